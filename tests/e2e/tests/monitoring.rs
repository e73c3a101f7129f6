//! The chart's monitoring objects (docs/metrics.md): the alert rules pass Prometheus' own rule
//! parser and the Grafana dashboard Grafana's dashboard schema (both through monitoring-check,
//! built by tests/monitoring/build.sh), every metric they select exists (the operator's own
//! names, or the DCGM exporter's and kube-state-metrics' in tests/monitoring/known-metrics.txt),
//! and the ServiceMonitor and PrometheusRule are off by default and refused with a message by a
//! cluster that does not serve the Prometheus Operator's API.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use e2e::cluster::unique_name;
use e2e::tools::{self, repo_root};
use serde_json::Value;

const ALL_ON: [&str; 6] = [
    "--set",
    "operator.metrics.serviceMonitor.enabled=true",
    "--set",
    "operator.metrics.prometheusRule.enabled=true",
    "--set",
    "operator.metrics.grafanaDashboard.enabled=true",
];

fn helm(args: &[&str]) -> Output {
    Command::new("helm").args(args).output().unwrap_or_else(|e| {
        panic!("running helm: {e}; put the harness's bin folder on PATH (`source $HARNESS_DIR/env`)")
    })
}

/// `helm template` of the chart with `extra`, as documents.
fn template(extra: &[&str]) -> Vec<Value> {
    use serde::Deserialize as _;
    let chart = repo_root()
        .join("charts/gpu-operator")
        .display()
        .to_string();
    let mut args = vec![
        "template",
        "gpu-operator",
        &chart,
        "--namespace",
        "gpu-operator",
    ];
    args.extend_from_slice(extra);
    let out = helm(&args);
    assert!(
        out.status.success(),
        "helm {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

fn kinds(docs: &[Value]) -> Vec<String> {
    docs.iter()
        .map(|d| d["kind"].as_str().unwrap_or_default().to_owned())
        .collect()
}

fn find<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} rendered: {:?}", kinds(docs)))
}

/// A file of every metric name the rules and dashboard may select: the operator's own and the
/// facts in tests/monitoring/known-metrics.txt.
fn known_metrics(dir: &Path) -> PathBuf {
    let facts =
        std::fs::read_to_string(repo_root().join("tests/monitoring/known-metrics.txt")).unwrap();
    let mut text = gpu_operator::metrics::exported_names().join("\n");
    text.push('\n');
    text.push_str(&facts);
    let path = dir.join("known-metrics.txt");
    std::fs::write(&path, text).unwrap();
    path
}

struct Check {
    dir: PathBuf,
    binary: PathBuf,
    metrics: PathBuf,
}

impl Check {
    /// The checker and a scratch folder, or `None` where helm or the checker is missing here
    /// (the test is skipped).
    fn new() -> Option<Check> {
        tools::harness_tool("helm")?;
        let binary = tools::checker("tests/monitoring/build.sh")?;
        let dir = std::env::temp_dir().join(unique_name("monitoring"));
        std::fs::create_dir_all(&dir).unwrap();
        let metrics = known_metrics(&dir);
        Some(Check {
            binary,
            metrics,
            dir,
        })
    }

    /// Runs `monitoring-check -metrics ... <what> <file holding text>`; (passed, stderr).
    fn run(&self, what: &str, name: &str, text: &str) -> (bool, String) {
        let file = self.dir.join(name);
        std::fs::write(&file, text).unwrap();
        let out = Command::new(&self.binary)
            .arg("-metrics")
            .arg(&self.metrics)
            .arg(what)
            .arg(&file)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    fn passes(&self, what: &str, name: &str, text: &str) {
        let (ok, stderr) = self.run(what, name, text);
        assert!(ok, "monitoring-check {what} refused {name}:\n{stderr}");
    }

    fn fails_with(&self, what: &str, name: &str, text: &str, expected: &str) {
        let (ok, stderr) = self.run(what, name, text);
        assert!(!ok, "monitoring-check {what} accepted the broken {name}");
        assert!(
            stderr.contains(expected),
            "{name}: expected {expected:?} in:\n{stderr}"
        );
    }
}

impl Drop for Check {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// The rendered PrometheusRule's rule groups, as a Prometheus rules file.
fn rendered_rules() -> String {
    let docs = template(&ALL_ON);
    serde_yaml_ng::to_string(&find(&docs, "PrometheusRule")["spec"]).unwrap()
}

/// The dashboard JSON of the rendered ConfigMap.
fn rendered_dashboard() -> String {
    let docs = template(&ALL_ON);
    let config_map = find(&docs, "ConfigMap");
    assert_eq!(config_map["metadata"]["labels"]["grafana_dashboard"], "1");
    config_map["data"]["gpu-operator.json"]
        .as_str()
        .expect("no gpu-operator.json in the dashboard ConfigMap")
        .to_owned()
}

#[test]
fn the_alert_rules_parse_with_prometheus_and_select_only_known_metrics() {
    let Some(check) = Check::new() else {
        return;
    };
    let rules = rendered_rules();
    for alert in [
        "GPUOperatorPolicyNotReady",
        "GPUOperatorOperandsNotReady",
        "GPUOperatorReconcileFailing",
        "GPUOperatorDriverUpgradeFailed",
        "GPUOperatorNodesWithoutAllocatableGPUs",
    ] {
        assert!(rules.contains(alert), "{alert} missing:\n{rules}");
    }
    check.passes("rules", "rules.yaml", &rules);

    // The bundle carries the same rules.
    let bundle: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(
            repo_root().join(format!("bundle/{}", xtask::bundle::PROMETHEUS_RULE_FILE)),
        )
        .unwrap(),
    )
    .unwrap();
    check.passes(
        "rules",
        "bundle-rules.yaml",
        &serde_yaml_ng::to_string(&bundle["spec"]).unwrap(),
    );

    // What the check must refuse: a misspelt metric, PromQL Prometheus cannot parse, a field
    // the rule format does not have, and an annotation template that does not parse.
    check.fails_with(
        "rules",
        "typo.yaml",
        &rules.replace(
            "gpu_operator_nodes_upgrades_failed",
            "gpu_operator_node_upgrades_failed",
        ),
        "unknown metric gpu_operator_node_upgrades_failed",
    );
    check.fails_with(
        "rules",
        "promql.yaml",
        &rules.replace("by (namespace, reason)", "by (namespace, reason"),
        "parse error",
    );
    check.fails_with(
        "rules",
        "field.yaml",
        &rules.replace("for: 15m", "fore: 15m"),
        "fore",
    );
    check.fails_with(
        "rules",
        "template.yaml",
        &rules.replace("{{ $labels.reason }}", "{{ $labels.reason "),
        "annotation",
    );
}

#[test]
fn the_dashboard_loads_through_grafanas_schema_and_selects_only_known_metrics() {
    let Some(check) = Check::new() else {
        return;
    };
    let dashboard = rendered_dashboard();
    for metric in [
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_XID_ERRORS",
        "gpu_operator_reconciliation_status",
    ] {
        assert!(
            dashboard.contains(metric),
            "{metric} missing from the dashboard"
        );
    }
    check.passes("dashboard", "dashboard.json", &dashboard);

    let mut unknown_field: Value = serde_json::from_str(&dashboard).unwrap();
    unknown_field["panels"][1]["options"]["colourMode"] = "background".into();
    check.fails_with(
        "dashboard",
        "field.json",
        &unknown_field.to_string(),
        "unexpected field 'colourMode'",
    );
    let mut wrong_type: Value = serde_json::from_str(&dashboard).unwrap();
    wrong_type["panels"][1]["gridPos"]["w"] = "wide".into();
    check.fails_with("dashboard", "type.json", &wrong_type.to_string(), "gridPos");
    check.fails_with(
        "dashboard",
        "typo.json",
        &dashboard.replace("DCGM_FI_DEV_GPU_TEMP{", "DCGM_FI_DEV_GPU_TEMPERATURE{"),
        "unknown metric DCGM_FI_DEV_GPU_TEMPERATURE",
    );
}

#[test]
fn monitoring_objects_are_off_by_default_and_only_the_metrics_service_is_rendered() {
    if tools::harness_tool("helm").is_none() {
        return;
    }
    let docs = template(&["--show-only", "templates/metrics.yaml"]);
    let mut default_kinds = kinds(&docs);
    default_kinds.sort();
    assert_eq!(default_kinds, ["ClusterRole", "Service"]);
    let reader = find(&docs, "ClusterRole");
    assert_eq!(reader["metadata"]["name"], "gpu-operator-metrics-reader");
    assert_eq!(
        reader["rules"],
        serde_json::json!([{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}])
    );
    let service = find(&docs, "Service");
    assert_eq!(service["metadata"]["name"], "gpu-operator");
    assert_eq!(service["spec"]["ports"][0]["name"], "gpu-operator-metrics");
    assert_eq!(service["spec"]["ports"][0]["targetPort"], "metrics");

    let mut all: Vec<&str> = vec!["--show-only", "templates/metrics.yaml"];
    all.extend_from_slice(&ALL_ON);
    all.extend_from_slice(&[
        "--set",
        "operator.metrics.serviceMonitor.additionalLabels.release=prometheus",
    ]);
    let docs = template(&all);
    let mut rendered = kinds(&docs);
    rendered.sort();
    assert_eq!(
        rendered,
        [
            "ClusterRole",
            "ConfigMap",
            "PrometheusRule",
            "Service",
            "ServiceMonitor"
        ]
    );
    let monitor = find(&docs, "ServiceMonitor");
    assert_eq!(monitor["metadata"]["labels"]["release"], "prometheus");
    assert_eq!(
        monitor["spec"]["endpoints"][0]["port"],
        "gpu-operator-metrics"
    );
    assert_eq!(
        monitor["spec"]["selector"]["matchLabels"],
        service["spec"]["selector"]
    );
}

#[test]
fn a_cluster_without_the_prometheus_operator_refuses_the_service_monitor_with_a_message() {
    if e2e::cluster::test_cluster().is_none() || tools::harness_tool("helm").is_none() {
        return;
    }
    // The harness serves no monitoring.coreos.com: a server-side dry run asks it.
    let chart = repo_root()
        .join("charts/gpu-operator")
        .display()
        .to_string();
    let base = [
        "install",
        "monitoring-guard",
        &chart,
        "--namespace",
        "gpu-operator-monitoring-guard",
        "--dry-run=server",
        "--set",
        "operator.repository=registry.example.com/gpu-operator",
        // The harness may not serve the ClusterPolicy CRD yet (a dry run installs no crds/).
        "--set",
        "clusterPolicy.deployCR=false",
    ];
    let out = helm(&base);
    assert!(
        out.status.success(),
        "the default install must not need the Prometheus Operator:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut args = base.to_vec();
    args.extend_from_slice(&["--set", "operator.metrics.serviceMonitor.enabled=true"]);
    let out = helm(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the dry run accepted a ServiceMonitor"
    );
    assert!(
        stderr.contains("operator.metrics.serviceMonitor.enabled is true but this cluster does not serve monitoring.coreos.com/v1 ServiceMonitor"),
        "{stderr}"
    );
}

/// The operator container's argument `--<flag>=<value>`, if it has one.
fn container_arg<'a>(container: &'a Value, flag: &str) -> Option<&'a str> {
    container["args"]
        .as_array()?
        .iter()
        .filter_map(Value::as_str)
        .find_map(|a| a.strip_prefix(flag)?.strip_prefix('='))
}

/// What the ServiceMonitor scrapes, followed through the Service to the container: its port
/// is the one `--metrics-addr` binds, and its scheme and credentials are what `--metrics-secure`
/// serves (HTTPS and a bearer token, or plain HTTP). The probes use their own port.
fn assert_scrape_reaches_metrics(extra: &[&str]) {
    let mut args = ALL_ON.to_vec();
    args.extend_from_slice(extra);
    let docs = template(&args);
    let monitor = find(&docs, "ServiceMonitor");
    let endpoint = &monitor["spec"]["endpoints"][0];
    let service = docs
        .iter()
        .find(|d| d["kind"] == "Service" && d["metadata"]["name"] == "gpu-operator")
        .unwrap();
    let service_port = service["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == endpoint["port"])
        .unwrap_or_else(|| panic!("the Service has no port {}", endpoint["port"]));
    let deployment = find(&docs, "Deployment");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let container_port = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == service_port["targetPort"])
        .unwrap_or_else(|| panic!("no container port {}", service_port["targetPort"]));
    let metrics_addr = container_arg(container, "--metrics-addr").unwrap();
    assert_eq!(
        metrics_addr.rsplit(':').next().unwrap(),
        container_port["containerPort"].to_string(),
        "the ServiceMonitor's port is not where /metrics listens"
    );
    let secure = container_arg(container, "--metrics-secure").unwrap();
    match secure {
        "true" => {
            assert_eq!(endpoint["scheme"], "https", "{endpoint}");
            assert!(endpoint["bearerTokenFile"].is_string(), "{endpoint}");
            assert!(endpoint["tlsConfig"].is_object(), "{endpoint}");
        }
        "false" => {
            assert_eq!(endpoint["scheme"], "http", "{endpoint}");
            assert!(endpoint.get("bearerTokenFile").is_none(), "{endpoint}");
        }
        other => panic!("--metrics-secure={other}"),
    }
    for probe in ["livenessProbe", "readinessProbe"] {
        let port = &container[probe]["httpGet"]["port"];
        let probe_port = container["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == *port)
            .unwrap();
        let health_addr = container_arg(container, "--health-addr").unwrap();
        assert_eq!(
            health_addr.rsplit(':').next().unwrap(),
            probe_port["containerPort"].to_string(),
            "{probe}"
        );
        assert_ne!(probe_port["name"], "metrics", "{probe} on the metrics port");
    }
}

#[test]
fn the_service_monitor_scrapes_the_port_scheme_and_credentials_the_operator_serves() {
    if tools::harness_tool("helm").is_none() {
        return;
    }
    assert_scrape_reaches_metrics(&[]);
    assert_scrape_reaches_metrics(&["--set", "operator.metrics.secure=false"]);
    assert_scrape_reaches_metrics(&["--set", "operator.metricsPort=9443"]);
    // A mounted certificate: the ServiceMonitor carries the CA the user gives.
    let docs = template(&[
        "--set",
        "operator.metrics.serviceMonitor.enabled=true",
        "--set",
        "operator.metrics.certSecret=metrics-tls",
        "--set",
        "operator.metrics.serviceMonitor.tlsConfig.serverName=gpu-operator.gpu-operator.svc",
    ]);
    let endpoint = &find(&docs, "ServiceMonitor")["spec"]["endpoints"][0];
    assert_eq!(
        endpoint["tlsConfig"],
        serde_json::json!({"serverName": "gpu-operator.gpu-operator.svc"})
    );
    let container = &find(&docs, "Deployment")["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        container_arg(container, "--metrics-cert-path"),
        Some("/etc/gpu-operator/metrics-tls")
    );
}

#[test]
fn the_network_policy_is_off_by_default_and_admits_only_the_metrics_and_probe_ports() {
    if tools::harness_tool("helm").is_none() {
        return;
    }
    let docs = template(&[]);
    assert!(!kinds(&docs).iter().any(|k| k == "NetworkPolicy"));
    let docs = template(&[
        "--set",
        "operator.networkPolicy.enabled=true",
        "--set",
        "operator.networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.name=monitoring",
    ]);
    let policy = find(&docs, "NetworkPolicy");
    let ports: Vec<&Value> = policy["spec"]["ingress"]
        .as_array()
        .unwrap()
        .iter()
        .map(|rule| &rule["ports"][0]["port"])
        .collect();
    assert_eq!(ports, [8080, 8081]);
    assert_eq!(
        policy["spec"]["ingress"][0]["from"][0]["namespaceSelector"]["matchLabels"]["name"],
        "monitoring"
    );
    assert_eq!(
        policy["spec"]["podSelector"]["matchLabels"],
        find(&docs, "Deployment")["spec"]["selector"]["matchLabels"]
    );
}
