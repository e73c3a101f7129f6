//! `gpu-operator` command line: a thin shell over the library.
#![forbid(unsafe_code)]

use clap::Parser;
use gpu_operator::cli::Cli;

fn main() -> anyhow::Result<()> {
    Cli::parse().run(&mut std::io::stdout().lock())
}
