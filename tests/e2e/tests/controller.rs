//! The operator end to end: the real binary against the harness, with its own identity.
//! Each test creates its own namespace and policy and removes them; tests run one at a time
//! (`--test-threads=1`) because a ClusterPolicy is cluster-wide.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use e2e::audit::{self, AuditLog};
use e2e::chaos::CrashLoop;
use e2e::nodes::{self, FakeNode, GpuModel};
use e2e::operator::Operator;
use e2e::session::*;
use e2e::{cluster::unique_name, wait};
use gpu_operator::api::State;
use gpu_operator::nodes::{DEPLOY_DEVICE_PLUGIN, DEPLOY_DRIVER, DEPLOY_MIG_MANAGER, GPU_PRESENT};
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

#[tokio::test]
async fn policy_rolls_out_every_operand_on_gpu_nodes_only_and_becomes_ready() {
    let Some(s) = start(json!({}), &[]).await else {
        return;
    };
    let policy = s.await_state(State::Ready, "policy ready").await;
    let status = policy.status.unwrap();
    let components: Vec<String> = status
        .components
        .unwrap()
        .iter()
        .map(|c| c.name.clone())
        .collect();
    for operand in [
        "driver",
        "container-toolkit",
        "operator-validator",
        "device-plugin",
        "gpu-feature-discovery",
        "dcgm-exporter",
        "mig-manager",
    ] {
        assert!(
            components.iter().any(|c| c == operand),
            "{operand} missing from {components:?}"
        );
    }
    let names: Vec<String> = s
        .daemonsets()
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|d| d.name_any())
        .collect();
    for ds in DEFAULT_DAEMONSETS {
        assert!(
            names.contains(&ds.to_string()),
            "{ds} missing from {names:?}"
        );
    }
    // Pods only on GPU nodes.
    let gpu_nodes = nodes::gpu_node_names(&s.admin).await.unwrap();
    let pods = Api::<Pod>::namespaced(s.admin.clone(), &s.identity.namespace)
        .list(&ListParams::default())
        .await
        .unwrap();
    for pod in pods.items.iter().filter(|p| is_gpu_operand(p)) {
        let node = pod
            .spec
            .as_ref()
            .unwrap()
            .node_name
            .clone()
            .unwrap_or_default();
        assert!(
            gpu_nodes.contains(&node),
            "pod {} on non-GPU node {node}",
            pod.name_any()
        );
    }
    // Nodes got NVIDIA's labels.
    let node = Api::<Node>::all(s.admin.clone())
        .get(&gpu_nodes[0])
        .await
        .unwrap();
    assert_eq!(
        node.labels().get(GPU_PRESENT).map(String::as_str),
        Some("true")
    );
    assert_eq!(
        node.labels().get(DEPLOY_DRIVER).map(String::as_str),
        Some("true")
    );
    s.teardown().await;
}

#[tokio::test]
async fn disabling_dcgm_exporter_removes_its_objects_and_rolls_nothing_else() {
    let Some(s) = start(json!({}), &[]).await else {
        return;
    };
    s.await_state(State::Ready, "policy ready").await;
    let before = s.generations().await;
    s.patch_policy(json!({"spec": {"dcgmExporter": {"enabled": false}}}))
        .await;
    let ds = s.daemonsets();
    wait::until(TIMEOUT, "dcgm-exporter DaemonSet removed", || {
        let ds = ds.clone();
        async move {
            Ok(match ds.get_opt("nvidia-dcgm-exporter").await? {
                None => Ok(()),
                Some(_) => Err("still there".to_string()),
            })
        }
    })
    .await
    .unwrap();
    // The same prune pass deletes the Service a moment after the DaemonSet.
    let services = Api::<Service>::namespaced(s.admin.clone(), &s.identity.namespace);
    wait::until(
        Duration::from_secs(10),
        "dcgm-exporter Service pruned",
        || {
            let services = services.clone();
            async move {
                Ok(match services.get_opt("nvidia-dcgm-exporter").await? {
                    None => Ok(()),
                    Some(_) => Err("still there".to_string()),
                })
            }
        },
    )
    .await
    .unwrap();
    let accounts = Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(
        s.admin.clone(),
        &s.identity.namespace,
    );
    wait::until(
        Duration::from_secs(10),
        "dcgm-exporter ServiceAccount pruned",
        || {
            let accounts = accounts.clone();
            async move {
                Ok(match accounts.get_opt("nvidia-dcgm-exporter").await? {
                    None => Ok(()),
                    Some(_) => Err("still there".to_string()),
                })
            }
        },
    )
    .await
    .unwrap();
    s.await_state(State::Ready, "ready without dcgm-exporter")
        .await;
    let mut after = s.generations().await;
    after.remove("nvidia-dcgm-exporter");
    let mut before = before;
    before.remove("nvidia-dcgm-exporter");
    assert_eq!(
        generation_changes(&before, &after),
        Vec::<String>::new(),
        "other operands rolled"
    );
    s.teardown().await;
}

/// The `Unsupported` condition's message once it names every one of `paths` (or, with an empty
/// list, once the condition is gone).
async fn await_unsupported(s: &Setup, paths: &[&str]) -> String {
    let api = policies(&s.admin);
    let name = s.policy.clone();
    let want: Vec<String> = paths.iter().map(|p| (*p).to_owned()).collect();
    wait::until(TIMEOUT, "Unsupported condition", || {
        let api = api.clone();
        let name = name.clone();
        let want = want.clone();
        async move {
            let policy = api.get(&name).await?;
            let condition = policy
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .into_iter()
                .find(|c| c.type_ == "Unsupported");
            Ok(match condition {
                None if want.is_empty() => Ok(String::new()),
                None => Err("no Unsupported condition".to_string()),
                Some(c) if want.is_empty() => Err(format!("still there: {}", c.message)),
                Some(c) => match want.iter().find(|p| {
                    !c.message.contains(&format!(
                        "{p} is accepted but not acted on by this operator"
                    ))
                }) {
                    None => Ok(c.message),
                    Some(p) => Err(format!("{p} not named in: {}", c.message)),
                },
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()))
}

#[tokio::test]
async fn fields_accepted_but_not_acted_on_are_named_in_status_by_path() {
    let Some(s) = start(
        json!({
            "driver": {"useOpenKernelModules": true, "upgradePolicy": {"autoUpgrade": false}, "readinessProbe": {"periodSeconds": 20}},
            "dcgm": {"hostPort": 5555},
            "gds": {"args": ["--verbose"]},
        }),
        &[],
    ).await else {
        return;
    };
    let message = await_unsupported(
        &s,
        &[
            "spec.gds.args",
            "spec.driver.useOpenKernelModules",
            "spec.dcgm.hostPort",
        ],
    )
    .await;
    // Server-side defaults (upgradePolicy.maxParallelUpgrades: 1, ...) ask for nothing.
    assert!(!message.contains("maxParallelUpgrades"), "{message}");
    // The driver's readiness probe is acted on: on the live DaemonSet, not in the condition.
    assert!(!message.contains("readinessProbe"), "{message}");
    let driver = s.daemonsets().get("nvidia-driver-daemonset").await.unwrap();
    let readiness = driver
        .spec
        .and_then(|spec| spec.template.spec)
        .and_then(|pod| {
            pod.containers
                .into_iter()
                .find(|c| c.name == "nvidia-driver-ctr")
        })
        .and_then(|c| c.readiness_probe)
        .expect("the driver container has the policy's readiness probe");
    assert_eq!(readiness.period_seconds, Some(20));

    s.patch_policy(json!({"spec": {
        "driver": {"useOpenKernelModules": null},
        "dcgm": {"hostPort": null},
        "gds": {"args": null},
    }}))
    .await;
    await_unsupported(&s, &[]).await;
    s.teardown().await;
}

#[tokio::test]
async fn patching_the_device_plugin_config_name_rolls_the_config_consumers_only() {
    let Some(s) = start(json!({}), &[]).await else {
        return;
    };
    s.await_state(State::Ready, "policy ready").await;
    config_map(
        &s.admin,
        &s.identity.namespace,
        "time-slicing-config",
        &[("any", &time_slicing(4))],
    )
    .await;
    let before = s.generations().await;
    s.patch_policy(json!({"spec": {"devicePlugin": {"config": {"name": "time-slicing-config"}}}}))
        .await;
    s.await_state(State::Ready, "ready with sharing config")
        .await;
    let changed = generation_changes(&before, &s.generations().await);
    let consumers: Vec<String> = ["gpu-feature-discovery", "nvidia-device-plugin-daemonset"]
        .map(String::from)
        .to_vec();
    assert!(
        changed
            .iter()
            .all(|c| consumers.contains(c) || c == "nvidia-device-plugin-mps-control-daemon"),
        "rolled: {changed:?}"
    );
    assert!(
        changed.contains(&consumers[1]) && changed.contains(&consumers[0]),
        "rolled: {changed:?}"
    );
    s.teardown().await;
}

#[tokio::test]
async fn editing_the_referenced_configmap_rolls_the_device_plugin_within_2_seconds() {
    let Some(s) = start(
        json!({"devicePlugin": {"config": {"name": "time-slicing-config"}}}),
        &[],
    )
    .await
    else {
        return;
    };
    config_map(
        &s.admin,
        &s.identity.namespace,
        "time-slicing-config",
        &[("any", &time_slicing(4))],
    )
    .await;
    s.await_state(State::Ready, "ready with sharing config")
        .await;
    let before = s.generations().await;
    let edited = Instant::now();
    config_map(
        &s.admin,
        &s.identity.namespace,
        "time-slicing-config",
        &[("any", &time_slicing(8))],
    )
    .await;
    let ds = s.daemonsets();
    let old = before["nvidia-device-plugin-daemonset"];
    wait::until(
        Duration::from_secs(2),
        "device plugin template updated",
        || {
            let ds = ds.clone();
            async move {
                let g = ds
                    .get("nvidia-device-plugin-daemonset")
                    .await?
                    .metadata
                    .generation
                    .unwrap_or(0);
                Ok(if g > old {
                    Ok(())
                } else {
                    Err(format!("generation {g}"))
                })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", s.operator.log_text()));
    eprintln!(
        "device plugin template updated {:?} after the ConfigMap edit",
        edited.elapsed()
    );
    s.teardown().await;
}

#[tokio::test]
async fn deleting_or_editing_a_managed_daemonset_is_undone_within_2_seconds() {
    let Some(s) = start(json!({}), &[]).await else {
        return;
    };
    s.await_state(State::Ready, "policy ready").await;
    let ds = s.daemonsets();
    ds.delete("gpu-feature-discovery", &DeleteParams::background())
        .await
        .unwrap();
    let deleted = Instant::now();
    wait::until(
        Duration::from_secs(2),
        "deleted DaemonSet recreated",
        || {
            let ds = ds.clone();
            async move {
                Ok(match ds.get_opt("gpu-feature-discovery").await? {
                    Some(d) if d.metadata.deletion_timestamp.is_none() => Ok(()),
                    _ => Err("absent".to_string()),
                })
            }
        },
    )
    .await
    .unwrap();
    eprintln!("recreated after {:?}", deleted.elapsed());

    let patch =
        json!({"spec": {"template": {"spec": {"priorityClassName": "system-cluster-critical"}}}});
    ds.patch(
        "nvidia-device-plugin-daemonset",
        &PatchParams::default(),
        &Patch::Merge(patch),
    )
    .await
    .unwrap();
    wait::until(Duration::from_secs(2), "hand edit undone", || {
        let ds = ds.clone();
        async move {
            let d = ds.get("nvidia-device-plugin-daemonset").await?;
            let pc = d
                .spec
                .and_then(|s| s.template.spec)
                .and_then(|s| s.priority_class_name);
            Ok(if pc.as_deref() == Some("system-node-critical") {
                Ok(())
            } else {
                Err(format!("{pc:?}"))
            })
        }
    })
    .await
    .unwrap();
    s.teardown().await;
}

#[tokio::test]
async fn restarting_the_operator_with_nothing_changed_makes_no_writes_but_its_lease() {
    let Some(mut s) = start(json!({}), &[]).await else {
        return;
    };
    s.await_state(State::Ready, "policy ready").await;
    // What the old process still sends while it stops does not count.
    s.operator.terminate(Duration::from_secs(20)).unwrap();
    let log = AuditLog::from_env().unwrap();
    let mark = log.mark().unwrap();
    // The new process has run a pass; then a few quiet seconds.
    s.start_operator_again().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let events = log.of_user_since(mark, &s.identity.username()).unwrap();
    let writes = audit::described_writes(&events);
    assert!(
        writes.is_empty(),
        "writes after restart: {writes:#?}\n{}",
        s.operator.log_text()
    );
    s.teardown().await;
}

#[tokio::test]
async fn crash_looping_validator_pods_turn_the_status_not_ready_until_they_recover() {
    let Some(s) = start(json!({}), &[]).await else {
        return;
    };
    s.await_state(State::Ready, "policy ready").await;
    let victim = nodes::gpu_node_names(&s.admin).await.unwrap()[0].clone();
    let crash = CrashLoop::start(&s.admin, &victim, "nvidia-operator-validator")
        .await
        .unwrap();
    let policy = s
        .await_state(State::NotReady, "not ready while the validator crash-loops")
        .await;
    let ready = policy
        .status
        .unwrap()
        .conditions
        .unwrap()
        .into_iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(ready.reason, "OperandNotReady");
    assert!(
        ready.message.contains("operator-validator"),
        "{}",
        ready.message
    );
    assert!(ready.message.contains("1 of"), "{}", ready.message);
    assert!(ready.message.contains(&victim), "{}", ready.message);
    crash.recover().await.unwrap();
    s.await_state(State::Ready, "ready after recovery").await;
    s.teardown().await;
}

#[tokio::test]
async fn a_second_policy_is_ignored_and_deleting_the_active_one_removes_every_operand() {
    let Some(s) = start(json!({}), &[]).await else {
        return;
    };
    s.await_state(State::Ready, "policy ready").await;
    let second = unique_name("second-policy");
    create_policy(&s.admin, &second, json!({"driver": {"enabled": false}})).await;
    let api = policies(&s.admin);
    let ignored = wait::until(TIMEOUT, "second policy ignored", || {
        let api = api.clone();
        let second = second.clone();
        async move {
            let p = api.get(&second).await?;
            Ok(match p.status.clone() {
                Some(st) if st.state == State::Ignored => Ok(p),
                other => Err(format!("{other:?}")),
            })
        }
    })
    .await
    .unwrap();
    let condition = ignored
        .status
        .unwrap()
        .conditions
        .unwrap()
        .into_iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert!(
        condition.message.contains(&s.policy),
        "{}",
        condition.message
    );
    api.delete(&second, &DeleteParams::default()).await.unwrap();
    // The driver of the active policy is untouched by the ignored one.
    assert!(
        s.daemonsets()
            .get_opt("nvidia-driver-daemonset")
            .await
            .unwrap()
            .is_some()
    );
    s.teardown().await;
}

#[tokio::test]
async fn a_new_gpu_node_gets_labels_and_pods_and_losing_its_nfd_label_removes_them() {
    let Some(s) = start(json!({}), &["--gpu-label-grace-seconds", "3"]).await else {
        return;
    };
    s.await_state(State::Ready, "policy ready").await;
    let name = unique_name("late-t4");
    nodes::create(&s.admin, &[FakeNode::gpu(&name, GpuModel::T4)])
        .await
        .unwrap();
    let pods = Api::<Pod>::namespaced(s.admin.clone(), &s.identity.namespace);
    let on_node = ListParams::default().fields(&format!("spec.nodeName={name}"));
    wait::until(TIMEOUT, "operand pods on the new node", || {
        let pods = pods.clone();
        let on_node = on_node.clone();
        async move {
            let n = pods.list(&on_node).await?.items.len();
            Ok(if n >= 5 {
                Ok(())
            } else {
                Err(format!("{n} pods"))
            })
        }
    })
    .await
    .unwrap();
    let node_api = Api::<Node>::all(s.admin.clone());
    let labels = node_api.get(&name).await.unwrap().metadata.labels.unwrap();
    assert_eq!(
        labels.get(DEPLOY_DEVICE_PLUGIN).map(String::as_str),
        Some("true")
    );
    assert!(
        !labels.contains_key(DEPLOY_MIG_MANAGER),
        "a T4 is not MIG-capable"
    );

    // NFD loses the label for good: after the grace period the node is unmarked and emptied.
    let unlabel = json!({"metadata": {"labels": {
        "feature.node.kubernetes.io/pci-10de.present": null,
        "feature.node.kubernetes.io/pci-0302_10de.present": null}}});
    node_api
        .patch(&name, &PatchParams::default(), &Patch::Merge(unlabel))
        .await
        .unwrap();
    wait::until(TIMEOUT, "operand pods gone from the node", || {
        let pods = pods.clone();
        let on_node = on_node.clone();
        async move {
            let left: Vec<String> = pods
                .list(&on_node)
                .await?
                .items
                .iter()
                .filter(|p| is_gpu_operand(p) && p.metadata.deletion_timestamp.is_none())
                .map(|p| p.name_any())
                .collect();
            Ok(if left.is_empty() {
                Ok(())
            } else {
                Err(format!("pods left: {left:?}"))
            })
        }
    })
    .await
    .unwrap();
    let labels = node_api.get(&name).await.unwrap().metadata.labels.unwrap();
    assert!(!labels.contains_key(GPU_PRESENT));
    nodes::delete(&s.admin, &[name]).await.unwrap();
    s.teardown().await;
}

#[tokio::test]
async fn an_untolerated_taint_shows_in_status_and_a_short_nfd_label_loss_deletes_nothing() {
    let Some(s) = start(json!({}), &["--gpu-label-grace-seconds", "30"]).await else {
        return;
    };
    s.await_state(State::Ready, "policy ready").await;
    let node_api = Api::<Node>::all(s.admin.clone());
    let name = unique_name("taint-probe");
    let node = ephemeral_gpu_node(&name, GpuModel::H100Sxm80Gb).build();
    node_api
        .create(&PostParams::default(), &node)
        .await
        .unwrap();
    let taint = json!({"spec": {"taints": [{"key": "dedicated", "value": "training", "effect": "NoSchedule"}]}});
    node_api
        .patch(&name, &PatchParams::default(), &Patch::Merge(taint))
        .await
        .unwrap();
    // First the difference is reported as it is; once it has lasted, with its likely causes.
    for (what, part) in [
        (
            "labelled node without operand pods reported",
            "nodes labelled for it but the DaemonSet wants",
        ),
        (
            "the lasting difference explained",
            "a taint it does not tolerate",
        ),
    ] {
        wait::until(TIMEOUT, what, || async {
            let message = e2e::session::ready_message(&s.admin, &s.policy).await?;
            Ok(if message.contains(part) {
                Ok(())
            } else {
                Err(message)
            })
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    }
    nodes::delete(&s.admin, &[name]).await.unwrap();
    s.await_state(State::Ready, "ready again").await;

    // A GPU node loses NFD's label briefly (NFD restart): nothing is deleted.
    let victim = nodes::gpu_node_names(&s.admin).await.unwrap()[0].clone();
    let before = s.generations().await;
    let pods = Api::<Pod>::namespaced(s.admin.clone(), &s.identity.namespace);
    let on_node = ListParams::default().fields(&format!("spec.nodeName={victim}"));
    let pods_before = pods.list(&on_node).await.unwrap().items.len();
    let labels = node_api
        .get(&victim)
        .await
        .unwrap()
        .metadata
        .labels
        .unwrap();
    let nfd: Vec<&str> = nodes::NFD_GPU_LABEL_KEYS
        .iter()
        .copied()
        .filter(|k| labels.contains_key(*k))
        .collect();
    let remove: serde_json::Map<String, serde_json::Value> = nfd
        .iter()
        .map(|k| (k.to_string(), serde_json::Value::Null))
        .collect();
    node_api
        .patch(
            &victim,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": remove}})),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let restore: serde_json::Map<String, serde_json::Value> =
        nfd.iter().map(|k| (k.to_string(), json!("true"))).collect();
    node_api
        .patch(
            &victim,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": restore}})),
        )
        .await
        .unwrap();
    let labels = node_api
        .get(&victim)
        .await
        .unwrap()
        .metadata
        .labels
        .unwrap();
    assert_eq!(labels.get(GPU_PRESENT).map(String::as_str), Some("true"));
    assert_eq!(pods.list(&on_node).await.unwrap().items.len(), pods_before);
    assert_eq!(
        generation_changes(&before, &s.generations().await),
        Vec::<String>::new()
    );
    s.teardown().await;
}

/// Waits until `operator` logs that it holds the Lease.
async fn await_leadership(operator: &Operator, timeout: Duration, what: &str) {
    wait::until(timeout, what, || {
        let text = operator.log_text();
        async move {
            Ok(if text.contains("became leader") {
                Ok(())
            } else {
                Err("not leader yet".to_string())
            })
        }
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn two_replicas_elect_one_leader_and_hand_over_on_sigterm_and_sigkill() {
    let lease = ["--lease-duration-seconds", "6"];
    let Some(mut s) = start(json!({}), &lease).await else {
        return;
    };
    s.await_state(State::Ready, "policy ready").await;
    let mut standby = Operator::start(&s.identity, &lease).unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(s.operator.log_text().contains("became leader"));
    assert!(
        !standby.log_text().contains("became leader"),
        "two leaders:\n{}",
        standby.log_text()
    );

    // SIGTERM: the leader releases the Lease, the standby takes over at once.
    let code = s.operator.terminate(Duration::from_secs(20)).unwrap();
    assert_eq!(code, Some(0), "{}", s.operator.log_text());
    let released = Instant::now();
    await_leadership(
        &standby,
        Duration::from_secs(5),
        "standby became leader after SIGTERM",
    )
    .await;
    eprintln!("handover after SIGTERM took {:?}", released.elapsed());

    // SIGKILL: the next standby takes over once the Lease expires.
    let mut third = Operator::start(&s.identity, &lease).unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    standby.kill().unwrap();
    let killed = Instant::now();
    // Lease duration 6 s, plus one renewal period of slack.
    await_leadership(
        &third,
        Duration::from_secs(6 + 6),
        "third replica became leader after SIGKILL",
    )
    .await;
    eprintln!("handover after SIGKILL took {:?}", killed.elapsed());
    assert!(third.is_running());
    s.operator = third;
    s.await_state(State::Ready, "ready under the third replica")
        .await;
    s.teardown().await;
}
