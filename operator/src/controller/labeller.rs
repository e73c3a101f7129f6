//! Node labelling (IO): writes the label changes `nodes::desired_label_changes` asks for, with a
//! JSON merge patch carrying the node's `resourceVersion` as a precondition, never a forced
//! apply (other components write `paused-*` values into the same keys, decision 2). A conflict
//! is not an error: the node's newer version arrives through the watch and the pass runs again.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Map, Value, json};

use crate::nodes::{GpuLabelLoss, LabelPatch, NodeView, desired_label_changes, mig_config_default};

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

/// Labels every node that needs it. Returns when to look again, if needed: when a node's
/// vanished GPU label reaches the grace period, or shortly after a conflict.
pub async fn label_nodes(
    client: &Client,
    nodes: &[NodeView],
    loss: &Mutex<GpuLabelLoss>,
    grace: Duration,
    mig_default_layout: Option<&str>,
) -> Result<Option<Instant>, kube::Error> {
    let api: Api<Node> = Api::all(client.clone());
    let now = Instant::now();
    let mut retry = None;
    for node in nodes {
        let gone_for = loss.lock().ok().and_then(|mut l| l.observe(node, now));
        let mut changes = desired_label_changes(node, gone_for, grace);
        changes.extend(mig_config_default(node, mig_default_layout));
        if changes.is_empty() {
            continue;
        }
        let patch = merge_patch(node, &changes);
        match api
            .patch(&node.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {
                tracing::info!(node = %node.name, changes = ?changes, "labelled node");
                if changes.get(crate::nodes::GPU_PRESENT) == Some(&None)
                    && let Ok(mut l) = loss.lock()
                {
                    l.forget(&node.name);
                }
            }
            // Stale resourceVersion or the node is gone: the watch brings the news.
            Err(kube::Error::Api(e)) if e.code == 409 => {
                tracing::debug!(node = %node.name, "node changed meanwhile; retrying shortly");
                retry = Some(Instant::now() + CONFLICT_RETRY);
            }
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    let grace_deadline = loss.lock().ok().and_then(|l| l.next_deadline(grace));
    Ok(grace_deadline.into_iter().chain(retry).min())
}

#[cfg(test)]
mod tests {
    use super::*;

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
