//! The operator's HTTP endpoints (IO), on two listeners as kubebuilder's operators have them:
//!
//! - the probes, `/healthz` (200 unless the reconcile loop is wedged) and `/readyz` (200 once
//!   this replica can serve: [`crate::health`] says when), plain HTTP and open, since the
//!   kubelet calls them without credentials;
//! - `/metrics`, by default over HTTPS and only for callers the API server authenticates
//!   (TokenReview) and authorizes for `get` on the non-resource URL `/metrics`
//!   (SubjectAccessReview): [`auth`]. `--metrics-secure=false` serves it as NVIDIA's operator
//!   does, plain and open.
//!
//! Both listeners bound what one client can hold ([`Limits`]): the request head must arrive
//! within a few seconds, a connection lives at most a minute, and only so many are open at
//! once; the next waits in the kernel's backlog.

pub mod auth;
pub mod tls;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;

use crate::health::Health;
use crate::metrics::Metrics;
use auth::{Authorizer, Verdict};

/// What one listener allows a client.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// From accepting a connection (or the end of its last response) to the end of the next
    /// request's head, TLS handshake included: a client that sends nothing, or a byte at a
    /// time, loses its connection after this.
    pub header_read_timeout: Duration,
    /// Connections served at once; further clients wait to be accepted.
    pub max_connections: usize,
    /// The longest a connection is kept (keep-alive included) before it is closed gracefully,
    /// so an idle client cannot hold a slot for good.
    pub max_connection_age: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            // Prometheus and the kubelet send a request head in one packet.
            header_read_timeout: Duration::from_secs(5),
            // A few scrapers and the kubelet's two probes need a handful.
            max_connections: 32,
            max_connection_age: Duration::from_secs(60),
        }
    }
}

/// How `/metrics` is served.
pub enum MetricsAccess {
    /// HTTP, no authentication (NVIDIA's operator's way; `--metrics-secure=false`).
    Open,
    /// HTTPS, and only for callers the API server allows `get` on `/metrics`.
    Secure {
        tls: Arc<rustls::ServerConfig>,
        authorizer: Arc<Authorizer>,
    },
}

/// Serves `/healthz` and `/readyz` on `listener` until the process ends.
pub async fn serve_probes(
    listener: TcpListener,
    health: Health,
    limits: Limits,
) -> anyhow::Result<()> {
    serve(listener, probes_router(health), None, limits).await
}

/// Serves `/metrics` on `listener` until the process ends.
pub async fn serve_metrics(
    listener: TcpListener,
    metrics: Metrics,
    access: MetricsAccess,
    limits: Limits,
) -> anyhow::Result<()> {
    let (router, tls) = match access {
        MetricsAccess::Open => (metrics_router(metrics, None), None),
        MetricsAccess::Secure { tls, authorizer } => (
            metrics_router(metrics, Some(authorizer)),
            Some(TlsAcceptor::from(tls)),
        ),
    };
    serve(listener, router, tls, limits).await
}

/// Binds one endpoint's listener; `what` and the flag name it in the error.
pub async fn bind(addr: SocketAddr, what: &str, flag: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr).await.map_err(|e| {
        anyhow::anyhow!(
            "binding the {what} endpoint to {addr}: {e} (choose another address with {flag})"
        )
    })
}

pub fn probes_router(health: Health) -> Router {
    Router::new()
        .route(
            "/healthz",
            get(|State(h): State<Health>| async move {
                match h.live() {
                    Ok(()) => (StatusCode::OK, "ok".to_owned()),
                    Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
                }
            }),
        )
        .route(
            "/readyz",
            get(|State(h): State<Health>| async move {
                if h.is_ready() {
                    (StatusCode::OK, "ready")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not ready")
                }
            }),
        )
        .with_state(health)
}

#[derive(Clone)]
struct MetricsState {
    metrics: Metrics,
    authorizer: Option<Arc<Authorizer>>,
}

pub fn metrics_router(metrics: Metrics, authorizer: Option<Arc<Authorizer>>) -> Router {
    Router::new()
        .route("/metrics", get(scrape))
        .with_state(MetricsState {
            metrics,
            authorizer,
        })
}

async fn scrape(State(s): State<MetricsState>, headers: HeaderMap) -> Response {
    if let Some(authorizer) = &s.authorizer {
        match authorizer.check(headers.get(header::AUTHORIZATION)).await {
            Verdict::Allowed => {}
            Verdict::Unauthenticated(why) => {
                return (
                    StatusCode::UNAUTHORIZED,
                    [(header::WWW_AUTHENTICATE, "Bearer")],
                    why,
                )
                    .into_response();
            }
            Verdict::Forbidden(why) => return (StatusCode::FORBIDDEN, why).into_response(),
            Verdict::Failed(why) => {
                tracing::warn!(error = %why, "could not review a /metrics caller");
                return (StatusCode::INTERNAL_SERVER_ERROR, why).into_response();
            }
        }
    }
    s.metrics.encode().into_response()
}

/// Accepts connections on `listener` (through TLS when `tls` is given) and serves `router` on
/// each, within `limits`, until the process ends.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Option<TlsAcceptor>,
    limits: Limits,
) -> anyhow::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    loop {
        // A slot first: at the limit nothing more is accepted.
        let slot = slots.clone().acquire_owned().await?;
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, say: wait a little instead of spinning.
                tracing::warn!(error = %e, "accepting a connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let router = router.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let _slot = slot;
            match tls {
                None => serve_connection(TokioIo::new(stream), router, limits).await,
                Some(acceptor) => {
                    let handshake =
                        tokio::time::timeout(limits.header_read_timeout, acceptor.accept(stream));
                    if let Ok(Ok(stream)) = handshake.await {
                        serve_connection(TokioIo::new(stream), router, limits).await;
                    }
                }
            }
        });
    }
}

/// HTTP/1.1 on one connection, within `limits`.
async fn serve_connection<I>(io: I, router: Router, limits: Limits)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .serve_connection(io, TowerToHyperService::new(router));
    let mut connection = std::pin::pin!(connection);
    tokio::select! {
        _ = connection.as_mut() => {}
        () = tokio::time::sleep(limits.max_connection_age) => {
            // Let a response in flight finish, then close.
            connection.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(limits.header_read_timeout, connection).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    async fn start(limits: Limits) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let health = Health::new(Duration::from_secs(600));
        tokio::spawn(serve(listener, probes_router(health), None, limits));
        addr
    }

    fn short_limits() -> Limits {
        Limits {
            header_read_timeout: Duration::from_millis(300),
            max_connections: 2,
            max_connection_age: Duration::from_secs(30),
        }
    }

    /// Reads until the peer closes; `None` when it did not within `within`.
    async fn read_until_closed(
        stream: &mut tokio::net::TcpStream,
        within: Duration,
    ) -> Option<String> {
        let mut text = Vec::new();
        tokio::time::timeout(within, stream.read_to_end(&mut text))
            .await
            .ok()?
            .ok()?;
        Some(String::from_utf8_lossy(&text).into_owned())
    }

    #[tokio::test]
    async fn a_client_that_never_finishes_its_request_head_is_disconnected() {
        let addr = start(short_limits()).await;
        let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        // The rest of the head never comes: the server closes the connection.
        assert!(
            read_until_closed(&mut slow, Duration::from_secs(5))
                .await
                .is_some(),
            "the connection stayed open without a complete request head"
        );
    }

    #[tokio::test]
    async fn connections_past_the_limit_wait_until_a_slot_frees() {
        let limits = Limits {
            header_read_timeout: Duration::from_secs(2),
            ..short_limits()
        };
        let addr = start(limits).await;
        // Two idle connections fill both slots.
        let idle_a = tokio::net::TcpStream::connect(addr).await.unwrap();
        let idle_b = tokio::net::TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut third = tokio::net::TcpStream::connect(addr).await.unwrap();
        third
            .write_all(b"GET /healthz HTTP/1.0\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(
            read_until_closed(&mut third, Duration::from_millis(800)).await,
            None,
            "a third connection was served while two held both slots"
        );
        // The idle ones are dropped by the header timeout; the third is served then.
        let answer = read_until_closed(&mut third, Duration::from_secs(5))
            .await
            .expect("the waiting connection was never served");
        assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
        drop((idle_a, idle_b));
    }
}
