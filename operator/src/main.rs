//! `gpu-operator` command line: a thin shell over the library.
#![forbid(unsafe_code)]

use gpu_operator::cli::Cli;

/// With `--features dhat-heap` every allocation is recorded (bench/README.md, heap profile).
#[cfg(feature = "dhat-heap")]
#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

/// jemalloc, configured in `.cargo/config.toml`: glibc's malloc kept what each burst of watch
/// events allocated (its arenas only shrink from the top), so the resident memory after a
/// rollout grew with the fleet although the live heap did not (bench/results/README.md).
#[cfg(all(not(feature = "dhat-heap"), not(target_env = "msvc")))]
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    // Written to `DHAT_OUT` (default `dhat-heap.json`) when `main` returns, after a SIGTERM.
    #[cfg(feature = "dhat-heap")]
    let _profiler = dhat::Profiler::builder()
        .file_name(std::env::var_os("DHAT_OUT").unwrap_or_else(|| "dhat-heap.json".into()))
        .build();
    // Not `stdout().lock()`: `run` logs to stdout from its runtime's worker threads, which would
    // block forever on a lock the main thread holds for the whole command.
    if gpu_operator::cli::invoked_for_kubectl_completion() {
        let words: Vec<String> = std::env::args().skip(1).collect();
        print!("{}", gpu_operator::cli::kubectl_plugin_completions(&words));
        return std::process::ExitCode::SUCCESS;
    }
    match Cli::parse_args().run(&mut std::io::stdout()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            // As `main` returning the error would print it, with its causes.
            eprintln!("Error: {error:?}");
            std::process::ExitCode::from(gpu_operator::cli::exit_code(&error))
        }
    }
}
