//! Build script: the git commit the binary is built from, for `gpu-operator --version` and the
//! image's `org.opencontainers.image.revision` label.
//!
//! `GPU_OPERATOR_COMMIT` wins when set (a build from a source tarball, or a container build
//! whose context has no `.git`); otherwise `git rev-parse HEAD`; otherwise "unknown". The
//! script reruns when HEAD moves (a commit, a checkout), not on every source change.

use std::path::PathBuf;
use std::process::Command;

const OVERRIDE: &str = "GPU_OPERATOR_COMMIT";

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_owned())
}

fn main() {
    println!("cargo::rerun-if-env-changed={OVERRIDE}");
    let commit = match std::env::var(OVERRIDE) {
        Ok(commit) if !commit.trim().is_empty() => commit.trim().to_owned(),
        _ => {
            // The files that change when HEAD does: HEAD itself (a checkout), the branch it names
            // (a commit) and packed-refs (where `git gc` moves branches). In a worktree these
            // live in different folders; `--git-path` knows which.
            for file in ["HEAD", "packed-refs"] {
                if let Some(path) = git(&["rev-parse", "--git-path", file]) {
                    rerun_if_changed(path);
                }
            }
            if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"])
                && let Some(path) = git(&["rev-parse", "--git-path", &branch])
            {
                rerun_if_changed(path);
            }
            git(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".to_owned())
        }
    };
    println!("cargo::rustc-env=GPU_OPERATOR_COMMIT={commit}");
}

/// Watches a path git printed (relative paths are relative to this package's folder, where
/// cargo runs the script). A missing file (no packed-refs yet) is not watched: cargo would rerun
/// the script on every build.
fn rerun_if_changed(path: String) {
    let path = PathBuf::from(path);
    let path = if path.is_absolute() {
        path
    } else {
        let dir = std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(PathBuf::new, PathBuf::from);
        dir.join(path)
    };
    if path.exists() {
        println!("cargo::rerun-if-changed={}", path.display());
    }
}
