//! Connects a batcher to its engine's share of a [`BudgetCoordinator`]: the budget module sits
//! on a lower floor and knows nothing of the scheduler, so the link lives here.

use super::batcher::EngineBudget;
use crate::block::EngineId;
use crate::budget::BudgetCoordinator;
use crate::sync::Arc;

/// One engine's view of a shared coordinator, attachable to its
/// [`Batcher`](super::Batcher). Every call is one of the coordinator's wait-free operations.
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

impl EngineBudget for EngineShare {
    fn token_budget(&self) -> u32 {
        self.coordinator.token_budget(self.engine)
    }

    fn try_acquire_blocks(&self, n: u32) -> bool {
        self.coordinator.try_acquire_blocks(self.engine, n).is_ok()
    }

    fn release_blocks(&self, n: u32) {
        // The batcher only gives back what it acquired; a refusal would mean its own
        // accounting broke, which the coordinator's counters then show.
        let released = self.coordinator.release_blocks(self.engine, n);
        debug_assert!(released.is_ok(), "{released:?}");
    }

    fn set_active(&self, active: bool) {
        self.coordinator.set_active(self.engine, active);
    }

    fn record_step(&self, tokens: u32) {
        // Start the engine's next step, then count this one's tokens against it, so that
        // `tokens_used` reads as the last step's usage.
        self.coordinator.begin_step(self.engine);
        let granted = self.coordinator.try_acquire_tokens(self.engine, tokens);
        debug_assert!(granted || tokens > self.coordinator.token_budget(self.engine));
    }
}

/// The coordinator's priority scale (larger is more important) for a scheduler class.
pub fn budget_priority(class: super::Priority) -> crate::budget::Priority {
    match class {
        super::Priority::LatencyCritical => 1,
        super::Priority::Throughput => 0,
    }
}
