//! Status stage (pure): what one pass rendered, applied and observed becomes the policy's
//! status. The controller patches it only when it differs from the stored one.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use super::plan::Rejection;
use crate::api::{ClusterPolicyStatus, ComponentStatus, State};
use crate::model::{Operand, config_hash};
use crate::nodes::NodeView;
use crate::operands::device_plugin;
use crate::render::{DesiredState, Outcome};

pub const READY: &str = "Ready";
pub const ERROR: &str = "Error";
/// Condition naming what the policy sets that this operator does not act on; present only
/// while there is something to name.
pub const UNSUPPORTED: &str = "Unsupported";

/// Why the policy is not ready (condition reasons; stable, used by tests and alerts).
pub mod reason {
    pub const READY: &str = "Ready";
    pub const NO_GPU_NODES: &str = "NoGPUNodes";
    pub const NFD_LABELS_MISSING: &str = "NFDLabelsMissing";
    pub const OPERAND_NOT_READY: &str = "OperandNotReady";
    pub const RECONCILE_FAILED: &str = "ReconcileFailed";
    pub const INVALID_CONFIG: &str = "InvalidConfig";
    pub const OBJECT_REJECTED: &str = "ObjectRejected";
    pub const IGNORED: &str = "Ignored";
    pub const NO_ERROR: &str = "NoError";
    pub const NOT_ACTED_ON: &str = "AcceptedNotActedOn";
}

/// Everything a status is computed from.
pub struct StatusInputs<'a> {
    pub generation: Option<i64>,
    pub namespace: &'a str,
    pub desired: &'a DesiredState,
    pub daemon_sets: &'a BTreeMap<String, DaemonSet>,
    pub deployments: &'a BTreeMap<String, Deployment>,
    pub nodes: &'a [Arc<NodeView>],
    /// Problems found while resolving or applying (reconcile failed when non-empty).
    pub failures: &'a [String],
    /// Invalid configs of operands that still render (with their last good config): reported
    /// like an invalid operand, on its component and in the conditions.
    pub config_problems: &'a BTreeMap<Operand, String>,
    /// Warnings that do not make the policy unready (e.g. "default inferred").
    pub notes: &'a [String],
    /// Warnings shown in the Ready message whatever the state (the label-loss breaker holding
    /// nodes): they matter most while something is not ready.
    pub warnings: &'a [String],
    /// What the policy sets that this operator does not act on, one line per field path
    /// (`ClusterPolicySpec::unsupported_fields`).
    pub unsupported: &'a [String],
    /// Per DaemonSet, a diagnosis of pods that are missing or not ready (from on-demand reads).
    pub diagnoses: &'a BTreeMap<String, String>,
    /// Operands frozen because the API server refused one of their objects.
    pub rejected: &'a BTreeMap<Operand, Rejection>,
    /// Objects (`Kind/namespace/name`) this pass wrote or deleted, or wrote earlier without the
    /// cache showing it yet: the caches do not show their outcome, so nothing about them is
    /// ready yet.
    pub unsettled: &'a [String],
    /// GPU nodes whose label patch the node cache has not shown yet: until it does, the
    /// labelled-node counts are not the truth.
    pub labels_in_flight: usize,
    /// DaemonSets whose pod count has differed from their labelled nodes for a while: only
    /// these are told what usually causes it (see [`label_mismatches`]).
    pub explained: &'a std::collections::BTreeSet<String>,
    /// Driver upgrade progress while automatic upgrades are on: shown on the driver's
    /// components; a failed node makes the driver not ready.
    pub driver_upgrade: Option<&'a super::upgrade::machine::Summary>,
    pub previous: Option<&'a ClusterPolicyStatus>,
    pub now: Time,
}

/// Readiness of one workload with the one-line message status shows.
#[derive(Debug, PartialEq, Eq)]
struct Readiness {
    ready: bool,
    message: String,
}

/// Whether a DaemonSet replaces its pods only when they are deleted (the driver's strategy).
pub fn updates_on_delete(ds: &DaemonSet) -> bool {
    ds.spec
        .as_ref()
        .and_then(|s| s.update_strategy.as_ref())
        .and_then(|u| u.type_.as_deref())
        == Some("OnDelete")
}

/// Decision 11 for a DaemonSet: RollingUpdate is ready when the observed generation caught up
/// and updated = available = desired; OnDelete (the driver) when available = desired, with old
/// pods reported as an upgrade pending. `labelled` is the number of GPU nodes labelled for the
/// operand (`None` for operands without a deploy label, or while node label writes of ours have
/// not reached the cache, when the count would blame the DaemonSet for our own lag).
/// `explain`: the difference has lasted long enough to name its likely causes.
/// `older_metadata`: of the old pods, those the driver upgrade found to differ in labels or
/// annotations only (decision 20): not an upgrade pending, they get them at their next restart.
fn daemonset_readiness(
    ds: &DaemonSet,
    labelled: Option<i32>,
    explain: bool,
    older_metadata: i32,
) -> (ComponentCounts, Readiness) {
    let status = ds.status.clone().unwrap_or_default();
    let counts = ComponentCounts {
        desired: status.desired_number_scheduled,
        updated: status.updated_number_scheduled.unwrap_or(0),
        ready: status.number_ready,
        available: status.number_available.unwrap_or(0),
    };
    let on_delete = updates_on_delete(ds);
    let caught_up = status.observed_generation.unwrap_or(0) >= ds.metadata.generation.unwrap_or(0);
    let mut problems = Vec::new();
    if !caught_up {
        problems.push("rollout not yet observed by the DaemonSet controller".to_string());
    }
    if counts.available < counts.desired {
        problems.push(format!(
            "{} of {} pods not available",
            counts.desired - counts.available,
            counts.desired
        ));
    }
    // Pods of an older template still running. Not `desired - updated`: while the DaemonSet
    // controller is still creating the first pods (thousands of nodes), the pods not yet made
    // are not old ones, and calling that "rolling out" or "upgrade pending" misleads.
    let old_pods = (status.current_number_scheduled - counts.updated).max(0);
    if !on_delete && counts.updated < counts.desired {
        problems.push(if old_pods > 0 {
            format!(
                "rolling out: {} of {} pods updated",
                counts.updated, counts.desired
            )
        } else {
            format!(
                "{} of {} pods created",
                status.current_number_scheduled, counts.desired
            )
        });
    }
    if let Some(labelled) = labelled
        && labelled != counts.desired
    {
        let mut problem = format!(
            "{labelled} nodes labelled for it but the DaemonSet wants {} pods",
            counts.desired
        );
        if explain {
            problem.push_str(" (a taint it does not tolerate, or pod creation failing)");
        }
        problems.push(problem);
    }
    let mut message = if problems.is_empty() {
        format!("{}/{} pods ready", counts.ready, counts.desired)
    } else {
        problems.join("; ")
    };
    let older_metadata = older_metadata.clamp(0, old_pods);
    if on_delete && old_pods > older_metadata {
        message.push_str(&format!(
            "; upgrade pending on {} nodes",
            old_pods - older_metadata
        ));
    }
    if on_delete && older_metadata > 0 {
        message.push_str(&format!(
            "; {older_metadata} pods run with older labels or annotations, which they get at \
             their next restart"
        ));
    }
    (
        counts,
        Readiness {
            ready: problems.is_empty(),
            message,
        },
    )
}

fn deployment_readiness(d: &Deployment) -> (ComponentCounts, Readiness) {
    let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    let status = d.status.clone().unwrap_or_default();
    let counts = ComponentCounts {
        desired: want,
        updated: status.updated_replicas.unwrap_or(0),
        ready: status.ready_replicas.unwrap_or(0),
        available: status.available_replicas.unwrap_or(0),
    };
    let caught_up = status.observed_generation.unwrap_or(0) >= d.metadata.generation.unwrap_or(0);
    let ready = caught_up && counts.updated == want && counts.available == want;
    let message = format!("{}/{} replicas available", counts.available, want);
    (counts, Readiness { ready, message })
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct ComponentCounts {
    desired: i32,
    updated: i32,
    ready: i32,
    available: i32,
}

/// A condition of a status with no previous one (an NVIDIADriver's `disabled`).
pub fn condition_now(
    kind: &str,
    ok: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
    now: Time,
) -> Condition {
    condition(kind, ok, reason, message, generation, None, &now)
}

fn condition(
    kind: &str,
    ok: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
    previous: Option<&ClusterPolicyStatus>,
    now: &Time,
) -> Condition {
    let status = if ok { "True" } else { "False" }.to_string();
    let last = previous
        .and_then(|p| p.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == kind))
        .filter(|c| c.status == status)
        .map(|c| c.last_transition_time.clone());
    Condition {
        type_: kind.to_string(),
        status,
        reason: reason.to_string(),
        message,
        observed_generation: generation,
        last_transition_time: last.unwrap_or_else(|| now.clone()),
    }
}

/// Whether `node` is a GPU node for `operand`: marked by the ClusterPolicy's labeller
/// (`gpu.present`), or, for a GPUCluster's operands, found by NFD, as the GPUCluster's
/// labeller decides (no ClusterPolicy need run to mark it).
fn gpu_node_for(operand: Operand, node: &NodeView) -> bool {
    node.is_gpu_node() || (Operand::GPU_CLUSTER.contains(&operand) && node.has_nfd_gpu())
}

/// GPU nodes labelled for `operand` (`None` for operands without a deploy label).
fn labelled_for_operand(operand: Operand, nodes: &[Arc<NodeView>]) -> Option<i32> {
    operand.deploy_label().map(|_| {
        nodes
            .iter()
            .filter(|n| gpu_node_for(operand, n) && operand.runs_on(n))
            .count() as i32
    })
}

/// GPU nodes that carry every label the rendered DaemonSet selects on (the deploy label, and
/// e.g. mps.capable for the MPS daemon).
fn labelled_for_daemonset(
    operand: Operand,
    ds: &DaemonSet,
    nodes: &[Arc<NodeView>],
) -> Option<i32> {
    let labelled = labelled_for_operand(operand, nodes)?;
    let selector = ds
        .spec
        .as_ref()?
        .template
        .spec
        .as_ref()?
        .node_selector
        .as_ref();
    Some(match selector {
        Some(selector) => nodes
            .iter()
            .filter(|n| gpu_node_for(operand, n) && n.matches(selector) && affinity_allows(ds, n))
            .count() as i32,
        None => labelled,
    })
}

/// Whether the DaemonSet's required node affinity admits `node` (the ClusterPolicy's driver
/// keeps off NVIDIADriver pools that way). Only the operators our renders use are evaluated;
/// any other admits.
fn affinity_allows(ds: &DaemonSet, node: &NodeView) -> bool {
    let Some(required) = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.affinity.as_ref())
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
    else {
        return true;
    };
    required.node_selector_terms.iter().any(|term| {
        term.match_expressions.iter().flatten().all(|e| {
            let value = node.labels.get(&e.key);
            let values = e.values.clone().unwrap_or_default();
            match e.operator.as_str() {
                "Exists" => value.is_some(),
                "DoesNotExist" => value.is_none(),
                "In" => value.is_some_and(|v| values.contains(v)),
                "NotIn" => value.is_none_or(|v| !values.contains(v)),
                _ => true,
            }
        })
    })
}

/// The rendered DaemonSets whose live pod count differs from the GPU nodes labelled for them.
/// The DaemonSet controller follows node labels within moments, so only a difference that
/// persists says something about the DaemonSet (the controller tracks for how long).
pub fn label_mismatches(
    desired: &DesiredState,
    daemon_sets: &BTreeMap<String, DaemonSet>,
    nodes: &[Arc<NodeView>],
) -> std::collections::BTreeSet<String> {
    let mut mismatched = std::collections::BTreeSet::new();
    for state in &desired.operands {
        let Outcome::Rendered(objects) = &state.outcome else {
            continue;
        };
        for rendered in &objects.daemon_sets {
            let name = rendered.metadata.name.clone().unwrap_or_default();
            let live = daemon_sets
                .get(&name)
                .and_then(|d| d.status.as_ref())
                .map(|s| s.desired_number_scheduled);
            let labelled = labelled_for_daemonset(state.operand, rendered, nodes);
            if labelled.is_some() && live.is_some() && labelled != live {
                mismatched.insert(name);
            }
        }
    }
    mismatched
}

/// The status of the active policy.
pub fn compute(inputs: &StatusInputs<'_>) -> ClusterPolicyStatus {
    let gpu_nodes = inputs.nodes.iter().filter(|n| n.is_gpu_node()).count();
    let nfd_nodes = inputs.nodes.iter().filter(|n| n.has_nfd_gpu()).count();
    let mut components = Vec::new();
    let mut not_ready = Vec::new();
    let mut invalid = Vec::new();
    let mut frozen = Vec::new();
    // Workloads of enabled operands, and how many of them are ready (`kubectl get` shows both).
    let (mut enabled_workloads, mut ready_workloads) = (0, 0);

    for state in &inputs.desired.operands {
        let operand = state.operand;
        let labelled = labelled_for_operand(operand, inputs.nodes);
        let rejected = inputs.rejected.get(&operand);
        if let Some(rejection) = rejected {
            frozen.push(format!(
                "{}: {rejection}; its live objects are kept as they were",
                operand.name()
            ));
        }
        match &state.outcome {
            Outcome::Disabled => {}
            Outcome::Invalid(message) => {
                enabled_workloads += 1;
                invalid.push(format!("{}: {message}", operand.name()));
                components.push(ComponentStatus {
                    name: operand.name().to_string(),
                    labeled_nodes: labelled.unwrap_or(0),
                    message: Some(format!(
                        "invalid configuration, live objects kept as they were: {message}"
                    )),
                    ..ComponentStatus::default()
                });
            }
            Outcome::Rendered(objects) => {
                let workloads = objects
                    .daemon_sets
                    .iter()
                    .filter_map(|d| d.metadata.name.clone())
                    .map(|n| (n, true))
                    .chain(
                        objects
                            .deployments
                            .iter()
                            .filter_map(|d| d.metadata.name.clone())
                            .map(|n| (n, false)),
                    );
                let config_problem = inputs.config_problems.get(&operand);
                if let Some(problem) = config_problem {
                    invalid.push(format!("{}: {problem}", operand.name()));
                }
                for (name, is_daemonset) in workloads {
                    let rendered_ds = objects
                        .daemon_sets
                        .iter()
                        .find(|d| d.metadata.name.as_deref() == Some(name.as_str()));
                    let hash = rendered_ds.and_then(config_hash).map(str::to_owned);
                    let labelled = match rendered_ds {
                        _ if inputs.labels_in_flight > 0 => None,
                        Some(ds) => labelled_for_daemonset(operand, ds, inputs.nodes),
                        None => labelled,
                    };
                    let observed = if is_daemonset {
                        let older_metadata = inputs
                            .driver_upgrade
                            .and_then(|u| u.older_metadata.get(&name))
                            .map_or(0, |n| i32::try_from(*n).unwrap_or(i32::MAX));
                        inputs.daemon_sets.get(&name).map(|ds| {
                            daemonset_readiness(
                                ds,
                                labelled,
                                inputs.explained.contains(&name),
                                older_metadata,
                            )
                        })
                    } else {
                        inputs.deployments.get(&name).map(deployment_readiness)
                    };
                    let (counts, mut readiness) = observed.unwrap_or_else(|| {
                        (
                            ComponentCounts::default(),
                            Readiness {
                                ready: false,
                                message: "not created yet".to_string(),
                            },
                        )
                    });
                    if let Some(diagnosis) = inputs.diagnoses.get(&name) {
                        readiness.message.push_str(&format!(" ({diagnosis})"));
                    }
                    let kind = if is_daemonset {
                        "DaemonSet"
                    } else {
                        "Deployment"
                    };
                    let key = format!("{kind}/{}/{name}", inputs.namespace);
                    if inputs.unsettled.contains(&key) {
                        readiness.ready = false;
                        readiness.message =
                            format!("change applied, waiting for the {kind} controller");
                    }
                    if let Some(rejection) = rejected {
                        readiness.ready = false;
                        readiness.message = format!("frozen: {rejection}; {}", readiness.message);
                    }
                    // The sharing config in effect, and the rollout towards it.
                    if let Some((copy, default_key)) =
                        rendered_ds.and_then(device_plugin::mounted_copy)
                    {
                        readiness
                            .message
                            .push_str(&format!("; config {copy} (default key {default_key:?})"));
                    }
                    if let Some(problem) = config_problem {
                        readiness.message =
                            format!("invalid configuration: {problem}; {}", readiness.message);
                    }
                    if let Some(upgrade) = inputs
                        .driver_upgrade
                        .filter(|_| operand == Operand::Driver && is_daemonset)
                    {
                        readiness
                            .message
                            .push_str(&format!("; driver upgrade: {}", upgrade.line()));
                        // A held node keeps an old driver until someone changes the image.
                        readiness.ready &= upgrade.failed.is_empty() && upgrade.held.is_empty();
                    }
                    enabled_workloads += 1;
                    if readiness.ready {
                        ready_workloads += 1;
                    } else {
                        not_ready.push(format!("{}: {}", operand.name(), readiness.message));
                    }
                    components.push(ComponentStatus {
                        name: component_name(
                            operand,
                            &name,
                            objects.daemon_sets.len() + objects.deployments.len(),
                        ),
                        daemon_set: is_daemonset.then(|| name.clone()),
                        desired: counts.desired,
                        updated: counts.updated,
                        ready: counts.ready,
                        available: counts.available,
                        labeled_nodes: labelled.unwrap_or(0),
                        config_hash: hash,
                        message: Some(readiness.message),
                    });
                }
            }
        }
    }

    let (ready, reason, message) = if !inputs.failures.is_empty() {
        (false, reason::RECONCILE_FAILED, inputs.failures.join("; "))
    } else if !invalid.is_empty() {
        (false, reason::INVALID_CONFIG, invalid.join("; "))
    } else if !frozen.is_empty() {
        (false, reason::OBJECT_REJECTED, frozen.join("; "))
    } else if nfd_nodes == 0 && gpu_nodes == 0 {
        let has_nfd = inputs.nodes.iter().any(|n| {
            n.labels
                .keys()
                .any(|k| k.starts_with("feature.node.kubernetes.io/"))
        });
        let shortfall = nfd_worker_shortfall(
            inputs.daemon_sets.get(crate::operands::nfd::WORKER),
            inputs.nodes.len(),
        )
        .unwrap_or_default();
        if has_nfd || inputs.nodes.is_empty() {
            (
                false,
                reason::NO_GPU_NODES,
                format!(
                    "no node reports an NVIDIA PCI device (NFD label \
                     feature.node.kubernetes.io/pci-10de.present){shortfall}"
                ),
            )
        } else {
            (
                false,
                reason::NFD_LABELS_MISSING,
                format!(
                    "no node carries NFD labels: is node-feature-discovery running?{shortfall}"
                ),
            )
        }
    } else if inputs.labels_in_flight > 0 {
        (
            false,
            reason::OPERAND_NOT_READY,
            format!(
                "labelling GPU nodes: {} node label writes not yet observed",
                inputs.labels_in_flight
            ),
        )
    } else if !not_ready.is_empty() {
        (false, reason::OPERAND_NOT_READY, not_ready.join("; "))
    } else if !inputs.unsettled.is_empty() {
        (
            false,
            reason::OPERAND_NOT_READY,
            format!(
                "applying: {} objects written or deleted, not yet observed ({})",
                inputs.unsettled.len(),
                first_few(inputs.unsettled, 5)
            ),
        )
    } else {
        let mut m = format!("all operands ready on {gpu_nodes} GPU nodes");
        for note in inputs.notes {
            m.push_str("; ");
            m.push_str(note);
        }
        (true, reason::READY, m)
    };
    let message = inputs
        .warnings
        .iter()
        .fold(message, |m, w| format!("{m}; {w}"));
    let error = !inputs.failures.is_empty() || !invalid.is_empty() || !frozen.is_empty();
    let conditions = vec![
        condition(
            READY,
            ready,
            reason,
            message.clone(),
            inputs.generation,
            inputs.previous,
            &inputs.now,
        ),
        condition(
            ERROR,
            error,
            if error { reason } else { reason::NO_ERROR },
            if error { message } else { String::new() },
            inputs.generation,
            inputs.previous,
            &inputs.now,
        ),
    ];
    let conditions = conditions
        .into_iter()
        .chain(unsupported_condition(
            inputs.unsupported,
            inputs.generation,
            inputs.previous,
            &inputs.now,
        ))
        .collect();
    ClusterPolicyStatus {
        state: if ready { State::Ready } else { State::NotReady },
        namespace: Some(inputs.namespace.to_string()),
        conditions: Some(conditions),
        components: Some(components),
        gpu_nodes: Some(i32::try_from(gpu_nodes).unwrap_or(i32::MAX)),
        operands_ready: Some(format!("{ready_workloads}/{enabled_workloads}")),
    }
}

/// `items` joined with commas, cut after `shown` with the number left out.
fn first_few(items: &[String], shown: usize) -> String {
    let mut text = items
        .iter()
        .take(shown)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if items.len() > shown {
        text.push_str(&format!(" and {} more", items.len() - shown));
    }
    text
}

/// The `Unsupported` condition (status True) listing every field path the policy sets that is
/// not acted on; none when there is nothing to list. It never affects readiness: the operands
/// that are acted on can be ready regardless.
fn unsupported_condition(
    unsupported: &[String],
    generation: Option<i64>,
    previous: Option<&ClusterPolicyStatus>,
    now: &Time,
) -> Option<Condition> {
    (!unsupported.is_empty()).then(|| {
        condition(
            UNSUPPORTED,
            true,
            reason::NOT_ACTED_ON,
            unsupported.join("; "),
            generation,
            previous,
            now,
        )
    })
}

/// One component per workload: the operand's name, or the workload's name when an operand has
/// several (NFD's worker and master).
fn component_name(operand: Operand, workload: &str, workloads: usize) -> String {
    if workloads > 1 {
        format!("{}/{workload}", operand.name())
    } else {
        operand.name().to_string()
    }
}

/// The status of a policy that is not the active one.
pub fn ignored(
    active: &str,
    namespace: &str,
    generation: Option<i64>,
    previous: Option<&ClusterPolicyStatus>,
    now: Time,
) -> ClusterPolicyStatus {
    let message =
        format!("ClusterPolicy {active} is the active one (the oldest); this one is ignored");
    ClusterPolicyStatus {
        state: State::Ignored,
        namespace: Some(namespace.to_string()),
        conditions: Some(vec![
            condition(
                READY,
                false,
                reason::IGNORED,
                message.clone(),
                generation,
                previous,
                &now,
            ),
            condition(
                ERROR,
                true,
                reason::IGNORED,
                message,
                generation,
                previous,
                &now,
            ),
        ]),
        components: None,
        gpu_nodes: None,
        operands_ready: None,
    }
}

/// Whether the status has its Error condition true (something a user must fix).
pub fn has_error(status: &ClusterPolicyStatus) -> bool {
    status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == ERROR && c.status == "True")
}

/// Whether two statuses differ in anything but timestamps that were carried over.
pub fn differs(a: Option<&ClusterPolicyStatus>, b: &ClusterPolicyStatus) -> bool {
    a != Some(b)
}

/// What to add to "no GPU node" when NFD's worker (the operator's) is scheduled on fewer nodes
/// than the cluster has: NFD cannot report a GPU on a node its worker does not run on, and the
/// usual cause is a taint the worker does not tolerate (the doctor names it and the toleration).
fn nfd_worker_shortfall(worker: Option<&DaemonSet>, nodes: usize) -> Option<String> {
    let scheduled = worker?.status.as_ref()?.desired_number_scheduled;
    (usize::try_from(scheduled).ok()? < nodes).then(|| {
        format!(
            "; NFD's worker ({}) runs on {scheduled} of {nodes} nodes: a taint it does not \
             tolerate (or its node affinity) keeps it off the others, so their PCI devices are \
             never reported; `kubectl gpu doctor` names the taint and the toleration to add to \
             spec.nfd.worker.tolerations",
            crate::operands::nfd::WORKER
        )
    })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::apps::v1::{DaemonSetSpec, DaemonSetStatus, DaemonSetUpdateStrategy};
    use kube_core::ObjectMeta;

    use super::*;

    fn ds(strategy: &str, desired: i32, updated: i32, available: i32) -> DaemonSet {
        DaemonSet {
            metadata: ObjectMeta {
                name: Some("x".into()),
                generation: Some(2),
                ..ObjectMeta::default()
            },
            spec: Some(DaemonSetSpec {
                update_strategy: Some(DaemonSetUpdateStrategy {
                    type_: Some(strategy.into()),
                    ..DaemonSetUpdateStrategy::default()
                }),
                ..DaemonSetSpec::default()
            }),
            status: Some(DaemonSetStatus {
                observed_generation: Some(2),
                desired_number_scheduled: desired,
                current_number_scheduled: desired,
                updated_number_scheduled: Some(updated),
                number_available: Some(available),
                number_ready: available,
                ..DaemonSetStatus::default()
            }),
        }
    }

    #[test]
    fn a_gpu_cluster_operand_counts_nfd_found_gpu_nodes_that_no_cluster_policy_marked() {
        let node = |labels: &[(&str, &str)]| {
            let labels = labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
            Arc::new(NodeView::from_labels("n", None, &labels))
        };
        let nfd_only = node(&[
            (crate::nodes::NFD_GPU_LABELS[0], "true"),
            (crate::nodes::DEPLOY_DRA_VALIDATOR, "true"),
            (crate::nodes::DEPLOY_VALIDATOR, "true"),
        ]);
        let nodes = [nfd_only];
        assert_eq!(labelled_for_operand(Operand::DraValidator, &nodes), Some(1));
        // A ClusterPolicy's operand counts only the nodes its labeller marked.
        assert_eq!(labelled_for_operand(Operand::Validator, &nodes), Some(0));
    }

    #[test]
    fn no_gpu_node_says_when_nfds_worker_is_kept_off_nodes() {
        let worker = ds("RollingUpdate", 2, 2, 2);
        let hint = nfd_worker_shortfall(Some(&worker), 3).unwrap();
        assert!(
            hint.contains("runs on 2 of 3 nodes: a taint it does not tolerate")
                && hint.contains("spec.nfd.worker.tolerations"),
            "{hint}"
        );
        assert_eq!(nfd_worker_shortfall(Some(&worker), 2), None);
        assert_eq!(nfd_worker_shortfall(None, 3), None);
    }

    #[test]
    fn unsupported_condition_names_every_path_and_is_absent_when_there_is_none() {
        let now = Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
        assert_eq!(unsupported_condition(&[], Some(1), None, &now), None);
        let lines = [
            "spec.vgpuManager is accepted but not acted on by this operator (enabled, but this operator \
             does not deploy it)"
                .to_owned(),
            "spec.driver.livenessProbe is accepted but not acted on by this \
             operator (the driver container keeps its built-in liveness probe)"
                .to_owned(),
        ];
        let c = unsupported_condition(&lines, Some(4), None, &now).unwrap();
        assert_eq!(
            (c.type_.as_str(), c.status.as_str(), c.reason.as_str()),
            (UNSUPPORTED, "True", reason::NOT_ACTED_ON)
        );
        assert_eq!(c.observed_generation, Some(4));
        assert!(
            c.message.contains("spec.vgpuManager is accepted"),
            "{}",
            c.message
        );
        assert!(
            c.message.contains("; spec.driver.livenessProbe"),
            "{}",
            c.message
        );
    }

    #[test]
    fn rolling_update_daemonset_is_ready_only_when_updated_and_available_match_desired() {
        assert!(
            daemonset_readiness(&ds("RollingUpdate", 3, 3, 3), Some(3), false, 0)
                .1
                .ready
        );
        assert!(
            !daemonset_readiness(&ds("RollingUpdate", 3, 2, 3), Some(3), false, 0)
                .1
                .ready
        );
        let (_, r) = daemonset_readiness(&ds("RollingUpdate", 3, 3, 2), Some(3), false, 0);
        assert!(!r.ready);
        assert_eq!(r.message, "1 of 3 pods not available");
    }

    #[test]
    fn on_delete_driver_with_old_pods_is_ready_with_upgrade_pending() {
        let (_, r) = daemonset_readiness(&ds("OnDelete", 3, 1, 3), Some(3), false, 0);
        assert!(r.ready);
        assert_eq!(r.message, "3/3 pods ready; upgrade pending on 2 nodes");
    }

    #[test]
    fn driver_pods_differing_in_metadata_only_are_no_pending_upgrade_and_status_says_so() {
        let (_, r) = daemonset_readiness(&ds("OnDelete", 3, 0, 3), Some(3), false, 2);
        assert!(r.ready);
        assert_eq!(
            r.message,
            "3/3 pods ready; upgrade pending on 1 nodes; 2 pods run with older labels or \
             annotations, which they get at their next restart"
        );
    }

    #[test]
    fn pods_not_yet_created_are_neither_a_rollout_nor_a_pending_upgrade() {
        // The DaemonSet controller has made 3,510 of 4,608 pods of the first template.
        let mut d = ds("RollingUpdate", 4608, 3510, 3000);
        d.status.as_mut().unwrap().current_number_scheduled = 3510;
        let (_, r) = daemonset_readiness(&d, None, false, 0);
        assert!(!r.ready);
        assert_eq!(
            r.message,
            "1608 of 4608 pods not available; 3510 of 4608 pods created"
        );
        let mut d = ds("OnDelete", 4608, 3510, 3510);
        d.status.as_mut().unwrap().current_number_scheduled = 3510;
        let (_, r) = daemonset_readiness(&d, None, false, 0);
        assert!(!r.message.contains("upgrade pending"), "{}", r.message);
        // Once old pods exist, both say so.
        let (_, r) = daemonset_readiness(&ds("RollingUpdate", 3, 1, 3), None, false, 0);
        assert_eq!(r.message, "rolling out: 1 of 3 pods updated");
    }

    #[test]
    fn fewer_pods_than_labelled_nodes_is_reported_and_explained_once_it_persists() {
        let (_, r) = daemonset_readiness(&ds("RollingUpdate", 2, 2, 2), Some(3), false, 0);
        assert!(!r.ready);
        assert_eq!(
            r.message,
            "3 nodes labelled for it but the DaemonSet wants 2 pods"
        );
        let (_, r) = daemonset_readiness(&ds("RollingUpdate", 2, 2, 2), Some(3), true, 0);
        assert!(
            r.message
                .ends_with("(a taint it does not tolerate, or pod creation failing)")
        );
    }

    #[test]
    fn unobserved_generation_is_not_ready() {
        let mut d = ds("RollingUpdate", 3, 3, 3);
        d.metadata.generation = Some(3);
        assert!(!daemonset_readiness(&d, None, false, 0).1.ready);
    }

    #[test]
    fn transition_time_is_kept_while_a_condition_holds() {
        let t0 = Time(k8s_openapi::jiff::Timestamp::from_second(1).unwrap());
        let t1 = Time(k8s_openapi::jiff::Timestamp::from_second(2).unwrap());
        let first = ignored("a", "ns", Some(1), None, t0.clone());
        let second = ignored("a", "ns", Some(1), Some(&first), t1);
        assert!(!differs(Some(&first), &second));
        assert_eq!(second.conditions.unwrap()[0].last_transition_time, t0);
    }
}
