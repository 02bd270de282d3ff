//! The CPU kernels against a naive float64 reference that gathers K and V token by token
//! through the block table, with its own copy of the layout formula. Inputs are fresh random
//! values (never zeros); outputs are poisoned with NaN first, unused cache slots and blocks hold
//! NaN (a kernel that reads them fails), and padding block-table entries are out of range.
//!
//! Grid: head dims 64..256, GQA 1/4/8, block sizes 8/16/32, context lengths 1, block
//! boundary +-1, long; ALiBi / sliding window / soft-cap in all 8 on/off combinations; f32,
//! f16, bf16. Release builds run every (head dim, GQA, block size, feature set) combination,
//! the dtype rotating so that every geometry and every feature set meets every dtype (432
//! batches of 7 sequences per kernel); debug builds run one rotating (dtype, feature set) per
//! geometry (54 batches), still every value of every axis.

use half::{bf16, f16};
use pagedkv::attn::cpu::{
    copy_blocks, paged_attention_decode, paged_attention_prefill, reshape_and_cache,
};
use pagedkv::attn::AttnWorkspace;
use pagedkv::error::{AttnError, KvError};
use pagedkv::kv::{AttnParams, PagedSeqs};
use pagedkv::kv::{HostKvCache, KvCacheConfig, KvDtype, KvElem};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const HEAD_DIMS: [usize; 6] = [64, 80, 96, 112, 128, 256];
const GQA: [usize; 3] = [1, 4, 8];
const BLOCK_SIZES: [usize; 3] = [8, 16, 32];
const NUM_KV_HEADS: usize = 2;
const NUM_LAYERS: usize = 2;
const LAYER: usize = 1;

/// Element offset by the layout formula, written out independently of `KvCacheConfig::offset`.
#[allow(clippy::too_many_arguments)]
fn ref_offset(
    l: usize,
    bs: usize,
    h: usize,
    d: usize,
    b: usize,
    layer: usize,
    kv: usize,
    t: usize,
    head: usize,
) -> usize {
    ((((b * l + layer) * 2 + kv) * bs + t) * h + head) * d
}

#[derive(Clone, Copy, Debug)]
struct Features {
    alibi: bool,
    window: bool,
    softcap: bool,
}

impl Features {
    fn from_bits(i: usize) -> Self {
        Self {
            alibi: i & 1 != 0,
            window: i & 2 != 0,
            softcap: i & 4 != 0,
        }
    }
}

/// One test batch: a cache (filled through `reshape_and_cache`), its block tables, and params.
struct Case<T> {
    cfg: KvCacheConfig,
    cache: HostKvCache,
    tables: Vec<i32>,
    mbps: usize,
    ctx: Vec<i32>,
    num_heads: usize,
    slopes: Vec<f32>,
    window: usize,
    softcap: f32,
    scale: f32,
    _t: std::marker::PhantomData<T>,
}

fn rand_vals<T: KvElem>(rng: &mut SmallRng, n: usize) -> Vec<T> {
    (0..n)
        .map(|_| {
            // Never zero: magnitude in [0.05, 1), random sign.
            let m: f32 = rng.gen_range(0.05..1.0);
            T::from_f32(if rng.gen::<bool>() { m } else { -m })
        })
        .collect()
}

impl<T: KvElem> Case<T> {
    fn new(
        rng: &mut SmallRng,
        d: usize,
        gqa: usize,
        bs: usize,
        ctx: &[usize],
        f: Features,
    ) -> Self {
        let mbps = ctx.iter().map(|c| c.div_ceil(bs)).max().unwrap_or(0) + 2;
        let used: usize = ctx.iter().map(|c| c.div_ceil(bs)).sum();
        let num_blocks = used + 5;
        let cfg =
            KvCacheConfig::new(NUM_LAYERS, NUM_KV_HEADS, d, bs, num_blocks, T::DTYPE).unwrap();
        let mut cache = HostKvCache::new(cfg).unwrap();
        cache
            .view_mut::<T>()
            .unwrap()
            .data_mut()
            .fill(T::from_f32(f32::NAN));
        // Distinct random blocks for every sequence; padding entries are garbage ids.
        let mut perm: Vec<i32> = (0..num_blocks as i32).collect();
        for i in (1..perm.len()).rev() {
            perm.swap(i, rng.gen_range(0..=i));
        }
        let mut tables = vec![0i32; ctx.len() * mbps];
        let mut next = 0;
        for (s, &c) in ctx.iter().enumerate() {
            for j in 0..mbps {
                tables[s * mbps + j] = if j < c.div_ceil(bs) {
                    next += 1;
                    perm[next - 1]
                } else if j % 2 == 0 {
                    -1
                } else {
                    i32::MAX
                };
            }
        }
        // Write every context token through reshape_and_cache, in a shuffled token order with
        // padding slots (-1) whose garbage K/V must be skipped. Layer 0 gets other data.
        let row = NUM_KV_HEADS * d;
        for layer in 0..NUM_LAYERS {
            let mut slots: Vec<i64> = Vec::new();
            for (s, &c) in ctx.iter().enumerate() {
                for p in 0..c {
                    slots.push(tables[s * mbps + p / bs] as i64 * bs as i64 + (p % bs) as i64);
                    if p % 7 == 3 {
                        slots.push(-1);
                    }
                }
            }
            for i in (1..slots.len()).rev() {
                slots.swap(i, rng.gen_range(0..=i));
            }
            let k: Vec<T> = rand_vals(rng, slots.len() * row);
            let v: Vec<T> = rand_vals(rng, slots.len() * row);
            let mut view = cache.view_mut::<T>().unwrap();
            reshape_and_cache(view.layer_mut(layer).unwrap(), &k, &v, &slots).unwrap();
            // reshape_and_cache placed every token where the formula says.
            let data = view.data();
            for (i, &slot) in slots.iter().enumerate() {
                if slot < 0 {
                    continue;
                }
                let (b, t) = (slot as usize / bs, slot as usize % bs);
                for h in 0..NUM_KV_HEADS {
                    let o = ref_offset(NUM_LAYERS, bs, NUM_KV_HEADS, d, b, layer, 0, t, h);
                    assert_eq!(&data[o..o + d], &k[i * row + h * d..i * row + (h + 1) * d]);
                    let o = ref_offset(NUM_LAYERS, bs, NUM_KV_HEADS, d, b, layer, 1, t, h);
                    assert_eq!(&data[o..o + d], &v[i * row + h * d..i * row + (h + 1) * d]);
                }
            }
        }
        let num_heads = NUM_KV_HEADS * gqa;
        let slopes = (0..num_heads)
            .map(|h| 2f32.powf(-8.0 * (h + 1) as f32 / num_heads as f32))
            .collect();
        Self {
            cfg,
            cache,
            tables,
            mbps,
            ctx: ctx.iter().map(|&c| c as i32).collect(),
            num_heads,
            slopes,
            window: if f.window { bs + 3 } else { 0 },
            softcap: if f.softcap { 0.4 } else { 0.0 },
            scale: if f.alibi {
                0.5
            } else {
                1.0 / (d as f32).sqrt()
            },
            _t: std::marker::PhantomData,
        }
        .with_alibi(f.alibi)
    }

    fn with_alibi(mut self, on: bool) -> Self {
        if !on {
            self.slopes.clear();
        }
        self
    }

    fn params(&self) -> AttnParams<'_> {
        AttnParams {
            num_heads: self.num_heads,
            scale: self.scale,
            alibi_slopes: if self.slopes.is_empty() {
                None
            } else {
                Some(&self.slopes)
            },
            sliding_window: self.window,
            softcap: self.softcap,
        }
    }

    fn seqs(&self) -> PagedSeqs<'_> {
        PagedSeqs {
            block_tables: &self.tables,
            max_blocks_per_seq: self.mbps,
            context_lens: &self.ctx,
        }
    }

    /// Float64 reference: query row `q` (head `h`) at position `qpos` of sequence `s`.
    fn reference(&self, s: usize, h: usize, qpos: usize, q: &[T]) -> Vec<f64> {
        let (d, bs) = (self.cfg.head_dim(), self.cfg.block_size());
        let kvh = h / (self.num_heads / NUM_KV_HEADS);
        let data = self.cache.view::<T>().unwrap().data();
        let visible = |kpos: usize| self.window == 0 || qpos - kpos < self.window;
        let addr = |kpos: usize, kv: usize| {
            let b = self.tables[s * self.mbps + kpos / bs] as usize;
            ref_offset(
                NUM_LAYERS,
                bs,
                NUM_KV_HEADS,
                d,
                b,
                LAYER,
                kv,
                kpos % bs,
                kvh,
            )
        };
        // Pass 1: logits, gathered token by token through the block table.
        let mut logits = vec![f64::NEG_INFINITY; qpos + 1];
        for (kpos, logit) in logits.iter_mut().enumerate() {
            if !visible(kpos) {
                continue;
            }
            let ko = addr(kpos, 0);
            let mut dot = 0f64;
            for i in 0..d {
                dot += q[i].to_f32() as f64 * data[ko + i].to_f32() as f64;
            }
            let mut x = self.scale as f64 * dot;
            if self.softcap > 0.0 {
                let c = self.softcap as f64;
                x = c * (x / c).tanh();
            }
            if !self.slopes.is_empty() {
                x += self.slopes[h] as f64 * (kpos as f64 - qpos as f64);
            }
            *logit = x;
        }
        // Pass 2: softmax and weighted values.
        let mx = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = logits.iter().map(|x| (x - mx).exp()).sum();
        let mut out = vec![0f64; d];
        for (kpos, x) in logits.iter().enumerate() {
            if !visible(kpos) {
                continue;
            }
            let w = (x - mx).exp() / z;
            let vo = addr(kpos, 1);
            for i in 0..d {
                out[i] += w * data[vo + i].to_f32() as f64;
            }
        }
        out
    }
}

fn tol<T: KvElem>() -> f64 {
    match T::DTYPE {
        KvDtype::F32 => 1e-5,
        _ => 1e-2,
    }
}

/// Relative error against the row's largest reference magnitude.
fn check_row<T: KvElem>(got: &[T], want: &[f64], what: &str) {
    let scale = want.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f32() as f64;
        let err = (g - w).abs() / scale;
        assert!(
            err <= tol::<T>(),
            "{what}: element {i}: got {g}, want {w} (rel err {err:e})"
        );
    }
}

fn ctx_lens(bs: usize) -> Vec<usize> {
    vec![1, bs - 1, bs, bs + 1, 2 * bs, 2 * bs + 1, 6 * bs + 5]
}

fn run_decode<T: KvElem>(
    rng: &mut SmallRng,
    d: usize,
    gqa: usize,
    bs: usize,
    f: Features,
    ws: &mut AttnWorkspace,
) {
    let ctx = ctx_lens(bs);
    let case = Case::<T>::new(rng, d, gqa, bs, &ctx, f);
    let nh = case.num_heads;
    let q: Vec<T> = rand_vals(rng, ctx.len() * nh * d);
    let mut out = vec![T::from_f32(f32::NAN); q.len()];
    let view = case.cache.view::<T>().unwrap();
    paged_attention_decode(
        ws,
        view.layer(LAYER).unwrap(),
        &q,
        &case.seqs(),
        &case.params(),
        &mut out,
    )
    .unwrap();
    for (s, &c) in ctx.iter().enumerate() {
        for h in 0..nh {
            let r = (s * nh + h) * d;
            let want = case.reference(s, h, c - 1, &q[r..r + d]);
            let what = format!(
                "decode {:?} d={d} gqa={gqa} bs={bs} {f:?} seq {s} (ctx {c}) head {h}",
                T::DTYPE
            );
            check_row(&out[r..r + d], &want, &what);
        }
    }
}

fn run_prefill<T: KvElem>(
    rng: &mut SmallRng,
    d: usize,
    gqa: usize,
    bs: usize,
    f: Features,
    ws: &mut AttnWorkspace,
) {
    // (context length, new query tokens): single token, full prefill up to a boundary-1,
    // chunked prefill crossing a boundary, exactly a boundary, long with a long chunk, empty.
    let spec = [
        (1, 1),
        (bs - 1, bs - 1),
        (bs + 1, 3),
        (2 * bs, bs + 1),
        (6 * bs + 5, 21),
        (5, 0),
    ];
    let ctx: Vec<usize> = spec.iter().map(|s| s.0).collect();
    let case = Case::<T>::new(rng, d, gqa, bs, &ctx, f);
    let nh = case.num_heads;
    let mut qsl = vec![0i32];
    for &(_, ql) in &spec {
        qsl.push(qsl.last().unwrap() + ql as i32);
    }
    let ntok = *qsl.last().unwrap() as usize;
    let q: Vec<T> = rand_vals(rng, ntok * nh * d);
    let mut out = vec![T::from_f32(f32::NAN); q.len()];
    let view = case.cache.view::<T>().unwrap();
    paged_attention_prefill(
        ws,
        view.layer(LAYER).unwrap(),
        &q,
        &qsl,
        &case.seqs(),
        &case.params(),
        &mut out,
    )
    .unwrap();
    for (s, &(c, ql)) in spec.iter().enumerate() {
        for i in 0..ql {
            let tok = qsl[s] as usize + i;
            for h in 0..nh {
                let r = (tok * nh + h) * d;
                let want = case.reference(s, h, c - ql + i, &q[r..r + d]);
                let what = format!(
                    "prefill {:?} d={d} gqa={gqa} bs={bs} {f:?} seq {s} token {i} head {h}",
                    T::DTYPE
                );
                check_row(&out[r..r + d], &want, &what);
            }
        }
    }
}

/// The grid (see the file docs for the sampling).
fn grid(kernel: fn(KvDtype, &mut SmallRng, usize, usize, usize, Features, &mut AttnWorkspace)) {
    let full = !cfg!(debug_assertions);
    let mut rng = SmallRng::seed_from_u64(0x5eed_a77e);
    let mut ws = AttnWorkspace::new();
    let dtypes = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16];
    let mut idx = 0usize;
    for &d in &HEAD_DIMS {
        for &g in &GQA {
            for &bs in &BLOCK_SIZES {
                for (di, &dt) in dtypes.iter().enumerate() {
                    for fb in 0..8 {
                        let run = if full {
                            di == (idx + fb) % 3
                        } else {
                            di == idx % 3 && fb == idx % 8
                        };
                        if run {
                            kernel(dt, &mut rng, d, g, bs, Features::from_bits(fb), &mut ws);
                        }
                    }
                }
                idx += 1;
            }
        }
    }
}

fn decode_any(
    dt: KvDtype,
    rng: &mut SmallRng,
    d: usize,
    g: usize,
    bs: usize,
    f: Features,
    ws: &mut AttnWorkspace,
) {
    match dt {
        KvDtype::F32 => run_decode::<f32>(rng, d, g, bs, f, ws),
        KvDtype::F16 => run_decode::<f16>(rng, d, g, bs, f, ws),
        KvDtype::Bf16 => run_decode::<bf16>(rng, d, g, bs, f, ws),
    }
}

fn prefill_any(
    dt: KvDtype,
    rng: &mut SmallRng,
    d: usize,
    g: usize,
    bs: usize,
    f: Features,
    ws: &mut AttnWorkspace,
) {
    match dt {
        KvDtype::F32 => run_prefill::<f32>(rng, d, g, bs, f, ws),
        KvDtype::F16 => run_prefill::<f16>(rng, d, g, bs, f, ws),
        KvDtype::Bf16 => run_prefill::<bf16>(rng, d, g, bs, f, ws),
    }
}

#[test]
fn decode_matches_f64_reference_over_grid() {
    grid(decode_any);
}

#[test]
fn prefill_matches_f64_reference_over_grid() {
    grid(prefill_any);
}

#[test]
fn decode_equals_prefill_of_one_token() {
    let mut rng = SmallRng::seed_from_u64(7);
    let (d, gqa, bs) = (64, 4, 16);
    let ctx = ctx_lens(bs);
    let case = Case::<f32>::new(&mut rng, d, gqa, bs, &ctx, Features::from_bits(7));
    let q: Vec<f32> = rand_vals(&mut rng, ctx.len() * case.num_heads * d);
    let (mut a, mut b) = (vec![f32::NAN; q.len()], vec![f32::NAN; q.len()]);
    let qsl: Vec<i32> = (0..=ctx.len() as i32).collect();
    let mut ws = AttnWorkspace::new();
    let view = case.cache.view::<f32>().unwrap();
    let kv = view.layer(LAYER).unwrap();
    paged_attention_decode(&mut ws, kv, &q, &case.seqs(), &case.params(), &mut a).unwrap();
    paged_attention_prefill(&mut ws, kv, &q, &qsl, &case.seqs(), &case.params(), &mut b).unwrap();
    assert_eq!(a, b);
}

#[test]
fn results_do_not_depend_on_thread_count_and_workspace_stops_growing() {
    let mut rng = SmallRng::seed_from_u64(11);
    let (d, gqa, bs) = (128, 8, 16);
    let ctx: Vec<usize> = (0..24).map(|i| 1 + i * 13).collect();
    let case = Case::<bf16>::new(&mut rng, d, gqa, bs, &ctx, Features::from_bits(3));
    let q: Vec<bf16> = rand_vals(&mut rng, ctx.len() * case.num_heads * d);
    let view = case.cache.view::<bf16>().unwrap();
    let kv = view.layer(LAYER).unwrap();
    let mut outs = Vec::new();
    for threads in [1, 2, 3, 8] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let mut ws = AttnWorkspace::new();
        let mut out = vec![bf16::NAN; q.len()];
        pool.install(|| {
            paged_attention_decode(&mut ws, kv, &q, &case.seqs(), &case.params(), &mut out)
                .unwrap();
            let cap = ws.capacity_bytes();
            for _ in 0..3 {
                paged_attention_decode(&mut ws, kv, &q, &case.seqs(), &case.params(), &mut out)
                    .unwrap();
                assert_eq!(ws.capacity_bytes(), cap, "workspace grew in steady state");
            }
        });
        outs.push(out.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
    }
    assert!(outs.windows(2).all(|w| w[0] == w[1]));
}

#[test]
fn empty_decode_sequence_gets_zeros_and_empty_batch_is_ok() {
    let mut rng = SmallRng::seed_from_u64(3);
    let case = Case::<f16>::new(&mut rng, 64, 1, 8, &[0, 9], Features::from_bits(0));
    let q: Vec<f16> = rand_vals(&mut rng, 2 * case.num_heads * 64);
    let mut out = vec![f16::NAN; q.len()];
    let mut ws = AttnWorkspace::new();
    let view = case.cache.view::<f16>().unwrap();
    let kv = view.layer(LAYER).unwrap();
    paged_attention_decode(&mut ws, kv, &q, &case.seqs(), &case.params(), &mut out).unwrap();
    assert!(out[..case.num_heads * 64].iter().all(|x| x.to_f32() == 0.0));
    assert!(out.iter().all(|x| x.is_finite()));
    let empty = PagedSeqs {
        block_tables: &[],
        max_blocks_per_seq: 4,
        context_lens: &[],
    };
    paged_attention_decode(&mut ws, kv, &[], &empty, &case.params(), &mut []).unwrap();
    paged_attention_prefill(&mut ws, kv, &[], &[0], &empty, &case.params(), &mut []).unwrap();
}

#[test]
fn bad_inputs_are_typed_errors_and_leave_outputs_untouched() {
    let mut rng = SmallRng::seed_from_u64(5);
    let (d, bs) = (64, 8);
    let mut case = Case::<f32>::new(&mut rng, d, 2, bs, &[5, 17], Features::from_bits(0));
    let nh = case.num_heads;
    let q: Vec<f32> = rand_vals(&mut rng, 2 * nh * d);
    let mut out = vec![f32::NAN; q.len()];
    let mut ws = AttnWorkspace::new();
    let nb = case.cfg.num_blocks();
    let snapshot = case.cache.as_bytes().to_vec();
    {
        let view = case.cache.view::<f32>().unwrap();
        let kv = view.layer(LAYER).unwrap();
        let p = case.params();
        let mut decode =
            |seqs: &PagedSeqs<'_>, params: &AttnParams<'_>, q: &[f32], out: &mut [f32]| {
                paged_attention_decode(&mut ws, kv, q, seqs, params, out)
            };
        // Wrong query / out length.
        assert!(matches!(
            decode(&case.seqs(), &p, &q[1..], &mut out),
            Err(AttnError::LengthMismatch { what: "query", .. })
        ));
        assert!(matches!(
            decode(&case.seqs(), &p, &q, &mut out[1..]),
            Err(AttnError::LengthMismatch { what: "out", .. })
        ));
        // Heads not a multiple.
        let p3 = AttnParams { num_heads: 3, ..p };
        assert!(matches!(
            decode(&case.seqs(), &p3, &q, &mut out),
            Err(AttnError::HeadsNotMultiple { .. })
        ));
        // No heads at all, with the empty query and output that no length check refuses: a
        // typed error, not a GQA group of 0 (a division by zero in the work split).
        let p0 = AttnParams { num_heads: 0, ..p };
        let r = decode(&case.seqs(), &p0, &[], &mut []);
        assert!(
            matches!(r, Err(AttnError::HeadsNotMultiple { num_heads: 0, .. })),
            "decode, 0 heads: {r:?}"
        );
        // Bad scalars.
        for bad in [
            AttnParams {
                scale: f32::NAN,
                ..p
            },
            AttnParams {
                scale: f32::INFINITY,
                ..p
            },
            AttnParams {
                scale: f32::NEG_INFINITY,
                ..p
            },
            AttnParams { softcap: -1.0, ..p },
            AttnParams {
                softcap: f32::INFINITY,
                ..p
            },
            AttnParams {
                alibi_slopes: Some(&[f32::NAN, 0.0, 0.0, 0.0]),
                ..p
            },
            AttnParams {
                alibi_slopes: Some(&[0.0, 0.0, 0.0, f32::NEG_INFINITY]),
                ..p
            },
        ] {
            assert!(matches!(
                decode(&case.seqs(), &bad, &q, &mut out),
                Err(AttnError::BadParam { .. })
            ));
        }
        let short = [0.5f32];
        let pa = AttnParams {
            alibi_slopes: Some(&short),
            ..p
        };
        assert!(matches!(
            decode(&case.seqs(), &pa, &q, &mut out),
            Err(AttnError::LengthMismatch { .. })
        ));
        // Context length negative or beyond the table row.
        for bad_ctx in [[-1, 17], [5, (case.mbps * bs + 1) as i32]] {
            let s = PagedSeqs {
                context_lens: &bad_ctx,
                ..case.seqs()
            };
            assert!(matches!(
                decode(&s, &p, &q, &mut out),
                Err(AttnError::ContextLen { .. })
            ));
        }
        // A live block-table entry out of range (padding entries are never checked).
        for bad in [-1, nb as i32] {
            let mut t = case.tables.clone();
            t[case.mbps + 2] = bad;
            let s = PagedSeqs {
                block_tables: &t,
                ..case.seqs()
            };
            assert!(matches!(
                decode(&s, &p, &q, &mut out),
                Err(AttnError::BlockOutOfRange {
                    seq: 1,
                    index: 2,
                    ..
                })
            ));
        }
        let t = &case.tables[1..];
        let s = PagedSeqs {
            block_tables: t,
            ..case.seqs()
        };
        assert!(matches!(
            decode(&s, &p, &q, &mut out),
            Err(AttnError::LengthMismatch { .. })
        ));
        // Prefill: bad query_start_loc, too many query tokens.
        for (qsl, want_seq) in [([1, 2, 3], 0usize), ([0, 2, 1], 1)] {
            let r = paged_attention_prefill(&mut ws, kv, &q, &qsl, &case.seqs(), &p, &mut out);
            assert_eq!(r, Err(AttnError::QueryStartLoc { seq: want_seq }));
        }
        let p0 = AttnParams { num_heads: 0, ..p };
        let r = paged_attention_prefill(&mut ws, kv, &[], &[0, 1, 2], &case.seqs(), &p0, &mut []);
        assert!(
            matches!(r, Err(AttnError::HeadsNotMultiple { num_heads: 0, .. })),
            "prefill, 0 heads: {r:?}"
        );
        let qlong: Vec<f32> = rand_vals(&mut rng, 7 * nh * d);
        let mut olong = vec![f32::NAN; qlong.len()];
        let r = paged_attention_prefill(
            &mut ws,
            kv,
            &qlong,
            &[0, 6, 7],
            &case.seqs(),
            &p,
            &mut olong,
        );
        assert!(matches!(
            r,
            Err(AttnError::QueryLongerThanContext {
                seq: 0,
                q_len: 6,
                context_len: 5
            })
        ));
        assert!(olong.iter().all(|x| x.is_nan()));
    }
    assert!(
        out.iter().all(|x| x.is_nan()),
        "an error path wrote the output"
    );
    // reshape_and_cache: bad slots and lengths, nothing written.
    let row = NUM_KV_HEADS * d;
    let k: Vec<f32> = rand_vals(&mut rng, 3 * row);
    let mut view = case.cache.view_mut::<f32>().unwrap();
    for bad in [-2i64, (nb * bs) as i64, i64::MAX] {
        let r = reshape_and_cache(view.layer_mut(0).unwrap(), &k, &k, &[0, bad, 1]);
        assert!(matches!(r, Err(AttnError::SlotOutOfRange { token: 1, .. })));
    }
    let r = reshape_and_cache(view.layer_mut(0).unwrap(), &k[1..], &k, &[0, 1, 2]);
    assert!(matches!(
        r,
        Err(AttnError::LengthMismatch { what: "key", .. })
    ));
    assert!(matches!(
        view.layer_mut(NUM_LAYERS),
        Err(KvError::LayerOutOfRange { .. })
    ));
    // copy_blocks errors.
    for (pairs, want) in [
        (
            vec![(0u32, nb as u32)],
            KvError::BlockOutOfRange {
                block: nb as i64,
                num_blocks: nb,
            },
        ),
        (
            vec![(0, 1), (2, 1)],
            KvError::DuplicateDestination { block: 1 },
        ),
        (vec![(0, 1), (1, 2)], KvError::CopyOverlap { block: 1 }),
        (vec![(3, 3)], KvError::CopyOverlap { block: 3 }),
    ] {
        assert_eq!(copy_blocks(&mut view, &pairs), Err(AttnError::Kv(want)));
    }
    let _ = view;
    assert_eq!(
        case.cache.as_bytes(),
        &snapshot[..],
        "an error path wrote the cache"
    );
    // Wrong dtype view.
    assert!(matches!(
        case.cache.view::<f16>(),
        Err(KvError::DtypeMismatch { .. })
    ));
}

#[test]
fn copy_blocks_copies_whole_blocks_all_layers() {
    let mut rng = SmallRng::seed_from_u64(9);
    for dt in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
        let cfg = KvCacheConfig::new(3, 2, 80, 16, 40, dt).unwrap();
        let mut cache = HostKvCache::new(cfg).unwrap();
        rng.fill(cache.as_bytes_mut());
        let before = cache.as_bytes().to_vec();
        // A run of 3 consecutive, singles, and a long list (> 32 pairs takes the sorted path).
        let mut pairs = vec![(0u32, 10u32), (1, 11), (2, 12), (5, 20), (7, 3)];
        let run_of_3 = pairs.clone();
        match dt {
            KvDtype::F32 => copy_blocks(&mut cache.view_mut::<f32>().unwrap(), &pairs).unwrap(),
            KvDtype::F16 => copy_blocks(&mut cache.view_mut::<f16>().unwrap(), &pairs).unwrap(),
            KvDtype::Bf16 => copy_blocks(&mut cache.view_mut::<bf16>().unwrap(), &pairs).unwrap(),
        }
        let bpb = cfg.bytes_per_block();
        let blk = |b: &[u8], i: u32| b[i as usize * bpb..(i as usize + 1) * bpb].to_vec();
        for b in 0..40u32 {
            let want = match run_of_3.iter().find(|p| p.1 == b) {
                Some(&(s, _)) => blk(&before, s),
                None => blk(&before, b),
            };
            assert_eq!(blk(cache.as_bytes(), b), want, "{dt} block {b}");
        }
        // The byte-level host copy agrees, and handles > 32 pairs.
        pairs = (0..18u32).map(|i| (i, 20 + i)).collect();
        let before = cache.as_bytes().to_vec();
        cache.copy_blocks(&pairs).unwrap();
        for &(s, d) in &pairs {
            assert_eq!(blk(cache.as_bytes(), d), blk(&before, s));
        }
        let long: Vec<(u32, u32)> = (0..20u32).map(|i| (i, 20 + i)).collect();
        let mut bad = long.clone();
        bad.push((39, 0));
        assert_eq!(
            cache.copy_blocks(&bad),
            Err(KvError::CopyOverlap { block: 0 })
        );
        let mut dup = long.clone();
        dup.push((1, 25));
        assert_eq!(
            cache.copy_blocks(&dup),
            Err(KvError::DuplicateDestination { block: 25 })
        );
    }
}

/// The sequence of `tiny_cache`: blocks 0 and 1, 3 tokens.
fn tiny_seqs() -> PagedSeqs<'static> {
    PagedSeqs {
        block_tables: &[0, 1],
        max_blocks_per_seq: 2,
        context_lens: &[3],
    }
}

/// One f32 sequence of 3 tokens over two 4-token blocks, head dim 8, one head.
fn tiny_cache() -> HostKvCache {
    let cfg = KvCacheConfig::new(1, 1, 8, 4, 2, KvDtype::F32).unwrap();
    let mut cache = HostKvCache::new(cfg).unwrap();
    let k: Vec<f32> = (0..24).map(|i| i as f32 * 0.01).collect();
    let mut view = cache.view_mut::<f32>().unwrap();
    reshape_and_cache(view.layer_mut(0).unwrap(), &k, &k, &[0, 1, 2]).unwrap();
    cache
}

/// A window past i64 is no window at all, as on the CUDA path (which treats one past i32 so):
/// cast to i64 it wrapped negative, masked every key, the query's own included, and the
/// output was NaN.
#[test]
fn a_window_past_i64_is_no_window() {
    let cache = tiny_cache();
    let seqs = tiny_seqs();
    let view = cache.view::<f32>().unwrap();
    let (q, plain, mut ws) = (vec![0.5f32; 8], AttnParams::new(1, 8), AttnWorkspace::new());
    let mut want = vec![0f32; 8];
    paged_attention_decode(
        &mut ws,
        view.layer(0).unwrap(),
        &q,
        &seqs,
        &plain,
        &mut want,
    )
    .unwrap();
    for window in [usize::MAX, 1 << 63] {
        let p = AttnParams {
            sliding_window: window,
            ..plain
        };
        let mut got = vec![0f32; 8];
        paged_attention_decode(&mut ws, view.layer(0).unwrap(), &q, &seqs, &p, &mut got).unwrap();
        assert_eq!(got, want, "window {window}");
        let mut got = vec![0f32; 8];
        let qsl = [0, 1];
        paged_attention_prefill(
            &mut ws,
            view.layer(0).unwrap(),
            &q,
            &qsl,
            &seqs,
            &p,
            &mut got,
        )
        .unwrap();
        assert_eq!(got, want, "prefill, window {window}");
    }
}

/// A head count whose rows overflow is a typed error, not a panic (the product wrapped to 0,
/// passed the empty buffers' length checks, and the workspace's resize panicked).
#[test]
fn a_head_count_that_overflows_is_refused() {
    let cache = tiny_cache();
    let seqs = tiny_seqs();
    let view = cache.view::<f32>().unwrap();
    let mut ws = AttnWorkspace::new();
    for heads in [1usize << 61, usize::MAX] {
        let p = AttnParams {
            num_heads: heads,
            ..AttnParams::new(1, 8)
        };
        let r = paged_attention_decode(&mut ws, view.layer(0).unwrap(), &[], &seqs, &p, &mut []);
        assert!(
            matches!(r, Err(AttnError::BadParam { .. })),
            "decode {heads}: {r:?}"
        );
        let r = paged_attention_prefill(
            &mut ws,
            view.layer(0).unwrap(),
            &[],
            &[0, 1],
            &seqs,
            &p,
            &mut [],
        );
        assert!(
            matches!(r, Err(AttnError::BadParam { .. })),
            "prefill {heads}: {r:?}"
        );
    }
}

/// A NaN logit poisons its row, as the formula has it and the CUDA prefill kernels do: the
/// online softmax took a block whose visible logits were all NaN for an all-masked one
/// (`f32::max` skips NaN, so the block's max came out `-inf`) and dropped it, so a key of NaN
/// (a stale page, the arena's poison) vanished from a finite result, or not, depending on
/// whether it shared its block with another visible key.
#[test]
fn a_nan_key_poisons_its_row_even_alone_in_a_block() {
    // 5 tokens over two 4-token blocks: block 1 holds only token 4, whose key is NaN.
    let cfg = KvCacheConfig::new(1, 1, 8, 4, 2, KvDtype::F32).unwrap();
    let mut cache = HostKvCache::new(cfg).unwrap();
    let mut k: Vec<f32> = (0..40).map(|i| i as f32 * 0.01).collect();
    let v = k.clone();
    k[32..40].fill(f32::NAN);
    let mut view = cache.view_mut::<f32>().unwrap();
    reshape_and_cache(view.layer_mut(0).unwrap(), &k, &v, &[0, 1, 2, 3, 4]).unwrap();
    let seqs = PagedSeqs {
        block_tables: &[0, 1],
        max_blocks_per_seq: 2,
        context_lens: &[5],
    };
    let view = cache.view::<f32>().unwrap();
    let (q, p, mut ws) = (vec![0.5f32; 8], AttnParams::new(1, 8), AttnWorkspace::new());
    let mut out = vec![0f32; 8];
    paged_attention_decode(&mut ws, view.layer(0).unwrap(), &q, &seqs, &p, &mut out).unwrap();
    assert!(out.iter().all(|x| x.is_nan()), "decode: {out:?}");
    // Prefill of the last two tokens: token 3 does not see the NaN key, token 4 does.
    let q2 = vec![0.5f32; 16];
    let mut out = vec![0f32; 16];
    paged_attention_prefill(
        &mut ws,
        view.layer(0).unwrap(),
        &q2,
        &[0, 2],
        &seqs,
        &p,
        &mut out,
    )
    .unwrap();
    assert!(
        out[..8].iter().all(|x| x.is_finite()),
        "prefill row 0: {out:?}"
    );
    assert!(
        out[8..].iter().all(|x| x.is_nan()),
        "prefill row 1: {out:?}"
    );
}

/// Naive dense reference of the documented formula for one query row of one head: keys
/// `0..=qpos` of `k` / `v` (`[ctx][d]`, one KV head), scale only (no cap, bias or window),
/// float64 softmax; a key whose weight is 0 (a `-inf` score) contributes nothing, whatever its
/// value. `None` when some key with a non-zero weight has a non-finite value or score (the
/// row is then not finite, and its exact value is not the point).
fn dense_reference(q: &[f32], k: &[f32], v: &[f32], qpos: usize, scale: f32) -> Option<Vec<f64>> {
    let d = q.len();
    let logits: Vec<f64> = (0..=qpos)
        .map(|j| {
            let dot: f64 = (0..d).map(|i| q[i] as f64 * k[j * d + i] as f64).sum();
            scale as f64 * dot
        })
        .collect();
    if logits.iter().any(|x| x.is_nan() || *x == f64::INFINITY) {
        return None;
    }
    let mx = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = logits
        .iter()
        .map(|&x| {
            if x == f64::NEG_INFINITY {
                0.0
            } else {
                (x - mx).exp()
            }
        })
        .collect();
    let z: f64 = w.iter().sum();
    let mut out = vec![0f64; d];
    for j in 0..=qpos {
        if w[j] == 0.0 {
            continue;
        }
        if v[j * d..(j + 1) * d].iter().any(|x| !x.is_finite()) {
            return None;
        }
        for i in 0..d {
            out[i] += w[j] / z * v[j * d + i] as f64;
        }
    }
    Some(out)
}

/// One f32 sequence of `ctx` tokens, one KV head of head dim 8, 16-token blocks in table order;
/// returns the cache and the table.
fn dense_cache(k: &[f32], v: &[f32], ctx: usize) -> (HostKvCache, Vec<i32>) {
    let bs = 16;
    let nb = ctx.div_ceil(bs);
    let cfg = KvCacheConfig::new(1, 1, 8, bs, nb, KvDtype::F32).unwrap();
    let mut cache = HostKvCache::new(cfg).unwrap();
    let slots: Vec<i64> = (0..ctx as i64).collect();
    let mut view = cache.view_mut::<f32>().unwrap();
    reshape_and_cache(view.layer_mut(0).unwrap(), k, v, &slots).unwrap();
    (cache, (0..nb as i32).collect())
}

/// Causality holds for non-finite values too: a token of a prefill chunk whose value
/// overflowed (inf, as an f16 activation past 65504 does) must not reach the rows of the
/// tokens before it, which do not see it. The kernel packed four query rows into one
/// `acc += p * v` and skipped it only when all four weights were 0, so a row that does not
/// see the key got `0 * inf = NaN` from the rows after it in the same tile, depending on the
/// thread count (which sizes the tiles).
#[test]
fn a_masked_key_with_an_infinite_value_does_not_reach_the_rows_before_it() {
    let (ctx, d, bad) = (64, 8, 13);
    let mut rng = SmallRng::seed_from_u64(71);
    let k: Vec<f32> = rand_vals(&mut rng, ctx * d);
    let mut v: Vec<f32> = rand_vals(&mut rng, ctx * d);
    v[bad * d..(bad + 1) * d].fill(f32::INFINITY);
    let (cache, table) = dense_cache(&k, &v, ctx);
    let ctxs = [ctx as i32];
    let seqs = PagedSeqs {
        block_tables: &table,
        max_blocks_per_seq: table.len(),
        context_lens: &ctxs,
    };
    let q: Vec<f32> = rand_vals(&mut rng, ctx * d);
    let p = AttnParams::new(1, d);
    let view = cache.view::<f32>().unwrap();
    for threads in [1, 2, 4] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let mut out = vec![f32::NAN; ctx * d];
        pool.install(|| {
            paged_attention_prefill(
                &mut AttnWorkspace::new(),
                view.layer(0).unwrap(),
                &q,
                &[0, ctx as i32],
                &seqs,
                &p,
                &mut out,
            )
            .unwrap()
        });
        for row in 0..bad {
            let want = dense_reference(&q[row * d..(row + 1) * d], &k, &v, row, p.scale)
                .expect("rows before the infinite value are finite");
            check_row(
                &out[row * d..(row + 1) * d],
                &want,
                &format!("{threads} threads, row {row}"),
            );
        }
    }
}

/// A score of -inf takes no weight (crate::attn), whatever the key's value, and a head's
/// output does not depend on the other heads of its group: a token whose key and value both
/// overflowed to +inf, against a head whose query is negative (score -inf), left that head
/// finite with no other query head, but NaN beside three heads that score it +inf (their
/// rows are NaN, as documented), because the four rows shared one `acc += p * v`.
#[test]
fn a_minus_infinity_score_takes_no_weight_beside_heads_that_see_the_key() {
    let (ctx, d, bad) = (5, 8, 3);
    let mut rng = SmallRng::seed_from_u64(72);
    let mut k: Vec<f32> = rand_vals(&mut rng, ctx * d);
    let mut v: Vec<f32> = rand_vals(&mut rng, ctx * d);
    k[bad * d..(bad + 1) * d].fill(f32::INFINITY);
    v[bad * d..(bad + 1) * d].fill(f32::INFINITY);
    let (cache, table) = dense_cache(&k, &v, ctx);
    let ctxs = [ctx as i32];
    let seqs = PagedSeqs {
        block_tables: &table,
        max_blocks_per_seq: table.len(),
        context_lens: &ctxs,
    };
    let view = cache.view::<f32>().unwrap();
    // Head 0 negative (score -inf against the infinite key), heads 1..3 positive (+inf).
    let q: Vec<f32> = rand_vals::<f32>(&mut rng, 4 * d)
        .iter()
        .enumerate()
        .map(|(i, x)| if i < d { -x.abs() } else { x.abs() })
        .collect();
    let want = dense_reference(&q[..d], &k, &v, ctx - 1, 1.0 / (d as f32).sqrt())
        .expect("head 0 gives the infinite key no weight");
    let mut ws = AttnWorkspace::new();
    for heads in [1, 4] {
        let p = AttnParams::new(heads, d);
        let mut out = vec![f32::NAN; heads * d];
        let qh = &q[..heads * d];
        paged_attention_decode(&mut ws, view.layer(0).unwrap(), qh, &seqs, &p, &mut out).unwrap();
        check_row(&out[..d], &want, &format!("decode, {heads} heads: head 0"));
        assert!(
            out[d..].iter().all(|x| x.is_nan()),
            "heads 1.. see +inf: {out:?}"
        );
        let mut out = vec![f32::NAN; heads * d];
        paged_attention_prefill(
            &mut ws,
            view.layer(0).unwrap(),
            qh,
            &[0, 1],
            &seqs,
            &p,
            &mut out,
        )
        .unwrap();
        check_row(&out[..d], &want, &format!("prefill, {heads} heads: head 0"));
    }
}

/// A key whose weight underflows contributes nothing whatever its value (crate::attn), also
/// when the walk reached it before the larger score that makes its weight 0. Key 0 scores 0
/// and has an infinite value, key 1 scores 200: key 0's f32 weight exp(-200) is 0, and the
/// row is key 1's value. With one key per block the kernel weighted key 0 by 1 in block 0,
/// then rescaled the accumulator by exp(-200) = 0 when block 1 raised the max: `inf * 0`, a
/// NaN row, and a result that depended on the block size (2 put both keys in one block, whose
/// max is taken first, and gave the value). The split-K CUDA decode merges partitions the
/// documented way, so the oracle flagged a correct kernel.
#[test]
fn an_infinite_value_whose_weight_underflows_later_contributes_nothing() {
    let d = 8;
    let big = vec![25f32; d]; // q . k = 200 with q = 1 and scale 1
    let vbig: Vec<f32> = (0..d).map(|i| i as f32).collect();
    let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for bs in [1, 2] {
        for inf_first in [true, false] {
            let (mut k, mut v) = (Vec::new(), Vec::new());
            for first in [inf_first, !inf_first] {
                if first {
                    k.extend(vec![0f32; d]);
                    v.extend(vec![f32::INFINITY; d]);
                } else {
                    k.extend(&big);
                    v.extend(&vbig);
                }
            }
            let cfg = KvCacheConfig::new(1, 1, d, bs, 2, KvDtype::F32).unwrap();
            let mut cache = HostKvCache::new(cfg).unwrap();
            let mut view = cache.view_mut::<f32>().unwrap();
            reshape_and_cache(view.layer_mut(0).unwrap(), &k, &v, &[0, 1]).unwrap();
            let seqs = PagedSeqs {
                block_tables: &[0, 1],
                max_blocks_per_seq: 2,
                context_lens: &[2],
            };
            let p = AttnParams {
                scale: 1.0,
                ..AttnParams::new(1, d)
            };
            let view = cache.view::<f32>().unwrap();
            let kv = view.layer(0).unwrap();
            let mut ws = AttnWorkspace::new();
            let mut out = vec![0f32; d];
            paged_attention_decode(&mut ws, kv, &vec![1f32; d], &seqs, &p, &mut out).unwrap();
            assert_eq!(
                bits(&out),
                bits(&vbig),
                "decode, bs {bs}, inf first {inf_first}"
            );
            let mut pre = vec![0f32; 2 * d];
            paged_attention_prefill(
                &mut ws,
                kv,
                &vec![1f32; 2 * d],
                &[0, 2],
                &seqs,
                &p,
                &mut pre,
            )
            .unwrap();
            assert_eq!(
                bits(&pre[d..]),
                bits(&vbig),
                "prefill, bs {bs}, inf first {inf_first}"
            );
        }
    }
}

/// As above, but the max reaches the infinite value's key in steps that each stay below the
/// ~87.3 (`-ln(f32::MIN_POSITIVE)`) that underflow a rescale to 0: key 0 scores 0 (value inf),
/// key 1 scores 60 (value 0), key 2 scores 120 (value `vbig`). Key 0's f32 weight exp(-120) is 0, so the row is key 2's
/// value (key 1's weight exp(-60) adds 0 to it and nothing to the sum). With one key per block
/// the walk weighted key 0 by 1, then rescaled `inf` by exp(-60) twice: `inf`, not 0, and a
/// row of inf where the formula has `vbig` (with 3 keys per block it gave `vbig`).
#[test]
fn an_infinite_value_whose_weight_underflows_over_several_rescales_contributes_nothing() {
    let d = 8;
    let vbig: Vec<f32> = (0..d).map(|i| i as f32).collect();
    let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut k = Vec::new();
    for s in [0f32, 60.0, 120.0] {
        k.extend(vec![s / d as f32; d]); // q . k = s with q = 1 and scale 1
    }
    let mut v = vec![f32::INFINITY; d];
    v.extend(vec![0f32; d]);
    v.extend(&vbig);
    for bs in [1, 3] {
        let blocks = 3usize.div_ceil(bs);
        let cfg = KvCacheConfig::new(1, 1, d, bs, blocks, KvDtype::F32).unwrap();
        let mut cache = HostKvCache::new(cfg).unwrap();
        let mut view = cache.view_mut::<f32>().unwrap();
        reshape_and_cache(view.layer_mut(0).unwrap(), &k, &v, &[0, 1, 2]).unwrap();
        let table: Vec<i32> = (0..blocks as i32).collect();
        let seqs = PagedSeqs {
            block_tables: &table,
            max_blocks_per_seq: blocks,
            context_lens: &[3],
        };
        let p = AttnParams {
            scale: 1.0,
            ..AttnParams::new(1, d)
        };
        let view = cache.view::<f32>().unwrap();
        let kv = view.layer(0).unwrap();
        let mut ws = AttnWorkspace::new();
        let mut out = vec![0f32; d];
        paged_attention_decode(&mut ws, kv, &vec![1f32; d], &seqs, &p, &mut out).unwrap();
        assert_eq!(bits(&out), bits(&vbig), "decode, bs {bs}: {out:?}");
        let mut pre = vec![0f32; 3 * d];
        paged_attention_prefill(
            &mut ws,
            kv,
            &vec![1f32; 3 * d],
            &[0, 3],
            &seqs,
            &p,
            &mut pre,
        )
        .unwrap();
        assert_eq!(
            bits(&pre[2 * d..]),
            bits(&vbig),
            "prefill, bs {bs}: {pre:?}"
        );
    }
}

/// The scale multiplies the dot product (`s = scale * dot(q, k)`, crate::attn and every CUDA
/// kernel), not the query. The kernel pre-scaled the query, which overflows and rounds
/// differently: a large scale times a large query was +inf (a NaN row) where the documented
/// score is finite, and a `q·k` past f32 under a small scale was finite where the documented
/// score (and the kernels') is +inf. Decode and prefill, both directions.
#[test]
fn the_scale_multiplies_the_dot_product_not_the_query() {
    let (ctx, d) = (3, 8);
    let mut rng = SmallRng::seed_from_u64(91);
    let v: Vec<f32> = rand_vals(&mut rng, ctx * d);
    let mean: Vec<f64> = (0..d)
        .map(|i| (0..ctx).map(|j| v[j * d + i] as f64).sum::<f64>() / ctx as f64)
        .collect();
    // (query, key, scale, finite): every key the same, so a finite row is the mean of V.
    // 1e10 * 1e30 overflows f32, 8 * 1e10 * 1e-20 * 1e30 = 8e21 does not; 8 * 1e19 * 1e19
    // overflows f32 (score +inf), 1e19 * 1e-30 * 1e19 does not.
    for (qv, kv, scale, finite) in [
        (1e10f32, 1e-20f32, 1e30f32, true),
        (1e19, 1e19, 1e-30, false),
    ] {
        let k = vec![kv; ctx * d];
        let (cache, table) = dense_cache(&k, &v, ctx);
        let ctxs = [ctx as i32];
        let seqs = PagedSeqs {
            block_tables: &table,
            max_blocks_per_seq: table.len(),
            context_lens: &ctxs,
        };
        let mut p = AttnParams::new(1, d);
        p.scale = scale;
        let view = cache.view::<f32>().unwrap();
        let q = vec![qv; ctx * d];
        let mut dec = vec![0f32; d];
        paged_attention_decode(
            &mut AttnWorkspace::new(),
            view.layer(0).unwrap(),
            &q[..d],
            &seqs,
            &p,
            &mut dec,
        )
        .unwrap();
        let mut pre = vec![0f32; ctx * d];
        paged_attention_prefill(
            &mut AttnWorkspace::new(),
            view.layer(0).unwrap(),
            &q,
            &[0, ctx as i32],
            &seqs,
            &p,
            &mut pre,
        )
        .unwrap();
        let what = format!("q {qv}, k {kv}, scale {scale}");
        if finite {
            check_row(&dec, &mean, &format!("{what}: decode"));
            check_row(&pre[(ctx - 1) * d..], &mean, &format!("{what}: prefill"));
        } else {
            assert!(dec.iter().all(|x| x.is_nan()), "{what}: decode {dec:?}");
            assert!(pre.iter().all(|x| x.is_nan()), "{what}: prefill {pre:?}");
        }
    }
}

/// A row whose every visible score is -inf has nothing to attend to and is all zero, like
/// padding (crate::attn; the CUDA kernels do the same), not the formula's 0 / 0: both keys
/// overflowed to +inf and the query is negative, so each score is -inf and the weights' sum is
/// 0. Rows that also see a finite key are the formula's. Decode and prefill.
#[test]
fn a_row_whose_every_score_is_minus_infinity_is_zero() {
    let (ctx, d) = (3, 8);
    let mut rng = SmallRng::seed_from_u64(73);
    // Keys 0 and 1 infinite, key 2 finite; values finite.
    let mut k: Vec<f32> = rand_vals(&mut rng, ctx * d);
    k[..2 * d].fill(f32::INFINITY);
    let v: Vec<f32> = rand_vals(&mut rng, ctx * d);
    let (cache, table) = dense_cache(&k, &v, ctx);
    let ctxs = [ctx as i32];
    let seqs = PagedSeqs {
        block_tables: &table,
        max_blocks_per_seq: table.len(),
        context_lens: &ctxs,
    };
    let view = cache.view::<f32>().unwrap();
    let q: Vec<f32> = rand_vals::<f32>(&mut rng, ctx * d)
        .iter()
        .map(|x| -x.abs())
        .collect();
    let p = AttnParams::new(1, d);
    let mut ws = AttnWorkspace::new();
    // Prefill of all three tokens: rows 0 and 1 see only infinite keys (zero), row 2 sees key
    // 2 too (its value: the other two weigh 0).
    let mut out = vec![f32::NAN; ctx * d];
    paged_attention_prefill(
        &mut ws,
        view.layer(0).unwrap(),
        &q,
        &[0, ctx as i32],
        &seqs,
        &p,
        &mut out,
    )
    .unwrap();
    assert!(
        out[..2 * d].iter().all(|&x| x == 0.0),
        "prefill rows 0 and 1: {:?}",
        &out[..2 * d]
    );
    let want = dense_reference(&q[2 * d..], &k, &v, 2, p.scale).expect("row 2 sees key 2");
    check_row(&out[2 * d..], &want, "prefill row 2");
    // Decode of a sequence of the first two tokens only.
    let short = [2];
    let seqs = PagedSeqs {
        context_lens: &short,
        ..seqs
    };
    let mut out = vec![f32::NAN; d];
    paged_attention_decode(
        &mut ws,
        view.layer(0).unwrap(),
        &q[d..2 * d],
        &seqs,
        &p,
        &mut out,
    )
    .unwrap();
    assert!(out.iter().all(|&x| x == 0.0), "decode: {out:?}");
}

/// A half-precision output is the f32 kernels' result rounded once, to nearest even: the walk
/// widens every key, value and query exactly and does the same f32 arithmetic whatever the
/// dtype, so an f16 / bf16 cache must give, bit for bit, `T::from_f32` of what the same values
/// in an f32 cache give. (The reference grid's 1e-2 tolerance cannot tell rounding from
/// truncation, which is up to one bf16 ulp, 2^-8 relative, off.) Decode and prefill, every
/// feature on.
#[test]
fn a_half_precision_output_is_the_f32_result_rounded_to_nearest_even() {
    fn run<T: KvElem>(seed: u64) {
        let mut rng = SmallRng::seed_from_u64(seed);
        let (d, gqa, bs) = (64, 4, 8);
        let ctx = [1, bs - 1, bs + 1, 3 * bs + 5];
        let case = Case::<T>::new(&mut rng, d, gqa, bs, &ctx, Features::from_bits(7));
        // The same cache in f32: every element widened (exact), NaN poison included.
        let wide_cfg = KvCacheConfig::new(
            NUM_LAYERS,
            NUM_KV_HEADS,
            d,
            bs,
            case.cfg.num_blocks(),
            KvDtype::F32,
        )
        .unwrap();
        let mut wide = HostKvCache::new(wide_cfg).unwrap();
        let half_view = case.cache.view::<T>().unwrap();
        for (w, h) in wide
            .view_mut::<f32>()
            .unwrap()
            .data_mut()
            .iter_mut()
            .zip(half_view.data())
        {
            *w = h.to_f32();
        }
        let wide_view = wide.view::<f32>().unwrap();
        let nh = case.num_heads;
        let q: Vec<T> = rand_vals(&mut rng, ctx.len() * nh * d);
        let q32: Vec<f32> = q.iter().map(|x| x.to_f32()).collect();
        let mut ws = AttnWorkspace::new();
        let check = |got: &[T], want: &[f32], what: &str| {
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                assert!(
                    w.is_finite() && g.to_f32().to_bits() == T::from_f32(*w).to_f32().to_bits(),
                    "{what} {:?}: element {i}: got {}, want {w} rounded to nearest, {}",
                    T::DTYPE,
                    g.to_f32(),
                    T::from_f32(*w).to_f32()
                );
            }
        };
        let (mut out, mut want) = (
            vec![T::from_f32(f32::NAN); q.len()],
            vec![f32::NAN; q.len()],
        );
        let (seqs, p) = (case.seqs(), case.params());
        paged_attention_decode(
            &mut ws,
            half_view.layer(LAYER).unwrap(),
            &q,
            &seqs,
            &p,
            &mut out,
        )
        .unwrap();
        paged_attention_decode(
            &mut ws,
            wide_view.layer(LAYER).unwrap(),
            &q32,
            &seqs,
            &p,
            &mut want,
        )
        .unwrap();
        check(&out, &want, "decode");
        // Prefill: the whole context of every sequence.
        let mut qsl = vec![0i32];
        for &c in &ctx {
            qsl.push(qsl.last().unwrap() + c as i32);
        }
        let ntok = *qsl.last().unwrap() as usize;
        let q: Vec<T> = rand_vals(&mut rng, ntok * nh * d);
        let q32: Vec<f32> = q.iter().map(|x| x.to_f32()).collect();
        let (mut out, mut want) = (
            vec![T::from_f32(f32::NAN); q.len()],
            vec![f32::NAN; q.len()],
        );
        paged_attention_prefill(
            &mut ws,
            half_view.layer(LAYER).unwrap(),
            &q,
            &qsl,
            &seqs,
            &p,
            &mut out,
        )
        .unwrap();
        paged_attention_prefill(
            &mut ws,
            wide_view.layer(LAYER).unwrap(),
            &q32,
            &qsl,
            &seqs,
            &p,
            &mut want,
        )
        .unwrap();
        check(&out, &want, "prefill");
    }
    run::<f16>(31);
    run::<bf16>(32);
}
