//! A scraper's view of the operator's endpoints: one GET, plain or over TLS, with or without a
//! bearer token, as a Prometheus scrape config with `scheme`, `bearerTokenFile` and
//! `tlsConfig.insecureSkipVerify` sends it (HTTP/1.0, so no HTTP client library is needed).

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// How to reach the endpoint.
#[derive(Clone, Copy, Debug)]
pub enum Scheme {
    Http,
    /// TLS, accepting any certificate (Prometheus' `insecureSkipVerify: true`); the handshake's
    /// signatures are still checked.
    HttpsSkipVerify,
}

/// The status code and body of GET `path` on 127.0.0.1:`port`; `None` while nothing answers.
pub async fn get(
    scheme: Scheme,
    port: u16,
    path: &str,
    token: Option<&str>,
) -> Option<(u16, String)> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let request = request(path, token);
    let text = match scheme {
        Scheme::Http => exchange(tcp, &request).await?,
        Scheme::HttpsSkipVerify => {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let config = rustls::ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .ok()?
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
                .with_no_client_auth();
            let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
            let name = ServerName::try_from("localhost").ok()?;
            exchange(connector.connect(name, tcp).await.ok()?, &request).await?
        }
    };
    let code = text.split(' ').nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((code, body))
}

fn request(path: &str, token: Option<&str>) -> String {
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n{auth}\r\n")
}

async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    request: &str,
) -> Option<String> {
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut bytes = Vec::new();
    // A TLS peer may close without close_notify after an HTTP/1.0 response: keep what came.
    let _ = stream.read_to_end(&mut bytes).await;
    (!bytes.is_empty()).then(|| String::from_utf8_lossy(&bytes).into_owned())
}

#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
