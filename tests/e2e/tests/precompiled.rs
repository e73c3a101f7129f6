//! Precompiled drivers on the harness (docs/operand-facts.md §3.2): one driver DaemonSet per
//! kernel of the GPU nodes, a node that boots another kernel moving to that kernel's pool (the
//! emptied pool pruned), and a running precompiled fleet never switched back all at once.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};

use e2e::nodes;
use e2e::session::{self, TIMEOUT};
use e2e::wait;
use gpu_operator::api::State;
use gpu_operator::nodes::KERNEL_VERSION;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
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

fn pool_name(kernel: &str, os: &str) -> String {
    format!("nvidia-driver-daemonset-{kernel}-{os}")
}

#[tokio::test]
async fn precompiled_pools_follow_the_kernels_and_a_running_fleet_is_not_switched_back() {
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

    // Switching the running precompiled fleet back is refused, and nothing is torn down.
    s.patch_policy(json!({"spec": {"driver": {"usePrecompiled": false, "version": "595.91.07"}}}))
        .await;
    let refused = s.await_state(State::NotReady, "switch back refused").await;
    let message = session::ready_condition(&refused)
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(
        message.contains("spec.driver.usePrecompiled")
            && message.contains("every GPU node at once"),
        "{message}"
    );
    assert!(daemonsets.get_opt(&old_pool).await.unwrap().is_some());
    assert!(
        daemonsets
            .get_opt("nvidia-driver-daemonset")
            .await
            .unwrap()
            .is_none()
    );

    s.teardown().await;
    for node in &gpu_nodes {
        set_kernel(&admin, node, None).await;
    }
}
