//! GPU node pools and GPU memory as an extended resource (`spec.nodePools`,
//! `spec.gpuMemoryResource`, docs/node-pools.md), against the real scheduler: it honours taints
//! and counts extended resources, so "a pod without the toleration never lands on a GPU node"
//! and "four of five 12 GiB pods run" are the scheduler's verdicts, not ours. The operator runs
//! with its generated ClusterRole, so the node and node-status patches prove its RBAC too.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use e2e::cluster::unique_name;
use e2e::nodes::{self, GpuModel};
use e2e::session::{self, Setup, TIMEOUT};
use e2e::wait;
use gpu_operator::api::State;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const POOL_LABEL_TYPE: &str = "gpu-type";
/// A PriorityClass the node pool lists but someone else created first.
const OTHERS_PRIORITY_CLASS: &str = "gpu-experiments";

/// Asks the API server's authorizer whether the operator's ServiceAccount may `verb` the
/// core `resource` (with `subresource`).
async fn allowed(setup: &Setup, verb: &str, resource: &str, subresource: Option<&str>) -> bool {
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(setup.identity.username()),
            groups: Some(vec!["system:serviceaccounts".into()]),
            resource_attributes: Some(ResourceAttributes {
                verb: Some(verb.into()),
                resource: Some(resource.into()),
                subresource: subresource.map(Into::into),
                ..ResourceAttributes::default()
            }),
            ..SubjectAccessReviewSpec::default()
        },
        ..SubjectAccessReview::default()
    };
    Api::<SubjectAccessReview>::all(setup.admin.clone())
        .create(&PostParams::default(), &review)
        .await
        .unwrap()
        .status
        .is_some_and(|s| s.allowed)
}

async fn gpu_nodes(client: &Client) -> Vec<Node> {
    nodes::marked_gpu_nodes(client).await.unwrap()
}

fn has_taint(node: &Node, key: &str, value: &str) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .into_iter()
        .flatten()
        .any(|t| t.key == key && t.value.as_deref() == Some(value) && t.effect == "NoSchedule")
}

fn label<'a>(node: &'a Node, key: &str) -> Option<&'a str> {
    node.labels().get(key).map(String::as_str)
}

fn allocatable(node: &Node, resource: &str) -> Option<String> {
    node.status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .and_then(|a| a.get(resource))
        .map(|q| q.0.clone())
}

fn capacity(node: &Node, resource: &str) -> Option<String> {
    node.status
        .as_ref()
        .and_then(|s| s.capacity.as_ref())
        .and_then(|a| a.get(resource))
        .map(|q| q.0.clone())
}

/// Waits until `check` holds for every GPU node; the message names the first that fails.
async fn until_every_gpu_node(
    setup: &Setup,
    what: &str,
    check: impl Fn(&Node) -> Result<(), String> + Clone,
) {
    let admin = setup.admin.clone();
    wait::until(TIMEOUT, what, || {
        let (admin, check) = (admin.clone(), check.clone());
        async move {
            let nodes = gpu_nodes(&admin).await;
            if nodes.is_empty() {
                return Ok(Err("no GPU node".to_string()));
            }
            Ok(nodes
                .iter()
                .try_for_each(|n| check(n).map_err(|e| format!("{}: {e}", n.name_any()))))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", setup.operator.log_text()));
}

async fn test_namespace(admin: &Client) -> String {
    let name = unique_name("pool-workload");
    Api::<Namespace>::all(admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": name}})).unwrap(),
        )
        .await
        .unwrap();
    name
}

async fn create_pod(admin: &Client, namespace: &str, pod: serde_json::Value) {
    Api::<Pod>::namespaced(admin.clone(), namespace)
        .create(
            &PostParams::default(),
            &serde_json::from_value(pod).unwrap(),
        )
        .await
        .unwrap();
}

async fn delete_namespace(admin: &Client, name: &str) {
    Api::<Namespace>::all(admin.clone())
        .delete(name, &DeleteParams::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn node_pool_taints_and_labels_keep_other_pods_off_gpu_nodes_and_only_ours_are_removed() {
    let spec = json!({
        "nodePools": {
            "enabled": true,
            "taints": [
                {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                {"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}
            ],
            "labels": {"workload-class": "inference"},
            "derivedLabels": {"product": POOL_LABEL_TYPE, "memory": "gpu-memory", "count": "gpu-count"},
            "priorityClasses": [
                {"name": "gpu-inference", "value": 100000, "description": "inference preempts training"},
                {"name": "gpu-training", "value": 10000},
                {"name": OTHERS_PRIORITY_CLASS, "value": 1}
            ]
        }
    });
    let Some(prepared) = session::builder().prepare().await else {
        return;
    };
    // A PriorityClass of a name the section lists, created by someone else first.
    let classes: Api<PriorityClass> = Api::all(prepared.admin.clone());
    let _ = classes
        .delete(OTHERS_PRIORITY_CLASS, &DeleteParams::default())
        .await;
    classes
        .create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": OTHERS_PRIORITY_CLASS}, "value": 7}),
            )
            .unwrap(),
        )
        .await
        .unwrap();
    let setup = prepared.start(spec).await;
    assert!(allowed(&setup, "patch", "nodes", None).await);
    assert!(allowed(&setup, "patch", "nodes", Some("status")).await);

    // Every GPU node: both taints and the labels derived from its model.
    let expected: BTreeMap<&str, (&str, &str, &str)> = [
        (GpuModel::T4.product(), ("t4", "15Gi", "1")),
        (GpuModel::A100Sxm40Gb.product(), ("a100", "40Gi", "8")),
        (GpuModel::H100Sxm80Gb.product(), ("h100", "79Gi", "8")),
    ]
    .into();
    until_every_gpu_node(&setup, "GPU nodes tainted and labelled", move |n| {
        let product = label(n, "nvidia.com/gpu.product").unwrap_or_default();
        let (kind, memory, count) = expected.get(product).ok_or("unknown model")?;
        let want = [
            (POOL_LABEL_TYPE, *kind),
            ("gpu-memory", *memory),
            ("gpu-count", *count),
            ("workload-class", "inference"),
        ];
        for (k, v) in want {
            if label(n, k) != Some(v) {
                return Err(format!("label {k} is {:?}, want {v}", label(n, k)));
            }
        }
        if !has_taint(n, "dedicated", "gpu") || !has_taint(n, "nvidia.com/gpu", "present") {
            return Err(format!(
                "taints {:?}",
                n.spec.as_ref().and_then(|s| s.taints.clone())
            ));
        }
        Ok(())
    })
    .await;

    // The PriorityClasses, with their values; the one someone else made keeps its own.
    wait::until(TIMEOUT, "PriorityClasses created", || {
        let classes = classes.clone();
        async move {
            let value = |name: &str| {
                let classes = classes.clone();
                let name = name.to_owned();
                async move {
                    classes
                        .get_opt(&name)
                        .await
                        .map(|pc| pc.and_then(|pc| pc.value))
                }
            };
            let got = (value("gpu-inference").await?, value("gpu-training").await?);
            Ok(if got == (Some(100000), Some(10000)) {
                Ok(())
            } else {
                Err(format!("{got:?}"))
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", setup.operator.log_text()));
    assert_eq!(
        classes.get(OTHERS_PRIORITY_CLASS).await.unwrap().value,
        Some(7)
    );

    // GPU operands still run on every GPU node: each DaemonSet schedules one pod per GPU node
    // (the DaemonSet controller leaves out nodes whose taints a pod does not tolerate).
    setup
        .await_state(State::Ready, "policy ready on tainted nodes")
        .await;
    let gpu_count = gpu_nodes(&setup.admin).await.len() as i32;
    for name in [
        "nvidia-operator-validator",
        "nvidia-device-plugin-daemonset",
    ] {
        let ds: DaemonSet = setup.daemonsets().get(name).await.unwrap();
        let status = ds.status.unwrap();
        assert_eq!(status.desired_number_scheduled, gpu_count, "{name}");
        assert_eq!(status.number_ready, gpu_count, "{name}");
    }

    // Ordinary pods (no toleration) land only where there is no GPU.
    let namespace = test_namespace(&setup.admin).await;
    for i in 0..6 {
        create_pod(
            &setup.admin,
            &namespace,
            json!({"metadata": {"name": format!("ordinary-{i}")},
                   "spec": {"containers": [{"name": "c", "image": "busybox"}]}}),
        )
        .await;
    }
    let pods: Api<Pod> = Api::namespaced(setup.admin.clone(), &namespace);
    let placed = wait::until(TIMEOUT, "ordinary pods scheduled", || {
        let pods = pods.clone();
        async move {
            let list = pods.list(&ListParams::default()).await?.items;
            let nodes: Vec<String> = list
                .iter()
                .filter_map(|p| p.spec.as_ref()?.node_name.clone())
                .collect();
            Ok(if nodes.len() == list.len() {
                Ok(nodes)
            } else {
                Err(format!("{} of {} scheduled", nodes.len(), list.len()))
            })
        }
    })
    .await
    .unwrap();
    let gpu_names: Vec<String> = gpu_nodes(&setup.admin)
        .await
        .iter()
        .map(|n| n.name_any())
        .collect();
    for node in &placed {
        assert!(
            !gpu_names.contains(node),
            "an ordinary pod landed on GPU node {node}"
        );
    }
    delete_namespace(&setup.admin, &namespace).await;

    // The section removed: our taints and labels go; the nvidia.com/gpu taint that was on the
    // `gpu-tainted-*` nodes before (someone else's) stays.
    setup
        .patch_policy(json!({"spec": {"nodePools": null}}))
        .await;
    until_every_gpu_node(&setup, "our taints and labels removed", |n| {
        let name = n.name_any();
        if has_taint(n, "dedicated", "gpu") || label(n, POOL_LABEL_TYPE).is_some() {
            return Err("still has ours".into());
        }
        if label(n, "workload-class").is_some() {
            return Err("workload-class still there".into());
        }
        let others = name.starts_with("gpu-tainted");
        if has_taint(n, "nvidia.com/gpu", "present") != others {
            return Err(format!("nvidia.com/gpu taint present: {}", !others));
        }
        Ok(())
    })
    .await;
    wait::until(TIMEOUT, "our PriorityClasses deleted", || {
        let classes = classes.clone();
        async move {
            let left = (
                classes.get_opt("gpu-inference").await?,
                classes.get_opt("gpu-training").await?,
            );
            Ok(if left == (None, None) {
                Ok(())
            } else {
                Err("still there".to_string())
            })
        }
    })
    .await
    .unwrap();
    assert!(
        classes
            .get_opt(OTHERS_PRIORITY_CLASS)
            .await
            .unwrap()
            .is_some(),
        "someone else's stays"
    );
    classes
        .delete(OTHERS_PRIORITY_CLASS, &DeleteParams::default())
        .await
        .unwrap();
    setup.teardown().await;
}

/// A GPU node with 48 GiB of GPU memory: an A30 board reported twice (2 x 24 GiB).
fn node_with_48_gib(name: &str) -> nodes::FakeNode {
    session::ephemeral_gpu_node(name, GpuModel::A30).label("nvidia.com/gpu.count", "2")
}

#[tokio::test]
async fn gpu_memory_resource_follows_the_model_fits_four_of_five_12gib_pods_and_goes_when_off() {
    let resource = "example.com/vram";
    let spec = json!({"gpuMemoryResource": {"enabled": true, "name": resource}});
    let Some(setup) = session::start(spec, &[]).await else {
        return;
    };
    let node48 = unique_name("vram-48gib");
    nodes::create(&setup.admin, &[node_with_48_gib(&node48)])
        .await
        .unwrap();

    // Memory per GPU x GPUs, in GiB, per model: T4 15, A100-40GB 8 x 40, H100 8 x 81,559 MiB.
    let expected: BTreeMap<&str, &str> = [
        (GpuModel::T4.product(), "15"),
        (GpuModel::A100Sxm40Gb.product(), "320"),
        (GpuModel::H100Sxm80Gb.product(), "637"),
        (GpuModel::A30.product(), "48"),
    ]
    .into();
    until_every_gpu_node(&setup, "memory resource on every GPU node", move |n| {
        let product = label(n, "nvidia.com/gpu.product").unwrap_or_default();
        let want = expected.get(product).copied();
        let got = (capacity(n, resource), allocatable(n, resource));
        if want.is_some() && got == (want.map(Into::into), want.map(Into::into)) {
            Ok(())
        } else {
            Err(format!(
                "{product}: capacity/allocatable {got:?}, want {want:?}"
            ))
        }
    })
    .await;
    let policy = setup.await_state(State::Ready, "policy ready").await;
    let status = serde_json::to_string(&policy.status).unwrap();
    assert!(status.contains("not isolation"), "status says it: {status}");

    // The seed's example: five pods asking 12 GiB each on the 48 GiB node.
    let namespace = test_namespace(&setup.admin).await;
    for i in 0..5 {
        create_pod(
            &setup.admin,
            &namespace,
            json!({"metadata": {"name": format!("infer-{i}")},
                   "spec": {
                       "nodeSelector": {"kubernetes.io/hostname": node48},
                       "containers": [{"name": "c", "image": "busybox",
                                       "resources": {"requests": {resource: "12"}, "limits": {resource: "12"}}}]}}),
        )
        .await;
    }
    let pods: Api<Pod> = Api::namespaced(setup.admin.clone(), &namespace);
    wait::until(TIMEOUT, "four running, one unschedulable", || {
        let pods = pods.clone();
        async move {
            let list = pods.list(&ListParams::default()).await?.items;
            let running = list
                .iter()
                .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
                .count();
            let unschedulable: Vec<String> = list
                .iter()
                .filter_map(|p| {
                    p.status
                        .as_ref()?
                        .conditions
                        .as_ref()?
                        .iter()
                        .find(|c| {
                            c.type_ == "PodScheduled"
                                && c.reason.as_deref() == Some("Unschedulable")
                        })?
                        .message
                        .clone()
                })
                .collect();
            Ok(
                if running == 4
                    && unschedulable.len() == 1
                    && unschedulable[0].contains(&format!("Insufficient {resource}"))
                {
                    Ok(())
                } else {
                    Err(format!(
                        "{running} running, unschedulable: {unschedulable:?}"
                    ))
                },
            )
        }
    })
    .await
    .unwrap();
    delete_namespace(&setup.admin, &namespace).await;

    // A steady operator restarted writes no node: the capacity is patched only on change.
    let audit = e2e::audit::AuditLog::from_env().unwrap();
    let mut setup = setup;
    let mark = audit.mark().unwrap();
    setup.restart_operator().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let writes: Vec<String> = audit
        .mutating_since(mark, &setup.identity.username())
        .unwrap()
        .iter()
        .filter(|e| e.resource().starts_with("nodes"))
        .map(|e| format!("{} {}", e.resource(), e.name().unwrap_or_default()))
        .collect();
    assert!(writes.is_empty(), "node writes after a restart: {writes:?}");

    // Switched off: the resource leaves every node.
    setup
        .patch_policy(json!({"spec": {"gpuMemoryResource": {"enabled": false}}}))
        .await;
    until_every_gpu_node(&setup, "memory resource removed", move |n| {
        match (capacity(n, resource), allocatable(n, resource)) {
            (None, None) => Ok(()),
            got => Err(format!("still {got:?}")),
        }
    })
    .await;
    nodes::delete(&setup.admin, &[node48]).await.unwrap();
    setup.teardown().await;
}
