//! Render stage, the operator's own metrics (pure, no IO): the ServiceMonitor `gpu-operator`
//! that `spec.operator.metrics.serviceMonitor` asks for (NVIDIA's `state-operator-metrics`).
//!
//! The Service it selects is the installer's: the chart's and the OLM bundle's metrics Service
//! both carry `app: gpu-operator` and name their port `gpu-operator-metrics`, as NVIDIA's does.
//! The installer may also have made a ServiceMonitor of that name (Helm's
//! `operator.metrics.serviceMonitor`, the bundle's): that one is never written over
//! ([`ClusterFacts::foreign_operator_service_monitor`]), and status says which to change.

use kube_core::DynamicObject;
use serde_json::json;

use super::dcgm_exporter::{service_monitor_api_resource, service_monitor_meta, tuned_endpoint};
use crate::api::{ClusterPolicySpec, ServiceMonitorSpec};
use crate::facts::ClusterFacts;
use crate::model::{Operand, OperandObjects, ValidatedPolicy};

/// What the engine knows about this operand ([`super::Descriptor`]).
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "operator-metrics",
    component: None,
    deploy_label: None,
    consumes_sharing_config: false,
    enabled: super::Enabled::When(renders),
    images: super::defaults::no_images,
    host_paths: super::defaults::no_host_paths,
    render,
    check: super::defaults::no_check,
    report: super::defaults::no_report,
};

/// The ServiceMonitor's name, the `app` label of the installer's metrics Service, and the
/// job label's value (NVIDIA's).
pub const NAME: &str = "gpu-operator";
/// The metrics port's name on the installer's Service.
const PORT_NAME: &str = "gpu-operator-metrics";

/// The policy's ServiceMonitor settings when it asks for one: `enabled: true`, or settings
/// without `enabled` (NVIDIA's documented form, which creates it whatever `enabled` says).
/// `enabled: false` asks for none, where NVIDIA ignores it.
pub fn wanted(spec: &ClusterPolicySpec) -> Option<&ServiceMonitorSpec> {
    let settings = spec
        .operator
        .as_ref()?
        .metrics
        .as_ref()?
        .service_monitor
        .as_ref()?;
    let tuned = settings.interval.as_ref().is_some_and(|i| !i.is_empty())
        || settings
            .scrape_timeout
            .as_ref()
            .is_some_and(|t| !t.is_empty())
        || settings.honor_labels.is_some()
        || settings
            .additional_labels
            .as_ref()
            .is_some_and(|l| !l.is_empty())
        || settings.relabelings.as_ref().is_some_and(|r| !r.is_empty());
    match settings.enabled {
        Some(true) => Some(settings),
        None if tuned => Some(settings),
        _ => None,
    }
}

fn renders(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> bool {
    wanted(spec).is_some() && facts.service_monitor_api && !facts.foreign_operator_service_monitor
}

pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> Option<OperandObjects> {
    let settings = wanted(&policy.spec)?;
    if !renders(&policy.spec, facts) {
        return None;
    }
    let mut object = DynamicObject::new(NAME, &service_monitor_api_resource());
    object.metadata = service_monitor_meta(Operand::OperatorMetrics, NAME, settings, facts);
    let mut endpoint = json!({"port": PORT_NAME, "path": "/metrics"});
    if facts.operator_metrics_https {
        // The operator checks the caller's token (TokenReview, then `get` on /metrics by
        // SubjectAccessReview). Its certificate is self-signed unless the installer mounts one,
        // whose CA this object cannot know: a verified connection needs the installer's
        // ServiceMonitor with its tlsConfig (docs/metrics.md).
        endpoint["scheme"] = json!("https");
        endpoint["bearerTokenFile"] = json!("/var/run/secrets/kubernetes.io/serviceaccount/token");
        endpoint["tlsConfig"] = json!({"insecureSkipVerify": true});
    } else {
        endpoint["scheme"] = json!("http");
    }
    object.data = json!({
        "spec": {
            "jobLabel": "app",
            "namespaceSelector": {"matchNames": [facts.namespace]},
            "selector": {"matchLabels": {"app": NAME}},
            "endpoints": [tuned_endpoint(endpoint, settings)],
        }
    });
    Some(OperandObjects {
        dynamic: vec![object],
        ..OperandObjects::default()
    })
}

/// Validate's status note for an asked-for ServiceMonitor that is not rendered, naming what to
/// change. A note, not a problem: the operands are unaffected, so the policy can be ready.
pub fn note(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Option<String> {
    wanted(spec)?;
    if !facts.service_monitor_api {
        return Some(
            "spec.operator.metrics.serviceMonitor: no ServiceMonitor, this cluster does not serve \
             monitoring.coreos.com/v1 (the Prometheus Operator's CRDs); install them and restart \
             the operator, or remove the field"
                .to_owned(),
        );
    }
    facts.foreign_operator_service_monitor.then(|| {
        format!(
            "spec.operator.metrics.serviceMonitor: ServiceMonitor {NAME} in namespace {} was made \
             by the operator's installer (Helm's operator.metrics.serviceMonitor or the OLM \
             bundle) and is left as it is; change it there, or delete it to let the operator \
             make its own",
            facts.namespace
        )
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::render::tests::{facts, policy};

    fn with_api(https: bool) -> ClusterFacts {
        ClusterFacts {
            service_monitor_api: true,
            operator_metrics_https: https,
            ..facts()
        }
    }

    fn endpoint(objects: &OperandObjects) -> serde_json::Value {
        objects.dynamic[0].data["spec"]["endpoints"][0].clone()
    }

    #[test]
    fn enabled_or_tuned_settings_ask_for_the_service_monitor_and_enabled_false_does_not() {
        for (spec, asks) in [
            ("{}", false),
            ("{operator: {metrics: {serviceMonitor: {}}}}", false),
            (
                "{operator: {metrics: {serviceMonitor: {enabled: false, interval: 15s}}}}",
                false,
            ),
            (
                "{operator: {metrics: {serviceMonitor: {enabled: true}}}}",
                true,
            ),
            (
                "{operator: {metrics: {serviceMonitor: {interval: 15s}}}}",
                true,
            ),
        ] {
            assert_eq!(wanted(&policy(spec).spec).is_some(), asks, "{spec}");
        }
    }

    #[test]
    fn the_service_monitor_selects_the_installers_service_with_the_policys_scrape_settings() {
        let p = policy(
            "{operator: {metrics: {serviceMonitor: {enabled: true, interval: 15s, \
             scrapeTimeout: 10s, honorLabels: true, additionalLabels: {release: prom}}}}}",
        );
        let objects = render(&p, &with_api(true)).unwrap();
        let sm = &objects.dynamic[0];
        assert_eq!(sm.metadata.name.as_deref(), Some(NAME));
        let labels = sm.metadata.labels.clone().unwrap();
        assert_eq!(labels["release"], "prom");
        assert_eq!(labels["app.kubernetes.io/managed-by"], "gpu-operator");
        assert_eq!(sm.data["spec"]["selector"]["matchLabels"]["app"], NAME);
        let e = endpoint(&objects);
        assert_eq!(e["port"], PORT_NAME);
        assert_eq!(e["scheme"], "https");
        assert_eq!(e["interval"], "15s");
        assert_eq!(e["scrapeTimeout"], "10s");
        assert_eq!(e["honorLabels"], true);
        assert!(e["bearerTokenFile"].is_string());

        let plain = render(&p, &with_api(false)).unwrap();
        assert_eq!(endpoint(&plain)["scheme"], "http");
        assert!(endpoint(&plain).get("tlsConfig").is_none());
    }

    #[test]
    fn without_the_api_or_beside_the_installers_service_monitor_nothing_renders_and_status_says_why()
     {
        let p = policy("{operator: {metrics: {serviceMonitor: {enabled: true}}}}");
        assert!(render(&p, &facts()).is_none());
        assert!(
            note(&p.spec, &facts())
                .unwrap()
                .contains("monitoring.coreos.com/v1")
        );
        let beside = ClusterFacts {
            foreign_operator_service_monitor: true,
            ..with_api(true)
        };
        assert!(render(&p, &beside).is_none());
        assert!(!DESCRIPTOR.is_enabled(&p.spec, &beside));
        let why = note(&p.spec, &beside).unwrap();
        assert!(why.contains("operator.metrics.serviceMonitor"), "{why}");
        assert_eq!(note(&p.spec, &with_api(true)), None);
        assert_eq!(note(&policy("{}").spec, &facts()), None);
    }
}
