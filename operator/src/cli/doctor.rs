//! `gpu-operator doctor` (also `kubectl gpu doctor` through a `kubectl-gpu` link): why GPU pods
//! stay Pending, read from the cluster and never written to it.
//!
//! Without a pod name it prints one row per GPU node (GPU, deploy labels, operand pods, the
//! validator, allocatable GPUs and GPU memory resource, taints) and the faults it sees; with a
//! pod name it walks the checklist platform teams walk (docs/doctor.md), in that order. Each
//! finding names the check and the command that fixes or explains it. The diagnosis is pure
//! ([`Snapshot`] in, text and [`Finding`]s out); only [`run`] talks to the API server.
//!
//! Both modes start with the ClusterPolicy's own faults as its status reports them
//! ([`policy`]); where a pod may go is judged by the scheduler's rules ([`affinity`]); a pod's
//! DRA ResourceClaims are judged against the published ResourceSlices ([`dra`]).

use std::fmt::Write as _;
use std::io::Write;

use anyhow::Context;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Node, Pod, Taint, Toleration};
use k8s_openapi::api::node::v1::RuntimeClass;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};

use crate::api::SandboxWorkload;
use crate::api::{ClusterPolicy, MigStrategy};
use crate::facts::{NodeRuntime, NodeRuntimeInfo, detect};
use crate::model::{MANAGED_BY_LABEL, MANAGER};
use crate::nodes::{GPU_COUNT, GPU_PRODUCT, NodeView, places_operand};
use crate::workload::{Sandbox, WORKLOAD_CONFIG, managed_deploy_keys};

pub mod affinity;
pub mod dra;
pub mod policy;

use affinity::tolerates;
pub use policy::{
    NO_POLICY, POLICY_COMPONENT_NOT_READY, POLICY_ERROR, POLICY_FIELDS_NOT_ACTED_ON,
    POLICY_IGNORED, POLICY_INVALID_CONFIG, POLICY_NOT_READY, POLICY_NOT_RECONCILED,
    POLICY_OBJECT_REJECTED, POLICY_RECONCILE_FAILED, policy_findings, policy_hints,
};

/// Exit status when the doctor ran and found at least one fault.
pub const EXIT_FAULTS: u8 = 1;
/// Exit status when the doctor could not make its diagnosis: bad arguments (clap's own usage
/// errors exit 2 as well), no usable kubeconfig, an API server it cannot reach or that refuses
/// its requests, a pod that does not exist.
pub const EXIT_COULD_NOT_RUN: u8 = 2;

/// What `--help` says after the options: the exit statuses and the `-o json` shape's home.
const AFTER_HELP: &str = "\
Exit status:
  0  no fault found
  1  faults found (each is printed with the command that fixes or explains it)
  2  could not run: bad arguments, no usable kubeconfig, the API server unreachable or
     refusing a request, the pod not found (nothing is diagnosed)

-o json and -o yaml print the same facts as the text, in the shape docs/doctor.md documents
(\"version\": 1); the exit status is the same for every format.";

/// How the doctor prints its report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// The table (or the pod's line) and one block per fault.
    #[default]
    Text,
    /// One JSON object, the shape docs/doctor.md documents.
    Json,
    /// The same object as YAML.
    Yaml,
}

/// Arguments of `gpu-operator doctor`.
#[derive(Debug, clap::Args)]
#[command(after_help = AFTER_HELP)]
pub struct DoctorArgs {
    /// A pod to explain (why it is Pending or failing); without it, the per-GPU-node table.
    pub pod: Option<String>,
    /// Namespace of the pod (default: the namespace of the kubeconfig context in use, as
    /// kubectl takes it, else default).
    #[arg(short = 'n', long)]
    pub namespace: Option<String>,
    /// Output format: text, or json / yaml for scripts (same facts, same exit status).
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Text)]
    pub output: Output,
    /// Namespace of the operator and its operands (default: the one the active ClusterPolicy
    /// reports, else gpu-operator).
    #[arg(long)]
    pub operator_namespace: Option<String>,
    /// Kubeconfig to use (default: KUBECONFIG, ~/.kube/config, or the in-cluster account).
    #[arg(long)]
    pub kubeconfig: Option<std::path::PathBuf>,
    /// Kubeconfig context to use.
    #[arg(long)]
    pub context: Option<String>,
}

/// What the doctor reads: every node, the operand pods, RuntimeClass names, the ClusterPolicies
/// as read (status included), and the tolerations of the NFD worker the operator deployed (none
/// when it deployed none).
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub nodes: Vec<Node>,
    pub operand_pods: Vec<Pod>,
    pub runtime_classes: Vec<String>,
    /// The active policy: the oldest, the one the operator acts on.
    pub policy: Option<ClusterPolicy>,
    /// Every other policy (the operator ignores them), oldest first.
    pub other_policies: Vec<ClusterPolicy>,
    pub operator_namespace: String,
    pub nfd_worker_tolerations: Option<Vec<Toleration>>,
    /// DRA's objects (the slices always, the rest with a pod name).
    pub dra: dra::DraSnapshot,
}

/// One fault: a stable check name, what is wrong, and the command that fixes or explains it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Finding {
    pub check: &'static str,
    pub problem: String,
    pub fix: String,
}

pub const NO_GPU_NODE: &str = "no-gpu-node";
pub const MISSING_TOLERATION: &str = "missing-toleration";
pub const ALLOCATABLE_ZERO: &str = "allocatable-zero";
pub const VALIDATOR_NOT_READY: &str = "validator-not-ready";
pub const DRIVER_CRASH_LOOP: &str = "driver-crash-loop";
pub const OPERAND_NOT_READY: &str = "operand-not-ready";
pub const MIG_STRATEGY_MISMATCH: &str = "mig-strategy-mismatch";
pub const RUNTIME_CLASS_MISSING: &str = "runtime-class-missing";
pub const UNSCHEDULABLE: &str = "unschedulable";
pub const READ_ONLY_IMAGE: &str = "read-only-image";
pub const RUNTIME_HANDLER_MISSING: &str = "runtime-handler-missing";
pub const TOOLKIT_CANNOT_WRITE_V3: &str = "toolkit-cannot-write-config-v3";
pub const GPU_QUARANTINED: &str = "gpu-quarantined";
pub const GPU_NOT_READY_YET: &str = "gpu-not-ready-yet";
pub const NODE_SELECTOR_MISMATCH: &str = "node-selector-mismatch";
pub const NODE_AFFINITY_MISMATCH: &str = "node-affinity-mismatch";
/// Hints, not faults: what ranks the GPU nodes for a pod without keeping it off any.
pub const PREFERRED_NODE_AFFINITY: &str = "preferred-node-affinity";
pub const PREFER_NO_SCHEDULE_TAINT: &str = "prefer-no-schedule-taint";

/// The first container toolkit release that writes containerd's config version 3, which
/// containerd 2 reads (docs/operand-facts.md §6.1).
const TOOLKIT_WRITES_V3: (u64, u64, u64) = (1, 17, 4);

/// `v1.17.3` or `1.17.3-ubi8` as (1, 17, 3); `None` for a digest or anything else.
fn release(version: &str) -> Option<(u64, u64, u64)> {
    let core = version.trim_start_matches('v').split(['-', '+']).next()?;
    let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
    Some((
        parts.next()??,
        parts.next()??,
        parts.next().flatten().unwrap_or(0),
    ))
}

/// The major version of the containerd a node reports (`containerd://2.0.4-k3s2` -> 2).
fn containerd_major(node: &Node) -> Option<u64> {
    let version = &node
        .status
        .as_ref()?
        .node_info
        .as_ref()?
        .container_runtime_version;
    version
        .strip_prefix("containerd://")?
        .trim_start_matches('v')
        .split('.')
        .next()?
        .parse()
        .ok()
}

pub const NFD_WORKER_KEPT_OFF: &str = "nfd-worker-kept-off";

/// The NFD worker DaemonSet the operator deploys (NVIDIA's name).
pub const NFD_WORKER: &str = "node-feature-discovery-worker";
/// Taints the DaemonSet controller tolerates on every DaemonSet's pods without the template
/// naming them (a node's passing conditions, not a choice of who runs there).
const DAEMON_SET_TOLERATED: [&str; 6] = [
    "node.kubernetes.io/not-ready",
    "node.kubernetes.io/unreachable",
    "node.kubernetes.io/disk-pressure",
    "node.kubernetes.io/memory-pressure",
    "node.kubernetes.io/pid-pressure",
    "node.kubernetes.io/unschedulable",
];
/// Labels NFD writes start so; a node with none of them was never seen by a worker.
const NFD_LABEL_PREFIX: &str = "feature.node.kubernetes.io/";

const GPU_RESOURCE: &str = "nvidia.com/gpu";
const MIG_RESOURCE_PREFIX: &str = "nvidia.com/mig-";
/// `app.kubernetes.io/name` of operand pods: the operand's name.
const NAME_LABEL: &str = "app.kubernetes.io/name";
const VALIDATOR: &str = "operator-validator";
const SANDBOX_VALIDATOR: &str = "sandbox-validator";
const DRIVER: &str = "driver";
const TOOLKIT: &str = "container-toolkit";

fn view(node: &Node) -> NodeView {
    NodeView::from_labels(
        &node.name_any(),
        None,
        &node.metadata.labels.clone().unwrap_or_default(),
    )
}

/// Whether `taint` is one of `gpuReadiness`'s (the quarantine's, or the policy's startup taint):
/// a pod must not be told to tolerate those, they say the node's GPUs are not usable.
fn is_readiness_taint(snapshot: &Snapshot, taint: &Taint) -> bool {
    let startup = snapshot
        .policy
        .as_ref()
        .and_then(|p| p.spec.gpu_readiness.as_ref())
        .and_then(|r| r.startup_taint.as_ref());
    taint.key == crate::gpu_readiness::QUARANTINE_TAINT
        || startup.is_some_and(|s| s.key == taint.key && s.effect().as_str() == taint.effect)
}

/// The node's `gpuReadiness` state: quarantined (with the operator's record), or still carrying
/// the policy's startup taint.
fn readiness_finding(snapshot: &Snapshot, node: &Node) -> Option<Finding> {
    let name = node.name_any();
    let k = snapshot.kubectl();
    let record = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(crate::gpu_readiness::QUARANTINE_ANNOTATION));
    let quarantined = taints(node)
        .iter()
        .any(|t| t.key == crate::gpu_readiness::QUARANTINE_TAINT);
    if let (true, Some(raw)) = (quarantined, record) {
        let record: crate::gpu_readiness::Record = serde_json::from_str(raw).unwrap_or_default();
        return Some(Finding {
            check: GPU_QUARANTINED,
            problem: format!(
                "node {name} is quarantined by gpuReadiness: {} (device plugin restarted {} time(s)); new pods stay off it until every GPU is advertised again",
                if record.message.is_empty() {
                    "unknown cause"
                } else {
                    record.message.as_str()
                },
                record.restarts
            ),
            fix: format!(
                "{k} describe node {name}; {k} logs -l app=nvidia-device-plugin-daemonset --field-selector spec.nodeName={name} --all-containers  (look for XID errors; the operator lifts the quarantine itself, `{k} taint node {name} {}-` ends it by hand)",
                crate::gpu_readiness::QUARANTINE_TAINT
            ),
        });
    }
    let startup = taints(node).into_iter().find(|t| {
        t.key != crate::gpu_readiness::QUARANTINE_TAINT && is_readiness_taint(snapshot, t)
    })?;
    Some(Finding {
        check: GPU_NOT_READY_YET,
        problem: format!(
            "node {name} still carries the startup taint {}: the operator removes it once the node's validator is ready and its device plugin advertises every GPU",
            taint_text(&startup)
        ),
        fix: format!(
            "{k} get clusterpolicy -o jsonpath='{{.items[*].status.conditions[?(@.type==\"Ready\")].message}}'  (names the step the node waits on)"
        ),
    })
}

/// A GPU node: marked by the operator, or reported by NFD.
pub fn is_gpu_node(node: &Node) -> bool {
    let v = view(node);
    v.is_gpu_node() || v.has_nfd_gpu()
}

fn quantity(node: &Node, resource: &str) -> Option<String> {
    node.status
        .as_ref()?
        .allocatable
        .as_ref()?
        .get(resource)
        .map(|q| q.0.clone())
}

fn has_some(node: &Node, resource: &str) -> bool {
    quantity(node, resource).is_some_and(|q| q != "0")
}

/// The resource names of MIG devices the node advertises (`nvidia.com/mig-1g.5gb`).
fn mig_resources(node: &Node) -> Vec<String> {
    node.status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .into_iter()
        .flatten()
        .filter(|(k, q)| k.starts_with(MIG_RESOURCE_PREFIX) && q.0 != "0")
        .map(|(k, _)| k.clone())
        .collect()
}

fn taints(node: &Node) -> Vec<Taint> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default()
}

fn taint_text(t: &Taint) -> String {
    match t.value.as_deref().filter(|v| !v.is_empty()) {
        Some(v) => format!("{}={v}:{}", t.key, t.effect),
        None => format!("{}:{}", t.key, t.effect),
    }
}

/// State of one pod: `Ready`, `Running` (not ready), a container's waiting or terminated
/// reason (`CrashLoopBackOff`), or the phase.
pub fn pod_state(pod: &Pod) -> String {
    let Some(status) = pod.status.as_ref() else {
        return "Unknown".into();
    };
    let statuses = status
        .init_container_statuses
        .iter()
        .flatten()
        .chain(status.container_statuses.iter().flatten());
    for c in statuses {
        let state = c.state.as_ref();
        if let Some(reason) = state
            .and_then(|s| s.waiting.as_ref())
            .and_then(|w| w.reason.clone())
        {
            return reason;
        }
        if let Some(t) = state.and_then(|s| s.terminated.as_ref())
            && t.exit_code != 0
        {
            return t.reason.clone().unwrap_or_else(|| "Error".into());
        }
    }
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    match status.phase.as_deref() {
        Some("Running") if ready => "Ready".into(),
        Some(phase) => phase.into(),
        None => "Unknown".into(),
    }
}

fn on_node<'a>(snapshot: &'a Snapshot, node: &str) -> impl Iterator<Item = &'a Pod> {
    snapshot
        .operand_pods
        .iter()
        .filter(move |p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node))
}

fn is_daemon_pod(pod: &Pod) -> bool {
    pod.owner_references().iter().any(|o| o.kind == "DaemonSet")
}

fn operand_of(pod: &Pod) -> &str {
    pod.labels().get(NAME_LABEL).map_or("?", String::as_str)
}

fn first_container(pod: &Pod) -> String {
    pod.spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .map(|c| c.name.clone())
        .unwrap_or_default()
}

impl Snapshot {
    fn gpu_nodes(&self) -> Vec<&Node> {
        let mut nodes: Vec<&Node> = self.nodes.iter().filter(|n| is_gpu_node(n)).collect();
        nodes.sort_by_key(|n| n.name_any());
        nodes
    }

    fn spec(&self) -> Option<&crate::api::ClusterPolicySpec> {
        self.policy.as_ref().map(|p| &p.spec)
    }

    fn runtime_class(&self) -> String {
        self.spec()
            .and_then(|s| s.operator.as_ref())
            .map_or("nvidia", |o| o.runtime_class())
            .to_owned()
    }

    fn memory_resource(&self) -> Option<String> {
        self.spec()
            .and_then(|s| s.gpu_memory_resource.as_ref())
            .filter(|m| m.is_enabled())
            .map(|m| m.name().to_owned())
    }

    fn mig_strategy(&self) -> MigStrategy {
        self.spec()
            .and_then(|s| s.mig.as_ref())
            .and_then(|m| m.strategy)
            // The plugins' own default when the policy leaves it out.
            .unwrap_or(MigStrategy::Single)
    }

    fn policy_name(&self) -> String {
        self.policy
            .as_ref()
            .map_or_else(|| "cluster-policy".into(), |p| p.name_any())
    }

    fn kubectl(&self) -> String {
        format!("kubectl -n {}", self.operator_namespace)
    }

    /// The node's workload type, as the operator's labeller decides it.
    fn workload_of(&self, node: &Node) -> SandboxWorkload {
        self.spec()
            .map_or(Sandbox::DISABLED, Sandbox::of)
            .workload_of(&view(node))
    }

    /// The state of the validator `node` runs for its workload type (the operator validator on
    /// container nodes, the sandbox validator on VM nodes; `missing` without a pod), and that
    /// validator's operand name.
    fn validator_state(&self, node: &Node) -> (String, Option<&Pod>, &'static str) {
        let validator = match self.workload_of(node) {
            SandboxWorkload::Container => VALIDATOR,
            SandboxWorkload::VmPassthrough | SandboxWorkload::VmVgpu => SANDBOX_VALIDATOR,
        };
        match on_node(self, &node.name_any()).find(|p| operand_of(p) == validator) {
            Some(pod) => (pod_state(pod), Some(pod), validator),
            None => ("missing".into(), None, validator),
        }
    }
}

/// One operand pod on a node that is not Ready.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PodState {
    pub operand: String,
    pub pod: String,
    pub state: String,
}

/// One GPU node as the doctor sees it: a row of the table, a `nodes[]` entry of `-o json`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeReport {
    pub name: String,
    /// GFD's `nvidia.com/gpu.product` label (absent before GFD ran).
    pub gpu_product: Option<String>,
    /// GFD's `nvidia.com/gpu.count` label, as written.
    pub gpu_count: Option<String>,
    /// The node's workload type (`container`, `vm-passthrough`, `vm-vgpu`): its
    /// `nvidia.com/gpu.workload.config` label or the policy's default, `container` while
    /// sandbox workloads are off (docs/vms.md). It decides which operands belong there.
    pub workload: String,
    /// `nvidia.com/gpu.deploy.*` labels that place their operand on the node: `true`, or a
    /// runtime flavour on the toolkit's (operands::toolkit_flavour).
    pub deploy_labels_placing: usize,
    /// `nvidia.com/gpu.deploy.*` labels present, whatever their value.
    pub deploy_labels_set: usize,
    /// Per-node operand pods (DaemonSets') that are Ready, and all of them.
    pub operands_ready: usize,
    pub operands_total: usize,
    /// The operand pods that are not Ready, with their state.
    pub operands_not_ready: Vec<PodState>,
    /// The validator pod's state, `missing` without one.
    pub validator: String,
    /// Allocatable `nvidia.com/gpu` ("0" when not advertised).
    pub allocatable_gpus: String,
    /// Allocatable of the policy's GPU memory resource, when one is enabled.
    pub allocatable_gpu_memory: Option<String>,
    /// The container runtime flavour the operator detects on the node.
    pub runtime: String,
    /// The node's taints, `key[=value]:Effect`.
    pub taints: Vec<String>,
}

/// The pod a `doctor <pod>` run explains.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PodReport {
    pub namespace: String,
    pub name: String,
    pub state: String,
}

/// Everything one doctor run found; `-o json|yaml` prints it as is (docs/doctor.md documents
/// the shape; `version` changes only when a field changes meaning or goes away).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub version: u32,
    pub operator_namespace: String,
    /// The active ClusterPolicy, none when there is none.
    pub cluster_policy: Option<String>,
    /// The GPU memory resource the policy enables (the table's seventh column).
    pub gpu_memory_resource: Option<String>,
    /// The GPU nodes (without a pod name; empty with one).
    pub nodes: Vec<NodeReport>,
    /// The pod explained (with a pod name).
    pub pod: Option<PodReport>,
    /// The pod's DRA ResourceClaims, each with its state (with a pod name that has any).
    pub resource_claims: Vec<dra::ClaimReport>,
    /// Every fault, in the order the text prints them; none means exit status 0.
    pub faults: Vec<Finding>,
    /// What does not keep GPU pods off but is worth knowing (a pod's preferred node affinity,
    /// fields the policy sets that are not acted on); never changes the exit status.
    pub hints: Vec<Finding>,
}

/// The version of [`Report`]'s shape.
pub const REPORT_VERSION: u32 = 1;

/// The GPU nodes' rows.
pub fn node_reports(snapshot: &Snapshot) -> Vec<NodeReport> {
    let memory = snapshot.memory_resource();
    let mut out = Vec::new();
    for node in snapshot.gpu_nodes() {
        let name = node.name_any();
        let v = view(node);
        // Per-node operands only: a Deployment's pod (NFD's master) lands wherever the
        // scheduler puts it.
        let mut pods: Vec<&Pod> = on_node(snapshot, &name)
            .filter(|p| is_daemon_pod(p))
            .collect();
        pods.sort_by_key(|p| operand_of(p).to_owned());
        out.push(NodeReport {
            gpu_product: v.label(GPU_PRODUCT).map(str::to_owned),
            gpu_count: v.label(GPU_COUNT).map(str::to_owned),
            workload: snapshot.workload_of(node).as_str().to_owned(),
            deploy_labels_placing: managed_deploy_keys()
                .filter(|k| v.label(k).is_some_and(|value| places_operand(k, value)))
                .count(),
            deploy_labels_set: managed_deploy_keys()
                .filter(|k| v.label(k).is_some())
                .count(),
            operands_ready: pods.iter().filter(|p| pod_state(p) == "Ready").count(),
            operands_total: pods.len(),
            operands_not_ready: pods
                .iter()
                .filter(|p| pod_state(p) != "Ready")
                .map(|p| PodState {
                    operand: operand_of(p).to_owned(),
                    pod: p.name_any(),
                    state: pod_state(p),
                })
                .collect(),
            validator: snapshot.validator_state(node).0,
            allocatable_gpus: quantity(node, GPU_RESOURCE).unwrap_or_else(|| "0".into()),
            allocatable_gpu_memory: memory
                .as_deref()
                .map(|m| quantity(node, m).unwrap_or_else(|| "0".into())),
            runtime: runtime_of(node).label().to_owned(),
            taints: taints(node).iter().map(taint_text).collect(),
            name,
        });
    }
    out
}

/// The per-GPU-node table.
pub fn node_table(snapshot: &Snapshot) -> String {
    table_text(
        &node_reports(snapshot),
        snapshot.memory_resource().as_deref(),
    )
}

fn table_text(nodes: &[NodeReport], memory: Option<&str>) -> String {
    let header = [
        "NODE",
        "GPU",
        "DEPLOY",
        "OPERANDS",
        "VALIDATOR",
        GPU_RESOURCE,
        memory.unwrap_or("GPU-MEMORY"),
        "RUNTIME",
        "TAINTS",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|s| (*s).to_owned()).collect()];
    for n in nodes {
        let mut gpu = match (&n.gpu_product, &n.gpu_count) {
            (Some(p), Some(c)) => format!("{c}x {p}"),
            (Some(p), None) => p.clone(),
            _ => "yes (no GFD labels)".into(),
        };
        if n.workload != SandboxWorkload::Container.as_str() {
            let _ = write!(gpu, " ({})", n.workload);
        }
        let mut operands = format!("{}/{}", n.operands_ready, n.operands_total);
        for p in &n.operands_not_ready {
            let _ = write!(operands, " {}:{}", p.operand, p.state);
        }
        rows.push(vec![
            n.name.clone(),
            gpu,
            format!("{}/{}", n.deploy_labels_placing, n.deploy_labels_set),
            operands,
            n.validator.clone(),
            n.allocatable_gpus.clone(),
            n.allocatable_gpu_memory
                .clone()
                .unwrap_or_else(|| "-".into()),
            n.runtime.clone(),
            if n.taints.is_empty() {
                "-".into()
            } else {
                n.taints.join(",")
            },
        ]);
    }
    columns(&rows)
}

impl Report {
    /// The cluster's report (the table and its faults).
    pub fn of_cluster(snapshot: &Snapshot) -> Self {
        Report {
            nodes: node_reports(snapshot),
            faults: cluster_findings(snapshot),
            hints: cluster_hints(snapshot),
            ..Report::empty(snapshot)
        }
    }

    /// The report on one pod.
    pub fn of_pod(snapshot: &Snapshot, pod: &Pod) -> Self {
        Report {
            pod: Some(PodReport {
                namespace: pod.namespace().unwrap_or_else(|| "default".into()),
                name: pod.name_any(),
                state: pod_state(pod),
            }),
            faults: pod_findings(snapshot, pod),
            hints: pod_hints(snapshot, pod),
            resource_claims: dra_diagnosis(snapshot, pod).claims,
            ..Report::empty(snapshot)
        }
    }

    fn empty(snapshot: &Snapshot) -> Self {
        Report {
            version: REPORT_VERSION,
            operator_namespace: snapshot.operator_namespace.clone(),
            cluster_policy: snapshot.policy.as_ref().map(ResourceExt::name_any),
            gpu_memory_resource: snapshot.memory_resource(),
            nodes: Vec::new(),
            pod: None,
            resource_claims: Vec::new(),
            faults: Vec::new(),
            hints: Vec::new(),
        }
    }

    /// The report in `format`; text is the table (or the pod's line), a blank line, the faults.
    pub fn render(&self, format: Output) -> anyhow::Result<String> {
        Ok(match format {
            Output::Text => {
                let head = match &self.pod {
                    Some(p) => format!(
                        "pod {}/{}: {}\n{}",
                        p.namespace,
                        p.name,
                        p.state,
                        dra::claims_text(&self.resource_claims)
                    ),
                    None => table_text(&self.nodes, self.gpu_memory_resource.as_deref()),
                };
                format!(
                    "{head}\n{}{}",
                    findings_text(&self.faults),
                    hints_text(&self.hints)
                )
            }
            Output::Json => {
                let mut text =
                    serde_json::to_string_pretty(self).context("serialising the report")?;
                text.push('\n');
                text
            }
            Output::Yaml => serde_yaml_ng::to_string(self).context("serialising the report")?,
        })
    }
}

/// Left-aligned columns two spaces apart, without trailing blanks.
fn columns(rows: &[Vec<String>]) -> String {
    let widths: Vec<usize> = (0..rows.first().map_or(0, Vec::len))
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let mut line = String::new();
        for (cell, width) in row.iter().zip(&widths) {
            let _ = write!(line, "{cell:<width$}  ");
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn no_gpu_node(what: &str) -> Finding {
    Finding {
        check: NO_GPU_NODE,
        problem: format!("no GPU node{what}"),
        fix: "kubectl get nodes -L feature.node.kubernetes.io/pci-10de.present,nvidia.com/gpu.present,nvidia.com/gpu.product  (NFD labels GPU nodes; the operator then marks them)".into(),
    }
}

/// Faults of the operand pods on `node`: a crash-looping driver, a validator that is not
/// ready, any other operand pod that is not ready.
fn operand_findings(snapshot: &Snapshot, node: &Node) -> Vec<Finding> {
    let mut out = Vec::new();
    let k = snapshot.kubectl();
    let name = node.name_any();
    let mut pods: Vec<&Pod> = on_node(snapshot, &name).collect();
    pods.sort_by_key(|p| (operand_of(p).to_owned(), p.name_any()));
    for pod in &pods {
        if operand_of(pod) == DRIVER && pod_state(pod) == "CrashLoopBackOff" {
            out.push(Finding {
                check: DRIVER_CRASH_LOOP,
                problem: format!(
                    "driver pod {} on {name} is crash-looping (often a kernel the driver does not build for)",
                    pod.name_any()
                ),
                fix: format!(
                    "{k} logs {} -c {} --previous",
                    pod.name_any(),
                    first_container(pod)
                ),
            });
        }
    }
    let (state, validator_pod, validator) = snapshot.validator_state(node);
    if state != "Ready" {
        let waiting = if validator == VALIDATOR {
            "GPU workloads wait for it"
        } else {
            "the VM device plugin waits for it"
        };
        out.push(Finding {
            check: VALIDATOR_NOT_READY,
            problem: format!("{validator} on {name} is {state}: {waiting}"),
            fix: match validator_pod {
                Some(p) => format!(
                    "{k} describe pod {0}; {k} logs {0} --all-containers",
                    p.name_any()
                ),
                None => format!(
                    "kubectl get node {name} -L nvidia.com/gpu.deploy.{validator},{WORKLOAD_CONFIG}  (the deploy label must be true)"
                ),
            },
        });
    }
    for pod in &pods {
        let (operand, state) = (operand_of(pod), pod_state(pod));
        if state != "Ready"
            && operand != validator
            && !(operand == DRIVER && state == "CrashLoopBackOff")
        {
            out.push(Finding {
                check: OPERAND_NOT_READY,
                problem: format!("{operand} pod {} on {name} is {state}", pod.name_any()),
                fix: format!("{k} describe pod {}", pod.name_any()),
            });
        }
    }
    out
}

/// The runtime flavour `node` reports, as the operator detects it (facts::detect).
fn runtime_of(node: &Node) -> NodeRuntime {
    detect(&NodeRuntimeInfo::of_node(node))
}

/// Faults of the node's container runtime: a read-only image (nothing can be installed), or a
/// toolkit that is Ready while the runtime reports no handler for the GPU RuntimeClass (the
/// toolkit wrote a config this runtime does not read). Nodes whose kubelet reports no
/// runtime handlers at all (before Kubernetes 1.30) are not judged on the second.
fn runtime_findings(snapshot: &Snapshot, node: &Node) -> Vec<Finding> {
    let name = node.name_any();
    let runtime = runtime_of(node);
    let flavour = match runtime {
        NodeRuntime::ReadOnly(image) => {
            let (image_name, instead) = image.instead();
            return vec![Finding {
                check: READ_ONLY_IMAGE,
                problem: format!(
                    "{name} runs {image_name}, a read-only image: no driver or container \
                     toolkit can be installed there"
                ),
                fix: instead.to_owned(),
            }];
        }
        NodeRuntime::Flavour(f) => f,
    };
    let toolkit_version = snapshot
        .policy
        .as_ref()
        .and_then(|p| p.spec.toolkit.as_ref())
        .and_then(|t| t.image.version.as_deref());
    if let (Some(major), Some(pinned)) = (containerd_major(node), toolkit_version.and_then(release))
        && major >= 2
        && pinned < TOOLKIT_WRITES_V3
    {
        let version = toolkit_version.unwrap_or_default();
        return vec![Finding {
            check: TOOLKIT_CANNOT_WRITE_V3,
            problem: format!(
                "{name} runs containerd {major}, which reads config version 3, but the container \
                 toolkit {version} writes only version 2 (version 3 from v1.17.4): the nvidia \
                 runtime it adds is not loaded"
            ),
            fix: format!(
                "kubectl patch clusterpolicy {} --type json -p \
                 '[{{\"op\":\"remove\",\"path\":\"/spec/toolkit/version\"}}]'  (the \
                 operator's pinned toolkit, {}, writes both versions)",
                snapshot.policy_name(),
                crate::api::ImageKind::Toolkit
                    .pinned()
                    .and_then(|i| i.rsplit_once(':'))
                    .map_or("", |(_, tag)| tag)
            ),
        }];
    }
    let toolkit_ready =
        on_node(snapshot, &name).any(|p| operand_of(p) == TOOLKIT && pod_state(p) == "Ready");
    let handlers: Vec<&str> = node
        .status
        .as_ref()
        .and_then(|s| s.runtime_handlers.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|h| h.name.as_deref())
        .collect();
    let handler = snapshot.runtime_class();
    if !toolkit_ready || handlers.is_empty() || handlers.contains(&handler.as_str()) {
        return Vec::new();
    }
    let paths = flavour.paths();
    vec![Finding {
        check: RUNTIME_HANDLER_MISSING,
        problem: format!(
            "the container toolkit on {name} is Ready, but its runtime reports no {handler} \
             handler ({}): the toolkit configured {}{} for {}, files this runtime does not read",
            handlers.join(", "),
            paths.config,
            paths
                .drop_in
                .map(|d| format!(" (its runtimes in {d})"))
                .unwrap_or_default(),
            flavour.label()
        ),
        fix: format!(
            "kubectl get node {name} -o jsonpath='{{.status.nodeInfo}}'  (what the operator \
             detects the flavour from); if the runtime keeps its config elsewhere, set \
             spec.toolkit.env CONTAINERD_CONFIG (or RUNTIME_CONFIG) and the socket to its \
             paths (docs/install.md, Distributions)"
        ),
    }]
}

/// The fault of a GPU node that advertises none of `resource`.
fn allocatable_finding(snapshot: &Snapshot, node: &Node, resource: &str) -> Option<Finding> {
    let name = node.name_any();
    let k = snapshot.kubectl();
    let empty = if resource == GPU_RESOURCE {
        // With the mixed MIG strategy the GPUs are advertised as MIG devices instead.
        !has_some(node, GPU_RESOURCE) && mig_resources(node).is_empty()
    } else {
        !has_some(node, resource)
    };
    let fix = if resource == GPU_RESOURCE || resource.starts_with(MIG_RESOURCE_PREFIX) {
        format!(
            "{k} get pods -o wide -l app.kubernetes.io/name=device-plugin --field-selector spec.nodeName={name}; {k} logs -l app=nvidia-device-plugin-daemonset --all-containers  (the device plugin advertises GPUs)"
        )
    } else {
        format!(
            "kubectl get node {name} -o jsonpath='{{.status.allocatable}}'; kubectl get clusterpolicy {} -o jsonpath='{{.spec.gpuMemoryResource}}'",
            snapshot.policy_name()
        )
    };
    empty.then(|| Finding {
        check: ALLOCATABLE_ZERO,
        problem: format!("{name} has no allocatable {resource}"),
        fix,
    })
}

fn runtime_class_finding(snapshot: &Snapshot, name: &str, whose: &str) -> Option<Finding> {
    (!snapshot.runtime_classes.iter().any(|r| r == name)).then(|| Finding {
        check: RUNTIME_CLASS_MISSING,
        problem: format!("RuntimeClass {name} ({whose}) does not exist"),
        fix: format!(
            "kubectl get runtimeclass; kubectl get clusterpolicy {} -o jsonpath='{{.status.conditions}}'  (the operator creates {} once the toolkit is deployed)",
            snapshot.policy_name(),
            snapshot.runtime_class()
        ),
    })
}

fn plural(n: usize, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

/// Nodes NFD never labelled because a taint keeps its worker off them, one finding per taint
/// (with the nodes it names): NFD cannot report a GPU on a node its worker does not run on, so
/// such a node is never taken for a GPU node. The fix names the toleration to add (the whole
/// list, since a list in the policy replaces the operator's defaults) and the taint to remove.
fn nfd_kept_off(snapshot: &Snapshot) -> Vec<(Vec<String>, Finding)> {
    let Some(tolerations) = &snapshot.nfd_worker_tolerations else {
        return Vec::new();
    };
    let mut by_taint: std::collections::BTreeMap<String, (Taint, Vec<String>)> =
        std::collections::BTreeMap::new();
    for node in &snapshot.nodes {
        let labelled = node
            .labels()
            .keys()
            .any(|k| k.starts_with(NFD_LABEL_PREFIX));
        if labelled {
            continue;
        }
        for taint in taints(node)
            .into_iter()
            .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
            .filter(|t| !DAEMON_SET_TOLERATED.contains(&t.key.as_str()))
            .filter(|t| !tolerations.iter().any(|tol| tolerates(tol, t)))
        {
            by_taint
                .entry(taint_text(&taint))
                .or_insert_with(|| (taint.clone(), Vec::new()))
                .1
                .push(node.name_any());
        }
    }
    by_taint
        .into_iter()
        .map(|(text, (taint, mut nodes))| {
            nodes.sort();
            let mut wanted = tolerations.clone();
            wanted.push(Toleration {
                key: Some(taint.key.clone()),
                operator: Some("Exists".into()),
                effect: Some(taint.effect.clone()),
                ..Toleration::default()
            });
            let list = serde_json::to_string(&wanted).unwrap_or_default();
            let shown: Vec<&str> = nodes.iter().take(5).map(String::as_str).collect();
            let more = nodes.len().saturating_sub(shown.len());
            let finding = Finding {
                check: NFD_WORKER_KEPT_OFF,
                problem: format!(
                    "taint {text} keeps NFD's worker ({NFD_WORKER}) off {}{}, which NFD has not \
                     labelled: a GPU there is never reported, so the operator never deploys to it",
                    shown.join(", "),
                    if more > 0 {
                        format!(" and {more} more")
                    } else {
                        String::new()
                    },
                ),
                fix: format!(
                    "add the toleration {{key: {}, operator: Exists, effect: {}}} to the NFD \
                     worker: kubectl patch clusterpolicy {} --type merge -p \
                     '{{\"spec\":{{\"nfd\":{{\"worker\":{{\"tolerations\":{list}}}}}}}}}'  \
                     (with Helm: node-feature-discovery.worker.tolerations, the same list); or, \
                     if the taint is not meant for it, kubectl taint node {} {}:{}-",
                    taint.key,
                    taint.effect,
                    snapshot.policy_name(),
                    nodes[0],
                    taint.key,
                    taint.effect,
                ),
            };
            (nodes, finding)
        })
        .collect()
}

/// Faults of the whole cluster (the table's companion): the policy's first, then the nodes'.
pub fn cluster_findings(snapshot: &Snapshot) -> Vec<Finding> {
    let mut out = policy_findings(snapshot);
    let kept_off = nfd_kept_off(snapshot);
    let nodes = snapshot.gpu_nodes();
    if nodes.is_empty() {
        let blocked: std::collections::BTreeSet<&String> =
            kept_off.iter().flat_map(|(n, _)| n).collect();
        out.push(if blocked.is_empty() {
            no_gpu_node(" in the cluster")
        } else {
            no_gpu_node(&format!(
                " in the cluster: NFD's worker cannot run on {}, so NFD reports no PCI device \
                 there ({NFD_WORKER_KEPT_OFF} below)",
                plural(blocked.len(), "node"),
            ))
        });
        out.extend(kept_off.into_iter().map(|(_, f)| f));
        return out;
    }
    out.extend(kept_off.into_iter().map(|(_, f)| f));
    for node in &nodes {
        // A VM node runs no container toolkit and advertises its GPUs to virtual machines
        // under other names: the container runtime and `nvidia.com/gpu` are not its business.
        let container = snapshot.workload_of(node) == SandboxWorkload::Container;
        if container {
            out.extend(runtime_findings(snapshot, node));
        }
        out.extend(operand_findings(snapshot, node));
        out.extend(readiness_finding(snapshot, node));
        if container {
            out.extend(allocatable_finding(snapshot, node, GPU_RESOURCE));
        }
    }
    out.extend(dra::conflicts(&snapshot.dra, &nodes));
    out.extend(runtime_class_finding(
        snapshot,
        &snapshot.runtime_class(),
        "the operand and GPU workload runtime",
    ));
    out
}

/// The extended resources `pod` requests that the GPU operator stack provides.
fn gpu_requests(pod: &Pod, memory: Option<&str>) -> Vec<String> {
    let mut out: Vec<String> = pod
        .spec
        .iter()
        .flat_map(|s| {
            s.containers
                .iter()
                .chain(s.init_containers.iter().flatten())
        })
        .filter_map(|c| c.resources.as_ref())
        .flat_map(|r| r.requests.iter().flatten().chain(r.limits.iter().flatten()))
        .map(|(k, _)| k.clone())
        .filter(|k| {
            k == GPU_RESOURCE || k.starts_with(MIG_RESOURCE_PREFIX) || Some(k.as_str()) == memory
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Hints of the whole cluster: what does not keep pods off GPUs but is worth knowing.
pub fn cluster_hints(snapshot: &Snapshot) -> Vec<Finding> {
    policy_hints(snapshot)
}

/// The GPU nodes the pod's `nodeSelector` and required node affinity both admit.
fn admitted<'a>(snapshot: &'a Snapshot, pod: &Pod) -> Vec<&'a Node> {
    snapshot
        .gpu_nodes()
        .into_iter()
        .filter(|n| {
            affinity::selector_misses(pod, n).is_empty()
                && affinity::affinity_misses(pod, n).is_none()
        })
        .collect()
}

/// The placement rules the pod has, as the no-gpu-node problem names them.
fn placement_rules(pod: &Pod) -> &'static str {
    let selector = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_selector.as_ref())
        .is_some_and(|s| !s.is_empty());
    match (selector, affinity::has_required_affinity(pod)) {
        (true, true) => "nodeSelector and required node affinity",
        (false, true) => "required node affinity",
        _ => "nodeSelector",
    }
}

/// Which of the pod's placement rules keep it off GPU node `node`, one finding per rule.
fn placement_findings(pod: &Pod, node: &Node) -> Vec<Finding> {
    let (pod_name, name) = (pod.name_any(), node.name_any());
    let mut out = Vec::new();
    let selector = affinity::selector_misses(pod, node);
    if !selector.is_empty() {
        let keys: Vec<&str> = selector
            .iter()
            .filter_map(|m| m.split_once('=').map(|(k, _)| k))
            .collect();
        out.push(Finding {
            check: NODE_SELECTOR_MISMATCH,
            problem: format!(
                "pod {pod_name}'s nodeSelector keeps it off GPU node {name}: {}",
                selector.join(", ")
            ),
            fix: format!(
                "kubectl get nodes -L {}  (the GPU nodes' values); set the pod's nodeSelector to \
                 values a GPU node has, or drop what it need not select",
                keys.join(",")
            ),
        });
    }
    if let Some(misses) = affinity::affinity_misses(pod, node) {
        let why = match misses.as_slice() {
            [] => "it has no nodeSelectorTerms, so it matches no node".to_owned(),
            [one] => one.clone(),
            many => format!("no term admits it: {}", many.join("; ")),
        };
        let mut keys: Vec<String> = pod
            .spec
            .iter()
            .filter_map(|s| s.affinity.as_ref()?.node_affinity.as_ref())
            .filter_map(|a| {
                a.required_during_scheduling_ignored_during_execution
                    .as_ref()
            })
            .flat_map(|r| &r.node_selector_terms)
            .flat_map(|t| t.match_expressions.iter().flatten())
            .map(|e| e.key.clone())
            .collect();
        keys.sort();
        keys.dedup();
        let show = if keys.is_empty() {
            format!("kubectl get node {name} --show-labels")
        } else {
            format!(
                "kubectl get nodes -L {}  (the labels its expressions test)",
                keys.join(",")
            )
        };
        out.push(Finding {
            check: NODE_AFFINITY_MISMATCH,
            problem: format!(
                "pod {pod_name}'s required node affinity keeps it off GPU node {name}: {why}"
            ),
            fix: format!(
                "{show}; in the pod's template (a pod's affinity cannot change in place), make \
                 one term of spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution \
                 match a GPU node, or move a wish to preferredDuringSchedulingIgnoredDuringExecution"
            ),
        });
    }
    out
}

fn toleration_text(t: &Taint) -> String {
    format!("{{key: {}, operator: Exists, effect: {}}}", t.key, t.effect)
}

/// Why `pod` is Pending or failing: the policy's faults, then the checklist in order.
pub fn pod_findings(snapshot: &Snapshot, pod: &Pod) -> Vec<Finding> {
    let mut out = policy_findings(snapshot);
    out.extend(pod_checklist(snapshot, pod));
    out
}

/// The pod's checklist (docs/doctor.md), in its order.
fn pod_checklist(snapshot: &Snapshot, pod: &Pod) -> Vec<Finding> {
    let mut out = Vec::new();
    let memory = snapshot.memory_resource();
    let requests = gpu_requests(pod, memory.as_deref());
    let pod_name = pod.name_any();
    let namespace = pod.namespace().unwrap_or_else(|| "default".into());

    // A pod whose GPUs come only from DRA claims needs no device plugin, GPU node label or
    // validator of ours: its claims are judged against the published devices instead.
    if requests.is_empty() && dra::has_claims(pod) {
        out.extend(dra_diagnosis(snapshot, pod).faults);
        if out.is_empty()
            && let Some(message) = unschedulable(pod)
        {
            out.push(Finding {
                check: UNSCHEDULABLE,
                problem: format!("the scheduler says: {message}"),
                fix: format!("kubectl -n {namespace} describe pod {pod_name}"),
            });
        }
        return out;
    }
    // 1. A GPU node exists that the pod's nodeSelector and required node affinity admit; if
    // none does, what keeps it off each one.
    let gpu_nodes = snapshot.gpu_nodes();
    let candidates = admitted(snapshot, pod);
    if gpu_nodes.is_empty() {
        out.push(no_gpu_node(" in the cluster"));
    } else if candidates.is_empty() {
        // GPU nodes exist: the pod's own rules are at fault, not NFD's labels.
        out.push(Finding {
            fix: format!(
                "kubectl -n {namespace} get pod {pod_name} -o yaml  (its nodeSelector and \
                 affinity); the findings below name what keeps it off each GPU node"
            ),
            ..no_gpu_node(&format!(" matches the pod's {}", placement_rules(pod)))
        });
        for node in &gpu_nodes {
            out.extend(placement_findings(pod, node));
        }
    }
    // 2. The pod tolerates the GPU nodes' NoSchedule and NoExecute taints: when none is left,
    // each node's taints and the tolerations to add.
    let blocked: Vec<(&Node, Vec<Taint>)> = candidates
        .iter()
        .map(|n| (*n, affinity::untolerated(pod, n, affinity::blocks)))
        .filter(|(_, t)| !t.is_empty())
        .collect();
    if !candidates.is_empty() && blocked.len() == candidates.len() {
        for (node, taints) in &blocked {
            // Nodes kept off by gpuReadiness: the pod must wait, not tolerate.
            if taints.iter().any(|t| is_readiness_taint(snapshot, t)) {
                out.extend(readiness_finding(snapshot, node));
            }
            let taints: Vec<&Taint> = taints
                .iter()
                .filter(|t| !is_readiness_taint(snapshot, t))
                .collect();
            if taints.is_empty() {
                continue;
            }
            let texts: Vec<String> = taints.iter().map(|t| taint_text(t)).collect();
            let tolerations: Vec<String> = taints.iter().map(|t| toleration_text(t)).collect();
            out.push(Finding {
                check: MISSING_TOLERATION,
                problem: format!(
                    "pod {pod_name} does not tolerate GPU node {}'s {} {}",
                    node.name_any(),
                    if taints.len() == 1 { "taint" } else { "taints" },
                    texts.join(", ")
                ),
                fix: format!(
                    "add to the pod spec: tolerations: [{}]",
                    tolerations.join(", ")
                ),
            });
        }
    }
    let schedulable: Vec<&Node> = candidates
        .iter()
        .copied()
        .filter(|n| affinity::untolerated(pod, n, affinity::blocks).is_empty())
        .collect();
    let considered = if schedulable.is_empty() {
        &candidates
    } else {
        &schedulable
    };
    // 3. Allocatable is not 0 for what the pod requests.
    for resource in &requests {
        let findings: Vec<Finding> = considered
            .iter()
            .filter_map(|n| allocatable_finding(snapshot, n, resource))
            .collect();
        if !considered.is_empty() && findings.len() == considered.len() {
            out.extend(findings);
        }
    }
    // 4 and 5. The validator is Running; the driver is not crash-looping.
    let node_faults: Vec<Finding> = considered
        .iter()
        .flat_map(|n| operand_findings(snapshot, n))
        .collect();
    for check in [VALIDATOR_NOT_READY, DRIVER_CRASH_LOOP] {
        out.extend(node_faults.iter().filter(|f| f.check == check).cloned());
    }
    // 6. The MIG strategy matches the resource name.
    let strategy = snapshot.mig_strategy();
    for resource in requests
        .iter()
        .filter(|r| r.starts_with(MIG_RESOURCE_PREFIX))
    {
        if strategy != MigStrategy::Mixed {
            out.push(Finding {
                check: MIG_STRATEGY_MISMATCH,
                problem: format!("pod {pod_name} requests {resource}, which only the mixed MIG strategy advertises (the strategy is {})", strategy_name(strategy)),
                fix: format!("kubectl patch clusterpolicy {} --type merge -p '{{\"spec\":{{\"mig\":{{\"strategy\":\"mixed\"}}}}}}'  (or request nvidia.com/gpu, which the single strategy advertises)", snapshot.policy_name()),
            });
        }
    }
    if strategy == MigStrategy::Mixed
        && requests.iter().any(|r| r == GPU_RESOURCE)
        && !considered.is_empty()
        && considered
            .iter()
            .all(|n| !has_some(n, GPU_RESOURCE) && !mig_resources(n).is_empty())
    {
        out.push(Finding {
            check: MIG_STRATEGY_MISMATCH,
            problem: format!("pod {pod_name} requests nvidia.com/gpu but the mixed MIG strategy advertises these nodes' GPUs as {}", mig_resources(considered[0]).join(", ")),
            fix: "request one of those MIG resources instead of nvidia.com/gpu".into(),
        });
    }
    // 7. The RuntimeClass exists.
    if let Some(name) = pod
        .spec
        .as_ref()
        .and_then(|s| s.runtime_class_name.as_deref())
    {
        out.extend(runtime_class_finding(
            snapshot,
            name,
            &format!("named by pod {pod_name}"),
        ));
    } else if !requests.is_empty() {
        out.extend(runtime_class_finding(
            snapshot,
            &snapshot.runtime_class(),
            "the GPU runtime",
        ));
    }
    // 8. The pod's DRA ResourceClaims.
    out.extend(dra_diagnosis(snapshot, pod).faults);
    // 9. What the scheduler says.
    if out.is_empty()
        && let Some(message) = unschedulable(pod)
    {
        out.push(Finding {
            check: UNSCHEDULABLE,
            problem: format!("the scheduler says: {message}"),
            fix: format!("kubectl -n {namespace} describe pod {pod_name}"),
        });
    }
    out
}

/// The nodes a DRA pod may go to: every node (DRA devices need no GPU label) that its
/// `nodeSelector` and required node affinity admit, whose blocking taints it tolerates and that
/// is not cordoned.
fn dra_nodes<'a>(snapshot: &'a Snapshot, pod: &Pod) -> Vec<&'a Node> {
    let mut nodes: Vec<&Node> = snapshot
        .nodes
        .iter()
        .filter(|n| {
            affinity::selector_misses(pod, n).is_empty()
                && affinity::affinity_misses(pod, n).is_none()
                && affinity::untolerated(pod, n, affinity::blocks).is_empty()
                && n.spec.as_ref().and_then(|s| s.unschedulable) != Some(true)
        })
        .collect();
    nodes.sort_by_key(|n| n.name_any());
    nodes
}

/// The DRA checks of `pod` ([`dra::diagnose`]); nothing for a pod without claims.
fn dra_diagnosis(snapshot: &Snapshot, pod: &Pod) -> dra::Diagnosis {
    if !dra::has_claims(pod) {
        return dra::Diagnosis::default();
    }
    let mut diagnosis = dra::diagnose(&snapshot.dra, pod, &dra_nodes(snapshot, pod));
    for what in &snapshot.dra.unreadable {
        diagnosis.hints.push(Finding {
            check: dra::DRA_NOT_EVALUATED,
            problem: format!(
                "the doctor may not read {what}: the pod's claims are judged without them"
            ),
            fix: format!("kubectl auth can-i list {what}  (grant the doctor's user list on it)"),
        });
    }
    diagnosis
}

/// Hints for `pod`: the policy's, then what ranks the GPU nodes it may go to without keeping it
/// off any (its preferred node affinity, PreferNoSchedule taints it does not tolerate). Never a
/// reason for Pending, so never a fault.
pub fn pod_hints(snapshot: &Snapshot, pod: &Pod) -> Vec<Finding> {
    let mut out = policy_hints(snapshot);
    out.extend(dra_diagnosis(snapshot, pod).hints);
    let pod_name = pod.name_any();
    let candidates = admitted(snapshot, pod);
    let open: Vec<&Node> = candidates
        .iter()
        .copied()
        .filter(|n| affinity::untolerated(pod, n, affinity::blocks).is_empty())
        .collect();
    let names = |nodes: &[&Node]| {
        nodes
            .iter()
            .map(|n| n.name_any())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if !candidates.is_empty() {
        for preference in affinity::preferences(pod) {
            let preferred: Vec<&Node> = candidates
                .iter()
                .copied()
                .filter(|n| affinity::term_admits(preference.term, n))
                .collect();
            let which = if preferred.is_empty() {
                format!(
                    "none of the GPU nodes it may go to ({}) matches",
                    names(&candidates)
                )
            } else {
                format!("GPU nodes that match: {}", names(&preferred))
            };
            out.push(Finding {
                check: PREFERRED_NODE_AFFINITY,
                problem: format!(
                    "pod {pod_name} prefers (preferredDuringSchedulingIgnoredDuringExecution[{}], \
                     weight {}) nodes with {}; {which}",
                    preference.index,
                    preference.weight,
                    affinity::term_text(preference.term)
                ),
                fix: "nothing to fix: a preference only ranks nodes and never keeps a pod \
                      Pending; to require those nodes, move the term to \
                      requiredDuringSchedulingIgnoredDuringExecution"
                    .into(),
            });
        }
    }
    for node in &open {
        let taints = affinity::untolerated(pod, node, |t| t.effect == affinity::PREFER_NO_SCHEDULE);
        if taints.is_empty() {
            continue;
        }
        let texts: Vec<String> = taints.iter().map(taint_text).collect();
        let tolerations: Vec<String> = taints.iter().map(toleration_text).collect();
        out.push(Finding {
            check: PREFER_NO_SCHEDULE_TAINT,
            problem: format!(
                "pod {pod_name} does not tolerate GPU node {}'s {}: the scheduler avoids the \
                 node while another fits, and still uses it when none does",
                node.name_any(),
                texts.join(", ")
            ),
            fix: format!(
                "if the pod should go there as readily: tolerations: [{}]",
                tolerations.join(", ")
            ),
        });
    }
    out
}

pub(crate) fn strategy_name(s: MigStrategy) -> &'static str {
    match s {
        MigStrategy::None => "none",
        MigStrategy::Single => "single",
        MigStrategy::Mixed => "mixed",
    }
}

/// The scheduler's message for a pod it could not place.
fn unschedulable(pod: &Pod) -> Option<String> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
        .and_then(|c| c.message.clone())
}

/// The findings as text: one block per finding.
pub fn findings_text(findings: &[Finding]) -> String {
    let mut out = String::new();
    if findings.is_empty() {
        out.push_str("No faults found.\n");
    }
    for f in findings {
        let _ = writeln!(out, "FAULT {}: {}\n  fix: {}", f.check, f.problem, f.fix);
    }
    out
}

/// The hints as text, after the faults: one block per hint.
pub fn hints_text(hints: &[Finding]) -> String {
    let mut out = String::new();
    for h in hints {
        let _ = writeln!(out, "HINT {}: {}\n  note: {}", h.check, h.problem, h.fix);
    }
    out
}

/// A client from `kubeconfig` and `context` (default: KUBECONFIG, ~/.kube/config, or the
/// in-cluster account), as every subcommand that talks to a cluster takes them.
pub async fn client(
    kubeconfig: Option<&std::path::Path>,
    context: Option<&str>,
) -> anyhow::Result<Client> {
    Ok(Client::try_from(config(kubeconfig, context).await?)?)
}

/// The active policy (the oldest, the operator's rule) and the others, oldest first.
pub fn split_active(
    mut policies: Vec<ClusterPolicy>,
) -> (Option<ClusterPolicy>, Vec<ClusterPolicy>) {
    policies.sort_by_key(|p| {
        (
            p.metadata.creation_timestamp.clone().map(|t| t.0),
            p.name_any(),
        )
    });
    let mut policies = policies.into_iter();
    (policies.next(), policies.collect())
}

/// Every ClusterPolicy as read, split as the operator does; none when the CRD is not served.
async fn policies(client: &Client) -> anyhow::Result<(Option<ClusterPolicy>, Vec<ClusterPolicy>)> {
    match Api::<ClusterPolicy>::all(client.clone())
        .list(&ListParams::default())
        .await
    {
        Ok(list) => Ok(split_active(list.items)),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok((None, Vec::new())),
        Err(e) => Err(e).context("listing ClusterPolicies"),
    }
}

async fn snapshot(client: &Client, args: &DoctorArgs) -> anyhow::Result<Snapshot> {
    let (policy, other_policies) = policies(client).await?;
    let operator_namespace = args
        .operator_namespace
        .clone()
        .or_else(|| policy.as_ref()?.status.as_ref()?.namespace.clone())
        .unwrap_or_else(|| "gpu-operator".into());
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .context("listing nodes")?
        .items;
    let operand_pods = Api::<Pod>::namespaced(client.clone(), &operator_namespace)
        .list(&ListParams::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGER}")))
        .await
        .with_context(|| format!("listing operand pods in {operator_namespace}"))?
        .items;
    // Read as the operator deployed it: absent when NFD came from elsewhere (then its own
    // tolerations are not ours to judge), and skipped for a user who may not read DaemonSets
    // (that one check is then not made; the rest needs no such right).
    let worker = match Api::<DaemonSet>::namespaced(client.clone(), &operator_namespace)
        .get_opt(NFD_WORKER)
        .await
    {
        Err(kube::Error::Api(e)) if e.code == 403 => None,
        other => {
            other.with_context(|| format!("reading DaemonSet {operator_namespace}/{NFD_WORKER}"))?
        }
    };
    let nfd_worker_tolerations = worker
        .filter(|ds| ds.labels().get(MANAGED_BY_LABEL).map(String::as_str) == Some(MANAGER))
        .map(|ds| {
            ds.spec
                .and_then(|s| s.template.spec)
                .and_then(|p| p.tolerations)
                .unwrap_or_default()
        });
    let runtime_classes = Api::<RuntimeClass>::all(client.clone())
        .list_metadata(&ListParams::default())
        .await
        .context("listing RuntimeClasses")?
        .items
        .into_iter()
        .map(|r| r.name_any())
        .collect();
    let dra = dra_snapshot(client, args.pod.is_some()).await?;
    Ok(Snapshot {
        nodes,
        operand_pods,
        runtime_classes,
        policy,
        other_policies,
        operator_namespace,
        nfd_worker_tolerations,
        dra,
    })
}

/// Every object of kind `K` (of every namespace, for a namespaced kind); none where the API
/// server does not serve its version (no DRA), and `what` added to `unreadable` where the user
/// may not list it.
async fn list_all<K>(
    client: &Client,
    what: &str,
    unreadable: &mut Vec<String>,
) -> anyhow::Result<Vec<K>>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    K::DynamicType: Default,
{
    classify(
        Api::<K>::all(client.clone())
            .list(&ListParams::default())
            .await,
        what,
        unreadable,
    )
}

fn classify<K>(
    listed: kube::Result<kube::core::ObjectList<K>>,
    what: &str,
    unreadable: &mut Vec<String>,
) -> anyhow::Result<Vec<K>>
where
    K: Clone,
{
    match listed {
        Ok(list) => Ok(list.items),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(Vec::new()),
        Err(kube::Error::Api(e)) if e.code == 403 => {
            unreadable.push(what.to_owned());
            Ok(Vec::new())
        }
        Err(e) => Err(e).with_context(|| format!("listing {what}")),
    }
}

/// DRA's objects: the ResourceSlices always (the device-plugin conflict is a cluster fault);
/// with a pod, also the DeviceClasses, ResourceClaims, ResourceClaimTemplates and NVIDIA's
/// ComputeDomains. A cluster without `resource.k8s.io/v1` has none of them.
async fn dra_snapshot(client: &Client, with_pod: bool) -> anyhow::Result<dra::DraSnapshot> {
    use k8s_openapi::api::resource::v1::{
        DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
    };
    let mut out = dra::DraSnapshot::default();
    let mut unreadable = Vec::new();
    out.slices =
        list_all::<ResourceSlice>(client, "resourceslices.resource.k8s.io", &mut unreadable)
            .await?;
    if !with_pod {
        // The cluster's checks skip what they may not read.
        return Ok(out);
    }
    out.classes =
        list_all::<DeviceClass>(client, "deviceclasses.resource.k8s.io", &mut unreadable).await?;
    out.claims =
        list_all::<ResourceClaim>(client, "resourceclaims.resource.k8s.io", &mut unreadable)
            .await?;
    out.templates = list_all::<ResourceClaimTemplate>(
        client,
        "resourceclaimtemplates.resource.k8s.io",
        &mut unreadable,
    )
    .await?;
    let gvk = kube::api::GroupVersionKind::gvk("resource.nvidia.com", "v1beta1", "ComputeDomain");
    let domains = Api::<kube::api::DynamicObject>::all_with(
        client.clone(),
        &kube::api::ApiResource::from_gvk(&gvk),
    )
    .list(&ListParams::default())
    .await;
    out.compute_domains = match domains {
        Ok(list) => Some(
            list.items
                .into_iter()
                .filter_map(|d| serde_json::to_value(d).ok())
                .collect(),
        ),
        Err(kube::Error::Api(e)) if e.code == 404 => None,
        Err(kube::Error::Api(e)) if e.code == 403 => {
            unreadable.push("computedomains.resource.nvidia.com".into());
            None
        }
        Err(e) => return Err(e).context("listing ComputeDomains"),
    };
    out.unreadable = unreadable;
    Ok(out)
}

/// How a doctor run ended without a clean bill: [`Failure::exit_code`] is its exit status.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// The diagnosis ran and found faults (printed in full on standard output).
    #[error("doctor found {0} fault(s)")]
    Faults(usize),
    /// No diagnosis: the reason, with its causes.
    #[error("doctor could not run: {0:#}")]
    CouldNotRun(anyhow::Error),
}

impl Failure {
    /// [`EXIT_FAULTS`] or [`EXIT_COULD_NOT_RUN`].
    pub fn exit_code(&self) -> u8 {
        match self {
            Failure::Faults(_) => EXIT_FAULTS,
            Failure::CouldNotRun(_) => EXIT_COULD_NOT_RUN,
        }
    }
}

/// The client configuration from `kubeconfig` and `context` (default: KUBECONFIG,
/// ~/.kube/config, or the in-cluster account); its `default_namespace` is the context's
/// namespace (else `default`), as kubectl's.
pub async fn config(
    kubeconfig: Option<&std::path::Path>,
    context: Option<&str>,
) -> anyhow::Result<kube::Config> {
    let options = kube::config::KubeConfigOptions {
        context: context.map(str::to_owned),
        ..Default::default()
    };
    Ok(match kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &options)
                .await
                .with_context(|| format!("using kubeconfig {}", path.display()))?
        }
        None if context.is_some() => kube::Config::from_kubeconfig(&options)
            .await
            .context("using the kubeconfig (KUBECONFIG or ~/.kube/config)")?,
        None => kube::Config::infer().await.context(
            "finding a kubeconfig (KUBECONFIG, ~/.kube/config) or an in-cluster account",
        )?,
    })
}

/// The namespace of the pod to explain: `-n`, else the kubeconfig context's.
pub fn pod_namespace(args: &DoctorArgs, config: &kube::Config) -> String {
    args.namespace
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| config.default_namespace.clone())
}

async fn diagnose(args: &DoctorArgs) -> anyhow::Result<Report> {
    let config = config(args.kubeconfig.as_deref(), args.context.as_deref()).await?;
    let namespace = pod_namespace(args, &config);
    let client = Client::try_from(config)?;
    let snapshot = snapshot(&client, args).await?;
    Ok(match &args.pod {
        None => Report::of_cluster(&snapshot),
        Some(name) => {
            let pod = Api::<Pod>::namespaced(client.clone(), &namespace)
                .get(name)
                .await
                .with_context(|| format!("reading pod {namespace}/{name}"))?;
            Report::of_pod(&snapshot, &pod)
        }
    })
}

/// Runs the doctor and prints its report in the chosen format; a [`Failure`] when it finds a
/// fault or cannot run.
pub fn run(args: &DoctorArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let report = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
        .and_then(|runtime| runtime.block_on(diagnose(args)))
        .and_then(|report| Ok((report.render(args.output)?, report)))
        .map_err(Failure::CouldNotRun)?;
    let (text, report) = report;
    out.write_all(text.as_bytes())
        .context("writing the report")
        .map_err(Failure::CouldNotRun)?;
    if report.faults.is_empty() {
        Ok(())
    } else {
        Err(Failure::Faults(report.faults.len()).into())
    }
}

#[cfg(test)]
#[path = "doctor_tests.rs"]
mod tests;
