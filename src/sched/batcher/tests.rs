//! Unit tests of the batcher's private storage.

use super::*;
use crate::block::PoolConfig;
use crate::sched::{PreemptionMode, Priority, SeqRequest, StopRules};

/// A pool of `num_blocks` blocks for one engine.
fn one_engine_pool(num_blocks: u32) -> Arc<BlockPool> {
    Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks,
            max_engines: 1,
        })
        .unwrap(),
    )
}

/// Sequences made by `fork` reuse free storage slots as `add`'s do: a server doing parallel
/// sampling for ever keeps storage bounded by the sequences alive at once (before, every
/// fork pushed a new slot: 1000 rounds of one request and 3 forks left 3001 slots).
#[test]
fn forked_sequences_reuse_free_slots() {
    let pool = one_engine_pool(64);
    let cfg = BatcherConfig {
        engine: EngineId(0),
        block_size: 4,
        max_running: 8,
        max_batched_tokens: 256,
        max_prefill_chunk: 256,
        max_blocks_per_seq: 16,
        preemption: PreemptionMode::Recompute,
        swap_blocks: 0,
    };
    let mut bt = Batcher::new(cfg, pool.clone()).unwrap();
    let mut fin = Vec::new();
    for round in 0..1000u64 {
        let id = 4 * round;
        bt.add(SeqRequest {
            id,
            prompt: vec![1, 2, 3],
            stop: StopRules {
                max_new_tokens: 3,
                ..Default::default()
            },
            priority: Priority::Throughput,
        })
        .unwrap();
        let mut forked = false;
        while bt.has_work() {
            let n = bt.schedule_into(&mut fin).num_samples();
            bt.commit(&vec![7; n], &mut fin).unwrap();
            if !forked && bt.index.contains_key(&id) {
                for child in 1..4 {
                    bt.fork(id, id + child).unwrap();
                }
                forked = true;
            }
        }
        assert!(forked);
    }
    assert_eq!(fin.len(), 4000);
    assert!(
        bt.seqs.len() <= 8,
        "{} slots for at most 4 live sequences",
        bt.seqs.len()
    );
    assert_eq!(pool.free_count(), 64);
}

/// A budget that grants every block and reports fixed figures for the other engines.
struct Figures {
    quotas: Vec<u32>,
    /// Blocks held by each engine's budget; this batcher's own entry is kept by its calls.
    held: std::sync::Mutex<Vec<u32>>,
    me: usize,
}

impl EngineBudget for Figures {
    fn token_budget(&self) -> u32 {
        u32::MAX
    }
    fn try_acquire_blocks(&self, n: u32) -> bool {
        self.held.lock().unwrap()[self.me] += n;
        true
    }
    fn release_blocks(&self, n: u32) {
        self.held.lock().unwrap()[self.me] -= n;
    }
    fn set_active(&self, _: bool) {}
    fn block_quotas(&self) -> Vec<u32> {
        self.quotas.clone()
    }
    fn blocks_held(&self) -> Vec<u32> {
        self.held.lock().unwrap().clone()
    }
}

/// On a dry pool, eviction first tries the engines that may have cached-free pages: engine 0
/// is the most over its share, but every page cached for it is in use (the completed blocks
/// of its running sequences), so a sweep of it finds nothing after reading every page's record
/// twice. It was tried first on every allocation the pool refused (33 ms for one page on a
/// pool of 2^19 pages), before engine 1's cached-free pages.
#[test]
fn eviction_skips_an_engine_whose_cached_pages_are_all_in_use() {
    use crate::prefix::{Inserted, PrefixCache, PrefixConfig, PrefixKey};
    let pages = 1024u32;
    let pool = Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: pages,
            max_engines: 3,
        })
        .unwrap(),
    );
    let cache = Arc::new(PrefixCache::new(
        pool.clone(),
        PrefixConfig { seed: Some(1) },
    ));
    let cache_pages = |engine: u16, n: u32, keep: &mut Vec<BlockId>| {
        let e = EngineId(engine);
        let key = PrefixKey {
            engine: e,
            adapter: 0,
            salt: 0,
            block_tokens: 1,
        };
        for i in 0..n {
            let id = pool.alloc(e).unwrap();
            let h = cache.hasher().block(cache.hasher().root(&key), &[i]);
            assert_eq!(cache.insert(e, h, id), Ok(Inserted::Inserted));
            keep.push(id);
        }
    };
    // Engine 0: 900 cached pages, all held by its sequences (here, the test).
    let mut busy = Vec::new();
    cache_pages(0, 900, &mut busy);
    // Engine 1: 64 cached-free pages.
    let mut idle = Vec::new();
    cache_pages(1, 64, &mut idle);
    pool.free_n(&idle).unwrap();
    // The rest of the pool is taken (uncached).
    let mut rest = Vec::new();
    pool.alloc_n(EngineId(1), pool.free_count(), &mut rest)
        .unwrap();
    let cfg = BatcherConfig {
        engine: EngineId(2),
        block_size: 4,
        max_running: 8,
        max_batched_tokens: 256,
        max_prefill_chunk: 256,
        max_blocks_per_seq: 16,
        preemption: PreemptionMode::Recompute,
        swap_blocks: 0,
    };
    let mut bt = Batcher::new(cfg, pool.clone()).unwrap();
    bt.attach_budget(Box::new(Figures {
        quotas: vec![100, 100, 100],
        held: std::sync::Mutex::new(vec![900, rest.len() as u32, 0]),
        me: 2,
    }));
    bt.attach_prefix_cache(cache.clone()).unwrap();
    bt.add(SeqRequest {
        id: 1,
        prompt: vec![1, 2, 3, 4],
        stop: StopRules {
            max_new_tokens: 1,
            ..Default::default()
        },
        priority: Priority::Throughput,
    })
    .unwrap();
    let mut fin = Vec::new();
    assert_eq!(bt.schedule_into(&mut fin).num_tokens(), 4);
    assert_eq!(cache.cached(EngineId(1)), 63, "engine 1 gave a page");
    assert_eq!(
        cache.clock_hand(EngineId(0)),
        0,
        "engine 0's pages, all in use, were swept"
    );
    bt.commit(&[9], &mut fin).unwrap();
    drop(bt);
    pool.free_n(&busy).unwrap();
    pool.free_n(&rest).unwrap();
    cache.clear();
    assert_eq!(pool.free_count(), pages);
}

/// A budget whose pages are lent out while `short` is set: it refuses every block then, and
/// says the refusal is pages lent out (they fit the engine's limit, not the pool).
struct LentOut {
    short: Arc<std::sync::atomic::AtomicBool>,
}

impl EngineBudget for LentOut {
    fn token_budget(&self) -> u32 {
        u32::MAX
    }
    fn try_acquire_blocks(&self, _: u32) -> bool {
        !self.short.load(std::sync::atomic::Ordering::Relaxed)
    }
    fn release_blocks(&self, _: u32) {}
    fn set_active(&self, _: bool) {}
    fn pages_lent_out(&self, _: u32) -> bool {
        self.short.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The bound on waiting for lent pages counts steps in a row: two waits, a step that got its
/// pages, then three more waits preempt nothing (five waits in all; without the reset, the
/// fourth preempted).
#[test]
fn the_lent_page_wait_bound_counts_steps_in_a_row() {
    let pool = one_engine_pool(64);
    // One token a page: every decode row needs a page.
    let cfg = BatcherConfig {
        engine: EngineId(0),
        block_size: 1,
        max_running: 8,
        max_batched_tokens: 256,
        max_prefill_chunk: 256,
        max_blocks_per_seq: 64,
        preemption: PreemptionMode::Recompute,
        swap_blocks: 0,
    };
    let short = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut bt = Batcher::new(cfg, pool).unwrap();
    bt.attach_budget(Box::new(LentOut {
        short: short.clone(),
    }));
    let mut fin = Vec::new();
    for id in 0..2 {
        bt.add(SeqRequest {
            id,
            prompt: vec![1, 2],
            stop: StopRules {
                max_new_tokens: 40,
                ..Default::default()
            },
            priority: Priority::Throughput,
        })
        .unwrap();
    }
    let mut step = |lent_out: bool| {
        short.store(lent_out, std::sync::atomic::Ordering::Relaxed);
        let n = bt.schedule_into(&mut fin).num_samples();
        bt.commit(&vec![7; n], &mut fin).unwrap();
        let s = bt.stats();
        s.preempted_recompute + s.preempted_swap
    };
    assert_eq!(step(false), 0);
    for lent_out in [true, true, false, true, true, true] {
        assert_eq!(
            step(lent_out),
            0,
            "a wait before a step that got its pages counted"
        );
    }
}

/// A budget that grants at most `cap` blocks and keeps the last block demand reported.
struct CappedBlocks {
    cap: u32,
    held: std::sync::atomic::AtomicU32,
    growth: Arc<std::sync::atomic::AtomicU32>,
}

impl EngineBudget for CappedBlocks {
    fn token_budget(&self) -> u32 {
        u32::MAX
    }
    fn try_acquire_blocks(&self, n: u32) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        self.held
            .fetch_update(Relaxed, Relaxed, |h| {
                h.checked_add(n).filter(|&t| t <= self.cap)
            })
            .is_ok()
    }
    fn release_blocks(&self, n: u32) {
        self.held.fetch_sub(n, std::sync::atomic::Ordering::Relaxed);
    }
    fn set_active(&self, _: bool) {}
    fn record_block_demand(&self, growth: u32) {
        self.growth
            .store(growth, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A swapped-out sequence keeps its running slot in the block demand: with two slots, one
/// running and one swapped out, a request that arrives waits for a slot and adds nothing
/// (counting only the running sequences as taking slots, its first 132 pages were asked
/// for while it could not run).
#[test]
fn a_swapped_sequence_keeps_its_slot_out_of_the_block_demand() {
    let pool = one_engine_pool(256);
    // One token a page; 12 pages for the engine: two growing sequences swap one out.
    let cfg = BatcherConfig {
        engine: EngineId(0),
        block_size: 1,
        max_running: 2,
        max_batched_tokens: 256,
        max_prefill_chunk: 256,
        max_blocks_per_seq: 256,
        preemption: PreemptionMode::Swap,
        swap_blocks: 64,
    };
    let growth = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let mut bt = Batcher::new(cfg, pool).unwrap();
    bt.attach_budget(Box::new(CappedBlocks {
        cap: 12,
        held: Default::default(),
        growth: growth.clone(),
    }));
    let request = |id| SeqRequest {
        id,
        prompt: vec![1, 2, 3, 4],
        stop: StopRules {
            max_new_tokens: 200,
            ..Default::default()
        },
        priority: Priority::Throughput,
    };
    bt.add(request(0)).unwrap();
    bt.add(request(1)).unwrap();
    let mut fin = Vec::new();
    let mut step = |bt: &mut Batcher| {
        let n = bt.schedule_into(&mut fin).num_samples();
        bt.commit(&vec![7; n], &mut fin).unwrap();
        growth.load(std::sync::atomic::Ordering::Relaxed)
    };
    let mut steps = 0;
    while bt.stats().preempted_swap == 0 {
        step(&mut bt);
        steps += 1;
        assert!(steps < 20, "no sequence was swapped out");
    }
    let before = step(&mut bt);
    assert_eq!((bt.running.len(), bt.swapped.len()), (1, 1));
    bt.add(request(2)).unwrap();
    let after = step(&mut bt);
    assert_eq!((bt.running.len(), bt.swapped.len()), (1, 1));
    assert_eq!(
        after, before,
        "a request with no free running slot changed the block demand"
    );
}
