//! The model's hyperparameters, read from GGUF metadata the way candle's `quantized_llama`
//! reads them, so that the two run the same model from the same file.

use crate::error::{Error, Result};
use pagedkv::gguf::{Gguf, LlamaParams};
use pagedkv::kv::{KvDtype, ModelKvShape};

/// Architectures this client runs: llama's GGUF layout with llama.cpp's "NORM" RoPE (adjacent
/// pairs rotated), which is what candle's `quantized_llama` runs for them (it reads `llama.*`
/// keys whatever the architecture). NEOX-RoPE families (qwen2, phi3, ...) are refused, and so
/// is a scaled RoPE (see `check_unscaled_rope`).
const SUPPORTED_ARCHS: [&str; 1] = ["llama"];

/// A llama's hyperparameters.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// pagedkv's reading of the llama keys (layers, heads, widths, eps, rope base).
    pub params: LlamaParams,
    /// Rows of the token embedding (and of the output projection).
    pub vocab_size: usize,
    /// Whether the file has no `output.weight`, so the output projection is the token
    /// embedding (tied), as candle does.
    pub tied_embeddings: bool,
}

/// Refuses a file whose RoPE is scaled: llama.cpp rotates such a model by other angles than
/// the plain `pos * base^(-2i/d)` this client applies (and candle's `quantized_llama`, which
/// reads none of these entries either), so running it would give wrong logits silently.
/// Scaled are: a `{arch}.rope.scaling.factor` or legacy `{arch}.rope.scale_linear` other than
/// 1 (0 is llama.cpp's "unset"), a `{arch}.rope.scaling.type` other than "none" or "linear"
/// (YaRN, LongRoPE, ...), and a `rope_freqs.weight` tensor (llama 3.1's per-frequency
/// factors).
fn check_unscaled_rope(g: &Gguf<'_>, arch: &str) -> Result<()> {
    let k_type = format!("{arch}.rope.scaling.type");
    if g.get(&k_type).is_some() {
        let ty = g.get_str(&k_type)?;
        if !matches!(ty, "none" | "linear") {
            return Err(Error::Unsupported(format!(
                "{k_type} {ty:?}: only an unscaled RoPE is supported"
            )));
        }
    }
    for key in ["rope.scaling.factor", "rope.scale_linear"] {
        let key = format!("{arch}.{key}");
        if g.get(&key).is_some() {
            let factor = g.get_f32(&key)?;
            if factor != 0.0 && factor != 1.0 {
                return Err(Error::Unsupported(format!(
                    "{key} {factor}: only an unscaled RoPE is supported"
                )));
            }
        }
    }
    if g.tensor("rope_freqs.weight").is_some() {
        return Err(Error::Unsupported(
            "rope_freqs.weight (per-frequency RoPE factors): only an unscaled RoPE is supported"
                .into(),
        ));
    }
    Ok(())
}

impl LlamaConfig {
    /// Reads and checks the hyperparameters.
    ///
    /// Beyond [`LlamaParams::from_gguf`], candle's reader requires
    /// `{arch}.rope.dimension_count` and `{arch}.attention.layer_norm_rms_epsilon` and takes the
    /// head dimension as `embedding_length / head_count`; a file where the RoPE covers part of
    /// a head, or whose key length differs from that quotient, is refused here rather than run
    /// differently from the oracle; so is a scaled RoPE (linear or YaRN scaling, llama3
    /// frequency factors), which both would run as if unscaled.
    pub fn from_gguf(g: &Gguf<'_>) -> Result<Self> {
        let params = g.llama_params()?;
        let arch = params.architecture.as_str();
        if !SUPPORTED_ARCHS.contains(&arch) {
            return Err(Error::Unsupported(format!(
                "architecture {arch:?} (supported: {SUPPORTED_ARCHS:?})"
            )));
        }
        let rope_dim = g.get_u32(&format!("{arch}.rope.dimension_count"))?;
        g.get_f32(&format!("{arch}.attention.layer_norm_rms_epsilon"))?;
        if params.embedding_length % params.n_heads != 0
            || params.head_dim != params.embedding_length / params.n_heads
            || params.head_dim_v != params.head_dim
        {
            return Err(Error::Unsupported(format!(
                "head dims {}/{} differ from embedding_length / head_count = {} / {}",
                params.head_dim, params.head_dim_v, params.embedding_length, params.n_heads
            )));
        }
        if rope_dim != params.head_dim || params.head_dim % 2 != 0 {
            return Err(Error::Unsupported(format!(
                "rope.dimension_count {rope_dim} with head_dim {}: only a RoPE over the whole \
                 (even) head is supported",
                params.head_dim
            )));
        }
        check_unscaled_rope(g, arch)?;
        let embd = g.require_tensor("token_embd.weight")?;
        let vocab_size = match embd.shape() {
            [d, v] if *d == u64::from(params.embedding_length) => *v as usize,
            s => {
                return Err(Error::Unsupported(format!(
                    "token_embd.weight has shape {s:?}, expected [{}, vocab]",
                    params.embedding_length
                )))
            }
        };
        Ok(Self {
            tied_embeddings: g.tensor("output.weight").is_none(),
            params,
            vocab_size,
        })
    }

    /// Model width.
    pub fn dim(&self) -> usize {
        self.params.embedding_length as usize
    }

    /// Transformer layers.
    pub fn n_layers(&self) -> usize {
        self.params.n_layers as usize
    }

    /// Query heads.
    pub fn n_heads(&self) -> usize {
        self.params.n_heads as usize
    }

    /// Key/value heads.
    pub fn n_kv_heads(&self) -> usize {
        self.params.n_kv_heads as usize
    }

    /// Elements per head.
    pub fn head_dim(&self) -> usize {
        self.params.head_dim as usize
    }

    /// The KV shape of this model in pagedkv's arena (f32 on the CPU).
    pub fn kv_shape(&self) -> ModelKvShape {
        ModelKvShape {
            num_layers: self.n_layers(),
            num_kv_heads: self.n_kv_heads(),
            head_dim: self.head_dim(),
            dtype: KvDtype::F32,
        }
    }
}
