//! The CPU backend of the step executor: the CPU kernels ([`crate::attn::cpu`]) on one model's
//! view of the host arena, with a host swap space.

use super::exec::KvBackend;
use crate::attn::{cpu, AttnWorkspace};
use crate::error::EngineError;
use crate::kv::{ArenaView, KvCacheConfig, KvElem, SwapSpace};
use crate::kv::{AttnParams, PagedSeqs};
use crate::sched::Batch;
use std::marker::PhantomData;

/// CPU kernels over an [`ArenaView`], element type `T` (the view's dtype).
///
/// Every engine's backend works on the one arena at the same time. What makes that sound is
/// the block pool: a batch from a [`Batcher`](crate::sched::Batcher) names only pages its
/// engine's sequences hold, pages are written only while held alone (copy-on-write), and the
/// pages a swap-out reads stay held until the batch has run (the batcher defers their
/// release). [`HostBackend::new`] is `unsafe` because it is the caller who promises that only
/// such batches are run on it; [`Engine`](super::Engine) keeps that promise for its own
/// batcher.
#[derive(Debug)]
pub struct HostBackend<T: KvElem> {
    view: ArenaView,
    /// `None` when built with no swap slots (recompute preemption never swaps).
    swap: Option<SwapSpace>,
    heads: usize,
    ws: AttnWorkspace,
    out: Vec<T>,
    _elem: PhantomData<T>,
}

impl<T: KvElem> HostBackend<T> {
    /// A backend over `view` for a model of `query_heads` heads, with a swap space of
    /// `swap_blocks` pages of the view's shape (none for 0: recompute preemption never swaps).
    ///
    /// # Errors
    /// [`EngineError::InvalidConfig`] if `T` is not the view's dtype or `query_heads` is not a
    /// positive multiple of its KV heads; the swap space's allocation errors.
    ///
    /// # Safety
    /// Every batch run on this backend is the current batch of a batcher for the view's
    /// engine whose blocks come from the pool that hands out the view's arena pages, run
    /// before that batcher's next schedule or commit; and every other user of the arena keeps
    /// the same rule. Then no page is written by one engine while another reads or writes it.
    pub unsafe fn new(
        view: ArenaView,
        query_heads: usize,
        swap_blocks: usize,
    ) -> Result<Self, EngineError> {
        let cfg = *view.config();
        if cfg.dtype() != T::DTYPE {
            return Err(EngineError::InvalidConfig(format!(
                "the backend's element type is {:?}, the view's dtype {:?}",
                T::DTYPE,
                cfg.dtype()
            )));
        }
        check_heads(&cfg, query_heads)?;
        Ok(Self {
            swap: match swap_blocks {
                0 => None,
                n => Some(SwapSpace::new(&cfg, n)?),
            },
            view,
            heads: query_heads,
            ws: AttnWorkspace::new(),
            out: Vec::new(),
            _elem: PhantomData,
        })
    }

    /// The view this backend works on.
    pub fn view(&self) -> &ArenaView {
        &self.view
    }
}

/// A swap asked of a backend built without swap slots: nothing to do for no pairs, refused
/// otherwise (its batcher, given no slots, never swaps).
pub(crate) fn no_swap_space(pairs: &[(u32, u32)]) -> Result<(), EngineError> {
    if pairs.is_empty() {
        return Ok(());
    }
    Err(EngineError::InvalidConfig(
        "a swap asked of a backend built with no swap slots".into(),
    ))
}

/// Checks that `query_heads` is a positive multiple of the cache's KV heads and that a
/// token's query row (`query_heads x head_dim` elements) fits in an `i32`.
pub(crate) fn check_heads(cfg: &KvCacheConfig, query_heads: usize) -> Result<(), EngineError> {
    if query_heads == 0 || query_heads % cfg.num_kv_heads() != 0 {
        return Err(EngineError::InvalidConfig(format!(
            "{query_heads} query heads is not a positive multiple of {} KV heads",
            cfg.num_kv_heads()
        )));
    }
    // A token's query row is indexed with 32 bits by the kernels; bounded here, a step's
    // output (tokens x row, tokens a u32) cannot overflow either.
    if query_heads
        .checked_mul(cfg.head_dim())
        .is_none_or(|row| row > i32::MAX as usize)
    {
        return Err(EngineError::InvalidConfig(format!(
            "{query_heads} query heads of {} dims: a token's row exceeds i32::MAX elements",
            cfg.head_dim()
        )));
    }
    Ok(())
}

fn seqs(batch: &Batch) -> PagedSeqs<'_> {
    PagedSeqs {
        block_tables: &batch.block_tables,
        max_blocks_per_seq: batch.max_blocks_per_seq,
        context_lens: &batch.context_lens,
    }
}

impl<T: KvElem> KvBackend for HostBackend<T> {
    type Buf = [T];

    fn config(&self) -> &KvCacheConfig {
        self.view.config()
    }

    fn query_heads(&self) -> usize {
        self.heads
    }

    fn swap_slots(&self) -> Option<usize> {
        Some(self.swap.as_ref().map_or(0, |s| s.config().num_blocks()))
    }

    fn swap_out(&mut self, pairs: &[(u32, u32)]) -> Result<(), EngineError> {
        let Some(swap) = self.swap.as_mut() else {
            return no_swap_space(pairs);
        };
        // SAFETY: the sources are pages this engine swapped out this step; the batcher keeps
        // them allocated to this engine until the batch has run (`new`'s contract).
        unsafe { self.view.swap_out(swap, pairs)? };
        Ok(())
    }

    fn swap_in(&mut self, pairs: &[(u32, u32)]) -> Result<(), EngineError> {
        let Some(swap) = self.swap.as_ref() else {
            return no_swap_space(pairs);
        };
        // SAFETY: the destinations were allocated to this engine this step and are held by its
        // sequences alone (`new`'s contract).
        unsafe { self.view.swap_in(swap, pairs)? };
        Ok(())
    }

    fn copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<(), EngineError> {
        // SAFETY: copy-on-write: destinations are fresh pages this engine holds alone, sources
        // are held (shared, so only read by anyone) (`new`'s contract).
        unsafe { self.view.copy_blocks(pairs)? };
        Ok(())
    }

    fn begin(&mut self, batch: &Batch) -> Result<(), EngineError> {
        let len = batch.num_tokens() * self.heads * self.view.config().head_dim();
        self.out.resize(len, T::default());
        Ok(())
    }

    fn reshape_and_cache(
        &mut self,
        layer: usize,
        key: &[T],
        value: &[T],
        batch: &Batch,
    ) -> Result<(), EngineError> {
        // SAFETY: the slots are this step's new tokens, in pages this engine's running
        // sequences hold alone (the batcher copies a shared last block first; `new`'s contract).
        let kv = unsafe { self.view.layer_mut::<T>(layer)? };
        cpu::reshape_and_cache(kv, key, value, &batch.slot_mapping)?;
        Ok(())
    }

    fn decode(&mut self, layer: usize, query: &[T], batch: &Batch) -> Result<&[T], EngineError> {
        let params = AttnParams::new(self.heads, self.view.config().head_dim());
        // SAFETY: the block tables name pages this engine's sequences hold; no engine writes a
        // page it does not hold, and this engine's writes of the step are done (`new`'s
        // contract).
        let kv = unsafe { self.view.layer::<T>(layer)? };
        cpu::paged_attention_decode(
            &mut self.ws,
            kv,
            query,
            &seqs(batch),
            &params,
            &mut self.out,
        )?;
        Ok(&self.out)
    }

    fn prefill(&mut self, layer: usize, query: &[T], batch: &Batch) -> Result<&[T], EngineError> {
        let params = AttnParams::new(self.heads, self.view.config().head_dim());
        // SAFETY: as in `decode`.
        let kv = unsafe { self.view.layer::<T>(layer)? };
        cpu::paged_attention_prefill(
            &mut self.ws,
            kv,
            query,
            &batch.query_start_loc,
            &seqs(batch),
            &params,
            &mut self.out,
        )?;
        Ok(&self.out)
    }

    fn end(&mut self) -> Result<(), EngineError> {
        Ok(())
    }
}
