//! The loom shim: every atomic, cell, `Arc` and thread the library's concurrent code uses comes
//! through here, so that `RUSTFLAGS="--cfg loom"` swaps in loom's model-checked versions
//! (tests/loom.rs) without touching the algorithms.

// Not every build uses every type (the shim serves all modules).
#[allow(unused_imports)]
#[cfg(loom)]
pub(crate) use loom::{
    hint,
    sync::{
        atomic::{
            fence, AtomicBool, AtomicI64, AtomicPtr, AtomicU16, AtomicU32, AtomicU64, AtomicUsize,
            Ordering,
        },
        Arc,
    },
    thread,
};

#[allow(unused_imports)]
#[cfg(not(loom))]
pub(crate) use std::{
    hint,
    sync::{
        atomic::{
            fence, AtomicBool, AtomicI64, AtomicPtr, AtomicU16, AtomicU32, AtomicU64, AtomicUsize,
            Ordering,
        },
        Arc,
    },
    thread,
};

/// A cache-line-padded wrapper for contended atomics (crossbeam's, re-exported so callers do not
/// depend on crossbeam directly).
pub use crossbeam_utils::CachePadded;

/// Exponential backoff for CAS retry loops (crossbeam's). Under loom a retry must yield to the
/// model's scheduler instead of spinning, or loom would explore the spin forever.
#[cfg(not(loom))]
pub(crate) use crossbeam_utils::Backoff;

/// Exponential backoff for CAS retry loops; under loom every step yields to the model.
///
/// `snooze` (the crate's only wait *for another thread*: a drop-oldest submit waiting for a
/// thread mid-way in the slot it needs) also bounds loom's exploration: from the
/// [`LOOM_SNOOZE_ROUNDS`]-th snooze of one `Backoff` on, the execution runs to its end without
/// branching (`loom::skip_branch`). Without that bound no model with two such waiters can
/// finish: while the thread they wait for is preempted, loom may schedule the two waiters'
/// yields alternately forever (a switch after a yield costs no preemption; tokio-rs/loom#53),
/// and every such execution ends at the branch limit. Nothing is left unchecked in the
/// execution itself (it still runs to the end, assertions included); what the bound gives up is
/// exploring *other* interleavings after a thread has waited that long. A waiting round only
/// loads (`try_push` answering `Busy`, or `Full` then `evict_if_full` answering `Busy`), so
/// deleting it changes no other thread's steps: the states those interleavings reach are
/// reached by ones in which the waiter waited fewer rounds (though one of these may need a
/// preemption where a deleted yield made the switch free, so under `LOOM_MAX_PREEMPTIONS` the
/// bound can cost coverage, as the preemption bound itself does).
#[cfg(loom)]
#[derive(Debug, Default)]
pub(crate) struct Backoff {
    /// Snoozes so far.
    snoozes: std::cell::Cell<u32>,
}

/// See [`Backoff`]: the snooze from which loom stops branching. 3 is where the count of
/// interleavings levels off (two drop-oldest submitters on one slot, tests/loom/admission.rs:
/// 313 k at 1, 388 k at 2, 394 k at 3, 398 k at 5); the one-waiter drop-oldest models explore
/// the same 194 / 293 / 296 with or without the bound.
#[cfg(loom)]
const LOOM_SNOOZE_ROUNDS: u32 = 3;

#[cfg(loom)]
impl Backoff {
    pub(crate) fn new() -> Self {
        Self::default()
    }
    pub(crate) fn spin(&self) {
        loom::thread::yield_now();
    }
    #[allow(dead_code)]
    pub(crate) fn snooze(&self) {
        let n = self.snoozes.get() + 1;
        self.snoozes.set(n);
        if n >= LOOM_SNOOZE_ROUNDS {
            loom::skip_branch();
        }
        loom::thread::yield_now();
    }
}

/// Process-wide counters that are identities, not protocols (pool tags): plain std atomics even
/// under loom, because loom atomics cannot live in a `static`.
pub(crate) mod global {
    use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

    /// Tags are 1..=65535 (0 is never handed out).
    const TAGS: u32 = u16::MAX as u32;

    /// Bit `t % 64` of word `t / 64` is set while a live pool holds tag `t`: a tag goes to one
    /// live pool at a time, however many pools were created and dropped in between.
    static LIVE_TAGS: [AtomicU64; 1024] = [const { AtomicU64::new(0) }; 1024];
    /// Where the next search for a free tag starts: round robin, so a dropped pool's tag is
    /// the last one handed out again (an id kept past its pool's drop is refused as long as
    /// possible).
    static NEXT_POOL_TAG: AtomicU32 = AtomicU32::new(0);

    /// A tag no live pool holds, or `None` when 65,535 pools are alive. Give it back with
    /// [`release_pool_tag`].
    pub(crate) fn acquire_pool_tag() -> Option<u16> {
        // Relaxed: uniqueness needs only the RMWs' atomicity (one fetch_or wins each bit), no
        // ordering with other memory.
        let start = NEXT_POOL_TAG.fetch_add(1, Ordering::Relaxed);
        (0..TAGS).find_map(|k| {
            let t = (start.wrapping_add(k) % TAGS) as u16 + 1;
            let bit = 1u64 << (t % 64);
            let was = LIVE_TAGS[usize::from(t / 64)].fetch_or(bit, Ordering::Relaxed);
            (was & bit == 0).then_some(t)
        })
    }

    /// Gives back a tag from [`acquire_pool_tag`] (its pool is gone).
    pub(crate) fn release_pool_tag(t: u16) {
        LIVE_TAGS[usize::from(t / 64)].fetch_and(!(1u64 << (t % 64)), Ordering::Relaxed);
    }
}

/// A cell for data whose exclusive access an atomic protocol guarantees. Under loom it is loom's
/// `UnsafeCell`, which checks that protocol (a read racing a write fails the model); otherwise a
/// zero-cost wrapper with the same closure-based API (`with` / `with_mut` hand out raw pointers).
#[cfg(loom)]
pub(crate) use loom::cell::UnsafeCell;

/// A cell for data whose exclusive access an atomic protocol guarantees (see the loom variant).
#[cfg(not(loom))]
#[derive(Debug, Default)]
pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    /// Wraps `data`.
    pub(crate) const fn new(data: T) -> Self {
        Self(std::cell::UnsafeCell::new(data))
    }

    /// Calls `f` with a shared raw pointer to the contents; the caller's protocol must rule out a
    /// concurrent `with_mut` before `f` dereferences it.
    #[inline(always)]
    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }

    /// Calls `f` with a unique raw pointer to the contents; the caller's protocol must rule out
    /// any concurrent access before `f` dereferences it.
    #[inline(always)]
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}
