//! The OLM bundle (`bundle/`) holds generated copies: the ClusterPolicy CRD, the operator's
//! RBAC in the CSV (decision 13), the image variables and `relatedImages`, `alm-examples` from
//! `examples/`. These tests fail when a copy drifts from what the operator prints and the
//! bundle generator writes; `cargo xtask generate` regenerates them. The CSV's Deployment is the
//! Helm chart's, rendered by helm: that step is checked by `cargo xtask check` and
//! `tests/e2e/tests/olm.rs`, where helm is at hand; here the Deployment is taken from the
//! committed CSV and everything else is regenerated around it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use clap::Parser as _;
use gpu_operator::cli::Cli;
use serde_json::Value;
use xtask::bundle::{self, CRD_FILE, CSV_FILE};

const FIX: &str = "regenerate the bundle with `cargo xtask generate` and review the diff";

fn repo_path(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
}

fn repo_file(path: &str) -> String {
    let path = repo_path(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// What `gpu-operator <args>` prints, run in this process.
fn run(args: &[&str]) -> String {
    let cli = Cli::try_parse_from(std::iter::once("gpu-operator").chain(args.iter().copied()))
        .unwrap_or_else(|e| panic!("gpu-operator {args:?}: {e}"));
    let mut out = Vec::new();
    cli.run(&mut out)
        .unwrap_or_else(|e| panic!("gpu-operator {args:?} failed: {e:#}"));
    String::from_utf8(out).unwrap()
}

fn committed_csv() -> Value {
    serde_yaml_ng::from_str(&repo_file(&format!("bundle/{CSV_FILE}"))).unwrap()
}

#[test]
fn the_bundles_crd_is_the_generated_one() {
    assert!(
        repo_file(&format!("bundle/{CRD_FILE}")) == run(&["crd"]),
        "bundle/{CRD_FILE} differs from `gpu-operator crd`: {FIX}"
    );
}

/// The document of `kind` that `gpu-operator rbac` prints.
fn rbac_document(kind: &str, name: &str) -> Value {
    let output = run(&["rbac"]);
    output
        .split("---\n")
        .map(|doc| serde_yaml_ng::from_str::<Value>(doc).unwrap())
        .find(|doc| doc["kind"] == kind && doc["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("`gpu-operator rbac` printed no {kind} {name}"))
}

#[test]
fn the_csv_grants_exactly_the_generated_cluster_role_less_writing_crds_and_the_role() {
    let role = rbac_document("ClusterRole", "gpu-operator");
    // Under OLM the bundle's CRDs are installed by OLM: the operator only reads CRDs.
    let mut role_rules: Vec<Value> = role["rules"].as_array().unwrap().clone();
    for rule in &mut role_rules {
        if rule["resources"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r == "customresourcedefinitions")
        {
            rule["verbs"]
                .as_array_mut()
                .unwrap()
                .retain(|v| ["get", "list", "watch"].contains(&v.as_str().unwrap()));
        }
    }
    role_rules.retain(|r| !r["verbs"].as_array().unwrap().is_empty());
    let csv = committed_csv();
    let permissions = &csv["spec"]["install"]["spec"]["clusterPermissions"];
    assert_eq!(
        permissions.as_array().map(Vec::len),
        Some(1),
        "one ServiceAccount's permissions"
    );
    assert_eq!(permissions[0]["serviceAccountName"], "gpu-operator");
    assert!(
        permissions[0]["rules"] == Value::Array(role_rules),
        "the CSV's clusterPermissions differ from `gpu-operator rbac` less writing CRDs: {FIX}"
    );
    // The operator namespace's Role and the leader-election Role are the CSV's
    // `permissions`, which OLM grants in the install namespace (where the Lease then lives).
    let namespaced = &csv["spec"]["install"]["spec"]["permissions"];
    assert_eq!(namespaced.as_array().map(Vec::len), Some(2));
    for (i, role) in ["gpu-operator", "gpu-operator-leader-election"]
        .into_iter()
        .enumerate()
    {
        assert_eq!(namespaced[i]["serviceAccountName"], "gpu-operator");
        assert!(
            namespaced[i]["rules"] == rbac_document("Role", role)["rules"],
            "the CSV's permissions differ from the Role {role} of `gpu-operator rbac`: {FIX}"
        );
    }
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
        "bundle/ holds a file the bundle generator does not write (OLM would ship it): remove it (`cargo xtask generate` does), or generate it"
    );
}

#[test]
fn the_bundle_regenerates_unchanged_around_its_deployment() {
    let deployment = bundle::deployment_of_csv(&committed_csv()).unwrap();
    let fresh = bundle::files(deployment).unwrap();
    let committed = bundle::read_files(&repo_path("bundle"));
    assert_eq!(
        fresh.iter().map(|f| f.path).collect::<Vec<_>>(),
        committed.iter().map(|(path, _)| *path).collect::<Vec<_>>(),
        "read_files lists the files `files` writes"
    );
    for (fresh, (path, committed)) in fresh.iter().zip(&committed) {
        assert!(committed.is_some(), "bundle/{path} is missing: {FIX}");
        assert!(
            Some(&fresh.content) == committed.as_ref(),
            "bundle/{path} differs from a fresh bundle: {FIX}"
        );
    }
}

/// `registry/path` of a reference, without tag or digest.
fn repository(reference: &str) -> &str {
    let name = reference.split('@').next().unwrap_or(reference);
    match name.rsplit_once(':') {
        Some((repo, tag)) if !tag.contains('/') => repo,
        _ => name,
    }
}

/// Images as (where, reference).
type Placed = Vec<(String, String)>;

/// Every image the CSV names: its Deployments' containers and `*_IMAGE` variables, and
/// `relatedImages`, as (where, reference).
fn csv_images(csv: &Value) -> (Placed, Placed) {
    let mut deployment = Vec::new();
    for d in csv["spec"]["install"]["spec"]["deployments"]
        .as_array()
        .unwrap()
    {
        for c in d["spec"]["template"]["spec"]["containers"]
            .as_array()
            .unwrap()
        {
            let name = c["name"].as_str().unwrap();
            deployment.push((
                format!("container {name}"),
                c["image"].as_str().unwrap().to_owned(),
            ));
            for e in c["env"].as_array().into_iter().flatten() {
                let var = e["name"].as_str().unwrap();
                if let Some(value) = e["value"].as_str().filter(|_| var.ends_with("_IMAGE")) {
                    deployment.push((format!("{name} env {var}"), value.to_owned()));
                }
            }
        }
    }
    let related = csv["spec"]["relatedImages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                format!("relatedImages {}", r["name"].as_str().unwrap()),
                r["image"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    (deployment, related)
}

/// Problems with the images of a CSV: an image the Deployment runs or names that
/// relatedImages lacks (a mirror would not copy it), a related image nothing uses, one
/// repository named by two references, or a known digest left out.
fn image_problems(csv: &Value) -> Vec<String> {
    let facts = bundle::digest_facts().unwrap();
    let (deployment, related) = csv_images(csv);
    let mut problems = Vec::new();
    for (place, image) in &deployment {
        if !related.iter().any(|(_, r)| r == image) {
            problems.push(format!("{place} {image} is not in relatedImages"));
        }
    }
    for (place, image) in &related {
        if !deployment.iter().any(|(_, d)| d == image) {
            problems.push(format!(
                "{place} {image} is named by no container or variable"
            ));
        }
    }
    let all: Vec<&(String, String)> = deployment.iter().chain(&related).collect();
    for (place, image) in &all {
        if let Some((other_place, other)) = all
            .iter()
            .find(|(_, o)| repository(o) == repository(image) && o != image)
        {
            problems.push(format!(
                "{} is pinned two ways: {place} {image}, {other_place} {other}",
                repository(image)
            ));
        }
        let tagged = image.split('@').next().unwrap();
        if let Some(fact) = facts.iter().find(|f| f.tagged() == tagged)
            && let Some(digest) = &fact.digest
            && !image.ends_with(&format!("@{digest}"))
        {
            problems.push(format!(
                "{place} {image} lacks the digest {digest} of scripts/image-digests.yaml"
            ));
        }
    }
    problems
}

#[test]
fn every_image_is_in_related_images_and_pinned_one_way_by_its_known_digest() {
    let csv = committed_csv();
    let problems = image_problems(&csv);
    assert!(problems.is_empty(), "{problems:#?}\n{FIX}");
    // At least the digests found in NVIDIA's CSV are in use.
    let (_, related) = csv_images(&csv);
    let pinned = related
        .iter()
        .filter(|(_, r)| r.contains("@sha256:"))
        .count();
    assert!(pinned >= 5, "only {pinned} images pinned by digest");
}

#[test]
fn the_image_check_finds_a_missing_related_image_and_a_second_pinning() {
    let mut csv = committed_csv();
    let related = csv["spec"]["relatedImages"].as_array_mut().unwrap();
    let dropped = related.remove(related.len() - 1);
    let problems = image_problems(&csv);
    assert!(
        problems
            .iter()
            .any(|p| p.contains(dropped["image"].as_str().unwrap())
                && p.contains("not in relatedImages")),
        "{problems:?}"
    );

    let mut csv = committed_csv();
    let related = csv["spec"]["relatedImages"].as_array_mut().unwrap();
    let device_plugin = related
        .iter_mut()
        .find(|r| r["name"] == "device-plugin-image")
        .unwrap();
    device_plugin["image"] = "nvcr.io/nvidia/k8s-device-plugin:v0.20.0".into();
    let problems = image_problems(&csv);
    assert!(
        problems.iter().any(|p| p.contains("pinned two ways")),
        "{problems:?}"
    );
    assert!(
        problems.iter().any(|p| p.contains("lacks the digest")),
        "{problems:?}"
    );
}
