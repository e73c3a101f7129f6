//! The pre-pull that gates a driver upgrade, decision by decision (pure; the IO half is proven
//! on the harness by tests/e2e/tests/prepull.rs).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use serde_json::json;

use super::machine::*;
use super::prepull::*;

const NOW: i64 = 1_000_000;
const OLD: &str = "nvcr.io/nvidia/driver:595.91.07-ubuntu24.04";
const NEW: &str = "nvcr.io/nvidia/driver:600.10.01-ubuntu24.04";
const FIXED: &str = "nvcr.io/nvidia/driver:600.10.02-ubuntu24.04";
const MANAGER_IMAGE: &str = "nvcr.io/nvidia/cloud-native/k8s-driver-manager:v0.8.0";
const DS: &str = "nvidia-driver-daemonset-ubuntu24.04";

fn images(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

fn policy(yaml: &str, nodes: usize) -> Policy {
    let spec: crate::api::DriverUpgradePolicySpec = serde_yaml_ng::from_str(yaml).unwrap();
    Policy::from_spec(&spec, nodes)
}

/// A node waiting in upgrade-required with an outdated driver pod and `prepull`.
fn waiting(name: &str, prepull: Prepull) -> NodeFacts {
    NodeFacts {
        name: name.into(),
        state: Some(UpgradeState::UpgradeRequired),
        driver: Some(DriverPod {
            name: format!("driver-{name}"),
            daemon_set: DS.into(),
            revision: DriverRevision::Outdated,
            ready: true,
            created: NOW - 10,
            ..DriverPod::default()
        }),
        validator_expected: true,
        prepull,
        ..NodeFacts::default()
    }
}

fn failed(image: &str) -> Prepull {
    Prepull::Failed {
        image: image.into(),
        reason: "ErrImagePull: manifest unknown".into(),
    }
}

fn next_states(steps: &[(String, Step)]) -> BTreeMap<String, Option<UpgradeState>> {
    steps.iter().map(|(n, s)| (n.clone(), s.next)).collect()
}

fn status(state: serde_json::Value) -> ContainerStatus {
    serde_json::from_value(json!({
        "name": "pull-0", "image": NEW, "imageID": "", "ready": false, "restartCount": 0,
        "state": state
    }))
    .unwrap()
}

fn pulls_on(shadows: &str, pulls: &[(&str, Pull)]) -> PrepullPod {
    PrepullPod {
        shadows: shadows.into(),
        images: pulls
            .iter()
            .map(|(i, p)| ((*i).to_owned(), p.clone()))
            .collect(),
    }
}

#[test]
fn a_node_whose_pull_failed_is_held_in_upgrade_required_and_its_slot_goes_to_a_pulled_node() {
    let nodes = [
        waiting("a-held", failed(NEW)),
        waiting("b-pulled", Prepull::Pulled),
    ];
    let steps = plan(&nodes, &policy("{maxParallelUpgrades: 1}", 2), NOW);
    let next = next_states(&steps);
    assert_eq!(next["a-held"], None, "held: never to cordon-required");
    assert_eq!(
        next["b-pulled"],
        Some(UpgradeState::CordonRequired),
        "the only slot goes to the node that has the image, though it sorts after"
    );
    let held = &steps[0].1;
    assert!(!held.actions.contains(&Action::Cordon));
    assert!(
        !held
            .actions
            .iter()
            .any(|a| matches!(a, Action::DeleteDriverPod(_))),
        "the held node keeps its running driver"
    );
    assert!(
        held.actions
            .contains(&Action::Annotate(HELD_ANNOTATION, Some(NEW.to_owned()))),
        "{:?}",
        held.actions
    );
}

#[test]
fn a_held_node_stays_held_pass_after_pass_without_writes() {
    let mut node = waiting("gpu-1", failed(NEW));
    node.annotations.insert(HELD_ANNOTATION.into(), NEW.into());
    let steps = plan(std::slice::from_ref(&node), &policy("{}", 1), NOW);
    assert_eq!(steps[0].1, Step::default(), "nothing to write or do");
    // The kubelet's retry turns ErrImagePull into ImagePullBackOff: still no write.
    node.prepull = Prepull::Failed {
        image: NEW.into(),
        reason: "ImagePullBackOff: Back-off pulling image".into(),
    };
    let steps = plan(std::slice::from_ref(&node), &policy("{}", 1), NOW);
    assert_eq!(steps[0].1, Step::default());
}

#[test]
fn a_node_whose_image_is_still_being_pulled_waits_without_taking_a_slot() {
    let nodes = [
        waiting("a-pulling", Prepull::Pulling(images(&[NEW]))),
        waiting("b-pulled", Prepull::Pulled),
    ];
    let steps = plan(&nodes, &policy("{maxParallelUpgrades: 1}", 2), NOW);
    let next = next_states(&steps);
    assert_eq!(next["a-pulling"], None);
    assert_eq!(next["b-pulled"], Some(UpgradeState::CordonRequired));
    assert!(steps[0].1.actions.is_empty(), "not held: no annotation");
}

#[test]
fn a_node_whose_pre_pull_pod_reports_the_image_pulled_proceeds_to_the_cordon() {
    let pod = pulls_on(DS, &[(NEW, Pull::Pulled)]);
    let state = node_state(DS, &images(&[NEW]), &[&pod]);
    assert_eq!(state, Prepull::Pulled);
    let steps = plan(&[waiting("gpu-1", state)], &policy("{}", 1), NOW);
    assert_eq!(steps[0].1.next, Some(UpgradeState::CordonRequired));
}

#[test]
fn nothing_is_pre_pulled_for_a_restart_only_or_metadata_only_driver_pod() {
    let running = images(&[OLD, MANAGER_IMAGE]);
    let wanted = images(&[OLD, "nvcr.io/nvidia/cloud-native/k8s-driver-manager:v0.9.0"]);
    for revision in [
        DriverRevision::RestartOnly,
        DriverRevision::OlderMetadata,
        DriverRevision::Current,
        DriverRevision::Outgoing,
    ] {
        assert!(
            missing_images(revision, &running, &wanted).is_empty(),
            "{revision:?}"
        );
    }
    // And the machine restarts such a pod in place at once, without waiting for any pull.
    let mut node = waiting("gpu-1", node_state(DS, &BTreeSet::new(), &[]));
    node.driver.as_mut().unwrap().revision = DriverRevision::RestartOnly;
    assert_eq!(node.prepull, Prepull::NotNeeded);
    let steps = plan(&[node], &policy("{}", 1), NOW);
    assert_eq!(steps[0].1.next, Some(UpgradeState::PodRestartRequired));
}

#[test]
fn a_node_that_already_runs_the_new_image_needs_no_pre_pull() {
    // A full upgrade (say, new driver env) that keeps every image.
    let running = images(&[NEW, MANAGER_IMAGE]);
    let missing = missing_images(DriverRevision::Outdated, &running, &running);
    assert!(missing.is_empty());
    assert_eq!(node_state(DS, &missing, &[]), Prepull::NotNeeded);
    // Only what the node lacks is pulled: the manager image it runs is not waited on.
    let wanted = images(&[FIXED, MANAGER_IMAGE]);
    assert_eq!(
        missing_images(DriverRevision::Outdated, &running, &wanted),
        images(&[FIXED])
    );
}

#[test]
fn without_a_pre_pull_pod_or_with_one_of_another_image_or_pool_the_image_is_not_there_yet() {
    let missing = images(&[NEW]);
    assert_eq!(
        node_state(DS, &missing, &[]),
        Prepull::Pulling(missing.clone())
    );
    let other_image = pulls_on(DS, &[(OLD, Pull::Pulled)]);
    let other_pool = pulls_on("nvidia-driver-daemonset", &[(NEW, Pull::Pulled)]);
    assert_eq!(
        node_state(DS, &missing, &[&other_image, &other_pool]),
        Prepull::Pulling(missing.clone())
    );
    let creating = pulls_on(DS, &[(NEW, Pull::Pending)]);
    assert_eq!(
        node_state(DS, &missing, &[&creating]),
        Prepull::Pulling(missing)
    );
}

#[test]
fn a_pull_error_image_pull_backoff_or_invalid_name_counts_as_failed_and_a_started_container_as_pulled()
 {
    for reason in ["ErrImagePull", "ImagePullBackOff", "InvalidImageName"] {
        let s = status(json!({"waiting": {"reason": reason, "message": "tag not found"}}));
        assert_eq!(
            container_pull(&s),
            Pull::Failed(format!("{reason}: tag not found"))
        );
    }
    let creating = status(json!({"waiting": {"reason": "ContainerCreating"}}));
    assert_eq!(container_pull(&creating), Pull::Pending);
    let running = status(json!({"running": {"startedAt": "2026-11-29T08:00:00Z"}}));
    assert_eq!(container_pull(&running), Pull::Pulled);
    // It ran (and exited, say a shell missing in the image): the image is on the node.
    let crashed = status(json!({"waiting": {"reason": "CrashLoopBackOff"}}));
    let mut crashed_once = crashed.clone();
    crashed_once.restart_count = 3;
    assert_eq!(container_pull(&crashed), Pull::Pending);
    assert_eq!(container_pull(&crashed_once), Pull::Pulled);
}

#[test]
fn a_pre_pull_pod_is_read_per_image_and_any_other_pod_is_not_one() {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "p", "labels": {"app.kubernetes.io/component": COMPONENT},
            "annotations": {SHADOWS_ANNOTATION: DS}},
        "spec": {"nodeName": "gpu-1", "containers": [
            {"name": "pull-0", "image": NEW}, {"name": "pull-1", "image": MANAGER_IMAGE}]},
        "status": {"containerStatuses": [{"name": "pull-0", "image": NEW, "imageID": "",
            "ready": false, "restartCount": 0,
            "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}}}]}
    }))
    .unwrap();
    let read = prepull_pod(&pod).unwrap();
    assert_eq!(read.shadows, DS);
    assert_eq!(
        read.images[NEW],
        Pull::Failed("ImagePullBackOff: Back-off pulling image".into())
    );
    assert_eq!(read.images[MANAGER_IMAGE], Pull::Pending, "no status yet");
    let mut driver = pod.clone();
    driver.metadata.labels = Some(BTreeMap::from([(
        "app.kubernetes.io/component".into(),
        "nvidia-driver".into(),
    )]));
    assert_eq!(prepull_pod(&driver), None);
}

#[test]
fn fixing_the_tag_resumes_the_held_node_once_the_new_image_is_pulled() {
    // Held on NEW: its pre-pull pod reports the pull error.
    let broken = pulls_on(DS, &[(NEW, Pull::Failed("ErrImagePull: not found".into()))]);
    let mut node = waiting("gpu-1", node_state(DS, &images(&[NEW]), &[&broken]));
    assert!(matches!(node.prepull, Prepull::Failed { .. }));
    let held = plan(std::slice::from_ref(&node), &policy("{}", 1), NOW);
    assert_eq!(held[0].1.next, None);
    node.annotations
        .insert(HELD_ANNOTATION.into(), held_annotation(&held[0].1).unwrap());

    // The version is fixed: the old pre-pull pod tells nothing of FIXED; the node waits for it
    // and is no longer reported as held.
    node.prepull = node_state(DS, &images(&[FIXED]), &[&broken]);
    assert_eq!(node.prepull, Prepull::Pulling(images(&[FIXED])));
    let pulling = plan(std::slice::from_ref(&node), &policy("{}", 1), NOW);
    assert_eq!(pulling[0].1.next, None);
    assert!(
        pulling[0]
            .1
            .actions
            .contains(&Action::Annotate(HELD_ANNOTATION, None)),
        "the hold is lifted: {:?}",
        pulling[0].1.actions
    );

    // Pulled: the upgrade starts.
    let fixed = pulls_on(DS, &[(FIXED, Pull::Pulled)]);
    node.prepull = node_state(DS, &images(&[FIXED]), &[&broken, &fixed]);
    node.annotations.remove(HELD_ANNOTATION);
    let resumed = plan(&[node], &policy("{}", 1), NOW);
    assert_eq!(resumed[0].1.next, Some(UpgradeState::CordonRequired));
}

/// The held annotation a step writes.
fn held_annotation(step: &Step) -> Option<String> {
    step.actions.iter().find_map(|a| match a {
        Action::Annotate(key, value) if *key == HELD_ANNOTATION => value.clone(),
        _ => None,
    })
}

#[test]
fn status_names_the_tag_the_held_nodes_and_the_pull_error_and_waits_for_a_person() {
    let nodes = [
        waiting("noble-0", failed(NEW)),
        waiting("noble-1", failed(NEW)),
        waiting("jammy-0", Prepull::Pulling(images(&[FIXED]))),
        NodeFacts {
            state: Some(UpgradeState::Done),
            ..waiting("jammy-1", Prepull::NotNeeded)
        },
    ];
    let mut nodes = nodes.to_vec();
    nodes[3].driver.as_mut().unwrap().revision = DriverRevision::Current;
    let p = policy("{maxParallelUpgrades: 2}", 4);
    let steps = plan(&nodes, &p, NOW);
    let summary = Summary::of(&nodes, &steps, &p);
    assert_eq!(summary.pulling, 1);
    assert_eq!(summary.held.len(), 2);
    assert_eq!(
        summary.line(),
        format!(
            "1 of 4 nodes upgraded, 3 waiting (1 until the new driver image is pulled), 2 held \
             before the cordon (they keep their running driver): {NEW} cannot be pulled on \
             noble-0, noble-1 (ErrImagePull: manifest unknown)"
        )
    );
    assert!(
        !summary.active(),
        "nothing can start: no requeue (the pre-pull pods' changes wake the pass)"
    );
}

fn driver_daemon_set(image: &str) -> DaemonSet {
    serde_json::from_value(json!({
        "metadata": {"name": DS, "namespace": "gpu-operator",
            "labels": {"app.kubernetes.io/component": "nvidia-driver"},
            "ownerReferences": [{"apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy",
                "name": "cluster-policy", "uid": "p1", "controller": true,
                "blockOwnerDeletion": true}]},
        "spec": {
            "selector": {"matchLabels": {"app": DS}},
            "updateStrategy": {"type": "OnDelete"},
            "template": {
                "metadata": {"labels": {"app": DS}},
                "spec": {
                    "nodeSelector": {"nvidia.com/gpu.deploy.driver": "true",
                        "feature.node.kubernetes.io/system-os_release.VERSION_ID": "24.04"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                        "effect": "NoSchedule"}],
                    "affinity": {
                        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [{"matchExpressions": [{"key": "nvidia.com/gpu.present",
                                "operator": "In", "values": ["true"]}]}]}},
                        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
                            "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "nvidia-driver"}},
                            "topologyKey": "kubernetes.io/hostname"}]}
                    },
                    "imagePullSecrets": [{"name": "ngc-secret"}],
                    "hostPID": true,
                    "priorityClassName": "system-node-critical",
                    "serviceAccountName": "nvidia-driver",
                    "initContainers": [{"name": "k8s-driver-manager", "image": MANAGER_IMAGE,
                        "securityContext": {"privileged": true}}],
                    "containers": [{"name": "nvidia-driver-ctr", "image": image,
                        "imagePullPolicy": "Always",
                        "command": ["nvidia-driver"], "args": ["init"],
                        "securityContext": {"privileged": true},
                        "volumeMounts": [{"name": "run-nvidia", "mountPath": "/run/nvidia"}]}],
                    "volumes": [{"name": "run-nvidia",
                        "hostPath": {"path": "/run/nvidia", "type": "DirectoryOrCreate"}}]
                }
            }
        }
    }))
    .unwrap()
}

#[test]
fn the_pre_pull_daemon_set_shadows_the_driver_placement_and_runs_nothing_privileged() {
    let driver = driver_daemon_set(NEW);
    let ds = render(&driver).unwrap();
    let name = ds.metadata.name.clone().unwrap();
    assert!(name.starts_with(&format!("{DS}-prepull-")), "{name}");
    assert!(name.len() <= 63 - 6, "room for the pod name suffix: {name}");
    let labels = ds.metadata.labels.clone().unwrap();
    assert_eq!(labels["app.kubernetes.io/managed-by"], "gpu-operator");
    assert_eq!(labels["app.kubernetes.io/component"], COMPONENT);
    assert!(is_prepull(&ds) && !is_prepull(&driver));
    assert_eq!(
        ds.metadata.owner_references,
        driver.metadata.owner_references
    );
    let template = ds.spec.as_ref().unwrap().template.clone();
    assert_eq!(
        template.metadata.unwrap().annotations.unwrap()[SHADOWS_ANNOTATION],
        DS
    );
    let pod = template.spec.unwrap();
    let driver_pod = driver.spec.unwrap().template.spec.unwrap();
    assert_eq!(pod.node_selector, driver_pod.node_selector);
    assert_eq!(pod.tolerations, driver_pod.tolerations);
    let affinity = pod.affinity.as_ref().unwrap();
    assert_eq!(
        affinity.node_affinity,
        driver_pod.affinity.as_ref().unwrap().node_affinity
    );
    assert!(
        affinity.pod_anti_affinity.is_none(),
        "the driver's one-per-node rule would keep it off the driver's nodes"
    );
    assert_eq!(pod.image_pull_secrets, driver_pod.image_pull_secrets);
    assert!(pod.volumes.is_none(), "no hostPath, no volume at all");
    assert_eq!(pod.host_pid, None);
    assert_eq!(pod.priority_class_name, None, "preempts no workload");
    assert_eq!(pod.service_account_name, None);
    assert_eq!(pod.automount_service_account_token, Some(false));
    assert!(
        pod.init_containers.is_none(),
        "the driver manager never runs"
    );
    let pulled: BTreeSet<String> = pod
        .containers
        .iter()
        .map(|c| c.image.clone().unwrap())
        .collect();
    assert_eq!(pulled, images(&[NEW, MANAGER_IMAGE]));
    for c in &pod.containers {
        assert_eq!(c.command.as_deref().unwrap(), COMMAND, "{}", c.name);
        assert_eq!(c.args, None, "the driver's entrypoint args are not passed");
        let sc = c.security_context.as_ref().unwrap();
        assert_eq!(sc.privileged, Some(false));
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(sc.run_as_non_root, Some(true));
        assert!(c.volume_mounts.is_none());
        let requests = c.resources.as_ref().unwrap().requests.as_ref().unwrap();
        assert_eq!(requests["cpu"].0, "1m");
    }
    let driver_ctr = pod
        .containers
        .iter()
        .find(|c| c.image.as_deref() == Some(NEW))
        .unwrap();
    assert_eq!(
        driver_ctr.image_pull_policy.as_deref(),
        Some("Always"),
        "pulls as the driver would"
    );
}

fn live(objects: &[DaemonSet]) -> BTreeMap<String, DaemonSet> {
    objects
        .iter()
        .map(|d| (d.metadata.name.clone().unwrap(), d.clone()))
        .collect()
}

#[test]
fn a_pre_pull_daemon_set_is_created_for_a_pool_in_rollout_and_not_sent_again_unchanged() {
    let driver = driver_daemon_set(NEW);
    let wanted = BTreeSet::from([DS.to_owned()]);
    let first = sync(&wanted, &live(std::slice::from_ref(&driver)));
    assert_eq!(first.apply.len(), 1);
    assert!(first.delete.is_empty());
    let again = sync(&wanted, &live(&[driver, first.apply[0].clone()]));
    assert_eq!(again, Sync::default(), "zero writes while it stands");
}

#[test]
fn the_pre_pull_daemon_set_is_deleted_when_the_rollout_is_done_or_the_image_changes() {
    let driver = driver_daemon_set(NEW);
    let prepull = render(&driver).unwrap();
    let prepull_name = prepull.metadata.name.clone().unwrap();

    // Every node runs the new image: no node wants a pre-pull.
    let done_nodes = [NodeFacts {
        state: Some(UpgradeState::Done),
        ..waiting("gpu-1", Prepull::NotNeeded)
    }];
    assert!(wanted(&done_nodes).is_empty());
    let done = sync(
        &wanted(&done_nodes),
        &live(&[driver.clone(), prepull.clone()]),
    );
    assert_eq!(done.delete, std::slice::from_ref(&prepull_name));
    assert!(done.apply.is_empty());

    // The version changed again: a new pre-pull DaemonSet for the new image, the old one goes.
    let refixed = driver_daemon_set(FIXED);
    let nodes = [waiting("gpu-1", Prepull::Pulling(images(&[FIXED])))];
    let changed = sync(&wanted(&nodes), &live(&[refixed, prepull.clone()]));
    assert_eq!(changed.delete, std::slice::from_ref(&prepull_name));
    assert_eq!(changed.apply.len(), 1);
    assert_ne!(changed.apply[0].metadata.name.as_ref(), Some(&prepull_name));

    // Its driver DaemonSet gone: the pre-pull goes with it.
    let orphaned = sync(&BTreeSet::from([DS.to_owned()]), &live(&[prepull]));
    assert_eq!(orphaned.delete, [prepull_name]);
}

#[test]
fn a_skipped_node_or_a_node_with_nothing_to_pull_wants_no_pre_pull() {
    let mut skipped = waiting("gpu-1", Prepull::Pulling(images(&[NEW])));
    skipped.skip = true;
    let restart = waiting("gpu-2", Prepull::NotNeeded);
    assert!(wanted(&[skipped, restart]).is_empty());
    assert_eq!(
        wanted(&[waiting("gpu-3", failed(NEW))]),
        BTreeSet::from([DS.to_owned()]),
        "a held node keeps its pre-pull, so a retried pull is seen"
    );
}

#[test]
fn a_pool_status_names_the_image_the_held_nodes_and_the_pull_error() {
    assert_eq!(
        held_line([("gpu-1", None, None), ("gpu-2", Some(""), None)]),
        None
    );
    let failing = pulls_on(DS, &[(NEW, Pull::Failed("ErrImagePull: not found".into()))]);
    let reason = pull_failure(NEW, [&failing]);
    assert_eq!(reason.as_deref(), Some("ErrImagePull: not found"));
    assert_eq!(pull_failure(OLD, [&failing]), None);
    assert_eq!(
        held_line([
            ("noble-1", Some(NEW), reason.clone()),
            ("jammy-1", None, None),
            ("noble-2", Some(NEW), reason)
        ])
        .unwrap(),
        format!(
            "driver upgrade held before the cordon (the nodes keep their running driver): \
             {NEW} cannot be pulled on noble-1, noble-2 (ErrImagePull: not found)"
        )
    );
}
