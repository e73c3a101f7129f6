//! Render stage, the operator's own RBAC (pure, no IO; decision 13). Kubernetes lets a subject
//! create a Role or ClusterRole only with permissions it holds itself (a Role's in its namespace,
//! a ClusterRole's cluster-wide), so the operator's RBAC is generated: the controller's own
//! needs, plus the union of every rule any operand renders across the feature combinations that
//! change RBAC (OpenShift or not, each runtime, sharing config, ServiceMonitor API, DCGM pod
//! labels, every optional operand on). It comes in two scopes:
//!
//! - a Role in the operator namespace: every namespaced permission used only there (the
//!   operand objects the operator applies and prunes, the rules of the operand Roles it creates
//!   there, its leader Lease, the labels of its own namespace);
//! - a ClusterRole: cluster-scoped kinds, reads the controller needs in every namespace, and the
//!   rules of the operand ClusterRoles. Writes to cluster-scoped objects the operator renders
//!   are limited to the rendered names, except `create`, which Kubernetes cannot limit by name.
//!
//! `gpu-operator rbac` prints both; the chart and the bundle use that output.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::{Outcome, render};
use crate::api::{ClusterPolicy, ClusterPolicySpec};
use crate::facts::{ClusterFacts, ConfigMapData, Runtime};
use crate::operands::common::{NAME_LABEL, PART_OF, PART_OF_LABEL, rule, rule_named, string_map};
use crate::validate::validate;

/// Name of the operator's Role and ClusterRole (and their bindings, and the ServiceAccount they
/// bind).
pub const OPERATOR_ROLE: &str = "gpu-operator";

/// The operator's leader-election Lease in its namespace (`gpu-operator run --lease-name`): the
/// only Lease the operator may read or renew, as kube-controller-manager's is.
pub const LEADER_LEASE: &str = "gpu-operator-leader";
/// The Role (and its binding) holding [`leader_election_rules`], in the Lease's namespace.
pub const LEADER_ELECTION_ROLE: &str = "gpu-operator-leader-election";

/// What the operator does to the objects it applies and prunes: server-side apply is a `patch`
/// (and a `create` when the object is new), pruning a `delete`, the caches `list` and `watch`.
const APPLY: [&str; 6] = ["get", "list", "watch", "create", "patch", "delete"];
const READ: [&str; 3] = ["get", "list", "watch"];

/// Whether objects of a kind live in a namespace or in the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    Namespaced,
    Cluster,
}

/// The scope of every resource a rule of ours names, by API group and resource (a subresource
/// has its parent's), and the kind whose rendered objects are that resource. A resource missing
/// here fails `every_granted_resource_has_a_known_scope`: add it with its scope.
const RESOURCES: &[(&str, &str, &str, Scope)] = &[
    ("", "configmaps", "ConfigMap", Scope::Namespaced),
    ("", "endpoints", "Endpoints", Scope::Namespaced),
    ("", "events", "Event", Scope::Namespaced),
    ("", "namespaces", "Namespace", Scope::Cluster),
    ("", "nodes", "Node", Scope::Cluster),
    ("", "pods", "Pod", Scope::Namespaced),
    ("", "secrets", "Secret", Scope::Namespaced),
    ("", "serviceaccounts", "ServiceAccount", Scope::Namespaced),
    ("", "services", "Service", Scope::Namespaced),
    (
        "admissionregistration.k8s.io",
        "validatingadmissionpolicies",
        "ValidatingAdmissionPolicy",
        Scope::Cluster,
    ),
    (
        "admissionregistration.k8s.io",
        "validatingadmissionpolicybindings",
        "ValidatingAdmissionPolicyBinding",
        Scope::Cluster,
    ),
    (
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        Scope::Cluster,
    ),
    (
        "apps",
        "controllerrevisions",
        "ControllerRevision",
        Scope::Namespaced,
    ),
    ("apps", "daemonsets", "DaemonSet", Scope::Namespaced),
    ("apps", "deployments", "Deployment", Scope::Namespaced),
    (
        "authentication.k8s.io",
        "tokenreviews",
        "TokenReview",
        Scope::Cluster,
    ),
    (
        "authorization.k8s.io",
        "subjectaccessreviews",
        "SubjectAccessReview",
        Scope::Cluster,
    ),
    (
        "config.openshift.io",
        "clusterversions",
        "ClusterVersion",
        Scope::Cluster,
    ),
    ("config.openshift.io", "proxies", "Proxy", Scope::Cluster),
    (
        "image.openshift.io",
        "imagestreams",
        "ImageStream",
        Scope::Namespaced,
    ),
    ("coordination.k8s.io", "leases", "Lease", Scope::Namespaced),
    ("events.k8s.io", "events", "Event", Scope::Namespaced),
    (
        "monitoring.coreos.com",
        "servicemonitors",
        "ServiceMonitor",
        Scope::Namespaced,
    ),
    (
        "networking.k8s.io",
        "networkpolicies",
        "NetworkPolicy",
        Scope::Namespaced,
    ),
    (
        "nfd.k8s-sigs.io",
        "nodefeaturegroups",
        "NodeFeatureGroup",
        Scope::Namespaced,
    ),
    (
        "nfd.k8s-sigs.io",
        "nodefeaturerules",
        "NodeFeatureRule",
        Scope::Cluster,
    ),
    (
        "nfd.k8s-sigs.io",
        "nodefeatures",
        "NodeFeature",
        Scope::Namespaced,
    ),
    (
        "node.k8s.io",
        "runtimeclasses",
        "RuntimeClass",
        Scope::Cluster,
    ),
    (
        "nvidia.com",
        "clusterpolicies",
        "ClusterPolicy",
        Scope::Cluster,
    ),
    ("nvidia.com", "gpuclusters", "GPUCluster", Scope::Cluster),
    (
        "nvidia.com",
        "nvidiadrivers",
        "NVIDIADriver",
        Scope::Cluster,
    ),
    (
        "rbac.authorization.k8s.io",
        "clusterrolebindings",
        "ClusterRoleBinding",
        Scope::Cluster,
    ),
    (
        "rbac.authorization.k8s.io",
        "clusterroles",
        "ClusterRole",
        Scope::Cluster,
    ),
    (
        "rbac.authorization.k8s.io",
        "rolebindings",
        "RoleBinding",
        Scope::Namespaced,
    ),
    (
        "rbac.authorization.k8s.io",
        "roles",
        "Role",
        Scope::Namespaced,
    ),
    (
        "resource.k8s.io",
        "deviceclasses",
        "DeviceClass",
        Scope::Cluster,
    ),
    (
        "resource.k8s.io",
        "resourceclaims",
        "ResourceClaim",
        Scope::Namespaced,
    ),
    (
        "resource.k8s.io",
        "resourceclaimtemplates",
        "ResourceClaimTemplate",
        Scope::Namespaced,
    ),
    (
        "resource.k8s.io",
        "resourceslices",
        "ResourceSlice",
        Scope::Cluster,
    ),
    (
        "resource.nvidia.com",
        "computedomaincliques",
        "ComputeDomainClique",
        Scope::Namespaced,
    ),
    (
        "resource.nvidia.com",
        "computedomains",
        "ComputeDomain",
        Scope::Namespaced,
    ),
    (
        "scheduling.k8s.io",
        "priorityclasses",
        "PriorityClass",
        Scope::Cluster,
    ),
    (
        "security.openshift.io",
        "securitycontextconstraints",
        "SecurityContextConstraints",
        Scope::Cluster,
    ),
];

/// The scope of `resource` (or of its parent, for a subresource) in API `group`; `None` for a
/// resource [`RESOURCES`] does not list.
pub fn scope(group: &str, resource: &str) -> Option<Scope> {
    let parent = resource.split('/').next().unwrap_or(resource);
    RESOURCES
        .iter()
        .find(|(g, r, _, _)| *g == group && *r == parent)
        .map(|(_, _, _, scope)| *scope)
}

/// The API group and resource of rendered objects of `api_version` and `kind`.
fn resource_of(api_version: &str, kind: &str) -> Option<(&'static str, &'static str)> {
    let group = api_version.rsplit_once('/').map_or("", |(group, _)| group);
    RESOURCES
        .iter()
        .find(|(g, _, k, _)| *g == group && *k == kind)
        .map(|(g, r, _, _)| (*g, *r))
}

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

/// What the controller itself does in every namespace or to cluster-scoped objects, besides
/// applying the cluster-scoped objects it renders ([`rendered_cluster_objects`]) and granting
/// operand permissions. Namespaced kinds get read verbs only here, except the two listed in
/// `CLUSTER_WIDE_NAMESPACED_WRITES`.
fn controller_cluster_rules() -> Vec<PolicyRule> {
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
        rule(&["nvidia.com"], &["nvidiadrivers"], &READ),
        rule(
            &["nvidia.com"],
            &["nvidiadrivers/status"],
            &["get", "patch", "update"],
        ),
        rule(&["nvidia.com"], &["nvidiadrivers/finalizers"], &["update"]),
        // Node labelling (deploy labels, gpu.present, mig.config), cordons of driver upgrades.
        rule(&[""], &["nodes"], &["get", "list", "watch", "patch"]),
        // The GPU memory resource in node capacity (spec.gpuMemoryResource).
        rule(&[""], &["nodes/status"], &["patch"]),
        // PriorityClasses of spec.nodePools.priorityClasses: the policy names them, so no
        // name can be fixed here.
        rule(
            &["scheduling.k8s.io"],
            &["priorityclasses"],
            &["get", "list", "create", "patch", "delete"],
        ),
        // Driver upgrades read the pods of the nodes they drain, in every namespace; also read
        // there: the holder pod of a Lease named like NVIDIA's operator's (is it a running,
        // privileged pod?), and before a RuntimeClass is pruned, whether pods name it...
        rule(&[""], &["pods"], &["get", "list"]),
        // ...and evict them through the Eviction API (PodDisruptionBudgets respected), as
        // `kubectl drain` does.
        rule(&[""], &["pods/eviction"], &["create"]),
        // Events about the cluster-scoped policy go to namespace `default`, as
        // kube-controller-manager's about Nodes do.
        rule(&["", "events.k8s.io"], &["events"], &["create", "patch"]),
        // Whether NVIDIA's operator holds its leader Lease, in any namespace (decision 14).
        rule(&["coordination.k8s.io"], &["leases"], &["list", "watch"]),
        // Whether someone else's NFD master runs, in any namespace (decision 16).
        rule(&["apps"], &["deployments"], &["list"]),
        // Which optional APIs are served, and our own CRD's schema.
        rule(
            &["apiextensions.k8s.io"],
            &["customresourcedefinitions"],
            &READ,
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
        // The DRA driver's ComputeDomain CRDs, installed and upgraded whenever a GPUCluster
        // deploys compute domains.
        rule_named(
            &["apiextensions.k8s.io"],
            &["customresourcedefinitions"],
            &crate::operands::dra_driver::COMPUTE_DOMAIN_CRDS,
            &["get", "patch"],
        ),
        // OpenShift detection and its cluster proxy.
        rule(
            &["config.openshift.io"],
            &["clusterversions", "proxies"],
            &READ,
        ),
        // The Driver Toolkit images by RHCOS version: ImageStream `openshift/driver-toolkit`
        // (operands::driver_toolkit). A read by name; a Role in namespace `openshift` would
        // need a RoleBinding there, which OLM's CSV cannot carry (its `permissions` land in the
        // operator namespace), so the name is the scope.
        rule_named(
            &["image.openshift.io"],
            &["imagestreams"],
            &[crate::operands::driver_toolkit::IMAGE_STREAM],
            &["get"],
        ),
        // Whether a Lease with NVIDIA's operator name, or a foreign NFD master, comes from a
        // ServiceAccount with cluster-wide privilege (decisions 14 and 16); and who may read
        // /metrics: the caller's token, then its right to `get /metrics`
        // (operator/src/http/auth.rs).
        rule(
            &["authorization.k8s.io"],
            &["subjectaccessreviews"],
            &["create"],
        ),
        rule(&["authentication.k8s.io"], &["tokenreviews"], &["create"]),
        // Whether NFD already runs.
        rule(&["nfd.k8s-sigs.io"], &["nodefeatures"], &READ),
    ]
}

/// What the controller itself does in its own namespace, besides applying the namespaced
/// objects it renders there and granting the operand Roles there.
fn controller_namespace_rules() -> Vec<PolicyRule> {
    vec![
        // Everything render produces, applied and pruned by label.
        rule(
            &[""],
            &["configmaps", "services", "serviceaccounts"],
            &APPLY,
        ),
        rule(&["apps"], &["daemonsets", "deployments"], &APPLY),
        rule(
            &["rbac.authorization.k8s.io"],
            &["roles", "rolebindings"],
            &APPLY,
        ),
        rule(&["monitoring.coreos.com"], &["servicemonitors"], &APPLY),
        // A GPUCluster's admin-access GPU claims (DCGM, the exporter, the DRA validator).
        rule(&["resource.k8s.io"], &["resourceclaimtemplates"], &APPLY),
        // Which pods run an old driver revision ("upgrade pending").
        rule(&["apps"], &["controllerrevisions"], &READ),
        // Diagnostics of unavailable operand pods, on demand; driver upgrades delete the old
        // driver and validator pods.
        rule(&[""], &["pods"], &["get", "list", "watch", "delete"]),
        // PSA labels on the operator's namespace: a request for a Namespace object is
        // authorised in that namespace, so a Role there covers its own namespace only.
        rule(&[""], &["namespaces"], &["get", "patch"]),
    ]
}

/// Leader election, as kube-controller-manager's: create the Lease (`create` cannot be scoped
/// to a name), then read and renew only ours. A Role of its own ([`leader_election_role`]), so
/// that the Lease may live in another namespace (`gpu-operator run --lease-namespace`).
fn leader_election_rules() -> Vec<PolicyRule> {
    vec![
        rule(&["coordination.k8s.io"], &["leases"], &["create"]),
        rule_named(
            &["coordination.k8s.io"],
            &["leases"],
            &[LEADER_LEASE],
            &["get", "update"],
        ),
    ]
}

/// A ClusterPolicy spec with every operand on and every option that adds RBAC: DCGM and the
/// node-status exporter enabled, NFD deployed, a sharing config (config-manager in the device
/// plugin, MPS daemon and GFD pods) named `sharing` with key `default`, DCGM exporter pod labels
/// (its pod-reading ClusterRole) and ServiceMonitor, and sandbox workloads in kubevirt mode
/// with the VFIO manager, the sandbox device plugin and the two vGPU managers (their images
/// named: none is pinned; every node still defaults to containers). The e2e API-contract test
/// deploys it too.
pub fn every_rbac_variant() -> serde_json::Value {
    serde_json::json!({
        "sandboxWorkloads": {"enabled": true, "defaultWorkload": "container", "mode": "kubevirt"},
        "vfioManager": {"enabled": true},
        "sandboxDevicePlugin": {
            "enabled": true,
            "repository": "nvcr.io/nvidia",
            "image": "kubevirt-gpu-device-plugin",
            "version": "v1.6.0",
        },
        "vgpuManager": {
            "enabled": true,
            "repository": "registry.example.com/nvidia",
            "image": "vgpu-manager",
            "version": "580.65.05",
        },
        "vgpuDeviceManager": {
            "enabled": true,
            "repository": "nvcr.io/nvidia/cloud-native",
            "image": "vgpu-device-manager",
            "version": "v0.5.0",
        },
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

/// The sandbox operands of mode kata with every option that adds RBAC, which
/// [`every_rbac_variant`] (mode kubevirt) cannot hold as one cluster has one mode: the Kata
/// sandbox device plugin launching its in-VM GPU feature discovery (`ENABLE_GFD`: its pod and
/// NodeFeature grants) and the CC manager, images named (none is pinned). Every node still
/// defaults to containers. The e2e API-contract tests check it as well.
pub fn every_kata_rbac_variant() -> serde_json::Value {
    serde_json::json!({
        "sandboxWorkloads": {"enabled": true, "defaultWorkload": "container", "mode": "kata"},
        "vfioManager": {"enabled": true},
        "kataSandboxDevicePlugin": {
            "enabled": true,
            "repository": "nvcr.io/nvidia/cloud-native",
            "image": "nvidia-sandbox-device-plugin",
            "version": "v0.0.5",
            "env": [{"name": "ENABLE_GFD", "value": "true"}],
        },
        "ccManager": {
            "enabled": true,
            "defaultMode": "on",
            "repository": "nvcr.io/nvidia/cloud-native",
            "image": "k8s-cc-manager",
            "version": "v0.4.3",
        },
    })
}

/// A GPUCluster spec with every operand and every option that adds RBAC: compute domains (on
/// by default), the MPSSupport feature gate (the kubelet plugin's MPS Role), DCGM and the
/// exporter. The e2e API-contract test deploys it too.
pub fn every_gpu_cluster_rbac_variant() -> serde_json::Value {
    serde_json::json!({
        "draDriver": {"featureGates": {"MPSSupport": true}},
        "dcgm": {"enabled": true},
        "dcgmExporter": {},
    })
}

/// Policies and facts that together switch on every RBAC-bearing variant of every operand.
fn scenarios() -> Vec<(ClusterPolicySpec, ClusterFacts)> {
    let everything: ClusterPolicySpec =
        serde_json::from_value(every_rbac_variant()).unwrap_or_default();
    let kata: ClusterPolicySpec =
        serde_json::from_value(every_kata_rbac_variant()).unwrap_or_default();
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
            out.push((everything.clone(), facts.clone()));
            out.push((kata.clone(), facts));
        }
    }
    out
}

/// Every operand's objects in the [`scenarios`], and a GPUCluster's with compute domains, DCGM
/// and the exporter on.
fn rendered_operands() -> Vec<crate::model::OperandObjects> {
    let mut out = Vec::new();
    for (spec, facts) in scenarios() {
        let policy = validate(&ClusterPolicy::new("rbac", spec), &facts);
        for state in render(&policy, &facts).operands {
            if let Outcome::Rendered(objects) = state.outcome {
                out.push(objects);
            }
        }
    }
    // Every GPUCluster operand on, plain and on OpenShift (SCCs).
    let cluster = crate::operands::dra_driver::ValidatedGpuCluster {
        spec: serde_json::from_value(every_gpu_cluster_rbac_variant()).unwrap_or_default(),
        ..Default::default()
    };
    for openshift in [false, true] {
        let facts = ClusterFacts {
            namespace: "gpu-operator".to_owned(),
            openshift,
            ..ClusterFacts::default()
        };
        for operand in crate::model::Operand::GPU_CLUSTER {
            out.extend(crate::operands::dra_driver::render(
                operand, &cluster, &facts,
            ));
        }
    }
    out
}

/// The rules of the RBAC objects the operands render, by the scope the operator must hold them
/// in to create those objects.
#[derive(Clone, Debug, Default)]
pub struct OperandRules {
    /// Rules of operand Roles, all in the operator namespace.
    pub namespaced: Vec<PolicyRule>,
    /// Rules of operand ClusterRoles.
    pub cluster: Vec<PolicyRule>,
}

/// Every rule of every Role and ClusterRole the operands render in the [`scenarios`].
pub fn operand_rules() -> OperandRules {
    let mut out = OperandRules::default();
    for objects in rendered_operands() {
        for role in &objects.roles {
            out.namespaced
                .extend(role.rules.clone().unwrap_or_default());
        }
        for role in &objects.cluster_roles {
            out.cluster.extend(role.rules.clone().unwrap_or_default());
        }
    }
    out
}

/// The cluster-scoped objects the operands render, by API group and resource: their names.
fn rendered_cluster_objects() -> BTreeMap<(&'static str, &'static str), BTreeSet<String>> {
    let mut out: BTreeMap<_, BTreeSet<String>> = BTreeMap::new();
    let mut add = |api_version: &str, kind: &str, meta: &ObjectMeta| {
        if meta.namespace.is_some() {
            return;
        }
        if let (Some(resource), Some(name)) = (resource_of(api_version, kind), &meta.name) {
            out.entry(resource).or_default().insert(name.clone());
        }
    };
    for objects in rendered_operands() {
        let rbac = "rbac.authorization.k8s.io/v1";
        for o in &objects.cluster_roles {
            add(rbac, "ClusterRole", &o.metadata);
        }
        for o in &objects.cluster_role_bindings {
            add(rbac, "ClusterRoleBinding", &o.metadata);
        }
        for o in &objects.runtime_classes {
            add("node.k8s.io/v1", "RuntimeClass", &o.metadata);
        }
        for o in &objects.dynamic {
            if let Some(types) = &o.types {
                add(&types.api_version, &types.kind, &o.metadata);
            }
        }
    }
    out
}

/// Cluster-scoped kinds the operands render under names a user chooses, so that no name can be
/// fixed here: a GPUCluster's attribute DeviceClasses (`spec.draDriver` names them).
const USER_NAMED: &[(&str, &str)] = &[("resource.k8s.io", "deviceclasses")];

/// What applying and pruning the rendered cluster-scoped objects takes: reading and creating
/// any (the caches watch them by label; `create` cannot be limited to names), changing and
/// deleting only the rendered names, or any for a kind in [`USER_NAMED`].
fn rendered_cluster_object_rules() -> Vec<PolicyRule> {
    let mut rules = Vec::new();
    for ((group, resource), names) in rendered_cluster_objects() {
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let changes = ["patch", "delete"];
        rules.push(rule(
            &[group],
            &[resource],
            &["get", "list", "watch", "create"],
        ));
        if USER_NAMED.contains(&(group, resource)) {
            rules.push(rule(&[group], &[resource], &changes));
        } else {
            rules.push(rule_named(&[group], &[resource], &names, &changes));
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

fn metadata(name: &str, namespace: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        namespace: namespace.map(str::to_owned),
        labels: Some(string_map(&[
            (NAME_LABEL, OPERATOR_ROLE),
            (PART_OF_LABEL, PART_OF),
        ])),
        ..ObjectMeta::default()
    }
}

/// Every permission the operator holds cluster-wide.
fn cluster_grants() -> BTreeSet<Grant> {
    controller_cluster_rules()
        .iter()
        .chain(&rendered_cluster_object_rules())
        .chain(&operand_rules().cluster)
        .flat_map(grants)
        .collect()
}

/// The operator's ClusterRole `gpu-operator`.
pub fn operator_cluster_role() -> ClusterRole {
    ClusterRole {
        metadata: metadata(OPERATOR_ROLE, None),
        rules: Some(compact(cluster_grants())),
        aggregation_rule: None,
    }
}

/// The operator's Role `gpu-operator` in its namespace (`namespace`, or set by whoever
/// installs it): what it needs there and the ClusterRole does not already grant.
pub fn operator_role(namespace: Option<&str>) -> Role {
    let cluster = compact(cluster_grants());
    let namespaced: BTreeSet<Grant> = controller_namespace_rules()
        .iter()
        .chain(&operand_rules().namespaced)
        .flat_map(grants)
        .filter(|g| !allows(&cluster, g))
        .collect();
    Role {
        metadata: metadata(OPERATOR_ROLE, namespace),
        rules: Some(compact(namespaced)),
    }
}

/// The operator's Role `gpu-operator-leader-election` in the Lease's namespace (`namespace`,
/// or set by whoever installs it): creating the leader Lease, then reading and renewing only it.
pub fn leader_election_role(namespace: Option<&str>) -> Role {
    Role {
        metadata: metadata(LEADER_ELECTION_ROLE, namespace),
        rules: Some(leader_election_rules()),
    }
}

/// Binds the leader-election Role in `lease_namespace` to ServiceAccount `gpu-operator` in
/// `namespace`.
pub fn leader_election_role_binding(lease_namespace: &str, namespace: &str) -> RoleBinding {
    RoleBinding {
        metadata: metadata(LEADER_ELECTION_ROLE, Some(lease_namespace)),
        role_ref: role_ref("Role", LEADER_ELECTION_ROLE),
        subjects: Some(operator_subject(namespace)),
    }
}

fn role_ref(kind: &str, name: &str) -> RoleRef {
    RoleRef {
        api_group: Some("rbac.authorization.k8s.io".to_owned()),
        kind: kind.to_owned(),
        name: name.to_owned(),
    }
}

fn operator_subject(namespace: &str) -> Vec<Subject> {
    vec![Subject {
        kind: "ServiceAccount".to_owned(),
        name: OPERATOR_ROLE.to_owned(),
        namespace: Some(namespace.to_owned()),
        api_group: None,
    }]
}

/// Binds the ClusterRole to ServiceAccount `gpu-operator` in `namespace`.
pub fn operator_cluster_role_binding(namespace: &str) -> ClusterRoleBinding {
    ClusterRoleBinding {
        metadata: metadata(OPERATOR_ROLE, None),
        role_ref: role_ref("ClusterRole", OPERATOR_ROLE),
        subjects: Some(operator_subject(namespace)),
    }
}

/// Binds the Role to ServiceAccount `gpu-operator`, both in `namespace`.
pub fn operator_role_binding(namespace: &str) -> RoleBinding {
    RoleBinding {
        metadata: metadata(OPERATOR_ROLE, Some(namespace)),
        role_ref: role_ref("Role", OPERATOR_ROLE),
        subjects: Some(operator_subject(namespace)),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn all_of(rules: &[PolicyRule]) -> BTreeSet<Grant> {
        rules.iter().flat_map(grants).collect()
    }

    #[test]
    fn compacting_keeps_exactly_the_same_permissions() {
        let cluster = operator_cluster_role().rules.unwrap();
        let wanted: Vec<PolicyRule> = cluster_grants()
            .into_iter()
            .map(|g| match g.name {
                Some(name) => rule_named(&[&g.group], &[&g.resource], &[&name], &[&g.verb]),
                None => rule(&[&g.group], &[&g.resource], &[&g.verb]),
            })
            .collect();
        for r in &wanted {
            assert!(missing(&cluster, r).is_empty(), "{r:?} lost");
        }
        for r in &cluster {
            assert!(missing(&wanted, r).is_empty(), "{r:?} added");
        }
        // The Role adds exactly what the namespace needs beyond the ClusterRole.
        let role = operator_role(None).rules.unwrap();
        let held: Vec<PolicyRule> = cluster.iter().chain(&role).cloned().collect();
        let needed: Vec<PolicyRule> = controller_namespace_rules()
            .into_iter()
            .chain(operand_rules().namespaced)
            .collect();
        for r in &needed {
            assert!(missing(&held, r).is_empty(), "{r:?} lost");
        }
        for r in &role {
            assert!(missing(&needed, r).is_empty(), "{r:?} added");
            assert!(
                !missing(&cluster, r).is_empty(),
                "{r:?} already cluster-wide"
            );
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

    fn grant(group: &str, resource: &str, verb: &str, name: Option<&str>) -> Grant {
        Grant {
            group: group.to_owned(),
            resource: resource.to_owned(),
            verb: verb.to_owned(),
            name: name.map(str::to_owned),
        }
    }

    #[test]
    fn operator_rbac_holds_what_the_controller_and_openshift_operands_need() {
        let cluster = operator_cluster_role().rules.unwrap();
        let role = operator_role(None).rules.unwrap();
        let in_cluster =
            |g: &str, r: &str, v: &str, n: Option<&str>| allows(&cluster, &grant(g, r, v, n));
        let in_namespace = |g: &str, r: &str, v: &str, n: Option<&str>| {
            in_cluster(g, r, v, n) || allows(&role, &grant(g, r, v, n))
        };
        assert!(in_cluster(
            "nvidia.com",
            "clusterpolicies/finalizers",
            "update",
            None
        ));
        assert!(in_cluster("", "pods/eviction", "create", None));
        let scc = "securitycontextconstraints";
        assert!(in_namespace(
            "security.openshift.io",
            scc,
            "use",
            Some("privileged")
        ));
        // The node-status exporter's Role uses any SCC, so the operator must too, there.
        assert!(in_namespace("security.openshift.io", scc, "use", None));
        assert!(!in_cluster("security.openshift.io", scc, "use", None));
        assert!(in_namespace(
            "coordination.k8s.io",
            "leases",
            "update",
            Some("nfd-master.nfd.kubernetes.io")
        ));
        assert!(in_namespace("", "namespaces", "patch", None));
        assert!(!in_cluster("", "namespaces", "patch", None));
        assert!(!in_namespace("", "secrets", "get", None));
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

    /// Namespaced writes the ClusterRole grants in every namespace, and who needs each there.
    /// Everything else namespaced the operator writes is in its own namespace, in the Role.
    const CLUSTER_WIDE_NAMESPACED_WRITES: &[(&str, &str, &[&str], &str)] = &[
        (
            "",
            "pods/eviction",
            &["create"],
            "driver upgrades (the controller) and the driver's k8s-driver-manager (its \
             ClusterRole) drain the GPU pods of every namespace",
        ),
        (
            "",
            "events",
            &["create", "patch"],
            "the controller: events about the cluster-scoped policy go to namespace default",
        ),
        (
            "events.k8s.io",
            "events",
            &["create", "patch"],
            "the controller: events about the cluster-scoped policy go to namespace default",
        ),
        (
            "nfd.k8s-sigs.io",
            "nodefeaturegroups/status",
            &["update", "patch"],
            "nfd-master's ClusterRole: the NodeFeatureGroups of every namespace",
        ),
        (
            "resource.k8s.io",
            "resourceclaimtemplates",
            &["create", "update", "delete"],
            "the DRA compute-domain controller's ClusterRole: templates in each \
             ComputeDomain's namespace",
        ),
        (
            "resource.nvidia.com",
            "computedomains",
            &["update"],
            "the DRA compute-domain controller's ClusterRole: its finalizer on ComputeDomains, \
             which live in the users' namespaces",
        ),
        (
            "resource.nvidia.com",
            "computedomains/status",
            &["update"],
            "the DRA compute-domain controller's and daemon's ClusterRoles",
        ),
    ];

    const WRITES: [&str; 6] = [
        "create",
        "update",
        "patch",
        "delete",
        "deletecollection",
        "*",
    ];

    fn listed_exception(g: &Grant) -> bool {
        CLUSTER_WIDE_NAMESPACED_WRITES
            .iter()
            .any(|(group, resource, verbs, _)| {
                *group == g.group && *resource == g.resource && verbs.contains(&g.verb.as_str())
            })
    }

    #[test]
    fn cluster_role_writes_no_namespaced_kind_but_the_listed_exceptions() {
        let unexpected: Vec<Grant> = all_of(&operator_cluster_role().rules.unwrap())
            .into_iter()
            .filter(|g| WRITES.contains(&g.verb.as_str()))
            .filter(|g| scope(&g.group, &g.resource) != Some(Scope::Cluster))
            .filter(|g| !listed_exception(g))
            .collect();
        assert!(
            unexpected.is_empty(),
            "the ClusterRole writes namespaced kinds in every namespace: {unexpected:?}; grant \
             them in the operator namespace (controller_namespace_rules, or an operand Role), \
             or list the grant with the operand that needs it cluster-wide"
        );
    }

    #[test]
    fn every_cluster_wide_namespaced_write_is_still_needed() {
        let needed = all_of(
            &controller_cluster_rules()
                .into_iter()
                .chain(operand_rules().cluster)
                .collect::<Vec<_>>(),
        );
        for (group, resource, verbs, who) in CLUSTER_WIDE_NAMESPACED_WRITES {
            for verb in *verbs {
                assert!(
                    needed.contains(&grant(group, resource, verb, None)),
                    "{verb} {group}/{resource} is listed for {who:?}, which no longer needs it"
                );
            }
        }
    }

    /// Unnamed patches the controller itself needs cluster-wide (no operand ClusterRole has
    /// them), and why.
    const CONTROLLER_PATCHES: &[(&str, &str, &str)] = &[
        (
            "nvidia.com",
            "clusterpolicies",
            "the policies' owner finalizers",
        ),
        (
            "nvidia.com",
            "clusterpolicies/status",
            "the policies' status",
        ),
        (
            "nvidia.com",
            "gpuclusters",
            "the GPUClusters' owner finalizers",
        ),
        (
            "nvidia.com",
            "gpuclusters/status",
            "the GPUClusters' status",
        ),
        (
            "nvidia.com",
            "nvidiadrivers/status",
            "the NVIDIADriver pools' status",
        ),
        (
            "",
            "nodes/status",
            "the GPU memory resource in node capacity",
        ),
        (
            "scheduling.k8s.io",
            "priorityclasses",
            "the PriorityClasses spec.nodePools names (no fixed names)",
        ),
        (
            "",
            "events",
            "events about the cluster-scoped policy, in namespace default",
        ),
        (
            "events.k8s.io",
            "events",
            "events about the cluster-scoped policy",
        ),
        (
            "resource.k8s.io",
            "deviceclasses",
            "a GPUCluster's attribute DeviceClasses, named in its spec",
        ),
    ];

    #[test]
    fn cluster_role_patches_only_what_an_operand_cluster_role_or_the_listed_controller_needs() {
        let operands = all_of(&operand_rules().cluster);
        let unexpected: Vec<Grant> = all_of(&operator_cluster_role().rules.unwrap())
            .into_iter()
            .filter(|g| g.verb == "patch" && g.name.is_none())
            .filter(|g| !operands.contains(g))
            .filter(|g| {
                !CONTROLLER_PATCHES
                    .iter()
                    .any(|(group, resource, _)| *group == g.group && *resource == g.resource)
            })
            .collect();
        assert!(
            unexpected.is_empty(),
            "the ClusterRole patches {unexpected:?} without names, though no operand \
             ClusterRole needs it: limit it to the rendered names, or list the need"
        );
    }

    #[test]
    fn every_granted_resource_has_a_known_scope() {
        let rules: Vec<PolicyRule> = controller_cluster_rules()
            .into_iter()
            .chain(controller_namespace_rules())
            .chain(leader_election_rules())
            .chain(operand_rules().cluster)
            .chain(operand_rules().namespaced)
            .collect();
        let unknown: BTreeSet<(String, String)> = all_of(&rules)
            .into_iter()
            .filter(|g| scope(&g.group, &g.resource).is_none())
            .map(|g| (g.group, g.resource))
            .collect();
        assert!(
            unknown.is_empty(),
            "no scope for {unknown:?}: add each to RESOURCES in render/rbac.rs"
        );
    }

    #[test]
    fn operand_roles_live_in_the_operator_namespace() {
        // The operator's Role is what lets it grant them, and it holds only there.
        for objects in rendered_operands() {
            for role in &objects.roles {
                assert_eq!(
                    role.metadata.namespace.as_deref(),
                    Some("gpu-operator"),
                    "{:?}",
                    role.metadata.name
                );
            }
        }
    }

    #[test]
    fn leases_are_written_only_by_the_leader_election_role_and_renewed_by_name() {
        let cluster = operator_cluster_role().rules.unwrap();
        let role = operator_role(None).rules.unwrap();
        let leader = leader_election_role(None).rules.unwrap();
        for verb in ["create", "update", "patch", "delete"] {
            assert!(!allows(
                &cluster,
                &grant("coordination.k8s.io", "leases", verb, None)
            ));
        }
        // The namespace Role creates Leases only to grant NFD's and the DRA controller's
        // Roles that; it neither reads nor renews the operator's own.
        for verb in ["get", "update", "patch", "delete"] {
            for rules in [&cluster, &role] {
                assert!(!allows(
                    rules,
                    &grant("coordination.k8s.io", "leases", verb, Some(LEADER_LEASE))
                ));
            }
        }
        let lease = |verb: &str, name: Option<&str>| {
            allows(&leader, &grant("coordination.k8s.io", "leases", verb, name))
        };
        assert!(lease("create", None));
        assert!(lease("update", Some(LEADER_LEASE)));
        assert!(lease("get", Some(LEADER_LEASE)));
        assert!(!lease("update", None));
        assert!(!lease("get", None));
        assert!(!lease("update", Some("kube-scheduler")));
        assert!(!lease("delete", Some(LEADER_LEASE)));
    }

    #[test]
    fn cluster_scoped_objects_are_changed_only_by_their_rendered_names() {
        let cluster = operator_cluster_role().rules.unwrap();
        let may = |group: &str, resource: &str, verb: &str, name: &str| {
            allows(&cluster, &grant(group, resource, verb, Some(name)))
        };
        let rbac = "rbac.authorization.k8s.io";
        assert!(may(rbac, "clusterroles", "patch", "nvidia-driver"));
        assert!(may(rbac, "clusterrolebindings", "delete", "nvidia-driver"));
        assert!(!may(rbac, "clusterroles", "patch", "cluster-admin"));
        assert!(!may(rbac, "clusterrolebindings", "patch", "cluster-admin"));
        assert!(!may(rbac, "clusterroles", "escalate", "cluster-admin"));
        assert!(may("node.k8s.io", "runtimeclasses", "patch", "nvidia"));
        assert!(!may("node.k8s.io", "runtimeclasses", "delete", "runc"));
        let scc = "securitycontextconstraints";
        assert!(may("security.openshift.io", scc, "patch", "nvidia-driver"));
        assert!(!may("security.openshift.io", scc, "patch", "privileged"));
        // A GPUCluster names its attribute DeviceClasses.
        assert!(may(
            "resource.k8s.io",
            "deviceclasses",
            "patch",
            "users-own-class"
        ));
        // Creating cannot be limited by name.
        assert!(allows(
            &cluster,
            &grant(rbac, "clusterroles", "create", None)
        ));
        for resource in ["clusterroles", "clusterrolebindings"] {
            for verb in ["update", "patch", "delete"] {
                assert!(
                    !allows(&cluster, &grant(rbac, resource, verb, None)),
                    "{verb} {resource}"
                );
            }
        }
    }
}
