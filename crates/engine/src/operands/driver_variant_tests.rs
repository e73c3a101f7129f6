#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use k8s_openapi::api::core::v1::NodeSelectorRequirement;

use super::*;
use crate::nodes::{KERNEL_VERSION, OS_ID, OS_VERSION_ID};
use crate::operands::test_support::*;

const PRECOMPILED: &str = "{driver: {usePrecompiled: true, repository: nvcr.io/nvidia, \
    image: driver, version: '580', upgradePolicy: {autoUpgrade: true}}}";
const BUILT: &str = "{driver: {repository: nvcr.io/nvidia, image: driver, version: '580.95.05', \
    upgradePolicy: {autoUpgrade: true}}}";

/// GPU nodes on Ubuntu 22.04 with their kernels (`None`: no kernel label) and, where given,
/// the variant label.
fn nodes(nodes: &[(&str, Option<&str>, Option<Variant>)]) -> ClusterFacts {
    let mut f = facts();
    f.os_tag = Some("ubuntu22.04".to_owned());
    f.gpu_nodes = nodes
        .iter()
        .map(|(name, kernel, variant)| {
            let mut labels: BTreeMap<String, String> = [
                ("feature.node.kubernetes.io/pci-10de.present", "true"),
                ("nvidia.com/gpu.present", "true"),
                ("nvidia.com/gpu.deploy.driver", "true"),
                (OS_ID, "ubuntu"),
                (OS_VERSION_ID, "22.04"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
            if let Some(k) = kernel {
                labels.insert(KERNEL_VERSION.to_owned(), (*k).to_owned());
            }
            if let Some(v) = variant {
                labels.insert(VARIANT_LABEL.to_owned(), v.label().to_owned());
            }
            Arc::new(NodeView::from_labels(name, None, &labels))
        })
        .collect();
    f
}

/// What the API server holds after applying `ds`: our hash annotation, its own annotation and
/// status.
fn applied(ds: &DaemonSet) -> Arc<DaemonSet> {
    let mut live = ds.clone();
    let annotations = live.metadata.annotations.get_or_insert_with(BTreeMap::new);
    annotations.insert(APPLIED_HASH_ANNOTATION.to_owned(), "h".to_owned());
    annotations.insert(TEMPLATE_GENERATION_ANNOTATION.to_owned(), "3".to_owned());
    live.metadata.resource_version = Some("42".to_owned());
    live.status = Some(Default::default());
    Arc::new(live)
}

fn with_live(mut f: ClusterFacts, live: &[DaemonSet]) -> ClusterFacts {
    f.live_driver.daemon_sets = live.iter().map(applied).collect();
    f
}

fn driver_sets(spec: &str, f: &ClusterFacts) -> Vec<DaemonSet> {
    objects(spec, f, Operand::Driver).daemon_sets
}

fn requirement(ds: &DaemonSet) -> Option<NodeSelectorRequirement> {
    variant_requirement(ds).cloned()
}

fn req(operator: &str, values: &[&str]) -> Option<NodeSelectorRequirement> {
    Some(NodeSelectorRequirement {
        key: VARIANT_LABEL.to_owned(),
        operator: operator.to_owned(),
        values: Some(values.iter().map(|v| (*v).to_owned()).collect()),
    })
}

fn name(ds: &DaemonSet) -> &str {
    ds.metadata.name.as_deref().unwrap()
}

fn image(ds: &DaemonSet) -> String {
    container(&pod(ds), driver::MAIN_CONTAINER).image.unwrap()
}

const K1: &str = "5.15.0-1048-aws";
const K2: &str = "6.8.0-1008-aws";

#[test]
fn one_variant_alone_is_labelled_and_placed_nowhere_special() {
    let f = nodes(&[("a", Some(K1), None)]);
    let sets = driver_sets(BUILT, &f);
    assert_eq!(sets.len(), 1);
    assert_eq!(
        sets[0].metadata.labels.as_ref().unwrap()[VARIANT_LABEL],
        "built-on-node"
    );
    assert_eq!(requirement(&sets[0]), None);
    assert_eq!(report(&policy(BUILT).spec, &f), None);
}

#[test]
fn switching_a_running_fleet_keeps_the_running_daemonset_frozen_beside_the_new_one() {
    let f = nodes(&[("a", Some(K1), None), ("b", Some(K2), None)]);
    let running = driver_sets(BUILT, &f);
    let f = with_live(f, &running);
    let sets = driver_sets(PRECOMPILED, &f);
    let names: Vec<&str> = sets.iter().map(name).collect();
    assert_eq!(
        names,
        [
            "nvidia-driver-daemonset-5.15.0-1048-aws-ubuntu22.04",
            "nvidia-driver-daemonset-6.8.0-1008-aws-ubuntu22.04",
            "nvidia-driver-daemonset",
        ]
    );
    // The new DaemonSets take only the nodes handed to them.
    for ds in &sets[..2] {
        assert_eq!(requirement(ds), req("In", &["precompiled"]));
        assert_eq!(
            ds.metadata.labels.as_ref().unwrap()[VARIANT_LABEL],
            "precompiled"
        );
    }
    // The running one keeps the others, runs what it ran, and names where it hands over to.
    let outgoing = &sets[2];
    assert_eq!(requirement(outgoing), req("NotIn", &["precompiled"]));
    assert_eq!(image(outgoing), image(&running[0]));
    assert_eq!(
        image(outgoing),
        "nvcr.io/nvidia/driver:580.95.05-ubuntu22.04"
    );
    let annotations = outgoing.metadata.annotations.as_ref().unwrap();
    assert_eq!(annotations[HANDOVER_ANNOTATION], "precompiled");
    assert!(!annotations.contains_key(APPLIED_HASH_ANNOTATION));
    assert!(!annotations.contains_key(TEMPLATE_GENERATION_ANNOTATION));
    assert_eq!(outgoing.metadata.resource_version, None);
    assert_eq!(outgoing.status, None);
    // Apart from its placement, its pods are what runs.
    let mut unplaced = outgoing.clone();
    place_daemon_set(&mut unplaced, None);
    assert_eq!(pod(&unplaced), pod(&running[0]));
    let line = report(&policy(PRECOMPILED).spec, &f).unwrap();
    assert!(
        line.starts_with(
            "switching from drivers built on the node to precompiled drivers: 2 GPU node(s) \
             not moved yet (a, b); the driver upgrade moves them"
        ),
        "{line}"
    );
}

#[test]
fn the_outgoing_daemonset_goes_once_every_node_it_selects_has_moved() {
    let f = nodes(&[("a", Some(K1), None), ("b", Some(K2), None)]);
    let running = driver_sets(BUILT, &f);
    let started = driver_sets(PRECOMPILED, &with_live(f, &running));

    // One node moved: the old DaemonSet stays for the other.
    let one = with_live(
        nodes(&[
            ("a", Some(K1), Some(Variant::Precompiled)),
            ("b", Some(K2), None),
        ]),
        &started,
    );
    assert_eq!(driver_sets(PRECOMPILED, &one).len(), 3);
    let line = report(&policy(PRECOMPILED).spec, &one).unwrap();
    assert!(line.contains("1 GPU node(s) not moved yet (b)"), "{line}");

    // Both moved: the old one is no longer rendered (so pruned), and the new ones take every
    // node again.
    let both = with_live(
        nodes(&[
            ("a", Some(K1), Some(Variant::Precompiled)),
            ("b", Some(K2), Some(Variant::Precompiled)),
        ]),
        &started,
    );
    let sets = driver_sets(PRECOMPILED, &both);
    assert_eq!(sets.len(), 2);
    assert!(sets.iter().all(|ds| requirement(ds).is_none()));
    assert_eq!(report(&policy(PRECOMPILED).spec, &both), None);
}

#[test]
fn switching_back_midway_keeps_each_node_where_it_runs() {
    let f = nodes(&[("a", Some(K1), None), ("b", Some(K2), None)]);
    let running = driver_sets(BUILT, &f);
    let started = driver_sets(PRECOMPILED, &with_live(f, &running));
    let midway = with_live(
        nodes(&[
            ("a", Some(K1), Some(Variant::Precompiled)),
            ("b", Some(K2), None),
        ]),
        &started,
    );
    let sets = driver_sets(BUILT, &midway);
    // Unlabelled nodes stay with the DaemonSet that keeps them (b); the precompiled pool that
    // runs on a stays, frozen, and hands back; the one that runs nowhere goes.
    let by_name: BTreeMap<&str, &DaemonSet> = sets.iter().map(|ds| (name(ds), ds)).collect();
    assert_eq!(
        by_name.keys().copied().collect::<Vec<_>>(),
        [
            "nvidia-driver-daemonset",
            "nvidia-driver-daemonset-5.15.0-1048-aws-ubuntu22.04",
        ]
    );
    assert_eq!(
        requirement(by_name["nvidia-driver-daemonset"]),
        req("NotIn", &["precompiled"])
    );
    let back = by_name["nvidia-driver-daemonset-5.15.0-1048-aws-ubuntu22.04"];
    assert_eq!(requirement(back), req("In", &["precompiled"]));
    assert_eq!(
        back.metadata.annotations.as_ref().unwrap()[HANDOVER_ANNOTATION],
        "built-on-node"
    );
}

#[test]
fn a_node_the_new_variant_cannot_serve_keeps_its_driver_and_is_named() {
    // c has no kernel label: no precompiled pool selects it.
    let f = nodes(&[("a", Some(K1), None), ("c", None, None)]);
    let running = driver_sets(BUILT, &f);
    let started = driver_sets(PRECOMPILED, &with_live(f, &running));
    let moved = with_live(
        nodes(&[
            ("a", Some(K1), Some(Variant::Precompiled)),
            ("c", None, None),
        ]),
        &started,
    );
    let sets = driver_sets(PRECOMPILED, &moved);
    assert!(sets.iter().any(|ds| name(ds) == "nvidia-driver-daemonset"));
    let line = crate::operands::report(Operand::Driver, &policy(PRECOMPILED).spec, &moved).unwrap();
    assert!(line.contains("not moved yet (c)"), "{line}");
    assert!(line.contains("without a precompiled driver pool"), "{line}");
}

#[test]
fn without_automatic_upgrades_status_gives_the_command_that_moves_a_node() {
    let manual = PRECOMPILED.replace("autoUpgrade: true", "autoUpgrade: false");
    let f = nodes(&[("a", Some(K1), None)]);
    let running = driver_sets(BUILT, &f);
    let f = with_live(f, &running);
    let line = report(&policy(&manual).spec, &f).unwrap();
    assert!(
        line.contains(
            "move each node when no GPU job runs there: kubectl label node <node> \
             nvidia.com/gpu-operator.driver-variant=precompiled"
        ),
        "{line}"
    );
}

#[test]
fn placement_touches_only_the_variant_requirement() {
    let mut p = PodSpec::default();
    let pool = NodeSelectorRequirement {
        key: crate::nodes::DRIVER_POOL.to_owned(),
        operator: "DoesNotExist".to_owned(),
        values: None,
    };
    p.affinity = Some(Affinity {
        node_affinity: Some(NodeAffinity {
            required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_expressions: Some(vec![pool.clone()]),
                    match_fields: None,
                }],
            }),
            ..NodeAffinity::default()
        }),
        ..Affinity::default()
    });
    let before = p.clone();
    place(&mut p, req("In", &["precompiled"]));
    place(&mut p, req("NotIn", &["precompiled"]));
    let terms = &p
        .affinity
        .as_ref()
        .unwrap()
        .node_affinity
        .as_ref()
        .unwrap()
        .required_during_scheduling_ignored_during_execution
        .as_ref()
        .unwrap()
        .node_selector_terms;
    assert_eq!(
        terms[0].match_expressions.as_ref().unwrap(),
        &vec![pool, req("NotIn", &["precompiled"]).unwrap()]
    );
    place(&mut p, None);
    assert_eq!(p, before);
    let mut empty = PodSpec::default();
    place(&mut empty, req("In", &["x"]));
    place(&mut empty, None);
    assert_eq!(empty, PodSpec::default());
}

#[test]
fn the_variant_of_a_daemonset_an_earlier_version_rendered_comes_from_its_labels() {
    let labelled = |pairs: &[(&str, &str)]| DaemonSet {
        metadata: ObjectMeta {
            labels: Some(
                pairs
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..ObjectMeta::default()
        },
        ..DaemonSet::default()
    };
    assert_eq!(
        Variant::of_daemon_set(&labelled(&[(driver::PRECOMPILED_LABEL, "true")])),
        Variant::Precompiled
    );
    assert_eq!(
        Variant::of_daemon_set(&labelled(&[
            (driver::PRECOMPILED_LABEL, "false"),
            (driver_toolkit::IDENTIFICATION_LABEL, "true")
        ])),
        Variant::DriverToolkit
    );
    assert_eq!(
        Variant::of_daemon_set(&labelled(&[(driver::PRECOMPILED_LABEL, "false")])),
        Variant::BuiltOnNode
    );
    for v in Variant::ALL {
        assert_eq!(Variant::parse(v.label()), Some(v));
    }
}
