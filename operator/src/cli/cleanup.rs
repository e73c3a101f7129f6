//! `gpu-operator cleanup` (IO): the teardown of a deleted ClusterPolicy (crate::cleanup) run from
//! a workstation, for when the operator is gone (uninstalled, or never coming back), so that no
//! policy hangs in Terminating and no node keeps the operator's taints, labels or cordons.

use std::io::Write;

use anyhow::Context;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};

use crate::api::{ClusterPolicy, GPUCluster};
use crate::cleanup::{self, Report};
use crate::controller::coexist::{Judge, NVIDIA_OPERATOR_LEASE, live_leases};

/// Arguments of `gpu-operator cleanup`.
#[derive(Debug, clap::Args)]
pub struct CleanupArgs {
    /// Kubeconfig to use (default: KUBECONFIG, ~/.kube/config, or the in-cluster account).
    #[arg(long)]
    pub kubeconfig: Option<std::path::PathBuf>,
    /// Kubeconfig context to use.
    #[arg(long)]
    pub context: Option<String>,
}

/// Runs the cleanup and writes what it removed to `out`.
pub fn run(args: &CleanupArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let text = runtime.block_on(async {
        let client =
            super::doctor::client(args.kubeconfig.as_deref(), args.context.as_deref()).await?;
        clean(&client).await
    })?;
    out.write_all(text.as_bytes())
        .context("writing the report")?;
    Ok(())
}

/// The ClusterPolicies, none when the CRD is not served.
async fn policies(client: &Client) -> anyhow::Result<Vec<ClusterPolicy>> {
    match Api::<ClusterPolicy>::all(client.clone())
        .list(&ListParams::default())
        .await
    {
        Ok(list) => Ok(list.items),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(Vec::new()),
        Err(e) => Err(e).context("listing ClusterPolicies"),
    }
}

/// Who holds NVIDIA's operator Lease, if it is live (decision 14: its operator writes the same
/// node keys, so they are not ours to remove).
async fn nvidia_operator(client: &Client) -> anyhow::Result<Option<String>> {
    let leases = Api::<Lease>::all(client.clone())
        .list(&ListParams::default().fields(&format!("metadata.name={NVIDIA_OPERATOR_LEASE}")))
        .await
        .context("listing NVIDIA's operator Leases")?;
    let leases: Vec<_> = leases.items.into_iter().map(std::sync::Arc::new).collect();
    // Only a Lease whose holder is privileged counts, as for the operator (decision 14): a
    // tenant's decoy must not block a teardown either.
    let (live, _) = live_leases(&leases, k8s_openapi::jiff::Timestamp::now());
    Judge::new(client.clone(), std::collections::BTreeSet::new())
        .trusted_holder(&live)
        .await
        .context("checking who holds NVIDIA's operator Lease")
}

/// Cleans the cluster and lets every deleted policy go; returns the report to print.
pub async fn clean(client: &Client) -> anyhow::Result<String> {
    let all = policies(client).await?;
    if let Some(live) = all.iter().find(|p| p.metadata.deletion_timestamp.is_none()) {
        anyhow::bail!(
            "ClusterPolicy {name} is not being deleted, and the nodes are managed for it: delete it first (kubectl delete clusterpolicy {name} --wait=false), then run gpu-operator cleanup",
            name = live.name_any()
        );
    }
    if let Some(holder) = nvidia_operator(client).await? {
        anyhow::bail!(
            "NVIDIA's GPU operator is live ({holder}) and writes the same node labels; nothing removed. Uninstall it first, or remove the finalizer {} by hand",
            crate::teardown::FINALIZER
        );
    }
    // A GPUCluster that is not being deleted keeps its marks (clean_cluster checks).
    let report = cleanup::clean_cluster(client, cleanup::Leaving::ClusterPolicy)
        .await
        .context("cleaning the nodes")?;
    let mut text = describe(&report);
    for policy in all.iter().filter(|p| cleanup::has_finalizer(*p)) {
        let name = policy.name_any();
        cleanup::remove_finalizer::<ClusterPolicy>(client, &name)
            .await
            .with_context(|| format!("letting ClusterPolicy {name} go"))?;
        text.push_str(&format!("ClusterPolicy {name}: finalizer removed\n"));
    }
    for cluster in deleted_gpu_clusters(client).await? {
        let name = cluster.name_any();
        cleanup::remove_finalizer::<GPUCluster>(client, &name)
            .await
            .with_context(|| format!("letting GPUCluster {name} go"))?;
        text.push_str(&format!("GPUCluster {name}: finalizer removed\n"));
    }
    Ok(text)
}

/// GPUClusters being deleted that wait for our teardown.
async fn deleted_gpu_clusters(client: &Client) -> anyhow::Result<Vec<GPUCluster>> {
    match Api::<GPUCluster>::all(client.clone())
        .list(&ListParams::default())
        .await
    {
        Ok(list) => Ok(list
            .items
            .into_iter()
            .filter(|c| c.metadata.deletion_timestamp.is_some() && cleanup::has_finalizer(c))
            .collect()),
        // The GPUCluster CRD is not installed: there are none.
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(Vec::new()),
        Err(e) => Err(e).context("listing GPUClusters"),
    }
}

fn describe(report: &Report) -> String {
    let mut text = String::new();
    for (node, removed) in &report.nodes {
        text.push_str(&format!("node {node}: removed {removed}\n"));
    }
    for name in &report.priority_classes_deleted {
        text.push_str(&format!("PriorityClass {name}: deleted\n"));
    }
    for name in &report.priority_classes_kept {
        text.push_str(&format!(
            "PriorityClass {name}: kept, pods that have not finished name it\n"
        ));
    }
    if text.is_empty() {
        text.push_str("nothing of the operator's was left on the nodes\n");
    }
    text
}
