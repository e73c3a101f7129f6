//! CRD generation for GPUCluster (pure), tidied like ClusterPolicy's ([`super::crd`]), with
//! NVIDIA's singleton rule. The committed copy in `crds/` is checked against it by a test.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, ValidationRule,
};
use kube_core::CustomResourceExt;

use super::crd::{quote_yaml11_booleans, tidy};
use super::{GPU_CLUSTER_NAME, GPUCluster};

/// Name of the GPUCluster CRD.
pub const CRD_NAME: &str = "gpuclusters.nvidia.com";
/// Where the generated CRD is committed, relative to the repository root.
pub const CRD_PATH: &str = "crds/nvidia.com_gpuclusters.yaml";
/// The command that regenerates [`CRD_PATH`].
pub const REGENERATE_COMMAND: &str =
    "cargo run -p gpu-operator -- crd --gpu-cluster > crds/nvidia.com_gpuclusters.yaml";

/// The GPUCluster CustomResourceDefinition as it is installed.
pub fn crd() -> CustomResourceDefinition {
    let mut crd = GPUCluster::crd();
    for version in &mut crd.spec.versions {
        if let Some(schema) = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        {
            tidy(schema);
            schema.x_kubernetes_validations = Some(vec![ValidationRule {
                rule: format!("self.metadata.name == '{GPU_CLUSTER_NAME}'"),
                message: Some(format!(
                    "GPUCluster is a singleton, metadata.name must be '{GPU_CLUSTER_NAME}'"
                )),
                ..ValidationRule::default()
            }]);
        }
    }
    crd
}

/// [`crd()`] as YAML with a header; what `gpu-operator crd --gpu-cluster` prints.
pub fn crd_yaml() -> Result<String, serde_yaml_ng::Error> {
    let body = quote_yaml11_booleans(&serde_yaml_ng::to_string(&crd())?);
    Ok(format!(
        "# Generated from the Rust types in operator/src/api; do not edit.\n\
         # Regenerate with: {REGENERATE_COMMAND}\n{body}"
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn committed_gpu_cluster_crd_matches_the_types() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(CRD_PATH);
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == crd_yaml().unwrap(),
            "{CRD_PATH} is out of date; run `cargo xtask generate` (it also updates the chart's and the bundle's copies)"
        );
    }

    #[test]
    fn gpu_cluster_crd_is_cluster_scoped_v1alpha1_with_status_and_the_singleton_rule() {
        let crd = crd();
        assert_eq!(crd.spec.scope, "Cluster");
        assert_eq!(crd.metadata.name.as_deref(), Some(CRD_NAME));
        let version = &crd.spec.versions[0];
        assert_eq!(version.name, "v1alpha1");
        assert!(version.subresources.as_ref().unwrap().status.is_some());
        let schema = version
            .schema
            .as_ref()
            .unwrap()
            .open_api_v3_schema
            .as_ref()
            .unwrap();
        let rules = schema.x_kubernetes_validations.as_ref().unwrap();
        assert!(rules[0].rule.contains("gpu-cluster"));
        let spec = &schema.properties.as_ref().unwrap()["spec"];
        let names: Vec<&String> = spec.properties.as_ref().unwrap().keys().collect();
        for field in [
            "draDriver",
            "dcgm",
            "dcgmExporter",
            "hostPaths",
            "daemonsets",
            "deviceClasses",
        ] {
            assert!(
                names.iter().any(|n| *n == field),
                "{field} missing: {names:?}"
            );
        }
        assert_eq!(crd.spec.names.short_names, Some(vec!["gc".to_owned()]));
    }
}
