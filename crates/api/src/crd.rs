//! CRD generation for ClusterPolicy (pure). The committed copy in `crds/` is checked against
//! these functions by a test, so the YAML never drifts from the Rust types.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps, JSONSchemaPropsOrArray, JSONSchemaPropsOrBool,
};
use kube_core::CustomResourceExt;

use super::ClusterPolicy;

/// Where the generated CRD is committed, relative to the repository root.
/// Name of the ClusterPolicy CRD (the one source: the operator, the bundle and the tests).
pub const CRD_NAME: &str = "clusterpolicies.nvidia.com";

pub const CRD_PATH: &str = "crds/nvidia.com_clusterpolicies.yaml";

/// The command that regenerates [`CRD_PATH`].
pub const REGENERATE_COMMAND: &str =
    "cargo run -p gpu-operator -- crd > crds/nvidia.com_clusterpolicies.yaml";

/// The ClusterPolicy CustomResourceDefinition as it is installed.
///
/// Starts from kube's derived CRD and tidies the schema so that it stores and validates like
/// NVIDIA's: fields are not `nullable` (a null, as Helm renders an empty value, is dropped and
/// then defaulted instead of being stored), and no `title` hides part of a description from
/// `kubectl explain`.
pub fn crd() -> CustomResourceDefinition {
    let mut crd = ClusterPolicy::crd();
    for version in &mut crd.spec.versions {
        if let Some(schema) = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        {
            tidy(schema);
        }
    }
    crd
}

/// [`crd()`] as YAML, with a header saying how it is made; what `gpu-operator crd` prints.
pub fn crd_yaml() -> Result<String, serde_yaml_ng::Error> {
    let body = quote_yaml11_booleans(&serde_yaml_ng::to_string(&crd())?);
    Ok(format!(
        "# Generated from the Rust types in operator/src/api; do not edit.\n\
         # Regenerate with: {REGENERATE_COMMAND}\n{body}"
    ))
}

/// Words that YAML 1.1 parsers (kubectl's among them) read as booleans, while the YAML 1.2
/// emitter writes them as plain strings: the enum value `on` would reach the API server as
/// `true`.
const YAML11_BOOLEANS: [&str; 16] = [
    "y", "Y", "yes", "Yes", "YES", "n", "N", "no", "No", "NO", "on", "On", "ON", "off", "Off",
    "OFF",
];

/// Quotes plain scalars that YAML 1.1 would read as booleans, in `- item` and `key: value`
/// lines. Block scalars never hold such a line alone in this CRD; a test parses the result back.
pub(super) fn quote_yaml11_booleans(yaml: &str) -> String {
    let mut out = String::with_capacity(yaml.len());
    for line in yaml.lines() {
        let body = line.trim_start();
        let indent = &line[..line.len() - body.len()];
        let quoted = if let Some(item) = body.strip_prefix("- ") {
            YAML11_BOOLEANS
                .contains(&item)
                .then(|| format!("{indent}- '{item}'"))
        } else if let Some((key, value)) = body.split_once(": ") {
            YAML11_BOOLEANS
                .contains(&value)
                .then(|| format!("{indent}{key}: '{value}'"))
        } else {
            None
        };
        out.push_str(quoted.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

/// Joins the lines of each paragraph of a doc comment, so that `kubectl explain` wraps the text
/// to the terminal instead of keeping the source's line breaks. Indented lines and list items
/// keep their line break.
fn reflow(description: &str) -> String {
    let mut out = String::with_capacity(description.len());
    for (i, line) in description.lines().enumerate() {
        if i > 0 {
            let keep_break = line.is_empty()
                || out.ends_with('\n')
                || line.starts_with([' ', '\t', '-', '*'])
                || out.ends_with(':');
            out.push(if keep_break { '\n' } else { ' ' });
        }
        out.push_str(line);
    }
    out
}

pub(super) fn tidy(schema: &mut JSONSchemaProps) {
    schema.nullable = None;
    if schema.x_kubernetes_int_or_string == Some(true) && schema.any_of.is_some() {
        // kube's rewriter hoists the branch types away; restore the one allowed form.
        let branch = |t: &str| JSONSchemaProps {
            type_: Some(t.to_owned()),
            ..Default::default()
        };
        schema.any_of = Some(vec![branch("integer"), branch("string")]);
    }
    // Only kube's root schema has a title (the kind's name); descriptions say it all.
    schema.title = None;
    if let Some(description) = &mut schema.description {
        *description = reflow(description);
    }
    let children = schema
        .properties
        .iter_mut()
        .flat_map(|p| p.values_mut())
        .chain(schema.any_of.iter_mut().flatten())
        .chain(schema.all_of.iter_mut().flatten())
        .chain(schema.one_of.iter_mut().flatten())
        .chain(schema.not.as_deref_mut());
    for child in children {
        tidy(child);
    }
    match &mut schema.items {
        Some(JSONSchemaPropsOrArray::Schema(items)) => tidy(items),
        Some(JSONSchemaPropsOrArray::Schemas(items)) => items.iter_mut().for_each(tidy),
        None => {}
    }
    if let Some(JSONSchemaPropsOrBool::Schema(additional)) = &mut schema.additional_properties {
        tidy(additional);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::PathBuf;

    use serde_json::{Value, json};

    use super::*;

    fn committed_path() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(CRD_PATH)
    }

    fn first_difference(committed: &str, generated: &str) -> String {
        let mut committed_lines = committed.lines();
        let mut generated_lines = generated.lines();
        for line_no in 1.. {
            match (committed_lines.next(), generated_lines.next()) {
                (None, None) => break,
                (c, g) if c == g => continue,
                (c, g) => {
                    return format!(
                        "first difference at line {line_no}:\n  committed: {}\n  generated: {}",
                        c.unwrap_or("<end of file>"),
                        g.unwrap_or("<end of file>")
                    );
                }
            }
        }
        String::new()
    }

    #[test]
    fn reflow_joins_paragraph_lines_but_keeps_lists_and_paragraphs() {
        assert_eq!(reflow("one\ntwo\n\nthree"), "one two\n\nthree");
        assert_eq!(reflow("options:\n  a\n  b"), "options:\n  a\n  b");
        assert_eq!(reflow("list\n- a\n- b"), "list\n- a\n- b");
    }

    #[test]
    fn yaml_output_parses_back_to_the_crd_even_for_yaml_1_1_readers() {
        let yaml = crd_yaml().unwrap();
        let parsed: CustomResourceDefinition = serde_yaml_ng::from_str(&yaml).unwrap();
        assert_eq!(parsed, crd());
        for line in yaml.lines() {
            let value = line
                .trim_start()
                .strip_prefix("- ")
                .or_else(|| line.split_once(": ").map(|(_, v)| v));
            assert!(
                value.is_none_or(|v| !YAML11_BOOLEANS.contains(&v)),
                "unquoted YAML 1.1 boolean: {line}"
            );
        }
        assert!(yaml.contains("- 'on'") && yaml.contains("- 'off'"));
    }

    #[test]
    fn committed_crd_matches_the_rust_types() {
        let generated = crd_yaml().unwrap();
        let committed = std::fs::read_to_string(committed_path()).unwrap_or_default();
        assert!(
            committed == generated,
            "{CRD_PATH} differs from the CRD generated from the Rust types.\n\
             Regenerate it, with the chart's and the bundle's copies, with:\n    cargo xtask generate\n\
             {}",
            first_difference(&committed, &generated)
        );
    }

    fn schema() -> Value {
        let crd = serde_json::to_value(crd()).unwrap();
        crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
    }

    /// Visits every schema node with its path (`.spec.driver.env[]`).
    fn walk(node: &Value, path: &str, visit: &mut dyn FnMut(&str, &Value)) {
        visit(path, node);
        if let Some(props) = node.get("properties").and_then(Value::as_object) {
            for (name, child) in props {
                walk(child, &format!("{path}.{name}"), visit);
            }
        }
        if let Some(items) = node.get("items") {
            walk(items, &format!("{path}[]"), visit);
        }
        if let Some(additional) = node.get("additionalProperties").filter(|a| a.is_object()) {
            walk(additional, &format!("{path}{{}}"), visit);
        }
    }

    #[test]
    fn schema_is_structural_and_not_nullable() {
        let mut problems = Vec::new();
        walk(&schema(), "", &mut |path, node| {
            let obj = node.as_object().unwrap();
            for forbidden in ["nullable", "$ref", "title", "oneOf", "allOf", "definitions"] {
                if obj.contains_key(forbidden) {
                    problems.push(format!("{path}: has {forbidden}"));
                }
            }
            let int_or_string = obj.get("x-kubernetes-int-or-string") == Some(&json!(true));
            if int_or_string {
                let ok_any_of = obj
                    .get("anyOf")
                    .is_none_or(|a| a == &json!([{"type": "integer"}, {"type": "string"}]));
                if obj.contains_key("type") || !ok_any_of {
                    problems.push(format!("{path}: malformed int-or-string"));
                }
            } else if !obj.contains_key("type")
                && obj.get("x-kubernetes-preserve-unknown-fields") != Some(&json!(true))
            {
                problems.push(format!("{path}: no type"));
            } else if obj.contains_key("anyOf") {
                problems.push(format!("{path}: anyOf outside int-or-string"));
            }
            if obj.contains_key("properties") && obj.get("type") != Some(&json!("object")) {
                problems.push(format!("{path}: properties on a non-object"));
            }
        });
        assert!(problems.is_empty(), "{problems:#?}");
    }

    #[test]
    fn field_names_are_camel_case_like_nvidias() {
        let mut snake = Vec::new();
        walk(
            &schema()["properties"]["spec"],
            ".spec",
            &mut |path, node| {
                for name in node
                    .get("properties")
                    .and_then(Value::as_object)
                    .into_iter()
                    .flat_map(|p| p.keys())
                {
                    // NVIDIA's one snake_case field, kept for compatibility.
                    if name.contains('_') && name != "use_ocp_driver_toolkit" {
                        snake.push(format!("{path}.{name}"));
                    }
                }
            },
        );
        assert!(snake.is_empty(), "{snake:?}");
    }

    #[test]
    fn every_field_has_a_description_for_kubectl_explain() {
        let mut missing = Vec::new();
        walk(
            &schema()["properties"]["spec"],
            ".spec",
            &mut |path, node| {
                if let Some(props) = node.get("properties").and_then(Value::as_object) {
                    for (name, child) in props {
                        let described = child
                            .get("description")
                            .and_then(Value::as_str)
                            .is_some_and(|d| !d.trim().is_empty());
                        if !described {
                            missing.push(format!("{path}.{name}"));
                        }
                    }
                }
            },
        );
        walk(
            &schema()["properties"]["status"],
            ".status",
            &mut |path, node| {
                if let Some(props) = node.get("properties").and_then(Value::as_object) {
                    for (name, child) in props {
                        if child.get("description").is_none() {
                            missing.push(format!("{path}.{name}"));
                        }
                    }
                }
            },
        );
        assert!(
            missing.is_empty(),
            "fields without description: {missing:#?}"
        );
    }

    #[test]
    fn cel_rules_have_messages_and_bounded_inputs() {
        let mut rules = 0;
        let mut problems = Vec::new();
        walk(&schema(), "", &mut |path, node| {
            let Some(validations) = node
                .get("x-kubernetes-validations")
                .and_then(Value::as_array)
            else {
                return;
            };
            for rule in validations {
                rules += 1;
                let message = rule["message"].as_str().unwrap_or_default();
                let leaf = path
                    .rsplit('.')
                    .next()
                    .unwrap_or_default()
                    .trim_end_matches("[]");
                if !message.contains(leaf) {
                    problems.push(format!("{path}: message does not name {leaf}: {message}"));
                }
            }
            match node.get("type").and_then(Value::as_str) {
                Some("array") if node.get("maxItems").is_none() => {
                    problems.push(format!("{path}: list in a CEL rule without maxItems"));
                }
                Some("object") | Some("array") => {}
                _ if node.get("maxLength").is_none() => {
                    problems.push(format!("{path}: string in a CEL rule without maxLength"));
                }
                _ => {}
            }
        });
        assert!(
            rules >= 4,
            "expected the CEL rules of the API, found {rules}"
        );
        assert!(problems.is_empty(), "{problems:#?}");
    }

    /// The schema's `default:` markers are exactly NVIDIA's, so a read-back differs from what
    /// was written only where NVIDIA's API server would differ too.
    #[test]
    fn server_side_defaults_are_exactly_nvidias() {
        let mut defaults = BTreeSet::new();
        walk(&schema(), "", &mut |path, node| {
            if let Some(default) = node.get("default") {
                defaults.insert(format!("{path}={default}"));
            }
        });
        let expected: BTreeSet<String> = [
            ".spec.cdi.default=false",
            ".spec.cdi.enabled=true",
            ".spec.cdi.nriPluginEnabled=false",
            ".spec.daemonsets.updateStrategy=\"RollingUpdate\"",
            ".spec.dcgmExporter.serviceMonitor.relabelings[].action=\"replace\"",
            ".spec.devicePlugin.mps.root=\"/run/nvidia/mps\"",
            ".spec.driver.kernelModuleType=\"auto\"",
            ".spec.driver.upgradePolicy.autoUpgrade=false",
            ".spec.driver.upgradePolicy.drain.deleteEmptyDir=false",
            ".spec.driver.upgradePolicy.drain.enable=false",
            ".spec.driver.upgradePolicy.drain.force=false",
            ".spec.driver.upgradePolicy.drain.timeoutSeconds=300",
            ".spec.driver.upgradePolicy.maxParallelUpgrades=1",
            ".spec.driver.upgradePolicy.maxUnavailable=\"25%\"",
            ".spec.driver.upgradePolicy.podDeletion.deleteEmptyDir=false",
            ".spec.driver.upgradePolicy.podDeletion.force=false",
            ".spec.driver.upgradePolicy.podDeletion.timeoutSeconds=300",
            ".spec.driver.upgradePolicy.waitForCompletion.timeoutSeconds=0",
            ".spec.hostPaths.kubeletRootDir=\"/var/lib/kubelet\"",
            ".spec.kataManager.config.artifactsDir=\"/opt/nvidia-gpu-operator/artifacts/runtimeclasses\"",
            ".spec.migManager.config.default=\"all-disabled\"",
            ".spec.operator.metrics.serviceMonitor.relabelings[].action=\"replace\"",
            ".spec.operator.runtimeClass=\"nvidia\"",
            ".spec.sandboxWorkloads.defaultWorkload=\"container\"",
            ".spec.sandboxWorkloads.mode=\"kubevirt\"",
            ".spec.toolkit.installDir=\"/usr/local/nvidia\"",
            ".spec.vgpuDeviceManager.config.default=\"default\"",
        ]
        .into_iter()
        .map(String::from)
        .collect();
        assert_eq!(defaults, expected);
    }

    #[test]
    fn enums_accept_every_value_nvidia_accepts() {
        let schema = schema();
        let spec = &schema["properties"]["spec"]["properties"];
        let enum_of = |node: &Value| -> Vec<String> {
            node["enum"]
                .as_array()
                .unwrap_or_else(|| panic!("no enum in {node}"))
                .iter()
                .map(|v| v.as_str().unwrap().to_owned())
                .collect()
        };
        let cases: [(&Value, &[&str]); 7] = [
            (
                &spec["daemonsets"]["properties"]["updateStrategy"],
                &["RollingUpdate", "OnDelete"],
            ),
            (
                &spec["driver"]["properties"]["kernelModuleType"],
                &["auto", "open", "proprietary"],
            ),
            (
                &spec["mig"]["properties"]["strategy"],
                &["none", "single", "mixed"],
            ),
            (
                &spec["migManager"]["properties"]["config"]["properties"]["default"],
                &["all-disabled", ""],
            ),
            (
                &spec["sandboxWorkloads"]["properties"]["defaultWorkload"],
                &["container", "vm-passthrough", "vm-vgpu"],
            ),
            (
                &spec["ccManager"]["properties"]["defaultMode"],
                &["on", "off", "devtools"],
            ),
            (
                &schema["properties"]["status"]["properties"]["state"],
                &["ignored", "ready", "notReady"],
            ),
        ];
        for (node, nvidia) in cases {
            let ours = enum_of(node);
            for value in nvidia {
                assert!(
                    ours.iter().any(|v| v == value),
                    "{value} missing from {ours:?}"
                );
            }
        }
        // Free-form strings in NVIDIA's CRD stay free-form here.
        for field in ["imagePullPolicy", "repository", "version"] {
            assert!(
                spec["driver"]["properties"][field].get("enum").is_none(),
                "{field}"
            );
        }
    }

    #[test]
    fn crd_is_cluster_scoped_with_status_and_printer_columns() {
        let crd = crd();
        assert_eq!(
            crd.metadata.name.as_deref(),
            Some("clusterpolicies.nvidia.com")
        );
        assert_eq!(crd.spec.scope, "Cluster");
        assert_eq!(crd.spec.names.kind, "ClusterPolicy");
        assert_eq!(crd.spec.names.singular.as_deref(), Some("clusterpolicy"));
        let version = &crd.spec.versions[0];
        assert_eq!(version.name, "v1");
        assert!(version.subresources.as_ref().unwrap().status.is_some());
        let columns: Vec<(String, String)> = version
            .additional_printer_columns
            .iter()
            .flatten()
            .map(|c| (c.name.clone(), c.json_path.clone()))
            .collect();
        assert_eq!(
            columns,
            [
                ("Status".to_owned(), ".status.state".to_owned()),
                ("GPU Nodes".to_owned(), ".status.gpuNodes".to_owned()),
                ("Operands".to_owned(), ".status.operandsReady".to_owned()),
                (
                    "Reason".to_owned(),
                    r#".status.conditions[?(@.type=="Ready")].reason"#.to_owned()
                ),
                ("Age".to_owned(), ".metadata.creationTimestamp".to_owned())
            ]
        );
    }

    #[test]
    fn status_lists_are_maps_keyed_like_nvidia_clients_expect() {
        let schema = schema();
        let status = &schema["properties"]["status"]["properties"];
        assert_eq!(status["conditions"]["x-kubernetes-list-type"], "map");
        assert_eq!(
            status["conditions"]["x-kubernetes-list-map-keys"],
            json!(["type"])
        );
        assert!(
            status["conditions"]["items"]["properties"]
                .get("observedGeneration")
                .is_some()
        );
        assert_eq!(
            status["components"]["x-kubernetes-list-map-keys"],
            json!(["name"])
        );
        assert_eq!(schema["properties"]["status"]["required"], json!(["state"]));
    }
}
