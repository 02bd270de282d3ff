//! Scaled RoPE files (llama 3.1/3.2's per-frequency factors in `rope_freqs.weight`, linear
//! scaling) run as llama.cpp runs them. candle's `quantized_llama` ignores both, so the oracle
//! is an identity instead: dividing each pair's inverse frequency `base^(-2i/d)` by
//! `(b2 / base)^(2i/d)` gives exactly the inverse frequencies of base `b2`, so a file of base
//! `base` with those factors must match candle on the same weights at base `b2`. A linear
//! factor `s` is the uniform factor `s`.

mod support;

use pagedkv::sched::{PreemptionMode, Priority, SeqRequest, StopRules};
use pagedkv_candle_llama::fixture::TinyLlama;
use pagedkv_candle_llama::{build_engine, generate, MatMulMode, PagedLlama, RowLogits};
use support::{candle_model, run_and_compare, small_engine, Tolerance, F32_TOL};

/// The factors `(to / from)^(2i/d)`, `i < d/2`, that turn base `from`'s frequencies into
/// base `to`'s (computed in f64, rounded once).
fn factors_between(from: f32, to: f32, head_dim: usize) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| (f64::from(to) / f64::from(from)).powf(2.0 * i as f64 / head_dim as f64) as f32)
        .collect()
}

/// `spec` at its own base carrying the factors that make it base `to`, against candle's
/// model of `spec` at base `to`.
fn check_against_base(spec: TinyLlama, to: f32, seed: u64, tol: Tolerance) {
    let head_dim = spec.dim / spec.heads;
    let scaled = TinyLlama {
        rope_freqs: Some(factors_between(spec.rope_base, to, head_dim)),
        ..spec.clone()
    };
    check_files(
        &scaled,
        &TinyLlama {
            rope_base: to,
            ..spec
        },
        seed,
        tol,
    );
}

/// pagedkv on `ours` against candle on `oracle` (the same weights: same shape and seed).
fn check_files(ours: &TinyLlama, oracle: &TinyLlama, seed: u64, tol: Tolerance) {
    let mut candle = candle_model(&oracle.write(seed).unwrap());
    let c = run_and_compare(
        &ours.write(seed).unwrap(),
        MatMulMode::Quantized,
        small_engine(PreemptionMode::Recompute),
        &mut candle,
        tol,
        false,
    );
    println!("{c}");
}

/// As `matches_candle`'s quantized bound (candle's 8-bit activation quantization).
const Q_TOL: Tolerance = Tolerance {
    atol: 0.1,
    rtol: 0.02,
    mean: 1e-2,
};

#[test]
fn llama3_frequency_factors_match_candle_at_the_equivalent_base() {
    check_against_base(TinyLlama::f32(), 1e6, 1, F32_TOL);
    check_against_base(TinyLlama::f32().with_head_dim(64), 1e6, 2, F32_TOL);
    check_against_base(TinyLlama::mixed(), 5e7, 3, Q_TOL);
}

/// The comparison sees the factors: the same file without them (a client that ignores
/// `rope_freqs.weight`, as this one did before it refused such files) does not match.
#[test]
#[should_panic(expected = "candle")]
fn ignored_frequency_factors_do_not_match_candle() {
    let spec = TinyLlama::f32();
    check_files(
        &spec,
        &TinyLlama {
            rope_base: 1e6,
            ..spec.clone()
        },
        1,
        F32_TOL,
    );
}

/// Every sampled row's logits of six sequences on `spec`'s file (greedy).
fn logits(spec: &TinyLlama) -> Vec<RowLogits> {
    let bytes = spec.write(5).unwrap();
    let g = pagedkv::gguf::Gguf::parse(&bytes).unwrap();
    let mut model = PagedLlama::from_gguf(&g, MatMulMode::Quantized).unwrap();
    model.record_logits(true);
    let setup = small_engine(PreemptionMode::Recompute);
    let mut engine = build_engine(model.config(), &setup).unwrap();
    let requests = support::prompts(&support::PROMPT_LENS, spec.vocab, 11)
        .into_iter()
        .enumerate()
        .map(|(i, prompt)| SeqRequest {
            id: i as u64,
            prompt,
            stop: StopRules {
                max_new_tokens: 12,
                eos: vec![],
                stop_sequences: vec![],
            },
            priority: Priority::Throughput,
        });
    generate(&mut engine, &mut model, requests, 10_000).unwrap();
    let mut rows = model.take_logits();
    rows.sort_by_key(|r| (r.seq, r.position));
    rows
}

/// A linear factor of 4 rotates as the uniform factor 4 (both exact in f32: a multiply by
/// 1/4 and a divide by 4), so the logits are identical; and unlike the unscaled file's.
#[test]
fn linear_scaling_runs_as_uniform_frequency_factors() {
    let spec = TinyLlama::f32();
    let linear = logits(&TinyLlama {
        rope_scaling_factor: Some(4.0),
        ..spec.clone()
    });
    let uniform = logits(&TinyLlama {
        rope_freqs: Some(vec![4.0; spec.dim / spec.heads / 2]),
        ..spec.clone()
    });
    let plain = logits(&spec);
    assert_eq!(linear.len(), uniform.len());
    for (a, b) in linear.iter().zip(&uniform) {
        assert_eq!((a.seq, a.position), (b.seq, b.position));
        assert_eq!(a.logits, b.logits, "seq {} pos {}", a.seq, a.position);
    }
    let moved = linear
        .iter()
        .zip(&plain)
        .filter(|(a, b)| a.position > 0 && a.logits != b.logits)
        .count();
    assert!(moved > linear.len() / 2, "scaling changed {moved} rows");
}
