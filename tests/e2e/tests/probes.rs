//! The operator's probes (operator/src/health.rs): `/readyz` answers 503 until the caches are
//! filled and the first reconcile pass has ended, then 200; and a DCGM exporter ServiceMonitor
//! that the harness (no Prometheus Operator) cannot serve is a note in the policy's status, not
//! a failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use e2e::cluster::unique_name;
use e2e::{session, wait};
use gpu_operator::api::State;
use k8s_openapi::api::rbac::v1::ClusterRole;
use kube::api::{Api, PostParams};
use serde_json::json;

/// The status code and body of GET `path` on the operator's endpoint port (HTTP/1.0, so no
/// client library is needed); `None` while nothing listens.
async fn get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await.ok()?;
    let code = text.split(' ').nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((code, body))
}

/// The operator's generated ClusterRole named `name`, without `list` and `watch` on
/// DaemonSets when `hold_caches`: start-up (discovery, CRD and Lease checks) works, but the
/// DaemonSet cache can never fill.
fn operator_role(name: &str, hold_caches: bool) -> ClusterRole {
    let mut role = e2e::operator::generated_role(name);
    if hold_caches {
        let rules = role.rules.get_or_insert_with(Vec::new);
        let mut held = Vec::new();
        for rule in rules.iter_mut() {
            let resources = rule.resources.get_or_insert_with(Vec::new);
            if resources.iter().any(|r| r == "daemonsets") {
                // The rule may name other kinds (Deployments, which start-up lists): only
                // DaemonSets lose list and watch.
                resources.retain(|r| r != "daemonsets");
                let mut daemonsets = rule.clone();
                daemonsets.resources = Some(vec!["daemonsets".to_owned()]);
                daemonsets.verbs.retain(|v| v != "list" && v != "watch");
                held.push(daemonsets);
            }
        }
        rules.retain(|r| r.resources.as_ref().is_none_or(|names| !names.is_empty()));
        rules.extend(held);
    }
    role
}

#[tokio::test]
async fn readyz_is_503_until_the_caches_fill_and_the_first_pass_ends_then_200() {
    // The harness serves no monitoring.coreos.com: the exporter's ServiceMonitor is skipped
    // and said so in status, and the policy still becomes ready.
    let role = unique_name("gpu-operator-readyz");
    let Some(setup) = session::builder()
        .cluster_role(operator_role(&role, true))
        .start(json!({"dcgmExporter": {"serviceMonitor": {"enabled": true}}}))
        .await
    else {
        return;
    };
    let roles = Api::<ClusterRole>::all(setup.admin.clone());
    let operator = &setup.operator;
    let port = operator.metrics_port;

    // Leader election is on (the chart's default): a standby is ready while it waits for the
    // Lease; the leader is not until its first pass. Caches not filled: not ready, alive, and
    // no pass has run.
    operator
        .await_log("became leader", Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
    wait::until(Duration::from_secs(30), "the endpoints answer", || async {
        Ok(match get(port, "/healthz").await {
            Some(_) => Ok(()),
            None => Err("not listening".to_owned()),
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
    let held_until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < held_until {
        assert_eq!(
            get(port, "/readyz").await.map(|(code, _)| code),
            Some(503),
            "ready before its DaemonSet cache could fill:\n{}",
            operator.log_text()
        );
        assert_eq!(get(port, "/healthz").await.map(|(code, _)| code), Some(200));
        assert_eq!(operator.reconciles().await, 0.0);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Grant the rest: the caches fill, the first pass runs, and only then is it ready.
    let mut full = operator_role(&role, false);
    full.metadata.resource_version = roles.get(&role).await.unwrap().metadata.resource_version;
    roles
        .replace(&role, &PostParams::default(), &full)
        .await
        .unwrap();
    wait::until(Duration::from_secs(90), "/readyz 200", || async {
        Ok(match get(port, "/readyz").await {
            Some((200, _)) => Ok(()),
            other => Err(format!("{other:?}")),
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
    assert!(
        operator.reconciles().await >= 1.0,
        "ready before a pass ended"
    );

    let ready = setup
        .await_state(State::Ready, "policy ready without a ServiceMonitor API")
        .await;
    let message = session::ready_condition(&ready)
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(
        message.contains("no ServiceMonitor for the DCGM exporter")
            && message.contains("monitoring.coreos.com/v1"),
        "{message}"
    );
    setup.teardown().await;
}
