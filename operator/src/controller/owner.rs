//! Apply, label, status and requeue stages shared by the three controllers (IO).
//!
//! What an owner of operand objects needs whatever its kind (ClusterPolicy, GPUCluster,
//! NVIDIADriver):
//!
//! - apply and prune with the owner's ledger ([`apply`]);
//! - the status inputs every owner fills alike ([`status_inputs`]), conditions that keep their
//!   transition time ([`keep_transition_times`]) and the status patch, sent only when the status
//!   changed ([`patch_status`], decision 9);
//! - the requeue rule ([`Again`]);
//! - node label writes: a merge patch with the node's `resourceVersion` as precondition
//!   (decision 2), and one bookkeeping of patches the cache has not shown yet
//!   ([`LabelAttempts`], [`write_labels`]);
//! - whether a kind's CRD is served ([`served`]) and whether an owner is still in force
//!   ([`still_in_force`], decision 17);
//! - the error type, which names the owner ([`Error`]).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::{self, Debug, Display};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, ApiResource, ListParams, Patch, PatchParams};
use kube::core::DeserializeGuard;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};
use tokio::sync::Semaphore;

use super::apply::{self, ApplyError, ApplyReport};
use super::observe::Observed;
use super::plan::Ledger;
use super::scheduler::Requeue;
use super::status::StatusInputs;
use super::{Deps, vendored_crds};
use crate::model::Operand;
use crate::nodes::{LabelPatch, NodeView};
use crate::render::DesiredState;

/// The object a pass works for, as errors and logs name it: `NVIDIADriver pool-a`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub kind: &'static str,
    pub name: String,
}

impl Owner {
    pub fn of<K: Resource<DynamicType = ()>>(object: &K) -> Self {
        Owner {
            // Resource::kind is a borrowed static str for every typed resource.
            kind: match K::kind(&()) {
                std::borrow::Cow::Borrowed(kind) => kind,
                std::borrow::Cow::Owned(_) => "object",
            },
            name: object.name_any(),
        }
    }
}

impl Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.kind, self.name)
    }
}

/// Why a pass failed. The ClusterPolicy's status shows its pass's error, so those messages are
/// what a user reads.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("resolving cluster facts: {0}")]
    Resolve(#[source] kube::Error),
    #[error(transparent)]
    Apply(#[from] ApplyError),
    #[error("patching status of {owner}: {source}")]
    Status {
        owner: Owner,
        #[source]
        source: kube::Error,
    },
    #[error(transparent)]
    Crds(#[from] vendored_crds::Error),
    #[error("driver upgrades: {0}")]
    Upgrade(#[source] kube::Error),
    /// `purpose` says for what, when not the ClusterPolicy's deploy labels.
    #[error("labelling nodes{purpose}: {source}")]
    Labels {
        purpose: &'static str,
        #[source]
        source: kube::Error,
    },
    #[error("selecting the GPU nodes of {owner}: {source}")]
    Select {
        owner: Owner,
        #[source]
        source: kube::Error,
    },
    #[error("labelling namespace {namespace} for privileged pods (Pod Security): {source}")]
    Namespace {
        namespace: String,
        #[source]
        source: kube::Error,
    },
    #[error(
        "labelling namespace {namespace} resource.kubernetes.io/admin-access=true, which the GPUCluster's admin-access GPU claims (DCGM, exporter, DRA validator) need (the operator's Role needs patch on its namespace): {source}"
    )]
    AdminAccess {
        namespace: String,
        #[source]
        source: kube::Error,
    },
    #[error("teardown of a deleted ClusterPolicy or GPUCluster: {0}")]
    Teardown(#[from] crate::cleanup::Error),
}

impl Error {
    /// Short stable reason for events and metric labels.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::Resolve(_) => "ResolveFailed",
            Error::Apply(_) => "ApplyFailed",
            Error::Status { .. } => "StatusFailed",
            // Selecting a pool's nodes is the first half of its labelling.
            Error::Labels { .. } | Error::Select { .. } => "LabelFailed",
            Error::Crds(_) => "CrdsFailed",
            Error::Upgrade(_) => "UpgradeFailed",
            Error::Namespace { .. } | Error::AdminAccess { .. } => "NamespaceLabelFailed",
            Error::Teardown(_) => "TeardownFailed",
        }
    }
}

/// Apply stage for one owner: its desired objects, then the pruning of what it owns and no
/// longer renders (controller::apply). `optional` are the store-less kinds it may own, whose
/// leftovers are found by listing.
pub async fn apply(
    deps: &Deps,
    owner: &Owner,
    owner_uid: Option<&str>,
    desired: &DesiredState,
    ledger: &mut Ledger,
    optional: &[ApiResource],
) -> Result<ApplyReport, Error> {
    // Taken for the apply and put back after it, also on failure: a pass abandoned at its
    // deadline leaves an empty ledger (the next pass compares with the live objects), never a
    // half-written one.
    let mut taken = std::mem::take(ledger);
    let applied = apply::apply(
        &deps.client,
        desired,
        &deps.stores,
        &mut taken,
        owner_uid,
        optional,
        &deps.settings.namespace,
    )
    .await;
    *ledger = taken;
    let report = applied?;
    if !report.applied.is_empty() || !report.pruned.is_empty() {
        tracing::info!(owner = %owner, applied = ?report.applied, pruned = ?report.pruned, unchanged = report.unchanged, "applied");
    }
    Ok(report)
}

static NO_CONFIG_PROBLEMS: BTreeMap<Operand, String> = BTreeMap::new();
static NONE_EXPLAINED: BTreeSet<String> = BTreeSet::new();

/// The status inputs every owner fills the same way, from its desired state, what the caches
/// show and what its apply did; each owner sets its own on top (struct update syntax).
#[allow(clippy::too_many_arguments)]
pub fn status_inputs<'a>(
    generation: Option<i64>,
    namespace: &'a str,
    desired: &'a DesiredState,
    observed: &'a Observed,
    nodes: &'a [Arc<NodeView>],
    applied: &'a ApplyReport,
    unsettled: &'a [String],
    now: Time,
) -> StatusInputs<'a> {
    StatusInputs {
        generation,
        namespace,
        desired,
        daemon_sets: &observed.daemon_sets,
        deployments: &observed.deployments,
        nodes,
        failures: &[],
        config_problems: &NO_CONFIG_PROBLEMS,
        notes: &[],
        warnings: &[],
        unsupported: &[],
        diagnoses: &observed.diagnoses,
        rejected: &applied.rejected,
        unsettled,
        labels_in_flight: 0,
        explained: &NONE_EXPLAINED,
        driver_upgrade: None,
        previous: None,
        now,
    }
}

/// Conditions whose status did not change keep their last transition time (no status write
/// on a steady pass).
pub fn keep_transition_times(
    previous: Option<Vec<Condition>>,
    conditions: Option<Vec<Condition>>,
) -> Option<Vec<Condition>> {
    let before = previous.unwrap_or_default();
    conditions.map(|cs| {
        cs.into_iter()
            .map(|mut c| {
                if let Some(old) = before
                    .iter()
                    .find(|o| o.type_ == c.type_ && o.status == c.status)
                {
                    c.last_transition_time = old.last_transition_time.clone();
                }
                c
            })
            .collect()
    })
}

/// Status stage, the writing half: a merge patch of `status` onto `object`, only when it differs
/// from `previous` (what the object shows now). Returns whether it wrote.
pub async fn patch_status<K, S>(
    client: &Client,
    object: &K,
    previous: Option<&S>,
    status: &S,
) -> Result<bool, Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
    S: Serialize + PartialEq,
{
    if previous == Some(status) {
        return Ok(false);
    }
    let api: Api<K> = Api::all(client.clone());
    api.patch_status(
        &object.name_any(),
        &PatchParams::default(),
        &Patch::Merge(json!({ "status": status })),
    )
    .await
    .map_err(|source| Error::Status {
        owner: Owner::of(object),
        source,
    })?;
    Ok(true)
}

/// How soon a pass that wrote something looks again if no watch event comes first: our own
/// writes wake the next pass through the watches, but a write the API server found identical
/// wakes nothing.
pub const UNSETTLED_REQUEUE: Duration = Duration::from_secs(2);

/// Requeue stage: when an owner wants to be looked at again without a watch event. One rule
/// for every owner: the earliest of its reasons.
#[derive(Debug, Default, Clone, Copy)]
pub struct Again {
    /// Everything the owner runs is ready.
    pub ready: bool,
    /// What is not ready waits for the user (an invalid input, a refused object, a conflict
    /// with another owner): the fix arrives as a watch event, so no timer.
    pub waits_for_user: bool,
    /// Writes of ours (objects, node labels) the caches have not shown yet.
    pub unsettled: bool,
    /// When a refused object that may pass later is sent again (controller::apply).
    pub retry_after: Option<Duration>,
    /// The owner's own next moment: a grace period ending, an upgrade step, a difference that
    /// is explained once it lasts.
    pub deadline: Option<Duration>,
}

impl Again {
    /// `not_ready` is how soon anything else not ready is looked at again.
    pub fn requeue(&self, not_ready: Duration) -> Requeue {
        let not_ready = (!self.ready && !self.waits_for_user).then_some(not_ready);
        let unsettled = self.unsettled.then_some(UNSETTLED_REQUEUE);
        not_ready
            .into_iter()
            .chain(unsettled)
            .chain(self.retry_after)
            .chain(self.deadline)
            .min()
    }
}

/// Whether the CRD of `K` is served (a cluster without it has nothing to watch).
pub async fn served<K>(client: &Client) -> bool
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
{
    let api: Api<K> = Api::all(client.clone());
    api.list_metadata(&ListParams::default().limit(1))
        .await
        .is_ok()
}

/// Whether `object` is still in `store` (the same object, not one recreated under its name) and
/// not being deleted: a pass that started before a deletion request stops before it writes
/// (decision 17).
pub fn still_in_force<K>(store: &Store<DeserializeGuard<K>>, object: &K) -> bool
where
    K: Resource<DynamicType = ()> + Clone,
{
    store
        .get(&ObjectRef::new(&object.name_any()))
        .and_then(|guard| guard.0.as_ref().ok().cloned())
        .is_some_and(|live| {
            live.meta().uid == object.meta().uid && live.meta().deletion_timestamp.is_none()
        })
}

/// The `resourceVersion` each node had when an owner last patched its labels (or met a
/// conflict). Until the cache shows a newer version, the cache has not seen our write (or the
/// newer node that refused it) and patching again would repeat the same request: with hundreds
/// of nodes and a pass every few milliseconds during convergence, that is hundreds of needless
/// writes. Each owner keeps its own (they write different keys).
#[derive(Debug, Default)]
pub struct LabelAttempts {
    at_version: BTreeMap<String, Option<String>>,
}

impl LabelAttempts {
    /// Whether `node` was patched at exactly the version the cache still shows; forgets the
    /// attempt once the cache shows another.
    pub fn pending(&mut self, node: &NodeView) -> bool {
        match self.at_version.get(&node.name) {
            Some(version) if *version == node.resource_version => true,
            Some(_) => {
                self.at_version.remove(&node.name);
                false
            }
            None => false,
        }
    }

    /// How many of `nodes` (a snapshot) were patched at exactly the version the snapshot shows:
    /// writes of ours the snapshot does not reflect.
    pub fn in_flight(&self, nodes: &[Arc<NodeView>]) -> usize {
        nodes
            .iter()
            .filter(|n| self.at_version.get(&n.name) == Some(&n.resource_version))
            .count()
    }

    /// Forgets nodes that no longer exist.
    pub fn retain_nodes(&mut self, exists: impl Fn(&str) -> bool) {
        self.at_version.retain(|name, _| exists(name));
    }

    /// Nothing of ours is in flight for `node` (the cache shows what it needs), or its write
    /// failed and may be sent again at once.
    pub fn forget(&mut self, node: &str) {
        self.at_version.remove(node);
    }

    /// A patch of `node` at the version the cache shows is about to be sent.
    pub fn record(&mut self, node: &NodeView) {
        self.at_version
            .insert(node.name.clone(), node.resource_version.clone());
    }
}

/// Node patches in flight at once. One at a time, every patch waits out a round trip to a busy
/// API server (tens of milliseconds while a thousand new nodes come up); sixteen label 1,000
/// nodes in seconds and stay far below the API server's default of 200 mutating requests in
/// flight.
pub const PATCH_CONCURRENCY: usize = 16;

/// The merge patch of `changes` (`None` removes a label) with `node`'s version as precondition.
pub fn label_patch(node: &NodeView, changes: &LabelPatch) -> Value {
    let labels: Map<String, Value> = changes
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                v.as_ref().map_or(Value::Null, |v| Value::String(v.clone())),
            )
        })
        .collect();
    let mut metadata = json!({ "labels": labels });
    if let Some(rv) = &node.resource_version {
        metadata["resourceVersion"] = Value::String(rv.clone());
    }
    json!({ "metadata": metadata })
}

/// What [`write_labels`] did.
#[derive(Debug, Default)]
pub struct LabelWrites<'n> {
    /// Nodes patched, with what was finally written (after a conflict, what the node read
    /// again still needed; empty when that was nothing).
    pub written: Vec<(&'n NodeView, LabelPatch)>,
    /// Nodes whose patch met a newer version again: the next pass retries them.
    pub conflicted: usize,
    /// Nodes left alone because our last patch of them is not in the cache yet.
    pub pending: usize,
    /// The first failure other than a conflict or a vanished node; the other nodes were
    /// still written.
    pub failure: Option<kube::Error>,
}

/// Label stage, the writing half: merge-patches the labels `changes` asks for on each of
/// `nodes` (a snapshot of every node) with the node's `resourceVersion` as precondition, never
/// a forced apply (decision 2), [`PATCH_CONCURRENCY`] at a time and no more than `gate` admits.
/// Nodes whose last patch the cache has not shown yet are left alone ([`LabelAttempts`]). On a
/// conflict (the node controller or a kubelet changed the node since the snapshot) the node is
/// read again and patched once more at once with what `changes` asks of the fresh node: during
/// a long pass, the next pass can be minutes away.
pub async fn write_labels<'n>(
    client: &Client,
    nodes: &'n [Arc<NodeView>],
    attempts: &mut LabelAttempts,
    gate: Option<&Semaphore>,
    changes: impl Fn(&NodeView) -> LabelPatch,
) -> LabelWrites<'n> {
    let api: Api<Node> = Api::all(client.clone());
    let names: BTreeSet<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
    attempts.retain_nodes(|n| names.contains(n));
    let mut writes = LabelWrites::default();
    let mut work = Vec::new();
    for node in nodes {
        let wanted = changes(node);
        if wanted.is_empty() {
            // The cache shows the labels this node needs: nothing of ours is in flight for it.
            attempts.forget(&node.name);
            continue;
        }
        if attempts.pending(node) {
            writes.pending += 1;
            continue;
        }
        attempts.record(node);
        work.push((node.as_ref(), wanted));
    }
    let changes = &changes;
    let results: Vec<_> = futures::stream::iter(work.into_iter().map(|(node, wanted)| {
        let api = api.clone();
        async move {
            // A closed gate (never closed here) admits everything.
            let _permit = match gate {
                Some(gate) => gate.acquire().await.ok(),
                None => None,
            };
            let (written, result) = label_node(&api, node, wanted, changes).await;
            (node, written, result)
        }
    }))
    .buffer_unordered(PATCH_CONCURRENCY)
    .collect()
    .await;
    for (node, written, result) in results {
        match result {
            Ok(()) => writes.written.push((node, written)),
            // A newer version again, or the node is gone: the watch brings the news.
            Err(kube::Error::Api(e)) if e.code == 409 => writes.conflicted += 1,
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => {
                writes.failure.get_or_insert(e);
            }
        }
    }
    writes
}

/// One merge patch with `node`'s version as the precondition.
async fn patch_labels(api: &Api<Node>, node: &NodeView, wanted: &LabelPatch) -> kube::Result<()> {
    // The answer as metadata only: a thousand full Nodes back are megabytes read for nothing.
    // Our field manager on the labels marks them as the operator's (node_pools reads it).
    api.patch_metadata(
        &node.name,
        &PatchParams {
            field_manager: Some(crate::model::MANAGER.to_owned()),
            ..PatchParams::default()
        },
        &Patch::Merge(&label_patch(node, wanted)),
    )
    .await
    .map(drop)
}

/// Patches `node` with `wanted`; on a conflict, reads it again and patches what it still needs.
/// Returns what was finally written.
async fn label_node(
    api: &Api<Node>,
    node: &NodeView,
    wanted: LabelPatch,
    changes: &impl Fn(&NodeView) -> LabelPatch,
) -> (LabelPatch, kube::Result<()>) {
    let first = patch_labels(api, node, &wanted).await;
    if !matches!(&first, Err(kube::Error::Api(e)) if e.code == 409) {
        return (wanted, first);
    }
    match api.get_metadata_opt(&node.name).await {
        Ok(Some(fresh)) => {
            let labels = fresh.metadata.labels.unwrap_or_default();
            let view = NodeView::from_labels(&node.name, fresh.metadata.resource_version, &labels);
            let again = changes(&view);
            if again.is_empty() {
                return (again, Ok(()));
            }
            let result = patch_labels(api, &view, &again).await;
            (again, result)
        }
        Ok(None) => (LabelPatch::new(), Ok(())),
        Err(e) => (wanted, Err(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(rv: &str) -> NodeView {
        NodeView {
            name: "n".into(),
            resource_version: Some(rv.into()),
            ..NodeView::default()
        }
    }

    #[test]
    fn a_node_is_not_patched_again_until_the_cache_shows_a_newer_version() {
        let mut attempts = LabelAttempts::default();
        assert!(!attempts.pending(&at("1")));
        attempts.record(&at("1"));
        assert!(
            attempts.pending(&at("1")),
            "cache still at the patched version"
        );
        assert!(!attempts.pending(&at("2")), "the cache caught up");
        assert!(!attempts.pending(&at("1")), "forgotten once caught up");
    }

    #[test]
    fn patch_sets_removes_and_carries_the_resource_version() {
        let node = NodeView {
            name: "n".into(),
            resource_version: Some("42".into()),
            ..NodeView::default()
        };
        let changes: LabelPatch = [
            ("a".to_string(), Some("true".to_string())),
            ("b".to_string(), None),
        ]
        .into();
        assert_eq!(
            label_patch(&node, &changes),
            json!({"metadata": {"labels": {"a": "true", "b": null}, "resourceVersion": "42"}})
        );
    }

    #[test]
    fn the_requeue_is_the_earliest_reason() {
        let not_ready = Duration::from_secs(30);
        assert_eq!(
            Again {
                ready: true,
                ..Again::default()
            }
            .requeue(not_ready),
            None,
            "ready and settled: no timer"
        );
        assert_eq!(Again::default().requeue(not_ready), Some(not_ready));
        assert_eq!(
            Again {
                waits_for_user: true,
                ..Again::default()
            }
            .requeue(not_ready),
            None,
            "an invalid input waits for the user's fix"
        );
        assert_eq!(
            Again {
                unsettled: true,
                retry_after: Some(Duration::from_secs(1)),
                ..Again::default()
            }
            .requeue(not_ready),
            Some(Duration::from_secs(1))
        );
        assert_eq!(
            Again {
                ready: true,
                unsettled: true,
                deadline: Some(Duration::from_secs(10)),
                ..Again::default()
            }
            .requeue(not_ready),
            Some(UNSETTLED_REQUEUE)
        );
    }

    #[test]
    fn a_status_error_names_the_owners_kind() {
        let e = Error::Status {
            owner: Owner {
                kind: "NVIDIADriver",
                name: "pool-a".into(),
            },
            source: kube::Error::LinesCodecMaxLineLengthExceeded,
        };
        assert!(
            e.to_string()
                .starts_with("patching status of NVIDIADriver pool-a: "),
            "{e}"
        );
    }
}
