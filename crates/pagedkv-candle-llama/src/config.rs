//! The model's hyperparameters, read from GGUF metadata the way candle's `quantized_llama`
//! reads them, so that the two run the same model from the same file.

use crate::error::{Error, Result};
use pagedkv::gguf::{GgmlType, Gguf, LlamaParams};
use pagedkv::kv::{KvDtype, ModelKvShape};

/// Architectures this client runs: llama's GGUF layout with llama.cpp's "NORM" RoPE (adjacent
/// pairs rotated), which is what candle's `quantized_llama` runs for them (it reads `llama.*`
/// keys whatever the architecture). NEOX-RoPE families (qwen2, phi3, ...) are refused, and so
/// are RoPE scalings other than linear and llama3's frequency factors (see [`RopeScaling`]).
const SUPPORTED_ARCHS: [&str; 1] = ["llama"];

/// A llama's hyperparameters.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// pagedkv's reading of the llama keys (layers, heads, widths, eps, rope base).
    pub params: LlamaParams,
    /// The RoPE's scaling (linear, llama3 frequency factors, or none).
    pub rope_scaling: RopeScaling,
    /// Rows of the token embedding (and of the output projection).
    pub vocab_size: usize,
    /// Whether the file has no `output.weight`, so the output projection is the token
    /// embedding (tied), as candle does.
    pub tied_embeddings: bool,
}

/// How the file scales its RoPE, as llama.cpp reads it for a llama: the pair `i` of a head is
/// rotated by `pos * freq_scale * base^(-2i/d) / freq_factors[i]` (ggml's `rope_ext` with no
/// YaRN extrapolation and an attention factor of 1).
#[derive(Debug, Clone, PartialEq)]
pub struct RopeScaling {
    /// `1 / {arch}.rope.scaling.factor` (or the legacy `{arch}.rope.scale_linear`) for linear
    /// scaling (position interpolation); 1 when the file has no factor, a factor of 0
    /// (llama.cpp's "unset"), or `rope.scaling.type` "none".
    pub freq_scale: f32,
    /// `rope_freqs.weight`: one divisor per rotated pair (llama 3.1/3.2's "llama3" frequency
    /// factors), `head_dim / 2` finite positive values; `None` when the file has none.
    pub freq_factors: Option<Vec<f32>>,
}

impl RopeScaling {
    /// No scaling: the plain `pos * base^(-2i/d)` that candle's `quantized_llama` applies.
    pub fn none() -> Self {
        Self {
            freq_scale: 1.0,
            freq_factors: None,
        }
    }

    /// Reads the scaling from the file (for `head_dim`-wide heads). Refused
    /// ([`Error::Unsupported`]): a `{arch}.rope.scaling.type` other than "none" or "linear"
    /// (YaRN, LongRoPE, ... rotate by other formulas), an attention factor
    /// (`{arch}.rope.scaling.attn_factor`) other than 1, a factor that is negative, not finite
    /// or makes `freq_scale` not finite, and a `rope_freqs.weight` that is not F32 of
    /// `head_dim / 2` finite positive values.
    fn from_gguf(g: &Gguf<'_>, arch: &str, head_dim: u32) -> Result<Self> {
        let unsupported = |m: String| Err(Error::Unsupported(m));
        let k_type = format!("{arch}.rope.scaling.type");
        // llama.cpp's default when the key is absent is "linear" (a factor alone scales).
        let linear = match g.get(&k_type) {
            None => true,
            Some(_) => match g.get_str(&k_type)? {
                "linear" => true,
                "none" => false,
                ty => {
                    return unsupported(format!(
                        "{k_type} {ty:?}: only an unscaled, linear or llama3 (rope_freqs) \
                         RoPE is supported"
                    ))
                }
            },
        };
        let k_attn = format!("{arch}.rope.scaling.attn_factor");
        if g.get(&k_attn).is_some() {
            let f = g.get_f32(&k_attn)?;
            if f != 1.0 {
                return unsupported(format!("{k_attn} {f}: only 1 is supported"));
            }
        }
        // The first key present wins, as in llama.cpp (the legacy key is read only when the
        // new one is absent).
        let mut factor = 0.0f32;
        for key in ["rope.scaling.factor", "rope.scale_linear"] {
            let key = format!("{arch}.{key}");
            if g.get(&key).is_some() {
                factor = g.get_f32(&key)?;
                let usable = factor == 0.0 || (factor > 0.0 && (1.0 / factor).is_finite());
                if !(usable && factor.is_finite()) {
                    return unsupported(format!("{key} {factor}: not a usable RoPE scale"));
                }
                break;
            }
        }
        let freq_scale = if linear && factor != 0.0 {
            1.0 / factor
        } else {
            1.0
        };
        let freq_factors = match g.tensor("rope_freqs.weight") {
            None => None,
            Some(t) => {
                let pairs = u64::from(head_dim / 2);
                if t.ty() != GgmlType::F32 || t.shape() != [pairs] {
                    return unsupported(format!(
                        "rope_freqs.weight is {:?} {:?}, expected F32 [{pairs}] (one factor \
                         per rotated pair)",
                        t.ty(),
                        t.shape()
                    ));
                }
                let factors: Vec<f32> = t
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                if let Some(bad) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
                    return unsupported(format!(
                        "rope_freqs.weight holds {bad}: factors must be finite and positive"
                    ));
                }
                Some(factors)
            }
        };
        Ok(Self {
            freq_scale,
            freq_factors,
        })
    }
}

impl LlamaConfig {
    /// Reads and checks the hyperparameters.
    ///
    /// Beyond [`LlamaParams::from_gguf`], candle's reader requires
    /// `{arch}.rope.dimension_count` and `{arch}.attention.layer_norm_rms_epsilon` and takes the
    /// head dimension as `embedding_length / head_count`; a file where the RoPE covers part of
    /// a head, or whose key length differs from that quotient, is refused here rather than run
    /// differently from the oracle. A linear scaling and llama3's frequency factors are run as
    /// llama.cpp runs them (candle's reader ignores both: [`RopeScaling`]); other scalings
    /// (YaRN, LongRoPE), mixture-of-experts layers and bias tensors (`*.bias`, which
    /// llama.cpp adds to the projections and candle's reader ignores) are refused.
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
        let k_experts = format!("{arch}.expert_count");
        if g.get(&k_experts).is_some() {
            let experts = g.get_u32(&k_experts)?;
            if experts > 0 {
                // A Mixtral-style file: its layers have routed experts (ffn_gate_inp,
                // ffn_*_exps) in place of the dense MLP this client runs.
                return Err(Error::Unsupported(format!(
                    "{k_experts} {experts}: mixture-of-experts layers are not supported"
                )));
            }
        }
        // llama.cpp's llama graph adds the projections' optional biases
        // (`blk.N.attn_{q,k,v,output}.bias`, `blk.N.ffn_{gate,up,down}.bias`) when the file
        // has them; this client has none (nor has candle's `quantized_llama`), and would run
        // such a file with them left out.
        if let Some(t) = g.tensors().iter().find(|t| t.name().ends_with(".bias")) {
            return Err(Error::Unsupported(format!(
                "tensor {}: bias terms are not supported",
                t.name()
            )));
        }
        let rope_scaling = RopeScaling::from_gguf(g, arch, params.head_dim)?;
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
            rope_scaling,
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
