//! Per-page cache records: which hash a page holds, read by lookups as a seqlock.
//!
//! # Protocol
//!
//! Each page has one record whose `state` word is both a seqlock version and a small state
//! machine:
//!
//! ```text
//!  state: | version (38) | generation (24) | phase (2) |
//!  phase: VACANT --begin--> BUSY --publish--> CACHED --begin--> BUSY --end--> VACANT
//!                                                 CACHED --check--> EVICTING --end--> VACANT
//!                                                                   EVICTING --publish--> CACHED
//! ```
//!
//! `EVICTING` is an eviction's `BUSY`: owned like it, but the cache still holds the page's
//! hash and its pool reference while the owner checks whether anyone else holds the page; it
//! then removes the page (`end`) or, when someone does, puts it back (`publish`). Lookups treat
//! it like `BUSY` (a miss); [`PrefixCache::is_cached`](super::PrefixCache::is_cached) treats it
//! like `CACHED`, which it is as far as the pool's counts go.
//!
//! Every transition increments the version, so a state word is never seen twice (modulo 2^38
//! transitions of one page while one reader is between its two loads).
//!
//! - A writer *owns* a record from its successful CAS into `BUSY` (or `EVICTING`) until it
//!   stores the next phase; only the owner writes `hash_*` and `engine`. Two writers never own
//!   a record at once (the CAS), so inserts, evictions and forgets of one page serialise without
//!   a lock and without waiting: a writer that finds the record owned gives up on that page.
//! - A reader (lookup, eviction scan, dedup) loads `state` (Acquire, pairing with the owner's
//!   Release store of `CACHED`), reads the fields (Relaxed), issues an Acquire fence and loads
//!   `state` again: equal words prove no owner wrote in between (Boehm, "Can seqlocks get along
//!   with programming language memory models?", 2012: the fence orders the field reads before
//!   the second load). It uses only snapshots taken that way.
//!
//! `CACHED` means: the cache holds one pool reference to `(page, generation)`, the slot table
//! holds one live entry `(hash tag, page)`, and `hash_*` / `engine` are the page's.

use crate::block::EngineId;
use crate::sync::{fence, AtomicBool, AtomicU16, AtomicU64, Ordering};

use super::hash::BlockHash;

pub(super) const VACANT: u64 = 0;
pub(super) const BUSY: u64 = 1;
pub(super) const CACHED: u64 = 2;
pub(super) const EVICTING: u64 = 3;
const PHASE_MASK: u64 = 0b11;
const GEN_SHIFT: u32 = 2;
const GEN_MASK: u64 = (1 << 24) - 1;
const VERSION_SHIFT: u32 = 26;

#[inline]
pub(super) fn phase(state: u64) -> u64 {
    state & PHASE_MASK
}

#[inline]
pub(super) fn generation(state: u64) -> u32 {
    ((state >> GEN_SHIFT) & GEN_MASK) as u32
}

/// `state` moved to `phase` with generation `gen` and the next version.
#[inline]
fn next(state: u64, gen: u32, phase: u64) -> u64 {
    let version = (state >> VERSION_SHIFT).wrapping_add(1);
    (version << VERSION_SHIFT) | ((u64::from(gen) & GEN_MASK) << GEN_SHIFT) | phase
}

/// A consistent view of a `CACHED` record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Snapshot {
    /// The state word it was read under (phase `CACHED`).
    pub(super) state: u64,
    pub(super) hash: BlockHash,
    pub(super) engine: EngineId,
}

/// Proof of owning a record in `BUSY`: the state word the owner installed.
#[derive(Debug)]
#[must_use = "a BUSY record must be published or ended"]
pub(super) struct Busy(u64);

/// One page's cache record.
#[derive(Debug, Default)]
pub(super) struct PageRecord {
    /// `version (38) | generation (24) | phase (2)`; see the module docs.
    state: AtomicU64,
    /// The page's hash, low lane. Written only by the owner of a `BUSY` record.
    hash_lo: AtomicU64,
    /// The page's hash, high lane. Written only by the owner of a `BUSY` record.
    hash_hi: AtomicU64,
    /// The engine the page is cached for. Written only by the owner of a `BUSY` record.
    engine: AtomicU16,
    /// CLOCK's reference bit: set by a hit (and by insertion), cleared by the eviction hand.
    /// Advisory only (Relaxed everywhere): a lost set or clear changes an eviction choice, never
    /// correctness.
    pub(super) referenced: AtomicBool,
}

impl PageRecord {
    /// The current state word (Acquire: pairs with the owner's Release publish/end, so a
    /// `CACHED` word read here makes the fields it covers visible).
    #[inline]
    pub(super) fn state(&self) -> u64 {
        self.state.load(Ordering::Acquire)
    }

    /// A consistent snapshot if the record is `CACHED`, else `None`.
    #[inline]
    pub(super) fn read(&self) -> Option<Snapshot> {
        let s1 = self.state.load(Ordering::Acquire);
        if phase(s1) != CACHED {
            return None;
        }
        let hash = BlockHash {
            lo: self.hash_lo.load(Ordering::Relaxed),
            hi: self.hash_hi.load(Ordering::Relaxed),
        };
        let engine = EngineId(self.engine.load(Ordering::Relaxed));
        // Orders the field loads above before the re-check below (seqlock reader side).
        fence(Ordering::Acquire);
        let s2 = self.state.load(Ordering::Relaxed);
        (s1 == s2).then_some(Snapshot {
            state: s1,
            hash,
            engine,
        })
    }

    /// Takes ownership if the record is `VACANT`; otherwise returns the state seen.
    #[inline]
    pub(super) fn begin_vacant(&self) -> Result<Busy, u64> {
        let cur = self.state.load(Ordering::Acquire);
        if phase(cur) != VACANT {
            return Err(cur);
        }
        self.begin_from(cur).map_err(|_| self.state())
    }

    /// Takes ownership if the state word is still exactly `expected` (read earlier).
    #[inline]
    pub(super) fn begin_from(&self, expected: u64) -> Result<Busy, ()> {
        self.begin_as(expected, BUSY)
    }

    /// Takes ownership of a `CACHED` record whose state word is still exactly `expected`, into
    /// `EVICTING`: the cache keeps its reference until the owner ends or republishes.
    #[inline]
    pub(super) fn begin_evicting(&self, expected: u64) -> Result<Busy, ()> {
        debug_assert_eq!(phase(expected), CACHED);
        self.begin_as(expected, EVICTING)
    }

    #[inline]
    fn begin_as(&self, expected: u64, owned: u64) -> Result<Busy, ()> {
        let busy = next(expected, generation(expected), owned);
        // Acquire: the previous owner's writes, which ours must follow (our Relaxed field
        // stores must come after theirs in modification order, or a reader synchronised with
        // our publish could read their hash under our state word). Every caller's `expected`
        // came from an Acquire load of this same word, which already does it, so weakening
        // either alone is safe; loom cannot show the pair is needed: it orders an atomic's
        // stores as it runs them.
        self.state
            .compare_exchange(expected, busy, Ordering::AcqRel, Ordering::Relaxed)
            .map_err(|_| ())?;
        // Seqlock writer side: the owner's field stores are Relaxed, and the CAS's release half
        // orders only what came before it. This fence pairs with the reader's Acquire fence in
        // `read`: a reader that sees any field this owner writes next then sees this state word
        // (or a later one) at its re-check, so its snapshot fails instead of pairing new fields
        // with the old word (loom `a_snapshot_never_pairs_new_fields_with_the_old_state`).
        fence(Ordering::Release);
        Ok(Busy(busy))
    }

    /// Writes the fields and publishes `CACHED` for generation `gen`.
    #[inline]
    pub(super) fn publish(&self, busy: Busy, gen: u32, hash: BlockHash, engine: EngineId) {
        // Relaxed: the Release store below publishes them; no reader uses them before a
        // matching Acquire load of that store.
        self.hash_lo.store(hash.lo, Ordering::Relaxed);
        self.hash_hi.store(hash.hi, Ordering::Relaxed);
        self.engine.store(engine.0, Ordering::Relaxed);
        self.referenced.store(true, Ordering::Relaxed);
        // Release pairs with readers' Acquire load of `state` (see `read`).
        self.state
            .store(next(busy.0, gen, CACHED), Ordering::Release);
    }

    /// Gives up ownership, leaving the record `VACANT`.
    #[inline]
    pub(super) fn end(&self, busy: Busy) {
        // Release: a later owner's Acquire CAS sees everything this owner did (slot removal).
        self.state
            .store(next(busy.0, generation(busy.0), VACANT), Ordering::Release);
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    /// The seqlock's reader against an owner that takes a `CACHED` record and republishes it
    /// with another hash: a snapshot under the old state word must hold the old fields. The
    /// owner's field stores are Relaxed, so only a Release fence after its CAS (pairing with
    /// the reader's Acquire fence) makes a reader that saw a new field see the taken state.
    #[test]
    fn a_snapshot_never_pairs_new_fields_with_the_old_state() {
        loom::model(|| {
            let rec = Arc::new(PageRecord::default());
            let old_hash = BlockHash { lo: 1, hi: 1 };
            let busy = rec.begin_vacant().unwrap();
            rec.publish(busy, 1, old_hash, EngineId(0));
            let old = rec.state();
            let owner = {
                let rec = rec.clone();
                loom::thread::spawn(move || {
                    let busy = rec.begin_from(old).unwrap();
                    rec.publish(busy, 1, BlockHash { lo: 2, hi: 2 }, EngineId(0));
                })
            };
            if let Some(s) = rec.read() {
                assert!(
                    s.state != old || s.hash == old_hash,
                    "a snapshot under the old state word holds new fields: {s:?}"
                );
            }
            owner.join().unwrap();
        });
    }
}
