//! `run-pod`: runs a Deployment's container from its OCI image under runc, as a kubelet would
//! (e2e::container), until SIGTERM or SIGINT, then stops it as the kubelet does (SIGTERM to the
//! container). For scripts (`make demo`); the tests use the library directly.
//!
//!   run-pod --namespace NS --deployment NAME [--container NAME]
//!           (--image-archive FILE.oci.tar | --image REF --oras PATH)
//!
//! Needs the harness environment (`source $HARNESS_DIR/env`) and root. Prints the probes'
//! report when the container is ready and when readiness changes, with its cgroup's memory.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use e2e::container::{self, Image, ImageSource, PodContext, RunningContainer, Tools};

struct Options {
    namespace: String,
    deployment: String,
    container: String,
    source: ImageSource,
}

fn parse(mut args: impl Iterator<Item = String>) -> Result<Options> {
    let (mut namespace, mut deployment, mut name) = (None, None, "gpu-operator".to_owned());
    let (mut archive, mut reference, mut oras) = (None, None, None);
    while let Some(arg) = args.next() {
        let mut value = || args.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--namespace" => namespace = Some(value()?),
            "--deployment" => deployment = Some(value()?),
            "--container" => name = value()?,
            "--image-archive" => archive = Some(PathBuf::from(value()?)),
            "--image" => reference = Some(value()?),
            "--oras" => oras = Some(PathBuf::from(value()?)),
            other => bail!("unknown argument {other}"),
        }
    }
    let source = match (archive, reference, oras) {
        (Some(a), None, _) => ImageSource::Archive(a),
        (None, Some(reference), Some(oras)) => ImageSource::Registry { reference, oras },
        _ => bail!("give --image-archive FILE, or --image REF with --oras PATH"),
    };
    Ok(Options {
        namespace: namespace.context("--namespace is required")?,
        deployment: deployment.context("--deployment is required")?,
        container: name,
        source,
    })
}

#[tokio::main]
async fn main() -> Result<()> {
    let o = parse(std::env::args().skip(1))?;
    let admin = e2e::client().await?;
    let tools = Tools::find()?;
    let dir = e2e::cluster::harness_dir()?.join(e2e::cluster::unique_name("run-pod-image"));
    let image = Image::pull(&o.source, &dir)?;
    println!("run-pod: image {} ({:?})", image.digest, o.source);
    let pod = container::deployment_pod(
        &admin,
        &o.namespace,
        &o.deployment,
        Duration::from_secs(180),
    )
    .await?;
    let pod = PodContext::live(&pod)?;
    let spec = pod
        .spec
        .containers
        .iter()
        .find(|c| c.name == o.container)
        .with_context(|| format!("pod {} has no container {}", pod.name, o.container))?
        .clone();
    let log = e2e::cluster::harness_dir()?.join(format!("{}.log", pod.name));
    let mut running = RunningContainer::start(&admin, &tools, &image, &pod, &spec, log).await?;
    println!(
        "run-pod: pod {}/{} container {} runs as pid {}, log {}; limits {:?}",
        pod.namespace,
        pod.name,
        o.container,
        running.pid,
        running.log.display(),
        running.limits
    );
    let result = watch(&mut running).await;
    let code = running.terminate(Duration::from_secs(30));
    println!("run-pod: container stopped: {code:?}");
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Reports readiness changes until a signal comes or the container exits.
async fn watch(running: &mut RunningContainer) -> Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut ready = None;
    loop {
        tokio::select! {
            _ = term.recv() => return Ok(()),
            _ = tokio::signal::ctrl_c() => return Ok(()),
            () = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        if !running.is_running() {
            bail!("the container exited:\n{}", running.log_text());
        }
        let report = running.probe_report();
        if ready != Some(report.ready) {
            ready = Some(report.ready);
            let memory = running
                .cgroup_stats()
                .ok()
                .and_then(|s| s.memory_usage_bytes)
                .map_or_else(
                    || "-".to_owned(),
                    |b| format!("{:.1} MiB", b as f64 / 1048576.0),
                );
            println!("run-pod: probes: {report}; cgroup memory {memory}");
        }
        if let Some(r) = &report.restart_due {
            bail!("{r}: a kubelet would restart the container");
        }
    }
}
