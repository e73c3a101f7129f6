//! The OLM bundle (`bundle/`) holds generated copies: the ClusterPolicy CRD, the operator's
//! RBAC in the CSV (decision 13), the image variables and `relatedImages`, `alm-examples` from
//! `examples/`. These tests fail when a copy drifts from what this binary writes; `make bundle`
//! regenerates them. The CSV's Deployment is the Helm chart's, rendered by helm: that step is
//! checked by `tests/e2e/tests/olm.rs`, where helm is on PATH; here the Deployment is taken from
//! the committed CSV and everything else is regenerated around it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::Command;

use gpu_operator::cli::bundle::{self, CRD_FILE, CSV_FILE};
use serde_json::Value;

const FIX: &str = "regenerate the bundle with `make bundle` and review the diff";

fn repo_path(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
}

fn repo_file(path: &str) -> String {
    let path = repo_path(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn run(args: &[&std::ffi::OsStr]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-operator"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "gpu-operator {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn committed_csv() -> Value {
    serde_yaml_ng::from_str(&repo_file(&format!("bundle/{CSV_FILE}"))).unwrap()
}

#[test]
fn the_bundles_crd_is_the_generated_one() {
    assert!(
        repo_file(&format!("bundle/{CRD_FILE}")) == run(&["crd".as_ref()]),
        "bundle/{CRD_FILE} differs from `gpu-operator crd`: {FIX}"
    );
}

#[test]
fn the_csv_grants_exactly_the_generated_cluster_role() {
    let role: Value = serde_yaml_ng::from_str(&run(&["rbac".as_ref()])).unwrap();
    let csv = committed_csv();
    let permissions = &csv["spec"]["install"]["spec"]["clusterPermissions"];
    assert_eq!(
        permissions.as_array().map(Vec::len),
        Some(1),
        "one ServiceAccount's permissions"
    );
    assert_eq!(permissions[0]["serviceAccountName"], "gpu-operator");
    assert!(
        permissions[0]["rules"] == role["rules"],
        "the CSV's clusterPermissions differ from `gpu-operator rbac`: {FIX}"
    );
    let pod = &csv["spec"]["install"]["spec"]["deployments"][0]["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "gpu-operator");
}

/// Every file under `dir`, relative to it.
fn files_under(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(current) = stack.pop() {
        for entry in std::fs::read_dir(&current).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let relative = path.strip_prefix(dir).unwrap();
                out.push(relative.to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    out
}

#[test]
fn the_bundle_holds_only_generated_files() {
    let mut generated: Vec<String> = bundle::read_files(&repo_path("bundle"))
        .into_iter()
        .map(|(path, _)| path.to_owned())
        .collect();
    generated.sort();
    assert_eq!(
        files_under(&repo_path("bundle")),
        generated,
        "bundle/ holds a file `gpu-operator bundle` does not write (OLM would ship it): remove it, or generate it"
    );
}

#[test]
fn the_bundle_regenerates_unchanged_around_its_deployment() {
    let deployment = bundle::deployment_of_csv(&committed_csv()).unwrap();
    let work =
        std::env::temp_dir().join(format!("gpu-operator-bundle-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let input = work.join("deployment.yaml");
    std::fs::write(&input, serde_yaml_ng::to_string(&deployment).unwrap()).unwrap();
    let output = work.join("bundle");
    run(&[
        "bundle".as_ref(),
        "--deployment".as_ref(),
        input.as_os_str(),
        "--output".as_ref(),
        output.as_os_str(),
    ]);
    let fresh = bundle::read_files(&output);
    let committed = bundle::read_files(&repo_path("bundle"));
    std::fs::remove_dir_all(&work).unwrap();
    for ((path, fresh), (_, committed)) in fresh.iter().zip(&committed) {
        assert!(fresh.is_some(), "gpu-operator bundle wrote no {path}");
        assert!(committed.is_some(), "bundle/{path} is missing: {FIX}");
        assert!(
            fresh == committed,
            "bundle/{path} differs from a fresh bundle: {FIX}"
        );
    }
}
