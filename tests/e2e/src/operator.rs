//! Running the real `gpu-operator` binary against the harness, as its own identity: a
//! ServiceAccount in a fresh namespace whose token is the operator's only credential, so the
//! audit log attributes its requests and RBAC applies to it as in a cluster.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, Role, RoleBinding, RoleRef, Subject,
};
use kube::Client;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};

use crate::cluster::{service_account_token, unique_name};
use crate::procs::{Signal, signal};

/// The operator binary built by `cargo build -p gpu-operator` (next to the test binaries).
pub fn binary() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("GPU_OPERATOR_BIN") {
        return Ok(path.into());
    }
    let exe = std::env::current_exe()?;
    // target/debug/deps/<test> -> target/debug/gpu-operator
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .context("locating the target folder")?;
    let path = dir.join("gpu-operator");
    anyhow::ensure!(
        path.exists(),
        "{} not found: run `cargo build -p gpu-operator` first (tests/e2e.sh does)",
        path.display()
    );
    Ok(path)
}

/// The operator's credentials: a ServiceAccount's token in a kubeconfig of its own. The
/// kubeconfig file is removed when this is dropped.
pub struct OperatorIdentity {
    pub namespace: String,
    pub service_account: String,
    pub kubeconfig: PathBuf,
    client: Client,
    /// The ClusterRole [`Self::with_generated_role`] created for this identity alone.
    own_role: Option<String>,
}

impl Drop for OperatorIdentity {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.kubeconfig);
    }
}

impl OperatorIdentity {
    /// A fresh namespace with a ServiceAccount bound to the operator's generated ClusterRole
    /// (`gpu-operator rbac`, what the chart and the CSV grant), created for this identity alone:
    /// the operator runs with exactly the chart's RBAC, never more. [`Self::delete`] removes
    /// the role too.
    pub async fn with_generated_role(admin: &Client) -> Result<Self> {
        Self::with_role(admin, generated_role(&unique_name("gpu-operator-role"))).await
    }

    /// [`Self::create`] with `role` applied first (server-side, so a role of a fixed name that
    /// an interrupted run left is taken over); [`Self::delete`] removes the role too.
    pub async fn with_role(admin: &Client, role: ClusterRole) -> Result<Self> {
        let name = role
            .metadata
            .name
            .clone()
            .context("the ClusterRole has no name")?;
        Api::<ClusterRole>::all(admin.clone())
            .patch(
                &name,
                &PatchParams::apply("e2e-operator-identity").force(),
                &Patch::Apply(&role),
            )
            .await
            .with_context(|| format!("applying ClusterRole {name}"))?;
        let mut identity = Self::create(admin, &name).await?;
        identity.own_role = Some(name);
        Ok(identity)
    }

    /// A fresh namespace with a ServiceAccount bound to `cluster_role` and, as the chart and
    /// the CSV install it, to the generated Role of the operator namespace (`gpu-operator
    /// rbac`); [`Self::delete`] removes them.
    pub async fn create(admin: &Client, cluster_role: &str) -> Result<Self> {
        let namespace = unique_name("gpu-operator");
        let meta = |name: &str| ObjectMeta {
            name: Some(name.to_string()),
            ..ObjectMeta::default()
        };
        Api::<Namespace>::all(admin.clone())
            .create(
                &PostParams::default(),
                &Namespace {
                    metadata: meta(&namespace),
                    ..Namespace::default()
                },
            )
            .await?;
        let sa = "gpu-operator";
        Api::<ServiceAccount>::namespaced(admin.clone(), &namespace)
            .create(
                &PostParams::default(),
                &ServiceAccount {
                    metadata: meta(sa),
                    ..ServiceAccount::default()
                },
            )
            .await?;
        let binding = ClusterRoleBinding {
            metadata: meta(&namespace),
            role_ref: RoleRef {
                api_group: Some("rbac.authorization.k8s.io".into()),
                kind: "ClusterRole".into(),
                name: cluster_role.into(),
            },
            subjects: Some(vec![Subject {
                kind: "ServiceAccount".into(),
                name: sa.into(),
                namespace: Some(namespace.clone()),
                ..Subject::default()
            }]),
        };
        Api::<ClusterRoleBinding>::all(admin.clone())
            .create(&PostParams::default(), &binding)
            .await?;
        apply_generated_role(admin, &namespace).await?;
        Self::existing(admin, &namespace, sa).await
    }

    /// A ServiceAccount someone else created, such as the Helm chart's.
    pub async fn existing(admin: &Client, namespace: &str, service_account: &str) -> Result<Self> {
        let token = service_account_token(admin, namespace, service_account).await?;
        let kubeconfig = write_token_kubeconfig(&format!("{namespace}-{service_account}"), &token)?;
        Ok(OperatorIdentity {
            namespace: namespace.to_string(),
            service_account: service_account.to_string(),
            kubeconfig,
            client: admin.clone(),
            own_role: None,
        })
    }

    /// The audit username of the operator.
    pub fn username(&self) -> String {
        crate::audit::service_account_user(&self.namespace, &self.service_account)
    }

    /// Deletes what [`Self::create`] made.
    pub async fn delete(self) -> Result<()> {
        Api::<ClusterRoleBinding>::all(self.client.clone())
            .delete(&self.namespace, &DeleteParams::default())
            .await?;
        Api::<Namespace>::all(self.client.clone())
            .delete(&self.namespace, &DeleteParams::default())
            .await?;
        if let Some(role) = &self.own_role {
            Api::<ClusterRole>::all(self.client.clone())
                .delete(role, &DeleteParams::default())
                .await?;
        }
        Ok(())
    }
}

/// Creates the operator's generated Role (`gpu-operator rbac`) in `namespace` and binds it to
/// ServiceAccount gpu-operator there, as the chart does in its release namespace.
pub async fn apply_generated_role(admin: &Client, namespace: &str) -> Result<()> {
    use gpu_operator::render::rbac;
    Api::<Role>::namespaced(admin.clone(), namespace)
        .create(
            &PostParams::default(),
            &rbac::operator_role(Some(namespace)),
        )
        .await
        .with_context(|| format!("creating the operator's Role in {namespace}"))?;
    Api::<RoleBinding>::namespaced(admin.clone(), namespace)
        .create(
            &PostParams::default(),
            &rbac::operator_role_binding(namespace),
        )
        .await
        .with_context(|| format!("creating the operator's RoleBinding in {namespace}"))?;
    apply_leader_election_role(admin, namespace, namespace).await
}

/// Creates the operator's leader-election Role in `lease_namespace` and binds it to
/// ServiceAccount gpu-operator of `namespace`, as the chart does where its Lease lives.
pub async fn apply_leader_election_role(
    admin: &Client,
    lease_namespace: &str,
    namespace: &str,
) -> Result<()> {
    use gpu_operator::render::rbac;
    Api::<Role>::namespaced(admin.clone(), lease_namespace)
        .create(
            &PostParams::default(),
            &rbac::leader_election_role(Some(lease_namespace)),
        )
        .await
        .with_context(|| format!("creating the leader-election Role in {lease_namespace}"))?;
    Api::<RoleBinding>::namespaced(admin.clone(), lease_namespace)
        .create(
            &PostParams::default(),
            &rbac::leader_election_role_binding(lease_namespace, namespace),
        )
        .await
        .with_context(|| {
            format!("creating the leader-election RoleBinding in {lease_namespace}")
        })?;
    Ok(())
}

/// Binds the generated Role of `namespace` ([`apply_generated_role`]) to another
/// ServiceAccount there, as a second replica with an identity of its own needs.
pub async fn bind_generated_role(
    admin: &Client,
    namespace: &str,
    service_account: &str,
) -> Result<()> {
    use gpu_operator::render::rbac;
    let mut binding = rbac::operator_role_binding(namespace);
    binding.metadata.name = Some(format!("{}-{service_account}", rbac::OPERATOR_ROLE));
    for subject in binding.subjects.iter_mut().flatten() {
        subject.name = service_account.to_owned();
    }
    Api::<RoleBinding>::namespaced(admin.clone(), namespace)
        .create(&PostParams::default(), &binding)
        .await
        .with_context(|| format!("binding the operator's Role to {namespace}/{service_account}"))?;
    let mut binding = rbac::leader_election_role_binding(namespace, namespace);
    binding.metadata.name = Some(format!("{}-{service_account}", rbac::LEADER_ELECTION_ROLE));
    for subject in binding.subjects.iter_mut().flatten() {
        subject.name = service_account.to_owned();
    }
    Api::<RoleBinding>::namespaced(admin.clone(), namespace)
        .create(&PostParams::default(), &binding)
        .await
        .with_context(|| {
            format!("binding the leader-election Role to {namespace}/{service_account}")
        })?;
    Ok(())
}

/// The operator's generated ClusterRole (`gpu-operator rbac`) under `name`.
pub fn generated_role(name: &str) -> ClusterRole {
    let mut role = gpu_operator::render::rbac::operator_cluster_role();
    role.metadata = ObjectMeta {
        name: Some(name.to_owned()),
        ..ObjectMeta::default()
    };
    role
}

/// A kubeconfig with the harness server and CA but authenticating with `token` only, written to
/// the temp folder as `<name>.kubeconfig`.
pub fn write_token_kubeconfig(name: &str, token: &str) -> Result<PathBuf> {
    let admin = std::env::var("KUBECONFIG").context("KUBECONFIG is not set")?;
    let text = std::fs::read_to_string(&admin)?;
    let mut config: serde_json::Value = serde_yaml_ng::from_str(&text)?;
    let cluster = config["clusters"][0]["name"].clone();
    config["users"] = serde_json::json!([{"name": "operator", "user": {"token": token}}]);
    config["contexts"] = serde_json::json!([{"name": "operator", "context": {"cluster": cluster, "user": "operator"}}]);
    config["current-context"] = serde_json::json!("operator");
    let path = std::env::temp_dir().join(format!("{name}.kubeconfig"));
    std::fs::write(&path, serde_yaml_ng::to_string(&config)?)?;
    Ok(path)
}

/// Arguments for an operator whose endpoints a test reads without credentials: plain HTTP
/// `/metrics`, and the probes on a port the system picks (so that several operators on one
/// machine do not collide on the default one).
pub const PLAIN_ENDPOINTS: [&str; 3] = ["--metrics-secure=false", "--health-addr", "127.0.0.1:0"];

/// Flags that say where and how the endpoints listen: a process here chooses its own.
const ENDPOINT_FLAGS: [&str; 4] = [
    "--metrics-addr",
    "--health-addr",
    "--metrics-secure",
    "--metrics-cert-path",
];

/// The container's arguments after `gpu-operator run`, less the endpoint flags
/// ([`ENDPOINT_FLAGS`]: the caller binds its own); an error for a container that does not run
/// `gpu-operator run`.
pub fn container_args(container: &k8s_openapi::api::core::v1::Container) -> Result<Vec<String>> {
    let mut words: Vec<String> = container
        .command
        .iter()
        .flatten()
        .chain(container.args.iter().flatten())
        .cloned()
        .collect();
    anyhow::ensure!(
        words.first().is_some_and(|w| w.ends_with("gpu-operator"))
            && words.get(1).is_some_and(|w| w == "run"),
        "container {} does not run `gpu-operator run`: {words:?}",
        container.name
    );
    words.drain(..2);
    let mut out = Vec::new();
    let mut skip_value = false;
    for word in words {
        if std::mem::take(&mut skip_value) {
            continue;
        }
        let flag = word.split_once('=').map_or(word.as_str(), |(flag, _)| flag);
        if ENDPOINT_FLAGS.contains(&flag) {
            // `--flag value` (not `--flag=value`) takes the next word with it.
            skip_value = flag == word;
        } else {
            out.push(word);
        }
    }
    Ok(out)
}

/// A running operator process (or container); killed when dropped.
pub struct Operator {
    child: Option<Child>,
    /// Set when it runs from its image under runc ([`Operator::start_in_container`]); `child`
    /// is then unset.
    pub container: Option<crate::container::RunningContainer>,
    pub log: PathBuf,
    pub metrics_port: u16,
    /// Where `/healthz` and `/readyz` answer (where the launcher said; else `metrics_port`).
    pub health_port: u16,
}

/// A free loopback port for the operator's endpoints, from this harness's own window
/// (`HARNESS_PORT_BASE` + [`PORT_WINDOW`]).
///
/// Not a port the kernel picks (`bind :0`): that one comes from the ephemeral range, and between
/// this probe and the operator's bind any outgoing connection (the operator's own to the API
/// server, kube-apiserver's to etcd) may take it as its source port. The window lies below the
/// ephemeral range (32768 and up by default) and beside the harness's fixed ports (tests/cluster/lib.sh),
/// so only another allocation can take it; ports are handed out in turn, and one still bound
/// (by an operator that has not yet exited, say) is skipped.
pub fn free_port() -> Result<u16> {
    let base: u16 = match std::env::var("HARNESS_PORT_BASE") {
        Ok(v) => v
            .parse()
            .with_context(|| format!("HARNESS_PORT_BASE={v}"))?,
        Err(_) => 16400,
    };
    anyhow::ensure!(
        base.checked_add(PORT_WINDOW.end).is_some(),
        "HARNESS_PORT_BASE={base} leaves no room for the ports {PORT_WINDOW:?} above it"
    );
    let len = u32::from(PORT_WINDOW.end - PORT_WINDOW.start);
    for _ in 0..len {
        let port = base + PORT_WINDOW.start + (next_port_slot() % len) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!(
        "no free port on 127.0.0.1 in {}..{} (HARNESS_PORT_BASE={base} + {PORT_WINDOW:?})",
        base + PORT_WINDOW.start,
        base + PORT_WINDOW.end
    )
}

/// Offsets from `HARNESS_PORT_BASE` that [`free_port`] hands out: past the fixed ports of
/// tests/cluster/lib.sh (0..=7 today) and short of the next harness's base (bases are 100 apart
/// in this repository's scripts).
pub const PORT_WINDOW: std::ops::Range<u16> = 16..100;

/// The next slot in [`PORT_WINDOW`]; it starts at a slot taken from the process id, so that two
/// test processes on one harness seldom probe the same ports.
fn next_port_slot() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id() % 997,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Operator {
    /// Runs container `container` of `pod` from `image` under runc, as a kubelet would
    /// (e2e::container): the pod's command, args, env, security context, limits, volumes and
    /// the ServiceAccount token, in a network namespace of its own; fails unless its readiness
    /// probe passes within `ready_timeout`. Its endpoints are inside that namespace, so
    /// `metrics_port` and `health_port` are 0 (the probes report health instead).
    pub async fn start_in_container(
        admin: &Client,
        tools: &crate::container::Tools,
        image: &crate::container::Image,
        pod: &crate::container::PodContext,
        container: &str,
        ready_timeout: Duration,
    ) -> Result<Self> {
        let spec = pod
            .spec
            .containers
            .iter()
            .find(|c| c.name == container)
            .with_context(|| format!("pod {} has no container {container}", pod.name))?;
        let log =
            std::env::temp_dir().join(format!("{}-{}.log", pod.namespace, unique_name("op-runc")));
        let running =
            crate::container::RunningContainer::start(admin, tools, image, pod, spec, log.clone())
                .await?;
        let mut operator = Operator {
            child: None,
            container: Some(running),
            log,
            metrics_port: 0,
            health_port: 0,
        };
        if let Some(c) = operator.container.as_mut() {
            let report = c.await_ready(ready_timeout).await.with_context(|| {
                format!("operator container of pod {}/{}", pod.namespace, pod.name)
            });
            match report {
                Ok(report) => crate::container::report(&format!("{} ready: {report}", pod.name)),
                Err(e) => bail!("{e:#}\ncontainer log:\n{}", operator.log_text()),
            }
        }
        Ok(operator)
    }

    /// Starts `gpu-operator run` for `identity` with extra arguments.
    pub fn start(identity: &OperatorIdentity, extra: &[&str]) -> Result<Self> {
        let mut args = vec!["--namespace", identity.namespace.as_str()];
        args.extend_from_slice(extra);
        Self::spawn(identity, &args, &[])
    }

    /// Starts it as the chart's Deployment does: namespace and pod name from the environment
    /// (the downward API there), nothing on the command line.
    pub fn start_as_pod(identity: &OperatorIdentity, pod_name: &str) -> Result<Self> {
        Self::spawn(
            identity,
            &[],
            &[
                ("OPERATOR_NAMESPACE", identity.namespace.as_str()),
                ("POD_NAME", pod_name),
            ],
        )
    }

    /// Starts it as `container` of a pod named `pod_name` in the identity's namespace would
    /// run: its args and env, the downward-API variables (`metadata.namespace`, `metadata.name`)
    /// filled in. Only the metrics address changes: the pod binds every address of its own
    /// network namespace, a process here binds a free loopback port.
    pub fn start_as_container(
        identity: &OperatorIdentity,
        container: &k8s_openapi::api::core::v1::Container,
        pod_name: &str,
    ) -> Result<Self> {
        let args = container_args(container)?;
        let mut env: Vec<(String, String)> = Vec::new();
        for var in container.env.iter().flatten() {
            let value = match (&var.value, &var.value_from) {
                (Some(value), None) => value.clone(),
                (None, Some(from)) => {
                    match from.field_ref.as_ref().map(|f| f.field_path.as_str()) {
                        Some("metadata.namespace") => identity.namespace.clone(),
                        Some("metadata.name") => pod_name.to_owned(),
                        _ => anyhow::bail!(
                            "env {}: valueFrom {from:?} is not supported here",
                            var.name
                        ),
                    }
                }
                (None, None) => String::new(),
                (Some(_), Some(_)) => anyhow::bail!("env {}: value and valueFrom", var.name),
            };
            env.push((var.name.clone(), value));
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        Self::spawn(identity, &args, &env)
    }

    /// Runs the operator with `args`; `/metrics` is plain HTTP unless they say
    /// `--metrics-secure=true` (tests read it without credentials).
    fn spawn(identity: &OperatorIdentity, args: &[&str], env: &[(&str, &str)]) -> Result<Self> {
        let port = free_port()?;
        let health_port = free_port()?;
        let log =
            std::env::temp_dir().join(format!("{}-{}.log", identity.namespace, unique_name("op")));
        let mut command = Command::new(binary()?);
        command
            .arg("run")
            .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
            .args(["--health-addr", &format!("127.0.0.1:{health_port}")]);
        if !args.iter().any(|a| a.starts_with("--metrics-secure")) {
            command.arg("--metrics-secure=false");
        }
        command
            .args(args)
            .envs(env.iter().copied())
            .env("RUST_LOG", "info,gpu_operator=debug,kube=warn");
        let mut operator = Self::launch(command, identity, log, port)?;
        operator.health_port = health_port;
        Ok(operator)
    }

    /// Starts `command` (an operator, ours or another) with `identity`'s kubeconfig, stdout and
    /// stderr into `log`; `metrics_port` is where it serves metrics. The benchmark starts the
    /// operators it compares this way.
    pub fn launch(
        command: Command,
        identity: &OperatorIdentity,
        log: PathBuf,
        metrics_port: u16,
    ) -> Result<Self> {
        Self::launch_with_kubeconfig(command, &identity.kubeconfig, log, metrics_port)
    }

    /// [`Self::launch`] with the credentials of `kubeconfig` (one of several ServiceAccounts of
    /// an identity's namespace, say).
    pub fn launch_with_kubeconfig(
        mut command: Command,
        kubeconfig: &std::path::Path,
        log: PathBuf,
        metrics_port: u16,
    ) -> Result<Self> {
        let file = std::fs::File::create(&log)?;
        let child = command
            .env("KUBECONFIG", kubeconfig)
            .stdout(file.try_clone()?)
            .stderr(file)
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {:?}", command.get_program()))?;
        Ok(Operator {
            child: Some(child),
            container: None,
            log,
            metrics_port,
            health_port: metrics_port,
        })
    }

    /// The operator's process: the container's init process for a container.
    pub fn pid(&self) -> Option<u32> {
        match &self.container {
            Some(c) => Some(c.pid),
            None => self.child.as_ref().map(Child::id),
        }
    }

    /// Sends SIGTERM and waits for the process to exit; returns its exit code.
    pub fn terminate(&mut self, timeout: Duration) -> Result<Option<i32>> {
        if let Some(container) = self.container.as_mut() {
            return container.terminate(timeout);
        }
        if let Some(pid) = self.pid() {
            signal(pid, Signal::Term)?;
        }
        self.wait(timeout)
    }

    /// Sends SIGKILL and reaps the process (a container is deleted too).
    pub fn kill(&mut self) -> Result<()> {
        if let Some(container) = self.container.as_mut() {
            container.kill();
        }
        if let Some(mut child) = self.child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    fn wait(&mut self, timeout: Duration) -> Result<Option<i32>> {
        let Some(child) = self.child.as_mut() else {
            return Ok(None);
        };
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait()? {
                self.child = None;
                return Ok(status.code());
            }
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "operator did not exit within {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        if let Some(container) = self.container.as_mut() {
            return container.is_running();
        }
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The operator's log so far (for assertion messages).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the log has a line containing `text`.
    pub async fn await_log(&self, text: &str, timeout: Duration) -> Result<()> {
        crate::wait::until(
            timeout,
            &format!("operator log line {text:?}"),
            || async move {
                let now = self.log_text();
                Ok(if now.contains(text) {
                    Ok(())
                } else {
                    Err(now.lines().last().unwrap_or_default().to_owned())
                })
            },
        )
        .await
    }

    /// `gpu_operator_reconciles_total`: passes run so far (0 before the endpoint is up).
    pub async fn reconciles(&self) -> f64 {
        reconciles(self.metrics_port).await.unwrap_or(0.0)
    }
}

/// `gpu_operator_reconciles_total` from the /metrics endpoint on `port`, if it answers.
pub async fn reconciles(port: u16) -> Option<f64> {
    metric(
        &scrape_metrics(port).await?,
        "gpu_operator_reconciles_total",
    )
}

/// The /metrics text served on 127.0.0.1:`port` (plain HTTP/1.0, so no HTTP client needed).
pub async fn scrape_metrics(port: u16) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await
        .ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await.ok()?;
    Some(text)
}

/// The value of an unlabelled sample `name` in Prometheus text.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_come_from_the_harness_window_and_skip_ports_in_use() {
        let base: u16 = std::env::var("HARNESS_PORT_BASE")
            .map(|v| v.parse().unwrap())
            .unwrap_or(16400);
        let window = base + PORT_WINDOW.start..base + PORT_WINDOW.end;
        let held: Vec<_> = (0..2)
            .map(|_| std::net::TcpListener::bind(("127.0.0.1", free_port().unwrap())).unwrap())
            .collect();
        let held_ports: Vec<u16> = held
            .iter()
            .map(|l| l.local_addr().unwrap().port())
            .collect();
        // More than the window holds, so the allocation wraps past the held ports.
        for _ in 0..window.len() + 5 {
            let port = free_port().unwrap();
            assert!(window.contains(&port), "{port} outside {window:?}");
            assert!(!held_ports.contains(&port), "{port} is held by this test");
        }
    }

    #[test]
    fn a_metric_is_read_by_its_exact_name() {
        let text = "HTTP/1.0 200 OK\r\n\r\n# TYPE gpu_operator_reconciles_total counter\n\
                    gpu_operator_reconciles_total_failed 3\ngpu_operator_reconciles_total 12\n";
        assert_eq!(metric(text, "gpu_operator_reconciles_total"), Some(12.0));
        assert_eq!(metric(text, "gpu_operator_missing"), None);
    }

    #[test]
    fn container_args_keep_everything_after_run_but_the_metrics_address() {
        let container: k8s_openapi::api::core::v1::Container = serde_json::from_value(serde_json::json!({
            "name": "gpu-operator", "command": ["gpu-operator"],
            "args": ["run", "--metrics-addr=0.0.0.0:8080", "--leader-elect=true", "--metrics-addr", "0.0.0.0:1",
                "--health-addr=0.0.0.0:8081", "--metrics-secure=true", "--metrics-cert-path", "/tls", "--json-logs"],
        }))
        .unwrap();
        assert_eq!(
            container_args(&container).unwrap(),
            ["--leader-elect=true", "--json-logs"]
        );
        let other: k8s_openapi::api::core::v1::Container = serde_json::from_value(
            serde_json::json!({"name": "x", "command": ["sleep"], "args": ["1"]}),
        )
        .unwrap();
        assert!(container_args(&other).is_err());
    }
}

/// One request to authorise: `verb` on `resource` (`resource/subresource` allowed) of API
/// `group`, in `namespace` (None: cluster-wide), on the object `name` (None: any).
#[derive(Clone, Copy, Debug)]
pub struct Access<'a> {
    pub verb: &'a str,
    pub group: &'a str,
    pub resource: &'a str,
    pub namespace: Option<&'a str>,
    pub name: Option<&'a str>,
}

/// Whether the API server's authorizer lets ServiceAccount `service_account` of `namespace`
/// make `access` (a SubjectAccessReview, what RBAC decides for its token).
pub async fn may(
    admin: &Client,
    namespace: &str,
    service_account: &str,
    access: Access<'_>,
) -> Result<bool> {
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
    };
    let (resource, subresource) = match access.resource.split_once('/') {
        Some((resource, sub)) => (resource, Some(sub)),
        None => (access.resource, None),
    };
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(crate::audit::service_account_user(
                namespace,
                service_account,
            )),
            groups: Some(vec![
                "system:serviceaccounts".to_owned(),
                format!("system:serviceaccounts:{namespace}"),
                "system:authenticated".to_owned(),
            ]),
            resource_attributes: Some(ResourceAttributes {
                verb: Some(access.verb.to_owned()),
                group: Some(access.group.to_owned()),
                resource: Some(resource.to_owned()),
                subresource: subresource.map(str::to_owned),
                namespace: access.namespace.map(str::to_owned),
                name: access.name.map(str::to_owned),
                ..ResourceAttributes::default()
            }),
            ..SubjectAccessReviewSpec::default()
        },
        ..SubjectAccessReview::default()
    };
    let answer = Api::<SubjectAccessReview>::all(admin.clone())
        .create(&PostParams::default(), &review)
        .await
        .with_context(|| format!("reviewing {access:?}"))?;
    Ok(answer.status.is_some_and(|s| s.allowed))
}
