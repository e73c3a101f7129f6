//! Mixed runtime fleets on the harness (docs/operand-facts.md §6.1): GPU nodes reporting k3s,
//! RKE2, stock containerd 2 and CRI-O in `status.nodeInfo` get one container-toolkit DaemonSet
//! per flavour, each only on its flavour's nodes, and a node of a read-only image
//! (Bottlerocket) gets none and is named in status.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};

use e2e::nodes::{self, GpuModel};
use e2e::session::{self, TIMEOUT, ephemeral_gpu_node};
use e2e::wait;
use gpu_operator::nodes::RUNTIME_FLAVOUR;
use gpu_operator::operands::toolkit;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use serde_json::json;

/// The nodes this test adds, with what they report and the flavour each must be found to be.
fn distribution_nodes() -> Vec<(nodes::FakeNode, &'static str)> {
    vec![
        (
            ephemeral_gpu_node("rt-k3s-0", GpuModel::T4)
                .reports("containerd://1.7.23-k3s2", "v1.31.4+k3s1"),
            "k3s",
        ),
        (
            ephemeral_gpu_node("rt-rke2-0", GpuModel::T4)
                .reports("containerd://1.7.23-k3s1", "v1.31.4+rke2r1"),
            "rke2",
        ),
        (
            ephemeral_gpu_node("rt-crio-0", GpuModel::T4).reports("cri-o://1.33.2", "v1.33.2"),
            "crio",
        ),
        (
            ephemeral_gpu_node("rt-bottlerocket-0", GpuModel::T4)
                .os_image("Bottlerocket OS 1.20.0 (aws-k8s-1.31)"),
            "read-only-bottlerocket",
        ),
    ]
}

/// Toolkit DaemonSet name -> the nodes its pods run on.
async fn toolkit_pods(admin: &Client, namespace: &str) -> BTreeMap<String, BTreeSet<String>> {
    let pods = Api::<Pod>::namespaced(admin.clone(), namespace)
        .list(&ListParams::default())
        .await
        .unwrap();
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for pod in pods.items {
        let Some(owner) = pod
            .owner_references()
            .iter()
            .find(|o| o.kind == "DaemonSet" && o.name.starts_with(toolkit::NAME))
            .map(|o| o.name.clone())
        else {
            continue;
        };
        if pod.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let node = pod.spec.and_then(|s| s.node_name).unwrap_or_default();
        out.entry(owner).or_default().insert(node);
    }
    out
}

/// Each GPU node's flavour label, as the operator wrote it.
async fn flavours(admin: &Client) -> BTreeMap<String, String> {
    Api::<Node>::all(admin.clone())
        .list_metadata(&ListParams::default().labels("nvidia.com/gpu.present=true"))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|n| {
            let flavour = n.labels().get(RUNTIME_FLAVOUR)?.clone();
            Some((n.name_any(), flavour))
        })
        .collect()
}

#[tokio::test]
async fn a_mixed_fleet_gets_one_toolkit_daemonset_per_runtime_flavour_and_read_only_nodes_none() {
    let Some(prepared) = session::builder().prepare().await else {
        return;
    };
    let admin = prepared.admin.clone();
    let added = distribution_nodes();
    let fakes: Vec<nodes::FakeNode> = added.iter().map(|(n, _)| n.clone()).collect();
    nodes::create(&admin, &fakes).await.unwrap();
    let s = prepared.start(json!({})).await;
    let namespace = s.identity.namespace.clone();

    // Every GPU node is labelled with the flavour its nodeInfo says.
    let expected: BTreeMap<String, &str> = added
        .iter()
        .map(|(n, flavour)| (n.name.clone(), *flavour))
        .collect();
    wait::until(TIMEOUT, "each added node labelled with its flavour", || {
        let (admin, expected) = (admin.clone(), expected.clone());
        async move {
            let found = flavours(&admin).await;
            let wrong: Vec<String> = expected
                .iter()
                .filter(|(node, flavour)| found.get(*node).map(String::as_str) != Some(**flavour))
                .map(|(node, flavour)| format!("{node}: {:?}, not {flavour}", found.get(node)))
                .collect();
            Ok(if wrong.is_empty() {
                Ok(())
            } else {
                Err(wrong.join("; "))
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));

    // One DaemonSet per flavour, each running exactly on its flavour's nodes; the read-only
    // node runs none.
    wait::until(
        TIMEOUT,
        "one toolkit DaemonSet per flavour on its nodes",
        || {
            let (admin, namespace) = (admin.clone(), namespace.clone());
            async move {
                let labels = flavours(&admin).await;
                let pods = toolkit_pods(&admin, &namespace).await;
                let mut by_flavour: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
                for (node, flavour) in labels.iter().filter(|(_, f)| !f.starts_with("read-only")) {
                    by_flavour
                        .entry(flavour.clone())
                        .or_default()
                        .insert(node.clone());
                }
                let got: BTreeSet<&BTreeSet<String>> = pods.values().collect();
                let want: BTreeSet<&BTreeSet<String>> = by_flavour.values().collect();
                Ok(if got == want && pods.len() == by_flavour.len() {
                    Ok(())
                } else {
                    Err(format!(
                        "pods by DaemonSet {pods:?}, nodes by flavour {by_flavour:?}"
                    ))
                })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));

    // Each DaemonSet selects one flavour, and the plain name stays with the stock one.
    let daemon_sets = Api::<DaemonSet>::namespaced(admin.clone(), &namespace)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    let selected: BTreeMap<String, String> = daemon_sets
        .iter()
        .filter(|d| d.name_any().starts_with(toolkit::NAME))
        .map(|d| {
            let selector = d
                .spec
                .as_ref()
                .and_then(|s| s.template.spec.as_ref())
                .and_then(|p| p.node_selector.as_ref())
                .and_then(|n| n.get(RUNTIME_FLAVOUR))
                .cloned()
                .unwrap_or_default();
            (d.name_any(), selector)
        })
        .collect();
    println!("toolkit DaemonSets by flavour: {selected:?}");
    assert_eq!(
        selected.get(toolkit::NAME).map(String::as_str),
        Some("containerd")
    );
    for flavour in ["k3s", "rke2", "crio"] {
        assert_eq!(
            selected
                .get(&format!("{}-{flavour}", toolkit::NAME))
                .map(String::as_str),
            Some(flavour),
            "{selected:?}"
        );
    }
    assert!(!selected.values().any(|f| f.starts_with("read-only")));

    // The read-only node is named in status with what to use instead.
    let policy = s.policy.clone();
    wait::until(TIMEOUT, "status names the read-only node", || {
        let (admin, policy) = (admin.clone(), policy.clone());
        async move {
            let message = session::ready_message(&admin, &policy).await?;
            Ok(
                if message.contains("read-only image") && message.contains("rt-bottlerocket-0") {
                    Ok(())
                } else {
                    Err(message)
                },
            )
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));

    s.teardown().await;
    let names: Vec<String> = added.iter().map(|(n, _)| n.name.clone()).collect();
    nodes::delete(&admin, &names).await.unwrap();
}
