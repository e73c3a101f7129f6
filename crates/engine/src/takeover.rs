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
//!
//! Where every difference is one that changes nothing a pod runs ([`inert`]: a pod label or
//! annotation, the name of the script ConfigMap of the same role, a command named by another
//! path, a default the API server fills), the DaemonSet keeps NVIDIA's template
//! ([`keep_adopted_template`]) until our render of it changes: a takeover restarts nothing for
//! a difference of implementation, and the next real change brings ours.

use std::collections::BTreeMap;
use std::path::Path;

use k8s_openapi::api::apps::v1::DaemonSet;
use serde_json::Value;

use crate::json_diff::{self, Difference, Rules};
use crate::operands::{driver, nvidia_digest};
use crate::plan::{APPLIED_HASH_ANNOTATION, applied_hash};

/// On a DaemonSet adopted with the pod template NVIDIA's operator gave it: the hash of our
/// template at adoption. While our render's template hashes the same, the live one is kept;
/// when ours changes, ours is applied (and its pods roll as for any change of ours).
pub const TEMPLATE_KEPT_ANNOTATION: &str = "nvidia.com/gpu-operator.template-kept";

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
    /// Adopted keeping NVIDIA's template: every difference changes nothing the pods run
    /// ([`inert`]); ours replaces it at the next change of our render.
    Kept,
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

fn selector(ds: &DaemonSet) -> BTreeMap<String, String> {
    ds.spec
        .as_ref()
        .and_then(|s| s.selector.match_labels.clone())
        .unwrap_or_default()
}

/// Whether the volume mounted at `mount_path` in `template` is one the kubelet mounts
/// read-only whatever the mount says (a ConfigMap, Secret, projected or downward API volume).
fn read_only_volume(template: &Value, mount_path: &str) -> bool {
    let spec = &template["spec"];
    let containers = ["containers", "initContainers"]
        .iter()
        .filter_map(|k| spec[k].as_array())
        .flatten();
    let volume = containers
        .filter_map(|c| c["volumeMounts"].as_array())
        .flatten()
        .find(|m| m["mountPath"] == mount_path)
        .and_then(|m| m["name"].as_str());
    let Some(volume) = volume else { return false };
    spec["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["name"] == volume)
        .is_some_and(|v| {
            ["configMap", "secret", "projected", "downwardAPI"]
                .iter()
                .any(|k| v.get(k).is_some())
        })
}

/// Why a difference between our pod template (`ours`) and NVIDIA's changes nothing a pod runs,
/// or `None` when it may (an image, an argument, an environment value, a host path, a
/// privilege, a resource: every field not named here). `selector` is the DaemonSet's;
/// `nvidias_digest_of_ours` is NVIDIA's driver config digest of our driver template.
pub fn inert(
    d: &Difference<'_>,
    ours: &Value,
    selector: &BTreeMap<String, String>,
    nvidias_digest_of_ours: Option<&str>,
) -> Option<&'static str> {
    let path = d.path();
    if let Some(key) = path.strip_prefix(".metadata.labels.") {
        return (!selector.contains_key(key)).then_some("a pod label outside the selector");
    }
    if path == ".metadata.labels" {
        let outside = |v: &Value| {
            v.as_object()
                .is_some_and(|m| m.keys().all(|k| !selector.contains_key(k)))
        };
        let only_outside = match d {
            Difference::Missing { wanted, .. } => outside(wanted),
            Difference::Extra { found, .. } => outside(found),
            _ => false,
        };
        return only_outside.then_some("pod labels outside the selector");
    }
    if path.starts_with(".metadata.annotations") {
        return Some("a pod annotation");
    }
    if path.starts_with(".spec.affinity") {
        return Some("where pods not yet scheduled may go");
    }
    if path.starts_with(".spec.volumes[") && path.ends_with("].configMap.name") {
        return Some("the name of the script ConfigMap of the same role");
    }
    let found = match d {
        Difference::Changed { found, .. } | Difference::Length { found, .. } => Some(*found),
        Difference::Extra { found, .. } => Some(*found),
        Difference::Missing { .. } => None,
    };
    let wanted = match d {
        Difference::Changed { wanted, .. }
        | Difference::Length { wanted, .. }
        | Difference::Missing { wanted, .. } => Some(*wanted),
        Difference::Extra { .. } => None,
    };
    if path.ends_with("command[0]") {
        fn base(v: Option<&Value>) -> Option<&std::ffi::OsStr> {
            v.and_then(Value::as_str)
                .and_then(|p| Path::new(p).file_name())
        }
        return (base(wanted).is_some() && base(wanted) == base(found))
            .then_some("the same executable named by another path");
    }
    if path.ends_with("].protocol")
        && found.is_none()
        && wanted.and_then(Value::as_str) == Some("TCP")
    {
        return Some("the API server's default");
    }
    if path.ends_with(&format!("env[name={}].value", driver::CONFIG_DIGEST_ENV)) {
        return (nvidias_digest_of_ours.is_some()
            && found.and_then(Value::as_str) == nvidias_digest_of_ours)
            .then_some("NVIDIA's digest of the same driver configuration");
    }
    if let Some(rest) = path.split_once("volumeMounts[mountPath=").map(|(_, r)| r)
        && let Some(mount_path) = rest.strip_suffix("].readOnly")
    {
        return read_only_volume(ours, mount_path)
            .then_some("a volume the kubelet mounts read-only anyway");
    }
    None
}

/// One template difference as the plan prints it, with why it changes nothing when it does not.
fn described(d: &Difference<'_>, reason: Option<&str>) -> String {
    match reason {
        Some(reason) => format!("{} (changes nothing run: {reason})", describe(d)),
        None => describe(d),
    }
}

fn nvidias_digest_of(ds: &DaemonSet) -> Option<String> {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .filter(|_| is_driver(ds))
        .map(nvidia_digest::digest)
}

/// Whether `d` is the driver config digest's env var.
fn is_digest(d: &Difference<'_>) -> bool {
    d.path()
        .ends_with(&format!("env[name={}].value", driver::CONFIG_DIGEST_ENV))
}

/// Every difference between our template and the live one, each with [`inert`]'s reason.
/// The driver config digest is a function of the template: where it is the only difference
/// that is not inert, the rest of what it digests is the same, and it differs by algorithm
/// alone (ours is not NVIDIA's, docs/operand-facts.md §5.0).
fn template_differences(ours: &DaemonSet, live: &DaemonSet) -> Vec<(String, bool)> {
    let (wanted, found) = (template(ours), template(live));
    let selector = selector(ours);
    let digest = nvidias_digest_of(ours);
    let differences = json_diff::differences("", &wanted, &found, &AS_APPLIED);
    let reasons: Vec<Option<&str>> = differences
        .iter()
        .map(|d| inert(d, &wanted, &selector, digest.as_deref()))
        .collect();
    let digest_alone = differences
        .iter()
        .zip(&reasons)
        .all(|(d, reason)| reason.is_some() || is_digest(d));
    differences
        .iter()
        .zip(reasons)
        .map(|(d, reason)| {
            let reason = reason.or((digest_alone && is_digest(d)).then_some(
                "the same driver configuration digested by another algorithm (nothing else \
                 it digests differs)",
            ));
            (described(d, reason), reason.is_some())
        })
        .collect()
}

/// The hash of our pod template, as [`TEMPLATE_KEPT_ANNOTATION`] records it.
pub fn template_hash(ds: &DaemonSet) -> String {
    applied_hash(&template(ds)).unwrap_or_default()
}

/// What we send for `desired` when the live DaemonSet keeps NVIDIA's pod template: `desired`
/// with the live template and [`TEMPLATE_KEPT_ANNOTATION`], or `None` to send ours. Kept while
/// the annotation's hash equals our template's; first kept when the live DaemonSet was never
/// applied by us (NVIDIA's) and every difference is [`inert`].
pub fn keep_adopted_template(desired: &DaemonSet, live: &DaemonSet) -> Option<DaemonSet> {
    let annotations = live.metadata.annotations.as_ref();
    let hash = match annotations.and_then(|a| a.get(TEMPLATE_KEPT_ANNOTATION)) {
        Some(recorded) => Some(template_hash(desired)).filter(|h| h == recorded)?,
        // Ours since we first applied it: the common case, decided without a comparison.
        None if annotations.is_some_and(|a| a.contains_key(APPLIED_HASH_ANNOTATION)) => {
            return None;
        }
        None => {
            let differences = template_differences(desired, live);
            if differences.is_empty() || !differences.iter().all(|(_, inert)| *inert) {
                return None;
            }
            template_hash(desired)
        }
    };
    let template = live.spec.as_ref()?.template.clone();
    let mut sent = desired.clone();
    sent.spec.as_mut()?.template = template;
    sent.metadata
        .annotations
        .get_or_insert_default()
        .insert(TEMPLATE_KEPT_ANNOTATION.to_owned(), hash);
    Some(sent)
}

/// The status note naming the DaemonSets that still run the pod template NVIDIA's operator
/// gave them ([`keep_adopted_template`]), so that what runs is never silently not ours.
pub fn kept_templates_note<'a>(
    daemon_sets: impl IntoIterator<Item = &'a DaemonSet>,
) -> Option<String> {
    let kept: Vec<String> = daemon_sets
        .into_iter()
        .filter(|d| {
            d.metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(TEMPLATE_KEPT_ANNOTATION))
        })
        .filter_map(|d| d.metadata.name.clone())
        .collect();
    (!kept.is_empty()).then(|| {
        format!(
            "DaemonSets {} keep the pod template NVIDIA's operator gave them: it differs from \
             ours only in fields that change nothing run, so adopting them restarted nothing; \
             ours replaces it at the next change of the policy (docs/migrate-from-nvidia.md)",
            kept.join(", ")
        )
    })
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
            let differences = template_differences(ours, theirs);
            let outcome = if differences.is_empty() {
                Outcome::Unchanged
            } else if keep_adopted_template(ours, theirs).is_some() {
                Outcome::Kept
            } else if is_driver(ours) {
                let carried = theirs
                    .spec
                    .as_ref()
                    .and_then(|s| s.template.spec.as_ref())
                    .and_then(driver::carried_config_digest)
                    .map(str::to_owned);
                Outcome::Driver {
                    installation_kept: carried.is_some() && carried == nvidias_digest_of(ours),
                }
            } else if on_delete(theirs) {
                Outcome::PodsStay
            } else {
                Outcome::PodsRoll
            };
            DaemonSetPlan {
                name: name(ours),
                outcome,
                changes: differences.into_iter().map(|(text, _)| text).collect(),
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
            Outcome::Kept => format!(
                "adopted keeping NVIDIA's template: its {} difference(s) from ours change \
                 nothing the pods run, so nothing restarts; ours replaces it at the next change \
                 of the policy",
                p.changes.len()
            ),
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
                "template": {
                    "metadata": {"labels": {"app": name}},
                    "spec": {"containers": [{"name": "c", "image": image}]},
                },
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

    fn with_template(mut ds: DaemonSet, patch: serde_json::Value) -> DaemonSet {
        let mut template = serde_json::to_value(&ds.spec.as_ref().unwrap().template).unwrap();
        json_patch_merge(&mut template, patch);
        ds.spec.as_mut().unwrap().template = serde_json::from_value(template).unwrap();
        ds
    }

    fn json_patch_merge(target: &mut Value, patch: Value) {
        match (target, patch) {
            (Value::Object(t), Value::Object(p)) => {
                for (k, v) in p {
                    json_patch_merge(t.entry(k).or_insert(Value::Null), v);
                }
            }
            (t, p) => *t = p,
        }
    }

    #[test]
    fn a_template_differing_only_in_labels_and_script_names_is_kept_and_one_with_another_image_is_not()
     {
        let nvidia = with_template(
            daemon_set("plugin", "img", "RollingUpdate"),
            json!({"spec": {"volumes": [{"name": "entry", "configMap": {"name": "plugin-entrypoint"}}]}}),
        );
        let ours = with_template(
            daemon_set("plugin", "img", "RollingUpdate"),
            json!({
                "metadata": {"labels": {"app.kubernetes.io/name": "device-plugin"},
                             "annotations": {"nvidia.com/gpu-operator.config-hash": "abc"}},
                "spec": {"volumes": [{"name": "entry", "configMap": {"name": "plugin-entrypoint-1234"}}]},
            }),
        );
        let sent = keep_adopted_template(&ours, &nvidia).expect("kept");
        assert_eq!(
            sent.spec.as_ref().unwrap().template,
            nvidia.spec.as_ref().unwrap().template
        );
        let hash = sent.metadata.annotations.as_ref().unwrap()[TEMPLATE_KEPT_ANNOTATION].clone();
        assert_eq!(hash, template_hash(&ours));
        assert_eq!(
            plan(std::slice::from_ref(&ours), std::slice::from_ref(&nvidia))[0].outcome,
            Outcome::Kept
        );

        // Once kept, it stays kept while our template is the same, and ours goes out when it
        // changes.
        let mut live = nvidia.clone();
        live.metadata = sent.metadata.clone();
        live.metadata
            .annotations
            .get_or_insert_default()
            .insert(APPLIED_HASH_ANNOTATION.to_owned(), "h".to_owned());
        assert!(keep_adopted_template(&ours, &live).is_some());
        let changed = with_template(
            ours.clone(),
            json!({"spec": {"containers": [{"name": "c", "image": "img2"}]}}),
        );
        assert!(keep_adopted_template(&changed, &live).is_none());

        // A difference in what runs is never kept.
        let other_image = with_template(
            ours,
            json!({"spec": {"containers": [{"name": "c", "image": "img2"}]}}),
        );
        assert!(keep_adopted_template(&other_image, &nvidia).is_none());
        assert_eq!(
            plan(&[other_image], &[nvidia])[0].outcome,
            Outcome::PodsRoll
        );
    }

    #[test]
    fn a_daemon_set_we_applied_before_is_not_taken_for_nvidias() {
        let mut live = daemon_set("plugin", "img", "RollingUpdate");
        live.metadata.annotations = Some(BTreeMap::from([(
            APPLIED_HASH_ANNOTATION.to_owned(),
            "h".to_owned(),
        )]));
        let ours = with_template(
            daemon_set("plugin", "img", "RollingUpdate"),
            json!({"metadata": {"labels": {"app.kubernetes.io/name": "device-plugin"}}}),
        );
        assert!(keep_adopted_template(&ours, &live).is_none());
    }

    #[test]
    fn inert_differences_are_the_ones_that_change_nothing_run() {
        let ours = json!({"spec": {
            "containers": [{"name": "c", "volumeMounts": [
                {"name": "probe", "mountPath": "/probe.sh"}, {"name": "host", "mountPath": "/host"}]}],
            "volumes": [{"name": "probe", "configMap": {"name": "p"}}, {"name": "host", "hostPath": {"path": "/"}}],
        }});
        let selector = BTreeMap::from([("app".to_owned(), "x".to_owned())]);
        let (sh, bin_sh, bash) = (json!("sh"), json!("/bin/sh"), json!("/bin/bash"));
        let (t, f) = (json!(true), json!(false));
        let changed =
            |path: &str, wanted: &'static Value, found: &'static Value| Difference::Changed {
                path: path.to_owned(),
                wanted,
                found,
            };
        let leak = |v: Value| -> &'static Value { Box::leak(Box::new(v)) };
        let cases: Vec<(Difference<'static>, bool)> = vec![
            (
                changed(
                    ".metadata.labels.app.kubernetes.io/name",
                    leak(json!("a")),
                    leak(json!("b")),
                ),
                true,
            ),
            (
                changed(".metadata.labels.app", leak(json!("a")), leak(json!("b"))),
                false,
            ),
            (
                changed(
                    ".spec.containers[name=c].command[0]",
                    leak(sh.clone()),
                    leak(bin_sh.clone()),
                ),
                true,
            ),
            (
                changed(".spec.containers[name=c].command[0]", leak(sh), leak(bash)),
                false,
            ),
            (
                changed(
                    ".spec.containers[name=c].image",
                    leak(bin_sh),
                    leak(json!("x")),
                ),
                false,
            ),
            (
                changed(
                    ".spec.containers[name=c].volumeMounts[mountPath=/probe.sh].readOnly",
                    leak(t.clone()),
                    leak(f.clone()),
                ),
                true,
            ),
            (
                changed(
                    ".spec.containers[name=c].volumeMounts[mountPath=/host].readOnly",
                    leak(t),
                    leak(f),
                ),
                false,
            ),
            (
                Difference::Missing {
                    path: ".spec.containers[name=c].ports[name=m].protocol".to_owned(),
                    wanted: leak(json!("TCP")),
                },
                true,
            ),
            (
                changed(
                    ".spec.containers[name=c].env[name=DRIVER_CONFIG_DIGEST].value",
                    leak(json!("ours")),
                    leak(json!("123")),
                ),
                true,
            ),
            (
                changed(
                    ".spec.containers[name=c].env[name=DRIVER_CONFIG_DIGEST].value",
                    leak(json!("ours")),
                    leak(json!("999")),
                ),
                false,
            ),
        ];
        for (d, expected) in cases {
            assert_eq!(
                inert(&d, &ours, &selector, Some("123")).is_some(),
                expected,
                "{d:?}"
            );
        }
    }
}
