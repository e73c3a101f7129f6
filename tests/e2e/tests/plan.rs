//! `gpu-operator plan` on the harness (docs/plan.md): each plan is made by a ServiceAccount that
//! may only read and dry-run ClusterPolicies, then the policy is applied and what the plan
//! predicted (the DaemonSets whose pods roll, the objects written, the cordons, evictions and
//! waves of a driver rollout, the node labels) is compared with what the audit log and the nodes
//! show happened. Every plan writes nothing but dry-run requests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use e2e::audit::{AuditLog, Mark};
use e2e::cluster::{service_account_token, unique_name};
use e2e::session::{self, Setup, TIMEOUT};
use e2e::{nodes, wait};
use gpu_operator::api::State;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

const STATE: &str = "nvidia.com/gpu-driver-upgrade-state";
const ROLLOUT: Duration = Duration::from_secs(300);
/// Label of the workload namespaces these tests make.
const WORKLOADS: &str = "gpu-operator.test/plan-workloads";

/// Who makes the plans: a ServiceAccount that may read everything and create or update
/// ClusterPolicies (the dry runs); its kubeconfig and audit username.
struct Planner {
    kubeconfig: PathBuf,
    user: String,
    role: String,
}

impl Planner {
    async fn new(admin: &Client, namespace: &str) -> Planner {
        let name = "planner";
        let role = unique_name("plan-reader");
        let sa: ServiceAccount =
            serde_json::from_value(json!({"metadata": {"name": name, "namespace": namespace}}))
                .unwrap();
        Api::<ServiceAccount>::namespaced(admin.clone(), namespace)
            .create(&PostParams::default(), &sa)
            .await
            .unwrap();
        let cluster_role: ClusterRole = serde_json::from_value(json!({
            "metadata": {"name": role},
            "rules": [
                {"apiGroups": ["*"], "resources": ["*"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": ["nvidia.com"], "resources": ["clusterpolicies"], "verbs": ["create", "update"]}
            ]
        }))
        .unwrap();
        Api::<ClusterRole>::all(admin.clone())
            .create(&PostParams::default(), &cluster_role)
            .await
            .unwrap();
        let binding: ClusterRoleBinding = serde_json::from_value(json!({
            "metadata": {"name": role},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]
        }))
        .unwrap();
        Api::<ClusterRoleBinding>::all(admin.clone())
            .create(&PostParams::default(), &binding)
            .await
            .unwrap();
        let token = service_account_token(admin, namespace, name).await.unwrap();
        Planner {
            kubeconfig: e2e::operator::write_token_kubeconfig(&role, &token).unwrap(),
            user: e2e::audit::service_account_user(namespace, name),
            role,
        }
    }

    /// `gpu-operator plan -o json` for `policy`; also returns the text output.
    fn plan(&self, namespace: &str, policy: &Value) -> (Value, String) {
        let file = std::env::temp_dir().join(format!("{}.json", unique_name("plan")));
        std::fs::write(&file, serde_json::to_vec(policy).unwrap()).unwrap();
        let run = |output: &str| {
            let out = Command::new(e2e::operator::binary().unwrap())
                .args(["plan", "-f"])
                .arg(&file)
                .args(["-n", namespace, "-o", output, "--kubeconfig"])
                .arg(&self.kubeconfig)
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(out.status.success(), "plan failed: {stderr}\n{stdout}");
            stdout
        };
        let json: Value = serde_json::from_str(&run("json")).unwrap();
        let text = run("text");
        eprintln!("plan:\n{text}");
        (json, text)
    }

    /// The planner's requests since `mark`: none may change anything (a dry run stores nothing).
    fn assert_no_write(&self, audit: &AuditLog, mark: Mark) -> usize {
        let events = audit.of_user_since(mark, &self.user).unwrap();
        assert!(
            !events.is_empty(),
            "the planner's requests are in the audit log"
        );
        let writes: Vec<String> = events
            .iter()
            .filter(|e| e.is_mutating() && !e.request_uri.contains("dryRun=All"))
            .map(ToString::to_string)
            .collect();
        assert!(writes.is_empty(), "the plan wrote: {writes:?}");
        events.len()
    }

    async fn remove(self, admin: &Client) {
        let _ = Api::<ClusterRoleBinding>::all(admin.clone())
            .delete(&self.role, &DeleteParams::default())
            .await;
        let _ = Api::<ClusterRole>::all(admin.clone())
            .delete(&self.role, &DeleteParams::default())
            .await;
    }
}

/// The live policy with `patch` merged in (RFC 7386), as a user's file would hold it.
async fn edited_policy(s: &Setup, patch: &Value) -> Value {
    let live = session::policies(&s.admin).get(&s.policy).await.unwrap();
    let mut policy = json!({
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "metadata": {"name": live.name_any()},
        "spec": serde_json::to_value(&live.spec).unwrap(),
    });
    merge(&mut policy, patch);
    policy
}

fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

/// Applies the file the plan read (the test's stand-in for `kubectl apply -f`).
async fn apply(s: &Setup, policy: &Value) {
    s.patch_policy(json!({"spec": policy["spec"]})).await;
}

/// Each operand DaemonSet's pods in `namespace`, by DaemonSet name: their uids. The audit
/// log leaves out the controller manager's requests (tests/cluster/manifests/audit-policy.yaml),
/// so a roll is seen by its pods.
async fn daemon_set_pods(admin: &Client, namespace: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for pod in Api::<Pod>::namespaced(admin.clone(), namespace)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
    {
        let Some(owner) = pod
            .owner_references()
            .iter()
            .find(|o| o.kind == "DaemonSet")
        else {
            continue;
        };
        out.entry(owner.name.clone())
            .or_default()
            .insert(pod.uid().unwrap_or_default());
    }
    out
}

/// The DaemonSets whose pods were replaced between two readings, with how many went.
fn replaced(
    before: &BTreeMap<String, BTreeSet<String>>,
    after: &BTreeMap<String, BTreeSet<String>>,
) -> BTreeMap<String, usize> {
    before
        .iter()
        .filter_map(|(ds, pods)| {
            let now = after.get(ds)?;
            let gone = pods.difference(now).count();
            (gone > 0).then(|| (ds.clone(), gone))
        })
        .collect()
}

/// The plan's `pods-roll` DaemonSets that have pods, with the node count it gives.
fn planned_rolls(plan: &Value) -> BTreeMap<String, usize> {
    plan["rollouts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["outcome"] == "pods-roll" && r["nodes"].as_u64() != Some(0))
        .map(|r| {
            (
                r["daemonSet"].as_str().unwrap().to_owned(),
                usize::try_from(r["nodes"].as_u64().unwrap()).unwrap(),
            )
        })
        .collect()
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect()
}

async fn gpu_node_names(admin: &Client) -> Vec<String> {
    let mut names: Vec<String> = nodes::marked_gpu_nodes(admin)
        .await
        .unwrap()
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    names.sort();
    names
}

/// Removes what a driver rollout left on the nodes and the workload namespaces of a failed run.
async fn clean(admin: &Client) {
    let api = Api::<Node>::all(admin.clone());
    for node in api.list(&ListParams::default()).await.unwrap().items {
        let annotations: serde_json::Map<String, Value> = node
            .annotations()
            .keys()
            .filter(|k| k.contains("driver-upgrade"))
            .map(|k| (k.clone(), Value::Null))
            .collect();
        let patch = json!({
            "metadata": {"labels": {STATE: null}, "annotations": annotations},
            "spec": {"unschedulable": null}
        });
        api.patch(
            &node.name_any(),
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(patch),
        )
        .await
        .unwrap();
    }
    let namespaces = Api::<Namespace>::all(admin.clone());
    let left = ListParams::default().labels(&format!("{WORKLOADS}=true"));
    for ns in namespaces.list(&left).await.unwrap().items {
        let _ = namespaces
            .delete(&ns.name_any(), &DeleteParams::default())
            .await;
    }
    wait::until_none_left(&namespaces, &left, TIMEOUT, "old workload namespaces gone")
        .await
        .unwrap();
}

/// A bare pod pinned to `node` (kwok runs it); with `gpu`, it requests one.
fn workload(ns: &str, name: &str, node: &str, gpu: bool) -> Pod {
    let mut container = json!({"name": "work", "image": "registry.example/train:1"});
    if gpu {
        container["resources"] = json!({"limits": {"nvidia.com/gpu": "1"}});
    }
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": name}},
        "spec": {"nodeName": node, "containers": [container]}
    }))
    .unwrap()
}

/// Waits until every GPU node is upgrade-done with a driver pod running `tag`.
async fn await_upgraded(s: &Setup, tag: &str, what: &str) {
    let (admin, ns) = (s.admin.clone(), s.identity.namespace.clone());
    wait::until(ROLLOUT, what, || {
        let (admin, ns) = (admin.clone(), ns.clone());
        async move {
            let names = gpu_node_names(&admin).await;
            let nodes = Api::<Node>::all(admin.clone());
            let pods = Api::<Pod>::namespaced(admin.clone(), &ns)
                .list(&ListParams::default().labels("app.kubernetes.io/component=nvidia-driver"))
                .await?
                .items;
            for name in &names {
                let node = nodes.get(name).await?;
                let state = node.labels().get(STATE).cloned().unwrap_or_default();
                let on_tag = pods.iter().any(|p| {
                    p.metadata.deletion_timestamp.is_none()
                        && p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(name)
                        && p.spec.as_ref().is_some_and(|s| {
                            s.containers
                                .iter()
                                .any(|c| c.image.as_deref().is_some_and(|i| i.contains(tag)))
                        })
                });
                if state != "upgrade-done" || !on_tag {
                    return Ok(Err(format!("{name}: {state}, driver on {tag}: {on_tag}")));
                }
            }
            Ok(Ok(()))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
}

/// When each node was first seen cordoned, and the most seen cordoned at once.
type Cordons = (BTreeMap<String, Instant>, usize);

/// Samples every node's cordon every 50 ms: when each was first seen cordoned, and the most
/// seen cordoned at once.
fn sample_cordons(admin: Client) -> (Arc<Mutex<Cordons>>, tokio::task::JoinHandle<()>) {
    let seen = Arc::new(Mutex::new((BTreeMap::new(), 0)));
    let task = tokio::spawn({
        let seen = seen.clone();
        async move {
            let api = Api::<Node>::all(admin);
            loop {
                if let Ok(list) = api.list(&ListParams::default()).await {
                    let now = Instant::now();
                    let cordoned: Vec<String> = list
                        .items
                        .iter()
                        .filter(|n| n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true))
                        .map(ResourceExt::name_any)
                        .collect();
                    let mut seen = seen.lock().unwrap();
                    seen.1 = seen.1.max(cordoned.len());
                    for name in cordoned {
                        seen.0.entry(name).or_insert(now);
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    });
    (seen, task)
}

#[tokio::test]
async fn a_driver_bump_plan_predicts_the_rollouts_cordons_evictions_and_waves_that_happen() {
    let Some(prepared) = session::builder().prepare().await else {
        return;
    };
    clean(&prepared.admin).await;
    let s = prepared
        .start(json!({"driver": {"upgradePolicy": {
            "autoUpgrade": true, "maxParallelUpgrades": 2, "maxUnavailable": "100%",
            "podDeletion": {"force": true, "timeoutSeconds": 60},
            "drain": {"enable": true, "force": true, "timeoutSeconds": 60}
        }}}))
        .await;
    let admin = s.admin.clone();
    let ns = s.identity.namespace.clone();
    s.await_state(State::Ready, "policy ready").await;
    await_upgraded(&s, "595.91.07", "every node upgrade-done before the plan").await;

    // Workloads: a GPU pod on each of the first two GPU nodes, a CPU pod on the third.
    let gpu_nodes = gpu_node_names(&admin).await;
    assert_eq!(gpu_nodes.len(), 6, "{gpu_nodes:?}");
    let ml = unique_name("ml");
    let namespace: Namespace =
        serde_json::from_value(json!({"metadata": {"name": ml, "labels": {WORKLOADS: "true"}}}))
            .unwrap();
    Api::<Namespace>::all(admin.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .unwrap();
    let pods = Api::<Pod>::namespaced(admin.clone(), &ml);
    for pod in [
        workload(&ml, "train-a", &gpu_nodes[0], true),
        workload(&ml, "train-b", &gpu_nodes[1], true),
        workload(&ml, "cache", &gpu_nodes[2], false),
    ] {
        pods.create(&PostParams::default(), &pod).await.unwrap();
    }

    // The plan, by a reader.
    let planner = Planner::new(&admin, &ns).await;
    let bump = json!({"spec": {"driver": {"repository": "nvcr.io/nvidia", "image": "driver", "version": "600.10.01"}}});
    let policy = edited_policy(&s, &bump).await;
    let audit = AuditLog::from_env().unwrap();
    let mark = audit.mark().unwrap();
    let (plan, text) = planner.plan(&ns, &policy);
    let requests = planner.assert_no_write(&audit, mark);
    eprintln!("the plan made {requests} requests, none a write");

    let upgrade = &plan["driverUpgrade"];
    assert_eq!(upgrade["maxParallelUpgrades"], 2, "{plan:#}");
    assert_eq!(upgrade["waves"], 3, "6 nodes, 2 at a time: {plan:#}");
    let predicted: BTreeMap<String, (u64, bool, Vec<String>)> = upgrade["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            (
                n["node"].as_str().unwrap().to_owned(),
                (
                    n["wave"].as_u64().unwrap_or(0),
                    n["cordon"].as_bool().unwrap(),
                    strings(&n["evicted"]),
                ),
            )
        })
        .collect();
    assert_eq!(
        predicted.keys().cloned().collect::<Vec<_>>(),
        gpu_nodes,
        "every GPU node is in the rollout"
    );
    let predicted_evictions: BTreeSet<String> =
        predicted.values().flat_map(|(_, _, e)| e.clone()).collect();
    // The drain also takes whatever else runs there (NFD's master, say): the plan names it.
    for pod in ["train-a", "train-b", "cache"] {
        assert!(
            predicted_evictions.contains(&format!("{ml}/{pod}")),
            "{text}"
        );
    }
    // Every pod as it is at the plan: a pod that moves to a node the rollout has not reached
    // yet (and is evicted there again) is a new pod the plan could not know of.
    let existing: BTreeSet<String> = Api::<Pod>::all(admin.clone())
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|p| format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any()))
        .collect();
    assert_eq!(upgrade["evictionsByNamespace"][&ml], 3);
    let rollouts: BTreeMap<String, String> = plan["rollouts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["daemonSet"].as_str().unwrap().to_owned(),
                r["outcome"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        rollouts.get("nvidia-driver-daemonset").map(String::as_str),
        Some("driver-upgrade"),
        "{text}"
    );
    assert!(plan["verdicts"].as_array().unwrap().is_empty(), "{text}");

    // Applied: what happens.
    let pods_before = daemon_set_pods(&admin, &ns).await;
    let mark = audit.mark().unwrap();
    let (cordons, sampler) = sample_cordons(admin.clone());
    apply(&s, &policy).await;
    await_upgraded(&s, "600.10.01", "every node upgraded to 600.10.01").await;
    sampler.abort();
    let operator = s.identity.username();
    let events = audit.since(mark).unwrap();

    // Evictions: exactly the predicted pods.
    let evicted: BTreeSet<String> = events
        .iter()
        .filter(|e| e.user.username == operator && e.resource() == "pods/eviction")
        .filter(|e| e.response_status.as_ref().and_then(|r| r.code) == Some(201))
        .filter_map(|e| {
            let r = e.object_ref.as_ref()?;
            Some(format!(
                "{}/{}",
                r.namespace.as_deref()?,
                r.name.as_deref()?
            ))
        })
        .collect();
    let (known, moved): (BTreeSet<String>, BTreeSet<String>) =
        evicted.into_iter().partition(|p| existing.contains(p));
    eprintln!("evicted: {known:?}; pods started after the plan, evicted too: {moved:?}");
    assert_eq!(known, predicted_evictions);

    // Cordons: the predicted nodes, started wave by wave, never more than 2 at once.
    let (first_cordon, most) = cordons.lock().unwrap().clone();
    let cordoned: BTreeSet<String> = first_cordon
        .keys()
        .filter(|n| gpu_nodes.contains(n))
        .cloned()
        .collect();
    let predicted_cordons: BTreeSet<String> = predicted
        .iter()
        .filter(|(_, (_, cordon, _))| *cordon)
        .map(|(n, _)| n.clone())
        .collect();
    assert_eq!(cordoned, predicted_cordons);
    assert!(most <= 2, "{most} nodes cordoned at once");
    let mut order: Vec<(&Instant, &String)> = first_cordon
        .iter()
        .filter(|(n, _)| gpu_nodes.contains(n))
        .map(|(n, t)| (t, n))
        .collect();
    order.sort();
    let waves: Vec<u64> = order.iter().map(|(_, n)| predicted[*n].0).collect();
    eprintln!("cordon order {order:?}, predicted waves {waves:?}");
    assert!(
        waves.windows(2).all(|w| w[0] <= w[1]),
        "nodes were cordoned out of their predicted waves: {order:?} vs {predicted:?}"
    );

    // Pods replaced: the driver's and validator's by the upgrade itself (it restarts each
    // node's validator to validate the new driver); no other DaemonSet's, as the plan said.
    let mut rolled = replaced(&pods_before, &daemon_set_pods(&admin, &ns).await);
    assert_eq!(rolled.remove("nvidia-driver-daemonset"), Some(6));
    rolled.remove("nvidia-operator-validator");
    assert_eq!(rolled, planned_rolls(&plan), "DaemonSets whose pods rolled");

    // Objects the operator wrote: the predicted changes.
    let written: BTreeSet<String> = events
        .iter()
        .filter(|e| {
            e.user.username == operator && matches!(e.verb.as_str(), "patch" | "create" | "update")
        })
        .filter(|e| {
            e.object_ref
                .as_ref()
                .is_some_and(|r| r.subresource.is_none())
        })
        .filter(|e| e.resource() == "daemonsets")
        .filter_map(|e| e.name().map(str::to_owned))
        .collect();
    let predicted_written: BTreeSet<String> = plan["objects"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| {
            o["object"]
                .as_str()?
                .strip_prefix(&format!("DaemonSet {ns}/"))
                .map(str::to_owned)
        })
        .chain(upgrade["prePull"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(written, predicted_written, "DaemonSets the operator wrote");

    planner.remove(&admin).await;
    pods.delete_collection(&DeleteParams::default(), &ListParams::default())
        .await
        .unwrap();
    s.teardown().await;
    clean(&admin).await;
}

const SHARING: &str = "nvidia.com/device-plugin.config";
const MIG: &str = "nvidia.com/mig.config";

/// The layout labels of every GPU node.
async fn layout_labels(admin: &Client) -> BTreeMap<(String, String), String> {
    nodes::marked_gpu_nodes(admin)
        .await
        .unwrap()
        .iter()
        .flat_map(|n| {
            [SHARING, MIG]
                .into_iter()
                .filter_map(|k| Some(((n.name_any(), k.to_owned()), n.labels().get(k)?.clone())))
        })
        .collect()
}

/// The plan's label changes on the layout keys: (node, key) -> new value (`None`: removed).
fn planned_labels(plan: &Value) -> BTreeMap<(String, String), Option<String>> {
    let mut out = BTreeMap::new();
    for n in plan["nodeLabels"].as_array().unwrap() {
        let node = n["node"].as_str().unwrap().to_owned();
        for (k, v) in n["set"].as_object().unwrap() {
            if [SHARING, MIG].contains(&k.as_str()) {
                out.insert(
                    (node.clone(), k.clone()),
                    Some(v.as_str().unwrap().to_owned()),
                );
            }
        }
        for k in strings(&n["removed"]) {
            if [SHARING, MIG].contains(&k.as_str()) {
                out.insert((node.clone(), k), None);
            }
        }
    }
    out
}

/// What changed between two [`layout_labels`] readings.
fn label_changes(
    before: &BTreeMap<(String, String), String>,
    after: &BTreeMap<(String, String), String>,
) -> BTreeMap<(String, String), Option<String>> {
    let keys: BTreeSet<&(String, String)> = before.keys().chain(after.keys()).collect();
    keys.into_iter()
        .filter(|k| before.get(*k) != after.get(*k))
        .map(|k| ((*k).clone(), after.get(k).cloned()))
        .collect()
}

/// The DaemonSets the plan says the operator writes.
fn planned_daemon_sets(plan: &Value, ns: &str) -> BTreeSet<String> {
    plan["objects"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| {
            o["object"]
                .as_str()?
                .strip_prefix(&format!("DaemonSet {ns}/"))
                .map(str::to_owned)
        })
        .collect()
}

/// Waits until every operand DaemonSet has rolled out its current template.
async fn await_rolled_out(s: &Setup) {
    let api = s.daemonsets();
    wait::until(TIMEOUT, "every DaemonSet rolled out", || {
        let api = api.clone();
        async move {
            for ds in api.list(&ListParams::default()).await?.items {
                let generation = ds.metadata.generation;
                let status = ds.status.clone().unwrap_or_default();
                let done = status.observed_generation == generation
                    && status.updated_number_scheduled.unwrap_or(0)
                        == status.desired_number_scheduled
                    && status.number_ready == status.desired_number_scheduled;
                if !done {
                    return Ok(Err(format!("{} {status:?}", ds.name_any())));
                }
            }
            Ok(Ok(()))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
}

/// Plans `patch` on the live policy, checks the plan wrote nothing, applies it, waits for
/// `settled`, and compares the predicted DaemonSet writes, pod rolls and layout labels with what
/// happened. Returns the plan.
async fn plan_apply_compare(
    s: &Setup,
    planner: &Planner,
    patch: Value,
    settled: impl AsyncFn(&Setup, &Value),
) -> Value {
    let (admin, ns) = (s.admin.clone(), s.identity.namespace.clone());
    let policy = edited_policy(s, &patch).await;
    let audit = AuditLog::from_env().unwrap();
    let mark = audit.mark().unwrap();
    let (plan, _) = planner.plan(&ns, &policy);
    planner.assert_no_write(&audit, mark);

    let labels_before = layout_labels(&admin).await;
    let pods_before = daemon_set_pods(&admin, &ns).await;
    let mark = audit.mark().unwrap();
    apply(s, &policy).await;
    settled(s, &plan).await;
    await_rolled_out(s).await;
    let operator = s.identity.username();
    let events = audit.since(mark).unwrap();

    let predicted_written = planned_daemon_sets(&plan, &ns);
    let written: BTreeSet<String> = events
        .iter()
        .filter(|e| e.user.username == operator && e.resource() == "daemonsets")
        .filter(|e| matches!(e.verb.as_str(), "patch" | "create" | "update"))
        .filter_map(|e| e.name().map(str::to_owned))
        .collect();
    assert_eq!(written, predicted_written, "DaemonSets the operator wrote");
    assert_eq!(
        replaced(&pods_before, &daemon_set_pods(&admin, &ns).await),
        planned_rolls(&plan),
        "DaemonSets whose pods rolled, and on how many nodes"
    );
    assert_eq!(
        label_changes(&labels_before, &layout_labels(&admin).await),
        planned_labels(&plan),
        "layout labels"
    );
    plan
}

/// Waits until the layout labels are what the plan says.
async fn labels_as_planned(s: &Setup, plan: &Value) {
    let want = planned_labels(plan);
    let admin = s.admin.clone();
    wait::until(TIMEOUT, "the planned labels", || {
        let (admin, want) = (admin.clone(), want.clone());
        async move {
            let now = layout_labels(&admin).await;
            for ((node, key), value) in &want {
                if now.get(&(node.clone(), key.clone())) != value.as_ref() {
                    return Ok(Err(format!(
                        "{node} {key}: {:?}",
                        now.get(&(node.clone(), key.clone()))
                    )));
                }
            }
            Ok(Ok(()))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
}

/// The planned allocatable of each node named in the plan, by resource.
fn planned_allocatable(plan: &Value) -> BTreeMap<String, BTreeMap<String, u64>> {
    plan["allocatable"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            let planned = a["planned"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
                .collect();
            (a["node"].as_str().unwrap().to_owned(), planned)
        })
        .collect()
}

/// For each node of `product` (node -> (product, GPU count)): `resource`, `per_gpu` per GPU.
fn each_gpu(
    gpus: &BTreeMap<String, (String, u64)>,
    product: &str,
    resource: &str,
    per_gpu: u64,
) -> BTreeMap<String, BTreeMap<String, u64>> {
    gpus.iter()
        .filter(|(_, (p, _))| p == product)
        .map(|(n, (_, count))| {
            (
                n.clone(),
                BTreeMap::from([(resource.to_owned(), per_gpu * count)]),
            )
        })
        .collect()
}

#[tokio::test]
async fn sharing_mig_and_invalid_config_plans_predict_the_labels_rolls_and_verdicts_that_happen() {
    let Some(s) = session::start(json!({"mig": {"strategy": "mixed"}}), &[]).await else {
        return;
    };
    let (admin, ns) = (s.admin.clone(), s.identity.namespace.clone());
    s.await_state(State::Ready, "policy ready").await;
    session::config_map(
        &admin,
        &ns,
        "sharing",
        &[
            ("off", "version: v1\n"),
            ("time-sliced-4", &session::time_slicing(4)),
        ],
    )
    .await;
    session::config_map(
        &admin,
        &ns,
        "broken",
        &[("off", "version: v1\nsharing: [\n")],
    )
    .await;
    let planner = Planner::new(&admin, &ns).await;
    let gpus: BTreeMap<String, (String, u64)> = nodes::marked_gpu_nodes(&admin)
        .await
        .unwrap()
        .iter()
        .map(|n| {
            let product = n.labels()["nvidia.com/gpu.product"].clone();
            let count = n.labels()["nvidia.com/gpu.count"].parse().unwrap();
            (n.name_any(), (product, count))
        })
        .collect();

    // (b) Time-slicing 4-way on the T4s.
    let sharing = json!({"spec": {
        "devicePlugin": {"config": {"name": "sharing", "default": "off"}},
        "layoutsByModel": {"Tesla-T4": {"sharing": "time-sliced-4"}}
    }});
    let plan = plan_apply_compare(&s, &planner, sharing.clone(), labels_as_planned).await;
    // The device plugin's rule: each GPU advertised `replicas` times.
    let t4s = each_gpu(&gpus, "Tesla-T4", "nvidia.com/gpu", 4);
    assert!(!t4s.is_empty());
    assert_eq!(planned_allocatable(&plan), t4s, "{plan:#}");

    // (c) A MIG layout on the A100-40GBs.
    let mut mig = sharing.clone();
    mig["spec"]["layoutsByModel"]["NVIDIA-A100-SXM4-40GB"] = json!({"mig": "all-1g.5gb"});
    let plan = plan_apply_compare(&s, &planner, mig.clone(), labels_as_planned).await;
    // mig-parted's all-1g.5gb: seven 1g.5gb instances per A100-40GB.
    let a100s = each_gpu(&gpus, "NVIDIA-A100-SXM4-40GB", "nvidia.com/mig-1g.5gb", 7);
    assert!(!a100s.is_empty());
    assert_eq!(planned_allocatable(&plan), a100s, "{plan:#}");
    assert!(plan["rollouts"].as_array().unwrap().is_empty(), "{plan:#}");

    // (d) A broken sharing config: the verdict is the one status reports, and nothing changes.
    let mut broken = mig.clone();
    broken["spec"]["devicePlugin"]["config"] = json!({"name": "broken", "default": "off"});
    let plan = plan_apply_compare(&s, &planner, broken, async |s: &Setup, plan: &Value| {
        let verdict = plan["verdicts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["component"] == "device-plugin")
            .unwrap_or_else(|| panic!("no device-plugin verdict: {plan:#}"))["message"]
            .as_str()
            .unwrap()
            .to_owned();
        let (admin, name) = (s.admin.clone(), s.policy.clone());
        wait::until(TIMEOUT, "status reports the plan's verdict", || {
            let (admin, name, verdict) = (admin.clone(), name.clone(), verdict.clone());
            async move {
                let policy = session::policies(&admin).get(&name).await?;
                let message = session::component_message(&policy, "device-plugin");
                Ok(if message.contains(&verdict) {
                    Ok(())
                } else {
                    Err(format!("status {message:?}, plan {verdict:?}"))
                })
            }
        })
        .await
        .unwrap();
    })
    .await;
    assert!(plan["rollouts"].as_array().unwrap().is_empty(), "{plan:#}");
    assert!(planned_allocatable(&plan).is_empty(), "{plan:#}");

    planner.remove(&admin).await;
    s.teardown().await;
}
