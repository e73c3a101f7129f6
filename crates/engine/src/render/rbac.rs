//! Render stage, the operator's own ClusterRole (pure, no IO; decision 13). Kubernetes lets a
//! subject create a Role or ClusterRole only with permissions it holds itself, so the operator's
//! role is generated: the controller's own needs, plus the union of every rule any operand
//! renders across the feature combinations that change RBAC (OpenShift or not, each runtime,
//! sharing config, ServiceMonitor API, DCGM pod labels, every optional operand on).
//! `gpu-operator rbac` prints it; the chart and the bundle use that output.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::{Outcome, render};
use crate::api::{ClusterPolicy, ClusterPolicySpec};
use crate::facts::{ClusterFacts, ConfigMapData, Runtime};
use crate::operands::common::{NAME_LABEL, PART_OF, PART_OF_LABEL, rule, rule_named, string_map};
use crate::validate::validate;

/// Name of the operator's ClusterRole (and binding, and the ServiceAccount it binds).
pub const OPERATOR_ROLE: &str = "gpu-operator";

const CRUD: [&str; 7] = [
    "get", "list", "watch", "create", "update", "patch", "delete",
];

/// One permission: `verb` on `resource` of API `group`, limited to one object when `name`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Grant {
    pub group: String,
    pub resource: String,
    pub verb: String,
    pub name: Option<String>,
}

/// The permissions a rule grants, one by one.
pub fn grants(rule: &PolicyRule) -> Vec<Grant> {
    let names: Vec<Option<String>> = match rule.resource_names.as_ref().filter(|n| !n.is_empty()) {
        Some(names) => names.iter().cloned().map(Some).collect(),
        None => vec![None],
    };
    let mut out = Vec::new();
    for group in rule.api_groups.iter().flatten() {
        for resource in rule.resources.iter().flatten() {
            for verb in &rule.verbs {
                for name in &names {
                    out.push(Grant {
                        group: group.clone(),
                        resource: resource.clone(),
                        verb: verb.clone(),
                        name: name.clone(),
                    });
                }
            }
        }
    }
    out
}

fn matches(pattern: &str, value: &str) -> bool {
    pattern == "*" || pattern == value
}

/// Whether `rules` allow `grant` (honouring `*` and resource names).
pub fn allows(rules: &[PolicyRule], grant: &Grant) -> bool {
    rules.iter().any(|r| {
        r.api_groups
            .iter()
            .flatten()
            .any(|g| matches(g, &grant.group))
            && r.resources
                .iter()
                .flatten()
                .any(|res| matches(res, &grant.resource))
            && r.verbs.iter().any(|v| matches(v, &grant.verb))
            && match r.resource_names.as_ref().filter(|n| !n.is_empty()) {
                None => true,
                Some(names) => grant.name.as_ref().is_some_and(|n| names.contains(n)),
            }
    })
}

/// The permissions of `rule` that `rules` do not allow (empty: `rule` can be granted).
pub fn missing(rules: &[PolicyRule], rule: &PolicyRule) -> Vec<Grant> {
    grants(rule)
        .into_iter()
        .filter(|g| !allows(rules, g))
        .collect()
}

/// What the controller itself does, besides granting operand permissions.
fn controller_rules() -> Vec<PolicyRule> {
    vec![
        // The policy: watch it, write its status, own children that block its deletion.
        rule(
            &["nvidia.com"],
            &["clusterpolicies"],
            &["get", "list", "watch", "patch", "update"],
        ),
        rule(
            &["nvidia.com"],
            &["clusterpolicies/status"],
            &["get", "patch", "update"],
        ),
        rule(
            &["nvidia.com"],
            &["clusterpolicies/finalizers"],
            &["update"],
        ),
        // The GPUCluster (DRA stack): watch it, write its status, own its children.
        rule(
            &["nvidia.com"],
            &["gpuclusters"],
            &["get", "list", "watch", "patch", "update"],
        ),
        rule(
            &["nvidia.com"],
            &["gpuclusters/status"],
            &["get", "patch", "update"],
        ),
        rule(&["nvidia.com"], &["gpuclusters/finalizers"], &["update"]),
        // NVIDIADriver pools: watch them, write their status, own their driver DaemonSets.
        rule(
            &["nvidia.com"],
            &["nvidiadrivers"],
            &["get", "list", "watch"],
        ),
        rule(
            &["nvidia.com"],
            &["nvidiadrivers/status"],
            &["get", "patch", "update"],
        ),
        rule(&["nvidia.com"], &["nvidiadrivers/finalizers"], &["update"]),
        // The DRA driver's DeviceClasses (and the attribute classes' dry runs) and its
        // ResourceSlice admission policy.
        rule(&["resource.k8s.io"], &["deviceclasses"], &CRUD),
        rule(
            &["admissionregistration.k8s.io"],
            &[
                "validatingadmissionpolicies",
                "validatingadmissionpolicybindings",
            ],
            &CRUD,
        ),
        // Node labelling (deploy labels, gpu.present, mig.config).
        rule(&[""], &["nodes"], &["get", "list", "watch", "patch"]),
        // The GPU memory resource in node capacity (spec.gpuMemoryResource).
        rule(&[""], &["nodes/status"], &["patch"]),
        // PriorityClasses of spec.nodePools.priorityClasses.
        rule(
            &["scheduling.k8s.io"],
            &["priorityclasses"],
            &["get", "list", "create", "patch", "delete"],
        ),
        // Everything render produces, applied and pruned by label.
        rule(&[""], &["configmaps", "services", "serviceaccounts"], &CRUD),
        rule(&["apps"], &["daemonsets", "deployments"], &CRUD),
        // Which pods run an old driver revision ("upgrade pending").
        rule(
            &["apps"],
            &["controllerrevisions"],
            &["get", "list", "watch"],
        ),
        rule(
            &["rbac.authorization.k8s.io"],
            &[
                "roles",
                "rolebindings",
                "clusterroles",
                "clusterrolebindings",
            ],
            &CRUD,
        ),
        rule(&["node.k8s.io"], &["runtimeclasses"], &CRUD),
        rule(&["monitoring.coreos.com"], &["servicemonitors"], &CRUD),
        rule(
            &["security.openshift.io"],
            &["securitycontextconstraints"],
            &CRUD,
        ),
        // Diagnostics of unavailable operand pods, on demand; driver upgrades delete the old
        // driver and validator pods and read the pods of the nodes they drain. Read in any
        // namespace also: the holder pod of a Lease named like NVIDIA's operator's (is it a
        // running, privileged pod?), and before a RuntimeClass is pruned, whether pods name it.
        rule(&[""], &["pods"], &["get", "list", "delete"]),
        // Driver upgrades evict GPU pods through the Eviction API (PDBs respected).
        rule(&[""], &["pods/eviction"], &["create"]),
        // PSA labels on the operator's namespace.
        rule(&[""], &["namespaces"], &["get", "patch"]),
        rule(&["", "events.k8s.io"], &["events"], &["create", "patch"]),
        // Leader election.
        rule(
            &["coordination.k8s.io"],
            &["leases"],
            &["get", "list", "watch", "create", "update", "patch"],
        ),
        // Which optional APIs are served, and our own CRD's schema.
        rule(
            &["apiextensions.k8s.io"],
            &["customresourcedefinitions"],
            &["get", "list", "watch"],
        ),
        // Upgrading our own CRD at start-up (crd_upgrade), never any other CRD. `create` cannot
        // be scoped to a name, so the chart's crds/ installs it.
        rule_named(
            &["apiextensions.k8s.io"],
            &["customresourcedefinitions"],
            &[crate::api::crd::CRD_NAME],
            &["get", "update"],
        ),
        // NFD's CRDs, installed and upgraded whenever the operator deploys NFD (decision 16).
        // `create` cannot be scoped to names; updates can.
        rule(
            &["apiextensions.k8s.io"],
            &["customresourcedefinitions"],
            &["create"],
        ),
        rule_named(
            &["apiextensions.k8s.io"],
            &["customresourcedefinitions"],
            &crate::operands::nfd::CRD_NAMES,
            &["get", "patch"],
        ),
        // OpenShift detection and its cluster proxy.
        rule(
            &["config.openshift.io"],
            &["clusterversions", "proxies"],
            &["get", "list", "watch"],
        ),
        // Whether a Lease with NVIDIA's operator name, or a foreign NFD master, comes from a
        // ServiceAccount with cluster-wide privilege (decisions 14 and 16).
        rule(
            &["authorization.k8s.io"],
            &["subjectaccessreviews"],
            &["create"],
        ),
        // Whether NFD already runs.
        rule(
            &["nfd.k8s-sigs.io"],
            &["nodefeatures"],
            &["get", "list", "watch"],
        ),
        // Who may read /metrics: the caller's token, then its right to `get /metrics`
        // (operator/src/http/auth.rs).
        rule(&["authentication.k8s.io"], &["tokenreviews"], &["create"]),
        rule(
            &["authorization.k8s.io"],
            &["subjectaccessreviews"],
            &["create"],
        ),
    ]
}

/// A ClusterPolicy spec with every operand on and every option that adds RBAC: DCGM and the
/// node-status exporter enabled, NFD deployed, a sharing config (config-manager in the device
/// plugin, MPS daemon and GFD pods) named `sharing` with key `default`, DCGM exporter pod labels
/// (its pod-reading ClusterRole) and ServiceMonitor. The e2e API-contract test deploys it too.
pub fn every_rbac_variant() -> serde_json::Value {
    serde_json::json!({
        "dcgm": {"enabled": true},
        "nodeStatusExporter": {"enabled": true},
        "nfd": {"enabled": true},
        "devicePlugin": {"config": {"name": "sharing", "default": "default"}},
        "dcgmExporter": {
            "env": [{"name": "DCGM_EXPORTER_KUBERNETES_ENABLE_POD_LABELS", "value": "true"}],
            "serviceMonitor": {"enabled": true},
        },
    })
}

/// Policies and facts that together switch on every RBAC-bearing variant of every operand.
fn scenarios() -> Vec<(ClusterPolicySpec, ClusterFacts)> {
    let everything: ClusterPolicySpec =
        serde_json::from_value(every_rbac_variant()).unwrap_or_default();
    let mut out = Vec::new();
    for openshift in [false, true] {
        for runtime in [Runtime::Containerd, Runtime::CriO, Runtime::Docker] {
            let facts = ClusterFacts {
                namespace: "gpu-operator".to_owned(),
                runtime,
                os_tag: Some("ubuntu22.04".to_owned()),
                openshift,
                service_monitor_api: true,
                sharing_source: Some(ConfigMapData {
                    name: "sharing".to_owned(),
                    data: [("default".to_owned(), "version: v1\n".to_owned())].into(),
                }),
                ..ClusterFacts::default()
            };
            out.push((everything.clone(), facts));
        }
    }
    out
}

/// Every rule of every Role and ClusterRole the operands render in the [`scenarios`].
pub fn operand_rules() -> Vec<PolicyRule> {
    let mut rules = Vec::new();
    for (spec, facts) in scenarios() {
        let policy = validate(&ClusterPolicy::new("rbac", spec), &facts);
        for state in render(&policy, &facts).operands {
            if let Outcome::Rendered(objects) = state.outcome {
                for role in &objects.roles {
                    rules.extend(role.rules.clone().unwrap_or_default());
                }
                for role in &objects.cluster_roles {
                    rules.extend(role.rules.clone().unwrap_or_default());
                }
            }
        }
    }
    // A GPUCluster's DRA driver with compute domains on: every role it renders.
    let cluster = crate::operands::dra_driver::ValidatedGpuCluster::default();
    let facts = ClusterFacts {
        namespace: "gpu-operator".to_owned(),
        ..ClusterFacts::default()
    };
    for operand in crate::model::Operand::GPU_CLUSTER {
        if let Some(objects) = crate::operands::dra_driver::render(operand, &cluster, &facts) {
            for role in objects
                .roles
                .iter()
                .map(|r| &r.rules)
                .chain(objects.cluster_roles.iter().map(|r| &r.rules))
            {
                rules.extend(role.clone().unwrap_or_default());
            }
        }
    }
    rules
}

fn verb_rank(verb: &str) -> (usize, &str) {
    let order = [
        "get", "list", "watch", "create", "update", "patch", "delete", "use",
    ];
    (
        order.iter().position(|v| *v == verb).unwrap_or(order.len()),
        verb,
    )
}

/// The fewest readable rules that grant exactly `grants` (named grants folded into unnamed
/// ones that already cover them).
fn compact(grants: BTreeSet<Grant>) -> Vec<PolicyRule> {
    let mut unnamed: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
    let mut named: BTreeMap<(String, String, String), BTreeSet<String>> = BTreeMap::new();
    for g in &grants {
        match &g.name {
            None => {
                unnamed
                    .entry((g.group.clone(), g.resource.clone()))
                    .or_default()
                    .insert(g.verb.clone());
            }
            Some(name) => {
                named
                    .entry((g.group.clone(), g.resource.clone(), name.clone()))
                    .or_default()
                    .insert(g.verb.clone());
            }
        }
    }
    let sorted_verbs = |verbs: &BTreeSet<String>| {
        let mut v: Vec<String> = verbs.iter().cloned().collect();
        v.sort_by(|a, b| verb_rank(a).cmp(&verb_rank(b)));
        v
    };
    let mut by_verbs: BTreeMap<(String, Vec<String>), Vec<String>> = BTreeMap::new();
    for ((group, resource), verbs) in &unnamed {
        by_verbs
            .entry((group.clone(), sorted_verbs(verbs)))
            .or_default()
            .push(resource.clone());
    }
    let mut rules: Vec<PolicyRule> = by_verbs
        .into_iter()
        .map(|((group, verbs), resources)| PolicyRule {
            api_groups: Some(vec![group]),
            resources: Some(resources),
            verbs,
            resource_names: None,
            non_resource_urls: None,
        })
        .collect();
    let mut by_name: BTreeMap<(String, String, Vec<String>), Vec<String>> = BTreeMap::new();
    for ((group, resource, name), verbs) in named {
        let covered = unnamed.get(&(group.clone(), resource.clone()));
        let verbs: BTreeSet<String> = verbs
            .into_iter()
            .filter(|v| !covered.is_some_and(|c| c.contains(v)))
            .collect();
        if !verbs.is_empty() {
            by_name
                .entry((group, resource, sorted_verbs(&verbs)))
                .or_default()
                .push(name);
        }
    }
    rules.extend(
        by_name
            .into_iter()
            .map(|((group, resource, verbs), names)| PolicyRule {
                api_groups: Some(vec![group]),
                resources: Some(vec![resource]),
                verbs,
                resource_names: Some(names),
                non_resource_urls: None,
            }),
    );
    rules
}

fn metadata(name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        labels: Some(string_map(&[
            (NAME_LABEL, OPERATOR_ROLE),
            (PART_OF_LABEL, PART_OF),
        ])),
        ..ObjectMeta::default()
    }
}

/// The operator's ClusterRole `gpu-operator`.
pub fn operator_cluster_role() -> ClusterRole {
    let all: BTreeSet<Grant> = controller_rules()
        .iter()
        .chain(operand_rules().iter())
        .flat_map(grants)
        .collect();
    ClusterRole {
        metadata: metadata(OPERATOR_ROLE),
        rules: Some(compact(all)),
        aggregation_rule: None,
    }
}

/// Binds the ClusterRole to ServiceAccount `gpu-operator` in `namespace`.
pub fn operator_cluster_role_binding(namespace: &str) -> ClusterRoleBinding {
    ClusterRoleBinding {
        metadata: metadata(OPERATOR_ROLE),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".to_owned()),
            kind: "ClusterRole".to_owned(),
            name: OPERATOR_ROLE.to_owned(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".to_owned(),
            name: OPERATOR_ROLE.to_owned(),
            namespace: Some(namespace.to_owned()),
            api_group: None,
        }]),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn compacting_keeps_exactly_the_same_permissions() {
        let rules = controller_rules()
            .into_iter()
            .chain(operand_rules())
            .collect::<Vec<_>>();
        let role = operator_cluster_role();
        let compacted = role.rules.unwrap();
        for r in &rules {
            assert!(missing(&compacted, r).is_empty(), "{r:?} lost");
        }
        for r in &compacted {
            assert!(missing(&rules, r).is_empty(), "{r:?} added");
        }
    }

    #[test]
    fn named_grants_are_only_honoured_for_their_names() {
        let rules = vec![rule_named(&["a"], &["b"], &["x"], &["get"])];
        let grant = |name: Option<&str>| Grant {
            group: "a".to_owned(),
            resource: "b".to_owned(),
            verb: "get".to_owned(),
            name: name.map(str::to_owned),
        };
        assert!(allows(&rules, &grant(Some("x"))));
        assert!(!allows(&rules, &grant(Some("y"))));
        assert!(!allows(&rules, &grant(None)));
    }

    #[test]
    fn operator_role_holds_what_the_controller_and_openshift_operands_need() {
        let rules = operator_cluster_role().rules.unwrap();
        let has = |group: &str, resource: &str, verb: &str, name: Option<&str>| {
            allows(
                &rules,
                &Grant {
                    group: group.to_owned(),
                    resource: resource.to_owned(),
                    verb: verb.to_owned(),
                    name: name.map(str::to_owned),
                },
            )
        };
        assert!(has(
            "nvidia.com",
            "clusterpolicies/finalizers",
            "update",
            None
        ));
        assert!(has("", "pods/eviction", "create", None));
        assert!(has(
            "security.openshift.io",
            "securitycontextconstraints",
            "use",
            Some("privileged")
        ));
        // The node-status exporter's Role uses any SCC, so the operator must too.
        assert!(has(
            "security.openshift.io",
            "securitycontextconstraints",
            "use",
            None
        ));
        assert!(has(
            "coordination.k8s.io",
            "leases",
            "update",
            Some("nfd-master.nfd.kubernetes.io")
        ));
        assert!(!has("", "secrets", "get", None));
    }

    #[test]
    fn operator_role_may_update_its_own_crd_and_install_only_nfds() {
        let rules = operator_cluster_role().rules.unwrap();
        let update = |name: Option<&str>| {
            allows(
                &rules,
                &Grant {
                    group: "apiextensions.k8s.io".to_owned(),
                    resource: "customresourcedefinitions".to_owned(),
                    verb: "update".to_owned(),
                    name: name.map(str::to_owned),
                },
            )
        };
        assert!(update(Some(crate::api::crd::CRD_NAME)));
        assert!(!update(Some("nvidiadrivers.nvidia.com")));
        assert!(!update(None));
        let grant = |verb: &str, name: Option<&str>| {
            allows(
                &rules,
                &Grant {
                    group: "apiextensions.k8s.io".to_owned(),
                    resource: "customresourcedefinitions".to_owned(),
                    verb: verb.to_owned(),
                    name: name.map(str::to_owned),
                },
            )
        };
        // NFD's CRDs: created (unscopable) and patched by name, nothing else patched.
        assert!(grant("create", None));
        assert!(grant("patch", Some("nodefeaturerules.nfd.k8s-sigs.io")));
        assert!(!grant("patch", Some("nvidiadrivers.nvidia.com")));
        assert!(!grant("delete", Some("nodefeaturerules.nfd.k8s-sigs.io")));
    }
}
