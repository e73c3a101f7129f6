//! The Kubernetes clients of `gpu-operator run` (IO set-up): every request bounded by
//! timeouts, and every mutating request refused while the replica's write gate is closed
//! ([`crate::leader::WriteGate`]), so no code path can write for a replica that may have lost
//! its Lease.
//!
//! Two clients come from one configuration: one for request/response calls, with a read
//! timeout (an API server that accepts a request and never answers cannot stall the reconcile
//! loop), and one for watches, without it (a quiet watch is healthy; kube-runtime's watcher
//! has its own idle timeout).
//!
//! Each client's HTTP stack is kube's default one with a smaller cap on hyper's HTTP/1 read
//! buffer ([`READ_BUFFER_MAX`]) and an idle timeout for pooled connections
//! ([`POOL_IDLE_TIMEOUT`]). The request client and the Lease's share one connection pool, so
//! the renewals keep a connection open for the next change's first write.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http_body_util::BodyExt as _;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kube::Client;
use kube::client::retry::RetryPolicy;
use kube::client::{ClientBuilder, ConfigExt as _, DynBody};
use tower::retry::RetryLayer;
use tower::util::BoxService;
use tower::{ServiceBuilder, ServiceExt as _};

use crate::leader::WriteGate;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The largest read buffer of one connection. hyper grows a connection's buffer while a large
/// response streams in (a LIST of every node or pod) up to its default of ~400 KiB and keeps it
/// for the connection's life; every watch holds a connection, so at 1,000 nodes these buffers
/// were 2.5 MiB of a 16 MiB heap (bench/results/heap-n1000.md). 32 KiB is two TLS records per
/// read; a long response takes more reads, not more memory.
pub const READ_BUFFER_MAX: usize = 32 * 1024;

/// How long an unused pooled connection stays open. hyper closes idle connections only when a
/// timer is set, and kube sets none: every connection of a burst (16 label patches, the apply's
/// tiers) stayed open, with its buffers and TLS state, for the life of the process. A pass's
/// requests seconds apart still reuse them.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(10);

/// The service stack of a client: kube's own type, so either builder below yields it.
type Stack = BoxService<http::Request<kube::client::Body>, http::Response<Box<DynBody>>, BoxError>;

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
    clients_from(config, timeouts, gate)
}

fn clients_from(
    config: kube::Config,
    timeouts: Timeouts,
    gate: &WriteGate,
) -> Result<Clients, Error> {
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
    // One pool for the requests and the Lease (same timeouts). A change often comes after
    // minutes without a write, when every connection of the last burst has been closed (by
    // POOL_IDLE_TIMEOUT here, or after 90 s by the API server): its first writes then waited
    // for a TCP and TLS handshake, 40-45 ms per change at 1,000 nodes (bench/results/README.md,
    // "first change after idle"). The renewals, every few seconds, keep a connection of this pool open.
    let shared = pool(&requests)?;
    let watch_pool = pool(&watches)?;
    Ok(Clients {
        requests: gated(builder(requests.clone(), shared.clone())?, gate),
        watches: gated(builder(watches, watch_pool)?, gate),
        lease: builder(requests, shared)?.build(),
    })
}

fn gated(builder: ClientBuilder<Stack>, gate: &WriteGate) -> Client {
    builder.with_layer(&GateLayer(gate.clone())).build()
}

/// A hyper client, and with it a connection pool, whose read buffer is capped and whose idle
/// connections close. None where kube's own builder must be used: a proxy, or an exec
/// credential plugin (the proxy connectors and the expiry of exec-issued certificates live
/// there).
fn pool(
    config: &kube::Config,
) -> Result<
    Option<
        hyper_util::client::legacy::Client<
            impl hyper_util::client::legacy::connect::Connect + Clone + Send + Sync + 'static,
            kube::client::Body,
        >,
    >,
    Error,
> {
    if config.proxy_url.is_some() || config.auth_info.exec.is_some() {
        return Ok(None);
    }
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    let tls = config
        .rustls_https_connector_with_connector(http)
        .map_err(Error::Build)?;
    let mut connector = hyper_timeout::TimeoutConnector::new(tls);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);
    Ok(Some(
        hyper_util::client::legacy::Builder::new(TokioExecutor::new())
            .http1_max_buf_size(READ_BUFFER_MAX)
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .build(connector),
    ))
}

/// kube's default stack (TLS, timeouts, base URI, retries of 429/503, credentials, extra
/// headers) over a hyper client from [`pool`], whose connections it shares with every other
/// stack built over that client. kube offers no hook for hyper's settings, so the stack is
/// assembled here from kube's own layers. Without a pool, kube's builder, unchanged.
fn builder<C>(
    config: kube::Config,
    pool: Option<hyper_util::client::legacy::Client<C, kube::client::Body>>,
) -> Result<ClientBuilder<Stack>, Error>
where
    C: hyper_util::client::legacy::connect::Connect + Clone + Send + Sync + 'static,
{
    let Some(client) = pool else {
        return ClientBuilder::try_from(config).map_err(Error::Build);
    };
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(
            config
                .default_retry
                .then(|| RetryLayer::new(RetryPolicy::server_retry())),
        )
        .option_layer(config.auth_layer().map_err(Error::Build)?)
        .layer(config.extra_headers_layer().map_err(Error::Build)?)
        .map_err(BoxError::from)
        .service(client)
        .map_response(|response| {
            response.map(|body| Box::new(body.map_err(BoxError::from)) as Box<DynBody>)
        });
    Ok(ClientBuilder::new(
        BoxService::new(service),
        config.default_namespace,
    ))
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

    /// Serves one HTTP/1.1 response with `body` (and `extra` header lines) to each connection
    /// on a local port; the receiver hears of each connection the client closed.
    async fn serve(
        body: Vec<u8>,
        extra: String,
    ) -> (u16, tokio::sync::mpsc::UnboundedReceiver<()>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (closed, closes) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let (body, extra, closed) = (body.clone(), extra.clone(), closed.clone());
                tokio::spawn(async move {
                    let mut buffer = vec![0; 4096];
                    let _ = socket.read(&mut buffer).await;
                    let header = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{extra}\r\n",
                        body.len()
                    );
                    let _ = socket.write_all(header.as_bytes()).await;
                    let _ = socket.write_all(&body).await;
                    while matches!(socket.read(&mut buffer).await, Ok(n) if n > 0) {}
                    let _ = closed.send(());
                });
            }
        });
        (port, closes)
    }

    #[tokio::test]
    async fn a_response_many_times_the_read_buffer_arrives_whole() {
        // 3.7 MiB of JSON, like a LIST of thousands of nodes: over a hundred times the cap.
        let items: Vec<String> = (0..240_000).map(|i| format!("node-{i:08}")).collect();
        let body = serde_json::to_vec(&serde_json::json!({ "items": items })).unwrap();
        assert!(body.len() > 100 * READ_BUFFER_MAX, "{}", body.len());
        let (port, _) = serve(body.clone(), String::new()).await;
        let client = local_client(port);
        let received = client.request_text(get_nodes()).await.unwrap();
        assert_eq!(received.as_bytes(), body.as_slice());
    }

    #[tokio::test]
    async fn the_read_buffer_is_capped() {
        // hyper refuses a response head that fills the whole buffer: with its default cap
        // (~400 KiB) this 64 KiB header would be read.
        let header = format!("x-filler: {}\r\n", "a".repeat(2 * READ_BUFFER_MAX));
        let (port, _) = serve(b"{}".to_vec(), header).await;
        let client = local_client(port);
        let err = client.request_text(get_nodes()).await.unwrap_err();
        assert!(format!("{err:?}").contains("TooLarge"), "{err:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_pooled_connection_is_closed() {
        let (port, mut closes) = serve(b"{}".to_vec(), String::new()).await;
        let client = local_client(port);
        client.request_text(get_nodes()).await.unwrap();
        let early = tokio::time::timeout(POOL_IDLE_TIMEOUT / 2, closes.recv()).await;
        assert!(early.is_err(), "closed before the idle timeout");
        // The pool looks for expired connections once per timeout: within two of them.
        tokio::time::timeout(POOL_IDLE_TIMEOUT * 2, closes.recv())
            .await
            .expect("the idle connection is still open")
            .unwrap();
    }

    fn local_config(port: u16) -> kube::Config {
        kube::Config::new(format!("http://127.0.0.1:{port}").parse().unwrap())
    }

    fn local_client(port: u16) -> Client {
        let config = local_config(port);
        let pool = pool(&config).unwrap();
        gated(
            builder(config, pool).unwrap(),
            &WriteGate::leased(Duration::from_secs(10)),
        )
    }

    /// Answers every request on a connection (keep-alive) with `{}`; counts the connections.
    async fn serve_keep_alive() -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = std::sync::Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut socket = BufReader::new(socket);
                    let mut line = String::new();
                    loop {
                        // A request without a body: its head ends with an empty line.
                        line.clear();
                        match socket.read_line(&mut line).await {
                            Ok(0) | Err(_) => return,
                            Ok(_) if line == "\r\n" => {}
                            Ok(_) => continue,
                        }
                        let response = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
                        if socket
                            .get_mut()
                            .write_all(response.as_bytes())
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                });
            }
        });
        (port, accepted)
    }

    #[tokio::test]
    async fn the_request_client_reuses_the_connection_the_lease_keeps_open() {
        let (port, accepted) = serve_keep_alive().await;
        let gate = WriteGate::leased(Duration::from_secs(10));
        let clients = clients_from(local_config(port), Timeouts::default(), &gate).unwrap();
        clients.lease.request_text(get_nodes()).await.unwrap();
        clients.requests.request_text(get_nodes()).await.unwrap();
        clients.lease.request_text(get_nodes()).await.unwrap();
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
        // Watches have no read timeout, so their connections are pooled apart.
        clients.watches.request_text(get_nodes()).await.unwrap();
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    fn get_nodes() -> http::Request<Vec<u8>> {
        http::Request::get("/api/v1/nodes").body(vec![]).unwrap()
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
