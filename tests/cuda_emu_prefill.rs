//! The tensor-core prefill kernel (kernels/prefill_mma.cuh: f16 / bf16) on the CPU emulation
//! (feature `cuda-emu`), against the CPU oracle, where its own structure has edges that the
//! shared grid of tests/cuda_emu.rs (chunks of at most 37 tokens, one key tile) does not reach:
//! several 64-row tiles per sequence (a token's group of heads split across two tiles when the
//! GQA ratio does not divide 64), several key tiles through both shared-memory stages, chunks
//! after cached tokens (the causal diagonal inside a tile, tiles some warps skip), sliding
//! windows shorter and longer than a tile, soft-cap and ALiBi, every head dim (key tiles of 32
//! and Q re-read from shared memory at 256), block sizes 8..256 and padded pages. And that f16 /
//! bf16 prefill does take this kernel (its shared-memory footprint is the launch's), f32 not.
#![cfg(all(feature = "cuda-emu", not(feature = "cuda")))]

#[path = "support/emu_bufs.rs"]
mod emu_bufs;
#[path = "support/kernel_grid.rs"]
mod kernel_grid;

use emu_bufs::*;
use half::{bf16, f16};
use kernel_grid::*;
use pagedkv::cuda_emu::{self, ffi, EmuBuf, EmuElem, Schedule};
use pagedkv::cuda_raw::PrefillTiling;
use pagedkv::error::RawError;
use pagedkv::kv::{AttnParams, KvCacheConfig, KvDtype};
use rand::rngs::SmallRng;
use rand::SeedableRng;

trait Elem: Tol + EmuElem {}
impl<T: Tol + EmuElem> Elem for T {}

/// Thread orders besides the forward one that the tests below also run: a kernel free of
/// shared-memory races gives the same results under each (warp by warp, one warp gets as far
/// ahead of the others as a barrier allows).
const OTHER_ORDERS: [Schedule; 4] = [
    Schedule::Reverse,
    Schedule::Random(7),
    Schedule::WarpByWarp { reverse: false },
    Schedule::WarpByWarp { reverse: true },
];

/// Runs the prefill launcher (the tiled entry, with `tiling`) on guarded copies of
/// the inputs: the query rows (dense in `query`, `[tokens][heads * d]`) placed `qs` elements
/// apart with NaN between them (a fused-QKV-shaped view when `qs` is larger than a row), the
/// output rows `os` elements apart in a buffer poisoned with NaN. Returns the status and the
/// output rows, dense; panics if anything between the output rows was written.
#[allow(clippy::too_many_arguments)]
fn launch<T: Elem>(
    b: &Batch,
    cache_bytes: &[u8],
    layer: usize,
    query: &[T],
    (qs, os): (usize, usize),
    qsl: &[i32],
    params: &AttnParams<'_>,
    tiling: i32,
) -> (i32, Vec<T>) {
    let slopes = params.alibi_slopes.map(buf::<f32>);
    let raw = ffi::pkv_attn_params {
        num_heads: params.num_heads as i32,
        scale: params.scale,
        softcap: params.softcap,
        sliding_window: params.sliding_window as i32,
        alibi_slopes: slopes
            .as_ref()
            .map_or(std::ptr::null(), |s| s.ptr() as *const f32),
        // The wgmma tilings as programmatic dependent launches, the others plain: the flag
        // must pass validation and change nothing.
        launch_flags: if tiling >= ffi::PKV_PREFILL_TILING_WGMMA as i32 {
            ffi::PKV_LAUNCH_PROGRAMMATIC as i32
        } else {
            0
        },
    };
    let row = params.num_heads * b.cfg.head_dim();
    let tokens = query.len() / row.max(1);
    let mut strided = vec![T::from_f32(f32::NAN); tokens * qs];
    for t in 0..tokens {
        strided[t * qs..t * qs + row].copy_from_slice(&query[t * row..(t + 1) * row]);
    }
    let geom = geometry(&b.cfg);
    let (cache, q, tables, ctx, qsl_buf) = (
        buf(cache_bytes),
        buf(&strided),
        buf(&b.tables),
        buf(&b.ctx),
        buf(qsl),
    );
    let mut out = EmuBuf::zeroed(tokens * os * std::mem::size_of::<T>()).expect("allocation");
    out.as_mut_slice::<u8>().fill(0xff);
    let max_q = qsl.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
    // SAFETY: every pointer is a live guarded buffer of the shape pagedkv.h documents (cache:
    // the whole cache; query/out: `tokens` rows of `row` elements `qs` / `os` apart; tables:
    // [num_seqs][mbps]; ctx: [num_seqs]; query_start_loc: [num_seqs + 1] with every query
    // length <= max_q); the emulated launch is synchronous, so the buffers outlive every access.
    let s = unsafe {
        ffi::pkv_paged_attention_prefill_tiled(
            out.ptr(),
            os as i64,
            q.ptr(),
            qs as i64,
            cache.ptr(),
            &geom,
            layer as i32,
            tables.ptr() as *const i32,
            b.mbps as i32,
            ctx.ptr() as *const i32,
            qsl_buf.ptr() as *const i32,
            b.ctx.len() as i32,
            max_q,
            &raw,
            tiling,
            std::ptr::null_mut(),
        )
    };
    let all = out.as_slice::<T>();
    let mut dense = Vec::with_capacity(tokens * row);
    for t in 0..tokens {
        dense.extend_from_slice(&all[t * os..t * os + row]);
        assert!(
            all[t * os + row..(t + 1) * os]
                .iter()
                .all(|x| x.to_f32().is_nan()),
            "prefill wrote between output rows (token {t})"
        );
    }
    (s, dense)
}

/// One case: sequences given as (query tokens, context) pairs over a fresh random cache of 2
/// KV heads (2 layers, layer 1 read), checked against the oracle.
#[allow(clippy::too_many_arguments)]
fn check<T: Elem>(
    rng: &mut SmallRng,
    d: usize,
    group: usize,
    bs: usize,
    page: Page,
    seqs_q_ctx: &[(usize, usize)],
    f: Features,
) {
    check_tilings::<T>(
        rng,
        d,
        group,
        bs,
        page,
        seqs_q_ctx,
        f,
        None,
        &PREFILL_TILINGS,
    );
}

/// As `check`, for the given tilings, with the query read from a fused-QKV-shaped view
/// (`strides` = (query token stride, out token stride) in elements; `None`: dense).
#[allow(clippy::too_many_arguments)]
fn check_tilings<T: Elem>(
    rng: &mut SmallRng,
    d: usize,
    group: usize,
    bs: usize,
    page: Page,
    seqs_q_ctx: &[(usize, usize)],
    f: Features,
    strides: Option<(usize, usize)>,
    tilings: &[u32],
) {
    let (layers, layer, hkv) = (2, 1, 2);
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
    let strides = strides.unwrap_or((nh * d, nh * d));
    for &tiling in tilings {
        let (s, got) = launch(
            &b,
            host.as_bytes(),
            layer,
            &query,
            strides,
            &qsl,
            &params,
            tiling as i32,
        );
        let what = format!(
            "prefill {} d{d} g{group} bs{bs} {page:?} {f:?} q/ctx {seqs_q_ctx:?} strides \
             {strides:?} tiling {tiling}",
            T::DTYPE
        );
        assert_eq!(
            s,
            ffi::PKV_OK as i32,
            "{what}: status {s} ({}), fault {:?}",
            cuda_emu::status_string(s),
            cuda_emu::last_fault()
        );
        assert_close(&what, &got, &want, d);
    }
}

/// Several row tiles and key tiles per sequence, at every head dim and both tilings, for GQA
/// ratios 1, 3 (a token's heads straddle row tiles), 4 and 8; a chunk after cached tokens whose
/// diagonal falls inside a key tile; a single-token chunk at position 64 or 128, the first key
/// of a tile (which that row's warp must not skip); a chunk of exactly one row tile (64 rows
/// at ratio 4, 128 at 8); MHA's 140 rows end in a tile whose only rows are warp 0's first
/// m-tile. Block sizes, pages and the logit features cycle with the cells.
fn tiles_grid<T: Elem>(seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut variant = 0;
    for d in HEAD_DIMS {
        for group in [1, 3, 4, 8] {
            let bs = BLOCK_SIZES[variant % BLOCK_SIZES.len()];
            let page = PAGES[(variant / 2) % PAGES.len()];
            let f = features(variant, bs);
            let seqs: &[(usize, usize)] = match group {
                1 => &[(140, 140), (21, 150), (1, 129), (64, 64)],
                3 => &[(30, 30), (25, 140), (1, 65)],
                // (2, 390): 4 key tiles of two warpgroups' 128 (7 of 64), both stages twice.
                _ => &[(20, 20), (17, 131), (1, 129), (16, 80), (2, 390)],
            };
            check::<T>(&mut rng, d, group, bs, page, seqs, f);
            variant += 1;
        }
    }
}

#[test]
fn tiles_grid_bf16() {
    tiles_grid::<bf16>(31);
}

#[test]
fn tiles_grid_f16() {
    tiles_grid::<f16>(32);
}

/// Sliding windows of 1 token, shorter than a key tile, exactly one tile, one past it and
/// longer than the context, each with and without soft-cap and ALiBi, on chunks after cached
/// tokens (the windowed first tile starts mid-tile, so whole tiles fall before some warps'
/// windows), at head dims 128 (tiles of 64 keys) and 256 (tiles of 32).
#[test]
fn windows_softcap_alibi() {
    let mut rng = SmallRng::seed_from_u64(33);
    for (i, window) in [1usize, 5, 32, 64, 65, 400].into_iter().enumerate() {
        for (alibi, softcap) in [(false, 0.0), (true, 5.0)] {
            let f = Features {
                alibi,
                window,
                softcap,
            };
            let bs = [8, 16, 32, 64, 128, 256][i];
            check::<bf16>(
                &mut rng,
                128,
                4,
                bs,
                Page::Pad(1),
                &[(40, 300), (9, 129)],
                f,
            );
            check::<f16>(&mut rng, 256, 2, bs, Page::Dense, &[(23, 200), (1, 77)], f);
        }
    }
    // The one shape where a warp's first row sees exactly the last key of an earlier tile
    // through its window (so skipping that tile would drop a visible key): head dim 256 (tiles
    // of 32 keys from 0), MHA, window 40, a chunk of 40 at position 38: warp 2's first row is
    // 70, whose window starts at key 31, the last of tile 0.
    let f = Features {
        window: 40,
        ..Features::PLAIN
    };
    check::<f16>(&mut rng, 256, 1, 16, Page::Dense, &[(40, 78)], f);
    // Its twin at 32 rows per warp (head dim 128: tiles of 64 keys from 0): a chunk of 70 at
    // position 38, window 40: warp 2's first row is 102, whose window starts at key 63, the
    // last of tile 0.
    check::<bf16>(&mut rng, 128, 1, 16, Page::Dense, &[(70, 108)], f);
}

/// Query rows read from a fused-QKV-shaped view (token stride: the query heads, the K and V
/// heads, 8 elements of padding) and written to output rows with a padded stride: the kernel
/// addresses rows by the strides (nothing between output rows is written), for both dtypes, a
/// few head dims and GQA ratios, over several row and key tiles.
#[test]
fn strided_query_and_out_views() {
    let mut rng = SmallRng::seed_from_u64(35);
    for (i, (d, group)) in [(64, 1), (128, 4), (256, 8), (80, 3)]
        .into_iter()
        .enumerate()
    {
        let nh = 2 * group;
        let strides = Some(((nh + 2 * 2) * d + 8, nh * d + 16));
        let f = features(i, 16);
        let seqs = [(30, 100), (1, 65)];
        check_tilings::<bf16>(
            &mut rng,
            d,
            group,
            16,
            Page::Dense,
            &seqs,
            f,
            strides,
            &PREFILL_TILINGS,
        );
        check_tilings::<f16>(
            &mut rng,
            d,
            group,
            32,
            Page::Pad(1),
            &seqs,
            f,
            strides,
            &PREFILL_TILINGS,
        );
    }
}

/// The persistent grid on few SMs (1, 2 and 3 persistent blocks, odd and even rounds of the
/// snake order), so that each block streams many work items back to back: items of one tile
/// and of several, items with no rows (a sequence with no query tokens; the short chunks'
/// row tiles past their rows when a longer chunk sets the grid), a chunk whose rows straddle
/// row tiles, windows, soft-cap and ALiBi, every head dim of the kernel (d64 runs the plain
/// grid) and both dtypes, against the oracle; then the thread schedules reversed, random and
/// warp by warp.
#[test]
fn persistent_grid_streams_many_items() {
    let mut rng = SmallRng::seed_from_u64(36);
    let persistent = [ffi::PKV_PREFILL_TILING_WGMMA128_PERSISTENT];
    let seqs: &[(usize, usize)] = &[
        (20, 20),
        (0, 40),
        (70, 330),
        (1, 129),
        (33, 33),
        (2, 390),
        (16, 80),
    ];
    for (i, sms) in [1, 2, 3].into_iter().enumerate() {
        cuda_emu::set_sm_count(sms);
        for (v, (d, group)) in [(128, 4), (80, 1), (96, 3), (112, 8), (64, 4)]
            .into_iter()
            .enumerate()
        {
            let bs = [8, 16, 32, 64, 128][(v + i) % 5];
            let f = features(v + i, bs);
            check_tilings::<bf16>(
                &mut rng,
                d,
                group,
                bs,
                Page::Dense,
                seqs,
                f,
                None,
                &persistent,
            );
        }
        check_tilings::<f16>(
            &mut rng,
            128,
            2,
            16,
            Page::Pad(1),
            seqs,
            Features::PLAIN,
            None,
            &persistent,
        );
    }
    for sched in OTHER_ORDERS {
        cuda_emu::set_schedule(sched);
        cuda_emu::set_sm_count(2);
        check_tilings::<bf16>(
            &mut rng,
            128,
            4,
            16,
            Page::Dense,
            seqs,
            Features::PLAIN,
            None,
            &persistent,
        );
    }
    cuda_emu::set_schedule(Schedule::Forward);
    cuda_emu::set_sm_count(132);
}

/// Copies landing at their issue instead of at their wait (the other end of the window in
/// which the hardware lands them): a copy queued into shared memory that some warp has yet to
/// read (the next tile's stage, the next item's Q buffer) would show here. Every tiling on
/// cells with several key tiles and row tiles, the persistent grid streaming many items per
/// block, and a cell under reversed and random thread orders, against the oracle.
#[test]
fn copies_landing_at_issue() {
    let mut rng = SmallRng::seed_from_u64(37);
    cuda_emu::set_copies_at_issue(true);
    let seqs: &[(usize, usize)] = &[(20, 20), (17, 131), (1, 129), (2, 390), (70, 330)];
    for (v, (d, group)) in [(128, 4), (64, 1), (96, 3), (80, 8)]
        .into_iter()
        .enumerate()
    {
        let bs = [16, 8, 32, 64][v];
        check::<bf16>(&mut rng, d, group, bs, Page::Dense, seqs, features(v, bs));
    }
    let persistent = [ffi::PKV_PREFILL_TILING_WGMMA128_PERSISTENT];
    let many: &[(usize, usize)] = &[(20, 20), (0, 40), (70, 330), (1, 129), (33, 33), (16, 80)];
    for sms in [1, 2, 3] {
        cuda_emu::set_sm_count(sms);
        let f = Features::PLAIN;
        check_tilings::<bf16>(
            &mut rng,
            128,
            4,
            16,
            Page::Dense,
            many,
            f,
            None,
            &persistent,
        );
        check_tilings::<f16>(
            &mut rng,
            112,
            1,
            32,
            Page::Pad(1),
            many,
            f,
            None,
            &persistent,
        );
    }
    cuda_emu::set_sm_count(132);
    // Warps in other orders (a warp's stores into shared memory another warp has yet to read
    // show under some order).
    for sched in OTHER_ORDERS {
        cuda_emu::set_schedule(sched);
        check::<bf16>(&mut rng, 128, 4, 16, Page::Dense, seqs, Features::PLAIN);
    }
    cuda_emu::set_schedule(Schedule::Forward);
    cuda_emu::set_copies_at_issue(false);
}

/// Bytes of dynamic shared memory the mma.sync kernel asks for at head dim `d` with `mt` m16
/// tiles per warp (its layout: two stages of K and V rows of d + 8 elements, 64 or 32 keys
/// each; Q's 64 mt rows where its fragments would take more than 32 registers per lane; two
/// key-flag arrays and two key-row-address arrays).
fn mma_smem(d: usize, mt: usize) -> u64 {
    let bc = if d <= 128 { 64 } else { 32 };
    let q = if d * mt <= 128 { 0 } else { 64 * mt * (d + 8) };
    (2 * (4 * bc * (d + 8) + q) + 2 * bc * 4 + 2 * bc * 8) as u64
}

/// The same for the wgmma kernel with `wg` warpgroups (head dims up to 128): two stages of K
/// and V in the swizzled layout (tiles of 64 keys with one warpgroup or at d64, else 128, d elements
/// each, no padding), Q's 64 wg rows of d + 8 where they do not fit stage 1, the flags, the row
/// addresses of two tiles (three with the overlapped schedule), and 1024 bytes of alignment.
fn wgmma_smem(d: usize, wg: usize, overlap: bool) -> u64 {
    let bc = if wg == 2 && d > 64 { 128 } else { 64 };
    let stage = 2 * bc * d;
    let q = if 64 * wg * (d + 8) <= stage {
        0
    } else {
        64 * wg * (d + 8)
    };
    let krows = if overlap { 3 } else { 2 };
    // + 1024: the stages start at the swizzle pattern's boundary (shared_align1024).
    (2 * (2 * stage + q) + 2 * bc * 4 + krows * bc * 8 + 1024) as u64
}

/// The same for the persistent grid (head dims above 64): the two stages, two Q buffers, the
/// flags and row addresses of two tiles, four stream-tile descriptions of 80 bytes (the item's
/// 64-byte PrefillBlock, round, tile, ordinal, validity) and the alignment.
fn persistent_smem(d: usize) -> u64 {
    let stage = 2 * 128 * d;
    (2 * (2 * stage + 2 * 128 * (d + 8)) + 2 * 128 * 4 + 2 * 128 * 8 + 4 * 80 + 1024) as u64
}

/// f16 and bf16 prefill launch the tiling's tensor-core kernel (one launch with its
/// shared-memory footprint and its rows per thread block: 64 at 16 rows per warp and with one
/// warpgroup, 128 at 32 and with two; the overlapped wgmma schedule keeps one more tile's row
/// addresses; the persistent grid one block per work item up to the SMs, its own footprint,
/// and the plain two-warpgroup grid at d64), f32 the CUDA-core one (another footprint),
/// whatever the tiling asked; 32
/// rows per warp and wgmma apply up to head dim 128 (the emulated device is compute capability
/// 9.0), 16 elsewhere, and Auto is one warpgroup of wgmma here (16 rows per warp at d256). A
/// dispatch that fell back would pass every accuracy test above unnoticed.
#[test]
fn each_tiling_takes_its_kernel() {
    let mut rng = SmallRng::seed_from_u64(34);
    // 40 tokens of 2 heads over 1 KV head: 80 rows, 2 thread blocks of 64 or 1 of 128.
    let (tokens, nh) = (40usize, 2usize);
    for d in HEAD_DIMS {
        for dtype in [KvDtype::F16, KvDtype::Bf16, KvDtype::F32] {
            for tiling in [ffi::PKV_PREFILL_TILING_AUTO, 16, 32, 64, 128, 65, 129, 130] {
                let b = make_batch(&mut rng, 1, 1, d, 16, dtype, Page::Dense, &[tokens]);
                let bytes = vec![0u8; b.cfg.total_bytes()];
                let params = AttnParams::new(nh, d);
                let qsl = [0, tokens as i32];
                let dense = (nh * d, nh * d);
                let n = tokens * nh * d;
                let t = tiling as i32;
                let _ = cuda_emu::take_stats();
                let s = match dtype {
                    KvDtype::F16 => {
                        let q = vec![f16::ZERO; n];
                        launch(&b, &bytes, 0, &q, dense, &qsl, &params, t).0
                    }
                    KvDtype::Bf16 => {
                        let q = vec![bf16::ZERO; n];
                        launch(&b, &bytes, 0, &q, dense, &qsl, &params, t).0
                    }
                    KvDtype::F32 => {
                        let q = vec![0f32; n];
                        launch(&b, &bytes, 0, &q, dense, &qsl, &params, t).0
                    }
                };
                let what = format!("{dtype} d{d} tiling {tiling}");
                assert_eq!(s, ffi::PKV_OK as i32, "{what}");
                let st = cuda_emu::take_stats();
                assert_eq!(st.launches, 1, "{what}");
                let tensor_core = [
                    mma_smem(d, 1),
                    mma_smem(d, 2),
                    wgmma_smem(d, 1, false),
                    wgmma_smem(d, 2, false),
                    wgmma_smem(d, 1, true),
                    wgmma_smem(d, 2, true),
                    persistent_smem(d),
                ];
                if dtype == KvDtype::F32 {
                    assert!(!tensor_core.contains(&st.max_dynamic_smem), "{what}");
                    continue;
                }
                let (smem, rows) = match tiling {
                    // Auto on the emulated 9.0 device: one warpgroup (1 block of 128 rows is
                    // under half of 132 SMs).
                    ffi::PKV_PREFILL_TILING_AUTO if d <= 128 => (wgmma_smem(d, 1, false), 64),
                    ffi::PKV_PREFILL_TILING_WARP32 if d <= 128 => (mma_smem(d, 2), 128),
                    ffi::PKV_PREFILL_TILING_WGMMA if d <= 128 => (wgmma_smem(d, 1, false), 64),
                    ffi::PKV_PREFILL_TILING_WGMMA128 if d <= 128 => (wgmma_smem(d, 2, false), 128),
                    ffi::PKV_PREFILL_TILING_WGMMA_OVERLAP if d <= 128 => {
                        (wgmma_smem(d, 1, true), 64)
                    }
                    ffi::PKV_PREFILL_TILING_WGMMA128_OVERLAP if d <= 128 => {
                        (wgmma_smem(d, 2, true), 128)
                    }
                    // One work item: one persistent block (the plain grid at d64).
                    ffi::PKV_PREFILL_TILING_WGMMA128_PERSISTENT if d == 64 => {
                        (wgmma_smem(d, 2, false), 128)
                    }
                    ffi::PKV_PREFILL_TILING_WGMMA128_PERSISTENT if d <= 128 => {
                        (persistent_smem(d), 128)
                    }
                    _ => (mma_smem(d, 1), 64),
                };
                assert_eq!(
                    (st.max_dynamic_smem, st.blocks),
                    (smem, (tokens * nh).div_ceil(rows) as u64),
                    "{what}: (dynamic shared memory, thread blocks)"
                );
            }
        }
    }
}

/// Auto's choice (pkv_prefill_tiling_choice, the launcher's own). Off compute capability 9.0:
/// 32 rows per warp once its 128-row blocks (KV heads x row tiles x sequences) cover 2 per SM,
/// else 16. On 9.0 (wgmma): two warpgroups once those blocks cover half the SMs, else one.
/// Every other tiling as the launch would run it; f32 has none. The shapes are the H100 grid's
/// (bf16 d128, 132 SMs, 32:8 and 32:32) where the tilings were measured.
#[test]
fn auto_tiling_follows_the_measured_rules() {
    let cfg = |kv: usize, d: usize, dtype: KvDtype| {
        KvCacheConfig::new(1, kv, d, 16, 64, dtype).expect("a valid geometry")
    };
    let auto = PrefillTiling::Auto;
    let pick = |c: &KvCacheConfig, heads, seqs, q, sms| {
        auto.resolve(c, heads, seqs, q, sms).expect("a valid shape")
    };
    let (gqa, mha) = (cfg(8, 128, KvDtype::Bf16), cfg(32, 128, KvDtype::Bf16));
    let (w16, w32) = (
        Some(PrefillTiling::WarpRows16),
        Some(PrefillTiling::WarpRows32),
    );
    let (wg1, wg2) = (Some(PrefillTiling::Wgmma), Some(PrefillTiling::Wgmma128));
    let asked = PrefillTiling::EXPLICIT;
    let d256 = cfg(8, 256, KvDtype::Bf16);

    // Compute capability 8.0: mma.sync only.
    cuda_emu::set_compute_capability(8, 0);
    // 32:8, 512 tokens: 8 x 16 = 128 blocks of 128 rows < 264 slots; 2048: 512 >= 264.
    assert_eq!(pick(&gqa, 32, 1, 512, 132), w16);
    assert_eq!(pick(&gqa, 32, 1, 2048, 132), w32);
    assert_eq!(pick(&mha, 32, 1, 512, 132), w16);
    assert_eq!(pick(&mha, 32, 1, 2048, 132), w32);
    // The boundary: 1056 rows of 32:8 are 9 tiles x 8 heads = 72 blocks: 36 SMs full, 37 not.
    assert_eq!(pick(&gqa, 32, 1, 264, 36), w32);
    assert_eq!(pick(&gqa, 32, 1, 264, 37), w16);
    // Sequences count: 4 x 512 tokens are 512 blocks.
    assert_eq!(pick(&gqa, 32, 4, 512, 132), w32);
    for t in asked {
        let want = if t == PrefillTiling::WarpRows32 {
            w32
        } else {
            w16
        };
        assert_eq!(
            t.resolve(&gqa, 32, 1, 16, 132).expect("valid"),
            want,
            "{t:?} on 8.0"
        );
    }
    cuda_emu::set_compute_capability(9, 0);

    // 9.0: 128 blocks of 32:8 x 512 cover half of 132 SMs (and of 256), not of 257.
    assert_eq!(pick(&gqa, 32, 1, 512, 132), wg2);
    assert_eq!(pick(&gqa, 32, 1, 2048, 132), wg2);
    assert_eq!(pick(&mha, 32, 1, 512, 132), wg2);
    assert_eq!(pick(&gqa, 32, 1, 512, 256), wg2);
    assert_eq!(pick(&gqa, 32, 1, 512, 257), wg1);
    assert_eq!(pick(&gqa, 32, 1, 16, 132), wg1);
    for t in asked {
        assert_eq!(
            t.resolve(&gqa, 32, 1, 16, 132).expect("valid"),
            Some(t),
            "{t:?}"
        );
        // Head dim 256 has neither a 32-row nor a wgmma kernel.
        assert_eq!(
            t.resolve(&d256, 32, 1, 16, 132).expect("valid"),
            w16,
            "{t:?} d256"
        );
    }
    // The persistent grid has no d64 instance: the plain two-warpgroup one runs.
    let persistent = PrefillTiling::Wgmma128Persistent;
    let d64 = cfg(8, 64, KvDtype::Bf16);
    assert_eq!(
        persistent.resolve(&d64, 32, 1, 16, 132).expect("valid"),
        wg2
    );
    let d80 = cfg(8, 80, KvDtype::Bf16);
    assert_eq!(
        persistent.resolve(&d80, 32, 1, 16, 132).expect("valid"),
        Some(persistent)
    );
    // d256 Auto follows the mma.sync rule (16 rows per warp always); f32 has no tilings.
    assert_eq!(pick(&cfg(8, 256, KvDtype::F16), 32, 8, 4096, 1), w16);
    assert_eq!(pick(&cfg(8, 128, KvDtype::F32), 32, 8, 4096, 1), None);
    // Nothing to run is still an answer (the launcher returns before choosing).
    assert_eq!(pick(&gqa, 32, 0, 512, 132), wg1);
    // The C entry with every size at its largest: the block count saturates (no overflow),
    // past every slot.
    let mut chosen = -1i32;
    // SAFETY: `chosen` is a valid local the call writes; the rest are integers (host only).
    let s = unsafe {
        ffi::pkv_prefill_tiling_choice(
            &mut chosen,
            ffi::PKV_PREFILL_TILING_AUTO as i32,
            ffi::PKV_DTYPE_BF16 as i32,
            i32::MAX,
            i32::MAX,
            128,
            i32::MAX,
            i32::MAX,
            i32::MAX,
        )
    };
    assert_eq!(
        (s, chosen),
        (ffi::PKV_OK as i32, ffi::PKV_PREFILL_TILING_WGMMA128 as i32)
    );
    // Refusals: heads not a multiple of the KV heads; a size past the ABI.
    assert!(matches!(
        auto.resolve(&gqa, 30, 1, 16, 132),
        Err(RawError::Launch { .. })
    ));
    assert!(matches!(
        auto.resolve(&gqa, 32, 1, usize::MAX, 132),
        Err(RawError::Unsupported {
            what: "max_query_len",
            ..
        })
    ));
}

/// The launcher runs Auto's choice: a chunk whose 128-row blocks fill a "device" of 1 SM takes
/// the 128-row kernel (WARP32 on compute capability 8.0, two warpgroups on 9.0: its shared
/// memory, half the blocks), and on 132 SMs the 64-row one, with results equal to the oracle's
/// every time.
#[test]
fn auto_launches_follow_the_choice() {
    let mut rng = SmallRng::seed_from_u64(37);
    let (hkv, group, d, tokens) = (1usize, 4usize, 64usize, 70usize);
    let nh = hkv * group;
    let b = make_batch(
        &mut rng,
        1,
        hkv,
        d,
        16,
        KvDtype::Bf16,
        Page::Dense,
        &[tokens],
    );
    let host = random_cache::<bf16>(&mut rng, b.cfg);
    let query = random_vec::<bf16>(&mut rng, tokens * nh * d);
    let params = AttnParams::new(nh, d);
    let qsl = [0, tokens as i32];
    let want = cpu_prefill(&b, &host, 0, &query, &qsl, &params);
    let cases = [
        ((8, 0), 1, mma_smem(d, 2), 128usize),
        ((8, 0), 132, mma_smem(d, 1), 64),
        ((9, 0), 1, wgmma_smem(d, 2, false), 128),
        ((9, 0), 132, wgmma_smem(d, 1, false), 64),
    ];
    for ((major, minor), sms, smem, rows) in cases {
        cuda_emu::set_compute_capability(major, minor);
        cuda_emu::set_sm_count(sms);
        let _ = cuda_emu::take_stats();
        let (s, got) = launch(
            &b,
            host.as_bytes(),
            0,
            &query,
            (nh * d, nh * d),
            &qsl,
            &params,
            ffi::PKV_PREFILL_TILING_AUTO as i32,
        );
        cuda_emu::set_sm_count(132);
        cuda_emu::set_compute_capability(9, 0);
        let what = format!("Auto on {sms} SMs of cc {major}.{minor}");
        assert_eq!(s, ffi::PKV_OK as i32, "{what}");
        let st = cuda_emu::take_stats();
        assert_eq!(
            (st.max_dynamic_smem, st.blocks),
            (smem, (tokens * nh).div_ceil(rows) as u64),
            "{what}: (dynamic shared memory, thread blocks)"
        );
        assert_close(&what, &got, &want, d);
    }
}

/// A tiling other than pkv_paged_attention_prefill_tiled's (PKV_PREFILL_TILING_*) is refused
/// before anything is launched (f32 ignores a valid choice, not an invalid one).
#[test]
fn unknown_tilings_are_refused() {
    let mut rng = SmallRng::seed_from_u64(36);
    let b = make_batch(&mut rng, 1, 1, 64, 16, KvDtype::Bf16, Page::Dense, &[8]);
    let host = random_cache::<bf16>(&mut rng, b.cfg);
    let query = random_vec::<bf16>(&mut rng, 8 * 2 * 64);
    let params = AttnParams::new(2, 64);
    for tiling in [-1, 1, 8, 15, 17, 48, 66, 127, 131, 256, i32::MAX] {
        let _ = cuda_emu::take_stats();
        let (s, _) = launch(
            &b,
            host.as_bytes(),
            0,
            &query,
            (128, 128),
            &[0, 8],
            &params,
            tiling,
        );
        assert_eq!(s, ffi::PKV_ERR_INVALID_ARG as i32, "tiling {tiling}");
        assert_eq!(cuda_emu::take_stats().launches, 0, "tiling {tiling}");
    }
}

/// The layout probe on the emulation: wgmma.cuh's reading of the descriptor (core matrices
/// `lbo` apart along k and `sbo` along n, K-major and MN-major B alike; the swizzled layouts)
/// is the emulation's, so its variants are exact and the exchanged offsets are not (the probe
/// can tell them apart). On a GPU (tests/cuda_kernels.rs) the same probe checks the hardware.
#[test]
fn wgmma_layout_probe_tells_the_layouts_apart() {
    let counts = buf(&[-1i32; ffi::PKV_WGMMA_PROBE_COUNTS as usize]);
    // SAFETY: `counts` is a live guarded buffer of PKV_WGMMA_PROBE_COUNTS i32 (an overrun
    // faults); the emulated launch is synchronous.
    let s = unsafe { ffi::pkv_wgmma_layout_probe(counts.ptr() as *mut i32, std::ptr::null_mut()) };
    assert_eq!(s, ffi::PKV_OK as i32, "status {s}");
    let c = counts.as_slice::<i32>();
    assert_eq!((c[0], c[2]), (0, 0), "K-major / MN-major as read: {c:?}");
    assert!(c[1] > 0 && c[3] > 0, "exchanged offsets must differ: {c:?}");
    assert_eq!(
        &c[4..],
        &[0; 6],
        "the swizzled layouts, stored as read: {c:?}"
    );
}

/// Block ids that name no page (-1, one past the cache) among a chunk's cached blocks mask
/// their keys: the output equals the oracle's over the valid blocks alone. The invalid blocks
/// lie in a key tile wholly before every query row, the case that takes the scale-only path
/// for interior tiles when its keys are valid (the check that they are is what this catches).
#[test]
fn invalid_block_ids_mask_their_keys() {
    fn run<T: Elem>(rng: &mut SmallRng, group: usize) {
        let (hkv, d, bs, layer) = (2, 64, 16, 0);
        let nh = hkv * group;
        let cfg = pagedkv::kv::KvCacheConfig::new(1, hkv, d, bs, 12, T::DTYPE).expect("config");
        let host = random_cache::<T>(rng, cfg);
        let (with_invalid, valid_only) = prefill_with_invalid_ids(cfg);
        let qsl = [0, 20];
        let query = random_vec::<T>(rng, 20 * nh * d);
        let params = attn_params(nh, d, Features::PLAIN, &[]);
        let want = cpu_prefill(&valid_only, &host, layer, &query, &qsl, &params);
        let row = nh * d;
        for tiling in PREFILL_TILINGS {
            let (s, got) = launch(
                &with_invalid,
                host.as_bytes(),
                layer,
                &query,
                (row, row),
                &qsl,
                &params,
                tiling as i32,
            );
            let what = format!(
                "prefill {} g{group} with invalid block ids, tiling {tiling}",
                T::DTYPE
            );
            assert_eq!(s, ffi::PKV_OK as i32, "{what}: status {s}");
            assert_close(&what, &got, &want, d);
        }
    }
    let mut rng = SmallRng::seed_from_u64(53);
    for group in [1, 4] {
        run::<bf16>(&mut rng, group);
        run::<f16>(&mut rng, group);
        run::<f32>(&mut rng, group);
    }
}

/// Huge finite logits (a query of 49152s against keys of 1s at head dim 64: dot products of
/// 3 145 728, scales 125 to 5000, logits 4e8 to 1.6e10) attend as the formula says: every key
/// here has the same score, so each row is the mean of the values it sees. The scale-only and
/// causal tiles fold the scale into the exponent, exp2(fma(s, scale * log2 e, -m)) with m the
/// rounded product of the row's largest s: past 2^24 the fma kept that product's rounding
/// error (here +-32, +256, -512) as the exponent of the row's largest probability, which
/// overflowed (2^32 is inf in f16, 2^256 in f32: inf or NaN rows) or underflowed (2^-32 is 0
/// in f16, 2^-512 in f32: zero rows), where the oracle and the f32 kernel give the mean. (At
/// such magnitudes one ulp of a logit is a factor of 2^32 on its weight: the mean is exact here
/// because every key's logit rounds alike on each path, general tiles included.)
#[test]
fn huge_logits_on_the_scale_only_path_stay_finite() {
    fn run<T: Elem>(scale: f32) {
        let (hkv, d, bs, layer) = (1, 64, 16, 0);
        let nh = 2;
        // (query tokens, context): one key alone (a causal tile), and a chunk over 130 keys
        // (scale-only tiles before the diagonal).
        let seqs = [(1, 1), (3, 130)];
        let mut rng = SmallRng::seed_from_u64(61);
        let ctx: Vec<usize> = seqs.iter().map(|&(_, c)| c).collect();
        let b = make_batch(&mut rng, 1, hkv, d, bs, T::DTYPE, Page::Dense, &ctx);
        let mut host = random_cache::<T>(&mut rng, b.cfg);
        {
            let mut v = host.view_mut::<T>().expect("view");
            let data = v.data_mut();
            for blk in 0..b.cfg.num_blocks() {
                for t in 0..bs {
                    let off = b.cfg.offset(blk, layer, pagedkv::kv::KvPart::Key, t, 0);
                    data[off..off + d].fill(T::from_f32(1.0));
                }
            }
        }
        let qsl = query_start_loc(&seqs);
        let tokens = *qsl.last().expect("qsl") as usize;
        let query = vec![T::from_f32(49152.0); tokens * nh * d];
        let mut params = AttnParams::new(nh, d);
        params.scale = scale;
        let want = cpu_prefill(&b, &host, layer, &query, &qsl, &params);
        let tilings: &[u32] = if T::DTYPE == KvDtype::F32 {
            &[ffi::PKV_PREFILL_TILING_AUTO]
        } else {
            &PREFILL_TILINGS
        };
        let row = nh * d;
        for &tiling in tilings {
            let (s, got) = launch(
                &b,
                host.as_bytes(),
                layer,
                &query,
                (row, row),
                &qsl,
                &params,
                tiling as i32,
            );
            let what = format!("prefill {} scale {scale} tiling {tiling}", T::DTYPE);
            assert_eq!(s, ffi::PKV_OK as i32, "{what}: status {s}");
            assert_close(&what, &got, &want, d);
        }
    }
    // 125 / 126: the product's rounding error +32 / -32; 1000: +256; 5000: -512.
    for scale in [125.0, 126.0, 1000.0, 5000.0] {
        run::<f16>(scale);
        run::<bf16>(scale);
        run::<f32>(scale);
    }
}
