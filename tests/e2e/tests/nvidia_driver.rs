//! NVIDIADriver pools on the harness (docs/nvidiadriver.md): two pools with different driver
//! versions each get their own DaemonSets, an overlapping pool is rejected in status, and
//! switching the ClusterPolicy's `useNvidiaDriverCRD` on and off hands nodes between the
//! policy's driver and the pools' without leaving a GPU node without a driver pod. Each pool's
//! `upgradePolicy` drives its own upgrades. The operator runs on its generated ClusterRole, so watching NVIDIADrivers, writing their status
//! and owning their DaemonSets is proven allowed to the chart's identity.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use e2e::nodes::{self, GpuModel};
use e2e::session::{self, Crd, Setup};
use e2e::wait;
use gpu_operator::api::{GPU_CLUSTER_NAME, GPUCluster, NVIDIADriver, NvidiaDriverState, State};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const POOL_LABEL: &str = "nvidia.com/gpu-operator.nvidiadriver";
const UPGRADE_STATE: &str = "nvidia.com/gpu-driver-upgrade-state";
const TIMEOUT: Duration = Duration::from_secs(180);
/// The longest a GPU node may be without a driver pod during a switch: the old pod's deletion,
/// the scheduler binding the new one and kwok starting it, on a loaded machine (a pass takes
/// well under a second; the bound leaves room for the scheduler's backoff).
const LONGEST_GAP: Duration = Duration::from_secs(15);

fn drivers(client: &Client) -> Api<NVIDIADriver> {
    Api::all(client.clone())
}

/// Deletes every NVIDIADriver and waits until they are gone.
async fn remove_drivers(admin: &Client) {
    let api = drivers(admin);
    for d in api.list(&ListParams::default()).await.unwrap().items {
        let _ = api.delete(&d.name_any(), &DeleteParams::default()).await;
    }
    wait::until_none_left(&api, &ListParams::default(), TIMEOUT, "NVIDIADrivers gone")
        .await
        .unwrap();
}

/// Removes what a failed run may have left on nodes: the pool label, the upgrade state and
/// annotations, cordons.
async fn clean_nodes(admin: &Client) {
    let api = Api::<Node>::all(admin.clone());
    for node in api.list(&ListParams::default()).await.unwrap().items {
        let upgrade: serde_json::Map<String, serde_json::Value> = node
            .annotations()
            .keys()
            .filter(|k| k.contains("driver-upgrade"))
            .map(|k| (k.clone(), serde_json::Value::Null))
            .collect();
        let dirty = node.labels().contains_key(POOL_LABEL)
            || node.labels().contains_key(UPGRADE_STATE)
            || !upgrade.is_empty()
            || node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true);
        if !dirty {
            continue;
        }
        let patch = json!({
            "metadata": {"labels": {POOL_LABEL: null, UPGRADE_STATE: null}, "annotations": upgrade},
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

/// The ClusterPolicy and the NVIDIADriver CRD installed, leftovers removed, the operator
/// running on the generated ClusterRole, and four pool nodes beside the standard fleet; `None`
/// where this run has no test cluster (the test is skipped).
async fn start(spec: serde_json::Value) -> Option<(Setup, Vec<String>)> {
    let prepared = session::builder().crd(Crd::NvidiaDriver).prepare().await?;
    remove_drivers(&prepared.admin).await;
    clean_nodes(&prepared.admin).await;
    let pool_nodes = vec![
        session::ephemeral_gpu_node("nvd-a-0", GpuModel::T4).label("pool", "a"),
        session::ephemeral_gpu_node("nvd-a-1", GpuModel::T4).label("pool", "a"),
        session::ephemeral_gpu_node("nvd-b-0", GpuModel::T4).label("pool", "b"),
        session::ephemeral_gpu_node("nvd-b-1", GpuModel::T4)
            .label("pool", "b")
            .os("ubuntu", "24.04"),
    ];
    nodes::create(&prepared.admin, &pool_nodes).await.unwrap();
    let names = pool_nodes.iter().map(|n| n.name.clone()).collect();
    Some((prepared.start(spec).await, names))
}

async fn create_driver(admin: &Client, name: &str, version: &str, pool: &str) {
    create_driver_with(admin, name, version, pool, json!({})).await;
}

/// [`create_driver`] with `extra` merged into the spec.
async fn create_driver_with(
    admin: &Client,
    name: &str,
    version: &str,
    pool: &str,
    extra: serde_json::Value,
) {
    let mut spec = json!({"driverType": "gpu", "repository": "nvcr.io/nvidia", "image": "driver",
                 "version": version, "nodeSelector": {"pool": pool}});
    for (k, v) in extra.as_object().cloned().unwrap_or_default() {
        spec[k] = v;
    }
    let d: NVIDIADriver = serde_json::from_value(json!({
        "apiVersion": "nvidia.com/v1alpha1", "kind": "NVIDIADriver",
        "metadata": {"name": name},
        "spec": spec
    }))
    .unwrap();
    drivers(admin)
        .create(&PostParams::default(), &d)
        .await
        .unwrap();
}

/// Waits until NVIDIADriver `name` reports `want` for its generation; returns its Ready message.
async fn await_driver(s: &Setup, name: &str, want: NvidiaDriverState, what: &str) -> String {
    let api = drivers(&s.admin);
    wait::until(TIMEOUT, what, || {
        let api = api.clone();
        async move {
            let d = api.get(name).await?;
            let status = d.status.clone().unwrap_or_default();
            let ready = status
                .conditions
                .iter()
                .flatten()
                .find(|c| c.type_ == "Ready")
                .cloned();
            let current = ready
                .as_ref()
                .and_then(|r| r.observed_generation)
                .is_some_and(|g| Some(g) >= d.metadata.generation);
            Ok(if status.state == want && current {
                Ok(ready.map(|r| r.message).unwrap_or_default())
            } else {
                Err(format!("{status:?}"))
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()))
}

/// The running driver pods (any driver DaemonSet), by node: (DaemonSet, image).
async fn driver_pods(admin: &Client, namespace: &str) -> BTreeMap<String, (String, String)> {
    Api::<Pod>::namespaced(admin.clone(), namespace)
        .list(&ListParams::default().labels("app.kubernetes.io/component=nvidia-driver"))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .filter_map(|p| {
            let node = p.spec.as_ref()?.node_name.clone()?;
            let owner = p.owner_references().first()?.name.clone();
            let image = p
                .spec
                .as_ref()?
                .containers
                .iter()
                .find(|c| c.name == "nvidia-driver-ctr")?
                .image
                .clone()?;
            Some((node, (owner, image)))
        })
        .collect()
}

async fn gpu_nodes(admin: &Client) -> Vec<String> {
    Api::<Node>::all(admin.clone())
        .list_metadata(&ListParams::default().labels("nvidia.com/gpu.present=true"))
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|n| n.name_any())
        .collect()
}

/// Waits until every GPU node runs exactly the driver `expect` names for it (DaemonSet prefix
/// and image tag), or, for nodes `expect` does not name, the ClusterPolicy's.
async fn await_drivers(s: &Setup, expect: &BTreeMap<String, (&str, &str)>, what: &str) {
    let (admin, ns) = (&s.admin, &s.identity.namespace);
    wait::until(TIMEOUT, what, || async move {
        let pods = driver_pods(admin, ns).await;
        let wrong: Vec<String> = gpu_nodes(admin)
            .await
            .into_iter()
            .filter_map(|node| {
                let (ds, tag) = expect
                    .get(&node)
                    .copied()
                    .unwrap_or(("nvidia-driver-daemonset", "595.91.07"));
                match pods.get(&node) {
                    Some((owner, image)) if owner.starts_with(ds) && image.contains(tag) => None,
                    other => Some(format!("{node}: {other:?}")),
                }
            })
            .collect();
        Ok(if wrong.is_empty() {
            Ok(())
        } else {
            Err(wrong.join("; "))
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
}

/// Samples the running driver pods per GPU node every 100 ms; records, per node, the longest
/// time it was seen without one.
fn sample_gaps(
    admin: Client,
    namespace: String,
) -> (
    Arc<Mutex<BTreeMap<String, Duration>>>,
    tokio::task::JoinHandle<()>,
) {
    let longest = Arc::new(Mutex::new(BTreeMap::new()));
    let seen = longest.clone();
    let task = tokio::spawn(async move {
        let mut since: BTreeMap<String, Instant> = BTreeMap::new();
        loop {
            let pods = driver_pods(&admin, &namespace).await;
            let now = Instant::now();
            for node in gpu_nodes(&admin).await {
                if pods.contains_key(&node) {
                    since.remove(&node);
                } else {
                    let start = *since.entry(node.clone()).or_insert(now);
                    let mut m = seen.lock().unwrap();
                    let gap = m.entry(node).or_insert(Duration::ZERO);
                    *gap = (*gap).max(now - start);
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    (longest, task)
}

fn assert_gaps(gaps: &BTreeMap<String, Duration>, what: &str) {
    let worst = gaps.iter().max_by_key(|(_, d)| **d);
    println!("{what}: longest time without a driver pod per node: {gaps:?}");
    if let Some((node, gap)) = worst {
        assert!(
            *gap <= LONGEST_GAP,
            "{what}: GPU node {node} was without a driver pod for {gap:?}"
        );
    }
}

#[tokio::test]
async fn two_nvidia_drivers_run_their_pools_reject_overlap_and_switch_without_driverless_nodes() {
    let Some((s, pool_nodes)) = start(json!({})).await else {
        return;
    };
    let admin = s.admin.clone();
    let ns = s.identity.namespace.clone();
    s.await_state(State::Ready, "policy ready with its own driver everywhere")
        .await;
    await_drivers(
        &s,
        &BTreeMap::new(),
        "the policy's driver on every GPU node",
    )
    .await;

    // Not acted on while the policy does not ask for them.
    create_driver(&admin, "pool-a", "580.95.05", "a").await;
    create_driver(&admin, "pool-b", "570.172.08", "b").await;
    let message = await_driver(&s, "pool-a", NvidiaDriverState::Disabled, "pool-a disabled").await;
    assert!(message.contains("useNvidiaDriverCRD"), "{message}");

    // Switched on: each pool its own DaemonSets and version, the other nodes keep the policy's.
    let (gaps, sampler) = sample_gaps(admin.clone(), ns.clone());
    let on = Instant::now();
    s.patch_policy(json!({"spec": {"driver": {"useNvidiaDriverCRD": true}}}))
        .await;
    let expect: BTreeMap<String, (&str, &str)> = [
        (
            "nvd-a-0",
            (
                "nvidia-gpu-driver-pool-a-ubuntu22.04",
                "580.95.05-ubuntu22.04",
            ),
        ),
        (
            "nvd-a-1",
            (
                "nvidia-gpu-driver-pool-a-ubuntu22.04",
                "580.95.05-ubuntu22.04",
            ),
        ),
        (
            "nvd-b-0",
            (
                "nvidia-gpu-driver-pool-b-ubuntu22.04",
                "570.172.08-ubuntu22.04",
            ),
        ),
        (
            "nvd-b-1",
            (
                "nvidia-gpu-driver-pool-b-ubuntu24.04",
                "570.172.08-ubuntu24.04",
            ),
        ),
    ]
    .into_iter()
    .map(|(n, e)| (n.to_owned(), e))
    .collect();
    await_drivers(&s, &expect, "each pool's driver on its nodes").await;
    println!(
        "switch on: every node on its final driver after {:?}",
        on.elapsed()
    );
    for pool in ["pool-a", "pool-b"] {
        await_driver(&s, pool, NvidiaDriverState::Ready, "pool ready").await;
    }
    let d = drivers(&admin).get("pool-b").await.unwrap();
    let status = d.status.unwrap();
    assert_eq!(status.selected_nodes, Some(2));
    let components: Vec<String> = status
        .components
        .unwrap()
        .iter()
        .filter_map(|c| c.daemon_set.clone())
        .collect();
    assert_eq!(
        components,
        [
            "nvidia-gpu-driver-pool-b-ubuntu22.04",
            "nvidia-gpu-driver-pool-b-ubuntu24.04"
        ]
    );
    let dss = Api::<DaemonSet>::namespaced(admin.clone(), &ns);
    let a = dss
        .get("nvidia-gpu-driver-pool-a-ubuntu22.04")
        .await
        .unwrap();
    assert_eq!(a.owner_references()[0].kind, "NVIDIADriver");
    s.await_state(State::Ready, "policy ready beside the pools")
        .await;
    let note = wait::until(TIMEOUT, "policy status names the pools", || {
        let admin = admin.clone();
        let policy = s.policy.clone();
        async move {
            let p = session::policies(&admin).get(&policy).await?;
            let text = serde_json::to_string(&p.status)?;
            Ok(
                if text.contains(
                    "4 GPU node(s) run the driver of an NVIDIADriver pool (pool-a: 2, pool-b: 2)",
                ) {
                    Ok(text)
                } else {
                    Err(text)
                },
            )
        }
    })
    .await
    .unwrap();
    assert!(note.contains("keep this policy's driver"), "{note}");

    // Overlap: a younger pool selecting pool a's nodes is rejected, naming both; nothing new.
    create_driver(&admin, "pool-c", "590.1.1", "a").await;
    let message = await_driver(
        &s,
        "pool-c",
        NvidiaDriverState::NotReady,
        "overlap rejected",
    )
    .await;
    assert!(
        message.contains("NVIDIADriver pool-a already selects GPU node(s) nvd-a-0, nvd-a-1")
            && message.contains("NVIDIADriver pool-c is not applied"),
        "{message}"
    );
    assert!(
        dss.get_opt("nvidia-gpu-driver-pool-c-ubuntu22.04")
            .await
            .unwrap()
            .is_none()
    );
    await_driver(&s, "pool-a", NvidiaDriverState::Ready, "pool-a still ready").await;
    drivers(&admin)
        .delete("pool-c", &DeleteParams::default())
        .await
        .unwrap();
    sampler.abort();
    assert_gaps(
        &gaps.lock().unwrap().clone(),
        "switching useNvidiaDriverCRD on",
    );

    // The upgrade controller drives the pools' DaemonSets: pool-a's version bump reaches its
    // nodes node by node (the policy's own DaemonSets changed template with the switch, so
    // their nodes are upgraded too).
    s.patch_policy(json!({"spec": {"driver": {"upgradePolicy": {
        "autoUpgrade": true, "maxParallelUpgrades": 10, "maxUnavailable": "100%"
    }}}}))
    .await;
    drivers(&admin)
        .patch(
            "pool-a",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"version": "580.95.06"}})),
        )
        .await
        .unwrap();
    let mut bumped = expect.clone();
    for node in ["nvd-a-0", "nvd-a-1"] {
        bumped.insert(
            node.to_owned(),
            (
                "nvidia-gpu-driver-pool-a-ubuntu22.04",
                "580.95.06-ubuntu22.04",
            ),
        );
    }
    await_drivers(&s, &bumped, "pool-a upgraded to 580.95.06").await;
    wait::until(
        TIMEOUT,
        "every GPU node upgrade-done and uncordoned",
        || {
            let admin = admin.clone();
            async move {
                let wrong: Vec<String> = Api::<Node>::all(admin)
                    .list(&ListParams::default().labels("nvidia.com/gpu.present=true"))
                    .await?
                    .items
                    .iter()
                    .filter(|n| {
                        n.labels().get(UPGRADE_STATE).map(String::as_str) != Some("upgrade-done")
                            || n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true)
                    })
                    .map(|n| format!("{}={:?}", n.name_any(), n.labels().get(UPGRADE_STATE)))
                    .collect();
                Ok(if wrong.is_empty() {
                    Ok(())
                } else {
                    Err(wrong.join(", "))
                })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    s.patch_policy(json!({"spec": {"driver": {"upgradePolicy": {"autoUpgrade": false}}}}))
        .await;
    wait::until(TIMEOUT, "upgrade labels cleared", || {
        let admin = admin.clone();
        async move {
            let n = Api::<Node>::all(admin)
                .list_metadata(&ListParams::default().labels(UPGRADE_STATE))
                .await?
                .items
                .len();
            Ok(if n == 0 {
                Ok(())
            } else {
                Err(format!("{n} left"))
            })
        }
    })
    .await
    .unwrap();

    // Switched off: the pools let go, the policy's driver covers every GPU node again.
    let (gaps, sampler) = sample_gaps(admin.clone(), ns.clone());
    let off = Instant::now();
    s.patch_policy(json!({"spec": {"driver": {"useNvidiaDriverCRD": false}}}))
        .await;
    await_drivers(
        &s,
        &BTreeMap::new(),
        "the policy's driver back on every GPU node",
    )
    .await;
    println!(
        "switch off: every node on the policy's driver after {:?}",
        off.elapsed()
    );
    await_driver(
        &s,
        "pool-a",
        NvidiaDriverState::Disabled,
        "pool-a disabled again",
    )
    .await;
    wait::until(TIMEOUT, "pool DaemonSets pruned and labels removed", || {
        let (dss, admin) = (dss.clone(), admin.clone());
        async move {
            let left: Vec<String> = dss
                .list_metadata(&ListParams::default())
                .await?
                .items
                .into_iter()
                .map(|d| d.name_any())
                .filter(|n| n.starts_with("nvidia-gpu-driver-"))
                .collect();
            let labelled = Api::<Node>::all(admin)
                .list_metadata(&ListParams::default().labels(POOL_LABEL))
                .await?
                .items
                .len();
            Ok(if left.is_empty() && labelled == 0 {
                Ok(())
            } else {
                Err(format!("{left:?}, {labelled} labelled"))
            })
        }
    })
    .await
    .unwrap();
    sampler.abort();
    assert_gaps(
        &gaps.lock().unwrap().clone(),
        "switching useNvidiaDriverCRD off",
    );

    remove_drivers(&admin).await;
    s.teardown().await;
    nodes::delete(&admin, &pool_nodes).await.unwrap();
    clean_nodes(&admin).await;
}

/// Upgrade states between `upgrade-required` and `upgrade-done`: a node in one is upgrading.
const UPGRADING: [&str; 7] = [
    "cordon-required",
    "wait-for-jobs-required",
    "pod-deletion-required",
    "drain-required",
    "pod-restart-required",
    "validation-required",
    "uncordon-required",
];

/// Samples the GPU nodes' upgrade state label every 100 ms while a rollout runs: per value of
/// the `pool` node label, the most nodes seen upgrading at once.
fn sample_upgrading(
    admin: Client,
) -> (
    Arc<Mutex<BTreeMap<String, usize>>>,
    tokio::task::JoinHandle<()>,
) {
    let most = Arc::new(Mutex::new(BTreeMap::new()));
    let seen = most.clone();
    let task = tokio::spawn(async move {
        loop {
            let nodes = Api::<Node>::all(admin.clone())
                .list_metadata(&ListParams::default().labels("nvidia.com/gpu.present=true"))
                .await;
            if let Ok(nodes) = nodes {
                let mut now: BTreeMap<String, usize> = BTreeMap::new();
                for n in &nodes.items {
                    let labels = n.labels();
                    let upgrading = labels
                        .get(UPGRADE_STATE)
                        .is_some_and(|s| UPGRADING.contains(&s.as_str()));
                    if let (true, Some(pool)) = (upgrading, labels.get("pool")) {
                        *now.entry(pool.clone()).or_default() += 1;
                    }
                }
                let mut m = seen.lock().unwrap();
                for (pool, count) in now {
                    let most: &mut usize = m.entry(pool).or_default();
                    *most = (*most).max(count);
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    (most, task)
}

/// Waits until every node of `nodes` is `upgrade-done`, uncordoned, with a driver pod whose
/// image carries `tag`.
async fn await_upgraded(s: &Setup, nodes: &[&str], tag: &str, what: &str) {
    let (admin, ns) = (&s.admin, &s.identity.namespace);
    wait::until(TIMEOUT, what, || async move {
        let pods = driver_pods(admin, ns).await;
        let api = Api::<Node>::all(admin.clone());
        let mut wrong = Vec::new();
        for name in nodes {
            let node = api.get(name).await?;
            let state = node
                .labels()
                .get(UPGRADE_STATE)
                .cloned()
                .unwrap_or_default();
            let cordoned = node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true);
            let image = pods
                .get(*name)
                .map(|(_, image)| image.clone())
                .unwrap_or_default();
            if state != "upgrade-done" || cordoned || !image.contains(tag) {
                wrong.push(format!("{name}: {state} cordoned={cordoned} {image}"));
            }
        }
        Ok(if wrong.is_empty() {
            Ok(())
        } else {
            Err(wrong.join("; "))
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
}

#[tokio::test]
async fn each_nvidia_driver_pool_upgrades_with_its_own_policy_one_node_at_a_time_where_it_says_so()
{
    // The ClusterPolicy's own policy upgrades nothing: every upgrade below is a pool's own.
    let Some((s, mut pool_nodes)) = start(json!({"driver": {
        "useNvidiaDriverCRD": true, "upgradePolicy": {"autoUpgrade": false}
    }}))
    .await
    else {
        return;
    };
    let admin = s.admin.clone();
    // Pool a gets four nodes, so one-at-a-time is visible; pool b keeps its two.
    let more = vec![
        session::ephemeral_gpu_node("nvd-a-2", GpuModel::T4).label("pool", "a"),
        session::ephemeral_gpu_node("nvd-a-3", GpuModel::T4).label("pool", "a"),
    ];
    nodes::create(&admin, &more).await.unwrap();
    pool_nodes.extend(more.iter().map(|n| n.name.clone()));
    let pool_a = ["nvd-a-0", "nvd-a-1", "nvd-a-2", "nvd-a-3"];
    let pool_b = ["nvd-b-0", "nvd-b-1"];
    create_driver_with(
        &admin,
        "pool-a",
        "580.95.05",
        "a",
        json!({"upgradePolicy": {"maxParallelUpgrades": 1, "maxUnavailable": "100%"}}),
    )
    .await;
    create_driver_with(
        &admin,
        "pool-b",
        "570.172.08",
        "b",
        json!({"upgradePolicy": {"maxParallelUpgrades": 2, "maxUnavailable": "100%"}}),
    )
    .await;
    // autoUpgrade was left out: NVIDIA's NVIDIADriver default (true) is stored.
    let stored = drivers(&admin).get("pool-a").await.unwrap();
    let policy = stored.spec.upgrade_policy.clone().unwrap();
    assert_eq!(policy.auto_upgrade, Some(true));
    for pool in ["pool-a", "pool-b"] {
        await_driver(&s, pool, NvidiaDriverState::Ready, "pool ready").await;
    }
    await_upgraded(&s, &pool_a, "580.95.05", "pool a's first rollout done").await;
    await_upgraded(&s, &pool_b, "570.172.08", "pool b's first rollout done").await;

    let (most, sampler) = sample_upgrading(admin.clone());
    for (pool, version) in [("pool-a", "580.95.06"), ("pool-b", "570.172.09")] {
        drivers(&admin)
            .patch(
                pool,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"version": version}})),
            )
            .await
            .unwrap();
    }
    await_upgraded(&s, &pool_a, "580.95.06", "pool a upgraded").await;
    await_upgraded(&s, &pool_b, "570.172.09", "pool b upgraded").await;
    sampler.abort();
    let most = most.lock().unwrap().clone();
    println!("most nodes upgrading at once, per pool: {most:?}");
    assert_eq!(
        most.get("a"),
        Some(&1),
        "pool-a (maxParallelUpgrades: 1) upgrades one node at a time: {most:?}"
    );
    assert_eq!(
        most.get("b"),
        Some(&2),
        "pool-b (maxParallelUpgrades: 2) follows its own policy, not pool-a's: {most:?}"
    );
    // The ClusterPolicy's own nodes (autoUpgrade false) carry no upgrade state.
    let labelled: Vec<String> = Api::<Node>::all(admin.clone())
        .list_metadata(&ListParams::default().labels(UPGRADE_STATE))
        .await
        .unwrap()
        .items
        .iter()
        .map(|n| n.name_any())
        .filter(|n| !pool_nodes.contains(n))
        .collect();
    assert!(labelled.is_empty(), "{labelled:?}");

    remove_drivers(&admin).await;
    s.teardown().await;
    nodes::delete(&admin, &pool_nodes).await.unwrap();
    clean_nodes(&admin).await;
}

/// Deletes the GPUCluster, if any, and waits until it is gone.
async fn remove_gpu_cluster(admin: &Client) {
    e2e::dra::remove_gpu_cluster(admin).await.unwrap();
}

#[tokio::test]
async fn a_gpu_cluster_without_a_cluster_policy_runs_each_nvidia_driver_pool_and_the_default_pool()
{
    let Some(prepared) = session::builder()
        .crd(Crd::NvidiaDriver)
        .crd(Crd::GpuCluster)
        .prepare()
        .await
    else {
        return;
    };
    let admin = prepared.admin.clone();
    remove_drivers(&admin).await;
    remove_gpu_cluster(&admin).await;
    clean_nodes(&admin).await;
    let pool_nodes = vec![
        session::ephemeral_gpu_node("nvd-a-0", GpuModel::T4).label("pool", "a"),
        session::ephemeral_gpu_node("nvd-a-1", GpuModel::T4).label("pool", "a"),
        session::ephemeral_gpu_node("nvd-b-0", GpuModel::T4)
            .label("pool", "b")
            .os("ubuntu", "24.04"),
    ];
    nodes::create(&admin, &pool_nodes).await.unwrap();
    let names: Vec<String> = pool_nodes.iter().map(|n| n.name.clone()).collect();
    let (admin, identity, mut operator) = prepared.start_operator().await;
    let ns = identity.namespace.clone();
    assert!(
        session::policies(&admin)
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty(),
        "no ClusterPolicy in this test"
    );

    // Before a GPUCluster exists the NVIDIADrivers say why nothing runs.
    create_driver(&admin, "pool-a", "580.95.05", "a").await;
    let fallback: NVIDIADriver = serde_json::from_value(json!({
        "apiVersion": "nvidia.com/v1alpha1", "kind": "NVIDIADriver",
        "metadata": {"name": "fallback"},
        "spec": {"default": true, "version": "570.172.08"}
    }))
    .unwrap();
    drivers(&admin)
        .create(&PostParams::default(), &fallback)
        .await
        .unwrap();
    // NVIDIA's rule, at admission: a default NVIDIADriver selects no nodes itself.
    let mut scoped = fallback.clone();
    scoped.metadata.name = Some("scoped-default".into());
    scoped.spec.node_selector = Some(BTreeMap::from([("pool".into(), "a".into())]));
    let refused = drivers(&admin)
        .create(&PostParams::default(), &scoped)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("default NVIDIADriver must not use nodeSelector"),
        "{refused}"
    );

    let cluster: GPUCluster = serde_json::from_value(json!({
        "apiVersion": "nvidia.com/v1alpha1", "kind": "GPUCluster",
        "metadata": {"name": GPU_CLUSTER_NAME}, "spec": {}
    }))
    .unwrap();
    Api::<GPUCluster>::all(admin.clone())
        .create(&PostParams::default(), &cluster)
        .await
        .unwrap();

    // Each pool reaches ready with its own DaemonSets: pool-a on its nodes, the default pool on
    // every other GPU node (one DaemonSet per OS).
    let await_ready = |name: &'static str| {
        let (admin, log) = (admin.clone(), &operator);
        async move {
            let api = drivers(&admin);
            wait::until(TIMEOUT, "pool ready", || {
                let api = api.clone();
                async move {
                    let d = api.get(name).await?;
                    let state = d.status.as_ref().map(|s| s.state);
                    Ok(if state == Some(NvidiaDriverState::Ready) {
                        Ok(())
                    } else {
                        Err(format!("{name}: {:?}", d.status))
                    })
                }
            })
            .await
            .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", log.log_text()));
        }
    };
    await_ready("pool-a").await;
    await_ready("fallback").await;
    let pods = driver_pods(&admin, &ns).await;
    let mut wrong = Vec::new();
    for node in gpu_nodes(&admin).await {
        let (ds, tag) = if node.starts_with("nvd-a-") {
            (
                "nvidia-gpu-driver-pool-a-ubuntu22.04",
                "580.95.05-ubuntu22.04",
            )
        } else if node == "nvd-b-0" {
            (
                "nvidia-gpu-driver-fallback-ubuntu24.04",
                "570.172.08-ubuntu24.04",
            )
        } else {
            (
                "nvidia-gpu-driver-fallback-ubuntu22.04",
                "570.172.08-ubuntu22.04",
            )
        };
        match pods.get(&node) {
            Some((owner, image)) if owner == ds && image.ends_with(tag) => {}
            other => wrong.push(format!("{node}: {other:?}, want {ds} {tag}")),
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    let dss = Api::<DaemonSet>::namespaced(admin.clone(), &ns);
    for name in [
        "nvidia-gpu-driver-pool-a-ubuntu22.04",
        "nvidia-gpu-driver-fallback-ubuntu22.04",
        "nvidia-gpu-driver-fallback-ubuntu24.04",
    ] {
        let status = dss.get(name).await.unwrap().status.unwrap();
        assert!(
            status.desired_number_scheduled > 0
                && status.number_ready == status.desired_number_scheduled,
            "{name}: {status:?}"
        );
    }
    // No ClusterPolicy driver DaemonSet; what the pools' pods use is the GPUCluster's.
    assert!(
        dss.get_opt("nvidia-driver-daemonset")
            .await
            .unwrap()
            .is_none()
    );
    let pod_spec = dss
        .get("nvidia-gpu-driver-pool-a-ubuntu22.04")
        .await
        .unwrap()
        .spec
        .unwrap()
        .template
        .spec
        .unwrap();
    let account = pod_spec.service_account_name.unwrap();
    let sa = Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(admin.clone(), &ns)
        .get(&account)
        .await
        .unwrap();
    assert_eq!(sa.owner_references()[0].kind, "GPUCluster");

    remove_drivers(&admin).await;
    remove_gpu_cluster(&admin).await;
    operator.terminate(Duration::from_secs(20)).unwrap();
    identity.delete().await.unwrap();
    nodes::delete(&admin, &names).await.unwrap();
    clean_nodes(&admin).await;
}

#[tokio::test]
async fn a_precompiled_nvidia_driver_runs_one_daemonset_per_kernel_and_takes_its_nodes() {
    let Some((s, pool_nodes)) = start(json!({"driver": {"useNvidiaDriverCRD": true}})).await else {
        return;
    };
    let admin = s.admin.clone();
    let kernel = gpu_operator::nodes::KERNEL_VERSION;
    let (k1, k2) = ("5.15.0-1048-aws", "5.15.0-1050-aws");
    nodes::set_label(&admin, "nvd-a-0", kernel, Some(k1))
        .await
        .unwrap();
    nodes::set_label(&admin, "nvd-a-1", kernel, Some(k2))
        .await
        .unwrap();
    create_driver_with(&admin, "pre", "580", "a", json!({"usePrecompiled": true})).await;
    await_driver(
        &s,
        "pre",
        NvidiaDriverState::Ready,
        "precompiled pool ready",
    )
    .await;
    let ds = |k: &str| format!("nvidia-gpu-driver-pre-ubuntu22.04-{k}");
    let (ds1, ds2) = (ds(k1), ds(k2));
    let tag = |k: &str| format!("driver:580-{k}-ubuntu22.04");
    let (tag1, tag2) = (tag(k1), tag(k2));
    let expect = BTreeMap::from([
        ("nvd-a-0".to_owned(), (ds1.as_str(), tag1.as_str())),
        ("nvd-a-1".to_owned(), (ds2.as_str(), tag2.as_str())),
        (
            "nvd-b-0".to_owned(),
            ("nvidia-driver-daemonset", "595.91.07"),
        ),
        (
            "nvd-b-1".to_owned(),
            ("nvidia-driver-daemonset-ubuntu24.04", "595.91.07"),
        ),
    ]);
    await_drivers(
        &s,
        &expect,
        "each kernel's node runs its precompiled driver",
    )
    .await;
    let daemonsets = Api::<DaemonSet>::namespaced(admin.clone(), &s.identity.namespace);
    for (name, k) in [(&ds1, k1), (&ds2, k2)] {
        let d = daemonsets.get(name).await.unwrap();
        assert_eq!(d.labels()["nvidia.com/precompiled"], "true");
        assert_eq!(d.labels()["nvidia.com/precompiled.kernel-version"], k);
        let pod = d.spec.unwrap().template.spec.unwrap();
        assert_eq!(pod.node_selector.unwrap()[kernel], k);
    }
    // The pool label hands exactly the nodes a precompiled DaemonSet selects to the pool.
    for node in ["nvd-a-0", "nvd-a-1"] {
        let n = Api::<Node>::all(admin.clone()).get(node).await.unwrap();
        assert_eq!(n.labels().get(POOL_LABEL).map(String::as_str), Some("pre"));
    }

    remove_drivers(&admin).await;
    s.teardown().await;
    nodes::delete(&admin, &pool_nodes).await.unwrap();
    clean_nodes(&admin).await;
}
