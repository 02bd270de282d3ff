//! Connects a batcher to its engine's share of a [`BudgetCoordinator`]: the budget module sits
//! on a lower floor and knows nothing of the scheduler, so the link lives here.

use super::batcher::EngineBudget;
use crate::block::EngineId;
use crate::budget::BudgetCoordinator;
use crate::sync::Arc;

/// One engine's view of a shared coordinator, attachable to its
/// [`Batcher`](super::Batcher). Every call is one of the coordinator's wait-free operations,
/// except the release of blocks and of unused tokens (lock-free: see
/// [`BudgetCoordinator::release_tokens`]).
///
/// Tokens are held for a step, so that the device's `tokens_per_step` binds the engines'
/// steps together, not only each engine's budget (crate::budget, "Global token cap"):
/// [`token_budget`](EngineBudget::token_budget), which the batcher calls once at the start of
/// each schedule, ends the engine's previous step ([`BudgetCoordinator::begin_step`]) and takes
/// as much of its budget as the device has left ([`BudgetCoordinator::acquire_tokens_up_to`]);
/// [`record_step`](EngineBudget::record_step) gives back what the step did not use. So an
/// engine's step tokens count from the start of its schedule until the start of its next one,
/// or until the batcher reports it idle ([`set_active`](EngineBudget::set_active)`(false)`,
/// once its last batch has run): an idle engine holds none even if it is not stepped again
/// (drivers park on their admission queue then).
#[derive(Debug, Clone)]
pub struct EngineShare {
    coordinator: Arc<BudgetCoordinator>,
    engine: EngineId,
}

impl EngineShare {
    /// The share of `engine` (registered with `coordinator`).
    pub fn new(coordinator: Arc<BudgetCoordinator>, engine: EngineId) -> Self {
        Self {
            coordinator,
            engine,
        }
    }
}

impl EngineShare {
    /// Gives back what the engine's current step holds above `keep` tokens.
    fn release_above(&self, keep: u64) {
        let c = &self.coordinator;
        let held = c.tokens_granted(self.engine);
        if held > keep {
            // At most what is held, so it fits in u32, and it cannot be refused.
            let released = c.release_tokens(self.engine, (held - keep) as u32);
            debug_assert!(released.is_ok(), "{released:?}");
        }
    }
}

impl EngineBudget for EngineShare {
    /// Starts the engine's step and takes its tokens: the engine's budget, or less when other
    /// engines' current steps hold the rest of the device's (right after a recomputation moved
    /// budget to this engine from one that has not started its next step yet).
    fn token_budget(&self) -> u32 {
        let c = &self.coordinator;
        c.begin_step(self.engine);
        c.acquire_tokens_up_to(self.engine, c.token_budget(self.engine))
    }

    fn try_acquire_blocks(&self, n: u32) -> bool {
        self.coordinator.try_acquire_blocks(self.engine, n).is_ok()
    }

    /// Whether `n` more blocks fit the engine's limit but not the device's total (what its
    /// driver also counts as a reclaim demand).
    fn pages_lent_out(&self, n: u32) -> bool {
        let c = &self.coordinator;
        let n = u64::from(n);
        c.blocks_held(self.engine) + n <= u64::from(c.block_limit(self.engine))
            && c.blocks_in_use() + n > u64::from(c.config().total_blocks)
    }

    fn release_blocks(&self, n: u32) {
        // The batcher only gives back what it acquired; a refusal would mean its own
        // accounting broke, which the coordinator's counters then show.
        let released = self.coordinator.release_blocks(self.engine, n);
        debug_assert!(released.is_ok(), "{released:?}");
    }

    /// An engine reported idle has no batch left to run (the batcher reports it at a commit, or
    /// at a schedule that scheduled nothing), so its step ends here: otherwise its last step's
    /// tokens would count against the device's `tokens_per_step`, and cut every other engine's
    /// grant, for as long as it stays idle.
    fn set_active(&self, active: bool) {
        if !active {
            self.coordinator.begin_step(self.engine);
        }
        self.coordinator.set_active(self.engine, active);
    }

    /// The engine's block quota, once published ([`BudgetCoordinator::guaranteed_blocks`]):
    /// what it gets whatever the other engines do. Borrowed pages last only while their
    /// lenders idle, so a sequence needing more could be preempted for as long as any other
    /// engine has work.
    fn guaranteed_blocks(&self) -> Option<u32> {
        self.coordinator.guaranteed_blocks(self.engine)
    }

    /// Every engine's quota, all from one publication
    /// ([`BudgetCoordinator::block_quotas`]).
    fn block_quotas(&self) -> Vec<u32> {
        self.coordinator.block_quotas()
    }

    /// Every engine's blocks held ([`BudgetCoordinator::blocks_held`]), one load each.
    fn blocks_held(&self) -> Vec<u32> {
        let c = &self.coordinator;
        (0..c.config().max_engines)
            .map(|e| c.blocks_held(EngineId(e)).min(u64::from(u32::MAX)) as u32)
            .collect()
    }

    /// What a step holds above the engine's share was lent by engines whose demand was low; it
    /// goes back once the batch has run (or failed: [`Batcher::step_failed`]), so that a lender
    /// whose work grew gets its share at its next schedule, not only after this engine's next
    /// one. Up to the share, the step's tokens stay held until the next schedule (the engine's
    /// guarantee between its steps).
    ///
    /// [`Batcher::step_failed`]: super::Batcher::step_failed
    fn step_ran(&self) {
        let share = u64::from(self.coordinator.token_share(self.engine));
        self.release_above(share);
    }

    /// Publishes the engine's block demand ([`BudgetCoordinator::publish_block_demand`]): the
    /// blocks it holds plus `growth`; the next recomputation lends what a demand leaves of the
    /// engine's quota to engines that want more, and takes it back (their reclaim orders) once
    /// it rises.
    fn record_block_demand(&self, growth: u32) {
        let c = &self.coordinator;
        let held = c.blocks_held(self.engine).min(u64::from(u32::MAX)) as u32;
        c.publish_block_demand(self.engine, held.saturating_add(growth));
    }

    /// Keeps the step's `tokens` and gives back the rest of what `token_budget` took, so that
    /// `tokens_used` reads as this step's usage until its batch has run (above the engine's
    /// share, [`step_ran`](EngineBudget::step_ran)) or the next one starts; publishes the
    /// step's `demand` ([`BudgetCoordinator::publish_demand`]), so that the next recomputation
    /// lends what this engine leaves unused to engines that want more.
    fn record_step(&self, tokens: u32, demand: u32) {
        let c = &self.coordinator;
        c.publish_demand(self.engine, demand);
        let held = c.tokens_granted(self.engine);
        let tokens = u64::from(tokens);
        if tokens < held {
            self.release_above(tokens);
        } else if tokens > held {
            // The batcher schedules within what `token_budget` returned, so this is not
            // reached; if it were, the excess is counted where it still fits.
            c.acquire_tokens_up_to(self.engine, (tokens - held).min(u64::from(u32::MAX)) as u32);
        }
    }
}
