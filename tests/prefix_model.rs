//! The prefix cache against a sequential model (proptest): random prefills (lookup, allocate,
//! insert), sequence drops, evictions by engine and by share, forgets and clears. After every
//! step the cache's hits, insert outcomes, cached sets and counts, and every page's reference
//! count match the model; at the end every page is free (no leak).

use std::collections::HashMap;
use std::sync::Arc;

use pagedkv::block::{BlockId, BlockPool, EngineId, PoolConfig};
use pagedkv::prefix::{BlockHash, Inserted, MostOverShare, PrefixCache, PrefixConfig, PrefixKey};
use proptest::prelude::*;

const PAGES: u32 = 12;
const ENGINES: u16 = 2;
const BT: u32 = 2;

#[derive(Debug, Clone)]
enum Op {
    /// A request of `engine` with `salt` and these tokens.
    Prefill(u16, u64, Vec<u32>),
    /// Drop live sequence `i % len`.
    Drop(usize),
    /// Evict up to `n` pages of `engine`.
    Evict(u16, u32),
    /// Evict up to `n` pages by share.
    EvictBy(u32, [u32; 2]),
    /// Forget block `j` of sequence `i`.
    Forget(usize, usize),
    /// Remove everything.
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..ENGINES, 0..2u64, prop::collection::vec(0..3u32, 0..9))
            .prop_map(|(e, s, t)| Op::Prefill(e, s, t)),
        2 => any::<usize>().prop_map(Op::Drop),
        1 => (0..ENGINES, 0..4u32).prop_map(|(e, n)| Op::Evict(e, n)),
        1 => (0..4u32, [0..12u32, 0..12u32]).prop_map(|(n, s)| Op::EvictBy(n, s)),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(i, j)| Op::Forget(i, j)),
        1 => Just(Op::Clear),
    ]
}

#[derive(Default)]
struct Model {
    /// (engine, hash) -> page: what the cache holds.
    cached: HashMap<(u16, BlockHash), BlockId>,
    /// Live sequences: the pages each holds a reference to.
    seqs: Vec<Vec<BlockId>>,
}

impl Model {
    fn is_cached(&self, id: BlockId) -> bool {
        self.cached.values().any(|&c| c == id)
    }
    fn seq_refs(&self, id: BlockId) -> u32 {
        self.seqs.iter().flatten().filter(|&&x| x == id).count() as u32
    }
    fn uncache(&mut self, id: BlockId) {
        self.cached.retain(|_, c| *c != id);
    }
    fn cached_free(&self, engine: Option<u16>) -> u32 {
        self.cached
            .iter()
            .filter(|((e, _), id)| engine.is_none_or(|x| x == *e) && self.seq_refs(**id) == 0)
            .count() as u32
    }
}

fn check(pool: &BlockPool, cache: &PrefixCache, m: &Model) {
    let mut live: Vec<BlockId> = m.seqs.iter().flatten().copied().collect();
    live.extend(m.cached.values().copied());
    live.sort_unstable();
    live.dedup();
    for &id in &live {
        let want = m.seq_refs(id) + u32::from(m.is_cached(id));
        assert_eq!(pool.ref_count(id), Ok(want), "{id:?}");
        assert_eq!(cache.is_cached(id), m.is_cached(id), "{id:?}");
    }
    assert_eq!(pool.free_count() as usize, PAGES as usize - live.len());
    for e in 0..ENGINES {
        let n = m.cached.keys().filter(|(x, _)| *x == e).count() as u32;
        assert_eq!(cache.cached(EngineId(e)), n);
        assert_eq!(cache.reclaimable(Some(EngineId(e))), m.cached_free(Some(e)));
    }
    for (&(e, h), &id) in &m.cached {
        assert!(cache.contains(EngineId(e), h), "{id:?}");
    }
}

/// Pages that left the cache during an eviction: the model drops them.
fn sync_evicted(cache: &PrefixCache, m: &mut Model) -> Vec<BlockId> {
    let gone: Vec<BlockId> = m
        .cached
        .values()
        .copied()
        .filter(|&id| !cache.is_cached(id))
        .collect();
    for &id in &gone {
        assert_eq!(m.seq_refs(id), 0, "{id:?} was evicted while in use");
        m.uncache(id);
    }
    gone
}

fn run(ops: Vec<Op>) {
    let pool = Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: PAGES,
            max_engines: ENGINES,
        })
        .unwrap(),
    );
    let cache = PrefixCache::new(pool.clone(), PrefixConfig { seed: Some(11) });
    let mut m = Model::default();
    for op in ops {
        match op {
            Op::Prefill(e, salt, tokens) => {
                let key = PrefixKey {
                    engine: EngineId(e),
                    adapter: 0,
                    salt,
                    block_tokens: BT,
                };
                let mut chain = Vec::new();
                cache.hasher().chain(&key, &tokens, &mut chain);
                let expect: Vec<BlockId> = chain
                    .iter()
                    .map_while(|h| m.cached.get(&(e, *h)).copied())
                    .collect();
                let mut ids = Vec::new();
                let hit = cache.lookup(&key, &tokens, &mut ids).unwrap();
                assert_eq!(ids, expect, "lookup");
                assert_eq!(hit.tokens, expect.len() * BT as usize);
                assert_eq!(hit.blocks, expect.len());
                // The parent of the next block, and the hit pages only the cache held.
                let root = cache.hasher().root(&key);
                assert_eq!(
                    hit.parent,
                    expect.len().checked_sub(1).map_or(root, |i| chain[i])
                );
                let revived = expect.iter().filter(|&&id| m.seq_refs(id) == 0).count();
                assert_eq!(hit.revived, revived, "revived");
                let need = (chain.len() - ids.len()) as u32;
                let mut fresh = Vec::new();
                let usage = cache.usage(&[6, 6]);
                let got =
                    cache.alloc_evicting(EngineId(e), need, &mut fresh, &usage, &mut MostOverShare);
                sync_evicted(&cache, &mut m);
                if got.is_err() {
                    assert!(fresh.is_empty());
                    pool.free_n(&ids).unwrap();
                    check(&pool, &cache, &m);
                    continue;
                }
                for (h, id) in chain[ids.len()..].iter().zip(&fresh) {
                    let r = cache.insert(EngineId(e), *h, *id).unwrap();
                    match m.cached.entry((e, *h)) {
                        std::collections::hash_map::Entry::Occupied(_) => {
                            assert_eq!(r, Inserted::Duplicate);
                        }
                        std::collections::hash_map::Entry::Vacant(v) => {
                            assert_eq!(r, Inserted::Inserted);
                            v.insert(*id);
                        }
                    }
                }
                ids.extend(fresh);
                m.seqs.push(ids);
            }
            Op::Drop(i) if !m.seqs.is_empty() => {
                let ids = m.seqs.swap_remove(i % m.seqs.len());
                pool.free_n(&ids).unwrap();
            }
            Op::Evict(e, n) => {
                let want = n.min(m.cached_free(Some(e)));
                assert_eq!(cache.evict(EngineId(e), n), Ok(want));
                assert_eq!(sync_evicted(&cache, &mut m).len() as u32, want);
            }
            Op::EvictBy(n, shares) => {
                let want = n.min(m.cached_free(None));
                let usage = cache.usage(&shares);
                assert_eq!(cache.evict_by(&usage, n, &mut MostOverShare), want);
                assert_eq!(sync_evicted(&cache, &mut m).len() as u32, want);
            }
            Op::Forget(i, j) if !m.seqs.is_empty() => {
                let seq = &m.seqs[i % m.seqs.len()];
                if seq.is_empty() {
                    continue;
                }
                let id = seq[j % seq.len()];
                assert_eq!(cache.forget(id), Ok(m.is_cached(id)));
                m.uncache(id);
            }
            Op::Clear => {
                // Only cached-free pages leave; pages in use stay cached.
                let want = m.cached_free(None);
                assert_eq!(cache.clear(), want);
                assert_eq!(sync_evicted(&cache, &mut m).len() as u32, want);
                assert_eq!(cache.reclaimable(None), 0);
            }
            _ => {}
        }
        check(&pool, &cache, &m);
    }
    for ids in m.seqs.drain(..) {
        pool.free_n(&ids).unwrap();
    }
    drop(cache);
    assert_eq!(pool.free_count(), PAGES, "leak");
    assert_eq!(pool.stats().held, vec![0; ENGINES as usize]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn matches_the_sequential_model(ops in prop::collection::vec(op(), 1..60)) {
        run(ops);
    }
}
