//! Admission policies that keep an operand's ServiceAccount to its own node (render stage,
//! pure). RBAC cannot say "only your node": a verb on `nodes` or `pods` reaches every one. A
//! token the kubelet mounts into a pod carries the pod's node in the
//! `authentication.kubernetes.io/node-name` extra claim, so a ValidatingAdmissionPolicy can
//! compare the object written with the caller's node, as NVIDIA's DRA driver does for its
//! ResourceSlices. A token without that claim (one not bound to a scheduled pod) may write
//! nothing these policies guard.

use kube_core::{ApiResource, DynamicObject, GroupVersionKind, TypeMeta};
use serde_json::{Value, json};

use super::*;
use crate::facts::ClusterFacts;
use crate::model::Operand;

/// The extra claim of a pod-bound ServiceAccount token naming the pod's node.
pub const NODE_NAME_CLAIM: &str = "authentication.kubernetes.io/node-name";

/// CEL: the node of the caller's pod, `''` for a token not bound to a scheduled pod.
const CALLER_NODE: &str =
    "request.userInfo.extra[?'authentication.kubernetes.io/node-name'][0].orValue('')";

/// One admission rule: the requests it matches and what they must satisfy.
pub struct Confinement<'a> {
    /// API group, resources (subresources as `pods/status`) and operations
    /// (`CREATE`, `UPDATE`, `DELETE`; a patch is an `UPDATE`).
    pub group: &'a str,
    pub resources: &'a [&'a str],
    pub operations: &'a [&'a str],
    /// CEL expressions that must all hold, with `variables.callerNode` the caller's node, and
    /// what the denial says for each.
    pub checks: Vec<(String, String)>,
}

/// A ValidatingAdmissionPolicy `name` (and its binding, same name) applying `rules` to the
/// requests of the operator-namespace ServiceAccounts `service_accounts`. Each request must
/// come from a pod-bound token, then pass the checks of the rule that matched it.
pub fn confinement_policy(
    operand: Operand,
    name: &str,
    service_accounts: &[&str],
    rules: &[Confinement<'_>],
    facts: &ClusterFacts,
) -> Vec<DynamicObject> {
    let users: Vec<String> = service_accounts
        .iter()
        .map(|sa| format!("system:serviceaccount:{}:{sa}", facts.namespace))
        .collect();
    let resource_rules: Vec<Value> = rules
        .iter()
        .map(|r| {
            json!({
                "apiGroups": [r.group],
                "apiVersions": ["*"],
                "operations": r.operations,
                "resources": r.resources,
            })
        })
        .collect();
    let mut validations = vec![json!({
        "expression": "variables.callerNode != ''",
        "message": format!(
            "{name}: this ServiceAccount may only make this request with the token of a pod \
             scheduled to a node (the {NODE_NAME_CLAIM} claim), which limits it to that node"
        ),
    })];
    for rule in rules {
        let applies = rule_condition(rule);
        for (check, denial) in &rule.checks {
            validations.push(json!({
                "expression": format!("!({applies}) || ({check})"),
                "messageExpression": format!(
                    "'{name}: ' + {denial} + ' (caller on node ' + variables.callerNode + ')'"
                ),
            }));
        }
    }
    let policy = dynamic(
        "ValidatingAdmissionPolicy",
        meta(operand, name, facts, false),
        json!({"spec": {
            "failurePolicy": "Fail",
            "matchConditions": [{
                "name": "operand-service-account",
                "expression": format!("request.userInfo.username in {}", cel_list(&users)),
            }],
            "matchConstraints": {"resourceRules": resource_rules},
            "variables": [{"name": "callerNode", "expression": CALLER_NODE}],
            "validations": validations,
        }}),
    );
    let binding = dynamic(
        "ValidatingAdmissionPolicyBinding",
        meta(operand, name, facts, false),
        json!({"spec": {"policyName": name, "validationActions": ["Deny"]}}),
    );
    vec![policy, binding]
}

/// The rule matching node writes (labels, taints, cordons, status) only on the caller's node.
pub fn own_node_writes() -> Confinement<'static> {
    Confinement {
        group: "",
        resources: &["nodes", "nodes/status"],
        operations: &["UPDATE"],
        checks: vec![(
            "object.metadata.name == variables.callerNode".to_owned(),
            "'writes to node ' + object.metadata.name + ' are limited to the node its pod runs on'"
                .to_owned(),
        )],
    }
}

/// Whether a request falls under `rule`: its resource (with subresource) and operation.
fn rule_condition(rule: &Confinement<'_>) -> String {
    let resource = "(request.subResource == '' ? request.resource.resource : \
                    request.resource.resource + '/' + request.subResource)";
    format!(
        "request.resource.group == '{}' && {resource} in {} && request.operation in {}",
        rule.group,
        cel_list(rule.resources),
        cel_list(rule.operations),
    )
}

/// A CEL list literal of strings.
pub fn cel_list<S: AsRef<str>>(items: &[S]) -> String {
    let quoted: Vec<String> = items
        .iter()
        .map(|s| {
            format!(
                "'{}'",
                s.as_ref().replace('\\', "\\\\").replace('\'', "\\'")
            )
        })
        .collect();
    format!("[{}]", quoted.join(", "))
}

/// The API group and version of the policies and bindings rendered here.
const ADMISSION_API: (&str, &str) = ("admissionregistration.k8s.io", "v1");

/// The API resources of the objects rendered here (ValidatingAdmissionPolicy and its binding,
/// served from Kubernetes 1.30, below our minimum): what pruning and the convergence checks list.
pub fn admission_api_resources() -> [ApiResource; 2] {
    [
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ]
    .map(|kind| {
        ApiResource::from_gvk(&GroupVersionKind::gvk(
            ADMISSION_API.0,
            ADMISSION_API.1,
            kind,
        ))
    })
}

fn dynamic(
    kind: &str,
    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    body: Value,
) -> DynamicObject {
    DynamicObject {
        types: Some(TypeMeta {
            api_version: format!("{}/{}", ADMISSION_API.0, ADMISSION_API.1),
            kind: kind.to_owned(),
        }),
        metadata,
        data: body,
    }
}

/// Writes that a node-bound identity (the ServiceAccount of a DaemonSet's pods, or one of
/// `also_node_bound`: pods other software starts per node) holds through its RBAC on nodes,
/// pods or ConfigMaps without a confinement policy matching that ServiceAccount, resource and
/// operation: each as `<sa>: <verb> <resource>`.
#[cfg(test)]
pub(crate) fn unconfined_writes(
    objects: &[&crate::model::OperandObjects],
    namespace: &str,
    also_node_bound: &[&str],
) -> Vec<String> {
    use std::collections::BTreeSet;

    use k8s_openapi::api::rbac::v1::{PolicyRule, RoleRef, Subject};

    const GUARDED: [&str; 4] = ["nodes", "nodes/status", "pods", "configmaps"];
    let node_bound: BTreeSet<String> = objects
        .iter()
        .flat_map(|o| &o.daemon_sets)
        .filter_map(|ds| {
            ds.spec
                .as_ref()?
                .template
                .spec
                .as_ref()?
                .service_account_name
                .clone()
        })
        .chain(also_node_bound.iter().map(|sa| (*sa).to_owned()))
        .collect();
    let roles: Vec<(&str, &str, &Vec<PolicyRule>)> = objects
        .iter()
        .flat_map(|o| {
            let roles = o.roles.iter().map(|r| ("Role", &r.metadata, &r.rules));
            let cluster = o
                .cluster_roles
                .iter()
                .map(|r| ("ClusterRole", &r.metadata, &r.rules));
            roles.chain(cluster).collect::<Vec<_>>()
        })
        .filter_map(|(kind, meta, rules)| Some((kind, meta.name.as_deref()?, rules.as_ref()?)))
        .collect();
    let bindings: Vec<(&RoleRef, &Vec<Subject>)> = objects
        .iter()
        .flat_map(|o| {
            let ns = o.role_bindings.iter().map(|b| (&b.role_ref, &b.subjects));
            let cl = o
                .cluster_role_bindings
                .iter()
                .map(|b| (&b.role_ref, &b.subjects));
            ns.chain(cl).collect::<Vec<_>>()
        })
        .filter_map(|(r, s)| Some((r, s.as_ref()?)))
        .collect();
    let policies: Vec<&serde_json::Value> = objects
        .iter()
        .flat_map(|o| &o.dynamic)
        .filter(|d| {
            d.types
                .as_ref()
                .is_some_and(|t| t.kind == "ValidatingAdmissionPolicy")
        })
        .map(|d| &d.data["spec"])
        .collect();
    let confined = |sa: &str, resource: &str, operation: &str| {
        let user = format!("'system:serviceaccount:{namespace}:{sa}'");
        policies.iter().any(|spec| {
            let matches_user = spec["matchConditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["expression"].as_str().is_some_and(|e| e.contains(&user)));
            let matches_request = spec["matchConstraints"]["resourceRules"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|r| {
                    r["resources"]
                        .as_array()
                        .is_some_and(|l| l.iter().any(|x| x == resource))
                        && r["operations"]
                            .as_array()
                            .is_some_and(|l| l.iter().any(|x| x == operation))
                });
            matches_user && matches_request
        })
    };
    let mut out = BTreeSet::new();
    for (role_ref, subjects) in bindings {
        for subject in subjects
            .iter()
            .filter(|s| s.kind == "ServiceAccount" && node_bound.contains(&s.name))
        {
            let rules = roles
                .iter()
                .filter(|(kind, name, _)| *kind == role_ref.kind && *name == role_ref.name)
                .flat_map(|(_, _, rules)| rules.iter());
            for rule in rules {
                if !rule.api_groups.iter().flatten().any(|g| g.is_empty()) {
                    continue;
                }
                for resource in rule
                    .resources
                    .iter()
                    .flatten()
                    .filter(|r| GUARDED.contains(&r.as_str()))
                {
                    for verb in &rule.verbs {
                        let operation = match verb.as_str() {
                            "create" => "CREATE",
                            "update" | "patch" => "UPDATE",
                            "delete" | "deletecollection" => "DELETE",
                            _ => continue,
                        };
                        if !confined(&subject.name, resource, operation) {
                            out.insert(format!("{}: {verb} {resource}", subject.name));
                        }
                    }
                }
            }
        }
    }
    out.into_iter().collect()
}
