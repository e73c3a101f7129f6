//! The GPUCluster reconcile (IO): label -> validate (with the API server's dry run of the
//! attribute DeviceClasses) -> render ([`crate::operands::dra_driver`]) -> apply/prune and
//! observe (the ClusterPolicy's machinery, with its own ledger and the GPUCluster as owner) ->
//! status, patched only when it changed.
//!
//! Guarantees and caveats:
//! - Pruning is per operand and owner: this pass prunes only the DRA operands' objects owned by
//!   the GPUCluster, and the ClusterPolicy pass never names the DRA operands, so neither tears
//!   down the other's objects.
//! - A ClusterPolicy whose device plugin runs on the same GPU nodes is a conflict (each GPU would
//!   be handed out twice, once as `nvidia.com/gpu` and once as a DRA device): both statuses say
//!   so and the DRA operands are frozen (nothing applied, nothing deleted) until it is resolved.
//! - An attribute DeviceClass the API server refuses in a dry run (its CEL does not compile), or
//!   that reads an attribute the driver does not publish, freezes only the attribute classes.
//!   A dry run is sent once per distinct rendering, so a steady pass writes nothing.
//! - A GPUCluster being deleted gets no writes: garbage collection removes its objects.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use kube::core::{DeserializeGuard, GroupVersionKind};
use kube::runtime::reflector::Store;
use kube::{Client, Resource, ResourceExt};

use super::observe::Diagnoser;
use super::owner::{self, Again, Error, LabelAttempts, Owner};
use super::plan::{self, Ledger};
use super::scheduler::Requeue;
use super::{Deps, apply, observe, status};
use crate::api::{
    ClusterPolicy, Component, GPUCluster, GpuClusterState, GpuClusterStatus, ImageKind, State,
};
use crate::facts::ClusterFacts;
use crate::model::{MANAGER, Operand};
use crate::nodes::{DEPLOY_OPERANDS, NodeView};
use crate::operands::dra_driver::{self, DEPLOY_LABEL, ValidatedGpuCluster};
use crate::render::{DesiredState, OperandState, Outcome};

/// What the GPUCluster passes keep between passes.
#[derive(Default)]
pub struct Memory {
    ledger: Ledger,
    /// Dry-run verdict per rendered attribute class (by hash): `Err` holds the API's message.
    dry_runs: BTreeMap<String, Result<(), String>>,
    /// Node label patches the cache has not shown yet.
    labels: LabelAttempts,
}

/// The store-less kinds a GPUCluster renders, whose leftovers are pruned by listing.
pub fn optional_kinds() -> Vec<ApiResource> {
    [
        ("resource.k8s.io", "v1", "DeviceClass"),
        (
            "admissionregistration.k8s.io",
            "v1",
            "ValidatingAdmissionPolicy",
        ),
        (
            "admissionregistration.k8s.io",
            "v1",
            "ValidatingAdmissionPolicyBinding",
        ),
    ]
    .into_iter()
    .map(|(g, v, k)| ApiResource::from_gvk(&GroupVersionKind::gvk(g, v, k)))
    .collect()
}

/// The ClusterPolicy whose device plugin would hand out the same GPUs, with a message.
fn conflict(policy: Option<&ClusterPolicy>, nodes: &[Arc<NodeView>]) -> Option<String> {
    let policy = policy.filter(|p| p.metadata.deletion_timestamp.is_none())?;
    if !policy.spec.is_enabled(Component::DevicePlugin) {
        return None;
    }
    let shared = nodes
        .iter()
        .filter(|n| n.has_nfd_gpu() && n.label(DEPLOY_OPERANDS) != Some("false"))
        .count();
    (shared > 0).then(|| {
        format!(
            "ClusterPolicy {} deploys the device plugin on the same {shared} GPU node(s), so each GPU would be allocated twice (nvidia.com/gpu and DRA); set spec.devicePlugin.enabled=false in the ClusterPolicy or delete this GPUCluster (nothing is applied or deleted meanwhile)",
            policy.name_any()
        )
    })
}

/// The line a ClusterPolicy's status carries while a GPUCluster drives the same GPUs.
pub fn policy_note(
    clusters: Option<&Store<DeserializeGuard<GPUCluster>>>,
    policy: &ClusterPolicy,
    nodes: &[Arc<NodeView>],
) -> Option<String> {
    let clusters = clusters?;
    let cluster = clusters
        .state()
        .iter()
        .find_map(|g| g.0.as_ref().ok().cloned())?;
    conflict(Some(policy), nodes)
        .map(|_| format!("GPUCluster {} drives the same GPU nodes with the DRA driver; its operands are frozen until the device plugin is switched off here or the GPUCluster is deleted", cluster.name_any()))
}

/// Validate stage of a GPUCluster: image, attribute classes, and the conflict.
fn validate(
    cluster: &GPUCluster,
    env: &BTreeMap<String, String>,
    conflict: Option<&String>,
) -> ValidatedGpuCluster {
    let mut invalid = BTreeMap::new();
    let image = dra_driver::image(&cluster.spec, env).unwrap_or_else(|e| {
        invalid.insert(Operand::DraDriver, e);
        String::new()
    });
    let lookup = |name: &str| env.get(name).cloned();
    let validator_image = crate::api::resolve(None, ImageKind::Validator, &lookup)
        .map(|r| r.reference)
        .unwrap_or_default();
    let problems = dra_driver::check_classes(&cluster.spec);
    if !problems.is_empty() {
        invalid.insert(Operand::DraDeviceClasses, problems.join("; "));
    }
    if let Some(message) = conflict {
        for operand in Operand::GPU_CLUSTER {
            invalid.insert(operand, message.clone());
        }
    }
    ValidatedGpuCluster {
        name: cluster.name_any(),
        spec: cluster.spec.clone(),
        image,
        validator_image,
        invalid,
    }
}

/// Render stage: the DesiredState of the GPUCluster's operands.
pub fn render(cluster: &ValidatedGpuCluster, facts: &ClusterFacts) -> DesiredState {
    DesiredState {
        operands: Operand::GPU_CLUSTER
            .into_iter()
            .map(|operand| OperandState {
                operand,
                outcome: match cluster.invalid.get(&operand) {
                    Some(message) => Outcome::Invalid(message.clone()),
                    None => dra_driver::render(operand, cluster, facts)
                        .map_or(Outcome::Disabled, Outcome::Rendered),
                },
            })
            .collect(),
    }
}

/// The API server compiles each attribute class's CEL (server-side apply, dry run); a class it
/// refuses freezes the attribute classes with its message.
async fn dry_run_classes(
    client: &Client,
    dry_runs: &mut BTreeMap<String, Result<(), String>>,
    desired: &mut DesiredState,
) -> Result<(), Error> {
    let Some(state) = desired
        .operands
        .iter_mut()
        .find(|s| s.operand == Operand::DraDeviceClasses)
    else {
        return Ok(());
    };
    let Outcome::Rendered(objects) = &state.outcome else {
        return Ok(());
    };
    let resource = &optional_kinds()[0];
    let api: Api<DynamicObject> = Api::all_with(client.clone(), resource);
    let mut refused = Vec::new();
    for class in &objects.dynamic {
        let mut sent = class.clone();
        sent.metadata.owner_references = None;
        let value = serde_json::to_value(&sent).unwrap_or_default();
        let hash = plan::applied_hash(&value).unwrap_or_default();
        let known = dry_runs.get(&hash).cloned();
        let verdict = match known {
            Some(v) => v,
            None => {
                let params = PatchParams::apply(MANAGER).force().dry_run();
                let verdict = match api
                    .patch(&class.name_any(), &params, &Patch::Apply(&sent))
                    .await
                {
                    Ok(_) => Ok(()),
                    Err(kube::Error::Api(s)) if (400..500).contains(&s.code) && s.code != 429 => {
                        Err(s.message)
                    }
                    Err(source) => {
                        return Err(Error::Apply(apply::ApplyError::Apply {
                            kind: "DeviceClass",
                            name: class.name_any(),
                            source,
                        }));
                    }
                };
                dry_runs.insert(hash, verdict.clone());
                verdict
            }
        };
        if let Err(message) = verdict {
            refused.push(format!(
                "DeviceClass {} refused by the API server: {message}",
                class.name_any()
            ));
        }
    }
    if !refused.is_empty() {
        state.outcome = Outcome::Invalid(refused.join("; "));
    }
    Ok(())
}

/// Label stage: GPU nodes get NVIDIA's `nvidia.com/gpu.deploy.dra-driver=true` where no value is
/// set (a user's `false` is respected), with a merge patch on the node's resource version.
/// Returns how many patches the cache has not shown yet.
async fn label_nodes(
    client: &Client,
    attempts: &mut LabelAttempts,
    nodes: &[Arc<NodeView>],
) -> Result<usize, Error> {
    let writes = owner::write_labels(client, nodes, attempts, None, |node| {
        let wanted = node.has_nfd_gpu()
            && node.label(DEPLOY_OPERANDS) != Some("false")
            && node.label(DEPLOY_LABEL).is_none();
        wanted
            .then(|| (DEPLOY_LABEL.to_owned(), Some("true".to_owned())))
            .into_iter()
            .collect()
    })
    .await;
    if let Some(source) = writes.failure {
        return Err(Error::Labels {
            purpose: " for the DRA driver",
            source,
        });
    }
    Ok(attempts.in_flight(nodes))
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

async fn reconcile(
    cluster: &GPUCluster,
    deps: &Deps,
    memory: &mut Memory,
    diagnoser: &mut Diagnoser,
    policy: Option<&ClusterPolicy>,
    nvidia_operator: Option<&str>,
) -> Result<Requeue, Error> {
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let namespace = deps.settings.namespace.as_str();
    let client = &deps.client;
    if let Some(other) = nvidia_operator {
        let status = GpuClusterStatus {
            state: GpuClusterState::Disabled,
            namespace: Some(namespace.to_owned()),
            conditions: None,
            components: None,
        };
        tracing::info!(operator = %other, "NVIDIA's operator is live; the GPUCluster is left to it");
        owner::patch_status(client, cluster, cluster.status.as_ref(), &status).await?;
        return Ok(None);
    }
    let nodes = deps.stores.nodes.snapshot();
    let labels_in_flight = label_nodes(client, &mut memory.labels, &nodes).await?;
    let conflict = conflict(policy, &nodes);
    let validated = validate(cluster, &deps.image_env, conflict.as_ref());
    let facts = ClusterFacts {
        namespace: namespace.to_owned(),
        owner: cluster.controller_owner_ref(&()),
        openshift: deps.resolver.discovered.openshift,
        ..ClusterFacts::default()
    };
    let mut desired = render(&validated, &facts);
    dry_run_classes(client, &mut memory.dry_runs, &mut desired).await?;
    let clusters = deps.gpu_clusters.as_ref();
    if !clusters.is_some_and(|c| owner::still_in_force(c, cluster)) {
        return Ok(None);
    }
    let applied = owner::apply(
        deps,
        &Owner::of(cluster),
        cluster.meta().uid.as_deref(),
        &desired,
        &mut memory.ledger,
        &optional_kinds(),
    )
    .await?;
    let observed = observe::observe(client, &deps.stores, diagnoser).await;
    let unsupported = dra_driver::not_acted_on(&cluster.spec);
    let unsettled = applied.unsettled();
    let computed = status::compute(&status::StatusInputs {
        unsupported: &unsupported,
        labels_in_flight,
        ..owner::status_inputs(
            cluster.metadata.generation,
            namespace,
            &desired,
            &observed,
            &nodes,
            &applied,
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
    let ready = status.state == GpuClusterState::Ready;
    owner::patch_status(client, cluster, cluster.status.as_ref(), &status).await?;
    let again = Again {
        ready,
        // A conflict with the policy's device plugin waits for the user to settle it.
        waits_for_user: conflict.is_some(),
        unsettled: !unsettled.is_empty() || labels_in_flight > 0,
        retry_after: applied.retry_after,
        deadline: None,
    };
    Ok(again.requeue(deps.settings.not_ready_requeue))
}
