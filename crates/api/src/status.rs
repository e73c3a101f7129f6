//! The ClusterPolicy status: NVIDIA's `state`, `namespace` and `conditions`, plus our
//! per-operand `components` (types; no IO).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Overall state of a ClusterPolicy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[schemars(description = "")]
pub enum State {
    /// Every enabled operand is rolled out and ready.
    #[serde(rename = "ready")]
    Ready,
    /// At least one enabled operand is not ready yet, or the policy is invalid.
    #[default]
    #[serde(rename = "notReady")]
    NotReady,
    /// Another ClusterPolicy is the active one; this one is not acted on.
    #[serde(rename = "ignored")]
    Ignored,
}

/// Observed state of the GPU stack, written by the operator.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterPolicyStatus {
    /// Overall state: ready, notReady or ignored.
    pub state: State,
    /// Namespace the operator runs in and deploys the operands to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Standard conditions, one per type: Ready (everything is rolled out) and Error (the
    /// reason the policy cannot be fully applied), each with the generation it describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["type"]
    ))]
    pub conditions: Option<Vec<Condition>>,
    /// One entry per operand the policy enables (and per enabled section this operator does not
    /// support), with its rollout counts and a one-line explanation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["name"]
    ))]
    pub components: Option<Vec<ComponentStatus>>,
    /// Nodes labelled `nvidia.com/gpu.present=true` (our addition; `kubectl get` shows it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_nodes: Option<i32>,
    /// Operand workloads ready out of those enabled, as `ready/enabled` (our addition;
    /// `kubectl get` shows it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operands_ready: Option<String>,
}

/// Rollout state of one operand.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ComponentStatus {
    /// The operand (driver, device-plugin, mig-manager, ...), or operand/workload where an
    /// operand has several (node-feature-discovery/node-feature-discovery-worker).
    pub name: String,
    /// Name of the operand's DaemonSet, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daemon_set: Option<String>,
    /// Nodes that should run the operand's pod (the DaemonSet's desired count).
    pub desired: i32,
    /// Nodes running a pod of the current pod template.
    pub updated: i32,
    /// Nodes whose pod is ready.
    pub ready: i32,
    /// Nodes whose pod has been ready for the DaemonSet's minimum ready time.
    pub available: i32,
    /// GPU nodes labelled for the operand (nvidia.com/gpu.deploy.OPERAND=true). A difference
    /// from desired points at an untolerated taint or at pods that cannot be created.
    pub labeled_nodes: i32,
    /// Hash of the configuration the operand's pods consume, as set on their pod template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_hash: Option<String>,
    /// One-line explanation, for example "upgrade pending on 2 nodes" or "enabled but not
    /// supported by this operator".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}
