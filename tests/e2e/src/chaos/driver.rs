//! The chaos run (IO): two operator replicas on the generated RBAC, a policy with a sharing
//! config and MIG layouts of the user's, then faults drawn from the seeded PRNG, each followed
//! by the invariant checker.
//!
//! Faults come in rounds: each round is a seeded shuffle of every kind, so a short run of 20
//! injects each kind once. After a fault the driver restarts replicas that exited (as a
//! Deployment would), and waits, bounded, until the invariants of [`super::checker`] hold and
//! then hold through a quiet window in which neither replica writes (Lease renewals aside). Over
//! the whole run no replica may write without holding the Lease ([`super::split_brain`]).

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kube::Client;
use kube::api::DeleteParams;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use super::checker;
use super::faults::{
    self, Fault, FaultSettings, MIG_CONFIG, SHARING_CONFIG, World, mig_config, sharing_config,
};
use super::replicas::{LEASE, ReplicaSettings, Replicas};
use super::report::Report;
use super::split_brain::LeaseFollower;
use crate::audit::{AuditLog, Mark, described_writes};
use crate::cluster::unique_name;
use crate::faults::ControlPlane;
use crate::session::{self, create_policy, policies};

/// A convergence slower than this prints what it waited on.
const SLOW: Duration = Duration::from_secs(20);

/// How a run goes; [`Settings::from_env`] reads it.
#[derive(Clone, Debug)]
pub struct Settings {
    pub faults: usize,
    pub seed: u64,
    pub lease_seconds: u64,
    pub gpu_label_grace_seconds: u64,
    /// Seconds etcd stays stopped, drawn from this range.
    pub etcd_stop_seconds: (u64, u64),
    /// How long neither replica may write once the invariants hold.
    pub quiet: Duration,
    /// Bound on convergence after one fault.
    pub converge_timeout: Duration,
    /// Exits of one replica during one fault that count as a crash loop.
    pub crash_loop_exits: u32,
    /// Kinds left out (`CHAOS_SKIP`, their Debug names, comma-separated): a kind whose fix is
    /// pending, so a long run measures the others.
    pub skip: Vec<Fault>,
}

fn env_number(name: &str) -> Result<Option<u64>> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(
            v.trim()
                .parse()
                .with_context(|| format!("{name}={v} is not a number"))?,
        )),
        Err(_) => Ok(None),
    }
}

impl Settings {
    /// `CHAOS_FAULTS` (else `default_faults`), `CHAOS_SEED` (else random),
    /// `CHAOS_ETCD_MAX_SECONDS` (else 5 for up to 30 faults, 60 above).
    pub fn from_env(default_faults: usize) -> Result<Self> {
        let faults = env_number("CHAOS_FAULTS")?.map_or(default_faults, |n| n as usize);
        let seed = env_number("CHAOS_SEED")?.unwrap_or_else(rand::random);
        let etcd_max = env_number("CHAOS_ETCD_MAX_SECONDS")?
            .unwrap_or(if faults <= 30 { 5 } else { 60 })
            .max(5);
        let skip_names = std::env::var("CHAOS_SKIP").unwrap_or_default();
        let mut skip = Vec::new();
        for name in skip_names
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
        {
            let fault = Fault::DRAWN
                .into_iter()
                .find(|f| format!("{f:?}") == name)
                .with_context(|| {
                    format!("CHAOS_SKIP: no fault {name}; known: {:?}", Fault::DRAWN)
                })?;
            skip.push(fault);
        }
        Ok(Settings {
            faults,
            skip,
            seed,
            lease_seconds: 10,
            gpu_label_grace_seconds: 6,
            etcd_stop_seconds: (5, etcd_max),
            quiet: Duration::from_secs(3),
            converge_timeout: Duration::from_secs(240),
            crash_loop_exits: 3,
        })
    }
}

/// The order of faults: rounds of every drawn kind but `skip`, each round shuffled.
pub fn schedule(rng: &mut StdRng, count: usize, skip: &[Fault]) -> Vec<Fault> {
    let kinds: Vec<Fault> = Fault::DRAWN
        .into_iter()
        .filter(|f| !skip.contains(f))
        .collect();
    if kinds.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(count);
    while out.len() < count {
        let mut round = kinds.clone();
        for i in (1..round.len()).rev() {
            let j = rng.random_range(0..=i);
            round.swap(i, j);
        }
        out.extend(round);
    }
    out.truncate(count);
    out
}

/// Runs the chaos suite against the harness of the environment and returns what it measured.
/// Every failure names the seed and the fault.
pub async fn run(settings: Settings) -> Result<Report> {
    println!(
        "chaos: seed {} ({} faults, skipping {:?}); replay with CHAOS_SEED={}",
        settings.seed, settings.faults, settings.skip, settings.seed
    );
    let admin = crate::client().await?;
    crate::crd::install_cluster_policy_crd(&admin, "e2e-chaos").await?;
    session::remove_leftovers(&admin).await;
    let audit = AuditLog::from_env()?;
    let start_mark = audit.mark()?;
    let replicas = Replicas::create(
        &admin,
        ReplicaSettings {
            lease_seconds: settings.lease_seconds,
            gpu_label_grace_seconds: settings.gpu_label_grace_seconds,
        },
    )
    .await?;
    let mut world = World {
        admin: admin.clone(),
        replicas,
        control_plane: ControlPlane::from_env()?,
        policy: unique_name("chaos-policy"),
        rng: StdRng::seed_from_u64(settings.seed),
        settings: FaultSettings {
            lease_seconds: settings.lease_seconds,
            gpu_label_grace_seconds: settings.gpu_label_grace_seconds,
            etcd_stop_seconds: settings.etcd_stop_seconds,
        },
        added_nodes: Vec::new(),
        sharing_replicas: 4,
        mig_layouts: 0,
        edits: 0,
    };
    let mut run = Run {
        settings: &settings,
        audit,
        mark: start_mark,
        follower: LeaseFollower::new(LEASE, Duration::from_secs(settings.lease_seconds)),
        report: Report {
            seed: settings.seed,
            ..Report::default()
        },
    };
    let outcome = run.faults(&mut world).await;
    let cleanup = teardown(world).await;
    let report = outcome.map(|()| run.report)?;
    cleanup?;
    Ok(report)
}

struct Run<'a> {
    settings: &'a Settings,
    audit: AuditLog,
    /// Where the split-brain check has read the audit log up to.
    mark: Mark,
    follower: LeaseFollower,
    report: Report,
}

impl Run<'_> {
    async fn faults(&mut self, world: &mut World) -> Result<()> {
        let namespace = world.replicas.namespace().to_owned();
        faults::write_config_map(
            &world.admin,
            &namespace,
            SHARING_CONFIG,
            "time-slicing",
            &sharing_config(world.sharing_replicas),
        )
        .await?;
        faults::write_config_map(
            &world.admin,
            &namespace,
            MIG_CONFIG,
            "config.yaml",
            &mig_config(world.mig_layouts),
        )
        .await?;
        world.replicas.start_all()?;
        create_policy(&world.admin, &world.policy, faults::policy_spec()).await;

        let mut plan = vec![Fault::KillLeaderFirstRollout];
        plan.extend(schedule(
            &mut world.rng,
            self.settings.faults.saturating_sub(1),
            &self.settings.skip,
        ));
        let (seed, total) = (self.settings.seed, self.settings.faults);
        for (index, fault) in plan.into_iter().enumerate() {
            let context = |e: anyhow::Error| {
                e.context(format!(
                    "chaos seed {seed} (replay with CHAOS_SEED={seed}), fault {} of {total}: {}",
                    index + 1,
                    fault.name()
                ))
            };
            let exits_before = exits(&world.replicas);
            let what = world
                .inject(fault)
                .await
                .map_err(|e| context(e.context(world.replicas.log_tails(15))))?;
            let lifted = Instant::now();
            let converged = self
                .converge(world)
                .await
                .map_err(|e| context(e.context(world.replicas.log_tails(25))))?;
            let took = converged.duration_since(lifted);
            let split = self.split_brain(world).map_err(context)?;
            if !split.is_empty() {
                return Err(context(anyhow::anyhow!(
                    "writes without the Lease:\n{}",
                    split.join("\n")
                )));
            }
            let exited = exits(&world.replicas) - exits_before;
            self.report.record(fault, took, exited);
            println!(
                "chaos [{}/{}] {}: {what}; converged in {:.1}s{}",
                index + 1,
                self.settings.faults,
                fault.name(),
                took.as_secs_f64(),
                if exited > 0 {
                    format!(" ({exited} replica exits)")
                } else {
                    String::new()
                }
            );
        }
        self.report.writes = self.follower.writes.clone();
        Ok(())
    }

    /// Waits until the invariants hold and then hold through a quiet window; returns when they
    /// first held in the successful attempt. Restarts exited replicas meanwhile; a replica that
    /// exits again and again fails the run.
    async fn converge(&mut self, world: &mut World) -> Result<Instant> {
        let started = Instant::now();
        let exits_at_start: Vec<u32> = world
            .replicas
            .slots
            .iter()
            .map(|s| s.unexpected_exits)
            .collect();
        let mut last = String::new();
        let users = world.replicas.usernames();
        while started.elapsed() < self.settings.converge_timeout {
            for line in world.replicas.supervise()? {
                println!("chaos: {line}");
            }
            for (slot, at_start) in world.replicas.slots.iter().zip(&exits_at_start) {
                anyhow::ensure!(
                    slot.unexpected_exits - at_start <= self.settings.crash_loop_exits,
                    "{} crash-loops: it exited {} times since the fault",
                    slot.name,
                    slot.unexpected_exits - at_start
                );
            }
            let verdict = tokio::time::timeout(
                Duration::from_secs(30),
                checker::check(&world.admin, world.replicas.namespace(), &world.policy),
            )
            .await;
            let mut problems = match verdict {
                Ok(Ok(v)) => v.problems,
                Ok(Err(e)) => vec![format!("checking failed: {e:#}")],
                Err(_) => vec!["checking took over 30s".to_owned()],
            };
            // Nothing changes without an operator, so the invariants alone would hold with
            // both replicas down: one must hold a fresh Lease.
            match world.replicas.live_leader().await {
                Ok(Some(_)) => {}
                Ok(None) => problems.push("no running replica holds a fresh Lease".to_owned()),
                Err(e) => problems.push(format!("reading the Lease: {e}")),
            }
            if problems.is_empty() {
                let held = Instant::now();
                let mark = self.audit.mark()?;
                tokio::time::sleep(self.settings.quiet).await;
                let mut writes = Vec::new();
                for user in &users {
                    writes.extend(described_writes(&self.audit.of_user_since(mark, user)?));
                }
                let again = checker::check(&world.admin, world.replicas.namespace(), &world.policy)
                    .await
                    .map(|v| v.problems)
                    .unwrap_or_else(|e| vec![format!("checking failed: {e:#}")]);
                if writes.is_empty() && again.is_empty() {
                    // What a slow convergence waited on, for whoever reads the run's log.
                    if held.duration_since(started) > SLOW && !last.is_empty() {
                        println!(
                            "chaos: slow convergence ({:.1}s), last waited on:\n  {last}",
                            held.duration_since(started).as_secs_f64()
                        );
                    }
                    return Ok(held);
                }
                last = format!("in the quiet window: writes {writes:?}, problems {again:?}");
            } else {
                last = problems.join("\n  ");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let counted: Vec<String> = world
            .replicas
            .slots
            .iter()
            .map(|s| format!("{}: {} exits", s.name, s.unexpected_exits))
            .collect();
        anyhow::bail!(
            "not converged within {:?} ({}); last seen:\n  {last}",
            self.settings.converge_timeout,
            counted.join(", ")
        )
    }

    /// Reads the audit log since the last call and returns every write made without the Lease.
    fn split_brain(&mut self, world: &World) -> Result<Vec<String>> {
        let mark = self.audit.mark()?;
        let events = self.audit.since(self.mark)?;
        self.mark = mark;
        Ok(self.follower.follow(&events, &world.replicas.usernames()))
    }
}

fn exits(replicas: &Replicas) -> u32 {
    replicas.slots.iter().map(|s| s.unexpected_exits).sum()
}

/// Deletes the policy (its operands are collected), the added nodes, the replicas and their
/// identity; every step is tried even when one fails.
async fn teardown(world: World) -> Result<()> {
    let World {
        admin,
        replicas,
        policy,
        added_nodes,
        ..
    } = world;
    let mut errors = Vec::new();
    if let Err(e) = crate::chaos::remove_all(&admin).await {
        errors.push(format!("crash-loop stages: {e}"));
    }
    if let Err(e) = policies(&admin)
        .delete(&policy, &DeleteParams::default())
        .await
    {
        errors.push(format!("policy: {e}"));
    }
    if let Err(e) = crate::nodes::delete(&admin, &added_nodes).await {
        errors.push(format!("nodes: {e}"));
    }
    if let Err(e) = await_collected(&admin).await {
        errors.push(format!("operands: {e}"));
    }
    if let Err(e) = replicas.delete().await {
        errors.push(format!("replicas: {e}"));
    }
    anyhow::ensure!(errors.is_empty(), "chaos teardown: {}", errors.join("; "));
    Ok(())
}

async fn await_collected(admin: &Client) -> Result<()> {
    crate::wait::until(session::TIMEOUT, "chaos operands collected", || async {
        let left = checker::live_objects(admin, false).await?.len();
        Ok(if left == 0 {
            Ok(())
        } else {
            Err(format!("{left} left"))
        })
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_the_same_schedule_and_every_kind_once_per_round() {
        let a = schedule(&mut StdRng::seed_from_u64(42), 40, &[]);
        let b = schedule(&mut StdRng::seed_from_u64(42), 40, &[]);
        assert_eq!(a, b);
        let round: std::collections::BTreeSet<Fault> =
            a[..Fault::DRAWN.len()].iter().copied().collect();
        assert_eq!(round.len(), Fault::DRAWN.len());
        assert_ne!(a, schedule(&mut StdRng::seed_from_u64(43), 40, &[]));
        let skipped = schedule(&mut StdRng::seed_from_u64(42), 40, &[Fault::EtcdStop]);
        assert_eq!(skipped.len(), 40);
        assert!(!skipped.contains(&Fault::EtcdStop));
    }
}
