//! CRD generation for NVIDIADriver (pure), tidied like ClusterPolicy's ([`super::crd`]). The
//! committed copy in `crds/` is checked against it by a test.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube_core::CustomResourceExt;

use super::NVIDIADriver;
use super::crd::{quote_yaml11_booleans, tidy};

/// Name of the NVIDIADriver CRD.
pub const CRD_NAME: &str = "nvidiadrivers.nvidia.com";
/// Where the generated CRD is committed, relative to the repository root.
pub const CRD_PATH: &str = "crds/nvidia.com_nvidiadrivers.yaml";
/// The command that regenerates [`CRD_PATH`].
pub const REGENERATE_COMMAND: &str =
    "cargo run -p gpu-operator -- crd --nvidia-driver > crds/nvidia.com_nvidiadrivers.yaml";

/// The NVIDIADriver CustomResourceDefinition as it is installed.
pub fn crd() -> CustomResourceDefinition {
    let mut crd = NVIDIADriver::crd();
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

/// [`crd()`] as YAML with a header; what `gpu-operator crd --nvidia-driver` prints.
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
    fn committed_nvidia_driver_crd_matches_the_types() {
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
    fn nvidia_driver_crd_is_cluster_scoped_v1alpha1_with_nvidias_fields_and_immutable_type() {
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
        let spec = &schema.properties.as_ref().unwrap()["spec"];
        let fields = spec.properties.as_ref().unwrap();
        for field in [
            "driverType",
            "usePrecompiled",
            "kernelModuleType",
            "repository",
            "image",
            "version",
            "imagePullPolicy",
            "imagePullSecrets",
            "manager",
            "resources",
            "args",
            "env",
            "startupProbe",
            "livenessProbe",
            "readinessProbe",
            "rdma",
            "gds",
            "gdrcopy",
            "repoConfig",
            "certConfig",
            "licensingConfig",
            "virtualTopologyConfig",
            "kernelModuleConfig",
            "secretEnv",
            "nodeSelector",
            "nodeAffinity",
            "labels",
            "annotations",
            "tolerations",
            "priorityClassName",
            "podSecurityContext",
            "upgradePolicy",
            "hostNetwork",
            "default",
        ] {
            assert!(fields.contains_key(field), "{field} missing");
        }
        let driver_type = &fields["driverType"];
        let rules = driver_type.x_kubernetes_validations.as_ref().unwrap();
        assert_eq!(rules[0].rule, "self == oldSelf");
        let values: Vec<String> = driver_type
            .enum_
            .iter()
            .flatten()
            .map(|v| v.0.as_str().unwrap_or_default().to_owned())
            .collect();
        assert_eq!(values, ["gpu", "vgpu", "vgpu-host-manager"]);
        // NVIDIA's NVIDIADriver default, unlike the ClusterPolicy's driver.upgradePolicy.
        let auto = &fields["upgradePolicy"].properties.as_ref().unwrap()["autoUpgrade"];
        assert_eq!(auto.default.as_ref().unwrap().0, serde_json::json!(true));
        let spec_rules = spec.x_kubernetes_validations.as_ref().unwrap();
        assert!(spec_rules[0].rule.contains("self.default"));
        assert_eq!(
            crd.spec.names.short_names,
            Some(vec![
                "nvd".to_owned(),
                "nvdriver".to_owned(),
                "nvdrivers".to_owned()
            ])
        );
    }
}
