//! `generate`'s counters: `generated` is the tokens sampled (every output token), `scheduled`
//! the tokens run through the model (each prompt, and every output token but the last, which
//! is sampled and never fed back). Without preemption both are exact sums of the requests.

use pagedkv::gguf::Gguf;
use pagedkv::sched::{PreemptionMode, Priority, SeqRequest, StopRules};
use pagedkv_candle_llama::fixture::TinyLlama;
use pagedkv_candle_llama::{build_engine, generate, EngineSetup, MatMulMode, PagedLlama};

#[test]
fn generation_counts_the_tokens_sampled_and_run() {
    let bytes = TinyLlama::f32().write(9).unwrap();
    let mut model =
        PagedLlama::from_gguf(&Gguf::parse(&bytes).unwrap(), MatMulMode::Quantized).unwrap();
    // The default arena (256 pages of 16) holds every sequence: nothing is preempted, so no
    // token is recomputed.
    let setup = EngineSetup {
        preemption: PreemptionMode::Recompute,
        ..EngineSetup::default()
    };
    let mut engine = build_engine(model.config(), &setup).unwrap();
    let (prompt_lens, new_tokens) = ([5u32, 9, 3], [4u32, 6, 1]);
    let requests = prompt_lens
        .iter()
        .zip(new_tokens)
        .enumerate()
        .map(|(i, (&len, n))| SeqRequest {
            id: i as u64,
            prompt: (1..=len).collect(),
            stop: StopRules {
                max_new_tokens: n,
                eos: vec![],
                stop_sequences: vec![],
            },
            priority: Priority::Throughput,
        });
    let gen = generate(&mut engine, &mut model, requests, 100).unwrap();
    let stats = engine.batcher().stats();
    assert_eq!(
        stats.preempted_recompute + stats.preempted_swap,
        0,
        "{stats:?}"
    );
    for (i, &n) in new_tokens.iter().enumerate() {
        assert_eq!(gen.outputs[&(i as u64)].len(), n as usize, "seq {i}");
    }
    let prompts: u64 = prompt_lens.iter().map(|&p| u64::from(p)).sum();
    let outputs: u64 = new_tokens.iter().map(|&n| u64::from(n)).sum();
    assert_eq!(gen.generated, outputs, "tokens sampled");
    assert_eq!(
        gen.scheduled,
        prompts + outputs - new_tokens.len() as u64,
        "tokens run: the prompts and every output token but each sequence's last"
    );
    // The longest sequence decodes one token a step after its prompt's step.
    assert!(gen.steps >= 6, "{} steps", gen.steps);
    assert!(gen.tokens_per_second() > 0.0);
}
