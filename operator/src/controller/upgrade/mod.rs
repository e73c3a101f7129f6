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

pub mod machine;
#[cfg(test)]
mod machine_tests;

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{ControllerRevision, DaemonSet};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, EvictParams, ListParams, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Client, Resource, ResourceExt};
use serde_json::{Value, json};

use self::machine::{
    Action, DriverPod, NodeFacts, PodFacts, Policy, STATE_LABEL, Step, Summary, UpgradeState,
    ValidatorPod,
};
use crate::api::{ClusterPolicySpec, Component};
use crate::metrics::UpgradeCounts;
use crate::nodes::{GPU_PRESENT, NodeView};
use crate::operands::{driver, validator};

/// `app.kubernetes.io/component` of the driver DaemonSets and their pods.
const COMPONENT_SELECTOR: &str = "app.kubernetes.io/component=nvidia-driver";
const REVISION_HASH_LABEL: &str = "controller-revision-hash";
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
/// `upgrade-done`. Then the stage's reads (driver and validator pods, GPU nodes, revisions: a
/// thousand-node fleet's worth each) would find nothing to do.
pub fn quiet(daemon_sets: &BTreeMap<String, DaemonSet>, nodes: &[NodeView]) -> bool {
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
    drivers_settled
        && nodes
            .iter()
            .filter(|n| n.label(crate::nodes::DEPLOY_DRIVER) == Some("true"))
            .all(|n| n.label(STATE_LABEL) == Some(UpgradeState::Done.label()))
}

/// Whether the policy asks for automatic upgrades of a driver it deploys itself.
pub fn enabled(spec: &ClusterPolicySpec) -> bool {
    let Some(driver) = spec.driver.as_ref() else {
        return false;
    };
    spec.is_enabled(Component::Driver)
        && driver
            .upgrade_policy
            .as_ref()
            .and_then(|u| u.auto_upgrade)
            .unwrap_or(false)
}

/// One pass of the upgrade stage.
pub async fn reconcile(
    client: &Client,
    namespace: &str,
    spec: &ClusterPolicySpec,
    daemon_sets: &BTreeMap<String, DaemonSet>,
    nodes: &[NodeView],
    recorder: &Recorder,
) -> Result<Report, kube::Error> {
    if !enabled(spec) {
        clear_labels(client, nodes).await;
        return Ok(Report::default());
    }
    let upgrade_policy = spec
        .driver
        .as_ref()
        .and_then(|d| d.upgrade_policy.clone())
        .unwrap_or_default();
    let runtime_class = spec
        .operator
        .as_ref()
        .map(|o| o.runtime_class().to_owned())
        .unwrap_or_else(|| "nvidia".to_owned());

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
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let driver_pods = pods
        .list(&ListParams::default().labels(COMPONENT_SELECTOR))
        .await?
        .items;
    let validator_pods = pods
        .list(&ListParams::default().labels(&format!("app={}", validator::NAME)))
        .await?
        .items;
    let validator_expected = daemon_sets.contains_key(validator::NAME);
    let node_api: Api<Node> = Api::all(client.clone());
    let live_nodes = node_api
        .list(&ListParams::default().labels(&format!("{GPU_PRESENT}=true")))
        .await?
        .items;

    let mut facts = Vec::new();
    for node in &live_nodes {
        let name = node.name_any();
        let driver_pod = driver_pods
            .iter()
            .filter(|p| on_node(p, &name) && p.metadata.deletion_timestamp.is_none())
            .find_map(|p| driver_pod_facts(p, &current));
        let state = node.labels().get(STATE_LABEL).map(String::as_str);
        let state = state.map(|s| UpgradeState::parse(Some(s)));
        // Managed: a driver pod runs there, or its upgrade is under way (pod being replaced).
        if driver_pod.is_none() && !state.is_some_and(UpgradeState::in_progress) {
            continue;
        }
        let validator = validator_pods
            .iter()
            .filter(|p| on_node(p, &name) && p.metadata.deletion_timestamp.is_none())
            .map(|p| ValidatorPod {
                name: p.name_any(),
                ready: pod_ready(p),
                failing: pod_failing(p),
                created: created(p),
            })
            .max_by_key(|v| v.created);
        let mut f = NodeFacts {
            name: name.clone(),
            state,
            unschedulable: node
                .spec
                .as_ref()
                .and_then(|s| s.unschedulable)
                .unwrap_or(false),
            not_ready: !node_ready(node),
            annotations: node.annotations().clone(),
            skip: node
                .labels()
                .get(machine::SKIP_LABEL)
                .is_some_and(|v| v == "true"),
            driver: driver_pod,
            validator,
            validator_expected,
            ..NodeFacts::default()
        };
        if matches!(
            f.state,
            Some(
                UpgradeState::WaitForJobsRequired
                    | UpgradeState::PodDeletionRequired
                    | UpgradeState::DrainRequired
            )
        ) {
            let policy = Policy::from_spec(&upgrade_policy, 1);
            node_pods(client, &name, &policy, &runtime_class, &mut f).await?;
        }
        facts.push(f);
    }

    let policy = Policy::from_spec(&upgrade_policy, facts.len());
    let now = k8s_openapi::jiff::Timestamp::now().as_second();
    let steps = machine::plan(&facts, &policy, now);
    let summary = Summary::of(&facts, &steps, &policy);
    for (name, step) in &steps {
        let Some(node) = live_nodes.iter().find(|n| n.name_any() == *name) else {
            continue;
        };
        let Some(f) = facts.iter().find(|f| f.name == *name) else {
            continue;
        };
        if let Err(e) = run_step(client, namespace, node, f, step).await {
            tracing::warn!(node = %name, error = %e, "driver upgrade step failed; retrying on the next pass");
            continue;
        }
        announce(recorder, node, f, step).await;
    }
    Ok(Report {
        summary: Some(summary),
    })
}

fn on_node(pod: &Pod, node: &str) -> bool {
    pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
}

fn created(pod: &Pod) -> i64 {
    pod.metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.as_second())
        .unwrap_or_default()
}

fn pod_ready(pod: &Pod) -> bool {
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

/// Each driver DaemonSet's current revision hash, by the DaemonSet's uid: the hash of its
/// newest ControllerRevision (what NVIDIA compares the pods' `controller-revision-hash` with).
async fn current_revisions(
    client: &Client,
    namespace: &str,
    drivers: &[&DaemonSet],
) -> Result<BTreeMap<String, String>, kube::Error> {
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
        let newest = revisions
            .iter()
            .filter(|r| r.owner_references().iter().any(|o| o.uid == uid))
            .max_by_key(|r| r.revision);
        if let Some(hash) = newest.and_then(|r| r.labels().get(REVISION_HASH_LABEL).cloned()) {
            current.insert(uid, hash);
        }
    }
    Ok(current)
}

/// The node's driver pod, if one of the driver DaemonSets owns it.
fn driver_pod_facts(pod: &Pod, current: &BTreeMap<String, String>) -> Option<DriverPod> {
    let owner = pod
        .owner_references()
        .iter()
        .find(|o| o.kind == "DaemonSet")?;
    let hash = current.get(&owner.uid)?;
    Some(DriverPod {
        name: pod.name_any(),
        current: pod.labels().get(REVISION_HASH_LABEL) == Some(hash),
        ready: pod_ready(pod),
        failing: pod_failing(pod),
        created: created(pod),
    })
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
    node: &Node,
    facts: &NodeFacts,
    step: &Step,
) -> Result<(), kube::Error> {
    let nodes: Api<Node> = Api::all(client.clone());
    let name = node.name_any();
    let mut annotations = serde_json::Map::new();
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
    let mut patch = serde_json::Map::new();
    if let Some(next) = step.next.filter(|n| Some(*n) != facts.state) {
        patch.insert("labels".to_owned(), json!({STATE_LABEL: next.label()}));
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
async fn announce(recorder: &Recorder, node: &Node, facts: &NodeFacts, step: &Step) {
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
    let event = Event {
        type_,
        reason: reason.to_owned(),
        note: Some(note.chars().take(1000).collect()),
        action: "DriverUpgrade".to_owned(),
        secondary: None,
    };
    if let Err(e) = recorder.publish(&event, &node.object_ref(&())).await {
        tracing::warn!(error = %e, "publishing event failed");
    }
}

/// Upgrades switched off: removes the state label and the machine's annotations from the
/// nodes that carry the label (NVIDIA clears them too). Cordons are left as they are.
async fn clear_labels(client: &Client, nodes: &[NodeView]) {
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

    fn node(state: Option<&str>) -> NodeView {
        let mut labels =
            BTreeMap::from([(crate::nodes::DEPLOY_DRIVER.to_owned(), "true".to_owned())]);
        if let Some(state) = state {
            labels.insert(STATE_LABEL.to_owned(), state.to_owned());
        }
        NodeView::from_labels("n", None, &labels)
    }

    #[test]
    fn the_upgrade_stage_is_quiet_only_when_every_driver_node_is_done_and_current() {
        let done = [node(Some("upgrade-done")), node(Some("upgrade-done"))];
        assert!(quiet(&driver(2, 2), &done));
        assert!(!quiet(&driver(1, 2), &done), "a pod on an old revision");
        assert!(!quiet(&driver(2, 1), &done), "a driver pod not available");
        assert!(!quiet(
            &driver(2, 2),
            &[node(Some("upgrade-done")), node(None)]
        ));
        assert!(!quiet(
            &driver(2, 2),
            &[node(Some("upgrade-done")), node(Some("upgrade-required"))]
        ));
    }
}
