//! Running a pod's container from its OCI image under runc, as a kubelet with containerd would
//! (IO; the translation from pod to OCI runtime config, [`plan`], is pure). kwok's nodes run no
//! containers, so this is where the operator image a user deploys actually runs.
//!
//! What is honoured, and how:
//! - the image: pulled from a registry with oras (or read from an OCI archive), every blob's
//!   digest checked, its layers unpacked into the container's own root file system; its
//!   `Entrypoint`, `Cmd`, `Env`, `User` and `WorkingDir` as the CRI applies them (`command`
//!   replaces the entrypoint, `args` the cmd, `$(VAR)` expanded);
//! - env: the image's, `KUBERNETES_SERVICE_*` pointing at the harness API server, `HOSTNAME`,
//!   then the container's, `valueFrom.fieldRef` resolved against the pod;
//! - security context: runAsUser/runAsGroup (else the image's user, its group from the image's
//!   /etc/passwd), runAsNonRoot checked with the kubelet's own refusals, supplemental groups
//!   and fsGroup, readOnlyRootFilesystem, capabilities from containerd's default set with
//!   drop/add, allowPrivilegeEscalation=false as no_new_privs, seccomp RuntimeDefault as
//!   containerd's default profile (`seccomp-default`, built from containerd's module), Unconfined
//!   as none; privileged containers and Localhost profiles are refused;
//! - limits: memory and CPU as cgroup limits (quota/period, shares from the request), the
//!   oom_score_adj of the pod's QoS class; after the start the limits are read back from the
//!   container's cgroup and the start fails, naming the file, if one is not in force;
//! - volumes: the service-account token (a TokenRequest for the pod's ServiceAccount, bound to
//!   the pod when it exists, as the kubelet asks for it), `ca.crt` and `namespace` at
//!   /var/run/secrets/kubernetes.io/serviceaccount (added as the ServiceAccount admission
//!   plugin adds them where the pod was only rendered), ConfigMap, Secret, emptyDir and
//!   projected volumes; /etc/hosts, /etc/hostname, /etc/resolv.conf, /dev/termination-log;
//! - network: the pod's own network namespace, with only loopback, made by netns-run, which
//!   forwards the API server's 127.0.0.1 port into it (the pod's endpoints bind every address
//!   there, seen by nobody outside); host-network pods are refused;
//! - probes: httpGet liveness, readiness and startup probes on the ports the container names,
//!   polled inside the pod's network namespace at their periods and thresholds, and reported.
//!
//! What it cannot show: no kubelet admission (eviction, node resources, device plugins), no
//! image pull secrets or pull policy, no restart on a failed liveness probe (reported instead),
//! no service links in the environment, no cluster DNS.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, HTTPGetAction, Pod, PodSpec, Probe, Secret, ServiceAccount, Volume,
    VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Client;
use kube::api::{Api, PostParams};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::cluster::unique_name;

/// Where a container finds its service-account token, CA and namespace.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// containerd's default capabilities (its `oci.defaultUnixCaps`), what a container starts with
/// before its securityContext drops or adds any.
const DEFAULT_CAPS: [&str; 14] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];
/// Every capability `add: [ALL]` grants (Linux 6.x).
const ALL_CAPS: [&str; 41] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
];
/// The CFS period the kubelet uses for CPU limits (100 ms).
const CPU_PERIOD_US: u64 = 100_000;

// ---------------------------------------------------------------------------------------------
// The image

/// Where the image comes from.
#[derive(Clone, Debug)]
pub enum ImageSource {
    /// A reference in a registry served over plain HTTP (the harness's), copied with oras.
    Registry { reference: String, oras: PathBuf },
    /// An OCI archive (a tar of an OCI image layout: `make image`).
    Archive(PathBuf),
}

/// The fields of an image's config that a runtime reads (OCI image spec, `config`).
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(rename_all = "PascalCase")]
pub struct ImageConfig {
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub entrypoint: Option<Vec<String>>,
    #[serde(default)]
    pub cmd: Option<Vec<String>>,
    #[serde(default)]
    pub env: Option<Vec<String>>,
    #[serde(default)]
    pub working_dir: Option<String>,
}

/// A pulled image: an OCI image layout on disk and what its manifest and config say.
#[derive(Clone, Debug)]
pub struct Image {
    /// The OCI image layout folder.
    pub layout: PathBuf,
    /// The manifest's digest (`sha256:...`).
    pub digest: String,
    pub config: ImageConfig,
    /// Layer blobs in order, with their media types.
    layers: Vec<(PathBuf, String)>,
}

/// Runs a command, failing with its output; its stdout.
fn run(command: &mut Command) -> Result<String> {
    let out = command
        .output()
        .with_context(|| format!("running {command:?}"))?;
    ensure!(
        out.status.success(),
        "{command:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The blob file of `digest` in an OCI layout, its content checked against the digest.
fn blob(layout: &Path, digest: &str) -> Result<PathBuf> {
    let hex = digest
        .strip_prefix("sha256:")
        .with_context(|| format!("digest {digest} is not sha256"))?;
    let path = layout.join("blobs/sha256").join(hex);
    let sum = run(Command::new("sha256sum").arg(&path))?;
    ensure!(
        sum.split_whitespace().next() == Some(hex),
        "blob {} does not match its digest {digest}",
        path.display()
    );
    Ok(path)
}

impl Image {
    /// Fetches the image into `dir` (created) as an OCI image layout and reads its manifest
    /// and config: the manifest for this machine's platform when the reference is an index.
    pub fn pull(source: &ImageSource, dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let layout = dir.join("layout");
        match source {
            ImageSource::Registry { reference, oras } => {
                run(Command::new(oras)
                    .args(["copy", "--from-plain-http", "--to-oci-layout", reference])
                    .arg(format!("{}:pulled", layout.display())))
                .with_context(|| format!("pulling {reference}"))?;
            }
            ImageSource::Archive(archive) => {
                std::fs::create_dir_all(&layout)?;
                run(Command::new("tar")
                    .arg("-xf")
                    .arg(archive)
                    .arg("-C")
                    .arg(&layout))
                .with_context(|| format!("unpacking {}", archive.display()))?;
            }
        }
        let index: Value = serde_json::from_str(
            &std::fs::read_to_string(layout.join("index.json")).context("the layout's index")?,
        )?;
        let manifests = index["manifests"]
            .as_array()
            .context("index.json lists nothing")?;
        let pulled = manifests
            .iter()
            .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == "pulled")
            .or_else(|| manifests.first())
            .context("index.json lists no manifest")?;
        let mut digest = pulled["digest"]
            .as_str()
            .context("a manifest without digest")?
            .to_owned();
        let mut manifest: Value = serde_json::from_slice(&std::fs::read(blob(&layout, &digest)?)?)?;
        if manifest["manifests"].is_array() {
            let arch = match std::env::consts::ARCH {
                "x86_64" => "amd64",
                "aarch64" => "arm64",
                other => other,
            };
            let chosen = manifest["manifests"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|m| m["platform"]["os"] == "linux" && m["platform"]["architecture"] == arch)
                .with_context(|| format!("the image index has no linux/{arch} manifest"))?;
            digest = chosen["digest"].as_str().context("no digest")?.to_owned();
            manifest = serde_json::from_slice(&std::fs::read(blob(&layout, &digest)?)?)?;
        }
        let config_digest = manifest["config"]["digest"]
            .as_str()
            .context("the manifest has no config")?;
        let config: Value = serde_json::from_slice(&std::fs::read(blob(&layout, config_digest)?)?)?;
        let config: ImageConfig =
            serde_json::from_value(config["config"].clone()).context("reading the image config")?;
        let mut layers = Vec::new();
        for layer in manifest["layers"].as_array().into_iter().flatten() {
            let d = layer["digest"].as_str().context("a layer without digest")?;
            let media = layer["mediaType"].as_str().unwrap_or_default().to_owned();
            layers.push((blob(&layout, d)?, media));
        }
        Ok(Image {
            layout,
            digest,
            config,
            layers,
        })
    }

    /// Unpacks the layers in order into `rootfs` (created), owners and modes as recorded.
    /// Whiteouts (files a later layer deletes) are refused: the operator's image has one layer.
    pub fn unpack(&self, rootfs: &Path) -> Result<()> {
        std::fs::create_dir_all(rootfs)?;
        for (path, media) in &self.layers {
            let gzip = media.ends_with("+gzip") || media.ends_with(".gzip");
            ensure!(
                gzip || media.ends_with(".tar") || media.is_empty(),
                "layer {} has media type {media}: only tar and tar+gzip are unpacked",
                path.display()
            );
            let flags = if gzip { "-tzf" } else { "-tf" };
            let names = run(Command::new("tar").arg(flags).arg(path))?;
            if let Some(w) = names
                .lines()
                .find(|n| n.rsplit('/').next().is_some_and(|b| b.starts_with(".wh.")))
            {
                bail!(
                    "layer {} has a whiteout ({w}): not supported here",
                    path.display()
                );
            }
            let flags = if gzip { "-xzf" } else { "-xf" };
            run(Command::new("tar")
                .arg("--numeric-owner")
                .arg("--same-permissions")
                .arg(flags)
                .arg(path)
                .arg("-C")
                .arg(rootfs))?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Quantities and limits

/// A memory quantity in bytes (`350Mi`, `1G`, `128974848`).
pub fn parse_bytes(q: &str) -> Result<u64> {
    let (number, factor): (&str, f64) = [
        ("Ki", 1024f64),
        ("Mi", 1024f64.powi(2)),
        ("Gi", 1024f64.powi(3)),
        ("Ti", 1024f64.powi(4)),
        ("Pi", 1024f64.powi(5)),
        ("Ei", 1024f64.powi(6)),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
        ("E", 1e18),
        ("m", 1e-3),
    ]
    .iter()
    .find_map(|(suffix, f)| q.strip_suffix(suffix).map(|n| (n, *f)))
    .unwrap_or((q, 1.0));
    let value: f64 = number
        .parse()
        .with_context(|| format!("quantity {q:?} is not a number with a unit"))?;
    ensure!(value >= 0.0, "quantity {q:?} is negative");
    Ok((value * factor).ceil() as u64)
}

/// A CPU quantity in millicores (`500m`, `1`, `1.5`).
pub fn parse_millicpu(q: &str) -> Result<u64> {
    let value = match q.strip_suffix('m') {
        Some(milli) => milli.parse::<f64>(),
        None => q.parse::<f64>().map(|v| v * 1000.0),
    }
    .with_context(|| format!("CPU quantity {q:?} is not a number of cores or millicores"))?;
    ensure!(value >= 0.0, "CPU quantity {q:?} is negative");
    Ok(value.ceil() as u64)
}

/// The cgroup limits a container runs under, as the kubelet sets them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Limits {
    /// `limits.memory` in bytes.
    pub memory_bytes: Option<u64>,
    /// `limits.cpu` as CFS quota per [`CPU_PERIOD_US`].
    pub cpu_quota_us: Option<u64>,
    /// `requests.cpu` (or the limit when no request) as cpu.shares.
    pub cpu_shares: Option<u64>,
    /// From the pod's QoS class.
    pub oom_score_adj: i64,
}

fn quantity<'a>(map: Option<&'a BTreeMap<String, Quantity>>, key: &str) -> Option<&'a str> {
    map.and_then(|m| m.get(key)).map(|q| q.0.as_str())
}

/// The limits of `container` (the only container of its pod) on a node with `node_memory`
/// bytes: CPU quota from `limits.cpu`, shares from `requests.cpu` (the limit when there is no
/// request, as the API server defaults it), and the oom_score_adj of the QoS class
/// (Guaranteed -997, BestEffort 1000, Burstable 1000 - 1000 * request / node memory, within
/// 2..=999).
pub fn limits(container: &Container, node_memory: u64) -> Result<Limits> {
    let res = container.resources.as_ref();
    let lim = res.and_then(|r| r.limits.as_ref());
    let req = res.and_then(|r| r.requests.as_ref());
    let memory_limit = quantity(lim, "memory").map(parse_bytes).transpose()?;
    let memory_request = quantity(req, "memory")
        .map(parse_bytes)
        .transpose()?
        .or(memory_limit);
    let cpu_limit = quantity(lim, "cpu").map(parse_millicpu).transpose()?;
    let cpu_request = quantity(req, "cpu")
        .map(parse_millicpu)
        .transpose()?
        .or(cpu_limit);
    let guaranteed = memory_limit.is_some()
        && cpu_limit.is_some()
        && memory_limit == memory_request
        && cpu_limit == cpu_request;
    let best_effort = memory_request.is_none() && cpu_request.is_none();
    let oom_score_adj = if guaranteed {
        -997
    } else if best_effort {
        1000
    } else {
        let request = memory_request.unwrap_or_default() as i128;
        let adj = 1000 - (1000 * request) / i128::from(node_memory.max(1));
        adj.clamp(2, 999) as i64
    };
    Ok(Limits {
        memory_bytes: memory_limit,
        cpu_quota_us: cpu_limit.map(|m| (m * CPU_PERIOD_US / 1000).max(1000)),
        cpu_shares: cpu_request.map(|m| (m * 1024 / 1000).max(2)),
        oom_score_adj,
    })
}

// ---------------------------------------------------------------------------------------------
// The pod: where it comes from, and the translation into a runtime config

/// The pod a container belongs to: a live Pod (scheduled by the harness, its name, UID and
/// admission's changes real) or a pod template as `helm template` renders it.
#[derive(Clone, Debug)]
pub struct PodContext {
    pub namespace: String,
    pub name: String,
    /// Set for a live Pod: the token is then bound to it, as the kubelet binds it.
    pub uid: Option<String>,
    pub node_name: Option<String>,
    pub spec: PodSpec,
}

impl PodContext {
    /// From a live Pod.
    pub fn live(pod: &Pod) -> Result<Self> {
        Ok(PodContext {
            namespace: pod
                .metadata
                .namespace
                .clone()
                .context("pod without namespace")?,
            name: pod.metadata.name.clone().context("pod without name")?,
            uid: pod.metadata.uid.clone(),
            node_name: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            spec: pod.spec.clone().context("pod without spec")?,
        })
    }

    /// From a rendered pod template, as a pod `name` in `namespace` that no API server has seen.
    pub fn rendered(namespace: &str, name: &str, spec: PodSpec) -> Self {
        PodContext {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            uid: None,
            node_name: None,
            spec,
        }
    }

    fn service_account(&self) -> &str {
        self.spec
            .service_account_name
            .as_deref()
            .filter(|s| !s.is_empty())
            .unwrap_or("default")
    }

    /// A downward-API field.
    fn field(&self, path: &str) -> Result<String> {
        match path {
            "metadata.name" => Ok(self.name.clone()),
            "metadata.namespace" => Ok(self.namespace.clone()),
            "metadata.uid" => self
                .uid
                .clone()
                .context("a rendered pod has no metadata.uid"),
            "spec.nodeName" => self
                .node_name
                .clone()
                .context("the pod is not scheduled (spec.nodeName)"),
            "spec.serviceAccountName" => Ok(self.service_account().to_owned()),
            other => bail!("downward-API field {other} is not supported by the container runner"),
        }
    }
}

/// The running Pod of Deployment `namespace/name` (the one the harness scheduled onto a fake
/// node), waited for: the pod whose container the runner runs.
pub async fn deployment_pod(
    admin: &Client,
    namespace: &str,
    name: &str,
    timeout: Duration,
) -> Result<Pod> {
    use k8s_openapi::api::apps::v1::Deployment;
    use kube::api::ListParams;
    let deployment = Api::<Deployment>::namespaced(admin.clone(), namespace)
        .get(name)
        .await
        .with_context(|| format!("reading Deployment {namespace}/{name}"))?;
    let selector = deployment
        .spec
        .and_then(|s| s.selector.match_labels)
        .context("the Deployment has no matchLabels")?
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let pods: Api<Pod> = Api::namespaced(admin.clone(), namespace);
    crate::wait::until(
        timeout,
        &format!("a running pod of Deployment {namespace}/{name}"),
        || {
            let (pods, selector) = (pods.clone(), selector.clone());
            async move {
                let list = pods
                    .list(&ListParams::default().labels(&selector))
                    .await?
                    .items;
                let running: Vec<Pod> = list
                    .into_iter()
                    .filter(|p| {
                        p.metadata.deletion_timestamp.is_none()
                            && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                    })
                    .collect();
                Ok(match running.as_slice() {
                    [pod] => Ok(pod.clone()),
                    other => Err(format!("{} running pods", other.len())),
                })
            }
        },
    )
    .await
}

/// The API server as the pod reaches it (`KUBERNETES_SERVICE_HOST`/`PORT`).
#[derive(Clone, Debug)]
pub struct ApiServer {
    pub host: String,
    pub port: u16,
}

impl ApiServer {
    /// The harness API server of the admin kubeconfig (`KUBECONFIG`).
    pub fn from_kubeconfig() -> Result<Self> {
        let kubeconfig = kube::config::Kubeconfig::read().context("reading KUBECONFIG")?;
        let server = kubeconfig
            .clusters
            .iter()
            .find_map(|c| c.cluster.as_ref()?.server.clone())
            .context("the kubeconfig names no server")?;
        let rest = server
            .strip_prefix("https://")
            .with_context(|| format!("server {server} is not https"))?
            .trim_end_matches('/');
        let (host, port) = rest
            .rsplit_once(':')
            .with_context(|| format!("no port in server address {server}"))?;
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        ensure!(
            host.parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback()),
            "the API server {server} is not on a loopback address: the runner forwards only those"
        );
        Ok(ApiServer {
            host,
            port: port.parse().with_context(|| format!("port of {server}"))?,
        })
    }
}

/// The user and groups a container's process runs as.
#[derive(Clone, Debug, PartialEq)]
pub struct User {
    pub uid: u32,
    pub gid: u32,
    pub additional_gids: Vec<u32>,
}

/// The image's `/etc/passwd` entry of `name_or_uid`: (uid, gid).
fn passwd_entry(passwd: &str, name_or_uid: &str) -> Option<(u32, u32)> {
    passwd.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        let (name, uid, gid) = (fields.first()?, fields.get(2)?, fields.get(3)?);
        (*name == name_or_uid || *uid == name_or_uid)
            .then(|| Some((uid.parse().ok()?, gid.parse().ok()?)))?
    })
}

/// The user the container runs as, with the kubelet's runAsNonRoot check. `passwd` is the
/// image's /etc/passwd (empty when it has none).
pub fn resolve_user(
    pod: &PodSpec,
    container: &Container,
    image: &ImageConfig,
    passwd: &str,
) -> Result<User> {
    let csc = container.security_context.as_ref();
    let psc = pod.security_context.as_ref();
    let run_as_user = csc
        .and_then(|s| s.run_as_user)
        .or(psc.and_then(|s| s.run_as_user));
    let run_as_group = csc
        .and_then(|s| s.run_as_group)
        .or(psc.and_then(|s| s.run_as_group));
    let non_root = csc
        .and_then(|s| s.run_as_non_root)
        .or(psc.and_then(|s| s.run_as_non_root))
        .unwrap_or(false);
    let image_user = image.user.clone().unwrap_or_default();
    let (image_uid, image_gid) = match image_user.split_once(':') {
        Some((u, g)) => (u.to_owned(), Some(g.to_owned())),
        None => (image_user.clone(), None),
    };
    let uid: u32 = match run_as_user {
        Some(uid) => {
            if non_root && uid == 0 {
                bail!(
                    "container's runAsUser breaks non-root policy (container {})",
                    container.name
                );
            }
            u32::try_from(uid).context("runAsUser out of range")?
        }
        None if image_uid.is_empty() => 0,
        None => match image_uid.parse::<u32>() {
            Ok(uid) => uid,
            Err(_) if non_root => bail!(
                "container has runAsNonRoot and image has non-numeric user ({image_uid}), cannot verify user is non-root (container {})",
                container.name
            ),
            Err(_) => passwd_entry(passwd, &image_uid)
                .map(|(uid, _)| uid)
                .with_context(|| {
                    format!("the image's user {image_uid} is not in its /etc/passwd")
                })?,
        },
    };
    if non_root && uid == 0 {
        bail!(
            "container has runAsNonRoot and image will run as root (container {})",
            container.name
        );
    }
    let gid: u32 = match (run_as_group, run_as_user, &image_gid) {
        (Some(gid), _, _) => u32::try_from(gid).context("runAsGroup out of range")?,
        // The image's group only goes with the image's user.
        (None, None, Some(g)) => match g.parse() {
            Ok(gid) => gid,
            Err(_) => bail!("the image's group {g} is not numeric: not supported here"),
        },
        _ => passwd_entry(passwd, &uid.to_string()).map_or(0, |(_, gid)| gid),
    };
    let mut additional_gids: Vec<u32> = psc
        .and_then(|s| s.supplemental_groups.clone())
        .unwrap_or_default()
        .into_iter()
        .chain(psc.and_then(|s| s.fs_group))
        .filter_map(|g| u32::try_from(g).ok())
        .collect();
    additional_gids.sort_unstable();
    additional_gids.dedup();
    Ok(User {
        uid,
        gid,
        additional_gids,
    })
}

/// The container's capabilities: containerd's defaults less `drop`, plus `add` (`ALL` in
/// either means every one).
pub fn capabilities(container: &Container) -> Vec<String> {
    let caps = container
        .security_context
        .as_ref()
        .and_then(|s| s.capabilities.as_ref());
    let norm = |c: &String| {
        let c = c.to_uppercase();
        if c.starts_with("CAP_") {
            c
        } else {
            format!("CAP_{c}")
        }
    };
    let drop: Vec<String> = caps
        .and_then(|c| c.drop.as_ref())
        .into_iter()
        .flatten()
        .map(norm)
        .collect();
    let add: Vec<String> = caps
        .and_then(|c| c.add.as_ref())
        .into_iter()
        .flatten()
        .map(norm)
        .collect();
    let mut out: Vec<String> = if drop.iter().any(|c| c == "CAP_ALL") {
        Vec::new()
    } else {
        DEFAULT_CAPS
            .iter()
            .map(|c| (*c).to_owned())
            .filter(|c| !drop.contains(c))
            .collect()
    };
    if add.iter().any(|c| c == "CAP_ALL") {
        out = ALL_CAPS.iter().map(|c| (*c).to_owned()).collect();
    } else {
        for c in add {
            if !out.contains(&c) {
                out.push(c);
            }
        }
    }
    out
}

/// Expands `$(NAME)` from `env` as the kubelet does in command, args and env values: `$$` is
/// a literal `$`, an unknown reference stays as written.
pub fn expand(text: &str, env: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(inner) = after.strip_prefix('(')
            && let Some(end) = inner.find(')')
        {
            let name = &inner[..end];
            match env.iter().rev().find(|(k, _)| k == name) {
                Some((_, v)) => out.push_str(v),
                None => out.push_str(&rest[i..i + 2 + end + 1]),
            }
            rest = &inner[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// The process's environment: the image's, the API server's service variables, HOSTNAME, then
/// the container's (fieldRef resolved, `$(VAR)` expanded), later entries replacing earlier ones.
pub fn environment(
    pod: &PodContext,
    container: &Container,
    image: &ImageConfig,
    api: &ApiServer,
) -> Result<Vec<(String, String)>> {
    let mut env: Vec<(String, String)> = Vec::new();
    let set = |env: &mut Vec<(String, String)>, k: &str, v: String| {
        env.retain(|(name, _)| name != k);
        env.push((k.to_owned(), v));
    };
    for entry in image.env.iter().flatten() {
        let (k, v) = entry.split_once('=').unwrap_or((entry.as_str(), ""));
        set(&mut env, k, v.to_owned());
    }
    let (h, p) = (&api.host, api.port);
    for (k, v) in [
        ("KUBERNETES_SERVICE_HOST", h.clone()),
        ("KUBERNETES_SERVICE_PORT", p.to_string()),
        ("KUBERNETES_SERVICE_PORT_HTTPS", p.to_string()),
        ("KUBERNETES_PORT", format!("tcp://{h}:{p}")),
        (
            &format!("KUBERNETES_PORT_{p}_TCP"),
            format!("tcp://{h}:{p}"),
        ),
        (&format!("KUBERNETES_PORT_{p}_TCP_PROTO"), "tcp".to_owned()),
        (&format!("KUBERNETES_PORT_{p}_TCP_PORT"), p.to_string()),
        (&format!("KUBERNETES_PORT_{p}_TCP_ADDR"), h.clone()),
        ("HOSTNAME", pod.name.clone()),
    ] {
        set(&mut env, k, v);
    }
    ensure!(
        container.env_from.as_ref().is_none_or(Vec::is_empty),
        "container {}: envFrom is not supported by the container runner",
        container.name
    );
    for var in container.env.iter().flatten() {
        let value = match (&var.value, &var.value_from) {
            (Some(value), None) => expand(value, &env),
            (None, None) => String::new(),
            (None, Some(from)) => match &from.field_ref {
                Some(f) => pod.field(&f.field_path)?,
                None => bail!(
                    "env {}: only valueFrom.fieldRef is supported by the container runner",
                    var.name
                ),
            },
            (Some(_), Some(_)) => bail!("env {}: both value and valueFrom", var.name),
        };
        set(&mut env, &var.name, value);
    }
    Ok(env)
}

/// The process's arguments, as the CRI combines the container's command/args with the image's
/// Entrypoint/Cmd.
pub fn process_args(
    container: &Container,
    image: &ImageConfig,
    env: &[(String, String)],
) -> Result<Vec<String>> {
    let expand_all = |v: &Vec<String>| v.iter().map(|s| expand(s, env)).collect::<Vec<_>>();
    let args: Vec<String> = match (&container.command, &container.args) {
        (Some(command), Some(args)) => expand_all(command)
            .into_iter()
            .chain(expand_all(args))
            .collect(),
        (Some(command), None) => expand_all(command),
        (None, Some(args)) => image
            .entrypoint
            .clone()
            .unwrap_or_default()
            .into_iter()
            .chain(expand_all(args))
            .collect(),
        (None, None) => image
            .entrypoint
            .clone()
            .unwrap_or_default()
            .into_iter()
            .chain(image.cmd.clone().unwrap_or_default())
            .collect(),
    };
    ensure!(
        !args.is_empty(),
        "container {}: no command, and the image has no entrypoint or cmd",
        container.name
    );
    Ok(args)
}

/// An httpGet probe resolved to a port number.
#[derive(Clone, Debug, PartialEq)]
pub struct HttpProbe {
    pub kind: &'static str,
    pub path: String,
    pub port: u16,
    pub https: bool,
    pub initial_delay: Duration,
    pub period: Duration,
    pub timeout: Duration,
    pub success_threshold: u32,
    pub failure_threshold: u32,
}

/// The container's probes, their named ports looked up in its `ports`; other kinds than
/// httpGet are refused.
pub fn probes(container: &Container) -> Result<Vec<HttpProbe>> {
    let mut out = Vec::new();
    for (kind, probe) in [
        ("startup", &container.startup_probe),
        ("liveness", &container.liveness_probe),
        ("readiness", &container.readiness_probe),
    ] {
        let Some(probe) = probe else { continue };
        let Probe { http_get, .. } = probe;
        let Some(HTTPGetAction {
            path,
            port,
            scheme,
            host,
            ..
        }) = http_get
        else {
            bail!(
                "container {}: its {kind} probe is not httpGet, which is all the runner polls",
                container.name
            );
        };
        ensure!(
            host.as_deref()
                .is_none_or(|h| h.is_empty() || h == "127.0.0.1" || h == "localhost"),
            "container {}: the {kind} probe names host {host:?}",
            container.name
        );
        let port = match port {
            IntOrString::Int(p) => u16::try_from(*p).context("probe port out of range")?,
            IntOrString::String(name) => container
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some(name.as_str()))
                .and_then(|p| u16::try_from(p.container_port).ok())
                .with_context(|| {
                    format!(
                        "container {}: the {kind} probe's port {name} is not among its ports",
                        container.name
                    )
                })?,
        };
        let secs =
            |v: Option<i32>, default: i32| Duration::from_secs(v.unwrap_or(default).max(0) as u64);
        out.push(HttpProbe {
            kind,
            path: path.clone().unwrap_or_else(|| "/".to_owned()),
            port,
            https: scheme.as_deref() == Some("HTTPS"),
            initial_delay: secs(probe.initial_delay_seconds, 0),
            period: secs(probe.period_seconds, 10),
            timeout: secs(probe.timeout_seconds, 1),
            success_threshold: probe.success_threshold.unwrap_or(1).max(1) as u32,
            failure_threshold: probe.failure_threshold.unwrap_or(3).max(1) as u32,
        });
    }
    Ok(out)
}

/// A bind mount of a file or folder the runner prepared in the bundle.
#[derive(Clone, Debug, PartialEq)]
pub struct BindMount {
    pub source: PathBuf,
    pub destination: String,
    pub read_only: bool,
}

/// Everything [`plan`] needs besides the pod and container.
pub struct PlanInputs<'a> {
    pub image: &'a ImageConfig,
    pub passwd: &'a str,
    pub api: &'a ApiServer,
    pub node_memory: u64,
    /// The `linux.seccomp` object for RuntimeDefault (the caller runs `seccomp-default` with
    /// the capabilities [`capabilities`] gives); None where the pod does not ask for it.
    pub seccomp: Option<Value>,
    /// The volume mounts and the prepared files (hosts, resolv.conf, ...).
    pub mounts: Vec<BindMount>,
    pub cgroups_path: String,
}

/// The seccomp profile type the container asks for (container first, then pod), defaulting
/// to Unconfined as the kubelet does without `seccompDefault`.
pub fn seccomp_type(pod: &PodSpec, container: &Container) -> String {
    container
        .security_context
        .as_ref()
        .and_then(|s| s.seccomp_profile.as_ref())
        .or(pod
            .security_context
            .as_ref()
            .and_then(|s| s.seccomp_profile.as_ref()))
        .map_or_else(|| "Unconfined".to_owned(), |p| p.type_.clone())
}

/// The OCI runtime config (config.json) for the container, and the limits it must run under.
pub fn plan(
    pod: &PodContext,
    container: &Container,
    inputs: &PlanInputs<'_>,
) -> Result<(Value, Limits)> {
    let spec = &pod.spec;
    ensure!(
        !spec.host_network.unwrap_or(false),
        "pod {}: hostNetwork pods are not run here (they would bind the host's addresses)",
        pod.name
    );
    let csc = container.security_context.as_ref();
    ensure!(
        !csc.and_then(|s| s.privileged).unwrap_or(false),
        "container {}: privileged containers are not run here",
        container.name
    );
    let user = resolve_user(spec, container, inputs.image, inputs.passwd)?;
    let env = environment(pod, container, inputs.image, inputs.api)?;
    let args = process_args(container, inputs.image, &env)?;
    let caps = capabilities(container);
    let limits = limits(container, inputs.node_memory)?;
    let seccomp = match seccomp_type(spec, container).as_str() {
        "RuntimeDefault" => Some(
            inputs
                .seccomp
                .clone()
                .context("RuntimeDefault seccomp asked for, but no profile given")?,
        ),
        "Unconfined" => None,
        other => bail!(
            "container {}: seccomp profile type {other} is not supported here",
            container.name
        ),
    };
    let no_new_privs = csc.and_then(|s| s.allow_privilege_escalation) == Some(false);
    let read_only = csc
        .and_then(|s| s.read_only_root_filesystem)
        .unwrap_or(false);
    let cwd = container
        .working_dir
        .clone()
        .or(inputs.image.working_dir.clone())
        .filter(|d| !d.is_empty())
        .unwrap_or_else(|| "/".to_owned());

    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]}),
        json!({"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]}),
        json!({"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup", "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]}),
        json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}),
    ];
    for m in &inputs.mounts {
        let mut options = vec!["rbind", "rprivate"];
        if m.read_only {
            options.push("ro");
        }
        mounts.push(json!({"destination": m.destination, "type": "bind", "source": m.source, "options": options}));
    }
    let mut resources = json!({"devices": [{"allow": false, "access": "rwm"}]});
    if let Some(bytes) = limits.memory_bytes {
        // No swap beyond the limit, as the kubelet's NoSwap.
        resources["memory"] = json!({"limit": bytes, "swap": bytes});
    }
    let mut cpu = serde_json::Map::new();
    if let Some(quota) = limits.cpu_quota_us {
        cpu.insert("quota".into(), json!(quota));
        cpu.insert("period".into(), json!(CPU_PERIOD_US));
    }
    if let Some(shares) = limits.cpu_shares {
        cpu.insert("shares".into(), json!(shares));
    }
    if !cpu.is_empty() {
        resources["cpu"] = Value::Object(cpu);
    }
    let mut linux = json!({
        "resources": resources,
        "cgroupsPath": inputs.cgroups_path,
        // The pod's network namespace is netns-run's, which the runtime inherits.
        "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}],
        "maskedPaths": ["/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
            "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware",
            "/sys/devices/virtual/powercap"],
        "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
    });
    if let Some(profile) = seccomp {
        linux["seccomp"] = profile;
    }
    let config = json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": user.uid, "gid": user.gid, "additionalGids": user.additional_gids},
            "args": args,
            "env": env.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>(),
            "cwd": cwd,
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "noNewPrivileges": no_new_privs,
            "oomScoreAdj": limits.oom_score_adj,
        },
        "root": {"path": "rootfs", "readonly": read_only},
        "hostname": pod.name.chars().take(63).collect::<String>(),
        "mounts": mounts,
        "linux": linux,
    });
    Ok((config, limits))
}

// ---------------------------------------------------------------------------------------------
// Volumes

/// Writes `files` (relative path, content) into `dir` with mode 0644 in folders of 0755, as the
/// kubelet writes ConfigMap, Secret and projected volumes (defaultMode 420).
fn write_files(dir: &Path, files: &[(String, Vec<u8>)]) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    for (path, content) in files {
        ensure!(
            !path.contains(".."),
            "volume item path {path} leaves its volume"
        );
        let target = dir.join(path);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&target, content)?;
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o644))?;
    }
    Ok(())
}

/// A ConfigMap's keys (or the `items`) as files.
async fn config_map_files(
    admin: &Client,
    namespace: &str,
    name: &str,
    items: Option<&Vec<k8s_openapi::api::core::v1::KeyToPath>>,
) -> Result<Vec<(String, Vec<u8>)>> {
    // As the kubelet, wait a little for a ConfigMap not there yet: kube-root-ca.crt is
    // published into a new namespace by the controller manager, shortly after it is created.
    let api = Api::<ConfigMap>::namespaced(admin.clone(), namespace);
    let cm = crate::wait::until(
        Duration::from_secs(30),
        &format!("ConfigMap {namespace}/{name}"),
        || {
            let api = api.clone();
            async move {
                Ok(api
                    .get_opt(name)
                    .await?
                    .ok_or_else(|| "not found".to_owned()))
            }
        },
    )
    .await?;
    let mut data: BTreeMap<String, Vec<u8>> = cm
        .data
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, v.into_bytes()))
        .collect();
    data.extend(
        cm.binary_data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.0)),
    );
    select_items(data, items, &format!("ConfigMap {namespace}/{name}"))
}

async fn secret_files(
    admin: &Client,
    namespace: &str,
    name: &str,
    items: Option<&Vec<k8s_openapi::api::core::v1::KeyToPath>>,
) -> Result<Vec<(String, Vec<u8>)>> {
    let secret = Api::<Secret>::namespaced(admin.clone(), namespace)
        .get(name)
        .await
        .with_context(|| format!("reading Secret {namespace}/{name}"))?;
    let data: BTreeMap<String, Vec<u8>> = secret
        .data
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, v.0))
        .collect();
    select_items(data, items, &format!("Secret {namespace}/{name}"))
}

fn select_items(
    data: BTreeMap<String, Vec<u8>>,
    items: Option<&Vec<k8s_openapi::api::core::v1::KeyToPath>>,
    what: &str,
) -> Result<Vec<(String, Vec<u8>)>> {
    match items {
        None => Ok(data.into_iter().collect()),
        Some(items) => items
            .iter()
            .map(|i| {
                let v = data
                    .get(&i.key)
                    .with_context(|| format!("{what} has no key {}", i.key))?;
                Ok((i.path.clone(), v.clone()))
            })
            .collect(),
    }
}

/// A token of the pod's ServiceAccount as the kubelet requests it: `audience` (the API
/// server's when empty), the expiry the projection asks for, bound to the pod when it is live.
async fn pod_token(
    admin: &Client,
    pod: &PodContext,
    audience: Option<&str>,
    seconds: Option<i64>,
) -> Result<String> {
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: audience
                .filter(|a| !a.is_empty())
                .map(|a| vec![a.to_owned()]),
            expiration_seconds: Some(seconds.unwrap_or(3607)),
            bound_object_ref: pod.uid.as_ref().map(|uid| BoundObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Pod".to_owned()),
                name: Some(pod.name.clone()),
                uid: Some(uid.clone()),
            }),
        }),
        ..TokenRequest::default()
    };
    let sa = pod.service_account();
    Api::<ServiceAccount>::namespaced(admin.clone(), &pod.namespace)
        .create_token_request(sa, &PostParams::default(), &request)
        .await
        .with_context(|| {
            format!(
                "requesting a token of ServiceAccount {}/{sa}",
                pod.namespace
            )
        })?
        .status
        .and_then(|s| s.token)
        .context("the token request returned no token")
}

/// The projected volume the ServiceAccount admission plugin adds to a pod that mounts its
/// token (what a rendered pod template lacks and a live Pod has).
fn service_account_volume() -> (Volume, k8s_openapi::api::core::v1::VolumeMount) {
    let volume: Volume = serde_json::from_value(json!({
        "name": "kube-api-access-runner",
        "projected": {"defaultMode": 420, "sources": [
            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
            {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}
        ]}
    }))
    .unwrap_or_default();
    let mount = k8s_openapi::api::core::v1::VolumeMount {
        name: "kube-api-access-runner".to_owned(),
        mount_path: SERVICE_ACCOUNT_DIR.to_owned(),
        read_only: Some(true),
        ..Default::default()
    };
    (volume, mount)
}

/// Writes the container's volumes under `dir` and returns their bind mounts.
async fn prepare_volumes(
    admin: &Client,
    pod: &PodContext,
    container: &Container,
    dir: &Path,
) -> Result<Vec<BindMount>> {
    let mut volumes: Vec<Volume> = pod.spec.volumes.clone().unwrap_or_default();
    let mut mounts = container.volume_mounts.clone().unwrap_or_default();
    let automount = pod.spec.automount_service_account_token.unwrap_or(true);
    if automount && !mounts.iter().any(|m| m.mount_path == SERVICE_ACCOUNT_DIR) {
        let (v, m) = service_account_volume();
        volumes.push(v);
        mounts.push(m);
    }
    let mut out = Vec::new();
    for mount in &mounts {
        let volume = volumes
            .iter()
            .find(|v| v.name == mount.name)
            .with_context(|| format!("volumeMount {} names no volume of the pod", mount.name))?;
        ensure!(
            mount.sub_path.as_deref().is_none_or(str::is_empty),
            "volumeMount {}: subPath is not supported by the runner",
            mount.name
        );
        let source = dir.join(&volume.name);
        if let Some(cm) = &volume.config_map {
            let files =
                config_map_files(admin, &pod.namespace, &cm.name, cm.items.as_ref()).await?;
            write_files(&source, &files)?;
        } else if let Some(secret) = &volume.secret {
            let name = secret
                .secret_name
                .as_deref()
                .context("a secret volume without secretName")?;
            let files = secret_files(admin, &pod.namespace, name, secret.items.as_ref()).await?;
            write_files(&source, &files)?;
        } else if volume.empty_dir.is_some() {
            use std::os::unix::fs::PermissionsExt;
            std::fs::create_dir_all(&source)?;
            std::fs::set_permissions(&source, std::fs::Permissions::from_mode(0o777))?;
        } else if let Some(projected) = &volume.projected {
            let mut files = Vec::new();
            for VolumeProjection {
                config_map,
                secret,
                downward_api,
                service_account_token,
                ..
            } in projected.sources.iter().flatten()
            {
                if let Some(cm) = config_map {
                    files.extend(
                        config_map_files(admin, &pod.namespace, &cm.name, cm.items.as_ref())
                            .await?,
                    );
                } else if let Some(s) = secret {
                    files.extend(
                        secret_files(admin, &pod.namespace, &s.name, s.items.as_ref()).await?,
                    );
                } else if let Some(d) = downward_api {
                    for item in d.items.iter().flatten() {
                        let f = item.field_ref.as_ref().with_context(|| {
                            format!("downwardAPI item {}: only fieldRef is supported", item.path)
                        })?;
                        files.push((item.path.clone(), pod.field(&f.field_path)?.into_bytes()));
                    }
                } else if let Some(t) = service_account_token {
                    let token =
                        pod_token(admin, pod, t.audience.as_deref(), t.expiration_seconds).await?;
                    files.push((t.path.clone(), token.into_bytes()));
                } else {
                    bail!(
                        "volume {}: a projected source the runner does not support",
                        volume.name
                    );
                }
            }
            write_files(&source, &files)?;
        } else {
            bail!(
                "volume {}: only configMap, secret, emptyDir and projected volumes are supported by the runner",
                volume.name
            );
        }
        out.push(BindMount {
            source,
            destination: mount.mount_path.clone(),
            read_only: mount.read_only.unwrap_or(false),
        });
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Cgroup accounting

/// What the container's cgroup says: the limits in force and the memory it used.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct CgroupStats {
    /// `v1` or `v2`.
    pub version: String,
    pub memory_limit_bytes: Option<u64>,
    pub memory_usage_bytes: Option<u64>,
    /// memory.max_usage_in_bytes (v1) or memory.peak (v2).
    pub memory_peak_bytes: Option<u64>,
    /// The oom_kill counter (memory.oom_control in v1, memory.events in v2).
    pub oom_kills: Option<u64>,
    /// How often usage hit the limit (memory.failcnt in v1, `max` of memory.events in v2).
    pub memory_limit_hits: Option<u64>,
    /// CFS quota and period in microseconds.
    pub cpu_quota_us: Option<u64>,
    pub cpu_period_us: Option<u64>,
    pub cpu_shares: Option<u64>,
    /// Periods in which the quota throttled it, and for how long (ns).
    pub cpu_throttled_periods: Option<u64>,
    pub cpu_throttled_ns: Option<u64>,
}

impl CgroupStats {
    pub fn memory_peak_mib(&self) -> Option<f64> {
        self.memory_peak_bytes.map(|b| b as f64 / 1024.0 / 1024.0)
    }
}

fn read_u64(path: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let text = text.trim();
    if text == "max" || text == "-1" {
        return None;
    }
    text.parse().ok()
}

fn keyed(path: &Path, key: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok())?
    })
}

/// The cgroup of process `pid`: v1 controller paths from /proc/PID/cgroup under
/// /sys/fs/cgroup/<controller>, or the unified path where the host has cgroup v2 only.
pub fn cgroup_stats(pid: u32) -> Result<CgroupStats> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .with_context(|| format!("reading /proc/{pid}/cgroup"))?;
    let root = Path::new("/sys/fs/cgroup");
    let mut s = CgroupStats::default();
    if root.join("cgroup.controllers").exists() {
        s.version = "v2".into();
        let path = text
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .context("no unified cgroup")?;
        let dir = root.join(path.trim_start_matches('/'));
        s.memory_limit_bytes = read_u64(&dir.join("memory.max"));
        s.memory_usage_bytes = read_u64(&dir.join("memory.current"));
        s.memory_peak_bytes = read_u64(&dir.join("memory.peak"));
        s.oom_kills = keyed(&dir.join("memory.events"), "oom_kill");
        s.memory_limit_hits = keyed(&dir.join("memory.events"), "max");
        if let Ok(max) = std::fs::read_to_string(dir.join("cpu.max")) {
            let mut it = max.split_whitespace();
            s.cpu_quota_us = it.next().and_then(|q| q.parse().ok());
            s.cpu_period_us = it.next().and_then(|p| p.parse().ok());
        }
        s.cpu_shares = read_u64(&dir.join("cpu.weight"));
        s.cpu_throttled_periods = keyed(&dir.join("cpu.stat"), "nr_throttled");
        s.cpu_throttled_ns = keyed(&dir.join("cpu.stat"), "throttled_usec").map(|u| u * 1000);
        return Ok(s);
    }
    s.version = "v1".into();
    let controller = |name: &str| -> Option<PathBuf> {
        text.lines().find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            controllers
                .split(',')
                .any(|c| c == name)
                .then(|| root.join(controllers).join(path.trim_start_matches('/')))
        })
    };
    if let Some(dir) = controller("memory") {
        s.memory_limit_bytes =
            read_u64(&dir.join("memory.limit_in_bytes")).filter(|b| *b < (1 << 62));
        s.memory_usage_bytes = read_u64(&dir.join("memory.usage_in_bytes"));
        s.memory_peak_bytes = read_u64(&dir.join("memory.max_usage_in_bytes"));
        s.oom_kills = keyed(&dir.join("memory.oom_control"), "oom_kill");
        s.memory_limit_hits = read_u64(&dir.join("memory.failcnt"));
    }
    if let Some(dir) = controller("cpu") {
        s.cpu_quota_us = read_u64(&dir.join("cpu.cfs_quota_us"));
        s.cpu_period_us = read_u64(&dir.join("cpu.cfs_period_us"));
        s.cpu_shares = read_u64(&dir.join("cpu.shares"));
        s.cpu_throttled_periods = keyed(&dir.join("cpu.stat"), "nr_throttled");
        s.cpu_throttled_ns = keyed(&dir.join("cpu.stat"), "throttled_time");
    }
    Ok(s)
}

/// Every limit of `want` that the cgroup does not enforce, described.
pub fn unenforced(want: &Limits, got: &CgroupStats) -> Vec<String> {
    let mut missing = Vec::new();
    if let Some(bytes) = want.memory_bytes {
        // The kernel rounds the limit down to whole pages.
        let page = 4096;
        if got
            .memory_limit_bytes
            .is_none_or(|b| b > bytes || b + page < bytes)
        {
            missing.push(format!(
                "memory limit {bytes} bytes: the container's {} cgroup has {:?}",
                got.version, got.memory_limit_bytes
            ));
        }
    }
    if let Some(quota) = want.cpu_quota_us {
        // v2's cpu.max and v1's quota/period say the same.
        if got.cpu_quota_us != Some(quota) || got.cpu_period_us != Some(CPU_PERIOD_US) {
            missing.push(format!(
                "CPU limit {quota}us per {CPU_PERIOD_US}us: the container's {} cgroup has {:?} per {:?}",
                got.version, got.cpu_quota_us, got.cpu_period_us
            ));
        }
    }
    missing
}

// ---------------------------------------------------------------------------------------------
// Probes

/// What the probes saw so far.
#[derive(Clone, Debug, Default)]
pub struct ProbeReport {
    /// Per probe kind: (successes, failures).
    pub counts: BTreeMap<&'static str, (u64, u64)>,
    /// Readiness as the kubelet would report it.
    pub ready: bool,
    /// Seconds after the start at which readiness first passed.
    pub first_ready_s: Option<f64>,
    /// Set when a liveness (or startup) probe reached its failure threshold: a kubelet would
    /// have killed and restarted the container here.
    pub restart_due: Option<String>,
    /// The last result of each probe kind.
    pub last: BTreeMap<&'static str, String>,
    /// The last failure of each probe kind, with how long after the start it came.
    pub last_failure: BTreeMap<&'static str, String>,
}

impl std::fmt::Display for ProbeReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ready={}", self.ready)?;
        if let Some(t) = self.first_ready_s {
            write!(f, " (first after {t:.1}s)")?;
        }
        for (kind, (ok, failed)) in &self.counts {
            write!(
                f,
                "; {kind}: {ok} passed, {failed} failed, last {}",
                self.last.get(kind).map_or("-", String::as_str)
            )?;
        }
        for (kind, failure) in &self.last_failure {
            write!(f, "; last {kind} failure {failure}")?;
        }
        if let Some(r) = &self.restart_due {
            write!(f, "; RESTART DUE: {r}")?;
        }
        Ok(())
    }
}

/// One httpGet from inside the network namespace of `pid`: Ok(status) for 200..400, else Err.
fn probe_once(pid: u32, probe: &HttpProbe) -> std::result::Result<String, String> {
    let scheme = if probe.https { "https" } else { "http" };
    let url = format!("{scheme}://127.0.0.1:{}{}", probe.port, probe.path);
    let out = Command::new("nsenter")
        .arg(format!("--net=/proc/{pid}/ns/net"))
        .args([
            "curl",
            "-sS",
            "-k",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--max-time",
        ])
        .arg(probe.timeout.as_secs().max(1).to_string())
        .arg(&url)
        .output()
        .map_err(|e| format!("running nsenter curl: {e}"))?;
    let code = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    match code.parse::<u16>() {
        Ok(c) if (200..400).contains(&c) => Ok(format!("{url} {c}")),
        _ => Err(format!(
            "{url} {code} {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

/// Polls the probes as the kubelet schedules them until `stop`.
fn poll_probes(
    pid: u32,
    probes: Vec<HttpProbe>,
    report: Arc<Mutex<ProbeReport>>,
    stop: Arc<AtomicBool>,
) {
    let started = Instant::now();
    let has_startup = probes.iter().any(|p| p.kind == "startup");
    let mut next: Vec<Instant> = probes.iter().map(|p| started + p.initial_delay).collect();
    let mut streak: Vec<(u32, u32)> = vec![(0, 0); probes.len()];
    let mut started_ok = !has_startup;
    let has_readiness = probes.iter().any(|p| p.kind == "readiness");
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        for (i, probe) in probes.iter().enumerate() {
            if now < next[i]
                || (probe.kind != "startup" && !started_ok)
                || (probe.kind == "startup" && started_ok)
            {
                continue;
            }
            next[i] = now + probe.period;
            let result = probe_once(pid, probe);
            let mut r = report
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let (ok, bad) = &mut streak[i];
            match &result {
                Ok(_) => {
                    r.counts.entry(probe.kind).or_default().0 += 1;
                    *ok += 1;
                    *bad = 0;
                }
                Err(e) => {
                    r.last_failure.insert(
                        probe.kind,
                        format!("after {:.1}s: {e}", started.elapsed().as_secs_f64()),
                    );
                    r.counts.entry(probe.kind).or_default().1 += 1;
                    *bad += 1;
                    *ok = 0;
                }
            }
            r.last.insert(
                probe.kind,
                result.clone().unwrap_or_else(|e| format!("FAILED {e}")),
            );
            match probe.kind {
                "startup" if *ok >= 1 => started_ok = true,
                "readiness" if *ok >= probe.success_threshold && !r.ready => {
                    r.ready = true;
                    r.first_ready_s
                        .get_or_insert(started.elapsed().as_secs_f64());
                }
                "readiness" if *ok >= probe.success_threshold => {}
                "readiness" if *bad >= probe.failure_threshold => r.ready = false,
                "liveness" | "startup"
                    if *bad >= probe.failure_threshold && r.restart_due.is_none() =>
                {
                    r.restart_due = Some(format!(
                        "{} probe failed {} times in a row after {:.1}s: {}",
                        probe.kind,
                        bad,
                        started.elapsed().as_secs_f64(),
                        result.clone().err().unwrap_or_default()
                    ));
                }
                _ => {}
            }
        }
        // Without a readiness probe a started container counts as ready.
        if !has_readiness && started_ok {
            let mut r = report
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if !r.ready {
                r.ready = true;
                r.first_ready_s
                    .get_or_insert(started.elapsed().as_secs_f64());
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

// ---------------------------------------------------------------------------------------------
// Running

/// The tools the runner needs: runc on PATH, netns-run and seccomp-default from
/// tests/cluster/container-tools.sh (which installs runc where missing).
#[derive(Clone, Debug)]
pub struct Tools {
    pub runc: PathBuf,
    pub netns_run: PathBuf,
    pub seccomp_default: PathBuf,
}

impl Tools {
    /// Runs tests/cluster/container-tools.sh.
    pub fn find() -> Result<Self> {
        let bin = crate::tools::built_by("tests/cluster/container-tools.sh")?;
        let runc = [
            "/usr/sbin/runc",
            "/usr/bin/runc",
            "/usr/local/sbin/runc",
            "/usr/local/bin/runc",
        ]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .or_else(|| crate::tools::on_path("runc").ok())
        .context("runc is not installed")?;
        Ok(Tools {
            runc,
            netns_run: bin.join("netns-run"),
            seccomp_default: bin.join("seccomp-default"),
        })
    }
}

/// The machine's memory (the node's capacity for the QoS score).
fn host_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(1 << 34, |kib| kib * 1024)
}

/// A container running under runc in a network namespace of its own; stopped and deleted
/// when dropped.
pub struct RunningContainer {
    pub id: String,
    /// The container's init process on the host.
    pub pid: u32,
    /// netns-run, whose child runc is; exits with the container.
    child: Option<Child>,
    tools: Tools,
    state_root: PathBuf,
    bundle: PathBuf,
    pub log: PathBuf,
    pub limits: Limits,
    /// The config.json runc ran.
    pub config: Value,
    probes: Arc<Mutex<ProbeReport>>,
    stop: Arc<AtomicBool>,
    poller: Option<std::thread::JoinHandle<()>>,
    /// The last cgroup reading (kept for after the container is gone).
    last_stats: Mutex<Option<CgroupStats>>,
}

impl RunningContainer {
    /// Runs `container` of `pod` from `image` under runc, stdout and stderr into `log`; fails
    /// (naming what) when a limit is not in force once it runs.
    pub async fn start(
        admin: &Client,
        tools: &Tools,
        image: &Image,
        pod: &PodContext,
        container: &Container,
        log: PathBuf,
    ) -> Result<Self> {
        let id = unique_name("runc");
        let base = crate::cluster::harness_dir()
            .unwrap_or_else(|_| std::env::temp_dir())
            .join("containers")
            .join(&id);
        let started = Self::start_in(admin, tools, image, pod, container, log, &id, &base).await;
        if started.is_err() {
            let _ = std::fs::remove_dir_all(&base);
        }
        started
    }

    #[allow(clippy::too_many_arguments)]
    async fn start_in(
        admin: &Client,
        tools: &Tools,
        image: &Image,
        pod: &PodContext,
        container: &Container,
        log: PathBuf,
        id: &str,
        base: &Path,
    ) -> Result<Self> {
        let id = id.to_owned();
        let bundle = base.join("bundle");
        let state_root = base.join("state");
        std::fs::create_dir_all(&state_root)?;
        let rootfs = bundle.join("rootfs");
        image.unpack(&rootfs)?;
        let passwd = std::fs::read_to_string(rootfs.join("etc/passwd")).unwrap_or_default();
        let api = ApiServer::from_kubeconfig()?;

        // The files a kubelet and containerd put in every container.
        let files = bundle.join("files");
        std::fs::create_dir_all(&files)?;
        std::fs::write(
            files.join("hosts"),
            format!(
                "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.0.1\t{}\n",
                pod.name
            ),
        )?;
        std::fs::write(files.join("hostname"), format!("{}\n", pod.name))?;
        // No cluster DNS here; searches as the kubelet writes them.
        std::fs::write(
            files.join("resolv.conf"),
            format!(
                "search {0}.svc.cluster.local svc.cluster.local cluster.local\nnameserver 127.0.0.1\noptions ndots:5\n",
                pod.namespace
            ),
        )?;
        std::fs::write(files.join("termination-log"), "")?;
        let mut mounts = vec![
            BindMount {
                source: files.join("hosts"),
                destination: "/etc/hosts".into(),
                read_only: false,
            },
            BindMount {
                source: files.join("hostname"),
                destination: "/etc/hostname".into(),
                read_only: false,
            },
            BindMount {
                source: files.join("resolv.conf"),
                destination: "/etc/resolv.conf".into(),
                read_only: false,
            },
            BindMount {
                source: files.join("termination-log"),
                destination: container
                    .termination_message_path
                    .clone()
                    .unwrap_or_else(|| "/dev/termination-log".into()),
                read_only: false,
            },
        ];
        mounts.extend(prepare_volumes(admin, pod, container, &bundle.join("volumes")).await?);

        let caps = capabilities(container);
        let seccomp = if seccomp_type(&pod.spec, container) == "RuntimeDefault" {
            let text = run(Command::new(&tools.seccomp_default).args(&caps))?;
            Some(serde_json::from_str::<Value>(&text).context("seccomp-default's output")?)
        } else {
            None
        };
        let inputs = PlanInputs {
            image: &image.config,
            passwd: &passwd,
            api: &api,
            node_memory: host_memory(),
            seccomp,
            mounts,
            cgroups_path: format!("gpu-operator-runc/{id}"),
        };
        let (config, limits) = plan(pod, container, &inputs)?;
        std::fs::write(
            bundle.join("config.json"),
            serde_json::to_vec_pretty(&config)?,
        )?;

        let file = std::fs::File::create(&log)?;
        let mut command = Command::new(&tools.netns_run);
        command
            .arg("--forward")
            .arg(format!("{}:{}", api.host, api.port))
            .arg("--")
            .arg(&tools.runc)
            .arg("--root")
            .arg(&state_root)
            .arg("run")
            .arg("--bundle")
            .arg(&bundle)
            .arg(&id)
            .stdout(file.try_clone()?)
            .stderr(file)
            .stdin(Stdio::null());
        let child = command
            .spawn()
            .with_context(|| format!("starting {command:?}"))?;
        let mut running = RunningContainer {
            id,
            pid: 0,
            child: Some(child),
            tools: tools.clone(),
            state_root,
            bundle,
            log,
            limits,
            config,
            probes: Arc::default(),
            stop: Arc::default(),
            poller: None,
            last_stats: Mutex::new(None),
        };
        running.pid = running.await_running(Duration::from_secs(30))?;
        let stats = cgroup_stats(running.pid)?;
        let missing = unenforced(&running.limits, &stats);
        if !missing.is_empty() {
            bail!(
                "LIMITS NOT ENFORCED for container {} (pod {}/{}): {}",
                container.name,
                pod.namespace,
                pod.name,
                missing.join("; ")
            );
        }
        *running
            .last_stats
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(stats);
        let probes = probes(container)?;
        let (pid, report, stop) = (running.pid, running.probes.clone(), running.stop.clone());
        running.poller = Some(std::thread::spawn(move || {
            poll_probes(pid, probes, report, stop)
        }));
        Ok(running)
    }

    /// `runc state`: the container's status and init pid.
    fn state(&self) -> Result<(String, u32)> {
        let text = run(Command::new(&self.tools.runc)
            .arg("--root")
            .arg(&self.state_root)
            .arg("state")
            .arg(&self.id))?;
        let v: Value = serde_json::from_str(&text)?;
        Ok((
            v["status"].as_str().unwrap_or_default().to_owned(),
            v["pid"].as_u64().unwrap_or_default() as u32,
        ))
    }

    /// Waits until runc reports the container running; its pid.
    fn await_running(&mut self, timeout: Duration) -> Result<u32> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok((status, pid)) = self.state()
                && status == "running"
                && pid > 0
            {
                return Ok(pid);
            }
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                self.child = None;
                bail!(
                    "the container exited before it ran ({status}):\n{}",
                    self.log_text()
                );
            }
            ensure!(
                Instant::now() < deadline,
                "the container did not start within {timeout:?}:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The probes' report so far.
    pub fn probe_report(&self) -> ProbeReport {
        self.probes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Waits until the readiness probe passes; fails when the container exits or a liveness
    /// probe reaches its failure threshold first.
    pub async fn await_ready(&mut self, timeout: Duration) -> Result<ProbeReport> {
        let deadline = Instant::now() + timeout;
        loop {
            let report = self.probe_report();
            if let Some(r) = &report.restart_due {
                bail!("{r}; probes: {report}");
            }
            if report.ready {
                return Ok(report);
            }
            ensure!(
                self.is_running(),
                "the container exited before it was ready; probes: {report}:\n{}",
                self.log_text()
            );
            ensure!(
                Instant::now() < deadline,
                "not ready within {timeout:?}; probes: {report}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The cgroup's figures now (the last reading once the container is gone).
    pub fn cgroup_stats(&self) -> Result<CgroupStats> {
        let mut last = self
            .last_stats
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match cgroup_stats(self.pid) {
            Ok(s) => {
                *last = Some(s.clone());
                Ok(s)
            }
            Err(e) => last.clone().with_context(|| format!("{e:#}")),
        }
    }

    /// Whether the container still runs.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Sends `signal` (`TERM`, `KILL`) to the container's init process through runc.
    pub fn signal(&self, signal: &str) -> Result<()> {
        run(Command::new(&self.tools.runc)
            .arg("--root")
            .arg(&self.state_root)
            .arg("kill")
            .arg(&self.id)
            .arg(signal))?;
        Ok(())
    }

    /// Waits for the container to exit; its exit code (128 + signal when killed).
    pub fn wait(&mut self, timeout: Duration) -> Result<Option<i32>> {
        let Some(child) = self.child.as_mut() else {
            return Ok(None);
        };
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait()? {
                self.child = None;
                return Ok(status.code());
            }
            ensure!(
                Instant::now() < deadline,
                "container {} did not exit within {timeout:?}",
                self.id
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGTERM, as the kubelet stops a container, and the exit code.
    pub fn terminate(&mut self, timeout: Duration) -> Result<Option<i32>> {
        if self.child.is_some() {
            let _ = self.cgroup_stats();
            self.signal("TERM")?;
        }
        self.wait(timeout)
    }

    /// SIGKILL, then runc's record and the bundle removed.
    pub fn kill(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if self.child.is_some() {
            let _ = self.cgroup_stats();
            let _ = self.signal("KILL");
            let _ = self.wait(Duration::from_secs(10));
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = Command::new(&self.tools.runc)
            .arg("--root")
            .arg(&self.state_root)
            .args(["delete", "--force", &self.id])
            .output();
        if let Some(poller) = self.poller.take() {
            let _ = poller.join();
        }
        let _ = std::fs::remove_dir_all(self.bundle.parent().unwrap_or(&self.bundle));
    }
}

impl Drop for RunningContainer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Writes a line to stderr unbuffered (what the runner reports goes beside the test's output).
pub fn report(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "container: {line}");
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use k8s_openapi::api::core::v1::PodSpec;

    fn container(v: Value) -> Container {
        serde_json::from_value(v).unwrap()
    }

    fn image() -> ImageConfig {
        ImageConfig {
            user: Some("65532:65532".into()),
            entrypoint: Some(vec!["/usr/local/bin/gpu-operator".into()]),
            cmd: None,
            env: Some(vec![
                "PATH=/usr/bin:/bin".into(),
                "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt".into(),
            ]),
            working_dir: Some("/".into()),
        }
    }

    fn pod_spec(v: Value) -> PodSpec {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn quantities_parse_as_the_api_writes_them() {
        assert_eq!(parse_bytes("350Mi").unwrap(), 350 * 1024 * 1024);
        assert_eq!(parse_bytes("1G").unwrap(), 1_000_000_000);
        assert_eq!(parse_bytes("128974848").unwrap(), 128_974_848);
        assert!(parse_bytes("lots").is_err());
        assert_eq!(parse_millicpu("500m").unwrap(), 500);
        assert_eq!(parse_millicpu("1.5").unwrap(), 1500);
        assert_eq!(parse_millicpu("2").unwrap(), 2000);
    }

    #[test]
    fn limits_become_quota_shares_and_the_burstable_oom_score() {
        let c = container(json!({"name": "c", "resources": {
            "limits": {"cpu": "500m", "memory": "350Mi"}, "requests": {"cpu": "200m", "memory": "100Mi"}}}));
        let l = limits(&c, 1024 * 1024 * 1024).unwrap();
        assert_eq!(l.memory_bytes, Some(350 * 1024 * 1024));
        assert_eq!(l.cpu_quota_us, Some(50_000));
        assert_eq!(l.cpu_shares, Some(204));
        // 1000 - 1000 * 100 MiB / 1 GiB
        assert_eq!(l.oom_score_adj, 903);
        let g =
            container(json!({"name": "c", "resources": {"limits": {"cpu": "1", "memory": "1Gi"}}}));
        assert_eq!(limits(&g, 1 << 34).unwrap().oom_score_adj, -997);
        assert_eq!(
            limits(&container(json!({"name": "c"})), 1 << 34).unwrap(),
            Limits {
                oom_score_adj: 1000,
                ..Limits::default()
            }
        );
    }

    #[test]
    fn the_user_comes_from_the_security_context_else_the_image_and_root_is_refused_when_non_root() {
        let c = container(json!({"name": "c"}));
        let spec = pod_spec(
            json!({"containers": [], "securityContext": {"runAsNonRoot": true, "runAsUser": 65532}}),
        );
        assert_eq!(
            resolve_user(&spec, &c, &image(), "").unwrap(),
            User {
                uid: 65532,
                gid: 0,
                additional_gids: vec![]
            }
        );
        let passwd = "root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532::/home/nonroot:/sbin/nologin\n";
        assert_eq!(
            resolve_user(&spec, &c, &image(), passwd).unwrap().gid,
            65532
        );
        let no_user =
            pod_spec(json!({"containers": [], "securityContext": {"runAsNonRoot": true}}));
        assert_eq!(
            resolve_user(&no_user, &c, &image(), "").unwrap(),
            User {
                uid: 65532,
                gid: 65532,
                additional_gids: vec![]
            }
        );
        let root_image = ImageConfig {
            user: None,
            ..image()
        };
        let e = resolve_user(&no_user, &c, &root_image, "")
            .unwrap_err()
            .to_string();
        assert!(e.contains("runAsNonRoot and image will run as root"), "{e}");
        let named = ImageConfig {
            user: Some("nonroot".into()),
            ..image()
        };
        let e = resolve_user(&no_user, &c, &named, passwd)
            .unwrap_err()
            .to_string();
        assert!(e.contains("non-numeric user (nonroot)"), "{e}");
        let zero = pod_spec(
            json!({"containers": [], "securityContext": {"runAsNonRoot": true, "runAsUser": 0}}),
        );
        assert!(
            resolve_user(&zero, &c, &image(), "")
                .unwrap_err()
                .to_string()
                .contains("breaks non-root policy")
        );
    }

    #[test]
    fn capabilities_start_from_containerds_defaults() {
        let none =
            container(json!({"name": "c", "securityContext": {"capabilities": {"drop": ["ALL"]}}}));
        assert!(capabilities(&none).is_empty());
        let some = container(
            json!({"name": "c", "securityContext": {"capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}}),
        );
        assert_eq!(capabilities(&some), ["CAP_NET_BIND_SERVICE"]);
        let default = capabilities(&container(
            json!({"name": "c", "securityContext": {"capabilities": {"drop": ["NET_RAW"]}}}),
        ));
        assert_eq!(default.len(), DEFAULT_CAPS.len() - 1);
        assert!(!default.contains(&"CAP_NET_RAW".to_owned()));
    }

    #[test]
    fn command_replaces_the_entrypoint_and_references_expand() {
        let env = vec![("NS".to_owned(), "gpu".to_owned())];
        let c = container(
            json!({"name": "c", "command": ["gpu-operator"], "args": ["run", "--ns=$(NS)", "$$(NS)", "$(MISSING)"]}),
        );
        assert_eq!(
            process_args(&c, &image(), &env).unwrap(),
            ["gpu-operator", "run", "--ns=gpu", "$(NS)", "$(MISSING)"]
        );
        let only_args = container(json!({"name": "c", "args": ["version"]}));
        assert_eq!(
            process_args(&only_args, &image(), &env).unwrap(),
            ["/usr/local/bin/gpu-operator", "version"]
        );
    }

    #[test]
    fn env_resolves_field_refs_after_the_image_and_service_variables() {
        let pod = PodContext::rendered(
            "gpu-operator",
            "gpu-operator-abc",
            pod_spec(json!({"containers": []})),
        );
        let c = container(json!({"name": "c", "env": [
            {"name": "OPERATOR_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "PATH", "value": "/x:$(PATH)"}]}));
        let api = ApiServer {
            host: "127.0.0.1".into(),
            port: 19402,
        };
        let env: BTreeMap<String, String> = environment(&pod, &c, &image(), &api)
            .unwrap()
            .into_iter()
            .collect();
        assert_eq!(env["OPERATOR_NAMESPACE"], "gpu-operator");
        assert_eq!(env["POD_NAME"], "gpu-operator-abc");
        assert_eq!(env["KUBERNETES_SERVICE_HOST"], "127.0.0.1");
        assert_eq!(env["KUBERNETES_SERVICE_PORT"], "19402");
        assert_eq!(env["PATH"], "/x:/usr/bin:/bin");
        let secret = container(
            json!({"name": "c", "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}),
        );
        assert!(environment(&pod, &secret, &image(), &api).is_err());
    }

    #[test]
    fn probes_resolve_named_ports() {
        let c = container(
            json!({"name": "c", "ports": [{"name": "health", "containerPort": 8081}],
            "livenessProbe": {"httpGet": {"path": "/healthz", "port": "health"}, "initialDelaySeconds": 5, "periodSeconds": 10},
            "readinessProbe": {"httpGet": {"path": "/readyz", "port": "health"}, "periodSeconds": 5}}),
        );
        let p = probes(&c).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(
            (
                p[0].kind,
                p[0].port,
                p[0].path.as_str(),
                p[0].failure_threshold
            ),
            ("liveness", 8081, "/healthz", 3)
        );
        assert_eq!(
            (p[1].kind, p[1].period),
            ("readiness", Duration::from_secs(5))
        );
        let wrong =
            container(json!({"name": "c", "readinessProbe": {"httpGet": {"port": "metrics"}}}));
        assert!(probes(&wrong).is_err());
        let exec =
            container(json!({"name": "c", "readinessProbe": {"exec": {"command": ["true"]}}}));
        assert!(probes(&exec).is_err());
    }

    #[test]
    fn the_runtime_config_carries_the_security_context() {
        let pod = PodContext::rendered(
            "ns",
            "pod",
            pod_spec(json!({"containers": [],
            "securityContext": {"runAsNonRoot": true, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"}}})),
        );
        let c = container(
            json!({"name": "c", "command": ["gpu-operator"], "args": ["run"],
            "resources": {"limits": {"cpu": "500m", "memory": "350Mi"}},
            "securityContext": {"allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true, "capabilities": {"drop": ["ALL"]}}}),
        );
        let api = ApiServer {
            host: "127.0.0.1".into(),
            port: 1,
        };
        let profile = json!({"defaultAction": "SCMP_ACT_ERRNO"});
        let inputs = PlanInputs {
            image: &image(),
            passwd: "",
            api: &api,
            node_memory: 1 << 34,
            seccomp: Some(profile.clone()),
            mounts: vec![],
            cgroups_path: "x/y".into(),
        };
        let (config, limits) = plan(&pod, &c, &inputs).unwrap();
        assert_eq!(config["process"]["user"]["uid"], 65532);
        assert_eq!(config["process"]["noNewPrivileges"], true);
        assert_eq!(config["process"]["capabilities"]["bounding"], json!([]));
        assert_eq!(config["root"]["readonly"], true);
        assert_eq!(config["linux"]["seccomp"], profile);
        assert_eq!(
            config["linux"]["resources"]["memory"]["limit"],
            350 * 1024 * 1024
        );
        assert_eq!(config["linux"]["resources"]["cpu"]["quota"], 50_000);
        assert_eq!(limits.cpu_quota_us, Some(50_000));
        assert!(
            config["linux"]["namespaces"]
                .as_array()
                .unwrap()
                .iter()
                .all(|n| n["type"] != "network")
        );
        let host = PodContext::rendered(
            "ns",
            "pod",
            pod_spec(json!({"containers": [], "hostNetwork": true})),
        );
        assert!(plan(&host, &c, &inputs).is_err());
        let no_profile = PlanInputs {
            seccomp: None,
            ..inputs
        };
        assert!(plan(&pod, &c, &no_profile).is_err());
    }

    #[test]
    fn a_limit_the_cgroup_does_not_hold_is_named() {
        let want = Limits {
            memory_bytes: Some(350 << 20),
            cpu_quota_us: Some(50_000),
            ..Limits::default()
        };
        let held = CgroupStats {
            version: "v1".into(),
            memory_limit_bytes: Some(350 << 20),
            cpu_quota_us: Some(50_000),
            cpu_period_us: Some(100_000),
            ..CgroupStats::default()
        };
        assert!(unenforced(&want, &held).is_empty());
        let none = CgroupStats {
            version: "v1".into(),
            ..CgroupStats::default()
        };
        let missing = unenforced(&want, &none);
        assert_eq!(missing.len(), 2, "{missing:?}");
    }
}
