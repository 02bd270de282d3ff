//! The hot path: activity, token and block acquires, budget reads, reclaim and donor queries
//! are wait-free, each a bounded number of atomic operations (`reclaim_orders` also allocates
//! its result); releases are lock-free (a compare-exchange loop, so that a refused release
//! changes nothing). Table in the module docs, "Progress".

use super::{
    unpack_load, BudgetCoordinator, Donor, Rank, Reclaim, JOINING, LIVE, LOAD_PUBLISHED, NO_DEMAND,
    USED_BITS, USED_MASK,
};
use crate::error::BudgetError;
use crate::ids::EngineId;
use crate::sync::{AtomicU32, Backoff, Ordering};

impl BudgetCoordinator {
    /// Marks an engine active (it has work) or idle; returns the previous value. Wait-free: one
    /// swap, plus two stores (its demands reset) and one `fetch_or` when the value changed.
    /// Budgets follow at the next [`recompute`](Self::recompute) /
    /// [`maybe_recompute`](Self::maybe_recompute). An id out of range is ignored (returns
    /// `false`).
    #[inline]
    pub fn set_active(&self, engine: EngineId, active: bool) -> bool {
        let Ok(slot) = self.slot(engine) else {
            return false;
        };
        // Relaxed: published to the recompute by `mark_dirty`'s Release RMW.
        let was = slot.active.swap(active, Ordering::Relaxed);
        if was != active {
            // A demand published while the engine had other work says nothing of its new
            // work: it counts as wanting its whole share until it publishes again.
            slot.demand.store(NO_DEMAND, Ordering::Relaxed);
            slot.block_demand.store(NO_DEMAND, Ordering::Relaxed);
            self.mark_dirty();
        }
        was
    }

    /// Publishes how many tokens per step the engine expects to use: what its last step
    /// scheduled when something other than its token grant bounded it (it ran out of work, of
    /// pages, of sequence slots), or `u32::MAX` when the grant did. The next
    /// [`recompute`](Self::recompute) lends what a demand leaves of its engine's share to the
    /// active engines that want more, by weight ([`token_budget`](Self::token_budget)); the
    /// engine's own budget stays at least its share ([`token_share`](Self::token_share)), so
    /// when its demand rises it takes what the device has left at once, and all of its share
    /// once the borrowers hold no more than theirs (module docs, "Token lending").
    ///
    /// Rounded up to a multiple of
    /// [`BudgetConfig::demand_quantum`](super::BudgetConfig::demand_quantum); a demand at or
    /// above the engine's cap counts as none (the whole share). Marks the inputs changed only
    /// when the rounded figure rises, or falls by more than one quantum, so that a demand
    /// wavering by a few tokens does not republish every step. Wait-free: one load, at most
    /// one store and one `fetch_or`. Meant for the engine's step owner; concurrent callers
    /// leave one of their figures. An id out of range is ignored.
    #[inline]
    pub fn publish_demand(&self, engine: EngineId, tokens: u32) {
        let Ok(slot) = self.slot(engine) else {
            return;
        };
        let (q, cap) = (self.config.demand_quantum(), self.config.token_cap());
        if requantise(&slot.demand, tokens, q, cap) {
            self.mark_dirty();
        }
    }

    /// The engine's published demand ([`publish_demand`](Self::publish_demand), rounded), or
    /// `None` when it counts as wanting its whole share. One load.
    #[inline]
    pub fn token_demand(&self, engine: EngineId) -> Option<u32> {
        match self.slot(engine).ok()?.demand.load(Ordering::Relaxed) {
            NO_DEMAND => None,
            d => Some(d),
        }
    }

    /// Publishes how many blocks the engine expects to hold soon: what it holds and what its
    /// work will take next (`u32::MAX`, or anything from the cap up: its whole quota, and
    /// borrowing up to the cap). The next [`recompute`](Self::recompute) lends what a demand
    /// leaves of its engine's quota to the active engines that want more
    /// ([`block_limit`](Self::block_limit)); the engine's own limit stays at least its quota,
    /// so when its demand rises it takes what the pool has free at once, and the rest once the
    /// borrowers give back ([`reclaim_for`](Self::reclaim_for): module docs, "Block lending").
    ///
    /// Rounded up to a multiple of
    /// [`BudgetConfig::block_demand_quantum`](super::BudgetConfig::block_demand_quantum); a
    /// demand at or above the engine's cap counts as none (the whole quota, and borrowing up
    /// to the cap). Marks the inputs changed only when the rounded figure rises, or falls by
    /// more than one quantum. Wait-free: one load, at most one store and one `fetch_or`. Meant
    /// for the engine's step owner; concurrent callers leave one of their figures. An id out
    /// of range is ignored.
    #[inline]
    pub fn publish_block_demand(&self, engine: EngineId, blocks: u32) {
        let Ok(slot) = self.slot(engine) else {
            return;
        };
        let (q, cap) = (self.config.block_demand_quantum(), self.config.block_cap());
        if requantise(&slot.block_demand, blocks, q, cap) {
            self.mark_dirty();
        }
    }

    /// The engine's published block demand ([`publish_block_demand`](Self::publish_block_demand),
    /// rounded), or `None` when it reserves its whole quota. One load.
    #[inline]
    pub fn block_demand(&self, engine: EngineId) -> Option<u32> {
        match self.slot(engine).ok()?.block_demand.load(Ordering::Relaxed) {
            NO_DEMAND => None,
            d => Some(d),
        }
    }

    /// Whether the engine is marked active.
    #[inline]
    pub fn is_active(&self, engine: EngineId) -> bool {
        self.slot(engine)
            .is_ok_and(|s| s.active.load(Ordering::Relaxed))
    }

    /// The most tokens the engine may take per step (0 for an unknown or idle engine): its
    /// share, or more where other active engines' demand leaves part of theirs unused (module
    /// docs, "Token lending"). What its acquires are admitted against, besides the device's
    /// `tokens_per_step`. One load.
    #[inline]
    pub fn token_budget(&self, engine: EngineId) -> u32 {
        // Relaxed: a plain figure, no data published with it.
        self.slot(engine)
            .map_or(0, |s| s.token_budget.load(Ordering::Relaxed))
    }

    /// The engine's weighted share of `tokens_per_step` among the active engines (0 for an
    /// unknown or idle engine): its budget is never below it. One load.
    #[inline]
    pub fn token_share(&self, engine: EngineId) -> u32 {
        self.slot(engine)
            .map_or(0, |s| s.token_share.load(Ordering::Relaxed))
    }

    /// Tokens counted against the engine's current step.
    #[inline]
    pub fn tokens_used(&self, engine: EngineId) -> u64 {
        self.slot(engine)
            .map_or(0, |s| s.tokens.load(Ordering::Relaxed) & USED_MASK)
    }

    /// Tokens granted to the engine in its current step and not released (no acquire in
    /// flight counted). One load.
    #[inline]
    pub fn tokens_granted(&self, engine: EngineId) -> u64 {
        self.slot(engine)
            .map_or(0, |s| s.tokens.load(Ordering::Relaxed) >> USED_BITS)
    }

    /// Tokens counted against the device's `tokens_per_step` by all engines together: those
    /// granted in each engine's current step and not released (may include an acquire in
    /// flight). One load.
    #[inline]
    pub fn tokens_in_use(&self) -> u64 {
        self.tokens_in_use.load(Ordering::Relaxed)
    }

    /// Takes `n` tokens for this step, or nothing: granted iff they fit both the engine's budget
    /// and what the device's `tokens_per_step` has left after every engine's current step
    /// (module docs, "Global token cap"). Wait-free: one load and at most four
    /// read-modify-writes (three when granted), no retry. Concurrent acquirers are never
    /// granted more than an engine's budget, nor all engines together more than
    /// `tokens_per_step`. `false` for an unknown engine.
    #[inline]
    pub fn try_acquire_tokens(&self, engine: EngineId, n: u32) -> bool {
        let Ok(slot) = self.slot(engine) else {
            return false;
        };
        self.take_tokens(slot, u64::from(n), false).is_some()
    }

    /// Takes as many of `n` tokens as fit (the engine's budget, and what the device has left),
    /// and returns how many: the admission of [`try_acquire_tokens`](Self::try_acquire_tokens)
    /// with a partial grant instead of a refusal. Wait-free: one load and at most six
    /// read-modify-writes, no retry. 0 for an unknown engine.
    #[inline]
    pub fn acquire_tokens_up_to(&self, engine: EngineId, n: u32) -> u32 {
        let Ok(slot) = self.slot(engine) else {
            return 0;
        };
        // At most `n`, so it fits in u32.
        self.take_tokens(slot, u64::from(n), true).unwrap_or(0) as u32
    }

    /// Grants `n` tokens (or, when `partial`, as many of them as fit), returning the grant, or
    /// `None` when it grants nothing. Fetch-and-add admission with (partial) compensation, on the
    /// engine's counter and then on the device's: an acquire adds its amount, gives back what it
    /// does not keep, and what it keeps stays counted until released or reset, so the argument
    /// of the module docs holds for the kept amounts.
    #[inline]
    fn take_tokens(&self, slot: &super::Slot, n: u64, partial: bool) -> Option<u64> {
        let budget = u64::from(slot.token_budget.load(Ordering::Relaxed));
        // Never add more than the budget: every amount in flight is then below 2^24, which keeps
        // the used field from overflowing (`Slot::tokens`).
        let want = if partial {
            n.min(budget)
        } else if n > budget {
            return None;
        } else {
            n
        };
        if partial && want == 0 {
            return None;
        }
        // Relaxed: the grant argument needs only this RMW's atomicity, and the reset and the
        // release work on this same word, so coherence orders them (module docs).
        let prev = slot.tokens.fetch_add(want, Ordering::Relaxed);
        let mine = match budget.checked_sub(prev & USED_MASK) {
            Some(room) if room >= want => want,
            Some(room) if partial && room > 0 => room,
            _ => {
                slot.tokens.fetch_sub(want, Ordering::Relaxed);
                return None;
            }
        };
        if mine < want {
            slot.tokens.fetch_sub(want - mine, Ordering::Relaxed);
        }
        // The device-wide counter, the same admission: what it keeps is at most what is left of
        // `tokens_per_step` after every grant still counted there. Relaxed, as above.
        let total = u64::from(self.config.tokens_per_step);
        let in_use = self.tokens_in_use.fetch_add(mine, Ordering::Relaxed);
        let got = match total.checked_sub(in_use) {
            Some(room) if room >= mine => mine,
            Some(room) if partial && room > 0 => room,
            _ => {
                self.tokens_in_use.fetch_sub(mine, Ordering::Relaxed);
                slot.tokens.fetch_sub(mine, Ordering::Relaxed);
                return None;
            }
        };
        if got < mine {
            self.tokens_in_use.fetch_sub(mine - got, Ordering::Relaxed);
            slot.tokens.fetch_sub(mine - got, Ordering::Relaxed);
        }
        // Release: pairs with the Acquire of whoever takes these tokens out of the granted
        // field again (`release_tokens`' compare-exchange, `begin_step`'s load), so that its
        // subtraction from `tokens_in_use` comes after our addition there in that counter's
        // modification order; otherwise it could take the counter below what is outstanding.
        slot.tokens.fetch_add(got << USED_BITS, Ordering::Release);
        Some(got)
    }

    /// Gives back `n` tokens granted in the current step (a sequence dropped from the batch).
    /// Must not race with [`begin_step`](Self::begin_step) on the same engine (both belong to
    /// the engine's step owner). Releasing more than was granted is refused, and a refused
    /// release changes nothing, not even transiently.
    ///
    /// Lock-free, not wait-free: one compare-exchange loop on the engine's token word, which
    /// retries only when a concurrent acquire or release on the same engine changed the word (so
    /// some call made progress) or the weak compare-exchange failed spuriously, then one
    /// `fetch_sub` on the device's counter.
    #[inline]
    pub fn release_tokens(&self, engine: EngineId, n: u32) -> Result<(), BudgetError> {
        let slot = self.slot(engine)?;
        let n = u64::from(n);
        let both = n | (n << USED_BITS);
        let backoff = Backoff::new();
        let mut word = slot.tokens.load(Ordering::Relaxed);
        loop {
            let granted = word >> USED_BITS;
            if granted < n {
                return Err(BudgetError::TokensNotHeld {
                    engine,
                    released: n,
                    granted,
                });
            }
            // No borrow: used ≥ granted ≥ n. Acquire on success: pairs with the Release add of
            // the grants we take back (`take_tokens`), so their additions to `tokens_in_use`
            // come before our subtraction below.
            match slot.tokens.compare_exchange_weak(
                word,
                word - both,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(now) => {
                    word = now;
                    backoff.spin();
                }
            }
        }
        self.tokens_in_use.fetch_sub(n, Ordering::Relaxed);
        Ok(())
    }

    /// Starts a new step for the engine: the tokens granted in the previous one are spent and
    /// no longer count, against its budget or the device's. Returns how many that was.
    /// Wait-free: one load, two `fetch_sub`. Safe against concurrent acquirers: a grant that
    /// lands after the load stays counted, in the new step (the reset only ever under-grants).
    #[inline]
    pub fn begin_step(&self, engine: EngineId) -> u64 {
        let Ok(slot) = self.slot(engine) else {
            return 0;
        };
        // Acquire: pairs with the Release add of each grant we read (`take_tokens`), so its
        // addition to `tokens_in_use` comes before our subtraction there.
        let granted = slot.tokens.load(Ordering::Acquire) >> USED_BITS;
        // Both fields hold at least `granted` now: grants only grow the granted field until a
        // release (which does not race with us), and used ≥ granted always.
        slot.tokens
            .fetch_sub(granted | (granted << USED_BITS), Ordering::Relaxed);
        self.tokens_in_use.fetch_sub(granted, Ordering::Relaxed);
        granted
    }

    /// The engine's guaranteed share of the pool. One load.
    #[inline]
    pub fn block_quota(&self, engine: EngineId) -> u32 {
        self.slot(engine)
            .map_or(0, |s| s.block_quota.load(Ordering::Relaxed))
    }

    /// The engine's quota once it is published: `None` for an unknown engine, or one whose
    /// registration no publication has taken yet (its quota still reads 0). What the engine
    /// is sure to get whatever the others do, so the most one of its sequences may need
    /// ([`EngineShare`](crate::sched::EngineShare) refuses longer ones). Two loads.
    #[inline]
    pub fn guaranteed_blocks(&self, engine: EngineId) -> Option<u32> {
        let slot = self.slot(engine).ok()?;
        // Acquire: pairs with the publisher's AcqRel JOINING -> LIVE exchange, made after it
        // wrote this engine's quota in the same round.
        (slot.state.load(Ordering::Acquire) == LIVE)
            .then(|| slot.block_quota.load(Ordering::Relaxed))
    }

    /// What the engine may hold now: its quota plus what it may borrow. One load.
    #[inline]
    pub fn block_limit(&self, engine: EngineId) -> u32 {
        self.slot(engine)
            .map_or(0, |s| s.block_limit.load(Ordering::Relaxed))
    }

    /// Blocks the engine holds: granted and not released (no acquire in flight counted).
    #[inline]
    pub fn blocks_held(&self, engine: EngineId) -> u64 {
        self.slot(engine)
            .map_or(0, |s| s.blocks_held.load(Ordering::Relaxed))
    }

    /// Blocks held by all engines together (may include acquires in flight).
    #[inline]
    pub fn blocks_in_use(&self) -> u64 {
        self.blocks_in_use.load(Ordering::Relaxed)
    }

    /// Takes `n` blocks against the engine's limit and the device's total, or nothing. Call it
    /// before `pool.alloc_n(engine, n)`, and [`release_blocks`](Self::release_blocks) if the
    /// allocation fails. Wait-free: one load, at most three `fetch_add` and two `fetch_sub`.
    ///
    /// [`BudgetError::OverBlockLimit`]: the engine is at its limit (ask for a donor, or wait);
    /// [`BudgetError::BlocksExhausted`]: the engine is within its limit but the pool is lent out
    /// (see [`reclaim_orders`](Self::reclaim_orders)).
    #[inline]
    pub fn try_acquire_blocks(&self, engine: EngineId, n: u32) -> Result<(), BudgetError> {
        let slot = self.slot(engine)?;
        let n64 = u64::from(n);
        let limit = slot.block_limit.load(Ordering::Relaxed);
        // Relaxed: counting needs only RMW atomicity (module docs); the pool allocation that
        // follows has its own synchronisation. Checked sums: a counter near 2^64 (which the
        // protocol never produces) refuses rather than wrapping into a grant.
        let claimed = slot.blocks_claimed.fetch_add(n64, Ordering::Relaxed);
        if claimed
            .checked_add(n64)
            .is_none_or(|after| after > u64::from(limit))
        {
            slot.blocks_claimed.fetch_sub(n64, Ordering::Relaxed);
            return Err(BudgetError::OverBlockLimit {
                engine,
                requested: n,
                held: claimed,
                limit,
            });
        }
        let in_use = self.blocks_in_use.fetch_add(n64, Ordering::Relaxed);
        let total = self.config.total_blocks;
        if in_use
            .checked_add(n64)
            .is_none_or(|after| after > u64::from(total))
        {
            self.blocks_in_use.fetch_sub(n64, Ordering::Relaxed);
            slot.blocks_claimed.fetch_sub(n64, Ordering::Relaxed);
            return Err(BudgetError::BlocksExhausted {
                requested: n,
                in_use,
                total,
            });
        }
        // Release: pairs with `release_blocks`' Acquire compare-exchange that takes these blocks
        // back, so our additions to `blocks_claimed` and `blocks_in_use` come before its
        // subtractions in those counters' modification orders (neither can dip below what is
        // outstanding).
        slot.blocks_held.fetch_add(n64, Ordering::Release);
        Ok(())
    }

    /// Gives back `n` blocks the engine acquired (after freeing them in the pool). Releasing
    /// more than it holds is refused, and a refused release changes nothing, not even
    /// transiently: it is checked against the exact holding, which no acquire in flight
    /// inflates.
    ///
    /// Lock-free, not wait-free: one compare-exchange loop on the engine's holding, which
    /// retries only when a concurrent grant or release on the same engine changed it (or the
    /// weak compare-exchange failed spuriously), then two `fetch_sub`.
    #[inline]
    pub fn release_blocks(&self, engine: EngineId, n: u32) -> Result<(), BudgetError> {
        let slot = self.slot(engine)?;
        let n64 = u64::from(n);
        let backoff = Backoff::new();
        let mut held = slot.blocks_held.load(Ordering::Relaxed);
        loop {
            if held < n64 {
                return Err(BudgetError::BlocksNotHeld {
                    engine,
                    released: n,
                    held,
                });
            }
            // Acquire on success: pairs with the Release add of the grants we take back
            // (`try_acquire_blocks`).
            match slot.blocks_held.compare_exchange_weak(
                held,
                held - n64,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(now) => {
                    held = now;
                    backoff.spin();
                }
            }
        }
        slot.blocks_claimed.fetch_sub(n64, Ordering::Relaxed);
        self.blocks_in_use.fetch_sub(n64, Ordering::Relaxed);
        Ok(())
    }

    /// Blocks the engine must give back: what it holds above its current limit. Two loads.
    #[inline]
    pub fn reclaim_for(&self, engine: EngineId) -> u32 {
        self.slot(engine).map_or(0, |s| {
            let held = s.blocks_held.load(Ordering::Relaxed);
            let limit = u64::from(s.block_limit.load(Ordering::Relaxed));
            held.saturating_sub(limit).min(u64::from(u32::MAX)) as u32
        })
    }

    /// Every registered engine holding more than its limit, by id: the borrowers that must give
    /// blocks back to lenders that became active.
    pub fn reclaim_orders(&self) -> Vec<Reclaim> {
        (0..self.slots.len())
            .map(|i| EngineId(i as u16))
            .filter(|&e| self.is_registered(e))
            .filter_map(|engine| {
                let blocks = self.reclaim_for(engine);
                (blocks > 0).then_some(Reclaim { engine, blocks })
            })
            .collect()
    }

    // ---------------------------------------------------------------------------------------
    // Preemption donor
    // ---------------------------------------------------------------------------------------

    /// Publishes the engine's preemption figures: the lowest priority among its running work,
    /// and how many blocks preempting that work would free. One store.
    #[inline]
    pub fn publish_load(
        &self,
        engine: EngineId,
        lowest_running_priority: Rank,
        freeable_blocks: u32,
    ) {
        if let Ok(slot) = self.slot(engine) {
            let word = LOAD_PUBLISHED
                | (u64::from(lowest_running_priority) << 32)
                | u64::from(freeable_blocks);
            // Relaxed: the two figures travel in one word; nothing else is published with them.
            slot.load.store(word, Ordering::Relaxed);
        }
    }

    /// Withdraws the engine's preemption figures (it runs nothing preemptible).
    #[inline]
    pub fn clear_load(&self, engine: EngineId) {
        if let Ok(slot) = self.slot(engine) {
            slot.load.store(0, Ordering::Relaxed);
        }
    }

    /// The engine to preempt so that `requester` can admit a request of `priority` needing
    /// `blocks_needed` blocks: among the other registered engines running strictly
    /// lower-priority work with at least `blocks_needed` (and at least one) freeable blocks, the
    /// lowest priority first, then the largest borrower above its quota, then the lowest id.
    /// `None` when no engine qualifies.
    pub fn pick_donor(
        &self,
        requester: EngineId,
        priority: Rank,
        blocks_needed: u32,
    ) -> Option<Donor> {
        let mut best: Option<Donor> = None;
        for (i, slot) in self.slots.iter().enumerate() {
            let engine = EngineId(i as u16);
            if engine == requester || !matches!(slot.state.load(Ordering::Acquire), JOINING | LIVE)
            {
                continue;
            }
            let Some((p, freeable)) = unpack_load(slot.load.load(Ordering::Relaxed)) else {
                continue;
            };
            if p >= priority || freeable < blocks_needed.max(1) {
                continue;
            }
            let held = slot.blocks_held.load(Ordering::Relaxed);
            let quota = u64::from(slot.block_quota.load(Ordering::Relaxed));
            let borrowed = held.saturating_sub(quota).min(u64::from(u32::MAX)) as u32;
            let better = match best {
                None => true,
                // Ids ascend, so on a full tie the earlier (lower) id stays.
                Some(b) => p < b.priority || (p == b.priority && borrowed > b.borrowed_blocks),
            };
            if better {
                best = Some(Donor {
                    engine,
                    priority: p,
                    freeable_blocks: freeable,
                    borrowed_blocks: borrowed,
                });
            }
        }
        best
    }
}

/// Stores `value` rounded up to a multiple of `quantum` in a demand cell (`NO_DEMAND` from
/// `cap` up) when the rounded figure rises, or falls by more than one quantum, so that a
/// figure wavering by a little does not ask for a publication each step; returns whether it
/// stored. Relaxed: published to the recompute by the caller's `mark_dirty` (Release RMW).
fn requantise(cell: &AtomicU32, value: u32, quantum: u32, cap: u32) -> bool {
    let q = u64::from(quantum);
    let rounded = u64::from(value).div_ceil(q) * q;
    let demand = if rounded >= u64::from(cap) {
        NO_DEMAND
    } else {
        rounded as u32
    };
    let old = cell.load(Ordering::Relaxed);
    let store = demand > old || u64::from(demand) + q < u64::from(old);
    if store {
        cell.store(demand, Ordering::Relaxed);
    }
    store
}
