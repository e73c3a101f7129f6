//! What every stage shares (the ground floor: it imports only `api` and `facts`, and every other
//! module may import it): the operands, their objects, the label and annotation contract with
//! the cluster, and the validated policy that validate hands to render.
//!
//! Contract with the apply stage: every object carries [`MANAGED_BY_LABEL`] = [`MANAGER`] and
//! [`OPERAND_LABEL`] = the operand's [`Operand::name`], the owner reference from the facts, and
//! the namespace from the facts when namespaced.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube_core::DynamicObject;
use serde_json::Value;

use crate::api::{ClusterPolicySpec, Component, ImageKind};
use crate::facts::{ClusterFacts, SharingConfig};
use crate::nodes::NodeView;
use crate::operands::Descriptor;

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

/// Declares `Kind` and `Kind::ALL` from one list, so no kind can be left out of `ALL` (which
/// apply, prune and the watches iterate).
macro_rules! kinds {
    ($($kind:ident),+ $(,)?) => {
        /// The typed kinds of operand objects, in apply order (pruning goes in reverse). The one
        /// list: apply, prune, the watches and the e2e teardown each `match` on it without a
        /// wildcard, so a new kind does not compile until every one of them handles it.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Kind {
            $($kind),+
        }

        impl Kind {
            /// Every kind, in apply order.
            pub const ALL: [Kind; [$(stringify!($kind)),+].len()] = [$(Kind::$kind),+];
        }
    };
}

kinds![
    ServiceAccount,
    ClusterRole,
    ClusterRoleBinding,
    Role,
    RoleBinding,
    ConfigMap,
    RuntimeClass,
    Service,
    DaemonSet,
    Deployment,
];

impl Kind {
    /// `(group, version, kind, plural)` of the kind's API.
    pub const fn api(self) -> (&'static str, &'static str, &'static str, &'static str) {
        match self {
            Kind::ServiceAccount => ("", "v1", "ServiceAccount", "serviceaccounts"),
            Kind::ClusterRole => (RBAC, "v1", "ClusterRole", "clusterroles"),
            Kind::ClusterRoleBinding => (RBAC, "v1", "ClusterRoleBinding", "clusterrolebindings"),
            Kind::Role => (RBAC, "v1", "Role", "roles"),
            Kind::RoleBinding => (RBAC, "v1", "RoleBinding", "rolebindings"),
            Kind::ConfigMap => ("", "v1", "ConfigMap", "configmaps"),
            Kind::RuntimeClass => ("node.k8s.io", "v1", "RuntimeClass", "runtimeclasses"),
            Kind::Service => ("", "v1", "Service", "services"),
            Kind::DaemonSet => ("apps", "v1", "DaemonSet", "daemonsets"),
            Kind::Deployment => ("apps", "v1", "Deployment", "deployments"),
        }
    }

    /// Whether objects of the kind live in a namespace (the operator's).
    pub const fn is_namespaced(self) -> bool {
        match self {
            Kind::ClusterRole | Kind::ClusterRoleBinding | Kind::RuntimeClass => false,
            Kind::ServiceAccount
            | Kind::Role
            | Kind::RoleBinding
            | Kind::ConfigMap
            | Kind::Service
            | Kind::DaemonSet
            | Kind::Deployment => true,
        }
    }
}

const RBAC: &str = "rbac.authorization.k8s.io";

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

impl OperandObjects {
    /// Number of objects: every typed kind's (`count` matches every `Kind`) and the dynamic ones.
    pub fn len(&self) -> usize {
        Kind::ALL
            .into_iter()
            .map(|kind| self.count(kind))
            .sum::<usize>()
            + self.dynamic.len()
    }

    /// Number of objects of one typed kind.
    pub fn count(&self, kind: Kind) -> usize {
        match kind {
            Kind::ServiceAccount => self.service_accounts.len(),
            Kind::ClusterRole => self.cluster_roles.len(),
            Kind::ClusterRoleBinding => self.cluster_role_bindings.len(),
            Kind::Role => self.roles.len(),
            Kind::RoleBinding => self.role_bindings.len(),
            Kind::ConfigMap => self.config_maps.len(),
            Kind::RuntimeClass => self.runtime_classes.len(),
            Kind::Service => self.services.len(),
            Kind::DaemonSet => self.daemon_sets.len(),
            Kind::Deployment => self.deployments.len(),
        }
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

/// A unit the operator renders, applies, prunes and reports on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Operand {
    /// RuntimeClass `nvidia` (and the CDI variants): NVIDIA's "pre-requisites" state.
    RuntimeClasses,
    /// The ServiceMonitor of the operator's own metrics (`spec.operator.metrics`).
    OperatorMetrics,
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
    /// NVIDIA's DRA driver, rendered for a GPUCluster (never by a ClusterPolicy).
    DraDriver,
    /// A GPUCluster's attribute DeviceClasses (frozen alone when one is invalid).
    DraDeviceClasses,
    /// A GPUCluster's standalone DCGM host engine (`nvidia-dcgm-dra`), rendered by
    /// [`crate::operands::dcgm`] with its GPUs claimed through DRA.
    DcgmDra,
    /// A GPUCluster's DCGM exporter in DRA mode (`nvidia-dcgm-exporter-dra`), rendered by
    /// [`crate::operands::dcgm_exporter`].
    DcgmExporterDra,
    /// A GPUCluster's DRA validator (`nvidia-dra-validator`), rendered by
    /// [`crate::operands::validator`].
    DraValidator,
    /// The driver DaemonSets of one NVIDIADriver pool (never rendered by a ClusterPolicy).
    NvidiaDriver,
    /// The sandbox validator on virtual machine nodes.
    SandboxValidator,
    /// The VFIO manager on `vm-passthrough` nodes.
    VfioManager,
    /// KubeVirt's GPU device plugin on virtual machine nodes.
    SandboxDevicePlugin,
    /// The vGPU host driver on `vm-vgpu` nodes.
    VgpuManager,
    /// The vGPU device manager on `vm-vgpu` nodes.
    VgpuDeviceManager,
    /// The Kata sandbox device plugin on `vm-passthrough` nodes (sandbox mode kata).
    KataSandboxDevicePlugin,
    /// The confidential computing manager on virtual machine nodes (sandbox mode kata).
    CcManager,
}

impl Operand {
    /// Every operand, in apply order (NVIDIA's state order).
    pub const ALL: [Operand; 20] = [
        Operand::RuntimeClasses,
        Operand::OperatorMetrics,
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
        Operand::VgpuManager,
        Operand::VgpuDeviceManager,
        Operand::SandboxValidator,
        Operand::VfioManager,
        Operand::SandboxDevicePlugin,
        Operand::KataSandboxDevicePlugin,
        Operand::CcManager,
    ];

    /// The operands of a GPUCluster, in apply order ([`crate::operands::dra_driver`]).
    pub const GPU_CLUSTER: [Operand; 5] = [
        Operand::DraDriver,
        Operand::DraDeviceClasses,
        Operand::DcgmDra,
        Operand::DcgmExporterDra,
        Operand::DraValidator,
    ];

    /// Everything the engine knows about the operand, from its home module.
    pub const fn descriptor(self) -> &'static Descriptor {
        crate::operands::descriptor(self)
    }

    /// Stable name: the value of [`OPERAND_LABEL`] and the operand's name in status.
    pub const fn name(self) -> &'static str {
        self.descriptor().name
    }

    /// The node label (NVIDIA's key) whose value `true` selects the nodes the operand runs on;
    /// `None` for operands that are not per-GPU-node DaemonSets.
    pub const fn deploy_label(self) -> Option<&'static str> {
        self.descriptor().deploy_label
    }

    /// Whether `node` is labelled to run the operand (its deploy label is exactly `true`).
    pub fn runs_on(self, node: &NodeView) -> bool {
        self.deploy_label()
            .is_some_and(|k| node.label(k) == Some("true"))
    }
}

impl Operand {
    /// The ClusterPolicy switch that turns the operand on (`None`: RuntimeClasses, which follow
    /// the CDI / NRI settings, and the operands of other resources).
    pub const fn component(self) -> Option<Component> {
        self.descriptor().component
    }

    /// Whether the operand has objects to render under this policy and these facts (its switch,
    /// plus: no RuntimeClasses with the NRI plugin, no NFD where NFD already runs). The driver
    /// stays on with `useNvidiaDriverCRD`: its render leaves the nodes NVIDIADriver pools run
    /// on to them ([`crate::operands::driver::render`]), so no GPU node is left without one.
    pub fn is_enabled(self, spec: &ClusterPolicySpec, facts: &ClusterFacts) -> bool {
        self.descriptor().is_enabled(spec, facts)
    }

    /// The images the operand's pods run: its own, the validator image of its validation init
    /// containers, the device-plugin image of GFD's config-manager (only with a sharing config
    /// to mount: `sharing`).
    pub fn images(self, spec: &ClusterPolicySpec, sharing: bool) -> Vec<ImageKind> {
        (self.descriptor().images)(spec, sharing)
    }
}

/// Whether the toolkit's NRI plugin injects devices (needs CDI explicitly on).
pub fn nri_enabled(spec: &ClusterPolicySpec) -> bool {
    spec.cdi.as_ref().is_some_and(|c| c.nri_plugin_enabled())
}

/// A policy that passed validation, with what render needs precomputed.
#[derive(Clone, Debug, Default)]
pub struct ValidatedPolicy {
    /// Name of the ClusterPolicy.
    pub name: String,
    pub spec: ClusterPolicySpec,
    /// Resolved image reference per image kind, for the kinds enabled operands use. The driver's
    /// already carries the OS suffix (`...:595.91.07-ubuntu22.04`).
    pub images: BTreeMap<ImageKind, String>,
    /// Operands whose input is invalid, each with a message that names the field and the fix:
    /// frozen (their live objects are kept as they are, decision 8).
    pub invalid: BTreeMap<Operand, String>,
    /// Problems reported as an invalid config while the operand still renders: a broken sharing
    /// config (the consumers keep the last good copy), nodes asking for a MIG layout that does
    /// not fit them.
    pub reported: BTreeMap<Operand, String>,
    /// What validate noticed that is worth a line in status (a default key it inferred).
    pub notes: Vec<String>,
    /// The device-plugin sharing config the consumers are to mount: the user's when it is valid,
    /// else the last good one (decision 4); `None` without one.
    pub sharing: Option<SharingConfig>,
    /// The layouts `spec.layoutsByModel` gives each GPU node, checked (crate::by_model).
    pub by_model: crate::by_model::ByModel,
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use crate::nodes;

    use super::*;

    #[test]
    fn the_deploy_keys_are_the_operands_deploy_labels_and_the_client_key_sorted() {
        let mut from_operands: BTreeSet<&str> = Operand::ALL
            .iter()
            .filter_map(|o| o.deploy_label())
            .collect();
        from_operands.insert(nodes::DEPLOY_CLIENT);
        let listed: Vec<&str> = nodes::DEPLOY_KEYS.to_vec();
        // The container stack's keys are exactly its operands'; every operand's key is managed
        // (virtual machine keys without an operand of ours yet are written as NVIDIA does).
        let container: Vec<&str> = from_operands
            .iter()
            .copied()
            .filter(|k| !crate::workload::SANDBOX_DEPLOY_KEYS.contains(k))
            .collect();
        assert_eq!(listed, container);
        let managed: BTreeSet<&str> = crate::workload::managed_deploy_keys().collect();
        assert!(from_operands.is_subset(&managed), "{from_operands:?}");
    }
}
