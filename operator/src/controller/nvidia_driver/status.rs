//! Status and requeue stages of the NVIDIADriver pass (IO: the status patch, when it changed).
//!
//! Also the line the ClusterPolicy's status carries about the pools.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::{Pass, Pool};
use crate::api::{ClusterPolicy, NVIDIADriver, NvidiaDriverState, NvidiaDriverStatus, State};
use crate::controller::apply::ApplyReport;
use crate::controller::observe::Observed;
use crate::controller::owner::{self, Again, Error};
use crate::controller::scheduler::{self, Requeue};
use crate::controller::status;
use crate::controller::upgrade::{machine, prepull};
use crate::nodes::{DEPLOY_OPERANDS, DRIVER_POOL, NodeView};
use crate::operands::driver;
use crate::render::{DesiredState, Outcome};

/// Status and requeue stages: each pool's status, patched when it changed; when to look again.
pub async fn report_all(
    ctx: &Pass<'_>,
    pools: &[Pool<'_>],
    desired: &[DesiredState],
    applied: &[ApplyReport],
    observed: &Observed,
    now: Time,
) -> Result<Requeue, Error> {
    let mut next: Requeue = None;
    for ((p, desired), applied) in pools.iter().zip(desired).zip(applied) {
        let requeue = report(ctx, p, desired, applied, observed, now.clone()).await?;
        next = scheduler::earliest(next, requeue);
    }
    Ok(next)
}

/// Status and requeue stages of one NVIDIADriver.
async fn report(
    ctx: &Pass<'_>,
    pool: &Pool<'_>,
    desired: &DesiredState,
    applied: &ApplyReport,
    observed: &Observed,
    now: Time,
) -> Result<Requeue, Error> {
    let d = pool.driver;
    let facts = &pool.facts;
    let pool = &pool.validated;
    let unsupported = crate::operands::nvidia_driver::not_acted_on(&d.spec);
    let notes: Vec<String> = crate::operands::nvidia_driver::unplaced(pool, facts)
        .into_iter()
        .collect();
    let unsettled = applied.unsettled();
    // Nodes whose new driver image cannot be pulled (the upgrade stage marks them), with the
    // kubelet's reason from their pre-pull pods (the upgrade's pod cache).
    let upgrade_pods = ctx.deps.stores.upgrade_pods.snapshot();
    let held: Vec<String> = prepull::held_line(pool.nodes.iter().map(|n| {
        let image = n
            .upgrade_annotations
            .get(machine::HELD_ANNOTATION)
            .map(String::as_str);
        let reason = image.and_then(|image| {
            let on_node = upgrade_pods
                .iter()
                .filter(|p| p.node.as_deref() == Some(n.name.as_str()))
                .filter_map(|p| p.prepull.as_ref());
            prepull::pull_failure(image, on_node)
        });
        (n.name.as_str(), image, reason)
    }))
    .into_iter()
    .collect();
    let computed = status::compute(&status::StatusInputs {
        notes: &notes,
        unsupported: &unsupported,
        warnings: &held,
        ..owner::status_inputs(
            d.metadata.generation,
            ctx.namespace,
            desired,
            observed,
            &pool.nodes,
            applied,
            &unsettled,
            now,
        )
    });
    let invalid = matches!(desired.operands[0].outcome, Outcome::Invalid(_));
    let mut conditions = computed.conditions;
    let empty = pool.nodes.is_empty() && !invalid;
    if empty {
        // "No GPU node" here means the pool's selector matched none.
        for c in conditions.iter_mut().flatten() {
            if c.type_ == status::READY {
                c.message = if d.spec.is_default() {
                    "default pool: every GPU node is selected by another NVIDIADriver".to_owned()
                } else {
                    format!(
                        "nodeSelector {} selects no GPU node",
                        crate::operands::nvidia_driver::label_selector(&d.spec)
                    )
                };
            }
        }
    }
    let status = NvidiaDriverStatus {
        state: match computed.state {
            State::Ready if !empty => NvidiaDriverState::Ready,
            _ => NvidiaDriverState::NotReady,
        },
        namespace: computed.namespace,
        conditions: owner::keep_transition_times(
            d.status.as_ref().and_then(|s| s.conditions.clone()),
            conditions,
        ),
        selected_nodes: Some(pool.nodes.len() as i32),
        components: computed.components,
    };
    let ready = status.state == NvidiaDriverState::Ready;
    owner::patch_status(ctx.client, d, d.status.as_ref(), &status).await?;
    let again = Again {
        ready,
        waits_for_user: invalid,
        unsettled: !unsettled.is_empty(),
        retry_after: applied.retry_after,
        deadline: None,
    };
    Ok(again.requeue(ctx.deps.settings.not_ready_requeue))
}

/// Status stage while NVIDIADrivers are not acted on: `disabled`, saying why.
pub async fn disabled(ctx: &Pass<'_>, d: &NVIDIADriver, why: &str, now: Time) -> Result<(), Error> {
    let status = NvidiaDriverStatus {
        state: NvidiaDriverState::Disabled,
        namespace: Some(ctx.namespace.to_owned()),
        conditions: owner::keep_transition_times(
            d.status.as_ref().and_then(|s| s.conditions.clone()),
            Some(vec![status::condition_now(
                status::READY,
                false,
                "Disabled",
                why.to_owned(),
                d.metadata.generation,
                now,
            )]),
        ),
        selected_nodes: None,
        components: None,
    };
    owner::patch_status(ctx.client, d, d.status.as_ref(), &status).await?;
    Ok(())
}

/// The line a ClusterPolicy's status carries with `useNvidiaDriverCRD`: which GPU nodes run an
/// NVIDIADriver pool's driver, and which keep the policy's own.
pub fn policy_note(
    policy: &ClusterPolicy,
    served: bool,
    nodes: &[Arc<NodeView>],
) -> Option<String> {
    if !driver::uses_nvidia_driver_crd(&policy.spec) {
        return None;
    }
    if !served {
        return Some(
            "driver.useNvidiaDriverCRD: the NVIDIADriver CRD is not served, so every GPU node \
             keeps this policy's driver DaemonSets"
                .to_owned(),
        );
    }
    let gpu: Vec<&NodeView> = nodes
        .iter()
        .filter(|n| n.is_gpu_node() && n.label(DEPLOY_OPERANDS) != Some("false"))
        .map(Arc::as_ref)
        .collect();
    let mut pools: BTreeMap<&str, usize> = BTreeMap::new();
    let mut own = Vec::new();
    for node in &gpu {
        match node.label(DRIVER_POOL) {
            Some(p) => *pools.entry(p).or_default() += 1,
            None => own.push(node.name.as_str()),
        }
    }
    let covered: usize = pools.values().sum();
    let by_pool: Vec<String> = pools.iter().map(|(p, n)| format!("{p}: {n}")).collect();
    let listed: Vec<&str> = own.iter().take(10).copied().collect();
    let more = own.len().saturating_sub(10);
    let more = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    Some(match (covered, own.len()) {
        (0, _) => "driver.useNvidiaDriverCRD: no NVIDIADriver selects a GPU node yet, so every \
                   GPU node keeps this policy's driver DaemonSets"
            .to_owned(),
        (_, 0) => format!(
            "driver.useNvidiaDriverCRD: all {covered} GPU node(s) run the driver of an \
             NVIDIADriver pool ({})",
            by_pool.join(", ")
        ),
        (_, n) => format!(
            "driver.useNvidiaDriverCRD: {covered} GPU node(s) run the driver of an NVIDIADriver \
             pool ({}); {n} GPU node(s) no NVIDIADriver selects keep this policy's driver: {}{more}",
            by_pool.join(", "),
            listed.join(", ")
        ),
    })
}
