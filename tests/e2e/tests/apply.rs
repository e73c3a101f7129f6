//! Apply exactly what the policy says (decisions 9, 17, 18): a setting that is switched off goes
//! off in the live objects, and the policy is not `ready` before it has; deleting a policy, in
//! the foreground or the background, makes the operator write nothing but its node cleanup and
//! finalizer while the garbage collector removes everything; an object the API server refuses freezes its operand only; and
//! after all of that a steady cluster and an operator restart cost no writes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use e2e::audit::{self, AuditLog};
use e2e::operator::Operator;
use e2e::session::{self, Setup, TIMEOUT, create_policy, policies};
use e2e::{steady, wait};
use gpu_operator::api::{ClusterPolicy, State};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

/// How soon a removed setting must be gone from the live DaemonSet.
const REMOVAL_DEADLINE: Duration = Duration::from_secs(2);

/// One optional setting: the policy patch that sets it, the JSON patch that removes it again,
/// the DaemonSet it shows on and where.
struct Setting {
    name: &'static str,
    set: Value,
    remove: Value,
    daemonset: &'static str,
    /// The live value at this JSON pointer while set (absent or different once removed).
    pointer: &'static str,
    expected: Value,
}

fn settings() -> Vec<Setting> {
    let gpu_toleration =
        json!({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"});
    let extra_toleration =
        json!({"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"});
    vec![
        Setting {
            name: "devicePlugin.hostNetwork",
            set: json!({"devicePlugin": {"hostNetwork": true}}),
            remove: json!([{"op": "remove", "path": "/spec/devicePlugin/hostNetwork"}]),
            daemonset: "nvidia-device-plugin-daemonset",
            pointer: "/spec/template/spec/hostNetwork",
            expected: json!(true),
        },
        Setting {
            name: "daemonsets.annotations",
            set: json!({"daemonsets": {"annotations": {"example.com/owner": "ml-platform"}}}),
            remove: json!([{"op": "remove", "path": "/spec/daemonsets/annotations"}]),
            daemonset: "gpu-feature-discovery",
            pointer: "/metadata/annotations/example.com~1owner",
            expected: json!("ml-platform"),
        },
        Setting {
            name: "dcgmExporter.resources",
            set: json!({"dcgmExporter": {"resources": {"limits": {"memory": "512Mi"}}}}),
            remove: json!([{"op": "remove", "path": "/spec/dcgmExporter/resources"}]),
            daemonset: "nvidia-dcgm-exporter",
            pointer: "/spec/template/spec/containers/0/resources/limits/memory",
            expected: json!("512Mi"),
        },
        Setting {
            name: "driver.secretEnv",
            set: json!({"driver": {"secretEnv": "driver-licence"}}),
            remove: json!([{"op": "remove", "path": "/spec/driver/secretEnv"}]),
            daemonset: "nvidia-driver-daemonset",
            pointer: "/spec/template/spec/containers/0/envFrom/0/secretRef/name",
            expected: json!("driver-licence"),
        },
        Setting {
            name: "daemonsets.tolerations (extra entry)",
            set: json!({"daemonsets": {"tolerations": [gpu_toleration, extra_toleration]}}),
            remove: json!([{"op": "remove", "path": "/spec/daemonsets/tolerations/1"}]),
            daemonset: "nvidia-operator-validator",
            pointer: "/spec/template/spec/tolerations/1/key",
            expected: json!("dedicated"),
        },
        Setting {
            name: "devicePlugin.imagePullSecrets",
            set: json!({"devicePlugin": {"imagePullSecrets": ["registry-credentials"]}}),
            remove: json!([{"op": "remove", "path": "/spec/devicePlugin/imagePullSecrets"}]),
            daemonset: "nvidia-device-plugin-daemonset",
            pointer: "/spec/template/spec/imagePullSecrets/0/name",
            expected: json!("registry-credentials"),
        },
    ]
}

/// The policy is `ready` for its current generation.
fn ready_now(policy: &ClusterPolicy) -> bool {
    let observed = session::ready_condition(policy).and_then(|c| c.observed_generation);
    policy.status.as_ref().map(|s| s.state) == Some(State::Ready)
        && observed >= policy.metadata.generation
}

async fn live_value(api: &Api<DaemonSet>, name: &str, pointer: &str) -> Option<Value> {
    let ds = api.get_opt(name).await.unwrap()?;
    serde_json::to_value(ds).unwrap().pointer(pointer).cloned()
}

#[tokio::test]
async fn a_removed_setting_is_gone_from_the_live_daemonset_before_the_policy_is_ready() {
    let Some(mut s) = session::start(json!({}), &[]).await else {
        return;
    };
    s.await_state(State::Ready, "policy ready").await;
    let daemonsets = s.daemonsets();
    let api = policies(&s.admin);
    let mut timings = Vec::new();
    for setting in settings() {
        s.patch_policy(json!({"spec": setting.set})).await;
        s.await_state(State::Ready, &format!("ready with {} set", setting.name))
            .await;
        assert_eq!(
            live_value(&daemonsets, setting.daemonset, setting.pointer).await,
            Some(setting.expected.clone()),
            "{} is not live on {} while the policy is ready",
            setting.name,
            setting.daemonset
        );

        let removed_at = Instant::now();
        api.patch(
            &s.policy,
            &PatchParams::default(),
            &Patch::<()>::Json(serde_json::from_value(setting.remove.clone()).unwrap()),
        )
        .await
        .unwrap();
        // Until the setting is gone, the policy must not say ready for the new generation.
        let gone_after = loop {
            let live = live_value(&daemonsets, setting.daemonset, setting.pointer).await;
            if live.as_ref() != Some(&setting.expected) {
                break removed_at.elapsed();
            }
            let policy = api.get(&s.policy).await.unwrap();
            assert!(
                !ready_now(&policy),
                "{}: the policy says ready for generation {:?} while {} still has {} = {}",
                setting.name,
                policy.metadata.generation,
                setting.daemonset,
                setting.pointer,
                setting.expected
            );
            assert!(
                removed_at.elapsed() < REMOVAL_DEADLINE,
                "{}: still live on {} after {REMOVAL_DEADLINE:?}\noperator log:\n{}",
                setting.name,
                setting.daemonset,
                s.operator.log_text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        timings.push(format!("{}: gone after {gone_after:?}", setting.name));
        s.await_state(
            State::Ready,
            &format!("ready with {} removed", setting.name),
        )
        .await;
        assert_ne!(
            live_value(&daemonsets, setting.daemonset, setting.pointer).await,
            Some(setting.expected.clone()),
            "{} came back",
            setting.name
        );
    }
    eprintln!("removals: {timings:#?}");

    // Steady after all of the above: 60 quiet seconds, an operator restart among them, and
    // not one write but the Lease.
    let log = AuditLog::from_env().unwrap();
    let user = s.identity.username();
    steady::await_quiet(&log, &user, Duration::from_secs(3), Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    let mark = log.mark().unwrap();
    tokio::time::sleep(Duration::from_secs(30)).await;
    s.restart_operator().await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    let writes = audit::described_writes(&log.of_user_since(mark, &user).unwrap());
    assert!(
        writes.is_empty(),
        "writes in 60 steady seconds with a restart: {writes:#?}\noperator log:\n{}",
        s.operator.log_text()
    );
    s.teardown().await;
}

/// Objects of ours left anywhere, as `Kind name` lines.
async fn managed_leftovers(admin: &Client, namespace: &str) -> Vec<String> {
    let managed = ListParams::default().labels("app.kubernetes.io/managed-by=gpu-operator");
    let mut left = Vec::new();
    macro_rules! collect {
        ($api:expr, $kind:literal) => {
            for o in $api.list_metadata(&managed).await.unwrap().items {
                left.push(format!("{} {}", $kind, o.name_any()));
            }
        };
    }
    collect!(
        Api::<DaemonSet>::namespaced(admin.clone(), namespace),
        "DaemonSet"
    );
    collect!(
        Api::<ConfigMap>::namespaced(admin.clone(), namespace),
        "ConfigMap"
    );
    collect!(
        Api::<ServiceAccount>::namespaced(admin.clone(), namespace),
        "ServiceAccount"
    );
    collect!(Api::<ClusterRole>::all(admin.clone()), "ClusterRole");
    collect!(
        Api::<ClusterRoleBinding>::all(admin.clone()),
        "ClusterRoleBinding"
    );
    collect!(Api::<RuntimeClass>::all(admin.clone()), "RuntimeClass");
    left
}

/// Deletes the ready policy `name` with `propagation`, waits until it and everything of ours is
/// gone, and returns the operator's writes since the deletion request other than the
/// teardown's (node cleaning, the finalizer).
async fn delete_and_collect(s: &Setup, name: &str, propagation: DeleteParams) -> Vec<String> {
    let log = AuditLog::from_env().unwrap();
    let user = s.identity.username();
    steady::await_quiet(&log, &user, Duration::from_secs(2), Duration::from_secs(30))
        .await
        .unwrap();
    let mark = log.mark().unwrap();
    policies(&s.admin).delete(name, &propagation).await.unwrap();
    let api = policies(&s.admin);
    let (admin, namespace) = (s.admin.clone(), s.identity.namespace.clone());
    wait::until(TIMEOUT, "policy and every managed object gone", || {
        let (api, admin, namespace) = (api.clone(), admin.clone(), namespace.clone());
        async move {
            let policy = api.get_opt(name).await?.is_some();
            let left = managed_leftovers(&admin, &namespace).await;
            Ok(if !policy && left.is_empty() {
                Ok(())
            } else {
                Err(format!("policy present: {policy}; left: {left:?}"))
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    // A few more seconds for anything a late pass might still send.
    tokio::time::sleep(Duration::from_secs(3)).await;
    operand_writes(
        &audit::described_writes(&log.of_user_since(mark, &user).unwrap()),
        name,
    )
}

/// Of `writes`, those a teardown may not make: anything but cleaning nodes (`patch nodes`)
/// and letting the policy go (`patch clusterpolicies <name>`, its finalizer).
fn operand_writes(writes: &[String], policy: &str) -> Vec<String> {
    let finalizer = format!("patch clusterpolicies {policy}");
    writes
        .iter()
        .filter(|w| !w.starts_with("patch nodes ") && **w != finalizer)
        .cloned()
        .collect()
}

#[tokio::test]
async fn deleting_a_ready_policy_in_the_foreground_or_background_gets_no_operand_writes_and_leaves_nothing()
 {
    let Some(s) = session::start(json!({}), &[]).await else {
        return;
    };
    s.await_state(State::Ready, "first policy ready").await;
    let foreground = delete_and_collect(&s, &s.policy.clone(), DeleteParams::foreground()).await;
    assert!(
        foreground.is_empty(),
        "operator operand writes during foreground deletion: {foreground:#?}\n{}",
        s.operator.log_text()
    );

    let second = e2e::cluster::unique_name("cluster-policy");
    create_policy(&s.admin, &second, json!({})).await;
    session::await_policy_state(&s.admin, &second, State::Ready, "second policy ready")
        .await
        .unwrap();
    let background = delete_and_collect(&s, &second, DeleteParams::background()).await;
    assert!(
        background.is_empty(),
        "operator operand writes during background deletion: {background:#?}\n{}",
        s.operator.log_text()
    );
    // Teardown deletes the (already deleted) session policy: recreate one for it.
    create_policy(&s.admin, &s.policy, json!({})).await;
    s.teardown().await;
}

#[tokio::test]
async fn an_object_the_api_server_rejects_freezes_its_operand_and_the_others_still_converge() {
    let Some(s) = session::start(json!({}), &[]).await else {
        return;
    };
    s.await_state(State::Ready, "policy ready").await;
    let daemonsets = s.daemonsets();
    let exporter_before = daemonsets.get("nvidia-dcgm-exporter").await.unwrap();

    // Requests above limits pass the CRD (both are valid quantities) and are refused by the API
    // server's DaemonSet validation. In the same change: GFD switched off (pruning) and a
    // variable for the device plugin (an apply).
    s.patch_policy(json!({"spec": {
        "dcgmExporter": {"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}},
        "gfd": {"enabled": false},
        "devicePlugin": {"env": [{"name": "E2E_MARKER", "value": "applied"}]},
    }}))
    .await;
    let frozen = s
        .await_state(State::NotReady, "rejected exporter reported")
        .await;
    let ready = session::ready_condition(&frozen).cloned().unwrap();
    for part in [
        "dcgm-exporter",
        "DaemonSet",
        "nvidia-dcgm-exporter",
        "spec.template.spec.containers[0].resources.requests",
        "must be less than or equal to cpu limit",
    ] {
        assert!(
            ready.message.contains(part),
            "status message lacks {part:?}: {}",
            ready.message
        );
    }
    assert_eq!(ready.reason, "ObjectRejected");
    // The others converged: GFD pruned, the plugin applied; the exporter kept as it was.
    wait::until(
        TIMEOUT,
        "GFD pruned and the plugin variable applied",
        || {
            let daemonsets = daemonsets.clone();
            async move {
                let gfd = daemonsets.get_opt("gpu-feature-discovery").await?.is_some();
                let plugin = daemonsets.get("nvidia-device-plugin-daemonset").await?;
                let marker = serde_json::to_string(&plugin.spec)
                    .unwrap()
                    .contains("E2E_MARKER");
                Ok(if !gfd && marker {
                    Ok(())
                } else {
                    Err(format!("gfd present {gfd}, marker {marker}"))
                })
            }
        },
    )
    .await
    .unwrap();
    let exporter = daemonsets.get("nvidia-dcgm-exporter").await.unwrap();
    assert_eq!(
        exporter.metadata.generation, exporter_before.metadata.generation,
        "the frozen exporter was changed"
    );

    // The fix converges.
    s.patch_policy(json!({"spec": {"dcgmExporter": {"resources": {"requests": {"cpu": "1"}}}}}))
        .await;
    s.await_state(State::Ready, "ready after the fix").await;
    let exporter = daemonsets.get("nvidia-dcgm-exporter").await.unwrap();
    assert_eq!(
        serde_json::to_value(&exporter)
            .unwrap()
            .pointer("/spec/template/spec/containers/0/resources/requests/cpu"),
        Some(&json!("1"))
    );
    s.teardown().await;
}

#[tokio::test]
async fn a_label_key_the_api_server_would_refuse_is_rejected_by_the_crd_naming_the_field() {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    e2e::crd::install_cluster_policy_crd(&admin, "e2e-apply-test")
        .await
        .unwrap();
    let name = e2e::cluster::unique_name("bad-label-policy");
    let policy: ClusterPolicy = serde_json::from_value(json!({
        "apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy",
        "metadata": {"name": name},
        "spec": {"daemonsets": {"labels": {"team/ml/gpu": "x"}}}
    }))
    .unwrap();
    let refused = policies(&admin)
        .create(&Default::default(), &policy)
        .await
        .expect_err("a policy with an invalid label key was accepted");
    let message = refused.to_string();
    assert!(
        message.contains("spec.daemonsets.labels") && message.contains("team/ml/gpu"),
        "{message}"
    );
}

#[tokio::test]
async fn a_fresh_install_reports_progress_without_blaming_taints_or_warning() {
    let Some(s) = session::start(json!({}), &[]).await else {
        return;
    };
    let api = policies(&s.admin);
    // Every Ready message the policy shows on its way to ready.
    let mut seen = Vec::new();
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let policy = api.get(&s.policy).await.unwrap();
        if let Some(message) = session::ready_condition(&policy).map(|c| c.message.clone())
            && seen.last() != Some(&message)
        {
            seen.push(message);
        }
        if ready_now(&policy) {
            break;
        }
        assert!(Instant::now() < deadline, "not ready: {seen:#?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Whole words only: the fleet's tainted nodes are named `gpu-tainted-*`, and a message may
    // name a node whose pod is still Pending.
    let blames_a_taint = |m: &str| {
        m.split(|c: char| !c.is_ascii_alphanumeric())
            .any(|word| matches!(word, "taint" | "taints" | "tolerate"))
    };
    assert!(
        !seen.iter().any(|m| blames_a_taint(m)),
        "a taint was blamed on the way to ready (the standard fleet's tainted nodes are tolerated): {seen:#?}"
    );
    let events = Api::<k8s_openapi::api::events::v1::Event>::all(s.admin.clone())
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(s.policy.as_str()))
        .map(|e| {
            (
                e.type_.unwrap_or_default(),
                e.reason.unwrap_or_default(),
                e.note.unwrap_or_default(),
            )
        })
        .collect::<Vec<_>>();
    assert!(
        events.iter().all(|(type_, _, _)| type_ == "Normal"),
        "warnings on a healthy install: {events:#?}"
    );
    eprintln!("on the way to ready: {seen:#?}\nevents: {events:#?}");

    // What `kubectl get clusterpolicy` shows beside the state.
    let policy = api.get(&s.policy).await.unwrap();
    let status = policy.status.as_ref().unwrap();
    let gpu_node_count = e2e::nodes::gpu_node_names(&s.admin).await.unwrap().len();
    assert_eq!(status.gpu_nodes, Some(gpu_node_count as i32));
    let operands = status.operands_ready.clone().unwrap_or_default();
    let (ready, enabled) = operands.split_once('/').unwrap();
    assert!(ready == enabled && ready != "0", "operands {operands}");

    // The metrics NVIDIA's dashboards and alerts read, under their names and meanings.
    let text = e2e::operator::scrape_metrics(s.operator.metrics_port)
        .await
        .unwrap();
    for name in gpu_operator::metrics::NVIDIA_METRICS {
        assert!(
            text.lines()
                .any(|l| l.split([' ', '{']).next() == Some(name)),
            "{name} is not exported:\n{text}"
        );
    }
    let value = |name| e2e::operator::metric(&text, name);
    assert_eq!(
        value("gpu_operator_reconciliation_status"),
        Some(1.0),
        "{text}"
    );
    let gpu_nodes = e2e::nodes::gpu_node_names(&s.admin).await.unwrap().len() as f64;
    assert_eq!(
        value("gpu_operator_gpu_nodes_total"),
        Some(gpu_nodes),
        "{text}"
    );
    assert_eq!(
        value("gpu_operator_reconciliation_has_nfd_labels"),
        Some(1.0),
        "{text}"
    );
    assert!(
        value("gpu_operator_reconciliation_last_success_ts_seconds") > Some(1.7e9),
        "{text}"
    );
    s.teardown().await;
}

#[tokio::test]
async fn an_operator_upgrade_that_renders_the_same_objects_rolls_nothing() {
    let Some(mut s) = session::start(json!({}), &[]).await else {
        return;
    };
    s.await_state(State::Ready, "policy ready").await;
    s.operator.terminate(Duration::from_secs(20)).unwrap();
    // What an operator version before the applied-hash annotation left behind: the same objects
    // without it.
    let daemonsets = s.daemonsets();
    let strip = json!({"metadata": {"annotations": {
        gpu_operator::controller::APPLIED_HASH_ANNOTATION: null}}});
    for ds in daemonsets.list(&ListParams::default()).await.unwrap() {
        daemonsets
            .patch(
                &ds.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&strip),
            )
            .await
            .unwrap();
    }
    let before = s.generations().await;
    let templates = |list: Vec<DaemonSet>| {
        list.into_iter()
            .map(|d| {
                (
                    d.name_any(),
                    serde_json::to_value(d.spec.unwrap().template).unwrap(),
                )
            })
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let templates_before = templates(daemonsets.list(&ListParams::default()).await.unwrap().items);

    s.operator = Operator::start(&s.identity, &[]).unwrap();
    wait::until(
        TIMEOUT,
        "every DaemonSet annotated by the new operator",
        || {
            let daemonsets = daemonsets.clone();
            async move {
                let missing: Vec<String> = daemonsets
                    .list(&ListParams::default())
                    .await?
                    .items
                    .into_iter()
                    .filter(|d| {
                        !d.annotations()
                            .contains_key(gpu_operator::controller::APPLIED_HASH_ANNOTATION)
                    })
                    .map(|d| d.name_any())
                    .collect();
                Ok(if missing.is_empty() {
                    Ok(())
                } else {
                    Err(format!("{missing:?}"))
                })
            }
        },
    )
    .await
    .unwrap();
    s.await_state(State::Ready, "ready after the upgrade").await;
    assert_eq!(
        s.generations().await,
        before,
        "a DaemonSet rolled on the upgrade"
    );
    assert_eq!(
        templates(daemonsets.list(&ListParams::default()).await.unwrap().items),
        templates_before,
        "a pod template changed on the upgrade"
    );
    s.teardown().await;
}
