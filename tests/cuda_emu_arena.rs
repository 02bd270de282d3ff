//! Cross-model hand-off over one KV arena, on the CUDA kernels' CPU emulation (feature
//! `cuda-emu`): model A (GQA 16/4, d64, 32 tokens per page) fills pages of an arena whose page
//! is larger than any model's block, the pages are freed and poisoned (0xFF: NaN in every
//! dtype), model B (MHA 8/8, d64, 16 tokens per page) gets the same pages scattered, then model
//! C (MQA d128, 64 tokens per page, f16) gets them from B. Each runs reshape_and_cache, decode
//! (single pass and split-K) and prefill through the C launchers with its own geometry and the
//! arena's page stride, and:
//! - its outputs equal the CPU oracle's on the same arena bytes, with no NaN (a byte read that
//!   the model did not write would be poison);
//! - its outputs are bit-identical to the same work on a fresh zeroed arena and on an arena
//!   where the previous owner's bytes were left unpoisoned: no byte of the previous model
//!   reaches them;
//! - its writes stay inside its blocks: pages it was not given and the padding of those it was
//!   keep their bytes.
//!
//! The same scenario on a GPU, through `cuda::DeviceArena`, is tests/cuda_arena.rs.
#![cfg(all(feature = "cuda-emu", not(feature = "cuda")))]

#[path = "support/emu_bufs.rs"]
mod emu_bufs;
#[path = "support/kernel_grid.rs"]
mod kernel_grid;

use emu_bufs::*;
use half::{bf16, f16};
use kernel_grid::*;
use pagedkv::cuda_emu::{ffi, EmuBuf, EmuElem};
use rand::rngs::SmallRng;
use rand::SeedableRng;

trait Elem: Tol + EmuElem {}
impl<T: Tol + EmuElem> Elem for T {}

/// Frees pages the way a test build does: every byte of the page becomes 0xFF.
fn poison_pages(arena: &mut EmuBuf, pages: &[u32]) {
    for &p in pages {
        let at = p as usize * ARENA_PAGE_BYTES;
        arena.as_mut_slice::<u8>()[at..at + ARENA_PAGE_BYTES].fill(0xFF);
    }
}

/// Per layer: decode (single pass), decode (split-K) and prefill outputs.
type Outputs<T> = Vec<[Vec<T>; 3]>;

/// Runs `w` on the arena: reshape_and_cache of every token per layer, then decode in both
/// partitionings and prefill per layer.
fn run_model<T: Elem>(arena: &mut EmuBuf, w: &HandOff<T>) -> Outputs<T> {
    let cfg = w.batch.cfg;
    let geom = geometry(&cfg);
    let row = cfg.token_stride();
    let slots = buf(&w.slots);
    for layer in 0..cfg.num_layers() {
        let (k, v) = (buf(&w.keys[layer]), buf(&w.values[layer]));
        // SAFETY: the arena holds num_blocks pages of the geometry's stride; keys and values
        // hold slots.len() dense rows of `row` elements; slots holds that many i64 slots, all
        // in range. The emulated launch is synchronous: every buffer outlives it.
        let s = unsafe {
            ffi::pkv_reshape_and_cache(
                arena.ptr(),
                &geom,
                layer as i32,
                k.ptr(),
                v.ptr(),
                row as i64,
                row as i64,
                slots.ptr() as *const i64,
                w.slots.len() as i32,
                null(),
            )
        };
        expect_ok(&format!("{} reshape_and_cache", w.model.name), s);
    }
    let p = w.params();
    let params = ffi::pkv_attn_params {
        num_heads: p.num_heads as i32,
        scale: p.scale,
        softcap: p.softcap,
        sliding_window: 0,
        alibi_slopes: std::ptr::null(),
        launch_flags: 0,
    };
    let (tables, ctx) = (buf(&w.batch.tables), buf(&w.batch.ctx));
    let (dq, pq, qsl) = (buf(&w.decode_q), buf(&w.prefill_q), buf(&w.qsl));
    let num_seqs = w.batch.ctx.len();
    let max_ctx = w.batch.ctx.iter().copied().max().unwrap_or(0).max(1);
    let max_q = w.qsl.windows(2).map(|x| x[1] - x[0]).max().unwrap_or(0);
    let d = cfg.head_dim();
    let row = (p.num_heads * d) as i64;
    let plan = |mode: u32| {
        let mut plan = ffi::pkv_decode_plan::default();
        // SAFETY: `plan` is a valid local the call writes; the SM count is given, so no device
        // query.
        let s = unsafe {
            ffi::pkv_decode_plan_init(
                &mut plan,
                mode as i32,
                num_seqs as i32,
                p.num_heads as i32,
                cfg.num_kv_heads() as i32,
                d as i32,
                max_ctx,
                132,
            )
        };
        expect_ok(&format!("{} plan mode {mode}", w.model.name), s);
        plan
    };
    let plans = [plan(ffi::PKV_DECODE_SINGLE), plan(ffi::PKV_DECODE_SPLIT)];
    let ws_bytes = plans
        .iter()
        .map(|p| p.workspace_bytes as usize)
        .max()
        .unwrap_or(0);
    // One workspace for both plans: the single pass leaves it alone, the split one leaves its
    // counters zero.
    let counters = plans
        .iter()
        .map(|p| p.counter_bytes as usize)
        .max()
        .unwrap_or(0);
    let ws = decode_workspace(ws_bytes, counters);
    let mut outs = Vec::new();
    for layer in 0..cfg.num_layers() {
        let decode = |plan: &ffi::pkv_decode_plan| {
            let out = poisoned::<T>(w.decode_q.len());
            // SAFETY: every pointer is a live guarded buffer of the shape pagedkv.h documents
            // (query/out [num_seqs][heads][d], dense rows; tables [num_seqs][mbps]; ctx
            // [num_seqs]; the workspace at least the plan's workspace_bytes); the launch is
            // synchronous.
            let s = unsafe {
                ffi::pkv_paged_attention_decode(
                    out.ptr(),
                    row,
                    dq.ptr(),
                    row,
                    arena.ptr(),
                    &geom,
                    layer as i32,
                    tables.ptr() as *const i32,
                    w.batch.mbps as i32,
                    ctx.ptr() as *const i32,
                    num_seqs as i32,
                    plan,
                    &params,
                    ws.ptr(),
                    ws.len(),
                    null(),
                )
            };
            expect_ok(&format!("{} decode mode {}", w.model.name, plan.mode), s);
            out.as_slice::<T>().to_vec()
        };
        let single = decode(&plans[0]);
        let split = decode(&plans[1]);
        let out = poisoned::<T>(w.prefill_q.len());
        // SAFETY: as above; query_start_loc is [num_seqs + 1] with every chunk <= max_q and
        // <= its context.
        let s = unsafe {
            ffi::pkv_paged_attention_prefill(
                out.ptr(),
                row,
                pq.ptr(),
                row,
                arena.ptr(),
                &geom,
                layer as i32,
                tables.ptr() as *const i32,
                w.batch.mbps as i32,
                ctx.ptr() as *const i32,
                qsl.ptr() as *const i32,
                num_seqs as i32,
                max_q,
                &params,
                null(),
            )
        };
        expect_ok(&format!("{} prefill", w.model.name), s);
        outs.push([single, split, out.as_slice::<T>().to_vec()]);
    }
    outs
}

/// Runs `w` on `arena` (whose `given` pages it owns), and checks it against the oracle on the
/// same bytes, against the same work on a fresh zeroed arena and on `unpoisoned` (the arena
/// before the previous owner's pages were poisoned), and that it wrote only its blocks.
fn check_model<T: Elem>(arena: &mut EmuBuf, unpoisoned: &[u8], w: &HandOff<T>, given: &[u32]) {
    let before = arena.as_slice::<u8>().to_vec();
    let got = run_model(arena, w);
    w.check_untouched(&before, arena.as_slice::<u8>(), given);
    let image = arena_image(w.batch.cfg, arena.as_slice::<u8>());
    let d = w.model.head_dim;
    for (layer, [single, split, prefill]) in got.iter().enumerate() {
        let (want_d, want_p) = w.oracle(&image, layer);
        let name = w.model.name;
        assert_close(
            &format!("{name} layer {layer} decode single"),
            single,
            &want_d,
            d,
        );
        assert_close(
            &format!("{name} layer {layer} decode split"),
            split,
            &want_d,
            d,
        );
        assert_close(
            &format!("{name} layer {layer} prefill"),
            prefill,
            &want_p,
            d,
        );
    }
    let bits = |o: &Outputs<T>| -> Vec<Vec<u8>> {
        o.iter()
            .flat_map(|l| l.iter())
            .map(|v| {
                let b = buf(v);
                b.as_slice::<u8>().to_vec()
            })
            .collect()
    };
    for (what, start) in [
        ("a fresh zeroed arena", vec![0u8; before.len()]),
        (
            "the previous owner's bytes, not poisoned",
            unpoisoned.to_vec(),
        ),
    ] {
        let mut other = buf(&start);
        let again = run_model(&mut other, w);
        assert!(
            bits(&again) == bits(&got),
            "{}: outputs differ on {what}: bytes of the pages' previous use reached them",
            w.model.name
        );
    }
}

#[test]
fn models_of_different_geometry_hand_pages_over() {
    let mut rng = SmallRng::seed_from_u64(31);
    let mut arena = EmuBuf::zeroed(ARENA_PAGES * ARENA_PAGE_BYTES).expect("arena");
    // A pattern on pages nobody was given yet, so that "untouched" means something.
    for (i, b) in arena.as_mut_slice::<u8>().iter_mut().enumerate() {
        *b = (i * 7 + 3) as u8;
    }

    let a = HandOff::<bf16>::new(&mut rng, MODEL_A, &A_PAGES, &A_CTX, &Q_LENS);
    let start = arena.as_slice::<u8>().to_vec();
    check_model(&mut arena, &start, &a, &A_PAGES);

    let unpoisoned = arena.as_slice::<u8>().to_vec();
    poison_pages(&mut arena, &A_PAGES);
    let b = HandOff::<bf16>::new(&mut rng, MODEL_B, &B_PAGES, &B_CTX, &Q_LENS);
    check_model(&mut arena, &unpoisoned, &b, &B_PAGES);

    let unpoisoned = arena.as_slice::<u8>().to_vec();
    poison_pages(&mut arena, &B_PAGES);
    let c = HandOff::<f16>::new(&mut rng, MODEL_C, &C_PAGES, &C_CTX, &Q_LENS);
    check_model(&mut arena, &unpoisoned, &c, &C_PAGES);
}
