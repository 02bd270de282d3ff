//! Tiny llama GGUF files with random weights, written by pagedkv's [`GgufWriter`], for tests,
//! examples and benchmarks: a few MB, deterministic from a seed.
//!
//! Values are drawn from a SplitMix64 stream (uniform, scaled so each projection keeps unit
//! variance); quantized tensors are encoded by candle's quantizer (`QTensor::quantize`), so
//! the file holds exactly the blocks llama.cpp would write for those values.

use crate::error::{Error, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use pagedkv::gguf::{GgmlType, GgufWriter, MetaValue};

/// The shape and tensor types of a tiny llama.
#[derive(Debug, Clone, PartialEq)]
pub struct TinyLlama {
    /// Vocabulary size.
    pub vocab: usize,
    /// Model width (a multiple of 256 for K-quant projections, of 32 for the others).
    pub dim: usize,
    /// Transformer layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// MLP width.
    pub ffn: usize,
    /// `llama.context_length`.
    pub context: u32,
    /// `llama.rope.freq_base`.
    pub rope_base: f32,
    /// `llama.attention.layer_norm_rms_epsilon`.
    pub rms_eps: f32,
    /// Half-width of the token embedding's uniform values. With tied embeddings a large scale
    /// makes every token predict itself (its logit is its embedding's squared norm), so the
    /// tied fixture keeps it small next to the layers' contributions.
    pub embd_scale: f32,
    /// Type of the token embedding.
    pub embd_type: GgmlType,
    /// Type of each layer's projections, in order q, k, v, o, gate, up, down; layer `l` uses
    /// the list rotated by `l`, so every type appears in every role across layers.
    pub proj_types: Vec<GgmlType>,
    /// Type of `output.weight`, or `None` for tied embeddings (no `output.weight`).
    pub output_type: Option<GgmlType>,
    /// A linear RoPE scaling: `llama.rope.scaling.type` "linear" and this
    /// `llama.rope.scaling.factor` (`None`: neither key).
    pub rope_scaling_factor: Option<f32>,
    /// llama3-style RoPE frequency factors, written as the F32 tensor `rope_freqs.weight`
    /// (one per rotated pair: `head_dim / 2` values; `None`: no tensor).
    pub rope_freqs: Option<Vec<f32>>,
}

impl TinyLlama {
    /// 2 layers, width 256, 8 heads of 32 with 2 KV heads (grouped-query attention), MLP 512,
    /// vocabulary 384, all F32 and tied embeddings (4.9 MB).
    pub fn f32() -> Self {
        Self {
            vocab: 384,
            dim: 256,
            layers: 2,
            heads: 8,
            kv_heads: 2,
            ffn: 512,
            context: 2048,
            rope_base: 10_000.0,
            rms_eps: 1e-5,
            embd_scale: 0.05,
            embd_type: GgmlType::F32,
            proj_types: vec![GgmlType::F32],
            output_type: None,
            rope_scaling_factor: None,
            rope_freqs: None,
        }
    }

    /// The same shape with mixed types: Q4_K embedding, projections rotating through Q8_0,
    /// Q4_0, Q4_K, F16 and F32, a Q8_0 `output.weight`, RoPE base 500000 and eps 1e-6
    /// (1.1 MB).
    pub fn mixed() -> Self {
        Self {
            rope_base: 500_000.0,
            rms_eps: 1e-6,
            embd_scale: 1.0,
            embd_type: GgmlType::Q4_K,
            proj_types: vec![
                GgmlType::Q8_0,
                GgmlType::Q4_0,
                GgmlType::Q4_K,
                GgmlType::F16,
                GgmlType::Q8_0,
                GgmlType::Q4_K,
                GgmlType::Q4_0,
            ],
            output_type: Some(GgmlType::Q8_0),
            ..Self::f32()
        }
    }

    /// The same width with heads of `head_dim` and the same query-to-KV group. pagedkv's CUDA
    /// kernels build head dims 64 and up (32 is refused with a typed error), so the CUDA tests
    /// and `generate --write-tiny` use `with_head_dim(64)`.
    ///
    /// # Panics
    /// If `head_dim` does not divide the width or the group does not fit the new head count.
    pub fn with_head_dim(self, head_dim: usize) -> Self {
        assert!(
            head_dim > 0 && self.dim % head_dim == 0,
            "head_dim divides the width"
        );
        let heads = self.dim / head_dim;
        let group = self.heads / self.kv_heads;
        assert!(heads % group == 0, "the group divides the new head count");
        Self {
            heads,
            kv_heads: heads / group,
            ..self
        }
    }

    /// The file's bytes for weights drawn from `seed`.
    ///
    /// # Errors
    /// [`Error::BadInput`] for a shape the file cannot describe (no heads, KV heads that do
    /// not divide the heads, a width the heads do not divide, no projection types, a count
    /// past 32 bits); candle's quantizer's and the writer's refusals (a zero size, a width
    /// that is not a whole number of a type's blocks).
    pub fn write(&self, seed: u64) -> Result<Vec<u8>> {
        self.check()?;
        let mut rng = SplitMix64(seed);
        let head_dim = self.dim / self.heads;
        let kv_dim = self.kv_heads * head_dim;
        // (name, ggml type, [n_out, n_in], values)
        let mut tensors: Vec<(String, GgmlType, [usize; 2], Vec<f32>)> = Vec::new();
        let mut matrix = |name: String, ty: GgmlType, n_out: usize, n_in: usize, scale: f32| {
            let v = rng.uniform(n_out * n_in, scale);
            tensors.push((name, ty, [n_out, n_in], v));
        };
        matrix(
            "token_embd.weight".into(),
            self.embd_type,
            self.vocab,
            self.dim,
            self.embd_scale,
        );
        if let Some(ty) = self.output_type {
            matrix(
                "output.weight".into(),
                ty,
                self.vocab,
                self.dim,
                unit(self.dim),
            );
        }
        let roles = [
            ("attn_q", self.dim, self.dim),
            ("attn_k", kv_dim, self.dim),
            ("attn_v", kv_dim, self.dim),
            ("attn_output", self.dim, self.dim),
            ("ffn_gate", self.ffn, self.dim),
            ("ffn_up", self.ffn, self.dim),
            ("ffn_down", self.dim, self.ffn),
        ];
        for l in 0..self.layers {
            for (r, &(role, n_out, n_in)) in roles.iter().enumerate() {
                let ty = self.proj_types[(r + l) % self.proj_types.len()];
                matrix(
                    format!("blk.{l}.{role}.weight"),
                    ty,
                    n_out,
                    n_in,
                    unit(n_in),
                );
            }
        }
        let mut norms = Vec::new();
        for l in 0..self.layers {
            for role in ["attn_norm", "ffn_norm"] {
                norms.push((format!("blk.{l}.{role}.weight"), rng.around_one(self.dim)));
            }
        }
        norms.push(("output_norm.weight".into(), rng.around_one(self.dim)));

        let encoded: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, ty, shape, v)| encode(*ty, *shape, v))
            .collect::<Result<_>>()?;
        let norm_bytes: Vec<Vec<u8>> = norms
            .iter()
            .map(|(_, v)| bytemuck::cast_slice(v).to_vec())
            .collect();

        let mut w = GgufWriter::new();
        let u32_ = |x: usize| MetaValue::U32(x as u32);
        w.add("general.architecture", MetaValue::String("llama".into()))?;
        w.add(
            "general.name",
            MetaValue::String("pagedkv tiny llama".into()),
        )?;
        w.add("llama.context_length", MetaValue::U32(self.context))?;
        w.add("llama.embedding_length", u32_(self.dim))?;
        w.add("llama.block_count", u32_(self.layers))?;
        w.add("llama.feed_forward_length", u32_(self.ffn))?;
        w.add("llama.attention.head_count", u32_(self.heads))?;
        w.add("llama.attention.head_count_kv", u32_(self.kv_heads))?;
        w.add("llama.rope.dimension_count", u32_(head_dim))?;
        w.add("llama.rope.freq_base", MetaValue::F32(self.rope_base))?;
        w.add(
            "llama.attention.layer_norm_rms_epsilon",
            MetaValue::F32(self.rms_eps),
        )?;
        w.add("llama.vocab_size", u32_(self.vocab))?;
        if let Some(factor) = self.rope_scaling_factor {
            w.add(
                "llama.rope.scaling.type",
                MetaValue::String("linear".into()),
            )?;
            w.add("llama.rope.scaling.factor", MetaValue::F32(factor))?;
        }
        for ((name, ty, [n_out, n_in], _), bytes) in tensors.iter().zip(&encoded) {
            w.add_tensor(name, *ty, &[*n_in as u64, *n_out as u64], bytes)?;
        }
        for ((name, _), bytes) in norms.iter().zip(&norm_bytes) {
            w.add_tensor(name, GgmlType::F32, &[self.dim as u64], bytes)?;
        }
        if let Some(f) = &self.rope_freqs {
            let bytes: &[u8] = bytemuck::cast_slice(f);
            w.add_tensor("rope_freqs.weight", GgmlType::F32, &[f.len() as u64], bytes)?;
        }
        Ok(w.to_bytes()?)
    }
}

impl TinyLlama {
    /// Refuses what [`write`](Self::write) would divide by zero, index modulo zero, or
    /// truncate in the metadata, before any weight is drawn.
    fn check(&self) -> Result<()> {
        let bad = |m: String| Err(Error::BadInput(format!("tiny llama: {m}")));
        if self.heads == 0 || self.kv_heads == 0 || self.heads % self.kv_heads != 0 {
            return bad(format!(
                "{} KV heads do not divide {} heads",
                self.kv_heads, self.heads
            ));
        }
        if self.dim % self.heads != 0 {
            return bad(format!(
                "{} heads do not divide the width {}",
                self.heads, self.dim
            ));
        }
        if self.proj_types.is_empty() {
            return bad("no projection types".into());
        }
        for (what, n) in [
            ("vocab", self.vocab),
            ("dim", self.dim),
            ("layers", self.layers),
            ("heads", self.heads),
            ("ffn", self.ffn),
        ] {
            if u32::try_from(n).is_err() {
                return bad(format!("{what} {n} does not fit in 32 bits"));
            }
        }
        Ok(())
    }
}

/// The half-width of a uniform distribution of variance `1 / n`.
fn unit(n: usize) -> f32 {
    (3.0 / n as f32).sqrt()
}

/// Encodes `[n_out, n_in]` row-major values as `ty`'s blocks (candle's quantizer).
fn encode(ty: GgmlType, [n_out, n_in]: [usize; 2], v: &[f32]) -> Result<Vec<u8>> {
    let dtype = match ty {
        GgmlType::F32 => return Ok(bytemuck::cast_slice(v).to_vec()),
        GgmlType::F16 => GgmlDType::F16,
        GgmlType::BF16 => GgmlDType::BF16,
        GgmlType::Q4_0 => GgmlDType::Q4_0,
        GgmlType::Q4_1 => GgmlDType::Q4_1,
        GgmlType::Q5_0 => GgmlDType::Q5_0,
        GgmlType::Q5_1 => GgmlDType::Q5_1,
        GgmlType::Q8_0 => GgmlDType::Q8_0,
        GgmlType::Q2_K => GgmlDType::Q2K,
        GgmlType::Q3_K => GgmlDType::Q3K,
        GgmlType::Q4_K => GgmlDType::Q4K,
        GgmlType::Q5_K => GgmlDType::Q5K,
        GgmlType::Q6_K => GgmlDType::Q6K,
        other => {
            return Err(Error::Unsupported(format!(
                "the fixture cannot encode {other:?}"
            )))
        }
    };
    let t = Tensor::from_slice(v, (n_out, n_in), &Device::Cpu)?;
    Ok(QTensor::quantize(&t, dtype)?.data()?.into_owned())
}

/// SplitMix64 (Steele, Lea, Flood 2014): a tiny, seedable generator; statistical quality is
/// ample for random weights.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 24 bits.
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// `n` values uniform in `[-scale, scale)`.
    fn uniform(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| (self.unit() * 2.0 - 1.0) * scale).collect()
    }

    /// `n` norm weights in `[0.75, 1.25)`.
    fn around_one(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| 0.75 + self.unit() * 0.5).collect()
    }
}
