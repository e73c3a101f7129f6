//! Tests over the example policies in `examples/`: nothing is lost client-side, and the maximal
//! example really sets every field of the schema.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde_json::Value;

use super::{ClusterPolicy, Component, crd};

fn examples_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

/// Every `examples/clusterpolicy-*.yaml`, parsed to JSON, with its file name.
fn examples() -> Vec<(String, Value)> {
    let mut found: Vec<_> = std::fs::read_dir(examples_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with("clusterpolicy-") && name.ends_with(".yaml")
        })
        .collect();
    found.sort();
    found
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).unwrap();
            let value: Value = serde_yaml_ng::from_str(&text)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            (
                path.file_name().unwrap().to_string_lossy().into_owned(),
                value,
            )
        })
        .collect()
}

#[test]
fn every_example_round_trips_through_the_rust_types_unchanged() {
    let examples = examples();
    assert!(
        examples.len() >= 5,
        "expected the examples, found {}",
        examples.len()
    );
    for (name, written) in examples {
        let policy: ClusterPolicy = serde_json::from_value(written.clone())
            .unwrap_or_else(|e| panic!("{name} does not deserialize: {e}"));
        let read = serde_json::to_value(&policy).unwrap();
        assert_eq!(
            read, written,
            "{name} changes when it passes through the Rust types"
        );
    }
}

/// Paths of the schema under `.spec` (`.driver.env[].name`), not descending into Kubernetes'
/// own types or free-form objects.
fn schema_paths(node: &Value, path: &str, out: &mut BTreeSet<String>) {
    let Some(props) = node.get("properties").and_then(Value::as_object) else {
        return;
    };
    for (name, child) in props {
        let child_path = format!("{path}.{name}");
        out.insert(child_path.clone());
        if matches!(
            name.as_str(),
            "tolerations" | "podSecurityContext" | "affinity"
        ) {
            continue;
        }
        schema_paths(child, &child_path, out);
        if let Some(items) = child.get("items") {
            schema_paths(items, &format!("{child_path}[]"), out);
        }
    }
}

fn value_paths(value: &Value, path: &str, out: &mut BTreeSet<String>) {
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                let child_path = format!("{path}.{key}");
                out.insert(child_path.clone());
                value_paths(child, &child_path, out);
            }
        }
        Value::Array(items) => {
            for item in items {
                value_paths(item, &format!("{path}[]"), out);
            }
        }
        _ => {}
    }
}

#[test]
fn maximal_example_sets_every_field_of_the_schema() {
    let crd = serde_json::to_value(crd::crd()).unwrap();
    let spec_schema =
        &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
    let mut wanted = BTreeSet::new();
    schema_paths(spec_schema, "", &mut wanted);

    let (_, maximal) = examples()
        .into_iter()
        .find(|(name, _)| name == "clusterpolicy-maximal.yaml")
        .unwrap();
    let mut present = BTreeSet::new();
    value_paths(&maximal["spec"], "", &mut present);

    let missing: Vec<_> = wanted.difference(&present).collect();
    assert!(
        missing.is_empty(),
        "clusterpolicy-maximal.yaml lacks {missing:#?}"
    );
}

#[test]
fn maximal_example_names_every_component_section() {
    let (_, maximal) = examples()
        .into_iter()
        .find(|(name, _)| name == "clusterpolicy-maximal.yaml")
        .unwrap();
    for component in Component::ALL {
        assert!(
            maximal["spec"].get(component.spec_key()).is_some(),
            "{component} missing"
        );
    }
}
