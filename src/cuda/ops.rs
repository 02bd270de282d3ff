//! Safe launch wrappers of the attention and cache-write kernels over cudarc buffers, and the
//! device-side batch metadata they read ([`DeviceSeqs`], [`DeviceAttnParams`],
//! [`DecodeWorkspace`]). A thin layer over [`crate::cuda_raw`]: each wrapper checks what the
//! cudarc types let it check (lengths, devices, dtypes), takes the buffers' device pointers
//! (cudarc's events order the launch after earlier work on them) and calls the raw launch.

use super::cache::{same_device, DeviceKvCache};
use super::device::Gpu;
use crate::cuda_raw::{
    self, AttnParamsRaw, DecodeMode, DecodePlan, DevPtr, PrefillTiling, Rows, SeqTables,
};
use crate::error::{AttnError, CudaError, KvError};
use crate::kv::{check_len, KvCacheConfig, KvElem};
use crate::kv::{AttnParams, PagedSeqs};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop};

/// Batch metadata in device memory: block tables and context lengths (and, for prefill, the
/// query start offsets), validated on the host with the CPU kernels' rules when uploaded, for
/// the geometry given then: a launch takes them only over a cache of the same block size and
/// at least as many blocks.
#[derive(Debug)]
pub struct DeviceSeqs {
    /// `[num_seqs][max_blocks_per_seq]` i32.
    block_tables: CudaSlice<i32>,
    /// `[num_seqs]` i32, each in `0..=max_blocks_per_seq * block_size`.
    context_lens: CudaSlice<i32>,
    /// `[num_seqs + 1]` i32 (prefill only).
    query_start_loc: Option<CudaSlice<i32>>,
    num_seqs: usize,
    max_blocks_per_seq: usize,
    /// Largest context length (host copy: chooses the decode partitioning).
    max_context_len: usize,
    /// Largest query length (prefill; sizes the grid).
    max_query_len: usize,
    /// Tokens in the batch: `query_start_loc[num_seqs]` (prefill) or `num_seqs` (decode).
    num_tokens: usize,
    /// Block size and block count of the geometry validated against (block ids are below
    /// `num_blocks`, contexts within `max_blocks_per_seq * block_size`).
    block_size: usize,
    num_blocks: usize,
}

impl DeviceSeqs {
    /// Validates `seqs` against `cfg` (the rules of [`crate::attn::cpu`]: table shape, context
    /// lengths within the table, live block ids in range) and uploads it for decode.
    ///
    /// # Errors
    /// [`CudaError::Attn`] with the CPU kernels' error for the same input;
    /// [`CudaError::Driver`] if the upload fails.
    pub fn upload(gpu: &Gpu, cfg: &KvCacheConfig, seqs: &PagedSeqs<'_>) -> Result<Self, CudaError> {
        let max_context_len = validate_seqs(cfg, seqs)?;
        let (block_tables, max_blocks_per_seq) = upload_tables(gpu, seqs)?;
        Ok(Self {
            block_tables,
            context_lens: upload_nonempty(gpu, seqs.context_lens)?,
            query_start_loc: None,
            num_seqs: seqs.num_seqs(),
            max_blocks_per_seq,
            max_context_len,
            max_query_len: 1,
            num_tokens: seqs.num_seqs(),
            block_size: cfg.block_size(),
            num_blocks: cfg.num_blocks(),
        })
    }

    /// As [`upload`](Self::upload), plus `query_start_loc` (`[num_seqs + 1]`, non-decreasing
    /// from 0, each sequence's query no longer than its context) for prefill.
    ///
    /// # Errors
    /// As [`upload`](Self::upload), plus [`AttnError::QueryStartLoc`] and
    /// [`AttnError::QueryLongerThanContext`].
    pub fn upload_prefill(
        gpu: &Gpu,
        cfg: &KvCacheConfig,
        seqs: &PagedSeqs<'_>,
        query_start_loc: &[i32],
    ) -> Result<Self, CudaError> {
        let max_context_len = validate_seqs(cfg, seqs)?;
        let n = seqs.num_seqs();
        let num_tokens = crate::kv::check_query_starts(query_start_loc, seqs)?;
        let max_q = query_start_loc
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0);
        let (block_tables, max_blocks_per_seq) = upload_tables(gpu, seqs)?;
        Ok(Self {
            block_tables,
            context_lens: upload_nonempty(gpu, seqs.context_lens)?,
            query_start_loc: Some(gpu.upload(query_start_loc)?),
            num_seqs: n,
            max_blocks_per_seq,
            max_context_len,
            max_query_len: max_q,
            num_tokens,
            block_size: cfg.block_size(),
            num_blocks: cfg.num_blocks(),
        })
    }

    /// Sequences in the batch.
    pub fn num_seqs(&self) -> usize {
        self.num_seqs
    }
    /// Largest context length.
    pub fn max_context_len(&self) -> usize {
        self.max_context_len
    }
    /// Query tokens in the batch (`num_seqs` for decode).
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// The metadata was validated for a geometry whose blocks `cfg` also has: the same block
    /// size (each context fits its table row in `cfg`'s blocks too) and no more blocks (every
    /// block id is in `cfg`'s range). A launch over another cache would read past a table row
    /// or past the arena, with no error.
    fn check_cache(&self, cfg: &KvCacheConfig) -> Result<(), CudaError> {
        if self.block_size != cfg.block_size() || self.num_blocks > cfg.num_blocks() {
            return Err(KvError::GeometryMismatch.into());
        }
        Ok(())
    }
}

/// cudarc refuses zero-length copies on some paths; a batch of zero sequences still needs a
/// (never read) buffer.
fn upload_nonempty(gpu: &Gpu, host: &[i32]) -> Result<CudaSlice<i32>, CudaError> {
    if host.is_empty() {
        gpu.alloc_zeros::<i32>(1)
    } else {
        gpu.upload(host)
    }
}

/// The block tables and their row width as the launches take them. Rows of no entries (every
/// context 0, which the CPU kernels accept) become rows of one never-read entry: the launchers
/// refuse a width of 0, and every entry of a row they are given must be readable memory.
fn upload_tables(gpu: &Gpu, seqs: &PagedSeqs<'_>) -> Result<(CudaSlice<i32>, usize), CudaError> {
    if seqs.max_blocks_per_seq == 0 {
        let rows = vec![0i32; seqs.num_seqs()];
        return Ok((upload_nonempty(gpu, &rows)?, 1));
    }
    Ok((
        upload_nonempty(gpu, seqs.block_tables)?,
        seqs.max_blocks_per_seq,
    ))
}

/// The kernel contract's batch checks (the same the CPU kernels run), plus the sizes the C ABI
/// can carry; returns the largest context.
fn validate_seqs(cfg: &KvCacheConfig, seqs: &PagedSeqs<'_>) -> Result<usize, CudaError> {
    let max_ctx = crate::kv::check_seqs(cfg, seqs)?;
    let (num_seqs, mbps) = (seqs.num_seqs(), seqs.max_blocks_per_seq);
    if i32::try_from(mbps).is_err() || i32::try_from(num_seqs).is_err() {
        return Err(CudaError::Unsupported {
            what: "batch size",
            value: num_seqs.max(mbps),
        });
    }
    Ok(max_ctx)
}

/// Attention parameters with the ALiBi slopes in device memory.
#[derive(Debug)]
pub struct DeviceAttnParams {
    num_heads: usize,
    scale: f32,
    softcap: f32,
    sliding_window: usize,
    /// `[num_heads]` f32, or none.
    alibi_slopes: Option<CudaSlice<f32>>,
    /// Decode partitioning.
    pub mode: DecodeMode,
    /// The f16 / bf16 prefill kernel's tiling.
    pub prefill_tiling: PrefillTiling,
    /// Programmatic dependent launches ([`AttnParamsRaw::programmatic_launch`]).
    pub programmatic_launch: bool,
}

impl DeviceAttnParams {
    /// Validates `params` with the CPU kernels' rules for a cache of `cfg` and uploads the
    /// slopes.
    ///
    /// # Errors
    /// [`CudaError::Attn`] (`HeadsNotMultiple`, `BadParam`, `LengthMismatch` of the slopes),
    /// [`CudaError::Driver`] on upload failure.
    pub fn upload(
        gpu: &Gpu,
        cfg: &KvCacheConfig,
        params: &AttnParams<'_>,
    ) -> Result<Self, CudaError> {
        let (nh, nkv) = (params.num_heads, cfg.num_kv_heads());
        if nh == 0 || nh % nkv != 0 {
            return Err(AttnError::HeadsNotMultiple {
                num_heads: nh,
                num_kv_heads: nkv,
            }
            .into());
        }
        if !params.scale.is_finite() {
            return Err(AttnError::BadParam {
                what: "scale is not finite",
            }
            .into());
        }
        if !(params.softcap.is_finite() && params.softcap >= 0.0) {
            return Err(AttnError::BadParam {
                what: "softcap is negative or not finite",
            }
            .into());
        }
        let alibi_slopes = match params.alibi_slopes {
            None => None,
            Some(s) => {
                if s.len() != nh {
                    return Err(AttnError::LengthMismatch {
                        what: "alibi_slopes",
                        expected: nh,
                        found: s.len(),
                    }
                    .into());
                }
                if s.iter().any(|x| !x.is_finite()) {
                    return Err(AttnError::BadParam {
                        what: "an ALiBi slope is not finite",
                    }
                    .into());
                }
                Some(gpu.upload(s)?)
            }
        };
        if i32::try_from(nh).is_err() {
            return Err(CudaError::Unsupported {
                what: "num_heads",
                value: nh,
            });
        }
        Ok(Self {
            num_heads: nh,
            scale: params.scale,
            softcap: params.softcap,
            // A window beyond i32 is no window at all for contexts that fit i32.
            sliding_window: params.sliding_window,
            alibi_slopes,
            mode: DecodeMode::Auto,
            prefill_tiling: PrefillTiling::Auto,
            programmatic_launch: false,
        })
    }

    /// Query heads.
    pub fn num_heads(&self) -> usize {
        self.num_heads
    }
}

/// Device scratch of split-K decode; grows to the largest batch seen, never shrinks. It keeps
/// the split merge's counters valid across plans: the kernels leave a plan's counters zero,
/// and a plan with more of them than the last one zeroes the difference first.
#[derive(Debug, Default)]
pub struct DecodeWorkspace {
    buf: Option<CudaSlice<u8>>,
    /// Leading bytes known to be zero (the last plan's counters, or all of a new buffer).
    zeroed: usize,
}

impl DecodeWorkspace {
    /// An empty workspace (allocated on first need).
    pub fn new() -> Self {
        Self::default()
    }
    /// Bytes currently allocated.
    pub fn capacity_bytes(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.len())
    }
    /// Grows to at least `plan`'s bytes (never shrinks; reallocated when `gpu` is another
    /// device than the buffer's) and zeroes its counters unless they are known to be zero.
    /// Call it right before a launch with `plan`, on `gpu`'s stream.
    ///
    /// # Errors
    /// [`CudaError::Driver`] if the allocation or the zeroing fails (the old buffer is kept).
    pub fn prepare(&mut self, gpu: &Gpu, plan: &cuda_raw::DecodePlan) -> Result<(), CudaError> {
        let (bytes, counters) = (plan.workspace_bytes(), plan.counter_bytes());
        // A workspace follows the device it is prepared for: one of another device's would be
        // written through a foreign pointer, so it is replaced (by a zeroed one). The new
        // buffer is allocated before the old one is dropped: on failure the old one is kept.
        let foreign = self
            .buf
            .as_ref()
            .is_some_and(|b| b.ordinal() != gpu.info().ordinal);
        if foreign || bytes > self.capacity_bytes() {
            self.buf = match bytes {
                0 => None,
                n => Some(gpu.alloc_zeros::<u8>(n)?),
            };
            self.zeroed = bytes;
        }
        if counters == 0 {
            return Ok(()); // one split: the launch does not touch the workspace
        }
        if let (Some(buf), true) = (self.buf.as_mut(), counters > self.zeroed) {
            gpu.bind()?;
            gpu.stream().memset_zeros(&mut buf.slice_mut(..counters))?;
        }
        // After the launch only its counters are known to be zero (the partials follow them).
        self.zeroed = counters;
        Ok(())
    }
    /// The raw workspace and the guard that records its use on `stream` when dropped.
    fn raw<'a>(
        &'a mut self,
        stream: &'a cudarc::driver::CudaStream,
    ) -> (cuda_raw::Workspace, Option<SyncOnDrop<'a>>) {
        match self.buf.as_mut() {
            None => (cuda_raw::Workspace::NONE, None),
            Some(b) => {
                let bytes = b.len();
                let (ptr, g) = b.device_ptr_mut(stream);
                (cuda_raw::Workspace { ptr, bytes }, Some(g))
            }
        }
    }
}

/// A `[tokens][heads][head_dim]` view of a cudarc buffer: row `t` starts at element `offset +
/// t * token_stride` (heads contiguous). [`dense`](Self::dense) for a plain tensor,
/// [`strided`](Self::strided) for the q, k or v part of a fused QKV projection.
#[derive(Debug, Clone, Copy)]
pub struct TokenRows<'a, T> {
    buf: &'a CudaSlice<T>,
    offset: usize,
    token_stride: usize,
}

impl<'a, T> TokenRows<'a, T> {
    /// Rows of `row` elements packed back to back from the start of `buf`.
    pub fn dense(buf: &'a CudaSlice<T>, row: usize) -> Self {
        Self {
            buf,
            offset: 0,
            token_stride: row,
        }
    }
    /// Rows `token_stride` elements apart starting `offset` elements into `buf`.
    pub fn strided(buf: &'a CudaSlice<T>, offset: usize, token_stride: usize) -> Self {
        Self {
            buf,
            offset,
            token_stride,
        }
    }
}

/// The writable twin of [`TokenRows`].
#[derive(Debug)]
pub struct TokenRowsMut<'a, T> {
    buf: &'a mut CudaSlice<T>,
    offset: usize,
    token_stride: usize,
}

impl<'a, T> TokenRowsMut<'a, T> {
    /// Rows of `row` elements packed back to back from the start of `buf`.
    pub fn dense(buf: &'a mut CudaSlice<T>, row: usize) -> Self {
        Self {
            buf,
            offset: 0,
            token_stride: row,
        }
    }
    /// Rows `token_stride` elements apart starting `offset` elements into `buf`.
    pub fn strided(buf: &'a mut CudaSlice<T>, offset: usize, token_stride: usize) -> Self {
        Self {
            buf,
            offset,
            token_stride,
        }
    }
}

/// `tokens` rows of `row` elements at `offset` + t * `stride` fit a buffer of `len` elements
/// (the stride itself is checked by the raw launch: at least a row, 16-byte multiple).
fn check_view(
    what: &'static str,
    len: usize,
    offset: usize,
    stride: usize,
    tokens: usize,
    row: usize,
) -> Result<(), CudaError> {
    if tokens == 0 {
        return Ok(());
    }
    let need = (tokens - 1)
        .checked_mul(stride)
        .and_then(|x| x.checked_add(offset))
        .and_then(|x| x.checked_add(row))
        .ok_or(CudaError::Unsupported {
            what,
            value: stride,
        })?;
    if need > len {
        return Err(AttnError::LengthMismatch {
            what,
            expected: need,
            found: len,
        }
        .into());
    }
    Ok(())
}

/// A buffer's device pointer advanced by `offset` elements of `T`.
fn at<T>(ptr: DevPtr, offset: usize) -> DevPtr {
    ptr + (offset * std::mem::size_of::<T>()) as u64
}

impl<T: DeviceRepr> TokenRows<'_, T> {
    pub(crate) fn check(
        &self,
        gpu: &Gpu,
        what: &'static str,
        tokens: usize,
        row: usize,
    ) -> Result<(), CudaError> {
        same_device(gpu, self.buf)?;
        check_view(
            what,
            self.buf.len(),
            self.offset,
            self.token_stride,
            tokens,
            row,
        )
    }
    pub(crate) fn raw<'s>(
        &'s self,
        stream: &'s cudarc::driver::CudaStream,
    ) -> (Rows, SyncOnDrop<'s>) {
        let (p, g) = self.buf.device_ptr(stream);
        let rows = Rows {
            ptr: at::<T>(p, self.offset),
            token_stride: self.token_stride,
        };
        (rows, g)
    }
}

impl<T: DeviceRepr> TokenRowsMut<'_, T> {
    pub(crate) fn check(
        &self,
        gpu: &Gpu,
        what: &'static str,
        tokens: usize,
        row: usize,
    ) -> Result<(), CudaError> {
        same_device(gpu, self.buf)?;
        check_view(
            what,
            self.buf.len(),
            self.offset,
            self.token_stride,
            tokens,
            row,
        )
    }
    pub(crate) fn raw<'s>(
        &'s mut self,
        stream: &'s cudarc::driver::CudaStream,
    ) -> (Rows, SyncOnDrop<'s>) {
        let (offset, token_stride) = (self.offset, self.token_stride);
        let (p, g) = self.buf.device_ptr_mut(stream);
        let rows = Rows {
            ptr: at::<T>(p, offset),
            token_stride,
        };
        (rows, g)
    }
}

fn check_dtype<T: KvElem>(cfg: &KvCacheConfig) -> Result<(), CudaError> {
    if T::DTYPE != cfg.dtype() {
        return Err(KvError::DtypeMismatch {
            expected: cfg.dtype(),
            found: T::DTYPE,
        }
        .into());
    }
    Ok(())
}

fn check_layer(cfg: &KvCacheConfig, layer: usize) -> Result<(), CudaError> {
    if layer >= cfg.num_layers() {
        return Err(KvError::LayerOutOfRange {
            layer,
            num_layers: cfg.num_layers(),
        }
        .into());
    }
    Ok(())
}

/// The heads divide the cache's KV heads, and the slopes (if any) live on the launch's device.
fn check_params(
    gpu: &Gpu,
    cfg: &KvCacheConfig,
    params: &DeviceAttnParams,
) -> Result<(), CudaError> {
    if params.num_heads == 0 || params.num_heads % cfg.num_kv_heads() != 0 {
        return Err(AttnError::HeadsNotMultiple {
            num_heads: params.num_heads,
            num_kv_heads: cfg.num_kv_heads(),
        }
        .into());
    }
    params.check_device(gpu)
}

impl DeviceAttnParams {
    /// The slopes (if any) were uploaded to `gpu`'s device: a kernel on another device would
    /// read them through a foreign pointer (an illegal address that poisons the context).
    pub(crate) fn check_device(&self, gpu: &Gpu) -> Result<(), CudaError> {
        self.alibi_slopes
            .as_ref()
            .map_or(Ok(()), |s| same_device(gpu, s))
    }

    /// The raw parameters, with the slopes' device pointer (and the guard recording the read
    /// on `stream`).
    pub(crate) fn raw<'a>(
        &'a self,
        stream: &'a cudarc::driver::CudaStream,
    ) -> (AttnParamsRaw, Option<SyncOnDrop<'a>>) {
        let (alibi_slopes, guard) = match self.alibi_slopes.as_ref() {
            None => (0, None),
            Some(s) => {
                let (p, g) = s.device_ptr(stream);
                (p, Some(g))
            }
        };
        let raw = AttnParamsRaw {
            num_heads: self.num_heads,
            scale: self.scale,
            softcap: self.softcap,
            sliding_window: self.sliding_window,
            alibi_slopes,
            prefill_tiling: self.prefill_tiling,
            programmatic_launch: self.programmatic_launch,
        };
        (raw, guard)
    }
}

impl DeviceSeqs {
    /// The raw metadata, with the guards recording the reads on `stream`.
    fn raw<'a>(
        &'a self,
        stream: &'a cudarc::driver::CudaStream,
    ) -> (SeqTables, [SyncOnDrop<'a>; 2]) {
        let (bp, gb) = self.block_tables.device_ptr(stream);
        let (lp, gl) = self.context_lens.device_ptr(stream);
        let raw = SeqTables {
            block_tables: bp,
            max_blocks_per_seq: self.max_blocks_per_seq,
            context_lens: lp,
            num_seqs: self.num_seqs,
        };
        (raw, [gb, gl])
    }
}

impl DeviceKvCache {
    /// Writes the K and V of new tokens into their slots of layer `layer` (the CUDA twin of
    /// [`crate::attn::cpu::reshape_and_cache`]): `key`, `value` `[num_tokens, num_kv_heads,
    /// head_dim]`, `slot_mapping` `[num_tokens]` (-1 = padding, skipped). Slots must be distinct
    /// and in range; the device does not report a bad slot (it skips it), so validate slot
    /// mappings on the host where they come from.
    ///
    /// # Errors
    /// [`CudaError::Kv`] (dtype, layer), [`CudaError::Attn`] (lengths),
    /// [`CudaError::Launch`].
    pub fn reshape_and_cache<T: KvElem + DeviceRepr>(
        &mut self,
        gpu: &Gpu,
        layer: usize,
        key: &CudaSlice<T>,
        value: &CudaSlice<T>,
        slot_mapping: &CudaSlice<i64>,
    ) -> Result<(), CudaError> {
        let (n, row) = (slot_mapping.len(), self.config().token_stride());
        check_len("key", n * row, key.len())?;
        check_len("value", n * row, value.len())?;
        self.reshape_and_cache_rows(
            gpu,
            layer,
            TokenRows::dense(key, row),
            TokenRows::dense(value, row),
            slot_mapping,
        )
    }

    /// [`reshape_and_cache`](Self::reshape_and_cache) from strided rows: the k and v parts of
    /// a fused QKV projection in place, one row per slot of `slot_mapping`.
    ///
    /// # Errors
    /// As [`reshape_and_cache`](Self::reshape_and_cache); [`CudaError::Raw`] for a stride
    /// shorter than a row or a view off the element grid.
    pub fn reshape_and_cache_rows<T: KvElem + DeviceRepr>(
        &mut self,
        gpu: &Gpu,
        layer: usize,
        key: TokenRows<'_, T>,
        value: TokenRows<'_, T>,
        slot_mapping: &CudaSlice<i64>,
    ) -> Result<(), CudaError> {
        let cfg = *self.config();
        check_dtype::<T>(&cfg)?;
        check_layer(&cfg, layer)?;
        let (n, row) = (slot_mapping.len(), cfg.token_stride());
        key.check(gpu, "key", n, row)?;
        value.check(gpu, "value", n, row)?;
        same_device(gpu, slot_mapping)?;
        self.check_device(gpu)?;
        if n == 0 {
            return Ok(());
        }
        gpu.bind()?;
        let stream = gpu.stream();
        let (k, _gk) = key.raw(stream);
        let (v, _gv) = value.raw(stream);
        let (sp, _gs) = slot_mapping.device_ptr(stream);
        // SAFETY: the cache view is this arena (num_blocks pages of its page stride, alive
        // through our Arc until the launch completes: the arena's drop synchronizes); the
        // kernel writes only the block part of the slots' pages, which this view's sequences
        // own (the arena's rule). `k`/`v` hold n rows of H*D elements of the cache's dtype at
        // their strides (dtype, lengths and device checked above), `sp` n i64 slots; all are
        // buffers of this context held by guards until after the call, with cudarc's events
        // ordering the launch after earlier work on them. The primary context is current
        // (bind) and the stream is cudarc's. Slots outside the cache are skipped by the kernel.
        unsafe {
            cuda_raw::reshape_and_cache(&self.raw_view(), layer, k, v, sp, n, gpu.raw_stream())
        }?;
        Ok(())
    }

    /// Decode attention over layer `layer` (the CUDA twin of
    /// [`crate::attn::cpu::paged_attention_decode`]): `query`, `out` `[num_seqs, num_heads,
    /// head_dim]`. The partitioning is a [`DecodePlan`] made per launch for this batch with
    /// [`DeviceAttnParams::mode`] (for a plan fixed across launches, see
    /// [`DecodeStep`](super::DecodeStep)).
    ///
    /// # Errors
    /// [`CudaError::Kv`] (dtype, layer; `GeometryMismatch` for `seqs` uploaded for a geometry
    /// of another block size or more blocks than this cache's), [`CudaError::Attn`] (lengths),
    /// [`CudaError::Driver`] (workspace allocation), [`CudaError::Launch`] (a refused plan,
    /// the launch).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_decode<T: KvElem + DeviceRepr>(
        &self,
        gpu: &Gpu,
        layer: usize,
        query: &CudaSlice<T>,
        seqs: &DeviceSeqs,
        params: &DeviceAttnParams,
        ws: &mut DecodeWorkspace,
        out: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        let row = params.num_heads * self.config().head_dim();
        check_len("query", seqs.num_seqs * row, query.len())?;
        check_len("out", seqs.num_seqs * row, out.len())?;
        self.paged_attention_decode_rows(
            gpu,
            layer,
            TokenRows::dense(query, row),
            seqs,
            params,
            ws,
            TokenRowsMut::dense(out, row),
        )
    }

    /// [`paged_attention_decode`](Self::paged_attention_decode) over strided query and output
    /// rows (e.g. the q part of a fused QKV projection, in place).
    ///
    /// # Errors
    /// As [`paged_attention_decode`](Self::paged_attention_decode); [`CudaError::Raw`] for a
    /// view off the 16-byte grid or a stride shorter than a row.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_decode_rows<T: KvElem + DeviceRepr>(
        &self,
        gpu: &Gpu,
        layer: usize,
        query: TokenRows<'_, T>,
        seqs: &DeviceSeqs,
        params: &DeviceAttnParams,
        ws: &mut DecodeWorkspace,
        mut out: TokenRowsMut<'_, T>,
    ) -> Result<(), CudaError> {
        let cfg = *self.config();
        check_dtype::<T>(&cfg)?;
        check_layer(&cfg, layer)?;
        check_params(gpu, &cfg, params)?;
        let row = params.num_heads * cfg.head_dim();
        query.check(gpu, "query", seqs.num_seqs, row)?;
        out.check(gpu, "out", seqs.num_seqs, row)?;
        seqs.check_cache(&cfg)?;
        same_device(gpu, &seqs.block_tables)?;
        self.check_device(gpu)?;
        if seqs.num_seqs == 0 {
            return Ok(());
        }
        let plan = DecodePlan::for_dtype(
            params.mode,
            cfg.dtype(),
            seqs.num_seqs,
            params.num_heads,
            cfg.num_kv_heads(),
            cfg.head_dim(),
            seqs.max_context_len.max(1),
            gpu.info().sm_count.max(1) as usize,
        )?;
        ws.prepare(gpu, &plan)?;
        gpu.bind()?;
        let stream = gpu.stream();
        let (q, _gq) = query.raw(stream);
        let (tables, _gt) = seqs.raw(stream);
        let (p, _gp) = params.raw(stream);
        let (w, _gw) = ws.raw(stream);
        let (o, _go) = out.raw(stream);
        // SAFETY: every pointer is a live device buffer of this context (devices checked) held
        // by a guard until after the call: `q`/`o` seqs.num_seqs rows of num_heads*head_dim
        // elements of the cache dtype at their strides (checked), the arena `self` views
        // (alive through our Arc until the launch completes; read only), the tables and
        // context lengths of seqs.num_seqs sequences (validated on upload against a geometry
        // of this cache's block size and at most its blocks: check_cache), the slopes
        // num_heads f32 (validated), the workspace at least the plan's bytes (reserved). The
        // primary context is current (bind); the launch is queued on cudarc's stream after
        // earlier work on these buffers (cudarc's events).
        unsafe {
            cuda_raw::paged_attention_decode(
                &self.raw_view(),
                layer,
                q,
                o,
                &tables,
                &p,
                &plan,
                w,
                gpu.raw_stream(),
            )
        }?;
        Ok(())
    }

    /// Prefill attention over layer `layer` (the CUDA twin of
    /// [`crate::attn::cpu::paged_attention_prefill`]): `query`, `out` `[num_tokens, num_heads,
    /// head_dim]` with `seqs` from [`DeviceSeqs::upload_prefill`]; causal over the cached
    /// context.
    ///
    /// # Errors
    /// As [`paged_attention_decode`](Self::paged_attention_decode); [`CudaError::Attn`]
    /// `QueryStartLoc` if `seqs` has no query offsets.
    pub fn paged_attention_prefill<T: KvElem + DeviceRepr>(
        &self,
        gpu: &Gpu,
        layer: usize,
        query: &CudaSlice<T>,
        seqs: &DeviceSeqs,
        params: &DeviceAttnParams,
        out: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        let row = params.num_heads * self.config().head_dim();
        check_len("query", seqs.num_tokens * row, query.len())?;
        check_len("out", seqs.num_tokens * row, out.len())?;
        self.paged_attention_prefill_rows(
            gpu,
            layer,
            TokenRows::dense(query, row),
            seqs,
            params,
            TokenRowsMut::dense(out, row),
        )
    }

    /// [`paged_attention_prefill`](Self::paged_attention_prefill) over strided query and
    /// output rows.
    ///
    /// # Errors
    /// As [`paged_attention_prefill`](Self::paged_attention_prefill); [`CudaError::Raw`] for
    /// a view off the 16-byte grid or a stride shorter than a row.
    pub fn paged_attention_prefill_rows<T: KvElem + DeviceRepr>(
        &self,
        gpu: &Gpu,
        layer: usize,
        query: TokenRows<'_, T>,
        seqs: &DeviceSeqs,
        params: &DeviceAttnParams,
        mut out: TokenRowsMut<'_, T>,
    ) -> Result<(), CudaError> {
        let cfg = *self.config();
        check_dtype::<T>(&cfg)?;
        check_layer(&cfg, layer)?;
        let qsl = seqs
            .query_start_loc
            .as_ref()
            .ok_or(AttnError::QueryStartLoc { seq: 0 })?;
        check_params(gpu, &cfg, params)?;
        let row = params.num_heads * cfg.head_dim();
        query.check(gpu, "query", seqs.num_tokens, row)?;
        out.check(gpu, "out", seqs.num_tokens, row)?;
        seqs.check_cache(&cfg)?;
        same_device(gpu, qsl)?;
        self.check_device(gpu)?;
        if seqs.num_seqs == 0 || seqs.num_tokens == 0 {
            return Ok(());
        }
        gpu.bind()?;
        let stream = gpu.stream();
        let (q, _gq) = query.raw(stream);
        let (tables, _gt) = seqs.raw(stream);
        let (sp, _gs) = qsl.device_ptr(stream);
        let (p, _gp) = params.raw(stream);
        let (o, _go) = out.raw(stream);
        // SAFETY: as in paged_attention_decode_rows; additionally `sp` holds num_seqs + 1
        // non-decreasing offsets from 0 with each q_len <= its context length and <=
        // max_query_len, the last equal to num_tokens (validated on upload), so every
        // query/out row the kernel touches is < num_tokens, inside the checked views.
        unsafe {
            cuda_raw::paged_attention_prefill(
                &self.raw_view(),
                layer,
                q,
                o,
                &tables,
                sp,
                seqs.max_query_len,
                &p,
                gpu.raw_stream(),
            )
        }?;
        Ok(())
    }
}
