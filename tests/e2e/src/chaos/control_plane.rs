//! Faults of the harness's own control plane (IO): restarting kube-apiserver (and kwok) with the
//! exact command line `up.sh` gave it, and stopping etcd for a while (SIGSTOP, then SIGCONT).
//!
//! A restarted process replaces its line in `$HARNESS_DIR/pids`, so `down.sh` stops the new
//! process. It runs in a process group of its own: a Ctrl-C of the test does not reach it.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Namespace;
use kube::Client;
use kube::api::Api;

use crate::cluster::harness_dir;
use crate::procs::{self, HarnessProcess};
use crate::wait;

/// How long the API server may take to come back (the machine is loaded).
const READY_TIMEOUT: Duration = Duration::from_secs(180);

pub struct ControlPlane {
    dir: PathBuf,
}

/// Sends `signal` (e.g. `-STOP`) to `pid` with kill(1).
pub fn signal(pid: u32, signal: &str) -> Result<()> {
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .context("running kill")?;
    anyhow::ensure!(status.success(), "kill {signal} {pid} failed");
    Ok(())
}

impl ControlPlane {
    /// The harness of `HARNESS_DIR`.
    pub fn from_env() -> Result<Self> {
        Ok(ControlPlane {
            dir: harness_dir()?,
        })
    }

    fn process(&self, name: &str) -> Result<HarnessProcess> {
        let process = procs::recorded(&self.dir)?
            .into_iter()
            .find(|p| p.name == name)
            .with_context(|| format!("{name} is not recorded in {}", self.dir.display()))?;
        anyhow::ensure!(
            process.is_running(),
            "{name} (pid {}) is not running",
            process.pid
        );
        Ok(process)
    }

    /// Stops kube-apiserver (SIGTERM, SIGKILL after 10 s), leaves it down for `down_for`, starts
    /// it again with the same arguments and waits until it serves requests again.
    pub async fn restart_apiserver(&self, admin: &Client, down_for: Duration) -> Result<()> {
        self.restart("kube-apiserver", down_for).await?;
        self.await_apiserver(admin).await
    }

    /// Restarts kwok (the fake kubelets). kwok v0.8 does not always re-establish its pod watch
    /// after an API server restart (pods stay unpatched for minutes), where real kubelets
    /// reconnect: the harness restarts it so that what is measured is the operator.
    pub async fn restart_kwok(&self) -> Result<()> {
        self.restart("kwok", Duration::ZERO).await
    }

    /// Stops process `name` of the harness (SIGTERM, SIGKILL after 10 s, as a kubelet's grace
    /// period would), waits `down_for`, and
    /// starts it again with the same arguments, its output appended to its log.
    async fn restart(&self, name: &str, down_for: Duration) -> Result<()> {
        let old = self.process(name)?;
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", old.pid))
            .with_context(|| format!("reading the command line of pid {}", old.pid))?;
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .skip(1)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        signal(old.pid, "-TERM")?;
        let stopped = wait::until(Duration::from_secs(10), &format!("{name} stopped"), || {
            let running = old.is_running();
            async move {
                Ok(if running {
                    Err("running".into())
                } else {
                    Ok(())
                })
            }
        })
        .await;
        if stopped.is_err() {
            signal(old.pid, "-KILL")?;
            wait::until(Duration::from_secs(30), &format!("{name} killed"), || {
                let running = old.is_running();
                async move {
                    Ok(if running {
                        Err("running".into())
                    } else {
                        Ok(())
                    })
                }
            })
            .await?;
        }
        tokio::time::sleep(down_for).await;
        let log = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(self.dir.join(format!("logs/{name}.log")))?;
        let child = Command::new(&old.binary)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {}", old.binary))?;
        self.replace_pid(&old, child.id())
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

    /// Freezes etcd for `duration` (SIGSTOP), then lets it go on (SIGCONT). SIGCONT is sent
    /// whatever happens in between, so the harness never stays frozen.
    pub async fn stop_etcd(&self, duration: Duration) -> Result<()> {
        let etcd = self.process("etcd")?;
        signal(etcd.pid, "-STOP")?;
        tokio::time::sleep(duration).await;
        signal(etcd.pid, "-CONT")
    }

    /// Rewrites the `pids` line of `old` with `pid`.
    fn replace_pid(&self, old: &HarnessProcess, pid: u32) -> Result<()> {
        let path = self.dir.join("pids");
        let text = std::fs::read_to_string(&path)?;
        let replaced: String = text
            .lines()
            .map(|line| {
                let mut parts = line.split_whitespace();
                let entry = (
                    parts.next(),
                    parts.next().and_then(|p| p.parse::<u32>().ok()),
                );
                if entry == (Some(old.name.as_str()), Some(old.pid)) {
                    format!("{} {pid} {}\n", old.name, old.binary)
                } else {
                    format!("{line}\n")
                }
            })
            .collect();
        std::fs::write(&path, replaced).with_context(|| format!("writing {}", path.display()))
    }
}
