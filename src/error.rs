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
    /// Invalid pool construction parameters.
    #[error("invalid pool configuration: {0}")]
    InvalidConfig(&'static str),
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
}
