//! Taking over a fleet NVIDIA's operator runs (pure): what applying our render over the
//! DaemonSets NVIDIA's operator created would change, and what each change restarts.
//!
//! The apply is server-side: fields our render does not name keep their live values (NVIDIA's
//! extra labels and volumes stay), list elements merge by their key (`name`, `mountPath`), so a
//! live pod template changes only where ours names a field with another value or an element
//! NVIDIA's lacks. Where it changes, a RollingUpdate DaemonSet replaces its pods; the driver's
//! (OnDelete) keeps them, and its pods are judged by NVIDIA's driver config digest
//! (operands::nvidia_digest): the installation they run is the one we render, or the driver
//! upgrade reinstalls it node by node.

use k8s_openapi::api::apps::v1::DaemonSet;
use serde_json::Value;

use crate::json_diff::{self, Difference, Rules};
use crate::operands::{driver, nvidia_digest};

/// How a live template compares with ours: as the server-side apply would merge it.
const AS_APPLIED: Rules = Rules {
    zero_is_absent: true,
    merge_keyed_lists: true,
    extra_keys_count: never,
};

fn never(_: &str) -> bool {
    false
}

/// What taking over one DaemonSet does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Ours has no DaemonSet of that name yet: created (its pods start).
    Created,
    /// Adopted with its pod template as it is: nothing restarts.
    Unchanged,
    /// The template changes and the DaemonSet's RollingUpdate replaces every pod.
    PodsRoll,
    /// The template changes; the DaemonSet is OnDelete, so its pods stay until deleted.
    PodsStay,
    /// The driver's template changes; its pods stay (OnDelete). `installation_kept`: NVIDIA's
    /// digest of our template equals the one the pods carry, so they run what we render.
    Driver { installation_kept: bool },
    /// NVIDIA's DaemonSet has no counterpart in our render (an operand we do not deploy, or
    /// one the policy disables): left to the owner reference (it goes with NVIDIA's policy).
    NotRendered,
}

/// One DaemonSet of the plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DaemonSetPlan {
    pub name: String,
    pub outcome: Outcome,
    /// The template fields that change, `path: ours <value>, live <value>`.
    pub changes: Vec<String>,
}

fn template(ds: &DaemonSet) -> Value {
    ds.spec
        .as_ref()
        .map(|s| serde_json::to_value(&s.template).unwrap_or(Value::Null))
        .unwrap_or(Value::Null)
}

fn describe(d: &Difference<'_>) -> String {
    let short = |v: &Value| {
        let text = v.to_string();
        match text.char_indices().nth(120) {
            Some((cut, _)) => format!("{}…", &text[..cut]),
            None => text,
        }
    };
    match d {
        Difference::Missing { path, wanted } => {
            format!("{path}: ours {}, live none", short(wanted))
        }
        Difference::Extra { path, found } => format!("{path}: ours none, live {}", short(found)),
        Difference::Length {
            path,
            wanted,
            found,
        }
        | Difference::Changed {
            path,
            wanted,
            found,
        } => format!("{path}: ours {}, live {}", short(wanted), short(found)),
    }
}

fn is_driver(ds: &DaemonSet) -> bool {
    ds.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(crate::operands::common::COMPONENT_LABEL))
        .is_some_and(|c| c == driver::COMPONENT)
}

fn on_delete(ds: &DaemonSet) -> bool {
    ds.spec
        .as_ref()
        .and_then(|s| s.update_strategy.as_ref())
        .and_then(|u| u.type_.as_deref())
        == Some("OnDelete")
}

/// The plan for `desired` (our render) over `live` (NVIDIA's DaemonSets), by name.
pub fn plan(desired: &[DaemonSet], live: &[DaemonSet]) -> Vec<DaemonSetPlan> {
    let name = |ds: &DaemonSet| ds.metadata.name.clone().unwrap_or_default();
    let mut out: Vec<DaemonSetPlan> = desired
        .iter()
        .map(|ours| {
            let Some(theirs) = live.iter().find(|l| name(l) == name(ours)) else {
                return DaemonSetPlan {
                    name: name(ours),
                    outcome: Outcome::Created,
                    changes: Vec::new(),
                };
            };
            let (wanted, found) = (template(ours), template(theirs));
            let changes: Vec<String> = json_diff::differences("", &wanted, &found, &AS_APPLIED)
                .iter()
                .map(describe)
                .collect();
            let outcome = if changes.is_empty() {
                Outcome::Unchanged
            } else if is_driver(ours) {
                let carried = theirs
                    .spec
                    .as_ref()
                    .and_then(|s| s.template.spec.as_ref())
                    .and_then(driver::carried_config_digest)
                    .map(str::to_owned);
                let ours_digest = ours
                    .spec
                    .as_ref()
                    .and_then(|s| s.template.spec.as_ref())
                    .map(nvidia_digest::digest);
                Outcome::Driver {
                    installation_kept: carried.is_some() && carried == ours_digest,
                }
            } else if on_delete(theirs) {
                Outcome::PodsStay
            } else {
                Outcome::PodsRoll
            };
            DaemonSetPlan {
                name: name(ours),
                outcome,
                changes,
            }
        })
        .collect();
    out.extend(
        live.iter()
            .filter(|l| !desired.iter().any(|d| name(d) == name(l)))
            .map(|l| DaemonSetPlan {
                name: name(l),
                outcome: Outcome::NotRendered,
                changes: Vec::new(),
            }),
    );
    out
}

/// The plan as the dry run prints it: one block per DaemonSet, its changes indented.
pub fn describe_plan(plan: &[DaemonSetPlan]) -> String {
    let mut text = String::new();
    for p in plan {
        let what = match &p.outcome {
            Outcome::Created => "created: its pods start".to_owned(),
            Outcome::Unchanged => "adopted as it is: nothing restarts".to_owned(),
            Outcome::PodsRoll => format!(
                "adopted, template changes in {} field(s): every pod is replaced",
                p.changes.len()
            ),
            Outcome::PodsStay => format!(
                "adopted, template changes in {} field(s); OnDelete: the pods stay until deleted",
                p.changes.len()
            ),
            Outcome::Driver {
                installation_kept: true,
            } => format!(
                "adopted, template changes in {} field(s); the driver pods stay (OnDelete) and \
                 already run the installation we render",
                p.changes.len()
            ),
            Outcome::Driver {
                installation_kept: false,
            } => format!(
                "adopted, template changes in {} field(s); the driver installation differs: the \
                 driver upgrade reinstalls it node by node",
                p.changes.len()
            ),
            Outcome::NotRendered => "not rendered here: goes with NVIDIA's policy".to_owned(),
        };
        text.push_str(&format!("DaemonSet {}: {what}\n", p.name));
        for change in &p.changes {
            text.push_str(&format!("  {change}\n"));
        }
    }
    text
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use serde_json::json;

    use super::*;

    fn daemon_set(name: &str, image: &str, strategy: &str) -> DaemonSet {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {
                "selector": {"matchLabels": {"app": name}},
                "updateStrategy": {"type": strategy},
                "template": {"spec": {"containers": [{"name": "c", "image": image}]}},
            },
        }))
        .unwrap()
    }

    #[test]
    fn a_changed_template_rolls_a_rolling_update_daemon_set_and_leaves_an_on_delete_ones_pods() {
        let ours = [
            daemon_set("plugin", "new", "RollingUpdate"),
            daemon_set("exporter", "new", "RollingUpdate"),
            daemon_set("same", "x", "RollingUpdate"),
            daemon_set("fresh", "x", "RollingUpdate"),
        ];
        let live = [
            daemon_set("plugin", "old", "RollingUpdate"),
            // A user's `daemonsets.updateStrategy: OnDelete` on NVIDIA's policy.
            daemon_set("exporter", "old", "OnDelete"),
            daemon_set("same", "x", "RollingUpdate"),
            daemon_set("gone", "x", "RollingUpdate"),
        ];
        let outcomes: Vec<(String, Outcome)> = plan(&ours, &live)
            .into_iter()
            .map(|p| (p.name, p.outcome))
            .collect();
        assert_eq!(
            outcomes,
            [
                ("plugin".to_owned(), Outcome::PodsRoll),
                ("exporter".to_owned(), Outcome::PodsStay),
                ("same".to_owned(), Outcome::Unchanged),
                ("fresh".to_owned(), Outcome::Created),
                ("gone".to_owned(), Outcome::NotRendered),
            ]
        );
    }
}
