//! The `pagedkv` command line. Each subcommand lives in its own file under src/bin/pagedkv/ (this file is its main.rs).

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[cfg(feature = "cuda")]
mod bench_attn;
#[cfg(feature = "cuda")]
mod bench_cmd;
#[cfg(feature = "cuda")]
mod bench_peer;
#[cfg(feature = "cuda")]
mod bench_timing;
mod gguf_cmd;
mod gguf_synth_cmd;
#[cfg(feature = "cuda")]
mod gguf_upload_cmd;
mod simulate_cmd;
mod stress_cmd;

/// pagedkv: lock-free paged KV-cache memory and scheduling core.
#[derive(Debug, Parser)]
#[command(name = "pagedkv", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The main job: several models serving a seeded workload on one shared KV pool.
    Simulate(simulate_cmd::Args),
    /// Hammer one shared block pool from several threads and report ops/s.
    Stress(stress_cmd::Args),
    /// Benchmarks that need hardware: `bench gpu` (feature `cuda`).
    #[cfg(feature = "cuda")]
    Bench(bench_cmd::Args),
    /// Inspect a GGUF file, dequantize a tensor, write a synthetic file, bench the upload.
    Gguf(gguf_cmd::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Simulate(args) => simulate_cmd::run(args),
        Command::Stress(args) => stress_cmd::run(args),
        #[cfg(feature = "cuda")]
        Command::Bench(args) => bench_cmd::run(args),
        Command::Gguf(args) => gguf_cmd::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pagedkv: error: {e}");
            ExitCode::FAILURE
        }
    }
}
