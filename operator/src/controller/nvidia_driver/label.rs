//! Label stage of the NVIDIADriver pass (IO: node patches).
//!
//! Through controller::owner::write_labels, the pool label hands each GPU node from the
//! ClusterPolicy's driver DaemonSets to its pool's, only once its pool's DaemonSet was applied.

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::Client;

use super::Pool;
use crate::controller::owner::{self, Error, LabelAttempts};
use crate::nodes::{DRIVER_POOL, LabelPatch, NodeView};
use crate::operands::nvidia_driver as pool;
use crate::render::{DesiredState, Outcome};

/// The pool label each GPU node should carry, from the pools and what they rendered: a
/// rendered pool takes the nodes its DaemonSets run on; a frozen one keeps the nodes it ran on.
pub fn wanted(
    pools: &[Pool<'_>],
    desired: &[DesiredState],
    nodes: &[Arc<NodeView>],
) -> BTreeMap<String, String> {
    let mut wanted: BTreeMap<String, String> = BTreeMap::new();
    for (p, desired) in pools.iter().zip(desired) {
        let label = pool::pool_label_value(&p.validated.name);
        match desired.operands.first().map(|s| &s.outcome) {
            Some(Outcome::Rendered(objects)) => {
                // Only nodes whose OS got a DaemonSet leave the policy's driver.
                for ds in &objects.daemon_sets {
                    for node in p.validated.nodes.iter().filter(|n| runs_on(ds, n)) {
                        wanted.insert(node.name.clone(), label.clone());
                    }
                }
            }
            // Frozen: the nodes it ran on stay its own.
            _ => {
                for node in nodes
                    .iter()
                    .filter(|n| n.label(DRIVER_POOL) == Some(label.as_str()))
                {
                    wanted.entry(node.name.clone()).or_insert(label.clone());
                }
            }
        }
    }
    wanted
}

/// Whether `ds` selects `node` by its OS labels (the pool's nodes all match the rest).
fn runs_on(ds: &k8s_openapi::api::apps::v1::DaemonSet, node: &NodeView) -> bool {
    let selector = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.node_selector.clone())
        .unwrap_or_default();
    selector
        .iter()
        .filter(|(k, _)| k.starts_with("feature.node.kubernetes.io/system-os_release"))
        .all(|(k, v)| node.labels.get(k) == Some(v))
}

/// Sets [`DRIVER_POOL`] to `wanted[node]` on each GPU node and removes it elsewhere, with a
/// merge patch on the node's resource version (decision 2). Returns how many patches the cache
/// has not shown yet.
pub async fn label_nodes(
    client: &Client,
    attempts: &mut LabelAttempts,
    nodes: &[Arc<NodeView>],
    wanted: &BTreeMap<String, String>,
) -> Result<usize, Error> {
    let writes = owner::write_labels(client, nodes, attempts, None, |node| {
        let want = wanted.get(&node.name);
        if node.labels.get(DRIVER_POOL) == want {
            return LabelPatch::new();
        }
        [(DRIVER_POOL.to_owned(), want.cloned())].into()
    })
    .await;
    if let Some(source) = writes.failure {
        return Err(Error::Labels {
            purpose: " for their NVIDIADriver pools",
            source,
        });
    }
    Ok(attempts.in_flight(nodes))
}
