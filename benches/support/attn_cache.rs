//! What the CPU attention benches share: a paged cache of random non-zero K/V whose blocks are
//! scattered (a random permutation, as a long-running pool hands them out), random queries, and
//! the baselines' 8-lane dot product.

// Each bench that includes this module uses part of it.
#![allow(dead_code)]

use pagedkv::kv::{HostKvCache, KvCacheConfig, KvElem};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

pub const KV_HEADS: usize = 8;
pub const HEAD_DIM: usize = 128;
/// Query heads per KV head (32:8, what current models use).
pub const GQA: usize = 4;
pub const BLOCK: usize = 16;

/// `batch` sequences of `ctx` tokens each in one layer's cache, and `q_rows` query tokens per
/// sequence (decode: 1; prefill: the chunk, the last `q_rows` of the context).
pub struct Setup<T> {
    pub cache: HostKvCache,
    pub tables: Vec<i32>,
    pub mbps: usize,
    pub ctx: Vec<i32>,
    pub q_rows: usize,
    /// `[batch * q_rows, KV_HEADS * GQA, HEAD_DIM]`.
    pub query: Vec<T>,
    /// Bytes of K and V the sequences' contexts hold.
    pub kv_bytes: usize,
}

pub fn setup<T: KvElem>(batch: usize, ctx: usize, q_rows: usize) -> Setup<T> {
    let mut rng = SmallRng::seed_from_u64(42);
    let mbps = ctx.div_ceil(BLOCK);
    let nb = batch * mbps;
    let cfg = KvCacheConfig::new(1, KV_HEADS, HEAD_DIM, BLOCK, nb, T::DTYPE).unwrap();
    let mut cache = HostKvCache::new(cfg).unwrap();
    for x in cache.view_mut::<T>().unwrap().data_mut() {
        *x = T::from_f32(rng.gen_range(-1.0..1.0));
    }
    let mut perm: Vec<i32> = (0..nb as i32).collect();
    for i in (1..nb).rev() {
        perm.swap(i, rng.gen_range(0..=i));
    }
    let query = (0..batch * q_rows * KV_HEADS * GQA * HEAD_DIM)
        .map(|_| T::from_f32(rng.gen_range(-1.0..1.0)))
        .collect();
    Setup {
        cache,
        tables: perm,
        mbps,
        ctx: vec![ctx as i32; batch],
        q_rows,
        query,
        kv_bytes: batch * ctx * 2 * KV_HEADS * HEAD_DIM * T::DTYPE.size_bytes(),
    }
}

/// The baselines' dot product: eight lanes of fused multiply-adds, as pagedkv's, so that a ratio
/// compares approaches.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    acc.iter().sum()
}

/// Panics unless pagedkv's `out` and a baseline's `base` agree within the dtype's tolerance
/// (relative, with a floor for values near zero).
pub fn assert_close<T: KvElem>(out: &[T], base: &[f32]) {
    let tol = if T::DTYPE == pagedkv::kv::KvDtype::F32 {
        1e-4
    } else {
        2e-2
    };
    assert_eq!(out.len(), base.len());
    for (a, b) in out.iter().zip(base) {
        assert!(
            (a.to_f32() - b).abs() <= tol * b.abs().max(0.05),
            "pagedkv {} vs baseline {b}",
            a.to_f32()
        );
    }
}
