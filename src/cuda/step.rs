//! [`DecodeStep`]: a decode step whose device-side state is sized once, so that the step can be
//! captured in a CUDA graph and replayed over changed metadata.
//!
//! What a captured step needs, and what this type holds:
//! - **Persistent device metadata**, one allocation laid out as a struct of arrays for
//!   `max_seqs` sequences: slot mapping (`i64`), context lengths (`i32`), block tables (`i32`,
//!   `max_blocks_per_seq` per row). Its address never changes, so kernels captured once read
//!   whatever the latest step put there.
//! - **A pinned host staging buffer** of the same layout. [`stage`](DecodeStep::stage)
//!   validates a step's metadata on the host and writes it there (sequences past the live ones
//!   padded with context 0, slot -1, which the kernels turn into zero outputs and skipped
//!   writes); [`upload`](DecodeStep::upload) queues **one** asynchronous copy of the whole
//!   block to the device. Captured, that copy becomes a graph node that reads the staging
//!   buffer when the graph runs, so each replay picks up the newly staged metadata.
//! - **A fixed [`DecodePlan`]** for `max_seqs` sequences of up to `max_blocks_per_seq *
//!   block_size` tokens and the workspace it needs, allocated once: the grid, shared memory and
//!   workspace of every decode launch are the same whatever the step's contexts.
//!
//! The host must not rewrite the staging buffer while a copy from it may still run:
//! [`stage`](DecodeStep::stage) first waits on an event recorded after the last eager
//! [`upload`](DecodeStep::upload) or graph [`replay`](DecodeStep::replay).
//!
//! Inside a capture, only raw pointers reach the launches: cudarc's per-buffer event tracking
//! (waits on events recorded outside the capture) has no place in a graph. The `*_raw` launches
//! take [`Rows`] views of pointers obtained before the capture; the step's own buffers are
//! addressed through pointers taken once at construction.

use super::cache::DeviceKvCache;
use super::device::Gpu;
use super::ops::DeviceAttnParams;
use crate::cuda_raw::{self, AttnParamsRaw, DecodeMode, DecodePlan, DevPtr, Rows, SeqTables};
use crate::error::{AttnError, CudaError, RawError};
use crate::kv::{KvCacheConfig, PagedSeqs};
use cudarc::driver::{sys, CudaEvent, CudaGraph, CudaSlice, DevicePtr};
use std::ffi::c_void;
use std::ptr::NonNull;

/// Byte offsets of the metadata arrays in the device block and the staging buffer.
#[derive(Debug, Clone, Copy)]
struct MetaLayout {
    /// `[max_seqs]` i64 at 0.
    slots: usize,
    /// `[max_seqs]` i32, 16-byte aligned.
    ctx: usize,
    /// `[max_seqs][max_blocks_per_seq]` i32, 16-byte aligned.
    tables: usize,
    /// Bytes of the whole block (a multiple of 16).
    total: usize,
}

impl MetaLayout {
    fn new(max_seqs: usize, mbps: usize) -> Option<Self> {
        let up = |x: usize| x.checked_add(15).map(|v| v & !15);
        let ctx = up(max_seqs.checked_mul(8)?)?;
        let tables = up(ctx.checked_add(max_seqs.checked_mul(4)?)?)?;
        let total = up(tables.checked_add(max_seqs.checked_mul(mbps)?.checked_mul(4)?)?)?;
        Some(Self {
            slots: 0,
            ctx,
            tables,
            total,
        })
    }
}

/// Page-locked host bytes (`cuMemHostAlloc`), zeroed at creation.
#[derive(Debug)]
struct Pinned {
    /// `len` bytes, owned, 16-byte aligned (page aligned, in fact).
    ptr: NonNull<u8>,
    len: usize,
    gpu: Gpu,
}

impl Pinned {
    fn new(gpu: &Gpu, len: usize) -> Result<Self, CudaError> {
        gpu.bind()?;
        // SAFETY: the context is current (bind); cuMemHostAlloc with flags 0 returns `len`
        // bytes of page-locked memory or an error. The memory is zeroed below before any
        // reference to it exists.
        let raw = unsafe { cudarc::driver::result::malloc_host(len, 0) }?;
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or(CudaError::HostAlloc { bytes: len })?;
        // SAFETY: `ptr` points at `len` writable bytes just allocated and not yet shared.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(Self {
            ptr,
            len,
            gpu: gpu.clone(),
        })
    }

    /// The bytes. The caller makes sure no DMA from them is in flight (the step's event).
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` owns `len` initialized bytes; &mut self makes this the only reference;
        // the step waits for the last copy reading them before calling this.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: as in bytes_mut, shared: nothing writes through another reference while
        // &self lives (only bytes_mut writes, and it needs &mut self). A DMA only reads them.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // A copy queued from the buffer may still run: wait for the stream (errors cannot be
        // reported from drop; on failure the memory is leaked rather than freed under a DMA).
        if self.gpu.synchronize().is_err() || self.gpu.bind().is_err() {
            return;
        }
        // SAFETY: `ptr` came from cuMemHostAlloc in this context and is freed once, here; no
        // copy uses it any more (the stream is idle) and no reference outlives &mut self.
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr.as_ptr().cast::<c_void>()) };
    }
}

// SAFETY: Pinned owns its allocation exclusively (like a Box<[u8]>); nothing in it is tied to
// the thread that allocated it, and Gpu is Send + Sync.
unsafe impl Send for Pinned {}
// SAFETY: shared access only reads (bytes); see Send.
unsafe impl Sync for Pinned {}

/// A decode step of fixed capacity: persistent device metadata filled by one copy per step, a
/// pinned staging buffer, a fixed [`DecodePlan`] and its workspace, so that a step can be
/// captured in a CUDA graph and replayed.
///
/// Per step: [`stage`](Self::stage) the batch's metadata, [`upload`](Self::upload) it (one
/// copy), then per layer [`reshape_and_cache`](Self::reshape_and_cache) the new tokens' K/V
/// and run [`attention`](Self::attention) — eagerly, or once inside
/// [`capture`](Self::capture) and then [`replay`](Self::replay) for every later step.
/// Every launch covers all `max_seqs` rows: query, key, value and output buffers hold
/// `max_seqs` rows; rows past the live sequences get zeros.
#[derive(Debug)]
pub struct DecodeStep {
    gpu: Gpu,
    /// The cache geometry the step serves (every cache passed must have it).
    config: KvCacheConfig,
    /// Owned so that the slopes' device pointer stays valid for every replay.
    params: DeviceAttnParams,
    /// `params` with the slopes' pointer, taken once.
    params_raw: AttnParamsRaw,
    plan: DecodePlan,
    max_seqs: usize,
    max_blocks_per_seq: usize,
    layout: MetaLayout,
    /// The device metadata block (`layout.total` bytes; owned, addressed through `meta_ptr`)
    /// and its address.
    _meta: CudaSlice<u8>,
    meta_ptr: DevPtr,
    /// The staging buffer (`layout.total` bytes).
    staging: Pinned,
    /// The plan's workspace (owned, addressed through `workspace_raw`; none with one split).
    _workspace: Option<CudaSlice<u8>>,
    workspace_raw: cuda_raw::Workspace,
    /// Recorded on the stream after the last work that reads `staging` (an eager upload or a
    /// replay); `stage` waits on it.
    staged: CudaEvent,
    /// Sequences of the last `stage`.
    live: usize,
}

impl DecodeStep {
    /// A step for batches of up to `max_seqs` sequences whose block table rows hold up to
    /// `max_blocks_per_seq` blocks of `config` (so contexts up to `max_blocks_per_seq *
    /// block_size` tokens), attention `params` (owned: its slopes must outlive every replay),
    /// partitioned by a plan of `mode` for `gpu`'s SM count. Allocates everything the step
    /// will ever use; the staged metadata, and the device copy (uploaded here), start as
    /// `max_seqs` empty sequences.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for a geometry without kernels or sizes beyond the C ABI,
    /// [`CudaError::Attn`] for heads that do not divide, [`CudaError::Launch`] for a plan the
    /// kernels refuse (e.g. more than `PKV_DECODE_MAX_SPLITS` splits),
    /// [`CudaError::Driver`] / [`CudaError::HostAlloc`] for allocation (or first upload)
    /// failures.
    pub fn new(
        gpu: &Gpu,
        config: &KvCacheConfig,
        params: DeviceAttnParams,
        max_seqs: usize,
        max_blocks_per_seq: usize,
        mode: DecodeMode,
    ) -> Result<Self, CudaError> {
        cuda_raw::geometry(config)?;
        let (nh, nkv) = (params.num_heads(), config.num_kv_heads());
        if nh == 0 || nh % nkv != 0 {
            return Err(AttnError::HeadsNotMultiple {
                num_heads: nh,
                num_kv_heads: nkv,
            }
            .into());
        }
        params.check_device(gpu)?;
        if max_seqs == 0 || max_blocks_per_seq == 0 {
            return Err(CudaError::Unsupported {
                what: "an empty decode step",
                value: 0,
            });
        }
        let capacity =
            max_blocks_per_seq
                .checked_mul(config.block_size())
                .ok_or(CudaError::Unsupported {
                    what: "max_blocks_per_seq",
                    value: max_blocks_per_seq,
                })?;
        let plan = DecodePlan::for_dtype(
            mode,
            config.dtype(),
            max_seqs,
            nh,
            nkv,
            config.head_dim(),
            capacity,
            gpu.info().sm_count.max(1) as usize,
        )?;
        let layout =
            MetaLayout::new(max_seqs, max_blocks_per_seq).ok_or(CudaError::Unsupported {
                what: "decode step metadata bytes",
                value: max_seqs,
            })?;
        let mut staging = Pinned::new(gpu, layout.total)?;
        let meta = gpu.alloc_zeros::<u8>(layout.total)?;
        // Zeroed once: the split merge's counters at its head start at zero, and every launch
        // with this (fixed) plan leaves them so.
        let workspace = match plan.workspace_bytes() {
            0 => None,
            n => Some(gpu.alloc_zeros::<u8>(n)?),
        };
        let stream = gpu.stream();
        // The addresses are taken once (the guards record these reads on the stream and drop
        // at once): the buffers are owned by the step and used only on its stream, so stream
        // order alone orders every later use, captured or eager.
        let meta_ptr = meta.device_ptr(stream).0;
        let workspace_raw =
            workspace
                .as_ref()
                .map_or(cuda_raw::Workspace::NONE, |w| cuda_raw::Workspace {
                    ptr: w.device_ptr(stream).0,
                    bytes: w.len(),
                });
        let params_raw = params.raw(stream).0;
        let staged = gpu.context().new_event(None)?;
        fill_padding(&mut staging, &layout, max_seqs, 0);
        let mut step = Self {
            gpu: gpu.clone(),
            config: *config,
            params,
            params_raw,
            plan,
            max_seqs,
            max_blocks_per_seq,
            layout,
            _meta: meta,
            meta_ptr,
            staging,
            _workspace: workspace,
            workspace_raw,
            staged,
            live: 0,
        };
        // The device block starts as the staging does (every row empty: slot -1, context 0),
        // not as zeros: a launch before the first `upload` would otherwise write its rows'
        // K/V into slot 0, a page the step's sequences may not own.
        step.upload()?;
        Ok(step)
    }

    /// The fixed plan.
    pub fn plan(&self) -> &DecodePlan {
        &self.plan
    }
    /// Most sequences of a step (rows of every query/key/value/output buffer).
    pub fn max_seqs(&self) -> usize {
        self.max_seqs
    }
    /// Entries per block table row.
    pub fn max_blocks_per_seq(&self) -> usize {
        self.max_blocks_per_seq
    }
    /// Sequences of the last [`stage`](Self::stage).
    pub fn live_seqs(&self) -> usize {
        self.live
    }
    /// The attention parameters the step was made with.
    pub fn params(&self) -> &DeviceAttnParams {
        &self.params
    }
    /// The device metadata as the raw launches take it (all `max_seqs` rows).
    pub fn seq_tables(&self) -> SeqTables {
        SeqTables {
            block_tables: self.meta_ptr + self.layout.tables as u64,
            max_blocks_per_seq: self.max_blocks_per_seq,
            context_lens: self.meta_ptr + self.layout.ctx as u64,
            num_seqs: self.max_seqs,
        }
    }
    /// The device slot mapping (`[max_seqs]` i64).
    pub fn slot_mapping_ptr(&self) -> DevPtr {
        self.meta_ptr + self.layout.slots as u64
    }

    /// Validates a step's metadata (the CPU kernels' rules, plus this step's capacities) and
    /// writes it into the staging buffer: `seqs` (one decode token per sequence) and
    /// `slot_mapping`, that token's cache slot per sequence (-1: none). Sequences past
    /// `seqs.num_seqs()` up to `max_seqs` become empty (context 0, slot -1). First waits for
    /// the last copy reading the staging buffer. Nothing reaches the device until
    /// [`upload`](Self::upload) (or a [`replay`](Self::replay) of a captured upload).
    ///
    /// # Errors
    /// [`CudaError::Attn`] for a malformed batch (the CPU kernels' errors; a slot outside the
    /// cache: `SlotOutOfRange`), [`CudaError::Raw`] with [`RawError::OverCapacity`] for more
    /// sequences or wider block table rows than the step holds, [`CudaError::Driver`] if
    /// waiting fails. On error nothing is written.
    pub fn stage(&mut self, seqs: &PagedSeqs<'_>, slot_mapping: &[i64]) -> Result<(), CudaError> {
        let n = seqs.num_seqs();
        if n > self.max_seqs {
            return Err(CudaError::Raw(RawError::OverCapacity {
                what: "num_seqs",
                capacity: self.max_seqs,
                found: n,
            }));
        }
        if seqs.max_blocks_per_seq > self.max_blocks_per_seq {
            return Err(CudaError::Raw(RawError::OverCapacity {
                what: "max_blocks_per_seq",
                capacity: self.max_blocks_per_seq,
                found: seqs.max_blocks_per_seq,
            }));
        }
        crate::kv::check_seqs(&self.config, seqs)?;
        if slot_mapping.len() != n {
            return Err(AttnError::LengthMismatch {
                what: "slot_mapping",
                expected: n,
                found: slot_mapping.len(),
            }
            .into());
        }
        crate::kv::check_slots(&self.config, slot_mapping)?;
        self.staged.synchronize()?;
        let (l, mbps_in, mbps) = (
            self.layout,
            seqs.max_blocks_per_seq,
            self.max_blocks_per_seq,
        );
        let bytes = self.staging.bytes_mut();
        for (i, &slot) in slot_mapping.iter().enumerate() {
            put(bytes, l.slots + 8 * i, &slot.to_ne_bytes());
        }
        for (i, &c) in seqs.context_lens.iter().enumerate() {
            put(bytes, l.ctx + 4 * i, &c.to_ne_bytes());
            let row = &seqs.block_tables[i * mbps_in..(i + 1) * mbps_in];
            for j in 0..mbps {
                let b = row.get(j).copied().unwrap_or(0);
                put(bytes, l.tables + 4 * (i * mbps + j), &b.to_ne_bytes());
            }
        }
        fill_padding(&mut self.staging, &l, self.max_seqs, n);
        self.live = n;
        Ok(())
    }

    /// Queues the one copy of the staged metadata to the device on the step's stream. Inside
    /// a [`capture`](Self::capture) it becomes a graph node (the staging buffer is read when
    /// the graph runs); outside, the step records that the buffer is in use until it runs.
    ///
    /// # Errors
    /// [`CudaError::Driver`] if the copy cannot be queued.
    pub fn upload(&mut self) -> Result<(), CudaError> {
        self.gpu.bind()?;
        let stream = self.gpu.stream();
        // SAFETY: `meta_ptr` is the step's device block of layout.total bytes, alive as long as
        // the step (and, in a graph, the caller keeps the step alive for every replay: replay's
        // contract); the staging buffer holds the same number of pinned bytes, owned by the
        // step, not written by the host until `staged` (recorded below, or after a replay) has
        // been waited on. The context is current (bind) and the stream is the step's.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                self.meta_ptr,
                self.staging.bytes(),
                stream.cu_stream(),
            )
        }?;
        if stream.capture_status()? == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            self.record_staged()?;
        }
        Ok(())
    }

    /// Checks that `cache` has the step's geometry on the step's device.
    fn check_cache(&self, cache: &DeviceKvCache) -> Result<(), CudaError> {
        if !cache.config().same_block_shape(&self.config)
            || cache.config().num_blocks() != self.config.num_blocks()
        {
            return Err(crate::error::KvError::GeometryMismatch.into());
        }
        cache.check_device(&self.gpu)
    }

    /// Writes the K/V of the step's tokens (row `i` of `key`/`value` for sequence `i`, one
    /// row per sequence up to `max_seqs`; padding rows are skipped) into layer `layer`, at
    /// the staged slots, from raw views (for use inside a capture).
    ///
    /// # Safety
    /// Until the launch (or every replay of a graph capturing it) completes: `key` and
    /// `value` hold `max_seqs` rows of `num_kv_heads * head_dim` elements of the cache's dtype
    /// at their strides, device memory of the step's context; `cache` stays alive.
    ///
    /// # Errors
    /// [`CudaError::Kv`] (geometry, layer), [`CudaError::Raw`] (views), [`CudaError::Launch`].
    pub unsafe fn reshape_and_cache_raw(
        &self,
        cache: &DeviceKvCache,
        layer: usize,
        key: Rows,
        value: Rows,
    ) -> Result<(), CudaError> {
        self.check_cache(cache)?;
        self.gpu.bind()?;
        // SAFETY: the caller vouches for key/value (this function's contract); the slot
        // mapping is the step's device block (max_seqs i64, alive with the step), staged and
        // validated by `stage`; the cache is `cache`'s arena (geometry and device checked).
        unsafe {
            cuda_raw::reshape_and_cache(
                &cache.raw_view(),
                layer,
                key,
                value,
                self.slot_mapping_ptr(),
                self.max_seqs,
                self.gpu.raw_stream(),
            )
        }?;
        Ok(())
    }

    /// Decode attention over layer `layer` with the step's fixed plan, all `max_seqs` rows
    /// (padding rows get zeros), from raw views (for use inside a capture).
    ///
    /// # Safety
    /// Until the launch (or every replay of a graph capturing it) completes: `query` holds
    /// `max_seqs` rows of `num_heads * head_dim` elements of the cache's dtype at its stride,
    /// `out` as many rows (written), device memory of the step's context, not overlapping;
    /// `cache` stays alive.
    ///
    /// # Errors
    /// [`CudaError::Kv`] (geometry, layer), [`CudaError::Raw`] (views), [`CudaError::Launch`].
    pub unsafe fn attention_raw(
        &self,
        cache: &DeviceKvCache,
        layer: usize,
        query: Rows,
        out: Rows,
    ) -> Result<(), CudaError> {
        self.check_cache(cache)?;
        self.gpu.bind()?;
        // SAFETY: the caller vouches for query/out and the cache's lifetime (this function's
        // contract); the metadata and workspace are the step's own device buffers (sized for
        // max_seqs and the plan, alive with the step); the slopes belong to the step's params.
        unsafe {
            cuda_raw::paged_attention_decode(
                &cache.raw_view(),
                layer,
                query,
                out,
                &self.seq_tables(),
                &self.params_raw,
                &self.plan,
                self.workspace_raw,
                self.gpu.raw_stream(),
            )
        }?;
        Ok(())
    }

    /// [`reshape_and_cache_raw`](Self::reshape_and_cache_raw) over cudarc buffers, eagerly
    /// (not inside a capture: cudarc's event tracking runs here).
    ///
    /// # Errors
    /// As `reshape_and_cache_raw`, plus [`CudaError::Attn`] if a view is too short.
    pub fn reshape_and_cache<T: crate::kv::KvElem + cudarc::driver::DeviceRepr>(
        &self,
        cache: &mut DeviceKvCache,
        layer: usize,
        key: super::TokenRows<'_, T>,
        value: super::TokenRows<'_, T>,
    ) -> Result<(), CudaError> {
        self.check_cache(cache)?;
        let row = self.config.token_stride();
        key.check(&self.gpu, "key", self.max_seqs, row)?;
        value.check(&self.gpu, "value", self.max_seqs, row)?;
        check_dtype::<T>(&self.config)?;
        let stream = self.gpu.stream();
        let (k, _gk) = key.raw(stream);
        let (v, _gv) = value.raw(stream);
        // SAFETY: `k`/`v` are max_seqs rows of the cache's dtype inside live cudarc buffers of
        // this device (checked), held by their guards until after the call; `cache` is
        // borrowed mutably through the call and its arena outlives the launch (its drop
        // synchronizes).
        unsafe { self.reshape_and_cache_raw(cache, layer, k, v) }
    }

    /// [`attention_raw`](Self::attention_raw) over cudarc buffers, eagerly (not inside a
    /// capture).
    ///
    /// # Errors
    /// As `attention_raw`, plus [`CudaError::Attn`] if a view is too short.
    pub fn attention<T: crate::kv::KvElem + cudarc::driver::DeviceRepr>(
        &self,
        cache: &DeviceKvCache,
        layer: usize,
        query: super::TokenRows<'_, T>,
        mut out: super::TokenRowsMut<'_, T>,
    ) -> Result<(), CudaError> {
        self.check_cache(cache)?;
        let row = self.params.num_heads() * self.config.head_dim();
        query.check(&self.gpu, "query", self.max_seqs, row)?;
        out.check(&self.gpu, "out", self.max_seqs, row)?;
        check_dtype::<T>(&self.config)?;
        let stream = self.gpu.stream();
        let (q, _gq) = query.raw(stream);
        let (o, _go) = out.raw(stream);
        // SAFETY: `q`/`o` are max_seqs rows of the cache's dtype inside live cudarc buffers of
        // this device (checked), held by their guards until after the call (the guards order
        // the launch after earlier work on them); `cache` outlives the launch (its arena's
        // drop synchronizes).
        unsafe { self.attention_raw(cache, layer, q, o) }
    }

    /// Captures what `f` queues on the step's stream (typically [`upload`](Self::upload) and,
    /// per layer, the `*_raw` launches) into a CUDA graph, in thread-local capture mode (other
    /// threads' CUDA calls are not affected). Nothing runs during the capture. The capture is
    /// ended even when `f` fails.
    ///
    /// # Errors
    /// `f`'s error; [`CudaError::Driver`] if capture cannot begin, end or instantiate (e.g. `f`
    /// made a call a capture does not allow).
    pub fn capture(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<(), CudaError>,
    ) -> Result<DecodeGraph, CudaError> {
        let stream = self.gpu.stream().clone();
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let body = f(self);
        let ended = stream.end_capture(
            sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
        );
        body?;
        match ended? {
            Some(graph) => Ok(DecodeGraph { graph }),
            None => Err(CudaError::Unsupported {
                what: "an empty or invalidated capture",
                value: 0,
            }),
        }
    }

    /// Launches a graph made by [`capture`](Self::capture) on the step's stream (the staged
    /// metadata is copied and every captured kernel runs over it), then records that the
    /// staging buffer is in use until the graph completes.
    ///
    /// # Safety
    /// Every buffer the captured work uses besides the step's own (caches, query, key, value,
    /// output) is still allocated and of the size it had at capture, until the replay
    /// completes; `graph` was captured from this step.
    ///
    /// # Errors
    /// [`CudaError::Driver`] if the launch fails.
    pub unsafe fn replay(&mut self, graph: &DecodeGraph) -> Result<(), CudaError> {
        graph.graph.launch()?;
        self.record_staged()
    }

    /// Marks the staging buffer read by the work queued so far (the next `stage` waits for
    /// it); where the record fails, waits for the stream instead, so that `stage` cannot
    /// rewrite bytes a queued copy has yet to read.
    fn record_staged(&mut self) -> Result<(), CudaError> {
        let recorded = self.staged.record(self.gpu.stream());
        if recorded.is_err() {
            let _ = self.gpu.synchronize();
        }
        Ok(recorded?)
    }
}

impl Drop for DecodeStep {
    fn drop(&mut self) {
        // Every launch and replay queued on the step's stream reads the ALiBi slopes through
        // `params_raw`, an address cudarc does not track, and the slopes' buffer is freed on the
        // stream that uploaded it (possibly another stream of the device), ordered only after
        // the read recorded at construction. So the read is recorded again at the end of the
        // step's stream (the slice's drop waits on it before the free), and the stream is
        // waited for before the fields drop (the staging buffer's drop waits for it anyway;
        // an error cannot be reported from drop).
        drop(self.params.raw(self.gpu.stream()));
        let _ = self.gpu.synchronize();
    }
}

/// A captured decode step (a CUDA graph and its executable instance), replayed with
/// [`DecodeStep::replay`].
pub struct DecodeGraph {
    graph: CudaGraph,
}

impl std::fmt::Debug for DecodeGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeGraph").finish_non_exhaustive()
    }
}

fn check_dtype<T: crate::kv::KvElem>(cfg: &KvCacheConfig) -> Result<(), CudaError> {
    if T::DTYPE != cfg.dtype() {
        return Err(crate::error::KvError::DtypeMismatch {
            expected: cfg.dtype(),
            found: T::DTYPE,
        }
        .into());
    }
    Ok(())
}

fn put(bytes: &mut [u8], at: usize, v: &[u8]) {
    bytes[at..at + v.len()].copy_from_slice(v);
}

/// Rows `from..max_seqs` of the staging buffer become empty sequences: slot -1, context 0,
/// block table row 0 (never read: a context of 0 names no block).
fn fill_padding(staging: &mut Pinned, l: &MetaLayout, max_seqs: usize, from: usize) {
    let bytes = staging.bytes_mut();
    for i in from..max_seqs {
        put(bytes, l.slots + 8 * i, &(-1i64).to_ne_bytes());
        put(bytes, l.ctx + 4 * i, &0i32.to_ne_bytes());
    }
}
