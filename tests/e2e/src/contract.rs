//! The operand API contract (docs/operand-api-contract.md): every Kubernetes API request each
//! operand's real binary makes at the pinned version, kept as facts in
//! `testdata/operand-api-contract.tsv`, and the checks of rendered RBAC against them. Pure: the
//! callers fetch Roles and bindings (from the cluster, or from a local rendering) and ask the
//! API server's authorizer (SubjectAccessReview) where they can.
//!
//! Two directions are checked. Every row that applies must be allowed to the operand's
//! ServiceAccount ([`missing`], and the e2e test asks the API server the same question); and
//! every permission a rendered Role or ClusterRole grants must be needed by some row of that
//! ServiceAccount, a row marked `parity` included ([`excess`]).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use gpu_operator::render::rbac::{Grant, grants};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};

/// The facts file, compiled in so that a unit test and the e2e test read the same rows.
pub const FACTS: &str = include_str!("../testdata/operand-api-contract.tsv");

/// Where a request reaches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Scope {
    /// The operator namespace (the operand's own).
    Namespaced,
    /// A cluster-scoped resource, or a namespaced one in every namespace.
    Cluster,
}

/// Where a row applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Platform {
    Any,
    OpenShift,
}

/// Why a row is there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Need {
    /// The pinned binary makes the request (or pod admission needs it).
    Uses,
    /// The pinned binary does not; NVIDIA's operator grants it and we keep it (the row says why).
    Parity,
}

/// One request of one operand container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    pub operand: String,
    pub service_account: String,
    pub container: String,
    pub verb: String,
    /// API group, `""` for the core group.
    pub group: String,
    pub version: String,
    pub resource: String,
    pub subresource: Option<String>,
    /// A single object's name (`resourceNames` in RBAC).
    pub name: Option<String>,
    pub scope: Scope,
    pub platform: Platform,
    pub need: Need,
    pub source: String,
    pub why: String,
}

impl Row {
    /// Whether the row says that the ServiceAccount makes no API request at all (verb `-`):
    /// nothing to allow, and every grant to it is excess.
    pub fn is_none(&self) -> bool {
        self.verb == "-"
    }

    /// The resource as RBAC names it (`pods/eviction`).
    pub fn rbac_resource(&self) -> String {
        match &self.subresource {
            Some(sub) => format!("{}/{sub}", self.resource),
            None => self.resource.clone(),
        }
    }

    pub fn applies(&self, openshift: bool) -> bool {
        self.platform == Platform::Any || openshift
    }

    /// `group/version`, or `v1` for the core group.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

impl fmt::Display for Row {
    /// `list pods (core/v1) in every namespace`, as failure messages name a request.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_none() {
            return write!(f, "no API request");
        }
        let group = if self.group.is_empty() {
            "core"
        } else {
            &self.group
        };
        write!(
            f,
            "{} {} ({group}/{})",
            self.verb,
            self.rbac_resource(),
            self.version
        )?;
        if let Some(name) = &self.name {
            write!(f, " named {name}")?;
        }
        match self.scope {
            Scope::Namespaced => write!(f, " in the operator namespace"),
            Scope::Cluster => write!(f, " cluster-wide"),
        }
    }
}

fn optional(field: &str) -> Option<String> {
    (field != "-").then(|| field.to_owned())
}

/// Parses the facts file: `#` lines are comments, every other line one 14-column row.
pub fn parse(text: &str) -> Result<Vec<Row>, String> {
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split('\t').collect();
        let [
            operand,
            service_account,
            container,
            verb,
            group,
            version,
            resource,
            subresource,
            name,
            scope,
            platform,
            need,
            source,
            why,
        ] = fields[..]
        else {
            return Err(format!(
                "line {}: {} columns, want 14: {line}",
                i + 1,
                fields.len()
            ));
        };
        let scope = match scope {
            "namespaced" => Scope::Namespaced,
            "cluster" => Scope::Cluster,
            other => return Err(format!("line {}: scope {other:?}", i + 1)),
        };
        let platform = match platform {
            "any" => Platform::Any,
            "openshift" => Platform::OpenShift,
            other => return Err(format!("line {}: platform {other:?}", i + 1)),
        };
        let need = match need {
            "uses" => Need::Uses,
            "parity" => Need::Parity,
            other => return Err(format!("line {}: need {other:?}", i + 1)),
        };
        rows.push(Row {
            operand: operand.to_owned(),
            service_account: service_account.to_owned(),
            container: container.to_owned(),
            verb: verb.to_owned(),
            group: if group == "core" {
                String::new()
            } else {
                group.to_owned()
            },
            version: version.to_owned(),
            resource: resource.to_owned(),
            subresource: optional(subresource),
            name: optional(name),
            scope,
            platform,
            need,
            source: source.to_owned(),
            why: why.to_owned(),
        });
    }
    Ok(rows)
}

/// The policy the contract test deploys: every operand and every RBAC-bearing option, the same
/// spec the operator's ClusterRole is generated from.
pub fn policy() -> serde_json::Value {
    gpu_operator::render::rbac::every_rbac_variant()
}

/// The sandbox operands of mode kata, which [`policy`] (mode kubevirt) cannot hold: the contract
/// test patches the policy to this one after checking [`policy`], and the operator's ClusterRole
/// is generated from both.
pub fn kata_policy() -> serde_json::Value {
    gpu_operator::render::rbac::every_kata_rbac_variant()
}

/// Every policy the contract covers; together they render every ServiceAccount of the rows.
pub fn policies() -> [serde_json::Value; 2] {
    [policy(), kata_policy()]
}

/// The ServiceAccounts the operands of `spec` bind roles to, rendered offline (the operator
/// namespace is `namespace`).
pub fn rendered_service_accounts(
    spec: &serde_json::Value,
    namespace: &str,
    openshift: bool,
) -> BTreeSet<String> {
    use gpu_operator::api::{ClusterPolicy, ClusterPolicySpec};
    use gpu_operator::facts::{ClusterFacts, ConfigMapData};
    use gpu_operator::render::{Outcome, render};
    let spec: ClusterPolicySpec = serde_json::from_value(spec.clone()).unwrap_or_default();
    let facts = ClusterFacts {
        namespace: namespace.to_owned(),
        os_tag: Some("ubuntu22.04".to_owned()),
        openshift,
        sharing_source: Some(ConfigMapData {
            name: "sharing".to_owned(),
            data: [("default".to_owned(), "version: v1\n".to_owned())].into(),
        }),
        ..ClusterFacts::default()
    };
    let policy = gpu_operator::validate::validate(&ClusterPolicy::new("contract", spec), &facts);
    render(&policy, &facts)
        .operands
        .into_iter()
        .filter_map(|state| match state.outcome {
            Outcome::Rendered(objects) => Some(objects),
            _ => None,
        })
        .flat_map(|objects| objects.service_accounts)
        .filter_map(|sa| sa.metadata.name)
        .collect()
}

/// The GPUCluster the contract test deploys beside [`policy`]: the DRA driver with compute
/// domains and every RBAC-bearing option, DCGM, the exporter and the DRA validator.
pub fn gpu_cluster() -> serde_json::Value {
    gpu_operator::render::rbac::every_gpu_cluster_rbac_variant()
}

/// The rows of the facts file.
pub fn rows() -> Vec<Row> {
    parse(FACTS).unwrap_or_else(|e| panic!("testdata/operand-api-contract.tsv: {e}"))
}

/// The rules a ServiceAccount holds through rendered Roles (in the operator namespace) and
/// ClusterRoles (everywhere), each with the role that grants it.
#[derive(Clone, Debug, Default)]
pub struct Held {
    pub namespaced: Vec<(String, PolicyRule)>,
    pub cluster: Vec<(String, PolicyRule)>,
}

/// The RBAC objects an operator rendered (or a cluster holds).
#[derive(Clone, Debug, Default)]
pub struct Rbac {
    pub roles: Vec<Role>,
    pub role_bindings: Vec<RoleBinding>,
    pub cluster_roles: Vec<ClusterRole>,
    pub cluster_role_bindings: Vec<ClusterRoleBinding>,
}

fn binds(
    subjects: Option<&Vec<k8s_openapi::api::rbac::v1::Subject>>,
    namespace: &str,
    sa: &str,
) -> bool {
    subjects.into_iter().flatten().any(|s| {
        s.kind == "ServiceAccount" && s.name == sa && s.namespace.as_deref() == Some(namespace)
    })
}

impl Rbac {
    /// What ServiceAccount `sa` of `namespace` holds.
    pub fn held_by(&self, namespace: &str, sa: &str) -> Held {
        let mut held = Held::default();
        for binding in &self.role_bindings {
            if binding.metadata.namespace.as_deref() != Some(namespace)
                || binding.role_ref.kind != "Role"
                || !binds(binding.subjects.as_ref(), namespace, sa)
            {
                continue;
            }
            for role in self.roles.iter().filter(|r| {
                r.metadata.name.as_deref() == Some(binding.role_ref.name.as_str())
                    && r.metadata.namespace.as_deref() == Some(namespace)
            }) {
                for rule in role.rules.iter().flatten() {
                    held.namespaced
                        .push((format!("Role {}", binding.role_ref.name), rule.clone()));
                }
            }
        }
        for binding in &self.cluster_role_bindings {
            if binding.role_ref.kind != "ClusterRole"
                || !binds(binding.subjects.as_ref(), namespace, sa)
            {
                continue;
            }
            for role in self
                .cluster_roles
                .iter()
                .filter(|r| r.metadata.name.as_deref() == Some(binding.role_ref.name.as_str()))
            {
                for rule in role.rules.iter().flatten() {
                    held.cluster.push((
                        format!("ClusterRole {}", binding.role_ref.name),
                        rule.clone(),
                    ));
                }
            }
        }
        held
    }
}

fn grant_of(row: &Row) -> Grant {
    Grant {
        group: row.group.clone(),
        resource: row.rbac_resource(),
        verb: row.verb.clone(),
        name: row.name.clone(),
    }
}

/// Whether `held` allows `row` as the RBAC authorizer decides it: a namespaced request by a
/// Role or a ClusterRole, a cluster-wide one by a ClusterRole only.
pub fn allows(held: &Held, row: &Row) -> bool {
    let grant = grant_of(row);
    let by = |rules: &[(String, PolicyRule)]| {
        let rules: Vec<PolicyRule> = rules.iter().map(|(_, r)| r.clone()).collect();
        gpu_operator::render::rbac::allows(&rules, &grant)
    };
    by(&held.cluster) || (row.scope == Scope::Namespaced && by(&held.namespaced))
}

/// The ServiceAccounts the rows name, with the operands that run under each.
pub fn service_accounts(rows: &[Row]) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for row in rows {
        out.entry(row.service_account.clone())
            .or_default()
            .insert(row.operand.clone());
    }
    out
}

/// One failure line per applicable row that `held_by` does not allow.
pub fn missing(rows: &[Row], openshift: bool, held_by: impl Fn(&str) -> Held) -> Vec<String> {
    rows.iter()
        .filter(|r| r.applies(openshift) && !r.is_none())
        .filter(|r| !allows(&held_by(&r.service_account), r))
        .map(|r| {
            format!(
                "{} ({} container, ServiceAccount {}) is not allowed to {} [{}]",
                r.operand, r.container, r.service_account, r, r.source
            )
        })
        .collect()
}

/// Whether an applicable row of `sa` needs what `grant` (held at `scope`) gives: same verb,
/// group and resource; a named grant is covered by a row for that name or for any name, an
/// unnamed grant only by an unnamed row; a cluster-wide grant only by a cluster-wide row.
fn needed(rows: &[Row], sa: &str, openshift: bool, grant: &Grant, scope: Scope) -> bool {
    rows.iter()
        .filter(|r| r.service_account == sa && r.applies(openshift))
        .any(|r| {
            r.verb == grant.verb
                && r.group == grant.group
                && r.rbac_resource() == grant.resource
                && (r.name.is_none() || r.name == grant.name)
                && (scope == Scope::Namespaced || r.scope == Scope::Cluster)
        })
}

/// One failure line per permission a rendered role grants a ServiceAccount that none of its
/// rows needs.
pub fn excess(rows: &[Row], openshift: bool, held_by: impl Fn(&str) -> Held) -> Vec<String> {
    let mut out = Vec::new();
    for (sa, operands) in service_accounts(rows) {
        let held = held_by(&sa);
        let operands = operands.into_iter().collect::<Vec<_>>().join(", ");
        for (scope, rules) in [
            (Scope::Namespaced, &held.namespaced),
            (Scope::Cluster, &held.cluster),
        ] {
            for (role, rule) in rules {
                for grant in grants(rule) {
                    if !needed(rows, &sa, openshift, &grant, scope) {
                        let group = if grant.group.is_empty() {
                            "core"
                        } else {
                            &grant.group
                        };
                        let name = grant
                            .name
                            .as_ref()
                            .map(|n| format!(" named {n}"))
                            .unwrap_or_default();
                        out.push(format!(
                            "{operands} (ServiceAccount {sa}): {role} grants {} {} ({group}){name} \
                             {}, which no row of the contract needs",
                            grant.verb,
                            grant.resource,
                            match scope {
                                Scope::Namespaced => "in the operator namespace",
                                Scope::Cluster => "cluster-wide",
                            }
                        ));
                    }
                }
            }
        }
    }
    out
}

/// The markdown table of `rows`, as docs/operand-api-contract.md carries it between its
/// `rows:begin` and `rows:end` markers.
pub fn markdown_table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| operand | container | ServiceAccount | verb | group | resource | name | scope | platform | need | why | source |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let group = if r.group.is_empty() {
            "core".to_owned()
        } else {
            r.group.clone()
        };
        if r.is_none() {
            out.push_str(&format!(
                "| {} | {} | {} | none | | | | | {} | {} | {} | `{}` |\n",
                r.operand,
                r.container,
                r.service_account,
                match r.platform {
                    Platform::Any => "any",
                    Platform::OpenShift => "OpenShift",
                },
                match r.need {
                    Need::Uses => "uses",
                    Need::Parity => "parity",
                },
                r.why.replace('|', "\\|"),
                r.source,
            ));
            continue;
        }
        out.push_str(&format!(
            "| {} | {} | {} | {} | {}/{} | {} | {} | {} | {} | {} | {} | `{}` |\n",
            r.operand,
            r.container,
            r.service_account,
            r.verb,
            group,
            r.version,
            r.rbac_resource(),
            r.name.as_deref().unwrap_or(""),
            match r.scope {
                Scope::Namespaced => "namespaced",
                Scope::Cluster => "cluster",
            },
            match r.platform {
                Platform::Any => "any",
                Platform::OpenShift => "OpenShift",
            },
            match r.need {
                Need::Uses => "uses",
                Need::Parity => "parity",
            },
            r.why.replace('|', "\\|"),
            r.source,
        ));
    }
    out
}

/// The environment facts file: which binary each rendered container runs, and the variables
/// each binary reads.
pub const ENV_FACTS: &str = include_str!("../testdata/operand-env-contract.tsv");

/// The binary whose variables the NVIDIA container runtime reads from any container's spec.
pub const RUNTIME_READER: &str = "nvidia-container-runtime";

/// The environment contract: `(operand, container) -> binary` and `binary -> variables`.
#[derive(Clone, Debug, Default)]
pub struct EnvContract {
    pub containers: BTreeMap<(String, String), String>,
    pub variables: BTreeMap<String, BTreeSet<String>>,
}

impl EnvContract {
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut out = EnvContract::default();
        for (i, line) in text.lines().enumerate() {
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            match line.split('\t').collect::<Vec<_>>()[..] {
                ["container", operand, container, binary, _] => {
                    out.containers.insert(
                        (operand.to_owned(), container.to_owned()),
                        binary.to_owned(),
                    );
                }
                ["env", binary, variable, "binary" | "runtime" | "parity", _] => {
                    out.variables
                        .entry(binary.to_owned())
                        .or_default()
                        .insert(variable.to_owned());
                }
                _ => return Err(format!("line {}: {line}", i + 1)),
            }
        }
        Ok(out)
    }

    /// The variables set on `container` of `operand` that its binary does not read (`None`:
    /// the container is not in the contract).
    pub fn unread<'a>(
        &self,
        operand: &str,
        container: &str,
        set: impl IntoIterator<Item = &'a str>,
    ) -> Option<Vec<String>> {
        let binary = self
            .containers
            .get(&(operand.to_owned(), container.to_owned()))?;
        let reads = |b: &str, v: &str| self.variables.get(b).is_some_and(|vars| vars.contains(v));
        Some(
            set.into_iter()
                .filter(|v| !reads(binary, v) && !reads(RUNTIME_READER, v))
                .map(str::to_owned)
                .collect(),
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use gpu_operator::api::{ClusterPolicy, ClusterPolicySpec};
    use gpu_operator::facts::{ClusterFacts, ConfigMapData, Runtime};
    use gpu_operator::model::{Operand, OperandObjects};
    use gpu_operator::operands::dra_driver::{self, ValidatedGpuCluster};
    use gpu_operator::render::{Outcome, render};
    use gpu_operator::validate::validate;

    const NAMESPACE: &str = "gpu-operator";
    const DOC: &str = "../../docs/operand-api-contract.md";

    /// The cluster the local renderings are for: OpenShift (CRI-O) or plain (containerd), the
    /// sharing ConfigMap of [`super::policy`] present.
    fn rendering_facts(openshift: bool) -> ClusterFacts {
        ClusterFacts {
            namespace: NAMESPACE.to_owned(),
            runtime: if openshift {
                Runtime::CriO
            } else {
                Runtime::Containerd
            },
            os_tag: Some("ubuntu22.04".to_owned()),
            openshift,
            sharing_source: Some(ConfigMapData {
                name: "sharing".to_owned(),
                data: [("default".to_owned(), "version: v1\n".to_owned())].into(),
            }),
            ..ClusterFacts::default()
        }
    }

    /// What the operator renders for a policy with every operand and RBAC-bearing option on,
    /// and for the GPUCluster beside it ([`super::gpu_cluster`]).
    fn rendered(openshift: bool) -> Rbac {
        let facts = rendering_facts(openshift);
        let mut objects: Vec<OperandObjects> = Vec::new();
        for spec in super::policies() {
            let spec: ClusterPolicySpec = serde_json::from_value(spec).unwrap();
            let policy = validate(&ClusterPolicy::new("contract", spec), &facts);
            objects.extend(
                render(&policy, &facts)
                    .operands
                    .into_iter()
                    .filter_map(|state| match state.outcome {
                        Outcome::Rendered(o) => Some(o),
                        _ => None,
                    }),
            );
        }
        let cluster = ValidatedGpuCluster {
            name: "gpu-cluster".to_owned(),
            spec: serde_json::from_value(super::gpu_cluster()).unwrap(),
            ..ValidatedGpuCluster::default()
        };
        for operand in Operand::GPU_CLUSTER {
            objects.extend(dra_driver::render(operand, &cluster, &facts));
        }
        let mut rbac = Rbac::default();
        for o in objects {
            rbac.roles.extend(o.roles);
            rbac.role_bindings.extend(o.role_bindings);
            rbac.cluster_roles.extend(o.cluster_roles);
            rbac.cluster_role_bindings.extend(o.cluster_role_bindings);
        }
        // Both policies render the operands they share (the same objects): keep one of each, as
        // a cluster holds one object per name.
        fn first_of_each_name<T: kube::Resource>(objects: &mut Vec<T>) {
            let mut seen = BTreeSet::new();
            objects.retain(|o| seen.insert(o.meta().name.clone()));
        }
        first_of_each_name(&mut rbac.roles);
        first_of_each_name(&mut rbac.role_bindings);
        first_of_each_name(&mut rbac.cluster_roles);
        first_of_each_name(&mut rbac.cluster_role_bindings);
        rbac
    }

    #[test]
    fn the_facts_file_parses_and_names_every_rendered_service_account() {
        let rows = rows();
        assert!(rows.len() > 100, "{} rows", rows.len());
        let named = service_accounts(&rows);
        for openshift in [false, true] {
            let rbac = rendered(openshift);
            for b in &rbac.role_bindings {
                for s in b.subjects.iter().flatten() {
                    assert!(named.contains_key(&s.name), "{} has no rows", s.name);
                }
            }
            for b in &rbac.cluster_role_bindings {
                for s in b.subjects.iter().flatten() {
                    assert!(named.contains_key(&s.name), "{} has no rows", s.name);
                }
            }
        }
    }

    #[test]
    fn rendered_rbac_allows_every_row_and_grants_nothing_else() {
        let rows = rows();
        for openshift in [false, true] {
            let rbac = rendered(openshift);
            let held = |sa: &str| rbac.held_by(NAMESPACE, sa);
            let missing = missing(&rows, openshift, held);
            assert!(
                missing.is_empty(),
                "openshift={openshift}:\n{}",
                missing.join("\n")
            );
            let excess = excess(&rows, openshift, held);
            assert!(
                excess.is_empty(),
                "openshift={openshift}:\n{}",
                excess.join("\n")
            );
        }
    }

    #[test]
    fn a_role_with_one_rule_removed_fails_naming_the_operand_and_the_request() {
        let rows = rows();
        let mut rbac = rendered(false);
        let role = rbac
            .roles
            .iter_mut()
            .find(|r| r.metadata.name.as_deref() == Some("nvidia-mig-manager"))
            .unwrap();
        let rules = role.rules.as_mut().unwrap();
        let before = rules.len();
        rules.retain(|r| !r.resources.iter().flatten().any(|res| res == "configmaps"));
        assert_eq!(rules.len(), before - 1);
        let missing = missing(&rows, false, |sa| rbac.held_by(NAMESPACE, sa));
        // The three requests mig-manager makes.
        for verb in ["create", "get", "update"] {
            let want = format!(
                "mig-manager (nvidia-mig-manager container, ServiceAccount nvidia-mig-manager) \
                 is not allowed to {verb} configmaps (core/v1) in the operator namespace"
            );
            assert!(
                missing.iter().any(|m| m.starts_with(&want)),
                "{want}\nnot in:\n{}",
                missing.join("\n")
            );
        }
        assert_eq!(missing.len(), 3, "{}", missing.join("\n"));
    }

    #[test]
    fn a_rule_no_row_needs_is_reported_as_excess() {
        let rows = rows();
        let mut rbac = rendered(false);
        let role = rbac
            .cluster_roles
            .iter_mut()
            .find(|r| r.metadata.name.as_deref() == Some("nvidia-device-plugin"))
            .unwrap();
        role.rules.as_mut().unwrap().push(PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["secrets".to_owned()]),
            verbs: vec!["get".to_owned()],
            ..PolicyRule::default()
        });
        let excess = excess(&rows, false, |sa| rbac.held_by(NAMESPACE, sa));
        assert_eq!(
            excess,
            vec![
                "device-plugin, mps-control-daemon (ServiceAccount nvidia-device-plugin): \
                 ClusterRole nvidia-device-plugin grants get secrets (core) cluster-wide, which \
                 no row of the contract needs"
                    .to_owned()
            ]
        );
    }

    #[test]
    fn a_cluster_wide_grant_of_a_namespaced_row_is_excess() {
        let rows: Vec<Row> = rows()
            .into_iter()
            .filter(|r| r.service_account == "nvidia-container-toolkit")
            .collect();
        let rule = PolicyRule {
            api_groups: Some(vec!["apps".to_owned()]),
            resources: Some(vec!["daemonsets".to_owned()]),
            verbs: vec!["list".to_owned()],
            ..PolicyRule::default()
        };
        let held = Held {
            namespaced: vec![],
            cluster: vec![("ClusterRole x".to_owned(), rule)],
        };
        assert_eq!(excess(&rows, false, |_| held.clone()).len(), 1);
        assert!(missing(&rows, false, |_| held.clone()).is_empty());
    }

    #[test]
    fn a_grant_to_a_service_account_that_makes_no_request_is_excess() {
        let rows = rows();
        let none: Vec<&Row> = rows.iter().filter(|r| r.is_none()).collect();
        assert_eq!(none.len(), 1, "{none:?}");
        assert_eq!(none[0].service_account, "nvidia-dra-validator");
        let rule = PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["pods".to_owned()]),
            verbs: vec!["get".to_owned()],
            ..PolicyRule::default()
        };
        let held = |sa: &str| Held {
            namespaced: if sa == "nvidia-dra-validator" {
                vec![("Role nvidia-dra-validator".to_owned(), rule.clone())]
            } else {
                vec![]
            },
            cluster: vec![],
        };
        let only: Vec<Row> = rows
            .iter()
            .filter(|r| r.service_account == "nvidia-dra-validator")
            .cloned()
            .collect();
        assert_eq!(excess(&only, false, held).len(), 1);
        assert!(missing(&only, false, held).is_empty());
    }

    #[test]
    fn the_doc_carries_exactly_the_rows_of_the_facts_file() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(DOC);
        let doc = std::fs::read_to_string(&path).unwrap();
        let (begin, end) = ("<!-- rows:begin -->\n", "<!-- rows:end -->");
        let start = doc.find(begin).expect("rows:begin marker") + begin.len();
        let stop = doc.find(end).expect("rows:end marker");
        let want = markdown_table(&rows());
        if doc[start..stop] != want {
            if std::env::var_os("CONTRACT_DOC_WRITE").is_some() {
                let mut new = doc[..start].to_owned();
                new.push_str(&want);
                new.push_str(&doc[stop..]);
                std::fs::write(&path, new).unwrap();
            } else {
                panic!(
                    "{} differs from testdata/operand-api-contract.tsv; regenerate with \
                     CONTRACT_DOC_WRITE=1 cargo test -p e2e --lib contract",
                    path.display()
                );
            }
        }
    }

    fn pods(
        openshift: bool,
        runtime: Runtime,
    ) -> Vec<(String, k8s_openapi::api::core::v1::PodSpec)> {
        let facts = ClusterFacts {
            runtime,
            openshift,
            ..rendering_facts(openshift)
        };
        let mut out = Vec::new();
        let states = super::policies().into_iter().flat_map(|spec| {
            let spec: ClusterPolicySpec = serde_json::from_value(spec).unwrap();
            render(
                &validate(&ClusterPolicy::new("contract", spec), &facts),
                &facts,
            )
            .operands
        });
        for state in states {
            if let Outcome::Rendered(o) = state.outcome {
                for ds in o.daemon_sets {
                    out.push((
                        state.operand.name().to_owned(),
                        ds.spec.unwrap().template.spec.unwrap(),
                    ));
                }
                for d in o.deployments {
                    out.push((
                        state.operand.name().to_owned(),
                        d.spec.unwrap().template.spec.unwrap(),
                    ));
                }
            }
        }
        out
    }

    #[test]
    fn every_variable_we_set_is_read_by_the_containers_binary() {
        let contract = EnvContract::parse(ENV_FACTS).unwrap();
        let mut seen = BTreeSet::new();
        let mut unread = Vec::new();
        for (openshift, runtime) in [
            (false, Runtime::Containerd),
            (false, Runtime::CriO),
            (false, Runtime::Docker),
            (true, Runtime::CriO),
        ] {
            for (operand, pod) in pods(openshift, runtime) {
                for c in pod.init_containers.iter().flatten().chain(&pod.containers) {
                    let set = c.env.iter().flatten().map(|e| e.name.as_str());
                    if let Some(names) = contract.unread(&operand, &c.name, set) {
                        seen.insert((operand.clone(), c.name.clone()));
                        for name in names {
                            unread.push(format!(
                                "{operand} container {} ({runtime:?}, openshift={openshift}) sets \
                                 {name}, which {} does not read",
                                c.name,
                                contract.containers[&(operand.clone(), c.name.clone())]
                            ));
                        }
                    }
                }
            }
        }
        unread.sort();
        unread.dedup();
        assert!(unread.is_empty(), "{}", unread.join("\n"));
        let listed: BTreeSet<_> = contract.containers.keys().cloned().collect();
        assert_eq!(
            listed.difference(&seen).collect::<Vec<_>>(),
            Vec::<&(String, String)>::new(),
            "containers in the env contract that are not rendered"
        );
    }

    #[test]
    fn a_renamed_variable_is_reported() {
        let contract = EnvContract::parse(ENV_FACTS).unwrap();
        assert_eq!(
            contract.unread(
                "mig-manager",
                "nvidia-mig-manager",
                ["GPU_CLIENTS_FILE", "GPU_CLIENT_FILE"]
            ),
            Some(vec!["GPU_CLIENT_FILE".to_owned()])
        );
        assert_eq!(
            contract.unread("gpu-feature-discovery", "no-such-container", ["X"]),
            None
        );
    }
}
