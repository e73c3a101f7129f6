//! The ClusterPolicy CRD as the API server serves it: installed from `crds/`, every example
//! reads back as written (plus the defaults the schema declares), invalid policies are rejected
//! with messages that name the field, and kubectl shows descriptions and printer columns. Every
//! field path of NVIDIA's v26.7 ClusterPolicy and NVIDIADriver reads back unpruned.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use e2e::cluster::{kubectl_output, unique_name};
use e2e::tools::repo_root;
use e2e::{connect, kubectl, wait};
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::{Client, Error};
use serde_json::{Value, json};

const FIELD_MANAGER: &str = "e2e-crd-test";
const TIMEOUT: Duration = Duration::from_secs(60);

fn read_yaml(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// YAML files in `dir` whose name starts with `prefix`, sorted.
fn yaml_files(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with(prefix) && name.ends_with(".yaml")
        })
        .collect();
    files.sort();
    files
}

fn stem(path: &Path) -> String {
    path.file_stem().unwrap().to_string_lossy().into_owned()
}

fn cluster_policies(client: &Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("nvidia.com", "v1", "ClusterPolicy");
    Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(&gvk, "clusterpolicies"),
    )
}

/// Applies `crds/nvidia.com_clusterpolicies.yaml` server-side, waits until it is established
/// and returns its `openAPIV3Schema`.
async fn install_crd(client: &Client) -> Result<Value> {
    e2e::crd::install_cluster_policy_crd(client, FIELD_MANAGER).await?;
    let crd = serde_json::to_value(e2e::crd::cluster_policy_crd()?)?;
    Ok(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone())
}

/// Paths where two JSON values differ, for a readable failure.
fn differences(path: &str, expected: &Value, actual: &Value, out: &mut Vec<String>) {
    use gpu_operator::json_diff::{self, Difference, Rules};
    out.extend(
        json_diff::differences(path, expected, actual, &Rules::EXACT)
            .into_iter()
            .map(|d| match d {
                Difference::Missing { path, wanted } => {
                    format!("{path}: written {wanted}, not read back")
                }
                Difference::Extra { path, found } => {
                    format!("{path}: read back {found}, never written")
                }
                Difference::Length {
                    path,
                    wanted,
                    found,
                }
                | Difference::Changed {
                    path,
                    wanted,
                    found,
                } => format!("{path}: expected {wanted}, read back {found}"),
            }),
    );
}

async fn delete_quietly(api: &Api<DynamicObject>, name: &str) {
    let _ = api.delete(name, &DeleteParams::default()).await;
}

#[tokio::test]
async fn every_example_reads_back_as_written_plus_schema_defaults() {
    let Some(client) = connect().await else {
        return;
    };
    let schema = install_crd(&client).await.unwrap();
    let api = cluster_policies(&client);
    let examples = yaml_files(&repo_root().join("examples"), "clusterpolicy-");
    assert!(examples.len() >= 5, "examples missing: {examples:?}");

    let mut failures = Vec::new();
    for path in &examples {
        let mut written = read_yaml(path);
        let name = unique_name(&format!("e2e-{}", stem(path)));
        written["metadata"]["name"] = json!(name);

        // Server-side apply with strict field validation: a field the schema does not know
        // fails the request instead of being pruned silently.
        let params = PatchParams::apply(FIELD_MANAGER)
            .force()
            .validation_strict();
        if let Err(e) = api.patch(&name, &params, &Patch::Apply(&written)).await {
            failures.push(format!("{}: not accepted: {e}", stem(path)));
            continue;
        }
        let read = serde_json::to_value(api.get(&name).await.unwrap()).unwrap();
        delete_quietly(&api, &name).await;

        let mut expected_spec = written["spec"].clone();
        // The operator's own copy of the API server's structural defaulting, checked against it.
        gpu_operator::validate::apply_defaults(&mut expected_spec, &schema["properties"]["spec"]);
        let mut diffs = Vec::new();
        differences(".spec", &expected_spec, &read["spec"], &mut diffs);
        for field in ["labels", "annotations"] {
            differences(
                &format!(".metadata.{field}"),
                &written["metadata"]
                    .get(field)
                    .cloned()
                    .unwrap_or(Value::Null),
                &read["metadata"].get(field).cloned().unwrap_or(Value::Null),
                &mut diffs,
            );
        }
        if read["apiVersion"] != json!("nvidia.com/v1") || read["kind"] != json!("ClusterPolicy") {
            diffs.push(format!("type: {} {}", read["apiVersion"], read["kind"]));
        }
        if !diffs.is_empty() {
            failures.push(format!("{}:\n  {}", stem(path), diffs.join("\n  ")));
        }
    }
    assert!(
        failures.is_empty(),
        "read-back differs:\n{}",
        failures.join("\n")
    );
}

/// NVIDIA's v26.7 ClusterPolicy field paths with type and default (facts, from
/// `scripts/crd-paths.py`).
const NVIDIA_PATHS: &str = "operator/tests/fixtures/nvidia-v26.7-clusterpolicy-paths.txt";
/// The same facts for NVIDIA's v26.7 NVIDIADriver CRD.
const NVIDIA_DRIVER_PATHS: &str = "operator/tests/fixtures/nvidia-v26.7-nvidiadriver-paths.txt";

/// One `spec.` field of [`NVIDIA_PATHS`]: path, type, default and enum.
struct NvidiaField {
    path: String,
    type_: String,
    default: Option<Value>,
    enum_first: Option<Value>,
}

fn nvidia_spec_fields(facts: &str) -> Vec<NvidiaField> {
    let text = std::fs::read_to_string(repo_root().join(facts)).unwrap();
    let json_column = |c: &str| (c != "-").then(|| serde_json::from_str::<Value>(c).unwrap());
    text.lines()
        .filter(|l| l.starts_with("spec."))
        .map(|line| {
            let c: Vec<&str> = line.split('\t').collect();
            NvidiaField {
                path: c[0].to_owned(),
                type_: c[1].to_owned(),
                default: json_column(c[2]),
                enum_first: json_column(c[3]).and_then(|e| e.get(0).cloned()),
            }
        })
        .collect()
}

/// A value for a leaf of NVIDIA's schema that our CRD must accept: the first enum value, else
/// NVIDIA's default, else a value of the type that passes our patterns and rules (durations
/// for Prometheus intervals, a label name for relabeling sources, `1` for numbers and
/// quantities).
fn sample_value(field: &NvidiaField) -> Value {
    if let Some(v) = field.enum_first.clone().or_else(|| field.default.clone()) {
        return v;
    }
    let last = field.path.rsplit('.').next().unwrap_or_default();
    match field.type_.as_str() {
        "boolean" => json!(true),
        "integer" => json!(1),
        "int-or-string" => json!("1"),
        _ if last == "interval" || last == "scrapeTimeout" => json!("30s"),
        _ if last == "sourceLabels[]" => json!("pod_name"),
        _ if field.path.ends_with("maxUnavailable") => json!("1"),
        _ => json!("value-1"),
    }
}

/// Sets `value` at a schema path (`a.b[].c`, `a.labels{}`) in `root`: one item per list, the key
/// `example.com/key` per map.
fn set_path(root: &mut Value, path: &str, value: Value) {
    let mut node = root;
    let mut rest = path;
    while !rest.is_empty() {
        let (segment, tail) = rest.split_once('.').unwrap_or((rest, ""));
        rest = tail;
        let mut key = segment;
        let mut suffixes = Vec::new();
        while let Some(k) = key.strip_suffix("[]") {
            suffixes.push("[]");
            key = k;
        }
        while let Some(k) = key.strip_suffix("{}") {
            suffixes.push("{}");
            key = k;
        }
        node = node
            .as_object_mut()
            .unwrap()
            .entry(key)
            .or_insert(Value::Null);
        for suffix in suffixes.into_iter().rev() {
            if suffix == "[]" {
                if !node.is_array() {
                    *node = json!([Value::Null]);
                }
                node = &mut node[0];
            } else {
                if !node.is_object() {
                    *node = json!({});
                }
                node = node
                    .as_object_mut()
                    .unwrap()
                    .entry("example.com/key")
                    .or_insert(Value::Null);
            }
        }
        if !rest.is_empty() && !node.is_object() {
            *node = json!({});
        }
    }
    *node = value;
}

/// NVIDIA's v26.7 leaf paths of `facts` (paths no other path extends), each set to a sample
/// value in one spec; asserts there are at least `min_leaves`.
fn every_leaf_set(facts: &str, min_leaves: usize) -> (Vec<NvidiaField>, Value) {
    let fields = nvidia_spec_fields(facts);
    let paths: std::collections::BTreeSet<String> = fields.iter().map(|f| f.path.clone()).collect();
    let leaves: Vec<NvidiaField> = fields
        .into_iter()
        .filter(|f| {
            !paths.iter().any(|p| {
                p.len() > f.path.len()
                    && p.starts_with(f.path.as_str())
                    && matches!(p.as_bytes()[f.path.len()], b'.' | b'[' | b'{')
            })
        })
        .collect();
    assert!(
        leaves.len() >= min_leaves,
        "{facts}: only {} leaves",
        leaves.len()
    );
    let mut written = json!({});
    for leaf in &leaves {
        set_path(&mut written, &leaf.path, sample_value(leaf));
    }
    (leaves, written["spec"].clone())
}

/// Stores `object` through `api` with strict field validation, reads it back and deletes it;
/// asserts the spec reads back as written plus `spec_schema`'s defaults and every leaf is there.
async fn assert_stored_unpruned(
    api: &Api<DynamicObject>,
    object: &Value,
    spec_schema: &Value,
    leaves: &[NvidiaField],
    kind: &str,
) {
    let name = object["metadata"]["name"].as_str().unwrap().to_owned();
    // Strict field validation: a field the schema does not know fails the request instead of
    // being pruned silently.
    let params = PatchParams::apply(FIELD_MANAGER)
        .force()
        .validation_strict();
    let applied = api.patch(&name, &params, &Patch::Apply(object)).await;
    let read = match applied {
        Ok(_) => serde_json::to_value(api.get(&name).await.unwrap()).unwrap(),
        Err(e) => panic!(
            "a {kind} with all {} v26.7 leaf paths set is refused: {e}",
            leaves.len()
        ),
    };
    delete_quietly(api, &name).await;

    let mut expected = object["spec"].clone();
    gpu_operator::validate::apply_defaults(&mut expected, spec_schema);
    let mut diffs = Vec::new();
    differences(".spec", &expected, &read["spec"], &mut diffs);
    assert!(
        diffs.is_empty(),
        "{} of NVIDIA v26.7's {kind} field paths do not read back as written:\n  {}",
        diffs.len(),
        diffs.join("\n  ")
    );
    // Every leaf is really there (a sample value that equals nothing proves nothing).
    for leaf in leaves {
        let mut node = &read;
        for segment in leaf.path.split('.') {
            let key = segment.trim_end_matches("[]").trim_end_matches("{}");
            node = &node[key];
            for suffix in segment.as_bytes()[key.len()..].chunks(2) {
                node = if suffix == b"[]" {
                    &node[0]
                } else {
                    &node["example.com/key"]
                };
            }
        }
        assert!(!node.is_null(), "{kind} {}: not read back", leaf.path);
    }
}

#[tokio::test]
async fn every_nvidia_v26_7_field_path_is_stored_and_read_back_unpruned() {
    let (leaves, spec) = every_leaf_set(NVIDIA_PATHS, 350);
    let Some(client) = connect().await else {
        return;
    };
    let schema = install_crd(&client).await.unwrap();
    let object = json!({
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "metadata": {"name": unique_name("e2e-nvidia-v26-7")},
        "spec": spec,
    });
    let api = cluster_policies(&client);
    assert_stored_unpruned(
        &api,
        &object,
        &schema["properties"]["spec"],
        &leaves,
        "ClusterPolicy",
    )
    .await;
}

#[tokio::test]
async fn every_nvidia_v26_7_nvidiadriver_field_path_is_stored_and_read_back_unpruned() {
    let (leaves, spec) = every_leaf_set(NVIDIA_DRIVER_PATHS, 120);
    assert!(
        leaves
            .iter()
            .any(|l| l.path == "spec.upgradePolicy.drain.podSelector"),
        "{NVIDIA_DRIVER_PATHS}: no upgradePolicy leaves"
    );
    let Some(client) = connect().await else {
        return;
    };
    e2e::crd::install_nvidia_driver_crd(&client, FIELD_MANAGER)
        .await
        .unwrap();
    let crd = serde_json::to_value(gpu_operator::api::nvidia_driver_crd::crd()).unwrap();
    let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    let object = json!({
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "NVIDIADriver",
        "metadata": {"name": unique_name("e2e-nvd-v26-7")},
        "spec": spec,
    });
    let gvk = GroupVersionKind::gvk("nvidia.com", "v1alpha1", "NVIDIADriver");
    let api = Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(&gvk, "nvidiadrivers"),
    );
    assert_stored_unpruned(
        &api,
        &object,
        &schema["properties"]["spec"],
        &leaves,
        "NVIDIADriver",
    )
    .await;
}

/// The `# expect: ...` lines of an invalid policy: substrings the API server's error must contain.
fn expectations(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter_map(|line| line.strip_prefix("# expect:"))
        .map(|s| s.trim().to_owned())
        .collect()
}

#[tokio::test]
async fn invalid_policies_are_rejected_with_a_message_naming_the_field() {
    let Some(client) = connect().await else {
        return;
    };
    install_crd(&client).await.unwrap();
    let api = cluster_policies(&client);
    let cases = yaml_files(&repo_root().join("tests/e2e/testdata/invalid-policies"), "");
    assert!(cases.len() >= 20, "only {} invalid policies", cases.len());

    let mut failures = Vec::new();
    for path in &cases {
        let expected = expectations(path);
        assert!(
            !expected.is_empty(),
            "{} has no `# expect:` line",
            path.display()
        );
        let mut policy = read_yaml(path);
        let name = unique_name(&format!("e2e-{}", stem(path)));
        policy["metadata"]["name"] = json!(name);
        let object: DynamicObject = serde_json::from_value(policy).unwrap();
        match api.create(&PostParams::default(), &object).await {
            Ok(_) => {
                delete_quietly(&api, &name).await;
                failures.push(format!("{}: accepted", stem(path)));
            }
            Err(Error::Api(status)) => {
                let message = status.message.clone();
                let missing: Vec<_> = expected
                    .iter()
                    .filter(|e| !message.contains(e.as_str()))
                    .collect();
                if status.code != 422 || !missing.is_empty() {
                    failures.push(format!(
                        "{}: HTTP {} {message:?} lacks {missing:?}",
                        stem(path),
                        status.code
                    ));
                }
            }
            Err(e) => failures.push(format!("{}: {e}", stem(path))),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test]
async fn kubectl_explain_teaches_the_device_plugin_config() {
    let Some(client) = connect().await else {
        return;
    };
    install_crd(&client).await.unwrap();
    // The API server publishes a new CRD's OpenAPI a moment after it is established.
    let explained = wait::until(
        TIMEOUT,
        "kubectl explain clusterpolicy.spec.devicePlugin.config",
        || async {
            let output = kubectl()
                .args(["explain", "clusterpolicy.spec.devicePlugin.config"])
                .output()
                .context("running kubectl")?;
            let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
            Ok(if output.status.success() && stdout.contains("FIELDS:") {
                Ok(stdout)
            } else {
                Err(format!(
                    "{stdout}{}",
                    String::from_utf8_lossy(&output.stderr)
                ))
            })
        },
    )
    .await
    .unwrap();
    for text in [
        "KIND:",
        "ClusterPolicy",
        "DESCRIPTION:",
        "The device plugin configuration",
        "nvidia.com/device-plugin.config",
    ] {
        assert!(
            explained.contains(text),
            "{text:?} missing from:\n{explained}"
        );
    }
    for field in ["default", "name"] {
        let listed = explained.lines().any(|line| {
            let line = line.trim_start();
            line.starts_with(field) && line.contains("<string>")
        });
        assert!(listed, "field {field} missing from:\n{explained}");
    }
}

#[tokio::test]
async fn kubectl_get_shows_status_gpu_nodes_operands_reason_and_age() {
    let Some(client) = connect().await else {
        return;
    };
    install_crd(&client).await.unwrap();
    let api = cluster_policies(&client);
    let name = unique_name("e2e-get");
    let policy = json!({
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "metadata": {"name": name},
        "spec": {}
    });
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER),
        &Patch::Apply(&policy),
    )
    .await
    .unwrap();
    let status = json!({"status": {
        "state": "ready", "namespace": "gpu-operator", "gpuNodes": 6, "operandsReady": "9/9",
        "conditions": [{"type": "Ready", "status": "True", "reason": "Ready",
            "message": "all operands ready on 6 GPU nodes",
            "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
    api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    let bad = json!({"status": {"state": "broken"}});
    let rejected = api
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&bad))
        .await;

    let table = kubectl_output(&["get", "clusterpolicy", &name]);
    delete_quietly(&api, &name).await;

    let error = rejected
        .expect_err("status.state broken accepted")
        .to_string();
    assert!(error.contains("status.state"), "{error}");
    let table = table.unwrap();
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "NAME", "STATUS", "GPU", "NODES", "OPERANDS", "REASON", "AGE"
        ],
        "{table}"
    );
    let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        &row[..5],
        [name.as_str(), "ready", "6", "9/9", "Ready"],
        "{table}"
    );
}
