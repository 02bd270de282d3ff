//! The CPU attention kernels walk a sequence's blocks for several KV heads at once, as many as
//! the batch shape and thread count allow (one head per walk for a lone sequence on many
//! threads, all of them for a large batch, a few per prefill tile). Each query row's arithmetic
//! must not depend on that: the same row computed in any batch, on any thread count, by decode
//! or by a one-token prefill, or inside any prefill tile, is bit-identical.

use half::f16;
use pagedkv::attn::cpu::{paged_attention_decode, paged_attention_prefill};
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
