//! [`PrefixCache`]: lookups, inserts and forgets over the slot table and page records.

use std::ops::ControlFlow;

use crate::block::{BlockId, BlockPool, EngineId};
use crate::sync::{fence, Arc, Backoff, CachePadded, Ordering};

use super::error::PrefixError;
use super::hash::{BlockHash, BlockHasher, PrefixKey};
use super::index::SlotTable;
use super::metrics::{bump, bump_removal, CacheEvent, EngineCounters, EventSink, PrefixMetrics};
use super::record::{generation, phase, Busy, PageRecord, Snapshot, CACHED, EVICTING, VACANT};

/// How a cache is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixConfig {
    /// The hasher's seed; `None` draws a secret one (see [`BlockHasher::random`]). Fix it to
    /// share hashes with a router, or for reproducible tests.
    pub seed: Option<u64>,
}

/// What a lookup found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixHit {
    /// Full blocks matched from the start of the tokens; their ids were appended to `out`.
    pub blocks: usize,
    /// Tokens in those blocks (`blocks * block_tokens`): the prefill the caller may skip.
    pub tokens: usize,
    /// The hash of the last matched block, or the root when none matched: the parent of the
    /// caller's next full block (see [`BlockHasher::block`]).
    pub parent: BlockHash,
    /// Of those blocks, the pages no one but the cache referenced when this lookup took its
    /// reference (cached-free pages coming back into use). Counted at the reference itself,
    /// which a count read afterwards is not: other holders may have come or gone since.
    pub revived: usize,
}

/// What an insert did. Only `Inserted` takes a reference; the others leave the pool as it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inserted {
    /// The page is now cached under the hash; the cache took one reference to it.
    Inserted,
    /// The page already held this hash (e.g. inserted by a fork sharing it).
    AlreadyCached,
    /// Another page already holds this hash; the caller's page stays uncached (its KV is
    /// identical, so nothing is lost but the duplicate's memory once the caller frees it).
    /// Two racing inserts of one hash on two pages may both succeed instead, which is
    /// harmless: both pages hold the right KV and each is evicted on its own.
    Duplicate,
    /// Another thread is inserting or evicting this page right now; not cached.
    Busy,
    /// The hash's probe window is full (vanishingly rare at the table's load of at most 1/2);
    /// not cached.
    NoRoom,
}

/// The prefix cache of one block pool: a lock-free map from chained block hashes to pages
/// (see the [module docs](super) for the protocol), holding one pool reference per cached page.
pub struct PrefixCache {
    pool: Arc<BlockPool>,
    hasher: BlockHasher,
    slots: SlotTable,
    /// One record per page, indexed by page.
    records: Box<[PageRecord]>,
    /// Per engine, indexed by engine id.
    counters: Box<[CachePadded<EngineCounters>]>,
    events: Option<Box<dyn EventSink>>,
    events_dropped: CachePadded<crate::sync::AtomicU64>,
    /// Whether a lookup re-checks the record after taking its reference. Always on, except in
    /// the loom model that shows the check is needed.
    validate: bool,
}

impl std::fmt::Debug for PrefixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixCache")
            .field("pages", &self.records.len())
            .field("slots", &self.slots.capacity())
            .field("cached", &self.cached_total())
            .field("events", &self.events.is_some())
            .finish_non_exhaustive()
    }
}

impl PrefixCache {
    /// A cache over every page of `pool`, with nothing cached.
    pub fn new(pool: Arc<BlockPool>, config: PrefixConfig) -> Self {
        let pages = pool.total();
        Self {
            hasher: config
                .seed
                .map_or_else(BlockHasher::random, BlockHasher::with_seed),
            slots: SlotTable::new(pages),
            records: (0..pages).map(|_| PageRecord::default()).collect(),
            counters: (0..pool.max_engines())
                .map(|_| CachePadded::new(EngineCounters::default()))
                .collect(),
            events: None,
            events_dropped: CachePadded::new(crate::sync::AtomicU64::new(0)),
            validate: true,
            pool,
        }
    }

    /// Sends a [`CacheEvent`] to `sink` for every page stored and removed from now on.
    pub fn with_events(mut self, sink: Box<dyn EventSink>) -> Self {
        self.events = Some(sink);
        self
    }

    /// Turns off the re-check that makes stale hits impossible. Exists only under loom, for the
    /// model that shows the check is needed (tests/loom/prefix.rs).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn without_validation(mut self) -> Self {
        self.validate = false;
        self
    }

    /// `LIVE` entries in the slot table: one per cached page when no insert or removal is in
    /// flight. Exists only under loom, where the models check it at their end (a removal that
    /// missed its entry leaves one behind, which nothing else observes).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn live_slots(&self) -> usize {
        self.slots.live()
    }

    /// The pool whose pages this cache holds.
    pub fn pool(&self) -> &Arc<BlockPool> {
        &self.pool
    }

    /// The hasher every lookup uses; callers hash the blocks they insert with it.
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// Events the sink refused (full or disconnected).
    pub fn events_dropped(&self) -> u64 {
        self.events_dropped.load(Ordering::Relaxed)
    }

    pub(super) fn check_engine(&self, engine: EngineId) -> Result<&EngineCounters, PrefixError> {
        self.counters
            .get(engine.index())
            .map(|c| &**c)
            .ok_or(PrefixError::UnknownEngine {
                engine,
                max_engines: self.counters.len() as u16,
            })
    }

    pub(super) fn records(&self) -> &[PageRecord] {
        &self.records
    }

    pub(super) fn counters(&self) -> &[CachePadded<EngineCounters>] {
        &self.counters
    }

    /// The id of `page` at the generation in `state`.
    #[inline]
    pub(super) fn id_at(&self, page: usize, state: u64) -> BlockId {
        BlockId::pack(self.pool.tag(), generation(state), page as u32)
    }

    /// Finds the longest cached prefix of `tokens` under `key`, in full blocks, and appends
    /// the pages to `out`, each with one pool reference taken for the caller (release them like
    /// any other reference, e.g. by pushing them into the sequence's block table). A partial
    /// last block is never matched. Never blocks: a page being inserted or evicted right now
    /// counts as a miss.
    ///
    /// Every returned page held the block's hash, for `key.engine`, at an instant after the
    /// caller's reference was taken, so its KV is that block's (module docs, "No stale hit").
    ///
    /// The references it takes are real pool references: while a caller other than the
    /// engine's batcher holds them (a router probing a live engine's key), the batcher's page
    /// counts for its budget (which pages leave it when a sequence drops them) see one holder
    /// too many. A router that only predicts hits should use [`PrefixCache::contains`].
    pub fn lookup(
        &self,
        key: &PrefixKey,
        tokens: &[u32],
        out: &mut Vec<BlockId>,
    ) -> Result<PrefixHit, PrefixError> {
        let counters = self.check_engine(key.engine)?;
        if key.block_tokens == 0 {
            return Err(PrefixError::ZeroBlockTokens);
        }
        bump(&counters.lookups, 1);
        bump(&counters.lookup_tokens, tokens.len() as u64);
        let mut parent = self.hasher.root(key);
        let (mut blocks, mut revived) = (0, 0);
        for block in tokens.chunks_exact(key.block_tokens as usize) {
            let hash = self.hasher.block(parent, block);
            let Some((id, prior)) = self.take(key.engine, hash) else {
                break;
            };
            out.push(id);
            parent = hash;
            blocks += 1;
            revived += usize::from(prior == 1);
        }
        let hit_tokens = blocks * key.block_tokens as usize;
        bump(&counters.hit_blocks, blocks as u64);
        bump(&counters.hit_tokens, hit_tokens as u64);
        Ok(PrefixHit {
            blocks,
            tokens: hit_tokens,
            parent,
            revived,
        })
    }

    /// Whether `hash` is cached for `engine` right now (no reference taken; for tests, routers
    /// and metrics).
    pub fn contains(&self, engine: EngineId, hash: BlockHash) -> bool {
        self.find(engine, hash).is_some()
    }

    /// What [`lookup`](Self::lookup) would find for `tokens` under `key` right now, without
    /// taking a reference or counting a lookup in the metrics: the longest cached prefix in
    /// full blocks and, in `revived`, how many of its pages no one but the cache references
    /// (a lookup would bring them back into use). For estimates only (a batcher's pages
    /// wanted by a waiting request): another thread may insert, evict or take a page
    /// between this and a lookup.
    pub fn peek(&self, key: &PrefixKey, tokens: &[u32]) -> Result<PrefixHit, PrefixError> {
        self.check_engine(key.engine)?;
        if key.block_tokens == 0 {
            return Err(PrefixError::ZeroBlockTokens);
        }
        let mut parent = self.hasher.root(key);
        let (mut blocks, mut revived) = (0, 0);
        for block in tokens.chunks_exact(key.block_tokens as usize) {
            let hash = self.hasher.block(parent, block);
            let Some((page, snap)) = self.find(key.engine, hash) else {
                break;
            };
            // The cache's own reference only: a lookup's would be the second.
            let count = self.pool.ref_count(self.id_at(page, snap.state));
            let Ok(count) = count else {
                // Freed since the record was read: a lookup would miss it too.
                break;
            };
            parent = hash;
            blocks += 1;
            revived += usize::from(count == 1);
        }
        Ok(PrefixHit {
            blocks,
            tokens: blocks * key.block_tokens as usize,
            parent,
            revived,
        })
    }

    /// The page and snapshot holding `hash` for `engine`, if any (no reference taken).
    fn find(&self, engine: EngineId, hash: BlockHash) -> Option<(usize, Snapshot)> {
        self.slots.probe(hash, |page| {
            let page = page as usize;
            match self.records.get(page).and_then(PageRecord::read) {
                Some(s) if s.hash == hash && s.engine == engine => ControlFlow::Break((page, s)),
                _ => ControlFlow::Continue(()),
            }
        })
    }

    /// Takes a reference to the page holding `hash` for `engine`; returns it with the page's
    /// reference count just before (the cache's own included: a validated hit took its
    /// reference while the record, and so the cache's reference, stood).
    ///
    /// The three steps, and why each is needed:
    /// 1. a consistent snapshot of the page's record says it holds `hash` at generation `g`;
    /// 2. `pool.share(page, g)` takes a reference, refused if the page was freed (or freed and
    ///    reallocated: generation) since step 1;
    /// 3. the record's state word is re-read and must equal step 1's: otherwise the page left
    ///    the cache (or changed hash) in between, and the reference is given back.
    ///
    /// Step 3 is what excludes a page that stayed allocated but was forgotten and rewritten
    /// (same generation): the rewriter releases the cache's reference (an AcqRel RMW on the
    /// page's pool word) *after* leaving `CACHED`, and checks that it holds the only reference
    /// before writing. Our `share` is an RMW on the same word: if it comes after that release,
    /// it synchronises with it and step 3 sees the new state; if before, the rewriter sees our
    /// reference and must copy instead of writing in place.
    fn take(&self, engine: EngineId, hash: BlockHash) -> Option<(BlockId, u32)> {
        self.slots.probe(hash, |page| {
            let page = page as usize;
            let Some(rec) = self.records.get(page) else {
                return ControlFlow::Continue(());
            };
            match rec.read() {
                Some(s) if s.hash == hash && s.engine == engine => {
                    let id = self.id_at(page, s.state);
                    let Ok(prior) = self.pool.share_counted(id) else {
                        return ControlFlow::Continue(());
                    };
                    // Between our reference and the re-read, as evict_one has between taking
                    // the record and reading the count: of the two threads, at least one sees
                    // the other (the lookup the EVICTING record, or the eviction our reference).
                    fence(Ordering::SeqCst);
                    if self.validate && rec.state() != s.state {
                        // Our own reference: the release cannot be refused. If it was the last
                        // one (an eviction dropped the cache's meanwhile), the page is freed
                        // here, which is what that eviction wanted.
                        let released = self.pool.release(id);
                        invariant!(released.is_ok(), "{released:?}");
                        return ControlFlow::Continue(());
                    }
                    // CLOCK's touch: no read-modify-write on the hit path, and no write at all
                    // when the bit is already set, so threads hitting one hot page do not
                    // bounce its record's cache line between them.
                    if !rec.referenced.load(Ordering::Relaxed) {
                        rec.referenced.store(true, Ordering::Relaxed);
                    }
                    ControlFlow::Break((id, prior))
                }
                _ => ControlFlow::Continue(()),
            }
        })
    }

    /// Caches `id` (a full block the caller holds a reference to) under `hash` for `engine`.
    /// On [`Inserted::Inserted`] the cache takes its own reference, so the page stays cached
    /// when the caller's table drops it ("cached-free") until evicted.
    ///
    /// The caller must have computed `hash` with [`hasher`](Self::hasher) under a key whose
    /// engine is `engine`, over the tokens whose KV the page holds, and must not write the
    /// page again while it is cached (a shared page is copied before writing; or
    /// [`forget`](Self::forget) it first).
    ///
    /// # Errors
    /// [`PrefixError::UnknownEngine`]; [`PrefixError::Pool`] for an id the pool refuses;
    /// [`PrefixError::NotOwner`] for a page another engine allocated (a page is cached only
    /// for its owner, whose budget it returns to when evicted);
    /// [`PrefixError::PageOfOtherEngine`] / [`PrefixError::PageHoldsOtherHash`] for a page
    /// already cached for another engine or under another hash. Nothing changes on error.
    pub fn insert(
        &self,
        engine: EngineId,
        hash: BlockHash,
        id: BlockId,
    ) -> Result<Inserted, PrefixError> {
        let counters = self.check_engine(engine)?;
        // Validates the id (pool, range, live generation) and takes the cache's reference
        // before anything is published.
        self.pool.share(id)?;
        // Cannot fail while our reference keeps the id's generation live; refused cleanly if
        // it did.
        let owner = match self.pool.owner(id) {
            Ok(owner) => owner,
            Err(e) => {
                self.give_back(id);
                return Err(e.into());
            }
        };
        let page = id.index() as usize;
        let rec = &self.records[page];
        let busy = match rec.begin_vacant() {
            Ok(busy) => busy,
            Err(state) => {
                self.give_back(id);
                // VACANT again: another insert of this page came and went between our load and
                // our CAS. Either way someone else is at it right now.
                if phase(state) != CACHED {
                    return Ok(Inserted::Busy);
                }
                return match rec.read() {
                    Some(s) if s.engine != engine => Err(PrefixError::PageOfOtherEngine {
                        id,
                        cached_for: s.engine,
                        engine,
                    }),
                    Some(s) if s.hash == hash => Ok(Inserted::AlreadyCached),
                    Some(_) => Err(PrefixError::PageHoldsOtherHash { id }),
                    // It changed under us: someone is removing it.
                    None => Ok(Inserted::Busy),
                };
            }
        };
        // A page is cached for the engine that allocated it: eviction gives it back to that
        // engine's budget and `usage` counts it there.
        if owner != engine {
            rec.end(busy);
            self.give_back(id);
            return Err(PrefixError::NotOwner { id, owner, engine });
        }
        if self.find(engine, hash).is_some() {
            rec.end(busy);
            self.give_back(id);
            return Ok(Inserted::Duplicate);
        }
        if !self.slots.claim(hash, page as u32) {
            rec.end(busy);
            self.give_back(id);
            return Ok(Inserted::NoRoom);
        }
        // Counted and reported before the record is published: from the publish on, a forget
        // or an eviction can remove the page and report that, and a sink must see a page's
        // events in the order they happened (a mirror keyed by page keeps the last one).
        bump(&counters.inserts, 1);
        self.emit(CacheEvent::Stored {
            engine,
            hash,
            page: id,
        });
        rec.publish(busy, id.generation(), hash, engine);
        Ok(Inserted::Inserted)
    }

    /// Drops a reference this cache took (cannot be refused: the cache holds it).
    #[inline]
    fn give_back(&self, id: BlockId) -> bool {
        let r = self.pool.release(id);
        invariant!(r.is_ok(), "the cache's own reference was refused: {r:?}");
        r.unwrap_or(false)
    }

    /// Removes `id`'s page from the cache if it is cached at `id`'s generation, dropping the
    /// cache's reference. Returns whether this call removed it (`false`: not cached, or another
    /// thread holds its record right now: removing it, or an eviction that will put it back
    /// because someone else holds the page too).
    ///
    /// Call it before rewriting a page that may be cached. After `true`, no lookup can hand the
    /// page out under its old hash. After `false` the page may still be cached: an eviction
    /// checking it right now sees the caller's reference and puts it back. Either way, if
    /// [`BlockPool::is_shared`] is then `false`, the page is not cached (the cache would hold
    /// a reference of its own), the caller holds the only reference and may write in place;
    /// otherwise it must copy.
    pub fn forget(&self, id: BlockId) -> Result<bool, PrefixError> {
        // Validates the id (and that it is live).
        self.pool.ref_count(id)?;
        let page = id.index() as usize;
        let Some(s) = self.records[page].read() else {
            return Ok(false);
        };
        if generation(s.state) != id.generation() {
            return Ok(false);
        }
        let removed = self.uncache(page, s).is_some();
        if removed {
            bump_removal(&self.counters[s.engine.index()].forgets);
        }
        Ok(removed)
    }

    /// Removes `page` from the cache if its record still is exactly `s`. Returns whether the
    /// page went back to the free list, or `None` if the record changed first.
    pub(super) fn uncache(&self, page: usize, s: Snapshot) -> Option<bool> {
        let busy = self.records[page].begin_from(s.state).ok()?;
        Some(self.remove_owned(page, s, busy))
    }

    /// Finishes removing `page`, whose record this caller took from `s` to `busy`: the slot,
    /// the record back to VACANT, the cache's reference. Returns whether the page went back to
    /// the free list.
    pub(super) fn remove_owned(&self, page: usize, s: Snapshot, busy: Busy) -> bool {
        let rec = &self.records[page];
        let found = self.slots.remove(s.hash, page as u32);
        invariant!(found, "a CACHED page had no slot");
        let id = self.id_at(page, s.state);
        // Reported while this caller holds the record: once it is VACANT (and the page free)
        // the page can be cached again, and its Stored must not overtake this Removed.
        self.emit(CacheEvent::Removed {
            engine: s.engine,
            hash: s.hash,
            page: id,
        });
        rec.end(busy);
        // After the record left CACHED (Release store above): see `take`, step 3.
        self.give_back(id)
    }

    fn emit(&self, event: CacheEvent) {
        if let Some(sink) = &self.events {
            if !sink.offer(event) {
                self.events_dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Pages cached for `engine` (in use by sequences or not). 0 for an unknown engine.
    pub fn cached(&self, engine: EngineId) -> u32 {
        self.counters.get(engine.index()).map_or(0, |c| c.cached())
    }

    /// Pages cached for all engines.
    pub fn cached_total(&self) -> u32 {
        self.counters.iter().map(|c| c.cached()).sum()
    }

    /// `engine`'s counters (all zero for an unknown engine).
    pub fn metrics(&self, engine: EngineId) -> PrefixMetrics {
        self.counters
            .get(engine.index())
            .map(|c| c.read())
            .unwrap_or_default()
    }

    /// Whether `id`'s page is cached at `id`'s generation right now: whether the cache holds a
    /// pool reference to it. True too while an eviction is checking the page (its record
    /// `EVICTING`): the cache still holds its reference then, and keeps it if anyone else holds
    /// the page (the batcher's budget relies on this for the pages its sequences hold).
    pub fn is_cached(&self, id: BlockId) -> bool {
        id.pool_tag() == self.pool.tag()
            && self.records.get(id.index() as usize).is_some_and(|rec| {
                // The generation is part of the state word: one load is a consistent view.
                let state = rec.state();
                matches!(phase(state), CACHED | EVICTING) && generation(state) == id.generation()
            })
    }

    /// Removes every cached page that no one else holds (cached-free). Returns how many were
    /// removed. Pages in use by a sequence stay cached: dropping the cache's reference from
    /// under a holder would change the counts its engine's budget is kept by (see
    /// [`lookup`](Self::lookup) on charging hits); call again once they are released, or see
    /// [`cached_total`](Self::cached_total) for what is left. Safe while engines run.
    pub fn clear(&self) -> u32 {
        self.clear_where(|_| true)
    }

    /// [`clear`](Self::clear) for the pages cached for `engine`. For an engine that leaves,
    /// after its sequences released their pages: its id may go to the next engine registered,
    /// another model whose lookups must not find these pages.
    pub fn clear_engine(&self, engine: EngineId) -> u32 {
        self.clear_where(|e| e == engine)
    }

    /// Removes every page cached for `engine`, *including* pages others hold (their holders
    /// keep their own references; such a page is freed when the last of them lets go). Returns
    /// how many were removed. For an engine id whose engine has left, before the id serves
    /// another model: the keys hold the engine id, not the model, so a page that merely stayed
    /// cached because a router's [`lookup`](Self::lookup) held it at the wrong instant would
    /// hand the old model's KV to the next one. Not for an engine that still runs: its budget
    /// counts the pages its sequences hold by whether the cache holds them too
    /// ([`clear_engine`](Self::clear_engine) is the one for that).
    ///
    /// A page whose record another thread owns at that instant (an eviction checking it, a
    /// forget) is waited for, with backoff, until its owner ends or republishes: those owners
    /// never wait themselves, so this takes a bounded number of their steps.
    pub fn purge_engine(&self, engine: EngineId) -> u32 {
        let Ok(counters) = self.check_engine(engine) else {
            return 0;
        };
        let mut n = 0;
        for (page, rec) in self.records.iter().enumerate() {
            let backoff = Backoff::new();
            loop {
                let removed = match rec.read() {
                    Some(s) if s.engine == engine => self.uncache(page, s).is_some(),
                    Some(_) => break,
                    // Not cached; or a snapshot torn by a change, or an owner at work: look
                    // again once it is done.
                    None if phase(rec.state()) == VACANT => break,
                    None => false,
                };
                if removed {
                    bump_removal(&counters.evictions);
                    n += 1;
                    break;
                }
                backoff.snooze();
            }
        }
        n
    }

    fn clear_where(&self, of: impl Fn(EngineId) -> bool) -> u32 {
        let mut n = 0;
        for page in 0..self.records.len() {
            if let Some(s) = self.records[page].read().filter(|s| of(s.engine)) {
                if self.uncache_unheld(page, s) {
                    bump_removal(&self.counters[s.engine.index()].evictions);
                    n += 1;
                }
            }
        }
        n
    }

    /// Removes `page` if its record still is exactly `s` and the cache holds the only
    /// reference. Returns whether it did (the page goes back to the free list here, or with the
    /// release of a lookup that shared it meanwhile and then failed its re-check).
    ///
    /// Takes the record, then checks the count again: a lookup may have shared the page since
    /// the first check and validated against the record as it was; removing it then would drop
    /// the cache's reference from under that hit. With SeqCst fences here and in `take`, this
    /// count sees the lookup's reference or the lookup sees the EVICTING record.
    pub(super) fn uncache_unheld(&self, page: usize, s: Snapshot) -> bool {
        let id = self.id_at(page, s.state);
        if self.pool.ref_count(id) != Ok(1) {
            return false;
        }
        let rec = &self.records[page];
        // EVICTING, not BUSY: the cache keeps its reference unless the count below is 1, and
        // `is_cached` must say so meanwhile (the batcher's budget reads it of pages it holds).
        let Ok(busy) = rec.begin_evicting(s.state) else {
            return false;
        };
        fence(Ordering::SeqCst);
        if self.pool.ref_count(id) != Ok(1) {
            rec.publish(busy, generation(s.state), s.hash, s.engine); // as it was
            return false;
        }
        self.remove_owned(page, s, busy);
        true
    }
}

impl Drop for PrefixCache {
    /// Gives back the cache's reference to every cached page, in use or not (their holders
    /// keep their own references). No other thread can reach the cache now.
    fn drop(&mut self) {
        for page in 0..self.records.len() {
            if let Some(s) = self.records[page].read() {
                self.uncache(page, s);
            }
        }
    }
}
