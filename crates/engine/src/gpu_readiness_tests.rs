use super::*;
use crate::api::{GpuReadinessSpec, TaintEffect};
use crate::nodes::{GPU_PRESENT, ReadinessFacts};

const STARTUP: &str = "nvidia.com/gpu-not-ready";

fn startup_taint() -> StartupTaintSpec {
    StartupTaintSpec {
        key: STARTUP.to_owned(),
        effect: None,
    }
}

/// A GPU node with `count` GPUs (GFD's label) advertising `advertised`.
fn gpu_node(name: &str, count: u64, advertised: Option<u64>) -> NodeView {
    let labels = [
        (GPU_PRESENT.to_owned(), "true".to_owned()),
        (GPU_COUNT.to_owned(), count.to_string()),
    ]
    .into();
    NodeView {
        readiness: ReadinessFacts {
            gpus_advertised: advertised,
            ..ReadinessFacts::default()
        },
        ..NodeView::from_labels(name, Some("1".into()), &labels)
    }
}

fn with_taint(mut node: NodeView, key: &str, effect: &str) -> NodeView {
    node.readiness
        .taints
        .push((key.to_owned(), effect.to_owned()));
    node
}

fn quarantine(grace: u32, percent: u32) -> QuarantineSpec {
    QuarantineSpec {
        enabled: Some(true),
        grace_period_seconds: Some(grace),
        max_unhealthy_percent: Some(percent),
    }
}

fn state(name: &str, health: Health, since: Option<i64>, record: Option<Record>) -> NodeState {
    NodeState {
        name: name.to_owned(),
        tainted: record.is_some(),
        health,
        unhealthy_since: since,
        record,
    }
}

fn missing(advertised: u64, of: u64) -> Health {
    Health::Unhealthy(Unhealthy::GpusMissing {
        advertised,
        expected: Expected::Count(of),
    })
}

fn record(since: i64, restarts: u32, last: Option<i64>) -> Record {
    Record {
        reason: "gpus-missing".into(),
        message: "its device plugin advertises 7 of 8 GPUs".into(),
        since,
        restarts,
        last_restart: last,
    }
}

#[test]
fn the_startup_taint_comes_off_once_the_validator_is_ready_and_every_gpu_is_advertised() {
    let node = with_taint(gpu_node("a", 8, Some(8)), STARTUP, "NoSchedule");
    assert_eq!(
        startup(&node, Validator::Ready, &startup_taint()),
        Some(Ok(Lift::Ready))
    );
}

#[test]
fn the_startup_taint_stays_while_the_validator_is_not_ready() {
    let node = with_taint(gpu_node("a", 8, Some(8)), STARTUP, "NoSchedule");
    for v in [Validator::Missing, Validator::Starting, Validator::Failing] {
        assert_eq!(
            startup(&node, v, &startup_taint()),
            Some(Err(Wait::Validator(v)))
        );
    }
}

#[test]
fn the_startup_taint_stays_while_the_device_plugin_advertises_fewer_gpus_than_the_node_has() {
    let node = with_taint(gpu_node("a", 8, Some(7)), STARTUP, "NoSchedule");
    let wait = startup(&node, Validator::Ready, &startup_taint());
    assert_eq!(
        wait,
        Some(Err(Wait::DevicePlugin {
            advertised: 7,
            expected: Expected::Count(8)
        }))
    );
    assert_eq!(
        wait.unwrap().unwrap_err().to_string(),
        "the device plugin: 7 of 8 GPUs advertised"
    );
}

#[test]
fn time_slicing_replicas_multiply_the_gpus_to_advertise() {
    let mut node = gpu_node("a", 2, Some(2));
    node.labels.insert(GPU_REPLICAS.into(), "4".into());
    assert_eq!(expected_gpus(&node), Expected::Count(8));
    assert!(missing_gpus(&node).is_some());
    node.readiness.gpus_advertised = Some(8);
    assert_eq!(missing_gpus(&node), None);
}

#[test]
fn the_mixed_mig_strategy_is_not_counted_and_no_gfd_count_needs_one_gpu() {
    let mut node = gpu_node("a", 8, Some(0));
    node.labels.insert(MIG_STRATEGY.into(), "mixed".into());
    assert_eq!(missing_gpus(&node), None);
    let mut node = gpu_node("b", 8, None);
    node.labels.remove(GPU_COUNT);
    assert_eq!(
        missing_gpus(&node),
        Some((0, Expected::AtLeastOne)),
        "no GFD count and nothing advertised"
    );
    node.readiness.gpus_advertised = Some(1);
    assert_eq!(missing_gpus(&node), None);
}

#[test]
fn a_node_without_the_startup_taint_is_left_alone_and_never_gets_it() {
    let node = gpu_node("a", 8, Some(8));
    assert_eq!(startup(&node, Validator::Ready, &startup_taint()), None);
    // A taint of the same key with another effect is not the startup taint.
    let node = with_taint(node, STARTUP, "NoExecute");
    assert_eq!(startup(&node, Validator::Ready, &startup_taint()), None);
}

#[test]
fn a_node_nfd_found_no_gpu_on_loses_the_startup_taint_and_one_not_yet_discovered_waits() {
    let labels = BTreeMap::new();
    let mut node = with_taint(
        NodeView::from_labels("cpu", None, &labels),
        STARTUP,
        "NoSchedule",
    );
    assert_eq!(
        startup(&node, Validator::Missing, &startup_taint()),
        Some(Err(Wait::Discovery))
    );
    node.nfd_annotated = true;
    assert_eq!(
        startup(&node, Validator::Missing, &startup_taint()),
        Some(Ok(Lift::NoGpu))
    );
}

#[test]
fn the_lift_patch_removes_only_the_startup_taint_and_carries_the_resource_version() {
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": "a", "resourceVersion": "7"},
        "spec": {"taints": [
            {"key": STARTUP, "value": "x", "effect": "NoSchedule"},
            {"key": "dedicated", "value": "gpu", "effect": "NoSchedule"},
            {"key": STARTUP, "effect": "NoExecute"}
        ]}
    }))
    .unwrap();
    let patch = lift_startup_patch(&node, &startup_taint()).unwrap();
    assert_eq!(patch["metadata"]["resourceVersion"], "7");
    assert_eq!(
        patch["spec"]["taints"],
        json!([
            {"key": "dedicated", "value": "gpu", "effect": "NoSchedule"},
            {"key": STARTUP, "effect": "NoExecute"}
        ])
    );
    let clean: Node = serde_json::from_value(json!({"metadata": {"name": "a"}})).unwrap();
    assert_eq!(lift_startup_patch(&clean, &startup_taint()), None);
}

#[test]
fn a_node_missing_a_gpu_is_quarantined_only_after_the_grace_period() {
    let spec = quarantine(120, 50);
    let nodes = vec![
        state("a", missing(7, 8), Some(1000), None),
        state("b", Health::Healthy, None, None),
    ];
    let early = plan(&nodes, Some(&spec), 1100);
    assert!(early.actions.is_empty());
    assert_eq!(
        early.next_check,
        Some(1120),
        "looks again when the grace ends"
    );
    let due = plan(&nodes, Some(&spec), 1120);
    let [(name, Action::Quarantine(r))] = due.actions.as_slice() else {
        panic!("{:?}", due.actions)
    };
    assert_eq!(name, "a");
    assert_eq!(r.reason, "gpus-missing");
    assert_eq!(r.message, "its device plugin advertises 7 of 8 GPUs");
    assert_eq!((r.since, r.restarts, r.last_restart), (1120, 0, None));
}

#[test]
fn the_grace_period_starts_again_after_a_healthy_moment() {
    let mut since = BTreeMap::new();
    let sick = missing(7, 8);
    track_unhealthy(&mut since, [("a", &sick)], 100);
    track_unhealthy(&mut since, [("a", &sick)], 150);
    assert_eq!(
        since.get("a"),
        Some(&100),
        "unbroken: the first sighting counts"
    );
    track_unhealthy(&mut since, [("a", &Health::Healthy)], 160);
    track_unhealthy(&mut since, [("a", &sick)], 170);
    assert_eq!(since.get("a"), Some(&170));
    track_unhealthy(&mut since, [("a", &Health::NotJudged)], 180);
    assert!(since.is_empty(), "not judged is not unhealthy");
}

#[test]
fn a_quarantined_node_has_its_plugin_restarted_at_once_then_with_a_doubling_backoff() {
    let spec = quarantine(0, 50);
    let quarantined = |r| vec![state("a", missing(7, 8), Some(0), Some(r))];
    let first = plan(&quarantined(record(1000, 0, None)), Some(&spec), 1000);
    let [(_, Action::RestartPlugin(r1))] = first.actions.as_slice() else {
        panic!("{:?}", first.actions)
    };
    assert_eq!((r1.restarts, r1.last_restart), (1, Some(1000)));
    assert_eq!(first.next_check, Some(1030));
    assert!(
        plan(&quarantined(r1.clone()), Some(&spec), 1029)
            .actions
            .is_empty(),
        "not before the backoff"
    );
    let second = plan(&quarantined(r1.clone()), Some(&spec), 1030);
    let [(_, Action::RestartPlugin(r2))] = second.actions.as_slice() else {
        panic!("{:?}", second.actions)
    };
    assert_eq!(r2.next_restart(), 1030 + 60);
    assert_eq!(
        (1..=8).map(restart_delay).collect::<Vec<_>>(),
        vec![30, 60, 120, 240, 480, 600, 600, 600]
    );
}

#[test]
fn a_quarantine_lifts_when_every_gpu_is_back_or_its_taint_was_removed_by_hand() {
    let spec = quarantine(0, 50);
    let back = vec![state(
        "a",
        Health::Healthy,
        None,
        Some(record(1000, 1, Some(1000))),
    )];
    assert_eq!(
        plan(&back, Some(&spec), 1001).actions,
        vec![("a".to_owned(), Action::Lift)]
    );
    let mut by_hand = state(
        "b",
        missing(7, 8),
        Some(0),
        Some(record(1000, 1, Some(1000))),
    );
    by_hand.tainted = false;
    assert_eq!(
        plan(&[by_hand], Some(&spec), 1001).actions,
        vec![("b".to_owned(), Action::Lift)]
    );
}

#[test]
fn a_taint_of_our_key_without_our_record_is_never_lifted() {
    let spec = quarantine(0, 50);
    let mut foreign = state("a", Health::Healthy, None, None);
    foreign.tainted = true;
    assert!(plan(&[foreign.clone()], Some(&spec), 10).actions.is_empty());
    assert!(
        plan(&[foreign], None, 10).actions.is_empty(),
        "switched off, only nodes carrying our record are lifted"
    );
}

#[test]
fn switching_the_quarantine_off_lifts_every_quarantine() {
    let nodes = vec![
        state("a", missing(7, 8), Some(0), Some(record(5, 1, Some(5)))),
        state("b", missing(7, 8), Some(0), None),
    ];
    assert_eq!(
        plan(&nodes, None, 10).actions,
        vec![("a".to_owned(), Action::Lift)]
    );
}

#[test]
fn the_breaker_holds_when_more_nodes_turn_unhealthy_at_once_than_the_limit() {
    let spec = quarantine(0, 25);
    // 6 of 10 GPU nodes missing a GPU together: a fleet-wide signal.
    let nodes: Vec<NodeState> = (0..10)
        .map(|i| {
            let name = format!("n{i}");
            if i < 6 {
                state(&name, missing(7, 8), Some(0), None)
            } else {
                state(&name, Health::Healthy, None, None)
            }
        })
        .collect();
    let held = plan(&nodes, Some(&spec), 100);
    assert!(held.actions.is_empty(), "{:?}", held.actions);
    let breaker = held.breaker.expect("the breaker holds");
    assert_eq!(
        (breaker.unhealthy, breaker.gpu_nodes, breaker.limit),
        (6, 10, 2)
    );
    assert_eq!(breaker.held.len(), 6);
    let lines = quarantine_lines(&nodes, Some(&breaker));
    assert!(lines[0].contains("6 of 10 GPU nodes"), "{lines:?}");
    assert!(lines[0].contains("fleet-wide"), "{lines:?}");
    // Two of ten is within the limit.
    let two: Vec<NodeState> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            if i < 2 {
                n.clone()
            } else {
                state(&n.name, Health::Healthy, None, None)
            }
        })
        .collect();
    let plan2 = plan(&two, Some(&spec), 100);
    assert_eq!(plan2.actions.len(), 2);
    assert!(plan2.breaker.is_none());
}

#[test]
fn nodes_failing_together_hold_the_breaker_although_only_the_first_is_past_its_grace() {
    // Four of six nodes lose a GPU within a second or two: the first crosses its 3 s grace
    // period alone, the others are seen failing but still within theirs.
    let spec = quarantine(3, 25);
    let nodes = vec![
        state("a", missing(7, 8), Some(10), None),
        state("b", missing(7, 8), Some(11), None),
        state("c", missing(3, 4), Some(11), None),
        state("d", missing(7, 8), Some(11), None),
        state("e", Health::Healthy, None, None),
        state("f", Health::Healthy, None, None),
    ];
    let p = plan(&nodes, Some(&spec), 13);
    assert!(p.actions.is_empty(), "{:?}", p.actions);
    let breaker = p.breaker.expect("the breaker holds");
    assert_eq!((breaker.unhealthy, breaker.limit), (4, 1));
    assert_eq!(breaker.held, ["a"]);
    // One node failing alone is quarantined once past its grace.
    let alone = vec![
        state("a", missing(7, 8), Some(10), None),
        state("e", Health::Healthy, None, None),
    ];
    let p = plan(&alone, Some(&spec), 13);
    assert!(
        matches!(p.actions[..], [(_, Action::Quarantine(_))]),
        "{:?}",
        p.actions
    );
}

#[test]
fn the_limit_counts_nodes_already_quarantined_and_is_at_least_one() {
    let spec = quarantine(0, 25);
    assert_eq!(quarantine_limit(3, &spec), 1);
    let nodes = vec![
        state("a", missing(7, 8), Some(0), Some(record(5, 1, Some(5)))),
        state("b", missing(7, 8), Some(0), None),
        state("c", Health::Healthy, None, None),
    ];
    let p = plan(&nodes, Some(&spec), 10);
    assert!(
        p.breaker.is_some(),
        "a is quarantined, b would be the second"
    );
    assert!(
        !p.actions
            .iter()
            .any(|(_, a)| matches!(a, Action::Quarantine(_)))
    );
}

#[test]
fn health_is_not_judged_while_starting_upgrading_or_before_the_validator_runs() {
    let node = gpu_node("a", 8, Some(7));
    assert_eq!(health(&node, Validator::Ready, true), Health::NotJudged);
    assert_eq!(health(&node, Validator::Starting, false), Health::NotJudged);
    assert_eq!(health(&node, Validator::Missing, false), Health::NotJudged);
    let mut upgrading = node.clone();
    upgrading.labels.insert(
        crate::nodes::DRIVER_UPGRADE_STATE.into(),
        "pod-restart-required".into(),
    );
    assert_eq!(
        health(&upgrading, Validator::Ready, false),
        Health::NotJudged
    );
    assert_eq!(health(&node, Validator::Ready, false), missing(7, 8));
    assert_eq!(
        health(&node, Validator::Failing, false),
        Health::Unhealthy(Unhealthy::ValidatorFailing)
    );
    assert_eq!(
        health(&gpu_node("b", 8, Some(8)), Validator::Ready, false),
        Health::Healthy
    );
}

#[test]
fn quarantine_patches_add_and_remove_only_our_taint_and_record() {
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": "a", "resourceVersion": "3"},
        "spec": {"taints": [{"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}]}
    }))
    .unwrap();
    let r = record(10, 0, None);
    let patch = quarantine_patch(&node, &r);
    assert_eq!(patch["metadata"]["resourceVersion"], "3");
    assert_eq!(
        patch["spec"]["taints"],
        json!([
            {"key": "dedicated", "value": "gpu", "effect": "NoSchedule"},
            {"key": QUARANTINE_TAINT, "value": "gpus-missing", "effect": "NoSchedule"}
        ])
    );
    let written: Record = serde_json::from_str(
        patch["metadata"]["annotations"][QUARANTINE_ANNOTATION]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(written, r);
    let mut quarantined = node.clone();
    quarantined.spec.as_mut().unwrap().taints =
        serde_json::from_value(patch["spec"]["taints"].clone()).unwrap();
    let lift = lift_quarantine_patch(&quarantined);
    assert_eq!(
        lift["spec"]["taints"],
        json!([{"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}])
    );
    assert_eq!(
        lift["metadata"]["annotations"][QUARANTINE_ANNOTATION],
        Value::Null
    );
}

#[test]
fn operands_tolerate_the_startup_and_quarantine_taints_when_set() {
    let mut spec = ClusterPolicySpec::default();
    assert!(operand_taints(&spec).is_empty());
    spec.gpu_readiness = Some(GpuReadinessSpec {
        startup_taint: Some(StartupTaintSpec {
            key: STARTUP.into(),
            effect: Some(TaintEffect::NoExecute),
        }),
        quarantine: Some(quarantine(60, 25)),
    });
    let tolerations = operand_tolerations(&spec, &[]);
    let pairs: Vec<(String, String, String)> = tolerations
        .iter()
        .map(|t| {
            (
                t.key.clone().unwrap(),
                t.operator.clone().unwrap(),
                t.effect.clone().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        pairs,
        vec![
            (STARTUP.into(), "Exists".into(), "NoExecute".into()),
            (
                QUARANTINE_TAINT.into(),
                "Exists".into(),
                "NoSchedule".into()
            )
        ]
    );
    // A blanket toleration already covers both.
    let all = Toleration {
        operator: Some("Exists".into()),
        ..Toleration::default()
    };
    assert!(operand_tolerations(&spec, &[all]).is_empty());
}

#[test]
fn the_waiting_note_names_each_node_and_its_step() {
    let waiting = Waiting {
        key: STARTUP.into(),
        nodes: vec![
            ("a".into(), Wait::Validator(Validator::Starting)),
            (
                "b".into(),
                Wait::DevicePlugin {
                    advertised: 0,
                    expected: Expected::Count(8),
                },
            ),
        ],
    };
    assert_eq!(
        waiting_note(&waiting).unwrap(),
        "gpuReadiness: 2 node(s) keep the startup taint nvidia.com/gpu-not-ready until their GPUs are ready: a waits for the validator to be ready, b waits for the device plugin: 0 of 8 GPUs advertised"
    );
    assert_eq!(waiting_note(&Waiting::default()), None);
}
