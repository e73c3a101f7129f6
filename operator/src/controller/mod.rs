//! The controller (IO): one kube-runtime controller over `ClusterPolicy` whose reconcile is the
//! pipeline resolve -> validate -> render -> apply -> status.
//!
//! Guarantees and caveats:
//! - One loop, one pass at a time: every watch of decision 10 (policies included) feeds one
//!   trigger stream; bursts are coalesced and each wake-up reconciles every policy in turn. The
//!   singleton rule makes every policy but the oldest a cheap no-op that only keeps its
//!   `ignored` status. There is a single key, so kube-runtime's `Controller` (per-object queues,
//!   and `owns`, which keys a cluster-scoped owner with the child's namespace and could run the
//!   active policy twice at once) buys nothing here; its watchers and reflectors do the caching.
//! - The reconcile reads caches, never lists: stores are awaited before the first pass so a
//!   restart with nothing changed writes nothing (decision 9).
//! - Invalid input for one operand freezes that operand (not applied, not pruned) and is
//!   reported; the others proceed (decision 8). Resolve errors prune nothing.
//! - No timer while steady: a pass requeues only while something is not ready, or when a node's
//!   vanished GPU label reaches its grace period.
//! - A policy being deleted gets no writes at all, not even status (decision 17): garbage
//!   collection removes its operands, and re-applying them meanwhile would start and kill
//!   driver pods on every GPU node. While the oldest policy is being deleted, no policy is
//!   active.

mod apply;
pub mod coexist;
mod gpu_cluster;
mod labeller;
mod namespace;
pub mod nfd_crds;
mod node_pools;
mod nvidia_driver;
mod observe;
mod owner;
mod resolve;
pub mod scheduler;
pub mod stores;
pub mod upgrade;

pub use gpu_operator_engine::{plan, status};

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use tokio::sync::Semaphore;

pub use owner::Error;
use owner::{Again, Owner};
pub use plan::{APPLIED_HASH_ANNOTATION, applied_hash, is_subset};
use resolve::{Discovered, Resolver};
use scheduler::{AbortOnDrop, PASS_TIMING, PassOutcome, Preemption, Requeue};
use stores::{Stores, Wake};

use crate::api::{ClusterPolicy, ClusterPolicyStatus, State};
use crate::metrics::{Metrics, ReconciliationStatus};
use crate::nodes::GpuLabelLoss;
use crate::render::{self, Outcome};
use crate::validate;

/// Settings of `gpu-operator run` that the reconcile uses.
#[derive(Clone, Debug)]
pub struct Settings {
    pub namespace: String,
    /// How long a node's NFD GPU label must stay gone before the node is unmarked.
    pub gpu_label_grace: Duration,
    /// Requeue interval while something is not ready.
    pub not_ready_requeue: Duration,
    /// The longest one pass may run: past it, the pass is abandoned (its requests cancelled)
    /// and retried with backoff.
    pub pass_deadline: Duration,
}

/// What every pass reads and none changes: clients, settings, caches and the machinery around
/// them.
struct Deps {
    client: Client,
    settings: Settings,
    stores: Stores,
    policies: Store<DeserializeGuard<ClusterPolicy>>,
    /// GPUClusters, `None` when their CRD is not served.
    gpu_clusters: Option<Store<DeserializeGuard<crate::api::GPUCluster>>>,
    /// NVIDIADrivers, `None` when their CRD is not served.
    nvidia_drivers: Option<Store<DeserializeGuard<crate::api::NVIDIADriver>>>,
    resolver: Resolver,
    /// The image environment GPUClusters and NVIDIADrivers resolve their images from.
    image_env: BTreeMap<String, String>,
    /// Whether NVIDIA's operator is live now (controller::coexist).
    nvidia: coexist::NvidiaOperator,
    recorder: Recorder,
    metrics: Metrics,
}

/// What the passes remember from one to the next: owned by the scheduler, lent to each pass.
#[derive(Default)]
struct PassState {
    policy: PolicyMemory,
    gpu_cluster: gpu_cluster::Memory,
    nvidia_driver: nvidia_driver::Memory,
    /// When the pods of a not-ready DaemonSet are listed: one for the three controllers, which
    /// observe the same DaemonSets.
    diagnoser: observe::Diagnoser,
}

/// What the ClusterPolicy passes remember.
#[derive(Default)]
struct PolicyMemory {
    labels: LabelMemory,
    apply: ApplyMemory,
    /// The container runtime of each GPU node read so far.
    runtimes: resolve::KnownRuntimes,
    /// Since when each DaemonSet's pod count has differed from its labelled nodes.
    mismatch_since: BTreeMap<String, Instant>,
    /// The upgrade stage's last report, standing while the caches show nothing to upgrade.
    last_upgrade: Option<upgrade::Report>,
    /// What the active policy's last pass validated and resolved: the NVIDIADriver pools
    /// render from it.
    rendered: Option<Arc<PolicyPass>>,
}

/// What the label stage remembers.
#[derive(Default)]
struct LabelMemory {
    loss: GpuLabelLoss,
    attempts: owner::LabelAttempts,
    pool_attempts: owner::LabelAttempts,
    priority_classes: node_pools::PriorityClassesDone,
}

/// What the apply stage remembers.
#[derive(Default)]
struct ApplyMemory {
    ledger: plan::Ledger,
    /// Whether NFD's CRDs were found or made current since the operator started.
    nfd_crds_current: bool,
    /// NFD's CRDs are installed by someone else (OLM) and not writable by us.
    nfd_crds_read_only: bool,
}

/// The active policy's validated form and facts from its last pass.
struct PolicyPass {
    uid: Option<String>,
    validated: crate::model::ValidatedPolicy,
    facts: crate::facts::ClusterFacts,
}

fn is_deleting(policy: &ClusterPolicy) -> bool {
    policy.metadata.deletion_timestamp.is_some()
}

/// Whether `policy` is still in the cache and not being deleted: a pass that started before a
/// deletion request stops before it writes.
fn still_in_force(ctx: &Deps, policy: &ClusterPolicy) -> bool {
    owner::still_in_force(&ctx.policies, policy)
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

/// How a policy's pass ended.
enum Ran {
    /// When to look again.
    Done(Requeue),
    /// It stopped after its apply stage for a user's change ([`Preemption`]).
    Preempted,
}

async fn reconcile(
    guard: &DeserializeGuard<ClusterPolicy>,
    ctx: &Deps,
    memory: &mut PolicyMemory,
    diagnoser: &mut observe::Diagnoser,
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

    let Some(active) = active_policy(&ctx.policies) else {
        ctx.metrics
            .observe_status(ReconciliationStatus::PolicyUnavailable, 0.0);
        return Ok(Ran::Done(None));
    };
    if is_deleting(&active) {
        // Its operands are being collected; the next policy takes over once it is gone.
        ctx.metrics
            .observe_status(ReconciliationStatus::PolicyUnavailable, 0.0);
        return Ok(Ran::Done(None));
    }
    if is_deleting(policy) {
        // An ignored policy going away: nothing to write for it.
        return Ok(Ran::Done(None));
    }
    if active.name_any() != name {
        let status = status::ignored(
            &active.name_any(),
            &ctx.settings.namespace,
            policy.metadata.generation,
            policy.status.as_ref(),
            now,
        );
        if owner::patch_status(&ctx.client, policy, policy.status.as_ref(), &status).await? {
            publish(
                ctx,
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

    let result = run_pass(policy, ctx, memory, diagnoser, now.clone(), preemption).await;
    ctx.metrics.observe_reconcile(started.elapsed());
    match result {
        Ok(action) => Ok(action),
        Err(e) => {
            tracing::warn!(policy = %name, error = %e, "reconcile failed");
            // Show the failure in status (best effort; the error itself drives the backoff).
            let _ = report_failure(policy, ctx, &e, now).await;
            Err(e)
        }
    }
}

async fn report_failure(
    policy: &ClusterPolicy,
    ctx: &Deps,
    error: &Error,
    now: Time,
) -> Result<(), Error> {
    if !still_in_force(ctx, policy) {
        return Ok(());
    }
    let mut status = policy.status.clone().unwrap_or_default();
    let unsupported = unsupported_lines(&policy.spec);
    let (desired, observed, applied) = Default::default();
    let failed = status::compute(&status::StatusInputs {
        failures: &[error.to_string()],
        unsupported: &unsupported,
        previous: policy.status.as_ref(),
        ..owner::status_inputs(
            policy.metadata.generation,
            &ctx.settings.namespace,
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
    owner::patch_status(&ctx.client, policy, policy.status.as_ref(), &status).await?;
    Ok(())
}

/// The layout MIG-capable nodes without a `nvidia.com/mig.config` label get (decision 7):
/// `all-disabled` while mig-manager is on and `migManager.config.default` is `all-disabled`
/// (its default).
fn mig_default_layout(spec: &crate::api::ClusterPolicySpec) -> Option<&'static str> {
    use crate::api::{Component, MigDefault};
    let default = spec
        .mig_manager
        .as_ref()
        .and_then(|m| m.config.as_ref())
        .and_then(|c| c.default)
        .unwrap_or(MigDefault::AllDisabled);
    (spec.is_enabled(Component::MigManager) && default == MigDefault::AllDisabled)
        .then_some("all-disabled")
}

/// The status lines of what the policy sets and this operator does not act on.
fn unsupported_lines(spec: &crate::api::ClusterPolicySpec) -> Vec<String> {
    spec.unsupported_fields()
        .iter()
        .map(ToString::to_string)
        .collect()
}

/// One pass for the active policy: the pipeline label -> resolve -> validate -> render -> apply
/// -> observe -> status, each stage a function of its own module.
///
/// Labelling and applying run side by side: the DaemonSets select their nodes by the deploy
/// labels whichever lands first, and a thousand label patches must not hold back the ~60
/// operand objects (nor the other way round). Until the apply is done the label stage keeps
/// only a couple of patches in flight, so the API server answers the operand objects first.
/// Both work on the same node snapshot.
async fn run_pass(
    policy: &ClusterPolicy,
    ctx: &Deps,
    memory: &mut PolicyMemory,
    diagnoser: &mut observe::Diagnoser,
    now: Time,
    mut preemption: Preemption,
) -> Result<Ran, Error> {
    let PolicyMemory {
        labels,
        apply: apply_memory,
        runtimes,
        mismatch_since,
        last_upgrade,
        rendered,
    } = memory;
    let mut watch = Stopwatch::start();
    let nodes = ctx.stores.nodes.snapshot();
    watch.lap("snapshot");
    ensure_namespace(policy, ctx).await?;
    watch.lap("namespace");
    // While the apply writes, the label stage keeps only a few patches in flight: every
    // operand waits on the ~60 objects, and a full flood of node patches made each of their
    // writes ~5x slower at 1,000 nodes. The gate opens fully when the apply is done.
    let label_gate = Semaphore::new(owner::PATCH_CONCURRENCY);
    let held_for_apply = label_gate.try_acquire_many(labeller::HELD_FOR_APPLY).ok();
    let render_and_apply = async {
        let _held_for_apply = held_for_apply;
        let mut watch = Stopwatch::start();
        let resolved = (ctx.resolver)
            .resolve(runtimes, policy, &ctx.stores, &nodes)
            .await
            .map_err(Error::Resolve)?;
        watch.lap("resolve");
        let validated = validate::validate(policy, &resolved.facts);
        watch.lap("validate");
        let desired = render::render(&validated, &resolved.facts);
        watch.lap("render");
        *rendered = Some(Arc::new(PolicyPass {
            uid: policy.metadata.uid.clone(),
            validated: validated.clone(),
            facts: resolved.facts.clone(),
        }));
        if !still_in_force(ctx, policy) {
            return Ok(None);
        }
        let applied = apply(policy, ctx, apply_memory, &desired).await?;
        watch.lap("apply");
        Ok::<_, Error>(Some((resolved, validated, desired, applied, watch)))
    };
    // Rendering and applying go first: a user's change reaches its first write before the
    // label stage's walk over every node (which needs no API call when nothing changed, so
    // it would otherwise run to its end before the apply started).
    let (applied, labelled) = tokio::join!(
        biased;
        render_and_apply,
        label(policy, ctx, labels, &nodes, &label_gate)
    );
    let labelled = labelled?;
    let Some((resolved, validated, desired, applied, apply_watch)) = applied? else {
        return Ok(Ran::Done(None));
    };
    // Render-and-apply and the label stage side by side: the longer of the two.
    watch.lap("apply+label");
    let rest = async {
        let observed = observe::observe(&ctx.client, &ctx.stores, diagnoser).await;
        watch.lap("observe");
        let upgrades = upgrade_drivers(policy, ctx, last_upgrade, &observed, &nodes).await?;
        watch.lap("upgrade");
        let mismatched = status::label_mismatches(&desired, &observed.daemon_sets, &nodes);
        let explained = observe::lasting_mismatches(mismatch_since, &mismatched);
        let notes: Vec<String> = validated
            .notes
            .iter()
            .chain(&resolved.notes)
            .cloned()
            .chain(
                apply_memory
                    .nfd_crds_read_only
                    .then(|| nfd_crds::READ_ONLY_NOTE.to_owned()),
            )
            .chain(gpu_cluster::policy_note(
                ctx.gpu_clusters.as_ref(),
                policy,
                &nodes,
            ))
            .chain(nvidia_driver::policy_note(
                policy,
                ctx.nvidia_drivers.is_some(),
                &nodes,
            ))
            .collect();
        let unsettled = applied.unsettled();
        let status = status::compute(&status::StatusInputs {
            failures: &ctx
                .resolver
                .discovered
                .coexistence_problems(ctx.nvidia.holder().as_deref()),
            config_problems: &validated.reported,
            notes: &notes,
            warnings: labelled.label_loss_warning.as_slice(),
            unsupported: &unsupported_lines(&policy.spec),
            labels_in_flight: labelled.in_flight,
            explained: &explained,
            driver_upgrade: upgrades.summary.as_ref(),
            previous: policy.status.as_ref(),
            ..owner::status_inputs(
                policy.metadata.generation,
                &ctx.settings.namespace,
                &desired,
                &observed,
                &nodes,
                &applied,
                &unsettled,
                now,
            )
        });
        report_status(policy, ctx, &status, &nodes).await?;
        watch.lap("status");
        tracing::debug!(
            target: PASS_TIMING,
            nodes = nodes.len(),
            render_and_apply = %apply_watch,
            rest = %watch,
            "policy pass"
        );
        let again = requeue(
            ctx,
            &status,
            &desired,
            &applied,
            &labelled,
            mismatched.len() > explained.len(),
        );
        // A node between upgrade states moves on as soon as the cluster shows its last step.
        let upgrading = upgrades.active().then_some(UPGRADE_REQUEUE);
        Ok::<_, Error>(Ran::Done(again.into_iter().chain(upgrading).min()))
    };
    // What follows the apply (observe, upgrade, status) is redone by the next pass: a user's
    // change that arrives meanwhile does not wait for it.
    match preemption.unless_user_change(rest).await {
        Some(done) => done,
        None => Ok(Ran::Preempted),
    }
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

/// How soon a pass looks again while a driver upgrade is under way (evictions and pod
/// restarts show in no watch of ours).
const UPGRADE_REQUEUE: Duration = Duration::from_secs(1);

/// Upgrade stage: the driver upgrade state machine (controller::upgrade), and its gauges. With
/// NVIDIA's operator live, or the policy being deleted, it changes nothing.
async fn upgrade_drivers(
    policy: &ClusterPolicy,
    ctx: &Deps,
    last_upgrade: &mut Option<upgrade::Report>,
    observed: &observe::Observed,
    nodes: &[Arc<crate::nodes::NodeView>],
) -> Result<upgrade::Report, Error> {
    if ctx.nvidia.holder().is_some() || !still_in_force(ctx, policy) {
        return Ok(upgrade::Report::default());
    }
    // Nothing to upgrade by the caches: the last report stands, without the stage's reads.
    if upgrade::enabled(&policy.spec)
        && upgrade::quiet(&observed.daemon_sets, nodes)
        && let Some(last) = last_upgrade.as_ref()
        && !last.active()
    {
        return Ok(last.clone());
    }
    let report = upgrade::reconcile(
        &ctx.client,
        &ctx.settings.namespace,
        &policy.spec,
        &observed.daemon_sets,
        nodes,
        &ctx.stores.upgrade_pods.snapshot(),
        &ctx.recorder,
    )
    .await
    .map_err(Error::Upgrade)?;
    ctx.metrics
        .observe_upgrades(upgrade::enabled(&policy.spec), &report.counts());
    *last_upgrade = Some(report.clone());
    Ok(report)
}

/// What the label stage did: what is still in flight.
struct Labelled {
    /// Nodes whose label patch the cache has not shown yet.
    in_flight: usize,
    /// When a node's vanished GPU label reaches its grace period.
    deadline: Option<Instant>,
    /// The label-loss breaker holds nodes marked (nodes::Breaker::warning).
    label_loss_warning: Option<String>,
}

/// Label stage: the GPU nodes' deploy labels (they decide where operands run), on `nodes`, the
/// pass's snapshot.
async fn label(
    policy: &ClusterPolicy,
    ctx: &Deps,
    memory: &mut LabelMemory,
    nodes: &[Arc<crate::nodes::NodeView>],
    gate: &Semaphore,
) -> Result<Labelled, Error> {
    if ctx.nvidia.holder().is_some() {
        // NVIDIA's operator labels the same keys: leave the nodes to it (decision 14).
        return Ok(Labelled {
            in_flight: 0,
            deadline: None,
            label_loss_warning: None,
        });
    }
    let labelling = labeller::label_nodes(
        &ctx.client,
        nodes,
        &mut memory.loss,
        &mut memory.attempts,
        ctx.settings.gpu_label_grace,
        mig_default_layout(&policy.spec),
        gate,
    )
    .await
    .map_err(|source| Error::Labels {
        purpose: "",
        source,
    })?;
    let label_loss_warning = labelling.breaker.warning(ctx.settings.gpu_label_grace);
    let deadline = labelling.again_at;
    // Node pools and the GPU memory resource (our extension), on the same snapshot.
    let pool_retry =
        node_pools::reconcile_nodes(&ctx.client, nodes, &policy.spec, &mut memory.pool_attempts)
            .await
            .map_err(|source| Error::Labels {
                purpose: "",
                source,
            })?;
    node_pools::reconcile_priority_classes(&ctx.client, policy, &mut memory.priority_classes)
        .await
        .map_err(|source| Error::Labels {
            purpose: "",
            source,
        })?;
    let deadline = deadline.into_iter().chain(pool_retry).min();
    let in_flight = memory.attempts.in_flight(nodes);
    Ok(Labelled {
        in_flight,
        deadline,
        label_loss_warning,
    })
}

/// The operator namespace's Pod Security labels: privileged operand pods need a namespace that
/// admits them, before their DaemonSets are applied.
async fn ensure_namespace(policy: &ClusterPolicy, ctx: &Deps) -> Result<(), Error> {
    let psa = policy.spec.psa.as_ref().is_some_and(|p| p.is_enabled());
    if (psa || ctx.resolver.discovered.openshift) && ctx.nvidia.holder().is_none() {
        namespace::ensure_privileged(&ctx.client, &ctx.settings.namespace)
            .await
            .map_err(|source| Error::Namespace {
                namespace: ctx.settings.namespace.clone(),
                source,
            })?;
    }
    Ok(())
}

/// Apply stage: NFD's CRDs before NFD itself (decision 16), then every operand's objects. With
/// NVIDIA's operator live, this operator stands aside: it reports and changes nothing
/// (decision 14).
async fn apply(
    policy: &ClusterPolicy,
    ctx: &Deps,
    memory: &mut ApplyMemory,
    desired: &render::DesiredState,
) -> Result<apply::ApplyReport, Error> {
    if ctx.nvidia.holder().is_some() {
        return Ok(apply::ApplyReport::default());
    }
    let deploys_nfd = desired.operands.iter().any(|s| {
        s.operand == crate::model::Operand::Nfd && matches!(s.outcome, Outcome::Rendered(_))
    });
    if deploys_nfd && !memory.nfd_crds_current {
        let ensured = nfd_crds::ensure(&ctx.client).await?;
        if !ensured.written.is_empty() {
            tracing::info!(crds = ?ensured.written, "installed NFD's CRDs");
        }
        if !ensured.read_only.is_empty() {
            tracing::warn!(crds = ?ensured.read_only, "{}", nfd_crds::READ_ONLY_NOTE);
        }
        memory.nfd_crds_read_only = !ensured.read_only.is_empty();
        memory.nfd_crds_current = true;
    } else if !deploys_nfd {
        // Switched off: look at the CRDs again when NFD is switched back on.
        memory.nfd_crds_current = false;
        memory.nfd_crds_read_only = false;
    }
    owner::apply(
        ctx,
        &Owner::of(policy),
        policy.meta().uid.as_deref(),
        desired,
        &mut memory.ledger,
        &ctx.resolver.discovered.optional_kinds(),
    )
    .await
}

/// Status stage, the writing half: metrics, the status patch when it changed, and an event
/// when the state changed.
async fn report_status(
    policy: &ClusterPolicy,
    ctx: &Deps,
    status: &ClusterPolicyStatus,
    nodes: &[Arc<crate::nodes::NodeView>],
) -> Result<(), Error> {
    ctx.metrics.observe_state(
        nodes.iter().filter(|n| n.is_gpu_node()).count(),
        status
            .components
            .iter()
            .flatten()
            .filter(|c| c.desired > 0 && c.available == c.desired)
            .count(),
        nodes.iter().filter(|n| n.has_nfd_gpu()).count(),
        // OpenShift's Driver Toolkit is on unless switched off; the driver is built the standard
        // way here (operands::driver), so a request for it cannot be honoured.
        ctx.resolver.discovered.openshift
            && policy.spec.is_enabled(crate::api::Component::Driver)
            && policy
                .spec
                .operator
                .as_ref()
                .and_then(|o| o.use_ocp_driver_toolkit)
                .unwrap_or(true),
    );
    let error = status::has_error(status);
    ctx.metrics.observe_status(
        match status.state {
            State::Ready => ReconciliationStatus::Success,
            _ if error => ReconciliationStatus::OperatorError,
            _ => ReconciliationStatus::NotReady,
        },
        k8s_openapi::jiff::Timestamp::now().as_millisecond() as f64 / 1000.0,
    );
    let previous_state = policy.status.as_ref().map(|s| s.state);
    if !still_in_force(ctx, policy) {
        return Ok(());
    }
    if ctx.nvidia.holder().is_some() && resolve::says_nvidia_operator_runs(policy.status.as_ref()) {
        // Standing aside (decision 14): status said so once; NVIDIA's operator writes the
        // same ClusterPolicy's status, and answering each of its writes would be a fight.
        return Ok(());
    }
    owner::patch_status(&ctx.client, policy, policy.status.as_ref(), status).await?;
    if previous_state != Some(status.state) {
        let message = status
            .conditions
            .iter()
            .flatten()
            .find(|c| c.type_ == status::READY)
            .map(|c| c.message.clone())
            .unwrap_or_default();
        // A policy that has never been ready is progressing, not failing: a warning then only
        // for what a user must fix.
        let (kind, reason) = match (status.state, previous_state) {
            (State::Ready, _) => (EventType::Normal, "Ready"),
            (_, None) if !error => (EventType::Normal, "Progressing"),
            _ => (EventType::Warning, "NotReady"),
        };
        publish(ctx, policy, kind, reason, message).await;
    }
    Ok(())
}

/// Requeue stage: when to look again without a watch event.
fn requeue(
    ctx: &Deps,
    status: &ClusterPolicyStatus,
    desired: &render::DesiredState,
    applied: &apply::ApplyReport,
    labelled: &Labelled,
    unexplained: bool,
) -> Requeue {
    // A node's vanished GPU label reaches its grace period, or the label stage retries.
    let grace = labelled
        .deadline
        .map(|d| d.saturating_duration_since(Instant::now()) + Duration::from_millis(100));
    // A difference not yet explained is looked at again when it would be.
    let unexplained = unexplained.then_some(observe::MISMATCH_GRACE);
    Again {
        ready: status.state == State::Ready,
        // An invalid config waits for the user's fix (its ConfigMap or the policy changes).
        waits_for_user: desired
            .operands
            .iter()
            .any(|s| matches!(s.outcome, Outcome::Invalid(_)))
            || !applied.rejected.is_empty(),
        unsettled: !applied.unsettled().is_empty() || labelled.in_flight > 0,
        retry_after: applied.retry_after,
        deadline: scheduler::earliest(grace, unexplained),
    }
    .requeue(ctx.settings.not_ready_requeue)
}

async fn publish(ctx: &Deps, policy: &ClusterPolicy, type_: EventType, reason: &str, note: String) {
    let event = Event {
        type_,
        reason: reason.to_string(),
        note: Some(event_note(note)),
        action: "Reconcile".to_string(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &policy.object_ref(&())).await {
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

/// One pass over every policy, GPUCluster and NVIDIADriver: when to look again, and whether any
/// failed. With `preemption`, the active policy's pass may stop after its apply stage for a
/// user's change (then the GPUClusters and NVIDIADrivers wait for the next pass, which runs at
/// once).
async fn pass(deps: &Deps, state: &mut PassState, preemption: Preemption) -> PassOutcome {
    let mut next: Option<Duration> = None;
    let mut failed = false;
    let mut preempted = false;
    if deps.policies.is_empty() {
        deps.metrics
            .observe_status(ReconciliationStatus::PolicyUnavailable, 0.0);
    }
    for guard in deps.policies.state() {
        let ran = reconcile(
            &guard,
            deps,
            &mut state.policy,
            &mut state.diagnoser,
            preemption.clone(),
        )
        .await;
        match ran {
            Ok(Ran::Done(requeue)) => next = next.into_iter().chain(requeue).min(),
            Ok(Ran::Preempted) => {
                preempted = true;
                next = Some(Duration::ZERO);
            }
            Err(e) => {
                // Counted here, once, for the active and the ignored policies alike.
                deps.metrics.observe_error(e.reason());
                failed = true;
            }
        }
    }
    if preempted {
        return PassOutcome {
            requeue: next,
            failed,
            preempted,
        };
    }
    let active = active_policy(&deps.policies);
    let clusters = gpu_cluster::reconcile_all(
        deps,
        &mut state.gpu_cluster,
        &mut state.diagnoser,
        active.as_deref(),
    )
    .await;
    match clusters.inspect_err(|e| tracing::warn!(error = %e, "GPUCluster reconcile failed")) {
        Ok(requeue) => next = next.into_iter().chain(requeue).min(),
        Err(e) => {
            deps.metrics.observe_error(e.reason());
            failed = true;
        }
    }
    // The NVIDIADrivers render against the active policy's last pass (none while the active
    // policy is being deleted or has not had a pass).
    let rendered = state.policy.rendered.clone();
    let policy = match (active.as_deref().filter(|p| !is_deleting(p)), &rendered) {
        (Some(p), Some(last)) if last.uid == p.metadata.uid => {
            Some((p, &last.validated, &last.facts))
        }
        _ => None,
    };
    let drivers =
        nvidia_driver::reconcile_all(deps, &mut state.nvidia_driver, &mut state.diagnoser, policy)
            .await;
    match drivers.inspect_err(|e| tracing::warn!(error = %e, "NVIDIADriver reconcile failed")) {
        Ok(requeue) => next = next.into_iter().chain(requeue).min(),
        Err(e) => {
            deps.metrics.observe_error(e.reason());
            failed = true;
        }
    }
    PassOutcome {
        requeue: next,
        failed,
        preempted: false,
    }
}

/// The clients the controller uses (crate::client): request/response calls, and watches.
#[derive(Clone)]
pub struct Clients {
    pub requests: Client,
    pub watches: Client,
}

/// Runs the controller until `shutdown` resolves; the pass in flight is finished first.
/// Dropping the future instead cancels the pass in flight and every watch.
pub async fn run(
    clients: Clients,
    settings: Settings,
    metrics: Metrics,
    health: crate::health::Health,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let Clients {
        requests: client,
        watches: watch_client,
    } = clients;
    let discovered = Discovered::probe(&client).await?;
    tracing::info!(?discovered, namespace = %settings.namespace, "starting controller");
    let (stores, triggers) = Stores::start(&watch_client, &settings.namespace);
    let (policies, policy_changes) = stores::watched_specs(
        Api::<DeserializeGuard<ClusterPolicy>>::all(watch_client.clone()),
        watcher::Config::default(),
    );
    // A policy's spec is the user's to change: its changes go first (stores::Wake).
    let mut triggers =
        futures::stream::select(triggers, policy_changes.map(|()| Wake::Now)).boxed();
    let gpu_clusters = if owner::served::<crate::api::GPUCluster>(&client).await {
        let (clusters, changes) = stores::watched_specs(
            Api::<DeserializeGuard<crate::api::GPUCluster>>::all(watch_client.clone()),
            watcher::Config::default(),
        );
        triggers = futures::stream::select(triggers, changes.map(|()| Wake::Now)).boxed();
        Some(clusters)
    } else {
        tracing::info!("the GPUCluster CRD is not served; GPUClusters are not watched");
        None
    };
    let nvidia_drivers = if owner::served::<crate::api::NVIDIADriver>(&client).await {
        let (drivers, changes) = stores::watched_specs(
            Api::<DeserializeGuard<crate::api::NVIDIADriver>>::all(client.clone()),
            watcher::Config::default(),
        );
        triggers = futures::stream::select(triggers, changes.map(|()| Wake::Now)).boxed();
        Some(drivers)
    } else {
        tracing::info!("the NVIDIADriver CRD is not served; NVIDIADrivers are not watched");
        None
    };

    // Fill every cache before the first pass, so it compares against the real cluster.
    let ready = async {
        stores.wait_until_ready().await?;
        policies.wait_until_ready().await?;
        if let Some(clusters) = &gpu_clusters {
            clusters.wait_until_ready().await?;
        }
        if let Some(drivers) = &nvidia_drivers {
            drivers.wait_until_ready().await?;
        }
        Ok::<_, kube::runtime::reflector::store::WriterDropped>(())
    };
    let pump = async { while triggers.next().await.is_some() {} };
    tokio::select! {
        done = ready => done?,
        () = pump => anyhow::bail!("watches ended before the caches were filled"),
    }
    tracing::info!(
        nodes = stores.nodes.len(),
        policies = policies.len(),
        "caches ready"
    );

    let reporting = Reporting {
        health,
        metrics: metrics.clone(),
    };
    // The watches run on their own task, so the caches stay current while a pass runs (a pass
    // that patches a thousand nodes must see the versions its own writes produced).
    let wakes = scheduler::Wakes::pump(triggers, reporting.clone());
    let nvidia = coexist::NvidiaOperator::fixed(discovered.nvidia_operator.clone());
    let _nvidia_watch = {
        let (nvidia, waker, client) = (nvidia.clone(), wakes.waker(), watch_client.clone());
        AbortOnDrop(tokio::spawn(async move {
            nvidia.watch(client, move || waker.wake()).await;
        }))
    };
    let deps = Deps {
        nvidia,
        resolver: Resolver::new(
            client.clone(),
            settings.namespace.clone(),
            discovered,
            resolve::image_env_from_process(),
        ),
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: "gpu-operator".into(),
                instance: std::env::var("POD_NAME").ok(),
            },
        ),
        client,
        settings,
        stores,
        policies,
        metrics,
        gpu_clusters,
        nvidia_drivers,
        image_env: resolve::image_env_from_process(),
    };

    let timing = scheduler::Timing {
        coalesce: scheduler::COALESCE,
        deadline: deps.settings.pass_deadline,
    };
    scheduler::run(
        wakes,
        timing,
        &reporting,
        PassState::default(),
        shutdown,
        async |state: &mut PassState, preemption| pass(&deps, state, preemption).await,
    )
    .await?;
    tracing::info!("controller stopped");
    Ok(())
}

/// The scheduler reports to the health endpoints and the metrics.
#[derive(Clone)]
struct Reporting {
    health: crate::health::Health,
    metrics: Metrics,
}

impl scheduler::Observer for Reporting {
    fn work_arrived(&self) {
        self.health.work_arrived();
    }

    /// Readiness after the first pass, liveness while passes end (crate::health).
    fn pass_started(&self) {
        self.health.pass_started();
    }

    fn pass_finished(&self) {
        self.health.pass_finished();
    }

    fn deadline_passed(&self) {
        self.metrics.observe_error("PassDeadline");
    }
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
