//! What a driver rollout will do to each node, before it starts (pure): the state machine of
//! [`super::machine`] run pass after pass over a copy of the nodes, each action taken as done
//! at once (a cordon holds, an eviction empties the pod, a new driver and validator pod come up
//! Ready). `gpu-operator plan` prints the result, so the waves, cordons and evictions it
//! predicts are the ones the upgrade stage's own rules give, not a second reading of them.
//!
//! What the forecast cannot know is left out of it: how long a pod takes to go, whether a
//! PodDisruptionBudget forbids an eviction, whether the new driver starts. A step that would
//! fail on what the nodes show now (a pod without a controller and no `force`) is reported as
//! the failure the upgrade would report.

use std::collections::BTreeMap;

use super::machine::{
    Action, NodeFacts, Policy, Step, UpgradeState, ValidatorPod, plan, upgrades_available,
};

/// How one node ends in the forecast.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ending {
    /// Its driver is replaced and validated; the node is released.
    Done,
    /// The upgrade stops on this node, for this reason (as status would show it).
    Failed(String),
    /// The rollout never reaches it (skipped by its label, already current, or held).
    Untouched,
}

/// The forecast for one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeForecast {
    pub name: String,
    /// The wave its upgrade starts in, from 1; `None` when it never starts. Nodes take the
    /// rollout's slots one at a time, in the order [`super::machine::plan`] gives them (by
    /// name), so wave `k` holds the `k`-th group of `parallel` nodes to start: when the nodes
    /// of a wave finish at different times, the next wave's nodes start as slots free up.
    pub wave: Option<usize>,
    /// Cordoned by the upgrade (a node cordoned before keeps its cordon and is not counted).
    pub cordoned: bool,
    /// Only its driver pod restarts: what the driver installs is unchanged, so no cordon and
    /// no eviction.
    pub restart_only: bool,
    /// Pods evicted, `namespace/name`, in the order the upgrade evicts them (GPU pods first,
    /// then the drain's).
    pub evicted: Vec<String>,
    /// Pods matching `waitForCompletion`'s selector it waits for before the evictions.
    pub waits_for_jobs: usize,
    pub ending: Ending,
}

/// The forecast for one set of nodes upgraded under one policy.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Forecast {
    /// By node name.
    pub nodes: Vec<NodeForecast>,
    /// How many waves the rollout takes: the nodes that start, `parallel` at a time.
    pub waves: usize,
    /// Nodes the rollout may take at once now (maxParallelUpgrades within maxUnavailable).
    pub parallel: usize,
}

impl Forecast {
    /// The nodes whose upgrade starts in `wave`.
    pub fn wave(&self, wave: usize) -> impl Iterator<Item = &NodeForecast> {
        self.nodes.iter().filter(move |n| n.wave == Some(wave))
    }
}

/// Passes after which a forecast stops: far beyond any fleet's rollout (each node needs about
/// ten), so reaching it means a node makes no progress.
const MAX_PASSES: usize = 100_000;

/// The rollout of `nodes` under `policy`: each node as the upgrade stage would see it once
/// the new driver revision exists (driver pods not current, states as the nodes carry them).
pub fn forecast(nodes: &[NodeFacts], policy: &Policy) -> Forecast {
    let mut world: Vec<NodeFacts> = nodes.to_vec();
    // One record per node, at the node's index in `world`.
    let mut out: Vec<NodeForecast> = nodes
        .iter()
        .map(|n| NodeForecast {
            name: n.name.clone(),
            wave: None,
            cordoned: false,
            restart_only: false,
            evicted: Vec::new(),
            waits_for_jobs: 0,
            ending: Ending::Untouched,
        })
        .collect();
    let index: BTreeMap<String, usize> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.name.clone(), i))
        .collect();
    let parallel = {
        // The slots as they will be once every node is waiting.
        let waiting: Vec<NodeFacts> = world
            .iter()
            .cloned()
            .map(|mut n| {
                n.state = Some(UpgradeState::UpgradeRequired);
                n
            })
            .collect();
        upgrades_available(&waiting, policy)
    };
    // How many nodes have started so far: a node's place in the start order.
    let mut starts = 0;
    // Any fixed start works: the machine only compares times it recorded itself.
    let mut now: i64 = 1_000_000_000;
    for _ in 0..MAX_PASSES {
        let steps = plan(&world, policy, now);
        let mut moved = false;
        for (name, step) in steps {
            let Some(&i) = index.get(&name) else {
                continue;
            };
            let (node, record) = (&mut world[i], &mut out[i]);
            let before = node.state.unwrap_or(UpgradeState::Unknown);
            if before == UpgradeState::UpgradeRequired
                && step
                    .next
                    .is_some_and(|s| s != UpgradeState::UpgradeRequired)
            {
                record.wave = Some(starts / parallel.max(1) + 1);
                starts += 1;
                record.restart_only = step.next == Some(UpgradeState::PodRestartRequired);
            }
            if before == UpgradeState::WaitForJobsRequired && step.next.is_none() {
                // It waits for its jobs; they finish in the forecast.
                record.waits_for_jobs = node.jobs_running;
                node.jobs_running = 0;
                moved = true;
            }
            moved |= take(node, &step, record, now);
        }
        if !moved {
            break;
        }
        now += 1;
    }
    for (node, record) in world.iter().zip(out.iter_mut()) {
        record.ending = match node.state.unwrap_or(UpgradeState::Unknown) {
            UpgradeState::Failed => record.ending.clone(),
            _ if record.wave.is_none() => Ending::Untouched,
            UpgradeState::Done => Ending::Done,
            other => Ending::Failed(format!(
                "makes no progress in {} (the forecast stopped there)",
                other.label()
            )),
        };
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Forecast {
        nodes: out,
        waves: starts.div_ceil(parallel.max(1)),
        parallel,
    }
}

/// Takes `step` on `node` as if every action succeeded at once; whether anything changed.
fn take(node: &mut NodeFacts, step: &Step, record: &mut NodeForecast, now: i64) -> bool {
    let mut moved = step.next.is_some();
    for action in &step.actions {
        moved = true;
        match action {
            Action::Cordon => {
                node.unschedulable = true;
                record.cordoned = true;
            }
            Action::Uncordon => node.unschedulable = false,
            Action::Evict(pods) => {
                for pod in pods {
                    if !record.evicted.contains(pod) {
                        record.evicted.push(pod.clone());
                    }
                }
                node.gpu_pods.retain(|p| !pods.contains(&p.key()));
                node.drain_pods.retain(|p| !pods.contains(&p.key()));
            }
            Action::DeleteDriverPod(_) | Action::HandOver(_) => {
                if let Some(driver) = node.driver.as_mut() {
                    driver.revision = super::machine::DriverRevision::Current;
                    driver.handover_to = None;
                    driver.ready = true;
                    driver.failing = false;
                    driver.created = now;
                }
            }
            Action::DeleteValidatorPod(name) => {
                node.validator = Some(ValidatorPod {
                    name: name.clone(),
                    ready: true,
                    failing: false,
                    created: now,
                });
            }
            Action::Annotate(key, value) => match value {
                Some(v) => {
                    node.annotations.insert((*key).to_owned(), v.clone());
                }
                None => {
                    node.annotations.remove(*key);
                }
            },
        }
    }
    if let Some(next) = step.next {
        node.state = Some(next);
        if next == UpgradeState::Failed {
            record.ending = Ending::Failed(step.failure.clone().unwrap_or_default());
        }
        // A node validating without a validator pod gets a new one (the DaemonSet starts it).
        if next == UpgradeState::ValidationRequired && node.validator_expected {
            let created = node.driver.as_ref().map_or(now, |d| d.created);
            if node.validator.as_ref().is_none_or(|v| v.created < created) {
                node.validator = Some(ValidatorPod {
                    name: format!("validator-{}", node.name),
                    ready: true,
                    failing: false,
                    created: now,
                });
            }
        }
    }
    moved
}
