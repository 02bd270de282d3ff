//! Host swap memory is allocated only for swap preemption: under `PreemptionMode::Recompute`
//! no block is ever swapped out, so `EngineSetup::swap_blocks` (64 by default) must cost
//! nothing. Measured with a counting allocator that counts the calling thread's allocations
//! only: the test harness's own thread allocates while the test runs (CI once saw 3.7 KB of it
//! land inside one measurement), and the engine is built on the test's thread.

use pagedkv::gguf::Gguf;
use pagedkv::kv::page_bytes_for;
use pagedkv::sched::{PreemptionMode, Priority, SeqRequest, StopRules};
use pagedkv_candle_llama::fixture::TinyLlama;
use pagedkv_candle_llama::{build_engine, generate, EngineSetup, MatMulMode, PagedLlama};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    /// Bytes live from this thread's allocations (a const-initialised Cell: no destructor, no
    /// lazy allocation, so the allocator may touch it).
    static LIVE: Cell<isize> = const { Cell::new(0) };
}

/// Adds `delta` to this thread's count (ignored while the thread's locals are torn down).
fn count(delta: isize) {
    let _ = LIVE.try_with(|live| live.set(live.get() + delta));
}

fn live() -> isize {
    LIVE.with(Cell::get)
}

// SAFETY: every call is forwarded to the system allocator unchanged; the counter is only
// bookkeeping.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as isize);
        // SAFETY: the caller's contract is GlobalAlloc::alloc's, forwarded.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as isize);
        // SAFETY: as `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(-(layout.size() as isize));
        // SAFETY: `ptr` came from this allocator (System) with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size as isize - layout.size() as isize);
        // SAFETY: as `dealloc` and `alloc`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Bytes held by an engine built for `setup` (kept alive while measured).
fn engine_bytes(model: &PagedLlama, setup: &EngineSetup) -> isize {
    let before = live();
    let engine = build_engine(model.config(), setup).unwrap();
    let held = live() - before;
    drop(engine);
    held
}

#[test]
fn recompute_preemption_allocates_no_swap_space() {
    let bytes = TinyLlama::f32().write(9).unwrap();
    let mut model =
        PagedLlama::from_gguf(&Gguf::parse(&bytes).unwrap(), MatMulMode::Quantized).unwrap();
    let setup = |preemption, swap_blocks| EngineSetup {
        pages: 32,
        preemption,
        swap_blocks,
        ..EngineSetup::default()
    };
    let page = page_bytes_for(&[model.config().kv_shape()], 16).unwrap() as isize;
    let recompute_64 = engine_bytes(&model, &setup(PreemptionMode::Recompute, 64));
    let recompute_0 = engine_bytes(&model, &setup(PreemptionMode::Recompute, 0));
    let swap_64 = engine_bytes(&model, &setup(PreemptionMode::Swap, 64));
    eprintln!(
        "page {page} B; recompute with 64 swap blocks {recompute_64} B, with 0 {recompute_0} \
         B; swap with 64 {swap_64} B"
    );
    // Under recompute the swap setting changes nothing (less than a page of difference).
    assert!(
        (recompute_64 - recompute_0).abs() < page,
        "recompute preemption allocated {} bytes ({} pages) more for 64 swap blocks it never \
         uses",
        recompute_64 - recompute_0,
        (recompute_64 - recompute_0) / page
    );
    // Under swap the 64 pages are there; under recompute none is (the backend rounded an
    // empty swap space up to one page).
    assert!(
        swap_64 - recompute_0 >= 64 * page,
        "{swap_64} vs {recompute_0}: a swap page under recompute"
    );
    for preemption in [PreemptionMode::Recompute, PreemptionMode::Swap] {
        let mut engine = build_engine(model.config(), &setup(preemption, 64)).unwrap();
        let req = SeqRequest {
            id: 1,
            prompt: vec![1, 2, 3],
            stop: StopRules {
                max_new_tokens: 4,
                eos: vec![],
                stop_sequences: vec![],
            },
            priority: Priority::Throughput,
        };
        let out = generate(&mut engine, &mut model, [req], 100).unwrap();
        assert_eq!(out.outputs[&1].len(), 4);
    }
}
