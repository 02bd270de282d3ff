//! Eviction choices the broader prefix tests do not pin down: `MostOverShare`'s tie-breaks, the
//! figures `evict_by` updates between pages and its bound on what it takes per engine, the
//! CLOCK bit of a page in use, a request of exactly the pool's size, `clear_engine` and
//! `purge_engine`.

use std::sync::Arc;

use pagedkv::block::{BlockId, BlockPool, EngineId, PoolConfig};
use pagedkv::prefix::{
    EngineUsage, Inserted, MostOverShare, PrefixCache, PrefixConfig, PrefixKey, VictimChoice,
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

/// One cached one-block sequence of `engine` starting with token `first`; the caller holds
/// the page (one reference besides the cache's).
fn one_block(cache: &PrefixCache, engine: u16, first: u32) -> BlockId {
    let k = key(engine);
    let h = cache.hasher();
    let hash = h.block(h.root(&k), &[first, 1, 2, 3]);
    let id = cache.pool().alloc(EngineId(engine)).unwrap();
    assert_eq!(
        cache.insert(EngineId(engine), hash, id),
        Ok(Inserted::Inserted)
    );
    id
}

fn hit(cache: &PrefixCache, engine: u16, first: u32) -> Option<BlockId> {
    let mut got = Vec::new();
    cache
        .lookup(&key(engine), &[first, 1, 2, 3], &mut got)
        .unwrap();
    got.first().copied()
}

fn usage(engine: u16, held: u32, share: u32, cached: u32) -> EngineUsage {
    EngineUsage {
        engine: EngineId(engine),
        held,
        share,
        cached,
    }
}

/// Equally far over their shares: the engine with more cached pages loses first, then (a full
/// tie) the lower id, whatever the candidates' order.
#[test]
fn most_over_share_ties_go_to_more_cached_then_lower_id() {
    let mut c = MostOverShare;
    assert_eq!(
        c.pick(&[usage(0, 5, 1, 2), usage(1, 5, 1, 3)]),
        Some(EngineId(1))
    );
    assert_eq!(
        c.pick(&[usage(1, 6, 2, 3), usage(0, 5, 1, 3)]),
        Some(EngineId(0))
    );
    // Over the share beats more cached pages.
    assert_eq!(
        c.pick(&[usage(0, 5, 1, 1), usage(1, 5, 2, 4)]),
        Some(EngineId(0))
    );
    assert_eq!(c.pick(&[]), None);
}

/// `evict_by` lowers the victim's held pages after each page it takes, so the choice moves to
/// the other engine once the first is no longer the most over its share.
#[test]
fn evict_by_updates_the_victims_figures_between_pages() {
    let (pool, cache) = setup(16, 2);
    let mut ids = Vec::new();
    for (engine, n) in [(0u16, 6u32), (1, 5)] {
        for i in 0..n {
            ids.push(one_block(&cache, engine, i));
        }
    }
    pool.free_n(&ids).unwrap();
    let usage = cache.usage(&[0, 0]);
    assert_eq!(usage[0], self::usage(0, 6, 0, 6));
    assert_eq!(usage[1], self::usage(1, 5, 0, 5));
    // 6 vs 5: engine 0; 5 vs 5 (cached 5 each): engine 0, the lower id; 4 vs 5: engine 1.
    assert_eq!(cache.evict_by(&usage, 3, &mut MostOverShare), 3);
    assert_eq!(
        (cache.cached(EngineId(0)), cache.cached(EngineId(1))),
        (4, 4)
    );
}

/// A usage's `cached` is an upper bound on what eviction takes from the engine: once that
/// many pages are gone it is no longer a candidate, even if more were cached since the figures
/// were read.
#[test]
fn evict_by_takes_no_more_than_the_usage_says_is_cached() {
    let (pool, cache) = setup(8, 1);
    let ids: Vec<BlockId> = (0..3).map(|i| one_block(&cache, 0, i)).collect();
    pool.free_n(&ids).unwrap();
    let stale = [usage(0, 3, 0, 1)];
    assert_eq!(cache.evict_by(&stale, 3, &mut MostOverShare), 1);
    assert_eq!(cache.cached(EngineId(0)), 2);
}

/// The hand passes a page in use without clearing its reference bit: once released, it still
/// has its second chance, and an unreferenced page behind it goes first.
#[test]
fn a_page_in_use_keeps_its_reference_bit_through_a_sweep() {
    let (pool, cache) = setup(4, 1);
    let a = one_block(&cache, 0, 0);
    let x = one_block(&cache, 0, 1);
    let y = one_block(&cache, 0, 2);
    assert_eq!(
        (a.index(), x.index(), y.index()),
        (0, 1, 2),
        "pages not allocated in order"
    );
    pool.free_n(&[x, y]).unwrap();
    // a is in use; the sweeps clear x's and y's bits and take x; the hand stops at y.
    assert_eq!(cache.evict(EngineId(0), 1), Ok(1));
    assert!(!cache.is_cached(x) && cache.is_cached(y));
    // y referenced again, then a released: a still has the bit its insertion set.
    let h = hit(&cache, 0, 2).unwrap();
    assert_eq!(h, y);
    pool.free_n(&[h, a]).unwrap();
    // From y: clear y, clear a, take y.
    assert_eq!(cache.evict(EngineId(0), 1), Ok(1));
    assert!(
        cache.is_cached(a),
        "a page in use lost its reference bit to the hand"
    );
    assert!(!cache.is_cached(y));
}

/// A request of exactly the pool's size is not "more than the pool could ever give": with
/// every page cached-free, it evicts them all and succeeds.
#[test]
fn alloc_evicting_the_whole_pool() {
    let (pool, cache) = setup(4, 1);
    let ids: Vec<BlockId> = (0..4).map(|i| one_block(&cache, 0, i)).collect();
    pool.free_n(&ids).unwrap();
    let mut got = Vec::new();
    cache
        .alloc_evicting(
            EngineId(0),
            4,
            &mut got,
            &cache.usage(&[4]),
            &mut MostOverShare,
        )
        .unwrap();
    assert_eq!(got.len(), 4);
    assert_eq!(cache.cached_total(), 0);
    pool.free_n(&got).unwrap();
    assert_eq!(pool.free_count(), 4);
}

/// `clear_engine` uncaches only that engine's cached-free pages.
#[test]
fn clear_engine_leaves_other_engines_pages() {
    let (pool, cache) = setup(8, 2);
    let a: Vec<BlockId> = (0..2).map(|i| one_block(&cache, 0, i)).collect();
    let b: Vec<BlockId> = (0..3).map(|i| one_block(&cache, 1, i)).collect();
    pool.free_n(&a).unwrap();
    pool.free_n(&b).unwrap();
    assert_eq!(cache.clear_engine(EngineId(1)), 3);
    assert_eq!(
        (cache.cached(EngineId(0)), cache.cached(EngineId(1))),
        (2, 0)
    );
    assert!(a.iter().all(|&id| cache.is_cached(id)));
    assert_eq!(hit(&cache, 0, 1).map(|id| id.index()), Some(a[1].index()));
}

/// `purge_engine` uncaches every page of that engine, those a holder still holds too (for an
/// engine id whose engine left: another model may take it), and no other engine's; a held
/// page is freed when its holder lets go.
#[test]
fn purge_engine_takes_held_pages_too() {
    let (pool, cache) = setup(8, 2);
    let a: Vec<BlockId> = (0..2).map(|i| one_block(&cache, 0, i)).collect();
    let b: Vec<BlockId> = (0..3).map(|i| one_block(&cache, 1, i)).collect();
    // One of engine 1's pages stays held (a router's lookup, say); the others are cached-free.
    pool.free_n(&b[1..]).unwrap();
    assert_eq!(cache.purge_engine(EngineId(1)), 3);
    assert_eq!(
        (cache.cached(EngineId(0)), cache.cached(EngineId(1))),
        (2, 0)
    );
    assert!(!cache.is_cached(b[0]));
    assert_eq!(hit(&cache, 1, 0), None, "a held page is still found");
    assert_eq!(pool.ref_count(b[0]), Ok(1), "the holder's reference only");
    pool.release(b[0]).unwrap();
    assert!(a.iter().all(|&id| cache.is_cached(id)));
    assert_eq!(cache.purge_engine(EngineId(5)), 0, "an unknown engine");
    pool.free_n(&a).unwrap();
    assert_eq!(cache.clear(), 2);
    assert_eq!(pool.free_count(), 8);
}
