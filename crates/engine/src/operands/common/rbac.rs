//! RBAC helpers: rules, and the ServiceAccount with its (Cluster)Role and binding (render
//! stage, pure).

use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
};

use super::*;
use crate::facts::ClusterFacts;
use crate::model::{Operand, OperandObjects};

/// A policy rule.
pub fn rule(groups: &[&str], resources: &[&str], verbs: &[&str]) -> PolicyRule {
    let strings = |items: &[&str]| items.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    PolicyRule {
        api_groups: Some(strings(groups)),
        resources: Some(strings(resources)),
        verbs: strings(verbs),
        resource_names: None,
        non_resource_urls: None,
    }
}

/// A policy rule limited to named objects.
pub fn rule_named(
    groups: &[&str],
    resources: &[&str],
    names: &[&str],
    verbs: &[&str],
) -> PolicyRule {
    PolicyRule {
        resource_names: Some(names.iter().map(|s| (*s).to_owned()).collect()),
        ..rule(groups, resources, verbs)
    }
}

/// The identity of one operand's pods: a ServiceAccount `name` in the operator namespace, and
/// when rules are given a Role and/or ClusterRole of the same name bound to it. Empty rule sets
/// create nothing (least privilege).
pub fn add_identity(
    objects: &mut OperandObjects,
    operand: Operand,
    name: &str,
    role_rules: Vec<PolicyRule>,
    cluster_rules: Vec<PolicyRule>,
    facts: &ClusterFacts,
) {
    objects.service_accounts.push(ServiceAccount {
        metadata: meta(operand, name, facts, true),
        ..ServiceAccount::default()
    });
    if !role_rules.is_empty() {
        add_role(objects, operand, name, name, role_rules, facts);
    }
    if !cluster_rules.is_empty() {
        add_cluster_role(objects, operand, name, name, cluster_rules, facts);
    }
}

/// A Role `role` in the operator namespace bound to ServiceAccount `service_account` there.
pub fn add_role(
    objects: &mut OperandObjects,
    operand: Operand,
    role: &str,
    service_account: &str,
    rules: Vec<PolicyRule>,
    facts: &ClusterFacts,
) {
    objects.roles.push(Role {
        metadata: meta(operand, role, facts, true),
        rules: Some(rules),
    });
    objects.role_bindings.push(RoleBinding {
        metadata: meta(operand, role, facts, true),
        role_ref: role_ref("Role", role),
        subjects: Some(vec![service_account_subject(service_account, facts)]),
    });
}

fn service_account_subject(name: &str, facts: &ClusterFacts) -> Subject {
    Subject {
        kind: "ServiceAccount".to_owned(),
        name: name.to_owned(),
        namespace: Some(facts.namespace.clone()),
        api_group: None,
    }
}

/// A ClusterRole `role` bound to ServiceAccount `service_account` of the operator namespace.
pub fn add_cluster_role(
    objects: &mut OperandObjects,
    operand: Operand,
    role: &str,
    service_account: &str,
    rules: Vec<PolicyRule>,
    facts: &ClusterFacts,
) {
    objects.cluster_roles.push(ClusterRole {
        metadata: meta(operand, role, facts, false),
        rules: Some(rules),
        aggregation_rule: None,
    });
    objects.cluster_role_bindings.push(ClusterRoleBinding {
        metadata: meta(operand, role, facts, false),
        role_ref: role_ref("ClusterRole", role),
        subjects: Some(vec![service_account_subject(service_account, facts)]),
    });
}

fn role_ref(kind: &str, name: &str) -> RoleRef {
    RoleRef {
        api_group: Some("rbac.authorization.k8s.io".to_owned()),
        kind: kind.to_owned(),
        name: name.to_owned(),
    }
}
