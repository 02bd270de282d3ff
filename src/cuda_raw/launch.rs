//! The launches: each checks on the host everything the host can see, then calls its C
//! launcher (kernels/pagedkv.h) on the caller's stream.

use super::check::{
    aligned, attn_params, cache_and_layer, check_status, i32_of, non_null, rows, PageArgs,
    VIEW_ALIGN,
};
use super::{ffi, AttnParamsRaw, CacheView, CuStream, DecodePlan, DevPtr, Rows, SeqTables};
use super::{RawError, Workspace};
use crate::kv::KvDtype;
use std::ffi::c_void;

fn dev(p: DevPtr) -> *mut c_void {
    p as usize as *mut c_void
}

/// The batch metadata's pointers and sizes as the ABI takes them.
fn seq_tables(s: &SeqTables) -> Result<(i32, i32), RawError> {
    let n = i32_of("num_seqs", s.num_seqs)?;
    let mbps = i32_of("max_blocks_per_seq", s.max_blocks_per_seq)?;
    if s.num_seqs > 0 {
        non_null("block_tables", s.block_tables)?;
        non_null("context_lens", s.context_lens)?;
        aligned("block_tables", s.block_tables, 4)?;
        aligned("context_lens", s.context_lens, 4)?;
        if s.max_blocks_per_seq == 0 {
            return Err(RawError::Unsupported {
                what: "max_blocks_per_seq",
                value: 0,
            });
        }
    }
    Ok((n, mbps))
}

/// Refuses a plan made for another shape than the launch's, or a batch above its capacity.
fn plan_fits(
    plan: &DecodePlan,
    num_heads: usize,
    cache: &CacheView,
    num_seqs: usize,
) -> Result<(), RawError> {
    let cfg = &cache.config;
    for (what, planned, found) in [
        ("num_heads", plan.num_heads(), num_heads),
        ("num_kv_heads", plan.num_kv_heads(), cfg.num_kv_heads()),
        ("head_dim", plan.head_dim(), cfg.head_dim()),
    ] {
        if planned != found {
            return Err(RawError::PlanMismatch {
                what,
                plan: planned,
                found,
            });
        }
    }
    if num_seqs > plan.num_seqs_capacity() {
        return Err(RawError::OverCapacity {
            what: "num_seqs",
            capacity: plan.num_seqs_capacity(),
            found: num_seqs,
        });
    }
    Ok(())
}

/// Decode attention over layer `layer` (the CUDA twin of
/// [`crate::attn::cpu::paged_attention_decode`]): one query token per sequence attending to
/// its whole context, partitioned as `plan` says; `out` row `s` gets sequence `s`'s output.
/// The grid, shared memory and workspace depend on `plan` and `seqs.num_seqs` only, so the
/// launch can be captured in a CUDA graph and replayed after the metadata and queries change in
/// place.
///
/// # Safety
/// Until the launch completes on `stream`, in the context current on this thread:
/// - `cache.base` points at `cache.config.num_blocks()` pages of `cache.config.page_bytes()`
///   bytes holding the cache in its layout (read only);
/// - `query` holds `seqs.num_seqs` rows of `params.num_heads * head_dim` elements of the
///   cache's dtype at its stride (read only), `out` as many rows (written, every element of
///   them), not overlapping `query`, the cache, the metadata or the workspace;
/// - `seqs.block_tables` holds `num_seqs * max_blocks_per_seq` i32 and `seqs.context_lens`
///   `num_seqs` i32 (read only; their values cannot make the kernel leave the buffers: block
///   ids outside the cache are masked, contexts clamped to the row and to the plan's capacity);
/// - `params.alibi_slopes`, when not 0, holds `num_heads` f32;
/// - `workspace` holds `workspace.bytes` bytes no other work uses meanwhile;
/// - `stream` is a stream of the current context (or null).
///
/// For a correct result (not for memory safety: the merge reads only the workspace), the
/// workspace's first [`DecodePlan::counter_bytes`] are zero: zeroed when it is new or last
/// served another plan; every launch leaves them zero.
///
/// # Errors
/// Before any launch: [`RawError::Unsupported`] (head dim, block size, sizes beyond `i32`),
/// [`RawError::Kv`] (layer), [`RawError::Attn`] (heads, scale, soft-cap), view errors
/// ([`RawError::NullPointer`], [`RawError::Misaligned`]: query/out pointers and strides must be
/// multiples of 16 bytes, [`RawError::StrideTooSmall`]), [`RawError::PlanMismatch`] and
/// [`RawError::OverCapacity`] (the plan), [`RawError::WorkspaceTooSmall`]; after:
/// [`RawError::Launch`] with the launcher's or the runtime's status.
#[allow(clippy::too_many_arguments)]
pub unsafe fn paged_attention_decode(
    cache: &CacheView,
    layer: usize,
    query: Rows,
    out: Rows,
    seqs: &SeqTables,
    params: &AttnParamsRaw,
    plan: &DecodePlan,
    workspace: Workspace,
    stream: CuStream,
) -> Result<(), RawError> {
    let (geom, layer_i) = cache_and_layer(cache, layer)?;
    let p = attn_params(&cache.config, params)?;
    plan_fits(plan, params.num_heads, cache, seqs.num_seqs)?;
    let row = params.num_heads * cache.config.head_dim();
    let es = cache.config.dtype().size_bytes();
    let qs = rows("query", query, row, es, VIEW_ALIGN)?;
    let os = rows("out", out, row, es, VIEW_ALIGN)?;
    let (n, mbps) = seq_tables(seqs)?;
    let need = plan.workspace_bytes();
    if need > 0 {
        if workspace.bytes < need {
            return Err(RawError::WorkspaceTooSmall {
                needed: need,
                found: workspace.bytes,
            });
        }
        non_null("workspace", workspace.ptr)?;
        aligned("workspace", workspace.ptr, VIEW_ALIGN)?;
    }
    if n == 0 {
        return Ok(());
    }
    // SAFETY: the caller vouches for every pointer's memory (this function's contract); the
    // host checks above make the launcher's own checks pass and keep every access the kernels
    // derive from host values inside those buffers (rows of `row` elements at checked strides,
    // num_seqs <= the plan's capacity, a workspace of the plan's size); device values are
    // clamped or masked by the kernels.
    let status = unsafe {
        ffi::pkv_paged_attention_decode(
            dev(out.ptr),
            os,
            dev(query.ptr),
            qs,
            dev(cache.base),
            &geom,
            layer_i,
            seqs.block_tables as usize as *const i32,
            mbps,
            seqs.context_lens as usize as *const i32,
            n,
            plan.as_ffi(),
            &p,
            dev(workspace.ptr),
            workspace.bytes,
            stream,
        )
    };
    check_status(
        "pkv_paged_attention_decode",
        status,
        Some(PageArgs::of(&cache.config)),
    )
}

/// Prefill (chunked) attention over layer `layer` (the CUDA twin of
/// [`crate::attn::cpu::paged_attention_prefill`]): sequence `s` has the query tokens
/// `query_start_loc[s] .. query_start_loc[s + 1]`, the last of its `context_lens[s]` tokens
/// (their K/V already cached); causal over the cached context.
///
/// # Safety
/// As [`paged_attention_decode`] (without plan and workspace), with `query` and `out` holding
/// `num_tokens = query_start_loc[num_seqs]` rows, and: `query_start_loc` holds `num_seqs + 1`
/// i32, non-decreasing from 0, each `q_len` at most `max_query_len` and at most its context
/// length. Unlike the tables and context lengths, these offsets index `query` and `out`, so
/// they must be valid (validate them on the host where they are built).
///
/// # Errors
/// As [`paged_attention_decode`]; [`RawError::NullPointer`] for a null `query_start_loc`;
/// [`RawError::OverCapacity`] for more than 65535 sequences, or a `max_query_len` whose row
/// tiles pass 65535 (`max_query_len * group` above 65535 * 64 rows for f16 / bf16, 65535 * 32
/// for f32).
#[allow(clippy::too_many_arguments)]
pub unsafe fn paged_attention_prefill(
    cache: &CacheView,
    layer: usize,
    query: Rows,
    out: Rows,
    seqs: &SeqTables,
    query_start_loc: DevPtr,
    max_query_len: usize,
    params: &AttnParamsRaw,
    stream: CuStream,
) -> Result<(), RawError> {
    let (geom, layer_i) = cache_and_layer(cache, layer)?;
    let p = attn_params(&cache.config, params)?;
    let row = params.num_heads * cache.config.head_dim();
    let es = cache.config.dtype().size_bytes();
    let qs = rows("query", query, row, es, VIEW_ALIGN)?;
    let os = rows("out", out, row, es, VIEW_ALIGN)?;
    let (n, mbps) = seq_tables(seqs)?;
    let max_q = i32_of("max_query_len", max_query_len)?;
    if n == 0 || max_q == 0 {
        return Ok(());
    }
    // The grid's limits (pagedkv.h): sequences in grid z, row tiles in grid y, counted at the
    // fewest rows per tile a kernel of this dtype has (a tiling with more is refused where
    // that one would be: the limit does not depend on the tiling chosen).
    if n > 65535 {
        return Err(RawError::OverCapacity {
            what: "prefill num_seqs",
            capacity: 65535,
            found: n as usize,
        });
    }
    let group = params.num_heads / cache.config.num_kv_heads();
    let max_rows = prefill_max_query_len(cache.config.dtype(), group);
    if max_query_len > max_rows {
        return Err(RawError::OverCapacity {
            what: "prefill max_query_len (row tiles in grid y)",
            capacity: max_rows,
            found: max_query_len,
        });
    }
    non_null("query_start_loc", query_start_loc)?;
    aligned("query_start_loc", query_start_loc, 4)?;
    // SAFETY: the caller vouches for every pointer's memory and for query_start_loc's values
    // (this function's contract); the host checks above make the launcher's checks pass.
    let status = unsafe {
        ffi::pkv_paged_attention_prefill_tiled(
            dev(out.ptr),
            os,
            dev(query.ptr),
            qs,
            dev(cache.base),
            &geom,
            layer_i,
            seqs.block_tables as usize as *const i32,
            mbps,
            seqs.context_lens as usize as *const i32,
            query_start_loc as usize as *const i32,
            n,
            max_q,
            &p,
            params.prefill_tiling.abi(),
            stream,
        )
    };
    check_status(
        "pkv_paged_attention_prefill_tiled",
        status,
        Some(PageArgs::of(&cache.config)),
    )
}

/// The longest query (tokens of one sequence) a prefill launch takes over a cache of `dtype`
/// with `group` query heads per KV head: its `max_query_len * group` rows, in tiles of the
/// fewest rows a kernel of that dtype has (64 for f16 / bf16, 32 for f32), must fit grid y
/// (65535 tiles).
pub(crate) fn prefill_max_query_len(dtype: KvDtype, group: usize) -> usize {
    let tile_rows = if dtype == KvDtype::F32 { 32 } else { 64 };
    65535 * tile_rows / group.max(1)
}

/// Writes the K and V of `num_tokens` new tokens into their slots of layer `layer` (the CUDA
/// twin of [`crate::attn::cpu::reshape_and_cache`]). Grid: one thread block per token, so a
/// fixed `num_tokens` (padding slots -1) replays in a graph.
///
/// # Safety
/// Until the launch completes on `stream`: `cache.base` as in [`paged_attention_decode`]
/// (written: only the block part of the slots' pages); `key` and `value` hold `num_tokens`
/// rows of `num_kv_heads * head_dim` elements of the cache's dtype at their strides (read
/// only; 16-byte aligned pointers and strides take the vectorized path);
/// `slot_mapping` holds `num_tokens` i64 (a slot outside the cache, -1 included, is skipped;
/// slots must be distinct, else two tokens race for one row).
///
/// # Errors
/// Before any launch: [`RawError::Unsupported`], [`RawError::Kv`] (layer), view errors for
/// `key`/`value`/`slot_mapping`; after: [`RawError::Launch`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn reshape_and_cache(
    cache: &CacheView,
    layer: usize,
    key: Rows,
    value: Rows,
    slot_mapping: DevPtr,
    num_tokens: usize,
    stream: CuStream,
) -> Result<(), RawError> {
    let (geom, layer_i) = cache_and_layer(cache, layer)?;
    let row = cache.config.token_stride();
    let es = cache.config.dtype().size_bytes();
    let ks = rows("key", key, row, es, es)?;
    let vs = rows("value", value, row, es, es)?;
    let n = i32_of("num_tokens", num_tokens)?;
    if n == 0 {
        return Ok(());
    }
    non_null("slot_mapping", slot_mapping)?;
    aligned("slot_mapping", slot_mapping, 8)?;
    // SAFETY: the caller vouches for the buffers (this function's contract); the kernel skips
    // slots outside the cache, so no slot value makes it write outside it.
    let status = unsafe {
        ffi::pkv_reshape_and_cache(
            dev(cache.base),
            &geom,
            layer_i,
            dev(key.ptr),
            dev(value.ptr),
            ks,
            vs,
            slot_mapping as usize as *const i64,
            n,
            stream,
        )
    };
    check_status(
        "pkv_reshape_and_cache",
        status,
        Some(PageArgs::of(&cache.config)),
    )
}

/// Copies whole blocks (every layer, K and V) inside the cache in one launch (copy-on-write):
/// `pairs` is device `[num_pairs][2]` i32 `(src, dst)`.
///
/// # Safety
/// Until the launch completes on `stream`: `cache.base` as in [`paged_attention_decode`]
/// (read and written: the block part of the pages named); `pairs` holds `num_pairs * 2` i32.
/// A pair out of range (or src == dst) is skipped on the device; destinations must be distinct
/// and not also sources, else copies race (wrong bytes, never outside the cache).
///
/// # Errors
/// [`RawError::Unsupported`], [`RawError::NullPointer`]; [`RawError::Launch`].
pub unsafe fn copy_blocks(
    cache: &CacheView,
    pairs: DevPtr,
    num_pairs: usize,
    stream: CuStream,
) -> Result<(), RawError> {
    let (geom, _) = cache_and_layer(cache, 0)?;
    let n = i32_of("copy_blocks pairs", num_pairs)?;
    if n == 0 {
        return Ok(());
    }
    non_null("pairs", pairs)?;
    aligned("pairs", pairs, 4)?;
    // SAFETY: the caller vouches for the cache and the pair list (this function's contract);
    // the kernel skips pairs outside the cache.
    let status = unsafe {
        ffi::pkv_copy_blocks(
            dev(cache.base),
            &geom,
            pairs as usize as *const i32,
            n,
            stream,
        )
    };
    check_status("pkv_copy_blocks", status, Some(PageArgs::of(&cache.config)))
}

/// Swaps whole blocks between a device cache and a host swap space of the same block shape
/// (`block_bytes` at the start of each page on either side), one call, runs of consecutive
/// blocks merged into one copy when both page sizes are equal. `pairs` are `(src block, dst
/// block)`, host memory read during the call only.
///
/// # Safety
/// Until the copies complete on `stream`: `dst` and `src` point at pages of `dst_page_bytes`
/// and `src_page_bytes` bytes holding every block index `pairs` names on their side (device
/// memory of the current context on one side, host memory on the other: pinned for the copies
/// to be asynchronous; pageable host memory makes them synchronous); the destination's blocks
/// are not read or written by other work meanwhile. `to_host`: `dst` is the host side.
///
/// # Errors
/// [`RawError::Unsupported`] (more pairs than `i32`), [`RawError::Kv`] (page smaller than a
/// block or off the 16-byte grid), [`RawError::Launch`] (a negative index: no copy queued; a
/// copy failure: the copies before it may be queued, so wait on `stream` before reusing the
/// buffers).
#[allow(clippy::too_many_arguments)]
pub unsafe fn swap_blocks(
    dst: *mut c_void,
    dst_page_bytes: usize,
    src: *const c_void,
    src_page_bytes: usize,
    block_bytes: usize,
    pairs: &[[i64; 2]],
    to_host: bool,
    stream: CuStream,
) -> Result<(), RawError> {
    let n = i32_of("swap mapping pairs", pairs.len())?;
    if n == 0 {
        return Ok(());
    }
    // SAFETY: the caller vouches for both sides (this function's contract); `pairs` is a live
    // host slice of n [src, dst] i64 pairs (the layout of [n][2] i64), read during the call.
    let status = unsafe {
        ffi::pkv_swap_blocks(
            dst,
            dst_page_bytes,
            src,
            src_page_bytes,
            block_bytes,
            pairs.as_ptr().cast::<i64>(),
            n,
            i32::from(to_host),
            stream,
        )
    };
    // The launcher checks both pages; its status says which check failed, not which side:
    // name the page that fails it.
    let align = ffi::PKV_PAGE_ALIGN as usize;
    let fails = |page_bytes: usize| {
        if status == ffi::PKV_ERR_PAGE_STRIDE as i32 {
            page_bytes < block_bytes
        } else {
            page_bytes % align != 0
        }
    };
    let page = [dst_page_bytes, src_page_bytes]
        .into_iter()
        .find(|&p| fails(p))
        .map(|page_bytes| PageArgs {
            page_bytes,
            block_bytes,
        });
    check_status("pkv_swap_blocks", status, page)
}
