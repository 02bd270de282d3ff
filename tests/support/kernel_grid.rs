//! The inputs and comparisons shared by the two runs of the CUDA kernels against the CPU oracle:
//! tests/cuda_kernels.rs (on a GPU) and tests/cuda_emu.rs (the same kernels on the CPU
//! emulation). Included by `#[path]` from each.
#![allow(dead_code)]

use pagedkv::attn::{cpu, AttnParams, AttnWorkspace, PagedSeqs};
use pagedkv::kv::{HostKvCache, KvCacheConfig, KvDtype, KvElem};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::Rng;

/// Absolute and relative tolerance of kernel vs CPU outputs (both f32 math, different
/// summation order; outputs rounded once to the dtype).
pub trait Tol: KvElem {
    const TOL: (f32, f32);
}
impl Tol for f32 {
    const TOL: (f32, f32) = (2e-5, 1e-4);
}
impl Tol for half::f16 {
    const TOL: (f32, f32) = (2e-3, 4e-3);
}
impl Tol for half::bf16 {
    const TOL: (f32, f32) = (1e-2, 2e-2);
}

pub const HEAD_DIMS: [usize; 6] = [64, 80, 96, 112, 128, 256];
pub const GROUPS: [usize; 3] = [1, 4, 8];
pub const BLOCK_SIZES: [usize; 3] = [8, 16, 32];

/// Query heads one decode thread block serves (as kernels/paged_attention.cu chooses).
pub fn heads_per_block(group: usize) -> usize {
    if group == 1 {
        1
    } else if group <= 4 {
        4
    } else {
        8
    }
}

/// Whether a forced single pass is refused: the logits of the longest context, plus the
/// kernel's static max and sum per head, do not fit the 48 KiB of shared memory.
pub fn single_pass_refused(group: usize, ctx: &[usize]) -> bool {
    let tokens = ctx.iter().max().copied().unwrap_or(1).max(1);
    heads_per_block(group) * (tokens + 2) * 4 > 48 * 1024
}

pub fn random_vec<T: KvElem>(rng: &mut SmallRng, n: usize) -> Vec<T> {
    (0..n)
        .map(|_| T::from_f32(rng.gen_range(-1.0f32..1.0)))
        .collect()
}

pub fn random_cache<T: KvElem>(rng: &mut SmallRng, cfg: KvCacheConfig) -> HostKvCache {
    let mut h = HostKvCache::new(cfg).expect("host cache");
    let mut v = h.view_mut::<T>().expect("view");
    for x in v.data_mut() {
        *x = T::from_f32(rng.gen_range(-1.0f32..1.0));
    }
    h
}

/// Compares a kernel's output with the CPU oracle's; rows of `d` elements for messages.
pub fn assert_close<T: Tol>(what: &str, got: &[T], cpu: &[T], d: usize) {
    assert_eq!(got.len(), cpu.len(), "{what}: length");
    let (atol, rtol) = T::TOL;
    for (i, (g, c)) in got.iter().zip(cpu).enumerate() {
        let (g, c) = (g.to_f32(), c.to_f32());
        assert!(
            g.is_finite(),
            "{what}: element {i} (row {}, dim {}) not written or not finite: {g}",
            i / d,
            i % d
        );
        assert!(c.is_finite(), "{what}: CPU element {i} not finite");
        let err = (g - c).abs();
        assert!(
            err <= atol + rtol * c.abs(),
            "{what}: element {i} (row {}, dim {}): kernel {g} vs cpu {c} (|diff| {err})",
            i / d,
            i % d
        );
    }
}

/// A batch: block tables scattered over a shuffled pool, garbage past the live entries.
pub struct Batch {
    pub cfg: KvCacheConfig,
    pub tables: Vec<i32>,
    pub mbps: usize,
    pub ctx: Vec<i32>,
}

pub fn make_batch(
    rng: &mut SmallRng,
    layers: usize,
    hkv: usize,
    d: usize,
    bs: usize,
    dtype: KvDtype,
    ctx: &[usize],
) -> Batch {
    let need: usize = ctx.iter().map(|c| c.div_ceil(bs)).sum();
    let num_blocks = need + 3 + rng.gen_range(0..4);
    let cfg = KvCacheConfig::new(layers, hkv, d, bs, num_blocks, dtype).expect("config");
    let mbps = ctx.iter().map(|c| c.div_ceil(bs)).max().unwrap_or(1).max(1) + 1;
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    ids.shuffle(rng);
    let mut next = 0;
    let mut tables = vec![0i32; ctx.len() * mbps];
    for (s, &c) in ctx.iter().enumerate() {
        for j in 0..mbps {
            tables[s * mbps + j] = if j < c.div_ceil(bs) {
                next += 1;
                ids[next - 1]
            } else {
                // Never read: garbage a kernel would fault on or visibly misuse.
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

/// The logit transforms a case turns on.
#[derive(Clone, Copy, Debug)]
pub struct Features {
    pub alibi: bool,
    pub window: usize,
    pub softcap: f32,
}

impl Features {
    pub const PLAIN: Features = Features {
        alibi: false,
        window: 0,
        softcap: 0.0,
    };
}

/// The four combinations the grids cycle through (window sizes relative to the block size).
pub fn features(variant: usize, bs: usize) -> Features {
    match variant % 4 {
        0 => Features::PLAIN,
        1 => Features {
            alibi: true,
            ..Features::PLAIN
        },
        2 => Features {
            window: bs + 3,
            ..Features::PLAIN
        },
        _ => Features {
            alibi: true,
            window: 2 * bs + 1,
            softcap: 5.0,
        },
    }
}

/// The attention parameters of a case (`sl`: the ALiBi slopes used when `f.alibi`).
pub fn attn_params(nh: usize, d: usize, f: Features, sl: &[f32]) -> AttnParams<'_> {
    let mut p = AttnParams::new(nh, d);
    p.alibi_slopes = f.alibi.then_some(sl);
    p.sliding_window = f.window;
    p.softcap = f.softcap;
    p
}

impl Batch {
    /// The batch as the kernels' sequence description.
    pub fn seqs(&self) -> PagedSeqs<'_> {
        PagedSeqs {
            block_tables: &self.tables,
            max_blocks_per_seq: self.mbps,
            context_lens: &self.ctx,
        }
    }
}

/// `query_start_loc` of prefill sequences given as (query tokens, context) pairs.
pub fn query_start_loc(seqs_q_ctx: &[(usize, usize)]) -> Vec<i32> {
    let mut qsl = vec![0i32];
    for &(q, _) in seqs_q_ctx {
        qsl.push(qsl.last().copied().unwrap_or(0) + q as i32);
    }
    qsl
}

/// The CPU oracle's decode output for `layer` of `host`.
pub fn cpu_decode<T: KvElem>(
    b: &Batch,
    host: &HostKvCache,
    layer: usize,
    query: &[T],
    params: &AttnParams<'_>,
) -> Vec<T> {
    let mut want = vec![T::from_f32(f32::NAN); query.len()];
    let view = host.view::<T>().expect("view");
    cpu::paged_attention_decode(
        &mut AttnWorkspace::new(),
        view.layer(layer).expect("layer"),
        query,
        &b.seqs(),
        params,
        &mut want,
    )
    .expect("cpu decode");
    want
}

/// The CPU oracle's prefill output for `layer` of `host`.
pub fn cpu_prefill<T: KvElem>(
    b: &Batch,
    host: &HostKvCache,
    layer: usize,
    query: &[T],
    qsl: &[i32],
    params: &AttnParams<'_>,
) -> Vec<T> {
    let mut want = vec![T::from_f32(f32::NAN); query.len()];
    let view = host.view::<T>().expect("view");
    cpu::paged_attention_prefill(
        &mut AttnWorkspace::new(),
        view.layer(layer).expect("layer"),
        query,
        qsl,
        &b.seqs(),
        params,
        &mut want,
    )
    .expect("cpu prefill");
    want
}

pub fn slopes(rng: &mut SmallRng, nh: usize) -> Vec<f32> {
    (0..nh).map(|_| rng.gen_range(0.01f32..0.5)).collect()
}

/// The decode contexts of one grid cell: single token, block boundaries +-1, a few blocks, a
/// longer context and an empty (padding) sequence.
pub fn decode_grid_contexts(bs: usize) -> [usize; 7] {
    [1, bs - 1, bs, bs + 1, 3 * bs + 5, 300, 0]
}

/// The (query tokens, context) pairs of one prefill grid cell.
pub fn prefill_grid_seqs(bs: usize) -> [(usize, usize); 7] {
    [
        (1, 1),
        (bs, bs),
        (bs + 1, 2 * bs + 3),
        (37, 37),
        (5, 300),
        (0, 20),
        (bs - 1, bs - 1),
    ]
}
