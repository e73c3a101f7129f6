//! Validate stage (pure, no IO): a `ClusterPolicy` plus the cluster facts become a
//! `ValidatedPolicy`; problems are recorded per operand so one bad section never blocks the
//! others (decision 8).
//!
//! What validate does:
//! - applies the CRD's server-side defaults to the spec (what the API server does on read-back),
//!   so a policy file rendered by `gpu-operator render` and the same policy read from the
//!   cluster render identically;
//! - resolves the image of every enabled operand (policy fields, then `facts.image_env`, then
//!   the pinned default), appending the GPU nodes' OS suffix to the tags of the driver and of
//!   the GDS and GDRCopy sidecars (NVIDIA's `resolveDriverTag` rule);
//! - checks what render cannot do without (named ConfigMaps present, OS known where a path or
//!   tag depends on it, absolute host paths, supported driver mode).
//!
//! Each problem names the field and the fix; an operand with problems is `Invalid`.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use serde_json::Value;

use crate::api::{ClusterPolicy, ClusterPolicySpec, ImageKind, crd};
use crate::facts::ClusterFacts;
use crate::model::{Operand, ValidatedPolicy};
use crate::operands::{self, dcgm_exporter, device_plugin};

/// Validates `policy` against what the cluster told us: every verdict of a pass (frozen
/// operands, reported problems, the sharing config to mount). The controller and
/// `gpu-operator render` both call this, so they cannot disagree.
pub fn validate(policy: &ClusterPolicy, facts: &ClusterFacts) -> ValidatedPolicy {
    let spec = with_schema_defaults(&policy.spec);
    let env = |name: &str| facts.image_env.get(name).cloned();
    let mut images = BTreeMap::new();
    let mut invalid = BTreeMap::new();
    let mut reported = BTreeMap::new();
    // Decided on the spec as written, as the device plugin reads it (decision 4).
    let sharing = device_plugin::decide_sharing(&policy.spec, facts).unwrap_or_default();
    if let Some(problem) = sharing.problem {
        reported.insert(Operand::DevicePlugin, problem);
    }
    for operand in Operand::ALL {
        if !operand.is_enabled(&spec, facts) {
            continue;
        }
        let mut problems = Vec::new();
        for kind in operand.images(&spec, sharing.sharing.is_some()) {
            match resolve_image(&spec, kind, &env, facts) {
                Ok(reference) => {
                    images.insert(kind, reference);
                }
                Err(problem) => problems.push(problem),
            }
        }
        problems.extend(host_path_problems(operand, &spec));
        problems.extend(operands::check(operand, &spec, facts));
        if let Some(freeze) = &sharing.freeze
            && operand.descriptor().consumes_sharing_config
        {
            problems.push(freeze.clone());
        }
        if !problems.is_empty() {
            problems.dedup();
            invalid.insert(operand, problems.join("; "));
        }
        if let Some(problem) = operands::report(operand, &spec, facts) {
            reported.insert(operand, problem);
        }
    }
    // Checked against the sharing config the plugins are to mount, so a node is never labelled
    // with a key they lack.
    let by_model = crate::by_model::plan(&spec, facts, sharing.sharing.as_ref());
    let mut by_model_notes = Vec::new();
    for (operand, problem) in [
        (Operand::DevicePlugin, &by_model.sharing_problem),
        (Operand::MigManager, &by_model.mig_problem),
    ] {
        let Some(problem) = problem else { continue };
        if operand.is_enabled(&spec, facts) {
            reported
                .entry(operand)
                .and_modify(|p: &mut String| *p = format!("{p}; {problem}"))
                .or_insert_with(|| problem.clone());
        } else {
            by_model_notes.push(problem.clone());
        }
    }
    ValidatedPolicy {
        name: policy.metadata.name.clone().unwrap_or_default(),
        spec,
        images,
        invalid,
        reported,
        notes: sharing
            .notes
            .into_iter()
            .chain(dcgm_exporter::service_monitor_note(
                &policy.spec,
                facts.service_monitor_api,
            ))
            .chain(operands::operator_metrics::note(&policy.spec, facts))
            .chain(crate::node_pools::status_note(&policy.spec))
            .chain(by_model_notes)
            .collect(),
        sharing: sharing.sharing,
        by_model,
    }
}

fn resolve_image(
    spec: &ClusterPolicySpec,
    kind: ImageKind,
    env: &dyn Fn(&str) -> Option<String>,
    facts: &ClusterFacts,
) -> Result<String, String> {
    let resolved = spec.resolve_image(kind, env).map_err(|e| {
        let user = match kind {
            ImageKind::Validator => " (the validation init containers use the validator image)",
            ImageKind::VgpuManager => {
                " (NVIDIA publishes no vGPU manager image: build one from the vGPU host driver \
                 package, push it to your registry and set spec.vgpuManager.repository, \
                 spec.vgpuManager.image (NVIDIA's name is vgpu-manager) and \
                 spec.vgpuManager.version)"
            }
            _ => "",
        };
        format!(
            "{e}{user}; set the fields or the operator's {} variable",
            kind.env_var()
        )
    })?;
    let what = match kind {
        ImageKind::Driver => "driver",
        ImageKind::Gds => "GPUDirect Storage (nvidia-fs)",
        ImageKind::GdrCopy => "GDRCopy (gdrdrv)",
        _ => return Ok(resolved.reference),
    };
    if resolved.is_digest {
        return Ok(resolved.reference);
    }
    match facts.os_tag.as_deref() {
        Some(os) => Ok(format!("{}-{os}", resolved.reference)),
        None => Err(format!(
            "{field}: the {what} image tag needs the GPU nodes' OS suffix (for example \
             {reference}-ubuntu22.04), and no GPU node with NFD OS labels \
             (feature.node.kubernetes.io/system-os_release.ID and VERSION_ID) is known yet; the \
             driver renders once one is, or pin {field}.version to a sha256 digest",
            field = kind.field_path(),
            reference = resolved.reference
        )),
    }
}

/// Host paths must be absolute: a relative hostPath is rejected by the API server only when the
/// DaemonSet is applied, which would surface far from the field that caused it.
fn host_path_problems(operand: Operand, spec: &ClusterPolicySpec) -> Vec<String> {
    if operand.deploy_label().is_none() {
        return Vec::new();
    }
    let host_paths = spec.host_paths.as_ref();
    let mut paths = vec![
        (
            "spec.hostPaths.rootFS",
            host_paths.and_then(|h| h.root_fs.as_deref()),
        ),
        (
            "spec.hostPaths.driverInstallDir",
            host_paths.and_then(|h| h.driver_install_dir.as_deref()),
        ),
        (
            "spec.hostPaths.kubeletRootDir",
            host_paths.and_then(|h| h.kubelet_root_dir.as_deref()),
        ),
    ];
    paths.extend((operand.descriptor().host_paths)(spec));
    paths
        .into_iter()
        .filter_map(|(field, value)| {
            let value = value.filter(|v| !v.is_empty())?;
            (!value.starts_with('/')).then(|| {
                format!("{field} must be an absolute host path such as /run/nvidia; got {value:?}")
            })
        })
        .collect()
}

/// The spec schema of our CRD, where the server-side defaults are declared.
fn spec_schema() -> &'static Value {
    static SCHEMA: OnceLock<Value> = OnceLock::new();
    SCHEMA.get_or_init(|| {
        let crd = serde_json::to_value(crd::crd()).unwrap_or_default();
        crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"].clone()
    })
}

/// What the API server's structural defaulting does: a property with a `default`, absent from
/// an object that is present, gets the default; defaults are defaulted in turn.
pub fn apply_defaults(value: &mut Value, schema: &Value) {
    match value {
        Value::Object(map) => {
            if let Some(properties) = schema.get("properties").and_then(Value::as_object) {
                for (key, property) in properties {
                    if let Some(default) = property.get("default")
                        && !map.contains_key(key)
                    {
                        map.insert(key.clone(), default.clone());
                    }
                }
                for (key, child) in map.iter_mut() {
                    if let Some(property) = properties.get(key) {
                        apply_defaults(child, property);
                    }
                }
            } else if let Some(additional) =
                schema.get("additionalProperties").filter(|a| a.is_object())
            {
                for child in map.values_mut() {
                    apply_defaults(child, additional);
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for item in items {
                    apply_defaults(item, item_schema);
                }
            }
        }
        _ => {}
    }
}

/// `spec` with the CRD's defaults applied; `spec` unchanged if that cannot be done.
pub fn with_schema_defaults(spec: &ClusterPolicySpec) -> ClusterPolicySpec {
    let Ok(mut value) = serde_json::to_value(spec) else {
        return spec.clone();
    };
    apply_defaults(&mut value, spec_schema());
    serde_json::from_value(value).unwrap_or_else(|_| spec.clone())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::facts::ConfigMapData;
    use crate::render::tests::{facts, policy, policy_with};

    #[test]
    fn empty_policy_resolves_pinned_images_with_the_os_suffix_on_the_driver() {
        let p = policy("{}");
        assert!(p.invalid.is_empty(), "{:?}", p.invalid);
        assert_eq!(
            p.images[&ImageKind::Driver],
            "nvcr.io/nvidia/driver:595.91.07-ubuntu22.04"
        );
        assert_eq!(
            p.images[&ImageKind::DevicePlugin],
            "nvcr.io/nvidia/k8s-device-plugin:v0.20.0"
        );
        // Node status exporter is off, so its image is not resolved.
        assert!(!p.images.contains_key(&ImageKind::NodeStatusExporter));
    }

    #[test]
    fn driver_without_known_os_is_invalid_but_every_other_operand_renders() {
        let f = ClusterFacts {
            os_tag: None,
            ..facts()
        };
        let p = policy_with("{}", &f);
        assert_eq!(p.invalid.keys().collect::<Vec<_>>(), [&Operand::Driver]);
        assert!(p.invalid[&Operand::Driver].contains("OS suffix"));
    }

    #[test]
    fn driver_pinned_by_digest_needs_no_os() {
        let f = ClusterFacts {
            os_tag: None,
            ..facts()
        };
        let p = policy_with(
            "{driver: {repository: nvcr.io/nvidia, image: driver, version: 'sha256:abc'}}",
            &f,
        );
        assert!(p.invalid.is_empty());
        assert_eq!(
            p.images[&ImageKind::Driver],
            "nvcr.io/nvidia/driver@sha256:abc"
        );
    }

    #[test]
    fn partial_image_triple_makes_only_its_operands_invalid_with_field_and_fix() {
        let p = policy("{gfd: {repository: nvcr.io/nvidia, image: k8s-device-plugin}}");
        assert_eq!(p.invalid.keys().collect::<Vec<_>>(), [&Operand::Gfd]);
        let message = &p.invalid[&Operand::Gfd];
        assert!(message.starts_with("spec.gfd:"), "{message}");
        assert!(message.contains("version is empty"), "{message}");
        assert!(message.contains("GFD_IMAGE"), "{message}");
    }

    #[test]
    fn broken_validator_image_invalidates_every_operand_with_validation_init_containers() {
        let p = policy("{validator: {repository: r.local, version: v1}}");
        let invalid: Vec<_> = p.invalid.keys().copied().collect();
        assert_eq!(
            invalid,
            [
                Operand::Toolkit,
                Operand::Validator,
                Operand::DevicePlugin,
                Operand::MpsControlDaemon,
                Operand::Gfd,
                Operand::Dcgm,
                Operand::DcgmExporter,
                Operand::MigManager,
            ]
        );
        assert!(p.invalid[&Operand::Toolkit].contains("validation init containers"));
    }

    #[test]
    fn environment_image_is_the_fallback() {
        let f = ClusterFacts {
            image_env: [("GFD_IMAGE".to_owned(), "mirror.local/gfd:1".to_owned())].into(),
            ..facts()
        };
        let p = policy_with("{}", &f);
        assert_eq!(p.images[&ImageKind::Gfd], "mirror.local/gfd:1");
    }

    #[test]
    fn crd_defaults_are_applied_like_the_api_server_does() {
        let p = policy("{driver: {}, operator: {}, cdi: {}}");
        let spec = &p.spec;
        assert_eq!(
            spec.driver.as_ref().unwrap().kernel_module_type,
            Some(crate::api::KernelModuleType::Auto)
        );
        assert_eq!(
            spec.operator.as_ref().unwrap().runtime_class.as_deref(),
            Some("nvidia")
        );
        assert_eq!(spec.cdi.as_ref().unwrap().enabled, Some(true));
        // Absent sections stay absent, as on the server.
        assert!(spec.toolkit.is_none());
    }

    #[test]
    fn named_configmaps_must_be_present_with_their_key() {
        let p = policy(
            "{migManager: {config: {name: my-layouts}}, dcgmExporter: {config: {name: metrics}}}",
        );
        assert!(p.invalid[&Operand::MigManager].contains("ConfigMap my-layouts was not found"));
        assert!(p.invalid[&Operand::DcgmExporter].contains("ConfigMap metrics was not found"));
        let f = ClusterFacts {
            mig_config: Some(ConfigMapData {
                name: "my-layouts".to_owned(),
                data: [("other.yaml".to_owned(), String::new())].into(),
            }),
            ..facts()
        };
        let p = policy_with("{migManager: {config: {name: my-layouts}}}", &f);
        assert!(p.invalid[&Operand::MigManager].contains("has no key config.yaml"));
        // The default name means the default layouts, which we render.
        let p = policy("{migManager: {config: {name: default-mig-parted-config}}}");
        assert!(!p.invalid.contains_key(&Operand::MigManager));
    }

    #[test]
    fn relative_host_paths_are_rejected_per_operand() {
        let p = policy("{devicePlugin: {mps: {root: run/mps}}}");
        assert_eq!(
            p.invalid.keys().collect::<Vec<_>>(),
            [&Operand::DevicePlugin, &Operand::MpsControlDaemon]
        );
        assert!(p.invalid[&Operand::DevicePlugin].contains("spec.devicePlugin.mps.root"));
    }

    #[test]
    fn a_precompiled_driver_is_valid_and_reports_gpu_nodes_without_a_kernel_pool() {
        let gpu = std::sync::Arc::new(crate::nodes::NodeView::from_labels(
            "gpu-0",
            None,
            &[("feature.node.kubernetes.io/pci-10de.present", "true")]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
        ));
        let f = ClusterFacts {
            gpu_nodes: vec![gpu],
            ..facts()
        };
        let p = policy_with(
            "{driver: {usePrecompiled: true, repository: r, image: driver, version: '580'}}",
            &f,
        );
        assert!(!p.invalid.contains_key(&Operand::Driver), "{:?}", p.invalid);
        assert!(
            p.reported[&Operand::Driver]
                .contains("gpu-0 (no NFD feature.node.kubernetes.io/kernel-version.full label)"),
            "{:?}",
            p.reported
        );
    }

    #[test]
    fn driver_configmaps_must_be_known_and_placeable() {
        let p = policy("{driver: {repoConfig: {configMapName: repos}}}");
        assert!(p.invalid[&Operand::Driver].contains("ConfigMap repos was not found"));
        let f = ClusterFacts {
            os_tag: Some("flatcar3975".to_owned()),
            driver_config_maps: [("repos".to_owned(), ConfigMapData::default())].into(),
            ..facts()
        };
        let p = policy_with("{driver: {repoConfig: {configMapName: repos}}}", &f);
        assert!(p.invalid[&Operand::Driver].contains("flatcar3975"));
    }
}
