//! Prefix cache: pagedkv's lock-free index beside a `Mutex<HashMap<BlockHash, BlockId>>`
//! (the usual design: one map behind one lock), in the same groups so every claim is a ratio
//! from one run.
//!
//! Both sides do the same work: the same chained hashing (`BlockHasher`), the same pool
//! reference per hit (`share`, and `free_n` to give the hits back), the same pool. The baseline
//! is given every advantage: it takes its lock once per lookup (not per block), and its map
//! hashes the already-uniform `BlockHash` with a pass-through hasher instead of SipHash.
//!
//! - `prefix_lookup/hit64`: a 1024-token prompt whose 64 blocks (16 tokens) are all cached,
//!   in a cache holding 4,096 other blocks; per lookup.
//! - `prefix_lookup/miss`: the same prompt with its first token changed (one hash, one probe).
//! - `prefix_lookup/hit64_2t_same`, `hit64_2t_distinct`: two threads (router and engine)
//!   looking up at once, the same prompt or two prompts sharing no page; time per lookup of
//!   each thread (the wall time of both).
//! - `prefix_insert/insert_remove64`: 64 blocks inserted then removed (the cache's `forget`,
//!   the map's `remove`, each with the cache's pool reference taken and given back).

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use pagedkv::block::{BlockId, BlockPool, EngineId, PoolConfig};
use pagedkv::prefix::{BlockHash, BlockHasher, Inserted, PrefixCache, PrefixConfig, PrefixKey};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

const PAGES: u32 = 8192;
const BT: u32 = 16;
const BLOCKS: usize = 64;
const FILLER: usize = 4096;

/// The map's hasher: the key is already a uniform 128-bit hash, so take its low word.
#[derive(Default)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 ^= v;
    }
}

type Map = HashMap<BlockHash, BlockId, BuildHasherDefault<PassThrough>>;

/// The baseline: one map behind one lock.
struct MutexIndex {
    map: Mutex<Map>,
    hasher: BlockHasher,
}

impl MutexIndex {
    fn lookup(&self, pool: &BlockPool, key: &PrefixKey, tokens: &[u32], out: &mut Vec<BlockId>) {
        let map = self.map.lock().unwrap();
        let mut parent = self.hasher.root(key);
        for block in tokens.chunks_exact(key.block_tokens as usize) {
            parent = self.hasher.block(parent, block);
            match map.get(&parent) {
                Some(&id) if pool.share(id).is_ok() => out.push(id),
                _ => break,
            }
        }
    }
}

struct Fixture {
    pool: Arc<BlockPool>,
    cache: PrefixCache,
    base: MutexIndex,
    key: PrefixKey,
    prompt: Vec<u32>,
    /// Another cached 64-block prompt, sharing no page with `prompt`.
    prompt2: Vec<u32>,
    miss: Vec<u32>,
}

fn fixture() -> Fixture {
    let pool = Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: PAGES,
            max_engines: 1,
        })
        .unwrap(),
    );
    let cache = PrefixCache::new(pool.clone(), PrefixConfig { seed: Some(5) });
    let base = MutexIndex {
        map: Mutex::new(Map::default()),
        hasher: *cache.hasher(),
    };
    let key = PrefixKey {
        engine: EngineId(0),
        adapter: 0,
        salt: 0,
        block_tokens: BT,
    };
    let prompt: Vec<u32> = (0..BLOCKS as u32 * BT).map(|i| i * 7 + 1).collect();
    let prompt2: Vec<u32> = prompt.iter().map(|t| t + 500_000).collect();
    let mut miss = prompt.clone();
    miss[0] ^= 1;
    // The prompt's blocks, then filler blocks (distinct single-block prompts), cached in both
    // indexes and held by nobody else (cached-free).
    let add = |tokens: &[u32]| {
        let mut chain = Vec::new();
        cache.hasher().chain(&key, tokens, &mut chain);
        for h in chain {
            let id = pool.alloc(EngineId(0)).unwrap();
            assert_eq!(cache.insert(EngineId(0), h, id), Ok(Inserted::Inserted));
            pool.share(id).unwrap(); // the baseline's own reference
            base.map.lock().unwrap().insert(h, id);
            pool.release(id).unwrap();
        }
    };
    add(&prompt);
    add(&prompt2);
    for i in 0..FILLER as u32 {
        add(&[i + 1_000_000; BT as usize]);
    }
    Fixture {
        pool,
        cache,
        base,
        key,
        prompt,
        prompt2,
        miss,
    }
}

fn lookup(c: &mut Criterion) {
    let f = fixture();
    // Correctness inside the bench: both find the same 64 pages.
    let (mut a, mut b) = (Vec::new(), Vec::new());
    assert_eq!(
        f.cache.lookup(&f.key, &f.prompt, &mut a).unwrap().blocks,
        BLOCKS
    );
    f.base.lookup(&f.pool, &f.key, &f.prompt, &mut b);
    assert_eq!(a, b);
    f.pool.free_n(&a).unwrap();
    f.pool.free_n(&b).unwrap();

    let mut g = c.benchmark_group("prefix_lookup");
    g.throughput(Throughput::Elements(1));
    let mut out = Vec::with_capacity(BLOCKS);
    for (name, tokens, hits) in [("hit64", &f.prompt, BLOCKS), ("miss", &f.miss, 0)] {
        g.bench_function(format!("{name}/pagedkv"), |bch| {
            bch.iter(|| {
                out.clear();
                let h = f.cache.lookup(&f.key, black_box(tokens), &mut out).unwrap();
                debug_assert_eq!(h.blocks, hits);
                f.pool.free_n(&out).unwrap();
            })
        });
        g.bench_function(format!("{name}/mutex_hashmap"), |bch| {
            bch.iter(|| {
                out.clear();
                f.base.lookup(&f.pool, &f.key, black_box(tokens), &mut out);
                debug_assert_eq!(out.len(), hits);
                f.pool.free_n(&out).unwrap();
            })
        });
    }
    // Two threads at once: on the same prompt (the same 64 pages: their pool reference words
    // are contended too), and on two prompts that share no page (only the index is shared).
    let f = Arc::new(f);
    for (case, same) in [("hit64_2t_same", true), ("hit64_2t_distinct", false)] {
        for which in ["pagedkv", "mutex_hashmap"] {
            g.bench_function(format!("{case}/{which}"), |bch| {
                bch.iter_custom(|iters| {
                    let go = Arc::new(Barrier::new(2));
                    let run = |second: bool| {
                        let (f, go) = (f.clone(), go.clone());
                        move || {
                            let tokens = if second && !same {
                                &f.prompt2
                            } else {
                                &f.prompt
                            };
                            let mut out = Vec::with_capacity(BLOCKS);
                            go.wait();
                            let t = Instant::now();
                            for _ in 0..iters {
                                out.clear();
                                if which == "pagedkv" {
                                    f.cache.lookup(&f.key, tokens, &mut out).unwrap();
                                } else {
                                    f.base.lookup(&f.pool, &f.key, tokens, &mut out);
                                }
                                assert_eq!(out.len(), BLOCKS);
                                f.pool.free_n(&out).unwrap();
                            }
                            t.elapsed()
                        }
                    };
                    let other = std::thread::spawn(run(true));
                    let mine = run(false)();
                    mine.max(other.join().unwrap())
                })
            });
        }
    }
    g.finish();
}

fn insert(c: &mut Criterion) {
    let f = fixture();
    let mut chain = Vec::new();
    let tokens: Vec<u32> = (0..BLOCKS as u32 * BT).map(|i| i + 3_000_000).collect();
    f.cache.hasher().chain(&f.key, &tokens, &mut chain);
    let mut ids = Vec::new();
    f.pool
        .alloc_n(EngineId(0), BLOCKS as u32, &mut ids)
        .unwrap();
    let mut g = c.benchmark_group("prefix_insert");
    g.throughput(Throughput::Elements(BLOCKS as u64));
    g.bench_function("insert_remove64/pagedkv", |bch| {
        bch.iter(|| {
            for (h, id) in chain.iter().zip(&ids) {
                let r = f.cache.insert(EngineId(0), *h, *id);
                debug_assert_eq!(r, Ok(Inserted::Inserted));
                black_box(r).ok();
            }
            for id in &ids {
                let r = f.cache.forget(*id);
                debug_assert_eq!(r, Ok(true));
                black_box(r).ok();
            }
        })
    });
    g.bench_function("insert_remove64/mutex_hashmap", |bch| {
        bch.iter(|| {
            for (h, id) in chain.iter().zip(&ids) {
                f.pool.share(*id).unwrap();
                let mut map = f.base.map.lock().unwrap();
                // Dedup as the cache does: an existing entry wins.
                if map.contains_key(h) {
                    drop(map);
                    f.pool.release(*id).unwrap();
                } else {
                    map.insert(*h, *id);
                }
            }
            for h in &chain {
                let id = f.base.map.lock().unwrap().remove(h).unwrap();
                f.pool.release(id).unwrap();
            }
        })
    });
    g.finish();
    f.pool.free_n(&ids).unwrap();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(3));
    targets = lookup, insert
}
criterion_main!(benches);
