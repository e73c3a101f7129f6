//! Label stage of the NVIDIADriver pass (IO: node patches).
//!
//! Through controller::owner::write_labels, the pool label hands each GPU node from the
//! ClusterPolicy's driver DaemonSets to its pool's, only once its pool's DaemonSet was applied.
//! In a GPUCluster install no ClusterPolicy marks the GPU nodes, so this stage also writes
//! NVIDIA's `nvidia.com/gpu.present` and `nvidia.com/gpu.deploy.driver` where they are unset.

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::Client;

use super::Pool;
use crate::controller::owner::{self, Error, LabelAttempts};
use crate::nodes::{DEPLOY_DRIVER, DRIVER_POOL, GPU_PRESENT, LabelPatch, NodeView};

/// NFD's node labels, among which the OS, kernel and RHCOS labels a pool's DaemonSets select.
const NFD_LABEL_PREFIX: &str = "feature.node.kubernetes.io/";
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
                // Only nodes a DaemonSet of the pool selects leave the policy's driver.
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

/// Whether `ds` selects `node` by the labels that split a pool into DaemonSets: NFD's OS,
/// kernel and RHCOS labels (the pool's nodes all match the rest, and the pool label is what
/// this stage writes).
fn runs_on(ds: &k8s_openapi::api::apps::v1::DaemonSet, node: &NodeView) -> bool {
    let selector = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.node_selector.clone())
        .unwrap_or_default();
    selector
        .iter()
        .filter(|(k, _)| k.starts_with(NFD_LABEL_PREFIX))
        .all(|(k, v)| node.labels.get(k) == Some(v))
}

/// Sets [`DRIVER_POOL`] to `wanted[node]` on each GPU node and removes it elsewhere, with a
/// merge patch on the node's resource version (decision 2). With `mark_gpu_nodes` (a GPUCluster
/// install) also [`gpu_node_marks`]. Returns how many patches the cache has not shown yet.
pub async fn label_nodes(
    client: &Client,
    attempts: &mut LabelAttempts,
    nodes: &[Arc<NodeView>],
    wanted: &BTreeMap<String, String>,
    mark_gpu_nodes: bool,
) -> Result<usize, Error> {
    let writes = owner::write_labels(client, nodes, attempts, None, |node| {
        let mut patch = if mark_gpu_nodes {
            gpu_node_marks(node)
        } else {
            LabelPatch::new()
        };
        let want = wanted.get(&node.name);
        if node.labels.get(DRIVER_POOL) != want {
            patch.insert(DRIVER_POOL.to_owned(), want.cloned());
        }
        patch
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

/// The labels a GPU node found by NFD needs for a pool's driver pods to select it, where no
/// value is set (a user's value, such as `false`, is respected; a node opted out with
/// `nvidia.com/gpu.deploy.operands=false` gets none).
pub fn gpu_node_marks(node: &NodeView) -> LabelPatch {
    if !node.has_nfd_gpu() || node.label(crate::nodes::DEPLOY_OPERANDS) == Some("false") {
        return LabelPatch::new();
    }
    [GPU_PRESENT, DEPLOY_DRIVER]
        .into_iter()
        .filter(|key| node.label(key).is_none())
        .map(|key| (key.to_owned(), Some("true".to_owned())))
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_cluster_install_marks_nfd_gpu_nodes_where_unset_and_respects_opt_outs() {
        let node = |labels: &[(&str, &str)]| {
            let labels = labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
            NodeView::from_labels("n", None, &labels)
        };
        let nfd = ("feature.node.kubernetes.io/pci-10de.present", "true");
        let marks = gpu_node_marks(&node(&[nfd]));
        assert_eq!(marks[GPU_PRESENT].as_deref(), Some("true"));
        assert_eq!(marks[DEPLOY_DRIVER].as_deref(), Some("true"));
        let paused = gpu_node_marks(&node(&[nfd, (DEPLOY_DRIVER, "false")]));
        assert!(!paused.contains_key(DEPLOY_DRIVER));
        assert!(gpu_node_marks(&node(&[nfd, (crate::nodes::DEPLOY_OPERANDS, "false")])).is_empty());
        assert!(gpu_node_marks(&node(&[])).is_empty(), "not a GPU node");
    }
}
