//! The inner loop of the CPU attention kernels: one work item's walk over its sequence's
//! blocks with a block-wise online softmax, and the lane-explicit vector arithmetic it uses.
//!
//! **Block-major over KV heads.** The layout puts a token's keys for all KV heads in one row
//! (`[token][kv_head][head_dim]` inside a block), so a walk that serves one KV head at a time
//! reads a `head_dim` run out of every row and jumps a whole row to the next: one 512-byte run
//! per 4 KiB page at the usual shapes, which the hardware prefetcher (it does not cross pages)
//! and the TLB serve badly once the cache is larger than the CPU's caches. A walk here serves
//! a chunk of consecutive KV heads together ([`TaskCtx::kv_chunk`]): each token's row of the
//! chunk is read once, in one sequential run, and each head's slice of it meets that head's
//! query rows. Every query row's arithmetic (its dot products, its softmax, its weighted sums,
//! in key order) is the same whatever the chunk, so results are bit-identical for any chunk
//! size and thread count.

use super::cpu::WorkItem;
#[cfg(target_arch = "x86_64")]
use super::lanes::Avx2Fma;
use super::lanes::{axpy, dot, exp, exp_sum, max, prefetch, weighted, widen, Dot4, Portable};
use crate::kv::{AttnParams, KvCacheConfig, KvElem, KvPart, LayerKv, PagedSeqs};

/// What every task reads.
pub(super) struct TaskCtx<'a, T> {
    pub(super) cfg: KvCacheConfig,
    pub(super) kv: LayerKv<'a, T>,
    pub(super) layer: usize,
    pub(super) query: &'a [T],
    pub(super) seqs: &'a PagedSeqs<'a>,
    pub(super) params: &'a AttnParams<'a>,
    /// Query heads per KV head.
    pub(super) group: usize,
    /// KV heads one walk serves together (the last chunk of an item may be shorter).
    pub(super) kv_chunk: usize,
}

/// Scratch floats one task slot needs for walks of `rows` query rows over `kv_heads` KV heads.
pub(super) fn slot_len(cfg: &KvCacheConfig, rows: usize, kv_heads: usize) -> usize {
    let (d, bs) = (cfg.head_dim(), cfg.block_size());
    2 * rows * d + rows * bs + 2 * rows + bs * kv_heads * d
}

/// One work item, on the widest vector unit the CPU has: the body is compiled twice, once for
/// the build's baseline target and once with AVX2 and FMA enabled (and [`Avx2Fma`]'s dot
/// products), chosen at run time. Every lane does the same arithmetic in both (fused
/// multiply-adds either way), so the results are bit-identical.
pub(super) fn attend_item<T: KvElem>(
    ctx: &TaskCtx<'_, T>,
    it: &WorkItem,
    out: &mut [T],
    slot: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        if let Some(avx2) = Avx2Fma::detect() {
            // SAFETY: `attend_item_avx2`'s only requirement is that the CPU supports AVX2
            // and FMA, which `Avx2Fma::detect` just found.
            unsafe { attend_item_avx2(ctx, it, out, slot, avx2) };
            return;
        }
    }
    attend_item_body(ctx, it, out, slot, Portable);
}

/// [`attend_item_body`] compiled with AVX2 and FMA.
///
/// # Safety
/// The CPU must support AVX2 and FMA (`is_x86_feature_detected!` of both).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_item_avx2<T: KvElem>(
    ctx: &TaskCtx<'_, T>,
    it: &WorkItem,
    out: &mut [T],
    slot: &mut [f32],
    avx2: Avx2Fma,
) {
    attend_item_body(ctx, it, out, slot, avx2);
}

/// One work item: its KV heads in chunks of [`TaskCtx::kv_chunk`], each chunk one walk.
#[inline(always)]
fn attend_item_body<T: KvElem, L: Dot4>(
    ctx: &TaskCtx<'_, T>,
    it: &WorkItem,
    out: &mut [T],
    slot: &mut [f32],
    lanes: L,
) {
    if it.qpos0 < 0 {
        // Empty decode sequence (context_len 0): defined as zeros.
        out.fill(T::default());
        return;
    }
    let (begin, end) = (it.kvh_begin as usize, it.kvh_end as usize);
    let mut kc = begin;
    while kc < end {
        let ke = (kc + ctx.kv_chunk.max(1)).min(end);
        walk(ctx, it, kc, ke, out, slot, lanes);
        kc = ke;
    }
}

/// KV heads `kc..ke` of one item: their `(ke - kc) * tq * group` query rows walk the visible
/// blocks once with an online (block-wise) softmax. Row `r = (kvh - kc) * tq * group + ti *
/// group + gi` is query head `kvh * group + gi` of token `tok0 + ti`.
#[inline(always)]
fn walk<T: KvElem, L: Dot4>(
    ctx: &TaskCtx<'_, T>,
    it: &WorkItem,
    kc: usize,
    ke: usize,
    out: &mut [T],
    slot: &mut [f32],
    lanes: L,
) {
    let cfg = &ctx.cfg;
    let (d, bs, g) = (cfg.head_dim(), cfg.block_size(), ctx.group);
    let nh = ctx.params.num_heads;
    let tq = it.tq as usize;
    let nk = ke - kc;
    let per_head = tq * g; // rows of one KV head
    let rows = nk * per_head;
    let (q32, rest) = slot.split_at_mut(rows * d);
    let (acc, rest) = rest.split_at_mut(rows * d);
    let (scores, rest) = rest.split_at_mut(rows * bs);
    let (m, rest) = rest.split_at_mut(rows);
    let (l, rest) = rest.split_at_mut(rows);
    let buf = &mut rest[..bs * nk * d];

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
    // Query head of row `r`, and its offset in `query` / `out`.
    let head_of = |r: usize| (kc + r / per_head) * g + r % g;
    let row_offset = |r: usize| ((tok0 + (r % per_head) / g) * nh + head_of(r)) * d;

    // Widen the query rows. The scale multiplies each dot product (`s = scale * dot(q, k)`, as
    // in the kernels), not the query: a pre-scaled query rounds and overflows differently (a
    // `q·k` past f32 under a small scale was finite here and +inf, a NaN row, in every CUDA
    // kernel).
    for r in 0..rows {
        let qo = row_offset(r);
        T::widen_slice(&ctx.query[qo..qo + d], &mut q32[r * d..(r + 1) * d]);
    }
    acc.fill(0.0);
    m.fill(f32::NEG_INFINITY);
    l.fill(0.0);
    // A raw `q·k` of row `r` and key position `kpos`, scaled, capped, biased and masked.
    let finish = |raw: f32, kpos: i64, r: usize| -> f32 {
        let qpos = qpos_first + ((r % per_head) / g) as i64;
        let visible = kpos <= qpos && (window == 0 || qpos - kpos < window);
        if !visible {
            return f32::NEG_INFINITY;
        }
        let mut s = raw * scale;
        if softcap > 0.0 {
            s = softcap * (s / softcap).tanh();
        }
        if let Some(slopes) = ctx.params.alibi_slopes {
            s += slopes[head_of(r)] * (kpos - qpos) as f32;
        }
        s
    };

    let ts = cfg.token_stride();
    let first_block = (lo as usize) / bs;
    let last_block = (hi as usize - 1) / bs;
    for (j, &block) in table
        .iter()
        .enumerate()
        .take(last_block + 1)
        .skip(first_block)
    {
        let (jb, t0, t1) = block_span(j, bs, lo, hi);
        let kbase = cfg.offset(block as usize, ctx.layer, KvPart::Key, 0, kc);
        let vbase = kbase + cfg.kv_stride();
        // Scores of this block's visible keys for every row: the block's key rows for the
        // chunk's heads (each token's one run), then each head's slice meets that head's rows,
        // four rows and two keys at a time (each loaded element used four or two times, eight
        // sums in flight), the last rows and key one by one; then cap, bias and mask.
        let n = t1 - t0;
        let (krows, kst) = block_rows(ctx, kbase + t0 * ts, n, nk * d, buf, Some(vbase + t0 * ts));
        for h in 0..nk {
            let key = |t: usize| &krows[t * kst + h * d..t * kst + (h + 1) * d];
            let (r0, r1) = (h * per_head, (h + 1) * per_head);
            let mut r = r0;
            while r + 4 <= r1 {
                let q4 = &q32[r * d..(r + 4) * d];
                let mut t = 0;
                while t + 2 <= n {
                    let s = lanes.dot4x2(q4, key(t), key(t + 1));
                    for (i, (x0, x1)) in s[0].into_iter().zip(s[1]).enumerate() {
                        scores[(r + i) * bs + t0 + t] = x0;
                        scores[(r + i) * bs + t0 + t + 1] = x1;
                    }
                    t += 2;
                }
                if t < n {
                    for (i, x) in lanes.dot4(q4, key(t)).into_iter().enumerate() {
                        scores[(r + i) * bs + t0 + t] = x;
                    }
                }
                r += 4;
            }
            for r in r..r1 {
                for t in 0..n {
                    scores[r * bs + t0 + t] = dot(&q32[r * d..(r + 1) * d], key(t));
                }
            }
        }
        // Scale, cap, bias and mask, row by row over the block's keys (one contiguous run of
        // `scores` each): a row that sees every key of the block with neither soft-cap nor
        // ALiBi only scales, in a loop that vectorises (`finish` computes the same product).
        let plain = softcap <= 0.0 && ctx.params.alibi_slopes.is_none();
        let (kfirst, klast) = (jb + t0 as i64, jb + t1 as i64 - 1);
        for r in 0..rows {
            let qpos = qpos_first + ((r % per_head) / g) as i64;
            let sr = &mut scores[r * bs + t0..r * bs + t1];
            let all_visible = klast <= qpos && (window == 0 || qpos - kfirst < window);
            if plain && all_visible {
                for x in sr.iter_mut() {
                    *x *= scale;
                }
            } else {
                for (kpos, x) in (kfirst..).zip(sr.iter_mut()) {
                    *x = finish(*x, kpos, r);
                }
            }
        }
        // Online softmax update, once per block and row.
        for r in 0..rows {
            let sr = &mut scores[r * bs + t0..r * bs + t1];
            let bmax = max(sr);
            // `f32::max` skips NaN, so a max of -inf may also mean "masked and NaN logits
            // only": only an all-masked block adds nothing; a NaN logit poisons its row
            // (exp(NaN) below), as in the formula and the CUDA prefill kernels.
            if bmax == f32::NEG_INFINITY && sr.iter().all(|&x| x == f32::NEG_INFINITY) {
                sr.fill(0.0);
                continue;
            }
            if bmax > m[r] {
                let corr = exp(m[r] - bmax); // exp(-inf) = 0 on the first block
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
            l[r] += exp_sum(sr, m[r], (jb + t0 as i64) as usize);
        }
        // Weighted values, up to four rows at a time over the block's keys, their sums in
        // registers (each V element loaded once per four rows). A weight of 0 (masked key,
        // -inf score, underflow) adds nothing, row by row: a shared `p * v` would give a row
        // that does not see an infinite or NaN value `0 * inf = NaN` from the rows beside it
        // (later tokens of its tile, other heads); rows with such a weight go key by key. The
        // next block's keys are asked for while these values are read.
        let next_kbase = (j < last_block)
            .then(|| cfg.offset(table[j + 1] as usize, ctx.layer, KvPart::Key, 0, kc) + t0 * ts);
        let (vrows, vst) = block_rows(ctx, vbase + t0 * ts, n, nk * d, buf, next_kbase);
        for h in 0..nk {
            let vh = &vrows[h * d..];
            let (r0, r1) = (h * per_head, (h + 1) * per_head);
            let mut r = r0;
            while r < r1 {
                let rn = (r1 - r).min(4);
                let w = &scores[r * bs + t0..];
                let a = &mut acc[r * d..(r + rn) * d];
                if (0..rn).any(|i| w[i * bs..i * bs + n].contains(&0.0)) {
                    for (i, ai) in a.chunks_exact_mut(d).enumerate() {
                        for (t, &p) in w[i * bs..i * bs + n].iter().enumerate() {
                            if p != 0.0 {
                                axpy(ai, p, &vh[t * vst..t * vst + d]);
                            }
                        }
                    }
                } else {
                    match rn {
                        4 => weighted::<4>(a, w, bs, n, vh, vst),
                        3 => weighted::<3>(a, w, bs, n, vh, vst),
                        2 => weighted::<2>(a, w, bs, n, vh, vst),
                        _ => weighted::<1>(a, w, bs, n, vh, vst),
                    }
                }
                r += rn;
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
        let kvh = kc + r / per_head;
        let kbuf = &mut buf[..d];
        let mut sum = 0.0;
        for (j, &block) in table
            .iter()
            .enumerate()
            .take(last_block + 1)
            .skip(first_block)
        {
            let (jb, t0, t1) = block_span(j, bs, lo, hi);
            let kbase = cfg.offset(block as usize, ctx.layer, KvPart::Key, 0, kvh);
            let vbase = kbase + cfg.kv_stride();
            for t in t0..t1 {
                let raw = dot(q, widen(ctx.kv.head(kbase + t * ts, d), kbuf));
                let w = exp(finish(raw, jb + t as i64, r) - mr);
                if w != 0.0 {
                    axpy(a, w, widen(ctx.kv.head(vbase + t * ts, d), kbuf));
                    sum += w;
                }
            }
        }
        l[r] = sum;
    }
    // Normalise and store the rows.
    for r in 0..rows {
        // Every visible score -inf (an infinite key) leaves an empty sum: the row attends to
        // nothing and is zero, as in the kernels (a NaN sum stays NaN).
        let inv = if l[r] == 0.0 { 0.0 } else { 1.0 / l[r] };
        let a = &mut acc[r * d..(r + 1) * d];
        for x in a.iter_mut() {
            *x *= inv;
        }
        let o = row_offset(r) - it.out_start;
        T::narrow_slice(a, &mut out[o..o + d]);
    }
}

/// Block `j`'s first key position `jb`, and the range `t0..t1` of its tokens inside the keys
/// `lo..hi` a walk may see.
#[inline(always)]
fn block_span(j: usize, bs: usize, lo: i64, hi: i64) -> (i64, usize, usize) {
    let jb = (j * bs) as i64;
    let t0 = (lo.max(jb) - jb) as usize;
    let t1 = (hi.min(jb + bs as i64) - jb) as usize;
    (jb, t0, t1)
}

/// Rows `0..n` of a block's keys or values for the walk's KV heads (`len` elements each, the
/// first at cache offset `base`, the next `token_stride` on), as `f32` rows `stride` apart:
/// the cache's own rows when it holds `f32`, else widened into `buf`. Each row also asks for
/// the row at `ahead` plus the same offset (the walk's next read of another part) to be
/// prefetched.
#[inline(always)]
fn block_rows<'b, T: KvElem>(
    ctx: &TaskCtx<'b, T>,
    base: usize,
    n: usize,
    len: usize,
    buf: &'b mut [f32],
    ahead: Option<usize>,
) -> (&'b [f32], usize) {
    let ts = ctx.cfg.token_stride();
    let ask = |t: usize| {
        if let Some(a) = ahead {
            prefetch(ctx.kv.head(a + t * ts, len));
        }
    };
    let span = ctx.kv.head(base, (n - 1) * ts + len);
    if let Some(rows) = T::as_f32_slice(span) {
        (0..n).for_each(ask);
        return (rows, ts);
    }
    for t in 0..n {
        ask(t);
        T::widen_slice(
            &span[t * ts..t * ts + len],
            &mut buf[t * len..(t + 1) * len],
        );
    }
    (&buf[..n * len], len)
}
