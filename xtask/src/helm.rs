//! Running helm (IO): which binary, and `helm template` with an error that says how to get one.
//! Only the bundle needs it (the chart's operator Deployment); nothing else of the harness is
//! built for it.

use std::ffi::{OsStr, OsString};
use std::process::Command;

use anyhow::Context;

/// The environment variable naming the helm binary to run; without it, `helm` from PATH.
pub const HELM_ENV: &str = "HELM";

/// Where a helm comes from when none is found.
const HOW_TO_GET_ONE: &str = "`make chart` builds the pinned helm alone and runs `cargo xtask generate` with it; \
     or set HELM to a helm binary (`tests/cluster/build.sh helm` builds the pinned one and prints \
     the folder that holds it), or put helm on PATH";

/// A helm binary to run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Helm {
    program: OsString,
}

impl Helm {
    /// `$HELM` when set, else `helm`, found on PATH when it runs.
    pub fn from_env() -> Self {
        let program = std::env::var_os(HELM_ENV)
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| OsString::from("helm"));
        Self { program }
    }

    /// The helm at `program` (a path, or a name looked up on PATH).
    pub fn at(program: impl Into<OsString>) -> Self {
        Self {
            program: program.into(),
        }
    }

    /// `helm template ARGS...`: what it prints, or an error with helm's own message.
    pub fn template<I, S>(&self, args: I) -> anyhow::Result<String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let program = self.program.to_string_lossy();
        let output = match Command::new(&self.program)
            .arg("template")
            .args(args)
            .output()
        {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                anyhow::bail!("helm not found (ran {program:?}): {HOW_TO_GET_ONE}")
            }
            other => other.with_context(|| format!("running {program} template"))?,
        };
        anyhow::ensure!(
            output.status.success(),
            "{program} template failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim_end()
        );
        String::from_utf8(output.stdout)
            .with_context(|| format!("{program} template printed something that is not UTF-8"))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_helm_is_an_error_that_says_how_to_get_one() {
        let err = Helm::at("/nonexistent/helm")
            .template(["chart"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("helm not found"), "{err}");
        assert!(err.contains("tests/cluster/build.sh helm"), "{err}");
        assert!(err.contains("HELM"), "{err}");
    }
}
