//! The hash -> page slot table: fixed-capacity open addressing with linear probing over a
//! bounded window, one `AtomicU64` per slot, no locks.
//!
//! # Layout and invariants
//!
//! ```text
//!  slot: | tag: hash.hi >> 26 (38) | page index (24) | kind (2) |
//!  kind: EMPTY (the whole word is 0) | TOMB (1) | LIVE (2)
//! ```
//!
//! - The table has `2 * pages` slots rounded up to a power of two, and a page holds at most one
//!   hash (its record's state machine), so at most half the slots are ever `LIVE`.
//! - A hash `h` lives in one of the `WINDOW` slots from `home(h) = h.lo & mask`. An insert
//!   takes the first non-`LIVE` slot of that window with a CAS; a full window (vanishingly rare
//!   at load <= 1/2) means the block is simply not cached.
//! - A slot never returns to `EMPTY` once used (removal writes `TOMB`, insertion reuses tombs).
//!   So when an entry sits at window offset `k`, every slot before it was non-`EMPTY` when it
//!   was claimed and still is: a probe may stop at the first `EMPTY` slot.
//! - A `LIVE` slot naming page `p` is written only by the thread that owns `p`'s record
//!   (`BUSY` or `EVICTING`: claim and removal); other threads only CAS non-`LIVE` slots. So no
//!   entry is ever overwritten by a stranger, and removal is a plain store.
//!
//! The tag is a filter: a probe hands every `LIVE` slot with a matching tag to the caller, who
//! verifies the full hash (and everything else) against the page's record. No reclamation: the
//! slots live as long as the cache.

use std::ops::ControlFlow;

use crate::sync::{AtomicU64, Backoff, Ordering};

use super::hash::BlockHash;

const EMPTY: u64 = 0;
const TOMB: u64 = 1;
const LIVE: u64 = 2;
const KIND_MASK: u64 = 0b11;
const PAGE_SHIFT: u32 = 2;
const PAGE_MASK: u64 = (1 << 24) - 1;
const TAG_SHIFT: u32 = 26;
/// Slots probed per hash: bounds every lookup and removal to this many loads, and an insert to
/// this many slots (an insert whose CAS on a slot lost to another insert looks at that slot
/// again: lock-free, not a bound on its loads).
const WINDOW: usize = 32;

#[inline]
fn live_word(hash: BlockHash, page: u32) -> u64 {
    ((hash.hi >> TAG_SHIFT) << TAG_SHIFT) | ((u64::from(page) & PAGE_MASK) << PAGE_SHIFT) | LIVE
}

#[inline]
fn word_page(word: u64) -> u32 {
    ((word >> PAGE_SHIFT) & PAGE_MASK) as u32
}

/// The slot table.
#[derive(Debug)]
pub(super) struct SlotTable {
    slots: Box<[AtomicU64]>,
    mask: usize,
    window: usize,
}

impl SlotTable {
    /// A table for `pages` pages (at most one entry each).
    pub(super) fn new(pages: u32) -> Self {
        let cap = (pages as usize * 2).next_power_of_two().max(2);
        Self {
            slots: (0..cap).map(|_| AtomicU64::new(EMPTY)).collect(),
            mask: cap - 1,
            window: WINDOW.min(cap),
        }
    }

    /// Slots in the table.
    pub(super) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// `LIVE` slots (loom models: one per cached page once every operation is done).
    #[cfg(loom)]
    pub(super) fn live(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| s.load(Ordering::Relaxed) & KIND_MASK == LIVE)
            .count()
    }

    #[inline]
    fn slot(&self, hash: BlockHash, k: usize) -> &AtomicU64 {
        &self.slots[(hash.lo as usize).wrapping_add(k) & self.mask]
    }

    /// Calls `f` with the page of every `LIVE` slot in `hash`'s window whose tag matches, until
    /// `f` breaks or the window ends. Returns what `f` broke with.
    #[inline]
    pub(super) fn probe<B>(
        &self,
        hash: BlockHash,
        mut f: impl FnMut(u32) -> ControlFlow<B>,
    ) -> Option<B> {
        let tag = (hash.hi >> TAG_SHIFT) << TAG_SHIFT;
        for k in 0..self.window {
            // Acquire pairs with the claiming CAS; the record the page names carries its own
            // synchronisation, so this only keeps the probe from seeing a slot "before" it was
            // claimed in a way that matters to nobody, and costs nothing on x86.
            let w = self.slot(hash, k).load(Ordering::Acquire);
            if w == EMPTY {
                return None;
            }
            if w & KIND_MASK == LIVE && (w >> TAG_SHIFT) << TAG_SHIFT == tag {
                if let ControlFlow::Break(b) = f(word_page(w)) {
                    return Some(b);
                }
            }
        }
        None
    }

    /// Adds `(hash, page)`. The caller owns `page`'s record. Returns `false` if the window has
    /// no free slot (the block is then not cached).
    pub(super) fn claim(&self, hash: BlockHash, page: u32) -> bool {
        let word = live_word(hash, page);
        let backoff = Backoff::new();
        let mut k = 0;
        while k < self.window {
            let slot = self.slot(hash, k);
            let cur = slot.load(Ordering::Acquire);
            if cur & KIND_MASK == LIVE {
                k += 1;
                continue;
            }
            // A CAS from the non-LIVE word seen, never a store: two inserts that race for a
            // slot must not both take it (the loser's entry would be lost; loom
            // `an_insert_behind_a_colliding_one_is_found_by_a_lookup_after_it`). Its orderings
            // are not what correctness rests on (loom passes with them Relaxed): the word
            // carries no data but itself, the page's record synchronises the rest, and a probe
            // that happens after a claim further down the window sees this slot claimed by
            // coherence (that claimer read it). A failure means another insert took this slot:
            // look at it again.
            match slot.compare_exchange(cur, word, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(_) => backoff.spin(),
            }
        }
        false
    }

    /// Removes `(hash, page)`, which the caller (owning `page`'s record) added. Returns whether
    /// it was found (always, unless the caller broke the protocol).
    pub(super) fn remove(&self, hash: BlockHash, page: u32) -> bool {
        let word = live_word(hash, page);
        for k in 0..self.window {
            let slot = self.slot(hash, k);
            // Relaxed is enough to find the entry: its claim happens-before this load, though
            // often on another thread (an evictor or forgetter removes what an inserter
            // claimed). The inserter claimed before publishing the record (Release); the caller
            // took the record with an AcqRel CAS from that state or a later one, so coherence
            // shows it the claim's word, and only the record's owner changes a LIVE slot.
            if slot.load(Ordering::Relaxed) == word {
                // A plain store: only the record's owner writes a LIVE slot naming its page.
                // Release: kept for symmetry with `claim`; as there, nothing depends on it.
                slot.store(TOMB, Ordering::Release);
                return true;
            }
        }
        false
    }
}
