//! Faults of the control plane and of operator processes, for the resilience and chaos tests:
//! restarting the API server with the flags and ports `up.sh` gave it, stopping etcd for a
//! while, signals to an operator process, and a black hole for one identity's Lease updates.
//!
//! Restarts reuse the command line of the running process (read from `/proc/<pid>/cmdline`), so
//! ports, certificates, the audit log and etcd's data folder stay the same, and rewrite the
//! process's line in `$HARNESS_DIR/pids` so `down.sh` stops the new process.
//!
//! Public API:
//! - [`Harness::from_env`], [`restart_apiserver`], [`stop_apiserver_for`], [`stop_etcd_for`]
//! - [`sigstop`], [`sigcont`], [`sigkill`] of an [`Operator`]
//! - [`LeaseBlackHole::install`]: a validating webhook that never answers, so the Lease updates
//!   of one identity hang (until the API server's webhook timeout, then fail) while everything
//!   else it does goes through.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kube::Client;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::json;

use crate::operator::Operator;
use crate::procs::{HarnessProcess, recorded};

/// The running harness: its folder (pids, logs, PKI) and the API server's address.
#[derive(Clone, Debug)]
pub struct Harness {
    pub dir: PathBuf,
}

impl Harness {
    /// The harness of `HARNESS_DIR` (set by sourcing `$HARNESS_DIR/env`).
    pub fn from_env() -> Result<Self> {
        Ok(Harness {
            dir: crate::cluster::harness_dir()?,
        })
    }

    /// The process `up.sh` recorded as `name` (`etcd`, `kube-apiserver`, ...).
    pub fn process(&self, name: &str) -> Result<HarnessProcess> {
        recorded(&self.dir)?
            .into_iter()
            .find(|p| p.name == name)
            .with_context(|| format!("no {name} recorded in {}/pids", self.dir.display()))
    }

    /// Whether the API server answers `/readyz` with 200 (admin client certificate, via curl as
    /// up.sh checks it).
    pub fn apiserver_ready(&self) -> bool {
        let Ok(url) = self.apiserver_url() else {
            return false;
        };
        let pki = self.dir.join("pki");
        Command::new("curl")
            .arg("-sf")
            .arg("--max-time")
            .arg("2")
            .arg("--cacert")
            .arg(pki.join("ca.crt"))
            .arg("--cert")
            .arg(pki.join("admin.crt"))
            .arg("--key")
            .arg(pki.join("admin.key"))
            .arg(format!("{url}/readyz"))
            .output()
            .is_ok_and(|o| o.status.success())
    }

    /// `https://127.0.0.1:<port>` from the admin kubeconfig.
    fn apiserver_url(&self) -> Result<String> {
        let text = std::fs::read_to_string(self.dir.join("admin.kubeconfig"))?;
        let config: serde_json::Value = serde_yaml_ng::from_str(&text)?;
        config["clusters"][0]["cluster"]["server"]
            .as_str()
            .map(str::to_owned)
            .context("no server in admin.kubeconfig")
    }

    /// Waits until the API server is ready again; returns how long that took.
    pub async fn await_apiserver_ready(&self, timeout: Duration) -> Result<Duration> {
        let started = Instant::now();
        while !self.apiserver_ready() {
            if started.elapsed() > timeout {
                bail!("kube-apiserver not ready within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(started.elapsed())
    }
}

/// A harness process stopped by a fault, with what it takes to start it again.
struct Stopped {
    name: String,
    binary: String,
    args: Vec<String>,
    log: PathBuf,
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

/// Sends `signal` (`TERM`, `KILL`, `STOP`, `CONT`) to `pid` with kill(1).
fn signal(pid: u32, signal: &str) -> Result<()> {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .context("running kill")?;
    anyhow::ensure!(status.success(), "kill -{signal} {pid} failed");
    Ok(())
}

/// Stops harness process `name` (SIGTERM, SIGKILL after 10 s) and returns how to start it
/// again.
async fn stop(harness: &Harness, name: &str) -> Result<Stopped> {
    let process = harness.process(name)?;
    anyhow::ensure!(
        process.is_running(),
        "{name} (pid {}) is not running",
        process.pid
    );
    let args = cmdline_args(process.pid)?;
    signal(process.pid, "TERM")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while process.is_running() {
        if Instant::now() > deadline {
            signal(process.pid, "KILL")?;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(Stopped {
        name: name.to_owned(),
        binary: process.binary,
        args,
        log: harness.dir.join("logs").join(format!("{name}.log")),
    })
}

/// Starts a stopped process again, detached (as up.sh does: nohup in the background of a shell
/// that exits at once, so the test process never has to reap it), and records its new pid.
fn start_again(harness: &Harness, stopped: &Stopped) -> Result<u32> {
    let output = Command::new("sh")
        .arg("-c")
        .arg(r#"log=$1; shift; nohup "$@" >>"$log" 2>&1 </dev/null & echo $!"#)
        .arg("sh")
        .arg(&stopped.log)
        .arg(&stopped.binary)
        .args(&stopped.args)
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
    record_pid(&harness.dir, &stopped.name, pid)?;
    Ok(pid)
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
    std::fs::write(&path, rewritten.join("\n") + "\n")?;
    Ok(())
}

/// What a control-plane fault measured.
#[derive(Clone, Copy, Debug)]
pub struct Outage {
    /// From the stop signal until the API server answered `/readyz` again.
    pub unavailable: Duration,
}

/// Restarts kube-apiserver (SIGTERM, then the same command line) and waits until it is ready.
pub async fn restart_apiserver(harness: &Harness) -> Result<Outage> {
    stop_apiserver_for(harness, Duration::ZERO).await
}

/// Stops kube-apiserver, keeps it down for `down`, starts it again with the same flags and
/// waits until it is ready.
pub async fn stop_apiserver_for(harness: &Harness, down: Duration) -> Result<Outage> {
    let started = Instant::now();
    let stopped = stop(harness, "kube-apiserver").await?;
    tokio::time::sleep(down).await;
    start_again(harness, &stopped)?;
    harness
        .await_apiserver_ready(Duration::from_secs(180))
        .await?;
    Ok(Outage {
        unavailable: started.elapsed(),
    })
}

/// Stops etcd for `down` (the API server stays up and answers with errors meanwhile), starts it
/// again on the same data folder and waits until the API server is ready.
pub async fn stop_etcd_for(harness: &Harness, down: Duration) -> Result<Outage> {
    let started = Instant::now();
    let stopped = stop(harness, "etcd").await?;
    tokio::time::sleep(down).await;
    start_again(harness, &stopped)?;
    harness
        .await_apiserver_ready(Duration::from_secs(180))
        .await?;
    Ok(Outage {
        unavailable: started.elapsed(),
    })
}

fn operator_pid(operator: &Operator) -> Result<u32> {
    operator
        .pid()
        .context("the operator process has already been reaped")
}

/// Freezes the operator process (SIGSTOP): it holds its connections and timers but does
/// nothing, as a process on a stalled node or in a long GC pause.
pub fn sigstop(operator: &Operator) -> Result<()> {
    signal(operator_pid(operator)?, "STOP")
}

/// Lets a frozen operator process run again (SIGCONT).
pub fn sigcont(operator: &Operator) -> Result<()> {
    signal(operator_pid(operator)?, "CONT")
}

/// Kills the operator process (SIGKILL, no clean-up, no Lease release) and reaps it.
pub fn sigkill(operator: &mut Operator) -> Result<()> {
    operator.kill()
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
