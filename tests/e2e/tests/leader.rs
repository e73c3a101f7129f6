//! Leader election as it meets other operators and namespaces: NVIDIA's operator Lease
//! appearing after start-up holds our writes back, and `--lease-namespace` puts our Lease where
//! the leader-election Role is bound. Split from resilience.rs (a long suite: control-plane
//! faults) so that `make test` keeps running them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant, SystemTime};

use e2e::audit::{self, AuditLog};
use e2e::cluster::unique_name;
use e2e::operator::{Operator, OperatorIdentity};
use e2e::session::*;
use gpu_operator::api::State;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};
use serde_json::json;

/// NVIDIA's operator Lease, renewed `now`.
fn nvidia_lease(namespace: &str, seconds: i32) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some("53822513.nvidia.com".into()),
            namespace: Some(namespace.into()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some("gpu-operator-5d8f7c9b6-xk2lp_0c1e".into()),
            lease_duration_seconds: Some(seconds),
            renew_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
            acquire_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
            ..LeaseSpec::default()
        }),
    }
}

/// NVIDIA's operator starts after ours: within one lease period our writes stop although the
/// policy keeps changing, status says why, and when NVIDIA's Lease goes, ours resumes. Its
/// namespace is named with `--nvidia-operator-namespaces`, so the Lease is trusted as it is
/// (hostile_tenant.rs shows a Lease elsewhere is not).
#[tokio::test]
async fn nvidias_lease_appearing_after_start_up_stops_our_writes_within_a_lease_period() {
    // A Lease left by an earlier failed run would make ours stand aside from the start.
    let Some(admin) = e2e::connect().await else {
        return;
    };
    for lease in Api::<Lease>::all(admin.clone())
        .list(&kube::api::ListParams::default().fields("metadata.name=53822513.nvidia.com"))
        .await
        .unwrap()
        .items
    {
        let namespace = lease.metadata.namespace.clone().unwrap_or_default();
        Api::<Lease>::namespaced(admin.clone(), &namespace)
            .delete("53822513.nvidia.com", &DeleteParams::default())
            .await
            .unwrap();
    }
    let nvidia_ns = unique_name("nvidia-gpu-operator");
    let trusted = format!("--nvidia-operator-namespaces={nvidia_ns}");
    let Some(s) = start(json!({}), &[&trusted]).await else {
        return;
    };
    s.await_state(State::Ready, "policy ready").await;
    e2e::cluster::create_namespace(&s.admin, &nvidia_ns)
        .await
        .unwrap();
    let leases: Api<Lease> = Api::namespaced(s.admin.clone(), &nvidia_ns);
    let log = AuditLog::from_env().unwrap();
    let mark = log.mark().unwrap();
    // Renewed for a minute by "NVIDIA's operator" (a long duration: the test need not renew).
    leases
        .create(&PostParams::default(), &nvidia_lease(&nvidia_ns, 60))
        .await
        .unwrap();
    let appeared = SystemTime::now();
    let lease_period = Duration::from_secs(15);
    // Changes that would each make us write, for two lease periods.
    let started = Instant::now();
    let mut n = 200;
    while started.elapsed() < lease_period * 2 {
        n += 1;
        tick(&s, n).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let writes = log.mutating_since(mark, &s.identity.username()).unwrap();
    let writes = audit::writes_excluding_leases(&writes);
    let last = writes
        .iter()
        .map(|e| e.received())
        .max()
        .map(|t| t.duration_since(appeared).unwrap_or_default());
    eprintln!(
        "NVIDIA's Lease appeared: our last write {last:?} after it ({} writes in all: {:?})",
        writes.len(),
        writes.iter().map(ToString::to_string).collect::<Vec<_>>()
    );
    assert!(
        last.is_none_or(|l| l < lease_period),
        "we kept writing after NVIDIA's operator appeared: {:?}\n{}",
        writes.iter().map(ToString::to_string).collect::<Vec<_>>(),
        s.operator.log_text()
    );
    let message = ready_message(&s.admin, &s.policy).await.unwrap();
    assert!(
        message.contains("NVIDIA's GPU Operator is running"),
        "{message}"
    );
    assert_ne!(
        s.template_env("nvidia-dcgm-exporter", "E2E_TICK").await,
        Some(n.to_string())
    );

    // NVIDIA's operator goes: ours applies the latest change.
    leases
        .delete("53822513.nvidia.com", &DeleteParams::default())
        .await
        .unwrap();
    let resumed = await_converged(&s, n, "resumed after NVIDIA's Lease went").await;
    eprintln!(
        "after NVIDIA's Lease was deleted: the held-back change applied after {:?}, ready after {:?}",
        resumed.applied, resumed.ready
    );
    Api::<Namespace>::all(s.admin.clone())
        .delete(&nvidia_ns, &DeleteParams::default())
        .await
        .unwrap();
    s.teardown().await;
}

/// `--lease-namespace` (NVIDIA's `--leader-elect-namespace`): the leader Lease lives in that
/// namespace, created and renewed through the leader-election Role bound there alone (the
/// operator's Role in its own namespace grants no renewal of it), and the leader leads.
#[tokio::test]
async fn the_leader_lease_lives_in_the_lease_namespace_through_the_role_bound_there() {
    use gpu_operator::render::rbac::LEADER_LEASE;
    let Some(prepared) = builder().prepare().await else {
        return;
    };
    let admin = prepared.admin.clone();
    let identity = OperatorIdentity::with_generated_role(&admin).await.unwrap();
    let lease_namespace = unique_name("gpu-operator-leases");
    e2e::cluster::create_namespace(&admin, &lease_namespace)
        .await
        .unwrap();
    e2e::operator::apply_leader_election_role(&admin, &lease_namespace, &identity.namespace)
        .await
        .unwrap();
    let operator = Operator::start(&identity, &["--lease-namespace", &lease_namespace]).unwrap();
    let policy = unique_name("cluster-policy");
    create_policy(&admin, &policy, json!({})).await;
    let s = Setup {
        admin: admin.clone(),
        identity,
        operator,
        policy,
    };
    s.await_state(State::Ready, "policy ready with the Lease elsewhere")
        .await;
    let lease = Api::<Lease>::namespaced(admin.clone(), &lease_namespace)
        .get(LEADER_LEASE)
        .await
        .unwrap();
    assert!(
        lease
            .spec
            .and_then(|s| s.holder_identity)
            .is_some_and(|h| !h.is_empty()),
        "the Lease in {lease_namespace} has a holder"
    );
    assert!(
        Api::<Lease>::namespaced(admin.clone(), &s.identity.namespace)
            .get_opt(LEADER_LEASE)
            .await
            .unwrap()
            .is_none(),
        "no leader Lease in the operator namespace"
    );
    s.teardown().await;
    Api::<Namespace>::all(admin)
        .delete(&lease_namespace, &DeleteParams::default())
        .await
        .unwrap();
}
