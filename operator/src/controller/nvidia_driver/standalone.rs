//! NVIDIADrivers in a GPUCluster install (IO): no ClusterPolicy exists, a GPUCluster is in
//! force, and the NVIDIADrivers run the drivers (NVIDIA's GPUCluster workflow).
//!
//! - The pools render against [`pool::standalone_policy`]: the driver on and handed to the
//!   NVIDIADrivers, every other setting at its default; images come from the operator's image
//!   environment, the namespace is the operator's.
//! - What every pool's DaemonSets use and no pool renders (the driver's ServiceAccount, RBAC and
//!   startup-probe ConfigMap) is applied here, owned by the GPUCluster, with its own ledger; the
//!   GPUCluster pass prunes only its DRA operands, so neither removes the other's objects.
//! - The upgrade stage runs here (the ClusterPolicy pass runs it otherwise), each pool with its
//!   own `upgradePolicy` or NVIDIA's NVIDIADriver defaults.

use std::sync::Arc;

use kube::{Resource, ResourceExt};

use super::{Memory, Pass, apply_with};
use crate::api::{GPUCluster, NVIDIADriver};
use crate::controller::Deps;
use crate::controller::apply::ApplyReport;
use crate::controller::observe::Observed;
use crate::controller::owner::{Error, Owner};
use crate::controller::upgrade::{Policies, Report};
use crate::facts::ClusterFacts;
use crate::model::{Operand, ValidatedPolicy};
use crate::nodes::NodeView;
use crate::operands::nvidia_driver as pool;
use crate::render::{DesiredState, OperandState, Outcome};

/// The GPUCluster the NVIDIADrivers follow: one not being deleted, while no ClusterPolicy
/// exists at all (a ClusterPolicy, even one not yet reconciled, decides instead, as in
/// NVIDIA's operator).
pub fn cluster_in_force(deps: &Deps) -> Option<GPUCluster> {
    let policies = deps.policies.state();
    if policies.iter().any(|g| g.0.is_ok()) {
        return None;
    }
    deps.gpu_clusters
        .as_ref()?
        .state()
        .iter()
        .filter_map(|g| g.0.as_ref().ok())
        .find(|c| c.metadata.deletion_timestamp.is_none())
        .cloned()
}

/// The policy and facts the pools render with in a GPUCluster install.
pub fn prepare(deps: &Deps, cluster: &GPUCluster) -> (ValidatedPolicy, ClusterFacts) {
    let facts = ClusterFacts {
        namespace: deps.settings.namespace.clone(),
        owner: cluster.controller_owner_ref(&()),
        openshift: deps.resolver.discovered.openshift,
        openshift_version: deps.resolver.discovered.openshift_version.clone(),
        image_env: deps.image_env.clone(),
        ..ClusterFacts::default()
    };
    (pool::standalone_policy(&facts), facts)
}

/// Apply stage of the objects every pool uses, owned by the GPUCluster.
pub async fn apply_shared(
    ctx: &Pass<'_>,
    memory: &mut Memory,
    cluster: &GPUCluster,
    policy: &ValidatedPolicy,
    facts: &ClusterFacts,
) -> Result<ApplyReport, Error> {
    let desired = DesiredState {
        operands: vec![OperandState {
            operand: Operand::Driver,
            outcome: Outcome::Rendered(pool::shared_objects(policy, facts)),
        }],
    };
    let uid = cluster.uid().unwrap_or_default();
    apply_with(ctx, &mut memory.shared, &Owner::of(cluster), &uid, &desired).await
}

/// Upgrade stage of a GPUCluster install: each pool with its own policy. `last` is the stage's
/// last report: while the caches show nothing to upgrade it stands, without the stage's reads.
pub async fn upgrade(
    deps: &Deps,
    last: &mut Option<Report>,
    drivers: &[NVIDIADriver],
    observed: &Observed,
    nodes: &[Arc<NodeView>],
) -> Result<Report, Error> {
    let policies = Policies::of(None, drivers);
    crate::controller::cluster_policy::upgrade::run(deps, last, &policies, observed, nodes).await
}
