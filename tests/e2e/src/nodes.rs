//! Fake GPU nodes that look like real ones to the operator: the labels NFD and GFD put on them,
//! capacity, nodeInfo and the optional `nvidia.com/gpu` taint. kwok manages every node carrying
//! the `kwok.x-k8s.io/node=fake` annotation (heartbeats, Ready condition, pod lifecycle).

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, NodeSpec, NodeStatus, NodeSystemInfo, Taint};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};

/// Annotation kwok selects the nodes it manages by.
pub const KWOK_ANNOTATION: &str = "kwok.x-k8s.io/node";
/// Label on every node this module creates, so tests and scripts can find and remove them.
pub const FAKE_NODE_LABEL: &str = "gpu-operator.test/fake-node";
/// NFD's label for a PCI device of vendor 0x10de (NVIDIA) on the node.
pub const NFD_NVIDIA_PCI: &str = gpu_operator::nodes::NFD_GPU_LABELS[0];
/// All three NFD labels that mark an NVIDIA PCI device (any class, 3D controller, VGA): the
/// operator's own list.
pub const NFD_GPU_LABEL_KEYS: [&str; 3] = gpu_operator::nodes::NFD_GPU_LABELS;
/// Prefix of every label NFD writes.
pub const NFD_LABEL_PREFIX: &str = "feature.node.kubernetes.io/";
/// Prefix of the labels GFD (and the operator) write.
const GFD_LABEL_PREFIX: &str = "nvidia.com/";
/// The taint platform teams put on GPU pools and operands must tolerate.
pub const GPU_TAINT_KEY: &str = "nvidia.com/gpu";

/// GPU boards the fake fleet is made of, with the facts GFD would report for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GpuModel {
    T4,
    A100Sxm40Gb,
    A100Sxm80Gb,
    H100Sxm80Gb,
    H200,
    A30,
}

/// What GFD labels for one model: NVML product name (sanitised), memory in MiB, compute
/// capability, and the PCI class NFD sees (0302 = 3D controller, 0300 = VGA).
struct ModelFacts {
    product: &'static str,
    memory_mib: u32,
    compute: (u32, u32),
    family: &'static str,
    mig_capable: bool,
    gpus_per_node: u32,
    pci_class: &'static str,
}

impl GpuModel {
    /// The mix `nodes.sh` and the scale tests cycle through.
    pub const FLEET: [GpuModel; 3] = [GpuModel::T4, GpuModel::A100Sxm40Gb, GpuModel::H100Sxm80Gb];

    fn facts(self) -> ModelFacts {
        match self {
            GpuModel::T4 => ModelFacts {
                product: "Tesla-T4",
                memory_mib: 15360,
                compute: (7, 5),
                family: "turing",
                mig_capable: false,
                gpus_per_node: 1,
                pci_class: "0302",
            },
            GpuModel::A100Sxm40Gb => ModelFacts {
                product: "NVIDIA-A100-SXM4-40GB",
                memory_mib: 40960,
                compute: (8, 0),
                family: "ampere",
                mig_capable: true,
                gpus_per_node: 8,
                pci_class: "0302",
            },
            GpuModel::A100Sxm80Gb => ModelFacts {
                product: "NVIDIA-A100-SXM4-80GB",
                memory_mib: 81920,
                compute: (8, 0),
                family: "ampere",
                mig_capable: true,
                gpus_per_node: 8,
                pci_class: "0302",
            },
            GpuModel::H100Sxm80Gb => ModelFacts {
                product: "NVIDIA-H100-80GB-HBM3",
                memory_mib: 81559,
                compute: (9, 0),
                family: "hopper",
                mig_capable: true,
                gpus_per_node: 8,
                pci_class: "0302",
            },
            GpuModel::H200 => ModelFacts {
                product: "NVIDIA-H200",
                memory_mib: 143771,
                compute: (9, 0),
                family: "hopper",
                mig_capable: true,
                gpus_per_node: 8,
                pci_class: "0302",
            },
            GpuModel::A30 => ModelFacts {
                product: "NVIDIA-A30",
                memory_mib: 24576,
                compute: (8, 0),
                family: "ampere",
                mig_capable: true,
                gpus_per_node: 4,
                pci_class: "0302",
            },
        }
    }

    /// The value GFD writes to `nvidia.com/gpu.product`.
    pub fn product(self) -> &'static str {
        self.facts().product
    }

    /// The PCI device ID of the board (`/sys/bus/pci/devices/*/device`), from the PCI ID
    /// database; NFD's default labels do not include it, its PCI features do.
    pub fn pci_device_id(self) -> &'static str {
        match self {
            GpuModel::T4 => "0x1eb8",
            GpuModel::A100Sxm40Gb => "0x20b0",
            GpuModel::A100Sxm80Gb => "0x20b2",
            GpuModel::H100Sxm80Gb => "0x2330",
            GpuModel::H200 => "0x2335",
            GpuModel::A30 => "0x20b7",
        }
    }

    pub fn mig_capable(self) -> bool {
        self.facts().mig_capable
    }

    /// A short name for node names: `t4`, `a100-40gb`, ...
    pub fn slug(self) -> &'static str {
        match self {
            GpuModel::T4 => "t4",
            GpuModel::A100Sxm40Gb => "a100-40gb",
            GpuModel::A100Sxm80Gb => "a100-80gb",
            GpuModel::H100Sxm80Gb => "h100-80gb",
            GpuModel::H200 => "h200",
            GpuModel::A30 => "a30",
        }
    }
}

/// The container runtime a fake node reports in `status.nodeInfo.containerRuntimeVersion`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Runtime {
    Containerd,
    CriO,
    Docker,
}

impl Runtime {
    fn version(self) -> &'static str {
        match self {
            Runtime::Containerd => "containerd://2.1.0",
            Runtime::CriO => "cri-o://1.33.2",
            Runtime::Docker => "docker://28.2.2",
        }
    }
}

/// A fake node to create: a GPU node of one model, or a CPU-only node.
#[derive(Clone, Debug)]
pub struct FakeNode {
    pub name: String,
    pub gpu: Option<GpuModel>,
    pub tainted: bool,
    pub runtime: Runtime,
    /// NFD's `system-os_release.ID` and `VERSION_ID`.
    pub os: (String, String),
    /// Advertise `nvidia.com/gpu` in capacity, as a node whose device plugin already runs does.
    pub advertise_gpus: bool,
    /// Carry the labels NFD and GFD would have written (`feature.node.kubernetes.io/*`,
    /// `nvidia.com/*`); without them the node is as a fresh node joins, for real NFD to find.
    pub discovered: bool,
    pub extra_labels: BTreeMap<String, String>,
    /// `status.nodeInfo` values that differ from the defaults: the runtime's version string
    /// (instead of [`Runtime`]'s), the kubelet's (`v1.31.4+k3s1`) and the OS image.
    pub node_info: NodeInfoOverrides,
}

/// What a fake node reports in `status.nodeInfo` instead of the defaults.
#[derive(Clone, Debug, Default)]
pub struct NodeInfoOverrides {
    pub container_runtime_version: Option<String>,
    pub kubelet_version: Option<String>,
    pub os_image: Option<String>,
}

impl FakeNode {
    pub fn gpu(name: impl Into<String>, model: GpuModel) -> Self {
        FakeNode {
            name: name.into(),
            gpu: Some(model),
            tainted: false,
            runtime: Runtime::Containerd,
            os: ("ubuntu".into(), "22.04".into()),
            advertise_gpus: false,
            discovered: true,
            extra_labels: BTreeMap::new(),
            node_info: NodeInfoOverrides::default(),
        }
    }

    pub fn cpu(name: impl Into<String>) -> Self {
        FakeNode {
            gpu: None,
            ..FakeNode::gpu(name, GpuModel::T4)
        }
    }

    pub fn tainted(mut self, tainted: bool) -> Self {
        self.tainted = tainted;
        self
    }

    pub fn runtime(mut self, runtime: Runtime) -> Self {
        self.runtime = runtime;
        self
    }

    /// Without the labels NFD and GFD write, so that only real NFD can mark it a GPU node.
    pub fn undiscovered(mut self) -> Self {
        self.discovered = false;
        self
    }

    /// The board's PCI device ID and class as sysfs shows them (`0x20b0`, `0x030200`), for a
    /// fake sysfs that real NFD reads; `None` for a CPU node.
    pub fn gpu_pci(&self) -> Option<(&'static str, String)> {
        self.gpu
            .map(|m| (m.pci_device_id(), format!("0x{}00", m.facts().pci_class)))
    }

    /// Reports another OS through NFD's `system-os_release.ID` and `VERSION_ID` (and the
    /// node's `osImage`).
    pub fn os(mut self, id: &str, version: &str) -> Self {
        self.os = (id.to_owned(), version.to_owned());
        self
    }

    /// Reports this runtime and kubelet version in `status.nodeInfo`, as a distribution's node
    /// does (`containerd://1.7.23-k3s2`, `v1.31.4+k3s1`).
    pub fn reports(mut self, runtime_version: &str, kubelet_version: &str) -> Self {
        self.node_info.container_runtime_version = Some(runtime_version.to_owned());
        self.node_info.kubelet_version = Some(kubelet_version.to_owned());
        self
    }

    /// Reports this `status.nodeInfo.osImage` (a managed image such as Bottlerocket's).
    pub fn os_image(mut self, image: &str) -> Self {
        self.node_info.os_image = Some(image.to_owned());
        self
    }

    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.extra_labels.insert(key.into(), value.into());
        self
    }

    /// The Node object, status included (a Node created by POST keeps the status it was given).
    pub fn build(&self) -> Node {
        let (os_id, os_version) = &self.os;
        let kernel = "5.15.0-1071-aws";
        let mut labels: BTreeMap<String, String> = [
            ("kubernetes.io/os", "linux".to_string()),
            ("kubernetes.io/arch", "amd64".to_string()),
            ("kubernetes.io/hostname", self.name.clone()),
            (FAKE_NODE_LABEL, "true".to_string()),
            (
                "feature.node.kubernetes.io/system-os_release.ID",
                os_id.clone(),
            ),
            (
                "feature.node.kubernetes.io/system-os_release.VERSION_ID",
                os_version.clone(),
            ),
            (
                "feature.node.kubernetes.io/system-os_release.VERSION_ID.major",
                os_version.split('.').next().unwrap_or_default().to_string(),
            ),
            (
                "feature.node.kubernetes.io/kernel-version.full",
                kernel.to_string(),
            ),
            (
                "feature.node.kubernetes.io/kernel-version.major",
                "5".to_string(),
            ),
            (
                "feature.node.kubernetes.io/kernel-version.minor",
                "15".to_string(),
            ),
            (
                "feature.node.kubernetes.io/cpu-model.vendor_id",
                "Intel".to_string(),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();

        let mut capacity: BTreeMap<String, Quantity> = [
            ("cpu", "48"),
            ("memory", "192Gi"),
            ("pods", "110"),
            ("ephemeral-storage", "500Gi"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
        .collect();

        if let Some(model) = self.gpu {
            let f = model.facts();
            let gfd = [
                (NFD_NVIDIA_PCI.to_string(), "true".to_string()),
                (
                    format!(
                        "feature.node.kubernetes.io/pci-{}_10de.present",
                        f.pci_class
                    ),
                    "true".into(),
                ),
                ("nvidia.com/gpu.product".into(), f.product.into()),
                ("nvidia.com/gpu.memory".into(), f.memory_mib.to_string()),
                ("nvidia.com/gpu.count".into(), f.gpus_per_node.to_string()),
                ("nvidia.com/gpu.family".into(), f.family.into()),
                (
                    "nvidia.com/gpu.compute.major".into(),
                    f.compute.0.to_string(),
                ),
                (
                    "nvidia.com/gpu.compute.minor".into(),
                    f.compute.1.to_string(),
                ),
                ("nvidia.com/gpu.mode".into(), "compute".into()),
                ("nvidia.com/gpu.machine".into(), "Fake-Server".into()),
                ("nvidia.com/gpu.replicas".into(), "1".into()),
                ("nvidia.com/gpu.sharing-strategy".into(), "none".into()),
                ("nvidia.com/mig.capable".into(), f.mig_capable.to_string()),
                ("nvidia.com/mps.capable".into(), "false".into()),
                ("nvidia.com/vgpu.present".into(), "false".into()),
                (
                    "nvidia.com/cuda.driver-version.full".into(),
                    "580.95.05".into(),
                ),
                ("nvidia.com/cuda.driver-version.major".into(), "580".into()),
                ("nvidia.com/cuda.driver-version.minor".into(), "95".into()),
                (
                    "nvidia.com/cuda.driver-version.revision".into(),
                    "05".into(),
                ),
                ("nvidia.com/cuda.runtime-version.full".into(), "13.0".into()),
                ("nvidia.com/cuda.runtime-version.major".into(), "13".into()),
                ("nvidia.com/cuda.runtime-version.minor".into(), "0".into()),
                ("nvidia.com/gfd.timestamp".into(), "1763683200".into()),
            ];
            labels.extend(gfd);
            if self.advertise_gpus {
                capacity.insert(
                    "nvidia.com/gpu".into(),
                    Quantity(f.gpus_per_node.to_string()),
                );
            }
        }
        if !self.discovered {
            labels.retain(|k, _| {
                !k.starts_with(NFD_LABEL_PREFIX) && !k.starts_with(GFD_LABEL_PREFIX)
            });
        }
        labels.extend(self.extra_labels.clone());

        let taints = self.tainted.then(|| {
            vec![Taint {
                key: GPU_TAINT_KEY.into(),
                value: Some("present".into()),
                effect: "NoSchedule".into(),
                ..Taint::default()
            }]
        });

        Node {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                labels: Some(labels),
                annotations: Some([(KWOK_ANNOTATION.to_string(), "fake".to_string())].into()),
                ..ObjectMeta::default()
            },
            spec: Some(NodeSpec {
                taints,
                ..NodeSpec::default()
            }),
            status: Some(NodeStatus {
                allocatable: Some(capacity.clone()),
                capacity: Some(capacity),
                node_info: Some(NodeSystemInfo {
                    architecture: "amd64".into(),
                    container_runtime_version: self
                        .node_info
                        .container_runtime_version
                        .clone()
                        .unwrap_or_else(|| self.runtime.version().into()),
                    kernel_version: kernel.into(),
                    kube_proxy_version: String::new(),
                    kubelet_version: self
                        .node_info
                        .kubelet_version
                        .clone()
                        .unwrap_or_else(|| "v1.36.3".into()),
                    operating_system: "linux".into(),
                    os_image: self
                        .node_info
                        .os_image
                        .clone()
                        .unwrap_or_else(|| format!("{} {} LTS", capitalise(os_id), os_version)),
                    ..NodeSystemInfo::default()
                }),
                ..NodeStatus::default()
            }),
        }
    }
}

fn capitalise(s: &str) -> String {
    let mut chars = s.chars();
    chars
        .next()
        .map(|c| c.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

/// A fleet of `gpu_nodes` GPU nodes cycling through [`GpuModel::FLEET`], named
/// `<prefix>-<model>-<n>`, plus `cpu_nodes` CPU-only nodes named `<prefix>-cpu-<n>`.
pub fn fleet(prefix: &str, gpu_nodes: usize, cpu_nodes: usize, tainted: bool) -> Vec<FakeNode> {
    let gpus = (0..gpu_nodes).map(|i| {
        let model = GpuModel::FLEET[i % GpuModel::FLEET.len()];
        FakeNode::gpu(format!("{prefix}-{}-{i}", model.slug()), model).tainted(tainted)
    });
    let cpus = (0..cpu_nodes).map(|i| FakeNode::cpu(format!("{prefix}-cpu-{i}")));
    gpus.chain(cpus).collect()
}

/// Creates the nodes with bounded concurrency; nodes that already exist are left as they are.
pub async fn create(client: &Client, nodes: &[FakeNode]) -> Result<()> {
    let api: Api<Node> = Api::all(client.clone());
    futures::stream::iter(nodes.iter().map(|n| {
        let api = api.clone();
        async move {
            match api.create(&PostParams::default(), &n.build()).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
                Err(e) => Err(e).with_context(|| format!("creating node {}", n.name)),
            }
        }
    }))
    .buffer_unordered(32)
    .try_collect::<Vec<()>>()
    .await?;
    Ok(())
}

/// Deletes the named nodes (missing ones are fine).
pub async fn delete(client: &Client, names: &[String]) -> Result<()> {
    let api: Api<Node> = Api::all(client.clone());
    futures::stream::iter(names.iter().map(|name| {
        let api = api.clone();
        async move {
            match api.delete(name, &DeleteParams::default()).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
                Err(e) => Err(e).with_context(|| format!("deleting node {name}")),
            }
        }
    }))
    .buffer_unordered(32)
    .try_collect::<Vec<()>>()
    .await?;
    Ok(())
}

/// The nodes the operator marked as GPU nodes (`nvidia.com/gpu.present=true`), read in full.
pub async fn marked_gpu_nodes(client: &Client) -> Result<Vec<Node>> {
    Ok(Api::<Node>::all(client.clone())
        .list(&ListParams::default().labels("nvidia.com/gpu.present=true"))
        .await?
        .items)
}

/// Names of the nodes that carry NFD's NVIDIA PCI label.
pub async fn gpu_node_names(client: &Client) -> Result<Vec<String>> {
    let api: Api<Node> = Api::all(client.clone());
    let list = api
        .list_metadata(&ListParams::default().labels(&format!("{NFD_NVIDIA_PCI}=true")))
        .await?;
    Ok(list
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect())
}

/// Sets label `key` of node `name` to `value`, or removes it (`None`), as NFD would after a
/// node's OS or kernel changed.
pub async fn set_label(client: &Client, name: &str, key: &str, value: Option<&str>) -> Result<()> {
    let patch = serde_json::json!({"metadata": {"labels": {key: value}}});
    Api::<Node>::all(client.clone())
        .patch(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(patch),
        )
        .await?;
    Ok(())
}

/// Sets `nvidia.com/gpu` in node `name`'s capacity and allocatable to `gpus`, or removes it
/// (`None`), as a device plugin advertising (or losing) GPUs would: kwok runs no plugin.
pub async fn advertise_gpus(client: &Client, name: &str, gpus: Option<u64>) -> Result<()> {
    let value = gpus.map(|n| n.to_string());
    let patch = serde_json::json!({"status": {
        "capacity": {"nvidia.com/gpu": value},
        "allocatable": {"nvidia.com/gpu": value}
    }});
    Api::<Node>::all(client.clone())
        .patch_status(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(patch),
        )
        .await
        .with_context(|| format!("advertising {gpus:?} GPUs on node {name}"))?;
    Ok(())
}
