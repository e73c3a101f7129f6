//! `gpu-operator run` (IO): logging, the HTTP endpoints, Lease-based leader election and the
//! controller.
//!
//! Leadership (crate::leader): a replica reconciles only while it holds the Lease, and every
//! write it sends passes a write gate that closes a safety margin before its Lease could expire
//! without a renewal. API errors and hung renewals are ridden out until then; a leader whose
//! window closes, or that finds the Lease held by another, cancels the controller (the pass in
//! flight and its watches) and waits as a standby again, in the same process: an API server
//! outage longer than the Lease makes no replica exit. On SIGTERM or SIGINT the leader finishes
//! the pass in flight, releases the Lease so a standby takes over without waiting for expiry,
//! and exits 0.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::bail;
use tokio::sync::watch;

use crate::client::{Clients, Timeouts};
use crate::controller::{self, Settings};
use crate::health::Health;
use crate::leader::{Elector, LeaseSettings, WriteGate};
use crate::metrics::Metrics;

/// Settings of `gpu-operator run`.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub namespace: Option<String>,
    pub metrics_addr: SocketAddr,
    /// HTTPS with TokenReview and SubjectAccessReview on /metrics ([`crate::http`]).
    pub metrics_secure: bool,
    /// Folder of the mounted metrics certificate; self-signed without it.
    pub metrics_cert_path: Option<std::path::PathBuf>,
    pub health_addr: SocketAddr,
    pub leader_elect: bool,
    pub lease_name: String,
    /// Namespace of the Lease; `None`: the operator namespace.
    pub lease_namespace: Option<String>,
    pub lease_duration: Duration,
    pub identity: Option<String>,
    pub gpu_label_grace: Duration,
    /// The longest one reconcile pass may run before it is abandoned and retried.
    pub pass_deadline: Duration,
    /// How long work may wait with no pass completing before `/healthz` fails.
    pub stall: Duration,
    pub json_logs: bool,
    /// Check the served ClusterPolicy CRD and upgrade it when it is ours ([`crate::crd_upgrade`]).
    pub upgrade_crd: bool,
    /// Namespaces whose NVIDIA operator Lease is trusted as it is (controller::coexist).
    pub nvidia_operator_namespaces: std::collections::BTreeSet<String>,
}

/// How long a controller that failed (not stopped) waits before it starts again.
const CONTROLLER_RESTART: Duration = Duration::from_secs(5);

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
    let identity = options
        .identity
        .clone()
        .or_else(|| std::env::var("POD_NAME").ok())
        .unwrap_or_else(|| format!("{}-{}", hostname(), std::process::id()));
    let lease = LeaseSettings {
        name: options.lease_name.clone(),
        namespace: options
            .lease_namespace
            .clone()
            .unwrap_or_else(|| namespace.clone()),
        identity: identity.clone(),
        duration: options.lease_duration.max(Duration::from_secs(2)),
    };
    let gate = if options.leader_elect {
        WriteGate::leased(lease.write_window())
    } else {
        WriteGate::always_open()
    };
    let clients = crate::client::clients(Timeouts::default(), &gate).await?;
    let metrics = Metrics::default();
    // Not ready until the controller's first pass (or, for a standby, until it waits for the
    // Lease): crate::health.
    let health = Health::new(options.stall);
    let access = if options.metrics_secure {
        crate::http::MetricsAccess::Secure {
            tls: crate::http::tls::server_config(options.metrics_cert_path.as_deref())?,
            authorizer: std::sync::Arc::new(crate::http::auth::Authorizer::new(
                clients.lease.clone(),
            )),
        }
    } else {
        crate::http::MetricsAccess::Open
    };
    let limits = crate::http::Limits::default();
    // Bound here, so that an address in use stops the start with a message.
    let probe_listener = crate::http::bind(options.health_addr, "probe", "--health-addr").await?;
    let metrics_listener =
        crate::http::bind(options.metrics_addr, "metrics", "--metrics-addr").await?;
    let http = Endpoints {
        probes: tokio::spawn(crate::http::serve_probes(
            probe_listener,
            health.clone(),
            limits,
        )),
        metrics: tokio::spawn(crate::http::serve_metrics(
            metrics_listener,
            metrics.clone(),
            access,
            limits,
        )),
    };

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
        pass_deadline: options.pass_deadline,
        nvidia_operator_namespaces: options.nvidia_operator_namespaces.clone(),
        metrics_https: options.metrics_secure,
    };
    let reconcile = Reconcile {
        clients: &clients,
        settings: &settings,
        metrics: &metrics,
        health: &health,
        upgrade_crd: options.upgrade_crd,
    };

    if !options.leader_elect {
        loop {
            match reconcile.run(stopped()).await {
                Ok(()) => break,
                Err(e) => {
                    tracing::error!(
                        error = format!("{e:#}"),
                        "the controller failed; starting it again"
                    );
                    if wait_or_stopped(CONTROLLER_RESTART, stopped()).await {
                        break;
                    }
                }
            }
        }
        http.abort();
        return Ok(());
    }

    let lease_namespace = lease.namespace.clone();
    let mut elector = Elector::new(clients.lease.clone(), lease, gate);
    loop {
        // A standby is ready (a rolling update waits for it while the old leader holds the
        // Lease).
        health.set_ready(true);
        tracing::info!(%identity, lease = %options.lease_name, %lease_namespace, "waiting to become leader");
        tokio::select! {
            () = elector.acquire() => {},
            () = stopped() => break,
        }
        tracing::info!(%identity, "became leader");
        // The leader is ready again once its caches are filled and its first pass finished.
        health.set_ready(false);
        let outcome = tokio::select! {
            ended = reconcile.run(stopped()) => Led::Ended(ended),
            lost = elector.keep() => Led::Lost(lost),
        };
        health.controller_stopped();
        match outcome {
            Led::Ended(Ok(())) => {
                release(&mut elector).await;
                break;
            }
            Led::Ended(Err(e)) => {
                tracing::error!(
                    error = format!("{e:#}"),
                    "the controller failed; giving up the Lease and starting again"
                );
                release(&mut elector).await;
                if wait_or_stopped(CONTROLLER_RESTART, stopped()).await {
                    break;
                }
            }
            Led::Lost(why) => {
                tracing::error!(reason = %why, "stepped down as leader: the write gate is closed and the controller stopped; waiting as a standby");
            }
        }
    }
    http.abort();
    Ok(())
}

/// The endpoint servers' tasks, stopped when the operator stops.
struct Endpoints {
    probes: tokio::task::JoinHandle<anyhow::Result<()>>,
    metrics: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Endpoints {
    fn abort(&self) {
        self.probes.abort();
        self.metrics.abort();
    }
}

/// How a term as leader ended.
enum Led {
    /// The controller returned (stopped, or failed).
    Ended(anyhow::Result<()>),
    /// Leadership was lost while the controller ran.
    Lost(crate::leader::Lost),
}

/// What a leader (or the single replica) runs.
struct Reconcile<'a> {
    clients: &'a Clients,
    settings: &'a Settings,
    metrics: &'a Metrics,
    health: &'a Health,
    upgrade_crd: bool,
}

impl Reconcile<'_> {
    async fn run(&self, stopped: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
        // Only the leader writes the CRD, before the controller probes its schema.
        if self.upgrade_crd {
            crate::crd_upgrade::ensure_and_log(&self.clients.requests).await;
        }
        controller::run(
            controller::Clients {
                requests: self.clients.requests.clone(),
                watches: self.clients.watches.clone(),
            },
            self.settings.clone(),
            self.metrics.clone(),
            self.health.clone(),
            stopped,
        )
        .await
    }
}

/// Releases the Lease so a standby takes over without waiting for it to expire.
async fn release(elector: &mut Elector) {
    match elector.release().await {
        Ok(()) => tracing::info!("leader Lease released"),
        Err(e) => {
            tracing::warn!(error = %e, "releasing the leader Lease failed; a standby takes over when it expires");
        }
    }
}

/// Sleeps for `wait`; `true` when a termination signal came first.
async fn wait_or_stopped(wait: Duration, stopped: impl Future<Output = ()>) -> bool {
    tokio::select! {
        () = tokio::time::sleep(wait) => false,
        () = stopped => true,
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "gpu-operator".into())
}
