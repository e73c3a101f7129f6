//! What `/readyz` and `/healthz` answer (no IO here; `run` and the controller report into it,
//! `http` serves it).
//!
//! - Ready: a replica that reconciles (the leader, or the only one without leader election) is
//!   ready once its caches are filled and its first pass over the policies has finished, failed
//!   or not: a policy with a mistake must not make the operator unready, since that would only
//!   stall rollouts of the operator itself. A standby replica (leader election, Lease held by
//!   another) is ready once it reaches the API and waits for the Lease. It must be: a
//!   Deployment of 2 replicas rolls out by starting a new pod and waiting for it to be ready
//!   before stopping an old one (maxUnavailable 0), and the new pod is a standby while the old
//!   leader runs, so a standby that is never ready would stall every rollout. A standby that
//!   becomes leader is unready until its own first pass finishes.
//! - Live: unless a reconcile pass has been running for longer than [`STALL`], which only a
//!   wedged pass does (an API call that never returns); the kubelet then restarts the
//!   process. An idle loop waiting for events is live.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long one pass may run before the process counts as wedged. Passes over thousands of
/// nodes take seconds to a minute; ten minutes leaves a wide margin.
pub const STALL: Duration = Duration::from_secs(600);

/// Readiness and liveness of this replica; cheap to clone, shared by `run`, the controller and
/// the HTTP endpoints.
#[derive(Clone, Debug, Default)]
pub struct Health {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    ready: AtomicBool,
    /// Milliseconds since the epoch when the running pass started; 0 while none runs.
    pass_started_ms: AtomicU64,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Health {
    pub fn set_ready(&self, ready: bool) {
        self.inner.ready.store(ready, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.inner.ready.load(Ordering::Relaxed)
    }

    /// A reconcile pass starts.
    pub fn pass_started(&self) {
        self.inner
            .pass_started_ms
            .store(now_ms(), Ordering::Relaxed);
    }

    /// The pass ended (whatever its outcome): the caches were filled before it, so a replica
    /// that reconciles is ready from now on.
    pub fn pass_finished(&self) {
        self.inner.pass_started_ms.store(0, Ordering::Relaxed);
        self.set_ready(true);
    }

    /// `Err` with the reason when a pass has run for longer than `stall` at `now_ms`.
    pub fn live_at(&self, now_ms: u64, stall: Duration) -> Result<(), String> {
        let started = self.inner.pass_started_ms.load(Ordering::Relaxed);
        let running = Duration::from_millis(now_ms.saturating_sub(started));
        if started != 0 && running > stall {
            return Err(format!(
                "a reconcile pass has been running for {}s (more than {}s): the reconcile loop is wedged",
                running.as_secs(),
                stall.as_secs()
            ));
        }
        Ok(())
    }

    /// [`Self::live_at`] now with [`STALL`].
    pub fn live(&self) -> Result<(), String> {
        self.live_at(now_ms(), STALL)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_after_the_first_pass_finished() {
        let health = Health::default();
        assert!(!health.is_ready());
        health.pass_started();
        assert!(!health.is_ready(), "ready while the first pass runs");
        health.pass_finished();
        assert!(health.is_ready());
    }

    #[test]
    fn a_pass_running_longer_than_the_stall_limit_is_not_live() {
        let health = Health::default();
        let stall = Duration::from_secs(600);
        // Idle: live however long nothing happens.
        assert_eq!(health.live_at(u64::MAX, stall), Ok(()));
        health.pass_started();
        let started = health.inner.pass_started_ms.load(Ordering::Relaxed);
        assert_eq!(health.live_at(started + 600_000, stall), Ok(()));
        let err = health.live_at(started + 601_000, stall).unwrap_err();
        assert!(err.contains("running for 601s"), "{err}");
        health.pass_finished();
        assert_eq!(health.live_at(started + 601_000, stall), Ok(()));
    }
}
