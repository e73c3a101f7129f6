//! Render stage, device plugin (pure, no IO): DaemonSet `nvidia-device-plugin-daemonset`
//! advertising `nvidia.com/gpu`, and the operator-owned copy of the sharing config (decision 4)
//! that it, GFD and the MPS control daemon mount through their config-manager containers
//! (docs/operand-facts.md §8, docs/config-facts.md §2).

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Container, PodSpec, Volume, VolumeMount};

use super::common::{
    self, DRIVER_INSTALL_DIR_VOLUME, GpuAccess, HOST_ROOT_VOLUME, HostPathType, MountExt,
    OperandDaemonSet, VALIDATIONS_DIR, env, env_field, host_path_volume, merge_user_env, mount,
    rule,
};
use super::openshift;
use super::validator::{self, VALIDATIONS_VOLUME};
use crate::api::{ClusterPolicySpec, Component, DevicePluginSpec, ImageKind};
use crate::facts::{ClusterFacts, LastGood, SharingConfig};
use crate::model::ValidatedPolicy;
use crate::model::{Operand, OperandObjects};
use crate::nodes::DEVICE_PLUGIN_CONFIG;
use crate::sharing::select::{SharingDecision, select_config};

/// What the engine knows about this operand ([`super::Descriptor`]).
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "device-plugin",
    component: Some(Component::DevicePlugin),
    deploy_label: Some(crate::nodes::DEPLOY_DEVICE_PLUGIN),
    consumes_sharing_config: true,
    enabled: super::Enabled::BySwitch,
    images: |_, _| vec![ImageKind::DevicePlugin, ImageKind::Validator],
    host_paths: |spec| {
        let mut paths = super::toolkit::install_dir_host_path(spec);
        paths.extend(mps_root_host_path(spec));
        paths
    },
    render,
    check: super::defaults::no_check,
    report: super::defaults::no_report,
};

/// DaemonSet name and `app` label.
pub const NAME: &str = "nvidia-device-plugin-daemonset";
/// ServiceAccount and ClusterRole name; the MPS control daemon runs under it too.
pub const SERVICE_ACCOUNT: &str = "nvidia-device-plugin";
pub const MAIN_CONTAINER: &str = "nvidia-device-plugin";
pub const ENTRYPOINT_CONFIG_MAP: &str = "nvidia-device-plugin-entrypoint";
const ENTRYPOINT_KEY: &str = "entrypoint.sh";
/// The config-manager init container (picks the node's config once, before the consumer
/// starts) and sidecar (switches it when the node label changes, then signals the consumer).
pub const CONFIG_MANAGER_INIT: &str = "config-manager-init";
pub const CONFIG_MANAGER: &str = "config-manager";
/// Volume of the sharing-config copy and where it is mounted.
pub const AVAILABLE_CONFIGS_VOLUME: &str = "available-configs";
pub const AVAILABLE_CONFIGS_DIR: &str = "/available-configs";
/// emptyDir holding the symlink config-manager points at the selected key.
pub const CONFIG_VOLUME: &str = "config";
pub const CONFIG_DIR: &str = "/config";
/// The file the consumers read (`CONFIG_FILE`), a symlink into the copy.
pub const CONFIG_FILE: &str = "/config/config.yaml";
/// Label of the sharing-config copies, so the apply stage can find earlier ones.
pub const CONFIG_COPY_LABEL: &str = common::CONFIG_COPY_LABEL;
/// Annotation of a copy naming the user's ConfigMap it was made from.
pub const CONFIG_SOURCE_ANNOTATION: &str = "nvidia.com/gpu-operator.config-source";

const DEVICE_PLUGIN_DIR: &str = "device-plugin";
const CDI_ROOT: &str = "cdi-root";
const MPS_ROOT: &str = "mps-root";
const MPS_SHM: &str = "mps-shm";

/// The entrypoint (our script): wait for the driver validation, take over the driver roots it
/// found, turn on GPUDirect features whose kernel modules are loaded, run the plugin.
const ENTRYPOINT: &str = r#"#!/bin/sh
# Entrypoint of the NVIDIA device plugin (rendered by gpu-operator).
ready=/run/nvidia/validations/driver-ready
until [ -f "$ready" ]; do
  echo "waiting for the driver validation ($ready)"
  sleep 5
done
set -a
. "$ready"
set +a
if [ -z "${GDRCOPY_ENABLED:-}" ] && grep -q '^gdrdrv ' /proc/modules; then
  export GDRCOPY_ENABLED=true
fi
if grep -q '^nvidia_fs ' /proc/modules; then
  export GDS_ENABLED="${GDS_ENABLED:-true}"
  export MOFED_ENABLED="${MOFED_ENABLED:-true}"
fi
exec nvidia-device-plugin
"#;

/// The operator-owned, immutable copy of the sharing config that the consumers mount.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharingCopy {
    /// `<source>-<first 10 hex digits of the hash>`.
    pub name: String,
    /// SHA-256 over every key and value: the consumers' config-hash annotation.
    pub hash: String,
    /// `DEFAULT_CONFIG` of the config-manager containers.
    pub default_key: String,
    /// The user's ConfigMap.
    pub source: String,
    pub data: BTreeMap<String, String>,
}

/// The sharing-config copy, when the device plugin is on, the policy names a config and the
/// facts hold a valid (or last good) one. Without it no consumer runs config-manager.
pub fn sharing_copy(policy: &ValidatedPolicy) -> Option<SharingCopy> {
    let spec = &policy.spec;
    let named = spec
        .device_plugin
        .as_ref()
        .and_then(|d| d.config.as_ref())
        .and_then(|c| c.name.as_deref())
        .is_some_and(|n| !n.is_empty());
    if !spec.is_enabled(Component::DevicePlugin) || !named {
        return None;
    }
    let sharing = policy.sharing.as_ref()?;
    let hash = common::config_hash(&sharing.data);
    Some(SharingCopy {
        name: copy_name(&sharing.source, &hash),
        hash,
        default_key: sharing.default_key.clone(),
        source: sharing.source.clone(),
        data: sharing.data.clone(),
    })
}

/// `<source>-<first 10 hex digits of hash>`, the name of the copy of `source` whose data has
/// the config hash `hash`.
pub fn copy_name(source: &str, hash: &str) -> String {
    common::hashed_name(source, hash)
}

/// The copy as an immutable ConfigMap of the device-plugin operand.
pub fn copy_config_map(copy: &SharingCopy, facts: &ClusterFacts) -> ConfigMap {
    let mut cm = common::config_map(Operand::DevicePlugin, &copy.name, copy.data.clone(), facts);
    common::add_labels(&mut cm.metadata, &[(CONFIG_COPY_LABEL, "sharing")]);
    cm.metadata.annotations = Some(BTreeMap::from([(
        CONFIG_SOURCE_ANNOTATION.to_owned(),
        copy.source.clone(),
    )]));
    // Content never changes under a name: a new config is a new copy, and pods roll to it.
    cm.immutable = Some(true);
    cm
}

/// The sharing-config copy a live consumer DaemonSet mounts, and the `DEFAULT_CONFIG` its
/// config-manager uses: the inverse of [`config_volumes`] and [`config_manager_containers`].
/// This is "last good" (decision 4): it lives in the cluster, so it survives an operator
/// restart. `None` when the DaemonSet runs without a sharing config.
pub fn mounted_copy(ds: &DaemonSet) -> Option<(String, String)> {
    let pod = ds.spec.as_ref()?.template.spec.as_ref()?;
    let copy = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == AVAILABLE_CONFIGS_VOLUME)?
        .config_map
        .as_ref()?
        .name
        .clone();
    let default_key = pod
        .init_containers
        .iter()
        .flatten()
        .chain(&pod.containers)
        .filter(|c| c.name == CONFIG_MANAGER_INIT || c.name == CONFIG_MANAGER)
        .flat_map(|c| c.env.iter().flatten())
        .find(|e| e.name == "DEFAULT_CONFIG")
        .and_then(|e| e.value.clone())
        .unwrap_or_default();
    Some((copy, default_key))
}

/// Volumes of the copy and the selected-config directory.
pub fn config_volumes(copy: &SharingCopy) -> Vec<Volume> {
    vec![
        common::config_map_volume(AVAILABLE_CONFIGS_VOLUME, &copy.name, None, &[]),
        common::empty_dir_volume(CONFIG_VOLUME),
    ]
}

/// Mounts of the copy and the selected-config directory (config-manager and consumer alike).
pub fn config_mounts() -> Vec<VolumeMount> {
    vec![
        mount(AVAILABLE_CONFIGS_VOLUME, AVAILABLE_CONFIGS_DIR).read_only(),
        mount(CONFIG_VOLUME, CONFIG_DIR),
    ]
}

fn config_manager_env(
    copy: &SharingCopy,
    oneshot: bool,
    process_to_signal: &str,
) -> Vec<k8s_openapi::api::core::v1::EnvVar> {
    vec![
        env("ONESHOT", if oneshot { "true" } else { "false" }),
        // In-cluster credentials of the pod's ServiceAccount.
        env("KUBECONFIG", ""),
        env_field("NODE_NAME", "spec.nodeName"),
        env("NODE_LABEL", DEVICE_PLUGIN_CONFIG),
        env("CONFIG_FILE_SRCDIR", AVAILABLE_CONFIGS_DIR),
        env("CONFIG_FILE_DST", CONFIG_FILE),
        env("DEFAULT_CONFIG", &copy.default_key),
        // A node whose label names nothing and no default: run without sharing.
        env("FALLBACK_STRATEGIES", "empty"),
        env("SEND_SIGNAL", if oneshot { "false" } else { "true" }),
        env("SIGNAL", if oneshot { "" } else { "1" }),
        env(
            "PROCESS_TO_SIGNAL",
            if oneshot { "" } else { process_to_signal },
        ),
    ]
}

/// The config-manager init container and sidecar (device-plugin image) for a consumer whose
/// main process has `argv[0] == process_to_signal`.
pub fn config_manager_containers(
    policy: &ValidatedPolicy,
    copy: &SharingCopy,
    process_to_signal: &str,
) -> (Container, Container) {
    let image = common::image(policy, ImageKind::DevicePlugin);
    let init = Container {
        env: Some(config_manager_env(copy, true, process_to_signal)),
        volume_mounts: Some(config_mounts()),
        ..common::container(CONFIG_MANAGER_INIT, &image, &["config-manager"], &[])
    };
    let sidecar = Container {
        env: Some(config_manager_env(copy, false, process_to_signal)),
        volume_mounts: Some(config_mounts()),
        security_context: Some(common::privileged()),
        ..common::container(CONFIG_MANAGER, &image, &["config-manager"], &[])
    };
    (init, sidecar)
}

pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> Option<OperandObjects> {
    let spec = &policy.spec;
    if !spec.is_enabled(Component::DevicePlugin) {
        return None;
    }
    let default_plugin = DevicePluginSpec::default();
    let plugin = spec.device_plugin.as_ref().unwrap_or(&default_plugin);
    let copy = sharing_copy(policy);
    let mps_root = common::mps_root(spec);

    let mut envs = vec![
        env("PASS_DEVICE_SPECS", "true"),
        env("FAIL_ON_INIT_ERROR", "true"),
        env("DEVICE_LIST_STRATEGY", "envvar"),
        env("DEVICE_ID_STRATEGY", "uuid"),
        env("NVIDIA_VISIBLE_DEVICES", "all"),
        env("NVIDIA_DRIVER_CAPABILITIES", "all"),
        env("MPS_ROOT", mps_root),
    ];
    if copy.is_some() {
        envs.push(env("CONFIG_FILE", CONFIG_FILE));
    }
    for var in common::mig_env(spec) {
        common::set_env(&mut envs, var);
    }
    // The plugin then injects /dev/nvidia-fs* and the InfiniBand devices (GDS), and
    // /dev/gdrdrv (GDRCopy), into the containers it allocates GPUs to.
    if spec.is_enabled(Component::Gds) {
        common::set_env(&mut envs, env("GDS_ENABLED", "true"));
        common::set_env(&mut envs, env("MOFED_ENABLED", "true"));
    }
    if spec.is_enabled(Component::GdrCopy) {
        common::set_env(&mut envs, env("GDRCOPY_ENABLED", "true"));
    }
    if common::cdi_enabled(spec) {
        common::set_env(&mut envs, env("CDI_ENABLED", "true"));
        common::set_env(
            &mut envs,
            env("DEVICE_LIST_STRATEGY", "cdi-annotations,cdi-cri"),
        );
        common::set_env(&mut envs, env("CDI_ANNOTATION_PREFIX", "cdi.k8s.io/"));
        if spec.is_enabled(Component::Toolkit) {
            let hook =
                common::join_path(common::toolkit_install_dir(spec), "toolkit/nvidia-cdi-hook");
            common::set_env(&mut envs, env("NVIDIA_CDI_HOOK_PATH", &hook));
        }
    }
    merge_user_env(&mut envs, plugin.container.env.as_ref());

    let mut mounts = vec![
        mount(ENTRYPOINT_CONFIG_MAP, "/bin/entrypoint.sh")
            .sub_path(ENTRYPOINT_KEY)
            .read_only(),
        mount(DEVICE_PLUGIN_DIR, "/var/lib/kubelet/device-plugins"),
        mount(VALIDATIONS_VOLUME, VALIDATIONS_DIR),
        mount(DRIVER_INSTALL_DIR_VOLUME, "/driver-root").host_to_container(),
        mount(HOST_ROOT_VOLUME, "/host")
            .read_only()
            .host_to_container(),
        mount(CDI_ROOT, "/var/run/cdi"),
        mount(MPS_ROOT, "/mps"),
        mount(MPS_SHM, "/dev/shm"),
    ];
    let mut volumes = vec![
        common::config_map_volume(
            ENTRYPOINT_CONFIG_MAP,
            &common::script_config_map_name(ENTRYPOINT_CONFIG_MAP, ENTRYPOINT_KEY, ENTRYPOINT),
            Some(0o700),
            &[],
        ),
        // The kubelet's plugin directory; hostPaths.kubeletRootDir does not move it (parity).
        host_path_volume(
            DEVICE_PLUGIN_DIR,
            "/var/lib/kubelet/device-plugins",
            HostPathType::Any,
        ),
        host_path_volume(
            VALIDATIONS_VOLUME,
            VALIDATIONS_DIR,
            HostPathType::DirectoryOrCreate,
        ),
        host_path_volume(
            DRIVER_INSTALL_DIR_VOLUME,
            common::DEFAULT_DRIVER_INSTALL_DIR,
            HostPathType::DirectoryOrCreate,
        ),
        host_path_volume(HOST_ROOT_VOLUME, "/", HostPathType::Any),
        host_path_volume(CDI_ROOT, "/var/run/cdi", HostPathType::DirectoryOrCreate),
        host_path_volume(MPS_ROOT, mps_root, HostPathType::DirectoryOrCreate),
        host_path_volume(
            MPS_SHM,
            &common::join_path(mps_root, "shm"),
            HostPathType::Any,
        ),
    ];
    let mut init = vec![validator::wait_for_toolkit(
        policy,
        mount(VALIDATIONS_VOLUME, VALIDATIONS_DIR).host_to_container(),
    )];
    let mut sidecars = Vec::new();
    if let Some(copy) = &copy {
        mounts.extend(config_mounts());
        volumes.extend(config_volumes(copy));
        let (cm_init, cm_sidecar) = config_manager_containers(policy, copy, MAIN_CONTAINER);
        init.push(cm_init);
        sidecars.push(cm_sidecar);
    }
    let main = Container {
        env: Some(envs),
        volume_mounts: Some(mounts),
        security_context: Some(common::privileged()),
        ..common::container(
            MAIN_CONTAINER,
            &common::image(policy, ImageKind::DevicePlugin),
            &["/bin/sh", "-c"],
            &["/bin/entrypoint.sh"],
        )
    };
    let mut containers = vec![main];
    containers.extend(sidecars);
    let pod = PodSpec {
        service_account_name: Some(SERVICE_ACCOUNT.to_owned()),
        // config-manager finds the plugin process to signal through the shared PID namespace.
        share_process_namespace: copy.is_some().then_some(true),
        init_containers: Some(init),
        containers,
        volumes: Some(volumes),
        ..PodSpec::default()
    };
    let mut ds = OperandDaemonSet::new(Operand::DevicePlugin, NAME, pod, MAIN_CONTAINER);
    ds.annotations = openshift::scc_annotation(facts, "hostmount-anyuid");
    ds.image = Some(&plugin.image);
    ds.overrides = Some(&plugin.container);
    ds.host_network = plugin.host_network.unwrap_or(false);
    ds.gpu_access = GpuAccess::Runtime {
        nri_container: MAIN_CONTAINER,
    };
    ds.config_hash = copy.as_ref().map(|c| c.hash.clone());

    let mut objects = OperandObjects::default();
    common::add_identity(
        &mut objects,
        Operand::DevicePlugin,
        SERVICE_ACCOUNT,
        openshift::use_privileged_scc(facts).into_iter().collect(),
        // config-manager watches its node's config label.
        vec![rule(&[""], &["nodes"], &["get", "list", "watch"])],
        facts,
    );
    objects.config_maps.push(common::script_config_map(
        Operand::DevicePlugin,
        ENTRYPOINT_CONFIG_MAP,
        (ENTRYPOINT_KEY, ENTRYPOINT),
        &[(common::APP_LABEL, NAME)],
        facts,
    ));
    if let Some(copy) = &copy {
        objects.config_maps.push(copy_config_map(copy, facts));
    }
    objects
        .daemon_sets
        .push(common::operand_daemon_set(policy, facts, ds));
    Some(objects)
}

/// The sharing config the consumers are to mount, and what is wrong with the user's.
#[derive(Debug, Default, PartialEq)]
pub struct SharingResolution {
    pub sharing: Option<SharingConfig>,
    /// Reported, not freezing: the consumers render with `sharing`.
    pub problem: Option<String>,
    /// Freezing the three consumers: their last good copy is gone, so rendering anything
    /// would change what the nodes run.
    pub freeze: Option<String>,
    pub notes: Vec<String>,
}

/// What validate decides about the device plugin's sharing config (decision 4 and 5), when
/// `devicePlugin.config.name` is set: from the ConfigMap as read, the keys the GPU nodes ask
/// for with `nvidia.com/device-plugin.config`, and what the live plugin mounts.
pub fn decide_sharing(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Option<SharingResolution> {
    let plugin_config = spec.device_plugin.as_ref().and_then(|d| d.config.as_ref());
    let name = plugin_config
        .and_then(|c| c.name.as_deref())
        .filter(|n| !n.is_empty())?;
    let node_keys: BTreeMap<String, String> = facts
        .gpu_nodes
        .iter()
        .filter_map(|n| Some((n.name.clone(), n.label(DEVICE_PLUGIN_CONFIG)?.to_string())))
        .collect();
    let source = facts
        .sharing_source
        .as_ref()
        .filter(|cm| cm.name == name)
        .map(|cm| &cm.data);
    Some(resolve_sharing(
        name,
        source,
        plugin_config
            .and_then(|c| c.default.as_deref())
            .filter(|d| !d.is_empty()),
        &node_keys,
        spec.mig
            .as_ref()
            .and_then(|m| m.strategy)
            .map(common::mig_strategy_name),
        &facts.namespace,
        facts.sharing_last_good.clone(),
    ))
}

/// Decides the sharing config from the user's ConfigMap (`source`: its name and data, `None`
/// when it does not exist) and the last good one (pure).
fn resolve_sharing(
    source_name: &str,
    source: Option<&BTreeMap<String, String>>,
    default: Option<&str>,
    node_keys: &BTreeMap<String, String>,
    mig_strategy: Option<&str>,
    namespace: &str,
    last_good: LastGood,
) -> SharingResolution {
    let problem = match source {
        None => format!(
            "spec.devicePlugin.config.name names ConfigMap {source_name}, which does not exist in namespace {namespace}: create it or fix the name"
        ),
        Some(data) => match select_config(source_name, data, default, node_keys, mig_strategy) {
            SharingDecision::Valid {
                config, warnings, ..
            } => {
                let mut notes = warnings;
                if config.default_inferred {
                    notes.insert(
                        0,
                        format!(
                            "device-plugin config: default inferred (key {:?}, the only key of ConfigMap {source_name})",
                            config.default_key
                        ),
                    );
                }
                return SharingResolution {
                    sharing: Some(config),
                    notes,
                    ..SharingResolution::default()
                };
            }
            SharingDecision::Invalid { problems, .. } => problems
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; "),
        },
    };
    match last_good {
        LastGood::Copy(config) => SharingResolution {
            problem: Some(format!(
                "{problem} (not rolled out: the device plugin, GFD and MPS daemon keep the last good config {})",
                last_good_copy_name(&config)
            )),
            sharing: Some(config),
            ..SharingResolution::default()
        },
        LastGood::Nothing => SharingResolution {
            problem: Some(format!(
                "{problem} (the device plugin runs without a sharing config until this is fixed)"
            )),
            ..SharingResolution::default()
        },
        LastGood::Gone(copy) => SharingResolution {
            freeze: Some(format!(
                "{problem} (the last good config {copy} that the pods mount was deleted; live objects kept as they are)"
            )),
            ..SharingResolution::default()
        },
    }
}

fn last_good_copy_name(config: &SharingConfig) -> String {
    copy_name(&config.source, &common::config_hash(&config.data))
}

/// `spec.devicePlugin.mps.root`, the MPS pipe and log folder the plugin and the MPS control
/// daemon share.
pub fn mps_root_host_path(spec: &ClusterPolicySpec) -> Vec<(&'static str, Option<&str>)> {
    vec![(
        "spec.devicePlugin.mps.root",
        spec.device_plugin
            .as_ref()
            .and_then(|d| d.mps.as_ref())
            .and_then(|m| m.root.as_deref()),
    )]
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const TS4: &str = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n";
    const BROKEN: &str = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 0\n";

    fn data(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect()
    }

    fn sharing(
        source: Option<&BTreeMap<String, String>>,
        last_good: LastGood,
    ) -> SharingResolution {
        resolve_sharing(
            "time-slicing-config",
            source,
            None,
            &BTreeMap::new(),
            None,
            "gpu-operator",
            last_good,
        )
    }

    fn good_copy() -> SharingConfig {
        SharingConfig {
            source: "time-slicing-config".into(),
            data: data(&[("any", TS4)]),
            default_key: "any".into(),
            default_inferred: false,
        }
    }

    #[test]
    fn a_valid_single_key_config_is_mounted_with_the_default_inferred() {
        let r = sharing(Some(&data(&[("any", TS4)])), LastGood::Nothing);
        let config = r.sharing.unwrap();
        assert_eq!(config.default_key, "any");
        assert!(config.default_inferred);
        assert_eq!(r.problem, None);
        assert!(r.notes[0].contains("default inferred"), "{:?}", r.notes);
    }

    #[test]
    fn an_invalid_edit_keeps_the_last_good_copy_and_is_reported() {
        let r = sharing(Some(&data(&[("any", BROKEN)])), LastGood::Copy(good_copy()));
        assert_eq!(r.sharing, Some(good_copy()));
        assert_eq!(r.freeze, None);
        let problem = r.problem.unwrap();
        assert!(problem.contains("replicas"), "{problem}");
        let copy = copy_name(
            "time-slicing-config",
            &common::config_hash(&good_copy().data),
        );
        assert!(
            problem.contains(&format!("keep the last good config {copy}")),
            "{problem}"
        );
    }

    #[test]
    fn a_deleted_config_map_keeps_the_last_good_copy_too() {
        let r = sharing(None, LastGood::Copy(good_copy()));
        assert_eq!(r.sharing, Some(good_copy()));
        assert!(
            r.problem
                .unwrap()
                .contains("does not exist in namespace gpu-operator")
        );
    }

    #[test]
    fn a_first_ever_invalid_config_runs_the_plugin_without_sharing() {
        let r = sharing(Some(&data(&[("any", BROKEN)])), LastGood::Nothing);
        assert_eq!(r.sharing, None);
        assert_eq!(r.freeze, None);
        assert!(r.problem.unwrap().contains("runs without a sharing config"));
    }

    #[test]
    fn an_invalid_config_whose_last_good_copy_was_deleted_freezes_the_consumers() {
        let r = sharing(
            Some(&data(&[("any", BROKEN)])),
            LastGood::Gone("time-slicing-config-0123456789".into()),
        );
        assert_eq!(r.sharing, None);
        assert_eq!(r.problem, None);
        assert!(
            r.freeze
                .unwrap()
                .contains("time-slicing-config-0123456789 that the pods mount was deleted")
        );
    }
}
