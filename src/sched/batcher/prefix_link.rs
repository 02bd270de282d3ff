//! The batcher's side of the prefix cache ([`crate::prefix`]): attaching a cached prefix when a
//! sequence is admitted, caching blocks as they complete, budget for pages that come and go
//! from the cache, and eviction when the pool runs dry.
//!
//! # Budget
//!
//! An engine's block budget counts the pages its *sequences* reference (and the pages its
//! swap-outs still read). A page whose last sequence reference goes while the cache still
//! holds it becomes cached-free and leaves the budget, exactly like a page that goes back to
//! the free list: the coordinator sees it as free, so it can be lent. A hit on a cached-free
//! page takes it back into the budget; if the budget refuses, the hit is given up. Pages
//! leave the cache (eviction) without budget changes, which is why eviction can run on any
//! engine's thread.
//!
//! The reference counts read here are exact: every reference to one of this engine's pages
//! belongs to this batcher (its tables and pending swap-outs, all on this thread) or to the
//! cache, and the cache's reference only ever goes from pages no sequence holds (eviction and
//! [`PrefixCache::clear`] skip a page with a second reference; only the cache's drop, when no
//! batcher is left, and [`PrefixCache::purge_engine`], when this engine's batcher is gone or
//! not yet reusing, take it from pages in use).

use super::Batcher;
use crate::block::BlockId;
use crate::prefix::{BlockHash, MostOverShare, PrefixCache, PrefixKey};
use crate::sync::Arc;

/// The prefix cache a batcher shares with the other engines of its pool.
#[derive(Debug)]
pub(super) struct PrefixLink {
    pub(super) cache: Arc<PrefixCache>,
    /// Whether this batcher looks prefixes up and caches its blocks; `false`: it only evicts
    /// the other engines' cached-free pages when the pool runs dry
    /// ([`attach_prefix_cache_for_eviction`](Batcher::attach_prefix_cache_for_eviction)).
    pub(super) reuse: bool,
}

impl Batcher {
    /// Reuses computed KV across requests through `cache` (shared by every engine of this
    /// batcher's pool): on admission a sequence attaches the longest cached prefix of its
    /// tokens (full blocks, at least its last token left to compute), and each block it
    /// completes is cached.
    ///
    /// Attaching the cache already attached again does nothing (or, if it was attached for
    /// eviction only, turns its reuse on).
    ///
    /// When reuse begins, every page cached under this batcher's engine id is uncached: they
    /// are the id's previous engine's (another model, perhaps), kept past that engine's drop
    /// by a holder such as a router's [`lookup`](PrefixCache::lookup). A page such a holder
    /// still holds is uncached too ([`PrefixCache::purge_engine`]; the holder keeps its own
    /// reference): the keys cannot tell the two models apart, so it would be a wrong hit.
    ///
    /// # Errors
    /// [`SchedError::InvalidConfig`](crate::error::SchedError::InvalidConfig) if the cache
    /// serves another pool, or if another cache is already attached: the budget tells the
    /// pages that leave it by asking the attached cache (see the module docs), so pages that
    /// sequences hold in the first cache would never leave it, and the first cache would keep
    /// this engine's pages after the batcher's drop.
    pub fn attach_prefix_cache(
        &mut self,
        cache: Arc<PrefixCache>,
    ) -> Result<(), crate::error::SchedError> {
        self.link_prefix_cache(cache, true)
    }

    /// Attaches `cache` (shared by other engines of this batcher's pool) for eviction only:
    /// this batcher neither looks prefixes up nor caches its blocks, but when the pool runs
    /// dry it evicts the other engines' cached-free pages like a batcher that uses the cache.
    /// Those pages count as free in the budget (see the module docs), so a batcher on a pool
    /// whose cache it cannot evict from would be granted pages by its budget that the pool
    /// never hands out, for as long as the engines that cached them stay idle.
    ///
    /// Attaching the cache already attached (either way) does nothing.
    ///
    /// # Errors
    /// As [`attach_prefix_cache`](Self::attach_prefix_cache).
    pub fn attach_prefix_cache_for_eviction(
        &mut self,
        cache: Arc<PrefixCache>,
    ) -> Result<(), crate::error::SchedError> {
        self.link_prefix_cache(cache, false)
    }

    fn link_prefix_cache(
        &mut self,
        cache: Arc<PrefixCache>,
        reuse: bool,
    ) -> Result<(), crate::error::SchedError> {
        if !Arc::ptr_eq(cache.pool(), &self.pool) {
            return Err(crate::error::SchedError::InvalidConfig(
                "the prefix cache serves another block pool",
            ));
        }
        if let Some(link) = &mut self.prefix {
            if Arc::ptr_eq(&link.cache, &cache) {
                // Reuse only ever switches on: pages this batcher's sequences hold are then
                // cached as they complete, and leave its budget as any cached page does.
                if reuse && !link.reuse {
                    // Eviction only, nothing of this batcher's is cached: see below.
                    link.cache.purge_engine(self.cfg.engine);
                }
                link.reuse |= reuse;
                return Ok(());
            }
            return Err(crate::error::SchedError::InvalidConfig(
                "another prefix cache is already attached",
            ));
        }
        if reuse {
            // Pages cached for this id before this batcher reused the cache are another
            // model's (the id's previous engine), even those a holder (a router's lookup)
            // still holds: the hash keys cannot tell the two models apart. None of this
            // batcher's sequences holds one (it never looked up), so its budget is unaffected.
            cache.purge_engine(self.cfg.engine);
        }
        self.prefix = Some(PrefixLink { cache, reuse });
        Ok(())
    }

    fn prefix_key(&self, salt: u64) -> PrefixKey {
        PrefixKey {
            engine: self.cfg.engine,
            adapter: 0,
            salt,
            block_tokens: self.cfg.block_size,
        }
    }

    /// On admission of a sequence with nothing computed: attaches the cached pages of its
    /// longest cached prefix (at most `tokens - 1` tokens, so the last token is computed and
    /// no cached page is ever written), counts them as computed, and takes budget for those
    /// that were cached-free. Gives the hit up if the budget refuses. Returns the tokens
    /// attached (0: none); [`detach_cached_prefix`](Self::detach_cached_prefix) undoes it if
    /// the admission then fails, [`count_prefix`](Self::count_prefix) counts it once it holds.
    pub(super) fn attach_cached_prefix(&mut self, slot: usize) -> usize {
        let Some(link) = self.prefix.as_ref().filter(|l| l.reuse) else {
            return 0;
        };
        let cache = link.cache.clone();
        let s = self.seq(slot);
        if s.computed != 0 || !s.table.is_empty() {
            return 0;
        }
        let (len, salt) = (s.tokens.len(), s.salt);
        let bs = self.cfg.block_size as usize;
        let blocks = (len - 1) / bs;
        if blocks == 0 {
            return 0;
        }
        let key = self.prefix_key(salt);
        let mut hits = std::mem::take(&mut self.scratch);
        hits.clear();
        let hit = match cache.lookup(&key, &self.seq(slot).tokens[..blocks * bs], &mut hits) {
            Ok(hit) if hit.blocks > 0 => hit,
            _ => {
                self.give_back_pages(&hits);
                hits.clear();
                self.scratch = hits;
                return 0;
            }
        };
        // Pages only the cache held before this lookup come back into the budget (counted by
        // the lookup at each reference it took).
        let revived = hit.revived as u32;
        if revived > 0 {
            if let Some(b) = &self.budget {
                if !b.try_acquire_blocks(revived) {
                    self.give_back_pages(&hits);
                    hits.clear();
                    self.scratch = hits;
                    return 0;
                }
            }
        }
        let s = self.seq_mut(slot);
        for &id in &hits {
            // Cannot fail: the hit is shorter than the sequence, whose longest length was
            // checked against the table's capacity at admission.
            if let Err(e) = s.table.push(id) {
                unreachable!("table capacity checked at admission: {e}");
            }
        }
        s.computed = hit.tokens;
        s.hashed = hit.blocks as u32;
        s.parent = Some(hit.parent);
        hits.clear();
        self.scratch = hits;
        hit.tokens
    }

    /// The pages the admission of the waiting sequence `slot` would take against the budget:
    /// those of its first chunk (`max_prefill_chunk` tokens at most) past the cached prefix
    /// [`attach_cached_prefix`](Self::attach_cached_prefix) would attach, and the attached
    /// pages only the cache holds (they come back into the budget); a cached page another
    /// sequence holds costs nothing. The prefix is looked up without a reference
    /// ([`PrefixCache::peek`](crate::prefix::PrefixCache::peek)): the cache, its metrics and
    /// the budget stay as they were. O(the prompt's full blocks) with a cache attached.
    pub(super) fn admission_pages(&self, slot: usize) -> u32 {
        let s = self.seq(slot);
        let len = s.tokens.len();
        let bs = self.cfg.block_size as usize;
        let chunk = self.cfg.max_prefill_chunk as usize;
        let (hit, revived) = match self.prefix.as_ref().filter(|l| l.reuse) {
            Some(link) if s.computed == 0 && s.table.is_empty() && len > bs => {
                let blocks = (len - 1) / bs;
                let key = self.prefix_key(s.salt);
                match link.cache.peek(&key, &s.tokens[..blocks * bs]) {
                    Ok(hit) => (hit.tokens, hit.revived),
                    Err(_) => (0, 0),
                }
            }
            _ => (0, 0),
        };
        let start = s.computed + hit;
        let n = (len - start).min(chunk);
        let new = self.blocks_for(start + n) - self.blocks_for(start);
        (new + revived) as u32
    }

    /// Undoes [`attach_cached_prefix`](Self::attach_cached_prefix) for a sequence that stays
    /// waiting (no token budget or no pages for the rest of it): a waiting sequence holds no
    /// pages, or two such sequences could each hold what the other needs and neither ever run.
    /// The pages go back to the cache (and their budget to the engine); the next admission
    /// attempt looks the prefix up again.
    pub(super) fn detach_cached_prefix(&mut self, slot: usize) {
        if self.seq(slot).table.is_empty() {
            return;
        }
        self.release_table(slot);
        self.seq_mut(slot).computed = 0;
    }

    /// Counts an admitted sequence in the prefix statistics: its prompt on its first
    /// admission (not on each step it waited, nor after a preemption), and the `hit` tokens
    /// attached.
    pub(super) fn count_prefix(&mut self, slot: usize, hit: usize) {
        if !self.reuses_prefixes() {
            return;
        }
        let s = self.seq(slot);
        let (first, prompt_len) = (s.preemptions == 0, s.prompt_len);
        self.stats.prefix_reused_tokens += hit as u64;
        if first {
            self.stats.prefix_prompt_tokens += prompt_len as u64;
            self.stats.prefix_hit_tokens += hit.min(prompt_len) as u64;
        }
    }

    /// Whether a prefix cache is attached for reuse (not for eviction only).
    pub(super) fn reuses_prefixes(&self) -> bool {
        self.prefix.as_ref().is_some_and(|l| l.reuse)
    }

    fn give_back_pages(&self, ids: &[BlockId]) {
        for &id in ids {
            // The lookup took these references for us: giving them back cannot be refused.
            let r = self.pool.release(id);
            debug_assert!(r.is_ok(), "{r:?}");
        }
    }

    /// After a commit: caches every block of the sequence that is now full and computed.
    pub(super) fn cache_completed_blocks(&mut self, slot: usize) {
        // Disjoint fields: the cache is read while the sequence is written (no `Arc` clone, two
        // atomic RMWs fewer per completed block).
        let Some(link) = self.prefix.as_ref().filter(|l| l.reuse) else {
            return;
        };
        let Some(s) = self.seqs[slot].as_mut() else {
            return;
        };
        let bs = self.cfg.block_size as usize;
        if (s.hashed as usize + 1) * bs > s.computed {
            // The common step: no block completed.
            return;
        }
        let cache = &link.cache;
        let key = PrefixKey {
            engine: self.cfg.engine,
            adapter: 0,
            salt: s.salt,
            block_tokens: self.cfg.block_size,
        };
        while (s.hashed as usize + 1) * bs <= s.computed {
            let at = s.hashed as usize * bs;
            let parent: BlockHash = s.parent.unwrap_or_else(|| cache.hasher().root(&key));
            let hash = cache.hasher().block(parent, &s.tokens[at..at + bs]);
            let Some(id) = s.table.get(s.hashed) else {
                break;
            };
            // Not cached (busy, duplicate, no room) is fine: the chain goes on from the hash.
            let _ = cache.insert(self.cfg.engine, hash, id);
            s.parent = Some(hash);
            s.hashed += 1;
        }
    }

    /// Pages among table entries `from..` of `slot` that leave this engine's budget when the
    /// table drops them: the ones it alone references (freed) and the ones only the cache will
    /// hold after (cached-free). Call before dropping them.
    pub(super) fn pages_leaving(&self, slot: usize, from: u32) -> u32 {
        let s = self.seq(slot);
        (from..s.table.len())
            .filter_map(|i| s.table.get(i))
            .filter(|&id| self.page_leaves(id))
            .count() as u32
    }

    /// Whether dropping one reference to `id` (held by this batcher) takes it out of this
    /// engine's budget: it is the last reference, or the only other one is the cache's.
    pub(super) fn page_leaves(&self, id: BlockId) -> bool {
        match self.pool.ref_count(id) {
            Ok(1) => true,
            Ok(2) => self.prefix.as_ref().is_some_and(|l| l.cache.is_cached(id)),
            _ => false,
        }
    }

    /// When the pool is short of `n` free pages: evicts cached-free pages, taken first from the
    /// engines most over their shares. `in_flight`: the pages this engine's budget just granted
    /// for the allocation that fell short (held there, not in the pool). Returns whether any
    /// page was evicted.
    ///
    /// An engine owns in the pool the pages its sequences hold and its cached pages; its budget
    /// holds the former ([`EngineBudget::blocks_held`](super::EngineBudget::blocks_held)), so an
    /// engine that owns no more pages than its budget holds has no cached-free page (short of a
    /// count read mid-change). Such engines are tried only if the others did not give `n`
    /// pages: the engine most over its share is typically the busiest, whose cached pages are
    /// the completed blocks its sequences still hold, and an eviction tried on it first swept
    /// every page's record twice for nothing on each allocation the dry pool refused.
    pub(super) fn evict_for(&self, n: u32, in_flight: u32) -> bool {
        let Some(link) = &self.prefix else {
            return false;
        };
        let (shares, in_use) = self
            .budget
            .as_ref()
            .map(|b| (b.block_quotas(), b.blocks_held()))
            .unwrap_or_default();
        let usage = link.cache.usage(&shares);
        if in_use.is_empty() {
            return link.cache.evict_by(&usage, n, &mut MostOverShare) > 0;
        }
        let (likely, rest): (Vec<_>, Vec<_>) = usage.into_iter().partition(|u| {
            let mut held = in_use.get(u.engine.index()).copied().unwrap_or(0);
            if u.engine == self.cfg.engine {
                held = held.saturating_sub(in_flight);
            }
            u.held > held
        });
        let done = link.cache.evict_by(&likely, n, &mut MostOverShare);
        // Engines tried above and not exhausted gave what was asked; those exhausted would
        // find nothing again.
        let rest_done = if done < n {
            link.cache.evict_by(&rest, n - done, &mut MostOverShare)
        } else {
            0
        };
        done + rest_done > 0
    }
}
