//! The `spec.driver` section: the containerised NVIDIA driver and its upgrade policy (types; no IO).

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

use super::common::{
    ConfigMapName, ContainerOverrides, ContainerProbeSpec, EnvVar, ImageSpec, enabled_or,
};

/// Schema of the upgrade policy's `maxUnavailable`: an integer or a percentage string.
fn upgrade_max_unavailable(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-int-or-string": true,
        "maxLength": 16,
        "default": "25%",
        "x-kubernetes-validations": [{
            "rule": "type(self) == int ? self >= 0 : self.matches('^[0-9]+%$')",
            "message": "driver.upgradePolicy.maxUnavailable must be a non-negative integer or a percentage such as 25%"
        }]
    })
}

/// Which flavour of the NVIDIA kernel modules the driver container builds and loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[schemars(description = "")]
#[serde(rename_all = "lowercase")]
pub enum KernelModuleType {
    /// Let the driver container choose from the GPUs present and the driver branch.
    Auto,
    /// The open GPU kernel modules.
    Open,
    /// The proprietary kernel modules.
    Proprietary,
}

/// The containerised NVIDIA driver (DaemonSet nvidia-driver-daemonset, updated OnDelete).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DriverSpec {
    /// Deploy the driver through the operator. Defaults to true; set false when the driver is
    /// installed on the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Manage the driver through NVIDIADriver resources instead of this section. Defaults to
    /// false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "useNvidiaDriverCRD")]
    pub use_nvidia_driver_crd: Option<bool>,
    /// Use driver images with kernel modules precompiled for the node's kernel. Defaults to
    /// false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_precompiled: Option<bool>,
    /// Deprecated and ignored; use kernelModuleType instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_open_kernel_modules: Option<bool>,
    /// Kernel module flavour: auto (the default), open or proprietary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "auto"))]
    pub kernel_module_type: Option<KernelModuleType>,
    /// Startup probe timing of the driver container (building the modules can take minutes).
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
    /// Automatic, node-by-node driver upgrades (cordon, drain, replace the driver pod).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upgrade_policy: Option<DriverUpgradePolicySpec>,
    /// The driver image. The tag gets the node's OS suffix (for example -ubuntu22.04) unless
    /// version is a digest.
    #[serde(flatten)]
    pub image: ImageSpec,
    /// The k8s-driver-manager init container, which prepares a node before the driver pod
    /// (evicting GPU pods, unloading old modules).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manager: Option<DriverManagerSpec>,
    /// Resources, arguments and environment of the driver container.
    #[serde(flatten)]
    pub container: ContainerOverrides,
    /// A ConfigMap with package repository files for the driver container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repo_config: Option<DriverRepoConfigSpec>,
    /// A ConfigMap with extra CA certificates for the driver container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_config: Option<ConfigMapName>,
    /// vGPU guest driver licensing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub licensing_config: Option<DriverLicensingConfigSpec>,
    /// vGPU virtual topology daemon configuration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_topology: Option<VirtualTopologyConfigSpec>,
    /// A ConfigMap with kernel module parameters for the driver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_module_config: Option<ConfigMapName>,
    /// Name of a Secret whose keys become environment variables of the driver container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_env: Option<String>,
    /// Run the driver pod in the host's network namespace. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
}

impl DriverSpec {
    /// Whether the driver is deployed; true when `enabled` is absent.
    pub fn is_enabled(&self) -> bool {
        enabled_or(self.enabled, true)
    }

    /// Whether NVIDIADriver resources manage the driver instead of this section.
    pub fn uses_nvidia_driver_crd(&self) -> bool {
        self.use_nvidia_driver_crd.unwrap_or(false)
    }

    /// Whether precompiled driver images are used.
    pub fn uses_precompiled(&self) -> bool {
        self.use_precompiled.unwrap_or(false)
    }

    /// Whether GPUDirect RDMA (nvidia-peermem) is on; off when the section is absent.
    pub fn rdma_enabled(&self) -> bool {
        self.rdma
            .as_ref()
            .is_some_and(GpuDirectRdmaSpec::is_enabled)
    }

    /// Whether vGPU licensing is configured (a ConfigMap or Secret is named).
    pub fn vgpu_licensing_enabled(&self) -> bool {
        self.licensing_config.as_ref().is_some_and(|l| {
            l.config_map_name.as_deref().is_some_and(|n| !n.is_empty())
                || l.secret_name.as_deref().is_some_and(|n| !n.is_empty())
        })
    }
}

/// The k8s-driver-manager init container of a driver DaemonSet.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DriverManagerSpec {
    /// The driver manager image.
    #[serde(flatten)]
    pub image: ImageSpec,
    /// Environment variables of the driver manager, for example ENABLE_GPU_POD_EVICTION.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<Vec<EnvVar>>,
}

/// GPUDirect RDMA settings.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuDirectRdmaSpec {
    /// Load nvidia-peermem with the driver. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Use the MOFED drivers installed on the host rather than the network operator's.
    /// Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_host_mofed: Option<bool>,
}

impl GpuDirectRdmaSpec {
    /// Whether RDMA is on; false when `enabled` is absent.
    pub fn is_enabled(&self) -> bool {
        enabled_or(self.enabled, false)
    }

    /// Whether the host's MOFED drivers are used (only meaningful with RDMA on).
    pub fn uses_host_mofed(&self) -> bool {
        self.is_enabled() && self.use_host_mofed.unwrap_or(false)
    }
}

/// A ConfigMap holding package repository configuration for the driver container.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DriverRepoConfigSpec {
    /// Name of the ConfigMap in the operator's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map_name: Option<String>,
}

/// vGPU licensing of the driver.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DriverLicensingConfigSpec {
    /// Deprecated: a ConfigMap with the licensing configuration; prefer secretName.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map_name: Option<String>,
    /// A Secret with the licensing configuration and client token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_name: Option<String>,
    /// License through the NVIDIA Licensing System. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nls_enabled: Option<bool>,
}

/// vGPU virtual topology daemon configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct VirtualTopologyConfigSpec {
    /// Name of a ConfigMap holding nvidia-topologyd.conf.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<String>,
}

/// Automatic driver upgrades, one group of nodes at a time.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DriverUpgradePolicySpec {
    /// Turn automatic upgrades on. When false, every other setting here is ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = false))]
    pub auto_upgrade: Option<bool>,
    /// How many nodes may upgrade at the same time; 0 means no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0), extend("default" = 1))]
    pub max_parallel_upgrades: Option<i64>,
    /// How many nodes with the driver may be unavailable during the upgrade: a number, or a
    /// percentage of the nodes (rounded up) such as 25%.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "upgrade_max_unavailable")]
    pub max_unavailable: Option<IntOrString>,
    /// Deleting pods that use GPUs before the driver is replaced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_deletion: Option<UpgradePodDeletionSpec>,
    /// Waiting for selected pods (for example batch jobs) to finish before upgrading a node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_for_completion: Option<WaitForCompletionSpec>,
    /// Draining a node before its driver is replaced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain: Option<UpgradeDrainSpec>,
}

/// Deleting GPU pods during an upgrade.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UpgradePodDeletionSpec {
    /// Delete pods that no controller manages as well.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = false))]
    pub force: Option<bool>,
    /// Seconds to wait for the pods to terminate; 0 waits forever.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0), extend("default" = 300))]
    pub timeout_seconds: Option<i64>,
    /// Go on even when pods use emptyDir volumes (their data is lost).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = false))]
    pub delete_empty_dir: Option<bool>,
}

/// Waiting for workloads to complete before a node is upgraded.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WaitForCompletionSpec {
    /// Label selector of the pods to wait for, for example app=training.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<String>,
    /// Seconds to wait; 0 waits forever.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0), extend("default" = 0))]
    pub timeout_seconds: Option<i64>,
}

/// Draining a node during an upgrade.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UpgradeDrainSpec {
    /// Allow draining the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = false))]
    pub enable: Option<bool>,
    /// Also evict pods that no controller manages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = false))]
    pub force: Option<bool>,
    /// Label selector limiting which pods are drained.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<String>,
    /// Seconds to wait for the drain; 0 waits forever.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0), extend("default" = 300))]
    pub timeout_seconds: Option<i64>,
    /// Go on even when pods use emptyDir volumes (their data is lost).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = false))]
    pub delete_empty_dir: Option<bool>,
}
