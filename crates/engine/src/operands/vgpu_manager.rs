//! Render stage, vGPU manager (pure, no IO): DaemonSet `nvidia-vgpu-manager-daemonset` on
//! `vm-vgpu` nodes, the NVIDIA vGPU host driver in a container. Its k8s-driver-manager init
//! container takes the container driver off the GPUs (as for the VFIO manager), then the main
//! container installs and loads the vGPU host driver (docs/operand-facts.md §20.4, §20.5). On
//! with sandbox workloads and `vgpuManager.enabled`; with `driver.useNvidiaDriverCRD` an
//! NVIDIADriver of type `vgpu-host-manager` deploys it instead, so this one is off (and status
//! says so: crates/api/src/unsupported.rs).
//!
//! Built per OS like the driver: the image tag is `<version>-<os>` of the vm-vgpu nodes' OS,
//! one DaemonSet per OS when they run several (the OS the live DaemonSet runs keeps the plain
//! name). NVIDIA publishes no vGPU manager image: the user builds it from the vGPU host driver
//! package and names it.

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Container, PodSpec};

use super::common::{
    self, HOST_ROOT_VOLUME, HostPathType, MountExt, OperandDaemonSet, env, host_path_volume,
    merge_user_env, mount, rule,
};
use super::{driver, driver_os, openshift};
use crate::api::{ClusterPolicySpec, Component, ImageKind, SandboxWorkload, VgpuManagerSpec};
use crate::facts::ClusterFacts;
use crate::model::{Operand, OperandObjects, ValidatedPolicy};
use crate::nodes::NodeView;
use crate::workload::Sandbox;

/// What the engine knows about this operand ([`super::Descriptor`]).
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "vgpu-manager",
    component: Some(Component::VgpuManager),
    deploy_label: Some(crate::workload::DEPLOY_VGPU_MANAGER),
    consumes_sharing_config: false,
    enabled: super::Enabled::When(|spec, _| enabled(spec)),
    images: |_, _| vec![ImageKind::VgpuManager, ImageKind::VgpuDriverManager],
    host_paths: super::defaults::no_host_paths,
    render,
    check,
    report: |spec, facts| report(spec, facts),
};

/// DaemonSet name and `app` label (NVIDIA's).
pub const NAME: &str = "nvidia-vgpu-manager-daemonset";
/// ServiceAccount, Role, ClusterRole and SCC name.
pub const SERVICE_ACCOUNT: &str = "nvidia-vgpu-manager";
pub const MAIN_CONTAINER: &str = "nvidia-vgpu-manager-ctr";
pub const MANAGER_CONTAINER: &str = "k8s-driver-manager";
/// The admission policy keeping the driver manager's node writes to its own node.
pub const CONFINEMENT_POLICY: &str = "nvidia-vgpu-manager-own-node";

const RUN_NVIDIA: &str = "run-nvidia";
const HOST_OS_RELEASE: &str = "host-os-release";
const HOST_SYS: &str = "host-sys";
const DEV_VFIO: &str = "vfio";
const CGROUP: &str = "host-cgroup";
const VAR_LOG: &str = "var-log";
const DEV_LOG: &str = "dev-log";
const FIRMWARE_SEARCH_PATH: &str = "firmware-search-path";
const FIRMWARE: &str = "nv-firmware";

/// Whether it is deployed: its switch, unless NVIDIADrivers manage the host drivers.
pub fn enabled(spec: &ClusterPolicySpec) -> bool {
    spec.is_enabled(Component::VgpuManager) && !uses_nvidia_driver_crd(spec)
}

fn uses_nvidia_driver_crd(spec: &ClusterPolicySpec) -> bool {
    spec.driver
        .as_ref()
        .is_some_and(|d| d.uses_nvidia_driver_crd())
}

/// The vm-vgpu GPU nodes.
fn vgpu_nodes(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Vec<std::sync::Arc<NodeView>> {
    Sandbox::of(spec)
        .nodes_running(&facts.gpu_nodes, SandboxWorkload::VmVgpu)
        .cloned()
        .collect()
}

/// The OS pools of the vm-vgpu nodes, and those whose OS has no known driver image.
fn pools(
    spec: &ClusterPolicySpec,
    facts: &ClusterFacts,
) -> (Vec<driver_os::OsPool>, Vec<(String, String)>) {
    driver_os::pools(&vgpu_nodes(spec, facts))
}

/// The OS whose DaemonSet keeps the plain name: the live one's while its nodes remain, else
/// the first vm-vgpu pool's, else the GPU nodes' (no vm-vgpu node yet).
fn primary_os(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Option<String> {
    let (pools, _) = pools(spec, facts);
    if let Some(live) = facts.vgpu_manager_live_os.as_deref()
        && pools.iter().any(|p| p.tag == live)
    {
        return Some(live.to_owned());
    }
    pools
        .first()
        .map(|p| p.tag.clone())
        .or_else(|| facts.os_tag.clone())
}

/// The image for nodes of OS `os`: the tag gets `-<os>`; a digest is left as it is.
fn image_for_os(reference: &str, os: Option<&str>) -> String {
    match os {
        Some(os) if !reference.contains("@sha256:") => format!("{reference}-{os}"),
        _ => reference.to_owned(),
    }
}

/// `vgpuManager.kernelModuleConfig.name`, when set: a ConfigMap of kernel module parameters,
/// mounted key by key under /drivers as the driver's is.
pub fn kernel_module_config_name(spec: &ClusterPolicySpec) -> Option<&str> {
    spec.vgpu_manager
        .as_ref()
        .and_then(|m| m.kernel_module_config.as_ref())
        .and_then(|c| c.name.as_deref())
        .filter(|name| !name.is_empty())
}

/// What freezes it: an image that cannot be run (NVIDIA publishes none, so a bare name is not
/// one), no OS to tag it with, or a kernel module parameter ConfigMap that is not there (the
/// pod would not start).
pub fn check(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Vec<String> {
    let mut problems = Vec::new();
    if let Some(name) = kernel_module_config_name(spec)
        && !facts.driver_config_maps.contains_key(name)
    {
        problems.push(format!(
            "spec.vgpuManager.kernelModuleConfig.name: ConfigMap {name} was not found in \
             namespace {}: create it, or clear the field",
            facts.namespace
        ));
    }
    let env = |name: &str| facts.image_env.get(name).cloned();
    let Ok(resolved) = spec.resolve_image(ImageKind::VgpuManager, &env) else {
        // validate reports the missing image itself.
        return problems;
    };
    let last = resolved.reference.rsplit('/').next().unwrap_or_default();
    if !resolved.is_digest && !last.contains(':') {
        problems.push(format!(
            "spec.vgpuManager: the image {:?} has no repository or version; NVIDIA publishes no \
             vGPU manager image: build one from the vGPU host driver package, push it, and set \
             spec.vgpuManager.repository and spec.vgpuManager.version beside \
             spec.vgpuManager.image (NVIDIA's name is vgpu-manager)",
            resolved.reference
        ));
    }
    if !resolved.is_digest && primary_os(spec, facts).is_none() {
        problems.push(format!(
            "spec.vgpuManager: the image tag needs the vm-vgpu nodes' OS suffix (for example \
             {}-ubuntu22.04), and no GPU node with NFD OS labels \
             (feature.node.kubernetes.io/system-os_release.ID and VERSION_ID) is known yet; it \
             renders once one is, or pin spec.vgpuManager.version to a sha256 digest",
            resolved.reference
        ));
    }
    problems
}

/// Reported while it runs: vm-vgpu nodes whose OS has no known driver image (they get no pod).
pub fn report(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Option<String> {
    let (pools, unknown) = pools(spec, facts);
    if unknown.is_empty() {
        return None;
    }
    let named = driver_os::name_nodes(&unknown);
    Some(if pools.is_empty() {
        format!("no vGPU manager image is known for the vm-vgpu nodes' OS: {named}")
    } else {
        format!(
            "vm-vgpu nodes whose OS has no known vGPU manager image get no vGPU manager pod: \
             {named} (known: {})",
            driver_os::KNOWN_OS.join(", ")
        )
    })
}

pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> Option<OperandObjects> {
    let spec = &policy.spec;
    if !enabled(spec) {
        return None;
    }
    let default_manager = VgpuManagerSpec::default();
    let manager = spec.vgpu_manager.as_ref().unwrap_or(&default_manager);
    let reference = common::image(policy, ImageKind::VgpuManager);
    let primary = primary_os(spec, facts);

    let mut objects = OperandObjects::default();
    let role_rules = openshift::use_privileged_scc(facts)
        .into_iter()
        // The driver manager waits for the operator's own operand pods to leave the node
        // before it unloads the container driver: pods of one namespace, so a Role.
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
        Operand::VgpuManager,
        SERVICE_ACCOUNT,
        role_rules,
        cluster_rules,
        facts,
    );
    // Its token may write only its own node.
    objects.dynamic.extend(common::confinement_policy(
        Operand::VgpuManager,
        CONFINEMENT_POLICY,
        &[SERVICE_ACCOUNT],
        &[common::own_node_writes()],
        facts,
    ));

    let plain = daemon_set(
        policy,
        facts,
        manager,
        &image_for_os(&reference, primary.as_deref()),
    );
    match split(spec, facts) {
        None => objects.daemon_sets.push(plain),
        Some(pools) => {
            for pool in pools {
                let is_primary = primary.as_deref() == Some(pool.tag.as_str());
                let mut ds = if is_primary {
                    plain.clone()
                } else {
                    daemon_set(
                        policy,
                        facts,
                        manager,
                        &image_for_os(&reference, Some(&pool.tag)),
                    )
                };
                select_os(&mut ds, &pool);
                if !is_primary {
                    driver::rename_daemon_set(&mut ds, format!("{NAME}-{}", pool.tag));
                }
                objects.daemon_sets.push(ds);
            }
        }
    }
    objects.dynamic.extend(openshift::scc(
        Operand::VgpuManager,
        SERVICE_ACCOUNT,
        openshift::HostAccess {
            pid: true,
            ipc: true,
            ..Default::default()
        },
        facts,
    ));
    Some(objects)
}

/// The pools that each need their own DaemonSet, or `None` when one DaemonSet without an OS
/// selector serves the vm-vgpu nodes (one known OS and none of an unknown one).
fn split(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Option<Vec<driver_os::OsPool>> {
    let (pools, unknown) = pools(spec, facts);
    (pools.len() > 1 || (pools.len() == 1 && !unknown.is_empty())).then_some(pools)
}

/// Limits a DaemonSet to one OS's nodes.
fn select_os(ds: &mut DaemonSet, pool: &driver_os::OsPool) {
    if let Some(pod) = ds.spec.as_mut().and_then(|s| s.template.spec.as_mut()) {
        let selector = pod.node_selector.get_or_insert_with(Default::default);
        for (key, value) in &pool.selector {
            selector.insert(key.clone(), value.clone());
        }
    }
}

/// The DaemonSet running `image` (already carrying its OS suffix).
fn daemon_set(
    policy: &ValidatedPolicy,
    facts: &ClusterFacts,
    manager: &VgpuManagerSpec,
    image: &str,
) -> DaemonSet {
    // The vGPU host driver image builds as the driver image does (OPENSHIFT_VERSION: see
    // driver::driver_env).
    let mut envs: Vec<_> = facts
        .openshift_version
        .as_deref()
        .map(|v| env("OPENSHIFT_VERSION", v))
        .into_iter()
        .collect();
    merge_user_env(&mut envs, manager.container.env.as_ref());
    let kernel_modules = kernel_module_config_name(&policy.spec)
        .map(|name| driver::kernel_module_parameters(name, facts));
    let main = Container {
        env: (!envs.is_empty()).then_some(envs),
        security_context: Some(common::privileged_s0()),
        volume_mounts: Some(
            [
                mount(RUN_NVIDIA, "/run/nvidia").bidirectional(),
                mount(HOST_OS_RELEASE, "/host-etc/os-release").read_only(),
                mount(DEV_VFIO, "/dev/vfio"),
                mount(CGROUP, "/sys/fs/cgroup"),
                mount(VAR_LOG, "/var/log"),
                mount(DEV_LOG, "/dev/log"),
                mount(
                    FIRMWARE_SEARCH_PATH,
                    "/sys/module/firmware_class/parameters/path",
                ),
                mount(FIRMWARE, "/lib/firmware"),
            ]
            .into_iter()
            .chain(kernel_modules.iter().flat_map(|(_, mounts)| mounts.clone()))
            .collect(),
        ),
        ..common::container(MAIN_CONTAINER, image, &["nvidia-driver"], &["init"])
    };
    let pod = PodSpec {
        service_account_name: Some(SERVICE_ACCOUNT.to_owned()),
        host_pid: Some(true),
        host_ipc: Some(true),
        // Unloading the vGPU host driver takes time; give the pod NVIDIA's two minutes.
        termination_grace_period_seconds: Some(120),
        init_containers: Some(vec![common::driver_manager_container(
            policy,
            ImageKind::VgpuDriverManager,
            manager.driver_manager.as_ref(),
        )]),
        containers: vec![main],
        volumes: Some(
            [
                host_path_volume(RUN_NVIDIA, "/run/nvidia", HostPathType::DirectoryOrCreate),
                host_path_volume(HOST_OS_RELEASE, "/etc/os-release", HostPathType::Any),
                host_path_volume(CGROUP, "/sys/fs/cgroup", HostPathType::Directory),
                host_path_volume(DEV_VFIO, "/dev/vfio", HostPathType::Directory),
                host_path_volume(HOST_ROOT_VOLUME, "/", HostPathType::Any),
                host_path_volume(HOST_SYS, "/sys", HostPathType::Directory),
                host_path_volume(VAR_LOG, "/var/log", HostPathType::Directory),
                host_path_volume(DEV_LOG, "/dev/log", HostPathType::Any),
                host_path_volume(
                    FIRMWARE_SEARCH_PATH,
                    "/sys/module/firmware_class/parameters/path",
                    HostPathType::Any,
                ),
                host_path_volume(
                    FIRMWARE,
                    "/run/nvidia/driver/lib/firmware",
                    HostPathType::DirectoryOrCreate,
                ),
            ]
            .into_iter()
            .chain(kernel_modules.map(|(volume, _)| volume))
            .collect(),
        ),
        ..PodSpec::default()
    };
    let mut ds = OperandDaemonSet::new(Operand::VgpuManager, NAME, pod, MAIN_CONTAINER);
    ds.annotations = openshift::scc_annotation(facts, SERVICE_ACCOUNT);
    ds.pod_annotations =
        common::string_map(&[("kubectl.kubernetes.io/default-container", MAIN_CONTAINER)]);
    ds.image = Some(&manager.image);
    ds.overrides = Some(&manager.container);
    ds.host_network = manager.host_network.unwrap_or(false);
    let mut daemon_set = common::operand_daemon_set(policy, facts, ds);
    if let Some(pod) = daemon_set
        .spec
        .as_mut()
        .and_then(|s| s.template.spec.as_mut())
    {
        own_settings(pod, manager);
    }
    daemon_set
}

/// What the shared DaemonSet rules set for every container but this operand needs otherwise:
/// the driver manager pulls with `vgpuManager.driverManager`'s policy and secrets, and gets
/// `vgpuManager`'s resources as NVIDIA's does.
fn own_settings(pod: &mut PodSpec, manager: &VgpuManagerSpec) {
    let manager_image = manager.driver_manager.as_ref().map(|m| &m.image);
    let main_resources = pod
        .containers
        .iter()
        .find(|c| c.name == MAIN_CONTAINER)
        .and_then(|c| c.resources.clone());
    for c in pod.init_containers.iter_mut().flatten() {
        if c.name == MANAGER_CONTAINER {
            c.image_pull_policy = Some(common::pull_policy(manager_image));
            if main_resources.is_some() {
                c.resources.clone_from(&main_resources);
            }
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

/// The OS suffix of the image the live plain-named DaemonSet's main container runs.
pub fn live_os(ds: &DaemonSet) -> Option<String> {
    let pod = ds.spec.as_ref()?.template.spec.as_ref()?;
    let main = pod.containers.iter().find(|c| c.name == MAIN_CONTAINER)?;
    driver_os::image_os_suffix(main.image.as_deref()?).map(str::to_owned)
}
