//! Driver upgrades, the pure half: NVIDIA's per-node state machine (k8s-operator-libs'
//! `pkg/upgrade`, the label `nvidia.com/gpu-driver-upgrade-state`) as step functions over what
//! one pass observed. No IO here: [`plan`] says, per node, which state it moves to and what the
//! IO half must do first (cordon, evict, delete a pod, set an annotation).
//!
//! Order: upgrade-required -> cordon-required -> wait-for-jobs-required -> pod-deletion-required
//! -> drain-required -> pod-restart-required -> validation-required -> uncordon-required ->
//! upgrade-done, or upgrade-failed from any step that can fail. One step per node per pass: every
//! step after an action waits for the cluster to show its outcome. A driver pod whose config
//! digest is unchanged ([`DriverRevision::RestartOnly`]) goes from upgrade-required straight to
//! pod-restart-required (no cordon, no evictions); one that differs from its template in labels
//! or annotations only is current (decision 20).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::prepull::Prepull;
use crate::api::DriverUpgradePolicySpec;

/// The node label carrying a node's upgrade state (NVIDIA's key).
pub const STATE_LABEL: &str = crate::nodes::DRIVER_UPGRADE_STATE;
/// `true` on a node keeps it out of upgrades (NVIDIA's key).
pub const SKIP_LABEL: &str = crate::nodes::DRIVER_UPGRADE_SKIP;
/// Pods labelled `true` with it are left alone by the drain (NVIDIA's key).
pub const SKIP_DRAIN_POD_LABEL: &str = "nvidia.com/gpu-driver-upgrade-drain.skip";
/// Node annotation: `true` while automatic upgrades are on (NVIDIA's key; the driver manager
/// reads it and leaves evictions to the operator).
pub const ENABLED_ANNOTATION: &str = "nvidia.com/gpu-driver-upgrade-enabled";
/// Node annotation: set by a user to upgrade a node whose driver pod is current (NVIDIA's key).
pub const REQUESTED_ANNOTATION: &str = "nvidia.com/gpu-driver-upgrade-requested";
/// Node annotation: the node was cordoned before its upgrade began, so it stays cordoned after
/// (NVIDIA's key).
pub const INITIAL_UNSCHEDULABLE_ANNOTATION: &str =
    "nvidia.com/gpu-driver-upgrade.node-initial-state.unschedulable";
/// Node annotations holding when a timed step began, in Unix seconds (NVIDIA's keys for the
/// two steps NVIDIA times this way; ours for pod deletion and drain, which NVIDIA times in
/// memory and so forgets on a restart).
pub const WAIT_FOR_JOBS_SINCE_ANNOTATION: &str =
    "nvidia.com/gpu-driver-upgrade-wait-for-pod-completion-start-time";
pub const VALIDATION_SINCE_ANNOTATION: &str = "nvidia.com/gpu-driver-upgrade-validation-start-time";
pub const POD_DELETION_SINCE_ANNOTATION: &str =
    "nvidia.com/gpu-operator.driver-upgrade-pod-deletion-start-time";
pub const DRAIN_SINCE_ANNOTATION: &str = "nvidia.com/gpu-operator.driver-upgrade-drain-start-time";
/// Node annotation: why the node's upgrade failed (ours; shown in status).
pub const FAILURE_ANNOTATION: &str = "nvidia.com/gpu-operator.driver-upgrade-failure";
/// Node annotation: the image of the node's next driver that could not be pulled, while its
/// upgrade is held before the cordon (ours; its appearance is the transition an Event marks).
/// The kubelet's reason stays out of it: it alternates between ErrImagePull and
/// ImagePullBackOff with every retry, which is no transition.
pub const HELD_ANNOTATION: &str = "nvidia.com/gpu-operator.driver-upgrade-held";
/// How long the new validator pod may take to become Ready (NVIDIA's fixed 600 s).
pub const VALIDATION_TIMEOUT: Duration = Duration::from_secs(600);

/// A node's upgrade state, as NVIDIA spells it in the label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum UpgradeState {
    /// No label (yet): the node has not been looked at.
    Unknown,
    UpgradeRequired,
    CordonRequired,
    WaitForJobsRequired,
    PodDeletionRequired,
    DrainRequired,
    PodRestartRequired,
    ValidationRequired,
    UncordonRequired,
    Done,
    Failed,
}

impl UpgradeState {
    pub const ALL: [UpgradeState; 11] = [
        UpgradeState::Unknown,
        UpgradeState::UpgradeRequired,
        UpgradeState::CordonRequired,
        UpgradeState::WaitForJobsRequired,
        UpgradeState::PodDeletionRequired,
        UpgradeState::DrainRequired,
        UpgradeState::PodRestartRequired,
        UpgradeState::ValidationRequired,
        UpgradeState::UncordonRequired,
        UpgradeState::Done,
        UpgradeState::Failed,
    ];

    pub fn label(self) -> &'static str {
        match self {
            UpgradeState::Unknown => "",
            UpgradeState::UpgradeRequired => "upgrade-required",
            UpgradeState::CordonRequired => "cordon-required",
            UpgradeState::WaitForJobsRequired => "wait-for-jobs-required",
            UpgradeState::PodDeletionRequired => "pod-deletion-required",
            UpgradeState::DrainRequired => "drain-required",
            UpgradeState::PodRestartRequired => "pod-restart-required",
            UpgradeState::ValidationRequired => "validation-required",
            UpgradeState::UncordonRequired => "uncordon-required",
            UpgradeState::Done => "upgrade-done",
            UpgradeState::Failed => "upgrade-failed",
        }
    }

    /// The state a label value names; an unknown value (another tool's, a typo) counts as no
    /// label, so the node is looked at afresh.
    pub fn parse(value: Option<&str>) -> UpgradeState {
        let value = value.unwrap_or_default();
        Self::ALL
            .into_iter()
            .find(|s| s.label() == value)
            .unwrap_or(UpgradeState::Unknown)
    }

    /// Between upgrade-required and upgrade-done: the node holds one of the parallel slots.
    /// A failed node holds its slot too (NVIDIA counts it), until it is fixed.
    pub fn in_progress(self) -> bool {
        !matches!(
            self,
            UpgradeState::Unknown | UpgradeState::UpgradeRequired | UpgradeState::Done
        )
    }

    /// The annotation timing this state, if it is a timed one.
    fn since_annotation(self) -> Option<&'static str> {
        match self {
            UpgradeState::WaitForJobsRequired => Some(WAIT_FOR_JOBS_SINCE_ANNOTATION),
            UpgradeState::PodDeletionRequired => Some(POD_DELETION_SINCE_ANNOTATION),
            UpgradeState::DrainRequired => Some(DRAIN_SINCE_ANNOTATION),
            UpgradeState::ValidationRequired => Some(VALIDATION_SINCE_ANNOTATION),
            _ => None,
        }
    }
}

/// Every annotation the machine may leave on a node (cleared when upgrades are switched off).
pub const NODE_ANNOTATIONS: [&str; 9] = [
    ENABLED_ANNOTATION,
    REQUESTED_ANNOTATION,
    INITIAL_UNSCHEDULABLE_ANNOTATION,
    WAIT_FOR_JOBS_SINCE_ANNOTATION,
    VALIDATION_SINCE_ANNOTATION,
    POD_DELETION_SINCE_ANNOTATION,
    DRAIN_SINCE_ANNOTATION,
    FAILURE_ANNOTATION,
    HELD_ANNOTATION,
];

/// The upgrade annotations among a node's `annotations`.
pub fn node_annotations(
    annotations: Option<&BTreeMap<String, String>>,
) -> BTreeMap<String, String> {
    annotations
        .into_iter()
        .flatten()
        .filter(|(k, _)| NODE_ANNOTATIONS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// `spec.driver.upgradePolicy` with NVIDIA's defaults applied and `maxUnavailable` resolved
/// against the number of managed nodes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    /// 0: no limit.
    pub max_parallel: usize,
    pub max_unavailable: usize,
    /// Pods to wait for (a label selector) and how long (`None`: forever).
    pub wait_for: Option<(String, Option<Duration>)>,
    pub pod_deletion: Removal,
    /// `None`: draining is off.
    pub drain: Option<Removal>,
}

/// How pods are removed in the pod-deletion and drain steps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Removal {
    /// Also remove pods no controller manages (they are not recreated elsewhere).
    pub force: bool,
    /// Also remove pods with emptyDir volumes (their data is lost).
    pub delete_empty_dir: bool,
    /// `None`: wait forever.
    pub timeout: Option<Duration>,
    /// Drain only: a label selector limiting the pods drained.
    pub pod_selector: Option<String>,
}

fn seconds(value: Option<i64>, default: i64) -> Option<Duration> {
    let s = value.unwrap_or(default);
    (s > 0).then(|| Duration::from_secs(s.unsigned_abs()))
}

/// `maxUnavailable` against `total` nodes: a number, or a percentage rounded up (NVIDIA's
/// `GetScaledValueFromIntOrPercent(.., true)`); NVIDIA's default is 25%. A malformed value
/// (the CRD's CEL rule rejects them) counts as the default.
pub fn max_unavailable(value: Option<&IntOrString>, total: usize) -> usize {
    let percent = |p: usize| (p * total).div_ceil(100);
    match value {
        Some(IntOrString::Int(n)) => usize::try_from(*n).unwrap_or(0),
        Some(IntOrString::String(s)) => match s.strip_suffix('%').map(str::parse::<usize>) {
            Some(Ok(p)) => percent(p),
            _ => percent(25),
        },
        None => percent(25),
    }
}

impl Policy {
    /// The policy with NVIDIA's defaults (maxParallelUpgrades 1, maxUnavailable 25%, pod
    /// deletion 300 s, drain off / 300 s, wait-for-completion off).
    pub fn from_spec(spec: &DriverUpgradePolicySpec, total_nodes: usize) -> Policy {
        let deletion = spec.pod_deletion.clone().unwrap_or_default();
        let drain = spec.drain.clone().unwrap_or_default();
        Policy {
            max_parallel: usize::try_from(spec.max_parallel_upgrades.unwrap_or(1)).unwrap_or(1),
            max_unavailable: max_unavailable(spec.max_unavailable.as_ref(), total_nodes),
            wait_for: spec.wait_for_completion.as_ref().and_then(|w| {
                let selector = w.pod_selector.clone().filter(|s| !s.is_empty())?;
                Some((selector, seconds(w.timeout_seconds, 0)))
            }),
            pod_deletion: Removal {
                force: deletion.force.unwrap_or(false),
                delete_empty_dir: deletion.delete_empty_dir.unwrap_or(false),
                timeout: seconds(deletion.timeout_seconds, 300),
                pod_selector: None,
            },
            drain: drain.enable.unwrap_or(false).then(|| Removal {
                force: drain.force.unwrap_or(false),
                delete_empty_dir: drain.delete_empty_dir.unwrap_or(false),
                timeout: seconds(drain.timeout_seconds, 300),
                pod_selector: drain.pod_selector.clone().filter(|s| !s.is_empty()),
            }),
        }
    }
}

/// A pod on the node that a step may have to remove.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodFacts {
    pub namespace: String,
    pub name: String,
    /// Owned by a controller (it will be recreated elsewhere).
    pub managed: bool,
    pub empty_dir: bool,
    /// Already terminating: nothing more to ask.
    pub terminating: bool,
}

impl PodFacts {
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// How a node's driver pod compares with what its DaemonSet runs now (decision 20: a driver
/// pod is current when what it runs matches, not when its template revision does).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DriverRevision {
    /// On the DaemonSet's current revision.
    #[default]
    Current,
    /// On an older revision whose template differs from the current one in pod labels or
    /// annotations only, or a pod NVIDIA's operator started that runs the installation the
    /// current template renders (taken over): left running, it gets the template at its next
    /// restart. A restart would not do: its manager would find another digest value on the
    /// node than the pod's and reinstall the driver.
    OlderMetadata,
    /// On an older revision with the same driver config digest (say, only the driver manager
    /// changed): restarted in place, without cordon, drain or evictions.
    RestartOnly,
    /// What the driver installs changed (or a digest is missing): the full upgrade.
    Outdated,
    /// Its DaemonSet is of a driver variant the policy switched away from, and a DaemonSet of
    /// the new variant selects the node (operands::driver_variant): the full upgrade, ending in
    /// a handover of the node instead of a pod deletion.
    Outgoing,
}

/// What one driver DaemonSet runs now, for [`classify`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredDriver {
    /// The DaemonSet's name (status counts per DaemonSet).
    pub daemon_set: String,
    /// Its current revision hash (`controller-revision-hash`).
    pub revision: String,
    /// The driver config digest its template carries.
    pub digest: Option<String>,
    /// NVIDIA's digest of its template (operands::nvidia_digest): a pod NVIDIA's operator
    /// started carries that value when it runs the installation this template renders.
    pub nvidia_digest: Option<String>,
    /// Older revisions whose template differs from the current one in pod metadata only.
    pub metadata_only: BTreeSet<String>,
    /// Every image its template runs (containers and init containers): what a node must have
    /// before its driver is replaced (super::prepull).
    pub images: BTreeSet<String>,
    /// For an outgoing DaemonSet of a variant switch: the variant its nodes are handed to, and
    /// the node selectors of that variant's DaemonSets (a node none selects is not moved).
    pub handover: Option<(String, Vec<BTreeMap<String, String>>)>,
}

/// The variant a node with `labels` running a pod of `desired` is to be handed to: `Some` when
/// `desired` is an outgoing DaemonSet and a DaemonSet of the new variant selects the node.
pub fn handover_to<'a>(
    desired: &'a DesiredDriver,
    labels: &BTreeMap<String, String>,
) -> Option<&'a str> {
    let (to, selectors) = desired.handover.as_ref()?;
    selectors
        .iter()
        .any(|s| crate::operands::driver_variant::selector_matches(s, labels))
        .then_some(to.as_str())
}

/// Classifies a driver pod by its revision hash and the driver config digest it carries. A
/// missing digest on either side never counts as equal (NVIDIA: the full flow).
pub fn classify(
    pod_revision: Option<&str>,
    pod_digest: Option<&str>,
    desired: &DesiredDriver,
) -> DriverRevision {
    match pod_revision {
        Some(r) if r == desired.revision => DriverRevision::Current,
        Some(r) if desired.metadata_only.contains(r) => DriverRevision::OlderMetadata,
        _ => match pod_digest {
            Some(running) if desired.digest.as_deref() == Some(running) => {
                DriverRevision::RestartOnly
            }
            Some(running) if desired.nvidia_digest.as_deref() == Some(running) => {
                DriverRevision::OlderMetadata
            }
            _ => DriverRevision::Outdated,
        },
    }
}

/// Whether two DaemonSet ControllerRevisions' `data` (the pod template, as the DaemonSet
/// controller stores it) differ in the template's metadata or in where its pods may be placed
/// (node selector, node affinity) only. A running pod is unchanged by either: the DaemonSet
/// controller itself removes pods from nodes no longer selected. Data without a template never
/// counts.
pub fn differs_only_in_metadata_or_placement(
    old: &serde_json::Value,
    new: &serde_json::Value,
) -> bool {
    let spec = |data: &serde_json::Value| {
        let mut spec = data.pointer("/spec/template/spec")?.clone();
        let pod = spec.as_object_mut()?;
        pod.remove("nodeSelector");
        if let Some(affinity) = pod.get_mut("affinity").and_then(|a| a.as_object_mut()) {
            affinity.remove("nodeAffinity");
            if affinity.is_empty() {
                pod.remove("affinity");
            }
        }
        Some(spec)
    };
    match (spec(old), spec(new)) {
        (Some(old), Some(new)) => old == new,
        _ => false,
    }
}

/// The node's driver pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DriverPod {
    pub name: String,
    /// The DaemonSet owning it.
    pub daemon_set: String,
    pub revision: DriverRevision,
    /// With [`DriverRevision::Outgoing`]: the variant the node is handed to.
    pub handover_to: Option<String>,
    pub ready: bool,
    /// Crash-looping or failed (its container keeps exiting).
    pub failing: bool,
    /// Creation time, Unix seconds.
    pub created: i64,
}

impl DriverPod {
    /// Runs what its DaemonSet renders now (its labels or annotations may be older).
    pub fn current(&self) -> bool {
        matches!(
            self.revision,
            DriverRevision::Current | DriverRevision::OlderMetadata
        )
    }
}

/// The node's validator pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ValidatorPod {
    pub name: String,
    pub ready: bool,
    pub failing: bool,
    pub created: i64,
}

/// What one pass saw of one node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeFacts {
    pub name: String,
    pub state: Option<UpgradeState>,
    pub unschedulable: bool,
    /// The node's Ready condition is not True.
    pub not_ready: bool,
    pub annotations: BTreeMap<String, String>,
    pub skip: bool,
    /// `None`: the DaemonSet has no pod there right now (deleted, being recreated).
    pub driver: Option<DriverPod>,
    /// `None` with `validator_expected`: the new validator pod is not there yet.
    pub validator: Option<ValidatorPod>,
    /// A validator DaemonSet exists, so a node is validated before it is released.
    pub validator_expected: bool,
    /// Pods matching waitForCompletion's selector that have not finished.
    pub jobs_running: usize,
    /// Pods that use GPUs (request `nvidia.com/*` or run with the nvidia RuntimeClass), not
    /// owned by a DaemonSet.
    pub gpu_pods: Vec<PodFacts>,
    /// Pods the drain removes: not owned by a DaemonSet, matching the drain selector, not
    /// labelled to skip the drain.
    pub drain_pods: Vec<PodFacts>,
    /// Whether the images the next driver pod needs are on the node (super::prepull): an
    /// upgrade that would replace the driver starts only once they are.
    pub prepull: Prepull,
}

impl NodeFacts {
    fn state(&self) -> UpgradeState {
        self.state.unwrap_or(UpgradeState::Unknown)
    }

    /// When the current timed step began (Unix seconds), if recorded.
    fn since(&self) -> Option<i64> {
        let key = self.state().since_annotation()?;
        self.annotations.get(key)?.parse().ok()
    }

    fn initially_unschedulable(&self) -> bool {
        self.annotations
            .get(INITIAL_UNSCHEDULABLE_ANNOTATION)
            .is_some_and(|v| v == "true")
    }

    /// Counts against maxUnavailable: cordoned or not Ready (NVIDIA's rule).
    pub fn unavailable(&self) -> bool {
        self.unschedulable || self.not_ready
    }

    /// The driver pod is current and Ready.
    fn driver_ready(&self) -> bool {
        self.driver.as_ref().is_some_and(|d| d.current() && d.ready)
    }
}

/// What the IO half does on a node, in order, before it writes the new state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    Cordon,
    Uncordon,
    /// Evict these pods (`namespace/name`) through the Eviction API (PDBs respected).
    Evict(Vec<String>),
    /// Delete the node's driver pod (OnDelete: the DaemonSet recreates it on its new revision).
    DeleteDriverPod(String),
    /// Hand the node to this driver variant (its label value): the outgoing DaemonSet lets go
    /// of the node and removes its pod, the new variant's DaemonSet starts one.
    HandOver(String),
    /// Delete the node's validator pod so it validates the new driver.
    DeleteValidatorPod(String),
    /// Set (`Some`) or remove (`None`) a node annotation.
    Annotate(&'static str, Option<String>),
}

/// What happens to one node in this pass.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    pub actions: Vec<Action>,
    /// The state to write; `None` keeps the current one.
    pub next: Option<UpgradeState>,
    /// Why the node failed (with `next: Some(Failed)`).
    pub failure: Option<String>,
}

impl Step {
    fn stay() -> Step {
        Step::default()
    }

    fn to(next: UpgradeState) -> Step {
        Step {
            next: Some(next),
            ..Step::default()
        }
    }

    fn with(mut self, action: Action) -> Step {
        self.actions.push(action);
        self
    }

    fn failed(reason: String) -> Step {
        Step {
            actions: vec![Action::Annotate(FAILURE_ANNOTATION, Some(reason.clone()))],
            next: Some(UpgradeState::Failed),
            failure: Some(reason),
        }
    }
}

/// Seconds since `since`, or `None` when no start was recorded.
fn elapsed(since: Option<i64>, now: i64) -> Option<Duration> {
    since.map(|s| Duration::from_secs(now.saturating_sub(s).max(0).unsigned_abs()))
}

fn timed_out(since: Option<i64>, now: i64, timeout: Option<Duration>) -> bool {
    matches!((elapsed(since, now), timeout), (Some(e), Some(t)) if e >= t)
}

/// Leaving a timed state: record the next state's start when it is timed, clear this one's.
fn moving(node: &NodeFacts, next: UpgradeState, now: i64) -> Step {
    let mut step = Step::to(next);
    if let Some(key) = node.state().since_annotation() {
        step.actions.push(Action::Annotate(key, None));
    }
    if let Some(key) = next.since_annotation() {
        step.actions
            .push(Action::Annotate(key, Some(now.to_string())));
    }
    step
}

/// Where a node goes once its driver is validated: uncordon, unless it was cordoned before the
/// upgrade began (then it stays cordoned and is done).
fn released(node: &NodeFacts, now: i64) -> Step {
    let mut step = if node.initially_unschedulable() {
        moving(node, UpgradeState::Done, now)
            .with(Action::Annotate(INITIAL_UNSCHEDULABLE_ANNOTATION, None))
    } else {
        moving(node, UpgradeState::UncordonRequired, now)
    };
    step.actions
        .push(Action::Annotate(FAILURE_ANNOTATION, None));
    step
}

/// Why a pod stops the removal: it would be lost (no controller) or its data would be.
fn blocked(pod: &PodFacts, removal: &Removal) -> Option<String> {
    if !pod.managed && !removal.force {
        Some(format!(
            "pod {} is not managed by a controller (set force to remove it)",
            pod.key()
        ))
    } else if pod.empty_dir && !removal.delete_empty_dir {
        Some(format!(
            "pod {} uses emptyDir (set deleteEmptyDir to remove it)",
            pod.key()
        ))
    } else {
        None
    }
}

/// Outcome of removing pods in one pass.
enum Removed {
    Done,
    Pending(Vec<String>),
    Failed(String),
}

fn remove(
    pods: &[PodFacts],
    removal: &Removal,
    since: Option<i64>,
    now: i64,
    what: &str,
) -> Removed {
    if pods.is_empty() {
        return Removed::Done;
    }
    if let Some(reason) = pods.iter().find_map(|p| blocked(p, removal)) {
        return Removed::Failed(format!("{what}: {reason}"));
    }
    if timed_out(since, now, removal.timeout) {
        let left: Vec<String> = pods.iter().map(PodFacts::key).collect();
        return Removed::Failed(format!(
            "{what} timed out after {}s with pods still on the node: {} (a PodDisruptionBudget \
             may forbid their eviction)",
            removal.timeout.unwrap_or_default().as_secs(),
            left.join(", ")
        ));
    }
    Removed::Pending(
        pods.iter()
            .filter(|p| !p.terminating)
            .map(PodFacts::key)
            .collect(),
    )
}

/// The step of one node whose upgrade is under way (or about to start when `start` is true),
/// at `now` (Unix seconds), with the node's held annotation brought in line ([`held`]).
pub fn step(node: &NodeFacts, policy: &Policy, start: bool, now: i64) -> Step {
    let mut step = transition(node, policy, start, now);
    let want = held(node, &step);
    if node.annotations.get(HELD_ANNOTATION) != want.as_ref() {
        step.actions.push(Action::Annotate(HELD_ANNOTATION, want));
    }
    step
}

/// What the node's held annotation says after `step`: the image that could not be pulled,
/// while the node waits in upgrade-required for it; nothing otherwise (the pull worked, the
/// target changed, or the node moved on).
pub fn held(node: &NodeFacts, step: &Step) -> Option<String> {
    let after = step.next.unwrap_or(node.state());
    match &node.prepull {
        Prepull::Failed { image, .. } if after == UpgradeState::UpgradeRequired => {
            Some(image.clone())
        }
        _ => None,
    }
}

/// Whether the node may take a slot and start its upgrade: waiting for it, not skipped, and
/// with the images its next driver pod needs on the node (a node whose pull failed or is still
/// under way keeps its running driver and leaves the slot to another).
pub fn may_start(node: &NodeFacts) -> bool {
    node.state() == UpgradeState::UpgradeRequired && !node.skip && !node.prepull.holds()
}

fn transition(node: &NodeFacts, policy: &Policy, start: bool, now: i64) -> Step {
    use UpgradeState as S;
    let Some(driver) = node.driver.as_ref() else {
        // No driver pod: only the restart step expects that (the DaemonSet recreates it).
        return Step::stay();
    };
    match node.state() {
        S::Unknown | S::Done => {
            let requested = node.annotations.contains_key(REQUESTED_ANNOTATION);
            if driver.current() && !requested {
                return if node.state() == S::Unknown {
                    Step::to(S::Done)
                } else {
                    Step::stay()
                };
            }
            let mut step = Step::to(S::UpgradeRequired);
            if requested {
                step.actions
                    .push(Action::Annotate(REQUESTED_ANNOTATION, None));
            }
            // A node retried after a failure is cordoned by us, not by its owner: what was
            // recorded at its first attempt stands.
            let failed_before = node.annotations.contains_key(FAILURE_ANNOTATION);
            if node.unschedulable && !failed_before {
                step.actions.push(Action::Annotate(
                    INITIAL_UNSCHEDULABLE_ANNOTATION,
                    Some("true".to_owned()),
                ));
            }
            step
        }
        // Nothing the driver installs changes: the pod is replaced in place, GPU pods keep
        // running and the node stays schedulable.
        S::UpgradeRequired
            if start && !node.skip && driver.revision == DriverRevision::RestartOnly =>
        {
            Step::to(S::PodRestartRequired)
        }
        S::UpgradeRequired if start && !node.skip => Step::to(S::CordonRequired),
        S::UpgradeRequired => Step::stay(),
        S::CordonRequired => {
            let step = moving(node, S::WaitForJobsRequired, now);
            if node.unschedulable {
                step
            } else {
                step.with(Action::Cordon)
            }
        }
        S::WaitForJobsRequired => {
            let waiting = match &policy.wait_for {
                Some((_, timeout)) => {
                    node.jobs_running > 0 && !timed_out(node.since(), now, *timeout)
                }
                None => false,
            };
            if waiting {
                Step::stay()
            } else {
                moving(node, S::PodDeletionRequired, now)
            }
        }
        S::PodDeletionRequired => {
            let after = if policy.drain.is_some() {
                S::DrainRequired
            } else {
                S::PodRestartRequired
            };
            match remove(
                &node.gpu_pods,
                &policy.pod_deletion,
                node.since(),
                now,
                "GPU pod deletion",
            ) {
                Removed::Done => moving(node, after, now),
                Removed::Pending(pods) if pods.is_empty() => Step::stay(),
                Removed::Pending(pods) => Step::stay().with(Action::Evict(pods)),
                // NVIDIA: a failed pod deletion falls back on the drain when it is on.
                Removed::Failed(_) if policy.drain.is_some() => moving(node, S::DrainRequired, now),
                Removed::Failed(reason) => Step::failed(reason),
            }
        }
        S::DrainRequired => {
            let Some(drain) = policy.drain.as_ref() else {
                return moving(node, S::PodRestartRequired, now);
            };
            match remove(&node.drain_pods, drain, node.since(), now, "drain") {
                Removed::Done => moving(node, S::PodRestartRequired, now),
                Removed::Pending(pods) if pods.is_empty() => Step::stay(),
                Removed::Pending(pods) => Step::stay().with(Action::Evict(pods)),
                Removed::Failed(reason) => Step::failed(reason),
            }
        }
        S::PodRestartRequired => {
            if let Some(to) = driver.handover_to.as_ref() {
                // The outgoing DaemonSet removes its pod once the node is handed over.
                Step::stay().with(Action::HandOver(to.clone()))
            } else if !driver.current() {
                Step::stay().with(Action::DeleteDriverPod(driver.name.clone()))
            } else if driver.ready {
                moving(node, S::ValidationRequired, now)
            } else if driver.failing {
                Step::failed(format!("driver pod {} keeps failing", driver.name))
            } else {
                Step::stay()
            }
        }
        S::ValidationRequired => validate(node, driver, now),
        S::UncordonRequired => {
            let step = moving(node, S::Done, now);
            if node.unschedulable {
                step.with(Action::Uncordon)
            } else {
                step
            }
        }
        S::Failed => {
            // Fixed when the driver pod is current and Ready and the node validates.
            if node.driver_ready() && validated(node, driver) {
                released(node, now)
            } else {
                Step::stay()
            }
        }
    }
}

/// The validator pod was created after the driver pod and is Ready (or no validator runs).
fn validated(node: &NodeFacts, driver: &DriverPod) -> bool {
    !node.validator_expected
        || node
            .validator
            .as_ref()
            .is_some_and(|v| v.ready && v.created >= driver.created)
}

fn validate(node: &NodeFacts, driver: &DriverPod, now: i64) -> Step {
    if validated(node, driver) {
        return released(node, now);
    }
    match node.validator.as_ref() {
        // Started before the new driver: restart it so it validates the new one (what the
        // driver manager does on a real node by pausing the operands).
        Some(v) if v.created < driver.created => {
            Step::stay().with(Action::DeleteValidatorPod(v.name.clone()))
        }
        Some(v) if v.failing => Step::failed(format!(
            "validator pod {} is failing on the new driver",
            v.name
        )),
        _ if timed_out(node.since(), now, Some(VALIDATION_TIMEOUT)) => Step::failed(format!(
            "validation timed out after {}s: the validator pod did not become Ready",
            VALIDATION_TIMEOUT.as_secs()
        )),
        _ => Step::stay(),
    }
}

/// How many upgrade-required nodes may start now: the parallel slots left, limited so that the
/// unavailable nodes stay within maxUnavailable (NVIDIA's `GetUpgradesAvailable`).
pub fn upgrades_available(nodes: &[NodeFacts], policy: &Policy) -> usize {
    let in_progress = nodes.iter().filter(|n| n.state().in_progress()).count();
    let waiting = nodes
        .iter()
        .filter(|n| n.state() == UpgradeState::UpgradeRequired)
        .count();
    let parallel = if policy.max_parallel == 0 {
        waiting
    } else {
        policy.max_parallel.saturating_sub(in_progress)
    };
    // A node in flight that is not cordoned yet will be: count it as unavailable already.
    let unavailable = nodes
        .iter()
        .filter(|n| n.unavailable() || n.state().in_progress())
        .count();
    parallel.min(policy.max_unavailable.saturating_sub(unavailable))
}

/// Every node's step in this pass: the upgrade-required nodes that may start are the first by
/// name (skipped nodes never start).
pub fn plan(nodes: &[NodeFacts], policy: &Policy, now: i64) -> Vec<(String, Step)> {
    let mut slots = upgrades_available(nodes, policy);
    let mut sorted: Vec<&NodeFacts> = nodes.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    sorted
        .into_iter()
        .map(|node| {
            let start = may_start(node) && slots > 0;
            if start {
                slots -= 1;
            }
            (node.name.clone(), step(node, policy, start, now))
        })
        .collect()
}

/// The nodes upgraded under one policy: the GPU nodes of one NVIDIADriver pool, or those of
/// the ClusterPolicy's own driver DaemonSets. Each pool's maxParallelUpgrades and
/// maxUnavailable count its own nodes only (NVIDIA partitions the same way).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pool {
    /// The NVIDIADriver's name, or empty for the ClusterPolicy's nodes.
    pub name: String,
    pub policy: Policy,
    pub nodes: Vec<NodeFacts>,
}

/// Every node's step in this pass, pool by pool: [`plan`] with each pool's own policy.
pub fn plan_pools(pools: &[Pool], now: i64) -> Vec<(String, Step)> {
    pools
        .iter()
        .flat_map(|p| plan(&p.nodes, &p.policy, now))
        .collect()
}

/// Nodes per state, for status and metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub total: usize,
    pub done: usize,
    pub pending: usize,
    pub in_progress: usize,
    pub available: usize,
    /// (node, reason) of each failed node.
    pub failed: Vec<(String, String)>,
    /// Per driver DaemonSet, its pods left running with older labels or annotations (status
    /// says so beside that DaemonSet's counts).
    pub older_metadata: BTreeMap<String, usize>,
    /// Waiting nodes whose new driver image is still being pulled.
    pub pulling: usize,
    /// Waiting nodes held because an image of their next driver could not be pulled.
    pub held: Vec<Hold>,
}

/// A node held in upgrade-required, keeping its running driver: the image that could not be
/// pulled there and the kubelet's reason.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Hold {
    pub image: String,
    pub reason: String,
    pub node: String,
}

/// At most this many node names per group in a status line.
const NAMED_NODES: usize = 10;

/// `names` joined, the first [`NAMED_NODES`] of them and how many more.
fn named(names: &[&str]) -> String {
    let mut line = names
        .iter()
        .take(NAMED_NODES)
        .copied()
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > NAMED_NODES {
        line.push_str(&format!(" and {} more", names.len() - NAMED_NODES));
    }
    line
}

impl Summary {
    /// States after this pass's steps.
    pub fn of(nodes: &[NodeFacts], steps: &[(String, Step)], policy: &Policy) -> Summary {
        let mut summary = Summary {
            total: nodes.len(),
            available: upgrades_available(nodes, policy),
            ..Summary::default()
        };
        let steps: BTreeMap<&str, &Step> = steps.iter().map(|(n, s)| (n.as_str(), s)).collect();
        for node in nodes {
            if let Some(d) = node
                .driver
                .as_ref()
                .filter(|d| d.revision == DriverRevision::OlderMetadata)
            {
                *summary
                    .older_metadata
                    .entry(d.daemon_set.clone())
                    .or_default() += 1;
            }
            let step = steps.get(node.name.as_str()).copied();
            let state = step.and_then(|s| s.next).unwrap_or(node.state());
            match state {
                UpgradeState::Done => summary.done += 1,
                UpgradeState::UpgradeRequired => {
                    summary.pending += 1;
                    match &node.prepull {
                        Prepull::Pulling(_) => summary.pulling += 1,
                        Prepull::Failed { image, reason } => summary.held.push(Hold {
                            image: image.clone(),
                            reason: reason.clone(),
                            node: node.name.clone(),
                        }),
                        Prepull::NotNeeded | Prepull::Pulled => {}
                    }
                }
                UpgradeState::Failed => summary.failed.push((
                    node.name.clone(),
                    step.and_then(|s| s.failure.clone())
                        .or_else(|| node.annotations.get(FAILURE_ANNOTATION).cloned())
                        .unwrap_or_else(|| "reason not recorded".to_owned()),
                )),
                UpgradeState::Unknown => {}
                _ => summary.in_progress += 1,
            }
        }
        summary.failed.sort();
        summary.held.sort();
        summary
    }

    /// The states after this pass's steps, summed over the pools (each pool's available
    /// upgrades counted against its own policy).
    pub fn of_pools(pools: &[Pool], steps: &[(String, Step)]) -> Summary {
        let mut total = Summary::default();
        for pool in pools {
            let s = Summary::of(&pool.nodes, steps, &pool.policy);
            total.total += s.total;
            total.done += s.done;
            total.pending += s.pending;
            total.in_progress += s.in_progress;
            total.available += s.available;
            total.failed.extend(s.failed);
            total.pulling += s.pulling;
            total.held.extend(s.held);
            for (daemon_set, count) in s.older_metadata {
                *total.older_metadata.entry(daemon_set).or_default() += count;
            }
        }
        total.failed.sort();
        total.held.sort();
        total
    }

    /// Whether a node is between states (the pass must look again soon). Nodes waiting for
    /// their pre-pull are not: their pre-pull pod's next state wakes the pass (a held node
    /// waits for a person, who changes the image).
    pub fn active(&self) -> bool {
        let startable = self.pending.saturating_sub(self.pulling + self.held.len());
        self.in_progress > 0 || (startable > 0 && self.available > 0)
    }

    /// The status line, e.g. `3 of 40 nodes upgraded, 2 in progress, 1 failed: gpu-7: drain
    /// timed out ...`.
    pub fn line(&self) -> String {
        let mut line = format!("{} of {} nodes upgraded", self.done, self.total);
        if self.in_progress > 0 {
            line.push_str(&format!(", {} in progress", self.in_progress));
        }
        if self.pending > 0 {
            line.push_str(&format!(", {} waiting", self.pending));
            if self.pulling > 0 {
                line.push_str(&format!(
                    " ({} until the new driver image is pulled)",
                    self.pulling
                ));
            }
        }
        if !self.failed.is_empty() {
            let named: Vec<String> = self
                .failed
                .iter()
                .map(|(node, reason)| format!("{node}: {reason}"))
                .collect();
            line.push_str(&format!(
                ", {} failed: {}",
                self.failed.len(),
                named.join("; ")
            ));
        }
        if !self.held.is_empty() {
            line.push_str(&format!(
                ", {} held before the cordon (they keep their running driver): {}",
                self.held.len(),
                self.held_groups().join("; ")
            ));
        }
        line
    }

    /// The held nodes grouped by image and reason: `<image> cannot be pulled on <nodes>
    /// (<reason>)`.
    fn held_groups(&self) -> Vec<String> {
        let mut groups: BTreeMap<(&str, &str), Vec<&str>> = BTreeMap::new();
        for h in &self.held {
            groups
                .entry((h.image.as_str(), h.reason.as_str()))
                .or_default()
                .push(h.node.as_str());
        }
        groups
            .into_iter()
            .map(|((image, reason), nodes)| {
                format!("{image} cannot be pulled on {} ({reason})", named(&nodes))
            })
            .collect()
    }
}
