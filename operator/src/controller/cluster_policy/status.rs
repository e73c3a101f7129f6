//! Status and requeue stages of the ClusterPolicy pass (IO: the status patch and Events).
//!
//! The status computed from everything the pass found, metrics, the patch when it changed, an Event
//! when the state changed, and when to look again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::Resource;
use kube::runtime::events::{Event, EventType};

use super::label::Labelled;
use crate::api::{ClusterPolicy, ClusterPolicyStatus, State};
use crate::controller::apply::ApplyReport;
use crate::controller::observe::{self, Observed};
use crate::controller::owner::{self, Again, Error};
use crate::controller::resolve::{self, Resolved};
use crate::controller::scheduler::{self, Requeue};
use crate::controller::status::{self as compute_status, StatusInputs};
use crate::controller::{Deps, gpu_cluster, nvidia_driver, upgrade, vendored_crds};
use crate::metrics::ReconciliationStatus;
use crate::model::ValidatedPolicy;
use crate::nodes::NodeView;
use crate::render::{DesiredState, Outcome};

/// What the status stage remembers: since when each DaemonSet's pod count has differed from
/// its labelled nodes.
#[derive(Default)]
pub struct Memory {
    mismatch_since: BTreeMap<String, Instant>,
}

/// What the pass found, for its status.
pub struct Inputs<'a> {
    pub resolved: &'a Resolved,
    pub validated: &'a ValidatedPolicy,
    pub desired: &'a DesiredState,
    pub applied: &'a ApplyReport,
    pub nfd_crds_read_only: bool,
    pub labelled: &'a Labelled,
    pub observed: &'a Observed,
    pub upgrades: &'a upgrade::Report,
    pub readiness: &'a super::readiness::Report,
    pub nodes: &'a [Arc<NodeView>],
}

/// The computed status, and whether a pod count differs from the labelled nodes without an
/// explanation yet (it gets one when the difference lasts).
pub struct Computed {
    pub status: ClusterPolicyStatus,
    unexplained: bool,
}

/// Status stage, the pure half: the policy's status from what the pass found.
pub fn compute(
    policy: &ClusterPolicy,
    deps: &Deps,
    memory: &mut Memory,
    found: Inputs<'_>,
    now: Time,
) -> Computed {
    let Inputs {
        resolved,
        validated,
        desired,
        applied,
        nfd_crds_read_only,
        labelled,
        observed,
        upgrades,
        readiness,
        nodes,
    } = found;
    let mismatched = compute_status::label_mismatches(desired, &observed.daemon_sets, nodes);
    let explained = observe::lasting_mismatches(&mut memory.mismatch_since, &mismatched);
    let notes: Vec<String> = validated
        .notes
        .iter()
        .chain(&resolved.notes)
        .cloned()
        .chain(nfd_crds_read_only.then(|| vendored_crds::READ_ONLY_NOTE.to_owned()))
        .chain(crate::takeover::kept_templates_note(
            observed.daemon_sets.values(),
        ))
        .chain(gpu_cluster::policy_note(
            deps.gpu_clusters.as_ref(),
            policy,
            nodes,
        ))
        .chain(nvidia_driver::policy_note(
            policy,
            deps.nvidia_drivers.is_some(),
            nodes,
        ))
        .chain(readiness.note())
        .collect();
    let warnings: Vec<String> = labelled
        .label_loss_warning
        .iter()
        .chain(&readiness.warnings)
        .cloned()
        .collect();
    let unsettled = applied.unsettled();
    let status = compute_status::compute(&StatusInputs {
        failures: &deps
            .resolver
            .discovered
            .coexistence_problems(deps.nvidia.holder().as_deref()),
        config_problems: &validated.reported,
        notes: &notes,
        warnings: &warnings,
        unsupported: &unsupported_lines(&policy.spec),
        labels_in_flight: labelled.in_flight,
        explained: &explained,
        driver_upgrade: upgrades.summary.as_ref(),
        previous: policy.status.as_ref(),
        ..owner::status_inputs(
            policy.metadata.generation,
            &deps.settings.namespace,
            desired,
            observed,
            nodes,
            applied,
            &unsettled,
            now,
        )
    });
    Computed {
        status,
        unexplained: mismatched.len() > explained.len(),
    }
}

/// Status stage, the writing half: metrics, the status patch when it changed, and an event
/// when the state changed.
pub async fn report(
    policy: &ClusterPolicy,
    deps: &Deps,
    status: &ClusterPolicyStatus,
    nodes: &[Arc<NodeView>],
    facts: &crate::facts::ClusterFacts,
) -> Result<(), Error> {
    deps.metrics.observe_state(
        nodes.iter().filter(|n| n.is_gpu_node()).count(),
        status
            .components
            .iter()
            .flatten()
            .filter(|c| c.desired > 0 && c.available == c.desired)
            .count(),
        nodes.iter().filter(|n| n.has_nfd_gpu()).count(),
        crate::operands::driver_toolkit::gauges(&policy.spec, facts),
    );
    let error = compute_status::has_error(status);
    deps.metrics.observe_status(
        match status.state {
            State::Ready => ReconciliationStatus::Success,
            _ if error => ReconciliationStatus::OperatorError,
            _ => ReconciliationStatus::NotReady,
        },
        k8s_openapi::jiff::Timestamp::now().as_millisecond() as f64 / 1000.0,
    );
    let previous_state = policy.status.as_ref().map(|s| s.state);
    if !super::still_in_force(deps, policy) {
        return Ok(());
    }
    if deps.nvidia.holder().is_some() && resolve::says_nvidia_operator_runs(policy.status.as_ref())
    {
        // Standing aside (decision 14): status said so once; NVIDIA's operator writes the
        // same ClusterPolicy's status, and answering each of its writes would be a fight.
        return Ok(());
    }
    owner::patch_status(&deps.client, policy, policy.status.as_ref(), status).await?;
    if previous_state != Some(status.state) {
        let message = status
            .conditions
            .iter()
            .flatten()
            .find(|c| c.type_ == compute_status::READY)
            .map(|c| c.message.clone())
            .unwrap_or_default();
        // A policy that has never been ready is progressing, not failing: a warning then only
        // for what a user must fix.
        let (kind, reason) = match (status.state, previous_state) {
            (State::Ready, _) => (EventType::Normal, "Ready"),
            (_, None) if !error => (EventType::Normal, "Progressing"),
            _ => (EventType::Warning, "NotReady"),
        };
        publish(deps, policy, kind, reason, message).await;
    }
    Ok(())
}

/// A failed pass in the status (its components stay as the last successful pass left them).
pub async fn report_failure(
    policy: &ClusterPolicy,
    deps: &Deps,
    error: &Error,
    now: Time,
) -> Result<(), Error> {
    if !super::still_in_force(deps, policy) {
        return Ok(());
    }
    let mut status = policy.status.clone().unwrap_or_default();
    let unsupported = unsupported_lines(&policy.spec);
    let (desired, observed, applied) = Default::default();
    let failed = compute_status::compute(&StatusInputs {
        failures: &[error.to_string()],
        unsupported: &unsupported,
        previous: policy.status.as_ref(),
        ..owner::status_inputs(
            policy.metadata.generation,
            &deps.settings.namespace,
            &desired,
            &observed,
            &[],
            &applied,
            &[],
            now,
        )
    });
    // Keep the component list of the last successful pass.
    status.state = failed.state;
    status.conditions = failed.conditions;
    status.namespace = failed.namespace;
    owner::patch_status(&deps.client, policy, policy.status.as_ref(), &status).await?;
    Ok(())
}

/// The status lines of what the policy sets and this operator does not act on.
fn unsupported_lines(spec: &crate::api::ClusterPolicySpec) -> Vec<String> {
    spec.unsupported_fields()
        .iter()
        .map(ToString::to_string)
        .collect()
}

/// How soon a pass looks again while a driver upgrade is under way (evictions and pod
/// restarts show in no watch of ours).
const UPGRADE_REQUEUE: Duration = Duration::from_secs(1);

/// How soon a pass reads OpenShift's driver-toolkit ImageStream again (no watch covers it; a
/// GET by name each time).
const IMAGE_STREAM_POLL: Duration = Duration::from_secs(30);

/// What else asks for a later look, without a watch event to wake it.
pub struct Timers {
    /// A node is between driver upgrade states.
    pub upgrading: bool,
    /// The policy builds with OpenShift's driver toolkit, whose ImageStream no watch covers.
    pub polls_image_stream: bool,
    /// GPU readiness: a grace period ends or a device plugin restart is due.
    pub readiness: Option<Instant>,
}

/// Requeue stage: when to look again without a watch event.
pub fn requeue(
    deps: &Deps,
    computed: &Computed,
    desired: &DesiredState,
    applied: &ApplyReport,
    labelled: &Labelled,
    timers: Timers,
) -> Requeue {
    // A node's vanished GPU label reaches its grace period, or the label stage retries.
    let grace = labelled
        .deadline
        .map(|d| d.saturating_duration_since(Instant::now()) + Duration::from_millis(100));
    // A difference not yet explained is looked at again when it would be.
    let unexplained = computed.unexplained.then_some(observe::MISMATCH_GRACE);
    // A node between upgrade states moves on as soon as the cluster shows its last step.
    let upgrading = timers.upgrading.then_some(UPGRADE_REQUEUE);
    Again {
        ready: computed.status.state == State::Ready,
        // An invalid config waits for the user's fix (its ConfigMap or the policy changes).
        waits_for_user: desired
            .operands
            .iter()
            .any(|s| matches!(s.outcome, Outcome::Invalid(_)))
            || !applied.rejected.is_empty(),
        unsettled: !applied.unsettled().is_empty() || labelled.in_flight > 0,
        retry_after: applied.retry_after,
        deadline: [
            grace,
            unexplained,
            upgrading,
            timers.polls_image_stream.then_some(IMAGE_STREAM_POLL),
            timers
                .readiness
                .map(|t| t.saturating_duration_since(Instant::now())),
        ]
        .into_iter()
        .fold(None, scheduler::earliest),
    }
    .requeue(deps.settings.not_ready_requeue)
}

/// An Event on the policy.
pub async fn publish(
    deps: &Deps,
    policy: &ClusterPolicy,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let event = Event {
        type_,
        reason: reason.to_string(),
        note: Some(event_note(note)),
        action: "Reconcile".to_string(),
        secondary: None,
    };
    if let Err(e) = deps.recorder.publish(&event, &policy.object_ref(&())).await {
        tracing::warn!(error = %e, "publishing event failed");
    }
}

/// The API server refuses an Event whose note exceeds 1,024 bytes (a status message listing many
/// nodes can): cut it on a character boundary and say so. The full text stays in status.
fn event_note(note: String) -> String {
    const LIMIT: usize = 1024;
    const MORE: &str = " ... (cut; full text in the policy's status)";
    if note.len() <= LIMIT {
        return note;
    }
    let mut end = LIMIT - MORE.len();
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{MORE}", &note[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_note_over_the_api_limit_is_cut_on_a_character_boundary() {
        let short = "DaemonSet nvidia-driver-daemonset: 3/6 pods ready".to_owned();
        assert_eq!(event_note(short.clone()), short);
        // 'é' is two bytes: the cut must not split one.
        let long = "é".repeat(700);
        let cut = event_note(long);
        assert!(cut.len() <= 1024, "{} bytes", cut.len());
        assert!(cut.ends_with("(cut; full text in the policy's status)"));
        assert!(cut.starts_with("éé"));
    }
}
