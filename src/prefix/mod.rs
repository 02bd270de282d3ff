//! The prefix cache: reuse of computed KV blocks across requests, on the shared arena.
//!
//! A request's full blocks are named by chained 128-bit hashes ([`hash`]: parent, tokens, and
//! the extra keys engine / adapter / salt at the root). [`PrefixCache`] maps a hash to the page
//! holding that block's KV, for every engine of one [`BlockPool`](crate::block::BlockPool):
//!
//! - **lookup** ([`PrefixCache::lookup`], on admission): the longest cached prefix of a token
//!   sequence in full blocks, each page returned with a pool reference taken for the caller;
//! - **insert** ([`PrefixCache::insert`], on block completion): the cache takes its own
//!   reference, so when the sequence's table later drops the block the page stays cached
//!   ("cached-free") instead of going back to the free list;
//! - **evict** ([`PrefixCache::evict`], [`PrefixCache::evict_by`],
//!   [`PrefixCache::alloc_evicting`]): cached-free pages go back to the pool in CLOCK order,
//!   taken first from the engine most over its weighted share ([`evict`] module docs);
//!   [`PrefixCache::reclaimable`] counts what eviction could free, for the budget to lend;
//! - **forget** ([`PrefixCache::forget`]): before a page that may be cached is rewritten.
//! - **purge** ([`PrefixCache::purge_engine`]): every page of an engine id whose engine left,
//!   held ones too, so that another model registered on the id never hits them.
//!
//! # Concurrency
//!
//! Lookups run on any thread (engine, admission, router) and take no lock; inserts, evictions
//! and forgets may run on several threads too. Two structures, both fixed-size and never
//! reclaimed:
//!
//! - a slot table, open addressing over a bounded probe window of `2 * pages` slots, each slot
//!   one `AtomicU64` (tag, page) claimed by CAS (src/prefix/index.rs);
//! - one record per page: a seqlock'd state machine `VACANT -> BUSY -> CACHED -> BUSY ->
//!   VACANT` (an eviction's check goes `CACHED -> EVICTING -> VACANT`, or back to `CACHED`)
//!   holding the page's full hash, engine and generation (src/prefix/record.rs). A page holds
//!   at most one hash.
//!
//! **Progress.** A lookup does a bounded number of steps (one hash per block, at most 32 slot
//! loads per block, one pool `share` per candidate), plus the pool's lock-free CAS retries: it
//! is lock-free, and wait-free apart from those retries. It never waits for a writer: a page
//! whose record is `BUSY` or `EVICTING` counts as a miss. Inserts and removals never wait
//! either (a record another writer owns makes them give up on that page); an eviction sweep is
//! bounded by two laps. The one exception is [`PrefixCache::purge_engine`], for an engine id
//! whose engine has left: it must not give up on a page, so it waits (with backoff) for a
//! record's owner to finish, a bounded number of that owner's steps; it is not lock-free, and
//! runs only when a batcher is dropped or starts reusing the cache.
//!
//! **No stale hit.** A lookup returns a page only if, *after* taking its pool reference
//! (with the generation its snapshot of the record named), the record still holds the same
//! state word, hence the same hash and engine: eviction and forget leave `CACHED` (and remove
//! the slot) before dropping the cache's reference, so a page is never freed, reallocated or
//! rewritten while a lookup could still accept it. A reallocated page fails the generation
//! check of `share` (up to the 24-bit generation's wrap, see [`BlockId`](crate::block::BlockId)); a
//! page forgotten and rewritten at the same generation fails the state re-check (the argument
//! is on `PrefixCache::take`; the loom model in tests/loom/prefix.rs fails without it).

/// `debug_assert!` that the loom models check too: they run in release builds, without debug
/// assertions, where a broken protocol invariant (a `CACHED` page whose slot entry is gone, the
/// cache's own reference refused) passed silently unless a model observed a consequence of it
/// (a slot claimed by a plain store instead of a CAS lost an entry, and no model failed).
macro_rules! invariant {
    ($($arg:tt)*) => {
        if cfg!(any(debug_assertions, loom)) {
            assert!($($arg)*);
        }
    };
}

pub mod cache;
pub mod error;
pub mod evict;
pub mod hash;
mod index;
pub mod metrics;
mod record;

pub use cache::{Inserted, PrefixCache, PrefixConfig, PrefixHit};
pub use error::PrefixError;
pub use evict::{EngineUsage, MostOverShare, VictimChoice};
pub use hash::{BlockHash, BlockHasher, PrefixKey};
pub use metrics::{CacheEvent, EventSink, PrefixMetrics};
