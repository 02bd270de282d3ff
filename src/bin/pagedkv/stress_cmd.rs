//! `pagedkv stress`: several threads allocating, sharing and freeing blocks of one pool.

/// Arguments of `pagedkv stress`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs the stress job.
pub fn run(_args: Args) -> Result<(), Box<dyn std::error::Error>> {
    Ok(())
}
