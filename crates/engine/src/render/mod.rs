//! Render stage (pure, no IO): `ValidatedPolicy` + `ClusterFacts` -> `DesiredState`, typed
//! k8s-openapi objects; each operand's objects come from its home in [`crate::operands`].
//!
//! Every object carries the label contract of [`crate::model`]. An operand whose outcome is
//! `Invalid` keeps its live objects untouched and out of pruning (decision 8).

pub mod inputs;
pub mod rbac;
mod yaml;

#[cfg(test)]
mod change_tests;
#[cfg(test)]
mod invariant_tests;
#[cfg(test)]
mod operand_tests;

use serde_json::Value;

use crate::api::ImageKind;
use crate::facts::ClusterFacts;
use crate::model::{Operand, OperandObjects, ValidatedPolicy};
use crate::operands;

/// What render decided for one operand.
// A dozen of these per pass: boxing the rendered objects would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum Outcome {
    /// Turned off (or not applicable, e.g. NFD already running): its objects are pruned.
    Disabled,
    /// The objects to apply; owned objects of this operand not among them are pruned.
    Rendered(OperandObjects),
    /// The policy's input for this operand is invalid (message names the field and the fix):
    /// its live objects are left exactly as they are.
    Invalid(String),
}

#[derive(Clone, Debug)]
pub struct OperandState {
    pub operand: Operand,
    pub outcome: Outcome,
}

/// Everything one reconcile pass wants in the cluster, per operand, in apply order.
#[derive(Clone, Debug, Default)]
pub struct DesiredState {
    pub operands: Vec<OperandState>,
}

/// Renders every operand, in [`Operand::ALL`] order: `Invalid` when validate recorded a
/// problem with its input, `Disabled` when it is off (or not applicable, e.g. NFD already
/// running), else its objects.
///
/// The driver needs the GPU nodes' OS for its image tag: while no GPU node is known, validate
/// marks it invalid (live objects kept, nothing pruned) unless the image is pinned by digest;
/// every other operand renders without node facts.
pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> DesiredState {
    let operands = Operand::ALL
        .into_iter()
        .map(|operand| OperandState {
            operand,
            outcome: outcome(operand, policy, facts),
        })
        .collect();
    DesiredState { operands }
}

fn outcome(operand: Operand, policy: &ValidatedPolicy, facts: &ClusterFacts) -> Outcome {
    if let Some(message) = policy.invalid.get(&operand) {
        return Outcome::Invalid(message.clone());
    }
    if !operand.is_enabled(&policy.spec, facts) {
        return Outcome::Disabled;
    }
    let missing: Vec<&str> = operand
        .images(&policy.spec, policy.sharing.is_some())
        .into_iter()
        .filter(|kind| !policy.images.contains_key(kind))
        .map(ImageKind::field_path)
        .collect();
    if !missing.is_empty() {
        // validate resolves these for every enabled operand; a policy built another way may not.
        return Outcome::Invalid(format!(
            "no resolved image for {}: run validate on the policy before render",
            missing.join(", ")
        ));
    }
    match operands::render(operand, policy, facts) {
        Some(objects) => Outcome::Rendered(objects),
        None => Outcome::Disabled,
    }
}

impl DesiredState {
    /// Every rendered object as JSON, in operand order then kind order.
    pub fn to_json(&self) -> Result<Vec<Value>, serde_json::Error> {
        let mut out = Vec::new();
        for state in &self.operands {
            if let Outcome::Rendered(objects) = &state.outcome {
                out.extend(objects.to_json()?);
            }
        }
        Ok(out)
    }

    /// The state as multi-document YAML, stable from run to run: a comment line for each
    /// operand whose input is invalid, then every rendered object (operand order, then kind
    /// order). Owner references are omitted when the facts had none.
    pub fn to_yaml(&self) -> Result<String, serde_yaml_ng::Error> {
        let mut out = String::new();
        for state in &self.operands {
            if let Outcome::Invalid(message) = &state.outcome {
                for (i, line) in message.lines().enumerate() {
                    let lead = if i == 0 {
                        format!("# {} not rendered (invalid input): ", state.operand.name())
                    } else {
                        "#   ".to_owned()
                    };
                    out.push_str(&lead);
                    out.push_str(line);
                    out.push('\n');
                }
            }
        }
        let objects = self
            .to_json()
            .map_err(<serde_yaml_ng::Error as serde::ser::Error>::custom)?;
        for object in objects {
            out.push_str("---\n");
            out.push_str(&yaml::document(object)?);
        }
        Ok(out)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
pub(crate) mod tests {
    use super::*;
    use crate::api::{ClusterPolicy, ClusterPolicySpec};

    /// The facts most tests use: containerd, Ubuntu 22.04 GPU nodes, namespace gpu-operator.
    pub(crate) fn facts() -> ClusterFacts {
        ClusterFacts {
            namespace: "gpu-operator".to_owned(),
            os_tag: Some("ubuntu22.04".to_owned()),
            ..ClusterFacts::default()
        }
    }

    /// A policy with `spec` given as YAML, validated against [`facts`].
    pub(crate) fn policy(spec: &str) -> ValidatedPolicy {
        policy_with(spec, &facts())
    }

    /// A policy with `spec` given as YAML, validated against `facts`.
    pub(crate) fn policy_with(spec: &str, facts: &ClusterFacts) -> ValidatedPolicy {
        let spec: ClusterPolicySpec = serde_yaml_ng::from_str(spec).unwrap();
        crate::validate::validate(&ClusterPolicy::new("cluster-policy", spec), facts)
    }

    /// The rendered objects of `operand`, panicking when it is not rendered.
    pub(crate) fn rendered(state: &DesiredState, operand: Operand) -> OperandObjects {
        let found = state
            .operands
            .iter()
            .find(|s| s.operand == operand)
            .unwrap();
        match &found.outcome {
            Outcome::Rendered(objects) => objects.clone(),
            other => panic!("{} is {other:?}", operand.name()),
        }
    }
}
