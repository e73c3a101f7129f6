//! Mixed runtime fleets (pure): the container toolkit gets one DaemonSet per runtime flavour
//! present on the GPU nodes (facts::RuntimeFlavour), each configuring its nodes' runtime where
//! that flavour keeps it and selecting its nodes by our node label
//! [`crate::nodes::RUNTIME_FLAVOUR`].
//!
//! A fleet of one flavour keeps the single `nvidia-container-toolkit-daemonset` without a
//! flavour selector, so an operator upgrade changes nothing on such a fleet unless the
//! flavour's files differ from the stock layout it used before. Once a second flavour or a
//! read-only image joins, every toolkit DaemonSet selects its flavour: the primary one (the
//! flavour the live DaemonSet configures, see [`plan`]) keeps the plain name, each other gets
//! `nvidia-container-toolkit-daemonset-<flavour>`. Nodes of a read-only image get none and are
//! reported with what to use there instead.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::apps::v1::DaemonSet;

use super::driver::rename_daemon_set;
use super::driver_os::name_nodes;
use super::toolkit::{self, NAME};
use crate::api::{ClusterPolicySpec, ToolkitSpec};
use crate::facts::{ClusterFacts, NodeRuntime, RuntimeFlavour};
use crate::nodes::RUNTIME_FLAVOUR;

/// Which toolkit DaemonSets to render.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The flavour of the DaemonSet named [`NAME`].
    pub primary: RuntimeFlavour,
    /// Every flavour present, each its own DaemonSet selecting its nodes; `None`: one DaemonSet
    /// without a flavour selector serves the fleet.
    pub split: Option<Vec<RuntimeFlavour>>,
}

/// The flavours present on the GPU nodes, and the nodes of read-only images (node, image).
fn present(facts: &ClusterFacts) -> (BTreeSet<RuntimeFlavour>, Vec<(String, NodeRuntime)>) {
    let mut flavours = BTreeSet::new();
    let mut read_only = Vec::new();
    for (node, runtime) in &facts.node_runtimes {
        match runtime.flavour() {
            Some(f) => {
                flavours.insert(f);
            }
            None => read_only.push((node.clone(), *runtime)),
        }
    }
    (flavours, read_only)
}

/// The DaemonSets for `facts`. The primary flavour is the one the live DaemonSet configures
/// while nodes of it remain (a flavour joining never renames what runs), else the stock
/// layout of the cluster's runtime (what an operator without flavours rendered), else the
/// first flavour present.
pub fn plan(facts: &ClusterFacts) -> Plan {
    let (flavours, read_only) = present(facts);
    let stock = RuntimeFlavour::stock(facts.runtime);
    let primary = facts
        .live_toolkit_flavour
        .filter(|f| flavours.contains(f))
        .or_else(|| flavours.contains(&stock).then_some(stock))
        .or_else(|| flavours.first().copied())
        .unwrap_or(stock);
    let split = (flavours.len() > 1 || !read_only.is_empty()).then(|| {
        if flavours.is_empty() {
            // Only read-only nodes: one DaemonSet that selects no node keeps the operand's
            // name and status (it is enabled), without a pod where none can work.
            vec![primary]
        } else {
            flavours.into_iter().collect()
        }
    });
    Plan { primary, split }
}

/// The name of a flavour's DaemonSet when it is not the primary one.
pub fn name(flavour: RuntimeFlavour) -> String {
    format!("{NAME}-{}", flavour.label())
}

/// Limits a toolkit DaemonSet to one flavour's nodes, under its own name when it is not the
/// primary one.
pub fn select(ds: &mut DaemonSet, flavour: RuntimeFlavour, rename: Option<String>) {
    if let Some(pod) = ds
        .spec
        .as_mut()
        .and_then(|spec| spec.template.spec.as_mut())
    {
        pod.node_selector
            .get_or_insert_with(BTreeMap::new)
            .insert(RUNTIME_FLAVOUR.to_owned(), flavour.label().to_owned());
    }
    if let Some(name) = rename {
        rename_daemon_set(ds, name);
    }
}

/// The flavour a live toolkit DaemonSet configures, told by the host directory it mounts for
/// the runtime's config and the config file named in `RUNTIME_CONFIG`; `None` when they match
/// no flavour's (a user-set path).
pub fn live_flavour(ds: &DaemonSet) -> Option<RuntimeFlavour> {
    let pod = ds.spec.as_ref()?.template.spec.as_ref()?;
    let main = pod
        .containers
        .iter()
        .find(|c| c.name == toolkit::MAIN_CONTAINER)?;
    let file = main
        .env
        .as_ref()?
        .iter()
        .find(|e| e.name == "RUNTIME_CONFIG")?
        .value
        .as_deref()?
        .rsplit('/')
        .next()?;
    let volumes = pod.volumes.as_ref()?;
    RuntimeFlavour::ALL.into_iter().find(|f| {
        let config = f.paths().config;
        let Some((dir, name)) = config.rsplit_once('/') else {
            return false;
        };
        name == file
            && volumes.iter().any(|v| {
                v.name.ends_with("-config")
                    && !v.name.contains("drop-in")
                    && v.host_path.as_ref().is_some_and(|h| h.path == dir)
            })
    })
}

/// The nodes of each flavour, for status lines.
fn nodes_of(facts: &ClusterFacts, flavour: RuntimeFlavour) -> Vec<(String, String)> {
    facts
        .node_runtimes
        .iter()
        .filter(|(_, r)| r.flavour() == Some(flavour))
        .map(|(n, _)| (n.clone(), flavour.label().to_owned()))
        .collect()
}

/// Status: the GPU nodes of read-only images, which get no toolkit, with what to do there;
/// and each `toolkit.env` variable that overrides a path detected for a flavour present.
pub fn report(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Option<String> {
    let mut lines = Vec::new();
    let (flavours, read_only) = present(facts);
    let mut by_image: BTreeMap<_, Vec<String>> = BTreeMap::new();
    for (node, runtime) in read_only {
        if let NodeRuntime::ReadOnly(image) = runtime {
            by_image.entry(image).or_default().push(node);
        }
    }
    for (image, nodes) in by_image {
        let (name, instead) = image.instead();
        let named: Vec<(String, String)> =
            nodes.into_iter().map(|n| (n, name.to_owned())).collect();
        lines.push(format!(
            "GPU nodes of the read-only image {name} get no container toolkit (nothing can be \
             installed there): {}; {instead}",
            name_nodes(&named)
        ));
    }
    let default_toolkit = ToolkitSpec::default();
    let user = spec
        .toolkit
        .as_ref()
        .unwrap_or(&default_toolkit)
        .container
        .env
        .as_deref()
        .unwrap_or_default();
    for flavour in flavours {
        for (var, detected) in toolkit::detected_paths(flavour) {
            let Some(set) = user.iter().find(|e| e.name == var) else {
                continue;
            };
            let value = set.value.as_deref().unwrap_or_default();
            if Some(value) == detected || (value.is_empty() && detected.is_none()) {
                continue;
            }
            lines.push(format!(
                "spec.toolkit.env {var}={value} overrides the detected {} for the {} nodes {}; \
                 remove it from spec.toolkit.env to use the detected path",
                detected.unwrap_or("(none)"),
                flavour.label(),
                name_nodes(&nodes_of(facts, flavour))
            ));
        }
    }
    (!lines.is_empty()).then(|| lines.join("; "))
}
