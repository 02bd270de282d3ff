//! The CUDA kernels against their CPU twins in `attn::cpu` (the oracle), over the CPU issue's
//! grid: dtypes f32/f16/bf16, head dims 64..256, GQA ratios 1/4/8, block sizes 8/16/32,
//! context lengths 1, block boundary +-1 and long, ALiBi / sliding window / soft-cap on and off,
//! every decode partitioning. Inputs are fresh random values, block tables scattered, unused
//! table entries garbage, outputs poisoned with NaN before every launch.
//!
//! Without a GPU each GPU test prints `SKIP` and passes; with `PAGEDKV_REQUIRE_GPU=1` it fails
//! instead. The `ffi_*` tests exercise the launchers' argument checks and run everywhere.
#![cfg(feature = "cuda")]

use half::{bf16, f16};
use pagedkv::attn::cpu;
use pagedkv::cuda::{
    self, ffi, DecodeMode, DecodeWorkspace, DeviceAttnParams, DeviceKvCache, DeviceSeqs, Gpu,
    PinnedSwapSpace, PrefillTiling, TokenRows, TokenRowsMut,
};
use pagedkv::error::CudaError;
use pagedkv::kv::{AttnParams, PagedSeqs};
use pagedkv::kv::{HostKvCache, KvCacheConfig, KvDtype, SwapSpace};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::io::Write;

// ---- harness -----------------------------------------------------------------------------

#[path = "support/gpu.rs"]
mod gpu_support;
use gpu_support::gpu;

#[path = "support/kernel_grid.rs"]
mod kernel_grid;
use kernel_grid::*;

trait Elem: Tol + cudarc::driver::DeviceRepr {}
impl<T: Tol + cudarc::driver::DeviceRepr> Elem for T {}

// ---- attention ---------------------------------------------------------------------------

#[allow(clippy::too_many_arguments)]
fn check_decode<T: Elem>(
    g: &Gpu,
    rng: &mut SmallRng,
    d: usize,
    group: usize,
    bs: usize,
    page: Page,
    ctx: &[usize],
    f: Features,
    modes: &[DecodeMode],
) {
    let (layers, layer, hkv) = (2, 1, 2);
    let b = make_batch(rng, layers, hkv, d, bs, T::DTYPE, page, ctx);
    let host = random_cache::<T>(rng, b.cfg);
    let nh = hkv * group;
    let query = random_vec::<T>(rng, ctx.len() * nh * d);
    let sl = slopes(rng, nh);
    let params = attn_params(nh, d, f, &sl);
    let seqs = b.seqs();
    let want = cpu_decode(&b, &host, layer, &query, &params);

    let mut dev = DeviceKvCache::new(g, b.cfg).expect("device cache");
    dev.upload_from(g, &host).expect("upload");
    let dseqs = DeviceSeqs::upload(g, &b.cfg, &seqs).expect("seqs");
    let mut dparams = DeviceAttnParams::upload(g, &b.cfg, &params).expect("params");
    let dq = g.upload(&query).expect("q");
    let mut ws = DecodeWorkspace::new();
    // One decode with `dparams` into a fresh NaN-filled output.
    let mut decode = |dparams: &DeviceAttnParams| -> Vec<T> {
        let mut out = g
            .upload(&vec![T::from_f32(f32::NAN); query.len()])
            .expect("out");
        let r = dev.paged_attention_decode(g, layer, &dq, &dseqs, dparams, &mut ws, &mut out);
        r.unwrap_or_else(|e| panic!("decode {:?}: {e}", dparams.mode));
        g.synchronize().expect("sync");
        g.download(&out).expect("download")
    };
    for &mode in modes {
        dparams.mode = mode;
        let got = decode(&dparams);
        let what = format!(
            "decode {} d{d} g{group} bs{bs} {page:?} {f:?} {mode:?} ctx {ctx:?}",
            T::DTYPE
        );
        assert_close(&what, &got, &want, d);
    }
}

#[allow(clippy::too_many_arguments)]
fn check_prefill<T: Elem>(
    g: &Gpu,
    rng: &mut SmallRng,
    d: usize,
    group: usize,
    bs: usize,
    page: Page,
    seqs_q_ctx: &[(usize, usize)],
    f: Features,
) {
    let (layers, layer, hkv) = (2, 0, 2);
    let ctx: Vec<usize> = seqs_q_ctx.iter().map(|&(_, c)| c).collect();
    let b = make_batch(rng, layers, hkv, d, bs, T::DTYPE, page, &ctx);
    let host = random_cache::<T>(rng, b.cfg);
    let nh = hkv * group;
    let qsl = query_start_loc(seqs_q_ctx);
    let tokens = *qsl.last().unwrap_or(&0) as usize;
    let query = random_vec::<T>(rng, tokens * nh * d);
    let sl = slopes(rng, nh);
    let params = attn_params(nh, d, f, &sl);
    let seqs = b.seqs();
    let want = cpu_prefill(&b, &host, layer, &query, &qsl, &params);

    let mut dev = DeviceKvCache::new(g, b.cfg).expect("device cache");
    dev.upload_from(g, &host).expect("upload");
    let dseqs = DeviceSeqs::upload_prefill(g, &b.cfg, &seqs, &qsl).expect("seqs");
    let mut dparams = DeviceAttnParams::upload(g, &b.cfg, &params).expect("params");
    let dq = g.upload(&query).expect("q");
    if query.is_empty() {
        return;
    }
    // f32 has one prefill kernel, whatever the tiling.
    let tilings: &[PrefillTiling] = if T::DTYPE == KvDtype::F32 {
        &[PrefillTiling::Auto]
    } else {
        &PrefillTiling::EXPLICIT
    };
    for &tiling in tilings {
        dparams.prefill_tiling = tiling;
        let mut out = g
            .upload(&vec![T::from_f32(f32::NAN); query.len()])
            .expect("out");
        dev.paged_attention_prefill(g, layer, &dq, &dseqs, &dparams, &mut out)
            .expect("prefill");
        g.synchronize().expect("sync");
        let got = g.download(&out).expect("download");
        let what = format!(
            "prefill {} d{d} g{group} bs{bs} {page:?} {f:?} q/ctx {seqs_q_ctx:?} {tiling:?}",
            T::DTYPE
        );
        assert_close(&what, &got, &want, d);
    }
}

const ALL_MODES: [DecodeMode; 3] = [DecodeMode::Auto, DecodeMode::SinglePass, DecodeMode::SplitK];

fn decode_grid<T: Elem>(seed: u64) {
    let Some(g) = gpu(&format!("decode_grid_{}", T::DTYPE)) else {
        return;
    };
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut variant = 0;
    for d in HEAD_DIMS {
        for group in GROUPS {
            for bs in BLOCK_SIZES {
                let ctx = decode_grid_contexts(bs);
                check_decode::<T>(
                    &g,
                    &mut rng,
                    d,
                    group,
                    bs,
                    PAGES[(variant / 4) % PAGES.len()],
                    &ctx,
                    features(variant, bs),
                    &ALL_MODES,
                );
                variant += 1;
            }
        }
    }
}

#[test]
fn decode_grid_f32() {
    decode_grid::<f32>(1);
}
#[test]
fn decode_grid_f16() {
    decode_grid::<f16>(2);
}
#[test]
fn decode_grid_bf16() {
    decode_grid::<bf16>(3);
}

/// Programmatic dependent launches (`PKV_LAUNCH_PROGRAMMATIC`) queued back to back with no
/// host synchronization: each step rewrites the last token of a sequence (reshape_and_cache,
/// which lets its successor launch early), then decodes twice with the flag (the second
/// decode's predecessor is the first, which shares its split merge's workspace and counters),
/// then runs a programmatic prefill of the last tokens. Every output equals the oracle's over
/// the cache as that step left it: a block that read before its predecessor finished would
/// see the previous step's token (or a half-merged workspace). On devices before compute
/// capability 9.0 the flag is a plain launch and this checks only that it is accepted.
#[test]
fn programmatic_launches_wait_for_their_predecessor() {
    let Some(g) = gpu("programmatic_launches_wait_for_their_predecessor") else {
        return;
    };
    let mut rng = SmallRng::seed_from_u64(21);
    let (layer, hkv, group, d, bs, ctx, steps, chunk) = (0, 2, 4, 128, 16, 1500, 24, 40);
    let nh = hkv * group;
    let b = make_batch(&mut rng, 1, hkv, d, bs, KvDtype::Bf16, Page::Dense, &[ctx]);
    let mut host = random_cache::<bf16>(&mut rng, b.cfg);
    let params = attn_params(nh, d, Features::PLAIN, &[]);
    let seqs = b.seqs();
    let qsl = [0i32, chunk as i32];
    let last = ctx - 1;
    let slot = (b.tables[last / bs] as i64) * bs as i64 + (last % bs) as i64;

    let mut dev = DeviceKvCache::new(&g, b.cfg).expect("device cache");
    dev.upload_from(&g, &host).expect("upload");
    let dseqs = DeviceSeqs::upload(&g, &b.cfg, &seqs).expect("seqs");
    let dseqs_pf = DeviceSeqs::upload_prefill(&g, &b.cfg, &seqs, &qsl).expect("prefill seqs");
    let mut dparams = DeviceAttnParams::upload(&g, &b.cfg, &params).expect("params");
    dparams.programmatic_launch = true;
    dparams.mode = DecodeMode::SplitK;
    let query = random_vec::<bf16>(&mut rng, nh * d);
    let pf_query = random_vec::<bf16>(&mut rng, chunk * nh * d);
    let (dq, dpq) = (
        g.upload(&query).expect("q"),
        g.upload(&pf_query).expect("pq"),
    );
    let dslot = g.upload(&[slot]).expect("slot");
    let mut ws = DecodeWorkspace::new();
    let mut kv = Vec::new();
    let mut dev_kv = Vec::new();
    let mut outs = Vec::new();
    for _ in 0..steps {
        let (k, v) = (
            random_vec::<bf16>(&mut rng, hkv * d),
            random_vec::<bf16>(&mut rng, hkv * d),
        );
        dev_kv.push((g.upload(&k).expect("k"), g.upload(&v).expect("v")));
        kv.push((k, v));
        let nan = |n: usize| g.upload(&vec![bf16::NAN; n]).expect("out");
        outs.push((nan(nh * d), nan(nh * d), nan(chunk * nh * d)));
    }
    // Queued with no synchronization between steps.
    for ((dk, dv), (o1, o2, o3)) in dev_kv.iter().zip(outs.iter_mut()) {
        dev.reshape_and_cache(&g, layer, dk, dv, &dslot)
            .expect("reshape");
        for o in [o1, o2] {
            dev.paged_attention_decode(&g, layer, &dq, &dseqs, &dparams, &mut ws, o)
                .expect("decode");
        }
        dev.paged_attention_prefill(&g, layer, &dpq, &dseqs_pf, &dparams, o3)
            .expect("prefill");
    }
    g.synchronize().expect("sync");
    for (step, ((k, v), (o1, o2, o3))) in kv.iter().zip(&outs).enumerate() {
        let mut view = host.view_mut::<bf16>().expect("view");
        cpu::reshape_and_cache(view.layer_mut(layer).expect("layer"), k, v, &[slot])
            .expect("cpu reshape");
        let want = cpu_decode(&b, &host, layer, &query, &params);
        for (i, o) in [o1, o2].into_iter().enumerate() {
            let got = g.download(o).expect("download");
            assert_close(&format!("step {step} decode {i}"), &got, &want, d);
        }
        let want = cpu_prefill(&b, &host, layer, &pf_query, &qsl, &params);
        let got = g.download(o3).expect("download");
        assert_close(&format!("step {step} prefill"), &got, &want, d);
    }
}

/// Long contexts: split-K over many partitions (boundaries 511/512/513), the in-launch split merge,
/// windows that start mid-partition, and odd GQA ratios (2, 6, 16: padded and chunked head
/// groups).
#[test]
fn decode_long_contexts_and_odd_groups() {
    let Some(g) = gpu("decode_long_contexts_and_odd_groups") else {
        return;
    };
    let mut rng = SmallRng::seed_from_u64(4);
    let ctx = [511, 512, 513, 1537, 5000, 20000, 1];
    for (i, f) in [
        Features::PLAIN,
        Features {
            alibi: true,
            window: 700,
            softcap: 0.0,
        },
        Features {
            alibi: false,
            window: 4100,
            softcap: 30.0,
        },
    ]
    .into_iter()
    .enumerate()
    {
        check_decode::<bf16>(&g, &mut rng, 128, 4, 16, Page::Dense, &ctx, f, &ALL_MODES);
        check_decode::<f32>(&g, &mut rng, 256, 8, 32, Page::Pad(3), &ctx, f, &ALL_MODES);
        check_decode::<f16>(
            &g,
            &mut rng,
            [80, 112, 64][i],
            1,
            8,
            Page::RoundUp(64 << 10),
            &ctx,
            f,
            &ALL_MODES,
        );
    }
    for group in [2, 3, 6, 16] {
        check_decode::<bf16>(
            &g,
            &mut rng,
            128,
            group,
            16,
            Page::Dense,
            &[1, 17, 600, 2000],
            features(group, 16),
            &ALL_MODES,
        );
    }
    // Large batch: the auto mode's single-pass branch for long contexts.
    let many: Vec<usize> = (0..300).map(|i| 700 + (i * 37) % 900).collect();
    check_decode::<bf16>(
        &g,
        &mut rng,
        128,
        4,
        16,
        Page::Dense,
        &many,
        features(0, 16),
        &[DecodeMode::Auto],
    );
}

/// One decode of `b` (layer 0) on the device in each of `modes`, against the CPU oracle.
fn decode_batch<T: Elem>(
    g: &Gpu,
    b: &Batch,
    host: &HostKvCache,
    query: &[T],
    params: &AttnParams,
    modes: &[DecodeMode],
    what: &str,
) {
    let want = cpu_decode(b, host, 0, query, params);
    assert!(
        want.iter().any(|x| x.to_f32() != 0.0),
        "{what}: the oracle attends"
    );
    let mut dev = DeviceKvCache::new(g, b.cfg).expect("device cache");
    dev.upload_from(g, host).expect("upload");
    let dseqs = DeviceSeqs::upload(g, &b.cfg, &b.seqs()).expect("seqs");
    let mut dparams = DeviceAttnParams::upload(g, &b.cfg, params).expect("params");
    let dq = g.upload(query).expect("q");
    let mut ws = DecodeWorkspace::new();
    for &mode in modes {
        dparams.mode = mode;
        let mut out = g
            .upload(&vec![T::from_f32(f32::NAN); query.len()])
            .expect("out");
        dev.paged_attention_decode(g, 0, &dq, &dseqs, &dparams, &mut ws, &mut out)
            .unwrap_or_else(|e| panic!("{what} {mode:?}: {e}"));
        g.synchronize().expect("sync");
        let got = g.download(&out).expect("download");
        assert_close(&format!("{what} {mode:?}"), &got, &want, b.cfg.head_dim());
    }
}

/// A decode batch of empty sequences whose block table rows have no entries (every context 0):
/// the CPU kernels take it and write zero rows; the device wrapper took it on upload and then
/// launched it with rows of width 0, which the launcher refuses (`max_blocks_per_seq` 0).
#[test]
fn decode_of_empty_sequences_with_empty_table_rows_writes_zeros() {
    let Some(g) = gpu("decode_of_empty_sequences_with_empty_table_rows_writes_zeros") else {
        return;
    };
    let (d, nh, n) = (64, 4, 3);
    let cfg = KvCacheConfig::new(1, 2, d, 16, 4, KvDtype::F32).expect("config");
    let seqs = PagedSeqs {
        block_tables: &[],
        max_blocks_per_seq: 0,
        context_lens: &[0; 3],
    };
    let params = AttnParams::new(nh, d);
    let query = vec![1.0f32; n * nh * d];
    let mut want = vec![f32::NAN; query.len()];
    let host = HostKvCache::new(cfg).expect("host cache");
    let view = host.view::<f32>().expect("view");
    cpu::paged_attention_decode(
        &mut pagedkv::attn::AttnWorkspace::new(),
        view.layer(0).expect("layer"),
        &query,
        &seqs,
        &params,
        &mut want,
    )
    .expect("the CPU kernels take the batch");
    assert!(want.iter().all(|&x| x == 0.0));
    let dev = DeviceKvCache::new(&g, cfg).expect("device cache");
    let dseqs = DeviceSeqs::upload(&g, &cfg, &seqs).expect("seqs");
    let dparams = DeviceAttnParams::upload(&g, &cfg, &params).expect("params");
    let dq = g.upload(&query).expect("q");
    let mut out = g.upload(&vec![f32::NAN; query.len()]).expect("out");
    let mut dws = DecodeWorkspace::new();
    dev.paged_attention_decode(&g, 0, &dq, &dseqs, &dparams, &mut dws, &mut out)
        .expect("the device takes what the CPU kernels take");
    assert_eq!(g.download(&out).expect("download"), want);
}

/// A context of 2^31 - 1 tokens under a 64-token window, in a table row of 2^23 + 1
/// 256-token blocks whose last block is the only one read: the decode tiles' last 8-token
/// half starts at 2^31 - 8, and its end computed as `t0 + 8` wrapped negative on the GPU and
/// masked the context's last tokens (found on the emulation under -fwrapv; this is the
/// device's check). The f32 body (a group of 4), the bf16 tensor-core body (4) and the bf16
/// one-head body (1).
#[test]
fn decode_at_context_i32_max() {
    let Some(g) = gpu("decode_at_context_i32_max") else {
        return;
    };
    let mut rng = SmallRng::seed_from_u64(31);
    let (d, bs, hkv) = (64, 256, 1);
    let mbps = (1usize << 23) + 1;
    let last = (i32::MAX as usize - 1) / bs;
    let windowed = |nh| {
        attn_params(
            nh,
            d,
            Features {
                window: 64,
                ..Features::PLAIN
            },
            &[],
        )
    };
    let huge = |rng: &mut SmallRng, dtype| {
        let mut b = make_batch(rng, 1, hkv, d, bs, dtype, Page::Pad(1), &[300]);
        let mut table = vec![0i32; mbps];
        table[last] = b.tables[0];
        b.tables = table;
        b.mbps = mbps;
        b.ctx = vec![i32::MAX];
        b
    };
    let modes = [DecodeMode::SinglePass, DecodeMode::Auto];
    let b = huge(&mut rng, KvDtype::F32);
    let host = random_cache::<f32>(&mut rng, b.cfg);
    let q = random_vec::<f32>(&mut rng, 4 * d);
    decode_batch(&g, &b, &host, &q, &windowed(4), &modes, "f32 group 4");
    let b = huge(&mut rng, KvDtype::Bf16);
    let host = random_cache::<bf16>(&mut rng, b.cfg);
    for group in [4, 1] {
        let q = random_vec::<bf16>(&mut rng, group * d);
        let what = format!("bf16 group {group}");
        decode_batch(&g, &b, &host, &q, &windowed(group), &modes, &what);
    }
}

fn prefill_grid<T: Elem>(seed: u64) {
    let Some(g) = gpu(&format!("prefill_grid_{}", T::DTYPE)) else {
        return;
    };
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut variant = 0;
    for d in HEAD_DIMS {
        for group in GROUPS {
            for bs in BLOCK_SIZES {
                let seqs = prefill_grid_seqs(bs);
                let page = PAGES[(variant / 4) % PAGES.len()];
                check_prefill::<T>(
                    &g,
                    &mut rng,
                    d,
                    group,
                    bs,
                    page,
                    &seqs,
                    features(variant, bs),
                );
                variant += 1;
            }
        }
    }
}

#[test]
fn prefill_grid_f32() {
    prefill_grid::<f32>(5);
}
#[test]
fn prefill_grid_f16() {
    prefill_grid::<f16>(6);
}
#[test]
fn prefill_grid_bf16() {
    prefill_grid::<bf16>(7);
}

#[test]
fn prefill_long_chunks() {
    let Some(g) = gpu("prefill_long_chunks") else {
        return;
    };
    let mut rng = SmallRng::seed_from_u64(8);
    for v in 0..4 {
        let f = features(v, 16);
        check_prefill::<bf16>(
            &g,
            &mut rng,
            128,
            4,
            16,
            Page::Dense,
            &[(100, 1000), (257, 257), (1, 3000)],
            f,
        );
        check_prefill::<f16>(
            &g,
            &mut rng,
            256,
            8,
            32,
            Page::Pad(1),
            &[(64, 64), (33, 500)],
            f,
        );
        check_prefill::<f32>(
            &g,
            &mut rng,
            96,
            6,
            8,
            Page::Dense,
            &[(40, 41), (7, 900)],
            f,
        );
    }
}

/// More 128-row work items than an H100 has SMs (100 sequences of 0-70 query tokens: up to 600
/// items, most of them empty or one key tile), so that the persistent grid's blocks stream
/// several items each on the hardware (its next item's Q and first tile copied during the
/// current one's last): every tiling against the oracle, plain and with the logit features.
/// The GPU scripts run it under racecheck too.
#[test]
fn persistent_prefill_streams_many_items() {
    let Some(g) = gpu("persistent_prefill_streams_many_items") else {
        return;
    };
    let mut rng = SmallRng::seed_from_u64(9);
    let seqs: Vec<(usize, usize)> = (0..100)
        .map(|i| {
            let q = [0, 1, 5, 33, 70, 17][i % 6];
            (q, q + (i * 37) % 200)
        })
        .collect();
    for v in 0..2 {
        let f = features(v, 16);
        check_prefill::<bf16>(&g, &mut rng, 128, 4, 16, Page::Dense, &seqs, f);
        check_prefill::<f16>(&g, &mut rng, 80, 1, 32, Page::Pad(1), &seqs, f);
    }
}

/// Block ids that name no page (-1, one past the cache) mask their tokens on the GPU as on the
/// emulation (tests/cuda_emu_raw.rs, tests/cuda_emu_prefill.rs): through the raw launches,
/// which take tables the safe API would refuse, the outputs equal the oracle's over the valid
/// blocks alone. Decode: the tensor-core body (bf16 GQA), the CUDA-core ones (bf16 MHA, f32
/// GQA), every split mode. Prefill: the invalid blocks lie wholly before the chunk (the case
/// the scale-only interior path must not take), both tilings, every dtype.
#[test]
fn invalid_block_ids_mask_their_keys() {
    let Some(g) = gpu("invalid_block_ids_mask_their_keys") else {
        return;
    };
    let mut rng = SmallRng::seed_from_u64(48);
    for bs in [8, 16, 32] {
        invalid_ids_decode::<bf16>(&g, &mut rng, 4, bs);
        invalid_ids_decode::<bf16>(&g, &mut rng, 1, bs);
        invalid_ids_decode::<f32>(&g, &mut rng, 4, bs);
    }
    for group in [1, 4] {
        invalid_ids_prefill::<bf16>(&g, &mut rng, group);
        invalid_ids_prefill::<f16>(&g, &mut rng, group);
        invalid_ids_prefill::<f32>(&g, &mut rng, group);
    }
}

/// The device address of a buffer (the guard records its use on the stream when dropped).
fn dptr<T>(g: &Gpu, s: &cudarc::driver::CudaSlice<T>) -> u64 {
    use cudarc::driver::DevicePtr;
    s.device_ptr(g.stream()).0
}

fn invalid_ids_decode<T: Elem + cudarc::driver::ValidAsZeroBits>(
    g: &Gpu,
    rng: &mut SmallRng,
    group: usize,
    bs: usize,
) {
    let (hkv, d, layer) = (2, 64, 0);
    let nh = hkv * group;
    let cfg = KvCacheConfig::new(1, hkv, d, bs, 12, T::DTYPE).expect("config");
    let host = random_cache::<T>(rng, cfg);
    let mut dev = DeviceKvCache::new(g, cfg).expect("device cache");
    dev.upload_from(g, &host).expect("upload");
    let params = attn_params(nh, d, Features::PLAIN, &[]);
    let query = random_vec::<T>(rng, 2 * nh * d);
    let (with_invalid, valid_only) = decode_with_invalid_ids(cfg);
    let want = cpu_decode(&valid_only, &host, layer, &query, &params);
    let (dq, dt, dc) = (
        g.upload(&query).expect("q"),
        g.upload(&with_invalid.tables).expect("tables"),
        g.upload(&with_invalid.ctx).expect("ctx"),
    );
    for mode in [DecodeMode::SinglePass, DecodeMode::SplitK, DecodeMode::Auto] {
        let plan = cuda::DecodePlan::new(mode, 2, nh, hkv, d, 4 * bs, 0).expect("plan");
        // Zeroed: the split merge's counters start at zero.
        let ws = g
            .alloc_zeros::<u8>(plan.workspace_bytes().max(16))
            .expect("workspace");
        let out = g
            .upload(&vec![T::from_f32(f32::NAN); query.len()])
            .expect("out");
        let seqs = pagedkv::cuda_raw::SeqTables {
            block_tables: dptr(g, &dt),
            max_blocks_per_seq: 4,
            context_lens: dptr(g, &dc),
            num_seqs: 2,
        };
        let raw = pagedkv::cuda_raw::AttnParamsRaw::new(nh, d);
        // SAFETY: every pointer is a live device buffer of this Gpu of the shape the contract
        // asks (cache: the whole cache; query / out: 2 dense rows of nh * d, distinct; tables
        // [2][4], ctx [2]; a zeroed workspace of the plan's size), and the stream is
        // synchronized before any of them is dropped or read back.
        unsafe {
            pagedkv::cuda_raw::paged_attention_decode(
                &dev.raw_view(),
                layer,
                pagedkv::cuda_raw::Rows::dense(dptr(g, &dq), nh, d),
                pagedkv::cuda_raw::Rows::dense(dptr(g, &out), nh, d),
                &seqs,
                &raw,
                &plan,
                pagedkv::cuda_raw::Workspace {
                    ptr: dptr(g, &ws),
                    bytes: plan.workspace_bytes().max(16),
                },
                g.raw_stream(),
            )
        }
        .expect("decode");
        g.synchronize().expect("sync");
        let got = g.download(&out).expect("download");
        let what = format!("decode {} group {group} bs {bs} {mode:?}", T::DTYPE);
        assert_close(&what, &got, &want, d);
    }
}

fn invalid_ids_prefill<T: Elem>(g: &Gpu, rng: &mut SmallRng, group: usize) {
    let (hkv, d, bs, layer) = (2, 64, 16, 0);
    let nh = hkv * group;
    let cfg = KvCacheConfig::new(1, hkv, d, bs, 12, T::DTYPE).expect("config");
    let host = random_cache::<T>(rng, cfg);
    let mut dev = DeviceKvCache::new(g, cfg).expect("device cache");
    dev.upload_from(g, &host).expect("upload");
    let (with_invalid, valid_only) = prefill_with_invalid_ids(cfg);
    let qsl = [0i32, 20];
    let query = random_vec::<T>(rng, 20 * nh * d);
    let params = attn_params(nh, d, Features::PLAIN, &[]);
    let want = cpu_prefill(&valid_only, &host, layer, &query, &qsl, &params);
    let (dq, dt, dc, dqsl) = (
        g.upload(&query).expect("q"),
        g.upload(&with_invalid.tables).expect("tables"),
        g.upload(&with_invalid.ctx).expect("ctx"),
        g.upload(&qsl).expect("qsl"),
    );
    for tiling in PrefillTiling::EXPLICIT {
        let out = g
            .upload(&vec![T::from_f32(f32::NAN); query.len()])
            .expect("out");
        let seqs = pagedkv::cuda_raw::SeqTables {
            block_tables: dptr(g, &dt),
            max_blocks_per_seq: with_invalid.mbps,
            context_lens: dptr(g, &dc),
            num_seqs: 1,
        };
        let raw = pagedkv::cuda_raw::AttnParamsRaw {
            prefill_tiling: tiling,
            ..pagedkv::cuda_raw::AttnParamsRaw::new(nh, d)
        };
        // SAFETY: as in invalid_ids_decode; query_start_loc holds [0, 20] (20 rows of query
        // and out, q_len 20 <= the context 91).
        unsafe {
            pagedkv::cuda_raw::paged_attention_prefill(
                &dev.raw_view(),
                layer,
                pagedkv::cuda_raw::Rows::dense(dptr(g, &dq), nh, d),
                pagedkv::cuda_raw::Rows::dense(dptr(g, &out), nh, d),
                &seqs,
                dptr(g, &dqsl),
                20,
                &raw,
                g.raw_stream(),
            )
        }
        .expect("prefill");
        g.synchronize().expect("sync");
        let got = g.download(&out).expect("download");
        let what = format!(
            "prefill {} g{group} with invalid block ids, {tiling:?}",
            T::DTYPE
        );
        assert_close(&what, &got, &want, d);
    }
}

/// The wgmma prefill kernel's layouts on the hardware (`pkv_wgmma_layout_probe`): one
/// m64n64k16 per layout of B, with the descriptor's offsets as kernels/wgmma.cuh reads them and
/// exchanged. On a device of compute capability 9.0 the kernel's reading must be exact; the
/// counts say what to change if not ([1] == 0: K-major's offsets are the other way round; [3]
/// == 0: MN-major's; all nonzero: the A or accumulator fragment layout). Other devices have no
/// image for it.
#[test]
fn wgmma_layouts_match_the_hardware() {
    let Some(g) = gpu("wgmma_layouts_match_the_hardware") else {
        return;
    };
    let info = g.info();
    let n = ffi::PKV_WGMMA_PROBE_COUNTS as usize;
    let counts = g.alloc_zeros::<i32>(n).expect("counts");
    // SAFETY: `counts` holds PKV_WGMMA_PROBE_COUNTS i32 on this Gpu's device, alive until the
    // synchronize below.
    let s = unsafe {
        ffi::pkv_wgmma_layout_probe(dptr(&g, &counts) as usize as *mut i32, g.raw_stream())
    };
    if (info.cc_major, info.cc_minor) != (9, 0) {
        assert_ne!(
            s,
            ffi::PKV_OK as i32,
            "sm_90a code ran on cc {}.{}",
            info.cc_major,
            info.cc_minor
        );
        println!(
            "SKIP wgmma_layouts_match_the_hardware: compute capability {}.{}",
            info.cc_major, info.cc_minor
        );
        return;
    }
    assert_eq!(s, ffi::PKV_OK as i32, "probe launch: status {s}");
    g.synchronize().expect("sync");
    let c = g.download(&counts).expect("download");
    println!("wgmma layout probe (wrong elements of 4096): K-major {} / exchanged {}, MN-major {} / exchanged {}", c[0], c[1], c[2], c[3]);
    println!(
        "wgmma swizzled layouts (wrong elements of 4096), K-major / MN-major: 128 B {} / {}, \
         64 B {} / {}, 32 B {} / {}",
        c[4], c[5], c[6], c[7], c[8], c[9]
    );
    assert_eq!(
        (c[0], c[2]),
        (0, 0),
        "wgmma.cuh's descriptor reading is wrong: {c:?}"
    );
    assert_eq!(
        &c[4..],
        &[0; 6],
        "wgmma.cuh's swizzled layouts are wrong: {c:?}"
    );
}

// ---- cache writes and block moves ----------------------------------------------------------

fn check_reshape<T: Elem>(g: &Gpu, rng: &mut SmallRng, d: usize, bs: usize, page: Page) {
    let (layers, hkv, num_blocks) = (3, 2, 7);
    let cfg = KvCacheConfig::new(layers, hkv, d, bs, num_blocks, T::DTYPE).expect("config");
    let cfg = with_page(cfg, page);
    let mut host = random_cache::<T>(rng, cfg);
    let mut dev = DeviceKvCache::new(g, cfg).expect("dev");
    dev.upload_from(g, &host).expect("upload");
    let slots_total = num_blocks * bs;
    let mut all: Vec<i64> = (0..slots_total as i64).collect();
    all.shuffle(rng);
    let n = slots_total / 2 + 3;
    let mut slots: Vec<i64> = all[..n].to_vec();
    for i in (0..n).step_by(5) {
        slots[i] = -1;
    }
    let key = random_vec::<T>(rng, n * hkv * d);
    let value = random_vec::<T>(rng, n * hkv * d);
    for layer in [0, 2] {
        let mut v = host.view_mut::<T>().expect("view");
        cpu::reshape_and_cache(v.layer_mut(layer).expect("layer"), &key, &value, &slots)
            .expect("cpu");
        let (dk, dv, ds) = (
            g.upload(&key).expect("k"),
            g.upload(&value).expect("v"),
            g.upload(&slots).expect("s"),
        );
        dev.reshape_and_cache(g, layer, &dk, &dv, &ds)
            .expect("gpu reshape");
    }
    let mut back = HostKvCache::new(cfg).expect("host");
    dev.download_to(g, &mut back).expect("download");
    assert!(
        back.as_bytes() == host.as_bytes(),
        "reshape_and_cache {} d{d} bs{bs} {page:?}: cache bytes differ",
        T::DTYPE
    );
}

#[test]
fn reshape_and_cache_grid() {
    let Some(g) = gpu("reshape_and_cache_grid") else {
        return;
    };
    let mut rng = SmallRng::seed_from_u64(9);
    let mut variant = 0;
    for d in HEAD_DIMS {
        for bs in BLOCK_SIZES {
            let page = PAGES[variant % PAGES.len()];
            variant += 1;
            check_reshape::<f32>(&g, &mut rng, d, bs, page);
            check_reshape::<f16>(&g, &mut rng, d, bs, page);
            check_reshape::<bf16>(&g, &mut rng, d, bs, page);
        }
    }
}

/// Query, output, key and value rows inside a fused QKV projection (`[q | k | v]` heads per
/// token) and an output with padded rows give the same bits as dense tensors (decode in every
/// mode, prefill, the cache write), through the cudarc layer's strided views.
fn check_fused<T: Elem + cudarc::driver::ValidAsZeroBits>(
    g: &Gpu,
    rng: &mut SmallRng,
    d: usize,
    group: usize,
) {
    let (layers, layer, hkv, bs) = (2, 1, 2, 16);
    let nh = hkv * group;
    let ctx = [37usize, 1, 700];
    let b = make_batch(rng, layers, hkv, d, bs, T::DTYPE, Page::Pad(1), &ctx);
    let host = random_cache::<T>(rng, b.cfg);
    let mut dev = DeviceKvCache::new(g, b.cfg).expect("cache");
    dev.upload_from(g, &host).expect("upload");
    let sl = slopes(rng, nh);
    let params = attn_params(nh, d, features(3, bs), &sl);
    let mut dparams = DeviceAttnParams::upload(g, &b.cfg, &params).expect("params");
    let (row, kv_row) = (nh * d, hkv * d);
    let fused_row = row + 2 * kv_row;
    let out_stride = row + 16 / std::mem::size_of::<T>();
    let qsl = [0i32, 2, 3, 7];
    let tokens = 7;
    let fused = random_vec::<T>(rng, tokens * fused_row);
    let df = g.upload(&fused).expect("fused");
    let dense_part = |off: usize, w: usize, rows: usize| -> Vec<T> {
        (0..rows)
            .flat_map(|t| fused[t * fused_row + off..t * fused_row + off + w].to_vec())
            .collect()
    };
    let dq = g.upload(&dense_part(0, row, tokens)).expect("q");
    let unpad = |v: Vec<T>, rows: usize| -> Vec<u64> {
        (0..rows)
            .flat_map(|t| v[t * out_stride..t * out_stride + row].to_vec())
            .map(|x| x.to_f32().to_bits() as u64)
            .collect()
    };
    let bits =
        |v: Vec<T>| -> Vec<u64> { v.into_iter().map(|x| x.to_f32().to_bits() as u64).collect() };
    let dseqs = DeviceSeqs::upload(g, &b.cfg, &b.seqs()).expect("seqs");
    let mut ws = DecodeWorkspace::new();
    for mode in ALL_MODES {
        dparams.mode = mode;
        let mut od = g.alloc_zeros::<T>(3 * row).expect("out");
        let mut os = g.alloc_zeros::<T>(3 * out_stride).expect("out");
        dev.paged_attention_decode_rows(
            g,
            layer,
            TokenRows::dense(&dq, row),
            &dseqs,
            &dparams,
            &mut ws,
            TokenRowsMut::dense(&mut od, row),
        )
        .expect("dense decode");
        dev.paged_attention_decode_rows(
            g,
            layer,
            TokenRows::strided(&df, 0, fused_row),
            &dseqs,
            &dparams,
            &mut ws,
            TokenRowsMut::strided(&mut os, 0, out_stride),
        )
        .expect("fused decode");
        let (od, os) = (g.download(&od).expect("d"), g.download(&os).expect("d"));
        assert!(
            bits(od.clone()) == unpad(os, 3),
            "{} d{d} {mode:?}: fused decode differs",
            T::DTYPE
        );
        let want = cpu_decode(&b, &host, layer, &dense_part(0, row, 3), &params);
        assert_close("dense decode", &od, &want, d);
    }
    let pseqs = DeviceSeqs::upload_prefill(g, &b.cfg, &b.seqs(), &qsl).expect("seqs");
    let mut pd = g.alloc_zeros::<T>(tokens * row).expect("out");
    let mut ps = g.alloc_zeros::<T>(tokens * out_stride).expect("out");
    dev.paged_attention_prefill_rows(
        g,
        layer,
        TokenRows::dense(&dq, row),
        &pseqs,
        &dparams,
        TokenRowsMut::dense(&mut pd, row),
    )
    .expect("dense prefill");
    dev.paged_attention_prefill_rows(
        g,
        layer,
        TokenRows::strided(&df, 0, fused_row),
        &pseqs,
        &dparams,
        TokenRowsMut::strided(&mut ps, 0, out_stride),
    )
    .expect("fused prefill");
    let (pd, ps) = (g.download(&pd).expect("d"), g.download(&ps).expect("d"));
    assert!(
        bits(pd.clone()) == unpad(ps, tokens),
        "{} d{d}: fused prefill differs",
        T::DTYPE
    );
    let want = cpu_prefill(&b, &host, layer, &dense_part(0, row, tokens), &qsl, &params);
    assert_close("dense prefill", &pd, &want, d);
    // The cache write from the fused k and v parts equals the CPU write of dense copies.
    let mut all: Vec<i64> = (0..(b.cfg.num_blocks() * bs) as i64).collect();
    all.shuffle(rng);
    let mut slots = all[..tokens].to_vec();
    slots[2] = -1;
    let ds = g.upload(&slots).expect("slots");
    dev.reshape_and_cache_rows(
        g,
        layer,
        TokenRows::strided(&df, row, fused_row),
        TokenRows::strided(&df, row + kv_row, fused_row),
        &ds,
    )
    .expect("fused write");
    let mut mirror = HostKvCache::new(b.cfg).expect("host");
    mirror.as_bytes_mut().copy_from_slice(host.as_bytes());
    let mut v = mirror.view_mut::<T>().expect("view");
    cpu::reshape_and_cache(
        v.layer_mut(layer).expect("layer"),
        &dense_part(row, kv_row, tokens),
        &dense_part(row + kv_row, kv_row, tokens),
        &slots,
    )
    .expect("cpu write");
    let mut back = HostKvCache::new(b.cfg).expect("host");
    dev.download_to(g, &mut back).expect("download");
    assert!(
        back.as_bytes() == mirror.as_bytes(),
        "{} d{d}: fused cache write differs",
        T::DTYPE
    );
}

#[test]
fn fused_qkv_views_match_dense() {
    let Some(g) = gpu("fused_qkv_views_match_dense") else {
        return;
    };
    let mut rng = SmallRng::seed_from_u64(16);
    check_fused::<bf16>(&g, &mut rng, 128, 4);
    check_fused::<f16>(&g, &mut rng, 80, 1);
    check_fused::<f32>(&g, &mut rng, 256, 8);
}

#[test]
fn copy_blocks_matches_cpu() {
    let Some(g) = gpu("copy_blocks_matches_cpu") else {
        return;
    };
    let mut rng = SmallRng::seed_from_u64(10);
    for (d, bs, dtype, page) in [
        (128, 16, KvDtype::Bf16, Page::Dense),
        (80, 8, KvDtype::F32, Page::Dense),
        (256, 32, KvDtype::F16, Page::Dense),
        (128, 64, KvDtype::Bf16, Page::Pad(1)),
        (64, 256, KvDtype::F16, Page::Pad(7)),
        (96, 128, KvDtype::F32, Page::RoundUp(64 << 10)),
    ] {
        let cfg = KvCacheConfig::new(4, 2, d, bs, 40, dtype).expect("cfg");
        let cfg = with_page(cfg, page);
        let mut host = HostKvCache::new(cfg).expect("host");
        rng.fill(host.as_bytes_mut());
        // Equal (poisoned) padding: the CPU twin copies runs of pages whole, the kernel only
        // the blocks.
        poison_padding(&mut host);
        let mut dev = DeviceKvCache::new(&g, cfg).expect("dev");
        dev.upload_from(&g, &host).expect("up");
        // Runs and singles, destinations distinct and never sources.
        let pairs: Vec<(u32, u32)> = vec![
            (0, 20),
            (1, 21),
            (2, 22),
            (5, 30),
            (9, 25),
            (10, 39),
            (3, 31),
            (4, 32),
        ];
        host.copy_blocks(&pairs).expect("cpu copy");
        dev.copy_blocks(&g, &pairs).expect("gpu copy");
        // A second call with fewer pairs reuses the device pair buffer.
        let pairs2 = [(20u32, 11u32)];
        host.copy_blocks(&pairs2).expect("cpu copy");
        dev.copy_blocks(&g, &pairs2).expect("gpu copy");
        let mut back = HostKvCache::new(cfg).expect("host");
        dev.download_to(&g, &mut back).expect("down");
        assert!(
            back.as_bytes() == host.as_bytes(),
            "copy_blocks {dtype} d{d} bs{bs} {page:?}: bytes differ"
        );
        // Bad mappings are refused before any launch, as on the CPU.
        assert!(matches!(
            dev.copy_blocks(&g, &[(0, 40)]),
            Err(CudaError::Kv(_))
        ));
        assert!(matches!(
            dev.copy_blocks(&g, &[(0, 1), (1, 2)]),
            Err(CudaError::Kv(_))
        ));
    }
}

#[test]
fn swap_out_then_in_restores_bytes() {
    let Some(g) = gpu("swap_out_then_in_restores_bytes") else {
        return;
    };
    for page in [Page::Dense, Page::Pad(3), Page::RoundUp(64 << 10)] {
        check_swap(&g, page);
    }
}

/// Swaps through one pinned space on two streams: the second (one block, on a new stream) is
/// queued behind the first (64 MiB, on the stream that uploaded the cache), so the host's read
/// of the space, which waits for the last swap only, sees both complete. Before swaps waited on
/// each other, the read could return while the first's DMA still ran (and the second could run
/// before the upload).
#[test]
fn swaps_on_two_streams_complete_before_host_access() {
    let Some(g) = gpu("swaps_on_two_streams_complete_before_host_access") else {
        return;
    };
    let mut rng = SmallRng::seed_from_u64(12);
    let cfg = KvCacheConfig::new(4, 8, 128, 16, 256, KvDtype::Bf16).expect("cfg");
    let mut host = HostKvCache::new(cfg).expect("host");
    rng.fill(host.as_bytes_mut());
    let mut dev = DeviceKvCache::new(&g, cfg).expect("dev");
    dev.upload_from(&g, &host).expect("up");
    let mut pinned = PinnedSwapSpace::new(&g, &cfg, 256).expect("pinned");
    let other = g.with_new_stream().expect("stream");
    let all_but_last: Vec<(u32, u32)> = (0..255).map(|b| (b, b)).collect();
    dev.swap_out(&g, &mut pinned, &all_but_last)
        .expect("swap out, stream 1");
    dev.swap_out(&other, &mut pinned, &[(255, 255)])
        .expect("swap out, stream 2");
    assert!(
        pinned.as_bytes().expect("pinned") == host.as_bytes(),
        "the host read did not wait for both swaps"
    );
}

/// Swap between a device cache with page stride `page` and a dense pinned swap space, against
/// the CPU twin.
fn check_swap(g: &Gpu, page: Page) {
    let g = g.clone();
    let mut rng = SmallRng::seed_from_u64(11);
    let cfg = KvCacheConfig::new(3, 4, 128, 16, 32, KvDtype::Bf16).expect("cfg");
    let cfg = with_page(cfg, page);
    let mut host = HostKvCache::new(cfg).expect("host");
    rng.fill(host.as_bytes_mut());
    poison_padding(&mut host);
    let mut dev = DeviceKvCache::new(&g, cfg).expect("dev");
    dev.upload_from(&g, &host).expect("up");
    let mut pinned = PinnedSwapSpace::new(&g, &cfg, 24).expect("pinned");
    let mut cpu_swap = SwapSpace::new(&cfg, 24).expect("swap");
    let out_map: Vec<(u32, u32)> = vec![
        (3, 0),
        (4, 1),
        (5, 2),
        (6, 3),
        (10, 7),
        (30, 8),
        (31, 9),
        (0, 23),
    ];
    dev.swap_out(&g, &mut pinned, &out_map)
        .expect("gpu swap out");
    cpu_swap.swap_out(&host, &out_map).expect("cpu swap out");
    assert!(
        pinned.as_bytes().expect("pinned") == cpu_swap.storage().as_bytes(),
        "{page:?}: swap-out bytes differ"
    );
    // Clobber the device blocks, swap back in to other places, compare with the CPU.
    let in_map: Vec<(u32, u32)> = vec![
        (0, 12),
        (1, 13),
        (2, 14),
        (3, 15),
        (7, 3),
        (8, 28),
        (9, 29),
        (23, 0),
    ];
    dev.swap_in(&g, &mut pinned, &in_map).expect("gpu swap in");
    cpu_swap.swap_in(&mut host, &in_map).expect("cpu swap in");
    let mut back = HostKvCache::new(cfg).expect("host");
    dev.download_to(&g, &mut back).expect("down");
    assert!(
        back.as_bytes() == host.as_bytes(),
        "{page:?}: swap-in bytes differ"
    );
    assert!(
        dev.swap_out(&g, &mut pinned, &[(32, 0)]).is_err(),
        "out-of-range source accepted"
    );
}

#[test]
fn typed_errors_before_launch() {
    let Some(g) = gpu("typed_errors_before_launch") else {
        return;
    };
    let cfg72 = KvCacheConfig::new(1, 1, 72, 16, 4, KvDtype::F16).expect("cfg");
    assert!(matches!(
        DeviceKvCache::new(&g, cfg72),
        Err(CudaError::Unsupported {
            what: "head_dim",
            ..
        })
    ));
    let cfg = KvCacheConfig::new(1, 2, 64, 16, 4, KvDtype::F16).expect("cfg");
    let dev = DeviceKvCache::new(&g, cfg).expect("dev");
    let seqs = PagedSeqs {
        block_tables: &[0, 1],
        max_blocks_per_seq: 2,
        context_lens: &[33],
    };
    assert!(matches!(
        DeviceSeqs::upload(&g, &cfg, &seqs),
        Err(CudaError::Attn(_))
    ));
    let seqs = PagedSeqs {
        block_tables: &[0, 9],
        max_blocks_per_seq: 2,
        context_lens: &[20],
    };
    assert!(matches!(
        DeviceSeqs::upload(&g, &cfg, &seqs),
        Err(CudaError::Attn(_))
    ));
    let seqs = PagedSeqs {
        block_tables: &[0, 1],
        max_blocks_per_seq: 2,
        context_lens: &[20],
    };
    let ds = DeviceSeqs::upload(&g, &cfg, &seqs).expect("seqs");
    let p = DeviceAttnParams::upload(&g, &cfg, &AttnParams::new(4, 64)).expect("params");
    assert!(DeviceAttnParams::upload(&g, &cfg, &AttnParams::new(3, 64)).is_err());
    let q = g.upload(&vec![f32::NAN; 4 * 64]).expect("q");
    let mut out = g.upload(&vec![f32::NAN; 4 * 64]).expect("out");
    let r = dev.paged_attention_decode(&g, 0, &q, &ds, &p, &mut DecodeWorkspace::new(), &mut out);
    assert!(
        matches!(r, Err(CudaError::Kv(_))),
        "f32 tensors on an f16 cache: {r:?}"
    );
    let q = g.upload(&vec![f16::ZERO; 3 * 64]).expect("q");
    let mut out = g.upload(&vec![f16::ZERO; 4 * 64]).expect("out");
    let r = dev.paged_attention_decode(&g, 0, &q, &ds, &p, &mut DecodeWorkspace::new(), &mut out);
    assert!(matches!(r, Err(CudaError::Attn(_))), "short query: {r:?}");
    let r = dev.paged_attention_decode(&g, 1, &q, &ds, &p, &mut DecodeWorkspace::new(), &mut out);
    assert!(r.is_err(), "layer out of range accepted");
}

/// Batch metadata validated for one geometry and launched over a cache of another: block 9 is
/// in range of a 16-block geometry but not of this 4-block cache, and 40 tokens fit a row of
/// two 32-token blocks but not of two of this cache's 16-token blocks. The CPU twin refuses
/// both over this cache (`BlockOutOfRange`, `ContextLen`); the launches read past the arena
/// or past the table row and returned no error.
#[test]
fn seqs_of_another_geometry_are_refused() {
    use pagedkv::error::KvError;
    let Some(g) = gpu("seqs_of_another_geometry_are_refused") else {
        return;
    };
    let cfg = KvCacheConfig::new(1, 2, 64, 16, 4, KvDtype::F16).expect("cfg");
    let dev = DeviceKvCache::new(&g, cfg).expect("dev");
    let p = DeviceAttnParams::upload(&g, &cfg, &AttnParams::new(4, 64)).expect("params");
    let q = g.upload(&vec![f16::ZERO; 4 * 64]).expect("q");
    let more_blocks = cfg.with_num_blocks(16).expect("cfg");
    let other_bs = KvCacheConfig::new(1, 2, 64, 32, 4, KvDtype::F16).expect("cfg");
    let cases: [(&str, KvCacheConfig, &[i32], i32); 2] = [
        ("16 blocks", more_blocks, &[0, 9], 20),
        ("32-token blocks", other_bs, &[0, 1], 40),
    ];
    for (what, other, tables, ctx) in cases {
        let seqs = PagedSeqs {
            block_tables: tables,
            max_blocks_per_seq: 2,
            context_lens: &[ctx],
        };
        let ds = DeviceSeqs::upload(&g, &other, &seqs).expect("seqs");
        let mut out = g.upload(&vec![f16::ZERO; 4 * 64]).expect("out");
        let r =
            dev.paged_attention_decode(&g, 0, &q, &ds, &p, &mut DecodeWorkspace::new(), &mut out);
        assert!(
            matches!(r, Err(CudaError::Kv(KvError::GeometryMismatch))),
            "decode, seqs for {what}: {r:?}"
        );
        let ps = DeviceSeqs::upload_prefill(&g, &other, &seqs, &[0, 1]).expect("seqs");
        let r = dev.paged_attention_prefill(&g, 0, &q, &ps, &p, &mut out);
        assert!(
            matches!(r, Err(CudaError::Kv(KvError::GeometryMismatch))),
            "prefill, seqs for {what}: {r:?}"
        );
    }
    // The same geometry, or one of fewer blocks, still runs.
    let seqs = PagedSeqs {
        block_tables: &[0, 1],
        max_blocks_per_seq: 2,
        context_lens: &[20],
    };
    for other in [cfg, cfg.with_num_blocks(2).expect("cfg")] {
        let ds = DeviceSeqs::upload(&g, &other, &seqs).expect("seqs");
        let mut out = g.upload(&vec![f16::ZERO; 4 * 64]).expect("out");
        dev.paged_attention_decode(&g, 0, &q, &ds, &p, &mut DecodeWorkspace::new(), &mut out)
            .expect("decode");
    }
    g.synchronize().expect("sync");
}

// ---- host-only: the launchers' argument checks (no GPU needed, run in CI) -----------------

fn geom(head_dim: i32, block_size: i32, dtype: u32) -> ffi::pkv_cache_geometry {
    ffi::pkv_cache_geometry {
        num_blocks: 4,
        num_layers: 2,
        block_size,
        num_kv_heads: 2,
        head_dim,
        dtype: dtype as i32,
        block_stride: 2 * 2 * block_size as i64 * 2 * head_dim as i64,
    }
}

#[test]
fn ffi_argument_errors_need_no_gpu() {
    // Non-null, aligned, never dereferenced: every call below fails validation first.
    let mut fake = [0u128; 4];
    let p = fake.as_mut_ptr() as *mut std::ffi::c_void;
    let short_page = ffi::pkv_cache_geometry {
        block_stride: geom(128, 64, ffi::PKV_DTYPE_F16).block_stride - 8,
        ..geom(128, 64, ffi::PKV_DTYPE_F16)
    };
    let odd_page = ffi::pkv_cache_geometry {
        block_stride: geom(128, 64, ffi::PKV_DTYPE_F16).block_stride + 4,
        ..geom(128, 64, ffi::PKV_DTYPE_F16)
    };
    let bad = [
        (geom(72, 16, ffi::PKV_DTYPE_F16), ffi::PKV_ERR_HEAD_DIM),
        (geom(128, 12, ffi::PKV_DTYPE_F16), ffi::PKV_ERR_BLOCK_SIZE),
        (geom(128, 512, ffi::PKV_DTYPE_F16), ffi::PKV_ERR_BLOCK_SIZE),
        (geom(128, 16, 7), ffi::PKV_ERR_DTYPE),
        (short_page, ffi::PKV_ERR_PAGE_STRIDE),
        (odd_page, ffi::PKV_ERR_PAGE_ALIGN),
    ];
    for (g, want) in bad {
        // SAFETY: the geometry is invalid, so pkv_copy_blocks returns before any CUDA call or
        // any access through `p`.
        let s = unsafe { ffi::pkv_copy_blocks(p, &g, p as *const i32, 1, std::ptr::null_mut()) };
        assert_eq!(s, want as i32);
        // SAFETY: as above for reshape_and_cache (geometry checked first).
        let s = unsafe {
            ffi::pkv_reshape_and_cache(
                p,
                &g,
                0,
                p,
                p,
                256,
                256,
                p as *const i64,
                1,
                std::ptr::null_mut(),
            )
        };
        assert_eq!(s, want as i32);
    }
    let g = geom(128, 16, ffi::PKV_DTYPE_BF16);
    let mut params = ffi::pkv_attn_params {
        num_heads: 3, // not a multiple of 2 KV heads
        scale: 0.1,
        ..Default::default()
    };
    let plan_of = |mode: u32, seqs: i32, ctx: i32| {
        let mut plan = ffi::pkv_decode_plan::default();
        // SAFETY: `plan` is a valid local; a forced mode makes no device query.
        let s =
            unsafe { ffi::pkv_decode_plan_init(&mut plan, mode as i32, seqs, 4, 2, 128, ctx, 0) };
        (s, plan)
    };
    // An unknown dtype: refused (before any device query).
    let mut unused = ffi::pkv_decode_plan::default();
    // SAFETY: `unused` is a valid local, written on success only.
    let s = unsafe {
        ffi::pkv_decode_plan_init_dtype(
            &mut unused,
            ffi::PKV_DECODE_AUTO as i32,
            7,
            1,
            4,
            2,
            128,
            16,
            0,
        )
    };
    assert_eq!(s, ffi::PKV_ERR_DTYPE as i32);
    let (s, plan) = plan_of(ffi::PKV_DECODE_SINGLE, 1, 16);
    assert_eq!(s, 0);
    // SAFETY: num_heads is invalid: the launcher returns before any CUDA call or dereference.
    let s = unsafe {
        ffi::pkv_paged_attention_decode(
            p,
            512,
            p,
            512,
            p,
            &g,
            0,
            p as *const i32,
            1,
            p as *const i32,
            1,
            &plan,
            &params,
            std::ptr::null_mut(),
            0,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(s, ffi::PKV_ERR_INVALID_ARG as i32);
    params.num_heads = 4;
    // A prefill over `p` with layer `layer` and `tiling` (pkv_paged_attention_prefill is this
    // with PKV_PREFILL_TILING_AUTO).
    let prefill = |layer: i32, tiling: i32| {
        // SAFETY: every call below has an invalid layer or tiling, which the launcher refuses
        // before any CUDA call or any access through `p`.
        unsafe {
            ffi::pkv_paged_attention_prefill_tiled(
                p,
                512,
                p,
                512,
                p,
                &g,
                layer,
                p as *const i32,
                1,
                p as *const i32,
                p as *const i32,
                1,
                1,
                &params,
                tiling,
                std::ptr::null_mut(),
            )
        }
    };
    // Layer 2 >= num_layers 2; then unknown tilings.
    let auto = ffi::PKV_PREFILL_TILING_AUTO as i32;
    assert_eq!(prefill(2, auto), ffi::PKV_ERR_INVALID_ARG as i32);
    for tiling in [-1, 8, 66, 131] {
        assert_eq!(
            prefill(0, tiling),
            ffi::PKV_ERR_INVALID_ARG as i32,
            "tiling {tiling}"
        );
    }
    // Split-K and no workspace: refused (a forced plan, so no device query).
    let (s, plan) = plan_of(ffi::PKV_DECODE_SPLIT, 1, 3000);
    assert_eq!(s, 0);
    // SAFETY: the workspace check fails before any launch or dereference.
    let s = unsafe {
        ffi::pkv_paged_attention_decode(
            p,
            512,
            p,
            512,
            p,
            &g,
            0,
            p as *const i32,
            200,
            p as *const i32,
            1,
            &plan,
            &params,
            std::ptr::null_mut(),
            0,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(s, ffi::PKV_ERR_WORKSPACE as i32);
    // A forced single pass takes any context capacity (no body limits a partition).
    assert_eq!(plan_of(ffi::PKV_DECODE_SINGLE, 1, 4000).0, 0);
    assert_eq!(
        plan_of(ffi::PKV_DECODE_SPLIT, 0, 16).0,
        ffi::PKV_ERR_INVALID_ARG as i32
    );
    // SAFETY: a null pointer argument is refused before use.
    let s = unsafe {
        ffi::pkv_copy_blocks(
            std::ptr::null_mut(),
            &g,
            p as *const i32,
            1,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(s, ffi::PKV_ERR_NULL_POINTER as i32);
    // SAFETY: a pure host function returning a static string.
    unsafe {
        let msg = std::ffi::CStr::from_ptr(ffi::pkv_status_string(ffi::PKV_ERR_HEAD_DIM as i32));
        assert!(msg.to_str().expect("utf8").contains("head_dim"));
    }
}

#[test]
fn probe_never_panics() {
    // Whatever the machine: a typed answer, no panic, no abort.
    match cuda::device_count() {
        Ok(n) => {
            let _ = writeln!(std::io::stderr(), "cuda devices: {n}");
        }
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "no CUDA: {e}");
        }
    }
    if let Err(e) = Gpu::open(usize::MAX) {
        assert!(matches!(
            e,
            CudaError::DriverNotFound | CudaError::NoDevice { .. } | CudaError::Driver(_)
        ));
    }
}
