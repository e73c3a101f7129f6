//! Property of the apply plan (decision 9): for random pairs of valid policies P -> P', applying
//! P and then P' to a simulated cluster leaves every object exactly as render(P') says, in every
//! field we own, while what the server and other managers added stays; a hand edit of a field
//! we own is undone; and a second pass with nothing changed sends nothing.
//!
//! The simulated API server does what server-side apply does for a single field manager: an
//! object is the server's defaults and other managers' fields, overlaid with the last object our
//! manager sent. A field we stop sending is therefore gone, as on a real server.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use proptest::prelude::*;
use serde_json::{Value, json};

use super::plan::{APPLIED_HASH_ANNOTATION, Ledger, Live, Plan, applied_hash, plan};
use crate::api::ClusterPolicy;
use crate::render::inputs::{RenderOptions, facts_for};
use crate::render::render;
use crate::validate::validate;

/// Every object render makes of `spec`, by `Kind/namespace/name`.
fn rendered(spec: &Value) -> BTreeMap<String, Value> {
    let policy = ClusterPolicy::new(
        "cluster-policy",
        serde_json::from_value(spec.clone()).unwrap(),
    );
    let options = RenderOptions {
        namespace: "gpu-operator".to_owned(),
        os_tag: Some("ubuntu22.04".to_owned()),
        ..RenderOptions::default()
    };
    let facts = facts_for(&policy, &options).unwrap();
    render(&validate(&policy, &facts), &facts)
        .to_json()
        .unwrap()
        .into_iter()
        .map(|o| {
            let key = format!(
                "{}/{}/{}",
                o["kind"].as_str().unwrap(),
                o["metadata"]["namespace"].as_str().unwrap_or_default(),
                o["metadata"]["name"].as_str().unwrap()
            );
            (key, o)
        })
        .collect()
}

/// `object` as the applier sends it: with the hash of the rendering as an annotation.
fn annotated(object: &Value) -> (String, Value) {
    let hash = applied_hash(object).unwrap();
    let mut sent = object.clone();
    sent["metadata"]["annotations"][APPLIED_HASH_ANNOTATION] = Value::String(hash.clone());
    (hash, sent)
}

/// What the server and other managers put on an object of ours: defaults, an annotation of
/// another tool, a variable another manager appended to each container.
fn foreign_fields(sent: &Value) -> Value {
    let mut base = json!({
        "metadata": {"uid": "u", "annotations": {"other-tool/note": "kept"}},
    });
    if sent["kind"] == "DaemonSet" {
        base["spec"] = json!({"revisionHistoryLimit": 10, "template": {"spec": {
            "dnsPolicy": "ClusterFirst", "schedulerName": "default-scheduler"}}});
        let containers = sent["spec"]["template"]["spec"]["containers"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|c| {
                json!({"name": c["name"], "terminationMessagePath": "/dev/termination-log",
                    "env": [{"name": "INJECTED_BY_OTHERS", "value": "1"}]})
            })
            .collect::<Vec<_>>();
        base["spec"]["template"]["spec"]["containers"] = Value::Array(containers);
    }
    base
}

/// `top` over `base`: maps merged key by key, keyed lists element by element (base's extra
/// elements kept, as server-side apply keeps other managers' elements), other values from top.
fn overlay(base: &Value, top: &Value) -> Value {
    match (base, top) {
        (Value::Object(b), Value::Object(t)) => {
            let mut out = b.clone();
            for (k, tv) in t {
                let merged = match b.get(k) {
                    Some(bv) => overlay(bv, tv),
                    None => tv.clone(),
                };
                out.insert(k.clone(), merged);
            }
            Value::Object(out)
        }
        (Value::Array(b), Value::Array(t))
            if t.iter().all(|e| e.get("name").is_some())
                && b.iter().all(|e| e.get("name").is_some()) =>
        {
            let mut out: Vec<Value> = t
                .iter()
                .map(|te| match b.iter().find(|be| be["name"] == te["name"]) {
                    Some(be) => overlay(be, te),
                    None => te.clone(),
                })
                .collect();
            out.extend(
                b.iter()
                    .filter(|be| !t.iter().any(|te| te["name"] == be["name"]))
                    .cloned(),
            );
            Value::Array(out)
        }
        (_, t) => t.clone(),
    }
}

/// A simulated API server holding our objects, with resource versions.
#[derive(Default)]
struct Cluster {
    objects: BTreeMap<String, (Value, u64)>,
    next_version: u64,
}

impl Cluster {
    /// One apply pass with an up-to-date cache; returns how many objects were sent.
    fn pass(&mut self, ledger: &mut Ledger, desired: &BTreeMap<String, Value>) -> usize {
        let mut sent_count = 0;
        for (key, object) in desired {
            let (hash, sent) = annotated(object);
            let version = self.objects.get(key).map(|(_, v)| v.to_string());
            let live = self.objects.get(key).map(|(o, _)| Live {
                object: o,
                resource_version: version.as_deref(),
            });
            match plan(ledger, key, &hash, &sent, live, std::time::Instant::now()) {
                Plan::Unchanged => {}
                Plan::Apply(_) => {
                    sent_count += 1;
                    self.next_version += 1;
                    let stored = overlay(&foreign_fields(&sent), &sent);
                    let changed = self.objects.get(key).is_none_or(|(o, _)| *o != stored);
                    // An apply that changes nothing keeps the resource version, as on a server.
                    let new_version = if changed {
                        self.next_version
                    } else {
                        self.objects[key].1
                    };
                    ledger.written(
                        key,
                        &hash,
                        version.as_deref(),
                        Some(new_version.to_string()),
                        std::time::Instant::now(),
                    );
                    self.objects.insert(key.clone(), (stored, new_version));
                }
                other => panic!("{key}: unexpected {other:?} with an up-to-date cache"),
            }
        }
        // Pruning: what was not rendered goes.
        self.objects.retain(|key, _| desired.contains_key(key));
        sent_count
    }

    /// Someone edits a field we own: the first container's image of DaemonSet number `which`.
    fn hand_edit(&mut self, which: usize) -> Option<String> {
        let (key, (object, version)) = self
            .objects
            .iter_mut()
            .filter(|(k, _)| k.starts_with("DaemonSet/"))
            .nth(which)?;
        object["spec"]["template"]["spec"]["containers"][0]["image"] =
            Value::String("example.com/hand-edited:1".into());
        *version += 1000;
        Some(key.clone())
    }
}

/// A valid policy with a random choice for each optional field the issue names (and a few
/// switches that add or remove whole objects).
fn policy() -> impl Strategy<Value = Value> {
    (
        (
            proptest::option::of(any::<bool>()),
            proptest::sample::subsequence(vec!["a", "b", "c"], 0..=3),
            proptest::sample::subsequence(vec!["team", "tier"], 0..=2),
            any::<bool>(),
        ),
        (
            proptest::option::of(prop_oneof![Just("500m"), Just("1")]),
            proptest::option::of(Just("driver-secrets")),
            proptest::sample::subsequence(vec!["regcred", "mirror"], 0..=2),
            proptest::sample::subsequence(vec!["FOO", "BAR"], 0..=2),
        ),
        (any::<bool>(), any::<bool>(), prop_oneof![Just("570.195.03"), Just("580.95.05")]),
    )
        .prop_map(
            |(
                (host_network, annotations, labels, toleration),
                (cpu_limit, secret_env, pull_secrets, env),
                (dcgm_exporter, mig_manager, driver_version),
            )| {
                let mut spec = json!({
                    "operator": {"defaultRuntime": "containerd"},
                    "daemonsets": {},
                    "driver": {"version": driver_version},
                    "devicePlugin": {},
                    "dcgmExporter": {"enabled": dcgm_exporter},
                    "migManager": {"enabled": mig_manager},
                });
                if let Some(h) = host_network {
                    spec["devicePlugin"]["hostNetwork"] = json!(h);
                }
                if !annotations.is_empty() {
                    spec["daemonsets"]["annotations"] = annotations
                        .iter()
                        .map(|k| (format!("example.com/{k}"), json!("v")))
                        .collect();
                }
                if !labels.is_empty() {
                    spec["daemonsets"]["labels"] =
                        labels.iter().map(|k| (k.to_string(), json!("x"))).collect();
                }
                if toleration {
                    spec["daemonsets"]["tolerations"] = json!([
                        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                        {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}
                    ]);
                }
                if let Some(cpu) = cpu_limit {
                    spec["dcgmExporter"]["resources"] = json!({"limits": {"cpu": cpu}});
                }
                if let Some(secret) = secret_env {
                    spec["driver"]["secretEnv"] = json!(secret);
                }
                if !pull_secrets.is_empty() {
                    spec["driver"]["imagePullSecrets"] = json!(pull_secrets);
                    spec["devicePlugin"]["imagePullSecrets"] = json!(pull_secrets);
                }
                if !env.is_empty() {
                    spec["devicePlugin"]["env"] = env
                        .iter()
                        .map(|n| json!({"name": n, "value": "1"}))
                        .collect();
                }
                spec
            },
        )
}

/// The object our manager's last apply should have left: foreign fields plus exactly `object`.
fn expected(object: &Value) -> Value {
    let (_, sent) = annotated(object);
    overlay(&foreign_fields(&sent), &sent)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn applying_p_then_p_prime_leaves_exactly_the_rendering_of_p_prime(
        first in policy(),
        second in policy(),
        edit in proptest::option::of(0usize..4),
    ) {
        let mut cluster = Cluster::default();
        let mut ledger = Ledger::default();
        cluster.pass(&mut ledger, &rendered(&first));
        let edited = edit.and_then(|i| cluster.hand_edit(i));
        let want = rendered(&second);
        cluster.pass(&mut ledger, &want);

        prop_assert_eq!(
            cluster.objects.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>()
        );
        for (key, object) in &want {
            let live = &cluster.objects[key].0;
            prop_assert!(
                *live == expected(object),
                "{} differs from the rendering (hand-edited: {:?}); first difference: {:?}",
                key,
                edited,
                super::plan::first_difference(&expected(object), live, "")
            );
        }
        // Nothing changed: nothing is sent.
        prop_assert_eq!(cluster.pass(&mut ledger, &want), 0);
    }
}

#[test]
fn removing_host_network_and_annotations_is_applied_and_removes_them() {
    // The reproduction, as a fixed case of the property.
    let on = json!({"devicePlugin": {"hostNetwork": true},
        "daemonsets": {"annotations": {"example.com/a": "v"}}});
    let off = json!({});
    let mut cluster = Cluster::default();
    let mut ledger = Ledger::default();
    cluster.pass(&mut ledger, &rendered(&on));
    let plugin = "DaemonSet/gpu-operator/nvidia-device-plugin-daemonset";
    assert_eq!(
        cluster.objects[plugin].0["spec"]["template"]["spec"]["hostNetwork"],
        json!(true)
    );
    assert!(cluster.pass(&mut ledger, &rendered(&off)) > 0);
    let live = &cluster.objects[plugin].0;
    assert_eq!(live["spec"]["template"]["spec"]["hostNetwork"], Value::Null);
    assert_eq!(
        live["metadata"]["annotations"]["example.com/a"],
        Value::Null
    );
    assert_eq!(
        live["metadata"]["annotations"]["other-tool/note"],
        json!("kept")
    );
}
