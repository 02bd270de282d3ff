//! Per-engine counters and the optional event sink.

use crate::block::{BlockId, EngineId};
use crate::sync::{AtomicU64, Ordering};

use super::hash::BlockHash;

/// One engine's counters. Relaxed, except the two removal counters that [`cached`] pairs with
/// `inserts` (see there): eviction decisions are taken on that count.
///
/// [`cached`]: EngineCounters::cached
#[derive(Debug, Default)]
pub(super) struct EngineCounters {
    pub(super) lookups: AtomicU64,
    pub(super) lookup_tokens: AtomicU64,
    pub(super) hit_blocks: AtomicU64,
    pub(super) hit_tokens: AtomicU64,
    pub(super) inserts: AtomicU64,
    pub(super) evictions: AtomicU64,
    pub(super) forgets: AtomicU64,
    /// This engine's CLOCK hand over page indices, taken modulo the page count. 64 bits so it
    /// never wraps in practice: a `u32` wrapped after 2^32 positions, and unless the page count
    /// divides 2^32 the positions then jump, so "two sweeps' worth of positions" saw some
    /// pages only once (a referenced cached-free page was passed and never taken).
    pub(super) hand: AtomicU64,
}

#[inline]
pub(super) fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Counts a removal (`evictions` or `forgets`) once the page has left the cache. Release: a
/// reader of [`EngineCounters::cached`] that sees this removal sees the page's insert too (the
/// remover read the record the inserter published after counting its insert). The Release
/// fence the remover issued on taking the record (`PageRecord::begin_as`) already orders that
/// insert before a Relaxed add, so loom passes with this one Relaxed and fails only when both
/// go; this keeps the pairing visible here.
#[inline]
pub(super) fn bump_removal(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Release);
}

impl EngineCounters {
    /// Pages cached for this engine: inserts minus removals (every removal is counted as an
    /// eviction or a forget), so no counter of its own is updated on insert and removal.
    /// Exact when no insert or removal is in flight; never below the pages whose insert
    /// happened before this call and whose removal did not.
    ///
    /// The removals are loaded first, Acquire (pairing with [`bump_removal`]), and the inserts
    /// after: every removal read brings its page's insert into view, so the difference counts
    /// at least the pages cached before this call. With Relaxed loads a removal of a page
    /// inserted by a thread this one has not synchronised with could be read without that
    /// insert, cancelling a page this thread knows is cached: `cached` read 0, eviction skipped
    /// the engine and an allocation failed while a cached-free page stood (loom
    /// `an_evictor_finds_a_page_cached_before_it_despite_a_concurrent_forget`).
    pub(super) fn cached(&self) -> u32 {
        self.changes().3
    }

    /// `(inserts, evictions, forgets, cached)`, loaded as [`cached`](Self::cached) explains:
    /// removals first (Acquire), inserts after, so `inserts >= evictions + forgets` and
    /// `cached` is their difference.
    fn changes(&self) -> (u64, u64, u64, u32) {
        let evictions = self.evictions.load(Ordering::Acquire);
        let forgets = self.forgets.load(Ordering::Acquire);
        let inserts = self.inserts.load(Ordering::Relaxed);
        // Saturating only as a guard: by the above, `inserts >= evictions + forgets`.
        let cached = inserts.saturating_sub(evictions + forgets) as u32;
        (inserts, evictions, forgets, cached)
    }

    pub(super) fn read(&self) -> PrefixMetrics {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let (inserts, evictions, forgets, cached) = self.changes();
        PrefixMetrics {
            lookups: r(&self.lookups),
            lookup_tokens: r(&self.lookup_tokens),
            hit_blocks: r(&self.hit_blocks),
            hit_tokens: r(&self.hit_tokens),
            inserts,
            evictions,
            forgets,
            cached,
        }
    }
}

/// One engine's prefix-cache figures, from [`PrefixCache::metrics`](super::PrefixCache::metrics).
///
/// They count calls of [`lookup`](super::PrefixCache::lookup): `hit_tokens / lookup_tokens` is
/// the hit rate of lookups, not of prompts. A [`Batcher`](crate::sched::Batcher) looks up a
/// waiting sequence's prefix on every step it tries to admit it, so a sequence that waits for
/// pages is counted once per failed admission, hit and presented tokens alike; it presents
/// only the full blocks of all but the last token (short prompts make no lookup at all); and
/// it looks up again after a preemption by recompute, generated tokens included. For an
/// engine's hit rate over prompt tokens use its
/// [`BatcherStats`](crate::sched::BatcherStats): `prefix_hit_tokens / prefix_prompt_tokens`
/// (each prompt counted once, on its first admission).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixMetrics {
    /// Lookups made (every call, a batcher's repeated ones for a waiting sequence included).
    pub lookups: u64,
    /// Tokens those lookups presented (full blocks and any partial tail the caller passed; a
    /// batcher passes full blocks only).
    pub lookup_tokens: u64,
    /// Blocks found (each handed out with a reference).
    pub hit_blocks: u64,
    /// Tokens in those blocks: prefill the engine skips.
    pub hit_tokens: u64,
    /// Pages inserted.
    pub inserts: u64,
    /// Pages evicted (by [`evict`](super::PrefixCache::evict) and its relatives, and
    /// [`clear`](super::PrefixCache::clear)).
    pub evictions: u64,
    /// Pages removed by [`forget`](super::PrefixCache::forget).
    pub forgets: u64,
    /// Pages cached for the engine now: `inserts - evictions - forgets` of this snapshot
    /// (whose removals are never read ahead of their pages' inserts).
    pub cached: u32,
}

/// A change in what the cache holds, for a KV-aware router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheEvent {
    /// `page` now holds `hash` for `engine`.
    Stored {
        /// The engine.
        engine: EngineId,
        /// The block's chained hash.
        hash: BlockHash,
        /// The page.
        page: BlockId,
    },
    /// `page` no longer holds `hash` (evicted or forgotten).
    Removed {
        /// The engine.
        engine: EngineId,
        /// The block's chained hash.
        hash: BlockHash,
        /// The page.
        page: BlockId,
    },
}

/// Where the cache sends [`CacheEvent`]s. `offer` is called on the inserting / evicting thread
/// and must not block: a bounded sink that is full drops the event and returns `false` (the
/// cache counts drops; see [`PrefixCache::events_dropped`](super::PrefixCache::events_dropped)).
///
/// A page's events are offered in the order they happen (its Stored before the Removed of that
/// content, a Removed before the page's next Stored), so a mirror keyed by page stays right;
/// events of different pages interleave. `offer` runs while the cache holds the page's record
/// (lookups of that page miss meanwhile): keep it short.
pub trait EventSink: Send + Sync {
    /// Hands over one event without blocking; `false` if it was dropped.
    fn offer(&self, event: CacheEvent) -> bool;
}

/// std's bounded channel as a sink: `try_send`, dropping when full or disconnected. (std's
/// bounded channel is crossbeam's array channel: `try_send` takes no lock unless a receiver is
/// parked in `recv`, when it wakes it under a short internal lock.)
impl EventSink for std::sync::mpsc::SyncSender<CacheEvent> {
    fn offer(&self, event: CacheEvent) -> bool {
        self.try_send(event).is_ok()
    }
}
