//! Render stage, MPS control daemon (pure, no IO): DaemonSet
//! `nvidia-device-plugin-mps-control-daemon`, on with the device plugin, scheduled only where
//! GFD reports `nvidia.com/mps.capable=true` (the node's sharing config uses MPS). It runs
//! under the device plugin's ServiceAccount and mounts the same sharing-config copy
//! (docs/operand-facts.md §9).

use k8s_openapi::api::core::v1::{Container, PodSpec};

use super::common::{
    self, GpuAccess, HostPathType, MountExt, OperandDaemonSet, env, env_field, host_path_volume,
    mount,
};
use super::device_plugin::{self, CONFIG_FILE};
use super::{openshift, validator};
use crate::api::{Component, DevicePluginSpec, ImageKind};
use crate::facts::ClusterFacts;
use crate::model::ValidatedPolicy;
use crate::model::{Operand, OperandObjects};

/// What the engine knows about this operand ([`super::Descriptor`]).
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "mps-control-daemon",
    component: Some(Component::DevicePlugin),
    deploy_label: Some(crate::nodes::DEPLOY_DEVICE_PLUGIN),
    consumes_sharing_config: true,
    enabled: super::Enabled::BySwitch,
    images: |_, _| vec![ImageKind::DevicePlugin, ImageKind::Validator],
    host_paths: super::device_plugin::mps_root_host_path,
    render,
    check: super::defaults::no_check,
    report: super::defaults::no_report,
};

/// DaemonSet name and `app` label.
pub const NAME: &str = "nvidia-device-plugin-mps-control-daemon";
pub const MAIN_CONTAINER: &str = "mps-control-daemon-ctr";
/// Init container that recreates the MPS shared-memory tmpfs under the MPS root.
pub const MOUNTS_CONTAINER: &str = "mps-control-daemon-mounts";
/// GFD's label for nodes whose selected sharing config uses MPS.
pub const MPS_CAPABLE_LABEL: &str = "nvidia.com/mps.capable";
/// Absolute, because config-manager compares argv[0] exactly and this pod shares the host's
/// PID namespace.
const DAEMON_PATH: &str = "/usr/bin/mps-control-daemon";

const RUN_NVIDIA: &str = "run-nvidia";
const MPS_ROOT: &str = "mps-root";
const MPS_SHM: &str = "mps-shm";

pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> Option<OperandObjects> {
    let spec = &policy.spec;
    if !spec.is_enabled(Component::DevicePlugin) {
        return None;
    }
    let default_plugin = DevicePluginSpec::default();
    let plugin = spec.device_plugin.as_ref().unwrap_or(&default_plugin);
    let copy = device_plugin::sharing_copy(policy);
    let root = common::mps_root(spec);
    let image = common::image(policy, ImageKind::DevicePlugin);

    let mut envs = vec![
        env_field("NODE_NAME", "spec.nodeName"),
        env("NVIDIA_VISIBLE_DEVICES", "all"),
        env("NVIDIA_DRIVER_CAPABILITIES", "compute,utility"),
    ];
    if copy.is_some() {
        envs.push(env("CONFIG_FILE", CONFIG_FILE));
    }
    for var in common::mig_env(spec) {
        common::set_env(&mut envs, var);
    }
    let mut mounts = vec![mount(MPS_SHM, "/dev/shm"), mount(MPS_ROOT, "/mps")];
    let mut volumes = vec![
        host_path_volume(RUN_NVIDIA, "/run/nvidia", HostPathType::Directory),
        host_path_volume(MPS_ROOT, root, HostPathType::DirectoryOrCreate),
        host_path_volume(MPS_SHM, &common::join_path(root, "shm"), HostPathType::Any),
    ];
    let mut init = vec![
        validator::wait_for_toolkit(policy, mount(RUN_NVIDIA, "/run/nvidia").host_to_container()),
        Container {
            volume_mounts: Some(vec![mount(MPS_ROOT, "/mps").bidirectional()]),
            security_context: Some(common::privileged()),
            ..common::container(
                MOUNTS_CONTAINER,
                &image,
                &["mps-control-daemon", "mount-shm"],
                &[],
            )
        },
    ];
    let mut sidecars = Vec::new();
    if let Some(copy) = &copy {
        mounts.extend(device_plugin::config_mounts());
        volumes.extend(device_plugin::config_volumes(copy));
        let (cm_init, cm_sidecar) =
            device_plugin::config_manager_containers(policy, copy, DAEMON_PATH);
        init.push(cm_init);
        sidecars.push(cm_sidecar);
    }
    let main = Container {
        env: Some(envs),
        volume_mounts: Some(mounts),
        security_context: Some(common::privileged()),
        ..common::container(MAIN_CONTAINER, &image, &[DAEMON_PATH], &[])
    };
    let mut containers = vec![main];
    containers.extend(sidecars);
    let pod = PodSpec {
        service_account_name: Some(device_plugin::SERVICE_ACCOUNT.to_owned()),
        // MPS clients in workload pods reach the daemon through host PIDs.
        host_pid: Some(true),
        init_containers: Some(init),
        containers,
        volumes: Some(volumes),
        ..PodSpec::default()
    };
    let mut ds = OperandDaemonSet::new(Operand::MpsControlDaemon, NAME, pod, MAIN_CONTAINER);
    ds.annotations = openshift::scc_annotation(facts, "hostmount-anyuid");
    ds.image = Some(&plugin.image);
    // The plugin's resources apply; its env and args are the plugin's, not the daemon's.
    let overrides = crate::api::ContainerOverrides {
        resources: plugin.container.resources.clone(),
        args: None,
        env: None,
    };
    ds.overrides = Some(&overrides);
    ds.gpu_access = GpuAccess::Runtime {
        nri_container: MAIN_CONTAINER,
    };
    ds.extra_node_selector = vec![(MPS_CAPABLE_LABEL, "true")];
    ds.config_hash = copy.as_ref().map(|c| c.hash.clone());
    Some(OperandObjects {
        daemon_sets: vec![common::operand_daemon_set(policy, facts, ds)],
        ..OperandObjects::default()
    })
}
