//! The CUDA kernels, run on the CPU emulation (feature `cuda-emu`, see kernels/emu/emu.h),
//! against their CPU twins in `attn::cpu`: the same grid as tests/cuda_kernels.rs (dtypes,
//! head dims, GQA ratios, block sizes, context lengths at block boundaries, ALiBi / window /
//! soft-cap, every decode partitioning), through the C launchers of kernels/pagedkv.h with
//! guarded buffers (an overrun aborts with the block and thread that made it).
//!
//! What this shows: the kernels' index arithmetic, lane layouts, shuffles, barriers, split-K
//! merge and launch configurations compute what the oracle computes, and their results do not
//! depend on the order threads run between barriers (a shared-memory race at barrier
//! granularity would). What it cannot show: speed, or faults only hardware has. The same
//! checks on a GPU are tests/cuda_kernels.rs.
#![cfg(all(feature = "cuda-emu", not(feature = "cuda")))]

#[path = "support/emu_bufs.rs"]
mod emu_bufs;
#[path = "support/kernel_grid.rs"]
mod kernel_grid;

use emu_bufs::*;
use half::{bf16, f16};
use kernel_grid::*;
use pagedkv::attn::cpu;
use pagedkv::cuda_emu::{self, ffi, EmuBuf, EmuElem, Schedule};
use pagedkv::cuda_raw::{DecodeMode, DecodePlan};
use pagedkv::kv::AttnParams;
use pagedkv::kv::{HostKvCache, KvCacheConfig, KvDtype, KvPart, SwapSpace};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::ffi::c_void;

trait Elem: Tol + EmuElem {}
impl<T: Tol + EmuElem> Elem for T {}

const OK: i32 = ffi::PKV_OK as i32;

/// One attention problem uploaded to guarded "device" buffers.
struct AttnCase {
    cfg: KvCacheConfig,
    geom: ffi::pkv_cache_geometry,
    cache: EmuBuf,
    query: EmuBuf,
    tables: EmuBuf,
    ctx: EmuBuf,
    /// Owns the ALiBi slopes `params.alibi_slopes` points into.
    _slopes: Option<EmuBuf>,
    mbps: usize,
    num_seqs: usize,
    max_ctx: usize,
    nh: usize,
    rows: usize,
    params: ffi::pkv_attn_params,
}

impl AttnCase {
    fn new<T: Elem>(b: &Batch, host: &HostKvCache, query: &[T], params: &AttnParams<'_>) -> Self {
        let slopes = params.alibi_slopes.map(buf::<f32>);
        let ffi_params = ffi::pkv_attn_params {
            num_heads: params.num_heads as i32,
            scale: params.scale,
            softcap: params.softcap,
            sliding_window: params.sliding_window as i32,
            alibi_slopes: slopes
                .as_ref()
                .map_or(std::ptr::null(), |s| s.ptr() as *const f32),
            launch_flags: 0,
        };
        Self {
            cfg: b.cfg,
            geom: geometry(&b.cfg),
            cache: buf(host.as_bytes()),
            query: buf(query),
            tables: buf(&b.tables),
            ctx: buf(&b.ctx),
            _slopes: slopes,
            mbps: b.mbps,
            num_seqs: b.ctx.len(),
            max_ctx: b.ctx.iter().copied().max().unwrap_or(0).max(0) as usize,
            nh: params.num_heads,
            rows: query.len() / b.cfg.head_dim(),
            params: ffi_params,
        }
    }

    /// The plan of `mode` for this batch (sized exactly to it, the device's SM count), or the
    /// status that refused it.
    fn plan(&self, mode: u32) -> Result<ffi::pkv_decode_plan, i32> {
        let mut plan = ffi::pkv_decode_plan::default();
        // SAFETY: `plan` is a valid local the call writes; with sm_count 0 it asks the
        // (emulated) device of this thread, which has no precondition.
        let s = unsafe {
            ffi::pkv_decode_plan_init(
                &mut plan,
                mode as i32,
                self.num_seqs as i32,
                self.nh as i32,
                self.cfg.num_kv_heads() as i32,
                self.cfg.head_dim() as i32,
                self.max_ctx.max(1) as i32,
                0,
            )
        };
        if s == OK {
            Ok(plan)
        } else {
            Err(s)
        }
    }

    /// Decode into a fresh poisoned output with a plan of `mode` made for this batch; returns
    /// the status (the plan's refusal, or the launcher's) and the output.
    fn decode<T: Elem>(&mut self, layer: usize, mode: u32) -> (i32, Vec<T>) {
        match self.plan(mode) {
            Ok(plan) => self.decode_with::<T>(layer, &plan),
            Err(s) => (s, Vec::new()),
        }
    }

    /// Decode into a fresh poisoned output under `plan`; returns the launcher status and the
    /// output.
    fn decode_with<T: Elem>(&self, layer: usize, plan: &ffi::pkv_decode_plan) -> (i32, Vec<T>) {
        let d = self.cfg.head_dim();
        let row = (self.nh * d) as i64;
        let out = poisoned::<T>(self.rows * d);
        let ws_bytes = plan.workspace_bytes as usize;
        let ws = (ws_bytes > 0).then(|| decode_workspace(ws_bytes, plan.counter_bytes as usize));
        // SAFETY: every pointer is a live guarded buffer of the shape pagedkv.h documents
        // (cache: the whole cache; query/out: [num_seqs][nh][d], dense rows; tables:
        // [num_seqs][mbps]; ctx: [num_seqs]; workspace: the plan's bytes); the emulated launch
        // is synchronous, so the buffers outlive every access.
        let s = unsafe {
            ffi::pkv_paged_attention_decode(
                out.ptr(),
                row,
                self.query.ptr(),
                row,
                self.cache.ptr(),
                &self.geom,
                layer as i32,
                self.tables.ptr() as *const i32,
                self.mbps as i32,
                self.ctx.ptr() as *const i32,
                self.num_seqs as i32,
                plan,
                &self.params,
                ws.as_ref().map_or(null(), EmuBuf::ptr),
                ws_bytes,
                null(),
            )
        };
        (s, out.as_slice::<T>().to_vec())
    }

    fn prefill<T: Elem>(&self, layer: usize, qsl: &[i32]) -> (i32, Vec<T>) {
        self.prefill_tiled(layer, qsl, ffi::PKV_PREFILL_TILING_AUTO)
    }

    /// Prefill with the f16 / bf16 kernel's `tiling` (PKV_PREFILL_TILING_*; f32 ignores it).
    fn prefill_tiled<T: Elem>(&self, layer: usize, qsl: &[i32], tiling: u32) -> (i32, Vec<T>) {
        let d = self.cfg.head_dim();
        let out = poisoned::<T>(self.rows * d);
        let qsl_buf = buf(qsl);
        let max_q = qsl.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
        // SAFETY: as in decode; query_start_loc is [num_seqs + 1] and every query length is at
        // most max_q.
        let s = unsafe {
            ffi::pkv_paged_attention_prefill_tiled(
                out.ptr(),
                (self.nh * d) as i64,
                self.query.ptr(),
                (self.nh * d) as i64,
                self.cache.ptr(),
                &self.geom,
                layer as i32,
                self.tables.ptr() as *const i32,
                self.mbps as i32,
                self.ctx.ptr() as *const i32,
                qsl_buf.ptr() as *const i32,
                self.num_seqs as i32,
                max_q,
                &self.params,
                tiling as i32,
                null(),
            )
        };
        (s, out.as_slice::<T>().to_vec())
    }
}

const MODES: [u32; 3] = [
    ffi::PKV_DECODE_AUTO,
    ffi::PKV_DECODE_SINGLE,
    ffi::PKV_DECODE_SPLIT,
];

#[allow(clippy::too_many_arguments)]
fn check_decode<T: Elem>(
    rng: &mut SmallRng,
    d: usize,
    group: usize,
    bs: usize,
    page: Page,
    ctx: &[usize],
    f: Features,
    modes: &[u32],
) {
    let (layers, layer, hkv) = (2, 1, 2);
    let b = make_batch(rng, layers, hkv, d, bs, T::DTYPE, page, ctx);
    let host = random_cache::<T>(rng, b.cfg);
    let nh = hkv * group;
    let query = random_vec::<T>(rng, ctx.len() * nh * d);
    let sl = slopes(rng, nh);
    let params = attn_params(nh, d, f, &sl);
    let want = cpu_decode(&b, &host, layer, &query, &params);

    let mut case = AttnCase::new(&b, &host, &query, &params);
    for &mode in modes {
        let (s, got) = case.decode::<T>(layer, mode);
        let what = format!(
            "decode {} d{d} g{group} bs{bs} {page:?} {f:?} mode {mode} ctx {ctx:?}",
            T::DTYPE
        );
        expect_ok(&what, s);
        assert_close(&what, &got, &want, d);
    }
}

fn check_prefill<T: Elem>(
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
    let want = cpu_prefill(&b, &host, layer, &query, &qsl, &params);
    if query.is_empty() {
        return;
    }
    let case = AttnCase::new(&b, &host, &query, &params);
    let (s, got) = case.prefill::<T>(layer, &qsl);
    let what = format!(
        "prefill {} d{d} g{group} bs{bs} {page:?} {f:?} q/ctx {seqs_q_ctx:?}",
        T::DTYPE
    );
    expect_ok(&what, s);
    assert_close(&what, &got, &want, d);
}

// ---- attention grids -------------------------------------------------------------------------

fn decode_grid<T: Elem>(seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut variant = 0;
    for d in HEAD_DIMS {
        for group in GROUPS {
            for bs in BLOCK_SIZES {
                let f = features(variant, bs);
                let page = PAGES[(variant / 4) % PAGES.len()];
                let ctx = decode_grid_contexts(bs);
                check_decode::<T>(&mut rng, d, group, bs, page, &ctx, f, &MODES);
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

/// Split-K over many partitions (boundaries 511/512/513), the in-launch split merge, windows starting
/// mid-partition, and odd GQA ratios (2, 3, 6, 16: padded and chunked head groups).
#[test]
fn decode_long_contexts_and_odd_groups() {
    let mut rng = SmallRng::seed_from_u64(4);
    let ctx = [511, 512, 513, 1537, 3000, 1];
    for (i, f) in [
        Features::PLAIN,
        Features {
            alibi: true,
            window: 700,
            softcap: 0.0,
        },
        Features {
            alibi: false,
            window: 2100,
            softcap: 30.0,
        },
    ]
    .into_iter()
    .enumerate()
    {
        check_decode::<bf16>(&mut rng, 128, 4, 16, Page::Dense, &ctx, f, &MODES);
        check_decode::<f32>(&mut rng, 256, 8, 32, Page::Pad(3), &ctx, f, &MODES);
        check_decode::<f16>(
            &mut rng,
            [80, 112, 64][i],
            1,
            8,
            Page::RoundUp(64 << 10),
            &ctx,
            f,
            &MODES,
        );
    }
    // A forced single pass over a context whose logits alone would overflow 48 KiB of shared
    // memory (the old body refused it): the v2 bodies keep nothing per token there.
    check_decode::<bf16>(
        &mut rng,
        128,
        4,
        16,
        Page::Dense,
        &[5000, 5],
        Features::PLAIN,
        &MODES,
    );
    for group in [2, 3, 6, 16] {
        let f = features(group, 16);
        check_decode::<bf16>(
            &mut rng,
            128,
            group,
            16,
            Page::Dense,
            &[1, 17, 600, 1100],
            f,
            &MODES,
        );
    }
}

/// The shapes `pagedkv bench gpu` times (issue 6): 32 query heads over 8 or 32 KV heads, head
/// dim 128, bf16, block 16, contexts 512 and 4096, with only the KV heads cut down (the kernels
/// see the same per-block work; the grid is just narrower).
#[test]
fn decode_benchmark_shapes() {
    let mut rng = SmallRng::seed_from_u64(15);
    // group 4 (32 / 8) and group 1 (32 / 32): GT = 4 and GT = 1 kernels.
    for group in [4, 1] {
        check_decode::<bf16>(
            &mut rng,
            128,
            group,
            16,
            Page::Dense,
            &[4096, 512, 4095],
            Features::PLAIN,
            &MODES,
        );
    }
}

/// Every GQA ratio from 1 to 8 (and 12, 16: head groups split over blocks) on each body: the
/// tensor-core one (f16 / bf16, ratio >= 2: 8 heads per block, rows past the group padded),
/// the CUDA-core one (f32, MHA), over every head dim and block size in turn, contexts that
/// cross tiles, partitions and blocks, each decode partitioning (auto: splits derived per
/// sequence on the device; forced split: fixed 512-token partitions; single pass).
#[test]
fn decode_every_group_size() {
    let mut rng = SmallRng::seed_from_u64(16);
    let ctx = [1, 16, 17, 600, 1100, 0];
    // 12 and 16: one 16-head tensor-core block (up to d128); 24 and 40: several, the last
    // padded.
    for (i, group) in (1..=8).chain([12, 16, 24, 40]).enumerate() {
        let d = HEAD_DIMS[i % HEAD_DIMS.len()];
        let bs = BLOCK_SIZES[(i + 2) % BLOCK_SIZES.len()];
        let page = PAGES[i % PAGES.len()];
        let f = features(i, bs);
        check_decode::<bf16>(&mut rng, d, group, bs, page, &ctx, f, &MODES);
        let d2 = HEAD_DIMS[(i + 3) % HEAD_DIMS.len()];
        let f2 = features(i + 1, 8);
        check_decode::<f16>(&mut rng, d2, group, 8, page, &ctx, f2, &MODES);
        if group <= 8 {
            check_decode::<f32>(&mut rng, d, group, bs, page, &ctx[..4], f2, &MODES);
        }
    }
}

/// The decode bodies' results are bit-identical whatever order the threads of a block run in
/// between barriers (their per-warp states meet only in the merge after a __syncthreads), on
/// each body and partitioning.
#[test]
fn decode_results_do_not_depend_on_thread_order() {
    let mut rng = SmallRng::seed_from_u64(17);
    let ctx = [700, 33, 1, 1300];
    // bf16 g6 d112: tensor cores with a padded group and 8- and 4-byte tails; bf16 g12 d64:
    // 16-head tensor-core blocks; f32 g8 d64 and f16 g1 d256: the CUDA-core body.
    fn run<T: Elem>(rng: &mut SmallRng, d: usize, group: usize, bs: usize, ctx: &[usize]) {
        let (layers, layer, hkv) = (2, 1, 2);
        let b = make_batch(rng, layers, hkv, d, bs, T::DTYPE, Page::Pad(1), ctx);
        let host = random_cache::<T>(rng, b.cfg);
        let nh = hkv * group;
        let sl = slopes(rng, nh);
        let params = attn_params(nh, d, features(3, bs), &sl);
        let q = random_vec::<T>(rng, ctx.len() * nh * d);
        let want = cpu_decode(&b, &host, layer, &q, &params);
        let mut case = AttnCase::new(&b, &host, &q, &params);
        for mode in [
            ffi::PKV_DECODE_AUTO,
            ffi::PKV_DECODE_SPLIT,
            ffi::PKV_DECODE_SINGLE,
        ] {
            let mut first: Option<Vec<f32>> = None;
            for sched in [
                Schedule::Forward,
                Schedule::Reverse,
                Schedule::Random(3),
                Schedule::Random(4),
                Schedule::WarpByWarp { reverse: false },
                Schedule::WarpByWarp { reverse: true },
            ] {
                cuda_emu::set_schedule(sched);
                let (s, got) = case.decode::<T>(layer, mode);
                let what = format!("{} d{d} g{group} mode {mode} {sched:?}", T::DTYPE);
                expect_ok(&what, s);
                assert_close(&what, &got, &want, d);
                let now: Vec<f32> = got.iter().map(|x| x.to_f32()).collect();
                match &first {
                    None => first = Some(now),
                    Some(f) => assert!(
                        f.iter().zip(&now).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{what}: outputs differ from the forward order"
                    ),
                }
            }
        }
        cuda_emu::set_schedule(Schedule::Forward);
    }
    run::<bf16>(&mut rng, 112, 6, 8, &ctx);
    run::<bf16>(&mut rng, 64, 12, 16, &ctx); // 16-head tensor-core blocks
    run::<f32>(&mut rng, 64, 8, 32, &ctx);
    run::<f16>(&mut rng, 256, 1, 16, &ctx);
}

/// Query rows read from a fused-QKV-shaped view (token stride num_heads + 2 * num_kv_heads
/// rows of head_dim, plus 16 bytes) and out rows written to a padded view give the dense
/// result on each body and partitioning; the padding between out rows is left as it was.
#[test]
fn decode_strided_views_match_the_oracle() {
    fn run<T: Elem>(rng: &mut SmallRng, d: usize, group: usize) {
        let (layers, layer, hkv, bs) = (1, 0, 2, 16);
        let ctx = [300usize, 1, 77];
        let b = make_batch(rng, layers, hkv, d, bs, T::DTYPE, Page::Dense, &ctx);
        let host = random_cache::<T>(rng, b.cfg);
        let nh = hkv * group;
        let sl = slopes(rng, nh);
        let params = attn_params(nh, d, features(1, bs), &sl);
        let query = random_vec::<T>(rng, ctx.len() * nh * d);
        let want = cpu_decode(&b, &host, layer, &query, &params);
        let vec = 16 / std::mem::size_of::<T>();
        let (qs, os) = ((nh + 2 * hkv) * d + vec, nh * d + vec);
        // The fused view: each token's q heads first, then garbage (k, v and the pad).
        let mut fused = vec![T::from_f32(f32::NAN); ctx.len() * qs];
        for s in 0..ctx.len() {
            fused[s * qs..s * qs + nh * d].copy_from_slice(&query[s * nh * d..(s + 1) * nh * d]);
        }
        let case = AttnCase::new(&b, &host, &query, &params);
        let fq = buf(&fused);
        for mode in MODES {
            let plan = case.plan(mode).expect("plan");
            let out = poisoned::<T>(ctx.len() * os);
            let ws = (plan.workspace_bytes > 0).then(|| {
                decode_workspace(plan.workspace_bytes as usize, plan.counter_bytes as usize)
            });
            // SAFETY: fq holds ctx.len() rows of qs elements (the q heads first), out
            // ctx.len() rows of os; the rest as AttnCase::decode_with; synchronous launch.
            let s = unsafe {
                ffi::pkv_paged_attention_decode(
                    out.ptr(),
                    os as i64,
                    fq.ptr(),
                    qs as i64,
                    case.cache.ptr(),
                    &case.geom,
                    layer as i32,
                    case.tables.ptr() as *const i32,
                    case.mbps as i32,
                    case.ctx.ptr() as *const i32,
                    ctx.len() as i32,
                    &plan,
                    &case.params,
                    ws.as_ref().map_or(null(), EmuBuf::ptr),
                    plan.workspace_bytes as usize,
                    null(),
                )
            };
            let what = format!("strided decode {} d{d} g{group} mode {mode}", T::DTYPE);
            expect_ok(&what, s);
            let got = out.as_slice::<T>();
            let dense: Vec<T> = (0..ctx.len())
                .flat_map(|s| got[s * os..s * os + nh * d].iter().copied())
                .collect();
            assert_close(&what, &dense, &want, d);
            for s in 0..ctx.len() {
                assert!(
                    got[s * os + nh * d..(s + 1) * os]
                        .iter()
                        .all(|x| x.to_f32().is_nan()),
                    "{what}: padding after out row {s} written"
                );
            }
        }
    }
    let mut rng = SmallRng::seed_from_u64(18);
    run::<bf16>(&mut rng, 96, 4); // tensor cores
    run::<f16>(&mut rng, 64, 1); // CUDA cores, MHA
    run::<f32>(&mut rng, 80, 3); // CUDA cores, GQA
}

fn prefill_grid<T: Elem>(seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut variant = 0;
    for d in HEAD_DIMS {
        for group in GROUPS {
            for bs in BLOCK_SIZES {
                let f = features(variant, bs);
                let page = PAGES[(variant / 4) % PAGES.len()];
                check_prefill::<T>(&mut rng, d, group, bs, page, &prefill_grid_seqs(bs), f);
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
    let mut rng = SmallRng::seed_from_u64(8);
    for v in 0..4 {
        let f = features(v, 16);
        check_prefill::<bf16>(
            &mut rng,
            128,
            4,
            16,
            Page::Dense,
            &[(100, 700), (129, 129)],
            f,
        );
        check_prefill::<f16>(
            &mut rng,
            256,
            8,
            32,
            Page::Pad(1),
            &[(40, 40), (33, 300)],
            f,
        );
        check_prefill::<f32>(&mut rng, 96, 6, 8, Page::Dense, &[(40, 41), (7, 500)], f);
    }
}

// ---- scheduling independence and the auto partitioning ---------------------------------------

/// Bit-identical outputs whatever order the threads of a block run in between barriers: a
/// read of shared memory not ordered by a barrier after its write would differ.
#[test]
fn results_do_not_depend_on_thread_order() {
    let mut rng = SmallRng::seed_from_u64(12);
    let (d, group, bs, hkv, layer) = (128, 4, 16, 2, 0);
    let ctx = [700, 33, 1];
    let b = make_batch(&mut rng, 1, hkv, d, bs, KvDtype::Bf16, Page::Pad(2), &ctx);
    let host = random_cache::<bf16>(&mut rng, b.cfg);
    let nh = hkv * group;
    let sl = slopes(&mut rng, nh);
    let f = features(3, bs);
    let params = attn_params(nh, d, f, &sl);
    let dq = random_vec::<bf16>(&mut rng, ctx.len() * nh * d);
    let mut dcase = AttnCase::new(&b, &host, &dq, &params);
    let qsl = [0, 40, 73, 74];
    let pq = random_vec::<bf16>(&mut rng, 74 * nh * d);
    let pcase = AttnCase::new(&b, &host, &pq, &params);

    let mut first: Option<(Vec<u16>, Vec<u16>, Vec<u16>)> = None;
    for sched in [
        Schedule::Forward,
        Schedule::Reverse,
        Schedule::Random(1),
        Schedule::Random(2),
        Schedule::WarpByWarp { reverse: false },
        Schedule::WarpByWarp { reverse: true },
    ] {
        cuda_emu::set_schedule(sched);
        let (s1, single) = dcase.decode::<bf16>(layer, ffi::PKV_DECODE_SINGLE);
        let (s2, split) = dcase.decode::<bf16>(layer, ffi::PKV_DECODE_SPLIT);
        let (s3, pre) = pcase.prefill::<bf16>(layer, &qsl);
        for s in [s1, s2, s3] {
            expect_ok(&format!("{sched:?}"), s);
        }
        let bits = |v: Vec<bf16>| v.into_iter().map(bf16::to_bits).collect::<Vec<u16>>();
        let now = (bits(single), bits(split), bits(pre));
        match &first {
            None => first = Some(now),
            Some(f) => assert!(
                *f == now,
                "{sched:?}: outputs differ from the forward order"
            ),
        }
    }
    cuda_emu::set_schedule(Schedule::Forward);
}

/// Auto mode: a long context is split when the batch is too small to fill the device, and
/// single-pass when the batch alone gives every SM several blocks; both match the oracle.
#[test]
fn auto_mode_picks_split_by_device_size() {
    let mut rng = SmallRng::seed_from_u64(13);
    let (d, group, bs, hkv, layer) = (64, 4, 16, 2, 0);
    let ctx = [1500, 900];
    let b = make_batch(&mut rng, 1, hkv, d, bs, KvDtype::F16, Page::Dense, &ctx);
    let host = random_cache::<f16>(&mut rng, b.cfg);
    let nh = hkv * group;
    let params = attn_params(nh, d, Features::PLAIN, &[]);
    let query = random_vec::<f16>(&mut rng, ctx.len() * nh * d);
    let want = cpu_decode(&b, &host, layer, &query, &params);
    let mut case = AttnCase::new(&b, &host, &query, &params);
    // 2 seqs x 2 KV heads = 4 thread blocks per split: PKV_DECODE_CTAS_PER_SM (2) per SM
    // without splitting only on a 1-SM device; on 132 SMs the plan splits. Either way one
    // kernel runs (the splits merge in the same launch).
    for (sms, split) in [(132, true), (1, false)] {
        cuda_emu::set_sm_count(sms);
        let splits = case.plan(ffi::PKV_DECODE_AUTO).expect("plan").num_splits as u64;
        assert_eq!(splits > 1, split, "{sms} SMs: {splits} splits");
        let _ = cuda_emu::take_stats();
        let (s, got) = case.decode::<f16>(layer, ffi::PKV_DECODE_AUTO);
        expect_ok("auto", s);
        let st = cuda_emu::take_stats();
        assert_eq!(st.launches, 1, "{sms} SMs: kernels launched");
        assert_eq!(st.blocks, 4 * splits, "{sms} SMs: thread blocks");
        assert_close(&format!("auto decode on {sms} SMs"), &got, &want, d);
    }
    cuda_emu::set_sm_count(132);
}

/// The split merge over many splits: 375 of a long context (a fixed plan: Auto's partitions
/// would keep 32-64 tokens), so each merging thread takes many steps of splits (the MHA body:
/// 8 threads per 16-byte piece at d64, 47 splits each; the 16-head body: one thread per piece,
/// every split) and keeps a running max across them, which the ALiBi slopes below move.
#[test]
fn split_merge_of_many_splits_matches_the_oracle() {
    let mut rng = SmallRng::seed_from_u64(29);
    let (d, bs, hkv, layer) = (64, 16, 1, 0);
    let ctx = [11_000];
    for group in [1, 16] {
        let b = make_batch(&mut rng, 1, hkv, d, bs, KvDtype::Bf16, Page::Dense, &ctx);
        let host = random_cache::<bf16>(&mut rng, b.cfg);
        let nh = hkv * group;
        // ALiBi slopes that make the splits' weights span e^-5 .. 1 over the context: a split
        // weighted against the wrong max is far off (with plain random logits every split's
        // max is about the same, and such a mix-up would pass).
        let sl: Vec<f32> = (0..nh).map(|h| 4e-4 * (1.0 + h as f32 / 16.0)).collect();
        let alibi = Features {
            alibi: true,
            ..Features::PLAIN
        };
        let params = attn_params(nh, d, alibi, &sl);
        let query = random_vec::<bf16>(&mut rng, ctx.len() * nh * d);
        let want = cpu_decode(&b, &host, layer, &query, &params);
        let case = AttnCase::new(&b, &host, &query, &params);
        let plan =
            DecodePlan::new(DecodeMode::Splits(375), 1, nh, hkv, d, 11_000, 0).expect("fixed plan");
        let splits = plan.num_splits();
        assert_eq!(splits, 375, "group {group}");
        let (s, got) = case.decode_with::<bf16>(layer, plan.as_ffi());
        expect_ok("merge of 375 splits", s);
        assert_close(&format!("group {group}, {splits} splits"), &got, &want, d);
    }
}

// ---- cache writes and block moves --------------------------------------------------------------

fn check_reshape<T: Elem>(rng: &mut SmallRng, d: usize, bs: usize, padded: bool, page: Page) {
    let (layers, hkv, num_blocks) = (3, 2, 7);
    let cfg = KvCacheConfig::new(layers, hkv, d, bs, num_blocks, T::DTYPE).expect("config");
    // The host image's page padding is poisoned (random_cache) and compared below: the kernel
    // must leave it as it is.
    let cfg = with_page(cfg, page);
    let mut host = random_cache::<T>(rng, cfg);
    let mut dev = buf(host.as_bytes());
    let geom = geometry(&cfg);
    let slots_total = num_blocks * bs;
    let mut all: Vec<i64> = (0..slots_total as i64).collect();
    all.shuffle(rng);
    let n = slots_total / 2 + 3;
    let mut slots: Vec<i64> = all[..n].to_vec();
    for i in (0..n).step_by(5) {
        slots[i] = -1;
    }
    let row = hkv * d;
    let key = random_vec::<T>(rng, n * row);
    let value = random_vec::<T>(rng, n * row);
    // A padded row stride (one element more) is not a whole number of 16-byte vectors: the
    // launcher must take the element-wise path.
    let stride = if padded { row + 1 } else { row };
    let spread = |x: &[T]| -> Vec<T> {
        let mut v = vec![T::from_f32(7.0); n * stride];
        for t in 0..n {
            v[t * stride..t * stride + row].copy_from_slice(&x[t * row..(t + 1) * row]);
        }
        v
    };
    let (dk, dv, ds) = (buf(&spread(&key)), buf(&spread(&value)), buf(&slots));
    for layer in [0, 2] {
        let mut v = host.view_mut::<T>().expect("view");
        cpu::reshape_and_cache(v.layer_mut(layer).expect("layer"), &key, &value, &slots)
            .expect("cpu");
        // SAFETY: cache is the whole cache; key/value hold n rows of `stride` elements;
        // slot_mapping holds n i64; the emulated launch is synchronous.
        let s = unsafe {
            ffi::pkv_reshape_and_cache(
                dev.ptr(),
                &geom,
                layer as i32,
                dk.ptr(),
                dv.ptr(),
                stride as i64,
                stride as i64,
                ds.ptr() as *const i64,
                n as i32,
                null(),
            )
        };
        expect_ok("reshape_and_cache", s);
    }
    assert!(
        dev.as_mut_slice::<u8>() == host.as_bytes(),
        "reshape_and_cache {} d{d} bs{bs} padded {padded} {page:?}: cache bytes differ",
        T::DTYPE
    );
}

#[test]
fn reshape_and_cache_grid() {
    let mut rng = SmallRng::seed_from_u64(9);
    let mut variant = 0;
    for d in HEAD_DIMS {
        for bs in BLOCK_SIZES {
            for padded in [false, true] {
                let page = PAGES[variant % PAGES.len()];
                variant += 1;
                check_reshape::<f32>(&mut rng, d, bs, padded, page);
                check_reshape::<f16>(&mut rng, d, bs, padded, page);
                check_reshape::<bf16>(&mut rng, d, bs, padded, page);
            }
        }
    }
}

/// Out-of-range slots are skipped by the kernel (the CPU twin refuses them up front).
#[test]
fn reshape_and_cache_skips_out_of_range_slots() {
    let cfg = KvCacheConfig::new(1, 2, 64, 8, 3, KvDtype::F32).expect("cfg");
    let before = vec![0u8; cfg.num_blocks() * cfg.bytes_per_block()];
    let dev = buf(&before);
    let key = buf(&vec![1.0f32; 3 * 128]);
    let slots = buf(&[24i64, i64::MAX, -5]);
    // SAFETY: 3 tokens of dense rows; every slot is out of range, so nothing is written.
    let s = unsafe {
        ffi::pkv_reshape_and_cache(
            dev.ptr(),
            &geometry(&cfg),
            0,
            key.ptr(),
            key.ptr(),
            128,
            128,
            slots.ptr() as *const i64,
            3,
            null(),
        )
    };
    expect_ok("reshape_and_cache", s);
    assert!(
        dev.as_slice::<u8>() == &before[..],
        "an out-of-range slot was written"
    );
}

#[test]
fn copy_blocks_matches_cpu() {
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
        // Poisoned padding everywhere: the CPU twin copies a run of pages whole (padding
        // between its blocks included), the kernel only the blocks; with equal padding both
        // must give the same bytes, and the kernel must not write the padding.
        poison_padding(&mut host);
        let mut dev = buf(host.as_bytes());
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
        // The kernel skips pairs it cannot do (out of range, src == dst); add some.
        let mut flat: Vec<i32> = pairs
            .iter()
            .flat_map(|&(s, d)| [s as i32, d as i32])
            .collect();
        flat.extend_from_slice(&[-1, 5, 7, 40, 6, 6]);
        let dpairs = buf(&flat);
        // SAFETY: pairs holds flat.len() / 2 (src, dst) i32 pairs; the cache is whole.
        let s = unsafe {
            ffi::pkv_copy_blocks(
                dev.ptr(),
                &geometry(&cfg),
                dpairs.ptr() as *const i32,
                (flat.len() / 2) as i32,
                null(),
            )
        };
        expect_ok("copy_blocks", s);
        assert!(
            dev.as_mut_slice::<u8>() == host.as_bytes(),
            "copy_blocks {dtype} d{d} bs{bs} {page:?}: bytes differ"
        );
    }
}

#[test]
fn swap_out_then_in_restores_bytes() {
    for page in [Page::Dense, Page::Pad(3), Page::RoundUp(64 << 10)] {
        check_swap(page);
    }
}

/// Swap out of a device arena with page stride `page` into a dense swap space and back, against
/// the CPU twin (`SwapSpace`); the arena's padding must be left as it is.
fn check_swap(page: Page) {
    let mut rng = SmallRng::seed_from_u64(11);
    let cfg = KvCacheConfig::new(3, 4, 128, 16, 32, KvDtype::Bf16).expect("cfg");
    let cfg = with_page(cfg, page);
    let mut host = HostKvCache::new(cfg).expect("host");
    rng.fill(host.as_bytes_mut());
    poison_padding(&mut host);
    let dev = buf(host.as_bytes());
    let mut cpu_swap = SwapSpace::new(&cfg, 24).expect("swap");
    let pinned = EmuBuf::zeroed(cpu_swap.storage().as_bytes().len()).expect("pinned");
    let block_bytes = cfg.bytes_per_block();
    let (dev_page, swap_page) = (cfg.page_bytes(), cpu_swap.config().page_bytes());
    let swap = |dst: &EmuBuf, src: &EmuBuf, map: &[(u32, u32)], to_host: i32| {
        let pairs: Vec<i64> = map
            .iter()
            .flat_map(|&(s, d)| [s as i64, d as i64])
            .collect();
        let (dst_page, src_page) = if to_host == 1 {
            (swap_page, dev_page)
        } else {
            (dev_page, swap_page)
        };
        // SAFETY: dst and src hold whole pages for every index in `map` (checked by the CPU
        // twin on the same mapping); pairs is a host array of map.len() pairs.
        let s = unsafe {
            ffi::pkv_swap_blocks(
                dst.ptr(),
                dst_page,
                src.ptr(),
                src_page,
                block_bytes,
                pairs.as_ptr(),
                map.len() as i32,
                to_host,
                null(),
            )
        };
        expect_ok(&format!("swap_blocks {page:?}"), s);
    };
    let out_map = [
        (3, 0),
        (4, 1),
        (5, 2),
        (6, 3),
        (10, 7),
        (30, 8),
        (31, 9),
        (0, 23),
    ];
    cpu_swap.swap_out(&host, &out_map).expect("cpu swap out");
    swap(&pinned, &dev, &out_map, 1);
    assert!(
        pinned.as_slice::<u8>() == cpu_swap.storage().as_bytes(),
        "{page:?}: swap-out bytes differ"
    );
    let in_map = [
        (0, 12),
        (1, 13),
        (2, 14),
        (3, 15),
        (7, 3),
        (8, 28),
        (9, 29),
        (23, 0),
    ];
    cpu_swap.swap_in(&mut host, &in_map).expect("cpu swap in");
    swap(&dev, &pinned, &in_map, 0);
    assert!(
        dev.as_slice::<u8>() == host.as_bytes(),
        "{page:?}: swap-in bytes differ"
    );
}

// ---- what the emulation refuses, as the hardware would ----------------------------------------

/// Query and out views off the 16-byte grid (pointer or token stride) or with a token stride
/// shorter than a row are refused by both launchers before any launch (`PKV_ERR_ROW_STRIDE`);
/// a plan that does not describe the launch is refused with `PKV_ERR_PLAN`.
#[test]
fn bad_views_and_plans_are_refused() {
    let mut rng = SmallRng::seed_from_u64(14);
    let b = make_batch(&mut rng, 1, 1, 64, 16, KvDtype::F32, Page::Dense, &[20]);
    let host = random_cache::<f32>(&mut rng, b.cfg);
    let params = attn_params(1, 64, Features::PLAIN, &[]);
    let query = random_vec::<f32>(&mut rng, 2 * 64 + 4);
    let case = AttnCase::new(&b, &host, &query, &params);
    let out = poisoned::<f32>(2 * 64 + 4);
    let plan = case.plan(ffi::PKV_DECODE_SINGLE).expect("plan");
    let qsl = buf(&[0i32, 1]);
    let (q, o) = (case.query.ptr(), out.ptr());
    // SAFETY: offsets stay inside the buffers; only used as (possibly misaligned) addresses.
    let (q4, o4) = unsafe { (q.cast::<u8>().add(4).cast(), o.cast::<u8>().add(4).cast()) };
    let launch = |o: *mut c_void, os: i64, q: *mut c_void, qs: i64, plan: &ffi::pkv_decode_plan| {
        // SAFETY: every pointer is a live guarded buffer holding at least one row of 64 f32
        // (plus 4 bytes of slack for the shifted views) and the tables/ctx/qsl of one
        // sequence; a refused launch touches nothing, an accepted one reads/writes one row.
        unsafe {
            [
                ffi::pkv_paged_attention_decode(
                    o,
                    os,
                    q,
                    qs,
                    case.cache.ptr(),
                    &case.geom,
                    0,
                    case.tables.ptr() as *const i32,
                    case.mbps as i32,
                    case.ctx.ptr() as *const i32,
                    1,
                    plan,
                    &case.params,
                    null(),
                    0,
                    null(),
                ),
                ffi::pkv_paged_attention_prefill(
                    o,
                    os,
                    q,
                    qs,
                    case.cache.ptr(),
                    &case.geom,
                    0,
                    case.tables.ptr() as *const i32,
                    case.mbps as i32,
                    case.ctx.ptr() as *const i32,
                    qsl.ptr() as *const i32,
                    1,
                    1,
                    &case.params,
                    null(),
                ),
            ]
        }
    };
    let bad = ffi::PKV_ERR_ROW_STRIDE as i32;
    assert_eq!(launch(o, 64, q, 64, &plan), [OK, OK], "dense views");
    assert_eq!(launch(o, 128, q, 68, &plan), [OK, OK], "padded rows");
    assert_eq!(launch(o, 64, q4, 64, &plan), [bad, bad], "misaligned query");
    assert_eq!(launch(o4, 64, q, 64, &plan), [bad, bad], "misaligned out");
    assert_eq!(
        launch(o, 64, q, 66, &plan),
        [bad, bad],
        "query stride off the grid"
    );
    assert_eq!(
        launch(o, 60, q, 64, &plan),
        [bad, bad],
        "out stride below a row"
    );
    assert_eq!(launch(o, 64, q, 0, &plan), [bad, bad], "zero query stride");
    let bad_plan = ffi::PKV_ERR_PLAN as i32;
    for wrong in [
        ffi::pkv_decode_plan {
            num_heads: 2,
            ..plan
        },
        ffi::pkv_decode_plan {
            head_dim: 128,
            ..plan
        },
        ffi::pkv_decode_plan {
            num_seqs_capacity: 0,
            ..plan
        },
        ffi::pkv_decode_plan {
            num_splits: 0,
            ..plan
        },
        ffi::pkv_decode_plan {
            num_splits: ffi::PKV_DECODE_MAX_SPLITS as i32 + 1,
            ..plan
        },
    ] {
        assert_eq!(launch(o, 64, q, 64, &wrong)[0], bad_plan, "{wrong:?}");
    }
    // One split over a 20000-token capacity is a valid plan: no body limits a partition.
    let long = ffi::pkv_decode_plan {
        max_context_capacity: 20000,
        ..plan
    };
    assert_eq!(
        launch(o, 64, q, 64, &long)[0],
        OK,
        "single split, long capacity"
    );
}

// ---- the page stride and block sizes in the C ABI ----------------------------------------------

/// Every launcher that takes a geometry refuses a page stride smaller than a block
/// (`PKV_ERR_PAGE_STRIDE`) or off the 16-byte grid (`PKV_ERR_PAGE_ALIGN`), and a block size
/// that is not a power of two in 8..=256 (`PKV_ERR_BLOCK_SIZE`), before touching any pointer;
/// the swap launcher refuses page sizes below the block or off the grid on either side. Each
/// refusal has its own message.
#[test]
fn page_stride_and_block_size_are_validated() {
    let cfg = KvCacheConfig::new(2, 2, 64, 16, 4, KvDtype::F16).expect("cfg");
    let elems = cfg.elems_per_block() as i64;
    let good = geometry(&cfg);
    // Never dereferenced: every call below fails validation first.
    let fake = EmuBuf::zeroed(64).expect("buf");
    let p = fake.ptr();
    let params = ffi::pkv_attn_params {
        num_heads: 2,
        scale: 0.1,
        ..Default::default()
    };
    let plan = single_split_plan();
    let launch_all = |g: &ffi::pkv_cache_geometry| -> [i32; 4] {
        // SAFETY: the geometry is invalid, so each launcher returns before any launch or any
        // access through `p`.
        unsafe {
            let [decode, prefill] = refused_attention(p, g, &plan, &params);
            [
                decode,
                prefill,
                ffi::pkv_reshape_and_cache(p, g, 0, p, p, 128, 128, p as *const i64, 1, null()),
                ffi::pkv_copy_blocks(p, g, p as *const i32, 1, null()),
            ]
        }
    };
    let cases = [
        (elems - 8, ffi::PKV_ERR_PAGE_STRIDE),
        (0, ffi::PKV_ERR_PAGE_STRIDE),
        (-1, ffi::PKV_ERR_PAGE_STRIDE),
        // 4 f16 elements = 8 bytes past the block: pages off the 16-byte grid.
        (elems + 4, ffi::PKV_ERR_PAGE_ALIGN),
        // num_blocks pages of this stride overflow a 64-bit byte count.
        (i64::MAX / 4, ffi::PKV_ERR_PAGE_STRIDE),
    ];
    for (stride, want) in cases {
        let g = ffi::pkv_cache_geometry {
            block_stride: stride,
            ..good
        };
        for (i, s) in launch_all(&g).into_iter().enumerate() {
            assert_eq!(s, want as i32, "launcher {i}, stride {stride}");
        }
    }
    for bs in [0, 4, 12, 24, 512, -16] {
        let g = ffi::pkv_cache_geometry {
            block_size: bs,
            ..good
        };
        for (i, s) in launch_all(&g).into_iter().enumerate() {
            assert_eq!(
                s,
                ffi::PKV_ERR_BLOCK_SIZE as i32,
                "launcher {i}, block size {bs}"
            );
        }
    }
    assert!(cuda_emu::status_string(ffi::PKV_ERR_PAGE_STRIDE as i32).contains("page stride"));
    assert!(cuda_emu::status_string(ffi::PKV_ERR_PAGE_ALIGN as i32).contains("16 bytes"));
    assert!(cuda_emu::status_string(ffi::PKV_ERR_BLOCK_SIZE as i32).contains("8 to 256"));

    let pair = [0i64, 0];
    let swap = |dst_page: usize, src_page: usize, block: usize| {
        // SAFETY: the sizes are invalid, so the launcher returns before any copy.
        unsafe {
            ffi::pkv_swap_blocks(p, dst_page, p, src_page, block, pair.as_ptr(), 1, 1, null())
        }
    };
    assert_eq!(swap(4096, 4080, 4096), ffi::PKV_ERR_PAGE_STRIDE as i32);
    assert_eq!(swap(4080, 4096, 4096), ffi::PKV_ERR_PAGE_STRIDE as i32);
    assert_eq!(swap(4104, 4096, 4096), ffi::PKV_ERR_PAGE_ALIGN as i32);
    assert_eq!(swap(4096, 4104, 4096), ffi::PKV_ERR_PAGE_ALIGN as i32);
    assert_eq!(swap(4096, 4096, 0), ffi::PKV_ERR_INVALID_ARG as i32);
}

/// A negative block index anywhere in the pair list is an argument error that queues no copy:
/// the pairs before it are not copied either (the header's promise for PKV_ERR_* argument
/// errors, on which a caller may free or reuse the buffers at once).
#[test]
fn swap_refuses_a_negative_index_before_any_copy() {
    let src = buf(&[0xAB; 64]);
    let dst = buf(&[0; 64]);
    for pairs in [[0i64, 0, -1, 1], [0, 0, 1, -1], [-1, 0, 0, 1]] {
        // SAFETY: both buffers hold 4 pages of 16 bytes, every non-negative index is < 4, and
        // the launcher refuses the list before reading a page.
        let s = unsafe {
            ffi::pkv_swap_blocks(
                dst.ptr(),
                16,
                src.ptr(),
                16,
                16,
                pairs.as_ptr(),
                2,
                1,
                null(),
            )
        };
        assert_eq!(s, ffi::PKV_ERR_INVALID_ARG as i32, "{pairs:?}");
        assert!(
            dst.as_slice::<u8>().iter().all(|&b| b == 0),
            "{pairs:?}: a copy was queued"
        );
    }
}

/// A block table row long enough that `max_blocks_per_seq * block_size` passes 2^31 (2^23 + 1
/// entries of 256-token blocks): the kernels clamp context lengths to what the row can name,
/// and that clamp must not wrap to a negative number (which silently turned every sequence
/// into an empty one, all-zero output).
#[test]
fn table_capacity_beyond_i32_does_not_wrap() {
    let mut rng = SmallRng::seed_from_u64(21);
    let (d, bs, hkv, group) = (64, 256, 1, 4);
    let mbps = (1usize << 23) + 1;
    let ctx = [300usize, 40];
    let mut b = make_batch(&mut rng, 1, hkv, d, bs, KvDtype::F32, Page::Pad(1), &ctx);
    // Re-lay the same live entries in rows of mbps entries (the rest: garbage, never read).
    let mut tables = vec![-3i32; ctx.len() * mbps];
    for (s, &c) in ctx.iter().enumerate() {
        let n = c.div_ceil(bs);
        tables[s * mbps..s * mbps + n].copy_from_slice(&b.tables[s * b.mbps..s * b.mbps + n]);
    }
    b.tables = tables;
    b.mbps = mbps;
    let host = random_cache::<f32>(&mut rng, b.cfg);
    let nh = hkv * group;
    let params = attn_params(nh, d, Features::PLAIN, &[]);
    let query = random_vec::<f32>(&mut rng, ctx.len() * nh * d);
    let want = cpu_decode(&b, &host, 0, &query, &params);
    let mut case = AttnCase::new(&b, &host, &query, &params);
    for mode in [ffi::PKV_DECODE_SINGLE, ffi::PKV_DECODE_SPLIT] {
        let (s, got) = case.decode::<f32>(0, mode);
        expect_ok("decode, huge table", s);
        assert_close(&format!("decode mode {mode}, huge table"), &got, &want, d);
    }
    let seqs_q_ctx = [(7usize, 300usize), (40, 40)];
    let qsl = query_start_loc(&seqs_q_ctx);
    let pq = random_vec::<f32>(&mut rng, 47 * nh * d);
    let want = cpu_prefill(&b, &host, 0, &pq, &qsl, &params);
    let pcase = AttnCase::new(&b, &host, &pq, &params);
    let (s, got) = pcase.prefill::<f32>(0, &qsl);
    expect_ok("prefill, huge table", s);
    assert_close("prefill, huge table", &got, &want, d);

    // A context of 2^31 - 1 tokens under a 64-token window: only the window's tokens are
    // read, all in the row's last block (the others name block 0: the oracle checks every
    // entry up to the context). Its partition length in one split rounds up past i32::MAX:
    // computed in 32 bits it wrapped negative, every split empty, a zero output.
    let c = i32::MAX as usize;
    let mut one = make_batch(&mut rng, 1, hkv, d, bs, KvDtype::F32, Page::Pad(1), &[300]);
    let last = (c - 1) / bs;
    let mut table = vec![0i32; mbps];
    table[last] = one.tables[0];
    one.tables = table;
    one.mbps = mbps;
    one.ctx = vec![i32::MAX];
    let host = random_cache::<f32>(&mut rng, one.cfg);
    let windowed = attn_params(
        nh,
        d,
        Features {
            window: 64,
            ..Features::PLAIN
        },
        &[],
    );
    let query = random_vec::<f32>(&mut rng, nh * d);
    let want = cpu_decode(&one, &host, 0, &query, &windowed);
    assert!(
        want.iter().any(|&x| x != 0.0),
        "the oracle attends the window"
    );
    let mut case = AttnCase::new(&one, &host, &query, &windowed);
    // (Split-K at this capacity needs more than PKV_DECODE_MAX_SPLITS splits: its plan is
    // refused; Auto's splits are few.)
    for mode in [ffi::PKV_DECODE_SINGLE, ffi::PKV_DECODE_AUTO] {
        let (s, got) = case.decode::<f32>(0, mode);
        expect_ok("decode, context 2^31 - 1", s);
        assert_close(
            &format!("decode mode {mode}, context 2^31 - 1"),
            &got,
            &want,
            d,
        );
    }

    // Prefill of the last token under windows of 40 and 64 keys: the key tiles end past
    // 2^31, and key positions computed as kt + x wrapped negative, passed `<= klast` and read
    // before the table row (an illegal address on the guarded row here), in the f32 kernel
    // and every f16 / bf16 tiling. The windows' keys are those of the row's last block.
    let qsl = [0, 1];
    let mut one16 = make_batch(&mut rng, 1, hkv, d, bs, KvDtype::Bf16, Page::Pad(1), &[300]);
    one16.tables = one.tables.clone();
    one16.mbps = mbps;
    one16.ctx = vec![i32::MAX];
    let host16 = random_cache::<bf16>(&mut rng, one16.cfg);
    let q16 = random_vec::<bf16>(&mut rng, nh * d);
    for window in [40, 64] {
        let windowed = attn_params(
            nh,
            d,
            Features {
                window,
                ..Features::PLAIN
            },
            &[],
        );
        let want = cpu_prefill(&one, &host, 0, &query, &qsl, &windowed);
        let case = AttnCase::new(&one, &host, &query, &windowed);
        let (s, got) = case.prefill::<f32>(0, &qsl);
        let what = format!("prefill f32 window {window}, context 2^31 - 1");
        expect_ok(&what, s);
        assert_close(&what, &got, &want, d);

        let want = cpu_prefill(&one16, &host16, 0, &q16, &qsl, &windowed);
        let case = AttnCase::new(&one16, &host16, &q16, &windowed);
        for tiling in PREFILL_TILINGS {
            let (s, got) = case.prefill_tiled::<bf16>(0, &qsl, tiling);
            let what = format!("prefill bf16 tiling {tiling} window {window}, context 2^31 - 1");
            expect_ok(&what, s);
            assert_close(&what, &got, &want, d);
        }
    }

    // Decode of the same context in bf16 through both 16-bit bodies, the tensor-core one (a
    // group of 4) and the one-head CUDA-core one (MHA): their 16-token tiles put the
    // context's last 8-token half at 2^31 - 8, whose end (t0 + 8) passed i32::MAX and wrapped
    // on the GPU (and here, under -fwrapv), masking the last 7 tokens, the query's own
    // included (the f32 body's 8-token tiles above likewise).
    for heads in [nh, hkv] {
        let windowed = attn_params(
            heads,
            d,
            Features {
                window: 64,
                ..Features::PLAIN
            },
            &[],
        );
        let q = random_vec::<bf16>(&mut rng, heads * d);
        let want = cpu_decode(&one16, &host16, 0, &q, &windowed);
        let mut case = AttnCase::new(&one16, &host16, &q, &windowed);
        for mode in [ffi::PKV_DECODE_SINGLE, ffi::PKV_DECODE_AUTO] {
            let (s, got) = case.decode::<bf16>(0, mode);
            let what = format!("decode bf16, {heads} heads, mode {mode}, context 2^31 - 1");
            expect_ok(&what, s);
            assert_close(&what, &got, &want, d);
        }
    }
}

/// Launch flags other than `PKV_LAUNCH_PROGRAMMATIC` are refused by both attention launchers
/// (`PKV_ERR_INVALID_ARG`) before any pointer is touched, 2 (the removed decode L2 prefetch)
/// included; the flag itself passes validation (what the emulated launches then compute with
/// it is checked in cuda_emu_raw's fixed-plan replay, which alternates it).
#[test]
fn unknown_launch_flags_are_refused() {
    let cfg = KvCacheConfig::new(2, 2, 64, 16, 4, KvDtype::F16).expect("cfg");
    let g = geometry(&cfg);
    // Never dereferenced: every call below fails validation first.
    let fake = EmuBuf::zeroed(64).expect("buf");
    let plan = single_split_plan();
    for flags in [2, 3, 4, 5, 7, -1, i32::MIN] {
        let params = ffi::pkv_attn_params {
            num_heads: 2,
            scale: 0.1,
            launch_flags: flags,
            ..Default::default()
        };
        // SAFETY: the flags are invalid for the prefill launcher, so it returns before any
        // launch or any access through the fake pointer.
        let prefill = unsafe { refused_prefill(fake.ptr(), &g, &params) };
        assert_eq!(
            prefill,
            ffi::PKV_ERR_INVALID_ARG as i32,
            "prefill, flags {flags:#x}"
        );
        // SAFETY: likewise for the decode launcher.
        let got = unsafe { refused_attention(fake.ptr(), &g, &plan, &params) };
        assert_eq!(
            got,
            [ffi::PKV_ERR_INVALID_ARG as i32; 2],
            "launch flags {flags:#x}"
        );
    }
}

/// A one-split plan for 2 heads of 2 KV heads at head dim 64, one sequence of up to 16 tokens.
fn single_split_plan() -> ffi::pkv_decode_plan {
    ffi::pkv_decode_plan {
        mode: ffi::PKV_DECODE_SINGLE as i32,
        num_seqs_capacity: 1,
        num_heads: 2,
        num_kv_heads: 2,
        head_dim: 64,
        max_context_capacity: 16,
        num_splits: 1,
        workspace_bytes: 0,
        counter_bytes: 0,
    }
}

/// A decode and a prefill launch with `g`, `plan` and `params` and the pointer `p` for every
/// buffer; their statuses.
///
/// # Safety
/// Some argument must be invalid, so that both launchers return before any launch or any
/// access through `p`.
unsafe fn refused_attention(
    p: *mut c_void,
    g: &ffi::pkv_cache_geometry,
    plan: &ffi::pkv_decode_plan,
    params: &ffi::pkv_attn_params,
) -> [i32; 2] {
    // SAFETY: the caller's contract: both return before touching any pointer.
    unsafe {
        [
            ffi::pkv_paged_attention_decode(
                p,
                128,
                p,
                128,
                p,
                g,
                0,
                p as *const i32,
                1,
                p as *const i32,
                1,
                plan,
                params,
                null(),
                0,
                null(),
            ),
            refused_prefill(p, g, params),
        ]
    }
}

/// A prefill launch with `g` and `params` and the pointer `p` for every buffer; its status.
///
/// # Safety
/// Some argument must be invalid, so that the launcher returns before any launch or any
/// access through `p`.
unsafe fn refused_prefill(
    p: *mut c_void,
    g: &ffi::pkv_cache_geometry,
    params: &ffi::pkv_attn_params,
) -> i32 {
    // SAFETY: the caller's contract: it returns before touching any pointer.
    unsafe {
        ffi::pkv_paged_attention_prefill(
            p,
            128,
            p,
            128,
            p,
            g,
            0,
            p as *const i32,
            1,
            p as *const i32,
            p as *const i32,
            1,
            1,
            params,
            null(),
        )
    }
}

/// A NaN key poisons the prefill rows that see it, on the kernel and in the CPU oracle alike
/// (the kernels' `safe_exp` zeroes only masked `-inf` logits), also when it is the only
/// visible key of its block: the oracle dropped such a block as if it were all masked and
/// returned a finite row where the kernel returned NaN.
#[test]
fn a_nan_key_alone_in_its_block_poisons_prefill_rows_on_both_sides() {
    fn run<T: Elem>() {
        let (d, bs) = (64, 8);
        let cfg = KvCacheConfig::new(1, 1, d, bs, 2, T::DTYPE).expect("config");
        let mut rng = SmallRng::seed_from_u64(7);
        let mut host = random_cache::<T>(&mut rng, cfg);
        // Token 8 (block 1, token 0): its key is NaN.
        let off = cfg.offset(1, 0, pagedkv::kv::KvPart::Key, 0, 0);
        host.view_mut::<T>().expect("view").data_mut()[off..off + d].fill(T::from_f32(f32::NAN));
        let b = Batch {
            cfg,
            tables: vec![0, 1],
            mbps: 2,
            ctx: vec![9],
        };
        let params = AttnParams::new(1, d);
        // Prefill of tokens 7 and 8: token 7 does not see the NaN key, token 8 does.
        let query = random_vec::<T>(&mut rng, 2 * d);
        let case = AttnCase::new(&b, &host, &query, &params);
        let qsl = [0, 2];
        let (s, got) = case.prefill::<T>(0, &qsl);
        expect_ok("prefill", s);
        let cpu = cpu_prefill(&b, &host, 0, &query, &qsl, &params);
        for (what, out) in [("kernel", &got), ("CPU", &cpu)] {
            let dt = T::DTYPE;
            let row0 = out[..d].iter().all(|x| x.to_f32().is_finite());
            let row1 = out[d..].iter().all(|x| x.to_f32().is_nan());
            assert!(row0, "{dt} {what}: row 0 not finite");
            assert!(row1, "{dt} {what}: row 1 not NaN");
        }
    }
    run::<f32>();
    run::<f16>();
    run::<bf16>();
}

/// A NaN key poisons every decode row that sees it, on each body (the CUDA-core one: f32, f16 /
/// bf16 MHA; the tensor-core GQA one: 8- and 16-head blocks) and partitioning (one split;
/// fixed splits, so that the NaN key is alone in its split, its warp's tiles or the whole
/// context), as in the CPU oracle: a freed arena page is poisoned with 0xFF (NaN) so that a
/// kernel reading a stale page shows it. The decode kernels gave 0 (`l > 0 ? o / l : 0` with a
/// NaN sum) or dropped a warp or split whose max was -inf (`fmaxf` skips NaN) though its sum
/// was NaN, a finite wrong row. The other KV head and a clean sequence still match the oracle,
/// a sequence with no context still gives zeros, and a NaN key just outside the window is not
/// seen.
#[test]
fn a_nan_key_poisons_every_decode_row_that_sees_it() {
    fn run<T: Elem>(d: usize, group: usize) {
        let (bs, hkv, layer) = (16, 2, 0);
        let nh = hkv * group;
        let mut rng = SmallRng::seed_from_u64(31 + (d * group) as u64);
        // (context, NaN key position, window): the NaN key alone in the context; the query's
        // own key, alone in its tile (with 16-token tiles warp 1's only one) and, at 7 splits
        // (partitions of 16), in its split; among others in warp 0; alone in the last split of
        // 7; mid-context; the first key; just inside and just outside a window.
        let cases = [
            (1, 0, 0),
            (17, 16, 0),
            (17, 3, 0),
            (97, 96, 0),
            (97, 40, 0),
            (100, 0, 0),
            (97, 77, 20),
            (97, 76, 20),
        ];
        for (c, pos, window) in cases {
            let ctx = [c, c, 0];
            let b = make_batch(&mut rng, 1, hkv, d, bs, T::DTYPE, Page::Dense, &ctx);
            let mut host = random_cache::<T>(&mut rng, b.cfg);
            let block = b.tables[pos / bs] as usize; // sequence 0's table row
            let off = b
                .cfg
                .offset(block, layer, pagedkv::kv::KvPart::Key, pos % bs, 0);
            host.view_mut::<T>().expect("view").data_mut()[off..off + d]
                .fill(T::from_f32(f32::NAN));
            let mut params = AttnParams::new(nh, d);
            params.sliding_window = window;
            let query = random_vec::<T>(&mut rng, ctx.len() * nh * d);
            let want = cpu_decode(&b, &host, layer, &query, &params);
            let seen = window == 0 || c - 1 - pos < window;
            // The oracle: NaN exactly in sequence 0's rows of KV head 0 when it sees the key,
            // zeros for the empty sequence.
            for (i, w) in want.iter().enumerate() {
                let (seq, head) = (i / (nh * d), i / d % nh);
                let x = w.to_f32();
                let nan = seq == 0 && head < group && seen;
                assert_eq!(x.is_nan(), nan, "oracle element {i} ctx {c} pos {pos}: {x}");
                if seq == 2 {
                    assert_eq!(x.to_bits(), 0, "oracle: empty sequence not zero");
                }
            }
            let case = AttnCase::new(&b, &host, &query, &params);
            let mut plans = vec![case.plan(ffi::PKV_DECODE_SINGLE).expect("plan")];
            plans.push(case.plan(ffi::PKV_DECODE_SPLIT).expect("plan"));
            for n in [2, 7] {
                let p = DecodePlan::new(DecodeMode::Splits(n), 3, nh, hkv, d, 100, 0);
                plans.push(*p.expect("fixed plan").as_ffi());
            }
            let (atol, rtol) = T::TOL;
            for plan in &plans {
                let (s, got) = case.decode_with::<T>(layer, plan);
                let what = format!(
                    "{} d{d} g{group} ctx {c} NaN key {pos} window {window} splits {}",
                    T::DTYPE,
                    plan.num_splits
                );
                expect_ok(&what, s);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let (g, w) = (g.to_f32(), w.to_f32());
                    let (row, dim) = (i / d, i % d);
                    if w.is_nan() {
                        assert!(g.is_nan(), "{what}: row {row} dim {dim}: {g}, not NaN");
                    } else if w == 0.0 && row >= 2 * nh {
                        assert_eq!(g.to_bits(), 0, "{what}: empty row {row} dim {dim}: {g}");
                    } else {
                        assert!(
                            (g - w).abs() <= atol + rtol * w.abs(),
                            "{what}: row {row} dim {dim}: kernel {g} vs cpu {w}"
                        );
                    }
                }
            }
        }
    }
    run::<f32>(64, 1); // CUDA cores, one head
    run::<f32>(80, 4); // CUDA cores, four heads
    run::<f16>(128, 1); // CUDA cores, MHA
    run::<bf16>(64, 1);
    run::<bf16>(128, 4); // tensor cores, 8-head blocks
    run::<f16>(96, 2);
    run::<bf16>(64, 12); // tensor cores, a 16-head block
}

/// A row whose every visible score is -inf (an infinite key against a query of the opposite
/// sign) attends to nothing and is zero, as a sequence with no context is, in the oracle and
/// on each decode body, partitioning and the prefill kernels: the oracle divided the empty sum
/// and returned NaN where every kernel returned zeros. A -inf score among finite ones only
/// takes no weight, on both sides.
#[test]
fn rows_whose_every_visible_score_is_minus_infinity_are_zero() {
    fn run<T: Elem>(d: usize, group: usize) {
        let (bs, hkv, layer) = (16, 2, 0);
        let nh = hkv * group;
        let mut rng = SmallRng::seed_from_u64(57 + (d * group) as u64);
        // KV head 0's key: sequence 0's only one is infinite; sequence 1's infinite one is one
        // of 17. KV head 1 sees finite keys only.
        let ctx = [1, 17];
        let b = make_batch(&mut rng, 1, hkv, d, bs, T::DTYPE, Page::Dense, &ctx);
        let mut host = random_cache::<T>(&mut rng, b.cfg);
        for (seq, pos) in [(0, 0), (1, 3)] {
            let block = b.tables[seq * b.mbps + pos / bs] as usize;
            let off = b
                .cfg
                .offset(block, layer, pagedkv::kv::KvPart::Key, pos % bs, 0);
            host.view_mut::<T>().expect("view").data_mut()[off..off + d]
                .fill(T::from_f32(f32::INFINITY));
        }
        // Negative queries: every score against the infinite key is -inf.
        let query: Vec<T> = random_vec::<T>(&mut rng, ctx.len() * nh * d)
            .iter()
            .map(|x| T::from_f32(-x.to_f32().abs() - 0.25))
            .collect();
        let params = AttnParams::new(nh, d);
        let (atol, rtol) = T::TOL;
        let check = |what: &str, got: &[T], want: &[T]| {
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                let (g, w) = (g.to_f32(), w.to_f32());
                if i < group * d {
                    assert_eq!(w.to_bits(), 0, "{what}: oracle element {i}: {w}");
                    assert_eq!(g.to_bits(), 0, "{what}: kernel element {i}: {g}");
                } else {
                    assert!(w.is_finite(), "{what}: oracle element {i}: {w}");
                    let ok = (g - w).abs() <= atol + rtol * w.abs();
                    assert!(ok, "{what}: element {i}: kernel {g} vs cpu {w}");
                }
            }
        };
        let case = AttnCase::new(&b, &host, &query, &params);
        let want = cpu_decode(&b, &host, layer, &query, &params);
        let mut plans = vec![case.plan(ffi::PKV_DECODE_SINGLE).expect("plan")];
        plans.push(case.plan(ffi::PKV_DECODE_SPLIT).expect("plan"));
        for n in [2, 7] {
            let p = DecodePlan::new(DecodeMode::Splits(n), 2, nh, hkv, d, 32, 0);
            plans.push(*p.expect("fixed plan").as_ffi());
        }
        for plan in &plans {
            let what = format!(
                "decode {} d{d} g{group} splits {}",
                T::DTYPE,
                plan.num_splits
            );
            let (s, got) = case.decode_with::<T>(layer, plan);
            expect_ok(&what, s);
            check(&what, &got, &want);
        }
        // Prefill: one query token per sequence (its last position).
        let qsl = [0, 1, 2];
        let want = cpu_prefill(&b, &host, layer, &query, &qsl, &params);
        let (s, got) = case.prefill::<T>(layer, &qsl);
        let what = format!("prefill {} d{d} g{group}", T::DTYPE);
        expect_ok(&what, s);
        check(&what, &got, &want);
    }
    run::<f32>(64, 1);
    run::<f16>(128, 1);
    run::<bf16>(128, 4); // tensor cores
    run::<f16>(64, 8);
}

/// A key that takes no weight contributes nothing whatever its value (crate::attn): an
/// infinite value (an f16 activation past 65504) at a token a row does not see (a later token
/// of its prefill chunk, a key before its window) or at a key whose score is -inf leaves the
/// row as the oracle has it. The kernels multiply every key of a loaded tile by its weight,
/// `0 * inf = NaN`: the prefill kernels poison rows before the token (which ones depends on
/// the tiling) and every decode body the head that scores it -inf.
#[test]
#[ignore = "kernels: a zero weight times a non-finite value is NaN (see the doc comment)"]
fn a_key_of_weight_zero_with_an_infinite_value_leaves_the_row_as_the_oracle_has_it() {
    fn same_finiteness<T: Elem>(what: &str, got: &[T], want: &[T], row: usize) {
        for (r, (g, w)) in got.chunks(row).zip(want.chunks(row)).enumerate() {
            let g = g.iter().all(|x| x.to_f32().is_finite());
            let w = w.iter().all(|x| x.to_f32().is_finite());
            assert_eq!(
                g, w,
                "{what}: row {r}: kernel finite {g}, oracle finite {w}"
            );
        }
    }
    fn run<T: Elem>(d: usize, group: usize) {
        let (bs, layer) = (16, 0);
        let mut rng = SmallRng::seed_from_u64(93 + (d * group) as u64);
        // Prefill of a whole 40-token context whose token 30 has an infinite value.
        let ctx = [40];
        let b = make_batch(&mut rng, 1, 1, d, bs, T::DTYPE, Page::Dense, &ctx);
        let mut host = random_cache::<T>(&mut rng, b.cfg);
        let off = b
            .cfg
            .offset(b.tables[1] as usize, layer, KvPart::Value, 30 % bs, 0);
        host.view_mut::<T>().expect("view").data_mut()[off..off + d]
            .fill(T::from_f32(f32::INFINITY));
        let query: Vec<T> = random_vec::<T>(&mut rng, 40 * group * d);
        let qsl = [0, 40];
        let tilings: &[u32] = if T::DTYPE == KvDtype::F32 {
            &[ffi::PKV_PREFILL_TILING_AUTO]
        } else {
            &PREFILL_TILINGS
        };
        for window in [0, 4] {
            let mut params = AttnParams::new(group, d);
            params.sliding_window = window;
            let want = cpu_prefill(&b, &host, layer, &query, &qsl, &params);
            let case = AttnCase::new(&b, &host, &query, &params);
            for &tiling in tilings {
                let (s, got) = case.prefill_tiled::<T>(layer, &qsl, tiling);
                let what = format!(
                    "prefill {} d{d} g{group} window {window} tiling {tiling}",
                    T::DTYPE
                );
                expect_ok(&what, s);
                same_finiteness(&what, &got, &want, d);
            }
        }
        // Decode: token 3 of 17 has an infinite key and value; KV head 0's queries are
        // negative (score -inf: no weight).
        let (hkv, nh) = (2, 2 * group);
        let ctx = [17];
        let b = make_batch(&mut rng, 1, hkv, d, bs, T::DTYPE, Page::Dense, &ctx);
        let mut host = random_cache::<T>(&mut rng, b.cfg);
        for part in [KvPart::Key, KvPart::Value] {
            let off = b.cfg.offset(b.tables[0] as usize, layer, part, 3, 0);
            host.view_mut::<T>().expect("view").data_mut()[off..off + d]
                .fill(T::from_f32(f32::INFINITY));
        }
        let query: Vec<T> = random_vec::<T>(&mut rng, nh * d)
            .iter()
            .map(|x| T::from_f32(-x.to_f32().abs() - 0.25))
            .collect();
        let params = AttnParams::new(nh, d);
        let want = cpu_decode(&b, &host, layer, &query, &params);
        let case = AttnCase::new(&b, &host, &query, &params);
        for mode in [ffi::PKV_DECODE_SINGLE, ffi::PKV_DECODE_SPLIT] {
            let plan = case.plan(mode).expect("plan");
            let (s, got) = case.decode_with::<T>(layer, &plan);
            let what = format!(
                "decode {} d{d} g{group} splits {}",
                T::DTYPE,
                plan.num_splits
            );
            expect_ok(&what, s);
            same_finiteness(&what, &got, &want, d);
        }
    }
    run::<f32>(64, 1);
    run::<f16>(128, 1);
    run::<bf16>(128, 4); // tensor cores
    run::<f16>(64, 8);
}

/// A value whose weight underflows after the walk reached it contributes nothing (crate::attn):
/// token 0 (score 0) has an infinite value, token `bs` (next block) scores 200, so token 0's
/// weight is exp(-200) = 0 and the oracle's rows are finite. The kernels weighted token 0
/// before the larger score and then rescale their running sums by exp(-200) = 0: `inf * 0 =
/// NaN` (the split decode's merge skips a partition of weight 0, and matches when token 0 is
/// alone in its partition). Documented in crate::attn; ignored until the kernels drop a
/// running sum whose rescale factor is 0.
#[test]
#[ignore = "kernels rescale a running sum by an underflowing factor: inf * 0 = NaN (crate::attn)"]
fn a_value_whose_weight_underflows_later_leaves_the_row_as_the_oracle_has_it() {
    fn finite<T: Elem>(x: &[T]) -> bool {
        x.iter().all(|x| x.to_f32().is_finite())
    }
    fn run<T: Elem>(d: usize, group: usize, bs: usize) {
        let layer = 0;
        let mut rng = SmallRng::seed_from_u64(5);
        let ctx = [bs + 1];
        let b = make_batch(&mut rng, 1, 1, d, bs, T::DTYPE, Page::Dense, &ctx);
        let mut host = random_cache::<T>(&mut rng, b.cfg);
        {
            let mut v = host.view_mut::<T>().expect("view");
            let data = v.data_mut();
            for t in 0..ctx[0] {
                let blk = b.tables[t / bs] as usize;
                let ko = b.cfg.offset(blk, layer, KvPart::Key, t % bs, 0);
                let vo = b.cfg.offset(blk, layer, KvPart::Value, t % bs, 0);
                let k = if t == bs { 25.0 } else { 0.0 };
                data[ko..ko + d].fill(T::from_f32(k));
                let v = if t == 0 { f32::INFINITY } else { 0.5 };
                data[vo..vo + d].fill(T::from_f32(v));
            }
        }
        // q . k = 200 against token `bs`, 0 against the others.
        let q = |rows: usize| vec![T::from_f32(8.0 / d as f32); rows * group * d];
        let mut params = AttnParams::new(group, d);
        params.scale = 1.0;
        let query = q(1);
        let want = cpu_decode(&b, &host, layer, &query, &params);
        assert!(finite(&want), "oracle");
        let case = AttnCase::new(&b, &host, &query, &params);
        for mode in [ffi::PKV_DECODE_SINGLE, ffi::PKV_DECODE_SPLIT] {
            let plan = case.plan(mode).expect("plan");
            let (s, got) = case.decode_with::<T>(layer, &plan);
            let what = format!("decode {} d{d} g{group} bs{bs} mode {mode}", T::DTYPE);
            expect_ok(&what, s);
            assert!(finite(&got), "{what}: {:?}", got[0].to_f32());
        }
        let query = q(ctx[0]);
        let qsl = [0, ctx[0] as i32];
        let want = cpu_prefill(&b, &host, layer, &query, &qsl, &params);
        assert!(finite(&want), "oracle");
        let case = AttnCase::new(&b, &host, &query, &params);
        let (s, got) = case.prefill_tiled::<T>(layer, &qsl, ffi::PKV_PREFILL_TILING_AUTO);
        let what = format!("prefill {} d{d} g{group} bs{bs}", T::DTYPE);
        expect_ok(&what, s);
        assert!(finite(&got), "{what}");
    }
    for bs in [8, 16] {
        run::<f32>(64, 1, bs);
        run::<f16>(64, 1, bs);
        run::<bf16>(128, 4, bs);
    }
}

/// An infinite scale or soft-cap is refused (`PKV_ERR_INVALID_ARG`) by both attention
/// launchers, as the Rust API and the CPU oracle refuse it (`BadParam`): the launchers refused
/// only NaN, and a soft-cap of +inf (a cap "too large to matter") computed inf * tanh(s / inf)
/// = inf * 0 = NaN for every logit, an all-NaN output with status OK.
#[test]
fn infinite_scale_or_softcap_is_refused() {
    let mut rng = SmallRng::seed_from_u64(41);
    let b = make_batch(&mut rng, 1, 1, 64, 16, KvDtype::F32, Page::Dense, &[20]);
    let host = random_cache::<f32>(&mut rng, b.cfg);
    let params = attn_params(1, 64, Features::PLAIN, &[]);
    let query = random_vec::<f32>(&mut rng, 64);
    let bad = ffi::PKV_ERR_INVALID_ARG as i32;
    for (scale, softcap) in [
        (f32::INFINITY, 0.0),
        (f32::NEG_INFINITY, 0.0),
        (0.125, f32::INFINITY),
    ] {
        let mut case = AttnCase::new(&b, &host, &query, &params);
        case.params.scale = scale;
        case.params.softcap = softcap;
        let (status, out) = case.decode::<f32>(0, ffi::PKV_DECODE_SINGLE);
        assert_eq!(
            status,
            bad,
            "decode, scale {scale} softcap {softcap}: NaN outputs {}",
            out.iter().filter(|x| x.is_nan()).count()
        );
        let (status, out) = case.prefill::<f32>(0, &[0, 1]);
        assert_eq!(
            status,
            bad,
            "prefill, scale {scale} softcap {softcap}: NaN outputs {}",
            out.iter().filter(|x| x.is_nan()).count()
        );
    }
}

/// The kernels compute `s = scale * dot(q, k)` (pagedkv.h, crate::attn); the oracle multiplied
/// the query by the scale first, which overflows elsewhere: a large scale times a large query
/// was +inf there (a NaN row) where the kernels' score is finite, and a `q·k` past f32 under a
/// small scale was finite there where the kernels' is +inf (a NaN row). Every key the same, so
/// a finite row is the mean of V; an f32 cache (the values exact), decode in each
/// partitioning and prefill.
#[test]
fn kernels_and_oracle_apply_the_scale_to_the_same_product() {
    let (d, bs, layer) = (64, 16, 0);
    let mut rng = SmallRng::seed_from_u64(93);
    for (qv, kv, scale) in [(1e10f32, 1e-20f32, 1e30f32), (1e19, 1e19, 1e-30)] {
        let ctx = [3usize, 20];
        let b = make_batch(&mut rng, 1, 1, d, bs, KvDtype::F32, Page::Dense, &ctx);
        let mut host = random_cache::<f32>(&mut rng, b.cfg);
        for (s, &c) in ctx.iter().enumerate() {
            for pos in 0..c {
                let block = b.tables[s * b.mbps + pos / bs] as usize;
                let off = b.cfg.offset(block, layer, KvPart::Key, pos % bs, 0);
                host.view_mut::<f32>().expect("view").data_mut()[off..off + d].fill(kv);
            }
        }
        let mut params = AttnParams::new(1, d);
        params.scale = scale;
        let same = |what: &str, got: &[f32], want: &[f32]| {
            for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                let ok = if w.is_nan() {
                    g.is_nan()
                } else {
                    (g - w).abs() <= 2e-5 + 1e-4 * w.abs()
                };
                assert!(ok, "{what}: element {i}: kernel {g} vs oracle {w}");
            }
        };
        let what = format!("q {qv} k {kv} scale {scale}");
        let query = vec![qv; ctx.len() * d];
        let want = cpu_decode(&b, &host, layer, &query, &params);
        let mut case = AttnCase::new(&b, &host, &query, &params);
        for mode in MODES {
            let (s, got) = case.decode::<f32>(layer, mode);
            expect_ok(&what, s);
            same(&format!("{what}: decode mode {mode}"), &got, &want);
        }
        let qsl = [0, 3, 3 + 20];
        let query = vec![qv; 23 * d];
        let want = cpu_prefill(&b, &host, layer, &query, &qsl, &params);
        let case = AttnCase::new(&b, &host, &query, &params);
        let (s, got) = case.prefill::<f32>(layer, &qsl);
        expect_ok(&what, s);
        same(&format!("{what}: prefill"), &got, &want);
    }
}
