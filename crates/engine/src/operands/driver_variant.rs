//! Render stage, the driver's variant handover (pure, no IO): a running fleet switches between
//! drivers built on the node, precompiled drivers and OpenShift's Driver Toolkit one node at a
//! time, never every GPU node at once (decision 20; docs/driver-upgrades.md, "Switching
//! driver variants").
//!
//! Every driver DaemonSet of the policy carries its variant ([`VARIANT_LABEL`]), and a GPU node
//! may carry the variant it is handed to (the same key, as a node label). While the policy asks
//! for one variant and DaemonSets of another still run:
//! - the outgoing DaemonSets are kept as they run (a frozen copy: their image and settings are
//!   what their pods run), name the variant they hand over to ([`HANDOVER_ANNOTATION`]) and let
//!   go of the nodes labelled for another variant;
//! - which variant keeps the unlabelled nodes does not change during a handover: it is the one
//!   whose live DaemonSets take unlabelled nodes ([`unlabelled_owner`]). Its DaemonSets select
//!   `NotIn` the other variants, every other variant's select `In` its own;
//! - a node moves when its label is set: by the upgrade controller, within the upgrade policy
//!   (cordon, wait for jobs, drain, then the label instead of a pod deletion), or by hand;
//! - an outgoing DaemonSet is rendered while a GPU node it selects has not moved; then it is
//!   pruned, and the wanted DaemonSets drop their `In` term once no other variant runs (a
//!   placement-only change, which restarts no driver:
//!   upgrade::machine::differs_only_in_metadata_or_placement).
//!
//! A node that no wanted DaemonSet selects (a kernel without a precompiled pool, an RHCOS
//! version without a toolkit tag) is never moved; status names it.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{
    Affinity, NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, PodSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::{driver, driver_toolkit};
use crate::api::ClusterPolicySpec;
use crate::facts::ClusterFacts;
use crate::model::OperandObjects;
use crate::nodes::{DRIVER_VARIANT, NodeView, is_read_label};
use crate::plan::APPLIED_HASH_ANNOTATION;

/// The variant of a driver DaemonSet (its label) and the variant a node is handed to (a node
/// label): the same key.
pub const VARIANT_LABEL: &str = DRIVER_VARIANT;
/// On an outgoing driver DaemonSet: the variant its nodes are handed over to. The upgrade
/// controller moves its nodes; nothing else reads it.
pub const HANDOVER_ANNOTATION: &str = "nvidia.com/gpu-operator.driver-handover-to";
/// Set by the API server on every DaemonSet; never part of what we render.
const TEMPLATE_GENERATION_ANNOTATION: &str = "deprecated.daemonset.template.generation";

/// How the driver gets onto a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Variant {
    /// Built on each node from the driver container (one DaemonSet, or one per OS).
    BuiltOnNode,
    /// Precompiled modules, one DaemonSet per kernel (operands::driver_kernel).
    Precompiled,
    /// Built with OpenShift's Driver Toolkit, one DaemonSet per RHCOS version
    /// (operands::driver_toolkit).
    DriverToolkit,
}

impl Variant {
    pub const ALL: [Variant; 3] = [
        Variant::BuiltOnNode,
        Variant::Precompiled,
        Variant::DriverToolkit,
    ];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            Variant::BuiltOnNode => "built-on-node",
            Variant::Precompiled => "precompiled",
            Variant::DriverToolkit => "driver-toolkit",
        }
    }

    pub fn parse(value: &str) -> Option<Variant> {
        Self::ALL.into_iter().find(|v| v.label() == value)
    }

    /// In prose: "drivers built on the node".
    fn describe(self) -> &'static str {
        match self {
            Variant::BuiltOnNode => "drivers built on the node",
            Variant::Precompiled => "precompiled drivers",
            Variant::DriverToolkit => "drivers built with the Driver Toolkit",
        }
    }

    /// The variant of one of our driver DaemonSets: its label, else (a DaemonSet an earlier
    /// version rendered) the labels each variant always had.
    pub fn of_daemon_set(ds: &DaemonSet) -> Variant {
        let labels = ds.metadata.labels.as_ref();
        let label = |key: &str| labels.and_then(|l| l.get(key)).map(String::as_str);
        if let Some(v) = label(VARIANT_LABEL).and_then(Variant::parse) {
            return v;
        }
        if label(driver::PRECOMPILED_LABEL) == Some("true") {
            Variant::Precompiled
        } else if label(driver_toolkit::IDENTIFICATION_LABEL) == Some("true") {
            Variant::DriverToolkit
        } else {
            Variant::BuiltOnNode
        }
    }
}

/// The variant the policy asks for.
pub fn wanted(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Variant {
    if driver::uses_precompiled(spec) {
        Variant::Precompiled
    } else if driver_toolkit::requested(spec, facts) {
        Variant::DriverToolkit
    } else {
        Variant::BuiltOnNode
    }
}

/// The node-affinity requirement on [`VARIANT_LABEL`] of a DaemonSet's pods, if it has one.
fn variant_requirement(ds: &DaemonSet) -> Option<&NodeSelectorRequirement> {
    ds.spec
        .as_ref()?
        .template
        .spec
        .as_ref()?
        .affinity
        .as_ref()?
        .node_affinity
        .as_ref()?
        .required_during_scheduling_ignored_during_execution
        .as_ref()?
        .node_selector_terms
        .iter()
        .flat_map(|t| t.match_expressions.iter().flatten())
        .find(|r| r.key == VARIANT_LABEL)
}

/// The variant that keeps GPU nodes without [`VARIANT_LABEL`]: the one whose live DaemonSets
/// take them (no `In` requirement on the label); `wanted` when none does (nothing runs yet, or
/// the last handover just ended).
pub fn unlabelled_owner(live: &[std::sync::Arc<DaemonSet>], wanted: Variant) -> Variant {
    live.iter()
        .find(|ds| variant_requirement(ds).is_none_or(|r| r.operator != "In"))
        .map(|ds| Variant::of_daemon_set(ds))
        .unwrap_or(wanted)
}

/// Whether `ds` selects a node with `labels` by its node selector ([`selector_matches`]).
pub fn selects(ds: &DaemonSet, labels: &BTreeMap<String, String>) -> bool {
    node_selector(ds).is_none_or(|s| selector_matches(s, labels))
}

/// A DaemonSet's pod node selector.
pub fn node_selector(ds: &DaemonSet) -> Option<&BTreeMap<String, String>> {
    ds.spec
        .as_ref()?
        .template
        .spec
        .as_ref()?
        .node_selector
        .as_ref()
}

/// Whether a node with `labels` matches `selector`, counting only the keys the operator reads
/// (node views keep only those; the others, such as a user's selector, are the same on every
/// variant's DaemonSets).
pub fn selector_matches(
    selector: &BTreeMap<String, String>,
    labels: &BTreeMap<String, String>,
) -> bool {
    selector
        .iter()
        .filter(|(k, _)| is_read_label(k))
        .all(|(k, v)| labels.get(k) == Some(v))
}

/// For an outgoing driver DaemonSet (one with [`HANDOVER_ANNOTATION`]): the variant its nodes
/// go to, and the node selectors of that variant's DaemonSets among `drivers` (the upgrade
/// controller moves a node only where one of them selects it).
pub fn successors<'a>(
    ds: &DaemonSet,
    drivers: impl IntoIterator<Item = &'a DaemonSet>,
) -> Option<(String, Vec<BTreeMap<String, String>>)> {
    let to = ds.metadata.annotations.as_ref()?.get(HANDOVER_ANNOTATION)?;
    let variant = Variant::parse(to)?;
    let selectors = drivers
        .into_iter()
        .filter(|d| Variant::of_daemon_set(d) == variant)
        .filter(|d| is_handing_over(d).is_none())
        .map(|d| node_selector(d).cloned().unwrap_or_default())
        .collect();
    Some((to.clone(), selectors))
}

/// The variant an outgoing driver DaemonSet hands its nodes to.
pub fn is_handing_over(ds: &DaemonSet) -> Option<&str> {
    ds.metadata
        .annotations
        .as_ref()?
        .get(HANDOVER_ANNOTATION)
        .map(String::as_str)
}

/// The variant a GPU node runs now: its label when that names a variant in `running`, else the
/// owner of unlabelled nodes.
fn current(node: &NodeView, running: &[Variant], owner: Variant) -> Variant {
    node.label(VARIANT_LABEL)
        .and_then(Variant::parse)
        .filter(|v| running.contains(v))
        .unwrap_or(owner)
}

/// The handover in progress, if any: what runs, and the nodes still to move.
#[derive(Clone, Debug, PartialEq)]
pub struct Handover {
    /// The variant keeping unlabelled nodes.
    pub owner: Variant,
    /// Outgoing DaemonSets (frozen copies) that still run on a GPU node that has not moved.
    pub outgoing: Vec<DaemonSet>,
    /// GPU nodes on an outgoing variant, by name.
    pub waiting: Vec<String>,
}

/// The frozen copy of a live DaemonSet: what it runs, without what the API server or the
/// last apply added (status, resource version, applied hash).
fn frozen(live: &DaemonSet) -> DaemonSet {
    let mut annotations = live.metadata.annotations.clone().unwrap_or_default();
    annotations.remove(APPLIED_HASH_ANNOTATION);
    annotations.remove(TEMPLATE_GENERATION_ANNOTATION);
    DaemonSet {
        metadata: ObjectMeta {
            name: live.metadata.name.clone(),
            namespace: live.metadata.namespace.clone(),
            labels: live.metadata.labels.clone(),
            annotations: Some(annotations),
            owner_references: live.metadata.owner_references.clone(),
            ..ObjectMeta::default()
        },
        spec: live.spec.clone(),
        status: None,
    }
}

/// Where a variant's DaemonSets may place pods among `rendered` variants: the owner of
/// unlabelled nodes everywhere but on nodes labelled for another rendered variant, every other
/// variant only on nodes labelled for it. `None`: no requirement (one variant, the owner).
fn placement(
    variant: Variant,
    owner: Variant,
    rendered: &[Variant],
) -> Option<NodeSelectorRequirement> {
    let others: Vec<String> = rendered
        .iter()
        .filter(|v| **v != variant)
        .map(|v| v.label().to_owned())
        .collect();
    if variant == owner {
        (!others.is_empty()).then(|| NodeSelectorRequirement {
            key: VARIANT_LABEL.to_owned(),
            operator: "NotIn".to_owned(),
            values: Some(others),
        })
    } else {
        Some(NodeSelectorRequirement {
            key: VARIANT_LABEL.to_owned(),
            operator: "In".to_owned(),
            values: Some(vec![variant.label().to_owned()]),
        })
    }
}

/// Sets (or with `None` removes) the [`VARIANT_LABEL`] requirement in every node-selector term
/// of the pod's required node affinity, leaving other requirements as they are.
fn place(pod: &mut PodSpec, requirement: Option<NodeSelectorRequirement>) {
    let affinity = pod.affinity.get_or_insert_with(Affinity::default);
    let node = affinity
        .node_affinity
        .get_or_insert_with(NodeAffinity::default);
    let selector = node
        .required_during_scheduling_ignored_during_execution
        .get_or_insert_with(|| NodeSelector {
            node_selector_terms: Vec::new(),
        });
    if selector.node_selector_terms.is_empty() {
        selector
            .node_selector_terms
            .push(NodeSelectorTerm::default());
    }
    for term in &mut selector.node_selector_terms {
        let expressions = term.match_expressions.get_or_insert_with(Vec::new);
        expressions.retain(|r| r.key != VARIANT_LABEL);
        expressions.extend(requirement.clone());
        if expressions.is_empty() {
            term.match_expressions = None;
        }
    }
    selector
        .node_selector_terms
        .retain(|t| t.match_expressions.is_some() || t.match_fields.is_some());
    if selector.node_selector_terms.is_empty() {
        node.required_during_scheduling_ignored_during_execution = None;
    }
    if *node == NodeAffinity::default() {
        affinity.node_affinity = None;
    }
    if *affinity == Affinity::default() {
        pod.affinity = None;
    }
}

fn set_label(ds: &mut DaemonSet, variant: Variant) {
    ds.metadata
        .labels
        .get_or_insert_with(BTreeMap::new)
        .insert(VARIANT_LABEL.to_owned(), variant.label().to_owned());
}

fn place_daemon_set(ds: &mut DaemonSet, requirement: Option<NodeSelectorRequirement>) {
    if let Some(pod) = ds.spec.as_mut().and_then(|s| s.template.spec.as_mut()) {
        place(pod, requirement);
    }
}

/// The handover `facts` call for when the policy wants `wanted` (`None`: nothing to hand
/// over). `wanted_daemon_sets` are the DaemonSets rendered for it.
pub fn handover(
    facts: &ClusterFacts,
    wanted: Variant,
    wanted_daemon_sets: &[DaemonSet],
) -> Option<Handover> {
    let live = &facts.live_driver.daemon_sets;
    let owner = unlabelled_owner(live, wanted);
    let mut running: Vec<Variant> = live.iter().map(|ds| Variant::of_daemon_set(ds)).collect();
    running.push(wanted);
    running.sort();
    running.dedup();
    let wanted_names: Vec<&str> = wanted_daemon_sets
        .iter()
        .filter_map(|d| d.metadata.name.as_deref())
        .collect();
    let mut outgoing = Vec::new();
    let mut waiting = Vec::new();
    for ds in live {
        let variant = Variant::of_daemon_set(ds);
        if variant == wanted
            || ds
                .metadata
                .name
                .as_deref()
                .is_some_and(|n| wanted_names.contains(&n))
        {
            continue;
        }
        let on_it: Vec<&str> = facts
            .gpu_nodes
            .iter()
            .filter(|n| current(n, &running, owner) == variant && selects(ds, &n.labels))
            .map(|n| n.name.as_str())
            .collect();
        if on_it.is_empty() {
            continue;
        }
        waiting.extend(on_it.into_iter().map(str::to_owned));
        outgoing.push(frozen(ds));
    }
    waiting.sort();
    waiting.dedup();
    // Nothing left to move: the wanted DaemonSets take every node again (and drop their `In`
    // term in the same pass the last outgoing DaemonSet is pruned).
    (!outgoing.is_empty()).then_some(Handover {
        owner,
        outgoing,
        waiting,
    })
}

/// The driver's objects for `wanted`, with the DaemonSets of a handover in progress: every
/// DaemonSet labelled with its variant and placed by [`placement`], the outgoing ones naming
/// `wanted` in [`HANDOVER_ANNOTATION`].
pub fn with_handover(facts: &ClusterFacts, wanted: Variant, objects: &mut OperandObjects) {
    let handover = handover(facts, wanted, &objects.daemon_sets);
    let (owner, outgoing) = match handover {
        Some(h) => (h.owner, h.outgoing),
        None => (wanted, Vec::new()),
    };
    let mut rendered: Vec<Variant> = outgoing.iter().map(Variant::of_daemon_set).collect();
    rendered.push(wanted);
    rendered.sort();
    rendered.dedup();
    for ds in &mut objects.daemon_sets {
        set_label(ds, wanted);
        place_daemon_set(ds, placement(wanted, owner, &rendered));
    }
    for mut ds in outgoing {
        let variant = Variant::of_daemon_set(&ds);
        set_label(&mut ds, variant);
        ds.metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(HANDOVER_ANNOTATION.to_owned(), wanted.label().to_owned());
        place_daemon_set(&mut ds, placement(variant, owner, &rendered));
        objects.daemon_sets.push(ds);
    }
}

/// The status line of a handover in progress: which variant to which, the nodes still waiting,
/// and how they move.
pub fn report(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Option<String> {
    if driver::uses_nvidia_driver_crd(spec) {
        return None;
    }
    let wanted = wanted(spec, facts);
    let handover = handover(facts, wanted, &[])?;
    let from: Vec<&str> = {
        let mut v: Vec<Variant> = handover
            .outgoing
            .iter()
            .map(Variant::of_daemon_set)
            .collect();
        v.sort();
        v.dedup();
        v.into_iter().map(Variant::describe).collect()
    };
    let auto = spec
        .driver
        .as_ref()
        .and_then(|d| d.upgrade_policy.as_ref())
        .and_then(|u| u.auto_upgrade)
        .unwrap_or(false);
    let how = if auto {
        "the driver upgrade moves them within driver.upgradePolicy".to_owned()
    } else {
        format!(
            "driver.upgradePolicy.autoUpgrade is off, so move each node when no GPU job runs \
             there: kubectl label node <node> {VARIANT_LABEL}={}",
            wanted.label()
        )
    };
    Some(format!(
        "switching from {} to {}: {} GPU node(s) not moved yet ({}); {how} (a node that no \
         new DaemonSet selects keeps the driver it runs)",
        from.join(" and "),
        wanted.describe(),
        handover.waiting.len(),
        first_ten(&handover.waiting),
    ))
}

/// The first ten names, then how many more.
fn first_ten(names: &[String]) -> String {
    let shown = names[..names.len().min(10)].join(", ");
    match names.len().saturating_sub(10) {
        0 => shown,
        more => format!("{shown} and {more} more"),
    }
}

#[cfg(test)]
#[path = "driver_variant_tests.rs"]
mod tests;
