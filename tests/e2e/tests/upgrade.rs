//! Driver upgrades on the harness (docs/driver-upgrades.md): NVIDIA's per-node state machine
//! rolling a driver version bump over the fleet, with real evictions, PodDisruptionBudgets and
//! DaemonSet pod replacement. The operator runs on its generated ClusterRole, so every API call
//! an upgrade makes is proven allowed to the chart's identity.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use e2e::audit::AuditLog;
use e2e::chaos::CrashLoop;
use e2e::cluster::unique_name;
use e2e::nodes::{self, GpuModel};
use e2e::session::{self, Setup};
use e2e::wait;
use gpu_operator::api::State;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const STATE: &str = "nvidia.com/gpu-driver-upgrade-state";
const DRIVER: &str = "nvidia-driver-daemonset";
const ROLLOUT: Duration = Duration::from_secs(240);
/// States a node holds a parallel slot in (NVIDIA's "in progress", failed included).
const BETWEEN: [&str; 8] = [
    "cordon-required",
    "wait-for-jobs-required",
    "pod-deletion-required",
    "drain-required",
    "pod-restart-required",
    "validation-required",
    "uncordon-required",
    "upgrade-failed",
];

/// The driver version bump (repository, image and version go together).
fn bump() -> serde_json::Value {
    json!({"spec": {"driver": {"repository": "nvcr.io/nvidia", "image": "driver", "version": "600.10.01"}}})
}

/// A session whose operator runs on the generated ClusterRole (not cluster-admin), after the
/// nodes and workload namespaces a failed run left are cleaned; `None` where this run has no
/// test cluster (the test is skipped).
async fn start_on_generated_rbac(spec: serde_json::Value) -> Option<Setup> {
    let prepared = session::builder().prepare().await?;
    let admin = &prepared.admin;
    clean_nodes(admin).await;
    // Workloads a failed run left (their pods would come back on nodes of the same name).
    let namespaces = Api::<Namespace>::all(admin.clone());
    let left = ListParams::default().labels(&format!("{WORKLOADS}=true"));
    for ns in namespaces.list(&left).await.unwrap().items {
        let _ = namespaces
            .delete(&ns.name_any(), &DeleteParams::default())
            .await;
    }
    wait::until_none_left(
        &namespaces,
        &left,
        session::TIMEOUT,
        "old workload namespaces gone",
    )
    .await
    .unwrap();
    Some(prepared.start(spec).await)
}

/// Asks the API server whether the operator's identity may `verb` `resource` in `namespace`.
async fn allowed(
    admin: &Client,
    user: &str,
    namespace: &str,
    verb: &str,
    resource: &str,
    sub: Option<&str>,
) -> bool {
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(user.to_owned()),
            resource_attributes: Some(ResourceAttributes {
                verb: Some(verb.to_owned()),
                resource: Some(resource.to_owned()),
                subresource: sub.map(str::to_owned),
                namespace: Some(namespace.to_owned()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<SubjectAccessReview>::all(admin.clone())
        .create(&PostParams::default(), &review)
        .await
        .unwrap()
        .status
        .is_some_and(|s| s.allowed)
}

/// Every GPU node's upgrade state label and cordon.
async fn node_states(admin: &Client) -> BTreeMap<String, (String, bool)> {
    Api::<Node>::all(admin.clone())
        .list(&ListParams::default().labels("nvidia.com/gpu.present=true"))
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|n| {
            let state = n.labels().get(STATE).cloned().unwrap_or_default();
            let cordoned = n
                .spec
                .as_ref()
                .and_then(|s| s.unschedulable)
                .unwrap_or(false);
            (n.name_any(), (state, cordoned))
        })
        .collect()
}

/// The driver pod of each node (of any driver DaemonSet), by node.
async fn driver_pods(admin: &Client, namespace: &str) -> BTreeMap<String, Pod> {
    Api::<Pod>::namespaced(admin.clone(), namespace)
        .list(&ListParams::default().labels("app.kubernetes.io/component=nvidia-driver"))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| Some((p.spec.as_ref()?.node_name.clone()?, p)))
        .collect()
}

fn image(pod: &Pod) -> String {
    pod.spec
        .as_ref()
        .and_then(|s| s.containers.iter().find(|c| c.name == "nvidia-driver-ctr"))
        .and_then(|c| c.image.clone())
        .unwrap_or_default()
}

async fn cordon(admin: &Client, node: &str, on: bool) {
    Api::<Node>::all(admin.clone())
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"unschedulable": on}})),
        )
        .await
        .unwrap();
}

/// A bare pod pinned to `node` (kwok runs it).
fn workload(ns: &str, name: &str, node: &str, gpu: bool, runtime_class: bool, app: &str) -> Pod {
    let mut container = json!({"name": "work", "image": "registry.example/train:1"});
    if gpu {
        container["resources"] = json!({"limits": {"nvidia.com/gpu": "1"}});
    }
    let mut spec = json!({"nodeName": node, "containers": [container]});
    if runtime_class {
        spec["runtimeClassName"] = json!("nvidia");
    }
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": app}},
        "spec": spec
    }))
    .unwrap()
}

/// Label of the workload namespaces these tests make (removed again by the next test).
const WORKLOADS: &str = "gpu-operator.test/upgrade-workloads";

async fn ensure_namespace(admin: &Client, name: &str) {
    let ns: k8s_openapi::api::core::v1::Namespace =
        serde_json::from_value(json!({"metadata": {"name": name, "labels": {WORKLOADS: "true"}}}))
            .unwrap();
    match Api::<k8s_openapi::api::core::v1::Namespace>::all(admin.clone())
        .create(&PostParams::default(), &ns)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("creating namespace {name}: {e}"),
    }
}

/// Waits until every GPU node is `upgrade-done` with a driver pod on the current image (or,
/// for the nodes in `failed`, `upgrade-failed`).
async fn await_states(
    s: &Setup,
    done: &BTreeSet<String>,
    failed: &BTreeSet<String>,
    image_tag: &str,
    what: &str,
) {
    let admin = &s.admin;
    let ns = &s.identity.namespace;
    wait::until(ROLLOUT, what, || async move {
        let states = node_states(admin).await;
        let pods = driver_pods(admin, ns).await;
        let wrong: Vec<String> = states
            .iter()
            .filter(|(node, (state, _))| {
                if failed.contains(*node) {
                    state != "upgrade-failed"
                } else if done.contains(*node) {
                    state != "upgrade-done"
                        || !pods
                            .get(*node)
                            .is_some_and(|p| image(p).contains(image_tag))
                } else {
                    false
                }
            })
            .map(|(node, (state, _))| format!("{node}={state}"))
            .collect();
        Ok(if wrong.is_empty() {
            Ok(())
        } else {
            Err(wrong.join(", "))
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
}

/// Samples the nodes while the rollout runs: the most nodes seen at once that were cordoned by
/// the upgrade or between states (`exempt`: a node cordoned beforehand).
fn sample_concurrency(
    admin: Client,
    exempt: String,
) -> (Arc<Mutex<usize>>, tokio::task::JoinHandle<()>) {
    let most = Arc::new(Mutex::new(0usize));
    let seen = most.clone();
    let task = tokio::spawn(async move {
        loop {
            let busy = node_states(&admin)
                .await
                .iter()
                .filter(|(node, (state, cordoned))| {
                    **node != exempt && (*cordoned || BETWEEN.contains(&state.as_str()))
                })
                .count();
            {
                let mut m = seen.lock().unwrap();
                *m = (*m).max(busy);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    (most, task)
}

/// Removes what the upgrade left on the standard fleet (labels, annotations, cordons), so the
/// next test starts from plain nodes.
async fn clean_nodes(admin: &Client) {
    let api = Api::<Node>::all(admin.clone());
    for node in api.list(&ListParams::default()).await.unwrap().items {
        let annotations: serde_json::Map<String, serde_json::Value> = node
            .annotations()
            .keys()
            .filter(|k| k.contains("driver-upgrade"))
            .map(|k| (k.clone(), serde_json::Value::Null))
            .collect();
        let patch = json!({
            "metadata": {"labels": {STATE: null}, "annotations": annotations},
            "spec": {"unschedulable": null}
        });
        api.patch(
            &node.name_any(),
            &PatchParams::default(),
            &Patch::Merge(patch),
        )
        .await
        .unwrap();
    }
}

async fn teardown(s: Setup, extra_nodes: &[String]) {
    let admin = s.admin.clone();
    s.teardown().await;
    nodes::delete(&admin, extra_nodes).await.unwrap();
    clean_nodes(&admin).await;
}

#[tokio::test]
async fn driver_version_bump_upgrades_12_nodes_at_most_3_at_a_time_evicting_gpu_pods_and_honouring_a_pdb()
 {
    let spec = json!({"driver": {"upgradePolicy": {
        "autoUpgrade": true, "maxParallelUpgrades": 3, "maxUnavailable": "50%",
        "podDeletion": {"force": true, "timeoutSeconds": 60},
        "drain": {"enable": true, "force": true, "timeoutSeconds": 6}
    }}});
    let Some(s) = start_on_generated_rbac(spec).await else {
        return;
    };
    let admin = s.admin.clone();
    // The standard fleet's 6 GPU nodes and 6 more: 12.
    let extra: Vec<String> = (0..6).map(|i| format!("upg-t4-{i}")).collect();
    let fleet: Vec<_> = extra
        .iter()
        .map(|n| {
            let mut node = session::ephemeral_gpu_node(n, GpuModel::T4);
            node.advertise_gpus = true;
            node
        })
        .collect();
    nodes::create(&admin, &fleet).await.unwrap();
    s.await_state(State::Ready, "policy ready on 12 GPU nodes")
        .await;
    let before = driver_pods(&admin, &s.identity.namespace).await;
    assert_eq!(before.len(), 12, "{:?}", before.keys());
    // Upgrades on: every node is looked at and found current.
    let all: BTreeSet<String> = before.keys().cloned().collect();
    await_states(
        &s,
        &all,
        &BTreeSet::new(),
        "595.91.07",
        "every node upgrade-done before the bump",
    )
    .await;

    // The chart's identity may do what an upgrade does: evict workload pods anywhere, delete
    // driver and validator pods in its own namespace only.
    let user = s.identity.username();
    let own = s.identity.namespace.as_str();
    assert!(allowed(&admin, &user, "ml", "create", "pods", Some("eviction")).await);
    assert!(allowed(&admin, &user, own, "delete", "pods", None).await);
    assert!(!allowed(&admin, &user, "ml", "delete", "pods", None).await);

    // Workloads: a GPU-requesting pod, a RuntimeClass-only pod, a pod a PDB protects, and a
    // node cordoned by someone else.
    let ml = unique_name("ml");
    ensure_namespace(&admin, &ml).await;
    let pods = Api::<Pod>::namespaced(admin.clone(), &ml);
    for pod in [
        workload(&ml, "gpu-job", "upg-t4-0", true, false, "gpu-job"),
        workload(&ml, "rc-job", "upg-t4-1", false, true, "rc-job"),
        workload(&ml, "guarded", "upg-t4-2", false, false, "guarded"),
    ] {
        pods.create(&PostParams::default(), &pod).await.unwrap();
    }
    let pdb: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": {"name": "guarded", "namespace": ml},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}}
    }))
    .unwrap();
    let pdbs = Api::<PodDisruptionBudget>::namespaced(admin.clone(), &ml);
    pdbs.create(&PostParams::default(), &pdb).await.unwrap();
    wait::until(session::TIMEOUT, "PDB observed, workloads running", || {
        let (pdbs, pods) = (pdbs.clone(), pods.clone());
        async move {
            let status = pdbs.get("guarded").await?.status;
            let running = pods
                .list(&ListParams::default())
                .await?
                .items
                .iter()
                .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
                .count();
            Ok(match status {
                Some(st) if st.current_healthy == Some(1) && running == 3 => Ok(()),
                other => Err(format!("{other:?}, {running} running")),
            })
        }
    })
    .await
    .unwrap();
    cordon(&admin, "upg-t4-3", true).await;

    // The bump.
    let audit = AuditLog::from_env().unwrap();
    let mark = audit.mark().unwrap();
    let (most, sampler) = sample_concurrency(admin.clone(), "upg-t4-3".to_owned());
    s.patch_policy(bump()).await;
    let mut done = all.clone();
    done.remove("upg-t4-2");
    let failed = BTreeSet::from(["upg-t4-2".to_owned()]);
    await_states(
        &s,
        &done,
        &failed,
        "600.10.01",
        "11 nodes upgraded, the PDB's node failed",
    )
    .await;

    // The PDB held its node until the drain timeout, and status names it.
    let message = session::ready_message(&admin, &s.policy).await.unwrap();
    assert!(
        message.contains("11 of 12 nodes upgraded")
            && message.contains("1 failed: upg-t4-2: drain timed out after 6s")
            && message.contains(&format!("{ml}/guarded")),
        "{message}"
    );
    assert!(
        pods.get("guarded").await.is_ok(),
        "the PDB's pod was not evicted"
    );
    let events = audit.of_user_since(mark, &user).unwrap();
    let evictions = |pod: &str| {
        events
            .iter()
            .filter(|e| e.resource() == "pods/eviction" && e.name() == Some(pod))
            .map(|e| {
                (
                    e.received(),
                    e.response_status.as_ref().and_then(|s| s.code),
                )
            })
            .collect::<Vec<_>>()
    };
    // The PDB refuses each eviction (429); under load an attempt may also time out in the API
    // server (504), but none may succeed.
    let guarded = evictions("guarded");
    assert!(
        guarded.iter().any(|(_, code)| *code == Some(429))
            && !guarded
                .iter()
                .any(|(_, code)| code.is_some_and(|c| (200..300).contains(&c))),
        "{guarded:?}"
    );
    // Retried, and the node failed only once the drain timeout had passed. The timeout runs from
    // the drain-required write (the node's last patch before the first eviction) and the
    // machine counts whole seconds, so the failure comes more than 5 s after it. How many
    // attempts fit in that time depends on how fast passes run, which the test does not fix.
    assert!(guarded.len() >= 2, "one eviction attempt only: {guarded:?}");
    let node_patches: Vec<SystemTime> = events
        .iter()
        .filter(|e| e.verb == "patch" && e.resource() == "nodes" && e.name() == Some("upg-t4-2"))
        .map(|e| e.received())
        .collect();
    let (first_eviction, last_eviction) = (guarded[0].0, guarded[guarded.len() - 1].0);
    let drain_started = *node_patches
        .iter()
        .rfind(|t| **t < first_eviction)
        .expect("no node patch before the first eviction");
    let failed = *node_patches
        .iter()
        .find(|t| **t > last_eviction)
        .expect("no node patch after the last eviction");
    let held = failed.duration_since(drain_started).unwrap();
    assert!(
        held > Duration::from_secs(5),
        "the node failed {held:?} after its drain began (timeout 6 s)"
    );
    assert!(
        !events.iter().any(|e| e.verb == "delete"
            && e.name() == before.get("upg-t4-2").map(|p| p.name_any()).as_deref()),
        "the held node's driver pod must not be restarted"
    );

    // GPU pods (by resource and by RuntimeClass alone) were evicted before their node's driver
    // pod was deleted.
    for (pod, node) in [("gpu-job", "upg-t4-0"), ("rc-job", "upg-t4-1")] {
        let evicted = evictions(pod);
        let ok = evicted
            .iter()
            .find(|(_, code)| *code == Some(201))
            .unwrap_or_else(|| panic!("{pod} not evicted: {evicted:?}"));
        let old_driver = before[node].name_any();
        let deleted = events
            .iter()
            .find(|e| e.verb == "delete" && e.resource() == "pods" && e.name() == Some(&old_driver))
            .unwrap_or_else(|| panic!("driver pod {old_driver} of {node} not deleted"));
        assert!(
            ok.0 < deleted.received(),
            "{pod} evicted after the driver pod restarted"
        );
        assert!(pods.get_opt(pod).await.unwrap().is_none());
    }

    // Fixing the PDB's node: the budget removed and the node's upgrade retried.
    pdbs.delete("guarded", &DeleteParams::default())
        .await
        .unwrap();
    Api::<Node>::all(admin.clone())
        .patch(
            "upg-t4-2",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {STATE: null}}})),
        )
        .await
        .unwrap();
    await_states(
        &s,
        &all,
        &BTreeSet::new(),
        "600.10.01",
        "all 12 nodes upgraded",
    )
    .await;
    sampler.abort();
    let most = *most.lock().unwrap();
    assert!(most <= 3, "{most} nodes cordoned or between states at once");
    assert!(
        most >= 2,
        "the sampler saw only {most} at once: parallelism not exercised"
    );

    let states = node_states(&admin).await;
    assert!(
        states["upg-t4-3"].1,
        "a node cordoned beforehand stays cordoned"
    );
    let cordoned: Vec<&String> = states
        .iter()
        .filter(|(n, (_, c))| *c && *n != "upg-t4-3")
        .map(|(n, _)| n)
        .collect();
    assert!(cordoned.is_empty(), "left cordoned: {cordoned:?}");
    let after = driver_pods(&admin, &s.identity.namespace).await;
    for (node, pod) in &after {
        assert!(
            image(pod).ends_with("600.10.01-ubuntu22.04"),
            "{node}: {}",
            image(pod)
        );
        assert_ne!(
            pod.name_any(),
            before[node].name_any(),
            "{node}: driver pod not replaced"
        );
    }
    let metrics = e2e::operator::scrape_metrics(s.operator.metrics_port)
        .await
        .unwrap();
    assert!(
        metrics.contains("gpu_operator_nodes_upgrades_done 12"),
        "{metrics}"
    );
    assert!(
        metrics.contains("gpu_operator_driver_auto_upgrade_enabled 1"),
        "{metrics}"
    );
    teardown(s, &extra).await;
    let _ = Api::<Namespace>::all(admin.clone())
        .delete(&ml, &DeleteParams::default())
        .await;
}

#[tokio::test]
async fn a_node_whose_new_validator_never_gets_ready_fails_and_stops_the_rollout_until_fixed() {
    let spec = json!({"driver": {"upgradePolicy": {
        "autoUpgrade": true, "maxParallelUpgrades": 2, "maxUnavailable": 1
    }}});
    let Some(s) = start_on_generated_rbac(spec).await else {
        return;
    };
    let admin = s.admin.clone();
    s.await_state(State::Ready, "policy ready").await;
    let before = driver_pods(&admin, &s.identity.namespace).await;
    let all: BTreeSet<String> = before.keys().cloned().collect();
    await_states(
        &s,
        &all,
        &BTreeSet::new(),
        "595.91.07",
        "every node upgrade-done before the bump",
    )
    .await;
    // The first node by name upgrades first; its validator will crash-loop on the new driver.
    let broken = all.iter().next().unwrap().clone();
    let chaos = CrashLoop::start(&admin, &broken, "nvidia-operator-validator")
        .await
        .unwrap();

    s.patch_policy(bump()).await;
    let failed = BTreeSet::from([broken.clone()]);
    await_states(
        &s,
        &BTreeSet::new(),
        &failed,
        "600.10.01",
        "the broken node failed",
    )
    .await;
    // maxUnavailable 1 is spent on the failed (still cordoned) node: nothing else starts.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let states = node_states(&admin).await;
    assert!(states[&broken].1, "a failed node stays cordoned");
    let moved: Vec<String> = states
        .iter()
        .filter(|(n, (state, _))| **n != broken && state != "upgrade-required")
        .map(|(n, (state, _))| format!("{n}={state}"))
        .collect();
    assert!(
        moved.is_empty(),
        "the rollout went on past maxUnavailable: {moved:?}"
    );
    let policy = s
        .await_state(State::NotReady, "failed upgrade reported")
        .await;
    let message = session::ready_condition(&policy).unwrap().message.clone();
    assert!(
        message.contains(&format!("1 failed: {broken}: validator pod"))
            && message.contains("failing on the new driver"),
        "{message}"
    );

    // Fixed: the validator recovers, the node is released and the rollout resumes.
    chaos.recover().await.unwrap();
    await_states(
        &s,
        &all,
        &BTreeSet::new(),
        "600.10.01",
        "rollout resumed and finished",
    )
    .await;
    let states = node_states(&admin).await;
    assert!(states.values().all(|(_, cordoned)| !cordoned), "{states:?}");
    s.await_state(State::Ready, "ready after the upgrade").await;
    teardown(s, &[]).await;
}

#[tokio::test]
async fn ubuntu_22_04_and_24_04_gpu_nodes_get_one_driver_daemonset_each_and_an_unknown_os_is_reported()
 {
    let Some(s) = start_on_generated_rbac(json!({})).await else {
        return;
    };
    let admin = s.admin.clone();
    s.await_state(State::Ready, "policy ready on the Ubuntu 22.04 fleet")
        .await;
    let ns = s.identity.namespace.clone();
    let before = driver_pods(&admin, &ns).await;
    assert_eq!(before.len(), 6);

    let noble: Vec<String> = (0..2).map(|i| format!("noble-t4-{i}")).collect();
    let fleet: Vec<_> = noble
        .iter()
        .map(|n| session::ephemeral_gpu_node(n, GpuModel::T4).os("ubuntu", "24.04"))
        .collect();
    nodes::create(&admin, &fleet).await.unwrap();
    let daemonsets = s.daemonsets();
    let second_name = format!("{DRIVER}-ubuntu24.04");
    wait::until(
        session::TIMEOUT,
        "a driver DaemonSet per OS, pods available",
        || {
            let (daemonsets, second_name) = (daemonsets.clone(), second_name.clone());
            async move {
                let mut seen = Vec::new();
                for (name, want) in [(DRIVER.to_owned(), 6), (second_name, 2)] {
                    let status = daemonsets.get_opt(&name).await?.and_then(|d| d.status);
                    let (desired, available) = status
                        .map(|s| (s.desired_number_scheduled, s.number_available.unwrap_or(0)))
                        .unwrap_or((-1, -1));
                    if desired != want || available != want {
                        seen.push(format!("{name}: {desired} desired, {available} available"));
                    }
                }
                Ok(if seen.is_empty() {
                    Ok(())
                } else {
                    Err(seen.join("; "))
                })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    let main = daemonsets.get(DRIVER).await.unwrap();
    let second = daemonsets.get(&second_name).await.unwrap();
    for (ds, count, version) in [(&main, 6, "22.04"), (&second, 2, "24.04")] {
        assert_eq!(ds.status.as_ref().unwrap().desired_number_scheduled, count);
        let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        assert_eq!(
            pod.node_selector.as_ref().unwrap()["feature.node.kubernetes.io/system-os_release.VERSION_ID"],
            version
        );
    }
    let after = driver_pods(&admin, &ns).await;
    for node in &noble {
        assert!(
            image(&after[node]).ends_with("-ubuntu24.04"),
            "{node}: {}",
            image(&after[node])
        );
    }
    for (node, pod) in &before {
        assert!(image(&after[node]).ends_with("-ubuntu22.04"));
        // OnDelete: the existing nodes' driver pods were not restarted by the split.
        assert_eq!(
            after[node].name_any(),
            pod.name_any(),
            "{node}'s driver pod restarted"
        );
    }

    // A GPU node of an OS without a driver image gets none, and status names it.
    let odd = "flatcar-t4-0".to_owned();
    nodes::create(
        &admin,
        &[session::ephemeral_gpu_node(&odd, GpuModel::T4).os("flatcar", "3975.2.0")],
    )
    .await
    .unwrap();
    let want = "get no driver pod: flatcar-t4-0 (flatcar3975.2.0)";
    wait::until(session::TIMEOUT, "unknown OS reported", || {
        let (admin, policy) = (admin.clone(), s.policy.clone());
        async move {
            let p = session::policies(&admin).get(&policy).await?;
            let message = session::ready_condition(&p)
                .map(|c| c.message.clone())
                .unwrap_or_default();
            let not_ready = p.status.as_ref().map(|s| s.state) == Some(State::NotReady);
            Ok(if not_ready && message.contains(want) {
                Ok(())
            } else {
                Err(message)
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!driver_pods(&admin, &ns).await.contains_key(&odd));

    let mut extra = noble.clone();
    extra.push(odd);
    teardown(s, &extra).await;
}

/// Watches the GPU nodes and records every one seen cordoned (a watch sees each change, so a
/// brief cordon is not missed between samples).
fn record_cordons(admin: Client) -> (Arc<Mutex<BTreeSet<String>>>, tokio::task::JoinHandle<()>) {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let seen = Arc::new(Mutex::new(BTreeSet::new()));
    let record = seen.clone();
    let task = tokio::spawn(async move {
        let api = Api::<Node>::all(admin);
        let config = watcher::Config::default().labels("nvidia.com/gpu.present=true");
        let mut stream = watcher(api, config)
            .default_backoff()
            .applied_objects()
            .boxed();
        while let Some(item) = stream.next().await {
            let Ok(node) = item else { continue };
            if node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true) {
                record.lock().unwrap().insert(node.name_any());
            }
        }
    });
    (seen, task)
}

/// The driver DaemonSet's component message in the policy's status.
async fn driver_message(s: &Setup) -> String {
    session::policies(&s.admin)
        .get(&s.policy)
        .await
        .unwrap()
        .status
        .and_then(|st| st.components)
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.daemon_set.as_deref() == Some(DRIVER))
        .and_then(|c| c.message)
        .unwrap_or_default()
}

fn uids(pods: &BTreeMap<String, Pod>) -> BTreeMap<String, String> {
    pods.iter()
        .map(|(node, p)| (node.clone(), p.uid().unwrap_or_default()))
        .collect()
}

fn manager_image(pod: &Pod) -> String {
    pod.spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.name == "k8s-driver-manager"))
        .and_then(|c| c.image.clone())
        .unwrap_or_default()
}

#[tokio::test]
async fn relabelling_keeps_driver_pods_a_new_driver_manager_restarts_them_in_place_and_a_new_driver_drains()
 {
    let spec = json!({"driver": {"upgradePolicy": {
        "autoUpgrade": true, "maxParallelUpgrades": 3, "maxUnavailable": "100%",
        "podDeletion": {"force": true, "timeoutSeconds": 60}
    }}});
    let Some(s) = start_on_generated_rbac(spec).await else {
        return;
    };
    let admin = s.admin.clone();
    let ns = s.identity.namespace.clone();
    let user = s.identity.username();
    s.await_state(State::Ready, "policy ready").await;
    let before = driver_pods(&admin, &ns).await;
    let all: BTreeSet<String> = before.keys().cloned().collect();
    assert!(all.len() >= 2, "{all:?}");
    await_states(
        &s,
        &all,
        &BTreeSet::new(),
        "595.91.07",
        "every node upgrade-done",
    )
    .await;

    // A GPU job on one node: restarts in place leave it running, a new driver evicts it.
    let ml = unique_name("ml");
    ensure_namespace(&admin, &ml).await;
    let gpu_node = all.iter().next().unwrap().clone();
    let jobs = Api::<Pod>::namespaced(admin.clone(), &ml);
    let job = jobs
        .create(
            &PostParams::default(),
            &workload(&ml, "gpu-job", &gpu_node, true, false, "gpu-job"),
        )
        .await
        .unwrap();
    let (cordoned, watch) = record_cordons(admin.clone());
    let audit = AuditLog::from_env().unwrap();

    // 1. Pod metadata only: nothing restarted, no node touched, and status says so.
    let mark = audit.mark().unwrap();
    s.patch_policy(json!({"spec": {"daemonsets": {
        "labels": {"example.com/team": "ml"}, "annotations": {"example.com/owner": "platform"}
    }}}))
    .await;
    let count = all.len();
    let s_ref = &s;
    wait::until(
        ROLLOUT,
        "status names the pods with older metadata",
        || async move {
            let message = driver_message(s_ref).await;
            Ok(
                if message.contains(&format!(
                    "{count} pods run with older labels or annotations"
                )) {
                    Ok(())
                } else {
                    Err(message)
                },
            )
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    assert!(
        !driver_message(&s).await.contains("upgrade pending"),
        "no upgrade is pending"
    );
    let after = driver_pods(&admin, &ns).await;
    assert_eq!(uids(&after), uids(&before), "no driver pod restarted");
    let writes = audit.mutating_since(mark, &user).unwrap();
    let touched: Vec<String> = writes
        .iter()
        .filter(|e| {
            e.resource() == "nodes" || e.resource() == "pods" || e.resource() == "pods/eviction"
        })
        .map(|e| format!("{} {} {:?}", e.verb, e.resource(), e.name()))
        .collect();
    assert!(touched.is_empty(), "node or pod writes: {touched:?}");
    assert!(cordoned.lock().unwrap().is_empty());

    // 2. Another driver manager (what an operator upgrade brings): every driver pod replaced
    //    in place, no node cordoned, no GPU pod evicted.
    let mark = audit.mark().unwrap();
    s.patch_policy(json!({"spec": {"driver": {"manager": {
        "repository": "nvcr.io/nvidia/cloud-native", "image": "k8s-driver-manager", "version": "v0.99.0"
    }}}}))
    .await;
    let (admin_ref, ns_ref, before_ref) = (&admin, &ns, &before);
    wait::until(
        ROLLOUT,
        "every driver pod restarted with the new manager",
        || async move {
            let pods = driver_pods(admin_ref, ns_ref).await;
            let states = node_states(admin_ref).await;
            let waiting: Vec<String> = before_ref
                .iter()
                .filter(|(node, old)| {
                    !pods.get(*node).is_some_and(|p| {
                        p.uid() != old.uid()
                            && manager_image(p).ends_with(":v0.99.0")
                            && p.status
                                .as_ref()
                                .and_then(|st| st.conditions.as_ref())
                                .is_some_and(|cs| {
                                    cs.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                                })
                    }) || states.get(*node).map(|(st, _)| st.as_str()) != Some("upgrade-done")
                })
                .map(|(node, _)| node.clone())
                .collect();
            Ok(if waiting.is_empty() {
                Ok(())
            } else {
                Err(format!("waiting: {waiting:?}"))
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    let events = audit.of_user_since(mark, &user).unwrap();
    for (node, old) in &before {
        assert!(
            events.iter().any(|e| e.verb == "delete"
                && e.resource() == "pods"
                && e.name() == Some(old.name_any().as_str())),
            "{node}: the operator did not delete its driver pod"
        );
    }
    assert!(
        !events.iter().any(|e| e.resource() == "pods/eviction"),
        "no pod evicted"
    );
    assert_eq!(
        jobs.get("gpu-job").await.unwrap().uid(),
        job.uid(),
        "the GPU job kept running"
    );
    assert!(
        cordoned.lock().unwrap().is_empty(),
        "cordoned: {:?}",
        cordoned.lock().unwrap()
    );

    // 3. A new driver version still cordons every node and evicts the GPU job.
    s.patch_policy(bump()).await;
    await_states(
        &s,
        &all,
        &BTreeSet::new(),
        "600.10.01",
        "every node on the new driver",
    )
    .await;
    watch.abort();
    assert_eq!(
        *cordoned.lock().unwrap(),
        all,
        "every node cordoned for the new driver"
    );
    assert!(
        jobs.get_opt("gpu-job").await.unwrap().is_none(),
        "the GPU job was evicted"
    );
    let states = node_states(&admin).await;
    assert!(
        states.values().all(|(_, c)| !c),
        "uncordoned after: {states:?}"
    );
    teardown(s, &[]).await;
    let _ = Api::<Namespace>::all(admin.clone())
        .delete(&ml, &DeleteParams::default())
        .await;
}

/// The driver DaemonSet's live pod template.
async fn driver_template(s: &Setup) -> serde_json::Value {
    let ds = s.daemonsets().get(DRIVER).await.unwrap();
    serde_json::to_value(ds.spec.unwrap().template).unwrap()
}

const SIDECARS: [&str; 2] = ["nvidia-fs-ctr", "nvidia-gdrcopy-ctr"];

/// `template` without the GDS / GDRCopy sidecars and the env that tells of them (the flags and
/// the config digest, which follow them).
fn without_sidecars(mut template: serde_json::Value) -> serde_json::Value {
    let spec = &mut template["spec"];
    if let Some(containers) = spec["containers"].as_array_mut() {
        containers.retain(|c| !SIDECARS.contains(&c["name"].as_str().unwrap_or_default()));
    }
    for list in ["initContainers", "containers"] {
        for c in spec[list].as_array_mut().into_iter().flatten() {
            if let Some(env) = c["env"].as_array_mut() {
                env.retain(|e| {
                    !["GDS_ENABLED", "GDRCOPY_ENABLED", "DRIVER_CONFIG_DIGEST"]
                        .contains(&e["name"].as_str().unwrap_or_default())
                });
            }
        }
    }
    template
}

fn container_names(pod: &Pod) -> Vec<String> {
    pod.spec
        .iter()
        .flat_map(|s| s.containers.iter().map(|c| c.name.clone()))
        .collect()
}

/// Waits until every node in `nodes` runs a new driver pod (not in `old`) with exactly the
/// containers `want` and is `upgrade-done`.
async fn await_driver_pods(
    s: &Setup,
    old: &BTreeMap<String, Pod>,
    want: &[&str],
    what: &str,
) -> BTreeMap<String, Pod> {
    let (admin, ns) = (&s.admin, &s.identity.namespace);
    wait::until(ROLLOUT, what, || async move {
        let pods = driver_pods(admin, ns).await;
        let states = node_states(admin).await;
        let waiting: Vec<String> = old
            .iter()
            .filter(|(node, before)| {
                !pods
                    .get(*node)
                    .is_some_and(|p| p.uid() != before.uid() && container_names(p) == want)
                    || states.get(*node).map(|(st, _)| st.as_str()) != Some("upgrade-done")
            })
            .map(|(node, _)| node.clone())
            .collect();
        Ok(if waiting.is_empty() {
            Ok(())
        } else {
            Err(format!("waiting: {waiting:?}"))
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    driver_pods(admin, ns).await
}

#[tokio::test]
async fn gds_and_gdrcopy_switched_on_and_off_add_and_remove_only_their_sidecars_and_roll_the_drivers()
 {
    let spec = json!({"driver": {"upgradePolicy": {
        "autoUpgrade": true, "maxParallelUpgrades": 3, "maxUnavailable": "100%",
        "podDeletion": {"force": true, "timeoutSeconds": 60}
    }}});
    let Some(s) = start_on_generated_rbac(spec).await else {
        return;
    };
    let (admin, ns, user) = (
        s.admin.clone(),
        s.identity.namespace.clone(),
        s.identity.username(),
    );
    s.await_state(State::Ready, "policy ready").await;
    let all: BTreeSet<String> = driver_pods(&admin, &ns).await.keys().cloned().collect();
    assert!(all.len() >= 2, "{all:?}");
    await_states(
        &s,
        &all,
        &BTreeSet::new(),
        "595.91.07",
        "every node upgrade-done",
    )
    .await;
    let original = driver_template(&s).await;
    let before = driver_pods(&admin, &ns).await;
    let audit = AuditLog::from_env().unwrap();

    // On: the two sidecars and their flags, nothing else of the template changes, and the
    // upgrade controller replaces every driver pod (the DaemonSet is OnDelete).
    let mark = audit.mark().unwrap();
    s.patch_policy(json!({"spec": {"gds": {"enabled": true}, "gdrcopy": {"enabled": true}}}))
        .await;
    let s_ref = &s;
    let with = wait::until(
        ROLLOUT,
        "driver template has both sidecars",
        || async move {
            let t = driver_template(s_ref).await;
            let names: Vec<&str> = t["spec"]["containers"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| c["name"].as_str())
                .collect();
            Ok(
                if names == ["nvidia-driver-ctr", SIDECARS[0], SIDECARS[1]] {
                    Ok(t)
                } else {
                    Err(format!("{names:?}"))
                },
            )
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    assert_eq!(
        without_sidecars(with.clone()),
        without_sidecars(original.clone()),
        "only the sidecars and their env differ"
    );
    let main = &with["spec"]["containers"][0];
    for flag in ["GDS_ENABLED", "GDRCOPY_ENABLED"] {
        assert!(
            main["env"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["name"] == flag && e["value"] == "true"),
            "{flag} on the driver container"
        );
    }
    let os = image(before.values().next().unwrap());
    let os = os.rsplit('-').next().unwrap();
    assert_eq!(
        with["spec"]["containers"][1]["image"],
        format!("nvcr.io/nvidia/cloud-native/nvidia-fs:2.29.4-{os}")
    );
    let on = await_driver_pods(
        &s,
        &before,
        &["nvidia-driver-ctr", SIDECARS[0], SIDECARS[1]],
        "every driver pod replaced with the sidecars",
    )
    .await;
    let events = audit.of_user_since(mark, &user).unwrap();
    for (node, old) in &before {
        assert!(
            events.iter().any(|e| e.verb == "delete"
                && e.resource() == "pods"
                && e.name() == Some(old.name_any().as_str())),
            "{node}: the upgrade controller did not replace its driver pod"
        );
    }

    // Off again: the live template is the original one, field for field, and the pods go back.
    s.patch_policy(json!({"spec": {"gds": {"enabled": false}, "gdrcopy": null}}))
        .await;
    let original_ref = &original;
    wait::until(
        ROLLOUT,
        "driver template back to the original",
        || async move {
            let t = driver_template(s_ref).await;
            Ok(if &t == original_ref {
                Ok(())
            } else {
                Err(json_diff(original_ref, &t))
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    await_driver_pods(
        &s,
        &on,
        &["nvidia-driver-ctr"],
        "every driver pod replaced without the sidecars",
    )
    .await;
    teardown(s, &[]).await;
}

/// The container names and env of a template, for a failure message.
fn json_diff(want: &serde_json::Value, got: &serde_json::Value) -> String {
    let brief = |t: &serde_json::Value| {
        t["spec"]["containers"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| format!("{} env={}", c["name"], c["env"]))
            .collect::<Vec<_>>()
            .join("; ")
    };
    format!("want {}\ngot  {}", brief(want), brief(got))
}

/// kwok Stages standing in for the kubelet's image pulls (kwok runs every pod whatever its
/// image); every one this file makes is named with this prefix and removed at the end.
const PULL_STAGE_PREFIX: &str = "e2e-pull-";
/// The simulated time one pull of a new driver image takes.
const PULL_DELAY: Duration = Duration::from_secs(10);

fn kwok_stages(admin: &Client) -> Api<kube::api::DynamicObject> {
    let gvk = kube::core::GroupVersionKind::gvk("kwok.x-k8s.io", "v1alpha1", "Stage");
    Api::all_with(admin.clone(), &kube::core::ApiResource::from_gvk(&gvk))
}

/// kwok's `pod-ready` status (kustomize/stage/pod/fast/pod-ready.yaml), trimmed of pod IPs:
/// what a pod shows once its images are pulled and its containers run.
const READY_STATUS: &str = r#"
{{ $now := Now }}
conditions:
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: Initialized
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: Ready
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: ContainersReady
containerStatuses:
{{ range .spec.containers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: true
  started: true
  restartCount: 0
  state:
    running:
      startedAt: {{ $now | Quote }}
{{ end }}
initContainerStatuses:
{{ range .spec.initContainers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: true
  restartCount: 0
  state:
    terminated:
      exitCode: 0
      finishedAt: {{ $now | Quote }}
      reason: Completed
      startedAt: {{ $now | Quote }}
{{ end }}
phase: Running
startTime: {{ $now | Quote }}
"#;

/// A Stage that keeps a new pod pending for [`PULL_DELAY`] before it runs: the pull of an image
/// the node does not have. `selector` narrows it to the pods that pull.
fn pull_delay_stage(name: &str, selector: serde_json::Value) -> serde_json::Value {
    let mut expressions = vec![
        json!({"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"}),
        json!({"key": ".status.phase", "operator": "In", "values": ["Pending"]}),
        json!({"key": ".status.conditions.[] | select( .type == \"Ready\" ) | .status",
            "operator": "NotIn", "values": ["True"]}),
    ];
    expressions.extend(selector.as_array().cloned().unwrap_or_default());
    json!({
        "apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage",
        "metadata": {"name": format!("{PULL_STAGE_PREFIX}{name}")},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
            "selector": {"matchExpressions": expressions},
            "weight": 100000,
            "delay": {"durationMilliseconds": PULL_DELAY.as_secs() * 1000},
            "next": {"statusTemplate": READY_STATUS}
        }
    })
}

/// A Stage that reports the pull of `image` failing, as a kubelet does for a tag the registry
/// does not have: the container waits in ErrImagePull, the pod's other containers run. Its
/// phase reads Running (a kubelet's says Pending) so that kwok's `pod-ready` stage, which
/// takes every Pending pod, leaves it alone; the operator reads the containers' states only.
fn missing_image_stage(image: &str) -> serde_json::Value {
    let template = format!(
        r#"
{{{{ $now := Now }}}}
conditions:
- lastTransitionTime: {{{{ $now | Quote }}}}
  status: "True"
  type: Initialized
- lastTransitionTime: {{{{ $now | Quote }}}}
  status: "False"
  reason: ContainersNotReady
  type: Ready
containerStatuses:
{{{{ range .spec.containers }}}}
- image: {{{{ .image | Quote }}}}
  name: {{{{ .name | Quote }}}}
  restartCount: 0
{{{{ if eq .image "{image}" }}}}
  ready: false
  started: false
  state:
    waiting:
      reason: ErrImagePull
      message: 'rpc error: code = NotFound desc = failed to pull and unpack image "{image}": not found'
{{{{ else }}}}
  ready: true
  started: true
  state:
    running:
      startedAt: {{{{ $now | Quote }}}}
{{{{ end }}}}
{{{{ end }}}}
phase: Running
"#
    );
    json!({
        "apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage",
        "metadata": {"name": format!("{PULL_STAGE_PREFIX}missing")},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
            "selector": {"matchExpressions": [
                {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
                {"key": ".spec.containers.[].image", "operator": "In", "values": [image]},
                {"key": ".status.containerStatuses.[].state.waiting.reason", "operator": "NotIn",
                    "values": ["ErrImagePull"]}
            ]},
            "weight": 100000,
            "next": {"statusTemplate": template}
        }
    })
}

async fn add_stages(admin: &Client, stages: &[serde_json::Value]) {
    let api = kwok_stages(admin);
    for stage in stages {
        let object: kube::api::DynamicObject = serde_json::from_value(stage.clone()).unwrap();
        api.create(&PostParams::default(), &object).await.unwrap();
    }
}

/// Removes every Stage this file made (also those a failed run left).
async fn remove_pull_stages(admin: &Client) {
    let api = kwok_stages(admin);
    for stage in api.list(&ListParams::default()).await.unwrap().items {
        let name = stage.name_any();
        if name.starts_with(PULL_STAGE_PREFIX) {
            let _ = api.delete(&name, &DeleteParams::default()).await;
        }
    }
}

fn ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Per node, how long it ran no driver: from the moment its driver pod of `old` (by uid) was
/// seen deleted to the moment a new driver pod there was seen Ready (a watch sees each
/// change as it happens).
type Downtimes = Arc<Mutex<BTreeMap<String, (Option<tokio::time::Instant>, Option<Duration>)>>>;

fn record_downtime(
    admin: Client,
    namespace: String,
    old: BTreeMap<String, String>,
) -> (Downtimes, tokio::task::JoinHandle<()>) {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let seen: Downtimes = Arc::default();
    let record = seen.clone();
    let task = tokio::spawn(async move {
        let api = Api::<Pod>::namespaced(admin, &namespace);
        let config = watcher::Config::default().labels("app.kubernetes.io/component=nvidia-driver");
        let mut stream = watcher(api, config)
            .default_backoff()
            .touched_objects()
            .boxed();
        while let Some(item) = stream.next().await {
            let Ok(pod) = item else { continue };
            let now = tokio::time::Instant::now();
            let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) else {
                continue;
            };
            let uid = pod.uid().unwrap_or_default();
            let mut seen = record.lock().unwrap();
            let entry = seen.entry(node.clone()).or_default();
            if old.get(&node) == Some(&uid) {
                if pod.metadata.deletion_timestamp.is_some() && entry.0.is_none() {
                    entry.0 = Some(now);
                }
            } else if ready(&pod)
                && entry.1.is_none()
                && let Some(deleted) = entry.0
            {
                entry.1 = Some(now - deleted);
            }
        }
    });
    (seen, task)
}

fn mean(values: &[Duration]) -> Duration {
    values.iter().sum::<Duration>() / u32::try_from(values.len().max(1)).unwrap()
}

/// The Events the operator published about `node` with `reason`.
async fn node_events(admin: &Client, node: &str, reason: &str) -> Vec<String> {
    Api::<k8s_openapi::api::events::v1::Event>::all(admin.clone())
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| {
            e.reason.as_deref() == Some(reason)
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(node)
        })
        .map(|e| e.note.unwrap_or_default())
        .collect()
}

#[tokio::test]
async fn pre_pull_holds_the_os_pool_whose_new_driver_image_is_missing_upgrades_the_other_and_a_fixed_tag_resumes()
 {
    let spec = json!({"driver": {"upgradePolicy": {
        "autoUpgrade": true, "maxParallelUpgrades": 3, "maxUnavailable": "100%",
        "podDeletion": {"force": true, "timeoutSeconds": 60}
    }}});
    let Some(s) = start_on_generated_rbac(spec).await else {
        return;
    };
    let admin = s.admin.clone();
    let ns = s.identity.namespace.clone();
    remove_pull_stages(&admin).await;
    s.await_state(State::Ready, "policy ready on the Ubuntu 22.04 fleet")
        .await;

    // Two Ubuntu 24.04 GPU nodes beside the standard fleet's six 22.04 ones: two driver pools.
    let noble: Vec<String> = (0..2).map(|i| format!("noble-pp-{i}")).collect();
    let fleet: Vec<_> = noble
        .iter()
        .map(|n| session::ephemeral_gpu_node(n, GpuModel::T4).os("ubuntu", "24.04"))
        .collect();
    nodes::create(&admin, &fleet).await.unwrap();
    let all: BTreeSet<String> = wait::until(
        session::TIMEOUT,
        "a driver pod on each of the 8 GPU nodes",
        || {
            let (admin, ns) = (admin.clone(), ns.clone());
            async move {
                let pods = driver_pods(&admin, &ns).await;
                let ready_nodes: BTreeSet<String> = pods
                    .iter()
                    .filter(|(_, p)| ready(p))
                    .map(|(n, _)| n.clone())
                    .collect();
                Ok(if ready_nodes.len() == 8 {
                    Ok(ready_nodes)
                } else {
                    Err(format!("{ready_nodes:?}"))
                })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    await_states(
        &s,
        &all,
        &BTreeSet::new(),
        "595.91.07",
        "every node upgrade-done before the bump",
    )
    .await;
    let before = driver_pods(&admin, &ns).await;
    let jammy: Vec<String> = all.iter().filter(|n| !noble.contains(n)).cloned().collect();

    // The new version exists for Ubuntu 22.04 (a pull takes PULL_DELAY) but not for 24.04.
    // Half of the 22.04 nodes keep no image between pulls: their driver pod pulls again after
    // the pre-pull, as every node would without one.
    let missing = "nvcr.io/nvidia/driver:600.10.01-ubuntu24.04";
    let jammy_image = "nvcr.io/nvidia/driver:600.10.01-ubuntu22.04";
    let (without, with): (Vec<String>, Vec<String>) =
        jammy.iter().cloned().partition(|n| !n.contains("tainted"));
    add_stages(
        &admin,
        &[
            missing_image_stage(missing),
            pull_delay_stage(
                "prepull",
                json!([
                    {"key": ".metadata.labels[\"app.kubernetes.io/component\"]", "operator": "In",
                        "values": ["nvidia-driver-prepull"]},
                    {"key": ".spec.containers.[].image", "operator": "In", "values": [jammy_image]}
                ]),
            ),
            pull_delay_stage(
                "driver-uncached",
                json!([
                    {"key": ".metadata.labels[\"app.kubernetes.io/component\"]", "operator": "In",
                        "values": ["nvidia-driver"]},
                    {"key": ".spec.nodeName", "operator": "In", "values": without.clone()},
                    {"key": ".spec.containers.[].image", "operator": "In", "values": [jammy_image]}
                ]),
            ),
        ],
    )
    .await;

    let (cordoned, cordon_watch) = record_cordons(admin.clone());
    let old_uids: BTreeMap<String, String> = before
        .iter()
        .map(|(n, p)| (n.clone(), p.uid().unwrap_or_default()))
        .collect();
    let (downtime, downtime_watch) = record_downtime(admin.clone(), ns.clone(), old_uids);
    let started = std::time::Instant::now();
    s.patch_policy(bump()).await;
    let jammy_set: BTreeSet<String> = jammy.iter().cloned().collect();
    await_states(
        &s,
        &jammy_set,
        &BTreeSet::new(),
        "600.10.01",
        "the 22.04 pool upgraded",
    )
    .await;
    let rollout = started.elapsed();
    let second = s
        .daemonsets()
        .get(&format!("{DRIVER}-ubuntu24.04"))
        .await
        .unwrap();
    assert_eq!(
        image_of_template(&second),
        missing,
        "the stage declares the tag the 24.04 pool's DaemonSet asks for"
    );

    // The 24.04 pool is held with its drivers, and status says why, naming tag and nodes.
    let want = format!(
        "{missing} cannot be pulled on {}, {} (ErrImagePull",
        noble[0], noble[1]
    );
    let s_ref = &s;
    wait::until(session::TIMEOUT, "status names the held pool", || {
        let want = want.clone();
        async move {
            let message = session::ready_message(&s_ref.admin, &s_ref.policy).await?;
            Ok(
                if message.contains(&want) && message.contains("held before the cordon") {
                    Ok(())
                } else {
                    Err(message)
                },
            )
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    s.await_state(State::NotReady, "a held pool is reported")
        .await;
    let states = node_states(&admin).await;
    let now_pods = driver_pods(&admin, &ns).await;
    for node in &noble {
        assert_eq!(states[node].0, "upgrade-required", "{node}: {states:?}");
        assert!(!states[node].1, "{node} cordoned");
        assert_eq!(
            now_pods[node].uid(),
            before[node].uid(),
            "{node}'s driver pod replaced"
        );
        assert!(image(&now_pods[node]).ends_with("595.91.07-ubuntu24.04"));
        assert!(
            !node_events(&admin, node, "DriverUpgradeHeld")
                .await
                .is_empty(),
            "{node}: no DriverUpgradeHeld event"
        );
    }
    let held_cordons: Vec<String> = cordoned
        .lock()
        .unwrap()
        .iter()
        .filter(|n| noble.contains(n))
        .cloned()
        .collect();
    assert!(
        held_cordons.is_empty(),
        "held nodes cordoned: {held_cordons:?}"
    );
    assert_eq!(
        cordoned
            .lock()
            .unwrap()
            .iter()
            .filter(|n| jammy_set.contains(*n))
            .count(),
        jammy.len(),
        "every 22.04 node went through the upgrade"
    );

    // Per-node downtime (driver pod deleted to new driver pod Ready).
    downtime_watch.abort();
    let downtime = downtime.lock().unwrap().clone();
    let of = |nodes: &[String]| -> Vec<Duration> {
        nodes
            .iter()
            .map(|n| {
                downtime
                    .get(n)
                    .and_then(|d| d.1)
                    .unwrap_or_else(|| panic!("{n}: no downtime recorded: {downtime:?}"))
            })
            .collect()
    };
    let (with_times, without_times) = (of(&with), of(&without));
    println!(
        "driver downtime per node with a {}s pull: with the pre-pull {:?} (mean {:.1}s), \
         pulling after the driver pod's deletion {:?} (mean {:.1}s); 22.04 pool rollout {:.1}s",
        PULL_DELAY.as_secs(),
        with_times,
        mean(&with_times).as_secs_f64(),
        without_times,
        mean(&without_times).as_secs_f64(),
        rollout.as_secs_f64()
    );
    assert!(
        with_times.iter().all(|d| *d < PULL_DELAY),
        "a pre-pulled node waited for a pull: {with_times:?}"
    );
    assert!(
        without_times.iter().all(|d| *d >= PULL_DELAY),
        "the pull is not in the downtime: {without_times:?}"
    );

    // The tag fixed (a version that exists for both OSes): the held pool resumes; the 22.04
    // pool moves to it too.
    s.patch_policy(json!({"spec": {"driver": {"version": "600.10.02"}}}))
        .await;
    await_states(
        &s,
        &all,
        &BTreeSet::new(),
        "600.10.02",
        "both pools on the fixed version",
    )
    .await;
    cordon_watch.abort();
    for node in &noble {
        assert!(
            cordoned.lock().unwrap().contains(node),
            "{node} upgraded without a cordon"
        );
        assert!(
            !node_events(&admin, node, "DriverUpgradeHoldLifted")
                .await
                .is_empty(),
            "{node}: no DriverUpgradeHoldLifted event"
        );
    }
    s.await_state(State::Ready, "ready after the fixed rollout")
        .await;
    // The rollout is done: no pre-pull DaemonSet is left, nor a held annotation.
    let daemonsets = s.daemonsets();
    wait::until(session::TIMEOUT, "pre-pull DaemonSets deleted", || {
        let daemonsets = daemonsets.clone();
        async move {
            let left: Vec<String> = daemonsets
                .list(
                    &ListParams::default()
                        .labels("app.kubernetes.io/component=nvidia-driver-prepull"),
                )
                .await?
                .items
                .iter()
                .map(|d| d.name_any())
                .collect();
            Ok(if left.is_empty() {
                Ok(())
            } else {
                Err(format!("{left:?}"))
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    let annotated: Vec<String> = Api::<Node>::all(admin.clone())
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .filter(|n| {
            n.annotations()
                .contains_key("nvidia.com/gpu-operator.driver-upgrade-held")
        })
        .map(|n| n.name_any())
        .collect();
    assert!(annotated.is_empty(), "still marked held: {annotated:?}");
    remove_pull_stages(&admin).await;
    teardown(s, &noble).await;
}

/// The image of a driver DaemonSet's driver container.
fn image_of_template(ds: &k8s_openapi::api::apps::v1::DaemonSet) -> String {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.containers.iter().find(|c| c.name == "nvidia-driver-ctr"))
        .and_then(|c| c.image.clone())
        .unwrap_or_default()
}
