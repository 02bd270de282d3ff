//! Hyperparameters of a llama-family model, read from GGUF metadata.
//!
//! Keys follow llama.cpp's `LLM_KV_*` names, prefixed with `general.architecture` ("llama",
//! "mistral", "qwen2", ...): `{arch}.block_count`, `{arch}.attention.head_count`, and so on.
//! Defaults are llama.cpp's where it has one (KV heads = heads, head dim = embedding / heads,
//! rope base 10000).

use super::parse::{Gguf, Value};
use super::GgufError;

/// What an engine needs to size its KV cache and attention for a llama-family model.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaParams {
    /// `general.architecture`.
    pub architecture: String,
    /// Transformer layers (`{arch}.block_count`).
    pub n_layers: u32,
    /// Query heads (`{arch}.attention.head_count`).
    pub n_heads: u32,
    /// Key/value heads (`{arch}.attention.head_count_kv`, default `n_heads`); divides `n_heads`.
    pub n_kv_heads: u32,
    /// Key head dimension (`{arch}.attention.key_length`, default `embedding_length / n_heads`).
    pub head_dim: u32,
    /// Value head dimension (`{arch}.attention.value_length`, default `embedding_length /
    /// n_heads` as in llama.cpp, whatever `key_length` says).
    pub head_dim_v: u32,
    /// Model width (`{arch}.embedding_length`).
    pub embedding_length: u32,
    /// Training context length (`{arch}.context_length`).
    pub context_length: u32,
    /// RoPE frequency base (`{arch}.rope.freq_base`, default 10000).
    pub rope_freq_base: f32,
    /// Normalisation epsilon (`{arch}.attention.layer_norm_rms_epsilon`, else
    /// `{arch}.attention.layer_norm_epsilon`).
    pub norm_eps: f32,
}

impl LlamaParams {
    /// Reads the hyperparameters from a parsed file.
    ///
    /// Errors: [`GgufError::MissingKey`] for an absent required key (and when neither epsilon
    /// key is present), [`GgufError::WrongType`] for a value of the wrong type (an integer out
    /// of `u32` range included), [`GgufError::BadHyperparameter`] for zero sizes, KV heads that
    /// do not divide the heads, a width the heads do not divide with no key / value length
    /// given, per-layer head counts that differ between layers (or whose array is empty or
    /// not one entry per layer), a RoPE base that is not a positive finite number, or a
    /// negative or non-finite epsilon.
    pub fn from_gguf(g: &Gguf<'_>) -> Result<LlamaParams, GgufError> {
        let arch = g.get_str("general.architecture")?;
        let key = |k: &str| format!("{arch}.{k}");
        let positive = |k: String, v: u32| {
            if v == 0 {
                Err(GgufError::BadHyperparameter {
                    key: k,
                    reason: "must be positive",
                })
            } else {
                Ok(v)
            }
        };
        let n_layers = positive(key("block_count"), g.get_u32(&key("block_count"))?)?;
        let k_heads = key("attention.head_count");
        let n_heads = positive(k_heads.clone(), uniform_u32(g, &k_heads, n_layers)?)?;
        let k_kv = key("attention.head_count_kv");
        let n_kv_heads = match g.get(&k_kv) {
            None => n_heads,
            Some(_) => positive(k_kv.clone(), uniform_u32(g, &k_kv, n_layers)?)?,
        };
        if n_heads % n_kv_heads != 0 {
            return Err(GgufError::BadHyperparameter {
                key: k_kv,
                reason: "KV heads must divide the attention heads",
            });
        }
        let k_embd = key("embedding_length");
        let embedding_length = positive(k_embd.clone(), g.get_u32(&k_embd)?)?;
        let k_kl = key("attention.key_length");
        let head_dim = match g.get(&k_kl) {
            Some(_) => positive(k_kl.clone(), g.get_u32(&k_kl)?)?,
            None if embedding_length % n_heads == 0 => embedding_length / n_heads,
            None => {
                return Err(GgufError::BadHyperparameter {
                    key: k_embd,
                    reason: "not divisible by the head count, and no key_length given",
                })
            }
        };
        let k_vl = key("attention.value_length");
        // llama.cpp: n_embd_head_v = n_embd / n_head unless value_length says otherwise;
        // key_length does not change it.
        let head_dim_v = match g.get(&k_vl) {
            Some(_) => positive(k_vl.clone(), g.get_u32(&k_vl)?)?,
            None if embedding_length % n_heads == 0 => embedding_length / n_heads,
            None => {
                return Err(GgufError::BadHyperparameter {
                    key: k_embd,
                    reason: "not divisible by the head count, and no value_length given",
                })
            }
        };
        let k_ctx = key("context_length");
        let context_length = positive(k_ctx.clone(), g.get_u32(&k_ctx)?)?;
        let k_rope = key("rope.freq_base");
        let rope_freq_base = match g.get(&k_rope) {
            Some(_) => g.get_f32(&k_rope)?,
            None => 10_000.0,
        };
        if !(rope_freq_base.is_finite() && rope_freq_base > 0.0) {
            return Err(GgufError::BadHyperparameter {
                key: k_rope,
                reason: "must be a positive finite number",
            });
        }
        let k_rms = key("attention.layer_norm_rms_epsilon");
        let k_ln = key("attention.layer_norm_epsilon");
        let (k_eps, norm_eps) = match (g.get(&k_rms), g.get(&k_ln)) {
            (Some(_), _) => (k_rms.clone(), g.get_f32(&k_rms)?),
            (None, Some(_)) => (k_ln.clone(), g.get_f32(&k_ln)?),
            (None, None) => return Err(GgufError::MissingKey { key: k_rms }),
        };
        if !(norm_eps.is_finite() && norm_eps >= 0.0) {
            return Err(GgufError::BadHyperparameter {
                key: k_eps,
                reason: "must be a finite number, not negative",
            });
        }
        Ok(LlamaParams {
            architecture: arch.into(),
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            head_dim_v,
            embedding_length,
            context_length,
            rope_freq_base,
            norm_eps,
        })
    }

    /// Bytes of K and V cache per token across all layers, at `bytes_per_elem` per value;
    /// `None` where that does not fit in 64 bits (the counts come from the file: a layer and
    /// head count of u32::MAX each is a valid header, not a valid model).
    pub fn kv_bytes_per_token(&self, bytes_per_elem: u64) -> Option<u64> {
        u64::from(self.n_layers)
            .checked_mul(u64::from(self.n_kv_heads))?
            .checked_mul(u64::from(self.head_dim) + u64::from(self.head_dim_v))?
            .checked_mul(bytes_per_elem)
    }
}

/// A head count stored either as one integer or as a per-layer array (one entry per layer,
/// as llama.cpp requires) whose entries agree.
fn uniform_u32(g: &Gguf<'_>, key: &str, n_layers: u32) -> Result<u32, GgufError> {
    match g.get(key) {
        Some(Value::Array(a)) => {
            if !a.is_empty() && a.len() != u64::from(n_layers) {
                return Err(GgufError::BadHyperparameter {
                    key: key.into(),
                    reason: "per-layer array length differs from block_count",
                });
            }
            let mut first = None;
            for v in a.iter() {
                let v = v.as_u32().ok_or_else(|| GgufError::WrongType {
                    key: key.into(),
                    expected: "an array of integers in u32 range",
                    found: v.value_type(),
                })?;
                match first {
                    None => first = Some(v),
                    Some(f) if f == v => {}
                    Some(_) => {
                        return Err(GgufError::BadHyperparameter {
                            key: key.into(),
                            reason: "per-layer values differ; only uniform models are supported",
                        })
                    }
                }
            }
            first.ok_or_else(|| GgufError::BadHyperparameter {
                key: key.into(),
                reason: "empty per-layer array",
            })
        }
        _ => g.get_u32(key),
    }
}

impl<'a> Gguf<'a> {
    /// The llama-family hyperparameters of this file (see [`LlamaParams::from_gguf`]).
    pub fn llama_params(&self) -> Result<LlamaParams, GgufError> {
        LlamaParams::from_gguf(self)
    }
}
