//! Two operator replicas with leader election, as the chart's Deployment would run them when
//! scaled to two (IO): one namespace, the generated ClusterRole (`gpu-operator rbac`), and one
//! ServiceAccount per replica bound to it, so the audit log tells their writes apart. A replica
//! that exits is started again by [`Replicas::supervise`], as the kubelet would restart it.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, RoleRef, Subject};
use kube::Client;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};

use crate::audit::service_account_user;
use crate::cluster::{service_account_token_valid_for, unique_name};
use crate::operator::{self, Operator, OperatorIdentity, write_token_kubeconfig};
use crate::procs::{Signal, signal};

/// The Lease the replicas elect their leader with (the operator's default name).
pub const LEASE: &str = "gpu-operator-leader";
/// The replicas' ServiceAccounts beside the identity's own `gpu-operator`.
const SECOND_SERVICE_ACCOUNT: &str = "gpu-operator-b";
/// Tokens outlive the longest run.
const TOKEN_SECONDS: i64 = 12 * 3600;

/// How the replicas run.
#[derive(Clone, Debug)]
pub struct ReplicaSettings {
    pub lease_seconds: u64,
    pub gpu_label_grace_seconds: u64,
}

/// One replica: its ServiceAccount, its kubeconfig, the process now running (if any) and how
/// often it was started.
pub struct Slot {
    pub name: String,
    /// Identity in the Lease of the process now running: the slot's name and how often it was
    /// started, as a Deployment's new pod has a new name.
    pub identity: String,
    pub service_account: String,
    kubeconfig: PathBuf,
    pub operator: Option<Operator>,
    /// Exits the driver did not cause (after SIGKILL the driver restarts it itself).
    pub unexpected_exits: u32,
    pub starts: u32,
}

pub struct Replicas {
    admin: Client,
    pub identity: OperatorIdentity,
    pub slots: [Slot; 2],
    settings: ReplicaSettings,
}

impl Replicas {
    /// The namespace, role, ServiceAccounts and bindings; no process runs yet.
    pub async fn create(admin: &Client, settings: ReplicaSettings) -> Result<Self> {
        let identity = OperatorIdentity::with_generated_role(admin).await?;
        let namespace = identity.namespace.clone();
        Api::<ServiceAccount>::namespaced(admin.clone(), &namespace)
            .create(
                &PostParams::default(),
                &ServiceAccount {
                    metadata: ObjectMeta {
                        name: Some(SECOND_SERVICE_ACCOUNT.into()),
                        ..ObjectMeta::default()
                    },
                    ..ServiceAccount::default()
                },
            )
            .await?;
        let role = Api::<ClusterRoleBinding>::all(admin.clone())
            .get(&namespace)
            .await?
            .role_ref
            .name;
        Api::<ClusterRoleBinding>::all(admin.clone())
            .create(
                &PostParams::default(),
                &ClusterRoleBinding {
                    metadata: ObjectMeta {
                        name: Some(second_binding(&namespace)),
                        ..ObjectMeta::default()
                    },
                    role_ref: RoleRef {
                        api_group: Some("rbac.authorization.k8s.io".into()),
                        kind: "ClusterRole".into(),
                        name: role,
                    },
                    subjects: Some(vec![Subject {
                        kind: "ServiceAccount".into(),
                        name: SECOND_SERVICE_ACCOUNT.into(),
                        namespace: Some(namespace.clone()),
                        ..Subject::default()
                    }]),
                },
            )
            .await?;
        operator::bind_generated_role(admin, &namespace, SECOND_SERVICE_ACCOUNT).await?;
        let mut slots = Vec::new();
        for (name, sa) in [
            ("replica-a", identity.service_account.clone()),
            ("replica-b", SECOND_SERVICE_ACCOUNT.to_owned()),
        ] {
            let token =
                service_account_token_valid_for(admin, &namespace, &sa, TOKEN_SECONDS).await?;
            let kubeconfig = write_token_kubeconfig(&format!("{namespace}-{sa}-chaos"), &token)?;
            slots.push(Slot {
                name: name.to_owned(),
                identity: String::new(),
                service_account: sa,
                kubeconfig,
                operator: None,
                unexpected_exits: 0,
                starts: 0,
            });
        }
        let [a, b]: [Slot; 2] = slots
            .try_into()
            .map_err(|_| anyhow::anyhow!("two slots expected"))?;
        Ok(Replicas {
            admin: admin.clone(),
            identity,
            slots: [a, b],
            settings,
        })
    }

    pub fn namespace(&self) -> &str {
        &self.identity.namespace
    }

    /// The audit usernames of the two replicas.
    pub fn usernames(&self) -> Vec<String> {
        self.slots
            .iter()
            .map(|s| service_account_user(self.namespace(), &s.service_account))
            .collect()
    }

    /// Starts replica `index` (a new process).
    pub fn start(&mut self, index: usize) -> Result<()> {
        let namespace = self.identity.namespace.clone();
        let settings = self.settings.clone();
        let slot = &mut self.slots[index];
        let port = operator::free_port()?;
        slot.identity = format!("{}-{}", slot.name, slot.starts + 1);
        let log = std::env::temp_dir().join(format!(
            "{namespace}-{}-{}.log",
            slot.name,
            unique_name("op")
        ));
        let mut command = Command::new(operator::binary()?);
        command
            .arg("run")
            .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
            .args(operator::PLAIN_ENDPOINTS)
            .args(["--namespace", &namespace])
            .args(["--identity", &slot.identity])
            .args([
                "--lease-duration-seconds",
                &settings.lease_seconds.to_string(),
            ])
            .args([
                "--gpu-label-grace-seconds",
                &settings.gpu_label_grace_seconds.to_string(),
            ])
            .env("RUST_LOG", "info,gpu_operator=debug,kube=warn")
            .env("NO_COLOR", "1")
            .env_remove("RUST_BACKTRACE");
        slot.operator = Some(Operator::launch_with_kubeconfig(
            command,
            &slot.kubeconfig,
            log,
            port,
        )?);
        slot.starts += 1;
        Ok(())
    }

    pub fn start_all(&mut self) -> Result<()> {
        self.start(0)?;
        self.start(1)
    }

    /// The index of the replica that holds the Lease now, from its holder identity.
    pub async fn leader(&self) -> Result<Option<usize>> {
        let api: Api<Lease> = Api::namespaced(self.admin.clone(), self.namespace());
        let Some(lease) = api.get_opt(LEASE).await? else {
            return Ok(None);
        };
        let holder = lease
            .spec
            .and_then(|s| s.holder_identity)
            .unwrap_or_default();
        Ok(self.slots.iter().position(|s| s.identity == holder))
    }

    /// The index of the replica that holds the Lease, runs, and renewed it within the lease
    /// duration: a leader that is operating.
    pub async fn live_leader(&mut self) -> Result<Option<usize>> {
        let api: Api<Lease> = Api::namespaced(self.admin.clone(), self.namespace());
        let Some(spec) = api.get_opt(LEASE).await?.and_then(|l| l.spec) else {
            return Ok(None);
        };
        let holder = spec.holder_identity.unwrap_or_default();
        let Some(index) = self.slots.iter().position(|s| s.identity == holder) else {
            return Ok(None);
        };
        let fresh = spec.renew_time.is_some_and(|t| {
            let age = k8s_openapi::jiff::Timestamp::now().as_second() - t.0.as_second();
            age <= self.settings.lease_seconds as i64
        });
        let running = self.slots[index]
            .operator
            .as_mut()
            .is_some_and(Operator::is_running);
        Ok((fresh && running).then_some(index))
    }

    /// Waits until a replica holds the Lease, returning its index.
    pub async fn await_leader(&self, timeout: Duration) -> Result<usize> {
        crate::wait::until(timeout, "a replica holds the Lease", || async {
            Ok(match self.leader().await {
                Ok(Some(i)) => Ok(i),
                Ok(None) => Err("no holder".into()),
                Err(e) => Err(e.to_string()),
            })
        })
        .await
    }

    /// SIGKILL of replica `index`, then a fresh process in its place (as a Deployment would).
    pub fn kill_and_restart(&mut self, index: usize) -> Result<()> {
        if let Some(mut op) = self.slots[index].operator.take() {
            op.kill()?;
        }
        self.start(index)
    }

    /// SIGSTOP of replica `index` for `duration`, then SIGCONT (sent whatever happens between).
    pub async fn pause(&self, index: usize, duration: Duration) -> Result<()> {
        let pid = self.slots[index]
            .operator
            .as_ref()
            .and_then(Operator::pid)
            .with_context(|| format!("{} runs no process", self.slots[index].name))?;
        signal(pid, Signal::Stop)?;
        tokio::time::sleep(duration).await;
        signal(pid, Signal::Cont)
    }

    /// Waits up to `timeout` for replica `index`'s process to exit; whether it did.
    pub async fn await_exit(&mut self, index: usize, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let running = self.slots[index]
                .operator
                .as_mut()
                .is_some_and(Operator::is_running);
            if !running {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Starts every replica whose process has exited, counting the exit; returns the names and
    /// last log lines of those that had exited.
    pub fn supervise(&mut self) -> Result<Vec<String>> {
        let mut exited = Vec::new();
        for index in 0..self.slots.len() {
            let slot = &mut self.slots[index];
            let running = slot.operator.as_mut().is_some_and(Operator::is_running);
            if !running {
                let tail = slot
                    .operator
                    .as_ref()
                    .map(|op| last_lines(&op.log_text(), 3))
                    .unwrap_or_default();
                slot.unexpected_exits += 1;
                exited.push(format!("{} exited: {tail}", slot.name));
                self.start(index)?;
            }
        }
        Ok(exited)
    }

    /// The last lines of both replicas' logs, for failure messages.
    pub fn log_tails(&self, lines: usize) -> String {
        self.slots
            .iter()
            .map(|s| {
                let text = s
                    .operator
                    .as_ref()
                    .map(Operator::log_text)
                    .unwrap_or_default();
                format!(
                    "--- {} ({}):\n{}",
                    s.name,
                    s.service_account,
                    last_lines(&text, lines)
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Stops both replicas and removes the namespace, role and bindings.
    pub async fn delete(mut self) -> Result<()> {
        for slot in &mut self.slots {
            if let Some(mut op) = slot.operator.take() {
                op.kill()?;
            }
            let _ = std::fs::remove_file(&slot.kubeconfig);
        }
        let binding = second_binding(self.namespace());
        Api::<ClusterRoleBinding>::all(self.admin.clone())
            .delete(&binding, &DeleteParams::default())
            .await?;
        self.identity.delete().await
    }
}

fn second_binding(namespace: &str) -> String {
    format!("{namespace}-{SECOND_SERVICE_ACCOUNT}")
}

/// The last `n` lines of `text`, without terminal colour codes.
fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    strip_ansi(&lines[lines.len().saturating_sub(n)..].join("\n"))
}

fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI sequences end with a letter.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn log_tails_lose_colour_codes() {
        let text = "a\n\u{1b}[2m2026\u{1b}[0m \u{1b}[31mERROR\u{1b}[0m lost\nb";
        assert_eq!(super::last_lines(text, 2), "2026 ERROR lost\nb");
    }
}
