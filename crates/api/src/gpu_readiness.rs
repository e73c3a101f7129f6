//! Our extension `gpuReadiness` (types; no IO): a startup taint the operator lifts once a node's
//! GPUs are usable, and a quarantine for nodes whose GPUs go missing that lifts itself. Neither
//! exists in NVIDIA's API; both are off unless set. The decisions live in the engine
//! (`crates/engine/src/gpu_readiness.rs`).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::enabled_or;
use super::node_pools::TaintEffect;

/// GPU readiness (an addition to NVIDIA's API).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuReadinessSpec {
    /// The taint GPU nodes join with (a Karpenter NodePool's `startupTaints`, a node group's
    /// taints at registration). The operator removes it from a node once the node's validator is
    /// ready and the device plugin advertises all its GPUs, and never adds it. Every operand
    /// tolerates it. Off when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub startup_taint: Option<StartupTaintSpec>,
    /// Taint (NoSchedule) a node whose device plugin advertises fewer GPUs than the node has, or
    /// whose validator fails, for longer than a grace period; restart its device plugin with a
    /// backoff, and lift the taint when every GPU is back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quarantine: Option<QuarantineSpec>,
}

/// The startup taint: matched by key and effect, whatever its value.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StartupTaintSpec {
    /// Taint key, for example `nvidia.com/gpu-not-ready`.
    #[schemars(schema_with = "super::node_pools::label_key")]
    pub key: String,
    /// NoSchedule (default), PreferNoSchedule or NoExecute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<TaintEffect>,
}

impl StartupTaintSpec {
    pub fn effect(&self) -> TaintEffect {
        self.effect.unwrap_or(TaintEffect::NoSchedule)
    }
}

/// The health quarantine.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuarantineSpec {
    /// Quarantine unhealthy GPU nodes. Off when absent; switching it off lifts every quarantine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// How long a node must stay unhealthy before it is quarantined, in seconds (default 120).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 86400))]
    pub grace_period_seconds: Option<u32>,
    /// The most GPU nodes quarantined at once, in percent of the GPU nodes (default 25; at least
    /// one node). When more nodes than that turn unhealthy together the signal is more likely
    /// broken than the GPUs: no new node is quarantined and the status says so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub max_unhealthy_percent: Option<u32>,
}

/// Defaults of [`QuarantineSpec`].
pub const DEFAULT_QUARANTINE_GRACE_SECONDS: u32 = 120;
pub const DEFAULT_MAX_UNHEALTHY_PERCENT: u32 = 25;

impl QuarantineSpec {
    pub fn is_enabled(&self) -> bool {
        enabled_or(self.enabled, false)
    }

    pub fn grace_period_seconds(&self) -> u32 {
        self.grace_period_seconds
            .unwrap_or(DEFAULT_QUARANTINE_GRACE_SECONDS)
    }

    pub fn max_unhealthy_percent(&self) -> u32 {
        self.max_unhealthy_percent
            .unwrap_or(DEFAULT_MAX_UNHEALTHY_PERCENT)
            .clamp(1, 100)
    }
}

impl GpuReadinessSpec {
    /// The quarantine settings when the quarantine is on.
    pub fn quarantine(&self) -> Option<&QuarantineSpec> {
        self.quarantine.as_ref().filter(|q| q.is_enabled())
    }
}
