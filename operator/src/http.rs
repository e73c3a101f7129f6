//! The operator's HTTP endpoints (IO): `/metrics`, `/healthz` (the process is alive) and
//! `/readyz` (this replica holds the lease and its caches are filled, or it is a healthy
//! standby: both are ready to serve; only a replica that lost its lease is not).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use crate::metrics::Metrics;

#[derive(Clone)]
struct Shared {
    metrics: Metrics,
    ready: Arc<AtomicBool>,
}

/// Serves the endpoints on `addr` until the process ends. `ready` is flipped by `run`.
pub async fn serve(
    addr: SocketAddr,
    metrics: Metrics,
    ready: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let app = Router::new()
        .route(
            "/metrics",
            get(|State(s): State<Shared>| async move { s.metrics.encode() }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(|State(s): State<Shared>| async move {
                if s.ready.load(Ordering::Relaxed) {
                    (StatusCode::OK, "ready")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not ready")
                }
            }),
        )
        .with_state(Shared { metrics, ready });
    let listener = tokio::net::TcpListener::bind(addr).await?;
    axum::serve(listener, app).await?;
    Ok(())
}
