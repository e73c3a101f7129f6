//! Render stage, OpenShift Driver Toolkit (pure, no IO): with `operator.use_ocp_driver_toolkit`
//! on OpenShift the GPU nodes of each RHCOS version get their own driver DaemonSet, whose
//! `openshift-driver-toolkit-ctr` sidecar builds the driver in the Driver Toolkit image made
//! for that RHCOS (kernel headers and compilers matching the node), as NVIDIA's operator does
//! (docs/operand-facts.md §3.3):
//!
//! - the RHCOS version is NFD's `feature.node.kubernetes.io/system-os_release.OSTREE_VERSION`
//!   label, which also selects the pool's nodes;
//! - the DaemonSet is `nvidia-driver-daemonset-<RHCOS version>`, labelled
//!   `openshift.driver-toolkit=true` and `openshift.driver-toolkit.rhcos=<version>`;
//! - the toolkit image is the `driver-toolkit` ImageStream's tag named after the version
//!   ([`ClusterFacts::driver_toolkit`]).
//!
//! Unlike NVIDIA's, a version without its tag gets no DaemonSet (NVIDIA's falls back to building
//! in the driver image, which has no matching kernel headers); its nodes are reported. A pool
//! already running keeps the toolkit image it runs while its tag is gone, so a broken
//! ImageStream never restarts a running driver (decision 20).

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Container, EmptyDirVolumeSource, Volume};

use super::common::{self, MountExt, env, mount, set_env};
use super::driver;
use crate::api::ClusterPolicySpec;
use crate::facts::ClusterFacts;
use crate::nodes::{NodeView, OSTREE_VERSION};

/// The sidecar that builds the driver in the Driver Toolkit image.
pub const CONTAINER: &str = "openshift-driver-toolkit-ctr";
/// Label on the toolkit DaemonSets and their pods (value `true`).
pub const IDENTIFICATION_LABEL: &str = "openshift.driver-toolkit";
/// Label on a toolkit DaemonSet: its RHCOS version.
pub const VERSION_LABEL: &str = "openshift.driver-toolkit.rhcos";
/// The ImageStream OpenShift publishes the toolkit images in, one tag per RHCOS version.
pub const IMAGE_STREAM: &str = "driver-toolkit";
pub const IMAGE_STREAM_NAMESPACE: &str = "openshift";
/// The directory the driver container prepares for the toolkit sidecar (an emptyDir).
const SHARED_VOLUME: &str = "shared-nvidia-driver-toolkit";
const SHARED_DIR: &str = "/mnt/shared-nvidia-driver-toolkit";
/// The driver image's entrypoint when the toolkit builds (NVIDIA's driver images ship it).
const ENTRYPOINT: &str = "ocp_dtk_entrypoint";

/// Whether the policy asks for the Driver Toolkit: on OpenShift, explicitly (absent means the
/// standard driver, docs/operand-facts.md §3.3). Precompiled drivers never use it.
pub fn asked_for(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> bool {
    facts.openshift
        && spec
            .operator
            .as_ref()
            .and_then(|o| o.use_ocp_driver_toolkit)
            == Some(true)
}

/// Whether the policy's own driver is built with the Driver Toolkit: [`asked_for`], with
/// drivers built on the node by the ClusterPolicy (NVIDIA's operator turns it off with
/// precompiled drivers; NVIDIADriver pools render their own).
pub fn requested(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> bool {
    asked_for(spec, facts)
        && !driver::uses_precompiled(spec)
        && !driver::uses_nvidia_driver_crd(spec)
}

/// What stops an NVIDIADriver pool's drivers from switching to or from the Driver Toolkit while
/// the other kind runs (`facts.live_driver` and `facts.live_driver_toolkit` are the pool's own):
/// nothing hands a pool's nodes over one at a time, so every node's driver would be replaced at
/// once (decision 20). The policy's own drivers switch node by node (operands::driver_variant).
pub fn switch_problem(toolkit: bool, facts: &ClusterFacts) -> Option<String> {
    let toolkit_live = !facts.live_driver_toolkit.is_empty();
    let standard_live = facts
        .live_driver
        .runs(super::driver_variant::Variant::BuiltOnNode);
    let field = "spec.operator.use_ocp_driver_toolkit";
    if toolkit && standard_live && !toolkit_live {
        return Some(format!(
            "{field}: the GPU nodes run driver DaemonSets built without the Driver Toolkit; \
             switching a running fleet to it would replace the driver on every GPU node at once, \
             which this operator does not do yet: set it back to false, or delete those \
             DaemonSets when no GPU job runs"
        ));
    }
    if !toolkit && toolkit_live && !standard_live {
        return Some(format!(
            "{field}: the GPU nodes run Driver Toolkit DaemonSets ({IDENTIFICATION_LABEL}=true); \
             switching them to the standard driver would replace the driver on every GPU node at \
             once, which this operator does not do yet: set it back to true, or delete those \
             DaemonSets when no GPU job runs"
        ));
    }
    None
}

/// Where a pool's toolkit image comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ImageSource {
    /// The ImageStream's tag for the version.
    Tag(String),
    /// The tag is gone; the running DaemonSet's image is kept.
    Running(String),
}

impl ImageSource {
    pub fn image(&self) -> &str {
        match self {
            ImageSource::Tag(i) | ImageSource::Running(i) => i,
        }
    }
}

/// The GPU nodes of one RHCOS version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolkitPool {
    /// NFD's OSTree version of its nodes (`414.92.202312132152-0`).
    pub rhcos: String,
    /// The OS tag of its nodes (`rhcos4.14`), the driver image tag's last part.
    pub os_tag: Option<String>,
    pub image: ImageSource,
    pub nodes: Vec<String>,
}

impl ToolkitPool {
    /// NVIDIA's DaemonSet name for the pool: the base name and the RHCOS version.
    pub fn daemon_set_name(&self, base: &str) -> String {
        format!("{base}-{}", self.rhcos)
    }
}

/// Why GPU nodes get no toolkit driver pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Unplaced {
    /// GPU nodes without NFD's OSTree label (not RHCOS, or an NFD too old to publish it).
    pub unlabelled: Vec<String>,
    /// RHCOS versions without a tag in the ImageStream (or no ImageStream), with their nodes.
    pub untagged: BTreeMap<String, Vec<String>>,
}

/// The GPU nodes by RHCOS version with their toolkit image, and those that get none.
pub fn pools(facts: &ClusterFacts) -> (Vec<ToolkitPool>, Unplaced) {
    let mut nodes: Vec<&Arc<NodeView>> = facts
        .gpu_nodes
        .iter()
        .filter(|n| n.is_gpu_node() || n.has_nfd_gpu())
        .collect();
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    let mut by_version: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut os_tags: BTreeMap<String, String> = BTreeMap::new();
    let mut unplaced = Unplaced::default();
    for node in nodes {
        let Some(v) = node.label(OSTREE_VERSION) else {
            unplaced.unlabelled.push(node.name.clone());
            continue;
        };
        by_version
            .entry(v.to_owned())
            .or_default()
            .push(node.name.clone());
        if let Some(tag) = super::driver_os::os_tag(node) {
            os_tags.entry(v.to_owned()).or_insert(tag);
        }
    }
    let mut pools = Vec::new();
    for (rhcos, nodes) in by_version {
        let tagged = facts
            .driver_toolkit
            .as_ref()
            .and_then(|tags| tags.get(&rhcos))
            .filter(|i| !i.is_empty());
        let image = match (tagged, facts.live_driver_toolkit.get(&rhcos)) {
            (Some(tag), _) => ImageSource::Tag(tag.clone()),
            (None, Some(running)) => {
                unplaced.untagged.insert(rhcos.clone(), nodes.clone());
                ImageSource::Running(running.clone())
            }
            (None, None) => {
                unplaced.untagged.insert(rhcos, nodes);
                continue;
            }
        };
        pools.push(ToolkitPool {
            os_tag: os_tags.get(&rhcos).cloned(),
            rhcos,
            image,
            nodes,
        });
    }
    (pools, unplaced)
}

/// NFD does not publish the OSTree version on any GPU node (NVIDIA's "NFD too old").
pub fn nfd_too_old(facts: &ClusterFacts) -> bool {
    let gpu: Vec<_> = facts
        .gpu_nodes
        .iter()
        .filter(|n| n.is_gpu_node() || n.has_nfd_gpu())
        .collect();
    !gpu.is_empty() && gpu.iter().all(|n| n.label(OSTREE_VERSION).is_none())
}

/// NVIDIA's `openshift_driver_toolkit_*` gauges: enabled (1, -1 requested but not possible, 0
/// not requested), NFD too old, ImageStream missing, RHCOS tags missing, ImageStream broken.
pub fn gauges(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> [i64; 5] {
    if !requested(spec, facts) {
        return [0; 5];
    }
    let too_old = nfd_too_old(facts);
    let missing = facts.driver_toolkit.is_none();
    let has_versions = facts
        .gpu_nodes
        .iter()
        .any(|n| n.label(OSTREE_VERSION).is_some());
    let enabled = !missing && has_versions;
    let tags_missing = enabled && !pools(facts).1.untagged.is_empty();
    [
        if enabled { 1 } else { -1 },
        i64::from(too_old),
        i64::from(missing),
        i64::from(tags_missing),
        i64::from(!missing && facts.driver_toolkit_broken),
    ]
}

/// What status says about GPU nodes the toolkit cannot build a driver for, when there are any.
pub fn report(facts: &ClusterFacts) -> Option<String> {
    let (pools, unplaced) = pools(facts);
    let mut parts = Vec::new();
    let names = |nodes: &[String]| {
        let mut named = nodes
            .iter()
            .take(10)
            .cloned()
            .collect::<Vec<_>>()
            .join(", ");
        if nodes.len() > 10 {
            named.push_str(&format!(" and {} more", nodes.len() - 10));
        }
        named
    };
    for (rhcos, nodes) in &unplaced.untagged {
        let kept = pools
            .iter()
            .find(|p| &p.rhcos == rhcos)
            .map(|p| format!(", its running pool keeps {}", p.image.image()));
        let missing = match facts.driver_toolkit {
            None => format!("no ImageStream {IMAGE_STREAM_NAMESPACE}/{IMAGE_STREAM}"),
            Some(_) => {
                format!("no tag {rhcos} in ImageStream {IMAGE_STREAM_NAMESPACE}/{IMAGE_STREAM}")
            }
        };
        parts.push(format!(
            "RHCOS {rhcos} ({}): {missing}{}",
            names(nodes),
            kept.unwrap_or_else(|| ", no driver pod".to_owned())
        ));
    }
    if !unplaced.unlabelled.is_empty() {
        parts.push(format!(
            "no NFD {OSTREE_VERSION} label, no driver pod: {}",
            names(&unplaced.unlabelled)
        ));
    }
    (!parts.is_empty()).then(|| format!("Driver Toolkit: {}", parts.join("; ")))
}

/// Makes the driver DaemonSet `ds` (rendered for the pool's OS) the pool's, named `name`: NVIDIA's
/// `transformOpenShiftDriverToolkitContainer`, with the repo and CA files also in the toolkit
/// container (it builds with the OS's packages; NVIDIA mounts them only in the driver's).
pub fn apply(ds: &mut DaemonSet, pool: &ToolkitPool, name: &str) {
    let name = name.to_owned();
    let app = driver::app_label(&name);
    let labels = ds.metadata.labels.get_or_insert_default();
    labels.insert(common::APP_LABEL.to_owned(), app.clone());
    labels.insert(VERSION_LABEL.to_owned(), pool.rhcos.clone());
    labels.insert(IDENTIFICATION_LABEL.to_owned(), "true".to_owned());
    ds.metadata.name = Some(name);
    let Some(ds_spec) = ds.spec.as_mut() else {
        return;
    };
    ds_spec
        .selector
        .match_labels
        .get_or_insert_default()
        .insert(common::APP_LABEL.to_owned(), app.clone());
    let template_labels = ds_spec
        .template
        .metadata
        .get_or_insert_default()
        .labels
        .get_or_insert_default();
    template_labels.insert(common::APP_LABEL.to_owned(), app);
    template_labels.insert(IDENTIFICATION_LABEL.to_owned(), "true".to_owned());
    let Some(pod) = ds_spec.template.spec.as_mut() else {
        return;
    };
    pod.node_selector
        .get_or_insert_default()
        .insert(OSTREE_VERSION.to_owned(), pool.rhcos.clone());
    let mut builds_with_packages = Vec::new();
    let mut resources = None;
    for c in &mut pod.containers {
        let run = match c.name.as_str() {
            driver::MAIN_CONTAINER => "nv-ctr-run-with-dtk",
            driver::GDS_CONTAINER => "nv-fs-ctr-run-with-dtk",
            driver::GDRCOPY_CONTAINER => "gdrcopy-ctr-run-with-dtk",
            _ => continue,
        };
        c.command = Some(vec![ENTRYPOINT.to_owned()]);
        c.args = Some(vec![run.to_owned()]);
        let mounts = c.volume_mounts.get_or_insert_default();
        mounts.push(mount(SHARED_VOLUME, SHARED_DIR));
        if c.name == driver::MAIN_CONTAINER {
            builds_with_packages = mounts
                .iter()
                .filter(|m| m.name == driver::REPO_CONFIG || m.name == driver::CERT_CONFIG)
                .cloned()
                .collect();
            resources = c.resources.clone();
        }
    }
    let mut toolkit_env = vec![
        env("RHCOS_VERSION", &pool.rhcos),
        // The toolkit container runs with runc, without GPUs.
        env("NVIDIA_VISIBLE_DEVICES", "void"),
    ];
    // The sidecars are in the pod exactly when their section enables them.
    let has = |name: &str| pod.containers.iter().any(|c| c.name == name);
    if has(driver::GDS_CONTAINER) {
        set_env(&mut toolkit_env, env("GDS_ENABLED", "true"));
    }
    if has(driver::GDRCOPY_CONTAINER) {
        set_env(&mut toolkit_env, env("GDRCOPY_ENABLED", "true"));
    }
    let mut toolkit_mounts = vec![
        mount(SHARED_VOLUME, SHARED_DIR),
        mount(driver::VAR_LOG, "/var/log"),
        mount(driver::MOFED_USR_SRC, "/run/mellanox/drivers/usr/src").host_to_container(),
        mount(driver::HOST_OS_RELEASE, "/host-etc/os-release").read_only(),
    ];
    toolkit_mounts.extend(builds_with_packages);
    let wait_and_build = format!(
        "until [ -f {SHARED_DIR}/dir_prepared ]; do echo  Waiting for {} container to prepare \
         the shared directory ...; sleep 10; done; exec {SHARED_DIR}/{ENTRYPOINT} dtk-build-driver",
        driver::MAIN_CONTAINER
    );
    let pull_policy = pod
        .containers
        .iter()
        .find(|c| c.name == driver::MAIN_CONTAINER)
        .and_then(|c| c.image_pull_policy.clone());
    pod.containers.push(Container {
        env: Some(toolkit_env),
        // The build loads and unloads the kernel module.
        security_context: Some(common::privileged_s0()),
        volume_mounts: Some(toolkit_mounts),
        resources,
        image_pull_policy: pull_policy.or_else(|| Some("IfNotPresent".to_owned())),
        ..common::container(
            CONTAINER,
            pool.image.image(),
            &["bash", "-xc"],
            &[&wait_and_build],
        )
    });
    pod.volumes.get_or_insert_default().push(Volume {
        name: SHARED_VOLUME.to_owned(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Volume::default()
    });
}
