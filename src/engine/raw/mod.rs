//! The device backend over raw pointers and the caller's stream (feature `cuda` or `cuda-emu`):
//! the step executor on pagedkv's CUDA kernels through [`crate::cuda_raw`], with no cudarc type
//! in its API. The caller supplies device memory and host-to-device copies through
//! [`RawDevice`] (on its own driver binding: candle's cudarc 0.19, pagedkv's
//! [`Gpu`](crate::cuda::Gpu), the CPU emulation) and the model's projections as
//! [`DeviceRows`] views of its own buffers (a fused QKV output in place), so a client such as
//! a candle model drives the engine on its own stream: launches queue behind the model's
//! matmuls with no synchronisation between them.
//!
//! Per step the backend stages the batch's metadata (slot mapping, query starts, context
//! lengths, block tables) in host memory, checks it with the CPU kernels' rules, and copies it
//! with **one** copy into one device block allocated once and grown only when a batch
//! outgrows it; [`end`](KvBackend::end) waits for the stream, so the staging buffer is free
//! again for the next step and an error surfaces in the step that caused it. Decode uses a
//! [`DecodePlan`] fixed for the capacities (its workspace allocated with it).

mod backend;
mod buffers;

pub use backend::RawBackend;

use crate::cuda_raw::{CuStream, DevPtr, Rows};
use crate::error::EngineError;

/// Device memory and copies for a [`RawBackend`], on one stream of one device context.
///
/// # Safety
/// An implementation guarantees: [`alloc`](Self::alloc) returns the address of at least
/// `bytes` bytes of device memory, 16-byte aligned, in the context that
/// [`stream`](Self::stream) belongs to, valid until passed to [`free`](Self::free);
/// [`copy_to_device`](Self::copy_to_device) queues the copy on that stream (or performs it
/// before returning); [`synchronize`](Self::synchronize) returns only once all work queued on
/// the stream has completed; the context is current on the calling thread whenever the
/// backend launches (a method may bind it; the backend calls one before each group of
/// launches).
pub unsafe trait RawDevice {
    /// The stream every launch and copy of the backend goes to.
    fn stream(&self) -> CuStream;
    /// Streaming multiprocessors of the device (sizes the decode plan).
    fn sm_count(&self) -> usize;
    /// Makes the device's context current on this thread.
    ///
    /// # Errors
    /// The driver's refusal, as [`EngineError`].
    fn bind(&self) -> Result<(), EngineError>;
    /// Allocates `bytes` (> 0) of device memory; see the trait's contract.
    ///
    /// # Errors
    /// Out of memory or a driver failure, as [`EngineError`].
    fn alloc(&self, bytes: usize) -> Result<DevPtr, EngineError>;
    /// Frees an allocation of [`alloc`](Self::alloc).
    ///
    /// # Safety
    /// `ptr` came from this device's `alloc`, is freed once, and no queued work still uses it.
    unsafe fn free(&self, ptr: DevPtr);
    /// Queues a copy of `src` to `dst` on the stream.
    ///
    /// # Safety
    /// `dst` is device memory of at least `src.len()` bytes from `alloc`; the bytes of `src`
    /// stay allocated and unmodified until the next [`synchronize`](Self::synchronize)
    /// returns.
    ///
    /// # Errors
    /// The driver's refusal, as [`EngineError`].
    unsafe fn copy_to_device(&self, dst: DevPtr, src: &[u8]) -> Result<(), EngineError>;
    /// Waits for all work queued on the stream and reports its errors.
    ///
    /// # Errors
    /// A failed copy or kernel, as [`EngineError`].
    fn synchronize(&self) -> Result<(), EngineError>;
}

/// A step's token rows on the device: `tokens` rows of `[heads][head_dim]` elements at `rows`
/// (its stride lets a fused projection be passed in place). What the model gives the backend
/// for queries, keys and values, and what the backend returns as attention output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRows {
    /// Address and token stride (elements).
    pub rows: Rows,
    /// Rows (the step's tokens).
    pub tokens: usize,
}

/// How many sequences, tokens, block-table entries and copy pairs a [`RawBackend`]'s device
/// buffers hold before a batch makes it grow them (growing waits for the stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawCaps {
    /// Sequences of one step (the engine's `max_running`).
    pub max_seqs: usize,
    /// Tokens of one step (the engine's `max_batched_tokens`).
    pub max_tokens: usize,
    /// Block-table entries per sequence (`ceil(max_context / block_size)`); also the decode
    /// plan's context capacity.
    pub max_blocks_per_seq: usize,
    /// Copy-on-write pairs of one step.
    pub max_copies: usize,
}

impl RawCaps {
    /// Capacities for an engine of `cfg` with `block_size` tokens per page on a pool of
    /// `pages`: its most sequences and tokens of a step, its longest context, a copy per
    /// sequence; within what a decode plan takes (65535 sequences, contexts of `i32::MAX`
    /// tokens), the limits the backend's growth stops at too.
    pub fn for_engine(cfg: &super::EngineConfig, block_size: usize, pages: u32) -> Self {
        let block_size = block_size.max(1);
        let blocks = (cfg.max_context as usize).div_ceil(block_size);
        let context_blocks = i32::MAX as usize / block_size;
        Self {
            max_seqs: (cfg.max_running as usize).clamp(1, backend::MAX_PLAN_SEQS),
            max_tokens: cfg.max_batched_tokens.max(1) as usize,
            max_blocks_per_seq: blocks.min(pages as usize).min(context_blocks).max(1),
            max_copies: cfg.max_running.max(1) as usize,
        }
    }
}

impl<D: RawDevice> super::Engine<RawBackend<D>> {
    /// An engine whose cache is a view of `shared`'s arena, at `arena_base` in `dev`'s device
    /// memory, with `shape`'s geometry (its tokens per page), on the CUDA kernels through raw
    /// pointers and `dev`'s stream, for a model of `query_heads` heads; device buffers sized by
    /// [`RawCaps::for_engine`].
    ///
    /// # Errors
    /// [`EngineError::InvalidConfig`] for a `max_running` over the 65535 sequences a decode
    /// plan takes, or prefill rows (`max_prefill_chunk`, `max_batched_tokens` and
    /// `max_context`, whichever is least) longer than a prefill launch takes
    /// ([`paged_attention_prefill`](crate::cuda_raw::paged_attention_prefill)'s
    /// `OverCapacity`); as [`RawBackend::new`] and [`Engine::new`](super::Engine::new).
    ///
    /// # Safety
    /// `arena_base` is the device memory of `shared`'s arena: `shared.pool().total()` pages of
    /// `shared.page_bytes()` bytes in `dev`'s context, alive as long as the engine, and every
    /// other user of those pages keeps the page-ownership rule of [`RawBackend::new`] (every
    /// engine built on `shared` does); the engine's model hands the backend only rows as
    /// [`RawBackend::new`] requires; `dev` keeps [`RawDevice`]'s contract.
    pub unsafe fn raw(
        shared: &crate::sync::Arc<super::SharedArena>,
        dev: D,
        arena_base: DevPtr,
        cfg: super::EngineConfig,
        shape: &crate::kv::ModelKvShape,
        query_heads: usize,
    ) -> Result<Self, EngineError> {
        if cfg.max_running as usize > backend::MAX_PLAN_SEQS {
            return Err(EngineError::InvalidConfig(format!(
                "max_running {} is over the {} sequences a decode plan takes",
                cfg.max_running,
                backend::MAX_PLAN_SEQS
            )));
        }
        // A row of a step is at most a prefill chunk, the step's tokens and the context
        // (`tokens_wanted`); one longer than a prefill launch takes would fail every step
        // that schedules it, so such a configuration is refused here, not at run time.
        let longest = cfg
            .max_prefill_chunk
            .min(cfg.max_batched_tokens)
            .min(cfg.max_context) as usize;
        let group = query_heads / shape.num_kv_heads.max(1);
        let limit = crate::cuda_raw::prefill_max_query_len(shape.dtype, group);
        if longest > limit {
            return Err(EngineError::InvalidConfig(format!(
                "prefill rows of up to {longest} tokens (max_prefill_chunk, max_batched_tokens \
                 and max_context) are over the {limit} a prefill launch takes with {group} \
                 query heads per KV head"
            )));
        }
        let (pages, page_bytes) = (shared.pool().total(), shared.page_bytes());
        let tokens = shape.tokens_per_page(page_bytes)?;
        let config = shape
            .config(tokens, pages as usize)?
            .with_page_stride(page_bytes)?;
        let caps = RawCaps::for_engine(&cfg, tokens, pages);
        // SAFETY: the caller's contract covers the arena, the page-ownership rule and `dev`;
        // the engine runs only its own batcher's current batch on the backend, before the
        // batcher's next schedule or commit, from `shared`'s pool.
        let backend = unsafe {
            RawBackend::new(
                dev,
                arena_base,
                &config,
                query_heads,
                caps,
                cfg.swap_space_pages() as usize,
            )?
        };
        Self::new(shared, cfg, backend)
    }

    /// Makes the backend's attention launches programmatic dependent launches (or not):
    /// [`RawBackend::set_programmatic_launch`].
    pub fn set_programmatic_launch(&mut self, on: bool) {
        self.backend_mut().set_programmatic_launch(on);
    }
}
