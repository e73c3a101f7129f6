//! Our extensions around the operands (types; no IO): `nodePools`, the taints and labels the
//! operator keeps on GPU nodes, and `gpuMemoryResource`, GPU memory as an extended resource in
//! node capacity. Neither exists in NVIDIA's API; both are off unless `enabled` is true.

use std::collections::BTreeMap;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

use super::common::{enabled_or, label_map};

/// Schema of a label key the operator writes (`gpu-type`, `example.com/gpu-memory`): a
/// qualified name with an optional DNS prefix, as Kubernetes takes it.
pub(crate) fn label_key(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "string",
        "maxLength": 316,
        "pattern": "^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
    })
}

/// GPU node pools: taints and labels the operator keeps on every GPU node (a node labelled
/// `nvidia.com/gpu.present=true`). Taints and labels someone else set are never removed; what
/// the operator added is removed again when the section is removed or disabled. Operands
/// tolerate every taint listed here.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodePoolsSpec {
    /// Keep the taints and labels of this section on GPU nodes. Off when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Taints for every GPU node, for example `nvidia.com/gpu=present:NoSchedule` so that pods
    /// without a toleration stay off GPU nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 16))]
    pub taints: Option<Vec<NodePoolTaint>>,
    /// Fixed labels for every GPU node, for example `workload-class: inference`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "label_map")]
    pub labels: Option<BTreeMap<String, String>>,
    /// Labels whose values are derived from GPU feature discovery's labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub derived_labels: Option<DerivedLabelsSpec>,
    /// PriorityClasses the operator creates (and deletes again with the section), for example
    /// inference above training above experiments. A PriorityClass of the same name that the
    /// operator did not create is left alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 16))]
    pub priority_classes: Option<Vec<PoolPriorityClass>>,
}

/// One PriorityClass for GPU workloads.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolPriorityClass {
    /// Name pods refer to in priorityClassName, for example `gpu-inference`.
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    )]
    pub name: String,
    /// Priority; higher preempts lower. At most 1000000000 (higher values are reserved for
    /// system-node-critical and system-cluster-critical).
    #[schemars(range(min = -2147483648, max = 1000000000))]
    pub value: i32,
    /// Shown by kubectl get priorityclass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// PreemptLowerPriority (default) or Never (the pod waits instead of preempting).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preemption_policy: Option<PreemptionPolicy>,
}

/// Whether pods of a PriorityClass preempt lower ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[schemars(description = "")]
pub enum PreemptionPolicy {
    PreemptLowerPriority,
    Never,
}

impl PreemptionPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            PreemptionPolicy::PreemptLowerPriority => "PreemptLowerPriority",
            PreemptionPolicy::Never => "Never",
        }
    }
}

impl NodePoolsSpec {
    pub fn is_enabled(&self) -> bool {
        enabled_or(self.enabled, false)
    }
}

/// Label keys for values derived from GFD's `nvidia.com/gpu.product`, `nvidia.com/gpu.memory`
/// and `nvidia.com/gpu.count`. A key left out is not written.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DerivedLabelsSpec {
    /// Key for the GPU type: GFD's product name, lower-cased, without a leading `NVIDIA-` or
    /// `Tesla-`, up to its first dash (`NVIDIA-A100-SXM4-40GB` gives `a100`, `Tesla-T4` gives
    /// `t4`). For example `gpu-type`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "label_key")]
    pub product: Option<String>,
    /// Key for the memory of one GPU in whole GiB, rounded down (`40960` MiB gives `40Gi`). For
    /// example `gpu-memory`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "label_key")]
    pub memory: Option<String>,
    /// Key for the number of GPUs on the node (`8`). For example `gpu-count`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "label_key")]
    pub count: Option<String>,
}

/// What a taint does to pods that do not tolerate it.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[schemars(description = "")]
pub enum TaintEffect {
    NoSchedule,
    PreferNoSchedule,
    NoExecute,
}

impl TaintEffect {
    pub fn as_str(self) -> &'static str {
        match self {
            TaintEffect::NoSchedule => "NoSchedule",
            TaintEffect::PreferNoSchedule => "PreferNoSchedule",
            TaintEffect::NoExecute => "NoExecute",
        }
    }
}

/// One taint for GPU nodes.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodePoolTaint {
    /// Taint key, for example `nvidia.com/gpu` or `dedicated`.
    #[schemars(schema_with = "label_key")]
    pub key: String,
    /// Taint value, for example `present` or `gpu` (may be empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 63))]
    pub value: Option<String>,
    /// NoSchedule, PreferNoSchedule or NoExecute.
    pub effect: TaintEffect,
}

/// GPU memory as an extended resource: each GPU node's capacity gets `name` with the value
/// memory per GPU x GPU count (from GFD's labels) in `unit`. This is accounting for the
/// scheduler only, not isolation: nothing on the node stops a pod from using more GPU memory
/// than it requested.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuMemoryResourceSpec {
    /// Advertise the resource. Off when absent; switching it off removes it from the nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Extended resource name, with a domain prefix other than kubernetes.io. When absent,
    /// `nvidia.com/gpu-memory`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "resource_name")]
    pub name: Option<String>,
    /// What one unit of the resource is: Gi (default) or Mi. Pods request whole units.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit: Option<MemoryUnit>,
}

/// Schema of an extended resource name: `domain/name`, outside `kubernetes.io`.
fn resource_name(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "string",
        "maxLength": 253,
        "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$",
        "x-kubernetes-validations": [{
            "rule": "!self.startsWith('kubernetes.io/') && !self.contains('.kubernetes.io/') && !self.startsWith('requests.')",
            "message": "gpuMemoryResource.name must be an extended resource name such as example.com/vram: a domain other than kubernetes.io, a slash, a name"
        }]
    })
}

/// The unit of [`GpuMemoryResourceSpec`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[schemars(description = "")]
pub enum MemoryUnit {
    #[default]
    Gi,
    Mi,
}

/// The default extended resource name.
pub const DEFAULT_GPU_MEMORY_RESOURCE: &str = "nvidia.com/gpu-memory";

impl GpuMemoryResourceSpec {
    pub fn is_enabled(&self) -> bool {
        enabled_or(self.enabled, false)
    }

    pub fn name(&self) -> &str {
        self.name
            .as_deref()
            .filter(|n| !n.is_empty())
            .unwrap_or(DEFAULT_GPU_MEMORY_RESOURCE)
    }

    pub fn unit(&self) -> MemoryUnit {
        self.unit.unwrap_or_default()
    }
}
