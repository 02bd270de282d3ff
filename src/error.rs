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

/// Errors of the KV cache geometry, host storage and swap space ([`crate::kv`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// A geometry size is zero.
    #[error("invalid KV geometry: {what} is 0")]
    ZeroDimension {
        /// Which size.
        what: &'static str,
    },
    /// `head_dim` is not a multiple of the vector width.
    #[error("invalid KV geometry: head_dim {head_dim} is not a multiple of {align}")]
    HeadDimAlignment {
        /// The refused head dim.
        head_dim: usize,
        /// The required multiple.
        align: usize,
    },
    /// More blocks than a block id can name.
    #[error("invalid KV geometry: {num_blocks} blocks, at most {max}")]
    TooManyBlocks {
        /// Blocks asked for.
        num_blocks: usize,
        /// The limit.
        max: usize,
    },
    /// The pool's byte size overflows `isize`.
    #[error("invalid KV geometry: the pool's size in bytes overflows")]
    SizeOverflow,
    /// The allocator refused the host buffer.
    #[error("host allocation of {bytes} bytes failed")]
    AllocFailed {
        /// Bytes asked for.
        bytes: usize,
    },
    /// The element type does not match the cache's dtype.
    #[error("dtype mismatch: the cache holds {expected}, got {found}")]
    DtypeMismatch {
        /// The cache's dtype.
        expected: crate::kv::KvDtype,
        /// The type used.
        found: crate::kv::KvDtype,
    },
    /// A buffer has the wrong number of elements.
    #[error("{what}: expected {expected} elements, got {found}")]
    LengthMismatch {
        /// Which buffer.
        what: &'static str,
        /// Elements the geometry requires.
        expected: usize,
        /// Elements given.
        found: usize,
    },
    /// The layer index is not below `num_layers`.
    #[error("layer {layer} is out of range: the cache has {num_layers} layers")]
    LayerOutOfRange {
        /// The refused layer.
        layer: usize,
        /// Layers in the cache.
        num_layers: usize,
    },
    /// A block index is outside the cache or swap space.
    #[error("block {block} is out of range: {num_blocks} blocks")]
    BlockOutOfRange {
        /// The refused index.
        block: i64,
        /// Blocks in the space indexed.
        num_blocks: usize,
    },
    /// Two pairs of a copy or swap mapping write the same destination block.
    #[error("block {block} is the destination of more than one copy")]
    DuplicateDestination {
        /// The block.
        block: u32,
    },
    /// A copy inside one cache writes a block that the same call reads.
    #[error("block {block} is both a source and a destination of one copy_blocks call")]
    CopyOverlap {
        /// The block.
        block: u32,
    },
    /// Swap between caches whose block shapes (layers, heads, head dim, block size, dtype) differ.
    #[error("swap between caches of different block shapes")]
    GeometryMismatch,
}

/// Errors of the attention and cache kernels ([`crate::attn`]): malformed batch tensors or
/// parameters. Kernels validate everything before writing, so on error no output or cache
/// element has been modified.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AttnError {
    /// A cache view or geometry problem.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// A tensor has the wrong number of elements for the batch.
    #[error("{what}: expected {expected} elements, got {found}")]
    LengthMismatch {
        /// Which tensor.
        what: &'static str,
        /// Elements the shapes require.
        expected: usize,
        /// Elements given.
        found: usize,
    },
    /// `num_heads` is zero or not a multiple of `num_kv_heads`.
    #[error("num_heads {num_heads} is not a positive multiple of num_kv_heads {num_kv_heads}")]
    HeadsNotMultiple {
        /// Query heads.
        num_heads: usize,
        /// KV heads of the cache.
        num_kv_heads: usize,
    },
    /// A scalar parameter is out of its domain (scale or soft-cap not finite, soft-cap
    /// negative, an ALiBi slope not finite).
    #[error("invalid attention parameter: {what}")]
    BadParam {
        /// Which parameter.
        what: &'static str,
    },
    /// A context length is negative or exceeds what the block table row can hold.
    #[error("sequence {seq}: context length {context_len} outside 0..={capacity}")]
    ContextLen {
        /// Sequence index in the batch.
        seq: usize,
        /// The refused length.
        context_len: i64,
        /// `max_blocks_per_seq * block_size`.
        capacity: usize,
    },
    /// A block table entry that the context length makes live is outside the cache.
    #[error("sequence {seq}: block table entry {index} = {block} outside 0..{num_blocks}")]
    BlockOutOfRange {
        /// Sequence index in the batch.
        seq: usize,
        /// Position in the sequence's block table row.
        index: usize,
        /// The refused entry.
        block: i32,
        /// Blocks in the cache.
        num_blocks: usize,
    },
    /// A slot mapping entry is neither -1 (padding) nor a slot of the cache.
    #[error("token {token}: slot {slot} outside 0..{num_slots} (and not -1)")]
    SlotOutOfRange {
        /// Token index.
        token: usize,
        /// The refused slot.
        slot: i64,
        /// `num_blocks * block_size`.
        num_slots: usize,
    },
    /// `query_start_loc` does not start at 0 or decreases.
    #[error("query_start_loc is not a non-decreasing sequence starting at 0 (at sequence {seq})")]
    QueryStartLoc {
        /// First offending sequence index.
        seq: usize,
    },
    /// A sequence has more new query tokens than tokens in its context.
    #[error("sequence {seq}: {q_len} query tokens but context length {context_len}")]
    QueryLongerThanContext {
        /// Sequence index in the batch.
        seq: usize,
        /// New tokens.
        q_len: usize,
        /// Tokens in the cache, new ones included.
        context_len: usize,
    },
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

/// Errors of the `simulate` job ([`crate::sim`]).
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The configuration cannot run.
    #[error("invalid simulation: {0}")]
    InvalidConfig(String),
    /// The requested device cannot be used.
    #[error("device: {0}")]
    Device(String),
    /// The block pool refused.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The KV cache refused.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// A kernel refused its inputs.
    #[error(transparent)]
    Attn(#[from] AttnError),
    /// The scheduler refused.
    #[error(transparent)]
    Sched(#[from] SchedError),
    /// The budget coordinator refused.
    #[error(transparent)]
    Budget(#[from] BudgetError),
    /// The admission queues refused.
    #[error(transparent)]
    Admission(#[from] AdmissionError),
    /// Writing the report failed.
    #[error("writing {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// What failed.
        source: std::io::Error,
    },
    /// Drawing the chart failed.
    #[error("drawing the chart: {0}")]
    Plot(String),
    /// A worker thread panicked (a bug).
    #[error("a simulation thread panicked")]
    ThreadPanicked,
}
