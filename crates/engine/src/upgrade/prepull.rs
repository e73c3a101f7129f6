//! Driver upgrades, the pre-pull (pure): before a node is cordoned for a new driver, the images
//! its next driver pod needs are pulled there by a pre-pull DaemonSet that shadows the node's
//! driver DaemonSet and runs nothing of the driver (docs/driver-upgrades.md, "Pre-pulled
//! images"). Here: which images a node lacks, what its pre-pull pod shows of them, which
//! pre-pull DaemonSets should exist, and the DaemonSet itself, rendered from the live driver
//! DaemonSet so that it lands on exactly the driver's nodes.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::apps::v1::{
    DaemonSet, DaemonSetSpec, DaemonSetUpdateStrategy, RollingUpdateDaemonSet,
};
use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, Container, ContainerStatus, Pod, PodSpec, PodTemplateSpec,
    ResourceRequirements, SeccompProfile, SecurityContext,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::machine::{DriverRevision, NodeFacts};
use crate::model::{MANAGED_BY_LABEL, MANAGER};
use crate::operands::common::{APP_LABEL, COMPONENT_LABEL, PART_OF, PART_OF_LABEL, sha256_hex};

/// `app.kubernetes.io/component` of the pre-pull DaemonSets and their pods (not the driver's:
/// nothing that looks for driver pods may find these).
pub const COMPONENT: &str = "nvidia-driver-prepull";
/// Pod template annotation: the driver DaemonSet a pre-pull DaemonSet shadows (an annotation,
/// as a DaemonSet name may be longer than a label value).
pub const SHADOWS_ANNOTATION: &str = "nvidia.com/gpu-operator.driver-prepull-for";
/// DaemonSet annotation: hash of what was rendered, so an unchanged one is not sent again.
pub const HASH_ANNOTATION: &str = "nvidia.com/gpu-operator.driver-prepull-hash";
/// Waiting reasons a kubelet reports for a container whose image could not be pulled.
pub const PULL_FAILURES: [&str; 5] = [
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "RegistryUnavailable",
];
/// What a pre-pull container runs: a shell that sleeps, never the driver's entrypoint. Every
/// driver image (and the driver manager's) ships a shell.
pub const COMMAND: [&str; 3] = ["sh", "-c", "while :; do sleep 3600; done"];
/// The user the pre-pull containers run as (nobody): they need no privilege at all.
const NOBODY: i64 = 65534;
/// Longest driver DaemonSet name kept in a pre-pull DaemonSet's name: the name is also the
/// pods' `app` label value (63 characters at most) and the pods' name prefix.
const NAME_BASE_MAX: usize = 40;

/// What a node's pre-pull pod shows of one image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pull {
    /// Not pulled yet (no status, or the container is still being created).
    Pending,
    /// The container started (or ran and exited): the image is on the node.
    Pulled,
    /// The kubelet could not pull it: its reason and message, e.g. `ErrImagePull: ... not
    /// found`.
    Failed(String),
}

/// A pre-pull pod, reduced: the driver DaemonSet it shadows and what each of its images shows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrepullPod {
    pub shadows: String,
    pub images: BTreeMap<String, Pull>,
}

/// Where a node stands with the images its next driver pod needs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Prepull {
    /// Nothing to pull: the next driver pod runs the images the node runs now (a restart only,
    /// new metadata, or a change that keeps the images).
    #[default]
    NotNeeded,
    /// These images are not known to be on the node yet: no pre-pull pod there, or it is
    /// still pulling.
    Pulling(BTreeSet<String>),
    /// Every image the next driver pod needs is on the node.
    Pulled,
    /// An image could not be pulled: the node keeps its running driver.
    Failed { image: String, reason: String },
}

impl Prepull {
    /// Whether the node's upgrade may not start yet.
    pub fn holds(&self) -> bool {
        matches!(self, Prepull::Pulling(_) | Prepull::Failed { .. })
    }
}

/// Every image a pod spec runs (containers and init containers).
pub fn pod_images(spec: &PodSpec) -> BTreeSet<String> {
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .filter_map(|c| c.image.clone())
        .filter(|i| !i.is_empty())
        .collect()
}

/// The images a driver pod classified as `revision` lacks for its DaemonSet's template (which
/// runs `wanted`): only a full upgrade replaces the driver with another image; a restart in
/// place and a metadata-only difference keep what the node has, and a pod handed to another
/// driver variant is not pre-pulled (its next pod comes from the new variant's DaemonSet).
pub fn missing_images(
    revision: DriverRevision,
    running: &BTreeSet<String>,
    wanted: &BTreeSet<String>,
) -> BTreeSet<String> {
    match revision {
        DriverRevision::Outdated => wanted.difference(running).cloned().collect(),
        DriverRevision::Current
        | DriverRevision::OlderMetadata
        | DriverRevision::RestartOnly
        | DriverRevision::Outgoing => BTreeSet::new(),
    }
}

/// What one container status says of its image's pull.
pub fn container_pull(status: &ContainerStatus) -> Pull {
    let state = status.state.as_ref();
    let waiting = state.and_then(|s| s.waiting.as_ref());
    if let Some(reason) = waiting
        .and_then(|w| w.reason.as_deref())
        .filter(|r| PULL_FAILURES.contains(r))
    {
        let message = waiting
            .and_then(|w| w.message.as_deref())
            .filter(|m| !m.is_empty());
        return Pull::Failed(match message {
            Some(m) => format!("{reason}: {}", m.chars().take(200).collect::<String>()),
            None => reason.to_owned(),
        });
    }
    let ran = state.is_some_and(|s| s.running.is_some() || s.terminated.is_some())
        || status.started == Some(true)
        || status.ready
        || status.restart_count > 0
        || status
            .last_state
            .as_ref()
            .is_some_and(|s| s.terminated.is_some());
    if ran { Pull::Pulled } else { Pull::Pending }
}

/// A pre-pull pod reduced to what the upgrade reads; `None` for any other pod.
pub fn prepull_pod(pod: &Pod) -> Option<PrepullPod> {
    let labels = pod.metadata.labels.as_ref()?;
    if labels.get(COMPONENT_LABEL).map(String::as_str) != Some(COMPONENT) {
        return None;
    }
    let shadows = pod
        .metadata
        .annotations
        .as_ref()?
        .get(SHADOWS_ANNOTATION)?
        .clone();
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref());
    let images = pod
        .spec
        .as_ref()?
        .containers
        .iter()
        .filter_map(|c| {
            let image = c.image.clone()?;
            let pull = statuses
                .into_iter()
                .flatten()
                .find(|s| s.name == c.name)
                .map_or(Pull::Pending, container_pull);
            Some((image, pull))
        })
        .collect();
    Some(PrepullPod { shadows, images })
}

/// Where a node whose driver pod belongs to `daemon_set` and lacks `missing` stands, given the
/// pre-pull pods on the node. A pod that shadows another DaemonSet, or pulls other images (one
/// left from an earlier target), tells nothing.
pub fn node_state(daemon_set: &str, missing: &BTreeSet<String>, pods: &[&PrepullPod]) -> Prepull {
    if missing.is_empty() {
        return Prepull::NotNeeded;
    }
    let Some(pod) = pods
        .iter()
        .find(|p| p.shadows == daemon_set && missing.iter().all(|i| p.images.contains_key(i)))
    else {
        return Prepull::Pulling(missing.clone());
    };
    if let Some((image, reason)) = missing.iter().find_map(|i| match pod.images.get(i)? {
        Pull::Failed(reason) => Some((i.clone(), reason.clone())),
        _ => None,
    }) {
        return Prepull::Failed { image, reason };
    }
    let pending: BTreeSet<String> = missing
        .iter()
        .filter(|i| pod.images.get(*i) != Some(&Pull::Pulled))
        .cloned()
        .collect();
    if pending.is_empty() {
        Prepull::Pulled
    } else {
        Prepull::Pulling(pending)
    }
}

/// The driver DaemonSets whose nodes need a pre-pull now: some node with a driver pod of it
/// lacks an image of its template and is not kept out of upgrades. Once every such pod runs
/// the template's images (the rollout to them is done) the set no longer names it.
pub fn wanted(nodes: &[NodeFacts]) -> BTreeSet<String> {
    nodes
        .iter()
        .filter(|n| !n.skip && n.prepull != Prepull::NotNeeded)
        .filter_map(|n| n.driver.as_ref().map(|d| d.daemon_set.clone()))
        .collect()
}

/// The pre-pull DaemonSet's name for driver DaemonSet `driver` pulling `images`: a new target
/// gets a new DaemonSet (and the old one goes), so a pod's images never change under it.
pub fn name(driver: &str, images: &BTreeSet<String>) -> String {
    let mut key = driver.to_owned();
    for image in images {
        key.push('\n');
        key.push_str(image);
    }
    let base: String = driver.chars().take(NAME_BASE_MAX).collect();
    format!(
        "{}-prepull-{}",
        base.trim_end_matches(['-', '.']),
        &sha256_hex(key.as_bytes())[..8]
    )
}

fn quantity(value: &str) -> Quantity {
    Quantity(value.to_owned())
}

/// One pre-pull container: the image, with the pull policy the driver's container has for it,
/// running a sleep with no privilege, no token and tiny resources.
fn container(index: usize, image: &str, pull_policy: Option<String>) -> Container {
    Container {
        name: format!("pull-{index}"),
        image: Some(image.to_owned()),
        image_pull_policy: pull_policy,
        command: Some(COMMAND.iter().map(|s| (*s).to_owned()).collect()),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_owned(), quantity("1m")),
                ("memory".to_owned(), quantity("8Mi")),
            ])),
            limits: Some(BTreeMap::from([
                ("cpu".to_owned(), quantity("10m")),
                ("memory".to_owned(), quantity("32Mi")),
            ])),
            ..ResourceRequirements::default()
        }),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            privileged: Some(false),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            run_as_user: Some(NOBODY),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_owned()]),
                ..Capabilities::default()
            }),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".to_owned(),
                ..SeccompProfile::default()
            }),
            ..SecurityContext::default()
        }),
        ..Container::default()
    }
}

/// The pre-pull DaemonSet shadowing the live driver DaemonSet `driver`: the same namespace,
/// owner, node selector, node affinity, tolerations and image pull secrets, so it lands on
/// exactly the driver's nodes and pulls as the driver would; one container per image of the driver's
/// template. `None` when `driver` has no name or template.
pub fn render(driver: &DaemonSet) -> Option<DaemonSet> {
    let driver_name = driver.metadata.name.as_deref()?;
    let template = driver.spec.as_ref()?.template.spec.as_ref()?;
    let images = pod_images(template);
    if images.is_empty() {
        return None;
    }
    let name = name(driver_name, &images);
    let pull_policy = |image: &str| {
        template
            .containers
            .iter()
            .chain(template.init_containers.iter().flatten())
            .find(|c| c.image.as_deref() == Some(image))
            .and_then(|c| c.image_pull_policy.clone())
    };
    let pod_labels = BTreeMap::from([
        (APP_LABEL.to_owned(), name.clone()),
        (COMPONENT_LABEL.to_owned(), COMPONENT.to_owned()),
        (PART_OF_LABEL.to_owned(), PART_OF.to_owned()),
    ]);
    let mut labels = pod_labels.clone();
    labels.insert(MANAGED_BY_LABEL.to_owned(), MANAGER.to_owned());
    let mut ds = DaemonSet {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: driver.metadata.namespace.clone(),
            labels: Some(labels),
            owner_references: driver.metadata.owner_references.clone(),
            ..ObjectMeta::default()
        },
        spec: Some(DaemonSetSpec {
            selector: LabelSelector {
                match_labels: Some(BTreeMap::from([(APP_LABEL.to_owned(), name.clone())])),
                ..LabelSelector::default()
            },
            // Its pods serve nobody: a changed placement replaces them all at once.
            update_strategy: Some(DaemonSetUpdateStrategy {
                type_: Some("RollingUpdate".to_owned()),
                rolling_update: Some(RollingUpdateDaemonSet {
                    max_unavailable: Some(IntOrString::String("100%".to_owned())),
                    ..RollingUpdateDaemonSet::default()
                }),
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    annotations: Some(BTreeMap::from([(
                        SHADOWS_ANNOTATION.to_owned(),
                        driver_name.to_owned(),
                    )])),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    containers: images
                        .iter()
                        .enumerate()
                        .map(|(i, image)| container(i, image, pull_policy(image)))
                        .collect(),
                    node_selector: template.node_selector.clone(),
                    // Node affinity only: the driver's pod anti-affinity (one driver pod per
                    // node) would keep the pre-pull pod off every node that runs a driver.
                    affinity: template
                        .affinity
                        .as_ref()
                        .and_then(|a| a.node_affinity.clone())
                        .map(|node_affinity| Affinity {
                            node_affinity: Some(node_affinity),
                            ..Affinity::default()
                        }),
                    tolerations: template.tolerations.clone(),
                    image_pull_secrets: template.image_pull_secrets.clone(),
                    automount_service_account_token: Some(false),
                    enable_service_links: Some(false),
                    termination_grace_period_seconds: Some(1),
                    ..PodSpec::default()
                }),
            },
            ..DaemonSetSpec::default()
        }),
        status: None,
    };
    let hash = sha256_hex(&serde_json::to_vec(&ds).unwrap_or_default());
    ds.metadata.annotations = Some(BTreeMap::from([(HASH_ANNOTATION.to_owned(), hash)]));
    Some(ds)
}

/// Whether a live DaemonSet is a pre-pull DaemonSet.
pub fn is_prepull(ds: &DaemonSet) -> bool {
    ds.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(COMPONENT_LABEL))
        .is_some_and(|c| c == COMPONENT)
}

fn hash_of(ds: &DaemonSet) -> Option<&str> {
    ds.metadata
        .annotations
        .as_ref()?
        .get(HASH_ANNOTATION)
        .map(String::as_str)
}

/// What the IO half does with the pre-pull DaemonSets in one pass.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sync {
    /// Rendered and not live as rendered: to apply.
    pub apply: Vec<DaemonSet>,
    /// Live pre-pull DaemonSets no longer wanted (their rollout is done, their target image
    /// changed, or their driver DaemonSet is gone): to delete.
    pub delete: Vec<String>,
}

/// The pre-pull DaemonSets for the driver DaemonSets named in `wanted` (rendered from `live`,
/// every DaemonSet the operator manages, by name) against the pre-pull DaemonSets in `live`.
pub fn sync(wanted: &BTreeSet<String>, live: &BTreeMap<String, DaemonSet>) -> Sync {
    let rendered: Vec<DaemonSet> = wanted
        .iter()
        .filter_map(|driver| live.get(driver))
        .filter(|d| !is_prepull(d))
        .filter_map(render)
        .collect();
    let names: BTreeSet<&str> = rendered
        .iter()
        .filter_map(|d| d.metadata.name.as_deref())
        .collect();
    let delete = live
        .iter()
        .filter(|(name, ds)| is_prepull(ds) && !names.contains(name.as_str()))
        .filter(|(_, ds)| ds.metadata.deletion_timestamp.is_none())
        .map(|(name, _)| name.clone())
        .collect();
    let apply = rendered
        .iter()
        .filter(|d| {
            let name = d.metadata.name.as_deref().unwrap_or_default();
            live.get(name).and_then(hash_of) != hash_of(d)
        })
        .cloned()
        .collect();
    Sync { apply, delete }
}

/// The status line of a set of nodes (an NVIDIADriver pool's) when some are held: per image
/// that cannot be pulled (each node's held annotation, [`super::machine::HELD_ANNOTATION`]) and
/// the kubelet's reason where its pre-pull pod still shows one, the nodes. Items are
/// `(node, held image, reason)`; `None` when no node is held.
pub fn held_line<'a>(
    nodes: impl IntoIterator<Item = (&'a str, Option<&'a str>, Option<String>)>,
) -> Option<String> {
    let mut groups: BTreeMap<(&str, Option<String>), Vec<&str>> = BTreeMap::new();
    for (node, image, reason) in nodes {
        if let Some(image) = image.filter(|i| !i.is_empty()) {
            groups.entry((image, reason)).or_default().push(node);
        }
    }
    if groups.is_empty() {
        return None;
    }
    let groups: Vec<String> = groups
        .iter()
        .map(|((image, reason), nodes)| {
            let why = reason
                .as_ref()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default();
            format!("{image} cannot be pulled on {}{why}", nodes.join(", "))
        })
        .collect();
    Some(format!(
        "driver upgrade held before the cordon (the nodes keep their running driver): {}",
        groups.join("; ")
    ))
}

/// The kubelet's reason for `image` on the node whose pre-pull pods are `pods`, while one
/// shows the pull failing.
pub fn pull_failure<'a>(
    image: &str,
    pods: impl IntoIterator<Item = &'a PrepullPod>,
) -> Option<String> {
    pods.into_iter().find_map(|p| match p.images.get(image)? {
        Pull::Failed(reason) => Some(reason.clone()),
        Pull::Pending | Pull::Pulled => None,
    })
}
