//! [`RawBackend`]: the step executor's backend over raw pointers (see the parent module).

use super::buffers::{free_buffers, Buffers};
use super::{DeviceRows, RawCaps, RawDevice};
use crate::cuda_raw::{
    self, AttnParamsRaw, CacheView, DecodeMode, DecodePlan, DevPtr, Rows, SeqTables,
};
use crate::engine::exec::KvBackend;
use crate::engine::host::{check_heads, no_swap_space};
use crate::error::{AttnError, EngineError, RawError};
use crate::kv::{
    check_block_mapping, check_len, check_query_starts, check_seqs, check_slots, KvArena,
    KvCacheConfig, PagedSeqs,
};
use crate::sched::Batch;

/// The step executor's backend on pagedkv's CUDA kernels over raw pointers: device memory and
/// copies from a [`RawDevice`], the model's projections as [`DeviceRows`], every launch on the
/// device's stream; per step one metadata copy, and [`end`](KvBackend::end) waits for the
/// stream.
///
/// Several engines' backends may work on one arena at once under the same page-ownership
/// rule as [`HostBackend`](crate::engine::HostBackend) (see [`RawBackend::new`]).
#[derive(Debug)]
pub struct RawBackend<D: RawDevice> {
    dev: D,
    cache: CacheView,
    heads: usize,
    params: AttnParamsRaw,
    mode: DecodeMode,
    bufs: Buffers,
    /// Host staging of the metadata block (`bufs.layout.total` bytes); free again once `end`
    /// (or a growth) synchronised the stream.
    staging: Vec<u8>,
    /// Whether a copy from the staging's step region (`begin`'s) or its copy-pairs region
    /// (`copy_blocks`') is queued and not yet synchronised: [`RawDevice::copy_to_device`]
    /// may read its source until then, so a second `begin` or `copy_blocks` in one step (the
    /// trait's order has one of each, but its methods are safe to call in any) waits first.
    staged: Staged,
    /// Host swap space: `swap_blocks` pages of the arena's page size, a block at the start of
    /// each (`None` for no swap slots: recompute preemption never swaps).
    swap: Option<KvArena>,
    /// Whether `swap` is pinned (`cuda_raw::host_register`): its copies are then asynchronous
    /// DMA; pageable, a swap-out blocks the engine's thread until its copies have run.
    swap_pinned: bool,
    /// `[src, dst]` pairs of the current swap, reused.
    swap_pairs: Vec<[i64; 2]>,
    /// The current step's shape, set by `begin`.
    step: Option<StepShape>,
    /// The attention output of the current step (rows of the output buffer), set by `begin`.
    out: DeviceRows,
}

/// The most sequences a decode plan (and so a launch) takes (`pkv_decode_plan_init`).
pub(super) const MAX_PLAN_SEQS: usize = 65535;

#[derive(Debug, Clone, Copy)]
struct StepShape {
    tokens: usize,
    seqs: usize,
    blocks_per_seq: usize,
    max_query_len: usize,
    /// Every row exactly one token: what `decode` launches over (one query row per sequence).
    one_token_rows: bool,
}

impl<D: RawDevice> RawBackend<D> {
    /// A backend for a model of `query_heads` heads whose cache is `config`'s view of the
    /// arena at `arena_base` (on `dev`'s device), with device buffers for `caps` and a host
    /// swap space of `swap_blocks` blocks.
    ///
    /// # Errors
    /// [`EngineError::Raw`] for a geometry without kernels, a plan the kernels refuse, or an
    /// `arena_base` that is null or not 16-byte aligned, [`EngineError::InvalidConfig`] for
    /// heads that do not divide or empty capacities, and `dev`'s allocation errors.
    ///
    /// # Safety
    /// `arena_base` is device memory of `dev`'s context holding `config.num_blocks()` pages of
    /// `config.page_bytes()` bytes, alive as long as the backend; every batch run on the
    /// backend is the current batch of a batcher for this engine whose blocks come from the
    /// pool that hands out the arena's pages, run before that batcher's next schedule or
    /// commit (as for [`HostBackend::new`](crate::engine::HostBackend::new)); every
    /// [`DeviceRows`] handed to its [`KvBackend`] methods (by the engine's model) names device
    /// memory of `dev`'s context holding its `tokens` rows of the call's heads x head_dim
    /// elements of the cache's dtype at its stride, alive until the step's `end` (the kernels
    /// read and write through these addresses, which the backend cannot check); and `dev`
    /// keeps its trait's contract.
    pub unsafe fn new(
        dev: D,
        arena_base: DevPtr,
        config: &KvCacheConfig,
        query_heads: usize,
        caps: RawCaps,
        swap_blocks: usize,
    ) -> Result<Self, EngineError> {
        cuda_raw::geometry(config)?;
        check_heads(config, query_heads)?;
        // Every launch refuses a cache base that is null or off the 16-byte grid: refused
        // here, not by every step's first cache write.
        if arena_base == 0 {
            return Err(RawError::NullPointer { what: "arena_base" }.into());
        }
        if arena_base % cuda_raw::VIEW_ALIGN as u64 != 0 {
            return Err(RawError::Misaligned {
                what: "arena_base",
                align: cuda_raw::VIEW_ALIGN,
            }
            .into());
        }
        if caps.max_seqs == 0 || caps.max_tokens == 0 || caps.max_blocks_per_seq == 0 {
            return Err(EngineError::InvalidConfig(format!(
                "raw backend capacities must be positive: {caps:?}"
            )));
        }
        let cache = CacheView {
            base: arena_base,
            config: *config,
        };
        let params = AttnParamsRaw::new(query_heads, config.head_dim());
        let mode = DecodeMode::Auto;
        // Swap pages of the arena's page size (on the 16-byte grid; a block fills its start).
        // Made before the device buffers, which only `Drop` frees once `Self` exists.
        let swap = match swap_blocks {
            0 => None,
            n => Some(KvArena::new(n, config.page_bytes())?),
        };
        let bufs = Buffers::allocate(&dev, &cache, query_heads, mode, caps)?;
        let mut backend = Self {
            staging: vec![0; bufs.layout.total],
            dev,
            cache,
            heads: query_heads,
            params,
            mode,
            bufs,
            swap,
            swap_pinned: false,
            staged: Staged::default(),
            swap_pairs: Vec::new(),
            step: None,
            out: DeviceRows {
                rows: Rows::dense(0, query_heads, config.head_dim()),
                tokens: 0,
            },
        };
        backend.pin_swap_space();
        Ok(backend)
    }

    /// Pins the swap space, if any; where the device refuses (a locked-memory limit, say) it
    /// stays pageable: slower swaps, the same results.
    fn pin_swap_space(&mut self) {
        let Some(space) = &self.swap else { return };
        if self.dev.bind().is_err() {
            return;
        }
        // SAFETY: the swap space is this backend's own host allocation of `total_bytes`,
        // registered nowhere else; `Drop` unregisters it before the allocation is freed.
        let pinned = unsafe {
            cuda_raw::host_register(
                space.base_ptr().cast::<std::ffi::c_void>(),
                space.total_bytes(),
            )
        };
        self.swap_pinned = pinned.is_ok();
    }

    /// The host swap space (`None` without swap slots).
    pub fn swap_space(&self) -> Option<&KvArena> {
        self.swap.as_ref()
    }

    /// Whether the host swap space is pinned (page-locked), so swaps are asynchronous copies at
    /// full PCIe bandwidth; `false` without swap space, or where the device refused to pin it
    /// (the swaps then copy pageable memory: correct, slower, and a swap-out waits for its
    /// copies).
    pub fn swap_pinned(&self) -> bool {
        self.swap_pinned
    }

    /// Waits for the stream: every queued copy has read its staging bytes.
    fn settle(&mut self) -> Result<(), EngineError> {
        self.dev.synchronize()?;
        self.staged = Staged::default();
        Ok(())
    }

    /// The device handle.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// The capacities of the device buffers now.
    pub fn caps(&self) -> RawCaps {
        self.bufs.caps
    }

    /// The decode plan now in use.
    pub fn plan(&self) -> &DecodePlan {
        &self.bufs.plan
    }

    /// Whether attention launches are programmatic dependent launches
    /// ([`AttnParamsRaw::programmatic_launch`]); off by default.
    pub fn programmatic_launch(&self) -> bool {
        self.params.programmatic_launch
    }

    /// Makes every later attention launch a programmatic dependent launch (or not): on compute
    /// capability 9.0 and later, a layer's attention launch then overlaps the tail of its cache
    /// write; results are unchanged.
    pub fn set_programmatic_launch(&mut self, on: bool) {
        self.params.programmatic_launch = on;
    }

    /// Grows the device buffers to hold `need` (each capacity `need` passes at least doubled,
    /// up to the kernels' limits; the others kept), after waiting for the stream (queued work
    /// may still use the old ones). On error the old buffers stay.
    fn reserve(&mut self, need: RawCaps) -> Result<(), EngineError> {
        let have = self.bufs.caps;
        if need.max_seqs <= have.max_seqs
            && need.max_tokens <= have.max_tokens
            && need.max_blocks_per_seq <= have.max_blocks_per_seq
            && need.max_copies <= have.max_copies
        {
            return Ok(());
        }
        // Doubling stops at what the decode plan takes (65535 sequences, contexts of
        // `i32::MAX` tokens), so a batch within those limits never fails for its headroom.
        let grow = |h: usize, n: usize, limit: usize| {
            if n <= h {
                h
            } else {
                n.max(h.saturating_mul(2).min(limit))
            }
        };
        let context_blocks = i32::MAX as usize / self.cache.config.block_size();
        let caps = RawCaps {
            max_seqs: grow(have.max_seqs, need.max_seqs, MAX_PLAN_SEQS),
            max_tokens: grow(have.max_tokens, need.max_tokens, usize::MAX),
            max_blocks_per_seq: grow(
                have.max_blocks_per_seq,
                need.max_blocks_per_seq,
                context_blocks,
            ),
            max_copies: grow(have.max_copies, need.max_copies, usize::MAX),
        };
        self.dev.synchronize()?;
        self.staged = Staged::default();
        let bufs = Buffers::allocate(&self.dev, &self.cache, self.heads, self.mode, caps)?;
        let old = std::mem::replace(&mut self.bufs, bufs);
        // SAFETY: the stream is idle (synchronised above), so nothing uses the old buffers;
        // each came from this device's alloc and is freed once, here.
        unsafe { free_buffers(&self.dev, &old) };
        self.staging.resize(self.bufs.layout.total, 0);
        // The current step's metadata went up into the old block (at the old layout's offsets)
        // and its output rows were the old buffer's: no launch may use the new ones until
        // `begin` fills them (a growth after `begin`: copy pairs past the capacity).
        self.step = None;
        Ok(())
    }

    fn swap(&mut self, pairs: &[(u32, u32)], to_host: bool) -> Result<(), EngineError> {
        let cfg = self.cache.config;
        let Some(space) = &self.swap else {
            return no_swap_space(pairs);
        };
        let (pages, slots) = (cfg.num_blocks(), space.num_pages());
        // The host backend's checks (pairs in range, distinct destinations), so both
        // backends refuse the same mappings.
        if to_host {
            check_block_mapping(pairs, pages, slots, false)?;
        } else {
            check_block_mapping(pairs, slots, pages, false)?;
        }
        self.swap_pairs.clear();
        self.swap_pairs
            .extend(pairs.iter().map(|&(a, b)| [i64::from(a), i64::from(b)]));
        let host = space.base_ptr().cast::<std::ffi::c_void>();
        let device = self.cache.base as usize as *mut std::ffi::c_void;
        let (dst, dst_page, src, src_page) = if to_host {
            (
                host,
                space.page_bytes(),
                device.cast_const(),
                cfg.page_bytes(),
            )
        } else {
            (
                device,
                cfg.page_bytes(),
                host.cast_const(),
                space.page_bytes(),
            )
        };
        self.dev.bind()?;
        // SAFETY: the device side is the arena (`new`'s contract: num_blocks pages of
        // page_bytes) and every page named was checked in range; the host side is this
        // backend's swap space (swap slots checked in range), alive as long as the backend and
        // not touched by the host until `end` waits for the stream. The pages swapped out stay
        // held by this engine until the batch has run, and the pages swapped into are held by
        // its sequences alone (`new`'s contract), so no other work uses them meanwhile.
        unsafe {
            cuda_raw::swap_blocks(
                dst,
                dst_page,
                src,
                src_page,
                cfg.bytes_per_block(),
                &self.swap_pairs,
                to_host,
                self.dev.stream(),
            )
        }?;
        Ok(())
    }

    /// The current step, after checking that each view holds its tokens, with the device's
    /// context bound for the launch that follows.
    fn launch_step(&self, views: &[(&'static str, &DeviceRows)]) -> Result<StepShape, EngineError> {
        let step = self
            .step
            .ok_or_else(|| EngineError::InvalidConfig("attention before begin".into()))?;
        for &(what, rows) in views {
            self.check_rows(what, rows, &step)?;
        }
        self.dev.bind()?;
        Ok(step)
    }

    fn check_rows(
        &self,
        what: &'static str,
        rows: &DeviceRows,
        step: &StepShape,
    ) -> Result<(), EngineError> {
        if rows.tokens != step.tokens {
            return Err(AttnError::LengthMismatch {
                what,
                expected: step.tokens,
                found: rows.tokens,
            }
            .into());
        }
        Ok(())
    }

    fn seq_tables(&self, step: &StepShape) -> SeqTables {
        let (meta, l) = (self.bufs.meta, self.bufs.layout);
        SeqTables {
            block_tables: meta + l.tables as u64,
            max_blocks_per_seq: step.blocks_per_seq,
            context_lens: meta + l.ctx as u64,
            num_seqs: step.seqs,
        }
    }

    fn out_rows(&self, step: &StepShape) -> DeviceRows {
        DeviceRows {
            rows: Rows::dense(self.bufs.out, self.heads, self.cache.config.head_dim()),
            tokens: step.tokens,
        }
    }
}

impl<D: RawDevice> Drop for RawBackend<D> {
    fn drop(&mut self) {
        // Queued work may still use the buffers: wait (an error cannot be reported from drop;
        // on failure the buffers are leaked rather than freed under a kernel).
        if self.dev.synchronize().is_ok() {
            // SAFETY: the stream is idle; the buffers came from this device and are freed once.
            unsafe { free_buffers(&self.dev, &self.bufs) };
            if let (true, Some(space)) = (self.swap_pinned, &self.swap) {
                // SAFETY: `pin_swap_space` registered exactly this base; the stream is idle, so
                // no copy still uses it; it is freed (the field's drop) only after this.
                let unpinned = self.dev.bind().is_ok()
                    && unsafe { cuda_raw::host_unregister(space.base_ptr().cast()) }.is_ok();
                if !unpinned {
                    // Still registered: freeing it could hand the driver's pinned pages back
                    // to the allocator; leaked instead.
                    std::mem::forget(self.swap.take());
                }
            }
        } else if self.swap_pinned {
            // A copy may still be under way into the pinned swap space: leaked, as the buffers.
            std::mem::forget(self.swap.take());
        }
    }
}

fn put(bytes: &mut [u8], at: usize, v: &[u8]) {
    bytes[at..at + v.len()].copy_from_slice(v);
}

impl<D: RawDevice> KvBackend for RawBackend<D> {
    type Buf = DeviceRows;

    fn config(&self) -> &KvCacheConfig {
        &self.cache.config
    }

    fn query_heads(&self) -> usize {
        self.heads
    }

    fn swap_slots(&self) -> Option<usize> {
        Some(self.swap.as_ref().map_or(0, KvArena::num_pages))
    }

    fn swap_out(&mut self, pairs: &[(u32, u32)]) -> Result<(), EngineError> {
        self.swap(pairs, true)
    }

    fn swap_in(&mut self, pairs: &[(u32, u32)]) -> Result<(), EngineError> {
        self.swap(pairs, false)
    }

    fn copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<(), EngineError> {
        let pages = self.cache.config.num_blocks();
        // The host backend's checks: pages in range, destinations distinct and none also a
        // source (the kernel runs every pair at once: a chain or two pairs into one page would
        // race, page by page, in an order nothing fixes).
        check_block_mapping(pairs, pages, pages, true)?;
        let need = RawCaps {
            max_copies: pairs.len(),
            ..self.bufs.caps
        };
        self.reserve(need)?;
        if self.staged.copies {
            self.settle()?;
        }
        let at = self.bufs.layout.copies;
        for (i, &(a, b)) in pairs.iter().enumerate() {
            // Pages are below MAX_BLOCKS (2^24), so they fit an i32.
            put(&mut self.staging, at + 8 * i, &(a as i32).to_ne_bytes());
            put(&mut self.staging, at + 8 * i + 4, &(b as i32).to_ne_bytes());
        }
        let bytes = &self.staging[at..at + 8 * pairs.len()];
        let dst = self.bufs.meta + at as u64;
        self.dev.bind()?;
        // SAFETY: `dst` is the copies region of the metadata block (max_copies >= pairs.len()
        // pairs); the staging bytes are not written again before the stream is synchronised
        // (begin writes other regions; a second copy_blocks settles first: `staged`). The pairs
        // name pages of the arena, destinations distinct and none also a source (checked), so
        // no two thread blocks touch one page but to read it; destinations are fresh pages
        // this engine holds alone and sources are held (`new`'s contract).
        unsafe {
            self.dev.copy_to_device(dst, bytes)?;
            self.staged.copies = true;
            cuda_raw::copy_blocks(&self.cache, dst, pairs.len(), self.dev.stream())?;
        }
        Ok(())
    }

    fn begin(&mut self, batch: &Batch) -> Result<(), EngineError> {
        self.step = None;
        let cfg = self.cache.config;
        let (tokens, seqs, mbps) = (
            batch.num_tokens(),
            batch.num_seqs(),
            batch.max_blocks_per_seq,
        );
        let paged = PagedSeqs {
            block_tables: &batch.block_tables,
            max_blocks_per_seq: mbps,
            context_lens: &batch.context_lens,
        };
        // The CPU kernels' checks, so both backends refuse the same batches.
        check_len("context_lens", seqs, batch.context_lens.len())?;
        check_seqs(&cfg, &paged)?;
        check_len(
            "input_tokens",
            check_query_starts(&batch.query_start_loc, &paged)?,
            tokens,
        )?;
        check_len("slot_mapping", tokens, batch.slot_mapping.len())?;
        check_slots(&cfg, &batch.slot_mapping)?;
        self.reserve(RawCaps {
            max_seqs: seqs,
            max_tokens: tokens,
            max_blocks_per_seq: mbps.max(1),
            max_copies: 0,
        })?;
        if self.staged.step {
            self.settle()?;
        }
        let l = self.bufs.layout;
        let s = &mut self.staging;
        for (i, &slot) in batch.slot_mapping.iter().enumerate() {
            put(s, l.slots + 8 * i, &slot.to_ne_bytes());
        }
        for (i, &q) in batch.query_start_loc.iter().enumerate() {
            put(s, l.query_start + 4 * i, &q.to_ne_bytes());
        }
        for (i, &c) in batch.context_lens.iter().enumerate() {
            put(s, l.ctx + 4 * i, &c.to_ne_bytes());
        }
        for (i, &b) in batch.block_tables.iter().enumerate() {
            put(s, l.tables + 4 * i, &b.to_ne_bytes());
        }
        // One copy of everything up to the end of this step's block tables (the copy pairs
        // region after them is not this step's).
        let len = l.tables + 4 * batch.block_tables.len();
        self.dev.bind()?;
        // SAFETY: the metadata block holds layout.total >= len bytes; the staging bytes stay
        // unmodified until the stream is synchronised (a second begin settles first: `staged`).
        unsafe {
            self.dev
                .copy_to_device(self.bufs.meta, &self.staging[..len])?
        };
        self.staged.step = true;
        let max_query_len = batch
            .query_start_loc
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0);
        let step = StepShape {
            tokens,
            seqs,
            blocks_per_seq: mbps.max(1),
            max_query_len,
            one_token_rows: batch
                .query_start_loc
                .iter()
                .enumerate()
                .all(|(i, &q)| q as usize == i),
        };
        self.out = self.out_rows(&step);
        self.step = Some(step);
        Ok(())
    }

    fn reshape_and_cache(
        &mut self,
        layer: usize,
        key: &DeviceRows,
        value: &DeviceRows,
        _batch: &Batch,
    ) -> Result<(), EngineError> {
        let step = self.launch_step(&[("key", key), ("value", value)])?;
        // SAFETY: key/value are the model's rows of this step's tokens in device memory of this
        // context, alive until the model's next call (the executor calls `attended` after the
        // attention that follows, and `end` waits for the stream before the step is over); the
        // slot mapping is the step's uploaded, checked metadata; the slots name pages this
        // engine's running sequences hold alone (`new`'s contract).
        unsafe {
            cuda_raw::reshape_and_cache(
                &self.cache,
                layer,
                key.rows,
                value.rows,
                self.bufs.meta + self.bufs.layout.slots as u64,
                step.tokens,
                self.dev.stream(),
            )
        }?;
        Ok(())
    }

    fn decode(
        &mut self,
        layer: usize,
        query: &DeviceRows,
        _batch: &Batch,
    ) -> Result<&DeviceRows, EngineError> {
        let step = self.launch_step(&[("query", query)])?;
        if !step.one_token_rows {
            // The kernel reads one query row and writes one output row per sequence: with
            // fewer tokens than sequences, past both buffers.
            return Err(AttnError::LengthMismatch {
                what: "query rows (decode: one token per sequence)",
                expected: step.seqs,
                found: step.tokens,
            }
            .into());
        }
        // SAFETY: the query rows as in reshape_and_cache; the output, metadata and workspace
        // are this backend's device buffers sized for the capacities (reserve) and the plan;
        // the block tables name pages this engine's sequences hold (`new`'s contract).
        unsafe {
            cuda_raw::paged_attention_decode(
                &self.cache,
                layer,
                query.rows,
                self.out.rows,
                &self.seq_tables(&step),
                &self.params,
                &self.bufs.plan,
                self.bufs.workspace,
                self.dev.stream(),
            )
        }?;
        Ok(&self.out)
    }

    fn prefill(
        &mut self,
        layer: usize,
        query: &DeviceRows,
        _batch: &Batch,
    ) -> Result<&DeviceRows, EngineError> {
        let step = self.launch_step(&[("query", query)])?;
        // SAFETY: as in decode; query_start_loc is the step's uploaded, checked metadata.
        unsafe {
            cuda_raw::paged_attention_prefill(
                &self.cache,
                layer,
                query.rows,
                self.out.rows,
                &self.seq_tables(&step),
                self.bufs.meta + self.bufs.layout.query_start as u64,
                step.max_query_len,
                &self.params,
                self.dev.stream(),
            )
        }?;
        Ok(&self.out)
    }

    fn end(&mut self) -> Result<(), EngineError> {
        self.step = None;
        self.settle()
    }
}

/// Which regions of a [`RawBackend`]'s staging buffer a queued copy may still read.
#[derive(Debug, Clone, Copy, Default)]
struct Staged {
    /// `begin`'s region (slot mapping, query starts, contexts, block tables).
    step: bool,
    /// `copy_blocks`' pairs.
    copies: bool,
}
