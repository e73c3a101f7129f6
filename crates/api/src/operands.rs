//! The container operand sections besides the driver: toolkit, device plugin, GFD, DCGM, DCGM
//! exporter, MIG, node status exporter, validator, GDS and GDRCopy (types; no IO).

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{
    ConfigMapName, ContainerOverrides, EnvVar, ImageSpec, annotation_map, enabled_or,
    pod_annotation_map, pod_label_map,
};

/// The NVIDIA Container Toolkit (DaemonSet nvidia-container-toolkit-daemonset).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ToolkitSpec {
    /// Deploy the toolkit through the operator. Defaults to true; set false when the toolkit is
    /// installed on the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// The toolkit image.
    #[serde(flatten)]
    pub image: ImageSpec,
    /// Resources, arguments and environment of the toolkit container. Environment variables
    /// such as CONTAINERD_CONFIG or CONTAINERD_SOCKET name host paths of the runtime.
    #[serde(flatten)]
    pub container: ContainerOverrides,
    /// Directory on the host where the toolkit installs its binaries and libraries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "/usr/local/nvidia"))]
    pub install_dir: Option<String>,
    /// Run the toolkit pods in the host's network namespace. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
}

impl ToolkitSpec {
    /// Whether the toolkit is deployed; true when `enabled` is absent.
    pub fn is_enabled(&self) -> bool {
        enabled_or(self.enabled, true)
    }
}

/// The NVIDIA device plugin (DaemonSet nvidia-device-plugin-daemonset, plus the MPS control
/// daemon when the sharing configuration asks for MPS).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DevicePluginSpec {
    /// Deploy the device plugin. Defaults to true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// The device plugin image (also used by its config-manager sidecar and the MPS daemon).
    #[serde(flatten)]
    pub image: ImageSpec,
    /// Resources, arguments and environment of the device plugin container.
    #[serde(flatten)]
    pub container: ContainerOverrides,
    /// The device plugin configuration (for example time-slicing or MPS sharing), shared with
    /// GPU feature discovery.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<DevicePluginConfig>,
    /// Host settings of the MPS control daemon.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps: Option<MpsConfig>,
    /// Run the device plugin pods in the host's network namespace. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
}

impl DevicePluginSpec {
    /// Whether the device plugin is deployed; true when `enabled` is absent.
    pub fn is_enabled(&self) -> bool {
        enabled_or(self.enabled, true)
    }
}

/// The ConfigMap that configures the device plugin and GPU feature discovery.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct DevicePluginConfig {
    /// Name of a ConfigMap in the operator's namespace. Each key holds one complete device
    /// plugin configuration file (version: v1, flags, sharing.timeSlicing or sharing.mps). A
    /// node picks a key with the label nvidia.com/device-plugin.config; other nodes use the
    /// default key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The key of the ConfigMap used on nodes that do not name one with the
    /// nvidia.com/device-plugin.config label. When it is absent and the ConfigMap has exactly
    /// one key, that key is used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<String>,
}

/// Host settings of the MPS control daemon.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct MpsConfig {
    /// Directory on the host where MPS keeps its pipes and logs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "/run/nvidia/mps"))]
    pub root: Option<String>,
}

/// The standalone DCGM host engine (DaemonSet nvidia-dcgm).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DcgmSpec {
    /// Run the DCGM host engine in its own pod. Defaults to true (NVIDIA's Helm chart sets
    /// false, and the exporter then runs an embedded engine).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// The DCGM image.
    #[serde(flatten)]
    pub image: ImageSpec,
    /// Resources, arguments and environment of the DCGM container.
    #[serde(flatten)]
    pub container: ContainerOverrides,
    /// Deprecated: the host port of the DCGM engine (5555); it is reached through a Service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_port: Option<i32>,
    /// Run the DCGM pods in the host's network namespace. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
}

impl DcgmSpec {
    /// Whether the standalone DCGM engine is deployed; true when `enabled` is absent.
    pub fn is_enabled(&self) -> bool {
        enabled_or(self.enabled, true)
    }
}

/// The DCGM exporter (DaemonSet nvidia-dcgm-exporter and its Service).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DcgmExporterSpec {
    /// Deploy the DCGM exporter. Defaults to true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// The DCGM exporter image.
    #[serde(flatten)]
    pub image: ImageSpec,
    /// Extra annotations for the exporter's pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "pod_annotation_map")]
    pub pod_annotations: Option<BTreeMap<String, String>>,
    /// Extra labels for the exporter's pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "pod_label_map")]
    pub pod_labels: Option<BTreeMap<String, String>>,
    /// Extra annotations for the exporter's pods (the spelling some NVIDIA releases document;
    /// merged with podAnnotations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "annotation_map")]
    pub annotations: Option<BTreeMap<String, String>>,
    /// Resources, arguments and environment of the exporter container.
    #[serde(flatten)]
    pub container: ContainerOverrides,
    /// A ConfigMap whose dcgm-metrics.csv key lists the metrics to collect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<ConfigMapName>,
    /// A Prometheus Operator ServiceMonitor for the exporter (created only when that API is
    /// served).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_monitor: Option<ServiceMonitorSpec>,
    /// The exporter's Service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<DcgmExporterServiceSpec>,
    /// Run the exporter in the host's PID namespace (needed to map processes to pods on some
    /// setups). Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "hostPID")]
    pub host_pid: Option<bool>,
    /// Serve metrics from the host's network namespace. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
    /// Attach HPC job identifiers to metrics, read from files a workload manager writes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hpc_job_mapping: Option<DcgmExporterHpcJobMappingSpec>,
    /// Add the Kubernetes labels of the pod using a GPU to its metrics (the exporter then reads
    /// pods cluster-wide). Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enable_pod_labels: Option<bool>,
    /// Add the UID of the pod using a GPU to its metrics (the exporter then reads pods
    /// cluster-wide). Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "enablePodUID")]
    pub enable_pod_uid: Option<bool>,
    /// Regular expressions selecting which pod labels enablePodLabels adds; all labels when
    /// empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_label_allowlist_regex: Option<Vec<String>>,
}

impl DcgmExporterSpec {
    /// Whether the exporter is deployed; true when `enabled` is absent.
    pub fn is_enabled(&self) -> bool {
        enabled_or(self.enabled, true)
    }

    /// Whether a ServiceMonitor is wanted; false when absent.
    pub fn service_monitor_enabled(&self) -> bool {
        self.service_monitor
            .as_ref()
            .is_some_and(|sm| enabled_or(sm.enabled, false))
    }
}

/// The Service in front of the DCGM exporter.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DcgmExporterServiceSpec {
    /// Service type, for example ClusterIP (the default) or NodePort.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "type")]
    pub type_: Option<String>,
    /// How nodes route traffic for the Service's cluster IP: Cluster or Local.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub internal_traffic_policy: Option<String>,
}

/// HPC job mapping of the DCGM exporter.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct DcgmExporterHpcJobMappingSpec {
    /// Turn HPC job mapping on. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Host directory holding the job mapping files; /var/lib/dcgm-exporter/job-mapping when
    /// empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub directory: Option<String>,
}

/// Prometheus' duration syntax, as NVIDIA's CRD checks it for scrape intervals and timeouts.
const DURATION_PATTERN: &str =
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$";

/// A Prometheus Operator ServiceMonitor (for the DCGM exporter, or the operator itself).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServiceMonitorSpec {
    /// Create the ServiceMonitor. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Scrape interval such as 15s or 1m30s (units y, w, d, h, m, s, ms). Prometheus' global
    /// interval applies when empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = DURATION_PATTERN))]
    pub interval: Option<String>,
    /// Time after which a scrape times out, in the same units as interval; Prometheus' global
    /// timeout applies when empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = DURATION_PATTERN))]
    pub scrape_timeout: Option<String>,
    /// On a label clash, keep the metric's label instead of the target's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub honor_labels: Option<bool>,
    /// Extra labels on the ServiceMonitor object (for example the label your Prometheus selects
    /// on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub additional_labels: Option<BTreeMap<String, String>>,
    /// Relabeling rules applied to scraped targets, in Prometheus' relabel_config form.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relabelings: Option<Vec<RelabelConfig>>,
}

/// One Prometheus relabeling rule.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RelabelConfig {
    /// What to do with matching targets: replace (the default), keep, drop, hashmod, labelmap,
    /// labeldrop, labelkeep, lowercase, uppercase, keepequal or dropequal (either spelling
    /// case).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend(
        "default" = "replace",
        "enum" = [
            "replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod",
            "labelmap", "LabelMap", "labeldrop", "LabelDrop", "labelkeep", "LabelKeep",
            "lowercase", "Lowercase", "uppercase", "Uppercase", "keepequal", "KeepEqual",
            "dropequal", "DropEqual"
        ]
    ))]
    pub action: Option<String>,
    /// Modulus of the hash, for the hashmod action.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modulus: Option<i64>,
    /// Regular expression matched against the joined source label values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regex: Option<String>,
    /// Value written on a match; regex capture groups such as $1 are available.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replacement: Option<String>,
    /// String placed between the source label values when they are joined.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub separator: Option<String>,
    /// Labels whose values are joined and matched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(inner(regex(pattern = r"^[a-zA-Z_][a-zA-Z0-9_]*$")))]
    pub source_labels: Option<Vec<String>>,
    /// Label that receives the result, for actions that write one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_label: Option<String>,
}

/// GPU feature discovery (DaemonSet gpu-feature-discovery).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GfdSpec {
    /// Deploy GPU feature discovery. Defaults to true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// The GPU feature discovery image.
    #[serde(flatten)]
    pub image: ImageSpec,
    /// Resources, arguments and environment of the GPU feature discovery container.
    #[serde(flatten)]
    pub container: ContainerOverrides,
    /// Run the GPU feature discovery pods in the host's network namespace. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
}

impl GfdSpec {
    /// Whether GPU feature discovery is deployed; true when `enabled` is absent.
    pub fn is_enabled(&self) -> bool {
        enabled_or(self.enabled, true)
    }
}

/// How MIG devices are advertised.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[schemars(description = "")]
#[serde(rename_all = "lowercase")]
pub enum MigStrategy {
    /// MIG devices are not advertised separately.
    None,
    /// All MIG devices of a node have the same profile and are advertised as nvidia.com/gpu.
    Single,
    /// Each MIG profile is advertised as its own resource, such as nvidia.com/mig-1g.5gb.
    Mixed,
}

/// MIG settings shared by the device plugin and GPU feature discovery.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct MigSpec {
    /// MIG strategy: none, single or mixed. When absent the plugins use their own default and
    /// only monitor MIG devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<MigStrategy>,
}

/// The MIG manager (DaemonSet nvidia-mig-manager, on MIG-capable nodes).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigManagerSpec {
    /// Deploy the MIG manager. Defaults to true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// The MIG manager image.
    #[serde(flatten)]
    pub image: ImageSpec,
    /// Resources, arguments and environment of the MIG manager container.
    #[serde(flatten)]
    pub container: ContainerOverrides,
    /// The MIG layouts (a mig-parted configuration) that nodes choose from with the
    /// nvidia.com/mig.config label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<MigPartedConfigSpec>,
    /// A ConfigMap listing the host services and clients that use the GPUs and are stopped
    /// while a GPU is repartitioned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_clients_config: Option<MigGpuClientsConfigSpec>,
    /// Run the MIG manager pods in the host's network namespace. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
}

impl MigManagerSpec {
    /// Whether the MIG manager is deployed; true when `enabled` is absent.
    pub fn is_enabled(&self) -> bool {
        enabled_or(self.enabled, true)
    }
}

/// Layout applied to MIG-capable nodes that carry no nvidia.com/mig.config label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[schemars(description = "")]
pub enum MigDefault {
    /// Label such nodes with all-disabled (MIG off on every GPU).
    #[serde(rename = "all-disabled")]
    AllDisabled,
    /// Leave such nodes unlabelled.
    #[serde(rename = "")]
    Unset,
}

/// The mig-parted configuration of the MIG manager.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct MigPartedConfigSpec {
    /// Name of a ConfigMap in the operator's namespace with a config.yaml key holding
    /// mig-configs. When empty, the operator's default layouts (default-mig-parted-config,
    /// one per MIG profile of the known GPU models) are used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Layout for MIG-capable nodes without a nvidia.com/mig.config label: all-disabled, or an
    /// empty string to leave them alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "all-disabled"))]
    pub default: Option<MigDefault>,
}

/// The gpu-clients configuration of the MIG manager.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct MigGpuClientsConfigSpec {
    /// Name of a ConfigMap in the operator's namespace with a clients.yaml key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// The node status exporter (DaemonSet nvidia-node-status-exporter).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatusExporterSpec {
    /// Deploy the node status exporter. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// The node status exporter image (the validator image by default).
    #[serde(flatten)]
    pub image: ImageSpec,
    /// Resources, arguments and environment of the node status exporter container.
    #[serde(flatten)]
    pub container: ContainerOverrides,
    /// Run the node status exporter pods in the host's network namespace. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
}

impl NodeStatusExporterSpec {
    /// Whether the node status exporter is deployed; false when `enabled` is absent.
    pub fn is_enabled(&self) -> bool {
        enabled_or(self.enabled, false)
    }
}

/// The operator validator (DaemonSet nvidia-operator-validator), always deployed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ValidatorSpec {
    /// Settings of the device plugin check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugin: Option<ValidatorComponentSpec>,
    /// Settings of the container toolkit check (also used by the toolkit-validation init
    /// containers of other operands).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub toolkit: Option<ValidatorComponentSpec>,
    /// Settings of the driver check (also used by the driver-validation init containers of
    /// other operands).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<ValidatorComponentSpec>,
    /// Settings of the CUDA workload check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda: Option<ValidatorComponentSpec>,
    /// Settings of the vfio-pci check (sandbox workloads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "vfioPCI")]
    pub vfio_pci: Option<ValidatorComponentSpec>,
    /// Settings of the vGPU manager check (sandbox workloads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vgpu_manager: Option<ValidatorComponentSpec>,
    /// Settings of the vGPU devices check (sandbox workloads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vgpu_devices: Option<ValidatorComponentSpec>,
    /// The validator image; its init containers also use it.
    #[serde(flatten)]
    pub image: ImageSpec,
    /// Resources, arguments and environment of the validator containers.
    #[serde(flatten)]
    pub container: ContainerOverrides,
    /// Run the validator pods in the host's network namespace. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
}

/// Settings of one validation step.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ValidatorComponentSpec {
    /// Environment variables for this validation step, for example WITH_WORKLOAD=false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<Vec<EnvVar>>,
}

/// GPUDirect Storage: the nvidia-fs kernel module, loaded by a sidecar of the driver pod.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuDirectStorageSpec {
    /// Turn GPUDirect Storage on. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// The nvidia-fs image, run as the nvidia-fs-ctr sidecar of the driver pods. The tag gets
    /// the GPU nodes' OS suffix (for example 2.29.4-ubuntu22.04) unless it is a digest.
    #[serde(flatten)]
    pub image: ImageSpec,
    /// Accepted for compatibility and not used: NVIDIA's operator does not pass them to the
    /// nvidia-fs container either (status lists them as not acted on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<Vec<String>>,
    /// Environment variables of the nvidia-fs container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<Vec<EnvVar>>,
}

impl GpuDirectStorageSpec {
    /// Whether GPUDirect Storage is on; false when `enabled` is absent.
    pub fn is_enabled(&self) -> bool {
        enabled_or(self.enabled, false)
    }
}

/// GDRCopy: the gdrdrv kernel module, loaded by a sidecar of the driver pod.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GdrCopySpec {
    /// Turn GDRCopy on. Defaults to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// The gdrdrv image, run as the nvidia-gdrcopy-ctr sidecar of the driver pods. The tag gets
    /// the GPU nodes' OS suffix (for example v2.6-ubuntu22.04) unless it is a digest.
    #[serde(flatten)]
    pub image: ImageSpec,
    /// Accepted for compatibility and not used: NVIDIA's operator does not pass them to the
    /// gdrcopy container either (status lists them as not acted on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<Vec<String>>,
    /// Environment variables of the gdrdrv container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<Vec<EnvVar>>,
}

impl GdrCopySpec {
    /// Whether GDRCopy is on; false when `enabled` is absent.
    pub fn is_enabled(&self) -> bool {
        enabled_or(self.enabled, false)
    }
}
