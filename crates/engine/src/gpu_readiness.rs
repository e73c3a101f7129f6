//! GPU readiness (pure): when a node's startup taint comes off, when an unhealthy node is
//! quarantined, when its device plugin is restarted, when the quarantine lifts, and when the
//! breaker holds (`spec.gpuReadiness`). The IO side is
//! `operator/src/controller/cluster_policy/readiness.rs`.
//!
//! - The startup taint is the user's (a Karpenter NodePool's `startupTaints`): it is only ever
//!   removed, from a node that joined with it, once the node's validator is ready and its device
//!   plugin advertises every GPU the node has.
//! - The quarantine taint is ours ([`QUARANTINE_TAINT`]), and so is the record beside it
//!   ([`QUARANTINE_ANNOTATION`]); only a node carrying our record is ever lifted, so a taint of
//!   that key someone else set stays.
//! - "Every GPU" is GFD's `nvidia.com/gpu.count` times its `nvidia.com/gpu.replicas`; under the
//!   `mixed` MIG strategy GPUs in MIG mode are advertised as MIG resources, so the count is not
//!   checked there, and without GFD's count one advertised GPU is enough.

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1::{Node, Taint, Toleration};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::api::{ClusterPolicySpec, QuarantineSpec, StartupTaintSpec};
use crate::nodes::{GPU_COUNT, GPU_REPLICAS, MIG_STRATEGY, NodeView};
use crate::upgrade::machine::UpgradeState;

/// The taint key of a quarantined node (ours; effect [`QUARANTINE_EFFECT`], value the reason).
pub const QUARANTINE_TAINT: &str = "nvidia.com/gpu-operator.quarantine";
pub const QUARANTINE_EFFECT: &str = "NoSchedule";
/// Node annotation: the operator's [`Record`] of a quarantine (JSON).
pub const QUARANTINE_ANNOTATION: &str = "nvidia.com/gpu-operator.quarantine";
/// The device plugin is restarted at once on quarantine, then after these delays, doubling up to
/// the cap.
pub const FIRST_RESTART_DELAY_SECONDS: i64 = 30;
pub const MAX_RESTART_DELAY_SECONDS: i64 = 600;

/// The validator pod of a node, as the caches show it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Validator {
    /// No validator pod on the node (yet).
    Missing,
    Starting,
    Ready,
    /// Its containers keep failing (a crash loop, a failed init container).
    Failing,
}

/// How many GPUs the device plugin should advertise on a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expected {
    /// GFD's count times its replicas.
    Count(u64),
    /// Without GFD's count: at least one.
    AtLeastOne,
    /// Not checked (the `mixed` MIG strategy).
    NotChecked,
}

/// What the device plugin should advertise on `node`.
pub fn expected_gpus(node: &NodeView) -> Expected {
    if node.label(MIG_STRATEGY) == Some("mixed") {
        return Expected::NotChecked;
    }
    let Some(count) = node.label(GPU_COUNT).and_then(|c| c.parse::<u64>().ok()) else {
        return Expected::AtLeastOne;
    };
    let replicas = node
        .label(GPU_REPLICAS)
        .and_then(|r| r.parse::<u64>().ok())
        .unwrap_or(1)
        .max(1);
    Expected::Count(count.saturating_mul(replicas))
}

/// `Some((advertised, expected))` when the device plugin advertises fewer GPUs than `node` has.
pub fn missing_gpus(node: &NodeView) -> Option<(u64, Expected)> {
    let advertised = node.readiness.gpus_advertised.unwrap_or(0);
    let expected = expected_gpus(node);
    let short = match expected {
        Expected::Count(n) => advertised < n,
        Expected::AtLeastOne => advertised == 0,
        Expected::NotChecked => false,
    };
    short.then_some((advertised, expected))
}

/// What a node carrying the startup taint waits on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Wait {
    /// Neither NFD nor the operator has marked it a GPU node yet.
    Discovery,
    Validator(Validator),
    DevicePlugin {
        advertised: u64,
        expected: Expected,
    },
}

impl Wait {
    /// The step's short name (the metric's `step` label).
    pub fn step(&self) -> &'static str {
        match self {
            Wait::Discovery => "discovery",
            Wait::Validator(_) => "validator",
            Wait::DevicePlugin { .. } => "device-plugin",
        }
    }
}

impl fmt::Display for Wait {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Wait::Discovery => write!(f, "GPU discovery: NFD has not labelled the node yet"),
            Wait::Validator(Validator::Failing) => write!(f, "the validator, which is failing"),
            Wait::Validator(_) => write!(f, "the validator to be ready"),
            Wait::DevicePlugin {
                advertised,
                expected: Expected::Count(n),
            } => write!(f, "the device plugin: {advertised} of {n} GPUs advertised"),
            Wait::DevicePlugin { .. } => write!(f, "the device plugin: no GPU advertised"),
        }
    }
}

/// Why a startup taint comes off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lift {
    /// The validator is ready and every GPU is advertised.
    Ready,
    /// NFD labelled the node and found no NVIDIA GPU: nothing would ever make it ready.
    NoGpu,
}

/// The startup taint of one node: `None` when the node does not carry it.
pub fn startup(
    node: &NodeView,
    validator: Validator,
    taint: &StartupTaintSpec,
) -> Option<Result<Lift, Wait>> {
    if !node
        .readiness
        .has_taint(&taint.key, taint.effect().as_str())
    {
        return None;
    }
    Some(startup_step(node, validator))
}

fn startup_step(node: &NodeView, validator: Validator) -> Result<Lift, Wait> {
    if !node.is_gpu_node() && !node.has_nfd_gpu() {
        return if node.nfd_annotated {
            Ok(Lift::NoGpu)
        } else {
            Err(Wait::Discovery)
        };
    }
    if validator != Validator::Ready {
        return Err(Wait::Validator(validator));
    }
    match missing_gpus(node) {
        Some((advertised, expected)) => Err(Wait::DevicePlugin {
            advertised,
            expected,
        }),
        None => Ok(Lift::Ready),
    }
}

/// Why a node counts as unhealthy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unhealthy {
    GpusMissing { advertised: u64, expected: Expected },
    ValidatorFailing,
}

impl Unhealthy {
    /// The taint's value: a label value.
    pub fn reason(&self) -> &'static str {
        match self {
            Unhealthy::GpusMissing { .. } => "gpus-missing",
            Unhealthy::ValidatorFailing => "validator-failing",
        }
    }
}

impl fmt::Display for Unhealthy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unhealthy::GpusMissing {
                advertised,
                expected: Expected::Count(n),
            } => write!(f, "its device plugin advertises {advertised} of {n} GPUs"),
            Unhealthy::GpusMissing { .. } => write!(f, "its device plugin advertises no GPU"),
            Unhealthy::ValidatorFailing => write!(f, "its validator is failing"),
        }
    }
}

/// A node's health as far as the quarantine judges it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    Healthy,
    Unhealthy(Unhealthy),
    /// Not judged: not a GPU node, still starting (its startup taint on, its validator not ready
    /// yet), or in a driver upgrade (which takes the GPUs away on purpose).
    NotJudged,
}

/// The health of `node`; `starting` when it still carries the startup taint.
pub fn health(node: &NodeView, validator: Validator, starting: bool) -> Health {
    if !node.is_gpu_node() || starting {
        return Health::NotJudged;
    }
    let upgrade = UpgradeState::parse(node.label(crate::nodes::DRIVER_UPGRADE_STATE));
    if upgrade.in_progress() && upgrade != UpgradeState::Failed {
        return Health::NotJudged;
    }
    match validator {
        Validator::Failing => Health::Unhealthy(Unhealthy::ValidatorFailing),
        Validator::Missing | Validator::Starting => Health::NotJudged,
        Validator::Ready => match missing_gpus(node) {
            Some((advertised, expected)) => Health::Unhealthy(Unhealthy::GpusMissing {
                advertised,
                expected,
            }),
            None => Health::Healthy,
        },
    }
}

/// Since when each node has been unhealthy without a break (Unix seconds), kept in memory: an
/// operator restart starts the grace periods again, which delays a quarantine and never hastens
/// one. Nodes no longer unhealthy are forgotten.
pub fn track_unhealthy<'a>(
    since: &mut BTreeMap<String, i64>,
    healths: impl IntoIterator<Item = (&'a str, &'a Health)>,
    now: i64,
) {
    let mut seen = BTreeMap::new();
    for (name, health) in healths {
        if matches!(health, Health::Unhealthy(_)) {
            let started = since.get(name).copied().unwrap_or(now);
            seen.insert(name.to_owned(), started);
        }
    }
    *since = seen;
}

/// What the operator wrote on a quarantined node (the annotation's content).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    /// Why ([`Unhealthy::reason`]) and what was seen, for people.
    pub reason: String,
    pub message: String,
    /// When the quarantine began (Unix seconds).
    pub since: i64,
    /// Device plugin restarts so far, and when the last one was (Unix seconds).
    #[serde(default)]
    pub restarts: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_restart: Option<i64>,
}

impl Record {
    /// The record on `node`; an unreadable one counts as a quarantine of unknown cause (ours:
    /// only we write the key), so it can still be lifted.
    pub fn of(node: &NodeView) -> Option<Record> {
        let raw = node.readiness.quarantine.as_deref()?;
        Some(serde_json::from_str(raw).unwrap_or_else(|_| Record {
            reason: "unknown".to_owned(),
            ..Record::default()
        }))
    }

    /// When the next device plugin restart is due: at once after the quarantine, then
    /// [`FIRST_RESTART_DELAY_SECONDS`] doubling up to [`MAX_RESTART_DELAY_SECONDS`].
    pub fn next_restart(&self) -> i64 {
        match self.last_restart {
            None => self.since,
            Some(last) => last + restart_delay(self.restarts),
        }
    }
}

/// The delay after the `restarts`-th restart.
pub fn restart_delay(restarts: u32) -> i64 {
    let doublings = restarts.saturating_sub(1).min(16);
    (FIRST_RESTART_DELAY_SECONDS << doublings).min(MAX_RESTART_DELAY_SECONDS)
}

/// One node as the quarantine plan sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeState {
    pub name: String,
    pub health: Health,
    /// From [`track_unhealthy`].
    pub unhealthy_since: Option<i64>,
    pub record: Option<Record>,
    /// Whether it carries our quarantine taint.
    pub tainted: bool,
}

/// What to do on one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Taint it and write this record.
    Quarantine(Record),
    /// Restart its device plugin pod; then write this record (restarts counted).
    RestartPlugin(Record),
    /// Remove our taint and record: every GPU is back, or someone removed the taint by hand (the
    /// record alone is then cleared), or the quarantine is switched off.
    Lift,
}

/// The breaker holding: more nodes unhealthy at once than the quarantine may take.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Breaker {
    /// Quarantined, past their grace period, or unhealthy within it.
    pub unhealthy: usize,
    pub gpu_nodes: usize,
    pub limit: usize,
    /// Nodes past their grace period left unquarantined.
    pub held: Vec<String>,
}

/// What the quarantine does in one pass.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub actions: Vec<(String, Action)>,
    pub breaker: Option<Breaker>,
    /// When to look again (Unix seconds): the next grace period's end or restart due.
    pub next_check: Option<i64>,
}

/// The most nodes quarantined at once out of `gpu_nodes`.
pub fn quarantine_limit(gpu_nodes: usize, spec: &QuarantineSpec) -> usize {
    (gpu_nodes * spec.max_unhealthy_percent() as usize / 100).max(1)
}

/// The quarantine's plan over every GPU node. `spec` is `None` when the quarantine is off: then
/// every quarantine lifts.
pub fn plan(nodes: &[NodeState], spec: Option<&QuarantineSpec>, now: i64) -> Plan {
    let mut out = Plan::default();
    let Some(spec) = spec else {
        out.actions = nodes
            .iter()
            .filter(|n| n.record.is_some())
            .map(|n| (n.name.clone(), Action::Lift))
            .collect();
        return out;
    };
    let mut next_check: Option<i64> = None;
    let mut soonest = |t: i64| next_check = Some(next_check.map_or(t, |c| c.min(t)));
    let grace = i64::from(spec.grace_period_seconds());
    let mut quarantined = 0;
    let mut candidates = Vec::new();
    // Unhealthy nodes still in their grace period count towards the breaker: nodes that lose a
    // GPU together do not cross their grace periods in the same second, and the first one past
    // it must not be quarantined alone while the others are seen failing beside it.
    let mut in_grace = 0;
    let mut actions = Vec::new();
    for node in nodes {
        match (&node.record, node.tainted) {
            // Every GPU back; or our taint removed by hand, which ends the quarantine.
            (Some(_), true) if node.health == Health::Healthy => {
                actions.push((node.name.clone(), Action::Lift))
            }
            (Some(_), false) => actions.push((node.name.clone(), Action::Lift)),
            (Some(record), true) => {
                quarantined += 1;
                let due = record.next_restart();
                if due <= now {
                    let next = Record {
                        restarts: record.restarts + 1,
                        last_restart: Some(now),
                        ..record.clone()
                    };
                    soonest(next.next_restart());
                    actions.push((node.name.clone(), Action::RestartPlugin(next)));
                } else {
                    soonest(due);
                }
            }
            // A taint of our key without our record is someone else's: left alone.
            (None, _) => {
                if let (Health::Unhealthy(why), Some(since)) = (&node.health, node.unhealthy_since)
                {
                    if since + grace <= now {
                        candidates.push((node.name.clone(), why.clone()));
                    } else {
                        in_grace += 1;
                        soonest(since + grace);
                    }
                }
            }
        }
    }
    let gpu_nodes = nodes.len();
    let limit = quarantine_limit(gpu_nodes, spec);
    let unhealthy = quarantined + candidates.len() + in_grace;
    if !candidates.is_empty() && unhealthy > limit {
        out.breaker = Some(Breaker {
            unhealthy,
            gpu_nodes,
            limit,
            held: candidates.into_iter().map(|(n, _)| n).collect(),
        });
    } else {
        for (name, why) in candidates {
            let record = Record {
                reason: why.reason().to_owned(),
                message: why.to_string(),
                since: now,
                restarts: 0,
                last_restart: None,
            };
            // The first restart is due at once: the next pass (woken by the taint) runs it.
            soonest(now);
            actions.push((name, Action::Quarantine(record)));
        }
    }
    out.actions = actions;
    out.next_check = next_check;
    out
}

/// The node's taints as the API holds them.
fn taints(node: &Node) -> Vec<Taint> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default()
}

/// A merge patch replacing the node's taint list, with its `resourceVersion` as a precondition
/// (the list is replaced whole, so a concurrent change must fail the patch, not be lost).
fn taints_patch(node: &Node, taints: Vec<Taint>, annotation: Option<Value>) -> Value {
    let mut metadata = json!({ "resourceVersion": node.metadata.resource_version });
    if let Some(value) = annotation {
        metadata["annotations"] = json!({ QUARANTINE_ANNOTATION: value });
    }
    json!({ "metadata": metadata, "spec": { "taints": taints } })
}

/// The patch taking the startup taint off `node` (read in full); `None` when it is gone.
pub fn lift_startup_patch(node: &Node, taint: &StartupTaintSpec) -> Option<Value> {
    let all = taints(node);
    let effect = taint.effect().as_str();
    let kept: Vec<Taint> = all
        .iter()
        .filter(|t| !(t.key == taint.key && t.effect == effect))
        .cloned()
        .collect();
    (kept.len() != all.len()).then(|| taints_patch(node, kept, None))
}

/// The patch quarantining `node`: our taint (value the reason) beside the others, and the
/// record.
pub fn quarantine_patch(node: &Node, record: &Record) -> Value {
    let mut kept: Vec<Taint> = taints(node)
        .into_iter()
        .filter(|t| !(t.key == QUARANTINE_TAINT && t.effect == QUARANTINE_EFFECT))
        .collect();
    kept.push(Taint {
        key: QUARANTINE_TAINT.to_owned(),
        value: Some(record.reason.clone()),
        effect: QUARANTINE_EFFECT.to_owned(),
        time_added: None,
    });
    let record = serde_json::to_string(record).unwrap_or_default();
    taints_patch(node, kept, Some(Value::String(record)))
}

/// The patch recording a device plugin restart (the record alone).
pub fn record_patch(record: &Record) -> Value {
    let record = serde_json::to_string(record).unwrap_or_default();
    json!({ "metadata": { "annotations": { QUARANTINE_ANNOTATION: record } } })
}

/// The patch lifting a quarantine: our taint and record off.
pub fn lift_quarantine_patch(node: &Node) -> Value {
    let kept: Vec<Taint> = taints(node)
        .into_iter()
        .filter(|t| !(t.key == QUARANTINE_TAINT && t.effect == QUARANTINE_EFFECT))
        .collect();
    taints_patch(node, kept, Some(Value::Null))
}

/// The taints every operand must tolerate for `gpuReadiness`, as key and effect: the startup
/// taint (operands bring the node up) and the quarantine taint (a restarted device plugin must
/// come back on a quarantined node).
pub fn operand_taints(spec: &ClusterPolicySpec) -> Vec<(String, String)> {
    let Some(readiness) = spec.gpu_readiness.as_ref() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    if let Some(taint) = &readiness.startup_taint {
        out.push((taint.key.clone(), taint.effect().as_str().to_owned()));
    }
    if readiness.quarantine().is_some() {
        out.push((QUARANTINE_TAINT.to_owned(), QUARANTINE_EFFECT.to_owned()));
    }
    out
}

/// The tolerations operands need for [`operand_taints`]: an `Exists` toleration for each one
/// `existing` does not already tolerate whatever its value.
pub fn operand_tolerations(spec: &ClusterPolicySpec, existing: &[Toleration]) -> Vec<Toleration> {
    let tolerated = |key: &str, effect: &str| {
        existing.iter().any(|tol| {
            let exists = tol.operator.as_deref() == Some("Exists");
            let key_ok = match tol.key.as_deref().unwrap_or_default() {
                "" => exists,
                k => k == key,
            };
            let effect_ok = tol
                .effect
                .as_deref()
                .is_none_or(|e| e.is_empty() || e == effect);
            key_ok && exists && effect_ok
        })
    };
    operand_taints(spec)
        .into_iter()
        .filter(|(key, effect)| !tolerated(key, effect))
        .map(|(key, effect)| Toleration {
            key: Some(key),
            operator: Some("Exists".to_owned()),
            effect: Some(effect),
            ..Toleration::default()
        })
        .collect()
}

/// Nodes waiting for their startup taint to come off, for status and metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Waiting {
    pub key: String,
    pub nodes: Vec<(String, Wait)>,
}

/// How many names a status line lists before "and N more".
const LISTED: usize = 5;

fn listed<T>(items: &[T], show: impl Fn(&T) -> String) -> String {
    let mut out: Vec<String> = items.iter().take(LISTED).map(show).collect();
    if items.len() > LISTED {
        out.push(format!("and {} more", items.len() - LISTED));
    }
    out.join(", ")
}

/// The status note on nodes waiting for GPU readiness; `None` when none waits.
pub fn waiting_note(waiting: &Waiting) -> Option<String> {
    if waiting.nodes.is_empty() {
        return None;
    }
    Some(format!(
        "gpuReadiness: {} node(s) keep the startup taint {} until their GPUs are ready: {}",
        waiting.nodes.len(),
        waiting.key,
        listed(&waiting.nodes, |(name, wait)| format!(
            "{name} waits for {wait}"
        ))
    ))
}

/// The status lines of the quarantine: quarantined nodes (why, restarts) and the breaker.
pub fn quarantine_lines(nodes: &[NodeState], breaker: Option<&Breaker>) -> Vec<String> {
    let quarantined: Vec<(&str, &Record)> = nodes
        .iter()
        .filter(|n| n.tainted)
        .filter_map(|n| n.record.as_ref().map(|r| (n.name.as_str(), r)))
        .collect();
    let mut out = Vec::new();
    if !quarantined.is_empty() {
        out.push(format!(
            "gpuReadiness: {} node(s) quarantined (taint {QUARANTINE_TAINT}:{QUARANTINE_EFFECT}), lifted when every GPU is back: {}",
            quarantined.len(),
            listed(&quarantined, |(name, r)| format!(
                "{name} ({}; device plugin restarted {} time(s))",
                r.message, r.restarts
            ))
        ));
    }
    if let Some(b) = breaker {
        out.push(format!(
            "gpuReadiness: {} of {} GPU nodes are unhealthy at once, over the quarantine limit of {} (maxUnhealthyPercent): the signal looks fleet-wide (a driver, device plugin or monitoring problem rather than the GPUs), so no new node is quarantined; held: {}",
            b.unhealthy,
            b.gpu_nodes,
            b.limit,
            listed(&b.held, String::clone)
        ));
    }
    out
}

#[cfg(test)]
#[path = "gpu_readiness_tests.rs"]
mod tests;
