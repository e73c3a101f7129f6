//! Real Node Feature Discovery on the harness: `nfd-master` and `nfd-worker`, built
//! from NFD's Go module at the version the operator deploys (tests/cluster/build.sh), run for
//! the pods of the NFD Deployment and DaemonSet the operator applied. kwok only marks those pods
//! running; [`RealNfd`] runs their containers as a kubelet would, from the live pod: command,
//! args and env of its spec (downward API resolved against the pod), its ConfigMap volumes and
//! service-account token (so each binary acts as the rendered ServiceAccount), and its hostPath
//! volumes from a fake host folder per node whose sysfs holds the node's PCI devices (an NVIDIA
//! board on GPU nodes). Each runs under `pod-sandbox` (tests/cluster/go/nfd): own network and
//! mount namespaces, chrooted into a prepared root, the API server at 127.0.0.1 through a unix
//! socket, as the image's user.

use crate::tools::on_path;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use gpu_operator::controller::vendored_crds;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Container, KeyToPath, Node, Pod, Volume};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, ListParams};
use kube::config::Kubeconfig;
use kube::{Client, ResourceExt};

use crate::cluster::{harness_dir, service_account_token, unique_name};
use crate::nodes::FakeNode;
use crate::wait;

/// The Deployment and DaemonSet names the operator renders for NFD.
pub const MASTER: &str = "node-feature-discovery-master";
pub const WORKER: &str = "node-feature-discovery-worker";
/// The user NFD's image runs as (`USER 65534:65534` in NFD's Dockerfile).
const IMAGE_USER: (i64, i64) = (65534, 65534);
/// Where a container finds its service-account token, CA and namespace.
const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
const TIMEOUT: Duration = Duration::from_secs(120);

/// Deletes NFD's three CRDs (their NodeFeature objects go with them) and waits until they are
/// gone, so that what installs them next is seen doing it.
pub async fn delete_crds(client: &Client) -> Result<()> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in vendored_crds::NAMES {
        match api.delete(name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e).with_context(|| format!("deleting CRD {name}")),
        }
    }
    wait::until(TIMEOUT, "NFD's CRDs gone", || {
        let api = api.clone();
        async move {
            let mut left = Vec::new();
            for name in vendored_crds::NAMES {
                if api.get_opt(name).await?.is_some() {
                    left.push(name);
                }
            }
            Ok(if left.is_empty() {
                Ok(())
            } else {
                Err(format!("{left:?}"))
            })
        }
    })
    .await
}

/// Waits until no node carries an NFD master's annotations: the nodes a real NFD labelled must
/// be gone before the next operator starts, or it takes NFD for running already (decision 16).
pub async fn await_no_annotated_nodes(client: &Client) -> Result<()> {
    let api: Api<Node> = Api::all(client.clone());
    wait::until(TIMEOUT, "no node annotated by an NFD master", || {
        let api = api.clone();
        async move {
            let annotated: Vec<String> = api
                .list_metadata(&ListParams::default())
                .await?
                .items
                .into_iter()
                .filter(|n| gpu_operator::nodes::nfd_annotated(n.metadata.annotations.as_ref()))
                .map(|n| n.name_any())
                .collect();
            Ok(if annotated.is_empty() {
                Ok(())
            } else {
                Err(format!("{annotated:?}"))
            })
        }
    })
    .await
}

/// A fake PCI device in sysfs: address, vendor, device, class (as sysfs writes them).
struct PciDevice {
    address: &'static str,
    vendor: &'static str,
    device: &'static str,
    class: String,
}

/// The PCI devices of a fake node: a host bridge, a network card and, on GPU nodes, the board.
fn pci_devices(node: &FakeNode) -> Vec<PciDevice> {
    let mut devices = vec![
        PciDevice {
            address: "0000:00:00.0",
            vendor: "0x8086",
            device: "0x1237",
            class: "0x060000".into(),
        },
        // Amazon's ENA, on a class NFD's worker config lists: CPU nodes get a PCI label too.
        PciDevice {
            address: "0000:00:05.0",
            vendor: "0x1d0f",
            device: "0xec20",
            class: "0x020000".into(),
        },
    ];
    if let Some((device, class)) = node.gpu_pci() {
        devices.push(PciDevice {
            address: "0000:00:1e.0",
            vendor: "0x10de",
            device,
            class,
        });
    }
    devices
}

/// Writes the host folder a node's hostPath volumes come from: `sys/bus/pci/devices/*` with the
/// attributes NFD's pci source reads, `etc/os-release`, `proc/swaps`, and the empty folders the
/// worker mounts (`boot`, `lib`, `usr/lib`, NFD's `features.d`) or lists.
pub fn write_fake_host(host: &Path, node: &FakeNode) -> Result<()> {
    // The sysfs folders NFD's other sources list, empty: they find nothing instead of failing.
    for dir in [
        "boot",
        "lib",
        "usr/lib",
        "proc",
        "etc/kubernetes/node-feature-discovery/features.d",
        "sys/block",
        "sys/bus/cpu/devices",
        "sys/bus/node/devices",
        "sys/class/net",
        "sys/devices/system/cpu",
        "sys/fs",
    ] {
        std::fs::create_dir_all(host.join(dir))?;
    }
    for dev in pci_devices(node) {
        let path = host.join("sys/bus/pci/devices").join(dev.address);
        std::fs::create_dir_all(&path)?;
        for (attr, value) in [
            ("vendor", dev.vendor),
            ("device", dev.device),
            ("class", dev.class.as_str()),
            ("subsystem_vendor", dev.vendor),
            ("subsystem_device", dev.device),
        ] {
            std::fs::write(path.join(attr), format!("{value}\n"))?;
        }
    }
    let (id, version) = &node.os;
    std::fs::write(
        host.join("etc/os-release"),
        format!("ID={id}\nVERSION_ID=\"{version}\"\nNAME=\"{id}\"\n"),
    )?;
    std::fs::write(
        host.join("proc/swaps"),
        "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n",
    )?;
    Ok(())
}

/// One running container of a pod; killed when dropped.
pub struct PodProcess {
    pub pod: String,
    pub node: String,
    pub log: PathBuf,
    child: Option<Child>,
}

impl PodProcess {
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether it still runs (a binary that exits on a bad flag or a denied request shows here).
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for PodProcess {
    fn drop(&mut self) {
        // The sandbox's children die with it (parent-death signal).
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// nfd-master and the nfd-workers of the given nodes, running; stopped when dropped.
pub struct RealNfd {
    pub dir: PathBuf,
    pub pods: Vec<PodProcess>,
}

impl RealNfd {
    /// Runs the NFD master pod and the worker pods on `nodes` (each with a fake host written
    /// from its [`FakeNode`]) that the operator's objects in `namespace` got.
    pub async fn start(admin: &Client, namespace: &str, nodes: &[FakeNode]) -> Result<Self> {
        let dir = harness_dir()?.join(unique_name("nfd"));
        std::fs::create_dir_all(&dir)?;
        let api_port = api_server_port()?;
        let mut nfd = RealNfd {
            dir: dir.clone(),
            pods: Vec::new(),
        };
        let master = Api::<Deployment>::namespaced(admin.clone(), namespace)
            .get(MASTER)
            .await
            .with_context(|| format!("reading the operator's Deployment {namespace}/{MASTER}"))?;
        let selector = master
            .spec
            .and_then(|s| s.selector.match_labels)
            .context("the NFD master Deployment has no matchLabels")?;
        let pod = running_pod(admin, namespace, &selector, None).await?;
        let master_node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
        let host = dir
            .join("hosts")
            .join(master_node.as_deref().unwrap_or("none"));
        std::fs::create_dir_all(&host)?;
        nfd.pods
            .push(run_pod(admin, &pod, &host, &dir, api_port, 0).await?);
        nfd.add_workers(admin, namespace, nodes).await?;
        Ok(nfd)
    }

    /// Runs the worker pods the DaemonSet placed on `nodes` (for nodes that joined after
    /// [`RealNfd::start`]); fails when the DaemonSet puts no running pod on one of them.
    pub async fn add_workers(
        &mut self,
        admin: &Client,
        namespace: &str,
        nodes: &[FakeNode],
    ) -> Result<()> {
        let api_port = api_server_port()?;
        let worker = Api::<DaemonSet>::namespaced(admin.clone(), namespace)
            .get(WORKER)
            .await
            .with_context(|| format!("reading the operator's DaemonSet {namespace}/{WORKER}"))?;
        let selector = worker
            .spec
            .and_then(|s| s.selector.match_labels)
            .context("the NFD worker DaemonSet has no matchLabels")?;
        for node in nodes {
            let host = self.dir.join("hosts").join(&node.name);
            write_fake_host(&host, node)?;
            let pod = running_pod(admin, namespace, &selector, Some(&node.name)).await?;
            let index = self.pods.len();
            self.pods
                .push(run_pod(admin, &pod, &host, &self.dir, api_port, index).await?);
        }
        Ok(())
    }

    /// Every process's log, for assertion messages.
    pub fn logs(&self) -> String {
        self.pods
            .iter()
            .map(|p| format!("--- {} on {}:\n{}", p.pod, p.node, p.log_text()))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Fails naming the process and its log if any has exited.
    pub fn ensure_running(&mut self) -> Result<()> {
        for p in &mut self.pods {
            if !p.is_running() {
                bail!("{} on {} exited:\n{}", p.pod, p.node, p.log_text());
            }
        }
        Ok(())
    }
}

impl Drop for RealNfd {
    fn drop(&mut self) {
        self.pods.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The API server port of the admin kubeconfig (the sandboxes offer it inside on 127.0.0.1).
fn api_server_port() -> Result<u16> {
    let kubeconfig = Kubeconfig::read().context("reading KUBECONFIG")?;
    let server = kubeconfig
        .clusters
        .iter()
        .find_map(|c| c.cluster.as_ref()?.server.clone())
        .context("the kubeconfig names no server")?;
    server_port(&server)
}

/// The port of a server address such as `https://127.0.0.1:16402`.
fn server_port(server: &str) -> Result<u16> {
    server
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .with_context(|| format!("no port in server address {server}"))
}

/// The running pod with `labels` (on `node` when given), waited for.
async fn running_pod(
    admin: &Client,
    namespace: &str,
    labels: &BTreeMap<String, String>,
    node: Option<&str>,
) -> Result<Pod> {
    let selector = labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let mut params = ListParams::default().labels(&selector);
    if let Some(node) = node {
        params = params.fields(&format!("spec.nodeName={node}"));
    }
    let pods: Api<Pod> = Api::namespaced(admin.clone(), namespace);
    let what = format!("a running pod {selector} on {}", node.unwrap_or("any node"));
    wait::until(TIMEOUT, &what, || {
        let (pods, params) = (pods.clone(), params.clone());
        async move {
            let list = pods.list(&params).await?.items;
            Ok(list
                .into_iter()
                .find(|p| {
                    p.metadata.deletion_timestamp.is_none()
                        && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                })
                .ok_or_else(|| "none yet".to_owned()))
        }
    })
    .await
}

/// How a volume reaches the container: a folder bind-mounted, or files written in place.
enum VolumeSource {
    Bind(PathBuf),
    Files(Vec<(String, Vec<u8>)>),
}

/// A downward-API field of the pod.
fn pod_field(pod: &Pod, path: &str) -> Result<String> {
    let spec = pod.spec.as_ref();
    let value = match path {
        "metadata.name" => Some(pod.name_any()),
        "metadata.namespace" => pod.namespace(),
        "metadata.uid" => pod.uid(),
        "spec.nodeName" => spec.and_then(|s| s.node_name.clone()),
        "spec.serviceAccountName" => spec.and_then(|s| s.service_account_name.clone()),
        other => bail!("downward-API field {other} is not supported by the harness's pod runner"),
    };
    value.with_context(|| format!("pod {} has no {path}", pod.name_any()))
}

/// The items of a ConfigMap (`items` when given, else every key), as files.
async fn config_map_files(
    admin: &Client,
    namespace: &str,
    name: &str,
    items: Option<&Vec<KeyToPath>>,
) -> Result<Vec<(String, Vec<u8>)>> {
    let cm = Api::<ConfigMap>::namespaced(admin.clone(), namespace)
        .get(name)
        .await
        .with_context(|| format!("reading ConfigMap {namespace}/{name}"))?;
    let data = cm.data.unwrap_or_default();
    let pairs: Vec<(String, String)> = match items {
        Some(items) => items
            .iter()
            .map(|i| (i.key.clone(), i.path.clone()))
            .collect(),
        None => data.keys().map(|k| (k.clone(), k.clone())).collect(),
    };
    pairs
        .into_iter()
        .map(|(key, path)| {
            let value = data
                .get(&key)
                .with_context(|| format!("ConfigMap {namespace}/{name} has no key {key}"))?;
            Ok((path, value.clone().into_bytes()))
        })
        .collect()
}

async fn volume_source(
    admin: &Client,
    pod: &Pod,
    volume: &Volume,
    host: &Path,
) -> Result<VolumeSource> {
    let namespace = pod.namespace().unwrap_or_default();
    if let Some(host_path) = &volume.host_path {
        let path = host.join(host_path.path.trim_start_matches('/'));
        anyhow::ensure!(
            path.exists(),
            "hostPath {} of volume {} is not in the fake host {}",
            host_path.path,
            volume.name,
            host.display()
        );
        return Ok(VolumeSource::Bind(path));
    }
    if let Some(cm) = &volume.config_map {
        let files = config_map_files(admin, &namespace, &cm.name, cm.items.as_ref()).await?;
        return Ok(VolumeSource::Files(files));
    }
    if let Some(projected) = &volume.projected {
        // What the ServiceAccount admission adds to every pod: token, CA, namespace.
        let mut files = Vec::new();
        for source in projected.sources.iter().flatten() {
            if let Some(token) = &source.service_account_token {
                let account = pod_field(pod, "spec.serviceAccountName")?;
                let value = service_account_token(admin, &namespace, &account).await?;
                files.push((token.path.clone(), value.into_bytes()));
            }
            if let Some(cm) = &source.config_map {
                files.extend(
                    config_map_files(admin, &namespace, &cm.name, cm.items.as_ref()).await?,
                );
            }
            for item in source
                .downward_api
                .iter()
                .flat_map(|d| d.items.iter().flatten())
            {
                let field = item
                    .field_ref
                    .as_ref()
                    .with_context(|| format!("downward-API item {} has no fieldRef", item.path))?;
                files.push((
                    item.path.clone(),
                    pod_field(pod, &field.field_path)?.into_bytes(),
                ));
            }
        }
        return Ok(VolumeSource::Files(files));
    }
    bail!(
        "volume {} of pod {}: only hostPath, configMap and projected volumes are supported by the harness's pod runner",
        volume.name,
        pod.name_any()
    )
}

/// The container's environment: its `env` (values and downward-API fields) plus what the
/// kubelet adds (the API server's service address, HOSTNAME, PATH).
fn container_env(pod: &Pod, container: &Container, api_port: u16) -> Result<Vec<(String, String)>> {
    let mut env = vec![
        ("PATH".to_owned(), "/usr/local/bin:/usr/bin:/bin".to_owned()),
        ("HOSTNAME".to_owned(), pod.name_any()),
        ("KUBERNETES_SERVICE_HOST".to_owned(), "127.0.0.1".to_owned()),
        ("KUBERNETES_SERVICE_PORT".to_owned(), api_port.to_string()),
    ];
    for var in container.env.iter().flatten() {
        let value = match (&var.value, &var.value_from) {
            (Some(value), _) => value.clone(),
            (None, Some(from)) => {
                let field = from.field_ref.as_ref().with_context(|| {
                    format!(
                        "env {} of {}: only fieldRef is supported by the harness's pod runner",
                        var.name, container.name
                    )
                })?;
                pod_field(pod, &field.field_path)?
            }
            (None, None) => String::new(),
        };
        env.push((var.name.clone(), value));
    }
    Ok(env)
}

/// Creates the mount point for `source` at `target` (a file for a file, else a folder).
fn mount_point(source: &Path, target: &Path) -> Result<()> {
    if source.is_file() {
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(target, b"")?;
    } else {
        std::fs::create_dir_all(target)?;
    }
    Ok(())
}

/// Runs the first container of `pod` under pod-sandbox; `index` keeps its folder and socket
/// names short (a unix socket path has at most 107 bytes).
async fn run_pod(
    admin: &Client,
    pod: &Pod,
    host: &Path,
    dir: &Path,
    api_port: u16,
    index: usize,
) -> Result<PodProcess> {
    let name = pod.name_any();
    let spec = pod.spec.as_ref().context("pod without spec")?;
    let container = spec
        .containers
        .first()
        .with_context(|| format!("pod {name} has no container"))?;
    let root = dir.join(format!("{index}.root"));
    std::fs::create_dir_all(&root)?;
    let mut binds: Vec<String> = Vec::new();
    let mut mounted: Vec<&str> = Vec::new();
    for mount in container.volume_mounts.iter().flatten() {
        anyhow::ensure!(
            mount.sub_path.is_none(),
            "subPath mounts are not supported by the harness's pod runner ({name})"
        );
        let volume = spec
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == mount.name)
            .with_context(|| format!("pod {name} mounts volume {} it lacks", mount.name))?;
        let target = root.join(mount.mount_path.trim_start_matches('/'));
        match volume_source(admin, pod, volume, host).await? {
            VolumeSource::Bind(source) => {
                mount_point(&source, &target)?;
                let ro = if mount.read_only == Some(true) {
                    ":ro"
                } else {
                    ""
                };
                binds.push(format!("{}:{}{ro}", source.display(), mount.mount_path));
            }
            VolumeSource::Files(files) => {
                for (path, content) in files {
                    let file = target.join(path);
                    if let Some(parent) = file.parent() {
                        std::fs::create_dir_all(parent)?;
                    }
                    std::fs::write(&file, content)?;
                }
            }
        }
        mounted.push(&mount.mount_path);
    }
    anyhow::ensure!(
        mounted.contains(&SERVICE_ACCOUNT_DIR),
        "pod {name} has no service-account token mounted at {SERVICE_ACCOUNT_DIR}"
    );
    let mut argv: Vec<String> = container.command.clone().unwrap_or_default();
    argv.extend(container.args.clone().unwrap_or_default());
    let program = argv
        .first()
        .with_context(|| format!("{name}: the harness needs the command in the pod spec"))?
        .clone();
    anyhow::ensure!(
        !argv.iter().any(|a| a.contains("$(")),
        "{name}: $(VAR) expansion is not supported by the harness's pod runner: {argv:?}"
    );
    let binary = on_path(&program)?;
    let in_root = format!("/usr/bin/{program}");
    mount_point(&binary, &root.join(in_root.trim_start_matches('/')))?;
    binds.push(format!("{}:{in_root}:ro", binary.display()));

    let context = container.security_context.as_ref();
    let pod_context = spec.security_context.as_ref();
    let uid = context
        .and_then(|c| c.run_as_user)
        .or(pod_context.and_then(|c| c.run_as_user))
        .unwrap_or(IMAGE_USER.0);
    let gid = context
        .and_then(|c| c.run_as_group)
        .or(pod_context.and_then(|c| c.run_as_group))
        .unwrap_or(IMAGE_USER.1);
    if context.and_then(|c| c.run_as_non_root) == Some(true) {
        anyhow::ensure!(uid != 0, "{name}: runAsNonRoot with user 0 would not start");
    }

    let log = dir.join(format!("{index}.log"));
    let file = std::fs::File::create(&log)?;
    let mut command = Command::new(on_path("pod-sandbox")?);
    command
        .env_clear()
        .envs(container_env(pod, container, api_port)?)
        .arg("-root")
        .arg(&root)
        .args(["-api-port", &api_port.to_string()])
        .arg("-socket")
        .arg(dir.join(format!("{index}.sock")))
        .args(["-user", &format!("{uid}:{gid}")]);
    for bind in &binds {
        command.args(["-bind", bind]);
    }
    let child = command
        .arg("--")
        .args(&argv)
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .spawn()
        .with_context(|| format!("starting pod-sandbox for {name}"))?;
    Ok(PodProcess {
        pod: name,
        node: pod_field(pod, "spec.nodeName").unwrap_or_default(),
        log,
        child: Some(child),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::nodes::GpuModel;
    use k8s_openapi::api::core::v1::{EnvVar, EnvVarSource, ObjectFieldSelector, PodSpec};
    use kube::api::ObjectMeta;

    fn read(host: &Path, path: &str) -> String {
        std::fs::read_to_string(host.join(path)).unwrap()
    }

    #[test]
    fn a_gpu_nodes_fake_sysfs_holds_an_nvidia_3d_controller_and_a_cpu_nodes_does_not() {
        let dir = std::env::temp_dir().join(unique_name("nfd-host-test"));
        let gpu = dir.join("gpu");
        write_fake_host(&gpu, &FakeNode::gpu("n", GpuModel::A100Sxm40Gb)).unwrap();
        let board = "sys/bus/pci/devices/0000:00:1e.0";
        assert_eq!(read(&gpu, &format!("{board}/vendor")), "0x10de\n");
        assert_eq!(read(&gpu, &format!("{board}/class")), "0x030200\n");
        assert_eq!(read(&gpu, &format!("{board}/device")), "0x20b0\n");
        assert!(read(&gpu, "etc/os-release").contains("ID=ubuntu"));

        let cpu = dir.join("cpu");
        write_fake_host(&cpu, &FakeNode::cpu("c")).unwrap();
        let vendors: Vec<String> = std::fs::read_dir(cpu.join("sys/bus/pci/devices"))
            .unwrap()
            .map(|d| std::fs::read_to_string(d.unwrap().path().join("vendor")).unwrap())
            .collect();
        assert_eq!(vendors.len(), 2);
        assert!(!vendors.contains(&"0x10de\n".to_owned()), "{vendors:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_api_server_port_is_read_from_the_kubeconfig_server_address() {
        assert_eq!(server_port("https://127.0.0.1:17402").unwrap(), 17402);
        assert_eq!(server_port("https://127.0.0.1:6443/").unwrap(), 6443);
        assert!(server_port("https://localhost").is_err());
    }

    fn field_env(name: &str, path: &str) -> EnvVar {
        EnvVar {
            name: name.into(),
            value_from: Some(EnvVarSource {
                field_ref: Some(ObjectFieldSelector {
                    field_path: path.into(),
                    api_version: None,
                }),
                ..EnvVarSource::default()
            }),
            value: None,
        }
    }

    #[test]
    fn downward_api_env_is_resolved_against_the_live_pod_and_the_api_server_is_on_loopback() {
        let pod = Pod {
            metadata: ObjectMeta {
                name: Some("worker-abc".into()),
                namespace: Some("ns".into()),
                uid: Some("1234".into()),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: Some("node-1".into()),
                ..PodSpec::default()
            }),
            status: None,
        };
        let container = Container {
            name: "nfd-worker".into(),
            env: Some(vec![
                field_env("NODE_NAME", "spec.nodeName"),
                field_env("POD_NAME", "metadata.name"),
                field_env("POD_UID", "metadata.uid"),
            ]),
            ..Container::default()
        };
        let env: BTreeMap<String, String> = container_env(&pod, &container, 17402)
            .unwrap()
            .into_iter()
            .collect();
        assert_eq!(env["NODE_NAME"], "node-1");
        assert_eq!(env["POD_NAME"], "worker-abc");
        assert_eq!(env["POD_UID"], "1234");
        assert_eq!(env["KUBERNETES_SERVICE_HOST"], "127.0.0.1");
        assert_eq!(env["KUBERNETES_SERVICE_PORT"], "17402");

        let unknown = Container {
            env: Some(vec![field_env("IP", "status.podIPs")]),
            ..container
        };
        let err = container_env(&pod, &unknown, 1).unwrap_err().to_string();
        assert!(err.contains("status.podIPs"), "{err}");
    }
}
