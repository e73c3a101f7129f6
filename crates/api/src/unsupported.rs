//! What a ClusterPolicy sets that this operator accepts but does not act on, by field path,
//! computed from the spec alone (pure; no IO). The status stage names every entry, so no field
//! of NVIDIA's API is silently ignored.
//!
//! Two kinds of entries: an enabled section whose operand this operator does not deploy
//! (`spec.kataManager`), and a field inside an acted-on part of the policy that no render or controller
//! code reads (`spec.dcgm.hostPort`). A field counts only when it asks for
//! something: `false`, empty values and the CRD's own default ask for nothing, so a policy that
//! only holds server-side defaults reports nothing.

use std::fmt;
use std::sync::LazyLock;

use serde_json::Value;

use super::{ClusterPolicySpec, crd};

/// Fields (or whole subtrees) that are stored but read by no stage of this operator, each with
/// the reason a user sees. Keep in step with the render and controller code: a test renders a
/// policy with each of them set and checks that the output does not change.
pub const NOT_ACTED_ON: [(&str, &str); 8] = [
    (
        "spec.operator.defaultRuntime",
        "deprecated: the container runtime is read from the nodes",
    ),
    (
        "spec.operator.initContainer",
        "no operand runs a separate CUDA init container",
    ),
    (
        "spec.psp",
        "deprecated: PodSecurityPolicies no longer exist; use spec.psa",
    ),
    (
        "spec.cdi.default",
        "deprecated: cdi.enabled alone decides whether CDI is used",
    ),
    (
        "spec.driver.useOpenKernelModules",
        "deprecated: use driver.kernelModuleType",
    ),
    (
        "spec.dcgm.hostPort",
        "deprecated: the DCGM engine is reached through its Service",
    ),
    (
        "spec.gds.args",
        "NVIDIA's operator does not pass them to the nvidia-fs sidecar either",
    ),
    (
        "spec.gdrcopy.args",
        "NVIDIA's operator does not pass them to the gdrcopy sidecar either",
    ),
];

/// One field or section that the policy sets and this operator does not act on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unsupported {
    /// Field path, such as `spec.driver.livenessProbe` or `spec.gds`.
    pub path: String,
    /// Why it has no effect.
    pub why: &'static str,
}

impl fmt::Display for Unsupported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} is accepted but not acted on by this operator ({})",
            self.path, self.why
        )
    }
}

/// The `spec` schema of the generated CRD, for the defaults that ask for nothing.
static SPEC_SCHEMA: LazyLock<Value> = LazyLock::new(|| {
    let crd = serde_json::to_value(crd::crd()).unwrap_or_default();
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"].clone()
});

/// Whether a value asks for nothing: absent, false, empty, or the schema's default.
fn is_inert(value: &Value, schema: Option<&Value>) -> bool {
    match value {
        Value::Null | Value::Bool(false) => true,
        Value::String(s) if s.is_empty() => true,
        Value::Array(a) if a.is_empty() => true,
        Value::Object(o) if o.is_empty() => true,
        _ => schema.and_then(|s| s.get("default")) == Some(value),
    }
}

/// Paths under `path` whose values ask for something. Objects with declared properties are
/// descended; lists, maps and scalars are reported whole.
fn set_fields(value: &Value, schema: Option<&Value>, path: &str, out: &mut Vec<String>) {
    let properties = schema.and_then(|s| s.get("properties"));
    match (value, properties) {
        (Value::Object(fields), Some(properties)) => {
            for (name, child) in fields {
                set_fields(child, properties.get(name), &format!("{path}.{name}"), out);
            }
        }
        _ if is_inert(value, schema) => {}
        _ => out.push(path.to_owned()),
    }
}

/// Walks `spec_value` and the spec schema down a `spec.`-prefixed dotted path.
fn lookup<'a>(spec_value: &'a Value, path: &str) -> Option<(&'a Value, Option<&'static Value>)> {
    let mut value = spec_value;
    let mut schema = Some(&*SPEC_SCHEMA);
    for key in path.strip_prefix("spec.")?.split('.') {
        value = value.get(key)?;
        schema = schema
            .and_then(|s| s.get("properties"))
            .and_then(|p| p.get(key));
    }
    Some((value, schema))
}

impl ClusterPolicySpec {
    /// Everything this policy sets that this operator does not act on, in a stable order:
    /// enabled sections it does not deploy, then fields it does not read (see
    /// [`NOT_ACTED_ON`]).
    pub fn unsupported_fields(&self) -> Vec<Unsupported> {
        let mut found: Vec<Unsupported> = self
            .unsupported_enabled()
            .into_iter()
            .map(|c| Unsupported {
                path: format!("spec.{}", c.spec_key()),
                why: not_deployed_because(c),
            })
            .collect();
        let Ok(spec_value) = serde_json::to_value(self) else {
            return found;
        };
        for (rule, why) in NOT_ACTED_ON {
            if let Some((value, schema)) = lookup(&spec_value, rule) {
                let mut paths = Vec::new();
                set_fields(value, schema, rule, &mut paths);
                found.extend(paths.into_iter().map(|path| Unsupported { path, why }));
            }
        }
        found.extend(vgpu_manager_not_acted_on(self));
        // As in NVIDIA's operator, the CRD hands the driver to the NVIDIADrivers, whose own
        // usePrecompiled decides for their pools.
        if self
            .driver
            .as_ref()
            .is_some_and(|d| d.uses_precompiled() && d.uses_nvidia_driver_crd())
        {
            found.push(Unsupported {
                path: "spec.driver.usePrecompiled".to_owned(),
                why: "with driver.useNvidiaDriverCRD the NVIDIADrivers decide: set \
                      spec.usePrecompiled on an NVIDIADriver; GPU nodes no NVIDIADriver selects \
                      keep a driver built on the node",
            });
        }
        found
    }
}

/// Why kata-manager is reported: NVIDIA's v26.7 never deploys it (docs/operand-facts.md
/// §20.6), so an enabled section gets this line instead of the generic one.
pub const KATA_MANAGER_DEPRECATED: &str = "deprecated: NVIDIA's operator no longer deploys \
    kata-manager (since v26.7) and neither does this one. The Kata runtime and its RuntimeClasses \
    (for example kata-qemu-nvidia-gpu) come from your Kata Containers installation; in \
    sandboxWorkloads.mode kata this operator deploys the Kata sandbox device plugin \
    (spec.kataSandboxDevicePlugin) and the CC manager (spec.ccManager). Remove spec.kataManager";

/// Why an enabled section has no effect.
fn not_deployed_because(component: super::Component) -> &'static str {
    match component {
        super::Component::KataManager => KATA_MANAGER_DEPRECATED,
        _ => "enabled, but this operator does not deploy it",
    }
}

/// The vGPU manager with `driver.useNvidiaDriverCRD`: as in NVIDIA's operator, the
/// ClusterPolicy's vGPU manager is skipped and an NVIDIADriver of driverType vgpu-host-manager
/// deploys the host driver instead.
fn vgpu_manager_not_acted_on(spec: &ClusterPolicySpec) -> Option<Unsupported> {
    let sandbox_on = spec
        .sandbox_workloads
        .as_ref()
        .is_some_and(|s| s.is_enabled());
    let crd = spec
        .driver
        .as_ref()
        .is_some_and(|d| d.uses_nvidia_driver_crd());
    let on = spec
        .vgpu_manager
        .as_ref()
        .is_some_and(|v| v.enabled == Some(true));
    (sandbox_on && crd && on).then(|| Unsupported {
        path: "spec.vgpuManager".to_owned(),
        why: "with driver.useNvidiaDriverCRD the ClusterPolicy's vGPU manager is not deployed: \
              create an NVIDIADriver with driverType vgpu-host-manager for the vm-vgpu nodes",
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn spec(yaml: &str) -> ClusterPolicySpec {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    fn paths(yaml: &str) -> Vec<String> {
        spec(yaml)
            .unsupported_fields()
            .into_iter()
            .map(|u| u.path)
            .collect()
    }

    #[test]
    fn an_empty_policy_and_a_policy_of_server_defaults_report_nothing() {
        assert!(paths("{}").is_empty());
        let defaults_only = "{operator: {runtimeClass: nvidia}, cdi: {enabled: true, default: false, \
             nriPluginEnabled: false}, driver: {upgradePolicy: {autoUpgrade: false, \
             maxParallelUpgrades: 1, maxUnavailable: 25%, drain: {enable: false, force: false, \
             timeoutSeconds: 300, deleteEmptyDir: false}, podDeletion: {force: false, \
             timeoutSeconds: 300, deleteEmptyDir: false}, waitForCompletion: {timeoutSeconds: 0}}}, \
             sandboxWorkloads: {enabled: false, defaultWorkload: container, mode: kubevirt}, \
             dcgmExporter: {enablePodLabels: false, enablePodUID: false}}";
        assert_eq!(paths(defaults_only), Vec::<String>::new());
    }

    #[test]
    fn fields_that_ask_for_something_are_named_by_path() {
        let got = paths(
            "{operator: {defaultRuntime: containerd, metrics: {serviceMonitor: {enabled: true, \
             interval: 30s}}}, driver: {upgradePolicy: {autoUpgrade: true, drain: {enable: true}}, \
             livenessProbe: {periodSeconds: 10}}, dcgmExporter: {enablePodLabels: true, \
             podLabelAllowlistRegex: ['^app$']}, dcgm: {hostPort: 5555}, psp: {enabled: true}, \
             validator: {plugin: {env: [{name: C}]}}}",
        );
        assert_eq!(
            got,
            [
                "spec.operator.defaultRuntime",
                "spec.psp.enabled",
                "spec.dcgm.hostPort",
            ]
        );
    }

    #[test]
    fn use_precompiled_is_not_acted_on_while_nvidiadrivers_decide() {
        assert_eq!(
            paths("{driver: {usePrecompiled: true, useNvidiaDriverCRD: true}}"),
            ["spec.driver.usePrecompiled"]
        );
        assert!(paths("{driver: {usePrecompiled: true}}").is_empty());
    }

    #[test]
    fn gds_and_gdrcopy_are_acted_on_but_their_args_are_not() {
        assert_eq!(
            paths(
                "{gds: {enabled: true, version: '2.29.4', env: [{name: A, value: b}]}, \
                 gdrcopy: {enabled: true, imagePullSecrets: [s]}}"
            ),
            Vec::<String>::new()
        );
        assert_eq!(
            paths("{gds: {enabled: true, args: [x]}, gdrcopy: {args: [y]}}"),
            ["spec.gds.args", "spec.gdrcopy.args"]
        );
    }

    #[test]
    fn enabled_unsupported_sections_come_first_and_their_fields_are_not_repeated() {
        let got = spec(
            "{gds: {enabled: true, version: '2.29'}, sandboxWorkloads: {enabled: true}, \
             kataManager: {enabled: true, hostNetwork: true}, \
             sandboxDevicePlugin: {enabled: true}, dcgm: {hostPort: 5555}}",
        )
        .unsupported_fields();
        let rendered: Vec<String> = got.iter().map(ToString::to_string).collect();
        assert_eq!(
            rendered,
            [
                format!(
                    "spec.kataManager is accepted but not acted on by this operator \
                     ({KATA_MANAGER_DEPRECATED})"
                ),
                "spec.dcgm.hostPort is accepted but not acted on by this operator \
                 (deprecated: the DCGM engine is reached through its Service)"
                    .to_owned(),
            ]
        );
    }

    #[test]
    fn vm_passthrough_vgpu_and_kata_mode_are_acted_on() {
        let served = "{sandboxWorkloads: {enabled: true, defaultWorkload: vm-passthrough, \
             mode: kubevirt}, vfioManager: {enabled: true, driverManager: {env: [{name: A}]}}, \
             sandboxDevicePlugin: {enabled: true}, validator: {vfioPCI: {env: [{name: B}]}}}";
        assert_eq!(paths(served), Vec::<String>::new());
        let vgpu = "{sandboxWorkloads: {enabled: true, defaultWorkload: vm-vgpu}, \
             vgpuManager: {enabled: true, driverManager: {env: [{name: A}]}}, \
             vgpuDeviceManager: {enabled: true, config: {name: c, default: d}}, \
             validator: {vgpuManager: {env: [{name: B}]}, vgpuDevices: {env: [{name: C}]}}}";
        assert_eq!(paths(vgpu), Vec::<String>::new());
        assert_eq!(
            paths(
                "{sandboxWorkloads: {enabled: true, mode: kata}, vgpuManager: {enabled: true}, \
                 ccManager: {enabled: true}}"
            ),
            Vec::<String>::new()
        );
        // Off, nothing of it is acted on and nothing asks for anything.
        assert!(paths("{sandboxWorkloads: {enabled: false, mode: kata}}").is_empty());
    }

    #[test]
    fn the_vgpu_manager_is_reported_while_nvidiadrivers_deploy_the_host_driver() {
        let with_crd = "{sandboxWorkloads: {enabled: true}, vgpuManager: {enabled: true}, \
             driver: {useNvidiaDriverCRD: true}}";
        let got = spec(with_crd).unsupported_fields();
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].path, "spec.vgpuManager");
        assert!(got[0].why.contains("driverType vgpu-host-manager"));
        assert!(
            paths("{sandboxWorkloads: {enabled: true}, vgpuManager: {enabled: true}}").is_empty()
        );
    }

    #[test]
    fn kata_mode_with_the_kata_plugin_and_the_cc_manager_is_acted_on() {
        assert_eq!(
            paths(
                "{sandboxWorkloads: {enabled: true, defaultWorkload: vm-passthrough, mode: kata}, \
                 vfioManager: {enabled: true}, kataSandboxDevicePlugin: {enabled: true, \
                 env: [{name: P_GPU_ALIAS, value: gpu}]}, ccManager: {enabled: true, \
                 defaultMode: 'on'}}"
            ),
            Vec::<String>::new()
        );
    }

    #[test]
    fn an_enabled_kata_manager_is_reported_deprecated_with_what_replaces_it() {
        let got = spec(
            "{sandboxWorkloads: {enabled: true, mode: kata}, kataManager: {enabled: true, \
             config: {artifactsDir: /opt/kata}}}",
        )
        .unsupported_fields();
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].path, "spec.kataManager");
        let line = got[0].to_string();
        for needle in [
            "deprecated",
            "no longer deploys",
            "RuntimeClasses",
            "spec.kataSandboxDevicePlugin",
            "spec.ccManager",
            "Remove spec.kataManager",
        ] {
            assert!(line.contains(needle), "{needle}: {line}");
        }
        // Switched off, or without sandbox workloads, it asks for nothing.
        assert!(
            paths("{sandboxWorkloads: {enabled: true}, kataManager: {enabled: false}}").is_empty()
        );
        assert!(paths("{kataManager: {enabled: true}}").is_empty());
    }

    #[test]
    fn every_rule_names_a_field_of_the_schema() {
        for (path, _) in NOT_ACTED_ON {
            let mut schema = &*SPEC_SCHEMA;
            for key in path.strip_prefix("spec.").unwrap().split('.') {
                schema = schema["properties"]
                    .get(key)
                    .unwrap_or_else(|| panic!("{path}: no field {key} in the CRD"));
            }
        }
    }
}
