//! The operator's HTTP endpoints (IO): `/metrics`, `/healthz` (200 unless the reconcile loop is
//! wedged) and `/readyz` (200 once this replica can serve: [`crate::health`] says when).

use std::net::SocketAddr;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use crate::health::Health;
use crate::metrics::Metrics;

#[derive(Clone)]
struct Shared {
    metrics: Metrics,
    health: Health,
}

/// Serves the endpoints on `addr` until the process ends.
pub async fn serve(addr: SocketAddr, metrics: Metrics, health: Health) -> anyhow::Result<()> {
    let app = Router::new()
        .route(
            "/metrics",
            get(|State(s): State<Shared>| async move { s.metrics.encode() }),
        )
        .route(
            "/healthz",
            get(|State(s): State<Shared>| async move {
                match s.health.live() {
                    Ok(()) => (StatusCode::OK, "ok".to_owned()),
                    Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
                }
            }),
        )
        .route(
            "/readyz",
            get(|State(s): State<Shared>| async move {
                if s.health.is_ready() {
                    (StatusCode::OK, "ready")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not ready")
                }
            }),
        )
        .with_state(Shared { metrics, health });
    let listener = tokio::net::TcpListener::bind(addr).await?;
    axum::serve(listener, app).await?;
    Ok(())
}
