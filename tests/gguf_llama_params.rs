//! A llama model's geometry from GGUF metadata (`Gguf::llama_params`): values that would run
//! but compute garbage are refused, and defaults follow llama.cpp's loader.

use pagedkv::gguf::{Gguf, GgufError, GgufWriter, LlamaParams, MetaValue, ValueType};

/// A 2-layer, 16-head (4 KV heads), 2048-wide llama header plus `extra` keys (an epsilon is
/// added unless `extra` has one).
fn params(extra: &[(&str, MetaValue)]) -> Result<LlamaParams, GgufError> {
    let mut w = GgufWriter::new();
    let base = [
        ("general.architecture", MetaValue::String("llama".into())),
        ("llama.block_count", MetaValue::U32(2)),
        ("llama.attention.head_count", MetaValue::U32(16)),
        ("llama.embedding_length", MetaValue::U32(2048)),
        ("llama.context_length", MetaValue::U32(4096)),
    ];
    for (k, v) in base.into_iter().chain(extra.iter().cloned()) {
        w.add(k, v).unwrap();
    }
    if !extra.iter().any(|(k, _)| k.contains("epsilon")) {
        w.add(
            "llama.attention.layer_norm_rms_epsilon",
            MetaValue::F32(1e-5),
        )
        .unwrap();
    }
    if !extra.iter().any(|(k, _)| k.contains("head_count_kv")) {
        w.add("llama.attention.head_count_kv", MetaValue::U32(4))
            .unwrap();
    }
    let bytes = w.to_bytes().unwrap();
    Gguf::parse(&bytes).unwrap().llama_params()
}

fn refused(r: Result<LlamaParams, GgufError>) -> bool {
    matches!(r, Err(GgufError::BadHyperparameter { .. }))
}

/// A RoPE base of 0, NaN, negative or infinite made every logit NaN (the candle client then
/// generated token 0 forever) instead of an error.
#[test]
fn a_rope_base_that_is_not_a_positive_finite_number_is_refused() {
    for base in [f32::NAN, 0.0, -10_000.0, f32::INFINITY] {
        let r = params(&[("llama.rope.freq_base", MetaValue::F32(base))]);
        assert!(refused(r), "rope.freq_base {base}");
    }
    let p = params(&[("llama.rope.freq_base", MetaValue::F32(500_000.0))]).unwrap();
    assert_eq!(p.rope_freq_base, 500_000.0);
}

/// As the RoPE base: a norm epsilon of NaN, below zero or infinite.
#[test]
fn a_norm_epsilon_that_is_negative_or_not_finite_is_refused() {
    for eps in [f32::NAN, -1.0, f32::INFINITY] {
        let r = params(&[(
            "llama.attention.layer_norm_rms_epsilon",
            MetaValue::F32(eps),
        )]);
        assert!(refused(r), "epsilon {eps}");
    }
    assert!(params(&[(
        "llama.attention.layer_norm_epsilon",
        MetaValue::F32(f32::NAN)
    )])
    .is_err());
}

/// llama.cpp's loader: the value head dim is embedding / heads unless value_length says
/// otherwise; key_length does not change it (it used to: an undersized V cache).
#[test]
fn value_length_defaults_to_embedding_over_heads_as_in_llama_cpp() {
    let p = params(&[("llama.attention.key_length", MetaValue::U32(64))]).unwrap();
    assert_eq!((p.head_dim, p.head_dim_v), (64, 2048 / 16));
    assert_eq!(p.kv_bytes_per_token(2), Some(2 * 4 * (64 + 128) * 2));
    let p = params(&[
        ("llama.attention.key_length", MetaValue::U32(64)),
        ("llama.attention.value_length", MetaValue::U32(96)),
    ])
    .unwrap();
    assert_eq!((p.head_dim, p.head_dim_v), (64, 96));
}

/// A per-layer head-count array must have one entry per layer (llama.cpp refuses others).
#[test]
fn a_per_layer_array_of_the_wrong_length_is_refused() {
    let per_layer = |n| MetaValue::Array {
        elem: ValueType::U32,
        items: vec![MetaValue::U32(4); n],
    };
    assert!(refused(params(&[(
        "llama.attention.head_count_kv",
        per_layer(5)
    )])));
    let p = params(&[("llama.attention.head_count_kv", per_layer(2))]).unwrap();
    assert_eq!(p.n_kv_heads, 4);
}
