//! A steady cluster as node agents keep it: GFD rewrites `nvidia.com/gfd.timestamp` on its node
//! once a minute, a label no operator decision depends on. Used by the steady-state test and the
//! benchmark, which count what the operator writes meanwhile (decision 9: nothing).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::audit::{AuditLog, writes_excluding_leases};

/// The label GFD refreshes on every node it runs on.
pub const GFD_TIMESTAMP: &str = "nvidia.com/gfd.timestamp";

/// Sets `key` to the current Unix time on every node of `names`, spreading the patches evenly
/// over `spread` (GFD instances tick independently); at most 32 in flight. Returns how many
/// nodes were patched.
pub async fn rewrite_label_spread(
    client: &Client,
    names: &[String],
    key: &str,
    spread: Duration,
) -> Result<usize> {
    let api: Api<Node> = Api::all(client.clone());
    let start = tokio::time::Instant::now();
    let n = names.len().max(1) as u32;
    futures::stream::iter(names.iter().enumerate().map(|(i, name)| {
        let api = api.clone();
        let at = start + spread * i as u32 / n;
        async move {
            tokio::time::sleep_until(at).await;
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or_default();
            let patch = json!({"metadata": {"labels": {key: now.to_string()}}});
            api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .with_context(|| format!("rewriting {key} on node {name}"))?;
            Ok::<_, anyhow::Error>(())
        }
    }))
    .buffer_unordered(32)
    .try_collect::<Vec<()>>()
    .await?;
    Ok(names.len())
}

/// Waits until `username` has made no write (Lease renewals aside) for `quiet`, checking the
/// audit log; fails after `timeout`. Returns how long it took. An identity that writes more
/// often than every `quiet` never gets there.
pub async fn await_quiet(
    log: &AuditLog,
    username: &str,
    quiet: Duration,
    timeout: Duration,
) -> Result<Duration> {
    let started = tokio::time::Instant::now();
    loop {
        let from = log.mark()?;
        tokio::time::sleep(quiet).await;
        let events = log.of_user_since(from, username)?;
        let Some(last) = writes_excluding_leases(&events).pop() else {
            return Ok(started.elapsed());
        };
        anyhow::ensure!(
            started.elapsed() < timeout,
            "{username} still writing after {timeout:?}; last: {last}"
        );
    }
}
