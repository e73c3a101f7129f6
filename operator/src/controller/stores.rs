//! Watches and caches (IO): the reflector stores the reconcile reads instead of the API, and
//! the trigger stream that wakes it (decision 10).
//!
//! - operand objects by `app.kubernetes.io/managed-by=gpu-operator`, one store per kind;
//! - the operator's own ConfigMaps whole, by label; users' ConfigMaps as names and versions,
//!   with the data of only those a policy names ([`super::config_maps`]);
//! - Nodes, reduced as they arrive to the labels, annotations, taints and advertised GPUs the
//!   operator reads ([`NodeView`]), waking the reconcile only when those change (a kubelet's
//!   heartbeat does not);
//! - driver and validator pods by label, reduced to what the driver upgrade reads
//!   ([`UpgradePod`]); never all Pods.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::{Arc, RwLock};

use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Service, ServiceAccount};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Api, ApiResource, DynamicObject};
use kube::core::PartialObjectMeta;
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::{self, Event};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;

use super::config_maps::UserConfigMaps;
use super::upgrade::{UPGRADE_POD_SELECTORS, UpgradePod};
use crate::model::{Kind, MANAGED_BY_LABEL, MANAGER};
use crate::nodes::NodeView;

/// How soon a watch event should start a pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// A user's change (a policy's spec, a ConfigMap of theirs): a pass starts at once (its
    /// latency is what the user waits on).
    Now,
    /// Cluster churn (a DaemonSet's counts, node labels, our own writes): a pass starts after a
    /// short wait that gathers the rest of the burst.
    Soon,
}

/// One cached object, reduced to what the operator reads of it.
pub trait View: Clone + Send + Sync + 'static {
    /// The cache key (the object's name).
    fn key(&self) -> &str;
    /// Whether replacing `old` with `self` is news for the reconcile.
    fn wakes(&self, old: &Self) -> bool;
}

impl View for NodeView {
    fn key(&self) -> &str {
        &self.name
    }

    fn wakes(&self, old: &Self) -> bool {
        // The resourceVersion alone is not news; it is kept for patch preconditions.
        old.labels != self.labels
            || old.nfd_annotated != self.nfd_annotated
            || old.pool_record != self.pool_record
            || old.upgrade_annotations != self.upgrade_annotations
            || old.readiness != self.readiness
    }
}

/// A driver, validator or pre-pull pod: a driver pod's changes wake no pass (the upgrade stage
/// looks again every second while a node is between states). A validator pod turning ready or
/// failing does (a node's startup taint waits on it, GPU readiness), and so does a pre-pull pod
/// whose images change state (a node waiting for the pull starts its upgrade on that news).
impl View for UpgradePod {
    fn key(&self) -> &str {
        &self.name
    }

    fn wakes(&self, old: &Self) -> bool {
        (self.validator && (old.ready != self.ready || old.failing != self.failing))
            || (self.prepull.is_some() && self.prepull != old.prepull)
    }
}

/// A container-toolkit pod, reduced to what a node's move between runtime flavours waits on
/// (operands::toolkit_flavour::place): the DaemonSet it belongs to (its `app` label), its node
/// and whether it is ready.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolkitPod {
    pub name: String,
    pub daemon_set: String,
    pub node: Option<String>,
    pub ready: bool,
    pub deleting: bool,
}

impl ToolkitPod {
    pub fn of(pod: &Pod) -> Self {
        ToolkitPod {
            name: pod.name_any(),
            daemon_set: pod
                .labels()
                .get(crate::operands::common::APP_LABEL)
                .cloned()
                .unwrap_or_default(),
            node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            ready: super::upgrade::pod_ready(pod),
            deleting: pod.metadata.deletion_timestamp.is_some(),
        }
    }

    /// The label selector of every toolkit DaemonSet's pods, whichever flavour.
    pub fn selector() -> String {
        let names: Vec<String> = std::iter::once(crate::operands::toolkit::NAME.to_owned())
            .chain(
                crate::facts::RuntimeFlavour::ALL
                    .into_iter()
                    .map(crate::operands::toolkit_flavour::name),
            )
            .collect();
        format!(
            "{} in ({})",
            crate::operands::common::APP_LABEL,
            names.join(",")
        )
    }
}

impl View for ToolkitPod {
    fn key(&self) -> &str {
        &self.name
    }

    /// A pod turning ready is what a node's flavour move waits on.
    fn wakes(&self, old: &Self) -> bool {
        old.ready != self.ready || old.node != self.node || old.deleting != self.deleting
    }
}

/// Objects by name, each reduced to a [`View`] as its watch event arrives, so that neither a
/// full object nor a list page outlives the event.
///
/// Several watches may fill one cache (the driver and the validator pods, by two selectors):
/// each watch's relist replaces only the objects that watch listed, and the cache is ready once
/// every watch has listed once.
#[derive(Clone)]
pub struct ViewCache<V> {
    /// Each view behind an `Arc`: a pass's snapshot shares them (a thousand nodes' label maps
    /// are not cloned for every pass).
    items: Arc<RwLock<BTreeMap<String, Arc<V>>>>,
    ready: tokio::sync::watch::Sender<bool>,
    /// Watches started on this cache, and those that have listed once.
    watches: Arc<std::sync::atomic::AtomicUsize>,
    listed: Arc<std::sync::atomic::AtomicUsize>,
}

/// What one watch keeps between its events: a relist in progress, and the keys it put in the
/// cache (a relist removes only those it no longer lists).
struct WatchState<V> {
    pending: Option<BTreeMap<String, Arc<V>>>,
    owned: BTreeSet<String>,
    listed_once: bool,
}

impl<V> Default for WatchState<V> {
    fn default() -> Self {
        WatchState {
            pending: None,
            owned: BTreeSet::new(),
            listed_once: false,
        }
    }
}

/// The nodes the operator knows, by name, reduced to the labels it reads.
pub type NodeCache = ViewCache<NodeView>;

impl<V> Default for ViewCache<V> {
    fn default() -> Self {
        ViewCache {
            items: Arc::default(),
            ready: tokio::sync::watch::channel(false).0,
            watches: Arc::default(),
            listed: Arc::default(),
        }
    }
}

impl<V: View> ViewCache<V> {
    /// Resolves once the first full list has been seen.
    pub async fn wait_until_ready(&self) {
        let mut rx = self.ready.subscribe();
        let _ = rx.wait_for(|ready| *ready).await;
    }

    pub fn snapshot(&self) -> Vec<Arc<V>> {
        self.items
            .read()
            .map(|n| n.values().cloned().collect())
            .unwrap_or_default()
    }

    pub fn len(&self) -> usize {
        self.items.read().map(|n| n.len()).unwrap_or_default()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Applies one watch event, each object reduced by `view`; true when the reconcile should
    /// hear of it. `state` is the watch's own: its relist until complete, the keys it owns.
    fn apply<K>(&self, event: Event<K>, view: impl Fn(&K) -> V, state: &mut WatchState<V>) -> bool {
        let Ok(mut items) = self.items.write() else {
            return false;
        };
        match event {
            Event::Init => {
                state.pending = Some(BTreeMap::new());
                false
            }
            Event::InitApply(o) => {
                let v = view(&o);
                if let Some(p) = state.pending.as_mut() {
                    p.insert(v.key().to_owned(), Arc::new(v));
                }
                false
            }
            Event::InitDone => {
                if let Some(listed) = state.pending.take() {
                    for gone in state.owned.iter().filter(|k| !listed.contains_key(*k)) {
                        items.remove(gone);
                    }
                    state.owned = listed.keys().cloned().collect();
                    items.extend(listed);
                }
                if !state.listed_once {
                    state.listed_once = true;
                    let listed = self
                        .listed
                        .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
                        + 1;
                    if listed >= self.watches.load(std::sync::atomic::Ordering::SeqCst) {
                        self.ready.send_replace(true);
                    }
                }
                true
            }
            Event::Apply(o) => {
                let v = view(&o);
                let wakes = items.get(v.key()).is_none_or(|old| v.wakes(old));
                state.owned.insert(v.key().to_owned());
                items.insert(v.key().to_owned(), Arc::new(v));
                wakes
            }
            Event::Delete(o) => {
                let v = view(&o);
                state.owned.remove(v.key());
                items.remove(v.key()).is_some()
            }
        }
    }

    /// Keeps the cache filled from `api`'s watch (list pages of `page_size`); the stream yields
    /// whenever the reconcile should hear of a change.
    fn watch<K>(
        &self,
        api: Api<K>,
        config: watcher::Config,
        view: impl Fn(&K) -> V + Send + 'static,
    ) -> BoxStream<'static, ()>
    where
        K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    {
        let cache = self.clone();
        cache
            .watches
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut state = WatchState::default();
        watcher::watcher(api, config)
            .default_backoff()
            .filter_map(move |event| {
                let wake = match event {
                    Ok(event) => cache.apply(event, &view, &mut state),
                    Err(e) => {
                        tracing::warn!(error = %e, "watch failed; retrying with backoff");
                        false
                    }
                };
                async move { wake.then_some(()) }
            })
            .boxed()
    }
}

/// A node reduced to what the operator reads: labels and annotations, and the taints and
/// advertised GPUs GPU readiness reads.
fn node_view(n: &Node) -> NodeView {
    let name = n.metadata.name.as_deref().unwrap_or_default();
    let none = BTreeMap::new();
    let labels = n.metadata.labels.as_ref().unwrap_or(&none);
    NodeView {
        nfd_annotated: crate::nodes::nfd_annotated(n.metadata.annotations.as_ref()),
        pool_record: crate::node_pools::record_annotation(n.metadata.annotations.as_ref()),
        upgrade_annotations: super::upgrade::machine::node_annotations(
            n.metadata.annotations.as_ref(),
        ),
        readiness: crate::nodes::ReadinessFacts::of(n),
        ..NodeView::from_labels(name, n.metadata.resource_version.clone(), labels)
    }
}

/// Nodes per page of the node watch's list. The reflector keeps a few labels per node, but a
/// page is read whole: 500 nodes' metadata (kwok's and kubelets' managedFields included) is
/// megabytes the allocator keeps for good once the page is freed.
const NODE_PAGE_SIZE: u32 = 100;

/// Every cache the reconcile reads.
#[derive(Clone)]
pub struct Stores {
    pub nodes: NodeCache,
    /// Driver and validator pods, for the driver upgrade.
    pub upgrade_pods: ViewCache<UpgradePod>,
    /// Container-toolkit pods, for nodes moving between runtime flavours.
    pub toolkit_pods: ViewCache<ToolkitPod>,
    /// VFIO manager pods (the toolkit pods' view fits them), for nodes switching back to
    /// containers: the driver waits until they are gone (workload::order_switch).
    pub vfio_pods: ViewCache<ToolkitPod>,
    /// The vGPU manager's pods (ours by operand name, NVIDIA's by its `app` label), by node: a
    /// node switching back to containers gets its driver only once they are gone.
    pub vgpu_pods: ViewCache<ToolkitPod>,
    /// The operator's own ConfigMaps (labelled [`MANAGED_BY_LABEL`]).
    pub config_maps: Store<ConfigMap>,
    /// Everyone else's: see [`super::config_maps`].
    pub user_config_maps: UserConfigMaps,
    pub daemon_sets: Store<DaemonSet>,
    pub deployments: Store<Deployment>,
    pub services: Store<Service>,
    pub service_accounts: Store<ServiceAccount>,
    pub roles: Store<Role>,
    pub role_bindings: Store<RoleBinding>,
    pub cluster_roles: Store<ClusterRole>,
    pub cluster_role_bindings: Store<ClusterRoleBinding>,
    pub runtime_classes: Store<RuntimeClass>,
}

/// A reflector over objects of kind `K` the operator manages, and its change stream.
fn managed<K>(api: Api<K>) -> (Store<K>, BoxStream<'static, ()>)
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone,
{
    let config = watcher::Config::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGER}"));
    watched(api, config)
}

/// What of a DaemonSet the reconcile must hear about at once: its metadata and spec (ours to
/// keep), its pod count, and whether it is ready (decision 11). A rollout updates the status
/// with every pod replaced, and with `maxUnavailable: 1` the available count dips and recovers
/// for each: while a rollout is under way only its end is news (the counts in between are
/// refreshed by the not-ready requeue), and waking a pass for each pod would queue the next
/// user change behind it. Once rolled out, any loss of availability (a crash loop) is news.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonSetWake {
    generation: Option<i64>,
    resource_labels: Option<BTreeMap<String, String>>,
    annotations: Option<BTreeMap<String, String>>,
    deleting: bool,
    desired: i32,
    /// The controller saw the last spec and every pod runs the current template; for an
    /// OnDelete DaemonSet (the driver, whose old pods wait for the upgrade) the first part only.
    rolled_out: bool,
    /// Every pod available, counted only once rolled out.
    all_available: bool,
}

impl DaemonSetWake {
    pub fn of(ds: &DaemonSet) -> Self {
        let status = ds.status.as_ref();
        let count = |f: fn(&k8s_openapi::api::apps::v1::DaemonSetStatus) -> Option<i32>| {
            status.and_then(f).unwrap_or(0)
        };
        let desired = status.map_or(0, |s| s.desired_number_scheduled);
        let generation = ds.metadata.generation;
        let on_delete = super::status::updates_on_delete(ds);
        let caught_up =
            status.and_then(|s| s.observed_generation).unwrap_or(0) >= generation.unwrap_or(0);
        let rolled_out =
            caught_up && (on_delete || count(|s| s.updated_number_scheduled) >= desired);
        DaemonSetWake {
            generation,
            resource_labels: ds.metadata.labels.clone(),
            annotations: ds.metadata.annotations.clone(),
            deleting: ds.metadata.deletion_timestamp.is_some(),
            desired,
            rolled_out,
            all_available: rolled_out && count(|s| s.number_available) >= desired,
        }
    }
}

/// Whether a watch event should wake the reconcile: only when what `of` takes from the object
/// changed (or the object came or went). `seen` is what each object last looked like.
fn wakes_on<K: Resource, W: PartialEq + Clone>(
    seen: &mut BTreeMap<String, W>,
    event: &Event<K>,
    of: impl Fn(&K) -> W,
) -> bool {
    let name = |o: &K| {
        format!(
            "{}/{}",
            o.meta().namespace.as_deref().unwrap_or_default(),
            o.meta().name.as_deref().unwrap_or_default()
        )
    };
    match event {
        Event::Init => {
            seen.clear();
            false
        }
        Event::InitApply(o) => {
            seen.insert(name(o), of(o));
            false
        }
        Event::InitDone => true,
        Event::Apply(o) => {
            let now = of(o);
            seen.insert(name(o), now.clone()) != Some(now)
        }
        Event::Delete(o) => {
            seen.remove(&name(o));
            true
        }
    }
}

/// Whether a DaemonSet watch event should wake the reconcile: not for status churn that leaves
/// [`DaemonSetWake`] as it was.
#[cfg(test)]
fn daemon_set_wakes(seen: &mut BTreeMap<String, DaemonSetWake>, event: &Event<DaemonSet>) -> bool {
    wakes_on(seen, event, DaemonSetWake::of)
}

/// What of a user's object (the ClusterPolicy, a GPUCluster, an NVIDIADriver) the reconcile
/// must hear about: everything but the status, which the operator writes itself. Waking a pass
/// for its own status write would run passes back to back for as long as a rollout moves the
/// counts the status shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecWake {
    uid: Option<String>,
    generation: Option<i64>,
    labels: Option<BTreeMap<String, String>>,
    annotations: Option<BTreeMap<String, String>>,
    finalizers: Option<Vec<String>>,
    deleting: bool,
}

impl SpecWake {
    pub fn of<K: Resource>(o: &K) -> Self {
        let m = o.meta();
        SpecWake {
            uid: m.uid.clone(),
            generation: m.generation,
            labels: m.labels.clone(),
            annotations: m.annotations.clone(),
            finalizers: m.finalizers.clone(),
            deleting: m.deletion_timestamp.is_some(),
        }
    }
}

/// A reflector over user objects of kind `K`; its change stream leaves out status writes
/// ([`SpecWake`]).
pub fn watched_specs<K>(api: Api<K>, config: watcher::Config) -> (Store<K>, BoxStream<'static, ()>)
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone,
{
    watched_waking(api, config, SpecWake::of)
}

/// The DaemonSet reflector; its change stream leaves out status churn ([`DaemonSetWake`]).
fn managed_daemon_sets(api: Api<DaemonSet>) -> (Store<DaemonSet>, BoxStream<'static, ()>) {
    let config = watcher::Config::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGER}"));
    watched_waking(api, config, DaemonSetWake::of)
}

/// A reflector whose change stream yields only when what `of` takes from an object changed
/// ([`wakes_on`]).
fn watched_waking<K, W>(
    api: Api<K>,
    config: watcher::Config,
    of: fn(&K) -> W,
) -> (Store<K>, BoxStream<'static, ()>)
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone,
    W: PartialEq + Clone + Send + 'static,
{
    let (reader, writer) = reflector::store();
    let mut seen = BTreeMap::new();
    let stream = reflector::reflector(writer, watcher::watcher(api, config))
        .default_backoff()
        .filter_map(move |event| {
            let wake = match &event {
                Ok(event) => wakes_on(&mut seen, event, of),
                Err(e) => {
                    tracing::warn!(error = %e, "watch failed; retrying with backoff");
                    false
                }
            };
            async move { wake.then_some(()) }
        })
        .boxed();
    (reader, stream)
}

/// Wakes a pass when an object of ours of a store-less kind (`resources`: admission policies,
/// ServiceMonitors, SCCs) changes or goes. The reconcile reads those one by one and keeps no
/// cache of them, so without this a deleted confinement policy stayed deleted until something
/// else woke the reconcile. Metadata only, nothing kept but what [`wakes_on`] compares; a
/// namespaced kind is watched in `namespace` only.
pub fn store_less_changes(
    client: &Client,
    namespace: &str,
    resources: Vec<ApiResource>,
) -> BoxStream<'static, Wake> {
    let config = watcher::Config::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGER}"));
    let streams = resources.into_iter().map(|resource| {
        let api: Api<PartialObjectMeta<DynamicObject>> =
            match crate::render::rbac::scope(&resource.group, &resource.plural) {
                Some(crate::render::rbac::Scope::Cluster) => {
                    Api::all_with(client.clone(), &resource)
                }
                _ => Api::namespaced_with(client.clone(), namespace, &resource),
            };
        let mut seen = BTreeMap::new();
        watcher::watcher(api, config.clone())
            .default_backoff()
            .filter_map(move |event| {
                let wake = match &event {
                    Ok(event) => {
                        wakes_on(&mut seen, event, |o: &PartialObjectMeta<DynamicObject>| {
                            (
                                o.metadata.generation,
                                o.metadata.labels.clone(),
                                o.metadata.annotations.clone(),
                                o.metadata.deletion_timestamp.is_some(),
                            )
                        })
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "watch failed; retrying with backoff");
                        false
                    }
                };
                async move { wake.then_some(Wake::Soon) }
            })
            .boxed()
    });
    futures::stream::select_all(streams).boxed()
}

/// The operator's own ConfigMaps (labelled [`MANAGED_BY_LABEL`]): their changes are churn.
fn config_maps(api: Api<ConfigMap>) -> (Store<ConfigMap>, BoxStream<'static, Wake>) {
    let config = watcher::Config::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGER}"));
    watched_as(api, config, |event| {
        matches!(event, Event::Apply(_) | Event::Delete(_) | Event::InitDone).then_some(Wake::Soon)
    })
}

/// A reflector over objects of kind `K` selected by `config`, and its change stream.
pub fn watched<K>(api: Api<K>, config: watcher::Config) -> (Store<K>, BoxStream<'static, ()>)
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone,
{
    watched_as(api, config, |event| {
        matches!(event, Event::Apply(_) | Event::Delete(_) | Event::InitDone).then_some(())
    })
}

/// A reflector over objects of kind `K` selected by `config`; its change stream yields what
/// `classify` makes of each watch event (nothing for `None`).
fn watched_as<K, T>(
    api: Api<K>,
    config: watcher::Config,
    classify: fn(&Event<K>) -> Option<T>,
) -> (Store<K>, BoxStream<'static, T>)
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone,
    T: Send + 'static,
{
    let (reader, writer) = reflector::store();
    let stream = reflector::reflector(writer, watcher::watcher(api, config))
        .default_backoff()
        .filter_map(move |event| {
            let item = match &event {
                Ok(event) => classify(event),
                Err(e) => {
                    tracing::warn!(error = %e, "watch failed; retrying with backoff");
                    None
                }
            };
            async move { item }
        })
        .boxed();
    (reader, stream)
}

impl Stores {
    /// Starts every watch; returns the stores and one stream that yields whenever the
    /// reconcile should run again.
    pub fn start(
        client: &Client,
        namespace: &str,
    ) -> (Stores, impl Stream<Item = Wake> + Send + 'static) {
        let (config_maps, cm_changes) =
            config_maps(Api::<ConfigMap>::namespaced(client.clone(), namespace));
        let user_config_maps = UserConfigMaps::default();
        let user_cm_changes = user_config_maps.watch(client, namespace);
        let (daemon_sets, ds_changes) =
            managed_daemon_sets(Api::<DaemonSet>::namespaced(client.clone(), namespace));
        let (deployments, deploy_changes) =
            managed(Api::<Deployment>::namespaced(client.clone(), namespace));
        let (services, svc_changes) =
            managed(Api::<Service>::namespaced(client.clone(), namespace));
        let (service_accounts, sa_changes) =
            managed(Api::<ServiceAccount>::namespaced(client.clone(), namespace));
        let (roles, role_changes) = managed(Api::<Role>::namespaced(client.clone(), namespace));
        let (role_bindings, rb_changes) =
            managed(Api::<RoleBinding>::namespaced(client.clone(), namespace));
        let (cluster_roles, cr_changes) = managed(Api::<ClusterRole>::all(client.clone()));
        let (cluster_role_bindings, crb_changes) =
            managed(Api::<ClusterRoleBinding>::all(client.clone()));
        let (runtime_classes, rc_changes) = managed(Api::<RuntimeClass>::all(client.clone()));

        // Whole nodes (GPU readiness reads taints and allocatable GPUs), reduced to a NodeView
        // as each arrives; small list pages, so the start-up list never holds hundreds of whole
        // nodes at once.
        let nodes = NodeCache::default();
        let node_changes = nodes.watch(
            Api::<Node>::all(client.clone()),
            watcher::Config::default().page_size(NODE_PAGE_SIZE),
            node_view,
        );
        // The driver upgrade's pods, reduced as they arrive; only a validator pod turning ready
        // or failing, or a pre-pull pod's news, wakes a pass (UpgradePod's View).
        let upgrade_pods = ViewCache::default();
        let upgrade_pod_watches = UPGRADE_POD_SELECTORS.map(|selector| {
            upgrade_pods
                .watch(
                    Api::<Pod>::namespaced(client.clone(), namespace),
                    watcher::Config::default()
                        .labels(selector)
                        .page_size(NODE_PAGE_SIZE),
                    UpgradePod::of,
                )
                .boxed()
        });

        let toolkit_pods = ViewCache::default();
        let toolkit_pod_changes = toolkit_pods.watch(
            Api::<Pod>::namespaced(client.clone(), namespace),
            watcher::Config::default()
                .labels(&ToolkitPod::selector())
                .page_size(NODE_PAGE_SIZE),
            ToolkitPod::of,
        );

        let vfio_pods = ViewCache::default();
        let vfio_pod_changes = vfio_pods.watch(
            Api::<Pod>::namespaced(client.clone(), namespace),
            watcher::Config::default()
                .labels(&format!(
                    "{}={}",
                    "name",
                    crate::operands::vfio_manager::NAME
                ))
                .page_size(NODE_PAGE_SIZE),
            ToolkitPod::of,
        );

        let vgpu_pods = ViewCache::default();
        let vgpu_pod_changes = vgpu_pods.watch(
            Api::<Pod>::namespaced(client.clone(), namespace),
            watcher::Config::default()
                .labels(&format!(
                    "{}={}",
                    crate::operands::common::NAME_LABEL,
                    crate::operands::vgpu_manager::DESCRIPTOR.name
                ))
                .page_size(NODE_PAGE_SIZE),
            ToolkitPod::of,
        );
        // A vGPU manager DaemonSet adopted from NVIDIA's operator keeps NVIDIA's pod template,
        // whose pods carry only NVIDIA's `app` label; our plain-named one's carry it too.
        let nvidia_vgpu_pod_changes = vgpu_pods.watch(
            Api::<Pod>::namespaced(client.clone(), namespace),
            watcher::Config::default()
                .labels(&format!("app={}", crate::operands::vgpu_manager::NAME))
                .page_size(NODE_PAGE_SIZE),
            ToolkitPod::of,
        );

        let mut triggers = vec![
            ds_changes,
            deploy_changes,
            svc_changes,
            sa_changes,
            role_changes,
            rb_changes,
            cr_changes,
            crb_changes,
            rc_changes,
            node_changes,
            toolkit_pod_changes,
            vfio_pod_changes,
            vgpu_pod_changes,
            nvidia_vgpu_pod_changes,
        ];
        triggers.extend(upgrade_pod_watches);
        let churn = futures::stream::select_all(triggers).map(|()| Wake::Soon);
        let triggers =
            futures::stream::select(futures::stream::select(cm_changes, user_cm_changes), churn);
        let stores = Stores {
            nodes,
            upgrade_pods,
            toolkit_pods,
            vfio_pods,
            vgpu_pods,
            config_maps,
            user_config_maps,
            daemon_sets,
            deployments,
            services,
            service_accounts,
            roles,
            role_bindings,
            cluster_roles,
            cluster_role_bindings,
            runtime_classes,
        };
        (stores, triggers)
    }

    /// A ConfigMap of the operator namespace `namespace` the reconcile may read: ours, or a
    /// user's that [`UserConfigMaps::fetch`] fetched for a policy naming it.
    pub fn config_map(&self, namespace: &str, name: &str) -> Option<Arc<ConfigMap>> {
        self.config_maps
            .get(&reflector::ObjectRef::new(name).within(namespace))
            .or_else(|| self.user_config_maps.get(name))
    }

    /// Waits until every store has finished its first list, so the first reconcile compares
    /// against the real cluster (an empty cache would make it re-apply everything).
    pub async fn wait_until_ready(&self) -> Result<(), reflector::store::WriterDropped> {
        self.nodes.wait_until_ready().await;
        self.upgrade_pods.wait_until_ready().await;
        self.toolkit_pods.wait_until_ready().await;
        self.vfio_pods.wait_until_ready().await;
        self.vgpu_pods.wait_until_ready().await;
        self.user_config_maps.wait_until_ready().await;
        // Every kind of operand object has a store.
        for kind in Kind::ALL {
            match kind {
                Kind::ServiceAccount => self.service_accounts.wait_until_ready().await?,
                Kind::ClusterRole => self.cluster_roles.wait_until_ready().await?,
                Kind::ClusterRoleBinding => self.cluster_role_bindings.wait_until_ready().await?,
                Kind::Role => self.roles.wait_until_ready().await?,
                Kind::RoleBinding => self.role_bindings.wait_until_ready().await?,
                Kind::ConfigMap => self.config_maps.wait_until_ready().await?,
                Kind::RuntimeClass => self.runtime_classes.wait_until_ready().await?,
                Kind::Service => self.services.wait_until_ready().await?,
                Kind::DaemonSet => self.daemon_sets.wait_until_ready().await?,
                Kind::Deployment => self.deployments.wait_until_ready().await?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn daemon_set(generation: i64, observed: i64, updated: i32, available: i32) -> DaemonSet {
        serde_json::from_value(json!({
            "metadata": {"name": "nvidia-device-plugin-daemonset", "namespace": "gpu-operator",
                "generation": generation},
            "status": {"observedGeneration": observed, "desiredNumberScheduled": 10,
                "currentNumberScheduled": 10, "numberMisscheduled": 0,
                "updatedNumberScheduled": updated, "numberAvailable": available,
                "numberReady": available}
        }))
        .unwrap()
    }

    #[test]
    fn daemon_set_status_churn_wakes_the_reconcile_only_when_readiness_flips() {
        let mut seen = BTreeMap::new();
        assert!(!daemon_set_wakes(&mut seen, &Event::Init));
        assert!(!daemon_set_wakes(
            &mut seen,
            &Event::InitApply(daemon_set(1, 1, 10, 10))
        ));
        assert!(daemon_set_wakes(&mut seen, &Event::InitDone));
        // Our new template: a new generation wakes.
        assert!(daemon_set_wakes(
            &mut seen,
            &Event::Apply(daemon_set(2, 1, 10, 10))
        ));
        // The controller sees it and replaces pods one by one, each dipping the available
        // count: no wake-up until the rollout ends.
        for updated in 0..10 {
            for available in [9, 10] {
                assert!(
                    !daemon_set_wakes(
                        &mut seen,
                        &Event::Apply(daemon_set(2, 2, updated, available))
                    ),
                    "{updated} updated, {available} available"
                );
            }
        }
        // Every pod updated and available: ready again, wakes.
        assert!(daemon_set_wakes(
            &mut seen,
            &Event::Apply(daemon_set(2, 2, 10, 10))
        ));
        // Rolled out, then a pod stops being available (a crash loop): wakes.
        assert!(daemon_set_wakes(
            &mut seen,
            &Event::Apply(daemon_set(2, 2, 10, 9))
        ));
        assert!(daemon_set_wakes(
            &mut seen,
            &Event::Delete(daemon_set(2, 2, 10, 10))
        ));
    }

    #[test]
    fn the_operators_own_status_write_on_a_policy_wakes_no_pass_but_a_spec_edit_does() {
        let policy = |generation: i64, state: &str| -> crate::api::ClusterPolicy {
            serde_json::from_value(json!({
                "apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy",
                "metadata": {"name": "cluster-policy", "uid": "u1", "generation": generation},
                "spec": {}, "status": {"state": state}
            }))
            .unwrap()
        };
        let mut seen = BTreeMap::new();
        let of = SpecWake::of::<crate::api::ClusterPolicy>;
        assert!(wakes_on(
            &mut seen,
            &Event::Apply(policy(1, "notReady")),
            of
        ));
        assert!(!wakes_on(&mut seen, &Event::Apply(policy(1, "ready")), of));
        assert!(wakes_on(&mut seen, &Event::Apply(policy(2, "ready")), of));
        let mut labelled = policy(2, "ready");
        labelled
            .metadata
            .labels
            .get_or_insert_default()
            .insert("team".into(), "ml".into());
        assert!(wakes_on(&mut seen, &Event::Apply(labelled), of));
    }

    #[test]
    fn a_changed_label_or_annotation_of_a_daemon_set_wakes_the_reconcile() {
        let mut seen = BTreeMap::new();
        let ds = daemon_set(1, 1, 10, 10);
        assert!(daemon_set_wakes(&mut seen, &Event::Apply(ds.clone())));
        assert!(!daemon_set_wakes(&mut seen, &Event::Apply(ds.clone())));
        let mut edited = ds;
        edited
            .metadata
            .annotations
            .get_or_insert_default()
            .insert("x".into(), "y".into());
        assert!(daemon_set_wakes(&mut seen, &Event::Apply(edited)));
    }

    fn pod(name: &str, app: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"app": app}},
            "spec": {"nodeName": "gpu-1", "containers": []},
        }))
        .unwrap()
    }

    #[test]
    fn two_watches_filling_one_cache_each_relist_only_their_own_objects() {
        let cache: ViewCache<ToolkitPod> = ViewCache::default();
        // Two watches, as the driver and validator pod selectors fill the upgrade's cache.
        cache
            .watches
            .fetch_add(2, std::sync::atomic::Ordering::SeqCst);
        let (mut drivers, mut validators) = (WatchState::default(), WatchState::default());
        let listed =
            |cache: &ViewCache<ToolkitPod>, state: &mut WatchState<ToolkitPod>, pods: &[Pod]| {
                cache.apply(Event::Init, ToolkitPod::of, state);
                for p in pods {
                    cache.apply(Event::InitApply(p.clone()), ToolkitPod::of, state);
                }
                cache.apply(Event::<Pod>::InitDone, ToolkitPod::of, state);
            };
        listed(
            &cache,
            &mut drivers,
            &[pod("driver-a", "driver"), pod("driver-b", "driver")],
        );
        assert!(!*cache.ready.borrow(), "one of two watches has listed");
        listed(&cache, &mut validators, &[pod("validator-a", "validator")]);
        assert!(*cache.ready.borrow());
        let names = |cache: &ViewCache<ToolkitPod>| {
            let mut n: Vec<String> = cache.snapshot().iter().map(|p| p.name.clone()).collect();
            n.sort();
            n
        };
        assert_eq!(names(&cache), ["driver-a", "driver-b", "validator-a"]);
        // A relist of the drivers drops the driver gone, and keeps the validator.
        listed(&cache, &mut drivers, &[pod("driver-a", "driver")]);
        assert_eq!(names(&cache), ["driver-a", "validator-a"]);
    }
}
