//! Multi-threaded stress of the prefix cache. Two engine threads prefill (lookup, allocate with
//! eviction by share, write, insert), drop sequences, and forget-and-rewrite pages they hold
//! alone; a router thread only looks up. Every page carries a `content` word (the hash its KV
//! was written for): every hit, on any thread, must find the content of the hash it asked for
//! (no stale hit). Between rounds, at a quiescent point, the pool and the cache are checked
//! against the model rebuilt from what every thread holds: each page's reference count is its
//! holders' plus one if cached, the free count matches, and nothing leaks at the end.
//!
//! Every wait has a deadline: a thread hung inside a cache operation fails the test with a
//! message instead of hanging it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use pagedkv::block::{BlockId, BlockPool, EngineId, PoolConfig};
use pagedkv::prefix::{Inserted, MostOverShare, PrefixCache, PrefixConfig, PrefixKey};
use rand::{rngs::SmallRng, Rng, SeedableRng};

const PAGES: u32 = 48;
const BT: u32 = 4;
/// How long one round may take before the test calls a thread hung.
const STALL: Duration = Duration::from_secs(60);
/// Total time spent in rounds.
const RUN: Duration = Duration::from_millis(2500);
const OPS_PER_ROUND: usize = 3000;

struct Shared {
    pool: Arc<BlockPool>,
    cache: PrefixCache,
    /// Per page: the low word of the hash whose KV the page holds (0: none).
    content: Vec<AtomicU64>,
}

fn key(engine: u16) -> PrefixKey {
    PrefixKey {
        engine: EngineId(engine),
        adapter: 0,
        salt: 0,
        block_tokens: BT,
    }
}

/// A prompt sharing a prefix with others: one of a few bases, cut at a random length, then a
/// random tail.
fn prompt(rng: &mut SmallRng) -> Vec<u32> {
    let base = rng.gen_range(0..4u32);
    let keep = rng.gen_range(0..6) * BT as usize;
    let tail = rng.gen_range(0..10);
    let mut t: Vec<u32> = (0..keep as u32).map(|i| base * 1000 + i).collect();
    t.extend((0..tail).map(|_| rng.gen_range(0..3u32)));
    t
}

/// Checks every page of a hit against the content of the hash asked for.
fn verify_hit(s: &Shared, key: &PrefixKey, tokens: &[u32], ids: &[BlockId]) {
    let mut chain = Vec::new();
    s.cache.hasher().chain(key, tokens, &mut chain);
    for (id, h) in ids.iter().zip(&chain) {
        let seen = s.content[id.index() as usize].load(Ordering::Relaxed);
        assert_eq!(seen, h.lo, "stale hit: {id:?} holds another block's KV");
    }
}

fn engine_round(s: &Shared, engine: u16, seqs: &mut Vec<Vec<BlockId>>, rng: &mut SmallRng) {
    let k = key(engine);
    for _ in 0..OPS_PER_ROUND {
        match rng.gen_range(0..10) {
            0..=4 => {
                let tokens = prompt(rng);
                let mut ids = Vec::new();
                let hit = s.cache.lookup(&k, &tokens, &mut ids).unwrap();
                verify_hit(s, &k, &tokens, &ids);
                let mut chain = Vec::new();
                s.cache.hasher().chain(&k, &tokens, &mut chain);
                let need = (chain.len() - hit.blocks) as u32;
                let mut fresh = Vec::new();
                let usage = s.cache.usage(&[PAGES / 2, PAGES / 2]);
                if s.cache
                    .alloc_evicting(k.engine, need, &mut fresh, &usage, &mut MostOverShare)
                    .is_err()
                {
                    s.pool.free_n(&ids).unwrap();
                    continue;
                }
                for (h, id) in chain[hit.blocks..].iter().zip(&fresh) {
                    // Fresh pages are ours alone: write the KV, then publish it.
                    s.content[id.index() as usize].store(h.lo, Ordering::Relaxed);
                    let r = s.cache.insert(k.engine, *h, *id).unwrap();
                    assert!(
                        matches!(r, Inserted::Inserted | Inserted::Duplicate),
                        "{r:?}"
                    );
                }
                ids.extend(fresh);
                seqs.push(ids);
            }
            5..=7 if !seqs.is_empty() => {
                let ids = seqs.swap_remove(rng.gen_range(0..seqs.len()));
                s.pool.free_n(&ids).unwrap();
            }
            8 if !seqs.is_empty() => {
                // Forget and rewrite a page held alone (e.g. a rolled-back block).
                let seq = &seqs[rng.gen_range(0..seqs.len())];
                let Some(&id) = seq.last() else { continue };
                s.cache.forget(id).unwrap();
                if !s.pool.is_shared(id).unwrap() {
                    let junk: Vec<u32> = (0..BT).map(|_| rng.gen_range(5000..6000)).collect();
                    let h = s.cache.hasher().block(s.cache.hasher().root(&k), &junk);
                    s.content[id.index() as usize].store(h.lo, Ordering::Relaxed);
                    s.cache.insert(k.engine, h, id).unwrap();
                }
            }
            _ => {
                s.cache.evict(k.engine, rng.gen_range(0..3)).unwrap();
            }
        }
    }
}

fn router_round(s: &Shared, rng: &mut SmallRng) -> u64 {
    let mut hits = 0;
    for _ in 0..OPS_PER_ROUND {
        let k = key(rng.gen_range(0..2));
        let tokens = prompt(rng);
        let mut ids = Vec::new();
        s.cache.lookup(&k, &tokens, &mut ids).unwrap();
        verify_hit(s, &k, &tokens, &ids);
        hits += ids.len() as u64;
        s.pool.free_n(&ids).unwrap();
    }
    hits
}

fn check_quiescent(s: &Shared, held: &[Vec<BlockId>]) {
    let mut refs: std::collections::HashMap<BlockId, u32> = Default::default();
    for id in held.iter().flatten() {
        *refs.entry(*id).or_default() += 1;
    }
    let mut live = refs.len();
    for (id, n) in &refs {
        let cached = u32::from(s.cache.is_cached(*id));
        assert_eq!(s.pool.ref_count(*id), Ok(n + cached), "{id:?}");
    }
    // Cached pages nobody holds: exactly the reference the cache keeps.
    let cached_total = s.cache.cached_total();
    let cached_free = s.cache.reclaimable(None);
    let cached_held = refs.keys().filter(|id| s.cache.is_cached(**id)).count() as u32;
    assert_eq!(cached_free + cached_held, cached_total);
    live += cached_free as usize;
    assert_eq!(s.pool.free_count() as usize, PAGES as usize - live);
}

#[test]
fn engines_and_a_router_race_without_stale_hits_or_leaks() {
    let pool = Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: PAGES,
            max_engines: 2,
        })
        .unwrap(),
    );
    let s = Arc::new(Shared {
        cache: PrefixCache::new(pool.clone(), PrefixConfig { seed: None }),
        pool: pool.clone(),
        content: (0..PAGES).map(|_| AtomicU64::new(0)).collect(),
    });
    let mut held: Vec<Vec<Vec<BlockId>>> = vec![Vec::new(), Vec::new()];
    let start = Instant::now();
    let (mut rounds, mut router_hits) = (0u64, 0u64);
    while start.elapsed() < RUN {
        let (tx, rx) = mpsc::channel();
        for (engine, mut seqs) in held.drain(..).enumerate() {
            let (s, tx) = (s.clone(), tx.clone());
            let seed = rounds * 16 + engine as u64;
            thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(seed);
                engine_round(&s, engine as u16, &mut seqs, &mut rng);
                // Before reporting, so the last round's end leaves the cache to the test alone.
                drop(s);
                tx.send((engine, seqs, 0)).unwrap();
            });
        }
        {
            let (s, tx) = (s.clone(), tx.clone());
            let seed = rounds * 16 + 9;
            thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(seed);
                let hits = router_round(&s, &mut rng);
                drop(s);
                tx.send((2, Vec::new(), hits)).unwrap();
            });
        }
        drop(tx);
        let mut back: Vec<Option<Vec<Vec<BlockId>>>> = vec![None, None];
        for _ in 0..3 {
            let (who, seqs, hits) = rx.recv_timeout(STALL).unwrap_or_else(|e| {
                panic!("round {rounds}: a thread did not finish within {STALL:?} ({e}): hung, or panicked (see above)")
            });
            router_hits += hits;
            if who < 2 {
                back[who] = Some(seqs);
            }
        }
        held = back.into_iter().map(Option::unwrap).collect();
        let all: Vec<Vec<BlockId>> = held.iter().flatten().cloned().collect();
        check_quiescent(&s, &all);
        rounds += 1;
    }
    let m0 = s.cache.metrics(EngineId(0));
    let m1 = s.cache.metrics(EngineId(1));
    // The run must have exercised sharing and eviction, or it proves nothing.
    assert!(
        router_hits > 0 && m0.hit_blocks > 0 && m1.hit_blocks > 0,
        "{m0:?} {m1:?}"
    );
    assert!(m0.evictions + m1.evictions > 0, "{m0:?} {m1:?}");
    assert!(m0.forgets + m1.forgets > 0, "{m0:?} {m1:?}");
    eprintln!("{rounds} rounds, router hit blocks {router_hits}, engine 0 {m0:?}, engine 1 {m1:?}");
    for seqs in held.drain(..) {
        for ids in seqs {
            pool.free_n(&ids).unwrap();
        }
    }
    drop(Arc::into_inner(s).expect("every thread finished"));
    assert_eq!(pool.free_count(), PAGES, "leak");
    assert_eq!(pool.stats().held, vec![0, 0]);
}
