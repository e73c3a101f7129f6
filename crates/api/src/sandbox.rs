//! Sandbox (virtual machine) sections: `sandboxWorkloads`, vGPU, VFIO, sandbox device plugin,
//! Kata and confidential computing managers (types; no IO).
//!
//! The sections are typed so that policies written for NVIDIA's operator apply unchanged and
//! read back intact, and so that status can name an enabled section this operator does not
//! deploy precisely (the vGPU managers not yet; kata-manager never, as it is deprecated).

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::DriverManagerSpec;
use super::common::{ConfigMapName, ContainerOverrides, ImageSpec, enabled_or};

/// Kind of workload a GPU node is prepared for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[schemars(description = "")]
pub enum SandboxWorkload {
    /// Containers (the usual GPU stack).
    #[serde(rename = "container")]
    Container,
    /// Virtual machines with whole GPUs passed through (vfio-pci).
    #[serde(rename = "vm-passthrough")]
    VmPassthrough,
    /// Virtual machines with vGPUs.
    #[serde(rename = "vm-vgpu")]
    VmVgpu,
}

impl SandboxWorkload {
    /// NVIDIA's name of the type, as the node label `nvidia.com/gpu.workload.config` and the
    /// policy spell it.
    pub const fn as_str(self) -> &'static str {
        match self {
            SandboxWorkload::Container => "container",
            SandboxWorkload::VmPassthrough => "vm-passthrough",
            SandboxWorkload::VmVgpu => "vm-vgpu",
        }
    }
}

/// How sandboxed (virtual machine) workloads run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[schemars(description = "")]
#[serde(rename_all = "lowercase")]
pub enum SandboxMode {
    /// KubeVirt virtual machines.
    #[default]
    Kubevirt,
    /// Kata Containers.
    Kata,
}

/// Sandbox (virtual machine) workloads.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxWorkloadsSpec {
    /// Manage the extra operands that virtual machine workloads need. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Workload type of nodes that do not choose one with the nvidia.com/gpu.workload.config
    /// label: container (the default), vm-passthrough or vm-vgpu.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "container"))]
    pub default_workload: Option<SandboxWorkload>,
    /// How virtual machine workloads run: kubevirt (the default; the sandbox device plugin
    /// serves them) or kata (Kata Containers; the Kata sandbox device plugin and the CC manager
    /// serve them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "kubevirt"))]
    pub mode: Option<SandboxMode>,
}

impl SandboxWorkloadsSpec {
    /// Whether sandbox workloads are managed; false when `enabled` is absent.
    pub fn is_enabled(&self) -> bool {
        enabled_or(self.enabled, false)
    }

    /// The sandbox mode; kubevirt when `mode` is absent.
    pub fn mode(&self) -> SandboxMode {
        self.mode.unwrap_or_default()
    }
}

/// The vGPU host manager.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VgpuManagerSpec {
    /// Deploy the vGPU manager (needs sandboxWorkloads.enabled). Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// The vGPU manager image.
    #[serde(flatten)]
    pub image: ImageSpec,
    /// Resources, arguments and environment of the vGPU manager container.
    #[serde(flatten)]
    pub container: ContainerOverrides,
    /// The k8s-driver-manager init container of the vGPU manager pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_manager: Option<DriverManagerSpec>,
    /// A ConfigMap with kernel module parameters for the vGPU manager.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_module_config: Option<ConfigMapName>,
    /// Run the vGPU manager pods in the host's network namespace. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
}

/// The vGPU device manager.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VgpuDeviceManagerSpec {
    /// Deploy the vGPU device manager (needs sandboxWorkloads.enabled). Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// The vGPU device manager image.
    #[serde(flatten)]
    pub image: ImageSpec,
    /// Resources, arguments and environment of the vGPU device manager container.
    #[serde(flatten)]
    pub container: ContainerOverrides,
    /// The vGPU device layouts nodes choose from with the nvidia.com/vgpu.config label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<VgpuDevicesConfigSpec>,
    /// Run the vGPU device manager pods in the host's network namespace. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
}

/// The vGPU devices configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct VgpuDevicesConfigSpec {
    /// Name of a ConfigMap in the operator's namespace with the vGPU device layouts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Layout for nodes that do not name one with a label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "default"))]
    pub default: Option<String>,
}

/// The VFIO manager.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VfioManagerSpec {
    /// Deploy the VFIO manager (needs sandboxWorkloads.enabled). Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// The VFIO manager image.
    #[serde(flatten)]
    pub image: ImageSpec,
    /// Resources, arguments and environment of the VFIO manager container.
    #[serde(flatten)]
    pub container: ContainerOverrides,
    /// The k8s-driver-manager init container of the VFIO manager pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_manager: Option<DriverManagerSpec>,
    /// Run the VFIO manager pods in the host's network namespace. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
}

/// The sandbox device plugin.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxDevicePluginSpec {
    /// Deploy the sandbox device plugin (needs sandboxWorkloads.enabled). Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// The sandbox device plugin image.
    #[serde(flatten)]
    pub image: ImageSpec,
    /// Resources, arguments and environment of the sandbox device plugin container.
    #[serde(flatten)]
    pub container: ContainerOverrides,
    /// Run the sandbox device plugin pods in the host's network namespace. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
}

/// The Kata sandbox device plugin, which advertises GPUs to Kata Containers (sandbox mode
/// kata).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KataSandboxDevicePluginSpec {
    /// Deploy the Kata sandbox device plugin (needs sandboxWorkloads.enabled and
    /// sandboxWorkloads.mode kata). Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// The Kata sandbox device plugin image.
    #[serde(flatten)]
    pub image: ImageSpec,
    /// Resources, arguments and environment of the Kata sandbox device plugin container.
    #[serde(flatten)]
    pub container: ContainerOverrides,
    /// Run the Kata sandbox device plugin pods in the host's network namespace. Defaults to
    /// false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
}

/// The Kata manager. Deprecated: not deployed, as NVIDIA's operator has not deployed it since
/// v26.7; the Kata runtime and its RuntimeClasses come from a Kata Containers installation.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KataManagerSpec {
    /// Deprecated and not deployed: the Kata runtime and its RuntimeClasses come from a Kata
    /// Containers installation. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Kata runtime classes to prepare.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<KataManagerConfig>,
    /// The Kata manager image.
    #[serde(flatten)]
    pub image: ImageSpec,
    /// Resources, arguments and environment of the Kata manager container.
    #[serde(flatten)]
    pub container: ContainerOverrides,
    /// Run the Kata manager pods in the host's network namespace. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
}

/// Configuration of the Kata manager.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KataManagerConfig {
    /// Host directory where Kata artifacts (guest kernels, images, configuration) are stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "/opt/nvidia-gpu-operator/artifacts/runtimeclasses"))]
    pub artifacts_dir: Option<String>,
    /// Kata runtime classes to configure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_classes: Option<Vec<KataRuntimeClass>>,
}

/// One Kata runtime class.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KataRuntimeClass {
    /// Name of the RuntimeClass.
    pub name: String,
    /// Node labels that the RuntimeClass's pods are scheduled by.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,
    /// The artifacts that belong to this runtime class.
    pub artifacts: KataArtifacts,
}

/// Where a Kata runtime class's artifacts come from.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KataArtifacts {
    /// OCI artifact holding everything the runtime class needs.
    pub url: String,
    /// Secret used to pull the artifact.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull_secret: Option<String>,
}

/// Confidential computing mode of capable GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[schemars(description = "")]
#[serde(rename_all = "lowercase")]
pub enum CcMode {
    /// Confidential computing on.
    On,
    /// Confidential computing off.
    Off,
    /// Developer tools mode.
    Devtools,
    /// Protected PCIe mode (multi-GPU systems).
    Ppcie,
}

/// The confidential computing manager.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CcManagerSpec {
    /// Deploy the CC manager (needs sandboxWorkloads.enabled). Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// CC mode of capable GPUs on nodes that do not choose one with the nvidia.com/cc.mode
    /// label: on, off, devtools or ppcie (the CC manager's own default is on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_mode: Option<CcMode>,
    /// The CC manager image.
    #[serde(flatten)]
    pub image: ImageSpec,
    /// Resources, arguments and environment of the CC manager container.
    #[serde(flatten)]
    pub container: ContainerOverrides,
    /// Run the CC manager pods in the host's network namespace. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
}

macro_rules! off_by_default {
    ($($spec:ty),*) => {$(
        impl $spec {
            /// Whether this section is switched on; false when `enabled` is absent. Deployment
            /// also needs `sandboxWorkloads.enabled`.
            pub fn is_enabled(&self) -> bool {
                enabled_or(self.enabled, false)
            }
        }
    )*};
}

off_by_default!(
    VgpuManagerSpec,
    VgpuDeviceManagerSpec,
    VfioManagerSpec,
    SandboxDevicePluginSpec,
    KataSandboxDevicePluginSpec,
    KataManagerSpec,
    CcManagerSpec
);
