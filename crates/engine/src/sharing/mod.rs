//! Validate stage (pure, no IO): GPU sharing configs, checked before they reach any node.
//!
//! - [`device_plugin`]: one key of the device plugin's ConfigMap (`version: v1`, time-slicing,
//!   MPS), accepted and rejected exactly as the pinned plugin does (decision 5), with warnings
//!   for what the plugin silently ignores.
//! - [`select`]: which keys apply (the default, an inferred default, per-node labels) and whether
//!   the whole ConfigMap may replace the last good copy (decision 4).
//! - [`mig`] and [`mig_profiles`]: mig-parted layouts, parsed as mig-parted does and checked
//!   per GPU model against its MIG profiles and placement rules (decision 7).
//! - [`vgpu`]: the vGPU device manager's configs (`vgpu-configs`), checked before rollout.
//!
//! The facts these modules restate are in [docs/config-facts.md](../../../docs/config-facts.md).

pub mod device_plugin;
pub mod mig;
pub mod mig_profiles;
mod problems;
pub mod select;
pub mod vgpu;
mod yaml;

use std::fmt;

/// Why a config is refused; a stable short word for Events and metric labels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProblemReason {
    /// The text is not YAML.
    InvalidYaml,
    /// `version` is not `v1`.
    UnknownVersion,
    /// A value has the wrong type (a string where a number belongs, ...).
    WrongType,
    /// A required field is missing.
    MissingField,
    /// A value is outside what the tool accepts.
    InvalidValue,
    /// `replicas` below 2.
    InvalidReplicas,
    /// A resource name that is not `nvidia.com/<DNS subdomain>`.
    InvalidResourceName,
    /// MPS sharing under MIG strategy `mixed`.
    MpsWithMixedMig,
    /// The ConfigMap has no keys.
    NoKeys,
    /// Several keys and no `devicePlugin.config.default`.
    NoDefault,
    /// `devicePlugin.config.default` names a key the ConfigMap lacks.
    MissingDefaultKey,
    /// A node label names a key the ConfigMap lacks.
    MissingNodeKey,
    /// The ConfigMap lacks the key a tool reads (`config.yaml` for mig-manager).
    MissingConfigKey,
    /// A mig-parted field that mig-parted does not know.
    UnexpectedField,
    /// A MIG profile name that fails mig-parted's grammar.
    InvalidMigProfile,
}

impl ProblemReason {
    /// The stable short form, in `UpperCamelCase`.
    pub const fn as_str(self) -> &'static str {
        match self {
            ProblemReason::InvalidYaml => "InvalidYaml",
            ProblemReason::UnknownVersion => "UnknownVersion",
            ProblemReason::WrongType => "WrongType",
            ProblemReason::MissingField => "MissingField",
            ProblemReason::InvalidValue => "InvalidValue",
            ProblemReason::InvalidReplicas => "InvalidReplicas",
            ProblemReason::InvalidResourceName => "InvalidResourceName",
            ProblemReason::MpsWithMixedMig => "MpsWithMixedMig",
            ProblemReason::NoKeys => "NoKeys",
            ProblemReason::NoDefault => "NoDefault",
            ProblemReason::MissingDefaultKey => "MissingDefaultKey",
            ProblemReason::MissingNodeKey => "MissingNodeKey",
            ProblemReason::MissingConfigKey => "MissingConfigKey",
            ProblemReason::UnexpectedField => "UnexpectedField",
            ProblemReason::InvalidMigProfile => "InvalidMigProfile",
        }
    }
}

/// One reason a sharing or MIG config cannot be used, located precisely enough to fix it:
/// `ConfigMap time-slicing-config, key "any": sharing.timeSlicing.resources[0].replicas is 0;
/// it must be at least 2 (...)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigProblem {
    /// The user's ConfigMap.
    pub config_map: String,
    /// The ConfigMap key, when the problem is inside one.
    pub key: Option<String>,
    /// Dotted path of the field inside the key's document, when there is one.
    pub field: Option<String>,
    /// What is wrong and how to fix it; reads on from the field.
    pub message: String,
    pub reason: ProblemReason,
}

impl ConfigProblem {
    /// The stable short reason, for Events and metric labels.
    pub const fn reason(&self) -> &'static str {
        self.reason.as_str()
    }
}

impl fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&located(
            &self.config_map,
            self.key.as_deref(),
            self.field.as_deref(),
            &self.message,
        ))
    }
}

impl std::error::Error for ConfigProblem {}

/// `ConfigMap <cm>, key "<key>": <field> <message>`, leaving out the parts that are absent.
pub(crate) fn located(
    config_map: &str,
    key: Option<&str>,
    field: Option<&str>,
    message: &str,
) -> String {
    let mut out = format!("ConfigMap {config_map}");
    if let Some(key) = key {
        out.push_str(&format!(", key {key:?}"));
    }
    out.push_str(": ");
    if let Some(field) = field.filter(|f| !f.is_empty()) {
        out.push_str(field);
        out.push(' ');
    }
    out.push_str(message);
    out
}

/// The closest of `candidates` to `word` when it is close enough to be a likely typo.
pub(crate) fn suggest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let lower = word.to_ascii_lowercase();
    candidates
        .iter()
        .map(|c| (edit_distance(&lower, &c.to_ascii_lowercase()), *c))
        .filter(|(d, c)| *d <= 2.max(c.len() / 5))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut current = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let substitution = previous[j] + usize::from(ca != *cb);
            current.push(substitution.min(previous[j + 1] + 1).min(current[j] + 1));
        }
        previous = current;
    }
    previous[b.len()]
}

/// `a, b and c` for messages; `none` when empty.
pub(crate) fn list_words<S: AsRef<str>>(items: &[S]) -> String {
    match items {
        [] => "none".to_string(),
        [one] => one.as_ref().to_string(),
        [init @ .., last] => format!(
            "{} and {}",
            init.iter()
                .map(AsRef::as_ref)
                .collect::<Vec<_>>()
                .join(", "),
            last.as_ref()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problem_message_names_config_map_key_and_field() {
        let p = ConfigProblem {
            config_map: "time-slicing-config".into(),
            key: Some("any".into()),
            field: Some("sharing.timeSlicing.resources[0].replicas".into()),
            message: "is 0; it must be at least 2".into(),
            reason: ProblemReason::InvalidReplicas,
        };
        assert_eq!(
            p.to_string(),
            "ConfigMap time-slicing-config, key \"any\": sharing.timeSlicing.resources[0].replicas is 0; it must be at least 2"
        );
        assert_eq!(p.reason(), "InvalidReplicas");
    }

    #[test]
    fn suggestions_catch_typos_and_case() {
        assert_eq!(suggest("sharring", &["sharing", "flags"]), Some("sharing"));
        assert_eq!(
            suggest("renamebydefault", &["renameByDefault", "resources"]),
            Some("renameByDefault")
        );
        assert_eq!(suggest("zzz", &["sharing", "flags"]), None);
    }

    #[test]
    fn word_lists_read_naturally() {
        assert_eq!(list_words::<&str>(&[]), "none");
        assert_eq!(list_words(&["a"]), "a");
        assert_eq!(list_words(&["a", "b", "c"]), "a, b and c");
    }
}
