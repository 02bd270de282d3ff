//! The CPU attention kernels walk a sequence's blocks for several KV heads at once, as many as
//! the batch shape and thread count allow (one head per walk for a lone sequence on many
//! threads, all of them for a large batch, a few per prefill tile). Each query row's arithmetic
//! must not depend on that: the same row computed in any batch, on any thread count, by decode
//! or by a one-token prefill, or inside any prefill tile, is bit-identical.

use half::f16;
use pagedkv::attn::cpu::{paged_attention_decode, paged_attention_prefill, reshape_and_cache};
use pagedkv::attn::AttnWorkspace;
use pagedkv::kv::{AttnParams, HostKvCache, KvCacheConfig, KvElem, PagedSeqs};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const NKV: usize = 8;
const GROUP: usize = 2;
const NH: usize = NKV * GROUP;
const D: usize = 64;
const BS: usize = 16;
const THREADS: [usize; 4] = [1, 2, 3, 16];

struct Setup {
    cache: HostKvCache,
    tables: Vec<i32>,
    mbps: usize,
    ctx: Vec<i32>,
    slopes: Vec<f32>,
}

impl Setup {
    fn new(rng: &mut SmallRng, ctx: &[usize]) -> Self {
        let mbps = ctx.iter().map(|c| c.div_ceil(BS)).max().unwrap_or(1);
        let nb = ctx.len() * mbps;
        let cfg = KvCacheConfig::new(2, NKV, D, BS, nb, f16::DTYPE).unwrap();
        let mut cache = HostKvCache::new(cfg).unwrap();
        for x in cache.view_mut::<f16>().unwrap().data_mut() {
            *x = f16::from_f32(rng.gen_range(-2.0..2.0));
        }
        let mut perm: Vec<i32> = (0..nb as i32).collect();
        for i in (1..nb).rev() {
            perm.swap(i, rng.gen_range(0..=i));
        }
        Setup {
            cache,
            tables: perm,
            mbps,
            ctx: ctx.iter().map(|&c| c as i32).collect(),
            slopes: (0..NH).map(|h| 0.5f32.powi(h as i32 % 5 + 1)).collect(),
        }
    }

    fn params(&self) -> AttnParams<'_> {
        AttnParams {
            num_heads: NH,
            scale: 0.3,
            alibi_slopes: Some(&self.slopes),
            sliding_window: 100,
            softcap: 20.0,
        }
    }

    /// The batch of sequences `which`, each with context `ctx[s]` (or `lens[i]` if given).
    fn seqs_of(&self, which: &[usize], lens: &[i32]) -> (Vec<i32>, Vec<i32>) {
        let tables = which
            .iter()
            .flat_map(|&s| {
                self.tables[s * self.mbps..(s + 1) * self.mbps]
                    .iter()
                    .copied()
            })
            .collect();
        (tables, lens.to_vec())
    }
}

fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}

fn bits(x: &[f16]) -> Vec<u16> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The first element where `a` and `b` differ (a length difference counts), for a short message.
fn first_diff(a: &[u16], b: &[u16]) -> Option<usize> {
    (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i))
}

fn decode(s: &Setup, which: &[usize], lens: &[i32], query: &[f16], threads: usize) -> Vec<u16> {
    let (tables, ctx) = s.seqs_of(which, lens);
    let seqs = PagedSeqs {
        block_tables: &tables,
        max_blocks_per_seq: s.mbps,
        context_lens: &ctx,
    };
    let view = s.cache.view::<f16>().unwrap();
    let mut out = vec![f16::NAN; query.len()];
    in_pool(threads, || {
        let mut ws = AttnWorkspace::new();
        paged_attention_decode(
            &mut ws,
            view.layer(1).unwrap(),
            query,
            &seqs,
            &s.params(),
            &mut out,
        )
        .unwrap()
    });
    bits(&out)
}

#[test]
fn a_decode_row_is_the_same_in_any_batch_on_any_thread_count() {
    let mut rng = SmallRng::seed_from_u64(23);
    let ctx = [1usize, 17, 250, 96, 130, 64, 3];
    let s = Setup::new(&mut rng, &ctx);
    let all: Vec<usize> = (0..ctx.len()).collect();
    let q: Vec<f16> = (0..ctx.len() * NH * D)
        .map(|_| f16::from_f32(rng.gen_range(-2.0..2.0)))
        .collect();
    let row = NH * D;
    let batch: Vec<Vec<u16>> = THREADS
        .iter()
        .map(|&t| decode(&s, &all, &s.ctx, &q, t))
        .collect();
    for (t, b) in THREADS.iter().zip(&batch) {
        let at = first_diff(b, &batch[0]);
        assert_eq!(
            at, None,
            "batch decode on {t} threads differs from 1 thread"
        );
    }
    assert!(batch[0].iter().all(|&b| f16::from_bits(b).is_finite()));
    for seq in 0..ctx.len() {
        let q1 = &q[seq * row..(seq + 1) * row];
        for &t in &THREADS {
            let alone = decode(&s, &[seq], &s.ctx[seq..seq + 1], q1, t);
            let at = first_diff(&alone, &batch[0][seq * row..(seq + 1) * row]);
            assert_eq!(
                at, None,
                "sequence {seq} decoded alone on {t} threads differs from the batch"
            );
        }
    }
}

#[test]
fn a_prefill_row_is_the_same_in_any_tile_and_as_a_decode() {
    let mut rng = SmallRng::seed_from_u64(29);
    let ctx = [300usize, 45];
    let s = Setup::new(&mut rng, &ctx);
    // The last `n` tokens of sequence 0 as one prefill chunk, beside sequence 1's last 5.
    let (n, n1) = (70usize, 5usize);
    let q: Vec<f16> = (0..(n + n1) * NH * D)
        .map(|_| f16::from_f32(rng.gen_range(-2.0..2.0)))
        .collect();
    let row = NH * D;
    let (tables, lens) = s.seqs_of(&[0, 1], &s.ctx);
    let seqs = PagedSeqs {
        block_tables: &tables,
        max_blocks_per_seq: s.mbps,
        context_lens: &lens,
    };
    let starts = [0, n as i32, (n + n1) as i32];
    let view = s.cache.view::<f16>().unwrap();
    let chunked: Vec<Vec<u16>> = THREADS
        .iter()
        .map(|&t| {
            let mut out = vec![f16::NAN; q.len()];
            in_pool(t, || {
                let mut ws = AttnWorkspace::new();
                let kv = view.layer(1).unwrap();
                paged_attention_prefill(&mut ws, kv, &q, &starts, &seqs, &s.params(), &mut out)
                    .unwrap()
            });
            bits(&out)
        })
        .collect();
    for (t, c) in THREADS.iter().zip(&chunked) {
        let at = first_diff(c, &chunked[0]);
        assert_eq!(at, None, "prefill on {t} threads differs from 1 thread");
    }
    // Each token of sequence 0's chunk, as a decode at its own position.
    for i in 0..n {
        let pos = ctx[0] - n + i;
        let q1 = &q[i * row..(i + 1) * row];
        let one = decode(&s, &[0], &[pos as i32 + 1], q1, 2);
        let at = first_diff(&one, &chunked[0][i * row..(i + 1) * row]);
        assert_eq!(
            at, None,
            "token {i} (position {pos}) decoded alone differs from the prefill chunk"
        );
    }
}

/// A row that sees a whole block with neither soft-cap nor ALiBi is only scaled, in a
/// vectorised loop; ALiBi with zero slopes adds exactly 0 and takes the per-key path: the two
/// must round alike (a fused multiply-add or a pre-scaled query in one of them would not).
#[test]
fn the_scale_only_path_rounds_as_the_per_key_path() {
    let mut rng = SmallRng::seed_from_u64(31);
    let ctx = [300usize, 47, 16];
    let s = Setup::new(&mut rng, &ctx);
    let all: Vec<usize> = (0..ctx.len()).collect();
    let q: Vec<f16> = (0..ctx.len() * NH * D)
        .map(|_| f16::from_f32(rng.gen_range(-2.0..2.0)))
        .collect();
    let zeros = vec![0.0f32; NH];
    let (tables, lens) = s.seqs_of(&all, &s.ctx);
    let seqs = PagedSeqs {
        block_tables: &tables,
        max_blocks_per_seq: s.mbps,
        context_lens: &lens,
    };
    let view = s.cache.view::<f16>().unwrap();
    let run = |slopes: Option<&[f32]>, window: usize| {
        let params = AttnParams {
            num_heads: NH,
            scale: 0.3,
            alibi_slopes: slopes,
            sliding_window: window,
            softcap: 0.0,
        };
        let mut out = vec![f16::NAN; q.len()];
        let mut ws = AttnWorkspace::new();
        paged_attention_decode(
            &mut ws,
            view.layer(1).unwrap(),
            &q,
            &seqs,
            &params,
            &mut out,
        )
        .unwrap();
        bits(&out)
    };
    for window in [0, 100] {
        let (plain, per_key) = (run(None, window), run(Some(&zeros), window));
        assert_eq!(first_diff(&plain, &per_key), None, "window {window}");
    }
}

/// The bits of `x` as `f32`, every NaN as one (which NaN payload survives is unspecified).
fn bits_any<T: KvElem>(x: &[T]) -> Vec<u32> {
    x.iter()
        .map(|v| {
            let f = v.to_f32();
            if f.is_nan() {
                f32::NAN.to_bits()
            } else {
                f.to_bits()
            }
        })
        .collect()
}

/// One case of [`edge_shapes_give_the_same_bits_in_any_tile_batch_and_as_decodes`]: a random
/// batch of sequences of one shape, prefilled (the last `q_len` tokens of each) on several
/// thread counts, decoded as a batch, and each prefill token decoded alone at its position.
fn edge_case<T: KvElem>(rng: &mut SmallRng, d: usize, bs: usize, group: usize, what: &str) {
    let nkv: usize = rng.gen_range(1..=2);
    let nh = nkv * group;
    let nseq: usize = rng.gen_range(1..=3);
    let ctx: Vec<usize> = (0..nseq)
        .map(|_| match rng.gen_range(0..4) {
            0 => 1,
            1 => bs * rng.gen_range(1..=3usize),
            2 => bs * rng.gen_range(1..=3usize) + 1,
            _ => rng.gen_range(2..=40usize),
        })
        .collect();
    // Chunks of 1 token too, and whole contexts.
    let q_len: Vec<usize> = ctx
        .iter()
        .map(|&c| match rng.gen_range(0..3) {
            0 => 1,
            1 => c,
            _ => rng.gen_range(1..=c),
        })
        .collect();
    let mbps = ctx.iter().map(|c| c.div_ceil(bs)).max().unwrap_or(1);
    let nb: usize = ctx.iter().map(|c| c.div_ceil(bs)).sum();
    let cfg = KvCacheConfig::new(1, nkv, d, bs, nb, T::DTYPE).unwrap();
    let mut cache = HostKvCache::new(cfg).unwrap();
    let mut perm: Vec<i32> = (0..nb as i32).collect();
    for i in (1..nb).rev() {
        perm.swap(i, rng.gen_range(0..=i));
    }
    let mut tables = vec![0i32; nseq * mbps];
    let mut next = 0;
    for s in 0..nseq {
        for j in 0..ctx[s].div_ceil(bs) {
            tables[s * mbps + j] = perm[next];
            next += 1;
        }
    }
    // Keys of a large magnitude in some cases (scores hundreds apart: weights that underflow
    // to 0, rescales by 0), a few infinite key rows (scores of +-inf, NaN), a few values of
    // +-inf or NaN (reaching only the rows that weigh them).
    let kmag: f32 = if rng.gen_bool(0.5) { 40.0 } else { 1.0 };
    let row = nkv * d;
    let ntok: usize = ctx.iter().sum();
    let mut k = Vec::with_capacity(ntok * row);
    let mut v = Vec::with_capacity(ntok * row);
    for _ in 0..ntok * nkv {
        let special = |rng: &mut SmallRng| match rng.gen_range(0..3) {
            0 => f32::INFINITY,
            1 => f32::NEG_INFINITY,
            _ => f32::NAN,
        };
        let kinf = rng
            .gen_bool(0.03)
            .then(|| special(rng))
            .filter(|x| !x.is_nan());
        let vbad = rng.gen_bool(0.06).then(|| special(rng));
        for _ in 0..d {
            let kx = kinf.unwrap_or_else(|| kmag * rng.gen_range(-2.0f32..2.0));
            let vx = vbad.unwrap_or_else(|| rng.gen_range(-2.0f32..2.0));
            k.push(T::from_f32(kx));
            v.push(T::from_f32(vx));
        }
    }
    let slots: Vec<i64> = (0..nseq)
        .flat_map(|s| {
            let t = &tables[s * mbps..];
            (0..ctx[s]).map(move |p| (t[p / bs] as usize * bs + p % bs) as i64)
        })
        .collect();
    {
        let mut view = cache.view_mut::<T>().unwrap();
        reshape_and_cache(view.layer_mut(0).unwrap(), &k, &v, &slots).unwrap();
    }
    let slopes: Vec<f32> = (0..nh).map(|h| 0.5f32.powi(h as i32 % 4 + 1)).collect();
    let params = AttnParams {
        num_heads: nh,
        scale: 1.0 / (d as f32).sqrt(),
        alibi_slopes: rng.gen_bool(0.3).then_some(&slopes[..]),
        sliding_window: if rng.gen_bool(0.4) {
            rng.gen_range(1..=2 * bs + 3)
        } else {
            0
        },
        softcap: if rng.gen_bool(0.25) { 30.0 } else { 0.0 },
    };
    let hd = nh * d;
    let ntq: usize = q_len.iter().sum();
    let q: Vec<T> = (0..ntq * hd)
        .map(|_| T::from_f32(rng.gen_range(-2.0f32..2.0)))
        .collect();
    let mut starts = vec![0i32];
    for &n in &q_len {
        starts.push(starts.last().unwrap() + n as i32);
    }
    let ctx_i: Vec<i32> = ctx.iter().map(|&c| c as i32).collect();
    let seqs = PagedSeqs {
        block_tables: &tables,
        max_blocks_per_seq: mbps,
        context_lens: &ctx_i,
    };
    let view = cache.view::<T>().unwrap();
    let kv = view.layer(0).unwrap();
    let case = format!("{what}: d {d}, bs {bs}, group {group}, nkv {nkv}, ctx {ctx:?}, q_len {q_len:?}, window {}, softcap {}, alibi {}, kmag {kmag}", params.sliding_window, params.softcap, params.alibi_slopes.is_some());
    let prefill: Vec<Vec<u32>> = THREADS
        .iter()
        .map(|&t| {
            let mut out = vec![T::from_f32(f32::NAN); q.len()];
            in_pool(t, || {
                let mut ws = AttnWorkspace::new();
                paged_attention_prefill(&mut ws, kv, &q, &starts, &seqs, &params, &mut out).unwrap()
            });
            bits_any(&out)
        })
        .collect();
    for (t, p) in THREADS.iter().zip(&prefill) {
        let at = first_diff_u32(p, &prefill[0]);
        assert_eq!(
            at, None,
            "{case}: prefill on {t} threads differs from 1 thread"
        );
    }
    let decode = |q1: &[T], s: usize, len: i32, threads: usize| {
        let t1 = &tables[s * mbps..(s + 1) * mbps];
        let l1 = [len];
        let seqs1 = PagedSeqs {
            block_tables: t1,
            max_blocks_per_seq: mbps,
            context_lens: &l1,
        };
        let mut out = vec![T::from_f32(f32::NAN); q1.len()];
        in_pool(threads, || {
            let mut ws = AttnWorkspace::new();
            paged_attention_decode(&mut ws, kv, q1, &seqs1, &params, &mut out).unwrap()
        });
        bits_any(&out)
    };
    // Every prefill token, decoded alone at its position.
    for s in 0..nseq {
        for i in 0..q_len[s] {
            let tok = starts[s] as usize + i;
            let pos = ctx[s] - q_len[s] + i;
            let q1 = &q[tok * hd..(tok + 1) * hd];
            let one = decode(q1, s, pos as i32 + 1, 1 + tok % 3);
            let at = first_diff_u32(&one, &prefill[0][tok * hd..(tok + 1) * hd]);
            assert_eq!(
                at, None,
                "{case}: sequence {s} token {i} (position {pos}) decoded alone differs from the prefill"
            );
        }
    }
    // The last tokens of all sequences as one decode batch, on 1 and 3 threads.
    let last: Vec<T> = (0..nseq)
        .flat_map(|s| {
            let tok = starts[s + 1] as usize - 1;
            q[tok * hd..(tok + 1) * hd].iter().copied()
        })
        .collect();
    for threads in [1, 3] {
        let mut out = vec![T::from_f32(f32::NAN); last.len()];
        in_pool(threads, || {
            let mut ws = AttnWorkspace::new();
            paged_attention_decode(&mut ws, kv, &last, &seqs, &params, &mut out).unwrap()
        });
        let got = bits_any(&out);
        for s in 0..nseq {
            let tok = starts[s + 1] as usize - 1;
            let at = first_diff_u32(
                &got[s * hd..(s + 1) * hd],
                &prefill[0][tok * hd..(tok + 1) * hd],
            );
            assert_eq!(at, None, "{case}: sequence {s} in a decode batch on {threads} threads differs from the prefill");
        }
    }
}

fn first_diff_u32(a: &[u32], b: &[u32]) -> Option<usize> {
    (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i))
}

/// The walk's arithmetic at the shapes where its loops have remainders (head dims not a
/// multiple of 16: `weighted`'s 8-wide tail; odd keys per block: `dot4x2`'s unpaired key;
/// group sizes not a multiple of 4: `weighted::<1..3>` and the dot step's single rows), with
/// values at the edges (scores hundreds apart, so weights underflow and sums rescale by 0;
/// infinite keys; infinite and NaN values that only some rows weigh): a row's bits do not
/// depend on the tile, the thread count, the batch, or decode against prefill. Rows that
/// weigh a non-finite value are compared too (NaN as one pattern).
#[test]
fn edge_shapes_give_the_same_bits_in_any_tile_batch_and_as_decodes() {
    let mut rng = SmallRng::seed_from_u64(37);
    let mut n = 0;
    for d in [8, 24, 40] {
        for bs in [1, 2, 3, 5, 8] {
            for group in [1, 2, 3, 5, 8] {
                match n % 3 {
                    0 => {
                        for _ in 0..3 {
                            edge_case::<f32>(&mut rng, d, bs, group, "f32")
                        }
                    }
                    1 => {
                        for _ in 0..3 {
                            edge_case::<half::bf16>(&mut rng, d, bs, group, "bf16")
                        }
                    }
                    _ => {
                        for _ in 0..3 {
                            edge_case::<f16>(&mut rng, d, bs, group, "f16")
                        }
                    }
                }
                n += 1;
            }
        }
    }
}
