//! Scheduler (IO: timers and the trigger stream, no API request): when a pass runs.
//!
//! What a pass does is the caller's (a closure over the state this loop owns).
//!
//! Guarantees and caveats:
//! - One pass at a time. Every watch feeds one trigger stream, pumped on a task of its own so
//!   the caches stay current while a pass runs; however many events arrive meanwhile, they leave
//!   one wake-up.
//! - Cluster churn (stores::Wake::Soon) waits [`COALESCE`] for the rest of its burst; a user's
//!   change (stores::Wake::Now) cuts that wait, and may stop the pass under way after its apply
//!   stage ([`Preemption`]), but not two passes in a row: the stages after the apply (driver
//!   upgrades, status) must run even while a user keeps changing things.
//! - A pass that runs past its deadline is abandoned (dropped, its requests cancelled) and
//!   counts as failed. Failures retry with exponential backoff from 1 s ([`backoff`]); a pass
//!   that succeeds resets it.
//! - No timer while steady: the next pass without a watch event comes only when a pass asked
//!   for one ([`PassOutcome::requeue`]) or failed.
//! - The state between passes is owned here and lent to each pass (`&mut`); a pass abandoned at
//!   its deadline leaves it as far as it got.
//! - Shutdown is looked at between passes: the pass in flight is finished first.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, Stream, StreamExt};
use tokio::sync::{Notify, oneshot, watch};
use tokio::time::Instant;

use super::stores::Wake;

/// How long a pass woken by cluster churn waits for the rest of its burst.
pub const COALESCE: Duration = Duration::from_millis(20);

/// The log target of per-stage pass timings (debug): where a change's latency goes.
pub const PASS_TIMING: &str = "gpu_operator::controller::timing";

/// When a pass wants the next one without a watch event: `None` waits for one.
pub type Requeue = Option<Duration>;

/// The earlier of two requeues (`None` is never).
pub fn earliest(a: Requeue, b: Requeue) -> Requeue {
    a.into_iter().chain(b).min()
}

/// What a pass tells the scheduler.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PassOutcome {
    /// When to run again without a watch event.
    pub requeue: Requeue,
    /// Something failed: retried with backoff.
    pub failed: bool,
    /// The pass gave way to a user's change after its apply stage ([`Preemption`]).
    pub preempted: bool,
}

impl PassOutcome {
    /// Two parts of one pass together: the earliest requeue, failed if either failed.
    #[must_use]
    pub fn and(self, other: PassOutcome) -> PassOutcome {
        PassOutcome {
            requeue: earliest(self.requeue, other.requeue),
            failed: self.failed || other.failed,
            preempted: self.preempted || other.preempted,
        }
    }
}

/// How long the scheduler waits, and for what.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// How long churn waits for the rest of its burst.
    pub coalesce: Duration,
    /// The longest one pass may run.
    pub deadline: Duration,
}

/// Where the scheduler reports what it does (health and metrics in the operator, nothing in
/// tests). Called from the trigger pump's task too, hence `Send + Sync + 'static`.
pub trait Observer: Clone + Send + Sync + 'static {
    /// A watch event arrived, or a requeue came due.
    fn work_arrived(&self) {}
    /// A pass starts.
    fn pass_started(&self) {}
    /// A pass ended, whatever its outcome (also when abandoned at its deadline).
    fn pass_finished(&self) {}
    /// A pass ran past its deadline and was abandoned.
    fn deadline_passed(&self) {}
}

impl Observer for () {}

/// Failures in a row -> the wait before the next try: 1 s, doubling with each failure. The
/// doubling stops at the sixth failure (32 s); [`BACKOFF_CAP`] bounds it in any case.
pub fn backoff(failures: u32) -> Duration {
    Duration::from_secs(1 << failures.min(6).saturating_sub(1)).min(BACKOFF_CAP)
}

/// The longest wait between two tries of a failing pass.
pub const BACKOFF_CAP: Duration = Duration::from_secs(60);

/// A spawned task that is aborted when the handle is dropped: a controller cancelled by its
/// caller (a leader stepping down) leaves no watch running behind.
pub struct AbortOnDrop(pub tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Wakes the loop from another task (no user's change: the pass coalesces).
#[derive(Clone, Debug, Default)]
pub struct Waker(Arc<Notify>);

impl Waker {
    pub fn wake(&self) {
        self.0.notify_one();
    }
}

/// The wake-ups of the loop: the trigger stream, pumped on its own task.
pub struct Wakes {
    wake: Waker,
    /// Counts users' changes (stores::Wake::Now), besides leaving `wake`: one cuts the
    /// coalescing wait, and stops a pass under way after its apply stage.
    user_changes: watch::Receiver<u64>,
    ended: oneshot::Receiver<()>,
    _pump: AbortOnDrop,
}

impl Wakes {
    /// Pumps `triggers` on a task of its own until they end (then [`run`] returns an error).
    pub fn pump(
        mut triggers: impl Stream<Item = Wake> + Send + Unpin + 'static,
        observer: impl Observer,
    ) -> Self {
        let wake = Waker::default();
        let (user_change, user_changes) = watch::channel(0u64);
        let (ended_tx, ended) = oneshot::channel::<()>();
        let pump = {
            let wake = wake.clone();
            AbortOnDrop(tokio::spawn(async move {
                while let Some(how) = triggers.next().await {
                    observer.work_arrived();
                    if how == Wake::Now {
                        user_change.send_modify(|n| *n += 1);
                    }
                    wake.wake();
                }
                let _ = ended_tx.send(());
            }))
        };
        Wakes {
            wake,
            user_changes,
            ended,
            _pump: pump,
        }
    }

    /// A handle other tasks wake the loop with.
    pub fn waker(&self) -> Waker {
        self.wake.clone()
    }
}

/// Whether the pass may stop after its apply stage for a user's change, and the means to.
#[derive(Clone, Debug, Default)]
pub struct Preemption(Option<watch::Receiver<u64>>);

impl Preemption {
    /// A pass that may not give way (tests, and the pass after a preempted one).
    pub fn never() -> Self {
        Preemption(None)
    }

    /// Whether a user's change may stop this pass.
    pub fn allowed(&self) -> bool {
        self.0.is_some()
    }

    /// Runs `rest` (the stages after the apply, which the next pass redoes) unless a user's
    /// change that arrived since the pass started comes first: `None` then.
    pub async fn unless_user_change<F: Future>(&mut self, rest: F) -> Option<F::Output> {
        let Some(changes) = &mut self.0 else {
            return Some(rest.await);
        };
        tokio::select! {
            biased;
            done = rest => Some(done),
            Ok(()) = changes.changed() => {
                tracing::debug!(target: PASS_TIMING, "a user's change arrived: the pass stops after its apply stage");
                None
            }
        }
    }
}

/// The trigger stream ended: the watches are gone.
#[derive(Debug, thiserror::Error)]
#[error("the watches ended")]
pub struct WatchesEnded;

/// Runs `pass` on `state` whenever [`Wakes`] or a requeue asks, until `shutdown` resolves (the
/// pass in flight is finished first); returns the state. The first pass runs at once.
pub async fn run<S>(
    mut wakes: Wakes,
    timing: Timing,
    observer: &impl Observer,
    mut state: S,
    shutdown: impl Future<Output = ()>,
    mut pass: impl AsyncFnMut(&mut S, Preemption) -> PassOutcome,
) -> Result<S, WatchesEnded> {
    let mut shutdown = std::pin::pin!(shutdown.fuse());
    let mut failures: u32 = 0;
    let mut preempted = false;
    let mut wake_at: Option<Instant> = Some(Instant::now());
    loop {
        let sleep = async {
            match wake_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        // Shutdown first: a requeue due at once must not start another pass after it.
        tokio::select! {
            biased;
            () = &mut shutdown => break,
            _ = &mut wakes.ended => return Err(WatchesEnded),
            () = wakes.wake.0.notified() => {},
            () = sleep => observer.work_arrived(),
        }
        let woke = Instant::now();
        // Coalesce a burst of events (a rollout updates a DaemonSet's status many times) into
        // one pass: give stragglers a moment, then take the wake-up they left. A user's change
        // among them starts the pass at once.
        if !wakes.user_changes.has_changed().unwrap_or(false) {
            tokio::select! {
                () = tokio::time::sleep(timing.coalesce) => {},
                _ = wakes.user_changes.changed() => {},
            }
        }
        wakes.user_changes.mark_unchanged();
        let _ = wakes.wake.0.notified().now_or_never();
        let preemption = if preempted {
            Preemption::never()
        } else {
            Preemption(Some(wakes.user_changes.clone()))
        };

        observer.pass_started();
        tracing::debug!(target: PASS_TIMING, waited_ms = woke.elapsed().as_secs_f64() * 1000.0, "pass started");
        let outcome = match tokio::time::timeout(timing.deadline, pass(&mut state, preemption))
            .await
        {
            Ok(outcome) => outcome,
            Err(_) => {
                tracing::error!(deadline = ?timing.deadline, "a reconcile pass ran past its deadline; abandoned, retrying with backoff");
                observer.deadline_passed();
                PassOutcome {
                    requeue: None,
                    failed: true,
                    preempted: false,
                }
            }
        };
        observer.pass_finished();
        preempted = outcome.preempted;
        failures = if outcome.failed {
            failures.saturating_add(1)
        } else {
            0
        };
        let next = if outcome.failed {
            earliest(outcome.requeue, Some(backoff(failures)))
        } else {
            outcome.requeue
        };
        wake_at = next.map(|d| Instant::now() + d);
    }
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::channel::mpsc;

    const MS: Duration = Duration::from_millis(1);

    /// Where a test sends its watch events.
    type Tx = mpsc::UnboundedSender<Wake>;

    const TIMING: Timing = Timing {
        coalesce: COALESCE,
        deadline: Duration::from_secs(60),
    };

    /// What the fake pass does and what it saw: each pass takes `work` (its apply stage), then
    /// `rest` (the stages after the apply, preemptible); its outcome is `script`'s next entry
    /// (the last one repeats).
    #[derive(Default)]
    struct Log {
        work: Duration,
        rest: Duration,
        script: Vec<PassOutcome>,
        started: Vec<Instant>,
        /// Per pass: whether it could be preempted.
        preemptible: Vec<bool>,
        finished: Vec<Instant>,
        preempted: Vec<bool>,
    }

    async fn fake_pass(log: &mut Log, mut preemption: Preemption) -> PassOutcome {
        log.started.push(Instant::now());
        log.preemptible.push(preemption.allowed());
        let planned = log
            .script
            .get(log.started.len() - 1)
            .or(log.script.last())
            .copied()
            .unwrap_or_default();
        tokio::time::sleep(log.work).await;
        let rest = preemption
            .unless_user_change(tokio::time::sleep(log.rest))
            .await;
        log.finished.push(Instant::now());
        match rest {
            Some(()) => {
                log.preempted.push(false);
                planned
            }
            None => {
                log.preempted.push(true);
                PassOutcome {
                    requeue: Some(Duration::ZERO),
                    failed: false,
                    preempted: true,
                }
            }
        }
    }

    /// Runs the scheduler over `log` while `script` sends triggers; the scheduler is shut down
    /// when `script` returns. Times in the log are relative to the start.
    async fn drive(log: Log, timing: Timing, script: impl AsyncFnOnce(&Tx)) -> (Instant, Log) {
        let start = Instant::now();
        let (triggers, stream) = mpsc::unbounded();
        let (stop, stopped) = oneshot::channel::<()>();
        let wakes = Wakes::pump(stream, ());
        let scheduler = run(
            wakes,
            timing,
            &(),
            log,
            async {
                let _ = stopped.await;
            },
            async |log: &mut Log, preemption| fake_pass(log, preemption).await,
        );
        let driver = async {
            script(&triggers).await;
            let _ = stop.send(());
        };
        let (log, ()) = tokio::join!(scheduler, driver);
        (start, log.unwrap_or_else(|e| panic!("{e}")))
    }

    fn since(start: Instant, times: &[Instant]) -> Vec<Duration> {
        times.iter().map(|t| *t - start).collect()
    }

    fn send(triggers: &Tx, how: Wake) {
        triggers
            .unbounded_send(how)
            .unwrap_or_else(|e| panic!("{e}"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_of_churn_is_coalesced_into_one_pass() {
        let (start, log) = drive(Log::default(), TIMING, async |triggers: &Tx| {
            tokio::time::sleep(Duration::from_secs(1)).await;
            // Five events 2 ms apart: a DaemonSet's status updated pod by pod.
            for _ in 0..5 {
                send(triggers, Wake::Soon);
                tokio::time::sleep(2 * MS).await;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        })
        .await;
        assert_eq!(
            since(start, &log.started),
            [COALESCE, Duration::from_secs(1) + COALESCE],
            "the first pass, then one for the whole burst, {COALESCE:?} after its first event"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_users_change_starts_a_pass_without_the_coalescing_wait() {
        let (start, log) = drive(Log::default(), TIMING, async |triggers: &Tx| {
            tokio::time::sleep(Duration::from_secs(1)).await;
            send(triggers, Wake::Now);
            tokio::time::sleep(Duration::from_secs(1)).await;
        })
        .await;
        assert_eq!(
            since(start, &log.started),
            [COALESCE, Duration::from_secs(1)]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_users_change_preempts_a_pass_after_its_apply_but_not_twice_in_a_row() {
        let log = Log {
            work: 10 * MS,
            rest: Duration::from_secs(1),
            ..Log::default()
        };
        let (start, log) = drive(log, TIMING, async |triggers: &Tx| {
            // The first pass starts at 20 ms and applies until 30 ms.
            tokio::time::sleep(50 * MS).await;
            send(triggers, Wake::Now);
            // The second pass starts at once; a change during its rest does not stop it.
            tokio::time::sleep(50 * MS).await;
            send(triggers, Wake::Now);
            tokio::time::sleep(Duration::from_secs(3)).await;
        })
        .await;
        assert_eq!(log.preempted, [true, false, false]);
        assert_eq!(log.preemptible, [true, false, true]);
        assert_eq!(
            since(start, &log.started),
            [
                COALESCE,
                50 * MS,
                // The second pass ran whole: apply and rest; the change it saw starts the next
                // one at once.
                60 * MS + Duration::from_secs(1),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_pass_past_its_deadline_is_abandoned_and_retried_with_backoff() {
        let log = Log {
            rest: Duration::from_secs(10),
            ..Log::default()
        };
        let timing = Timing {
            deadline: Duration::from_secs(3),
            ..TIMING
        };
        let (start, log) = drive(log, timing, async |_: &Tx| {
            tokio::time::sleep(Duration::from_secs(5)).await;
        })
        .await;
        assert!(
            log.finished.is_empty(),
            "no pass ran to its end: {:?}",
            since(start, &log.finished)
        );
        let deadline = Duration::from_secs(3);
        assert_eq!(
            since(start, &log.started),
            [
                COALESCE,
                COALESCE + deadline + Duration::from_secs(1) + COALESCE
            ],
            "abandoned at the deadline, tried again after the first backoff"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn backoff_doubles_from_one_second_to_its_ceiling() {
        let failed = PassOutcome {
            failed: true,
            ..PassOutcome::default()
        };
        let mut script = vec![failed; 8];
        script.push(PassOutcome::default());
        let log = Log {
            script,
            ..Log::default()
        };
        let (_, log) = drive(log, TIMING, async |_: &Tx| {
            tokio::time::sleep(Duration::from_secs(300)).await;
        })
        .await;
        let gaps: Vec<u64> = log
            .started
            .windows(2)
            .map(|w| (w[1] - w[0] - COALESCE).as_secs())
            .collect();
        // Eight failures, then a success that asks for nothing: the loop sleeps after it.
        assert_eq!(gaps, [1, 2, 4, 8, 16, 32, 32, 32]);
        assert!((1..=100).all(|n| backoff(n) <= BACKOFF_CAP));
    }

    #[tokio::test(start_paused = true)]
    async fn a_success_resets_the_backoff() {
        let failed = PassOutcome {
            failed: true,
            ..PassOutcome::default()
        };
        let ok = PassOutcome::default();
        let log = Log {
            script: vec![failed, failed, failed, ok, failed, ok],
            ..Log::default()
        };
        let (_, log) = drive(log, TIMING, async |triggers: &Tx| {
            // Three failures (1 + 2 + 4 s), then the success at 7 s; a change wakes the fifth.
            tokio::time::sleep(Duration::from_secs(10)).await;
            send(triggers, Wake::Soon);
            tokio::time::sleep(Duration::from_secs(10)).await;
        })
        .await;
        let gaps: Vec<u64> = log
            .started
            .windows(2)
            .map(|w| (w[1] - w[0] - COALESCE).as_millis() as u64)
            .collect();
        assert_eq!(gaps.len(), 5, "{gaps:?}");
        assert_eq!(&gaps[..3], [1000, 2000, 4000]);
        assert_eq!(gaps[4], 1000, "the failure after a success waits 1 s again");
    }

    #[tokio::test(start_paused = true)]
    async fn a_pass_runs_again_at_the_earliest_time_asked_for() {
        let asked = |secs: u64, failed: bool| PassOutcome {
            requeue: Some(Duration::from_secs(secs)),
            failed,
            preempted: false,
        };
        // One controller asks for 30 s, another for 5 s: the pass asks for the earlier.
        let both = asked(30, false).and(asked(5, false));
        assert_eq!(both.requeue, Some(Duration::from_secs(5)));
        assert_eq!(
            PassOutcome::default().and(asked(7, true)),
            asked(7, true),
            "no requeue and 7 s is 7 s; a failure in either part fails the pass"
        );
        let failing_soon = PassOutcome {
            requeue: Some(300 * MS),
            failed: true,
            preempted: false,
        };
        let log = Log {
            script: vec![both, failing_soon, PassOutcome::default()],
            ..Log::default()
        };
        let (start, log) = drive(log, TIMING, async |_: &Tx| {
            tokio::time::sleep(Duration::from_secs(60)).await;
        })
        .await;
        assert_eq!(
            since(start, &log.started),
            [
                COALESCE,
                COALESCE + Duration::from_secs(5) + COALESCE,
                // A failed pass asking for 300 ms comes back then, before its 1 s backoff.
                2 * COALESCE + Duration::from_secs(5) + 300 * MS + COALESCE,
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_steady_loop_sets_no_timer() {
        let (_, log) = drive(Log::default(), TIMING, async |_: &Tx| {
            tokio::time::sleep(Duration::from_secs(24 * 3600)).await;
        })
        .await;
        assert_eq!(log.started.len(), 1, "a day without events: one pass");
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_finishes_the_pass_in_flight() {
        let log = Log {
            rest: Duration::from_secs(5),
            script: vec![PassOutcome {
                requeue: Some(Duration::ZERO),
                ..PassOutcome::default()
            }],
            ..Log::default()
        };
        let (start, log) = drive(log, TIMING, async |_: &Tx| {
            tokio::time::sleep(Duration::from_secs(1)).await;
        })
        .await;
        assert_eq!(
            since(start, &log.finished),
            [COALESCE + Duration::from_secs(5)],
            "the pass under way at the shutdown ran to its end"
        );
        assert_eq!(
            log.started.len(),
            1,
            "and no pass started after the shutdown"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_loop_ends_with_an_error_when_the_watches_end() {
        let (triggers, stream) = mpsc::unbounded::<Wake>();
        let wakes = Wakes::pump(stream, ());
        drop(triggers);
        let ended = run(
            wakes,
            TIMING,
            &(),
            Log::default(),
            std::future::pending(),
            async |log: &mut Log, p| fake_pass(log, p).await,
        )
        .await;
        assert!(ended.is_err());
    }
}
