//! The harness's OCI registry and the client that reads it (IO): `tests/cluster/registry.sh`
//! starts distribution's registry on 127.0.0.1 (or finds it running) inside the harness, which
//! stops it with the rest; `oras` is built by `tests/cluster/build.sh oras`. Only the tests that
//! publish start it.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::tools::repo_root;

/// The registry's address (`127.0.0.1:PORT`), started on first use, or `None` when this run has
/// no harness or the registry cannot be built here ([`crate::cluster::prerequisite`]).
pub fn start() -> Option<String> {
    crate::cluster::prerequisite(
        "the harness's OCI registry (tests/cluster/registry.sh) did not start",
        last_line("tests/cluster/registry.sh", &[]),
    )
}

/// The oras binary, or `None` when it cannot be built here.
pub fn oras() -> Option<PathBuf> {
    crate::cluster::prerequisite(
        "oras (tests/cluster/build.sh oras) could not be built",
        last_line("tests/cluster/build.sh", &["oras"]).map(|bin| PathBuf::from(bin).join("oras")),
    )
}

/// Runs `script` of the clone with `args` and returns its stdout (its log goes to stderr).
pub(crate) fn run_script(script: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(repo_root().join(script))
        .args(args)
        .output()
        .with_context(|| format!("running {script}"))?;
    if !out.status.success() {
        bail!("{script} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    }
    String::from_utf8(out.stdout).with_context(|| format!("{script}'s output"))
}

/// Runs `script` of the clone with `args` and returns the last line it printed.
fn last_line(script: &str, args: &[&str]) -> Result<String> {
    run_script(script, args)?
        .lines()
        .last()
        .map(|l| l.trim().to_owned())
        .with_context(|| format!("{script} printed nothing"))
}
