//! Faults of the harness's control plane (IO), for the resilience tests and the chaos suite:
//! kube-apiserver stopped and started again (after a chosen time down), kwok restarted, etcd
//! frozen for a while, and a black hole for one identity's Lease updates. Signals to operator
//! processes are [`crate::procs::signal`] and [`crate::operator::Operator`]'s own methods.
//!
//! A restart reuses the command line of the running process (read from `/proc/<pid>/cmdline`),
//! so ports, certificates, the audit log and etcd's data folder stay the same, and rewrites the
//! process's line in `$HARNESS_DIR/pids` so `down.sh` stops the new process. The new process is
//! started as up.sh starts it (nohup, in the background of a shell that exits at once, so the
//! test never has to reap it) and in a process group of its own, so a Ctrl-C of the test does
//! not reach it.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Namespace;
use kube::Client;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::json;

use crate::procs::{self, HarnessProcess, Signal, signal};
use crate::wait;

/// How long the API server may take to come back (the machine is loaded).
const READY_TIMEOUT: Duration = Duration::from_secs(180);
/// How long a process gets after SIGTERM before SIGKILL, as a kubelet's grace period.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// The control plane of the running harness: its folder (pids, logs, PKI).
#[derive(Clone, Debug)]
pub struct ControlPlane {
    dir: PathBuf,
}

/// What a control-plane fault measured.
#[derive(Clone, Copy, Debug)]
pub struct Outage {
    /// From the stop signal until the API server was ready again.
    pub unavailable: Duration,
}

/// A harness process stopped by a fault, with what it takes to start it again.
struct Stopped {
    name: String,
    binary: String,
    args: Vec<String>,
}

impl ControlPlane {
    /// The harness of `HARNESS_DIR` (set by sourcing `$HARNESS_DIR/env`).
    pub fn from_env() -> Result<Self> {
        Ok(ControlPlane {
            dir: crate::cluster::harness_dir()?,
        })
    }

    /// The running process `up.sh` recorded as `name` (`etcd`, `kube-apiserver`, ...).
    pub fn process(&self, name: &str) -> Result<HarnessProcess> {
        let process = procs::recorded(&self.dir)?
            .into_iter()
            .find(|p| p.name == name)
            .with_context(|| format!("no {name} recorded in {}/pids", self.dir.display()))?;
        anyhow::ensure!(
            process.is_running(),
            "{name} (pid {}) is not running",
            process.pid
        );
        Ok(process)
    }

    /// Stops kube-apiserver (SIGTERM, SIGKILL after 10 s), keeps it down for `down` more,
    /// starts it again with the same flags and waits until it serves requests again
    /// ([`Self::await_apiserver`]). kwok is restarted after it (outside the measured outage):
    /// see [`Self::restart_kwok`].
    pub async fn restart_apiserver(&self, admin: &Client, down: Duration) -> Result<Outage> {
        let started = Instant::now();
        let stopped = self.stop("kube-apiserver").await?;
        tokio::time::sleep(down).await;
        self.start_again(&stopped)?;
        self.await_apiserver(admin).await?;
        let unavailable = started.elapsed();
        self.restart_kwok().await?;
        Ok(Outage { unavailable })
    }

    /// Restarts kwok (the fake kubelets). kwok v0.8 does not always re-establish its pod watch
    /// after an API server restart (pods stay unpatched for minutes), where real kubelets
    /// reconnect: every API server restart is followed by this one, so that what a test
    /// measures is the operator, and a later test in the same harness starts with working
    /// fake kubelets.
    async fn restart_kwok(&self) -> Result<()> {
        let stopped = self.stop("kwok").await?;
        self.start_again(&stopped)?;
        Ok(())
    }

    /// Freezes etcd for `duration` (SIGSTOP), then lets it go on (SIGCONT): the API server stays
    /// up and its requests wait, then fail. SIGCONT is sent whatever happens in between, so the
    /// harness never stays frozen.
    pub async fn pause_etcd_for(&self, duration: Duration) -> Result<()> {
        let etcd = self.process("etcd")?;
        signal(etcd.pid, Signal::Stop)?;
        tokio::time::sleep(duration).await;
        signal(etcd.pid, Signal::Cont)
    }

    /// Waits until the API server reports ready (`/readyz`, which includes its informers'
    /// sync: before it, RBAC denies every ServiceAccount), and answers a read.
    pub async fn await_apiserver(&self, admin: &Client) -> Result<()> {
        let api: Api<Namespace> = Api::all(admin.clone());
        wait::until(READY_TIMEOUT, "kube-apiserver ready again", || {
            let api = api.clone();
            async move {
                if let Err(e) = crate::cluster::kubectl_output(&["get", "--raw", "/readyz"]) {
                    return Ok(Err(e.to_string()));
                }
                Ok(
                    match tokio::time::timeout(Duration::from_secs(5), api.get("default")).await {
                        Ok(Ok(_)) => Ok(()),
                        Ok(Err(e)) => Err(e.to_string()),
                        Err(_) => Err("no answer within 5s".into()),
                    },
                )
            }
        })
        .await
    }

    /// Stops harness process `name` (SIGTERM, SIGKILL after [`STOP_GRACE`]) and returns how to
    /// start it again.
    async fn stop(&self, name: &str) -> Result<Stopped> {
        let process = self.process(name)?;
        let args = cmdline_args(process.pid)?;
        signal(process.pid, Signal::Term)?;
        if self.await_exit(&process, STOP_GRACE).await.is_err() {
            signal(process.pid, Signal::Kill)?;
            self.await_exit(&process, Duration::from_secs(30)).await?;
        }
        Ok(Stopped {
            name: name.to_owned(),
            binary: process.binary,
            args,
        })
    }

    async fn await_exit(&self, process: &HarnessProcess, timeout: Duration) -> Result<()> {
        wait::until(timeout, &format!("{} stopped", process.name), || {
            let running = process.is_running();
            async move {
                Ok(if running {
                    Err("running".into())
                } else {
                    Ok(())
                })
            }
        })
        .await
    }

    /// Starts a stopped process again, its output appended to its log, and records its new pid.
    fn start_again(&self, stopped: &Stopped) -> Result<u32> {
        let log = self.dir.join("logs").join(format!("{}.log", stopped.name));
        let output = Command::new("sh")
            .arg("-c")
            .arg(r#"log=$1; shift; nohup "$@" >>"$log" 2>&1 </dev/null & echo $!"#)
            .arg("sh")
            .arg(&log)
            .arg(&stopped.binary)
            .args(&stopped.args)
            .process_group(0)
            .output()
            .with_context(|| format!("starting {} again", stopped.name))?;
        anyhow::ensure!(
            output.status.success(),
            "starting {} again failed: {}",
            stopped.name,
            String::from_utf8_lossy(&output.stderr)
        );
        let pid: u32 = String::from_utf8_lossy(&output.stdout)
            .trim()
            .parse()
            .context("reading the new pid")?;
        record_pid(&self.dir, &stopped.name, pid)?;
        Ok(pid)
    }
}

/// The command line of a running pid, without the program itself.
fn cmdline_args(pid: u32) -> Result<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline"))
        .with_context(|| format!("reading the command line of pid {pid}"))?;
    let mut words: Vec<String> = raw
        .split(|b| *b == 0)
        .filter(|w| !w.is_empty())
        .map(|w| String::from_utf8_lossy(w).into_owned())
        .collect();
    anyhow::ensure!(!words.is_empty(), "pid {pid} has an empty command line");
    words.remove(0);
    Ok(words)
}

/// Rewrites `name`'s line in `<dir>/pids` with `pid` (same binary, same position, so down.sh
/// still stops processes in reverse start order).
fn record_pid(dir: &Path, name: &str, pid: u32) -> Result<()> {
    let path = dir.join("pids");
    let text = std::fs::read_to_string(&path)?;
    let rewritten: Vec<String> = text
        .lines()
        .map(|line| {
            let mut parts = line.split_whitespace();
            match (parts.next(), parts.next(), parts.next()) {
                (Some(n), Some(_), Some(binary)) if n == name => format!("{n} {pid} {binary}"),
                _ => line.to_owned(),
            }
        })
        .collect();
    std::fs::write(&path, rewritten.join("\n") + "\n")
        .with_context(|| format!("writing {}", path.display()))
}

fn webhook_configs(client: &Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk(
        "admissionregistration.k8s.io",
        "v1",
        "ValidatingWebhookConfiguration",
    );
    Api::all_with(client.clone(), &ApiResource::from_gvk(&gvk))
}

/// Lease updates of one identity that never get an answer: a validating webhook for `update`
/// of Leases in one namespace, matched to that username only, whose endpoint accepts TCP
/// connections and never answers the TLS handshake. The API server waits for the webhook's
/// timeout and then fails the request (failurePolicy Fail), so the update is never applied and
/// the client sees a hang. Other requests of the identity, and other identities' Lease updates,
/// go through. [`LeaseBlackHole::remove`] takes it away.
pub struct LeaseBlackHole {
    client: Client,
    name: String,
    listener: tokio::task::JoinHandle<()>,
}

impl LeaseBlackHole {
    /// Black-holes Lease updates by `username` in `namespace`, each held for `hold` (1 to 30 s,
    /// the API server's webhook timeout range).
    pub async fn install(
        admin: &Client,
        namespace: &str,
        username: &str,
        hold: Duration,
    ) -> Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        // Accept and keep every connection open without a byte in reply.
        let listener = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                held.push(stream);
            }
        });
        let name = crate::cluster::unique_name("lease-black-hole");
        let username = username.replace('"', "");
        let config = json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [{
                "name": "lease-black-hole.e2e.gpu-operator.test",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Fail",
                "timeoutSeconds": hold.as_secs().clamp(1, 30),
                // No caBundle: the handshake never completes, so no certificate is ever checked.
                "clientConfig": {"url": format!("https://127.0.0.1:{port}/")},
                "rules": [{
                    "apiGroups": ["coordination.k8s.io"], "apiVersions": ["v1"],
                    "operations": ["UPDATE"], "resources": ["leases"], "scope": "Namespaced"
                }],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "matchConditions": [{
                    "name": "only-this-identity",
                    "expression": format!("request.userInfo.username == \"{username}\"")
                }]
            }]
        });
        let object: DynamicObject = serde_json::from_value(config)?;
        webhook_configs(admin)
            .patch(
                &name,
                &PatchParams::apply("e2e-faults").force(),
                &Patch::Apply(&object),
            )
            .await
            .context("creating the black-hole webhook")?;
        Ok(LeaseBlackHole {
            client: admin.clone(),
            name,
            listener,
        })
    }

    /// Removes the webhook; Lease updates go through again.
    pub async fn remove(self) -> Result<()> {
        webhook_configs(&self.client)
            .delete(&self.name, &DeleteParams::default())
            .await?;
        self.listener.abort();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restarted_process_keeps_its_place_in_the_pids_file() {
        let dir = std::env::temp_dir().join(crate::cluster::unique_name("faults-pids"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("pids"),
            "etcd 10 /bin/etcd\nkube-apiserver 11 /bin/kube-apiserver\nkwok 12 /bin/kwok\n",
        )
        .unwrap();
        record_pid(&dir, "kube-apiserver", 99).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join("pids")).unwrap(),
            "etcd 10 /bin/etcd\nkube-apiserver 99 /bin/kube-apiserver\nkwok 12 /bin/kwok\n"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
