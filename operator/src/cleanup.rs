//! Teardown (IO): takes off the nodes what the operator put there, deletes the node-pool
//! PriorityClasses no pod holds, and lets a deleted ClusterPolicy go by removing the finalizer
//! that kept it for this (decision 17). The ClusterPolicy pass runs it when the policy in force
//! is deleted; `gpu-operator cleanup` runs it when no operator does.
//!
//! Guarantees and caveats:
//! - Only what carries our mark comes off (engine `teardown::plan`, decision 19). Each node is
//!   read in full and patched with its `resourceVersion` as a precondition; a node that changed
//!   meanwhile is read again.
//! - Operands are not touched: garbage collection removes them with the policy.
//! - A PriorityClass that a pod which has not finished names stays (its pods keep their
//!   priority and a controller recreating them would fail without it); it loses any owner
//!   reference to the policy so that garbage collection keeps it too.
//! - Safe to run twice, and beside an operator doing the same.

use std::collections::BTreeSet;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{Api, DeleteParams, ListParams, ObjectList, Patch, PatchParams};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::api::{ClusterPolicy, GPUCluster, NVIDIADriver};
use crate::model::{MANAGED_BY_LABEL, MANAGER};
use crate::node_pools::PRIORITY_CLASS_LABEL;
use crate::teardown::{self, FINALIZER, NodeCleanup, Options};

/// Nodes read and patched at once.
const CONCURRENCY: usize = 16;
/// Objects per page of a list.
const PAGE: u32 = 500;
/// Writes tried on an object that keeps changing under us before giving up for this round.
const ATTEMPTS: usize = 5;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("listing {what}: {source}")]
    List {
        what: &'static str,
        #[source]
        source: kube::Error,
    },
    #[error("cleaning node {node}: {source}")]
    Node {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error("node {node} changed {ATTEMPTS} times while being cleaned; run the cleanup again")]
    NodeBusy { node: String },
    #[error("PriorityClass {name}: {source}")]
    PriorityClass {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("writing finalizer {FINALIZER} of {kind} {name}: {source}")]
    Finalizer {
        kind: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("{kind} {name} changed {ATTEMPTS} times while its finalizer was written; try again")]
    FinalizerBusy { kind: &'static str, name: String },
}

/// What a teardown took off the cluster.
#[derive(Debug, Default)]
pub struct Report {
    /// Each node something came off, and what.
    pub nodes: Vec<(String, NodeCleanup)>,
    pub priority_classes_deleted: Vec<String>,
    /// PriorityClasses kept for the pods that name them.
    pub priority_classes_kept: Vec<String>,
}

/// Every object of `api` matching `params`, page by page.
async fn list_all<K>(api: &Api<K>, params: &ListParams, what: &'static str) -> Result<Vec<K>, Error>
where
    K: Clone + DeserializeOwned + std::fmt::Debug,
{
    let mut out = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let mut page = params.clone().limit(PAGE);
        if let Some(t) = token.take() {
            page = page.continue_token(&t);
        }
        let list: ObjectList<K> = api
            .list(&page)
            .await
            .map_err(|source| Error::List { what, source })?;
        out.extend(list.items);
        match list.metadata.continue_.filter(|t| !t.is_empty()) {
            Some(t) => token = Some(t),
            None => return Ok(out),
        }
    }
}

/// What goes away, and so whose marks come off the nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leaving {
    /// The ClusterPolicy in force: its marks and PriorityClasses, and a GPUCluster's marks
    /// when no GPUCluster is left.
    ClusterPolicy,
    /// The GPUCluster: its marks, and a ClusterPolicy's when none is in force (a GPUCluster
    /// alone marks GPU nodes for NVIDIADriver pools).
    GpuCluster,
}

/// Cleans the nodes, and the PriorityClasses when no ClusterPolicy stays; logs each thing it
/// removed.
pub async fn clean_cluster(client: &Client, leaving: Leaving) -> Result<Report, Error> {
    let options = Options {
        keep_gpu_present: nvidia_drivers_exist(client).await?,
        keep_policy_marks: leaving == Leaving::GpuCluster && policy_in_force(client).await?,
        gpu_cluster_marks: leaving == Leaving::GpuCluster || !gpu_cluster_stays(client).await?,
    };
    if options.keep_gpu_present {
        tracing::info!(
            "teardown: NVIDIADrivers exist and their driver DaemonSets select on nvidia.com/gpu.present; the label stays"
        );
    }
    let nodes = clean_nodes(client, options).await?;
    let (deleted, kept) = if options.keep_policy_marks {
        (Vec::new(), Vec::new())
    } else {
        clean_priority_classes(client).await?
    };
    Ok(Report {
        nodes,
        priority_classes_deleted: deleted,
        priority_classes_kept: kept,
    })
}

/// Whether a ClusterPolicy that is not being deleted exists.
async fn policy_in_force(client: &Client) -> Result<bool, Error> {
    let api: Api<ClusterPolicy> = Api::all(client.clone());
    let policies = list_all(&api, &ListParams::default(), "ClusterPolicies").await?;
    Ok(policies
        .iter()
        .any(|p| p.metadata.deletion_timestamp.is_none()))
}

/// Whether a GPUCluster that is not being deleted exists.
async fn gpu_cluster_stays(client: &Client) -> Result<bool, Error> {
    let api: Api<GPUCluster> = Api::all(client.clone());
    match api.list_metadata(&ListParams::default()).await {
        Ok(list) => Ok(list
            .items
            .iter()
            .any(|c| c.metadata.deletion_timestamp.is_none())),
        // The GPUCluster CRD is not installed: there are none.
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(false),
        Err(source) => Err(Error::List {
            what: "GPUClusters",
            source,
        }),
    }
}

async fn nvidia_drivers_exist(client: &Client) -> Result<bool, Error> {
    let api: Api<NVIDIADriver> = Api::all(client.clone());
    match api.list_metadata(&ListParams::default().limit(1)).await {
        Ok(list) => Ok(!list.items.is_empty()),
        // The NVIDIADriver CRD is not installed: there are none.
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(false),
        Err(source) => Err(Error::List {
            what: "NVIDIADrivers",
            source,
        }),
    }
}

async fn clean_nodes(
    client: &Client,
    options: Options,
) -> Result<Vec<(String, NodeCleanup)>, Error> {
    let api: Api<Node> = Api::all(client.clone());
    let nodes = list_all(&api, &ListParams::default(), "nodes").await?;
    let results: Vec<Result<Option<(String, NodeCleanup)>, Error>> =
        futures::stream::iter(nodes.into_iter().map(|node| {
            let api = api.clone();
            async move { clean_node(&api, node, options).await }
        }))
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    let mut cleaned = Vec::new();
    for result in results {
        if let Some((name, cleanup)) = result? {
            cleaned.push((name, cleanup));
        }
    }
    cleaned.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(cleaned)
}

/// Takes our marks off one node; `None` when it carried none (or is gone).
async fn clean_node(
    api: &Api<Node>,
    mut node: Node,
    options: Options,
) -> Result<Option<(String, NodeCleanup)>, Error> {
    let name = node.name_any();
    let failed = |source| Error::Node {
        node: name.clone(),
        source,
    };
    let mut removed = NodeCleanup::default();
    for _ in 0..ATTEMPTS {
        let cleanup = teardown::plan(&node, options);
        if cleanup.is_empty() {
            return Ok((!removed.is_empty()).then(|| (name.clone(), removed)));
        }
        if let Some(patch) = cleanup.status_patch() {
            node = match api
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(node) => node,
                Err(kube::Error::Api(e)) if e.code == 404 => return Ok(None),
                Err(e) => return Err(failed(e)),
            };
            removed.capacity.extend(cleanup.capacity.iter().cloned());
        }
        let Some(patch) = cleanup.object_patch(node.resource_version().as_deref()) else {
            tracing::info!(node = %name, removed = %removed, "teardown: removed the operator's marks from node");
            return Ok(Some((name, removed)));
        };
        match api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {
                let NodeCleanup {
                    labels,
                    taints,
                    annotations,
                    capacity: _,
                    uncordon,
                    ..
                } = cleanup;
                removed.labels.extend(labels);
                removed.taints.extend(taints);
                removed.annotations.extend(annotations);
                removed.uncordon |= uncordon;
                tracing::info!(node = %name, removed = %removed, "teardown: removed the operator's marks from node");
                return Ok(Some((name, removed)));
            }
            Err(kube::Error::Api(e)) if e.code == 404 => return Ok(None),
            Err(kube::Error::Api(e)) if e.code == 409 => match api.get_opt(&name).await {
                Ok(Some(fresh)) => node = fresh,
                Ok(None) => return Ok(None),
                Err(e) => return Err(failed(e)),
            },
            Err(e) => return Err(failed(e)),
        }
    }
    Err(Error::NodeBusy { node: name })
}

/// Deletes the operator's PriorityClasses that no unfinished pod names; keeps the others (and
/// frees them of owner references, so that garbage collection keeps them as well). Returns
/// (deleted, kept).
async fn clean_priority_classes(client: &Client) -> Result<(Vec<String>, Vec<String>), Error> {
    let api: Api<PriorityClass> = Api::all(client.clone());
    let ours = list_all(
        &api,
        &ListParams::default().labels(&format!(
            "{PRIORITY_CLASS_LABEL},{MANAGED_BY_LABEL}={MANAGER}"
        )),
        "the operator's PriorityClasses",
    )
    .await?;
    if ours.is_empty() {
        return Ok((Vec::new(), Vec::new()));
    }
    // Pods cannot be selected by priorityClassName on the server: one paged list, only here.
    let pods = list_all(
        &Api::<Pod>::all(client.clone()),
        &ListParams::default(),
        "pods",
    )
    .await?;
    let held: BTreeSet<String> = ours
        .iter()
        .map(|pc| pc.name_any())
        .filter(|name| {
            pods.iter().any(|pod| {
                teardown::pod_holds_priority_class(
                    pod.spec
                        .as_ref()
                        .and_then(|s| s.priority_class_name.as_deref()),
                    pod.status.as_ref().and_then(|s| s.phase.as_deref()),
                    name,
                )
            })
        })
        .collect();
    let (mut deleted, mut kept) = (Vec::new(), Vec::new());
    for pc in &ours {
        let name = pc.name_any();
        let failed = |source| Error::PriorityClass {
            name: name.clone(),
            source,
        };
        if held.contains(&name) {
            if pc
                .meta()
                .owner_references
                .as_ref()
                .is_some_and(|o| !o.is_empty())
            {
                let patch = json!({"metadata": {"ownerReferences": null}});
                api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(failed)?;
            }
            tracing::info!(priority_class = %name, "teardown: PriorityClass kept: pods that have not finished name it");
            kept.push(name);
            continue;
        }
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => {
                tracing::info!(priority_class = %name, "teardown: PriorityClass deleted");
                deleted.push(name);
            }
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(failed(e)),
        }
    }
    Ok((deleted, kept))
}

/// Whether `object` (the ClusterPolicy or the GPUCluster) carries the teardown finalizer.
pub fn has_finalizer(object: &impl Resource) -> bool {
    object
        .meta()
        .finalizers
        .iter()
        .flatten()
        .any(|f| f == FINALIZER)
}

/// Adds the teardown finalizer to the cluster-scoped `K` named `name` unless it has it or is
/// being deleted (the API server refuses new finalizers then). Returns whether it wrote.
pub async fn add_finalizer<K: Owner>(client: &Client, name: &str) -> Result<bool, Error> {
    edit_finalizers::<K>(client, name, |object| {
        (object.meta().deletion_timestamp.is_none() && !has_finalizer(object)).then(|| {
            let mut finalizers = object.finalizers().to_vec();
            finalizers.push(FINALIZER.to_owned());
            finalizers
        })
    })
    .await
}

/// Removes the teardown finalizer from the cluster-scoped `K` named `name`. Returns whether it
/// wrote.
pub async fn remove_finalizer<K: Owner>(client: &Client, name: &str) -> Result<bool, Error> {
    let wrote = edit_finalizers::<K>(client, name, |object| {
        has_finalizer(object).then(|| {
            object
                .finalizers()
                .iter()
                .filter(|f| *f != FINALIZER)
                .cloned()
                .collect()
        })
    })
    .await?;
    if wrote {
        tracing::info!(kind = %K::kind(&()), %name, "teardown: finalizer removed; it can go");
    }
    Ok(wrote)
}

/// What carries the teardown finalizer: a cluster-scoped resource of ours.
pub trait Owner:
    Resource<DynamicType = (), Scope = kube::core::ClusterResourceScope>
    + Clone
    + DeserializeOwned
    + std::fmt::Debug
{
}

impl<K> Owner for K where
    K: Resource<DynamicType = (), Scope = kube::core::ClusterResourceScope>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
{
}

/// Reads `name` and writes the finalizer list `edit` returns (`None`: no change), with the
/// read's `resourceVersion` as a precondition, reading again after a conflict (another
/// finalizer, such as garbage collection's, may be written meanwhile).
async fn edit_finalizers<K: Owner>(
    client: &Client,
    name: &str,
    edit: impl Fn(&K) -> Option<Vec<String>>,
) -> Result<bool, Error> {
    let api: Api<K> = Api::all(client.clone());
    let kind: &'static str = match K::kind(&()) {
        std::borrow::Cow::Borrowed(kind) => kind,
        std::borrow::Cow::Owned(_) => "object",
    };
    let failed = |source| Error::Finalizer {
        kind,
        name: name.to_owned(),
        source,
    };
    for _ in 0..ATTEMPTS {
        let Some(object) = api.get_opt(name).await.map_err(failed)? else {
            return Ok(false);
        };
        let Some(finalizers) = edit(&object) else {
            return Ok(false);
        };
        let patch = json!({"metadata": {
            "finalizers": finalizers,
            "resourceVersion": object.resource_version(),
        }});
        match api
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => return Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(kube::Error::Api(e)) if e.code == 404 => return Ok(false),
            Err(e) => return Err(failed(e)),
        }
    }
    Err(Error::FinalizerBusy {
        kind,
        name: name.to_owned(),
    })
}
