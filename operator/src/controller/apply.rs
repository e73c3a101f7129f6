//! Apply stage (IO): server-side apply of the desired objects with one field manager, in a
//! fixed order, sending only the objects [`plan`](super::plan) says differ from what we last
//! sent or lost a field we set (decision 9); then pruning of owned objects that were not
//! rendered, per operand, only for operands that rendered or were disabled (never for invalid
//! ones, decision 8). An object the API server refuses freezes its operand (reported, kept out
//! of pruning) and the other operands go on (decision 18).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, ObjectMeta, Patch, PatchParams,
};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::plan::{self, APPLIED_HASH_ANNOTATION, Ledger, Live, Plan, Rejection, is_ours};
use super::stores::Stores;
use crate::model::{Kind, MANAGER, OPERAND_LABEL, Operand, OperandObjects};
use crate::operands::device_plugin::{self, CONFIG_COPY_LABEL};
use crate::operands::{gfd, mps};
use crate::render::{DesiredState, Outcome};

#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error("applying {kind} {name}: {source}")]
    Apply {
        kind: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("deleting {kind} {name}: {source}")]
    Delete {
        kind: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("listing {resource} to prune: {source}")]
    List {
        resource: String,
        #[source]
        source: kube::Error,
    },
    #[error("serialising {kind} {name}: {source}")]
    Serialize {
        kind: &'static str,
        name: String,
        #[source]
        source: serde_json::Error,
    },
}

/// What one apply pass did, for logs, status, metrics and tests.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ApplyReport {
    /// Objects sent this pass.
    pub applied: Vec<String>,
    pub unchanged: usize,
    /// Objects whose last write the cache has not shown yet (not sent again).
    pub awaiting_cache: Vec<String>,
    pub pruned: Vec<String>,
    /// Operands frozen because the API server refused one of their objects.
    pub rejected: BTreeMap<Operand, Rejection>,
    /// When a refused object that may pass later is sent again (the next pass must come then).
    pub retry_after: Option<Duration>,
}

impl ApplyReport {
    /// What this pass wrote, pruned or still waits to see in the caches: the next pass comes
    /// soon while any is left.
    pub fn unsettled(&self) -> Vec<String> {
        self.applied
            .iter()
            .chain(&self.pruned)
            .chain(&self.awaiting_cache)
            .cloned()
            .collect()
    }
}

/// Why one operand's objects could not all be applied.
enum OperandFailure {
    /// The API server refused an object: the operand is frozen, the pass goes on.
    Rejected(Rejection),
    /// Anything else (the API unreachable, throttled, a conflict): the pass fails and is retried.
    Failed(ApplyError),
}

impl From<ApplyError> for OperandFailure {
    fn from(e: ApplyError) -> Self {
        OperandFailure::Failed(e)
    }
}

/// Whether an API error means the object itself is refused (invalid, forbidden, unknown kind),
/// which sending it again cannot fix, rather than a transient failure.
fn rejection(object: String, error: &kube::Error) -> Option<Rejection> {
    let kube::Error::Api(status) = error else {
        return None;
    };
    let transient = [408, 409, 429].contains(&status.code);
    if !(400..500).contains(&status.code) || transient {
        return None;
    }
    let field = status
        .details
        .as_ref()
        .and_then(|d| d.causes.iter().find(|c| !c.field.is_empty()))
        .map(|c| c.field.clone());
    Some(Rejection {
        object,
        field,
        message: status.message.clone(),
        code: status.code,
        not_ours: false,
    })
}

/// The fields of `desired` to compare: everything but status and the metadata the server owns.
fn comparable<K: Serialize>(desired: &K) -> Result<Value, serde_json::Error> {
    let mut value = serde_json::to_value(desired)?;
    if let Value::Object(map) = &mut value {
        map.remove("status");
    }
    Ok(value)
}

/// The API resource of an optional kind we render. kube guesses the plural from the kind, and
/// the guess for SecurityContextConstraints (a kind that is already plural) is wrong.
fn api_resource(gvk: &kube::core::GroupVersionKind) -> kube::core::ApiResource {
    match gvk.kind.as_str() {
        "SecurityContextConstraints" => {
            kube::core::ApiResource::from_gvk_with_plural(gvk, "securitycontextconstraints")
        }
        _ => kube::core::ApiResource::from_gvk(gvk),
    }
}

/// How to reach the API of a typed kind: namespaced kinds in the object's namespace, cluster
/// kinds at the root.
pub trait ScopedApi: Resource<DynamicType = ()> + Sized {
    fn api(client: &Client, namespace: Option<&str>) -> Api<Self>;

    /// What to send in place of `rendered` over `live`, when not `rendered` itself: only a
    /// DaemonSet adopted from NVIDIA's operator keeps its live pod template
    /// (takeover::keep_adopted_template).
    fn adopted(_rendered: &Self, _live: &Self) -> Option<Self> {
        None
    }
}

impl ScopedApi for DaemonSet {
    fn api(client: &Client, namespace: Option<&str>) -> Api<Self> {
        Api::namespaced(client.clone(), namespace.unwrap_or_default())
    }

    fn adopted(rendered: &Self, live: &Self) -> Option<Self> {
        crate::takeover::keep_adopted_template(rendered, live)
    }
}

macro_rules! namespaced_api {
    ($($kind:ty),*) => {$(
        impl ScopedApi for $kind {
            fn api(client: &Client, namespace: Option<&str>) -> Api<Self> {
                Api::namespaced(client.clone(), namespace.unwrap_or_default())
            }
        }
    )*};
}

macro_rules! cluster_api {
    ($($kind:ty),*) => {$(
        impl ScopedApi for $kind {
            fn api(client: &Client, _namespace: Option<&str>) -> Api<Self> {
                Api::all(client.clone())
            }
        }
    )*};
}

namespaced_api!(
    ServiceAccount,
    Role,
    RoleBinding,
    ConfigMap,
    Service,
    Deployment
);
cluster_api!(ClusterRole, ClusterRoleBinding, RuntimeClass);

fn key<K: Resource<DynamicType = ()>>(obj: &K) -> String {
    format!(
        "{}/{}/{}",
        K::kind(&()),
        obj.namespace().unwrap_or_default(),
        obj.name_any()
    )
}

struct Applier<'a> {
    client: &'a Client,
    params: PatchParams,
    ledger: &'a mut Ledger,
    report: ApplyReport,
    desired_keys: BTreeSet<String>,
    /// The active owner's UID: an existing object it owns is ours ([`is_ours`]).
    owner_uid: Option<String>,
    /// An object with a name we render exists and is not ours: look again later.
    not_ours_seen: bool,
}

/// How soon an operand frozen by an object that is not ours is looked at again: deleting or
/// adopting that object sends no event we watch (it carries none of our labels).
const NOT_OURS_RECHECK: Duration = Duration::from_secs(10);

/// A rendered object as it is sent: with [`APPLIED_HASH_ANNOTATION`] set to the hash of the
/// rendering, and its JSON form for the comparison. The hash is taken over the JSON value, whose
/// maps are sorted, so typed and dynamic objects hash alike.
fn annotated<K: Resource + Serialize + Clone>(
    rendered: &K,
    kind: &'static str,
) -> Result<(K, String, Value), ApplyError> {
    let serialize = |source| ApplyError::Serialize {
        kind,
        name: rendered.meta().name.clone().unwrap_or_default(),
        source,
    };
    let hash = plan::applied_hash(&serde_json::to_value(rendered).map_err(serialize)?)
        .map_err(serialize)?;
    let mut sent = rendered.clone();
    sent.meta_mut()
        .annotations
        .get_or_insert_default()
        .insert(APPLIED_HASH_ANNOTATION.to_owned(), hash.clone());
    let desired = comparable(&sent).map_err(serialize)?;
    Ok((sent, hash, desired))
}

/// What one send did.
enum Sent {
    /// Applied: the object's new `resourceVersion`.
    Written(Option<String>),
    /// Not sent: an object with that name exists and is not ours ([`is_ours`]).
    NotOurs,
}

/// The answer to one send.
type Answer = Result<Sent, kube::Error>;

/// An object the plan says to send, with what recording its answer needs.
struct Outgoing {
    operand: Operand,
    key: String,
    kind: &'static str,
    name: String,
    /// `Kind namespace/name`, for a refusal's message.
    object: String,
    hash: String,
    /// The cached `resourceVersion` the write starts from.
    before: Option<String>,
}

/// Applies in flight at once within a tier. One at a time, each apply waits out a round trip to
/// an API server that is busy creating the pods of the DaemonSets just applied; 32 send the
/// largest tier of a policy (~30 ServiceAccounts, roles and ConfigMaps) in one round trip and
/// stay well below the API server's default of 200 mutating requests in flight (the node
/// labeller's 16 included).
const APPLY_CONCURRENCY: usize = 32;

/// The apply tiers: every object of a tier is sent before any of the next. A tier's objects do
/// not depend on each other; bindings come after the roles they grant (the API server checks
/// a binding against the role's rules, so binding a role not yet created is refused), and
/// workloads after everything they use (decision: ServiceAccounts, RBAC, ConfigMaps,
/// RuntimeClass, Services, then DaemonSets and Deployments).
const TIERS: [&[Kind]; 3] = [
    &[
        Kind::ServiceAccount,
        Kind::ClusterRole,
        Kind::Role,
        Kind::ConfigMap,
        Kind::RuntimeClass,
        Kind::Service,
    ],
    &[Kind::ClusterRoleBinding, Kind::RoleBinding],
    &[Kind::DaemonSet, Kind::Deployment],
];

impl Applier<'_> {
    /// Sends `sent` when the plan says so, recording the outcome in the ledger.
    #[allow(clippy::too_many_arguments)]
    async fn apply_one<K>(
        &mut self,
        api: &Api<K>,
        key: String,
        kind: &'static str,
        sent: &K,
        hash: &str,
        desired: &Value,
        live: Option<Live<'_>>,
    ) -> Result<(), OperandFailure>
    where
        K: Resource + Clone + Debug + Serialize + DeserializeOwned,
    {
        let reason = match plan::plan(self.ledger, &key, hash, desired, live, Instant::now()) {
            Plan::Unchanged => {
                self.report.unchanged += 1;
                return Ok(());
            }
            Plan::AwaitingCache => {
                self.report.awaiting_cache.push(key);
                return Ok(());
            }
            Plan::StillRejected(rejection) => return Err(OperandFailure::Rejected(rejection)),
            Plan::Apply(reason) => reason,
        };
        let name = sent.meta().name.clone().unwrap_or_default();
        tracing::debug!(object = %key, difference = %reason, "applying");
        let before = live.and_then(|l| l.resource_version);
        match api.patch(&name, &self.params, &Patch::Apply(sent)).await {
            Ok(answer) => {
                self.ledger.written(
                    &key,
                    hash,
                    before,
                    answer.meta().resource_version.clone(),
                    Instant::now(),
                );
                self.report.applied.push(key);
                Ok(())
            }
            Err(source) => {
                let object = match sent.meta().namespace.as_deref() {
                    Some(ns) => format!("{kind} {ns}/{name}"),
                    None => format!("{kind} {name}"),
                };
                match rejection(object, &source) {
                    Some(rejection) => {
                        tracing::warn!(object = %key, %rejection, "object rejected; its operand is frozen");
                        self.ledger
                            .rejected(&key, hash, rejection.clone(), Instant::now());
                        Err(OperandFailure::Rejected(rejection))
                    }
                    None => Err(OperandFailure::Failed(ApplyError::Apply {
                        kind,
                        name,
                        source,
                    })),
                }
            }
        }
    }

    /// Plans `objects` (one operand's objects of kind `K`) against the cache and queues those
    /// to send in `sends`. An object the API server refused before, rendered the same, stops the
    /// operand's remaining objects as a refusal now would.
    fn plan_kind<K>(
        &mut self,
        operand: Operand,
        objects: &[K],
        live: &Store<K>,
        sends: &mut Vec<(Outgoing, BoxFuture<'static, Answer>)>,
    ) -> Result<(), OperandFailure>
    where
        K: ScopedApi + Clone + Debug + Serialize + DeserializeOwned + Send + Sync + 'static,
    {
        for obj in objects {
            let name = obj.name_any();
            let kind = kind_name::<K>();
            let key = key(obj);
            self.desired_keys.insert(key.clone());
            let mut object_ref = ObjectRef::<K>::new(&name);
            if let Some(ns) = obj.namespace() {
                object_ref = object_ref.within(&ns);
            }
            let current = live.get(&object_ref);
            let kept = current.as_deref().and_then(|c| K::adopted(obj, c));
            let (sent, hash, desired) = annotated(kept.as_ref().unwrap_or(obj), kind)?;
            // The ConfigMap cache holds the namespace's ConfigMaps, ours or not.
            if let Some(c) = &current
                && !is_ours(c.meta(), self.owner_uid.as_deref())
            {
                self.not_ours_seen = true;
                let namespace = obj.namespace();
                return Err(OperandFailure::Rejected(Rejection::not_ours(
                    kind,
                    namespace.as_deref(),
                    &name,
                )));
            }
            let current_value = current
                .as_ref()
                .map(|c| serde_json::to_value(c.as_ref()))
                .transpose()
                .map_err(|source| ApplyError::Serialize {
                    kind,
                    name: name.clone(),
                    source,
                })?;
            let live = current
                .as_ref()
                .zip(current_value.as_ref())
                .map(|(c, v)| Live {
                    object: v,
                    resource_version: c.meta().resource_version.as_deref(),
                });
            let reason = match plan::plan(self.ledger, &key, &hash, &desired, live, Instant::now())
            {
                Plan::Unchanged => {
                    self.report.unchanged += 1;
                    continue;
                }
                Plan::AwaitingCache => {
                    self.report.awaiting_cache.push(key);
                    continue;
                }
                Plan::StillRejected(rejection) => return Err(OperandFailure::Rejected(rejection)),
                Plan::Apply(reason) => reason,
            };
            tracing::debug!(object = %key, difference = %reason, "applying");
            let object = match obj.namespace() {
                Some(ns) => format!("{kind} {ns}/{name}"),
                None => format!("{kind} {name}"),
            };
            let api = K::api(self.client, obj.namespace().as_deref());
            let params = self.params.clone();
            let patch_name = name.clone();
            // The caches hold only what is labelled ours: an object they lack may still
            // exist, made by someone else, and a forced apply would take it over.
            let first_write = current.is_none();
            let owner_uid = self.owner_uid.clone();
            let request = async move {
                if first_write
                    && let Some(existing) = api.get_metadata_opt(&patch_name).await?
                    && !is_ours(&existing.metadata, owner_uid.as_deref())
                {
                    return Ok(Sent::NotOurs);
                }
                api.patch(&patch_name, &params, &Patch::Apply(&sent))
                    .await
                    .map(|answer| Sent::Written(answer.meta().resource_version.clone()))
            };
            let outgoing = Outgoing {
                operand,
                key,
                kind,
                name,
                object,
                hash,
                before: live.and_then(|l| l.resource_version.map(str::to_owned)),
            };
            sends.push((outgoing, request.boxed()));
        }
        Ok(())
    }

    /// Plans one operand's objects of `kinds` (one tier) into `sends`.
    fn plan_tier(
        &mut self,
        operand: Operand,
        objects: &OperandObjects,
        kinds: &[Kind],
        stores: &Stores,
        sends: &mut Vec<(Outgoing, BoxFuture<'static, Answer>)>,
    ) -> Result<(), OperandFailure> {
        for kind in kinds {
            let (o, s) = (objects, stores);
            match kind {
                Kind::ServiceAccount => {
                    self.plan_kind(operand, &o.service_accounts, &s.service_accounts, sends)?
                }
                Kind::ClusterRole => {
                    self.plan_kind(operand, &o.cluster_roles, &s.cluster_roles, sends)?
                }
                Kind::ClusterRoleBinding => self.plan_kind(
                    operand,
                    &o.cluster_role_bindings,
                    &s.cluster_role_bindings,
                    sends,
                )?,
                Kind::Role => self.plan_kind(operand, &o.roles, &s.roles, sends)?,
                Kind::RoleBinding => {
                    self.plan_kind(operand, &o.role_bindings, &s.role_bindings, sends)?
                }
                Kind::ConfigMap => {
                    self.plan_kind(operand, &o.config_maps, &s.config_maps, sends)?
                }
                Kind::RuntimeClass => {
                    self.plan_kind(operand, &o.runtime_classes, &s.runtime_classes, sends)?
                }
                Kind::Service => self.plan_kind(operand, &o.services, &s.services, sends)?,
                Kind::DaemonSet => {
                    self.plan_kind(operand, &o.daemon_sets, &s.daemon_sets, sends)?
                }
                Kind::Deployment => {
                    self.plan_kind(operand, &o.deployments, &s.deployments, sends)?
                }
            }
        }
        Ok(())
    }

    /// Sends one tier's objects, [`APPLY_CONCURRENCY`] at a time, and records each answer in
    /// the ledger. A refusal freezes its operand; any other failure is returned once every
    /// answer of the tier is recorded (the writes that did succeed are not repeated).
    async fn send_tier(
        &mut self,
        sends: Vec<(Outgoing, BoxFuture<'static, Answer>)>,
    ) -> Result<(), ApplyError> {
        let (sends, requests): (Vec<_>, Vec<_>) = sends.into_iter().unzip();
        let answers: Vec<_> = futures::stream::iter(requests)
            .buffered(APPLY_CONCURRENCY)
            .collect()
            .await;
        let mut failure = None;
        for (send, answer) in sends.into_iter().zip(answers) {
            match answer {
                Ok(Sent::NotOurs) => {
                    tracing::warn!(object = %send.key, "an object with this name exists and is not ours; its operand is frozen");
                    self.not_ours_seen = true;
                    let (namespace, name) = namespace_and_name(&send.key);
                    self.report
                        .rejected
                        .entry(send.operand)
                        .or_insert_with(|| Rejection::not_ours(send.kind, namespace, name));
                }
                Ok(Sent::Written(after)) => {
                    self.ledger.written(
                        &send.key,
                        &send.hash,
                        send.before.as_deref(),
                        after,
                        Instant::now(),
                    );
                    self.report.applied.push(send.key);
                }
                Err(source) => match rejection(send.object, &source) {
                    Some(rejection) => {
                        tracing::warn!(object = %send.key, %rejection, "object rejected; its operand is frozen");
                        self.ledger.rejected(
                            &send.key,
                            &send.hash,
                            rejection.clone(),
                            Instant::now(),
                        );
                        self.report
                            .rejected
                            .entry(send.operand)
                            .or_insert(rejection);
                    }
                    None => {
                        failure.get_or_insert(ApplyError::Apply {
                            kind: send.kind,
                            name: send.name,
                            source,
                        });
                    }
                },
            }
        }
        failure.map_or(Ok(()), Err)
    }

    /// Objects of optional APIs without a store (ServiceMonitor, SCC): read one by one (a read
    /// per object and pass, but no write when nothing changed), then planned like the others.
    async fn apply_dynamic(&mut self, objects: &[DynamicObject]) -> Result<(), OperandFailure> {
        for obj in objects {
            let Some(types) = obj.types.clone() else {
                continue;
            };
            let (group, version) = types
                .api_version
                .split_once('/')
                .unwrap_or(("", types.api_version.as_str()));
            let gvk = kube::core::GroupVersionKind::gvk(group, version, &types.kind);
            let resource = api_resource(&gvk);
            let name = obj.name_any();
            let key = format!(
                "{}/{}/{}",
                types.kind,
                obj.namespace().unwrap_or_default(),
                name
            );
            self.desired_keys.insert(key.clone());
            let api: Api<DynamicObject> = match obj.namespace() {
                Some(ns) => Api::namespaced_with(self.client.clone(), &ns, &resource),
                None => Api::all_with(self.client.clone(), &resource),
            };
            let (sent, hash, desired) = annotated(obj, "dynamic")?;
            let current = api
                .get_opt(&name)
                .await
                .map_err(|source| ApplyError::Apply {
                    kind: "dynamic",
                    name: name.clone(),
                    source,
                })?;
            if let Some(c) = &current
                && !is_ours(&c.metadata, self.owner_uid.as_deref())
            {
                self.not_ours_seen = true;
                let namespace = obj.namespace();
                return Err(OperandFailure::Rejected(Rejection::not_ours(
                    &types.kind,
                    namespace.as_deref(),
                    &name,
                )));
            }
            let current_value = current
                .as_ref()
                .map(comparable)
                .transpose()
                .map_err(|source| ApplyError::Serialize {
                    kind: "dynamic",
                    name: name.clone(),
                    source,
                })?;
            let live = current
                .as_ref()
                .zip(current_value.as_ref())
                .map(|(c, v)| Live {
                    object: v,
                    resource_version: c.metadata.resource_version.as_deref(),
                });
            let kind = match types.kind.as_str() {
                "ServiceMonitor" => "ServiceMonitor",
                "SecurityContextConstraints" => "SecurityContextConstraints",
                _ => "object",
            };
            self.apply_one(&api, key, kind, &sent, &hash, &desired, live)
                .await?;
        }
        Ok(())
    }
}

/// The namespace (none for a cluster-scoped object) and name in a ledger key
/// (`Kind/namespace/name`).
fn namespace_and_name(key: &str) -> (Option<&str>, &str) {
    let mut parts = key.splitn(3, '/').skip(1);
    let namespace = parts.next().filter(|ns| !ns.is_empty());
    (namespace, parts.next().unwrap_or_default())
}

fn kind_name<K: Resource<DynamicType = ()>>() -> &'static str {
    // Resource::kind returns a Cow of a static str for typed resources.
    match K::kind(&()) {
        std::borrow::Cow::Borrowed(s) => s,
        std::borrow::Cow::Owned(_) => "object",
    }
}

/// Applies every rendered operand tier by tier ([`TIERS`]), the objects of a tier concurrently,
/// then prunes. `owner_uid` is the active policy's
/// UID: only objects it owns are pruned. `optional` are the store-less kinds (ServiceMonitor,
/// SCC) this cluster serves, whose leftovers are found by listing (namespaced ones in
/// `namespace`, the operator's, where all of ours are). An operand with a refused
/// object is frozen and reported; any other failure stops the pass (the reconcile retries
/// with backoff).
pub async fn apply(
    client: &Client,
    desired: &DesiredState,
    stores: &Stores,
    ledger: &mut Ledger,
    owner_uid: Option<&str>,
    optional: &[ApiResource],
    namespace: &str,
) -> Result<ApplyReport, ApplyError> {
    let mut applier = Applier {
        client,
        params: PatchParams::apply(MANAGER).force(),
        ledger,
        report: ApplyReport::default(),
        desired_keys: BTreeSet::new(),
        owner_uid: owner_uid.map(str::to_owned),
        not_ours_seen: false,
    };
    let rendered: Vec<(Operand, &OperandObjects)> = desired
        .operands
        .iter()
        .filter_map(|state| match &state.outcome {
            Outcome::Rendered(objects) => Some((state.operand, objects)),
            _ => None,
        })
        .collect();
    for kinds in TIERS {
        let mut sends = Vec::new();
        for (operand, objects) in &rendered {
            if applier.report.rejected.contains_key(operand) {
                continue;
            }
            match applier.plan_tier(*operand, objects, kinds, stores, &mut sends) {
                Ok(()) => {}
                Err(OperandFailure::Rejected(rejection)) => {
                    applier.report.rejected.insert(*operand, rejection);
                }
                Err(OperandFailure::Failed(e)) => return Err(e),
            }
        }
        applier.send_tier(sends).await?;
    }
    // Objects of optional APIs are read one by one before they are planned: last, per operand.
    for (operand, objects) in &rendered {
        if applier.report.rejected.contains_key(operand) {
            continue;
        }
        match applier.apply_dynamic(&objects.dynamic).await {
            Ok(()) => {}
            Err(OperandFailure::Rejected(rejection)) => {
                applier.report.rejected.insert(*operand, rejection);
            }
            Err(OperandFailure::Failed(e)) => return Err(e),
        }
    }
    let Applier {
        mut report,
        desired_keys,
        ledger,
        not_ours_seen,
        ..
    } = applier;
    let operands = prunable(desired, &report.rejected);
    report.pruned = prune(client, &operands, stores, &desired_keys, owner_uid).await?;
    for resource in optional {
        prune_dynamic(
            client,
            resource,
            namespace,
            &operands,
            &desired_keys,
            owner_uid,
            &mut report.pruned,
        )
        .await?;
    }
    for key in &report.pruned {
        ledger.forget(key);
    }
    report.retry_after = ledger.next_retry(Instant::now(), |key| desired_keys.contains(key));
    if not_ours_seen {
        report.retry_after = Some(
            report
                .retry_after
                .map_or(NOT_OURS_RECHECK, |r| r.min(NOT_OURS_RECHECK)),
        );
    }
    Ok(report)
}

/// Names of operands whose leftovers may be pruned: rendered or disabled ones, except those
/// frozen by a refused object (their last good objects stay).
fn prunable(
    desired: &DesiredState,
    rejected: &BTreeMap<Operand, Rejection>,
) -> BTreeSet<&'static str> {
    desired
        .operands
        .iter()
        .filter(|s| !matches!(s.outcome, Outcome::Invalid(_)) && !rejected.contains_key(&s.operand))
        .map(|s| s.operand.name())
        .collect()
}

async fn prune(
    client: &Client,
    operands: &BTreeSet<&'static str>,
    stores: &Stores,
    keep: &BTreeSet<String>,
    owner: Option<&str>,
) -> Result<Vec<String>, ApplyError> {
    let mut pruned = Vec::new();
    // Old sharing-config and script copies stay while pods that mount them may still run
    // (decision 4).
    let daemon_sets: Vec<_> = stores.daemon_sets.state();
    let copies: Vec<_> = stores
        .config_maps
        .state()
        .into_iter()
        .filter(|cm| cm.labels().contains_key(CONFIG_COPY_LABEL))
        .collect();
    let copy_names: BTreeSet<String> = copies.iter().map(|cm| cm.name_any()).collect();
    let keep = &if daemon_sets
        .iter()
        .any(|ds| copy_rollout_in_progress(ds, &copy_names))
    {
        let mut keep = keep.clone();
        keep.extend(copies.iter().map(|cm| key(cm.as_ref())));
        keep
    } else {
        keep.clone()
    };
    // Reverse apply order: workloads first, then what they use.
    for kind in Kind::ALL.into_iter().rev() {
        let (o, k, p) = (operands, keep, &mut pruned);
        match kind {
            Kind::Deployment => prune_kind(client, &stores.deployments, o, k, owner, p).await?,
            Kind::DaemonSet => prune_kind(client, &stores.daemon_sets, o, k, owner, p).await?,
            Kind::Service => prune_kind(client, &stores.services, o, k, owner, p).await?,
            Kind::RuntimeClass => {
                let mut keep = k.clone();
                keep.extend(
                    runtime_classes_in_use(client, &stores.runtime_classes, o, k, owner).await?,
                );
                prune_kind(client, &stores.runtime_classes, o, &keep, owner, p).await?
            }
            Kind::ConfigMap => prune_kind(client, &stores.config_maps, o, k, owner, p).await?,
            Kind::RoleBinding => prune_kind(client, &stores.role_bindings, o, k, owner, p).await?,
            Kind::Role => prune_kind(client, &stores.roles, o, k, owner, p).await?,
            Kind::ClusterRoleBinding => {
                prune_kind(client, &stores.cluster_role_bindings, o, k, owner, p).await?
            }
            Kind::ClusterRole => prune_kind(client, &stores.cluster_roles, o, k, owner, p).await?,
            Kind::ServiceAccount => {
                prune_kind(client, &stores.service_accounts, o, k, owner, p).await?
            }
        }
    }
    Ok(pruned)
}

/// Keys of the leftover RuntimeClasses that pods not yet finished name: deleting one would
/// leave those pods unable to restart. Pods are listed (in pages) only when a RuntimeClass is
/// about to be pruned, which happens when an operand is switched off, not while steady.
async fn runtime_classes_in_use(
    client: &Client,
    live: &Store<RuntimeClass>,
    operands: &BTreeSet<&'static str>,
    keep: &BTreeSet<String>,
    owner: Option<&str>,
) -> Result<BTreeSet<String>, ApplyError> {
    let leftovers: BTreeSet<String> = live
        .state()
        .iter()
        .filter(|rc| is_leftover(rc.meta(), &key(rc.as_ref()), operands, keep, owner))
        .map(|rc| rc.name_any())
        .collect();
    if leftovers.is_empty() {
        return Ok(BTreeSet::new());
    }
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::all(client.clone());
    let mut params = ListParams::default()
        .fields("status.phase!=Succeeded,status.phase!=Failed")
        .limit(500);
    let mut in_use = BTreeSet::new();
    loop {
        let page = pods
            .list(&params)
            .await
            .map_err(|source| ApplyError::List {
                resource: "pods".to_owned(),
                source,
            })?;
        for pod in &page.items {
            if let Some(class) = pod
                .spec
                .as_ref()
                .and_then(|s| s.runtime_class_name.as_ref())
                && leftovers.contains(class)
                && in_use.insert(format!("RuntimeClass//{class}"))
            {
                tracing::info!(runtime_class = %class, "not pruned: running pods name it");
            }
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(in_use),
        }
    }
}

/// Whether `ds` mounts copies (a sharing-config consumer: device plugin, GFD, MPS daemon; or a
/// DaemonSet whose template mounts one of `copies`, the live copies' names, such as a script)
/// and has pods that may still mount an older copy: its rollout is not yet observed, or not
/// every pod runs the current template (under OnDelete, until each old pod is replaced).
fn copy_rollout_in_progress(ds: &DaemonSet, copies: &BTreeSet<String>) -> bool {
    let consumers = [device_plugin::NAME, gfd::NAME, mps::NAME];
    let mounts_a_copy = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.volumes.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|v| v.config_map.as_ref())
        .any(|c| copies.contains(&c.name));
    if !consumers.contains(&ds.name_any().as_str()) && !mounts_a_copy {
        return false;
    }
    let status = ds.status.clone().unwrap_or_default();
    status.observed_generation.unwrap_or(0) < ds.metadata.generation.unwrap_or(0)
        || status.updated_number_scheduled.unwrap_or(0) < status.desired_number_scheduled
        || status.number_available.unwrap_or(0) < status.desired_number_scheduled
}

/// Deletes live objects of kind `K` that belong to a prunable operand, are owned by the active
/// policy (when its UID is known), and were not rendered in this pass.
async fn prune_kind<K>(
    client: &Client,
    live: &Store<K>,
    operands: &BTreeSet<&'static str>,
    keep: &BTreeSet<String>,
    owner: Option<&str>,
    pruned: &mut Vec<String>,
) -> Result<(), ApplyError>
where
    K: ScopedApi + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
{
    for obj in live.state() {
        if !is_leftover(obj.meta(), &key(obj.as_ref()), operands, keep, owner) {
            continue;
        }
        let name = obj.name_any();
        let api = K::api(client, obj.namespace().as_deref());
        match api.delete(&name, &DeleteParams::background()).await {
            Ok(_) => pruned.push(key(obj.as_ref())),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(source) => {
                return Err(ApplyError::Delete {
                    kind: kind_name::<K>(),
                    name,
                    source,
                });
            }
        }
    }
    Ok(())
}

/// Whether an object is ours to delete: labelled with a prunable operand, owned by the active
/// policy (when its UID is known), not rendered in this pass (`key` not in `keep`) and not
/// already being deleted.
fn is_leftover(
    meta: &ObjectMeta,
    key: &str,
    operands: &BTreeSet<&'static str>,
    keep: &BTreeSet<String>,
    owner: Option<&str>,
) -> bool {
    let labelled = meta
        .labels
        .as_ref()
        .and_then(|l| l.get(OPERAND_LABEL))
        .is_some_and(|operand| operands.contains(operand.as_str()));
    let owned =
        owner.is_none_or(|uid| meta.owner_references.iter().flatten().any(|r| r.uid == uid));
    labelled && owned && !keep.contains(key) && meta.deletion_timestamp.is_none()
}

/// Prunes a store-less kind: lists the objects carrying the operand label (one request per
/// pass and kind) and deletes the leftovers, e.g. the ServiceMonitor of a DCGM exporter that
/// was disabled, or an SCC an operand no longer needs. A namespaced kind is listed in
/// `namespace` only: the operator may write nowhere else. A kind the cluster does not serve
/// (404) has nothing to prune.
async fn prune_dynamic(
    client: &Client,
    resource: &ApiResource,
    namespace: &str,
    operands: &BTreeSet<&'static str>,
    keep: &BTreeSet<String>,
    owner: Option<&str>,
    pruned: &mut Vec<String>,
) -> Result<(), ApplyError> {
    let all: Api<DynamicObject> =
        match crate::render::rbac::scope(&resource.group, &resource.plural) {
            Some(crate::render::rbac::Scope::Cluster) => Api::all_with(client.clone(), resource),
            _ => Api::namespaced_with(client.clone(), namespace, resource),
        };
    let listed = match all.list(&ListParams::default().labels(OPERAND_LABEL)).await {
        Ok(list) => list.items,
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(()),
        Err(source) => {
            return Err(ApplyError::List {
                resource: resource.plural.clone(),
                source,
            });
        }
    };
    for obj in listed {
        let namespace = obj.namespace();
        let name = obj.name_any();
        let key = format!(
            "{}/{}/{name}",
            resource.kind,
            namespace.clone().unwrap_or_default()
        );
        if !is_leftover(&obj.metadata, &key, operands, keep, owner) {
            continue;
        }
        let api: Api<DynamicObject> = match namespace.as_deref() {
            Some(ns) => Api::namespaced_with(client.clone(), ns, resource),
            None => Api::all_with(client.clone(), resource),
        };
        match api.delete(&name, &DeleteParams::background()).await {
            Ok(_) => pruned.push(key),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(source) => {
                return Err(ApplyError::Delete {
                    kind: "dynamic",
                    name,
                    source,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn consumer(
        name: &str,
        generation: i64,
        observed: i64,
        desired: i32,
        updated: i32,
    ) -> DaemonSet {
        serde_json::from_value(json!({
            "metadata": {"name": name, "generation": generation},
            "status": {"observedGeneration": observed, "desiredNumberScheduled": desired,
                "updatedNumberScheduled": updated, "numberAvailable": desired,
                "currentNumberScheduled": desired, "numberMisscheduled": 0, "numberReady": desired}
        }))
        .unwrap()
    }

    #[test]
    fn every_kind_is_in_one_tier_and_bindings_follow_their_roles() {
        let tier_of = |kind: Kind| {
            let tiers: Vec<usize> = TIERS
                .iter()
                .enumerate()
                .filter(|(_, kinds)| kinds.contains(&kind))
                .map(|(i, _)| i)
                .collect();
            assert_eq!(tiers.len(), 1, "{kind:?} is in tiers {tiers:?}");
            tiers[0]
        };
        for kind in Kind::ALL {
            tier_of(kind);
        }
        assert!(tier_of(Kind::ClusterRole) < tier_of(Kind::ClusterRoleBinding));
        assert!(tier_of(Kind::Role) < tier_of(Kind::RoleBinding));
        for used in [
            Kind::ServiceAccount,
            Kind::RoleBinding,
            Kind::ClusterRoleBinding,
            Kind::ConfigMap,
            Kind::RuntimeClass,
            Kind::Service,
        ] {
            assert!(tier_of(used) < tier_of(Kind::DaemonSet), "{used:?}");
            assert!(tier_of(used) < tier_of(Kind::Deployment), "{used:?}");
        }
    }

    #[test]
    fn old_config_copies_are_kept_while_a_consumer_rolls_out() {
        let none = BTreeSet::new();
        assert!(copy_rollout_in_progress(
            &consumer(device_plugin::NAME, 3, 3, 4, 2),
            &none
        ));
        assert!(copy_rollout_in_progress(
            &consumer(gfd::NAME, 3, 2, 4, 4),
            &none
        ));
        assert!(!copy_rollout_in_progress(
            &consumer(mps::NAME, 3, 3, 4, 4),
            &none
        ));
        // Other operands' rollouts do not hold copies back.
        assert!(!copy_rollout_in_progress(
            &consumer("nvidia-dcgm-exporter", 3, 3, 4, 2),
            &none
        ));
    }

    #[test]
    fn old_script_copies_are_kept_while_a_daemonset_mounting_one_has_old_pods() {
        let mut driver = consumer("nvidia-driver-daemonset", 3, 3, 4, 2);
        let copies = BTreeSet::from(["nvidia-driver-startup-probe-0123456789".to_owned()]);
        assert!(!copy_rollout_in_progress(&driver, &copies));
        driver.spec = Some(
            serde_json::from_value(json!({
                "selector": {},
                "template": {"spec": {"containers": [], "volumes": [
                    {"name": "probe", "configMap": {"name": "nvidia-driver-startup-probe-0123456789"}}
                ]}}
            }))
            .unwrap(),
        );
        // An OnDelete driver with two pods on the old template: their probe script stays.
        assert!(copy_rollout_in_progress(&driver, &copies));
        driver.status.as_mut().unwrap().updated_number_scheduled = Some(4);
        assert!(!copy_rollout_in_progress(&driver, &copies));
    }

    fn meta(operand: &str, owner: &str) -> ObjectMeta {
        ObjectMeta {
            name: Some("nvidia-dcgm-exporter".into()),
            labels: Some([(OPERAND_LABEL.to_owned(), operand.to_owned())].into()),
            owner_references: Some(vec![
                k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                    uid: owner.into(),
                    ..Default::default()
                },
            ]),
            ..ObjectMeta::default()
        }
    }

    #[test]
    fn a_leftover_is_a_prunable_operands_owned_object_not_rendered_this_pass() {
        let operands: BTreeSet<&'static str> = ["dcgm-exporter"].into();
        let key = "ServiceMonitor/gpu-operator/nvidia-dcgm-exporter";
        let none = BTreeSet::new();
        let ours = meta("dcgm-exporter", "uid-1");
        assert!(is_leftover(&ours, key, &operands, &none, Some("uid-1")));
        assert!(is_leftover(&ours, key, &operands, &none, None));
        // Rendered this pass, another policy's, an operand that is invalid (not prunable), or
        // already going.
        assert!(!is_leftover(
            &ours,
            key,
            &operands,
            &[key.to_owned()].into(),
            Some("uid-1")
        ));
        assert!(!is_leftover(&ours, key, &operands, &none, Some("uid-2")));
        let other = meta("device-plugin", "uid-1");
        assert!(!is_leftover(&other, key, &operands, &none, Some("uid-1")));
        let deleting = ObjectMeta {
            deletion_timestamp: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            )),
            ..ours.clone()
        };
        assert!(!is_leftover(
            &deleting,
            key,
            &operands,
            &none,
            Some("uid-1")
        ));
        let unlabelled = ObjectMeta {
            labels: None,
            ..ours
        };
        assert!(!is_leftover(
            &unlabelled,
            key,
            &operands,
            &none,
            Some("uid-1")
        ));
    }

    #[test]
    fn optional_kinds_reach_their_real_resource_names() {
        let scc = kube::core::GroupVersionKind::gvk(
            "security.openshift.io",
            "v1",
            "SecurityContextConstraints",
        );
        assert_eq!(api_resource(&scc).plural, "securitycontextconstraints");
        let monitor =
            kube::core::GroupVersionKind::gvk("monitoring.coreos.com", "v1", "ServiceMonitor");
        assert_eq!(api_resource(&monitor).plural, "servicemonitors");
    }

    #[test]
    fn every_optional_kind_has_a_known_scope_for_pruning() {
        use crate::render::rbac::{Scope, scope};
        let kinds = [
            crate::operands::dcgm_exporter::service_monitor_api_resource(),
            crate::operands::openshift::scc_api_resource(),
        ]
        .into_iter()
        .chain(crate::controller::gpu_cluster::optional_kinds());
        for kind in kinds {
            let want =
                if ["servicemonitors", "resourceclaimtemplates"].contains(&kind.plural.as_str()) {
                    Scope::Namespaced
                } else {
                    Scope::Cluster
                };
            assert_eq!(
                scope(&kind.group, &kind.plural),
                Some(want),
                "{}",
                kind.plural
            );
        }
    }
}
