//! The prefix cache's behaviour, one property per test: reuse, isolation, eviction order and
//! shares, no stale hit, forget, typed refusals, events, metrics, no leak.

use std::sync::Arc;

use pagedkv::block::{BlockId, BlockPool, EngineId, PoolConfig};
use pagedkv::error::PoolError;
use pagedkv::prefix::{
    BlockHash, CacheEvent, EngineUsage, Inserted, MostOverShare, PrefixCache, PrefixConfig,
    PrefixError, PrefixKey,
};

const B: u32 = 4;

fn setup(pages: u32, engines: u16) -> (Arc<BlockPool>, PrefixCache) {
    let pool = Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: pages,
            max_engines: engines,
        })
        .unwrap(),
    );
    let cache = PrefixCache::new(pool.clone(), PrefixConfig { seed: Some(7) });
    (pool, cache)
}

fn key(engine: u16) -> PrefixKey {
    PrefixKey {
        engine: EngineId(engine),
        adapter: 0,
        salt: 0,
        block_tokens: B,
    }
}

/// Runs a sequence's prefill the way the batcher will: take the cached prefix, allocate the
/// rest of the full blocks, insert them. Returns the sequence's pages (one reference each).
fn prefill(cache: &PrefixCache, key: &PrefixKey, tokens: &[u32]) -> Vec<BlockId> {
    let mut ids = Vec::new();
    let hit = cache.lookup(key, tokens, &mut ids).unwrap();
    let mut parent = hit.parent;
    for block in tokens[hit.tokens..].chunks_exact(B as usize) {
        let id = cache.pool().alloc(key.engine).unwrap();
        parent = cache.hasher().block(parent, block);
        assert_eq!(cache.insert(key.engine, parent, id), Ok(Inserted::Inserted));
        ids.push(id);
    }
    ids
}

fn release(pool: &BlockPool, ids: &[BlockId]) {
    pool.free_n(ids).unwrap();
}

fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

#[test]
fn exact_reuse_of_full_blocks() {
    let (pool, cache) = setup(32, 1);
    let t = toks(0..42); // 10 full blocks and a partial one
    let first = prefill(&cache, &key(0), &t);
    assert_eq!(first.len(), 10);
    release(&pool, &first);
    // The cache keeps them: cached-free.
    assert_eq!(pool.free_count(), 22);
    assert_eq!(cache.reclaimable(None), 10);
    for id in &first {
        assert_eq!(pool.ref_count(*id), Ok(1));
    }

    let mut got = Vec::new();
    let hit = cache.lookup(&key(0), &t, &mut got).unwrap();
    assert_eq!((hit.blocks, hit.tokens), (10, 40));
    assert_eq!(got, first);
    for id in &got {
        assert_eq!(pool.ref_count(*id), Ok(2), "a hit takes a reference");
    }
    assert_eq!(
        cache.reclaimable(None),
        0,
        "pages in use are not cached-free"
    );
    // The parent continues the chain.
    let mut chain = Vec::new();
    cache.hasher().chain(&key(0), &t, &mut chain);
    assert_eq!(hit.parent, chain[9]);

    let mut shorter = Vec::new();
    let hit = cache.lookup(&key(0), &t[..39], &mut shorter).unwrap();
    assert_eq!(hit.blocks, 9);
    assert_eq!(shorter[..], first[..9]);

    let m = cache.metrics(EngineId(0));
    assert_eq!(m.lookups, 3);
    assert_eq!(m.lookup_tokens, 42 + 42 + 39);
    assert_eq!(m.hit_blocks, 19);
    assert_eq!(m.hit_tokens, 76);
    assert_eq!(m.inserts, 10);
    assert_eq!(m.cached, 10);
    release(&pool, &got);
    release(&pool, &shorter);
    drop(cache);
    assert_eq!(
        pool.free_count(),
        32,
        "dropping the cache gives every page back"
    );
}

/// `peek` says what a lookup would find (the blocks, and the pages only the cache holds) but
/// takes no reference and counts no lookup: a batcher estimates a waiting request's pages with
/// it every step.
#[test]
fn peek_finds_what_a_lookup_would_and_changes_nothing() {
    let (pool, cache) = setup(16, 1);
    let t = toks(0..18); // 4 full blocks and a partial one
    let first = prefill(&cache, &key(0), &t[..16]);
    release(&pool, &first[2..]); // 2 pages in use, 2 cached-free
    let before = cache.metrics(EngineId(0));
    let peeked = cache.peek(&key(0), &t).unwrap();
    assert_eq!((peeked.blocks, peeked.tokens, peeked.revived), (4, 16, 2));
    assert_eq!(
        cache.metrics(EngineId(0)),
        before,
        "a peek counted as a lookup"
    );
    for id in &first[..2] {
        assert_eq!(pool.ref_count(*id), Ok(2), "a peek took a reference");
    }
    assert_eq!(cache.reclaimable(None), 2);
    let mut got = Vec::new();
    assert_eq!(cache.lookup(&key(0), &t, &mut got).unwrap(), peeked);
    assert!(
        cache.peek(&key(5), &t).is_err(),
        "an engine the cache does not serve"
    );
    release(&pool, &got);
    release(&pool, &first[..2]);
}

#[test]
fn a_partial_block_is_never_matched() {
    let (pool, cache) = setup(8, 1);
    let ids = prefill(&cache, &key(0), &toks(0..3));
    assert!(ids.is_empty());
    assert_eq!(cache.cached_total(), 0);
    let mut got = Vec::new();
    assert_eq!(
        cache.lookup(&key(0), &toks(0..3), &mut got).unwrap().blocks,
        0
    );
    assert_eq!(pool.free_count(), 8);
}

#[test]
fn no_reuse_past_a_differing_token() {
    let (pool, cache) = setup(32, 1);
    let t = toks(0..40);
    let first = prefill(&cache, &key(0), &t);
    release(&pool, &first);
    for (pos, expect) in [(13usize, 3usize), (0, 0), (39, 9), (4, 1)] {
        let mut other = t.clone();
        other[pos] ^= 1;
        let mut got = Vec::new();
        let hit = cache.lookup(&key(0), &other, &mut got).unwrap();
        assert_eq!(hit.blocks, expect, "token {pos} changed");
        assert_eq!(got[..], first[..expect]);
        release(&pool, &got);
    }
    // Same tokens, shifted by one position: nothing matches.
    let mut got = Vec::new();
    assert_eq!(cache.lookup(&key(0), &t[1..], &mut got).unwrap().blocks, 0);
}

#[test]
fn salt_adapter_and_model_isolation() {
    let (pool, cache) = setup(32, 2);
    let t = toks(100..116);
    let first = prefill(&cache, &key(0), &t);
    release(&pool, &first);
    let variants = [
        PrefixKey { salt: 1, ..key(0) },
        PrefixKey {
            adapter: 9,
            ..key(0)
        },
        key(1),
        PrefixKey {
            block_tokens: 2 * B,
            ..key(0)
        },
    ];
    for k in variants {
        let mut got = Vec::new();
        assert_eq!(cache.lookup(&k, &t, &mut got).unwrap().blocks, 0, "{k:?}");
    }
    // The engine is checked exactly, not only through the hash: a hash computed under engine
    // 0's key finds nothing when asked for engine 1.
    let mut chain = Vec::new();
    cache.hasher().chain(&key(0), &t, &mut chain);
    assert!(cache.contains(EngineId(0), chain[0]));
    assert!(!cache.contains(EngineId(1), chain[0]));
    // Each engine caches its own copy.
    let other = prefill(&cache, &key(1), &t);
    assert_eq!(other.len(), 4);
    assert!(other.iter().all(|id| !first.contains(id)));
    release(&pool, &other);
    assert_eq!(cache.cached(EngineId(0)), 4);
    assert_eq!(cache.cached(EngineId(1)), 4);
}

/// One single-block sequence per first token, so each page is found on its own.
fn one_block(cache: &PrefixCache, first: u32) -> BlockId {
    let ids = prefill(cache, &key(0), &[first, 1, 2, 3]);
    assert_eq!(ids.len(), 1);
    ids[0]
}

fn hit(cache: &PrefixCache, first: u32) -> Option<BlockId> {
    let mut got = Vec::new();
    cache.lookup(&key(0), &[first, 1, 2, 3], &mut got).unwrap();
    got.first().copied()
}

#[test]
fn eviction_order_is_clock_with_second_chance() {
    let (pool, cache) = setup(8, 1);
    let pages: Vec<BlockId> = (0..4).map(|i| one_block(&cache, i)).collect();
    release(&pool, &pages);
    // Every insertion set its reference bit: the first sweep clears them all, the second takes
    // the first page.
    assert_eq!(cache.evict(EngineId(0), 1), Ok(1));
    assert!(!cache.is_cached(pages[0]));
    // A hit on page 2 gives it a second chance: the hand (at page 1) takes 1, passes 2, takes 3.
    let h = hit(&cache, 2).unwrap();
    assert_eq!(h, pages[2]);
    release(&pool, &[h]);
    assert_eq!(cache.evict(EngineId(0), 2), Ok(2));
    assert!(!cache.is_cached(pages[1]));
    assert!(cache.is_cached(pages[2]));
    assert!(!cache.is_cached(pages[3]));
    assert_eq!(pool.free_count(), 7);
    // A page in use is never evicted.
    let held = hit(&cache, 2).unwrap();
    assert_eq!(cache.evict(EngineId(0), 5), Ok(0));
    assert!(cache.is_cached(held));
    assert_eq!(cache.reclaimable(None), 0);
    release(&pool, &[held]);
    assert_eq!(cache.reclaimable(Some(EngineId(0))), 1);
    assert_eq!(cache.evict(EngineId(0), 5), Ok(1));
    assert_eq!(pool.free_count(), 8);
    assert_eq!(cache.metrics(EngineId(0)).evictions, 4);
}

/// An insertion gives its page a second chance like a hit does: a page cached after the hand
/// cleared the older pages' bits is passed once, and the older page ahead of it goes first.
#[test]
fn a_fresh_insertion_outlives_an_older_page_the_hand_already_passed() {
    let (pool, cache) = setup(8, 1);
    let x = one_block(&cache, 0);
    let y = pool.alloc(EngineId(0)).unwrap(); // in use, not cached yet
    let z = one_block(&cache, 2);
    assert!(
        x.index() < y.index() && y.index() < z.index(),
        "{x:?} {y:?} {z:?}"
    );
    release(&pool, &[x, z]);
    // The sweep clears x's and z's bits and takes x; the hand stops at y.
    assert_eq!(cache.evict(EngineId(0), 1), Ok(1));
    assert!(!cache.is_cached(x) && cache.is_cached(z));
    // y is cached now, after that sweep.
    let h = cache.hasher();
    let hash = h.block(h.root(&key(0)), &[5, 1, 2, 3]);
    assert_eq!(cache.insert(EngineId(0), hash, y), Ok(Inserted::Inserted));
    release(&pool, &[y]);
    assert_eq!(cache.evict(EngineId(0), 1), Ok(1));
    assert!(
        cache.is_cached(y),
        "the page just inserted was evicted first"
    );
    assert!(!cache.is_cached(z));
}

#[test]
fn no_stale_hit_after_eviction_and_reallocation() {
    let (pool, cache) = setup(1, 1);
    let old = one_block(&cache, 5);
    release(&pool, &[old]);
    assert_eq!(cache.evict(EngineId(0), 1), Ok(1));
    // The page is reallocated (new generation) and holds other tokens.
    let new = pool.alloc(EngineId(0)).unwrap();
    assert_eq!(new.index(), old.index());
    assert_ne!(new.generation(), old.generation());
    assert_eq!(
        hit(&cache, 5),
        None,
        "the evicted hash must not find the new page"
    );
    let h = cache
        .hasher()
        .block(cache.hasher().root(&key(0)), &[6, 1, 2, 3]);
    assert_eq!(cache.insert(EngineId(0), h, new), Ok(Inserted::Inserted));
    assert_eq!(hit(&cache, 5), None);
    let again = hit(&cache, 6).unwrap();
    assert_eq!(again, new);
    // The old id is refused everywhere.
    assert!(!cache.is_cached(old));
    assert!(matches!(
        cache.forget(old),
        Err(PrefixError::Pool(PoolError::StaleBlock { .. }))
    ));
    assert!(matches!(
        cache.insert(EngineId(0), h, old),
        Err(PrefixError::Pool(PoolError::StaleBlock { .. }))
    ));
    release(&pool, &[again, new]);
}

#[test]
fn forget_before_rewrite() {
    let (pool, cache) = setup(2, 1);
    let id = one_block(&cache, 1); // the sequence still holds it
    assert_eq!(pool.ref_count(id), Ok(2));
    let other = cache
        .hasher()
        .block(cache.hasher().root(&key(0)), &[9, 9, 9, 9]);
    assert_eq!(
        cache.insert(EngineId(0), other, id),
        Err(PrefixError::PageHoldsOtherHash { id })
    );
    assert_eq!(
        pool.ref_count(id),
        Ok(2),
        "a refused insert takes no reference"
    );
    assert_eq!(cache.forget(id), Ok(true));
    assert_eq!(cache.forget(id), Ok(false));
    assert_eq!(
        pool.is_shared(id),
        Ok(false),
        "the writer may now write in place"
    );
    assert_eq!(hit(&cache, 1), None);
    assert_eq!(cache.insert(EngineId(0), other, id), Ok(Inserted::Inserted));
    assert_eq!(cache.metrics(EngineId(0)).forgets, 1);
    release(&pool, &[id]);
    drop(cache);
    assert_eq!(pool.free_count(), 2);
}

#[test]
fn inserts_dedup_and_refuse_bad_input() {
    let (pool, cache) = setup(4, 2);
    let a = one_block(&cache, 1); // tokens [1, 1, 2, 3]
    let mut chain = Vec::new();
    cache.hasher().chain(&key(0), &[1, 1, 2, 3], &mut chain);
    // The same block computed again on another page: a duplicate, and no reference taken.
    let c = pool.alloc(EngineId(0)).unwrap();
    assert_eq!(
        cache.insert(EngineId(0), chain[0], c),
        Ok(Inserted::Duplicate)
    );
    assert_eq!(pool.ref_count(c), Ok(1));
    assert!(!cache.is_cached(c));
    // Reinserting the same page and hash (a fork completing the shared block) is a no-op.
    assert_eq!(
        cache.insert(EngineId(0), chain[0], a),
        Ok(Inserted::AlreadyCached)
    );
    assert_eq!(pool.ref_count(a), Ok(2));
    // Another engine may not claim a page cached for engine 0.
    assert_eq!(
        cache.insert(EngineId(1), chain[0], a),
        Err(PrefixError::PageOfOtherEngine {
            id: a,
            cached_for: EngineId(0),
            engine: EngineId(1)
        })
    );
    assert_eq!(pool.ref_count(a), Ok(2));
    // A page engine 0 allocated is not cached for engine 1 (its usage and its eviction would
    // count against the wrong engine's budget); nothing changes.
    let mut chain1 = Vec::new();
    cache.hasher().chain(&key(1), &[1, 1, 2, 3], &mut chain1);
    let (stats, cached) = (pool.stats(), cache.cached_total());
    assert_eq!(
        cache.insert(EngineId(1), chain1[0], c),
        Err(PrefixError::NotOwner {
            id: c,
            owner: EngineId(0),
            engine: EngineId(1)
        })
    );
    assert_eq!((pool.stats(), cache.cached_total()), (stats, cached));
    assert_eq!(pool.ref_count(c), Ok(1));
    assert!(!cache.is_cached(c));

    let before = (pool.stats(), cache.cached_total());
    assert_eq!(
        cache.insert(EngineId(9), chain[0], c),
        Err(PrefixError::UnknownEngine {
            engine: EngineId(9),
            max_engines: 2
        })
    );
    let foreign = BlockPool::new(PoolConfig {
        device: 1,
        num_blocks: 4,
        max_engines: 1,
    })
    .unwrap()
    .alloc(EngineId(0))
    .unwrap();
    assert!(matches!(
        cache.insert(EngineId(0), BlockHash::default(), foreign),
        Err(PrefixError::Pool(PoolError::ForeignBlock { .. }))
    ));
    let out_of_range = BlockId::from_bits((u64::from(pool.tag()) << 48) | 77);
    assert!(matches!(
        cache.insert(EngineId(0), BlockHash::default(), out_of_range),
        Err(PrefixError::Pool(PoolError::OutOfRange { .. }))
    ));
    assert!(matches!(
        cache.forget(out_of_range),
        Err(PrefixError::Pool(PoolError::OutOfRange { .. }))
    ));
    let mut got = Vec::new();
    assert_eq!(
        cache.lookup(
            &PrefixKey {
                block_tokens: 0,
                ..key(0)
            },
            &[1, 2],
            &mut got
        ),
        Err(PrefixError::ZeroBlockTokens)
    );
    assert!(cache.lookup(&key(5), &[1, 2], &mut got).is_err());
    assert_eq!(cache.evict(EngineId(5), 1).ok(), None);
    assert_eq!((pool.stats(), cache.cached_total()), before);
    release(&pool, &[a, c]);
}

#[test]
fn eviction_takes_from_the_engine_most_over_its_share() {
    let (pool, cache) = setup(16, 2);
    let mut keep = Vec::new();
    // Engine 0 caches 6 pages, engine 1 caches 4; both cached-free.
    for (engine, n) in [(0u16, 6u32), (1, 4)] {
        for i in 0..n {
            let ids = prefill(&cache, &key(engine), &[i, 0, 0, 0]);
            keep.extend(ids);
        }
    }
    release(&pool, &keep);
    // Shares 4 and 12: engine 0 holds 6 (2 over), engine 1 holds 4 (8 under).
    let usage = cache.usage(&[4, 12]);
    assert_eq!(
        usage[0],
        EngineUsage {
            engine: EngineId(0),
            held: 6,
            share: 4,
            cached: 6
        }
    );
    assert_eq!(cache.evict_by(&usage, 3, &mut MostOverShare), 3);
    // Engine 0 loses pages down to its share first (6 -> 4); at (4 - 4 = 0, 4 - 12 = -8)
    // it is still the most over, and loses the third too.
    assert_eq!(cache.cached(EngineId(0)), 3);
    assert_eq!(cache.cached(EngineId(1)), 4);

    // An idle engine's cache is reclaimable by another engine: engine 1 needs more pages
    // than are free, although engine 0 is under its share now.
    let usage = cache.usage(&[8, 8]);
    let mut got = Vec::new();
    let free = pool.free_count();
    assert_eq!(free, 9);
    let mut prefer_engine0 = |c: &[EngineUsage]| {
        c.iter()
            .find(|u| u.engine == EngineId(0))
            .or(c.first())
            .map(|u| u.engine)
    };
    cache
        .alloc_evicting(EngineId(1), 11, &mut got, &usage, &mut prefer_engine0)
        .unwrap();
    assert_eq!(got.len(), 11);
    assert_eq!(cache.cached(EngineId(0)), 1);
    assert_eq!(pool.held(EngineId(1)), 4 + 11);
    // More than the pool has: refused before evicting anything.
    let mut more = Vec::new();
    let r = cache.alloc_evicting(
        EngineId(1),
        17,
        &mut more,
        &cache.usage(&[]),
        &mut MostOverShare,
    );
    assert!(matches!(
        r,
        Err(PrefixError::Pool(PoolError::OutOfBlocks { .. }))
    ));
    assert_eq!(cache.cached_total(), 5);
    // Not enough even with every cached page gone: the pool's refusal, nothing allocated.
    let mut more = Vec::new();
    let r = cache.alloc_evicting(
        EngineId(1),
        10,
        &mut more,
        &cache.usage(&[]),
        &mut MostOverShare,
    );
    assert!(matches!(
        r,
        Err(PrefixError::Pool(PoolError::OutOfBlocks { .. }))
    ));
    assert!(more.is_empty());
    assert_eq!(
        cache.cached_total(),
        0,
        "the shortfall evicted everything it could"
    );
    release(&pool, &got);
    assert_eq!(pool.free_count(), 16);
}

#[test]
fn events_are_bounded_and_never_block() {
    let (pool, cache) = setup(8, 1);
    let (tx, rx) = std::sync::mpsc::sync_channel(2);
    let cache = cache.with_events(Box::new(tx));
    let ids = prefill(&cache, &key(0), &toks(0..12)); // three stores, the channel holds two
    assert_eq!(cache.events_dropped(), 1);
    let got: Vec<CacheEvent> = rx.try_iter().collect();
    assert_eq!(got.len(), 2);
    let mut chain = Vec::new();
    cache.hasher().chain(&key(0), &toks(0..12), &mut chain);
    assert_eq!(
        got[0],
        CacheEvent::Stored {
            engine: EngineId(0),
            hash: chain[0],
            page: ids[0]
        }
    );
    release(&pool, &ids);
    assert_eq!(cache.clear(), 3);
    let removed: Vec<CacheEvent> = rx.try_iter().collect();
    assert_eq!(removed.len(), 2);
    assert!(matches!(removed[0], CacheEvent::Removed { .. }));
    drop(rx);
    assert_eq!(pool.free_count(), 8);
}

/// `clear` removes the pages no one else holds and leaves pages in use cached (their engines'
/// budgets count the cache's reference), so a later clear takes them once released.
#[test]
fn clear_leaves_pages_in_use_cached() {
    let (pool, cache) = setup(8, 1);
    let ids = prefill(&cache, &key(0), &toks(0..12));
    release(&pool, &ids[..1]); // the first page cached-free, the others in use
    assert_eq!(cache.clear(), 1);
    assert!(!cache.is_cached(ids[0]));
    assert!(ids[1..].iter().all(|&id| cache.is_cached(id)));
    assert_eq!(cache.metrics(EngineId(0)).evictions, 1);
    release(&pool, &ids[1..]);
    assert_eq!(cache.clear(), 2);
    assert_eq!(cache.cached_total(), 0);
    assert_eq!(pool.free_count(), 8);
}

/// A hit counts as revived the pages only the cache held when it took them.
#[test]
fn lookup_counts_revived_pages() {
    let (pool, cache) = setup(8, 1);
    let ids = prefill(&cache, &key(0), &toks(0..12));
    release(&pool, &ids[..2]); // two cached-free, the third still held
    let mut got = Vec::new();
    let hit = cache.lookup(&key(0), &toks(0..12), &mut got).unwrap();
    assert_eq!((hit.blocks, hit.revived), (3, 2));
    release(&pool, &got);
    release(&pool, &ids[2..]);
    assert_eq!(cache.clear(), 3);
    assert_eq!(pool.free_count(), 8);
}

/// A partial last block is never matched, even when a page is cached under that partial
/// block's hash (a caller that hashed one): lookup and peek walk full blocks only.
#[test]
fn a_partial_block_is_not_matched_even_when_its_hash_is_cached() {
    let (pool, cache) = setup(8, 1);
    let root = cache.hasher().root(&key(0));
    let partial = cache.hasher().block(root, &[1, 2, 3]);
    let id = pool.alloc(EngineId(0)).unwrap();
    assert_eq!(
        cache.insert(EngineId(0), partial, id),
        Ok(Inserted::Inserted)
    );
    let mut got = Vec::new();
    let hit = cache.lookup(&key(0), &[1, 2, 3], &mut got).unwrap();
    assert_eq!(
        (hit.blocks, got.len()),
        (0, 0),
        "a partial block was matched"
    );
    assert_eq!(cache.peek(&key(0), &[1, 2, 3]).unwrap().blocks, 0);
    release(&pool, &[id]);
}

/// The seed is the hasher's secret: caches built with one seed name blocks alike (a router
/// predicting hits), another seed or a drawn one names them differently.
#[test]
fn the_seed_decides_the_hashes() {
    let (pool, a) = setup(4, 1);
    let with = |seed| PrefixCache::new(pool.clone(), PrefixConfig { seed });
    let chain = |cache: &PrefixCache| {
        let mut out = Vec::new();
        cache.hasher().chain(&key(0), &toks(0..8), &mut out);
        out
    };
    assert_eq!(chain(&a), chain(&with(Some(7))), "one seed, one naming");
    for other in [with(Some(8)), with(None), with(None)] {
        let (x, y) = (chain(&a), chain(&other));
        assert!(x.iter().zip(&y).all(|(x, y)| x != y), "{x:?} vs {y:?}");
    }
    assert_ne!(chain(&with(None)), chain(&with(None)), "drawn seeds differ");
}

/// Models never share a page even under a hash collision: a page cached for engine 0 under the
/// very hash engine 1's lookup computes is not handed to engine 1 (the engine is checked on
/// every hit), and engine 1 caches its own page under that hash.
#[test]
fn a_hit_checks_the_engine_not_only_the_hash() {
    let (pool, cache) = setup(8, 2);
    let t = [1, 2, 3, 4];
    let mut chain1 = Vec::new();
    cache.hasher().chain(&key(1), &t, &mut chain1);
    let of0 = pool.alloc(EngineId(0)).unwrap();
    assert_eq!(
        cache.insert(EngineId(0), chain1[0], of0),
        Ok(Inserted::Inserted)
    );
    let mut got = Vec::new();
    let hit = cache.lookup(&key(1), &t, &mut got).unwrap();
    assert_eq!(
        (hit.blocks, got.len()),
        (0, 0),
        "engine 0's page served to engine 1"
    );
    assert_eq!(cache.peek(&key(1), &t).unwrap().blocks, 0);
    assert!(!cache.contains(EngineId(1), chain1[0]));
    let of1 = pool.alloc(EngineId(1)).unwrap();
    assert_eq!(
        cache.insert(EngineId(1), chain1[0], of1),
        Ok(Inserted::Inserted)
    );
    assert_eq!(cache.lookup(&key(1), &t, &mut got).unwrap().blocks, 1);
    assert_eq!(got, [of1]);
    release(&pool, &[of0, of1, of1]);
}

/// The slot's tag is only a filter: a page cached under a hash that shares the looked-up hash's
/// home slot and tag but differs in the other bits is not a hit (all 128 bits are compared).
#[test]
fn a_tag_collision_is_not_a_hit() {
    let (pool, cache) = setup(8, 1);
    let t = [1, 2, 3, 4];
    let mut chain = Vec::new();
    cache.hasher().chain(&key(0), &t, &mut chain);
    // Same low lane (home slot), same high bits (tag); the lowest bit of the high lane differs.
    let twin = BlockHash {
        lo: chain[0].lo,
        hi: chain[0].hi ^ 1,
    };
    let id = pool.alloc(EngineId(0)).unwrap();
    assert_eq!(cache.insert(EngineId(0), twin, id), Ok(Inserted::Inserted));
    let mut got = Vec::new();
    let hit = cache.lookup(&key(0), &t, &mut got).unwrap();
    assert_eq!((hit.blocks, got.len()), (0, 0), "a tag collision was a hit");
    assert_eq!(cache.peek(&key(0), &t).unwrap().blocks, 0);
    assert!(!cache.contains(EngineId(0), chain[0]));
    let real = pool.alloc(EngineId(0)).unwrap();
    assert_eq!(
        cache.insert(EngineId(0), chain[0], real),
        Ok(Inserted::Inserted)
    );
    cache.lookup(&key(0), &t, &mut got).unwrap();
    assert_eq!(got, [real]);
    release(&pool, &[id, real, real]);
}

/// A forget is reported like an eviction: a router's mirror must drop the page before its
/// holder rewrites it with other tokens.
#[test]
fn forget_emits_a_removed_event() {
    let (pool, cache) = setup(4, 1);
    let (tx, rx) = std::sync::mpsc::sync_channel(8);
    let cache = cache.with_events(Box::new(tx));
    let ids = prefill(&cache, &key(0), &[1, 2, 3, 4]);
    let mut chain = Vec::new();
    cache.hasher().chain(&key(0), &[1, 2, 3, 4], &mut chain);
    assert_eq!(cache.forget(ids[0]), Ok(true));
    let (engine, hash, page) = (EngineId(0), chain[0], ids[0]);
    let got: Vec<CacheEvent> = rx.try_iter().collect();
    assert_eq!(
        got,
        [
            CacheEvent::Stored { engine, hash, page },
            CacheEvent::Removed { engine, hash, page }
        ]
    );
    release(&pool, &ids);
}
