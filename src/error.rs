//! Typed errors, one enum per module family. Every error says what was wrong with the input in
//! words a caller can log; none carries a `String` built on a hot path.

use crate::ids::{BlockId, EngineId};

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
    /// A block table was asked to hold more blocks than its pool has: its slots (8 bytes each,
    /// allocated up front so readers never see them move) would be memory no sequence can use.
    #[error("block table of {capacity} blocks refused: the pool has {total} blocks")]
    TableTooLarge {
        /// The capacity asked for.
        capacity: u32,
        /// Blocks in the pool.
        total: u32,
    },
    /// Logical blocks `from..end` of a block table were asked for, past its `len` blocks.
    #[error("blocks {from}..{end} are past the block table's end ({len} blocks)")]
    PastTableEnd {
        /// First block asked for.
        from: u32,
        /// One past the last block asked for.
        end: u64,
        /// Blocks the table holds.
        len: u32,
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
    /// `free_n` checked every id, then another thread released one of them before this call
    /// did (a double free racing the batch). Unlike every other refusal this one is not
    /// side-effect free: every other reference in the batch was released.
    #[error(
        "{id:?} was released by another thread while free_n was releasing it (a double free); \
         every other reference of the batch was released, {freed} blocks went back to the free list"
    )]
    ConcurrentDoubleFree {
        /// The first id whose release failed.
        id: BlockId,
        /// Blocks the call returned to the free list.
        freed: u32,
    },
}

/// Errors of the continuous-batching scheduler ([`crate::sched::Batcher`]).
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
    /// The request can never fit, or never surely: its prompt plus output needs more blocks than
    /// a sequence may hold, than the whole pool has, or than the engine's guaranteed share of a
    /// shared pool (see `EngineBudget::guaranteed_blocks`: pages it borrows beyond that are
    /// taken back whenever the other engines have work).
    #[error("request {id} needs {blocks} KV blocks, more than the {limit} one sequence can get")]
    TooLong {
        /// The request's id.
        id: u64,
        /// Blocks it would need at its longest.
        blocks: u64,
        /// The most one sequence can hold.
        limit: u64,
    },
    /// The request is longer, at its longest (prompt and output but the last token), than the
    /// engine's `max_context` tokens.
    #[error(
        "request {id} reaches {tokens} tokens, more than the engine's max_context {max_context}"
    )]
    ContextTooLong {
        /// The request's id.
        id: u64,
        /// Its prompt plus `max_new_tokens - 1`.
        tokens: u64,
        /// The engine's limit.
        max_context: u64,
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
    /// Two caches, or a cache and metadata validated for another one, whose block shapes
    /// (layers, heads, head dim, block size, dtype, or block count) differ: a swap, an upload
    /// or a launch between them.
    #[error("a cache used with a cache or metadata of another block geometry")]
    GeometryMismatch,
    /// A model's block is larger than the arena's page.
    #[error(
        "a block of this model needs {block_bytes} bytes, more than the arena's {page_bytes}-byte page"
    )]
    PageTooSmall {
        /// The arena's page size.
        page_bytes: usize,
        /// Bytes one block of the model takes.
        block_bytes: usize,
    },
    /// Not even the smallest block of a model fits one page of the arena.
    #[error(
        "model does not fit the KV arena: {min_tokens} tokens of {bytes_per_token} bytes need more than the {page_bytes}-byte page (make the page larger)"
    )]
    ModelDoesNotFit {
        /// The model's KV bytes per token (all layers, K and V).
        bytes_per_token: usize,
        /// The smallest block the kernels take, in tokens.
        min_tokens: usize,
        /// The arena's page size.
        page_bytes: usize,
    },
    /// A tokens-per-page request that no model can get: not a power of two from `min` to `max`
    /// (the block sizes the kernels take).
    #[error("tokens per page {tokens_per_page} is not a power of two from {min} to {max}")]
    TokensPerPage {
        /// The refused count.
        tokens_per_page: usize,
        /// [`MIN_TOKENS_PER_PAGE`](crate::kv::MIN_TOKENS_PER_PAGE).
        min: usize,
        /// [`MAX_TOKENS_PER_PAGE`](crate::kv::MAX_TOKENS_PER_PAGE).
        max: usize,
    },
    /// A page size that would leave pages unaligned for the kernels' vector loads.
    #[error("page size {page_bytes} bytes is not a multiple of {align}")]
    PageMisaligned {
        /// The refused page size.
        page_bytes: usize,
        /// The required multiple.
        align: usize,
    },
    /// A raw cache base that is not aligned for the element type: views form `&[T]` from it.
    #[error("KV cache base pointer is not aligned to {align} bytes, the element type's alignment")]
    BaseMisaligned {
        /// The element type's alignment.
        align: usize,
    },
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

/// Errors of the raw kernel API ([`crate::cuda_raw`]): what the host checks refuse before
/// anything launches, and the status a launcher returned. Only with feature `cuda` or
/// `cuda-emu`.
#[cfg(any(feature = "cuda", feature = "cuda-emu"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RawError {
    /// A shape or parameter the CPU kernels refuse too (same checks, same words).
    #[error(transparent)]
    Attn(#[from] AttnError),
    /// A KV geometry, layer or dtype problem.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// The geometry is valid for the CPU kernels but not supported by the CUDA kernels, or a
    /// size does not fit the C ABI.
    #[error("unsupported by the CUDA kernels: {what} = {value}")]
    Unsupported {
        /// Which parameter (head_dim, block_size, ...).
        what: &'static str,
        /// The refused value.
        value: usize,
    },
    /// A required device pointer is null.
    #[error("{what} is a null pointer")]
    NullPointer {
        /// Which argument.
        what: &'static str,
    },
    /// A pointer, or a token stride in bytes, is not a multiple of the alignment the kernels
    /// load with.
    #[error("{what} is not {align}-byte aligned (its address or its token stride in bytes)")]
    Misaligned {
        /// Which argument.
        what: &'static str,
        /// Bytes it must be a multiple of.
        align: usize,
    },
    /// A token stride is shorter than a row, so rows would overlap.
    #[error("{what}: token stride of {stride} elements is shorter than a row of {row}")]
    StrideTooSmall {
        /// Which argument.
        what: &'static str,
        /// The stride given, in elements.
        stride: usize,
        /// Elements of one row (heads * head_dim).
        row: usize,
    },
    /// The decode plan was made for another shape than the launch's.
    #[error("decode plan made for {what} = {plan}, launched with {found}")]
    PlanMismatch {
        /// Which parameter (num_heads, num_kv_heads, head_dim).
        what: &'static str,
        /// The plan's value.
        plan: usize,
        /// The launch's value.
        found: usize,
    },
    /// A launch exceeds a capacity fixed at creation (a decode plan, a decode step).
    #[error("{what} = {found} exceeds the capacity {capacity}")]
    OverCapacity {
        /// Which quantity (num_seqs, max_blocks_per_seq, context length, ...).
        what: &'static str,
        /// The capacity.
        capacity: usize,
        /// What was asked for.
        found: usize,
    },
    /// The decode workspace is smaller than the plan needs.
    #[error("decode workspace of {found} bytes; the plan needs {needed}")]
    WorkspaceTooSmall {
        /// Bytes the plan needs.
        needed: usize,
        /// Bytes given.
        found: usize,
    },
    /// A launcher of kernels/pagedkv.h returned a non-zero status: a CUDA runtime error
    /// (1..9999) or an argument the launcher refused (`PKV_ERR_*`, >= 10000).
    #[error("{op}: {message} (status {status})")]
    Launch {
        /// The launcher.
        op: &'static str,
        /// The status it returned.
        status: i32,
        /// The runtime's or the launcher's description of it.
        message: &'static str,
    },
}

/// Errors of the CUDA run time ([`crate::cuda`]): probing, allocation, copies and kernel
/// launches. Only with feature `cuda`.
#[cfg(feature = "cuda")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// The CUDA driver library (`libcuda.so`) cannot be loaded: no NVIDIA driver here.
    #[error("no CUDA driver: libcuda cannot be loaded on this machine")]
    DriverNotFound,
    /// The driver is present but has no device with this ordinal.
    #[error("no CUDA device {ordinal}: the driver reports {count} device(s)")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver reports.
        count: usize,
    },
    /// A CUDA driver API call (through cudarc) failed.
    #[error("CUDA driver error: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// This build holds no kernel image the device can run (built for sm_80, sm_90 and
    /// compute_90 PTX).
    #[error("no kernel image for compute capability {major}.{minor} in this build")]
    NoKernelImage {
        /// Compute capability, major.
        major: i32,
        /// Compute capability, minor.
        minor: i32,
    },
    /// A launcher of kernels/pagedkv.h returned a non-zero status: a CUDA runtime error
    /// (1..9999) or an argument the launcher refused (`PKV_ERR_*`, >= 10000).
    #[error("{op}: {message} (status {status})")]
    Launch {
        /// The launcher.
        op: &'static str,
        /// The status it returned.
        status: i32,
        /// The runtime's or the launcher's description of it.
        message: &'static str,
    },
    /// A shape or parameter the CPU kernels refuse too (same checks, same words).
    #[error(transparent)]
    Attn(#[from] AttnError),
    /// A KV geometry, mapping or dtype problem.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// The geometry is valid for the CPU kernels but not supported by the CUDA kernels.
    #[error("unsupported by the CUDA kernels: {what} = {value}")]
    Unsupported {
        /// Which parameter (head_dim, block_size, ...).
        what: &'static str,
        /// The refused value.
        value: usize,
    },
    /// A device buffer belongs to another device or context than the one used.
    #[error("a device buffer belongs to device {found}, not to device {expected}")]
    WrongDevice {
        /// The device the call runs on.
        expected: usize,
        /// The buffer's device.
        found: usize,
    },
    /// A GGUF upload needs more device memory than is free (nothing was copied).
    #[error("upload needs {needed} bytes of device memory, {free} are free")]
    DeviceOutOfMemory {
        /// Bytes of all tensors.
        needed: u64,
        /// Free device memory when the upload began.
        free: u64,
    },
    /// Pinning host memory returned no memory.
    #[error("cannot pin {bytes} bytes of host memory")]
    HostAlloc {
        /// Bytes asked for.
        bytes: usize,
    },
    /// A refusal of the raw kernel API that has no variant of its own here (views, plans,
    /// capacities, workspaces).
    #[error(transparent)]
    Raw(RawError),
}

/// The raw API's shape, geometry and launch errors keep the variants they always had here
/// ([`CudaError::Attn`], [`CudaError::Kv`], [`CudaError::Unsupported`], [`CudaError::Launch`]);
/// the rest arrive as [`CudaError::Raw`].
#[cfg(feature = "cuda")]
impl From<RawError> for CudaError {
    fn from(e: RawError) -> Self {
        match e {
            RawError::Attn(a) => Self::Attn(a),
            RawError::Kv(k) => Self::Kv(k),
            RawError::Unsupported { what, value } => Self::Unsupported { what, value },
            RawError::Launch {
                op,
                status,
                message,
            } => Self::Launch {
                op,
                status,
                message,
            },
            other => Self::Raw(other),
        }
    }
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
    /// The ticket's outcome was already taken ([`Ticket::try_take`](crate::sched::admission::Ticket::try_take)).
    #[error("the request's outcome was already taken from its ticket")]
    Taken,
    /// Invalid queue-set construction parameters.
    #[error("invalid admission configuration: {0}")]
    InvalidConfig(&'static str),
}

/// Errors of the step executor and the engine driver ([`crate::engine`]).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The KV cache refused (geometry, mapping).
    #[error(transparent)]
    Kv(#[from] KvError),
    /// A kernel refused its inputs.
    #[error(transparent)]
    Attn(#[from] AttnError),
    /// The scheduler refused.
    #[error(transparent)]
    Sched(#[from] SchedError),
    /// The block pool refused.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The budget coordinator refused.
    #[error(transparent)]
    Budget(#[from] BudgetError),
    /// A CUDA call failed.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// A raw-pointer launch refused its inputs (or failed).
    #[cfg(any(feature = "cuda", feature = "cuda-emu"))]
    #[error(transparent)]
    Raw(#[from] RawError),
    /// The engine or its model was configured wrongly.
    #[error("invalid engine configuration: {0}")]
    InvalidConfig(String),
    /// The caller's model (projections, sampling) failed; its message is kept.
    #[error("model: {0}")]
    Model(String),
}
