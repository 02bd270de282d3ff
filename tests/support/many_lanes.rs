//! The closed-form workload of the many-engine tests (tests/engine_many.rs on the host backend,
//! tests/cuda_emu_many.rs on the emulated raw backend): K/V values that depend on the engine,
//! so a page of one engine read through another's view shows; the attention output each row
//! must have; the requests, and the bookkeeping of what each sequence was delivered.
// Each test crate that includes this file uses part of it.
#![allow(dead_code)]

use pagedkv::sched::{Batch, FinishReason, Priority, SeqId, SeqRequest, StepResults, StopRules};
use rand::Rng;
use std::collections::HashMap;

/// Every prompt token of sequence `seq`.
pub fn prompt_token(seq: SeqId) -> u32 {
    7 + (seq % 5) as u32
}

/// The token the model generates at position `pos` (never a prompt token).
pub fn truth(pos: i32) -> u32 {
    100 + pos as u32
}

/// A K/V element. Depends on the engine too, so a page of one engine read through another
/// shows.
pub fn value(engine: usize, pos: i32, layer: usize, d: usize, token: u32) -> f32 {
    (pos % 64) as f32 * 0.25
        + layer as f32 * 3.0
        + d as f32 * 0.01
        + (token % 97) as f32 * 0.125
        + engine as f32 * 5.0
}

/// The row (sequence) of each flattened token.
pub fn token_rows(batch: &Batch) -> Vec<usize> {
    let mut rows = Vec::with_capacity(batch.num_tokens());
    for s in 0..batch.num_seqs() {
        let (a, b) = (batch.query_start_loc[s], batch.query_start_loc[s + 1]);
        rows.extend(std::iter::repeat_n(s, (b - a) as usize));
    }
    rows
}

/// One engine's closed-form model, as far as its attention output goes.
pub struct ClosedForm<'a> {
    pub engine: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// Each sequence's prompt length.
    pub prompt_len: &'a HashMap<SeqId, usize>,
}

impl ClosedForm<'_> {
    /// Checks every attention output of `layer`: `got(t, h, d)` against the mean over the
    /// positions up to `t`'s of the values (queries and keys are constant, so every weight is
    /// equal), each rounded through the cache type by `round`, within `tol` relative.
    pub fn check_attended(
        &self,
        layer: usize,
        batch: &Batch,
        tol: f32,
        round: impl Fn(f32) -> f32,
        got: impl Fn(usize, usize, usize) -> f32,
    ) {
        let rows = token_rows(batch);
        for (t, &row) in rows.iter().enumerate() {
            let (seq, pos) = (batch.seq_ids[row], batch.positions[t]);
            let first = batch.query_start_loc[row] as usize;
            let row_start = batch.positions[first];
            let plen = self.prompt_len[&seq];
            let token = |p: i32| {
                if p < row_start {
                    if (p as usize) < plen {
                        prompt_token(seq)
                    } else {
                        truth(p)
                    }
                } else {
                    batch.input_tokens[first + (p - row_start) as usize]
                }
            };
            for h in 0..self.heads {
                for d in 0..self.head_dim {
                    let want = (0..=pos)
                        .map(|p| round(value(self.engine, p, layer, d, token(p))))
                        .sum::<f32>()
                        / (pos + 1) as f32;
                    let got = got(t, h, d);
                    assert!(
                        (got - want).abs() <= tol * want.abs().max(1.0),
                        "engine {} seq {seq} pos {pos} layer {layer} head {h} dim {d}: {got} != {want}",
                        self.engine
                    );
                }
            }
        }
    }
}

/// The sampled tokens of a batch: the truth after each sampling position.
pub fn sample(batch: &Batch, out: &mut Vec<u32>) {
    out.extend(
        batch
            .logits_indices
            .iter()
            .map(|&t| truth(batch.positions[t as usize] + 1)),
    );
}

/// A request of `prompt` tokens for up to `out` new ones, latency-critical with probability
/// 0.3 (one draw from `rng`).
pub fn request(rng: &mut impl Rng, id: SeqId, prompt: usize, out: u32) -> SeqRequest {
    SeqRequest {
        id,
        prompt: vec![prompt_token(id); prompt],
        stop: StopRules {
            max_new_tokens: out,
            eos: Vec::new(),
            stop_sequences: Vec::new(),
        },
        priority: if rng.gen_bool(0.3) {
            Priority::LatencyCritical
        } else {
            Priority::Throughput
        },
    }
}

/// Per sequence: (prompt length, max new tokens, tokens delivered, end).
pub type Seqs = HashMap<SeqId, (usize, u32, Vec<u32>, Option<FinishReason>)>;

/// Records a step's delivered tokens and ends; nothing may arrive after a sequence's end.
pub fn record(seqs: &mut Seqs, results: &StepResults, seed: u64) {
    for u in &results.updates {
        let w = seqs.get_mut(&u.id).expect("unknown seq");
        assert!(
            w.3.is_none(),
            "seed {seed}: seq {} updated after its end",
            u.id
        );
        w.2.extend_from_slice(results.tokens_of(u));
        w.3 = u.finished;
    }
}

/// Every sequence delivered has ended (if `strict`) and its tokens are the truth, all of them
/// where it ended at its token limit.
pub fn check_streams(seqs: &Seqs, seed: u64, strict: bool) {
    for (&id, (prompt, out, tokens, end)) in seqs {
        if end.is_none() && !strict {
            continue;
        }
        let end = end.unwrap_or_else(|| panic!("seed {seed}: seq {id} never ended"));
        let want: Vec<u32> = (*prompt as i32..).take(*out as usize).map(truth).collect();
        assert_eq!(&want[..tokens.len()], &tokens[..], "seed {seed}: seq {id}");
        if end == FinishReason::MaxTokens {
            assert_eq!(tokens.len(), *out as usize, "seed {seed}: seq {id}");
        }
    }
}
