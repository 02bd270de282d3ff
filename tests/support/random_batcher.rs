//! The randomized scheduler tests' common start (tests/sched_shadow_kv.rs,
//! tests/sched_differential.rs): a batcher with a random configuration on a fresh pool, under
//! a block quota that fails the test on a release below zero (tests/sched_batcher.rs,
//! tests/sched_latency_critical.rs and tests/prefix_two_engines.rs use the quota alone).
// Each test crate that includes this file uses part of it.
#![allow(dead_code)]

use pagedkv::block::{BlockPool, EngineId, PoolConfig};
use pagedkv::sched::{Batcher, BatcherConfig, EngineBudget, PreemptionMode};
use rand::{rngs::SmallRng, Rng};
use std::ops::Range;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// A block quota that refuses past `quota`, and a token budget the test sets.
pub struct Quota {
    pub tokens: Arc<AtomicU32>,
    pub quota: u32,
    pub used: Arc<AtomicU32>,
}

impl EngineBudget for Quota {
    fn token_budget(&self) -> u32 {
        self.tokens.load(Ordering::Relaxed)
    }
    fn try_acquire_blocks(&self, n: u32) -> bool {
        let prev = self.used.fetch_add(n, Ordering::Relaxed);
        if prev + n > self.quota {
            self.used.fetch_sub(n, Ordering::Relaxed);
            return false;
        }
        true
    }
    fn release_blocks(&self, n: u32) {
        let prev = self.used.fetch_sub(n, Ordering::Relaxed);
        assert!(prev >= n, "budget released below zero");
    }
    fn set_active(&self, _: bool) {}
}

/// What [`random_batcher`] made.
pub struct RandomBatcher {
    pub pool: Arc<BlockPool>,
    pub batcher: Batcher,
    pub cfg: BatcherConfig,
    pub blocks: u32,
    pub quota: u32,
    /// Blocks the batcher holds against its quota.
    pub used: Arc<AtomicU32>,
    /// The token budget (starts unbounded).
    pub tokens: Arc<AtomicU32>,
}

/// A batcher with a block size from `sizes` on a pool of `blocks` blocks, random limits and
/// preemption mode, and a random quota of at least 4 blocks attached.
pub fn random_batcher(rng: &mut SmallRng, sizes: &[u32], blocks: Range<u32>) -> RandomBatcher {
    let bs = sizes[rng.gen_range(0..sizes.len())];
    let blocks: u32 = rng.gen_range(blocks);
    let pool = Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: blocks,
            max_engines: 2,
        })
        .unwrap(),
    );
    let preemption = if rng.gen_bool(0.5) {
        PreemptionMode::Recompute
    } else {
        PreemptionMode::Swap
    };
    let swap_blocks = rng.gen_range(0..40);
    let cfg = BatcherConfig {
        engine: EngineId(0),
        block_size: bs,
        max_running: rng.gen_range(1..8),
        max_batched_tokens: rng.gen_range(1..48),
        max_prefill_chunk: rng.gen_range(1..16),
        max_blocks_per_seq: 24,
        preemption,
        swap_blocks,
    };
    let used = Arc::new(AtomicU32::new(0));
    let tokens = Arc::new(AtomicU32::new(u32::MAX));
    let quota = rng.gen_range(4..=blocks);
    let mut batcher = Batcher::new(cfg, pool.clone()).unwrap();
    batcher.attach_budget(Box::new(Quota {
        tokens: tokens.clone(),
        quota,
        used: used.clone(),
    }));
    RandomBatcher {
        pool,
        batcher,
        cfg,
        blocks,
        quota,
        used,
        tokens,
    }
}
