//! Fuzz the batcher with arbitrary submit / step / commit / abort / fork / discard (a batch
//! scheduled and never committed) sequences: no panic,
//! every batch consistent, the token budget respected, and at the end every request finished
//! or refused and no block leaked.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pagedkv::block::{BlockPool, EngineId, PoolConfig};
use pagedkv::sched::{Batcher, BatcherConfig, PreemptionMode, Priority, SeqRequest, StopRules};
use std::collections::HashSet;
use std::sync::Arc;

#[derive(Debug, Arbitrary)]
struct Input {
    blocks: u8,
    block_size: u8,
    max_running: u8,
    max_tokens: u8,
    chunk: u8,
    max_blocks_per_seq: u8,
    swap: bool,
    swap_blocks: u8,
    ops: Vec<Op>,
}

#[derive(Debug, Arbitrary)]
enum Op {
    Submit {
        prompt_len: u8,
        max_new: u8,
        urgent: bool,
        eos: Option<u8>,
    },
    Step {
        tokens: Vec<u8>,
    },
    StepWrongCount,
    /// Schedules a batch that is never committed (its execution failed): the next schedule
    /// discards it.
    Discard,
    Abort(u8),
    Fork(u8),
}

fuzz_target!(|input: Input| {
    let Ok(pool) = BlockPool::new(PoolConfig {
        device: 0,
        num_blocks: u32::from(input.blocks),
        max_engines: 1,
    }) else {
        return;
    };
    let pool = Arc::new(pool);
    let cfg = BatcherConfig {
        engine: EngineId(0),
        block_size: u32::from(input.block_size % 33),
        max_running: u32::from(input.max_running % 17),
        max_batched_tokens: u32::from(input.max_tokens),
        max_prefill_chunk: u32::from(input.chunk),
        max_blocks_per_seq: u32::from(input.max_blocks_per_seq),
        preemption: if input.swap {
            PreemptionMode::Swap
        } else {
            PreemptionMode::Recompute
        },
        swap_blocks: u32::from(input.swap_blocks),
    };
    let Ok(mut bt) = Batcher::new(cfg, pool.clone()) else {
        return;
    };
    let mut next_id = 0u64;
    let mut accepted = HashSet::new();
    let mut done = Vec::new();
    for op in input.ops.into_iter().take(256) {
        match op {
            Op::Submit {
                prompt_len,
                max_new,
                urgent,
                eos,
            } => {
                let req = SeqRequest {
                    id: next_id,
                    prompt: vec![1; usize::from(prompt_len)],
                    stop: StopRules {
                        max_new_tokens: u32::from(max_new),
                        eos: eos.map(u32::from).into_iter().collect(),
                        stop_sequences: vec![],
                    },
                    priority: if urgent {
                        Priority::LatencyCritical
                    } else {
                        Priority::Throughput
                    },
                };
                if bt.add(req).is_ok() {
                    accepted.insert(next_id);
                }
                next_id += 1;
            }
            Op::Step { tokens } => {
                let b = bt.schedule_into(&mut done);
                assert!(b.num_tokens() <= cfg.max_batched_tokens as usize);
                assert_eq!(b.query_start_loc.len(), b.num_seqs() + 1);
                // Every token's slot lies in the block its row names for its position, and no
                // two tokens share a slot: the rows (kept across steps) are current.
                let (w, bs) = (b.max_blocks_per_seq, cfg.block_size as usize);
                let mut slots = HashSet::new();
                for s in 0..b.num_seqs() {
                    let row = &b.block_tables[s * w..(s + 1) * w];
                    for t in b.query_start_loc[s] as usize..b.query_start_loc[s + 1] as usize {
                        let pos = b.positions[t] as usize;
                        assert!(pos < b.context_lens[s] as usize);
                        let expect = i64::from(row[pos / bs]) * bs as i64 + (pos % bs) as i64;
                        assert_eq!(b.slot_mapping[t], expect);
                        assert!(slots.insert(expect));
                    }
                }
                let n = b.num_samples();
                let sampled: Vec<u32> = (0..n)
                    .map(|i| u32::from(tokens.get(i).copied().unwrap_or(7)))
                    .collect();
                bt.commit(&sampled, &mut done).unwrap();
            }
            Op::StepWrongCount => {
                let n = bt.schedule_into(&mut done).num_samples();
                assert!(bt.commit(&vec![1; n + 1], &mut done).is_err());
                bt.commit(&vec![1; n], &mut done).unwrap();
            }
            Op::Discard => {
                bt.schedule_into(&mut done);
            }
            Op::Abort(id) => {
                let _ = bt.abort(u64::from(id));
            }
            Op::Fork(id) => {
                if bt.fork(u64::from(id), next_id).is_ok() {
                    accepted.insert(next_id);
                }
                next_id += 1;
            }
        }
    }
    // Drain: a workload that fits one sequence at a time always finishes.
    for _ in 0..100_000 {
        if !bt.has_work() {
            break;
        }
        let n = bt.schedule_into(&mut done).num_samples();
        bt.commit(&vec![7; n], &mut done).unwrap();
    }
    assert!(!bt.has_work(), "livelock: work left after draining");
    let finished: HashSet<u64> = done.iter().map(|f| f.id).collect();
    assert_eq!(
        finished, accepted,
        "every accepted request finishes exactly once"
    );
    assert_eq!(finished.len(), done.len());
    drop(bt);
    assert_eq!(pool.free_count(), pool.total());
});
