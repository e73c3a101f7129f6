//! The certificate `/metrics` serves (IO: reads files): one mounted from a Secret when
//! `--metrics-cert-path` names its folder (`tls.crt`, `tls.key`, as a `kubernetes.io/tls` Secret
//! holds them, cert-manager's for example), else a self-signed one made at start-up, which
//! Prometheus accepts with `insecureSkipVerify` (the token still has to pass).

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// File names in the mounted folder.
pub const CERT_FILE: &str = "tls.crt";
pub const KEY_FILE: &str = "tls.key";

/// The TLS settings of the metrics listener.
pub fn server_config(cert_dir: Option<&Path>) -> anyhow::Result<Arc<ServerConfig>> {
    let (chain, key) = match cert_dir {
        Some(dir) => mounted(dir)?,
        None => self_signed()?,
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("choosing TLS versions")?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .context("the metrics certificate and key do not match")?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

type Identity = (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

fn mounted(dir: &Path) -> anyhow::Result<Identity> {
    let cert = dir.join(CERT_FILE);
    let key = dir.join(KEY_FILE);
    let chain = CertificateDer::pem_file_iter(&cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("reading the metrics certificate {}", cert.display()))?;
    anyhow::ensure!(
        !chain.is_empty(),
        "{} holds no PEM certificate (--metrics-cert-path names a folder with {CERT_FILE} and {KEY_FILE})",
        cert.display()
    );
    let key = PrivateKeyDer::from_pem_file(&key)
        .with_context(|| format!("reading the metrics key {}", key.display()))?;
    Ok((chain, key))
}

fn self_signed() -> anyhow::Result<Identity> {
    let names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
    let rcgen::CertifiedKey { cert, signing_key } = rcgen::generate_simple_self_signed(names)
        .context("generating the self-signed metrics certificate")?;
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(signing_key.serialize_der()));
    Ok((vec![cert.der().clone()], key))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mounted_pair_is_served_and_a_missing_one_names_the_file() {
        let dir = std::env::temp_dir().join(format!("metrics-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let rcgen::CertifiedKey { cert, signing_key } =
            rcgen::generate_simple_self_signed(vec!["gpu-operator".into()]).unwrap();
        std::fs::write(dir.join(CERT_FILE), cert.pem()).unwrap();
        std::fs::write(dir.join(KEY_FILE), signing_key.serialize_pem()).unwrap();
        assert!(server_config(Some(&dir)).is_ok());
        std::fs::remove_file(dir.join(KEY_FILE)).unwrap();
        let err = format!("{:#}", server_config(Some(&dir)).unwrap_err());
        assert!(err.contains(KEY_FILE), "{err}");
        std::fs::remove_dir_all(&dir).ok();
        assert!(server_config(None).is_ok());
    }
}
