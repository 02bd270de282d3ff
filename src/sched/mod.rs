//! Continuous-batching scheduler and admission queues without locks.
//!
//! - [`admission`]: per-worker priority queues where server threads hand requests in; no call
//!   takes a lock, but the queues are not lock-free in the strict sense (a stalled submitter
//!   holds up its queue, and a drop-oldest submit can wait for it: its "Progress" section).
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
