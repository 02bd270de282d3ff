//! KV cache geometry: the one paged layout that the CPU and CUDA kernels share, host storage and
//! swap space.
//!
//! - [`KvCacheConfig`]: the validated geometry of the layout (documented once on it, with the
//!   reason for it), which exposes its strides and byte sizes.
//! - [`KvDtype`] / [`KvElem`]: `f32`, `f16`, `bf16` storage; arithmetic is always `f32`.
//! - [`HostKvCache`], [`SwapSpace`]: page-aligned host storage of that layout; batched
//!   block copies ([`HostKvCache::copy_blocks`]) and swap-out / swap-in by mapping lists.
//! - [`ArenaView`]: one model's cache as a view of the device's shared
//!   [`KvArena`], with its own tokens per page ([`ModelKvShape`],
//!   [`page_bytes_for`]).
//! - [`PagedSeqs`], [`AttnParams`]: the kernel contract (the batch view and the attention
//!   parameters that the CPU and CUDA kernels take) and its validation.
//! - [`KvCacheView`], [`LayerKv`] (and their `Mut` twins): typed, validated views of a cache
//!   slice, what the kernels in [`crate::attn::cpu`] take.

mod arena;
mod arena_view;
mod contract;
mod dtype;
mod host;
mod layout;

pub use arena::{check_arena_size, KvArena, ARENA_ALIGN, PAGE_ALIGN, POISON_BYTE};
pub use arena_view::{
    page_bytes_for, ArenaView, ModelKvShape, MAX_TOKENS_PER_PAGE, MIN_TOKENS_PER_PAGE,
};
#[cfg(any(feature = "cuda", feature = "cuda-emu"))]
pub(crate) use contract::check_seqs;
pub(crate) use contract::{
    check_len, check_params, check_query_starts, check_slots, elems_of, row_elems,
};
pub use contract::{AttnParams, PagedSeqs};
pub use dtype::{KvDtype, KvElem};
pub use host::{
    check_block_mapping, coalesce_block_runs, BlockRun, HostKvCache, KvCacheView, KvCacheViewMut,
    LayerKv, LayerKvMut, SwapSpace, HOST_ALIGN,
};
pub use layout::{KvCacheConfig, KvPart, HEAD_DIM_ALIGN};

pub(crate) use host::copy_runs_within;
