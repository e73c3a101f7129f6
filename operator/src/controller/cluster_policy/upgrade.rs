//! Upgrade stage of the ClusterPolicy pass (IO).
//!
//! The driver upgrade state machine (controller::upgrade) and its gauges: the policy's own
//! driver nodes with its `driver.upgradePolicy`, each NVIDIADriver pool with its own.

use std::sync::Arc;

use crate::api::ClusterPolicy;
use crate::controller::Deps;
use crate::controller::observe::Observed;
use crate::controller::owner::Error;
use crate::controller::upgrade::{self as machine, Report};
use crate::nodes::NodeView;

/// Upgrade stage: one step of every node's driver upgrade. With NVIDIA's operator live, or the
/// policy being deleted, it changes nothing. `last` is the stage's last report: while the
/// caches show nothing to upgrade it stands, without the stage's reads.
pub async fn upgrade(
    policy: &ClusterPolicy,
    deps: &Deps,
    last: &mut Option<Report>,
    observed: &Observed,
    nodes: &[Arc<NodeView>],
) -> Result<Report, Error> {
    if deps.nvidia.holder().is_some() || !super::still_in_force(deps, policy) {
        return Ok(Report::default());
    }
    let policies = machine::Policies::of(Some(&policy.spec), &deps.nvidia_driver_specs());
    run(deps, last, &policies, observed, nodes).await
}

/// One step of every node's driver upgrade under `policies` (the ClusterPolicy's and each
/// pool's), and the gauges. `last` stands while the caches show nothing to upgrade.
pub async fn run(
    deps: &Deps,
    last: &mut Option<Report>,
    policies: &machine::Policies,
    observed: &Observed,
    nodes: &[Arc<NodeView>],
) -> Result<Report, Error> {
    if policies.enabled()
        && machine::quiet(&observed.daemon_sets, nodes, policies)
        && let Some(last) = last.as_ref()
        && !last.active()
    {
        return Ok(last.clone());
    }
    let report = machine::reconcile(
        &deps.client,
        &deps.settings.namespace,
        policies,
        &observed.daemon_sets,
        nodes,
        &deps.stores.upgrade_pods.snapshot(),
        &deps.recorder,
    )
    .await
    .map_err(Error::Upgrade)?;
    deps.metrics
        .observe_upgrades(policies.enabled(), &report.counts());
    *last = Some(report.clone());
    Ok(report)
}
