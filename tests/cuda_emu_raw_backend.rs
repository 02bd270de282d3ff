//! The raw-pointer backend's refusals (feature `cuda-emu`): calls in an order or shape the
//! executor never makes, through the public trait, must be refused instead of launching a
//! kernel past its buffers or over metadata that was never uploaded.
#![cfg(all(feature = "cuda-emu", not(feature = "cuda")))]

use pagedkv::cuda_emu::{EmuBuf, EmuDevice};
use pagedkv::cuda_raw::Rows;
use pagedkv::engine::{DeviceRows, KvBackend, RawBackend, RawCaps};
use pagedkv::kv::{KvCacheConfig, KvDtype};
use pagedkv::sched::Batch;

const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const D: usize = 64;
const BS: usize = 16;
const BLOCKS: usize = 8;

fn config() -> KvCacheConfig {
    KvCacheConfig::new(1, KV_HEADS, D, BS, BLOCKS, KvDtype::F32).unwrap()
}

/// A backend with room for 4 sequences but 1 token per step (its output buffer: 1 row).
fn backend(arena: &EmuBuf) -> RawBackend<EmuDevice> {
    backend_with(arena, 4, 1)
}

/// A backend over `arena` with room for `max_seqs` sequences (one token row, one block each)
/// and `swap_pages` host swap pages.
fn backend_with(arena: &EmuBuf, max_seqs: usize, swap_pages: usize) -> RawBackend<EmuDevice> {
    let cfg = config();
    assert!(arena.len() >= cfg.total_bytes());
    let caps = RawCaps {
        max_seqs,
        max_tokens: 1,
        max_blocks_per_seq: 1,
        max_copies: 0,
    };
    // SAFETY: emulated device memory is host memory; `arena` holds the cache's pages and
    // outlives the backend; the batches below name pages nothing else uses, and the rows
    // handed to the backend are emulated buffers alive across each call.
    unsafe {
        RawBackend::new(
            EmuDevice::new(8),
            arena.ptr() as u64,
            &cfg,
            HEADS,
            caps,
            swap_pages,
        )
    }
    .unwrap()
}

/// Three sequences over one token row (empty rows pass the batch checks): decode would read
/// three query rows and write three output rows of one-row buffers (the emulation's illegal
/// address). The host backend refuses it; so must this one.
#[test]
fn decode_refuses_a_step_with_more_sequences_than_tokens() {
    let arena = EmuBuf::zeroed(config().total_bytes()).unwrap();
    let mut b = backend(&arena);
    let batch = Batch {
        seq_ids: vec![1, 2, 3],
        input_tokens: vec![7],
        positions: vec![0],
        query_start_loc: vec![0, 1, 1, 1],
        context_lens: vec![1, 1, 1],
        slot_mapping: vec![0],
        block_tables: vec![0, 1, 2],
        max_blocks_per_seq: 1,
        ..Batch::default()
    };
    b.begin(&batch).unwrap();
    let q = EmuBuf::zeroed(HEADS * D * 4).unwrap();
    let query = DeviceRows {
        rows: Rows::dense(q.ptr() as u64, HEADS, D),
        tokens: 1,
    };
    assert!(
        b.decode(0, &query, &batch).is_err(),
        "decode of 3 sequences over 1 row ran"
    );
    b.end().unwrap();
}

/// Copy pairs past the capacity after `begin` grow the device buffers: the step's uploaded
/// slot mapping stayed in the old block, and the cache write used to read the new, never
/// filled one (its K/V landed in page 0, which the batch does not name). Now refused until
/// the next `begin`.
#[test]
fn a_buffer_growth_after_begin_ends_the_step() {
    let cfg = config();
    let mut arena = EmuBuf::zeroed(cfg.total_bytes()).unwrap();
    let mut b = backend(&arena);
    let batch = Batch {
        seq_ids: vec![1],
        input_tokens: vec![7],
        positions: vec![2],
        query_start_loc: vec![0, 1],
        context_lens: vec![3],
        slot_mapping: vec![(3 * BS + 2) as i64],
        block_tables: vec![3],
        max_blocks_per_seq: 1,
        ..Batch::default()
    };
    b.begin(&batch).unwrap();
    b.copy_blocks(&[(5, 6)]).unwrap(); // max_copies 0: the buffers grow
    let k = EmuBuf::from_slice(&vec![1.0f32; KV_HEADS * D]).unwrap();
    let rows = DeviceRows {
        rows: Rows::dense(k.ptr() as u64, KV_HEADS, D),
        tokens: 1,
    };
    assert!(b.reshape_and_cache(0, &rows, &rows, &batch).is_err());
    b.end().unwrap();
    // Begun again, the step runs and writes the token's slot only.
    b.begin(&batch).unwrap();
    b.reshape_and_cache(0, &rows, &rows, &batch).unwrap();
    b.end().unwrap();
    let cache = arena.as_mut_slice::<f32>();
    let page = cfg.block_stride();
    let at = 3 * page + 2 * KV_HEADS * D;
    assert!(
        cache[at..at + KV_HEADS * D].iter().all(|&x| x == 1.0),
        "the token's K"
    );
    assert!(
        cache[..page].iter().all(|&x| x == 0.0),
        "page 0 was written"
    );
}

/// Copy-on-write pairs the host backend refuses (`check_block_mapping`: a destination that is
/// also a source, twice the same destination, a page onto itself) must be refused here too,
/// before anything is queued: on a GPU the copy kernel runs every pair at once, so a chain
/// `(1, 2), (2, 3)` reads page 2 while another thread block writes it (page 3 gets old, new or
/// torn bytes) and two pairs into one page race. Swap mappings likewise: two pages into one
/// swap slot (or one page from two slots) is the host backend's `DuplicateDestination`.
#[test]
fn copy_and_swap_mappings_the_host_backend_refuses_are_refused() {
    use pagedkv::error::{EngineError, KvError};
    let arena = EmuBuf::zeroed(config().total_bytes()).unwrap();
    let mut b = backend(&arena);
    for pairs in [
        &[(1, 2), (2, 3)][..],
        &[(2, 3), (1, 2)][..],
        &[(1, 4), (2, 4)][..],
        &[(5, 5)][..],
    ] {
        let r = b.copy_blocks(pairs);
        assert!(
            matches!(
                r,
                Err(EngineError::Kv(
                    KvError::CopyOverlap { .. } | KvError::DuplicateDestination { .. }
                ))
            ),
            "copy {pairs:?}: {r:?}"
        );
    }
    // Out of range stays refused.
    assert!(b.copy_blocks(&[(1, BLOCKS as u32)]).is_err());
    b.copy_blocks(&[(1, 2), (3, 4)]).unwrap();
    b.end().unwrap();

    // Two swap slots: two pages out into slot 0, or slot 0 and 1 into one page.
    let mut b = backend_with(&arena, 4, 2);
    // What `Engine::new` checks a swap-preempting engine's `swap_blocks` against.
    assert_eq!(b.swap_slots(), Some(2));
    let r = b.swap_out(&[(1, 0), (2, 0)]);
    assert!(
        matches!(
            r,
            Err(EngineError::Kv(KvError::DuplicateDestination { .. }))
        ),
        "swap out: {r:?}"
    );
    let r = b.swap_in(&[(0, 3), (1, 3)]);
    assert!(
        matches!(
            r,
            Err(EngineError::Kv(KvError::DuplicateDestination { .. }))
        ),
        "swap in: {r:?}"
    );
    b.swap_out(&[(1, 0), (2, 1)]).unwrap();
    b.swap_in(&[(0, 3), (1, 4)]).unwrap();
    b.end().unwrap();
}

/// A batch of 40001 sequences (one token in all, the other rows empty) on a backend sized for
/// 40000: the kernels take up to 65535 sequences, but the growth doubled the capacity to 80000,
/// past the decode plan's limit, and `begin` refused a batch that fits.
#[test]
fn growth_stays_within_the_kernels_limits() {
    let arena = EmuBuf::zeroed(config().total_bytes()).unwrap();
    let mut b = backend_with(&arena, 40_000, 1);
    let n = 40_001;
    let mut query_start_loc = vec![1i32; n + 1];
    query_start_loc[0] = 0;
    let batch = Batch {
        seq_ids: (1..=n as u64).collect(),
        input_tokens: vec![7],
        positions: vec![0],
        query_start_loc,
        context_lens: vec![1; n],
        slot_mapping: vec![0],
        block_tables: vec![0; n],
        max_blocks_per_seq: 1,
        ..Batch::default()
    };
    b.begin(&batch).unwrap();
    assert!(
        b.caps().max_seqs >= n && b.caps().max_seqs <= 65_535,
        "{:?}",
        b.caps()
    );
    b.end().unwrap();
}

/// The capacities `Engine::raw` starts with (`RawCaps::for_engine`) for an engine of 256-token
/// pages on a pool of 2^23 pages with a `max_context` past what a block table can name: a row
/// per pool page is 2^31 tokens, past the decode plan's `i32` contexts, and construction failed
/// (`Unsupported("max_context_capacity")`), although the backend's growth stops at `i32::MAX`
/// tokens. Likewise `max_running` past the plan's 65535 sequences. No page is touched:
/// nothing launches, so the arena address is never dereferenced.
#[test]
fn initial_capacities_stay_within_the_kernels_limits() {
    use pagedkv::engine::{EngineConfig, RecomputePolicy};
    use pagedkv::sched::PreemptionMode;
    let engine = |max_running, max_context| EngineConfig {
        weight: 1,
        max_running,
        max_batched_tokens: 1,
        max_prefill_chunk: 1,
        max_context,
        preemption: PreemptionMode::Recompute,
        swap_blocks: 1,
        recompute: RecomputePolicy::CALLER,
        prefix_cache: false,
    };
    let arena = EmuBuf::zeroed(16).unwrap();
    for (bs, pages, running, context) in [(256, 1u32 << 23, 1, u32::MAX), (16, 8, 100_000, 64)] {
        let kv = KvCacheConfig::new(1, KV_HEADS, D, bs, pages as usize, KvDtype::F32).unwrap();
        let caps = RawCaps::for_engine(&engine(running, context), bs, pages);
        // SAFETY: nothing is launched (the backend is only built): the arena is never used.
        let b =
            unsafe { RawBackend::new(EmuDevice::new(8), arena.ptr() as u64, &kv, HEADS, caps, 1) };
        assert!(b.is_ok(), "{caps:?}: {:?}", b.err());
        assert!(
            caps.max_blocks_per_seq * bs <= i32::MAX as usize && caps.max_seqs <= 65_535,
            "{caps:?}"
        );
    }
}

/// The host swap space is pinned (page-locked: swaps are then asynchronous DMA, not staged
/// copies that block the engine's thread) while the backend lives, and unpinned before it is
/// freed. Where the device refuses to pin it, it stays pageable, swaps move the same bytes, and
/// the backend's launches run as before.
#[test]
fn the_swap_space_is_pinned_while_the_backend_lives() {
    use pagedkv::cuda_emu::{host_registered, set_host_register_fails};
    let cfg = config();
    let page = cfg.block_stride();
    for refused in [false, true] {
        let mut arena = EmuBuf::zeroed(cfg.total_bytes()).unwrap();
        for (i, x) in arena.as_mut_slice::<f32>()[page..2 * page]
            .iter_mut()
            .enumerate()
        {
            *x = 1.0 + i as f32;
        }
        set_host_register_fails(refused);
        let mut b = backend_with(&arena, 4, 2);
        set_host_register_fails(false);
        let space = b.swap_space().unwrap();
        let (base, bytes) = (space.base_ptr() as usize, space.total_bytes());
        assert_eq!(b.swap_pinned(), !refused);
        assert_eq!(host_registered(base), if refused { 0 } else { bytes });
        // Page 1 out to slot 1 and back into page 3, then a launch.
        b.swap_out(&[(1, 1)]).unwrap();
        b.end().unwrap();
        b.swap_in(&[(1, 3)]).unwrap();
        let batch = Batch {
            seq_ids: vec![1],
            input_tokens: vec![7],
            positions: vec![0],
            query_start_loc: vec![0, 1],
            context_lens: vec![1],
            slot_mapping: vec![(5 * BS) as i64],
            block_tables: vec![5],
            max_blocks_per_seq: 1,
            ..Batch::default()
        };
        b.begin(&batch).unwrap();
        let k = EmuBuf::from_slice(&vec![2.0f32; KV_HEADS * D]).unwrap();
        let rows = DeviceRows {
            rows: Rows::dense(k.ptr() as u64, KV_HEADS, D),
            tokens: 1,
        };
        b.reshape_and_cache(0, &rows, &rows, &batch)
            .unwrap_or_else(|e| panic!("a launch after the pinning (refused: {refused}): {e}"));
        b.end().unwrap();
        drop(b);
        assert_eq!(host_registered(base), 0, "still pinned after the drop");
        let cache = arena.as_slice::<f32>();
        assert_eq!(cache[page..2 * page], cache[3 * page..4 * page]);
        assert_eq!(cache[5 * page], 2.0);
    }
    assert!(!backend_with(&EmuBuf::zeroed(cfg.total_bytes()).unwrap(), 4, 0).swap_pinned());
}

/// An arena base the kernels cannot take (null, or off the 16-byte grid every launch checks
/// the cache base against) is refused when the backend is built: it was accepted, and then
/// every step with tokens failed at its first cache write (`Misaligned` / `NullPointer`; a
/// misaligned base still ran swap-only steps). Nothing launches here: the base is never used.
#[test]
fn an_arena_base_the_kernels_refuse_is_refused_at_construction() {
    use pagedkv::cuda_raw::RawError;
    use pagedkv::error::EngineError;
    let cfg = config();
    let arena = EmuBuf::zeroed(cfg.total_bytes() + 16).unwrap();
    let caps = RawCaps {
        max_seqs: 1,
        max_tokens: 1,
        max_blocks_per_seq: 1,
        max_copies: 0,
    };
    for base in [0, arena.ptr() as u64 + 8] {
        // SAFETY: the construction is refused or, on the old code, builds a backend that is
        // dropped without a launch: the base is never dereferenced.
        let b = unsafe { RawBackend::new(EmuDevice::new(8), base, &cfg, HEADS, caps, 0) };
        assert!(
            matches!(
                b,
                Err(EngineError::Raw(
                    RawError::NullPointer { .. } | RawError::Misaligned { .. }
                ))
            ),
            "arena base {base:#x}: {:?}",
            b.map(|b| b.caps())
        );
    }
}

/// A second `begin` or `copy_blocks` before `end` (the executor makes one of each per step, but
/// the methods are safe to call in any order) rewrote the host staging bytes a queued copy may
/// still read on a GPU (`RawDevice::copy_to_device`'s contract: unmodified until synchronize),
/// so the kernels could read the new step's metadata, or some of each. The emulated device
/// checks the contract at synchronize; the backend now waits before rewriting.
#[test]
fn a_second_begin_or_copy_in_one_step_waits_for_the_queued_copy() {
    let arena = EmuBuf::zeroed(config().total_bytes()).unwrap();
    let mut b = backend_with(&arena, 4, 0);
    let batch = |page: i32| Batch {
        seq_ids: vec![1],
        input_tokens: vec![7],
        positions: vec![0],
        query_start_loc: vec![0, 1],
        context_lens: vec![1],
        slot_mapping: vec![i64::from(page) * BS as i64],
        block_tables: vec![page],
        max_blocks_per_seq: 1,
        ..Batch::default()
    };
    b.copy_blocks(&[(1, 2)]).unwrap();
    b.copy_blocks(&[(3, 4)]).unwrap();
    b.begin(&batch(5)).unwrap();
    b.begin(&batch(6)).unwrap();
    b.end().unwrap();
}

/// Two clones of one emulated device (one stream) on two threads: thread A queues a copy, thread
/// B's `synchronize` takes the queue and checks A's source bytes, and A's own `synchronize`,
/// called meanwhile, found the queue empty and returned at once, so A rewrote (or could free)
/// its source while B still read it: a data race, and B reported A's legal rewrite as a broken
/// contract. A `synchronize` now returns only once the copies queued before it are checked.
#[test]
fn a_clones_synchronize_waits_for_the_check_another_clone_runs() {
    use pagedkv::engine::RawDevice;
    use std::sync::mpsc;
    const BYTES: usize = 64 << 20;
    let a = EmuDevice::new(8);
    let dst = a.alloc(BYTES).unwrap();
    for attempt in 0..8 {
        let mut src = vec![attempt as u8; BYTES];
        // SAFETY: `dst` holds BYTES bytes of emulated memory; `src` is rewritten only after a
        // `synchronize` of this stream has returned (below).
        unsafe { a.copy_to_device(dst, &src) }.unwrap();
        let b = a.clone();
        let (started, wait) = mpsc::channel();
        let checker = std::thread::spawn(move || {
            started.send(()).unwrap();
            b.synchronize()
        });
        wait.recv().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(2));
        a.synchronize().unwrap();
        // The copy is complete for this thread: its source is the caller's again.
        src[BYTES - 1] ^= 0xff;
        let r = checker.join().unwrap();
        assert!(r.is_ok(), "attempt {attempt}: {r:?}");
        drop(src);
    }
    // SAFETY: allocated above, freed once; nothing is queued (synchronised).
    unsafe { a.free(dst) };
}
