//! Label stage of the GPUCluster pass (IO: node patches through controller::owner::write_labels).

use std::sync::Arc;

use kube::Client;

use crate::controller::owner::{self, Error, LabelAttempts};
use crate::nodes::{DEPLOY_OPERANDS, NodeView};
use crate::operands::dra_driver::DEPLOY_LABEL;

/// Label stage: GPU nodes get NVIDIA's `nvidia.com/gpu.deploy.dra-driver=true` where no value is
/// set (a user's `false` is respected), with a merge patch on the node's resource version.
/// Returns how many patches the cache has not shown yet.
pub async fn label_nodes(
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
