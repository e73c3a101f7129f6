//! Render stage, VFIO manager (pure, no IO): DaemonSet `nvidia-vfio-manager` on
//! `vm-passthrough` nodes. Its k8s-driver-manager init container takes the NVIDIA driver off the
//! GPUs (pausing the operands that use it through their deploy labels), then the main container
//! binds every NVIDIA GPU to vfio-pci so virtual machines can take them whole, and unbinds them
//! when the pod stops (docs/operand-facts.md §20.2, §20.4). On with sandbox workloads and
//! `vfioManager.enabled`.

use k8s_openapi::api::core::v1::{Container, PodSpec};

use super::common::{
    self, HOST_ROOT_VOLUME, HostPathType, MountExt, OperandDaemonSet, env, host_path_volume,
    merge_user_env, mount, rule,
};
use super::openshift;
use crate::api::{Component, ImageKind, VfioManagerSpec};
use crate::facts::ClusterFacts;
use crate::model::{Operand, OperandObjects, ValidatedPolicy};

/// What the engine knows about this operand ([`super::Descriptor`]).
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "vfio-manager",
    component: Some(Component::VfioManager),
    deploy_label: Some(crate::workload::DEPLOY_VFIO_MANAGER),
    consumes_sharing_config: false,
    enabled: super::Enabled::BySwitch,
    images: |_, _| vec![ImageKind::VfioManager, ImageKind::VfioDriverManager],
    host_paths: super::defaults::no_host_paths,
    render,
    check: super::defaults::no_check,
    report: super::defaults::no_report,
};

/// DaemonSet name and `app` label of the DaemonSet (NVIDIA's).
pub const NAME: &str = "nvidia-vfio-manager";
/// ServiceAccount, Role, ClusterRole and SCC name.
pub const SERVICE_ACCOUNT: &str = "nvidia-vfio-manager";
pub const MAIN_CONTAINER: &str = "nvidia-vfio-manager";
pub const MANAGER_CONTAINER: &str = common::DRIVER_MANAGER_CONTAINER;
/// The admission policy keeping the driver manager's node writes to its own node.
pub const CONFINEMENT_POLICY: &str = "nvidia-vfio-manager-own-node";

/// The pod label NVIDIA's DaemonSet selects on (its pods also carry `app`).
const SELECTOR_LABEL: &str = "name";
const HOST_SYS: &str = common::HOST_SYS_VOLUME;
const HOST_LIB_MODULES: &str = "host-lib-modules";
const RUN_NVIDIA: &str = common::RUN_NVIDIA_VOLUME;

/// Binds every NVIDIA GPU to its VFIO driver, then keeps the pod alive (the binding stays after
/// the process; the preStop hook undoes it).
const BIND: &str = "vfio-manage bind --all && sleep inf";

pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> Option<OperandObjects> {
    let spec = &policy.spec;
    if !spec.is_enabled(Component::VfioManager) {
        return None;
    }
    let default_manager = VfioManagerSpec::default();
    let vfio = spec.vfio_manager.as_ref().unwrap_or(&default_manager);

    let mut envs = vec![env("HOST_ROOT", "/host")];
    merge_user_env(&mut envs, vfio.container.env.as_ref());
    let main = Container {
        env: Some(envs),
        resources: Some(common::small_manager_resources()),
        security_context: Some(common::privileged_s0()),
        volume_mounts: Some(vec![
            mount(HOST_SYS, "/sys"),
            mount(HOST_LIB_MODULES, "/lib/modules").read_only(),
            mount(HOST_ROOT_VOLUME, "/host"),
        ]),
        lifecycle: Some(common::pre_stop_exec(&["vfio-manage", "unbind", "--all"])),
        ..common::container(
            MAIN_CONTAINER,
            &common::image(policy, ImageKind::VfioManager),
            &["/bin/sh", "-c"],
            &[BIND],
        )
    };
    let pod = PodSpec {
        service_account_name: Some(SERVICE_ACCOUNT.to_owned()),
        init_containers: Some(vec![common::driver_manager_container(
            policy,
            ImageKind::VfioDriverManager,
            vfio.driver_manager.as_ref(),
        )]),
        containers: vec![main],
        termination_grace_period_seconds: Some(30),
        volumes: Some(vec![
            host_path_volume(HOST_SYS, "/sys", HostPathType::Directory),
            host_path_volume(HOST_LIB_MODULES, "/lib/modules", HostPathType::Directory),
            host_path_volume(RUN_NVIDIA, "/run/nvidia", HostPathType::DirectoryOrCreate),
            host_path_volume(HOST_ROOT_VOLUME, "/", HostPathType::Any),
        ]),
        ..PodSpec::default()
    };
    let mut ds = OperandDaemonSet::new(Operand::VfioManager, NAME, pod, MAIN_CONTAINER);
    ds.annotations = openshift::scc_annotation(facts, SERVICE_ACCOUNT);
    ds.image = Some(&vfio.image);
    ds.overrides = Some(&vfio.container);
    ds.host_network = vfio.host_network.unwrap_or(false);

    let mut objects = OperandObjects::default();
    let role_rules = openshift::use_privileged_scc(facts)
        .into_iter()
        // The driver manager waits for the operator's own operand pods to leave the node
        // before it unloads the driver: pods of one namespace, so a Role.
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
    // It pauses the operands that use the driver by rewriting their deploy labels on its node.
    cluster_rules.push(rule(&[""], &["nodes"], &["get", "list", "patch", "watch"]));
    common::add_identity(
        &mut objects,
        Operand::VfioManager,
        SERVICE_ACCOUNT,
        role_rules,
        cluster_rules,
        facts,
    );
    // Its token may patch only its own node.
    objects.dynamic.extend(common::confinement_policy(
        Operand::VfioManager,
        CONFINEMENT_POLICY,
        &[SERVICE_ACCOUNT],
        &[common::own_node_writes()],
        facts,
    ));
    ds.pod_labels = common::string_map(&[(SELECTOR_LABEL, NAME)]);
    let mut daemon_set = common::operand_daemon_set(policy, facts, ds);
    // NVIDIA selects these pods by `name`, not `app`; a DaemonSet's selector cannot change, so
    // taking over NVIDIA's needs the same one (decision 1).
    if let Some(spec) = daemon_set.spec.as_mut() {
        spec.selector.match_labels = Some(common::string_map(&[(SELECTOR_LABEL, NAME)]));
        if let Some(pod) = spec.template.spec.as_mut() {
            own_settings(pod, vfio);
        }
    }
    objects.daemon_sets.push(daemon_set);
    objects.dynamic.extend(openshift::scc(
        Operand::VfioManager,
        SERVICE_ACCOUNT,
        openshift::HostAccess::default(),
        facts,
    ));
    Some(objects)
}

/// What the shared DaemonSet rules set for every container but this operand needs otherwise:
/// the driver manager pulls with `vfioManager.driverManager`'s policy and secrets, and
/// `vfio-manage` finds the host root where it is mounted (`/host`), wherever
/// `hostPaths.rootFS` puts it on the host.
fn own_settings(pod: &mut PodSpec, vfio: &VfioManagerSpec) {
    let manager_image = vfio.driver_manager.as_ref().map(|m| &m.image);
    for c in pod.init_containers.iter_mut().flatten() {
        if c.name == MANAGER_CONTAINER {
            c.image_pull_policy = Some(common::pull_policy(manager_image));
        }
    }
    for c in &mut pod.containers {
        if c.name == MAIN_CONTAINER {
            common::set_env(
                c.env.get_or_insert_with(Vec::new),
                env("HOST_ROOT", "/host"),
            );
        }
    }
    let secrets = manager_image
        .and_then(|i| i.image_pull_secrets.as_ref())
        .into_iter()
        .flatten()
        .filter(|name| !name.is_empty());
    for name in secrets {
        let list = pod.image_pull_secrets.get_or_insert_with(Vec::new);
        if !list.iter().any(|r| &r.name == name) {
            list.push(k8s_openapi::api::core::v1::LocalObjectReference { name: name.clone() });
        }
    }
}
