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
#[cfg(loom)]
#[derive(Debug, Default)]
pub(crate) struct Backoff;

#[cfg(loom)]
impl Backoff {
    pub(crate) fn new() -> Self {
        Self
    }
    pub(crate) fn spin(&self) {
        loom::thread::yield_now();
    }
    #[allow(dead_code)]
    pub(crate) fn snooze(&self) {
        loom::thread::yield_now();
    }
}

/// Process-wide counters that are identities, not protocols (pool tags): plain std atomics even
/// under loom, because loom atomics cannot live in a `static`.
pub(crate) mod global {
    use std::sync::atomic::{AtomicU32, Ordering};

    static NEXT_POOL_TAG: AtomicU32 = AtomicU32::new(1);

    /// A fresh pool tag. Tags wrap after 65,535 pools; two live pools sharing a tag would need
    /// that many pools created in between, and even then ids stay range- and generation-checked.
    pub(crate) fn next_pool_tag() -> u16 {
        // Relaxed: uniqueness needs only the RMW's atomicity, no ordering with other memory.
        let t = NEXT_POOL_TAG.fetch_add(1, Ordering::Relaxed);
        (t % u32::from(u16::MAX)) as u16 + 1
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
