//! Resolve stage, continuously (IO): whether NVIDIA's GPU Operator is live, from a watch of its
//! leader Lease (`53822513.nvidia.com`) in every namespace (decision 14). The answer changes
//! when the Lease appears, is renewed after a lapse, is deleted, or lapses (a timer at its
//! expiry: a Lease nobody renews any more sends no event). Only a change wakes the reconcile
//! loop, so NVIDIA's operator renewing every few seconds costs no pass.
//!
//! While NVIDIA's operator is live this operator makes no change to the cluster but its own
//! status, which says why; a pass that is running when the Lease appears finishes first, so
//! writes stop within one pass.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::Api;
use kube::runtime::watcher;

use super::stores;

/// Name of the leader-election Lease of NVIDIA's GPU Operator.
pub const NVIDIA_OPERATOR_LEASE: &str = "53822513.nvidia.com";

/// A Lease without `leaseDurationSeconds` counts as valid this long (controller-runtime's
/// default lease duration).
const DEFAULT_DURATION_SECONDS: i64 = 15;

/// The live holder among `leases` at `now` (the first by namespace), and when the answer
/// changes next unless a Lease is written meanwhile (the earliest expiry of a live one).
pub fn live_holder(leases: &[Arc<Lease>], now: Timestamp) -> (Option<String>, Option<Timestamp>) {
    let mut live: Vec<(String, String, Timestamp)> = leases
        .iter()
        .filter_map(|lease| {
            let spec = lease.spec.as_ref()?;
            let renewed = spec.renew_time.as_ref()?.0;
            let seconds = spec
                .lease_duration_seconds
                .map_or(DEFAULT_DURATION_SECONDS, i64::from);
            let expires = renewed
                .checked_add(k8s_openapi::jiff::SignedDuration::from_secs(seconds))
                .ok()?;
            let holder = spec.holder_identity.clone().filter(|h| !h.is_empty())?;
            (now < expires).then(|| {
                (
                    lease.metadata.namespace.clone().unwrap_or_default(),
                    format!(
                        "{holder} (Lease {}/{NVIDIA_OPERATOR_LEASE})",
                        lease.metadata.namespace.as_deref().unwrap_or_default()
                    ),
                    expires,
                )
            })
        })
        .collect();
    live.sort();
    let next = live.iter().map(|(_, _, expires)| *expires).min();
    (live.into_iter().next().map(|(_, holder, _)| holder), next)
}

/// The current answer, shared between the watch task and the reconcile.
#[derive(Clone, Debug, Default)]
pub struct NvidiaOperator {
    /// A mutex because the Lease watch (a task of its own) writes it while passes read it.
    holder: Arc<Mutex<Option<String>>>,
}

impl NvidiaOperator {
    /// A fixed answer (the start-up probe before the watch has listed, and tests).
    pub fn fixed(holder: Option<String>) -> Self {
        NvidiaOperator {
            holder: Arc::new(Mutex::new(holder)),
        }
    }

    /// Who holds NVIDIA's operator Lease, when it is live.
    pub fn holder(&self) -> Option<String> {
        self.holder.lock().ok().and_then(|h| h.clone())
    }

    fn set(&self, holder: Option<String>) -> bool {
        match self.holder.lock() {
            Ok(mut current) if *current != holder => {
                *current = holder;
                true
            }
            _ => false,
        }
    }

    /// Keeps the answer current from a watch of NVIDIA's Lease in every namespace; calls
    /// `changed` whenever it changes. Runs until the watch ends.
    pub async fn watch(self, client: Client, changed: impl Fn()) {
        let api: Api<Lease> = Api::all(client);
        let config =
            watcher::Config::default().fields(&format!("metadata.name={NVIDIA_OPERATOR_LEASE}"));
        let (store, mut events) = stores::watched(api, config);
        // The store fills as the stream is driven: the first list ends in an event.
        if events.next().await.is_none() {
            return;
        }
        loop {
            let (holder, next) = live_holder(&store.state(), Timestamp::now());
            let appeared = holder.is_some();
            if self.set(holder.clone()) {
                if appeared {
                    tracing::warn!(holder = ?holder, "NVIDIA's GPU Operator is live: this operator stops changing the cluster");
                } else {
                    tracing::info!(
                        "NVIDIA's GPU Operator is no longer live: this operator resumes"
                    );
                }
                changed();
            }
            let until_next = next.map_or(Duration::from_secs(3600), |at| {
                let left = at.duration_since(Timestamp::now()).as_millis().max(0);
                Duration::from_millis(u64::try_from(left).unwrap_or(0) + 50)
            });
            tokio::select! {
                event = events.next() => if event.is_none() { return },
                () = tokio::time::sleep(until_next) => {},
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    fn lease(
        namespace: &str,
        holder: Option<&str>,
        renewed: i64,
        seconds: Option<i32>,
    ) -> Arc<Lease> {
        let mut lease = Lease {
            spec: Some(LeaseSpec {
                holder_identity: holder.map(str::to_owned),
                renew_time: Some(MicroTime(Timestamp::from_second(renewed).unwrap())),
                lease_duration_seconds: seconds,
                ..LeaseSpec::default()
            }),
            ..Lease::default()
        };
        lease.metadata.namespace = Some(namespace.into());
        lease.metadata.name = Some(NVIDIA_OPERATOR_LEASE.into());
        Arc::new(lease)
    }

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(second).unwrap()
    }

    #[test]
    fn a_lease_renewed_within_its_duration_is_live_until_it_expires() {
        let leases = [lease("gpu-operator", Some("nvidia-7f"), 1_000, Some(15))];
        let (holder, next) = live_holder(&leases, at(1_010));
        assert_eq!(
            holder.as_deref(),
            Some("nvidia-7f (Lease gpu-operator/53822513.nvidia.com)")
        );
        assert_eq!(next, Some(at(1_015)));
        assert_eq!(live_holder(&leases, at(1_015)), (None, None));
    }

    #[test]
    fn a_released_or_durationless_lease_is_judged_as_controller_runtime_writes_it() {
        let released = [lease("a", None, 1_000, Some(15))];
        assert_eq!(live_holder(&released, at(1_001)).0, None);
        let default_duration = [lease("a", Some("x"), 1_000, None)];
        assert!(live_holder(&default_duration, at(1_014)).0.is_some());
        assert!(live_holder(&default_duration, at(1_016)).0.is_none());
    }

    #[test]
    fn the_next_change_is_the_earliest_expiry_of_the_live_leases() {
        let leases = [
            lease("b", Some("late"), 1_000, Some(60)),
            lease("a", Some("early"), 1_000, Some(15)),
            lease("c", Some("stale"), 100, Some(15)),
        ];
        let (holder, next) = live_holder(&leases, at(1_001));
        assert!(holder.unwrap().starts_with("early"));
        assert_eq!(next, Some(at(1_015)));
    }
}
