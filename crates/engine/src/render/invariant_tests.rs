//! Invariants over every object rendered for every example policy under several sets of cluster
//! facts (containerd, CRI-O, Docker, OpenShift, ServiceMonitor API, NFD present, no known OS),
//! plus a policy with every optional operand on. What a fake node cannot prove about an operand
//! pod (docs/architecture.md, last table) is checked here instead: everything a pod names exists, and
//! every status file an init container waits for is written by a validator stage.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use k8s_openapi::api::core::v1::{ConfigMap, PodSpec};
use serde_json::Value;

use super::inputs::{RenderOptions, facts_for};
use super::{DesiredState, Outcome, rbac, render};
use crate::api::ClusterPolicy;
use crate::facts::{ClusterFacts, Runtime};
use crate::model::{
    CONFIG_HASH_ANNOTATION, MANAGED_BY_LABEL, MANAGER, OPERAND_LABEL, Operand, OperandObjects,
};
use crate::operands::common::{NAME_LABEL, PART_OF, PART_OF_LABEL};
use crate::operands::gfd;
use crate::operands::validator::Stage;
use crate::validate::validate;

fn examples_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

/// Every `examples/clusterpolicy-*.yaml`, by file name.
pub(crate) fn examples() -> Vec<(String, ClusterPolicy)> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(examples_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with("clusterpolicy-") && name.ends_with(".yaml")
        })
        .collect();
    paths.sort();
    assert!(paths.len() >= 6, "examples not found");
    paths
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                serde_yaml_ng::from_str(&text).unwrap(),
            )
        })
        .collect()
}

/// The sample ConfigMaps under `examples/configmaps/` that examples reference.
pub(crate) fn example_config_maps() -> Vec<ConfigMap> {
    let dir = examples_dir().join("configmaps");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    paths.sort();
    paths
        .iter()
        .map(|p| serde_yaml_ng::from_str(&std::fs::read_to_string(p).unwrap()).unwrap())
        .collect()
}

/// The fact variants every example is rendered under.
pub(crate) fn fact_variants(policy: &ClusterPolicy) -> Vec<(&'static str, ClusterFacts)> {
    let base = RenderOptions {
        namespace: "gpu-operator".to_owned(),
        os_tag: Some("ubuntu22.04".to_owned()),
        config_maps: example_config_maps(),
        ..RenderOptions::default()
    };
    let variants = [
        ("containerd", base.clone()),
        (
            "cri-o",
            RenderOptions {
                runtime: Some(Runtime::CriO),
                ..base.clone()
            },
        ),
        (
            "docker",
            RenderOptions {
                runtime: Some(Runtime::Docker),
                ..base.clone()
            },
        ),
        (
            "openshift",
            RenderOptions {
                openshift: true,
                os_tag: Some("rhcos4.16".to_owned()),
                ..base.clone()
            },
        ),
        (
            "service-monitor",
            RenderOptions {
                service_monitor_api: true,
                ..base.clone()
            },
        ),
        (
            "nfd-running, no OS yet",
            RenderOptions {
                nfd_running: true,
                os_tag: None,
                ..base.clone()
            },
        ),
    ];
    variants
        .into_iter()
        .map(|(name, options)| (name, facts_for(policy, &options).unwrap()))
        .collect()
}

/// A policy with every optional operand and RBAC variant on.
fn everything_on() -> ClusterPolicy {
    serde_yaml_ng::from_str(
        "apiVersion: nvidia.com/v1\nkind: ClusterPolicy\nmetadata: {name: everything}\nspec:\n  \
         dcgm: {enabled: true}\n  nodeStatusExporter: {enabled: true}\n  \
         devicePlugin: {config: {name: device-plugin-config, default: default}}\n  \
         dcgmExporter:\n    serviceMonitor: {enabled: true}\n    \
         env: [{name: DCGM_EXPORTER_KUBERNETES_ENABLE_POD_LABELS, value: 'true'}]\n  \
         driver: {rdma: {enabled: true, useHostMofed: true}}\n",
    )
    .unwrap()
}

/// Every (case name, facts, desired state) the invariants run over.
fn cases() -> Vec<(String, ClusterFacts, DesiredState)> {
    let mut policies = examples();
    policies.push(("everything-on".to_owned(), everything_on()));
    let mut out = Vec::new();
    for (name, policy) in policies {
        for (variant, facts) in fact_variants(&policy) {
            let validated = validate(&policy, &facts);
            out.push((
                format!("{name} [{variant}]"),
                facts.clone(),
                render(&validated, &facts),
            ));
        }
    }
    out
}

fn rendered(state: &DesiredState) -> Vec<(Operand, &OperandObjects)> {
    state
        .operands
        .iter()
        .filter_map(|s| match &s.outcome {
            Outcome::Rendered(objects) => Some((s.operand, objects)),
            _ => None,
        })
        .collect()
}

fn all_json(state: &DesiredState) -> Vec<(Operand, Value)> {
    rendered(state)
        .into_iter()
        .flat_map(|(op, objects)| objects.to_json().unwrap().into_iter().map(move |v| (op, v)))
        .collect()
}

fn id(object: &Value) -> String {
    format!(
        "{} {}",
        object["kind"].as_str().unwrap_or("?"),
        object["metadata"]["name"].as_str().unwrap_or("?")
    )
}

/// Pod specs with where they come from.
fn pods(state: &DesiredState) -> Vec<(String, Operand, PodSpec, BTreeMap<String, String>)> {
    let mut out = Vec::new();
    for (op, objects) in rendered(state) {
        for ds in &objects.daemon_sets {
            let spec = ds.spec.clone().unwrap();
            out.push((
                format!("DaemonSet {}", ds.metadata.name.clone().unwrap()),
                op,
                spec.template.spec.unwrap(),
                spec.template.metadata.unwrap().labels.unwrap(),
            ));
        }
        for d in &objects.deployments {
            let spec = d.spec.clone().unwrap();
            out.push((
                format!("Deployment {}", d.metadata.name.clone().unwrap()),
                op,
                spec.template.spec.unwrap(),
                spec.template.metadata.unwrap().labels.unwrap(),
            ));
        }
    }
    out
}

#[test]
fn every_object_carries_the_contract_and_recommended_labels() {
    for (case, _, state) in cases() {
        for (op, object) in all_json(&state) {
            let labels = &object["metadata"]["labels"];
            let want = [
                (MANAGED_BY_LABEL, MANAGER),
                (OPERAND_LABEL, op.name()),
                (NAME_LABEL, op.name()),
                (PART_OF_LABEL, PART_OF),
            ];
            for (key, value) in want {
                assert_eq!(
                    labels[key].as_str(),
                    Some(value),
                    "{case}: {} label {key}",
                    id(&object)
                );
            }
        }
    }
}

#[test]
fn every_object_has_the_owner_reference_and_namespace_it_should() {
    let owner = k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
        api_version: "nvidia.com/v1".to_owned(),
        kind: "ClusterPolicy".to_owned(),
        name: "cluster-policy".to_owned(),
        uid: "0000-1111".to_owned(),
        ..Default::default()
    };
    let cluster_scoped = [
        "ClusterRole",
        "ClusterRoleBinding",
        "RuntimeClass",
        "SecurityContextConstraints",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ];
    for (name, policy) in examples() {
        for (variant, facts) in fact_variants(&policy) {
            let facts = ClusterFacts {
                owner: Some(owner.clone()),
                ..facts
            };
            let state = render(&validate(&policy, &facts), &facts);
            for (_, object) in all_json(&state) {
                let case = format!("{name} [{variant}]: {}", id(&object));
                let refs = &object["metadata"]["ownerReferences"];
                assert_eq!(refs[0]["uid"], "0000-1111", "{case}");
                assert_eq!(refs[0]["controller"], true, "{case}");
                assert_eq!(refs[0]["blockOwnerDeletion"], true, "{case}");
                let namespaced = !cluster_scoped.contains(&object["kind"].as_str().unwrap());
                assert_eq!(
                    object["metadata"]["namespace"].as_str() == Some("gpu-operator"),
                    namespaced,
                    "{case}"
                );
            }
        }
    }
}

#[test]
fn names_fit_kubernetes_limits() {
    for (case, _, state) in cases() {
        for (_, object) in all_json(&state) {
            let name = object["metadata"]["name"].as_str().unwrap();
            assert!(
                !name.is_empty() && name.len() <= 63,
                "{case}: {} is too long",
                id(&object)
            );
            for (key, value) in object["metadata"]["labels"].as_object().unwrap() {
                let v = value.as_str().unwrap();
                assert!(v.len() <= 63, "{case}: label {key}={v} of {}", id(&object));
            }
        }
        for (what, _, pod, _) in pods(&state) {
            for c in pod.init_containers.iter().flatten().chain(&pod.containers) {
                assert!(c.name.len() <= 63, "{case}: {what} container {}", c.name);
                for p in c.ports.iter().flatten() {
                    let port = p.name.as_deref().unwrap_or_default();
                    assert!(port.len() <= 15, "{case}: {what} port {port}");
                }
            }
            for v in pod.volumes.iter().flatten() {
                assert!(v.name.len() <= 63, "{case}: {what} volume {}", v.name);
            }
        }
    }
}

#[test]
fn selectors_are_contained_in_template_labels() {
    for (case, _, state) in cases() {
        for (op, objects) in rendered(&state) {
            let selectors = objects
                .daemon_sets
                .iter()
                .map(|d| {
                    (
                        d.metadata.name.clone(),
                        d.spec.clone().unwrap().selector,
                        d.spec.clone().unwrap().template,
                    )
                })
                .chain(objects.deployments.iter().map(|d| {
                    (
                        d.metadata.name.clone(),
                        d.spec.clone().unwrap().selector,
                        d.spec.clone().unwrap().template,
                    )
                }));
            for (name, selector, template) in selectors {
                let labels = template.metadata.unwrap().labels.unwrap();
                let wanted = selector.match_labels.unwrap();
                assert!(!wanted.is_empty());
                for (k, v) in &wanted {
                    assert_eq!(labels.get(k), Some(v), "{case}: {name:?} selector {k}");
                }
                // NVIDIA's selectors, kept for in-place takeover (decision 1).
                if op.deploy_label().is_some() {
                    let name = name.unwrap();
                    let mut expected = BTreeMap::from([("app".to_owned(), name.clone())]);
                    if op == Operand::Validator || op == Operand::SandboxValidator {
                        expected.insert(PART_OF_LABEL.to_owned(), PART_OF.to_owned());
                    }
                    if op == Operand::VfioManager || op == Operand::CcManager {
                        expected = BTreeMap::from([("name".to_owned(), name.clone())]);
                    }
                    if op == Operand::Gfd {
                        expected.insert(PART_OF_LABEL.to_owned(), gfd::SELECTOR_PART_OF.to_owned());
                    }
                    assert_eq!(wanted, expected, "{case}: selector of {name}");
                }
            }
        }
    }
}

#[test]
fn every_container_has_an_image_and_a_pull_policy() {
    for (case, _, state) in cases() {
        for (what, _, pod, _) in pods(&state) {
            for c in pod.init_containers.iter().flatten().chain(&pod.containers) {
                let image = c.image.as_deref().unwrap_or_default();
                assert!(
                    !image.is_empty() && !image.ends_with(':'),
                    "{case}: {what} {} has image {image:?}",
                    c.name
                );
                assert!(c.image_pull_policy.is_some(), "{case}: {what} {}", c.name);
            }
        }
    }
}

#[test]
fn operand_daemonsets_tolerate_the_gpu_taint_and_select_their_deploy_label() {
    for (case, _, state) in cases() {
        for (what, op, pod, _) in pods(&state) {
            if what.starts_with("Deployment") {
                continue;
            }
            let tolerated = pod.tolerations.iter().flatten().any(|t| {
                (t.key.as_deref() == Some("nvidia.com/gpu") || t.key.is_none())
                    && t.operator.as_deref() == Some("Exists")
                    && matches!(t.effect.as_deref(), None | Some("NoSchedule"))
            });
            assert!(tolerated, "{case}: {what} does not tolerate nvidia.com/gpu");
            if let Some(label) = op.deploy_label() {
                assert_eq!(
                    pod.node_selector
                        .as_ref()
                        .and_then(|n| n.get(label))
                        .map(String::as_str),
                    Some("true"),
                    "{case}: {what}"
                );
            }
        }
    }
}

#[test]
fn everything_a_pod_names_is_rendered_or_standard() {
    let provided: BTreeSet<String> = example_config_maps()
        .iter()
        .map(|cm| cm.metadata.name.clone().unwrap())
        .collect();
    let standard_priorities = ["system-node-critical", "system-cluster-critical"];
    for (case, _, state) in cases() {
        let json = all_json(&state);
        let names_of = |kind: &str| -> BTreeSet<String> {
            json.iter()
                .filter(|(_, o)| o["kind"] == kind)
                .map(|(_, o)| o["metadata"]["name"].as_str().unwrap().to_owned())
                .collect()
        };
        let config_maps = names_of("ConfigMap");
        let service_accounts = names_of("ServiceAccount");
        let runtime_classes = names_of("RuntimeClass");
        for (what, _, pod, _) in pods(&state) {
            let sa = pod.service_account_name.clone().unwrap();
            assert!(
                service_accounts.contains(&sa),
                "{case}: {what} names ServiceAccount {sa}"
            );
            if let Some(rc) = &pod.runtime_class_name {
                assert!(
                    runtime_classes.contains(rc),
                    "{case}: {what} names RuntimeClass {rc}"
                );
            }
            let priority = pod.priority_class_name.clone().unwrap();
            assert!(
                standard_priorities.contains(&priority.as_str()),
                "{case}: {what} {priority}"
            );
            let volumes: BTreeSet<&str> = pod
                .volumes
                .iter()
                .flatten()
                .map(|v| v.name.as_str())
                .collect();
            assert_eq!(
                volumes.len(),
                pod.volumes.iter().flatten().count(),
                "{case}: {what} duplicate volume"
            );
            for v in pod.volumes.iter().flatten() {
                if let Some(cm) = &v.config_map {
                    assert!(
                        config_maps.contains(&cm.name) || provided.contains(&cm.name),
                        "{case}: {what} mounts ConfigMap {} that is neither rendered nor provided",
                        cm.name
                    );
                }
                if let Some(hp) = &v.host_path {
                    assert!(
                        hp.path.starts_with('/'),
                        "{case}: {what} hostPath {}",
                        hp.path
                    );
                }
                let sources = [
                    v.config_map.is_some(),
                    v.host_path.is_some(),
                    v.empty_dir.is_some(),
                    v.secret.is_some(),
                ];
                assert_eq!(
                    sources.iter().filter(|s| **s).count(),
                    1,
                    "{case}: {what} volume {}",
                    v.name
                );
            }
            for c in pod.init_containers.iter().flatten().chain(&pod.containers) {
                let mut paths = BTreeSet::new();
                for m in c.volume_mounts.iter().flatten() {
                    assert!(
                        volumes.contains(m.name.as_str()),
                        "{case}: {what} {} mounts unknown volume {}",
                        c.name,
                        m.name
                    );
                    assert!(
                        paths.insert(m.mount_path.clone()),
                        "{case}: {what} {} mounts {} twice",
                        c.name,
                        m.mount_path
                    );
                }
            }
        }
        // Bindings point at rendered roles and ServiceAccounts.
        let roles = names_of("Role");
        let cluster_roles = names_of("ClusterRole");
        for (_, o) in &json {
            let kind = o["kind"].as_str().unwrap();
            if kind == "RoleBinding" || kind == "ClusterRoleBinding" {
                let role = o["roleRef"]["name"].as_str().unwrap().to_owned();
                let known = if o["roleRef"]["kind"] == "Role" {
                    &roles
                } else {
                    &cluster_roles
                };
                assert!(
                    known.contains(&role),
                    "{case}: {} binds unknown {role}",
                    id(o)
                );
                for s in o["subjects"].as_array().unwrap() {
                    assert!(
                        service_accounts.contains(s["name"].as_str().unwrap()),
                        "{case}: {}",
                        id(o)
                    );
                }
            }
        }
    }
}

/// `/run/nvidia/validations/<file>` paths that a script waits for: `[ -f PATH ]` tests and
/// `ready=PATH` assignments.
fn waited_files(script: &str) -> Vec<String> {
    let mut out = Vec::new();
    for marker in ["[ -f ", "ready="] {
        for (i, _) in script.match_indices(marker) {
            let rest = &script[i + marker.len()..];
            let path: String = rest
                .trim_start_matches('"')
                .chars()
                .take_while(|c| !c.is_whitespace() && *c != '"' && *c != ']')
                .collect();
            if path.starts_with("/run/nvidia/validations/") {
                out.push(path);
            }
        }
    }
    out
}

#[test]
fn every_file_an_operand_waits_for_is_written_by_a_validator_stage() {
    for (case, _, state) in cases() {
        // Stage files the rendered validation containers write: COMPONENT=<stage> on a
        // container running nvidia-validator.
        let mut written = BTreeSet::new();
        for (_, _, pod, _) in pods(&state) {
            for c in pod.init_containers.iter().flatten() {
                let component = c
                    .env
                    .iter()
                    .flatten()
                    .find(|e| e.name == "COMPONENT")
                    .and_then(|e| e.value.clone());
                let runs_validator = c.args.iter().flatten().any(|a| a == "nvidia-validator");
                if let (Some(component), true) = (component, runs_validator) {
                    let sandbox = crate::operands::sandbox_validator::files_written(&component);
                    if !sandbox.is_empty() {
                        written.extend(
                            sandbox
                                .iter()
                                .map(|f| format!("/run/nvidia/validations/{f}")),
                        );
                        continue;
                    }
                    let stage = Stage::ALL
                        .iter()
                        .find(|s| s.component() == component)
                        .unwrap();
                    written.insert(stage.ready_file());
                }
            }
        }
        let mut waited = Vec::new();
        for (what, _, pod, _) in pods(&state) {
            for c in pod.init_containers.iter().flatten() {
                for arg in c.command.iter().flatten().chain(c.args.iter().flatten()) {
                    waited.extend(waited_files(arg).into_iter().map(|f| (what.clone(), f)));
                }
            }
        }
        for (op, objects) in rendered(&state) {
            for cm in &objects.config_maps {
                for script in cm
                    .data
                    .iter()
                    .flatten()
                    .filter(|(k, _)| k.ends_with(".sh"))
                    .map(|(_, v)| v)
                {
                    waited.extend(
                        waited_files(script)
                            .into_iter()
                            .map(|f| (op.name().to_owned(), f)),
                    );
                }
            }
        }
        assert!(
            !waited.is_empty(),
            "{case}: no waits found; the scan is broken"
        );
        for (what, file) in waited {
            assert!(
                written.contains(&file),
                "{case}: {what} waits for {file}, which no rendered stage writes"
            );
        }
    }
}

#[test]
fn validator_stages_run_in_order_driver_toolkit_cuda_plugin() {
    for (case, _, state) in cases() {
        for (op, objects) in rendered(&state) {
            if op != Operand::Validator {
                continue;
            }
            let pod = objects.daemon_sets[0]
                .spec
                .clone()
                .unwrap()
                .template
                .spec
                .unwrap();
            let names: Vec<String> = pod
                .init_containers
                .unwrap()
                .into_iter()
                .map(|c| c.name)
                .collect();
            assert_eq!(
                names[..3],
                ["driver-validation", "toolkit-validation", "cuda-validation"],
                "{case}"
            );
            assert!(
                names.len() == 3 || names[3] == "plugin-validation",
                "{case}"
            );
        }
    }
}

#[test]
fn every_granted_permission_is_held_by_the_operator_in_the_scope_granted() {
    // Kubernetes checks a Role's rules against what the operator holds in the Role's
    // namespace (its Role and ClusterRole), a ClusterRole's against the ClusterRole alone.
    let cluster = rbac::operator_cluster_role().rules.unwrap();
    let namespace: Vec<_> = cluster
        .iter()
        .cloned()
        .chain(rbac::operator_role(None).rules.unwrap())
        .collect();
    for (case, _, state) in cases() {
        for (_, objects) in rendered(&state) {
            let scoped = objects
                .roles
                .iter()
                .map(|r| (&namespace, r.rules.clone().unwrap()))
                .chain(
                    objects
                        .cluster_roles
                        .iter()
                        .map(|r| (&cluster, r.rules.clone().unwrap())),
                );
            for (held, rules) in scoped {
                for rule in rules {
                    let missing = rbac::missing(held, &rule);
                    assert!(
                        missing.is_empty(),
                        "{case}: the operator cannot grant {missing:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn config_hash_annotation_is_on_exactly_the_config_driven_pod_templates() {
    for (case, _, state) in cases() {
        for (op, objects) in rendered(&state) {
            for ds in &objects.daemon_sets {
                let annotations = ds
                    .spec
                    .clone()
                    .unwrap()
                    .template
                    .metadata
                    .unwrap()
                    .annotations
                    .unwrap_or_default();
                let has = annotations.contains_key(CONFIG_HASH_ANNOTATION);
                let config_driven = matches!(
                    op,
                    Operand::DevicePlugin
                        | Operand::MpsControlDaemon
                        | Operand::Gfd
                        | Operand::MigManager
                        | Operand::DcgmExporter
                        | Operand::Nfd
                        | Operand::VgpuDeviceManager
                );
                if !config_driven {
                    assert!(!has, "{case}: {} has a config hash", op.name());
                }
                if matches!(
                    op,
                    Operand::MigManager | Operand::Nfd | Operand::VgpuDeviceManager
                ) {
                    assert!(has, "{case}: {} lacks a config hash", op.name());
                }
            }
        }
    }
}

#[test]
fn yaml_output_is_stable_and_parses_back_to_the_same_objects() {
    for (case, _, state) in cases() {
        let yaml = state.to_yaml().unwrap();
        assert_eq!(yaml, state.to_yaml().unwrap(), "{case}");
        let parsed: Vec<Value> = serde_yaml_ng::Deserializer::from_str(&yaml)
            .map(|d| serde::Deserialize::deserialize(d).unwrap())
            .filter(|v: &Value| !v.is_null())
            .collect();
        let objects: Vec<Value> = state.to_json().unwrap();
        assert_eq!(parsed, objects, "{case}");
    }
}

#[test]
fn every_node_bound_identity_writes_nodes_pods_and_config_maps_only_under_a_confinement_policy() {
    for (case, facts, state) in cases() {
        let objects: Vec<&OperandObjects> = rendered(&state).into_iter().map(|(_, o)| o).collect();
        let unconfined =
            crate::operands::common::unconfined_writes(&objects, &facts.namespace, &[]);
        assert!(
            unconfined.is_empty(),
            "{case}: a DaemonSet's token could write beyond its node: {unconfined:?}"
        );
    }
}

#[test]
fn every_script_config_map_is_immutable_named_by_its_content_and_mounted_by_that_name() {
    for (case, _, state) in cases() {
        let mut scripts = BTreeSet::new();
        for (_, objects) in rendered(&state) {
            for cm in &objects.config_maps {
                let data = cm.data.clone().unwrap_or_default();
                let name = cm.metadata.name.clone().unwrap();
                // The driver's probe keeps its fixed name so that an operator upgrade does not
                // restart running drivers (operands/driver.rs, startup_probe_config_map).
                if !data.keys().any(|k| k.ends_with(".sh"))
                    || name == crate::operands::driver::STARTUP_PROBE_CONFIG_MAP
                {
                    continue;
                }
                let hash = crate::operands::common::config_hash(&data);
                assert!(
                    name.ends_with(&format!("-{}", &hash[..10])),
                    "{case}: {name}"
                );
                assert_eq!(cm.immutable, Some(true), "{case}: {name} is not immutable");
                scripts.insert(name);
            }
        }
        for (source, _, pod, _) in pods(&state) {
            for volume in pod.volumes.iter().flatten() {
                let Some(cm) = volume.config_map.as_ref() else {
                    continue;
                };
                if cm.default_mode.is_some_and(|mode| mode & 0o100 != 0)
                    && cm.name != crate::operands::driver::STARTUP_PROBE_CONFIG_MAP
                {
                    assert!(
                        scripts.contains(&cm.name),
                        "{case}: {source} runs scripts from {}, not an immutable copy",
                        cm.name
                    );
                }
            }
        }
    }
}

/// Problems of a CEL expression's string literals that make the API server refuse it: an
/// unterminated literal, or a literal run into a name (a quote inside a quote).
fn cel_literal_problems(expression: &str) -> Option<String> {
    let mut chars = expression.chars().peekable();
    let mut previous = ' ';
    while let Some(c) = chars.next() {
        if c != '\'' && c != '"' {
            previous = c;
            continue;
        }
        if previous.is_alphanumeric() || previous == '_' {
            return Some(format!("a literal follows a name in {expression}"));
        }
        let mut closed = false;
        while let Some(inner) = chars.next() {
            if inner == '\\' {
                chars.next();
            } else if inner == c {
                closed = true;
                break;
            }
        }
        if !closed {
            return Some(format!("unterminated literal in {expression}"));
        }
        if chars
            .peek()
            .is_some_and(|n| n.is_alphanumeric() || *n == '_')
        {
            return Some(format!("a name follows a literal in {expression}"));
        }
        previous = c;
    }
    None
}

#[test]
fn admission_policy_expressions_have_well_formed_string_literals() {
    assert!(cel_literal_problems("'a in ['x', 'y']'").is_some());
    assert!(cel_literal_problems("'open").is_some());
    assert!(cel_literal_problems("a.?b[?'c'].orValue('') in ['x', 'y']").is_none());
    for (case, _, state) in cases() {
        for (_, object) in all_json(&state) {
            if object["kind"] != "ValidatingAdmissionPolicy" {
                continue;
            }
            let spec = &object["spec"];
            let expressions = spec["validations"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|v| [&v["expression"], &v["messageExpression"]])
                .chain(
                    spec["matchConditions"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|c| &c["expression"]),
                )
                .chain(
                    spec["variables"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|v| &v["expression"]),
                )
                .filter_map(Value::as_str);
            for expression in expressions {
                assert_eq!(
                    cel_literal_problems(expression),
                    None,
                    "{case}: {}",
                    id(&object)
                );
            }
        }
    }
}
