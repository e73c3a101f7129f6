//! Render stage, NVIDIADriver pools (pure, no IO): each NVIDIADriver gets one driver DaemonSet
//! per group of the GPU nodes its `nodeSelector` selects, split as NVIDIA splits them ([`Build`]):
//! per OS (`nvidia-<driverType>-driver-<name>-<os>`), per kernel and OS with `usePrecompiled`
//! (`...-<os>-<kernel>`), or per RHCOS version with OpenShift's Driver Toolkit
//! (`...-<rhcos version>`). Each is rendered by the driver operand's own per-group render
//! ([`super::driver::render_pool_daemon_set`], `render_kernel_daemon_set`,
//! `render_toolkit_daemon_set`) from the active ClusterPolicy with the pool's driver settings
//! in place of `spec.driver`.
//!
//! Also here, because validate and status need them without IO: the pool's image, the overlap
//! rule (two pools may not select the same GPU node; the older keeps it), and what an
//! NVIDIADriver sets that this operator does not act on.
//!
//! The pools' DaemonSets share the ClusterPolicy driver's ServiceAccount, RBAC and
//! startup-probe ConfigMap (that operand keeps rendering them while `useNvidiaDriverCRD` is
//! on), so a pool renders DaemonSets only.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::jiff::Timestamp;

use super::{driver, driver_kernel, driver_os, driver_toolkit};
use crate::api::{
    ClusterPolicySpec, ContainerOverrides, DaemonsetsSpec, DriverLicensingConfigSpec,
    DriverRepoConfigSpec, DriverSpec, DriverUpgradePolicySpec, ImageKind, ImageSpec,
    NvidiaDriverSpec, NvidiaDriverType, POOL_AUTO_UPGRADE_DEFAULT, VirtualTopologyConfigSpec,
};
use crate::facts::ClusterFacts;
use crate::model::{OPERAND_LABEL, Operand, OperandObjects, ValidatedPolicy};
use crate::nodes::{DRIVER_POOL, GPU_PRESENT, NodeView};

/// The driver DaemonSets of one NVIDIADriver pool: rendered from the NVIDIADriver ([`render`]),
/// never from a ClusterPolicy.
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "nvidia-driver",
    component: None,
    deploy_label: Some(crate::nodes::DEPLOY_DRIVER),
    consumes_sharing_config: false,
    enabled: super::Enabled::When(super::defaults::not_from_a_policy),
    images: super::defaults::no_images,
    host_paths: super::defaults::no_host_paths,
    render: super::defaults::renders_nothing,
    check: super::defaults::no_check,
    report: super::defaults::no_report,
};

/// An NVIDIADriver after validate: what render needs.
#[derive(Clone, Debug, Default)]
pub struct ValidatedNvidiaDriver {
    /// Name of the NVIDIADriver.
    pub name: String,
    pub spec: NvidiaDriverSpec,
    /// The driver image without the OS suffix (`nvcr.io/nvidia/driver:580.95.05`), or pinned by
    /// digest (then the same for every OS).
    pub image: String,
    /// The driver-manager image, when the NVIDIADriver names one (else the ClusterPolicy's).
    pub manager_image: Option<String>,
    /// The GPUDirect Storage (nvidia-fs) image without the OS suffix, when `gds` is enabled.
    pub gds_image: Option<String>,
    /// The GDRCopy (gdrdrv) image without the OS suffix, when `gdrcopy` is enabled.
    pub gdrcopy_image: Option<String>,
    /// The GPU nodes the pool selects.
    pub nodes: Vec<Arc<NodeView>>,
    /// How its nodes are split into DaemonSets ([`build`]).
    pub build: Build,
}

/// How a pool's GPU nodes are split into driver DaemonSets, as NVIDIA's NVIDIADriver splits its
/// node pools.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Build {
    /// One DaemonSet per OS, building the driver on the node.
    #[default]
    PerOs,
    /// `usePrecompiled`: one DaemonSet per kernel (and OS), with modules built for that kernel.
    Precompiled,
    /// One DaemonSet per RHCOS version, building in OpenShift's Driver Toolkit image.
    Toolkit,
}

/// How the pool's nodes are split: precompiled when the pool asks for it; else the Driver
/// Toolkit where the ClusterPolicy asks for it on OpenShift ([`driver_toolkit::asked_for`]:
/// only explicitly, unlike NVIDIA's NVIDIADriver, which uses it whenever the ImageStream has
/// tags, so that an upgrade never moves a running OpenShift fleet); else per OS.
pub fn build(policy: &ClusterPolicySpec, spec: &NvidiaDriverSpec, facts: &ClusterFacts) -> Build {
    if spec.use_precompiled == Some(true) {
        Build::Precompiled
    } else if driver_toolkit::asked_for(policy, facts) {
        Build::Toolkit
    } else {
        Build::PerOs
    }
}

/// The pool's node selector: `nodeSelector`, or every GPU node when it is absent or empty
/// (NVIDIA's default).
pub fn selector(spec: &NvidiaDriverSpec) -> BTreeMap<String, String> {
    spec.node_selector
        .clone()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| BTreeMap::from([(GPU_PRESENT.to_owned(), "true".to_owned())]))
}

/// The upgrade policy of a pool: its own `upgradePolicy` (with NVIDIA's NVIDIADriver default,
/// autoUpgrade true, where the API server did not fill it in), else `fallback` (the
/// ClusterPolicy's `driver.upgradePolicy`), else NVIDIA's defaults for an NVIDIADriver (no
/// ClusterPolicy in force: automatic upgrades on, one node at a time).
pub fn upgrade_policy(
    spec: &NvidiaDriverSpec,
    fallback: Option<&DriverUpgradePolicySpec>,
) -> DriverUpgradePolicySpec {
    match (&spec.upgrade_policy, fallback) {
        (Some(own), _) => DriverUpgradePolicySpec {
            auto_upgrade: Some(own.auto_upgrade.unwrap_or(POOL_AUTO_UPGRADE_DEFAULT)),
            ..own.clone()
        },
        (None, Some(policy)) => policy.clone(),
        (None, None) => DriverUpgradePolicySpec {
            auto_upgrade: Some(POOL_AUTO_UPGRADE_DEFAULT),
            ..DriverUpgradePolicySpec::default()
        },
    }
}

/// The default (fallback) NVIDIADrivers beyond the first: the oldest (creation time, then
/// name) is the default, each younger one is rejected with a message naming the kept one.
/// `defaults` are (name, creation time) of the NVIDIADrivers with `spec.default: true`.
pub fn extra_defaults(defaults: &[(String, Option<Timestamp>)]) -> BTreeMap<String, String> {
    let mut ordered: Vec<&(String, Option<Timestamp>)> = defaults.iter().collect();
    ordered.sort_by(|a, b| (a.1, &a.0).cmp(&(b.1, &b.0)));
    let Some((kept, _)) = ordered.first() else {
        return BTreeMap::new();
    };
    ordered
        .iter()
        .skip(1)
        .map(|(name, _)| {
            (
                name.clone(),
                format!(
                    "spec.default: NVIDIADriver {kept} is already the default pool (one default \
                     is allowed); set spec.default=false here or on {kept}; NVIDIADriver {name} \
                     is not applied (its running DaemonSets are kept) meanwhile"
                ),
            )
        })
        .collect()
}

/// [`selector`] as a label selector string for a list request (`k=v,k2=v2`).
pub fn label_selector(spec: &NvidiaDriverSpec) -> String {
    selector(spec)
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// NVIDIA's DaemonSet name for the pool's nodes of one OS (at most 253 characters).
pub fn daemon_set_name(name: &str, driver_type: NvidiaDriverType, os_tag: &str) -> String {
    let full = match driver_type {
        NvidiaDriverType::VgpuHostManager => format!("nvidia-vgpu-manager-{name}-{os_tag}"),
        other => format!("nvidia-{}-driver-{name}-{os_tag}", other.as_str()),
    };
    full.chars().take(253).collect()
}

/// The value of [`DRIVER_POOL`] on the pool's nodes: the NVIDIADriver's name when it is a
/// valid label value, else `true`.
pub fn pool_label_value(name: &str) -> String {
    let valid = name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    if valid {
        name.to_owned()
    } else {
        "true".to_owned()
    }
}

/// The driver image without OS suffix: `repository/image:version` (`image` may hold the whole
/// path, NVIDIA's default `nvcr.io/nvidia/driver`), `@` for a digest. NVIDIA takes no image
/// from the operator's environment for an NVIDIADriver, so the version must be set.
pub fn image(spec: &NvidiaDriverSpec) -> Result<String, String> {
    let non_empty = |s: &Option<String>| s.clone().filter(|s| !s.trim().is_empty());
    let name = non_empty(&spec.image).unwrap_or_else(|| crate::api::DEFAULT_DRIVER_IMAGE.into());
    let path = match non_empty(&spec.repository) {
        Some(repository) => format!("{}/{name}", repository.trim_end_matches('/')),
        None => name,
    };
    let Some(version) = non_empty(&spec.version) else {
        return Err(
            "spec.version: the driver version is not set; set it (for example 580.95.05), NVIDIA \
             takes no default version for an NVIDIADriver"
                .to_owned(),
        );
    };
    if path.contains('@')
        || path
            .rsplit('/')
            .next()
            .is_some_and(|last| last.contains(':'))
    {
        return Err(format!(
            "spec.image: {path} already carries a tag or digest; put it in spec.version instead"
        ));
    }
    Ok(if version.starts_with("sha256:") {
        format!("{path}@{version}")
    } else {
        format!("{path}:{version}")
    })
}

/// The image of an enabled GDS or GDRCopy sidecar (`field` is `spec.gds` or `spec.gdrcopy`)
/// without the OS suffix: as for the driver, NVIDIA takes no image from the operator's
/// environment for an NVIDIADriver, so the image must be named in the NVIDIADriver.
fn sidecar_image(fields: &ImageSpec, kind: ImageKind, field: &str) -> Result<String, String> {
    let set = |s: &Option<String>| s.as_deref().is_some_and(|s| !s.trim().is_empty());
    if !set(&fields.repository) && !set(&fields.image) && !set(&fields.version) {
        return Err(format!(
            "{field}: enabled without an image; set {field}.repository, image and version (for \
             example {}), NVIDIA takes no default image for an NVIDIADriver",
            kind.pinned().unwrap_or_default()
        ));
    }
    crate::api::resolve(Some(fields), kind, &|_| None)
        .map(|r| r.reference)
        .map_err(|e| e.to_string().replacen(kind.field_path(), field, 1))
}

/// The images of the pool's enabled GDS and GDRCopy sidecars (without OS suffix), or the
/// problems with them.
pub fn sidecar_images(
    spec: &NvidiaDriverSpec,
) -> Result<(Option<String>, Option<String>), Vec<String>> {
    let mut problems = Vec::new();
    let mut resolve = |fields: Option<&ImageSpec>, kind, field| {
        let fields = fields?;
        sidecar_image(fields, kind, field)
            .map_err(|e| problems.push(e))
            .ok()
    };
    let gds = resolve(
        spec.gds
            .as_ref()
            .filter(|g| g.is_enabled())
            .map(|g| &g.image),
        ImageKind::Gds,
        "spec.gds",
    );
    let gdrcopy = resolve(
        spec.gdrcopy
            .as_ref()
            .filter(|g| g.is_enabled())
            .map(|g| &g.image),
        ImageKind::GdrCopy,
        "spec.gdrcopy",
    );
    if problems.is_empty() {
        Ok((gds, gdrcopy))
    } else {
        Err(problems)
    }
}

/// Whether GPUDirect Storage at `version` needs the open kernel modules: from 2.17.5 on, and
/// for a digest (whose version is unknown), as NVIDIA's `IsOpenKernelModulesRequired` decides.
fn gds_needs_open_modules(version: &str) -> bool {
    if version.starts_with("sha256") {
        return true;
    }
    let parts: Vec<u64> = version
        .trim_start_matches('v')
        .split(['.', '-', '+'])
        .take(3)
        .map_while(|p| p.parse().ok())
        .collect();
    let mut padded = [0u64; 3];
    for (slot, part) in padded.iter_mut().zip(&parts) {
        *slot = *part;
    }
    !parts.is_empty() && padded >= [2, 17, 5]
}

/// The image for nodes of `os_tag`: `-<os>` appended unless the image is pinned by digest.
pub fn image_for_os(image: &str, os_tag: &str) -> String {
    if image.contains("@sha256:") {
        image.to_owned()
    } else {
        format!("{image}-{os_tag}")
    }
}

/// What validate says about an NVIDIADriver's own input, each problem naming the field and
/// the fix (an invalid pool renders nothing new and claims no node). `facts` are the pool's:
/// what its own DaemonSets run ([`switch_problems`]).
pub fn check(spec: &NvidiaDriverSpec, build: Build, facts: &ClusterFacts) -> Vec<String> {
    let mut problems = Vec::new();
    if spec.driver_type == Some(NvidiaDriverType::VgpuHostManager) {
        problems.push(
            "spec.driverType: vgpu-host-manager (the vGPU host manager) is not deployed by this \
             operator; use gpu or vgpu, or NVIDIA's operator for vGPU hosts"
                .to_owned(),
        );
    }
    let as_policy = crate::api::ClusterPolicySpec {
        driver: Some(driver_spec(spec, &DriverSpec::default())),
        ..Default::default()
    };
    // The driver operand's own checks, with this API's field paths.
    problems.extend(
        driver::input_problems(&as_policy, facts)
            .into_iter()
            .map(|p| p.replace("spec.driver.", "spec.")),
    );
    if build == Build::Precompiled {
        let on = |enabled: Option<bool>| enabled == Some(true);
        problems.extend(driver::precompiled_input_problems(
            "spec",
            spec.version.as_deref(),
            on(spec.gds.as_ref().and_then(|g| g.enabled)),
            on(spec.gdrcopy.as_ref().and_then(|g| g.enabled)),
        ));
    }
    problems.extend(switch_problems(build, facts));
    if let Some(gds) = spec.gds.as_ref().filter(|g| g.is_enabled()) {
        let version = gds.image.version.as_deref().unwrap_or_default();
        let open = spec.kernel_module_type == Some(crate::api::KernelModuleType::Open);
        if gds_needs_open_modules(version) && !open {
            problems.push(format!(
                "spec.kernelModuleType: GPUDirect Storage {version} (spec.gds.version) works only \
                 with the open kernel modules; set spec.kernelModuleType to open, or disable \
                 spec.gds"
            ));
        }
    }
    problems
}

/// What stops `build` from replacing the pool's running DaemonSets of another kind all at once
/// (`facts.live_driver` and `facts.live_driver_toolkit` are the pool's own DaemonSets), as the
/// ClusterPolicy refuses it for its fleet (decision 20).
pub fn switch_problems(build: Build, facts: &ClusterFacts) -> Vec<String> {
    let precompiled = build == Build::Precompiled;
    // usePrecompiled is immutable once set (true to false is refused by the API server), so a
    // switch is undone by setting or removing it, never by flipping it.
    let undo = if precompiled {
        "remove spec.usePrecompiled again (or create another NVIDIADriver for precompiled drivers)"
    } else {
        "set spec.usePrecompiled back to true"
    };
    let mut problems: Vec<String> = driver::precompiled_switch_problem(
        "spec.usePrecompiled",
        undo,
        precompiled,
        &facts.live_driver,
    )
    .into_iter()
    .collect();
    if !precompiled && facts.openshift {
        problems.extend(
            driver_toolkit::switch_problem(build == Build::Toolkit, facts)
                .map(|p| p.replacen("spec.operator.", "the ClusterPolicy's spec.operator.", 1)),
        );
    }
    problems
}

/// What the NVIDIADriver sets that this operator does not act on (status lists each).
pub fn not_acted_on(spec: &NvidiaDriverSpec) -> Vec<String> {
    let mut lines = Vec::new();
    let mut add = |set: bool, path: &str, why: &str| {
        if set {
            lines.push(format!("{path}: {why}"));
        }
    };
    add(
        spec.node_affinity.is_some(),
        "spec.nodeAffinity",
        "pools are chosen by nodeSelector only",
    );
    add(
        spec.use_open_kernel_modules.is_some(),
        "spec.useOpenKernelModules",
        "deprecated: use kernelModuleType",
    );
    add(
        spec.gds
            .as_ref()
            .is_some_and(|g| g.args.as_ref().is_some_and(|a| !a.is_empty())),
        "spec.gds.args",
        "NVIDIA's operator does not pass them to the nvidia-fs sidecar either",
    );
    add(
        spec.gdrcopy
            .as_ref()
            .is_some_and(|g| g.args.as_ref().is_some_and(|a| !a.is_empty())),
        "spec.gdrcopy.args",
        "NVIDIA's operator does not pass them to the gdrcopy sidecar either",
    );
    lines
}

/// One NVIDIADriver's claim on GPU nodes, for [`overlaps`].
#[derive(Clone, Debug)]
pub struct Claim {
    pub name: String,
    pub created: Option<Timestamp>,
    /// The GPU nodes its selector matches.
    pub nodes: Vec<String>,
}

/// The NVIDIADrivers rejected for selecting a GPU node an older one (creation time, then name)
/// already selects, each with a message naming the other object and the shared nodes. A
/// rejected pool claims no node, so a third one is compared with the accepted ones only.
pub fn overlaps(claims: &[Claim]) -> BTreeMap<String, String> {
    let mut ordered: Vec<&Claim> = claims.iter().collect();
    ordered.sort_by(|a, b| (a.created, &a.name).cmp(&(b.created, &b.name)));
    let mut owner: BTreeMap<&str, &str> = BTreeMap::new();
    let mut rejected = BTreeMap::new();
    for claim in ordered {
        let mut shared: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for node in &claim.nodes {
            if let Some(other) = owner.get(node.as_str()) {
                shared.entry(*other).or_default().push(node.as_str());
            }
        }
        if shared.is_empty() {
            for node in &claim.nodes {
                owner.insert(node.as_str(), claim.name.as_str());
            }
            continue;
        }
        let named: Vec<String> = shared
            .iter()
            .map(|(other, nodes)| {
                let more = nodes.len().saturating_sub(10);
                let list: Vec<&str> = nodes.iter().take(10).copied().collect();
                let more = if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                };
                format!(
                    "NVIDIADriver {other} already selects GPU node(s) {}{more}",
                    list.join(", ")
                )
            })
            .collect();
        rejected.insert(
            claim.name.clone(),
            format!(
                "nodeSelector overlaps an older pool: {}; NVIDIADriver {} is not applied (its \
                 running DaemonSets are kept) until the nodeSelectors select disjoint nodes",
                named.join("; "),
                claim.name
            ),
        );
    }
    rejected
}

/// The driver section a pool renders with: the NVIDIADriver's settings, and from the policy
/// what the NVIDIADriver leaves unset (`upgradePolicy`, `hostNetwork`).
fn driver_spec(spec: &NvidiaDriverSpec, policy: &DriverSpec) -> DriverSpec {
    DriverSpec {
        enabled: Some(true),
        // The switch that hands nodes to pools is the policy's; a pool's own DaemonSets are
        // precompiled exactly when the pool says so (driver::uses_precompiled).
        use_nvidia_driver_crd: None,
        use_precompiled: spec.use_precompiled,
        use_open_kernel_modules: None,
        kernel_module_type: spec.kernel_module_type,
        startup_probe: spec.startup_probe.clone(),
        liveness_probe: spec.liveness_probe.clone(),
        readiness_probe: spec.readiness_probe.clone(),
        rdma: spec.rdma.clone(),
        upgrade_policy: Some(upgrade_policy(spec, policy.upgrade_policy.as_ref())),
        image: ImageSpec {
            repository: None,
            image: None,
            version: None,
            image_pull_policy: spec.image_pull_policy.clone(),
            image_pull_secrets: spec.image_pull_secrets.clone(),
        },
        manager: spec.manager.clone(),
        container: ContainerOverrides {
            resources: spec.resources.clone(),
            args: spec.args.clone(),
            env: spec.env.clone(),
        },
        repo_config: spec.repo_config.as_ref().map(|r| DriverRepoConfigSpec {
            config_map_name: r.name.clone(),
        }),
        cert_config: spec.cert_config.clone(),
        licensing_config: spec
            .licensing_config
            .as_ref()
            .map(|l| DriverLicensingConfigSpec {
                config_map_name: l.name.clone(),
                secret_name: l.secret_name.clone(),
                nls_enabled: l.nls_enabled,
            }),
        virtual_topology: spec.virtual_topology_config.as_ref().map(|v| {
            VirtualTopologyConfigSpec {
                config: v.name.clone(),
            }
        }),
        kernel_module_config: spec.kernel_module_config.clone(),
        secret_env: spec.secret_env.clone(),
        host_network: spec.host_network.or(policy.host_network),
    }
}

/// The policy a pool renders with: its driver section and DaemonSet settings in place of the
/// ClusterPolicy's (tolerations, priority class, pod security context, labels and annotations
/// where the NVIDIADriver sets them).
fn pool_policy(policy: &ValidatedPolicy, pool: &ValidatedNvidiaDriver) -> ValidatedPolicy {
    let mut out = policy.clone();
    let own = policy.spec.driver.clone().unwrap_or_default();
    out.spec.driver = Some(driver_spec(&pool.spec, &own));
    // A pool's sidecars are its own, never the ClusterPolicy's (NVIDIA's state-driver reads
    // only the NVIDIADriver).
    out.spec.gds = pool.spec.gds.clone().filter(|_| pool.gds_image.is_some());
    out.spec.gdrcopy = pool
        .spec
        .gdrcopy
        .clone()
        .filter(|_| pool.gdrcopy_image.is_some());
    let d = &pool.spec;
    let daemonsets = out
        .spec
        .daemonsets
        .get_or_insert_with(DaemonsetsSpec::default);
    if let Some(tolerations) = d.tolerations.clone() {
        daemonsets.tolerations = Some(tolerations);
    }
    if let Some(class) = d.priority_class_name.clone().filter(|c| !c.is_empty()) {
        daemonsets.priority_class_name = Some(class);
    }
    if let Some(context) = d.pod_security_context.clone() {
        daemonsets.pod_security_context = Some(context);
    }
    for (theirs, ours) in [
        (&d.labels, &mut daemonsets.labels),
        (&d.annotations, &mut daemonsets.annotations),
    ] {
        if let Some(extra) = theirs {
            ours.get_or_insert_with(BTreeMap::new)
                .extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
    }
    if let Some(manager) = &pool.manager_image {
        out.images.insert(ImageKind::DriverManager, manager.clone());
    }
    out
}

/// The pool's driver DaemonSets, one per group of its GPU nodes ([`Build`]), each selecting the
/// pool's `nodeSelector`, the driver deploy label and its group's labels. `facts` carry the
/// NVIDIADriver as owner and the ConfigMaps its settings name.
pub fn render(
    policy: &ValidatedPolicy,
    pool: &ValidatedNvidiaDriver,
    facts: &ClusterFacts,
) -> OperandObjects {
    let pool_policy = pool_policy(policy, pool);
    let mut selector = selector(&pool.spec);
    if pool.spec.is_default() {
        // The fallback pool runs only where the pool label hands a node to it: every GPU node
        // matches its selector, including the other pools' nodes.
        selector.insert(DRIVER_POOL.to_owned(), pool_label_value(&pool.name));
    }
    let mut objects = OperandObjects::default();
    let daemon_sets = match pool.build {
        Build::PerOs => per_os_daemon_sets(&pool_policy, pool, facts),
        Build::Precompiled => kernel_daemon_sets(&pool_policy, pool, facts),
        Build::Toolkit => toolkit_daemon_sets(&pool_policy, pool, facts),
    };
    for mut ds in daemon_sets {
        ds.metadata.labels.get_or_insert_with(BTreeMap::new).insert(
            OPERAND_LABEL.to_owned(),
            Operand::NvidiaDriver.name().to_owned(),
        );
        if let Some(pod) = ds.spec.as_mut().and_then(|s| s.template.spec.as_mut()) {
            let node_selector = pod.node_selector.get_or_insert_with(BTreeMap::new);
            node_selector.extend(selector.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        objects.daemon_sets.push(ds);
    }
    objects
}

/// The pool's images for the nodes of `os_tag`, each with that OS's suffix.
fn images_for_os(pool: &ValidatedNvidiaDriver, os_tag: &str) -> driver::DriverImages {
    driver::DriverImages {
        driver: image_for_os(&pool.image, os_tag),
        gds: pool.gds_image.as_ref().map(|i| image_for_os(i, os_tag)),
        gdrcopy: pool.gdrcopy_image.as_ref().map(|i| image_for_os(i, os_tag)),
    }
}

/// One DaemonSet per OS of the pool's (known-OS) GPU nodes.
fn per_os_daemon_sets(
    policy: &ValidatedPolicy,
    pool: &ValidatedNvidiaDriver,
    facts: &ClusterFacts,
) -> Vec<DaemonSet> {
    let driver_type = pool.spec.driver_type.unwrap_or_default();
    driver_os::pools(&pool.nodes)
        .0
        .iter()
        .filter_map(|os| {
            let name = daemon_set_name(&pool.name, driver_type, &os.tag);
            let images = images_for_os(pool, &os.tag);
            driver::render_pool_daemon_set(policy, facts, os, images, &name)
        })
        .collect()
}

/// NVIDIA's label on an NVIDIADriver's precompiled DaemonSets and their pods: the sanitized
/// kernel.
pub const PRECOMPILED_KERNEL_LABEL: &str = "nvidia.com/precompiled.kernel-version";

/// One precompiled DaemonSet per kernel (and OS) of the pool's GPU nodes, with the image tag
/// `<version>-<kernel>-<os>` (validate refused a digest and the GDS and GDRCopy sidecars).
fn kernel_daemon_sets(
    policy: &ValidatedPolicy,
    pool: &ValidatedNvidiaDriver,
    facts: &ClusterFacts,
) -> Vec<DaemonSet> {
    let driver_type = pool.spec.driver_type.unwrap_or_default();
    driver_kernel::pools(&pool.nodes)
        .0
        .iter()
        .filter_map(|kernel| {
            let name = daemon_set_name(&pool.name, driver_type, &kernel_group(kernel));
            let images = driver::DriverImages {
                driver: format!("{}-{}", pool.image, kernel.tag_suffix()),
                gds: None,
                gdrcopy: None,
            };
            let mut ds = driver::render_kernel_daemon_set(policy, facts, kernel, images, &name)?;
            let sanitized = driver_kernel::sanitized_kernel(&kernel.kernel);
            for labels in pod_and_daemon_set_labels(&mut ds) {
                labels.insert(PRECOMPILED_KERNEL_LABEL.to_owned(), sanitized.clone());
            }
            set_app(&mut ds, &unique_app_label(&name));
            Some(ds)
        })
        .collect()
}

/// NVIDIA's name for a precompiled node pool, which its DaemonSet's name ends with:
/// `<os>-<sanitized kernel>`.
fn kernel_group(pool: &driver_kernel::KernelPool) -> String {
    format!(
        "{}-{}",
        pool.os_tag,
        driver_kernel::sanitized_kernel(&pool.kernel)
    )
}

/// One Driver Toolkit DaemonSet per RHCOS version of the pool's GPU nodes that has a toolkit
/// image (the others are reported by [`unplaced`]).
fn toolkit_daemon_sets(
    policy: &ValidatedPolicy,
    pool: &ValidatedNvidiaDriver,
    facts: &ClusterFacts,
) -> Vec<DaemonSet> {
    let driver_type = pool.spec.driver_type.unwrap_or_default();
    let facts = with_pool_nodes(pool, facts);
    driver_toolkit::pools(&facts)
        .0
        .iter()
        .filter_map(|rhcos| {
            let tag = rhcos.os_tag.clone().or_else(|| facts.os_tag.clone())?;
            let name = daemon_set_name(&pool.name, driver_type, &rhcos.rhcos);
            let images = images_for_os(pool, &tag);
            let mut ds =
                driver::render_toolkit_daemon_set(policy, &facts, rhcos, &tag, images, &name)?;
            set_app(&mut ds, &unique_app_label(&name));
            Some(ds)
        })
        .collect()
}

/// The facts with the pool's GPU nodes as the GPU nodes.
fn with_pool_nodes(pool: &ValidatedNvidiaDriver, facts: &ClusterFacts) -> ClusterFacts {
    ClusterFacts {
        gpu_nodes: pool.nodes.clone(),
        ..facts.clone()
    }
}

/// The DaemonSet's labels and its pods'.
fn pod_and_daemon_set_labels(ds: &mut DaemonSet) -> Vec<&mut BTreeMap<String, String>> {
    let mut out = vec![ds.metadata.labels.get_or_insert_default()];
    if let Some(spec) = ds.spec.as_mut() {
        out.push(
            spec.template
                .metadata
                .get_or_insert_default()
                .labels
                .get_or_insert_default(),
        );
    }
    out
}

/// The `app` label (and selector) of a per-kernel or per-RHCOS pool DaemonSet named `name`: the
/// name, or, when it is longer than a label value may be, its start and a hash of the whole
/// name. Cutting alone could give two kernels of one pool the same selector; NVIDIA hashes its
/// pools' app names for the same reason.
pub fn unique_app_label(name: &str) -> String {
    if name.len() <= 63 {
        return name.to_owned();
    }
    let hash = super::common::sha256_hex(name.as_bytes());
    let start: String = name.chars().take(52).collect();
    let start = driver::app_label(&start);
    format!("{start}-{}", &hash[..10])
}

/// Sets the DaemonSet's `app` label, selector and pod label to `app`.
fn set_app(ds: &mut DaemonSet, app: &str) {
    if let Some(spec) = ds.spec.as_mut() {
        spec.selector
            .match_labels
            .get_or_insert_default()
            .insert(super::common::APP_LABEL.to_owned(), app.to_owned());
    }
    for labels in pod_and_daemon_set_labels(ds) {
        labels.insert(super::common::APP_LABEL.to_owned(), app.to_owned());
    }
}

/// The policy NVIDIADriver pools render with when no ClusterPolicy exists and a GPUCluster is
/// in force (NVIDIA's GPUCluster workflow): the driver on and handed to the NVIDIADrivers,
/// every other setting at its default, so each pool's own fields decide (docs/nvidiadriver.md).
pub fn standalone_policy(facts: &ClusterFacts) -> ValidatedPolicy {
    let spec = crate::api::ClusterPolicySpec {
        driver: Some(DriverSpec {
            enabled: Some(true),
            use_nvidia_driver_crd: Some(true),
            ..DriverSpec::default()
        }),
        ..Default::default()
    };
    crate::validate::validate(&crate::api::ClusterPolicy::new(STANDALONE, spec), facts)
}

/// Name of the policy [`standalone_policy`] validates (it is never stored).
pub const STANDALONE: &str = "gpu-cluster-nvidia-drivers";

/// What every pool's DaemonSets use and no pool renders (the driver's ServiceAccount, RBAC and
/// startup-probe ConfigMap): the driver operand's own objects without its DaemonSets, for a
/// GPUCluster install where no ClusterPolicy renders them.
pub fn shared_objects(policy: &ValidatedPolicy, facts: &ClusterFacts) -> OperandObjects {
    let mut objects = driver::render(policy, facts).unwrap_or_default();
    objects.daemon_sets.clear();
    objects
}

/// The pool's GPU nodes that get no driver pod, as a status line: for its [`Build`], nodes
/// whose OS has no known driver image, without the kernel label (or on a kernel another OS's
/// nodes run), or of an RHCOS version the Driver Toolkit has no image for.
pub fn unplaced(pool: &ValidatedNvidiaDriver, facts: &ClusterFacts) -> Option<String> {
    match pool.build {
        Build::PerOs => unknown_os(pool),
        Build::Precompiled => driver_kernel::report(&with_pool_nodes(pool, facts)),
        Build::Toolkit => driver_toolkit::report(&with_pool_nodes(pool, facts)),
    }
}

/// The pool's GPU nodes whose OS has no known driver image, as a status line.
fn unknown_os(pool: &ValidatedNvidiaDriver) -> Option<String> {
    let (_, unknown) = driver_os::pools(&pool.nodes);
    (!unknown.is_empty()).then(|| {
        let named: Vec<String> = unknown
            .iter()
            .take(10)
            .map(|(node, why)| format!("{node} ({why})"))
            .collect();
        format!(
            "GPU nodes whose OS has no known driver image get no driver pod: {} (known: {})",
            named.join(", "),
            driver_os::KNOWN_OS.join(", ")
        )
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::render::tests::{facts, policy};

    fn node(name: &str, os: (&str, &str), pool: &str) -> NodeView {
        let labels: BTreeMap<String, String> = [
            (GPU_PRESENT, "true"),
            ("feature.node.kubernetes.io/pci-10de.present", "true"),
            (crate::nodes::OS_ID, os.0),
            (crate::nodes::OS_VERSION_ID, os.1),
            ("pool", pool),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let mut n = NodeView::from_labels(name, None, &labels);
        // The controller adds the selector's labels to the pool's nodes.
        n.labels.insert("pool".to_owned(), pool.to_owned());
        n
    }

    fn pool(name: &str, spec: serde_json::Value, nodes: Vec<NodeView>) -> ValidatedNvidiaDriver {
        let spec: NvidiaDriverSpec = serde_json::from_value(spec).unwrap();
        let (gds_image, gdrcopy_image) = sidecar_images(&spec).unwrap();
        ValidatedNvidiaDriver {
            build: build(&ClusterPolicySpec::default(), &spec, &facts()),
            name: name.to_owned(),
            image: image(&spec).unwrap(),
            spec,
            manager_image: None,
            gds_image,
            gdrcopy_image,
            nodes: nodes.into_iter().map(Arc::new).collect(),
        }
    }

    fn containers(ds: &k8s_openapi::api::apps::v1::DaemonSet) -> Vec<(String, String)> {
        let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        pod.containers
            .iter()
            .map(|c| (c.name.clone(), c.image.clone().unwrap_or_default()))
            .collect()
    }

    #[test]
    fn a_pool_runs_its_own_gds_and_gdrcopy_sidecars_with_each_os_suffix_never_the_policys() {
        let p = pool(
            "pool-a",
            serde_json::json!({"version": "580.95.05", "nodeSelector": {"pool": "a"},
                "kernelModuleType": "open",
                "gds": {"enabled": true, "repository": "nvcr.io/nvidia/cloud-native",
                    "image": "nvidia-fs", "version": "2.26.6"},
                "gdrcopy": {"enabled": true, "repository": "nvcr.io/nvidia/cloud-native",
                    "image": "gdrdrv", "version": "v2.5.1", "env": [{"name": "A", "value": "b"}]}}),
            vec![
                node("a1", ("ubuntu", "22.04"), "a"),
                node("a2", ("ubuntu", "24.04"), "a"),
            ],
        );
        let objects = render(&policy("{}"), &p, &facts());
        for (ds, os) in objects
            .daemon_sets
            .iter()
            .zip(["ubuntu22.04", "ubuntu24.04"])
        {
            assert_eq!(
                containers(ds),
                [
                    (
                        "nvidia-driver-ctr".to_owned(),
                        format!("nvcr.io/nvidia/driver:580.95.05-{os}")
                    ),
                    (
                        "nvidia-fs-ctr".to_owned(),
                        format!("nvcr.io/nvidia/cloud-native/nvidia-fs:2.26.6-{os}")
                    ),
                    (
                        "nvidia-gdrcopy-ctr".to_owned(),
                        format!("nvcr.io/nvidia/cloud-native/gdrdrv:v2.5.1-{os}")
                    ),
                ]
            );
        }
        // The ClusterPolicy's own switches do not reach a pool that leaves them off.
        let plain = pool(
            "pool-b",
            serde_json::json!({"version": "580.95.05", "nodeSelector": {"pool": "b"}}),
            vec![node("b1", ("ubuntu", "22.04"), "b")],
        );
        let objects = render(
            &policy("{gds: {enabled: true}, gdrcopy: {enabled: true}}"),
            &plain,
            &facts(),
        );
        let names: Vec<String> = containers(&objects.daemon_sets[0])
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(names, ["nvidia-driver-ctr"]);
    }

    #[test]
    fn a_pools_sidecar_needs_its_image_and_recent_gds_needs_open_modules() {
        let spec =
            |v: serde_json::Value| -> NvidiaDriverSpec { serde_json::from_value(v).unwrap() };
        let problems =
            sidecar_images(&spec(serde_json::json!({"gds": {"enabled": true}}))).unwrap_err();
        assert!(
            problems[0].starts_with("spec.gds: enabled without an image; set spec.gds.repository"),
            "{problems:?}"
        );
        let problems = sidecar_images(&spec(serde_json::json!({"gdrcopy": {"enabled": true,
            "repository": "r.local", "image": "gdrdrv"}})))
        .unwrap_err();
        assert!(
            problems[0].starts_with("spec.gdrcopy: repository, image and version"),
            "{problems:?}"
        );
        // Off: no image needed.
        assert_eq!(
            sidecar_images(&spec(serde_json::json!({"gds": {"enabled": false}}))).unwrap(),
            (None, None)
        );
        let gds = |version: &str, kind: &str| {
            check(
                &spec(serde_json::json!({"version": "1", "kernelModuleType": kind,
                    "gds": {"enabled": true, "repository": "r", "image": "nvidia-fs",
                        "version": version}})),
                Build::PerOs,
                &facts(),
            )
        };
        let needs_open = gds("2.17.5", "auto");
        assert!(
            needs_open[0].starts_with("spec.kernelModuleType: GPUDirect Storage 2.17.5"),
            "{needs_open:?}"
        );
        assert_eq!(gds("v2.26.6", "proprietary").len(), 1);
        assert_eq!(gds("sha256:abc", "auto").len(), 1);
        assert!(gds("2.26.6", "open").is_empty());
        assert!(gds("2.16.1", "auto").is_empty());
    }

    #[test]
    fn each_pool_gets_one_daemonset_per_os_named_as_nvidia_names_them_with_its_version() {
        let p = pool(
            "pool-a",
            serde_json::json!({"version": "580.95.05", "nodeSelector": {"pool": "a"}}),
            vec![
                node("a1", ("ubuntu", "22.04"), "a"),
                node("a2", ("ubuntu", "24.04"), "a"),
            ],
        );
        let facts = facts();
        let objects = render(&policy("{}"), &p, &facts);
        let names: Vec<String> = objects
            .daemon_sets
            .iter()
            .map(|d| d.metadata.name.clone().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "nvidia-gpu-driver-pool-a-ubuntu22.04",
                "nvidia-gpu-driver-pool-a-ubuntu24.04"
            ]
        );
        let ds = &objects.daemon_sets[1];
        let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        let main = pod
            .containers
            .iter()
            .find(|c| c.name == driver::MAIN_CONTAINER)
            .unwrap();
        assert_eq!(
            main.image.as_deref(),
            Some("nvcr.io/nvidia/driver:580.95.05-ubuntu24.04")
        );
        let selector = pod.node_selector.clone().unwrap();
        assert_eq!(selector["pool"], "a");
        assert_eq!(selector[crate::nodes::DEPLOY_DRIVER], "true");
        assert_eq!(selector[crate::nodes::OS_VERSION_ID], "24.04");
        // Pruned per NVIDIADriver, found by the upgrade controller by its component label.
        let labels = ds.metadata.labels.clone().unwrap();
        assert_eq!(labels[OPERAND_LABEL], "nvidia-driver");
        assert_eq!(labels["app.kubernetes.io/component"], "nvidia-driver");
        assert_eq!(
            ds.spec
                .as_ref()
                .unwrap()
                .selector
                .match_labels
                .as_ref()
                .unwrap()["app"],
            "nvidia-gpu-driver-pool-a-ubuntu24.04"
        );
    }

    #[test]
    fn the_younger_of_two_overlapping_pools_is_rejected_naming_both_and_the_nodes() {
        let t = |s: i64| Some(Timestamp::from_second(s).unwrap());
        let claims = [
            Claim {
                name: "b".into(),
                created: t(20),
                nodes: vec!["n2".into(), "n3".into()],
            },
            Claim {
                name: "a".into(),
                created: t(10),
                nodes: vec!["n1".into(), "n2".into()],
            },
            Claim {
                name: "c".into(),
                created: t(30),
                nodes: vec!["n3".into()],
            },
        ];
        let rejected = overlaps(&claims);
        assert_eq!(rejected.keys().collect::<Vec<_>>(), ["b"]);
        assert!(rejected["b"].contains("NVIDIADriver a already selects GPU node(s) n2"));
        assert!(rejected["b"].contains("NVIDIADriver b is not applied"));
        // Same creation time: the name breaks the tie.
        let tie = [
            Claim {
                name: "y".into(),
                created: t(5),
                nodes: vec!["n".into()],
            },
            Claim {
                name: "x".into(),
                created: t(5),
                nodes: vec!["n".into()],
            },
        ];
        assert_eq!(overlaps(&tie).keys().collect::<Vec<_>>(), ["y"]);
    }

    #[test]
    fn image_needs_a_version_and_joins_repository_image_and_digest() {
        let spec =
            |v: serde_json::Value| -> NvidiaDriverSpec { serde_json::from_value(v).unwrap() };
        assert!(
            image(&spec(serde_json::json!({})))
                .unwrap_err()
                .contains("spec.version")
        );
        assert_eq!(
            image(&spec(
                serde_json::json!({"repository": "r.io/x/", "image": "driver", "version": "1"})
            ))
            .unwrap(),
            "r.io/x/driver:1"
        );
        let digest = image(&spec(serde_json::json!({"version": "sha256:abc"}))).unwrap();
        assert_eq!(digest, "nvcr.io/nvidia/driver@sha256:abc");
        assert_eq!(image_for_os(&digest, "ubuntu22.04"), digest);
        assert_eq!(
            daemon_set_name("p", NvidiaDriverType::VgpuHostManager, "rhel9"),
            "nvidia-vgpu-manager-p-rhel9"
        );
        assert_eq!(pool_label_value("pool-a"), "pool-a");
        assert_eq!(pool_label_value(&"x".repeat(64)), "true");
    }

    #[test]
    fn unsupported_settings_are_reported_and_host_manager_is_rejected() {
        let spec: NvidiaDriverSpec = serde_json::from_value(serde_json::json!({
            "driverType": "vgpu-host-manager", "version": "1",
            "nodeAffinity": {}, "gds": {"enabled": true}, "gdrcopy": {"enabled": true, "args": ["x"]}
        }))
        .unwrap();
        let lines = not_acted_on(&spec);
        assert!(lines.iter().any(|l| l.starts_with("spec.nodeAffinity")));
        // GDS and GDRCopy are deployed; only their args are not (NVIDIA ignores them too).
        assert!(
            !lines.iter().any(|l| l.starts_with("spec.gds")),
            "{lines:?}"
        );
        assert!(
            lines.iter().any(|l| l.starts_with("spec.gdrcopy.args")),
            "{lines:?}"
        );
        assert_eq!(lines.len(), 2, "{lines:?}");
        let problems = check(&spec, Build::PerOs, &facts());
        assert!(problems[0].starts_with("spec.driverType"));
    }

    #[test]
    fn a_pool_upgrades_with_its_own_policy_else_the_cluster_policys_else_nvidias_defaults() {
        let spec =
            |v: serde_json::Value| -> NvidiaDriverSpec { serde_json::from_value(v).unwrap() };
        let cluster: DriverUpgradePolicySpec =
            serde_json::from_value(serde_json::json!({"maxParallelUpgrades": 4})).unwrap();
        let own = upgrade_policy(
            &spec(serde_json::json!({"upgradePolicy": {"maxParallelUpgrades": 1}})),
            Some(&cluster),
        );
        assert_eq!(own.max_parallel_upgrades, Some(1));
        // NVIDIA's NVIDIADriver default, not the ClusterPolicy's false.
        assert_eq!(own.auto_upgrade, Some(true));
        let inherited = upgrade_policy(&spec(serde_json::json!({})), Some(&cluster));
        assert_eq!(inherited, cluster);
        let alone = upgrade_policy(&spec(serde_json::json!({})), None);
        assert_eq!(alone.auto_upgrade, Some(true));
        assert_eq!(alone.max_parallel_upgrades, None, "machine default: 1");
    }

    #[test]
    fn host_network_is_the_pools_else_the_cluster_policys() {
        let nodes = || vec![node("a1", ("ubuntu", "22.04"), "a")];
        let host_network = |spec: serde_json::Value, policy_yaml: &str| {
            let objects = render(&policy(policy_yaml), &pool("p", spec, nodes()), &facts());
            crate::operands::test_support::pod(&objects.daemon_sets[0]).host_network
        };
        let on =
            serde_json::json!({"version": "1", "nodeSelector": {"pool": "a"}, "hostNetwork": true});
        assert_eq!(host_network(on, "{}"), Some(true));
        let unset = serde_json::json!({"version": "1", "nodeSelector": {"pool": "a"}});
        assert_eq!(
            host_network(unset.clone(), "driver: {hostNetwork: true}"),
            Some(true)
        );
        assert_ne!(host_network(unset, "{}"), Some(true));
        let off = serde_json::json!({"version": "1", "nodeSelector": {"pool": "a"}, "hostNetwork": false});
        assert_ne!(host_network(off, "driver: {hostNetwork: true}"), Some(true));
    }

    #[test]
    fn the_default_pool_runs_only_on_nodes_handed_to_it_and_one_default_is_kept() {
        let p = pool(
            "fallback",
            serde_json::json!({"version": "1", "default": true}),
            vec![node("f1", ("ubuntu", "22.04"), "none")],
        );
        let objects = render(&policy("{}"), &p, &facts());
        let pod = &crate::operands::test_support::pod(&objects.daemon_sets[0]);
        let selector = pod.node_selector.clone().unwrap();
        assert_eq!(selector[DRIVER_POOL], "fallback");
        assert_eq!(selector[GPU_PRESENT], "true");

        let t = |s: i64| Some(Timestamp::from_second(s).unwrap());
        let extra = extra_defaults(&[("b".into(), t(20)), ("a".into(), t(10))]);
        assert_eq!(extra.keys().collect::<Vec<_>>(), ["b"]);
        assert!(extra["b"].starts_with("spec.default: NVIDIADriver a is already the default"));
        assert!(extra_defaults(&[("a".into(), t(1))]).is_empty());
    }

    #[test]
    fn a_gpu_cluster_install_renders_pools_and_the_shared_driver_objects_without_a_policy() {
        let facts = facts();
        let standalone = standalone_policy(&facts);
        assert!(driver::uses_nvidia_driver_crd(&standalone.spec));
        let p = pool(
            "pool-a",
            serde_json::json!({"version": "580.95.05", "nodeSelector": {"pool": "a"}}),
            vec![node("a1", ("ubuntu", "22.04"), "a")],
        );
        let objects = render(&standalone, &p, &facts);
        assert_eq!(
            objects.daemon_sets[0].metadata.name.as_deref(),
            Some("nvidia-gpu-driver-pool-a-ubuntu22.04")
        );
        let shared = shared_objects(&standalone, &facts);
        assert!(shared.daemon_sets.is_empty());
        let pod = &crate::operands::test_support::pod(&objects.daemon_sets[0]);
        // The pool's pods run as the ServiceAccount the shared objects carry.
        let account = pod.service_account_name.clone().unwrap();
        assert!(
            shared
                .service_accounts
                .iter()
                .any(|a| a.metadata.name.as_deref() == Some(account.as_str())),
            "{account}"
        );
        let volumes: Vec<String> = pod
            .volumes
            .iter()
            .flatten()
            .filter_map(|v| Some(v.config_map.as_ref()?.name.clone()))
            .collect();
        for name in volumes {
            assert!(
                shared
                    .config_maps
                    .iter()
                    .any(|c| c.metadata.name.as_deref() == Some(name.as_str())),
                "the pool mounts ConfigMap {name}, which nothing renders"
            );
        }
    }

    /// `node` with `label` set to `value`.
    fn with(mut node: NodeView, label: &str, value: &str) -> NodeView {
        node.labels.insert(label.to_owned(), value.to_owned());
        node
    }

    fn names(objects: &OperandObjects) -> Vec<String> {
        objects
            .daemon_sets
            .iter()
            .map(|d| d.metadata.name.clone().unwrap())
            .collect()
    }

    fn labels(ds: &DaemonSet) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
        let spec = ds.spec.as_ref().unwrap();
        (
            ds.metadata.labels.clone().unwrap(),
            spec.template.metadata.clone().unwrap().labels.unwrap(),
        )
    }

    const K1: &str = "5.15.0-1048-aws";
    const K2: &str = "5.15.0-1050-aws";

    fn precompiled_pool(name: &str) -> ValidatedNvidiaDriver {
        let kernel = crate::nodes::KERNEL_VERSION;
        pool(
            name,
            serde_json::json!({"usePrecompiled": true, "repository": "nvcr.io/nvidia",
                "image": "driver", "version": "580", "nodeSelector": {"pool": "a"}}),
            vec![
                with(node("a1", ("ubuntu", "22.04"), "a"), kernel, K1),
                with(node("a2", ("ubuntu", "22.04"), "a"), kernel, K2),
                with(node("a3", ("ubuntu", "22.04"), "a"), kernel, K1),
                node("a4", ("ubuntu", "22.04"), "a"),
            ],
        )
    }

    #[test]
    fn a_precompiled_pool_gets_one_daemonset_per_kernel_with_nvidias_labels_and_tags() {
        let p = precompiled_pool("pool-a");
        assert_eq!(p.build, Build::Precompiled);
        let objects = render(&policy("{}"), &p, &facts());
        assert_eq!(
            names(&objects),
            [
                "nvidia-gpu-driver-pool-a-ubuntu22.04-5.15.0-1048-aws",
                "nvidia-gpu-driver-pool-a-ubuntu22.04-5.15.0-1050-aws"
            ]
        );
        for (ds, kernel) in objects.daemon_sets.iter().zip([K1, K2]) {
            let name = ds.metadata.name.clone().unwrap();
            assert_eq!(
                containers(ds)[0],
                (
                    "nvidia-driver-ctr".to_owned(),
                    format!("nvcr.io/nvidia/driver:580-{kernel}-ubuntu22.04")
                )
            );
            let pod = crate::operands::test_support::pod(ds);
            let selector = pod.node_selector.clone().unwrap();
            assert_eq!(selector[crate::nodes::KERNEL_VERSION], kernel);
            assert_eq!(selector[crate::nodes::OS_VERSION_ID], "22.04");
            assert_eq!(selector["pool"], "a");
            let (own, pods) = labels(ds);
            for l in [&own, &pods] {
                assert_eq!(l[driver::PRECOMPILED_LABEL], "true");
                assert_eq!(l[PRECOMPILED_KERNEL_LABEL], kernel);
                assert_eq!(l["app"], name);
            }
            assert_eq!(own[OPERAND_LABEL], "nvidia-driver");
            // Nothing is built on the node: no repository, headers or compiler are needed.
            assert!(
                !pod.volumes
                    .iter()
                    .flatten()
                    .any(|v| v.name == driver::REPO_CONFIG)
            );
        }
        // The node without NFD's kernel label gets no half-configured driver, and status says
        // why.
        let note = unplaced(&p, &facts()).unwrap();
        assert!(note.contains("a4"), "{note}");
        assert!(note.contains(crate::nodes::KERNEL_VERSION), "{note}");
        assert!(!note.contains("a1"), "{note}");
    }

    #[test]
    fn long_pool_names_keep_one_distinct_app_selector_per_kernel() {
        let p = precompiled_pool(&"long-pool-name-".repeat(3));
        let objects = render(&policy("{}"), &p, &facts());
        let apps: Vec<String> = objects
            .daemon_sets
            .iter()
            .map(|ds| labels(ds).0["app"].clone())
            .collect();
        assert_eq!(apps.len(), 2);
        assert_ne!(apps[0], apps[1]);
        for app in &apps {
            assert!(app.len() <= 63, "{app}");
        }
        assert_eq!(unique_app_label("short"), "short");
    }

    #[test]
    fn precompiled_pools_refuse_a_digest_sidecars_and_a_switch_of_a_running_pool() {
        let spec =
            |v: serde_json::Value| -> NvidiaDriverSpec { serde_json::from_value(v).unwrap() };
        let digest = check(
            &spec(serde_json::json!({"usePrecompiled": true, "version": "sha256:abc"})),
            Build::Precompiled,
            &facts(),
        );
        assert!(
            digest[0].starts_with("spec.version: a digest"),
            "{digest:?}"
        );
        let gds = check(
            &spec(serde_json::json!({"usePrecompiled": true, "version": "580",
                "kernelModuleType": "open", "gds": {"enabled": true, "repository": "r",
                "image": "nvidia-fs", "version": "2.26.6"}})),
            Build::Precompiled,
            &facts(),
        );
        assert!(
            gds[0].starts_with("spec.gds.enabled: NVIDIA publishes no"),
            "{gds:?}"
        );
        assert!(gds[0].contains("spec.usePrecompiled to false"), "{gds:?}");
        let plain = spec(serde_json::json!({"usePrecompiled": true, "version": "580"}));
        assert!(check(&plain, Build::Precompiled, &facts()).is_empty());
        // The pool's own running DaemonSets decide, never the ClusterPolicy's.
        let running = |built_on_node: bool, precompiled: bool| {
            use crate::operands::driver_variant::Variant;
            let variants: Vec<Variant> = [
                (built_on_node, Variant::BuiltOnNode),
                (precompiled, Variant::Precompiled),
            ]
            .into_iter()
            .filter_map(|(on, v)| on.then_some(v))
            .collect();
            ClusterFacts {
                live_driver: crate::facts::LiveDriver::running(&variants),
                ..facts()
            }
        };
        let to_precompiled = check(&plain, Build::Precompiled, &running(true, false));
        assert!(
            to_precompiled[0]
                .starts_with("spec.usePrecompiled: the GPU nodes run driver DaemonSets that build"),
            "{to_precompiled:?}"
        );
        assert!(to_precompiled[0].contains("remove spec.usePrecompiled again"));
        let built = spec(serde_json::json!({"version": "580"}));
        let to_built = check(&built, Build::PerOs, &running(false, true));
        assert!(
            to_built[0].contains("precompiled driver DaemonSets")
                && to_built[0].contains("set spec.usePrecompiled back to true"),
            "{to_built:?}"
        );
        assert!(check(&plain, Build::Precompiled, &running(false, true)).is_empty());
        assert!(check(&built, Build::PerOs, &running(true, false)).is_empty());
    }

    const V414: &str = "414.92.202312132152-0";
    const V415: &str = "415.92.202402201450-0";

    fn openshift_facts() -> ClusterFacts {
        ClusterFacts {
            openshift: true,
            os_tag: Some("rhcos4.14".to_owned()),
            driver_toolkit: Some(
                [(V414.to_owned(), "quay.io/ocp/dtk@sha256:414".to_owned())].into(),
            ),
            ..facts()
        }
    }

    #[test]
    fn a_pool_on_openshift_gets_a_toolkit_daemonset_per_rhcos_version_and_untagged_ones_are_reported()
     {
        let toolkit = policy("{operator: {use_ocp_driver_toolkit: true}}");
        let ostree = crate::nodes::OSTREE_VERSION;
        let mut p = pool(
            "pool-a",
            serde_json::json!({"version": "580.95.05", "nodeSelector": {"pool": "a"}}),
            vec![
                with(node("r1", ("rhcos", "4.14"), "a"), ostree, V414),
                with(node("r2", ("rhcos", "4.15"), "a"), ostree, V415),
            ],
        );
        let f = openshift_facts();
        p.build = build(&toolkit.spec, &p.spec, &f);
        assert_eq!(p.build, Build::Toolkit);
        let objects = render(&toolkit, &p, &f);
        assert_eq!(
            names(&objects),
            [format!("nvidia-gpu-driver-pool-a-{V414}")]
        );
        let ds = &objects.daemon_sets[0];
        assert_eq!(
            containers(ds),
            [
                (
                    "nvidia-driver-ctr".to_owned(),
                    "nvcr.io/nvidia/driver:580.95.05-rhcos4.14".to_owned()
                ),
                (
                    driver_toolkit::CONTAINER.to_owned(),
                    "quay.io/ocp/dtk@sha256:414".to_owned()
                ),
            ]
        );
        let (own, pods) = labels(ds);
        assert_eq!(own[driver_toolkit::IDENTIFICATION_LABEL], "true");
        assert_eq!(own[driver_toolkit::VERSION_LABEL], V414);
        assert_eq!(pods[driver_toolkit::IDENTIFICATION_LABEL], "true");
        assert_eq!(own["app"], format!("nvidia-gpu-driver-pool-a-{V414}"));
        assert_eq!(own[OPERAND_LABEL], "nvidia-driver");
        let selector = crate::operands::test_support::pod(ds)
            .node_selector
            .clone()
            .unwrap();
        assert_eq!(selector[ostree], V414);
        assert_eq!(selector["pool"], "a");
        let note = unplaced(&p, &f).unwrap();
        assert!(note.contains(&format!("RHCOS {V415} (r2)")), "{note}");
        assert!(!note.contains("r1"), "{note}");
    }

    #[test]
    fn the_toolkit_is_used_only_when_asked_for_and_never_with_precompiled_drivers() {
        let spec =
            |v: serde_json::Value| -> NvidiaDriverSpec { serde_json::from_value(v).unwrap() };
        let plain = spec(serde_json::json!({"version": "1"}));
        let precompiled = spec(serde_json::json!({"version": "1", "usePrecompiled": true}));
        let asked = policy("{operator: {use_ocp_driver_toolkit: true}}").spec;
        let f = openshift_facts();
        assert_eq!(build(&asked, &plain, &f), Build::Toolkit);
        assert_eq!(build(&asked, &precompiled, &f), Build::Precompiled);
        // Absent means the standard driver, on OpenShift too; and never off OpenShift.
        assert_eq!(build(&policy("{}").spec, &plain, &f), Build::PerOs);
        assert_eq!(build(&asked, &plain, &facts()), Build::PerOs);
        // A running pool is not moved to or from the toolkit at once.
        let mut standard = openshift_facts();
        standard.live_driver = crate::facts::LiveDriver::running(&[
            crate::operands::driver_variant::Variant::BuiltOnNode,
        ]);
        let problems = check(&plain, Build::Toolkit, &standard);
        assert!(
            problems[0].starts_with(
                "the ClusterPolicy's spec.operator.use_ocp_driver_toolkit: the GPU nodes run"
            ),
            "{problems:?}"
        );
        assert!(check(&plain, Build::PerOs, &standard).is_empty());
        let mut toolkit = openshift_facts();
        toolkit.live_driver = crate::facts::LiveDriver::running(&[
            crate::operands::driver_variant::Variant::DriverToolkit,
        ]);
        toolkit
            .live_driver_toolkit
            .insert(V414.to_owned(), "quay.io/ocp/dtk@sha256:414".to_owned());
        assert!(check(&plain, Build::PerOs, &toolkit)[0].contains("Driver Toolkit DaemonSets"));
        assert!(check(&plain, Build::Toolkit, &toolkit).is_empty());
    }
}
