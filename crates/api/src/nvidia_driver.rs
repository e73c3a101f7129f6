//! The `nvidia.com/v1alpha1` `NVIDIADriver` API (types only, pure): one driver per node pool.
//!
//! Field names follow NVIDIA's NVIDIADriver so their manifests apply unchanged. Each object
//! selects GPU nodes with `nodeSelector` (all GPU nodes when absent) and gets its own driver
//! DaemonSets, one per OS of those nodes; it is acted on while the active ClusterPolicy sets
//! `spec.driver.useNvidiaDriverCRD: true` (docs/nvidiadriver.md).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{NodeAffinity, PodSecurityContext, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube_derive::CustomResource;
use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde::{Deserialize, Serialize};

use super::common::{annotation_map, label_map};
use super::{
    ComponentStatus, ConfigMapName, ContainerProbeSpec, DriverManagerSpec, DriverUpgradePolicySpec,
    EnvVar, GdrCopySpec, GpuDirectRdmaSpec, GpuDirectStorageSpec, KernelModuleType,
    ResourceRequirements,
};

/// NVIDIA's default driver image name (repository included) of an NVIDIADriver.
pub const DEFAULT_DRIVER_IMAGE: &str = "nvcr.io/nvidia/driver";

/// Which driver an NVIDIADriver deploys.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[schemars(description = "")]
pub enum NvidiaDriverType {
    /// The data-center GPU driver.
    #[default]
    #[serde(rename = "gpu")]
    Gpu,
    /// The vGPU guest driver (licensed through licensingConfig).
    #[serde(rename = "vgpu")]
    Vgpu,
    /// The vGPU host manager (not deployed by this operator; reported in status).
    #[serde(rename = "vgpu-host-manager")]
    VgpuHostManager,
}

impl NvidiaDriverType {
    /// The value as written in the spec (part of the DaemonSet names).
    pub const fn as_str(self) -> &'static str {
        match self {
            NvidiaDriverType::Gpu => "gpu",
            NvidiaDriverType::Vgpu => "vgpu",
            NvidiaDriverType::VgpuHostManager => "vgpu-host-manager",
        }
    }
}

/// The NVIDIA driver for one pool of GPU nodes.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    crates(kube_core = "::kube_core"),
    group = "nvidia.com",
    version = "v1alpha1",
    kind = "NVIDIADriver",
    plural = "nvidiadrivers",
    singular = "nvidiadriver",
    shortname = "nvd",
    shortname = "nvdriver",
    shortname = "nvdrivers",
    status = "NvidiaDriverStatus",
    doc = "The NVIDIA driver of one pool of GPU nodes (selected by nodeSelector), acted on while the ClusterPolicy sets driver.useNvidiaDriverCRD.",
    printcolumn = r#"{"name":"Status","type":"string","description":"ready, notReady or disabled","jsonPath":".status.state"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","description":"The Ready condition's reason","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "has(self.default) && self.default ? !has(self.nodeSelector) || size(self.nodeSelector) == 0 : true",
    "message": "default NVIDIADriver must not use nodeSelector: a default NVIDIADriver serves the GPU nodes no other NVIDIADriver selects; remove spec.nodeSelector or set spec.default=false"
}]))]
pub struct NvidiaDriverSpec {
    /// The fallback pool: this NVIDIADriver serves the GPU nodes that no other (non-default)
    /// NVIDIADriver's nodeSelector selects. At most one NVIDIADriver may be the default, and it
    /// sets no nodeSelector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = false))]
    pub default: Option<bool>,
    /// gpu (the default), vgpu or vgpu-host-manager. Immutable: create another NVIDIADriver
    /// to change it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend(
        "default" = "gpu",
        "x-kubernetes-validations" = [{
            "rule": "self == oldSelf",
            "message": "driverType is immutable; create another NVIDIADriver to change it"
        }]
    ))]
    pub driver_type: Option<NvidiaDriverType>,
    /// Use driver images with kernel modules precompiled for the node's kernel. Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "self == oldSelf",
        "message": "usePrecompiled is immutable; create another NVIDIADriver to change it"
    }]))]
    pub use_precompiled: Option<bool>,
    /// Deprecated and ignored; use kernelModuleType instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_open_kernel_modules: Option<bool>,
    /// Kernel module flavour: auto (the default), open or proprietary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "auto"))]
    pub kernel_module_type: Option<KernelModuleType>,
    /// Startup probe timing of the driver container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub startup_probe: Option<ContainerProbeSpec>,
    /// Liveness probe timing of the driver container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub liveness_probe: Option<ContainerProbeSpec>,
    /// Readiness probe timing of the driver container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readiness_probe: Option<ContainerProbeSpec>,
    /// GPUDirect RDMA: load nvidia-peermem alongside the driver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma: Option<GpuDirectRdmaSpec>,
    /// GPUDirect Storage (nvidia-fs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gds: Option<GpuDirectStorageSpec>,
    /// GDRCopy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gdrcopy: Option<GdrCopySpec>,
    /// Registry and path of the image, for example nvcr.io/nvidia (optional when image holds
    /// the full path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repository: Option<String>,
    /// Image name, or the full path without tag (nvcr.io/nvidia/driver, the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = DEFAULT_DRIVER_IMAGE))]
    pub image: Option<String>,
    /// Driver version (the image tag before the OS suffix), or a digest such as sha256:...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Always, IfNotPresent or Never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    /// Names of Secrets in the operator namespace used to pull the image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_secrets: Option<Vec<String>>,
    /// The k8s-driver-manager init container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manager: Option<DriverManagerSpec>,
    /// Resource requests and limits of the driver container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Arguments of the driver container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<Vec<String>>,
    /// Environment variables of the driver container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<Vec<EnvVar>>,
    /// A ConfigMap with package repository files for the driver container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repo_config: Option<ConfigMapName>,
    /// A ConfigMap with extra CA certificates for the driver container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_config: Option<ConfigMapName>,
    /// vGPU guest driver licensing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub licensing_config: Option<NvidiaDriverLicensingConfig>,
    /// vGPU virtual topology daemon configuration (a ConfigMap holding nvidia-topologyd.conf).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_topology_config: Option<ConfigMapName>,
    /// A ConfigMap with kernel module parameters for the driver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_module_config: Option<ConfigMapName>,
    /// Name of a Secret whose keys become environment variables of the driver container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_env: Option<String>,
    /// The GPU nodes of this pool; every GPU node (nvidia.com/gpu.present=true) when absent.
    /// Two NVIDIADrivers may not select the same GPU node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "label_map")]
    pub node_selector: Option<BTreeMap<String, String>>,
    /// Node affinity of the driver pods. Stored; not acted on (reported in status): pools are
    /// chosen by nodeSelector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_affinity: Option<NodeAffinity>,
    /// Labels of the driver DaemonSets and their pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "label_map")]
    pub labels: Option<BTreeMap<String, String>>,
    /// Annotations of the driver DaemonSets and their pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "annotation_map")]
    pub annotations: Option<BTreeMap<String, String>>,
    /// Tolerations of the driver pods; the ClusterPolicy's daemonsets.tolerations when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,
    /// Priority class of the driver pods; the ClusterPolicy's when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// Pod-level security context of the driver pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_security_context: Option<PodSecurityContext>,
    /// Automatic upgrades of this pool's driver, node by node. Absent: the ClusterPolicy's
    /// driver.upgradePolicy, or NVIDIA's defaults when no ClusterPolicy is in force. Unlike the
    /// ClusterPolicy's, autoUpgrade defaults to true here (NVIDIA's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "pool_upgrade_policy")]
    pub upgrade_policy: Option<DriverUpgradePolicySpec>,
    /// Run the driver pods in the host's network namespace; the ClusterPolicy's
    /// driver.hostNetwork when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
}

impl NvidiaDriverSpec {
    /// Whether this is the fallback pool (`spec.default: true`).
    pub fn is_default(&self) -> bool {
        self.default == Some(true)
    }
}

/// NVIDIA's default of `upgradePolicy.autoUpgrade` on an NVIDIADriver (the ClusterPolicy's is
/// false).
pub const POOL_AUTO_UPGRADE_DEFAULT: bool = true;

/// The ClusterPolicy's upgrade-policy schema with NVIDIA's NVIDIADriver defaults: one Rust type
/// for both, so the upgrade machine reads either.
fn pool_upgrade_policy(generator: &mut SchemaGenerator) -> Schema {
    let mut schema = DriverUpgradePolicySpec::json_schema(generator);
    if let Some(auto) = schema
        .get_mut("properties")
        .and_then(|p| p.get_mut("autoUpgrade"))
        .and_then(|a| a.as_object_mut())
    {
        auto.insert("default".into(), POOL_AUTO_UPGRADE_DEFAULT.into());
        auto.insert(
            "description".into(),
            "Turn automatic upgrades of this pool on (the default). When false, every other \
             setting here is ignored."
                .into(),
        );
    }
    if let Some(rules) = schema
        .get_mut("properties")
        .and_then(|p| p.get_mut("maxUnavailable"))
        .and_then(|m| m.get_mut("x-kubernetes-validations"))
        .and_then(|r| r.as_array_mut())
    {
        for rule in rules.iter_mut().filter_map(|r| r.as_object_mut()) {
            if let Some(message) = rule.get("message").and_then(|m| m.as_str()) {
                let message = message.replace("driver.upgradePolicy.", "spec.upgradePolicy.");
                rule.insert("message".into(), message.into());
            }
        }
    }
    schema
}

/// vGPU licensing of an NVIDIADriver (NVIDIA names the ConfigMap field `name` here).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NvidiaDriverLicensingConfig {
    /// A Secret holding gridd.conf (and client_configuration_token.tok with NLS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_name: Option<String>,
    /// Deprecated: a ConfigMap with the same keys; use secretName.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Whether the NVIDIA Licensing System is used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nls_enabled: Option<bool>,
}

/// Overall state of an NVIDIADriver (NVIDIA's values).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[schemars(description = "")]
pub enum NvidiaDriverState {
    /// Every driver DaemonSet of the pool is rolled out and ready.
    #[serde(rename = "ready")]
    Ready,
    /// Not rolled out yet, invalid input, or overlapping another NVIDIADriver.
    #[default]
    #[serde(rename = "notReady")]
    NotReady,
    /// Not acted on: the ClusterPolicy does not set driver.useNvidiaDriverCRD, or NVIDIA's
    /// operator runs the driver.
    #[serde(rename = "disabled")]
    Disabled,
    /// Not acted on (NVIDIA's value; not written by this operator).
    #[serde(rename = "ignored")]
    Ignored,
}

/// Observed state of one NVIDIADriver, written by the operator.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NvidiaDriverStatus {
    /// Overall state: ready, notReady or disabled.
    pub state: NvidiaDriverState,
    /// Namespace of the operator and the driver DaemonSets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Ready and Error conditions, each with the generation it describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["type"]
    ))]
    pub conditions: Option<Vec<Condition>>,
    /// GPU nodes the pool's nodeSelector selects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selected_nodes: Option<i32>,
    /// Per driver DaemonSet (one per OS of the pool) rollout counts and a one-line explanation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["name"]
    ))]
    pub components: Option<Vec<ComponentStatus>>,
}
