//! Apply stage of the ClusterPolicy pass (IO).
//!
//! The operator namespace's Pod Security labels, NFD's CRDs before NFD itself (decision 16), then
//! every operand's objects with the policy as owner (controller::owner::apply). With NVIDIA's
//! operator live, this operator stands aside: it reports and changes nothing (decision 14).

use kube::Resource;

use super::namespace;
use crate::api::ClusterPolicy;
use crate::controller::apply::ApplyReport;
use crate::controller::owner::{self, Error, Owner};
use crate::controller::plan::Ledger;
use crate::controller::{Deps, vendored_crds};
use crate::model::Operand;
use crate::render::{DesiredState, Outcome};

/// What the apply stage remembers.
#[derive(Default)]
pub struct Memory {
    ledger: Ledger,
    /// Whether NFD's CRDs were found or made current since the operator started.
    nfd_crds_current: bool,
    /// NFD's CRDs are installed by someone else (OLM) and not writable by us.
    pub nfd_crds_read_only: bool,
}

/// Apply stage: the namespace, NFD's CRDs, then the operands' objects and the pruning.
pub async fn apply(
    policy: &ClusterPolicy,
    deps: &Deps,
    memory: &mut Memory,
    desired: &DesiredState,
) -> Result<ApplyReport, Error> {
    if deps.nvidia.holder().is_some() {
        return Ok(ApplyReport::default());
    }
    ensure_namespace(policy, deps).await?;
    let deploys_nfd = desired
        .operands
        .iter()
        .any(|s| s.operand == Operand::Nfd && matches!(s.outcome, Outcome::Rendered(_)));
    if deploys_nfd && !memory.nfd_crds_current {
        let ensured = vendored_crds::ensure(&deps.client).await?;
        if !ensured.written.is_empty() {
            tracing::info!(crds = ?ensured.written, "installed NFD's CRDs");
        }
        if !ensured.read_only.is_empty() {
            tracing::warn!(crds = ?ensured.read_only, "{}", vendored_crds::READ_ONLY_NOTE);
        }
        memory.nfd_crds_read_only = !ensured.read_only.is_empty();
        memory.nfd_crds_current = true;
    } else if !deploys_nfd {
        // Switched off: look at the CRDs again when NFD is switched back on.
        memory.nfd_crds_current = false;
        memory.nfd_crds_read_only = false;
    }
    owner::apply(
        deps,
        &Owner::of(policy),
        policy.meta().uid.as_deref(),
        desired,
        &mut memory.ledger,
        &deps.resolver.discovered.optional_kinds(),
    )
    .await
}

/// The operator namespace's Pod Security labels: privileged operand pods need a namespace that
/// admits them, before their DaemonSets are applied.
async fn ensure_namespace(policy: &ClusterPolicy, deps: &Deps) -> Result<(), Error> {
    let psa = policy.spec.psa.as_ref().is_some_and(|p| p.is_enabled());
    if psa || deps.resolver.discovered.openshift {
        namespace::ensure_privileged(&deps.client, &deps.settings.namespace)
            .await
            .map_err(|source| Error::Namespace {
                namespace: deps.settings.namespace.clone(),
                source,
            })?;
    }
    Ok(())
}
