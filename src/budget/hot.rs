//! The wait-free hot path: activity, token and block acquire/release, budget reads, reclaim and
//! donor queries. Each call is a fixed number of atomic operations (table in the module docs).

use super::{
    unpack_load, BudgetCoordinator, Donor, Priority, Reclaim, JOINING, LIVE, LOAD_PUBLISHED,
    USED_BITS, USED_MASK,
};
use crate::block::EngineId;
use crate::error::BudgetError;
use crate::sync::Ordering;

impl BudgetCoordinator {
    /// Marks an engine active (it has work) or idle; returns the previous value. Wait-free: one
    /// swap, plus one `fetch_or` when the value changed. Budgets follow at the next
    /// [`recompute`](Self::recompute) / [`maybe_recompute`](Self::maybe_recompute). An id out of
    /// range is ignored (returns `false`).
    #[inline]
    pub fn set_active(&self, engine: EngineId, active: bool) -> bool {
        let Ok(slot) = self.slot(engine) else {
            return false;
        };
        // Relaxed: published to the recompute by `mark_dirty`'s Release RMW.
        let was = slot.active.swap(active, Ordering::Relaxed);
        if was != active {
            self.mark_dirty();
        }
        was
    }

    /// Whether the engine is marked active.
    #[inline]
    pub fn is_active(&self, engine: EngineId) -> bool {
        self.slot(engine)
            .is_ok_and(|s| s.active.load(Ordering::Relaxed))
    }

    /// The engine's token budget per step (0 for an unknown or idle engine). One load.
    #[inline]
    pub fn token_budget(&self, engine: EngineId) -> u32 {
        // Relaxed: a plain figure, no data published with it.
        self.slot(engine)
            .map_or(0, |s| s.token_budget.load(Ordering::Relaxed))
    }

    /// Tokens counted against the engine's current step.
    #[inline]
    pub fn tokens_used(&self, engine: EngineId) -> u64 {
        self.slot(engine)
            .map_or(0, |s| s.tokens.load(Ordering::Relaxed) & USED_MASK)
    }

    /// Takes `n` tokens of the engine's budget for this step, or nothing. Wait-free: one load
    /// and two read-modify-writes, no retry. Concurrent acquirers on one engine are never granted
    /// more than its budget in total (module docs). `false` for an unknown engine.
    #[inline]
    pub fn try_acquire_tokens(&self, engine: EngineId, n: u32) -> bool {
        let Ok(slot) = self.slot(engine) else {
            return false;
        };
        let budget = u64::from(slot.token_budget.load(Ordering::Relaxed));
        let n = u64::from(n);
        if n > budget {
            // Can never fit; refusing before the add also bounds every amount in flight by
            // the budget (< 2^24), which keeps the used field from overflowing.
            return false;
        }
        // Relaxed: the grant argument needs only this RMW's atomicity, and the reset and the
        // release work on this same word, so coherence orders them (module docs).
        let prev = slot.tokens.fetch_add(n, Ordering::Relaxed);
        if (prev & USED_MASK) + n <= budget {
            slot.tokens.fetch_add(n << USED_BITS, Ordering::Relaxed);
            true
        } else {
            slot.tokens.fetch_sub(n, Ordering::Relaxed);
            false
        }
    }

    /// Gives back `n` tokens granted in the current step (a sequence dropped from the batch):
    /// one `fetch_sub` on both fields. Must not race with [`begin_step`](Self::begin_step) on
    /// the same engine (both belong to the engine's step owner). Releasing more than was
    /// granted is refused.
    #[inline]
    pub fn release_tokens(&self, engine: EngineId, n: u32) -> Result<(), BudgetError> {
        let slot = self.slot(engine)?;
        let both = u64::from(n) | (u64::from(n) << USED_BITS);
        let prev = slot.tokens.fetch_sub(both, Ordering::Relaxed);
        let granted = prev >> USED_BITS;
        if granted < u64::from(n) {
            // Undo exactly (wrapping add inverts wrapping sub). Meanwhile the used field may
            // read as huge, which only makes concurrent acquirers fail.
            slot.tokens.fetch_add(both, Ordering::Relaxed);
            return Err(BudgetError::TokensNotHeld {
                engine,
                released: u64::from(n),
                granted,
            });
        }
        Ok(())
    }

    /// Starts a new step for the engine: the tokens granted in the previous one are spent and
    /// no longer count. Returns how many that was. Wait-free: one load, one `fetch_sub`. Safe
    /// against concurrent acquirers: a grant that lands after the load stays counted, in the
    /// new step (the reset only ever under-grants).
    #[inline]
    pub fn begin_step(&self, engine: EngineId) -> u64 {
        let Ok(slot) = self.slot(engine) else {
            return 0;
        };
        let granted = slot.tokens.load(Ordering::Relaxed) >> USED_BITS;
        // Both fields hold at least `granted` now: grants only grow the granted field until a
        // release (which does not race with us), and used ≥ granted always.
        slot.tokens
            .fetch_sub(granted | (granted << USED_BITS), Ordering::Relaxed);
        granted
    }

    /// The engine's guaranteed share of the pool. One load.
    #[inline]
    pub fn block_quota(&self, engine: EngineId) -> u32 {
        self.slot(engine)
            .map_or(0, |s| s.block_quota.load(Ordering::Relaxed))
    }

    /// What the engine may hold now: its quota plus what it may borrow. One load.
    #[inline]
    pub fn block_limit(&self, engine: EngineId) -> u32 {
        self.slot(engine)
            .map_or(0, |s| s.block_limit.load(Ordering::Relaxed))
    }

    /// Blocks the engine holds (counting an acquire in flight).
    #[inline]
    pub fn blocks_held(&self, engine: EngineId) -> u64 {
        self.slot(engine)
            .map_or(0, |s| s.blocks_held.load(Ordering::Relaxed))
    }

    /// Blocks held by all engines together.
    #[inline]
    pub fn blocks_in_use(&self) -> u64 {
        self.blocks_in_use.load(Ordering::Relaxed)
    }

    /// Takes `n` blocks against the engine's limit and the device's total, or nothing. Call it
    /// before `pool.alloc_n(engine, n)`, and [`release_blocks`](Self::release_blocks) if the
    /// allocation fails. Wait-free: one load, at most two `fetch_add` and two `fetch_sub`.
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
        // follows has its own synchronisation.
        let held = slot.blocks_held.fetch_add(n64, Ordering::Relaxed);
        if held + n64 > u64::from(limit) {
            slot.blocks_held.fetch_sub(n64, Ordering::Relaxed);
            return Err(BudgetError::OverBlockLimit {
                engine,
                requested: n,
                held,
                limit,
            });
        }
        let in_use = self.blocks_in_use.fetch_add(n64, Ordering::Relaxed);
        let total = self.config.total_blocks;
        if in_use + n64 > u64::from(total) {
            self.blocks_in_use.fetch_sub(n64, Ordering::Relaxed);
            slot.blocks_held.fetch_sub(n64, Ordering::Relaxed);
            return Err(BudgetError::BlocksExhausted {
                requested: n,
                in_use,
                total,
            });
        }
        Ok(())
    }

    /// Gives back `n` blocks the engine acquired (after freeing them in the pool). Releasing
    /// more than it holds is refused.
    #[inline]
    pub fn release_blocks(&self, engine: EngineId, n: u32) -> Result<(), BudgetError> {
        let slot = self.slot(engine)?;
        let n64 = u64::from(n);
        let held = slot.blocks_held.fetch_sub(n64, Ordering::Relaxed);
        if held < n64 {
            slot.blocks_held.fetch_add(n64, Ordering::Relaxed);
            return Err(BudgetError::BlocksNotHeld {
                engine,
                released: n,
                held,
            });
        }
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
        lowest_running_priority: Priority,
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
        priority: Priority,
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
