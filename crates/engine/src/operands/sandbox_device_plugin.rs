//! Render stage, sandbox device plugin (pure, no IO): DaemonSet
//! `nvidia-sandbox-device-plugin-daemonset`, KubeVirt's GPU device plugin, on `vm-passthrough`
//! and `vm-vgpu` nodes. It advertises GPUs bound to vfio-pci (and vGPU mediated devices) to the
//! kubelet, one resource per GPU model named from the PCI ID database; it reads no settings
//! (docs/operand-facts.md §20.4, §20.7). Its init containers hold it until the sandbox validator
//! has found the node's GPUs bound to vfio-pci (`vm-passthrough`) or its vGPU devices created
//! (`vm-vgpu`): it discovers devices once, at start. On with sandbox workloads in `kubevirt`
//! mode and `sandboxDevicePlugin.enabled`.

use k8s_openapi::api::core::v1::{Container, EnvVar, PodSpec};
use k8s_openapi::api::rbac::v1::PolicyRule;

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

/// The init container that holds a plugin until the node's GPUs are bound to vfio-pci on
/// `vm-passthrough` nodes: both sandbox plugins discover their devices once, at start.
pub(super) fn wait_for_vfio_pci(policy: &ValidatedPolicy) -> Container {
    wait_for(
        policy,
        VFIO_PCI_VALIDATION,
        "vm-passthrough",
        "vfio-pci-ready",
    )
}

/// A sandbox plugin's main container, privileged and running its image's own command, with the
/// kubelet's device-plugin directory (its sockets), `/dev/vfio` when the plugin opens the vfio
/// groups itself (`dev_vfio`, KubeVirt's), and the CDI directory.
pub(super) fn plugin_container(
    policy: &ValidatedPolicy,
    name: &str,
    image: ImageKind,
    env: Vec<EnvVar>,
    dev_vfio: bool,
) -> Container {
    let mut mounts = vec![mount(DEVICE_PLUGINS, "/var/lib/kubelet/device-plugins")];
    if dev_vfio {
        mounts.push(mount(DEV_VFIO, "/dev/vfio"));
    }
    mounts.push(mount(CDI_ROOT, "/var/run/cdi"));
    Container {
        env: Some(env),
        security_context: Some(common::privileged()),
        volume_mounts: Some(mounts),
        ..common::container(name, &common::image(policy, image), &[], &[])
    }
}

/// A sandbox plugin's pod: `init_containers` wait for the sandbox validator, whose status
/// directory they mount, and `main` ([`plugin_container`], with the same `dev_vfio`) gets its
/// host directories.
pub(super) fn plugin_pod(
    service_account: &str,
    init_containers: Vec<Container>,
    main: Container,
    dev_vfio: bool,
) -> PodSpec {
    // NVIDIA does not apply the kubelet root setting to this path (§20.4).
    let mut volumes = vec![host_path_volume(
        DEVICE_PLUGINS,
        "/var/lib/kubelet/device-plugins",
        HostPathType::Any,
    )];
    if dev_vfio {
        volumes.push(host_path_volume(DEV_VFIO, "/dev/vfio", HostPathType::Any));
    }
    volumes.extend([
        host_path_volume(CDI_ROOT, "/var/run/cdi", HostPathType::DirectoryOrCreate),
        host_path_volume(
            VALIDATIONS_VOLUME,
            VALIDATIONS_DIR,
            HostPathType::DirectoryOrCreate,
        ),
    ]);
    PodSpec {
        service_account_name: Some(service_account.to_owned()),
        init_containers: Some(init_containers),
        containers: vec![main],
        volumes: Some(volumes),
        ..PodSpec::default()
    }
}

/// A sandbox plugin's objects: its DaemonSet, its identity with `role_rules` in the namespace and
/// cluster-wide get on the core resources `core_reads` (plus the cluster version on OpenShift),
/// and its SCC on OpenShift.
pub(super) fn plugin_objects(
    policy: &ValidatedPolicy,
    facts: &ClusterFacts,
    mut ds: OperandDaemonSet,
    service_account: &str,
    role_rules: Vec<PolicyRule>,
    core_reads: &[&str],
) -> OperandObjects {
    ds.annotations = openshift::scc_annotation(facts, service_account);
    let operand = ds.operand;
    let mut objects = OperandObjects::default();
    let mut cluster_rules = Vec::new();
    if facts.openshift {
        cluster_rules.push(rule(
            &["config.openshift.io"],
            &["clusterversions"],
            &["get", "list"],
        ));
    }
    cluster_rules.push(rule(&[""], core_reads, &["get"]));
    common::add_identity(
        &mut objects,
        operand,
        service_account,
        role_rules,
        cluster_rules,
        facts,
    );
    objects
        .daemon_sets
        .push(common::operand_daemon_set(policy, facts, ds));
    objects.dynamic.extend(openshift::scc(
        operand,
        service_account,
        openshift::HostAccess::default(),
        facts,
    ));
    objects
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
    // The plugin takes no arguments.
    let main = plugin_container(
        policy,
        MAIN_CONTAINER,
        ImageKind::SandboxDevicePlugin,
        envs,
        true,
    );
    let init_containers = vec![
        wait_for_vfio_pci(policy),
        wait_for(
            policy,
            VGPU_DEVICES_VALIDATION,
            "vm-vgpu",
            "vgpu-devices-ready",
        ),
    ];
    let pod = plugin_pod(SERVICE_ACCOUNT, init_containers, main, true);
    let mut ds = OperandDaemonSet::new(Operand::SandboxDevicePlugin, NAME, pod, MAIN_CONTAINER);
    ds.image = Some(&plugin.image);
    ds.overrides = Some(&plugin.container);
    ds.host_network = plugin.host_network.unwrap_or(false);

    // NVIDIA grants this plugin pod and NodeFeature writes in the namespace too; those serve
    // the Kata plugin's in-VM GPU feature discovery (docs/operand-facts.md §20.6), which
    // KubeVirt's plugin does not have (§20.7), so only NVIDIA's reads are kept.
    let role_rules: Vec<_> = openshift::use_privileged_scc(facts).into_iter().collect();
    Some(plugin_objects(
        policy,
        facts,
        ds,
        SERVICE_ACCOUNT,
        role_rules,
        &["nodes", "pods"],
    ))
}
