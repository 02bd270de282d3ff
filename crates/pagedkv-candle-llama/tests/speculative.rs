//! Speculative decoding through the model (`Engine::propose`, drafts checked by
//! `PagedLlama::check_drafts`): a decode row then carries its last token and the drafts, the
//! model samples one token per draft, and the engine keeps the confirmed drafts and rolls back
//! the KV of the rest. Greedy outputs must be those of plain decoding, and every row whose
//! inputs were the sequence's real tokens must carry candle's logits (f32 tolerance).

#[allow(dead_code)] // the six-sequence scenario of the other comparisons
mod support;

use pagedkv::gguf::Gguf;
use pagedkv::sched::{Priority, SeqId, SeqRequest, StopRules};
use pagedkv_candle_llama::fixture::TinyLlama;
use pagedkv_candle_llama::{
    build_engine, generate, EngineSetup, MatMulMode, PagedLlama, RowLogits,
};
use std::collections::BTreeMap;
use support::{candle_model, compare_rows, prompts, F32_TOL};

const NEW_TOKENS: u32 = 16;

fn requests(prompts: &[Vec<u32>]) -> Vec<SeqRequest> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| SeqRequest {
            id: i as SeqId,
            prompt: p.clone(),
            stop: StopRules {
                max_new_tokens: NEW_TOKENS,
                eos: vec![],
                stop_sequences: vec![],
            },
            priority: Priority::Throughput,
        })
        .collect()
}

#[test]
fn accepted_and_rejected_drafts_match_candle() {
    let bytes = TinyLlama::f32().write(4).unwrap();
    let mut oracle = candle_model(&bytes);
    let mut model =
        PagedLlama::from_gguf(&Gguf::parse(&bytes).unwrap(), MatMulMode::Quantized).unwrap();
    let vocab = model.config().vocab_size;
    let prompts = prompts(&[5, 17, 30, 9], vocab, 31);
    let setup = EngineSetup::default();

    // Plain greedy decoding: the tokens the drafts are taken from.
    let mut engine = build_engine(model.config(), &setup).unwrap();
    let want = generate(&mut engine, &mut model, requests(&prompts), 1_000)
        .unwrap()
        .outputs;

    // Each step, every decoding sequence proposes up to 3 of its next tokens, one of them
    // wrong every other step, so drafts are accepted in part, in whole and not at all.
    model.record_logits(true);
    let mut engine = build_engine(model.config(), &setup).unwrap();
    for r in requests(&prompts) {
        engine.add(r).unwrap();
    }
    let mut got: BTreeMap<SeqId, Vec<u32>> = BTreeMap::new();
    let (mut steps, mut proposed, mut multi) = (0u32, 0u32, 0u32);
    while engine.has_work() {
        steps += 1;
        assert!(steps < 200, "no end");
        for (&id, out) in &got {
            let left = NEW_TOKENS as usize - out.len();
            let k = left.saturating_sub(1).min(3);
            if k == 0 {
                continue;
            }
            let mut drafts = want[&id][out.len()..out.len() + k].to_vec();
            if steps % 2 == 0 {
                let wrong = (k - 1).min(steps as usize % 3);
                drafts[wrong] = (drafts[wrong] + 1) % vocab as u32;
            }
            model.check_drafts(id, &drafts).unwrap();
            engine.propose(id, &drafts).unwrap();
            proposed += 1;
        }
        engine.step(&mut model).unwrap();
        let res = engine.results();
        for u in &res.updates {
            let toks = &res.tokens[u.tokens.clone()];
            multi += u32::from(toks.len() > 1);
            got.entry(u.id).or_default().extend_from_slice(toks);
        }
    }
    assert_eq!(got, want, "drafts changed the greedy outputs");
    assert!(
        proposed >= 16 && multi >= 8,
        "{proposed} proposals, {multi} multi-token steps"
    );

    // A rejected draft's row and those after it ran on a token the sequence does not hold;
    // the position runs again with the real token, so the last row of each position is the
    // one to check (rows past the sequence's last sampled position are such leftovers).
    let mut last: BTreeMap<(SeqId, i32), RowLogits> = BTreeMap::new();
    for row in model.take_logits() {
        last.insert((row.seq, row.position), row);
    }
    let rows: Vec<RowLogits> = last
        .into_values()
        .filter(|r| {
            let len = prompts[r.seq as usize].len() + NEW_TOKENS as usize;
            (r.position as usize) < len - 1
        })
        .collect();
    let lens = vec![NEW_TOKENS as usize; prompts.len()];
    let c = compare_rows(
        rows,
        &prompts,
        &got,
        &lens,
        &mut oracle,
        F32_TOL,
        setup.max_prefill_chunk as usize,
        0,
    );
    println!("{proposed} proposals, {multi} multi-token steps: {c}");
}

/// A draft after a rejected one is never accepted, even when it is the token the model samples
/// after the rejected draft (that sample was conditioned on a token the sequence does not
/// hold). The drafts are built to make exactly that happen: a wrong first draft, then the
/// model's own greedy choice after it; the step must keep only the correction.
#[test]
fn a_draft_after_a_rejected_one_is_never_accepted() {
    let bytes = TinyLlama::f32().write(4).unwrap();
    let mut model =
        PagedLlama::from_gguf(&Gguf::parse(&bytes).unwrap(), MatMulMode::Quantized).unwrap();
    let vocab = model.config().vocab_size as u32;
    let prompt = prompts(&[9], vocab as usize, 41).remove(0);
    let setup = EngineSetup::default();
    let run = |model: &mut PagedLlama, prompt: Vec<u32>, n: u32| {
        let mut engine = build_engine(model.config(), &setup).unwrap();
        let mut req = requests(&[prompt]).remove(0);
        req.stop.max_new_tokens = n;
        generate(&mut engine, model, [req], 100).unwrap().outputs[&0].clone()
    };
    // Plain greedy: t0 (sampled by the prompt's step), t1, t2, ...
    let want = run(&mut model, prompt.clone(), 6);
    // A wrong draft in place of t1, and the model's greedy token after it; one whose token
    // after it is not t2 (accepting it would then change the output).
    let (wrong, after_wrong) = (1..vocab)
        .map(|delta| {
            let wrong = (want[1] + delta) % vocab;
            let mut off_path = prompt.clone();
            off_path.extend([want[0], wrong]);
            (wrong, run(&mut model, off_path, 1)[0])
        })
        .find(|&(_, after)| after != want[2])
        .unwrap();

    let mut engine = build_engine(model.config(), &setup).unwrap();
    let mut req = requests(&[prompt]).remove(0);
    req.stop.max_new_tokens = 6;
    engine.add(req).unwrap();
    let mut got: Vec<u32> = Vec::new();
    let mut proposed = false;
    while engine.has_work() {
        if got.len() == 1 && !proposed {
            engine.propose(0, &[wrong, after_wrong]).unwrap();
            proposed = true;
        }
        engine.step(&mut model).unwrap();
        let res = engine.results();
        for u in &res.updates {
            let toks = &res.tokens[u.tokens.clone()];
            if proposed && got.len() == 1 {
                assert_eq!(
                    toks,
                    &want[1..2],
                    "drafts {wrong}, {after_wrong}: only the correction of the first is kept"
                );
            }
            got.extend_from_slice(toks);
        }
    }
    assert!(proposed, "the sequence never decoded");
    assert_eq!(got, want, "the drafts changed the greedy outputs");
}
