//! Driver upgrades, the IO half (docs/driver-upgrades.md): reads what the pure state machine
//! ([`machine`]) needs, runs the steps it plans and writes each node's state label.
//!
//! - Runs only while `spec.driver.upgradePolicy.autoUpgrade` is true and the driver is rendered
//!   by the policy; switched off, it removes its labels and annotations from the nodes that
//!   carry them (NVIDIA does the same) and leaves cordons as they are.
//! - Reads on demand, bounded by label or node: driver and validator pods by label, the
//!   driver DaemonSets' ControllerRevisions, GPU nodes, and the pods of the few nodes in an
//!   eviction step. Nothing is written on a pass where no node changes state.
//! - Pods are removed through the Eviction API, so PodDisruptionBudgets hold; a refused
//!   eviction is retried on the next pass until the step's timeout.
//! - One node's failing API call is logged and retried on the next pass; it does not stop the
//!   other nodes or the reconcile.
//! - Before a node is cordoned for a new driver image, that image is pulled there by a pre-pull
//!   DaemonSet shadowing its driver DaemonSet ([`prepull`]): created while a node of the pool
//!   lacks the image, deleted once none does (or the image changes, or upgrades are off). A node
//!   whose pull fails stays in upgrade-required with its running driver.

pub use gpu_operator_engine::upgrade::{forecast, machine, prepull};

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::{ControllerRevision, DaemonSet};
use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod};
use kube::api::{Api, DeleteParams, EvictParams, ListParams, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

use self::machine::{
    Action, DesiredDriver, DriverPod, DriverRevision, NodeFacts, PodFacts, Policy, Pool,
    STATE_LABEL, Step, Summary, UpgradeState, ValidatorPod,
};
use self::prepull::PrepullPod;
use crate::api::{ClusterPolicySpec, Component, DriverUpgradePolicySpec, NVIDIADriver};
use crate::metrics::UpgradeCounts;
use crate::nodes::{DRIVER_POOL, GPU_PRESENT, NodeView};
use crate::operands::{driver, driver_variant, nvidia_driver, validator};

/// `app.kubernetes.io/component` of the driver DaemonSets and their pods.
const COMPONENT_SELECTOR: &str = "app.kubernetes.io/component=nvidia-driver";
const REVISION_HASH_LABEL: &str = "controller-revision-hash";
/// Nodes whose step runs at once (as many node patches in flight as the labeller's).
const STEP_CONCURRENCY: usize = 16;
/// How long one eviction request may take before the pass moves on.
const EVICTION_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// What the upgrade stage did in one pass.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// `None` while automatic upgrades are off.
    pub summary: Option<Summary>,
}

impl Report {
    /// The counts NVIDIA's `nodes_upgrades_*` gauges show.
    pub fn counts(&self) -> UpgradeCounts {
        self.summary
            .as_ref()
            .map(|s| UpgradeCounts {
                in_progress: s.in_progress,
                done: s.done,
                failed: s.failed.len(),
                available: s.available,
                pending: s.pending,
            })
            .unwrap_or_default()
    }

    /// Whether a node is between states, so the pass must look again soon.
    pub fn active(&self) -> bool {
        self.summary.as_ref().is_some_and(Summary::active)
    }
}

/// Whether nothing can be left to upgrade, from the caches alone: every driver DaemonSet has
/// every pod on its current revision and available, and every node labelled for the driver is
/// `upgrade-done` (nodes whose pool upgrades by hand aside). Then the stage's reads (driver and
/// validator pods, GPU nodes, revisions: a thousand-node fleet's worth each) would find nothing
/// to do.
pub fn quiet(
    daemon_sets: &BTreeMap<String, DaemonSet>,
    nodes: &[Arc<NodeView>],
    policies: &Policies,
) -> bool {
    let drivers_settled = daemon_sets
        .values()
        .filter(|d| {
            d.labels()
                .get(crate::operands::common::COMPONENT_LABEL)
                .map(String::as_str)
                == Some(driver::COMPONENT)
        })
        .all(|d| {
            let status = d.status.clone().unwrap_or_default();
            status.observed_generation.unwrap_or(0) >= d.metadata.generation.unwrap_or(0)
                && status.updated_number_scheduled.unwrap_or(0) >= status.desired_number_scheduled
                && status.number_available.unwrap_or(0) >= status.desired_number_scheduled
        });
    // A variant switch moves nodes although every DaemonSet is settled.
    let handing_over = daemon_sets
        .values()
        .any(|d| driver_variant::is_handing_over(d).is_some());
    // A pre-pull DaemonSet left standing is for the stage to delete.
    let prepulling = daemon_sets.values().any(prepull::is_prepull);
    drivers_settled
        && !handing_over
        && !prepulling
        && nodes
            .iter()
            .filter(|n| n.label(crate::nodes::DEPLOY_DRIVER) == Some("true"))
            .filter(|n| policies.for_node(n).is_some())
            .all(|n| {
                n.label(STATE_LABEL) == Some(UpgradeState::Done.label())
                    && !n
                        .upgrade_annotations
                        .contains_key(machine::REQUESTED_ANNOTATION)
            })
}

/// The upgrade policy of each set of driver nodes, the machine's per-pool input: the nodes of
/// the ClusterPolicy's own driver DaemonSets, and each NVIDIADriver pool's (known by the pool
/// label its nodes carry).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Policies {
    /// The ClusterPolicy's `driver.upgradePolicy` for the nodes of its own driver DaemonSets
    /// (and of a pool no longer known); `None` when no ClusterPolicy deploys the driver.
    pub own: Option<DriverUpgradePolicySpec>,
    /// By the value of the pool label on a pool's nodes: the NVIDIADriver's name and the
    /// policy it upgrades with ([`crate::operands::nvidia_driver::upgrade_policy`]).
    pub pools: BTreeMap<String, (String, DriverUpgradePolicySpec)>,
    /// The RuntimeClass that gives a pod GPUs (a pod using it counts as a GPU pod).
    pub runtime_class: String,
}

fn auto_upgrade(spec: &DriverUpgradePolicySpec) -> bool {
    spec.auto_upgrade.unwrap_or(false)
}

impl Policies {
    /// The ClusterPolicy's policy for its own driver nodes (when it deploys the driver), and
    /// with `useNvidiaDriverCRD`, each of `drivers`' (its own, else the ClusterPolicy's).
    pub fn of(spec: Option<&ClusterPolicySpec>, drivers: &[NVIDIADriver]) -> Policies {
        let own = spec.filter(|s| s.is_enabled(Component::Driver)).map(|s| {
            s.driver
                .as_ref()
                .and_then(|d| d.upgrade_policy.clone())
                .unwrap_or_default()
        });
        let pools_in_use = spec
            .is_none_or(|s| s.is_enabled(Component::Driver) && driver::uses_nvidia_driver_crd(s));
        let pools = drivers
            .iter()
            .filter(|_| pools_in_use)
            .filter(|d| d.metadata.deletion_timestamp.is_none())
            .map(|d| {
                let name = d.name_any();
                let policy = nvidia_driver::upgrade_policy(&d.spec, own.as_ref());
                (nvidia_driver::pool_label_value(&name), (name, policy))
            })
            .collect();
        let runtime_class = spec
            .and_then(|s| s.operator.as_ref())
            .map(|o| o.runtime_class().to_owned())
            .unwrap_or_else(|| "nvidia".to_owned());
        Policies {
            own,
            pools,
            runtime_class,
        }
    }

    /// Whether any set of driver nodes upgrades automatically.
    pub fn enabled(&self) -> bool {
        self.own.as_ref().is_some_and(auto_upgrade)
            || self.pools.values().any(|(_, p)| auto_upgrade(p))
    }

    /// The pool a node belongs to (its NVIDIADriver's name, empty for the ClusterPolicy's own
    /// nodes) and that pool's policy; `None` when nothing upgrades it automatically.
    fn for_node(&self, node: &NodeView) -> Option<(&str, &DriverUpgradePolicySpec)> {
        let found = node
            .label(DRIVER_POOL)
            .and_then(|value| self.pools.get(value))
            .map(|(name, policy)| (name.as_str(), policy))
            .or_else(|| self.own.as_ref().map(|p| ("", p)))?;
        auto_upgrade(found.1).then_some(found)
    }
}

/// Label selectors of the pods the upgrade reads: every driver pod (the ClusterPolicy's and
/// NVIDIADriver pools'), the validator's, and the pre-pull pods.
pub const UPGRADE_POD_SELECTORS: [&str; 3] = [
    COMPONENT_SELECTOR,
    "app=nvidia-operator-validator",
    PREPULL_POD_SELECTOR,
];
/// Label selector of the pre-pull DaemonSets' pods.
pub const PREPULL_POD_SELECTOR: &str = "app.kubernetes.io/component=nvidia-driver-prepull";
/// The `app` label of the validator pods.
const VALIDATOR_APP: &str = "nvidia-operator-validator";

/// A driver, validator or pre-pull pod, reduced to what the upgrade reads of it (cached by
/// the controller's stores, `upgrade_pods`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpgradePod {
    pub name: String,
    pub node: Option<String>,
    /// For a driver pod: the uid of the DaemonSet owning it, and its revision hash.
    pub driver: Option<(String, Option<String>)>,
    /// For a driver pod: the driver config digest it runs with.
    pub digest: Option<String>,
    /// For a driver pod: the images it runs.
    pub images: BTreeSet<String>,
    /// For a pre-pull pod: the driver DaemonSet it pulls for, and what each image shows.
    pub prepull: Option<PrepullPod>,
    pub deleting: bool,
    pub ready: bool,
    pub failing: bool,
    pub created: i64,
    /// A validator pod (the other selector's).
    pub validator: bool,
}

impl UpgradePod {
    pub fn of(pod: &Pod) -> Self {
        let is_driver = pod
            .labels()
            .get(crate::operands::common::COMPONENT_LABEL)
            .is_some_and(|c| c == driver::COMPONENT);
        let owner = pod
            .owner_references()
            .iter()
            .find(|o| o.kind == "DaemonSet")
            .map(|o| o.uid.clone());
        UpgradePod {
            name: pod.name_any(),
            node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            driver: owner
                .filter(|_| is_driver)
                .map(|uid| (uid, pod.labels().get(REVISION_HASH_LABEL).cloned())),
            digest: pod
                .spec
                .as_ref()
                .filter(|_| is_driver)
                .and_then(driver::carried_config_digest)
                .map(str::to_owned),
            images: pod
                .spec
                .as_ref()
                .filter(|_| is_driver)
                .map(prepull::pod_images)
                .unwrap_or_default(),
            prepull: prepull::prepull_pod(pod),
            deleting: pod.metadata.deletion_timestamp.is_some(),
            ready: pod_ready(pod),
            failing: pod_failing(pod),
            created: created(pod),
            validator: pod
                .labels()
                .get(crate::operands::common::APP_LABEL)
                .map(String::as_str)
                == Some(VALIDATOR_APP),
        }
    }
}

/// The node's driver pod, if one of the driver DaemonSets owns it, and the images of its
/// DaemonSet's template it lacks (to be pulled before it is replaced). A pod of an outgoing
/// DaemonSet on a node the new variant's DaemonSets select is [`DriverRevision::Outgoing`].
fn driver_pod(
    pods: &[&UpgradePod],
    current: &BTreeMap<String, DesiredDriver>,
    node: &NodeView,
) -> Option<(DriverPod, BTreeSet<String>)> {
    pods.iter().find_map(|p| {
        let (owner, hash) = p.driver.as_ref()?;
        let desired = current.get(owner)?;
        let handover_to = machine::handover_to(desired, &node.labels).map(str::to_owned);
        let revision = if handover_to.is_some() {
            DriverRevision::Outgoing
        } else {
            machine::classify(hash.as_deref(), p.digest.as_deref(), desired)
        };
        let missing = prepull::missing_images(revision, &p.images, &desired.images);
        let pod = DriverPod {
            name: p.name.clone(),
            daemon_set: desired.daemon_set.clone(),
            revision,
            handover_to,
            ready: p.ready,
            failing: p.failing,
            created: p.created,
        };
        Some((pod, missing))
    })
}

/// The node's newest validator pod.
fn validator_pod(pods: &[&UpgradePod]) -> Option<ValidatorPod> {
    pods.iter()
        .filter(|p| p.driver.is_none() && p.prepull.is_none())
        .map(|p| ValidatorPod {
            name: p.name.clone(),
            ready: p.ready,
            failing: p.failing,
            created: p.created,
        })
        .max_by_key(|v| v.created)
}

/// Whether a node's step may depend on its cordon or readiness, which the metadata cache does
/// not hold: it is between states, waiting to start, failed, or about to need an upgrade.
fn needs_node_status(f: &NodeFacts) -> bool {
    let state = f.state.unwrap_or(UpgradeState::Unknown);
    match state {
        UpgradeState::Unknown | UpgradeState::Done => f.driver.as_ref().is_some_and(|d| {
            !d.current() || f.annotations.contains_key(machine::REQUESTED_ANNOTATION)
        }),
        _ => true,
    }
}

/// What one pass knows of each managed node, from the caches: `nodes` (labels and upgrade
/// annotations) and `pods`. Cordon and readiness are not known here ([`needs_node_status`]).
pub fn cached_facts(
    nodes: &[Arc<NodeView>],
    pods: &[Arc<UpgradePod>],
    current: &BTreeMap<String, DesiredDriver>,
    validator_expected: bool,
) -> Vec<NodeFacts> {
    // Each node's pods, found once (not a scan of every pod per node).
    let mut by_node: BTreeMap<&str, Vec<&UpgradePod>> = BTreeMap::new();
    for pod in pods.iter().filter(|p| !p.deleting) {
        if let Some(node) = pod.node.as_deref() {
            by_node.entry(node).or_default().push(pod);
        }
    }
    let none = Vec::new();
    nodes
        .iter()
        .filter(|n| n.label(GPU_PRESENT) == Some("true"))
        .filter_map(|node| {
            let on_node = by_node.get(node.name.as_str()).unwrap_or(&none);
            let (driver, missing) = driver_pod(on_node, current, node).unzip();
            let pulls: Vec<&PrepullPod> =
                on_node.iter().filter_map(|p| p.prepull.as_ref()).collect();
            let prepull = match (&driver, &missing) {
                (Some(d), Some(missing)) => prepull::node_state(&d.daemon_set, missing, &pulls),
                _ => prepull::Prepull::NotNeeded,
            };
            let state = node
                .label(STATE_LABEL)
                .map(|s| UpgradeState::parse(Some(s)));
            // Managed: a driver pod runs there, or its upgrade is under way (pod being replaced).
            if driver.is_none() && !state.is_some_and(UpgradeState::in_progress) {
                return None;
            }
            Some(NodeFacts {
                name: node.name.clone(),
                state,
                annotations: node.upgrade_annotations.clone(),
                skip: node.label(machine::SKIP_LABEL) == Some("true"),
                driver,
                validator: validator_pod(on_node),
                validator_expected,
                prepull,
                ..NodeFacts::default()
            })
        })
        .collect()
}

/// Completes `facts` from the live nodes: cordon and readiness, and labels and annotations as
/// they are now (the cache may not show the last pass's writes yet).
fn with_live(mut facts: Vec<NodeFacts>, live: &[Node]) -> Vec<NodeFacts> {
    let live: BTreeMap<&str, &Node> = live
        .iter()
        .filter_map(|n| Some((n.metadata.name.as_deref()?, n)))
        .collect();
    for f in &mut facts {
        let Some(node) = live.get(f.name.as_str()) else {
            continue;
        };
        f.state = node
            .labels()
            .get(STATE_LABEL)
            .map(|s| UpgradeState::parse(Some(s)));
        f.skip = node
            .labels()
            .get(machine::SKIP_LABEL)
            .is_some_and(|v| v == "true");
        f.annotations = node.annotations().clone();
        f.unschedulable = node
            .spec
            .as_ref()
            .and_then(|s| s.unschedulable)
            .unwrap_or(false);
        f.not_ready = !node_ready(node);
    }
    facts
}

/// One pass of the upgrade stage, each pool of driver nodes under its own policy. Reads the
/// caches; the GPU nodes are listed only when a node's step depends on its cordon or
/// readiness, and the ControllerRevisions (a few) only while a driver DaemonSet exists.
pub async fn reconcile(
    client: &Client,
    namespace: &str,
    policies: &Policies,
    daemon_sets: &BTreeMap<String, DaemonSet>,
    nodes: &[Arc<NodeView>],
    pods: &[Arc<UpgradePod>],
    recorder: &Recorder,
) -> Result<Report, kube::Error> {
    if !policies.enabled() {
        clear_labels(client, nodes).await;
        sync_prepulls(client, namespace, &BTreeSet::new(), daemon_sets).await?;
        return Ok(Report::default());
    }
    let drivers: Vec<&DaemonSet> = daemon_sets
        .values()
        .filter(|d| {
            d.labels()
                .get(crate::operands::common::COMPONENT_LABEL)
                .map(String::as_str)
                == Some(driver::COMPONENT)
        })
        .collect();
    let current = current_revisions(client, namespace, &drivers).await?;
    let validator_expected = daemon_sets.contains_key(validator::NAME);
    let mut facts = cached_facts(nodes, pods, &current, validator_expected);
    if facts.iter().any(needs_node_status) {
        let live = Api::<Node>::all(client.clone())
            .list(&ListParams::default().labels(&format!("{GPU_PRESENT}=true")))
            .await?
            .items;
        facts = with_live(facts, &live);
    }
    let (mut pools, manual) = partition(policies, nodes, facts);
    // A pool that upgrades by hand keeps no upgrade labels (as when upgrades are off).
    clear_labels(client, &manual).await;
    for pool in &mut pools {
        let policy = pool.policy.clone();
        for f in pool.nodes.iter_mut().filter(|f| {
            matches!(
                f.state,
                Some(
                    UpgradeState::WaitForJobsRequired
                        | UpgradeState::PodDeletionRequired
                        | UpgradeState::DrainRequired
                )
            )
        }) {
            node_pods(client, &f.name.clone(), &policy, &policies.runtime_class, f).await?;
        }
    }

    let now = k8s_openapi::jiff::Timestamp::now().as_second();
    let steps = machine::plan_pools(&pools, now);
    let summary = Summary::of_pools(&pools, &steps);
    let facts: Vec<&NodeFacts> = pools.iter().flat_map(|p| &p.nodes).collect();
    // Nodes are independent: their steps run side by side, so a fleet's first rollout (every
    // node labelled upgrade-done as its driver pod turns Ready) is not one patch at a time.
    let by_name: BTreeMap<&str, &NodeFacts> = facts.iter().map(|f| (f.name.as_str(), *f)).collect();
    futures::stream::iter(
        steps
            .iter()
            .filter_map(|(name, step)| Some((by_name.get(name.as_str())?, step))),
    )
    .for_each_concurrent(STEP_CONCURRENCY, |(f, step)| async move {
        if let Err(e) = run_step(client, namespace, f, step).await {
            tracing::warn!(node = %f.name, error = %e, "driver upgrade step failed; retrying on the next pass");
            return;
        }
        announce(recorder, f, step).await;
        announce_hold(recorder, f, step).await;
    })
    .await;
    let wanted = prepull::wanted(
        &pools
            .iter()
            .flat_map(|p| p.nodes.clone())
            .collect::<Vec<_>>(),
    );
    sync_prepulls(client, namespace, &wanted, daemon_sets).await?;
    Ok(Report {
        summary: Some(summary),
    })
}

/// A driver rollout as [`forecast_rollout`] foresees it.
pub struct Rollout {
    pub policy: machine::Policy,
    pub forecast: forecast::Forecast,
    /// The pre-pull DaemonSet that pulls the new images on every node before the first cordon,
    /// when the nodes lack them.
    pub pre_pull: Option<String>,
}

/// What the upgrade stage will do once the ClusterPolicy's driver DaemonSet `live` gets the
/// template of `next` (`gpu-operator plan`): each node of `live`'s pods as the stage will see
/// it then, forecast to the end of the rollout under the policy's upgrade rules
/// ([`machine::Policy`]). `None` when the policy does not upgrade automatically (the pods stay
/// until deleted: OnDelete). Reads the nodes, the driver and validator pods and each node's
/// pods; writes nothing.
pub async fn forecast_rollout(
    client: &Client,
    namespace: &str,
    spec: &ClusterPolicySpec,
    nodes: &[Arc<NodeView>],
    live: &DaemonSet,
    next: &DaemonSet,
    validator_expected: bool,
) -> Result<Option<Rollout>, kube::Error> {
    let policies = Policies::of(Some(spec), &[]);
    if !policies.enabled() {
        return Ok(None);
    }
    let Some(uid) = live.uid() else {
        return Ok(None);
    };
    let pods: Vec<Arc<UpgradePod>> = {
        let api = Api::<Pod>::namespaced(client.clone(), namespace);
        let mut pods = Vec::new();
        for selector in [COMPONENT_SELECTOR, "app=nvidia-operator-validator"] {
            pods.extend(
                api.list(&ListParams::default().labels(selector))
                    .await?
                    .items
                    .iter()
                    .map(|p| Arc::new(UpgradePod::of(p))),
            );
        }
        pods
    };
    let template = |ds: &DaemonSet| ds.spec.as_ref().map(|s| s.template.clone());
    let next_template = template(next);
    let next_spec = next_template.as_ref().and_then(|t| t.spec.as_ref());
    // A change of metadata or placement only leaves running pods as they are (decision 20):
    // the pods' revisions then count as the new one's metadata-only predecessors.
    let as_revision = |ds: &DaemonSet| json!({"spec": {"template": template(ds)}});
    let metadata_only: BTreeSet<String> =
        if machine::differs_only_in_metadata_or_placement(&as_revision(live), &as_revision(next)) {
            pods.iter()
                .filter_map(|p| p.driver.as_ref())
                .filter(|(owner, _)| *owner == uid)
                .filter_map(|(_, hash)| hash.clone())
                .collect()
        } else {
            BTreeSet::new()
        };
    let desired = DesiredDriver {
        daemon_set: live.name_any(),
        // No pod carries it yet: every pod is on an older revision.
        revision: "planned".to_owned(),
        digest: next_spec
            .and_then(driver::carried_config_digest)
            .map(str::to_owned),
        nvidia_digest: next_spec.map(crate::operands::nvidia_digest::digest),
        metadata_only,
        images: next_spec.map(prepull::pod_images).unwrap_or_default(),
        handover: None,
    };
    let current = BTreeMap::from([(uid, desired)]);
    let facts = cached_facts(nodes, &pods, &current, validator_expected);
    let live_nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default().labels(&format!("{GPU_PRESENT}=true")))
        .await?
        .items;
    let mut facts = with_live(facts, &live_nodes);
    // The pre-pull DaemonSet the stage will run first, where nodes lack the new images.
    let pre_pull = (!prepull::wanted(&facts).is_empty())
        .then(|| prepull::render(next))
        .flatten()
        .and_then(|ds| ds.metadata.name);
    for f in &mut facts {
        // The images are pulled before the first cordon (super::prepull): the forecast starts
        // from there.
        f.prepull = prepull::Prepull::NotNeeded;
    }
    let (mut pools, _) = partition(&policies, nodes, facts);
    let Some(pool) = pools.iter_mut().find(|p| p.name.is_empty()) else {
        return Ok(None);
    };
    for f in &mut pool.nodes {
        node_pods(
            client,
            &f.name.clone(),
            &pool.policy,
            &policies.runtime_class,
            f,
        )
        .await?;
    }
    let forecast = forecast::forecast(&pool.nodes, &pool.policy);
    Ok(Some(Rollout {
        policy: pool.policy.clone(),
        forecast,
        pre_pull,
    }))
}

/// The managed nodes grouped into the machine's pools, each with its policy resolved against
/// its own node count, and the nodes no automatic upgrade covers (their pool sets
/// `autoUpgrade: false`).
fn partition(
    policies: &Policies,
    nodes: &[Arc<NodeView>],
    facts: Vec<NodeFacts>,
) -> (Vec<Pool>, Vec<Arc<NodeView>>) {
    let views: BTreeMap<&str, &Arc<NodeView>> =
        nodes.iter().map(|n| (n.name.as_str(), n)).collect();
    let mut grouped: BTreeMap<&str, (&DriverUpgradePolicySpec, Vec<NodeFacts>)> = BTreeMap::new();
    let mut manual = Vec::new();
    for f in facts {
        let Some(view) = views.get(f.name.as_str()) else {
            continue;
        };
        match policies.for_node(view) {
            Some((pool, spec)) => grouped.entry(pool).or_insert((spec, Vec::new())).1.push(f),
            None => manual.push(Arc::clone(view)),
        }
    }
    let pools = grouped
        .into_iter()
        .map(|(name, (spec, nodes))| Pool {
            name: name.to_owned(),
            policy: Policy::from_spec(spec, nodes.len()),
            nodes,
        })
        .collect();
    (pools, manual)
}

fn created(pod: &Pod) -> i64 {
    pod.metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.as_second())
        .unwrap_or_default()
}

pub(crate) fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// A container (init or main) keeps exiting or cannot start.
fn pod_failing(pod: &Pod) -> bool {
    const FAILING: [&str; 4] = [
        "CrashLoopBackOff",
        "ErrImagePull",
        "ImagePullBackOff",
        "CreateContainerConfigError",
    ];
    let Some(status) = pod.status.as_ref() else {
        return false;
    };
    status.phase.as_deref() == Some("Failed")
        || status
            .init_container_statuses
            .iter()
            .flatten()
            .chain(status.container_statuses.iter().flatten())
            .filter_map(|c| c.state.as_ref()?.waiting.as_ref()?.reason.as_deref())
            .any(|reason| FAILING.contains(&reason))
}

fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// What each driver DaemonSet runs now, by the DaemonSet's uid: the hash of its newest
/// ControllerRevision (what NVIDIA compares the pods' `controller-revision-hash` with), the
/// driver config digest of its template, and its older revisions whose pod template differs
/// from the newest in labels or annotations only (a revision's `data` holds its whole template).
async fn current_revisions(
    client: &Client,
    namespace: &str,
    drivers: &[&DaemonSet],
) -> Result<BTreeMap<String, DesiredDriver>, kube::Error> {
    if drivers.is_empty() {
        return Ok(BTreeMap::new());
    }
    let revisions = Api::<ControllerRevision>::namespaced(client.clone(), namespace)
        .list(&ListParams::default().labels(COMPONENT_SELECTOR))
        .await?
        .items;
    let mut current = BTreeMap::new();
    for ds in drivers {
        let Some(uid) = ds.uid() else { continue };
        let owned: Vec<&ControllerRevision> = revisions
            .iter()
            .filter(|r| r.owner_references().iter().any(|o| o.uid == uid))
            .collect();
        let Some(newest) = owned.iter().max_by_key(|r| r.revision) else {
            continue;
        };
        let Some(hash) = newest.labels().get(REVISION_HASH_LABEL).cloned() else {
            continue;
        };
        let data = |r: &ControllerRevision| r.data.as_ref().map(|d| d.0.clone());
        let newest_data = data(newest);
        let metadata_only = owned
            .iter()
            .filter(|r| r.revision != newest.revision)
            .filter(|r| match (data(r), newest_data.as_ref()) {
                (Some(old), Some(new)) => machine::differs_only_in_metadata_or_placement(&old, new),
                _ => false,
            })
            .filter_map(|r| r.labels().get(REVISION_HASH_LABEL).cloned())
            .collect();
        let template = ds.spec.as_ref().and_then(|s| s.template.spec.as_ref());
        let images = template.map(prepull::pod_images).unwrap_or_default();
        let digest = template
            .and_then(driver::carried_config_digest)
            .map(str::to_owned);
        current.insert(
            uid,
            DesiredDriver {
                daemon_set: ds.name_any(),
                revision: hash,
                digest,
                nvidia_digest: template.map(crate::operands::nvidia_digest::digest),
                metadata_only,
                images,
                handover: driver_variant::successors(ds, drivers.iter().copied()),
            },
        );
    }
    Ok(current)
}

/// A pod that uses GPUs: it requests an `nvidia.com/*` resource, or runs with the nvidia
/// RuntimeClass (which gives it every GPU of the node without requesting one).
pub fn uses_gpus(pod: &Pod, runtime_class: &str) -> bool {
    let Some(spec) = pod.spec.as_ref() else {
        return false;
    };
    let requests = |c: &k8s_openapi::api::core::v1::Container| {
        c.resources.as_ref().is_some_and(|r| {
            r.limits
                .iter()
                .chain(r.requests.iter())
                .flat_map(|m| m.keys())
                .any(|k| k.starts_with("nvidia.com/"))
        })
    };
    spec.runtime_class_name.as_deref() == Some(runtime_class)
        || spec
            .containers
            .iter()
            .chain(spec.init_containers.iter().flatten())
            .any(requests)
}

fn owned_by_daemon_set(pod: &Pod) -> bool {
    pod.owner_references().iter().any(|o| o.kind == "DaemonSet")
}

fn terminal(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

fn pod_facts(pod: &Pod) -> PodFacts {
    PodFacts {
        namespace: pod.namespace().unwrap_or_default(),
        name: pod.name_any(),
        managed: pod
            .owner_references()
            .iter()
            .any(|o| o.controller == Some(true)),
        empty_dir: pod
            .spec
            .as_ref()
            .and_then(|s| s.volumes.as_ref())
            .is_some_and(|vs| vs.iter().any(|v| v.empty_dir.is_some())),
        terminating: pod.metadata.deletion_timestamp.is_some(),
    }
}

/// The node's pods for the eviction steps: jobs to wait for, GPU pods, pods to drain.
/// DaemonSet pods are never removed (they would come straight back, like `kubectl drain`).
async fn node_pods(
    client: &Client,
    node: &str,
    policy: &Policy,
    runtime_class: &str,
    facts: &mut NodeFacts,
) -> Result<(), kube::Error> {
    let api: Api<Pod> = Api::all(client.clone());
    let on_node = format!("spec.nodeName={node}");
    let list = |labels: Option<String>| {
        let mut params = ListParams::default().fields(&on_node);
        if let Some(labels) = labels {
            params = params.labels(&labels);
        }
        let api = api.clone();
        async move { api.list(&params).await.map(|l| l.items) }
    };
    let removable = |p: &&Pod| !owned_by_daemon_set(p) && !terminal(p);
    if let Some((selector, _)) = &policy.wait_for {
        facts.jobs_running = list(Some(selector.clone()))
            .await?
            .iter()
            .filter(|p| !terminal(p))
            .count();
    }
    facts.gpu_pods = list(None)
        .await?
        .iter()
        .filter(removable)
        .filter(|p| uses_gpus(p, runtime_class))
        .map(pod_facts)
        .collect();
    if let Some(drain) = &policy.drain {
        let skip = format!("{}!=true", machine::SKIP_DRAIN_POD_LABEL);
        let selector = match &drain.pod_selector {
            Some(s) => format!("{s},{skip}"),
            None => skip,
        };
        facts.drain_pods = list(Some(selector))
            .await?
            .iter()
            .filter(removable)
            .map(pod_facts)
            .collect();
    }
    Ok(())
}

/// Runs a step's actions, then writes the node's new state (and annotations) in one patch.
async fn run_step(
    client: &Client,
    namespace: &str,
    facts: &NodeFacts,
    step: &Step,
) -> Result<(), kube::Error> {
    let nodes: Api<Node> = Api::all(client.clone());
    let name = facts.name.clone();
    let mut annotations = serde_json::Map::new();
    let mut handed_over = None;
    if facts
        .annotations
        .get(machine::ENABLED_ANNOTATION)
        .is_none_or(|v| v != "true")
    {
        annotations.insert(machine::ENABLED_ANNOTATION.to_owned(), json!("true"));
    }
    for action in &step.actions {
        match action {
            Action::Cordon | Action::Uncordon => {
                let cordon = matches!(action, Action::Cordon);
                nodes
                    .patch(
                        &name,
                        &PatchParams::default(),
                        &Patch::Merge(json!({"spec": {"unschedulable": cordon}})),
                    )
                    .await?;
            }
            Action::Evict(pods) => {
                for key in pods {
                    let (ns, pod) = key.split_once('/').unwrap_or_default();
                    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
                    // The client retries a 429 (a PodDisruptionBudget refusing) with backoff
                    // for ever: one answer is all a pass needs, the next pass asks again.
                    let evicted = tokio::time::timeout(
                        EVICTION_WAIT,
                        api.evict(pod, &EvictParams::default()),
                    )
                    .await;
                    match evicted {
                        Ok(Ok(_)) => {
                            tracing::info!(node = %name, pod = %key, "evicted for the driver upgrade")
                        }
                        // Refused for now (429, or still retrying), or gone already (404).
                        Err(_) => {}
                        Ok(Err(kube::Error::Api(e))) if e.code == 429 || e.code == 404 => {}
                        Ok(Err(e)) => return Err(e),
                    }
                }
            }
            Action::DeleteDriverPod(pod) | Action::DeleteValidatorPod(pod) => {
                let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
                match api.delete(pod, &DeleteParams::default()).await {
                    Ok(_) => tracing::info!(node = %name, %pod, "deleted for the driver upgrade"),
                    Err(kube::Error::Api(e)) if e.code == 404 => {}
                    Err(e) => return Err(e),
                }
            }
            // Sent again while the old pod is still there: the patch is idempotent.
            Action::HandOver(variant) => handed_over = Some(variant.clone()),
            Action::Annotate(key, value) => {
                let value = value.as_ref().map_or(Value::Null, |v| json!(v));
                if facts
                    .annotations
                    .get(*key)
                    .map(|v| json!(v))
                    .unwrap_or(Value::Null)
                    != value
                {
                    annotations.insert((*key).to_owned(), value);
                }
            }
        }
    }
    let mut labels = serde_json::Map::new();
    if let Some(next) = step.next.filter(|n| Some(*n) != facts.state) {
        labels.insert(STATE_LABEL.to_owned(), json!(next.label()));
    }
    if let Some(variant) = &handed_over {
        tracing::info!(node = %name, %variant, "handed over to another driver variant");
        labels.insert(driver_variant::VARIANT_LABEL.to_owned(), json!(variant));
    }
    let mut patch = serde_json::Map::new();
    if !labels.is_empty() {
        patch.insert("labels".to_owned(), Value::Object(labels));
    }
    if !annotations.is_empty() {
        patch.insert("annotations".to_owned(), Value::Object(annotations));
    }
    if !patch.is_empty() {
        nodes
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": patch})),
            )
            .await?;
    }
    Ok(())
}

/// Events on the node: its upgrade started, finished or failed.
async fn announce(recorder: &Recorder, facts: &NodeFacts, step: &Step) {
    let from = facts.state.unwrap_or(UpgradeState::Unknown);
    let Some(to) = step.next.filter(|n| *n != from) else {
        return;
    };
    let (type_, reason, note) = match to {
        UpgradeState::CordonRequired => (
            EventType::Normal,
            "DriverUpgradeStarted",
            "driver upgrade started".to_owned(),
        ),
        UpgradeState::Done if from.in_progress() => (
            EventType::Normal,
            "DriverUpgradeDone",
            "driver upgraded".to_owned(),
        ),
        UpgradeState::Failed => (
            EventType::Warning,
            "DriverUpgradeFailed",
            format!(
                "driver upgrade failed: {}",
                step.failure.clone().unwrap_or_default()
            ),
        ),
        _ => return,
    };
    publish_node_event(recorder, &facts.name, type_, reason, "DriverUpgrade", note).await;
}

/// Events on the node when its upgrade is held for an image that cannot be pulled, and when the
/// hold is lifted (the held annotation appearing or going: once per transition).
async fn announce_hold(recorder: &Recorder, facts: &NodeFacts, step: &Step) {
    let was = facts.annotations.get(machine::HELD_ANNOTATION);
    let Some(now) = step.actions.iter().find_map(|a| match a {
        Action::Annotate(key, value) if *key == machine::HELD_ANNOTATION => Some(value.as_ref()),
        _ => None,
    }) else {
        return;
    };
    let (type_, reason, note) = match (now, &facts.prepull) {
        (Some(image), prepull::Prepull::Failed { reason, .. }) => (
            EventType::Warning,
            "DriverUpgradeHeld",
            format!(
                "driver upgrade held before the cordon: image {image} cannot be pulled \
                 ({reason}); the node keeps its running driver"
            ),
        ),
        (None, _) if was.is_some() => (
            EventType::Normal,
            "DriverUpgradeHoldLifted",
            "driver upgrade no longer held: the image that could not be pulled is no longer \
             wanted or is on the node now"
                .to_owned(),
        ),
        _ => return,
    };
    publish_node_event(recorder, &facts.name, type_, reason, "DriverUpgrade", note).await;
}

/// Brings the pre-pull DaemonSets in line with `wanted` (the driver DaemonSets, by name, whose
/// nodes lack their template's images): each rendered from its live driver DaemonSet in
/// `daemon_sets` and applied when it is not live as rendered; any other pre-pull DaemonSet is
/// deleted. Nothing is sent while they stand as rendered.
async fn sync_prepulls(
    client: &Client,
    namespace: &str,
    wanted: &BTreeSet<String>,
    daemon_sets: &BTreeMap<String, DaemonSet>,
) -> Result<(), kube::Error> {
    let sync = prepull::sync(wanted, daemon_sets);
    let api: Api<DaemonSet> = Api::namespaced(client.clone(), namespace);
    let params = PatchParams::apply(crate::model::MANAGER).force();
    for ds in &sync.apply {
        let name = ds.name_any();
        // k8s-openapi writes apiVersion and kind, as server-side apply needs.
        api.patch(&name, &params, &Patch::Apply(ds)).await?;
        tracing::info!(daemon_set = %name, "pre-pull DaemonSet applied for a driver rollout");
    }
    for name in &sync.delete {
        match api.delete(name, &DeleteParams::background()).await {
            Ok(_) => tracing::info!(daemon_set = %name, "pre-pull DaemonSet deleted"),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// An Event on node `node` (its note cut to the 1,024 bytes the API server takes); a failure to
/// publish is logged, never an error of the pass.
pub(crate) async fn publish_node_event(
    recorder: &Recorder,
    node: &str,
    type_: EventType,
    reason: &str,
    action: &str,
    note: String,
) {
    let event = Event {
        type_,
        reason: reason.to_owned(),
        note: Some(note.chars().take(1000).collect()),
        action: action.to_owned(),
        secondary: None,
    };
    if let Err(e) = recorder.publish(&event, &node_reference(node)).await {
        tracing::warn!(error = %e, "publishing event failed");
    }
}

/// The node an event is about, with the kubelet's convention for node events: the uid is the
/// node's name. `kubectl describe node` looks events up by the node's uid and by its name as
/// uid; an event without a uid matches neither.
fn node_reference(name: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".to_owned()),
        kind: Some("Node".to_owned()),
        name: Some(name.to_owned()),
        uid: Some(name.to_owned()),
        ..ObjectReference::default()
    }
}

/// Upgrades switched off: removes the state label and the machine's annotations from the
/// nodes that carry the label (NVIDIA clears them too). Cordons are left as they are.
async fn clear_labels(client: &Client, nodes: &[Arc<NodeView>]) {
    let api: Api<Node> = Api::all(client.clone());
    for node in nodes.iter().filter(|n| n.labels.contains_key(STATE_LABEL)) {
        let annotations: serde_json::Map<String, Value> = machine::NODE_ANNOTATIONS
            .iter()
            .map(|k| ((*k).to_owned(), Value::Null))
            .collect();
        let patch =
            json!({"metadata": {"labels": {STATE_LABEL: null}, "annotations": annotations}});
        if let Err(e) = api
            .patch(&node.name, &PatchParams::default(), &Patch::Merge(patch))
            .await
        {
            tracing::warn!(node = %node.name, error = %e, "removing the driver upgrade label failed");
        }
    }
}

#[cfg(test)]
mod cache_tests {
    use serde_json::json;

    use super::*;

    fn pod(name: &str, node: &str, labels: Value, ready: bool) -> Arc<UpgradePod> {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": labels, "creationTimestamp": "2026-11-27T08:00:00Z",
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet",
                    "name": "ds", "uid": "ds-uid", "controller": true}]},
            "spec": {"nodeName": node, "containers": []},
            "status": {"conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}
        }))
        .unwrap();
        Arc::new(UpgradePod::of(&pod))
    }

    fn driver_pod(node: &str, hash: &str) -> Arc<UpgradePod> {
        let labels = json!({crate::operands::common::COMPONENT_LABEL: driver::COMPONENT,
            REVISION_HASH_LABEL: hash});
        pod(&format!("driver-{node}"), node, labels, true)
    }

    fn gpu_node(name: &str, state: Option<&str>) -> Arc<NodeView> {
        let mut labels = BTreeMap::from([(GPU_PRESENT.to_owned(), "true".to_owned())]);
        if let Some(state) = state {
            labels.insert(STATE_LABEL.to_owned(), state.to_owned());
        }
        Arc::new(NodeView::from_labels(name, None, &labels))
    }

    #[test]
    fn node_events_name_the_node_as_kubectl_describe_finds_them() {
        let r = node_reference("gpu-1");
        assert_eq!(
            (r.kind.as_deref(), r.name.as_deref(), r.uid.as_deref()),
            (Some("Node"), Some("gpu-1"), Some("gpu-1"))
        );
    }

    #[test]
    fn the_pod_selectors_match_the_driver_and_validator_pods() {
        assert_eq!(
            UPGRADE_POD_SELECTORS,
            [
                format!(
                    "{}={}",
                    crate::operands::common::COMPONENT_LABEL,
                    driver::COMPONENT
                ),
                format!("{}={}", crate::operands::common::APP_LABEL, validator::NAME),
                format!(
                    "{}={}",
                    crate::operands::common::COMPONENT_LABEL,
                    prepull::COMPONENT
                ),
            ]
        );
    }

    fn driver_pod_running(node: &str, hash: &str, image: &str) -> Arc<UpgradePod> {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": format!("driver-{node}"), "creationTimestamp": "2026-11-27T08:00:00Z",
                "labels": {crate::operands::common::COMPONENT_LABEL: driver::COMPONENT,
                    REVISION_HASH_LABEL: hash},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet",
                    "name": "ds", "uid": "ds-uid", "controller": true}]},
            "spec": {"nodeName": node, "containers": [{"name": driver::MAIN_CONTAINER, "image": image}]},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap();
        Arc::new(UpgradePod::of(&pod))
    }

    fn prepull_pod(node: &str, image: &str, state: Value) -> Arc<UpgradePod> {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": format!("prepull-{node}"), "creationTimestamp": "2026-11-27T09:00:00Z",
                "labels": {crate::operands::common::COMPONENT_LABEL: prepull::COMPONENT},
                "annotations": {prepull::SHADOWS_ANNOTATION: "nvidia-driver-daemonset"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet",
                    "name": "pp", "uid": "pp-uid", "controller": true}]},
            "spec": {"nodeName": node, "containers": [{"name": "pull-0", "image": image}]},
            "status": {"containerStatuses": [{"name": "pull-0", "image": image, "imageID": "",
                "ready": false, "restartCount": 0, "state": state}]}
        }))
        .unwrap();
        Arc::new(UpgradePod::of(&pod))
    }

    #[test]
    fn a_cached_pre_pull_pod_holds_its_node_on_a_pull_error_and_frees_it_once_started() {
        const OLD: &str = "nvcr.io/nvidia/driver:595.91.07-ubuntu22.04";
        const NEW: &str = "nvcr.io/nvidia/driver:600.10.01-ubuntu22.04";
        let mut current = desired("new");
        current.get_mut("ds-uid").unwrap().images = BTreeSet::from([NEW.to_owned()]);
        let nodes = [
            gpu_node("gpu-1", Some("upgrade-required")),
            gpu_node("gpu-2", Some("upgrade-required")),
            gpu_node("gpu-3", Some("upgrade-required")),
        ];
        let failing = json!({"waiting": {"reason": "ErrImagePull", "message": "not found"}});
        let started = json!({"running": {"startedAt": "2026-11-27T09:00:05Z"}});
        let pods = [
            driver_pod_running("gpu-1", "old", OLD),
            driver_pod_running("gpu-2", "old", OLD),
            driver_pod_running("gpu-3", "old", OLD),
            prepull_pod("gpu-1", NEW, failing),
            prepull_pod("gpu-2", NEW, started),
        ];
        let facts = cached_facts(&nodes, &pods, &current, true);
        let by_node: BTreeMap<&str, &NodeFacts> =
            facts.iter().map(|f| (f.name.as_str(), f)).collect();
        assert_eq!(
            by_node["gpu-1"].prepull,
            prepull::Prepull::Failed {
                image: NEW.to_owned(),
                reason: "ErrImagePull: not found".to_owned()
            }
        );
        assert_eq!(by_node["gpu-2"].prepull, prepull::Prepull::Pulled);
        assert_eq!(
            by_node["gpu-3"].prepull,
            prepull::Prepull::Pulling(BTreeSet::from([NEW.to_owned()])),
            "no pre-pull pod there yet"
        );
        assert!(
            facts.iter().all(|f| f.validator.is_none()),
            "a pre-pull pod is no validator"
        );
        assert_eq!(
            prepull::wanted(&facts),
            BTreeSet::from(["nvidia-driver-daemonset".to_owned()])
        );
    }

    #[test]
    fn a_cached_pod_keeps_its_owner_revision_node_and_readiness() {
        let d = driver_pod("gpu-1", "abc");
        assert_eq!(
            d.driver,
            Some(("ds-uid".to_owned(), Some("abc".to_owned())))
        );
        assert_eq!(d.node.as_deref(), Some("gpu-1"));
        assert!(d.ready && !d.failing && !d.deleting);
        let v = pod(
            "validator-x",
            "gpu-1",
            json!({"app": validator::NAME}),
            false,
        );
        assert_eq!(v.driver, None, "a validator pod is not a driver pod");
        assert!(!v.ready);
    }

    fn desired(revision: &str) -> BTreeMap<String, DesiredDriver> {
        BTreeMap::from([(
            "ds-uid".to_owned(),
            DesiredDriver {
                daemon_set: "nvidia-driver-daemonset".to_owned(),
                revision: revision.to_owned(),
                ..DesiredDriver::default()
            },
        )])
    }

    #[test]
    fn the_first_rollout_is_planned_from_the_caches_without_reading_the_nodes() {
        let current = desired("new");
        let nodes = [
            gpu_node("gpu-1", None),
            gpu_node("gpu-2", Some("upgrade-done")),
            gpu_node("gpu-3", None),
            Arc::new(NodeView::from_labels("cpu-1", None, &BTreeMap::new())),
        ];
        let pods = [
            driver_pod("gpu-1", "new"),
            driver_pod("gpu-2", "new"),
            driver_pod("cpu-1", "new"),
        ];
        let facts = cached_facts(&nodes, &pods, &current, true);
        let names: Vec<&str> = facts.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            ["gpu-1", "gpu-2"],
            "gpu-3 has no driver pod yet; cpu-1 no GPU"
        );
        assert!(!facts.iter().any(needs_node_status));
        let steps = machine::plan(&facts, &Policy::from_spec(&Default::default(), 2), 0);
        assert_eq!(steps[0].1.next, Some(UpgradeState::Done));
    }

    #[test]
    fn a_cached_driver_pod_with_the_templates_digest_on_an_old_revision_is_restart_only() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "driver-gpu-1", "creationTimestamp": "2026-11-27T08:00:00Z",
                "labels": {crate::operands::common::COMPONENT_LABEL: driver::COMPONENT,
                    REVISION_HASH_LABEL: "old"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet",
                    "name": "ds", "uid": "ds-uid", "controller": true}]},
            "spec": {"nodeName": "gpu-1", "containers": [{"name": driver::MAIN_CONTAINER,
                "env": [{"name": driver::CONFIG_DIGEST_ENV, "value": "d1"}]}]}
        }))
        .unwrap();
        let pod = Arc::new(UpgradePod::of(&pod));
        assert_eq!(pod.digest.as_deref(), Some("d1"));
        let mut current = desired("new");
        let classified = |current: &BTreeMap<String, DesiredDriver>| {
            cached_facts(
                &[gpu_node("gpu-1", Some("upgrade-done"))],
                std::slice::from_ref(&pod),
                current,
                true,
            )[0]
            .driver
            .clone()
            .unwrap()
            .revision
        };
        assert_eq!(classified(&current), machine::DriverRevision::Outdated);
        current.get_mut("ds-uid").unwrap().digest = Some("d1".to_owned());
        assert_eq!(classified(&current), machine::DriverRevision::RestartOnly);
        current
            .get_mut("ds-uid")
            .unwrap()
            .metadata_only
            .insert("old".to_owned());
        assert_eq!(classified(&current), machine::DriverRevision::OlderMetadata);
    }

    #[test]
    fn an_out_of_date_driver_or_a_node_between_states_needs_the_live_node() {
        let current = desired("new");
        let facts = cached_facts(
            &[gpu_node("gpu-1", Some("upgrade-done"))],
            &[driver_pod("gpu-1", "old")],
            &current,
            true,
        );
        assert!(
            needs_node_status(&facts[0]),
            "its upgrade is about to start"
        );
        let facts = cached_facts(
            &[gpu_node("gpu-1", Some("pod-restart-required"))],
            &[],
            &current,
            true,
        );
        assert_eq!(
            facts.len(),
            1,
            "a node between states is managed without its pod"
        );
        assert!(needs_node_status(&facts[0]));
    }
}

#[cfg(test)]
mod quiet_tests {
    use serde_json::json;

    use super::*;

    fn driver(updated: i32, available: i32) -> BTreeMap<String, DaemonSet> {
        let ds: DaemonSet = serde_json::from_value(json!({
            "metadata": {"name": "nvidia-driver-daemonset", "generation": 1,
                "labels": {crate::operands::common::COMPONENT_LABEL: driver::COMPONENT}},
            "status": {"observedGeneration": 1, "desiredNumberScheduled": 2,
                "currentNumberScheduled": 2, "numberMisscheduled": 0, "numberReady": available,
                "updatedNumberScheduled": updated, "numberAvailable": available}
        }))
        .unwrap();
        BTreeMap::from([("nvidia-driver-daemonset".to_owned(), ds)])
    }

    fn node(state: Option<&str>) -> Arc<NodeView> {
        let mut labels =
            BTreeMap::from([(crate::nodes::DEPLOY_DRIVER.to_owned(), "true".to_owned())]);
        if let Some(state) = state {
            labels.insert(STATE_LABEL.to_owned(), state.to_owned());
        }
        Arc::new(NodeView::from_labels("n", None, &labels))
    }

    fn on() -> Policies {
        Policies {
            own: Some(DriverUpgradePolicySpec {
                auto_upgrade: Some(true),
                ..DriverUpgradePolicySpec::default()
            }),
            ..Policies::default()
        }
    }

    #[test]
    fn the_upgrade_stage_is_quiet_only_when_every_driver_node_is_done_and_current() {
        let done = [node(Some("upgrade-done")), node(Some("upgrade-done"))];
        assert!(quiet(&driver(2, 2), &done, &on()));
        assert!(
            !quiet(&driver(1, 2), &done, &on()),
            "a pod on an old revision"
        );
        assert!(
            !quiet(&driver(2, 1), &done, &on()),
            "a driver pod not available"
        );
        assert!(!quiet(
            &driver(2, 2),
            &[node(Some("upgrade-done")), node(None)],
            &on()
        ));
        assert!(!quiet(
            &driver(2, 2),
            &[node(Some("upgrade-done")), node(Some("upgrade-required"))],
            &on()
        ));
        // A node whose pool upgrades by hand is never labelled done: it does not count.
        assert!(quiet(
            &driver(2, 2),
            &[node(Some("upgrade-done")), node(None)],
            &Policies::default()
        ));
        // A pre-pull DaemonSet left from the rollout: the stage runs to delete it.
        let mut with_prepull = driver(2, 2);
        let template = with_prepull["nvidia-driver-daemonset"].clone();
        let mut template = template;
        template.spec = Some(
            serde_json::from_value(json!({
                "selector": {}, "template": {"spec": {"containers": [
                    {"name": "nvidia-driver-ctr", "image": "nvcr.io/nvidia/driver:1-ubuntu22.04"}]}}
            }))
            .unwrap(),
        );
        let pre = prepull::render(&template).unwrap();
        with_prepull.insert(pre.name_any(), pre);
        assert!(!quiet(&with_prepull, &done, &on()));
    }
}

#[cfg(test)]
mod policies_tests {
    use serde_json::json;

    use super::*;

    fn nvidia_driver(name: &str, spec: Value) -> NVIDIADriver {
        serde_json::from_value(json!({"apiVersion": "nvidia.com/v1alpha1",
            "kind": "NVIDIADriver", "metadata": {"name": name}, "spec": spec}))
        .unwrap()
    }

    fn gpu_node(name: &str, pool: Option<&str>) -> Arc<NodeView> {
        let mut labels = BTreeMap::from([(GPU_PRESENT.to_owned(), "true".to_owned())]);
        if let Some(pool) = pool {
            labels.insert(DRIVER_POOL.to_owned(), pool.to_owned());
        }
        Arc::new(NodeView::from_labels(name, None, &labels))
    }

    fn facts(name: &str) -> NodeFacts {
        NodeFacts {
            name: name.to_owned(),
            ..NodeFacts::default()
        }
    }

    #[test]
    fn nodes_are_grouped_by_their_pool_each_with_its_policy_and_manual_pools_left_out() {
        let spec: ClusterPolicySpec = serde_json::from_value(json!({"driver": {
            "useNvidiaDriverCRD": true,
            "upgradePolicy": {"autoUpgrade": true, "maxParallelUpgrades": 5}
        }}))
        .unwrap();
        let drivers = [
            nvidia_driver("a", json!({"upgradePolicy": {"maxParallelUpgrades": 1}})),
            nvidia_driver("b", json!({})),
            nvidia_driver("c", json!({"upgradePolicy": {"autoUpgrade": false}})),
        ];
        let policies = Policies::of(Some(&spec), &drivers);
        assert!(policies.enabled());
        let nodes = [
            gpu_node("own-0", None),
            gpu_node("a-0", Some("a")),
            gpu_node("a-1", Some("a")),
            gpu_node("b-0", Some("b")),
            gpu_node("c-0", Some("c")),
        ];
        let all = nodes.iter().map(|n| facts(&n.name)).collect();
        let (pools, manual) = partition(&policies, &nodes, all);
        let by_name: BTreeMap<&str, &Pool> = pools.iter().map(|p| (p.name.as_str(), p)).collect();
        assert_eq!(by_name["a"].policy.max_parallel, 1, "its own");
        assert_eq!(by_name["a"].nodes.len(), 2);
        assert_eq!(by_name["b"].policy.max_parallel, 5, "the ClusterPolicy's");
        assert_eq!(by_name[""].nodes[0].name, "own-0");
        assert!(!by_name.contains_key("c"));
        assert_eq!(
            manual.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(),
            ["c-0"]
        );

        // No ClusterPolicy (a GPUCluster install): pools without a policy get NVIDIA's
        // defaults, automatic upgrades on.
        let alone = Policies::of(None, &drivers[1..2]);
        assert!(alone.enabled());
        assert_eq!(alone.own, None);
        // A ClusterPolicy without useNvidiaDriverCRD: pools are not its concern.
        let plain: ClusterPolicySpec = serde_json::from_value(json!({})).unwrap();
        assert!(Policies::of(Some(&plain), &drivers).pools.is_empty());
    }
}
