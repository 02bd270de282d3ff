//! `pagedkv stress`: several threads allocating, sharing and freeing blocks of one shared pool,
//! each as its own engine; reports operations per second and checks that nothing leaked.

use pagedkv::block::{BlockId, BlockPool, EngineId, PoolConfig};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Arguments of `pagedkv stress`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Worker threads, one engine each.
    #[arg(long, default_value_t = 2)]
    threads: u16,
    /// Blocks in the shared pool.
    #[arg(long, default_value_t = 4096)]
    blocks: u32,
    /// How long to run, in seconds.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Seed of the operation mix.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// Runs the stress job.
pub fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    if args.threads == 0 {
        return Err("--threads must be at least 1".into());
    }
    if !(args.seconds > 0.0 && args.seconds.is_finite()) {
        return Err("--seconds must be a positive number".into());
    }
    let pool = Arc::new(BlockPool::new(PoolConfig {
        device: 0,
        num_blocks: args.blocks,
        max_engines: args.threads,
    })?);
    let duration = Duration::try_from_secs_f64(args.seconds)
        .map_err(|_| format!("--seconds {}: too long", args.seconds))?;
    let start = Instant::now();
    let workers: Vec<_> = (0..args.threads)
        .map(|t| {
            let pool = Arc::clone(&pool);
            let seed = args.seed.wrapping_add(u64::from(t));
            std::thread::Builder::new()
                .spawn(move || -> Result<u64, pagedkv::error::PoolError> {
                    let engine = EngineId(t);
                    let mut rng = SmallRng::seed_from_u64(seed);
                    let mut held: Vec<BlockId> = Vec::new();
                    let mut scratch = Vec::new();
                    let mut ops = 0u64;
                    while start.elapsed() < duration {
                        for _ in 0..1024 {
                            match rng.gen_range(0..10) {
                                0..=3 => {
                                    if let Ok(id) = pool.alloc(engine) {
                                        held.push(id);
                                    }
                                }
                                4 => {
                                    scratch.clear();
                                    if pool.alloc_n(engine, 16, &mut scratch).is_ok() {
                                        held.extend_from_slice(&scratch);
                                    }
                                }
                                5 if !held.is_empty() => {
                                    let id = held[rng.gen_range(0..held.len())];
                                    pool.share(id)?;
                                    held.push(id);
                                }
                                _ if !held.is_empty() => {
                                    let id = held.swap_remove(rng.gen_range(0..held.len()));
                                    pool.release(id)?;
                                }
                                _ => {}
                            }
                            ops += 1;
                        }
                    }
                    pool.free_n(&held)?;
                    Ok(ops)
                })
                .map_err(|e| format!("cannot start worker thread {t}: {e}"))
        })
        .collect::<Result<_, _>>()?;
    let mut total = 0u64;
    for w in workers {
        total += w.join().map_err(|_| "a worker thread panicked")??;
    }
    let secs = start.elapsed().as_secs_f64();
    let stats = pool.stats();
    println!(
        "pool stress: {} threads, {} blocks, {:.2} s: {} ops, {:.1} M ops/s",
        args.threads,
        args.blocks,
        secs,
        total,
        total as f64 / secs / 1e6
    );
    println!(
        "after: {} of {} blocks free, held per engine {:?}",
        stats.free, stats.total, stats.held
    );
    if stats.free != stats.total || stats.held.iter().any(|&h| h != 0) {
        return Err("blocks leaked".into());
    }
    Ok(())
}
