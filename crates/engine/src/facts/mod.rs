//! Cluster facts (resolve stage output; plain data, no IO): what the cluster told us that the
//! validate and render stages need. The `resolve` module fills it from the API server; the
//! `render` subcommand fills it from flags, so rendering never needs a client (decision 3).

mod assemble;
mod flavour;

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

use crate::nodes::NodeView;

pub use assemble::{
    NamespaceObjects, Observed, assemble, cluster_runtime, config_map_names, gpu_nodes,
    live_driver_toolkit, nfd_already_running, nfd_beside_ours, owner_reference, parse_runtime,
};
pub use flavour::{
    FlavourPaths, MICROK8S_LABEL, NodeRuntime, NodeRuntimeInfo, NodeRuntimes, ReadOnlyImage,
    RuntimeFlavour, detect, on_cluster,
};

/// The container runtime of the cluster's GPU nodes; one for the whole cluster.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Runtime {
    #[default]
    Containerd,
    CriO,
    Docker,
}

impl Runtime {
    /// The value NVIDIA's toolkit expects in its `RUNTIME` variable.
    pub const fn toolkit_name(self) -> &'static str {
        match self {
            Runtime::Containerd => "containerd",
            Runtime::CriO => "crio",
            Runtime::Docker => "docker",
        }
    }
}

/// A ConfigMap the policy references by name (sharing config, MIG config, DCGM metrics CSV),
/// as read from the cluster: its name and data.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConfigMapData {
    pub name: String,
    pub data: BTreeMap<String, String>,
}

/// The device-plugin sharing config that consumers are to mount (decision 4): the keys that
/// passed validation (or the last good ones), and which key is the default.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SharingConfig {
    /// The user's ConfigMap (`devicePlugin.config.name`); the operator-owned copy is named
    /// `<source>-<hash>`.
    pub source: String,
    /// Every key of the copy, each a complete device-plugin config file.
    pub data: BTreeMap<String, String>,
    /// The key nodes without the `nvidia.com/device-plugin.config` label use.
    pub default_key: String,
    /// True when `devicePlugin.config.default` was absent and the only key was taken.
    pub default_inferred: bool,
}

/// What the live device plugin mounts (decision 4's "last good" sharing config).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum LastGood {
    /// No live device plugin, or one without a sharing config.
    #[default]
    Nothing,
    /// The copy it mounts, read back from the cluster.
    Copy(SharingConfig),
    /// It mounts a copy that no longer exists (someone deleted it).
    Gone(String),
}

/// The policy's own driver DaemonSets that run now (NVIDIADriver pools' aside): a switch
/// between driver variants hands their nodes over one at a time (operands::driver_variant).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LiveDriver {
    pub daemon_sets: Vec<Arc<k8s_openapi::api::apps::v1::DaemonSet>>,
}

impl LiveDriver {
    /// One labelled DaemonSet per variant (tests build what runs from it).
    #[cfg(test)]
    pub fn running(variants: &[crate::operands::driver_variant::Variant]) -> LiveDriver {
        use crate::operands::driver_variant::VARIANT_LABEL;
        let daemon_set = |v: &crate::operands::driver_variant::Variant| {
            let mut ds = k8s_openapi::api::apps::v1::DaemonSet::default();
            ds.metadata.name = Some(format!("nvidia-driver-daemonset-{}", v.label()));
            ds.metadata.labels = Some([(VARIANT_LABEL.to_owned(), v.label().to_owned())].into());
            Arc::new(ds)
        };
        LiveDriver {
            daemon_sets: variants.iter().map(daemon_set).collect(),
        }
    }

    /// Whether a DaemonSet of `variant` runs.
    pub fn runs(&self, variant: crate::operands::driver_variant::Variant) -> bool {
        self.daemon_sets
            .iter()
            .any(|ds| crate::operands::driver_variant::Variant::of_daemon_set(ds) == variant)
    }
}

/// Everything validate and render need to know about the cluster: facts only, no verdicts
/// (validate judges them).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClusterFacts {
    /// The operator's namespace, where every namespaced operand object goes.
    pub namespace: String,
    /// Owner reference to the active ClusterPolicy; `None` for `gpu-operator render`.
    pub owner: Option<OwnerReference>,
    /// Container runtime of the GPU nodes, one for the cluster: what the operands other than the
    /// toolkit follow (runtimeClassName under CRI-O without CDI).
    pub runtime: Runtime,
    /// Each GPU node's runtime flavour, from its nodeInfo ([`detect`]): the toolkit configures
    /// each node's runtime where that node keeps it. Empty when no GPU node was read (then
    /// [`Self::runtime`]'s stock layout is used).
    pub node_runtimes: NodeRuntimes,
    /// The flavour the live `nvidia-container-toolkit-daemonset` configures, if it runs and
    /// matches one (operands::toolkit_flavour::live_flavour): it keeps the plain name.
    pub live_toolkit_flavour: Option<RuntimeFlavour>,
    /// `<ID><VERSION_ID>` of the GPU nodes' OS from NFD labels (`ubuntu22.04`, `rhel9`), the
    /// suffix of the driver image tag. `None` while no GPU node is known.
    pub os_tag: Option<String>,
    /// OpenShift's `major.minor` ([`openshift_version`]), when the cluster is OpenShift and its
    /// ClusterVersion has completed an install or update.
    pub openshift_version: Option<String>,
    /// Whether the cluster is OpenShift (ClusterVersion API served).
    pub openshift: bool,
    /// Whether the Prometheus Operator's ServiceMonitor API is served.
    pub service_monitor_api: bool,
    /// The policy's driver DaemonSets that run now: a switch of variant hands their nodes over
    /// one at a time instead of replacing every GPU node's driver at once.
    pub live_driver: LiveDriver,
    /// Whether the operator serves its own /metrics over HTTPS with token checks
    /// (`--metrics-secure`), which its ServiceMonitor's scheme follows.
    pub operator_metrics_https: bool,
    /// A ServiceMonitor named as the operator's own ([`crate::operands::operator_metrics::NAME`])
    /// exists in its namespace and is not ours: the installer's, left as it is.
    pub foreign_operator_service_monitor: bool,
    /// Whether node-feature-discovery already runs: an NFD master workload that is not ours, or
    /// nodes an NFD master annotated while ours is not deployed (decision 16). NFD's CRDs being
    /// served says nothing.
    pub nfd_running: bool,
    /// Why our deployed NFD is frozen, if it is: a trusted NFD that is not ours runs beside it
    /// ([`nfd_beside_ours`]). A foreign signal never prunes our NFD (decision 16).
    pub nfd_frozen: Option<String>,
    /// The ConfigMap named by `devicePlugin.config.name`, if set and present (validate decides
    /// what the consumers mount: [`crate::model::ValidatedPolicy::sharing`]).
    pub sharing_source: Option<ConfigMapData>,
    /// What the live device plugin mounts.
    pub sharing_last_good: LastGood,
    /// The ConfigMap named by `migManager.config.name`, if set and present.
    pub mig_config: Option<ConfigMapData>,
    /// The ConfigMap named by `dcgmExporter.config.name`, if set and present.
    pub dcgm_metrics: Option<ConfigMapData>,
    /// The ConfigMap named by `vgpuDeviceManager.config.name`, if set, not our default, and
    /// present.
    pub vgpu_config: Option<ConfigMapData>,
    /// The vGPU config copy the live vGPU device manager mounts ("last good").
    pub vgpu_live_config: crate::operands::vgpu_device_manager::LiveConfig,
    /// The OS suffix of the image the live `nvidia-vgpu-manager-daemonset` runs: that OS keeps
    /// the plain name when the vm-vgpu nodes run several.
    pub vgpu_manager_live_os: Option<String>,
    /// The ConfigMaps named by `driver.repoConfig.configMapName`, `driver.certConfig.name`,
    /// `driver.kernelModuleConfig.name` and `vgpuManager.kernelModuleConfig.name` that are
    /// present, by name: the driver and the vGPU manager mount each key as its own file, so
    /// render needs the keys (validate marks the operand invalid when one is named but missing
    /// here).
    pub driver_config_maps: BTreeMap<String, ConfigMapData>,
    /// The GPU nodes (NFD's GPU label or our `nvidia.com/gpu.present`), with the labels the
    /// operator reads; empty for `gpu-operator render`.
    pub gpu_nodes: Vec<Arc<NodeView>>,
    /// The tags of OpenShift's `openshift/driver-toolkit` ImageStream: RHCOS version to Driver
    /// Toolkit image (`spec.tags[].from.name`, as NVIDIA reads them); `None` when the
    /// ImageStream is absent (or the cluster is not OpenShift).
    pub driver_toolkit: Option<BTreeMap<String, String>>,
    /// The toolkit image each running Driver Toolkit DaemonSet of ours uses, by RHCOS version:
    /// kept while the version's tag is gone (operands::driver_toolkit).
    pub live_driver_toolkit: BTreeMap<String, String>,
    /// The ImageStream has a tag without a name (NVIDIA's "imagestream broken", rhbz#2015024).
    pub driver_toolkit_broken: bool,
    /// Image fallbacks from the operator's environment (`DRIVER_IMAGE`, ...), for OLM.
    pub image_env: BTreeMap<String, String>,
}

/// OpenShift's version as NVIDIA's operator reads it for the driver's `OPENSHIFT_VERSION`
/// (`cluster_version`: the ClusterVersion `version` as the API serves it): `major.minor` of the
/// first `Completed` entry of `status.history` (the newest first), or the whole version when it
/// has no minor part.
pub fn openshift_version(cluster_version: &serde_json::Value) -> Option<String> {
    let completed = cluster_version
        .pointer("/status/history")?
        .as_array()?
        .iter()
        .find(|entry| {
            entry.get("state").and_then(serde_json::Value::as_str) == Some("Completed")
        })?;
    let version = completed
        .get("version")?
        .as_str()
        .filter(|v| !v.is_empty())?;
    let mut parts = version.split('.');
    Some(match (parts.next(), parts.next()) {
        (Some(major), Some(minor)) => format!("{major}.{minor}"),
        _ => version.to_owned(),
    })
}

/// The toolkit images of OpenShift's `driver-toolkit` ImageStream (`image`: the object as the
/// API serves it), by RHCOS version, read as NVIDIA's `ocpHasDriverToolkitImageStream` reads
/// them: `spec.tags[]` with a name and a `from.name`, `latest` left out.
pub fn driver_toolkit_tags(image_stream: &serde_json::Value) -> BTreeMap<String, String> {
    image_stream
        .pointer("/spec/tags")
        .and_then(serde_json::Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|tag| {
            let name = tag.get("name")?.as_str().filter(|n| !n.is_empty())?;
            let from = tag
                .pointer("/from/name")?
                .as_str()
                .filter(|f| !f.is_empty())?;
            (name != "latest").then(|| (name.to_owned(), from.to_owned()))
        })
        .collect()
}

/// Whether the ImageStream has a tag without a name ([`ClusterFacts::driver_toolkit_broken`]).
pub fn driver_toolkit_broken(image_stream: &serde_json::Value) -> bool {
    image_stream
        .pointer("/spec/tags")
        .and_then(serde_json::Value::as_array)
        .into_iter()
        .flatten()
        .any(|tag| {
            tag.get("name")
                .and_then(serde_json::Value::as_str)
                .unwrap_or_default()
                .is_empty()
        })
}
