//! Mixed runtime fleets (pure): the container toolkit gets one DaemonSet per runtime flavour
//! present on the GPU nodes (facts::RuntimeFlavour), each configuring its nodes' runtime where
//! that flavour keeps it.
//!
//! Placement goes through NVIDIA's deploy key [`DEPLOY_TOOLKIT`], so no DaemonSet's template
//! ever depends on which other flavours are present: the primary flavour (the one the live
//! DaemonSet configures, see [`primary`]) keeps the plain `nvidia-container-toolkit-daemonset`
//! with NVIDIA's own selector (`…container-toolkit=true`), unchanged when a second flavour
//! joins; every other flavour gets `nvidia-container-toolkit-daemonset-<flavour>`, selecting
//! the nodes whose deploy value is that flavour's label. The label stage writes each node's
//! value ([`place`]); nodes of a read-only image get [`READ_ONLY_IMAGE`] on the toolkit's and
//! the driver's keys, so neither runs there, and are reported with what to use instead.
//!
//! A node that changes flavour (a re-image from containerd 1 to 2) is moved make-before-break:
//! [`TOOLKIT_HANDOVER`] keeps the outgoing flavour's DaemonSet on it (or brings the incoming
//! one) until the incoming flavour's pod there is ready. The two write different files
//! (docs/operand-facts.md §6.1), so they never fight over one.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{
    Affinity, NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm,
};

use super::driver::rename_daemon_set;
use super::driver_os::name_nodes;
use super::toolkit::{self, NAME};
use crate::api::{ClusterPolicySpec, ToolkitSpec};
use crate::facts::{ClusterFacts, NodeRuntime, NodeRuntimes, Runtime, RuntimeFlavour};
use crate::nodes::{
    DEPLOY_DRIVER, DEPLOY_TOOLKIT, LabelPatch, NodeView, READ_ONLY_IMAGE, TOOLKIT_HANDOVER,
    is_our_deploy_value,
};

/// Which toolkit DaemonSets to render.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The flavour of the DaemonSet named [`NAME`].
    pub primary: RuntimeFlavour,
    /// The other flavours present (or still handing nodes over), each its own DaemonSet.
    pub others: Vec<RuntimeFlavour>,
}

/// The flavours present on the GPU nodes, and the nodes of read-only images (node, image).
fn present(node_runtimes: &NodeRuntimes) -> (BTreeSet<RuntimeFlavour>, Vec<(String, NodeRuntime)>) {
    let mut flavours = BTreeSet::new();
    let mut read_only = Vec::new();
    for (node, runtime) in node_runtimes {
        match runtime.flavour() {
            Some(f) => {
                flavours.insert(f);
            }
            None => read_only.push((node.clone(), *runtime)),
        }
    }
    (flavours, read_only)
}

/// The flavour of the DaemonSet named [`NAME`]: the one the live DaemonSet configures (`live`)
/// while it serves nodes (nodes of that flavour, or nodes still placed on it), so a flavour
/// joining or a node moving never changes what runs; else the stock layout of the cluster's
/// `runtime` when nodes of it are present (what an operator without flavours rendered); else
/// the first flavour present. The label stage and the render both ask this, from one snapshot.
pub fn primary(
    live: Option<RuntimeFlavour>,
    node_runtimes: &NodeRuntimes,
    gpu_nodes: &[Arc<NodeView>],
    runtime: Runtime,
) -> RuntimeFlavour {
    let (flavours, _) = present(node_runtimes);
    let serving = gpu_nodes
        .iter()
        .any(|n| n.label(DEPLOY_TOOLKIT) == Some("true"));
    let stock = RuntimeFlavour::stock(runtime);
    live.filter(|f| serving || flavours.contains(f))
        .or_else(|| flavours.contains(&stock).then_some(stock))
        .or_else(|| flavours.first().copied())
        .unwrap_or(stock)
}

/// The DaemonSets for `facts`: the primary one always (it keeps the operand's name and
/// status), one per other flavour present or named by a node's [`TOOLKIT_HANDOVER`].
pub fn plan(facts: &ClusterFacts) -> Plan {
    let primary = primary(
        facts.live_toolkit_flavour,
        &facts.node_runtimes,
        &facts.gpu_nodes,
        facts.runtime,
    );
    let (mut flavours, _) = present(&facts.node_runtimes);
    flavours.extend(
        facts
            .gpu_nodes
            .iter()
            .filter_map(|n| RuntimeFlavour::parse(n.label(TOOLKIT_HANDOVER)?)),
    );
    flavours.remove(&primary);
    Plan {
        primary,
        others: flavours.into_iter().collect(),
    }
}

/// The name of a flavour's DaemonSet when it is not the primary one.
pub fn name(flavour: RuntimeFlavour) -> String {
    format!("{NAME}-{}", flavour.label())
}

/// The name of the DaemonSet that runs `flavour`'s toolkit.
pub fn daemon_set_name(flavour: RuntimeFlavour, primary: RuntimeFlavour) -> String {
    if flavour == primary {
        NAME.to_owned()
    } else {
        name(flavour)
    }
}

/// The value of [`DEPLOY_TOOLKIT`] that places a node on `flavour`'s DaemonSet.
fn deploy_value(flavour: RuntimeFlavour, primary: RuntimeFlavour) -> &'static str {
    if flavour == primary {
        "true"
    } else {
        flavour.label()
    }
}

/// Turns a toolkit DaemonSet into a non-primary flavour's: its own name, and the nodes whose
/// deploy value is the flavour's, or whose handover names it, in place of NVIDIA's
/// `…container-toolkit=true`.
pub fn select(ds: &mut DaemonSet, flavour: RuntimeFlavour) {
    if let Some(pod) = ds
        .spec
        .as_mut()
        .and_then(|spec| spec.template.spec.as_mut())
    {
        if let Some(selector) = pod.node_selector.as_mut() {
            selector.remove(DEPLOY_TOOLKIT);
        }
        pod.node_selector = pod.node_selector.take().filter(|s| !s.is_empty());
        let is = |key: &str| NodeSelectorRequirement {
            key: key.to_owned(),
            operator: "In".to_owned(),
            values: Some(vec![flavour.label().to_owned()]),
        };
        let ours = [is(DEPLOY_TOOLKIT), is(TOOLKIT_HANDOVER)];
        let affinity = pod.affinity.get_or_insert_with(Affinity::default);
        let node = affinity
            .node_affinity
            .get_or_insert_with(NodeAffinity::default);
        let required = node
            .required_during_scheduling_ignored_during_execution
            .get_or_insert_with(NodeSelector::default);
        // Terms are ORed and a term's expressions ANDed: each existing term with each of ours.
        let existing = std::mem::take(&mut required.node_selector_terms);
        required.node_selector_terms = if existing.is_empty() {
            ours.into_iter()
                .map(|r| NodeSelectorTerm {
                    match_expressions: Some(vec![r]),
                    ..NodeSelectorTerm::default()
                })
                .collect()
        } else {
            existing
                .iter()
                .flat_map(|term| {
                    ours.iter().map(move |r| {
                        let mut term = term.clone();
                        term.match_expressions
                            .get_or_insert_with(Vec::new)
                            .push(r.clone());
                        term
                    })
                })
                .collect()
        };
    }
    rename_daemon_set(ds, name(flavour));
}

/// Where a node's toolkit runs: what the label stage knows beside the node.
pub struct Placement<'a> {
    pub primary: RuntimeFlavour,
    /// The node's runtime, `None` while its nodeInfo has not been read.
    pub runtime: Option<NodeRuntime>,
    /// Whether the named toolkit DaemonSet's pod on the node is ready.
    pub ready: &'a dyn Fn(&str) -> bool,
}

/// Completes `patch` (the deploy labels the node gets otherwise) with the exact values of the
/// toolkit's and the driver's deploy keys and the [`TOOLKIT_HANDOVER`] label. Values someone
/// else wrote (`false`, `paused-*`) stay; a node whose runtime is not read yet gets no toolkit
/// until it is.
pub fn place(node: &NodeView, mut patch: LabelPatch, at: &Placement<'_>) -> LabelPatch {
    let after = |patch: &LabelPatch, key: &str| -> Option<String> {
        match patch.get(key) {
            Some(value) => value.clone(),
            None => node.label(key).map(str::to_owned),
        }
    };
    let ours = |value: &Option<String>, key: &str| {
        value
            .as_deref()
            .is_some_and(|v| is_our_deploy_value(key, v))
    };
    let driver = after(&patch, DEPLOY_DRIVER);
    let toolkit_wanted = ours(&after(&patch, DEPLOY_TOOLKIT), DEPLOY_TOOLKIT);
    let current = node.label(DEPLOY_TOOLKIT);
    let handover = node.label(TOOLKIT_HANDOVER);
    let mut set = |key: &str, value: Option<&str>| {
        if node.label(key) == value {
            patch.remove(key);
        } else {
            patch.insert(key.to_owned(), value.map(str::to_owned));
        }
    };
    match at.runtime {
        _ if !toolkit_wanted => {
            if handover.is_some() {
                set(TOOLKIT_HANDOVER, None);
            }
        }
        None => {
            if current.is_none() {
                set(DEPLOY_TOOLKIT, None);
            }
        }
        Some(NodeRuntime::ReadOnly(_)) => {
            set(DEPLOY_TOOLKIT, Some(READ_ONLY_IMAGE));
            set(TOOLKIT_HANDOVER, None);
        }
        Some(NodeRuntime::Flavour(flavour)) => {
            let want = deploy_value(flavour, at.primary);
            let ready = || (at.ready)(&daemon_set_name(flavour, at.primary));
            match current {
                // Placed already (or new: nothing to hand over); an outgoing flavour kept
                // beside it leaves once this one's pod is ready.
                None => {
                    set(DEPLOY_TOOLKIT, Some(want));
                    set(TOOLKIT_HANDOVER, None);
                }
                Some(value) if value == want => {
                    if handover.is_some() && ready() {
                        set(TOOLKIT_HANDOVER, None);
                    }
                }
                // Leaving the primary DaemonSet, whose selector is NVIDIA's and cannot name a
                // handover: the incoming flavour comes through the handover first.
                Some("true") => {
                    if handover == Some(flavour.label()) && ready() {
                        set(DEPLOY_TOOLKIT, Some(want));
                        set(TOOLKIT_HANDOVER, None);
                    } else {
                        set(TOOLKIT_HANDOVER, Some(flavour.label()));
                    }
                }
                // Leaving another flavour's DaemonSet: the handover keeps it.
                Some(value) => {
                    set(DEPLOY_TOOLKIT, Some(want));
                    match RuntimeFlavour::parse(value) {
                        Some(outgoing) if outgoing != flavour => {
                            set(TOOLKIT_HANDOVER, Some(outgoing.label()));
                        }
                        _ => set(TOOLKIT_HANDOVER, None),
                    }
                }
            }
        }
    }
    // The driver: off read-only images, back on a node that no longer is one.
    let read_only = matches!(at.runtime, Some(NodeRuntime::ReadOnly(_)));
    if ours(&driver, DEPLOY_DRIVER) {
        set(
            DEPLOY_DRIVER,
            Some(if read_only { READ_ONLY_IMAGE } else { "true" }),
        );
    }
    patch
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
    let (flavours, read_only) = present(&facts.node_runtimes);
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
