//! The controller (IO): one loop over the ClusterPolicy, GPUCluster and NVIDIADriver passes.
//!
//! Each pass is a list of stages (resolve -> validate -> render -> apply -> label -> upgrade ->
//! status -> requeue) on the machinery the three share.
//!
//! Guarantees and caveats:
//! - One loop, one pass at a time ([`scheduler`]): every watch of decision 10 (policies
//!   included) feeds one trigger stream; bursts are coalesced and each wake-up reconciles every
//!   policy in turn, then the GPUClusters, then the NVIDIADrivers. There is a single key, so
//!   kube-runtime's `Controller` (per-object queues, and `owns`, which keys a cluster-scoped
//!   owner with the child's namespace and could run the active policy twice at once) buys
//!   nothing here; its watchers and reflectors do the caching.
//! - The reconcile reads caches, never lists: stores are awaited before the first pass so a
//!   restart with nothing changed writes nothing (decision 9).
//! - What the passes remember lives in one struct the scheduler owns ([`PassState`]); what they
//!   only read in another ([`Deps`]). What one controller learns for another is a return value
//!   (the policy in force and its last render, from [`cluster_policy::reconcile_all`]).
//!
//! Layout: `cluster_policy/`, `gpu_cluster/` and `nvidia_driver/` hold one controller each, its
//! pass in its `mod.rs`; `owner.rs` what every owner needs (apply with the ledger, status
//! patch, requeue rule, node label writes, errors); `apply.rs`, `observe.rs`, `resolve.rs`,
//! `upgrade/` the stages they share; `stores.rs` the caches and `scheduler.rs` the loop.

mod apply;
mod cluster_policy;
pub mod coexist;
pub mod config_maps;
mod gpu_cluster;
mod nvidia_driver;
mod observe;
mod owner;
pub mod preview;
mod resolve;
pub mod scheduler;
pub mod stores;
pub mod upgrade;
pub mod vendored_crds;

pub use gpu_operator_engine::{plan, status};

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use kube::Client;
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;

pub use owner::Error;
pub use plan::{APPLIED_HASH_ANNOTATION, applied_hash, is_subset};
use resolve::{Discovered, Resolver};
use scheduler::{AbortOnDrop, PassOutcome, Preemption, Requeue};
use stores::{Stores, Wake};

use crate::api::{ClusterPolicy, GPUCluster, NVIDIADriver};
use crate::metrics::Metrics;

/// Settings of `gpu-operator run` that the reconcile uses.
#[derive(Clone, Debug)]
pub struct Settings {
    pub namespace: String,
    /// How long a node's NFD GPU label must stay gone before the node is unmarked.
    pub gpu_label_grace: Duration,
    /// Requeue interval while something is not ready.
    pub not_ready_requeue: Duration,
    /// The longest one pass may run: past it, the pass is abandoned (its requests cancelled)
    /// and retried with backoff.
    pub pass_deadline: Duration,
    /// Namespaces whose NVIDIA operator Lease is trusted as it is (coexist::Judge).
    pub nvidia_operator_namespaces: std::collections::BTreeSet<String>,
    /// Whether /metrics is served over HTTPS (`--metrics-secure`): the scheme of the
    /// operator's own ServiceMonitor.
    pub metrics_https: bool,
}

/// What every pass reads and none changes: clients, settings, caches and the machinery around
/// them.
struct Deps {
    client: Client,
    settings: Settings,
    stores: Stores,
    policies: Store<DeserializeGuard<ClusterPolicy>>,
    /// GPUClusters, `None` when their CRD is not served.
    gpu_clusters: Option<Store<DeserializeGuard<GPUCluster>>>,
    /// NVIDIADrivers, `None` when their CRD is not served.
    nvidia_drivers: Option<Store<DeserializeGuard<NVIDIADriver>>>,
    resolver: Resolver,
    /// The image environment GPUClusters and NVIDIADrivers resolve their images from.
    image_env: BTreeMap<String, String>,
    /// Whether NVIDIA's operator is live now (controller::coexist).
    nvidia: coexist::NvidiaOperator,
    recorder: Recorder,
    metrics: Metrics,
}

impl Deps {
    /// The NVIDIADrivers in the cache that are not being deleted (none when their CRD is not
    /// served); one list for the NVIDIADriver pass and the upgrade stage.
    fn nvidia_driver_specs(&self) -> Vec<NVIDIADriver> {
        self.nvidia_drivers
            .iter()
            .flat_map(|store| store.state())
            .filter_map(|g| g.0.as_ref().ok().cloned())
            .filter(|d| d.metadata.deletion_timestamp.is_none())
            .collect()
    }
}

/// What the passes remember from one to the next: owned by the scheduler, lent to each pass.
#[derive(Default)]
struct PassState {
    cluster_policy: cluster_policy::Memory,
    gpu_cluster: gpu_cluster::Memory,
    nvidia_driver: nvidia_driver::Memory,
    /// When the pods of a not-ready DaemonSet are listed: one for the three controllers, which
    /// observe the same DaemonSets.
    diagnoser: observe::Diagnoser,
}

/// One pass over every policy, GPUCluster and NVIDIADriver: when to look again, and whether any
/// failed. With `preemption`, the active policy's pass may stop after its apply stage for a
/// user's change (then the GPUClusters and NVIDIADrivers wait for the next pass, which runs at
/// once).
async fn pass(deps: &Deps, state: &mut PassState, preemption: Preemption) -> PassOutcome {
    let policy = cluster_policy::reconcile_all(
        deps,
        &mut state.cluster_policy,
        &mut state.diagnoser,
        preemption,
    )
    .await;
    if policy.outcome.preempted {
        return policy.outcome;
    }
    let clusters = gpu_cluster::reconcile_all(
        deps,
        &mut state.gpu_cluster,
        &mut state.diagnoser,
        policy.active.as_deref(),
    )
    .await;
    // The NVIDIADrivers render against the policy in force's last render.
    let in_force = policy.active.as_deref().zip(policy.rendered.as_deref());
    let drivers = nvidia_driver::reconcile_all(
        deps,
        &mut state.nvidia_driver,
        &mut state.diagnoser,
        in_force,
    )
    .await;
    policy
        .outcome
        .and(counted(deps, "GPUCluster", clusters))
        .and(counted(deps, "NVIDIADriver", drivers))
}

/// A controller's result as the scheduler takes it; a failure is logged and counted.
fn counted(deps: &Deps, kind: &str, result: Result<Requeue, Error>) -> PassOutcome {
    match result {
        Ok(requeue) => PassOutcome {
            requeue,
            ..PassOutcome::default()
        },
        Err(e) => {
            tracing::warn!(error = %e, "{kind} reconcile failed");
            deps.metrics.observe_error(e.reason());
            PassOutcome {
                failed: true,
                ..PassOutcome::default()
            }
        }
    }
}

/// The clients the controller uses (crate::client): request/response calls, and watches.
#[derive(Clone)]
pub struct Clients {
    pub requests: Client,
    pub watches: Client,
}

/// Runs the controller until `shutdown` resolves; the pass in flight is finished first.
/// Dropping the future instead cancels the pass in flight and every watch.
pub async fn run(
    clients: Clients,
    settings: Settings,
    metrics: Metrics,
    health: crate::health::Health,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let Clients {
        requests: client,
        watches: watch_client,
    } = clients;
    let mut judge =
        coexist::Judge::new(client.clone(), settings.nvidia_operator_namespaces.clone());
    let discovered = Discovered::probe(&client, &mut judge).await?;
    tracing::info!(?discovered, namespace = %settings.namespace, "starting controller");
    let (stores, triggers) = Stores::start(&watch_client, &settings.namespace);
    let (policies, policy_changes) = stores::watched_specs(
        Api::<DeserializeGuard<ClusterPolicy>>::all(watch_client.clone()),
        watcher::Config::default(),
    );
    // A policy's spec is the user's to change: its changes go first (stores::Wake).
    let store_less = stores::store_less_changes(
        &watch_client,
        &settings.namespace,
        discovered.optional_kinds(),
    );
    let mut triggers = futures::stream::select(
        futures::stream::select(triggers, store_less),
        policy_changes.map(|()| Wake::Now),
    )
    .boxed();
    let gpu_clusters = watch_if_served::<GPUCluster>(&client, &watch_client, &mut triggers).await;
    // NVIDIADrivers are watched through the request client, as they always were.
    let nvidia_drivers = watch_if_served::<NVIDIADriver>(&client, &client, &mut triggers).await;

    // Fill every cache before the first pass, so it compares against the real cluster.
    let ready = async {
        stores.wait_until_ready().await?;
        policies.wait_until_ready().await?;
        if let Some(clusters) = &gpu_clusters {
            clusters.wait_until_ready().await?;
        }
        if let Some(drivers) = &nvidia_drivers {
            drivers.wait_until_ready().await?;
        }
        Ok::<_, kube::runtime::reflector::store::WriterDropped>(())
    };
    let pump = async { while triggers.next().await.is_some() {} };
    tokio::select! {
        done = ready => done?,
        () = pump => anyhow::bail!("watches ended before the caches were filled"),
    }
    tracing::info!(
        nodes = stores.nodes.len(),
        policies = policies.len(),
        "caches ready"
    );

    let reporting = Reporting {
        health,
        metrics: metrics.clone(),
    };
    // The watches run on their own task, so the caches stay current while a pass runs (a pass
    // that patches a thousand nodes must see the versions its own writes produced).
    let wakes = scheduler::Wakes::pump(triggers, reporting.clone());
    let nvidia = coexist::NvidiaOperator::fixed(discovered.nvidia_operator.clone());
    let _nvidia_watch = {
        let (nvidia, waker, client) = (nvidia.clone(), wakes.waker(), watch_client.clone());
        AbortOnDrop(tokio::spawn(async move {
            nvidia.watch(client, judge, move || waker.wake()).await;
        }))
    };
    let deps = Deps {
        nvidia,
        resolver: Resolver::new(
            client.clone(),
            settings.namespace.clone(),
            discovered,
            resolve::image_env_from_process(),
            settings.metrics_https,
        ),
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: "gpu-operator".into(),
                instance: std::env::var("POD_NAME").ok(),
            },
        ),
        client,
        settings,
        stores,
        policies,
        metrics,
        gpu_clusters,
        nvidia_drivers,
        image_env: resolve::image_env_from_process(),
    };

    let timing = scheduler::Timing {
        coalesce: scheduler::COALESCE,
        deadline: deps.settings.pass_deadline,
    };
    scheduler::run(
        wakes,
        timing,
        &reporting,
        PassState::default(),
        shutdown,
        async |state: &mut PassState, preemption| pass(&deps, state, preemption).await,
    )
    .await?;
    tracing::info!("controller stopped");
    Ok(())
}

/// A watch of `K` through `watches` when its CRD is served, its changes joined to `triggers` as
/// users' changes; `None` (and a log line) when it is not.
async fn watch_if_served<K>(
    client: &Client,
    watches: &Client,
    triggers: &mut futures::stream::BoxStream<'static, Wake>,
) -> Option<Store<DeserializeGuard<K>>>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let kind = K::kind(&());
    if !owner::served::<K>(client).await {
        tracing::info!("the {kind} CRD is not served; {kind}s are not watched");
        return None;
    }
    let (store, changes) = stores::watched_specs(
        Api::<DeserializeGuard<K>>::all(watches.clone()),
        watcher::Config::default(),
    );
    let before = std::mem::replace(triggers, futures::stream::empty().boxed());
    *triggers = futures::stream::select(before, changes.map(|()| Wake::Now)).boxed();
    Some(store)
}

/// The scheduler reports to the health endpoints and the metrics.
#[derive(Clone)]
struct Reporting {
    health: crate::health::Health,
    metrics: Metrics,
}

impl scheduler::Observer for Reporting {
    fn work_arrived(&self) {
        self.health.work_arrived();
    }

    /// Readiness after the first pass, liveness while passes end (crate::health).
    fn pass_started(&self) {
        self.health.pass_started();
    }

    fn pass_finished(&self) {
        self.health.pass_finished();
    }

    fn deadline_passed(&self) {
        self.metrics.observe_error("PassDeadline");
    }
}
