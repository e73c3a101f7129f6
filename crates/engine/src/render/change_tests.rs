//! How render output changes with the policy, so a change rolls only what it must: switching one
//! operand off removes exactly that operand's objects (and touches only the objects that
//! document a dependency on it); changing only the sharing config changes only the copy and
//! the config hash (with the copy's name) of the device plugin, GFD and MPS daemon templates.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};

use super::invariant_tests::{examples, fact_variants};
use super::render;
use crate::api::ClusterPolicy;
use crate::facts::{ClusterFacts, ConfigMapData};
use crate::model::{CONFIG_HASH_ANNOTATION, OPERAND_LABEL};
use crate::operands::device_plugin::{AVAILABLE_CONFIGS_VOLUME, CONFIG_COPY_LABEL};
use crate::validate::validate;

/// Every rendered object by `Kind/name`.
fn objects(policy: &ClusterPolicy, facts: &ClusterFacts) -> BTreeMap<String, Value> {
    let state = render(&validate(policy, facts), facts);
    state
        .to_json()
        .unwrap()
        .into_iter()
        .map(|o| {
            let key = format!(
                "{}/{}",
                o["kind"].as_str().unwrap(),
                o["metadata"]["name"].as_str().unwrap()
            );
            (key, o)
        })
        .collect()
}

fn example(name: &str) -> ClusterPolicy {
    examples().into_iter().find(|(n, _)| n == name).unwrap().1
}

fn with(policy: &ClusterPolicy, patch: Value) -> ClusterPolicy {
    let mut spec = serde_json::to_value(&policy.spec).unwrap();
    merge(&mut spec, &patch);
    ClusterPolicy::new("cluster-policy", serde_json::from_value(spec).unwrap())
}

fn merge(base: &mut Value, patch: &Value) {
    match (base, patch) {
        (Value::Object(b), Value::Object(p)) => {
            for (k, v) in p {
                merge(b.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (b, p) => *b = p.clone(),
    }
}

#[test]
fn disabling_one_operand_removes_exactly_its_objects() {
    // Each switch, the operands it governs, and the DaemonSets of other operands that document
    // a dependency on it (and so may change).
    let switches: [(&str, &[&str], &[&str]); 9] = [
        ("driver", &["driver"], &[]),
        // The device plugin and MIG manager point at the toolkit's CDI hook.
        (
            "toolkit",
            &["container-toolkit"],
            &["nvidia-device-plugin-daemonset", "nvidia-mig-manager"],
        ),
        // The validator's plugin stage and GFD's config-manager need the plugin.
        (
            "devicePlugin",
            &["device-plugin", "mps-control-daemon"],
            &["nvidia-operator-validator", "gpu-feature-discovery"],
        ),
        ("gfd", &["gpu-feature-discovery"], &[]),
        // The exporter embeds its own engine without the standalone one.
        ("dcgm", &["dcgm"], &["nvidia-dcgm-exporter"]),
        ("dcgmExporter", &["dcgm-exporter"], &[]),
        ("migManager", &["mig-manager"], &[]),
        ("nodeStatusExporter", &["node-status-exporter"], &[]),
        ("nfd", &["node-feature-discovery"], &[]),
    ];
    let everything_on = json!({"dcgm": {"enabled": true}, "nodeStatusExporter": {"enabled": true}});
    for example_name in [
        "clusterpolicy-default.yaml",
        "clusterpolicy-time-slicing.yaml",
        "clusterpolicy-maximal.yaml",
    ] {
        let base_policy = with(&example(example_name), everything_on.clone());
        for (variant, facts) in fact_variants(&base_policy).into_iter().take(4) {
            let base = objects(&base_policy, &facts);
            for (switch, operands, coupled) in switches {
                let off = objects(
                    &with(&base_policy, json!({switch: {"enabled": false}})),
                    &facts,
                );
                let case = format!("{example_name} [{variant}] {switch}=false");
                let of_operands: BTreeSet<&String> = base
                    .iter()
                    .filter(|(_, o)| {
                        operands.contains(&o["metadata"]["labels"][OPERAND_LABEL].as_str().unwrap())
                    })
                    .map(|(k, _)| k)
                    .collect();
                assert!(!of_operands.is_empty(), "{case}: nothing to remove");
                let removed: BTreeSet<&String> =
                    base.keys().filter(|k| !off.contains_key(*k)).collect();
                assert_eq!(removed, of_operands, "{case}: removed objects");
                assert!(
                    off.keys().all(|k| base.contains_key(k)),
                    "{case}: objects added"
                );
                for (key, object) in &off {
                    let name = object["metadata"]["name"].as_str().unwrap();
                    if object != &base[key] {
                        assert!(
                            object["kind"] == "DaemonSet" && coupled.contains(&name),
                            "{case}: {key} changed"
                        );
                    }
                }
            }
        }
    }
}

fn sharing_facts(policy: &ClusterPolicy, replicas: u32) -> ClusterFacts {
    let (_, mut facts) = fact_variants(policy).remove(0);
    let config = format!(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: {replicas}\n"
    );
    facts.sharing_source = Some(ConfigMapData {
        name: "device-plugin-config".to_owned(),
        data: [("default".to_owned(), config)].into(),
    });
    facts
}

/// The object without what a sharing-config change may change: the config hash annotation and
/// the copy the `available-configs` volume names.
fn without_sharing_refs(object: &Value) -> Value {
    let mut object = object.clone();
    if let Some(annotations) = object["spec"]["template"]["metadata"]["annotations"].as_object_mut()
    {
        annotations.remove(CONFIG_HASH_ANNOTATION);
    }
    if let Some(volumes) = object["spec"]["template"]["spec"]["volumes"].as_array_mut() {
        for v in volumes {
            if v["name"] == AVAILABLE_CONFIGS_VOLUME {
                v["configMap"]["name"] = json!("<copy>");
            }
        }
    }
    object
}

#[test]
fn changing_only_the_sharing_config_changes_only_the_consumers_config_hash() {
    let policy = example("clusterpolicy-time-slicing.yaml");
    let four = objects(&policy, &sharing_facts(&policy, 4));
    let eight = objects(&policy, &sharing_facts(&policy, 8));
    let is_copy = |o: &Value| o["metadata"]["labels"][CONFIG_COPY_LABEL] == "sharing";
    let copies = |objects: &BTreeMap<String, Value>| -> Vec<String> {
        objects
            .iter()
            .filter(|(_, o)| is_copy(o))
            .map(|(k, _)| k.clone())
            .collect()
    };
    assert_eq!(copies(&four).len(), 1);
    assert_ne!(copies(&four), copies(&eight), "a new config is a new copy");
    let rest = |objects: &BTreeMap<String, Value>| -> BTreeMap<String, Value> {
        objects
            .iter()
            .filter(|(_, o)| !is_copy(o))
            .map(|(k, o)| (k.clone(), o.clone()))
            .collect()
    };
    let (four, eight) = (rest(&four), rest(&eight));
    assert_eq!(
        four.keys().collect::<Vec<_>>(),
        eight.keys().collect::<Vec<_>>()
    );
    let mut hash_changed = BTreeSet::new();
    for (key, a) in &four {
        let b = &eight[key];
        assert_eq!(
            without_sharing_refs(a),
            without_sharing_refs(b),
            "{key} changed beyond its config hash"
        );
        let hash = |o: &Value| {
            o["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION].clone()
        };
        if hash(a) != hash(b) {
            hash_changed.insert(key.as_str());
        }
    }
    assert_eq!(
        hash_changed,
        BTreeSet::from([
            "DaemonSet/gpu-feature-discovery",
            "DaemonSet/nvidia-device-plugin-daemonset",
            "DaemonSet/nvidia-device-plugin-mps-control-daemon",
        ])
    );
}

#[test]
fn fields_reported_as_not_acted_on_leave_the_rendering_unchanged() {
    // One value per rule of `NOT_ACTED_ON` that asks for something.
    let patches = [
        (
            "spec.operator.defaultRuntime",
            json!({"operator": {"defaultRuntime": "crio"}}),
        ),
        (
            "spec.operator.initContainer",
            json!({"operator": {"initContainer": {"repository": "r.example", "image": "cuda", "version": "12"}}}),
        ),
        ("spec.psp", json!({"psp": {"enabled": true}})),
        ("spec.cdi.default", json!({"cdi": {"default": true}})),
        (
            "spec.driver.useOpenKernelModules",
            json!({"driver": {"useOpenKernelModules": true}}),
        ),
        ("spec.dcgm.hostPort", json!({"dcgm": {"hostPort": 5555}})),
        (
            "spec.gds.args",
            json!({"gds": {"enabled": true, "args": ["--verbose"]}}),
        ),
        (
            "spec.gdrcopy.args",
            json!({"gdrcopy": {"enabled": true, "args": ["--verbose"]}}),
        ),
    ];
    let rules: BTreeSet<&str> = crate::api::NOT_ACTED_ON.iter().map(|(p, _)| *p).collect();
    let patched: BTreeSet<&str> = patches.iter().map(|(p, _)| *p).collect();
    assert_eq!(patched, rules, "one patch per rule");

    // Every operand on, so that no field goes unread only because its operand is off.
    let base = with(
        &example("clusterpolicy-default.yaml"),
        json!({"dcgm": {"enabled": true}, "nodeStatusExporter": {"enabled": true},
            "gds": {"enabled": true}, "gdrcopy": {"enabled": true}}),
    );
    for (rule, patch) in patches {
        let policy = with(&base, patch);
        let reported = policy.spec.unsupported_fields();
        assert!(
            reported.iter().any(|u| u.path.starts_with(rule)),
            "{rule}: not reported ({reported:?})"
        );
        for (variant, facts) in fact_variants(&base) {
            assert!(
                objects(&base, &facts) == objects(&policy, &facts),
                "{rule} changes the rendering ({variant}), so it is acted on: take it out of \
                 NOT_ACTED_ON"
            );
        }
    }
}
