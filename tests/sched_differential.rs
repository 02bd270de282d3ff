//! The batcher against a sequential model: every sequence's output must be what generating it
//! alone gives, whatever the scheduling did (chunked prefill, token budgets, drafts, forks,
//! recompute and swap preemption, discarded batches). The "model" reads each row's context
//! from a shadow of the KV pages at every `logits_indices` entry and samples a token that
//! depends on the whole history, so a wrong position, slot, block table or logits index
//! changes the output.

#[path = "support/random_batcher.rs"]
mod random_batcher;
use pagedkv::sched::{
    Batch, FinishReason, FinishedSeq, Priority, SeqPhase, SeqRequest, StepResults, StopRules,
};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use random_batcher::{random_batcher, RandomBatcher};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

const SEEDS: u64 = 1500;
const VOCAB: u32 = 6;

/// The model: the next token after `hist`.
fn next_token(hist: &[u32]) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (i, &t) in hist.iter().enumerate() {
        h ^= u64::from(t) + ((i as u64) << 20);
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    ((h >> 29) % u64::from(VOCAB)) as u32
}

fn stop_reason(stop: &StopRules, out: &[u32]) -> Option<FinishReason> {
    let t = *out.last().unwrap();
    if stop.eos.contains(&t) {
        return Some(FinishReason::Eos);
    }
    if stop
        .stop_sequences
        .iter()
        .any(|s| !s.is_empty() && out.ends_with(s))
    {
        return Some(FinishReason::StopSequence);
    }
    if out.len() >= stop.max_new_tokens as usize {
        return Some(FinishReason::MaxTokens);
    }
    None
}

/// Generating alone: the output and why it stopped.
fn reference(prompt: &[u32], stop: &StopRules) -> (Vec<u32>, FinishReason) {
    let mut hist = prompt.to_vec();
    loop {
        hist.push(next_token(&hist));
        let out = &hist[prompt.len()..];
        if let Some(r) = stop_reason(stop, out) {
            return (out.to_vec(), r);
        }
    }
}

type Cell = Option<(u32, i32)>;

fn check_batch(b: &Batch, bs: usize, token_budget: usize) {
    assert!(b.num_tokens() <= token_budget);
    assert_eq!(b.query_start_loc.len(), b.num_seqs() + 1);
    assert_eq!(b.query_start_loc[0], 0);
    assert_eq!(*b.query_start_loc.last().unwrap() as usize, b.num_tokens());
    assert_eq!(b.positions.len(), b.num_tokens());
    assert_eq!(b.slot_mapping.len(), b.num_tokens());
    let w = b.max_blocks_per_seq;
    let mut li = 0;
    for r in 0..b.num_seqs() {
        let (a, e) = (
            b.query_start_loc[r] as usize,
            b.query_start_loc[r + 1] as usize,
        );
        assert!(a < e, "empty row");
        let start = b.positions[a] as usize;
        assert_eq!(b.context_lens[r] as usize, start + e - a);
        assert!((b.context_lens[r] as usize).div_ceil(bs) <= w);
        for t in a..e {
            let pos = b.positions[t] as usize;
            assert_eq!(pos, start + t - a);
            let page = b.block_tables[r * w + pos / bs];
            assert!(page >= 0);
            assert_eq!(
                b.slot_mapping[t],
                i64::from(page) * bs as i64 + (pos % bs) as i64
            );
        }
        assert!((b.drafts[r] as usize) < e - a || b.drafts[r] == 0);
        if b.samples[r] {
            let d = b.drafts[r] as usize;
            for k in 0..=d {
                assert_eq!(b.logits_indices[li + k] as usize, e - 1 - d + k);
            }
            li += d + 1;
        } else {
            assert_eq!(b.drafts[r], 0);
        }
    }
    assert_eq!(li, b.num_samples());
}

#[test]
fn outputs_match_sequential_generation() {
    let mut total = [0u64; 4];
    for seed in 0..SEEDS {
        let c = run(seed);
        for k in 0..4 {
            total[k] += c[k];
        }
    }
    eprintln!("recompute, swap, cow, draft rows: {total:?}");
    assert!(total.iter().all(|&c| c > 100), "{total:?}");
}

fn run(seed: u64) -> [u64; 4] {
    let mut draft_rows = 0;
    let mut rng = SmallRng::seed_from_u64(seed);
    let RandomBatcher {
        pool: p,
        batcher: mut bt,
        cfg,
        blocks,
        used,
        tokens,
        ..
    } = random_batcher(&mut rng, &[1, 2, 3, 4, 8], 8..40);
    let (bs, mode, swap_blocks) = (cfg.block_size, cfg.preemption, cfg.swap_blocks);
    let cache = Arc::new(pagedkv::prefix::PrefixCache::new(
        p.clone(),
        pagedkv::prefix::PrefixConfig { seed: Some(1) },
    ));
    if rng.gen_bool(0.5) {
        bt.attach_prefix_cache(cache.clone()).unwrap();
    }
    let bsz = bs as usize;
    let mut dev: Vec<Cell> = vec![None; blocks as usize * bsz];
    let mut host: Vec<Cell> = vec![None; swap_blocks.max(1) as usize * bsz];
    // Live sequences: their history (from the updates), root prompt and stop rules.
    let mut hist: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut meta: HashMap<u64, (Vec<u32>, StopRules)> = HashMap::new();
    let mut cut: HashMap<u64, bool> = HashMap::new();
    let mut next_id = 0u64;
    let mut fin: Vec<FinishedSeq> = Vec::new();
    let mut res = StepResults::default();
    let mut done = 0;
    let check_fin = |f: &FinishedSeq,
                     meta: &HashMap<u64, (Vec<u32>, StopRules)>,
                     cut: &HashMap<u64, bool>,
                     step: usize| {
        let (prompt, stop) = &meta[&f.id];
        let (want, why) = reference(prompt, stop);
        if matches!(f.reason, FinishReason::Aborted | FinishReason::Caller(_)) || cut[&f.id] {
            assert!(
                want.starts_with(&f.output),
                "seed {seed} step {step} seq {}: {:?} not a prefix of {:?}",
                f.id,
                f.output,
                want
            );
        } else {
            assert_eq!(
                (&f.output, f.reason),
                (&want, why),
                "seed {seed} step {step} seq {} ({mode:?})",
                f.id
            );
        }
    };
    for step in 0..4000 {
        if next_id < 30 && rng.gen_bool(0.3) {
            let len = rng.gen_range(1..20);
            let prompt: Vec<u32> = (0..len).map(|_| rng.gen_range(0..VOCAB)).collect();
            let stop = StopRules {
                max_new_tokens: if rng.gen_bool(0.2) {
                    1
                } else {
                    rng.gen_range(1..20)
                },
                eos: if rng.gen_bool(0.3) {
                    vec![rng.gen_range(0..VOCAB)]
                } else {
                    vec![]
                },
                stop_sequences: if rng.gen_bool(0.3) {
                    vec![(0..rng.gen_range(1..4))
                        .map(|_| rng.gen_range(0..VOCAB))
                        .collect()]
                } else {
                    vec![]
                },
            };
            let r = SeqRequest {
                id: next_id,
                prompt: prompt.clone(),
                stop: stop.clone(),
                priority: if rng.gen_bool(0.3) {
                    Priority::LatencyCritical
                } else {
                    Priority::Throughput
                },
            };
            if bt.add(r).is_ok() {
                hist.insert(next_id, prompt.clone());
                meta.insert(next_id, (prompt, stop));
                cut.insert(next_id, false);
            }
            next_id += 1;
        }
        let mut ids: Vec<u64> = hist.keys().copied().collect();
        ids.sort_unstable();
        for &id in &ids {
            if bt.phase(id) == Some(SeqPhase::Decoding) {
                if rng.gen_bool(0.1) && next_id < 60 {
                    if bt.fork(id, next_id).is_ok() {
                        hist.insert(next_id, hist[&id].clone());
                        meta.insert(next_id, meta[&id].clone());
                        cut.insert(next_id, false);
                    }
                    next_id += 1;
                } else if rng.gen_bool(0.4) {
                    // Drafts: the model's continuation, sometimes wrong past some point.
                    let n = rng.gen_range(1..5);
                    let mut h = hist[&id].clone();
                    let wrong_at = rng.gen_range(0..n + 2);
                    let mut d = Vec::new();
                    for k in 0..n {
                        let t = if k >= wrong_at {
                            rng.gen_range(0..VOCAB)
                        } else {
                            next_token(&h)
                        };
                        h.push(t);
                        d.push(t);
                    }
                    let _ = bt.propose(id, &d);
                }
            }
            if rng.gen_bool(0.005) {
                let _ = bt.abort(id);
            }
        }
        if rng.gen_bool(0.03) {
            bt.request_shed(rng.gen_range(0..6));
        }
        tokens.store(
            if rng.gen_bool(0.2) {
                rng.gen_range(0..8)
            } else {
                u32::MAX
            },
            Ordering::Relaxed,
        );
        let token_budget =
            (tokens.load(Ordering::Relaxed) as usize).min(cfg.max_batched_tokens as usize);
        fin.clear();
        let b = bt.schedule_into(&mut fin).clone();
        for f in &fin {
            check_fin(f, &meta, &cut, step);
            hist.remove(&f.id);
            done += 1;
        }
        check_batch(&b, bsz, token_budget);
        draft_rows += b.drafts.iter().filter(|&&d| d > 0).count() as u64;
        let discard = rng.gen_bool(0.04);
        let execute = !discard || rng.gen_bool(0.5);
        let mut sampled = Vec::new();
        if execute {
            for &(d, h) in &b.swap_out {
                for o in 0..bsz {
                    host[h as usize * bsz + o] = dev[d as usize * bsz + o];
                }
            }
            for &(h, d) in &b.swap_in {
                for o in 0..bsz {
                    dev[d as usize * bsz + o] = host[h as usize * bsz + o];
                }
            }
            let snap = dev.clone();
            for &(s, d) in &b.copies {
                for o in 0..bsz {
                    dev[d as usize * bsz + o] = snap[s as usize * bsz + o];
                }
            }
            for t in 0..b.num_tokens() {
                dev[b.slot_mapping[t] as usize] = Some((b.input_tokens[t], b.positions[t]));
            }
            let w = b.max_blocks_per_seq;
            let mut li = 0;
            for r in 0..b.num_seqs() {
                if !b.samples[r] {
                    continue;
                }
                for _ in 0..=b.drafts[r] {
                    let j = b.logits_indices[li] as usize;
                    li += 1;
                    let last = b.positions[j];
                    let ctx: Vec<u32> = (0..=last)
                        .map(|pos| {
                            let pg = b.block_tables[r * w + pos as usize / bsz];
                            match dev[pg as usize * bsz + pos as usize % bsz] {
                                Some((t, p)) if p == pos => t,
                                _ => u32::MAX,
                            }
                        })
                        .collect();
                    sampled.push(next_token(&ctx));
                }
            }
        }
        if discard {
            continue;
        }
        res.clear();
        fin.clear();
        bt.commit_with_updates(&sampled, &mut fin, &mut res)
            .unwrap();
        for u in &res.updates {
            hist.get_mut(&u.id)
                .unwrap()
                .extend_from_slice(res.tokens_of(u));
        }
        for f in &fin {
            check_fin(f, &meta, &cut, step);
            hist.remove(&f.id);
            done += 1;
        }
        if rng.gen_bool(0.01) {
            if let Some(&id) = ids.first() {
                if bt.finish_with(id, FinishReason::Caller(3)).is_ok() {
                    cut.insert(id, true);
                }
            }
        }
        if next_id >= 30 && !bt.has_work() {
            break;
        }
    }
    assert!(!bt.has_work(), "seed {seed}: livelock? {:?}", bt.stats());
    assert!(done > 0);
    let st = bt.stats();
    drop(bt);
    cache.clear();
    assert_eq!(p.free_count(), blocks, "seed {seed}");
    assert_eq!(used.load(Ordering::Relaxed), 0, "seed {seed}");
    [
        st.preempted_recompute,
        st.preempted_swap,
        st.cow_copies,
        draft_rows,
    ]
}
