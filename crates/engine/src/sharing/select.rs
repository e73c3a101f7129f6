//! Validate stage (pure, no IO): which keys of the sharing ConfigMap apply, and whether the
//! ConfigMap as a whole may replace the last good copy the plugins mount (decision 4).
//!
//! Rules:
//! - every key must pass [`validate_key`]: the operator-owned copy holds all keys, and the
//!   plugin's config-manager may switch a node to any of them without a roll;
//! - the default is `devicePlugin.config.default`; without one, a ConfigMap with a single key
//!   uses that key ("default inferred", decision 6); several keys and no default is an error;
//! - a key named by the default or by a node's `nvidia.com/device-plugin.config` label must
//!   exist (config-manager exits when it does not), so removing it makes the whole ConfigMap
//!   invalid; an empty label value counts as absent.
//!
//! An invalid ConfigMap never reaches the nodes: the caller keeps the last good copy.

use std::collections::BTreeMap;

use super::device_plugin::validate_key;
use super::{ConfigProblem, ProblemReason, list_words};
use crate::facts::SharingConfig;
use crate::nodes::DEVICE_PLUGIN_CONFIG;

/// At most this many node names appear in one message; the rest are counted.
const NODES_IN_MESSAGE: usize = 5;

/// The outcome of checking a sharing ConfigMap against the policy and the nodes' labels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SharingDecision {
    /// Every key is valid and every named key exists: mount this config.
    Valid {
        config: SharingConfig,
        /// Things the plugin ignores or overrides, one line each, naming ConfigMap, key and
        /// field.
        warnings: Vec<String>,
        /// Nodes whose label names a missing key, as `(node, label value)`; always empty here,
        /// since such a node makes the config invalid, and kept for the status code's sake.
        nodes_with_missing_key: Vec<(String, String)>,
    },
    /// Keep the last good config and report these.
    Invalid {
        problems: Vec<ConfigProblem>,
        /// Nodes whose label names a missing key, as `(node, label value)`.
        nodes_with_missing_key: Vec<(String, String)>,
    },
}

impl SharingDecision {
    /// The nodes whose label names a key the ConfigMap does not have.
    pub fn nodes_with_missing_key(&self) -> &[(String, String)] {
        match self {
            SharingDecision::Valid {
                nodes_with_missing_key,
                ..
            }
            | SharingDecision::Invalid {
                nodes_with_missing_key,
                ..
            } => nodes_with_missing_key,
        }
    }
}

/// Decides whether the sharing ConfigMap `config_map` (its `data`) can be mounted.
///
/// `default` is `devicePlugin.config.default`; `node_keys` maps node name to the value of its
/// [`DEVICE_PLUGIN_CONFIG`] label; `mig_strategy_override` is `spec.mig.strategy`.
pub fn select_config(
    config_map: &str,
    data: &BTreeMap<String, String>,
    default: Option<&str>,
    node_keys: &BTreeMap<String, String>,
    mig_strategy_override: Option<&str>,
) -> SharingDecision {
    let mut problems = Vec::new();
    let mut warnings = Vec::new();
    let problem = |reason, message: String| ConfigProblem {
        config_map: config_map.to_string(),
        key: None,
        field: None,
        message,
        reason,
    };

    if data.is_empty() {
        problems.push(problem(
            ProblemReason::NoKeys,
            "has no keys; add one key per device plugin config (for example `any` holding a `version: v1` config)".to_string(),
        ));
    }

    for (key, text) in data {
        match validate_key(config_map, key, text, mig_strategy_override) {
            Ok(summary) => warnings.extend(summary.warnings),
            Err(key_problems) => problems.extend(key_problems),
        }
    }

    let keys: Vec<&str> = data.keys().map(String::as_str).collect();
    let default_choice = match default.filter(|d| !d.is_empty()) {
        Some(name) if data.contains_key(name) => Some((name.to_string(), false)),
        Some(name) => {
            problems.push(problem(
                ProblemReason::MissingDefaultKey,
                format!(
                    "spec.devicePlugin.config.default names key {name:?}, which the ConfigMap does not have (its keys: {}); add the key back or point the default at an existing one",
                    list_words(&keys)
                ),
            ));
            None
        }
        None => match keys.as_slice() {
            [only] => Some(((*only).to_string(), true)),
            [] => None,
            several => {
                problems.push(problem(
                    ProblemReason::NoDefault,
                    format!(
                        "has {} keys ({}) and spec.devicePlugin.config.default names none of them; set it to the key that nodes without the {DEVICE_PLUGIN_CONFIG} label should use",
                        several.len(),
                        list_words(several)
                    ),
                ));
                None
            }
        },
    };

    let mut nodes_with_missing_key: Vec<(String, String)> = node_keys
        .iter()
        .filter(|(_, key)| !key.is_empty() && !data.contains_key(key.as_str()))
        .map(|(node, key)| (node.clone(), key.clone()))
        .collect();
    nodes_with_missing_key.sort();
    let mut nodes_by_key: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (node, key) in &nodes_with_missing_key {
        nodes_by_key.entry(key).or_default().push(node);
    }
    for (key, nodes) in nodes_by_key {
        let mut named: Vec<String> = nodes
            .iter()
            .take(NODES_IN_MESSAGE)
            .map(|n| (*n).to_string())
            .collect();
        if nodes.len() > NODES_IN_MESSAGE {
            named.push(format!("{} more", nodes.len() - NODES_IN_MESSAGE));
        }
        let count = if nodes.len() == 1 { "node" } else { "nodes" };
        problems.push(problem(
            ProblemReason::MissingNodeKey,
            format!(
                "has no key {key:?}, but the {DEVICE_PLUGIN_CONFIG} label names it on {count} {}; add the key back or change those labels",
                list_words(&named)
            ),
        ));
    }

    match default_choice {
        Some((default_key, default_inferred)) if problems.is_empty() => SharingDecision::Valid {
            config: SharingConfig {
                source: config_map.to_string(),
                data: data.clone(),
                default_key,
                default_inferred,
            },
            warnings,
            nodes_with_missing_key,
        },
        _ => SharingDecision::Invalid {
            problems,
            nodes_with_missing_key,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n";
    const GOOD_8: &str = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 8\n";

    fn data(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect()
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        data(pairs)
    }

    fn problems(decision: &SharingDecision) -> Vec<String> {
        match decision {
            SharingDecision::Invalid { problems, .. } => {
                problems.iter().map(ToString::to_string).collect()
            }
            SharingDecision::Valid { .. } => panic!("valid: {decision:?}"),
        }
    }

    fn config(decision: SharingDecision) -> SharingConfig {
        match decision {
            SharingDecision::Valid { config, .. } => config,
            SharingDecision::Invalid { problems, .. } => panic!("invalid: {problems:?}"),
        }
    }

    #[test]
    fn named_default_is_used() {
        let d = select_config(
            "device-plugin-config",
            &data(&[("default", GOOD), ("big", GOOD_8)]),
            Some("default"),
            &BTreeMap::new(),
            None,
        );
        let c = config(d);
        assert_eq!(c.default_key, "default");
        assert!(!c.default_inferred);
        assert_eq!(c.source, "device-plugin-config");
        assert_eq!(c.data.len(), 2);
    }

    #[test]
    fn single_key_without_default_is_inferred() {
        // What users type after the plugin's docs: `kubectl create configmap time-slicing-config --from-file=any=any.yaml`
        // and a patch that names no default.
        let c = config(select_config(
            "time-slicing-config",
            &data(&[("any", GOOD)]),
            None,
            &BTreeMap::new(),
            None,
        ));
        assert_eq!(c.default_key, "any");
        assert!(c.default_inferred);
        // An empty default counts as absent.
        let c = config(select_config(
            "time-slicing-config",
            &data(&[("any", GOOD)]),
            Some(""),
            &BTreeMap::new(),
            None,
        ));
        assert!(c.default_inferred);
    }

    #[test]
    fn several_keys_without_default_is_an_error() {
        let d = select_config(
            "cm",
            &data(&[("a", GOOD), ("b", GOOD_8)]),
            None,
            &BTreeMap::new(),
            None,
        );
        let p = problems(&d);
        assert_eq!(p.len(), 1);
        assert_eq!(
            p[0],
            "ConfigMap cm: has 2 keys (a and b) and spec.devicePlugin.config.default names none of them; set it to the key that nodes without the nvidia.com/device-plugin.config label should use"
        );
    }

    #[test]
    fn default_naming_a_missing_key_is_an_error() {
        let p = problems(&select_config(
            "cm",
            &data(&[("a", GOOD)]),
            Some("default"),
            &BTreeMap::new(),
            None,
        ));
        assert!(
            p[0].contains(
                "default names key \"default\", which the ConfigMap does not have (its keys: a)"
            ),
            "{p:?}"
        );
    }

    #[test]
    fn removing_a_key_a_node_label_names_makes_the_config_invalid() {
        let nodes = labels(&[
            ("gpu-node-1", "big"),
            ("gpu-node-2", "default"),
            ("gpu-node-3", "big"),
        ]);
        // Before the edit: both keys exist.
        let before = select_config(
            "cm",
            &data(&[("default", GOOD), ("big", GOOD_8)]),
            Some("default"),
            &nodes,
            None,
        );
        assert!(matches!(before, SharingDecision::Valid { .. }));
        // The edit removes `big` while two nodes still name it.
        let after = select_config(
            "cm",
            &data(&[("default", GOOD)]),
            Some("default"),
            &nodes,
            None,
        );
        assert_eq!(
            after.nodes_with_missing_key(),
            &[
                ("gpu-node-1".to_string(), "big".to_string()),
                ("gpu-node-3".to_string(), "big".to_string())
            ]
        );
        let p = problems(&after);
        assert_eq!(
            p,
            vec![
                "ConfigMap cm: has no key \"big\", but the nvidia.com/device-plugin.config label names it on nodes gpu-node-1 and gpu-node-3; add the key back or change those labels"
                    .to_string()
            ]
        );
    }

    #[test]
    fn empty_label_value_counts_as_absent() {
        let d = select_config(
            "cm",
            &data(&[("any", GOOD)]),
            None,
            &labels(&[("gpu-node-1", "")]),
            None,
        );
        assert!(d.nodes_with_missing_key().is_empty());
        assert!(matches!(d, SharingDecision::Valid { .. }));
    }

    #[test]
    fn one_broken_key_invalidates_the_whole_config() {
        let broken = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 0\n";
        let p = problems(&select_config(
            "cm",
            &data(&[("default", GOOD), ("spare", broken)]),
            Some("default"),
            &BTreeMap::new(),
            None,
        ));
        assert_eq!(p.len(), 1);
        assert!(p[0].starts_with(
            "ConfigMap cm, key \"spare\": sharing.timeSlicing.resources[0].replicas is 0"
        ));
    }

    #[test]
    fn empty_config_map_is_an_error() {
        let p = problems(&select_config(
            "cm",
            &BTreeMap::new(),
            None,
            &BTreeMap::new(),
            None,
        ));
        assert!(p[0].starts_with("ConfigMap cm: has no keys"));
    }

    #[test]
    fn warnings_of_every_key_are_collected() {
        let d = select_config(
            "cm",
            &data(&[("any", "version: v1\nsharring: {}\n")]),
            None,
            &BTreeMap::new(),
            None,
        );
        let SharingDecision::Valid { warnings, .. } = d else {
            panic!("invalid")
        };
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].contains("sharring is not a key the device plugin knows"));
    }

    #[test]
    fn mig_strategy_override_reaches_every_key() {
        let mps = "sharing: {mps: {resources: [{name: gpu, replicas: 2}]}}\n";
        let d = select_config(
            "cm",
            &data(&[("any", mps)]),
            None,
            &BTreeMap::new(),
            Some("mixed"),
        );
        assert!(problems(&d)[0].contains("MIG strategy mixed"));
    }
}
