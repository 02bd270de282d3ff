//! The CUDA backend of the step executor (feature `cuda`): the CUDA kernels on one model's view
//! of the device arena, on the engine's own stream, with a pinned host swap space.

use super::exec::KvBackend;
use super::host::check_heads;
use crate::cuda::{
    DecodeWorkspace, DeviceArena, DeviceAttnParams, DeviceKvCache, DeviceSeqs, Gpu, PinnedSwapSpace,
};
use crate::error::EngineError;
use crate::kv::{AttnParams, PagedSeqs};
use crate::kv::{KvCacheConfig, KvElem, ModelKvShape};
use crate::sched::Batch;
use crate::sync::Arc;
use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};

/// CUDA kernels over a [`DeviceKvCache`] view of a [`DeviceArena`], element type `T`.
///
/// The step's metadata (block tables, context lengths, slots) is uploaded at
/// [`begin`](KvBackend::begin) into buffers allocated for that step;
/// [`end`](KvBackend::end) synchronises the engine's stream so that an error surfaces in the
/// step that caused it. [`RawBackend`](super::RawBackend) over this crate's
/// [`Gpu`](crate::cuda::Gpu) (`Engine::raw`) runs the same kernels with metadata buffers
/// allocated once and one copy per step, on any caller's stream. The same page-ownership rule as
/// [`HostBackend`](super::HostBackend) keeps engines on one arena apart; on the device a
/// breach is a wrong result, not undefined behaviour in Rust, so construction is safe.
#[derive(Debug)]
pub struct DeviceBackend<T: KvElem + DeviceRepr> {
    gpu: Gpu,
    cache: DeviceKvCache,
    swap: PinnedSwapSpace,
    params: DeviceAttnParams,
    ws: DecodeWorkspace,
    seqs: Option<DeviceSeqs>,
    slots: Option<CudaSlice<i64>>,
    out: Option<CudaSlice<T>>,
    heads: usize,
}

impl<T: KvElem + DeviceRepr + ValidAsZeroBits> DeviceBackend<T> {
    /// A backend over `arena` with `shape`'s geometry (its tokens per page), for a model of
    /// `query_heads` heads, on a new stream of `gpu`, with `swap_blocks` pinned swap pages.
    pub fn new(
        gpu: &Gpu,
        arena: &Arc<DeviceArena>,
        shape: &ModelKvShape,
        query_heads: usize,
        swap_blocks: usize,
    ) -> Result<Self, EngineError> {
        let tokens = shape.tokens_per_page(arena.page_bytes())?;
        let kv = shape.config(tokens, arena.num_pages())?;
        if kv.dtype() != T::DTYPE {
            return Err(EngineError::InvalidConfig(format!(
                "the backend's element type is {:?}, the model's dtype {:?}",
                T::DTYPE,
                kv.dtype()
            )));
        }
        check_heads(&kv, query_heads)?;
        let gpu = gpu.with_new_stream()?;
        let cache = DeviceKvCache::view(arena, &kv)?;
        let cfg = *cache.config();
        Ok(Self {
            params: DeviceAttnParams::upload(
                &gpu,
                &cfg,
                &AttnParams::new(query_heads, cfg.head_dim()),
            )?,
            swap: PinnedSwapSpace::new(&gpu, &cfg, swap_blocks.max(1))?,
            cache,
            ws: DecodeWorkspace::new(),
            seqs: None,
            slots: None,
            out: None,
            heads: query_heads,
            gpu,
        })
    }

    /// The engine's stream (uploads of the model's projections go here).
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
}

impl<T: KvElem + DeviceRepr + ValidAsZeroBits> KvBackend for DeviceBackend<T> {
    type Buf = CudaSlice<T>;

    fn config(&self) -> &KvCacheConfig {
        self.cache.config()
    }

    fn query_heads(&self) -> usize {
        self.heads
    }

    fn swap_out(&mut self, pairs: &[(u32, u32)]) -> Result<(), EngineError> {
        Ok(self.cache.swap_out(&self.gpu, &mut self.swap, pairs)?)
    }

    fn swap_in(&mut self, pairs: &[(u32, u32)]) -> Result<(), EngineError> {
        Ok(self.cache.swap_in(&self.gpu, &mut self.swap, pairs)?)
    }

    fn copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<(), EngineError> {
        Ok(self.cache.copy_blocks(&self.gpu, pairs)?)
    }

    fn begin(&mut self, batch: &Batch) -> Result<(), EngineError> {
        let cfg = *self.cache.config();
        let tokens = batch.num_tokens();
        let seqs = PagedSeqs {
            block_tables: &batch.block_tables,
            max_blocks_per_seq: batch.max_blocks_per_seq,
            context_lens: &batch.context_lens,
        };
        self.seqs = Some(if batch.num_seqs() == tokens {
            DeviceSeqs::upload(&self.gpu, &cfg, &seqs)?
        } else {
            DeviceSeqs::upload_prefill(&self.gpu, &cfg, &seqs, &batch.query_start_loc)?
        });
        self.slots = Some(self.gpu.upload(&batch.slot_mapping)?);
        let len = tokens * self.heads * cfg.head_dim();
        if self.out.as_ref().map(|o| o.len()) != Some(len) {
            self.out = Some(self.gpu.alloc_zeros::<T>(len)?);
        }
        Ok(())
    }

    fn reshape_and_cache(
        &mut self,
        layer: usize,
        key: &CudaSlice<T>,
        value: &CudaSlice<T>,
        _batch: &Batch,
    ) -> Result<(), EngineError> {
        let slots = self
            .slots
            .as_ref()
            .ok_or_else(|| EngineError::InvalidConfig("reshape_and_cache before begin".into()))?;
        Ok(self
            .cache
            .reshape_and_cache(&self.gpu, layer, key, value, slots)?)
    }

    fn decode(
        &mut self,
        layer: usize,
        query: &CudaSlice<T>,
        _batch: &Batch,
    ) -> Result<&CudaSlice<T>, EngineError> {
        let (Some(seqs), Some(out)) = (&self.seqs, self.out.as_mut()) else {
            return Err(EngineError::InvalidConfig("decode before begin".into()));
        };
        self.cache.paged_attention_decode(
            &self.gpu,
            layer,
            query,
            seqs,
            &self.params,
            &mut self.ws,
            out,
        )?;
        Ok(out)
    }

    fn prefill(
        &mut self,
        layer: usize,
        query: &CudaSlice<T>,
        _batch: &Batch,
    ) -> Result<&CudaSlice<T>, EngineError> {
        let (Some(seqs), Some(out)) = (&self.seqs, self.out.as_mut()) else {
            return Err(EngineError::InvalidConfig("prefill before begin".into()));
        };
        self.cache
            .paged_attention_prefill(&self.gpu, layer, query, seqs, &self.params, out)?;
        Ok(out)
    }

    fn end(&mut self) -> Result<(), EngineError> {
        self.seqs = None;
        self.slots = None;
        Ok(self.gpu.synchronize()?)
    }
}

impl<T: KvElem + DeviceRepr + ValidAsZeroBits> super::Engine<DeviceBackend<T>> {
    /// An engine whose cache is a view of `shared`'s device arena with `shape`'s geometry, on
    /// the CUDA kernels (its own stream of `gpu`), for a model of `query_heads` heads.
    pub fn cuda(
        shared: &Arc<super::SharedArena>,
        gpu: &Gpu,
        cfg: super::EngineConfig,
        shape: &ModelKvShape,
        query_heads: usize,
    ) -> Result<Self, EngineError> {
        let arena = shared.device_arena().ok_or_else(|| {
            EngineError::InvalidConfig("the shared arena is not a device arena".into())
        })?;
        let backend = DeviceBackend::new(gpu, arena, shape, query_heads, cfg.swap_blocks as usize)?;
        Self::new(shared, cfg, backend)
    }
}
