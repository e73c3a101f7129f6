//! Container environment: setting, merging the user's variables, MIG settings (render stage,
//! pure).

use k8s_openapi::api::core::v1::{EnvVar, EnvVarSource, ObjectFieldSelector};

use super::*;
use crate::api::{ClusterPolicySpec, MigStrategy};

/// `name=value`.
pub fn env(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: Some(value.to_owned()),
        value_from: None,
    }
}

/// `name` from a pod field (`spec.nodeName`, `metadata.namespace`, ...).
pub fn env_field(name: &str, field_path: &str) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                api_version: None,
                field_path: field_path.to_owned(),
            }),
            ..EnvVarSource::default()
        }),
    }
}

/// Sets `var` in place if a variable of that name exists, else appends it (NVIDIA's
/// set-or-append, which keeps a variable's position stable).
pub fn set_env(envs: &mut Vec<EnvVar>, var: EnvVar) {
    match envs.iter_mut().find(|e| e.name == var.name) {
        Some(existing) => *existing = var,
        None => envs.push(var),
    }
}

/// Set-or-appends each of the user's variables (an absent value is the empty string).
pub fn merge_user_env(envs: &mut Vec<EnvVar>, user: Option<&Vec<crate::api::EnvVar>>) {
    for var in user.into_iter().flatten() {
        set_env(
            envs,
            env(&var.name, var.value.as_deref().unwrap_or_default()),
        );
    }
}

/// The literal value of `name` in `envs`, if set.
pub fn env_value<'a>(envs: &'a [EnvVar], name: &str) -> Option<&'a str> {
    envs.iter()
        .find(|e| e.name == name)
        .and_then(|e| e.value.as_deref())
}

/// The MIG variables of the device plugin, MPS daemon and GFD (docs/operand-facts.md §1 "MIG env rule").
pub fn mig_env(spec: &ClusterPolicySpec) -> Vec<EnvVar> {
    match mig_strategy(spec) {
        None => vec![env("NVIDIA_MIG_MONITOR_DEVICES", "all")],
        Some(MigStrategy::None) => vec![env("MIG_STRATEGY", "none")],
        Some(s @ (MigStrategy::Single | MigStrategy::Mixed)) => vec![
            env("MIG_STRATEGY", mig_strategy_name(s)),
            env("NVIDIA_MIG_MONITOR_DEVICES", "all"),
        ],
    }
}

/// The value the plugins expect for a strategy.
pub const fn mig_strategy_name(strategy: MigStrategy) -> &'static str {
    match strategy {
        MigStrategy::None => "none",
        MigStrategy::Single => "single",
        MigStrategy::Mixed => "mixed",
    }
}
