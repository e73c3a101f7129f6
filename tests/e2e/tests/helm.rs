//! The Helm chart (`charts/gpu-operator`) checked by the real helm against the harness:
//! lint and template for the default values, the per-component flags NVIDIA's documentation
//! installs with and the time-slicing values file; misspelt values rejected with a message that names them; the chart's generated copies
//! (CRD, operator ClusterRole) equal to what the operator prints; `helm install --wait`, the
//! operator running with nothing but the chart's ServiceAccount, `helm upgrade` rolling the
//! sharing-config consumers and `helm uninstall` leaving no operand behind; and a CRD change
//! reaching the cluster on `helm upgrade` through the operator (Helm never upgrades `crds/`).
//! `helm template` and `helm lint` with no flags and no cluster; the operator image by tag or
//! digest, the same reference as the OLM bundle's; an install with no image failing before it
//! creates anything, with the value to set.
//!
//! Tests that touch the cluster run one at a time (`--test-threads=1`, as tests/e2e.sh runs
//! them): the ClusterPolicy and the CRD are cluster-wide. Each removes what an earlier failed run
//! left and cleans up after itself.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::process::Command;
use std::time::{Duration, Instant};

use e2e::audit::AuditLog;
use e2e::cluster::unique_name;
use e2e::helm::{
    RELEASE, chart, helm, helm_ok, helm_release, operator_image_args, operator_repository,
    release_namespace, strings,
};
use e2e::operator::{Access, Operator, OperatorIdentity};
use e2e::tools::{self, repo_root};
use e2e::{nodes, session, wait};
use futures::FutureExt;
use gpu_operator::api::image::ImageKind;
use gpu_operator::api::{
    ClusterPolicy, ClusterPolicySpec, GPU_CLUSTER_NAME, GPUCluster, GpuClusterState, SandboxMode,
    State,
};
use gpu_operator::crd_upgrade::{CRD_VERSION_ANNOTATION, OPERATOR_VERSION};
use gpu_operator::model::config_hash;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, Service, ServiceAccount};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, ObjectMeta,
    PostParams,
};
use kube::runtime::wait::conditions;
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

/// The ClusterPolicy the chart creates (NVIDIA's name, which users' `kubectl patch` names).
const POLICY: &str = "cluster-policy";
/// The ServiceAccount, ClusterRole and binding the chart creates.
const OPERATOR_ACCOUNT: &str = "gpu-operator";
use e2e::crd::CLUSTER_POLICY_CRD as CRD_NAME;
const MANAGED_BY_OPERATOR: &str = "app.kubernetes.io/managed-by=gpu-operator";
const TIMEOUT: Duration = Duration::from_secs(120);

/// The per-component flags NVIDIA's documentation installs with, as it writes them.
const DOCUMENTED_FLAGS: [&str; 10] = [
    "--set",
    "driver.enabled=true",
    "--set",
    "toolkit.enabled=true",
    "--set",
    "devicePlugin.enabled=true",
    "--set",
    "dcgmExporter.enabled=true",
    "--set",
    "migManager.enabled=true",
];

/// The chart's time-slicing values file (a sharing config, NFD workers on GPU nodes), as `-f`.
fn time_slicing_values() -> Vec<String> {
    let file = repo_root().join("charts/gpu-operator/ci/time-slicing-values.yaml");
    vec!["-f".into(), file.display().to_string()]
}

/// `helm template` as users type it: Helm's offline defaults (no --kube-version), which the
/// chart renders with.
fn template_args(extra: &[String]) -> Vec<String> {
    let mut args = strings(&["template", RELEASE]);
    args.push(chart());
    args.extend(strings(&["--namespace", "gpu-operator"]));
    args.extend(extra.iter().cloned());
    args
}

/// The operator image the committed bundle's CSV names in `containerImage`.
fn csv_container_image() -> String {
    let path = repo_root().join("bundle/manifests/gpu-operator.clusterserviceversion.yaml");
    let csv: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    csv["metadata"]["annotations"]["containerImage"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// The objects `helm template` renders, as JSON.
fn template(extra: &[String]) -> Vec<Value> {
    use serde::Deserialize as _;
    let text = helm_ok(&template_args(extra));
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> Option<&'a Value> {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
}

fn policy_spec(docs: &[Value]) -> Value {
    find(docs, "ClusterPolicy", POLICY).expect("no ClusterPolicy cluster-policy rendered")["spec"]
        .clone()
}

/// The chart sets no key the API types do not know: the spec reads back unchanged through them.
fn assert_spec_uses_only_api_fields(case: &str, spec: &Value) {
    let typed: ClusterPolicySpec = serde_json::from_value(spec.clone())
        .unwrap_or_else(|e| panic!("{case}: the rendered spec is not a ClusterPolicy spec: {e}"));
    let back = serde_json::to_value(&typed).unwrap();
    assert_eq!(
        &back, spec,
        "{case}: the rendered spec has keys the API does not know"
    );
}

#[test]
fn chart_lints_and_renders_the_policy_for_default_values_documented_flags_and_time_slicing() {
    if tools::harness_tool("helm").is_none() {
        return;
    }
    let cases: [(&str, Vec<String>); 3] = [
        ("default values", Vec::new()),
        ("documented flags", strings(&DOCUMENTED_FLAGS)),
        ("time-slicing values", time_slicing_values()),
    ];
    for (case, args) in &cases {
        let mut lint = strings(&["lint", "--strict"]);
        lint.push(chart());
        lint.extend(args.iter().cloned());
        helm_ok(&lint);

        let docs = template(args);
        let spec = policy_spec(&docs);
        assert_spec_uses_only_api_fields(case, &spec);
        for operand in [
            "driver",
            "toolkit",
            "devicePlugin",
            "dcgmExporter",
            "gfd",
            "migManager",
        ] {
            assert_eq!(spec[operand]["enabled"], true, "{case}: {operand}: {spec}");
        }
        assert_eq!(spec["dcgm"]["enabled"], false, "{case}");
        assert_eq!(spec["nodeStatusExporter"]["enabled"], false, "{case}");
        assert_eq!(spec["nfd"]["enabled"], true, "{case}");
        assert_eq!(spec["mig"]["strategy"], "single", "{case}");
        assert_eq!(spec["operator"]["runtimeClass"], "nvidia", "{case}");
        assert_eq!(
            spec["daemonsets"]["tolerations"],
            json!([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]),
            "{case}"
        );
        // The images are those the operator pins, so the chart and `gpu-operator render` agree.
        for (path, kind) in [
            ("/driver", ImageKind::Driver),
            ("/driver/manager", ImageKind::DriverManager),
            ("/toolkit", ImageKind::Toolkit),
            ("/devicePlugin", ImageKind::DevicePlugin),
            ("/gfd", ImageKind::Gfd),
            ("/dcgm", ImageKind::Dcgm),
            ("/dcgmExporter", ImageKind::DcgmExporter),
            ("/migManager", ImageKind::MigManager),
            ("/nodeStatusExporter", ImageKind::NodeStatusExporter),
            ("/validator", ImageKind::Validator),
        ] {
            let section = spec.pointer(path).unwrap();
            let image = format!(
                "{}/{}:{}",
                section["repository"].as_str().unwrap(),
                section["image"].as_str().unwrap(),
                section["version"].as_str().unwrap()
            );
            assert_eq!(
                Some(image.as_str()),
                kind.pinned(),
                "{case}: spec{path} image differs from the operator's pin (update charts/gpu-operator/values.yaml)"
            );
        }

        // The operator's Deployment: namespace from the downward API, probes, leader election,
        // CRD upgrade on, the chart's ServiceAccount.
        let deployment = find(&docs, "Deployment", "gpu-operator").expect("no Deployment");
        let pod = &deployment["spec"]["template"]["spec"];
        assert_eq!(pod["serviceAccountName"], OPERATOR_ACCOUNT, "{case}");
        let container = &pod["containers"][0];
        let env = container["env"].as_array().unwrap();
        let env_field = |name: &str| {
            env.iter()
                .find(|e| e["name"] == name)
                .map(|e| e["valueFrom"]["fieldRef"]["fieldPath"].clone())
        };
        assert_eq!(
            env_field("OPERATOR_NAMESPACE"),
            Some(json!("metadata.namespace")),
            "{case}"
        );
        assert_eq!(
            env_field("POD_NAME"),
            Some(json!("metadata.name")),
            "{case}"
        );
        let args: Vec<&str> = container["args"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        for arg in ["run", "--leader-elect=true", "--upgrade-crd=true"] {
            assert!(args.contains(&arg), "{case}: {arg} missing from {args:?}");
        }
        assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
        assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
        assert!(container["resources"]["limits"]["memory"].is_string());
        let binding = find(&docs, "ClusterRoleBinding", "gpu-operator").expect("no binding");
        assert_eq!(binding["subjects"][0]["namespace"], "gpu-operator");
        assert!(find(&docs, "ClusterRole", "gpu-operator").is_some());
        let role = find(&docs, "Role", "gpu-operator").expect("no Role");
        assert_eq!(role["metadata"]["namespace"], "gpu-operator");
        let binding = find(&docs, "RoleBinding", "gpu-operator").expect("no RoleBinding");
        assert_eq!(binding["metadata"]["namespace"], "gpu-operator");
        assert_eq!(binding["roleRef"]["kind"], "Role");
        assert_eq!(binding["subjects"][0]["namespace"], "gpu-operator");

        let sharing_config = find(&docs, "ConfigMap", "device-plugin-config");
        if *case == "time-slicing values" {
            assert_eq!(
                spec["devicePlugin"]["config"],
                json!({"name": "device-plugin-config", "default": "default"})
            );
            let config =
                sharing_config.expect("time-slicing values: no ConfigMap device-plugin-config");
            assert_eq!(config["metadata"]["namespace"], "gpu-operator");
            let default = config["data"]["default"].as_str().unwrap();
            assert!(default.contains("replicas: 4"), "{default}");
            // NFD's workers stay on every node: a worker is what finds a node's GPU, so no
            // affinity may wait for a label only a worker writes (tests/e2e/tests/shipped.rs).
            assert!(
                spec["nfd"]["worker"].get("affinity").is_none(),
                "time-slicing values pin NFD's workers: {}",
                spec["nfd"]["worker"]
            );
        } else {
            assert!(spec["devicePlugin"].get("config").is_none(), "{case}");
            assert!(sharing_config.is_none(), "{case}");
        }
    }
}

/// The operator pod's fixed UID, rendered except where OpenShift's restricted SCCs would reject
/// it: `platform.openshift=true`, or a cluster serving the SCC API.
#[test]
fn the_operator_pod_runs_as_a_fixed_uid_except_on_openshift() {
    if tools::harness_tool("helm").is_none() {
        return;
    }
    let uid = |extra: &[&str]| {
        let docs = template(&strings(extra));
        let deployment = find(&docs, "Deployment", "gpu-operator").expect("no Deployment");
        let pod = &deployment["spec"]["template"]["spec"]["securityContext"];
        assert_eq!(pod["runAsNonRoot"], true, "{extra:?}");
        pod["runAsUser"].clone()
    };
    assert_eq!(uid(&[]), json!(65532));
    assert_eq!(uid(&["--set", "platform.openshift=true"]), Value::Null);
    assert_eq!(
        uid(&["--api-versions", "security.openshift.io/v1"]),
        Value::Null
    );
}

/// NVIDIA's v26.7.0 default values as key paths and values (facts, from
/// `scripts/values-paths.py`).
const NVIDIA_VALUES: &str = "operator/tests/fixtures/nvidia-v26.7-values-paths.txt";

/// Splits a key path of [`NVIDIA_VALUES`] into its keys (`a."b.c".d` is `a`, `b.c`, `d`).
fn value_path_keys(path: &str) -> Vec<String> {
    let mut keys = Vec::new();
    let mut key = String::new();
    let mut chars = path.chars().peekable();
    let mut quoted = false;
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', false) if key.is_empty() => quoted = true,
            ('"', true) if chars.peek() == Some(&'"') => {
                chars.next();
                key.push('"');
            }
            ('"', true) => quoted = false,
            ('.', false) => keys.push(std::mem::take(&mut key)),
            (c, _) => key.push(c),
        }
    }
    keys.push(key);
    keys
}

/// The values file that [`NVIDIA_VALUES`] lists, rebuilt, and how many key paths it has.
fn nvidia_values() -> (Value, usize) {
    let path = repo_root().join(NVIDIA_VALUES);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut values = json!({});
    let mut count = 0;
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (path, value) = line
            .split_once('\t')
            .unwrap_or_else(|| panic!("{NVIDIA_VALUES}: no tab in {line:?}"));
        let value: Value = serde_json::from_str(value)
            .unwrap_or_else(|e| panic!("{NVIDIA_VALUES}: {line:?}: {e}"));
        let keys = value_path_keys(path);
        let (last, parents) = keys.split_last().unwrap();
        let mut node = &mut values;
        for key in parents {
            node = node
                .as_object_mut()
                .unwrap_or_else(|| panic!("{NVIDIA_VALUES}: {path} is below a value"))
                .entry(key.clone())
                .or_insert_with(|| json!({}));
        }
        node[last.as_str()] = value;
        count += 1;
    }
    (values, count)
}

#[test]
fn value_paths_split_at_dots_outside_quotes() {
    assert_eq!(value_path_keys("a.b"), ["a", "b"]);
    assert_eq!(
        value_path_keys(r#"operator.annotations."openshift.io/scc""#),
        ["operator", "annotations", "openshift.io/scc"]
    );
    assert_eq!(
        value_path_keys(r#"x."say ""hi"".now""#),
        ["x", r#"say "hi".now"#]
    );
}

#[test]
fn every_key_of_nvidias_v26_7_default_values_passes_the_schema_and_reaches_the_policy() {
    if tools::harness_tool("helm").is_none() {
        return;
    }
    let (values, count) = nvidia_values();
    assert!(
        count > 250,
        "{NVIDIA_VALUES} looks truncated: {count} key paths"
    );
    let file = write_values_file(&values);
    let out = helm(&template_args(&strings(&["-f", &file])));
    assert!(
        out.status.success(),
        "helm template -f <NVIDIA's v26.7 default values> failed (each line names a key the \
         chart's values.schema.json refuses):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Keys that map onto the ClusterPolicy reach it.
    let docs = template(&strings(&["-f", &file]));
    std::fs::remove_file(&file).ok();
    let spec = &find(&docs, "ClusterPolicy", POLICY).expect("no ClusterPolicy")["spec"];
    assert_eq!(spec["sandboxWorkloads"]["mode"], "kubevirt");
    assert_eq!(
        spec["dcgmExporter"]["serviceMonitor"]["scrapeTimeout"],
        "10s"
    );
    assert_eq!(
        spec["kataSandboxDevicePlugin"]["image"],
        values["kataSandboxDevicePlugin"]["image"]
    );
    let policy: ClusterPolicySpec = serde_json::from_value(spec.clone())
        .unwrap_or_else(|e| panic!("the rendered spec is not a ClusterPolicy spec: {e}"));
    assert_eq!(
        policy.sandbox_workloads.and_then(|s| s.mode),
        Some(SandboxMode::Kubevirt)
    );
}

/// The sandbox sections of the chart's values: NVIDIA's keys and defaults, passed to the policy.
const SANDBOX_SECTIONS: [&str; 8] = [
    "sandboxWorkloads",
    "vgpuManager",
    "vgpuDeviceManager",
    "vfioManager",
    "kataManager",
    "sandboxDevicePlugin",
    "kataSandboxDevicePlugin",
    "ccManager",
];

#[test]
fn the_sandbox_values_are_nvidias_defaults_and_deploy_nothing_while_sandbox_workloads_are_off() {
    if tools::harness_tool("helm").is_none() {
        return;
    }
    let (nvidia, _) = nvidia_values();
    let spec = policy_spec(&template(&[]));
    for section in SANDBOX_SECTIONS {
        assert_eq!(
            spec[section], nvidia[section],
            "spec.{section} differs from NVIDIA's v26.7 default values \
             (charts/gpu-operator/values.yaml)"
        );
    }
    assert_eq!(spec["sandboxWorkloads"]["enabled"], false);

    // Sandbox workloads off: the operands render exactly as without the sections.
    let mut bare = spec.clone();
    for section in SANDBOX_SECTIONS {
        bare.as_object_mut().unwrap().remove(section);
    }
    let facts = gpu_operator::facts::ClusterFacts {
        namespace: "gpu-operator".to_owned(),
        os_tag: Some("ubuntu22.04".to_owned()),
        ..Default::default()
    };
    let objects = |spec: &Value| {
        let spec: ClusterPolicySpec = serde_json::from_value(spec.clone()).unwrap();
        let policy = gpu_operator::validate::validate(
            &ClusterPolicy::new("cluster-policy", spec.clone()),
            &facts,
        );
        let rendered = gpu_operator::render::render(&policy, &facts);
        let json: Vec<Vec<Value>> = rendered
            .operands
            .into_iter()
            .filter_map(|o| match o.outcome {
                gpu_operator::render::Outcome::Rendered(objects) => {
                    Some(objects.to_json().unwrap())
                }
                _ => None,
            })
            .collect();
        (json, spec.unsupported_fields())
    };
    assert!(
        objects(&spec) == objects(&bare),
        "the default sandbox values change what a default install renders or reports"
    );
}

/// Writes `values` to a file of its own and returns its path. JSON, not YAML: helm reads YAML
/// 1.1, where a plain `on` (ccManager.defaultMode) would become a boolean.
fn write_values_file(values: &Value) -> String {
    let file = std::env::temp_dir().join(format!("{}.json", unique_name("values")));
    std::fs::write(&file, serde_json::to_string_pretty(values).unwrap()).unwrap();
    file.display().to_string()
}

#[test]
fn chart_values_map_new_v26_7_keys_onto_the_policy() {
    if tools::harness_tool("helm").is_none() {
        return;
    }
    let docs = template(&strings(&[
        "--set",
        "toolkit.hostNetwork=true",
        "--set",
        "gfd.hostNetwork=true",
        "--set",
        "validator.hostNetwork=true",
        "--set",
        "dcgmExporter.enablePodUID=true",
        "--set",
        "dcgmExporter.podLabelAllowlistRegex={^app$}",
        "--set",
        "operator.env[0].name=HTTPS_PROXY",
        "--set",
        "operator.env[0].value=http://proxy:3128",
    ]));
    let spec = &find(&docs, "ClusterPolicy", POLICY).expect("no ClusterPolicy")["spec"];
    for section in ["toolkit", "gfd", "validator"] {
        assert_eq!(spec[section]["hostNetwork"], true, "{section}");
    }
    assert_eq!(spec["devicePlugin"].get("hostNetwork"), None);
    assert_eq!(spec["dcgmExporter"]["enablePodUID"], true);
    assert_eq!(
        spec["dcgmExporter"]["podLabelAllowlistRegex"],
        json!(["^app$"])
    );
    let deployment = find(&docs, "Deployment", "gpu-operator").expect("no Deployment");
    let env = &deployment["spec"]["template"]["spec"]["containers"][0]["env"];
    assert!(
        env.as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "HTTPS_PROXY" && e["value"] == "http://proxy:3128"),
        "{env}"
    );

    let without = template(&strings(&["--set", "clusterPolicy.deployCR=false"]));
    assert!(find(&without, "ClusterPolicy", POLICY).is_none());
    assert!(find(&without, "Deployment", "gpu-operator").is_some());

    // gpuCluster.deployCR=true, clusterPolicy.deployCR=false: the DRA stack's GPUCluster only.
    let dra = template(&strings(&[
        "--set",
        "gpuCluster.deployCR=true",
        "--set",
        "clusterPolicy.deployCR=false",
        "--set",
        "draDriver.computeDomains.enabled=false",
    ]));
    assert!(find(&dra, "ClusterPolicy", POLICY).is_none());
    let cluster = find(&dra, "GPUCluster", "gpu-cluster").expect("no GPUCluster");
    assert_eq!(
        cluster["spec"]["draDriver"]["image"],
        json!("dra-driver-nvidia-gpu")
    );
    assert_eq!(
        cluster["spec"]["draDriver"]["computeDomains"]["enabled"],
        json!(false)
    );
    assert!(find(&without, "GPUCluster", "gpu-cluster").is_none());
}

#[test]
fn misspelt_and_unsupported_values_fail_with_a_message_naming_the_value() {
    if tools::harness_tool("helm").is_none() {
        return;
    }
    let cases: [(&[&str], &[&str]); 10] = [
        (
            &["--set", "devicePlugin.enable=true"],
            &["/devicePlugin", "'enable' not allowed"],
        ),
        // The ClusterPolicy takes env values and args as strings only: the schema refuses what
        // the CRD would (`--set-string` or quotes pass).
        (
            &[
                "--set",
                "toolkit.env[0].name=CONTAINERD_SET_AS_DEFAULT",
                "--set",
                "toolkit.env[0].value=true",
            ],
            &["/toolkit/env/0/value", "got boolean, want string"],
        ),
        (
            &["--set", "driver.args[0]=1"],
            &["/driver/args/0", "want string"],
        ),
        (
            &["--set", "dcgmExporter.serviceMonitor.enable=true"],
            &["/dcgmExporter/serviceMonitor", "'enable' not allowed"],
        ),
        (
            &["--set", "node-feature-discovery.worker.tolerance=x"],
            &["/node-feature-discovery/worker", "'tolerance' not allowed"],
        ),
        (
            &["--set", "mig.strategy=mixd"],
            &["/mig/strategy", "'mixed'"],
        ),
        (
            &["--set", "devicePlugin.config.create=true"],
            &["devicePlugin.config.name is empty"],
        ),
        (
            &[
                "--set",
                "devicePlugin.config.create=true",
                "--set",
                "devicePlugin.config.name=sharing",
                "--set",
                "devicePlugin.config.default=b",
                "--set-string",
                "devicePlugin.config.data.a=version: v1",
            ],
            &["devicePlugin.config.default is \"b\"", "(keys: a)"],
        ),
        (
            &["--set", "operator.cleanupCRD=true"],
            &["operator.cleanupCRD", "not supported"],
        ),
        (
            &[
                "--set",
                "node-feature-discovery.image.repository=example.com/nfd",
            ],
            &["node-feature-discovery.image.tag"],
        ),
    ];
    // Quoted, the same values pass.
    let quoted = helm(&template_args(&strings(&[
        "--set",
        "toolkit.env[0].name=CONTAINERD_SET_AS_DEFAULT",
        "--set-string",
        "toolkit.env[0].value=true",
        "--set-string",
        "driver.args[0]=1",
    ])));
    assert!(
        quoted.status.success(),
        "{}",
        String::from_utf8_lossy(&quoted.stderr)
    );
    for (args, expected) in cases {
        let out = helm(&template_args(&strings(args)));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "helm template {args:?} succeeded, expected a failure"
        );
        for text in expected {
            assert!(
                stderr.contains(text),
                "helm template {args:?}: {text:?} not in:\n{stderr}"
            );
        }
    }
}

/// `helm template` and `helm lint` as users type them, with no flags at all and no cluster to
/// ask: the chart carries no kubeVersion (Helm checks it against v1.20 offline) and its
/// install-time checks stay quiet offline.
#[test]
fn helm_template_and_lint_work_with_no_flags_and_no_cluster() {
    if tools::harness_tool("helm").is_none() {
        return;
    }
    for verb in ["template", "lint"] {
        let out = Command::new("helm")
            .arg(verb)
            .arg(chart())
            .env("KUBECONFIG", "/nonexistent/kubeconfig")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "helm {verb} {} failed:\n{}{}",
            chart(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if verb == "template" {
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(text.contains("kind: ClusterPolicy"), "{text}");
            // No registry set: rendered for review as the bare name and the release's tag.
            assert!(
                text.contains(&format!("image: gpu-operator:{OPERATOR_VERSION}")),
                "{text}"
            );
        }
    }
}

/// The operator's image by tag (default: the release version) or by digest, in both forms.
#[test]
fn the_operator_image_is_taken_by_tag_or_by_digest() {
    if tools::harness_tool("helm").is_none() {
        return;
    }
    let image = |extra: &[String]| -> String {
        let docs = template(extra);
        let deployment = find(&docs, "Deployment", "gpu-operator").expect("no Deployment");
        deployment["spec"]["template"]["spec"]["containers"][0]["image"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let repository = operator_repository();
    assert_eq!(image(&operator_image_args()), csv_container_image());
    assert_eq!(
        image(&operator_image_args()),
        format!("{repository}/gpu-operator:{OPERATOR_VERSION}")
    );
    let digest = format!("sha256:{}", "0123456789abcdef".repeat(4));
    let mut by_version = operator_image_args();
    by_version.extend(["--set".into(), format!("operator.version={digest}")]);
    assert_eq!(
        image(&by_version),
        format!("{repository}/gpu-operator@{digest}")
    );
    let mut by_image = operator_image_args();
    by_image.extend([
        "--set".into(),
        format!("operator.image=gpu-operator@{digest}"),
    ]);
    assert_eq!(
        image(&by_image),
        format!("{repository}/gpu-operator@{digest}")
    );
}

// ---- against the cluster ----

fn policies(client: &Client) -> Api<ClusterPolicy> {
    Api::all(client.clone())
}

/// The committed CRD (`crds/`).
fn committed_crd() -> CustomResourceDefinition {
    e2e::crd::cluster_policy_crd().unwrap()
}

/// Replaces the served CRD's spec and annotations (a PUT, so that fields the replacement
/// lacks really go), and waits until it is established.
async fn put_crd(
    admin: &Client,
    spec_from: CustomResourceDefinition,
    annotations: BTreeMap<String, String>,
) -> CustomResourceDefinition {
    let api: Api<CustomResourceDefinition> = Api::all(admin.clone());
    let mut served = match api.get_opt(CRD_NAME).await.unwrap() {
        Some(served) => served,
        None => {
            e2e::crd::install_cluster_policy_crd(admin, "e2e-helm-test")
                .await
                .unwrap();
            api.get(CRD_NAME).await.unwrap()
        }
    };
    served.spec = spec_from.spec;
    served.metadata.annotations = Some(annotations);
    served.metadata.managed_fields = None;
    served.status = None;
    let written = api
        .replace(CRD_NAME, &PostParams::default(), &served)
        .await
        .unwrap();
    wait::for_object(
        api,
        CRD_NAME,
        Duration::from_secs(60),
        "CRD established",
        conditions::is_crd_established(),
    )
    .await
    .unwrap();
    written
}

/// The committed CRD with `edit` applied to its v1 schema.
fn crd_with_schema(edit: impl FnOnce(&mut Value)) -> CustomResourceDefinition {
    let mut value = serde_json::to_value(committed_crd()).unwrap();
    edit(&mut value["spec"]["versions"][0]["schema"]["openAPIV3Schema"]);
    serde_json::from_value(value).unwrap()
}

fn schema_has(crd: &CustomResourceDefinition, pointer: &str) -> bool {
    let value = serde_json::to_value(crd).unwrap();
    value["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        .pointer(pointer)
        .is_some()
}

const SPEC_NFD: &str = "/properties/spec/properties/nfd";

async fn wait_until_gone<K>(api: Api<K>, params: ListParams, what: &str)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    wait::until(TIMEOUT, what, || {
        let (api, params) = (api.clone(), params.clone());
        async move {
            let left: Vec<String> = api
                .list_metadata(&params)
                .await?
                .items
                .into_iter()
                .map(|o| o.name_any())
                .collect();
            Ok(if left.is_empty() {
                Ok(())
            } else {
                Err(format!("{left:?} left"))
            })
        }
    })
    .await
    .unwrap();
}

/// Removes what an earlier failed run (of these tests or others) left: releases of these tests,
/// every ClusterPolicy (another one would make ours `ignored`), failure-injection stages, a
/// modified CRD; then waits for the garbage collector to finish with cluster-scoped operand
/// objects, so that nothing races the next install.
async fn remove_leftovers(admin: &Client) {
    e2e::helm::remove_releases(admin).await;
    // A release whose namespace went first leaves its cluster-scoped objects behind.
    let roles = Api::<ClusterRole>::all(admin.clone());
    let bindings = Api::<ClusterRoleBinding>::all(admin.clone());
    let ours = |meta: &ObjectMeta| {
        meta.annotations
            .as_ref()
            .and_then(|a| a.get("meta.helm.sh/release-namespace"))
            .is_some_and(|ns| ns.starts_with("helm-"))
    };
    if let Some(role) = roles.get_opt(OPERATOR_ACCOUNT).await.unwrap()
        && ours(&role.metadata)
    {
        let _ = roles
            .delete(OPERATOR_ACCOUNT, &DeleteParams::default())
            .await;
    }
    if let Some(binding) = bindings.get_opt(OPERATOR_ACCOUNT).await.unwrap()
        && ours(&binding.metadata)
    {
        let _ = bindings
            .delete(OPERATOR_ACCOUNT, &DeleteParams::default())
            .await;
    }
    e2e::chaos::remove_all(admin).await.unwrap();
    // Installs the CRD on a fresh harness too.
    put_crd(admin, committed_crd(), BTreeMap::new()).await;
    let api = policies(admin);
    for p in api.list(&ListParams::default()).await.unwrap().items {
        let _ = api.delete(&p.name_any(), &DeleteParams::default()).await;
    }
    session::finish_teardowns(admin).await;
    wait_until_gone(api, ListParams::default(), "leftover policies gone").await;
    let managed = ListParams::default().labels(MANAGED_BY_OPERATOR);
    wait_until_gone(
        Api::<ClusterRoleBinding>::all(admin.clone()),
        managed.clone(),
        "operand ClusterRoleBindings collected",
    )
    .await;
    wait_until_gone(
        Api::<RuntimeClass>::all(admin.clone()),
        managed,
        "operand RuntimeClasses collected",
    )
    .await;
}

/// The operator as the chart's pod runs it: the chart's ServiceAccount token, namespace and pod
/// name from the environment. The identity must outlive the process (it holds the kubeconfig).
async fn start_chart_operator(admin: &Client, namespace: &str) -> (OperatorIdentity, Operator) {
    let identity = OperatorIdentity::existing(admin, namespace, OPERATOR_ACCOUNT)
        .await
        .unwrap();
    let operator = Operator::start_as_pod(&identity, &format!("{RELEASE}-e2e")).unwrap();
    (identity, operator)
}

/// What the chart's ServiceAccount may do, asked of the API server's authorizer: run its
/// operands in its namespace, and not write in another namespace (a pod as any ServiceAccount
/// of kube-system, a ConfigMap there, a Lease elsewhere) nor change cluster-scoped objects it
/// does not render.
async fn the_charts_account_writes_only_in_its_namespace(admin: &Client, namespace: &str) {
    let access = |verb, group, resource, namespace, name| Access {
        verb,
        group,
        resource,
        namespace,
        name,
    };
    let own = Some(namespace);
    let system = Some("kube-system");
    let lease = Some(gpu_operator::render::rbac::LEADER_LEASE);
    let rbac = "rbac.authorization.k8s.io";
    let expected = [
        (access("create", "", "pods", own, None), true),
        (access("create", "", "configmaps", own, None), true),
        (access("update", "", "configmaps", own, Some("x")), true),
        (access("create", "apps", "daemonsets", own, None), true),
        (access("create", rbac, "rolebindings", own, None), true),
        (access("patch", "", "namespaces", own, own), true),
        (
            access("create", "coordination.k8s.io", "leases", own, None),
            true,
        ),
        (
            access("update", "coordination.k8s.io", "leases", own, lease),
            true,
        ),
        // Draining a node for a driver upgrade evicts pods wherever they run.
        (access("create", "", "pods/eviction", system, None), true),
        (access("create", "", "pods", system, None), false),
        (access("delete", "", "pods", system, None), false),
        (access("update", "", "configmaps", system, Some("x")), false),
        (access("create", "", "configmaps", system, None), false),
        (access("create", "apps", "daemonsets", system, None), false),
        (access("create", rbac, "rolebindings", system, None), false),
        (access("patch", "", "namespaces", system, system), false),
        (
            access("update", "coordination.k8s.io", "leases", system, lease),
            false,
        ),
        (
            access(
                "update",
                "coordination.k8s.io",
                "leases",
                system,
                Some("kube-scheduler"),
            ),
            false,
        ),
        (
            access(
                "update",
                "coordination.k8s.io",
                "leases",
                own,
                Some("other"),
            ),
            false,
        ),
        (
            access("patch", rbac, "clusterroles", None, Some("cluster-admin")),
            false,
        ),
        (
            access(
                "patch",
                rbac,
                "clusterrolebindings",
                None,
                Some("cluster-admin"),
            ),
            false,
        ),
        (
            access("patch", rbac, "clusterroles", None, Some("nvidia-driver")),
            true,
        ),
    ];
    let mut wrong = Vec::new();
    for (request, want) in expected {
        let got = e2e::operator::may(admin, namespace, OPERATOR_ACCOUNT, request)
            .await
            .unwrap();
        if got != want {
            wrong.push(format!("{request:?}: allowed {got}, want {want}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "the chart's RBAC for ServiceAccount {namespace}/{OPERATOR_ACCOUNT}:\n{}",
        wrong.join("\n")
    );
}

/// SIGTERM, then the exit (it may have exited already, when `helm uninstall` deleted its
/// ServiceAccount).
fn stop(mut operator: Operator) {
    if let Err(e) = operator.terminate(Duration::from_secs(20)) {
        panic!("{e}:\n{}", operator.log_text());
    }
}

/// Waits until the operator logged `text`.
async fn await_log(operator: &Operator, text: &str) {
    operator
        .await_log(text, TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
}

/// Waits until the policy is `ready` for its current generation.
async fn await_ready(admin: &Client, operator: &Operator, what: &str) -> ClusterPolicy {
    session::await_policy_state(admin, POLICY, State::Ready, what)
        .await
        .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()))
}

/// Whether a RollingUpdate DaemonSet finished rolling out its current template.
fn rolled_out(ds: &DaemonSet) -> bool {
    let Some(status) = ds.status.as_ref() else {
        return false;
    };
    status.observed_generation == ds.metadata.generation
        && status.updated_number_scheduled == Some(status.desired_number_scheduled)
        && status.number_available == Some(status.desired_number_scheduled)
}

/// Waits until nothing the operator applied is left in `namespace` or cluster-wide.
async fn await_no_operands(admin: &Client, namespace: &str) {
    let managed = ListParams::default().labels(MANAGED_BY_OPERATOR);
    let c = admin.clone();
    wait_until_gone(
        Api::<DaemonSet>::namespaced(c.clone(), namespace),
        managed.clone(),
        "operand DaemonSets collected",
    )
    .await;
    wait_until_gone(
        Api::<Deployment>::namespaced(c.clone(), namespace),
        managed.clone(),
        "operand Deployments collected",
    )
    .await;
    wait_until_gone(
        Api::<ConfigMap>::namespaced(c.clone(), namespace),
        managed.clone(),
        "operand ConfigMaps collected",
    )
    .await;
    wait_until_gone(
        Api::<Service>::namespaced(c.clone(), namespace),
        managed.clone(),
        "operand Services collected",
    )
    .await;
    wait_until_gone(
        Api::<ServiceAccount>::namespaced(c.clone(), namespace),
        managed.clone(),
        "operand ServiceAccounts collected",
    )
    .await;
    wait_until_gone(
        Api::<Role>::namespaced(c.clone(), namespace),
        managed.clone(),
        "operand Roles collected",
    )
    .await;
    wait_until_gone(
        Api::<RoleBinding>::namespaced(c.clone(), namespace),
        managed.clone(),
        "operand RoleBindings collected",
    )
    .await;
    wait_until_gone(
        Api::<ClusterRole>::all(c.clone()),
        managed.clone(),
        "operand ClusterRoles collected",
    )
    .await;
    wait_until_gone(
        Api::<ClusterRoleBinding>::all(c.clone()),
        managed.clone(),
        "operand ClusterRoleBindings collected",
    )
    .await;
    wait_until_gone(
        Api::<RuntimeClass>::all(c),
        managed,
        "operand RuntimeClasses collected",
    )
    .await;
}

/// Operand DaemonSets of a default policy on the fake fleet.
const OPERAND_DAEMONSETS: [&str; 7] = [
    "nvidia-driver-daemonset",
    "nvidia-container-toolkit-daemonset",
    "nvidia-operator-validator",
    "nvidia-device-plugin-daemonset",
    "gpu-feature-discovery",
    "nvidia-dcgm-exporter",
    "nvidia-mig-manager",
];

#[tokio::test]
async fn helm_install_upgrade_and_uninstall_with_the_operator_on_the_charts_rbac_only() {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    remove_leftovers(&admin).await;
    let namespace = release_namespace(&admin).await;

    // Install with the documented flags, waiting for the operator Deployment (its
    // pod lands on a fake node, where kwok marks it ready).
    let took = helm_release("install", &namespace, &strings(&DOCUMENTED_FLAGS));
    println!("helm install --wait: {took:?}");
    let deployment = Api::<Deployment>::namespaced(admin.clone(), &namespace)
        .get("gpu-operator")
        .await
        .unwrap();
    assert_eq!(
        deployment
            .status
            .as_ref()
            .and_then(|s| s.available_replicas),
        Some(1),
        "operator Deployment not available after helm install --wait"
    );
    // The image the chart rendered is the one the OLM bundle names (one source: the chart's
    // image helper, the registry of scripts/bundle-values.yaml, the release version).
    let image = deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.containers.first())
        .and_then(|c| c.image.clone());
    assert_eq!(image, Some(csv_container_image()));

    // The chart's ServiceAccount writes namespaced objects in its own namespace only.
    the_charts_account_writes_only_in_its_namespace(&admin, &namespace).await;

    // The operator with the chart's ServiceAccount (and so only the chart's RBAC).
    let (_identity, operator) = start_chart_operator(&admin, &namespace).await;
    let started = Instant::now();
    await_ready(&admin, &operator, "policy ready after helm install").await;
    println!(
        "policy ready {:?} after the operator started",
        started.elapsed()
    );
    let daemonsets = Api::<DaemonSet>::namespaced(admin.clone(), &namespace);
    let before: BTreeMap<String, DaemonSet> = daemonsets
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|d| (d.name_any(), d))
        .collect();
    for name in OPERAND_DAEMONSETS {
        assert!(
            before.contains_key(name),
            "{name} missing: {:?}",
            before.keys()
        );
    }
    // Operand pods run on GPU nodes only.
    let gpu_nodes = nodes::gpu_node_names(&admin).await.unwrap();
    for pod in Api::<Pod>::namespaced(admin.clone(), &namespace)
        .list(&ListParams::default().labels(MANAGED_BY_OPERATOR))
        .await
        .unwrap()
        .items
        .iter()
        .filter(|p| {
            p.labels()
                .get("app")
                .is_some_and(|a| OPERAND_DAEMONSETS.contains(&a.as_str()))
        })
    {
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        assert!(
            gpu_nodes.contains(&node),
            "{} on non-GPU node {node}",
            pod.name_any()
        );
    }

    // Time-slicing through the values file rolls the config consumers, nothing else.
    let took = helm_release(
        "upgrade",
        &namespace,
        &[strings(&DOCUMENTED_FLAGS), time_slicing_values()].concat(),
    );
    println!("helm upgrade --wait with the time-slicing values: {took:?}");
    let started = Instant::now();
    for consumer in ["nvidia-device-plugin-daemonset", "gpu-feature-discovery"] {
        let old = config_hash(&before[consumer]);
        let ds = daemonsets.clone();
        wait::until(
            TIMEOUT,
            &format!("{consumer} rolled with the new config"),
            || {
                let ds = ds.clone();
                async move {
                    let now = ds.get(consumer).await?;
                    let hash = config_hash(&now);
                    Ok(if hash.is_some() && hash != old && rolled_out(&now) {
                        Ok(())
                    } else {
                        Err(format!(
                            "hash {hash:?} (was {old:?}), status {:?}",
                            now.status
                        ))
                    })
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
    }
    println!(
        "plugin and GFD rolled {:?} after helm upgrade",
        started.elapsed()
    );
    let policy = await_ready(&admin, &operator, "policy ready after helm upgrade").await;
    assert_eq!(
        serde_json::to_value(&policy.spec.device_plugin.as_ref().unwrap().config).unwrap(),
        json!({"name": "device-plugin-config", "default": "default"})
    );
    for unrelated in [
        "nvidia-driver-daemonset",
        "nvidia-container-toolkit-daemonset",
        "nvidia-dcgm-exporter",
    ] {
        let now = daemonsets.get(unrelated).await.unwrap();
        assert_eq!(
            now.metadata.generation, before[unrelated].metadata.generation,
            "{unrelated} rolled, but the sharing config does not concern it"
        );
    }

    // Teardown as docs/install.md gives it: the policy deleted while the operator runs (the
    // garbage collector takes every operand with it), then the release uninstalled.
    let started = Instant::now();
    policies(&admin)
        .delete(POLICY, &DeleteParams::default())
        .await
        .unwrap();
    helm_ok(&strings(&[
        "uninstall",
        RELEASE,
        "--namespace",
        &namespace,
        "--wait",
    ]));
    await_no_operands(&admin, &namespace).await;
    println!(
        "no operand left {:?} after the policy's deletion and helm uninstall",
        started.elapsed()
    );
    assert!(
        Api::<ClusterRole>::all(admin.clone())
            .get_opt(OPERATOR_ACCOUNT)
            .await
            .unwrap()
            .is_none(),
        "the chart's ClusterRole is left"
    );
    assert!(policies(&admin).get_opt(POLICY).await.unwrap().is_none());
    stop(operator);
    Api::<Namespace>::all(admin.clone())
        .delete(&namespace, &DeleteParams::default())
        .await
        .unwrap();
}

/// Writes to the CRD by `username` after `mark`.
fn crd_writes(log: &AuditLog, mark: e2e::audit::Mark, username: &str) -> Vec<String> {
    log.mutating_since(mark, username)
        .unwrap()
        .into_iter()
        .filter(|e| e.resource() == "customresourcedefinitions")
        .map(|e| format!("{} {}", e.verb, e.request_uri))
        .collect()
}

#[tokio::test]
async fn a_crd_change_reaches_the_cluster_on_helm_upgrade_and_nvidias_crd_is_left_alone() {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    remove_leftovers(&admin).await;
    let namespace = release_namespace(&admin).await;
    let outcome = AssertUnwindSafe(crd_upgrade_steps(&admin, &namespace))
        .catch_unwind()
        .await;
    // Whatever happened, the next test finds the committed CRD.
    put_crd(&admin, committed_crd(), BTreeMap::new()).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
    helm_ok(&strings(&[
        "uninstall",
        RELEASE,
        "--namespace",
        &namespace,
        "--wait",
    ]));
    // The chart keeps the policy (clusterPolicy.keepOnUninstall); the operator is stopped, so
    // its teardown is finished as `gpu-operator cleanup` does.
    let _ = policies(&admin)
        .delete(POLICY, &DeleteParams::default())
        .await;
    session::finish_teardowns(&admin).await;
    await_no_operands(&admin, &namespace).await;
    Api::<Namespace>::all(admin.clone())
        .delete(&namespace, &DeleteParams::default())
        .await
        .unwrap();
}

async fn crd_upgrade_steps(admin: &Client, namespace: &str) {
    let crds: Api<CustomResourceDefinition> = Api::all(admin.clone());
    let audit = AuditLog::from_env().unwrap();
    helm_release("install", namespace, &[]);

    // The CRD an older chart installed: no spec.nfd yet, an older description.
    let older = crd_with_schema(|schema| {
        schema["properties"]["spec"]["properties"]
            .as_object_mut()
            .unwrap()
            .remove("nfd");
        schema["description"] = json!("ClusterPolicy of an older release");
    });
    put_crd(admin, older, BTreeMap::new()).await;

    // helm upgrade alone leaves it as it is.
    helm_release("upgrade", namespace, &strings(&DOCUMENTED_FLAGS));
    let served = crds.get(CRD_NAME).await.unwrap();
    assert!(
        !schema_has(&served, SPEC_NFD),
        "helm upgrade changed the CRD; this test assumes it never does"
    );

    // The upgraded operator starts (as its new pod would) and brings the CRD up to date.
    let mark = audit.mark().unwrap();
    let (identity, operator) = start_chart_operator(admin, namespace).await;
    let crds_poll = crds.clone();
    let upgraded = wait::until(TIMEOUT, "CRD upgraded by the operator", || {
        let crds = crds_poll.clone();
        async move {
            let served = crds.get(CRD_NAME).await?;
            let version = served.annotations().get(CRD_VERSION_ANNOTATION).cloned();
            Ok(
                if schema_has(&served, SPEC_NFD) && version.as_deref() == Some(OPERATOR_VERSION) {
                    Ok(served)
                } else {
                    Err(format!(
                        "spec.nfd served: {}, version annotation {version:?}",
                        schema_has(&served, SPEC_NFD)
                    ))
                },
            )
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
    // The versions (schemas, printer columns) are stored exactly as the operator wrote them, which
    // is what its "up to date" comparison relies on.
    assert_eq!(
        upgraded.spec.versions,
        committed_crd().spec.versions,
        "served versions are not the operator's"
    );
    await_log(&operator, "CRD upgraded").await;
    await_ready(admin, &operator, "policy ready with the upgraded CRD").await;
    // On a fresh cluster the same start also installs the vendored NFD CRDs: only the
    // ClusterPolicy CRD's writes count here.
    let writes: Vec<String> = crd_writes(&audit, mark, &identity.username())
        .into_iter()
        .filter(|w| w.contains(&format!("/customresourcedefinitions/{CRD_NAME}?")))
        .collect();
    assert_eq!(
        writes.len(),
        1,
        "expected one ClusterPolicy CRD update: {writes:?}"
    );
    assert!(writes[0].starts_with("update "), "{writes:?}");
    stop(operator);

    // A restart with the CRD up to date writes nothing to it.
    let mark = audit.mark().unwrap();
    let (identity, operator) = start_chart_operator(admin, namespace).await;
    await_log(&operator, "CRD is up to date").await;
    await_log(&operator, "caches ready").await;
    assert_eq!(
        crd_writes(&audit, mark, &identity.username()),
        Vec::<String>::new()
    );
    stop(operator);

    // NVIDIA's CRD (controller-gen's annotation, none of our fields) is reported, never written.
    let nvidias = crd_with_schema(|schema| {
        schema["properties"]["spec"]["properties"]
            .as_object_mut()
            .unwrap()
            .remove("nfd");
        schema["properties"]["status"]["properties"]
            .as_object_mut()
            .unwrap()
            .remove("components");
    });
    let written = put_crd(
        admin,
        nvidias,
        [(
            "controller-gen.kubebuilder.io/version".to_owned(),
            "v0.18.0".to_owned(),
        )]
        .into(),
    )
    .await;
    let mark = audit.mark().unwrap();
    let (identity, operator) = start_chart_operator(admin, namespace).await;
    await_log(&operator, "leaving the ClusterPolicy CRD alone").await;
    await_log(&operator, "caches ready").await;
    assert!(
        operator
            .log_text()
            .contains("installed by NVIDIA's GPU Operator"),
        "{}",
        operator.log_text()
    );
    // Reported where users look (decision 14).
    let api = policies(admin);
    wait::until(TIMEOUT, "policy status names the foreign CRD", || {
        let api = api.clone();
        async move {
            let status = serde_json::to_string(&api.get(POLICY).await?.status)?;
            Ok(if status.contains("ClusterPolicy CRD lacks") {
                Ok(())
            } else {
                Err(status)
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
    let served = crds.get(CRD_NAME).await.unwrap();
    assert_eq!(
        served.metadata.resource_version, written.metadata.resource_version,
        "NVIDIA's CRD was written"
    );
    assert_eq!(
        crd_writes(&audit, mark, &identity.username()),
        Vec::<String>::new()
    );
    stop(operator);
}

/// Installing with no operator image fails before any object of the release exists, with a
/// message naming the value to set; the same install by digest passes the live checks (the
/// cluster's Kubernetes version included) with `--dry-run=server`.
#[tokio::test]
async fn helm_install_without_an_operator_image_fails_early_naming_the_value_and_a_digest_passes() {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    remove_leftovers(&admin).await;
    let namespace = release_namespace(&admin).await;
    let install = |extra: &[String]| {
        let mut args = strings(&["install", RELEASE]);
        args.push(chart());
        args.extend(strings(&["--namespace", &namespace]));
        args.extend(extra.iter().cloned());
        helm(&args)
    };

    let out = install(&[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "helm install with no operator image succeeded"
    );
    for text in [
        "operator.repository is not set",
        "--set operator.repository=",
        "docs/install.md",
    ] {
        assert!(stderr.contains(text), "{text:?} not in:\n{stderr}");
    }
    let releases = helm_ok(&strings(&[
        "list",
        "--all",
        "--short",
        "--namespace",
        &namespace,
    ]));
    assert_eq!(releases.trim(), "", "a release was recorded: {releases}");
    for (what, count) in [
        (
            "Deployments",
            Api::<Deployment>::namespaced(admin.clone(), &namespace)
                .list(&ListParams::default())
                .await
                .unwrap()
                .items
                .len(),
        ),
        (
            "ServiceAccounts other than default",
            Api::<ServiceAccount>::namespaced(admin.clone(), &namespace)
                .list(&ListParams::default())
                .await
                .unwrap()
                .items
                .iter()
                .filter(|sa| sa.name_any() != "default")
                .count(),
        ),
    ] {
        assert_eq!(count, 0, "{what} created by a failed install");
    }
    assert!(
        policies(&admin).get_opt(POLICY).await.unwrap().is_none(),
        "a failed install created the ClusterPolicy"
    );

    // Against the live cluster (lookups answer), by digest: accepted and rendered.
    let digest = format!("sha256:{}", "0123456789abcdef".repeat(4));
    let mut args = operator_image_args();
    args.extend(strings(&["--dry-run=server", "--set"]));
    args.push(format!("operator.version={digest}"));
    let out = install(&args);
    assert!(
        out.status.success(),
        "helm install --dry-run=server by digest failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let manifest = String::from_utf8_lossy(&out.stdout);
    let expected = format!("image: {}/gpu-operator@{digest}", operator_repository());
    assert!(
        manifest.contains(&expected),
        "{expected} not in:\n{manifest}"
    );

    Api::<Namespace>::all(admin.clone())
        .delete(&namespace, &DeleteParams::default())
        .await
        .unwrap();
}

/// The DRA stack from the chart, as NVIDIA's values name it: `gpuCluster.deployCR=true` with
/// `clusterPolicy.deployCR=false` creates the GPUCluster and no ClusterPolicy; the operator, on
/// the chart's RBAC alone, deploys NVIDIA's DRA driver (kubelet plugin, controller,
/// DeviceClasses) and the GPUCluster reaches ready, with no device plugin anywhere;
/// `helm uninstall` takes the stack away.
#[tokio::test]
async fn helm_install_with_gpu_cluster_deploy_cr_and_no_cluster_policy_installs_the_dra_stack() {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    remove_leftovers(&admin).await;
    // Helm installs CRDs only where none exists; the one of the operator's types, as here, is
    // the chart's copy (a unit test keeps them equal).
    e2e::dra::install_gpu_cluster_crd(&admin).await.unwrap();
    e2e::dra::remove_all(&admin).await.unwrap();
    let clusters = Api::<GPUCluster>::all(admin.clone());
    e2e::dra::remove_gpu_cluster(&admin).await.unwrap();
    let namespace = release_namespace(&admin).await;

    helm_release(
        "install",
        &namespace,
        &strings(&[
            "--set",
            "gpuCluster.deployCR=true",
            "--set",
            "clusterPolicy.deployCR=false",
        ]),
    );
    assert!(
        policies(&admin).get_opt(POLICY).await.unwrap().is_none(),
        "clusterPolicy.deployCR=false, yet the chart created a ClusterPolicy"
    );
    assert!(
        clusters.get_opt(GPU_CLUSTER_NAME).await.unwrap().is_some(),
        "gpuCluster.deployCR=true, yet the chart created no GPUCluster"
    );

    e2e::dra::publish_fleet(&admin).await.unwrap();
    let (_identity, operator) = start_chart_operator(&admin, &namespace).await;
    e2e::dra::await_state(&admin, GpuClusterState::Ready, TIMEOUT, "GPUCluster ready")
        .await
        .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
    let daemonsets = Api::<DaemonSet>::namespaced(admin.clone(), &namespace);
    daemonsets
        .get("nvidia-dra-driver-kubelet-plugin")
        .await
        .unwrap();
    assert!(
        daemonsets
            .get_opt("nvidia-device-plugin-daemonset")
            .await
            .unwrap()
            .is_none(),
        "a device plugin beside the DRA driver"
    );
    Api::<Deployment>::namespaced(admin.clone(), &namespace)
        .get("nvidia-dra-driver-controller")
        .await
        .unwrap();
    let device_classes = Api::<DynamicObject>::all_with(
        admin.clone(),
        &ApiResource::from_gvk(&GroupVersionKind::gvk(
            "resource.k8s.io",
            "v1",
            "DeviceClass",
        )),
    );
    device_classes.get("gpu.nvidia.com").await.unwrap();

    helm_ok(&strings(&[
        "uninstall",
        RELEASE,
        "--namespace",
        &namespace,
        "--wait",
    ]));
    // Kept, as the ClusterPolicy is (gpuCluster.keepOnUninstall): the DRA stack stays under
    // running jobs. Deleted while the operator runs, it goes with its objects.
    assert!(
        clusters.get_opt(GPU_CLUSTER_NAME).await.unwrap().is_some(),
        "helm uninstall deleted the GPUCluster"
    );
    e2e::dra::remove_gpu_cluster(&admin).await.unwrap();
    let dra_objects = ListParams::default()
        .labels("nvidia.com/gpu-operator.operand in (dra-driver,dra-device-classes)");
    wait::until_none_left(
        &device_classes,
        &dra_objects,
        TIMEOUT,
        "DeviceClasses collected",
    )
    .await
    .unwrap();
    wait::until_none_left(
        &daemonsets,
        &dra_objects,
        TIMEOUT,
        "DRA DaemonSet collected",
    )
    .await
    .unwrap();
    stop(operator);
    Api::<Namespace>::all(admin.clone())
        .delete(&namespace, &DeleteParams::default())
        .await
        .unwrap();
    e2e::dra::remove_all(&admin).await.unwrap();
}
