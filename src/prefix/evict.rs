//! Cached-free pages, CLOCK eviction, and the victim choice across engines' weighted shares.
//!
//! A cached page is *cached-free* when the cache's reference is its only one (no sequence's
//! table holds it): evicting it returns it to the free list. Eviction walks a per-engine CLOCK
//! hand over the page indices (second chance: a hit or an insertion sets the page's reference
//! bit, the hand clears it and passes; an unreferenced cached-free page is taken). Pages in use
//! are passed over without touching their bit. An eviction takes its first position from the
//! hand with one `fetch_add` and walks two sweeps from there on its own, advancing the hand by
//! what it visited: concurrent evictors never wait for each other, and each sees every page
//! twice itself, so one finds nothing only when each of the engine's cached pages was, at some
//! point of its walk, in use, hit, or removed by another thread.
//!
//! Across engines, a [`VictimChoice`] picks which engine loses the next page, given each
//! engine's `(held, share, cached)`; the default, [`MostOverShare`], takes from the engine
//! furthest above its share, so an engine under its share keeps its cache while another is
//! over, and an idle engine's cache (held = cached pages, nothing running) is reclaimable by
//! any engine that needs pages.

use crate::block::{BlockId, EngineId};
use crate::error::PoolError;
use crate::sync::Ordering;

use super::cache::PrefixCache;
use super::error::PrefixError;
use super::metrics::bump_removal;

/// One engine's figures for the victim choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineUsage {
    /// The engine.
    pub engine: EngineId,
    /// Pages it holds, cached ones included (e.g. [`BlockPool::held`](crate::block::BlockPool::held)).
    pub held: u32,
    /// Its weighted share of the pool, in pages (e.g. the budget's block quota).
    pub share: u32,
    /// Pages cached for it ([`PrefixCache::cached`]); an upper bound on what eviction can
    /// take from it.
    pub cached: u32,
}

/// Chooses the engine that loses the next cached page.
pub trait VictimChoice {
    /// Picks one of `candidates` (engines with cached pages not yet found exhausted, figures
    /// updated after every page this eviction took), or `None` to stop evicting.
    fn pick(&mut self, candidates: &[EngineUsage]) -> Option<EngineId>;
}

/// The default choice: the engine most over its share (`held - share`, largest first), ties
/// to the one with more cached pages, then the lower id.
#[derive(Debug, Clone, Copy, Default)]
pub struct MostOverShare;

impl VictimChoice for MostOverShare {
    fn pick(&mut self, candidates: &[EngineUsage]) -> Option<EngineId> {
        candidates
            .iter()
            .max_by_key(|u| {
                (
                    i64::from(u.held) - i64::from(u.share),
                    u.cached,
                    std::cmp::Reverse(u.engine),
                )
            })
            .map(|u| u.engine)
    }
}

impl<F: FnMut(&[EngineUsage]) -> Option<EngineId>> VictimChoice for F {
    fn pick(&mut self, candidates: &[EngineUsage]) -> Option<EngineId> {
        self(candidates)
    }
}

impl PrefixCache {
    /// Every engine's figures, with `shares[i]` as engine `i`'s share (0 past the slice) and
    /// `held` read from the pool.
    pub fn usage(&self, shares: &[u32]) -> Vec<EngineUsage> {
        (0..self.counters().len())
            .map(|i| {
                let engine = EngineId(i as u16);
                EngineUsage {
                    engine,
                    held: self.pool().held(engine),
                    share: shares.get(i).copied().unwrap_or(0),
                    cached: self.cached(engine),
                }
            })
            .collect()
    }

    /// Evicts up to `n` cached-free pages of `engine` in CLOCK order. Returns how many pages
    /// were evicted (each freed, unless a lookup took a reference in the same instant: then
    /// that lookup's holder frees it later).
    pub fn evict(&self, engine: EngineId, n: u32) -> Result<u32, PrefixError> {
        self.check_engine(engine)?;
        let mut done = 0;
        while done < n && self.evict_one(engine) {
            done += 1;
        }
        Ok(done)
    }

    /// Evicts up to `n` cached-free pages across engines, asking `choice` which engine loses
    /// each one. Returns how many were evicted. Entries of `usage` naming unknown engines are
    /// ignored.
    pub fn evict_by(&self, usage: &[EngineUsage], n: u32, choice: &mut impl VictimChoice) -> u32 {
        let mut candidates: Vec<EngineUsage> = usage
            .iter()
            .filter(|u| u.cached > 0 && self.check_engine(u.engine).is_ok())
            .copied()
            .collect();
        let mut done = 0;
        while done < n && !candidates.is_empty() {
            let Some(engine) = choice.pick(&candidates) else {
                break;
            };
            let Some(at) = candidates.iter().position(|u| u.engine == engine) else {
                break;
            };
            if self.evict_one(engine) {
                done += 1;
                let u = &mut candidates[at];
                u.held = u.held.saturating_sub(1);
                u.cached -= 1;
                if u.cached == 0 {
                    candidates.swap_remove(at);
                }
            } else {
                candidates.swap_remove(at);
            }
        }
        done
    }

    /// Allocates `n` pages for `engine`, all or nothing: free pages first, and if there are too
    /// few, evicts the shortfall of cached-free pages by `choice` over `usage` and tries once
    /// more. Appends the ids to `out`. The pool's error if that still is not enough (too few
    /// cached-free pages, or another thread took the evicted pages first): `out` is unchanged,
    /// no page is lost, but the pages this call evicted stay evicted (free in the pool, their
    /// cached content gone). A request larger than the whole pool evicts nothing.
    pub fn alloc_evicting(
        &self,
        engine: EngineId,
        n: u32,
        out: &mut Vec<BlockId>,
        usage: &[EngineUsage],
        choice: &mut impl VictimChoice,
    ) -> Result<(), PrefixError> {
        self.check_engine(engine)?;
        match self.pool().alloc_n(engine, n, out) {
            // More than the pool could ever give: refuse without evicting anything.
            Err(PoolError::OutOfBlocks { requested, free }) if requested <= self.pool().total() => {
                self.evict_by(usage, requested.saturating_sub(free), choice);
                Ok(self.pool().alloc_n(engine, n, out)?)
            }
            r => Ok(r?),
        }
    }

    /// Cached-free pages of `engine` (`None`: of every engine) right now: how many pages
    /// eviction could free, which the budget may lend. A scan over every page (one record and
    /// one pool load each); exact when nothing runs concurrently, otherwise some count of the
    /// pages as they were during the scan.
    pub fn reclaimable(&self, engine: Option<EngineId>) -> u32 {
        let mut n = 0;
        for (page, rec) in self.records().iter().enumerate() {
            let Some(s) = rec.read() else { continue };
            if engine.is_some_and(|e| e != s.engine) {
                continue;
            }
            if self.pool().ref_count(self.id_at(page, s.state)) == Ok(1) {
                n += 1;
            }
        }
        n
    }

    /// Positions `engine`'s CLOCK hand has passed so far (tests: how far evictions swept).
    #[cfg(test)]
    pub(crate) fn clock_hand(&self, engine: EngineId) -> u64 {
        self.counters()[engine.index()].hand.load(Ordering::Relaxed)
    }

    /// Advances `engine`'s CLOCK hand until it evicts one cached-free page of that engine, for
    /// at most two sweeps' worth of positions. Returns whether it evicted one.
    ///
    /// The walk takes its first position from the hand with one `fetch_add` and goes on through
    /// the positions after it on its own, then advances the hand by the rest of what it
    /// visited: alone, the same positions as one `fetch_add` per step, and under concurrency
    /// every evictor still sees every page twice itself. Shared steps did not: a concurrent
    /// evictor took some of this one's positions, and two evictors reading a page's reference
    /// bit at once both passed it as its second chance, so an evictor could finish its two
    /// sweeps having passed a cached-free page only as "referenced" and report nothing to evict
    /// while that page stayed (a spurious allocation failure; loom
    /// `two_evictors_two_cached_free_pages_*`).
    pub(super) fn evict_one(&self, engine: EngineId) -> bool {
        let pages = self.records().len() as u64;
        let counters = &self.counters()[engine.index()];
        if counters.cached() == 0 {
            return false;
        }
        // Relaxed: the hand only spreads evictors over positions; what a position holds is
        // read through the record's own protocol.
        let start = counters.hand.fetch_add(1, Ordering::Relaxed);
        let mut visited = 0;
        let mut evicted = false;
        while visited < 2 * pages {
            let page = (start.wrapping_add(visited) % pages) as usize;
            visited += 1;
            if self.try_evict_at(engine, page) {
                bump_removal(&counters.evictions);
                evicted = true;
                break;
            }
        }
        // The first position was taken above; `visited` is at least 1 (pages > 0: the engine
        // has a cached page).
        counters.hand.fetch_add(visited - 1, Ordering::Relaxed);
        evicted
    }

    /// One CLOCK step at `page` for `engine`: evicts it if it is the engine's, cached-free and
    /// unreferenced; clears its reference bit if it is cached-free and referenced.
    fn try_evict_at(&self, engine: EngineId, page: usize) -> bool {
        let rec = &self.records()[page];
        let Some(s) = rec.read() else { return false };
        if s.engine != engine {
            return false;
        }
        // In use by a sequence (or mid-lookup): not cached-free; its bit stays.
        if self.pool().ref_count(self.id_at(page, s.state)) != Ok(1) {
            return false;
        }
        // Second chance. Load first so a sweep over cold pages does not write.
        if rec.referenced.load(Ordering::Relaxed) {
            rec.referenced.store(false, Ordering::Relaxed);
            return false;
        }
        self.uncache_unheld(page, s)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use crate::block::{BlockPool, EngineId, PoolConfig};
    use crate::prefix::{Inserted, PrefixCache, PrefixConfig};
    use crate::sync::{Arc, Ordering};

    /// The CLOCK hand wrapping past its integer type must not break "two sweeps' worth of
    /// positions": with 3 pages and a `u32` hand at `u32::MAX`, the positions were 0, 0, 1, 2,
    /// 0, 1 (2^32 is not a multiple of 3), so page 2 was seen once: its reference bit was
    /// cleared and the only cached-free page of the engine was never taken.
    #[test]
    fn a_wrapping_hand_still_sweeps_every_page_twice() {
        let pool = Arc::new(
            BlockPool::new(PoolConfig {
                device: 0,
                num_blocks: 3,
                max_engines: 1,
            })
            .unwrap(),
        );
        let cache = PrefixCache::new(pool.clone(), PrefixConfig { seed: Some(1) });
        let e = EngineId(0);
        let ids: Vec<_> = (0..3).map(|_| pool.alloc(e).unwrap()).collect();
        let page2 = *ids.iter().find(|id| id.index() == 2).unwrap();
        let key = crate::prefix::PrefixKey {
            engine: e,
            adapter: 0,
            salt: 0,
            block_tokens: 1,
        };
        let h = cache.hasher().block(cache.hasher().root(&key), &[7]);
        assert_eq!(cache.insert(e, h, page2), Ok(Inserted::Inserted));
        pool.free_n(&ids).unwrap();
        assert_eq!(cache.reclaimable(Some(e)), 1);
        cache.counters()[0]
            .hand
            .store(u32::MAX as _, Ordering::Relaxed);
        assert_eq!(
            cache.evict(e, 1),
            Ok(1),
            "the cached-free page was not evicted"
        );
        assert_eq!(pool.free_count(), 3);
    }
}
