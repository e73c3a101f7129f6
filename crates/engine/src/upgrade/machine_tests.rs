//! The driver upgrade state machine, step by step (pure; the IO half is proven on the harness
//! by tests/e2e/tests/upgrade.rs).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::machine::*;
use crate::api::DriverUpgradePolicySpec;

const NOW: i64 = 1_000_000;

fn policy(yaml: &str, nodes: usize) -> Policy {
    let spec: DriverUpgradePolicySpec = serde_yaml_ng::from_str(yaml).unwrap();
    Policy::from_spec(&spec, nodes)
}

fn driver(current: bool, ready: bool) -> Option<DriverPod> {
    let revision = if current {
        DriverRevision::Current
    } else {
        DriverRevision::Outdated
    };
    driver_on(revision, ready)
}

fn driver_on(revision: DriverRevision, ready: bool) -> Option<DriverPod> {
    Some(DriverPod {
        name: "nvidia-driver-daemonset-x".into(),
        daemon_set: "nvidia-driver-daemonset".into(),
        revision,
        handover_to: None,
        ready,
        failing: false,
        created: NOW - 10,
    })
}

fn node(name: &str, state: UpgradeState) -> NodeFacts {
    NodeFacts {
        name: name.into(),
        state: Some(state),
        driver: driver(false, true),
        validator_expected: true,
        ..NodeFacts::default()
    }
}

fn pod(name: &str) -> PodFacts {
    PodFacts {
        namespace: "ml".into(),
        name: name.into(),
        managed: true,
        ..PodFacts::default()
    }
}

#[test]
fn labels_round_trip_in_nvidia_spelling_and_unknown_values_mean_no_state() {
    for state in UpgradeState::ALL {
        assert_eq!(UpgradeState::parse(Some(state.label())), state);
    }
    assert_eq!(
        UpgradeState::PodRestartRequired.label(),
        "pod-restart-required"
    );
    assert_eq!(UpgradeState::parse(Some("banana")), UpgradeState::Unknown);
    assert_eq!(STATE_LABEL, "nvidia.com/gpu-driver-upgrade-state");
}

#[test]
fn defaults_and_max_unavailable_follow_nvidia() {
    let p = policy("{autoUpgrade: true}", 12);
    assert_eq!(p.max_parallel, 1);
    assert_eq!(p.max_unavailable, 3, "25% of 12");
    assert_eq!(p.pod_deletion.timeout, Some(Duration::from_secs(300)));
    assert!(p.drain.is_none());
    assert_eq!(
        max_unavailable(Some(&IntOrString::String("10%".into())), 12),
        2,
        "rounded up"
    );
    assert_eq!(max_unavailable(Some(&IntOrString::Int(4)), 12), 4);
    let p = policy(
        "{drain: {enable: true, timeoutSeconds: 0, podSelector: 'a=b'}, waitForCompletion: {podSelector: 'job=x', timeoutSeconds: 30}}",
        4,
    );
    let drain = p.drain.unwrap();
    assert_eq!(drain.timeout, None, "0 waits forever");
    assert_eq!(drain.pod_selector.as_deref(), Some("a=b"));
    assert_eq!(
        p.wait_for,
        Some(("job=x".to_owned(), Some(Duration::from_secs(30))))
    );
}

#[test]
fn a_current_driver_is_done_and_an_old_one_requires_an_upgrade_remembering_a_prior_cordon() {
    let p = policy("{}", 1);
    let mut n = node("a", UpgradeState::Unknown);
    n.driver = driver(true, true);
    assert_eq!(step(&n, &p, false, NOW).next, Some(UpgradeState::Done));
    n.state = Some(UpgradeState::Done);
    assert_eq!(step(&n, &p, false, NOW), Step::default());

    n.driver = driver(false, true);
    n.unschedulable = true;
    let s = step(&n, &p, false, NOW);
    assert_eq!(s.next, Some(UpgradeState::UpgradeRequired));
    assert!(s.actions.contains(&Action::Annotate(
        INITIAL_UNSCHEDULABLE_ANNOTATION,
        Some("true".into())
    )));
    // A failed node retried (its label removed) is cordoned by the operator: not recorded.
    n.annotations
        .insert(FAILURE_ANNOTATION.into(), "drain timed out".into());
    n.state = None;
    let s = step(&n, &p, false, NOW);
    assert_eq!(s.next, Some(UpgradeState::UpgradeRequired));
    assert!(s.actions.is_empty(), "{:?}", s.actions);
    n.annotations.clear();
    n.state = Some(UpgradeState::Done);
    // A user's request upgrades a node whose driver is current.
    n.driver = driver(true, true);
    n.unschedulable = false;
    n.annotations
        .insert(REQUESTED_ANNOTATION.into(), "true".into());
    let s = step(&n, &p, false, NOW);
    assert_eq!(s.next, Some(UpgradeState::UpgradeRequired));
    assert!(
        s.actions
            .contains(&Action::Annotate(REQUESTED_ANNOTATION, None))
    );
}

#[test]
fn slots_are_the_parallel_limit_less_in_progress_and_failed_within_max_unavailable() {
    let p = policy("{maxParallelUpgrades: 3, maxUnavailable: 100%}", 6);
    let mut nodes: Vec<NodeFacts> = (0..6)
        .map(|i| node(&format!("n{i}"), UpgradeState::UpgradeRequired))
        .collect();
    assert_eq!(upgrades_available(&nodes, &p), 3);
    let started: Vec<String> = plan(&nodes, &p, NOW)
        .into_iter()
        .filter(|(_, s)| s.next == Some(UpgradeState::CordonRequired))
        .map(|(n, _)| n)
        .collect();
    assert_eq!(started, ["n0", "n1", "n2"], "first by name");
    nodes[0].state = Some(UpgradeState::DrainRequired);
    nodes[1].state = Some(UpgradeState::Failed);
    assert_eq!(
        upgrades_available(&nodes, &p),
        1,
        "a failed node holds its slot"
    );
    // A node cordoned by someone else counts against maxUnavailable.
    let p = policy("{maxParallelUpgrades: 3, maxUnavailable: 2}", 6);
    nodes[5].unschedulable = true;
    assert_eq!(upgrades_available(&nodes, &p), 0);
    nodes[1].state = Some(UpgradeState::Done);
    nodes[0].state = Some(UpgradeState::Done);
    assert_eq!(upgrades_available(&nodes, &p), 1);
    // maxParallelUpgrades 0: no parallel limit.
    let p = policy("{maxParallelUpgrades: 0, maxUnavailable: 100%}", 6);
    assert_eq!(upgrades_available(&nodes, &p), 4);
}

#[test]
fn skipped_nodes_never_start() {
    let p = policy("{maxParallelUpgrades: 2, maxUnavailable: 100%}", 2);
    let mut a = node("a", UpgradeState::UpgradeRequired);
    a.skip = true;
    let b = node("b", UpgradeState::UpgradeRequired);
    let steps = plan(&[a, b], &p, NOW);
    assert_eq!(steps[0].1.next, None);
    assert_eq!(steps[1].1.next, Some(UpgradeState::CordonRequired));
}

#[test]
fn cordon_then_wait_for_jobs_until_they_finish_or_time_out() {
    let p = policy(
        "{waitForCompletion: {podSelector: 'job=train', timeoutSeconds: 60}}",
        1,
    );
    let n = node("a", UpgradeState::CordonRequired);
    let s = step(&n, &p, false, NOW);
    assert_eq!(s.next, Some(UpgradeState::WaitForJobsRequired));
    assert!(s.actions.contains(&Action::Cordon));
    assert!(s.actions.contains(&Action::Annotate(
        WAIT_FOR_JOBS_SINCE_ANNOTATION,
        Some(NOW.to_string())
    )));

    let mut n = node("a", UpgradeState::WaitForJobsRequired);
    n.unschedulable = true;
    n.jobs_running = 1;
    n.annotations.insert(
        WAIT_FOR_JOBS_SINCE_ANNOTATION.into(),
        (NOW - 59).to_string(),
    );
    assert_eq!(step(&n, &p, false, NOW).next, None, "job still running");
    n.annotations.insert(
        WAIT_FOR_JOBS_SINCE_ANNOTATION.into(),
        (NOW - 60).to_string(),
    );
    assert_eq!(
        step(&n, &p, false, NOW).next,
        Some(UpgradeState::PodDeletionRequired),
        "timed out"
    );
    n.jobs_running = 0;
    n.annotations.clear();
    assert_eq!(
        step(&n, &p, false, NOW).next,
        Some(UpgradeState::PodDeletionRequired)
    );
}

#[test]
fn gpu_pods_are_evicted_before_the_driver_restarts_and_blockers_fail_or_fall_back_to_drain() {
    let p = policy("{}", 1);
    let mut n = node("a", UpgradeState::PodDeletionRequired);
    n.gpu_pods = vec![
        pod("train-0"),
        PodFacts {
            terminating: true,
            ..pod("train-1")
        },
    ];
    let s = step(&n, &p, false, NOW);
    assert_eq!(s.next, None);
    assert_eq!(s.actions, [Action::Evict(vec!["ml/train-0".into()])]);
    n.gpu_pods.clear();
    assert_eq!(
        step(&n, &p, false, NOW).next,
        Some(UpgradeState::PodRestartRequired),
        "drain off: straight to the restart"
    );

    // An unmanaged pod without force: failed (drain off) or handed to the drain (drain on).
    n.gpu_pods = vec![PodFacts {
        managed: false,
        ..pod("bare")
    }];
    let s = step(&n, &p, false, NOW);
    assert_eq!(s.next, Some(UpgradeState::Failed));
    assert!(s.failure.unwrap().contains("ml/bare is not managed"));
    let drain = policy("{drain: {enable: true}}", 1);
    assert_eq!(
        step(&n, &drain, false, NOW).next,
        Some(UpgradeState::DrainRequired)
    );
    let force = policy("{podDeletion: {force: true}}", 1);
    assert_eq!(
        step(&n, &force, false, NOW).actions,
        [Action::Evict(vec!["ml/bare".into()])]
    );
    n.gpu_pods = vec![PodFacts {
        empty_dir: true,
        ..pod("scratch")
    }];
    assert!(
        step(&n, &p, false, NOW)
            .failure
            .unwrap()
            .contains("emptyDir")
    );
    let empty_dir = policy("{podDeletion: {deleteEmptyDir: true}}", 1);
    assert_eq!(step(&n, &empty_dir, false, NOW).next, None);
}

#[test]
fn a_drain_held_by_a_pdb_fails_the_node_at_its_timeout_naming_the_pod() {
    let p = policy("{drain: {enable: true, timeoutSeconds: 10}}", 1);
    let mut n = node("a", UpgradeState::DrainRequired);
    n.drain_pods = vec![pod("guarded")];
    n.annotations
        .insert(DRAIN_SINCE_ANNOTATION.into(), (NOW - 9).to_string());
    let s = step(&n, &p, false, NOW);
    assert_eq!(s.next, None);
    assert_eq!(s.actions, [Action::Evict(vec!["ml/guarded".into()])]);
    n.annotations
        .insert(DRAIN_SINCE_ANNOTATION.into(), (NOW - 10).to_string());
    let s = step(&n, &p, false, NOW);
    assert_eq!(s.next, Some(UpgradeState::Failed));
    let reason = s.failure.unwrap();
    assert!(reason.contains("drain timed out after 10s"), "{reason}");
    assert!(reason.contains("ml/guarded"), "{reason}");
    assert!(
        s.actions
            .contains(&Action::Annotate(FAILURE_ANNOTATION, Some(reason)))
    );
    n.drain_pods.clear();
    assert_eq!(
        step(&n, &p, false, NOW).next,
        Some(UpgradeState::PodRestartRequired)
    );
}

#[test]
fn the_restart_deletes_the_old_driver_pod_and_waits_for_the_new_one_to_be_ready() {
    let p = policy("{}", 1);
    let mut n = node("a", UpgradeState::PodRestartRequired);
    assert_eq!(
        step(&n, &p, false, NOW).actions,
        [Action::DeleteDriverPod("nvidia-driver-daemonset-x".into())]
    );
    n.driver = None;
    assert_eq!(step(&n, &p, false, NOW), Step::default(), "being recreated");
    n.driver = driver(true, false);
    assert_eq!(step(&n, &p, false, NOW).next, None);
    n.driver.as_mut().unwrap().failing = true;
    assert_eq!(step(&n, &p, false, NOW).next, Some(UpgradeState::Failed));
    n.driver = driver(true, true);
    assert_eq!(
        step(&n, &p, false, NOW).next,
        Some(UpgradeState::ValidationRequired)
    );
}

#[test]
fn validation_needs_a_validator_started_after_the_new_driver_and_ready() {
    let p = policy("{}", 1);
    let mut n = node("a", UpgradeState::ValidationRequired);
    n.driver = driver(true, true);
    let old = ValidatorPod {
        name: "validator-old".into(),
        ready: true,
        failing: false,
        created: NOW - 1000,
    };
    n.validator = Some(old);
    assert_eq!(
        step(&n, &p, false, NOW).actions,
        [Action::DeleteValidatorPod("validator-old".into())],
        "an old Ready validator proves nothing about the new driver"
    );
    n.validator = Some(ValidatorPod {
        name: "validator-new".into(),
        ready: false,
        failing: true,
        created: NOW,
    });
    let s = step(&n, &p, false, NOW);
    assert_eq!(s.next, Some(UpgradeState::Failed));
    assert!(s.failure.unwrap().contains("validator-new"));
    n.validator = Some(ValidatorPod {
        name: "validator-new".into(),
        ready: true,
        failing: false,
        created: NOW,
    });
    let s = step(&n, &p, false, NOW);
    assert_eq!(s.next, Some(UpgradeState::UncordonRequired));
    // No validator yet: wait, until NVIDIA's 600 s are over.
    n.validator = None;
    n.annotations
        .insert(VALIDATION_SINCE_ANNOTATION.into(), (NOW - 599).to_string());
    assert_eq!(step(&n, &p, false, NOW).next, None);
    n.annotations
        .insert(VALIDATION_SINCE_ANNOTATION.into(), (NOW - 600).to_string());
    assert_eq!(step(&n, &p, false, NOW).next, Some(UpgradeState::Failed));
    // Without a validator DaemonSet the driver's readiness is the validation.
    n.validator_expected = false;
    assert_eq!(
        step(&n, &p, false, NOW).next,
        Some(UpgradeState::UncordonRequired)
    );
}

#[test]
fn a_node_cordoned_before_its_upgrade_stays_cordoned_and_others_are_uncordoned() {
    let p = policy("{}", 1);
    let mut n = node("a", UpgradeState::ValidationRequired);
    n.driver = driver(true, true);
    n.validator_expected = false;
    n.unschedulable = true;
    n.annotations
        .insert(INITIAL_UNSCHEDULABLE_ANNOTATION.into(), "true".into());
    let s = step(&n, &p, false, NOW);
    assert_eq!(s.next, Some(UpgradeState::Done));
    assert!(!s.actions.contains(&Action::Uncordon));
    assert!(
        s.actions
            .contains(&Action::Annotate(INITIAL_UNSCHEDULABLE_ANNOTATION, None))
    );

    let mut n = node("b", UpgradeState::UncordonRequired);
    n.unschedulable = true;
    let s = step(&n, &p, false, NOW);
    assert_eq!(s.next, Some(UpgradeState::Done));
    assert_eq!(s.actions, [Action::Uncordon]);
}

#[test]
fn a_failed_node_resumes_once_its_driver_and_validator_are_ready() {
    let p = policy("{}", 1);
    let mut n = node("a", UpgradeState::Failed);
    n.driver = driver(true, true);
    n.validator = Some(ValidatorPod {
        name: "v".into(),
        ready: false,
        failing: true,
        created: NOW,
    });
    assert_eq!(step(&n, &p, false, NOW), Step::default());
    n.validator.as_mut().unwrap().ready = true;
    n.validator.as_mut().unwrap().failing = false;
    let s = step(&n, &p, false, NOW);
    assert_eq!(s.next, Some(UpgradeState::UncordonRequired));
    assert!(
        s.actions
            .contains(&Action::Annotate(FAILURE_ANNOTATION, None))
    );
}

#[test]
fn the_summary_line_counts_nodes_and_names_failures() {
    let p = policy("{maxParallelUpgrades: 3, maxUnavailable: 100%}", 4);
    let mut failed = node("gpu-7", UpgradeState::Failed);
    failed
        .annotations
        .insert(FAILURE_ANNOTATION.into(), "drain timed out".into());
    let nodes = vec![
        node("a", UpgradeState::Done),
        node("b", UpgradeState::DrainRequired),
        node("c", UpgradeState::UpgradeRequired),
        failed,
    ];
    let summary = Summary::of(&nodes, &[], &p);
    assert_eq!(
        summary.line(),
        "1 of 4 nodes upgraded, 1 in progress, 1 waiting, 1 failed: gpu-7: drain timed out"
    );
    assert!(summary.active());
}

#[test]
fn a_driver_pod_is_classified_by_revision_then_by_metadata_only_templates_then_by_digest() {
    use DriverRevision as R;
    let desired = DesiredDriver {
        daemon_set: "nvidia-driver-daemonset".into(),
        revision: "new".into(),
        digest: Some("d1".into()),
        nvidia_digest: Some("3379408550".into()),
        metadata_only: ["relabelled".to_owned()].into(),
        handover: None,
        ..DesiredDriver::default()
    };
    let cases = [
        (
            Some("new"),
            Some("d1"),
            R::Current,
            "its revision is current",
        ),
        (
            Some("new"),
            None,
            R::Current,
            "current, with or without a digest",
        ),
        (
            Some("relabelled"),
            Some("d0"),
            R::OlderMetadata,
            "only labels/annotations differ",
        ),
        (
            Some("old"),
            Some("d1"),
            R::RestartOnly,
            "same digest: restart in place",
        ),
        (
            Some("old"),
            Some("d0"),
            R::Outdated,
            "another digest: full upgrade",
        ),
        (
            Some("old"),
            None,
            R::Outdated,
            "the running pod has no digest",
        ),
        (
            None,
            Some("d1"),
            R::RestartOnly,
            "no revision label, same digest",
        ),
        (
            Some("nvidias"),
            Some("3379408550"),
            R::OlderMetadata,
            "started by NVIDIA's operator with the installation we render: left running",
        ),
    ];
    for (revision, digest, want, why) in cases {
        assert_eq!(classify(revision, digest, &desired), want, "{why}");
    }
    let no_digest = DesiredDriver {
        digest: None,
        ..desired
    };
    assert_eq!(
        classify(Some("old"), Some("d1"), &no_digest),
        R::Outdated,
        "the template has no digest"
    );
}

#[test]
fn revisions_differ_only_in_metadata_or_placement_when_the_rest_of_their_pod_specs_is_equal() {
    let data = |labels: serde_json::Value, image: &str, placement: serde_json::Value| {
        let mut spec =
            serde_json::json!({"containers": [{"name": "nvidia-driver-ctr", "image": image}]});
        for (k, v) in placement.as_object().unwrap() {
            spec[k] = v.clone();
        }
        serde_json::json!({"spec": {"template": {"$patch": "replace",
            "metadata": {"labels": labels}, "spec": spec}}})
    };
    let none = serde_json::json!({});
    let old = data(serde_json::json!({"app": "d"}), "driver:1", none.clone());
    assert!(differs_only_in_metadata_or_placement(
        &old,
        &data(
            serde_json::json!({"app": "d", "team": "ml"}),
            "driver:1",
            none.clone()
        )
    ));
    // A variant switch adds a node-affinity requirement, a pool a node selector: the pods that
    // stay on their nodes run the same.
    let anti = serde_json::json!({"podAntiAffinity": {"x": 1}});
    let placed = serde_json::json!({
        "nodeSelector": {"k": "v"},
        "affinity": {"nodeAffinity": {"required": 1}, "podAntiAffinity": {"x": 1}},
    });
    let with_anti = data(
        serde_json::json!({"app": "d"}),
        "driver:1",
        serde_json::json!({"affinity": anti}),
    );
    assert!(differs_only_in_metadata_or_placement(
        &with_anti,
        &data(serde_json::json!({"app": "d"}), "driver:1", placed.clone())
    ));
    assert!(differs_only_in_metadata_or_placement(
        &old,
        &data(
            serde_json::json!({"app": "d"}),
            "driver:1",
            serde_json::json!({"affinity": {"nodeAffinity": {}}})
        )
    ));
    // Anything else in the pod spec is a change.
    assert!(!differs_only_in_metadata_or_placement(&old, &with_anti));
    assert!(!differs_only_in_metadata_or_placement(
        &old,
        &data(serde_json::json!({"app": "d"}), "driver:2", none)
    ));
    assert!(!differs_only_in_metadata_or_placement(
        &old,
        &serde_json::json!({})
    ));
}

#[test]
fn an_outgoing_node_takes_the_full_upgrade_and_is_handed_over_instead_of_restarted() {
    let p = policy("{drain: {enable: true}}", 1);
    let mut n = node("gpu-1", UpgradeState::Done);
    n.driver = driver_on(DriverRevision::Outgoing, true);
    n.driver.as_mut().unwrap().handover_to = Some("precompiled".into());
    assert_eq!(
        step(&n, &p, false, NOW).next,
        Some(UpgradeState::UpgradeRequired)
    );
    n.state = Some(UpgradeState::UpgradeRequired);
    assert_eq!(
        step(&n, &p, true, NOW).next,
        Some(UpgradeState::CordonRequired),
        "cordoned like any new driver, never restarted in place"
    );
    n.state = Some(UpgradeState::PodRestartRequired);
    assert_eq!(
        step(&n, &p, false, NOW).actions,
        [Action::HandOver("precompiled".into())]
    );
    // The old pod goes, the new variant's comes up Ready: validated as after any restart.
    n.driver = None;
    assert_eq!(step(&n, &p, false, NOW), Step::default());
    n.driver = driver(true, true);
    assert_eq!(
        step(&n, &p, false, NOW).next,
        Some(UpgradeState::ValidationRequired)
    );
}

#[test]
fn a_node_is_handed_over_only_where_a_daemonset_of_the_new_variant_selects_it() {
    let labels = |kernel: &str| -> BTreeMap<String, String> {
        [
            ("feature.node.kubernetes.io/kernel-version.full", kernel),
            ("nvidia.com/gpu.deploy.driver", "true"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    };
    let mut selector = labels("5.15.0-1048-aws");
    // A user's key on every variant's DaemonSets is not among the labels node views keep.
    selector.insert("example.com/team".to_owned(), "ml".to_owned());
    let outgoing = DesiredDriver {
        handover: Some(("precompiled".into(), vec![selector])),
        ..DesiredDriver::default()
    };
    assert_eq!(
        handover_to(&outgoing, &labels("5.15.0-1048-aws")),
        Some("precompiled")
    );
    assert_eq!(handover_to(&outgoing, &labels("6.8.0-1008-aws")), None);
    assert_eq!(
        handover_to(&DesiredDriver::default(), &labels("5.15.0-1048-aws")),
        None
    );
}

#[test]
fn a_restart_only_node_skips_cordon_and_evictions_and_its_pod_is_replaced_in_place() {
    let p = policy("{drain: {enable: true}}", 1);
    let mut n = node("gpu-1", UpgradeState::Done);
    n.driver = driver_on(DriverRevision::RestartOnly, true);
    n.gpu_pods = vec![pod("trainer")];
    assert_eq!(
        step(&n, &p, false, NOW).next,
        Some(UpgradeState::UpgradeRequired)
    );
    n.state = Some(UpgradeState::UpgradeRequired);
    let s = step(&n, &p, true, NOW);
    assert_eq!(s.next, Some(UpgradeState::PodRestartRequired));
    assert!(s.actions.is_empty(), "no cordon: {:?}", s.actions);
    n.state = Some(UpgradeState::PodRestartRequired);
    assert_eq!(
        step(&n, &p, false, NOW).actions,
        [Action::DeleteDriverPod("nvidia-driver-daemonset-x".into())]
    );
    // Recreated on the current revision and Ready: validated, then done without an uncordon.
    n.driver = driver(true, true);
    assert_eq!(
        step(&n, &p, false, NOW).next,
        Some(UpgradeState::ValidationRequired)
    );
    n.state = Some(UpgradeState::UncordonRequired);
    let s = step(&n, &p, false, NOW);
    assert_eq!(s.next, Some(UpgradeState::Done));
    assert!(!s.actions.contains(&Action::Uncordon));
}

#[test]
fn restart_only_nodes_start_within_max_parallel_upgrades() {
    let p = policy("{maxParallelUpgrades: 2, maxUnavailable: 100%}", 4);
    let nodes: Vec<NodeFacts> = ["a", "b", "c", "d"]
        .into_iter()
        .map(|name| {
            let mut n = node(name, UpgradeState::UpgradeRequired);
            n.driver = driver_on(DriverRevision::RestartOnly, true);
            n
        })
        .collect();
    let started: Vec<String> = plan(&nodes, &p, NOW)
        .into_iter()
        .filter(|(_, s)| s.next == Some(UpgradeState::PodRestartRequired))
        .map(|(n, _)| n)
        .collect();
    assert_eq!(started, ["a", "b"]);
}

#[test]
fn a_pod_with_older_metadata_only_is_left_running_and_counted_in_the_summary() {
    let p = policy("{}", 2);
    let mut a = node("a", UpgradeState::Done);
    a.driver = driver_on(DriverRevision::OlderMetadata, true);
    let mut b = node("b", UpgradeState::Unknown);
    b.driver = driver_on(DriverRevision::OlderMetadata, true);
    assert_eq!(step(&a, &p, true, NOW), Step::default(), "no action");
    assert_eq!(
        step(&b, &p, true, NOW).next,
        Some(UpgradeState::Done),
        "a node seen first is done"
    );
    let nodes = [a, b];
    let summary = Summary::of(&nodes, &plan(&nodes, &p, NOW), &p);
    assert_eq!(
        summary.older_metadata.get("nvidia-driver-daemonset"),
        Some(&2)
    );
    assert_eq!(summary.line(), "2 of 2 nodes upgraded");
    assert!(!summary.active());
}

#[test]
fn each_pool_starts_nodes_within_its_own_parallel_and_unavailable_limits() {
    let waiting = |prefix: &str, n: usize| -> Vec<NodeFacts> {
        (0..n)
            .map(|i| node(&format!("{prefix}-{i}"), UpgradeState::UpgradeRequired))
            .collect()
    };
    let mut one_at_a_time = waiting("a", 4);
    let pools = [
        Pool {
            name: "pool-a".into(),
            policy: policy("maxParallelUpgrades: 1\nmaxUnavailable: 100%", 4),
            nodes: one_at_a_time.clone(),
        },
        Pool {
            name: "pool-b".into(),
            policy: policy("maxParallelUpgrades: 3\nmaxUnavailable: 100%", 4),
            nodes: waiting("b", 4),
        },
    ];
    let started = |steps: &[(String, Step)], prefix: &str| {
        steps
            .iter()
            .filter(|(n, s)| n.starts_with(prefix) && s.next == Some(UpgradeState::CordonRequired))
            .count()
    };
    let steps = plan_pools(&pools, NOW);
    assert_eq!(
        started(&steps, "a-"),
        1,
        "pool-a upgrades one node at a time"
    );
    assert_eq!(started(&steps, "b-"), 3, "pool-b's own limit, not pool-a's");
    let summary = Summary::of_pools(&pools, &steps);
    assert_eq!(
        (summary.total, summary.in_progress, summary.pending),
        (8, 4, 4)
    );

    // A node of pool-a in flight holds pool-a's only slot and none of pool-b's.
    one_at_a_time[0].state = Some(UpgradeState::DrainRequired);
    let pools = [
        Pool {
            nodes: one_at_a_time,
            ..pools[0].clone()
        },
        pools[1].clone(),
    ];
    let steps = plan_pools(&pools, NOW);
    assert_eq!(started(&steps, "a-"), 0);
    assert_eq!(started(&steps, "b-"), 3);
}

#[test]
fn the_pools_summary_keeps_each_pools_pods_with_older_metadata() {
    let mut a = node("a", UpgradeState::Done);
    a.driver = driver_on(DriverRevision::OlderMetadata, true);
    let mut b = node("b", UpgradeState::Done);
    b.driver = driver_on(DriverRevision::OlderMetadata, true);
    let pools = [
        Pool {
            name: "pool-a".into(),
            policy: policy("{}", 1),
            nodes: vec![a],
        },
        Pool {
            name: "pool-b".into(),
            policy: policy("{}", 1),
            nodes: vec![b],
        },
    ];
    let steps = plan_pools(&pools, NOW);
    let summary = Summary::of_pools(&pools, &steps);
    assert_eq!(
        summary.older_metadata.get("nvidia-driver-daemonset"),
        Some(&2)
    );
}
