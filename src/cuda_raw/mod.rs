//! The kernels over raw device pointers and the caller's stream (feature `cuda` or
//! `cuda-emu`): no cudarc type in any signature, so a client on any cudarc version (candle
//! 0.11 pins cudarc 0.19), or on none, launches pagedkv's kernels on its own buffers and its
//! own `CUstream`.
//!
//! # What a caller passes
//!
//! - **Device pointers** as [`DevPtr`] (`u64`, a `CUdeviceptr`: what cudarc's
//!   `DevicePtr::device_ptr` returns in every version, or `CudaSlice::device_ptr` in candle's).
//!   Each launch documents the memory each pointer must point at (space, shape, element type),
//!   and how long it must stay valid: until the launch has **completed** on the stream, not
//!   just until the call returns (launches are asynchronous).
//! - **Shapes and strides** in small structs ([`CacheView`], [`Rows`], [`SeqTables`],
//!   [`AttnParamsRaw`], [`DecodePlan`], [`Workspace`]): a query or output is a [`Rows`] view,
//!   a row per token of `[heads][head_dim]` elements `token_stride` elements apart, so the q
//!   (or k, v) part of a fused QKV projection (`[q heads | k heads | v heads]` per token) is
//!   passed in place, without a copy.
//! - **The stream** as [`CuStream`] (an opaque `CUstream` == `cudaStream_t`; null is the legacy
//!   default stream). Launches are queued on it and never synchronize.
//!
//! The kernels run in the CUDA context current on the calling thread: make the context that
//! owns the pointers and the stream current first (cudarc: `CudaContext::bind_to_thread`;
//! candle: `CudaDevice` binds its context on use, and its stream is `cuda_stream().cu_stream()`).
//! The runtime API the kernels use adopts the current context (a primary context, as cudarc and
//! candle retain, or any other).
//!
//! # Safety of the launches
//!
//! Every launch is an `unsafe fn`: the host cannot see device memory, so the caller vouches
//! that each pointer points at what it says, for as long as it says. Everything the host
//! *can* check is checked before anything launches, with typed errors ([`RawError`]): the
//! geometry, the layer, the heads, the parameters, null and misaligned pointers, strides
//! shorter than a row, plans that do not fit the launch, workspaces too small. What lives in
//! device memory (block ids, context lengths, slots) cannot make a kernel step outside the
//! buffers: block ids outside the cache are masked, context lengths are clamped to the block
//! table row (and the decode plan's capacity), slots outside the cache are skipped. Such values
//! give wrong results, never out-of-bounds accesses; validate them on the host where they come
//! from (`crate::kv::check_seqs` is the CPU kernels' check).
//!
//! Under `cuda-emu` the same launches run the kernels on the CPU emulation (kernels/emu/):
//! "device" pointers are host pointers (`crate::cuda_emu::EmuBuf::ptr`), the stream is
//! ignored, and every launch completes before it returns.

mod check;
pub mod ffi;
mod host_pin;
mod launch;
mod plan;
mod tiling;

pub use crate::error::RawError;
#[cfg(feature = "cuda")]
pub(crate) use check::check_status;
pub use check::{geometry, status_message, SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_DIMS, VIEW_ALIGN};
pub use host_pin::{host_register, host_unregister};
pub(crate) use launch::prefill_max_query_len;
pub use launch::{
    copy_blocks, paged_attention_decode, paged_attention_prefill, reshape_and_cache, swap_blocks,
};
pub use plan::{DecodeMode, DecodePlan};
pub use tiling::PrefillTiling;

use crate::kv::KvCacheConfig;
use std::ffi::c_void;

/// A device address (`CUdeviceptr`); under `cuda-emu`, a host address. 0 is null.
pub type DevPtr = u64;

/// A CUDA stream (`CUstream` == `cudaStream_t`) as an opaque pointer; null is the legacy
/// default stream.
pub type CuStream = *mut c_void;

/// A model's paged KV cache on the device: the arena's base and the view's geometry (its
/// page stride is the arena's page size; see [`KvCacheConfig`] for the layout).
#[derive(Debug, Clone, Copy)]
pub struct CacheView {
    /// Device, 16-byte aligned: page 0 of `config.num_blocks()` pages of
    /// `config.page_bytes()` bytes, elements of `config.dtype()`.
    pub base: DevPtr,
    /// The geometry (head dim and block size among [`SUPPORTED_HEAD_DIMS`] and
    /// [`SUPPORTED_BLOCK_SIZES`]).
    pub config: KvCacheConfig,
}

/// Rows of `[heads][head_dim]` elements (of the cache's dtype), one per token: row `t` starts
/// `t * token_stride` elements after `ptr`, its heads contiguous at `head_dim` apart. How many
/// rows and heads is the launch's business (its batch and its `num_heads` or `num_kv_heads`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rows {
    /// Device address of row 0.
    pub ptr: DevPtr,
    /// Elements from one row to the next, at least a row (`heads * head_dim`).
    pub token_stride: usize,
}

impl Rows {
    /// A dense `[tokens][heads][head_dim]` tensor at `ptr`. A product past `usize` saturates
    /// (no panic here): the launch that takes the view refuses such a stride
    /// ([`RawError::Unsupported`]).
    pub fn dense(ptr: DevPtr, heads: usize, head_dim: usize) -> Self {
        Self {
            ptr,
            token_stride: heads.saturating_mul(head_dim),
        }
    }

    /// Part `part` of a fused projection whose token rows hold `parts_heads` (e.g. `[num_heads,
    /// num_kv_heads, num_kv_heads]` for q, k, v) in that order, at `base` of `elem_bytes`-byte
    /// elements: the view of heads `parts_heads[part]` starting after the earlier parts.
    /// `None` if `part` is out of range or an offset overflows.
    pub fn fused(
        base: DevPtr,
        parts_heads: &[usize],
        part: usize,
        head_dim: usize,
        elem_bytes: usize,
    ) -> Option<Self> {
        if part >= parts_heads.len() {
            return None;
        }
        let sum = |heads: &[usize]| heads.iter().try_fold(0usize, |a, &h| a.checked_add(h));
        let total = sum(parts_heads)?;
        let before = sum(&parts_heads[..part])?;
        let offset = before.checked_mul(head_dim)?.checked_mul(elem_bytes)?;
        Some(Self {
            ptr: base.checked_add(u64::try_from(offset).ok()?)?,
            token_stride: total.checked_mul(head_dim)?,
        })
    }
}

/// A batch's paged-sequence metadata in device memory (the contract of
/// [`PagedSeqs`](crate::kv::PagedSeqs)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqTables {
    /// Device `[num_seqs][max_blocks_per_seq]` i32 physical block ids, every entry readable
    /// memory; entries past a sequence's `ceil(context_len / block_size)` do not change the
    /// result (decode does not read them; prefill may read a row's first entries ahead of its
    /// context, then ignore them), ids outside the cache mask their tokens.
    pub block_tables: DevPtr,
    /// Entries per block table row (>= 1).
    pub max_blocks_per_seq: usize,
    /// Device `[num_seqs]` i32 context lengths (new tokens included): at most
    /// `max_blocks_per_seq * block_size` (longer ones are clamped); <= 0 is an empty sequence.
    pub context_lens: DevPtr,
    /// Sequences in the batch.
    pub num_seqs: usize,
}

/// Attention parameters with the ALiBi slopes (if any) in device memory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnParamsRaw {
    /// Query heads; a positive multiple of the cache's KV heads.
    pub num_heads: usize,
    /// Multiplies q.k (typically 1/sqrt(head_dim)); finite.
    pub scale: f32,
    /// Logit soft-cap; 0 turns it off; finite, >= 0.
    pub softcap: f32,
    /// Sliding window in tokens; 0 turns it off.
    pub sliding_window: usize,
    /// Device `[num_heads]` f32 slopes, or 0 for no ALiBi.
    pub alibi_slopes: DevPtr,
    /// The f16 / bf16 prefill kernel's tiling (decode ignores it).
    pub prefill_tiling: PrefillTiling,
    /// Launch as a programmatic dependent launch (`PKV_LAUNCH_PROGRAMMATIC`, compute capability
    /// 9.0 and later; elsewhere a plain launch): the launch and block dispatch overlap the tail
    /// of the kernel before it on the stream (e.g. the layer's cache write), and every block
    /// waits for that kernel's completion before reading anything, so results are unchanged.
    pub programmatic_launch: bool,
}

impl AttnParamsRaw {
    /// Plain attention: `num_heads` heads, scale `1/sqrt(head_dim)`, no soft-cap, window or
    /// ALiBi.
    pub fn new(num_heads: usize, head_dim: usize) -> Self {
        Self {
            num_heads,
            scale: 1.0 / (head_dim as f32).sqrt(),
            softcap: 0.0,
            sliding_window: 0,
            alibi_slopes: 0,
            prefill_tiling: PrefillTiling::Auto,
            programmatic_launch: false,
        }
    }
}

/// Device scratch of split-K decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workspace {
    /// Device, 16-byte aligned; 0 when `bytes` is 0. Its first
    /// [`DecodePlan::counter_bytes`] must be zero before a launch (zero them when the buffer is
    /// new or last served another plan; each launch leaves them zero).
    pub ptr: DevPtr,
    /// Bytes at `ptr`: at least [`DecodePlan::workspace_bytes`].
    pub bytes: usize,
}

impl Workspace {
    /// No workspace (plans of one split need none).
    pub const NONE: Self = Self { ptr: 0, bytes: 0 };
}
