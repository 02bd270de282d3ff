//! Documented claims checked against the code: what a decode step allocates, and what the
//! prefix cache's counters count.

use pagedkv::block::{BlockPool, EngineId, PoolConfig};
use pagedkv::prefix::{PrefixCache, PrefixConfig};
use pagedkv::sched::{
    Batcher, BatcherConfig, FinishedSeq, PreemptionMode, Priority, SeqRequest, StepResults,
    StopRules,
};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Arc;

struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
    static BYTES: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards every call to the system allocator unchanged; the counter is a
// thread-local `Cell` with a const initialiser (no allocation, no reentrancy).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        let _ = BYTES.try_with(|c| c.set(c.get() + l.size() as u64));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        let _ = BYTES.try_with(|c| c.set(c.get() + n as u64));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(|c| c.get())
}

/// Bytes asked of the allocator on this thread so far.
fn bytes() -> u64 {
    BYTES.with(|c| c.get())
}

const BS: u32 = 16;

fn batcher(blocks: u32) -> Batcher {
    batcher_on(pool(blocks))
}

fn pool(blocks: u32) -> Arc<BlockPool> {
    Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: blocks,
            max_engines: 2,
        })
        .unwrap(),
    )
}

fn batcher_on(pool: Arc<BlockPool>) -> Batcher {
    batcher_with_tables(pool, 64)
}

fn batcher_with_tables(pool: Arc<BlockPool>, max_blocks_per_seq: u32) -> Batcher {
    Batcher::new(
        BatcherConfig {
            engine: EngineId(0),
            block_size: BS,
            max_running: 64,
            max_batched_tokens: 4096,
            max_prefill_chunk: 4096,
            max_blocks_per_seq,
            preemption: PreemptionMode::Recompute,
            swap_blocks: 0,
        },
        pool,
    )
    .unwrap()
}

fn req(id: u64, prompt_len: u32, max_new: u32) -> SeqRequest {
    SeqRequest {
        id,
        prompt: (0..prompt_len).collect(),
        stop: StopRules {
            max_new_tokens: max_new,
            ..Default::default()
        },
        priority: Priority::Throughput,
    }
}

/// A decode step of sequences whose prompt `Vec`s have room for their output allocates
/// nothing (`Batch`'s docs). The batch's buffers never do once grown, but a sequence's tokens
/// are its prompt `Vec`: with prompts of exactly their length, 200 decode steps of 8 sequences
/// allocated 40 times (the token lists doubling), which the docs used to deny ("a steady-state
/// step allocates nothing").
#[test]
fn a_decode_step_of_sequences_with_room_for_their_output_allocates_nothing() {
    let mut bt = batcher(512);
    for id in 0..8 {
        let mut r = req(id, 3, 1000);
        r.prompt.reserve_exact(1000);
        bt.add(r).unwrap();
    }
    let (mut fin, mut res) = (Vec::<FinishedSeq>::new(), StepResults::default());
    let sampled = [7u32; 8];
    let mut total = 0;
    for step in 0..204 {
        let before = allocs();
        res.clear();
        let n = bt.schedule_into(&mut fin).num_samples();
        bt.commit_with_updates(&sampled[..n], &mut fin, &mut res)
            .unwrap();
        if step >= 4 {
            total += allocs() - before;
        }
    }
    assert!(fin.is_empty());
    assert_eq!(total, 0, "decode steps allocated");
}

/// `PrefixMetrics` counts lookups, and a batcher repeats a waiting sequence's lookup on every
/// step its admission fails: `hit_tokens / lookup_tokens` is then not the prompt hit rate (the
/// docs said it was). Here a 40-token prompt with 32 cached tokens waits 5 steps for a page:
/// the lookups' rate is 192 / 224 (86%), the prompts' 32 / 73 (44%).
#[test]
fn prefix_metrics_count_every_lookup_and_batcher_stats_count_prompts() {
    let pool = pool(8);
    let mut bt = batcher_on(Arc::clone(&pool));
    let cache = Arc::new(PrefixCache::new(
        Arc::clone(&pool),
        PrefixConfig { seed: Some(5) },
    ));
    bt.attach_prefix_cache(Arc::clone(&cache)).unwrap();
    let (mut fin, sampled) = (Vec::<FinishedSeq>::new(), [9u32; 4]);
    let step = |bt: &mut Batcher, fin: &mut Vec<FinishedSeq>| {
        let n = bt.schedule_into(fin).num_samples();
        bt.commit(&sampled[..n], fin).unwrap();
    };
    // Sequence 1 caches its two full blocks (tokens 0..32) and ends.
    bt.add(req(1, 33, 1)).unwrap();
    step(&mut bt, &mut fin);
    assert_eq!(fin.len(), 1);
    // Another engine takes every free page: sequence 2 (its first 32 tokens cached) finds
    // them but no third page, and waits.
    let mut other = Vec::new();
    pool.alloc_n(EngineId(1), pool.free_count(), &mut other)
        .unwrap();
    bt.add(req(2, 40, 1)).unwrap();
    for _ in 0..5 {
        step(&mut bt, &mut fin);
    }
    assert_eq!(fin.len(), 1, "sequence 2 waits");
    pool.free_n(&other).unwrap();
    step(&mut bt, &mut fin);
    assert_eq!(fin.len(), 2, "sequence 2 ran");

    let m = cache.metrics(EngineId(0));
    // One lookup for sequence 1 (a miss), six for sequence 2 (five failed admissions).
    assert_eq!(m.lookups, 1 + 6);
    assert_eq!((m.hit_tokens, m.lookup_tokens), (6 * 32, 32 + 6 * 32));
    let s = bt.stats();
    assert_eq!((s.prefix_hit_tokens, s.prefix_prompt_tokens), (32, 33 + 40));
}

/// `max_blocks_per_seq` is a limit ("most blocks one sequence may hold"), not a size: every
/// request's block table was allocated at that capacity, 8 bytes a block, so a server that set
/// it high to mean "no limit" (u32::MAX: 32 GiB) had each request abort the process. A table
/// now holds what its request can reach at its longest.
#[test]
fn a_request_allocates_for_its_own_length_not_the_table_limit() {
    let mut bt = batcher_with_tables(pool(64), 1 << 24);
    let before = bytes();
    bt.add(req(1, 40, 24)).unwrap(); // 63 tokens: 4 blocks
    let added = bytes() - before;
    assert!(added < 4096, "adding one request allocated {added} bytes");
    // And it runs to its end within that table.
    let mut fin = Vec::new();
    while bt.has_work() {
        let n = bt.schedule_into(&mut fin).num_samples();
        bt.commit(&vec![7; n], &mut fin).unwrap();
    }
    assert_eq!(fin.len(), 1);
    assert_eq!(fin[0].output.len(), 24);
}

/// `FillScratch`'s claim (src/budget/waterfill.rs): "a round does not allocate once warm". An
/// activity change recomputed on warm scratch, with engines lifted from 0 tokens too (the
/// lift's heap), allocates nothing on the publishing thread.
#[test]
fn a_warm_budget_recompute_allocates_nothing() {
    use pagedkv::budget::{BudgetConfig, BudgetCoordinator};
    // 64 engines; weights 1000:1 so the light ones round to 0 tokens and are lifted.
    let c = BudgetCoordinator::new(BudgetConfig::new(64, 512, 4096)).unwrap();
    let ids: Vec<EngineId> = (0..64u32)
        .map(|i| c.register(if i % 8 == 0 { 1000 } else { 1 }).unwrap())
        .collect();
    for &e in &ids {
        c.set_active(e, true);
    }
    c.recompute();
    c.set_active(ids[1], false);
    c.recompute();
    c.set_active(ids[1], true);
    c.recompute();
    let before = allocs();
    for i in 0..100 {
        c.set_active(ids[1 + i % 7], i % 2 == 0);
        c.recompute();
    }
    assert_eq!(allocs() - before, 0, "a warm recompute allocated");
}
