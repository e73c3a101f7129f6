//! The GPUCluster pass (IO): its stages, in order.
//!
//! resolve -> validate -> render (with the API server's dry run of the attribute DeviceClasses,
//! [`crate::operands::dra_driver`]; DCGM, the exporter and the DRA validator through their own
//! renderers) -> apply/prune (with its own ledger and the GPUCluster as owner; the namespace
//! labelled for admin-access claims first) -> label -> status (patched only when it changed) ->
//! requeue.
//!
//! Guarantees and caveats:
//! - Pruning is per operand and owner: this pass prunes only the DRA operands' objects owned by the
//!   GPUCluster, and the ClusterPolicy pass never names the DRA operands, so neither tears down the
//!   other's objects.
//! - A ClusterPolicy whose device plugin runs on the same GPU nodes is a conflict (each GPU would
//!   be handed out twice, once as `nvidia.com/gpu` and once as a DRA device): both statuses say so
//!   and the DRA operands are frozen (nothing applied, nothing deleted) until it is resolved.
//! - An attribute DeviceClass the API server refuses in a dry run (its CEL does not compile), or
//!   that reads an attribute the driver does not publish, freezes only the attribute classes. A dry
//!   run is sent once per distinct rendering, so a steady pass writes nothing.
//! - A GPUCluster being deleted gets no writes: garbage collection removes its objects. Its
//!   teardown finalizer keeps it until its marks are off the nodes (crate::cleanup,
//!   [`teardown`]).

mod label;
mod render;
mod status;
mod validate;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::Resource;
use kube::api::ApiResource;
use kube::core::GroupVersionKind;

use super::Deps;
use super::cluster_policy::namespace;
use super::observe::{self, Diagnoser};
use super::owner::{self, Error, LabelAttempts, Owner};
use super::plan::Ledger;
use super::scheduler::Requeue;
use super::vendored_crds;
use crate::api::{ClusterPolicy, GPUCluster};
use crate::facts::ClusterFacts;

pub use validate::policy_note;

/// What the GPUCluster passes keep between passes.
#[derive(Default)]
pub struct Memory {
    ledger: Ledger,
    dry_runs: render::DryRuns,
    /// Node label patches the cache has not shown yet.
    labels: LabelAttempts,
    /// The compute-domain CRDs are current (looked at once per process, again after a failure
    /// or after compute domains were switched off).
    crds_current: bool,
    /// The status note while they are used as someone else installed them.
    crds_note: Option<String>,
}

/// Apply stage, the compute-domain CRDs: installed and upgraded while compute domains are on
/// ([`vendored_crds::COMPUTE_DOMAINS`]), never deleted. Returns the status line of a failure.
async fn ensure_compute_domain_crds(
    deps: &Deps,
    memory: &mut Memory,
    cluster: &crate::operands::dra_driver::ValidatedGpuCluster,
) -> Option<String> {
    let wanted = cluster
        .spec
        .dra_driver
        .as_ref()
        .is_none_or(|d| d.compute_domains_enabled())
        && !cluster
            .invalid
            .contains_key(&crate::model::Operand::DraDriver);
    if !wanted {
        memory.crds_current = false;
        memory.crds_note = None;
        return None;
    }
    if memory.crds_current {
        return None;
    }
    match vendored_crds::ensure_set(&deps.client, &vendored_crds::COMPUTE_DOMAINS).await {
        Ok(ensured) => {
            if !ensured.written.is_empty() {
                tracing::info!(crds = ?ensured.written, "installed the compute-domain CRDs");
            }
            memory.crds_note = (!ensured.read_only.is_empty())
                .then(|| vendored_crds::COMPUTE_DOMAINS.read_only_note(&ensured.read_only));
            memory.crds_current = true;
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, "the compute-domain CRDs could not be installed");
            Some(format!("compute domains cannot work: {e}"))
        }
    }
}

/// The store-less kinds a GPUCluster renders, whose leftovers are pruned by listing.
pub fn optional_kinds() -> Vec<ApiResource> {
    ["DeviceClass", "ResourceClaimTemplate"]
        .map(|kind| ApiResource::from_gvk(&GroupVersionKind::gvk("resource.k8s.io", "v1", kind)))
        .into_iter()
        .chain(crate::operands::common::admission_api_resources())
        .collect()
}

/// Reconciles every GPUCluster (the CRD allows one, named gpu-cluster), beside `policy`, the
/// ClusterPolicy in force.
pub async fn reconcile_all(
    deps: &Deps,
    memory: &mut Memory,
    diagnoser: &mut Diagnoser,
    policy: Option<&ClusterPolicy>,
) -> Result<Requeue, Error> {
    let Some(clusters) = deps.gpu_clusters.as_ref() else {
        return Ok(None);
    };
    let nvidia_operator = deps.nvidia.holder();
    let mut next: Requeue = None;
    for guard in clusters.state() {
        let Ok(cluster) = guard.0.as_ref() else {
            continue;
        };
        if cluster.metadata.deletion_timestamp.is_some() {
            if crate::cleanup::has_finalizer(cluster) {
                teardown(cluster, deps, nvidia_operator.as_deref()).await?;
            }
            continue;
        }
        let requeue = reconcile(
            cluster,
            deps,
            memory,
            diagnoser,
            policy,
            nvidia_operator.as_deref(),
        )
        .await?;
        next = next.into_iter().chain(requeue).min();
    }
    Ok(next)
}

/// A deleted GPUCluster that carries our finalizer: its node labels come off
/// ([`crate::cleanup::Leaving::GpuCluster`]), then the finalizer goes. Not while NVIDIA's
/// operator is live (it writes the same keys, decision 14): then only the finalizer goes.
async fn teardown(
    cluster: &GPUCluster,
    deps: &Deps,
    nvidia_operator: Option<&str>,
) -> Result<(), Error> {
    let name = kube::ResourceExt::name_any(cluster);
    if let Some(holder) = nvidia_operator {
        tracing::warn!(gpu_cluster = %name, nvidia_operator = %holder, "teardown: NVIDIA's operator is live and writes the same node keys; nodes left as they are");
    } else {
        let report =
            crate::cleanup::clean_cluster(&deps.client, crate::cleanup::Leaving::GpuCluster)
                .await?;
        tracing::info!(
            gpu_cluster = %name,
            nodes = report.nodes.len(),
            "teardown: the GPUCluster's marks are off the nodes"
        );
    }
    crate::cleanup::remove_finalizer::<GPUCluster>(&deps.client, &name).await?;
    Ok(())
}

/// One GPUCluster, stage by stage.
async fn reconcile(
    cluster: &GPUCluster,
    deps: &Deps,
    memory: &mut Memory,
    diagnoser: &mut Diagnoser,
    policy: Option<&ClusterPolicy>,
    nvidia_operator: Option<&str>,
) -> Result<Requeue, Error> {
    if let Some(other) = nvidia_operator {
        status::stand_aside(deps, cluster, other).await?;
        return Ok(None);
    }
    // Before the first node is labelled, so that a deletion always finds the finalizer.
    if !crate::cleanup::has_finalizer(cluster) {
        crate::cleanup::add_finalizer::<GPUCluster>(
            &deps.client,
            &kube::ResourceExt::name_any(cluster),
        )
        .await?;
    }
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    // Resolve: the node snapshot, and the facts the DRA operands render with.
    let nodes = deps.stores.nodes.snapshot();
    let facts = ClusterFacts {
        namespace: deps.settings.namespace.clone(),
        owner: cluster.controller_owner_ref(&()),
        openshift: deps.resolver.discovered.openshift,
        service_monitor_api: deps.resolver.discovered.service_monitor,
        ..ClusterFacts::default()
    };
    let conflict = validate::conflict(policy, &nodes);
    let validated = validate::validate(cluster, &deps.image_env, conflict.as_ref());
    let desired = render::render(&deps.client, &mut memory.dry_runs, &validated, &facts).await?;
    if !deps
        .gpu_clusters
        .as_ref()
        .is_some_and(|c| owner::still_in_force(c, cluster))
    {
        return Ok(None);
    }
    // The admin-access GPU claims of DCGM, the exporter and the validator need the label on the
    // namespace before their templates are applied.
    namespace::ensure_admin_access(&deps.client, &deps.settings.namespace)
        .await
        .map_err(|source| Error::AdminAccess {
            namespace: deps.settings.namespace.clone(),
            source,
        })?;
    let crds_failure = ensure_compute_domain_crds(deps, memory, &validated).await;
    let applied = owner::apply(
        deps,
        &Owner::of(cluster),
        cluster.meta().uid.as_deref(),
        &desired,
        &mut memory.ledger,
        &optional_kinds(),
    )
    .await?;
    let labels_in_flight = label::label_nodes(&deps.client, &mut memory.labels, &nodes).await?;
    let observed = observe::observe(&deps.client, &deps.stores, diagnoser).await;
    let found = status::Found {
        desired: &desired,
        observed: &observed,
        nodes: &nodes,
        applied: &applied,
        labels_in_flight,
        notes: memory.crds_note.iter().cloned().collect(),
        failures: crds_failure.into_iter().collect(),
    };
    let ready = status::report(deps, cluster, found, now).await?;
    Ok(status::requeue(
        deps,
        ready,
        conflict.is_some(),
        &applied,
        labels_in_flight,
    ))
}
