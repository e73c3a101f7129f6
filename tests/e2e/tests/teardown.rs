//! Uninstall and teardown (decision 17, docs/install.md "Uninstalling"): deleting the policy
//! while the operator runs takes what the operator put on the nodes off them (node-pool taints
//! and labels, the GPU memory resource, deploy labels, the driver upgrade's labels and its own
//! cordons) and keeps PriorityClasses that running pods name; `helm uninstall` with default
//! values leaves the GPU stack running; and a policy deleted with no operator running is
//! finished by `gpu-operator cleanup`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use e2e::chaos::CrashLoop;
use e2e::cluster::unique_name;
use e2e::helm::{RELEASE, helm_ok, helm_release, release_namespace, strings};
use e2e::nodes;
use e2e::operator::{self, Operator, OperatorIdentity};
use e2e::session::{self, Setup, TIMEOUT, policies};
use e2e::wait;
use gpu_operator::api::State;
use gpu_operator::node_pools::RECORD_ANNOTATION;
use gpu_operator::nodes::DEPLOY_KEYS;
use gpu_operator::teardown::FINALIZER;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const MEMORY_RESOURCE: &str = "example.com/vram";
const POOL_LABELS: [&str; 4] = ["workload-class", "gpu-type", "gpu-memory", "gpu-count"];
const UPGRADE_STATE: &str = "nvidia.com/gpu-driver-upgrade-state";
const HELD_CLASS: &str = "teardown-held";
const FREE_CLASS: &str = "teardown-free";
/// The standard fleet's nodes that carry `nvidia.com/gpu=present:NoSchedule` from the start
/// (someone else's taint, which stays).
const OTHERS_TAINTED: &str = "gpu-tainted";

fn taints(node: &Node) -> Vec<String> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default()
        .iter()
        .map(|t| {
            format!(
                "{}={}:{}",
                t.key,
                t.value.as_deref().unwrap_or_default(),
                t.effect
            )
        })
        .collect()
}

fn cordoned(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.unschedulable)
        .unwrap_or(false)
}

fn has_resource(node: &Node, name: &str) -> bool {
    let status = node.status.as_ref();
    [
        status.and_then(|s| s.capacity.as_ref()),
        status.and_then(|s| s.allocatable.as_ref()),
    ]
    .into_iter()
    .flatten()
    .any(|m| m.contains_key(name))
}

/// What of the operator's is still on `node`: every mark a teardown must take off. A cordon
/// counts unless the node is in `cordoned_by_others`.
fn operator_marks(node: &Node, cordoned_by_others: &[String]) -> Vec<String> {
    let name = node.name_any();
    let mut left = Vec::new();
    for (key, value) in node.labels() {
        let deploy = DEPLOY_KEYS.contains(&key.as_str()) && value == "true";
        let present = key == "nvidia.com/gpu.present" && value == "true";
        if deploy || present || POOL_LABELS.contains(&key.as_str()) || key == UPGRADE_STATE {
            left.push(format!("label {key}={value}"));
        }
    }
    for key in node.annotations().keys() {
        if key == RECORD_ANNOTATION || key.contains("driver-upgrade") {
            left.push(format!("annotation {key}"));
        }
    }
    for taint in taints(node) {
        let ours = taint.starts_with("dedicated=")
            || (taint == "nvidia.com/gpu=present:NoSchedule" && !name.starts_with(OTHERS_TAINTED));
        if ours {
            left.push(format!("taint {taint}"));
        }
    }
    if has_resource(node, MEMORY_RESOURCE) {
        left.push(format!("capacity {MEMORY_RESOURCE}"));
    }
    if cordoned(node) && !cordoned_by_others.contains(&name) {
        left.push("cordon".to_owned());
    }
    left
}

/// Every node with something of the operator's left, and what.
async fn dirty_nodes(
    admin: &Client,
    cordoned_by_others: &[String],
) -> BTreeMap<String, Vec<String>> {
    Api::<Node>::all(admin.clone())
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|n| (n.name_any(), operator_marks(n, cordoned_by_others)))
        .filter(|(_, left)| !left.is_empty())
        .collect()
}

async fn gpu_nodes(admin: &Client) -> Vec<Node> {
    let names = nodes::gpu_node_names(admin).await.unwrap();
    let api = Api::<Node>::all(admin.clone());
    let mut out = Vec::new();
    for name in names {
        out.push(api.get(&name).await.unwrap());
    }
    out.sort_by_key(|n| n.name_any());
    out
}

/// Deletes the policy of `s` and waits until it is gone: the operator's teardown removed its
/// finalizer.
async fn delete_and_await_gone(s: &Setup) {
    let api = policies(&s.admin);
    api.delete(&s.policy, &DeleteParams::default())
        .await
        .unwrap();
    let name = s.policy.clone();
    wait::until(TIMEOUT, "policy torn down and gone", || {
        let (api, name) = (api.clone(), name.clone());
        async move {
            Ok(match api.get_opt(&name).await? {
                None => Ok(()),
                Some(p) => Err(format!("still there, finalizers {:?}", p.finalizers())),
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
}

#[tokio::test]
async fn deleting_the_policy_takes_pool_taints_labels_and_memory_off_the_nodes_and_keeps_priority_classes_pods_use()
 {
    let spec = json!({
        "nodePools": {
            "enabled": true,
            "taints": [
                {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                {"key": "dedicated", "value": "gpu", "effect": "NoExecute"}
            ],
            "labels": {"workload-class": "inference"},
            "derivedLabels": {"product": "gpu-type", "memory": "gpu-memory", "count": "gpu-count"},
            "priorityClasses": [
                {"name": HELD_CLASS, "value": 1000},
                {"name": FREE_CLASS, "value": 500}
            ]
        },
        "gpuMemoryResource": {"enabled": true, "name": MEMORY_RESOURCE}
    });
    let Some(prepared) = session::builder().prepare().await else {
        return;
    };
    let classes: Api<PriorityClass> = Api::all(prepared.admin.clone());
    for name in [HELD_CLASS, FREE_CLASS] {
        let _ = classes.delete(name, &DeleteParams::default()).await;
    }
    let s = prepared.start(spec).await;
    let admin = s.admin.clone();

    // Every GPU node carries the pool's marks and the memory resource; both classes exist.
    let check_admin = admin.clone();
    wait::until(TIMEOUT, "GPU nodes marked, PriorityClasses created", || {
        let (admin, classes) = (check_admin.clone(), classes.clone());
        async move {
            for node in gpu_nodes(&admin).await {
                let marked = taints(&node).contains(&"dedicated=gpu:NoExecute".to_owned())
                    && node.labels().contains_key("gpu-type")
                    && has_resource(&node, MEMORY_RESOURCE);
                if !marked {
                    return Ok(Err(format!("{} not marked yet", node.name_any())));
                }
            }
            let both = classes.get_opt(HELD_CLASS).await?.is_some()
                && classes.get_opt(FREE_CLASS).await?.is_some();
            Ok(if both {
                Ok(())
            } else {
                Err("PriorityClasses missing".to_owned())
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));

    // A running workload names one class (it lands on a node without GPU taints).
    let namespace = unique_name("teardown-workload");
    Api::<Namespace>::all(admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": namespace}})).unwrap(),
        )
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &namespace);
    let pod = json!({"metadata": {"name": "job"},
        "spec": {"priorityClassName": HELD_CLASS,
                 "containers": [{"name": "c", "image": "busybox"}]}});
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(pod).unwrap(),
    )
    .await
    .unwrap();
    wait::until(TIMEOUT, "workload running", || {
        let pods = pods.clone();
        async move {
            let phase = pods.get("job").await?.status.and_then(|s| s.phase);
            Ok(if phase.as_deref() == Some("Running") {
                Ok(())
            } else {
                Err(format!("{phase:?}"))
            })
        }
    })
    .await
    .unwrap();

    delete_and_await_gone(&s).await;
    let dirty = dirty_nodes(&admin, &[]).await;
    assert!(
        dirty.is_empty(),
        "left on the nodes after the teardown: {dirty:#?}\noperator log:\n{}",
        s.operator.log_text()
    );
    for node in gpu_nodes(&admin).await {
        let others = node.name_any().starts_with(OTHERS_TAINTED);
        assert_eq!(
            taints(&node).contains(&"nvidia.com/gpu=present:NoSchedule".to_owned()),
            others,
            "{}: someone else's taint stays, ours goes",
            node.name_any()
        );
    }
    // Garbage collection has finished with the operands: the class the pod names is still there.
    wait::until_none_left(
        &s.daemonsets(),
        &ListParams::default(),
        TIMEOUT,
        "operands garbage-collected",
    )
    .await
    .unwrap();
    assert!(
        classes.get_opt(HELD_CLASS).await.unwrap().is_some(),
        "the PriorityClass a running pod names is gone"
    );
    assert!(
        classes.get_opt(FREE_CLASS).await.unwrap().is_none(),
        "the PriorityClass no pod names is left"
    );
    let log = s.operator.log_text();
    for said in [
        "teardown: removed the operator's marks from node",
        "teardown: PriorityClass kept",
        "teardown: PriorityClass deleted",
        "teardown: finalizer removed",
    ] {
        assert!(
            log.contains(said),
            "the operator did not log {said:?}:\n{log}"
        );
    }

    Api::<Namespace>::all(admin.clone())
        .delete(&namespace, &DeleteParams::default())
        .await
        .unwrap();
    classes
        .delete(HELD_CLASS, &DeleteParams::default())
        .await
        .unwrap();
    s.teardown().await;
}

#[tokio::test]
async fn deleting_the_policy_mid_driver_upgrade_lifts_only_the_upgrades_cordon_and_clears_its_labels()
 {
    let spec = json!({"driver": {"upgradePolicy": {
        "autoUpgrade": true, "maxParallelUpgrades": 1, "maxUnavailable": 2
    }}});
    let Some(s) = session::start(spec, &[]).await else {
        return;
    };
    let admin = s.admin.clone();
    s.await_state(State::Ready, "policy ready").await;
    let check_admin = admin.clone();
    wait::until(
        Duration::from_secs(240),
        "every GPU node upgrade-done",
        || {
            let admin = check_admin.clone();
            async move {
                let states: Vec<String> = gpu_nodes(&admin)
                    .await
                    .iter()
                    .map(|n| n.labels().get(UPGRADE_STATE).cloned().unwrap_or_default())
                    .collect();
                Ok(if states.iter().all(|s| s == "upgrade-done") {
                    Ok(())
                } else {
                    Err(format!("{states:?}"))
                })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));

    // The first node by name upgrades first; its new validator never gets ready, so it stays
    // cordoned by the upgrade. The last one its owner cordoned before.
    let names: Vec<String> = gpu_nodes(&admin)
        .await
        .iter()
        .map(|n| n.name_any())
        .collect();
    let upgrading = names.first().unwrap().clone();
    let owners = names.last().unwrap().clone();
    let node_api = Api::<Node>::all(admin.clone());
    let cordon = |on: bool| json!({"spec": {"unschedulable": on}});
    node_api
        .patch(
            &owners,
            &PatchParams::default(),
            &Patch::Merge(cordon(true)),
        )
        .await
        .unwrap();
    let chaos = CrashLoop::start(&admin, &upgrading, "nvidia-operator-validator")
        .await
        .unwrap();
    s.patch_policy(json!({"spec": {"driver": {
        "repository": "nvcr.io/nvidia", "image": "driver", "version": "600.10.01"
    }}}))
    .await;
    let (api, node) = (node_api.clone(), upgrading.clone());
    wait::until(
        Duration::from_secs(240),
        "the upgrading node cordoned",
        || {
            let (api, node) = (api.clone(), node.clone());
            async move {
                let n = api.get(&node).await?;
                let state = n.labels().get(UPGRADE_STATE).cloned().unwrap_or_default();
                let between = !["", "upgrade-required", "upgrade-done"].contains(&state.as_str());
                Ok(if between && cordoned(&n) {
                    Ok(())
                } else {
                    Err(format!("state {state:?}, cordoned {}", cordoned(&n)))
                })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));

    delete_and_await_gone(&s).await;
    let dirty = dirty_nodes(&admin, std::slice::from_ref(&owners)).await;
    assert!(
        dirty.is_empty(),
        "left on the nodes after the teardown: {dirty:#?}\noperator log:\n{}",
        s.operator.log_text()
    );
    assert!(
        cordoned(&node_api.get(&owners).await.unwrap()),
        "the owner's cordon on {owners} was lifted"
    );
    assert!(
        s.operator.log_text().contains("the upgrade's cordon"),
        "the operator did not log the cordon it lifted:\n{}",
        s.operator.log_text()
    );

    node_api
        .patch(
            &owners,
            &PatchParams::default(),
            &Patch::Merge(cordon(false)),
        )
        .await
        .unwrap();
    chaos.recover().await.unwrap();
    s.teardown().await;
}

/// The driver pods in `namespace`: name -> uid, for those not being deleted and Running.
async fn running_driver_pods(admin: &Client, namespace: &str) -> BTreeMap<String, String> {
    Api::<Pod>::namespaced(admin.clone(), namespace)
        .list(&ListParams::default().labels("app=nvidia-driver-daemonset"))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| {
            p.metadata.deletion_timestamp.is_none()
                && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
        })
        .map(|p| (p.name_any(), p.uid().unwrap_or_default()))
        .collect()
}

#[tokio::test]
async fn helm_uninstall_keeps_the_driver_running_and_gpu_operator_cleanup_finishes_a_later_teardown()
 {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    e2e::helm::remove_releases(&admin).await;
    e2e::crd::install_cluster_policy_crd(&admin, "e2e-teardown")
        .await
        .unwrap();
    session::remove_leftovers(&admin).await;
    let namespace = release_namespace(&admin).await;
    helm_release("install", &namespace, &[]);
    let identity = OperatorIdentity::existing(&admin, &namespace, "gpu-operator")
        .await
        .unwrap();
    let mut operator = Operator::start_as_pod(&identity, &format!("{RELEASE}-e2e")).unwrap();
    let policy = "cluster-policy";
    session::await_policy_state(
        &admin,
        policy,
        State::Ready,
        "policy ready after helm install",
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
    let gpu_count = nodes::gpu_node_names(&admin).await.unwrap().len();
    let drivers = running_driver_pods(&admin, &namespace).await;
    assert_eq!(drivers.len(), gpu_count, "{drivers:?}");
    let dirty = dirty_nodes(&admin, &[]).await;
    assert!(!dirty.is_empty(), "the operator marked no node");

    // (b) Uninstalled with default values: the policy and every driver pod stay.
    helm_ok(&strings(&[
        "uninstall",
        RELEASE,
        "--namespace",
        &namespace,
        "--wait",
    ]));
    operator.terminate(Duration::from_secs(20)).unwrap();
    let api = policies(&admin);
    // Long enough for the garbage collector to act on a deleted owner, which it does within a
    // second or two on the harness.
    for _ in 0..8 {
        let kept = api.get_opt(policy).await.unwrap();
        assert!(
            kept.as_ref()
                .is_some_and(|p| p.metadata.deletion_timestamp.is_none()),
            "helm uninstall deleted the policy: {:?}",
            kept.map(|p| p.metadata)
        );
        assert_eq!(
            running_driver_pods(&admin, &namespace).await,
            drivers,
            "driver pods changed after helm uninstall"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }

    // (c) The kept policy deleted later, with no operator: its finalizer holds it until
    // `gpu-operator cleanup` has cleaned the nodes.
    api.delete(policy, &DeleteParams::default()).await.unwrap();
    let held = api.get(policy).await.unwrap();
    assert!(
        held.finalizers().iter().any(|f| f == FINALIZER),
        "{:?}",
        held.finalizers()
    );
    let out = Command::new(operator::binary().unwrap())
        .arg("cleanup")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "gpu-operator cleanup failed:\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(&format!("ClusterPolicy {policy}: finalizer removed")),
        "{stdout}"
    );
    assert!(stdout.contains("node "), "{stdout}");
    wait::until_none_left(&api, &ListParams::default(), TIMEOUT, "policy gone")
        .await
        .unwrap();
    let dirty = dirty_nodes(&admin, &[]).await;
    assert!(dirty.is_empty(), "left on the nodes: {dirty:#?}\n{stdout}");
    // A second run finds nothing to do.
    let again = Command::new(operator::binary().unwrap())
        .arg("cleanup")
        .output()
        .unwrap();
    assert!(again.status.success());
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("nothing of the operator's was left"),
        "{}",
        String::from_utf8_lossy(&again.stdout)
    );

    wait::until_none_left(
        &Api::<DaemonSet>::namespaced(admin.clone(), &namespace),
        &ListParams::default(),
        TIMEOUT,
        "operands garbage-collected",
    )
    .await
    .unwrap();
    Api::<Namespace>::all(admin.clone())
        .delete(&namespace, &DeleteParams::default())
        .await
        .unwrap();
}
