//! Render stage, vGPU device manager (pure, no IO): DaemonSet `nvidia-vgpu-device-manager` on
//! `vm-vgpu` nodes. Once the vGPU manager (the host driver) is ready it creates the vGPU
//! devices of the config each node's `nvidia.com/vgpu.config` label names (or
//! `vgpuDeviceManager.config.default`), pausing the sandbox device plugin and validator while it
//! does (docs/operand-facts.md §20.4, §20.5). On with sandbox workloads and
//! `vgpuDeviceManager.enabled`.
//!
//! The configs reach the pods only through an operator-owned, immutable copy named by its
//! content (as the sharing config does, decision 4): the user's ConfigMap
//! (`vgpuDeviceManager.config.name`) or our default `default-vgpu-devices-config`. An edit that
//! does not parse, or drops the default config or one a node still names, is reported and not
//! rolled out: the DaemonSet keeps mounting the copy it mounts now.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Container, PodSpec};

use super::common::{
    self, DRIVER_INSTALL_DIR_VOLUME, HOST_ROOT_VOLUME, HostPathType, MountExt, OperandDaemonSet,
    VALIDATIONS_DIR, env, env_field, host_path_volume, merge_user_env, mount, rule,
};
use super::openshift;
use super::validator::VALIDATIONS_VOLUME;
use crate::api::{ClusterPolicySpec, Component, ImageKind, VgpuDeviceManagerSpec};
use crate::facts::ClusterFacts;
use crate::model::{Operand, OperandObjects, ValidatedPolicy};
use crate::nodes::NodeView;
use crate::sharing::vgpu::{self, CONFIG_KEY, VgpuConfigFile};
use crate::workload::Sandbox;

/// What the engine knows about this operand ([`super::Descriptor`]).
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "vgpu-device-manager",
    component: Some(Component::VgpuDeviceManager),
    deploy_label: Some(crate::workload::DEPLOY_VGPU_DEVICE_MANAGER),
    consumes_sharing_config: false,
    enabled: super::Enabled::BySwitch,
    images: |_, _| vec![ImageKind::VgpuDeviceManager, ImageKind::Validator],
    host_paths: super::defaults::no_host_paths,
    render,
    check,
    report,
};

/// DaemonSet name and `app` label (NVIDIA's).
pub const NAME: &str = "nvidia-vgpu-device-manager";
/// ServiceAccount, Role, ClusterRole and SCC name.
pub const SERVICE_ACCOUNT: &str = "nvidia-vgpu-device-manager";
pub const MAIN_CONTAINER: &str = "nvidia-vgpu-device-manager";
pub const VGPU_MANAGER_VALIDATION: &str = "vgpu-manager-validation";
/// The configs rendered when the policy names no ConfigMap (NVIDIA's name).
pub const DEFAULT_CONFIG_MAP: &str = "default-vgpu-devices-config";
/// The config nodes without a label get when `vgpuDeviceManager.config.default` is unset.
pub const DEFAULT_CONFIG: &str = "default";
/// The admission policy keeping its node writes to its own node.
pub const CONFINEMENT_POLICY: &str = "nvidia-vgpu-device-manager-own-node";
/// Volume of the config copy; where it is mounted.
pub const CONFIG_VOLUME: &str = "vgpu-config";
pub const CONFIG_DIR: &str = "/vgpu-config";
/// Annotation of a copy naming the ConfigMap it was made from.
pub const CONFIG_SOURCE_ANNOTATION: &str = super::device_plugin::CONFIG_SOURCE_ANNOTATION;

const HOST_SYS: &str = "host-sys";

/// Our default configs (the §20.5 format): `default` gives every GPU of a node the type that
/// splits it into the most vGPUs for the common data-centre boards, by PCI device ID; the
/// others fill every GPU of a node with one type (1:1 GPU to vGPU, or a MIG-backed half).
const DEFAULT_CONFIGS: &str = r#"version: v1
vgpu-configs:
  # Nodes without an nvidia.com/vgpu.config label: the smallest Q-series type per board.
  default:
  - device-filter: "0x223610DE" # A10
    devices: all
    vgpu-devices:
      A10-4Q: 6
  - device-filter: "0x20B710DE" # A30
    devices: all
    vgpu-devices:
      A30-4C: 6
  - device-filter: ["0x20B010DE", "0x20F110DE"] # A100 40GB (SXM4, PCIe)
    devices: all
    vgpu-devices:
      A100-4C: 10
  - device-filter: "0x26B910DE" # L40S
    devices: all
    vgpu-devices:
      L40S-4Q: 12
  A10-24Q:
  - devices: all
    vgpu-devices:
      A10-24Q: 1
  A30-24C:
  - devices: all
    vgpu-devices:
      A30-24C: 1
  A30-2-12C:
  - devices: all
    vgpu-devices:
      A30-2-12C: 2
  A100-40C:
  - devices: all
    vgpu-devices:
      A100-40C: 1
  A100-3-20C:
  - devices: all
    vgpu-devices:
      A100-3-20C: 2
  L40S-12Q:
  - devices: all
    vgpu-devices:
      L40S-12Q: 4
  L40S-48Q:
  - devices: all
    vgpu-devices:
      L40S-48Q: 1
"#;

/// The default configs' ConfigMap data.
pub fn default_configs() -> BTreeMap<String, String> {
    BTreeMap::from([(CONFIG_KEY.to_owned(), DEFAULT_CONFIGS.to_owned())])
}

/// The ConfigMap the policy names for the configs, if it names one other than the default.
pub fn custom_config_name(spec: &ClusterPolicySpec) -> Option<&str> {
    spec.vgpu_device_manager
        .as_ref()
        .and_then(|m| m.config.as_ref())
        .and_then(|c| c.name.as_deref())
        .filter(|n| !n.is_empty() && *n != DEFAULT_CONFIG_MAP)
}

/// `DEFAULT_VGPU_CONFIG`: `vgpuDeviceManager.config.default`, else `default`.
pub fn default_config_name(spec: &ClusterPolicySpec) -> &str {
    spec.vgpu_device_manager
        .as_ref()
        .and_then(|m| m.config.as_ref())
        .and_then(|c| c.default.as_deref())
        .filter(|d| !d.is_empty())
        .unwrap_or(DEFAULT_CONFIG)
}

/// The config copy the live DaemonSet mounts ("last good": it lives in the cluster, so it
/// survives an operator restart).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum LiveConfig {
    /// No live DaemonSet, or one without a copy.
    #[default]
    Nothing,
    /// The copy it mounts: the ConfigMap it was made from and its data.
    Copy {
        source: String,
        data: BTreeMap<String, String>,
    },
    /// It mounts a copy that no longer exists (someone deleted it).
    Gone(String),
}

/// The name of the copy a live DaemonSet mounts (the inverse of [`render`]'s config volume).
pub fn mounted_copy(ds: &DaemonSet) -> Option<String> {
    let pod = ds.spec.as_ref()?.template.spec.as_ref()?;
    pod.volumes
        .iter()
        .flatten()
        .find(|v| v.name == CONFIG_VOLUME)?
        .config_map
        .as_ref()
        .map(|c| c.name.clone())
}

/// [`LiveConfig`] from the live DaemonSet and a lookup of ConfigMaps by name.
pub fn live_config(
    ds: Option<&DaemonSet>,
    config_map: impl Fn(&str) -> Option<std::sync::Arc<ConfigMap>>,
) -> LiveConfig {
    let Some(copy) = ds.and_then(mounted_copy) else {
        return LiveConfig::Nothing;
    };
    match config_map(&copy) {
        Some(cm) => LiveConfig::Copy {
            source: cm
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(CONFIG_SOURCE_ANNOTATION))
                .cloned()
                .unwrap_or_else(|| copy.clone()),
            data: cm.data.clone().unwrap_or_default(),
        },
        None => LiveConfig::Gone(copy),
    }
}

/// What the pods mount: the configs of `source`, as the copy `copy_name`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mounted {
    pub source: String,
    pub data: BTreeMap<String, String>,
    pub hash: String,
    pub copy_name: String,
}

impl Mounted {
    fn new(source: &str, data: BTreeMap<String, String>) -> Self {
        let hash = common::config_hash(&data);
        Mounted {
            copy_name: common::hashed_name(source, &hash),
            source: source.to_owned(),
            data,
            hash,
        }
    }
}

/// What validate decides about the configs (pure): what the pods mount, what is reported while
/// they keep running, and what freezes the operand.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decision {
    pub mounted: Option<Mounted>,
    /// Reported; the DaemonSet renders with `mounted`.
    pub problem: Option<String>,
    /// Freezes the operand: nothing valid to mount, so rendering would change what nodes run.
    pub freeze: Option<String>,
}

/// The vm-vgpu GPU nodes, the ones whose `nvidia.com/vgpu.config` label matters.
fn vgpu_nodes<'a>(spec: &ClusterPolicySpec, facts: &'a ClusterFacts) -> Vec<&'a NodeView> {
    Sandbox::of(spec)
        .nodes_running(&facts.gpu_nodes, crate::api::SandboxWorkload::VmVgpu)
        .map(AsRef::as_ref)
        .collect()
}

/// Decides the configs from the user's ConfigMap (or ours), the nodes' labels and the copy the
/// live DaemonSet mounts.
pub fn decide(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Decision {
    let (source, data) = match custom_config_name(spec) {
        None => (DEFAULT_CONFIG_MAP, Some(default_configs())),
        Some(name) => (
            name,
            facts
                .vgpu_config
                .as_ref()
                .filter(|cm| cm.name == name)
                .map(|cm| cm.data.clone()),
        ),
    };
    let problem = match &data {
        None => format!(
            "spec.vgpuDeviceManager.config.name names ConfigMap {source}, which does not exist \
             in namespace {}: create it with the key {CONFIG_KEY}, fix the name, or remove the \
             field to use the default configs",
            facts.namespace
        ),
        Some(data) => match vgpu::parse_config(source, data) {
            Ok(file) => match removed_configs(spec, facts, source, &file) {
                None => {
                    return Decision {
                        mounted: Some(Mounted::new(source, data.clone())),
                        ..Decision::default()
                    };
                }
                Some(problem) => problem,
            },
            Err(found) => found
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; "),
        },
    };
    match &facts.vgpu_live_config {
        LiveConfig::Copy { source, data } => {
            let last = Mounted::new(source, data.clone());
            Decision {
                problem: Some(format!(
                    "{problem} (not rolled out: the vGPU device manager keeps the last good \
                     config {})",
                    last.copy_name
                )),
                mounted: Some(last),
                freeze: None,
            }
        }
        LiveConfig::Nothing => Decision {
            freeze: Some(format!(
                "{problem} (the vGPU device manager is not deployed until this is fixed)"
            )),
            ..Decision::default()
        },
        LiveConfig::Gone(copy) => Decision {
            freeze: Some(format!(
                "{problem} (the last good config {copy} that the pods mount was deleted; live \
                 objects kept as they are)"
            )),
            ..Decision::default()
        },
    }
}

/// Configs a valid file lacks that must be there for the edit to roll out: the default config
/// (nodes without a label get it), and any a node's label names while the running copy has it
/// (the edit removed it). A label that names a config neither has is the label's problem, which
/// [`report`] names.
fn removed_configs(
    spec: &ClusterPolicySpec,
    facts: &ClusterFacts,
    source: &str,
    file: &VgpuConfigFile,
) -> Option<String> {
    let default = default_config_name(spec);
    if !file.configs.contains_key(default) {
        let field = if default == DEFAULT_CONFIG {
            "the default config name".to_owned()
        } else {
            "spec.vgpuDeviceManager.config.default".to_owned()
        };
        return Some(format!(
            "ConfigMap {source}, key {CONFIG_KEY:?}: vgpu-configs has no config {default:?}, \
             which {field} names and nodes without a {} label get (its configs: {}); add it, or \
             set spec.vgpuDeviceManager.config.default to one of them",
            vgpu::VGPU_CONFIG_LABEL,
            file.names().join(", ")
        ));
    }
    let LiveConfig::Copy { data, .. } = &facts.vgpu_live_config else {
        return None;
    };
    let running = vgpu::parse_config(source, data).ok()?;
    let removed: Vec<String> = vgpu_nodes(spec, facts)
        .into_iter()
        .filter_map(|n| {
            let wanted = n.label(vgpu::VGPU_CONFIG_LABEL)?;
            (running.configs.contains_key(wanted) && !file.configs.contains_key(wanted))
                .then(|| format!("{wanted} (node {})", n.name))
        })
        .collect();
    (!removed.is_empty()).then(|| {
        format!(
            "ConfigMap {source}, key {CONFIG_KEY:?}: the edit removes configs that nodes still \
             name with {}: {}; keep them, or relabel those nodes first",
            vgpu::VGPU_CONFIG_LABEL,
            removed.join(", ")
        )
    })
}

/// What freezes the operand: an invalid config with nothing good to keep running.
pub fn check(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Vec<String> {
    decide(spec, facts).freeze.into_iter().collect()
}

/// Reported while it runs: an invalid config it does not roll out, and vm-vgpu nodes whose
/// label names a config the mounted file lacks.
pub fn report(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Option<String> {
    let decision = decide(spec, facts);
    let nodes = decision.mounted.as_ref().and_then(|m| {
        let file = vgpu::parse_config(&m.source, &m.data).ok()?;
        vgpu::node_report(&m.source, &file, &vgpu_nodes(spec, facts))
    });
    match (decision.problem, nodes) {
        (Some(problem), Some(nodes)) => Some(format!("{problem}; {nodes}")),
        (problem, nodes) => problem.or(nodes),
    }
}

/// The copy as an immutable ConfigMap of this operand.
fn copy_config_map(mounted: &Mounted, facts: &ClusterFacts) -> ConfigMap {
    let mut cm = common::config_map(
        Operand::VgpuDeviceManager,
        &mounted.copy_name,
        mounted.data.clone(),
        facts,
    );
    common::add_labels(&mut cm.metadata, &[(common::CONFIG_COPY_LABEL, "vgpu")]);
    cm.metadata.annotations = Some(BTreeMap::from([(
        CONFIG_SOURCE_ANNOTATION.to_owned(),
        mounted.source.clone(),
    )]));
    // A new config is a new copy, and pods roll to it.
    cm.immutable = Some(true);
    cm
}

/// Waits for the sandbox validator's vGPU manager check: the host driver (ours, or one
/// installed on the host) is loaded and its vGPU parents exist.
fn wait_for_vgpu_manager(policy: &ValidatedPolicy) -> Container {
    let script = format!(
        "until [ -f {dir}/vgpu-manager-ready ] || [ -f {dir}/host-vgpu-manager-ready ]; do \
         echo waiting for the vGPU manager; sleep 5; done",
        dir = VALIDATIONS_DIR
    );
    Container {
        security_context: Some(common::privileged()),
        volume_mounts: Some(vec![
            mount(VALIDATIONS_VOLUME, VALIDATIONS_DIR).bidirectional(),
        ]),
        ..common::container(
            VGPU_MANAGER_VALIDATION,
            &common::image(policy, ImageKind::Validator),
            &["sh", "-c"],
            &[&script],
        )
    }
}

pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> Option<OperandObjects> {
    let spec = &policy.spec;
    if !spec.is_enabled(Component::VgpuDeviceManager) {
        return None;
    }
    // Frozen (check) when there is nothing to mount.
    let mounted = decide(spec, facts).mounted?;
    let default_manager = VgpuDeviceManagerSpec::default();
    let manager = spec
        .vgpu_device_manager
        .as_ref()
        .unwrap_or(&default_manager);

    let mut envs = vec![
        env_field("NAMESPACE", "metadata.namespace"),
        env_field("NODE_NAME", "spec.nodeName"),
        env("CONFIG_FILE", &format!("{CONFIG_DIR}/{CONFIG_KEY}")),
        env("DEFAULT_VGPU_CONFIG", default_config_name(spec)),
    ];
    merge_user_env(&mut envs, manager.container.env.as_ref());
    let main = Container {
        env: Some(envs),
        security_context: Some(common::privileged()),
        volume_mounts: Some(vec![
            mount(CONFIG_VOLUME, CONFIG_DIR).read_only(),
            mount(HOST_SYS, "/sys"),
            mount(HOST_ROOT_VOLUME, "/host").host_to_container(),
            mount(DRIVER_INSTALL_DIR_VOLUME, "/driver-root").host_to_container(),
        ]),
        // The image's own entrypoint (nvidia-k8s-vgpu-dm).
        ..common::container(
            MAIN_CONTAINER,
            &common::image(policy, ImageKind::VgpuDeviceManager),
            &[],
            &[],
        )
    };
    let pod = PodSpec {
        service_account_name: Some(SERVICE_ACCOUNT.to_owned()),
        init_containers: Some(vec![wait_for_vgpu_manager(policy)]),
        containers: vec![main],
        volumes: Some(vec![
            common::config_map_volume(CONFIG_VOLUME, &mounted.copy_name, None, &[]),
            host_path_volume(
                VALIDATIONS_VOLUME,
                VALIDATIONS_DIR,
                HostPathType::DirectoryOrCreate,
            ),
            host_path_volume(HOST_SYS, "/sys", HostPathType::Directory),
            host_path_volume(HOST_ROOT_VOLUME, "/", HostPathType::Any),
            host_path_volume(
                DRIVER_INSTALL_DIR_VOLUME,
                common::DEFAULT_DRIVER_INSTALL_DIR,
                HostPathType::DirectoryOrCreate,
            ),
        ]),
        ..PodSpec::default()
    };
    let mut ds = OperandDaemonSet::new(Operand::VgpuDeviceManager, NAME, pod, MAIN_CONTAINER);
    ds.annotations = openshift::scc_annotation(facts, SERVICE_ACCOUNT);
    ds.image = Some(&manager.image);
    ds.overrides = Some(&manager.container);
    ds.host_network = manager.host_network.unwrap_or(false);
    ds.config_hash = Some(mounted.hash.clone());

    let mut objects = OperandObjects::default();
    let role_rules = openshift::use_privileged_scc(facts)
        .into_iter()
        // Before it changes a node's vGPUs it waits for the sandbox device plugin and validator
        // pods of its node to leave: pods of this namespace, so a Role.
        .chain([rule(&[""], &["pods"], &["get", "list", "watch"])])
        .collect();
    let mut cluster_rules = Vec::new();
    if facts.openshift {
        cluster_rules.push(rule(
            &["config.openshift.io"],
            &["clusterversions"],
            &["get", "list"],
        ));
    }
    // It watches its own node's nvidia.com/vgpu.config label, and writes the config state and
    // the sandbox operands' pause values into its labels (an update of the Node).
    cluster_rules.push(rule(&[""], &["nodes"], &["get", "list", "watch", "update"]));
    common::add_identity(
        &mut objects,
        Operand::VgpuDeviceManager,
        SERVICE_ACCOUNT,
        role_rules,
        cluster_rules,
        facts,
    );
    // Its token may write only its own node.
    objects.dynamic.extend(common::confinement_policy(
        Operand::VgpuDeviceManager,
        CONFINEMENT_POLICY,
        &[SERVICE_ACCOUNT],
        &[common::own_node_writes()],
        facts,
    ));
    if custom_config_name(spec).is_none() {
        // Ours, for users to read and copy from; the pods mount the copy.
        objects.config_maps.push(common::config_map(
            Operand::VgpuDeviceManager,
            DEFAULT_CONFIG_MAP,
            default_configs(),
            facts,
        ));
    }
    objects.config_maps.push(copy_config_map(&mounted, facts));
    objects
        .daemon_sets
        .push(common::operand_daemon_set(policy, facts, ds));
    objects.dynamic.extend(openshift::scc(
        Operand::VgpuDeviceManager,
        SERVICE_ACCOUNT,
        openshift::HostAccess::default(),
        facts,
    ));
    Some(objects)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_default_configs_parse_and_hold_the_default_config() {
        let file = vgpu::parse_config(DEFAULT_CONFIG_MAP, &default_configs()).unwrap();
        assert!(file.configs.contains_key(DEFAULT_CONFIG));
        assert!(file.configs.len() > 3);
    }
}
