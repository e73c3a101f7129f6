//! Render stage, GPU feature discovery (pure, no IO): DaemonSet `gpu-feature-discovery`
//! labelling nodes with GPU model, memory, count and sharing replicas (through NFD), reading the
//! device plugin's sharing-config copy through config-manager (docs/operand-facts.md §10).

use k8s_openapi::api::core::v1::{Container, PodSpec};

use super::common::{
    self, GpuAccess, HostPathType, MountExt, OperandDaemonSet, PART_OF_LABEL, env, env_field,
    host_path_volume, merge_user_env, mount, rule,
};
use super::device_plugin::{self, CONFIG_FILE};
use super::{openshift, validator};
use crate::api::{ClusterPolicySpec, Component, GfdSpec, ImageKind};
use crate::facts::ClusterFacts;
use crate::model::ValidatedPolicy;
use crate::model::{Operand, OperandObjects};

/// What the engine knows about this operand ([`super::Descriptor`]).
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "gpu-feature-discovery",
    component: Some(Component::Gfd),
    deploy_label: Some(crate::nodes::DEPLOY_GFD),
    consumes_sharing_config: true,
    enabled: super::Enabled::BySwitch,
    images,
    host_paths: super::defaults::no_host_paths,
    render,
    check: super::defaults::no_check,
    report: super::defaults::no_report,
};

/// DaemonSet name and `app` label.
pub const NAME: &str = "gpu-feature-discovery";
/// ServiceAccount, Role, ClusterRole and SCC name.
pub const SERVICE_ACCOUNT: &str = "nvidia-gpu-feature-discovery";
/// Main container; also the process name config-manager signals.
pub const MAIN_CONTAINER: &str = "gpu-feature-discovery";
/// NVIDIA's GFD selector has this `part-of` value, not ours (selectors are immutable).
pub const SELECTOR_PART_OF: &str = "nvidia-gpu";
/// Where NFD's worker reads feature files (used when the NodeFeature API is off).
pub const FEATURES_DIR: &str = "/etc/kubernetes/node-feature-discovery/features.d";

const OUTPUT_DIR: &str = "output-dir";
const HOST_SYS: &str = "host-sys";
const RUN_NVIDIA: &str = "run-nvidia";

pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> Option<OperandObjects> {
    let spec = &policy.spec;
    if !spec.is_enabled(Component::Gfd) {
        return None;
    }
    let default_gfd = GfdSpec::default();
    let gfd = spec.gfd.as_ref().unwrap_or(&default_gfd);
    let copy = device_plugin::sharing_copy(policy);

    let mut envs = vec![
        env("GFD_SLEEP_INTERVAL", "60s"),
        env("GFD_FAIL_ON_INIT_ERROR", "true"),
        env_field("NAMESPACE", "metadata.namespace"),
        env_field("NODE_NAME", "spec.nodeName"),
        env_field("POD_NAME", "metadata.name"),
    ];
    if facts.openshift {
        // OpenShift's NFD reads feature files, not NodeFeature objects.
        envs.push(env("USE_NODE_FEATURE_API", "false"));
    }
    // User variables before the config and MIG ones, which the operator owns here.
    merge_user_env(&mut envs, gfd.container.env.as_ref());
    if copy.is_some() {
        common::set_env(&mut envs, env("CONFIG_FILE", CONFIG_FILE));
    }
    for var in common::mig_env(spec) {
        common::set_env(&mut envs, var);
    }

    let mut mounts = vec![
        mount(OUTPUT_DIR, FEATURES_DIR),
        mount(HOST_SYS, "/sys").read_only(),
    ];
    let mut volumes = vec![
        host_path_volume(OUTPUT_DIR, FEATURES_DIR, HostPathType::Any),
        host_path_volume(HOST_SYS, "/sys", HostPathType::Any),
        host_path_volume(RUN_NVIDIA, "/run/nvidia", HostPathType::Directory),
    ];
    let mut init = vec![validator::wait_for_toolkit(
        policy,
        mount(RUN_NVIDIA, "/run/nvidia").host_to_container(),
    )];
    let mut sidecars = Vec::new();
    if let Some(copy) = &copy {
        mounts.extend(device_plugin::config_mounts());
        volumes.extend(device_plugin::config_volumes(copy));
        let (cm_init, cm_sidecar) =
            device_plugin::config_manager_containers(policy, copy, MAIN_CONTAINER);
        init.push(cm_init);
        sidecars.push(cm_sidecar);
    }
    let main = Container {
        env: Some(envs),
        volume_mounts: Some(mounts),
        security_context: Some(common::privileged()),
        ..common::container(
            MAIN_CONTAINER,
            &common::image(policy, ImageKind::Gfd),
            &["gpu-feature-discovery"],
            &[],
        )
    };
    let mut containers = vec![main];
    containers.extend(sidecars);
    let pod = PodSpec {
        service_account_name: Some(SERVICE_ACCOUNT.to_owned()),
        share_process_namespace: copy.is_some().then_some(true),
        init_containers: Some(init),
        containers,
        volumes: Some(volumes),
        ..PodSpec::default()
    };
    let mut ds = OperandDaemonSet::new(Operand::Gfd, NAME, pod, MAIN_CONTAINER);
    ds.extra_selector = vec![(PART_OF_LABEL, SELECTOR_PART_OF)];
    ds.image = Some(&gfd.image);
    ds.host_network = gfd.host_network.unwrap_or(false);
    ds.overrides = Some(&gfd.container);
    ds.gpu_access = GpuAccess::Runtime {
        nri_container: MAIN_CONTAINER,
    };
    ds.config_hash = copy.as_ref().map(|c| c.hash.clone());

    let mut objects = OperandObjects::default();
    let role_rules = openshift::use_privileged_scc(facts)
        .into_iter()
        .chain([
            // GFD publishes its labels as a NodeFeature object that NFD turns into labels.
            rule(
                &["nfd.k8s-sigs.io"],
                &["nodefeatures"],
                &["get", "list", "watch", "create", "update"],
            ),
            rule(&[""], &["pods"], &["get"]),
        ])
        .collect();
    common::add_identity(
        &mut objects,
        Operand::Gfd,
        SERVICE_ACCOUNT,
        role_rules,
        vec![rule(&[""], &["nodes"], &["get", "list", "watch"])],
        facts,
    );
    objects
        .daemon_sets
        .push(common::operand_daemon_set(policy, facts, ds));
    objects.dynamic.extend(openshift::scc(
        Operand::Gfd,
        SERVICE_ACCOUNT,
        openshift::HostAccess {
            pid: true,
            ..Default::default()
        },
        facts,
    ));
    Some(objects)
}

/// GFD's images: its own, the validator's (its init container), and the device plugin's for
/// its config-manager sidecar, which runs only with a sharing config to mount (`sharing`).
fn images(spec: &ClusterPolicySpec, sharing: bool) -> Vec<ImageKind> {
    let config_manager = spec.is_enabled(Component::DevicePlugin)
        && sharing
        && spec
            .device_plugin
            .as_ref()
            .and_then(|d| d.config.as_ref())
            .and_then(|c| c.name.as_deref())
            .is_some_and(|n| !n.is_empty());
    let mut kinds = vec![ImageKind::Gfd, ImageKind::Validator];
    if config_manager {
        kinds.push(ImageKind::DevicePlugin);
    }
    kinds
}
