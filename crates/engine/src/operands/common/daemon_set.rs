//! The cross-cutting DaemonSet rules of docs/operand-facts.md §1, applied the same way to every
//! operand by [`operand_daemon_set`] (render stage, pure).

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    DaemonSet, DaemonSetSpec, DaemonSetUpdateStrategy, RollingUpdateDaemonSet,
};
use k8s_openapi::api::core::v1::{
    Container, LocalObjectReference, PodSpec, PodTemplateSpec, ResourceRequirements,
    SecurityContext, Toleration,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::*;
use crate::api::{ClusterPolicySpec, ContainerOverrides, ImageSpec, UpdateStrategy};
use crate::facts::{ClusterFacts, ConfigMapData};
use crate::model::ValidatedPolicy;
use crate::model::{CONFIG_HASH_ANNOTATION, MANAGED_BY_LABEL, MANAGER, Operand};

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
/// one for each `nodePools` and `gpuReadiness` taint not tolerated yet (operands run on every
/// GPU node).
pub fn operand_tolerations(spec: &ClusterPolicySpec) -> Vec<Toleration> {
    let mut tolerations = spec
        .daemonsets
        .as_ref()
        .and_then(|d| d.tolerations.clone())
        .filter(|t| !t.is_empty())
        .unwrap_or_else(|| vec![gpu_toleration()]);
    let pools = crate::node_pools::operand_tolerations(spec, &tolerations);
    tolerations.extend(pools);
    let readiness = crate::gpu_readiness::operand_tolerations(spec, &tolerations);
    tolerations.extend(readiness);
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
