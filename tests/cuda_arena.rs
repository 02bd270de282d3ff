//! Cross-model hand-off over one device KV arena (`cuda::DeviceArena`), on a GPU: the scenario
//! of tests/cuda_emu_arena.rs through the crate's safe wrappers. Model A (GQA 16/4, d64, 32
//! tokens per page) fills pages, they are poisoned on free (0xFF), model B (MHA 8/8, d64, 16
//! tokens per page) and then model C (MQA d128, 64 tokens per page, f16) get them as views of
//! the same arena with their own geometry; each runs reshape_and_cache, decode (single pass and
//! split-K) and prefill. Outputs equal the CPU oracle on the same bytes with no NaN, are
//! bit-identical to the same work on a fresh arena and on one where the previous owner's bytes
//! were not poisoned, and each model writes only its blocks.
//!
//! Without a GPU each GPU test prints `SKIP` and passes; with `PAGEDKV_REQUIRE_GPU=1` it fails
//! instead. `arena_checks_need_no_gpu` runs everywhere.
#![cfg(feature = "cuda")]

#[path = "support/kernel_grid.rs"]
mod kernel_grid;

use half::{bf16, f16};
use kernel_grid::*;
use pagedkv::cuda::{
    DecodeMode, DecodeWorkspace, DeviceArena, DeviceAttnParams, DeviceKvCache, DeviceSeqs, Gpu,
    POISON_BYTE,
};
use pagedkv::error::{CudaError, KvError};
use pagedkv::kv::{KvCacheConfig, KvDtype};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::sync::Arc;

#[path = "support/gpu.rs"]
mod gpu_support;
use gpu_support::gpu;

trait Elem: Tol + cudarc::driver::DeviceRepr + bytemuck_free::Bits {}
impl<T: Tol + cudarc::driver::DeviceRepr + bytemuck_free::Bits> Elem for T {}

/// Bit patterns of the element types, for bit-identical comparisons.
mod bytemuck_free {
    pub trait Bits: Copy {
        fn bits(self) -> u32;
    }
    impl Bits for half::bf16 {
        fn bits(self) -> u32 {
            self.to_bits() as u32
        }
    }
    impl Bits for half::f16 {
        fn bits(self) -> u32 {
            self.to_bits() as u32
        }
    }
    impl Bits for f32 {
        fn bits(self) -> u32 {
            self.to_bits()
        }
    }
}

/// Per layer: decode (single pass), decode (split-K) and prefill outputs, as bit patterns and
/// values.
type Outputs<T> = Vec<[Vec<T>; 3]>;

fn run_model<T: Elem>(g: &Gpu, arena: &Arc<DeviceArena>, w: &HandOff<T>) -> Outputs<T> {
    let mut view = DeviceKvCache::view(arena, &w.model.view()).expect("view");
    assert_eq!(
        view.config(),
        &w.batch.cfg,
        "{}: view geometry",
        w.model.name
    );
    let slots = g.upload(&w.slots).expect("slots");
    for layer in 0..w.batch.cfg.num_layers() {
        let k = g.upload(&w.keys[layer]).expect("k");
        let v = g.upload(&w.values[layer]).expect("v");
        view.reshape_and_cache(g, layer, &k, &v, &slots)
            .expect("reshape_and_cache");
    }
    let cfg = w.batch.cfg;
    let seqs = w.batch.seqs();
    let dseqs = DeviceSeqs::upload(g, &cfg, &seqs).expect("decode seqs");
    let pseqs = DeviceSeqs::upload_prefill(g, &cfg, &seqs, &w.qsl).expect("prefill seqs");
    let mut params = DeviceAttnParams::upload(g, &cfg, &w.params()).expect("params");
    let (dq, pq) = (
        g.upload(&w.decode_q).expect("q"),
        g.upload(&w.prefill_q).expect("q"),
    );
    let mut ws = DecodeWorkspace::new();
    let mut outs = Vec::new();
    for layer in 0..cfg.num_layers() {
        let mut decode = |mode| {
            params.mode = mode;
            let mut out = g
                .upload(&vec![T::from_f32(f32::NAN); w.decode_q.len()])
                .expect("out");
            view.paged_attention_decode(g, layer, &dq, &dseqs, &params, &mut ws, &mut out)
                .expect("decode");
            g.download(&out).expect("download")
        };
        let single = decode(DecodeMode::SinglePass);
        let split = decode(DecodeMode::SplitK);
        let mut out = g
            .upload(&vec![T::from_f32(f32::NAN); w.prefill_q.len()])
            .expect("out");
        view.paged_attention_prefill(g, layer, &pq, &pseqs, &params, &mut out)
            .expect("prefill");
        outs.push([single, split, g.download(&out).expect("download")]);
    }
    g.synchronize().expect("sync");
    outs
}

fn arena_bytes(g: &Gpu, arena: &DeviceArena) -> Vec<u8> {
    let mut v = vec![0u8; arena.total_bytes()];
    arena.download(g, &mut v).expect("download arena");
    v
}

fn fresh_arena(g: &Gpu, bytes: &[u8]) -> Arc<DeviceArena> {
    let a = DeviceArena::new(g, ARENA_PAGES, ARENA_PAGE_BYTES).expect("arena");
    a.upload(g, bytes).expect("upload");
    a
}

fn check_model<T: Elem>(
    g: &Gpu,
    arena: &Arc<DeviceArena>,
    unpoisoned: &[u8],
    w: &HandOff<T>,
    given: &[u32],
) {
    let before = arena_bytes(g, arena);
    let got = run_model(g, arena, w);
    let after = arena_bytes(g, arena);
    w.check_untouched(&before, &after, given);
    let image = arena_image(w.batch.cfg, &after);
    let (d, name) = (w.model.head_dim, w.model.name);
    for (layer, [single, split, prefill]) in got.iter().enumerate() {
        let (want_d, want_p) = w.oracle(&image, layer);
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
    let bits = |o: &Outputs<T>| -> Vec<u32> {
        o.iter()
            .flat_map(|l| l.iter().flatten())
            .map(|x| x.bits())
            .collect()
    };
    for (what, start) in [
        ("a fresh zeroed arena", vec![0u8; before.len()]),
        (
            "the previous owner's bytes, not poisoned",
            unpoisoned.to_vec(),
        ),
    ] {
        let other = fresh_arena(g, &start);
        assert!(
            bits(&run_model(g, &other, w)) == bits(&got),
            "{name}: outputs differ on {what}: bytes of the pages' previous use reached them"
        );
    }
}

#[test]
fn models_of_different_geometry_hand_pages_over() {
    let Some(g) = gpu("models_of_different_geometry_hand_pages_over") else {
        return;
    };
    let mut rng = SmallRng::seed_from_u64(31);
    let pattern: Vec<u8> = (0..ARENA_PAGES * ARENA_PAGE_BYTES)
        .map(|i| (i * 7 + 3) as u8)
        .collect();
    let arena = fresh_arena(&g, &pattern);

    let a = HandOff::<bf16>::new(&mut rng, MODEL_A, &A_PAGES, &A_CTX, &Q_LENS);
    check_model(&g, &arena, &pattern, &a, &A_PAGES);

    let unpoisoned = arena_bytes(&g, &arena);
    arena.fill_pages(&g, &A_PAGES, POISON_BYTE).expect("poison");
    let b = HandOff::<bf16>::new(&mut rng, MODEL_B, &B_PAGES, &B_CTX, &Q_LENS);
    check_model(&g, &arena, &unpoisoned, &b, &B_PAGES);

    let unpoisoned = arena_bytes(&g, &arena);
    arena.fill_pages(&g, &B_PAGES, POISON_BYTE).expect("poison");
    let c = HandOff::<f16>::new(&mut rng, MODEL_C, &C_PAGES, &C_CTX, &Q_LENS);
    check_model(&g, &arena, &unpoisoned, &c, &C_PAGES);
}

/// Views on two streams of one device share the arena's bytes: what one writes (after its
/// stream is synchronized) the other reads through its own geometry.
#[test]
fn views_share_bytes_across_streams() {
    let Some(g) = gpu("views_share_bytes_across_streams") else {
        return;
    };
    let g2 = g.with_new_stream().expect("stream");
    let arena = DeviceArena::new(&g, 4, 64 << 10).expect("arena");
    let cfg = KvCacheConfig::new(1, 2, 64, 16, 4, KvDtype::Bf16).expect("cfg");
    let mut w = DeviceKvCache::view(&arena, &cfg).expect("view");
    let r = DeviceKvCache::view(&arena, &cfg).expect("view");
    let kv: Vec<bf16> = (0..2 * 64).map(|i| bf16::from_f32(i as f32)).collect();
    let (k, s) = (
        g.upload(&kv).expect("k"),
        g.upload(&[3 * 16 + 5i64]).expect("s"),
    );
    w.reshape_and_cache(&g, 0, &k, &k, &s).expect("write");
    g.synchronize().expect("sync");
    let mut host = pagedkv::kv::HostKvCache::new(*r.config()).expect("host");
    r.download_to(&g2, &mut host).expect("download");
    let at = 3 * (64 << 10) + 5 * 2 * 64 * 2;
    let row: Vec<u8> = kv.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
    assert_eq!(&host.as_bytes()[at..at + row.len()], &row[..]);
}

/// A model whose block does not fit the arena's page is refused with the layout's error.
#[test]
fn view_refuses_a_block_larger_than_the_page() {
    let Some(g) = gpu("view_refuses_a_block_larger_than_the_page") else {
        return;
    };
    let arena = DeviceArena::new(&g, 4, 16 << 10).expect("arena");
    let cfg = KvCacheConfig::new(2, 4, 64, 32, 1, KvDtype::Bf16).expect("cfg");
    match DeviceKvCache::view(&arena, &cfg) {
        Err(CudaError::Kv(KvError::PageTooSmall {
            page_bytes,
            block_bytes,
        })) => assert_eq!((page_bytes, block_bytes), (16 << 10, 64 << 10)),
        other => panic!("expected PageTooSmall, got {other:?}"),
    }
    assert!(matches!(
        arena.fill_pages(&g, &[4], POISON_BYTE),
        Err(CudaError::Kv(KvError::BlockOutOfRange { block: 4, .. }))
    ));
    assert!(matches!(
        arena.upload(&g, &[0u8; 5]),
        Err(CudaError::Kv(KvError::LengthMismatch { .. }))
    ));
}

/// The arena's size checks run without a device.
#[test]
fn arena_checks_need_no_gpu() {
    assert_eq!(DeviceArena::check(3, 4096), Ok(3 * 4096));
    assert!(matches!(
        DeviceArena::check(0, 4096),
        Err(KvError::ZeroDimension { .. })
    ));
    assert!(matches!(
        DeviceArena::check(3, 0),
        Err(KvError::ZeroDimension { .. })
    ));
    assert!(matches!(
        DeviceArena::check(3, 4104),
        Err(KvError::PageMisaligned {
            page_bytes: 4104,
            ..
        })
    ));
    assert!(matches!(
        DeviceArena::check(1 << 20, 1 << 60),
        Err(KvError::SizeOverflow | KvError::TooManyBlocks { .. })
    ));
    assert!(matches!(
        DeviceArena::check(usize::MAX, 16),
        Err(KvError::TooManyBlocks { .. })
    ));
}
