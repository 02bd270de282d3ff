//! Typed errors, one enum per module family. Every error says what was wrong with the input in
//! words a caller can log; none carries a `String` built on a hot path.

use crate::block::{BlockId, EngineId};

/// Errors of the block pool ([`crate::block::BlockPool`]) and block tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// Not enough free blocks for the request; nothing was allocated.
    #[error("out of KV blocks: {requested} requested, {free} free")]
    OutOfBlocks {
        /// Blocks asked for.
        requested: u32,
        /// Blocks free when the request was refused.
        free: u32,
    },
    /// The id was minted by another pool (another device, or another pool on this device).
    #[error("{id:?} belongs to pool {id_pool}, not to this pool {pool} (device {device})")]
    ForeignBlock {
        /// The refused id.
        id: BlockId,
        /// The pool tag carried by the id.
        id_pool: u16,
        /// This pool's tag.
        pool: u16,
        /// This pool's device.
        device: u32,
    },
    /// The index is outside the pool.
    #[error("{id:?} is out of range: the pool has {total} blocks")]
    OutOfRange {
        /// The refused id.
        id: BlockId,
        /// Blocks in the pool.
        total: u32,
    },
    /// The block is free: it was never allocated, or this is a double free.
    #[error("{id:?} is not allocated (double free, or never allocated)")]
    NotAllocated {
        /// The refused id.
        id: BlockId,
    },
    /// The id's generation does not match the block's: the holder freed it and it has since
    /// been handed to someone else (a use-after-free by the caller).
    #[error("{id:?} is stale: the block was freed and reallocated (now generation {current})")]
    StaleBlock {
        /// The refused id.
        id: BlockId,
        /// The block's current generation.
        current: u32,
    },
    /// The engine id is not below the pool's `max_engines`.
    #[error("engine {engine:?} is out of range: the pool serves {max_engines} engines")]
    UnknownEngine {
        /// The refused engine.
        engine: EngineId,
        /// Engines the pool was built for.
        max_engines: u16,
    },
    /// A block's reference count would overflow.
    #[error("{id:?} is shared too many times")]
    TooManyRefs {
        /// The refused id.
        id: BlockId,
    },
    /// The block table is full.
    #[error("block table full: capacity {capacity} blocks")]
    TableFull {
        /// The table's capacity in blocks.
        capacity: u32,
    },
    /// A kernel block-table row is shorter than the table.
    #[error("block-table row too short: {needed} blocks, row of {row}")]
    RowTooShort {
        /// Blocks the table holds.
        needed: u32,
        /// Length of the row given.
        row: usize,
    },
    /// Invalid pool construction parameters.
    #[error("invalid pool configuration: {0}")]
    InvalidConfig(&'static str),
}

/// Errors of the continuous-batching scheduler ([`crate::sched::batcher`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedError {
    /// The batcher configuration cannot work.
    #[error("invalid scheduler configuration: {0}")]
    InvalidConfig(&'static str),
    /// The request is malformed.
    #[error("invalid request {id}: {reason}")]
    InvalidRequest {
        /// The request's id.
        id: u64,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A request with this id is already in the batcher.
    #[error("request {0} is already scheduled")]
    DuplicateId(u64),
    /// The request can never fit: its prompt plus output needs more blocks than a sequence may
    /// hold or than the whole pool has.
    #[error("request {id} needs {blocks} KV blocks, more than the {limit} one sequence can get")]
    TooLong {
        /// The request's id.
        id: u64,
        /// Blocks it would need at its longest.
        blocks: u64,
        /// The most one sequence can hold.
        limit: u64,
    },
    /// No sequence with this id.
    #[error("no sequence {0}")]
    UnknownSeq(u64),
    /// `commit` got a different number of sampled tokens than the batch has sampling rows.
    #[error("commit expected {expected} sampled tokens, got {got}")]
    SampleCountMismatch {
        /// Rows of the last batch that sample.
        expected: usize,
        /// Tokens given.
        got: usize,
    },
    /// The block pool refused an operation.
    #[error(transparent)]
    Pool(#[from] PoolError),
}

/// Why an admission queue refused or dropped a request ([`AdmissionError::Overloaded`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OverloadReason {
    /// The target queue was full and the policy (drop-newest, or a non-blocking `try_submit`)
    /// refused the new request.
    QueueFull,
    /// The request was queued, then evicted by a newer one under the drop-oldest policy.
    EvictedOldest,
}

/// Errors of the admission queues ([`crate::sched::admission`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    /// The request was refused or dropped because its queue was full.
    #[error("admission queue overloaded ({reason:?}) on worker {worker}")]
    Overloaded {
        /// Why: refused at submit, or evicted later.
        reason: OverloadReason,
        /// The worker whose queue overflowed.
        worker: u32,
    },
    /// The queue set was closed (shutting down): no new requests, and a request still queued
    /// when the queue set was dropped ends with this error.
    #[error("admission queues are closed (shutting down)")]
    Closed,
    /// The route named a worker that does not exist.
    #[error("unknown worker {worker}: the queue set has {workers} workers")]
    UnknownWorker {
        /// The refused worker index.
        worker: usize,
        /// Workers in the queue set.
        workers: usize,
    },
    /// The worker dropped the request without completing it.
    #[error("the request was dropped by its worker without an outcome")]
    Abandoned,
    /// Invalid queue-set construction parameters.
    #[error("invalid admission configuration: {0}")]
    InvalidConfig(&'static str),
}
