//! The doctor's diagnosis on hand-made snapshots: one healthy cluster (its table is a golden
//! file) and each fault of the checklist made from it by one change.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use k8s_openapi::api::core::v1::{
    Container, ContainerState, ContainerStateWaiting, ContainerStatus, NodeSpec, NodeStatus,
    PodCondition, PodSpec, PodStatus,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::ObjectMeta;
use serde_json::json;

use clap::Parser as _;

use super::*;

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

fn policy(spec: serde_json::Value) -> ClusterPolicy {
    serde_json::from_value(json!({
        "apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy",
        "metadata": {"name": "cluster-policy"}, "spec": spec
    }))
    .unwrap()
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
        operator_namespace: "gpu-operator".into(),
        nfd_worker_tolerations: None,
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
    assert_eq!(checks(&findings), [NO_GPU_NODE]);
    assert!(findings[0].problem.contains("nodeSelector"));
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
