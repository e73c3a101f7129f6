//! Node labelling (IO): writes the label changes `nodes::desired_label_changes` asks for, with a
//! JSON merge patch carrying the node's `resourceVersion` as a precondition, never a forced
//! apply (other components write `paused-*` values into the same keys, decision 2). A conflict
//! is not an error: the node is re-read and patched once more at once, and should that conflict
//! too, the node's newer version arrives through the watch and a pass shortly after retries.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Map, Value, json};
use tokio::sync::Semaphore;

use crate::nodes::{
    Breaker, GpuLabelLoss, LabelPatch, NodeView, desired_label_changes, mig_config_default,
};

fn merge_patch(node: &NodeView, changes: &LabelPatch) -> Value {
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

/// How soon to retry a node whose patch met a newer version (kwok or a kubelet updated its
/// status meanwhile). Such an update changes no label we read, so no watch event would wake us.
const CONFLICT_RETRY: Duration = Duration::from_millis(500);

/// The `resourceVersion` of each node as it was when we last patched it (or met a conflict).
/// Until the cache shows a newer version, the cache has not seen our write (or the newer node
/// that refused it) and patching again would repeat the same request: with hundreds of nodes
/// and a pass every few milliseconds during convergence, that is hundreds of needless writes.
#[derive(Debug, Default)]
pub struct Attempts {
    at_version: BTreeMap<String, Option<String>>,
}

impl Attempts {
    /// Whether `node` was patched at exactly the version the cache still shows.
    fn pending(&mut self, node: &NodeView) -> bool {
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
    fn retain_nodes(&mut self, exists: impl Fn(&str) -> bool) {
        self.at_version.retain(|name, _| exists(name));
    }

    fn settled(&mut self, node: &NodeView) {
        self.at_version.remove(&node.name);
    }

    fn record(&mut self, node: &NodeView) {
        self.at_version
            .insert(node.name.clone(), node.resource_version.clone());
    }
}

/// What `node` needs: decision 2's labels and the default MIG layout (decision 7).
fn changes_for(
    node: &NodeView,
    gone_for: Option<Duration>,
    grace: Duration,
    mig_default_layout: Option<&str>,
) -> LabelPatch {
    let mut changes = desired_label_changes(node, gone_for, grace);
    changes.extend(mig_config_default(node, mig_default_layout));
    changes
}

/// One merge patch with `node`'s version as the precondition; the changes come back with the
/// result for the log.
async fn patch_labels(
    api: &Api<Node>,
    node: &NodeView,
    changes: LabelPatch,
) -> (LabelPatch, Result<(), kube::Error>) {
    let patch = merge_patch(node, &changes);
    // The answer as metadata only: a thousand full Nodes back are megabytes read for nothing.
    let result = api
        .patch_metadata(&node.name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map(drop);
    (changes, result)
}

/// Patches `node` with `changes`. On a conflict (the node controller or a kubelet changed the
/// node since our snapshot) it re-reads the node and tries once more right away: during a long
/// pass the next pass, and so the retry from the cache, can be minutes away. Returns what was
/// finally written (empty when nothing was left to do).
async fn label_node(
    api: &Api<Node>,
    node: &NodeView,
    changes: LabelPatch,
    gone_for: Option<Duration>,
    grace: Duration,
    mig_default_layout: Option<&str>,
) -> (LabelPatch, Result<(), kube::Error>) {
    let first = patch_labels(api, node, changes).await;
    if !matches!(&first.1, Err(kube::Error::Api(e)) if e.code == 409) {
        return first;
    }
    match api.get_metadata_opt(&node.name).await {
        Ok(Some(fresh)) => {
            let labels = fresh.metadata.labels.unwrap_or_default();
            let view = NodeView::from_labels(&node.name, fresh.metadata.resource_version, &labels);
            let changes = changes_for(&view, gone_for, grace, mig_default_layout);
            if changes.is_empty() {
                (changes, Ok(()))
            } else {
                patch_labels(api, &view, changes).await
            }
        }
        Ok(None) => (LabelPatch::new(), Ok(())),
        Err(e) => (first.0, Err(e)),
    }
}

/// Node patches in flight at once. One at a time, every patch waits out a round trip to a busy
/// API server (tens of milliseconds while a thousand new nodes come up); sixteen label 1,000
/// nodes in seconds and stay far below the API server's default of 200 mutating requests in
/// flight.
pub const PATCH_CONCURRENCY: usize = 16;

/// Of [`PATCH_CONCURRENCY`], the permits a pass holds back while its apply is writing: two
/// label patches stay in flight beside the operand objects, the rest wait for the apply.
pub const HELD_FOR_APPLY: u32 = PATCH_CONCURRENCY as u32 - 2;

/// What labelling found beyond the writes: when to look again, and the label-loss breaker.
#[derive(Debug, Default)]
pub struct Labelling {
    /// When a node's vanished GPU label reaches the grace period, the breaker lets the next
    /// node go, or a conflict is retried.
    pub again_at: Option<Instant>,
    pub breaker: Breaker,
}

/// Labels every node that needs it, [`PATCH_CONCURRENCY`] at a time and no more than `gate`
/// admits (a permit per patch in flight). A node whose NFD GPU
/// label has been gone past the grace period is unmarked only when the label-loss breaker
/// admits it ([`GpuLabelLoss::breaker`]): a mass loss (an NFD upgrade or outage) unmarks a
/// bounded share of the fleet per grace window instead of all of it.
pub async fn label_nodes(
    client: &Client,
    nodes: &[Arc<NodeView>],
    loss: &mut GpuLabelLoss,
    attempts: &mut Attempts,
    grace: Duration,
    mig_default_layout: Option<&str>,
    gate: &Semaphore,
) -> Result<Labelling, kube::Error> {
    let api: Api<Node> = Api::all(client.clone());
    let now = Instant::now();
    let mut retry = None;
    let mut work = Vec::new();
    let names: BTreeSet<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
    loss.retain_nodes(|n| names.contains(n));
    attempts.retain_nodes(|n| names.contains(n));
    let gone: Vec<Option<Duration>> = nodes.iter().map(|node| loss.observe(node, now)).collect();
    let gpu_nodes = nodes
        .iter()
        .filter(|n| n.is_gpu_node() || n.has_nfd_gpu())
        .count();
    let breaker = loss.breaker(gpu_nodes, grace, now);
    for (node, gone_for) in nodes.iter().zip(gone) {
        // Past the grace but held back by the breaker: left exactly as it is for now.
        let gone_for = gone_for.filter(|g| *g < grace || breaker.admitted.contains(&node.name));
        let changes = changes_for(node, gone_for, grace, mig_default_layout);
        if changes.is_empty() {
            // The cache shows the labels this node needs: nothing of ours is in flight for it.
            attempts.settled(node);
            continue;
        }
        if attempts.pending(node) {
            // Our write (or the version that refused it) has not reached the cache yet; a
            // conflict's retry timer is already set.
            retry = Some(retry.unwrap_or(now + CONFLICT_RETRY));
            continue;
        }
        attempts.record(node);
        work.push((node, gone_for, changes));
    }
    let results: Vec<_> =
        futures::stream::iter(work.into_iter().map(|(node, gone_for, changes)| {
            let api = api.clone();
            async move {
                // A closed gate (never closed here) admits everything.
                let _permit = gate.acquire().await.ok();
                let (changes, result) =
                    label_node(&api, node, changes, gone_for, grace, mig_default_layout).await;
                (node, changes, result)
            }
        }))
        .buffer_unordered(PATCH_CONCURRENCY)
        .collect()
        .await;
    let mut failure = None;
    for (node, changes, result) in results {
        match result {
            Ok(()) if changes.is_empty() => {}
            Ok(()) => {
                tracing::info!(node = %node.name, changes = ?changes, "labelled node");
                if changes.get(crate::nodes::GPU_PRESENT) == Some(&None) {
                    loss.forget(&node.name);
                }
            }
            // Stale resourceVersion or the node is gone: the watch brings the news.
            Err(kube::Error::Api(e)) if e.code == 409 => {
                tracing::debug!(node = %node.name, "node changed meanwhile; retrying shortly");
                retry = Some(Instant::now() + CONFLICT_RETRY);
            }
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => {
                failure.get_or_insert(e);
            }
        }
    }
    if let Some(e) = failure {
        return Err(e);
    }
    let grace_deadline = loss.next_deadline(grace, now);
    if !breaker.held_back.is_empty() {
        tracing::warn!(held_back = ?breaker.held_back, limit = breaker.limit, "GPU label loss on many nodes: the breaker holds them marked");
    }
    Ok(Labelling {
        again_at: grace_deadline
            .into_iter()
            .chain(retry)
            .chain(breaker.reopens)
            .min(),
        breaker,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_is_not_patched_again_until_the_cache_shows_a_newer_version() {
        let at = |rv: &str| NodeView {
            name: "n".into(),
            resource_version: Some(rv.into()),
            ..NodeView::default()
        };
        let mut attempts = Attempts::default();
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
            merge_patch(&node, &changes),
            json!({"metadata": {"labels": {"a": "true", "b": null}, "resourceVersion": "42"}})
        );
    }
}
