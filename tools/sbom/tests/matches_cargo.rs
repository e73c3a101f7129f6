//! The SBOM lists exactly what Cargo links into the operator binary, at Cargo.lock's versions
//! and checksums: checked against `cargo tree`, an independent reading of the same graph.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn host() -> String {
    let out = Command::new("rustc").arg("-vV").output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .unwrap()
}

fn metadata(target: &str) -> serde_json::Value {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = Command::new(cargo)
        .current_dir(root())
        .args([
            "metadata",
            "--format-version",
            "1",
            "--locked",
            "--filter-platform",
            target,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The SBOM comes from `cargo tree`; these checks read `cargo metadata` and Cargo.lock instead:
/// nothing listed that the workspace does not link for this target, nothing missing that a
/// listed package needs unconditionally (a non-optional normal dependency), every package at
/// Cargo.lock's version and checksum.
#[test]
fn sbom_components_are_the_binarys_dependencies_at_their_locked_checksums() {
    let target = host();
    let document = sbom::from_workspace(&root(), &target, "gpu-operator").unwrap();
    let lock =
        sbom::parse_lock(&std::fs::read_to_string(root().join("Cargo.lock")).unwrap()).unwrap();
    let metadata = metadata(&target);

    let top = &document["metadata"]["component"];
    assert_eq!(top["name"], "gpu-operator");
    let mut listed: BTreeSet<String> = document["components"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            format!(
                "{}@{}",
                c["name"].as_str().unwrap(),
                c["version"].as_str().unwrap()
            )
        })
        .collect();
    listed.insert(format!("gpu-operator@{}", top["version"].as_str().unwrap()));

    let packages: BTreeMap<&str, &serde_json::Value> = metadata["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["id"].as_str().unwrap(), p))
        .collect();
    let name_version = |id: &str| {
        let p = packages[id];
        format!(
            "{}@{}",
            p["name"].as_str().unwrap(),
            p["version"].as_str().unwrap()
        )
    };
    let linked: BTreeSet<String> = sbom::linked_packages(&metadata, "gpu-operator")
        .unwrap()
        .iter()
        .map(|id| name_version(id))
        .collect();
    let extra: Vec<_> = listed.difference(&linked).collect();
    assert!(
        extra.is_empty(),
        "listed but never linked for {target}: {extra:?}"
    );

    for node in metadata["resolve"]["nodes"].as_array().unwrap() {
        let id = node["id"].as_str().unwrap();
        if !listed.contains(&name_version(id)) {
            continue;
        }
        let manifest = packages[id]["dependencies"].as_array().unwrap();
        for dep in node["deps"].as_array().unwrap() {
            let child = packages[dep["pkg"].as_str().unwrap()];
            let required = manifest.iter().any(|d| {
                d["name"] == child["name"] && d["kind"].is_null() && d["optional"] == false
            });
            let normal = dep["dep_kinds"]
                .as_array()
                .unwrap()
                .iter()
                .any(|k| k["kind"].is_null());
            let child = name_version(dep["pkg"].as_str().unwrap());
            assert!(
                !(required && normal) || listed.contains(&child),
                "{} needs {child}, which the SBOM lacks",
                name_version(id)
            );
        }
    }

    for component in document["components"].as_array().unwrap() {
        let (name, version) = (
            component["name"].as_str().unwrap(),
            component["version"].as_str().unwrap(),
        );
        let locked = lock
            .iter()
            .find(|l| l.name == name && l.version == version)
            .unwrap_or_else(|| panic!("{name}@{version} is not in Cargo.lock"));
        match &locked.checksum {
            Some(sum) => assert_eq!(
                component["hashes"][0]["content"].as_str(),
                Some(sum.as_str()),
                "{name}"
            ),
            None => assert!(
                component.get("hashes").is_none(),
                "{name} is a workspace member"
            ),
        }
        assert!(
            component["licenses"][0]["expression"]
                .as_str()
                .is_some_and(|l| !l.contains('/')),
            "{name}"
        );
    }
}

#[test]
fn two_runs_write_the_same_document() {
    let a = sbom::from_workspace(&root(), &host(), "gpu-operator").unwrap();
    let b = sbom::from_workspace(&root(), &host(), "gpu-operator").unwrap();
    assert_eq!(a, b);
}
