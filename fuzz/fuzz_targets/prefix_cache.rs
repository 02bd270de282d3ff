//! Fuzz the prefix cache with arbitrary operation sequences: lookups (any key, any tokens, zero
//! block sizes, unknown engines), inserts of held, raw and foreign ids under arbitrary hashes,
//! forgets, evictions by engine and by share, allocation with eviction, clears, purges. Every
//! call either succeeds or returns a typed error with the pool unchanged; after every step each
//! page's reference count is its holders' plus one if cached, and nothing leaks at the end.
//! A model of what is cached (each `Inserted` page under its engine and token prefix, dropped
//! once the page leaves the cache) checks every lookup's pages: exactly the longest chain of
//! cached full blocks of that engine, salt and block size, in order; nothing else.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pagedkv::block::{BlockId, BlockPool, EngineId, PoolConfig};
use pagedkv::prefix::{
    BlockHash, EngineUsage, Inserted, MostOverShare, PrefixCache, PrefixConfig, PrefixKey,
};
use std::sync::Arc;

#[derive(Debug, Arbitrary)]
struct Input {
    num_blocks: u8,
    max_engines: u8,
    seed: u64,
    ops: Vec<Op>,
}

#[derive(Debug, Arbitrary)]
enum Op {
    Alloc(u8),
    Release(u8),
    Lookup {
        engine: u8,
        salt: u8,
        block_tokens: u8,
        tokens: Vec<u8>,
    },
    /// Look up the last `InsertHeld`'s tokens, then `more`, under its engine (or `engine`)
    /// and salt (or `salt`): a likely hit, unless the key differs.
    LookupAgain {
        engine: Option<u8>,
        salt: Option<u8>,
        more: Vec<u8>,
    },
    /// Insert held reference `i` under the chain hash of `tokens` (salt 0 or 1); `whole`:
    /// references `i..` under each of its blocks' hashes.
    InsertHeld {
        i: u8,
        engine: u8,
        salt: bool,
        whole: bool,
        tokens: Vec<u8>,
    },
    InsertRaw {
        engine: u8,
        bits: u64,
        lo: u64,
        hi: u64,
    },
    Forget(u8),
    ForgetRaw(u64),
    Evict(u8, u8),
    EvictBy(u8, Vec<(u8, u8, u8, u8)>),
    AllocEvicting(u8, u8, Vec<u8>),
    Clear,
    /// `purge_engine`: every page of the engine leaves, held ones too.
    Purge(u8),
}

fuzz_target!(|input: Input| {
    let n = u32::from(input.num_blocks);
    let engines = u16::from(input.max_engines);
    let Ok(pool) = BlockPool::new(PoolConfig {
        device: 3,
        num_blocks: n,
        max_engines: engines,
    }) else {
        assert!(n == 0 || engines == 0);
        return;
    };
    let pool = Arc::new(pool);
    let cache = PrefixCache::new(
        pool.clone(),
        PrefixConfig {
            seed: Some(input.seed),
        },
    );
    // References this harness holds, one entry per reference.
    let mut refs: Vec<BlockId> = Vec::new();
    // Model of the cache: (engine, salt, token prefix) -> page, for pages inserted under the
    // chain hash of `InsertHeld` (adapter 0, two tokens a block); pruned after every step of
    // pages no longer cached.
    let mut model: Vec<(u16, u64, Vec<u32>, BlockId)> = Vec::new();
    // The last `InsertHeld`'s engine, salt and tokens.
    let mut last: (u8, u8, Vec<u8>) = (0, 0, Vec::new());
    for op in input.ops.into_iter().take(256) {
        let before = pool.stats();
        let op = match op {
            Op::LookupAgain { engine, salt, more } => Op::Lookup {
                engine: engine.unwrap_or(last.0),
                salt: salt.unwrap_or(last.1),
                block_tokens: 2,
                tokens: last.2.iter().chain(&more).copied().collect(),
            },
            op => op,
        };
        match op {
            Op::Alloc(e) => {
                if let Ok(id) = pool.alloc(EngineId(u16::from(e))) {
                    refs.push(id);
                }
            }
            Op::Release(i) if !refs.is_empty() => {
                let id = refs.swap_remove(i as usize % refs.len());
                pool.release(id).unwrap();
            }
            Op::Lookup {
                engine,
                salt,
                block_tokens,
                tokens,
            } => {
                // Small engines, salts and block sizes, so lookups meet what was inserted
                // (engines past the registry, salts and sizes never inserted still occur).
                let key = PrefixKey {
                    engine: EngineId(u16::from(engine % 4)),
                    adapter: 0,
                    salt: u64::from(salt % 3),
                    block_tokens: u32::from(block_tokens % 4),
                };
                let tokens: Vec<u32> = tokens.iter().map(|&t| u32::from(t % 4)).collect();
                // The model's hit: the model's pages for this key's leading full blocks, up to
                // the first miss (only two tokens a block were ever inserted).
                let mut want = Vec::new();
                if key.block_tokens == 2 {
                    for end in (2..=tokens.len()).step_by(2) {
                        let Some(e) = model.iter().find(|(me, ms, mt, _)| {
                            *me == key.engine.0 && *ms == key.salt && mt[..] == tokens[..end]
                        }) else {
                            break;
                        };
                        want.push(e.3);
                    }
                }
                let mut got = Vec::new();
                match cache.lookup(&key, &tokens, &mut got) {
                    Ok(hit) => {
                        assert_eq!(got, want, "lookup {key:?} {tokens:?}");
                        assert_eq!(hit.tokens, got.len() * key.block_tokens as usize);
                        assert_eq!(hit.blocks, got.len());
                        assert!(hit.tokens <= tokens.len());
                        refs.extend(got);
                    }
                    Err(_) => {
                        assert!(got.is_empty());
                        assert!(
                            want.is_empty(),
                            "lookup {key:?} refused, model hits {want:?}"
                        );
                        assert_eq!(pool.stats(), before);
                    }
                }
            }
            Op::InsertHeld {
                i,
                engine,
                salt,
                whole,
                tokens,
            } if !refs.is_empty() => {
                last = (engine, u8::from(salt), tokens.clone());
                let key = PrefixKey {
                    engine: EngineId(u16::from(engine % 4)),
                    adapter: 0,
                    salt: u64::from(salt),
                    block_tokens: 2,
                };
                let tokens: Vec<u32> = tokens.iter().map(|&t| u32::from(t % 4)).collect();
                let mut chain = Vec::new();
                cache.hasher().chain(&key, &tokens, &mut chain);
                // The last block's hash alone, or (`whole`, as a sequence caches its blocks)
                // each block's on held references `i`, `i + 1`, ...
                let blocks: Vec<usize> = if whole && !chain.is_empty() {
                    (1..=chain.len()).collect()
                } else {
                    vec![chain.len()]
                };
                for (k, &nb) in blocks.iter().enumerate() {
                    let id = refs[(i as usize + k) % refs.len()];
                    let h = nb.checked_sub(1).map(|j| chain[j]).unwrap_or_default();
                    let was = cache.is_cached(id);
                    match cache.insert(key.engine, h, id) {
                        Ok(Inserted::Inserted) => {
                            assert!(!was && cache.is_cached(id));
                            if nb > 0 {
                                let end = nb * 2;
                                // One page a (engine, hash): a second insert is a Duplicate.
                                assert!(
                                    !model.iter().any(|(e, s, t, _)| {
                                        *e == key.engine.0
                                            && *s == key.salt
                                            && t[..] == tokens[..end]
                                    }),
                                    "{tokens:?} inserted twice"
                                );
                                model.push((key.engine.0, key.salt, tokens[..end].to_vec(), id));
                            }
                        }
                        Ok(_) | Err(_) => assert_eq!(cache.is_cached(id), was),
                    }
                }
            }
            Op::InsertRaw {
                engine,
                bits,
                lo,
                hi,
            } => {
                let id = BlockId::from_bits(bits);
                if !refs.contains(&id) {
                    // Not a reference anyone holds (unless cached): refused, or at worst a
                    // no-op on a page the cache holds.
                    let r = cache.insert(EngineId(u16::from(engine)), BlockHash { lo, hi }, id);
                    assert!(
                        !matches!(r, Ok(Inserted::Inserted)),
                        "{id:?} inserted: {r:?}"
                    );
                    assert_eq!(pool.stats(), before);
                }
            }
            Op::Forget(i) if !refs.is_empty() => {
                let id = refs[i as usize % refs.len()];
                let was = cache.is_cached(id);
                assert_eq!(cache.forget(id), Ok(was));
                assert!(!cache.is_cached(id));
            }
            Op::ForgetRaw(bits) => {
                let id = BlockId::from_bits(bits);
                let _ = cache.forget(id);
            }
            Op::Evict(e, k) => {
                let _ = cache.evict(EngineId(u16::from(e)), u32::from(k));
            }
            Op::EvictBy(k, usage) => {
                let usage: Vec<EngineUsage> = usage
                    .into_iter()
                    .take(8)
                    .map(|(e, held, share, cached)| EngineUsage {
                        engine: EngineId(u16::from(e)),
                        held: u32::from(held),
                        share: u32::from(share),
                        cached: u32::from(cached),
                    })
                    .collect();
                assert!(cache.evict_by(&usage, u32::from(k), &mut MostOverShare) <= u32::from(k));
            }
            Op::AllocEvicting(e, k, shares) => {
                let shares: Vec<u32> = shares.into_iter().map(u32::from).collect();
                let usage = cache.usage(&shares);
                let mut out = Vec::new();
                match cache.alloc_evicting(
                    EngineId(u16::from(e)),
                    u32::from(k),
                    &mut out,
                    &usage,
                    &mut MostOverShare,
                ) {
                    Ok(()) => assert_eq!(out.len(), k as usize),
                    Err(_) => assert!(out.is_empty()),
                }
                refs.extend(out);
            }
            Op::Clear => {
                // Cached-free pages leave; the harness's pages stay cached.
                let free = cache.reclaimable(None);
                assert_eq!(cache.clear(), free);
                assert_eq!(cache.reclaimable(None), 0);
                // What stays cached is what the harness holds.
                let mut held: Vec<_> = refs.iter().filter(|id| cache.is_cached(**id)).collect();
                held.sort_unstable();
                held.dedup();
                assert_eq!(cache.cached_total() as usize, held.len());
            }
            Op::Purge(e) => {
                let e = EngineId(u16::from(e));
                let before = cache.cached(e);
                assert_eq!(cache.purge_engine(e), before);
                assert_eq!(cache.cached(e), 0);
                assert!(refs.iter().all(|id| !cache.is_cached(*id) || pool.owner(*id) != Ok(e)));
            }
            _ => {}
        }
        model.retain(|(_, _, _, id)| cache.is_cached(*id));
        // Every page's references: the harness's plus the cache's.
        let mut distinct = refs.clone();
        distinct.sort_unstable();
        distinct.dedup();
        for id in &distinct {
            let mine = refs.iter().filter(|x| *x == id).count() as u32;
            assert_eq!(
                pool.ref_count(*id),
                Ok(mine + u32::from(cache.is_cached(*id)))
            );
        }
        let cached_free = cache.reclaimable(None) as usize;
        assert_eq!(
            pool.free_count() as usize,
            n as usize - distinct.len() - cached_free
        );
    }
    pool.free_n(&refs).unwrap();
    drop(cache);
    assert_eq!(pool.free_count(), n, "leak");
});
