//! Label stage of the ClusterPolicy pass (IO: node patches, PriorityClasses).
//!
//! The GPU nodes' deploy labels, which decide where operands run (labeller), beside the apply;
//! then, once validate has checked them, node pools, the GPU memory resource and the layouts by
//! GPU model (node_pools), all on the pass's node snapshot.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use tokio::sync::Semaphore;

use super::{labeller, node_pools};
use crate::api::ClusterPolicy;
use crate::controller::Deps;
use crate::controller::owner::{self, Error, LabelAttempts};
use crate::nodes::{GpuLabelLoss, NodeView};
use crate::workload::{Sandbox, is_container_stack_pod};

/// What the label stage remembers.
#[derive(Default)]
pub struct Memory {
    loss: GpuLabelLoss,
    attempts: LabelAttempts,
    pool_attempts: LabelAttempts,
    priority_classes: node_pools::PriorityClassesDone,
}

/// Of [`owner::PATCH_CONCURRENCY`], the permits a pass holds back while its apply is writing:
/// two label patches stay in flight beside the operand objects, the rest wait for the apply.
pub const HELD_FOR_APPLY: u32 = owner::PATCH_CONCURRENCY as u32 - 2;

/// What the label stage did: what is still in flight.
#[derive(Default)]
pub struct Labelled {
    /// Nodes whose label patch the cache has not shown yet.
    pub in_flight: usize,
    /// When a node's vanished GPU label reaches its grace period, or a conflict is retried.
    pub deadline: Option<Instant>,
    /// The label-loss breaker holds nodes marked (nodes::Breaker::warning).
    pub label_loss_warning: Option<String>,
}

/// The ClusterPolicy's label writes fail with this purpose: none, they are the deploy labels.
fn failed(source: kube::Error) -> Error {
    Error::Labels {
        purpose: "",
        source,
    }
}

/// Label stage: the GPU nodes' deploy labels, no more patches at a time than `gate` admits.
pub async fn label(
    policy: &ClusterPolicy,
    deps: &Deps,
    memory: &mut Memory,
    nodes: &[Arc<NodeView>],
    runtimes: &crate::controller::resolve::KnownRuntimes,
    gate: &Semaphore,
) -> Result<Labelled, Error> {
    if deps.nvidia.holder().is_some() {
        // NVIDIA's operator labels the same keys: leave the nodes to it (decision 14).
        return Ok(Labelled::default());
    }
    let grace = deps.settings.gpu_label_grace;
    let toolkit_primary =
        deps.resolver
            .toolkit_primary(runtimes, &deps.stores, &crate::facts::gpu_nodes(nodes));
    let ready_toolkit_pods: HashSet<(String, String)> = deps
        .stores
        .toolkit_pods
        .snapshot()
        .iter()
        .filter(|p| p.ready && !p.deleting)
        .filter_map(|p| Some((p.node.clone()?, p.daemon_set.clone())))
        .collect();
    // Container-stack pods the operator watches (driver, validator, toolkit), and VFIO manager
    // pods, by node: a workload type switch waits for the leaving stack's.
    let container_pods: HashSet<String> = deps
        .stores
        .upgrade_pods
        .snapshot()
        .iter()
        .filter(|p| p.driver.is_some() || p.validator)
        .filter_map(|p| p.node.clone())
        .chain(
            deps.stores
                .toolkit_pods
                .snapshot()
                .iter()
                .filter_map(|p| p.node.clone()),
        )
        .collect();
    let vgpu_pods: HashSet<String> = deps
        .stores
        .vgpu_pods
        .snapshot()
        .iter()
        .filter_map(|p| p.node.clone())
        .collect();
    let vfio_pods: HashSet<String> = deps
        .stores
        .vfio_pods
        .snapshot()
        .iter()
        .filter_map(|p| p.node.clone())
        .collect();
    let sandbox = crate::workload::Sandbox::of(&policy.spec);
    let unwatched = unwatched_container_pods(deps, nodes, &sandbox, &container_pods).await;
    let mut container_pods = container_pods;
    container_pods.extend(unwatched);
    let labelling = labeller::label_nodes(
        &deps.client,
        nodes,
        &mut memory.loss,
        &mut memory.attempts,
        grace,
        &labeller::Wanted {
            sandbox,
            mig_default_layout: mig_default_layout(&policy.spec),
            mig_by_model: &|node: &NodeView| crate::by_model::names_mig_layout(&policy.spec, node),
            runtime_of: &|node: &str| runtimes.get(node),
            toolkit_primary,
            toolkit_ready: &|node: &str, daemon_set: &str| {
                ready_toolkit_pods.contains(&(node.to_owned(), daemon_set.to_owned()))
            },
            stack_pods_left: &|node: &str| crate::workload::StackPodsLeft {
                container: container_pods.contains(node),
                vfio: vfio_pods.contains(node),
                vgpu: vgpu_pods.contains(node),
            },
            held_back: Default::default(),
        },
        gate,
    )
    .await
    .map_err(failed)?;
    Ok(Labelled {
        in_flight: memory.attempts.in_flight(nodes),
        deadline: labelling.again_at,
        label_loss_warning: labelling.breaker.warning(grace),
    })
}

/// The nodes awaiting a virtual machine owner of their GPUs ([`Sandbox::awaits_vm_owner`]) on
/// which a container-stack pod that the watches do not cover (device plugin, GFD, DCGM...) is
/// still present: the VFIO or vGPU manager must not take GPUs such a pod holds open. Listed on
/// demand, by node and metadata only, so only nodes in the middle of a switch cost a request; a
/// list that fails counts as pods left (the switch waits and looks again).
async fn unwatched_container_pods(
    deps: &Deps,
    nodes: &[Arc<NodeView>],
    sandbox: &Sandbox,
    watched: &HashSet<String>,
) -> Vec<String> {
    let pods: Api<Pod> = Api::namespaced(deps.client.clone(), &deps.settings.namespace);
    let arriving = nodes
        .iter()
        .filter(|n| !watched.contains(&n.name) && sandbox.awaits_vm_owner(n));
    futures::stream::iter(arriving)
        .map(|node| {
            let pods = pods.clone();
            async move {
                // From the API server's cache, which indexes pods by node: a stale answer only
                // delays the key by one look.
                let on_node = ListParams::default()
                    .match_any()
                    .fields(&format!("spec.nodeName={}", node.name));
                let left = match pods.list_metadata(&on_node).await {
                    Ok(list) => list.items.iter().any(|pod| {
                        pod.metadata
                            .labels
                            .as_ref()
                            .is_some_and(is_container_stack_pod)
                    }),
                    Err(e) => {
                        tracing::warn!(node = %node.name, error = %e, "listing the node's operand pods for a workload switch failed; the switch waits");
                        true
                    }
                };
                left.then(|| node.name.clone())
            }
        })
        .buffer_unordered(owner::PATCH_CONCURRENCY)
        .filter_map(std::future::ready)
        .collect()
        .await
}

/// Node-pool stage: node pools, the GPU memory resource and the layouts by GPU model (our
/// extensions), on the pass's node snapshot. It follows validate, which checks each model's
/// layout against the sharing and MIG configs before any node is labelled with it; `labelled`
/// gets its conflict retry.
pub async fn pools(
    policy: &ClusterPolicy,
    deps: &Deps,
    memory: &mut Memory,
    nodes: &[Arc<NodeView>],
    by_model: &crate::by_model::ByModel,
    labelled: &mut Labelled,
) -> Result<(), Error> {
    if deps.nvidia.holder().is_some() {
        return Ok(());
    }
    let retry = node_pools::reconcile_nodes(
        &deps.client,
        nodes,
        &policy.spec,
        by_model,
        &mut memory.pool_attempts,
    )
    .await
    .map_err(failed)?;
    node_pools::reconcile_priority_classes(&deps.client, policy, &mut memory.priority_classes)
        .await
        .map_err(failed)?;
    labelled.deadline = labelled.deadline.into_iter().chain(retry).min();
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
