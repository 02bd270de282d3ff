//! Continuous-batching scheduler and lock-free admission queues.
//!
//! - [`admission`]: lock-free per-worker priority queues where server threads hand requests in.
//! - [`Batcher`]: one engine's step loop scheduler, producing kernel-ready [`Batch`]es.
//! - [`SeqRequest`], [`StopRules`], [`FinishedSeq`], [`StepResults`]: requests, stop rules and
//!   results.

pub mod admission;
mod batch;
mod batcher;
mod budget_link;
mod sequence;

pub use batch::Batch;
pub use batcher::{Batcher, BatcherConfig, BatcherStats, EngineBudget, PreemptionMode};
pub use budget_link::EngineShare;
pub use sequence::{
    FinishReason, FinishedSeq, Priority, SeqId, SeqPhase, SeqRequest, SeqUpdate, StepResults,
    StopRules,
};
