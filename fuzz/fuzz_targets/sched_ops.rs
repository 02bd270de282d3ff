//! Fuzz the batcher with arbitrary submit / step / commit / abort / fork / discard (a batch
//! scheduled and never committed) sequences: no panic,
//! every batch consistent, the token budget respected, and at the end every request finished
//! or refused and no block leaked. A model of each sequence's tokens (prompt, then every token
//! committed to it, a fork starting from its parent's) checks what the batches feed and what
//! comes out: every input token is the sequence's token at its position, a sampling row ends
//! at the sequence's last token, a finished output is exactly the tokens committed to it, and a
//! sequence ends exactly when its stop rules say (EOS, `max_new_tokens`) and not before.
//!
//! Page accounting after every operation (`check_pages`): the batcher lists exactly the live
//! sequences of the model; a waiting or swapped sequence holds no pages; a running one holds at
//! most the pages its tokens cover; after a commit each row still running holds at least the
//! pages its context covers, and the pool holds exactly the pages the live tables hold (while
//! no fork family is live: forks share pages); and once drained, before the batcher is
//! dropped, every page is back in the pool (a page kept by a finished sequence until the
//! batcher's drop is a leak for its whole life).
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pagedkv::block::{BlockPool, EngineId, PoolConfig};
use pagedkv::sched::{
    Batch, Batcher, BatcherConfig, FinishReason, FinishedSeq, PreemptionMode, Priority, SeqPhase,
    SeqRequest, StopRules,
};
use std::collections::{HashMap, HashSet};
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
    // Model: each live sequence's tokens, prompt length and stop rules.
    let mut model: Model = HashMap::new();
    // Ids of forked sequences and their parents: while one is live, pages may be shared.
    let mut family: HashSet<u64> = HashSet::new();
    for op in input.ops.into_iter().take(256) {
        match op {
            Op::Submit {
                prompt_len,
                max_new,
                urgent,
                eos,
            } => {
                // Distinct tokens per position, so a token fed at the wrong position shows.
                let prompt: Vec<u32> = (0..u32::from(prompt_len)).map(|i| 1000 + i).collect();
                let req = SeqRequest {
                    id: next_id,
                    prompt: prompt.clone(),
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
                let stop = req.stop.clone();
                if bt.add(req).is_ok() {
                    accepted.insert(next_id);
                    model.insert(next_id, (prompt.clone(), prompt.len(), stop));
                }
                next_id += 1;
            }
            Op::Step { tokens } => {
                let b = schedule_checked(&mut bt, &mut done, &mut model);
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
                commit_checked(&mut bt, &mut done, &mut model, &sampled);
                check_committed(&bt, &pool, &model, &family);
            }
            Op::StepWrongCount => {
                let n = schedule_checked(&mut bt, &mut done, &mut model).num_samples();
                assert!(bt.commit(&vec![1; n + 1], &mut done).is_err());
                commit_checked(&mut bt, &mut done, &mut model, &vec![1; n]);
                check_committed(&bt, &pool, &model, &family);
            }
            Op::Discard => {
                schedule_checked(&mut bt, &mut done, &mut model);
            }
            Op::Abort(id) => {
                let _ = bt.abort(u64::from(id));
            }
            Op::Fork(id) => {
                if bt.fork(u64::from(id), next_id).is_ok() {
                    accepted.insert(next_id);
                    let parent = model[&u64::from(id)].clone();
                    model.insert(next_id, parent);
                    family.insert(u64::from(id));
                    family.insert(next_id);
                }
                next_id += 1;
            }
        }
        check_pages(&bt, &pool, &model, &family);
    }
    // Drain: a workload that fits one sequence at a time always finishes.
    for _ in 0..100_000 {
        if !bt.has_work() {
            break;
        }
        let n = schedule_checked(&mut bt, &mut done, &mut model).num_samples();
        commit_checked(&mut bt, &mut done, &mut model, &vec![7; n]);
        check_committed(&bt, &pool, &model, &family);
    }
    assert!(
        model.is_empty(),
        "unfinished in the model: {:?}",
        model.keys()
    );
    assert!(!bt.has_work(), "livelock: work left after draining");
    let finished: HashSet<u64> = done.iter().map(|f| f.id).collect();
    assert_eq!(
        finished, accepted,
        "every accepted request finishes exactly once"
    );
    assert_eq!(finished.len(), done.len());
    // Drained: every page is back now, not only once the batcher is dropped.
    assert_eq!(
        pool.free_count(),
        pool.total(),
        "pages held by a drained batcher"
    );
    drop(bt);
    assert_eq!(pool.free_count(), pool.total());
});

/// After any operation: the batcher lists exactly the model's live sequences, a waiting or
/// swapped one holds no pages, a running one no more than its tokens cover, and the pool holds
/// at least the pages of the live tables (exactly, but for swap-outs in flight, while no fork
/// family is live).
fn check_pages(bt: &Batcher, pool: &BlockPool, model: &Model, family: &HashSet<u64>) {
    let bs = bt.config().block_size as usize;
    assert_eq!(
        bt.num_waiting() + bt.num_running() + bt.num_swapped(),
        model.len(),
        "live sequences"
    );
    let mut sum = 0u64;
    for (&id, (toks, _, _)) in model {
        let phase = bt.phase(id).expect("a live sequence has a phase");
        let blocks = bt.blocks_of(id).expect("a live sequence has a table");
        match phase {
            SeqPhase::Waiting | SeqPhase::Swapped => {
                assert_eq!(blocks, 0, "seq {id}: {phase:?} yet holds pages")
            }
            SeqPhase::Prefilling | SeqPhase::Decoding => assert!(
                blocks as usize <= toks.len().div_ceil(bs),
                "seq {id}: {blocks} pages for {} tokens",
                toks.len()
            ),
        }
        sum += u64::from(blocks);
    }
    let held = u64::from(pool.total() - pool.free_count());
    assert_eq!(u64::from(pool.stats().held[0]), held);
    if !model.keys().any(|id| family.contains(id)) {
        // Swap-outs in flight hold their pages until the batch has run.
        assert!(held >= sum, "pool holds {held} pages, the tables {sum}");
    }
}

/// Right after a commit (no swap-out in flight): [`check_pages`], each committed row still
/// running holds at least the pages its context covers, and the pool exactly the tables' pages
/// while no fork family is live.
fn check_committed(bt: &Batcher, pool: &BlockPool, model: &Model, family: &HashSet<u64>) {
    check_pages(bt, pool, model, family);
    let bs = bt.config().block_size as usize;
    let b = bt.batch();
    for s in 0..b.num_seqs() {
        let id = b.seq_ids[s];
        if !model.contains_key(&id) {
            continue;
        }
        // At least: pages a discarded batch reserved beyond it stay (the sequence grows into
        // them; `check_pages` bounds them by its tokens).
        assert!(
            bt.blocks_of(id).unwrap() as usize >= (b.context_lens[s] as usize).div_ceil(bs),
            "seq {id}: pages after a commit of context {}",
            b.context_lens[s]
        );
    }
    if !model.keys().any(|id| family.contains(id)) {
        let sum: u64 = model
            .keys()
            .map(|&id| u64::from(bt.blocks_of(id).unwrap()))
            .sum();
        let held = u64::from(pool.total() - pool.free_count());
        assert_eq!(held, sum, "pool holds {held} pages, the live tables {sum}");
    }
}

/// Per live sequence: its tokens (prompt, then what was committed), its prompt length and its
/// stop rules.
type Model = HashMap<u64, (Vec<u32>, usize, StopRules)>;

/// Schedules a step and checks the ends it reported and every row's inputs against `model`.
fn schedule_checked<'a>(
    bt: &'a mut Batcher,
    done: &mut Vec<FinishedSeq>,
    model: &mut Model,
) -> &'a Batch {
    let seen = done.len();
    let b = bt.schedule_into(done);
    check_finished(model, &done[seen..]);
    check_inputs(model, b);
    b
}

/// Commits the scheduled batch with `sampled` and applies it to `model`, checking who ended.
fn commit_checked(
    bt: &mut Batcher,
    done: &mut Vec<FinishedSeq>,
    model: &mut Model,
    sampled: &[u32],
) {
    let rows = sampling_rows(bt.batch());
    let seen = done.len();
    bt.commit(sampled, done).unwrap();
    committed(model, &rows, sampled, &done[seen..]);
}

/// The ids of a batch's sampling rows, in row order (no drafts here: one sample each).
fn sampling_rows(b: &Batch) -> Vec<u64> {
    (0..b.num_seqs())
        .filter(|&s| b.samples[s])
        .map(|s| b.seq_ids[s])
        .collect()
}

/// Every row feeds its sequence's own tokens at their positions, and a sampling row ends at the
/// sequence's last token.
fn check_inputs(model: &Model, b: &Batch) {
    for s in 0..b.num_seqs() {
        let id = b.seq_ids[s];
        let (toks, _, _) = model.get(&id).expect("a scheduled sequence is live");
        let (lo, hi) = (
            b.query_start_loc[s] as usize,
            b.query_start_loc[s + 1] as usize,
        );
        for t in lo..hi {
            let pos = b.positions[t] as usize;
            assert_eq!(b.input_tokens[t], toks[pos], "seq {id}: token at {pos}");
        }
        assert_eq!(b.context_lens[s] as usize, b.positions[hi - 1] as usize + 1);
        if b.samples[s] {
            assert_eq!(
                b.context_lens[s] as usize,
                toks.len(),
                "seq {id}: samples early"
            );
        }
    }
}

/// Why a sequence with these tokens must stop, if it must (the batcher's order: EOS first).
fn must_stop(toks: &[u32], prompt: usize, stop: &StopRules) -> Option<FinishReason> {
    let out = &toks[prompt..];
    let last = *out.last()?;
    if stop.eos.contains(&last) {
        return Some(FinishReason::Eos);
    }
    (out.len() >= stop.max_new_tokens as usize).then_some(FinishReason::MaxTokens)
}

/// Ends reported outside a commit (aborts, or too long): the output is what was committed.
fn check_finished(model: &mut Model, fin: &[FinishedSeq]) {
    for f in fin {
        let (toks, p, _) = model.remove(&f.id).expect("finished once");
        assert_eq!(f.output, toks[p..], "seq {}: output", f.id);
        assert!(
            matches!(f.reason, FinishReason::Aborted | FinishReason::TooLong),
            "seq {}: {:?} outside a commit",
            f.id,
            f.reason
        );
    }
}

/// Applies a commit to the model and checks who ended: exactly the sequences whose stop rules
/// say so, with that reason and their whole output (plus aborts and too-long ends).
fn committed(model: &mut Model, rows: &[u64], sampled: &[u32], fin: &[FinishedSeq]) {
    for (id, &tok) in rows.iter().zip(sampled) {
        model
            .get_mut(id)
            .expect("a sampled sequence is live")
            .0
            .push(tok);
    }
    for f in fin {
        let (toks, p, stop) = model.remove(&f.id).expect("finished once");
        assert_eq!(f.output, toks[p..], "seq {}: output", f.id);
        match f.reason {
            FinishReason::Aborted | FinishReason::TooLong => {}
            r => assert_eq!(Some(r), must_stop(&toks, p, &stop), "seq {}: reason", f.id),
        }
    }
    for (id, (toks, p, stop)) in model.iter() {
        assert_eq!(
            must_stop(toks, *p, stop),
            None,
            "seq {id} should have ended"
        );
    }
}
