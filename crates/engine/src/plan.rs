//! Apply stage, planning (pure): for one rendered object and what the cache shows of it, whether
//! to send it (decision 9).
//!
//! An object is skipped only when what we would send is what we last sent *and* every field we
//! set still holds our value. The first half is a SHA-256 of the rendered object, stored on it
//! as [`APPLIED_HASH_ANNOTATION`]: a field we stop rendering changes the hash, so the apply that
//! follows removes it (server-side apply drops fields our manager owned and no longer sends).
//! The second half is a structural subset test of the rendered object against the live one,
//! which undoes a hand edit of a field we set and leaves alone what others added.
//!
//! A [`Ledger`] remembers, per object, the last write and its outcome, so that a cache that has
//! not caught up with our own write does not make us send the same object again, and an object
//! the API server refused is not resent until its rendering changes.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::Value;

use crate::json_diff::{self, Difference, Rules};
use crate::model::{MANAGED_BY_LABEL, MANAGER};
use crate::operands::common::sha256_hex;

/// Annotation on every applied object: the SHA-256 of the object as rendered (before the
/// annotation was added). Equal hashes mean equal renderings, whichever operator version made
/// them, so an upgrade that renders the same objects rolls nothing.
pub const APPLIED_HASH_ANNOTATION: &str = "nvidia.com/gpu-operator.applied-hash";

/// The stable hash of a rendered object: SHA-256 of its JSON form (a `serde_json::Value` keeps
/// its maps sorted), so equal objects give equal hashes.
pub fn applied_hash(rendered: &Value) -> Result<String, serde_json::Error> {
    Ok(sha256_hex(&serde_json::to_vec(rendered)?))
}

/// Whether every field set in `desired` has the same value in `live`. Maps are compared key by
/// key (live may have more: server defaults, other managers). Lists of objects that all carry a
/// unique key (`mountPath`, `devicePath`, `uid` or `name`, as server-side apply merges them) are
/// matched by that key, and live may hold more elements (a container or variable another
/// manager added is theirs); other lists are ours as a whole and must match element by element.
/// A zero value we set (`""`, `false`, `0`, empty list or map) matches an absent field: the API
/// server omits them.
pub fn is_subset(desired: &Value, live: &Value) -> bool {
    first_difference(desired, live, "").is_none()
}

/// How the plan compares: zero values equal absent, merge-keyed lists, extra live keys fine.
pub const PLAN_RULES: Rules = Rules {
    zero_is_absent: true,
    merge_keyed_lists: true,
    extra_keys_count: |_| false,
};

/// The JSON path of the first field of `desired` that `live` does not hold, by the rules of
/// [`is_subset`] (also for logs: an object that is re-applied on every pass shows why here).
pub fn first_difference(desired: &Value, live: &Value, path: &str) -> Option<String> {
    Some(
        match json_diff::first_difference(path, desired, live, &PLAN_RULES)? {
            Difference::Missing { path, .. } => format!("{path} (absent live)"),
            Difference::Length {
                path,
                wanted,
                found,
            } => format!(
                "{path} (length {} vs {} live)",
                wanted.as_array().map_or(0, Vec::len),
                found.as_array().map_or(0, Vec::len)
            ),
            Difference::Changed {
                path,
                wanted,
                found,
            } => format!("{path}: {wanted} vs {found} live"),
            Difference::Extra { path, .. } => format!("{path} (not ours)"),
        },
    )
}

/// Annotation by which a user hands an existing object to this operator (decision 19): with
/// `true` it counts as ours and is applied, labelled and owned like one we created.
pub const ADOPT_ANNOTATION: &str = "nvidia.com/gpu-operator.adopt";

/// Whether a live object with a name we render is ours to write (decision 19): it carries our
/// managed-by label, an owner reference to `owner_uid` (the active policy: NVIDIA's operands
/// that policy owns are taken over, not adopted), or a user's [`ADOPT_ANNOTATION`]. Anything
/// else (a RuntimeClass `nvidia` k3s made, a ConfigMap someone left) is never written: a
/// forced apply would take it over and garbage collection would delete it with the policy.
pub fn is_ours(meta: &ObjectMeta, owner_uid: Option<&str>) -> bool {
    let labelled = meta
        .labels
        .as_ref()
        .and_then(|l| l.get(MANAGED_BY_LABEL))
        .is_some_and(|v| v == MANAGER);
    let owned =
        owner_uid.is_some_and(|uid| meta.owner_references.iter().flatten().any(|r| r.uid == uid));
    let adopted = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(ADOPT_ANNOTATION))
        .is_some_and(|v| v == "true");
    labelled || owned || adopted
}

/// What the cache shows of one object.
#[derive(Clone, Copy, Debug)]
pub struct Live<'a> {
    pub object: &'a Value,
    pub resource_version: Option<&'a str>,
}

/// Why the API server refused an object: its operand is frozen (decision 18). An invalid
/// object (400, 422) stays refused until the rendering changes; any other refusal (403 from
/// admission, such as an owner kind whose CRD the API server is still registering, a quota or
/// a terminating namespace; 404) can pass later, and is sent again with backoff.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    /// `Kind namespace/name` or `Kind name`.
    pub object: String,
    /// The field the API server named (`spec.template.spec.containers[0].resources.requests`),
    /// when it named one.
    pub field: Option<String>,
    pub message: String,
    /// The HTTP status code of the refusal.
    pub code: u16,
    /// Not refused by the API server: an object with this name exists and is not ours
    /// ([`is_ours`]), so it is not written.
    pub not_ours: bool,
}

impl Rejection {
    /// An existing object that is not ours: `kind` and `name`, with the namespace of a
    /// namespaced one. Looked at again with backoff, so deleting or adopting it is noticed.
    pub fn not_ours(kind: &str, namespace: Option<&str>, name: &str) -> Self {
        Rejection {
            object: match namespace {
                Some(ns) => format!("{kind}/{name} in namespace {ns}"),
                None => format!("{kind}/{name}"),
            },
            field: None,
            message: String::new(),
            code: 409,
            not_ours: true,
        }
    }

    /// Whether only a different rendering can pass: the API server found the object invalid.
    pub fn permanent(&self) -> bool {
        !self.not_ours && matches!(self.code, 400 | 422)
    }
}

/// How long a refusal that may pass later waits before the object is sent again, after
/// `attempts` refusals of the same rendering: 2 s, doubling, at most 5 min.
pub fn retry_delay(attempts: u32) -> Duration {
    Duration::from_secs(2u64 << attempts.saturating_sub(1).min(8)).min(Duration::from_secs(300))
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.not_ours {
            return write!(
                f,
                "{} exists and was not created by this operator: delete it, or annotate it \
                 {ADOPT_ANNOTATION}=true to make it ours",
                self.object
            );
        }
        write!(f, "{} was rejected by the API server", self.object)?;
        if let Some(field) = &self.field {
            write!(f, " at field {field}")?;
        }
        write!(f, ": {}", self.message)?;
        if !self.permanent() {
            write!(f, " (sent again with backoff until it passes)")?;
        }
        Ok(())
    }
}

/// What the last apply of one object did.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Entry {
    /// Sent with this hash at `at`; the cache showed `before` then, the API server answered
    /// `after`. Once the cache shows anything but `before`, `before` is set to `after`:
    /// nothing is on its way any more.
    Written {
        hash: String,
        before: Option<String>,
        after: Option<String>,
        at: Instant,
    },
    /// Refused with this hash, `attempts` times in a row, the last at `at`.
    Rejected {
        hash: String,
        rejection: Rejection,
        attempts: u32,
        at: Instant,
    },
}

impl Entry {
    /// When a refused rendering may be sent again; `None` for a write, or for a refusal only a
    /// new rendering can pass.
    fn retry_at(&self) -> Option<Instant> {
        match self {
            Entry::Rejected {
                rejection,
                attempts,
                at,
                ..
            } if !rejection.permanent() => Some(*at + retry_delay(*attempts)),
            _ => None,
        }
    }
}

/// The outcome of every object's last write, by object key, kept between passes.
#[derive(Debug, Default)]
pub struct Ledger {
    entries: BTreeMap<String, Entry>,
}

impl Ledger {
    pub fn written(
        &mut self,
        key: &str,
        hash: &str,
        before: Option<&str>,
        after: Option<String>,
        at: Instant,
    ) {
        self.entries.insert(
            key.to_owned(),
            Entry::Written {
                hash: hash.to_owned(),
                before: before.map(str::to_owned),
                after,
                at,
            },
        );
    }

    pub fn rejected(&mut self, key: &str, hash: &str, rejection: Rejection, at: Instant) {
        let attempts = match self.entries.get(key) {
            Some(Entry::Rejected {
                hash: refused,
                attempts,
                ..
            }) if refused == hash => attempts + 1,
            _ => 1,
        };
        self.entries.insert(
            key.to_owned(),
            Entry::Rejected {
                hash: hash.to_owned(),
                rejection,
                attempts,
                at,
            },
        );
    }

    /// How soon the next refused object among those `wanted` may be sent again, if any
    /// refusal can pass later.
    pub fn next_retry(&self, now: Instant, wanted: impl Fn(&str) -> bool) -> Option<Duration> {
        self.entries
            .iter()
            .filter(|(key, _)| wanted(key))
            .filter_map(|(_, e)| Some(e.retry_at()?.saturating_duration_since(now)))
            .min()
    }

    /// Forgets an object that is gone (pruned).
    pub fn forget(&mut self, key: &str) {
        self.entries.remove(key);
    }
}

/// What to do with one rendered object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// The live object is what we last sent and holds every field we set.
    Unchanged,
    /// We sent exactly this rendering and the cache has not shown the result yet.
    AwaitingCache,
    /// The API server refused exactly this rendering before; not sent again.
    StillRejected(Rejection),
    /// Send it; the reason is for the log.
    Apply(String),
}

/// How long a write of ours may stay out of the cache before the object is judged on what the
/// cache shows again (a watch that skipped our version, e.g. an object deleted right after).
const CACHE_LAG_LIMIT: Duration = Duration::from_secs(5);

/// Decides for one object. `desired` is the rendered object with its hash annotation, as it
/// would be sent; `hash` that annotation's value; `key` the object's ledger key. Notes in the
/// ledger when the cache has caught up with our last write.
pub fn plan(
    ledger: &mut Ledger,
    key: &str,
    hash: &str,
    desired: &Value,
    live: Option<Live<'_>>,
    now: Instant,
) -> Plan {
    let live_version = live.and_then(|l| l.resource_version);
    if let Some(entry) = ledger.entries.get(key)
        && let Entry::Rejected {
            hash: refused,
            rejection,
            ..
        } = entry
        && refused == hash
    {
        return match entry.retry_at() {
            Some(due) if now >= due => Plan::Apply(format!(
                "sending again after a refusal that may pass now: {rejection}"
            )),
            _ => Plan::StillRejected(rejection.clone()),
        };
    }
    match ledger.entries.get_mut(key) {
        Some(Entry::Written {
            hash: sent,
            before,
            after,
            at,
        }) if sent == hash => {
            // The cache shows the answer to our last write of this very rendering: whatever a
            // subset test says (a value the server normalised), sending it again changes nothing.
            if after.is_some() && live_version == after.as_deref() {
                before.clone_from(after);
                return Plan::Unchanged;
            }
            if live_version != before.as_deref() {
                // The cache moved past the state our write started from: it is not on its way.
                before.clone_from(after);
            } else if before != after && now.saturating_duration_since(*at) < CACHE_LAG_LIMIT {
                return Plan::AwaitingCache;
            }
        }
        _ => {}
    }
    match live {
        None => Plan::Apply("absent".to_owned()),
        Some(live) => match first_difference(desired, live.object, "") {
            None => Plan::Unchanged,
            Some(path) => Plan::Apply(path),
        },
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn live(object: &Value, version: &'static str) -> Option<Live<'static>> {
        // Leaked for the test's lifetime only: keeps the call sites short.
        let object: &'static Value = Box::leak(Box::new(object.clone()));
        Some(Live {
            object,
            resource_version: Some(version),
        })
    }

    #[test]
    fn server_defaults_and_foreign_fields_do_not_count_as_differences() {
        let desired =
            json!({"spec": {"template": {"spec": {"containers": [{"name": "a", "image": "x"}]}}}});
        let live = json!({"spec": {"revisionHistoryLimit": 10, "template": {"spec": {"containers": [
            {"name": "a", "image": "x", "terminationMessagePath": "/dev/termination-log"}]}}}});
        assert!(is_subset(&desired, &live));
    }

    #[test]
    fn a_changed_value_or_a_missing_field_is_a_difference() {
        let desired = json!({"metadata": {"labels": {"a": "1"}}, "data": {"k": "v"}});
        assert!(!is_subset(
            &desired,
            &json!({"metadata": {"labels": {"a": "2"}}, "data": {"k": "v"}})
        ));
        assert!(!is_subset(
            &desired,
            &json!({"metadata": {"labels": {}}, "data": {"k": "v"}})
        ));
    }

    #[test]
    fn zero_values_the_server_omits_match_absent_fields() {
        let desired = json!({"env": [{"name": "A", "value": ""}], "hostNetwork": false, "x": {}});
        assert!(is_subset(&desired, &json!({"env": [{"name": "A"}]})));
        assert!(!is_subset(
            &json!({"env": [{"name": "A", "value": "1"}]}),
            &json!({"env": [{"name": "A"}]})
        ));
    }

    #[test]
    fn lists_without_a_merge_key_must_match_element_by_element() {
        let desired = json!({"args": ["a", "b"]});
        assert!(is_subset(&desired, &json!({"args": ["a", "b"]})));
        assert!(!is_subset(&desired, &json!({"args": ["a"]})));
        assert!(!is_subset(&desired, &json!({"args": ["a", "b", "c"]})));
        assert!(!is_subset(&desired, &json!({"args": ["b", "a"]})));
        let tolerations = json!({"tolerations": [{"key": "a", "operator": "Exists"}]});
        assert!(!is_subset(
            &tolerations,
            &json!({"tolerations": [{"key": "a", "operator": "Exists"}, {"key": "b"}]})
        ));
    }

    #[test]
    fn keyed_lists_match_by_key_and_leave_other_managers_elements_alone() {
        let desired = json!({"env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]});
        // Another manager appended C: not ours, not a difference.
        assert!(is_subset(
            &desired,
            &json!({"env": [{"name": "B", "value": "2"}, {"name": "A", "value": "1"},
                {"name": "C", "value": "3"}]})
        ));
        // One of ours edited or removed: a difference, named by key.
        assert_eq!(
            first_difference(
                &desired,
                &json!({"env": [{"name": "A", "value": "9"}, {"name": "B", "value": "2"}]}),
                ""
            ),
            Some(r#".env[name=A].value: "1" vs "9" live"#.to_owned())
        );
        assert_eq!(
            first_difference(&desired, &json!({"env": [{"name": "A", "value": "1"}]}), ""),
            Some(".env[name=B] (absent live)".to_owned())
        );
    }

    #[test]
    fn mounts_of_one_volume_at_two_paths_are_keyed_by_path() {
        let desired = json!({"volumeMounts": [{"name": "v", "mountPath": "/a"},
            {"name": "v", "mountPath": "/b", "subPath": "x"}]});
        assert!(is_subset(
            &desired,
            &json!({"volumeMounts": [{"name": "v", "mountPath": "/b", "subPath": "x"},
                {"name": "v", "mountPath": "/a"}]})
        ));
        assert!(!is_subset(
            &desired,
            &json!({"volumeMounts": [{"name": "v", "mountPath": "/a"},
                {"name": "v", "mountPath": "/b"}]})
        ));
    }

    #[test]
    fn the_hash_changes_exactly_when_the_rendering_does() {
        let a = json!({"spec": {"hostNetwork": true}});
        let b = json!({"spec": {}});
        assert_eq!(applied_hash(&a).unwrap(), applied_hash(&a.clone()).unwrap());
        assert_ne!(applied_hash(&a).unwrap(), applied_hash(&b).unwrap());
        assert_eq!(applied_hash(&a).unwrap().len(), 64);
    }

    /// A fixed instant for the ledger's timestamps.
    fn t0() -> Instant {
        static T0: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        *T0.get_or_init(Instant::now)
    }

    fn annotated(hash: &str, spec: Value) -> Value {
        json!({"metadata": {"annotations": {APPLIED_HASH_ANNOTATION: hash}}, "spec": spec})
    }

    #[test]
    fn a_field_we_stop_rendering_is_applied_although_desired_is_a_subset_of_live() {
        let mut ledger = Ledger::default();
        let before = annotated("h1", json!({"hostNetwork": true, "x": 1}));
        let after = annotated("h2", json!({"x": 1}));
        // The subset test alone would skip it: hostNetwork is extra in live.
        assert!(is_subset(&json!({"spec": {"x": 1}}), &before));
        assert!(matches!(
            plan(&mut ledger, "k", "h2", &after, live(&before, "1"), t0()),
            Plan::Apply(_)
        ));
        assert_eq!(
            plan(&mut ledger, "k", "h1", &before, live(&before, "1"), t0()),
            Plan::Unchanged
        );
    }

    #[test]
    fn our_own_write_not_yet_in_the_cache_is_not_sent_twice() {
        let mut ledger = Ledger::default();
        let old = annotated("h1", json!({"x": 1}));
        let new = annotated("h2", json!({"x": 2}));
        ledger.written("k", "h2", Some("1"), Some("2".to_owned()), t0());
        assert_eq!(
            plan(&mut ledger, "k", "h2", &new, live(&old, "1"), t0()),
            Plan::AwaitingCache
        );
        // The cache caught up.
        assert_eq!(
            plan(&mut ledger, "k", "h2", &new, live(&new, "2"), t0()),
            Plan::Unchanged
        );
        // Someone edited it after our write: judged on its content again.
        let edited = annotated("h2", json!({"x": 3}));
        assert!(matches!(
            plan(&mut ledger, "k", "h2", &new, live(&edited, "3"), t0()),
            Plan::Apply(_)
        ));
        // A create not yet in the cache.
        ledger.written("c", "h9", None, Some("5".to_owned()), t0());
        assert_eq!(
            plan(&mut ledger, "c", "h9", &new, None, t0()),
            Plan::AwaitingCache
        );
    }

    #[test]
    fn a_write_the_server_found_identical_is_not_repeated() {
        // The server normalised a value (e.g. a quantity), so the subset test never agrees;
        // the write changed nothing (same resourceVersion) and is not sent again.
        let mut ledger = Ledger::default();
        let sent = annotated("h1", json!({"cpu": "1000m"}));
        let stored = annotated("h1", json!({"cpu": "1"}));
        ledger.written("k", "h1", Some("7"), Some("7".to_owned()), t0());
        assert_eq!(
            plan(&mut ledger, "k", "h1", &sent, live(&stored, "7"), t0()),
            Plan::Unchanged
        );
    }

    #[test]
    fn a_rejected_rendering_is_not_resent_until_it_changes() {
        let mut ledger = Ledger::default();
        let rejection = Rejection {
            object: "DaemonSet gpu-operator/nvidia-dcgm-exporter".into(),
            field: Some("spec.template.spec.containers[0].resources.requests".into()),
            message: "must be less than or equal to cpu limit".into(),
            code: 422,
            not_ours: false,
        };
        ledger.rejected("k", "h1", rejection.clone(), t0());
        let desired = annotated("h1", json!({}));
        assert_eq!(
            plan(&mut ledger, "k", "h1", &desired, None, t0()),
            Plan::StillRejected(rejection)
        );
        assert!(matches!(
            plan(
                &mut ledger,
                "k",
                "h2",
                &annotated("h2", json!({})),
                None,
                t0()
            ),
            Plan::Apply(_)
        ));
    }

    #[test]
    fn a_refusal_that_may_pass_later_is_sent_again_with_backoff() {
        let mut ledger = Ledger::default();
        let rejection = Rejection {
            object: "DaemonSet gpu-operator/nvidia-gpu-driver-pool-a".into(),
            field: None,
            message: "cannot set blockOwnerDeletion in this case because cannot find \
                      RESTMapping for APIVersion nvidia.com/v1alpha1 Kind NVIDIADriver"
                .into(),
            code: 403,
            not_ours: false,
        };
        let desired = annotated("h1", json!({}));
        let wanted = |_: &str| true;
        ledger.rejected("k", "h1", rejection.clone(), t0());
        assert_eq!(
            ledger.next_retry(t0(), wanted),
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            plan(
                &mut ledger,
                "k",
                "h1",
                &desired,
                None,
                t0() + Duration::from_secs(1)
            ),
            Plan::StillRejected(rejection.clone())
        );
        assert!(matches!(
            plan(
                &mut ledger,
                "k",
                "h1",
                &desired,
                None,
                t0() + Duration::from_secs(2)
            ),
            Plan::Apply(_)
        ));
        // Refused again: the wait doubles.
        let later = t0() + Duration::from_secs(2);
        ledger.rejected("k", "h1", rejection.clone(), later);
        assert_eq!(
            ledger.next_retry(later, wanted),
            Some(Duration::from_secs(4))
        );
        assert_eq!(
            ledger.next_retry(later, |_| false),
            None,
            "not rendered any more"
        );
        assert_eq!(retry_delay(30), Duration::from_secs(300));
    }

    #[test]
    fn an_invalid_object_is_never_retried_on_a_timer() {
        let mut ledger = Ledger::default();
        let rejection = Rejection {
            object: "DaemonSet gpu-operator/nvidia-dcgm-exporter".into(),
            field: None,
            message: "Invalid value".into(),
            code: 422,
            not_ours: false,
        };
        ledger.rejected("k", "h1", rejection.clone(), t0());
        assert_eq!(ledger.next_retry(t0(), |_| true), None);
        let much_later = t0() + Duration::from_secs(3600);
        assert_eq!(
            plan(
                &mut ledger,
                "k",
                "h1",
                &annotated("h1", json!({})),
                None,
                much_later
            ),
            Plan::StillRejected(rejection)
        );
    }

    #[test]
    fn a_create_the_cache_never_shows_is_judged_again_after_a_while() {
        let mut ledger = Ledger::default();
        let object = annotated("h9", json!({"x": 1}));
        ledger.written("c", "h9", None, Some("5".to_owned()), t0());
        assert_eq!(
            plan(&mut ledger, "c", "h9", &object, None, t0()),
            Plan::AwaitingCache
        );
        // A watch may never show a version that was deleted right after.
        let later = t0() + CACHE_LAG_LIMIT;
        assert!(matches!(
            plan(&mut ledger, "c", "h9", &object, None, later),
            Plan::Apply(_)
        ));
    }

    #[test]
    fn an_object_deleted_after_the_cache_showed_our_create_is_created_again() {
        let mut ledger = Ledger::default();
        let object = annotated("h1", json!({"x": 1}));
        ledger.written("k", "h1", None, Some("5".to_owned()), t0());
        assert_eq!(
            plan(&mut ledger, "k", "h1", &object, live(&object, "5"), t0()),
            Plan::Unchanged
        );
        // Someone deleted it: absent again, which is not our create on its way.
        assert!(matches!(
            plan(&mut ledger, "k", "h1", &object, None, t0()),
            Plan::Apply(_)
        ));
        // Also when the cache only ever showed a later version (a status update) before that.
        ledger.written("k", "h1", None, Some("5".to_owned()), t0());
        assert_eq!(
            plan(&mut ledger, "k", "h1", &object, live(&object, "6"), t0()),
            Plan::Unchanged
        );
        assert!(matches!(
            plan(&mut ledger, "k", "h1", &object, None, t0()),
            Plan::Apply(_)
        ));
    }

    fn meta(
        labels: &[(&str, &str)],
        annotations: &[(&str, &str)],
        owner: Option<&str>,
    ) -> ObjectMeta {
        let map = |pairs: &[(&str, &str)]| {
            Some(
                pairs
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            )
        };
        ObjectMeta {
            labels: map(labels),
            annotations: map(annotations),
            owner_references: owner.map(|uid| {
                vec![
                    k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                        uid: uid.to_owned(),
                        ..Default::default()
                    },
                ]
            }),
            ..ObjectMeta::default()
        }
    }

    #[test]
    fn only_our_label_our_policys_ownership_or_a_users_adoption_make_an_object_ours() {
        let policy = Some("policy-uid");
        // k3s's RuntimeClass, a ConfigMap someone left, one another policy owns.
        assert!(!is_ours(&meta(&[("created-by", "k3s")], &[], None), policy));
        assert!(!is_ours(&meta(&[], &[], None), policy));
        assert!(!is_ours(&meta(&[], &[], Some("other-uid")), policy));
        assert!(!is_ours(
            &meta(&[(MANAGED_BY_LABEL, "helm")], &[], None),
            policy
        ));
        assert!(!is_ours(
            &meta(&[], &[(ADOPT_ANNOTATION, "false")], None),
            policy
        ));
        // Ours, a takeover of NVIDIA's operands (owned by the same policy), adopted.
        assert!(is_ours(
            &meta(&[(MANAGED_BY_LABEL, MANAGER)], &[], None),
            policy
        ));
        assert!(is_ours(&meta(&[], &[], Some("policy-uid")), policy));
        assert!(is_ours(
            &meta(&[], &[(ADOPT_ANNOTATION, "true")], None),
            None
        ));
    }

    #[test]
    fn an_object_that_is_not_ours_is_reported_with_the_fix_and_looked_at_again() {
        let cluster = Rejection::not_ours("RuntimeClass", None, "nvidia");
        assert_eq!(
            cluster.to_string(),
            "RuntimeClass/nvidia exists and was not created by this operator: delete it, or \
             annotate it nvidia.com/gpu-operator.adopt=true to make it ours"
        );
        assert!(!cluster.permanent());
        let namespaced = Rejection::not_ours("ConfigMap", Some("gpu-operator"), "x");
        assert!(
            namespaced
                .to_string()
                .starts_with("ConfigMap/x in namespace gpu-operator exists and was not created")
        );
    }
}
