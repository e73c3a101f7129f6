//! Chaos testing against the harness: crash-looping operand pods through kwok Stages
//! ([`CrashLoop`]), and a seeded fault driver ([`driver::run`]) that injects faults one after
//! another into a cluster run by two operator replicas, and after each checks the invariants of
//! [`checker`] once the cluster has converged.
//!
//! Reproducible: every choice comes from one PRNG seeded by `CHAOS_SEED` (random when unset);
//! the seed is printed at the start and in every failure message.

pub mod checker;
mod crash_loop;
pub mod driver;
pub mod faults;
pub mod replicas;
pub mod report;
pub mod split_brain;

pub use crash_loop::{CrashLoop, is_crash_looping, remove_all};
