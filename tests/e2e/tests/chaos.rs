//! The chaos suite's short run, part of every end-to-end run: about 20 seeded faults (every kind
//! once, the first a SIGKILL of the leader during the first rollout) against two operator
//! replicas on the generated RBAC, the invariants checked after each (tests/e2e/src/chaos).
//! `make chaos N=100` runs more on a harness of its own. `CHAOS_SEED` replays a run.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use e2e::chaos::driver::{Settings, run};

#[tokio::test]
async fn chaos_short_run_converges_after_every_fault() {
    if e2e::cluster::test_cluster().is_none() {
        return;
    }
    let settings = Settings::from_env(20).unwrap();
    let seed = settings.seed;
    match run(settings).await {
        Ok(report) => println!("{report}"),
        Err(e) => panic!("chaos seed {seed} (replay with CHAOS_SEED={seed}): {e:?}"),
    }
}
