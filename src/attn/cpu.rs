//! The CPU kernels: `reshape_and_cache`, `paged_attention_decode`, `paged_attention_prefill`,
//! `copy_blocks`, with exactly the semantics of their CUDA twins (see [`crate::attn`] for the
//! attention formula and [`crate::kv::layout`] for the cache layout).

use super::{AttnParams, AttnWorkspace, PagedSeqs};
use crate::error::AttnError;
use crate::kv::{KvCacheViewMut, KvElem, LayerKv, LayerKvMut};

/// One unit of parallel work (internal; public only so [`AttnWorkspace`] can name it).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, Default)]
pub struct WorkItem {
    seq: u32,
    /// KV head (decode) or first query token of the tile, relative to the sequence (prefill).
    sub: u32,
    /// Query tokens of the tile (prefill).
    len: u32,
    /// First output element of the item.
    out_start: usize,
    /// Sum of the costs of this item and all before it.
    cost_end: u64,
}

/// Writes the keys and values of this step's tokens into their cache slots, for one layer.
///
/// - `key`, `value`: `[num_tokens, num_kv_heads, head_dim]` row-major, the cache's dtype.
/// - `slot_mapping`: `[num_tokens]`; token `i` goes to block `slot / block_size`, token
///   `slot % block_size` of that block, in `kv.layer()`. `-1` is padding: that token is
///   skipped.
///
/// Tokens are written in order; two tokens with the same slot is a caller bug (the CUDA kernel
/// writes them concurrently, so which one wins is unspecified there; here the later one).
///
/// # Errors
/// [`AttnError::LengthMismatch`] if `key`/`value` are not `num_tokens * num_kv_heads *
/// head_dim` long; [`AttnError::SlotOutOfRange`] for a slot not in `-1` or
/// `0..num_blocks*block_size`. Nothing is written on error.
pub fn reshape_and_cache<T: KvElem>(
    kv: LayerKvMut<'_, T>,
    key: &[T],
    value: &[T],
    slot_mapping: &[i64],
) -> Result<(), AttnError> {
    let _ = (kv, key, value, slot_mapping);
    todo!()
}

/// Decode attention: one new query token per sequence, attending to its whole context (new
/// token included) through the block table.
///
/// - `query`, `out`: `[num_seqs, num_heads, head_dim]`, the cache's dtype; `num_seqs =
///   seqs.num_seqs()`, `num_heads = params.num_heads`.
/// - Query position of sequence `s`: `context_lens[s] - 1`. A sequence with `context_len == 0`
///   (padding) gets an all-zero output row.
/// - Semantics: [`crate::attn`] (scale, soft-cap, ALiBi, window, f32 softmax with max trick).
///
/// Parallel over (sequence, KV head) pairs with rayon; each task handles the
/// `num_heads / num_kv_heads` query heads that share its KV head, so each K/V element is read
/// once per task. Blocks wholly outside the sliding window are not read. No allocation once
/// `ws` has grown to the batch's shape.
///
/// # Errors
/// [`AttnError::HeadsNotMultiple`], [`AttnError::BadParam`], [`AttnError::LengthMismatch`]
/// (query, out, block tables, ALiBi slopes), [`AttnError::ContextLen`],
/// [`AttnError::BlockOutOfRange`] (only live entries are checked). `out` is untouched on error.
pub fn paged_attention_decode<T: KvElem>(
    ws: &mut AttnWorkspace,
    kv: LayerKv<'_, T>,
    query: &[T],
    seqs: &PagedSeqs<'_>,
    params: &AttnParams<'_>,
    out: &mut [T],
) -> Result<(), AttnError> {
    let _ = (ws, kv, query, seqs, params, out);
    todo!()
}

/// Prefill (and chunked prefill) attention: a variable number of new query tokens per
/// sequence, each attending causally to the cached context and to the new tokens up to itself.
///
/// - `query_start_loc`: `[num_seqs + 1]`, non-decreasing, `query_start_loc[0] == 0`; the new
///   tokens of sequence `s` are rows `query_start_loc[s]..query_start_loc[s+1]` of `query`
///   (`q_len = ` their count, may be 0), and `num_tokens = query_start_loc[num_seqs]`.
/// - `query`, `out`: `[num_tokens, num_heads, head_dim]`, the cache's dtype.
/// - Their K/V are already in the cache (`reshape_and_cache` ran first), so `context_lens[s]`
///   counts them: `q_len <= context_len`, and new token `i` has position
///   `context_len - q_len + i` and sees keys `0..=` that position (window permitting).
/// - Semantics: [`crate::attn`].
///
/// Parallel over (sequence, tile of query tokens) with rayon, balanced by causal cost; inside a
/// task each KV head's keys are read once for the whole tile and all query heads of its group.
///
/// # Errors
/// As [`paged_attention_decode`], plus [`AttnError::QueryStartLoc`] and
/// [`AttnError::QueryLongerThanContext`]. `out` is untouched on error.
pub fn paged_attention_prefill<T: KvElem>(
    ws: &mut AttnWorkspace,
    kv: LayerKv<'_, T>,
    query: &[T],
    query_start_loc: &[i32],
    seqs: &PagedSeqs<'_>,
    params: &AttnParams<'_>,
    out: &mut [T],
) -> Result<(), AttnError> {
    let _ = (ws, kv, query, query_start_loc, seqs, params, out);
    todo!()
}

/// Copies whole blocks, `(src, dst)` dense block indices, all layers, K and V, in one call
/// (copy-on-write of shared prefix blocks). Consecutive pairs with consecutive indices become
/// one contiguous copy (the layout puts a block's layers next to each other).
///
/// Destinations must be pairwise distinct and no destination may be a source of the same call
/// (the CUDA kernel copies all pairs concurrently, so the result must not depend on order).
///
/// # Errors
/// [`AttnError::Kv`] wrapping [`crate::error::KvError::BlockOutOfRange`],
/// `DuplicateDestination` or `CopyOverlap`. Nothing is copied on error.
pub fn copy_blocks<T: KvElem>(
    cache: &mut KvCacheViewMut<'_, T>,
    pairs: &[(u32, u32)],
) -> Result<(), AttnError> {
    let _ = (cache, pairs);
    todo!()
}
