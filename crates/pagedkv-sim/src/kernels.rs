//! One engine's kernel work for a step, on the CPU kernels and the engine's view of the shared
//! host KV arena: swaps and copies first, then per layer `reshape_and_cache` and paged
//! attention. Random vectors stand in for the model's projections, so every byte of KV traffic
//! is real.
//!
//! Every engine thread runs these on the one arena at the same time. What makes that sound is
//! the block pool: a batch names only pages its engine's sequences hold (the batcher builds it
//! from their block tables), pages are written only while held alone (copy-on-write), and the
//! pages a swap-out reads stay held until the batch has run (the batcher defers their release).

use crate::error::SimError;
use pagedkv::attn::{cpu, AttnParams, AttnWorkspace, PagedSeqs};
use pagedkv::kv::{ArenaView, KvCacheConfig, KvElem, SwapSpace};
use pagedkv::sched::Batch;
use rand::{rngs::SmallRng, Rng};

/// Elements of the random pool the projections are sliced from (several steps' worth, so
/// consecutive steps see different values).
const NOISE: usize = 1 << 21;

/// Reusable buffers of one engine's kernels for element type `T`.
#[derive(Debug)]
pub(crate) struct KernelBuffers<T: KvElem> {
    cache: ArenaView,
    swap: SwapSpace,
    noise: Vec<T>,
    out: Vec<T>,
    ws: AttnWorkspace,
    pairs: Vec<(u32, u32)>,
}

impl<T: KvElem> KernelBuffers<T> {
    /// Kernels over `view` (this engine's view of the arena) and a swap space of
    /// `swap_blocks` blocks of its shape.
    pub(crate) fn new(
        view: ArenaView,
        swap_blocks: usize,
        rng: &mut SmallRng,
    ) -> Result<Self, SimError> {
        Ok(Self {
            swap: SwapSpace::new(view.config(), swap_blocks.max(1))?,
            cache: view,
            noise: (0..NOISE)
                .map(|_| T::from_f32(rng.gen_range(-1.0..1.0)))
                .collect(),
            out: Vec::new(),
            ws: AttnWorkspace::new(),
            pairs: Vec::new(),
        })
    }

    /// Runs one step's kernels. Returns the KV bytes the attention read.
    pub(crate) fn run(
        &mut self,
        batch: &Batch,
        heads: usize,
        rng: &mut SmallRng,
    ) -> Result<u64, SimError> {
        let (cache, swap) = (&self.cache, &mut self.swap);
        let cfg = *cache.config();
        // Swap-outs first: a swap-in of this step may target a page a swap-out reads last.
        if !batch.swap_out.is_empty() {
            to_pairs(&batch.swap_out, &mut self.pairs);
            // SAFETY: the sources are pages this engine swapped out this step; the batcher
            // keeps them allocated to this engine until the batch has run (module docs).
            unsafe { cache.swap_out(swap, &self.pairs)? };
        }
        if !batch.swap_in.is_empty() {
            to_pairs(&batch.swap_in, &mut self.pairs);
            // SAFETY: the destinations were allocated to this engine this step and are held
            // by its sequences alone.
            unsafe { cache.swap_in(swap, &self.pairs)? };
        }
        if !batch.copies.is_empty() {
            to_pairs(&batch.copies, &mut self.pairs);
            // SAFETY: copy-on-write: destinations are fresh pages this engine holds alone,
            // sources are held (shared, so only read by anyone).
            unsafe { cache.copy_blocks(&self.pairs)? };
        }
        let tokens = batch.num_tokens();
        if tokens == 0 {
            return Ok(0);
        }
        let kv_len = tokens * cfg.num_kv_heads() * cfg.head_dim();
        let q_len = tokens * heads * cfg.head_dim();
        self.out.resize(q_len, T::default());
        let seqs = PagedSeqs {
            block_tables: &batch.block_tables,
            max_blocks_per_seq: batch.max_blocks_per_seq,
            context_lens: &batch.context_lens,
        };
        let params = AttnParams::new(heads, cfg.head_dim());
        let decode_only = batch.num_seqs() == tokens;
        for layer in 0..cfg.num_layers() {
            {
                let key = noise(&self.noise, rng, kv_len)?;
                let value = noise(&self.noise, rng, kv_len)?;
                // SAFETY: the slots are this step's new tokens, in pages this engine's running
                // sequences hold alone (the batcher copies a shared last block first).
                let view = unsafe { cache.layer_mut::<T>(layer)? };
                cpu::reshape_and_cache(view, key, value, &batch.slot_mapping)?;
            }
            let query = noise(&self.noise, rng, q_len)?;
            // SAFETY: the block tables name pages this engine's sequences hold; no other engine
            // writes a page it does not hold, and this engine's writes are done.
            let kv = unsafe { cache.layer::<T>(layer)? };
            if decode_only {
                cpu::paged_attention_decode(
                    &mut self.ws,
                    kv,
                    query,
                    &seqs,
                    &params,
                    &mut self.out,
                )?;
            } else {
                cpu::paged_attention_prefill(
                    &mut self.ws,
                    kv,
                    query,
                    &batch.query_start_loc,
                    &seqs,
                    &params,
                    &mut self.out,
                )?;
            }
        }
        Ok(kv_bytes_read(&cfg, batch))
    }
}

/// A slice of `len` random elements of `pool` at a random offset.
fn noise<'a, T>(pool: &'a [T], rng: &mut SmallRng, len: usize) -> Result<&'a [T], SimError> {
    if len > pool.len() {
        return Err(SimError::InvalidConfig(format!(
            "a step needs {len} projection values; the random pool holds {}",
            pool.len()
        )));
    }
    let at = rng.gen_range(0..=pool.len() - len);
    Ok(&pool[at..at + len])
}

/// KV bytes a step's attention reads: every context token's K and V in every layer.
pub(crate) fn kv_bytes_read(cfg: &KvCacheConfig, batch: &Batch) -> u64 {
    let ctx: u64 = batch.context_lens.iter().map(|&c| c as u64).sum();
    let per_token =
        2 * cfg.num_layers() * cfg.num_kv_heads() * cfg.head_dim() * cfg.dtype().size_bytes();
    ctx * per_token as u64
}

/// The batch's `(i32, i32)` block pairs as the cache APIs' `(u32, u32)`.
pub(crate) fn to_pairs(src: &[(i32, i32)], dst: &mut Vec<(u32, u32)>) {
    dst.clear();
    dst.extend(src.iter().map(|&(a, b)| (a as u32, b as u32)));
}
