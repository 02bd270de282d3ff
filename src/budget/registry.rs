//! The engine registry: register, reweight, deregister (slot life cycle in the module docs).

use super::{BudgetCoordinator, Slot, CLAIMED, FREE, JOINING, LEAVING, LIVE, NO_DEMAND};
use crate::error::BudgetError;
use crate::ids::EngineId;
use crate::sync::Ordering;

impl BudgetCoordinator {
    /// Registers an engine with share weight `weight` (≥ 1) and returns its id, reusing the
    /// lowest free slot. The engine starts idle; its quotas appear with the publication this
    /// call runs (or, if another thread is publishing, the one after).
    pub fn register(&self, weight: u32) -> Result<EngineId, BudgetError> {
        if weight == 0 {
            return Err(BudgetError::ZeroWeight);
        }
        if let Some(id) = self.claim_slot(weight) {
            return Ok(id);
        }
        // A departed engine's slot is freed only by a publication, and the one its `deregister`
        // asked for may still be pending with no publisher running (a publisher that took the
        // request ran out of rounds, or unwound, leaving `DIRTY` for the next caller). Serve it
        // here and scan once more, rather than refuse until some other call recomputes. (If
        // another thread is publishing, it takes the request and the slot may still be
        // `LEAVING`: refused as before.) Bounded: at most one recompute and two scans.
        if self
            .slots
            .iter()
            .any(|slot| slot.state.load(Ordering::Relaxed) == LEAVING)
        {
            self.recompute();
            if let Some(id) = self.claim_slot(weight) {
                return Ok(id);
            }
        }
        Err(BudgetError::TooManyEngines {
            max_engines: self.config.max_engines,
        })
    }

    /// Claims the lowest free slot for an engine of `weight` and publishes it (see
    /// [`register`](Self::register)); `None` when no slot is free.
    fn claim_slot(&self, weight: u32) -> Option<EngineId> {
        for (i, slot) in self.slots.iter().enumerate() {
            // One compare-exchange per slot, never retried: a bounded scan. `Acquire` on success
            // pairs with the publisher's `Release` store of `FREE`, so its zeroing of the slot is
            // visible before we fill it.
            if slot.state.load(Ordering::Relaxed) != FREE
                || slot
                    .state
                    .compare_exchange(FREE, CLAIMED, Ordering::Acquire, Ordering::Relaxed)
                    .is_err()
            {
                continue;
            }
            slot.weight.store(weight, Ordering::Relaxed);
            slot.active.store(false, Ordering::Relaxed);
            slot.demand.store(NO_DEMAND, Ordering::Relaxed);
            slot.block_demand.store(NO_DEMAND, Ordering::Relaxed);
            slot.tokens.store(0, Ordering::Relaxed);
            slot.blocks_claimed.store(0, Ordering::Relaxed);
            slot.blocks_held.store(0, Ordering::Relaxed);
            slot.load.store(0, Ordering::Relaxed);
            // `Release`: the publisher that sees JOINING (`Acquire` load) sees the filled slot.
            slot.state.store(JOINING, Ordering::Release);
            self.mark_dirty();
            self.recompute();
            return Some(EngineId(i as u16));
        }
        None
    }

    /// Changes an engine's share weight (≥ 1) and republishes.
    pub fn set_weight(&self, engine: EngineId, weight: u32) -> Result<(), BudgetError> {
        if weight == 0 {
            return Err(BudgetError::ZeroWeight);
        }
        let slot = self.registered(engine)?;
        slot.weight.store(weight, Ordering::Relaxed);
        self.mark_dirty();
        self.recompute();
        Ok(())
    }

    /// Deregisters an engine (its model is unloaded). It must hold no blocks (release them
    /// first); the tokens of its current step stop counting against the device's
    /// `tokens_per_step` (as at [`begin_step`](Self::begin_step), which this call must not race
    /// on the same engine). The caller must not use the id afterwards: the slot is reused by a
    /// later [`register`](Self::register) once the publisher has zeroed it.
    pub fn deregister(&self, engine: EngineId) -> Result<(), BudgetError> {
        let slot = self.registered(engine)?;
        let held = slot.blocks_held.load(Ordering::Relaxed);
        if held != 0 {
            return Err(BudgetError::StillHoldsBlocks { engine, held });
        }
        // The engine goes idle and its step ends (or its tokens would stay counted device-wide
        // forever) while the slot is still its own: once it is LEAVING, a publication may free
        // it and a register reuse it, and these writes would then idle the new engine and
        // take its grant away (tests/loom/budget.rs, deregister_does_not_touch_a_reused_slot).
        // The state check below fails only where another deregister of the same id raced
        // this one, which the contract rules out; ending an idle engine's step twice is a no-op.
        slot.active.store(false, Ordering::Relaxed);
        self.begin_step(engine);
        // Two single-shot attempts in the only order the publisher can move the state
        // (JOINING -> LIVE, never back): a bounded sequence, not a retry loop.
        let left = [JOINING, LIVE].into_iter().any(|from| {
            slot.state
                .compare_exchange(from, LEAVING, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        });
        if !left {
            return Err(BudgetError::NotRegistered { engine });
        }
        self.mark_dirty();
        self.recompute();
        Ok(())
    }

    /// The slot of a registered (`JOINING` or `LIVE`) engine.
    fn registered(&self, engine: EngineId) -> Result<&Slot, BudgetError> {
        let slot = self.slot(engine)?;
        match slot.state.load(Ordering::Acquire) {
            JOINING | LIVE => Ok(slot),
            _ => Err(BudgetError::NotRegistered { engine }),
        }
    }

    /// Whether `engine` is registered (and not deregistered).
    pub fn is_registered(&self, engine: EngineId) -> bool {
        self.registered(engine).is_ok()
    }
}
