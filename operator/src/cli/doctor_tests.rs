//! The doctor's diagnosis on hand-made snapshots: one healthy cluster (its table is a golden
//! file) and each fault of the checklist made from it by one change.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::cli::golden::assert_golden;
use k8s_openapi::api::core::v1::{
    Container, ContainerState, ContainerStateWaiting, ContainerStatus, NodeSpec, NodeStatus,
    PodCondition, PodSpec, PodStatus,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::ObjectMeta;
use serde_json::json;

use clap::Parser as _;

use super::*;
use crate::api::State;

fn node(name: &str, product: &str, count: u32, gpus: u32, taint: bool) -> Node {
    let labels = [
        ("kubernetes.io/hostname", name.to_string()),
        ("nvidia.com/gpu.present", "true".into()),
        ("feature.node.kubernetes.io/pci-10de.present", "true".into()),
        ("nvidia.com/gpu.product", product.into()),
        ("nvidia.com/gpu.count", count.to_string()),
        ("nvidia.com/gpu.deploy.driver", "true".into()),
        ("nvidia.com/gpu.deploy.operator-validator", "true".into()),
        ("nvidia.com/gpu.deploy.device-plugin", "true".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let allocatable = [("nvidia.com/gpu".to_string(), Quantity(gpus.to_string()))].into();
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(labels),
            ..ObjectMeta::default()
        },
        spec: Some(NodeSpec {
            taints: taint.then(|| {
                vec![Taint {
                    key: "nvidia.com/gpu".into(),
                    value: Some("present".into()),
                    effect: "NoSchedule".into(),
                    time_added: None,
                }]
            }),
            ..NodeSpec::default()
        }),
        status: Some(NodeStatus {
            allocatable: Some(allocatable),
            ..NodeStatus::default()
        }),
    }
}

fn cpu_node() -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some("cpu-0".into()),
            ..ObjectMeta::default()
        },
        ..Node::default()
    }
}

fn operand_pod(operand: &str, node: &str, waiting: Option<&str>) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(format!("{operand}-{node}")),
            namespace: Some("gpu-operator".into()),
            labels: Some(
                [
                    ("app.kubernetes.io/name".to_string(), operand.to_string()),
                    (
                        "app.kubernetes.io/managed-by".to_string(),
                        "gpu-operator".to_string(),
                    ),
                ]
                .into(),
            ),
            owner_references: Some(vec![
                serde_json::from_value(json!({
                    "apiVersion": "apps/v1", "kind": "DaemonSet", "name": operand, "uid": "1"
                }))
                .unwrap(),
            ]),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            containers: vec![Container {
                name: format!("{operand}-ctr"),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        status: Some(PodStatus {
            phase: Some("Running".into()),
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: if waiting.is_some() { "False" } else { "True" }.into(),
                ..PodCondition::default()
            }]),
            container_statuses: waiting.map(|reason| {
                vec![ContainerStatus {
                    name: format!("{operand}-ctr"),
                    state: Some(ContainerState {
                        waiting: Some(ContainerStateWaiting {
                            reason: Some(reason.into()),
                            message: None,
                        }),
                        ..ContainerState::default()
                    }),
                    ..ContainerStatus::default()
                }]
            }),
            ..PodStatus::default()
        }),
    }
}

/// A condition as the operator writes it, for generation 1.
fn condition(kind: &str, ok: bool, reason: &str, message: &str) -> serde_json::Value {
    json!({
        "type": kind, "status": if ok { "True" } else { "False" }, "reason": reason,
        "message": message, "observedGeneration": 1,
        "lastTransitionTime": "2026-01-01T00:00:00Z"
    })
}

/// A component as the operator writes it for a DaemonSet on two nodes.
fn component(name: &str, daemon_set: &str, available: i32, message: &str) -> serde_json::Value {
    json!({
        "name": name, "daemonSet": daemon_set, "desired": 2, "updated": 2, "ready": available,
        "available": available, "labeledNodes": 2, "message": message
    })
}

/// The status of a ready policy on `healthy()`'s two GPU nodes.
fn ready_status() -> serde_json::Value {
    json!({
        "state": "ready",
        "namespace": "gpu-operator",
        "conditions": [
            condition("Ready", true, "Ready", "all operands ready on 2 GPU nodes"),
            condition("Error", false, "NoError", "")
        ],
        "components": [
            component("driver", "nvidia-driver-daemonset", 2, "2/2 pods ready; upgrade pending on 1 nodes"),
            component("device-plugin", "nvidia-device-plugin-daemonset", 2, "2/2 pods ready"),
            component("operator-validator", "nvidia-operator-validator", 2, "2/2 pods ready")
        ],
        "gpuNodes": 2,
        "operandsReady": "3/3"
    })
}

/// A policy named `name` with `spec` and `status` (generation 1).
fn policy_named(name: &str, spec: serde_json::Value, status: serde_json::Value) -> ClusterPolicy {
    serde_json::from_value(json!({
        "apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy",
        "metadata": {"name": name, "generation": 1}, "spec": spec, "status": status
    }))
    .unwrap()
}

/// The active policy with `spec`, ready.
fn policy(spec: serde_json::Value) -> ClusterPolicy {
    policy_named("cluster-policy", spec, ready_status())
}

/// Two GPU nodes (one tainted) with every operand ready, GPUs advertised, the RuntimeClass.
fn healthy() -> Snapshot {
    let nodes = vec![
        node("gpu-a100-0", "NVIDIA-A100-SXM4-40GB", 8, 8, false),
        node("gpu-t4-0", "Tesla-T4", 1, 1, true),
        cpu_node(),
    ];
    let operand_pods = ["gpu-a100-0", "gpu-t4-0"]
        .into_iter()
        .flat_map(|n| {
            ["driver", "operator-validator", "device-plugin"]
                .into_iter()
                .map(move |o| operand_pod(o, n, None))
        })
        .collect();
    Snapshot {
        nodes,
        operand_pods,
        runtime_classes: vec!["nvidia".into()],
        policy: Some(policy(json!({}))),
        other_policies: Vec::new(),
        operator_namespace: "gpu-operator".into(),
        nfd_worker_tolerations: None,
        dra: dra::DraSnapshot::default(),
    }
}

fn workload(spec: serde_json::Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": "infer", "namespace": "default"},
        "spec": spec
    }))
    .unwrap()
}

fn gpu_pod(extra: serde_json::Value) -> Pod {
    let mut spec = json!({
        "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    });
    for (k, v) in extra.as_object().unwrap() {
        spec[k] = v.clone();
    }
    workload(spec)
}

fn checks(findings: &[Finding]) -> Vec<&'static str> {
    findings.iter().map(|f| f.check).collect()
}

/// The report's text and `-o json` against `testdata/<name>.txt` and `<name>.json`.
fn assert_report_golden(name: &str, report: &Report) {
    assert_golden(
        &format!("{name}.txt"),
        &report.render(Output::Text).unwrap(),
    );
    assert_golden(
        &format!("{name}.json"),
        &report.render(Output::Json).unwrap(),
    );
}

#[test]
fn a_healthy_cluster_has_no_findings_and_its_table_matches_the_golden_file() {
    let snapshot = healthy();
    assert_eq!(cluster_findings(&snapshot), []);
    assert_eq!(pod_findings(&snapshot, &gpu_pod(json!({}))), []);
    let table = node_table(&snapshot);
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/src/cli/testdata/doctor-healthy.txt"
    );
    if std::env::var_os("UPDATE_GOLDEN").is_some_and(|v| v == "1") {
        std::fs::write(path, &table).unwrap();
    }
    let golden = std::fs::read_to_string(path).unwrap();
    assert_eq!(table, golden, "regenerate with UPDATE_GOLDEN=1 and review");
}

#[test]
fn no_gpu_node_is_a_fault_of_the_cluster_and_of_a_pod_selecting_none() {
    let mut snapshot = healthy();
    snapshot.nodes = vec![cpu_node()];
    assert_eq!(checks(&cluster_findings(&snapshot)), [NO_GPU_NODE]);
    let pod = gpu_pod(json!({"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-B200"}}));
    let findings = pod_findings(&healthy(), &pod);
    // The headline, then the selector key that keeps the pod off each GPU node.
    assert_eq!(
        checks(&findings),
        [NO_GPU_NODE, NODE_SELECTOR_MISMATCH, NODE_SELECTOR_MISMATCH]
    );
    assert!(findings[0].problem.contains("nodeSelector"));
    assert_eq!(
        findings[2].problem,
        "pod infer's nodeSelector keeps it off GPU node gpu-t4-0: \
         nvidia.com/gpu.product=NVIDIA-B200 (the node's is Tesla-T4)"
    );
    assert!(
        findings[2]
            .fix
            .starts_with("kubectl get nodes -L nvidia.com/gpu.product"),
        "{}",
        findings[2].fix
    );
}

#[test]
fn a_pod_without_the_toleration_is_told_which_to_add() {
    let pod = workload(json!({
        "nodeSelector": {"kubernetes.io/hostname": "gpu-t4-0"},
        "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
    }));
    let findings = pod_findings(&healthy(), &pod);
    assert_eq!(checks(&findings), [MISSING_TOLERATION]);
    assert!(
        findings[0]
            .problem
            .contains("nvidia.com/gpu=present:NoSchedule")
    );
    assert!(
        findings[0]
            .fix
            .contains("{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}")
    );
    // A toleration of another key does not help; one of this key does.
    let other = workload(json!({
        "nodeSelector": {"kubernetes.io/hostname": "gpu-t4-0"},
        "tolerations": [{"key": "dedicated", "operator": "Exists"}],
        "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
    }));
    assert_eq!(
        checks(&pod_findings(&healthy(), &other)),
        [MISSING_TOLERATION]
    );
    let tolerating = workload(json!({
        "nodeSelector": {"kubernetes.io/hostname": "gpu-t4-0"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Equal", "value": "present"}],
        "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
    }));
    assert_eq!(pod_findings(&healthy(), &tolerating), []);
    // An untainted GPU node is left to it: no fault.
    let anywhere = workload(json!({"containers": [{"name": "c"}]}));
    assert_eq!(pod_findings(&healthy(), &anywhere), []);
}

#[test]
fn a_quarantined_or_not_yet_ready_node_is_named_and_pods_are_not_told_to_tolerate_it() {
    let mut snapshot = healthy();
    snapshot.policy = Some(policy(json!({
        "gpuReadiness": {"startupTaint": {"key": "example.com/gpu-not-ready"}}
    })));
    let record = crate::gpu_readiness::Record {
        reason: "gpus-missing".into(),
        message: "its device plugin advertises 7 of 8 GPUs".into(),
        since: 1,
        restarts: 2,
        last_restart: Some(2),
    };
    let a100 = &mut snapshot.nodes[0];
    a100.metadata.annotations = Some(
        [(
            crate::gpu_readiness::QUARANTINE_ANNOTATION.to_string(),
            serde_json::to_string(&record).unwrap(),
        )]
        .into(),
    );
    a100.spec.as_mut().unwrap().taints = Some(vec![Taint {
        key: crate::gpu_readiness::QUARANTINE_TAINT.into(),
        value: Some("gpus-missing".into()),
        effect: "NoSchedule".into(),
        time_added: None,
    }]);
    snapshot.nodes[1]
        .spec
        .as_mut()
        .unwrap()
        .taints
        .get_or_insert_default()
        .push(Taint {
            key: "example.com/gpu-not-ready".into(),
            value: Some("true".into()),
            effect: "NoSchedule".into(),
            time_added: None,
        });
    let findings = cluster_findings(&snapshot);
    assert_eq!(checks(&findings), [GPU_QUARANTINED, GPU_NOT_READY_YET]);
    assert!(
        findings[0]
            .problem
            .contains("node gpu-a100-0 is quarantined by gpuReadiness: its device plugin advertises 7 of 8 GPUs (device plugin restarted 2 time(s))"),
        "{}",
        findings[0].problem
    );
    assert!(findings[1].problem.contains(
        "node gpu-t4-0 still carries the startup taint example.com/gpu-not-ready=true:NoSchedule"
    ));
    // A pod blocked only by these is told why, not to tolerate them.
    let findings = pod_findings(&snapshot, &gpu_pod(json!({})));
    assert_eq!(checks(&findings), [GPU_QUARANTINED, GPU_NOT_READY_YET]);
    assert!(!findings.iter().any(|f| f.fix.contains("tolerations")));
}

#[test]
fn allocatable_zero_points_at_the_device_plugin() {
    let mut snapshot = healthy();
    snapshot.nodes[1].status.as_mut().unwrap().allocatable = Some(Default::default());
    let findings = cluster_findings(&snapshot);
    assert_eq!(checks(&findings), [ALLOCATABLE_ZERO]);
    assert!(
        findings[0]
            .problem
            .contains("gpu-t4-0 has no allocatable nvidia.com/gpu")
    );
    assert!(findings[0].fix.contains("device-plugin"));
    let pod = gpu_pod(json!({"nodeSelector": {"kubernetes.io/hostname": "gpu-t4-0"}}));
    assert_eq!(checks(&pod_findings(&snapshot, &pod)), [ALLOCATABLE_ZERO]);
    // Another node still has GPUs: a pod that may go anywhere is not stuck on this.
    assert_eq!(pod_findings(&snapshot, &gpu_pod(json!({}))), []);
}

/// `healthy()` with sandbox workloads on and the A100 node passed through to virtual machines:
/// its container stack replaced by the VM stack, no `nvidia.com/gpu` advertised.
fn with_a_vm_passthrough_node(sandbox_validator: Option<Option<&str>>) -> Snapshot {
    let mut snapshot = healthy();
    snapshot.policy = Some(policy(json!({"sandboxWorkloads": {"enabled": true}})));
    let vm = &mut snapshot.nodes[0];
    let labels = vm.metadata.labels.as_mut().unwrap();
    labels.retain(|k, _| !k.starts_with("nvidia.com/gpu.deploy."));
    for key in ["vfio-manager", "sandbox-validator", "sandbox-device-plugin"] {
        labels.insert(format!("nvidia.com/gpu.deploy.{key}"), "true".into());
    }
    labels.insert(WORKLOAD_CONFIG.into(), "vm-passthrough".into());
    vm.status.as_mut().unwrap().allocatable = Some(Default::default());
    snapshot
        .operand_pods
        .retain(|p| p.spec.as_ref().unwrap().node_name.as_deref() != Some("gpu-a100-0"));
    for operand in ["vfio-manager", "sandbox-device-plugin"] {
        snapshot
            .operand_pods
            .push(operand_pod(operand, "gpu-a100-0", None));
    }
    if let Some(waiting) = sandbox_validator {
        snapshot
            .operand_pods
            .push(operand_pod("sandbox-validator", "gpu-a100-0", waiting));
    }
    snapshot
}

#[test]
fn a_vm_passthrough_node_is_judged_by_its_own_stack_not_the_container_one() {
    let snapshot = with_a_vm_passthrough_node(Some(None));
    // No toolkit, no operator validator, no nvidia.com/gpu: none of it is a fault there.
    assert_eq!(cluster_findings(&snapshot), []);
    let reports = node_reports(&snapshot);
    let vm = &reports[0];
    assert_eq!(
        (vm.workload.as_str(), vm.validator.as_str()),
        ("vm-passthrough", "Ready")
    );
    assert_eq!((vm.deploy_labels_placing, vm.deploy_labels_set), (3, 3));
    assert_eq!(reports[1].workload, "container");
    let table = node_table(&snapshot);
    assert!(
        table.contains("8x NVIDIA-A100-SXM4-40GB (vm-passthrough)"),
        "{table}"
    );
    assert!(!table.contains("Tesla-T4 ("), "{table}");

    // Its own validator is what it waits on.
    let missing = cluster_findings(&with_a_vm_passthrough_node(None));
    assert_eq!(checks(&missing), [VALIDATOR_NOT_READY]);
    assert!(
        missing[0]
            .problem
            .contains("sandbox-validator on gpu-a100-0 is missing"),
        "{missing:?}"
    );
    assert!(
        missing[0]
            .fix
            .contains("nvidia.com/gpu.deploy.sandbox-validator"),
        "{missing:?}"
    );
    let failing = cluster_findings(&with_a_vm_passthrough_node(Some(Some("CrashLoopBackOff"))));
    assert_eq!(checks(&failing), [VALIDATOR_NOT_READY], "{failing:?}");

    // The same node with sandbox workloads off is a container node missing its stack.
    let mut off = with_a_vm_passthrough_node(Some(None));
    off.policy = Some(policy(json!({})));
    let found = checks(&cluster_findings(&off));
    assert!(
        found.contains(&VALIDATOR_NOT_READY) && found.contains(&ALLOCATABLE_ZERO),
        "{found:?}"
    );
}

#[test]
fn a_crash_looping_validator_and_driver_are_named_with_their_logs_command() {
    let mut snapshot = healthy();
    for pod in &mut snapshot.operand_pods {
        let node = pod.spec.as_ref().unwrap().node_name.clone().unwrap();
        let operand = operand_of(pod).to_owned();
        if node == "gpu-t4-0" && (operand == "operator-validator" || operand == "driver") {
            *pod = operand_pod(&operand, &node, Some("CrashLoopBackOff"));
        }
    }
    let findings = cluster_findings(&snapshot);
    assert_eq!(checks(&findings), [DRIVER_CRASH_LOOP, VALIDATOR_NOT_READY]);
    assert!(
        findings[0]
            .fix
            .contains("logs driver-gpu-t4-0 -c driver-ctr --previous")
    );
    assert!(findings[1].problem.contains("gpu-t4-0 is CrashLoopBackOff"));
    let pod = gpu_pod(json!({"nodeSelector": {"kubernetes.io/hostname": "gpu-t4-0"}}));
    assert_eq!(
        checks(&pod_findings(&snapshot, &pod)),
        [VALIDATOR_NOT_READY, DRIVER_CRASH_LOOP]
    );
    // A missing validator is a fault too.
    let mut snapshot = healthy();
    snapshot
        .operand_pods
        .retain(|p| operand_of(p) != "operator-validator");
    assert_eq!(
        checks(&cluster_findings(&snapshot)),
        [VALIDATOR_NOT_READY, VALIDATOR_NOT_READY]
    );
}

#[test]
fn a_mig_resource_under_the_single_strategy_is_a_mismatch() {
    let pod = workload(json!({
        "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/mig-1g.5gb": "1"}}}]
    }));
    let findings = pod_findings(&healthy(), &pod);
    assert!(
        checks(&findings).contains(&MIG_STRATEGY_MISMATCH),
        "{findings:?}"
    );
    assert!(
        findings
            .iter()
            .any(|f| f.fix.contains("\"strategy\":\"mixed\""))
    );
    // With the mixed strategy and nodes advertising the profile: no mismatch.
    let mut snapshot = healthy();
    snapshot.policy = Some(policy(json!({"mig": {"strategy": "mixed"}})));
    for n in &mut snapshot.nodes {
        if let Some(a) = n.status.as_mut().and_then(|s| s.allocatable.as_mut()) {
            a.insert("nvidia.com/mig-1g.5gb".into(), Quantity("7".into()));
        }
    }
    assert_eq!(pod_findings(&snapshot, &pod), []);
}

#[test]
fn a_missing_runtime_class_is_named() {
    let mut snapshot = healthy();
    snapshot.runtime_classes.clear();
    let findings = cluster_findings(&snapshot);
    assert_eq!(checks(&findings), [RUNTIME_CLASS_MISSING]);
    assert!(findings[0].problem.contains("RuntimeClass nvidia"));
    let pod = gpu_pod(json!({"runtimeClassName": "nvidia-cdi"}));
    assert_eq!(
        checks(&pod_findings(&healthy(), &pod)),
        [RUNTIME_CLASS_MISSING]
    );
}

#[test]
fn the_table_shows_a_failing_operand_and_the_memory_resource() {
    let mut snapshot = healthy();
    snapshot.policy = Some(policy(
        json!({"gpuMemoryResource": {"enabled": true, "name": "example.com/vram"}}),
    ));
    snapshot.operand_pods[2] = operand_pod("device-plugin", "gpu-a100-0", Some("ImagePullBackOff"));
    snapshot.nodes[0]
        .status
        .as_mut()
        .unwrap()
        .allocatable
        .as_mut()
        .unwrap()
        .insert("example.com/vram".into(), Quantity("320".into()));
    let table = node_table(&snapshot);
    assert!(
        table.lines().next().unwrap().contains("example.com/vram"),
        "{table}"
    );
    assert!(
        table.contains("2/3 device-plugin:ImagePullBackOff"),
        "{table}"
    );
    assert!(table.contains("  320  "), "{table}");
    assert_eq!(checks(&cluster_findings(&snapshot)), [OPERAND_NOT_READY]);
}

#[test]
fn a_pod_with_nothing_else_wrong_gets_the_schedulers_message() {
    let mut pod = gpu_pod(json!({}));
    pod.status = Some(PodStatus {
        phase: Some("Pending".into()),
        conditions: Some(vec![PodCondition {
            type_: "PodScheduled".into(),
            status: "False".into(),
            reason: Some("Unschedulable".into()),
            message: Some("0/3 nodes are available: 3 Insufficient nvidia.com/gpu.".into()),
            ..PodCondition::default()
        }]),
        ..PodStatus::default()
    });
    let findings = pod_findings(&healthy(), &pod);
    assert_eq!(checks(&findings), [UNSCHEDULABLE]);
    assert!(findings[0].problem.contains("0/3 nodes are available"));
}

fn report_runtime(node: &mut Node, runtime: &str, kubelet: &str, os_image: &str) {
    let status = node.status.get_or_insert_with(NodeStatus::default);
    status.node_info = Some(k8s_openapi::api::core::v1::NodeSystemInfo {
        container_runtime_version: runtime.into(),
        kubelet_version: kubelet.into(),
        os_image: os_image.into(),
        ..Default::default()
    });
}

fn report_handlers(node: &mut Node, handlers: &[&str]) {
    let status = node.status.get_or_insert_with(NodeStatus::default);
    status.runtime_handlers = Some(
        handlers
            .iter()
            .map(|h| k8s_openapi::api::core::v1::NodeRuntimeHandler {
                name: Some((*h).into()),
                features: None,
            })
            .collect(),
    );
}

#[test]
fn a_read_only_image_is_named_with_what_to_use_instead_and_the_table_shows_each_flavour() {
    let mut snapshot = healthy();
    report_runtime(
        &mut snapshot.nodes[0],
        "containerd://1.7.23-k3s2",
        "v1.31.4+k3s1",
        "Ubuntu 22.04.4 LTS",
    );
    report_runtime(
        &mut snapshot.nodes[1],
        "containerd://1.7.27",
        "v1.31.4-eks-1",
        "Bottlerocket OS 1.36.0 (aws-k8s-1.31-nvidia)",
    );
    let findings = cluster_findings(&snapshot);
    assert_eq!(checks(&findings), [READ_ONLY_IMAGE]);
    assert!(
        findings[0]
            .problem
            .starts_with("gpu-t4-0 runs Bottlerocket")
    );
    assert!(findings[0].fix.contains("toolkit.enabled=false"));
    let table = node_table(&snapshot);
    assert!(table.contains(" k3s "), "{table}");
    assert!(table.contains(" read-only-bottlerocket "), "{table}");
}

#[test]
fn a_ready_toolkit_whose_runtime_reports_no_gpu_handler_names_the_file_it_wrote() {
    let mut snapshot = healthy();
    snapshot
        .operand_pods
        .push(operand_pod("container-toolkit", "gpu-a100-0", None));
    report_runtime(
        &mut snapshot.nodes[0],
        "containerd://1.7.23-k3s2",
        "v1.31.4+rke2r1",
        "Ubuntu 22.04.4 LTS",
    );
    // A kubelet that reports no handlers at all says nothing either way.
    assert_eq!(cluster_findings(&snapshot), []);
    report_handlers(&mut snapshot.nodes[0], &["runc", ""]);
    let findings = cluster_findings(&snapshot);
    assert_eq!(checks(&findings), [RUNTIME_HANDLER_MISSING]);
    assert!(
        findings[0].problem.contains(
            "configured /var/lib/rancher/rke2/agent/etc/containerd/config.toml.tmpl (its runtimes \
             in /var/lib/rancher/rke2/agent/etc/containerd/config.toml.d/99-nvidia.toml) for rke2"
        ),
        "{}",
        findings[0].problem
    );
    report_handlers(&mut snapshot.nodes[0], &["runc", "nvidia"]);
    assert_eq!(cluster_findings(&snapshot), []);
}

#[test]
fn containerd_2_under_a_toolkit_too_old_for_config_version_3_is_named() {
    let mut snapshot = healthy();
    report_runtime(
        &mut snapshot.nodes[0],
        "containerd://2.0.4",
        "v1.33.2",
        "Ubuntu 24.04.2 LTS",
    );
    // The pinned toolkit writes version 3: nothing to say.
    assert_eq!(cluster_findings(&snapshot), []);
    snapshot.policy = Some(policy(json!({"toolkit": {"version": "v1.17.3-ubi8"}})));
    let findings = cluster_findings(&snapshot);
    assert_eq!(checks(&findings), [TOOLKIT_CANNOT_WRITE_V3]);
    assert!(
        findings[0].problem.contains("runs containerd 2"),
        "{}",
        findings[0].problem
    );
    assert!(
        findings[0].fix.contains("/spec/toolkit/version"),
        "{}",
        findings[0].fix
    );
    assert!(findings[0].fix.contains("v1.20.0"), "{}", findings[0].fix);
    // containerd 1.7 reads version 2: the old toolkit is fine there.
    report_runtime(
        &mut snapshot.nodes[0],
        "containerd://1.7.27",
        "v1.31.4",
        "Ubuntu 22.04.4 LTS",
    );
    assert_eq!(cluster_findings(&snapshot), []);
}

#[test]
fn json_and_yaml_carry_the_facts_of_the_text() {
    let mut snapshot = healthy();
    snapshot.policy = Some(policy(
        json!({"gpuMemoryResource": {"enabled": true, "name": "example.com/vram"}}),
    ));
    snapshot.operand_pods[2] = operand_pod("device-plugin", "gpu-a100-0", Some("ImagePullBackOff"));
    let report = Report::of_cluster(&snapshot);
    let text = report.render(Output::Text).unwrap();
    assert_eq!(
        text,
        format!(
            "{}\n{}",
            node_table(&snapshot),
            findings_text(&cluster_findings(&snapshot))
        )
    );
    let json: serde_json::Value =
        serde_json::from_str(&report.render(Output::Json).unwrap()).unwrap();
    let yaml: serde_json::Value =
        serde_yaml_ng::from_str(&report.render(Output::Yaml).unwrap()).unwrap();
    assert_eq!(json, yaml);
    assert_eq!(json["version"], 1);
    assert_eq!(json["operatorNamespace"], "gpu-operator");
    assert_eq!(json["clusterPolicy"], "cluster-policy");
    assert_eq!(json["gpuMemoryResource"], "example.com/vram");
    assert_eq!(json["pod"], serde_json::Value::Null);
    let a100 = &json["nodes"][0];
    assert_eq!(
        a100,
        &json!({
            "name": "gpu-a100-0",
            "gpuProduct": "NVIDIA-A100-SXM4-40GB",
            "gpuCount": "8",
            "workload": "container",
            "deployLabelsPlacing": 3,
            "deployLabelsSet": 3,
            "operandsReady": 2,
            "operandsTotal": 3,
            "operandsNotReady": [{"operand": "device-plugin", "pod": "device-plugin-gpu-a100-0", "state": "ImagePullBackOff"}],
            "validator": "Ready",
            "allocatableGpus": "8",
            "allocatableGpuMemory": "0",
            "runtime": "containerd",
            "taints": []
        })
    );
    assert_eq!(
        json["nodes"][1]["taints"],
        json!(["nvidia.com/gpu=present:NoSchedule"])
    );
    // Every fault of the text, with its check and fix.
    let faults = json["faults"].as_array().unwrap();
    assert_eq!(faults.len(), text.matches("FAULT ").count());
    assert_eq!(faults[0]["check"], OPERAND_NOT_READY);
    assert!(text.contains(faults[0]["fix"].as_str().unwrap()));
}

#[test]
fn a_pods_report_names_the_pod_and_lists_no_nodes() {
    let snapshot = healthy();
    let pod = gpu_pod(json!({"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-B200"}}));
    let report = Report::of_pod(&snapshot, &pod);
    assert_eq!(
        report.render(Output::Text).unwrap(),
        format!(
            "pod default/infer: Unknown\n\n{}",
            findings_text(&pod_findings(&snapshot, &pod))
        )
    );
    let json: serde_json::Value =
        serde_json::from_str(&report.render(Output::Json).unwrap()).unwrap();
    assert_eq!(
        json["pod"],
        json!({"namespace": "default", "name": "infer", "state": "Unknown"})
    );
    assert_eq!(json["nodes"], json!([]));
    assert_eq!(json["faults"][0]["check"], NO_GPU_NODE);
}

fn nfd_worker_default_tolerations() -> Vec<Toleration> {
    serde_json::from_value(json!([
        {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]))
    .unwrap()
}

/// A GPU node NFD has not seen yet (no NFD label) behind `taint`.
fn unseen_node(name: &str, taint: (&str, &str)) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some([("kubernetes.io/hostname".to_string(), name.to_string())].into()),
            ..ObjectMeta::default()
        },
        spec: Some(NodeSpec {
            taints: Some(vec![Taint {
                key: taint.0.into(),
                value: Some("true".into()),
                effect: taint.1.into(),
                time_added: None,
            }]),
            ..NodeSpec::default()
        }),
        ..Node::default()
    }
}

#[test]
fn a_taint_keeping_the_nfd_worker_off_is_named_with_the_toleration_to_add() {
    let mut snapshot = healthy();
    snapshot.nodes = vec![
        cpu_node(),
        unseen_node("gpu-new-0", ("dedicated", "NoSchedule")),
        unseen_node("gpu-new-1", ("dedicated", "NoSchedule")),
    ];
    snapshot.operand_pods.clear();
    snapshot.nfd_worker_tolerations = Some(nfd_worker_default_tolerations());
    let findings = cluster_findings(&snapshot);
    assert_eq!(checks(&findings), [NO_GPU_NODE, NFD_WORKER_KEPT_OFF]);
    assert!(
        findings[0]
            .problem
            .contains("NFD's worker cannot run on 2 nodes"),
        "{}",
        findings[0].problem
    );
    let kept_off = &findings[1];
    assert!(
        kept_off
            .problem
            .contains("taint dedicated=true:NoSchedule keeps NFD's worker")
            && kept_off.problem.contains("gpu-new-0, gpu-new-1"),
        "{}",
        kept_off.problem
    );
    // The whole list goes into the patch: a list in the policy replaces the defaults.
    assert!(
        kept_off.fix.contains(
            r#"{"spec":{"nfd":{"worker":{"tolerations":[{"effect":"NoSchedule","key":"node-role.kubernetes.io/control-plane","operator":"Exists"},{"effect":"NoSchedule","key":"nvidia.com/gpu","operator":"Exists"},{"effect":"NoSchedule","key":"dedicated","operator":"Exists"}]}}}}"#
        ),
        "{}",
        kept_off.fix
    );
    assert!(
        kept_off
            .fix
            .contains("kubectl patch clusterpolicy cluster-policy")
            && kept_off
                .fix
                .contains("kubectl taint node gpu-new-0 dedicated:NoSchedule-"),
        "{}",
        kept_off.fix
    );

    // A tolerated taint (also one every DaemonSet tolerates), a node NFD already labelled, or
    // an NFD not deployed by the operator: nothing to say.
    snapshot.nodes[1] = unseen_node("gpu-new-0", ("nvidia.com/gpu", "NoSchedule"));
    snapshot.nodes.push(unseen_node(
        "joining-0",
        ("node.kubernetes.io/not-ready", "NoExecute"),
    ));
    snapshot.nodes[2].metadata.labels.as_mut().unwrap().insert(
        "feature.node.kubernetes.io/cpu-model.family".into(),
        "6".into(),
    );
    assert_eq!(checks(&cluster_findings(&snapshot)), [NO_GPU_NODE]);
    let mut foreign = snapshot.clone();
    foreign.nodes[1] = unseen_node("gpu-new-0", ("dedicated", "NoSchedule"));
    foreign.nfd_worker_tolerations = None;
    assert_eq!(checks(&cluster_findings(&foreign)), [NO_GPU_NODE]);
}

#[test]
fn faults_and_could_not_run_have_distinct_exit_codes() {
    assert_eq!(Failure::Faults(3).exit_code(), EXIT_FAULTS);
    assert_eq!(
        Failure::CouldNotRun(anyhow::anyhow!("no kubeconfig")).exit_code(),
        EXIT_COULD_NOT_RUN
    );
    assert_ne!(EXIT_FAULTS, EXIT_COULD_NOT_RUN);
    assert_ne!(EXIT_FAULTS, 0);
    let faults: anyhow::Error = Failure::Faults(1).into();
    assert_eq!(crate::cli::exit_code(&faults), EXIT_FAULTS);
    let broken: anyhow::Error = Failure::CouldNotRun(anyhow::anyhow!("refused")).into();
    assert_eq!(crate::cli::exit_code(&broken), EXIT_COULD_NOT_RUN);
    assert!(broken.to_string().contains("refused"));
    assert_eq!(crate::cli::exit_code(&anyhow::anyhow!("render failed")), 1);
}

#[test]
fn a_kubeconfig_that_cannot_be_read_is_could_not_run() {
    let args = DoctorArgs {
        pod: None,
        namespace: None,
        output: Output::Json,
        operator_namespace: None,
        kubeconfig: Some("/nonexistent/kubeconfig".into()),
        context: None,
    };
    let mut out = Vec::new();
    let error = run(&args, &mut out).unwrap_err();
    assert_eq!(crate::cli::exit_code(&error), EXIT_COULD_NOT_RUN);
    assert!(
        out.is_empty(),
        "printed a report: {}",
        String::from_utf8_lossy(&out)
    );
    assert!(
        format!("{error:#}").contains("/nonexistent/kubeconfig"),
        "{error:#}"
    );
}

const KUBECONFIG: &str = r#"
apiVersion: v1
kind: Config
clusters:
- name: c
  cluster: {server: "https://127.0.0.1:1", insecure-skip-tls-verify: true}
users:
- name: u
  user: {token: t}
contexts:
- name: team-a
  context: {cluster: c, user: u, namespace: team-a}
- name: bare
  context: {cluster: c, user: u}
current-context: team-a
"#;

#[test]
fn the_pod_namespace_defaults_to_the_contexts_as_kubectl_does() {
    let dir = std::env::temp_dir().join(format!("doctor-kubeconfig-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("config");
    std::fs::write(&path, KUBECONFIG).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let namespace = |args: &[&str]| {
        let cli = crate::cli::Cli::try_parse_from(
            [
                "gpu-operator",
                "doctor",
                "--kubeconfig",
                path.to_str().unwrap(),
            ]
            .iter()
            .chain(args),
        )
        .unwrap();
        let crate::cli::Command::Doctor(args) = cli.command else {
            panic!("not the doctor")
        };
        let config = runtime
            .block_on(config(args.kubeconfig.as_deref(), args.context.as_deref()))
            .unwrap();
        pod_namespace(&args, &config)
    };
    assert_eq!(namespace(&[]), "team-a");
    assert_eq!(namespace(&["--context", "bare"]), "default");
    assert_eq!(namespace(&["-n", "ml"]), "ml");
    assert_eq!(namespace(&["--namespace", "ml", "--context", "bare"]), "ml");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn output_takes_text_json_and_yaml_only() {
    let parse = |args: &[&str]| {
        crate::cli::Cli::try_parse_from(["gpu-operator", "doctor"].iter().chain(args))
    };
    for (flag, want) in [
        (&["-o", "json"][..], Output::Json),
        (&["--output", "yaml"][..], Output::Yaml),
        (&[][..], Output::Text),
    ] {
        let crate::cli::Command::Doctor(args) = parse(flag).unwrap().command else {
            panic!("not the doctor")
        };
        assert_eq!(args.output, want);
        assert_eq!(args.namespace, None);
    }
    let error = parse(&["-o", "wide"]).unwrap_err();
    assert_eq!(error.exit_code(), i32::from(EXIT_COULD_NOT_RUN));
}

#[test]
fn help_documents_the_exit_statuses_and_the_formats() {
    let error = crate::cli::Cli::try_parse_from(["gpu-operator", "doctor", "--help"]).unwrap_err();
    let help = error.render().to_string();
    for text in [
        "Exit status:",
        "1  faults found",
        "2  could not run",
        "json",
        "yaml",
        "the kubeconfig context in use",
    ] {
        assert!(help.contains(text), "{text:?} not in:\n{help}");
    }
}

/// `healthy()` with the active policy's status replaced by `status`.
fn with_status(status: serde_json::Value) -> Snapshot {
    let mut snapshot = healthy();
    snapshot.policy = Some(policy_named("cluster-policy", json!({}), status));
    snapshot
}

/// A not-ready status whose Ready condition says `reason: message`, Error true when `error`.
fn failing_status(
    reason: &str,
    message: &str,
    error: bool,
    components: serde_json::Value,
) -> serde_json::Value {
    json!({
        "state": "notReady",
        "namespace": "gpu-operator",
        "conditions": [
            condition("Ready", false, reason, message),
            if error {
                condition("Error", true, reason, message)
            } else {
                condition("Error", false, "NoError", "")
            }
        ],
        "components": components
    })
}

const INVALID_MESSAGE: &str = "device-plugin: config map gpu-operator/sharing has no key \
                               \"a100\" (named by spec.devicePlugin.config.default)";

fn invalid_config() -> Snapshot {
    with_status(failing_status(
        "InvalidConfig",
        INVALID_MESSAGE,
        true,
        json!([
            component("driver", "nvidia-driver-daemonset", 2, "2/2 pods ready"),
            {"name": "device-plugin", "desired": 0, "updated": 0, "ready": 0, "available": 0,
             "labeledNodes": 2,
             "message": "invalid configuration, live objects kept as they were: config map \
                         gpu-operator/sharing has no key \"a100\""}
        ]),
    ))
}

#[test]
fn a_ready_policy_gives_no_finding_even_with_an_upgrade_pending() {
    let snapshot = healthy();
    assert_eq!(policy_findings(&snapshot), []);
    assert_eq!(cluster_hints(&snapshot), []);
}

#[test]
fn no_policy_is_named_first_in_both_modes() {
    let mut snapshot = healthy();
    snapshot.policy = None;
    assert_eq!(checks(&cluster_findings(&snapshot)), [NO_POLICY]);
    let pod = workload(json!({
        "nodeSelector": {"kubernetes.io/hostname": "gpu-t4-0"},
        "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
    }));
    assert_eq!(
        checks(&pod_findings(&snapshot, &pod)),
        [NO_POLICY, MISSING_TOLERATION]
    );
}

#[test]
fn an_invalid_config_is_named_with_its_message_and_the_commands_that_show_and_fix_it() {
    let snapshot = invalid_config();
    let findings = cluster_findings(&snapshot);
    // The component repeats the Error condition: said once.
    assert_eq!(checks(&findings), [POLICY_INVALID_CONFIG]);
    assert_eq!(
        findings[0].problem,
        format!("ClusterPolicy cluster-policy reports an error (InvalidConfig): {INVALID_MESSAGE}")
    );
    assert!(
        findings[0]
            .fix
            .starts_with("kubectl get clusterpolicy cluster-policy -o yaml")
            && findings[0]
                .fix
                .contains("kubectl edit clusterpolicy cluster-policy"),
        "{}",
        findings[0].fix
    );
    // First in the pod's checklist too, before the pod's own faults.
    let pod = workload(json!({
        "nodeSelector": {"kubernetes.io/hostname": "gpu-t4-0"},
        "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
    }));
    assert_eq!(
        checks(&pod_findings(&snapshot, &pod)),
        [POLICY_INVALID_CONFIG, MISSING_TOLERATION]
    );
}

#[test]
fn a_rejected_object_points_at_the_policys_events() {
    let message = "driver: DaemonSet gpu-operator/nvidia-driver-daemonset was rejected by the API \
                   server at field spec.template.spec.priorityClassName: no such class";
    let snapshot = with_status(failing_status(
        "ObjectRejected",
        message,
        true,
        json!([component(
            "driver",
            "nvidia-driver-daemonset",
            2,
            "frozen: DaemonSet gpu-operator/nvidia-driver-daemonset was rejected; 2/2 pods ready"
        )]),
    ));
    let findings = cluster_findings(&snapshot);
    assert_eq!(checks(&findings), [POLICY_OBJECT_REJECTED]);
    assert!(findings[0].problem.contains(message));
    assert!(
        findings[0]
            .fix
            .starts_with("kubectl describe clusterpolicy cluster-policy")
    );
}

#[test]
fn a_failed_reconcile_points_at_the_operator_log() {
    let snapshot = with_status(failing_status(
        "ReconcileFailed",
        "NVIDIA's GPU Operator is running (held by gpu-operator/nvidia); uninstall one of the two",
        true,
        json!([]),
    ));
    let findings = cluster_findings(&snapshot);
    assert_eq!(checks(&findings), [POLICY_RECONCILE_FAILED]);
    assert!(
        findings[0]
            .fix
            .starts_with("kubectl -n gpu-operator logs deploy/gpu-operator"),
        "{}",
        findings[0].fix
    );
    // A reason this doctor does not know is still an error.
    let snapshot = with_status(failing_status("SomethingNew", "it broke", true, json!([])));
    let findings = cluster_findings(&snapshot);
    assert_eq!(checks(&findings), [POLICY_ERROR]);
    assert!(findings[0].problem.contains("(SomethingNew): it broke"));
}

#[test]
fn operands_not_ready_are_named_per_component_instead_of_the_joined_message() {
    let snapshot = with_status(failing_status(
        "OperandNotReady",
        "driver: 1 of 2 pods not available",
        false,
        json!([
            component("driver", "nvidia-driver-daemonset", 1, "1 of 2 pods not available"),
            component("device-plugin", "nvidia-device-plugin-daemonset", 2, "2/2 pods ready; config sharing-copy (default key \"a100\")"),
            {"name": "node-feature-discovery/node-feature-discovery-master", "desired": 1,
             "updated": 1, "ready": 1, "available": 1, "labeledNodes": 0,
             "message": "1/1 replicas available"}
        ]),
    ));
    let findings = cluster_findings(&snapshot);
    assert_eq!(checks(&findings), [POLICY_COMPONENT_NOT_READY]);
    assert_eq!(
        findings[0].problem,
        "ClusterPolicy cluster-policy component driver: 1 of 2 pods not available"
    );
    assert!(
        findings[0]
            .fix
            .starts_with("kubectl -n gpu-operator describe daemonset nvidia-driver-daemonset"),
        "{}",
        findings[0].fix
    );
}

#[test]
fn a_not_ready_policy_whose_components_are_fine_shows_its_ready_message() {
    let snapshot = with_status(failing_status(
        "OperandNotReady",
        "labelling GPU nodes: 2 node label writes not yet observed",
        false,
        json!([component(
            "driver",
            "nvidia-driver-daemonset",
            2,
            "2/2 pods ready"
        )]),
    ));
    let findings = cluster_findings(&snapshot);
    assert_eq!(checks(&findings), [POLICY_NOT_READY]);
    assert_eq!(
        findings[0].problem,
        "ClusterPolicy cluster-policy is not ready (OperandNotReady): labelling GPU nodes: 2 node \
         label writes not yet observed"
    );
    assert!(
        findings[0]
            .fix
            .starts_with("kubectl describe clusterpolicy cluster-policy")
    );
}

#[test]
fn a_failed_or_held_driver_upgrade_and_a_short_deployment_are_component_problems() {
    let snapshot = with_status(failing_status(
        "OperandNotReady",
        "driver: ...",
        false,
        json!([
            component("driver", "nvidia-driver-daemonset", 2,
                "2/2 pods ready; driver upgrade: 1 of 2 nodes upgraded, 1 failed: gpu-t4-0: drain timed out"),
            {"name": "node-feature-discovery/node-feature-discovery-master", "desired": 1,
             "updated": 1, "ready": 0, "available": 0, "labeledNodes": 0,
             "message": "0/1 replicas available"},
            {"name": "gpu-feature-discovery", "desired": 2, "updated": 0, "ready": 0,
             "available": 0, "labeledNodes": 2}
        ]),
    ));
    let findings = cluster_findings(&snapshot);
    assert_eq!(
        checks(&findings),
        [
            POLICY_COMPONENT_NOT_READY,
            POLICY_COMPONENT_NOT_READY,
            POLICY_COMPONENT_NOT_READY
        ]
    );
    assert!(findings[0].problem.contains("1 failed: gpu-t4-0"));
    assert!(findings[1].problem.contains("0/1 replicas available"));
    // Without a DaemonSet, the component list is what shows it.
    assert!(findings[1].fix.contains("{.status.components}"));
    assert!(findings[2].problem.ends_with("0 of 2 pods available"));
}

#[test]
fn ignored_policies_are_named_as_such_with_the_active_one() {
    let mut snapshot = healthy();
    let ignored_status = json!({
        "state": "ignored",
        "conditions": [
            condition("Ready", false, "Ignored",
                "ClusterPolicy cluster-policy is the active one (the oldest); this one is ignored"),
            condition("Error", true, "Ignored",
                "ClusterPolicy cluster-policy is the active one (the oldest); this one is ignored")
        ]
    });
    snapshot.other_policies = vec![
        policy_named("second", json!({}), ignored_status),
        policy_named("third", json!({}), serde_json::Value::Null),
    ];
    let findings = cluster_findings(&snapshot);
    assert_eq!(checks(&findings), [POLICY_IGNORED, POLICY_IGNORED]);
    assert_eq!(
        findings[0].problem,
        "ClusterPolicy second is ignored: ClusterPolicy cluster-policy is the active one (the \
         oldest); this one is ignored"
    );
    // One the operator has not written to yet is ignored all the same.
    assert!(findings[1].problem.starts_with(
        "ClusterPolicy third is ignored: ClusterPolicy cluster-policy is the active one"
    ));
    assert!(
        findings[1].fix.ends_with(
            "move what third sets into cluster-policy, then kubectl delete clusterpolicy third"
        ),
        "{}",
        findings[1].fix
    );
    // The active one calling itself ignored says so, and nothing else of it.
    let mut snapshot = healthy();
    snapshot
        .policy
        .as_mut()
        .unwrap()
        .status
        .as_mut()
        .unwrap()
        .state = State::Ignored;
    assert_eq!(checks(&cluster_findings(&snapshot)), [POLICY_IGNORED]);
}

#[test]
fn the_active_policy_is_the_oldest_and_the_rest_are_others() {
    let at = |name: &str, time: &str| {
        let mut p = policy_named(name, json!({}), serde_json::Value::Null);
        p.metadata.creation_timestamp = Some(serde_json::from_value(json!(time)).unwrap());
        p
    };
    let (active, others) = split_active(vec![
        at("b", "2026-01-02T00:00:00Z"),
        at("c", "2026-01-01T00:00:00Z"),
        at("a", "2026-01-02T00:00:00Z"),
    ]);
    assert_eq!(active.unwrap().name_any(), "c");
    let names: Vec<String> = others.iter().map(ResourceExt::name_any).collect();
    assert_eq!(names, ["a", "b"]);
    assert!(split_active(Vec::new()).0.is_none());
}

#[test]
fn a_policy_without_status_or_with_an_older_generation_is_not_reconciled() {
    let snapshot = with_status(serde_json::Value::Null);
    let findings = cluster_findings(&snapshot);
    assert_eq!(checks(&findings), [POLICY_NOT_RECONCILED]);
    assert!(findings[0].problem.contains("has no status"));
    assert!(
        findings[0]
            .fix
            .contains("kubectl -n gpu-operator logs deploy/gpu-operator")
    );
    let mut snapshot = healthy();
    snapshot.policy.as_mut().unwrap().metadata.generation = Some(2);
    let findings = cluster_findings(&snapshot);
    assert_eq!(checks(&findings), [POLICY_NOT_RECONCILED]);
    assert!(
        findings[0]
            .problem
            .contains("status describes generation 1, the policy is at 2"),
        "{}",
        findings[0].problem
    );
}

#[test]
fn fields_not_acted_on_are_a_hint_and_leave_the_exit_status_clean() {
    let mut status = ready_status();
    status["conditions"].as_array_mut().unwrap().push(condition(
        "Unsupported",
        true,
        "AcceptedNotActedOn",
        "spec.sandboxWorkloads.enabled",
    ));
    let snapshot = with_status(status);
    assert_eq!(cluster_findings(&snapshot), []);
    let hints = cluster_hints(&snapshot);
    assert_eq!(checks(&hints), [POLICY_FIELDS_NOT_ACTED_ON]);
    assert!(
        hints[0]
            .problem
            .ends_with(": spec.sandboxWorkloads.enabled")
    );
    let report = Report::of_cluster(&snapshot);
    assert!(report.faults.is_empty());
    let text = report.render(Output::Text).unwrap();
    assert!(
        text.contains("No faults found.\nHINT policy-fields-not-acted-on: "),
        "{text}"
    );
    assert!(!text.contains("FAULT"), "{text}");
}

/// A GPU pod that tolerates the GPU taint and requires `terms`.
fn requiring(terms: serde_json::Value) -> Pod {
    gpu_pod(json!({"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}}))
}

#[test]
fn a_pod_whose_required_affinity_excludes_every_gpu_node_is_told_the_expression_per_node() {
    let pod = requiring(json!([{"matchExpressions": [
        {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]}
    ]}]));
    let findings = pod_findings(&healthy(), &pod);
    assert_eq!(
        checks(&findings),
        [NO_GPU_NODE, NODE_AFFINITY_MISMATCH, NODE_AFFINITY_MISMATCH]
    );
    assert_eq!(
        findings[0].problem,
        "no GPU node matches the pod's required node affinity"
    );
    assert_eq!(
        findings[1].problem,
        "pod infer's required node affinity keeps it off GPU node gpu-a100-0: \
         nodeSelectorTerms[0].matchExpressions[0] (nvidia.com/gpu.product In \
         [NVIDIA-H100-80GB-HBM3]): the node's is NVIDIA-A100-SXM4-40GB"
    );
    assert!(
        findings[1]
            .fix
            .starts_with("kubectl get nodes -L nvidia.com/gpu.product"),
        "{}",
        findings[1].fix
    );
    // One term that admits one node is enough: nothing to say.
    let pod = requiring(json!([
        {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]}]},
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-t4-0"]}]}
    ]));
    assert_eq!(pod_findings(&healthy(), &pod), []);
}

#[test]
fn a_pod_kept_off_by_both_selector_and_affinity_is_told_each_rule() {
    let mut pod = requiring(json!([{"matchExpressions": [
        {"key": "nvidia.com/gpu.count", "operator": "Gt", "values": ["4"]}
    ]}]));
    pod.spec.as_mut().unwrap().node_selector =
        Some([("nvidia.com/gpu.product".to_string(), "Tesla-T4".to_string())].into());
    let findings = pod_findings(&healthy(), &pod);
    assert_eq!(
        checks(&findings),
        [NO_GPU_NODE, NODE_SELECTOR_MISMATCH, NODE_AFFINITY_MISMATCH]
    );
    assert!(
        findings[0]
            .problem
            .ends_with("the pod's nodeSelector and required node affinity")
    );
    assert!(findings[1].problem.contains("off GPU node gpu-a100-0"));
    assert!(
        findings[2]
            .problem
            .contains("off GPU node gpu-t4-0: nodeSelectorTerms[0].matchExpressions[0] (nvidia.com/gpu.count Gt 4): the node's is 1"),
        "{}",
        findings[2].problem
    );
}

#[test]
fn a_pod_admitted_only_where_it_does_not_tolerate_the_taint_is_told_that_nodes_taint() {
    let pod = workload(json!({
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
            {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["Tesla-T4"]}]}]}}},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Equal", "value": "absent"}],
        "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
    }));
    let findings = pod_findings(&healthy(), &pod);
    assert_eq!(checks(&findings), [MISSING_TOLERATION]);
    assert_eq!(
        findings[0].problem,
        "pod infer does not tolerate GPU node gpu-t4-0's taint nvidia.com/gpu=present:NoSchedule"
    );
    assert_eq!(
        findings[0].fix,
        "add to the pod spec: tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]"
    );
}

fn preferring_a100() -> Pod {
    gpu_pod(json!({"affinity": {"nodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 80, "preference":
            {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In",
                                   "values": ["NVIDIA-A100-SXM4-40GB"]}]}}]}}}))
}

#[test]
fn preferred_terms_are_hints_naming_the_nodes_they_prefer_never_faults() {
    let pod = preferring_a100();
    assert_eq!(pod_findings(&healthy(), &pod), []);
    let hints = pod_hints(&healthy(), &pod);
    assert_eq!(checks(&hints), [PREFERRED_NODE_AFFINITY]);
    assert!(
        hints[0].problem.contains(
            "weight 80) nodes with nvidia.com/gpu.product In [NVIDIA-A100-SXM4-40GB]; GPU nodes \
             that match: gpu-a100-0"
        ),
        "{}",
        hints[0].problem
    );
    // A preference no GPU node meets is still no fault.
    let mut snapshot = healthy();
    snapshot.nodes.remove(0);
    assert_eq!(pod_findings(&snapshot, &pod), []);
    let hints = pod_hints(&snapshot, &pod);
    assert!(
        hints[0]
            .problem
            .ends_with("none of the GPU nodes it may go to (gpu-t4-0) matches"),
        "{}",
        hints[0].problem
    );
}

#[test]
fn an_untolerated_prefer_no_schedule_taint_is_a_hint_not_a_fault() {
    let mut snapshot = healthy();
    snapshot.nodes[0].spec.as_mut().unwrap().taints = Some(vec![Taint {
        key: "spot".into(),
        value: Some("true".into()),
        effect: "PreferNoSchedule".into(),
        time_added: None,
    }]);
    let pod = gpu_pod(json!({}));
    assert_eq!(pod_findings(&snapshot, &pod), []);
    let hints = pod_hints(&snapshot, &pod);
    assert_eq!(checks(&hints), [PREFER_NO_SCHEDULE_TAINT]);
    assert!(
        hints[0]
            .problem
            .contains("GPU node gpu-a100-0's spot=true:PreferNoSchedule")
    );
    assert!(
        hints[0]
            .fix
            .contains("{key: spot, operator: Exists, effect: PreferNoSchedule}")
    );
}

#[test]
fn golden_a_policy_with_an_invalid_config() {
    assert_report_golden(
        "doctor-policy-invalid-config",
        &Report::of_cluster(&invalid_config()),
    );
}

#[test]
fn golden_a_pod_excluded_by_required_affinity() {
    let pod = requiring(json!([{"matchExpressions": [
        {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]},
        {"key": "nvidia.com/gpu.count", "operator": "Gt", "values": ["4"]}
    ]}, {"matchExpressions": [
        {"key": "topology.kubernetes.io/zone", "operator": "Exists"}
    ]}]));
    assert_report_golden(
        "doctor-pod-affinity-excluded",
        &Report::of_pod(&healthy(), &pod),
    );
}

#[test]
fn golden_a_pod_that_does_not_tolerate_a_gpu_nodes_taint() {
    let pod = workload(json!({
        "nodeSelector": {"nvidia.com/gpu.product": "Tesla-T4"},
        "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
    }));
    assert_report_golden(
        "doctor-pod-untolerated-taint",
        &Report::of_pod(&healthy(), &pod),
    );
}

#[test]
fn golden_a_pod_with_only_preferred_terms_reads_ok_with_a_hint() {
    let report = Report::of_pod(&healthy(), &preferring_a100());
    assert!(report.faults.is_empty());
    assert_report_golden("doctor-pod-preferred-only", &report);
}
