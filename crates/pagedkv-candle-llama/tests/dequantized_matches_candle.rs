//! pagedkv's dequantizer against candle's, through the whole model: the mixed-type file run
//! with [`MatMulMode::Dequantized`] (every Q4_K / Q8_0 / Q4_0 / F16 tensor dequantized by
//! pagedkv, multiplied in f32) against candle's `quantized_llama` with
//! `CANDLE_DEQUANTIZE_ALL=1` (the same tensors dequantized by candle, multiplied in f32), to
//! the f32 tolerance. Its own test binary: candle reads that variable once per thread, and
//! no other test of this binary may see it.

mod support;

use pagedkv::sched::PreemptionMode;
use pagedkv_candle_llama::fixture::TinyLlama;
use pagedkv_candle_llama::MatMulMode;
use support::{candle_model, run_and_compare, small_engine, F32_TOL};

#[test]
fn dequantized_matches_candle_dequantize_all() {
    // The only test in this binary, so no other thread reads the environment meanwhile.
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    let bytes = TinyLlama::mixed().write(5).unwrap();
    let mut oracle = candle_model(&bytes);
    let c = run_and_compare(
        &bytes,
        MatMulMode::Dequantized,
        small_engine(PreemptionMode::Recompute),
        &mut oracle,
        F32_TOL,
        false,
    );
    println!("{c}");
}
