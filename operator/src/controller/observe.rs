//! Observe stage (IO, mostly from caches): what the cluster runs now, for status: the DaemonSets
//! and Deployments from the caches, and for each stalled or failing DaemonSet why its pods are
//! not ready (a bounded on-demand list; the operator never watches Pods).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};

use super::stores::Stores;

/// What runs now, by name.
#[derive(Default)]
pub struct Observed {
    pub daemon_sets: BTreeMap<String, DaemonSet>,
    pub deployments: BTreeMap<String, Deployment>,
    /// Why the pods of each not-ready DaemonSet are not ready.
    pub diagnoses: BTreeMap<String, String>,
}

/// The workloads in the caches, and a diagnosis for each DaemonSet that is not available and not
/// progressing either ([`Diagnoser`]).
pub async fn observe(client: &Client, stores: &Stores, diagnoser: &mut Diagnoser) -> Observed {
    let daemon_sets: BTreeMap<String, DaemonSet> = stores
        .daemon_sets
        .state()
        .iter()
        .map(|d| (d.name_any(), d.as_ref().clone()))
        .collect();
    let deployments: BTreeMap<String, Deployment> = stores
        .deployments
        .state()
        .iter()
        .map(|d| (d.name_any(), d.as_ref().clone()))
        .collect();
    let mut diagnoses = BTreeMap::new();
    diagnoser.forget_all_but(&daemon_sets);
    for (name, ds) in &daemon_sets {
        let wanted = diagnoser.wanted(name, Counts::of(ds), Instant::now());
        let diagnosis = match wanted {
            Wanted::Nothing => None,
            Wanted::Cached(diagnosis) => diagnosis,
            Wanted::List(counts) => {
                let diagnosis = diagnose(client, ds).await;
                diagnoser.record(name, counts, diagnosis.clone(), Instant::now());
                diagnosis
            }
        };
        if let Some(d) = diagnosis {
            diagnoses.insert(name.clone(), d);
        }
    }
    Observed {
        daemon_sets,
        deployments,
        diagnoses,
    }
}

/// A DaemonSet's status counts: what tells a rollout making progress from one that is stuck.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    generation: i64,
    observed_generation: i64,
    desired: i32,
    current: i32,
    updated: i32,
    ready: i32,
    available: i32,
}

impl Counts {
    pub fn of(ds: &DaemonSet) -> Self {
        let status = ds.status.clone().unwrap_or_default();
        Counts {
            generation: ds.metadata.generation.unwrap_or(0),
            observed_generation: status.observed_generation.unwrap_or(0),
            desired: status.desired_number_scheduled,
            current: status.current_number_scheduled,
            updated: status.updated_number_scheduled.unwrap_or(0),
            ready: status.number_ready,
            available: status.number_available.unwrap_or(0),
        }
    }

    fn available(&self) -> bool {
        self.available >= self.desired
    }

    /// A new template on its way, or pods still being created.
    fn rolling_out(&self) -> bool {
        self.observed_generation < self.generation
            || self.updated < self.desired
            || self.current < self.desired
    }
}

/// How long a not-available DaemonSet's counts may stay unchanged before its pods are listed:
/// while they move the DaemonSet controller is at work, and a list would only slow it down.
pub const STALL: Duration = Duration::from_secs(30);

/// How long a diagnosis of unchanged counts is shown before the pods are listed again (a
/// crash-looping pod's reason changes without the counts changing).
pub const DIAGNOSIS_REFRESH: Duration = Duration::from_secs(60);

/// What the observe stage should do about one DaemonSet's pods.
#[derive(Debug, PartialEq, Eq)]
pub enum Wanted {
    /// Available, or progressing: no list.
    Nothing,
    /// Stalled with the same counts as at the last list: its diagnosis again.
    Cached(Option<String>),
    /// List its pods and record the diagnosis for these counts.
    List(Counts),
}

/// One DaemonSet as the observe stage last saw it.
#[derive(Debug)]
struct Seen {
    counts: Counts,
    /// When the counts last changed.
    changed: Instant,
    /// The last diagnosis: for which counts, when, and what it said.
    diagnosis: Option<(Counts, Instant, Option<String>)>,
    /// A list was asked for these counts and its answer never recorded (its pass gave way to a
    /// user's change mid-list): the next pass asks again instead of waiting for a stall.
    unanswered: bool,
}

/// Decides when a not-available DaemonSet's pods are listed (the operator never watches Pods,
/// decision 10): not while a rollout or the creation of pods makes progress (with a thousand
/// nodes a pass would list pods again and again), but at once when pods that were available
/// stop being so without a rollout (a crash), and when the counts stall for [`STALL`]. A
/// diagnosis is reused while the counts stay the same, up to [`DIAGNOSIS_REFRESH`].
#[derive(Debug, Default)]
pub struct Diagnoser {
    seen: BTreeMap<String, Seen>,
}

impl Diagnoser {
    /// Drops what it remembers of DaemonSets that are gone.
    fn forget_all_but(&mut self, live: &BTreeMap<String, DaemonSet>) {
        self.seen.retain(|name, _| live.contains_key(name));
    }

    /// What to do about DaemonSet `name` with `counts` now; remembers the counts. A fresh
    /// diagnosis of the same counts is shown on every pass, not only on those that would list:
    /// status must not drop it between a crash and the next stall check.
    pub fn wanted(&mut self, name: &str, counts: Counts, now: Instant) -> Wanted {
        let seen = &mut self.seen;
        let previous = seen.remove(name);
        let same = previous.as_ref().is_some_and(|p| p.counts == counts);
        let (changed, diagnosis) = match &previous {
            Some(p) if same => (p.changed, p.diagnosis.clone()),
            Some(p) => (now, p.diagnosis.clone()),
            None => (now, None),
        };
        let look = match &previous {
            // First sight (a restart): a DaemonSet that is not creating or replacing pods.
            None => !counts.rolling_out(),
            Some(p) if same => p.unanswered || now.saturating_duration_since(p.changed) >= STALL,
            // Fewer pods available without a rollout: pods failed.
            Some(p) => !counts.rolling_out() && counts.available < p.counts.available,
        };
        let fresh = diagnosis
            .as_ref()
            .filter(|(at_counts, at, _)| {
                *at_counts == counts && now.saturating_duration_since(*at) < DIAGNOSIS_REFRESH
            })
            .map(|(_, _, text)| text.clone());
        let wanted = match fresh {
            _ if counts.available() => Wanted::Nothing,
            Some(text) => Wanted::Cached(text),
            None if look => Wanted::List(counts),
            None => Wanted::Nothing,
        };
        seen.insert(
            name.to_owned(),
            Seen {
                counts,
                changed,
                diagnosis,
                unanswered: matches!(wanted, Wanted::List(_)),
            },
        );
        wanted
    }

    /// Records the diagnosis of a list made for `counts`.
    pub fn record(&mut self, name: &str, counts: Counts, diagnosis: Option<String>, now: Instant) {
        if let Some(s) = self.seen.get_mut(name) {
            s.diagnosis = Some((counts, now, diagnosis));
            s.unanswered = false;
        }
    }
}

/// Why pods of a not-ready DaemonSet are not ready, from a bounded on-demand list of its pods
/// (the operator never watches Pods): e.g. `gpu-t4-0: CrashLoopBackOff`.
async fn diagnose(client: &Client, ds: &DaemonSet) -> Option<String> {
    let namespace = ds.namespace()?;
    let selector = ds.spec.as_ref()?.selector.match_labels.as_ref()?;
    let selector = selector
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let request = kube::core::Request::new(pods.resource_url())
        .list(&ListParams::default().labels(&selector).limit(200))
        .ok()?;
    let list: DiagnosedPods = client.request(request).await.ok()?;
    describe_unready(&list)
}

/// A pod list decoded into only what [`describe_unready`] reads. As full `Pod`s (spec, managed
/// fields), a list of 200 pods held ~25 MiB for a moment, the operator's largest allocation
/// (bench/results/heap-n1000.md).
#[derive(Debug, serde::Deserialize)]
struct DiagnosedPods {
    items: Option<Vec<DiagnosedPod>>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct DiagnosedPod {
    spec: DiagnosedSpec,
    status: Option<DiagnosedStatus>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct DiagnosedSpec {
    node_name: Option<String>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct DiagnosedStatus {
    phase: Option<String>,
    conditions: Option<Vec<DiagnosedCondition>>,
    container_statuses: Option<Vec<DiagnosedContainer>>,
    init_container_statuses: Option<Vec<DiagnosedContainer>>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
struct DiagnosedCondition {
    #[serde(rename = "type")]
    type_: String,
    status: String,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
struct DiagnosedContainer {
    state: Option<DiagnosedState>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
struct DiagnosedState {
    waiting: Option<DiagnosedWaiting>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
struct DiagnosedWaiting {
    reason: Option<String>,
}

/// "not ready on N node(s): node: reason, ..." for the pods that are not Ready (the first five,
/// sorted), or None when every pod is Ready. A pod without conditions has not been looked at
/// by a kubelet yet and is left out.
fn describe_unready(list: &DiagnosedPods) -> Option<String> {
    let mut problems: Vec<String> = list
        .items
        .iter()
        .flatten()
        .filter_map(|pod| {
            let status = pod.status.as_ref()?;
            let ready = status
                .conditions
                .as_ref()?
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            if ready {
                return None;
            }
            let node = pod.spec.node_name.as_deref().unwrap_or("unscheduled");
            let why = status
                .container_statuses
                .iter()
                .chain(status.init_container_statuses.iter())
                .flatten()
                .find_map(|c| c.state.as_ref()?.waiting.as_ref()?.reason.clone())
                .or_else(|| status.phase.clone())
                .unwrap_or_else(|| "not ready".into());
            Some(format!("{node}: {why}"))
        })
        .collect();
    problems.sort();
    const SHOWN: usize = 5;
    let more = problems.len().saturating_sub(SHOWN);
    problems.truncate(SHOWN);
    if problems.is_empty() {
        return None;
    }
    let mut text = format!(
        "not ready on {} node(s): {}",
        problems.len() + more,
        problems.join(", ")
    );
    if more > 0 {
        text.push_str(&format!(" and {more} more"));
    }
    Some(text)
}

/// How long a DaemonSet's pod count may differ from its labelled nodes before status names the
/// usual causes: the DaemonSet controller follows label changes within moments.
pub const MISMATCH_GRACE: Duration = Duration::from_secs(10);

/// Records which DaemonSets differ from their labelled nodes now and returns those that have
/// differed for longer than [`MISMATCH_GRACE`].
pub fn lasting_mismatches(
    since: &mut BTreeMap<String, Instant>,
    now_mismatched: &BTreeSet<String>,
) -> BTreeSet<String> {
    let now = Instant::now();
    since.retain(|name, _| now_mismatched.contains(name));
    now_mismatched
        .iter()
        .filter(|name| {
            now.duration_since(*since.entry((*name).clone()).or_insert(now)) >= MISMATCH_GRACE
        })
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pod as the API server lists it: spec, managed fields and all.
    fn listed_pod(node: &str, ready: bool, waiting: Option<&str>) -> serde_json::Value {
        let state = match waiting {
            Some(reason) => {
                serde_json::json!({"waiting": {"reason": reason, "message": "back-off"}})
            }
            None => serde_json::json!({"running": {"startedAt": "2026-11-27T20:00:00Z"}}),
        };
        serde_json::json!({
            "metadata": {
                "name": format!("nvidia-device-plugin-daemonset-{node}"),
                "labels": {"app": "nvidia-device-plugin-daemonset"},
                "managedFields": [{"manager": "kubelet", "operation": "Update",
                    "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {"f:phase": {}}}}]
            },
            "spec": {
                "nodeName": node,
                "containers": [{"name": "plugin", "image": "nvcr.io/nvidia/k8s-device-plugin:v0.17.0",
                    "env": [{"name": "FAIL_ON_INIT_ERROR", "value": "false"}]}],
                "volumes": [{"name": "dp", "hostPath": {"path": "/var/lib/kubelet/device-plugins"}}]
            },
            "status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
                "containerStatuses": [{"name": "plugin", "ready": ready, "restartCount": 4, "state": state}],
                "initContainerStatuses": null
            }
        })
    }

    #[test]
    fn a_listed_pod_is_decoded_to_its_node_and_waiting_reason() {
        let list = serde_json::json!({
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": "42"},
            "items": [
                listed_pod("gpu-a", true, None),
                listed_pod("gpu-c", false, Some("CrashLoopBackOff")),
                listed_pod("gpu-b", false, None),
            ]
        });
        let pods: DiagnosedPods = serde_json::from_value(list).unwrap();
        assert_eq!(
            describe_unready(&pods).as_deref(),
            Some("not ready on 2 node(s): gpu-b: Running, gpu-c: CrashLoopBackOff")
        );
    }

    #[test]
    fn more_than_five_unready_pods_are_counted_not_listed() {
        let items: Vec<_> = (0..7)
            .map(|i| listed_pod(&format!("gpu-{i}"), false, Some("ImagePullBackOff")))
            .collect();
        let pods: DiagnosedPods =
            serde_json::from_value(serde_json::json!({ "items": items })).unwrap();
        let text = describe_unready(&pods).unwrap();
        assert!(
            text.starts_with("not ready on 7 node(s): gpu-0: ImagePullBackOff"),
            "{text}"
        );
        assert!(text.ends_with(" and 2 more"), "{text}");
    }

    #[test]
    fn an_empty_or_all_ready_list_has_no_diagnosis() {
        let empty: DiagnosedPods =
            serde_json::from_value(serde_json::json!({"items": null})).unwrap();
        assert_eq!(describe_unready(&empty), None);
        let ready: DiagnosedPods =
            serde_json::from_value(serde_json::json!({"items": [listed_pod("gpu-a", true, None)]}))
                .unwrap();
        assert_eq!(describe_unready(&ready), None);
    }

    fn counts(desired: i32, updated: i32, available: i32) -> Counts {
        Counts {
            generation: 2,
            observed_generation: 2,
            desired,
            current: desired,
            updated,
            ready: available,
            available,
        }
    }

    #[test]
    fn pods_are_not_listed_while_a_rollout_makes_progress() {
        let mut d = Diagnoser::default();
        let t = Instant::now();
        assert_eq!(d.wanted("ds", counts(10, 10, 10), t), Wanted::Nothing);
        // A new template: one pod down at a time, counts moving.
        let rolling = Counts {
            generation: 3,
            ..counts(10, 0, 9)
        };
        assert_eq!(d.wanted("ds", rolling, t), Wanted::Nothing);
        let rolling = Counts {
            observed_generation: 3,
            ..rolling
        };
        assert_eq!(d.wanted("ds", rolling, t), Wanted::Nothing);
        assert_eq!(
            d.wanted(
                "ds",
                Counts {
                    updated: 5,
                    ..rolling
                },
                t + STALL / 2
            ),
            Wanted::Nothing
        );
    }

    #[test]
    fn available_pods_that_fail_without_a_rollout_are_listed_at_once() {
        let mut d = Diagnoser::default();
        let t = Instant::now();
        assert_eq!(d.wanted("ds", counts(10, 10, 10), t), Wanted::Nothing);
        let crashed = counts(10, 10, 9);
        assert_eq!(d.wanted("ds", crashed, t), Wanted::List(crashed));
        d.record("ds", crashed, Some("n1: CrashLoopBackOff".into()), t);
        assert_eq!(
            d.wanted("ds", crashed, t),
            Wanted::Cached(Some("n1: CrashLoopBackOff".into())),
            "the next pass shows the diagnosis again without a list"
        );
        assert_eq!(
            d.wanted("ds", crashed, t + STALL),
            Wanted::Cached(Some("n1: CrashLoopBackOff".into())),
        );
        assert_eq!(
            d.wanted("ds", crashed, t + STALL + DIAGNOSIS_REFRESH),
            Wanted::List(crashed),
            "an old diagnosis is refreshed"
        );
    }

    #[test]
    fn counts_that_stall_are_listed_once_per_change() {
        let mut d = Diagnoser::default();
        let t = Instant::now();
        let creating = Counts {
            current: 4,
            ..counts(10, 4, 2)
        };
        assert_eq!(d.wanted("ds", creating, t), Wanted::Nothing);
        assert_eq!(d.wanted("ds", creating, t + STALL), Wanted::List(creating));
        d.record("ds", creating, None, t + STALL);
        assert_eq!(
            d.wanted("ds", creating, t + STALL * 2),
            Wanted::Cached(None)
        );
    }

    #[test]
    fn a_not_available_daemon_set_first_seen_without_a_rollout_is_listed() {
        let mut d = Diagnoser::default();
        let stuck = counts(10, 10, 7);
        assert_eq!(d.wanted("ds", stuck, Instant::now()), Wanted::List(stuck));
        let creating = Counts {
            current: 3,
            ..counts(10, 3, 0)
        };
        assert_eq!(d.wanted("other", creating, Instant::now()), Wanted::Nothing);
    }

    #[test]
    fn a_list_whose_pass_gave_way_is_asked_for_again_on_the_next_pass() {
        let mut d = Diagnoser::default();
        let t = Instant::now();
        assert_eq!(d.wanted("ds", counts(10, 10, 10), t), Wanted::Nothing);
        let crashed = counts(10, 10, 9);
        assert_eq!(d.wanted("ds", crashed, t), Wanted::List(crashed));
        // No record: the pass was cut short while listing.
        assert_eq!(
            d.wanted("ds", crashed, t + STALL / 10),
            Wanted::List(crashed)
        );
        d.record("ds", crashed, Some("n1: CrashLoopBackOff".into()), t);
        assert_eq!(
            d.wanted("ds", crashed, t + STALL / 5),
            Wanted::Cached(Some("n1: CrashLoopBackOff".into()))
        );
    }

    #[test]
    fn a_recovered_daemon_set_shows_no_old_diagnosis() {
        let mut d = Diagnoser::default();
        let t = Instant::now();
        let crashed = counts(10, 10, 9);
        assert_eq!(d.wanted("ds", crashed, t), Wanted::List(crashed));
        d.record("ds", crashed, Some("n1: CrashLoopBackOff".into()), t);
        assert_eq!(d.wanted("ds", counts(10, 10, 10), t), Wanted::Nothing);
    }
}
