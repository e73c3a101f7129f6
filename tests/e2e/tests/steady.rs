//! Zero writes when steady (decision 9), on the standard fleet: once a policy with a sharing
//! config is ready and the operator has settled, node agents rewriting an unrelated label
//! (`nvidia.com/gfd.timestamp`), and no-op touches of the policy and of the user's ConfigMap,
//! must not make the operator write anything but its Lease. `make bench` measures the same at
//! scale (bench/README.md).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use e2e::audit::{self, AuditLog};
use e2e::nodes;
use e2e::session::{self, config_map, time_slicing};
use e2e::steady::{self, GFD_TIMESTAMP};
use gpu_operator::api::State;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

const CONFIG: &str = "steady-sharing-config";

#[tokio::test]
async fn a_steady_cluster_with_node_label_churn_gets_no_writes_but_the_lease() {
    let Some(s) = session::start(
        json!({"devicePlugin": {"config": {"name": CONFIG, "default": "any"}}}),
        &[],
    )
    .await
    else {
        return;
    };
    config_map(
        &s.admin,
        &s.identity.namespace,
        CONFIG,
        &[("any", &time_slicing(4))],
    )
    .await;
    s.await_state(State::Ready, "ready with sharing config")
        .await;

    // Settled: the passes that brought the policy to ready have finished writing. An operator
    // that writes every few seconds never gets here.
    let log = AuditLog::from_env().unwrap();
    let user = s.identity.username();
    steady::await_quiet(&log, &user, Duration::from_secs(3), Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));

    let from = log.mark().unwrap();
    let passes_before = s.operator.reconciles().await;
    let gpu_nodes = nodes::gpu_node_names(&s.admin).await.unwrap();
    assert!(!gpu_nodes.is_empty(), "the standard fleet has GPU nodes");
    // Node agents: three rounds of GFD timestamp rewrites on every GPU node.
    for _ in 0..3 {
        steady::rewrite_label_spread(&s.admin, &gpu_nodes, GFD_TIMESTAMP, Duration::from_secs(5))
            .await
            .unwrap();
    }
    // Events the operator does react to, with nothing to change: an annotation on the policy
    // (no new generation) and on the user's ConfigMap (same data). Each wakes a full pass.
    let touch = json!({"metadata": {"annotations": {"gpu-operator.test/touched": "1"}}});
    s.patch_policy(touch.clone()).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    Api::<ConfigMap>::namespaced(s.admin.clone(), &s.identity.namespace)
        .patch(CONFIG, &PatchParams::default(), &Patch::Merge(&touch))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;

    let passes = s.operator.reconciles().await - passes_before;
    let events = log.of_user_since(from, &user).unwrap();
    let writes = audit::described_writes(&events);
    assert!(
        writes.is_empty(),
        "steady writes: {writes:#?}\noperator log:\n{}",
        s.operator.log_text()
    );
    // The no-op touches did reach the operator: it ran passes that wrote nothing.
    assert!(
        passes >= 1.0,
        "no reconcile pass ran on the policy and ConfigMap touches\n{}",
        s.operator.log_text()
    );
    eprintln!(
        "steady: {} requests by the operator ({:?}), {passes} no-op passes, 0 writes",
        events.len(),
        audit::by_verb(&events)
    );
    s.teardown().await;
}
