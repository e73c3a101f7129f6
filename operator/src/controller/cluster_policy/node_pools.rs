//! Label stage, node pools and the GPU memory resource (IO).
//!
//! For each node whose record says it was not brought to the current want
//! (`node_pools::needs_work`, from the metadata cache, no request), the node is read in full and
//! patched: its status first (the memory resource in capacity and allocatable, only when it
//! differs), then labels, taints and the record in one merge patch carrying the `resourceVersion`
//! of that read. A conflict is retried on a later pass.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};

use crate::api::{ClusterPolicy, ClusterPolicySpec, PoolPriorityClass};
use crate::by_model::ByModel;
use crate::controller::owner::LabelAttempts;
use crate::model::{MANAGED_BY_LABEL, MANAGER};
use crate::node_pools::{
    PRIORITY_CLASS_LABEL, Record, desired, desired_priority_classes, needs_work, object_patch,
    priority_class_object, priority_class_plan, record_annotation, status_patch,
};
use crate::nodes::NodeView;

/// How soon to look again at a node whose patch met a newer version.
const CONFLICT_RETRY: Duration = Duration::from_millis(500);
/// Nodes read and patched at once.
const CONCURRENCY: usize = 16;

/// Node writes under the operator's field manager: a label it wrote is then known as its own
/// (`node_pools::label_written_by_operator`).
fn params() -> PatchParams {
    PatchParams {
        field_manager: Some(MANAGER.to_owned()),
        ..PatchParams::default()
    }
}

/// What happened on one node.
enum Outcome {
    Unchanged,
    Written,
    Conflict,
}

async fn bring(
    api: &Api<Node>,
    name: &str,
    spec: &ClusterPolicySpec,
    by_model: &ByModel,
    view: &NodeView,
) -> Result<Outcome, kube::Error> {
    let want = desired(spec, by_model, view);
    let Some(mut node) = api.get_opt(name).await? else {
        return Ok(Outcome::Unchanged);
    };
    let annotation = record_annotation(node.metadata.annotations.as_ref());
    let record = Record::parse(annotation.as_deref()).unwrap_or_default();
    let mut wrote = false;
    if let Some(patch) = status_patch(&node, &record, &want) {
        node = api
            .patch_status(name, &params(), &Patch::Merge(&patch))
            .await?;
        wrote = true;
    }
    let (patch, conflicts) = object_patch(&node, &record, &want);
    if !conflicts.is_empty() {
        tracing::warn!(node = %name, keys = ?conflicts, "node pool: someone else holds these labels or taints with other values; left alone");
    }
    if let Some(patch) = patch {
        match api.patch(name, &params(), &Patch::Merge(&patch)).await {
            Ok(_) => wrote = true,
            Err(kube::Error::Api(e)) if e.code == 409 => return Ok(Outcome::Conflict),
            Err(e) => return Err(e),
        }
    }
    Ok(if wrote {
        Outcome::Written
    } else {
        Outcome::Unchanged
    })
}

/// Brings every node to what `spec.nodePools`, `spec.gpuMemoryResource` and
/// `spec.layoutsByModel` (checked: `by_model`) want. Returns when
/// to look again after a conflict, if one happened. `attempts` holds the nodes written whose
/// write the cache has not shown yet: they are not written again until it does.
pub async fn reconcile_nodes(
    client: &Client,
    nodes: &[Arc<NodeView>],
    spec: &ClusterPolicySpec,
    by_model: &ByModel,
    attempts: &mut LabelAttempts,
) -> Result<Option<Instant>, kube::Error> {
    let api: Api<Node> = Api::all(client.clone());
    let mut work = Vec::new();
    for node in nodes {
        if !needs_work(node, &desired(spec, by_model, node)) {
            attempts.forget(&node.name);
            continue;
        }
        if attempts.pending(node) {
            continue;
        }
        attempts.record(node);
        work.push(node);
    }
    let results: Vec<_> = futures::stream::iter(work.into_iter().map(|node| {
        let api = api.clone();
        async move { (node, bring(&api, &node.name, spec, by_model, node).await) }
    }))
    .buffer_unordered(CONCURRENCY)
    .collect()
    .await;
    let mut retry = None;
    let mut failure = None;
    for (node, result) in results {
        match result {
            Ok(Outcome::Written) => tracing::info!(node = %node.name, "node pool: node updated"),
            Ok(Outcome::Unchanged) => {}
            Ok(Outcome::Conflict) => {
                attempts.forget(&node.name);
                retry = Some(Instant::now() + CONFLICT_RETRY);
            }
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {
                attempts.forget(&node.name);
                retry = Some(Instant::now() + CONFLICT_RETRY);
            }
            Err(e) => {
                attempts.forget(&node.name);
                failure.get_or_insert(e);
            }
        }
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(retry),
    }
}

/// The PriorityClasses last brought to the cluster; `None` until the first pass has listed
/// them. While the policy asks for the same set, no request is made.
pub type PriorityClassesDone = Option<Vec<PoolPriorityClass>>;

/// Creates, recreates, updates and deletes the operator's PriorityClasses so that they are
/// what `policy`'s `nodePools.priorityClasses` lists. They carry our managed-by label and no
/// owner reference (see below). A name taken by a PriorityClass someone
/// else created is reported and left alone.
pub async fn reconcile_priority_classes(
    client: &Client,
    policy: &ClusterPolicy,
    done: &mut PriorityClassesDone,
) -> Result<(), kube::Error> {
    let want = desired_priority_classes(&policy.spec);
    if done.as_ref() == Some(&want) {
        return Ok(());
    }
    let api: Api<PriorityClass> = Api::all(client.clone());
    let ours = api
        .list(&ListParams::default().labels(&format!(
            "{PRIORITY_CLASS_LABEL},{MANAGED_BY_LABEL}={MANAGER}"
        )))
        .await?
        .items;
    let plan = priority_class_plan(&ours, &want);
    for name in plan
        .delete
        .iter()
        .chain(plan.recreate.iter().map(|pc| &pc.name))
    {
        match api.delete(name, &DeleteParams::default()).await {
            Ok(_) => tracing::info!(priority_class = %name, "node pool: PriorityClass deleted"),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    for pc in plan.create.iter().chain(&plan.recreate) {
        match api
            .create(&PostParams::default(), &priority_class_object(pc, None))
            .await
        {
            Ok(_) => tracing::info!(priority_class = %pc.name, "node pool: PriorityClass created"),
            Err(kube::Error::Api(e)) if e.code == 409 => tracing::warn!(
                priority_class = %pc.name,
                "node pool: a PriorityClass of this name exists and was not created by the operator; left alone"
            ),
            Err(e) => return Err(e),
        }
    }
    for pc in &plan.update {
        let patch = serde_json::json!({ "description": pc.description });
        api.patch(&pc.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
    }
    // Workloads name these classes: garbage collection must not take them with the policy
    // (a foreground deletion would, before the teardown can look for pods that use them). The
    // teardown deletes those no pod holds. Owner references of earlier releases come off.
    for live in ours.iter().filter(|pc| {
        pc.metadata
            .owner_references
            .as_ref()
            .is_some_and(|o| !o.is_empty())
            && !plan
                .delete
                .iter()
                .any(|name| Some(name) == pc.metadata.name.as_ref())
            && !plan
                .recreate
                .iter()
                .any(|r| Some(&r.name) == pc.metadata.name.as_ref())
    }) {
        let patch = serde_json::json!({"metadata": {"ownerReferences": null}});
        let name = live.metadata.name.clone().unwrap_or_default();
        api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
    }
    *done = Some(want);
    Ok(())
}
