//! `fake-nodes N [--prefix P] [--taint] [--cpu-nodes M] [--undiscovered] [--delete]`: creates N
//! fake GPU nodes (a T4 / A100 / H100 mix) plus M CPU-only nodes (default 1) on the harness in
//! `KUBECONFIG`, without NFD's and GFD's labels with `--undiscovered` (for real NFD to find), or
//! deletes every fake node with `--delete`. Used by tests/cluster/nodes.sh.

use anyhow::{Context, Result, bail};
use e2e::nodes;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams};

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let (mut count, mut prefix, mut taint, mut cpu_nodes, mut delete) =
        (None, "gpu-node".to_string(), false, 1, false);
    let mut undiscovered = false;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--prefix" => prefix = args.next().context("--prefix needs a value")?,
            "--taint" => taint = true,
            "--cpu-nodes" => {
                cpu_nodes = args.next().context("--cpu-nodes needs a value")?.parse()?
            }
            "--undiscovered" => undiscovered = true,
            "--delete" => delete = true,
            n if count.is_none() && n.parse::<usize>().is_ok() => count = n.parse().ok(),
            other => bail!(
                "unknown argument {other}; usage: fake-nodes N [--prefix P] [--taint] [--cpu-nodes M] [--undiscovered] | --delete"
            ),
        }
    }
    let client = e2e::client().await?;
    if delete {
        let api: Api<Node> = Api::all(client.clone());
        let fakes = api
            .list_metadata(
                &ListParams::default().labels(&format!("{}=true", nodes::FAKE_NODE_LABEL)),
            )
            .await?;
        let names: Vec<String> = fakes
            .items
            .into_iter()
            .filter_map(|n| n.metadata.name)
            .collect();
        nodes::delete(&client, &names).await?;
        println!("deleted {} fake nodes", names.len());
        return Ok(());
    }
    let count = count.context(
        "usage: fake-nodes N [--prefix P] [--taint] [--cpu-nodes M] [--undiscovered] | --delete",
    )?;
    let mut fleet = nodes::fleet(&prefix, count, cpu_nodes, taint);
    if undiscovered {
        fleet = fleet.into_iter().map(|n| n.undiscovered()).collect();
    }
    let started = std::time::Instant::now();
    nodes::create(&client, &fleet).await?;
    println!(
        "created {} GPU and {cpu_nodes} CPU fake nodes in {:.1}s",
        count,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
