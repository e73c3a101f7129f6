//! Mixed-OS fleets (pure): the GPU nodes grouped by OS from NFD's `system-os_release` labels,
//! one driver DaemonSet per OS with the image tag of that OS and a node selector on it.
//!
//! A fleet of one OS keeps the single `nvidia-driver-daemonset` without an OS selector (no
//! change, so no driver pod restarts, for the common case). Once GPU nodes of a second OS
//! appear, or nodes whose OS has no driver image, every driver DaemonSet selects its OS: the
//! primary OS (the one the live DaemonSet already runs, see [`primary_os`]) keeps
//! `nvidia-driver-daemonset`, every other OS gets `nvidia-driver-daemonset-<os tag>`. Nodes of
//! an OS without a known driver image get no driver pod and are reported.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::facts::ClusterFacts;
use crate::nodes::{NodeView, OS_ID, OS_VERSION_ID};

/// NFD's major-version label, for distributions whose driver images are tagged by major
/// version only.
pub const OS_VERSION_MAJOR: &str = "feature.node.kubernetes.io/system-os_release.VERSION_ID.major";

/// OS ids NVIDIA publishes driver images for (and whose package and certificate paths the
/// driver container knows, see [`super::driver::repo_dir`]).
pub const KNOWN_OS: [&str; 9] = [
    "ubuntu", "debian", "rhel", "rhcos", "centos", "rocky", "ol", "sles", "sl-micro",
];

fn major_only(id: &str) -> bool {
    matches!(id, "rhel" | "rocky" | "ol")
}

/// `<ID><VERSION_ID>` of a node from NFD's labels (`ubuntu22.04`; RHEL-like distributions keep
/// only the major version, as NVIDIA's driver images are tagged).
pub fn os_tag(node: &NodeView) -> Option<String> {
    let id = node.label(OS_ID)?;
    let version = node.label(OS_VERSION_ID)?;
    let version = if major_only(id) {
        version.split('.').next().unwrap_or(version)
    } else {
        version
    };
    Some(format!("{id}{version}"))
}

/// The node labels that select the nodes of OS `id` at `version` (RHEL-like distributions by
/// major version, as their images are tagged).
pub fn os_selector(id: &str, version: &str) -> Vec<(String, String)> {
    let version_selector = if major_only(id) {
        (
            OS_VERSION_MAJOR.to_owned(),
            version.split('.').next().unwrap_or(version).to_owned(),
        )
    } else {
        (OS_VERSION_ID.to_owned(), version.to_owned())
    };
    vec![(OS_ID.to_owned(), id.to_owned()), version_selector]
}

/// The GPU nodes of one OS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OsPool {
    /// `ubuntu22.04`, the driver image tag's suffix.
    pub tag: String,
    /// The node labels that select this OS.
    pub selector: Vec<(String, String)>,
    pub nodes: Vec<String>,
}

/// The GPU nodes by OS, and the GPU nodes whose OS has no known driver image (node, why).
pub fn pools(gpu_nodes: &[Arc<NodeView>]) -> (Vec<OsPool>, Vec<(String, String)>) {
    let mut pools: BTreeMap<String, OsPool> = BTreeMap::new();
    let mut unknown = Vec::new();
    for node in gpu_nodes
        .iter()
        .filter(|n| n.is_gpu_node() || n.has_nfd_gpu())
    {
        let (Some(id), Some(version), Some(tag)) =
            (node.label(OS_ID), node.label(OS_VERSION_ID), os_tag(node))
        else {
            unknown.push((node.name.clone(), "no NFD OS labels".to_owned()));
            continue;
        };
        if !KNOWN_OS.contains(&id) {
            unknown.push((node.name.clone(), tag));
            continue;
        }
        pools
            .entry(tag.clone())
            .or_insert_with(|| OsPool {
                tag,
                selector: os_selector(id, version),
                nodes: Vec::new(),
            })
            .nodes
            .push(node.name.clone());
    }
    (pools.into_values().collect(), unknown)
}

/// The OS the driver image tag gets when there is one DaemonSet, and the OS that keeps the
/// plain DaemonSet name when there are several: the one the live driver DaemonSet runs
/// (`live_tag`, its image's suffix) while GPU nodes of that OS remain, so a new OS joining the
/// fleet never renames the DaemonSet the existing nodes run; otherwise the first GPU node's
/// (by name) with a known OS, or with any OS.
pub fn primary_os(gpu_nodes: &[Arc<NodeView>], live_tag: Option<&str>) -> Option<String> {
    let (pools, _) = pools(gpu_nodes);
    if let Some(live) = live_tag
        && pools.iter().any(|p| p.tag == live)
    {
        return Some(live.to_owned());
    }
    let mut sorted: Vec<&NodeView> = gpu_nodes.iter().map(Arc::as_ref).collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    sorted
        .iter()
        .filter(|n| n.label(OS_ID).is_some_and(|id| KNOWN_OS.contains(&id)))
        .find_map(|n| os_tag(n))
        .or_else(|| sorted.iter().find_map(|n| os_tag(n)))
}

/// The OS suffix of a driver image reference (`...:595.91.07-ubuntu22.04` -> `ubuntu22.04`).
pub fn image_os_suffix(image: &str) -> Option<&str> {
    let (_, tag) = image.rsplit_once(':')?;
    let (_, suffix) = tag.rsplit_once('-')?;
    Some(suffix)
}

/// The pools that each need their own DaemonSet, or `None` when one DaemonSet without an OS
/// selector serves the fleet (one known OS and no node of an unknown one).
pub fn split(facts: &ClusterFacts) -> Option<Vec<OsPool>> {
    let (pools, unknown) = pools(&facts.gpu_nodes);
    (pools.len() > 1 || (pools.len() == 1 && !unknown.is_empty())).then_some(pools)
}

/// Nodes with the reason each is set apart, for status: the first ten, then how many more.
pub fn name_nodes(nodes: &[(String, String)]) -> String {
    let named: Vec<String> = nodes
        .iter()
        .take(10)
        .map(|(node, why)| format!("{node} ({why})"))
        .collect();
    match nodes.len().saturating_sub(10) {
        0 => named.join(", "),
        more => format!("{} and {more} more", named.join(", ")),
    }
}

/// What status says about GPU nodes whose OS has no driver image, when there are any.
pub fn report(facts: &ClusterFacts) -> Option<String> {
    let (pools, unknown) = pools(&facts.gpu_nodes);
    if unknown.is_empty() {
        return None;
    }
    let named = name_nodes(&unknown);
    Some(if pools.is_empty() {
        format!(
            "no driver image is known for the GPU nodes' OS: {named}; the image tag carries \
             that OS as it is (known: {})",
            KNOWN_OS.join(", ")
        )
    } else {
        format!(
            "GPU nodes whose OS has no known driver image get no driver pod: {named} (known: {})",
            KNOWN_OS.join(", ")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, os: Option<(&str, &str)>) -> Arc<NodeView> {
        let mut labels: BTreeMap<String, String> = [(
            "feature.node.kubernetes.io/pci-10de.present".to_owned(),
            "true".to_owned(),
        )]
        .into();
        if let Some((id, version)) = os {
            labels.insert(OS_ID.to_owned(), id.to_owned());
            labels.insert(OS_VERSION_ID.to_owned(), version.to_owned());
        }
        Arc::new(NodeView::from_labels(name, None, &labels))
    }

    #[test]
    fn nodes_are_grouped_by_os_tag_and_unknown_oses_are_set_apart() {
        let nodes = [
            node("a", Some(("ubuntu", "22.04"))),
            node("b", Some(("ubuntu", "24.04"))),
            node("c", Some(("ubuntu", "22.04"))),
            node("d", Some(("rhel", "9.4"))),
            node("e", Some(("rhel", "9.2"))),
            node("f", Some(("flatcar", "3975"))),
            node("g", None),
        ];
        let (pools, unknown) = pools(&nodes);
        let tags: Vec<(&str, usize)> = pools
            .iter()
            .map(|p| (p.tag.as_str(), p.nodes.len()))
            .collect();
        assert_eq!(tags, [("rhel9", 2), ("ubuntu22.04", 2), ("ubuntu24.04", 1)]);
        assert_eq!(
            pools[0].selector,
            [
                (OS_ID.to_owned(), "rhel".to_owned()),
                (OS_VERSION_MAJOR.to_owned(), "9".to_owned())
            ]
        );
        assert_eq!(
            unknown,
            [
                ("f".to_owned(), "flatcar3975".to_owned()),
                ("g".to_owned(), "no NFD OS labels".to_owned())
            ]
        );
    }

    #[test]
    fn the_primary_os_is_the_live_one_while_its_nodes_remain() {
        let nodes = [
            node("a", Some(("ubuntu", "24.04"))),
            node("b", Some(("ubuntu", "22.04"))),
        ];
        assert_eq!(
            primary_os(&nodes, Some("ubuntu22.04")).as_deref(),
            Some("ubuntu22.04")
        );
        assert_eq!(primary_os(&nodes, None).as_deref(), Some("ubuntu24.04"));
        assert_eq!(
            primary_os(&nodes, Some("rhel9")).as_deref(),
            Some("ubuntu24.04")
        );
        assert_eq!(
            primary_os(&[node("f", Some(("flatcar", "3975")))], None).as_deref(),
            Some("flatcar3975")
        );
        assert_eq!(primary_os(&[], None), None);
        assert_eq!(
            image_os_suffix("nvcr.io/nvidia/driver:595.91.07-ubuntu22.04"),
            Some("ubuntu22.04")
        );
        assert_eq!(image_os_suffix("nvcr.io/nvidia/driver@sha256:abc"), None);
    }
}
