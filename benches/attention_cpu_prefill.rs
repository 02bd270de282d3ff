//! Prefill (chunked prefill) attention on the CPU: chunks of new query tokens over cached
//! context, GQA 32:8, head_dim 128, in FLOP/s of the causal attention (`4 * head_dim` per
//! query row and visible key: `q·k` and the weighted value, multiply and add each), side by
//! side in each group with:
//!
//! - `gather_then_attend`: the seed designs' approach (ruvllm keeps each sequence's K/V as
//!   contiguous `Vec<f32>`): copy each sequence's K and V out of the paged cache into
//!   contiguous `f32` buffers, then, per query head in parallel with rayon, each query row's
//!   scores over its visible keys, softmax, weighted values; our re-implementation with the same
//!   8-lane dot product of fused multiply-adds, the same run-time choice of AVX2 + FMA code and
//!   buffers kept across calls (as pagedkv keeps its workspace), so the ratio measures the
//!   approach.
//!
//! Correctness is checked before timing: pagedkv and the baseline agree within the dtype's
//! tolerance.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::{bf16, f16};
use pagedkv::attn::cpu::paged_attention_prefill;
use pagedkv::attn::AttnWorkspace;
use pagedkv::kv::{AttnParams, KvElem, KvPart, PagedSeqs};
use rayon::prelude::*;
use std::hint::black_box;

#[path = "support/attn_cache.rs"]
mod attn_cache;
use attn_cache::{assert_close, dot, setup, Setup, BLOCK, GQA, HEAD_DIM, KV_HEADS};

/// (sequences, new tokens each, cached tokens each) points of the grid.
const GRID: [(usize, usize, usize); 3] = [(1, 256, 0), (1, 128, 1024), (4, 64, 256)];

/// Multiply-adds of the causal attention of `s`, times two (FLOP).
fn flops<T>(s: &Setup<T>) -> u64 {
    let nh = (KV_HEADS * GQA) as u64;
    let keys: u64 = s
        .ctx
        .iter()
        .map(|&c| {
            let (c, q) = (c as u64, s.q_rows as u64);
            (c - q + 1..=c).sum::<u64>()
        })
        .sum();
    4 * HEAD_DIM as u64 * nh * keys
}

/// One rayon thread's buffers for the baseline's rows, kept across calls.
#[derive(Default)]
struct RowScratch {
    q: Vec<f32>,
    scores: Vec<f32>,
}

thread_local! {
    static ROW_SCRATCH: std::cell::RefCell<RowScratch> =
        std::cell::RefCell::new(RowScratch::default());
}

/// The baseline's gathered K and V of one sequence, kept across calls.
#[derive(Default)]
struct Gathered {
    k: Vec<f32>,
    v: Vec<f32>,
}

/// The seed designs' path: per sequence, gather its K/V contiguous as f32, then attend every
/// query head in parallel.
fn gather_then_attend<T: KvElem>(
    s: &Setup<T>,
    params: &AttnParams<'_>,
    kv: &mut Gathered,
    out: &mut [f32],
) {
    let (d, nh) = (HEAD_DIM, params.num_heads);
    let cfg = *s.cache.config();
    let data = s.cache.view::<T>().unwrap().data();
    let row = KV_HEADS * d;
    for (seq, out) in out.chunks_mut(s.q_rows * nh * d).enumerate() {
        let ctx = s.ctx[seq] as usize;
        // Every element below is written before it is read: growing fills once.
        kv.k.resize(ctx * row, 0.0);
        kv.v.resize(ctx * row, 0.0);
        for p in 0..ctx {
            let b = s.tables[seq * s.mbps + p / BLOCK] as usize;
            let ko = cfg.offset(b, 0, KvPart::Key, p % BLOCK, 0);
            let vo = cfg.offset(b, 0, KvPart::Value, p % BLOCK, 0);
            T::widen_slice(&data[ko..ko + row], &mut kv.k[p * row..(p + 1) * row]);
            T::widen_slice(&data[vo..vo + row], &mut kv.v[p * row..(p + 1) * row]);
        }
        let (k, v) = (&kv.k[..ctx * row], &kv.v[..ctx * row]);
        let q0 = seq * s.q_rows;
        // Heads in parallel; a head's rows are strided in `out`, so each task writes its own
        // `[q_rows, d]` block and the blocks are scattered after.
        let per_head: Vec<Vec<f32>> = (0..nh)
            .into_par_iter()
            .map(|h| {
                ROW_SCRATCH
                    .with(|sc| attend_head(s, params, h, q0, ctx, k, v, &mut sc.borrow_mut()))
            })
            .collect();
        for (h, rows) in per_head.iter().enumerate() {
            for (i, r) in rows.chunks_exact(d).enumerate() {
                out[(i * nh + h) * d..(i * nh + h + 1) * d].copy_from_slice(r);
            }
        }
    }
}

/// Query head `h` of one sequence's chunk (rows `q0..q0 + q_rows` of the query), over its
/// gathered `k`, `v` (`ctx` tokens), on the widest vector unit the CPU has (as pagedkv).
#[allow(clippy::too_many_arguments)]
fn attend_head<T: KvElem>(
    s: &Setup<T>,
    params: &AttnParams<'_>,
    h: usize,
    q0: usize,
    ctx: usize,
    k: &[f32],
    v: &[f32],
    sc: &mut RowScratch,
) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: `attend_head_avx2` only requires AVX2 and FMA, which the line above detected.
            return unsafe { attend_head_avx2(s, params, h, q0, ctx, k, v, sc) };
        }
    }
    attend_head_body(s, params, h, q0, ctx, k, v, sc)
}

/// [`attend_head_body`] compiled with AVX2 and FMA.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_head_avx2<T: KvElem>(
    s: &Setup<T>,
    params: &AttnParams<'_>,
    h: usize,
    q0: usize,
    ctx: usize,
    k: &[f32],
    v: &[f32],
    sc: &mut RowScratch,
) -> Vec<f32> {
    attend_head_body(s, params, h, q0, ctx, k, v, sc)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_head_body<T: KvElem>(
    s: &Setup<T>,
    params: &AttnParams<'_>,
    h: usize,
    q0: usize,
    ctx: usize,
    k: &[f32],
    v: &[f32],
    sc: &mut RowScratch,
) -> Vec<f32> {
    let (d, nh, row) = (HEAD_DIM, params.num_heads, KV_HEADS * HEAD_DIM);
    let kvh = h / GQA;
    let mut out = vec![0f32; s.q_rows * d];
    sc.q.resize(d, 0.0);
    sc.scores.resize(ctx, 0.0);
    for (i, o) in out.chunks_exact_mut(d).enumerate() {
        let qo = ((q0 + i) * nh + h) * d;
        T::widen_slice(&s.query[qo..qo + d], &mut sc.q);
        let keys = ctx - s.q_rows + i + 1; // causal: keys 0..=own position
        let scores = &mut sc.scores[..keys];
        for (p, x) in scores.iter_mut().enumerate() {
            *x = params.scale * dot(&sc.q, &k[p * row + kvh * d..p * row + (kvh + 1) * d]);
        }
        let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut z = 0.0;
        for x in scores.iter_mut() {
            *x = (*x - m).exp();
            z += *x;
        }
        for (p, &w) in scores.iter().enumerate() {
            let vr = &v[p * row + kvh * d..p * row + (kvh + 1) * d];
            for (a, &x) in o.iter_mut().zip(vr) {
                *a = (w / z).mul_add(x, *a);
            }
        }
    }
    out
}

fn bench_dtype<T: KvElem>(c: &mut Criterion) {
    for (batch, new, cached) in GRID {
        let s = setup::<T>(batch, cached + new, new);
        let params = AttnParams::new(KV_HEADS * GQA, HEAD_DIM);
        let seqs = PagedSeqs {
            block_tables: &s.tables,
            max_blocks_per_seq: s.mbps,
            context_lens: &s.ctx,
        };
        let starts: Vec<i32> = (0..=batch).map(|i| (i * new) as i32).collect();
        let view = s.cache.view::<T>().unwrap();
        let kv = view.layer(0).unwrap();
        let mut ws = AttnWorkspace::new();
        let mut out = vec![T::default(); s.query.len()];
        let mut base = vec![0f32; s.query.len()];
        let mut gathered = Gathered::default();

        // Correctness inside the bench.
        paged_attention_prefill(&mut ws, kv, &s.query, &starts, &seqs, &params, &mut out).unwrap();
        gather_then_attend(&s, &params, &mut gathered, &mut base);
        assert_close(&out, &base);

        let mut g = c.benchmark_group(format!("prefill_{}", T::DTYPE));
        g.throughput(Throughput::Elements(flops(&s)));
        let label = format!("b{batch}_new{new}_cached{cached}");
        g.bench_function(BenchmarkId::new("pagedkv", &label), |bch| {
            bch.iter(|| {
                paged_attention_prefill(
                    &mut ws,
                    kv,
                    black_box(&s.query),
                    &starts,
                    &seqs,
                    &params,
                    &mut out,
                )
                .unwrap()
            })
        });
        g.bench_function(BenchmarkId::new("gather_then_attend", &label), |bch| {
            bch.iter(|| gather_then_attend(&s, &params, &mut gathered, black_box(&mut base)))
        });
        g.finish();
    }
}

fn benches(c: &mut Criterion) {
    bench_dtype::<f32>(c);
    bench_dtype::<f16>(c);
    bench_dtype::<bf16>(c);
}

criterion_group!(attention_cpu_prefill, benches);
criterion_main!(attention_cpu_prefill);
