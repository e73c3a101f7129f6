//! `gpu-operator run` (IO): logging, the HTTP endpoints, Lease-based leader election and the
//! controller.
//!
//! Leadership: a replica reconciles only while it holds the Lease. If a renewal fails or the
//! Lease is lost, it stops writing at once by exiting (its replacement starts clean). On SIGTERM
//! or SIGINT it finishes in-flight reconciles, releases the Lease so a standby takes over
//! without waiting for expiry, and exits 0.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use kube::Client;
use kube_lease_manager::LeaseManagerBuilder;
use tokio::sync::watch;

use crate::controller::{self, Settings};
use crate::health::Health;
use crate::metrics::Metrics;

/// Settings of `gpu-operator run`.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub namespace: Option<String>,
    pub metrics_addr: SocketAddr,
    pub leader_elect: bool,
    pub lease_name: String,
    pub lease_duration: Duration,
    pub identity: Option<String>,
    pub gpu_label_grace: Duration,
    pub json_logs: bool,
    /// Check the served ClusterPolicy CRD and upgrade it when it is ours ([`crate::crd_upgrade`]).
    pub upgrade_crd: bool,
}

fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "info,kube=warn".into());
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// Resolves when SIGTERM or SIGINT arrives.
async fn termination() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = term => {},
        _ = tokio::signal::ctrl_c() => {},
    }
}

pub async fn run(options: RunOptions) -> anyhow::Result<()> {
    init_logging(options.json_logs);
    let Some(namespace) = options.namespace.clone().filter(|n| !n.is_empty()) else {
        bail!(
            "OPERATOR_NAMESPACE is not set: the operator needs the namespace it runs in. In a pod, set it from the \
             downward API (env valueFrom fieldRef metadata.namespace); outside a cluster, export OPERATOR_NAMESPACE or pass --namespace"
        );
    };
    let client = Client::try_default()
        .await
        .context("connecting to the Kubernetes API (in-cluster config or KUBECONFIG)")?;
    let metrics = Metrics::default();
    // Not ready until the controller's first pass (or, for a standby, until it waits for the
    // Lease): crate::health.
    let health = Health::default();
    let http = tokio::spawn(crate::http::serve(
        options.metrics_addr,
        metrics.clone(),
        health.clone(),
    ));

    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        termination().await;
        tracing::info!("termination signal received; shutting down");
        let _ = stop_tx.send(true);
    });
    let stopped = {
        let rx = stop_rx.clone();
        move || {
            let mut rx = rx.clone();
            async move {
                let _ = rx.wait_for(|s| *s).await;
            }
        }
    };

    let settings = Settings {
        namespace: namespace.clone(),
        gpu_label_grace: options.gpu_label_grace,
        not_ready_requeue: Duration::from_secs(30),
    };

    if !options.leader_elect {
        if options.upgrade_crd {
            crate::crd_upgrade::ensure_and_log(&client).await;
        }
        controller::run(client, settings, metrics, health, stopped()).await?;
        http.abort();
        return Ok(());
    }

    let identity = options
        .identity
        .clone()
        .or_else(|| std::env::var("POD_NAME").ok())
        .unwrap_or_else(|| format!("{}-{}", hostname(), std::process::id()));
    let seconds = options.lease_duration.as_secs().max(2);
    let lease = Arc::new(
        LeaseManagerBuilder::new(client.clone(), &options.lease_name)
            .with_namespace(&namespace)
            .with_identity(&identity)
            .with_duration(seconds)
            .with_grace((seconds / 3).max(1))
            .with_field_manager("gpu-operator-leader-election")
            .build()
            .await
            .context("setting up leader election")?,
    );
    // A standby is ready (a rolling update waits for it while the old leader holds the Lease).
    health.set_ready(true);
    tracing::info!(%identity, lease = %options.lease_name, "waiting to become leader");
    tokio::select! {
        acquired = async {
            loop {
                if lease.changed().await? {
                    break Ok::<(), kube_lease_manager::LeaseManagerError>(());
                }
            }
        } => acquired.context("acquiring the leader Lease")?,
        _ = stopped() => {
            http.abort();
            return Ok(());
        }
    }
    tracing::info!(%identity, "became leader");
    // The leader is ready again once its caches are filled and its first pass finished.
    health.set_ready(false);

    // Keep renewing; losing the Lease or failing to renew ends the process at once, so no two
    // replicas ever write together.
    let renewer = {
        let lease = lease.clone();
        let health = health.clone();
        tokio::spawn(async move {
            let outcome = lease.changed().await;
            health.set_ready(false);
            match outcome {
                Ok(_) => tracing::error!("leader Lease lost; exiting so no two replicas write"),
                Err(e) => {
                    tracing::error!(error = %e, "renewing the leader Lease failed; exiting so no two replicas write")
                }
            }
            std::process::exit(1);
        })
    };

    // Only the leader writes the CRD, before the controller probes its schema.
    if options.upgrade_crd {
        crate::crd_upgrade::ensure_and_log(&client).await;
    }
    controller::run(client, settings, metrics, health, stopped()).await?;
    renewer.abort();
    if let Err(e) = lease.release().await {
        tracing::warn!(error = %e, "releasing the leader Lease failed; a standby takes over when it expires");
    } else {
        tracing::info!("leader Lease released");
    }
    http.abort();
    Ok(())
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "gpu-operator".into())
}
