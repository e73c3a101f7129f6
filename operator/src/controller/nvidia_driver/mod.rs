//! The NVIDIADriver pass (IO): its stages, in order.
//!
//! resolve (each pool's GPU nodes) -> validate (each pool's input, then the overlap rule across
//! pools) -> render ([`crate::operands::nvidia_driver`]) -> apply/prune (with a ledger per
//! NVIDIADriver and the NVIDIADriver as owner) -> label (the pool label, which hands each node from
//! the ClusterPolicy's driver DaemonSets to its pool's) -> status (patched only when it changed) ->
//! requeue.
//!
//! Guarantees and caveats:
//! - Acted on while the active ClusterPolicy sets `driver.useNvidiaDriverCRD: true` (and
//!   deploys the driver), or while no ClusterPolicy exists and a GPUCluster is in force
//!   ([`standalone`]). Otherwise each NVIDIADriver is `disabled`, its DaemonSets are pruned and
//!   the pool labels removed, so the policy's own driver DaemonSets cover every GPU node again.
//!   With NVIDIA's operator live, or neither a ClusterPolicy nor a GPUCluster in force, nothing
//!   is written but the NVIDIADrivers' status.
//! - The handover never leaves a GPU node without a driver DaemonSet that wants it: a node gets the
//!   pool label (and the policy's DaemonSets let go of it) only after its pool's DaemonSet was
//!   applied in this pass, and loses it when the pool stops covering it. The driver pods'
//!   anti-affinity keeps one driver pod per node meanwhile.
//! - Two pools selecting the same GPU node: the older keeps it, the younger is `notReady` with a
//!   message naming both and the nodes, renders nothing new and keeps what runs (decision 8). An
//!   NVIDIADriver with invalid input is frozen the same way; the nodes it already ran on keep its
//!   label, the others stay with the policy's driver.
//! - Node selectors over labels the node cache does not keep are answered by one label-selected
//!   metadata list per NVIDIADriver and pass; a relabelled node is seen on the next pass (a pool
//!   that is not ready looks again after a while).

mod label;
mod resolve;
mod standalone;
mod status;
mod validate;

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{Client, ResourceExt};

use super::Deps;
use super::apply::ApplyReport;
use super::cluster_policy::Rendered;
use super::observe::{self, Diagnoser};
use super::owner::{self, Error, LabelAttempts, Owner, UNSETTLED_REQUEUE};
use super::plan::Ledger;
use super::scheduler::{self, Requeue};
use crate::api::{ClusterPolicy, Component, GPUCluster, NVIDIADriver};
use crate::facts::ClusterFacts;
use crate::model::{Operand, ValidatedPolicy};
use crate::operands::driver;
use crate::operands::nvidia_driver::{self as pool, ValidatedNvidiaDriver};
use crate::render::{DesiredState, OperandState, Outcome};

pub use status::policy_note;

/// What one NVIDIADriver pass reads: the controller's dependencies, NVIDIA's operator if it
/// is live, and the ClusterPolicy in force with what its last pass validated and resolved.
struct Pass<'a> {
    deps: &'a Deps,
    client: &'a Client,
    namespace: &'a str,
    nvidia_operator: Option<&'a str>,
    policy: Option<(&'a ClusterPolicy, &'a Rendered)>,
    /// The GPUCluster in force when no ClusterPolicy exists ([`standalone`]).
    cluster: Option<&'a GPUCluster>,
}

/// What the NVIDIADriver passes keep between passes: a ledger per NVIDIADriver (by uid), and
/// the pool labels sent.
#[derive(Default)]
pub struct Memory {
    ledgers: BTreeMap<String, Ledger>,
    /// Pool label patches the cache has not shown yet.
    labels: LabelAttempts,
    /// The objects every pool uses, in a GPUCluster install ([`standalone`]).
    shared: Ledger,
    /// The upgrade stage's last report in a GPUCluster install.
    last_upgrade: Option<crate::controller::upgrade::Report>,
}

/// One NVIDIADriver through the stages: its GPU nodes and facts, and its verdict.
struct Pool<'a> {
    driver: &'a NVIDIADriver,
    validated: ValidatedNvidiaDriver,
    facts: ClusterFacts,
    /// Why it is frozen: its own input, or an overlap with an older pool.
    invalid: Option<String>,
}

/// Reconciles every NVIDIADriver, stage by stage. `policy` is the ClusterPolicy in force with
/// what its last pass validated and resolved (none while it is being deleted or has not had a
/// pass).
pub async fn reconcile_all(
    deps: &Deps,
    memory: &mut Memory,
    diagnoser: &mut Diagnoser,
    policy: Option<(&ClusterPolicy, &Rendered)>,
) -> Result<Requeue, Error> {
    if deps.nvidia_drivers.is_none() {
        return Ok(None);
    }
    let nvidia_operator = deps.nvidia.holder();
    let cluster = standalone::cluster_in_force(deps);
    let ctx = &Pass {
        deps,
        client: &deps.client,
        namespace: &deps.settings.namespace,
        nvidia_operator: nvidia_operator.as_deref(),
        policy,
        cluster: cluster.as_ref(),
    };
    let drivers = deps.nvidia_driver_specs();
    let nodes = deps.stores.nodes.snapshot();
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    if let Some(why) = not_in_use(ctx) {
        switched_off(ctx, memory, &drivers, &nodes, &why, now).await?;
        return Ok(None);
    }
    let standalone_inputs;
    let (validated, facts) = match (ctx.policy, ctx.cluster) {
        (Some((_, rendered)), _) => (&rendered.validated, &rendered.facts),
        (None, Some(cluster)) => {
            standalone_inputs = standalone::prepare(deps, cluster);
            (&standalone_inputs.0, &standalone_inputs.1)
        }
        (None, None) => return Ok(None),
    };
    let resolved = resolve::resolve_all(ctx, &drivers, &nodes, facts).await?;
    let pools = validate::validate_all(resolved, &deps.image_env, &validated.spec);
    let desired = render_all(&pools, validated);
    let applied = apply_all(ctx, memory, &pools, &desired).await?;
    if let (None, Some(cluster)) = (ctx.policy, ctx.cluster) {
        standalone::apply_shared(ctx, memory, cluster, validated, facts).await?;
    }
    let wanted = label::wanted(&pools, &desired, &nodes);
    let standalone = ctx.policy.is_none();
    let in_flight =
        label::label_nodes(ctx.client, &mut memory.labels, &nodes, &wanted, standalone).await?;
    let observed = observe::observe(ctx.client, &deps.stores, diagnoser).await;
    // Without a ClusterPolicy its pass runs no upgrade stage: the pools' runs here.
    let upgrading = match (ctx.policy, ctx.cluster) {
        (None, Some(_)) => {
            standalone::upgrade(deps, &mut memory.last_upgrade, &drivers, &observed, &nodes)
                .await?
                .active()
                .then_some(UPGRADE_REQUEUE)
        }
        _ => None,
    };
    let requeue = status::report_all(ctx, &pools, &desired, &applied, &observed, now).await?;
    let labels = (in_flight > 0).then_some(UNSETTLED_REQUEUE);
    Ok(scheduler::earliest(
        scheduler::earliest(requeue, labels),
        upgrading,
    ))
}

/// How soon a pass looks again while a node is between upgrade states (as the ClusterPolicy's).
const UPGRADE_REQUEUE: std::time::Duration = std::time::Duration::from_secs(1);

/// Render stage: each pool's driver DaemonSets from the policy's validated form, or its
/// verdict when frozen.
fn render_all(pools: &[Pool<'_>], policy: &ValidatedPolicy) -> Vec<DesiredState> {
    pools
        .iter()
        .map(|p| {
            one(match &p.invalid {
                Some(message) => Outcome::Invalid(message.clone()),
                None => Outcome::Rendered(pool::render(policy, &p.validated, &p.facts)),
            })
        })
        .collect()
}

/// Apply stage: each pool's objects, in the order of the pools.
async fn apply_all(
    ctx: &Pass<'_>,
    memory: &mut Memory,
    pools: &[Pool<'_>],
    desired: &[DesiredState],
) -> Result<Vec<ApplyReport>, Error> {
    let mut applied = Vec::new();
    for (p, desired) in pools.iter().zip(desired) {
        applied.push(apply_for(ctx, memory, p.driver, desired).await?);
    }
    Ok(applied)
}

/// NVIDIADrivers not acted on: with a ClusterPolicy in force and NVIDIA's operator not live,
/// the pools' DaemonSets go and the pool labels are removed, so the policy's own driver
/// DaemonSets cover the nodes again; every NVIDIADriver is `disabled`.
async fn switched_off(
    ctx: &Pass<'_>,
    memory: &mut Memory,
    drivers: &[NVIDIADriver],
    nodes: &[std::sync::Arc<crate::nodes::NodeView>],
    why: &str,
    now: Time,
) -> Result<(), Error> {
    let acts = ctx.nvidia_operator.is_none() && ctx.policy.is_some();
    if acts {
        for d in drivers {
            apply_for(ctx, memory, d, &one(Outcome::Disabled)).await?;
        }
        label::label_nodes(
            ctx.client,
            &mut memory.labels,
            nodes,
            &BTreeMap::new(),
            false,
        )
        .await?;
    }
    for d in drivers {
        status::disabled(ctx, d, why, now.clone()).await?;
    }
    Ok(())
}

/// Why NVIDIADrivers are not acted on now, or `None` when they are.
fn not_in_use(ctx: &Pass<'_>) -> Option<String> {
    if let Some(other) = ctx.nvidia_operator {
        return Some(format!(
            "NVIDIA's GPU operator ({other}) is live and runs the drivers; this operator stands aside"
        ));
    }
    let Some((policy, _)) = ctx.policy else {
        if ctx.cluster.is_some() {
            return None;
        }
        return Some("neither a ClusterPolicy nor a GPUCluster is in force".to_owned());
    };
    if !policy.spec.is_enabled(Component::Driver) {
        return Some(format!(
            "ClusterPolicy {} sets driver.enabled=false",
            policy.name_any()
        ));
    }
    if !driver::uses_nvidia_driver_crd(&policy.spec) {
        return Some(format!(
            "ClusterPolicy {} does not set driver.useNvidiaDriverCRD=true; its own driver \
             DaemonSets serve every GPU node",
            policy.name_any()
        ));
    }
    None
}

/// A desired state with the one NVIDIADriver operand.
fn one(outcome: Outcome) -> DesiredState {
    DesiredState {
        operands: vec![OperandState {
            operand: Operand::NvidiaDriver,
            outcome,
        }],
    }
}

/// Apply stage for one NVIDIADriver: its operand with its own ledger, owned by it.
async fn apply_for(
    ctx: &Pass<'_>,
    memory: &mut Memory,
    d: &NVIDIADriver,
    desired: &DesiredState,
) -> Result<ApplyReport, Error> {
    let uid = d.uid().unwrap_or_default();
    let ledger = memory.ledgers.entry(uid.clone()).or_default();
    apply_with(ctx, ledger, &Owner::of(d), &uid, desired).await
}

/// Apply stage for `owner` (by `uid`) with `ledger`.
async fn apply_with(
    ctx: &Pass<'_>,
    ledger: &mut Ledger,
    owner: &Owner,
    uid: &str,
    desired: &DesiredState,
) -> Result<ApplyReport, Error> {
    owner::apply(ctx.deps, owner, Some(uid), desired, ledger, &[]).await
}
