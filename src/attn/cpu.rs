//! The CPU kernels: `reshape_and_cache`, `paged_attention_decode`, `paged_attention_prefill`,
//! `copy_blocks`, with exactly the semantics of their CUDA twins (see [`crate::attn`] for the
//! attention formula and [`KvCacheConfig`] for the cache layout).

use super::AttnWorkspace;
use crate::error::AttnError;
use crate::kv::{
    check_block_mapping, check_len, check_params, check_query_starts, check_slots,
    copy_runs_within, elems_of, row_elems, AttnParams, KvCacheConfig, KvCacheViewMut, KvElem,
    KvPart, LayerKv, LayerKvMut, PagedSeqs,
};

/// One unit of parallel work: query tokens `tok0..tok0+tq` of one sequence (decode: `tq == 1`),
/// KV heads `kvh_begin..kvh_end`. Internal; public only so [`AttnWorkspace`] can hold them.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, Default)]
pub struct WorkItem {
    seq: u32,
    /// First query row (index into the `[num_tokens, num_heads, head_dim]` query).
    tok0: u32,
    /// Query tokens in the item.
    tq: u32,
    kvh_begin: u32,
    kvh_end: u32,
    /// Position of query token `tok0` in its sequence; -1 for an empty decode sequence.
    qpos0: i64,
    /// First output element written by the item; items are sorted by it and do not overlap.
    out_start: usize,
    /// Output elements written by the item.
    out_len: usize,
    /// Cost (keys x query rows) of all items before this one, and including it.
    cost_start: u64,
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
    let cfg = *kv.config();
    let group = check_params(&cfg, seqs, params)?;
    let num_seqs = seqs.num_seqs();
    let hd = row_elems(params.num_heads, cfg.head_dim())?;
    let rows = elems_of(num_seqs, hd)?;
    check_len("query", rows, query.len())?;
    check_len("out", rows, out.len())?;
    let window = params.sliding_window as u64;
    ws.items.clear();
    let mut cost = 0u64;
    for (s, &ctx) in seqs.context_lens.iter().enumerate() {
        let ctx = ctx as u64;
        let keys = if window == 0 { ctx } else { ctx.min(window) };
        for kvh in 0..cfg.num_kv_heads() {
            let c = 1 + keys * group as u64;
            ws.items.push(WorkItem {
                seq: s as u32,
                tok0: s as u32,
                tq: 1,
                kvh_begin: kvh as u32,
                kvh_end: kvh as u32 + 1,
                qpos0: ctx as i64 - 1,
                out_start: s * hd + kvh * group * cfg.head_dim(),
                out_len: group * cfg.head_dim(),
                cost_start: cost,
                cost_end: cost + c,
            });
            cost += c;
        }
    }
    run(ws, &cfg, kv, query, seqs, params, group, 1, out);
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
    run(ws, &cfg, kv, query, seqs, params, group, tile, out);
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

/// Scratch floats one task slot needs for `rows` query rows.
fn slot_len(cfg: &KvCacheConfig, rows: usize) -> usize {
    let (d, bs) = (cfg.head_dim(), cfg.block_size());
    2 * rows * d + rows * bs + 2 * rows + d
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
    out: &mut [T],
) {
    if ws.items.is_empty() {
        return;
    }
    let per_slot = slot_len(cfg, group * max_tq);
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

/// What every task reads.
struct TaskCtx<'a, T> {
    cfg: KvCacheConfig,
    kv: LayerKv<'a, T>,
    layer: usize,
    query: &'a [T],
    seqs: &'a PagedSeqs<'a>,
    params: &'a AttnParams<'a>,
    group: usize,
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

/// `s[r..r+8]` as an array (`r + 8 <= s.len()`), so that lane loops compile to vector code.
#[inline(always)]
fn lanes(s: &[f32], r: usize) -> &[f32; 8] {
    s[r..r + 8].try_into().unwrap_or(&[0.0; 8])
}

/// Pairwise sum of eight lanes, in a fixed order shared by [`dot`] and [`dot4`].
#[inline(always)]
fn hsum(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
}

/// 8-lane dot product (`head_dim` is a multiple of 8): the lanes are explicit, so the compiler
/// keeps them in vector registers without reassociating a single accumulator.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let d = b.len();
    let a = &a[..d];
    let mut acc = [0f32; 8];
    for c in (0..d).step_by(8) {
        let (x, y) = (lanes(a, c), lanes(b, c));
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    hsum(acc)
}

/// Four dot products of `q4` (four rows of `k.len()` elements) with `k`, sharing each load
/// of `k`. Lane-for-lane the same arithmetic as [`dot`], so results do not depend on grouping.
#[inline(always)]
fn dot4(q4: &[f32], k: &[f32]) -> [f32; 4] {
    let d = k.len();
    let (q0, rest) = q4.split_at(d);
    let (q1, rest) = rest.split_at(d);
    let (q2, q3) = rest.split_at(d);
    let (mut a0, mut a1, mut a2, mut a3) = ([0f32; 8], [0f32; 8], [0f32; 8], [0f32; 8]);
    for c in (0..d).step_by(8) {
        let kc = lanes(k, c);
        let (c0, c1, c2, c3) = (lanes(q0, c), lanes(q1, c), lanes(q2, c), lanes(q3, c));
        for i in 0..8 {
            a0[i] += c0[i] * kc[i];
            a1[i] += c1[i] * kc[i];
            a2[i] += c2[i] * kc[i];
            a3[i] += c3[i] * kc[i];
        }
    }
    [hsum(a0), hsum(a1), hsum(a2), hsum(a3)]
}

/// `acc4[r] += p[r] * v` for four rows of `v.len()` elements, sharing each load of `v`.
#[inline(always)]
fn axpy4(acc4: &mut [f32], p: [f32; 4], v: &[f32]) {
    let d = v.len();
    let (a0, rest) = acc4.split_at_mut(d);
    let (a1, rest) = rest.split_at_mut(d);
    let (a2, a3) = rest.split_at_mut(d);
    let (a1, a2, a3) = (&mut a1[..d], &mut a2[..d], &mut a3[..d]);
    for i in 0..d {
        let x = v[i];
        a0[i] += p[0] * x;
        a1[i] += p[1] * x;
        a2[i] += p[2] * x;
        a3[i] += p[3] * x;
    }
}

#[inline(always)]
fn axpy(acc: &mut [f32], p: f32, v: &[f32]) {
    let acc = &mut acc[..v.len()];
    for i in 0..v.len() {
        acc[i] += p * v[i];
    }
}

/// Widens `src` into `buf` unless it already is `f32`.
#[inline(always)]
fn widen<'b, T: KvElem>(src: &'b [T], buf: &'b mut [f32]) -> &'b [f32] {
    match T::as_f32_slice(src) {
        Some(s) => s,
        None => {
            T::widen_slice(src, buf);
            buf
        }
    }
}

/// One work item, on the widest vector unit the CPU has: the body is compiled twice, once for
/// the build's baseline target and once with AVX2 enabled, chosen at run time. Every lane does
/// the same arithmetic in both, so the results are bit-identical.
fn attend_item<T: KvElem>(ctx: &TaskCtx<'_, T>, it: &WorkItem, out: &mut [T], slot: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: `attend_item_avx2`'s only requirement is that the CPU supports AVX2, which
            // the line above just detected.
            unsafe { attend_item_avx2(ctx, it, out, slot) };
            return;
        }
    }
    attend_item_body(ctx, it, out, slot);
}

/// [`attend_item_body`] compiled with AVX2.
///
/// # Safety
/// The CPU must support AVX2 (`is_x86_feature_detected!("avx2")`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn attend_item_avx2<T: KvElem>(
    ctx: &TaskCtx<'_, T>,
    it: &WorkItem,
    out: &mut [T],
    slot: &mut [f32],
) {
    attend_item_body(ctx, it, out, slot);
}

/// One work item: for each of its KV heads, the `tq * group` query rows sharing that KV head
/// walk the visible blocks once with an online (block-wise) softmax.
#[inline(always)]
fn attend_item_body<T: KvElem>(
    ctx: &TaskCtx<'_, T>,
    it: &WorkItem,
    out: &mut [T],
    slot: &mut [f32],
) {
    let cfg = &ctx.cfg;
    let (d, bs, g) = (cfg.head_dim(), cfg.block_size(), ctx.group);
    let nh = ctx.params.num_heads;
    let tq = it.tq as usize;
    let rows = tq * g;
    if it.qpos0 < 0 {
        // Empty decode sequence (context_len 0): defined as zeros.
        out.fill(T::default());
        return;
    }
    let (q32, rest) = slot.split_at_mut(rows * d);
    let (acc, rest) = rest.split_at_mut(rows * d);
    let (scores, rest) = rest.split_at_mut(rows * bs);
    let (m, rest) = rest.split_at_mut(rows);
    let (l, rest) = rest.split_at_mut(rows);
    let kbuf = &mut rest[..d];

    let scale = ctx.params.scale;
    let softcap = ctx.params.softcap;
    // A window past i64 is no window at all (as on the CUDA path): `as` would wrap it negative
    // and mask every key, the query's own included.
    let window = i64::try_from(ctx.params.sliding_window).unwrap_or(i64::MAX);
    let mbps = ctx.seqs.max_blocks_per_seq;
    let seq = it.seq as usize;
    let table = &ctx.seqs.block_tables[seq * mbps..(seq + 1) * mbps];
    let qpos_first = it.qpos0;
    let qpos_last = it.qpos0 + tq as i64 - 1;
    let lo = if window > 0 {
        (qpos_first - window + 1).max(0)
    } else {
        0
    };
    let hi = qpos_last + 1; // keys lo..hi may be visible to some row
    let tok0 = it.tok0 as usize;

    for kvh in it.kvh_begin as usize..it.kvh_end as usize {
        // Widen the query rows: row r = ti * g + gi is head kvh*g + gi of token tok0+ti. The
        // scale multiplies each dot product (`s = scale * dot(q, k)`, as in the kernels), not
        // the query: a pre-scaled query rounds and overflows differently (a `q·k` past f32 under
        // a small scale was finite here and +inf, a NaN row, in every CUDA kernel).
        for ti in 0..tq {
            for gi in 0..g {
                let r = ti * g + gi;
                let qo = ((tok0 + ti) * nh + kvh * g + gi) * d;
                T::widen_slice(&ctx.query[qo..qo + d], &mut q32[r * d..(r + 1) * d]);
            }
        }
        acc.fill(0.0);
        m.fill(f32::NEG_INFINITY);
        l.fill(0.0);
        // A raw `q·k` of row `r` and key position `kpos`, scaled, capped, biased and masked.
        let finish = |raw: f32, kpos: i64, r: usize| -> f32 {
            let qpos = qpos_first + (r / g) as i64;
            let visible = kpos <= qpos && (window == 0 || qpos - kpos < window);
            if !visible {
                return f32::NEG_INFINITY;
            }
            let mut s = raw * scale;
            if softcap > 0.0 {
                s = softcap * (s / softcap).tanh();
            }
            if let Some(slopes) = ctx.params.alibi_slopes {
                s += slopes[kvh * g + r % g] * (kpos - qpos) as f32;
            }
            s
        };

        let first_block = (lo as usize) / bs;
        let last_block = (hi as usize - 1) / bs;
        for (j, &block) in table
            .iter()
            .enumerate()
            .take(last_block + 1)
            .skip(first_block)
        {
            let jb = (j * bs) as i64;
            let t0 = (lo.max(jb) - jb) as usize;
            let t1 = (hi.min(jb + bs as i64) - jb) as usize;
            let kbase = cfg.offset(block as usize, ctx.layer, KvPart::Key, 0, kvh);
            let vbase = kbase + cfg.kv_stride();
            let ts = cfg.token_stride();
            // Scores of this block's visible keys for every row: raw dots four rows at a time
            // (each K element loaded once per four query rows), then cap, bias and mask.
            for t in t0..t1 {
                let kpos = jb + t as i64;
                let ko = kbase + t * ts;
                let k = widen(ctx.kv.head(ko, d), kbuf);
                let mut r = 0;
                while r + 4 <= rows {
                    let s4 = dot4(&q32[r * d..(r + 4) * d], k);
                    for (i, x) in s4.into_iter().enumerate() {
                        scores[(r + i) * bs + t] = x;
                    }
                    r += 4;
                }
                for r in r..rows {
                    scores[r * bs + t] = dot(&q32[r * d..(r + 1) * d], k);
                }
                for r in 0..rows {
                    let x = &mut scores[r * bs + t];
                    *x = finish(*x, kpos, r);
                }
            }
            // Online softmax update, once per block and row.
            for r in 0..rows {
                let sr = &mut scores[r * bs + t0..r * bs + t1];
                let bmax = sr.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                // `f32::max` skips NaN, so a max of -inf may also mean "masked and NaN logits
                // only": only an all-masked block adds nothing; a NaN logit poisons its row
                // (exp(NaN) below), as in the formula and the CUDA prefill kernels.
                if bmax == f32::NEG_INFINITY && sr.iter().all(|&x| x == f32::NEG_INFINITY) {
                    sr.fill(0.0);
                    continue;
                }
                if bmax > m[r] {
                    let corr = (m[r] - bmax).exp(); // exp(-inf) = 0 on the first block
                    let a = &mut acc[r * d..(r + 1) * d];
                    if corr == 0.0 {
                        // Every key so far now has weight 0 (exp underflows): it contributes
                        // nothing, whatever its value; `inf * 0` would make the row NaN, and
                        // the result depend on where block boundaries fall. (`l` keeps a NaN
                        // of a NaN score: that row stays NaN.)
                        a.fill(0.0);
                    } else {
                        for a in a.iter_mut() {
                            *a *= corr;
                        }
                    }
                    l[r] *= corr;
                    m[r] = bmax;
                }
                let mr = m[r];
                let mut sum = 0.0;
                for x in sr.iter_mut() {
                    *x = (*x - mr).exp();
                    sum += *x;
                }
                l[r] += sum;
            }
            // Weighted values, four rows at a time (each V element loaded once per four rows).
            // A weight of 0 (masked key, -inf score, underflow) adds nothing, row by row: a
            // shared `p * v` would give a row that does not see an infinite or NaN value
            // `0 * inf = NaN` from the rows beside it (later tokens of its tile, other heads).
            for t in t0..t1 {
                let vo = vbase + t * ts;
                let v = widen(ctx.kv.head(vo, d), kbuf);
                let mut r = 0;
                while r + 4 <= rows {
                    let p = [0, 1, 2, 3].map(|i| scores[(r + i) * bs + t]);
                    if !p.contains(&0.0) {
                        axpy4(&mut acc[r * d..(r + 4) * d], p, v);
                    } else {
                        // Same per-element arithmetic as `axpy4`, so results do not depend
                        // on which path a row took.
                        for (i, &pi) in p.iter().enumerate() {
                            if pi != 0.0 {
                                axpy(&mut acc[(r + i) * d..(r + i + 1) * d], pi, v);
                            }
                        }
                    }
                    r += 4;
                }
                for r in r..rows {
                    let p = scores[r * bs + t];
                    if p != 0.0 {
                        axpy(&mut acc[r * d..(r + 1) * d], p, v);
                    }
                }
            }
        }
        // A row left non-finite may hold a value whose weight the walk gave before larger
        // scores made it underflow in several rescales, none 0 on its own (`inf * 1e-26` is
        // still inf): the row is recomputed with every key's final weight `exp(s - max)`, so
        // a key of weight 0 contributes nothing however the max grew. Rare (an infinite or
        // overflowing value), so the second walk costs nothing in practice; a NaN sum (a NaN
        // or +inf score) stays NaN, as the formula has it.
        for r in 0..rows {
            let (mr, a) = (m[r], &mut acc[r * d..(r + 1) * d]);
            if !(l[r].is_finite() && mr.is_finite()) || a.iter().all(|x| x.is_finite()) {
                continue;
            }
            a.fill(0.0);
            let q = &q32[r * d..(r + 1) * d];
            let mut sum = 0.0;
            for (j, &block) in table
                .iter()
                .enumerate()
                .take(last_block + 1)
                .skip(first_block)
            {
                let jb = (j * bs) as i64;
                let t0 = (lo.max(jb) - jb) as usize;
                let t1 = (hi.min(jb + bs as i64) - jb) as usize;
                let kbase = cfg.offset(block as usize, ctx.layer, KvPart::Key, 0, kvh);
                let vbase = kbase + cfg.kv_stride();
                let ts = cfg.token_stride();
                for t in t0..t1 {
                    let raw = dot(q, widen(ctx.kv.head(kbase + t * ts, d), kbuf));
                    let w = (finish(raw, jb + t as i64, r) - mr).exp();
                    if w != 0.0 {
                        axpy(a, w, widen(ctx.kv.head(vbase + t * ts, d), kbuf));
                        sum += w;
                    }
                }
            }
            l[r] = sum;
        }
        // Normalise and store rows of this KV head.
        for ti in 0..tq {
            for gi in 0..g {
                let r = ti * g + gi;
                // Every visible score -inf (an infinite key) leaves an empty sum: the row
                // attends to nothing and is zero, as in the kernels (a NaN sum stays NaN).
                let inv = if l[r] == 0.0 { 0.0 } else { 1.0 / l[r] };
                let a = &mut acc[r * d..(r + 1) * d];
                for x in a.iter_mut() {
                    *x *= inv;
                }
                let o = ((tok0 + ti) * nh + kvh * g + gi) * d - it.out_start;
                T::narrow_slice(a, &mut out[o..o + d]);
            }
        }
    }
}
