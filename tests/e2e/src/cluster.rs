//! Connecting to the harness: the admin client, identities with their own token, and kubectl.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{Api, PostParams};
use kube::config::{AuthInfo, KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

/// The harness folder (logs, pids, audit log), from `HARNESS_DIR` as written by `up.sh`.
pub fn harness_dir() -> Result<PathBuf> {
    std::env::var_os("HARNESS_DIR")
        .map(PathBuf::from)
        .context("HARNESS_DIR is not set: start the harness with tests/cluster/up.sh and source $HARNESS_DIR/env (make test does both)")
}

async fn admin_config() -> Result<Config> {
    let path = std::env::var_os("KUBECONFIG")
        .context("KUBECONFIG is not set: start the harness with tests/cluster/up.sh first")?;
    let kubeconfig = Kubeconfig::read_from(&path)
        .with_context(|| format!("reading kubeconfig {}", PathBuf::from(&path).display()))?;
    Ok(Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?)
}

/// A client with the harness admin identity (`system:masters`).
pub async fn client() -> Result<Client> {
    Ok(Client::try_from(admin_config().await?)?)
}

/// A client that authenticates with a bound token of ServiceAccount `namespace/name`, so its
/// requests show up in the audit log under `system:serviceaccount:<namespace>:<name>`.
pub async fn service_account_client(admin: &Client, namespace: &str, name: &str) -> Result<Client> {
    let token = service_account_token(admin, namespace, name).await?;
    let mut config = admin_config().await?;
    config.auth_info = AuthInfo {
        token: Some(token.into()),
        ..AuthInfo::default()
    };
    Ok(Client::try_from(config)?)
}

/// A one-hour token for ServiceAccount `namespace/name` (what `kubectl create token` does).
pub async fn service_account_token(admin: &Client, namespace: &str, name: &str) -> Result<String> {
    service_account_token_valid_for(admin, namespace, name, 3600).await
}

/// A token for ServiceAccount `namespace/name` valid for `seconds` (runs longer than an hour).
pub async fn service_account_token_valid_for(
    admin: &Client,
    namespace: &str,
    name: &str,
    seconds: i64,
) -> Result<String> {
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(seconds),
            ..TokenRequestSpec::default()
        }),
        ..TokenRequest::default()
    };
    let api: Api<ServiceAccount> = Api::namespaced(admin.clone(), namespace);
    let response = api
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .with_context(|| format!("requesting a token for ServiceAccount {namespace}/{name}"))?;
    response
        .status
        .and_then(|s| s.token)
        .context("token request returned no token")
}

/// `kubectl` from the harness PATH, talking to the harness through `KUBECONFIG`.
pub fn kubectl() -> Command {
    Command::new("kubectl")
}

/// Runs a kubectl command and returns its stdout, failing with its stderr.
pub fn kubectl_output(args: &[&str]) -> Result<String> {
    let output = kubectl().args(args).output().context("running kubectl")?;
    anyhow::ensure!(
        output.status.success(),
        "kubectl {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?)
}

/// A value from `tests/cluster/versions.env`, e.g. `KUBERNETES_VERSION`.
pub fn pinned_version(key: &str) -> Result<String> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../cluster/versions.env");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .filter_map(|line| line.split_once('='))
        .find(|(k, _)| k.trim() == key)
        .map(|(_, v)| v.trim().to_string())
        .with_context(|| format!("{key} is not set in {}", path.display()))
}

/// A name unique to this test run, for namespaces and objects tests create.
pub fn unique_name(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    format!("{prefix}-{:x}{n}", nanos % 0xfffff)
}
