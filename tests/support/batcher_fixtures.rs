//! The batcher tests' common fixtures (tests/sched_batcher.rs,
//! tests/sched_latency_critical.rs): a small pool and configuration, requests, a step, a run to
//! idle, and the batch consistency check every scheduled batch passes.
// Each test crate that includes this file uses part of it.
#![allow(dead_code)]

use pagedkv::block::{BlockPool, EngineId, PoolConfig};
use pagedkv::prefix::{PrefixCache, PrefixConfig};
use pagedkv::sched::{
    Batch, Batcher, BatcherConfig, FinishedSeq, PreemptionMode, Priority, SeqRequest, StopRules,
};
use std::collections::HashSet;
use std::sync::Arc;

/// Tokens per page in every batcher test.
pub const BS: u32 = 4;

pub fn pool(blocks: u32) -> Arc<BlockPool> {
    Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: blocks,
            max_engines: 2,
        })
        .unwrap(),
    )
}

pub fn config() -> BatcherConfig {
    BatcherConfig {
        engine: EngineId(0),
        block_size: BS,
        max_running: 32,
        max_batched_tokens: 512,
        max_prefill_chunk: 256,
        max_blocks_per_seq: 64,
        preemption: PreemptionMode::Recompute,
        swap_blocks: 0,
    }
}

/// [`config`] preempting by `mode`, with 16 host swap slots (used only by `Swap`).
pub fn config_with(mode: PreemptionMode) -> BatcherConfig {
    BatcherConfig {
        preemption: mode,
        swap_blocks: 16,
        ..config()
    }
}

/// A latency-critical request of `prompt` tokens (one output token).
pub fn urgent(id: u64, prompt: Vec<u32>) -> SeqRequest {
    let mut r = req(id, prompt, 1);
    r.priority = Priority::LatencyCritical;
    r
}

pub fn req(id: u64, prompt: Vec<u32>, max_new: u32) -> SeqRequest {
    SeqRequest {
        id,
        prompt,
        stop: StopRules {
            max_new_tokens: max_new,
            ..Default::default()
        },
        priority: Priority::Throughput,
    }
}

/// Checks a batch's internal consistency against the pool geometry.
pub fn check_batch(b: &Batch, budget: usize) {
    assert!(b.num_tokens() <= budget, "token budget exceeded");
    assert_eq!(b.query_start_loc.len(), b.num_seqs() + 1);
    assert_eq!(*b.query_start_loc.last().unwrap() as usize, b.num_tokens());
    let w = b.max_blocks_per_seq;
    assert_eq!(b.block_tables.len(), b.num_seqs() * w);
    let mut slots = HashSet::new();
    for s in 0..b.num_seqs() {
        let row = &b.block_tables[s * w..(s + 1) * w];
        let ctx = b.context_lens[s] as usize;
        let blocks = ctx.div_ceil(BS as usize);
        assert!(
            row[..blocks].iter().all(|&x| x >= 0),
            "table does not cover the tokens"
        );
        for t in b.query_start_loc[s] as usize..b.query_start_loc[s + 1] as usize {
            let pos = b.positions[t] as usize;
            assert!(pos < ctx);
            let expect =
                i64::from(row[pos / BS as usize]) * i64::from(BS) + (pos % BS as usize) as i64;
            assert_eq!(
                b.slot_mapping[t], expect,
                "slot mapping disagrees with the table"
            );
            assert!(slots.insert(b.slot_mapping[t]), "two tokens write one slot");
        }
    }
    // A sampling row asks for one logit, and one more per draft token.
    let logits: usize = b
        .samples
        .iter()
        .zip(&b.drafts)
        .filter(|(&s, _)| s)
        .map(|(_, &d)| 1 + d as usize)
        .sum();
    assert_eq!(logits, b.num_samples());
}

/// Runs steps until idle (or `max_steps`), sampling `token_of(id, step)`.
pub fn drive(bt: &mut Batcher, max_steps: usize) -> Vec<FinishedSeq> {
    let mut done = Vec::new();
    let budget = bt.config().max_batched_tokens as usize;
    for step in 0..max_steps {
        if !bt.has_work() {
            break;
        }
        let b = bt.schedule_into(&mut done);
        check_batch(b, budget);
        let sampled: Vec<u32> = (0..b.num_samples())
            .map(|k| 1000 + (step + k) as u32)
            .collect();
        bt.commit(&sampled, &mut done).unwrap();
    }
    done
}

/// A batcher on a pool of `blocks` pages with a prefix cache attached.
pub fn with_prefix(blocks: u32) -> (Arc<BlockPool>, Batcher) {
    let p = pool(blocks);
    let mut bt = Batcher::new(config(), p.clone()).unwrap();
    let cache = PrefixCache::new(p.clone(), PrefixConfig { seed: Some(3) });
    bt.attach_prefix_cache(Arc::new(cache)).unwrap();
    (p, bt)
}

/// One step: schedule, then commit with every sample 1000.
pub fn step(bt: &mut Batcher, fin: &mut Vec<FinishedSeq>) {
    bt.schedule_into(fin);
    commit_scheduled(bt, fin);
}

/// Commits the batch already scheduled, every sample 1000.
pub fn commit_scheduled(bt: &mut Batcher, fin: &mut Vec<FinishedSeq>) {
    let n = bt.batch().num_samples();
    bt.commit(&vec![1000; n], fin).unwrap();
}

/// Sequences preempted so far, by recompute or by swap.
pub fn preemptions(bt: &Batcher) -> u64 {
    let s = bt.stats();
    s.preempted_recompute + s.preempted_swap
}
