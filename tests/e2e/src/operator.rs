//! Running the real `gpu-operator` binary against the harness, as its own identity: a
//! ServiceAccount in a fresh namespace whose token is the operator's only credential, so the
//! audit log attributes its requests and RBAC applies to it as in a cluster.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, RoleRef, Subject};
use kube::Client;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};

use crate::cluster::{service_account_token, unique_name};

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

/// A namespace for the operator with a ServiceAccount bound to `cluster_role`.
pub struct OperatorIdentity {
    pub namespace: String,
    pub service_account: String,
    pub kubeconfig: PathBuf,
    client: Client,
}

impl OperatorIdentity {
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
        let token = service_account_token(admin, &namespace, sa).await?;
        let kubeconfig = write_token_kubeconfig(&namespace, &token)?;
        Ok(OperatorIdentity {
            namespace,
            service_account: sa.to_string(),
            kubeconfig,
            client: admin.clone(),
        })
    }

    /// The audit username of the operator.
    pub fn username(&self) -> String {
        crate::audit::service_account_user(&self.namespace, &self.service_account)
    }

    pub async fn delete(self) -> Result<()> {
        Api::<ClusterRoleBinding>::all(self.client.clone())
            .delete(&self.namespace, &DeleteParams::default())
            .await?;
        Api::<Namespace>::all(self.client.clone())
            .delete(&self.namespace, &DeleteParams::default())
            .await?;
        let _ = std::fs::remove_file(&self.kubeconfig);
        Ok(())
    }
}

/// A kubeconfig with the harness server and CA but authenticating with `token` only.
fn write_token_kubeconfig(name: &str, token: &str) -> Result<PathBuf> {
    let admin = std::env::var("KUBECONFIG").context("KUBECONFIG is not set")?;
    let text = std::fs::read_to_string(&admin)?;
    let mut config: serde_json::Value = serde_yaml_ng::from_str(&text)?;
    config["users"] = serde_json::json!([{"name": "operator", "user": {"token": token}}]);
    config["contexts"] = serde_json::json!([{"name": "harness", "context": {"cluster": "harness", "user": "operator"}}]);
    let path = std::env::temp_dir().join(format!("{name}.kubeconfig"));
    std::fs::write(&path, serde_yaml_ng::to_string(&config)?)?;
    Ok(path)
}

/// A running operator process; killed when dropped.
pub struct Operator {
    child: Option<Child>,
    pub log: PathBuf,
    pub metrics_port: u16,
}

/// A free loopback port for the operator's endpoints.
fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

impl Operator {
    /// Starts `gpu-operator run` for `identity` with extra arguments.
    pub fn start(identity: &OperatorIdentity, extra: &[&str]) -> Result<Self> {
        let port = free_port()?;
        let log =
            std::env::temp_dir().join(format!("{}-{}.log", identity.namespace, unique_name("op")));
        let file = std::fs::File::create(&log)?;
        let child = Command::new(binary()?)
            .arg("run")
            .args(["--namespace", &identity.namespace])
            .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
            .args(extra)
            .env("KUBECONFIG", &identity.kubeconfig)
            .env("RUST_LOG", "info,gpu_operator=debug,kube=warn")
            .stdout(file.try_clone()?)
            .stderr(file)
            .stdin(Stdio::null())
            .spawn()
            .context("starting gpu-operator")?;
        Ok(Operator {
            child: Some(child),
            log,
            metrics_port: port,
        })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends SIGTERM and waits for the process to exit; returns its exit code.
    pub fn terminate(&mut self, timeout: Duration) -> Result<Option<i32>> {
        self.signal("-TERM")?;
        self.wait(timeout)
    }

    /// Sends SIGKILL and reaps the process.
    pub fn kill(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    fn signal(&self, signal: &str) -> Result<()> {
        if let Some(pid) = self.pid() {
            let status = Command::new("kill")
                .args([signal, &pid.to_string()])
                .status()?;
            anyhow::ensure!(status.success(), "kill {signal} {pid} failed");
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
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The operator's log so far (for assertion messages).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}
