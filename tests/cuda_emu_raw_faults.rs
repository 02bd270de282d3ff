//! The raw-pointer backend under device failures (feature `cuda-emu`): a [`RawDevice`] over the
//! emulated one that refuses an allocation, a copy or a synchronize on demand and tracks the
//! live allocations. A backend whose construction fails frees what it had allocated; one whose
//! buffer growth, metadata copy or stream wait fails keeps its old buffers and serves the next
//! step; nothing is leaked or freed twice.
#![cfg(all(feature = "cuda-emu", not(feature = "cuda")))]

use pagedkv::cuda_emu::{EmuBuf, EmuDevice};
use pagedkv::cuda_raw::{CuStream, DevPtr, Rows};
use pagedkv::engine::{DeviceRows, KvBackend, RawBackend, RawCaps, RawDevice};
use pagedkv::error::EngineError;
use pagedkv::kv::{KvCacheConfig, KvDtype};
use pagedkv::sched::Batch;
use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::rc::Rc;

/// What the faulty device refuses next, and what it has allocated.
#[derive(Debug, Default)]
struct Faults {
    live: RefCell<HashSet<u64>>,
    allocs: Cell<usize>,
    fail_alloc_at: Cell<Option<usize>>,
    fail_copy: Cell<bool>,
    fail_sync: Cell<bool>,
}

impl Faults {
    fn leaked(&self) -> usize {
        self.live.borrow().len()
    }
}

#[derive(Debug)]
struct Faulty {
    inner: EmuDevice,
    f: Rc<Faults>,
}

fn injected(what: &str) -> EngineError {
    EngineError::InvalidConfig(format!("injected {what} failure"))
}

// SAFETY: every call that succeeds is the emulated device's (which keeps the contract); a
// refused allocation returns no pointer, a refused copy queues nothing, and a refused
// synchronize leaves the queued copies to the next one.
unsafe impl RawDevice for Faulty {
    fn stream(&self) -> CuStream {
        self.inner.stream()
    }
    fn sm_count(&self) -> usize {
        self.inner.sm_count()
    }
    fn bind(&self) -> Result<(), EngineError> {
        self.inner.bind()
    }
    fn alloc(&self, bytes: usize) -> Result<DevPtr, EngineError> {
        let n = self.f.allocs.get();
        self.f.allocs.set(n + 1);
        if self.f.fail_alloc_at.get() == Some(n) {
            return Err(injected("alloc"));
        }
        let p = self.inner.alloc(bytes)?;
        self.f.live.borrow_mut().insert(p);
        Ok(p)
    }
    unsafe fn free(&self, ptr: DevPtr) {
        assert!(
            self.f.live.borrow_mut().remove(&ptr),
            "{ptr:#x} freed twice or never allocated"
        );
        // SAFETY: the caller's contract, and `ptr` is one of the inner device's allocations.
        unsafe { self.inner.free(ptr) }
    }
    unsafe fn copy_to_device(&self, dst: DevPtr, src: &[u8]) -> Result<(), EngineError> {
        if self.f.fail_copy.get() {
            return Err(injected("copy"));
        }
        // SAFETY: the caller's contract.
        unsafe { self.inner.copy_to_device(dst, src) }
    }
    fn synchronize(&self) -> Result<(), EngineError> {
        if self.f.fail_sync.get() {
            return Err(injected("synchronize"));
        }
        self.inner.synchronize()
    }
}

const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const D: usize = 64;
const BS: usize = 16;
const BLOCKS: usize = 64;
/// Capacities a `batch(3, 60)` outgrows (sequences and blocks per sequence).
const SMALL: RawCaps = RawCaps {
    max_seqs: 1,
    max_tokens: 1,
    max_blocks_per_seq: 4,
    max_copies: 0,
};

fn config() -> KvCacheConfig {
    KvCacheConfig::new(1, KV_HEADS, D, BS, BLOCKS, KvDtype::F32).unwrap()
}

fn backend(arena: &EmuBuf, f: &Rc<Faults>) -> Result<RawBackend<Faulty>, EngineError> {
    // SAFETY: emulated device memory is host memory; `arena` holds the cache's pages and
    // outlives the backend; the batches below name pages nothing else uses, and the rows
    // handed to the backend are emulated buffers alive across each step.
    unsafe {
        RawBackend::new(
            Faulty {
                inner: EmuDevice::new(132),
                f: f.clone(),
            },
            arena.ptr() as u64,
            &config(),
            HEADS,
            SMALL,
            2,
        )
    }
}

/// A decode step of `seqs` sequences of `ctx` tokens each, over pages of their own.
fn batch(seqs: usize, ctx: usize) -> Batch {
    let per = ctx.div_ceil(BS);
    let mut b = Batch {
        max_blocks_per_seq: per,
        query_start_loc: vec![0],
        ..Batch::default()
    };
    for s in 0..seqs {
        let last = ctx - 1;
        b.seq_ids.push(s as u64);
        b.input_tokens.push(1);
        b.positions.push(last as i32);
        b.query_start_loc.push(s as i32 + 1);
        b.context_lens.push(ctx as i32);
        b.block_tables
            .extend((0..per).map(|j| (s * per + j) as i32));
        b.slot_mapping
            .push(((s * per + last / BS) * BS + last % BS) as i64);
    }
    b
}

/// Runs a step as the executor does (its `end` also after an error).
fn step(b: &mut RawBackend<Faulty>, batch: &Batch) -> Result<(), EngineError> {
    let n = batch.num_tokens();
    let q = EmuBuf::zeroed(n * HEADS * D * 4).unwrap();
    let kv = EmuBuf::zeroed(n * KV_HEADS * D * 4).unwrap();
    let rows = |buf: &EmuBuf, heads| DeviceRows {
        rows: Rows::dense(buf.ptr() as u64, heads, D),
        tokens: n,
    };
    let r = (|| {
        b.begin(batch)?;
        b.reshape_and_cache(0, &rows(&kv, KV_HEADS), &rows(&kv, KV_HEADS), batch)?;
        b.decode(0, &rows(&q, HEADS), batch)?;
        Ok(())
    })();
    let e = b.end();
    r.and(e)
}

#[test]
fn a_failed_construction_frees_what_it_allocated() {
    let arena = EmuBuf::zeroed(config().total_bytes()).unwrap();
    let f = Rc::new(Faults::default());
    let b = backend(&arena, &f).unwrap();
    // Metadata, output and a split-K workspace (whose counters are zeroed by a copy).
    assert!(b.plan().workspace_bytes() > 0, "{:?}", b.plan());
    let allocs = f.allocs.get();
    assert_eq!(allocs, 3);
    drop(b);
    assert_eq!(f.leaked(), 0);
    for at in 0..allocs {
        let f = Rc::new(Faults::default());
        f.fail_alloc_at.set(Some(at));
        assert!(backend(&arena, &f).is_err());
        assert_eq!(f.leaked(), 0, "allocation {at} refused");
    }
    let f = Rc::new(Faults::default());
    f.fail_copy.set(true);
    assert!(backend(&arena, &f).is_err());
    assert_eq!(f.leaked(), 0, "the counters' copy refused");
}

#[test]
fn a_failed_growth_copy_or_wait_keeps_the_backend_usable() {
    let arena = EmuBuf::zeroed(config().total_bytes()).unwrap();
    // Each allocation of a growth refused in turn, then the zeroing copy of its workspace.
    for at in 0..4 {
        let f = Rc::new(Faults::default());
        let mut b = backend(&arena, &f).unwrap();
        step(&mut b, &batch(1, 40)).unwrap();
        if at < 3 {
            f.fail_alloc_at.set(Some(f.allocs.get() + at));
        } else {
            f.fail_copy.set(true);
        }
        assert!(step(&mut b, &batch(3, 60)).is_err());
        assert_eq!(b.caps(), SMALL, "{at}: the old buffers stay");
        f.fail_copy.set(false);
        step(&mut b, &batch(1, 40))
            .unwrap_or_else(|e| panic!("{at}: after the failed growth: {e}"));
        f.fail_alloc_at.set(None);
        step(&mut b, &batch(3, 60)).unwrap();
        assert!(b.caps().max_seqs >= 3);
        drop(b);
        assert_eq!(f.leaked(), 0, "{at}: leaked");
    }

    let f = Rc::new(Faults::default());
    let mut b = backend(&arena, &f).unwrap();
    // A refused metadata or copy-pair upload.
    f.fail_copy.set(true);
    assert!(step(&mut b, &batch(1, 40)).is_err());
    assert!(b.copy_blocks(&[(40, 41)]).is_err());
    f.fail_copy.set(false);
    b.end().unwrap();
    step(&mut b, &batch(1, 40)).unwrap();
    b.copy_blocks(&[(40, 41)]).unwrap();
    b.end().unwrap();
    // A failed wait at the end of a step, and before a growth.
    for seqs in [1, 3] {
        f.fail_sync.set(true);
        assert!(step(&mut b, &batch(seqs, 40)).is_err());
        f.fail_sync.set(false);
        step(&mut b, &batch(1, 40)).unwrap();
    }
    step(&mut b, &batch(3, 60)).unwrap();
    drop(b);
    assert_eq!(f.leaked(), 0);
}
