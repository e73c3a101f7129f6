//! `gpu-operator` command line: a thin shell over the library.
#![forbid(unsafe_code)]

use gpu_operator::cli::Cli;

fn main() -> anyhow::Result<()> {
    // Not `stdout().lock()`: `run` logs to stdout from its runtime's worker threads, which would
    // block forever on a lock the main thread holds for the whole command.
    Cli::parse_args().run(&mut std::io::stdout())
}
