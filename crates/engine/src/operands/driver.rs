//! Render stage, driver (pure, no IO): DaemonSet `nvidia-driver-daemonset` (always OnDelete,
//! hostPID) with the k8s-driver-manager init container, the driver container and its startup
//! probe, the optional nvidia-peermem, nvidia-fs (GPUDirect Storage, `spec.gds`) and
//! nvidia-gdrcopy (`spec.gdrcopy`) sidecars, the startup-probe ConfigMap and RBAC
//! (docs/operand-facts.md §5). The image tags of the driver and of the GDS and GDRCopy sidecars
//! carry the GPU nodes' OS suffix, added by validate.
//!
//! The variants with one DaemonSet per node group: per OS (operands::driver_os), per kernel
//! for precompiled drivers (operands::driver_kernel), per RHCOS version with OpenShift's Driver
//! Toolkit (operands::driver_toolkit).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{
    Affinity, ConfigMap, ConfigMapVolumeSource, Container, EnvFromSource, EnvVar, ExecAction,
    KeyToPath, LocalObjectReference, NodeAffinity, NodeSelector, NodeSelectorRequirement,
    NodeSelectorTerm, PodAffinityTerm, PodAntiAffinity, PodSpec, Probe, SecretEnvSource,
    SecretVolumeSource, Volume, VolumeMount,
};
use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::common::{
    self, COMPONENT_LABEL, HOST_ROOT_VOLUME, HostPathType, MountExt, OperandDaemonSet, env,
    env_field, host_path_volume, merge_user_env, mount, rule, set_env,
};
use super::driver_variant::Variant;
use super::{driver_os, openshift};
use crate::api::{
    ClusterPolicySpec, Component, ContainerProbeSpec, DriverSpec, EnvVar as PolicyEnvVar,
    ImageKind, ImageSpec, KernelModuleType, SandboxWorkload,
};
use crate::facts::{ClusterFacts, LiveDriver, Runtime};
use crate::model::ValidatedPolicy;
use crate::model::{Operand, OperandObjects};
use crate::nodes::{DRIVER_POOL, KERNEL_VERSION, NodeView};
use crate::workload::Sandbox;

/// What the engine knows about this operand ([`super::Descriptor`]).
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "driver",
    component: Some(Component::Driver),
    deploy_label: Some(crate::nodes::DEPLOY_DRIVER),
    consumes_sharing_config: false,
    enabled: super::Enabled::BySwitch,
    images: |spec, _| images(spec),
    host_paths: super::defaults::no_host_paths,
    render,
    check,
    report: |spec, facts| {
        let facts = &container_fleet(spec, facts);
        let nodes = if super::driver_toolkit::requested(spec, facts) {
            super::driver_toolkit::report(facts)
        } else if uses_precompiled(spec) {
            super::driver_kernel::report(facts)
        } else {
            super::driver_os::report(facts)
        };
        match (super::driver_variant::report(spec, facts), nodes) {
            (Some(handover), Some(nodes)) => Some(format!("{handover}; {nodes}")),
            (handover, nodes) => handover.or(nodes),
        }
    },
};

/// DaemonSet name and `app` label.
pub const NAME: &str = "nvidia-driver-daemonset";
/// ServiceAccount, Role, ClusterRole and SCC name.
pub const SERVICE_ACCOUNT: &str = "nvidia-driver";
pub const MAIN_CONTAINER: &str = "nvidia-driver-ctr";
pub const MANAGER_CONTAINER: &str = "k8s-driver-manager";
pub const PEERMEM_CONTAINER: &str = "nvidia-peermem-ctr";
/// The GPUDirect Storage sidecar (loads nvidia-fs), with `gds.enabled`.
pub const GDS_CONTAINER: &str = "nvidia-fs-ctr";
/// The GDRCopy sidecar (loads gdrdrv), with `gdrcopy.enabled`.
pub const GDRCOPY_CONTAINER: &str = "nvidia-gdrcopy-ctr";
/// `app.kubernetes.io/component` of driver pods; the validator finds the driver DaemonSet by
/// it and the anti-affinity keeps one driver pod per node with it.
pub const COMPONENT: &str = "nvidia-driver";
/// Label telling precompiled and build-on-node driver DaemonSets apart.
pub const PRECOMPILED_LABEL: &str = "nvidia.com/precompiled";
/// The admission policy keeping the driver's ServiceAccount to its own node.
pub const CONFINEMENT_POLICY: &str = "nvidia-driver-own-node";
pub const STARTUP_PROBE_CONFIG_MAP: &str = "nvidia-driver-startup-probe";
pub const STARTUP_PROBE_KEY: &str = "startup-probe.sh";
const STARTUP_PROBE_PATH: &str = "/usr/local/bin/startup-probe.sh";

const RUN_NVIDIA: &str = "run-nvidia";
pub const VAR_LOG: &str = "var-log";
const DEV_LOG: &str = "dev-log";
pub const HOST_OS_RELEASE: &str = "host-os-release";
const RUN_FABRICMANAGER: &str = "run-nvidia-fabricmanager";
const RUN_TOPOLOGYD: &str = "run-nvidia-topologyd";
pub const MOFED_USR_SRC: &str = "mlnx-ofed-usr-src";
const RUN_MELLANOX: &str = "run-mellanox-drivers";
const HOST_SYS: &str = "host-sys";
const FIRMWARE_SEARCH_PATH: &str = "firmware-search-path";
const SYS_DEVICES_SYSTEM: &str = "host-sys-devices-system";
const NV_FIRMWARE: &str = "nv-firmware";
const STARTUP_PROBE_VOLUME: &str = "driver-startup-probe-script";
const LICENSING: &str = "licensing-config";
const TOPOLOGY: &str = "topology-config";
const KERNEL_MODULE_CONFIG: &str = "kernel-module-config";
pub const REPO_CONFIG: &str = "repo-config";
pub const CERT_CONFIG: &str = "cert-config";
const MOFED_DRIVERS_DIR: &str = "/run/mellanox/drivers";

/// What the startup probe does (our script): fail until the module is loaded, the driver
/// daemons report Ready and nvidia-smi works; then publish the container's feature flags to
/// the validator through `.driver-ctr-ready`, written atomically.
const STARTUP_PROBE_SCRIPT: &str = r#"#!/bin/sh
# Startup probe of the NVIDIA driver container (rendered by gpu-operator).
dir=/run/nvidia/validations
mkdir -p "$dir" || exit 1
# The kernel module must be loaded.
[ -f /sys/module/nvidia/refcnt ] || exit 1
# Daemons the driver container starts report their state here while they come up.
status_file="$dir/.driver-daemons-status"
if [ -f "$status_file" ] && [ "$(cat "$status_file")" != "Ready" ]; then
  exit 1
fi
nvidia-smi >/dev/null 2>&1 || exit 1
tmp=$(mktemp "$dir/.driver-ctr-ready.XXXXXX") || exit 1
{
  echo "GDRCOPY_ENABLED: ${GDRCOPY_ENABLED:-false}"
  echo "GDS_ENABLED: ${GDS_ENABLED:-false}"
  echo "GPU_DIRECT_RDMA_ENABLED: ${GPU_DIRECT_RDMA_ENABLED:-false}"
} >"$tmp" && mv -f "$tmp" "$dir/.driver-ctr-ready"
"#;

/// Liveness and readiness of a started driver container: the module is loaded and nvidia-smi
/// answers. Unlike the startup probe it writes nothing, so it can run every period.
const HEALTH_PROBE: &[&str] = &[
    "sh",
    "-c",
    "[ -f /sys/module/nvidia/refcnt ] && nvidia-smi >/dev/null 2>&1",
];
/// Timing of [`HEALTH_PROBE`] where the policy leaves it unset (initial delay, period, timeout,
/// failure and success thresholds): nvidia-smi can take tens of seconds on a loaded node, and
/// the startup probe already waited for the first load.
const HEALTH_PROBE_TIMING: [i32; 5] = [0, 30, 60, 3, 1];

/// What stops `driver.usePrecompiled` from being applied as the policy says. Without
/// `useNvidiaDriverCRD` a switch of a running fleet is not one of them: it is handed over node
/// by node (operands::driver_variant). With it, the policy's own DaemonSets build on the node,
/// and nothing hands its precompiled nodes over.
fn precompiled_problems(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Vec<String> {
    let default_driver = DriverSpec::default();
    let driver = spec.driver.as_ref().unwrap_or(&default_driver);
    let precompiled = uses_precompiled(spec);
    // With the CRD on, the policy's own DaemonSets build on the node whatever usePrecompiled
    // says, so the field whose change would switch them is useNvidiaDriverCRD.
    let (field, back) = if driver.uses_precompiled() && !precompiled {
        ("spec.driver.useNvidiaDriverCRD", false)
    } else {
        ("spec.driver.usePrecompiled", !precompiled)
    };
    let undo = format!("set {field} back to {back}");
    let mut problems = Vec::new();
    if driver.uses_nvidia_driver_crd() {
        problems.extend(precompiled_switch_problem(
            field,
            &undo,
            precompiled,
            &facts.live_driver,
        ));
    }
    if precompiled {
        let on = |enabled: Option<bool>| enabled == Some(true);
        problems.extend(precompiled_input_problems(
            "spec.driver",
            driver.image.version.as_deref(),
            on(spec.gds.as_ref().and_then(|g| g.enabled)),
            on(spec.gdrcopy.as_ref().and_then(|g| g.enabled)),
        ));
    }
    problems
}

/// What stops running drivers that nothing hands over node by node (an NVIDIADriver pool's,
/// or the policy's own beside the pools) from switching between precompiled images and
/// building on the node: every node's driver would be replaced at once (decision 20). `field`
/// is the field whose change asks for it, `undo` how to take it back.
pub fn precompiled_switch_problem(
    field: &str,
    undo: &str,
    precompiled: bool,
    live: &LiveDriver,
) -> Option<String> {
    let built = live.runs(Variant::BuiltOnNode) || live.runs(Variant::DriverToolkit);
    let prebuilt = live.runs(Variant::Precompiled);
    if precompiled && built && !prebuilt {
        return Some(format!(
            "{field}: the GPU nodes run driver DaemonSets that build the driver on each node \
             ({PRECOMPILED_LABEL}=false); switching them to precompiled drivers would replace the \
             driver on every GPU node at once, which this operator does not do yet: {undo}, or \
             delete those DaemonSets when no GPU job runs"
        ));
    }
    if !precompiled && prebuilt && !built {
        return Some(format!(
            "{field}: the GPU nodes run precompiled driver DaemonSets ({PRECOMPILED_LABEL}=true); \
             switching them to drivers built on the node would replace the driver on every GPU \
             node at once, which this operator does not do yet: {undo}, or delete those \
             DaemonSets when no GPU job runs"
        ));
    }
    None
}

/// What precompiled drivers cannot work with, as NVIDIA refuses it: a digest (one image, where
/// each kernel needs its own tag) and the GDS or GDRCopy sidecars (no precompiled modules
/// exist for them). `driver` is the path of the driver fields (`spec.driver`, or `spec` in an
/// NVIDIADriver).
pub fn precompiled_input_problems(
    driver: &str,
    version: Option<&str>,
    gds: bool,
    gdrcopy: bool,
) -> Vec<String> {
    let mut problems = Vec::new();
    if version.is_some_and(|v| v.contains("sha256:")) {
        problems.push(format!(
            "{driver}.version: a digest names one image, and precompiled drivers need one per \
             kernel (tag <version>-<kernel>-<os>); give the driver branch, such as 580"
        ));
    }
    for (field, on) in [("spec.gds.enabled", gds), ("spec.gdrcopy.enabled", gdrcopy)] {
        if on {
            problems.push(format!(
                "{field}: NVIDIA publishes no precompiled GPUDirect Storage or GDRCopy modules, \
                 so they cannot run beside precompiled drivers; set it to false, or \
                 {driver}.usePrecompiled to false"
            ));
        }
    }
    problems
}

/// The OS id part of an OS tag (`ubuntu22.04` -> `ubuntu`, `sl-micro6.0` -> `sl-micro`).
pub fn os_id(os_tag: &str) -> &str {
    let end = os_tag
        .find(|c: char| c.is_ascii_digit())
        .unwrap_or(os_tag.len());
    &os_tag[..end]
}

/// Where the OS's package manager reads repository files, for `driver.repoConfig`.
pub fn repo_dir(os_id: &str) -> Option<&'static str> {
    match os_id {
        "ubuntu" | "debian" => Some("/etc/apt/sources.list.d"),
        "rhel" | "rhcos" | "centos" | "rocky" | "ol" => Some("/etc/yum.repos.d"),
        "sles" | "sl-micro" => Some("/etc/zypp/repos.d"),
        _ => None,
    }
}

/// Where the OS reads extra CA certificates, for `driver.certConfig`.
pub fn cert_dir(os_id: &str) -> Option<&'static str> {
    match os_id {
        "ubuntu" | "debian" => Some("/usr/local/share/ca-certificates"),
        "rhel" | "rhcos" | "centos" | "rocky" | "ol" => Some("/etc/pki/ca-trust/extracted/pem"),
        "sles" | "sl-micro" => Some("/etc/pki/trust/anchors"),
        _ => None,
    }
}

/// The images the driver's pods run: the driver and its manager, and the GDS and GDRCopy
/// sidecars' images where the policy turns them on.
fn images(spec: &ClusterPolicySpec) -> Vec<ImageKind> {
    let mut kinds = vec![ImageKind::Driver, ImageKind::DriverManager];
    if spec.is_enabled(Component::Gds) {
        kinds.push(ImageKind::Gds);
    }
    if spec.is_enabled(Component::GdrCopy) {
        kinds.push(ImageKind::GdrCopy);
    }
    kinds
}

/// The images of one OS's driver pods, each with that OS's suffix (unless pinned by digest):
/// the driver, and the GDS and GDRCopy sidecars' images when they are on (`None`: no sidecar).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DriverImages {
    pub driver: String,
    pub gds: Option<String>,
    pub gdrcopy: Option<String>,
}

impl DriverImages {
    /// The policy's images, resolved by validate with the primary OS's suffix.
    fn of_policy(policy: &ValidatedPolicy) -> DriverImages {
        let sidecar = |component, kind| {
            policy
                .spec
                .is_enabled(component)
                .then(|| common::image(policy, kind))
        };
        DriverImages {
            driver: common::image(policy, ImageKind::Driver),
            gds: sidecar(Component::Gds, ImageKind::Gds),
            gdrcopy: sidecar(Component::GdrCopy, ImageKind::GdrCopy),
        }
    }

    /// These images (suffixed for `primary`) for the nodes of `tag`: the OS suffix replaced,
    /// digests kept (a digest pins one image for every OS).
    fn for_os(&self, primary: &str, tag: &str) -> DriverImages {
        let swap = |image: &String| match image.strip_suffix(&format!("-{primary}")) {
            Some(reference) => format!("{reference}-{tag}"),
            None => image.clone(),
        };
        DriverImages {
            driver: swap(&self.driver),
            gds: self.gds.as_ref().map(swap),
            gdrcopy: self.gdrcopy.as_ref().map(swap),
        }
    }
}

fn non_empty(s: Option<&String>) -> Option<&str> {
    s.map(String::as_str).filter(|s| !s.is_empty())
}

/// `driver.kernelModuleConfig.name`, when set.
fn kernel_module_config_name(driver: &DriverSpec) -> Option<&str> {
    non_empty(
        driver
            .kernel_module_config
            .as_ref()
            .and_then(|c| c.name.as_ref()),
    )
}

/// `driver.repoConfig.configMapName`, when set.
fn repo_config_name(driver: &DriverSpec) -> Option<&str> {
    non_empty(
        driver
            .repo_config
            .as_ref()
            .and_then(|r| r.config_map_name.as_ref()),
    )
}

/// `driver.certConfig.name`, when set.
fn cert_config_name(driver: &DriverSpec) -> Option<&str> {
    non_empty(driver.cert_config.as_ref().and_then(|c| c.name.as_ref()))
}

/// The driver ConfigMaps the policy names: (field path, name), for validate's checks.
pub fn referenced_config_maps(driver: &DriverSpec) -> Vec<(&'static str, &str)> {
    let mut out = Vec::new();
    if let Some(name) = repo_config_name(driver) {
        out.push(("spec.driver.repoConfig.configMapName", name));
    }
    if let Some(name) = cert_config_name(driver) {
        out.push(("spec.driver.certConfig.name", name));
    }
    if let Some(name) = kernel_module_config_name(driver) {
        out.push(("spec.driver.kernelModuleConfig.name", name));
    }
    out
}

fn probe(exec: &[&str], defaults: [i32; 5], custom: Option<&ContainerProbeSpec>) -> Probe {
    let [initial_delay, period, timeout, failure, success] = defaults;
    let custom = custom.cloned().unwrap_or_default();
    Probe {
        exec: Some(ExecAction {
            command: Some(exec.iter().map(|s| (*s).to_owned()).collect()),
        }),
        initial_delay_seconds: Some(custom.initial_delay_seconds.unwrap_or(initial_delay)),
        period_seconds: Some(custom.period_seconds.unwrap_or(period)),
        timeout_seconds: Some(custom.timeout_seconds.unwrap_or(timeout)),
        failure_threshold: Some(custom.failure_threshold.unwrap_or(failure)),
        success_threshold: Some(custom.success_threshold.unwrap_or(success)),
        ..Probe::default()
    }
}

/// Mounts of every key of a ConfigMap as its own file under `dir` (keeps files the image
/// already has there).
fn per_key_mounts(volume: &str, dir: &str, keys: &[String]) -> Vec<VolumeMount> {
    keys.iter()
        .map(|key| {
            mount(volume, &common::join_path(dir, key))
                .sub_path(key)
                .read_only()
        })
        .collect()
}

/// The driver's objects: one DaemonSet for a fleet of one OS, else one per OS of the GPU nodes
/// (operands::driver_os), each with its OS's image tag and an OS node selector.
///
/// With `useNvidiaDriverCRD` the GPU nodes an NVIDIADriver pool runs on (they carry
/// [`DRIVER_POOL`], written once the pool's DaemonSet exists) are left to it: the DaemonSets
/// here keep off them by node affinity and cover only the other GPU nodes, and when no GPU node
/// is left, none is rendered. The ServiceAccount, RBAC and startup-probe ConfigMap stay, as the
/// pools' DaemonSets use them too.
pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> Option<OperandObjects> {
    let facts = &container_fleet(&policy.spec, facts);
    let image = DriverImages::of_policy(policy);
    let variant = super::driver_variant::wanted(&policy.spec, facts);
    let mut objects = match variant {
        Variant::Precompiled => render_precompiled(policy, facts, image)?,
        Variant::DriverToolkit => render_toolkit(policy, facts, image)?,
        Variant::BuiltOnNode if uses_nvidia_driver_crd(&policy.spec) => {
            return render_beside_pools(policy, facts, image);
        }
        Variant::BuiltOnNode => render_fleet(policy, facts, image, driver_os::split(facts))?,
    };
    // A running fleet of another variant moves to this one node by node.
    super::driver_variant::with_handover(facts, variant, &mut objects);
    Some(objects)
}

/// With `useNvidiaDriverCRD`: the driver for the GPU nodes no NVIDIADriver pool runs on.
fn render_beside_pools(
    policy: &ValidatedPolicy,
    facts: &ClusterFacts,
    image: DriverImages,
) -> Option<OperandObjects> {
    let gpu = |n: &std::sync::Arc<NodeView>| n.is_gpu_node() || n.has_nfd_gpu();
    let had_gpu_nodes = facts.gpu_nodes.iter().any(gpu);
    let facts = uncovered(facts);
    // One DaemonSet per OS even for one OS, so nodes joining or leaving pools never rename
    // or reselect the DaemonSet the other nodes run.
    let pools = driver_os::pools(&facts.gpu_nodes).0;
    let mut objects = render_fleet(policy, &facts, image, Some(pools))?;
    if had_gpu_nodes && !facts.gpu_nodes.iter().any(gpu) {
        objects.daemon_sets.clear();
    }
    for ds in &mut objects.daemon_sets {
        keep_off_pools(ds);
    }
    Some(objects)
}

/// Whether the policy's own driver DaemonSets are precompiled ([`super::driver_kernel`]). With
/// `useNvidiaDriverCRD` they are not, whatever `usePrecompiled` says: NVIDIA's operator then
/// leaves the driver to the NVIDIADrivers (each pool has its own `usePrecompiled`), and status
/// lists `driver.usePrecompiled` as not acted on.
pub fn uses_precompiled(spec: &ClusterPolicySpec) -> bool {
    spec.driver
        .as_ref()
        .is_some_and(|d| d.uses_precompiled() && !d.uses_nvidia_driver_crd())
}

/// The driver's objects with precompiled images: one DaemonSet per kernel of the GPU nodes
/// ([`super::driver_kernel`]), none while no GPU node has a kernel pool. Each pool's image
/// swaps the primary OS suffix for its kernel and OS.
fn render_precompiled(
    policy: &ValidatedPolicy,
    facts: &ClusterFacts,
    images: DriverImages,
) -> Option<OperandObjects> {
    let primary = facts.os_tag.clone().unwrap_or_default();
    let mut objects = render_os(policy, facts, images.clone())?;
    let (pools, _) = super::driver_kernel::pools(&facts.gpu_nodes);
    let mut daemon_sets = Vec::new();
    for pool in &pools {
        // GDS and GDRCopy are refused beside precompiled drivers, so only the driver image
        // is here to retag.
        let pool_images = images.for_os(&primary, &pool.tag_suffix());
        let name = pool.daemon_set_name(NAME);
        daemon_sets.push(render_kernel_daemon_set(
            policy,
            facts,
            pool,
            pool_images,
            &name,
        )?);
    }
    objects.daemon_sets = daemon_sets;
    Some(objects)
}

/// The precompiled driver DaemonSet for the GPU nodes of one kernel, with `images` (the kernel
/// and OS in their tags), named `name`: selecting the kernel and the OS (unlike NVIDIA's, which
/// selects the kernel only: nodes of another OS on the same kernel are not the pool's, and
/// driver_kernel::pools reports them), labelled `nvidia.com/precompiled=true`. The policy's
/// kernel pools and an NVIDIADriver's render it alike.
pub fn render_kernel_daemon_set(
    policy: &ValidatedPolicy,
    facts: &ClusterFacts,
    pool: &super::driver_kernel::KernelPool,
    images: DriverImages,
    name: &str,
) -> Option<DaemonSet> {
    let mut ds = daemon_set_for_os(policy, facts, &pool.os_tag, images)?;
    let mut selector = pool.os_selector.clone();
    selector.push((KERNEL_VERSION.to_owned(), pool.kernel.clone()));
    let os = driver_os::OsPool {
        tag: pool.os_tag.clone(),
        selector,
        nodes: pool.nodes.clone(),
    };
    select_os(&mut ds, &os, Some(name.to_owned()));
    let precompiled = |labels: &mut Option<BTreeMap<String, String>>| {
        labels
            .get_or_insert_default()
            .insert(PRECOMPILED_LABEL.to_owned(), "true".to_owned());
    };
    precompiled(&mut ds.metadata.labels);
    if let Some(spec) = ds.spec.as_mut() {
        precompiled(&mut spec.template.metadata.get_or_insert_default().labels);
    }
    Some(ds)
}

/// The driver's objects built with OpenShift's Driver Toolkit: one DaemonSet per RHCOS version
/// of the GPU nodes that has a toolkit image ([`super::driver_toolkit`]), each with its nodes'
/// OS tag on the driver image.
fn render_toolkit(
    policy: &ValidatedPolicy,
    facts: &ClusterFacts,
    images: DriverImages,
) -> Option<OperandObjects> {
    let primary = facts.os_tag.clone().unwrap_or_default();
    let mut objects = render_os(policy, facts, images.clone())?;
    let (pools, _) = super::driver_toolkit::pools(facts);
    let mut daemon_sets = Vec::new();
    for pool in &pools {
        let tag = pool.os_tag.clone().unwrap_or_else(|| primary.clone());
        let name = pool.daemon_set_name(NAME);
        daemon_sets.push(render_toolkit_daemon_set(
            policy,
            facts,
            pool,
            &tag,
            images.for_os(&primary, &tag),
            &name,
        )?);
    }
    objects.daemon_sets = daemon_sets;
    Some(objects)
}

/// The Driver Toolkit DaemonSet for the GPU nodes of one RHCOS version, whose OS tag is
/// `os_tag`, with `images` (that OS's), named `name`. The policy's toolkit pools and an
/// NVIDIADriver's render it alike.
pub fn render_toolkit_daemon_set(
    policy: &ValidatedPolicy,
    facts: &ClusterFacts,
    pool: &super::driver_toolkit::ToolkitPool,
    os_tag: &str,
    images: DriverImages,
    name: &str,
) -> Option<DaemonSet> {
    let mut ds = daemon_set_for_os(policy, facts, os_tag, images)?;
    super::driver_toolkit::apply(&mut ds, pool, name);
    // The digest covers the toolkit container and the entrypoint, as NVIDIA's does.
    add_config_digest(&mut ds);
    Some(ds)
}

/// Whether the policy hands GPU nodes selected by NVIDIADriver resources to them.
pub fn uses_nvidia_driver_crd(spec: &ClusterPolicySpec) -> bool {
    spec.driver
        .as_ref()
        .is_some_and(DriverSpec::uses_nvidia_driver_crd)
}

/// The facts as the driver sees them: only the GPU nodes that run containers. Nodes given to
/// virtual machines run the VFIO or the vGPU manager instead (crates/engine/src/workload.rs),
/// so their OS or kernel gets no driver DaemonSet of its own, nor a line in status (the OS tag
/// is already theirs: facts::assemble). Borrowed when every GPU node runs containers.
fn container_fleet<'a>(spec: &ClusterPolicySpec, facts: &'a ClusterFacts) -> Cow<'a, ClusterFacts> {
    let containers: Vec<Arc<NodeView>> = Sandbox::of(spec)
        .nodes_running(&facts.gpu_nodes, SandboxWorkload::Container)
        .cloned()
        .collect();
    if containers.len() == facts.gpu_nodes.len() {
        return Cow::Borrowed(facts);
    }
    Cow::Owned(ClusterFacts {
        gpu_nodes: containers,
        ..facts.clone()
    })
}

/// The facts without the GPU nodes an NVIDIADriver pool runs on (the primary OS, and so the
/// DaemonSet names, stay as they are).
fn uncovered(facts: &ClusterFacts) -> ClusterFacts {
    ClusterFacts {
        gpu_nodes: facts
            .gpu_nodes
            .iter()
            .filter(|n| n.label(DRIVER_POOL).is_none())
            .cloned()
            .collect(),
        ..facts.clone()
    }
}

/// Keeps a ClusterPolicy driver DaemonSet off the nodes NVIDIADriver pools run on.
fn keep_off_pools(ds: &mut DaemonSet) {
    let Some(pod) = ds.spec.as_mut().and_then(|s| s.template.spec.as_mut()) else {
        return;
    };
    let affinity = pod.affinity.get_or_insert_with(Affinity::default);
    affinity.node_affinity = Some(NodeAffinity {
        required_during_scheduling_ignored_during_execution: Some(NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm {
                match_expressions: Some(vec![NodeSelectorRequirement {
                    key: DRIVER_POOL.to_owned(),
                    operator: "DoesNotExist".to_owned(),
                    values: None,
                }]),
                match_fields: None,
            }],
        }),
        ..NodeAffinity::default()
    });
}

/// The driver DaemonSet for the GPU nodes of one OS, with `images` (the OS suffix included),
/// named `name` and selecting the OS's nodes: what an NVIDIADriver pool renders per OS, from
/// the same render as the policy's own driver.
pub fn render_pool_daemon_set(
    policy: &ValidatedPolicy,
    facts: &ClusterFacts,
    pool: &driver_os::OsPool,
    images: DriverImages,
    name: &str,
) -> Option<DaemonSet> {
    let mut ds = daemon_set_for_os(policy, facts, &pool.tag, images)?;
    select_os(&mut ds, pool, Some(name.to_owned()));
    Some(ds)
}

/// The driver DaemonSet for the GPU nodes of OS `os_tag` with `images` (before any pool's
/// name, selector or labels): every per-OS, per-kernel and per-RHCOS pool starts from it.
fn daemon_set_for_os(
    policy: &ValidatedPolicy,
    facts: &ClusterFacts,
    os_tag: &str,
    images: DriverImages,
) -> Option<DaemonSet> {
    let pool_facts = ClusterFacts {
        os_tag: Some(os_tag.to_owned()),
        ..facts.clone()
    };
    render_os(policy, &pool_facts, images)?
        .daemon_sets
        .into_iter()
        .next()
}

/// The driver's objects, with one DaemonSet per OS pool in `pools` (`None`: one DaemonSet
/// without an OS selector).
fn render_fleet(
    policy: &ValidatedPolicy,
    facts: &ClusterFacts,
    image: DriverImages,
    pools: Option<Vec<driver_os::OsPool>>,
) -> Option<OperandObjects> {
    let mut objects = render_os(policy, facts, image.clone())?;
    let Some(pools) = pools else {
        return Some(objects);
    };
    let primary = facts.os_tag.clone().unwrap_or_default();
    let mut daemon_sets = Vec::new();
    for pool in &pools {
        let mut ds = if pool.tag == primary {
            objects.daemon_sets.first()?.clone()
        } else {
            daemon_set_for_os(policy, facts, &pool.tag, image.for_os(&primary, &pool.tag))?
        };
        let rename = (pool.tag != primary).then(|| format!("{NAME}-{}", pool.tag));
        select_os(&mut ds, pool, rename);
        daemon_sets.push(ds);
    }
    objects.daemon_sets = daemon_sets;
    Some(objects)
}

/// A label value for a DaemonSet name: at most 63 characters, ending alphanumeric.
pub fn app_label(name: &str) -> String {
    let cut: String = name.chars().take(63).collect();
    cut.trim_end_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_owned()
}

/// Limits a driver DaemonSet to one OS's nodes, under its own name (and `app` label, which its
/// selector uses) when it is not the primary one.
fn select_os(ds: &mut DaemonSet, pool: &driver_os::OsPool, rename: Option<String>) {
    let Some(spec) = ds.spec.as_mut() else {
        return;
    };
    if let Some(pod) = spec.template.spec.as_mut() {
        let selector = pod.node_selector.get_or_insert_with(BTreeMap::new);
        for (key, value) in &pool.selector {
            selector.insert(key.clone(), value.clone());
        }
    }
    if let Some(name) = rename {
        rename_daemon_set(ds, name);
    }
}

/// Gives an operand DaemonSet its own name, and the `app` label (which its selector uses) of
/// that name, so it lives beside the one of the plain name.
pub fn rename_daemon_set(ds: &mut DaemonSet, name: String) {
    let Some(spec) = ds.spec.as_mut() else {
        return;
    };
    let app = app_label(&name);
    let set_app = |labels: &mut Option<BTreeMap<String, String>>| {
        labels
            .get_or_insert_with(BTreeMap::new)
            .insert(common::APP_LABEL.to_owned(), app.clone());
    };
    set_app(&mut spec.selector.match_labels);
    set_app(
        &mut spec
            .template
            .metadata
            .get_or_insert_with(Default::default)
            .labels,
    );
    set_app(&mut ds.metadata.labels);
    ds.metadata.name = Some(name);
}

/// The driver's objects for the GPU nodes of `facts.os_tag`, with `images` (that OS's).
fn render_os(
    policy: &ValidatedPolicy,
    facts: &ClusterFacts,
    images: DriverImages,
) -> Option<OperandObjects> {
    let spec = &policy.spec;
    let default_driver = DriverSpec::default();
    let driver = spec.driver.as_ref().unwrap_or(&default_driver);
    if !spec.is_enabled(Component::Driver) {
        return None;
    }
    let sidecars = sidecars(spec, &images);
    let files = host_files(driver, uses_precompiled(spec), facts);
    let manager = manager_container(policy, driver);
    let mut containers = vec![driver_container(
        driver,
        &sidecars,
        &images.driver,
        files.driver_mounts,
        facts.openshift_version.as_deref(),
    )];
    containers.extend(peermem_container(
        driver,
        &images.driver,
        files.peermem_mounts,
    ));
    containers.extend(
        sidecars
            .iter()
            .map(|s| sidecar_container(driver, s, files.sidecar_mounts.clone())),
    );
    let pod = pod_spec(manager, containers, files.volumes);
    let mut daemon_set = daemon_set(policy, facts, driver, pod);
    sidecar_pull_settings(&mut daemon_set, &sidecars);
    Some(objects(facts, daemon_set))
}

/// One kernel-module sidecar of the driver pod (GDS or GDRCopy): what NVIDIA's
/// `transformGDSContainer` / `transformGDRCopyContainer` make of the asset's container.
struct Sidecar<'a> {
    container: &'static str,
    /// Driver container env var telling the startup probe (and so the validator) it is on.
    flag: &'static str,
    image: &'a str,
    /// The kernel module it loads, as `lsmod` names it.
    module: &'static str,
    /// The command of its image that builds and loads the module.
    install: &'static str,
    settings: &'a ImageSpec,
    env: Option<&'a Vec<PolicyEnvVar>>,
}

/// The sidecars `images` holds an image for (validate resolved one exactly for those the
/// policy turns on), GDS first as in NVIDIA's DaemonSet.
fn sidecars<'a>(spec: &'a ClusterPolicySpec, images: &'a DriverImages) -> Vec<Sidecar<'a>> {
    let mut out = Vec::new();
    if let (Some(gds), Some(image)) = (spec.gds.as_ref(), images.gds.as_deref()) {
        out.push(Sidecar {
            container: GDS_CONTAINER,
            flag: "GDS_ENABLED",
            image,
            module: "nvidia_fs",
            install: "nvidia-gds-driver",
            settings: &gds.image,
            env: gds.env.as_ref(),
        });
    }
    if let (Some(gdrcopy), Some(image)) = (spec.gdrcopy.as_ref(), images.gdrcopy.as_deref()) {
        out.push(Sidecar {
            container: GDRCOPY_CONTAINER,
            flag: "GDRCOPY_ENABLED",
            image,
            module: "gdrdrv",
            install: "nvidia-gdrcopy-driver",
            settings: &gdrcopy.image,
            env: gdrcopy.env.as_ref(),
        });
    }
    out
}

/// A kernel-module sidecar: it waits until the driver container has published its sources and
/// loaded the driver, then builds and loads its module; started once `lsmod` lists it. The
/// policy's env for it, the driver's secret env (the build may need proxies or credentials) and
/// the package repository and CA files it builds with.
fn sidecar_container(
    driver: &DriverSpec,
    sidecar: &Sidecar<'_>,
    mounts: Vec<VolumeMount>,
) -> Container {
    let mut sidecar_env = Vec::new();
    merge_user_env(&mut sidecar_env, sidecar.env);
    let wait_and_install = format!(
        "until [ -d /run/nvidia/driver/usr/src ] && lsmod | grep nvidia; do echo  Waiting for \
         nvidia-driver to be installed...; sleep 10; done; exec {} install",
        sidecar.install
    );
    let loaded = format!("lsmod | grep {}", sidecar.module);
    let mut sidecar_mounts = vec![
        mount(RUN_NVIDIA, "/run/nvidia").host_to_container(),
        mount(VAR_LOG, "/var/log"),
        mount(DEV_LOG, "/dev/log").read_only(),
    ];
    sidecar_mounts.extend(mounts);
    Container {
        env: (!sidecar_env.is_empty()).then_some(sidecar_env),
        env_from: secret_env_from(driver),
        security_context: Some(common::privileged_s0()),
        volume_mounts: Some(sidecar_mounts),
        startup_probe: Some(probe(&["sh", "-c", &loaded], [10, 10, 10, 120, 1], None)),
        ..common::container(
            sidecar.container,
            sidecar.image,
            &["bash", "-xc"],
            &[&wait_and_install],
        )
    }
}

/// Pull policy and pull secrets of the sidecars from their own sections (the common rules gave
/// every container the driver's pull policy): NVIDIA adds their pull secrets to the pod's.
fn sidecar_pull_settings(daemon_set: &mut DaemonSet, sidecars: &[Sidecar<'_>]) {
    let Some(pod) = daemon_set
        .spec
        .as_mut()
        .and_then(|s| s.template.spec.as_mut())
    else {
        return;
    };
    for sidecar in sidecars {
        if let Some(c) = pod
            .containers
            .iter_mut()
            .find(|c| c.name == sidecar.container)
        {
            c.image_pull_policy = Some(common::pull_policy(Some(sidecar.settings)));
        }
        let names = sidecar.settings.image_pull_secrets.iter().flatten();
        for name in names.filter(|n| !n.is_empty()) {
            let secrets = pod.image_pull_secrets.get_or_insert_with(Vec::new);
            if !secrets.iter().any(|s| &s.name == name) {
                secrets.push(LocalObjectReference { name: name.clone() });
            }
        }
    }
}

/// Whether the driver builds against the host's MOFED instead of the MOFED driver container's.
fn uses_host_mofed(driver: &DriverSpec) -> bool {
    driver.rdma.as_ref().is_some_and(|r| r.uses_host_mofed())
}

/// The keys of the driver ConfigMap `name` (none when it is not present).
fn config_map_keys(facts: &ClusterFacts, name: &str) -> Vec<String> {
    facts
        .driver_config_maps
        .get(name)
        .map(|cm| cm.data.keys().cloned().collect())
        .unwrap_or_default()
}

/// The driver pod's volumes and what the driver, peermem and GDS / GDRCopy sidecars mount of
/// them (the sidecars' own host directories are in [`sidecar_container`]).
#[derive(Default)]
struct HostFiles {
    volumes: Vec<Volume>,
    driver_mounts: Vec<VolumeMount>,
    peermem_mounts: Vec<VolumeMount>,
    sidecar_mounts: Vec<VolumeMount>,
}

impl HostFiles {
    /// `other`'s volumes and mounts after these.
    fn append(&mut self, other: HostFiles) {
        self.volumes.extend(other.volumes);
        self.driver_mounts.extend(other.driver_mounts);
        self.peermem_mounts.extend(other.peermem_mounts);
        self.sidecar_mounts.extend(other.sidecar_mounts);
    }
}

/// Every volume of the driver pod and the driver and peermem containers' mounts: the host
/// directories they always use, then those of the optional sources the policy names.
fn host_files(driver: &DriverSpec, precompiled: bool, facts: &ClusterFacts) -> HostFiles {
    let os = facts.os_tag.as_deref().map(os_id).unwrap_or_default();
    let mut files = standard_host_files(uses_host_mofed(driver));
    for optional in [
        licensing_files(driver),
        topology_files(driver),
        kernel_module_files(driver, facts),
    ] {
        files.append(optional);
    }
    if precompiled {
        // Nothing is installed from packages; SUSE's precompiled images read the host's
        // modules tree at run time (NVIDIA's transformDriverContainer).
        if matches!(os, "sles" | "sl-micro") {
            files.append(HostFiles {
                volumes: vec![host_path_volume(
                    "lib-modules",
                    "/lib/modules",
                    HostPathType::Directory,
                )],
                driver_mounts: vec![mount("lib-modules", "/run/host/lib/modules").read_only()],
                peermem_mounts: Vec::new(),
                sidecar_mounts: Vec::new(),
            });
        }
        return files;
    }
    for optional in [
        repo_files(driver, os, facts),
        cert_files(driver, os, facts),
        subscription_files(driver, os, facts),
    ] {
        files.append(optional);
    }
    files
}

/// The host directories every driver pod uses and the startup-probe script, with the driver
/// and peermem containers' mounts of them.
fn standard_host_files(host_mofed: bool) -> HostFiles {
    let driver_mounts = vec![
        mount(RUN_NVIDIA, "/run/nvidia").bidirectional(),
        mount(VAR_LOG, "/var/log"),
        mount(DEV_LOG, "/dev/log"),
        mount(HOST_OS_RELEASE, "/host-etc/os-release").read_only(),
        mount(RUN_FABRICMANAGER, "/run/nvidia-fabricmanager"),
        mount(RUN_TOPOLOGYD, "/run/nvidia-topologyd"),
        mount(MOFED_USR_SRC, "/run/mellanox/drivers/usr/src").host_to_container(),
        mount(RUN_MELLANOX, MOFED_DRIVERS_DIR).host_to_container(),
        mount(
            FIRMWARE_SEARCH_PATH,
            "/sys/module/firmware_class/parameters/path",
        ),
        mount(SYS_DEVICES_SYSTEM, "/sys/devices/system"),
        mount(NV_FIRMWARE, "/lib/firmware"),
        mount(STARTUP_PROBE_VOLUME, STARTUP_PROBE_PATH)
            .sub_path(STARTUP_PROBE_KEY)
            .read_only(),
    ];
    let peermem_mounts = vec![
        mount(RUN_NVIDIA, "/run/nvidia").bidirectional(),
        mount(VAR_LOG, "/var/log"),
        mount(DEV_LOG, "/dev/log").read_only(),
        mount(RUN_MELLANOX, MOFED_DRIVERS_DIR).host_to_container(),
    ];
    HostFiles {
        volumes: standard_volumes(host_mofed),
        driver_mounts,
        peermem_mounts,
        sidecar_mounts: Vec::new(),
    }
}

/// The volumes of [`standard_host_files`]. With `host_mofed` the MOFED sources are the host's
/// `/usr/src`, else those the MOFED driver container publishes.
fn standard_volumes(host_mofed: bool) -> Vec<Volume> {
    vec![
        host_path_volume(RUN_NVIDIA, "/run/nvidia", HostPathType::DirectoryOrCreate),
        host_path_volume(VAR_LOG, "/var/log", HostPathType::Any),
        host_path_volume(DEV_LOG, "/dev/log", HostPathType::Any),
        host_path_volume(HOST_OS_RELEASE, "/etc/os-release", HostPathType::Any),
        host_path_volume(
            RUN_FABRICMANAGER,
            "/run/nvidia-fabricmanager",
            HostPathType::DirectoryOrCreate,
        ),
        host_path_volume(
            RUN_TOPOLOGYD,
            "/run/nvidia-topologyd",
            HostPathType::DirectoryOrCreate,
        ),
        host_path_volume(
            MOFED_USR_SRC,
            if host_mofed {
                "/usr/src"
            } else {
                "/run/mellanox/drivers/usr/src"
            },
            HostPathType::DirectoryOrCreate,
        ),
        host_path_volume(
            RUN_MELLANOX,
            MOFED_DRIVERS_DIR,
            HostPathType::DirectoryOrCreate,
        ),
        host_path_volume(HOST_ROOT_VOLUME, "/", HostPathType::Any),
        host_path_volume(HOST_SYS, "/sys", HostPathType::Directory),
        host_path_volume(
            FIRMWARE_SEARCH_PATH,
            "/sys/module/firmware_class/parameters/path",
            HostPathType::Any,
        ),
        host_path_volume(
            SYS_DEVICES_SYSTEM,
            "/sys/devices/system",
            HostPathType::Directory,
        ),
        host_path_volume(
            NV_FIRMWARE,
            "/run/nvidia/driver/lib/firmware",
            HostPathType::DirectoryOrCreate,
        ),
        common::config_map_volume(
            STARTUP_PROBE_VOLUME,
            STARTUP_PROBE_CONFIG_MAP,
            Some(0o755),
            &[],
        ),
    ]
}

/// vGPU guest licensing: gridd.conf (and the NLS client token) from a Secret or ConfigMap.
fn licensing_files(driver: &DriverSpec) -> HostFiles {
    let Some(licensing) = driver.licensing_config.as_ref() else {
        return HostFiles::default();
    };
    if !driver.vgpu_licensing_enabled() {
        return HostFiles::default();
    }
    let mut items = vec![("gridd.conf", "gridd.conf")];
    let nls = licensing.nls_enabled.unwrap_or(false);
    if nls {
        items.push((
            "client_configuration_token.tok",
            "client_configuration_token.tok",
        ));
    }
    let items: Vec<KeyToPath> = items
        .iter()
        .map(|(k, p)| KeyToPath {
            key: (*k).to_owned(),
            path: (*p).to_owned(),
            mode: None,
        })
        .collect();
    let volume = match non_empty(licensing.secret_name.as_ref()) {
        Some(secret) => Volume {
            name: LICENSING.to_owned(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(secret.to_owned()),
                items: Some(items),
                ..SecretVolumeSource::default()
            }),
            ..Volume::default()
        },
        None => Volume {
            name: LICENSING.to_owned(),
            config_map: Some(ConfigMapVolumeSource {
                name: non_empty(licensing.config_map_name.as_ref())
                    .unwrap_or_default()
                    .to_owned(),
                items: Some(items),
                ..ConfigMapVolumeSource::default()
            }),
            ..Volume::default()
        },
    };
    let mut driver_mounts = vec![
        mount(LICENSING, "/drivers/gridd.conf")
            .sub_path("gridd.conf")
            .read_only(),
    ];
    if nls {
        driver_mounts.push(
            mount(
                LICENSING,
                "/drivers/ClientConfigToken/client_configuration_token.tok",
            )
            .sub_path("client_configuration_token.tok")
            .read_only(),
        );
    }
    HostFiles {
        volumes: vec![volume],
        driver_mounts,
        peermem_mounts: Vec::new(),
        sidecar_mounts: Vec::new(),
    }
}

/// The vGPU topology daemon's config, from `driver.virtualTopology.config`.
fn topology_files(driver: &DriverSpec) -> HostFiles {
    let Some(topology) = non_empty(
        driver
            .virtual_topology
            .as_ref()
            .and_then(|t| t.config.as_ref()),
    ) else {
        return HostFiles::default();
    };
    HostFiles {
        volumes: vec![common::config_map_volume(
            TOPOLOGY,
            topology,
            None,
            &[("nvidia-topologyd.conf", "nvidia-topologyd.conf")],
        )],
        driver_mounts: vec![
            mount(TOPOLOGY, "/etc/nvidia/nvidia-topologyd.conf")
                .sub_path("nvidia-topologyd.conf")
                .read_only(),
        ],
        peermem_mounts: Vec::new(),
        sidecar_mounts: Vec::new(),
    }
}

/// Kernel module parameters, one file per key under /drivers, for the driver and peermem.
fn kernel_module_files(driver: &DriverSpec, facts: &ClusterFacts) -> HostFiles {
    let Some(name) = kernel_module_config_name(driver) else {
        return HostFiles::default();
    };
    let (volume, mounts) = kernel_module_parameters(name, facts);
    HostFiles {
        volumes: vec![volume],
        driver_mounts: mounts.clone(),
        peermem_mounts: mounts,
        sidecar_mounts: Vec::new(),
    }
}

/// The volume of the kernel module parameter ConfigMap `name` and its mounts, one file per key
/// under /drivers, where the driver image's `nvidia-driver` script reads `<module>.conf`. The
/// vGPU manager gets the same (NVIDIA's `transformVGPUManagerContainer`).
pub(super) fn kernel_module_parameters(
    name: &str,
    facts: &ClusterFacts,
) -> (Volume, Vec<VolumeMount>) {
    let keys = config_map_keys(facts, name);
    (
        common::config_map_volume(KERNEL_MODULE_CONFIG, name, None, &[]),
        per_key_mounts(KERNEL_MODULE_CONFIG, "/drivers", &keys),
    )
}

/// Package repository files, where the OS's package manager reads them (none for an OS
/// without a known place).
fn repo_files(driver: &DriverSpec, os: &str, facts: &ClusterFacts) -> HostFiles {
    let (Some(name), Some(dir)) = (repo_config_name(driver), repo_dir(os)) else {
        return HostFiles::default();
    };
    let mounts = per_key_mounts(REPO_CONFIG, dir, &config_map_keys(facts, name));
    HostFiles {
        volumes: vec![common::config_map_volume(REPO_CONFIG, name, None, &[])],
        driver_mounts: mounts.clone(),
        peermem_mounts: Vec::new(),
        // The sidecars build their modules with the OS's packages too.
        sidecar_mounts: mounts,
    }
}

/// Extra CA certificates, where the OS reads them (none for an OS without a known place).
fn cert_files(driver: &DriverSpec, os: &str, facts: &ClusterFacts) -> HostFiles {
    let (Some(name), Some(dir)) = (cert_config_name(driver), cert_dir(os)) else {
        return HostFiles::default();
    };
    let mounts = per_key_mounts(CERT_CONFIG, dir, &config_map_keys(facts, name));
    HostFiles {
        volumes: vec![common::config_map_volume(CERT_CONFIG, name, None, &[])],
        driver_mounts: mounts.clone(),
        peermem_mounts: Vec::new(),
        sidecar_mounts: mounts,
    }
}

/// Entitled package repositories of the host, for builds on RHEL and SLES nodes when no
/// repository config replaces them (OpenShift and CRI-O hosts provide their own).
fn subscription_files(driver: &DriverSpec, os: &str, facts: &ClusterFacts) -> HostFiles {
    let repo_config = repo_config_name(driver);
    let subscriptions: &[(&str, &str, HostPathType)] = match os {
        "rhel" if !facts.openshift && facts.runtime != Runtime::CriO && repo_config.is_none() => &[
            (
                "/etc/pki/entitlement",
                "/run/secrets/etc-pki-entitlement",
                HostPathType::Directory,
            ),
            (
                "/etc/yum.repos.d/redhat.repo",
                "/run/secrets/redhat.repo",
                HostPathType::File,
            ),
            ("/etc/rhsm", "/run/secrets/rhsm", HostPathType::Directory),
        ],
        "sles" | "sl-micro" if repo_config.is_none() => &[
            (
                "/etc/zypp/credentials.d",
                "/etc/zypp/credentials.d",
                HostPathType::Directory,
            ),
            (
                "/etc/SUSEConnect",
                "/etc/SUSEConnect",
                HostPathType::FileOrCreate,
            ),
        ],
        _ => &[],
    };
    let mut subscriptions = subscriptions.to_vec();
    subscriptions.sort_by_key(|(_, mount_path, _)| *mount_path);
    let mut files = HostFiles::default();
    for (i, (host, path, kind)) in subscriptions.into_iter().enumerate() {
        let name = format!("subscription-config-{i}");
        files.volumes.push(host_path_volume(&name, host, kind));
        files.driver_mounts.push(mount(&name, path).read_only());
    }
    files
}

/// What the manager and the driver container are told about GPUDirect RDMA.
fn rdma_env(driver: &DriverSpec) -> Vec<EnvVar> {
    let mut envs = Vec::new();
    if driver.rdma_enabled() {
        envs.push(env("GPU_DIRECT_RDMA_ENABLED", "true"));
        if uses_host_mofed(driver) {
            envs.push(env("USE_HOST_MOFED", "true"));
        }
    }
    envs
}

/// The k8s-driver-manager init container: it makes the node ready for a new driver (evicting
/// GPU pods, unloading the old driver) before the driver container starts.
fn manager_container(policy: &ValidatedPolicy, driver: &DriverSpec) -> Container {
    let mut manager_env = vec![
        env_field("NODE_NAME", "spec.nodeName"),
        // The manager talks to the API server only; it must not get GPUs from the runtime.
        env("NVIDIA_VISIBLE_DEVICES", "void"),
        env("ENABLE_GPU_POD_EVICTION", "true"),
        env("ENABLE_AUTO_DRAIN", "false"),
        env("DRAIN_USE_FORCE", "false"),
        env("DRAIN_POD_SELECTOR_LABEL", ""),
        env("DRAIN_TIMEOUT_SECONDS", "0s"),
        env("DRAIN_DELETE_EMPTYDIR_DATA", "false"),
        env_field("OPERATOR_NAMESPACE", "metadata.namespace"),
    ];
    manager_env.extend(rdma_env(driver));
    merge_user_env(
        &mut manager_env,
        driver.manager.as_ref().and_then(|m| m.env.as_ref()),
    );
    Container {
        env: Some(manager_env),
        security_context: Some(common::privileged()),
        volume_mounts: Some(vec![
            mount(RUN_NVIDIA, "/run/nvidia").bidirectional(),
            mount(HOST_ROOT_VOLUME, "/host")
                .read_only()
                .host_to_container(),
            mount(HOST_SYS, "/sys"),
            mount(RUN_MELLANOX, MOFED_DRIVERS_DIR).host_to_container(),
        ]),
        ..common::container(
            MANAGER_CONTAINER,
            &common::image(policy, ImageKind::DriverManager),
            &["driver-manager"],
            &["uninstall_driver"],
        )
    }
}

/// The driver container's env: the node, the kernel module flavour, the GDRCopy and GDS
/// flags (the startup probe hands them to the validator through `.driver-ctr-ready`), RDMA,
/// then the user's.
/// The driver container's env. `openshift_version` ([`ClusterFacts::openshift_version`]) goes
/// in as `OPENSHIFT_VERSION`, which the driver image's build path uses for the RHOCP package
/// repositories, as NVIDIA's operator sets it; a user's own value wins.
fn driver_env(
    driver: &DriverSpec,
    sidecars: &[Sidecar<'_>],
    openshift_version: Option<&str>,
) -> Vec<EnvVar> {
    let mut driver_env = vec![
        env_field("NODE_NAME", "spec.nodeName"),
        env_field("NODE_IP", "status.hostIP"),
    ];
    if let Some(kind) = driver.kernel_module_type {
        let value = match kind {
            KernelModuleType::Auto => "auto",
            KernelModuleType::Open => "open",
            KernelModuleType::Proprietary => "proprietary",
        };
        driver_env.push(env("KERNEL_MODULE_TYPE", value));
        if kind == KernelModuleType::Open {
            driver_env.push(env("OPEN_KERNEL_MODULES_ENABLED", "true"));
        }
    }
    // NVIDIA's order: GDRCopy, then GDS.
    for flag in ["GDRCOPY_ENABLED", "GDS_ENABLED"] {
        if sidecars.iter().any(|s| s.flag == flag) {
            driver_env.push(env(flag, "true"));
        }
    }
    driver_env.extend(rdma_env(driver));
    driver_env.extend(openshift_version.map(|v| env("OPENSHIFT_VERSION", v)));
    merge_user_env(&mut driver_env, driver.container.env.as_ref());
    driver_env
}

/// The driver's `secretEnv` as an env source (driver container and sidecars).
fn secret_env_from(driver: &DriverSpec) -> Option<Vec<EnvFromSource>> {
    non_empty(driver.secret_env.as_ref()).map(|secret| {
        vec![EnvFromSource {
            secret_ref: Some(SecretEnvSource {
                name: secret.to_owned(),
                optional: None,
            }),
            ..EnvFromSource::default()
        }]
    })
}

/// The driver container, which builds (or installs) and loads the driver and keeps it loaded.
fn driver_container(
    driver: &DriverSpec,
    sidecars: &[Sidecar<'_>],
    image: &str,
    mounts: Vec<VolumeMount>,
    openshift_version: Option<&str>,
) -> Container {
    let ready_files = "rm -f /run/nvidia/validations/.driver-ctr-ready /run/nvidia/validations/.driver-daemons-status";
    Container {
        env: Some(driver_env(driver, sidecars, openshift_version)),
        env_from: secret_env_from(driver),
        security_context: Some(common::privileged_s0()),
        volume_mounts: Some(mounts),
        // Building and loading the modules can take many minutes.
        startup_probe: Some(probe(
            &["sh", STARTUP_PROBE_PATH],
            [60, 10, 60, 120, 1],
            driver.startup_probe.as_ref(),
        )),
        // Only when the policy asks: the driver image has no probe of its own, and a failed
        // liveness probe restarts the container that holds the driver loaded.
        liveness_probe: driver
            .liveness_probe
            .as_ref()
            .map(|custom| probe(HEALTH_PROBE, HEALTH_PROBE_TIMING, Some(custom))),
        readiness_probe: driver
            .readiness_probe
            .as_ref()
            .map(|custom| probe(HEALTH_PROBE, HEALTH_PROBE_TIMING, Some(custom))),
        // The validator must not see a stale ready file while the driver is replaced.
        lifecycle: Some(common::pre_stop_exec(&["sh", "-c", ready_files])),
        ..common::container(MAIN_CONTAINER, image, &["nvidia-driver"], &["init"])
    }
}

/// The nvidia-peermem sidecar, with GPUDirect RDMA only.
fn peermem_container(
    driver: &DriverSpec,
    image: &str,
    mounts: Vec<VolumeMount>,
) -> Option<Container> {
    if !driver.rdma_enabled() {
        return None;
    }
    let mut peermem_env = Vec::new();
    if uses_host_mofed(driver) {
        peermem_env.push(env("USE_HOST_MOFED", "true"));
    }
    let peermem_probe = &["nvidia-driver", "probe_nvidia_peermem"];
    Some(Container {
        env: (!peermem_env.is_empty()).then_some(peermem_env),
        security_context: Some(common::privileged_s0()),
        volume_mounts: Some(mounts),
        startup_probe: Some(probe(peermem_probe, [10, 10, 10, 120, 1], None)),
        liveness_probe: Some(probe(peermem_probe, [30, 30, 10, 1, 1], None)),
        ..common::container(
            PEERMEM_CONTAINER,
            image,
            &["nvidia-driver"],
            &["reload_nvidia_peermem"],
        )
    })
}

/// The `app.kubernetes.io/component` label of driver DaemonSets and pods.
fn component_labels() -> BTreeMap<String, String> {
    common::string_map(&[(COMPONENT_LABEL, COMPONENT)])
}

/// The driver pod: host PID, the manager first, and at most one driver pod per node.
fn pod_spec(manager: Container, containers: Vec<Container>, volumes: Vec<Volume>) -> PodSpec {
    PodSpec {
        service_account_name: Some(SERVICE_ACCOUNT.to_owned()),
        host_pid: Some(true),
        init_containers: Some(vec![manager]),
        containers,
        volumes: Some(volumes),
        // One driver per node, whichever DaemonSet variant it comes from.
        affinity: Some(Affinity {
            pod_anti_affinity: Some(PodAntiAffinity {
                required_during_scheduling_ignored_during_execution: Some(vec![PodAffinityTerm {
                    label_selector: Some(LabelSelector {
                        match_labels: Some(component_labels()),
                        match_expressions: None,
                    }),
                    topology_key: "kubernetes.io/hostname".to_owned(),
                    ..PodAffinityTerm::default()
                }]),
                ..PodAntiAffinity::default()
            }),
            ..Affinity::default()
        }),
        ..PodSpec::default()
    }
}

/// The driver DaemonSet running `pod`: always OnDelete, with the config digest the manager
/// compares with the node's installed driver.
fn daemon_set(
    policy: &ValidatedPolicy,
    facts: &ClusterFacts,
    driver: &DriverSpec,
    pod: PodSpec,
) -> DaemonSet {
    let mut ds = OperandDaemonSet::new(Operand::Driver, NAME, pod, MAIN_CONTAINER);
    ds.labels = component_labels();
    ds.labels
        .insert(PRECOMPILED_LABEL.to_owned(), "false".to_owned());
    ds.annotations = openshift::scc_annotation(facts, SERVICE_ACCOUNT);
    ds.pod_annotations =
        common::string_map(&[("kubectl.kubernetes.io/default-container", MAIN_CONTAINER)]);
    ds.image = Some(&driver.image);
    ds.overrides = Some(&driver.container);
    ds.host_network = driver.host_network.unwrap_or(false);
    ds.always_on_delete = true;
    let mut daemon_set = common::operand_daemon_set(policy, facts, ds);
    add_config_digest(&mut daemon_set);
    daemon_set
}

/// The cluster-wide permissions of the driver's ServiceAccount (those of the manager).
fn cluster_rules(facts: &ClusterFacts) -> Vec<PolicyRule> {
    let mut cluster_rules = Vec::new();
    if facts.openshift {
        cluster_rules.push(rule(
            &["config.openshift.io"],
            &["clusterversions"],
            &["get", "list"],
        ));
    }
    cluster_rules.extend([
        // The manager cordons the node and pauses operands through their deploy labels.
        rule(
            &[""],
            &["nodes"],
            &["get", "list", "patch", "update", "watch"],
        ),
        // ... and evicts the pods that use GPUs before unloading the driver.
        rule(&[""], &["pods"], &["get", "list", "watch"]),
        rule(&[""], &["pods/eviction"], &["create"]),
        rule(&["resource.k8s.io"], &["resourceclaims"], &["get", "list"]),
        rule(&["apps"], &["daemonsets"], &["get"]),
    ]);
    cluster_rules
}

/// The ConfigMap holding the driver container's startup-probe script. Unlike the other operands'
/// scripts it keeps its fixed name: a new name would change the driver's template and its config
/// digest, and so restart every running driver on an operator upgrade although what the driver
/// runs is the same (decision 20). No operand token may write ConfigMaps in the operator
/// namespace (their Roles and admission policies), which is what the immutable copies protect
/// against for the others.
fn startup_probe_config_map(facts: &ClusterFacts) -> ConfigMap {
    let mut probe_config = common::config_map(
        Operand::Driver,
        STARTUP_PROBE_CONFIG_MAP,
        BTreeMap::from([(
            STARTUP_PROBE_KEY.to_owned(),
            STARTUP_PROBE_SCRIPT.to_owned(),
        )]),
        facts,
    );
    common::add_labels(
        &mut probe_config.metadata,
        &[(common::APP_LABEL, NAME), (COMPONENT_LABEL, COMPONENT)],
    );
    probe_config
}

/// The driver's objects around `daemon_set`: its identity (ServiceAccount, RBAC), the
/// startup-probe ConfigMap and, on OpenShift, its SCC.
fn objects(facts: &ClusterFacts, daemon_set: DaemonSet) -> OperandObjects {
    let mut objects = OperandObjects::default();
    common::add_identity(
        &mut objects,
        Operand::Driver,
        SERVICE_ACCOUNT,
        openshift::use_privileged_scc(facts).into_iter().collect(),
        cluster_rules(facts),
        facts,
    );
    // The manager cordons and labels its own node only; its token must not reach the others.
    objects.dynamic.extend(common::confinement_policy(
        Operand::Driver,
        CONFINEMENT_POLICY,
        &[SERVICE_ACCOUNT],
        &[common::own_node_writes()],
        facts,
    ));
    objects.config_maps.push(startup_probe_config_map(facts));
    objects.daemon_sets.push(daemon_set);
    objects.dynamic.extend(openshift::scc(
        Operand::Driver,
        SERVICE_ACCOUNT,
        openshift::HostAccess {
            pid: true,
            ..Default::default()
        },
        facts,
    ));
    objects
}

/// The env var carrying the driver config digest (NVIDIA's name), on the manager and driver
/// containers.
pub const CONFIG_DIGEST_ENV: &str = "DRIVER_CONFIG_DIGEST";

/// The driver config digest of a rendered driver pod: a hash of what decides the installed
/// driver, following NVIDIA's `DriverInstallState`. Every container but the manager counts with
/// its image, command, args, env set to plain values (the digest itself excluded; downward-API
/// values such as the node name are the same everywhere) and the Secrets it takes env from and
/// its mounts; the pod's volumes count by name and source (ConfigMap, Secret, host path). So
/// the driver version, kernel module type, RDMA and its sidecar, proxies, licensing, repo, cert
/// and kernel-module configs move it. The manager (its image included: an operator upgrade
/// that ships a new manager must not reinstall every driver), labels, annotations, tolerations,
/// priority class, resources and probes do not.
pub fn config_digest(pod: &PodSpec) -> String {
    let containers: Vec<serde_json::Value> = pod
        .containers
        .iter()
        .map(|c| {
            let mut env: Vec<(&str, &str)> = c
                .env
                .iter()
                .flatten()
                .filter(|e| e.value_from.is_none() && e.name != CONFIG_DIGEST_ENV)
                .map(|e| (e.name.as_str(), e.value.as_deref().unwrap_or_default()))
                .collect();
            env.sort();
            let mut secrets: Vec<&str> = c
                .env_from
                .iter()
                .flatten()
                .filter_map(|e| Some(e.secret_ref.as_ref()?.name.as_str()))
                .collect();
            secrets.sort();
            let mut mounts: Vec<(&str, &str, &str, bool)> = c
                .volume_mounts
                .iter()
                .flatten()
                .map(|m| {
                    (
                        m.name.as_str(),
                        m.mount_path.as_str(),
                        m.sub_path.as_deref().unwrap_or_default(),
                        m.read_only.unwrap_or(false),
                    )
                })
                .collect();
            mounts.sort();
            serde_json::json!({
                "name": c.name, "image": c.image, "command": c.command, "args": c.args,
                "env": env, "secretEnv": secrets, "mounts": mounts,
            })
        })
        .collect();
    let mut volumes: Vec<(&str, &str, &str, &str)> = pod
        .volumes
        .iter()
        .flatten()
        .map(|v| {
            (
                v.name.as_str(),
                v.config_map.as_ref().map_or("", |c| c.name.as_str()),
                v.secret
                    .as_ref()
                    .and_then(|s| s.secret_name.as_deref())
                    .unwrap_or_default(),
                v.host_path.as_ref().map_or("", |h| h.path.as_str()),
            )
        })
        .collect();
    volumes.sort();
    let input = serde_json::json!({"containers": containers, "volumes": volumes});
    common::sha256_hex(input.to_string().as_bytes())[..16].to_owned()
}

/// The driver config digest a driver pod (or template) carries, if any: the first container
/// with the env var set, init containers first (as NVIDIA reads it).
pub fn carried_config_digest(pod: &PodSpec) -> Option<&str> {
    pod.init_containers
        .iter()
        .flatten()
        .chain(pod.containers.iter())
        .flat_map(|c| c.env.iter().flatten())
        .find(|e| e.name == CONFIG_DIGEST_ENV)
        .and_then(|e| e.value.as_deref())
        .filter(|v| !v.is_empty())
}

/// Sets [`CONFIG_DIGEST_ENV`] on the manager and driver containers (where NVIDIA sets it): the
/// manager skips unloading the driver when the node's installed digest is the same, and the
/// upgrade restarts a pod in place, without cordon or drain, when only its digest-neutral
/// settings changed (docs/driver-upgrades.md).
fn add_config_digest(daemon_set: &mut DaemonSet) {
    let Some(pod) = daemon_set
        .spec
        .as_mut()
        .and_then(|s| s.template.spec.as_mut())
    else {
        return;
    };
    let digest = config_digest(pod);
    for c in pod
        .init_containers
        .iter_mut()
        .flatten()
        .chain(pod.containers.iter_mut())
    {
        // NVIDIA's toolkit container reads it to skip a rebuild of an unchanged driver.
        if c.name == MANAGER_CONTAINER
            || c.name == MAIN_CONTAINER
            || c.name == super::driver_toolkit::CONTAINER
        {
            set_env(
                c.env.get_or_insert_with(Vec::new),
                env(CONFIG_DIGEST_ENV, &digest),
            );
        }
    }
}

/// What validate says about the driver: supported mode, no running fleet switched at once,
/// and [`input_problems`].
pub fn check(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Vec<String> {
    let facts = &container_fleet(spec, facts);
    let mut problems = precompiled_problems(spec, facts);
    problems.extend(input_problems(spec, facts));
    problems
}

/// What validate says about the driver section itself: its probes, its ConfigMaps present and
/// placeable on the GPU nodes' OS. NVIDIADriver pools run these on their own fields.
pub fn input_problems(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Vec<String> {
    let mut problems = Vec::new();
    let Some(driver) = spec.driver.as_ref() else {
        return problems;
    };
    if driver
        .liveness_probe
        .as_ref()
        .and_then(|p| p.success_threshold)
        .is_some_and(|n| n != 1)
    {
        problems.push(
            "spec.driver.livenessProbe.successThreshold: Kubernetes allows only 1 for a liveness \
             probe; set it to 1 or remove it"
                .to_owned(),
        );
    }
    let os = facts.os_tag.as_deref().map(os_id);
    // Precompiled images install no packages: NVIDIA mounts no repository or certificate
    // config then, and neither does host_files.
    let precompiled = uses_precompiled(spec);
    let configs = referenced_config_maps(driver)
        .into_iter()
        .filter(|(field, _)| {
            !(precompiled && (field.contains("repoConfig") || field.contains("certConfig")))
        });
    for (field, name) in configs {
        if !facts.driver_config_maps.contains_key(name) {
            problems.push(format!(
                "{field}: ConfigMap {name} was not found in namespace {}: create it, or clear the \
                 field",
                facts.namespace
            ));
        }
        let dir = if field.contains("certConfig") {
            os.and_then(cert_dir)
        } else if field.contains("repoConfig") {
            os.and_then(repo_dir)
        } else {
            Some("/drivers")
        };
        if dir.is_none() {
            problems.push(format!(
                "{field}: where the files go depends on the GPU nodes' OS, which is {}; known are \
                 ubuntu, debian, rhel, rhcos, centos, rocky, ol, sles and sl-micro",
                facts.os_tag.as_deref().unwrap_or("not known yet")
            ));
        }
    }
    problems
}
