//! Cluster-wide sections: `operator`, `daemonsets`, `hostPaths`, `cdi`, `psa`, `psp` (types; no IO).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{PodSecurityContext, Toleration};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

use super::common::{ImageSpec, annotation_map, enabled_or, label_map};
use super::operands::ServiceMonitorSpec;

/// Schema of `daemonsets.rollingUpdate.maxUnavailable`: a positive integer, or a percentage
/// between 1% and 100%, given as a number or a string (NVIDIA's CRD takes only strings).
fn daemonset_max_unavailable(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-int-or-string": true,
        "maxLength": 16,
        "x-kubernetes-validations": [{
            "rule": "type(self) == int ? self >= 1 : self.matches('^0*([1-9][0-9]*|([1-9][0-9]?|100)%)$')",
            "message": "daemonsets.rollingUpdate.maxUnavailable must be a positive integer such as 1 or a percentage between 1% and 100% such as 10%"
        }]
    })
}

/// Settings of the operator that apply to all operands.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OperatorSpec {
    /// Deprecated and ignored, as by NVIDIA's operator since v26.7: the container runtime is
    /// read from the GPU nodes. NVIDIA's values were docker, crio and containerd; any string is
    /// stored, as NVIDIA's CRD stores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_runtime: Option<String>,
    /// Name of the RuntimeClass that operand pods and GPU workloads use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "nvidia"))]
    pub runtime_class: Option<String>,
    /// Image for helper init containers shared by the operands (a CUDA base image).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_container: Option<InitContainerSpec>,
    /// Labels for the objects the operator creates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "label_map")]
    pub labels: Option<BTreeMap<String, String>>,
    /// Annotations for the objects the operator creates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "annotation_map")]
    pub annotations: Option<BTreeMap<String, String>>,
    /// On OpenShift, build the driver with the Driver Toolkit image. On when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "use_ocp_driver_toolkit")]
    pub use_ocp_driver_toolkit: Option<bool>,
    /// Metrics of the operator itself: a Prometheus Operator ServiceMonitor for them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<OperatorMetricsSpec>,
}

/// Metrics of the operator itself.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OperatorMetricsSpec {
    /// A ServiceMonitor for the operator's metrics endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_monitor: Option<ServiceMonitorSpec>,
}

impl OperatorSpec {
    /// The RuntimeClass name, `nvidia` unless overridden.
    pub fn runtime_class(&self) -> &str {
        self.runtime_class
            .as_deref()
            .filter(|s| !s.is_empty())
            .unwrap_or("nvidia")
    }
}

/// The shared helper init container image.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct InitContainerSpec {
    /// The init container image.
    #[serde(flatten)]
    pub image: ImageSpec,
}

/// How the operand DaemonSets replace their pods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[schemars(description = "")]
pub enum UpdateStrategy {
    /// Replace pods node by node (the driver DaemonSet stays OnDelete regardless).
    RollingUpdate,
    /// Replace a pod only when it is deleted; applies to every operand.
    OnDelete,
}

/// Settings shared by every operand DaemonSet.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DaemonsetsSpec {
    /// Labels added to every operand DaemonSet and its pods (app and
    /// app.kubernetes.io/part-of are reserved and ignored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "label_map")]
    pub labels: Option<BTreeMap<String, String>>,
    /// Annotations added to every operand DaemonSet and its pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "annotation_map")]
    pub annotations: Option<BTreeMap<String, String>>,
    /// Tolerations of every operand pod. A non-empty list replaces the default, which tolerates
    /// the nvidia.com/gpu taint (operator Exists, effect NoSchedule).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,
    /// PriorityClass of every operand pod; system-node-critical when empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// RollingUpdate (the default) or OnDelete.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "RollingUpdate"))]
    pub update_strategy: Option<UpdateStrategy>,
    /// Rolling update settings of the operand DaemonSets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rolling_update: Option<RollingUpdateSpec>,
    /// Pod-level security context of every operand pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_security_context: Option<PodSecurityContext>,
}

/// Rolling update settings of the operand DaemonSets.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RollingUpdateSpec {
    /// How many nodes may have their operand pod unavailable during an update: a number such as
    /// 1, or a percentage of the nodes such as 10%. The DaemonSet's own default applies when
    /// empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "daemonset_max_unavailable")]
    pub max_unavailable: Option<IntOrString>,
}

/// Host paths used by the operands.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HostPathsSpec {
    /// The host's root file system as seen by the node (a chroot-able directory); / when empty.
    /// Operands that restart host services, such as the toolkit and the MIG manager, use it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "rootFS")]
    pub root_fs: Option<String>,
    /// Where driver libraries, binaries and configuration are found on the host;
    /// /run/nvidia/driver when empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_install_dir: Option<String>,
    /// The kubelet's root directory; /var/lib/kubelet when empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "/var/lib/kubelet"))]
    pub kubelet_root_dir: Option<String>,
}

/// Use of the Container Device Interface.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CdiConfigSpec {
    /// Give containers access to GPUs through CDI.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = true))]
    pub enabled: Option<bool>,
    /// Deprecated and ignored; enabled decides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = false))]
    pub default: Option<bool>,
    /// Also run the toolkit's NRI plugin to inject CDI devices into the management containers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = false))]
    pub nri_plugin_enabled: Option<bool>,
}

impl CdiConfigSpec {
    /// Whether CDI is used; true when `enabled` is absent.
    pub fn is_enabled(&self) -> bool {
        enabled_or(self.enabled, true)
    }

    /// Whether the NRI plugin runs; needs CDI enabled explicitly, as in NVIDIA's operator.
    pub fn nri_plugin_enabled(&self) -> bool {
        self.enabled.unwrap_or(false) && self.nri_plugin_enabled.unwrap_or(false)
    }
}

/// Pod Security Admission labelling of the operator's namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PsaSpec {
    /// Label the operator's namespace as privileged for enforce, audit and warn. Defaults to
    /// false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
}

impl PsaSpec {
    /// Whether the namespace is labelled; false when `enabled` is absent.
    pub fn is_enabled(&self) -> bool {
        enabled_or(self.enabled, false)
    }
}

/// Deprecated PodSecurityPolicy settings.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PspSpec {
    /// Ignored: PodSecurityPolicies were removed from Kubernetes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
}
