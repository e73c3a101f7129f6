//! The operator's own ServiceMonitor from `spec.operator.metrics.serviceMonitor`, against the
//! Prometheus Operator's real ServiceMonitor CRD (tests/monitoring/crds.sh, at the version
//! tests/cluster/versions.env pins), so the API server validates what the operator renders:
//!
//! - created with the policy's scrape settings and labels, selecting the installer's metrics
//!   Service, and removed when the policy turns it off;
//! - an installer's ServiceMonitor of the same name (the chart's, the OLM bundle's) is never
//!   written: it keeps its resourceVersion, and the policy's status says what to change.
//!
//! The CRD is removed again at the end, whatever happens: the other suites expect a cluster
//! without the Prometheus Operator's API.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use e2e::crd::TemporaryCrd;
use e2e::session::{self, Setup};
use e2e::{tools, wait};
use gpu_operator::api::State;
use gpu_operator::operands::dcgm_exporter::service_monitor_api_resource;
use gpu_operator::operands::operator_metrics;
use kube::api::{Api, DynamicObject, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use std::time::Duration;

const CRD: &str = "servicemonitors.monitoring.coreos.com";
const TIMEOUT: Duration = Duration::from_secs(120);

/// The Prometheus Operator's ServiceMonitor CRD at the pinned version, removed when dropped;
/// `None` where it cannot be fetched (the test is skipped).
fn install_service_monitor_crd() -> Option<TemporaryCrd> {
    let dir = tools::checker("tests/monitoring/crds.sh")?;
    let file = dir.join("monitoring.coreos.com_servicemonitors.yaml");
    Some(TemporaryCrd::apply(&file, CRD).unwrap())
}

fn service_monitors(s: &Setup) -> Api<DynamicObject> {
    Api::namespaced_with(
        s.admin.clone(),
        &s.identity.namespace,
        &service_monitor_api_resource(),
    )
}

/// The operator's ServiceMonitor once `check` holds for it (`None`: absent).
async fn await_service_monitor(
    s: &Setup,
    what: &str,
    check: impl Fn(Option<&DynamicObject>) -> Result<(), String>,
) -> Option<DynamicObject> {
    let api = service_monitors(s);
    let check = &check;
    wait::until(TIMEOUT, what, || {
        let api = api.clone();
        async move {
            let found = api.get_opt(operator_metrics::NAME).await?;
            Ok(check(found.as_ref()).map(|()| found))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()))
}

/// The policy's Ready message once it contains `text`.
async fn await_ready_message(s: &Setup, text: &str) -> String {
    let (admin, policy) = (s.admin.clone(), s.policy.clone());
    wait::until(TIMEOUT, &format!("Ready message naming {text:?}"), || {
        let (admin, policy) = (admin.clone(), policy.clone());
        async move {
            let message = session::ready_message(&admin, &policy).await?;
            Ok(if message.contains(text) {
                Ok(message)
            } else {
                Err(message)
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()))
}

#[tokio::test]
async fn the_policy_service_monitor_is_created_tuned_and_removed_and_an_installers_one_is_left_alone()
 {
    let Some(prepared) = session::builder().prepare().await else {
        return;
    };
    let Some(_crd) = install_service_monitor_crd() else {
        return;
    };
    // NVIDIA's documented form: settings without `enabled`.
    let s = prepared
        .start(json!({"operator": {"metrics": {"serviceMonitor": {
            "interval": "15s",
            "honorLabels": true,
            "additionalLabels": {"release": "kube-prometheus-stack"},
        }}}}))
        .await;
    s.await_state(State::Ready, "policy ready").await;
    let sm = await_service_monitor(&s, "the operator's ServiceMonitor", |sm| {
        sm.map(|_| ()).ok_or_else(|| "absent".to_owned())
    })
    .await
    .unwrap();
    let labels = sm.labels();
    assert_eq!(labels["release"], "kube-prometheus-stack");
    assert_eq!(labels["app.kubernetes.io/managed-by"], "gpu-operator");
    let spec = &sm.data["spec"];
    assert_eq!(spec["selector"]["matchLabels"]["app"], "gpu-operator");
    let endpoint = &spec["endpoints"][0];
    assert_eq!(endpoint["port"], "gpu-operator-metrics");
    assert_eq!(endpoint["interval"], "15s");
    assert_eq!(endpoint["honorLabels"], true);
    // The harness's operators serve plain HTTP (e2e::operator::PLAIN_ENDPOINTS).
    assert_eq!(endpoint["scheme"], "http");

    // Turned off: removed.
    s.patch_policy(
        json!({"spec": {"operator": {"metrics": {"serviceMonitor": {"enabled": false}}}}}),
    )
    .await;
    await_service_monitor(&s, "the operator's ServiceMonitor removed", |sm| match sm {
        None => Ok(()),
        Some(_) => Err("still there".to_owned()),
    })
    .await;

    // The installer's ServiceMonitor of the same name, then the policy asks again.
    let installers = installers_service_monitor(&s.admin, &s.identity.namespace).await;
    s.patch_policy(json!({"spec": {"operator": {"metrics": {"serviceMonitor": {"enabled": true, "interval": "5s"}}}}}))
        .await;
    let message = await_ready_message(&s, "operator.metrics.serviceMonitor").await;
    assert!(
        message.contains("made by the operator's installer"),
        "{message}"
    );
    s.await_state(
        State::Ready,
        "policy ready beside the installer's ServiceMonitor",
    )
    .await;
    let after = service_monitors(&s)
        .get(operator_metrics::NAME)
        .await
        .unwrap();
    assert_eq!(
        after.resource_version(),
        installers.resource_version(),
        "the installer's ServiceMonitor was written"
    );
    assert_eq!(after.data["spec"]["endpoints"][0]["interval"], "30s");
    assert_eq!(after.labels()["app.kubernetes.io/managed-by"], "Helm");
    s.teardown().await;
}

/// A ServiceMonitor as the chart makes it (`operator.metrics.serviceMonitor.enabled`).
async fn installers_service_monitor(admin: &Client, namespace: &str) -> DynamicObject {
    let api: Api<DynamicObject> =
        Api::namespaced_with(admin.clone(), namespace, &service_monitor_api_resource());
    let mut sm = DynamicObject::new(operator_metrics::NAME, &service_monitor_api_resource());
    sm.metadata.labels = Some(
        [
            ("app", "gpu-operator"),
            ("app.kubernetes.io/managed-by", "Helm"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect(),
    );
    sm.data = json!({"spec": {
        "jobLabel": "app",
        "selector": {"matchLabels": {"app": "gpu-operator"}},
        "endpoints": [{"port": "gpu-operator-metrics", "path": "/metrics", "interval": "30s"}],
    }});
    api.create(&PostParams::default(), &sm).await.unwrap()
}
