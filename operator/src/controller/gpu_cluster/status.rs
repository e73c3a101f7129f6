//! Status and requeue stages of the GPUCluster pass (IO: the status patch, when it changed).

use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::api::{GPUCluster, GpuClusterState, GpuClusterStatus, State};
use crate::controller::apply::ApplyReport;
use crate::controller::observe::Observed;
use crate::controller::owner::{self, Again, Error};
use crate::controller::scheduler::Requeue;
use crate::controller::{Deps, status};
use crate::nodes::NodeView;
use crate::operands::dra_driver;
use crate::render::DesiredState;

/// What the pass found, for the status.
pub struct Found<'a> {
    pub desired: &'a DesiredState,
    pub observed: &'a Observed,
    pub nodes: &'a [Arc<NodeView>],
    pub applied: &'a ApplyReport,
    pub labels_in_flight: usize,
    /// Lines of status: the compute-domain CRDs used as installed by someone else...
    pub notes: Vec<String>,
    /// ...or not installable (the GPUCluster is then not ready).
    pub failures: Vec<String>,
}

/// Status stage: the GPUCluster's status from what the pass found, patched when it changed.
/// Returns whether it is ready.
pub async fn report(
    deps: &Deps,
    cluster: &GPUCluster,
    found: Found<'_>,
    now: Time,
) -> Result<bool, Error> {
    let unsupported =
        dra_driver::not_acted_on(&cluster.spec, deps.resolver.discovered.service_monitor);
    let unsettled = found.applied.unsettled();
    let computed = status::compute(&status::StatusInputs {
        unsupported: &unsupported,
        notes: &found.notes,
        failures: &found.failures,
        labels_in_flight: found.labels_in_flight,
        ..owner::status_inputs(
            cluster.metadata.generation,
            &deps.settings.namespace,
            found.desired,
            found.observed,
            found.nodes,
            found.applied,
            &unsettled,
            now,
        )
    });
    let status = GpuClusterStatus {
        state: match computed.state {
            State::Ready => GpuClusterState::Ready,
            State::NotReady | State::Ignored => GpuClusterState::NotReady,
        },
        namespace: computed.namespace,
        conditions: owner::keep_transition_times(
            cluster.status.as_ref().and_then(|s| s.conditions.clone()),
            computed.conditions,
        ),
        components: computed.components,
    };
    owner::patch_status(&deps.client, cluster, cluster.status.as_ref(), &status).await?;
    Ok(status.state == GpuClusterState::Ready)
}

/// Status stage while NVIDIA's operator is live: `disabled`, and nothing else is written.
pub async fn stand_aside(deps: &Deps, cluster: &GPUCluster, other: &str) -> Result<(), Error> {
    let status = GpuClusterStatus {
        state: GpuClusterState::Disabled,
        namespace: Some(deps.settings.namespace.clone()),
        conditions: None,
        components: None,
    };
    tracing::info!(operator = %other, "NVIDIA's operator is live; the GPUCluster is left to it");
    owner::patch_status(&deps.client, cluster, cluster.status.as_ref(), &status).await?;
    Ok(())
}

/// Requeue stage.
pub fn requeue(
    deps: &Deps,
    ready: bool,
    conflict: bool,
    applied: &ApplyReport,
    labels_in_flight: usize,
) -> Requeue {
    Again {
        ready,
        // A conflict with the policy's device plugin waits for the user to settle it.
        waits_for_user: conflict,
        unsettled: !applied.unsettled().is_empty() || labels_in_flight > 0,
        retry_after: applied.retry_after,
        deadline: None,
    }
    .requeue(deps.settings.not_ready_requeue)
}
