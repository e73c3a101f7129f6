//! Installing the ClusterPolicy CRD from `crds/` the same way in every test binary.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::wait::conditions;

use crate::wait;

/// The CRD's name as the API server knows it.
pub const CLUSTER_POLICY_CRD: &str = gpu_operator::api::crd::CRD_NAME;

/// `crds/nvidia.com_clusterpolicies.yaml` in this checkout.
pub fn cluster_policy_crd_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../crds/nvidia.com_clusterpolicies.yaml")
}

/// The CRD as committed.
pub fn cluster_policy_crd() -> Result<CustomResourceDefinition> {
    let path = cluster_policy_crd_path();
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_yaml_ng::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// Applies the committed CRD server-side as `field_manager` and waits until it is established.
///
/// Waits by watching the object rather than with `kubectl wait`: right after creation the CRD
/// has no `status.conditions` at all, which `kubectl wait --for condition=...` reports as an
/// error instead of waiting.
pub async fn install_cluster_policy_crd(client: &Client, field_manager: &str) -> Result<()> {
    let crd = cluster_policy_crd()?;
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    api.patch(
        CLUSTER_POLICY_CRD,
        &PatchParams::apply(field_manager).force(),
        &Patch::Apply(&crd),
    )
    .await
    .with_context(|| format!("applying {}", cluster_policy_crd_path().display()))?;
    wait::for_object(
        api,
        CLUSTER_POLICY_CRD,
        Duration::from_secs(60),
        "CRD established",
        conditions::is_crd_established(),
    )
    .await?;
    Ok(())
}

/// Waits until CRD `name` is established.
pub async fn await_established(client: &Client, name: &str) -> Result<CustomResourceDefinition> {
    wait::for_object(
        Api::all(client.clone()),
        name,
        Duration::from_secs(60),
        "CRD established",
        conditions::is_crd_established(),
    )
    .await
}

/// Applies the NVIDIADriver CRD generated from the operator's types and waits until it is
/// established (the operator watches NVIDIADrivers only when it finds the CRD at start-up).
pub async fn install_nvidia_driver_crd(client: &Client, field_manager: &str) -> Result<()> {
    let crd = gpu_operator::api::nvidia_driver_crd::crd();
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    api.patch(
        gpu_operator::api::nvidia_driver_crd::CRD_NAME,
        &PatchParams::apply(field_manager).force(),
        &Patch::Apply(&crd),
    )
    .await
    .context("applying the NVIDIADriver CRD")?;
    await_established(client, gpu_operator::api::nvidia_driver_crd::CRD_NAME).await?;
    Ok(())
}

/// A CRD (of an API the harness does not serve, such as the Prometheus Operator's or
/// OpenShift's) that one test installs and that is removed again when this is dropped,
/// whatever happens, with the namespaces named by [`Self::also_removing`]: the other suites
/// expect a cluster without that API.
pub struct TemporaryCrd {
    name: String,
    namespaces: Vec<String>,
}

impl TemporaryCrd {
    /// Applies `file` (the CRD, and any objects beside it) server-side and waits until CRD
    /// `name` is established.
    pub fn apply(file: &std::path::Path, name: &str) -> Result<Self> {
        // Built first, so that a failure below still removes what was applied.
        let crd = TemporaryCrd {
            name: name.to_owned(),
            namespaces: Vec::new(),
        };
        let path = file.to_str().context("a CRD file path that is not UTF-8")?;
        crate::cluster::kubectl_output(&["apply", "--server-side", "-f", path])?;
        crate::cluster::kubectl_output(&[
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            &format!("crd/{name}"),
        ])?;
        Ok(crd)
    }

    /// Deletes namespace `namespace` too when dropped.
    pub fn also_removing(mut self, namespace: &str) -> Self {
        self.namespaces.push(namespace.to_owned());
        self
    }
}

impl Drop for TemporaryCrd {
    fn drop(&mut self) {
        let crd = [
            "delete",
            "crd",
            &self.name,
            "--ignore-not-found",
            "--timeout=60s",
        ];
        if let Err(e) = crate::cluster::kubectl_output(&crd) {
            eprintln!("deleting CRD {}: {e}", self.name);
        }
        for namespace in &self.namespaces {
            // Waited for: the next test may create the namespace again, which a terminating
            // namespace refuses.
            let args = [
                "delete",
                "namespace",
                namespace,
                "--ignore-not-found",
                "--timeout=120s",
            ];
            if let Err(e) = crate::cluster::kubectl_output(&args) {
                eprintln!("deleting namespace {namespace}: {e}");
            }
        }
    }
}
