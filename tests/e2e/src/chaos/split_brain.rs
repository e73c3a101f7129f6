//! The "never two writers" check over a whole run (pure over audit entries): every write a
//! replica makes (Lease writes aside) must come while it holds the Lease, that is after its own
//! last successful Lease write, before any other replica's successful Lease write since then, and
//! within one lease duration of its last renewal.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use crate::audit::AuditEvent;

/// Follows the Lease through the audit log, entry by entry.
#[derive(Debug)]
pub struct LeaseFollower {
    lease: String,
    duration: Duration,
    /// The user of the last successful Lease write.
    holder: Option<String>,
    /// When each user's last successful Lease write completed.
    renewed: BTreeMap<String, SystemTime>,
    /// Writes so far by user.
    pub writes: BTreeMap<String, u64>,
}

fn succeeded(e: &AuditEvent) -> bool {
    e.response_status
        .as_ref()
        .and_then(|s| s.code)
        .is_some_and(|c| (200..300).contains(&c))
}

impl LeaseFollower {
    pub fn new(lease: &str, duration: Duration) -> Self {
        LeaseFollower {
            lease: lease.to_owned(),
            duration,
            holder: None,
            renewed: BTreeMap::new(),
            writes: BTreeMap::new(),
        }
    }

    /// Takes the entries of `users` (in the order the API server received them) and returns a
    /// description of every write made without the Lease.
    pub fn follow(&mut self, events: &[AuditEvent], users: &[String]) -> Vec<String> {
        let mut ours: Vec<&AuditEvent> = events
            .iter()
            .filter(|e| e.is_mutating() && users.contains(&e.user.username))
            .collect();
        ours.sort_by_key(|e| e.received());
        let mut violations = Vec::new();
        for e in ours {
            let user = &e.user.username;
            if e.is_lease() {
                // A create names its object in the body, which a metadata-level entry may not show.
                if e.name().is_none_or(|n| n == self.lease) && succeeded(e) {
                    self.holder = Some(user.clone());
                    self.renewed.insert(user.clone(), e.completed());
                }
                continue;
            }
            *self.writes.entry(user.clone()).or_default() += 1;
            let at = e.received();
            if self.holder.as_ref() != Some(user) {
                violations.push(format!(
                    "{e} by {user} at {} while {} held the Lease",
                    timestamp(at),
                    self.holder.as_deref().unwrap_or("nobody")
                ));
            } else if let Some(renewed) = self.renewed.get(user)
                && at
                    .duration_since(*renewed)
                    .is_ok_and(|since| since > self.duration)
            {
                violations.push(format!(
                    "{e} by {user} at {}: its Lease expired (last renewed {})",
                    timestamp(at),
                    timestamp(*renewed)
                ));
            }
        }
        violations
    }
}

fn timestamp(t: SystemTime) -> String {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    format!("{}.{:03}", d.as_secs(), d.subsec_millis())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn entry(user: &str, verb: &str, resource: &str, at_ms: u64, code: u16) -> AuditEvent {
        let at = |ms: u64| format!("2026-11-27T06:00:{:02}.{:03}Z", ms / 1000, ms % 1000);
        serde_json::from_value(serde_json::json!({
            "verb": verb,
            "user": {"username": user},
            "objectRef": {"resource": resource, "name": if resource == "leases" { "lease" } else { "x" }},
            "requestURI": "/x",
            "responseStatus": {"code": code},
            "requestReceivedTimestamp": at(at_ms),
            "stageTimestamp": at(at_ms + 1),
        }))
        .unwrap()
    }

    fn users() -> Vec<String> {
        vec!["a".into(), "b".into()]
    }

    #[test]
    fn a_handover_after_the_lease_moved_is_clean() {
        let mut f = LeaseFollower::new("lease", Duration::from_secs(10));
        let events = [
            entry("a", "update", "leases", 0, 200),
            entry("a", "patch", "daemonsets", 1_000, 200),
            entry("b", "update", "leases", 12_000, 200),
            entry("b", "patch", "daemonsets", 12_500, 200),
            entry("a", "update", "leases", 13_000, 409),
        ];
        assert_eq!(f.follow(&events, &users()), Vec::<String>::new());
        assert_eq!(f.writes["a"], 1);
        assert_eq!(f.writes["b"], 1);
    }

    #[test]
    fn a_write_by_the_old_leader_after_the_handover_is_a_violation() {
        let mut f = LeaseFollower::new("lease", Duration::from_secs(10));
        let events = [
            entry("a", "update", "leases", 0, 200),
            entry("b", "update", "leases", 12_000, 200),
            entry("a", "patch", "daemonsets", 12_100, 200),
        ];
        let v = f.follow(&events, &users());
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].contains("while b held the Lease"), "{v:?}");
    }

    #[test]
    fn a_write_past_the_lease_duration_without_renewal_is_a_violation() {
        let mut f = LeaseFollower::new("lease", Duration::from_secs(10));
        let events = [
            entry("a", "update", "leases", 0, 200),
            entry("a", "patch", "daemonsets", 11_000, 200),
        ];
        let v = f.follow(&events, &users());
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].contains("expired"), "{v:?}");
    }
}
