//! Node labelling (pure): which GPU nodes exist, and the labels the operator wants on them
//! (decision 2). The IO side (watching node metadata, patching) lives in `controller::nodes`.
//!
//! Only the labels listed in [`NodeView::from_labels`] are kept per node, so the node cache
//! stays small and a change of any other label (such as `nvidia.com/gfd.timestamp`) is not a
//! reason to reconcile.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::workload::{Sandbox, managed_deploy_keys};

/// NFD labels that mark a node with an NVIDIA PCI device (vendor 0x10de, any class, 3D
/// controller, VGA controller).
pub const NFD_GPU_LABELS: [&str; 3] = [
    "feature.node.kubernetes.io/pci-10de.present",
    "feature.node.kubernetes.io/pci-0302_10de.present",
    "feature.node.kubernetes.io/pci-0300_10de.present",
];
pub const GPU_PRESENT: &str = "nvidia.com/gpu.present";
/// `false` on a node takes it out of every operand.
pub const DEPLOY_OPERANDS: &str = "nvidia.com/gpu.deploy.operands";
pub const MIG_CAPABLE: &str = "nvidia.com/mig.capable";
/// GFD sets it where MPS sharing is configured; the MPS daemon selects on it.
pub const MPS_CAPABLE: &str = "nvidia.com/mps.capable";
pub const GPU_PRODUCT: &str = "nvidia.com/gpu.product";
pub const GPU_COUNT: &str = "nvidia.com/gpu.count";
/// GFD: memory of one GPU in MiB.
pub const GPU_MEMORY: &str = "nvidia.com/gpu.memory";
/// GFD's label: replicas per GPU under time-slicing or MPS (absent or `1` without sharing).
pub const GPU_REPLICAS: &str = "nvidia.com/gpu.replicas";
/// GFD's label: the MIG strategy the node's GPUs are advertised with.
pub const MIG_STRATEGY: &str = "nvidia.com/mig.strategy";
pub const OS_ID: &str = "feature.node.kubernetes.io/system-os_release.ID";
pub const OS_VERSION_ID: &str = "feature.node.kubernetes.io/system-os_release.VERSION_ID";
/// NFD's label of the running kernel: precompiled driver pools select on it.
pub const KERNEL_VERSION: &str = "feature.node.kubernetes.io/kernel-version.full";
/// NFD's label of an RHCOS node's OSTree version (`414.92.202312132152-0`): OpenShift Driver
/// Toolkit pools select on it (operands::driver_toolkit).
pub const OSTREE_VERSION: &str = "feature.node.kubernetes.io/system-os_release.OSTREE_VERSION";
pub const DEVICE_PLUGIN_CONFIG: &str = "nvidia.com/device-plugin.config";
pub const MIG_CONFIG: &str = "nvidia.com/mig.config";
pub const MIG_CONFIG_STATE: &str = "nvidia.com/mig.config.state";
/// The driver upgrade state machine's label and its opt-out (controller::upgrade): a change
/// wakes the reconcile, and switching upgrades off clears the label where it is.
pub const DRIVER_UPGRADE_STATE: &str = "nvidia.com/gpu-driver-upgrade-state";
pub const DRIVER_UPGRADE_SKIP: &str = "nvidia.com/gpu-driver-upgrade.skip";
/// Our label on a GPU node an NVIDIADriver pool runs its driver on (value: the NVIDIADriver's
/// name, or `true` when the name is no valid label value). The ClusterPolicy's own driver
/// DaemonSets keep off nodes that carry it (operands::nvidia_driver).
pub const DRIVER_POOL: &str = "nvidia.com/gpu-operator.nvidiadriver";
/// Our label on a GPU node handed to a driver variant during a switch between drivers built
/// on the node, precompiled drivers and the Driver Toolkit (operands::driver_variant).
pub const DRIVER_VARIANT: &str = "nvidia.com/gpu-operator.driver-variant";
/// Our label on a GPU node naming its container runtime flavour
/// ([`crate::facts::NodeRuntime::label`]): in a fleet of several flavours each toolkit
/// DaemonSet selects its flavour's nodes by it (operands::toolkit_flavour).
pub const RUNTIME_FLAVOUR: &str = "nvidia.com/gpu-operator.runtime-flavour";
/// Our label on a GPU node whose container toolkit moves from one runtime flavour's DaemonSet
/// to another's: the flavour whose DaemonSet keeps (or already gets) a pod there until the
/// other's pod is ready, so the node never lacks a configured runtime
/// (operands::toolkit_flavour::place).
pub const TOOLKIT_HANDOVER: &str = "nvidia.com/gpu-operator.toolkit-handover";
/// Our value of [`DEPLOY_TOOLKIT`] and [`DEPLOY_DRIVER`] on a GPU node of a read-only image
/// (COS, Bottlerocket, Talos): nothing can be installed there, so neither runs.
pub const READ_ONLY_IMAGE: &str = "read-only-image";
/// NVIDIA's operator also marks GPU nodes for third-party GPU clients.
pub const DEPLOY_CLIENT: &str = "nvidia.com/gpu.deploy.client";

pub const DEPLOY_DRIVER: &str = "nvidia.com/gpu.deploy.driver";
pub const DEPLOY_TOOLKIT: &str = "nvidia.com/gpu.deploy.container-toolkit";
pub const DEPLOY_VALIDATOR: &str = "nvidia.com/gpu.deploy.operator-validator";
/// The device plugin's key; the MPS daemon shares it, as in NVIDIA's operator.
pub const DEPLOY_DEVICE_PLUGIN: &str = "nvidia.com/gpu.deploy.device-plugin";
pub const DEPLOY_GFD: &str = "nvidia.com/gpu.deploy.gpu-feature-discovery";
pub const DEPLOY_DCGM: &str = "nvidia.com/gpu.deploy.dcgm";
pub const DEPLOY_DCGM_EXPORTER: &str = "nvidia.com/gpu.deploy.dcgm-exporter";
/// A GPUCluster's DCGM, exporter and validator (NVIDIA's keys; the driver manager pauses them).
pub const DEPLOY_DCGM_DRA: &str = "nvidia.com/gpu.deploy.dcgm-dra";
pub const DEPLOY_DCGM_EXPORTER_DRA: &str = "nvidia.com/gpu.deploy.dcgm-exporter-dra";
pub const DEPLOY_DRA_VALIDATOR: &str = "nvidia.com/gpu.deploy.dra-validator";
/// Set only on MIG-capable nodes.
pub const DEPLOY_MIG_MANAGER: &str = "nvidia.com/gpu.deploy.mig-manager";
pub const DEPLOY_NODE_STATUS_EXPORTER: &str = "nvidia.com/gpu.deploy.node-status-exporter";

/// The container stack's deploy keys and [`DEPLOY_CLIENT`], in NVIDIA's spelling, sorted: what a
/// container node carries (mig-manager only where MIG-capable). With the virtual machine
/// operands' keys ([`crate::workload::SANDBOX_DEPLOY_KEYS`]) they are every key the labeller
/// manages ([`crate::workload::managed_deploy_keys`]; a test keeps them equal to the operands'
/// [`crate::model::Operand::deploy_label`]s and the client key).
pub const DEPLOY_KEYS: [&str; 10] = [
    DEPLOY_CLIENT,
    DEPLOY_TOOLKIT,
    DEPLOY_DCGM,
    DEPLOY_DCGM_EXPORTER,
    DEPLOY_DEVICE_PLUGIN,
    DEPLOY_DRIVER,
    DEPLOY_GFD,
    DEPLOY_MIG_MANAGER,
    DEPLOY_NODE_STATUS_EXPORTER,
    DEPLOY_VALIDATOR,
];

/// [`DEPLOY_KEYS`] as an iterator.
pub fn deploy_keys() -> impl Iterator<Item = &'static str> {
    DEPLOY_KEYS.into_iter()
}

/// Whether the deploy key `key` set to `value` places its operand on the node.
pub fn places_operand(key: &str, value: &str) -> bool {
    value != READ_ONLY_IMAGE && is_our_deploy_value(key, value)
}

/// Whether `value` of the deploy key `key` is one the operator writes, and so may change or
/// remove: `true` on every key; on the toolkit's, a runtime flavour (the node runs that
/// flavour's toolkit DaemonSet) or [`READ_ONLY_IMAGE`]; on the driver's, [`READ_ONLY_IMAGE`].
/// Every other value (`false`, `paused-for-*`) was written by someone else.
pub fn is_our_deploy_value(key: &str, value: &str) -> bool {
    value == "true"
        || (key == DEPLOY_TOOLKIT
            && (value == READ_ONLY_IMAGE || crate::facts::RuntimeFlavour::parse(value).is_some()))
        || (key == DEPLOY_DRIVER && value == READ_ONLY_IMAGE)
}

/// What the operator knows about one node: only the labels it reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeView {
    pub name: String,
    pub resource_version: Option<String>,
    pub labels: BTreeMap<String, String>,
    /// Whether an NFD master annotated the node ([`NFD_ANNOTATION_PREFIX`]).
    pub nfd_annotated: bool,
    /// The node pool record the operator keeps on the node
    /// ([`crate::node_pools::RECORD_ANNOTATION`]).
    pub pool_record: Option<String>,
    /// The driver upgrade's annotations on the node
    /// ([`crate::upgrade::machine::NODE_ANNOTATIONS`]).
    pub upgrade_annotations: BTreeMap<String, String>,
    /// What GPU readiness reads beyond labels ([`crate::gpu_readiness`]).
    pub readiness: ReadinessFacts,
}

/// What the GPU readiness stage reads of a node besides its labels: from the node's spec and
/// status, so the node cache watches whole nodes and keeps only this.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReadinessFacts {
    /// The node's taints as key and effect (their values are not read).
    pub taints: Vec<(String, String)>,
    /// GPUs the device plugin advertises: allocatable `nvidia.com/gpu` plus
    /// `nvidia.com/gpu.shared` (time-slicing with `renameByDefault`); `None` when neither is
    /// there.
    pub gpus_advertised: Option<u64>,
    /// The operator's quarantine record on the node
    /// ([`crate::gpu_readiness::QUARANTINE_ANNOTATION`]).
    pub quarantine: Option<String>,
}

impl ReadinessFacts {
    /// What `node` (read in full) shows.
    pub fn of(node: &k8s_openapi::api::core::v1::Node) -> Self {
        let taints = node
            .spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .map(|ts| {
                ts.iter()
                    .map(|t| (t.key.clone(), t.effect.clone()))
                    .collect()
            })
            .unwrap_or_default();
        let allocatable = node.status.as_ref().and_then(|s| s.allocatable.as_ref());
        let count = |name: &str| {
            allocatable
                .and_then(|a| a.get(name))
                .and_then(|q| q.0.parse::<u64>().ok())
        };
        let gpus_advertised = match (count("nvidia.com/gpu"), count("nvidia.com/gpu.shared")) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
        };
        ReadinessFacts {
            taints,
            gpus_advertised,
            quarantine: node
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(crate::gpu_readiness::QUARANTINE_ANNOTATION))
                .cloned(),
        }
    }

    /// Whether the node carries a taint with `key` and `effect`.
    pub fn has_taint(&self, key: &str, effect: &str) -> bool {
        self.taints.iter().any(|(k, e)| k == key && e == effect)
    }
}

/// Prefix of the annotations an NFD master writes on the nodes it labels (for example
/// `nfd.node.kubernetes.io/feature-labels`).
pub const NFD_ANNOTATION_PREFIX: &str = "nfd.node.kubernetes.io/";

/// Whether `annotations` hold one an NFD master writes.
pub fn nfd_annotated(annotations: Option<&BTreeMap<String, String>>) -> bool {
    annotations.is_some_and(|a| a.keys().any(|k| k.starts_with(NFD_ANNOTATION_PREFIX)))
}

pub fn is_read_label(key: &str) -> bool {
    NFD_GPU_LABELS.contains(&key)
        || key.starts_with("nvidia.com/gpu.deploy.")
        || [
            GPU_PRESENT,
            RUNTIME_FLAVOUR,
            TOOLKIT_HANDOVER,
            MIG_CAPABLE,
            MPS_CAPABLE,
            GPU_PRODUCT,
            GPU_COUNT,
            GPU_MEMORY,
            GPU_REPLICAS,
            MIG_STRATEGY,
            OS_ID,
            OS_VERSION_ID,
            KERNEL_VERSION,
            OSTREE_VERSION,
            DEVICE_PLUGIN_CONFIG,
            MIG_CONFIG,
            MIG_CONFIG_STATE,
            DRIVER_UPGRADE_STATE,
            DRIVER_UPGRADE_SKIP,
            DRIVER_POOL,
            DRIVER_VARIANT,
            crate::workload::WORKLOAD_CONFIG,
            crate::sharing::vgpu::VGPU_CONFIG_LABEL,
        ]
        .contains(&key)
}

impl NodeView {
    /// Keeps only the labels the operator reads.
    pub fn from_labels(
        name: &str,
        resource_version: Option<String>,
        labels: &BTreeMap<String, String>,
    ) -> Self {
        NodeView {
            name: name.to_string(),
            resource_version,
            labels: labels
                .iter()
                .filter(|(k, _)| is_read_label(k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            nfd_annotated: false,
            pool_record: None,
            upgrade_annotations: BTreeMap::new(),
            readiness: ReadinessFacts::default(),
        }
    }

    /// A label's value, with an empty value counted as absent (decision 2).
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .get(key)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }

    /// Whether NFD reports an NVIDIA PCI device on the node.
    pub fn has_nfd_gpu(&self) -> bool {
        NFD_GPU_LABELS.iter().any(|k| self.label(k) == Some("true"))
    }

    /// Whether the operator has marked the node as a GPU node.
    pub fn is_gpu_node(&self) -> bool {
        self.label(GPU_PRESENT) == Some("true")
    }

    /// Whether the node carries every label of a pod `nodeSelector`.
    pub fn matches(&self, selector: &BTreeMap<String, String>) -> bool {
        selector.iter().all(|(k, v)| self.labels.get(k) == Some(v))
    }
}

/// A label change for one node: `Some(value)` sets, `None` removes.
pub type LabelPatch = BTreeMap<String, Option<String>>;

/// The labels to change on `node` so it carries what decision 2 asks for, without sandbox
/// workloads (every GPU node a container node): [`desired_label_changes_for`] with
/// [`Sandbox::DISABLED`].
pub fn desired_label_changes(
    node: &NodeView,
    gpu_gone_for: Option<Duration>,
    grace: Duration,
) -> LabelPatch {
    desired_label_changes_for(node, gpu_gone_for, grace, &Sandbox::DISABLED)
}

/// The labels to change on `node` so it carries what decision 2 asks for: the deploy keys of
/// its workload type under `sandbox` ([`Sandbox::deploy_keys_of`]), every other managed key
/// removed where it holds a value of ours.
///
/// `gpu_gone_for` is how long the node has been without NFD's GPU labels while still marked as
/// a GPU node (`None` if it has them); the node is unmarked only once that exceeds `grace`,
/// since NFD restarts remove and re-add labels.
pub fn desired_label_changes_for(
    node: &NodeView,
    gpu_gone_for: Option<Duration>,
    grace: Duration,
    sandbox: &Sandbox,
) -> LabelPatch {
    let mut patch = LabelPatch::new();
    if !node.has_nfd_gpu() && node.is_gpu_node() && gpu_gone_for.is_none_or(|gone| gone < grace) {
        // NFD restarts remove and re-add labels: leave a marked node exactly as it is until
        // the label has stayed away for the grace period.
        return patch;
    }
    if !node.has_nfd_gpu() {
        if node.labels.contains_key(GPU_PRESENT) {
            patch.insert(GPU_PRESENT.to_string(), None);
        }
        for key in managed_deploy_keys() {
            if node.labels.contains_key(key) {
                patch.insert(key.to_string(), None);
            }
        }
        return patch;
    }

    if node.label(GPU_PRESENT) != Some("true") {
        patch.insert(GPU_PRESENT.to_string(), Some("true".to_string()));
    }
    if node.label(DEPLOY_OPERANDS) == Some("false") {
        // Taken out of everything: remove our deploy keys (a `false` someone set stays).
        for key in managed_deploy_keys() {
            if node.label(key).is_some_and(|v| is_our_deploy_value(key, v)) {
                patch.insert(key.to_string(), None);
            }
        }
        return patch;
    }
    let wanted_keys = sandbox.deploy_keys_of(node);
    for key in managed_deploy_keys() {
        let wanted = wanted_keys.contains(key);
        match (wanted, node.label(key)) {
            // Absent or empty: ours to set (the toolkit's and driver's exact values are
            // operands::toolkit_flavour::place's). Any value not ours (`false`,
            // `paused-for-*`) was written by someone else and is respected.
            (true, None) => {
                patch.insert(key.to_string(), Some("true".to_string()));
            }
            (false, Some(value)) if is_our_deploy_value(key, value) => {
                patch.insert(key.to_string(), None);
            }
            _ => {}
        }
    }
    patch
}

/// The [`RUNTIME_FLAVOUR`] label a GPU node needs: its detected flavour (`flavour`, `None`
/// while its nodeInfo has not been read, then nothing changes). Only marked GPU nodes carry it;
/// the label leaves with the node's other marks when it is no GPU node any more.
pub fn runtime_flavour_label(node: &NodeView, flavour: Option<&str>) -> LabelPatch {
    let mut patch = LabelPatch::new();
    let gpu = node.has_nfd_gpu() || node.is_gpu_node();
    match (gpu, flavour) {
        (true, Some(value)) if node.label(RUNTIME_FLAVOUR) != Some(value) => {
            patch.insert(RUNTIME_FLAVOUR.to_owned(), Some(value.to_owned()));
        }
        (false, _) if node.labels.contains_key(RUNTIME_FLAVOUR) => {
            patch.insert(RUNTIME_FLAVOUR.to_owned(), None);
        }
        _ => {}
    }
    patch
}

/// Decision 7: the `nvidia.com/mig.config` label for a MIG-capable GPU node that has none,
/// when the policy's `migManager.config.default` asks for one (`default_layout`, normally
/// `all-disabled`). A value already there, whoever wrote it, is never overwritten.
pub fn mig_config_default(node: &NodeView, default_layout: Option<&str>) -> LabelPatch {
    let mut patch = LabelPatch::new();
    if let Some(layout) = default_layout
        && node.has_nfd_gpu()
        && node.label(DEPLOY_OPERANDS) != Some("false")
        && node.label(MIG_CAPABLE) == Some("true")
        && node.label(MIG_CONFIG).is_none()
    {
        patch.insert(MIG_CONFIG.to_string(), Some(layout.to_string()));
    }
    patch
}

/// At most this share (percent) of the GPU nodes is unmarked for a lost NFD label within one
/// grace window, and at least one node: the circuit breaker on GPU-label loss.
pub const UNMARK_SHARE_PERCENT: usize = 10;

/// How many nodes may be unmarked per grace window on a fleet of `gpu_nodes`.
pub fn unmark_limit(gpu_nodes: usize) -> usize {
    (gpu_nodes.saturating_mul(UNMARK_SHARE_PERCENT) / 100).max(1)
}

/// How many of `due` nodes may be unmarked now, when `recent` were unmarked within the current
/// grace window on a fleet of `gpu_nodes`.
pub fn unmark_budget(gpu_nodes: usize, recent: usize, due: usize) -> usize {
    unmark_limit(gpu_nodes).saturating_sub(recent).min(due)
}

/// What the breaker decided for the nodes whose GPU label has been gone past the grace period.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Breaker {
    /// Nodes that may be unmarked now.
    pub admitted: std::collections::BTreeSet<String>,
    /// Nodes past the grace period that stay marked for now, sorted.
    pub held_back: Vec<String>,
    /// The limit per grace window.
    pub limit: usize,
    /// The GPU nodes the limit was computed from.
    pub gpu_nodes: usize,
    /// When the window lets the next held-back node go.
    pub reopens: Option<Instant>,
}

impl Breaker {
    /// The status warning while nodes are held back; `None` when none is.
    pub fn warning(&self, grace: Duration) -> Option<String> {
        if self.held_back.is_empty() {
            return None;
        }
        let shown: Vec<&str> = self.held_back.iter().take(5).map(String::as_str).collect();
        let more = self.held_back.len().saturating_sub(shown.len());
        Some(format!(
            "NFD's GPU labels have been gone for longer than the grace period ({}s) from {} of {} GPU nodes: {} held back by the label-loss breaker ({}{}), which unmarks at most {} node{} per grace period ({UNMARK_SHARE_PERCENT} % of the GPU nodes, at least 1); check node-feature-discovery, the nodes keep their operands until their labels return or the breaker lets them go",
            grace.as_secs(),
            self.held_back.len() + self.admitted.len(),
            self.gpu_nodes,
            self.held_back.len(),
            shown.join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            },
            self.limit,
            if self.limit == 1 { "" } else { "s" },
        ))
    }
}

/// Tracks since when marked GPU nodes have been missing NFD's GPU labels, and which nodes were
/// unmarked for it within the last grace window (the breaker's memory).
#[derive(Debug, Default)]
pub struct GpuLabelLoss {
    since: BTreeMap<String, Instant>,
    unmarked: BTreeMap<String, Instant>,
}

impl GpuLabelLoss {
    /// Updates the record for `node` and returns how long its GPU labels have been gone
    /// (`None` when they are present or the node is not marked).
    pub fn observe(&mut self, node: &NodeView, now: Instant) -> Option<Duration> {
        if node.has_nfd_gpu() || !node.is_gpu_node() {
            self.since.remove(&node.name);
            return None;
        }
        let since = *self.since.entry(node.name.clone()).or_insert(now);
        Some(now.saturating_duration_since(since))
    }

    pub fn forget(&mut self, node: &str) {
        self.since.remove(node);
    }

    /// Drops what is remembered about nodes that no longer exist: a node deleted while its
    /// label was gone must not keep a deadline (and so the loop) alive.
    pub fn retain_nodes(&mut self, exists: impl Fn(&str) -> bool) {
        self.since.retain(|name, _| exists(name));
    }

    /// Decides which of the nodes past `grace` may be unmarked now: the longest gone first, at
    /// most [`unmark_limit`] per grace window counting the nodes already unmarked in it. A node
    /// admitted before and still pending (its patch not yet seen) stays admitted without
    /// counting twice.
    pub fn breaker(&mut self, gpu_nodes: usize, grace: Duration, now: Instant) -> Breaker {
        self.unmarked
            .retain(|_, at| now.saturating_duration_since(*at) < grace);
        let mut due: Vec<(&String, &Instant)> = self
            .since
            .iter()
            .filter(|(_, since)| now.saturating_duration_since(**since) >= grace)
            .collect();
        due.sort_by(|a, b| a.1.cmp(b.1).then(a.0.cmp(b.0)));
        let (already, fresh): (Vec<_>, Vec<_>) = due
            .into_iter()
            .partition(|(name, _)| self.unmarked.contains_key(*name));
        let budget = unmark_budget(gpu_nodes, self.unmarked.len(), fresh.len());
        let mut admitted: std::collections::BTreeSet<String> =
            already.iter().map(|(n, _)| (*n).clone()).collect();
        let mut held_back = Vec::new();
        for (i, (name, _)) in fresh.into_iter().enumerate() {
            if i < budget {
                admitted.insert(name.clone());
            } else {
                held_back.push(name.clone());
            }
        }
        for name in &admitted {
            self.unmarked.entry(name.clone()).or_insert(now);
        }
        held_back.sort();
        let reopens = (!held_back.is_empty())
            .then(|| self.unmarked.values().min().map(|at| *at + grace))
            .flatten();
        Breaker {
            admitted,
            held_back,
            limit: unmark_limit(gpu_nodes),
            gpu_nodes,
            reopens,
        }
    }

    /// The earliest moment a pending loss reaches `grace`, to requeue then (losses already past
    /// it wait for the breaker, [`Breaker::reopens`]).
    pub fn next_deadline(&self, grace: Duration, now: Instant) -> Option<Instant> {
        self.since
            .values()
            .map(|since| *since + grace)
            .filter(|deadline| *deadline > now)
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(labels: &[(&str, &str)]) -> NodeView {
        let labels = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        NodeView::from_labels("n1", None, &labels)
    }

    const GRACE: Duration = Duration::from_secs(60);

    fn set<'a>(patch: &'a LabelPatch, key: &str) -> Option<Option<&'a str>> {
        patch.get(key).map(|v| v.as_deref())
    }

    #[test]
    fn any_of_nfds_three_nvidia_labels_marks_a_gpu_node_with_every_deploy_key() {
        for label in NFD_GPU_LABELS {
            let patch = desired_label_changes(&node(&[(label, "true")]), None, GRACE);
            assert_eq!(set(&patch, GPU_PRESENT), Some(Some("true")), "{label}");
            assert_eq!(
                set(&patch, "nvidia.com/gpu.deploy.driver"),
                Some(Some("true"))
            );
            assert_eq!(
                set(&patch, "nvidia.com/gpu.deploy.dcgm-exporter"),
                Some(Some("true"))
            );
            assert_eq!(set(&patch, DEPLOY_CLIENT), Some(Some("true")));
            // Not MIG-capable: no mig-manager.
            assert_eq!(set(&patch, "nvidia.com/gpu.deploy.mig-manager"), None);
        }
    }

    #[test]
    fn mig_config_is_defaulted_only_on_mig_capable_gpu_nodes_without_one() {
        let capable = [(NFD_GPU_LABELS[0], "true"), (MIG_CAPABLE, "true")];
        assert_eq!(
            set(
                &mig_config_default(&node(&capable), Some("all-disabled")),
                MIG_CONFIG
            ),
            Some(Some("all-disabled"))
        );
        // migManager.config.default is "" (leave nodes alone): nothing.
        assert!(mig_config_default(&node(&capable), None).is_empty());
        // Not MIG-capable, or taken out of everything: nothing.
        assert!(
            mig_config_default(&node(&[(NFD_GPU_LABELS[0], "true")]), Some("all-disabled"))
                .is_empty()
        );
        let out = [
            (NFD_GPU_LABELS[0], "true"),
            (MIG_CAPABLE, "true"),
            (DEPLOY_OPERANDS, "false"),
        ];
        assert!(mig_config_default(&node(&out), Some("all-disabled")).is_empty());
        // A layout someone chose is never overwritten.
        let chosen = [
            (NFD_GPU_LABELS[0], "true"),
            (MIG_CAPABLE, "true"),
            (MIG_CONFIG, "all-1g.5gb"),
        ];
        assert!(mig_config_default(&node(&chosen), Some("all-disabled")).is_empty());
    }

    #[test]
    fn mig_manager_only_on_mig_capable_nodes() {
        let patch = desired_label_changes(
            &node(&[(NFD_GPU_LABELS[0], "true"), (MIG_CAPABLE, "true")]),
            None,
            GRACE,
        );
        assert_eq!(
            set(&patch, "nvidia.com/gpu.deploy.mig-manager"),
            Some(Some("true"))
        );
        let patch = desired_label_changes(
            &node(&[
                (NFD_GPU_LABELS[0], "true"),
                (GPU_PRESENT, "true"),
                ("nvidia.com/gpu.deploy.mig-manager", "true"),
            ]),
            None,
            GRACE,
        );
        assert_eq!(set(&patch, "nvidia.com/gpu.deploy.mig-manager"), Some(None));
    }

    #[test]
    fn values_others_wrote_are_respected_and_empty_counts_as_absent() {
        let patch = desired_label_changes(
            &node(&[
                (NFD_GPU_LABELS[0], "true"),
                ("nvidia.com/gpu.deploy.driver", "false"),
                (
                    "nvidia.com/gpu.deploy.device-plugin",
                    "paused-for-mig-change",
                ),
                ("nvidia.com/gpu.deploy.gpu-feature-discovery", ""),
            ]),
            None,
            GRACE,
        );
        assert_eq!(set(&patch, "nvidia.com/gpu.deploy.driver"), None);
        assert_eq!(set(&patch, "nvidia.com/gpu.deploy.device-plugin"), None);
        assert_eq!(
            set(&patch, "nvidia.com/gpu.deploy.gpu-feature-discovery"),
            Some(Some("true"))
        );
    }

    #[test]
    fn a_labelled_node_needs_no_change() {
        let mut labels = vec![(NFD_GPU_LABELS[0], "true"), (GPU_PRESENT, "true")];
        let keys: Vec<&str> = deploy_keys()
            .filter(|k| !k.ends_with("mig-manager"))
            .collect();
        labels.extend(keys.iter().map(|k| (*k, "true")));
        assert!(desired_label_changes(&node(&labels), None, GRACE).is_empty());
    }

    #[test]
    fn deploy_operands_false_removes_our_deploy_keys_only() {
        let patch = desired_label_changes(
            &node(&[
                (NFD_GPU_LABELS[0], "true"),
                (GPU_PRESENT, "true"),
                (DEPLOY_OPERANDS, "false"),
                ("nvidia.com/gpu.deploy.driver", "true"),
                ("nvidia.com/gpu.deploy.toolkit", "false"),
            ]),
            None,
            GRACE,
        );
        assert_eq!(set(&patch, "nvidia.com/gpu.deploy.driver"), Some(None));
        assert_eq!(patch.len(), 1, "{patch:?}");
    }

    #[test]
    fn a_vanished_gpu_label_is_acted_on_only_after_the_grace_period() {
        let marked = node(&[
            (GPU_PRESENT, "true"),
            ("nvidia.com/gpu.deploy.driver", "true"),
        ]);
        assert!(desired_label_changes(&marked, Some(Duration::from_secs(5)), GRACE).is_empty());
        let patch = desired_label_changes(&marked, Some(Duration::from_secs(61)), GRACE);
        assert_eq!(set(&patch, GPU_PRESENT), Some(None));
        assert_eq!(set(&patch, "nvidia.com/gpu.deploy.driver"), Some(None));
    }

    #[test]
    fn cpu_nodes_are_left_alone() {
        assert!(
            desired_label_changes(&node(&[("kubernetes.io/os", "linux")]), None, GRACE).is_empty()
        );
    }

    #[test]
    fn loss_tracking_measures_from_the_first_observation() {
        let mut loss = GpuLabelLoss::default();
        let marked = node(&[(GPU_PRESENT, "true")]);
        let t0 = Instant::now();
        assert_eq!(loss.observe(&marked, t0), Some(Duration::ZERO));
        assert_eq!(
            loss.observe(&marked, t0 + Duration::from_secs(10)),
            Some(Duration::from_secs(10))
        );
        assert_eq!(loss.next_deadline(GRACE, t0), Some(t0 + GRACE));
        let back = node(&[(GPU_PRESENT, "true"), (NFD_GPU_LABELS[1], "true")]);
        assert_eq!(loss.observe(&back, t0 + Duration::from_secs(11)), None);
        assert_eq!(loss.next_deadline(GRACE, t0), None);
    }

    fn named(name: &str, labels: &[(&str, &str)]) -> NodeView {
        NodeView {
            name: name.into(),
            ..node(labels)
        }
    }

    #[test]
    fn the_unmark_limit_is_ten_percent_of_gpu_nodes_and_at_least_one() {
        assert_eq!(unmark_limit(0), 1);
        assert_eq!(unmark_limit(6), 1);
        assert_eq!(unmark_limit(19), 1);
        assert_eq!(unmark_limit(20), 2);
        assert_eq!(unmark_limit(1000), 100);
        assert_eq!(unmark_budget(1000, 40, 500), 60);
        assert_eq!(unmark_budget(1000, 40, 7), 7);
        assert_eq!(unmark_budget(1000, 120, 7), 0);
        assert_eq!(unmark_limit(usize::MAX), usize::MAX / 100);
    }

    #[test]
    fn the_breaker_holds_back_all_but_the_limit_and_reopens_one_grace_later() {
        let mut loss = GpuLabelLoss::default();
        let t0 = Instant::now();
        // 3 of 6 GPU nodes lose their label at t0 (n1 first).
        for name in ["n1", "n2", "n3"] {
            loss.observe(&named(name, &[(GPU_PRESENT, "true")]), t0);
        }
        // Within the grace: nothing is due.
        let early = loss.breaker(6, GRACE, t0 + Duration::from_secs(30));
        assert!(early.admitted.is_empty() && early.held_back.is_empty());
        assert_eq!(early.warning(GRACE), None);
        let t1 = t0 + GRACE;
        let first = loss.breaker(6, GRACE, t1);
        assert_eq!(first.admitted.len(), 1, "{first:?}");
        assert_eq!(first.held_back.len(), 2);
        assert_eq!(first.reopens, Some(t1 + GRACE));
        let warning = first.warning(GRACE).unwrap();
        assert!(
            warning.contains("from 3 of 6 GPU nodes: 2 held back"),
            "{warning}"
        );
        // The same pass again (the patch not yet seen): the admitted node does not count twice.
        let again = loss.breaker(6, GRACE, t1 + Duration::from_secs(1));
        assert_eq!(again.admitted, first.admitted);
        assert_eq!(again.held_back, first.held_back);
        // The admitted node is unmarked; the window is still full.
        let gone = first.admitted.iter().next().unwrap().clone();
        loss.forget(&gone);
        let full = loss.breaker(6, GRACE, t1 + Duration::from_secs(30));
        assert!(full.admitted.is_empty());
        assert_eq!(full.held_back.len(), 2);
        // One grace later the next node may go.
        let next = loss.breaker(6, GRACE, t1 + GRACE);
        assert_eq!(next.admitted.len(), 1);
        assert_eq!(next.held_back.len(), 1);
    }

    #[test]
    fn labels_coming_back_clear_the_breaker() {
        let mut loss = GpuLabelLoss::default();
        let t0 = Instant::now();
        for name in ["n1", "n2", "n3"] {
            loss.observe(&named(name, &[(GPU_PRESENT, "true")]), t0);
        }
        let held = loss.breaker(6, GRACE, t0 + GRACE);
        assert_eq!(held.held_back.len(), 2);
        for name in &held.held_back {
            let back = named(name, &[(GPU_PRESENT, "true"), (NFD_GPU_LABELS[0], "true")]);
            assert_eq!(loss.observe(&back, t0 + GRACE), None);
        }
        let cleared = loss.breaker(6, GRACE, t0 + GRACE + Duration::from_secs(1));
        assert!(cleared.held_back.is_empty());
        assert_eq!(cleared.warning(GRACE), None);
    }

    #[test]
    fn a_deleted_node_leaves_no_deadline_behind() {
        let mut loss = GpuLabelLoss::default();
        let t0 = Instant::now();
        loss.observe(&named("gone", &[(GPU_PRESENT, "true")]), t0);
        loss.observe(
            &named("kept", &[(GPU_PRESENT, "true")]),
            t0 + Duration::from_secs(5),
        );
        loss.retain_nodes(|n| n == "kept");
        assert_eq!(
            loss.next_deadline(GRACE, t0),
            Some(t0 + Duration::from_secs(5) + GRACE)
        );
        loss.retain_nodes(|_| false);
        assert_eq!(loss.next_deadline(GRACE, t0), None);
        // A deadline in the past is no reason to wake (the breaker decides those nodes).
        loss.observe(&named("due", &[(GPU_PRESENT, "true")]), t0);
        assert_eq!(
            loss.next_deadline(GRACE, t0 + GRACE + Duration::from_secs(1)),
            None
        );
    }

    fn kubevirt(default_workload: crate::api::SandboxWorkload) -> Sandbox {
        Sandbox {
            enabled: true,
            default_workload,
            mode: crate::api::SandboxMode::Kubevirt,
        }
    }

    #[test]
    fn a_vm_passthrough_node_gets_the_vm_set_and_loses_the_container_stack() {
        use crate::workload::{DEPLOY_SANDBOX_VALIDATOR, DEPLOY_VFIO_MANAGER, WORKLOAD_CONFIG};
        let mut labels = vec![
            (NFD_GPU_LABELS[0], "true"),
            (GPU_PRESENT, "true"),
            (MIG_CAPABLE, "true"),
            (WORKLOAD_CONFIG, "vm-passthrough"),
            // Someone else's value on a key the type no longer asks for stays.
            (DEPLOY_DCGM, "false"),
        ];
        labels.extend(
            deploy_keys()
                .filter(|k| *k != DEPLOY_DCGM)
                .map(|k| (k, "true")),
        );
        let sandbox = kubevirt(crate::api::SandboxWorkload::Container);
        let patch = desired_label_changes_for(&node(&labels), None, GRACE, &sandbox);
        for key in deploy_keys().filter(|k| *k != DEPLOY_CLIENT && *k != DEPLOY_DCGM) {
            assert_eq!(set(&patch, key), Some(None), "{key}");
        }
        assert_eq!(set(&patch, DEPLOY_DCGM), None);
        assert_eq!(set(&patch, DEPLOY_CLIENT), None, "kept as it is");
        assert_eq!(set(&patch, DEPLOY_VFIO_MANAGER), Some(Some("true")));
        assert_eq!(set(&patch, DEPLOY_SANDBOX_VALIDATOR), Some(Some("true")));
        assert_eq!(
            set(&patch, crate::workload::DEPLOY_SANDBOX_DEVICE_PLUGIN),
            Some(Some("true"))
        );
    }

    #[test]
    fn a_node_without_a_workload_label_gets_the_default_type() {
        use crate::workload::DEPLOY_VFIO_MANAGER;
        let plain = node(&[(NFD_GPU_LABELS[0], "true")]);
        let vm = kubevirt(crate::api::SandboxWorkload::VmPassthrough);
        let patch = desired_label_changes_for(&plain, None, GRACE, &vm);
        assert_eq!(set(&patch, DEPLOY_VFIO_MANAGER), Some(Some("true")));
        assert_eq!(set(&patch, DEPLOY_DRIVER), None);
        let container = kubevirt(crate::api::SandboxWorkload::Container);
        assert_eq!(
            desired_label_changes_for(&plain, None, GRACE, &container),
            desired_label_changes(&plain, None, GRACE),
        );
    }

    #[test]
    fn sandbox_keys_come_off_a_node_switched_back_to_containers_and_off_a_node_taken_out() {
        use crate::workload::{DEPLOY_VFIO_MANAGER, WORKLOAD_CONFIG};
        let vm_labelled = [
            (NFD_GPU_LABELS[0], "true"),
            (GPU_PRESENT, "true"),
            (WORKLOAD_CONFIG, "container"),
            (DEPLOY_VFIO_MANAGER, "true"),
            (
                crate::workload::DEPLOY_SANDBOX_VALIDATOR,
                "paused-for-vgpu-change",
            ),
        ];
        let sandbox = kubevirt(crate::api::SandboxWorkload::VmPassthrough);
        let patch = desired_label_changes_for(&node(&vm_labelled), None, GRACE, &sandbox);
        assert_eq!(set(&patch, DEPLOY_VFIO_MANAGER), Some(None));
        assert_eq!(set(&patch, crate::workload::DEPLOY_SANDBOX_VALIDATOR), None);
        assert_eq!(set(&patch, DEPLOY_DRIVER), Some(Some("true")));
        let mut out = vm_labelled.to_vec();
        out.push((DEPLOY_OPERANDS, "false"));
        let patch = desired_label_changes_for(&node(&out), None, GRACE, &sandbox);
        assert_eq!(set(&patch, DEPLOY_VFIO_MANAGER), Some(None));
        assert_eq!(patch.len(), 1, "{patch:?}");
    }

    #[test]
    fn the_workload_label_is_kept_in_the_node_cache() {
        let v = node(&[(crate::workload::WORKLOAD_CONFIG, "vm-vgpu")]);
        assert_eq!(v.label(crate::workload::WORKLOAD_CONFIG), Some("vm-vgpu"));
    }

    #[test]
    fn only_read_labels_are_kept() {
        let v = node(&[
            ("nvidia.com/gfd.timestamp", "1"),
            (GPU_PRODUCT, "Tesla-T4"),
            ("kubernetes.io/os", "linux"),
        ]);
        assert_eq!(v.labels.len(), 1);
    }
}
