//! A per-engine magazine of free blocks: a bounded array stack with one pusher at a time and any
//! number of poppers, so an engine's scheduler thread recycles its own blocks without touching
//! the pool's shared head (and without walking links: a batch is a slice of the array).
//!
//! # Algorithm
//!
//! A **tagged array stack** (the array form of a Treiber stack): one word holds the count, a
//! push-in-progress bit and an ABA tag; entries below the count are free block indices.
//!
//! ```text
//!  top: |        tag (55 bits)        | busy (1) | count (8) |
//! ```
//!
//! - **Pop** (anyone): read `top`, read the `n` entries below the count, CAS `top` to
//!   `count - n` (tag and busy unchanged). Entries read from a stale `top` may be garbage; they
//!   are used only if the CAS proves `top` unchanged since the read.
//! - **Push** (one thread at a time): CAS the busy bit on (refused, not awaited, if it is already
//!   on or the blocks do not fit: the caller pushes to the shared list instead), write the
//!   entries at the count, CAS `top` to `(tag + 1, idle, count + k)`. Pops may run meanwhile;
//!   they only lower the count, so a failed final CAS rewrites the entries at the new count.
//!
//! **ABA.** A pop's CAS compares the whole word. While the pusher's bit is off, the count only
//! rises through a push, whose release bumps the tag; while it is on, the count only falls. So a
//! word can only reappear after a push released it with the tag wrapped (2^55 pushes between a
//! popper's read and its CAS; 2 bits under loom so models can wrap it), and a successful CAS
//! proves the entries read were the live ones. Entries lie between index 0 and the capacity, so
//! reading one is always in bounds; an entry value is only trusted once the CAS succeeds.
//!
//! **Ordering.** A push's final CAS releases its entries to the pops that acquire its word. The
//! other direction matters too: a pop frees the entries it read for the next push to
//! overwrite, so a successful pop CAS also releases (its Relaxed reads of the entries), and the
//! push acquires the count it writes at (its claim, and its final CAS on failure). Without
//! that, the memory model lets a popper's read return the value a later pusher stores there
//! (load buffering; loom does not model it, so this is argued here, not checked).
//!
//! **Reclamation.** The array lives as long as the pool; nothing is freed.

use crate::sync::{AtomicU32, AtomicU64, CachePadded, Ordering};

/// Bits of the count (capacity at most 255).
const COUNT_BITS: u32 = 8;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;
const BUSY: u64 = 1 << COUNT_BITS;
const TAG_SHIFT: u32 = COUNT_BITS + 1;
/// 2 bits under loom so that models can wrap the tag (see the module docs).
const TAG_BITS: u32 = if cfg!(loom) { 2 } else { 64 - TAG_SHIFT };
const TAG_MASK: u64 = (1 << TAG_BITS) - 1;

/// Entries per magazine. Four batches of 16; 2 under loom, so small models fill and overflow it.
pub(super) const MAG_CAP: u32 = if cfg!(loom) { 2 } else { 64 };

#[inline]
pub(super) fn count_of(top: u64) -> u32 {
    (top & COUNT_MASK) as u32
}

/// The word after a push released it: tag + 1, idle, `count`.
#[inline]
fn released(top: u64, count: u32) -> u64 {
    let tag = ((top >> TAG_SHIFT).wrapping_add(1)) & TAG_MASK;
    (tag << TAG_SHIFT) | u64::from(count)
}

/// Free blocks parked for one engine. See the module docs.
#[derive(Debug)]
pub(super) struct Magazine {
    /// `tag | busy | count`. Entries `0..count` are free block indices; `busy` is set while one
    /// thread pushes (only it writes entries at or above the count); the tag rises with every
    /// push.
    top: CachePadded<AtomicU64>,
    /// Free block indices, valid below the count of `top`.
    slots: Box<[AtomicU32]>,
}

impl Magazine {
    /// An empty magazine of `cap` entries (`cap <= MAG_CAP`).
    pub(super) fn new(cap: u32) -> Self {
        debug_assert!(cap <= MAG_CAP);
        Self {
            top: CachePadded::new(AtomicU64::new(0)),
            slots: (0..cap).map(|_| AtomicU32::new(0)).collect(),
        }
    }

    /// The whole `top` word (for snapshots: any change to the magazine changes it).
    #[inline]
    pub(super) fn word(&self) -> u64 {
        // Acquire pairs with the Release CAS of the push that set it, so the entries below the
        // count (and the freed blocks' metadata) are visible to a popper that goes on to read
        // them.
        self.top.load(Ordering::Acquire)
    }

    /// Pops exactly `dst.len() >= 1` entries into `dst` (top first), or returns `false` with the
    /// magazine unchanged when it holds fewer. `dst` may be written by several attempts; only
    /// the last attempt's values count, and after a `false` its contents are meaningless.
    #[inline]
    pub(super) fn pop_n(&self, dst: &mut [u32]) -> bool {
        let n = dst.len();
        let mut top = self.word();
        loop {
            let count = count_of(top) as usize;
            if count < n {
                return false;
            }
            // `count <= capacity` (pushes never exceed it), so the slice is in bounds: one check
            // for the batch instead of one per entry.
            for (d, slot) in dst
                .iter_mut()
                .zip(self.slots[count - n..count].iter().rev())
            {
                // Relaxed: ordered by the Acquire on `top` (see `word`); a stale value is
                // discarded because the CAS below fails.
                *d = slot.load(Ordering::Relaxed);
            }
            // Acquire on success and failure: the next attempt reads entries published by the
            // push that made the observed word current. Release on success: our reads of the
            // entries happen before a push that Acquires the lowered word (its claim, or its
            // failed final CAS) overwrites them; without it a popper's Relaxed load may return
            // the pusher's later value (load buffering), a block then both popped and parked.
            match self.top.compare_exchange_weak(
                top,
                top - n as u64,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(actual) => top = actual,
            }
        }
    }

    /// Pops every entry into `buf` (at least the capacity long); returns how many.
    pub(super) fn pop_all(&self, buf: &mut [u32]) -> u32 {
        let mut top = self.word();
        loop {
            let count = count_of(top);
            if count == 0 {
                return 0;
            }
            for (dst, slot) in buf.iter_mut().zip(&self.slots[..count as usize]) {
                // Relaxed: see pop_n.
                *dst = slot.load(Ordering::Relaxed);
            }
            // AcqRel / Acquire: see pop_n.
            match self.top.compare_exchange_weak(
                top,
                top - u64::from(count),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return count,
                Err(actual) => top = actual,
            }
        }
    }

    /// Pushes `blocks` (free blocks the caller alone holds) unless another push is in progress
    /// or they do not fit; returns whether it did. Never waits for another thread.
    #[inline]
    pub(super) fn try_push(&self, blocks: impl ExactSizeIterator<Item = u32> + Clone) -> bool {
        let k = blocks.len() as u32;
        let cap = self.slots.len() as u32;
        // Relaxed load: a word is only acted on through the claim's CAS.
        let mut top = self.top.load(Ordering::Relaxed);
        loop {
            if top & BUSY != 0 || count_of(top) + k > cap {
                return false;
            }
            // Acquire on success: the pops that lowered the count to what we claim released
            // their reads of the entries we are about to overwrite (every write to `top` is a
            // read-modify-write, so their release sequences reach this claim). The entries are
            // published by the final Release CAS.
            match self.top.compare_exchange_weak(
                top,
                top | BUSY,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(actual) => top = actual,
            }
        }
        top |= BUSY;
        loop {
            // Only pops ran since the claim, and they only lower the count: the entries from
            // the count up are this thread's alone (a stale popper may read them, and then
            // fails its CAS).
            let count = count_of(top);
            let at = count as usize;
            for (slot, b) in self.slots[at..at + blocks.len()].iter().zip(blocks.clone()) {
                // Relaxed: published by the Release CAS below.
                slot.store(b, Ordering::Relaxed);
            }
            // Release publishes the entries and the blocks' zeroed metadata (written by the
            // caller before this call) to the popper that Acquires the new word. Acquire on
            // failure: a pop lowered the count, and its reads of the entries we rewrite next
            // must come before our stores (as at the claim).
            match self.top.compare_exchange_weak(
                top,
                released(top, count + k),
                Ordering::Release,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(actual) => top = actual,
            }
        }
    }
}
