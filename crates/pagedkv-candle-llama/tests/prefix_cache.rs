//! The model on an engine with pagedkv's prefix cache: sequences whose prompts start with a
//! prefix an earlier sequence computed attach its cached KV pages and prefill only the rest,
//! from the position after the hit. `build_engine` runs no prefix cache, but the model is a
//! `StepModel` a server may put on one; every sampled row's logits must still be candle's
//! (which computes each prompt whole), to the f32 tolerance.

#[allow(dead_code)] // the six-sequence scenario of the other comparisons
mod support;

use pagedkv::budget::BudgetConfig;
use pagedkv::engine::{Engine, EngineConfig, HostBackend, RecomputePolicy, SharedArena};
use pagedkv::gguf::Gguf;
use pagedkv::kv::page_bytes_for;
use pagedkv::sched::{PreemptionMode, Priority, SeqRequest, StopRules};
use pagedkv_candle_llama::fixture::TinyLlama;
use pagedkv_candle_llama::{generate, LlamaConfig, MatMulMode, PagedLlama};
use std::collections::BTreeMap;
use std::sync::Arc;
use support::{candle_model, compare_rows, prompts, F32_TOL};

const TOKENS_PER_PAGE: usize = 8;

/// A host engine for `cfg`'s model whose arena has a prefix cache it uses.
fn engine_with_prefix_cache(cfg: &LlamaConfig, pages: u32) -> Engine<HostBackend<f32>> {
    let shape = cfg.kv_shape();
    let page_bytes = page_bytes_for(&[shape], TOKENS_PER_PAGE).unwrap();
    let mut shared = SharedArena::host(BudgetConfig::new(1, 64, pages), page_bytes).unwrap();
    Arc::get_mut(&mut shared)
        .unwrap()
        .enable_prefix_cache(Some(1));
    let engine_cfg = EngineConfig {
        weight: 1,
        max_running: 8,
        max_batched_tokens: 64,
        max_prefill_chunk: 16,
        max_context: 128,
        preemption: PreemptionMode::Recompute,
        swap_blocks: 0,
        recompute: RecomputePolicy::SERVER,
        prefix_cache: true,
    };
    Engine::host(&shared, engine_cfg, &shape, cfg.n_heads()).unwrap()
}

fn request(id: u64, prompt: Vec<u32>, new_tokens: u32) -> SeqRequest {
    SeqRequest {
        id,
        prompt,
        stop: StopRules {
            max_new_tokens: new_tokens,
            eos: vec![],
            stop_sequences: vec![],
        },
        priority: Priority::Throughput,
    }
}

/// Sequence 0 computes a 29-token prompt; then sequences 1-4 share its first 24, 20, 24 and
/// 17 tokens (three whole pages; two and a half; all of a 24-token prompt; two and a token)
/// and go on differently, so they start from cached pages 16 or 24 tokens in. A wrong cached
/// page (the first hit page replaced by the second) fails at sequence 1's first logits.
#[test]
fn model_on_prefix_cache_hits_matches_candle() {
    let bytes = TinyLlama::f32().write(3).unwrap();
    let mut oracle = candle_model(&bytes);
    let mut model =
        PagedLlama::from_gguf(&Gguf::parse(&bytes).unwrap(), MatMulMode::Quantized).unwrap();
    model.record_logits(true);
    let vocab = model.config().vocab_size;
    let mut engine = engine_with_prefix_cache(model.config(), 64);

    let own = prompts(&[29, 5, 9, 0, 11], vocab, 21);
    let shared = &own[0];
    let mut all: Vec<Vec<u32>> = vec![shared.clone()];
    for (i, keep) in [24, 20, 24, 17].into_iter().enumerate() {
        all.push(shared[..keep].iter().chain(&own[i + 1]).copied().collect());
    }
    let new_tokens: Vec<u32> = vec![6, 8, 5, 7, 9];

    let mut outputs = BTreeMap::new();
    let first = generate(
        &mut engine,
        &mut model,
        [request(0, all[0].clone(), new_tokens[0])],
        1_000,
    )
    .unwrap();
    outputs.extend(first.outputs);
    let rest = (1..all.len()).map(|i| request(i as u64, all[i].clone(), new_tokens[i]));
    let second = generate(&mut engine, &mut model, rest, 1_000).unwrap();
    outputs.extend(second.outputs);

    let stats = engine.batcher().stats();
    // Whole cached pages only, and never a prompt's last token (it must run for its logits):
    // 24 + 16 + 16 (of the 24-token prompt) + 16.
    assert_eq!(stats.prefix_hit_tokens, 24 + 16 + 16 + 16, "{stats:?}");
    let lens: Vec<usize> = new_tokens.iter().map(|&n| n as usize).collect();
    let c = compare_rows(
        model.take_logits(),
        &all,
        &outputs,
        &lens,
        &mut oracle,
        F32_TOL,
        16,
        0,
    );
    println!("{} prefix hit tokens: {c}", stats.prefix_hit_tokens);
}
