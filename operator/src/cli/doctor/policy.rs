//! Validate stage of `doctor` (pure, no IO): the ClusterPolicy's own faults as its status
//! reports them, read before any node or pod.
//!
//! The operator writes what it could not do into the policy's status: `state`, the `Ready` and
//! `Error` conditions with a stable reason (crates/engine/src/status.rs, `reason`), and one
//! `components[]` entry per operand workload with a one-line message. A policy whose operator
//! never wrote a status, or wrote it for an older generation, has not been acted on. Only the
//! oldest policy is acted on; every other one is ignored. The checks here say each of these with
//! the command that shows it in full; a ready policy says nothing.

use gpu_operator_engine::status::{ERROR, READY, UNSUPPORTED, reason};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::ResourceExt;

use super::{Finding, Snapshot};
use crate::api::{ClusterPolicy, ComponentStatus, State};

pub const NO_POLICY: &str = "no-cluster-policy";
pub const POLICY_IGNORED: &str = "policy-ignored";
pub const POLICY_NOT_RECONCILED: &str = "policy-not-reconciled";
pub const POLICY_INVALID_CONFIG: &str = "policy-invalid-config";
pub const POLICY_OBJECT_REJECTED: &str = "policy-object-rejected";
pub const POLICY_RECONCILE_FAILED: &str = "policy-reconcile-failed";
pub const POLICY_ERROR: &str = "policy-error";
pub const POLICY_NOT_READY: &str = "policy-not-ready";
pub const POLICY_COMPONENT_NOT_READY: &str = "policy-component-not-ready";
/// A hint, not a fault: fields the policy sets that this operator does not act on.
pub const POLICY_FIELDS_NOT_ACTED_ON: &str = "policy-fields-not-acted-on";

/// The operator's Deployment (charts/gpu-operator: `gpu-operator.name`).
const OPERATOR_DEPLOYMENT: &str = "gpu-operator";

fn condition<'a>(policy: &'a ClusterPolicy, kind: &str) -> Option<&'a Condition> {
    policy
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == kind)
}

fn is_true(c: Option<&Condition>) -> bool {
    c.is_some_and(|c| c.status == "True")
}

/// The namespace the operator reports for its operands, else the one the doctor looked in.
fn namespace(snapshot: &Snapshot, policy: &ClusterPolicy) -> String {
    policy
        .status
        .as_ref()
        .and_then(|s| s.namespace.clone())
        .unwrap_or_else(|| snapshot.operator_namespace.clone())
}

/// The faults of the ClusterPolicies, in the order the doctor prints them first: none at all;
/// each ignored one; then the active one's status.
pub fn policy_findings(snapshot: &Snapshot) -> Vec<Finding> {
    let Some(active) = &snapshot.policy else {
        return vec![Finding {
            check: NO_POLICY,
            problem: "no ClusterPolicy: the operator deploys nothing".into(),
            fix: "kubectl get clusterpolicies; helm install gpu-operator charts/gpu-operator -n gpu-operator --create-namespace".into(),
        }];
    };
    let name = active.name_any();
    let mut out: Vec<Finding> = snapshot
        .other_policies
        .iter()
        .map(|p| ignored(p, Some(name.as_str())))
        .collect();
    // The active one may call itself ignored too (its status from before an older policy went).
    if active
        .status
        .as_ref()
        .is_some_and(|s| s.state == State::Ignored)
    {
        out.push(ignored(active, None));
        return out;
    }
    out.extend(active_findings(snapshot, active));
    out
}

fn ignored(policy: &ClusterPolicy, active: Option<&str>) -> Finding {
    let name = policy.name_any();
    let says = condition(policy, READY)
        .filter(|c| c.reason == reason::IGNORED && !c.message.is_empty())
        .map(|c| c.message.clone());
    let problem = match (says, active) {
        (Some(message), _) => format!("ClusterPolicy {name} is ignored: {message}"),
        (None, Some(active)) => format!(
            "ClusterPolicy {name} is ignored: ClusterPolicy {active} is the active one (the \
             oldest); the operator acts on one policy only"
        ),
        (None, None) => format!("ClusterPolicy {name} is ignored (its state is ignored)"),
    };
    let keep = active.map_or_else(|| "the active one".to_owned(), str::to_owned);
    Finding {
        check: POLICY_IGNORED,
        problem,
        fix: format!(
            "kubectl get clusterpolicies  (only the oldest is acted on); move what {name} sets \
             into {keep}, then kubectl delete clusterpolicy {name}"
        ),
    }
}

fn active_findings(snapshot: &Snapshot, policy: &ClusterPolicy) -> Vec<Finding> {
    let name = policy.name_any();
    let ns = namespace(snapshot, policy);
    let logs = format!("kubectl -n {ns} logs deploy/{OPERATOR_DEPLOYMENT} --tail=100");
    let Some(status) = &policy.status else {
        return vec![Finding {
            check: POLICY_NOT_RECONCILED,
            problem: format!(
                "ClusterPolicy {name} has no status: no operator has acted on it (is the operator \
                 running?)"
            ),
            fix: format!(
                "kubectl get deploy -A -l app.kubernetes.io/name={OPERATOR_DEPLOYMENT}; {logs}"
            ),
        }];
    };
    let mut out = Vec::new();
    let ready = condition(policy, READY);
    let error = condition(policy, ERROR);
    let generation = policy.metadata.generation;
    if let (Some(seen), Some(now)) = (ready.and_then(|c| c.observed_generation), generation)
        && seen < now
    {
        out.push(Finding {
            check: POLICY_NOT_RECONCILED,
            problem: format!(
                "ClusterPolicy {name}'s status describes generation {seen}, the policy is at \
                 {now}: the operator has not acted on its latest change (yet); what follows may \
                 be out of date"
            ),
            fix: format!("kubectl get clusterpolicy {name} -o yaml; {logs}"),
        });
    }
    let describe = format!("kubectl describe clusterpolicy {name}");
    let yaml = format!("kubectl get clusterpolicy {name} -o yaml");
    if let Some(error) = error.filter(|c| c.status == "True") {
        let (check, fix) = match error.reason.as_str() {
            reason::INVALID_CONFIG => (
                POLICY_INVALID_CONFIG,
                format!(
                    "{yaml}  (status.conditions and status.components name the field or \
                     ConfigMap key); kubectl edit clusterpolicy {name}  (the live objects stay as \
                     they were until it is valid)"
                ),
            ),
            reason::OBJECT_REJECTED => (
                POLICY_OBJECT_REJECTED,
                format!(
                    "{describe}  (its Events name the object and the API server's answer); \
                     correct what the message names in the policy, or the object it names"
                ),
            ),
            reason::RECONCILE_FAILED => (POLICY_RECONCILE_FAILED, format!("{logs}; {describe}")),
            _ => (POLICY_ERROR, format!("{describe}; {logs}")),
        };
        out.push(Finding {
            check,
            problem: format!(
                "ClusterPolicy {name} reports an error ({}): {}",
                error.reason, error.message
            ),
            fix,
        });
    }
    if status.state == State::Ready || is_true(ready) {
        return out;
    }
    let components: Vec<Finding> = status
        .components
        .iter()
        .flatten()
        .filter_map(|c| component_finding(policy, &ns, c, error))
        .collect();
    // Components say more than the Ready message that joins them; it stands alone when no
    // component names the cause (labels or objects in flight).
    let said_by_components =
        ready.is_some_and(|c| c.reason == reason::OPERAND_NOT_READY) && !components.is_empty();
    if !is_true(error) && !said_by_components {
        out.push(Finding {
            check: POLICY_NOT_READY,
            problem: match ready {
                Some(c) => format!(
                    "ClusterPolicy {name} is not ready ({}): {}",
                    c.reason, c.message
                ),
                None => format!("ClusterPolicy {name} is not ready (no Ready condition)"),
            },
            fix: format!("{describe}  (the checks below look at the nodes themselves)"),
        });
    }
    out.extend(components);
    out
}

/// A component whose message reports a problem, unless the Error condition already says it
/// (an invalid configuration, a rejected object).
fn component_finding(
    policy: &ClusterPolicy,
    ns: &str,
    component: &ComponentStatus,
    error: Option<&Condition>,
) -> Option<Finding> {
    let message = component_problem(component)?;
    let said = match error
        .filter(|c| c.status == "True")
        .map(|c| c.reason.as_str())
    {
        Some(reason::INVALID_CONFIG) => message.starts_with("invalid configuration"),
        Some(reason::OBJECT_REJECTED) => message.starts_with("frozen:"),
        _ => false,
    };
    if said {
        return None;
    }
    let fix = match &component.daemon_set {
        Some(ds) => format!(
            "kubectl -n {ns} describe daemonset {ds}; kubectl -n {ns} get pods -o wide | grep {ds}"
        ),
        None => format!(
            "kubectl get clusterpolicy {} -o jsonpath='{{.status.components}}'; kubectl -n {ns} \
             get deploy,pods -o wide",
            policy.name_any()
        ),
    };
    Some(Finding {
        check: POLICY_COMPONENT_NOT_READY,
        problem: format!(
            "ClusterPolicy {} component {}: {message}",
            policy.name_any(),
            component.name
        ),
        fix,
    })
}

/// The component's message when it reports a problem. A ready DaemonSet's message starts
/// `N/N pods ready` and a ready Deployment's `N/N replicas available`; anything else (pods not
/// available, a rollout, an invalid configuration, a frozen object, not created yet) or a failed
/// or held driver upgrade after it is a problem.
fn component_problem(component: &ComponentStatus) -> Option<String> {
    let Some(message) = component.message.as_deref().filter(|m| !m.is_empty()) else {
        let short = component.desired > 0 && component.available < component.desired;
        return short.then(|| {
            format!(
                "{} of {} pods available",
                component.available, component.desired
            )
        });
    };
    let first = message.split("; ").next().unwrap_or_default();
    let counts = |suffix: &str| -> Option<(u64, u64)> {
        let (have, want) = first.strip_suffix(suffix)?.split_once('/')?;
        Some((have.parse().ok()?, want.parse().ok()?))
    };
    let ready = counts(" pods ready").is_some_and(|(have, want)| have >= want)
        || counts(" replicas available").is_some_and(|(have, want)| have >= want);
    let upgrade = message
        .split_once("driver upgrade: ")
        .map(|(_, line)| line)
        .is_some_and(|line| line.contains(" failed: ") || line.contains(" held before"));
    (!ready || upgrade).then(|| message.to_owned())
}

/// Hints of the active policy: the fields it sets that this operator does not act on (never a
/// reason for a fault: the rest is acted on).
pub fn policy_hints(snapshot: &Snapshot) -> Vec<Finding> {
    let Some(policy) = &snapshot.policy else {
        return Vec::new();
    };
    condition(policy, UNSUPPORTED)
        .filter(|c| c.status == "True" && c.reason == reason::NOT_ACTED_ON)
        .map(|c| Finding {
            check: POLICY_FIELDS_NOT_ACTED_ON,
            problem: format!(
                "ClusterPolicy {} sets fields this operator does not act on: {}",
                policy.name_any(),
                c.message
            ),
            fix: "none needed for GPU pods to run: these fields change nothing; remove them \
                  from the policy if they were meant to"
                .into(),
        })
        .into_iter()
        .collect()
}
