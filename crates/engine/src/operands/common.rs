//! Render stage, shared pieces (pure, no IO): object metadata (contract and recommended labels,
//! owner reference, namespace), container and volume helpers, RBAC helpers, SHA-256 config
//! hashing, and the cross-cutting DaemonSet rules of docs/operand-facts.md §1 applied the same way to
//! every operand in [`operand_daemon_set`].

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    DaemonSet, DaemonSetSpec, DaemonSetUpdateStrategy, RollingUpdateDaemonSet,
};
use k8s_openapi::api::core::v1::{
    ConfigMap, ConfigMapVolumeSource, Container, EmptyDirVolumeSource, EnvVar, EnvVarSource,
    HostPathVolumeSource, KeyToPath, LocalObjectReference, ObjectFieldSelector, PodSpec,
    PodTemplateSpec, ResourceRequirements, SELinuxOptions, SecurityContext, ServiceAccount,
    Toleration, Volume, VolumeMount,
};
use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use sha2::{Digest, Sha256};

use crate::api::{
    ClusterPolicySpec, ContainerOverrides, ImageKind, ImageSpec, MigStrategy, UpdateStrategy,
};
use crate::facts::{ClusterFacts, ConfigMapData, Runtime};
use crate::model::ValidatedPolicy;
use crate::model::{
    CONFIG_HASH_ANNOTATION, MANAGED_BY_LABEL, MANAGER, OPERAND_LABEL, Operand, OperandObjects,
};

/// NVIDIA's pod label that DaemonSet selectors (and mig-manager's pod waits) use.
pub const APP_LABEL: &str = "app";
/// Recommended label: the application an object belongs to (our operand name).
pub const NAME_LABEL: &str = "app.kubernetes.io/name";
/// Recommended label: the larger application; part of two NVIDIA selectors.
pub const PART_OF_LABEL: &str = "app.kubernetes.io/part-of";
/// Recommended label: the role within the application.
pub const COMPONENT_LABEL: &str = "app.kubernetes.io/component";
/// Value of [`PART_OF_LABEL`] on every object.
pub const PART_OF: &str = "gpu-operator";
/// The taint key GPU node pools carry; every operand tolerates it by default.
pub const GPU_TAINT_KEY: &str = "nvidia.com/gpu";
/// PriorityClass of operand pods unless `daemonsets.priorityClassName` names another.
pub const DEFAULT_PRIORITY_CLASS: &str = "system-node-critical";
/// Host (and container) directory of the validator's status files.
pub const VALIDATIONS_DIR: &str = "/run/nvidia/validations";
/// Default host directory of the containerised driver's root file system.
pub const DEFAULT_DRIVER_INSTALL_DIR: &str = "/run/nvidia/driver";
/// Default directory where the toolkit installs itself on the host.
pub const DEFAULT_TOOLKIT_INSTALL_DIR: &str = "/usr/local/nvidia";
/// Default MPS root on the host.
pub const DEFAULT_MPS_ROOT: &str = "/run/nvidia/mps";
/// Default kubelet root directory.
pub const DEFAULT_KUBELET_ROOT_DIR: &str = "/var/lib/kubelet";
/// Pod annotation prefix through which the NRI plugin injects CDI devices.
pub const NRI_ANNOTATION_PREFIX: &str = "nvidia.cdi.k8s.io/container.";
/// The CDI device the NRI annotation asks for: every GPU, management view.
pub const NRI_ANNOTATION_VALUE: &str = "management.nvidia.com/gpu=all";

/// Volume names the cross-cutting hostPaths rules rewrite (docs/operand-facts.md §1).
pub const HOST_ROOT_VOLUME: &str = "host-root";
pub const HOST_DEV_CHAR_VOLUME: &str = "host-dev-char";
pub const DRIVER_INSTALL_DIR_VOLUME: &str = "driver-install-dir";
/// The init container whose driver-root mount follows `hostPaths.driverInstallDir`.
pub const DRIVER_VALIDATION_CONTAINER: &str = "driver-validation";

// ---------------------------------------------------------------------------------------------
// Effective settings: what an absent field means (the CRD's defaults are already applied by
// validate; these cover sections that are absent altogether).

/// Whether CDI is used (default true).
pub fn cdi_enabled(spec: &ClusterPolicySpec) -> bool {
    spec.cdi.as_ref().is_none_or(|c| c.is_enabled())
}

pub use crate::model::nri_enabled;

/// The RuntimeClass name operand pods and workloads use (`nvidia` unless overridden).
pub fn runtime_class_name(spec: &ClusterPolicySpec) -> &str {
    spec.operator
        .as_ref()
        .map_or("nvidia", |o| o.runtime_class())
}

/// The MIG strategy, when the policy sets one.
pub fn mig_strategy(spec: &ClusterPolicySpec) -> Option<MigStrategy> {
    spec.mig.as_ref().and_then(|m| m.strategy)
}

fn non_empty(value: Option<&String>) -> Option<&str> {
    value.map(String::as_str).filter(|s| !s.is_empty())
}

/// `hostPaths.rootFS`, `/` when empty.
pub fn root_fs(spec: &ClusterPolicySpec) -> &str {
    non_empty(spec.host_paths.as_ref().and_then(|h| h.root_fs.as_ref())).unwrap_or("/")
}

/// `hostPaths.driverInstallDir`, `/run/nvidia/driver` when empty.
pub fn driver_install_dir(spec: &ClusterPolicySpec) -> &str {
    non_empty(
        spec.host_paths
            .as_ref()
            .and_then(|h| h.driver_install_dir.as_ref()),
    )
    .unwrap_or(DEFAULT_DRIVER_INSTALL_DIR)
}

/// `hostPaths.kubeletRootDir`, `/var/lib/kubelet` when empty.
pub fn kubelet_root_dir(spec: &ClusterPolicySpec) -> &str {
    non_empty(
        spec.host_paths
            .as_ref()
            .and_then(|h| h.kubelet_root_dir.as_ref()),
    )
    .unwrap_or(DEFAULT_KUBELET_ROOT_DIR)
}

/// `toolkit.installDir`, `/usr/local/nvidia` when empty.
pub fn toolkit_install_dir(spec: &ClusterPolicySpec) -> &str {
    non_empty(spec.toolkit.as_ref().and_then(|t| t.install_dir.as_ref()))
        .unwrap_or(DEFAULT_TOOLKIT_INSTALL_DIR)
}

/// `devicePlugin.mps.root`, `/run/nvidia/mps` when empty.
pub fn mps_root(spec: &ClusterPolicySpec) -> &str {
    non_empty(
        spec.device_plugin
            .as_ref()
            .and_then(|d| d.mps.as_ref())
            .and_then(|m| m.root.as_ref()),
    )
    .unwrap_or(DEFAULT_MPS_ROOT)
}

/// Joins a host directory and a relative path without doubling the slash.
pub fn join_path(dir: &str, rest: &str) -> String {
    format!(
        "{}/{}",
        dir.trim_end_matches('/'),
        rest.trim_start_matches('/')
    )
}

/// Whether operand pods that use GPUs get `runtimeClassName` (docs/operand-facts.md §1): not with the
/// NRI plugin, and not on CRI-O without CDI (the OCI hook does the work there).
pub fn sets_runtime_class(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> bool {
    !(nri_enabled(spec) || (!cdi_enabled(spec) && facts.runtime == Runtime::CriO))
}

/// The resolved image of `kind`. validate resolved every image an enabled operand needs and
/// [`crate::render::render`] checks that before calling an operand module, so the empty fallback is
/// never rendered.
pub fn image(policy: &ValidatedPolicy, kind: ImageKind) -> String {
    policy.images.get(&kind).cloned().unwrap_or_default()
}

/// A pull policy as the kubelet knows it; anything else is IfNotPresent, as NVIDIA does.
pub fn pull_policy(image: Option<&ImageSpec>) -> String {
    match image.and_then(|i| i.image_pull_policy.as_deref()) {
        Some(p @ ("Always" | "Never" | "IfNotPresent")) => p.to_owned(),
        _ => "IfNotPresent".to_owned(),
    }
}

// ---------------------------------------------------------------------------------------------
// Metadata

/// The labels every object of `operand` carries: the apply/prune contract and the recommended
/// `app.kubernetes.io/*` labels.
pub fn operand_labels(operand: Operand) -> BTreeMap<String, String> {
    BTreeMap::from([
        (MANAGED_BY_LABEL.to_owned(), MANAGER.to_owned()),
        (OPERAND_LABEL.to_owned(), operand.name().to_owned()),
        (NAME_LABEL.to_owned(), operand.name().to_owned()),
        (PART_OF_LABEL.to_owned(), PART_OF.to_owned()),
    ])
}

/// The owner reference to the ClusterPolicy, as a controller reference that blocks the owner's
/// deletion until the child is gone.
pub fn owner_references(facts: &ClusterFacts) -> Option<Vec<OwnerReference>> {
    facts.owner.as_ref().map(|owner| {
        vec![OwnerReference {
            controller: Some(true),
            block_owner_deletion: Some(true),
            ..owner.clone()
        }]
    })
}

/// Metadata of an object of `operand`: name, contract labels, owner reference, and the operator
/// namespace when `namespaced`.
pub fn meta(operand: Operand, name: &str, facts: &ClusterFacts, namespaced: bool) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        namespace: namespaced.then(|| facts.namespace.clone()),
        labels: Some(operand_labels(operand)),
        owner_references: owner_references(facts),
        ..ObjectMeta::default()
    }
}

/// Adds labels to an object's metadata (ours win over what is there).
pub fn add_labels(meta: &mut ObjectMeta, labels: &[(&str, &str)]) {
    let map = meta.labels.get_or_insert_with(BTreeMap::new);
    for (k, v) in labels {
        map.insert((*k).to_owned(), (*v).to_owned());
    }
}

/// Builds a string map from pairs.
pub fn string_map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// A ConfigMap of `operand` with the given data.
pub fn config_map(
    operand: Operand,
    name: &str,
    data: BTreeMap<String, String>,
    facts: &ClusterFacts,
) -> ConfigMap {
    ConfigMap {
        metadata: meta(operand, name, facts, true),
        data: Some(data),
        ..ConfigMap::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Hashing

/// SHA-256 (lower-case hex) over every key and value of a ConfigMap's data, each length-prefixed
/// so that no two different maps hash alike. Stable across processes and releases, unlike
/// `DefaultHasher`.
pub fn config_hash(data: &BTreeMap<String, String>) -> String {
    let mut hasher = Sha256::new();
    for (key, value) in data {
        for part in [key, value] {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part.as_bytes());
        }
    }
    hex(&hasher.finalize())
}

/// SHA-256 (lower-case hex) of arbitrary bytes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

// ---------------------------------------------------------------------------------------------
// Env

/// `name=value`.
pub fn env(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: Some(value.to_owned()),
        value_from: None,
    }
}

/// `name` from a pod field (`spec.nodeName`, `metadata.namespace`, ...).
pub fn env_field(name: &str, field_path: &str) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                api_version: None,
                field_path: field_path.to_owned(),
            }),
            ..EnvVarSource::default()
        }),
    }
}

/// Sets `var` in place if a variable of that name exists, else appends it (NVIDIA's
/// set-or-append, which keeps a variable's position stable).
pub fn set_env(envs: &mut Vec<EnvVar>, var: EnvVar) {
    match envs.iter_mut().find(|e| e.name == var.name) {
        Some(existing) => *existing = var,
        None => envs.push(var),
    }
}

/// Set-or-appends each of the user's variables (an absent value is the empty string).
pub fn merge_user_env(envs: &mut Vec<EnvVar>, user: Option<&Vec<crate::api::EnvVar>>) {
    for var in user.into_iter().flatten() {
        set_env(
            envs,
            env(&var.name, var.value.as_deref().unwrap_or_default()),
        );
    }
}

/// The literal value of `name` in `envs`, if set.
pub fn env_value<'a>(envs: &'a [EnvVar], name: &str) -> Option<&'a str> {
    envs.iter()
        .find(|e| e.name == name)
        .and_then(|e| e.value.as_deref())
}

/// The literal value of `name` in the user's variables, if set and not empty.
pub fn user_env_value<'a>(
    user: Option<&'a Vec<crate::api::EnvVar>>,
    name: &str,
) -> Option<&'a str> {
    user.into_iter()
        .flatten()
        .rev()
        .find(|e| e.name == name)
        .and_then(|e| e.value.as_deref())
        .filter(|v| !v.is_empty())
}

/// The MIG variables of the device plugin, MPS daemon and GFD (docs/operand-facts.md §1 "MIG env rule").
pub fn mig_env(spec: &ClusterPolicySpec) -> Vec<EnvVar> {
    match mig_strategy(spec) {
        None => vec![env("NVIDIA_MIG_MONITOR_DEVICES", "all")],
        Some(MigStrategy::None) => vec![env("MIG_STRATEGY", "none")],
        Some(s @ (MigStrategy::Single | MigStrategy::Mixed)) => vec![
            env("MIG_STRATEGY", mig_strategy_name(s)),
            env("NVIDIA_MIG_MONITOR_DEVICES", "all"),
        ],
    }
}

/// The value the plugins expect for a strategy.
pub const fn mig_strategy_name(strategy: MigStrategy) -> &'static str {
    match strategy {
        MigStrategy::None => "none",
        MigStrategy::Single => "single",
        MigStrategy::Mixed => "mixed",
    }
}

// ---------------------------------------------------------------------------------------------
// Containers, volumes, mounts

/// A container with a name, image and its command line.
pub fn container(name: &str, image: &str, command: &[&str], args: &[&str]) -> Container {
    let strings = |items: &[&str]| {
        (!items.is_empty()).then(|| items.iter().map(|s| (*s).to_owned()).collect())
    };
    Container {
        name: name.to_owned(),
        image: Some(image.to_owned()),
        command: strings(command),
        args: strings(args),
        ..Container::default()
    }
}

/// `privileged: true`.
pub fn privileged() -> SecurityContext {
    SecurityContext {
        privileged: Some(true),
        ..SecurityContext::default()
    }
}

/// `privileged: true` with SELinux level `s0` (containers that write host paths on SELinux
/// hosts).
pub fn privileged_s0() -> SecurityContext {
    SecurityContext {
        privileged: Some(true),
        se_linux_options: Some(SELinuxOptions {
            level: Some("s0".to_owned()),
            ..SELinuxOptions::default()
        }),
        ..SecurityContext::default()
    }
}

/// The type of a hostPath volume; it decides what the kubelet checks or creates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostPathType {
    /// No check.
    Any,
    /// Must exist and be a directory.
    Directory,
    /// Created (0755) when missing.
    DirectoryOrCreate,
    /// Must exist and be a file.
    File,
    /// Created empty when missing.
    FileOrCreate,
}

/// A hostPath volume.
pub fn host_path_volume(name: &str, path: &str, kind: HostPathType) -> Volume {
    let type_ = match kind {
        HostPathType::Any => None,
        HostPathType::Directory => Some("Directory"),
        HostPathType::DirectoryOrCreate => Some("DirectoryOrCreate"),
        HostPathType::File => Some("File"),
        HostPathType::FileOrCreate => Some("FileOrCreate"),
    };
    Volume {
        name: name.to_owned(),
        host_path: Some(HostPathVolumeSource {
            path: path.to_owned(),
            type_: type_.map(str::to_owned),
        }),
        ..Volume::default()
    }
}

/// A ConfigMap volume, optionally with a file mode and a key-to-path projection.
pub fn config_map_volume(
    name: &str,
    config_map: &str,
    mode: Option<i32>,
    items: &[(&str, &str)],
) -> Volume {
    Volume {
        name: name.to_owned(),
        config_map: Some(ConfigMapVolumeSource {
            name: config_map.to_owned(),
            default_mode: mode,
            items: (!items.is_empty()).then(|| {
                items
                    .iter()
                    .map(|(key, path)| KeyToPath {
                        key: (*key).to_owned(),
                        path: (*path).to_owned(),
                        mode: None,
                    })
                    .collect()
            }),
            optional: None,
        }),
        ..Volume::default()
    }
}

/// An emptyDir volume.
pub fn empty_dir_volume(name: &str) -> Volume {
    Volume {
        name: name.to_owned(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Volume::default()
    }
}

/// A read-write mount of volume `name` at `path`.
pub fn mount(name: &str, path: &str) -> VolumeMount {
    VolumeMount {
        name: name.to_owned(),
        mount_path: path.to_owned(),
        ..VolumeMount::default()
    }
}

/// Modifiers for [`mount`].
pub trait MountExt {
    /// `readOnly: true`.
    fn read_only(self) -> Self;
    /// `mountPropagation: HostToContainer`: mounts the host makes later show up inside.
    fn host_to_container(self) -> Self;
    /// `mountPropagation: Bidirectional`: mounts made inside show up on the host (the driver
    /// container publishes its root under /run/nvidia/driver this way).
    fn bidirectional(self) -> Self;
    /// Mounts one file or directory of the volume.
    fn sub_path(self, path: &str) -> Self;
}

impl MountExt for VolumeMount {
    fn read_only(mut self) -> Self {
        self.read_only = Some(true);
        self
    }
    fn host_to_container(mut self) -> Self {
        self.mount_propagation = Some("HostToContainer".to_owned());
        self
    }
    fn bidirectional(mut self) -> Self {
        self.mount_propagation = Some("Bidirectional".to_owned());
        self
    }
    fn sub_path(mut self, path: &str) -> Self {
        self.sub_path = Some(path.to_owned());
        self
    }
}

// ---------------------------------------------------------------------------------------------
// RBAC

/// A policy rule.
pub fn rule(groups: &[&str], resources: &[&str], verbs: &[&str]) -> PolicyRule {
    let strings = |items: &[&str]| items.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    PolicyRule {
        api_groups: Some(strings(groups)),
        resources: Some(strings(resources)),
        verbs: strings(verbs),
        resource_names: None,
        non_resource_urls: None,
    }
}

/// A policy rule limited to named objects.
pub fn rule_named(
    groups: &[&str],
    resources: &[&str],
    names: &[&str],
    verbs: &[&str],
) -> PolicyRule {
    PolicyRule {
        resource_names: Some(names.iter().map(|s| (*s).to_owned()).collect()),
        ..rule(groups, resources, verbs)
    }
}

/// The identity of one operand's pods: a ServiceAccount `name` in the operator namespace, and
/// when rules are given a Role and/or ClusterRole of the same name bound to it. Empty rule sets
/// create nothing (least privilege).
pub fn add_identity(
    objects: &mut OperandObjects,
    operand: Operand,
    name: &str,
    role_rules: Vec<PolicyRule>,
    cluster_rules: Vec<PolicyRule>,
    facts: &ClusterFacts,
) {
    objects.service_accounts.push(ServiceAccount {
        metadata: meta(operand, name, facts, true),
        ..ServiceAccount::default()
    });
    if !role_rules.is_empty() {
        add_role(objects, operand, name, name, role_rules, facts);
    }
    if !cluster_rules.is_empty() {
        add_cluster_role(objects, operand, name, name, cluster_rules, facts);
    }
}

/// A Role `role` in the operator namespace bound to ServiceAccount `service_account` there.
pub fn add_role(
    objects: &mut OperandObjects,
    operand: Operand,
    role: &str,
    service_account: &str,
    rules: Vec<PolicyRule>,
    facts: &ClusterFacts,
) {
    objects.roles.push(Role {
        metadata: meta(operand, role, facts, true),
        rules: Some(rules),
    });
    objects.role_bindings.push(RoleBinding {
        metadata: meta(operand, role, facts, true),
        role_ref: role_ref("Role", role),
        subjects: Some(vec![service_account_subject(service_account, facts)]),
    });
}

fn service_account_subject(name: &str, facts: &ClusterFacts) -> Subject {
    Subject {
        kind: "ServiceAccount".to_owned(),
        name: name.to_owned(),
        namespace: Some(facts.namespace.clone()),
        api_group: None,
    }
}

/// A ClusterRole `role` bound to ServiceAccount `service_account` of the operator namespace.
pub fn add_cluster_role(
    objects: &mut OperandObjects,
    operand: Operand,
    role: &str,
    service_account: &str,
    rules: Vec<PolicyRule>,
    facts: &ClusterFacts,
) {
    objects.cluster_roles.push(ClusterRole {
        metadata: meta(operand, role, facts, false),
        rules: Some(rules),
        aggregation_rule: None,
    });
    objects.cluster_role_bindings.push(ClusterRoleBinding {
        metadata: meta(operand, role, facts, false),
        role_ref: role_ref("ClusterRole", role),
        subjects: Some(vec![service_account_subject(service_account, facts)]),
    });
}

fn role_ref(kind: &str, name: &str) -> RoleRef {
    RoleRef {
        api_group: Some("rbac.authorization.k8s.io".to_owned()),
        kind: kind.to_owned(),
        name: name.to_owned(),
    }
}

// ---------------------------------------------------------------------------------------------
// The cross-cutting DaemonSet rules

/// Whether an operand's pods get `runtimeClassName` and the NRI annotation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuAccess {
    /// Driver, toolkit and node-status exporter: never through the NVIDIA runtime.
    None,
    /// Pods that use GPUs through the NVIDIA runtime; the NRI annotation is keyed on this
    /// container.
    Runtime { nri_container: &'static str },
}

/// What an operand module decides about its DaemonSet; [`operand_daemon_set`] adds everything
/// the policy says about all operands.
#[derive(Clone, Debug)]
pub struct OperandDaemonSet<'a> {
    pub operand: Operand,
    /// DaemonSet name and `app` label (NVIDIA's, decision 1).
    pub name: &'static str,
    /// Selector labels besides `app` (validator and GFD carry `part-of` in theirs).
    pub extra_selector: Vec<(&'static str, &'static str)>,
    /// Labels on the DaemonSet and its pods.
    pub labels: BTreeMap<String, String>,
    /// Labels on the pods only.
    pub pod_labels: BTreeMap<String, String>,
    /// Annotations on the DaemonSet only.
    pub annotations: BTreeMap<String, String>,
    /// Annotations on the pod template only.
    pub pod_annotations: BTreeMap<String, String>,
    /// Containers, volumes, service account, host namespaces.
    pub pod: PodSpec,
    /// The container the user's `args` (and the module's env merge) apply to.
    pub main_container: &'static str,
    /// The operand's image section: pull policy and pull secrets.
    pub image: Option<&'a ImageSpec>,
    /// The operand's resources and args.
    pub overrides: Option<&'a ContainerOverrides>,
    pub host_network: bool,
    pub gpu_access: GpuAccess,
    /// Nodes must also carry these labels.
    pub extra_node_selector: Vec<(&'static str, &'static str)>,
    /// Hash of the configuration the pods consume ([`CONFIG_HASH_ANNOTATION`]).
    pub config_hash: Option<String>,
    /// The driver: OnDelete whatever the policy says.
    pub always_on_delete: bool,
}

impl<'a> OperandDaemonSet<'a> {
    /// A DaemonSet of `operand` named `name` running `pod`, whose main container is `main`.
    pub fn new(operand: Operand, name: &'static str, pod: PodSpec, main: &'static str) -> Self {
        Self {
            operand,
            name,
            extra_selector: Vec::new(),
            labels: BTreeMap::new(),
            pod_labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            pod_annotations: BTreeMap::new(),
            pod,
            main_container: main,
            image: None,
            overrides: None,
            host_network: false,
            gpu_access: GpuAccess::None,
            extra_node_selector: Vec::new(),
            config_hash: None,
            always_on_delete: false,
        }
    }
}

/// The default toleration of every operand: the GPU taint, any value, NoSchedule.
pub fn gpu_toleration() -> Toleration {
    Toleration {
        key: Some(GPU_TAINT_KEY.to_owned()),
        operator: Some("Exists".to_owned()),
        effect: Some("NoSchedule".to_owned()),
        ..Toleration::default()
    }
}

/// `daemonsets.tolerations` when non-empty (it replaces the default), else the default; plus
/// one for each `nodePools` taint not tolerated yet (operands run on every GPU node).
pub fn operand_tolerations(spec: &ClusterPolicySpec) -> Vec<Toleration> {
    let mut tolerations = spec
        .daemonsets
        .as_ref()
        .and_then(|d| d.tolerations.clone())
        .filter(|t| !t.is_empty())
        .unwrap_or_else(|| vec![gpu_toleration()]);
    let pools = crate::node_pools::operand_tolerations(spec, &tolerations);
    tolerations.extend(pools);
    tolerations
}

/// `daemonsets.priorityClassName` when non-empty, else `system-node-critical`.
pub fn priority_class(spec: &ClusterPolicySpec) -> String {
    non_empty(
        spec.daemonsets
            .as_ref()
            .and_then(|d| d.priority_class_name.as_ref()),
    )
    .unwrap_or(DEFAULT_PRIORITY_CLASS)
    .to_owned()
}

fn update_strategy(
    spec: &ClusterPolicySpec,
    always_on_delete: bool,
) -> Option<DaemonSetUpdateStrategy> {
    let daemonsets = spec.daemonsets.as_ref();
    let on_delete = daemonsets.and_then(|d| d.update_strategy) == Some(UpdateStrategy::OnDelete);
    if always_on_delete || on_delete {
        return Some(DaemonSetUpdateStrategy {
            type_: Some("OnDelete".to_owned()),
            rolling_update: None,
        });
    }
    let max_unavailable = daemonsets
        .and_then(|d| d.rolling_update.as_ref())
        .and_then(|r| r.max_unavailable.clone())?;
    // NVIDIA reads a string without `%` as a number of nodes.
    let max_unavailable = match max_unavailable {
        IntOrString::String(s) if !s.ends_with('%') => match s.trim().parse::<i32>() {
            Ok(n) => IntOrString::Int(n),
            Err(_) => IntOrString::String(s),
        },
        other => other,
    };
    Some(DaemonSetUpdateStrategy {
        type_: Some("RollingUpdate".to_owned()),
        rolling_update: Some(RollingUpdateDaemonSet {
            max_unavailable: Some(max_unavailable),
            max_surge: None,
        }),
    })
}

fn to_k8s_resources(resources: &crate::api::ResourceRequirements) -> ResourceRequirements {
    ResourceRequirements {
        limits: resources.limits.clone(),
        requests: resources.requests.clone(),
        claims: None,
    }
}

fn is_validation(container: &Container) -> bool {
    container.name.contains("validation")
}

/// Adds the user's labels (minus the keys selectors use) and then `ours` on top.
fn merged(
    user: Option<&BTreeMap<String, String>>,
    ours: BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = user
        .into_iter()
        .flatten()
        .filter(|(k, _)| k.as_str() != APP_LABEL && k.as_str() != PART_OF_LABEL)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    out.extend(ours);
    out
}

/// The operand's DaemonSet with every cross-cutting rule of docs/operand-facts.md §1 applied:
/// deploy-label nodeSelector, tolerations, priority class, pod security context, update
/// strategy, labels and annotations, pull policy and secrets, resources, args, host network,
/// validation init containers, runtimeClassName and NRI annotation, hostPaths, config hash.
pub fn operand_daemon_set(
    policy: &ValidatedPolicy,
    facts: &ClusterFacts,
    ds: OperandDaemonSet<'_>,
) -> DaemonSet {
    let spec = &policy.spec;
    let daemonsets = spec.daemonsets.as_ref();
    let validator = spec.validator.as_ref();
    let mut pod = ds.pod;

    let mut node_selector = BTreeMap::new();
    if let Some(key) = ds.operand.deploy_label() {
        node_selector.insert(key.to_owned(), "true".to_owned());
    }
    for (k, v) in &ds.extra_node_selector {
        node_selector.insert((*k).to_owned(), (*v).to_owned());
    }
    pod.node_selector = Some(node_selector);
    pod.tolerations = Some(operand_tolerations(spec));
    pod.priority_class_name = Some(priority_class(spec));
    if let Some(psc) = daemonsets.and_then(|d| d.pod_security_context.clone()) {
        pod.security_context = Some(psc);
    }
    if ds.host_network {
        pod.host_network = Some(true);
        pod.dns_policy = Some("ClusterFirstWithHostNet".to_owned());
    }

    let mut pod_annotations = ds.pod_annotations;
    if let GpuAccess::Runtime { nri_container } = ds.gpu_access {
        if sets_runtime_class(spec, facts) {
            pod.runtime_class_name = Some(runtime_class_name(spec).to_owned());
        }
        if nri_enabled(spec) {
            pod_annotations.insert(
                format!("{NRI_ANNOTATION_PREFIX}{nri_container}"),
                NRI_ANNOTATION_VALUE.to_owned(),
            );
        }
    }

    // Containers.
    let operand_policy = pull_policy(ds.image);
    let validator_image = validator.map(|v| &v.image);
    let validator_policy = pull_policy(validator_image);
    let operand_resources = ds
        .overrides
        .and_then(|o| o.resources.as_ref())
        .map(to_k8s_resources);
    let validator_resources = validator
        .and_then(|v| v.container.resources.as_ref())
        .map(to_k8s_resources);
    let user_args = ds
        .overrides
        .and_then(|o| o.args.clone())
        .filter(|a| !a.is_empty());
    let root = root_fs(spec);
    let install_dir = driver_install_dir(spec);
    let mut uses_validator = false;
    for c in pod
        .init_containers
        .iter_mut()
        .flatten()
        .chain(pod.containers.iter_mut())
    {
        if is_validation(c) {
            uses_validator = true;
            c.image_pull_policy = Some(validator_policy.clone());
            if validator_resources.is_some() {
                c.resources = validator_resources.clone();
            }
            let sc = c
                .security_context
                .get_or_insert_with(SecurityContext::default);
            sc.run_as_user = Some(0);
            let step_env = if c.name.starts_with("driver") {
                validator
                    .and_then(|v| v.driver.as_ref())
                    .and_then(|s| s.env.as_ref())
            } else if c.name.starts_with("toolkit") {
                validator
                    .and_then(|v| v.toolkit.as_ref())
                    .and_then(|s| s.env.as_ref())
            } else {
                None
            };
            if step_env.is_some() {
                merge_user_env(c.env.get_or_insert_with(Vec::new), step_env);
            }
            if c.name == DRIVER_VALIDATION_CONTAINER && install_dir != DEFAULT_DRIVER_INSTALL_DIR {
                let envs = c.env.get_or_insert_with(Vec::new);
                set_env(envs, env("DRIVER_INSTALL_DIR", install_dir));
                set_env(envs, env("DRIVER_INSTALL_DIR_CTR_PATH", install_dir));
                for m in c.volume_mounts.iter_mut().flatten() {
                    if m.name == DRIVER_INSTALL_DIR_VOLUME {
                        m.mount_path = install_dir.to_owned();
                    }
                }
            }
        } else {
            c.image_pull_policy = Some(operand_policy.clone());
            if operand_resources.is_some() {
                c.resources = operand_resources.clone();
            }
        }
        if c.name == ds.main_container
            && let Some(args) = &user_args
        {
            c.args = Some(args.clone());
        }
        if root != "/" {
            set_env(c.env.get_or_insert_with(Vec::new), env("HOST_ROOT", root));
        }
    }
    for v in pod.volumes.iter_mut().flatten() {
        let Some(host_path) = v.host_path.as_mut() else {
            continue;
        };
        match v.name.as_str() {
            HOST_ROOT_VOLUME if root != "/" => host_path.path = root.to_owned(),
            HOST_DEV_CHAR_VOLUME if root != "/" => host_path.path = join_path(root, "dev/char"),
            DRIVER_INSTALL_DIR_VOLUME => host_path.path = install_dir.to_owned(),
            _ => {}
        }
    }

    let mut secrets: Vec<String> = Vec::new();
    let secret_sources = ds
        .image
        .and_then(|i| i.image_pull_secrets.as_ref())
        .into_iter()
        .chain(
            uses_validator
                .then(|| validator_image.and_then(|i| i.image_pull_secrets.as_ref()))
                .flatten(),
        );
    for name in secret_sources.flatten() {
        if !name.is_empty() && !secrets.contains(name) {
            secrets.push(name.clone());
        }
    }
    if !secrets.is_empty() {
        pod.image_pull_secrets = Some(
            secrets
                .into_iter()
                .map(|name| LocalObjectReference { name })
                .collect(),
        );
    }

    // Labels and annotations.
    let mut selector = BTreeMap::from([(APP_LABEL.to_owned(), ds.name.to_owned())]);
    for (k, v) in &ds.extra_selector {
        selector.insert((*k).to_owned(), (*v).to_owned());
    }
    let user_labels = daemonsets.and_then(|d| d.labels.as_ref());
    let user_annotations = daemonsets.and_then(|d| d.annotations.as_ref());

    let mut template_labels = ds.labels.clone();
    template_labels.extend(ds.pod_labels.clone());
    template_labels.insert(NAME_LABEL.to_owned(), ds.operand.name().to_owned());
    template_labels.insert(PART_OF_LABEL.to_owned(), PART_OF.to_owned());
    template_labels.insert(MANAGED_BY_LABEL.to_owned(), MANAGER.to_owned());
    template_labels.extend(selector.clone());
    let template_labels = merged(user_labels, template_labels);

    let mut ds_labels = ds.labels;
    ds_labels.insert(APP_LABEL.to_owned(), ds.name.to_owned());
    ds_labels.extend(operand_labels(ds.operand));
    let ds_labels = merged(user_labels, ds_labels);

    if let Some(hash) = ds.config_hash {
        pod_annotations.insert(CONFIG_HASH_ANNOTATION.to_owned(), hash);
    }
    let mut all_pod_annotations: BTreeMap<String, String> =
        user_annotations.cloned().unwrap_or_default();
    all_pod_annotations.extend(pod_annotations);
    let mut ds_annotations: BTreeMap<String, String> =
        user_annotations.cloned().unwrap_or_default();
    ds_annotations.extend(ds.annotations);

    let mut metadata = meta(ds.operand, ds.name, facts, true);
    metadata.labels = Some(ds_labels);
    metadata.annotations = (!ds_annotations.is_empty()).then_some(ds_annotations);

    DaemonSet {
        metadata,
        spec: Some(DaemonSetSpec {
            selector: LabelSelector {
                match_labels: Some(selector),
                match_expressions: None,
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(template_labels),
                    annotations: (!all_pod_annotations.is_empty()).then_some(all_pod_annotations),
                    ..ObjectMeta::default()
                }),
                spec: Some(pod),
            },
            update_strategy: update_strategy(spec, ds.always_on_delete),
            min_ready_seconds: None,
            revision_history_limit: None,
        }),
        status: None,
    }
}

/// The problem with a ConfigMap the policy names at `field` (`found`: the one read, if any):
/// missing, or without the key the operand reads. The same text for the operator and for
/// `gpu-operator render`, since both go through validate.
pub fn config_map_problem(
    field: &str,
    name: &str,
    key: &str,
    found: Option<&ConfigMapData>,
    facts: &ClusterFacts,
    alternative: &str,
) -> Option<String> {
    match found.filter(|cm| cm.name == name) {
        None => Some(format!(
            "{field}: ConfigMap {name} was not found in namespace {}: create it with the key \
             {key}, {alternative}",
            facts.namespace
        )),
        Some(cm) if !cm.data.contains_key(key) => Some(format!(
            "{field}: ConfigMap {name} has no key {key}: add it, {alternative}"
        )),
        Some(_) => None,
    }
}
