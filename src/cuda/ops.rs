//! Safe launch wrappers of the attention and cache-write kernels, and the device-side batch
//! metadata they read ([`DeviceSeqs`], [`DeviceAttnParams`], [`DecodeWorkspace`]).

use super::cache::{same_device, DeviceKvCache};
use super::device::{check_status, Gpu, PageArgs};
use super::ffi;
use crate::error::{AttnError, CudaError, KvError};
use crate::kv::{check_len, KvCacheConfig, KvElem};
use crate::kv::{AttnParams, PagedSeqs};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};
use std::ffi::c_void;

/// How decode attention partitions each sequence's context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeMode {
    /// Single pass for short contexts or large batches, split-K + reduce otherwise, chosen per
    /// launch from the batch shape and the device's SM count (the default).
    #[default]
    Auto,
    /// One pass per (sequence, KV head) over the whole context, whatever its length (the
    /// kernels keep nothing per token in shared memory).
    SinglePass,
    /// Partitions of `PKV_DECODE_PARTITION` (512) tokens and the reduce kernel.
    SplitK,
}

/// Batch metadata in device memory: block tables and context lengths (and, for prefill, the
/// query start offsets), validated on the host with the CPU kernels' rules when uploaded.
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
        Ok(Self {
            block_tables: upload_nonempty(gpu, seqs.block_tables)?,
            context_lens: upload_nonempty(gpu, seqs.context_lens)?,
            query_start_loc: None,
            num_seqs: seqs.num_seqs(),
            max_blocks_per_seq: seqs.max_blocks_per_seq,
            max_context_len,
            max_query_len: 1,
            num_tokens: seqs.num_seqs(),
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
        if query_start_loc.len() != n + 1 {
            return Err(AttnError::LengthMismatch {
                what: "query_start_loc",
                expected: n + 1,
                found: query_start_loc.len(),
            }
            .into());
        }
        if query_start_loc[0] != 0 {
            return Err(AttnError::QueryStartLoc { seq: 0 }.into());
        }
        let mut max_q = 0usize;
        for s in 0..n {
            let (a, b) = (query_start_loc[s], query_start_loc[s + 1]);
            if b < a {
                return Err(AttnError::QueryStartLoc { seq: s }.into());
            }
            let (q_len, context_len) = ((b - a) as usize, seqs.context_lens[s] as usize);
            if q_len > context_len {
                return Err(AttnError::QueryLongerThanContext {
                    seq: s,
                    q_len,
                    context_len,
                }
                .into());
            }
            max_q = max_q.max(q_len);
        }
        Ok(Self {
            block_tables: upload_nonempty(gpu, seqs.block_tables)?,
            context_lens: upload_nonempty(gpu, seqs.context_lens)?,
            query_start_loc: Some(gpu.upload(query_start_loc)?),
            num_seqs: n,
            max_blocks_per_seq: seqs.max_blocks_per_seq,
            max_context_len,
            max_query_len: max_q,
            num_tokens: query_start_loc[n] as usize,
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
        })
    }

    /// Query heads.
    pub fn num_heads(&self) -> usize {
        self.num_heads
    }
}

/// Device scratch of split-K decode; grows to the largest batch seen, never shrinks.
#[derive(Debug, Default)]
pub struct DecodeWorkspace {
    buf: Option<CudaSlice<u8>>,
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

fn check_layer(cfg: &KvCacheConfig, layer: usize) -> Result<i32, CudaError> {
    if layer >= cfg.num_layers() {
        return Err(KvError::LayerOutOfRange {
            layer,
            num_layers: cfg.num_layers(),
        }
        .into());
    }
    Ok(layer as i32)
}

fn ffi_params<'a>(
    p: &'a DeviceAttnParams,
    gpu: &'a Gpu,
) -> (ffi::pkv_attn_params, Option<GuardedPtr<'a>>) {
    let guard = p.alibi_slopes.as_ref().map(|s| {
        let (ptr, g) = s.device_ptr(gpu.stream());
        GuardedPtr { ptr, _g: g }
    });
    let raw = ffi::pkv_attn_params {
        num_heads: p.num_heads as i32,
        scale: p.scale,
        softcap: p.softcap,
        sliding_window: i32::try_from(p.sliding_window).unwrap_or(i32::MAX),
        alibi_slopes: guard
            .as_ref()
            .map_or(std::ptr::null(), |g| g.ptr as usize as *const f32),
    };
    (raw, guard)
}

/// A device pointer and the cudarc guard that records its use on the stream when dropped.
struct GuardedPtr<'a> {
    ptr: u64,
    _g: cudarc::driver::SyncOnDrop<'a>,
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
        let cfg = *self.config();
        check_dtype::<T>(&cfg)?;
        let layer_i = check_layer(&cfg, layer)?;
        let n = slot_mapping.len();
        let row = cfg.token_stride();
        check_len("key", n * row, key.len())?;
        check_len("value", n * row, value.len())?;
        self.check_device(gpu)?;
        for s in [key.ordinal(), value.ordinal(), slot_mapping.ordinal()] {
            if s != gpu.info().ordinal {
                return Err(CudaError::WrongDevice {
                    expected: gpu.info().ordinal,
                    found: s,
                });
            }
        }
        let num_tokens = i32::try_from(n).map_err(|_| CudaError::Unsupported {
            what: "num_tokens",
            value: n,
        })?;
        if n == 0 {
            return Ok(());
        }
        gpu.bind()?;
        let stream = gpu.stream();
        let geom = *self.geom();
        let (kp, _gk) = key.device_ptr(stream);
        let (vp, _gv) = value.device_ptr(stream);
        let (sp, _gs) = slot_mapping.device_ptr(stream);
        // SAFETY: `self.base()` is the arena that `geom` describes (num_blocks pages of its
        // page stride), alive through our Arc until the launch completes (the arena's drop
        // synchronizes); the kernel writes only the block part of the slots' pages, which this
        // view's sequences own (the arena's rule). `kp`/`vp` hold
        // n * H * D elements of the cache's dtype (checked: T::DTYPE == dtype, lengths), dense,
        // so row stride H*D; `sp` holds n i64 slots. All four are device buffers of this
        // context (ordinal checked), valid until the guards drop after the call, with cudarc's
        // events ordering the launch after earlier writes. The kernel skips slots outside
        // 0..num_blocks*block_size, so no input makes it write outside the cache.
        let status = unsafe {
            ffi::pkv_reshape_and_cache(
                self.base(),
                &geom,
                layer_i,
                kp as usize as *const c_void,
                vp as usize as *const c_void,
                row as i64,
                row as i64,
                sp as usize as *const i64,
                num_tokens,
                gpu.raw_stream(),
            )
        };
        check_status("pkv_reshape_and_cache", status, Some(PageArgs::of(&cfg)))
    }

    /// Decode attention over layer `layer` (the CUDA twin of
    /// [`crate::attn::cpu::paged_attention_decode`]): `query`, `out` `[num_seqs, num_heads,
    /// head_dim]`. GQA-aware single pass or split-K per [`DeviceAttnParams::mode`].
    ///
    /// # Errors
    /// [`CudaError::Kv`] (dtype, layer), [`CudaError::Attn`] (lengths), [`CudaError::Driver`]
    /// (workspace allocation), [`CudaError::Launch`].
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
        let cfg = *self.config();
        check_dtype::<T>(&cfg)?;
        let layer_i = check_layer(&cfg, layer)?;
        let row = params.num_heads * cfg.head_dim();
        let rows = seqs.num_seqs * row;
        check_len("query", rows, query.len())?;
        check_len("out", rows, out.len())?;
        check_heads(&cfg, params)?;
        same_device(gpu, query)?;
        same_device(gpu, out)?;
        same_device(gpu, &seqs.block_tables)?;
        self.check_device(gpu)?;
        if seqs.num_seqs == 0 {
            return Ok(());
        }
        let max_ctx = i32::try_from(seqs.max_context_len).map_err(|_| CudaError::Unsupported {
            what: "max_context_len",
            value: seqs.max_context_len,
        })?;
        let mode = match params.mode {
            DecodeMode::Auto => ffi::PKV_DECODE_AUTO,
            DecodeMode::SinglePass => ffi::PKV_DECODE_SINGLE,
            DecodeMode::SplitK => ffi::PKV_DECODE_SPLIT,
        };
        let mut plan = ffi::pkv_decode_plan::default();
        // SAFETY: `plan` is a valid local the call writes; with the SM count given the call is
        // a pure host function of its integer arguments.
        let status = unsafe {
            ffi::pkv_decode_plan_init(
                &mut plan,
                mode as i32,
                seqs.num_seqs as i32,
                params.num_heads as i32,
                cfg.num_kv_heads() as i32,
                cfg.head_dim() as i32,
                max_ctx.max(1),
                gpu.info().sm_count.max(1),
            )
        };
        check_status("pkv_decode_plan_init", status, None)?;
        let need = plan.workspace_bytes as usize;
        if need > 0 && ws.capacity_bytes() < need {
            ws.buf = Some(gpu.alloc_zeros::<u8>(need)?);
        }
        gpu.bind()?;
        let stream = gpu.stream();
        let (raw, _alibi) = ffi_params(params, gpu);
        let (qp, _gq) = query.device_ptr(stream);
        let (bp, _gb) = seqs.block_tables.device_ptr(stream);
        let (lp, _gl) = seqs.context_lens.device_ptr(stream);
        let ws_len = ws.capacity_bytes();
        let wsg = ws.buf.as_mut().map(|b| b.device_ptr_mut(stream));
        let wp = wsg.as_ref().map_or(0, |(p, _)| *p);
        let (op, _go) = out.device_ptr_mut(stream);
        // SAFETY: every pointer is a live device buffer of this context (ordinals checked)
        // held by a guard until after the call: `op`/`qp` num_seqs*num_heads*head_dim elements
        // of the cache dtype (checked), `self.base()` the arena `geom` describes (num_blocks
        // pages of its page stride, alive through our Arc until the launch completes; the
        // kernel only reads), `bp`
        // num_seqs*max_blocks_per_seq i32 whose live entries are < num_blocks and `lp` num_seqs
        // context lengths <= max_blocks_per_seq*block_size and <= max_ctx (validated on upload),
        // the ALiBi slopes num_heads f32 (validated), `wp` ws_len >= the bytes
        // pkv_decode_workspace_bytes asked for (or 0 when none is needed). The primary context
        // is current (bind); the launch is queued on cudarc's stream after earlier work on
        // these buffers (cudarc's events).
        let status = unsafe {
            ffi::pkv_paged_attention_decode(
                op as usize as *mut c_void,
                row as i64,
                qp as usize as *const c_void,
                row as i64,
                self.base() as *const c_void,
                self.geom(),
                layer_i,
                bp as usize as *const i32,
                seqs.max_blocks_per_seq as i32,
                lp as usize as *const i32,
                seqs.num_seqs as i32,
                &plan,
                &raw,
                wp as usize as *mut c_void,
                ws_len,
                gpu.raw_stream(),
            )
        };
        drop(wsg);
        check_status(
            "pkv_paged_attention_decode",
            status,
            Some(PageArgs::of(&cfg)),
        )
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
        let cfg = *self.config();
        check_dtype::<T>(&cfg)?;
        let layer_i = check_layer(&cfg, layer)?;
        let qsl = seqs
            .query_start_loc
            .as_ref()
            .ok_or(AttnError::QueryStartLoc { seq: 0 })?;
        let row = params.num_heads * cfg.head_dim();
        let rows = seqs.num_tokens * row;
        check_len("query", rows, query.len())?;
        check_len("out", rows, out.len())?;
        check_heads(&cfg, params)?;
        same_device(gpu, query)?;
        same_device(gpu, out)?;
        same_device(gpu, qsl)?;
        self.check_device(gpu)?;
        if seqs.num_seqs == 0 || seqs.num_tokens == 0 {
            return Ok(());
        }
        gpu.bind()?;
        let stream = gpu.stream();
        let (raw, _alibi) = ffi_params(params, gpu);
        let (qp, _gq) = query.device_ptr(stream);
        let (bp, _gb) = seqs.block_tables.device_ptr(stream);
        let (lp, _gl) = seqs.context_lens.device_ptr(stream);
        let (sp, _gs) = qsl.device_ptr(stream);
        let (op, _go) = out.device_ptr_mut(stream);
        // SAFETY: as in paged_attention_decode; additionally `sp` holds num_seqs + 1
        // non-decreasing offsets from 0 with each q_len <= its context length and the last equal
        // to num_tokens (validated on upload), so every query/out row the kernel touches is
        // < num_tokens; max_query_len bounds every q_len.
        let status = unsafe {
            ffi::pkv_paged_attention_prefill(
                op as usize as *mut c_void,
                row as i64,
                qp as usize as *const c_void,
                row as i64,
                self.base() as *const c_void,
                self.geom(),
                layer_i,
                bp as usize as *const i32,
                seqs.max_blocks_per_seq as i32,
                lp as usize as *const i32,
                sp as usize as *const i32,
                seqs.num_seqs as i32,
                seqs.max_query_len as i32,
                &raw,
                gpu.raw_stream(),
            )
        };
        check_status(
            "pkv_paged_attention_prefill",
            status,
            Some(PageArgs::of(&cfg)),
        )
    }
}

fn check_heads(cfg: &KvCacheConfig, params: &DeviceAttnParams) -> Result<(), CudaError> {
    if params.num_heads == 0 || params.num_heads % cfg.num_kv_heads() != 0 {
        return Err(AttnError::HeadsNotMultiple {
            num_heads: params.num_heads,
            num_kv_heads: cfg.num_kv_heads(),
        }
        .into());
    }
    Ok(())
}
