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

use k8s_openapi::api::rbac::v1::PolicyRule;

use super::common::{OperandDaemonSet, env_field, merge_user_env, rule};
use super::openshift;
use super::sandbox_device_plugin::{
    plugin_container, plugin_objects, plugin_pod, wait_for_vfio_pci,
};
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
pub const VFIO_PCI_VALIDATION: &str = super::sandbox_device_plugin::VFIO_PCI_VALIDATION;
/// The plugin's switch for the GPU feature discovery pod it launches into a Kata VM.
pub const ENABLE_GFD: &str = "ENABLE_GFD";

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
    // The image's own command.
    let main = plugin_container(
        policy,
        MAIN_CONTAINER,
        ImageKind::KataSandboxDevicePlugin,
        envs,
        false,
    );
    // Kata serves whole GPUs only: no wait for vGPU devices.
    let pod = plugin_pod(
        SERVICE_ACCOUNT,
        vec![wait_for_vfio_pci(policy)],
        main,
        false,
    );
    let mut ds = OperandDaemonSet::new(Operand::KataSandboxDevicePlugin, NAME, pod, MAIN_CONTAINER);
    ds.image = Some(&plugin.image);
    ds.overrides = Some(&plugin.container);
    ds.host_network = plugin.host_network.unwrap_or(false);

    // The GFD launcher reads its node's labels (the Kata runtime's readiness label and the CC
    // state that picks the RuntimeClass). NVIDIA also grants pods get cluster-wide, but the
    // plugin reads only its own pod, in its namespace (the Role).
    Some(plugin_objects(
        policy,
        facts,
        ds,
        SERVICE_ACCOUNT,
        role_rules(facts, launches_gfd(plugin.container.env.as_ref())),
        &["nodes"],
    ))
}
