//! Teardown (pure): what the operator put on one node, to take off when its ClusterPolicy is
//! deleted (decision 17). The IO side lives in the runtime's `teardown` module.
//!
//! Only what carries our mark is removed (decision 19):
//! - node pools and the GPU memory resource: what the record annotation
//!   ([`crate::node_pools::RECORD_ANNOTATION`]) lists, while the node still holds our value;
//! - `nvidia.com/gpu.present` and the deploy keys while they hold `true` (the value we write; a
//!   `false` or `paused-*` someone set is theirs), `gpu.present` kept while another owner's
//!   driver selects on it;
//! - the driver upgrade's state label and annotations, and its cordon only where the upgrade
//!   machine made it: the node is between cordon and uncordon and was not cordoned before its
//!   upgrade began (the machine's own rule for uncordoning).
//!
//! `nvidia.com/mig.config` is left: its value is a MIG layout that the GPUs keep whoever wrote
//! it, and an `all-disabled` we defaulted cannot be told from one a user set.

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1::{Node, Taint};
use serde_json::{Map, Value, json};

use crate::api::NodePoolTaint;
use crate::node_pools::{RECORD_ANNOTATION, Record};
use crate::nodes::GPU_PRESENT;
use crate::upgrade::machine::{
    INITIAL_UNSCHEDULABLE_ANNOTATION, NODE_ANNOTATIONS, STATE_LABEL, UpgradeState,
};
use crate::workload::managed_deploy_keys;

/// The finalizer the operator keeps on the ClusterPolicy in force, so that its teardown can
/// clean the nodes before the policy goes.
pub const FINALIZER: &str = "nvidia.com/gpu-operator-teardown";

/// What comes off one node.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeCleanup {
    /// Label keys removed.
    pub labels: Vec<String>,
    /// Taints removed, as `key=value:effect`.
    pub taints: Vec<String>,
    /// Annotation keys removed.
    pub annotations: Vec<String>,
    /// Extended resources removed from capacity and allocatable.
    pub capacity: Vec<String>,
    /// Whether the node is uncordoned (the upgrade cordoned it).
    pub uncordon: bool,
    /// The node's taint list without ours, when any of ours was there.
    remaining_taints: Option<Vec<Taint>>,
}

/// What the planner needs to know beyond the node. The default is a ClusterPolicy's teardown
/// while a GPUCluster stays.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// Leave `nvidia.com/gpu.present`: an NVIDIADriver's driver DaemonSets select on it.
    pub keep_gpu_present: bool,
    /// Leave what a ClusterPolicy puts on nodes (its deploy keys, `gpu.present`, node pools,
    /// the driver upgrade's marks): a GPUCluster goes while a ClusterPolicy stays in force.
    pub keep_policy_marks: bool,
    /// Take off what a GPUCluster puts on nodes too (the DRA driver's deploy key and those of
    /// its DCGM, exporter and validator): no GPUCluster stays.
    pub gpu_cluster_marks: bool,
}

fn is_our_pool_taint(taint: &Taint, ours: &NodePoolTaint) -> bool {
    taint.key == ours.key
        && taint.effect == ours.effect.as_str()
        && taint.value.as_deref().unwrap_or_default() == ours.value.as_deref().unwrap_or_default()
}

fn describe_taint(taint: &Taint) -> String {
    format!(
        "{}={}:{}",
        taint.key,
        taint.value.as_deref().unwrap_or_default(),
        taint.effect
    )
}

/// Plans what comes off `node` (read in full).
pub fn plan(node: &Node, options: Options) -> NodeCleanup {
    let empty = BTreeMap::new();
    let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
    let annotations = node.metadata.annotations.as_ref().unwrap_or(&empty);
    let record =
        Record::parse(annotations.get(RECORD_ANNOTATION).map(String::as_str)).unwrap_or_default();
    let mut out = NodeCleanup::default();
    if options.gpu_cluster_marks {
        out.labels.extend(
            crate::operands::dra_driver::deploy_keys()
                .filter(|key| labels.get(*key).map(String::as_str) == Some("true"))
                .map(str::to_owned),
        );
    }
    if options.keep_policy_marks {
        out.labels.sort();
        return out;
    }

    for (key, ours) in &record.labels {
        if labels.get(key) == Some(ours) {
            out.labels.push(key.clone());
        }
    }
    let marks = managed_deploy_keys().chain((!options.keep_gpu_present).then_some(GPU_PRESENT));
    for key in marks {
        if labels
            .get(key)
            .is_some_and(|v| crate::nodes::is_our_deploy_value(key, v))
        {
            out.labels.push(key.to_owned());
        }
    }
    let state = labels.get(STATE_LABEL);
    // The upgrade state, the driver variant a switch handed the node to, the runtime flavour
    // and a toolkit handover between flavours.
    for key in [
        STATE_LABEL,
        crate::nodes::DRIVER_VARIANT,
        crate::nodes::RUNTIME_FLAVOUR,
        crate::nodes::TOOLKIT_HANDOVER,
    ] {
        if labels.contains_key(key) {
            out.labels.push(key.to_owned());
        }
    }
    out.labels.sort();
    out.labels.dedup();

    let taints = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    // Our quarantine taint goes with our record beside it (crate::gpu_readiness); a taint of
    // that key without the record is someone else's.
    let quarantined = annotations.contains_key(crate::gpu_readiness::QUARANTINE_ANNOTATION);
    let (removed, kept): (Vec<Taint>, Vec<Taint>) = taints.into_iter().partition(|t| {
        record.taints.iter().any(|ours| is_our_pool_taint(t, ours))
            || (quarantined
                && t.key == crate::gpu_readiness::QUARANTINE_TAINT
                && t.effect == crate::gpu_readiness::QUARANTINE_EFFECT)
    });
    if !removed.is_empty() {
        out.taints = removed.iter().map(describe_taint).collect();
        out.remaining_taints = Some(kept);
    }

    let status = node.status.as_ref();
    let has_resource = |name: &str| {
        [
            status.and_then(|s| s.capacity.as_ref()),
            status.and_then(|s| s.allocatable.as_ref()),
        ]
        .into_iter()
        .flatten()
        .any(|m| m.contains_key(name))
    };
    out.capacity = record
        .memory
        .iter()
        .filter(|m| has_resource(m))
        .cloned()
        .collect();

    out.annotations = NODE_ANNOTATIONS
        .iter()
        .chain([
            &RECORD_ANNOTATION,
            &crate::gpu_readiness::QUARANTINE_ANNOTATION,
        ])
        .filter(|k| annotations.contains_key(**k))
        .map(|k| (*k).to_owned())
        .collect();
    out.annotations.sort();

    let unschedulable = node
        .spec
        .as_ref()
        .and_then(|s| s.unschedulable)
        .unwrap_or(false);
    let cordoned_by_upgrade = UpgradeState::parse(state.map(String::as_str)).in_progress()
        && !annotations.contains_key(INITIAL_UNSCHEDULABLE_ANNOTATION);
    out.uncordon = unschedulable && cordoned_by_upgrade;
    out
}

impl NodeCleanup {
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
            && self.taints.is_empty()
            && self.annotations.is_empty()
            && self.capacity.is_empty()
            && !self.uncordon
    }

    /// The merge patch of the node's status subresource: our extended resources removed.
    pub fn status_patch(&self) -> Option<Value> {
        if self.capacity.is_empty() {
            return None;
        }
        let gone: Map<String, Value> = self
            .capacity
            .iter()
            .map(|name| (name.clone(), Value::Null))
            .collect();
        Some(json!({"status": {"capacity": gone.clone(), "allocatable": gone}}))
    }

    /// The merge patch of the node object: labels, annotations, the taint list and the cordon,
    /// with `resource_version` as a precondition (the taint list is replaced whole, so a taint
    /// someone adds meanwhile must make it fail rather than vanish).
    pub fn object_patch(&self, resource_version: Option<&str>) -> Option<Value> {
        let nulls = |keys: &[String]| -> Map<String, Value> {
            keys.iter().map(|k| (k.clone(), Value::Null)).collect()
        };
        let mut metadata = Map::new();
        if !self.labels.is_empty() {
            metadata.insert("labels".into(), Value::Object(nulls(&self.labels)));
        }
        if !self.annotations.is_empty() {
            metadata.insert(
                "annotations".into(),
                Value::Object(nulls(&self.annotations)),
            );
        }
        let mut spec = Map::new();
        if let Some(taints) = &self.remaining_taints {
            spec.insert("taints".into(), json!(taints));
        }
        if self.uncordon {
            spec.insert("unschedulable".into(), Value::Bool(false));
        }
        if metadata.is_empty() && spec.is_empty() {
            return None;
        }
        if let Some(rv) = resource_version {
            metadata.insert("resourceVersion".into(), Value::String(rv.to_owned()));
        }
        let mut patch = json!({ "metadata": metadata });
        if !spec.is_empty() {
            patch["spec"] = Value::Object(spec);
        }
        Some(patch)
    }
}

impl fmt::Display for NodeCleanup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        let mut list = |what: &str, items: &[String]| {
            if !items.is_empty() {
                parts.push(format!("{what} {}", items.join(", ")));
            }
        };
        list("labels", &self.labels);
        list("taints", &self.taints);
        list("capacity", &self.capacity);
        list("annotations", &self.annotations);
        if self.uncordon {
            parts.push("the upgrade's cordon".to_owned());
        }
        if parts.is_empty() {
            return f.write_str("nothing");
        }
        f.write_str(&parts.join("; "))
    }
}

/// Whether a pod holds on to PriorityClass `name`: it names it and has not finished.
pub fn pod_holds_priority_class(
    priority_class: Option<&str>,
    phase: Option<&str>,
    name: &str,
) -> bool {
    priority_class == Some(name) && !matches!(phase, Some("Succeeded" | "Failed"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use k8s_openapi::api::core::v1::{NodeSpec, NodeStatus};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;
    use crate::api::TaintEffect;

    fn taint(key: &str, value: &str, effect: &str) -> Taint {
        Taint {
            key: key.into(),
            value: Some(value.into()),
            effect: effect.into(),
            time_added: None,
        }
    }

    fn record() -> String {
        let record = Record {
            want: "f".into(),
            labels: [
                ("gpu-type".to_string(), "a100".to_string()),
                ("team".to_string(), "ml".to_string()),
            ]
            .into(),
            taints: vec![NodePoolTaint {
                key: "dedicated".into(),
                value: Some("gpu".into()),
                effect: TaintEffect::NoExecute,
            }],
            memory: Some("example.com/vram".into()),
        };
        serde_json::to_string(&record).unwrap()
    }

    fn node(labels: &[(&str, &str)], annotations: &[(&str, &str)], taints: Vec<Taint>) -> Node {
        let map = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>()
        };
        let vram: BTreeMap<String, Quantity> =
            [("example.com/vram".to_string(), Quantity("320".into()))].into();
        Node {
            metadata: ObjectMeta {
                name: Some("gpu-1".into()),
                resource_version: Some("9".into()),
                labels: Some(map(labels)),
                annotations: Some(map(annotations)),
                ..ObjectMeta::default()
            },
            spec: Some(NodeSpec {
                taints: Some(taints),
                unschedulable: Some(true),
                ..NodeSpec::default()
            }),
            status: Some(NodeStatus {
                capacity: Some(vram.clone()),
                allocatable: Some(vram),
                ..NodeStatus::default()
            }),
        }
    }

    #[test]
    fn a_teardown_removes_our_quarantine_taint_and_record_but_not_a_foreign_taint_of_that_key() {
        use crate::gpu_readiness::{QUARANTINE_ANNOTATION, QUARANTINE_TAINT};
        let ours = node(
            &[],
            &[(QUARANTINE_ANNOTATION, "{}")],
            vec![
                taint(QUARANTINE_TAINT, "gpus-missing", "NoSchedule"),
                taint("other", "x", "NoSchedule"),
            ],
        );
        let cleanup = plan(&ours, Options::default());
        assert_eq!(
            cleanup.taints,
            [format!("{QUARANTINE_TAINT}=gpus-missing:NoSchedule")]
        );
        assert_eq!(
            cleanup.remaining_taints,
            Some(vec![taint("other", "x", "NoSchedule")])
        );
        assert!(
            cleanup
                .annotations
                .contains(&QUARANTINE_ANNOTATION.to_owned())
        );
        let foreign = node(
            &[],
            &[],
            vec![taint(QUARANTINE_TAINT, "set-by-hand", "NoSchedule")],
        );
        assert!(plan(&foreign, Options::default()).taints.is_empty());
    }

    #[test]
    fn only_what_the_record_and_our_values_mark_comes_off() {
        let record = record();
        let node = node(
            &[
                ("gpu-type", "a100"),
                // Someone changed it since: theirs now.
                ("team", "infra"),
                (GPU_PRESENT, "true"),
                ("nvidia.com/gpu.deploy.driver", "true"),
                // A user's or another tool's value.
                (
                    "nvidia.com/gpu.deploy.device-plugin",
                    "paused-for-mig-change",
                ),
                ("nvidia.com/gpu.deploy.operands", "false"),
                ("nvidia.com/mig.config", "all-disabled"),
                // A driver variant switch handed the node over.
                (crate::nodes::DRIVER_VARIANT, "precompiled"),
            ],
            &[(RECORD_ANNOTATION, &record)],
            vec![
                taint("dedicated", "gpu", "NoExecute"),
                taint("dedicated", "other", "NoExecute"),
                taint("reserved", "yes", "NoSchedule"),
            ],
        );
        let cleanup = plan(&node, Options::default());
        assert_eq!(
            cleanup.labels,
            [
                "gpu-type",
                "nvidia.com/gpu-operator.driver-variant",
                "nvidia.com/gpu.deploy.driver",
                GPU_PRESENT
            ]
        );
        assert_eq!(cleanup.taints, ["dedicated=gpu:NoExecute"]);
        assert_eq!(cleanup.capacity, ["example.com/vram"]);
        assert_eq!(cleanup.annotations, [RECORD_ANNOTATION]);
        assert!(!cleanup.uncordon, "cordoned by someone, not by an upgrade");
        let patch = cleanup.object_patch(Some("9")).unwrap();
        assert_eq!(patch["metadata"]["resourceVersion"], "9");
        assert_eq!(patch["metadata"]["labels"]["gpu-type"], Value::Null);
        assert_eq!(
            patch["spec"]["taints"],
            json!([
                {"key": "dedicated", "value": "other", "effect": "NoExecute"},
                {"key": "reserved", "value": "yes", "effect": "NoSchedule"},
            ])
        );
        assert!(patch["spec"].get("unschedulable").is_none());
        assert_eq!(
            cleanup.status_patch().unwrap(),
            json!({"status": {"capacity": {"example.com/vram": null}, "allocatable": {"example.com/vram": null}}})
        );
    }

    #[test]
    fn gpu_present_stays_while_another_owner_selects_on_it() {
        let node = node(&[(GPU_PRESENT, "true")], &[], vec![]);
        let kept = plan(
            &node,
            Options {
                keep_gpu_present: true,
                ..Options::default()
            },
        );
        assert!(kept.is_empty(), "{kept}");
        assert_eq!(plan(&node, Options::default()).labels, [GPU_PRESENT]);
    }

    #[test]
    fn each_owner_takes_off_only_its_own_deploy_keys_and_only_where_they_hold_true() {
        let dra = crate::operands::dra_driver::DEPLOY_LABEL;
        let node = node(
            &[
                (dra, "true"),
                ("nvidia.com/gpu.deploy.dra-validator", "true"),
                // A user's or a driver manager's value is theirs.
                ("nvidia.com/gpu.deploy.dcgm-dra", "false"),
                (crate::nodes::DEPLOY_DEVICE_PLUGIN, "true"),
                (GPU_PRESENT, "true"),
            ],
            &[],
            vec![],
        );
        // A ClusterPolicy goes, a GPUCluster stays: the DRA keys stay.
        assert_eq!(
            plan(&node, Options::default()).labels,
            [crate::nodes::DEPLOY_DEVICE_PLUGIN, GPU_PRESENT]
        );
        // A GPUCluster goes, a ClusterPolicy stays: only the DRA keys go.
        let gpu_cluster_only = Options {
            keep_policy_marks: true,
            gpu_cluster_marks: true,
            ..Options::default()
        };
        assert_eq!(
            plan(&node, gpu_cluster_only).labels,
            [dra, "nvidia.com/gpu.deploy.dra-validator"]
        );
        // Neither stays: everything of ours goes.
        let everything = Options {
            gpu_cluster_marks: true,
            ..Options::default()
        };
        assert_eq!(
            plan(&node, everything).labels,
            [
                crate::nodes::DEPLOY_DEVICE_PLUGIN,
                dra,
                "nvidia.com/gpu.deploy.dra-validator",
                GPU_PRESENT
            ]
        );
    }

    #[test]
    fn the_upgrade_cordon_is_lifted_only_where_the_upgrade_made_it() {
        let mid = node(
            &[(STATE_LABEL, "wait-for-jobs-required")],
            &[("nvidia.com/gpu-driver-upgrade-enabled", "true")],
            vec![],
        );
        let cleanup = plan(&mid, Options::default());
        assert!(cleanup.uncordon);
        assert_eq!(cleanup.labels, [STATE_LABEL]);
        assert_eq!(
            cleanup.annotations,
            ["nvidia.com/gpu-driver-upgrade-enabled"]
        );
        assert_eq!(
            cleanup.object_patch(None).unwrap()["spec"]["unschedulable"],
            false
        );

        // Cordoned by its owner before the upgrade began: stays cordoned.
        let owners = node(
            &[(STATE_LABEL, "drain-required")],
            &[(INITIAL_UNSCHEDULABLE_ANNOTATION, "true")],
            vec![],
        );
        assert!(!plan(&owners, Options::default()).uncordon);
        // Not yet cordoned by the upgrade, or done with it: a cordon there is someone's.
        for state in ["upgrade-required", "upgrade-done"] {
            let n = node(&[(STATE_LABEL, state)], &[], vec![]);
            assert!(!plan(&n, Options::default()).uncordon, "{state}");
        }
    }

    #[test]
    fn a_clean_node_needs_no_patch() {
        let mut clean = node(&[("team", "ml")], &[], vec![taint("a", "b", "NoSchedule")]);
        clean.status = None;
        let cleanup = plan(&clean, Options::default());
        assert!(cleanup.is_empty());
        assert_eq!(cleanup.object_patch(Some("1")), None);
        assert_eq!(cleanup.status_patch(), None);
        assert_eq!(cleanup.to_string(), "nothing");
    }

    #[test]
    fn a_priority_class_is_held_by_pods_that_have_not_finished() {
        assert!(pod_holds_priority_class(
            Some("gpu"),
            Some("Running"),
            "gpu"
        ));
        assert!(pod_holds_priority_class(
            Some("gpu"),
            Some("Pending"),
            "gpu"
        ));
        assert!(!pod_holds_priority_class(
            Some("gpu"),
            Some("Succeeded"),
            "gpu"
        ));
        assert!(!pod_holds_priority_class(
            Some("other"),
            Some("Running"),
            "gpu"
        ));
        assert!(!pod_holds_priority_class(None, None, "gpu"));
    }
}
