//! The rollout forecast: the state machine run to its end over a copy of the nodes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::forecast::*;
use super::machine::*;
use crate::api::DriverUpgradePolicySpec;

fn policy(yaml: &str, nodes: usize) -> Policy {
    let spec: DriverUpgradePolicySpec = serde_yaml_ng::from_str(yaml).unwrap();
    Policy::from_spec(&spec, nodes)
}

fn node(name: &str, revision: DriverRevision) -> NodeFacts {
    NodeFacts {
        name: name.into(),
        state: Some(UpgradeState::Done),
        driver: Some(DriverPod {
            name: format!("nvidia-driver-daemonset-{name}"),
            daemon_set: "nvidia-driver-daemonset".into(),
            revision,
            ready: true,
            created: 10,
            ..DriverPod::default()
        }),
        validator: Some(ValidatorPod {
            name: format!("nvidia-operator-validator-{name}"),
            ready: true,
            failing: false,
            created: 11,
        }),
        validator_expected: true,
        ..NodeFacts::default()
    }
}

fn pod(namespace: &str, name: &str, managed: bool) -> PodFacts {
    PodFacts {
        namespace: namespace.into(),
        name: name.into(),
        managed,
        ..PodFacts::default()
    }
}

fn fleet(n: usize) -> Vec<NodeFacts> {
    (1..=n)
        .map(|i| node(&format!("gpu-{i}"), DriverRevision::Outdated))
        .collect()
}

#[test]
fn max_parallel_upgrades_two_takes_six_nodes_in_three_waves_by_name() {
    let mut nodes = fleet(6);
    // gpu-1 takes a pass longer (a drain after its GPU pod): gpu-3 starts as gpu-2's slot frees,
    // gpu-4 once gpu-1's does; the waves are the start order in groups of two.
    nodes[0].gpu_pods = vec![pod("ml", "train-0", true)];
    nodes[0].drain_pods = vec![pod("ml", "train-0", true), pod("web", "cache-0", true)];
    let f = forecast(
        &nodes,
        &policy(
            "{autoUpgrade: true, maxParallelUpgrades: 2, maxUnavailable: 100%}",
            6,
        ),
    );
    assert_eq!(f.waves, 3);
    assert_eq!(f.parallel, 2);
    let wave = |w| f.wave(w).map(|n| n.name.as_str()).collect::<Vec<_>>();
    assert_eq!(wave(1), ["gpu-1", "gpu-2"]);
    assert_eq!(wave(2), ["gpu-3", "gpu-4"]);
    assert_eq!(wave(3), ["gpu-5", "gpu-6"]);
    assert!(
        f.nodes
            .iter()
            .all(|n| n.cordoned && n.ending == Ending::Done)
    );
}

#[test]
fn max_unavailable_bounds_the_wave_below_max_parallel() {
    let mut nodes = fleet(8);
    // One node is cordoned already: it counts against maxUnavailable (2 of 8 at 25%).
    nodes[7].unschedulable = true;
    let f = forecast(
        &nodes,
        &policy("{autoUpgrade: true, maxParallelUpgrades: 4}", 8),
    );
    assert_eq!(f.parallel, 1, "25% of 8 is 2, one already unavailable");
    assert_eq!(f.wave(1).count(), 1);
    // The cordoned node keeps its cordon: the upgrade does not count it as its own.
    let last = f.nodes.iter().find(|n| n.name == "gpu-8").unwrap();
    assert!(!last.cordoned);
    assert_eq!(last.ending, Ending::Done);
}

#[test]
fn gpu_pods_are_evicted_then_the_drain_takes_the_rest() {
    let mut nodes = fleet(1);
    nodes[0].gpu_pods = vec![pod("ml", "train-0", true)];
    nodes[0].drain_pods = vec![pod("ml", "train-0", true), pod("web", "cache-0", true)];
    let f = forecast(
        &nodes,
        &policy("{autoUpgrade: true, drain: {enable: true}}", 1),
    );
    assert_eq!(f.nodes[0].evicted, ["ml/train-0", "web/cache-0"]);
    assert_eq!(f.nodes[0].ending, Ending::Done);
}

#[test]
fn a_pod_without_a_controller_fails_the_node_as_the_upgrade_would() {
    let mut nodes = fleet(2);
    nodes[0].gpu_pods = vec![pod("ml", "notebook", false)];
    let f = forecast(&nodes, &policy("{autoUpgrade: true}", 2));
    let failed = &f.nodes[0];
    assert!(
        matches!(&failed.ending, Ending::Failed(why) if why.contains("ml/notebook") && why.contains("force")),
        "{failed:?}"
    );
    // A failed node holds its slot (NVIDIA's rule): with one slot the rollout stops there.
    assert_eq!(f.nodes[1].ending, Ending::Untouched);
    assert_eq!(f.waves, 1);
}

#[test]
fn a_restart_only_driver_change_cordons_nothing_and_evicts_nothing() {
    let mut nodes = vec![node("gpu-1", DriverRevision::RestartOnly)];
    nodes[0].gpu_pods = vec![pod("ml", "train-0", true)];
    let f = forecast(&nodes, &policy("{autoUpgrade: true}", 1));
    let n = &f.nodes[0];
    assert!(
        n.restart_only && !n.cordoned && n.evicted.is_empty(),
        "{n:?}"
    );
    assert_eq!(n.ending, Ending::Done);
}

#[test]
fn skipped_and_current_nodes_are_untouched() {
    let mut nodes = fleet(2);
    nodes[0].skip = true;
    nodes.push(node("gpu-3", DriverRevision::Current));
    let f = forecast(&nodes, &policy("{autoUpgrade: true}", 3));
    let ending = |name: &str| {
        f.nodes
            .iter()
            .find(|n| n.name == name)
            .unwrap()
            .ending
            .clone()
    };
    assert_eq!(ending("gpu-1"), Ending::Untouched);
    assert_eq!(ending("gpu-2"), Ending::Done);
    assert_eq!(ending("gpu-3"), Ending::Untouched);
}

#[test]
fn running_jobs_are_waited_for_before_the_evictions() {
    let mut nodes = fleet(1);
    nodes[0].jobs_running = 2;
    let f = forecast(
        &nodes,
        &policy(
            "{autoUpgrade: true, waitForCompletion: {podSelector: app=batch}}",
            1,
        ),
    );
    assert_eq!(f.nodes[0].waits_for_jobs, 2);
    assert_eq!(f.nodes[0].ending, Ending::Done);
}
