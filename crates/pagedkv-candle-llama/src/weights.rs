//! The llama's weights, read from a GGUF file through pagedkv's parser and dequantizer.
//!
//! Every tensor's bytes come from [`pagedkv::gguf::Gguf`] (validated offsets, types and
//! lengths). Norms and the token embedding are dequantized by pagedkv to f32, as candle does
//! with its own dequantizer. A projection follows candle's `QMatMul` rules so that the model
//! computes what candle's `quantized_llama` computes: float tensors (F32, F16, BF16) are
//! dequantized and multiplied in f32; quantized tensors are handed, as the file's blocks, to
//! candle's quantized matmul (which quantizes the activations to its dot-product type), or,
//! in [`MatMulMode::Dequantized`], dequantized by pagedkv and multiplied in f32.

use crate::config::LlamaConfig;
use crate::error::{Error, Result};
use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{Device, Module, Tensor};
use pagedkv::gguf::{GgmlType, Gguf, TensorInfo};
use std::borrow::Cow;
use std::sync::Arc;

/// How projections on quantized tensors are multiplied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MatMulMode {
    /// candle's quantized matmul on the file's blocks (what `quantized_llama` runs). Types
    /// candle has no kernel for (IQ4_NL, MXFP4, ...) fall back to `Dequantized`.
    #[default]
    Quantized,
    /// Dequantized by pagedkv to f32 at load, multiplied in f32 (what candle runs with
    /// `CANDLE_DEQUANTIZE_ALL=1`).
    Dequantized,
}

/// A projection `y = x Wᵀ` with `W` of shape `[n_out, n_in]`.
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    inner: QMatMul,
}

impl Linear {
    pub(crate) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.inner.forward(x)
    }
}

/// One transformer layer.
#[derive(Debug, Clone)]
pub(crate) struct LayerWeights {
    pub(crate) attn_norm: Tensor,
    pub(crate) wq: Linear,
    pub(crate) wk: Linear,
    pub(crate) wv: Linear,
    pub(crate) wo: Linear,
    pub(crate) ffn_norm: Tensor,
    /// `ffn_gate` (w1), `ffn_up` (w3), `ffn_down` (w2).
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}

/// The whole model's weights.
#[derive(Debug, Clone)]
pub(crate) struct Weights {
    /// `[vocab, dim]`, f32.
    pub(crate) embedding: Tensor,
    pub(crate) layers: Vec<LayerWeights>,
    pub(crate) final_norm: Tensor,
    /// `output.weight`, or the token embedding when the file ties them.
    pub(crate) output: Linear,
}

impl Weights {
    pub(crate) fn load(
        g: &Gguf<'_>,
        cfg: &LlamaConfig,
        mode: MatMulMode,
        dev: &Device,
    ) -> Result<Self> {
        let (dim, vocab) = (cfg.dim(), cfg.vocab_size);
        let kv_dim = cfg.n_kv_heads() * cfg.head_dim();
        let embd = g.require_tensor("token_embd.weight")?;
        let embedding = dequantize(embd, &[dim, vocab], dev)?;
        let output_info = g.tensor("output.weight").unwrap_or(embd);
        let output = linear(output_info, dim, vocab, mode, dev)?;
        // Grown as the file's tensors are found: the layer count is the header's claim, and a
        // capacity taken from it (u32::MAX layers) aborted the process before any check.
        let mut layers = Vec::new();
        for l in 0..cfg.n_layers() {
            let t = |name: &str| g.require_tensor(&format!("blk.{l}.{name}.weight"));
            let ffn = match t("ffn_gate")?.shape() {
                [d, f] if *d == dim as u64 => *f as usize,
                s => {
                    return Err(Error::Unsupported(format!(
                        "blk.{l}.ffn_gate.weight has shape {s:?}, expected [{dim}, ffn]"
                    )))
                }
            };
            layers.push(LayerWeights {
                attn_norm: dequantize(t("attn_norm")?, &[dim], dev)?,
                wq: linear(t("attn_q")?, dim, dim, mode, dev)?,
                wk: linear(t("attn_k")?, dim, kv_dim, mode, dev)?,
                wv: linear(t("attn_v")?, dim, kv_dim, mode, dev)?,
                wo: linear(t("attn_output")?, dim, dim, mode, dev)?,
                ffn_norm: dequantize(t("ffn_norm")?, &[dim], dev)?,
                gate: linear(t("ffn_gate")?, dim, ffn, mode, dev)?,
                up: linear(t("ffn_up")?, dim, ffn, mode, dev)?,
                down: linear(t("ffn_down")?, ffn, dim, mode, dev)?,
            });
        }
        Ok(Self {
            embedding,
            layers,
            final_norm: dequantize(g.require_tensor("output_norm.weight")?, &[dim], dev)?,
            output,
        })
    }
}

/// Refuses a tensor whose ggml shape (innermost first) is not `want`.
fn check_shape(t: &TensorInfo<'_>, want: &[usize]) -> Result<()> {
    if t.shape().len() != want.len() || t.shape().iter().zip(want).any(|(&a, &b)| a != b as u64) {
        return Err(Error::Unsupported(format!(
            "tensor {} has shape {:?}, expected {want:?}",
            t.name(),
            t.shape()
        )));
    }
    Ok(())
}

/// pagedkv's dequantization of `t` (ggml shape `ne`, innermost first) into an f32 tensor of
/// the reversed (row-major) shape.
fn dequantize(t: &TensorInfo<'_>, ne: &[usize], dev: &Device) -> Result<Tensor> {
    check_shape(t, ne)?;
    // The library refuses a type it cannot dequantize before allocating the output (up to
    // ~28 f32 per byte of a 1-bit type's tensor).
    let out = t.dequantize()?;
    let dims: Vec<usize> = ne.iter().rev().copied().collect();
    Ok(Tensor::from_vec(out, dims, dev)?)
}

/// A projection from `n_in` to `n_out` (ggml shape `[n_in, n_out]`), by candle's `QMatMul`
/// rules (see the module docs).
fn linear(
    t: &TensorInfo<'_>,
    n_in: usize,
    n_out: usize,
    mode: MatMulMode,
    dev: &Device,
) -> Result<Linear> {
    check_shape(t, &[n_in, n_out])?;
    let quantized = match (t.ty(), mode) {
        (GgmlType::F32 | GgmlType::F16 | GgmlType::BF16, _) | (_, MatMulMode::Dequantized) => None,
        (ty, MatMulMode::Quantized) => candle_dtype(ty),
    };
    let inner = match quantized {
        Some(dtype) => QMatMul::from_arc(Arc::new(qtensor(t, dtype, n_out, n_in, dev)?))?,
        None => QMatMul::Tensor(dequantize(t, &[n_in, n_out], dev)?),
    };
    Ok(Linear { inner })
}

/// The file's blocks of `t` as a candle quantized tensor `[n_out, n_in]`.
fn qtensor(
    t: &TensorInfo<'_>,
    dtype: GgmlDType,
    n_out: usize,
    n_in: usize,
    dev: &Device,
) -> Result<QTensor> {
    let data = t.data();
    // candle reinterprets the bytes as its block structs and asserts (panics) on a length or
    // alignment mismatch: check the length here, and copy into 8-byte-aligned memory (a
    // mapped file's tensor is 32-byte aligned, but an owned buffer's start need not be).
    let want = n_out * n_in / dtype.block_size() * dtype.type_size();
    if data.len() != want || (n_out * n_in) % dtype.block_size() != 0 {
        return Err(Error::Unsupported(format!(
            "tensor {} holds {} bytes, candle's {dtype:?} layout wants {want}",
            t.name(),
            data.len()
        )));
    }
    let mut aligned = vec![0u64; data.len().div_ceil(8)];
    let bytes = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut aligned)[..data.len()];
    bytes.copy_from_slice(data);
    let storage = QStorage::from_data(Cow::Borrowed(bytes), dev, dtype)?;
    Ok(QTensor::new(storage, (n_out, n_in))?)
}

/// candle's name for a quantized ggml type it can multiply, if any.
fn candle_dtype(ty: GgmlType) -> Option<GgmlDType> {
    Some(match ty {
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
        _ => return None,
    })
}
