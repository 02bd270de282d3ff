//! The shared KV arena on the CPU path: page planning (tokens per page per model, bytes wasted,
//! models that cannot fit), the cross-model hand-off (model A's pages, freed and poisoned, become
//! model B's; B's results equal the oracle on a private cache and carry no byte of A), and
//! several engine threads running kernels on one arena at once over pages from one pool.

use pagedkv::attn::{cpu, AttnWorkspace};
use pagedkv::block::{BlockPool, EngineId, PoolConfig};
use pagedkv::error::KvError;
use pagedkv::kv::{
    page_bytes_for, ArenaView, HostKvCache, KvCacheConfig, KvDtype, KvElem, LayerKv, ModelKvShape,
    MAX_TOKENS_PER_PAGE, MIN_TOKENS_PER_PAGE,
};
use pagedkv::kv::{AttnParams, PagedSeqs};
use pagedkv::kv::{KvArena, POISON_BYTE};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn shape(layers: usize, hkv: usize, d: usize, dtype: KvDtype) -> ModelKvShape {
    ModelKvShape {
        num_layers: layers,
        num_kv_heads: hkv,
        head_dim: d,
        dtype,
    }
}

/// The simulator's three default models (GQA 16/4 d64, MQA 8/1 d128, MHA 8/8 d64; 2 layers).
fn default_models(dtype: KvDtype) -> [ModelKvShape; 3] {
    [
        shape(2, 4, 64, dtype),
        shape(2, 1, 128, dtype),
        shape(2, 8, 64, dtype),
    ]
}

#[test]
fn default_models_fill_their_pages_exactly() {
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
        let models = default_models(dtype);
        let page = page_bytes_for(&models, 16).unwrap();
        // The MHA model is the largest per token: it gets the 16 tokens asked for.
        assert_eq!(page, 16 * models[2].bytes_per_token());
        let arena = Arc::new(KvArena::new(64, page).unwrap());
        let tokens: Vec<usize> = models
            .iter()
            .map(|m| {
                let v = ArenaView::new(arena.clone(), m).unwrap();
                assert_eq!(v.wasted_bytes_per_page(), 0, "{dtype} {m:?}");
                assert_eq!(v.config().page_bytes(), page);
                assert_eq!(v.config().num_blocks(), 64);
                v.config().block_size()
            })
            .collect();
        assert_eq!(tokens, [32, 64, 16], "{dtype}");
    }
}

#[test]
fn waste_is_reported_and_tokens_per_page_are_powers_of_two() {
    // 3 layers x 2 x 2 heads x 80 dims x 2 bytes = 1920 B per token: not a power of two.
    let odd = shape(3, 2, 80, KvDtype::F16);
    let big = shape(2, 8, 128, KvDtype::F16); // 8192 B per token
    let page = page_bytes_for(&[odd, big], 16).unwrap();
    assert_eq!(page, 16 * 8192);
    let arena = Arc::new(KvArena::new(8, page).unwrap());
    let v = ArenaView::new(arena.clone(), &odd).unwrap();
    // 131072 / 1920 = 68.3 -> 64 tokens; 131072 - 64 * 1920 bytes unused.
    assert_eq!(v.config().block_size(), 64);
    assert_eq!(v.wasted_bytes_per_page(), 131_072 - 64 * 1920);
    assert_eq!(odd.tokens_per_page(page).unwrap(), 64);
    // A tiny model is capped at 256 tokens per page; the rest is waste, reported.
    let tiny = shape(1, 1, 8, KvDtype::F16); // 32 B per token
    let t = ArenaView::new(arena.clone(), &tiny).unwrap();
    assert_eq!(t.config().block_size(), 256);
    assert_eq!(t.wasted_bytes_per_page(), page - 256 * 32);
    // An explicit block size that fits is accepted; one that does not is refused.
    assert!(ArenaView::with_block_size(arena.clone(), &big, 16).is_ok());
    assert!(matches!(
        ArenaView::with_block_size(arena, &big, 17),
        Err(KvError::PageTooSmall { .. })
    ));
}

#[test]
fn a_model_that_cannot_fit_a_page_is_refused_with_why() {
    let arena = Arc::new(KvArena::new(4, 4096).unwrap());
    // 2 x 2 x 8 x 128 x 4 = 16 KiB per token: not even 8 tokens fit a 4 KiB page.
    let huge = shape(2, 8, 128, KvDtype::F32);
    let err = ArenaView::new(arena, &huge).unwrap_err();
    assert_eq!(
        err,
        KvError::ModelDoesNotFit {
            bytes_per_token: 16384,
            min_tokens: 8,
            page_bytes: 4096
        }
    );
    assert!(err.to_string().contains("does not fit"), "{err}");
}

#[test]
fn bad_arena_shapes_are_typed_errors() {
    assert!(matches!(
        KvArena::new(0, 4096),
        Err(KvError::ZeroDimension { .. })
    ));
    assert!(matches!(
        KvArena::new(4, 0),
        Err(KvError::ZeroDimension { .. })
    ));
    assert!(matches!(
        KvArena::new(4, 4100),
        Err(KvError::PageMisaligned { .. })
    ));
    assert!(matches!(
        KvArena::new(1 << 25, 16),
        Err(KvError::TooManyBlocks { .. })
    ));
    assert!(matches!(
        KvArena::new(1 << 20, usize::MAX / 64 * 16),
        Err(KvError::SizeOverflow)
    ));
    assert!(matches!(
        page_bytes_for(&[], 16),
        Err(KvError::ZeroDimension { .. })
    ));
}

/// One model's sequences over some pages: block tables, context lengths, and the slots of
/// every context token (in order).
struct Seqs {
    tables: Vec<i32>,
    mbps: usize,
    ctx: Vec<i32>,
    slots: Vec<i64>,
}

impl Seqs {
    /// Sequences of `ctx` tokens over `pages` (used in order), `bs` tokens per page.
    fn over(pages: &[u32], bs: usize, ctx: &[usize]) -> Self {
        let mbps = ctx.iter().map(|c| c.div_ceil(bs)).max().unwrap_or(1);
        let mut tables = vec![-1i32; ctx.len() * mbps];
        let mut slots = Vec::new();
        let mut next = 0;
        for (s, &c) in ctx.iter().enumerate() {
            for j in 0..c.div_ceil(bs) {
                tables[s * mbps + j] = pages[next] as i32;
                next += 1;
            }
            for p in 0..c {
                slots.push(i64::from(tables[s * mbps + p / bs]) * bs as i64 + (p % bs) as i64);
            }
        }
        Self {
            tables,
            mbps,
            ctx: ctx.iter().map(|&c| c as i32).collect(),
            slots,
        }
    }

    fn paged(&self) -> PagedSeqs<'_> {
        PagedSeqs {
            block_tables: &self.tables,
            max_blocks_per_seq: self.mbps,
            context_lens: &self.ctx,
        }
    }
}

/// A page's bytes. Only for single-threaded tests (or pages the caller holds).
fn page_of(arena: &KvArena, p: u32) -> Vec<u8> {
    // SAFETY: the callers are single-threaded tests, or hold the page: no concurrent writer.
    unsafe { arena.read_page(p).unwrap() }
}

/// Poisons pages. Only for single-threaded tests (or pages the caller holds).
fn poison(arena: &KvArena, pages: &[u32]) {
    // SAFETY: the callers are single-threaded tests, or hold the pages until they free them.
    unsafe { arena.poison_pages(pages).unwrap() }
}

fn random<T: KvElem>(rng: &mut SmallRng, n: usize) -> Vec<T> {
    (0..n)
        .map(|_| T::from_f32(rng.gen_range(-1.0..1.0)))
        .collect()
}

/// What a model computes in one round: per layer, the decode output (one query per
/// sequence) and the prefill output (the last `q` tokens of each sequence as queries).
#[derive(Debug, PartialEq)]
struct Outputs<T> {
    decode: Vec<Vec<T>>,
    prefill: Vec<Vec<T>>,
}

/// The inputs of one model's round: K/V of every context token per layer, queries.
struct Inputs<T> {
    k: Vec<Vec<T>>,
    v: Vec<Vec<T>>,
    q_decode: Vec<T>,
    q_prefill: Vec<T>,
    qsl: Vec<i32>,
}

fn inputs<T: KvElem>(
    rng: &mut SmallRng,
    cfg: &KvCacheConfig,
    heads: usize,
    seqs: &Seqs,
    q: usize,
) -> Inputs<T> {
    let row = cfg.num_kv_heads() * cfg.head_dim();
    let n = seqs.slots.len();
    let layers = cfg.num_layers();
    let mut qsl = vec![0i32];
    for _ in &seqs.ctx {
        qsl.push(qsl.last().unwrap() + q as i32);
    }
    Inputs {
        k: (0..layers).map(|_| random(rng, n * row)).collect(),
        v: (0..layers).map(|_| random(rng, n * row)).collect(),
        q_decode: random(rng, seqs.ctx.len() * heads * cfg.head_dim()),
        q_prefill: random(rng, seqs.ctx.len() * q * heads * cfg.head_dim()),
        qsl,
    }
}

/// Writes every context token, then attends: on the arena view when `view` is given, else on
/// the private dense cache `own` (the oracle: same kernels, memory nobody else shares).
fn round<T: KvElem>(
    view: Option<&ArenaView>,
    own: Option<&mut HostKvCache>,
    seqs: &Seqs,
    inp: &Inputs<T>,
    params: &AttnParams<'_>,
) -> Outputs<T> {
    let mut out = Outputs {
        decode: Vec::new(),
        prefill: Vec::new(),
    };
    let layers = view.map_or_else(
        || own.as_ref().unwrap().config().num_layers(),
        |v| v.config().num_layers(),
    );
    let mut own = own;
    let mut ws = AttnWorkspace::new();
    for l in 0..layers {
        let mut dec = vec![T::from_f32(f32::NAN); inp.q_decode.len()];
        let mut pre = vec![T::from_f32(f32::NAN); inp.q_prefill.len()];
        match (view, own.as_deref_mut()) {
            (Some(v), _) => {
                // SAFETY: this test's thread owns the pages of `seqs` (allocated to it from the
                // pool, or the whole arena in single-threaded tests).
                let w = unsafe { v.layer_mut::<T>(l).unwrap() };
                cpu::reshape_and_cache(w, &inp.k[l], &inp.v[l], &seqs.slots).unwrap();
                // SAFETY: as above; the writes are done.
                let r = unsafe { v.layer::<T>(l).unwrap() };
                attend(&mut ws, r, seqs, inp, params, &mut dec, &mut pre);
            }
            (None, Some(c)) => {
                let mut vm = c.view_mut::<T>().unwrap();
                cpu::reshape_and_cache(vm.layer_mut(l).unwrap(), &inp.k[l], &inp.v[l], &seqs.slots)
                    .unwrap();
                let vr = c.view::<T>().unwrap();
                attend(
                    &mut ws,
                    vr.layer(l).unwrap(),
                    seqs,
                    inp,
                    params,
                    &mut dec,
                    &mut pre,
                );
            }
            (None, None) => unreachable!(),
        }
        out.decode.push(dec);
        out.prefill.push(pre);
    }
    out
}

/// Decode and prefill of one layer into `dec` and `pre`.
fn attend<T: KvElem>(
    ws: &mut AttnWorkspace,
    kv: LayerKv<'_, T>,
    seqs: &Seqs,
    inp: &Inputs<T>,
    params: &AttnParams<'_>,
    dec: &mut [T],
    pre: &mut [T],
) {
    cpu::paged_attention_decode(ws, kv, &inp.q_decode, &seqs.paged(), params, dec).unwrap();
    cpu::paged_attention_prefill(ws, kv, &inp.q_prefill, &inp.qsl, &seqs.paged(), params, pre)
        .unwrap();
}

fn has_nan<T: KvElem>(o: &Outputs<T>) -> bool {
    o.decode
        .iter()
        .chain(&o.prefill)
        .flatten()
        .any(|x| x.to_f32().is_nan())
}

fn hand_off<T: KvElem>(dtype: KvDtype) {
    let mut rng = SmallRng::seed_from_u64(7);
    // A: GQA 16/4 d64 (32 tokens per page); B: MHA 8/8 d64 (16 tokens per page).
    let (a_shape, a_heads) = (shape(2, 4, 64, dtype), 16);
    let (b_shape, b_heads) = (shape(2, 8, 64, dtype), 8);
    let page = page_bytes_for(&[a_shape, b_shape], 16).unwrap();
    let arena = Arc::new(KvArena::new(24, page).unwrap());
    let a = ArenaView::new(arena.clone(), &a_shape).unwrap();
    let b = ArenaView::new(arena.clone(), &b_shape).unwrap();
    assert_eq!((a.config().block_size(), b.config().block_size()), (32, 16));

    // A fills pages 3..13 with two sequences (partial last pages on purpose) and attends.
    let a_pages: Vec<u32> = (3..13).collect();
    let a_seqs = Seqs::over(&a_pages, 32, &[150, 141]);
    let a_in = inputs::<T>(&mut rng, a.config(), a_heads, &a_seqs, 5);
    let a_params = AttnParams::new(a_heads, 64);
    let a_out = round(Some(&a), None, &a_seqs, &a_in, &a_params);
    assert!(!has_nan(&a_out));

    // B gets the same pages (in another order), writes and attends, twice: over A's leftover
    // bytes, and over poisoned pages (A "freed" them). Both must equal B's run on a private
    // cache of its own and hold no NaN: nothing of A, and no byte B did not write, is read.
    let mut b_pages = a_pages.clone();
    b_pages.reverse();
    let b_seqs = Seqs::over(&b_pages, 16, &[77, 61]);
    let b_in = inputs::<T>(&mut rng, b.config(), b_heads, &b_seqs, 4);
    let mut slopes = vec![0f32; b_heads];
    slopes
        .iter_mut()
        .for_each(|s| *s = rng.gen_range(0.01..0.5));
    let mut b_params = AttnParams::new(b_heads, 64);
    b_params.alibi_slopes = Some(&slopes);
    b_params.sliding_window = 40;

    let over_a = round(Some(&b), None, &b_seqs, &b_in, &b_params);
    // SAFETY: single-threaded test: nobody else touches the arena.
    poison(&arena, &a_pages);
    let page0 = page_of(&arena, a_pages[0]);
    assert!(page0.iter().all(|&x| x == POISON_BYTE));
    let over_poison = round(Some(&b), None, &b_seqs, &b_in, &b_params);

    let mut own = HostKvCache::new(b_shape.config(16, 24).unwrap()).unwrap();
    let oracle = round(None, Some(&mut own), &b_seqs, &b_in, &b_params);
    assert!(!has_nan(&oracle));
    assert!(
        !has_nan(&over_poison),
        "{dtype}: a poisoned byte reached B's output"
    );
    assert_eq!(
        over_a, oracle,
        "{dtype}: B over A's bytes differs from the oracle"
    );
    assert_eq!(
        over_poison, oracle,
        "{dtype}: B over poison differs from the oracle"
    );
    // Pages B never used keep A's poison; B's padding (none here) and unwritten rows too.
    let untouched = page_of(&arena, b_pages[9]);
    assert!(
        untouched.iter().all(|&x| x == POISON_BYTE),
        "B wrote outside its pages"
    );
}

#[test]
fn cross_model_hand_off_f32() {
    hand_off::<f32>(KvDtype::F32);
}

#[test]
fn cross_model_hand_off_f16() {
    hand_off::<half::f16>(KvDtype::F16);
}

#[test]
fn cross_model_hand_off_bf16() {
    hand_off::<half::bf16>(KvDtype::Bf16);
}

#[test]
fn copy_and_swap_move_only_the_block_between_pages() {
    let mut rng = SmallRng::seed_from_u64(11);
    let small = shape(1, 1, 16, KvDtype::F32); // 128 B per token
    let arena = Arc::new(KvArena::new(6, 4096).unwrap());
    // 8 tokens of 128 B = 1 KiB block in a 4 KiB page: 3 KiB of padding per page.
    let v = ArenaView::with_block_size(arena.clone(), &small, 8).unwrap();
    assert_eq!(v.wasted_bytes_per_page(), 3072);
    poison(&arena, &[0, 1, 2, 3, 4, 5]);
    let k: Vec<f32> = random(&mut rng, 16 * 16);
    let val: Vec<f32> = random(&mut rng, 16 * 16);
    let slots: Vec<i64> = (0..8).chain(8..16).collect(); // pages 0 and 1
                                                         // SAFETY: single-threaded test.
    cpu::reshape_and_cache(unsafe { v.layer_mut::<f32>(0).unwrap() }, &k, &val, &slots).unwrap();
    let p0 = page_of(&arena, 0);
    // copy-on-write of pages 0,1 -> 3,4 (one run): the block bytes move, the padding too.
    // SAFETY: single-threaded test: nothing else touches the arena.
    unsafe { v.copy_blocks(&[(0, 3), (1, 4)]).unwrap() };
    assert_eq!(page_of(&arena, 3)[..1024], p0[..1024]);
    // swap out page 1 and back in to page 5: exactly the block's bytes come back.
    let mut swap = pagedkv::kv::SwapSpace::new(v.config(), 2).unwrap();
    assert_eq!(swap.storage().as_bytes().len(), 2 * 1024);
    // SAFETY: single-threaded test: nothing else touches the arena.
    unsafe { v.swap_out(&mut swap, &[(1, 1)]).unwrap() };
    // SAFETY: single-threaded test: nothing else touches the arena.
    unsafe { v.swap_in(&swap, &[(1, 5)]).unwrap() };
    let (p1, p5) = (page_of(&arena, 1), page_of(&arena, 5));
    assert_eq!(p5[..1024], p1[..1024]);
    assert!(
        p5[1024..].iter().all(|&x| x == POISON_BYTE),
        "swap-in wrote padding"
    );
    // Bad mappings are typed errors that copy nothing.
    // SAFETY: single-threaded test: nothing else touches the arena.
    assert!(unsafe { v.copy_blocks(&[(0, 6)]) }.is_err());
    // SAFETY: single-threaded test: nothing else touches the arena.
    assert!(unsafe { v.swap_in(&swap, &[(2, 0)]) }.is_err());
    assert_eq!(page_of(&arena, 0), p0);
}

/// Several engines, one arena, one pool: each thread allocates its pages from the pool, writes
/// and attends on its own view, checks the result against its private oracle, frees (poisoning
/// first), and goes again; pages wander between models of different geometry all the time.
#[test]
fn engines_share_one_arena_concurrently() {
    let models = [
        (shape(2, 4, 64, KvDtype::F32), 16usize),
        (shape(2, 1, 128, KvDtype::F32), 8),
        (shape(2, 8, 64, KvDtype::F32), 8),
    ];
    let shapes: Vec<ModelKvShape> = models.iter().map(|m| m.0).collect();
    let page = page_bytes_for(&shapes, 16).unwrap();
    let pages = 40u32;
    let arena = Arc::new(KvArena::new(pages as usize, page).unwrap());
    let pool = Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: pages,
            max_engines: 3,
        })
        .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    std::thread::scope(|s| {
        for (e, &(m, heads)) in models.iter().enumerate() {
            let (arena, pool) = (arena.clone(), pool.clone());
            s.spawn(move || {
                let view = ArenaView::new(arena.clone(), &m).unwrap();
                let bs = view.config().block_size();
                let mut rng = SmallRng::seed_from_u64(100 + e as u64);
                let params = AttnParams::new(heads, m.head_dim);
                for round_no in 0..25 {
                    assert!(
                        Instant::now() < deadline,
                        "engine {e} hung at round {round_no}"
                    );
                    let ctx = [rng.gen_range(2..3 * bs), rng.gen_range(2..2 * bs)];
                    let need: usize = ctx.iter().map(|c| c.div_ceil(bs)).sum();
                    let mut ids = Vec::new();
                    while pool
                        .alloc_n(EngineId(e as u16), need as u32, &mut ids)
                        .is_err()
                    {
                        assert!(Instant::now() < deadline, "engine {e} starved of pages");
                        std::thread::yield_now();
                    }
                    let mine: Vec<u32> = ids.iter().map(|id| id.index()).collect();
                    let seqs = Seqs::over(&mine, bs, &ctx);
                    let inp = inputs::<f32>(&mut rng, view.config(), heads, &seqs, 2);
                    let got = round(Some(&view), None, &seqs, &inp, &params);
                    let mut own = HostKvCache::new(m.config(bs, pages as usize).unwrap()).unwrap();
                    let want = round(None, Some(&mut own), &seqs, &inp, &params);
                    assert_eq!(
                        got, want,
                        "engine {e} round {round_no}: shared arena != oracle"
                    );
                    // SAFETY: this thread holds these pages until free_n below.
                    poison(&arena, &mine);
                    pool.free_n(&ids).unwrap();
                }
            });
        }
    });
    assert_eq!(pool.free_count(), pages, "pages lost");
}

/// A shape whose bytes per token overflow is refused (its product wrapped to a small size, and
/// `page_bytes_for` returned that as a page size).
#[test]
fn a_shape_too_large_for_any_page_is_refused() {
    let huge = ModelKvShape {
        num_layers: (1 << 62) + 1,
        num_kv_heads: 2,
        head_dim: 8,
        dtype: KvDtype::F16,
    };
    assert_eq!(huge.bytes_per_token(), usize::MAX);
    assert!(matches!(
        page_bytes_for(&[huge], 16),
        Err(KvError::SizeOverflow)
    ));
    assert!(matches!(
        huge.tokens_per_page(1 << 20),
        Err(KvError::ModelDoesNotFit { .. })
    ));
}

/// `page_bytes_for` takes only the tokens per page a model can get: a power of two from
/// `MIN_TOKENS_PER_PAGE` to `MAX_TOKENS_PER_PAGE` (12 sized a page on which the largest model
/// got 8 tokens and left a third of every page unused; 1024 one on which it got 256 and left
/// three quarters; 4 one that no model fits).
#[test]
fn page_bytes_for_refuses_tokens_per_page_no_model_can_get() {
    let s = shape(2, 8, 64, KvDtype::F16); // 4096 B per token
    for tpp in [1, 2, 4, 7, 9, 12, 24, 100, 255, 257, 512, 1024, usize::MAX] {
        assert_eq!(
            page_bytes_for(&[s], tpp),
            Err(KvError::TokensPerPage {
                tokens_per_page: tpp,
                min: MIN_TOKENS_PER_PAGE,
                max: MAX_TOKENS_PER_PAGE,
            }),
            "{tpp}"
        );
    }
    let mut tpp = MIN_TOKENS_PER_PAGE;
    while tpp <= MAX_TOKENS_PER_PAGE {
        let page = page_bytes_for(&[s], tpp).unwrap();
        assert_eq!(page, tpp * 4096);
        // The largest model gets exactly the tokens asked for, and wastes nothing.
        assert_eq!(s.tokens_per_page(page).unwrap(), tpp);
        tpp *= 2;
    }
}

/// A zero-size shape is refused wherever it sits in the list, as documented (only a list of
/// nothing but zero-size shapes was: beside a real model one sized the page and failed later,
/// at its view).
#[test]
fn page_bytes_for_refuses_a_zero_size_shape_beside_others() {
    let good = shape(2, 8, 64, KvDtype::F16);
    let empty = shape(0, 8, 64, KvDtype::F16);
    for shapes in [[good, empty], [empty, good]] {
        assert_eq!(
            page_bytes_for(&shapes, 16),
            Err(KvError::ZeroDimension {
                what: "bytes per token"
            })
        );
    }
}

/// A shape with a zero size holds no bytes per token however large its other sizes are, and is
/// refused as the zero-size shape it is: `bytes_per_token` multiplied left to right and
/// saturated at the first overflow (layers x heads) before it reached the zero head dim, so
/// the shape read as `usize::MAX` bytes per token and was refused as `ModelDoesNotFit` /
/// `SizeOverflow` instead of the documented `ZeroDimension`.
#[test]
fn a_zero_size_shape_with_overflowing_other_sizes_is_refused_as_zero_size() {
    let zero_d = ModelKvShape {
        num_layers: usize::MAX,
        num_kv_heads: usize::MAX,
        head_dim: 0,
        dtype: KvDtype::F32,
    };
    let zero_layers = ModelKvShape {
        num_layers: 0,
        num_kv_heads: usize::MAX,
        head_dim: usize::MAX,
        dtype: KvDtype::F32,
    };
    let want = KvError::ZeroDimension {
        what: "bytes per token",
    };
    for s in [zero_d, zero_layers] {
        assert_eq!(s.bytes_per_token(), 0, "{s:?}");
        assert_eq!(s.tokens_per_page(1 << 20), Err(want), "{s:?}");
        let good = shape(2, 8, 64, KvDtype::F16);
        assert_eq!(page_bytes_for(&[good, s], 16), Err(want), "{s:?}");
        let arena = Arc::new(KvArena::new(2, 1 << 20).unwrap());
        assert_eq!(ArenaView::new(arena, &s).err(), Some(want), "{s:?}");
    }
}

/// The module docs' exact-fill claim holds only up to `MAX_TOKENS_PER_PAGE` tokens: a model with
/// a power-of-two per-token size below 1/256 of the page (a draft model beside a large one) is
/// capped at 256 tokens and leaves most of every page unused, which its view reports.
#[test]
fn a_model_below_a_256th_of_the_page_is_capped_and_reports_its_waste() {
    let big = shape(32, 32, 128, KvDtype::F16); // 512 KiB per token
    let draft = shape(2, 2, 64, KvDtype::F16); // 1 KiB per token
    assert!(big.bytes_per_token().is_power_of_two() && draft.bytes_per_token().is_power_of_two());
    let page = page_bytes_for(&[big, draft], 16).unwrap();
    assert_eq!(page, 16 << 19);
    let arena = Arc::new(KvArena::new(2, page).unwrap());
    let v = ArenaView::new(arena.clone(), &big).unwrap();
    assert_eq!(
        (v.config().block_size(), v.wasted_bytes_per_page()),
        (16, 0)
    );
    let v = ArenaView::new(arena, &draft).unwrap();
    assert_eq!(v.config().block_size(), MAX_TOKENS_PER_PAGE);
    assert_eq!(v.wasted_bytes_per_page(), page - MAX_TOKENS_PER_PAGE * 1024);
}
