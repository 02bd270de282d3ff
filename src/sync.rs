//! The loom shim: every atomic, cell, `Arc` and thread the library's concurrent code uses comes
//! through here, so that `RUSTFLAGS="--cfg loom"` swaps in loom's model-checked versions
//! (tests/loom.rs) without touching the algorithms.

#[cfg(loom)]
pub(crate) use loom::{
    hint,
    sync::{
        atomic::{fence, AtomicBool, AtomicI64, AtomicU16, AtomicU32, AtomicU64, AtomicUsize, Ordering},
        Arc,
    },
    thread,
};

#[cfg(not(loom))]
pub(crate) use std::{
    hint,
    sync::{
        atomic::{fence, AtomicBool, AtomicI64, AtomicU16, AtomicU32, AtomicU64, AtomicUsize, Ordering},
        Arc,
    },
    thread,
};

/// A cache-line-padded wrapper for contended atomics (crossbeam's, re-exported so callers do not
/// depend on crossbeam directly).
pub use crossbeam_utils::CachePadded;
