//! The CPU kernels: `reshape_and_cache`, `paged_attention_decode`, `paged_attention_prefill`,
//! `copy_blocks`, with exactly the semantics of their CUDA twins (see [`crate::attn`] for the
//! attention formula and [`KvCacheConfig`] for the cache layout).

use super::walk::{attend_item, slot_len, TaskCtx};
use super::AttnWorkspace;
use crate::error::AttnError;
use crate::kv::{
    check_block_mapping, check_len, check_params, check_query_starts, check_slots,
    copy_runs_within, elems_of, row_elems, AttnParams, KvCacheConfig, KvCacheViewMut, KvElem,
    KvPart, LayerKv, LayerKvMut, PagedSeqs,
};

/// Query rows one walk over a sequence's blocks serves at most (its KV heads x query tokens x
/// group): the rows' queries and accumulators (2 x 64 x 128 floats at head_dim 128) stay in the
/// L1 / L2 caches while the walk streams the keys and values.
const MAX_WALK_ROWS: usize = 64;

/// One unit of parallel work: query tokens `tok0..tok0+tq` of one sequence (decode: `tq == 1`),
/// KV heads `kvh_begin..kvh_end`. Internal; public only so [`AttnWorkspace`] can hold them.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, Default)]
pub struct WorkItem {
    pub(super) seq: u32,
    /// First query row (index into the `[num_tokens, num_heads, head_dim]` query).
    pub(super) tok0: u32,
    /// Query tokens in the item.
    pub(super) tq: u32,
    pub(super) kvh_begin: u32,
    pub(super) kvh_end: u32,
    /// Position of query token `tok0` in its sequence; -1 for an empty decode sequence.
    pub(super) qpos0: i64,
    /// First output element written by the item; items are sorted by it and do not overlap.
    pub(super) out_start: usize,
    /// Output elements written by the item.
    pub(super) out_len: usize,
    /// Cost (keys x query rows) of all items before this one, and including it.
    pub(super) cost_start: u64,
    pub(super) cost_end: u64,
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
    let mut kv = kv;
    let cfg = *kv.config();
    let row = cfg.token_stride();
    let n = slot_mapping.len();
    let elems = elems_of(n, row)?;
    check_len("key", elems, key.len())?;
    check_len("value", elems, value.len())?;
    check_slots(&cfg, slot_mapping)?;
    let layer = kv.layer();
    for (i, &slot) in slot_mapping.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let (block, off) = (
            slot as usize / cfg.block_size(),
            slot as usize % cfg.block_size(),
        );
        let k = cfg.offset(block, layer, KvPart::Key, off, 0);
        let v = k + cfg.kv_stride();
        kv.write(k, &key[i * row..(i + 1) * row]);
        kv.write(v, &value[i * row..(i + 1) * row]);
    }
    Ok(())
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
/// Parallel with rayon over (sequence, run of KV heads): all of a sequence's KV heads in one
/// task when the batch has enough sequences to keep every thread busy, fewer otherwise (one
/// each for a lone sequence). A task walks its sequence's blocks once for all its KV heads and
/// the `num_heads / num_kv_heads` query heads of each, so each K/V element is read once, and
/// each token's keys (values) of those heads in one contiguous run. Blocks wholly outside the
/// sliding window are not read. No allocation once `ws` has grown to the batch's shape.
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
    let cfg = *kv.config();
    let group = check_params(&cfg, seqs, params)?;
    let num_seqs = seqs.num_seqs();
    let hd = row_elems(params.num_heads, cfg.head_dim())?;
    let rows = elems_of(num_seqs, hd)?;
    check_len("query", rows, query.len())?;
    check_len("out", rows, out.len())?;
    let window = params.sliding_window as u64;
    // KV heads per item: all of a sequence's (one sequential sweep of each block, see
    // `walk`) unless the batch has too few sequences to keep every thread busy, then fewer.
    let nkv = cfg.num_kv_heads();
    let threads = rayon::current_num_threads().max(1);
    let items_per_seq = (threads * 4).div_ceil(num_seqs.max(1)).clamp(1, nkv);
    let chunk = nkv
        .div_ceil(items_per_seq)
        .min((MAX_WALK_ROWS / group).max(1));
    ws.items.clear();
    let mut cost = 0u64;
    for (s, &ctx) in seqs.context_lens.iter().enumerate() {
        let ctx = ctx as u64;
        let keys = if window == 0 { ctx } else { ctx.min(window) };
        let mut kb = 0;
        while kb < nkv {
            let ke = (kb + chunk).min(nkv);
            let c = 1 + keys * (group * (ke - kb)) as u64;
            ws.items.push(WorkItem {
                seq: s as u32,
                tok0: s as u32,
                tq: 1,
                kvh_begin: kb as u32,
                kvh_end: ke as u32,
                qpos0: ctx as i64 - 1,
                out_start: s * hd + kb * group * cfg.head_dim(),
                out_len: (ke - kb) * group * cfg.head_dim(),
                cost_start: cost,
                cost_end: cost + c,
            });
            cost += c;
            kb = ke;
        }
    }
    run(ws, &cfg, kv, query, seqs, params, group, 1, chunk, out);
    Ok(())
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
/// task each KV head's keys are read once for the whole tile and all query heads of its group,
/// several KV heads in one walk when the tile is small (up to 64 query rows a walk).
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
    let cfg = *kv.config();
    let group = check_params(&cfg, seqs, params)?;
    let num_seqs = seqs.num_seqs();
    let num_tokens = check_query_starts(query_start_loc, seqs)?;
    let hd = row_elems(params.num_heads, cfg.head_dim())?;
    let rows = elems_of(num_tokens, hd)?;
    check_len("query", rows, query.len())?;
    check_len("out", rows, out.len())?;

    // Tile size: big enough to reuse each K/V row across many query rows, small enough that
    // every thread gets several tiles and a tile's scratch stays in L2.
    let threads = rayon::current_num_threads().max(1);
    let tile = (num_tokens.div_ceil(threads * 4)).clamp(1, (64 / group).clamp(1, 16));
    let window = params.sliding_window as u64;
    ws.items.clear();
    let mut cost = 0u64;
    for s in 0..num_seqs {
        let qs = query_start_loc[s] as usize;
        let q_len = query_start_loc[s + 1] as usize - qs;
        let ctx = seqs.context_lens[s] as usize;
        let mut i0 = 0;
        while i0 < q_len {
            let tq = tile.min(q_len - i0);
            let qpos0 = (ctx - q_len + i0) as u64;
            let c: u64 = (0..tq as u64)
                .map(|t| {
                    let keys = qpos0 + t + 1;
                    if window == 0 {
                        keys
                    } else {
                        keys.min(window)
                    }
                })
                .sum::<u64>()
                * params.num_heads as u64
                + 1;
            ws.items.push(WorkItem {
                seq: s as u32,
                tok0: (qs + i0) as u32,
                tq: tq as u32,
                kvh_begin: 0,
                kvh_end: cfg.num_kv_heads() as u32,
                qpos0: qpos0 as i64,
                out_start: (qs + i0) * hd,
                out_len: tq * hd,
                cost_start: cost,
                cost_end: cost + c,
            });
            cost += c;
            i0 += tq;
        }
    }
    // KV heads one walk serves together: as many as keep a walk's rows within
    // `MAX_WALK_ROWS` (each item covers every KV head, so its output rows stay contiguous).
    let chunk = (MAX_WALK_ROWS / (tile * group)).clamp(1, cfg.num_kv_heads());
    run(ws, &cfg, kv, query, seqs, params, group, tile, chunk, out);
    Ok(())
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
    let n = cache.config().num_blocks();
    check_block_mapping(pairs, n, n, true)?;
    let (stride, epb) = (
        cache.config().block_stride(),
        cache.config().elems_per_block(),
    );
    copy_runs_within(cache.data_mut(), stride, epb, pairs);
    Ok(())
}

/// Runs `ws.items` over `out` on the rayon pool, with per-slot scratch from `ws.scratch`.
#[allow(clippy::too_many_arguments)]
fn run<T: KvElem>(
    ws: &mut AttnWorkspace,
    cfg: &KvCacheConfig,
    kv: LayerKv<'_, T>,
    query: &[T],
    seqs: &PagedSeqs<'_>,
    params: &AttnParams<'_>,
    group: usize,
    max_tq: usize,
    kv_chunk: usize,
    out: &mut [T],
) {
    if ws.items.is_empty() {
        return;
    }
    let per_slot = slot_len(cfg, kv_chunk * group * max_tq, kv_chunk);
    let slots = ws.items.len().min(rayon::current_num_threads().max(1) * 4);
    if ws.scratch.len() < slots * per_slot {
        ws.scratch.resize(slots * per_slot, 0.0);
    }
    let ctx = TaskCtx {
        cfg: *cfg,
        layer: kv.layer(),
        kv,
        query,
        seqs,
        params,
        group,
        kv_chunk,
    };
    let AttnWorkspace { scratch, items } = ws;
    // Items are built in increasing `out_start` order and their ranges tile a prefix of `out`
    // (prefill items may leave no gap either: tokens of all sequences are consecutive).
    let base = items[0].out_start;
    split_run(
        items,
        &mut out[base..],
        base,
        &mut scratch[..slots * per_slot],
        per_slot,
        &ctx,
    );
}

/// Recursively halves the scratch slots and splits the items where the cumulative cost
/// crosses the same fraction, then `rayon::join`s the halves; one slot runs its items in order.
/// Safe disjointness: `out` is split at the first output element of the right half's first
/// item, and items never write outside `[out_start, out_start + out_len)`.
fn split_run<T: KvElem>(
    items: &[WorkItem],
    out: &mut [T],
    out_base: usize,
    scratch: &mut [f32],
    per_slot: usize,
    ctx: &TaskCtx<'_, T>,
) {
    let slots = scratch.len() / per_slot;
    if slots <= 1 || items.len() <= 1 {
        let slot = &mut scratch[..per_slot];
        for it in items {
            let o = it.out_start - out_base;
            attend_item(ctx, it, &mut out[o..o + it.out_len], slot);
        }
        return;
    }
    let left_slots = slots / 2;
    let (c0, c1) = (items[0].cost_start, items[items.len() - 1].cost_end);
    let target = c0 + (c1 - c0) * left_slots as u64 / slots as u64;
    let k = items
        .partition_point(|it| it.cost_end <= target)
        .clamp(1, items.len() - 1);
    let split = items[k].out_start - out_base;
    let (o1, o2) = out.split_at_mut(split);
    let (s1, s2) = scratch.split_at_mut(left_slots * per_slot);
    let (i1, i2) = items.split_at(k);
    rayon::join(
        || split_run(i1, o1, out_base, s1, per_slot, ctx),
        || split_run(i2, o2, out_base + split, s2, per_slot, ctx),
    );
}
