//! The Kubernetes clients of `gpu-operator run` (IO set-up): every request bounded by
//! timeouts, and every mutating request refused while the replica's write gate is closed
//! ([`crate::leader::WriteGate`]), so no code path can write for a replica that may have lost
//! its Lease.
//!
//! Two clients come from one configuration: one for request/response calls, with a read
//! timeout (an API server that accepts a request and never answers cannot stall the reconcile
//! loop), and one for watches, without it (a quiet watch is healthy; kube-runtime's watcher
//! has its own idle timeout).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use kube::Client;
use kube::client::ClientBuilder;

use crate::leader::WriteGate;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Timeouts of the request/response client.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// Establishing a connection.
    pub connect: Duration,
    /// Waiting for the response of a request that was sent.
    pub read: Duration,
    /// Sending a request.
    pub write: Duration,
}

impl Default for Timeouts {
    /// Generous for a loaded API server (a LIST of thousands of nodes takes seconds), short
    /// against a hang: the per-pass deadline and liveness build on them.
    fn default() -> Self {
        Timeouts {
            connect: Duration::from_secs(10),
            read: Duration::from_secs(60),
            write: Duration::from_secs(30),
        }
    }
}

/// The clients of one replica.
#[derive(Clone)]
pub struct Clients {
    /// Gets, lists, writes: bounded by [`Timeouts`], gated.
    pub requests: Client,
    /// Watches: connect timeout only, gated like the other (a watch never writes).
    pub watches: Client,
    /// The Lease's own calls: bounded, never gated (a renewal is what opens the gate).
    pub lease: Client,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading the Kubernetes client configuration (in-cluster, or KUBECONFIG): {0}")]
    Config(#[source] kube::config::InferConfigError),
    #[error("building the Kubernetes client: {0}")]
    Build(#[source] kube::Error),
}

/// Builds the clients from the in-cluster configuration or `KUBECONFIG`.
pub async fn clients(timeouts: Timeouts, gate: &WriteGate) -> Result<Clients, Error> {
    let config = kube::Config::infer().await.map_err(Error::Config)?;
    let mut requests = config.clone();
    requests.connect_timeout = Some(timeouts.connect);
    requests.read_timeout = Some(timeouts.read);
    requests.write_timeout = Some(timeouts.write);
    // The read timeout counts from when a request is sent, not from when its pooled
    // connection went idle.
    requests.reset_reader_on_write = true;
    let mut watches = config;
    watches.connect_timeout = Some(timeouts.connect);
    watches.write_timeout = Some(timeouts.write);
    watches.read_timeout = None;
    let lease = requests.clone();
    Ok(Clients {
        requests: gated(requests, gate)?,
        watches: gated(watches, gate)?,
        lease: Client::try_from(lease).map_err(Error::Build)?,
    })
}

fn gated(config: kube::Config, gate: &WriteGate) -> Result<Client, Error> {
    Ok(ClientBuilder::try_from(config)
        .map_err(Error::Build)?
        .with_layer(&GateLayer(gate.clone()))
        .build())
}

/// Whether a request changes state (every verb but get, list and watch).
fn is_mutating(method: &http::Method) -> bool {
    !matches!(
        *method,
        http::Method::GET | http::Method::HEAD | http::Method::OPTIONS
    )
}

/// The error a gated request fails with.
#[derive(Debug, thiserror::Error)]
#[error(
    "{method} {path} refused: this replica does not hold a current leader Lease (write gate closed)"
)]
pub struct GateClosed {
    method: http::Method,
    path: String,
}

/// A tower layer that refuses mutating requests while the gate is closed.
#[derive(Clone)]
struct GateLayer(WriteGate);

impl<S> tower::Layer<S> for GateLayer {
    type Service = GateService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GateService {
            inner,
            gate: self.0.clone(),
        }
    }
}

#[derive(Clone)]
struct GateService<S> {
    inner: S,
    gate: WriteGate,
}

impl<S, B> tower::Service<http::Request<B>> for GateService<S>
where
    S: tower::Service<http::Request<B>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if is_mutating(request.method()) && !self.gate.is_open() {
            let refused = GateClosed {
                method: request.method().clone(),
                path: request.uri().path().to_owned(),
            };
            return Box::pin(async move { Err(Box::new(refused) as BoxError) });
        }
        let response = self.inner.call(request);
        Box::pin(async move { response.await.map_err(Into::into) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::{Layer, Service};

    /// A service that answers every request with its method.
    #[derive(Clone)]
    struct Echo;

    impl Service<http::Request<()>> for Echo {
        type Response = String;
        type Error = BoxError;
        type Future = Pin<Box<dyn Future<Output = Result<String, BoxError>> + Send>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: http::Request<()>) -> Self::Future {
            let method = request.method().to_string();
            Box::pin(async move { Ok(method) })
        }
    }

    fn request(method: http::Method) -> http::Request<()> {
        http::Request::builder()
            .method(method)
            .uri("/api/v1/nodes/n1")
            .body(())
            .unwrap()
    }

    #[tokio::test]
    async fn a_closed_gate_refuses_writes_and_lets_reads_through() {
        let gate = WriteGate::leased(Duration::from_secs(10));
        let mut service = GateLayer(gate.clone()).layer(Echo);
        assert_eq!(
            service.call(request(http::Method::GET)).await.unwrap(),
            "GET"
        );
        for method in [
            http::Method::POST,
            http::Method::PUT,
            http::Method::PATCH,
            http::Method::DELETE,
        ] {
            let err = service.call(request(method.clone())).await.unwrap_err();
            assert!(
                err.to_string()
                    .contains(&format!("{method} /api/v1/nodes/n1 refused")),
                "{err}"
            );
        }
        gate.renewed(std::time::Instant::now());
        assert_eq!(
            service.call(request(http::Method::PATCH)).await.unwrap(),
            "PATCH"
        );
    }
}
