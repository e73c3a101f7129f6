//! `cargo xtask generate | check` (the alias is in `.cargo/config.toml`): a thin command line
//! over [`xtask::generated`].
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use xtask::generated::{self, GENERATE_COMMAND};
use xtask::helm::Helm;

/// Packaging tasks of the GPU operator: the generated files (CRDs, the chart's copies, the OLM
/// bundle). Helm renders the chart for the bundle: `$HELM`, else `helm` on PATH.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Regenerate every generated file: crds/, the chart's crds/ and ClusterRole, bundle/.
    Generate,
    /// Fail when a committed generated file differs from what `generate` would write, naming
    /// each one.
    Check,
}

fn main() -> ExitCode {
    match run(Cli::parse().command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> anyhow::Result<ExitCode> {
    let root = xtask::repo_root();
    let all = generated::all(&root, &Helm::from_env())?;
    match command {
        Command::Generate => {
            let changed = generated::write(&root, &all)?;
            for path in &changed.written {
                println!("wrote {path}");
            }
            for path in &changed.removed {
                println!("removed {path} (written by no generator)");
            }
            if changed == generated::Written::default() {
                println!("{} generated files: all up to date", all.files.len());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Check => {
            let drift = generated::drift(&root, &all)?;
            if drift.is_empty() {
                println!("{} generated files: all up to date", all.files.len());
                return Ok(ExitCode::SUCCESS);
            }
            eprintln!(
                "xtask check: {} generated file(s) out of date (the committed copy is not what its generator writes now):",
                drift.len()
            );
            for d in &drift {
                eprintln!("  {d}");
            }
            eprintln!("Fix: run `{GENERATE_COMMAND}` and review the diff.");
            Ok(ExitCode::FAILURE)
        }
    }
}
