//! Validate stage of `doctor` (pure, no IO): where the scheduler lets a pod go by its
//! `nodeSelector`, required node affinity and tolerations, and which rule keeps it off a node.
//!
//! The rules are the scheduler's (its NodeAffinity and TaintToleration plugins, and the
//! `nodeaffinity` package of Kubernetes' component-helpers they use), so that the doctor never
//! calls a node fine that the scheduler refuses, nor the other way round:
//!
//! - `nodeSelector` and the required node affinity must both admit a node.
//! - Required `nodeSelectorTerms` are ORed; within a term `matchExpressions` and `matchFields`
//!   are ANDed. A term with neither matches no node, and an empty term list matches none.
//! - A term the scheduler cannot parse (an unknown operator, `In`/`NotIn` without values,
//!   `Exists`/`DoesNotExist` with values, `Gt`/`Lt` without exactly one integer, `matchFields`
//!   other than `In`/`NotIn` with one value) matches no node. The API server refuses most such
//!   pods; label key and value syntax is left to it.
//! - `Gt`/`Lt` read the node's label and the expression's value as integers; a label that is
//!   not one never matches.
//! - `matchFields` sees only `metadata.name`.
//! - Preferred terms only rank nodes (weight 0 and empty terms count for nothing): never a
//!   reason to stay Pending.
//! - A toleration with an empty effect matches every effect and one with an empty key every
//!   key; the operator defaults to `Equal`, which compares values; `Exists` matches any value;
//!   any other operator matches nothing. `NoSchedule` and `NoExecute` taints keep a pod off,
//!   `PreferNoSchedule` only ranks.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Node, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Pod, Taint, Toleration,
};

/// The only node field `matchFields` can test.
const NAME_FIELD: &str = "metadata.name";

const NO_SCHEDULE: &str = "NoSchedule";
const NO_EXECUTE: &str = "NoExecute";
pub const PREFER_NO_SCHEDULE: &str = "PreferNoSchedule";

/// Whether `toleration` tolerates `taint`, by the scheduler's rule.
pub fn tolerates(toleration: &Toleration, taint: &Taint) -> bool {
    let effect = toleration.effect.as_deref().unwrap_or_default();
    if !effect.is_empty() && effect != taint.effect {
        return false;
    }
    let key = toleration.key.as_deref().unwrap_or_default();
    if !key.is_empty() && key != taint.key {
        return false;
    }
    match toleration.operator.as_deref().unwrap_or_default() {
        "" | "Equal" => {
            toleration.value.as_deref().unwrap_or_default()
                == taint.value.as_deref().unwrap_or_default()
        }
        "Exists" => true,
        _ => false,
    }
}

/// Whether a taint keeps pods that do not tolerate it off the node (not only ranks the node).
pub fn blocks(taint: &Taint) -> bool {
    taint.effect == NO_SCHEDULE || taint.effect == NO_EXECUTE
}

fn tolerations(pod: &Pod) -> &[Toleration] {
    pod.spec
        .as_ref()
        .and_then(|s| s.tolerations.as_deref())
        .unwrap_or_default()
}

fn node_taints(node: &Node) -> &[Taint] {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_deref())
        .unwrap_or_default()
}

/// The taints of `node` with an effect `wanted` accepts that no toleration of `pod` tolerates.
pub fn untolerated(pod: &Pod, node: &Node, wanted: impl Fn(&Taint) -> bool) -> Vec<Taint> {
    node_taints(node)
        .iter()
        .filter(|t| wanted(t))
        .filter(|t| !tolerations(pod).iter().any(|tol| tolerates(tol, t)))
        .cloned()
        .collect()
}

fn labels(node: &Node) -> &BTreeMap<String, String> {
    static NONE: BTreeMap<String, String> = BTreeMap::new();
    node.metadata.labels.as_ref().unwrap_or(&NONE)
}

/// Each `nodeSelector` entry `node` does not carry, as `key=value` and what the node has.
pub fn selector_misses(pod: &Pod, node: &Node) -> Vec<String> {
    let selector = pod.spec.as_ref().and_then(|s| s.node_selector.as_ref());
    selector
        .into_iter()
        .flatten()
        .filter_map(|(key, want)| match labels(node).get(key) {
            Some(have) if have == want => None,
            Some(have) => Some(format!("{key}={want} (the node's is {have})")),
            None => Some(format!("{key}={want} (the node has no label {key})")),
        })
        .collect()
}

fn required(pod: &Pod) -> Option<&NodeSelector> {
    pod.spec
        .as_ref()?
        .affinity
        .as_ref()?
        .node_affinity
        .as_ref()?
        .required_during_scheduling_ignored_during_execution
        .as_ref()
}

/// Whether the pod has a required node affinity at all.
pub fn has_required_affinity(pod: &Pod) -> bool {
    required(pod).is_some()
}

/// Why the pod's required node affinity does not admit `node`, one line per term (none when
/// the term list is empty); `None` when it admits it or the pod has none.
pub fn affinity_misses(pod: &Pod, node: &Node) -> Option<Vec<String>> {
    let required = required(pod)?;
    let mut misses = Vec::new();
    for (i, term) in required.node_selector_terms.iter().enumerate() {
        match term_miss(term, node, &format!("nodeSelectorTerms[{i}]")) {
            None => return None,
            Some(miss) => misses.push(miss),
        }
    }
    Some(misses)
}

/// One preferred term of the pod that counts (weight not 0, some expression).
pub struct Preference<'a> {
    /// Its place in `preferredDuringSchedulingIgnoredDuringExecution`.
    pub index: usize,
    pub weight: i32,
    pub term: &'a NodeSelectorTerm,
}

/// The preferred terms that count for the scheduler's ranking.
pub fn preferences(pod: &Pod) -> Vec<Preference<'_>> {
    pod.spec
        .as_ref()
        .and_then(|s| s.affinity.as_ref())
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| {
            a.preferred_during_scheduling_ignored_during_execution
                .as_ref()
        })
        .into_iter()
        .flatten()
        .enumerate()
        .filter(|(_, p)| p.weight != 0 && !is_empty(&p.preference))
        .map(|(index, p)| Preference {
            index,
            weight: p.weight,
            term: &p.preference,
        })
        .collect()
}

/// Whether `term` admits `node`.
pub fn term_admits(term: &NodeSelectorTerm, node: &Node) -> bool {
    term_miss(term, node, "").is_none()
}

/// A term's expressions, readable: `key In [a, b]`, `key Exists`, `key Gt 4`.
pub fn term_text(term: &NodeSelectorTerm) -> String {
    let labels = term.match_expressions.iter().flatten().map(expression_text);
    let fields = term
        .match_fields
        .iter()
        .flatten()
        .map(|r| format!("field {}", expression_text(r)));
    labels.chain(fields).collect::<Vec<_>>().join(", ")
}

fn is_empty(term: &NodeSelectorTerm) -> bool {
    term.match_expressions
        .as_deref()
        .unwrap_or_default()
        .is_empty()
        && term.match_fields.as_deref().unwrap_or_default().is_empty()
}

fn values(req: &NodeSelectorRequirement) -> &[String] {
    req.values.as_deref().unwrap_or_default()
}

fn expression_text(req: &NodeSelectorRequirement) -> String {
    match (req.operator.as_str(), values(req)) {
        (_, []) => format!("{} {}", req.key, req.operator),
        ("Gt" | "Lt", [one]) => format!("{} {} {one}", req.key, req.operator),
        (op, many) => format!("{} {op} [{}]", req.key, many.join(", ")),
    }
}

/// Whether a label expression holds for `labels`; `Err` (why) when the scheduler cannot parse
/// it, which makes its term match no node.
fn label_holds(
    req: &NodeSelectorRequirement,
    labels: &BTreeMap<String, String>,
) -> Result<bool, String> {
    let value = labels.get(&req.key);
    let values = values(req);
    match req.operator.as_str() {
        "In" | "NotIn" if values.is_empty() => Err(format!("{} needs values", req.operator)),
        "In" => Ok(value.is_some_and(|v| values.contains(v))),
        "NotIn" => Ok(value.is_none_or(|v| !values.contains(v))),
        "Exists" | "DoesNotExist" if !values.is_empty() => {
            Err(format!("{} takes no values", req.operator))
        }
        "Exists" => Ok(value.is_some()),
        "DoesNotExist" => Ok(value.is_none()),
        op @ ("Gt" | "Lt") => {
            let [bound] = values else {
                return Err(format!("{op} takes exactly one value"));
            };
            let bound: i64 = bound
                .parse()
                .map_err(|_| format!("{op} takes an integer, not {bound:?}"))?;
            let have = value.and_then(|v| v.parse::<i64>().ok());
            Ok(have.is_some_and(|v| if op == "Gt" { v > bound } else { v < bound }))
        }
        other => Err(format!("unknown operator {other:?}")),
    }
}

/// Whether a field expression holds for the node named `name` (only `metadata.name` is a
/// field; any other reads as empty, as in the scheduler).
fn field_holds(req: &NodeSelectorRequirement, name: &str) -> Result<bool, String> {
    let field = if req.key == NAME_FIELD { name } else { "" };
    match (req.operator.as_str(), values(req)) {
        ("In", [value]) => Ok(field == value.as_str()),
        ("NotIn", [value]) => Ok(field != value.as_str()),
        ("In" | "NotIn", _) => Err(format!(
            "matchFields {} takes exactly one value",
            req.operator
        )),
        (other, _) => Err(format!("matchFields takes In or NotIn, not {other:?}")),
    }
}

/// What the node has that fails `req`: `the node's is Tesla-T4`.
fn node_fact(req: &NodeSelectorRequirement, labels: &BTreeMap<String, String>) -> String {
    match (req.operator.as_str(), labels.get(&req.key)) {
        (_, None) => format!("the node has no label {}", req.key),
        ("Gt" | "Lt", Some(v)) if v.parse::<i64>().is_err() => {
            format!("the node's {v:?} is not an integer")
        }
        ("DoesNotExist", Some(v)) => format!("the node has {}={v}", req.key),
        (_, Some(v)) => format!("the node's is {v}"),
    }
}

/// Why `term` does not admit `node` (`path` names the term), or `None` when it does.
fn term_miss(term: &NodeSelectorTerm, node: &Node, path: &str) -> Option<String> {
    if is_empty(term) {
        return Some(format!("{path} has no expressions, so it matches no node"));
    }
    let labels = labels(node);
    let name = node.metadata.name.as_deref().unwrap_or_default();
    let exprs = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    let label_results: Vec<_> = exprs.iter().map(|r| label_holds(r, labels)).collect();
    let field_results: Vec<_> = fields.iter().map(|r| field_holds(r, name)).collect();
    // The scheduler parses the whole term before testing it: one bad expression anywhere
    // voids the term, whatever the others say.
    let invalid = label_results
        .iter()
        .zip(exprs)
        .enumerate()
        .map(|(i, (r, req))| (format!("matchExpressions[{i}]"), r, req))
        .chain(
            field_results
                .iter()
                .zip(fields)
                .enumerate()
                .map(|(i, (r, req))| (format!("matchFields[{i}]"), r, req)),
        )
        .find_map(|(at, r, req)| r.as_ref().err().map(|why| (at, why, req)));
    if let Some((at, why, req)) = invalid {
        return Some(format!(
            "{path}.{at} ({}) is invalid: {why}, so the term matches no node",
            expression_text(req)
        ));
    }
    let failed_label = label_results
        .iter()
        .zip(exprs)
        .enumerate()
        .find(|(_, (r, _))| **r == Ok(false));
    if let Some((i, (_, req))) = failed_label {
        return Some(format!(
            "{path}.matchExpressions[{i}] ({}): {}",
            expression_text(req),
            node_fact(req, labels)
        ));
    }
    // As in the scheduler, a node without a name is not judged by its fields.
    if name.is_empty() {
        return None;
    }
    let failed_field = field_results
        .iter()
        .zip(fields)
        .enumerate()
        .find(|(_, (r, _))| **r == Ok(false));
    failed_field.map(|(i, (_, req))| {
        format!(
            "{path}.matchFields[{i}] (field {}): the node is {name}",
            expression_text(req)
        )
    })
}

#[cfg(test)]
#[path = "affinity_tests.rs"]
mod tests;
