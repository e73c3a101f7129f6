//! Everything `gpu-operator render` prints for every example is accepted by a real API server:
//! `kubectl apply --dry-run=server` runs schema validation, defaulting and admission (RBAC
//! escalation checks included) without persisting anything. Only the ClusterPolicy CRD (when
//! missing) and the `gpu-operator` namespace are created for real. ServiceMonitor and
//! SecurityContextConstraints objects are left out where their CRDs are not served.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use e2e::tools::repo_root;
use e2e::{connect, kubectl, wait};
use gpu_operator::api::ClusterPolicy;
use gpu_operator::facts::Runtime;
use gpu_operator::render::inputs::{RenderOptions, facts_for, render_yaml};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::wait::conditions;
use serde_json::Value;

const NAMESPACE: &str = "gpu-operator";
use e2e::crd::CLUSTER_POLICY_CRD as CRD;
const TIMEOUT: Duration = Duration::from_secs(60);

fn yaml_files(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with(prefix) && name.ends_with(".yaml")
        })
        .collect();
    files.sort();
    files
}

fn read<T: serde::de::DeserializeOwned>(path: &Path) -> T {
    serde_yaml_ng::from_str(&std::fs::read_to_string(path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Installs the ClusterPolicy CRD unless it is already served (others may be using it).
async fn ensure_crd(client: &Client) {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    if api.get_opt(CRD).await.unwrap().is_none() {
        let crd: CustomResourceDefinition =
            read(&repo_root().join("crds/nvidia.com_clusterpolicies.yaml"));
        api.patch(
            CRD,
            &PatchParams::apply("e2e-render-test").force(),
            &Patch::Apply(&crd),
        )
        .await
        .unwrap();
    }
    wait::for_object(
        api,
        CRD,
        TIMEOUT,
        "CRD established",
        conditions::is_crd_established(),
    )
    .await
    .unwrap();
}

async fn ensure_namespace(client: &Client) {
    let api: Api<Namespace> = Api::all(client.clone());
    if api.get_opt(NAMESPACE).await.unwrap().is_none() {
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(NAMESPACE.to_owned()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        api.create(&PostParams::default(), &ns).await.unwrap();
    }
}

async fn crd_served(client: &Client, name: &str) -> bool {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    api.get_opt(name).await.unwrap().is_some()
}

/// Drops the documents of kinds the cluster does not serve.
fn keep_served(yaml: &str, skip_kinds: &[&str]) -> (String, usize) {
    let mut out = String::new();
    let mut kept = 0;
    for document in yaml.split("\n---\n").flat_map(|d| d.split("---\n")) {
        let value: Value = match serde_yaml_ng::from_str(document) {
            Ok(v) => v,
            Err(_) => continue,
        };
        let Some(kind) = value["kind"].as_str() else {
            continue;
        };
        if skip_kinds.contains(&kind) {
            continue;
        }
        out.push_str("---\n");
        out.push_str(document.trim_end());
        out.push('\n');
        kept += 1;
    }
    (out, kept)
}

fn dry_run(yaml: &str) -> Result<String, String> {
    let mut child = kubectl()
        .args(["apply", "--dry-run=server", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("running kubectl: {e}"))?;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(yaml.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).into_owned())
    }
}

#[tokio::test]
async fn everything_render_prints_for_every_example_passes_server_side_dry_run() {
    let Some(client) = connect().await else {
        return;
    };
    ensure_crd(&client).await;
    ensure_namespace(&client).await;
    let mut skip = Vec::new();
    if !crd_served(&client, "servicemonitors.monitoring.coreos.com").await {
        skip.push("ServiceMonitor");
    }
    if !crd_served(&client, "securitycontextconstraints.security.openshift.io").await {
        skip.push("SecurityContextConstraints");
    }

    let config_map_files = yaml_files(&repo_root().join("examples/configmaps"), "");
    let config_maps: Vec<ConfigMap> = config_map_files.iter().map(|p| read(p)).collect();
    // The sample ConfigMaps themselves must be valid too.
    let samples: String = config_map_files
        .iter()
        .map(|p| format!("---\n{}", std::fs::read_to_string(p).unwrap()))
        .collect();
    dry_run(&samples).unwrap();

    let examples = yaml_files(&repo_root().join("examples"), "clusterpolicy-");
    assert!(examples.len() >= 6, "examples missing: {examples:?}");
    let base = RenderOptions {
        namespace: NAMESPACE.to_owned(),
        os_tag: Some("ubuntu22.04".to_owned()),
        config_maps,
        ..RenderOptions::default()
    };
    let variants = [
        ("containerd", base.clone()),
        (
            "docker",
            RenderOptions {
                runtime: Some(Runtime::Docker),
                ..base.clone()
            },
        ),
        (
            "openshift with ServiceMonitor API",
            RenderOptions {
                openshift: true,
                service_monitor_api: true,
                os_tag: Some("rhcos4.16".to_owned()),
                ..base.clone()
            },
        ),
    ];
    let mut failures = Vec::new();
    let mut applied = 0;
    for path in &examples {
        let policy: ClusterPolicy = read(path);
        for (variant, options) in &variants {
            let facts = facts_for(&policy, options).unwrap();
            let yaml = render_yaml(&policy, &facts).unwrap();
            assert!(
                !yaml.starts_with('#'),
                "{}: an operand is invalid:\n{yaml}",
                path.display()
            );
            let (yaml, kept) = keep_served(&yaml, &skip);
            assert!(
                kept > 20,
                "{} [{variant}]: only {kept} objects",
                path.display()
            );
            match dry_run(&yaml) {
                Ok(out) => applied += out.lines().count(),
                Err(e) => failures.push(format!("{} [{variant}]: {e}", path.display())),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "dry-run rejected:\n{}",
        failures.join("\n")
    );
    assert!(applied > 100, "kubectl reported only {applied} objects");
}
