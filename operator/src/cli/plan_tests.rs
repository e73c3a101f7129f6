//! The plan's pure half: what each GPU node advertises under a preview's configs, and the plan's
//! text and JSON (golden files in src/cli/testdata).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::cli::golden::assert_golden;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ConfigMap, Node};
use serde_json::json;

use super::*;
use crate::controller::upgrade::forecast::forecast;
use crate::controller::upgrade::machine::{
    DriverPod, DriverRevision, NodeFacts, PodFacts, UpgradeState,
};
use crate::render::inputs::{RenderOptions, facts_for};

const TS_4: &str = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n";
const TS_4_RENAMED: &str = "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n";

fn node(name: &str, product: &str, count: u32, labels: &[(&str, &str)]) -> Node {
    let mut all: BTreeMap<String, String> = [
        ("feature.node.kubernetes.io/pci-10de.present", "true"),
        ("nvidia.com/gpu.present", "true"),
        ("nvidia.com/gpu.product", product),
        (
            "nvidia.com/mig.capable",
            if product.contains("A100") {
                "true"
            } else {
                "false"
            },
        ),
    ]
    .iter()
    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
    .collect();
    all.insert("nvidia.com/gpu.count".to_owned(), count.to_string());
    all.extend(
        labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    serde_json::from_value(json!({"metadata": {"name": name, "labels": all}})).unwrap()
}

/// The preview of `spec` over `nodes` with the sharing ConfigMap `sharing`, as a pass makes it.
fn preview(spec: serde_json::Value, nodes: Vec<Node>) -> Preview {
    let policy: ClusterPolicy = serde_json::from_value(json!({
        "apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy",
        "metadata": {"name": "gpu-cluster-policy"}, "spec": spec
    }))
    .unwrap();
    let sharing: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "sharing", "namespace": "gpu-operator"},
        "data": {"off": "version: v1\n", "ts-4": TS_4, "ts-4-renamed": TS_4_RENAMED}
    }))
    .unwrap();
    let options = RenderOptions {
        namespace: "gpu-operator".to_owned(),
        runtime: None,
        openshift: false,
        os_tag: None,
        service_monitor_api: false,
        nfd_running: false,
        sharing_config: None,
        mig_config: None,
        dcgm_metrics: None,
        config_maps: vec![sharing],
        nodes,
        driver_toolkit: None,
    };
    let facts = facts_for(&policy, &options).unwrap();
    let validated = crate::validate::validate(&policy, &facts);
    let desired = crate::render::render(&validated, &facts);
    Preview {
        validated,
        facts,
        desired,
        notes: Vec::new(),
    }
}

fn labels(node: &Node) -> BTreeMap<String, String> {
    node.metadata.labels.clone().unwrap_or_default()
}

fn counts(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect()
}

#[test]
fn a_node_advertises_its_sharing_keys_replicas_and_the_default_key_without_a_label() {
    let t4 = node(
        "t4",
        "Tesla-T4",
        4,
        &[("nvidia.com/device-plugin.config", "ts-4")],
    );
    let renamed = node(
        "t4-r",
        "Tesla-T4",
        4,
        &[("nvidia.com/device-plugin.config", "ts-4-renamed")],
    );
    let plain = node("t4-p", "Tesla-T4", 4, &[]);
    let p = preview(
        json!({"devicePlugin": {"config": {"name": "sharing", "default": "off"}}}),
        vec![t4.clone(), renamed.clone(), plain.clone()],
    );
    // Time-slicing: each GPU is advertised `replicas` times.
    assert_eq!(
        predicted(&p, &labels(&t4)),
        Ok(counts(&[("nvidia.com/gpu", 16)]))
    );
    // renameByDefault: the replicas go under `<name>.shared`.
    assert_eq!(
        predicted(&p, &labels(&renamed)),
        Ok(counts(&[("nvidia.com/gpu.shared", 16)]))
    );
    // No label: the config's default key (`off`): whole GPUs.
    assert_eq!(
        predicted(&p, &labels(&plain)),
        Ok(counts(&[("nvidia.com/gpu", 4)]))
    );
    // A key the config lacks is named.
    let missing = node(
        "t4-m",
        "Tesla-T4",
        4,
        &[("nvidia.com/device-plugin.config", "ts-8")],
    );
    let err = predicted(&p, &labels(&missing)).unwrap_err();
    assert!(err.contains("\"ts-8\""), "{err}");
}

#[test]
fn a_node_serving_virtual_machines_advertises_no_gpu_resource() {
    let vm = node(
        "a100-vm",
        "NVIDIA-A100-SXM4-40GB",
        8,
        &[("nvidia.com/gpu.workload.config", "vm-passthrough")],
    );
    let on = preview(
        json!({"sandboxWorkloads": {"enabled": true}}),
        vec![vm.clone()],
    );
    assert_eq!(predicted(&on, &labels(&vm)), Ok(BTreeMap::new()));
    // Sandbox workloads off: the label means nothing and the GPUs are advertised whole.
    let off = preview(json!({}), vec![vm.clone()]);
    assert_eq!(
        predicted(&off, &labels(&vm)),
        Ok(counts(&[("nvidia.com/gpu", 8)]))
    );
}

#[test]
fn a_mig_layout_is_advertised_by_the_strategy_from_the_default_mig_parted_config() {
    let a100 = node(
        "a100",
        "NVIDIA-A100-SXM4-40GB",
        8,
        &[("nvidia.com/mig.config", "all-1g.5gb")],
    );
    let mixed = preview(json!({"mig": {"strategy": "mixed"}}), vec![a100.clone()]);
    assert_eq!(
        predicted(&mixed, &labels(&a100)),
        Ok(counts(&[("nvidia.com/mig-1g.5gb", 56)]))
    );
    let single = preview(json!({"mig": {"strategy": "single"}}), vec![a100.clone()]);
    assert_eq!(
        predicted(&single, &labels(&a100)),
        Ok(counts(&[("nvidia.com/gpu", 56)]))
    );
    // MIG manager off: the label is nobody's to act on; whole GPUs.
    let off = preview(
        json!({"mig": {"strategy": "mixed"}, "migManager": {"enabled": false}}),
        vec![a100.clone()],
    );
    assert_eq!(
        predicted(&off, &labels(&a100)),
        Ok(counts(&[("nvidia.com/gpu", 8)]))
    );
    // A layout with no entry for the model cannot be predicted, and says why.
    let t4 = node(
        "t4",
        "Tesla-T4",
        1,
        &[("nvidia.com/mig.config", "all-1g.5gb")],
    );
    let p = preview(json!({"mig": {"strategy": "mixed"}}), vec![t4.clone()]);
    assert!(
        predicted(&p, &labels(&t4))
            .unwrap_err()
            .contains("all-1g.5gb")
    );
}

fn facts(name: &str, pods: &[&str]) -> NodeFacts {
    NodeFacts {
        name: name.into(),
        state: Some(UpgradeState::Done),
        driver: Some(DriverPod {
            name: format!("nvidia-driver-daemonset-{name}"),
            daemon_set: "nvidia-driver-daemonset".into(),
            revision: DriverRevision::Outdated,
            ready: true,
            ..DriverPod::default()
        }),
        gpu_pods: pods
            .iter()
            .map(|p| PodFacts {
                namespace: "ml".into(),
                name: (*p).into(),
                managed: true,
                ..PodFacts::default()
            })
            .collect(),
        ..NodeFacts::default()
    }
}

/// One plan of each kind of consequence, as text and JSON.
#[test]
fn the_plan_reads_the_same_as_text_and_json() {
    let spec: crate::api::DriverUpgradePolicySpec =
        serde_json::from_value(json!({"autoUpgrade": true, "maxParallelUpgrades": 2})).unwrap();
    let policy = crate::controller::upgrade::machine::Policy::from_spec(&spec, 3);
    let nodes = [
        facts("gpu-a", &["train-0"]),
        facts("gpu-b", &[]),
        facts("gpu-c", &["train-1"]),
    ];
    let t4 = node(
        "gpu-t4",
        "Tesla-T4",
        4,
        &[("nvidia.com/device-plugin.config", "ts-4")],
    );
    let p = preview(
        json!({"devicePlugin": {"config": {"name": "sharing", "default": "off"}}}),
        vec![t4.clone()],
    );
    let plan = Plan {
        version: 1,
        policy: "gpu-cluster-policy".to_owned(),
        change: "update".to_owned(),
        verdicts: vec![Verdict {
            component: "mig-manager".to_owned(),
            state: "invalid".to_owned(),
            message: "migManager.config.name: ConfigMap custom-mig-parted-config not found in gpu-operator; create it or remove the field".to_owned(),
        }],
        objects: vec![
            ObjectChange {
                object: "DaemonSet gpu-operator/nvidia-driver-daemonset".to_owned(),
                change: "changed".to_owned(),
                fields: vec![
                    ".spec.template.spec.containers[name=nvidia-driver-ctr].image: \"nvcr.io/nvidia/driver:595.91.07-ubuntu22.04\" -> \"nvcr.io/nvidia/driver:600.10.01-ubuntu22.04\"".to_owned(),
                ],
            },
            ObjectChange {
                object: "ConfigMap gpu-operator/sharing-5f2c".to_owned(),
                change: "created".to_owned(),
                fields: Vec::new(),
            },
        ],
        rollouts: vec![
            Rollout {
                daemon_set: "nvidia-driver-daemonset".to_owned(),
                outcome: "driver-upgrade".to_owned(),
                nodes: 3,
            },
            Rollout {
                daemon_set: "nvidia-device-plugin-daemonset".to_owned(),
                outcome: "pods-roll".to_owned(),
                nodes: 3,
            },
        ],
        driver_upgrade: Some(driver_upgrade(&policy, &forecast(&nodes, &policy))),
        node_labels: vec![NodeLabels {
            node: "gpu-t4".to_owned(),
            set: BTreeMap::from([("nvidia.com/device-plugin.config".to_owned(), "ts-4".to_owned())]),
            removed: Vec::new(),
            kept: vec!["nvidia.com/mig.config".to_owned()],
        }],
        allocatable: vec![NodeAllocatable {
            node: "gpu-t4".to_owned(),
            now: BTreeMap::from([("nvidia.com/gpu".to_owned(), "4".to_owned())]),
            planned: predicted(&p, &labels(&t4)).ok(),
            error: None,
        }],
        ..Plan::default()
    };
    assert_golden("plan.txt", &text(&plan));
    assert_golden(
        "plan.json",
        &(serde_json::to_string_pretty(&plan).unwrap() + "\n"),
    );
}

fn placed_node(name: &str, labels: Value, taints: Value) -> Node {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"taints": taints},
    }))
    .unwrap()
}

#[test]
fn a_new_daemon_set_counts_the_nodes_the_daemon_set_controller_would_place_a_pod_on() {
    let ds: DaemonSet = serde_json::from_value(json!({
        "metadata": {"name": "plugin"},
        "spec": {
            "selector": {},
            "template": {"spec": {
                "containers": [],
                "nodeSelector": {"nvidia.com/gpu.deploy.device-plugin": "true"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [
                        {"key": "pool", "operator": "NotIn", "values": ["excluded"]}]}]}}},
            }},
        },
    }))
    .unwrap();
    let gpu = json!({"nvidia.com/gpu.deploy.device-plugin": "true"});
    let nodes = [
        placed_node("plain", gpu.clone(), json!([])),
        // Tolerated by the template, by the controller's own tolerations (a cordon), or only
        // ranked (PreferNoSchedule): placed.
        placed_node(
            "gpu-tainted",
            gpu.clone(),
            json!([{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]),
        ),
        placed_node(
            "cordoned",
            gpu.clone(),
            json!([{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}]),
        ),
        placed_node(
            "preferred-off",
            gpu.clone(),
            json!([{"key": "x", "effect": "PreferNoSchedule"}]),
        ),
        // Kept off: an untolerated taint, the selector, the required affinity.
        placed_node(
            "dedicated",
            gpu.clone(),
            json!([{"key": "dedicated", "value": "infra", "effect": "NoExecute"}]),
        ),
        placed_node("cpu", json!({}), json!([])),
        placed_node(
            "excluded",
            json!({"nvidia.com/gpu.deploy.device-plugin": "true", "pool": "excluded"}),
            json!([]),
        ),
    ];
    assert_eq!(selected(&ds, &nodes), 4);
    // network-unavailable is the controller's to tolerate only for host-network pods.
    let unavailable = [placed_node(
        "no-network",
        gpu,
        json!([{"key": "node.kubernetes.io/network-unavailable", "effect": "NoSchedule"}]),
    )];
    assert_eq!(selected(&ds, &unavailable), 0);
    let mut host = ds.clone();
    host.spec
        .as_mut()
        .unwrap()
        .template
        .spec
        .as_mut()
        .unwrap()
        .host_network = Some(true);
    assert_eq!(selected(&host, &unavailable), 1);
}
