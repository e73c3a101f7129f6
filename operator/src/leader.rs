//! Leader election (IO around a pure core): one Lease in the operator namespace decides which
//! replica writes, and a write gate makes sure a replica that may have lost it writes nothing.
//!
//! Guarantees and caveats:
//! - Every Lease write is a full update carrying the `resourceVersion` it was computed from, so
//!   two replicas can never both take the Lease, and a late renewal of a deposed leader fails
//!   with a conflict instead of extending the new leader's Lease.
//! - A standby takes the Lease only after it has seen the holder's renewal stand unchanged for
//!   the whole lease duration, measured on its own monotonic clock from when it saw it (clock
//!   skew between replicas does not matter).
//! - The leader's write gate ([`WriteGate`]) is open only until its last successful renewal
//!   (timed from when that request was sent) is older than the lease duration less a safety
//!   margin. A standby can take over no sooner than a full duration after that renewal, so the
//!   old leader stops at least the margin before the new one starts, whether its renewals fail,
//!   hang, or the process was frozen (SIGSTOP) and resumed.
//! - API errors never end the process: a leader keeps renewing until its window closes, then
//!   steps down and waits as a standby; a standby keeps waiting. Every Lease call is bounded by
//!   a timeout, so a renewal that hangs cannot hold the window open.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, ObjectMeta, PostParams};

/// The Lease and how this replica uses it.
#[derive(Clone, Debug)]
pub struct LeaseSettings {
    pub name: String,
    pub namespace: String,
    pub identity: String,
    /// How long a Lease stays valid without renewal.
    pub duration: Duration,
}

impl LeaseSettings {
    /// The leader renews three times per duration, so two renewals may fail before the window
    /// closes.
    pub fn renew_interval(&self) -> Duration {
        (self.duration / 3).max(Duration::from_millis(500))
    }

    /// The longest one Lease call may take (a renewal that hangs fails after this).
    pub fn call_timeout(&self) -> Duration {
        (self.duration / 5).max(Duration::from_secs(1))
    }

    /// How long before its Lease would expire the leader stops writing: long enough for a
    /// write sent just before the gate closed to be done before a standby can start.
    pub fn safety_margin(&self) -> Duration {
        (self.duration / 5).max(Duration::from_secs(1))
    }

    /// How long after a successful renewal the leader may write.
    pub fn write_window(&self) -> Duration {
        self.duration.saturating_sub(self.safety_margin())
    }

    /// How often a standby looks at the Lease.
    fn poll_interval(&self) -> Duration {
        self.renew_interval().min(Duration::from_secs(2))
    }
}

/// Whether a write may be sent at `now`, given when the last successful renewal was sent.
pub fn write_allowed(last_renewal: Option<Instant>, window: Duration, now: Instant) -> bool {
    last_renewal.is_some_and(|at| now < at + window)
}

/// Whether this replica may write: always without leader election, else only inside the window
/// after its last successful renewal. Cheap to clone; checked on every mutating request
/// ([`crate::client`]).
#[derive(Clone, Debug)]
pub struct WriteGate {
    inner: Arc<GateInner>,
}

#[derive(Debug)]
struct GateInner {
    /// `None`: no leader election, always open.
    window: Option<Duration>,
    base: Instant,
    /// Milliseconds after `base` at which the last successful renewal was sent, plus one; 0
    /// while this replica does not lead.
    renewed: AtomicU64,
}

impl WriteGate {
    /// The gate of a single replica without leader election.
    pub fn always_open() -> Self {
        Self::new(None)
    }

    /// A leader's gate, closed until the first successful acquisition.
    pub fn leased(window: Duration) -> Self {
        Self::new(Some(window))
    }

    fn new(window: Option<Duration>) -> Self {
        WriteGate {
            inner: Arc::new(GateInner {
                window,
                base: Instant::now(),
                renewed: AtomicU64::new(0),
            }),
        }
    }

    /// A renewal (or acquisition) sent at `sent` succeeded.
    pub fn renewed(&self, sent: Instant) {
        let ms = sent.saturating_duration_since(self.inner.base).as_millis();
        let ms = u64::try_from(ms).unwrap_or(u64::MAX - 1) + 1;
        // Never move backwards: an older renewal that completes late changes nothing.
        self.inner.renewed.fetch_max(ms, Ordering::SeqCst);
    }

    /// Closes the gate at once (the Lease was seen held by another, or released).
    pub fn close(&self) {
        self.inner.renewed.store(0, Ordering::SeqCst);
    }

    fn last_renewal(&self) -> Option<Instant> {
        match self.inner.renewed.load(Ordering::SeqCst) {
            0 => None,
            ms => Some(self.inner.base + Duration::from_millis(ms - 1)),
        }
    }

    /// When the gate closes unless renewed again (`None`: closed, or no leader election).
    pub fn closes_at(&self) -> Option<Instant> {
        let window = self.inner.window?;
        self.last_renewal().map(|at| at + window)
    }

    pub fn is_open(&self) -> bool {
        match self.inner.window {
            None => true,
            Some(window) => write_allowed(self.last_renewal(), window, Instant::now()),
        }
    }
}

/// The Lease as a replica last saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    pub holder: Option<String>,
    pub renew_time: Option<MicroTime>,
    pub duration: Duration,
    /// When this replica first saw this holder with this renew time.
    pub since: Instant,
}

impl Seen {
    /// What `lease` shows at `now`, keeping `previous.since` when nothing moved.
    pub fn update(previous: Option<&Seen>, lease: &Lease, default: Duration, now: Instant) -> Seen {
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.filter(|h| !h.is_empty());
        let renew_time = spec.renew_time;
        let duration = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map_or(default, Duration::from_secs);
        let since = match previous {
            Some(p) if p.holder == holder && p.renew_time == renew_time => p.since,
            _ => now,
        };
        Seen {
            holder,
            renew_time,
            duration,
            since,
        }
    }
}

/// What a replica that does not lead does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Standby {
    /// The Lease is free, expired, or names this identity (a previous run of this pod): take it.
    Take,
    /// Someone else holds it: look again after this long.
    Wait(Duration),
}

/// The standby's decision: take the Lease once the holder's last renewal has stood unchanged
/// for the whole lease duration on this replica's clock.
pub fn standby_step(seen: &Seen, identity: &str, now: Instant) -> Standby {
    match seen.holder.as_deref() {
        None => Standby::Take,
        Some(holder) if holder == identity => Standby::Take,
        Some(_) => {
            let expires = seen.since + seen.duration;
            if now >= expires {
                Standby::Take
            } else {
                Standby::Wait(expires - now)
            }
        }
    }
}

/// Why a leader stopped leading.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lost {
    /// No renewal succeeded within the write window (API errors, timeouts, a frozen process).
    WindowClosed,
    /// Another replica holds the Lease.
    TakenBy(String),
}

impl std::fmt::Display for Lost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Lost::WindowClosed => write!(
                f,
                "no Lease renewal succeeded within the lease duration less the safety margin"
            ),
            Lost::TakenBy(holder) => write!(f, "the Lease is held by {holder}"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Lease {namespace}/{name}: {source}")]
    Api {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("Lease {namespace}/{name}: no answer within {timeout:?}")]
    Timeout {
        namespace: String,
        name: String,
        timeout: Duration,
    },
}

/// Runs this replica's side of the election.
pub struct Elector {
    api: Api<Lease>,
    settings: LeaseSettings,
    gate: WriteGate,
    /// The Lease as last read or written (its `resourceVersion` preconditions the next write).
    lease: Option<Lease>,
    seen: Option<Seen>,
}

impl Elector {
    /// `client` must not be gated by `gate` (Lease writes open it).
    pub fn new(client: kube::Client, settings: LeaseSettings, gate: WriteGate) -> Self {
        Elector {
            api: Api::namespaced(client, &settings.namespace),
            settings,
            gate,
            lease: None,
            seen: None,
        }
    }

    pub fn settings(&self) -> &LeaseSettings {
        &self.settings
    }

    /// Bounds one Lease call by [`LeaseSettings::call_timeout`].
    async fn call<T>(
        &self,
        request: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, Error> {
        let timeout = self.settings.call_timeout();
        match tokio::time::timeout(timeout, request).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(source)) => Err(Error::Api {
                namespace: self.settings.namespace.clone(),
                name: self.settings.name.clone(),
                source,
            }),
            Err(_) => Err(Error::Timeout {
                namespace: self.settings.namespace.clone(),
                name: self.settings.name.clone(),
                timeout,
            }),
        }
    }

    /// The Lease spec that names this replica as holder, renewed now.
    fn held_spec(&self, previous: Option<&LeaseSpec>, taking: bool) -> LeaseSpec {
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let transitions = previous.and_then(|s| s.lease_transitions).unwrap_or(0);
        let was_mine =
            previous.and_then(|s| s.holder_identity.as_deref()) == Some(&self.settings.identity);
        LeaseSpec {
            holder_identity: Some(self.settings.identity.clone()),
            lease_duration_seconds: Some(
                i32::try_from(self.settings.duration.as_secs()).unwrap_or(i32::MAX),
            ),
            acquire_time: if taking && !was_mine {
                Some(now.clone())
            } else {
                previous.and_then(|s| s.acquire_time.clone())
            },
            renew_time: Some(now),
            lease_transitions: Some(if taking && !was_mine {
                transitions + 1
            } else {
                transitions
            }),
            ..LeaseSpec::default()
        }
    }

    /// Writes the Lease with this replica as holder, preconditioned on the version last seen
    /// (or creates it). `Ok(false)`: someone else wrote it first.
    async fn write_held(&mut self, taking: bool) -> Result<bool, Error> {
        let sent = Instant::now();
        let result = match self.lease.clone() {
            Some(mut lease) => {
                lease.spec = Some(self.held_spec(lease.spec.as_ref(), taking));
                let name = self.settings.name.clone();
                self.call(self.api.replace(&name, &PostParams::default(), &lease))
                    .await
            }
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.settings.name.clone()),
                        namespace: Some(self.settings.namespace.clone()),
                        ..ObjectMeta::default()
                    },
                    spec: Some(self.held_spec(None, true)),
                };
                self.call(self.api.create(&PostParams::default(), &lease))
                    .await
            }
        };
        match result {
            Ok(written) => {
                self.gate.renewed(sent);
                self.lease = Some(written);
                Ok(true)
            }
            Err(Error::Api {
                source: kube::Error::Api(e),
                ..
            }) if e.code == 409 => {
                // Written (or created) by someone else since we read it: read again.
                self.lease = None;
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Reads the Lease (`None` when it does not exist) and updates what this replica has seen.
    async fn read(&mut self) -> Result<Option<Seen>, Error> {
        let name = self.settings.name.clone();
        let lease = self.call(self.api.get_opt(&name)).await?;
        self.lease = lease.clone();
        Ok(lease.map(|lease| {
            let seen = Seen::update(
                self.seen.as_ref(),
                &lease,
                self.settings.duration,
                Instant::now(),
            );
            self.seen = Some(seen.clone());
            seen
        }))
    }

    /// One standby step: read, and take the Lease when [`standby_step`] says so. Returns how
    /// long to wait before the next step, or `None` once this replica holds the Lease.
    async fn try_acquire(&mut self) -> Result<Option<Duration>, Error> {
        let poll = self.settings.poll_interval();
        let Some(seen) = self.read().await? else {
            return Ok(if self.write_held(true).await? {
                None
            } else {
                Some(poll)
            });
        };
        match standby_step(&seen, &self.settings.identity, Instant::now()) {
            Standby::Take => Ok(if self.write_held(true).await? {
                None
            } else {
                Some(poll)
            }),
            Standby::Wait(left) => Ok(Some(left.min(poll))),
        }
    }

    /// Waits as a standby until this replica holds the Lease (the gate is open then). API errors
    /// and timeouts are logged and retried; they never end the wait.
    pub async fn acquire(&mut self) {
        let mut failures: u32 = 0;
        loop {
            let wait = match self.try_acquire().await {
                Ok(None) => return,
                Ok(Some(wait)) => {
                    failures = 0;
                    wait
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    tracing::warn!(error = %e, failures, "reading or taking the leader Lease failed; retrying");
                    self.settings.poll_interval()
                }
            };
            tokio::time::sleep(wait).await;
        }
    }

    /// Renews while leading. Returns when leadership is lost: the write window closed without a
    /// successful renewal (the gate is closed by then), or another replica holds the Lease.
    pub async fn keep(&mut self) -> Lost {
        let interval = self.settings.renew_interval();
        loop {
            let next = match self.renew().await {
                Ok(()) => Instant::now() + interval,
                Err(Some(lost)) => {
                    self.gate.close();
                    return lost;
                }
                Err(None) => {
                    // Try again soon, but not in a hot loop.
                    Instant::now() + (interval / 3).max(Duration::from_millis(200))
                }
            };
            let Some(closes) = self.gate.closes_at() else {
                return Lost::WindowClosed;
            };
            if Instant::now() >= closes {
                self.gate.close();
                return Lost::WindowClosed;
            }
            tokio::time::sleep_until(next.min(closes).into()).await;
            if !self.gate.is_open() {
                self.gate.close();
                return Lost::WindowClosed;
            }
        }
    }

    /// One renewal. `Err(Some(_))`: leadership is lost; `Err(None)`: this renewal failed (the
    /// window may still be open).
    async fn renew(&mut self) -> Result<(), Option<Lost>> {
        if self.lease.is_none() {
            match self.read().await {
                Ok(Some(seen)) if seen.holder.as_deref() != Some(&self.settings.identity) => {
                    return Err(Some(Lost::TakenBy(
                        seen.holder.unwrap_or_else(|| "nobody".into()),
                    )));
                }
                Ok(Some(_)) => {}
                Ok(None) => return Err(Some(Lost::TakenBy("nobody (deleted)".into()))),
                Err(e) => {
                    tracing::warn!(error = %e, closes_in = ?self.closes_in(), "reading the leader Lease failed; still leading until the window closes");
                    return Err(None);
                }
            }
        }
        match self.write_held(false).await {
            Ok(true) => Ok(()),
            Ok(false) => {
                tracing::info!("the leader Lease changed under us; reading it again");
                Err(None)
            }
            Err(e) => {
                tracing::warn!(error = %e, closes_in = ?self.closes_in(), "renewing the leader Lease failed; still leading until the window closes");
                Err(None)
            }
        }
    }

    fn closes_in(&self) -> Option<Duration> {
        self.gate
            .closes_at()
            .map(|at| at.saturating_duration_since(Instant::now()))
    }

    /// Gives the Lease up so a standby takes over at once (on shutdown, after the controller
    /// stopped). Only a Lease that still names this replica, at the version last written, is
    /// released.
    pub async fn release(&mut self) -> Result<(), Error> {
        self.gate.close();
        let Some(mut lease) = self.lease.clone() else {
            return Ok(());
        };
        if lease
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.as_deref())
            != Some(&self.settings.identity)
        {
            return Ok(());
        }
        if let Some(spec) = lease.spec.as_mut() {
            spec.holder_identity = None;
            spec.renew_time = None;
            spec.acquire_time = None;
        }
        let name = self.settings.name.clone();
        self.call(self.api.replace(&name, &PostParams::default(), &lease))
            .await?;
        self.lease = None;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(seconds: u64) -> LeaseSettings {
        LeaseSettings {
            name: "l".into(),
            namespace: "ns".into(),
            identity: "me".into(),
            duration: Duration::from_secs(seconds),
        }
    }

    fn seen(holder: Option<&str>, since: Instant) -> Seen {
        Seen {
            holder: holder.map(str::to_owned),
            renew_time: None,
            duration: Duration::from_secs(15),
            since,
        }
    }

    #[test]
    fn the_leader_stops_writing_a_safety_margin_before_a_standby_may_take_over() {
        let s = settings(15);
        assert_eq!(s.safety_margin(), Duration::from_secs(3));
        assert_eq!(s.write_window(), Duration::from_secs(12));
        assert_eq!(s.renew_interval(), Duration::from_secs(5));
        assert!(s.call_timeout() < s.renew_interval());
        let renewed = Instant::now();
        let window = s.write_window();
        assert!(write_allowed(Some(renewed), window, renewed));
        assert!(write_allowed(
            Some(renewed),
            window,
            renewed + Duration::from_millis(11_999)
        ));
        assert!(!write_allowed(Some(renewed), window, renewed + window));
        assert!(!write_allowed(None, window, renewed));
        // A standby that saw that very renewal at once may take over only a full duration
        // later: the margin separates the last write from the first of the new leader.
        let observed = seen(Some("old"), renewed);
        assert_eq!(
            standby_step(&observed, "new", renewed + window),
            Standby::Wait(s.safety_margin())
        );
        assert_eq!(
            standby_step(&observed, "new", renewed + s.duration),
            Standby::Take
        );
    }

    #[test]
    fn short_leases_keep_a_margin_of_at_least_a_second() {
        let s = settings(2);
        assert_eq!(s.safety_margin(), Duration::from_secs(1));
        assert_eq!(s.write_window(), Duration::from_secs(1));
    }

    #[test]
    fn a_standby_takes_a_free_or_own_lease_at_once_and_waits_out_a_held_one() {
        let t0 = Instant::now();
        assert_eq!(standby_step(&seen(None, t0), "me", t0), Standby::Take);
        assert_eq!(standby_step(&seen(Some("me"), t0), "me", t0), Standby::Take);
        assert_eq!(
            standby_step(&seen(Some("other"), t0), "me", t0 + Duration::from_secs(5)),
            Standby::Wait(Duration::from_secs(10))
        );
    }

    #[test]
    fn the_standby_clock_restarts_when_the_holder_renews() {
        let t0 = Instant::now();
        let lease = |renew: i64| Lease {
            spec: Some(LeaseSpec {
                holder_identity: Some("other".into()),
                renew_time: Some(MicroTime(
                    k8s_openapi::jiff::Timestamp::from_second(renew).unwrap(),
                )),
                lease_duration_seconds: Some(15),
                ..LeaseSpec::default()
            }),
            ..Lease::default()
        };
        let first = Seen::update(None, &lease(100), Duration::from_secs(9), t0);
        assert_eq!(first.since, t0);
        assert_eq!(first.duration, Duration::from_secs(15));
        let same = Seen::update(
            Some(&first),
            &lease(100),
            Duration::from_secs(9),
            t0 + Duration::from_secs(10),
        );
        assert_eq!(same.since, t0, "an unchanged renewal keeps counting");
        let renewed = Seen::update(
            Some(&same),
            &lease(105),
            Duration::from_secs(9),
            t0 + Duration::from_secs(11),
        );
        assert_eq!(renewed.since, t0 + Duration::from_secs(11));
    }

    #[test]
    fn the_gate_opens_on_renewal_closes_after_the_window_and_never_moves_back() {
        let gate = WriteGate::leased(Duration::from_secs(12));
        assert!(!gate.is_open(), "closed before the Lease is held");
        let now = Instant::now();
        gate.renewed(now);
        assert!(gate.is_open());
        let closes = gate.closes_at().unwrap();
        assert!(closes >= now + Duration::from_millis(11_990));
        // A slower, older renewal completing late does not move the window back.
        gate.renewed(now - Duration::from_secs(5));
        assert_eq!(gate.closes_at(), Some(closes));
        gate.close();
        assert!(!gate.is_open());
        // Renewed longer ago than the window: closed.
        let stale = WriteGate::leased(Duration::from_millis(10));
        stale.renewed(Instant::now());
        std::thread::sleep(Duration::from_millis(30));
        assert!(!stale.is_open());
        assert!(WriteGate::always_open().is_open());
    }
}
