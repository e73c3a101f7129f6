//! The `nvidia.com/v1` `ClusterPolicy` API: types, defaults and image resolution (pure, no IO).
//!
//! Field names, shapes, enums and server-side defaults follow NVIDIA's GPU Operator so that
//! users' YAML, Helm values and `kubectl patch` one-liners apply unchanged. Our own additions
//! (`spec.nfd`, `status.components`, a few fields NVIDIA's newer releases document) are optional
//! fields only. Every field is optional on the Rust side and omitted when absent, so a read-back
//! returns exactly what was written plus the defaults the API server applies from the CRD.
//!
//! Enablement defaults ("is the driver on when `enabled` is absent?") are never stored: they live
//! in [`Component`] and the `is_enabled()` accessors, mirroring NVIDIA's rules.
//!
//! Schema conventions: server-side `default`s are exactly NVIDIA's (added with
//! `#[schemars(extend("default" = ...))]`, never with serde defaults, which would also inject
//! values client-side); enum types carry `#[schemars(description = "")]` so that the field's own
//! description, not the enum's, reaches `kubectl explain`; [`crd::crd`] tidies the rest.

mod common;
mod component;
pub mod crd;
mod driver;
#[cfg(test)]
mod example_tests;
mod gpu_cluster;
pub mod gpu_cluster_crd;
mod gpu_readiness;
pub mod image;
mod layouts_by_model;
mod nfd;
mod node_pools;
#[cfg(test)]
mod nvidia_compat_tests;
mod nvidia_driver;
pub mod nvidia_driver_crd;
mod operands;
mod platform;
mod sandbox;
mod status;
mod unsupported;

use kube_derive::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use common::{
    ConfigMapName, ContainerOverrides, ContainerProbeSpec, EnvVar, ImageSpec, ResourceRequirements,
};
pub use component::Component;
pub use driver::{
    DriverLicensingConfigSpec, DriverManagerSpec, DriverRepoConfigSpec, DriverSpec,
    DriverUpgradePolicySpec, GpuDirectRdmaSpec, KernelModuleType, UpgradeDrainSpec,
    UpgradePodDeletionSpec, VirtualTopologyConfigSpec, WaitForCompletionSpec,
};
pub use gpu_cluster::{
    AttributeDeviceClass, DraComputeDomainsSpec, DraControllerSpec, DraDeviceType, DraDriverSpec,
    DraGpusSpec, DraHealthcheckSpec, DraKubeletPluginSpec, GPU_CLUSTER_NAME, GPUCluster,
    GpuClusterHostPaths, GpuClusterSpec, GpuClusterState, GpuClusterStatus,
};
pub use gpu_readiness::{
    DEFAULT_MAX_UNHEALTHY_PERCENT, DEFAULT_QUARANTINE_GRACE_SECONDS, GpuReadinessSpec,
    QuarantineSpec, StartupTaintSpec,
};
pub use image::{EnvLookup, ImageError, ImageKind, ImageSource, ResolvedImage, resolve};
pub use layouts_by_model::{LayoutsByModel, ModelLayout};
pub use nfd::{NfdMasterSpec, NfdSpec, NfdWorkerSpec};
pub use node_pools::{
    DEFAULT_GPU_MEMORY_RESOURCE, DerivedLabelsSpec, GpuMemoryResourceSpec, MemoryUnit,
    NodePoolTaint, NodePoolsSpec, PoolPriorityClass, PreemptionPolicy, TaintEffect,
};
pub use nvidia_driver::{
    DEFAULT_DRIVER_IMAGE, NVIDIADriver, NvidiaDriverLicensingConfig, NvidiaDriverSpec,
    NvidiaDriverState, NvidiaDriverStatus, NvidiaDriverType, POOL_AUTO_UPGRADE_DEFAULT,
};
pub use operands::{
    DcgmExporterHpcJobMappingSpec, DcgmExporterServiceSpec, DcgmExporterSpec, DcgmSpec,
    DevicePluginConfig, DevicePluginSpec, GdrCopySpec, GfdSpec, GpuDirectStorageSpec, MigDefault,
    MigGpuClientsConfigSpec, MigManagerSpec, MigPartedConfigSpec, MigSpec, MigStrategy, MpsConfig,
    NodeStatusExporterSpec, RelabelConfig, ServiceMonitorSpec, ToolkitSpec, ValidatorComponentSpec,
    ValidatorSpec,
};
pub use platform::{
    CdiConfigSpec, DaemonsetsSpec, HostPathsSpec, InitContainerSpec, OperatorMetricsSpec,
    OperatorSpec, PsaSpec, PspSpec, RollingUpdateSpec, UpdateStrategy,
};
pub use sandbox::{
    CcManagerSpec, CcMode, KataArtifacts, KataManagerConfig, KataManagerSpec, KataRuntimeClass,
    KataSandboxDevicePluginSpec, SandboxDevicePluginSpec, SandboxMode, SandboxWorkload,
    SandboxWorkloadsSpec, VfioManagerSpec, VgpuDeviceManagerSpec, VgpuDevicesConfigSpec,
    VgpuManagerSpec,
};
pub use status::{ClusterPolicyStatus, ComponentStatus, State};
pub use unsupported::{NOT_ACTED_ON, Unsupported};

/// API group of the ClusterPolicy resource.
pub const GROUP: &str = "nvidia.com";
/// API version of the ClusterPolicy resource.
pub const VERSION: &str = "v1";
/// Oldest Kubernetes minor release this API and the operator support: the oldest release that
/// the kube 5 / k8s-openapi 0.29 client stack supports. The CRD's CEL rules
/// (`x-kubernetes-validations` with `message`, `type(self)` on int-or-string fields) need 1.29
/// or later, well inside that range.
pub const MIN_KUBERNETES_VERSION: &str = "1.33";

/// Desired state of the NVIDIA GPU software stack, one object for the whole cluster.
///
/// Every section is optional. A section that is absent behaves like an empty one: each operand
/// then follows its documented default (for example the driver, toolkit, device plugin, GPU
/// feature discovery, DCGM, DCGM exporter and MIG manager are deployed; GDS, GDRCopy, the node
/// status exporter and all sandbox operands are not).
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    crates(kube_core = "::kube_core"),
    group = "nvidia.com",
    version = "v1",
    kind = "ClusterPolicy",
    plural = "clusterpolicies",
    singular = "clusterpolicy",
    status = "ClusterPolicyStatus",
    doc = "The NVIDIA GPU software stack of the cluster: which operands run on GPU nodes and how. One ClusterPolicy is active; others are marked ignored.",
    printcolumn = r#"{"name":"Status","type":"string","description":"Overall state: ready, notReady or ignored","jsonPath":".status.state"}"#,
    printcolumn = r#"{"name":"GPU Nodes","type":"integer","description":"Nodes labelled nvidia.com/gpu.present=true","jsonPath":".status.gpuNodes"}"#,
    printcolumn = r#"{"name":"Operands","type":"string","description":"Operand workloads ready out of those enabled","jsonPath":".status.operandsReady"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","description":"Why the policy is or is not ready (the Ready condition's reason)","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterPolicySpec {
    /// Settings of the operator itself that apply to every operand: default container runtime,
    /// RuntimeClass name, extra labels and annotations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operator: Option<OperatorSpec>,
    /// Settings shared by every operand DaemonSet: tolerations, priority class, update strategy,
    /// labels, annotations and pod security context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daemonsets: Option<DaemonsetsSpec>,
    /// The containerised NVIDIA kernel driver (DaemonSet nvidia-driver-daemonset). Deployed
    /// unless enabled is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<DriverSpec>,
    /// The NVIDIA Container Toolkit, which configures the node's container runtime for GPUs.
    /// Deployed unless enabled is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub toolkit: Option<ToolkitSpec>,
    /// The NVIDIA device plugin, which advertises nvidia.com/gpu to the kubelet (with optional
    /// time-slicing or MPS sharing). Deployed unless enabled is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_plugin: Option<DevicePluginSpec>,
    /// The standalone DCGM host engine (DaemonSet nvidia-dcgm). Deployed unless enabled is
    /// false; NVIDIA's Helm chart sets it to false by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dcgm: Option<DcgmSpec>,
    /// The DCGM exporter, which publishes GPU metrics for Prometheus. Deployed unless enabled is
    /// false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dcgm_exporter: Option<DcgmExporterSpec>,
    /// GPU feature discovery, which labels nodes with GPU model, memory, count and sharing
    /// replicas. Deployed unless enabled is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gfd: Option<GfdSpec>,
    /// How MIG devices are exposed by the device plugin and GPU feature discovery.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigSpec>,
    /// The MIG manager, which partitions MIG-capable GPUs according to the nvidia.com/mig.config
    /// node label. Deployed unless enabled is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_manager: Option<MigManagerSpec>,
    /// The node status exporter (node-level validation metrics). Deployed only when enabled is
    /// true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_status_exporter: Option<NodeStatusExporterSpec>,
    /// The operator validator, which checks driver, toolkit, CUDA and device plugin on every GPU
    /// node and gates the other operands. Always deployed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validator: Option<ValidatorSpec>,
    /// How the Container Device Interface (CDI) is used to give containers access to GPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cdi: Option<CdiConfigSpec>,
    /// Pod Security Admission: when enabled, the operator labels its namespace so that the
    /// privileged operand pods are admitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub psa: Option<PsaSpec>,
    /// Deprecated and ignored: PodSecurityPolicies no longer exist in Kubernetes. Kept so that
    /// older policies still apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub psp: Option<PspSpec>,
    /// Host paths the operands need when the node's layout differs from the usual one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_paths: Option<HostPathsSpec>,
    /// GPUDirect Storage: the nvidia-fs kernel module, built and loaded by the nvidia-fs-ctr
    /// sidecar of the driver pods. Off unless enabled is true. Not with precompiled drivers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gds: Option<GpuDirectStorageSpec>,
    /// GDRCopy: the gdrdrv kernel module, built and loaded by the nvidia-gdrcopy-ctr sidecar of
    /// the driver pods. Off unless enabled is true. Not with precompiled drivers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gdrcopy: Option<GdrCopySpec>,
    /// GPUs for sandboxed workloads (virtual machines). When enabled, nodes can be dedicated to
    /// VM passthrough or vGPU instead of containers. Not supported by this operator yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_workloads: Option<SandboxWorkloadsSpec>,
    /// The vGPU host manager (vGPU host driver) for vm-vgpu nodes. Not supported by this operator
    /// yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vgpu_manager: Option<VgpuManagerSpec>,
    /// The vGPU device manager, which creates vGPU devices on vm-vgpu nodes. Not supported by
    /// this operator yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vgpu_device_manager: Option<VgpuDeviceManagerSpec>,
    /// The VFIO manager, which binds GPUs to vfio-pci on vm-passthrough nodes. Not supported by
    /// this operator yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vfio_manager: Option<VfioManagerSpec>,
    /// The sandbox device plugin, which advertises passthrough GPUs and vGPUs to KubeVirt. Not
    /// supported by this operator yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_device_plugin: Option<SandboxDevicePluginSpec>,
    /// The Kata sandbox device plugin, which advertises GPUs to Kata Containers when
    /// sandboxWorkloads.mode is kata. Not supported by this operator yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kata_sandbox_device_plugin: Option<KataSandboxDevicePluginSpec>,
    /// The Kata manager, which prepares Kata Containers runtime classes for GPUs. Not supported
    /// by this operator yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kata_manager: Option<KataManagerSpec>,
    /// The confidential computing manager, which sets the CC mode of capable GPUs. Not
    /// supported by this operator yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cc_manager: Option<CcManagerSpec>,
    /// Node Feature Discovery, deployed by this operator (an addition to NVIDIA's API, where the
    /// Helm chart deploys it). NFD labels nodes with their PCI devices, which is how GPU nodes
    /// are found. Deployed unless enabled is false, and skipped when NFD already runs in the
    /// cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nfd: Option<NfdSpec>,
    /// GPU node pools (an addition to NVIDIA's API): taints and labels the operator keeps on
    /// every GPU node, derived from GPU feature discovery's labels where asked. Off unless
    /// enabled is true; operands tolerate the taints listed here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_pools: Option<NodePoolsSpec>,
    /// GPU memory as an extended resource in each GPU node's capacity (an addition to NVIDIA's
    /// API), so pods can request GPU memory. Scheduler accounting only, not isolation. Off
    /// unless enabled is true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory_resource: Option<GpuMemoryResourceSpec>,
    /// GPU readiness (an addition to NVIDIA's API): a startup taint lifted once a node's GPUs
    /// are usable, and a quarantine of nodes whose GPUs go missing that lifts itself. Off unless
    /// set; operands tolerate both taints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_readiness: Option<GpuReadinessSpec>,
    /// Sharing and MIG layouts by GPU model (an addition to NVIDIA's API): the operator sets
    /// each GPU node's `nvidia.com/device-plugin.config` and `nvidia.com/mig.config` from its
    /// `nvidia.com/gpu.product`, never over a value someone else set, and removes what it set
    /// when the entry goes. Every entry is checked against the sharing ConfigMap and the MIG
    /// layouts for that model before a node is labelled. Off when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "layouts_by_model::layouts_by_model")]
    pub layouts_by_model: Option<LayoutsByModel>,
}

impl ClusterPolicySpec {
    /// Whether `component` is to be deployed, following NVIDIA's rules for absent fields
    /// (see [`Component::enabled_by_default`]). Sandbox operands additionally need
    /// `sandboxWorkloads.enabled: true`, as in NVIDIA's operator.
    pub fn is_enabled(&self, component: Component) -> bool {
        component::is_enabled(self, component)
    }

    /// Components that the policy turns on but this operator does not deploy yet, in a stable
    /// order. The status stage reports each of them; their sections are stored untouched.
    pub fn unsupported_enabled(&self) -> Vec<Component> {
        Component::ALL
            .into_iter()
            .filter(|c| !c.is_supported() && self.is_enabled(*c))
            .collect()
    }
}
