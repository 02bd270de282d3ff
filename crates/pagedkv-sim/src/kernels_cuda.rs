//! One engine's kernel work for a step on a GPU (feature `cuda`): the same steps as
//! [`super::kernels`] on a device KV cache of the same layout, through the crate's CUDA launch
//! wrappers. The step's batch tensors and random projections are uploaded each step (they are
//! small next to the KV traffic); the step ends with a stream synchronisation so that errors
//! surface in the step that caused them.

use super::kernels::{kv_bytes_read, to_pairs};
use crate::error::SimError;
use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use pagedkv::attn::{AttnParams, PagedSeqs};
use pagedkv::cuda::{
    DecodeWorkspace, DeviceAttnParams, DeviceKvCache, DeviceSeqs, Gpu, PinnedSwapSpace,
};
use pagedkv::kv::{KvCacheConfig, KvElem};
use pagedkv::sched::Batch;
use rand::{rngs::SmallRng, Rng};

/// Host elements the projections are sliced from before upload.
const NOISE: usize = 1 << 21;

/// Device state of one engine's kernels for element type `T`.
#[derive(Debug)]
pub(crate) struct DeviceKernels<T: KvElem + DeviceRepr> {
    gpu: Gpu,
    cache: DeviceKvCache,
    swap: PinnedSwapSpace,
    params: DeviceAttnParams,
    ws: DecodeWorkspace,
    noise: Vec<T>,
    out: Option<CudaSlice<T>>,
    pairs: Vec<(u32, u32)>,
    heads: usize,
}

impl<T: KvElem + DeviceRepr + ValidAsZeroBits> DeviceKernels<T> {
    /// A device cache of `kv`'s geometry on its own stream of `gpu`, and a pinned swap space.
    pub(crate) fn new(
        gpu: &Gpu,
        kv: KvCacheConfig,
        swap_blocks: usize,
        heads: usize,
        rng: &mut SmallRng,
    ) -> Result<Self, SimError> {
        let gpu = gpu.with_new_stream()?;
        let params = DeviceAttnParams::upload(&gpu, &kv, &AttnParams::new(heads, kv.head_dim()))?;
        Ok(Self {
            cache: DeviceKvCache::new(&gpu, kv)?,
            swap: PinnedSwapSpace::new(&gpu, &kv, swap_blocks.max(1))?,
            params,
            ws: DecodeWorkspace::new(),
            noise: (0..NOISE)
                .map(|_| T::from_f32(rng.gen_range(-1.0..1.0)))
                .collect(),
            out: None,
            pairs: Vec::new(),
            heads,
            gpu,
        })
    }

    /// Uploads `len` random elements.
    fn projection(&self, rng: &mut SmallRng, len: usize) -> Result<CudaSlice<T>, SimError> {
        if len > self.noise.len() {
            return Err(SimError::InvalidConfig(format!(
                "a step needs {len} projection values; the random pool holds {}",
                self.noise.len()
            )));
        }
        let at = rng.gen_range(0..=self.noise.len() - len);
        Ok(self.gpu.upload(&self.noise[at..at + len])?)
    }

    /// Runs one step's kernels. Returns the KV bytes the attention read.
    pub(crate) fn run(&mut self, batch: &Batch, rng: &mut SmallRng) -> Result<u64, SimError> {
        let cfg = *self.cache.config();
        if !batch.swap_out.is_empty() {
            to_pairs(&batch.swap_out, &mut self.pairs);
            self.cache
                .swap_out(&self.gpu, &mut self.swap, &self.pairs)?;
        }
        if !batch.swap_in.is_empty() {
            to_pairs(&batch.swap_in, &mut self.pairs);
            self.cache.swap_in(&self.gpu, &mut self.swap, &self.pairs)?;
        }
        if !batch.copies.is_empty() {
            to_pairs(&batch.copies, &mut self.pairs);
            self.cache.copy_blocks(&self.gpu, &self.pairs)?;
        }
        let tokens = batch.num_tokens();
        if tokens == 0 {
            self.gpu.synchronize()?;
            return Ok(0);
        }
        let kv_len = tokens * cfg.num_kv_heads() * cfg.head_dim();
        let q_len = tokens * self.heads * cfg.head_dim();
        if self.out.as_ref().map(|o| o.len()) != Some(q_len) {
            self.out = Some(self.gpu.alloc_zeros::<T>(q_len)?);
        }
        let seqs = PagedSeqs {
            block_tables: &batch.block_tables,
            max_blocks_per_seq: batch.max_blocks_per_seq,
            context_lens: &batch.context_lens,
        };
        let decode_only = batch.num_seqs() == tokens;
        let dev_seqs = if decode_only {
            DeviceSeqs::upload(&self.gpu, &cfg, &seqs)?
        } else {
            DeviceSeqs::upload_prefill(&self.gpu, &cfg, &seqs, &batch.query_start_loc)?
        };
        let slots = self.gpu.upload(&batch.slot_mapping)?;
        for layer in 0..cfg.num_layers() {
            let key = self.projection(rng, kv_len)?;
            let value = self.projection(rng, kv_len)?;
            self.cache
                .reshape_and_cache(&self.gpu, layer, &key, &value, &slots)?;
            let query = self.projection(rng, q_len)?;
            let out = self
                .out
                .as_mut()
                .unwrap_or_else(|| unreachable!("allocated above"));
            if decode_only {
                self.cache.paged_attention_decode(
                    &self.gpu,
                    layer,
                    &query,
                    &dev_seqs,
                    &self.params,
                    &mut self.ws,
                    out,
                )?;
            } else {
                self.cache.paged_attention_prefill(
                    &self.gpu,
                    layer,
                    &query,
                    &dev_seqs,
                    &self.params,
                    out,
                )?;
            }
        }
        self.gpu.synchronize()?;
        Ok(kv_bytes_read(&cfg, batch))
    }
}
