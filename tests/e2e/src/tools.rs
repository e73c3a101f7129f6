//! The clone and the tools the tests run: where the repository is, a harness binary on PATH,
//! and a checker built (or reused) by one of the project's build scripts.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The root of this clone.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `name` on PATH, symlinks resolved (the harness's bin folder links into the build cache, where
/// some tools keep files beside the binary).
pub fn on_path(name: &str) -> Result<PathBuf> {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "{name} is not on PATH: source $HARNESS_DIR/env (tests/cluster/build.sh builds it)"
            )
        })?
        .canonicalize()
        .with_context(|| format!("resolving {name}"))
}

/// Harness tool `name` (helm, kubectl, ...) for a test that runs it, or `None` when it is not on
/// PATH and the test is to be skipped ([`crate::cluster::prerequisite`]).
pub fn harness_tool(name: &str) -> Option<PathBuf> {
    crate::cluster::prerequisite(&format!("{name} is not on PATH"), on_path(name))
}

/// The checker `script` builds (or reuses), for a test that runs it, or `None` when it cannot
/// be built here (no Go toolchain, no module proxy) and the test is to be skipped
/// ([`crate::cluster::prerequisite`]).
pub fn checker(script: &str) -> Option<PathBuf> {
    crate::cluster::prerequisite(
        &format!("{script} could not build its tool"),
        built_by(script),
    )
}

/// Runs `script` (relative to the clone, e.g. `tests/olm/build.sh`), which builds a tool or
/// reuses its cached build and prints the binary's path as its last line; that path.
pub fn built_by(script: &str) -> Result<PathBuf> {
    let out = Command::new(repo_root().join(script))
        .output()
        .with_context(|| format!("running {script}"))?;
    if !out.status.success() {
        bail!("{script} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    }
    let stdout = String::from_utf8(out.stdout).with_context(|| format!("{script}'s output"))?;
    let path = stdout
        .lines()
        .last()
        .with_context(|| format!("{script} printed no path"))?;
    Ok(PathBuf::from(path.trim()))
}
