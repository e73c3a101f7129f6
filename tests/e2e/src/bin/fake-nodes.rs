//! `fake-nodes N [--prefix P] [--taint] [--cpu-nodes M] [--undiscovered] [--os ID:VERSION]
//! [--delete]`: creates N fake GPU nodes (a T4 / A100 / H100 mix) plus M CPU-only nodes (one by
//! default) on the harness in `KUBECONFIG`, without NFD's and GFD's labels with `--undiscovered`
//! (for real NFD to find), reporting another OS than Ubuntu 22.04 with `--os` (for example
//! `ubuntu:24.04`), or deletes every fake node with `--delete`. Used by tests/cluster/nodes.sh.

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
    let mut os: Option<(String, String)> = None;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--prefix" => prefix = args.next().context("--prefix needs a value")?,
            "--taint" => taint = true,
            "--cpu-nodes" => {
                cpu_nodes = args.next().context("--cpu-nodes needs a value")?.parse()?
            }
            "--undiscovered" => undiscovered = true,
            "--os" => {
                let value = args
                    .next()
                    .context("--os needs ID:VERSION, e.g. ubuntu:24.04")?;
                let (id, version) = value
                    .split_once(':')
                    .context("--os needs ID:VERSION, e.g. ubuntu:24.04")?;
                os = Some((id.to_owned(), version.to_owned()));
            }
            "--delete" => delete = true,
            n if count.is_none() && n.parse::<usize>().is_ok() => count = n.parse().ok(),
            other => bail!(
                "unknown argument {other}; usage: fake-nodes N [--prefix P] [--taint] [--cpu-nodes M] [--undiscovered] [--os ID:VERSION] | --delete"
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
        "usage: fake-nodes N [--prefix P] [--taint] [--cpu-nodes M] [--undiscovered] [--os ID:VERSION] | --delete",
    )?;
    let mut fleet = nodes::fleet(&prefix, count, cpu_nodes, taint);
    if undiscovered {
        fleet = fleet.into_iter().map(|n| n.undiscovered()).collect();
    }
    if let Some((id, version)) = os {
        fleet = fleet
            .into_iter()
            .map(|n| {
                if n.gpu.is_some() {
                    n.os(&id, &version)
                } else {
                    n
                }
            })
            .collect();
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
