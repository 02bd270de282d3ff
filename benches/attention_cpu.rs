//! Decode attention on the CPU over a batch x context grid, as bytes of KV read per second,
//! side by side in each group with:
//!
//! - `memcpy`: a plain copy of the same number of bytes (the bandwidth ceiling);
//! - `gather_then_attend`: the seed designs' approach (ruvllm keeps each sequence's K/V as
//!   contiguous `Vec<f32>`): copy each sequence's K and V out of the paged cache into
//!   contiguous `f32` buffers, then attend over them; our re-implementation, parallel over
//!   sequences with rayon, with the same 8-lane dot product of fused multiply-adds, the same
//!   run-time choice of AVX2 + FMA code and buffers kept across calls (as pagedkv keeps its
//!   workspace), so the ratio measures the approach and not threading, vectorisation or the
//!   allocator.
//!
//! Correctness is checked before timing: `pagedkv` and the baseline agree within the dtype's
//! tolerance, and the memcpy destination equals its source.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::{bf16, f16};
use pagedkv::attn::cpu::paged_attention_decode;
use pagedkv::attn::AttnWorkspace;
use pagedkv::kv::{AttnParams, PagedSeqs};
use pagedkv::kv::{KvElem, KvPart};
use rayon::prelude::*;
use std::hint::black_box;

#[path = "support/attn_cache.rs"]
mod attn_cache;
use attn_cache::{assert_close, dot, setup, Setup, BLOCK, GQA, HEAD_DIM, KV_HEADS};

/// (batch, context) points of the grid.
const GRID: [(usize, usize); 3] = [(4, 512), (16, 1024), (64, 256)];

/// One rayon thread's buffers for [`gather_then_attend`], kept across calls (as pagedkv keeps
/// its `AttnWorkspace`), so the baseline times the gather and the attention, not the allocator
/// zero-filling (or page-faulting in) megabytes per sequence per call.
#[derive(Default)]
struct GatherScratch {
    k: Vec<f32>,
    v: Vec<f32>,
    q: Vec<f32>,
    scores: Vec<f32>,
}

thread_local! {
    static GATHER_SCRATCH: std::cell::RefCell<GatherScratch> =
        std::cell::RefCell::new(GatherScratch::default());
}

/// The seed designs' path: gather each sequence's K/V contiguous as f32, then attend.
fn gather_then_attend<T: KvElem>(s: &Setup<T>, params: &AttnParams<'_>, out: &mut [f32]) {
    let nh = params.num_heads;
    out.par_chunks_mut(nh * HEAD_DIM)
        .enumerate()
        .for_each(|(seq, out)| {
            GATHER_SCRATCH
                .with(|scratch| gather_seq(s, params, seq, out, &mut scratch.borrow_mut()))
        });
}

/// One sequence of [`gather_then_attend`], on the widest vector unit the CPU has, chosen at
/// run time as pagedkv's kernel chooses (`attend_item` in src/attn/walk.rs): both sides run
/// AVX2 + FMA code on such a machine, so the ratio compares the approaches, not the
/// instruction sets.
fn gather_seq<T: KvElem>(
    s: &Setup<T>,
    params: &AttnParams<'_>,
    seq: usize,
    out: &mut [f32],
    scratch: &mut GatherScratch,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: `gather_seq_avx2` only requires AVX2 and FMA, which the line above detected.
            unsafe { gather_seq_avx2(s, params, seq, out, scratch) };
            return;
        }
    }
    gather_seq_body(s, params, seq, out, scratch);
}

/// [`gather_seq_body`] compiled with AVX2 and FMA.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gather_seq_avx2<T: KvElem>(
    s: &Setup<T>,
    params: &AttnParams<'_>,
    seq: usize,
    out: &mut [f32],
    scratch: &mut GatherScratch,
) {
    gather_seq_body(s, params, seq, out, scratch);
}

#[inline(always)]
fn gather_seq_body<T: KvElem>(
    s: &Setup<T>,
    params: &AttnParams<'_>,
    seq: usize,
    out: &mut [f32],
    scratch: &mut GatherScratch,
) {
    let cfg = *s.cache.config();
    let data = s.cache.view::<T>().unwrap().data();
    let (d, nh) = (HEAD_DIM, params.num_heads);
    let ctx = s.ctx[seq] as usize;
    let row = KV_HEADS * d;
    // Every element below is written before it is read: growing fills once, never per call.
    scratch.k.resize(ctx * row, 0.0);
    scratch.v.resize(ctx * row, 0.0);
    scratch.q.resize(d, 0.0);
    scratch.scores.resize(ctx, 0.0);
    let (k, v) = (&mut scratch.k[..ctx * row], &mut scratch.v[..ctx * row]);
    let (q, scores) = (&mut scratch.q[..d], &mut scratch.scores[..ctx]);
    for p in 0..ctx {
        let b = s.tables[seq * s.mbps + p / BLOCK] as usize;
        let ko = cfg.offset(b, 0, KvPart::Key, p % BLOCK, 0);
        let vo = cfg.offset(b, 0, KvPart::Value, p % BLOCK, 0);
        T::widen_slice(&data[ko..ko + row], &mut k[p * row..(p + 1) * row]);
        T::widen_slice(&data[vo..vo + row], &mut v[p * row..(p + 1) * row]);
    }
    for h in 0..nh {
        let kvh = h / GQA;
        T::widen_slice(&s.query[(seq * nh + h) * d..(seq * nh + h + 1) * d], q);
        for (p, sc) in scores.iter_mut().enumerate() {
            *sc = params.scale * dot(q, &k[p * row + kvh * d..p * row + (kvh + 1) * d]);
        }
        let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut z = 0.0;
        for sc in scores.iter_mut() {
            *sc = (*sc - m).exp();
            z += *sc;
        }
        let o = &mut out[h * d..(h + 1) * d];
        o.fill(0.0);
        for (p, &w) in scores.iter().enumerate() {
            let vr = &v[p * row + kvh * d..p * row + (kvh + 1) * d];
            for (a, &x) in o.iter_mut().zip(vr) {
                *a = (w / z).mul_add(x, *a);
            }
        }
    }
}

fn bench_dtype<T: KvElem>(c: &mut Criterion) {
    for (batch, ctx) in GRID {
        let s = setup::<T>(batch, ctx, 1);
        let params = AttnParams::new(KV_HEADS * GQA, HEAD_DIM);
        let seqs = PagedSeqs {
            block_tables: &s.tables,
            max_blocks_per_seq: s.mbps,
            context_lens: &s.ctx,
        };
        let view = s.cache.view::<T>().unwrap();
        let kv = view.layer(0).unwrap();
        let mut ws = AttnWorkspace::new();
        let mut out = vec![T::default(); s.query.len()];
        let mut base = vec![0f32; s.query.len()];

        // Correctness inside the bench.
        paged_attention_decode(&mut ws, kv, &s.query, &seqs, &params, &mut out).unwrap();
        gather_then_attend(&s, &params, &mut base);
        assert_close(&out, &base);
        let src = &s.cache.as_bytes()[..s.kv_bytes];
        let mut dst = vec![0u8; s.kv_bytes];
        dst.copy_from_slice(src);
        assert_eq!(&dst[..], src);

        let mut g = c.benchmark_group(format!("decode_{}", T::DTYPE));
        g.throughput(Throughput::Bytes(s.kv_bytes as u64));
        let label = format!("b{batch}_ctx{ctx}");
        g.bench_function(BenchmarkId::new("pagedkv", &label), |bch| {
            bch.iter(|| {
                paged_attention_decode(&mut ws, kv, black_box(&s.query), &seqs, &params, &mut out)
                    .unwrap()
            })
        });
        g.bench_function(BenchmarkId::new("memcpy", &label), |bch| {
            bch.iter(|| dst.copy_from_slice(black_box(src)))
        });
        g.bench_function(BenchmarkId::new("gather_then_attend", &label), |bch| {
            bch.iter(|| gather_then_attend(&s, &params, black_box(&mut base)))
        });
        g.finish();
    }
}

fn benches(c: &mut Criterion) {
    bench_dtype::<f32>(c);
    bench_dtype::<f16>(c);
    bench_dtype::<bf16>(c);
}

criterion_group!(attention_cpu, benches);
criterion_main!(attention_cpu);
