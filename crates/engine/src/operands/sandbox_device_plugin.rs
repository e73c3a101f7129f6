//! Render stage, sandbox device plugin (pure, no IO): DaemonSet
//! `nvidia-sandbox-device-plugin-daemonset`, KubeVirt's GPU device plugin, on `vm-passthrough`
//! and `vm-vgpu` nodes. It advertises GPUs bound to vfio-pci (and vGPU mediated devices) to the
//! kubelet, one resource per GPU model named from the PCI ID database; it reads no settings
//! (docs/operand-facts.md §20.4, §20.7). Its init containers hold it until the sandbox validator
//! has found the node's GPUs bound to vfio-pci (`vm-passthrough`) or its vGPU devices created
//! (`vm-vgpu`): it discovers devices once, at start. On with sandbox workloads in `kubevirt`
//! mode and `sandboxDevicePlugin.enabled`.

use k8s_openapi::api::core::v1::{Container, PodSpec};

use super::common::{
    self, HostPathType, MountExt, OperandDaemonSet, VALIDATIONS_DIR, env, env_field,
    host_path_volume, merge_user_env, mount, rule,
};
use super::openshift;
use super::validator::VALIDATIONS_VOLUME;
use crate::api::{Component, ImageKind, SandboxDevicePluginSpec};
use crate::facts::ClusterFacts;
use crate::model::{Operand, OperandObjects, ValidatedPolicy};

/// What the engine knows about this operand ([`super::Descriptor`]).
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "sandbox-device-plugin",
    component: Some(Component::SandboxDevicePlugin),
    deploy_label: Some(crate::workload::DEPLOY_SANDBOX_DEVICE_PLUGIN),
    consumes_sharing_config: false,
    enabled: super::Enabled::BySwitch,
    images: |_, _| vec![ImageKind::SandboxDevicePlugin, ImageKind::Validator],
    host_paths: super::defaults::no_host_paths,
    render,
    check: super::defaults::no_check,
    report: super::defaults::no_report,
};

/// DaemonSet name and `app` label (NVIDIA's).
pub const NAME: &str = "nvidia-sandbox-device-plugin-daemonset";
/// ServiceAccount, Role, ClusterRole and SCC name.
pub const SERVICE_ACCOUNT: &str = "nvidia-sandbox-device-plugin";
pub const MAIN_CONTAINER: &str = "nvidia-sandbox-device-plugin-ctr";
pub const VFIO_PCI_VALIDATION: &str = "vfio-pci-validation";
pub const VGPU_DEVICES_VALIDATION: &str = "vgpu-devices-validation";

const DEVICE_PLUGINS: &str = "device-plugin";
const DEV_VFIO: &str = "vfio";
const CDI_ROOT: &str = "cdi-root";

/// An init container that waits for the sandbox validator: it passes at once unless the node's
/// workload type is `workload`, and otherwise waits for the validator's `ready` file.
pub(super) fn wait_for(
    policy: &ValidatedPolicy,
    name: &str,
    workload: &str,
    ready: &str,
) -> Container {
    let script = format!(
        "until [ -f {dir}/workload-type ]; do echo waiting for the workload type; sleep 5; done; \
         if [ \"$(cat {dir}/workload-type)\" != \"{workload}\" ]; then exit 0; fi; \
         until [ -f {dir}/{ready} ]; do echo waiting for {ready}; sleep 5; done",
        dir = VALIDATIONS_DIR,
    );
    Container {
        env: Some(vec![env("NVIDIA_VISIBLE_DEVICES", "void")]),
        security_context: Some(common::privileged()),
        volume_mounts: Some(vec![
            mount(VALIDATIONS_VOLUME, VALIDATIONS_DIR).host_to_container(),
        ]),
        ..common::container(
            name,
            &common::image(policy, ImageKind::Validator),
            &["sh", "-c"],
            &[&script],
        )
    }
}

pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> Option<OperandObjects> {
    let spec = &policy.spec;
    if !spec.is_enabled(Component::SandboxDevicePlugin) {
        return None;
    }
    let default_plugin = SandboxDevicePluginSpec::default();
    let plugin = spec
        .sandbox_device_plugin
        .as_ref()
        .unwrap_or(&default_plugin);

    let mut envs = vec![
        env_field("NODE_NAME", "spec.nodeName"),
        env_field("POD_NAMESPACE", "metadata.namespace"),
    ];
    merge_user_env(&mut envs, plugin.container.env.as_ref());
    let main = Container {
        env: Some(envs),
        security_context: Some(common::privileged()),
        volume_mounts: Some(vec![
            mount(DEVICE_PLUGINS, "/var/lib/kubelet/device-plugins"),
            mount(DEV_VFIO, "/dev/vfio"),
            mount(CDI_ROOT, "/var/run/cdi"),
        ]),
        // The image's own command: the plugin takes no arguments.
        ..common::container(
            MAIN_CONTAINER,
            &common::image(policy, ImageKind::SandboxDevicePlugin),
            &[],
            &[],
        )
    };
    let pod = PodSpec {
        service_account_name: Some(SERVICE_ACCOUNT.to_owned()),
        init_containers: Some(vec![
            wait_for(
                policy,
                VFIO_PCI_VALIDATION,
                "vm-passthrough",
                "vfio-pci-ready",
            ),
            wait_for(
                policy,
                VGPU_DEVICES_VALIDATION,
                "vm-vgpu",
                "vgpu-devices-ready",
            ),
        ]),
        containers: vec![main],
        volumes: Some(vec![
            // NVIDIA does not apply the kubelet root setting to this path (§20.4).
            host_path_volume(
                DEVICE_PLUGINS,
                "/var/lib/kubelet/device-plugins",
                HostPathType::Any,
            ),
            host_path_volume(DEV_VFIO, "/dev/vfio", HostPathType::Any),
            host_path_volume(CDI_ROOT, "/var/run/cdi", HostPathType::DirectoryOrCreate),
            host_path_volume(
                VALIDATIONS_VOLUME,
                VALIDATIONS_DIR,
                HostPathType::DirectoryOrCreate,
            ),
        ]),
        ..PodSpec::default()
    };
    let mut ds = OperandDaemonSet::new(Operand::SandboxDevicePlugin, NAME, pod, MAIN_CONTAINER);
    ds.annotations = openshift::scc_annotation(facts, SERVICE_ACCOUNT);
    ds.image = Some(&plugin.image);
    ds.overrides = Some(&plugin.container);
    ds.host_network = plugin.host_network.unwrap_or(false);

    let mut objects = OperandObjects::default();
    // NVIDIA grants this plugin pod and NodeFeature writes in the namespace too; those serve
    // the Kata plugin's in-VM GPU feature discovery (docs/operand-facts.md §20.6), which
    // KubeVirt's plugin does not have (§20.7), so only NVIDIA's reads are kept.
    let role_rules: Vec<_> = openshift::use_privileged_scc(facts).into_iter().collect();
    let mut cluster_rules = Vec::new();
    if facts.openshift {
        cluster_rules.push(rule(
            &["config.openshift.io"],
            &["clusterversions"],
            &["get", "list"],
        ));
    }
    cluster_rules.push(rule(&[""], &["nodes", "pods"], &["get"]));
    common::add_identity(
        &mut objects,
        Operand::SandboxDevicePlugin,
        SERVICE_ACCOUNT,
        role_rules,
        cluster_rules,
        facts,
    );
    objects
        .daemon_sets
        .push(common::operand_daemon_set(policy, facts, ds));
    objects.dynamic.extend(openshift::scc(
        Operand::SandboxDevicePlugin,
        SERVICE_ACCOUNT,
        openshift::HostAccess::default(),
        facts,
    ));
    Some(objects)
}
