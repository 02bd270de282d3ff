//! The inputs and comparisons shared by the two runs of the CUDA kernels against the CPU oracle:
//! tests/cuda_kernels.rs (on a GPU) and tests/cuda_emu.rs (the same kernels on the CPU
//! emulation). Included by `#[path]` from each.
#![allow(dead_code)]

use pagedkv::attn::{cpu, AttnWorkspace};
use pagedkv::kv::{AttnParams, PagedSeqs};
use pagedkv::kv::{HostKvCache, KvCacheConfig, KvDtype, KvElem};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::Rng;

/// Absolute and relative tolerance of kernel vs CPU outputs (f32 math, different summation
/// order, outputs rounded once to the dtype; the f16 / bf16 tensor-core prefill tilings also
/// round the probabilities to the dtype before `P V`, which the f16 / bf16 tolerances cover).
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
/// Tokens per block: every power of two the kernels take (the arena's page-size scheme gives
/// small-KV models 64-256 tokens per page).
pub const BLOCK_SIZES: [usize; 6] = [8, 16, 32, 64, 128, 256];

/// How far apart a cache's blocks are: a model's view of an arena steps over blocks by the
/// arena's page size, which may exceed the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Page {
    /// Blocks back to back (page = block).
    Dense,
    /// The block plus this many 16-byte units of padding.
    Pad(usize),
    /// The block rounded up to a multiple of this many bytes (a realistic arena page, e.g.
    /// 64 KiB shared with larger models).
    RoundUp(usize),
}

/// The page variants the grids cycle through.
pub const PAGES: [Page; 4] = [
    Page::Dense,
    Page::Pad(1),
    Page::Pad(5),
    Page::RoundUp(64 << 10),
];

/// `cfg` with the page stride `page` asks for.
pub fn with_page(cfg: KvCacheConfig, page: Page) -> KvCacheConfig {
    let block = cfg.bytes_per_block();
    let bytes = match page {
        Page::Dense => return cfg,
        Page::Pad(units) => block + 16 * units,
        Page::RoundUp(to) => block.div_ceil(to) * to,
    };
    cfg.with_page_stride(bytes).expect("page stride")
}

/// Overwrites every page's padding (the bytes past its block) with 0xFF, NaN in every dtype:
/// a kernel that reads padding, or steps over blocks by the block size instead of the page
/// stride, produces NaN or wrong values.
pub fn poison_padding(h: &mut HostKvCache) {
    let (page, block) = (h.config().page_bytes(), h.config().bytes_per_block());
    if page == block {
        return;
    }
    for p in h.as_bytes_mut().chunks_exact_mut(page) {
        p[block..].fill(0xFF);
    }
}

pub fn random_vec<T: KvElem>(rng: &mut SmallRng, n: usize) -> Vec<T> {
    (0..n)
        .map(|_| T::from_f32(rng.gen_range(-1.0f32..1.0)))
        .collect()
}

/// A host cache of `cfg` with random blocks and poisoned page padding.
pub fn random_cache<T: KvElem>(rng: &mut SmallRng, cfg: KvCacheConfig) -> HostKvCache {
    let mut h = HostKvCache::new(cfg).expect("host cache");
    let mut v = h.view_mut::<T>().expect("view");
    for x in v.data_mut() {
        *x = T::from_f32(rng.gen_range(-1.0f32..1.0));
    }
    poison_padding(&mut h);
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

#[allow(clippy::too_many_arguments)]
pub fn make_batch(
    rng: &mut SmallRng,
    layers: usize,
    hkv: usize,
    d: usize,
    bs: usize,
    dtype: KvDtype,
    page: Page,
    ctx: &[usize],
) -> Batch {
    let need: usize = ctx.iter().map(|c| c.div_ceil(bs)).sum();
    let num_blocks = need + 3 + rng.gen_range(0..4);
    let cfg = KvCacheConfig::new(layers, hkv, d, bs, num_blocks, dtype).expect("config");
    let cfg = with_page(cfg, page);
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

/// The invalid-block-id decode case (one layer's cache of 12 blocks of `bs`): sequence 0 has
/// blocks 3, -1, 7, one past the cache (its last 5 tokens short), sequence 1 blocks 5, 2; and
/// the same batch over its valid blocks alone, whose output the first must equal (no ALiBi or
/// window, so positions do not matter).
pub fn decode_with_invalid_ids(cfg: KvCacheConfig) -> (Batch, Batch) {
    let (bs, past) = (cfg.block_size(), cfg.num_blocks() as i32);
    let with_invalid = Batch {
        cfg,
        tables: vec![3, -1, 7, past, 5, 2, -9, -9],
        mbps: 4,
        ctx: vec![(4 * bs - 5) as i32, (bs + 4) as i32],
    };
    let valid_only = Batch {
        cfg,
        tables: vec![3, 7, 5, 2],
        mbps: 2,
        ctx: vec![(2 * bs) as i32, (bs + 4) as i32],
    };
    (with_invalid, valid_only)
}

/// The invalid-block-id prefill case (block size 16): blocks 3, -1, 7, one past the cache, 5, 2
/// (91 tokens) under a 20-token chunk at positions 71..90 (query_start_loc [0, 20]), the
/// invalid blocks holding tokens 16..31 and 48..63, all before the chunk; and the batch of the
/// valid blocks alone (59 tokens).
pub fn prefill_with_invalid_ids(cfg: KvCacheConfig) -> (Batch, Batch) {
    let past = cfg.num_blocks() as i32;
    let with_invalid = Batch {
        cfg,
        tables: vec![3, -1, 7, past, 5, 2],
        mbps: 6,
        ctx: vec![91],
    };
    let valid_only = Batch {
        cfg,
        tables: vec![3, 7, 5, 2],
        mbps: 4,
        ctx: vec![59],
    };
    (with_invalid, valid_only)
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

/// The (query tokens, context) pairs of one prefill grid cell. Up to 32 tokens per block the
/// chunks span whole blocks; above, the same boundaries are crossed by short chunks (a chunk
/// ending on a block's last row, one crossing into the next block, one starting a block), which
/// keeps the quadratic cost of a cell (and of its oracle) near the small blocks'.
pub fn prefill_grid_seqs(bs: usize) -> [(usize, usize); 7] {
    if bs <= 32 {
        [
            (1, 1),
            (bs, bs),
            (bs + 1, 2 * bs + 3),
            (37, 37),
            (5, 300),
            (0, 20),
            (bs - 1, bs - 1),
        ]
    } else {
        [
            (1, 1),
            (3, bs),
            (5, bs + 2),
            (9, 2 * bs + 1),
            (37, 37),
            (0, 20),
            (2, bs - 1),
        ]
    }
}

// ---- cross-model hand-off over one arena (tests/cuda_emu_arena.rs, tests/cuda_arena.rs) -----

/// A model's KV geometry, as the arena tests put it on shared pages.
#[derive(Clone, Copy, Debug)]
pub struct Model {
    pub name: &'static str,
    pub layers: usize,
    pub kv_heads: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub dtype: KvDtype,
}

/// GQA 16/4, d64, 32 tokens per page, 2 layers, bf16: 64 KiB per block.
pub const MODEL_A: Model = Model {
    name: "A gqa16/4 d64 bs32",
    layers: 2,
    kv_heads: 4,
    heads: 16,
    head_dim: 64,
    block_size: 32,
    dtype: KvDtype::Bf16,
};
/// MHA 8/8, d64, 16 tokens per page, 1 layer, bf16: 32 KiB per block (half a page spare).
pub const MODEL_B: Model = Model {
    name: "B mha8/8 d64 bs16",
    layers: 1,
    kv_heads: 8,
    heads: 8,
    head_dim: 64,
    block_size: 16,
    dtype: KvDtype::Bf16,
};
/// MQA 8/1, d128, 64 tokens per page, 2 layers, f16: 64 KiB per block.
pub const MODEL_C: Model = Model {
    name: "C mqa8/1 d128 bs64",
    layers: 2,
    kv_heads: 1,
    heads: 8,
    head_dim: 128,
    block_size: 64,
    dtype: KvDtype::F16,
};

/// The arena of the hand-off tests: 64 KiB + 48 bytes per page (every model's block fits, each
/// leaves padding), 12 pages.
pub const ARENA_PAGE_BYTES: usize = (64 << 10) + 48;
pub const ARENA_PAGES: usize = 12;

impl Model {
    /// The model's view of the test arena.
    pub fn view(&self) -> KvCacheConfig {
        KvCacheConfig::new(
            self.layers,
            self.kv_heads,
            self.head_dim,
            self.block_size,
            ARENA_PAGES,
            self.dtype,
        )
        .expect("config")
        .with_page_stride(ARENA_PAGE_BYTES)
        .expect("fits the page")
    }
}

/// One model's step on a set of arena pages: every token of every sequence written by
/// reshape_and_cache (per layer), then decode of each sequence's last token and prefill of its
/// last `q_len` tokens.
pub struct HandOff<T> {
    pub model: Model,
    /// The view's sequences: block tables over the given pages.
    pub batch: Batch,
    /// Per layer: keys and values `[tokens][kv_heads * head_dim]`.
    pub keys: Vec<Vec<T>>,
    pub values: Vec<Vec<T>>,
    /// The slot of each token of `keys` (every position of every sequence).
    pub slots: Vec<i64>,
    /// Decode queries `[num_seqs][heads][head_dim]`.
    pub decode_q: Vec<T>,
    /// Prefill queries `[sum q_len][heads][head_dim]` and their `query_start_loc`.
    pub prefill_q: Vec<T>,
    pub qsl: Vec<i32>,
}

impl<T: KvElem> HandOff<T> {
    /// Sequences of `ctx` tokens on `pages` (in order: the first sequence's blocks first),
    /// prefill chunks of `q_lens` tokens.
    pub fn new(
        rng: &mut SmallRng,
        model: Model,
        pages: &[u32],
        ctx: &[usize],
        q_lens: &[usize],
    ) -> Self {
        assert_eq!(T::DTYPE, model.dtype);
        let cfg = model.view();
        let bs = model.block_size;
        let mbps = ctx.iter().map(|c| c.div_ceil(bs)).max().unwrap_or(1).max(1);
        let mut tables = vec![-1i32; ctx.len() * mbps];
        let mut next = pages.iter();
        let mut slots = Vec::new();
        for (s, &c) in ctx.iter().enumerate() {
            for j in 0..c.div_ceil(bs) {
                let page = *next.next().expect("enough pages");
                tables[s * mbps + j] = page as i32;
            }
            for pos in 0..c {
                let page = tables[s * mbps + pos / bs] as i64;
                slots.push(page * bs as i64 + (pos % bs) as i64);
            }
        }
        let row = model.kv_heads * model.head_dim;
        let tokens = slots.len();
        let keys = (0..model.layers)
            .map(|_| random_vec(rng, tokens * row))
            .collect();
        let values = (0..model.layers)
            .map(|_| random_vec(rng, tokens * row))
            .collect();
        let hd = model.heads * model.head_dim;
        let seqs_q_ctx: Vec<(usize, usize)> =
            q_lens.iter().copied().zip(ctx.iter().copied()).collect();
        let qsl = query_start_loc(&seqs_q_ctx);
        let q_tokens = *qsl.last().unwrap_or(&0) as usize;
        Self {
            model,
            batch: Batch {
                cfg,
                tables,
                mbps,
                ctx: ctx.iter().map(|&c| c as i32).collect(),
            },
            keys,
            values,
            slots,
            decode_q: random_vec(rng, ctx.len() * hd),
            prefill_q: random_vec(rng, q_tokens * hd),
            qsl,
        }
    }

    /// The attention parameters (soft-capped for the MQA model, so one model runs a transform).
    pub fn params(&self) -> AttnParams<'static> {
        let mut p = AttnParams::new(self.model.heads, self.model.head_dim);
        if self.model.kv_heads == 1 {
            p.softcap = 20.0;
        }
        p
    }

    /// The oracle's (decode, prefill) outputs for `layer` on a host image of the arena.
    pub fn oracle(&self, arena_image: &HostKvCache, layer: usize) -> (Vec<T>, Vec<T>) {
        let p = self.params();
        (
            cpu_decode(&self.batch, arena_image, layer, &self.decode_q, &p),
            cpu_prefill(
                &self.batch,
                arena_image,
                layer,
                &self.prefill_q,
                &self.qsl,
                &p,
            ),
        )
    }

    /// Checks the arena bytes after this model's writes: every page it was not given is
    /// `before`'s, and every given page's padding too (kernels write only the block part).
    pub fn check_untouched(&self, before: &[u8], after: &[u8], given: &[u32]) {
        let (page, block) = (ARENA_PAGE_BYTES, self.batch.cfg.bytes_per_block());
        for (i, (b, a)) in before
            .chunks_exact(page)
            .zip(after.chunks_exact(page))
            .enumerate()
        {
            let from = if given.contains(&(i as u32)) {
                block
            } else {
                0
            };
            assert!(
                b[from..] == a[from..],
                "{}: page {i} changed outside the model's blocks",
                self.model.name
            );
        }
    }
}

/// A host image of an arena's bytes under a model's view.
pub fn arena_image(cfg: KvCacheConfig, bytes: &[u8]) -> HostKvCache {
    let mut h = HostKvCache::new(cfg).expect("host image");
    h.as_bytes_mut().copy_from_slice(bytes);
    h
}

/// Pages model A fills and frees, and the order models B and C take them in (scattered, and
/// one page A never had).
pub const A_PAGES: [u32; 6] = [7, 2, 9, 4, 0, 11];
pub const B_PAGES: [u32; 7] = [4, 11, 7, 0, 9, 2, 5];
pub const C_PAGES: [u32; 4] = [9, 0, 7, 11];
/// Contexts and prefill chunks of each model's two sequences (A: 3 + 3 pages, B: 4 + 3,
/// C: 2 + 2), boundaries crossed mid-block.
pub const A_CTX: [usize; 2] = [70, 96];
pub const B_CTX: [usize; 2] = [61, 33];
pub const C_CTX: [usize; 2] = [100, 65];
pub const Q_LENS: [usize; 2] = [19, 5];
