//! Observe stage (IO, mostly from caches): what the cluster runs now, for status: the DaemonSets
//! and Deployments from the caches, and for each not-ready DaemonSet why its pods are not ready
//! (a bounded on-demand list; the operator never watches Pods).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};

use super::stores::Stores;

/// What runs now, by name.
pub struct Observed {
    pub daemon_sets: BTreeMap<String, DaemonSet>,
    pub deployments: BTreeMap<String, Deployment>,
    /// Why the pods of each not-ready DaemonSet are not ready.
    pub diagnoses: BTreeMap<String, String>,
}

/// The workloads in the caches, and a diagnosis for each DaemonSet that is not available.
pub async fn observe(client: &Client, stores: &Stores) -> Observed {
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
    for ds in daemon_sets.values() {
        let s = ds.status.clone().unwrap_or_default();
        if s.number_available.unwrap_or(0) < s.desired_number_scheduled
            && let Some(d) = diagnose(client, ds).await
        {
            diagnoses.insert(ds.name_any(), d);
        }
    }
    Observed {
        daemon_sets,
        deployments,
        diagnoses,
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
    let list = pods
        .list(&ListParams::default().labels(&selector).limit(200))
        .await
        .ok()?;
    let mut problems: Vec<String> = list
        .items
        .iter()
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
            let node = pod
                .spec
                .as_ref()?
                .node_name
                .clone()
                .unwrap_or_else(|| "unscheduled".into());
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
    mismatch_since: &Mutex<BTreeMap<String, Instant>>,
    now_mismatched: &BTreeSet<String>,
) -> BTreeSet<String> {
    let Ok(mut since) = mismatch_since.lock() else {
        return BTreeSet::new();
    };
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
