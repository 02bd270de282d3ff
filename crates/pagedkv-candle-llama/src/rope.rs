//! Rotary position embedding as candle's `quantized_llama` applies it to a llama: llama.cpp's
//! "NORM" variant, which rotates adjacent pairs `(x[2i], x[2i+1])` by `pos * base^(-2i/d)`;
//! with the file's scaling (which candle ignores) by `pos * freq_scale * base^(-2i/d) / f[i]`
//! as llama.cpp does ([`RopeScaling`]).
//!
//! candle precomputes a table for positions `0..4096` as `positions (n, 1) x theta (1, d/2)`
//! (one f32 product per entry) and takes its `cos`/`sin`; here the same products are computed
//! for the step's positions only, one row per token, so each token of a mixed batch gets its
//! own position with no table and no length limit, and every value equals candle's table row.

use crate::config::RopeScaling;
use candle_core::{Device, Tensor};

/// The inverse frequencies of one head.
#[derive(Debug, Clone)]
pub(crate) struct Rope {
    /// `[1, head_dim / 2]`: `1 / base^(i / head_dim)` for even `i`, in f32 as candle has it.
    theta: Tensor,
}

impl Rope {
    /// The inverse frequencies `freq_scale * base^(-i/head_dim) / factors[i/2]` (even `i`).
    /// Unscaled, each is candle's f32 `1 / base^(i/head_dim)` exactly (no multiply or divide
    /// is applied), so the angles are bit-identical to `quantized_llama`'s.
    pub(crate) fn new(
        head_dim: usize,
        base: f32,
        scaling: &RopeScaling,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let theta: Vec<f32> = (0..head_dim)
            .step_by(2)
            .enumerate()
            .map(|(pair, i)| {
                let mut t = 1f32 / base.powf(i as f32 / head_dim as f32);
                if scaling.freq_scale != 1.0 {
                    t *= scaling.freq_scale;
                }
                if let Some(f) = &scaling.freq_factors {
                    t /= f[pair];
                }
                t
            })
            .collect();
        let half = theta.len();
        Ok(Self {
            theta: Tensor::from_vec(theta, (1, half), device)?,
        })
    }

    /// `(cos, sin)` of shape `[tokens, 1, head_dim / 2]` for the tokens' positions.
    pub(crate) fn tables(&self, positions: &[i32]) -> candle_core::Result<(Tensor, Tensor)> {
        let n = positions.len();
        let pos: Vec<f32> = positions.iter().map(|&p| p as f32).collect();
        let pos = Tensor::from_vec(pos, (n, 1), self.theta.device())?;
        let angles = pos.matmul(&self.theta)?;
        let half = angles.dim(1)?;
        let cos = angles.cos()?.reshape((n, 1, half))?;
        let sin = angles.sin()?.reshape((n, 1, half))?;
        Ok((cos, sin))
    }

    /// Rotates `x` of shape `[tokens, heads * head_dim]` per token with `tables`' rows;
    /// returns `[tokens, heads, 1, head_dim]` (the same memory order as `[tokens, heads,
    /// head_dim]`, pagedkv's layout).
    pub(crate) fn apply(
        x: &Tensor,
        heads: usize,
        (cos, sin): &(Tensor, Tensor),
    ) -> candle_core::Result<Tensor> {
        let (n, width) = x.dims2()?;
        // Each token is its own "batch" entry with one time step, so candle's batched rope
        // kernel takes that token's cos/sin row: the arithmetic per element is the kernel's,
        // the same as candle's per-sequence call.
        let x = x.reshape((n, heads, 1, width / heads))?;
        candle_nn::rotary_emb::rope_i(&x, cos, sin)
    }
}
