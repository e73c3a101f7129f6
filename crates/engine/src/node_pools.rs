//! GPU node pools and the GPU memory resource (pure): what the operator wants on one GPU node
//! (`spec.nodePools`, `spec.gpuMemoryResource`), and the patches that get it there from what
//! the node carries. The IO side lives in `controller::node_pools`.
//!
//! Ownership: the operator records on each node, in the annotation [`RECORD_ANNOTATION`], the
//! labels, taints and resource it added, and a fingerprint of what it wanted. Only what that
//! record lists is ever changed back or removed, so a taint or label someone else set survives
//! everything this module does; a key someone else holds with another value is left alone. A
//! node whose record's fingerprint equals what is wanted needs no request at all, which keeps a
//! steady cluster free of reads and writes (the record arrives with the node metadata watch).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Taint, Toleration};
use k8s_openapi::api::scheduling::v1::PriorityClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use crate::api::{ClusterPolicySpec, MemoryUnit, NodePoolTaint, PoolPriorityClass};
use crate::by_model::ByModel;
use crate::model::{MANAGED_BY_LABEL, MANAGER};
use crate::nodes::{GPU_COUNT, GPU_MEMORY, GPU_PRODUCT, NodeView};

/// Annotation on each node holding the operator's [`Record`] (JSON).
pub const RECORD_ANNOTATION: &str = "nvidia.com/gpu-operator.node-pool";

/// The record annotation's value, if the node has one.
pub fn record_annotation(annotations: Option<&BTreeMap<String, String>>) -> Option<String> {
    annotations.and_then(|a| a.get(RECORD_ANNOTATION)).cloned()
}

/// What the operator wants on one node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Desired {
    pub labels: BTreeMap<String, String>,
    /// Sorted, one per key and effect.
    pub taints: Vec<NodePoolTaint>,
    /// Extended resource name and its value in whole units.
    pub memory: Option<(String, u64)>,
}

impl Desired {
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty() && self.taints.is_empty() && self.memory.is_none()
    }

    /// A short digest of the whole want, stored in the record to tell "done" without a read.
    pub fn fingerprint(&self) -> String {
        let json = serde_json::to_vec(self).unwrap_or_default();
        let digest = Sha256::digest(&json);
        digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
    }
}

/// What the operator added to a node and still answers for (the annotation's content).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// [`Desired::fingerprint`] of the want these were written for.
    pub want: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub taints: Vec<NodePoolTaint>,
    /// The extended resource name written into capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<String>,
}

impl Record {
    /// The record on `node`; an unreadable one counts as none (nothing is then removed).
    pub fn of(node: &NodeView) -> Option<Record> {
        Record::parse(node.pool_record.as_deref())
    }

    /// The record in an annotation value (see [`Record::of`]).
    pub fn parse(annotation: Option<&str>) -> Option<Record> {
        annotation.and_then(|s| serde_json::from_str(s).ok())
    }
}

/// The taints `spec.nodePools` asks for (deduplicated by key and effect, first wins); empty
/// when the section is off.
pub fn pool_taints(spec: &ClusterPolicySpec) -> Vec<NodePoolTaint> {
    let mut out: Vec<NodePoolTaint> = Vec::new();
    let Some(pools) = spec.node_pools.as_ref().filter(|p| p.is_enabled()) else {
        return out;
    };
    for t in pools.taints.iter().flatten() {
        if !out.iter().any(|o| o.key == t.key && o.effect == t.effect) {
            out.push(t.clone());
        }
    }
    out.sort();
    out
}

/// GFD's product name shortened to a GPU type: `NVIDIA-A100-SXM4-40GB` -> `a100`,
/// `Tesla-T4` -> `t4`, `NVIDIA-H100-80GB-HBM3` -> `h100`.
pub fn gpu_type(product: &str) -> Option<String> {
    let lower = product.to_ascii_lowercase();
    let mut rest = lower.as_str();
    for prefix in ["nvidia-", "tesla-"] {
        rest = rest.strip_prefix(prefix).unwrap_or(rest);
    }
    let head: String = rest
        .split('-')
        .next()
        .unwrap_or_default()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_'))
        .take(63)
        .collect();
    let head = head.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    (!head.is_empty()).then(|| head.to_owned())
}

/// A MiB count as a label value: whole GiB rounded down (`40960` -> `40Gi`), or MiB below 1 GiB.
pub fn memory_label(mib: u64) -> String {
    if mib >= 1024 {
        format!("{}Gi", mib / 1024)
    } else {
        format!("{mib}Mi")
    }
}

fn parsed(node: &NodeView, key: &str) -> Option<u64> {
    node.label(key)
        .and_then(|v| v.trim().parse().ok())
        .filter(|n| *n > 0)
}

/// The memory resource of `node` in whole `unit`s: memory per GPU x GPU count, rounded down.
pub fn memory_units(node: &NodeView, unit: MemoryUnit) -> Option<u64> {
    let total_mib = parsed(node, GPU_MEMORY)?.checked_mul(parsed(node, GPU_COUNT)?)?;
    Some(match unit {
        MemoryUnit::Mi => total_mib,
        MemoryUnit::Gi => total_mib / 1024,
    })
}

/// What `spec` wants on `node`: nothing unless it is a GPU node. `by_model` adds the layout
/// labels `spec.layoutsByModel` gives the node ([`crate::model::ValidatedPolicy::by_model`]).
pub fn desired(spec: &ClusterPolicySpec, by_model: &ByModel, node: &NodeView) -> Desired {
    let mut want = Desired::default();
    // The layouts by model decide for themselves which nodes are GPU nodes (crate::by_model).
    if let Some(labels) = by_model.labels_for(&node.name) {
        want.labels.extend(labels.clone());
    }
    if !node.is_gpu_node() {
        return want;
    }
    if let Some(pools) = spec.node_pools.as_ref().filter(|p| p.is_enabled()) {
        want.taints = pool_taints(spec);
        want.labels.extend(pools.labels.clone().unwrap_or_default());
        let derived = pools.derived_labels.clone().unwrap_or_default();
        let values = [
            (derived.product, node.label(GPU_PRODUCT).and_then(gpu_type)),
            (derived.memory, parsed(node, GPU_MEMORY).map(memory_label)),
            (
                derived.count,
                parsed(node, GPU_COUNT).map(|n| n.to_string()),
            ),
        ];
        for (key, value) in values {
            if let (Some(key), Some(value)) = (key.filter(|k| !k.is_empty()), value) {
                want.labels.insert(key, value);
            }
        }
    }
    if let Some(memory) = spec.gpu_memory_resource.as_ref().filter(|m| m.is_enabled())
        && let Some(units) = memory_units(node, memory.unit())
    {
        want.memory = Some((memory.name().to_owned(), units));
    }
    want
}

/// Whether `node` may need a write: its record is not for `want` (or it has a record and
/// nothing is wanted any more).
pub fn needs_work(node: &NodeView, want: &Desired) -> bool {
    match Record::of(node) {
        Some(record) => want.is_empty() || record.want != want.fingerprint(),
        None => !want.is_empty() || node.pool_record.is_some(),
    }
}

/// Plans the status patch for the memory resource on `node` (read in full): a merge patch of
/// `capacity` and `allocatable`, `None` when the node already shows what is wanted.
pub fn status_patch(node: &Node, record: &Record, want: &Desired) -> Option<Value> {
    let status = node.status.as_ref();
    let capacity = status.and_then(|s| s.capacity.as_ref());
    let allocatable = status.and_then(|s| s.allocatable.as_ref());
    let mut cap = Map::new();
    if let Some(old) = &record.memory
        && want.memory.as_ref().is_none_or(|(name, _)| name != old)
    {
        cap.insert(old.clone(), Value::Null);
    }
    if let Some((name, units)) = &want.memory {
        let value = units.to_string();
        let has = |m: Option<&BTreeMap<String, _>>| {
            m.and_then(|m| m.get(name)).is_some_and(
                |q: &k8s_openapi::apimachinery::pkg::api::resource::Quantity| q.0 == value,
            )
        };
        if !has(capacity) || !has(allocatable) {
            cap.insert(name.clone(), Value::String(value));
        }
    }
    // Drop removals of what the node no longer has.
    cap.retain(|k, v| {
        !v.is_null()
            || capacity.is_some_and(|c| c.contains_key(k))
            || allocatable.is_some_and(|a| a.contains_key(k))
    });
    // The kubelet copies an extended resource from capacity to allocatable; without a kubelet
    // (kwok), and until it does, the scheduler reads allocatable, so both are written.
    (!cap.is_empty()).then(|| json!({"status": {"capacity": cap.clone(), "allocatable": cap}}))
}

fn same_slot(t: &Taint, p: &NodePoolTaint) -> bool {
    t.key == p.key && t.effect == p.effect.as_str()
}

fn value_of(t: &Taint) -> &str {
    t.value.as_deref().unwrap_or_default()
}

fn pool_value(p: &NodePoolTaint) -> &str {
    p.value.as_deref().unwrap_or_default()
}

/// Whether the operator's own field manager ([`MANAGER`]) last wrote label `key` of `node`
/// (read in full, with its managed fields): a value the operator wrote elsewhere, such as the
/// `all-disabled` MIG default (decision 7), which a layout of `spec.layoutsByModel` may replace.
/// Anyone else who sets the label takes the field over, so a hand-set value never counts.
pub fn label_written_by_operator(node: &Node, key: &str) -> bool {
    let field = format!("f:{key}");
    node.metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|entry| entry.manager.as_deref() == Some(MANAGER))
        .filter_map(|entry| entry.fields_v1.as_ref())
        .any(|fields| fields.0["f:metadata"]["f:labels"].get(&field).is_some())
}

/// Plans the object patch for `node` (read in full), given the record it carries: labels, the
/// record annotation and the full taint list, with the node's `resourceVersion` as a
/// precondition; `None` when nothing differs. Also returns the keys someone else holds with
/// another value (label `key`, taint `key:effect`), which are left alone.
pub fn object_patch(node: &Node, record: &Record, want: &Desired) -> (Option<Value>, Vec<String>) {
    let labels = node.metadata.labels.clone().unwrap_or_default();
    let mut conflicts = Vec::new();
    let mut owned = Record {
        want: want.fingerprint(),
        memory: want.memory.as_ref().map(|(name, _)| name.clone()),
        ..Record::default()
    };

    // Labels: remove ours that are no longer wanted (only while they hold our value), set the
    // wanted ones that are absent or ours.
    let mut label_patch = Map::new();
    for (key, ours) in &record.labels {
        if !want.labels.contains_key(key) && labels.get(key) == Some(ours) {
            label_patch.insert(key.clone(), Value::Null);
        }
    }
    for (key, value) in &want.labels {
        match labels.get(key) {
            None => {
                label_patch.insert(key.clone(), Value::String(value.clone()));
                owned.labels.insert(key.clone(), value.clone());
            }
            Some(current) if current == value => {
                if record.labels.contains_key(key) {
                    owned.labels.insert(key.clone(), value.clone());
                }
            }
            Some(current)
                if record.labels.get(key) == Some(current)
                    || label_written_by_operator(node, key) =>
            {
                label_patch.insert(key.clone(), Value::String(value.clone()));
                owned.labels.insert(key.clone(), value.clone());
            }
            Some(_) => conflicts.push(key.clone()),
        }
    }

    // Taints: the same rules per key and effect.
    let current: Vec<Taint> = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    let mut taints = current.clone();
    for ours in &record.taints {
        if !want
            .taints
            .iter()
            .any(|w| w.key == ours.key && w.effect == ours.effect)
        {
            taints.retain(|t| !(same_slot(t, ours) && value_of(t) == pool_value(ours)));
        }
    }
    for wanted in &want.taints {
        let recorded = record
            .taints
            .iter()
            .find(|r| r.key == wanted.key && r.effect == wanted.effect);
        match taints.iter_mut().find(|t| same_slot(t, wanted)) {
            None => {
                taints.push(Taint {
                    key: wanted.key.clone(),
                    value: wanted.value.clone().filter(|v| !v.is_empty()),
                    effect: wanted.effect.as_str().to_owned(),
                    time_added: None,
                });
                owned.taints.push(wanted.clone());
            }
            Some(t) if value_of(t) == pool_value(wanted) => {
                if recorded.is_some() {
                    owned.taints.push(wanted.clone());
                }
            }
            Some(t) if recorded.is_some_and(|r| pool_value(r) == value_of(t)) => {
                t.value = wanted.value.clone().filter(|v| !v.is_empty());
                owned.taints.push(wanted.clone());
            }
            Some(_) => conflicts.push(format!("{}:{}", wanted.key, wanted.effect.as_str())),
        }
    }

    let annotation = (!want.is_empty())
        .then(|| serde_json::to_string(&owned).unwrap_or_default())
        .map_or(Value::Null, Value::String);
    let current_annotation = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(RECORD_ANNOTATION))
        .map_or(Value::Null, |s| Value::String(s.clone()));

    let mut metadata = Map::new();
    if !label_patch.is_empty() {
        metadata.insert("labels".into(), Value::Object(label_patch));
    }
    if annotation != current_annotation {
        metadata.insert(
            "annotations".into(),
            json!({ RECORD_ANNOTATION: annotation }),
        );
    }
    let taints_changed = taints != current;
    if metadata.is_empty() && !taints_changed {
        return (None, conflicts);
    }
    if let Some(rv) = &node.metadata.resource_version {
        metadata.insert("resourceVersion".into(), Value::String(rv.clone()));
    }
    let mut patch = json!({ "metadata": metadata });
    if taints_changed {
        // A merge patch replaces the whole list; the resourceVersion precondition makes that
        // safe against a taint someone adds meanwhile.
        patch["spec"] = json!({ "taints": taints });
    }
    (Some(patch), conflicts)
}

/// The tolerations operands need for the pool's taints: one `Exists` per key and effect that
/// `existing` does not already tolerate.
pub fn operand_tolerations(spec: &ClusterPolicySpec, existing: &[Toleration]) -> Vec<Toleration> {
    let tolerated = |t: &NodePoolTaint| {
        existing.iter().any(|tol| {
            let key_ok = match tol.key.as_deref().unwrap_or_default() {
                "" => tol.operator.as_deref() == Some("Exists"),
                key => key == t.key,
            };
            let value_ok = tol.operator.as_deref() == Some("Exists")
                || tol.value.as_deref().unwrap_or_default() == pool_value(t);
            let effect_ok = tol
                .effect
                .as_deref()
                .is_none_or(|e| e.is_empty() || e == t.effect.as_str());
            key_ok && value_ok && effect_ok
        })
    };
    pool_taints(spec)
        .iter()
        .filter(|t| !tolerated(t))
        .map(|t| Toleration {
            key: Some(t.key.clone()),
            operator: Some("Exists".to_owned()),
            effect: Some(t.effect.as_str().to_owned()),
            ..Toleration::default()
        })
        .collect()
}

/// The status note for an enabled memory resource: it is accounting, not isolation.
pub fn status_note(spec: &ClusterPolicySpec) -> Option<String> {
    let memory = spec
        .gpu_memory_resource
        .as_ref()
        .filter(|m| m.is_enabled())?;
    let unit = match memory.unit() {
        MemoryUnit::Gi => "GiB",
        MemoryUnit::Mi => "MiB",
    };
    Some(format!(
        "gpuMemoryResource: {} counts GPU memory in {unit} for the scheduler only; it is not \
         isolation (a pod can use more GPU memory than it requests)",
        memory.name()
    ))
}

/// Label on the PriorityClasses the operator creates for `nodePools.priorityClasses` (beside
/// the usual managed-by label): only those are ever changed or deleted.
pub const PRIORITY_CLASS_LABEL: &str = "nvidia.com/gpu-operator.node-pool";

/// The PriorityClasses `spec.nodePools` asks for (empty when the section is off).
pub fn desired_priority_classes(spec: &ClusterPolicySpec) -> Vec<PoolPriorityClass> {
    spec.node_pools
        .as_ref()
        .filter(|p| p.is_enabled())
        .and_then(|p| p.priority_classes.clone())
        .unwrap_or_default()
}

/// The PriorityClass object for `pc`, owned by the policy (`owner`) so that it goes with it.
pub fn priority_class_object(
    pc: &PoolPriorityClass,
    owner: Option<OwnerReference>,
) -> PriorityClass {
    PriorityClass {
        metadata: ObjectMeta {
            name: Some(pc.name.clone()),
            labels: Some(BTreeMap::from([
                (MANAGED_BY_LABEL.to_owned(), MANAGER.to_owned()),
                (PRIORITY_CLASS_LABEL.to_owned(), "priority-class".to_owned()),
            ])),
            owner_references: owner.map(|o| vec![o]),
            ..ObjectMeta::default()
        },
        value: Some(pc.value),
        description: pc.description.clone(),
        preemption_policy: pc.preemption_policy.map(|p| p.as_str().to_owned()),
        global_default: None,
    }
}

/// What to do with PriorityClasses: `ours` are the live ones carrying [`PRIORITY_CLASS_LABEL`].
#[derive(Debug, Default, PartialEq)]
pub struct PriorityClassPlan {
    pub create: Vec<PoolPriorityClass>,
    /// Value or preemption policy changed: both are immutable, so delete and create again.
    pub recreate: Vec<PoolPriorityClass>,
    /// Only the description changed.
    pub update: Vec<PoolPriorityClass>,
    pub delete: Vec<String>,
}

pub fn priority_class_plan(
    ours: &[PriorityClass],
    want: &[PoolPriorityClass],
) -> PriorityClassPlan {
    let mut plan = PriorityClassPlan::default();
    let live: BTreeMap<String, &PriorityClass> = ours
        .iter()
        .map(|pc| (pc.metadata.name.clone().unwrap_or_default(), pc))
        .collect();
    for pc in want {
        match live.get(&pc.name) {
            None => plan.create.push(pc.clone()),
            Some(l) => {
                let policy = pc
                    .preemption_policy
                    .map_or("PreemptLowerPriority", |p| p.as_str());
                let live_policy = l
                    .preemption_policy
                    .as_deref()
                    .unwrap_or("PreemptLowerPriority");
                if l.value != Some(pc.value) || live_policy != policy {
                    plan.recreate.push(pc.clone());
                } else if l.description != pc.description {
                    plan.update.push(pc.clone());
                }
            }
        }
    }
    plan.delete = live
        .keys()
        .filter(|name| !want.iter().any(|pc| &pc.name == *name))
        .cloned()
        .collect();
    plan
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use k8s_openapi::api::core::v1::{NodeSpec, NodeStatus};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use kube_core::ObjectMeta;

    use super::*;
    use crate::api::{DerivedLabelsSpec, GpuMemoryResourceSpec, NodePoolsSpec, TaintEffect};
    use crate::nodes::GPU_PRESENT;

    fn taint(key: &str, value: &str) -> NodePoolTaint {
        NodePoolTaint {
            key: key.into(),
            value: Some(value.into()),
            effect: TaintEffect::NoSchedule,
        }
    }

    fn spec() -> ClusterPolicySpec {
        ClusterPolicySpec {
            node_pools: Some(NodePoolsSpec {
                enabled: Some(true),
                taints: Some(vec![
                    taint("nvidia.com/gpu", "present"),
                    taint("dedicated", "gpu"),
                ]),
                labels: Some([("workload-class".to_string(), "inference".to_string())].into()),
                derived_labels: Some(DerivedLabelsSpec {
                    product: Some("gpu-type".into()),
                    memory: Some("gpu-memory".into()),
                    count: Some("gpu-count".into()),
                }),
                priority_classes: None,
            }),
            gpu_memory_resource: Some(GpuMemoryResourceSpec {
                enabled: Some(true),
                name: Some("example.com/vram".into()),
                unit: None,
            }),
            ..ClusterPolicySpec::default()
        }
    }

    fn view(product: &str, memory_mib: &str, count: &str) -> NodeView {
        let labels = [
            (GPU_PRESENT, "true"),
            (GPU_PRODUCT, product),
            (GPU_MEMORY, memory_mib),
            (GPU_COUNT, count),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        NodeView::from_labels("gpu-1", Some("7".into()), &labels)
    }

    fn a100() -> NodeView {
        view("NVIDIA-A100-SXM4-40GB", "40960", "8")
    }

    /// A node as the API server returns it, with `view`'s labels plus `extra` and `taints`.
    fn live(view: &NodeView, extra: &[(&str, &str)], taints: &[(&str, &str)]) -> Node {
        let mut labels = view.labels.clone();
        labels.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        Node {
            metadata: ObjectMeta {
                name: Some(view.name.clone()),
                resource_version: view.resource_version.clone(),
                labels: Some(labels),
                annotations: view
                    .pool_record
                    .clone()
                    .map(|r| [(RECORD_ANNOTATION.to_string(), r)].into()),
                ..ObjectMeta::default()
            },
            spec: Some(NodeSpec {
                taints: Some(
                    taints
                        .iter()
                        .map(|(k, v)| Taint {
                            key: k.to_string(),
                            value: Some(v.to_string()),
                            effect: "NoSchedule".into(),
                            time_added: None,
                        })
                        .collect(),
                ),
                ..NodeSpec::default()
            }),
            status: Some(NodeStatus::default()),
        }
    }

    /// Applies the object patch the way the API server's merge patch would, for the fields the
    /// planner writes, and returns the node's labels, taints and record afterwards.
    fn apply(node: &Node, patch: &Value) -> Node {
        let mut out = node.clone();
        let labels = out.metadata.labels.get_or_insert_default();
        for (k, v) in patch["metadata"]["labels"]
            .as_object()
            .into_iter()
            .flatten()
        {
            match v.as_str() {
                Some(v) => labels.insert(k.clone(), v.to_string()),
                None => labels.remove(k),
            };
        }
        if let Some(record) = patch["metadata"]["annotations"].get(RECORD_ANNOTATION) {
            let annotations = out.metadata.annotations.get_or_insert_default();
            match record.as_str() {
                Some(r) => annotations.insert(RECORD_ANNOTATION.into(), r.into()),
                None => annotations.remove(RECORD_ANNOTATION),
            };
        }
        if let Some(taints) = patch["spec"].get("taints") {
            out.spec.get_or_insert_default().taints =
                Some(serde_json::from_value(taints.clone()).unwrap());
        }
        out
    }

    fn record_of(node: &Node) -> Record {
        serde_json::from_str(&node.metadata.annotations.as_ref().unwrap()[RECORD_ANNOTATION])
            .unwrap()
    }

    fn taint_keys(node: &Node) -> Vec<String> {
        node.spec
            .as_ref()
            .unwrap()
            .taints
            .iter()
            .flatten()
            .map(|t| format!("{}={}", t.key, value_of(t)))
            .collect()
    }

    #[test]
    fn gpu_types_and_memory_labels_are_derived_from_gfds_labels() {
        assert_eq!(gpu_type("NVIDIA-A100-SXM4-40GB").as_deref(), Some("a100"));
        assert_eq!(gpu_type("Tesla-T4").as_deref(), Some("t4"));
        assert_eq!(gpu_type("NVIDIA-H100-80GB-HBM3").as_deref(), Some("h100"));
        assert_eq!(gpu_type("NVIDIA-H200").as_deref(), Some("h200"));
        assert_eq!(gpu_type("NVIDIA-"), None);
        assert_eq!(memory_label(40960), "40Gi");
        assert_eq!(memory_label(81559), "79Gi");
        assert_eq!(memory_label(512), "512Mi");
    }

    #[test]
    fn a_gpu_node_wants_the_taints_the_derived_labels_and_its_memory() {
        let want = desired(&spec(), &ByModel::default(), &a100());
        assert_eq!(want.labels["gpu-type"], "a100");
        assert_eq!(want.labels["gpu-memory"], "40Gi");
        assert_eq!(want.labels["gpu-count"], "8");
        assert_eq!(want.labels["workload-class"], "inference");
        assert_eq!(want.taints.len(), 2);
        // 8 x 40 GiB.
        assert_eq!(want.memory, Some(("example.com/vram".into(), 320)));
        let t4 = desired(
            &spec(),
            &ByModel::default(),
            &view("Tesla-T4", "15360", "1"),
        );
        assert_eq!(t4.memory, Some(("example.com/vram".into(), 15)));
        // 8 x 81,559 MiB rounded down once, not per GPU.
        let h100 = desired(
            &spec(),
            &ByModel::default(),
            &view("NVIDIA-H100-80GB-HBM3", "81559", "8"),
        );
        assert_eq!(h100.memory, Some(("example.com/vram".into(), 637)));
    }

    #[test]
    fn nothing_is_wanted_when_off_or_on_a_cpu_node() {
        assert!(desired(&ClusterPolicySpec::default(), &ByModel::default(), &a100()).is_empty());
        let cpu = NodeView::from_labels("cpu", None, &BTreeMap::new());
        assert!(desired(&spec(), &ByModel::default(), &cpu).is_empty());
        let mut off = spec();
        off.node_pools.as_mut().unwrap().enabled = Some(false);
        off.gpu_memory_resource.as_mut().unwrap().enabled = None;
        assert!(desired(&off, &ByModel::default(), &a100()).is_empty());
    }

    #[test]
    fn a_node_is_tainted_labelled_and_recorded_then_needs_no_more_work() {
        let view = a100();
        let want = desired(&spec(), &ByModel::default(), &view);
        assert!(needs_work(&view, &want));
        let node = live(&view, &[], &[]);
        let (patch, conflicts) = object_patch(&node, &Record::default(), &want);
        assert!(conflicts.is_empty());
        let patch = patch.unwrap();
        assert_eq!(patch["metadata"]["resourceVersion"], "7");
        let after = apply(&node, &patch);
        assert_eq!(
            taint_keys(&after),
            ["dedicated=gpu", "nvidia.com/gpu=present"]
        );
        assert_eq!(after.metadata.labels.as_ref().unwrap()["gpu-type"], "a100");
        let record = record_of(&after);
        assert_eq!(record.want, want.fingerprint());
        // The cache now shows the record: nothing to do, no request.
        let cached = NodeView {
            pool_record: Some(serde_json::to_string(&record).unwrap()),
            ..view
        };
        assert!(!needs_work(&cached, &want));
        assert_eq!(object_patch(&after, &record, &want).0, None);
    }

    #[test]
    fn removing_the_section_removes_only_what_the_operator_added() {
        let view = a100();
        let want = desired(&spec(), &ByModel::default(), &view);
        // Someone else tainted the node with the same key and set a label we also want.
        let node = live(
            &view,
            &[("workload-class", "inference"), ("team", "ml")],
            &[("nvidia.com/gpu", "present"), ("reserved", "yes")],
        );
        let after = apply(
            &node,
            &object_patch(&node, &Record::default(), &want).0.unwrap(),
        );
        let record = record_of(&after);
        assert_eq!(
            record.taints,
            vec![taint("dedicated", "gpu")],
            "only the one we added"
        );
        assert!(!record.labels.contains_key("workload-class"));

        let cached = NodeView {
            pool_record: Some(serde_json::to_string(&record).unwrap()),
            ..view.clone()
        };
        let none = desired(&ClusterPolicySpec::default(), &ByModel::default(), &cached);
        assert!(needs_work(&cached, &none));
        let cleaned = apply(&after, &object_patch(&after, &record, &none).0.unwrap());
        assert_eq!(
            taint_keys(&cleaned),
            ["nvidia.com/gpu=present", "reserved=yes"]
        );
        let labels = cleaned.metadata.labels.as_ref().unwrap();
        assert_eq!(labels["workload-class"], "inference", "someone else's");
        assert_eq!(labels["team"], "ml");
        assert!(!labels.contains_key("gpu-type"), "ours, removed");
        assert!(
            !cleaned
                .metadata
                .annotations
                .as_ref()
                .unwrap()
                .contains_key(RECORD_ANNOTATION),
            "the record goes with the last thing it listed"
        );
    }

    #[test]
    fn a_key_someone_else_holds_with_another_value_is_left_alone_and_reported() {
        let view = a100();
        let want = desired(&spec(), &ByModel::default(), &view);
        let node = live(
            &view,
            &[("gpu-type", "custom")],
            &[("dedicated", "training")],
        );
        let (patch, conflicts) = object_patch(&node, &Record::default(), &want);
        assert_eq!(conflicts, ["gpu-type", "dedicated:NoSchedule"]);
        let after = apply(&node, &patch.unwrap());
        assert_eq!(
            after.metadata.labels.as_ref().unwrap()["gpu-type"],
            "custom"
        );
        assert!(taint_keys(&after).contains(&"dedicated=training".to_string()));
    }

    #[test]
    fn a_changed_value_of_ours_is_updated() {
        let view = a100();
        let record = Record {
            want: "old".into(),
            labels: [("workload-class".to_string(), "training".to_string())].into(),
            taints: vec![taint("dedicated", "old")],
            memory: None,
        };
        let node = live(
            &view,
            &[("workload-class", "training")],
            &[("dedicated", "old")],
        );
        let want = desired(&spec(), &ByModel::default(), &view);
        let after = apply(&node, &object_patch(&node, &record, &want).0.unwrap());
        assert_eq!(
            after.metadata.labels.as_ref().unwrap()["workload-class"],
            "inference"
        );
        assert!(taint_keys(&after).contains(&"dedicated=gpu".to_string()));
    }

    #[test]
    fn the_memory_resource_is_written_only_when_it_differs_and_removed_when_off() {
        let view = a100();
        let want = desired(&spec(), &ByModel::default(), &view);
        let mut node = live(&view, &[], &[]);
        let patch = status_patch(&node, &Record::default(), &want).unwrap();
        assert_eq!(
            patch,
            json!({"status": {"capacity": {"example.com/vram": "320"}, "allocatable": {"example.com/vram": "320"}}})
        );
        let q: BTreeMap<String, Quantity> =
            [("example.com/vram".to_string(), Quantity("320".into()))].into();
        node.status = Some(NodeStatus {
            capacity: Some(q.clone()),
            allocatable: Some(q),
            ..NodeStatus::default()
        });
        assert_eq!(
            status_patch(&node, &Record::default(), &want),
            None,
            "already there"
        );
        let record = Record {
            memory: Some("example.com/vram".into()),
            ..Record::default()
        };
        let off = desired(&ClusterPolicySpec::default(), &ByModel::default(), &view);
        assert_eq!(
            status_patch(&node, &record, &off).unwrap(),
            json!({"status": {"capacity": {"example.com/vram": null}, "allocatable": {"example.com/vram": null}}})
        );
        // Not ours: never removed.
        assert_eq!(status_patch(&node, &Record::default(), &off), None);
    }

    #[test]
    fn priority_classes_are_created_recreated_on_value_change_and_deleted_when_unwanted() {
        let pc = |name: &str, value: i32| PoolPriorityClass {
            name: name.into(),
            value,
            description: None,
            preemption_policy: None,
        };
        let want = vec![pc("gpu-inference", 1000), pc("gpu-training", 500)];
        let live = vec![
            priority_class_object(&pc("gpu-training", 400), None),
            priority_class_object(&pc("gpu-old", 1), None),
        ];
        let plan = priority_class_plan(&live, &want);
        assert_eq!(plan.create, [pc("gpu-inference", 1000)]);
        assert_eq!(plan.recreate, [pc("gpu-training", 500)]);
        assert_eq!(plan.delete, ["gpu-old"]);
        let same: Vec<PriorityClass> = want
            .iter()
            .map(|p| priority_class_object(p, None))
            .collect();
        assert_eq!(
            priority_class_plan(&same, &want),
            PriorityClassPlan::default()
        );
        let mut spec = spec();
        spec.node_pools.as_mut().unwrap().priority_classes = Some(want.clone());
        assert_eq!(desired_priority_classes(&spec), want);
        spec.node_pools.as_mut().unwrap().enabled = Some(false);
        assert!(desired_priority_classes(&spec).is_empty());
    }

    #[test]
    fn operands_tolerate_every_pool_taint_once() {
        let existing = vec![Toleration {
            key: Some("nvidia.com/gpu".into()),
            operator: Some("Exists".into()),
            effect: Some("NoSchedule".into()),
            ..Toleration::default()
        }];
        let added = operand_tolerations(&spec(), &existing);
        assert_eq!(added.len(), 1);
        assert_eq!(added[0].key.as_deref(), Some("dedicated"));
        assert!(operand_tolerations(&ClusterPolicySpec::default(), &[]).is_empty());
    }

    /// `node` with label `key` last written by field manager `manager`.
    fn written_by(mut node: Node, manager: &str, key: &str) -> Node {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry};
        let fields = serde_json::json!({"f:metadata": {"f:labels": {format!("f:{key}"): {}}}});
        node.metadata
            .managed_fields
            .get_or_insert_default()
            .push(ManagedFieldsEntry {
                manager: Some(manager.to_owned()),
                operation: Some("Update".into()),
                fields_type: Some("FieldsV1".into()),
                fields_v1: Some(FieldsV1(fields)),
                ..ManagedFieldsEntry::default()
            });
        node
    }

    fn by_model(node: &str, labels: &[(&str, &str)]) -> ByModel {
        ByModel {
            labels: [(
                node.to_owned(),
                labels
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            )]
            .into(),
            ..ByModel::default()
        }
    }

    #[test]
    fn a_layout_by_model_replaces_the_operators_mig_default_but_never_a_hand_set_value() {
        use crate::nodes::MIG_CONFIG;
        let view = a100();
        let layouts = by_model(&view.name, &[(MIG_CONFIG, "all-1g.5gb")]);
        let want = desired(&ClusterPolicySpec::default(), &layouts, &view);
        assert_eq!(want.labels[MIG_CONFIG], "all-1g.5gb");

        // The labeller's all-disabled default, written under the operator's field manager.
        let defaulted = written_by(
            live(&view, &[(MIG_CONFIG, "all-disabled")], &[]),
            MANAGER,
            MIG_CONFIG,
        );
        let (patch, conflicts) = object_patch(&defaulted, &Record::default(), &want);
        assert!(conflicts.is_empty());
        let after = apply(&defaulted, &patch.unwrap());
        assert_eq!(
            after.metadata.labels.as_ref().unwrap()[MIG_CONFIG],
            "all-1g.5gb"
        );
        assert_eq!(record_of(&after).labels[MIG_CONFIG], "all-1g.5gb");

        // The same value set with kubectl label: someone else's, left alone.
        let by_hand = written_by(
            live(&view, &[(MIG_CONFIG, "all-disabled")], &[]),
            "kubectl-label",
            MIG_CONFIG,
        );
        let (patch, conflicts) = object_patch(&by_hand, &Record::default(), &want);
        assert_eq!(conflicts, [MIG_CONFIG]);
        let after = apply(&by_hand, &patch.unwrap());
        assert_eq!(
            after.metadata.labels.as_ref().unwrap()[MIG_CONFIG],
            "all-disabled"
        );
        assert!(!record_of(&after).labels.contains_key(MIG_CONFIG));
    }

    #[test]
    fn removing_a_layout_by_model_removes_the_label_the_operator_set_and_keeps_the_rest() {
        use crate::nodes::DEVICE_PLUGIN_CONFIG;
        let view = a100();
        let layouts = by_model(&view.name, &[(DEVICE_PLUGIN_CONFIG, "time-sliced-4")]);
        let want = desired(&ClusterPolicySpec::default(), &layouts, &view);
        let node = live(&view, &[], &[]);
        let labelled = apply(
            &node,
            &object_patch(&node, &Record::default(), &want).0.unwrap(),
        );
        assert_eq!(
            labelled.metadata.labels.as_ref().unwrap()[DEVICE_PLUGIN_CONFIG],
            "time-sliced-4"
        );
        let gone = desired(&ClusterPolicySpec::default(), &ByModel::default(), &view);
        let after = apply(
            &labelled,
            &object_patch(&labelled, &record_of(&labelled), &gone)
                .0
                .unwrap(),
        );
        assert!(
            !after
                .metadata
                .labels
                .as_ref()
                .unwrap()
                .contains_key(DEVICE_PLUGIN_CONFIG)
        );
        assert!(
            after
                .metadata
                .annotations
                .as_ref()
                .is_none_or(|a| !a.contains_key(RECORD_ANNOTATION))
        );
    }
}
