//! Label stage of the GPUCluster pass (IO: node patches through controller::owner::write_labels).

use std::sync::Arc;

use kube::Client;

use crate::controller::owner::{self, Error, LabelAttempts};
use crate::nodes::{DEPLOY_OPERANDS, NodeView};
use crate::operands::dra_driver;

/// Label stage: GPU nodes get NVIDIA's `nvidia.com/gpu.deploy.dra-driver=true` and the deploy
/// keys of the GPUCluster's DCGM, exporter and DRA validator where no value is set (a user's
/// `false` or a driver manager's `paused-*` is respected), with a merge patch on the node's
/// resource version. Keys are set for every operand, deployed or not (decision 2).
/// Returns how many patches the cache has not shown yet.
pub async fn label_nodes(
    client: &Client,
    attempts: &mut LabelAttempts,
    nodes: &[Arc<NodeView>],
) -> Result<usize, Error> {
    let writes = owner::write_labels(client, nodes, attempts, None, |node| {
        let gpu = node.has_nfd_gpu() && node.label(DEPLOY_OPERANDS) != Some("false");
        dra_driver::deploy_keys()
            .filter(|key| gpu && node.label(key).is_none())
            .map(|key| (key.to_owned(), Some("true".to_owned())))
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
