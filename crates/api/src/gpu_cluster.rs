//! The `nvidia.com/v1alpha1` `GPUCluster` API (types only, pure): the DRA-based GPU stack.
//!
//! Field names follow NVIDIA's GPUCluster (`draDriver`, `dcgm`, `dcgmExporter`, `hostPaths`,
//! `daemonsets`) so their manifests apply unchanged. `deviceClasses` is our addition: attribute
//! DeviceClasses (for example `h100`, `gpu-80gb`) rendered as CEL over the attributes and
//! capacities NVIDIA's DRA driver publishes.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube_derive::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{
    ComponentStatus, DaemonsetsSpec, DcgmExporterSpec, DcgmSpec, EnvVar, ResourceRequirements,
};

/// The one name a GPUCluster may have (NVIDIA's singleton rule, enforced by the CRD).
pub const GPU_CLUSTER_NAME: &str = "gpu-cluster";

/// Desired state of the DRA-based GPU stack: NVIDIA's DRA driver (kubelet plugin, compute-domain
/// controller, DeviceClasses) instead of the device plugin. The driver itself is installed
/// separately (on the host, or by a ClusterPolicy with the device plugin switched off).
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    crates(kube_core = "::kube_core"),
    group = "nvidia.com",
    version = "v1alpha1",
    kind = "GPUCluster",
    plural = "gpuclusters",
    singular = "gpucluster",
    shortname = "gc",
    status = "GpuClusterStatus",
    doc = "The DRA-based NVIDIA GPU stack of the cluster (NVIDIA's DRA driver and its DeviceClasses). A singleton named gpu-cluster.",
    printcolumn = r#"{"name":"Status","type":"string","description":"ready, notReady or disabled","jsonPath":".status.state"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","description":"The Ready condition's reason","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct GpuClusterSpec {
    /// NVIDIA's DRA driver: the gpus capability (always deployed) and compute domains.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dra_driver: Option<DraDriverSpec>,
    /// The standalone DCGM host engine. Stored; not deployed by this operator for a GPUCluster
    /// (reported in status when enabled).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dcgm: Option<DcgmSpec>,
    /// The DCGM exporter. Stored; not deployed by this operator for a GPUCluster (reported in
    /// status when enabled).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dcgm_exporter: Option<DcgmExporterSpec>,
    /// Host paths the DRA driver mounts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_paths: Option<GpuClusterHostPaths>,
    /// Settings shared by the DaemonSets: labels, annotations, tolerations, priority class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daemonsets: Option<DaemonsetsSpec>,
    /// Attribute DeviceClasses (an addition to NVIDIA's API): each renders a DeviceClass whose
    /// CEL selector narrows the driver's devices by product name, architecture, CUDA compute
    /// capability, driver version, memory or MIG profile. Checked against the attributes the
    /// driver publishes and compiled by the API server (dry run) before it is applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxItems" = 64))]
    pub device_classes: Option<Vec<AttributeDeviceClass>>,
}

/// NVIDIA's DRA driver stack.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DraDriverSpec {
    /// Image repository, for example nvcr.io/nvidia.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repository: Option<String>,
    /// Image name, for example k8s-dra-driver-gpu.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[a-zA-Z0-9\-]+$"))]
    pub image: Option<String>,
    /// Image tag or digest (sha256:...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Always, IfNotPresent or Never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    /// Names of Secrets in the operator namespace used to pull the image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_secrets: Option<Vec<String>>,
    /// Feature gates of the driver, rendered as FEATURE_GATES (Name=true,...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feature_gates: Option<BTreeMap<String, bool>>,
    /// The gpu.nvidia.com capability (the gpus container of the kubelet plugin).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus: Option<DraGpusSpec>,
    /// The compute-domain capability (multi-node NVLink): the computeDomains container and the
    /// compute-domain controller Deployment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_domains: Option<DraComputeDomainsSpec>,
}

/// The gpus capability of the DRA driver.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DraGpusSpec {
    /// The gpus container of the kubelet-plugin DaemonSet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubelet_plugin: Option<DraKubeletPluginSpec>,
}

/// The compute-domain capability of the DRA driver.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DraComputeDomainsSpec {
    /// Whether compute domains are deployed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = true))]
    pub enabled: Option<bool>,
    /// The compute-domain controller Deployment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller: Option<DraControllerSpec>,
    /// The computeDomains container of the kubelet-plugin DaemonSet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubelet_plugin: Option<DraKubeletPluginSpec>,
}

impl DraDriverSpec {
    /// Compute domains are on unless `computeDomains.enabled` is false (the CRD's default).
    pub fn compute_domains_enabled(&self) -> bool {
        self.compute_domains
            .as_ref()
            .and_then(|c| c.enabled)
            .unwrap_or(true)
    }
}

/// One container of the kubelet-plugin DaemonSet.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DraKubeletPluginSpec {
    /// Extra environment variables of the container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<Vec<EnvVar>>,
    /// Resource requests and limits of the container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// The container's gRPC health service and the probes that use it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub healthcheck: Option<DraHealthcheckSpec>,
}

/// The gRPC health service of a kubelet-plugin container.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DraHealthcheckSpec {
    /// Whether the health service and its startup and liveness probes are on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = true))]
    pub enabled: Option<bool>,
    /// Port of the health service: 51516 for gpus, 51515 for computeDomains when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<i32>,
}

/// The compute-domain controller Deployment.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DraControllerSpec {
    /// Extra environment variables of the controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<Vec<EnvVar>>,
    /// Resource requests and limits of the controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
}

/// Host paths of the DRA stack (the host root is always `/`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuClusterHostPaths {
    /// Where the driver's libraries and tools are on the host; /run/nvidia/driver when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_install_dir: Option<String>,
    /// The kubelet's root directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "/var/lib/kubelet"))]
    pub kubelet_root_dir: Option<String>,
}

/// Kind of DRA device an attribute class selects.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[schemars(description = "")]
pub enum DraDeviceType {
    /// A whole GPU.
    #[default]
    #[serde(rename = "gpu")]
    Gpu,
    /// A MIG device of a partitioned GPU.
    #[serde(rename = "mig")]
    Mig,
}

/// A DeviceClass selecting the DRA driver's devices by attribute. Every set field narrows the
/// class; they are joined with `&&`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AttributeDeviceClass {
    /// Name of the DeviceClass, for example h100 or gpu-80gb.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// gpu (whole GPUs, the default) or mig (MIG devices).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_type: Option<DraDeviceType>,
    /// A part of the productName attribute, for example H100 or A100-SXM4-80GB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product_name: Option<String>,
    /// The architecture attribute exactly, for example Hopper or Ampere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<String>,
    /// Lowest cudaComputeCapability, for example 9.0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_cuda_compute_capability: Option<String>,
    /// Lowest driverVersion, for example 580.65.06.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_driver_version: Option<String>,
    /// Lowest memory capacity, for example 40Gi.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_memory: Option<Quantity>,
    /// The MIG profile attribute exactly, for example 1g.5gb (mig classes only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_profile: Option<String>,
    /// Further CEL expressions over `device`, for example
    /// `device.attributes['gpu.nvidia.com'].brand == 'Nvidia'`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxItems" = 16))]
    pub expressions: Option<Vec<String>>,
}

/// Overall state of a GPUCluster (NVIDIA's values).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[schemars(description = "")]
pub enum GpuClusterState {
    /// The DRA driver is rolled out and ready.
    #[serde(rename = "ready")]
    Ready,
    /// Not rolled out yet, invalid input, or a ClusterPolicy drives the same GPUs.
    #[default]
    #[serde(rename = "notReady")]
    NotReady,
    /// Not acted on: NVIDIA's operator runs this stack.
    #[serde(rename = "disabled")]
    Disabled,
}

/// Observed state of the DRA stack, written by the operator.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuClusterStatus {
    /// Overall state: ready, notReady or disabled.
    pub state: GpuClusterState,
    /// Namespace of the operator and the DRA driver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Ready and Error conditions, each with the generation it describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["type"]
    ))]
    pub conditions: Option<Vec<Condition>>,
    /// Per component (DaemonSet or Deployment) rollout counts and a one-line explanation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["name"]
    ))]
    pub components: Option<Vec<ComponentStatus>>,
}
