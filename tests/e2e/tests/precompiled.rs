//! Precompiled drivers on the harness (docs/operand-facts.md §3.2): one driver DaemonSet per
//! kernel of the GPU nodes, a node that boots another kernel moving to that kernel's pool (the
//! emptied pool pruned), and a running fleet switched between precompiled drivers and drivers
//! built on the node one node at a time: by the upgrade controller within the upgrade policy, or
//! by hand with automatic upgrades off.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use e2e::nodes;
use e2e::session::{self, TIMEOUT};
use e2e::wait;
use gpu_operator::api::State;
use gpu_operator::nodes::KERNEL_VERSION;
use gpu_operator::operands::driver_variant::VARIANT_LABEL;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const OLD_KERNEL: &str = "5.15.0-1048-aws";
const NEW_KERNEL: &str = "5.15.0-1050-aws";

async fn set_kernel(admin: &Client, node: &str, kernel: Option<&str>) {
    nodes::set_label(admin, node, KERNEL_VERSION, kernel)
        .await
        .unwrap();
}

/// Driver DaemonSet name -> the nodes its pods run on.
async fn driver_pods(admin: &Client, namespace: &str) -> BTreeMap<String, BTreeSet<String>> {
    let pods = Api::<Pod>::namespaced(admin.clone(), namespace)
        .list(&ListParams::default().labels("app.kubernetes.io/component=nvidia-driver"))
        .await
        .unwrap();
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for pod in pods.items {
        let owner = pod
            .owner_references()
            .iter()
            .find(|o| o.kind == "DaemonSet")
            .map(|o| o.name.clone())
            .unwrap_or_default();
        let node = pod.spec.and_then(|s| s.node_name).unwrap_or_default();
        out.entry(owner).or_default().insert(node);
    }
    out
}

const STANDARD: &str = "nvidia-driver-daemonset";
const UPGRADE_STATE: &str = "nvidia.com/gpu-driver-upgrade-state";

fn pool_name(kernel: &str, os: &str) -> String {
    format!("nvidia-driver-daemonset-{kernel}-{os}")
}

#[tokio::test]
async fn precompiled_pools_follow_the_kernels_and_a_switch_back_without_auto_upgrade_moves_labelled_nodes_only()
 {
    let Some(prepared) = session::builder().prepare().await else {
        return;
    };
    let admin = prepared.admin.clone();
    let gpu_nodes = nodes::gpu_node_names(&admin).await.unwrap();
    assert!(gpu_nodes.len() >= 2, "{gpu_nodes:?}");
    let moving = gpu_nodes[0].clone();
    set_kernel(&admin, &moving, Some(NEW_KERNEL)).await;
    for node in &gpu_nodes[1..] {
        set_kernel(&admin, node, Some(OLD_KERNEL)).await;
    }
    let s = prepared
        .start(
            json!({"driver": {"usePrecompiled": true, "repository": "nvcr.io/nvidia",
            "image": "driver", "version": "580"}}),
        )
        .await;
    s.await_state(State::Ready, "precompiled policy ready")
        .await;
    let namespace = s.identity.namespace.clone();
    // The fleet's OS, from the DaemonSet the old kernel's nodes run.
    let os = "ubuntu22.04";
    let (old_pool, new_pool) = (pool_name(OLD_KERNEL, os), pool_name(NEW_KERNEL, os));
    let pods = driver_pods(&admin, &namespace).await;
    assert_eq!(
        pods.keys().cloned().collect::<Vec<_>>(),
        [old_pool.clone(), new_pool.clone()],
        "{pods:?}"
    );
    assert_eq!(pods[&new_pool], BTreeSet::from([moving.clone()]));
    assert_eq!(pods[&old_pool].len(), gpu_nodes.len() - 1);
    let daemonsets = Api::<DaemonSet>::namespaced(admin.clone(), &namespace);
    let image = daemonsets
        .get(&new_pool)
        .await
        .unwrap()
        .spec
        .unwrap()
        .template
        .spec
        .unwrap()
        .containers
        .into_iter()
        .find(|c| c.name == "nvidia-driver-ctr")
        .and_then(|c| c.image);
    assert_eq!(
        image.as_deref(),
        Some("nvcr.io/nvidia/driver:580-5.15.0-1050-aws-ubuntu22.04")
    );

    // The node boots the old kernel again: it joins that pool, and the emptied pool goes.
    set_kernel(&admin, &moving, Some(OLD_KERNEL)).await;
    wait::until(TIMEOUT, "the node moved to the old kernel's pool", || {
        let (admin, namespace, old_pool, moving) = (
            admin.clone(),
            namespace.clone(),
            old_pool.clone(),
            moving.clone(),
        );
        async move {
            let pods = driver_pods(&admin, &namespace).await;
            Ok(
                if pods.len() == 1 && pods.get(&old_pool).is_some_and(|n| n.contains(&moving)) {
                    Ok(())
                } else {
                    Err(format!("{pods:?}"))
                },
            )
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    wait::until(TIMEOUT, "the emptied pool's DaemonSet pruned", || {
        let (daemonsets, new_pool) = (daemonsets.clone(), new_pool.clone());
        async move {
            Ok(match daemonsets.get_opt(&new_pool).await? {
                None => Ok(()),
                Some(_) => Err("still there".to_owned()),
            })
        }
    })
    .await
    .unwrap();

    // Switching the running precompiled fleet back, with automatic upgrades off: nothing is
    // torn down, status gives the command that moves a node, and a node so labelled moves.
    s.patch_policy(json!({"spec": {"driver": {"usePrecompiled": false, "version": "595.91.07"}}}))
        .await;
    let policy = s.policy.clone();
    wait::until(TIMEOUT, "status says how to move nodes", || {
        let (admin, policy) = (admin.clone(), policy.clone());
        async move {
            let message = session::ready_message(&admin, &policy).await?;
            Ok(
                if message
                    .contains("switching from precompiled drivers to drivers built on the node")
                    && message.contains(&format!("{VARIANT_LABEL}=built-on-node"))
                {
                    Ok(())
                } else {
                    Err(message)
                },
            )
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    let pods = driver_pods(&admin, &namespace).await;
    assert_eq!(
        pods.get(&old_pool).map(BTreeSet::len),
        Some(gpu_nodes.len()),
        "{pods:?}"
    );
    assert!(!pods.contains_key(STANDARD), "{pods:?}");
    nodes::set_label(&admin, &moving, VARIANT_LABEL, Some("built-on-node"))
        .await
        .unwrap();
    wait::until(TIMEOUT, "the labelled node moved", || {
        let (admin, namespace, moving) = (admin.clone(), namespace.clone(), moving.clone());
        async move {
            let pods = driver_pods(&admin, &namespace).await;
            let moved = pods.get(STANDARD) == Some(&BTreeSet::from([moving.clone()]));
            Ok(if moved {
                Ok(())
            } else {
                Err(format!("{pods:?}"))
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    assert_eq!(
        driver_pods(&admin, &namespace).await[&old_pool].len(),
        gpu_nodes.len() - 1
    );

    s.teardown().await;
    for node in &gpu_nodes {
        set_kernel(&admin, node, None).await;
        nodes::set_label(&admin, node, VARIANT_LABEL, None)
            .await
            .unwrap();
    }
}

/// What a sampler saw while a fleet switched driver variant.
#[derive(Debug, Default)]
struct Seen {
    /// The most GPU nodes at once without a running driver pod.
    most_without_driver: usize,
    /// The most GPU nodes cordoned at once.
    most_cordoned: usize,
    /// The GPU nodes seen cordoned at least once.
    cordoned: BTreeSet<String>,
}

/// Samples the GPU nodes and driver pods every 100 ms until stopped.
fn sample(
    admin: Client,
    namespace: String,
    nodes: Vec<String>,
) -> (Arc<Mutex<Seen>>, tokio::task::JoinHandle<()>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let out = seen.clone();
    let task = tokio::spawn(async move {
        let api = Api::<Node>::all(admin.clone());
        loop {
            let pods = driver_pods(&admin, &namespace).await;
            let without = {
                let with_driver: BTreeSet<&String> = pods.values().flatten().collect();
                nodes.iter().filter(|n| !with_driver.contains(n)).count()
            };
            let mut cordoned = BTreeSet::new();
            for name in &nodes {
                if let Ok(node) = api.get(name).await
                    && node.spec.and_then(|s| s.unschedulable) == Some(true)
                {
                    cordoned.insert(name.clone());
                }
            }
            {
                let mut s = out.lock().unwrap();
                s.most_without_driver = s.most_without_driver.max(without);
                s.most_cordoned = s.most_cordoned.max(cordoned.len());
                s.cordoned.extend(cordoned);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    (seen, task)
}

#[tokio::test]
async fn a_running_fleet_switches_to_precompiled_drivers_one_node_at_a_time_through_the_upgrade() {
    let Some(prepared) = session::builder().prepare().await else {
        return;
    };
    let admin = prepared.admin.clone();
    let gpu_nodes = nodes::gpu_node_names(&admin).await.unwrap();
    assert!(gpu_nodes.len() >= 2, "{gpu_nodes:?}");
    for node in &gpu_nodes {
        set_kernel(&admin, node, Some(OLD_KERNEL)).await;
        nodes::set_label(&admin, node, VARIANT_LABEL, None)
            .await
            .unwrap();
    }
    let upgrade = json!({"autoUpgrade": true, "maxParallelUpgrades": 1, "maxUnavailable": 1});
    let s = prepared
        .start(
            json!({"driver": {"repository": "nvcr.io/nvidia", "image": "driver",
            "version": "595.91.07", "upgradePolicy": upgrade}}),
        )
        .await;
    s.await_state(State::Ready, "built-on-node fleet ready")
        .await;
    let namespace = s.identity.namespace.clone();
    let pool = pool_name(OLD_KERNEL, "ubuntu22.04");
    let pods = driver_pods(&admin, &namespace).await;
    assert_eq!(pods.get(STANDARD).map(BTreeSet::len), Some(gpu_nodes.len()));

    let (seen, sampler) = sample(admin.clone(), namespace.clone(), gpu_nodes.clone());
    s.patch_policy(json!({"spec": {"driver": {"usePrecompiled": true, "version": "580"}}}))
        .await;
    let daemonsets = Api::<DaemonSet>::namespaced(admin.clone(), &namespace);
    let node_api = Api::<Node>::all(admin.clone());
    wait::until(TIMEOUT, "every node moved, upgraded and released", || {
        let (admin, namespace, daemonsets, node_api, gpu_nodes, pool) = (
            admin.clone(),
            namespace.clone(),
            daemonsets.clone(),
            node_api.clone(),
            gpu_nodes.clone(),
            pool.clone(),
        );
        async move {
            let pods = driver_pods(&admin, &namespace).await;
            let mut wrong = Vec::new();
            if pods.get(&pool).map(BTreeSet::len) != Some(gpu_nodes.len()) {
                wrong.push(format!("pods {pods:?}"));
            }
            if daemonsets.get_opt(STANDARD).await?.is_some() {
                wrong.push("the built-on-node DaemonSet is still there".to_owned());
            }
            for name in &gpu_nodes {
                let node = node_api.get(name).await?;
                let labels = node.labels();
                let state = labels.get(UPGRADE_STATE).map(String::as_str);
                let variant = labels.get(VARIANT_LABEL).map(String::as_str);
                let cordoned = node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true);
                if state != Some("upgrade-done") || variant != Some("precompiled") || cordoned {
                    wrong.push(format!("{name}: {state:?} {variant:?} cordoned={cordoned}"));
                }
            }
            Ok(if wrong.is_empty() {
                Ok(())
            } else {
                Err(wrong.join("; "))
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    sampler.abort();
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    println!("while switching: {seen:?}");
    assert!(
        seen.most_without_driver <= 1,
        "more GPU nodes than maxParallelUpgrades were without a driver pod at once: {seen:?}"
    );
    assert!(seen.most_cordoned <= 1, "{seen:?}");
    assert_eq!(
        seen.cordoned,
        gpu_nodes.iter().cloned().collect::<BTreeSet<_>>(),
        "every node is cordoned for its switch"
    );
    // The switch over, the precompiled DaemonSet takes unlabelled nodes again: no placement
    // term is left on it.
    let template = daemonsets.get(&pool).await.unwrap().spec.unwrap().template;
    let affinity = template.spec.unwrap().affinity.unwrap();
    assert!(affinity.node_affinity.is_none(), "{affinity:?}");
    s.await_state(State::Ready, "precompiled fleet ready").await;

    s.teardown().await;
    for node in &gpu_nodes {
        set_kernel(&admin, node, None).await;
    }
}
