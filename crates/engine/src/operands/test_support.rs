//! What the per-operand render tests share (test builds only): the policy and facts helpers
//! and the accessors into rendered pods.

#![allow(clippy::unwrap_used, clippy::expect_used)]

pub(crate) use std::collections::BTreeMap;

pub(crate) use k8s_openapi::api::apps::v1::DaemonSet;
pub(crate) use k8s_openapi::api::core::v1::{Container, PodSpec};
pub(crate) use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

pub(crate) use crate::facts::{ClusterFacts, ConfigMapData, Runtime};
pub(crate) use crate::model::{CONFIG_HASH_ANNOTATION, Operand, OperandObjects};
pub(crate) use crate::operands::common;
pub(crate) use crate::render::tests::{facts, policy, policy_with, rendered};
pub(crate) use crate::render::{DesiredState, Outcome, render};

pub(crate) fn state(spec: &str, facts: &ClusterFacts) -> DesiredState {
    render(&policy_with(spec, facts), facts)
}

pub(crate) fn objects(spec: &str, facts: &ClusterFacts, operand: Operand) -> OperandObjects {
    rendered(&state(spec, facts), operand)
}

pub(crate) fn daemon_set(spec: &str, facts: &ClusterFacts, operand: Operand) -> DaemonSet {
    objects(spec, facts, operand).daemon_sets.remove(0)
}

pub(crate) fn pod(ds: &DaemonSet) -> PodSpec {
    ds.spec.clone().unwrap().template.spec.unwrap()
}

pub(crate) fn template_annotations(ds: &DaemonSet) -> BTreeMap<String, String> {
    ds.spec
        .clone()
        .unwrap()
        .template
        .metadata
        .unwrap()
        .annotations
        .unwrap_or_default()
}

pub(crate) fn container(pod: &PodSpec, name: &str) -> Container {
    pod.init_containers
        .iter()
        .flatten()
        .chain(&pod.containers)
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name}"))
        .clone()
}

pub(crate) fn has_container(pod: &PodSpec, name: &str) -> bool {
    pod.init_containers
        .iter()
        .flatten()
        .chain(&pod.containers)
        .any(|c| c.name == name)
}

pub(crate) fn env(c: &Container, name: &str) -> Option<String> {
    c.env
        .iter()
        .flatten()
        .find(|e| e.name == name)
        .and_then(|e| e.value.clone())
}

pub(crate) fn env_names(c: &Container) -> Vec<String> {
    c.env.iter().flatten().map(|e| e.name.clone()).collect()
}

pub(crate) fn host_path(pod: &PodSpec, volume: &str) -> (String, Option<String>) {
    let v = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == volume)
        .unwrap_or_else(|| panic!("no volume {volume}"));
    let hp = v.host_path.clone().unwrap();
    (hp.path, hp.type_)
}

pub(crate) fn mount_path(c: &Container, volume: &str) -> String {
    c.volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == volume)
        .unwrap()
        .mount_path
        .clone()
}

pub(crate) fn sharing(data: &[(&str, &str)]) -> ClusterFacts {
    ClusterFacts {
        sharing_source: Some(ConfigMapData {
            name: "device-plugin-config".to_owned(),
            data: data
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        }),
        ..facts()
    }
}

pub(crate) const SHARED: &str =
    "{devicePlugin: {config: {name: device-plugin-config, default: default}}}";
pub(crate) const TS4: &str = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n";
pub(crate) const TS8: &str = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 8\n";
