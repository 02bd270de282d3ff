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

/// Errors of the budget coordinator ([`crate::budget::BudgetCoordinator`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BudgetError {
    /// Invalid coordinator construction parameters.
    #[error("invalid budget configuration: {0}")]
    InvalidConfig(&'static str),
    /// A share weight of zero was given; weights are at least 1.
    #[error("share weight must be at least 1")]
    ZeroWeight,
    /// Every engine slot is taken.
    #[error("too many engines: the coordinator serves at most {max_engines}")]
    TooManyEngines {
        /// The coordinator's capacity.
        max_engines: u16,
    },
    /// The engine id is not below the coordinator's `max_engines`.
    #[error("engine {engine:?} is out of range: the coordinator serves {max_engines} engines")]
    UnknownEngine {
        /// The refused engine.
        engine: EngineId,
        /// The coordinator's capacity.
        max_engines: u16,
    },
    /// The engine id is in range but not registered (never, or already deregistered).
    #[error("engine {engine:?} is not registered")]
    NotRegistered {
        /// The refused engine.
        engine: EngineId,
    },
    /// An engine cannot be deregistered while it holds blocks.
    #[error("engine {engine:?} still holds {held} blocks; release them before deregistering")]
    StillHoldsBlocks {
        /// The engine.
        engine: EngineId,
        /// Blocks it holds.
        held: u64,
    },
    /// The engine would exceed its block limit (quota plus what it may borrow).
    #[error("engine {engine:?} asked for {requested} blocks holding {held}, limit {limit}")]
    OverBlockLimit {
        /// The engine.
        engine: EngineId,
        /// Blocks asked for.
        requested: u32,
        /// Blocks it held (counting acquires in flight) when refused.
        held: u64,
        /// Its limit when refused.
        limit: u32,
    },
    /// The engine is within its limit but the device's blocks are all taken (lent to
    /// borrowers that must give them back).
    #[error("pool exhausted: {requested} blocks asked, {in_use} of {total} in use")]
    BlocksExhausted {
        /// Blocks asked for.
        requested: u32,
        /// Blocks in use when refused (counting acquires in flight).
        in_use: u64,
        /// Blocks in the pool.
        total: u32,
    },
    /// More tokens released than were granted this step.
    #[error("engine {engine:?} released {released} tokens but holds {granted} this step")]
    TokensNotHeld {
        /// The engine.
        engine: EngineId,
        /// Tokens released.
        released: u64,
        /// Tokens it held.
        granted: u64,
    },
    /// More blocks released than the engine holds.
    #[error("engine {engine:?} released {released} blocks but holds {held}")]
    BlocksNotHeld {
        /// The engine.
        engine: EngineId,
        /// Blocks released.
        released: u32,
        /// Blocks it held.
        held: u64,
    },
}
