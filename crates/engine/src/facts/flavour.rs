//! Resolve stage, the pure half of per-node runtime detection: which container runtime
//! flavour a GPU node runs, from what its Node object reports (`status.nodeInfo` and a few
//! labels), and where that flavour keeps its configuration and socket on the host
//! (docs/operand-facts.md §6.1). No IO: the operator and `gpu-operator render` pass what they
//! read.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;

use super::Runtime;

/// Label MicroK8s puts on every node of its clusters; its kubelet and containerd report plain
/// upstream versions, so this label is what tells it apart.
pub const MICROK8S_LABEL: &str = "microk8s.io/cluster";

/// What a Node reports that tells its runtime flavour apart.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeRuntimeInfo {
    /// `status.nodeInfo.containerRuntimeVersion` (`containerd://2.0.4-k3s2`).
    pub container_runtime_version: String,
    /// `status.nodeInfo.kubeletVersion` (`v1.31.6+k3s1`).
    pub kubelet_version: String,
    /// `status.nodeInfo.osImage` (`Bottlerocket OS 1.36.0 (aws-k8s-1.32-nvidia)`).
    pub os_image: String,
    /// Whether the node carries [`MICROK8S_LABEL`].
    pub microk8s: bool,
}

impl NodeRuntimeInfo {
    /// What `node` reports (empty fields where it reports nothing).
    pub fn of_node(node: &Node) -> Self {
        let info = node.status.as_ref().and_then(|s| s.node_info.as_ref());
        NodeRuntimeInfo {
            container_runtime_version: info
                .map(|i| i.container_runtime_version.clone())
                .unwrap_or_default(),
            kubelet_version: info.map(|i| i.kubelet_version.clone()).unwrap_or_default(),
            os_image: info.map(|i| i.os_image.clone()).unwrap_or_default(),
            microk8s: node
                .metadata
                .labels
                .as_ref()
                .is_some_and(|l| l.get(MICROK8S_LABEL).is_some_and(|v| v == "true")),
        }
    }
}

/// Where a node's container runtime keeps what the toolkit changes. Distributions that bundle
/// containerd keep it under their own directories, and the ones that generate containerd's
/// config on every start read a template instead of the file containerd loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RuntimeFlavour {
    /// containerd installed from packages, 1.x (config version 2) or 2.x (version 3): one
    /// layout under /etc/containerd; the toolkit itself writes the config version it finds.
    Containerd,
    /// k3s with containerd 1.7 (template `config.toml.tmpl`).
    K3s,
    /// k3s with containerd 2 (template `config-v3.toml.tmpl`).
    K3sV3,
    /// RKE2 with containerd 1.7.
    Rke2,
    /// RKE2 with containerd 2.
    Rke2V3,
    /// k0s: containerd imports `/etc/k0s/containerd.d/*.toml`.
    K0s,
    /// MicroK8s (snap): the containerd template under the snap's `args`.
    MicroK8s,
    CriO,
    Docker,
}

/// Managed node images whose root filesystem is read-only: neither the toolkit nor a driver
/// container can install anything there; the image ships its own GPU stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ReadOnlyImage {
    /// Google's Container-Optimized OS (GKE).
    ContainerOptimizedOs,
    /// Bottlerocket (EKS and others).
    Bottlerocket,
    /// Talos Linux.
    Talos,
}

/// What a GPU node runs, for the toolkit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NodeRuntime {
    Flavour(RuntimeFlavour),
    ReadOnly(ReadOnlyImage),
}

impl Default for NodeRuntime {
    fn default() -> Self {
        NodeRuntime::Flavour(RuntimeFlavour::Containerd)
    }
}

/// The host files of one flavour: the config file the toolkit writes, the drop-in file (when
/// the runtime imports one the toolkit may write), the socket, and the file the toolkit reads
/// the current configuration from when `containerd config dump` would not show what the node
/// runs (bundled containerd binaries are not on the host's PATH, or the file written is a
/// template).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlavourPaths {
    pub config: &'static str,
    pub drop_in: Option<&'static str>,
    pub socket: Option<&'static str>,
    pub config_source: Option<&'static str>,
}

impl RuntimeFlavour {
    /// Every flavour, in the order DaemonSets are rendered.
    pub const ALL: [RuntimeFlavour; 9] = [
        RuntimeFlavour::Containerd,
        RuntimeFlavour::K3s,
        RuntimeFlavour::K3sV3,
        RuntimeFlavour::Rke2,
        RuntimeFlavour::Rke2V3,
        RuntimeFlavour::K0s,
        RuntimeFlavour::MicroK8s,
        RuntimeFlavour::CriO,
        RuntimeFlavour::Docker,
    ];

    /// The runtime NVIDIA's toolkit is told (`RUNTIME`): every bundled containerd is containerd.
    pub const fn runtime(self) -> Runtime {
        match self {
            RuntimeFlavour::CriO => Runtime::CriO,
            RuntimeFlavour::Docker => Runtime::Docker,
            _ => Runtime::Containerd,
        }
    }

    /// The flavour of a stock installation of `runtime`.
    pub const fn stock(runtime: Runtime) -> RuntimeFlavour {
        match runtime {
            Runtime::Containerd => RuntimeFlavour::Containerd,
            Runtime::CriO => RuntimeFlavour::CriO,
            Runtime::Docker => RuntimeFlavour::Docker,
        }
    }

    /// Its value of the node label [`crate::nodes::RUNTIME_FLAVOUR`], and the suffix of its
    /// toolkit DaemonSet's name in a mixed fleet.
    pub const fn label(self) -> &'static str {
        match self {
            RuntimeFlavour::Containerd => "containerd",
            RuntimeFlavour::K3s => "k3s",
            RuntimeFlavour::K3sV3 => "k3s-containerd2",
            RuntimeFlavour::Rke2 => "rke2",
            RuntimeFlavour::Rke2V3 => "rke2-containerd2",
            RuntimeFlavour::K0s => "k0s",
            RuntimeFlavour::MicroK8s => "microk8s",
            RuntimeFlavour::CriO => "crio",
            RuntimeFlavour::Docker => "docker",
        }
    }

    pub fn parse(label: &str) -> Option<RuntimeFlavour> {
        RuntimeFlavour::ALL.into_iter().find(|f| f.label() == label)
    }

    /// Where this flavour keeps its files on the host (docs/operand-facts.md §6.1).
    pub const fn paths(self) -> FlavourPaths {
        const K3S_SOCKET: &str = "/run/k3s/containerd/containerd.sock";
        match self {
            RuntimeFlavour::Containerd => FlavourPaths {
                config: "/etc/containerd/config.toml",
                drop_in: Some("/etc/containerd/conf.d/99-nvidia.toml"),
                socket: Some("/run/containerd/containerd.sock"),
                config_source: None,
            },
            // k3s and RKE2 rewrite config.toml from the template on every start: the toolkit
            // writes the template, seeded from the generated file (the effective config), with
            // an `imports` entry for its drop-in, which it keeps in the directory newer k3s
            // releases import on their own (config.toml.d, config-v3.toml.d).
            RuntimeFlavour::K3s => FlavourPaths {
                config: "/var/lib/rancher/k3s/agent/etc/containerd/config.toml.tmpl",
                drop_in: Some(
                    "/var/lib/rancher/k3s/agent/etc/containerd/config.toml.d/99-nvidia.toml",
                ),
                socket: Some(K3S_SOCKET),
                config_source: Some("/var/lib/rancher/k3s/agent/etc/containerd/config.toml"),
            },
            RuntimeFlavour::K3sV3 => FlavourPaths {
                config: "/var/lib/rancher/k3s/agent/etc/containerd/config-v3.toml.tmpl",
                drop_in: Some(
                    "/var/lib/rancher/k3s/agent/etc/containerd/config-v3.toml.d/99-nvidia.toml",
                ),
                socket: Some(K3S_SOCKET),
                config_source: Some("/var/lib/rancher/k3s/agent/etc/containerd/config.toml"),
            },
            RuntimeFlavour::Rke2 => FlavourPaths {
                config: "/var/lib/rancher/rke2/agent/etc/containerd/config.toml.tmpl",
                drop_in: Some(
                    "/var/lib/rancher/rke2/agent/etc/containerd/config.toml.d/99-nvidia.toml",
                ),
                // RKE2 keeps k3s's socket path.
                socket: Some(K3S_SOCKET),
                config_source: Some("/var/lib/rancher/rke2/agent/etc/containerd/config.toml"),
            },
            RuntimeFlavour::Rke2V3 => FlavourPaths {
                config: "/var/lib/rancher/rke2/agent/etc/containerd/config-v3.toml.tmpl",
                drop_in: Some(
                    "/var/lib/rancher/rke2/agent/etc/containerd/config-v3.toml.d/99-nvidia.toml",
                ),
                socket: Some(K3S_SOCKET),
                config_source: Some("/var/lib/rancher/rke2/agent/etc/containerd/config.toml"),
            },
            // k0s (1.27.1 and later) brings every file of containerd.d into the config it
            // generates: the drop-in goes there. The toolkit always also writes a top-level
            // file that imports its drop-in; k0s reads no such file, so it is kept beside
            // k0s' own config, inert. k0s' generated config tells the toolkit the version to
            // write (2 up to k0s 1.35, 3 from 1.36, which refuses version 2 drop-ins).
            RuntimeFlavour::K0s => FlavourPaths {
                config: "/etc/k0s/nvidia-container-toolkit.toml",
                drop_in: Some("/etc/k0s/containerd.d/99-nvidia.toml"),
                socket: Some("/run/k0s/containerd.sock"),
                config_source: Some("/etc/k0s/containerd.toml"),
            },
            // MicroK8s renders containerd.toml from the template at every start; the template
            // imports nothing by default, so the toolkit adds the import of its drop-in.
            RuntimeFlavour::MicroK8s => FlavourPaths {
                config: "/var/snap/microk8s/current/args/containerd-template.toml",
                drop_in: Some("/var/snap/microk8s/current/args/conf.d/99-nvidia.toml"),
                socket: Some("/var/snap/microk8s/common/run/containerd.sock"),
                config_source: Some("/var/snap/microk8s/current/args/containerd-template.toml"),
            },
            RuntimeFlavour::CriO => FlavourPaths {
                config: "/etc/crio/config.toml",
                drop_in: Some("/etc/crio/crio.conf.d/99-nvidia.conf"),
                socket: None,
                config_source: None,
            },
            RuntimeFlavour::Docker => FlavourPaths {
                config: "/etc/docker/daemon.json",
                drop_in: None,
                socket: Some("/var/run/docker.sock"),
                config_source: None,
            },
        }
    }
}

impl ReadOnlyImage {
    pub const fn label(self) -> &'static str {
        match self {
            ReadOnlyImage::ContainerOptimizedOs => "read-only-cos",
            ReadOnlyImage::Bottlerocket => "read-only-bottlerocket",
            ReadOnlyImage::Talos => "read-only-talos",
        }
    }

    /// The image's name and what to use on it instead of the operator's driver and toolkit.
    pub const fn instead(self) -> (&'static str, &'static str) {
        match self {
            ReadOnlyImage::ContainerOptimizedOs => (
                "Container-Optimized OS",
                "install the driver with GKE's own installer (gpu-driver-version on the node \
                 pool) and set driver.enabled=false and toolkit.enabled=false",
            ),
            ReadOnlyImage::Bottlerocket => (
                "Bottlerocket",
                "use a Bottlerocket NVIDIA variant (aws-k8s-*-nvidia), which ships the driver \
                 and the runtime, and set driver.enabled=false and toolkit.enabled=false",
            ),
            ReadOnlyImage::Talos => (
                "Talos",
                "add Talos' nvidia-container-toolkit and NVIDIA kernel module system extensions \
                 to the machine image, and set driver.enabled=false and toolkit.enabled=false",
            ),
        }
    }
}

impl NodeRuntime {
    /// Its value of the node label [`crate::nodes::RUNTIME_FLAVOUR`].
    pub const fn label(self) -> &'static str {
        match self {
            NodeRuntime::Flavour(f) => f.label(),
            NodeRuntime::ReadOnly(r) => r.label(),
        }
    }

    pub const fn flavour(self) -> Option<RuntimeFlavour> {
        match self {
            NodeRuntime::Flavour(f) => Some(f),
            NodeRuntime::ReadOnly(_) => None,
        }
    }
}

/// The major version of a runtime version string after its scheme (`containerd://2.0.4-k3s2`
/// -> 2).
fn runtime_major(version: &str) -> Option<u32> {
    let (_, rest) = version.split_once("://")?;
    rest.trim_start_matches('v').split('.').next()?.parse().ok()
}

/// The read-only image `os_image` names, if it names one.
fn read_only_image(os_image: &str) -> Option<ReadOnlyImage> {
    let image = os_image.trim();
    if image.starts_with("Container-Optimized OS") {
        Some(ReadOnlyImage::ContainerOptimizedOs)
    } else if image.starts_with("Bottlerocket") {
        Some(ReadOnlyImage::Bottlerocket)
    } else if image.starts_with("Talos") {
        Some(ReadOnlyImage::Talos)
    } else {
        None
    }
}

/// What a node runs, from what it reports: a read-only image by its `osImage`; CRI-O and Docker
/// by the runtime's scheme; among containerd nodes the distribution by the kubelet version's
/// build suffix (`+k3s1`, `+rke2r1`, `+k0s`) or MicroK8s' node label, with the containerd
/// major version choosing k3s' and RKE2's template. Anything else is stock containerd, as
/// NVIDIA's operator assumes for an unknown runtime.
pub fn detect(info: &NodeRuntimeInfo) -> NodeRuntime {
    if let Some(image) = read_only_image(&info.os_image) {
        return NodeRuntime::ReadOnly(image);
    }
    let flavour = match super::parse_runtime(&info.container_runtime_version) {
        Runtime::CriO => RuntimeFlavour::CriO,
        Runtime::Docker => RuntimeFlavour::Docker,
        Runtime::Containerd => {
            let build = info
                .kubelet_version
                .split_once('+')
                .map(|(_, b)| b)
                .unwrap_or_default();
            let v3 = runtime_major(&info.container_runtime_version).is_some_and(|m| m >= 2);
            if build.starts_with("k3s") {
                if v3 {
                    RuntimeFlavour::K3sV3
                } else {
                    RuntimeFlavour::K3s
                }
            } else if build.starts_with("rke2") {
                if v3 {
                    RuntimeFlavour::Rke2V3
                } else {
                    RuntimeFlavour::Rke2
                }
            } else if build.starts_with("k0s") {
                RuntimeFlavour::K0s
            } else if info.microk8s {
                RuntimeFlavour::MicroK8s
            } else {
                RuntimeFlavour::Containerd
            }
        }
    };
    NodeRuntime::Flavour(flavour)
}

/// A node's runtime on a cluster that is (or is not) OpenShift: every OpenShift node runs CRI-O
/// (NVIDIA configures CRI-O there whatever a node reports), the rest as detected.
pub fn on_cluster(runtime: NodeRuntime, openshift: bool) -> NodeRuntime {
    match runtime {
        NodeRuntime::Flavour(_) if openshift => NodeRuntime::Flavour(RuntimeFlavour::CriO),
        other => other,
    }
}

/// Each GPU node's runtime, by node name.
pub type NodeRuntimes = BTreeMap<String, NodeRuntime>;

#[cfg(test)]
mod tests {
    use super::*;

    fn info(runtime: &str, kubelet: &str, os_image: &str) -> NodeRuntimeInfo {
        NodeRuntimeInfo {
            container_runtime_version: runtime.to_owned(),
            kubelet_version: kubelet.to_owned(),
            os_image: os_image.to_owned(),
            microk8s: false,
        }
    }

    fn flavour(runtime: &str, kubelet: &str) -> NodeRuntime {
        detect(&info(runtime, kubelet, "Ubuntu 22.04.4 LTS"))
    }

    use NodeRuntime::Flavour as F;
    use RuntimeFlavour::*;

    #[test]
    fn every_openshift_node_runs_cri_o_whatever_it_reports() {
        let k3s = flavour("containerd://1.7.23-k3s2", "v1.31.4+k3s1");
        assert_eq!(on_cluster(k3s, true), F(CriO));
        assert_eq!(on_cluster(k3s, false), F(K3s));
    }

    #[test]
    fn stock_containerd_of_either_major_version_is_one_flavour() {
        assert_eq!(flavour("containerd://1.7.27", "v1.32.3"), F(Containerd));
        assert_eq!(flavour("containerd://2.1.1", "v1.33.1"), F(Containerd));
        // EKS and AKS builds carry their own suffixes; they are stock containerd.
        assert_eq!(
            flavour("containerd://1.7.27", "v1.32.3-eks-473151a"),
            F(Containerd)
        );
    }

    #[test]
    fn k3s_is_told_by_the_kubelet_build_and_its_template_by_containerd_major() {
        assert_eq!(flavour("containerd://1.7.23-k3s2", "v1.30.10+k3s1"), F(K3s));
        assert_eq!(flavour("containerd://2.0.4-k3s2", "v1.32.3+k3s1"), F(K3sV3));
    }

    #[test]
    fn rke2_is_told_by_the_kubelet_build() {
        assert_eq!(
            flavour("containerd://1.7.23-k3s2", "v1.30.10+rke2r1"),
            F(Rke2)
        );
        assert_eq!(
            flavour("containerd://2.0.4-k3s2", "v1.32.3+rke2r1"),
            F(Rke2V3)
        );
    }

    #[test]
    fn k0s_is_told_by_the_kubelet_build() {
        assert_eq!(flavour("containerd://1.7.27", "v1.32.3+k0s"), F(K0s));
    }

    #[test]
    fn microk8s_is_told_by_its_node_label() {
        let mut microk8s = info("containerd://1.6.28", "v1.30.1", "Ubuntu 22.04.4 LTS");
        assert_eq!(detect(&microk8s), F(Containerd));
        microk8s.microk8s = true;
        assert_eq!(detect(&microk8s), F(MicroK8s));
    }

    #[test]
    fn cri_o_and_docker_are_told_by_the_runtime_scheme() {
        assert_eq!(flavour("cri-o://1.31.3", "v1.31.3"), F(CriO));
        // OpenShift's kubelet build suffix does not make it anything but CRI-O.
        assert_eq!(
            flavour("cri-o://1.29.8-5.rhaos4.16", "v1.29.8+f10c92d"),
            F(CriO)
        );
        assert_eq!(flavour("docker://28.2.2", "v1.23.17"), F(Docker));
    }

    #[test]
    fn read_only_images_are_told_by_the_os_image() {
        use ReadOnlyImage::*;
        let ro = |os| detect(&info("containerd://1.7.24", "v1.31.5-gke.1", os));
        assert_eq!(
            ro("Container-Optimized OS from Google"),
            NodeRuntime::ReadOnly(ContainerOptimizedOs)
        );
        assert_eq!(
            ro("Bottlerocket OS 1.36.0 (aws-k8s-1.32-nvidia)"),
            NodeRuntime::ReadOnly(Bottlerocket)
        );
        assert_eq!(ro("Talos (v1.9.5)"), NodeRuntime::ReadOnly(Talos));
        assert_eq!(ro("Ubuntu 24.04.2 LTS"), F(Containerd));
    }

    #[test]
    fn an_unknown_or_missing_runtime_is_stock_containerd() {
        assert_eq!(detect(&NodeRuntimeInfo::default()), F(Containerd));
    }

    #[test]
    fn labels_round_trip_and_are_valid_label_values() {
        for f in RuntimeFlavour::ALL {
            assert_eq!(RuntimeFlavour::parse(f.label()), Some(f));
            assert!(f.label().len() <= 63);
            assert!(
                f.label()
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-')
            );
        }
    }
}
