//! Command line of the `gpu-operator` binary: argument parsing and dispatch (IO only through
//! the writer it is handed).
//!
//! Each subcommand is one variant of [`Command`] with its own `Args` struct and one arm in
//! [`Cli::run`]; adding `run`, `render` or `rbac` touches nothing else.

use std::io::Write;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use crate::api;

/// Kubernetes operator that rolls out the NVIDIA GPU software stack from one ClusterPolicy.
#[derive(Debug, Parser)]
#[command(name = "gpu-operator", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the CustomResourceDefinitions the operator serves, as YAML (apply with
    /// `kubectl apply --server-side -f -`).
    Crd(CrdArgs),
}

/// Arguments of `gpu-operator crd` (none yet).
#[derive(Debug, Args)]
pub struct CrdArgs {}

impl Cli {
    /// Runs the parsed command, writing its output to `out`.
    pub fn run(self, out: &mut dyn Write) -> anyhow::Result<()> {
        match self.command {
            Command::Crd(CrdArgs {}) => {
                let yaml = api::crd::crd_yaml().context("serialising the ClusterPolicy CRD")?;
                out.write_all(yaml.as_bytes())
                    .context("writing the CRD to standard output")?;
                Ok(())
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn crd_subcommand_prints_the_committed_crd() {
        let cli = Cli::try_parse_from(["gpu-operator", "crd"]).unwrap();
        let mut out = Vec::new();
        cli.run(&mut out).unwrap();
        let printed = String::from_utf8(out).unwrap();
        assert_eq!(printed, api::crd::crd_yaml().unwrap());
        assert!(printed.contains("name: clusterpolicies.nvidia.com"));
    }
}
