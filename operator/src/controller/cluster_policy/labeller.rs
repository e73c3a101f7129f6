//! Label stage, deploy labels (IO).
//!
//! Writes the label changes `nodes::desired_label_changes` asks for on the GPU nodes (decision 2)
//! and the default MIG layout (decision 7), through the owners' one node label writer
//! (controller::owner::write_labels: a merge patch carrying the node's `resourceVersion` as a
//! precondition, never a forced apply, since other components write `paused-*` values into the same
//! keys). A conflict is not an error: the node is re-read and patched once more at once, and should
//! that conflict too, the node's newer version arrives through the watch and a pass shortly after
//! retries.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kube::Client;
use tokio::sync::Semaphore;

use crate::controller::owner::{self, LabelAttempts};
use crate::facts::{NodeRuntime, RuntimeFlavour};
use crate::nodes::{
    Breaker, GpuLabelLoss, LabelPatch, NodeView, desired_label_changes_for, mig_config_default,
    runtime_flavour_label,
};
use crate::operands::toolkit_flavour::{self, Placement};
use crate::workload::{Sandbox, StackPodsLeft, order_switch};

/// How soon to retry a node whose patch met a newer version (kwok or a kubelet updated its
/// status meanwhile). Such an update changes no label we read, so no watch event would wake us.
const CONFLICT_RETRY: Duration = Duration::from_millis(500);

/// How soon to look again at a node whose workload type switch waits for pods to leave.
const SWITCH_RETRY: Duration = Duration::from_secs(5);

/// What `node` needs: decision 2's labels, the default MIG layout (decision 7), its runtime
/// flavour and the toolkit DaemonSet that serves it.
fn changes_for(
    node: &NodeView,
    gone_for: Option<Duration>,
    grace: Duration,
    wanted: &Wanted<'_>,
) -> LabelPatch {
    let mut changes = desired_label_changes_for(node, gone_for, grace, &wanted.sandbox);
    if !(wanted.mig_by_model)(node) {
        changes.extend(mig_config_default(node, wanted.mig_default_layout));
    }
    let runtime = (wanted.runtime_of)(&node.name);
    changes.extend(runtime_flavour_label(node, runtime.map(|r| r.label())));
    let ready = |daemon_set: &str| (wanted.toolkit_ready)(&node.name, daemon_set);
    let mut changes = toolkit_flavour::place(
        node,
        changes,
        &Placement {
            primary: wanted.toolkit_primary,
            runtime,
            ready: &ready,
        },
    );
    if order_switch(&mut changes, (wanted.stack_pods_left)(&node.name)) {
        wanted.held_back.store(true, Ordering::Relaxed);
    }
    changes
}

/// What the policy and the resolved facts want on GPU nodes besides decision 2's labels.
pub struct Wanted<'a> {
    /// `spec.sandboxWorkloads`: each node's workload type and so its deploy keys.
    pub sandbox: Sandbox,
    /// The default MIG layout (decision 7).
    pub mig_default_layout: Option<&'a str>,
    /// Whether `spec.layoutsByModel` gives the node a MIG layout: the node-pool stage writes
    /// that one instead of the default.
    pub mig_by_model: &'a (dyn Fn(&NodeView) -> bool + Sync),
    /// Each node's runtime, once its nodeInfo was read.
    pub runtime_of: &'a (dyn Fn(&str) -> Option<NodeRuntime> + Sync),
    /// The flavour of the toolkit DaemonSet NVIDIA's deploy value `true` places nodes on.
    pub toolkit_primary: RuntimeFlavour,
    /// Whether the named toolkit DaemonSet's pod on the node is ready (node, DaemonSet).
    pub toolkit_ready: &'a (dyn Fn(&str, &str) -> bool + Sync),
    /// Which stacks' operand pods are still on the node, to order a workload type switch.
    pub stack_pods_left: &'a (dyn Fn(&str) -> StackPodsLeft + Sync),
    /// Set when a switch held a key back: the pass looks again shortly.
    pub held_back: AtomicBool,
}

/// What labelling found beyond the writes: when to look again, and the label-loss breaker.
#[derive(Debug, Default)]
pub struct Labelling {
    /// When a node's vanished GPU label reaches the grace period, the breaker lets the next
    /// node go, or a conflict is retried.
    pub again_at: Option<Instant>,
    pub breaker: Breaker,
}

/// Labels every node that needs it, no more at a time than `gate` admits (a permit per patch
/// in flight). A node whose NFD GPU label has been gone past the grace period is unmarked only
/// when the label-loss breaker admits it ([`GpuLabelLoss::breaker`]): a mass loss (an NFD
/// upgrade or outage) unmarks a bounded share of the fleet per grace window instead of all of
/// it.
pub async fn label_nodes(
    client: &Client,
    nodes: &[Arc<NodeView>],
    loss: &mut GpuLabelLoss,
    attempts: &mut LabelAttempts,
    grace: Duration,
    wanted: &Wanted<'_>,
    gate: &Semaphore,
) -> Result<Labelling, kube::Error> {
    let now = Instant::now();
    let names: BTreeSet<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
    loss.retain_nodes(|n| names.contains(n));
    let gone: Vec<Option<Duration>> = nodes.iter().map(|node| loss.observe(node, now)).collect();
    let gpu_nodes = nodes
        .iter()
        .filter(|n| n.is_gpu_node() || n.has_nfd_gpu())
        .count();
    let breaker = loss.breaker(gpu_nodes, grace, now);
    // Past the grace but held back by the breaker: left exactly as it is for now.
    let gone: BTreeMap<&str, Duration> = nodes
        .iter()
        .zip(gone)
        .filter_map(|(node, gone_for)| {
            let gone_for =
                gone_for.filter(|g| *g < grace || breaker.admitted.contains(&node.name))?;
            Some((node.name.as_str(), gone_for))
        })
        .collect();
    let writes = owner::write_labels(client, nodes, attempts, Some(gate), |node| {
        let gone_for = gone.get(node.name.as_str()).copied();
        changes_for(node, gone_for, grace, wanted)
    })
    .await;
    for (node, changes) in writes.written.iter().filter(|(_, c)| !c.is_empty()) {
        tracing::info!(node = %node.name, changes = ?changes, "labelled node");
        if changes.get(crate::nodes::GPU_PRESENT) == Some(&None) {
            loss.forget(&node.name);
        }
    }
    if let Some(e) = writes.failure {
        return Err(e);
    }
    // A node changed meanwhile, or our write has not reached the cache yet: looked at again
    // shortly (a conflict's retry timer is set when its write is pending).
    let retry = if writes.conflicted > 0 {
        tracing::debug!(
            nodes = writes.conflicted,
            "nodes changed meanwhile; retrying shortly"
        );
        Some(Instant::now() + CONFLICT_RETRY)
    } else {
        (writes.pending > 0).then_some(now + CONFLICT_RETRY)
    };
    // A switch waiting for the leaving stack's pods: not every departure is watched.
    let retry = if wanted.held_back.load(Ordering::Relaxed) {
        let switch = now + SWITCH_RETRY;
        Some(retry.map_or(switch, |r| r.min(switch)))
    } else {
        retry
    };
    let grace_deadline = loss.next_deadline(grace, now);
    if !breaker.held_back.is_empty() {
        tracing::warn!(held_back = ?breaker.held_back, limit = breaker.limit, "GPU label loss on many nodes: the breaker holds them marked");
    }
    Ok(Labelling {
        again_at: grace_deadline
            .into_iter()
            .chain(retry)
            .chain(breaker.reopens)
            .min(),
        breaker,
    })
}
