//! Layouts by GPU model (pure): the `nvidia.com/device-plugin.config` and `nvidia.com/mig.config`
//! labels each GPU node gets from `spec.layoutsByModel` and its `nvidia.com/gpu.product`, each
//! checked before any node is labelled. The node-pool stage writes them (crate::node_pools, with
//! its record of what the operator set); the IO side is `controller::cluster_policy::node_pools`.
//!
//! Matching: the product and the keys are compared without case, spaces read as dashes, and the
//! product without its MIG suffix (under the `single` strategy GFD writes
//! `NVIDIA-A100-SXM4-40GB-MIG-1g.5gb`). `*` in a key matches any run of characters. A key without
//! `*` wins over patterns; among patterns the one with the most characters other than `*` wins;
//! then the first in key order.
//!
//! Checks, per (entry, GPU model): a sharing key must be one of the sharing config the plugins
//! mount (a node label naming a missing key makes the device plugin's config-manager exit, and
//! makes the whole ConfigMap invalid to validate); a MIG layout must exist and fit the model
//! (`sharing::mig::check_node`, decision 7), with mig-manager on. A failed check freezes that label
//! on the nodes of that model only: they keep the value they carry, and status names the entry.

use std::cmp::Reverse;
use std::collections::BTreeMap;

use crate::api::{ClusterPolicySpec, Component, LayoutsByModel, ModelLayout};
use crate::facts::{ClusterFacts, SharingConfig};
use crate::nodes::{
    DEPLOY_OPERANDS, DEVICE_PLUGIN_CONFIG, GPU_COUNT, GPU_PRODUCT, MIG_CONFIG, NodeView,
};
use crate::operands::mig_manager;
use crate::sharing::list_words;
use crate::sharing::mig::{MigConfigFile, check_node, layout_selects};
use crate::sharing::mig_profiles::board_product;

/// At most this many node names appear per problem; the rest are counted.
const NODES_IN_MESSAGE: usize = 5;

/// What `spec.layoutsByModel` wants on the GPU nodes, and what it could not check.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ByModel {
    /// Per node name, the labels it is to carry. A frozen label carries the node's current value
    /// (so nothing the operator set is removed) or is left out (so nothing is added).
    pub labels: BTreeMap<String, BTreeMap<String, String>>,
    /// Entries whose sharing key cannot be used, with the nodes they froze.
    pub sharing_problem: Option<String>,
    /// Entries whose MIG layout cannot be used, with the nodes they froze.
    pub mig_problem: Option<String>,
}

impl ByModel {
    /// The labels `node` is to carry (none when no entry covers it).
    pub fn labels_for(&self, node: &str) -> Option<&BTreeMap<String, String>> {
        self.labels.get(node)
    }
}

/// A product or key as compared: lower case, spaces as dashes.
fn folded(text: &str) -> String {
    text.trim().to_ascii_lowercase().replace(' ', "-")
}

/// `product` as matched: its board (a MIG suffix stripped), folded.
pub fn normalised_product(product: &str) -> String {
    folded(board_product(product).0)
}

/// Whether `pattern` (folded) matches `text` (folded), `*` matching any run of characters.
fn glob(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut i, mut j) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while j < t.len() {
        if i < p.len() && p[i] != '*' && p[i] == t[j] {
            i += 1;
            j += 1;
        } else if i < p.len() && p[i] == '*' {
            star = Some((i, j));
            i += 1;
        } else if let Some((si, sj)) = star {
            i = si + 1;
            j = sj + 1;
            star = Some((si, sj + 1));
        } else {
            return false;
        }
    }
    p[i..].iter().all(|c| *c == '*')
}

/// The entry of `models` for GPU product `product` (as GFD labels it), with its key.
pub fn entry_for<'a>(
    models: &'a LayoutsByModel,
    product: &str,
) -> Option<(&'a str, &'a ModelLayout)> {
    let product = normalised_product(product);
    models
        .iter()
        .filter(|(key, _)| glob(&folded(key), &product))
        .max_by_key(|(key, _)| {
            (
                !key.contains('*'),
                key.chars().filter(|c| *c != '*').count(),
                Reverse(*key),
            )
        })
        .map(|(key, layout)| (key.as_str(), layout))
}

/// Whether `spec.layoutsByModel` gives `node` a MIG layout: then the operator's `all-disabled`
/// default (decision 7) is not written there.
pub fn names_mig_layout(spec: &ClusterPolicySpec, node: &NodeView) -> bool {
    let (Some(models), Some(product)) = (spec.layouts_by_model.as_ref(), node.label(GPU_PRODUCT))
    else {
        return false;
    };
    entry_for(models, product).is_some_and(|(_, layout)| layout.mig.is_some())
}

/// Checks an entry's sharing key against the config the plugins mount.
fn check_sharing(
    spec: &ClusterPolicySpec,
    mounted: Option<&SharingConfig>,
    key: &str,
) -> Result<(), String> {
    let named = spec
        .device_plugin
        .as_ref()
        .and_then(|d| d.config.as_ref())
        .and_then(|c| c.name.as_deref())
        .filter(|n| !n.is_empty());
    match (named, mounted) {
        (None, _) => Err(
            "spec.devicePlugin.config.name names no sharing ConfigMap; create one holding this key and name it there".to_owned(),
        ),
        (Some(name), None) => Err(format!(
            "the sharing ConfigMap {name} cannot be used yet (see the device-plugin component); fix it first"
        )),
        (Some(_), Some(config)) if config.data.contains_key(key) => Ok(()),
        (Some(_), Some(config)) => {
            let keys: Vec<&str> = config.data.keys().map(String::as_str).collect();
            Err(format!(
                "the sharing ConfigMap {} has no key {key:?} (its keys: {}); add the key or fix the entry",
                config.source,
                list_words(&keys)
            ))
        }
    }
}

/// Problems grouped by message, each with the nodes it froze: `"<message> (nodes a, b and 3
/// more)"` joined with `; `.
fn grouped(problems: BTreeMap<String, Vec<String>>) -> Option<String> {
    (!problems.is_empty()).then(|| {
        problems
            .into_iter()
            .map(|(message, mut nodes)| {
                nodes.sort_unstable();
                let mut listed: Vec<String> =
                    nodes.iter().take(NODES_IN_MESSAGE).cloned().collect();
                if nodes.len() > NODES_IN_MESSAGE {
                    listed.push(format!("{} more", nodes.len() - NODES_IN_MESSAGE));
                }
                let noun = if nodes.len() == 1 { "node" } else { "nodes" };
                format!("{message} (frozen on {noun} {})", list_words(&listed))
            })
            .collect::<Vec<_>>()
            .join("; ")
    })
}

/// What `spec.layoutsByModel` wants on every GPU node of `facts`, checked against `sharing` (the
/// sharing config the plugins are to mount, [`crate::model::ValidatedPolicy::sharing`]) and the
/// MIG layouts mig-manager applies.
pub fn plan(
    spec: &ClusterPolicySpec,
    facts: &ClusterFacts,
    sharing: Option<&SharingConfig>,
) -> ByModel {
    let mut out = ByModel::default();
    let Some(models) = spec.layouts_by_model.as_ref().filter(|m| !m.is_empty()) else {
        return out;
    };
    let mig_on = spec.is_enabled(Component::MigManager);
    let layouts: Result<MigConfigFile, String> = mig_manager::layouts(facts).map_err(|problems| {
        problems
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    });
    // A fleet has a handful of (entry, GPU, count) combinations over thousands of nodes.
    let mut sharing_checks: BTreeMap<&str, Result<(), String>> = BTreeMap::new();
    let mut mig_checks: BTreeMap<(&str, &str, Option<&str>), Result<(), String>> = BTreeMap::new();
    let mut sharing_problems: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut mig_problems: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for node in &facts.gpu_nodes {
        // NFD's GPU label counts as much as our mark: the label stage marks the node in the same
        // pass, and the layout is then written in that pass too rather than the next.
        let gpu = node.is_gpu_node() || node.has_nfd_gpu();
        if !gpu || node.label(DEPLOY_OPERANDS) == Some("false") {
            continue;
        }
        let Some(product) = node.label(GPU_PRODUCT) else {
            continue;
        };
        let Some((key, layout)) = entry_for(models, product) else {
            continue;
        };
        let mut labels = BTreeMap::new();
        if let Some(value) = layout.sharing.as_deref() {
            let checked = sharing_checks
                .entry(value)
                .or_insert_with(|| check_sharing(spec, sharing, value));
            match checked {
                Ok(()) => {
                    labels.insert(DEVICE_PLUGIN_CONFIG.to_owned(), value.to_owned());
                }
                Err(why) => {
                    if let Some(current) = node.label(DEVICE_PLUGIN_CONFIG) {
                        labels.insert(DEVICE_PLUGIN_CONFIG.to_owned(), current.to_owned());
                    }
                    sharing_problems
                        .entry(format!(
                            "spec.layoutsByModel[{key:?}].sharing {value:?}: {why}"
                        ))
                        .or_default()
                        .push(node.name.clone());
                }
            }
        }
        if let Some(value) = layout.mig.as_deref() {
            let count = node.label(GPU_COUNT);
            let checked = mig_checks.entry((value, product, count)).or_insert_with(|| {
                if !mig_on {
                    return Err(
                        "mig-manager is off (spec.migManager.enabled), so nothing would apply the layout; turn it on or drop the entry's mig".to_owned(),
                    );
                }
                match &layouts {
                    Ok(file) => check_node(file, value, product, count).and_then(|()| {
                        if layout_selects(file, value, product) {
                            Ok(())
                        } else {
                            Err(format!(
                                "MIG layout {value:?} has no entry for {} (every entry's device-filter leaves it out), so mig-manager would change nothing there; pick a layout with profiles this model has",
                                board_product(product).0
                            ))
                        }
                    }),
                    Err(why) => Err(format!("the MIG config cannot be used: {why}")),
                }
            });
            match checked {
                Ok(()) => {
                    labels.insert(MIG_CONFIG.to_owned(), value.to_owned());
                }
                Err(why) => {
                    if let Some(current) = node.label(MIG_CONFIG) {
                        labels.insert(MIG_CONFIG.to_owned(), current.to_owned());
                    }
                    mig_problems
                        .entry(format!("spec.layoutsByModel[{key:?}].mig {value:?}: {why}"))
                        .or_default()
                        .push(node.name.clone());
                }
            }
        }
        if !labels.is_empty() {
            out.labels.insert(node.name.clone(), labels);
        }
    }
    out.sharing_problem = grouped(sharing_problems);
    out.mig_problem = grouped(mig_problems);
    out
}

#[cfg(test)]
#[path = "by_model_tests.rs"]
mod tests;
