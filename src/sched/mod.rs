//! Continuous-batching scheduler and lock-free admission queues.
//!
//! - [`admission`]: lock-free per-worker priority queues where server threads hand requests in.
//! - [`batcher`]: one engine's step loop scheduler, producing kernel-ready [`Batch`]es.
//! - [`sequence`]: requests, stop rules and results.

pub mod admission;
pub mod batch;
pub mod batcher;
pub mod budget_link;
pub mod sequence;

pub use batch::Batch;
pub use batcher::{Batcher, BatcherConfig, BatcherStats, EngineBudget, PreemptionMode};
pub use budget_link::{budget_priority, EngineShare};
pub use sequence::{
    FinishReason, FinishedSeq, Priority, SeqId, SeqPhase, SeqRequest, SeqUpdate, StepResults,
    StopRules,
};
