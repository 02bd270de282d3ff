//! Per-engine counters and the optional event sink.

use crate::block::{BlockId, EngineId};
use crate::sync::{AtomicU64, Ordering};

use super::hash::BlockHash;

/// One engine's counters. Relaxed everywhere: statistics, publishing no memory.
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

impl EngineCounters {
    /// Pages cached for this engine: inserts minus removals (every removal is counted as an
    /// eviction or a forget), so no counter of its own is updated on insert and removal.
    /// Exact when no insert or removal is in flight.
    pub(super) fn cached(&self) -> u32 {
        // Saturating: the Relaxed loads of different counters may pair a removal with an
        // insert not yet visible; that reads as fewer cached pages for an instant, never as a
        // wrapped count.
        let removed = self.evictions.load(Ordering::Relaxed) + self.forgets.load(Ordering::Relaxed);
        let inserted = self.inserts.load(Ordering::Relaxed);
        inserted.saturating_sub(removed) as u32
    }

    pub(super) fn read(&self) -> PrefixMetrics {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        PrefixMetrics {
            lookups: r(&self.lookups),
            lookup_tokens: r(&self.lookup_tokens),
            hit_blocks: r(&self.hit_blocks),
            hit_tokens: r(&self.hit_tokens),
            inserts: r(&self.inserts),
            evictions: r(&self.evictions),
            forgets: r(&self.forgets),
            cached: self.cached(),
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
    /// Pages cached for the engine now.
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
