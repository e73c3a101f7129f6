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
//! - Live: unless work has been waiting for longer than the stall limit with no pass completing
//!   since it arrived: a wedged loop (a pass stuck past its deadline, a loop that stopped
//!   waking). A pass that ends with an error counts as completed (an API outage is not cured by
//!   a restart; the loop retries with backoff). An idle loop with nothing to do is live however
//!   long it waits, and so is a standby.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Default stall limit: longer than the per-pass deadline plus the longest backoff, so only a
/// loop that is really stuck trips it.
pub const DEFAULT_STALL: Duration = Duration::from_secs(600);

/// Readiness and liveness of this replica; cheap to clone, shared by `run`, the controller and
/// the HTTP endpoints.
#[derive(Clone, Debug)]
pub struct Health {
    inner: Arc<Inner>,
}

impl Default for Health {
    fn default() -> Self {
        Health::new(DEFAULT_STALL)
    }
}

#[derive(Debug)]
struct Inner {
    stall: Duration,
    ready: AtomicBool,
    /// Milliseconds since the epoch when the running pass started; 0 while none runs.
    pass_started_ms: AtomicU64,
    /// Since when work (a watch event, a due requeue) has been waiting for a pass that started
    /// after it; 0 when nothing waits.
    pending_since_ms: AtomicU64,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Whether the loop is live at `now_ms`, from when unserved work arrived (`pending_since_ms`,
/// 0: none). `Err` names how long it has waited.
pub fn live_at(pending_since_ms: u64, now_ms: u64, stall: Duration) -> Result<(), String> {
    if pending_since_ms == 0 {
        return Ok(());
    }
    let waiting = Duration::from_millis(now_ms.saturating_sub(pending_since_ms));
    if waiting > stall {
        return Err(format!(
            "work has waited {}s with no reconcile pass completing (limit {}s): the reconcile loop is wedged",
            waiting.as_secs(),
            stall.as_secs()
        ));
    }
    Ok(())
}

impl Health {
    /// Health with a stall limit of `stall`.
    pub fn new(stall: Duration) -> Self {
        Health {
            inner: Arc::new(Inner {
                stall,
                ready: AtomicBool::new(false),
                pass_started_ms: AtomicU64::new(0),
                pending_since_ms: AtomicU64::new(0),
            }),
        }
    }

    pub fn set_ready(&self, ready: bool) {
        self.inner.ready.store(ready, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.inner.ready.load(Ordering::Relaxed)
    }

    /// Work arrived for the loop (a watch event, or a requeue came due). Only the first
    /// arrival since the last pass that covered it counts.
    pub fn work_arrived(&self) {
        let _ = self.inner.pending_since_ms.compare_exchange(
            0,
            now_ms().max(1),
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
    }

    /// A reconcile pass starts: it sees every change that arrived so far.
    pub fn pass_started(&self) {
        self.inner
            .pass_started_ms
            .store(now_ms().max(1), Ordering::SeqCst);
    }

    /// The pass ended (whatever its outcome): work that arrived before it started is served,
    /// and the caches were filled before it, so a replica that reconciles is ready from now on.
    pub fn pass_finished(&self) {
        let started = self.inner.pass_started_ms.swap(0, Ordering::SeqCst);
        let pending = self.inner.pending_since_ms.load(Ordering::SeqCst);
        if pending != 0 && pending <= started {
            let _ = self.inner.pending_since_ms.compare_exchange(
                pending,
                0,
                Ordering::SeqCst,
                Ordering::SeqCst,
            );
        }
        self.set_ready(true);
    }

    /// The controller stopped (this replica stepped down): nothing is pending for it.
    pub fn controller_stopped(&self) {
        self.inner.pass_started_ms.store(0, Ordering::SeqCst);
        self.inner.pending_since_ms.store(0, Ordering::SeqCst);
    }

    /// `Err` with the reason when work has waited past the stall limit.
    pub fn live(&self) -> Result<(), String> {
        live_at(
            self.inner.pending_since_ms.load(Ordering::SeqCst),
            now_ms(),
            self.inner.stall,
        )
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
    fn work_waiting_past_the_stall_limit_is_not_live() {
        let stall = Duration::from_secs(600);
        // Idle: live however long nothing happens.
        assert_eq!(live_at(0, u64::MAX, stall), Ok(()));
        assert_eq!(live_at(1_000, 601_000, stall), Ok(()));
        let err = live_at(1_000, 602_000, stall).unwrap_err();
        assert!(err.contains("waited 601s"), "{err}");
    }

    #[test]
    fn a_finished_pass_clears_the_work_that_came_before_it_only() {
        let health = Health::new(Duration::from_millis(50));
        assert_eq!(health.live(), Ok(()));
        health.work_arrived();
        std::thread::sleep(Duration::from_millis(80));
        assert!(health.live().is_err(), "work waited past the limit");
        health.pass_started();
        health.pass_finished();
        assert_eq!(health.live(), Ok(()), "the pass served it");
        // Work arriving while a pass runs waits for the next pass.
        health.pass_started();
        std::thread::sleep(Duration::from_millis(5));
        health.work_arrived();
        health.pass_finished();
        std::thread::sleep(Duration::from_millis(80));
        assert!(health.live().is_err());
        health.controller_stopped();
        assert_eq!(
            health.live(),
            Ok(()),
            "a replica that stepped down has no work"
        );
    }
}
