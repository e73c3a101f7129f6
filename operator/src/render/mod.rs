//! Render stage (pure, no IO): `ValidatedPolicy` + `ClusterFacts` -> `DesiredState`, one module
//! per operand, typed k8s-openapi objects.
//!
//! Contract with the apply stage: every object carries [`MANAGED_BY_LABEL`] = [`MANAGER`] and
//! [`OPERAND_LABEL`] = the operand's [`Operand::name`], the owner reference from the facts, and
//! the namespace from the facts when namespaced. An operand whose outcome is `Invalid` keeps its
//! live objects untouched and out of pruning (decision 8).

pub mod common;
pub mod dcgm;
pub mod dcgm_exporter;
pub mod device_plugin;
pub mod driver;
pub mod gfd;
pub mod inputs;
pub mod mig_manager;
pub mod mps;
pub mod nfd;
pub mod node_status_exporter;
pub mod openshift;
pub mod rbac;
pub mod runtime_classes;
pub mod toolkit;
pub mod validator;

#[cfg(test)]
mod change_tests;
#[cfg(test)]
mod invariant_tests;
#[cfg(test)]
mod operand_tests;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::DynamicObject;
use serde_json::Value;

use crate::api::{ClusterPolicySpec, Component, ImageKind};
use crate::facts::ClusterFacts;
use crate::validate::ValidatedPolicy;

/// Label every object the operator owns carries (the watches select on it).
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// Value of [`MANAGED_BY_LABEL`], also the server-side apply field manager.
pub const MANAGER: &str = "gpu-operator";
/// Label naming the operand an object belongs to, so pruning works per operand.
pub const OPERAND_LABEL: &str = "nvidia.com/gpu-operator.operand";
/// Pod-template annotation holding the SHA-256 of the config an operand consumes.
pub const CONFIG_HASH_ANNOTATION: &str = "nvidia.com/gpu-operator.config-hash";

/// The [`CONFIG_HASH_ANNOTATION`] on a DaemonSet's pod template: the config its pods run with.
pub fn config_hash(ds: &DaemonSet) -> Option<&str> {
    ds.spec
        .as_ref()?
        .template
        .metadata
        .as_ref()?
        .annotations
        .as_ref()?
        .get(CONFIG_HASH_ANNOTATION)
        .map(String::as_str)
}

/// The objects of one operand, by kind. The applier destructures this without `..`, so a new
/// kind cannot be added and silently never applied.
#[derive(Clone, Debug, Default)]
pub struct OperandObjects {
    pub service_accounts: Vec<ServiceAccount>,
    pub cluster_roles: Vec<ClusterRole>,
    pub cluster_role_bindings: Vec<ClusterRoleBinding>,
    pub roles: Vec<Role>,
    pub role_bindings: Vec<RoleBinding>,
    pub config_maps: Vec<ConfigMap>,
    pub runtime_classes: Vec<RuntimeClass>,
    pub services: Vec<Service>,
    pub daemon_sets: Vec<DaemonSet>,
    pub deployments: Vec<Deployment>,
    /// Objects of APIs that may be absent (ServiceMonitor, SecurityContextConstraints), rendered
    /// only when the facts say the API is served.
    pub dynamic: Vec<DynamicObject>,
}

/// A unit the operator renders, applies, prunes and reports on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Operand {
    /// RuntimeClass `nvidia` (and the CDI variants): NVIDIA's "pre-requisites" state.
    RuntimeClasses,
    Driver,
    Toolkit,
    Validator,
    DevicePlugin,
    MpsControlDaemon,
    Gfd,
    Nfd,
    Dcgm,
    DcgmExporter,
    MigManager,
    NodeStatusExporter,
}

impl Operand {
    /// Every operand, in apply order (NVIDIA's state order).
    pub const ALL: [Operand; 12] = [
        Operand::RuntimeClasses,
        Operand::Nfd,
        Operand::Driver,
        Operand::Toolkit,
        Operand::Validator,
        Operand::DevicePlugin,
        Operand::MpsControlDaemon,
        Operand::Dcgm,
        Operand::DcgmExporter,
        Operand::Gfd,
        Operand::MigManager,
        Operand::NodeStatusExporter,
    ];

    /// Stable name: the value of [`OPERAND_LABEL`] and the operand's name in status.
    pub const fn name(self) -> &'static str {
        match self {
            Operand::RuntimeClasses => "runtime-classes",
            Operand::Driver => "driver",
            Operand::Toolkit => "container-toolkit",
            Operand::Validator => "operator-validator",
            Operand::DevicePlugin => "device-plugin",
            Operand::MpsControlDaemon => "mps-control-daemon",
            Operand::Gfd => "gpu-feature-discovery",
            Operand::Nfd => "node-feature-discovery",
            Operand::Dcgm => "dcgm",
            Operand::DcgmExporter => "dcgm-exporter",
            Operand::MigManager => "mig-manager",
            Operand::NodeStatusExporter => "node-status-exporter",
        }
    }

    /// The node label (NVIDIA's key) whose value `true` selects the nodes the operand runs on;
    /// `None` for operands that are not per-GPU-node DaemonSets.
    pub const fn deploy_label(self) -> Option<&'static str> {
        match self {
            Operand::Driver => Some("nvidia.com/gpu.deploy.driver"),
            Operand::Toolkit => Some("nvidia.com/gpu.deploy.container-toolkit"),
            Operand::Validator => Some("nvidia.com/gpu.deploy.operator-validator"),
            // The MPS daemon shares the device plugin's key, as in NVIDIA's operator.
            Operand::DevicePlugin | Operand::MpsControlDaemon => {
                Some("nvidia.com/gpu.deploy.device-plugin")
            }
            Operand::Gfd => Some("nvidia.com/gpu.deploy.gpu-feature-discovery"),
            Operand::Dcgm => Some("nvidia.com/gpu.deploy.dcgm"),
            Operand::DcgmExporter => Some("nvidia.com/gpu.deploy.dcgm-exporter"),
            Operand::MigManager => Some("nvidia.com/gpu.deploy.mig-manager"),
            Operand::NodeStatusExporter => Some("nvidia.com/gpu.deploy.node-status-exporter"),
            Operand::RuntimeClasses | Operand::Nfd => None,
        }
    }
}

/// What render decided for one operand.
// A dozen of these per pass: boxing the rendered objects would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum Outcome {
    /// Turned off (or not applicable, e.g. NFD already running): its objects are pruned.
    Disabled,
    /// The objects to apply; owned objects of this operand not among them are pruned.
    Rendered(OperandObjects),
    /// The policy's input for this operand is invalid (message names the field and the fix):
    /// its live objects are left exactly as they are.
    Invalid(String),
}

#[derive(Clone, Debug)]
pub struct OperandState {
    pub operand: Operand,
    pub outcome: Outcome,
}

/// Everything one reconcile pass wants in the cluster, per operand, in apply order.
#[derive(Clone, Debug, Default)]
pub struct DesiredState {
    pub operands: Vec<OperandState>,
}

impl Operand {
    /// The ClusterPolicy switch that turns the operand on (`None`: RuntimeClasses, which follow
    /// the CDI / NRI settings).
    pub const fn component(self) -> Option<Component> {
        match self {
            Operand::RuntimeClasses => None,
            Operand::Driver => Some(Component::Driver),
            Operand::Toolkit => Some(Component::Toolkit),
            Operand::Validator => Some(Component::Validator),
            Operand::DevicePlugin | Operand::MpsControlDaemon => Some(Component::DevicePlugin),
            Operand::Gfd => Some(Component::Gfd),
            Operand::Nfd => Some(Component::Nfd),
            Operand::Dcgm => Some(Component::Dcgm),
            Operand::DcgmExporter => Some(Component::DcgmExporter),
            Operand::MigManager => Some(Component::MigManager),
            Operand::NodeStatusExporter => Some(Component::NodeStatusExporter),
        }
    }

    /// Whether the operand has objects to render under this policy and these facts (its switch,
    /// plus: no RuntimeClasses with the NRI plugin, no driver when NVIDIADriver resources manage
    /// it, no NFD where NFD already runs).
    pub fn is_enabled(self, spec: &ClusterPolicySpec, facts: &ClusterFacts) -> bool {
        match self {
            Operand::RuntimeClasses => !common::nri_enabled(spec),
            Operand::Driver => {
                spec.is_enabled(Component::Driver)
                    && !spec
                        .driver
                        .as_ref()
                        .is_some_and(|d| d.uses_nvidia_driver_crd())
            }
            Operand::Nfd => spec.is_enabled(Component::Nfd) && !facts.nfd_running,
            other => other.component().is_some_and(|c| spec.is_enabled(c)),
        }
    }

    /// The images the operand's pods run: its own, the validator image of its validation init
    /// containers, the device-plugin image of GFD's config-manager.
    pub fn images(self, spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Vec<ImageKind> {
        match self {
            Operand::RuntimeClasses => vec![],
            Operand::Nfd => vec![ImageKind::Nfd],
            Operand::Driver => vec![ImageKind::Driver, ImageKind::DriverManager],
            Operand::Toolkit => vec![ImageKind::Toolkit, ImageKind::Validator],
            Operand::Validator => vec![ImageKind::Validator],
            Operand::DevicePlugin | Operand::MpsControlDaemon => {
                vec![ImageKind::DevicePlugin, ImageKind::Validator]
            }
            Operand::Gfd => {
                let config_manager = spec.is_enabled(Component::DevicePlugin)
                    && facts.sharing.is_some()
                    && spec
                        .device_plugin
                        .as_ref()
                        .and_then(|d| d.config.as_ref())
                        .and_then(|c| c.name.as_deref())
                        .is_some_and(|n| !n.is_empty());
                let mut kinds = vec![ImageKind::Gfd, ImageKind::Validator];
                if config_manager {
                    kinds.push(ImageKind::DevicePlugin);
                }
                kinds
            }
            Operand::Dcgm => vec![ImageKind::Dcgm, ImageKind::Validator],
            Operand::DcgmExporter => vec![ImageKind::DcgmExporter, ImageKind::Validator],
            Operand::MigManager => vec![ImageKind::MigManager, ImageKind::Validator],
            Operand::NodeStatusExporter => vec![ImageKind::NodeStatusExporter],
        }
    }

    fn render_objects(
        self,
        policy: &ValidatedPolicy,
        facts: &ClusterFacts,
    ) -> Option<OperandObjects> {
        match self {
            Operand::RuntimeClasses => runtime_classes::render(policy, facts),
            Operand::Driver => driver::render(policy, facts),
            Operand::Toolkit => toolkit::render(policy, facts),
            Operand::Validator => validator::render(policy, facts),
            Operand::DevicePlugin => device_plugin::render(policy, facts),
            Operand::MpsControlDaemon => mps::render(policy, facts),
            Operand::Gfd => gfd::render(policy, facts),
            Operand::Nfd => nfd::render(policy, facts),
            Operand::Dcgm => dcgm::render(policy, facts),
            Operand::DcgmExporter => dcgm_exporter::render(policy, facts),
            Operand::MigManager => mig_manager::render(policy, facts),
            Operand::NodeStatusExporter => node_status_exporter::render(policy, facts),
        }
    }
}

/// Renders every operand, in [`Operand::ALL`] order: `Invalid` when validate recorded a
/// problem with its input, `Disabled` when it is off (or not applicable, e.g. NFD already
/// running), else its objects.
///
/// The driver needs the GPU nodes' OS for its image tag: while no GPU node is known, validate
/// marks it invalid (live objects kept, nothing pruned) unless the image is pinned by digest;
/// every other operand renders without node facts.
pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> DesiredState {
    let operands = Operand::ALL
        .into_iter()
        .map(|operand| OperandState {
            operand,
            outcome: outcome(operand, policy, facts),
        })
        .collect();
    DesiredState { operands }
}

fn outcome(operand: Operand, policy: &ValidatedPolicy, facts: &ClusterFacts) -> Outcome {
    if let Some(message) = policy.invalid.get(&operand) {
        return Outcome::Invalid(message.clone());
    }
    if !operand.is_enabled(&policy.spec, facts) {
        return Outcome::Disabled;
    }
    let missing: Vec<&str> = operand
        .images(&policy.spec, facts)
        .into_iter()
        .filter(|kind| !policy.images.contains_key(kind))
        .map(ImageKind::field_path)
        .collect();
    if !missing.is_empty() {
        // validate resolves these for every enabled operand; a policy built another way may not.
        return Outcome::Invalid(format!(
            "no resolved image for {}: run validate on the policy before render",
            missing.join(", ")
        ));
    }
    match operand.render_objects(policy, facts) {
        Some(objects) => Outcome::Rendered(objects),
        None => Outcome::Disabled,
    }
}

impl OperandObjects {
    /// Number of objects.
    pub fn len(&self) -> usize {
        let OperandObjects {
            service_accounts,
            cluster_roles,
            cluster_role_bindings,
            roles,
            role_bindings,
            config_maps,
            runtime_classes,
            services,
            daemon_sets,
            deployments,
            dynamic,
        } = self;
        service_accounts.len()
            + cluster_roles.len()
            + cluster_role_bindings.len()
            + roles.len()
            + role_bindings.len()
            + config_maps.len()
            + runtime_classes.len()
            + services.len()
            + daemon_sets.len()
            + deployments.len()
            + dynamic.len()
    }

    /// Whether there is no object.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every object as JSON (with `apiVersion` and `kind`), in kind order: ServiceAccounts,
    /// ClusterRoles, ClusterRoleBindings, Roles, RoleBindings, ConfigMaps, RuntimeClasses,
    /// Services, DaemonSets, Deployments, then the dynamic ones.
    pub fn to_json(&self) -> Result<Vec<Value>, serde_json::Error> {
        let OperandObjects {
            service_accounts,
            cluster_roles,
            cluster_role_bindings,
            roles,
            role_bindings,
            config_maps,
            runtime_classes,
            services,
            daemon_sets,
            deployments,
            dynamic,
        } = self;
        fn all<T: serde::Serialize>(
            items: &[T],
            out: &mut Vec<Value>,
        ) -> Result<(), serde_json::Error> {
            for item in items {
                out.push(serde_json::to_value(item)?);
            }
            Ok(())
        }
        let mut out = Vec::with_capacity(self.len());
        all(service_accounts, &mut out)?;
        all(cluster_roles, &mut out)?;
        all(cluster_role_bindings, &mut out)?;
        all(roles, &mut out)?;
        all(role_bindings, &mut out)?;
        all(config_maps, &mut out)?;
        all(runtime_classes, &mut out)?;
        all(services, &mut out)?;
        all(daemon_sets, &mut out)?;
        all(deployments, &mut out)?;
        all(dynamic, &mut out)?;
        Ok(out)
    }
}

impl DesiredState {
    /// Every rendered object as JSON, in operand order then kind order.
    pub fn to_json(&self) -> Result<Vec<Value>, serde_json::Error> {
        let mut out = Vec::new();
        for state in &self.operands {
            if let Outcome::Rendered(objects) = &state.outcome {
                out.extend(objects.to_json()?);
            }
        }
        Ok(out)
    }

    /// The state as multi-document YAML, stable from run to run: a comment line for each
    /// operand whose input is invalid, then every rendered object (operand order, then kind
    /// order). Owner references are omitted when the facts had none.
    pub fn to_yaml(&self) -> Result<String, serde_yaml_ng::Error> {
        let mut out = String::new();
        for state in &self.operands {
            if let Outcome::Invalid(message) = &state.outcome {
                for (i, line) in message.lines().enumerate() {
                    let lead = if i == 0 {
                        format!("# {} not rendered (invalid input): ", state.operand.name())
                    } else {
                        "#   ".to_owned()
                    };
                    out.push_str(&lead);
                    out.push_str(line);
                    out.push('\n');
                }
            }
        }
        let objects = self
            .to_json()
            .map_err(<serde_yaml_ng::Error as serde::ser::Error>::custom)?;
        for object in objects {
            out.push_str("---\n");
            out.push_str(&serde_yaml_ng::to_string(&identity_first(object))?);
        }
        Ok(out)
    }
}

/// The object with `apiVersion`, `kind` and `metadata` first (JSON objects sort their keys,
/// which would put them in the middle of kinds without a `spec`, such as SCCs).
fn identity_first(object: Value) -> serde_yaml_ng::Mapping {
    let mut out = serde_yaml_ng::Mapping::new();
    let Value::Object(mut map) = object else {
        return out;
    };
    for key in ["apiVersion", "kind", "metadata"] {
        if let Some(value) = map.remove(key) {
            out.insert(key.into(), to_yaml_value(value));
        }
    }
    for (key, value) in map {
        out.insert(key.into(), to_yaml_value(value));
    }
    out
}

fn to_yaml_value(value: Value) -> serde_yaml_ng::Value {
    serde_yaml_ng::to_value(value).unwrap_or(serde_yaml_ng::Value::Null)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
pub(crate) mod tests {
    use super::*;
    use crate::api::ClusterPolicy;

    /// The facts most tests use: containerd, Ubuntu 22.04 GPU nodes, namespace gpu-operator.
    pub(crate) fn facts() -> ClusterFacts {
        ClusterFacts {
            namespace: "gpu-operator".to_owned(),
            os_tag: Some("ubuntu22.04".to_owned()),
            ..ClusterFacts::default()
        }
    }

    /// A policy with `spec` given as YAML, validated against [`facts`].
    pub(crate) fn policy(spec: &str) -> ValidatedPolicy {
        policy_with(spec, &facts())
    }

    /// A policy with `spec` given as YAML, validated against `facts`.
    pub(crate) fn policy_with(spec: &str, facts: &ClusterFacts) -> ValidatedPolicy {
        let spec: ClusterPolicySpec = serde_yaml_ng::from_str(spec).unwrap();
        crate::validate::validate(&ClusterPolicy::new("cluster-policy", spec), facts)
    }

    /// The rendered objects of `operand`, panicking when it is not rendered.
    pub(crate) fn rendered(state: &DesiredState, operand: Operand) -> OperandObjects {
        let found = state
            .operands
            .iter()
            .find(|s| s.operand == operand)
            .unwrap();
        match &found.outcome {
            Outcome::Rendered(objects) => objects.clone(),
            other => panic!("{} is {other:?}", operand.name()),
        }
    }
}
