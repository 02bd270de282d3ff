//! Two engines (batchers of different block sizes, salts, forks, drafts, aborts, discarded
//! batches, swap and recompute preemption) share one pool and its prefix cache; engine 1 starts
//! eviction-only and turns reuse on mid-run; a third engine scribbles on every free page
//! between schedule and execution. Every row must read its own engine's KV of its own history
//! at every position (a hit on another model's page fails here), each engine's quota must be
//! exactly the pages it holds less its cached-free ones, the cache's per-engine `cached` count
//! must match a mirror kept from its events, and nothing leaks. A second test runs two engines
//! on two threads, each executing its batch on the shared shadow device between the other's
//! steps.

use pagedkv::block::{BlockPool, EngineId, PoolConfig};
use pagedkv::prefix::{PrefixCache, PrefixConfig};
use pagedkv::sched::{
    Batcher, BatcherConfig, FinishedSeq, PreemptionMode, Priority, SeqPhase, SeqRequest,
    StepResults, StopRules,
};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

#[path = "support/random_batcher.rs"]
mod random_batcher;
use random_batcher::Quota;

/// (engine, token, position) whose KV a slot holds.
type Cell = Option<(u16, u32, i32)>;
const MAXBS: usize = 8;

struct Eng {
    bt: Batcher,
    bs: usize,
    used: Arc<AtomicU32>,
    hist: HashMap<u64, Vec<u32>>,
    host: Vec<Cell>,
    next_id: u64,
}

/// A random batcher configuration for engine `e` with a block size from `sizes`; also returns
/// the block size and the swap blocks.
fn random_config(rng: &mut SmallRng, e: u16, sizes: &[u32]) -> (BatcherConfig, u32, u32) {
    let bs = sizes[rng.gen_range(0..sizes.len())];
    let swap_blocks = rng.gen_range(0..30);
    let cfg = BatcherConfig {
        engine: EngineId(e),
        block_size: bs,
        max_running: rng.gen_range(1..6),
        max_batched_tokens: rng.gen_range(1..40),
        max_prefill_chunk: rng.gen_range(1..16),
        max_blocks_per_seq: 48,
        preemption: if rng.gen_bool(0.5) {
            PreemptionMode::Recompute
        } else {
            PreemptionMode::Swap
        },
        swap_blocks,
    };
    (cfg, bs, swap_blocks)
}

/// Commits `n` random samples (tokens 0..3) and keeps each live sequence's history: the
/// tokens appended, a finished sequence's history dropped.
fn commit_random(
    bt: &mut Batcher,
    rng: &mut SmallRng,
    n: usize,
    res: &mut StepResults,
    fin: &mut Vec<FinishedSeq>,
    hist: &mut HashMap<u64, Vec<u32>>,
) {
    let sampled: Vec<u32> = (0..n).map(|_| rng.gen_range(0..3)).collect();
    res.clear();
    fin.clear();
    bt.commit_with_updates(&sampled, fin, res).unwrap();
    for u in &res.updates {
        hist.get_mut(&u.id)
            .unwrap()
            .extend_from_slice(res.tokens_of(u));
    }
    for f in fin.iter() {
        hist.remove(&f.id);
    }
}

#[test]
fn two_engines_share_a_cache_without_mixing_kv() {
    let mut tot = [0u64; 5];
    for seed in 0..1500 {
        let c = run(seed);
        for k in 0..5 {
            tot[k] += c[k];
        }
    }
    eprintln!("hit tokens, evictions, steps, preempt, swaps: {tot:?}");
    assert!(tot.iter().all(|&c| c > 100), "{tot:?}");
}

fn run(seed: u64) -> [u64; 5] {
    let mut rng = SmallRng::seed_from_u64(seed);
    let blocks: u32 = rng.gen_range(12..50);
    let pool = Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: blocks,
            max_engines: 3,
        })
        .unwrap(),
    );
    let (tx, rx) = std::sync::mpsc::sync_channel(1 << 16);
    let cache = Arc::new(
        PrefixCache::new(pool.clone(), PrefixConfig { seed: Some(1) }).with_events(Box::new(tx)),
    );
    let mut mirror: HashMap<u32, (u16, pagedkv::prefix::BlockHash)> = HashMap::new();
    let mut engs: Vec<Eng> = (0..2u16)
        .map(|e| {
            let (cfg, bs, swap_blocks) = random_config(&mut rng, e, &[1, 2, 3, 4, 8]);
            let used = Arc::new(AtomicU32::new(0));
            let mut bt = Batcher::new(cfg, pool.clone()).unwrap();
            bt.attach_budget(Box::new(Quota {
                tokens: Arc::new(AtomicU32::new(u32::MAX)),
                quota: rng.gen_range(4..=blocks),
                used: used.clone(),
            }));
            if e == 0 || rng.gen_bool(0.7) {
                bt.attach_prefix_cache(cache.clone()).unwrap();
            } else {
                bt.attach_prefix_cache_for_eviction(cache.clone()).unwrap();
            }
            Eng {
                bt,
                bs: bs as usize,
                used,
                hist: HashMap::new(),
                host: vec![None; swap_blocks.max(1) as usize * bs as usize],
                next_id: 0,
            }
        })
        .collect();
    let mut dev: Vec<Cell> = vec![None; blocks as usize * MAXBS];
    let mut fin: Vec<FinishedSeq> = Vec::new();
    let mut res = StepResults::default();
    let switch_at = rng.gen_range(0..200);
    for step in 0..3000 {
        if step == switch_at {
            engs[1].bt.attach_prefix_cache(cache.clone()).unwrap();
        }
        for (e, g) in engs.iter_mut().enumerate() {
            let e = e as u16;
            if g.next_id < 25 && rng.gen_bool(0.3) {
                let len = rng.gen_range(1..30);
                let prompt: Vec<u32> = (0..len)
                    .map(|i| {
                        if rng.gen_bool(0.85) {
                            i as u32
                        } else {
                            rng.gen_range(0..50)
                        }
                    })
                    .collect();
                let r = SeqRequest {
                    id: g.next_id,
                    prompt: prompt.clone(),
                    stop: StopRules {
                        max_new_tokens: rng.gen_range(1..12),
                        eos: vec![],
                        stop_sequences: vec![],
                    },
                    priority: if rng.gen_bool(0.3) {
                        Priority::LatencyCritical
                    } else {
                        Priority::Throughput
                    },
                };
                if g.bt.add_salted(r, rng.gen_range(0..2)).is_ok() {
                    g.hist.insert(g.next_id, prompt);
                }
                g.next_id += 1;
            }
            let ids: Vec<u64> = g.hist.keys().copied().collect();
            for &id in &ids {
                if g.bt.phase(id) == Some(SeqPhase::Decoding) {
                    if rng.gen_bool(0.15) && g.next_id < 50 {
                        if g.bt.fork(id, g.next_id).is_ok() {
                            let h = g.hist[&id].clone();
                            g.hist.insert(g.next_id, h);
                        }
                        g.next_id += 1;
                    } else if rng.gen_bool(0.2) {
                        let d: Vec<u32> = (0..rng.gen_range(1..4))
                            .map(|_| rng.gen_range(0..3))
                            .collect();
                        let _ = g.bt.propose(id, &d);
                    }
                }
                if rng.gen_bool(0.01) {
                    let _ = g.bt.abort(id);
                }
            }
            fin.clear();
            let b = g.bt.schedule_into(&mut fin).clone();
            for f in &fin {
                g.hist.remove(&f.id);
            }
            // A third engine grabs every free page and scribbles on it.
            let free = pool.free_count();
            let mut other = Vec::new();
            if free > 0 {
                pool.alloc_n(EngineId(2), free, &mut other).unwrap();
            }
            for id in &other {
                let pg = id.index() as usize;
                for o in 0..MAXBS {
                    dev[pg * MAXBS + o] = Some((2, u32::MAX, -7));
                }
            }
            pool.free_n(&other).unwrap();
            let bsz = g.bs;
            let at = |slot: i64| {
                let (pg, o) = (slot as usize / bsz, slot as usize % bsz);
                pg * MAXBS + o
            };
            let discard = rng.gen_bool(0.04);
            if !discard || rng.gen_bool(0.5) {
                for &(d, h) in &b.swap_out {
                    for o in 0..bsz {
                        g.host[h as usize * bsz + o] = dev[d as usize * MAXBS + o];
                    }
                }
                for &(h, d) in &b.swap_in {
                    for o in 0..bsz {
                        dev[d as usize * MAXBS + o] = g.host[h as usize * bsz + o];
                    }
                }
                let snap = dev.clone();
                for &(s, d) in &b.copies {
                    for o in 0..MAXBS {
                        dev[d as usize * MAXBS + o] = snap[s as usize * MAXBS + o];
                    }
                }
                for t in 0..b.num_tokens() {
                    dev[at(b.slot_mapping[t])] = Some((e, b.input_tokens[t], b.positions[t]));
                }
                let w = b.max_blocks_per_seq;
                for r in 0..b.num_seqs() {
                    let id = b.seq_ids[r];
                    let h = &g.hist[&id];
                    let a = b.query_start_loc[r] as usize;
                    let start = b.positions[a];
                    for pos in 0..b.context_lens[r] {
                        let want = if pos < start {
                            h[pos as usize]
                        } else {
                            b.input_tokens[a + (pos - start) as usize]
                        };
                        let pg = b.block_tables[r * w + pos as usize / bsz];
                        let cell = dev[pg as usize * MAXBS + pos as usize % bsz];
                        assert_eq!(
                            cell,
                            Some((e, want, pos)),
                            "seed {seed} step {step} engine {e} seq {id} pos {pos}"
                        );
                    }
                }
            }
            if discard {
                continue;
            }
            let n = b.num_samples();
            commit_random(&mut g.bt, &mut rng, n, &mut res, &mut fin, &mut g.hist);
        }
        // Each engine's quota: the pages it holds, less its cached-free ones (between steps,
        // after both commits: no swap-out pending).
        while let Ok(ev) = rx.try_recv() {
            match ev {
                pagedkv::prefix::CacheEvent::Stored { engine, hash, page } => {
                    assert!(mirror.insert(page.index(), (engine.0, hash)).is_none());
                }
                pagedkv::prefix::CacheEvent::Removed { engine, hash, page } => {
                    assert_eq!(mirror.remove(&page.index()), Some((engine.0, hash)));
                }
            }
        }
        assert_eq!(cache.events_dropped(), 0);
        for (e, g) in engs.iter().enumerate() {
            let e = EngineId(e as u16);
            let n = mirror.values().filter(|v| v.0 == e.0).count() as u32;
            assert_eq!(cache.cached(e), n, "seed {seed} step {step}: cached count");
            assert_eq!(cache.metrics(e).cached, n);
            assert!(g.bt.stats().prefix_reused_tokens <= cache.metrics(e).hit_tokens);
            assert!(g.bt.stats().prefix_hit_tokens <= g.bt.stats().prefix_prompt_tokens);
            assert_eq!(
                g.used.load(Ordering::Relaxed),
                pool.held(e) - cache.reclaimable(Some(e)),
                "seed {seed} step {step} engine {e:?}: budget drifted"
            );
        }
        if engs.iter().all(|g| g.next_id >= 25 && !g.bt.has_work()) {
            break;
        }
    }
    let m = [cache.metrics(EngineId(0)), cache.metrics(EngineId(1))];
    let st = [engs[0].bt.stats(), engs[1].bt.stats()];
    let counts = [
        m[0].hit_tokens + m[1].hit_tokens,
        m[0].evictions + m[1].evictions,
        st[0].steps + st[1].steps,
        st[0].preempted_recompute + st[1].preempted_recompute,
        st[0].preempted_swap + st[1].preempted_swap,
    ];
    for g in &engs {
        assert!(
            !g.bt.has_work(),
            "seed {seed}: livelock? {:?}",
            g.bt.stats()
        );
    }
    for (e, g) in engs.into_iter().enumerate() {
        let used = g.used.clone();
        drop(g);
        assert_eq!(used.load(Ordering::Relaxed), 0, "seed {seed} engine {e}");
    }
    assert_eq!(
        cache.cached_total(),
        0,
        "seed {seed}: pages cached after both engines left"
    );
    assert_eq!(pool.free_count(), blocks, "seed {seed}");
    counts
}

/// The same two engines on two threads: each schedules, then executes and checks its batch
/// on the shared shadow device (under a lock), then commits; the other engine's steps (its
/// allocations, evictions and writes) land in between.
#[test]
fn two_engine_threads_share_a_cache_without_mixing_kv() {
    for seed in 0..40 {
        run_threads(seed);
    }
}

fn run_threads(seed: u64) {
    use std::sync::Mutex;
    let mut rng = SmallRng::seed_from_u64(seed);
    let blocks: u32 = rng.gen_range(12..40);
    let pool = Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: blocks,
            max_engines: 2,
        })
        .unwrap(),
    );
    let cache = Arc::new(PrefixCache::new(
        pool.clone(),
        PrefixConfig { seed: Some(1) },
    ));
    let dev: Arc<Mutex<Vec<Cell>>> = Arc::new(Mutex::new(vec![None; blocks as usize * MAXBS]));
    let mut handles = Vec::new();
    for e in 0..2u16 {
        let (pool, cache, dev) = (pool.clone(), cache.clone(), dev.clone());
        let tseed = seed * 2 + u64::from(e);
        handles.push(std::thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(tseed);
            let (cfg, bs, swap_blocks) = random_config(&mut rng, e, &[1, 2, 4, 8]);
            let used = Arc::new(AtomicU32::new(0));
            let mut bt = Batcher::new(cfg, pool.clone()).unwrap();
            bt.attach_budget(Box::new(Quota {
                tokens: Arc::new(AtomicU32::new(u32::MAX)),
                quota: rng.gen_range(6..=blocks),
                used: used.clone(),
            }));
            bt.attach_prefix_cache(cache.clone()).unwrap();
            let bsz = bs as usize;
            let mut host: Vec<Cell> = vec![None; swap_blocks.max(1) as usize * bsz];
            let mut hist: HashMap<u64, Vec<u32>> = HashMap::new();
            let mut next_id = 0;
            let mut fin = Vec::new();
            let mut res = StepResults::default();
            for step in 0..20000 {
                if next_id < 40 && rng.gen_bool(0.3) {
                    let len = rng.gen_range(1..30);
                    let prompt: Vec<u32> = (0..len)
                        .map(|i| {
                            if rng.gen_bool(0.9) {
                                i as u32
                            } else {
                                rng.gen_range(0..50)
                            }
                        })
                        .collect();
                    let r = SeqRequest {
                        id: next_id,
                        prompt: prompt.clone(),
                        stop: StopRules {
                            max_new_tokens: rng.gen_range(1..12),
                            eos: vec![],
                            stop_sequences: vec![],
                        },
                        priority: Priority::Throughput,
                    };
                    if bt.add(r).is_ok() {
                        hist.insert(next_id, prompt);
                    }
                    next_id += 1;
                }
                let ids: Vec<u64> = hist.keys().copied().collect();
                for &id in &ids {
                    if bt.phase(id) == Some(SeqPhase::Decoding) && rng.gen_bool(0.1) && next_id < 80
                    {
                        if bt.fork(id, next_id).is_ok() {
                            let h = hist[&id].clone();
                            hist.insert(next_id, h);
                        }
                        next_id += 1;
                    }
                    if rng.gen_bool(0.01) {
                        let _ = bt.abort(id);
                    }
                }
                fin.clear();
                let b = bt.schedule_into(&mut fin).clone();
                for f in &fin {
                    hist.remove(&f.id);
                }
                std::thread::yield_now();
                {
                    let mut dev = dev.lock().unwrap();
                    let at = |slot: i64| (slot as usize / bsz) * MAXBS + slot as usize % bsz;
                    for &(d, h) in &b.swap_out {
                        for o in 0..bsz {
                            host[h as usize * bsz + o] = dev[d as usize * MAXBS + o];
                        }
                    }
                    for &(h, d) in &b.swap_in {
                        for o in 0..bsz {
                            dev[d as usize * MAXBS + o] = host[h as usize * bsz + o];
                        }
                    }
                    let snap = dev.clone();
                    for &(s, d) in &b.copies {
                        for o in 0..MAXBS {
                            dev[d as usize * MAXBS + o] = snap[s as usize * MAXBS + o];
                        }
                    }
                    for t in 0..b.num_tokens() {
                        dev[at(b.slot_mapping[t])] = Some((e, b.input_tokens[t], b.positions[t]));
                    }
                    let w = b.max_blocks_per_seq;
                    for r in 0..b.num_seqs() {
                        let id = b.seq_ids[r];
                        let h = &hist[&id];
                        let a = b.query_start_loc[r] as usize;
                        let start = b.positions[a];
                        for pos in 0..b.context_lens[r] {
                            let want = if pos < start {
                                h[pos as usize]
                            } else {
                                b.input_tokens[a + (pos - start) as usize]
                            };
                            let pg = b.block_tables[r * w + pos as usize / bsz];
                            let cell = dev[pg as usize * MAXBS + pos as usize % bsz];
                            assert_eq!(
                                cell,
                                Some((e, want, pos)),
                                "seed {tseed} step {step} engine {e} seq {id} pos {pos}"
                            );
                        }
                    }
                }
                std::thread::yield_now();
                let n = b.num_samples();
                commit_random(&mut bt, &mut rng, n, &mut res, &mut fin, &mut hist);
                if next_id >= 40 && !bt.has_work() {
                    break;
                }
            }
            assert!(!bt.has_work(), "seed {tseed}: livelock? {:?}", bt.stats());
            assert_eq!(used.load(Ordering::Relaxed), 0, "seed {tseed}");
            (bt, used)
        }));
    }
    let done: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (bt, used) in done {
        drop(bt);
        assert_eq!(used.load(Ordering::Relaxed), 0);
    }
    assert_eq!(cache.cached_total(), 0, "seed {seed}");
    assert_eq!(pool.free_count(), blocks, "seed {seed}");
}
