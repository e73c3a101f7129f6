//! The operator under faults: the API server restarting, a leader whose Lease renewals vanish,
//! NFD losing half the fleet's labels, a node deleted while its label loss is in its grace
//! period (a long suite, `make test-long`; NVIDIA's Lease and the Lease namespace: leader.rs). Each test measures what it bounds and
//! prints the figure (`eprintln!`, shown with `--nocapture`).
//!
//! The API server tests stop and start the harness's kube-apiserver (e2e::faults): run them on
//! a harness of your own, one test at a time (tests/e2e.sh does both).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use e2e::audit::{self, AuditLog};
use e2e::cluster::unique_name;
use e2e::faults::{ControlPlane, LeaseBlackHole};
use e2e::nodes;
use e2e::operator::{Operator, OperatorIdentity};
use e2e::session::*;
use e2e::wait;
use gpu_operator::api::State;
use gpu_operator::nodes::GPU_PRESENT;
use k8s_openapi::api::core::v1::{Node, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, RoleRef, Subject};
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use serde_json::json;

/// A short Lease keeps the tests short; the arithmetic is the production one (crate::leader).
const LEASE_SECONDS: u64 = 6;
const LEASE: [&str; 2] = ["--lease-duration-seconds", "6"];

/// Waits until the dcgm-exporter carries tick `n` and the policy's status is written for its
/// current generation without an error: what the operator owes after a control-plane fault.
/// Operand readiness is not waited for: after an API server restart the controller manager may
/// mark pods not ready (stale kwok heartbeats), and kwok never reports them ready again, as a
/// kubelet would.
async fn await_operator_converged(s: &Setup, n: u32, what: &str) -> Duration {
    let started = Instant::now();
    let want = n.to_string();
    wait::until(CONVERGENCE_BOUND, what, || async {
        let tick = s.template_env("nvidia-dcgm-exporter", "E2E_TICK").await;
        let policy = policies(&s.admin).get(&s.policy).await?;
        let ready = ready_condition(&policy);
        let current = ready.and_then(|c| c.observed_generation) >= policy.metadata.generation;
        let error = policy
            .status
            .as_ref()
            .and_then(|st| st.conditions.as_ref())
            .into_iter()
            .flatten()
            .any(|c| c.type_ == "Error" && c.status == "True");
        Ok(
            if tick.as_deref() == Some(want.as_str()) && current && !error {
                Ok(())
            } else {
                Err(format!(
                    "dcgm-exporter tick {tick:?}, status current {current}, error {error}: {:?}",
                    ready.map(|c| &c.message)
                ))
            },
        )
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    started.elapsed()
}

/// Waits until `operator` has logged `line` `count` times in all.
async fn await_log_count(operator: &Operator, line: &str, count: usize, timeout: Duration) {
    wait::until(timeout, &format!("{count}× {line:?}"), || async {
        let n = operator.log_text().matches(line).count();
        Ok(if n >= count {
            Ok(())
        } else {
            Err(format!("{n} so far"))
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\nlog:\n{}", operator.log_text()));
}

fn assert_alive(operator: &mut Operator, who: &str) {
    assert!(
        operator.is_running(),
        "the {who} exited:\n{}",
        operator.log_text()
    );
}

/// Both replicas survive an API server outage longer than their Lease (the old code exited on
/// the first failed renewal: a crash loop for every replica), and the pair converges on a
/// change made after the outage within the bound.
#[tokio::test]
async fn api_server_restart_at_steady_state_keeps_both_replicas_and_converges() {
    let Some(mut s) = start(json!({}), &LEASE).await else {
        return;
    };
    let control_plane = ControlPlane::from_env().unwrap();
    s.await_state(State::Ready, "policy ready").await;
    let mut standby = Operator::start(&s.identity, &LEASE).unwrap();
    await_log_count(&standby, "waiting to become leader", 1, TIMEOUT).await;

    // Down for longer than the Lease: the leader's write window closes and it steps down.
    let outage = control_plane
        .restart_apiserver(&s.admin, Duration::from_secs(LEASE_SECONDS + 2))
        .await
        .unwrap();
    eprintln!("API server unavailable for {:?}", outage.unavailable);
    tick(&s, 1).await;
    let converged = await_operator_converged(&s, 1, "converged after the API server restart").await;
    eprintln!(
        "after the API server restart: a change made once it was ready was applied and its status written after {converged:?}"
    );
    assert_alive(&mut s.operator, "first replica");
    assert_alive(&mut standby, "second replica");
    let leaders = [&s.operator, &standby]
        .iter()
        .filter(|o| o.log_text().contains("stepped down as leader"))
        .count();
    eprintln!("replicas that stepped down during the outage: {leaders}");
    standby.terminate(Duration::from_secs(20)).unwrap();
    s.teardown().await;
}

/// The API server restarts while a rollout is being applied: the replicas recover without
/// exiting and the rollout completes.
#[tokio::test]
async fn api_server_restart_mid_rollout_recovers_and_converges() {
    let Some(mut s) = start(json!({}), &LEASE).await else {
        return;
    };
    let control_plane = ControlPlane::from_env().unwrap();
    s.await_state(State::Ready, "policy ready").await;
    let mut standby = Operator::start(&s.identity, &LEASE).unwrap();
    await_log_count(&standby, "waiting to become leader", 1, TIMEOUT).await;

    // A change that rolls a DaemonSet, and the API server restarted as the leader applies it.
    let reconciles = s.operator.reconciles().await;
    tick(&s, 7).await;
    wait::until(
        TIMEOUT,
        "the leader started a pass for the change",
        || async {
            let n = s.operator.reconciles().await;
            Ok(if n > reconciles {
                Ok(())
            } else {
                Err(format!("{n} reconciles"))
            })
        },
    )
    .await
    .unwrap();
    let outage = control_plane
        .restart_apiserver(&s.admin, Duration::ZERO)
        .await
        .unwrap();
    eprintln!("API server unavailable for {:?}", outage.unavailable);
    let converged = await_operator_converged(&s, 7, "rollout converged after the restart").await;
    eprintln!(
        "mid-rollout API server restart: the change applied and its status written {converged:?} after the API server was ready"
    );
    assert_alive(&mut s.operator, "first replica");
    assert_alive(&mut standby, "second replica");
    standby.terminate(Duration::from_secs(20)).unwrap();
    s.teardown().await;
}

/// A second ServiceAccount in the operator's namespace, bound like the first (to the same
/// generated ClusterRole), so two replicas have different audit usernames; returns its identity
/// and the binding to delete.
async fn second_identity(s: &Setup, name: &str) -> (OperatorIdentity, String) {
    let namespace = s.identity.namespace.clone();
    // The first identity's binding is named after its namespace (OperatorIdentity::create).
    let role = Api::<ClusterRoleBinding>::all(s.admin.clone())
        .get(&namespace)
        .await
        .unwrap()
        .role_ref
        .name;
    Api::<ServiceAccount>::namespaced(s.admin.clone(), &namespace)
        .create(
            &PostParams::default(),
            &ServiceAccount {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    ..ObjectMeta::default()
                },
                ..ServiceAccount::default()
            },
        )
        .await
        .unwrap();
    let binding = format!("{namespace}-{name}");
    Api::<ClusterRoleBinding>::all(s.admin.clone())
        .create(
            &PostParams::default(),
            &ClusterRoleBinding {
                metadata: ObjectMeta {
                    name: Some(binding.clone()),
                    ..ObjectMeta::default()
                },
                role_ref: RoleRef {
                    api_group: Some("rbac.authorization.k8s.io".into()),
                    kind: "ClusterRole".into(),
                    name: role,
                },
                subjects: Some(vec![Subject {
                    kind: "ServiceAccount".into(),
                    name: name.into(),
                    namespace: Some(namespace.clone()),
                    ..Subject::default()
                }]),
            },
        )
        .await
        .unwrap();
    e2e::operator::bind_generated_role(&s.admin, &namespace, name)
        .await
        .unwrap();
    let identity = OperatorIdentity::existing(&s.admin, &namespace, name)
        .await
        .unwrap();
    (identity, binding)
}

/// The leader's Lease updates hang (a webhook that never answers, for its identity only) while
/// everything else it does still works and there is always something to write. It must stop
/// writing before the standby, which takes the Lease once it expires, writes anything: no
/// request of the old leader after the new one's first.
#[tokio::test]
async fn a_black_holed_lease_renewal_stops_the_old_leader_before_the_standby_writes() {
    let Some(mut s) = start(json!({}), &LEASE).await else {
        return;
    };
    s.await_state(State::Ready, "policy ready").await;
    let (standby_identity, binding) = second_identity(&s, "gpu-operator-standby").await;
    let standby = Operator::start(&standby_identity, &LEASE).unwrap();
    await_log_count(&standby, "waiting to become leader", 1, TIMEOUT).await;
    let log = AuditLog::from_env().unwrap();
    let mark = log.mark().unwrap();

    let hole = LeaseBlackHole::install(
        &s.admin,
        &s.identity.namespace,
        &s.identity.username(),
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let holed = Instant::now();
    // Keep the leader busy: a change to apply every 700 ms, until the standby has led a while.
    let mut n = 100;
    let mut took_over = None;
    while holed.elapsed() < Duration::from_secs(40) {
        n += 1;
        tick(&s, n).await;
        if took_over.is_none() && standby.log_text().contains("became leader") {
            took_over = Some(holed.elapsed());
        }
        if let Some(at) = took_over
            && holed.elapsed() > at + Duration::from_secs(8)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    let took_over = took_over.unwrap_or_else(|| {
        panic!(
            "the standby never took over\nold leader:\n{}\nstandby:\n{}",
            s.operator.log_text(),
            standby.log_text()
        )
    });
    eprintln!("standby took over {took_over:?} after the old leader's renewals were black-holed");
    await_converged(&s, n, "the new leader applied the last change").await;
    tokio::time::sleep(Duration::from_secs(2)).await;

    let old_writes: Vec<audit::AuditEvent> = log
        .mutating_since(mark, &s.identity.username())
        .unwrap()
        .into_iter()
        .filter(|e| !e.is_lease())
        .collect();
    let new_writes: Vec<audit::AuditEvent> = log
        .mutating_since(mark, &standby_identity.username())
        .unwrap()
        .into_iter()
        .filter(|e| !e.is_lease())
        .collect();
    let first_new = new_writes
        .iter()
        .map(audit::AuditEvent::received)
        .min()
        .expect("the new leader wrote nothing");
    let last_old = old_writes.iter().map(audit::AuditEvent::received).max();
    let overlapping: Vec<String> = old_writes
        .iter()
        .filter(|e| e.received() >= first_new)
        .map(ToString::to_string)
        .collect();
    if let Some(last_old) = last_old {
        eprintln!(
            "old leader's last write {:?} before the new leader's first ({} writes by the old leader after the black hole, {} by the new)",
            first_new.duration_since(last_old).unwrap_or_default(),
            old_writes.len(),
            new_writes.len()
        );
    }
    assert!(
        overlapping.is_empty(),
        "the old leader wrote after the new leader's first write: {overlapping:#?}\nold leader:\n{}",
        s.operator.log_text()
    );
    assert_alive(&mut s.operator, "old leader");
    assert!(
        s.operator.log_text().contains("stepped down as leader"),
        "{}",
        s.operator.log_text()
    );

    hole.remove().await.unwrap();
    s.operator.terminate(Duration::from_secs(20)).unwrap();
    s.operator = standby;
    let admin = s.admin.clone();
    s.teardown().await;
    Api::<ClusterRoleBinding>::all(admin)
        .delete(&binding, &DeleteParams::default())
        .await
        .unwrap();
}

/// The NFD GPU labels of `names` removed (`restore`: put back).
async fn set_nfd_labels(admin: &kube::Client, names: &[String], restore: bool) {
    let api: Api<Node> = Api::all(admin.clone());
    for name in names {
        let labels: serde_json::Map<String, serde_json::Value> = nodes::NFD_GPU_LABEL_KEYS
            .iter()
            .map(|k| {
                (
                    k.to_string(),
                    if restore {
                        json!("true")
                    } else {
                        serde_json::Value::Null
                    },
                )
            })
            .collect();
        api.patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": labels}})),
        )
        .await
        .unwrap();
    }
}

async fn marked(admin: &kube::Client, names: &[String]) -> Vec<String> {
    let api: Api<Node> = Api::all(admin.clone());
    let mut out = Vec::new();
    for name in names {
        let node = api.get(name).await.unwrap();
        if node.metadata.labels.unwrap_or_default().get(GPU_PRESENT) == Some(&"true".to_string()) {
            out.push(name.clone());
        }
    }
    out
}

/// NFD's labels vanish from half the GPU nodes for longer than the grace period (an NFD
/// upgrade gone wrong): the breaker unmarks at most its share (one node of six per grace
/// window) and says in status how many it holds back; the labels coming back clear it.
#[tokio::test]
async fn nfd_labels_gone_from_half_the_gpu_nodes_past_the_grace_are_held_by_the_breaker() {
    let grace = 8;
    let Some(s) = start(json!({}), &["--gpu-label-grace-seconds", "8"]).await else {
        return;
    };
    s.await_state(State::Ready, "policy ready").await;
    let mut gpu = nodes::gpu_node_names(&s.admin).await.unwrap();
    gpu.sort();
    let half: Vec<String> = gpu.iter().take(gpu.len() / 2).cloned().collect();
    assert!(
        half.len() >= 3,
        "the standard fleet has 6 GPU nodes: {gpu:?}"
    );
    set_nfd_labels(&s.admin, &half, false).await;
    let lost = Instant::now();
    // Past the grace period and well inside the second window.
    tokio::time::sleep(Duration::from_secs(grace + 4)).await;
    let still_marked = marked(&s.admin, &half).await;
    let message = ready_message(&s.admin, &s.policy).await.unwrap();
    let held = half.len() - 1;
    // Put the labels back before asserting, so a failure leaves the fleet as it was.
    set_nfd_labels(&s.admin, &half, true).await;
    eprintln!(
        "{:?} after NFD's labels vanished from {} of {} GPU nodes: {} still marked; status: {message}",
        lost.elapsed(),
        half.len(),
        gpu.len(),
        still_marked.len()
    );
    assert_eq!(
        still_marked.len(),
        held,
        "the breaker let more than one node go: {still_marked:?} of {half:?}\n{}",
        s.operator.log_text()
    );
    assert!(
        message.contains(&format!("{held} held back by the label-loss breaker")),
        "{message}"
    );
    // Labels back: every node marked again, the warning gone.
    wait::until(TIMEOUT, "every node marked again", || async {
        let m = marked(&s.admin, &half).await;
        Ok(if m.len() == half.len() {
            Ok(())
        } else {
            Err(format!("{m:?}"))
        })
    })
    .await
    .unwrap();
    wait::until(TIMEOUT, "the breaker's warning cleared", || async {
        let message = ready_message(&s.admin, &s.policy).await?;
        Ok(if message.contains("held back") {
            Err(message)
        } else {
            Ok(())
        })
    })
    .await
    .unwrap();
    s.await_state(State::Ready, "ready with the labels back")
        .await;
    s.teardown().await;
}

/// A node whose GPU label vanished is deleted before its grace period ends: nothing about it
/// must keep the loop running (the old code requeued every 100 ms for ever).
#[tokio::test]
async fn a_node_deleted_during_the_grace_leaves_the_reconcile_loop_idle() {
    let Some(s) = start(json!({}), &["--gpu-label-grace-seconds", "6"]).await else {
        return;
    };
    s.await_state(State::Ready, "policy ready").await;
    let name = unique_name("gpu-doomed");
    nodes::create(&s.admin, &[ephemeral_gpu_node(&name, nodes::GpuModel::T4)])
        .await
        .unwrap();
    wait::until(TIMEOUT, "new node marked", || async {
        let m = marked(&s.admin, std::slice::from_ref(&name)).await;
        Ok(if m.is_empty() {
            Err("not yet".into())
        } else {
            Ok(())
        })
    })
    .await
    .unwrap();
    s.await_state(State::Ready, "ready with the new node").await;
    set_nfd_labels(&s.admin, std::slice::from_ref(&name), false).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    nodes::delete(&s.admin, std::slice::from_ref(&name))
        .await
        .unwrap();
    s.await_state(State::Ready, "ready without the node").await;
    // Past the grace period the deleted node would have reached, then a quiet window.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let before = s.operator.reconciles().await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let after = s.operator.reconciles().await;
    eprintln!(
        "reconciles in 10 s after the deleted node's grace ended: {}",
        after - before
    );
    assert!(
        after - before <= 5.0,
        "the loop kept running: {} passes in 10 s\n{}",
        after - before,
        s.operator.log_text()
    );
    s.teardown().await;
}
