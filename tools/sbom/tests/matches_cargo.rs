//! The SBOM lists exactly what Cargo links into the operator binary, at Cargo.lock's versions
//! and checksums: checked against `cargo tree`, an independent reading of the same graph.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
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

/// `name@version` of every package `cargo tree` shows for the binary's normal dependencies.
fn cargo_tree(target: &str) -> BTreeSet<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = Command::new(cargo)
        .current_dir(root())
        .args([
            "tree",
            "--locked",
            "-p",
            "gpu-operator",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .args(["--target", target, "-f", "{p}"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let name = words.next()?;
            let version = words.next()?.strip_prefix('v')?;
            Some(format!("{name}@{version}"))
        })
        .collect()
}

#[test]
fn sbom_components_are_the_binarys_dependencies_at_their_locked_checksums() {
    let target = host();
    let document = sbom::from_workspace(&root(), &target, "gpu-operator").unwrap();
    let lock =
        sbom::parse_lock(&std::fs::read_to_string(root().join("Cargo.lock")).unwrap()).unwrap();

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
    let top = &document["metadata"]["component"];
    assert_eq!(top["name"], "gpu-operator");
    listed.insert(format!("gpu-operator@{}", top["version"].as_str().unwrap()));
    assert_eq!(listed, cargo_tree(&target), "SBOM vs cargo tree");

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
