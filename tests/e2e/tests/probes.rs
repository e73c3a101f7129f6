//! The operator's endpoints (operator/src/http/, operator/src/health.rs): `/readyz` answers 503
//! until the caches are filled and the first reconcile pass has ended, then 200; a DCGM
//! exporter ServiceMonitor that the harness (no Prometheus Operator) cannot serve is a note in
//! the policy's status, not a failure; and `/metrics` answers, over HTTPS as the chart's
//! ServiceMonitor scrapes it, only a token allowed `get /metrics`, while the probes stay open.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use e2e::cluster::{service_account_token, unique_name};
use e2e::scrape::{self, Scheme};
use e2e::{session, tools, wait};
use gpu_operator::api::State;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};

/// The status code and body of GET `path` on the operator's probe port (plain HTTP, no
/// token, as the kubelet asks); `None` while nothing listens.
async fn get(port: u16, path: &str) -> Option<(u16, String)> {
    scrape::get(Scheme::Http, port, path, None).await
}

/// The operator's generated ClusterRole named `name`, without `list` and `watch` on Nodes when
/// `hold_caches`: start-up (discovery, CRD and Lease checks) works, but the node cache can never
/// fill. Nodes, because they are cluster-scoped: the operator's Role in its namespace (applied
/// beside this ClusterRole, as the chart does) cannot grant them back, as it does DaemonSets.
fn operator_role(name: &str, hold_caches: bool) -> ClusterRole {
    let mut role = e2e::operator::generated_role(name);
    if hold_caches {
        let rules = role.rules.get_or_insert_with(Vec::new);
        let mut held = Vec::new();
        for rule in rules.iter_mut() {
            let resources = rule.resources.get_or_insert_with(Vec::new);
            if resources.iter().any(|r| r == "nodes") {
                // The rule may name other kinds: only Nodes lose list and watch.
                resources.retain(|r| r != "nodes");
                let mut nodes = rule.clone();
                nodes.resources = Some(vec!["nodes".to_owned()]);
                nodes.verbs.retain(|v| v != "list" && v != "watch");
                held.push(nodes);
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
    let port = operator.health_port;

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
            "ready before its node cache could fill:\n{}",
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

/// The chart's metrics objects with the ServiceMonitor on, as documents.
fn rendered_metrics_objects() -> Vec<serde_json::Value> {
    use serde::Deserialize as _;
    let text = e2e::helm::helm_ok(&e2e::helm::strings(&[
        "template",
        "gpu-operator",
        &e2e::helm::chart(),
        "--namespace",
        "gpu-operator",
        "--show-only",
        "templates/metrics.yaml",
        "--set",
        "operator.metrics.serviceMonitor.enabled=true",
    ]));
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| serde_json::Value::deserialize(doc).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

fn rendered<'a>(docs: &'a [serde_json::Value], kind: &str) -> &'a serde_json::Value {
    docs.iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("the chart rendered no {kind}"))
}

/// The scrape job prometheus-operator generates for the ServiceMonitor endpoint `endpoint`
/// (`generateServiceMonitorConfig` and `addTLStoYaml` in its pkg/prometheus/promcfg.go), with
/// the target it would discover replaced by the static `target` and the token file Prometheus'
/// pod mounts by `token_file`. prometheus-operator writes `bearerTokenFile` as
/// `bearer_token_file`, which Prometheus' config loader turns into this `authorization`
/// (prometheus/common's HTTPClientConfig.Validate). Fields the chart does not render (Secret
/// references, OAuth2, proxies) are refused rather than dropped, so a new one is noticed here.
fn prometheus_scrape_job(endpoint: &Value, target: &str, token_file: &Path) -> Value {
    let known = [
        "port",
        "path",
        "scheme",
        "bearerTokenFile",
        "tlsConfig",
        "interval",
        "scrapeTimeout",
        "honorLabels",
    ];
    for key in endpoint.as_object().unwrap().keys() {
        assert!(
            known.contains(&key.as_str()),
            "the ServiceMonitor endpoint's {key} has no translation to a scrape job here: add one"
        );
    }
    let mut job = json!({
        "job_name": "serviceMonitor/gpu-operator/gpu-operator/0",
        "honor_labels": endpoint["honorLabels"].as_bool().unwrap_or(false),
        "static_configs": [{"targets": [target]}],
    });
    let copies = [
        ("path", "metrics_path"),
        ("scheme", "scheme"),
        ("interval", "scrape_interval"),
        ("scrapeTimeout", "scrape_timeout"),
    ];
    for (from, to) in copies {
        if let Some(value) = endpoint.get(from) {
            job[to] = value.clone();
        }
    }
    if let Some(tls) = endpoint.get("tlsConfig") {
        job["tls_config"] = prometheus_tls_config(tls);
    }
    if endpoint.get("bearerTokenFile").is_some() {
        job["authorization"] = json!({"type": "Bearer", "credentials_file": token_file});
    }
    json!({"scrape_configs": [job]})
}

/// A ServiceMonitor `tlsConfig` in Prometheus' `tls_config` names (prometheus-operator's
/// `addTLStoYaml`); its Secret and ConfigMap references become files in Prometheus' pod, which
/// a local scrape cannot have, so they are refused.
fn prometheus_tls_config(tls: &Value) -> Value {
    let names = [
        ("insecureSkipVerify", "insecure_skip_verify"),
        ("serverName", "server_name"),
        ("caFile", "ca_file"),
        ("certFile", "cert_file"),
        ("keyFile", "key_file"),
    ];
    let mut out = serde_json::Map::new();
    for (key, value) in tls.as_object().unwrap() {
        let (_, name) = names
            .iter()
            .find(|(from, _)| from == key)
            .unwrap_or_else(|| panic!("tlsConfig.{key} has no translation to tls_config here"));
        out.insert((*name).to_owned(), value.clone());
    }
    Value::Object(out)
}

/// Writes `token` and the scrape configuration for `endpoint` into `dir` and runs
/// `monitoring-check scrape` on it, expecting the operator's metric families; (passed, its
/// stdout and stderr).
fn prometheus_scrape(
    check: &Path,
    dir: &Path,
    endpoint: &Value,
    target: &str,
    who: &str,
    token: &str,
) -> (bool, String) {
    let token_file = dir.join(format!("{who}.token"));
    std::fs::write(&token_file, token).unwrap();
    let config = prometheus_scrape_job(endpoint, target, &token_file);
    let config_file = dir.join(format!("{who}-prometheus.yaml"));
    std::fs::write(&config_file, serde_yaml_ng::to_string(&config).unwrap()).unwrap();
    let mut expect = gpu_operator::metrics::NVIDIA_METRICS.to_vec();
    expect.push("gpu_operator_reconciles_total");
    let out = Command::new(check)
        .arg("-expect")
        .arg(expect.join(","))
        .arg("scrape")
        .arg(&config_file)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[tokio::test]
async fn metrics_answer_only_a_token_allowed_to_get_them_and_the_probes_stay_open() {
    if tools::harness_tool("helm").is_none() {
        return;
    }
    // The chart's defaults: secure metrics.
    let Some(prepared) = session::builder()
        .operator_args(&["--metrics-secure=true"])
        .prepare()
        .await
    else {
        return;
    };
    let (admin, identity, mut operator) = prepared.start_operator().await;
    let namespace = identity.namespace.clone();

    // How the chart's ServiceMonitor tells Prometheus to scrape: HTTPS, accepting the
    // self-signed certificate, with its ServiceAccount token.
    let docs = rendered_metrics_objects();
    let endpoint = &rendered(&docs, "ServiceMonitor")["spec"]["endpoints"][0];
    assert_eq!(endpoint["scheme"], "https", "{endpoint}");
    assert_eq!(
        endpoint["tlsConfig"]["insecureSkipVerify"], true,
        "{endpoint}"
    );
    assert_eq!(
        endpoint["bearerTokenFile"], "/var/run/secrets/kubernetes.io/serviceaccount/token",
        "{endpoint}"
    );
    let scheme = Scheme::HttpsSkipVerify;

    // The chart's metrics-reader ClusterRole (under a name of this test's), bound to one
    // scraper; another ServiceAccount has no binding.
    let mut reader: ClusterRole =
        serde_json::from_value(rendered(&docs, "ClusterRole").clone()).unwrap();
    let reader_name = unique_name("metrics-reader");
    reader.metadata = kube::api::ObjectMeta {
        name: Some(reader_name.clone()),
        ..Default::default()
    };
    let roles = Api::<ClusterRole>::all(admin.clone());
    roles.create(&PostParams::default(), &reader).await.unwrap();
    let accounts = Api::<ServiceAccount>::namespaced(admin.clone(), &namespace);
    for name in ["scraper", "stranger"] {
        let account: ServiceAccount =
            serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
        accounts
            .create(&PostParams::default(), &account)
            .await
            .unwrap();
    }
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": reader_name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": reader_name},
        "subjects": [{"kind": "ServiceAccount", "name": "scraper", "namespace": namespace}],
    }))
    .unwrap();
    let bindings = Api::<ClusterRoleBinding>::all(admin.clone());
    bindings
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let scraper = service_account_token(&admin, &namespace, "scraper")
        .await
        .unwrap();
    let stranger = service_account_token(&admin, &namespace, "stranger")
        .await
        .unwrap();

    let port = operator.metrics_port;
    wait::until(Duration::from_secs(30), "/metrics answers", || async {
        Ok(match scrape::get(scheme, port, "/metrics", None).await {
            Some(_) => Ok(()),
            None => Err("no answer".to_owned()),
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
    let code = |answer: Option<(u16, String)>| answer.map(|(code, _)| code);
    assert_eq!(
        code(scrape::get(scheme, port, "/metrics", None).await),
        Some(401),
        "no token"
    );
    assert_eq!(
        code(scrape::get(scheme, port, "/metrics", Some("not-a-token")).await),
        Some(401),
        "a token the API server does not know"
    );
    let (status, body) = scrape::get(scheme, port, "/metrics", Some(&stranger))
        .await
        .unwrap();
    assert_eq!(
        status, 403,
        "a token without the metrics-reader role: {body}"
    );
    assert!(body.contains("may not get /metrics"), "{body}");
    let (status, body) = scrape::get(scheme, port, "/metrics", Some(&scraper))
        .await
        .unwrap();
    assert_eq!(
        status,
        200,
        "{body}\noperator log:\n{}",
        operator.log_text()
    );
    assert!(body.contains("gpu_operator_reconciles_total"), "{body}");
    // Prometheus' own scrape code, configured as prometheus-operator configures it from the
    // chart's ServiceMonitor: the scraper's token is read, the stranger's refused.
    if let Some(check) = tools::checker("tests/monitoring/build.sh") {
        let dir = std::env::temp_dir().join(unique_name("prometheus-scrape"));
        std::fs::create_dir_all(&dir).unwrap();
        let target = format!("127.0.0.1:{port}");
        let (ok, out) = prometheus_scrape(&check, &dir, endpoint, &target, "scraper", &scraper);
        assert!(
            ok,
            "Prometheus could not scrape with the reader's token:\n{out}"
        );
        assert!(out.contains("HTTP 200"), "{out}");
        // Shown with --nocapture: the status, sample count and families Prometheus read.
        eprintln!("{out}");
        let (ok, out) = prometheus_scrape(&check, &dir, endpoint, &target, "stranger", &stranger);
        assert!(
            !ok,
            "Prometheus scraped with a token lacking the role:\n{out}"
        );
        assert!(out.contains("HTTP 403"), "{out}");
        std::fs::remove_dir_all(&dir).ok();
    }
    // Plain HTTP gets nothing from the TLS port.
    assert_ne!(
        code(scrape::get(Scheme::Http, port, "/metrics", None).await),
        Some(200)
    );
    // The probes: plain, no token, on their own port; not on the metrics one.
    assert_eq!(code(get(operator.health_port, "/healthz").await), Some(200));
    assert_eq!(
        code(scrape::get(scheme, port, "/healthz", Some(&scraper)).await),
        Some(404)
    );

    bindings
        .delete(&reader_name, &DeleteParams::default())
        .await
        .unwrap();
    roles
        .delete(&reader_name, &DeleteParams::default())
        .await
        .unwrap();
    operator.terminate(Duration::from_secs(20)).unwrap();
    identity.delete().await.unwrap();
}
