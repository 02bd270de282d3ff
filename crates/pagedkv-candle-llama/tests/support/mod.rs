//! The oracle and the engine run shared by the `matches_candle` tests: several sequences of
//! different prompt lengths through pagedkv's engine, every sampled row's logits compared with
//! candle-transformers' `quantized_llama` running each sequence alone on the same GGUF bytes.

use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use pagedkv::engine::{Engine, KvBackend, LayerQkv, StepModel};
use pagedkv::error::EngineError;
use pagedkv::gguf::Gguf;
use pagedkv::sched::{Batch, PreemptionMode, Priority, SeqId, SeqRequest, StopRules};
use pagedkv_candle_llama::{
    argmax, build_engine, generate, EngineSetup, MatMulMode, PagedLlama, RowLogits,
};
use std::collections::BTreeMap;
use std::io::Cursor;

/// The f32 paths (float tensors; quantized tensors dequantized on both sides): both sides
/// compute in f32 on the same weights and differ only in summation order (pagedkv's attention
/// kernel against candle's matmul-softmax-matmul; one flat batch against one sequence, so
/// gemm tiles differ). Measured: at most 2.5e-6 and a mean of 3.7e-7 on logits up to 2.3
/// (the tests print it); a decode-position bug (the negative control) gives 3.7e-2.
pub const F32_TOL: Tolerance = Tolerance {
    atol: 5e-5,
    rtol: 1e-5,
    mean: 1e-5,
};

/// candle's own model on the file's bytes.
pub fn candle_model(bytes: &[u8]) -> ModelWeights {
    let mut cur = Cursor::new(bytes);
    let content = candle_core::quantized::gguf_file::Content::read(&mut cur).unwrap();
    ModelWeights::from_gguf(content, &mut cur, &Device::Cpu).unwrap()
}

/// candle's logits after each position `prompt_len - 1 ..= tokens.len() - 2` of one sequence
/// (the prompt in one forward, then one token per forward, as its examples generate).
pub fn candle_logits(m: &mut ModelWeights, tokens: &[u32], prompt_len: usize) -> Vec<Vec<f32>> {
    let row = |t: Tensor| -> Vec<f32> { t.squeeze(0).unwrap().to_vec1().unwrap() };
    let prompt = Tensor::new(&tokens[..prompt_len], &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let mut out = vec![row(m.forward(&prompt, 0).unwrap())];
    for (p, &t) in tokens
        .iter()
        .enumerate()
        .take(tokens.len() - 1)
        .skip(prompt_len)
    {
        let x = Tensor::new(&[t], &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        out.push(row(m.forward(&x, p).unwrap()));
    }
    out
}

/// candle against itself: the largest logit difference between feeding each prompt in one
/// forward and in chunks of `chunk` tokens (then decoding the same tokens), which changes only
/// candle's attention summation order. It calibrates what a different but correct attention
/// does to the logits of a model whose matmuls quantize activations.
pub fn candle_self_noise(
    m: &mut ModelWeights,
    sequences: &[Vec<u32>],
    prompt_lens: &[usize],
    chunk: usize,
) -> f32 {
    let mut max = 0f32;
    for (tokens, &prompt_len) in sequences.iter().zip(prompt_lens) {
        let whole = candle_logits(m, tokens, prompt_len);
        let mut last = None;
        for start in (0..prompt_len).step_by(chunk) {
            let end = (start + chunk).min(prompt_len);
            let x = Tensor::new(&tokens[start..end], &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            last = Some(m.forward(&x, start).unwrap());
        }
        let mut chunked = vec![last.unwrap().squeeze(0).unwrap().to_vec1::<f32>().unwrap()];
        for (p, &t) in tokens
            .iter()
            .enumerate()
            .take(tokens.len() - 1)
            .skip(prompt_len)
        {
            let x = Tensor::new(&[t], &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            chunked.push(
                m.forward(&x, p)
                    .unwrap()
                    .squeeze(0)
                    .unwrap()
                    .to_vec1()
                    .unwrap(),
            );
        }
        for (a, b) in whole.iter().flatten().zip(chunked.iter().flatten()) {
            max = max.max((a - b).abs());
        }
    }
    max
}

/// The model with a record of what the engine made it run.
pub struct Observed {
    pub model: PagedLlama,
    /// Steps whose batch held a prefill row and a decode row together.
    pub mixed_steps: u32,
    /// Prefill rows that did not reach the end of their prompt (chunked prefill).
    pub partial_prefills: u32,
    /// Largest number of rows in one step.
    pub max_rows: usize,
    /// A negative control: rotate decode rows' queries and keys as if one position later
    /// (the KV slots stay right), so the comparison must fail.
    pub shift_decode_positions: bool,
    shifted: Option<Batch>,
}

impl AsRef<PagedLlama> for Observed {
    fn as_ref(&self) -> &PagedLlama {
        &self.model
    }
}

impl<B: KvBackend> StepModel<B> for Observed
where
    PagedLlama: StepModel<B>,
{
    fn qkv(
        &mut self,
        backend: &B,
        layer: usize,
        batch: &Batch,
    ) -> Result<LayerQkv<'_, B::Buf>, EngineError> {
        if layer == 0 {
            let prefill = batch.is_prefill.iter().filter(|&&p| p).count();
            if prefill > 0 && prefill < batch.num_seqs() {
                self.mixed_steps += 1;
            }
            self.partial_prefills += batch
                .is_prefill
                .iter()
                .zip(&batch.samples)
                .filter(|&(&p, &s)| p && !s)
                .count() as u32;
            self.max_rows = self.max_rows.max(batch.num_seqs());
            self.shifted = self.shift_decode_positions.then(|| {
                let mut b = batch.clone();
                for (s, &prefill) in batch.is_prefill.iter().enumerate() {
                    if !prefill {
                        b.positions[batch.query_start_loc[s] as usize] += 1;
                    }
                }
                b
            });
        }
        let batch = self.shifted.as_ref().unwrap_or(batch);
        <PagedLlama as StepModel<B>>::qkv(&mut self.model, backend, layer, batch)
    }

    fn attended(&mut self, layer: usize, batch: &Batch, out: &B::Buf) -> Result<(), EngineError> {
        <PagedLlama as StepModel<B>>::attended(&mut self.model, layer, batch, out)
    }

    fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError> {
        <PagedLlama as StepModel<B>>::sample(&mut self.model, batch, out)
    }
}

/// Deterministic prompts of the given lengths over `vocab`.
pub fn prompts(lens: &[usize], vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut s = seed;
    lens.iter()
        .map(|&n| {
            (0..n)
                .map(|_| {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((s >> 33) % vocab as u64) as u32
                })
                .collect()
        })
        .collect()
}

/// Prompt lengths and output lengths of the sequences run together.
pub const PROMPT_LENS: [usize; 6] = [5, 23, 41, 12, 60, 2];
pub const OUTPUT_LENS: [u32; 6] = [20, 14, 24, 18, 10, 30];

/// A small arena (20 pages of 8 tokens for 6 sequences needing 35), chunks of 16 prompt
/// tokens, 48 tokens a step: chunked prefill, mixed prefill/decode steps and preemption.
pub fn small_engine(preemption: PreemptionMode) -> EngineSetup {
    EngineSetup {
        tokens_per_page: 8,
        pages: 20,
        max_running: 8,
        max_batched_tokens: 48,
        max_prefill_chunk: 16,
        max_context: 128,
        preemption,
        swap_blocks: 64,
    }
}

/// What one comparison found.
#[derive(Debug)]
pub struct Compared {
    /// Sampled rows compared (every step of every sequence).
    pub rows: usize,
    pub max_abs_diff: f32,
    pub mean_abs_diff: f32,
    /// Largest |logit| candle produced (the scale the differences are relative to).
    pub max_abs_logit: f32,
    /// [`candle_self_noise`] on the same sequences with the engine's chunk size.
    pub candle_self_noise: f32,
    /// Smallest gap between candle's best and second-best logit: how close greedy came to a tie.
    pub min_top2_gap: f32,
    /// Rows where the engine's greedy token is not candle's but a tie within twice the row's
    /// largest difference (at most 1 in 20 rows).
    pub greedy_ties: usize,
    pub preempted: u64,
}

impl std::fmt::Display for Compared {
    /// The comparison's figures, as the tests print them.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} rows, max |diff| {:.3e}, mean |diff| {:.3e}, max |logit| {:.2}, min top-2 gap \
             {:.3e}, {} greedy ties, {} preemptions; candle against itself (prompt chunked) max \
             |diff| {:.3e}",
            self.rows,
            self.max_abs_diff,
            self.mean_abs_diff,
            self.max_abs_logit,
            self.min_top2_gap,
            self.greedy_ties,
            self.preempted,
            self.candle_self_noise
        )
    }
}

/// Logits agree when every `|ours - candle| <= atol + rtol * |candle|` and the mean of
/// `|ours - candle|` over every compared logit is at most `mean`.
#[derive(Debug, Clone, Copy)]
pub struct Tolerance {
    pub atol: f32,
    pub rtol: f32,
    pub mean: f32,
}

/// Runs the sequences through pagedkv's engine and checks every sampled row's logits and the
/// greedy tokens against candle's single-sequence forward.
pub fn run_and_compare(
    bytes: &[u8],
    mode: MatMulMode,
    setup: EngineSetup,
    oracle: &mut ModelWeights,
    tol: Tolerance,
    shift_decode_positions: bool,
) -> Compared {
    let g = Gguf::parse(bytes).unwrap();
    let model = PagedLlama::from_gguf(&g, mode).unwrap();
    let mut engine = build_engine(model.config(), &setup).unwrap();
    compare_on(
        &mut engine,
        model,
        setup,
        oracle,
        tol,
        shift_decode_positions,
    )
}

/// [`run_and_compare`] on any engine (the CPU one, or the CUDA one of the `cuda` feature),
/// with the model already loaded on the engine's device.
pub fn compare_on<B: KvBackend>(
    engine: &mut Engine<B>,
    mut model: PagedLlama,
    setup: EngineSetup,
    oracle: &mut ModelWeights,
    tol: Tolerance,
    shift_decode_positions: bool,
) -> Compared
where
    PagedLlama: StepModel<B>,
{
    model.record_logits(true);
    let vocab = model.config().vocab_size;
    let prompts = prompts(&PROMPT_LENS, vocab, 7);
    let requests: Vec<SeqRequest> = prompts
        .iter()
        .zip(OUTPUT_LENS)
        .enumerate()
        .map(|(i, (p, n))| SeqRequest {
            id: i as SeqId,
            prompt: p.clone(),
            stop: StopRules {
                max_new_tokens: n,
                eos: Vec::new(),
                stop_sequences: Vec::new(),
            },
            priority: Priority::Throughput,
        })
        .collect();
    let mut observed = Observed {
        model,
        mixed_steps: 0,
        partial_prefills: 0,
        max_rows: 0,
        shift_decode_positions,
        shifted: None,
    };
    let gen = generate(engine, &mut observed, requests, 10_000).unwrap();
    let stats = engine.batcher().stats();
    let preempted = stats.preempted_recompute + stats.preempted_swap;
    assert!(
        preempted > 0,
        "the small arena preempted no sequence: {stats:?}"
    );
    // A swap run must have swapped a sequence out and back in (the batcher falls back to
    // recompute where host slots run short), or it checked recompute twice.
    if setup.preemption == PreemptionMode::Swap {
        assert!(
            stats.preempted_swap > 0 && stats.blocks_swapped_in > 0,
            "the swap run swapped nothing back in: {stats:?}"
        );
    }
    assert!(observed.partial_prefills > 0, "no chunked prefill");
    assert!(
        observed.mixed_steps > 0,
        "no step mixed prefill and decode rows"
    );
    assert!(
        observed.max_rows >= 3,
        "at most {} rows in a step",
        observed.max_rows
    );
    let output_lens: Vec<usize> = OUTPUT_LENS.iter().map(|&n| n as usize).collect();
    compare_rows(
        observed.model.take_logits(),
        &prompts,
        &gen.outputs,
        &output_lens,
        oracle,
        tol,
        setup.max_prefill_chunk as usize,
        preempted,
    )
}

/// Checks the engine's sampled rows of sequences `0..prompts.len()` (sequence `i` ran
/// `prompts[i]` and generated `outputs[&i]`, `output_lens[i]` tokens) against candle's
/// single-sequence forward: every row present once, each logit within `tol`, greedy tokens
/// candle's but for ties the row's difference explains. `chunk` is the prompt chunk
/// [`candle_self_noise`] calibrates with; `preempted` is reported as is.
#[allow(clippy::too_many_arguments)]
pub fn compare_rows(
    rows: Vec<RowLogits>,
    prompts: &[Vec<u32>],
    outputs: &BTreeMap<SeqId, Vec<u32>>,
    output_lens: &[usize],
    oracle: &mut ModelWeights,
    tol: Tolerance,
    chunk: usize,
    preempted: u64,
) -> Compared {
    // Every sampled row, keyed by (sequence, position); each must appear once.
    let mut ours: BTreeMap<(SeqId, i32), Vec<f32>> = BTreeMap::new();
    for RowLogits {
        seq,
        position,
        logits,
    } in rows
    {
        assert!(
            ours.insert((seq, position), logits).is_none(),
            "seq {seq} pos {position} sampled twice"
        );
    }
    let mut rows = 0;
    let mut sequences = Vec::new();
    let mut max_abs_diff = 0f32;
    let mut max_abs_logit = 0f32;
    let mut sum_abs_diff = 0f64;
    let mut n_values = 0u64;
    let mut min_gap = f32::INFINITY;
    let mut greedy_ties = 0usize;
    for (i, prompt) in prompts.iter().enumerate() {
        let id = i as SeqId;
        let output = &outputs[&id];
        assert_eq!(output.len(), output_lens[i], "seq {id}");
        let tokens: Vec<u32> = prompt.iter().chain(output).copied().collect();
        let theirs = candle_logits(oracle, &tokens, prompt.len());
        sequences.push(tokens.clone());
        for (j, want) in theirs.iter().enumerate() {
            let pos = (prompt.len() - 1 + j) as i32;
            let got = ours
                .remove(&(id, pos))
                .unwrap_or_else(|| panic!("seq {id}: no logits at position {pos}"));
            assert_eq!(got.len(), want.len());
            let mut row_max_diff = 0f32;
            for (v, (&a, &b)) in got.iter().zip(want).enumerate() {
                let d = (a - b).abs();
                row_max_diff = row_max_diff.max(d);
                max_abs_diff = max_abs_diff.max(d);
                max_abs_logit = max_abs_logit.max(b.abs());
                sum_abs_diff += f64::from(d);
                n_values += 1;
                assert!(
                    d <= tol.atol + tol.rtol * b.abs(),
                    "seq {id} pos {pos} token {v}: pagedkv {a} candle {b}"
                );
            }
            let mut sorted = want.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            min_gap = min_gap.min(sorted[0] - sorted[1]);
            // Greedy: candle's choice after this position is the token the engine generated
            // next, so candle's own greedy run, fed its own choices, yields the same tokens.
            // The one exception is a tie that this row's measured disagreement explains: when
            // candle's logit of the engine's token is within twice the row's largest
            // |pagedkv - candle| of candle's best, the two models' orders of those two tokens
            // may differ by rounding alone (different float kernels, e.g. on another CPU's
            // SIMD path). Candle is fed the engine's tokens, so later rows still compare like
            // with like; such ties are counted and bounded below.
            let next = tokens[pos as usize + 1];
            let best = argmax(want);
            if best != next {
                let gap = want[best as usize] - want[next as usize];
                assert!(
                    gap <= 2.0 * row_max_diff,
                    "seq {id}: greedy differs at position {} (candle prefers {best} by {gap}, \
                     more than twice this row's largest difference {row_max_diff})",
                    pos + 1
                );
                greedy_ties += 1;
            }
            rows += 1;
        }
    }
    assert!(
        ours.is_empty(),
        "logits for positions candle never reached: {:?}",
        ours.keys()
    );
    assert!(
        greedy_ties * 20 <= rows,
        "{greedy_ties} greedy ties in {rows} rows: more than 1 in 20 is not rounding"
    );
    let mean_abs_diff = (sum_abs_diff / n_values.max(1) as f64) as f32;
    assert!(
        mean_abs_diff <= tol.mean,
        "mean |pagedkv - candle| {mean_abs_diff} over {n_values} logits exceeds {}",
        tol.mean
    );
    let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    Compared {
        candle_self_noise: candle_self_noise(oracle, &sequences, &lens, chunk),
        rows,
        max_abs_diff,
        mean_abs_diff,
        max_abs_logit,
        min_top2_gap: min_gap,
        greedy_ties,
        preempted,
    }
}
