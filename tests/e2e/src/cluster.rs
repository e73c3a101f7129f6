//! Connecting to the harness (IO): whether this run has a test cluster at all (the one place a
//! test without one is skipped, or failed where the harness is expected), the admin client,
//! identities with their own token, and kubectl.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result};
use k8s_openapi::api::authentication::v1::{
    BoundObjectReference, SelfSubjectReview, TokenRequest, TokenRequestSpec,
};
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use kube::api::{Api, PostParams};
use kube::config::{AuthInfo, KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

/// Set (to anything but empty or `0`) where a harness is expected: tests/e2e.sh and
/// tests/chaos.sh start one and export it, so a test that finds no cluster there fails instead
/// of being skipped, and a skip can never hide a failure in CI.
pub const REQUIRE_CLUSTER_ENV: &str = "E2E_REQUIRE_CLUSTER";

/// How to get what a skipped test needs.
const HOW_TO_RUN: &str = "run `make test` or tests/e2e.sh";

/// Whether this run must have the harness (see [`REQUIRE_CLUSTER_ENV`]).
pub fn cluster_required() -> bool {
    std::env::var_os(REQUIRE_CLUSTER_ENV).is_some_and(|v| !v.is_empty() && v != "0")
}

/// What a test does without something it needs (a test cluster, a tool the harness build
/// provides): with it, `Some`; without it, `None` after one line on stderr naming the test and
/// what is missing (the caller returns: the test is skipped), or a panic where the harness is
/// expected ([`cluster_required`]). Every skip of the e2e crate is decided here.
pub fn prerequisite<T>(missing: &str, found: Result<T>) -> Option<T> {
    match found {
        Ok(value) => Some(value),
        Err(e) if cluster_required() => {
            panic!("{missing}, but {REQUIRE_CLUSTER_ENV} is set (the harness should be up): {e:#}")
        }
        Err(_) => {
            // Straight to the stderr stream: the test harness captures `eprintln!` of passing
            // tests, and a skip has to be seen.
            let test = std::thread::current()
                .name()
                .filter(|name| *name != "main")
                .map(|name| format!("test {name} "))
                .unwrap_or_default();
            let _ = writeln!(
                std::io::stderr().lock(),
                "{test}skipped: {missing} ({HOW_TO_RUN})"
            );
            None
        }
    }
}

/// The harness this run talks to, from the environment `$HARNESS_DIR/env` sets.
#[derive(Clone, Debug)]
pub struct TestCluster {
    /// Logs, pids, PKI and the audit log.
    pub dir: PathBuf,
    /// The admin kubeconfig.
    pub kubeconfig: PathBuf,
}

impl TestCluster {
    /// Both variables or none: `KUBECONFIG` alone may name someone's real cluster, which these
    /// tests (they delete every ClusterPolicy, add nodes, restart the API server) must never
    /// touch.
    fn from_env() -> Result<Self> {
        let dir = harness_dir()?;
        let kubeconfig = std::env::var_os("KUBECONFIG")
            .map(PathBuf::from)
            .context("HARNESS_DIR is set but KUBECONFIG is not: source $HARNESS_DIR/env")?;
        Ok(TestCluster { dir, kubeconfig })
    }
}

/// The test cluster, or `None` when this run has none and the test is to be skipped
/// ([`prerequisite`]). For tests that need the cluster but not a client (yet).
pub fn test_cluster() -> Option<TestCluster> {
    prerequisite("no test cluster", TestCluster::from_env())
}

/// The admin client of the test cluster, or `None` when this run has none and the test is to
/// be skipped ([`prerequisite`]). Every cluster test starts here (or in the session builder,
/// which starts here). A cluster that is there but does not answer is a failure, not a skip.
pub async fn connect() -> Option<Client> {
    test_cluster()?;
    match client().await {
        Ok(client) => Some(client),
        Err(e) => panic!("connecting to the test cluster: {e:#}"),
    }
}

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

/// A client with the token the kubelet would mount into `pod`: its ServiceAccount's, bound to
/// the pod, so the API server adds the pod's node to the user's extra claims
/// (`authentication.kubernetes.io/node-name`), as it does for a real operand pod.
pub async fn pod_bound_client(admin: &Client, pod: &Pod) -> Result<Client> {
    let namespace = pod
        .metadata
        .namespace
        .as_deref()
        .context("pod without namespace")?;
    let name = pod.metadata.name.as_deref().context("pod without name")?;
    let service_account = pod
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.as_deref())
        .context("pod without ServiceAccount")?;
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(3600),
            bound_object_ref: Some(BoundObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Pod".to_owned()),
                name: Some(name.to_owned()),
                uid: pod.metadata.uid.clone(),
            }),
            ..TokenRequestSpec::default()
        }),
        ..TokenRequest::default()
    };
    let api: Api<ServiceAccount> = Api::namespaced(admin.clone(), namespace);
    let token = api
        .create_token_request(service_account, &PostParams::default(), &request)
        .await
        .with_context(|| {
            format!("requesting a token of {namespace}/{service_account} bound to pod {name}")
        })?
        .status
        .and_then(|s| s.token)
        .context("token request returned no token")?;
    let mut config = admin_config().await?;
    config.auth_info = AuthInfo {
        token: Some(token.into()),
        ..AuthInfo::default()
    };
    Ok(Client::try_from(config)?)
}

/// The values of extra claim `key` of the user `client` authenticates as (SelfSubjectReview).
pub async fn own_extra_claim(client: &Client, key: &str) -> Result<Vec<String>> {
    let review = Api::<SelfSubjectReview>::all(client.clone())
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await
        .context("SelfSubjectReview")?;
    Ok(review
        .status
        .and_then(|s| s.user_info)
        .and_then(|u| u.extra)
        .and_then(|mut extra| extra.remove(key))
        .unwrap_or_default())
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

/// Creates namespace `name` (unlabelled; the test deletes it).
pub async fn create_namespace(admin: &Client, name: &str) -> Result<()> {
    let namespace = Namespace {
        metadata: kube::api::ObjectMeta {
            name: Some(name.to_owned()),
            ..kube::api::ObjectMeta::default()
        },
        ..Namespace::default()
    };
    Api::<Namespace>::all(admin.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .with_context(|| format!("creating namespace {name}"))?;
    Ok(())
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
