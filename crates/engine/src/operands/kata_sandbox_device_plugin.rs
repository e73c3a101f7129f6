//! Render stage, Kata sandbox device plugin (pure, no IO): DaemonSet
//! `nvidia-kata-sandbox-device-plugin-daemonset` on `vm-passthrough` nodes in sandbox mode
//! kata. It advertises the GPUs bound to vfio-pci as one resource (`nvidia.com/pgpu` unless
//! `P_GPU_ALIAS` says otherwise, NVSwitches likewise under `NVSWITCH_ALIAS`) and writes CDI
//! specs for them under `/var/run/cdi`, so the Kata runtime can hand them to a pod's VM
//! (docs/operand-facts.md §20.4, §20.6). Its init container holds it until the sandbox validator
//! has found the node's GPUs bound to vfio-pci. On with sandbox workloads in mode kata and
//! `kataSandboxDevicePlugin.enabled`.
//!
//! The Kata runtime and its RuntimeClasses are not deployed here: they come from the user's Kata
//! Containers installation.

use k8s_openapi::api::core::v1::{Container, PodSpec};
use k8s_openapi::api::rbac::v1::PolicyRule;

use super::common::{
    self, HostPathType, OperandDaemonSet, VALIDATIONS_DIR, env_field, host_path_volume,
    merge_user_env, mount, rule,
};
use super::openshift;
use super::sandbox_device_plugin::wait_for;
use super::validator::VALIDATIONS_VOLUME;
use crate::api::{Component, EnvVar, ImageKind, KataSandboxDevicePluginSpec};
use crate::facts::ClusterFacts;
use crate::model::{Operand, OperandObjects, ValidatedPolicy};

/// What the engine knows about this operand ([`super::Descriptor`]).
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "kata-sandbox-device-plugin",
    component: Some(Component::KataSandboxDevicePlugin),
    deploy_label: Some(crate::workload::DEPLOY_KATA_SANDBOX_DEVICE_PLUGIN),
    consumes_sharing_config: false,
    enabled: super::Enabled::BySwitch,
    images: |_, _| vec![ImageKind::KataSandboxDevicePlugin, ImageKind::Validator],
    host_paths: super::defaults::no_host_paths,
    render,
    check: super::defaults::no_check,
    report: super::defaults::no_report,
};

/// DaemonSet name and `app` label (NVIDIA's).
pub const NAME: &str = "nvidia-kata-sandbox-device-plugin-daemonset";
/// ServiceAccount, Role, ClusterRole and SCC name.
pub const SERVICE_ACCOUNT: &str = "nvidia-kata-sandbox-device-plugin";
pub const MAIN_CONTAINER: &str = "nvidia-kata-sandbox-device-plugin-ctr";
pub const VFIO_PCI_VALIDATION: &str = "vfio-pci-validation";
/// The plugin's switch for the GPU feature discovery pod it launches into a Kata VM.
pub const ENABLE_GFD: &str = "ENABLE_GFD";

const DEVICE_PLUGINS: &str = "device-plugin";
const CDI_ROOT: &str = "cdi-root";

/// Whether the user's env turns on the plugin's in-VM GPU feature discovery. The plugin reads
/// the variable with Go's `strconv.ParseBool`, so these are the spellings it takes as true.
pub fn launches_gfd(user_env: Option<&Vec<EnvVar>>) -> bool {
    user_env
        .into_iter()
        .flatten()
        .rfind(|e| e.name == ENABLE_GFD)
        .and_then(|e| e.value.as_deref())
        .is_some_and(|v| matches!(v, "1" | "t" | "T" | "true" | "TRUE" | "True"))
}

/// The namespaced grants. With `ENABLE_GFD` the plugin creates a GFD pod on its node in its own
/// namespace, running as this ServiceAccount (`POD_SERVICE_ACCOUNT`), and reads its own pod for
/// the image when `GFD_IMAGE` is unset; that GFD publishes its labels as a NodeFeature in the
/// namespace. NVIDIA grants all of it (and pod delete, which the plugin never sends) whatever
/// the env says; here only a plugin that launches GFD gets it.
fn role_rules(facts: &ClusterFacts, gfd: bool) -> Vec<PolicyRule> {
    let mut rules: Vec<PolicyRule> = openshift::use_privileged_scc(facts).into_iter().collect();
    if gfd {
        rules.push(rule(&[""], &["pods"], &["create", "get"]));
        rules.push(rule(
            &["nfd.k8s-sigs.io"],
            &["nodefeatures"],
            &["get", "list", "watch", "create", "update"],
        ));
    }
    rules
}

pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> Option<OperandObjects> {
    let spec = &policy.spec;
    if !spec.is_enabled(Component::KataSandboxDevicePlugin) {
        return None;
    }
    let default_plugin = KataSandboxDevicePluginSpec::default();
    let plugin = spec
        .kata_sandbox_device_plugin
        .as_ref()
        .unwrap_or(&default_plugin);

    // The aliases (`P_GPU_ALIAS`, `NVSWITCH_ALIAS`) and `ENABLE_GFD` come from the user's env:
    // unset, the plugin's own defaults apply.
    let mut envs = vec![
        env_field("NODE_NAME", "spec.nodeName"),
        env_field("POD_NAMESPACE", "metadata.namespace"),
        env_field("POD_SERVICE_ACCOUNT", "spec.serviceAccountName"),
    ];
    merge_user_env(&mut envs, plugin.container.env.as_ref());
    let main = Container {
        env: Some(envs),
        security_context: Some(common::privileged()),
        volume_mounts: Some(vec![
            mount(DEVICE_PLUGINS, "/var/lib/kubelet/device-plugins"),
            mount(CDI_ROOT, "/var/run/cdi"),
        ]),
        // The image's own command.
        ..common::container(
            MAIN_CONTAINER,
            &common::image(policy, ImageKind::KataSandboxDevicePlugin),
            &[],
            &[],
        )
    };
    let pod = PodSpec {
        service_account_name: Some(SERVICE_ACCOUNT.to_owned()),
        // Kata serves whole GPUs only: no wait for vGPU devices.
        init_containers: Some(vec![wait_for(
            policy,
            VFIO_PCI_VALIDATION,
            "vm-passthrough",
            "vfio-pci-ready",
        )]),
        containers: vec![main],
        volumes: Some(vec![
            // NVIDIA does not apply the kubelet root setting to this path (§20.4).
            host_path_volume(
                DEVICE_PLUGINS,
                "/var/lib/kubelet/device-plugins",
                HostPathType::Any,
            ),
            host_path_volume(CDI_ROOT, "/var/run/cdi", HostPathType::DirectoryOrCreate),
            host_path_volume(
                VALIDATIONS_VOLUME,
                VALIDATIONS_DIR,
                HostPathType::DirectoryOrCreate,
            ),
        ]),
        ..PodSpec::default()
    };
    let mut ds = OperandDaemonSet::new(Operand::KataSandboxDevicePlugin, NAME, pod, MAIN_CONTAINER);
    ds.annotations = openshift::scc_annotation(facts, SERVICE_ACCOUNT);
    ds.image = Some(&plugin.image);
    ds.overrides = Some(&plugin.container);
    ds.host_network = plugin.host_network.unwrap_or(false);

    let mut objects = OperandObjects::default();
    let mut cluster_rules = Vec::new();
    if facts.openshift {
        cluster_rules.push(rule(
            &["config.openshift.io"],
            &["clusterversions"],
            &["get", "list"],
        ));
    }
    // The GFD launcher reads its node's labels (the Kata runtime's readiness label and the CC
    // state that picks the RuntimeClass). NVIDIA also grants pods get cluster-wide, but the
    // plugin reads only its own pod, in its namespace (the Role).
    cluster_rules.push(rule(&[""], &["nodes"], &["get"]));
    common::add_identity(
        &mut objects,
        Operand::KataSandboxDevicePlugin,
        SERVICE_ACCOUNT,
        role_rules(facts, launches_gfd(plugin.container.env.as_ref())),
        cluster_rules,
        facts,
    );
    objects
        .daemon_sets
        .push(common::operand_daemon_set(policy, facts, ds));
    objects.dynamic.extend(openshift::scc(
        Operand::KataSandboxDevicePlugin,
        SERVICE_ACCOUNT,
        openshift::HostAccess::default(),
        facts,
    ));
    Some(objects)
}
