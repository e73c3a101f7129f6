//! GPU readiness stage of the ClusterPolicy pass (IO): takes startup taints off nodes whose GPUs
//! are ready, quarantines nodes whose GPUs went missing, restarts their device plugin and lifts
//! the quarantine again (`spec.gpuReadiness`; every decision is in crate::gpu_readiness).
//!
//! - Reads nothing while no node carries the startup taint, an unhealthy mark or our record: the
//!   node cache (taints, advertised GPUs) and the validator pods' cache say so.
//! - Each node write reads the node first and replaces its taint list under that read's
//!   `resourceVersion`; a conflict is retried on a later pass.
//! - Every step is an Event on the node; the breaker's opening is one on the policy.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::events::EventType;
use serde_json::Value;

use crate::api::ClusterPolicy;
use crate::controller::Deps;
use crate::controller::upgrade::{UpgradePod, publish_node_event};
use crate::gpu_readiness::{
    self as decide, Action, Lift, NodeState, QUARANTINE_EFFECT, QUARANTINE_TAINT, Record,
    Validator, Waiting,
};
use crate::nodes::NodeView;

/// Nodes written at once.
const CONCURRENCY: usize = 16;
/// The device plugin's pods (NVIDIA's `app` label).
const DEVICE_PLUGIN_SELECTOR: &str = "app=nvidia-device-plugin-daemonset";

/// What the stage remembers between passes.
#[derive(Default)]
pub struct Memory {
    /// Since when each node has been unhealthy (Unix seconds).
    unhealthy_since: BTreeMap<String, i64>,
    /// Whether the breaker held on the last pass (its Event goes out on the transition).
    breaker_held: bool,
}

/// What the stage found, for status, metrics and the requeue.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Nodes keeping their startup taint, with the step each waits on.
    pub waiting: Waiting,
    /// Status lines: quarantined nodes and the breaker.
    pub warnings: Vec<String>,
    pub quarantined: usize,
    pub breaker_held: bool,
    /// When a grace period ends or a restart is due.
    pub next_check: Option<Instant>,
}

impl Report {
    pub fn note(&self) -> Option<String> {
        decide::waiting_note(&self.waiting)
    }
}

/// The validator of each node, from the validator pods' cache: the newest pod not being deleted.
fn validators(pods: &[Arc<UpgradePod>]) -> BTreeMap<String, Validator> {
    let mut newest: BTreeMap<String, &UpgradePod> = BTreeMap::new();
    for pod in pods.iter().filter(|p| p.validator && !p.deleting) {
        let Some(node) = pod.node.as_ref() else {
            continue;
        };
        if newest.get(node).is_none_or(|p| p.created <= pod.created) {
            newest.insert(node.clone(), pod);
        }
    }
    newest
        .into_iter()
        .map(|(node, pod)| {
            let state = if pod.failing {
                Validator::Failing
            } else if pod.ready {
                Validator::Ready
            } else {
                Validator::Starting
            };
            (node, state)
        })
        .collect()
}

fn unix_now() -> i64 {
    k8s_openapi::jiff::Timestamp::now().as_second()
}

/// One pass of the stage.
pub async fn readiness(
    policy: &ClusterPolicy,
    deps: &Deps,
    memory: &mut Memory,
    nodes: &[Arc<NodeView>],
) -> Report {
    let spec = policy.spec.gpu_readiness.as_ref();
    let startup_taint = spec.and_then(|s| s.startup_taint.as_ref());
    let quarantine = spec.and_then(|s| s.quarantine());
    let has_record = nodes.iter().any(|n| n.readiness.quarantine.is_some());
    if startup_taint.is_none() && quarantine.is_none() && !has_record {
        memory.unhealthy_since.clear();
        memory.breaker_held = false;
        deps.metrics.observe_readiness([], 0, false);
        return Report::default();
    }
    let validators = validators(&deps.stores.upgrade_pods.snapshot());
    let validator = |n: &NodeView| {
        validators
            .get(&n.name)
            .copied()
            .unwrap_or(Validator::Missing)
    };
    let now = unix_now();
    let mut report = Report::default();

    // Startup taints.
    let mut lifts = Vec::new();
    if let Some(taint) = startup_taint {
        report.waiting.key = taint.key.clone();
        for node in nodes {
            match decide::startup(node, validator(node), taint) {
                Some(Ok(why)) => lifts.push((node.name.clone(), why)),
                Some(Err(wait)) => report.waiting.nodes.push((node.name.clone(), wait)),
                None => {}
            }
        }
    }

    // The quarantine.
    let starting = |n: &NodeView| {
        startup_taint.is_some_and(|t| n.readiness.has_taint(&t.key, t.effect().as_str()))
    };
    let judged: Vec<(&NodeView, decide::Health)> = nodes
        .iter()
        .filter(|n| n.is_gpu_node() || n.readiness.quarantine.is_some())
        .map(|n| (n.as_ref(), decide::health(n, validator(n), starting(n))))
        .collect();
    decide::track_unhealthy(
        &mut memory.unhealthy_since,
        judged.iter().map(|(n, h)| (n.name.as_str(), h)),
        now,
    );
    let states: Vec<NodeState> = judged
        .into_iter()
        .map(|(n, health)| NodeState {
            name: n.name.clone(),
            health,
            unhealthy_since: memory.unhealthy_since.get(&n.name).copied(),
            record: Record::of(n),
            tainted: n.readiness.has_taint(QUARANTINE_TAINT, QUARANTINE_EFFECT),
        })
        .collect();
    let plan = decide::plan(&states, quarantine, now);
    report.warnings = decide::quarantine_lines(&states, plan.breaker.as_ref());
    report.quarantined = states
        .iter()
        .filter(|s| s.record.is_some() && s.tainted)
        .count();
    report.breaker_held = plan.breaker.is_some();
    report.next_check = plan
        .next_check
        .map(|t| Instant::now() + Duration::from_secs(u64::try_from(t - now).unwrap_or(0)));
    if report.breaker_held && !memory.breaker_held {
        super::status::publish(
            deps,
            policy,
            EventType::Warning,
            "GpuQuarantineHeld",
            report.warnings.last().cloned().unwrap_or_default(),
        )
        .await;
    }
    memory.breaker_held = report.breaker_held;
    deps.metrics.observe_readiness(
        report.waiting.nodes.iter().map(|(_, w)| w.step()),
        report.quarantined,
        report.breaker_held,
    );

    if !super::still_in_force(deps, policy) {
        return report;
    }
    let api: Api<Node> = Api::all(deps.client.clone());
    let pods: Api<Pod> = Api::namespaced(deps.client.clone(), &deps.settings.namespace);
    let work = lifts
        .into_iter()
        .map(|(name, why)| (name, Work::Startup(why)))
        .chain(
            plan.actions
                .into_iter()
                .map(|(name, action)| (name, Work::Quarantine(action))),
        );
    let taint = startup_taint.cloned();
    let done: Vec<(String, Work, Result<bool, kube::Error>)> =
        futures::stream::iter(work.map(|(name, work): (String, Work)| {
            let (api, pods, taint) = (api.clone(), pods.clone(), taint.clone());
            async move {
                let result = act(&api, &pods, &name, &work, taint.as_ref()).await;
                (name, work, result)
            }
        }))
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    for (name, work, result) in done {
        match result {
            Ok(true) => announce(deps, &name, &work).await,
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(node = %name, error = %e, "gpu readiness: node step failed; retried on a later pass");
                // Looked at again soon: the step is still due.
                let soon = Instant::now() + Duration::from_secs(1);
                report.next_check = Some(report.next_check.map_or(soon, |c| c.min(soon)));
            }
        }
    }
    report
}

/// A step on one node.
enum Work {
    Startup(Lift),
    Quarantine(Action),
}

/// Runs `work` on node `name`; `Ok(false)` when there was nothing left to do (the node is gone,
/// the taint already off).
async fn act(
    api: &Api<Node>,
    pods: &Api<Pod>,
    name: &str,
    work: &Work,
    startup_taint: Option<&crate::api::StartupTaintSpec>,
) -> Result<bool, kube::Error> {
    let patch_with = |patch: Value| async move {
        match api
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => Ok(true),
            // A newer version of the node: the next pass reads it again.
            Err(kube::Error::Api(e)) if e.code == 409 || e.code == 404 => Ok(false),
            Err(e) => Err(e),
        }
    };
    if let Work::Quarantine(Action::RestartPlugin(record)) = work {
        let listed = pods
            .list(
                &ListParams::default()
                    .labels(DEVICE_PLUGIN_SELECTOR)
                    .fields(&format!("spec.nodeName={name}")),
            )
            .await?;
        for pod in listed
            .items
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
        {
            let pod_name = pod.metadata.name.as_deref().unwrap_or_default();
            match pods.delete(pod_name, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e),
            }
        }
        return patch_with(decide::record_patch(record)).await;
    }
    let Some(node) = api.get_opt(name).await? else {
        return Ok(false);
    };
    let patch = match work {
        Work::Startup(_) => {
            match startup_taint.and_then(|t| decide::lift_startup_patch(&node, t)) {
                Some(p) => p,
                None => return Ok(false),
            }
        }
        Work::Quarantine(Action::Quarantine(record)) => decide::quarantine_patch(&node, record),
        Work::Quarantine(Action::Lift) => decide::lift_quarantine_patch(&node),
        Work::Quarantine(Action::RestartPlugin(_)) => unreachable!("handled above"),
    };
    patch_with(patch).await
}

/// The Event on the node for a step done.
async fn announce(deps: &Deps, node: &str, work: &Work) {
    let (type_, reason, note) = match work {
        Work::Startup(Lift::Ready) => (
            EventType::Normal,
            "GpuReady",
            "startup taint removed: the validator is ready and every GPU is advertised".to_owned(),
        ),
        Work::Startup(Lift::NoGpu) => (
            EventType::Normal,
            "GpuReadinessNotApplicable",
            "startup taint removed: NFD found no NVIDIA GPU on this node".to_owned(),
        ),
        Work::Quarantine(Action::Quarantine(r)) => (
            EventType::Warning,
            "GpuQuarantined",
            format!(
                "quarantined ({QUARANTINE_TAINT}={}:{QUARANTINE_EFFECT}): {}",
                r.reason, r.message
            ),
        ),
        Work::Quarantine(Action::RestartPlugin(r)) => (
            EventType::Normal,
            "DevicePluginRestarted",
            format!(
                "device plugin restarted to re-check the GPUs (restart {}; the next in {} s if they are still missing)",
                r.restarts,
                decide::restart_delay(r.restarts)
            ),
        ),
        Work::Quarantine(Action::Lift) => (
            EventType::Normal,
            "GpuQuarantineLifted",
            "quarantine lifted: every GPU is advertised again, the taint was removed by hand, or the quarantine was switched off".to_owned(),
        ),
    };
    publish_node_event(&deps.recorder, node, type_, reason, "GpuReadiness", note).await;
}
