//! Precompiled drivers (pure): `driver.usePrecompiled` gives the GPU nodes of each kernel their
//! own driver DaemonSet, whose image carries modules built for that kernel (no headers, no
//! compiler, no network on the node), as NVIDIA's operator does:
//!
//! - the kernel is NFD's `feature.node.kubernetes.io/kernel-version.full` label, which also
//!   selects the pool's nodes;
//! - the DaemonSet is `nvidia-driver-daemonset-<kernel, sanitized>-<OS tag>`, labelled
//!   `nvidia.com/precompiled=true`;
//! - the image tag is `<driver branch>-<kernel>-<OS tag>` (`driver.version` is the branch, such
//!   as `580`).
//!
//! A GPU node without the kernel label, of an OS without driver images, or whose kernel another
//! OS's nodes also run (one image per kernel) gets no driver pod and is reported.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::driver_os::{KNOWN_OS, os_tag};
use crate::facts::ClusterFacts;
use crate::nodes::{KERNEL_VERSION, NodeView, OS_ID, OS_VERSION_ID};

/// The GPU nodes of one kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelPool {
    /// The kernel as NFD reports it (`5.15.0-1048-aws`).
    pub kernel: String,
    /// The OS tag of its nodes (`ubuntu22.04`), the image tag's last part.
    pub os_tag: String,
    /// The node labels that select that OS ([`super::driver_os::os_selector`]).
    pub os_selector: Vec<(String, String)>,
    pub nodes: Vec<String>,
}

impl KernelPool {
    /// NVIDIA's DaemonSet name for the pool: the base name, the sanitized kernel, the OS tag.
    pub fn daemon_set_name(&self, base: &str) -> String {
        format!("{base}-{}-{}", sanitized_kernel(&self.kernel), self.os_tag)
    }

    /// What follows the driver branch in the pool's image tag: `<kernel>-<OS tag>`.
    pub fn tag_suffix(&self) -> String {
        format!("{}-{}", self.kernel, self.os_tag)
    }
}

/// The kernel in a name: without architecture strings, `_` as `.`, no trailing `.`, lower
/// case (NVIDIA's rule, so the DaemonSet names match its operator's).
pub fn sanitized_kernel(kernel: &str) -> String {
    let mut out = kernel.to_owned();
    for arch in ["x86_64_64k", "aarch64_64k", "x86_64", "aarch64"] {
        out = out.replace(arch, "");
    }
    out.replace('_', ".")
        .trim_end_matches('.')
        .to_ascii_lowercase()
}

/// The GPU nodes by kernel, and the GPU nodes that get no precompiled driver (node, why).
pub fn pools(gpu_nodes: &[Arc<NodeView>]) -> (Vec<KernelPool>, Vec<(String, String)>) {
    let mut nodes: Vec<&Arc<NodeView>> = gpu_nodes
        .iter()
        .filter(|n| n.is_gpu_node() || n.has_nfd_gpu())
        .collect();
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    let mut pools: BTreeMap<String, KernelPool> = BTreeMap::new();
    let mut unplaced = Vec::new();
    for node in nodes {
        let Some(kernel) = node.label(KERNEL_VERSION) else {
            unplaced.push((node.name.clone(), format!("no NFD {KERNEL_VERSION} label")));
            continue;
        };
        let (Some(tag), Some(id), Some(version)) =
            (os_tag(node), node.label(OS_ID), node.label(OS_VERSION_ID))
        else {
            unplaced.push((node.name.clone(), "no NFD OS labels".to_owned()));
            continue;
        };
        if !KNOWN_OS.contains(&id) {
            unplaced.push((node.name.clone(), format!("{tag}: no driver images")));
            continue;
        }
        let pool = pools
            .entry(kernel.to_owned())
            .or_insert_with(|| KernelPool {
                kernel: kernel.to_owned(),
                os_tag: tag.clone(),
                os_selector: super::driver_os::os_selector(id, version),
                nodes: Vec::new(),
            });
        if pool.os_tag != tag {
            unplaced.push((
                node.name.clone(),
                format!(
                    "kernel {kernel} on {tag}, which nodes of {} also run: one image per kernel",
                    pool.os_tag
                ),
            ));
            continue;
        }
        pool.nodes.push(node.name.clone());
    }
    (pools.into_values().collect(), unplaced)
}

/// What status says about GPU nodes that get no precompiled driver, when there are any.
pub fn report(facts: &ClusterFacts) -> Option<String> {
    let (_, unplaced) = pools(&facts.gpu_nodes);
    if unplaced.is_empty() {
        return None;
    }
    Some(format!(
        "GPU nodes without a precompiled driver pool get no driver pod: {}",
        super::driver_os::name_nodes(&unplaced)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, os: (&str, &str), kernel: Option<&str>) -> Arc<NodeView> {
        let mut labels: BTreeMap<String, String> = [
            ("feature.node.kubernetes.io/pci-10de.present", "true"),
            (OS_ID, os.0),
            (OS_VERSION_ID, os.1),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        if let Some(kernel) = kernel {
            labels.insert(KERNEL_VERSION.to_owned(), kernel.to_owned());
        }
        Arc::new(NodeView::from_labels(name, None, &labels))
    }

    #[test]
    fn kernels_are_sanitized_as_nvidia_names_its_daemonsets() {
        assert_eq!(sanitized_kernel("5.15.0-1048-aws"), "5.15.0-1048-aws");
        assert_eq!(
            sanitized_kernel("5.14.0-427.13.1.el9_4.x86_64"),
            "5.14.0-427.13.1.el9.4"
        );
        assert_eq!(
            sanitized_kernel("6.8.0-1008-NVIDIA-64K_aarch64_64k"),
            "6.8.0-1008-nvidia-64k"
        );
    }

    #[test]
    fn gpu_nodes_are_pooled_by_kernel_and_nodes_that_cannot_be_are_set_apart() {
        let nodes = [
            node("a", ("ubuntu", "22.04"), Some("5.15.0-1048-aws")),
            node("b", ("ubuntu", "22.04"), Some("5.15.0-1050-aws")),
            node("c", ("ubuntu", "24.04"), Some("6.8.0-1008-aws")),
            node("d", ("ubuntu", "22.04"), Some("5.15.0-1048-aws")),
            node("e", ("ubuntu", "24.04"), Some("5.15.0-1048-aws")),
            node("f", ("ubuntu", "22.04"), None),
            node("g", ("flatcar", "3975"), Some("6.6.0")),
        ];
        let (pools, unplaced) = pools(&nodes);
        let got: Vec<(String, Vec<String>)> = pools
            .iter()
            .map(|p| {
                (
                    p.daemon_set_name("nvidia-driver-daemonset"),
                    p.nodes.clone(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (
                    "nvidia-driver-daemonset-5.15.0-1048-aws-ubuntu22.04".to_owned(),
                    vec!["a".to_owned(), "d".to_owned()]
                ),
                (
                    "nvidia-driver-daemonset-5.15.0-1050-aws-ubuntu22.04".to_owned(),
                    vec!["b".to_owned()]
                ),
                (
                    "nvidia-driver-daemonset-6.8.0-1008-aws-ubuntu24.04".to_owned(),
                    vec!["c".to_owned()]
                ),
            ]
        );
        assert_eq!(pools[0].tag_suffix(), "5.15.0-1048-aws-ubuntu22.04");
        let names: Vec<&str> = unplaced.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["e", "f", "g"]);
        assert!(
            unplaced[0].1.contains("one image per kernel"),
            "{unplaced:?}"
        );
        assert!(unplaced[1].1.contains(KERNEL_VERSION));
    }
}
