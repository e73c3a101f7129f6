//! Helm against the harness, shared by the chart's tests (tests/helm.rs) and those that install
//! the chart to test something else (tests/nfd_real.rs): helm from the harness PATH, the chart
//! of this clone, the operator image the OLM bundle names, and releases in labelled namespaces
//! that a later run cleans up. A failed step panics: this is test support, and the panic
//! message is the test's failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::tools::repo_root;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};
use kube::{Client, ResourceExt};
use serde_json::Value;

use crate::cluster::unique_name;

/// The release name the tests install the chart as.
pub const RELEASE: &str = "gpu-operator";
/// Label of the namespaces these tests install into, to find a failed run's leftovers.
pub const TEST_LABEL: &str = "gpu-operator.test/helm";

/// The chart folder, as helm takes it.
pub fn chart() -> String {
    repo_root()
        .join("charts/gpu-operator")
        .display()
        .to_string()
}

/// Owned copies of string literals, for argument lists.
pub fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| (*s).to_owned()).collect()
}

/// Runs helm from PATH (the harness env puts it there).
pub fn helm(args: &[String]) -> Output {
    Command::new("helm").args(args).output().unwrap_or_else(|e| {
        panic!(
            "running helm: {e}; put the harness's bin folder on PATH (`source $HARNESS_DIR/env`, or the folder tests/cluster/build.sh prints)"
        )
    })
}

/// Runs helm and returns its stdout, failing with its stderr.
pub fn helm_ok(args: &[String]) -> String {
    let out = helm(args);
    assert!(
        out.status.success(),
        "helm {} failed:\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The registry the committed OLM bundle names (scripts/bundle-values.yaml): installs set it,
/// as users must (docs/install.md), so the chart's Deployment names the bundle's image.
pub fn operator_repository() -> String {
    let path = repo_root().join("scripts/bundle-values.yaml");
    let values: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    values["operator"]["repository"]
        .as_str()
        .expect("scripts/bundle-values.yaml sets no operator.repository")
        .to_owned()
}

/// `--set operator.repository=...`: the image the OLM bundle names.
pub fn operator_image_args() -> Vec<String> {
    vec![
        "--set".into(),
        format!("operator.repository={}", operator_repository()),
    ]
}

/// A namespace for a release, labelled so a later run can clean it up.
pub async fn release_namespace(admin: &Client) -> String {
    let name = unique_name("helm");
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            labels: Some([(TEST_LABEL.to_owned(), "true".to_owned())].into()),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    };
    Api::<Namespace>::all(admin.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    name
}

/// `helm install|upgrade RELEASE chart -n ns ARGS --wait`, returning how long it took.
pub fn helm_release(verb: &str, namespace: &str, args: &[String]) -> Duration {
    let mut all = strings(&[verb, RELEASE]);
    all.push(chart());
    all.extend(strings(&[
        "--namespace",
        namespace,
        "--wait",
        "--timeout",
        "3m",
    ]));
    if verb == "install" {
        all.push("--create-namespace".into());
    }
    all.extend(operator_image_args());
    all.extend(args.iter().cloned());
    let started = Instant::now();
    helm_ok(&all);
    started.elapsed()
}

/// Uninstalls the releases an earlier run left in its labelled namespaces and deletes those.
pub async fn remove_releases(admin: &Client) {
    let namespaces = Api::<Namespace>::all(admin.clone());
    let labelled = ListParams::default().labels(&format!("{TEST_LABEL}=true"));
    for ns in namespaces.list_metadata(&labelled).await.unwrap().items {
        let name = ns.name_any();
        let _ = helm(&strings(&[
            "uninstall",
            RELEASE,
            "--namespace",
            &name,
            "--wait",
        ]));
        let _ = namespaces.delete(&name, &DeleteParams::default()).await;
    }
}
