//! Steady-state decode steps of one batcher (for profilers: callgrind, perf).
//!
//! `cargo run --release --example sched_profile -- [running] [steps]`
use pagedkv::block::{BlockPool, EngineId, PoolConfig};
use pagedkv::sched::{Batcher, BatcherConfig, PreemptionMode, Priority, SeqRequest, StopRules};
use std::sync::Arc;

fn main() {
    let mut args = std::env::args()
        .skip(1)
        .map(|a| a.parse::<usize>().unwrap_or(0));
    let running = args.next().unwrap_or(1024).max(1);
    let steps = args.next().unwrap_or(2000).max(1);
    let bs = 16u32;
    let per_seq = (100 + steps as u32).div_ceil(bs) + 1;
    let pool = Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: running as u32 * per_seq,
            max_engines: 1,
        })
        .expect("pool"),
    );
    let mut b = Batcher::new(
        BatcherConfig {
            engine: EngineId(0),
            block_size: bs,
            max_running: running as u32,
            max_batched_tokens: 1 << 20,
            max_prefill_chunk: 256,
            max_blocks_per_seq: per_seq,
            preemption: PreemptionMode::Recompute,
            swap_blocks: 0,
        },
        pool,
    )
    .expect("batcher");
    for id in 0..running as u64 {
        b.add(SeqRequest {
            id,
            prompt: vec![1; 100],
            stop: StopRules {
                max_new_tokens: steps as u32 + 10,
                ..Default::default()
            },
            priority: Priority::Throughput,
        })
        .expect("add");
    }
    let mut fin = Vec::new();
    let sampled = vec![3u32; running];
    let t = std::time::Instant::now();
    for _ in 0..steps {
        let n = b.schedule_into(&mut fin).num_samples();
        b.commit(&sampled[..n], &mut fin).expect("commit");
    }
    let e = t.elapsed();
    println!(
        "{running} sequences, {steps} steps: {:.1} us per step",
        e.as_secs_f64() * 1e6 / steps as f64
    );
}
