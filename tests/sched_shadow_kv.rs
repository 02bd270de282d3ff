//! The batcher against a shadow of the KV it schedules: random workloads (forks, draft
//! proposals, aborts, discarded batches, swap and recompute preemption, the prefix cache, a
//! block quota) on a small pool, each batch "executed" on a model of the device and host pages
//! (swap-outs, swap-ins, copies at once, then the rows' KV writes), with a second engine
//! grabbing every free page and writing junk into it between schedule and execution. Every
//! row must read its own token history at every position of its context, the copies of a step
//! must not read a page they write, the quota must match the pages in use, and nothing may
//! leak or livelock.

#[path = "support/random_batcher.rs"]
mod random_batcher;
use pagedkv::block::EngineId;
use pagedkv::sched::{FinishedSeq, Priority, SeqPhase, SeqRequest, StepResults, StopRules};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use random_batcher::{random_batcher, RandomBatcher};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A KV slot of the shadow device or host: the token and position whose KV it holds.
type Cell = Option<(u32, i32)>;

#[test]
fn every_row_reads_its_own_history() {
    let mut cow = 0;
    for seed in 0..SEEDS {
        cow += run(seed);
    }
    assert!(cow > 100, "the workloads copy on write ({cow} copies)");
}

const SEEDS: u64 = 3000;

/// One random workload; returns its copy-on-write count.
fn run(seed: u64) -> u64 {
    let mut rng = SmallRng::seed_from_u64(seed);
    let RandomBatcher {
        pool: p,
        batcher: mut bt,
        cfg,
        blocks,
        quota,
        used,
        tokens,
        ..
    } = random_batcher(&mut rng, &[1, 2, 4, 3], 6..30);
    let (bs, mode, swap_blocks) = (cfg.block_size, cfg.preemption, cfg.swap_blocks);
    let prefix = rng.gen_bool(0.5);
    let cache = Arc::new(pagedkv::prefix::PrefixCache::new(
        p.clone(),
        pagedkv::prefix::PrefixConfig { seed: Some(1) },
    ));
    if prefix {
        bt.attach_prefix_cache(cache.clone()).unwrap();
    }
    let bsz = bs as usize;
    let mut dev: Vec<Cell> = vec![None; blocks as usize * bsz];
    let mut host: Vec<Cell> = vec![None; swap_blocks.max(1) as usize * bsz];
    let mut hist: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut next_id = 0u64;
    let mut fin: Vec<FinishedSeq> = Vec::new();
    let mut res = StepResults::default();
    for step in 0..3000 {
        if next_id < 30 && rng.gen_bool(0.3) {
            let len = rng.gen_range(1..20);
            let prompt: Vec<u32> = (0..len)
                .map(|i| {
                    if rng.gen_bool(0.8) {
                        i as u32
                    } else {
                        rng.gen_range(0..1000)
                    }
                })
                .collect();
            let r = SeqRequest {
                id: next_id,
                prompt: prompt.clone(),
                stop: StopRules {
                    max_new_tokens: rng.gen_range(1..20),
                    eos: vec![],
                    stop_sequences: vec![],
                },
                priority: if rng.gen_bool(0.3) {
                    Priority::LatencyCritical
                } else {
                    Priority::Throughput
                },
            };
            if bt.add(r).is_ok() {
                hist.insert(next_id, prompt);
            }
            next_id += 1;
        }
        // Forks, draft proposals and aborts of random live sequences.
        let ids: Vec<u64> = hist.keys().copied().collect();
        for &id in &ids {
            if bt.phase(id) == Some(SeqPhase::Decoding) {
                if rng.gen_bool(0.25) && next_id < 60 {
                    if bt.fork(id, next_id).is_ok() {
                        let h = hist[&id].clone();
                        hist.insert(next_id, h);
                    }
                    next_id += 1;
                } else if rng.gen_bool(0.2) {
                    let d: Vec<u32> = (0..rng.gen_range(1..4))
                        .map(|_| rng.gen_range(0..3))
                        .collect();
                    let _ = bt.propose(id, &d);
                }
            }
            if rng.gen_bool(0.01) {
                let _ = bt.abort(id);
            }
        }
        if rng.gen_bool(0.05) {
            bt.request_shed(rng.gen_range(0..6));
        }
        if rng.gen_bool(0.1) {
            tokens.store(
                if rng.gen_bool(0.3) {
                    0
                } else {
                    rng.gen_range(1..40)
                },
                Ordering::Relaxed,
            );
        }
        fin.clear();
        let b = bt.schedule_into(&mut fin).clone();
        for f in &fin {
            hist.remove(&f.id);
        }
        // Another engine grabs every free page and scribbles on it.
        let free = p.free_count();
        let mut other = Vec::new();
        if free > 0 {
            p.alloc_n(EngineId(1), free, &mut other).unwrap();
        }
        for id in &other {
            let pg = id.index() as usize;
            for o in 0..bsz {
                dev[pg * bsz + o] = Some((u32::MAX, -7));
            }
        }
        p.free_n(&other).unwrap();
        let discard = rng.gen_bool(0.05);
        let execute = !discard || rng.gen_bool(0.5);
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
            let mut dsts = std::collections::HashSet::new();
            for &(_, d) in &b.copies {
                assert!(dsts.insert(d));
            }
            for &(s, _) in &b.copies {
                assert!(!dsts.contains(&s), "seed {seed} step {step}: copy overlap");
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
            // Every row reads its history: the prompt and the tokens committed, then this step's.
            let w = b.max_blocks_per_seq;
            for r in 0..b.num_seqs() {
                let id = b.seq_ids[r];
                let h = &hist[&id];
                let (a, e) = (
                    b.query_start_loc[r] as usize,
                    b.query_start_loc[r + 1] as usize,
                );
                let start = b.positions[a];
                assert_eq!(b.context_lens[r] as usize, start as usize + (e - a));
                for pos in 0..b.context_lens[r] {
                    let want = if pos < start {
                        h[pos as usize]
                    } else {
                        b.input_tokens[a + (pos - start) as usize]
                    };
                    if pos < start || (pos as usize) < h.len() {
                        assert_eq!(
                            want, h[pos as usize],
                            "seed {seed} step {step} seq {id} input pos {pos}"
                        );
                    }
                    let pg = b.block_tables[r * w + pos as usize / bsz];
                    let cell = dev[pg as usize * bsz + pos as usize % bsz];
                    assert_eq!(
                        cell,
                        Some((want, pos)),
                        "seed {seed} step {step} seq {id} pos {pos} (start {start}, {mode:?})"
                    );
                }
            }
        }
        if discard {
            continue;
        }
        let sampled: Vec<u32> = (0..b.num_samples()).map(|_| rng.gen_range(0..3)).collect();
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
            let h = hist.remove(&f.id).unwrap();
            assert_eq!(&h[h.len() - f.output.len()..], &f.output[..]);
        }
        assert!(used.load(Ordering::Relaxed) <= quota);
        // With the cache, cached-free pages have left the budget.
        if prefix {
            assert_eq!(
                used.load(Ordering::Relaxed),
                blocks - p.free_count() - cache.reclaimable(None),
                "seed {seed} step {step}: budget drifted (prefix)"
            );
        }
        // Without the cache, the quota counts exactly the pages in use.
        if !prefix {
            assert_eq!(
                used.load(Ordering::Relaxed),
                blocks - p.free_count(),
                "seed {seed} step {step}: budget drifted"
            );
        }
        if next_id >= 30 && !bt.has_work() {
            break;
        }
    }
    assert!(!bt.has_work(), "seed {seed}: livelock? {:?}", bt.stats());
    let cow = bt.stats().cow_copies;
    drop(bt);
    cache.clear();
    assert_eq!(p.free_count(), blocks, "seed {seed}");
    assert_eq!(used.load(Ordering::Relaxed), 0, "seed {seed}");
    cow
}
