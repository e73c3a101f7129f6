//! The ClusterPolicy pass (IO): its stages, in order, for the policy in force.
//!
//! resolve -> validate -> render -> apply, the label stage beside them, then upgrade -> GPU
//! readiness -> status -> requeue.
//!
//! Guarantees and caveats:
//! - One policy is in force: the oldest decodable one, name breaking ties. Every other policy is a
//!   cheap no-op that only keeps its `ignored` status; while the oldest is being deleted, none is
//!   in force.
//! - Invalid input for one operand freezes that operand (not applied, not pruned) and is reported;
//!   the others proceed (decision 8). Resolve errors prune nothing.
//! - No timer while steady: a pass requeues only while something is not ready, or when a node's
//!   vanished GPU label reaches its grace period.
//! - A policy being deleted gets no operand, label or status writes (decision 17): garbage
//!   collection removes its operands, and re-applying them meanwhile would start and kill driver
//!   pods on every GPU node. A pass that started before the deletion request checks before each
//!   stage that writes ([`still_in_force`]). What the operator put on the nodes is taken off
//!   under the finalizer the policy in force carries ([`teardown`]), unless another policy
//!   takes over; `gpu-operator cleanup` does the same when no operator runs.
//! - A user's change that arrives after the apply stage stops the pass there
//!   (scheduler::Preemption): what follows (observe, upgrade, status) is redone by the next pass.

mod apply;
mod label;
mod labeller;
pub(crate) mod namespace;
mod node_pools;
mod readiness;
mod status;
pub(crate) mod upgrade;

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use kube::core::DeserializeGuard;
use kube::runtime::events::EventType;
use kube::runtime::reflector::Store;
use tokio::sync::Semaphore;

use super::observe::{self, Diagnoser};
use super::owner::{self, Error};
use super::scheduler::{PASS_TIMING, PassOutcome, Preemption, Requeue};
use super::{Deps, resolve};
use crate::api::ClusterPolicy;
use crate::facts::ClusterFacts;
use crate::metrics::ReconciliationStatus;
use crate::model::ValidatedPolicy;
use crate::{render, validate};

/// What the ClusterPolicy passes remember.
#[derive(Default)]
pub struct Memory {
    labels: label::Memory,
    apply: apply::Memory,
    /// The container runtime of each GPU node read so far.
    runtimes: resolve::KnownRuntimes,
    status: status::Memory,
    /// The upgrade stage's last report, standing while the caches show nothing to upgrade.
    last_upgrade: Option<crate::controller::upgrade::Report>,
    /// What the policy in force last validated and resolved.
    rendered: Option<Arc<Rendered>>,
    readiness: readiness::Memory,
}

/// What a policy's pass validated and resolved: the NVIDIADriver pools render from it.
pub struct Rendered {
    /// The policy it was rendered for.
    uid: Option<String>,
    pub validated: ValidatedPolicy,
    pub facts: ClusterFacts,
}

/// What the ClusterPolicy passes tell the scheduler and the other controllers.
pub struct Passed {
    pub outcome: PassOutcome,
    /// The policy in force (also while it is being deleted: a GPUCluster checks it for a
    /// conflict).
    pub active: Option<Arc<ClusterPolicy>>,
    /// What the policy in force last validated and resolved; `None` while it is being deleted
    /// or before its first render. A pass that failed before rendering leaves the previous one.
    pub rendered: Option<Arc<Rendered>>,
}

/// Reconciles every ClusterPolicy: the one in force through its stages, the others to their
/// `ignored` status.
pub async fn reconcile_all(
    deps: &Deps,
    memory: &mut Memory,
    diagnoser: &mut Diagnoser,
    preemption: Preemption,
) -> Passed {
    let mut outcome = PassOutcome::default();
    if deps.policies.is_empty() {
        deps.metrics
            .observe_status(ReconciliationStatus::PolicyUnavailable, 0.0);
    }
    for guard in deps.policies.state() {
        let ran = reconcile_one(&guard, deps, memory, diagnoser, preemption.clone()).await;
        outcome = outcome.and(match ran {
            Ok(Ran::Done(requeue)) => PassOutcome {
                requeue,
                ..PassOutcome::default()
            },
            // The next pass runs at once, and may not give way.
            Ok(Ran::Preempted) => PassOutcome {
                requeue: Some(Duration::ZERO),
                failed: false,
                preempted: true,
            },
            Err(e) => {
                // Counted here, once, for the active and the ignored policies alike.
                deps.metrics.observe_error(e.reason());
                PassOutcome {
                    failed: true,
                    ..PassOutcome::default()
                }
            }
        });
    }
    let active = active_policy(&deps.policies);
    let rendered = match (active.as_deref(), &memory.rendered) {
        (Some(policy), Some(rendered))
            if !is_deleting(policy) && rendered.uid == policy.metadata.uid =>
        {
            Some(rendered.clone())
        }
        _ => None,
    };
    Passed {
        outcome,
        active,
        rendered,
    }
}

/// How a policy's pass ended.
enum Ran {
    /// When to look again.
    Done(Requeue),
    /// It stopped after its apply stage for a user's change.
    Preempted,
}

/// One policy: in force, ignored, being deleted, or undecodable.
async fn reconcile_one(
    guard: &DeserializeGuard<ClusterPolicy>,
    deps: &Deps,
    memory: &mut Memory,
    diagnoser: &mut Diagnoser,
    preemption: Preemption,
) -> Result<Ran, Error> {
    let started = Instant::now();
    let Ok(policy) = guard.0.as_ref() else {
        // An object the API server accepted but we cannot decode (an older or foreign CRD):
        // reported once in the log; nothing to do until it changes.
        if let Err(e) = &guard.0 {
            tracing::error!(error = %e, "ClusterPolicy cannot be decoded; ignoring it until it changes");
        }
        return Ok(Ran::Done(None));
    };
    let name = policy.name_any();
    let now = Time(k8s_openapi::jiff::Timestamp::now());

    let Some(active) = active_policy(&deps.policies) else {
        deps.metrics
            .observe_status(ReconciliationStatus::PolicyUnavailable, 0.0);
        return Ok(Ran::Done(None));
    };
    if is_deleting(policy) && crate::cleanup::has_finalizer(policy) {
        teardown(policy, deps).await?;
    }
    if is_deleting(&active) {
        // Its operands are being collected; the next policy takes over once it is gone.
        deps.metrics
            .observe_status(ReconciliationStatus::PolicyUnavailable, 0.0);
        return Ok(Ran::Done(None));
    }
    if is_deleting(policy) {
        // An ignored policy going away: nothing to write for it.
        return Ok(Ran::Done(None));
    }
    if active.name_any() != name {
        let status = crate::controller::status::ignored(
            &active.name_any(),
            &deps.settings.namespace,
            policy.metadata.generation,
            policy.status.as_ref(),
            now,
        );
        if owner::patch_status(&deps.client, policy, policy.status.as_ref(), &status).await? {
            status::publish(
                deps,
                policy,
                EventType::Warning,
                "Ignored",
                format!(
                    "ClusterPolicy {} is active; this one is ignored",
                    active.name_any()
                ),
            )
            .await;
        }
        return Ok(Ran::Done(None));
    }

    let result = reconcile(policy, deps, memory, diagnoser, now.clone(), preemption).await;
    deps.metrics.observe_reconcile(started.elapsed());
    match result {
        Ok(ran) => Ok(ran),
        Err(e) => {
            tracing::warn!(policy = %name, error = %e, "reconcile failed");
            // Show the failure in status (best effort; the error itself drives the backoff).
            let _ = status::report_failure(policy, deps, &e, now).await;
            Err(e)
        }
    }
}

/// One pass for the policy in force, stage by stage.
///
/// The label stage runs beside resolve -> validate -> render -> apply: the DaemonSets select
/// their nodes by the deploy labels whichever lands first, and a thousand label patches must
/// not hold back the ~60 operand objects (nor the other way round). Until the apply is done
/// the label stage keeps only a couple of patches in flight, so the API server answers the
/// operand objects first. Both work on the same node snapshot.
async fn reconcile(
    policy: &ClusterPolicy,
    deps: &Deps,
    memory: &mut Memory,
    diagnoser: &mut Diagnoser,
    now: Time,
    mut preemption: Preemption,
) -> Result<Ran, Error> {
    let Memory {
        labels,
        apply: applied_memory,
        runtimes,
        status: status_memory,
        last_upgrade,
        rendered,
        readiness: readiness_memory,
    } = memory;
    // Before anything lands on a node: the finalizer that lets a teardown take it off again.
    if !crate::cleanup::has_finalizer(policy) && deps.nvidia.holder().is_none() {
        crate::cleanup::add_finalizer::<ClusterPolicy>(&deps.client, &policy.name_any()).await?;
    }
    let mut watch = Stopwatch::start();
    let nodes = deps.stores.nodes.snapshot();
    watch.lap("snapshot");
    // While the apply writes, the label stage keeps only a few patches in flight: every
    // operand waits on the ~60 objects, and a full flood of node patches made each of their
    // writes ~5x slower at 1,000 nodes. The gate opens fully when the apply is done.
    // Each GPU node's runtime, read before both stages use it: the toolkit renders per flavour
    // and the label stage marks each node's flavour. Nothing is read on a steady fleet.
    runtimes
        .refresh(
            &deps.client,
            &crate::facts::gpu_nodes(&nodes),
            deps.resolver.discovered.openshift,
        )
        .await
        .map_err(Error::Resolve)?;
    let runtimes = &*runtimes;
    let label_gate = Semaphore::new(owner::PATCH_CONCURRENCY);
    let held_for_apply = label_gate.try_acquire_many(label::HELD_FOR_APPLY).ok();
    let resolve_to_apply = async {
        let _held_for_apply = held_for_apply;
        let mut watch = Stopwatch::start();
        let resolved = (deps.resolver)
            .resolve(runtimes, policy, &deps.stores, &nodes)
            .await
            .map_err(Error::Resolve)?;
        watch.lap("resolve");
        let validated = validate::validate(policy, &resolved.facts);
        watch.lap("validate");
        let desired = render::render(&validated, &resolved.facts);
        watch.lap("render");
        *rendered = Some(Arc::new(Rendered {
            uid: policy.metadata.uid.clone(),
            validated: validated.clone(),
            facts: resolved.facts.clone(),
        }));
        if !still_in_force(deps, policy) {
            return Ok(None);
        }
        let applied = apply::apply(policy, deps, applied_memory, &desired).await?;
        watch.lap("apply");
        Ok::<_, Error>(Some((resolved, validated, desired, applied, watch)))
    };
    // Resolving to applying goes first: a user's change reaches its first write before the
    // label stage's walk over every node (which needs no API call when nothing changed, so
    // it would otherwise run to its end before the apply started).
    let (applied, labelled) = tokio::join!(
        biased;
        resolve_to_apply,
        label::label(policy, deps, labels, &nodes, runtimes, &label_gate)
    );
    let mut labelled = labelled?;
    let Some((resolved, validated, desired, applied, apply_watch)) = applied? else {
        return Ok(Ran::Done(None));
    };
    // Resolve-to-apply and the label stage side by side: the longer of the two.
    watch.lap("apply+label");
    label::pools(
        policy,
        deps,
        labels,
        &nodes,
        &validated.by_model,
        &mut labelled,
    )
    .await?;
    watch.lap("pools");
    let rest = async {
        let observed = observe::observe(&deps.client, &deps.stores, diagnoser).await;
        watch.lap("observe");
        let upgrades = upgrade::upgrade(policy, deps, last_upgrade, &observed, &nodes).await?;
        watch.lap("upgrade");
        let ready = readiness::readiness(policy, deps, readiness_memory, &nodes).await;
        watch.lap("readiness");
        let computed = status::compute(
            policy,
            deps,
            status_memory,
            status::Inputs {
                resolved: &resolved,
                validated: &validated,
                desired: &desired,
                applied: &applied,
                nfd_crds_read_only: applied_memory.nfd_crds_read_only,
                labelled: &labelled,
                observed: &observed,
                upgrades: &upgrades,
                readiness: &ready,
                nodes: &nodes,
            },
            now,
        );
        status::report(policy, deps, &computed.status, &nodes, &resolved.facts).await?;
        watch.lap("status");
        tracing::debug!(
            target: PASS_TIMING,
            nodes = nodes.len(),
            render_and_apply = %apply_watch,
            rest = %watch,
            "policy pass"
        );
        // No watch covers OpenShift's driver-toolkit ImageStream (an OpenShift API, read by
        // name): while the policy builds with it, a pass reads it again after a while.
        let polls_image_stream =
            crate::operands::driver_toolkit::requested(&validated.spec, &resolved.facts);
        let again = status::requeue(
            deps,
            &computed,
            &desired,
            &applied,
            &labelled,
            status::Timers {
                upgrading: upgrades.active(),
                polls_image_stream,
                readiness: ready.next_check,
            },
        );
        Ok::<_, Error>(Ran::Done(again))
    };
    // What follows the apply (observe, upgrade, status) is redone by the next pass: a user's
    // change that arrives meanwhile does not wait for it.
    match preemption.unless_user_change(rest).await {
        Some(done) => done,
        None => Ok(Ran::Preempted),
    }
}

/// A deleted policy that carries our finalizer: the nodes and PriorityClasses are cleaned
/// (crate::cleanup), then the finalizer goes. Not while another policy takes over (it manages
/// the nodes next and would put back what came off), nor while NVIDIA's operator is live (it
/// writes the same keys, decision 14): then only the finalizer goes.
async fn teardown(policy: &ClusterPolicy, deps: &Deps) -> Result<(), Error> {
    let name = policy.name_any();
    let successor = deps
        .policies
        .state()
        .iter()
        .filter_map(|g| g.0.as_ref().ok())
        .find(|p| !is_deleting(p) && p.name_any() != name)
        .map(|p| p.name_any());
    if let Some(next) = successor {
        tracing::info!(policy = %name, successor = %next, "teardown: another ClusterPolicy takes over the nodes; they are left as they are");
    } else if let Some(holder) = deps.nvidia.holder() {
        tracing::warn!(policy = %name, nvidia_operator = %holder, "teardown: NVIDIA's operator is live and writes the same node keys; nodes left as they are");
    } else {
        let report =
            crate::cleanup::clean_cluster(&deps.client, crate::cleanup::Leaving::ClusterPolicy)
                .await?;
        tracing::info!(
            policy = %name,
            nodes = report.nodes.len(),
            priority_classes_deleted = ?report.priority_classes_deleted,
            priority_classes_kept = ?report.priority_classes_kept,
            "teardown: the operator's marks are off the nodes"
        );
    }
    crate::cleanup::remove_finalizer::<ClusterPolicy>(&deps.client, &name).await?;
    Ok(())
}

fn is_deleting(policy: &ClusterPolicy) -> bool {
    policy.metadata.deletion_timestamp.is_some()
}

/// Whether `policy` is still in the cache and not being deleted: a pass that started before a
/// deletion request stops before it writes.
fn still_in_force(deps: &Deps, policy: &ClusterPolicy) -> bool {
    owner::still_in_force(&deps.policies, policy)
}

/// The policy that is in force: the oldest decodable one, name breaking ties.
fn active_policy(policies: &Store<DeserializeGuard<ClusterPolicy>>) -> Option<Arc<ClusterPolicy>> {
    let mut all: Vec<ClusterPolicy> = policies
        .state()
        .iter()
        .filter_map(|g| g.0.as_ref().ok().cloned())
        .collect();
    all.sort_by(|a, b| {
        let key = |p: &ClusterPolicy| {
            (
                p.metadata.creation_timestamp.clone().map(|t| t.0),
                p.name_any(),
            )
        };
        key(a).cmp(&key(b))
    });
    all.into_iter().next().map(Arc::new)
}

/// Milliseconds per stage of one pass, for the [`PASS_TIMING`] log.
struct Stopwatch {
    last: Instant,
    laps: Vec<(&'static str, Duration)>,
}

impl Stopwatch {
    fn start() -> Self {
        Stopwatch {
            last: Instant::now(),
            laps: Vec::new(),
        }
    }

    fn lap(&mut self, stage: &'static str) {
        let now = Instant::now();
        self.laps.push((stage, now - self.last));
        self.last = now;
    }
}

impl std::fmt::Display for Stopwatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (stage, took)) in self.laps.iter().enumerate() {
            let sep = if i == 0 { "" } else { " " };
            write!(f, "{sep}{stage}={:.1}ms", took.as_secs_f64() * 1000.0)?;
        }
        Ok(())
    }
}
