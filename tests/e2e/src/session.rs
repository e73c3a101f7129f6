//! One operator session for an end-to-end test (IO), set up by one builder ([`builder`]): the
//! ClusterPolicy CRD (and others) installed, leftovers of failed tests removed, the operator
//! binary running with its own ServiceAccount identity and a policy created; plus the waits and
//! edits the tests share. Where this run has no test cluster, starting a session returns `None`
//! and the test returns (skipped; [`crate::cluster::prerequisite`]). A failed step panics: this
//! is test support, and the panic message is the test's failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpu_operator::api::{ClusterPolicy, State};
use gpu_operator::model::Kind;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use k8s_openapi::api::rbac::v1::ClusterRole;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

use crate::audit::{AuditLog, Mark};
use crate::cluster::unique_name;
use crate::nodes::{self, FakeNode, GpuModel};
use crate::operator::{Operator, OperatorIdentity};
use crate::{steady, wait};

pub const TIMEOUT: Duration = Duration::from_secs(120);

/// The DaemonSets a default policy renders on the fake fleet (mig-manager only on the
/// MIG-capable A100 and H100 nodes).
pub const DEFAULT_DAEMONSETS: [&str; 7] = [
    "nvidia-driver-daemonset",
    "nvidia-container-toolkit-daemonset",
    "nvidia-operator-validator",
    "nvidia-device-plugin-daemonset",
    "gpu-feature-discovery",
    "nvidia-dcgm-exporter",
    "nvidia-mig-manager",
];

pub struct Setup {
    pub admin: Client,
    pub identity: OperatorIdentity,
    pub operator: Operator,
    pub policy: String,
}

pub fn policies(client: &Client) -> Api<ClusterPolicy> {
    Api::all(client.clone())
}

/// Waits until policy `name` reports `want` for its current generation (a status written
/// before the last patch does not count).
pub async fn await_policy_state(
    client: &Client,
    name: &str,
    want: State,
    what: &str,
) -> anyhow::Result<ClusterPolicy> {
    let api = policies(client);
    wait::until(TIMEOUT, what, || {
        let api = api.clone();
        async move {
            let p = api.get(name).await?;
            let state = p.status.as_ref().map(|s| s.state);
            let observed = ready_condition(&p).and_then(|c| c.observed_generation);
            Ok(
                if state == Some(want) && observed >= p.metadata.generation {
                    Ok(p)
                } else {
                    Err(format!("{:?}", p.status))
                },
            )
        }
    })
    .await
}

/// The policy's `Ready` condition.
pub fn ready_condition(
    policy: &ClusterPolicy,
) -> Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    policy
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")
}

/// The reason and message of the policy's `Ready` condition (empty while it has none).
pub fn ready_reason_and_message(policy: &ClusterPolicy) -> (String, String) {
    ready_condition(policy)
        .map(|c| (c.reason.clone(), c.message.clone()))
        .unwrap_or_default()
}

/// The message of `component` in the policy's `status.components` (empty while it has none).
pub fn component_message(policy: &ClusterPolicy, component: &str) -> String {
    policy
        .status
        .as_ref()
        .and_then(|s| s.components.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.name == component))
        .and_then(|c| c.message.clone())
        .unwrap_or_default()
}

/// The message of the policy's `Ready` condition (empty when it has none yet).
pub async fn ready_message(client: &Client, name: &str) -> anyhow::Result<String> {
    let policy = policies(client).get(name).await?;
    Ok(ready_condition(&policy)
        .map(|c| c.message.clone())
        .unwrap_or_default())
}

pub async fn create_policy(client: &Client, name: &str, spec: serde_json::Value) {
    let policy: ClusterPolicy = serde_json::from_value(json!({
        "apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy",
        "metadata": {"name": name}, "spec": spec
    }))
    .unwrap();
    policies(client)
        .create(&PostParams::default(), &policy)
        .await
        .unwrap();
}

/// Label of nodes a test adds to the standard fleet; removed again by the next test if the
/// test that made them failed.
pub const EPHEMERAL: &str = "gpu-operator.test/ephemeral";

pub fn ephemeral_gpu_node(name: &str, model: GpuModel) -> FakeNode {
    FakeNode::gpu(name, model).label(EPHEMERAL, "true")
}

/// Removes what a failed test left behind (its policy would make the next test's ignored, its
/// nodes would change every count).
pub async fn remove_leftovers(admin: &Client) {
    let node_api = Api::<Node>::all(admin.clone());
    let extra = node_api
        .list_metadata(&ListParams::default().labels(&format!("{EPHEMERAL}=true")))
        .await
        .unwrap();
    let names: Vec<String> = extra
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect();
    nodes::delete(admin, &names).await.unwrap();
    crate::chaos::remove_all(admin).await.unwrap();
    let api = policies(admin);
    for p in api.list(&ListParams::default()).await.unwrap().items {
        api.delete(&p.name_any(), &DeleteParams::default())
            .await
            .unwrap();
    }
    finish_teardowns(admin).await;
    wait::until_none_left(
        &api,
        &ListParams::default(),
        TIMEOUT,
        "leftover policies gone",
    )
    .await
    .unwrap();
}

/// Finishes the teardown of the ClusterPolicies and GPUClusters being deleted that a stopped
/// operator left holding its finalizer, as `gpu-operator cleanup` does (without its refusals: a
/// leftover NVIDIA Lease of a coexistence test must not stop the cleanup of leftovers).
pub async fn finish_teardowns(admin: &Client) {
    use gpu_operator::api::GPUCluster;
    use gpu_operator::cleanup::{self, Leaving};
    let held_policies = held_by_finalizer(&policies(admin)).await;
    let held_clusters = held_by_finalizer(&Api::<GPUCluster>::all(admin.clone())).await;
    if !held_policies.is_empty() {
        cleanup::clean_cluster(admin, Leaving::ClusterPolicy)
            .await
            .unwrap();
    }
    if !held_clusters.is_empty() {
        cleanup::clean_cluster(admin, Leaving::GpuCluster)
            .await
            .unwrap();
    }
    for name in held_policies {
        cleanup::remove_finalizer::<ClusterPolicy>(admin, &name)
            .await
            .unwrap();
    }
    for name in held_clusters {
        cleanup::remove_finalizer::<GPUCluster>(admin, &name)
            .await
            .unwrap();
    }
}

/// The objects of `api` being deleted that our teardown finalizer holds (none where the kind is
/// not served).
async fn held_by_finalizer<K>(api: &Api<K>) -> Vec<String>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.list(&ListParams::default()).await {
        Ok(list) => list
            .items
            .into_iter()
            .filter(|o| {
                o.meta().deletion_timestamp.is_some() && gpu_operator::cleanup::has_finalizer(o)
            })
            .map(|o| o.name_any())
            .collect(),
        Err(kube::Error::Api(e)) if e.code == 404 => Vec::new(),
        Err(e) => panic!("listing objects held by the teardown finalizer: {e}"),
    }
}

/// The field manager of every session's CRD installs. The OLM tests apply the bundle's copies
/// of the same CRDs under it too, so a session's apply of the committed copy takes back any
/// field they set.
pub const CRD_FIELD_MANAGER: &str = "e2e-controller-test";

/// A CRD a session installs beside the ClusterPolicy's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Crd {
    NvidiaDriver,
    GpuCluster,
}

/// How a test's operator session is set up; [`builder`] starts one. The steps, in order:
/// connect (or skip the test where this run has no cluster: [`crate::cluster::connect`]), the
/// CRDs installed, leftovers of failed tests removed ([`remove_leftovers`]), then (from
/// [`Prepared`], after what the test itself removes or adds) the operator's identity with its
/// ClusterRole, the operator process and, for [`Prepared::start`], the policy.
#[derive(Default)]
pub struct SessionBuilder {
    crds: Vec<Crd>,
    cluster_role: Option<ClusterRole>,
    operator_args: Vec<String>,
}

/// A session builder: the generated ClusterRole, no extra CRD, no extra operator argument.
pub fn builder() -> SessionBuilder {
    SessionBuilder::default()
}

/// A session with the generated ClusterRole running the operator with `extra` arguments and a
/// policy with `spec`; `None` where this run has no test cluster (the test is skipped).
pub async fn start(spec: serde_json::Value, extra: &[&str]) -> Option<Setup> {
    builder().operator_args(extra).start(spec).await
}

impl SessionBuilder {
    /// Installs `crd` too (and waits until it is established).
    pub fn crd(mut self, crd: Crd) -> Self {
        self.crds.push(crd);
        self
    }

    /// Runs the operator with `role` (applied, and deleted with the identity) instead of a
    /// fresh copy of the generated one.
    pub fn cluster_role(mut self, role: ClusterRole) -> Self {
        self.cluster_role = Some(role);
        self
    }

    /// Extra arguments of `gpu-operator run`.
    pub fn operator_args(mut self, args: &[&str]) -> Self {
        self.operator_args = args.iter().map(|a| (*a).to_owned()).collect();
        self
    }

    /// Connects, installs the CRDs and removes leftovers; `None` where this run has no test
    /// cluster (the test is skipped).
    pub async fn prepare(self) -> Option<Prepared> {
        let admin = crate::cluster::connect().await?;
        crate::crd::install_cluster_policy_crd(&admin, CRD_FIELD_MANAGER)
            .await
            .unwrap();
        for crd in &self.crds {
            match crd {
                Crd::NvidiaDriver => {
                    crate::crd::install_nvidia_driver_crd(&admin, CRD_FIELD_MANAGER)
                        .await
                        .unwrap()
                }
                Crd::GpuCluster => crate::dra::install_gpu_cluster_crd(&admin).await.unwrap(),
            }
        }
        remove_leftovers(&admin).await;
        Some(Prepared {
            admin,
            cluster_role: self.cluster_role,
            operator_args: self.operator_args,
        })
    }

    /// [`Self::prepare`], then [`Prepared::start`].
    pub async fn start(self, spec: serde_json::Value) -> Option<Setup> {
        Some(self.prepare().await?.start(spec).await)
    }
}

/// A cluster ready for a session: CRDs installed, leftovers removed, no operator yet. A test
/// removes or adds what it needs besides (its own leftovers, extra nodes) with `admin` before
/// the operator starts.
pub struct Prepared {
    pub admin: Client,
    cluster_role: Option<ClusterRole>,
    operator_args: Vec<String>,
}

impl Prepared {
    /// The operator's identity and process, and no policy (for tests of other custom
    /// resources).
    pub async fn start_operator(self) -> (Client, OperatorIdentity, Operator) {
        let identity = match self.cluster_role {
            Some(role) => OperatorIdentity::with_role(&self.admin, role).await,
            None => OperatorIdentity::with_generated_role(&self.admin).await,
        }
        .unwrap();
        let args: Vec<&str> = self.operator_args.iter().map(String::as_str).collect();
        let operator = Operator::start(&identity, &args).unwrap();
        (self.admin, identity, operator)
    }

    /// The operator's identity and process, and a policy with `spec`.
    pub async fn start(self, spec: serde_json::Value) -> Setup {
        let (admin, identity, operator) = self.start_operator().await;
        let policy = unique_name("cluster-policy");
        create_policy(&admin, &policy, spec).await;
        Setup {
            admin,
            identity,
            operator,
            policy,
        }
    }
}

impl Setup {
    pub fn daemonsets(&self) -> Api<DaemonSet> {
        Api::namespaced(self.admin.clone(), &self.identity.namespace)
    }

    /// The value of env var `name` in the live template of DaemonSet `daemonset` (any
    /// container); `None` while the DaemonSet or the variable is absent.
    pub async fn template_env(&self, daemonset: &str, name: &str) -> Option<String> {
        let ds = self.daemonsets().get_opt(daemonset).await.ok()??;
        ds.spec?
            .template
            .spec?
            .containers
            .into_iter()
            .flat_map(|c| c.env.unwrap_or_default())
            .find(|e| e.name == name)
            .and_then(|e| e.value)
    }

    pub async fn await_state(&self, want: State, what: &str) -> ClusterPolicy {
        await_policy_state(&self.admin, &self.policy, want, what)
            .await
            .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", self.operator.log_text()))
    }

    /// metadata.generation of every operand DaemonSet, by name.
    pub async fn generations(&self) -> BTreeMap<String, i64> {
        self.daemonsets()
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .map(|d| (d.name_any(), d.metadata.generation.unwrap_or(0)))
            .collect()
    }

    /// Stops the operator (SIGTERM) and starts it again with the same identity, returning once
    /// the new process has run a pass.
    pub async fn restart_operator(&mut self) {
        self.operator.terminate(Duration::from_secs(20)).unwrap();
        self.start_operator_again().await;
    }

    /// Starts a new operator process with the same identity (the previous one stopped) and
    /// returns once it has run a pass.
    pub async fn start_operator_again(&mut self) {
        self.operator = Operator::start(&self.identity, &[]).unwrap();
        let operator = &self.operator;
        wait::until(TIMEOUT, "restarted operator reconciled", || async move {
            let n = operator.reconciles().await;
            Ok(if n >= 1.0 {
                Ok(())
            } else {
                Err(format!("{n} reconciles"))
            })
        })
        .await
        .unwrap();
    }

    pub async fn patch_policy(&self, patch: serde_json::Value) {
        policies(&self.admin)
            .patch(&self.policy, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .unwrap();
    }

    /// Waits until the policy's status refuses an edited config: not ready, reason
    /// `InvalidConfig`, and every one of `needles` in the message. A refused edit changes no
    /// operand, so the status is the only sign the operator reacted to it.
    pub async fn await_invalid_config(&self, needles: &[&str]) -> ClusterPolicy {
        let (admin, name) = (self.admin.clone(), self.policy.clone());
        let needles: Vec<String> = needles.iter().map(|n| n.to_string()).collect();
        wait::until(TIMEOUT, "status reports the invalid config", || {
            let (admin, name, needles) = (admin.clone(), name.clone(), needles.clone());
            async move {
                let p = policies(&admin).get(&name).await?;
                let (reason, message) = ready_reason_and_message(&p);
                let state = p.status.as_ref().map(|s| s.state);
                Ok(
                    if state == Some(State::NotReady)
                        && reason == "InvalidConfig"
                        && needles.iter().all(|n| message.contains(n.as_str()))
                    {
                        Ok(p)
                    } else {
                        Err(format!("{state:?} {reason}: {message}"))
                    },
                )
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", self.operator.log_text()))
    }

    /// A mark in the audit log taken once the operator has made no write for two seconds, so
    /// the writes counted from it are the reaction to what the test does next, not the tail of
    /// the last change.
    pub async fn quiet_mark(&self, log: &AuditLog) -> Mark {
        self.await_quiet(log).await;
        log.mark().unwrap()
    }

    /// The operator's writes of `resources` (`verb resource name`) since `mark`, read once it
    /// has made no write for two seconds: what "nothing rolled" and "rolled once" are checked
    /// against after a config edit.
    pub async fn writes_once_quiet(
        &self,
        log: &AuditLog,
        mark: Mark,
        resources: &[&str],
    ) -> Vec<String> {
        self.await_quiet(log).await;
        log.of_user_since(mark, &self.identity.username())
            .unwrap()
            .iter()
            .filter(|e| e.is_mutating() && resources.contains(&&*e.resource()))
            .map(ToString::to_string)
            .collect()
    }

    async fn await_quiet(&self, log: &AuditLog) {
        let user = self.identity.username();
        steady::await_quiet(log, &user, Duration::from_secs(2), TIMEOUT)
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", self.operator.log_text()));
    }

    /// Deletes the policy (unless the test did), waits until its operands are
    /// garbage-collected, stops the operator.
    pub async fn teardown(mut self) {
        match policies(&self.admin)
            .delete(&self.policy, &DeleteParams::default())
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => panic!("deleting policy {}: {e}", self.policy),
        }
        let api = self.daemonsets();
        wait::until_none_left(
            &api,
            &ListParams::default(),
            TIMEOUT,
            "operands garbage-collected",
        )
        .await
        .unwrap();
        // Cluster-scoped operand objects (RuntimeClass nvidia, ClusterRoles) have fixed names:
        // the next test's operator must not race their garbage collection.
        let cluster_scoped: Vec<Api<kube::api::DynamicObject>> = Kind::ALL
            .into_iter()
            .filter(|kind| !kind.is_namespaced())
            .map(|kind| {
                let (group, version, kind, plural) = kind.api();
                let gvk = kube::api::GroupVersionKind::gvk(group, version, kind);
                let resource = kube::api::ApiResource::from_gvk_with_plural(&gvk, plural);
                Api::all_with(self.admin.clone(), &resource)
            })
            .collect();
        let managed = ListParams::default().labels("app.kubernetes.io/managed-by=gpu-operator");
        wait::until(TIMEOUT, "cluster-scoped operand objects collected", || {
            let (apis, managed) = (cluster_scoped.clone(), managed.clone());
            async move {
                let mut n = 0;
                for api in &apis {
                    n += api.list_metadata(&managed).await?.items.len();
                }
                Ok(if n == 0 {
                    Ok(())
                } else {
                    Err(format!("{n} left"))
                })
            }
        })
        .await
        .unwrap();
        self.operator.terminate(Duration::from_secs(20)).unwrap();
        self.identity.delete().await.unwrap();
    }
}

/// Pods of GPU operands (NFD's worker runs on every node and is not one).
pub fn is_gpu_operand(pod: &Pod) -> bool {
    pod.labels()
        .get("app")
        .is_some_and(|a| a.starts_with("nvidia-") || a == "gpu-feature-discovery")
}

pub fn generation_changes(
    before: &BTreeMap<String, i64>,
    after: &BTreeMap<String, i64>,
) -> Vec<String> {
    let mut changed: Vec<String> = after
        .iter()
        .filter(|(name, generation)| before.get(*name) != Some(generation))
        .map(|(name, _)| name.clone())
        .collect();
    changed.sort();
    changed
}

pub async fn config_map(client: &Client, namespace: &str, name: &str, data: &[(&str, &str)]) {
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        data: Some(
            data.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        ),
        ..ConfigMap::default()
    };
    Api::<ConfigMap>::namespaced(client.clone(), namespace)
        .patch(name, &PatchParams::apply("e2e").force(), &Patch::Apply(&cm))
        .await
        .unwrap();
}

pub fn time_slicing(replicas: u32) -> String {
    format!(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: {replicas}\n"
    )
}

/// How long a change may take to converge after a fault or a held-back write.
pub const CONVERGENCE_BOUND: Duration = Duration::from_secs(90);

/// Sets an env var on the dcgm-exporter: every value rolls its DaemonSet, so the leader has a
/// write to make for each (resilience.rs, leader.rs).
pub async fn tick(s: &Setup, n: u32) {
    s.patch_policy(
        json!({"spec": {"dcgmExporter": {"env": [{"name": "E2E_TICK", "value": n.to_string()}]}}}),
    )
    .await;
}

/// How long a change took: until its object was written, and until the policy was ready.
#[derive(Debug)]
pub struct Converged {
    pub applied: Duration,
    pub ready: Duration,
}

/// Waits until the dcgm-exporter carries tick `n` and the policy is ready for its generation.
pub async fn await_converged(s: &Setup, n: u32, what: &str) -> Converged {
    let started = Instant::now();
    let want = n.to_string();
    wait::until(CONVERGENCE_BOUND, what, || async {
        let tick = s.template_env("nvidia-dcgm-exporter", "E2E_TICK").await;
        Ok(if tick.as_deref() == Some(want.as_str()) {
            Ok(())
        } else {
            Err(format!("dcgm-exporter tick {tick:?}"))
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    let applied = started.elapsed();
    await_policy_state(&s.admin, &s.policy, State::Ready, what)
        .await
        .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    Converged {
        applied,
        ready: started.elapsed(),
    }
}
