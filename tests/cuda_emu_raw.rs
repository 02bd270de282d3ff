//! The raw kernel API (`pagedkv::cuda_raw`: raw pointers, shapes and strides, the caller's
//! stream) on the CPU emulation of the kernels (feature `cuda-emu`), against the CPU oracle:
//!
//! - a decode plan fixed for a batch capacity, launched again and again over metadata
//!   rewritten in place (other context lengths, other block tables, fewer live sequences padded
//!   with context 0), as a replayed CUDA graph would: the grid never changes, every live row
//!   matches the oracle and the eager launch (a plan per launch), every padding row is zero,
//!   and stale split-K partials of earlier steps never leak into later ones;
//! - query, output, key and value views inside a fused QKV projection (strided rows) give the
//!   same bits as dense tensors;
//! - the split policy of `DecodePlan` (SM count, batch, context capacity);
//! - every host check refuses bad input with its typed error before anything launches.
#![cfg(all(feature = "cuda-emu", not(feature = "cuda")))]

#[path = "support/emu_bufs.rs"]
mod emu_bufs;
#[path = "support/kernel_grid.rs"]
mod kernel_grid;

use emu_bufs::*;
use half::{bf16, f16};
use kernel_grid::*;
use pagedkv::cuda_emu::{self, EmuBuf, EmuElem};
use pagedkv::cuda_raw::{
    self, AttnParamsRaw, CacheView, DecodeMode, DecodePlan, PrefillTiling, RawError, Rows,
    SeqTables, Workspace,
};
use pagedkv::error::{AttnError, KvError};
use pagedkv::kv::{AttnParams, KvCacheConfig, KvDtype};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

trait Elem: Tol + EmuElem {}
impl<T: Tol + EmuElem> Elem for T {}

fn ptr(b: &EmuBuf) -> u64 {
    b.ptr() as u64
}

fn null_stream() -> cuda_raw::CuStream {
    std::ptr::null_mut()
}

/// The emulated launches' ALiBi slopes and parameters of an `AttnParams`.
fn raw_params(p: &AttnParams<'_>, slopes: Option<&EmuBuf>) -> AttnParamsRaw {
    AttnParamsRaw {
        num_heads: p.num_heads,
        scale: p.scale,
        softcap: p.softcap,
        sliding_window: p.sliding_window,
        alibi_slopes: slopes.map_or(0, ptr),
        prefill_tiling: PrefillTiling::Auto,
        programmatic_launch: false,
    }
}

/// A batch's tables laid out in rows of `mbps` entries (the live entries of `b`, garbage
/// after), for a capacity wider than the batch's own rows.
fn widen(b: &Batch, mbps: usize) -> Vec<i32> {
    let mut t = vec![-9i32; b.ctx.len() * mbps];
    for s in 0..b.ctx.len() {
        t[s * mbps..s * mbps + b.mbps].copy_from_slice(&b.tables[s * b.mbps..(s + 1) * b.mbps]);
    }
    t
}

/// One step's live batch over a shared cache: contexts `ctx`, tables scattered over a shuffled
/// pool of the cache's blocks (each step its own blocks and order).
fn step_batch(rng: &mut SmallRng, cfg: KvCacheConfig, ctx: &[usize]) -> Batch {
    let bs = cfg.block_size();
    let mbps = ctx.iter().map(|c| c.div_ceil(bs)).max().unwrap_or(1).max(1);
    let mut ids: Vec<i32> = (0..cfg.num_blocks() as i32).collect();
    ids.shuffle(rng);
    let mut next = 0;
    let mut tables = vec![0i32; ctx.len() * mbps];
    for (s, &c) in ctx.iter().enumerate() {
        for j in 0..mbps {
            tables[s * mbps + j] = if j < c.div_ceil(bs) {
                next += 1;
                ids[next - 1]
            } else {
                [-7, i32::MAX, 1 << 30][j % 3]
            };
        }
    }
    Batch {
        cfg,
        tables,
        mbps,
        ctx: ctx.iter().map(|&c| c as i32).collect(),
    }
}

/// The eager decode of a live batch: a plan of `mode` made for exactly this batch (on the
/// emulated 132 SMs), fresh buffers.
fn eager_decode<T: Elem>(
    cache: &CacheView,
    layer: usize,
    b: &Batch,
    query: &[T],
    params: &AttnParamsRaw,
    mode: DecodeMode,
) -> Vec<T> {
    let cfg = cache.config;
    let (nh, d) = (params.num_heads, cfg.head_dim());
    let n = b.ctx.len();
    let max_ctx = b.ctx.iter().copied().max().unwrap_or(0).max(1) as usize;
    let plan =
        DecodePlan::new(mode, n, nh, cfg.num_kv_heads(), d, max_ctx, 132).expect("eager plan");
    let (q, out) = (buf(query), poisoned::<T>(n * nh * d));
    let (tables, ctx) = (buf(&b.tables), buf(&b.ctx));
    let ws = decode_workspace(plan.workspace_bytes(), plan.counter_bytes());
    let seqs = SeqTables {
        block_tables: ptr(&tables),
        max_blocks_per_seq: b.mbps,
        context_lens: ptr(&ctx),
        num_seqs: n,
    };
    // SAFETY: every pointer is a live guarded buffer of the documented shape (query/out n dense
    // rows, tables n x mbps, ctx n, workspace the plan's bytes); emulated launches complete
    // before returning.
    unsafe {
        cuda_raw::paged_attention_decode(
            cache,
            layer,
            Rows::dense(ptr(&q), nh, d),
            Rows::dense(ptr(&out), nh, d),
            &seqs,
            params,
            &plan,
            Workspace {
                ptr: ptr(&ws),
                bytes: ws.len(),
            },
            null_stream(),
        )
    }
    .expect("eager decode");
    out.as_slice::<T>().to_vec()
}

/// The steps a fixed plan of capacity `cap_seqs` x `cap_ctx` tokens replays over: full and
/// partial batches, contexts from 1 to the capacity, block boundaries, empty sequences.
fn steps(cap_seqs: usize, cap_ctx: usize, bs: usize) -> Vec<Vec<usize>> {
    assert!(cap_seqs >= 5);
    vec![
        vec![1, bs, cap_ctx, 3 * bs + 1, 33],
        vec![cap_ctx - 1, 2],
        (0..cap_seqs).map(|i| 1 + (i * 97) % cap_ctx).collect(),
        vec![bs - 1],
        vec![0, cap_ctx / 2, 0, bs + 1],
    ]
}

/// A decode plan fixed for `cap_seqs` sequences of up to `mbps` blocks, launched over
/// persistent metadata, query, output and workspace buffers rewritten in place per step.
#[allow(clippy::too_many_arguments)]
fn check_fixed_plan<T: Elem>(
    rng: &mut SmallRng,
    d: usize,
    group: usize,
    bs: usize,
    mbps: usize,
    f: Features,
    mode: DecodeMode,
    sms: usize,
) {
    let (layers, layer, hkv, cap_seqs) = (2, 1, 2, 6);
    let cap_ctx = mbps * bs;
    let nh = hkv * group;
    // Enough blocks for a full step of full contexts.
    let cfg = KvCacheConfig::new(layers, hkv, d, bs, cap_seqs * mbps + 5, T::DTYPE).expect("cfg");
    let cfg = with_page(cfg, Page::Pad(1));
    let host = random_cache::<T>(rng, cfg);
    let dev_cache = buf(host.as_bytes());
    let cache = CacheView {
        base: ptr(&dev_cache),
        config: cfg,
    };
    let sl = slopes(rng, nh);
    let slopes_buf = buf(&sl);
    let params = attn_params(nh, d, f, &sl);
    let raw = raw_params(&params, f.alibi.then_some(&slopes_buf));

    let plan = DecodePlan::new(mode, cap_seqs, nh, hkv, d, cap_ctx, sms).expect("plan");
    // The persistent buffers a captured step would hold: metadata, query, output, workspace.
    let mut tables = poisoned::<i32>(cap_seqs * mbps);
    let mut ctx = poisoned::<i32>(cap_seqs);
    let mut query = poisoned::<T>(cap_seqs * nh * d);
    let mut out = poisoned::<T>(cap_seqs * nh * d);
    // Prepared once, never again: a partial left by an earlier step must never be read, and
    // every step must leave the split merge's counters zero for the next.
    let ws = decode_workspace(plan.workspace_bytes(), plan.counter_bytes());
    let seqs = SeqTables {
        block_tables: ptr(&tables),
        max_blocks_per_seq: mbps,
        context_lens: ptr(&ctx),
        num_seqs: cap_seqs,
    };
    let mut grid: Option<(u64, u64)> = None;
    for (step, live_ctx) in steps(cap_seqs, cap_ctx, bs).into_iter().enumerate() {
        let what = format!(
            "{} d{d} g{group} bs{bs} {mode:?} ({} splits) step {step} ctx {live_ctx:?}",
            T::DTYPE,
            plan.num_splits()
        );
        let b = step_batch(rng, cfg, &live_ctx);
        let n = live_ctx.len();
        // Rewrite the metadata in place: live rows, then padding (context 0, garbage tables).
        let t = tables.as_mut_slice::<i32>();
        t.fill(i32::MIN);
        t[..n * mbps].copy_from_slice(&widen(&b, mbps));
        let c = ctx.as_mut_slice::<i32>();
        c.fill(0);
        c[..n].copy_from_slice(&b.ctx);
        let q_all = random_vec::<T>(rng, cap_seqs * nh * d);
        query.as_mut_slice::<T>().copy_from_slice(&q_all);
        out.as_mut_slice::<u8>().fill(0xff);

        let _ = cuda_emu::take_stats();
        // Every other step a programmatic dependent launch, as a captured step would make it
        // after its cache write: the same results (the kernels wait for their predecessor).
        let raw = AttnParamsRaw {
            programmatic_launch: step % 2 == 1,
            ..raw
        };
        // SAFETY: every pointer is a live guarded buffer of the documented shape (query/out
        // cap_seqs dense rows, tables cap_seqs x mbps, ctx cap_seqs, the plan's workspace, the
        // slopes nh f32); emulated launches complete before returning.
        unsafe {
            cuda_raw::paged_attention_decode(
                &cache,
                layer,
                Rows::dense(ptr(&query), nh, d),
                Rows::dense(ptr(&out), nh, d),
                &seqs,
                &raw,
                &plan,
                Workspace {
                    ptr: ptr(&ws),
                    bytes: ws.len(),
                },
                null_stream(),
            )
        }
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        let st = cuda_emu::take_stats();
        assert!(
            ws.as_slice::<u8>()[..plan.counter_bytes()]
                .iter()
                .all(|&c| c == 0),
            "{what}: the launch left a split merge counter non-zero"
        );
        match grid {
            None => grid = Some((st.launches, st.blocks)),
            Some(g) => assert_eq!(
                g,
                (st.launches, st.blocks),
                "{what}: the grid changed between steps"
            ),
        }

        let got = out.as_slice::<T>().to_vec();
        let row = nh * d;
        let live_q = &q_all[..n * row];
        let want = cpu_decode(&b, &host, layer, live_q, &params);
        assert_close(&format!("{what} vs oracle"), &got[..n * row], &want, d);
        let eager = eager_decode(&cache, layer, &b, live_q, &raw, DecodeMode::Auto);
        assert_close(&format!("{what} vs eager"), &got[..n * row], &eager, d);
        for (i, x) in got[n * row..].iter().enumerate() {
            assert!(
                x.to_f32() == 0.0,
                "{what}: padding element {} is {}",
                n * row + i,
                x.to_f32()
            );
        }
    }
}

#[test]
fn fixed_plan_replays_over_changed_metadata() {
    let mut rng = SmallRng::seed_from_u64(31);
    let alibi_window = Features {
        alibi: true,
        window: 40,
        softcap: 0.0,
    };
    let capped = Features {
        alibi: false,
        window: 0,
        softcap: 20.0,
    };
    // Auto on an H100-sized device: 6 seqs x 2 KV heads leave the SMs idle, so the plan
    // splits; contexts far below capacity leave most partitions empty.
    check_fixed_plan::<bf16>(
        &mut rng,
        128,
        4,
        16,
        40,
        Features::PLAIN,
        DecodeMode::Auto,
        132,
    );
    check_fixed_plan::<f16>(&mut rng, 64, 1, 8, 30, alibi_window, DecodeMode::Auto, 132);
    check_fixed_plan::<f32>(&mut rng, 256, 8, 32, 12, capped, DecodeMode::Auto, 132);
    // Auto on a 4-SM device: the batch fills it, one split (no split merge).
    check_fixed_plan::<bf16>(&mut rng, 96, 6, 16, 20, alibi_window, DecodeMode::Auto, 4);
    // Forced modes: split-K with the split merge, and a single pass.
    check_fixed_plan::<f16>(&mut rng, 112, 3, 64, 20, capped, DecodeMode::SplitK, 132);
    check_fixed_plan::<bf16>(&mut rng, 128, 8, 16, 12, capped, DecodeMode::Splits(5), 132);
    check_fixed_plan::<bf16>(
        &mut rng,
        80,
        2,
        16,
        8,
        alibi_window,
        DecodeMode::SinglePass,
        132,
    );
}

/// Rows inside a fused QKV projection (`[q heads | k heads | v heads]` per token) and an
/// output with padded rows give the same bits as dense tensors, for decode, prefill and the
/// cache write.
fn check_fused<T: Elem>(rng: &mut SmallRng, d: usize, group: usize, bs: usize) {
    let (layers, layer, hkv) = (2, 1, 2);
    let nh = hkv * group;
    let ctx = [37usize, 1, 3 * bs + 5];
    let b = make_batch(rng, layers, hkv, d, bs, T::DTYPE, Page::Pad(2), &ctx);
    let host = random_cache::<T>(rng, b.cfg);
    let cfg = b.cfg;
    let sl = slopes(rng, nh);
    let slopes_buf = buf(&sl);
    let params = attn_params(nh, d, features(3, bs), &sl);
    let raw = raw_params(&params, Some(&slopes_buf));
    let (tables, ctxb) = (buf(&b.tables), buf(&b.ctx));
    let seqs = SeqTables {
        block_tables: ptr(&tables),
        max_blocks_per_seq: b.mbps,
        context_lens: ptr(&ctxb),
        num_seqs: ctx.len(),
    };
    let (row, kv_row) = (nh * d, hkv * d);
    let parts = [nh, hkv, hkv];
    let fused_row = (nh + 2 * hkv) * d;
    let es = std::mem::size_of::<T>();
    // An output row padded by 16 bytes' worth of elements.
    let out_stride = row + 16 / es;

    // Prefill tokens: 2 + 1 + 4 query tokens.
    let qsl = [0i32, 2, 3, 7];
    let tokens = 7;
    let fused = random_vec::<T>(rng, tokens * fused_row);
    let fbuf = buf(&fused);
    let part = |p: usize| Rows::fused(ptr(&fbuf), &parts, p, d, es).expect("fused view");
    let q_dense: Vec<T> = (0..tokens)
        .flat_map(|t| fused[t * fused_row..t * fused_row + row].to_vec())
        .collect();
    let qd = buf(&q_dense);
    let unpad = |o: &EmuBuf, rows: usize| -> Vec<T> {
        let v = o.as_slice::<T>();
        (0..rows)
            .flat_map(|t| v[t * out_stride..t * out_stride + row].to_vec())
            .collect()
    };

    // Decode: the first 3 tokens' q as the 3 sequences' queries.
    let plan = DecodePlan::new(DecodeMode::SplitK, 3, nh, hkv, d, b.mbps * bs, 132).expect("plan");
    let ws = decode_workspace(plan.workspace_bytes(), plan.counter_bytes());
    let wsr = Workspace {
        ptr: ptr(&ws),
        bytes: ws.len(),
    };
    let cache_buf = buf(host.as_bytes());
    let cache = CacheView {
        base: ptr(&cache_buf),
        config: cfg,
    };
    let (od, os) = (poisoned::<T>(3 * row), poisoned::<T>(3 * out_stride));
    // SAFETY: live guarded buffers of the documented shapes (3 query rows in the fused buffer
    // and the dense one, 3 output rows at each stride, the batch's tables and contexts, the
    // plan's workspace); emulated launches complete before returning.
    unsafe {
        for (q, o) in [
            (Rows::dense(ptr(&qd), nh, d), Rows::dense(ptr(&od), nh, d)),
            (
                part(0),
                Rows {
                    ptr: ptr(&os),
                    token_stride: out_stride,
                },
            ),
        ] {
            cuda_raw::paged_attention_decode(
                &cache,
                layer,
                q,
                o,
                &seqs,
                &raw,
                &plan,
                wsr,
                null_stream(),
            )
            .expect("decode");
        }
    }
    let bits = |v: Vec<T>| -> Vec<u8> {
        let b = buf(&v);
        b.as_slice::<u8>().to_vec()
    };
    let dense = od.as_slice::<T>().to_vec();
    assert!(
        bits(dense.clone()) == bits(unpad(&os, 3)),
        "{} d{d} g{group}: fused decode differs from dense",
        T::DTYPE
    );
    let want = cpu_decode(&b, &host, layer, &q_dense[..3 * row], &params);
    assert_close("dense decode", &dense, &want, d);

    // Prefill over the same cache: sequence s has qsl[s+1] - qsl[s] query tokens.
    let pb = Batch {
        cfg,
        tables: b.tables.clone(),
        mbps: b.mbps,
        ctx: b.ctx.clone(),
    };
    let qslb = buf(&qsl);
    let (pd, ps) = (
        poisoned::<T>(tokens * row),
        poisoned::<T>(tokens * out_stride),
    );
    // SAFETY: as above, with `tokens` rows and query_start_loc [4] non-decreasing from 0, each
    // q_len <= 4 and <= its context.
    unsafe {
        for (q, o) in [
            (Rows::dense(ptr(&qd), nh, d), Rows::dense(ptr(&pd), nh, d)),
            (
                part(0),
                Rows {
                    ptr: ptr(&ps),
                    token_stride: out_stride,
                },
            ),
        ] {
            cuda_raw::paged_attention_prefill(
                &cache,
                layer,
                q,
                o,
                &seqs,
                ptr(&qslb),
                4,
                &raw,
                null_stream(),
            )
            .expect("prefill");
        }
    }
    let dense = pd.as_slice::<T>().to_vec();
    assert!(
        bits(dense.clone()) == bits(unpad(&ps, tokens)),
        "{} d{d} g{group}: fused prefill differs from dense",
        T::DTYPE
    );
    let want = cpu_prefill(&pb, &host, layer, &q_dense, &qsl, &params);
    assert_close("dense prefill", &dense, &want, d);

    // The cache write from the fused k and v parts equals the write from dense copies.
    let slots: Vec<i64> = {
        let mut all: Vec<i64> = (0..(cfg.num_blocks() * bs) as i64).collect();
        all.shuffle(rng);
        let mut s = all[..tokens].to_vec();
        s[3] = -1;
        s
    };
    let dense_of = |p: usize| -> Vec<T> {
        let off = parts[..p].iter().sum::<usize>() * d;
        (0..tokens)
            .flat_map(|t| fused[t * fused_row + off..t * fused_row + off + kv_row].to_vec())
            .collect()
    };
    let (kd, vd, sb) = (buf(&dense_of(1)), buf(&dense_of(2)), buf(&slots));
    let (c1, c2) = (buf(host.as_bytes()), buf(host.as_bytes()));
    // SAFETY: `tokens` key/value rows in each view, `tokens` i64 slots, whole caches.
    unsafe {
        for (c, k, v) in [
            (
                &c1,
                Rows::dense(ptr(&kd), hkv, d),
                Rows::dense(ptr(&vd), hkv, d),
            ),
            (&c2, part(1), part(2)),
        ] {
            let view = CacheView {
                base: ptr(c),
                config: cfg,
            };
            cuda_raw::reshape_and_cache(&view, layer, k, v, ptr(&sb), tokens, null_stream())
                .expect("reshape");
        }
    }
    assert!(
        c1.as_slice::<u8>() == c2.as_slice::<u8>(),
        "{} d{d}: fused cache write differs from dense",
        T::DTYPE
    );
    assert!(
        c1.as_slice::<u8>() != host.as_bytes(),
        "the cache write changed nothing"
    );
}

#[test]
fn fused_qkv_views_match_dense() {
    let mut rng = SmallRng::seed_from_u64(32);
    check_fused::<bf16>(&mut rng, 128, 4, 16);
    check_fused::<f16>(&mut rng, 80, 1, 8);
    check_fused::<f32>(&mut rng, 64, 8, 32);
    check_fused::<bf16>(&mut rng, 256, 3, 16);
    // Head counts whose sum overflows: no view (the sum wrapped to a zero stride before).
    assert!(Rows::fused(0, &[usize::MAX, 1], 0, 64, 2).is_none());
    assert!(Rows::fused(0, &[usize::MAX, 1], 1, 64, 2).is_none());
    // A dense view whose stride overflows saturates (it wrapped to 0, and panicked in a debug
    // build), so the launch's stride check refuses it.
    assert_eq!(Rows::dense(16, 1 << 33, 1 << 31).token_stride, usize::MAX);
}

/// The split policy: one split when the batch fills the device, enough splits to fill it
/// otherwise (bounded by the minimum partition), workspaces sized for the splits; the forced
/// modes.
#[test]
fn decode_plan_policy() {
    let plan = |mode, seqs, nh, nkv, d, cap, sms| DecodePlan::new(mode, seqs, nh, nkv, d, cap, sms);
    let auto = |seqs, nh, nkv, cap, sms| {
        plan(DecodeMode::Auto, seqs, nh, nkv, 128, cap, sms).expect("auto plan")
    };
    // 64 seqs x 8 KV heads = 512 blocks >= 2 per SM of 132, but 1.3 waves of the 396 that
    // are resident (3 per SM at d128): the wave rule takes 3 splits (3.9 waves).
    assert_eq!(auto(64, 32, 8, 2048, 132).num_splits(), 3);
    assert_eq!(auto(64, 32, 8, 4096, 132).num_splits(), 3);
    // 48 seqs: 384 blocks, one wave: no split, no workspace.
    assert_eq!(auto(48, 32, 8, 4096, 132).num_splits(), 1);
    assert_eq!(auto(48, 32, 8, 4096, 132).workspace_bytes(), 0);
    // 32 seqs: 256 blocks, 2 splits to reach 2 per SM would be 1.3 waves: 3 (1.9 waves).
    assert_eq!(auto(32, 32, 8, 4096, 132).num_splits(), 3);
    // MHA aims at 4 blocks per SM (528): 8 seqs x 32 heads = 256 -> 3 splits, one wave of the
    // 924 resident (7 per SM); 64 seqs are 2048 blocks unsplit, 2.2 waves: 2 splits (4.4).
    assert_eq!(auto(8, 32, 32, 4096, 132).num_splits(), 3);
    assert_eq!(auto(64, 32, 32, 4096, 132).num_splits(), 2);
    // 128 seqs: 4096 blocks, 4.4 waves; no split count up to 4 saves 10%.
    assert_eq!(auto(128, 32, 32, 4096, 132).num_splits(), 1);
    // Batch 1, 8 KV heads: 264 / 8 = 33 splits (partitions of 128 tokens at 4096).
    assert_eq!(auto(1, 32, 8, 4096, 132).num_splits(), 33);
    // ... but no partition below 32 tokens: 512 / 32 = 16.
    assert_eq!(auto(1, 32, 8, 512, 132).num_splits(), 16);
    // Long partitions fill all 396 resident slots in one wave: floor(396 / ctas) splits while
    // they keep 256 tokens (at 4096, 49 splits would be 84: the 33 above stay).
    for (seqs, cap, splits) in [
        (1, 32768, 49),
        (1, 16384, 49),
        (2, 16384, 24),
        (4, 8192, 12),
    ] {
        assert_eq!(
            auto(seqs, 32, 8, cap, 132).num_splits(),
            splits,
            "{seqs} x {cap}"
        );
    }
    assert_eq!(auto(8, 32, 8, 4096, 132).num_splits(), 6);
    // 8 x 1024: 6 splits would be partitions of 170 tokens: the 5 that reach 2 per SM.
    assert_eq!(auto(8, 32, 8, 1024, 132).num_splits(), 5);
    // MHA's partitions keep 64 tokens: 1 x 512 is 8 splits (not the 16 of 32 tokens).
    assert_eq!(auto(1, 32, 32, 512, 132).num_splits(), 8);
    // MHA keeps its 4 per SM: 1 x 32768 is 32 blocks, 17 splits (not 924 / 32 = 28).
    assert_eq!(auto(1, 32, 32, 32768, 132).num_splits(), 17);
    // 32:2 (group 16): one 16-head tensor-core block per KV head, 264 / 2 = 132 splits.
    assert_eq!(auto(1, 32, 2, 8192, 132).num_splits(), 132);
    // f32 caches run CUDA-core bodies (d128): groups up to 4 the 4-head one, 4 blocks per SM
    // (127 registers), so 32:8 at 1 x 32768 fills 528 slots with 66 splits (bf16: 49); the
    // 8-head one fits 3 (166 registers): 64:8 fills 396 with 49, and 32:2 (two 8-head blocks
    // per KV head, not one 16-head tensor-core block) 396 / 4 = 99 (bf16's rule: 132 splits
    // of 4 blocks, two waves).
    let auto_f32 = |seqs, nh, nkv, cap| {
        DecodePlan::for_dtype(DecodeMode::Auto, KvDtype::F32, seqs, nh, nkv, 128, cap, 132)
            .expect("f32 plan")
            .num_splits()
    };
    assert_eq!(auto_f32(1, 32, 8, 32768), 66);
    assert_eq!(auto_f32(1, 64, 8, 32768), 49);
    assert_eq!(auto_f32(1, 32, 2, 32768), 99);
    // Fixed and forced modes do not depend on the dtype.
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let p = DecodePlan::for_dtype(DecodeMode::Splits(7), dtype, 1, 32, 8, 128, 4096, 132);
        assert_eq!(p.expect("fixed").num_splits(), 7);
    }
    assert_eq!(auto(1, 32, 8, 20, 132).num_splits(), 1);
    // One sequence of MHA stays within one wave: more SMs never mean fewer splits (with the
    // wave rule that holds only there); a larger batch never more.
    let mut last = 0;
    for sms in [1, 8, 32, 108, 132, 264] {
        let s = auto(1, 32, 32, 32768, sms).num_splits();
        assert!(s >= last, "{sms} SMs: {s} splits after {last}");
        last = s;
    }
    let mut last = usize::MAX;
    for seqs in [1, 2, 5, 16, 33, 100] {
        let s = auto(seqs, 32, 32, 32768, 132).num_splits();
        assert!(s <= last, "{seqs} seqs: {s} splits after {last}");
        last = s;
    }
    // A batch that fills the device alone for many waves is one split whatever its context
    // capacity (no kernel body limits a partition's length): 4096 blocks are 10.3 waves, and
    // no split count up to 4 saves 10% of them.
    let big = auto(512, 64, 8, 20000, 132);
    assert_eq!((big.num_splits(), big.workspace_bytes()), (1, 0));
    // Forced modes.
    let split = plan(DecodeMode::SplitK, 8, 32, 8, 128, 100, 132).expect("split");
    assert_eq!(split.num_splits(), 2);
    let split = plan(DecodeMode::SplitK, 8, 32, 8, 128, 5000, 132).expect("split");
    assert_eq!(split.num_splits(), 10);
    assert!(split.workspace_bytes() >= 8 * 32 * 10 * (128 + 2) * 4);
    for cap in [3070, 3071, 1 << 20] {
        let single = plan(DecodeMode::SinglePass, 8, 32, 8, 128, cap, 132).expect("single");
        assert_eq!((single.num_splits(), single.workspace_bytes()), (1, 0));
        assert_eq!(single.mode(), DecodeMode::SinglePass);
    }
    // Exactly the caller's splits, whatever the device; 1 is a single pass.
    for n in [1u32, 3, 7, 4096] {
        let fixed = plan(DecodeMode::Splits(n), 8, 32, 8, 128, 100, 132).expect("fixed");
        assert_eq!(
            (fixed.num_splits(), fixed.mode()),
            (n as usize, DecodeMode::Splits(n))
        );
        assert_eq!(fixed.workspace_bytes() == 0, n == 1);
    }
    // Refusals: zero sizes; heads that do not divide; an unsupported head dim; more than 65535
    // sequences; no splits or too many.
    let invalid = |r: Result<DecodePlan, RawError>, what: &str| match r {
        Err(RawError::Launch { status, .. }) => assert!(
            status == cuda_raw::ffi::PKV_ERR_INVALID_ARG as i32
                || status == cuda_raw::ffi::PKV_ERR_HEAD_DIM as i32,
            "{what}: status {status}"
        ),
        other => panic!("{what}: {other:?}"),
    };
    invalid(plan(DecodeMode::Auto, 0, 32, 8, 128, 100, 132), "no seqs");
    invalid(plan(DecodeMode::Auto, 8, 32, 8, 128, 0, 132), "no context");
    invalid(plan(DecodeMode::Auto, 8, 30, 8, 128, 100, 132), "heads");
    invalid(plan(DecodeMode::Auto, 8, 32, 8, 72, 100, 132), "head dim");
    invalid(plan(DecodeMode::Auto, 65536, 32, 8, 128, 100, 132), "seqs");
    invalid(
        plan(DecodeMode::Splits(0), 8, 32, 8, 128, 100, 132),
        "no splits",
    );
    invalid(
        plan(DecodeMode::Splits(4097), 8, 32, 8, 128, 100, 132),
        "splits",
    );
    // sm_count 0: the (emulated) device's own count, 132 by default.
    assert_eq!(
        plan(DecodeMode::Auto, 1, 32, 8, 128, 4096, 0)
            .expect("device plan")
            .num_splits(),
        33
    );
    // The fixed mode through the C plan calls that take an SM count: refused (its split
    // count is pkv_decode_plan_init_splits' argument); the SM count was taken for it, so 132
    // SMs made 132 splits and a count <= 0 (the header's "ask the device") was refused.
    for dtype in [cuda_raw::ffi::PKV_DTYPE_BF16, cuda_raw::ffi::PKV_DTYPE_F32] {
        let mut raw = cuda_raw::ffi::pkv_decode_plan::default();
        let fixed = cuda_raw::ffi::PKV_DECODE_FIXED as i32;
        // SAFETY: `raw` is a live local the call may write; the rest are integers.
        let status = unsafe {
            cuda_raw::ffi::pkv_decode_plan_init_dtype(
                &mut raw,
                fixed,
                dtype as i32,
                8,
                32,
                8,
                128,
                4096,
                132,
            )
        };
        assert_eq!(
            status,
            cuda_raw::ffi::PKV_ERR_INVALID_ARG as i32,
            "dtype {dtype}"
        );
        assert_eq!(raw.num_splits, 0, "the plan was written");
    }
}

/// Every host check refuses its input with a typed error, and nothing launches.
#[test]
fn raw_launches_refuse_bad_input_before_launch() {
    let mut rng = SmallRng::seed_from_u64(33);
    let (d, hkv, nh, bs) = (64, 2, 4, 16);
    let b = make_batch(&mut rng, 2, hkv, d, bs, KvDtype::F16, Page::Dense, &[20, 3]);
    let host = random_cache::<f16>(&mut rng, b.cfg);
    let cache_buf = buf(host.as_bytes());
    let cache = CacheView {
        base: ptr(&cache_buf),
        config: b.cfg,
    };
    let (tables, ctx) = (buf(&b.tables), buf(&b.ctx));
    let seqs = SeqTables {
        block_tables: ptr(&tables),
        max_blocks_per_seq: b.mbps,
        context_lens: ptr(&ctx),
        num_seqs: 2,
    };
    let row = nh * d;
    let (q, out) = (
        buf(&random_vec::<f16>(&mut rng, 2 * row + 8)),
        poisoned::<f16>(2 * row + 8),
    );
    let plan = DecodePlan::new(DecodeMode::SplitK, 2, nh, hkv, d, 64, 132).expect("plan");
    let ws = poisoned::<u8>(plan.workspace_bytes());
    let good_ws = Workspace {
        ptr: ptr(&ws),
        bytes: ws.len(),
    };
    let params = AttnParamsRaw::new(nh, d);
    let dense = |b: &EmuBuf| Rows::dense(ptr(b), nh, d);
    let decode = |cache: &CacheView,
                  layer: usize,
                  q: Rows,
                  o: Rows,
                  seqs: &SeqTables,
                  p: &AttnParamsRaw,
                  plan: &DecodePlan,
                  ws: Workspace| {
        let _ = cuda_emu::take_stats();
        // SAFETY: every pointer is a live guarded buffer of at least the documented size, or
        // refused by the host checks (the point of this test) before any launch.
        let r = unsafe {
            cuda_raw::paged_attention_decode(cache, layer, q, o, seqs, p, plan, ws, null_stream())
        };
        if r.is_err() {
            assert_eq!(cuda_emu::take_stats().launches, 0, "{r:?}: launched anyway");
        }
        r
    };
    decode(
        &cache,
        0,
        dense(&q),
        dense(&out),
        &seqs,
        &params,
        &plan,
        good_ws,
    )
    .expect("good");
    let err = |r: Result<(), RawError>| r.expect_err("accepted");
    let shift = |r: Rows, bytes: u64| Rows {
        ptr: r.ptr + bytes,
        ..r
    };
    let strided = |r: Rows, s: usize| Rows {
        token_stride: s,
        ..r
    };
    let base = || (dense(&q), dense(&out));
    let (bq, bo) = base();
    for (r, what) in [
        (
            err(decode(&cache, 2, bq, bo, &seqs, &params, &plan, good_ws)),
            "layer",
        ),
        (
            err(decode(
                &cache,
                0,
                shift(bq, 2),
                bo,
                &seqs,
                &params,
                &plan,
                good_ws,
            )),
            "misaligned query",
        ),
        (
            err(decode(
                &cache,
                0,
                bq,
                strided(bo, row - 8),
                &seqs,
                &params,
                &plan,
                good_ws,
            )),
            "short out stride",
        ),
        (
            err(decode(
                &cache,
                0,
                strided(bq, row + 4),
                bo,
                &seqs,
                &params,
                &plan,
                good_ws,
            )),
            "query stride off the grid",
        ),
        (
            err(decode(
                &cache,
                0,
                Rows { ptr: 0, ..bq },
                bo,
                &seqs,
                &params,
                &plan,
                good_ws,
            )),
            "null query",
        ),
        (
            err(decode(
                &cache,
                0,
                bq,
                bo,
                &SeqTables {
                    num_seqs: 3,
                    ..seqs
                },
                &params,
                &plan,
                good_ws,
            )),
            "over capacity",
        ),
        (
            err(decode(
                &cache,
                0,
                bq,
                bo,
                &seqs,
                &AttnParamsRaw::new(2 * nh, d),
                &plan,
                good_ws,
            )),
            "plan heads",
        ),
        (
            err(decode(
                &cache,
                0,
                bq,
                bo,
                &seqs,
                &AttnParamsRaw::new(3, d),
                &plan,
                good_ws,
            )),
            "heads not a multiple",
        ),
        (
            err(decode(
                &cache,
                0,
                bq,
                bo,
                &seqs,
                &AttnParamsRaw {
                    scale: f32::NAN,
                    ..params
                },
                &plan,
                good_ws,
            )),
            "NaN scale",
        ),
        (
            err(decode(
                &cache,
                0,
                bq,
                bo,
                &seqs,
                &params,
                &plan,
                Workspace {
                    bytes: good_ws.bytes - 1,
                    ..good_ws
                },
            )),
            "short workspace",
        ),
        (
            err(decode(
                &CacheView {
                    base: cache.base + 8,
                    ..cache
                },
                0,
                bq,
                bo,
                &seqs,
                &params,
                &plan,
                good_ws,
            )),
            "misaligned cache",
        ),
    ] {
        let ok = match what {
            "layer" => matches!(r, RawError::Kv(KvError::LayerOutOfRange { .. })),
            "misaligned query" | "query stride off the grid" => {
                matches!(
                    r,
                    RawError::Misaligned {
                        what: "query",
                        align: 16
                    }
                )
            }
            "short out stride" => matches!(r, RawError::StrideTooSmall { what: "out", .. }),
            "null query" => matches!(r, RawError::NullPointer { what: "query" }),
            "over capacity" => matches!(
                r,
                RawError::OverCapacity {
                    what: "num_seqs",
                    capacity: 2,
                    found: 3
                }
            ),
            "plan heads" => matches!(
                r,
                RawError::PlanMismatch {
                    what: "num_heads",
                    ..
                }
            ),
            "heads not a multiple" => {
                matches!(r, RawError::Attn(AttnError::HeadsNotMultiple { .. }))
            }
            "NaN scale" => matches!(r, RawError::Attn(AttnError::BadParam { .. })),
            "short workspace" => matches!(r, RawError::WorkspaceTooSmall { .. }),
            "misaligned cache" => matches!(r, RawError::Misaligned { what: "cache", .. }),
            _ => false,
        };
        assert!(ok, "{what}: {r:?}");
        assert!(!r.to_string().is_empty());
    }
    // ALiBi slopes off their f32 alignment, and a prefill with no query heads (no plan there
    // to refuse a head count): typed errors, no launch.
    let slopes = buf(&vec![0f32; 2 * nh]);
    let r = decode(
        &cache,
        0,
        dense(&q),
        dense(&out),
        &seqs,
        &AttnParamsRaw {
            alibi_slopes: ptr(&slopes) + 2,
            ..params
        },
        &plan,
        good_ws,
    );
    assert!(
        matches!(
            r,
            Err(RawError::Misaligned {
                what: "alibi_slopes",
                align: 4
            })
        ),
        "{r:?}"
    );
    let _ = cuda_emu::take_stats();
    // SAFETY: refused by the host checks before any launch (asserted below).
    let r = unsafe {
        cuda_raw::paged_attention_prefill(
            &cache,
            0,
            dense(&q),
            dense(&out),
            &seqs,
            ptr(&ctx),
            4,
            &AttnParamsRaw {
                num_heads: 0,
                ..params
            },
            null_stream(),
        )
    };
    assert!(
        matches!(
            r,
            Err(RawError::Attn(AttnError::HeadsNotMultiple {
                num_heads: 0,
                ..
            }))
        ),
        "{r:?}"
    );
    assert_eq!(cuda_emu::take_stats().launches, 0, "launched with no heads");
    // A geometry without kernels, and the cache write's own checks.
    let cfg72 = KvCacheConfig::new(1, 1, 72, 16, 4, KvDtype::F16).expect("cfg");
    let c72 = CacheView {
        base: ptr(&cache_buf),
        config: cfg72,
    };
    // SAFETY: refused by the host checks before any launch.
    let r = unsafe {
        cuda_raw::reshape_and_cache(&c72, 0, dense(&q), dense(&q), ptr(&ctx), 1, null_stream())
    };
    assert!(
        matches!(
            r,
            Err(RawError::Unsupported {
                what: "head_dim",
                ..
            })
        ),
        "{r:?}"
    );
    let kv = Rows::dense(ptr(&q), hkv, d);
    // SAFETY: refused by the host checks before any launch.
    let r = unsafe {
        cuda_raw::reshape_and_cache(&cache, 0, strided(kv, 10), kv, ptr(&ctx), 1, null_stream())
    };
    assert!(
        matches!(r, Err(RawError::StrideTooSmall { what: "key", .. })),
        "{r:?}"
    );
    // SAFETY: refused by the host checks before any launch.
    let r = unsafe { cuda_raw::reshape_and_cache(&cache, 0, kv, kv, 0, 1, null_stream()) };
    assert!(
        matches!(
            r,
            Err(RawError::NullPointer {
                what: "slot_mapping"
            })
        ),
        "{r:?}"
    );
    // Prefill past the grid's limits: 65536 sequences (grid z), and row tiles past 65535 (grid
    // y: group 2, 64-row tiles, so 2,097,120 query tokens at most).
    let prefill = |seqs: &SeqTables, max_q: usize| {
        let _ = cuda_emu::take_stats();
        // SAFETY: refused by the host checks before any launch (asserted below).
        let r = unsafe {
            cuda_raw::paged_attention_prefill(
                &cache,
                0,
                bq,
                bo,
                seqs,
                ptr(&ctx),
                max_q,
                &params,
                null_stream(),
            )
        };
        assert_eq!(cuda_emu::take_stats().launches, 0, "{r:?}: launched");
        r
    };
    let many = SeqTables {
        num_seqs: 65536,
        ..seqs
    };
    let r = prefill(&many, 4);
    assert!(
        matches!(
            r,
            Err(RawError::OverCapacity {
                capacity: 65535,
                found: 65536,
                ..
            })
        ),
        "{r:?}"
    );
    let r = prefill(&seqs, 2_097_121);
    assert!(
        matches!(
            r,
            Err(RawError::OverCapacity {
                capacity: 2_097_120,
                ..
            })
        ),
        "{r:?}"
    );
}

/// A block id outside the cache masks its tokens (pkv_paged_attention_decode's contract): with
/// blocks 1 and 3 of sequence 0 invalid (-1, and one past the cache), the output is the
/// oracle's over the remaining blocks alone (no ALiBi or window, so positions do not matter),
/// for the tensor-core body (bf16 GQA), the CUDA-core one (bf16 MHA, f32 GQA), and every split
/// mode (masked tokens at partition edges, partitions masked whole).
#[test]
fn invalid_block_ids_mask_their_tokens() {
    fn check<T: Elem>(rng: &mut SmallRng, group: usize, bs: usize) {
        let (hkv, d, layer) = (2, 64, 0);
        let nh = hkv * group;
        let cfg = KvCacheConfig::new(1, hkv, d, bs, 12, T::DTYPE).expect("config");
        let host = random_cache::<T>(rng, cfg);
        let dev_cache = buf(host.as_bytes());
        let cache = CacheView {
            base: ptr(&dev_cache),
            config: cfg,
        };
        let params = attn_params(nh, d, Features::PLAIN, &[]);
        let raw = raw_params(&params, None);
        let query = random_vec::<T>(rng, 2 * nh * d);
        let (with_invalid, valid_only) = decode_with_invalid_ids(cfg);
        let want = cpu_decode(&valid_only, &host, layer, &query, &params);
        for mode in [DecodeMode::SinglePass, DecodeMode::SplitK, DecodeMode::Auto] {
            let got = eager_decode(&cache, layer, &with_invalid, &query, &raw, mode);
            let what = format!("{} group {group} bs {bs} {mode:?}", T::DTYPE);
            assert_close(&what, &got, &want, d);
        }
    }
    let mut rng = SmallRng::seed_from_u64(47);
    for bs in [8, 16, 32] {
        check::<bf16>(&mut rng, 4, bs);
        check::<bf16>(&mut rng, 1, bs);
        check::<f32>(&mut rng, 4, bs);
    }
}

/// A swap whose *host* page is smaller than a block (or off the 16-byte grid) is refused with
/// the layout's error naming that page: it named the device page (here 4096 bytes "smaller
/// than" a 2048-byte block).
#[test]
fn swap_page_errors_name_the_offending_page() {
    let dev = EmuBuf::zeroed(2 * 4096).unwrap();
    let host = vec![0u8; 2 * 4096];
    let pairs = [[0i64, 1]];
    let small = 1024usize;
    for to_host in [true, false] {
        let (dst, dst_page, src, src_page) = if to_host {
            (host.as_ptr() as *mut _, small, dev.ptr() as *const _, 4096)
        } else {
            (dev.ptr() as *mut _, 4096, host.as_ptr() as *const _, small)
        };
        // SAFETY: refused by the page checks before any copy (the point of this test).
        let r = unsafe {
            cuda_raw::swap_blocks(
                dst,
                dst_page,
                src,
                src_page,
                2048,
                &pairs,
                to_host,
                null_stream(),
            )
        };
        assert!(
            matches!(
                r,
                Err(RawError::Kv(KvError::PageTooSmall {
                    page_bytes: 1024,
                    block_bytes: 2048
                }))
            ),
            "host page {small} (to_host {to_host}): {r:?}"
        );
    }
    // SAFETY: as above.
    let r = unsafe {
        cuda_raw::swap_blocks(
            host.as_ptr() as *mut _,
            4104,
            dev.ptr() as *const _,
            4096,
            2048,
            &pairs,
            true,
            null_stream(),
        )
    };
    assert!(
        matches!(
            r,
            Err(RawError::Kv(KvError::PageMisaligned {
                page_bytes: 4104,
                ..
            }))
        ),
        "{r:?}"
    );
}

/// A context length near `i32::MIN` in device memory is an empty sequence to prefill, as to
/// decode (the module docs: device context lengths cannot make a kernel leave the buffers;
/// `<= 0` is empty). Prefill clamped it only from above (`min(ctx, table_tokens)`), so
/// `ctx - 1` and `ctx - q_len` wrapped to ~2^31: the key loop walked the block table row far
/// past its end (a fault, here: the table is a guarded buffer).
#[test]
fn prefill_with_a_context_near_i32_min_reads_nothing() {
    fn check<T: Elem>(rng: &mut SmallRng, ctx: i32, tiling: PrefillTiling) {
        let (hkv, group, d, bs, mbps) = (1, 2, 64, 8, 2);
        let nh = hkv * group;
        let cfg = KvCacheConfig::new(1, hkv, d, bs, 4, T::DTYPE).expect("config");
        let host = random_cache::<T>(rng, cfg);
        let dev_cache = buf(host.as_bytes());
        let cache = CacheView {
            base: ptr(&dev_cache),
            config: cfg,
        };
        let tables = buf(&[0i32, 1]);
        let ctx_lens = buf(&[ctx]);
        let qsl = buf(&[0i32, 1]);
        let query = buf(&random_vec::<T>(rng, nh * d));
        let out = poisoned::<T>(nh * d);
        let seqs = SeqTables {
            block_tables: ptr(&tables),
            max_blocks_per_seq: mbps,
            context_lens: ptr(&ctx_lens),
            num_seqs: 1,
        };
        let mut raw = AttnParamsRaw::new(nh, d);
        raw.prefill_tiling = tiling;
        // SAFETY: every buffer holds what the launch reads and writes (one sequence of one
        // query token, a 2-entry table row, a 4-block cache); the emulated launch is synchronous.
        // The context breaks the prefill contract's `q_len <= context_len` on purpose: the
        // module docs promise that no context length in device memory makes a kernel leave the
        // buffers (the emulation would report it as an illegal address), which is the point.
        let r = unsafe {
            cuda_raw::paged_attention_prefill(
                &cache,
                0,
                Rows::dense(ptr(&query), nh, d),
                Rows::dense(ptr(&out), nh, d),
                &seqs,
                ptr(&qsl),
                1,
                &raw,
                null_stream(),
            )
        };
        let what = format!("{} ctx {ctx} {tiling:?}", T::DTYPE);
        assert!(
            r.is_ok(),
            "{what}: {r:?}; fault: {:?}",
            cuda_emu::last_fault()
        );
        let zero = T::from_f32(0.0);
        assert!(
            out.as_slice::<T>().iter().all(|x| *x == zero),
            "{what}: an empty sequence's rows are zero"
        );
    }
    let mut rng = SmallRng::seed_from_u64(53);
    for ctx in [i32::MIN, i32::MIN + 1] {
        check::<f32>(&mut rng, ctx, PrefillTiling::Auto);
        for tiling in [PrefillTiling::WarpRows16, PrefillTiling::Wgmma] {
            check::<bf16>(&mut rng, ctx, tiling);
        }
    }
}
