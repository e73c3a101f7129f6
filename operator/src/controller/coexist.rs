//! Resolve stage, continuously (IO): whether NVIDIA's GPU Operator is live, from a watch of its
//! leader Lease (`53822513.nvidia.com`) in every namespace (decision 14). The answer changes
//! when the Lease appears, is renewed after a lapse, is deleted, or lapses (a timer at its
//! expiry: a Lease nobody renews any more sends no event). Only a change wakes the reconcile
//! loop, so NVIDIA's operator renewing every few seconds costs no pass.
//!
//! While NVIDIA's operator is live this operator makes no change to the cluster but its own
//! status, which says why; a pass that is running when the Lease appears finishes first, so
//! writes stop within one pass.
//!
//! Anyone with `edit` in a namespace can create a Lease with that name, so a Lease counts only
//! when it is trusted ([`Judge`]): it lies in a namespace the user named
//! (`--nvidia-operator-namespaces`), or its holder is a running pod of that namespace whose
//! ServiceAccount holds privilege a namespace tenant cannot get (a SubjectAccessReview:
//! `update clusterpolicies.nvidia.com` or `patch nodes`, cluster-wide). Other Leases are logged
//! once and ignored.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, PostParams};
use kube::runtime::watcher;

use super::stores;

/// Name of the leader-election Lease of NVIDIA's GPU Operator.
pub const NVIDIA_OPERATOR_LEASE: &str = "53822513.nvidia.com";

/// A Lease without `leaseDurationSeconds` counts as valid this long (controller-runtime's
/// default lease duration).
const DEFAULT_DURATION_SECONDS: i64 = 15;

/// A Lease of NVIDIA's name that someone renews.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct LiveLease {
    pub namespace: String,
    /// `holderIdentity`: controller-runtime writes `<pod hostname>_<uuid>`.
    pub holder: String,
    pub expires: Timestamp,
}

impl LiveLease {
    /// How status names the holder.
    pub fn describe(&self) -> String {
        format!(
            "{} (Lease {}/{NVIDIA_OPERATOR_LEASE})",
            self.holder, self.namespace
        )
    }

    /// The pod that holds it: controller-runtime's identity is the pod's hostname (its name)
    /// and a UUID joined by `_`.
    pub fn holder_pod(&self) -> &str {
        self.holder
            .rsplit_once('_')
            .map_or(self.holder.as_str(), |(pod, _)| pod)
    }
}

/// The live Leases among `leases` at `now`, by namespace, and when the answer changes next
/// unless a Lease is written meanwhile (the earliest expiry of a live one).
pub fn live_leases(leases: &[Arc<Lease>], now: Timestamp) -> (Vec<LiveLease>, Option<Timestamp>) {
    let mut live: Vec<LiveLease> = leases
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
            (now < expires).then(|| LiveLease {
                namespace: lease.metadata.namespace.clone().unwrap_or_default(),
                holder,
                expires,
            })
        })
        .collect();
    live.sort();
    let next = live.iter().map(|l| l.expires).min();
    (live, next)
}

/// What a ServiceAccount may do that a namespace tenant cannot be granted: write ClusterPolicies
/// or patch nodes, cluster-wide. NVIDIA's operator holds both.
const PRIVILEGES: [(&str, &str, &str); 2] = [
    ("nvidia.com", "clusterpolicies", "update"),
    ("", "nodes", "patch"),
];

/// Whether `service_account` of `namespace` holds one of [`PRIVILEGES`], by SubjectAccessReview.
pub async fn service_account_is_privileged(
    client: &Client,
    namespace: &str,
    service_account: &str,
) -> Result<bool, kube::Error> {
    let api: Api<SubjectAccessReview> = Api::all(client.clone());
    for (group, resource, verb) in PRIVILEGES {
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(format!(
                    "system:serviceaccount:{namespace}:{service_account}"
                )),
                groups: Some(vec![
                    "system:serviceaccounts".to_owned(),
                    format!("system:serviceaccounts:{namespace}"),
                    "system:authenticated".to_owned(),
                ]),
                resource_attributes: Some(ResourceAttributes {
                    group: Some(group.to_owned()),
                    resource: Some(resource.to_owned()),
                    verb: Some(verb.to_owned()),
                    ..ResourceAttributes::default()
                }),
                ..SubjectAccessReviewSpec::default()
            },
            ..SubjectAccessReview::default()
        };
        let answer = api.create(&PostParams::default(), &review).await?;
        if answer.status.is_some_and(|s| s.allowed) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Judges which Leases of NVIDIA's name are trusted, remembering each verdict per holder (a
/// renewal changes only `renewTime`, so a steady Lease costs no request).
pub struct Judge {
    client: Client,
    /// Namespaces the user named: a Lease there is trusted as it is.
    trusted_namespaces: BTreeSet<String>,
    verdicts: HashMap<(String, String), bool>,
}

impl Judge {
    pub fn new(client: Client, trusted_namespaces: BTreeSet<String>) -> Self {
        Judge {
            client,
            trusted_namespaces,
            verdicts: HashMap::new(),
        }
    }

    /// The first trusted live Lease among `live`, described for status.
    pub async fn trusted_holder(
        &mut self,
        live: &[LiveLease],
    ) -> Result<Option<String>, kube::Error> {
        for lease in live {
            if self.trusted(lease).await? {
                return Ok(Some(lease.describe()));
            }
        }
        Ok(None)
    }

    async fn trusted(&mut self, lease: &LiveLease) -> Result<bool, kube::Error> {
        if self.trusted_namespaces.contains(&lease.namespace) {
            return Ok(true);
        }
        let key = (lease.namespace.clone(), lease.holder.clone());
        if let Some(verdict) = self.verdicts.get(&key) {
            return Ok(*verdict);
        }
        let verdict = self.privileged_holder(lease).await?;
        if !verdict {
            tracing::warn!(
                lease = %lease.describe(),
                "ignoring a Lease with NVIDIA's operator name: its holder is no running pod whose ServiceAccount may update ClusterPolicies or patch nodes (name its namespace in --nvidia-operator-namespaces to trust it)"
            );
        }
        self.verdicts.insert(key, verdict);
        Ok(verdict)
    }

    /// Whether the holder is a running pod of the Lease's namespace with a privileged
    /// ServiceAccount.
    async fn privileged_holder(&self, lease: &LiveLease) -> Result<bool, kube::Error> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &lease.namespace);
        let Some(pod) = pods.get_opt(lease.holder_pod()).await? else {
            return Ok(false);
        };
        let running = pod
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .is_some_and(|p| p == "Running");
        if !running || pod.metadata.deletion_timestamp.is_some() {
            return Ok(false);
        }
        let service_account = pod
            .spec
            .as_ref()
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_else(|| "default".to_owned());
        service_account_is_privileged(&self.client, &lease.namespace, &service_account).await
    }
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

    /// Keeps the answer current from a watch of NVIDIA's Lease in every namespace, counting
    /// only the Leases `judge` trusts; calls `changed` whenever it changes. Runs until the
    /// watch ends.
    pub async fn watch(self, client: Client, mut judge: Judge, changed: impl Fn()) {
        let api: Api<Lease> = Api::all(client);
        let config =
            watcher::Config::default().fields(&format!("metadata.name={NVIDIA_OPERATOR_LEASE}"));
        let (store, mut events) = stores::watched(api, config);
        // The store fills as the stream is driven: the first list ends in an event.
        if events.next().await.is_none() {
            return;
        }
        loop {
            let (live, next) = live_leases(&store.state(), Timestamp::now());
            let holder = match judge.trusted_holder(&live).await {
                Ok(holder) => holder,
                Err(e) => {
                    // Unknown: the answer stays as it was, and is judged again shortly.
                    tracing::warn!(error = %e, "judging NVIDIA's operator Lease failed; retrying");
                    tokio::select! {
                        event = events.next() => if event.is_none() { return },
                        () = tokio::time::sleep(Duration::from_secs(5)) => {},
                    }
                    continue;
                }
            };
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

    /// The first live Lease, described, as the tests before trust judged it.
    fn live_holder(leases: &[Arc<Lease>], now: Timestamp) -> (Option<String>, Option<Timestamp>) {
        let (live, next) = live_leases(leases, now);
        (live.first().map(LiveLease::describe), next)
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
    fn the_holder_pod_is_the_identity_before_its_uuid() {
        let (live, _) = live_leases(
            &[lease(
                "gpu-operator",
                Some("gpu-operator-5d9c7b_1f0e2a3b-4c5d-6e7f-8091-a2b3c4d5e6f7"),
                1_000,
                Some(15),
            )],
            at(1_001),
        );
        assert_eq!(live[0].holder_pod(), "gpu-operator-5d9c7b");
        let (plain, _) = live_leases(&[lease("a", Some("just-a-name"), 1_000, None)], at(1_001));
        assert_eq!(plain[0].holder_pod(), "just-a-name");
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
