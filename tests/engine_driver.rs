//! The engine driver and its step executor: two models of different geometry on one host arena,
//! driven step by step with a model whose attention output has a closed form, so every row of
//! every step is checked; per-step results against the final outputs; caller finish reasons;
//! no page or budget leaked.

use pagedkv::block::EngineId;
use pagedkv::budget::BudgetConfig;
use pagedkv::engine::{
    Engine, EngineConfig, HostBackend, KvBackend, LayerQkv, RecomputePolicy, SharedArena, StepModel,
};
use pagedkv::error::{EngineError, SchedError};
use pagedkv::kv::{page_bytes_for, KvDtype, ModelKvShape};
use pagedkv::sched::{
    Batch, FinishReason, PreemptionMode, Priority, SeqId, SeqPhase, SeqRequest, StopRules,
};
use std::collections::HashMap;
use std::sync::Arc;

/// Keys are all equal, so attention is uniform over the visible positions and each output
/// element is the mean of the values at positions `0..=pos`. Value element `d` of sequence `s`
/// at position `p` in layer `l` is `value(s, p, l, d, token)` of the token at `p`, and the
/// model's "true" continuation is `truth(p)` at every generated position, so the expected
/// output is known exactly, and a slot still holding a rejected draft's KV shows.
struct ClosedForm {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Prompt length of each sequence (its prompt tokens are all `prompt_token(seq)`).
    prompt_len: HashMap<SeqId, usize>,
    rows_checked: u64,
}

/// Every prompt token of sequence `seq`: sequences with equal ids mod 3 share prompts (and
/// so, with a prefix cache, cached blocks); the others differ in every token.
fn prompt_token(seq: SeqId) -> u32 {
    7 + (seq % 3) as u32
}

/// The token the model generates at position `pos` (never a prompt token).
fn truth(pos: i32) -> u32 {
    100 + pos as u32
}

/// A K/V value: a function of the position and the token only, as a cached block's KV must be
/// (a block computed for one sequence is reused by another with the same prefix).
fn value(pos: i32, layer: usize, d: usize, token: u32) -> f32 {
    pos as f32 * 0.25 + layer as f32 * 3.0 + d as f32 * 0.01 + (token % 97) as f32 * 0.125
}

impl ClosedForm {
    fn new(heads: usize, kv_heads: usize, head_dim: usize) -> Self {
        Self {
            heads,
            kv_heads,
            head_dim,
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            prompt_len: HashMap::new(),
            rows_checked: 0,
        }
    }

    /// The token at `pos` of sequence `seq` in the true history.
    fn token_at(&self, seq: SeqId, pos: i32) -> u32 {
        if (pos as usize) < self.prompt_len[&seq] {
            prompt_token(seq)
        } else {
            truth(pos)
        }
    }

    /// The row (sequence) of each flattened token.
    fn token_rows(batch: &Batch) -> Vec<usize> {
        let mut rows = Vec::with_capacity(batch.num_tokens());
        for s in 0..batch.num_seqs() {
            let (a, b) = (batch.query_start_loc[s], batch.query_start_loc[s + 1]);
            rows.extend(std::iter::repeat_n(s, (b - a) as usize));
        }
        rows
    }
}

impl StepModel<HostBackend<f32>> for ClosedForm {
    fn qkv(
        &mut self,
        _backend: &HostBackend<f32>,
        layer: usize,
        batch: &Batch,
    ) -> Result<LayerQkv<'_, [f32]>, EngineError> {
        let n = batch.num_tokens();
        let rows = Self::token_rows(batch);
        self.q = vec![0.1; n * self.heads * self.head_dim];
        self.k = vec![0.2; n * self.kv_heads * self.head_dim];
        self.v.clear();
        for t in 0..rows.len() {
            let (pos, token) = (batch.positions[t], batch.input_tokens[t]);
            for _ in 0..self.kv_heads {
                self.v
                    .extend((0..self.head_dim).map(|d| value(pos, layer, d, token)));
            }
        }
        Ok(LayerQkv {
            query: &self.q,
            key: &self.k,
            value: &self.v,
        })
    }

    fn attended(&mut self, layer: usize, batch: &Batch, out: &[f32]) -> Result<(), EngineError> {
        let rows = Self::token_rows(batch);
        let width = self.heads * self.head_dim;
        assert_eq!(out.len(), batch.num_tokens() * width);
        for (t, &row) in rows.iter().enumerate() {
            let (seq, pos) = (batch.seq_ids[row], batch.positions[t]);
            // Positions before the row's first hold the true history; the row's own positions
            // hold its inputs (drafts included: a draft's KV is visible to later queries of
            // its row, like any input's).
            let first = batch.query_start_loc[row] as usize;
            let row_start = batch.positions[first];
            let token = |p: i32| {
                if p < row_start {
                    self.token_at(seq, p)
                } else {
                    batch.input_tokens[first + (p - row_start) as usize]
                }
            };
            for h in 0..self.heads {
                for d in 0..self.head_dim {
                    let want = (0..=pos).map(|p| value(p, layer, d, token(p))).sum::<f32>()
                        / (pos + 1) as f32;
                    let got = out[t * width + h * self.head_dim + d];
                    assert!(
                        (got - want).abs() <= 1e-3 * want.abs().max(1.0),
                        "seq {seq} pos {pos} layer {layer} head {h} dim {d}: {got} != {want}"
                    );
                }
            }
            self.rows_checked += 1;
        }
        Ok(())
    }

    fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError> {
        // The true next token after each input that needs logits.
        out.extend(
            batch
                .logits_indices
                .iter()
                .map(|&t| truth(batch.positions[t as usize] + 1)),
        );
        Ok(())
    }
}

fn shapes() -> [(ModelKvShape, usize); 2] {
    [
        (
            ModelKvShape {
                num_layers: 2,
                num_kv_heads: 1,
                head_dim: 16,
                dtype: KvDtype::F32,
            },
            2,
        ),
        (
            ModelKvShape {
                num_layers: 1,
                num_kv_heads: 2,
                head_dim: 32,
                dtype: KvDtype::F32,
            },
            4,
        ),
    ]
}

fn engine_config(preemption: PreemptionMode) -> EngineConfig {
    EngineConfig {
        weight: 1,
        max_running: 8,
        max_batched_tokens: 64,
        max_prefill_chunk: 24,
        max_context: 512,
        preemption,
        swap_blocks: 64,
        recompute: RecomputePolicy::SERVER,
        prefix_cache: true,
    }
}

/// A model's engine with its closed-form model.
type Driven = (Engine<HostBackend<f32>>, ClosedForm);
/// Per sequence: the streamed tokens and the finish reason streamed last.
type Streamed = HashMap<SeqId, (Vec<u32>, Option<FinishReason>)>;

/// Every page is free once the prefix cache (if any) lets go of the pages only it holds.
fn assert_no_leak(shared: &SharedArena) {
    if let Some(cache) = shared.prefix_cache() {
        cache.clear();
    }
    assert_eq!(shared.pool().free_count(), shared.pool().total());
    assert_eq!(shared.coordinator().blocks_in_use(), 0);
}

fn request(id: SeqId, prompt: usize, out: u32) -> SeqRequest {
    SeqRequest {
        id,
        prompt: vec![prompt_token(id); prompt],
        stop: StopRules {
            max_new_tokens: out,
            eos: Vec::new(),
            stop_sequences: Vec::new(),
        },
        priority: Priority::Throughput,
    }
}

/// Queues a request on an engine and tells its model the prompt length.
fn add(driven: &mut Driven, req: SeqRequest) {
    driven.1.prompt_len.insert(req.id, req.prompt.len());
    driven.0.add(req).unwrap();
}

/// Runs both engines until idle; returns, per engine, the streamed tokens and finish reasons.
fn run_to_idle(engines: &mut [Driven]) -> Vec<Streamed> {
    let mut streamed = vec![HashMap::new(); engines.len()];
    for _ in 0..2000 {
        if engines.iter().all(|(e, _)| !e.has_work()) {
            return streamed;
        }
        for (i, (engine, model)) in engines.iter_mut().enumerate() {
            engine.step(model).unwrap();
            let results = engine.results();
            for u in &results.updates {
                let entry: &mut (Vec<u32>, Option<FinishReason>) =
                    streamed[i].entry(u.id).or_default();
                assert!(entry.1.is_none(), "seq {} updated after it finished", u.id);
                entry.0.extend_from_slice(results.tokens_of(u));
                entry.1 = u.finished;
            }
            // The streamed tokens of every finished sequence are its whole output, in order.
            for f in engine.finished() {
                let (tokens, reason) = &streamed[i][&f.id];
                assert_eq!(tokens, &f.output, "seq {}", f.id);
                assert_eq!(*reason, Some(f.reason));
            }
        }
    }
    panic!("engines did not go idle in 2000 steps");
}

/// The small-arena workload of engine `e`: 8 requests, prompts of 20 + 3s tokens, 30 out.
fn small_arena_requests(e: usize) -> impl Iterator<Item = SeqRequest> {
    (0..8u64).map(move |s| request(100 * e as u64 + s, 20 + 3 * s as usize, 30))
}

/// The engine's sequences finished in the last step, each checked to have run the
/// small-arena workload's 30 tokens to the end.
fn full_outputs(engine: &Engine<HostBackend<f32>>) -> usize {
    for f in engine.finished() {
        assert_eq!(f.output.len(), 30, "seq {}", f.id);
        assert_eq!(f.reason, FinishReason::MaxTokens);
    }
    engine.finished().len()
}

fn build(pages: u32, preemption: PreemptionMode) -> (Arc<SharedArena>, Vec<Driven>) {
    build_with(pages, preemption, false)
}

/// Two engines on one arena, sharing a prefix cache if `prefix`.
fn build_with(
    pages: u32,
    preemption: PreemptionMode,
    prefix: bool,
) -> (Arc<SharedArena>, Vec<Driven>) {
    let shapes = shapes();
    let page_bytes = page_bytes_for(&shapes.map(|(s, _)| s), 16).unwrap();
    let mut shared = SharedArena::host(BudgetConfig::new(2, 128, pages), page_bytes).unwrap();
    if prefix {
        Arc::get_mut(&mut shared)
            .unwrap()
            .enable_prefix_cache(Some(1));
    }
    let engines = shapes
        .iter()
        .map(|(shape, heads)| {
            let engine = Engine::host(&shared, engine_config(preemption), shape, *heads).unwrap();
            (
                engine,
                ClosedForm::new(*heads, shape.num_kv_heads, shape.head_dim),
            )
        })
        .collect();
    (shared, engines)
}

#[test]
fn two_models_on_one_arena_attend_exactly_and_stream_every_token() {
    let (shared, mut engines) = build(256, PreemptionMode::Recompute);
    // The pages hold 16 tokens of the larger model and 32 of the smaller one.
    assert_eq!(engines[0].0.tokens_per_page(), 32);
    assert_eq!(engines[1].0.tokens_per_page(), 16);
    for (e, driven) in engines.iter_mut().enumerate() {
        for s in 0..6u64 {
            let id = 10 * e as u64 + s;
            add(driven, request(id, 5 + 11 * s as usize, 3 + s as u32 * 4));
        }
    }
    let streamed = run_to_idle(&mut engines);
    for (e, per) in streamed.iter().enumerate() {
        assert_eq!(per.len(), 6, "engine {e}");
        for (id, (tokens, reason)) in per {
            let s = id % 10;
            assert_eq!(tokens.len() as u64, 3 + s * 4, "seq {id}");
            assert_eq!(*reason, Some(FinishReason::MaxTokens));
            // The model's true continuation, in order.
            let prompt = 5 + 11 * s as i32;
            assert!(tokens.iter().zip(prompt..).all(|(&t, pos)| t == truth(pos)));
        }
        assert!(engines[e].1.rows_checked > 0);
    }
    assert_eq!(shared.pool().free_count(), shared.pool().total());
    assert_eq!(shared.coordinator().blocks_in_use(), 0);
}

#[test]
fn preemption_under_a_small_arena_keeps_every_result_exact() {
    for mode in [PreemptionMode::Recompute, PreemptionMode::Swap] {
        // Few pages: the engines preempt each other's and their own sequences.
        let (shared, mut engines) = build(24, mode);
        for (e, driven) in engines.iter_mut().enumerate() {
            small_arena_requests(e).for_each(|r| add(driven, r));
        }
        let streamed = run_to_idle(&mut engines);
        let preempted: u64 = engines
            .iter()
            .map(|(e, _)| {
                let st = e.batcher().stats();
                st.preempted_recompute + st.preempted_swap
            })
            .sum();
        assert!(preempted > 0, "{mode:?}: the test must preempt");
        for per in &streamed {
            assert_eq!(per.len(), 8);
            assert!(per
                .values()
                .all(|(t, r)| t.len() == 30 && *r == Some(FinishReason::MaxTokens)));
        }
        assert_eq!(
            shared.pool().free_count(),
            shared.pool().total(),
            "{mode:?}"
        );
    }
}

#[test]
fn a_caller_finish_reason_is_reported_apart_from_an_abort() {
    let (shared, mut engines) = build(128, PreemptionMode::Recompute);
    add(&mut engines[0], request(1, 8, 50));
    add(&mut engines[0], request(2, 8, 50));
    let (engine, model) = &mut engines[0];
    for _ in 0..4 {
        engine.step(model).unwrap();
    }
    engine.finish_with(1, FinishReason::Caller(7)).unwrap();
    engine.abort(2).unwrap();
    // A second request for the same sequence does not change the first one's reason.
    engine.abort(1).unwrap();
    engine.step(model).unwrap();
    let ended: HashMap<SeqId, Option<FinishReason>> = engine
        .results()
        .updates
        .iter()
        .map(|u| (u.id, u.finished))
        .collect();
    assert_eq!(ended[&1], Some(FinishReason::Caller(7)));
    assert_eq!(ended[&2], Some(FinishReason::Aborted));
    let reasons: Vec<_> = engine.finished().iter().map(|f| (f.id, f.reason)).collect();
    assert!(reasons.contains(&(1, FinishReason::Caller(7))));
    assert!(reasons.contains(&(2, FinishReason::Aborted)));
    let stats = engine.batcher().stats();
    assert_eq!((stats.finished, stats.aborted), (1, 1));
    assert!(engine.finish_with(1, FinishReason::Caller(1)).is_err());
    assert!(!engine.has_work());
    assert_eq!(shared.pool().free_count(), shared.pool().total());
}

/// A batch not committed when the engine schedules again is discarded safely: scheduling
/// twice every step (swap-outs, swap-ins and copies among the discarded batches, under a small
/// arena) keeps every result exact. Before, the second schedule dropped the first batch with
/// its swap-outs, and the swapped sequences came back over KV that was never written; now the
/// sequences a discarded batch was to swap or copy for are recomputed.
#[test]
fn an_uncommitted_batch_is_discarded_safely() {
    let (shared, mut engines) = build(24, PreemptionMode::Swap);
    for (e, driven) in engines.iter_mut().enumerate() {
        small_arena_requests(e).for_each(|r| add(driven, r));
    }
    let (mut swaps_discarded, mut finished) = (0, 0);
    for _ in 0..4000 {
        if engines.iter().all(|(e, _)| !e.has_work()) {
            break;
        }
        for (engine, model) in engines.iter_mut() {
            swaps_discarded += usize::from(!engine.schedule().swap_out.is_empty());
            engine.schedule();
            engine.execute(model).unwrap();
            engine.commit(model).unwrap();
            finished += full_outputs(engine);
        }
    }
    assert!(swaps_discarded > 0, "the test must discard swap-outs");
    assert_eq!(finished, 16);
    assert_no_leak(&shared);
}

/// ClosedForm failing at its first attention output when armed: a step that fails part-way
/// (swaps and copies done, layer 0's KV written).
struct FailingArmed {
    inner: ClosedForm,
    armed: bool,
}

impl StepModel<HostBackend<f32>> for FailingArmed {
    fn qkv(
        &mut self,
        backend: &HostBackend<f32>,
        layer: usize,
        batch: &Batch,
    ) -> Result<LayerQkv<'_, [f32]>, EngineError> {
        self.inner.qkv(backend, layer, batch)
    }
    fn attended(&mut self, layer: usize, batch: &Batch, out: &[f32]) -> Result<(), EngineError> {
        if self.armed {
            return Err(EngineError::Model(format!(
                "injected failure at layer {layer}"
            )));
        }
        self.inner.attended(layer, batch, out)
    }
    fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError> {
        self.inner.sample(batch, out)
    }
}

/// An engine with a model that fails when armed.
type Armed = (Engine<HostBackend<f32>>, FailingArmed);

/// [`build`] with each model wrapped in a disarmed [`FailingArmed`].
fn build_armed(pages: u32, preemption: PreemptionMode) -> (Arc<SharedArena>, Vec<Armed>) {
    let (shared, engines) = build(pages, preemption);
    let engines = engines
        .into_iter()
        .map(|(e, inner)| {
            (
                e,
                FailingArmed {
                    inner,
                    armed: false,
                },
            )
        })
        .collect();
    (shared, engines)
}

/// An execute that failed part-way is not run again (its rows may have written pages its
/// swap-outs or copies read) and not committed; the next schedule discards the batch and every
/// result stays exact. Failures are injected at steps with swaps or copies.
#[test]
fn a_failed_execute_is_discarded_not_retried() {
    let (shared, mut engines) = build_armed(24, PreemptionMode::Swap);
    for (e, (engine, model)) in engines.iter_mut().enumerate() {
        for req in small_arena_requests(e) {
            model.inner.prompt_len.insert(req.id, req.prompt.len());
            engine.add(req).unwrap();
        }
    }
    let (mut failed, mut finished) = (0, 0);
    for _ in 0..4000 {
        if engines.iter().all(|(e, _)| !e.has_work()) {
            break;
        }
        for (engine, model) in engines.iter_mut() {
            let b = engine.schedule();
            model.armed = failed < 20
                && b.num_seqs() > 0
                && !(b.swap_out.is_empty() && b.copies.is_empty() && b.swap_in.is_empty());
            if model.armed {
                assert!(engine.execute(model).is_err());
                model.armed = false;
                assert!(engine.execute(model).is_err(), "a failed batch ran again");
                assert!(engine.commit(model).is_err(), "a failed batch committed");
                failed += 1;
                continue; // the next schedule discards it
            }
            engine.execute(model).unwrap();
            engine.commit(model).unwrap();
            finished += full_outputs(engine);
        }
    }
    assert!(failed > 0, "the test must fail steps with swaps or copies");
    assert_eq!(finished, 16);
    assert_no_leak(&shared);
}

/// `max_context` is a token limit (prompt and output but the last token), not a page count:
/// at 500 tokens over 32-token pages (16 pages: 512 tokens), a request reaching 501 to 512
/// tokens was accepted.
#[test]
fn max_context_is_enforced_in_tokens() {
    let (shared, engines) = build(256, PreemptionMode::Recompute);
    drop(engines); // their coordinator slots, for this engine's
    let (shape, heads) = shapes()[0];
    let cfg = EngineConfig {
        max_context: 500,
        ..engine_config(PreemptionMode::Recompute)
    };
    let mut engine: Engine<HostBackend<f32>> = Engine::host(&shared, cfg, &shape, heads).unwrap();
    assert_eq!(engine.tokens_per_page(), 32);
    for (id, prompt, out, ok) in [
        (1, 490, 11, true),
        (2, 490, 12, false),
        (3, 1, 500, true),
        (4, 512, 1, false),
    ] {
        let r = engine.add(request(id, prompt, out));
        if ok {
            r.unwrap();
        } else {
            let tokens = prompt as u64 + u64::from(out) - 1;
            assert_eq!(
                r,
                Err(SchedError::ContextTooLong {
                    id,
                    tokens,
                    max_context: 500,
                })
            );
        }
    }
}

/// A `max_context` of 0 is refused by name, before registering: the batcher would refuse the
/// zero pages per sequence it implies too, but its message names a setting the caller never
/// gave.
#[test]
fn a_zero_max_context_is_refused_by_name() {
    let (shape, heads) = shapes()[0];
    let page_bytes = page_bytes_for(&[shape], 16).unwrap();
    let shared = SharedArena::host(BudgetConfig::new(2, 128, 32), page_bytes).unwrap();
    let mut bad = engine_config(PreemptionMode::Recompute);
    bad.max_context = 0;
    let epoch = shared.coordinator().epoch();
    let err = Engine::<HostBackend<f32>>::host(&shared, bad, &shape, heads).unwrap_err();
    assert!(
        matches!(&err, EngineError::InvalidConfig(m) if m.contains("max_context")),
        "{err:?}"
    );
    assert_eq!(
        shared.coordinator().epoch(),
        epoch,
        "a refused engine published shares"
    );
}

/// Steps until a schedule has rows (the first steps may be empty until the coordinator has
/// seen the engine active); that batch is left scheduled, not executed.
fn schedule_first_rows(engine: &mut Engine<HostBackend<f32>>, model: &mut ClosedForm) {
    while engine.schedule().is_empty() {
        engine.execute(model).unwrap();
        engine.commit(model).unwrap();
    }
}

#[test]
fn commit_before_execute_is_refused_and_changes_nothing() {
    let (_shared, mut engines) = build(64, PreemptionMode::Recompute);
    add(&mut engines[0], request(1, 8, 4));
    let (engine, model) = &mut engines[0];
    schedule_first_rows(engine, model);
    let stats = engine.batcher().stats();
    assert!(engine.commit(model).is_err());
    assert_eq!(engine.batcher().stats(), stats);
    engine.execute(model).unwrap();
    engine.commit(model).unwrap();
    assert_eq!(engine.results().updates.len(), 1);
}

/// A step is committed once: a second commit (of the same batch, before the next schedule)
/// is refused like a commit before execute. It was accepted: the model was asked to sample
/// again and the step's report came back a second time (a caller summing reports counted the
/// step's tokens, sheds and donation twice), and the policy's recompute ran again.
#[test]
fn a_second_commit_of_a_step_is_refused_and_changes_nothing() {
    let (_shared, mut engines) = build(64, PreemptionMode::Recompute);
    add(&mut engines[0], request(1, 8, 4));
    let (engine, model) = &mut engines[0];
    schedule_first_rows(engine, model);
    engine.execute(model).unwrap();
    let report = engine.commit(model).unwrap();
    assert_eq!(report.sampled, 1);
    let (stats, results) = (engine.batcher().stats(), engine.results().clone());
    let again = engine.commit(model);
    assert!(again.is_err(), "a second commit was accepted: {again:?}");
    assert_eq!(engine.batcher().stats(), stats);
    assert_eq!(engine.results(), &results);
    engine.step(model).unwrap();
    assert_eq!(engine.results().updates.len(), 1);
}

#[test]
fn a_backend_over_another_pool_size_is_refused_and_leaves_no_registration() {
    let (shape, heads) = shapes()[0];
    let page_bytes = page_bytes_for(&[shape], 16).unwrap();
    let shared = SharedArena::host(BudgetConfig::new(2, 128, 32), page_bytes).unwrap();
    let other = SharedArena::host(BudgetConfig::new(2, 128, 64), page_bytes).unwrap();
    let view = pagedkv::kv::ArenaView::new(other.host_arena().unwrap().clone(), &shape).unwrap();
    // SAFETY: the backend is refused before any batch could run on it.
    let backend = unsafe { HostBackend::<f32>::new(view, heads, 4).unwrap() };
    assert_eq!(backend.config().num_blocks(), 64);
    let err = Engine::new(&shared, engine_config(PreemptionMode::Recompute), backend).unwrap_err();
    assert!(err.to_string().contains("64 pages"), "{err}");
    // Two engines still fit: nothing was registered by the refused one.
    let a = Engine::<HostBackend<f32>>::host(
        &shared,
        engine_config(PreemptionMode::Recompute),
        &shape,
        heads,
    );
    let b = Engine::<HostBackend<f32>>::host(
        &shared,
        engine_config(PreemptionMode::Recompute),
        &shape,
        heads,
    );
    assert!(a.is_ok() && b.is_ok());
}

/// A backend whose swap space is smaller than the engine's `swap_blocks` is refused under swap
/// preemption: the batcher hands out swap slots up to `swap_blocks`, the backend refused each
/// slot past its own, and every step that swapped into one failed (at run time, with a
/// "block N is out of range" error).
#[test]
fn a_backend_with_less_swap_than_swap_blocks_is_refused_under_swap_preemption() {
    let (shape, heads) = shapes()[0];
    let page_bytes = page_bytes_for(&[shape], 16).unwrap();
    let shared = SharedArena::host(BudgetConfig::new(1, 128, 32), page_bytes).unwrap();
    let backend = |slots| {
        let view =
            pagedkv::kv::ArenaView::new(shared.host_arena().unwrap().clone(), &shape).unwrap();
        // SAFETY: the view is of `shared`'s arena and only the engine below runs batches on
        // the backend (its own batcher's, from `shared`'s pool).
        unsafe { HostBackend::<f32>::new(view, heads, slots).unwrap() }
    };
    let swap = engine_config(PreemptionMode::Swap);
    assert_eq!(backend(2).swap_slots(), Some(2));
    let err = Engine::new(&shared, swap, backend(2)).unwrap_err();
    assert!(err.to_string().contains("swap"), "{err}");
    // Nothing was registered (one engine fits), and room enough, or recompute, is accepted.
    let mut recompute = engine_config(PreemptionMode::Recompute);
    recompute.swap_blocks = 64;
    drop(Engine::new(&shared, recompute, backend(2)).unwrap());
    let (mut engine, mut model) = (
        Engine::new(&shared, swap, backend(swap.swap_blocks as usize)).unwrap(),
        ClosedForm::new(heads, shape.num_kv_heads, shape.head_dim),
    );
    // The same workload swaps and runs clean over a big enough swap space.
    for req in small_arena_requests(0) {
        model.prompt_len.insert(req.id, req.prompt.len());
        engine.add(req).unwrap();
    }
    let mut swapped = 0;
    for _ in 0..2000 {
        if !engine.has_work() {
            break;
        }
        swapped += engine.step(&mut model).unwrap().exec.pages_moved;
    }
    assert!(!engine.has_work() && swapped > 0);
    drop(engine);
    assert_no_leak(&shared);
}

/// An engine under recompute preemption never swaps, so its constructors allocate no swap
/// space whatever `swap_blocks` says: before, `Engine::host` (and `Engine::raw`, with pinned
/// host memory) allocated `swap_blocks` pages that nothing would ever use.
#[test]
fn an_engine_under_recompute_preemption_allocates_no_swap_space() {
    let (shape, heads) = shapes()[0];
    let page_bytes = page_bytes_for(&[shape], 16).unwrap();
    let shared = SharedArena::host(BudgetConfig::new(1, 128, 32), page_bytes).unwrap();
    for (mode, slots) in [(PreemptionMode::Recompute, 0), (PreemptionMode::Swap, 64)] {
        let cfg = engine_config(mode);
        assert_eq!(cfg.swap_blocks, 64);
        assert_eq!(cfg.swap_space_pages(), slots);
        let engine = Engine::<HostBackend<f32>>::host(&shared, cfg, &shape, heads).unwrap();
        assert_eq!(
            engine.backend().swap_slots(),
            Some(slots as usize),
            "{mode:?}"
        );
    }
}

/// Drives `engines` to idle, proposing drafts (right or wrong, from `rng`) for decoding
/// sequences before every step; checks page accounting after every step. Returns the
/// (accepted, rejected) drafts seen.
fn run_speculative(
    engines: &mut [Driven],
    rng: &mut rand::rngs::SmallRng,
    outputs: &mut [Streamed],
) -> (u64, u64) {
    use rand::Rng;
    let (mut accepted, mut rejected) = (0u64, 0u64);
    for _ in 0..4000 {
        if engines.iter().all(|(e, _)| !e.has_work()) {
            return (accepted, rejected);
        }
        for (i, (engine, model)) in engines.iter_mut().enumerate() {
            // Sorted: the run is a function of the rng's seed alone.
            let mut live: Vec<SeqId> = model.prompt_len.keys().copied().collect();
            live.sort_unstable();
            let mut proposed: HashMap<SeqId, Vec<u32>> = HashMap::new();
            for id in live {
                if engine.batcher().phase(id) != Some(pagedkv::sched::SeqPhase::Decoding) {
                    continue;
                }
                let generated = outputs[i].get(&id).map_or(0, |o| o.0.len());
                let pos = (model.prompt_len[&id] + generated) as i32;
                let k = rng.gen_range(0..5usize);
                let drafts: Vec<u32> = (0..k as i32)
                    .map(|j| if rng.gen_bool(0.7) { truth(pos + j) } else { 3 })
                    .collect();
                if engine.propose(id, &drafts).is_ok() {
                    proposed.insert(id, drafts);
                }
            }
            engine.step(model).unwrap();
            let results = engine.results();
            for u in &results.updates {
                let tokens = results.tokens_of(u);
                if let Some(d) = proposed.get(&u.id) {
                    if !tokens.is_empty() {
                        let ok = d.iter().zip(tokens).take_while(|(a, b)| a == b).count();
                        accepted += ok as u64;
                        rejected += (d.len() - ok.min(d.len())) as u64;
                    }
                }
                let entry = outputs[i].entry(u.id).or_default();
                entry.0.extend_from_slice(tokens);
                entry.1 = u.finished;
                if u.finished.is_some() {
                    model.prompt_len.remove(&u.id);
                }
            }
            // Every page the engine holds belongs to a live sequence's table or, only cached,
            // to the prefix cache; the budget counts exactly the former.
            let tables: u32 = model
                .prompt_len
                .keys()
                .filter_map(|&id| engine.batcher().blocks_of(id))
                .sum();
            let shared = engine.shared();
            let held = shared.pool().held(engine.id());
            let budget = shared.coordinator().blocks_held(engine.id()) as u32;
            match shared.prefix_cache() {
                None => assert_eq!((held, budget), (tables, tables)),
                Some(cache) => {
                    let cached_free = cache.reclaimable(Some(engine.id()));
                    assert_eq!(held, budget + cached_free, "pool vs budget + cached-free");
                    // Tables may share cached pages.
                    assert!(budget <= tables);
                }
            }
            // No sequence keeps pages past the tokens in its cache (rolled-back drafts' pages
            // are freed): the cache holds every token but the last one at most.
            let bs = engine.tokens_per_page() as usize;
            for (&id, &prompt) in &model.prompt_len {
                let generated = outputs[i].get(&id).map_or(0, |o| o.0.len());
                let cached = (prompt + generated).saturating_sub(1);
                let blocks = engine.batcher().blocks_of(id).unwrap_or(0) as usize;
                assert!(
                    blocks <= cached.div_ceil(bs),
                    "seq {id}: {blocks} pages for {cached} tokens"
                );
            }
        }
    }
    panic!("speculative run did not finish in 4000 steps");
}

#[test]
fn speculative_drafts_are_accepted_or_rolled_back_exactly() {
    use rand::SeedableRng;
    let (shared, mut engines) = build(48, PreemptionMode::Recompute);
    let mut lens = HashMap::new();
    for (e, driven) in engines.iter_mut().enumerate() {
        for s in 0..6u64 {
            let id = 10 * e as u64 + s;
            let (prompt, out) = (3 + 9 * s as usize, 12 + 5 * s as u32);
            lens.insert((e, id), (prompt, out));
            add(driven, request(id, prompt, out));
        }
    }
    let mut outputs = vec![Streamed::new(), Streamed::new()];
    let mut rng = rand::rngs::SmallRng::seed_from_u64(5);
    let (accepted, rejected) = run_speculative(&mut engines, &mut rng, &mut outputs);
    assert!(accepted > 20 && rejected > 20, "{accepted} / {rejected}");
    for (&(e, id), &(prompt, out)) in &lens {
        let (tokens, reason) = &outputs[e][&id];
        let want: Vec<u32> = (prompt as i32..).take(out as usize).map(truth).collect();
        assert_eq!(tokens, &want, "engine {e} seq {id}");
        assert_eq!(*reason, Some(FinishReason::MaxTokens));
    }
    assert_eq!(shared.pool().free_count(), shared.pool().total());
    assert_eq!(shared.coordinator().blocks_in_use(), 0);
}

#[test]
fn a_proposal_is_refused_where_it_cannot_apply() {
    let (_shared, mut engines) = build(64, PreemptionMode::Recompute);
    add(&mut engines[0], request(1, 8, 4));
    let (engine, model) = &mut engines[0];
    // Waiting, not decoding.
    assert!(engine.propose(1, &[1]).is_err());
    assert!(engine.propose(9, &[1]).is_err());
    while engine.batcher().phase(1) != Some(pagedkv::sched::SeqPhase::Decoding) {
        engine.step(model).unwrap();
    }
    // One token generated, three left: at most two drafts.
    assert!(engine.propose(1, &[1, 2, 3]).is_err());
    assert!(engine.propose(1, &[1, 2]).is_ok());
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]

    /// Random workloads, pool sizes and drafts: outputs are always the true continuation, the
    /// attention always matches the closed form, and no page is leaked.
    #[test]
    fn speculative_runs_match_the_model_and_leak_nothing(
        seed in 0u64..1_000_000,
        pages in 24u32..96,
        seqs in proptest::collection::vec((1usize..40, 2u32..30), 1..6),
        swap in proptest::bool::ANY,
        prefix in proptest::bool::ANY,
    ) {
        use rand::SeedableRng;
        let mode = if swap { PreemptionMode::Swap } else { PreemptionMode::Recompute };
        let (shared, mut engines) = build_with(pages, mode, prefix);
        for (e, driven) in engines.iter_mut().enumerate() {
            for (s, &(prompt, out)) in seqs.iter().enumerate() {
                add(driven, request(100 * e as u64 + s as u64, prompt, out));
            }
        }
        let mut outputs = vec![Streamed::new(), Streamed::new()];
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        run_speculative(&mut engines, &mut rng, &mut outputs);
        for (e, per) in outputs.iter().enumerate() {
            for (s, &(prompt, out)) in seqs.iter().enumerate() {
                let (tokens, _) = &per[&(100 * e as u64 + s as u64)];
                let want: Vec<u32> = (prompt as i32..).take(out as usize).map(truth).collect();
                proptest::prop_assert_eq!(tokens, &want);
            }
        }
        drop(engines);
        assert_no_leak(&shared);
    }
}

#[test]
fn cached_prefixes_are_reused_exactly_across_sequences_and_preemptions() {
    // Several seeds: which drafts are right, and so which pages are swapped out, cached and
    // reused, depends on them (seed 3 once hid a swap-out page reused while cached).
    for (mode, seed) in [PreemptionMode::Recompute, PreemptionMode::Swap]
        .into_iter()
        .flat_map(|m| (0..12u64).map(move |s| (m, s)))
    {
        // A small arena: cached pages are evicted, hit, and preempted around.
        let (shared, mut engines) = build_with(40, mode, true);
        for (e, driven) in engines.iter_mut().enumerate() {
            // Ids equal mod 3 share their prompt; waves arrive after earlier ones finished.
            for s in 0..9u64 {
                add(
                    driven,
                    request(100 * e as u64 + s, 40 + (s as usize % 3), 12),
                );
            }
        }
        let mut outputs = vec![Streamed::new(), Streamed::new()];
        let mut rng = rand::SeedableRng::seed_from_u64(seed);
        run_speculative(&mut engines, &mut rng, &mut outputs);
        for (e, per) in outputs.iter().enumerate() {
            for s in 0..9u64 {
                let prompt = 40 + (s as i32 % 3);
                let want: Vec<u32> = (prompt..).take(12).map(truth).collect();
                assert_eq!(
                    per[&(100 * e as u64 + s)].0,
                    want,
                    "{mode:?} engine {e} seq {s}"
                );
            }
        }
        let hits: u64 = engines
            .iter()
            .map(|(e, _)| e.batcher().stats().prefix_hit_tokens)
            .sum();
        assert!(hits > 0, "{mode:?}: shared prompts must hit");
        drop(engines);
        assert_no_leak(&shared);
    }
}

#[test]
fn a_fresh_engine_schedules_its_first_request_on_its_first_step() {
    let (_shared, mut engines) = build(64, PreemptionMode::Recompute);
    add(&mut engines[0], request(1, 8, 4));
    let (engine, model) = &mut engines[0];
    assert_eq!(engine.schedule().num_tokens(), 8);
    engine.execute(model).unwrap();
    engine.commit(model).unwrap();
    assert_eq!(engine.results().updates.len(), 1);
}

/// An engine's cached pages leave with it: the next engine registered gets its id back, and a
/// different model (same tokens per page, another layout) must not find the first one's pages
/// under the same prompt (the cache's keys hold the engine id).
#[test]
fn a_dropped_engines_cached_pages_do_not_serve_the_next_engine_on_its_id() {
    let shapes = shapes();
    let page_bytes = page_bytes_for(&shapes.map(|(s, _)| s), 16).unwrap();
    let mut shared = SharedArena::host(BudgetConfig::new(2, 128, 64), page_bytes).unwrap();
    Arc::get_mut(&mut shared)
        .unwrap()
        .enable_prefix_cache(Some(1));
    let (shape, heads) = shapes[0];
    let mut a = vec![(
        Engine::host(
            &shared,
            engine_config(PreemptionMode::Recompute),
            &shape,
            heads,
        )
        .unwrap(),
        ClosedForm::new(heads, shape.num_kv_heads, shape.head_dim),
    )];
    let id_a = a[0].0.id();
    add(&mut a[0], request(3, 40, 4));
    run_to_idle(&mut a);
    let cache = shared.prefix_cache().unwrap().clone();
    assert!(cache.cached(id_a) > 0, "A cached its prompt's full pages");
    let tokens_per_page = a[0].0.tokens_per_page();
    drop(a);
    assert_eq!(cache.cached(id_a), 0, "A's pages left the cache with A");
    let other = ModelKvShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 32,
        dtype: KvDtype::F32,
    };
    let mut b = vec![(
        Engine::host(&shared, engine_config(PreemptionMode::Recompute), &other, 1).unwrap(),
        ClosedForm::new(1, 1, 32),
    )];
    assert_eq!(b[0].0.id(), id_a, "the id is registered again");
    assert_eq!(b[0].0.tokens_per_page(), tokens_per_page);
    add(&mut b[0], request(6, 40, 4)); // seq 3's prompt
    run_to_idle(&mut b);
    assert_eq!(
        b[0].0.batcher().stats().prefix_hit_tokens,
        0,
        "B hit A's pages"
    );
}

/// Two engines on 32 pages: B (engine 1) filled the whole pool while A was idle, and A then
/// got a latency-critical request that needs pages B borrowed.
fn lender_lent_out() -> (Arc<SharedArena>, Vec<Driven>) {
    let (shared, mut engines) = build(32, PreemptionMode::Recompute);
    for s in 0..8u64 {
        add(&mut engines[1], request(100 + s, 40, 200));
    }
    for _ in 0..40 {
        let (b, m) = &mut engines[1];
        b.step(m).unwrap();
    }
    assert_eq!(shared.pool().free_count(), 0);
    let mut urgent = request(1, 200, 4);
    urgent.priority = Priority::LatencyCritical;
    add(&mut engines[0], urgent);
    (shared, engines)
}

/// A latency-critical request waiting for pages lent out asks the donor once per donor step,
/// not once per own step: while the donor had not stepped, every (empty) step of the waiting
/// engine asked for the same pages again, the requests added up, and the donor then shed them
/// all: a one-page demand made it give back a page per step the requester had spun, down below
/// its own share (a server's engine thread steps in a loop while it has work).
#[test]
fn a_waiting_request_asks_its_donor_once_per_donor_step() {
    let mut shed = Vec::new();
    for requester_steps in [1usize, 10] {
        let (_shared, mut engines) = lender_lent_out();
        let mut asked = 0;
        for _ in 0..requester_steps {
            let (a, m) = &mut engines[0];
            asked += u32::from(a.step(m).unwrap().asked_donation);
        }
        assert_eq!(asked, 1, "asked again before the donor stepped");
        let (b, m) = &mut engines[1];
        shed.push(b.step(m).unwrap().pages_shed);
    }
    assert_eq!(
        shed[0], shed[1],
        "pages shed after 1 and 10 requester steps"
    );
}

/// A donation asked of an engine that is dropped before it steps dies with it: the next engine
/// registered on its id used to take it at its first step and report pages shed that nobody
/// had asked of it (`StepReport::pages_shed`), for a requester that was by then asking others.
#[test]
fn a_dropped_donors_pending_donation_does_not_pass_to_the_next_engine_on_its_id() {
    let (shared, mut engines) = lender_lent_out();
    let (a, m) = &mut engines[0];
    assert!(a.step(m).unwrap().asked_donation);
    // The donor leaves before taking the request; a new engine gets its id.
    let donor = engines.pop().unwrap();
    let donor_id = donor.0.id();
    drop(donor);
    let mut next = weighted_engine(&shared, 1, 1);
    assert_eq!(next.0.id(), donor_id);
    add(&mut next, request(300, 8, 4));
    let (c, m) = &mut next;
    assert_eq!(
        c.step(m).unwrap().pages_shed,
        0,
        "the dead donor's request was taken"
    );
}

/// A donation asked by an engine that is dropped before its donor takes it dies with it: the
/// donor used to take it at its next step and shed pages for an engine that no longer existed
/// (`StepReport::pages_shed`), preempting its own work for nobody.
#[test]
fn a_dropped_requesters_pending_donation_is_not_shed_by_its_donor() {
    let (_shared, mut engines) = lender_lent_out();
    let (a, m) = &mut engines[0];
    assert!(a.step(m).unwrap().asked_donation);
    // The requester leaves before its donor steps.
    drop(engines.remove(0));
    let (b, m) = &mut engines[0];
    let report = b.step(m).unwrap();
    assert_eq!(
        report.pages_shed, 0,
        "the donor shed pages for a dropped requester"
    );
}

/// The periodic recompute counts committed steps, not schedules: a step that failed (and the
/// schedule that retried it) used to shift the count, so the recompute due at the second step
/// came only at the fourth one.
#[test]
fn the_periodic_recompute_counts_committed_steps() {
    let shapes = shapes();
    let page_bytes = page_bytes_for(&shapes.map(|(s, _)| s), 16).unwrap();
    let shared = SharedArena::host(BudgetConfig::new(1, 128, 64), page_bytes).unwrap();
    let mut cfg = engine_config(PreemptionMode::Recompute);
    cfg.recompute = RecomputePolicy {
        when_dirty: false,
        every_steps: 2,
    };
    let (shape, heads) = shapes[0];
    let mut engine = Engine::host(&shared, cfg, &shape, heads).unwrap();
    let mut model = FailingArmed {
        inner: ClosedForm::new(heads, shape.num_kv_heads, shape.head_dim),
        armed: false,
    };
    let req = request(1, 8, 50);
    model.inner.prompt_len.insert(1, req.prompt.len());
    engine.add(req).unwrap();
    // The first step finds the engine idle in the budgets (it reports itself active there);
    // under this policy the engine publishes only periodically, so the caller publishes that.
    assert_eq!(engine.step(&mut model).unwrap().scheduled, 0);
    shared.coordinator().recompute();
    let epoch = || shared.coordinator().snapshot().epoch;
    model.armed = true;
    assert!(engine.step(&mut model).is_err());
    model.armed = false;
    let before = epoch();
    engine.step(&mut model).unwrap(); // the second committed step
    assert!(
        epoch() > before,
        "no periodic recompute at the second committed step"
    );
}

/// A sequence ended at the start of a step that then fails (a caller's finish, an abort) is
/// still reported: the failed step's caller skips its results, and the next schedule, which
/// discards the failed batch, reports it again. Before, that schedule cleared the report,
/// and the stream of a sequence the caller had finished (a stop string) never got its end.
#[test]
fn a_sequence_ended_at_a_failed_step_is_reported_by_the_next() {
    let (shared, mut engines) = build_armed(64, PreemptionMode::Recompute);
    let (engine, model) = &mut engines[0];
    for id in [1, 2] {
        let req = request(id, 8, 50);
        model.inner.prompt_len.insert(id, req.prompt.len());
        engine.add(req).unwrap();
    }
    for _ in 0..4 {
        engine.step(model).unwrap();
    }
    engine.finish_with(1, FinishReason::Caller(7)).unwrap();
    // The step fails (seq 2's row): a server delivers nothing from it.
    model.armed = true;
    assert!(engine.step(model).is_err());
    model.armed = false;
    // It goes on: the next step discards the failed batch.
    let mut ended = HashMap::new();
    for _ in 0..3 {
        engine.step(model).unwrap();
        for u in &engine.results().updates {
            if let Some(reason) = u.finished {
                ended.insert(u.id, reason);
            }
        }
        for f in engine.finished() {
            assert_eq!(ended.get(&f.id), Some(&f.reason));
        }
    }
    assert_eq!(ended.get(&1), Some(&FinishReason::Caller(7)), "{ended:?}");
    engine.abort(2).unwrap();
    engine.step(model).unwrap();
    drop(engines);
    assert_no_leak(&shared);
}

/// `StepResults` order (its docs said rows first, then the ends): the sequences that ended at
/// the start of the step come first, with empty token ranges, then one entry per sampling row
/// in row order.
#[test]
fn step_results_list_the_ended_sequences_before_the_rows() {
    let (_shared, mut engines) = build(128, PreemptionMode::Recompute);
    for id in 1..=3 {
        add(&mut engines[0], request(id, 8, 50));
    }
    let (engine, model) = &mut engines[0];
    for _ in 0..3 {
        engine.step(model).unwrap();
    }
    engine.abort(2).unwrap();
    engine.step(model).unwrap();
    let r = engine.results();
    let order: Vec<_> = r.updates.iter().map(|u| (u.id, u.finished)).collect();
    assert_eq!(order[0], (2, Some(FinishReason::Aborted)), "{order:?}");
    assert!(r.updates[0].tokens.is_empty());
    let rows: Vec<SeqId> = r.updates[1..].iter().map(|u| u.id).collect();
    assert_eq!(rows, engine.batch().seq_ids, "then the rows, in row order");
}

/// Engines of `weights` on `pages` pages (room for `max_engines`), with a block cap of `cap`
/// per mille; no prefix cache.
fn build_weighted(
    pages: u32,
    weights: &[u32],
    max_engines: u16,
    cap: u16,
) -> (Arc<SharedArena>, Vec<Driven>) {
    let shapes = shapes();
    let page_bytes = page_bytes_for(&shapes.map(|(s, _)| s), 16).unwrap();
    let shared = SharedArena::host(
        BudgetConfig::new(max_engines, 128, pages).with_cap_permille(cap),
        page_bytes,
    )
    .unwrap();
    let engines = weights
        .iter()
        .map(|&w| weighted_engine(&shared, w, 0))
        .collect();
    (shared, engines)
}

/// Steps every engine that has work, round after round (2000 at most), as engine threads
/// that step while `has_work()` do.
fn step_while_working(engines: &mut [Driven]) {
    for _ in 0..2000 {
        for (e, m) in engines.iter_mut().filter(|(e, _)| e.has_work()) {
            e.step(m).unwrap();
        }
    }
}

/// Two engines of weight 1 on 32 pages (quotas of 16; pages of 32 tokens in `shapes()[0]`'s
/// geometry; block demand quantum 1), no prefix cache, prefill chunks of at most `chunk`.
fn two_engines_of_chunk(chunk: u32) -> (Arc<SharedArena>, Vec<Driven>) {
    let (shared, _) = build_weighted(32, &[], 2, 1000);
    let engines = (0..2)
        .map(|_| {
            let (shape, heads) = shapes()[0];
            let mut cfg = engine_config(PreemptionMode::Recompute);
            cfg.prefix_cache = false;
            cfg.max_prefill_chunk = chunk;
            let engine = Engine::host(&shared, cfg, &shape, heads).unwrap();
            (
                engine,
                ClosedForm::new(heads, shape.num_kv_heads, shape.head_dim),
            )
        })
        .collect();
    (shared, engines)
}

/// An engine of weight `weight` and geometry `shapes()[shape]` on `shared`.
fn weighted_engine(shared: &Arc<SharedArena>, weight: u32, shape: usize) -> Driven {
    let (shape, heads) = shapes()[shape];
    let mut cfg = engine_config(PreemptionMode::Recompute);
    cfg.weight = weight;
    cfg.prefix_cache = false;
    let engine = Engine::host(shared, cfg, &shape, heads).unwrap();
    (
        engine,
        ClosedForm::new(heads, shape.num_kv_heads, shape.head_dim),
    )
}

/// Steps engine 0 and keeps every other engine fed with short requests (so it
/// stays active and its share is never lent), until `id` ends on engine 0 or `steps` pass.
/// Returns its finish reason. The fed requests take ids from `*next` on.
fn run_beside_busy(
    engines: &mut [Driven],
    id: SeqId,
    next: &mut SeqId,
    steps: usize,
) -> Option<FinishReason> {
    for _ in 0..steps {
        for other in engines.iter_mut().skip(1) {
            let b = other.0.batcher();
            if b.num_waiting() + b.num_running() < 4 {
                *next += 1;
                add(other, request(*next, 30, 20));
            }
            if other.0.has_work() {
                let (eng, m) = other;
                eng.step(m).unwrap();
            }
        }
        let (a, m) = &mut engines[0];
        a.step(m).unwrap();
        if let Some(f) = a.finished().iter().find(|f| f.id == id) {
            return Some(f.reason);
        }
    }
    None
}

/// One sequence needing more pages than its engine's guaranteed share (its quota) could only
/// ever run on pages lent by idle engines: beside an engine that keeps some work (a server's
/// steady traffic; here it holds a few pages of its 24), the small engine's limit stays at its
/// quota and the sequence was preempted by recompute again and again, never finishing and
/// never refused (36 preemptions in 400 steps). It is refused at `add` now, with the quota as
/// the limit, with two or three engines, and with a block cap alone; a request within the
/// quota still finishes beside busy engines, and one engine's sequences together still borrow
/// beyond its quota while the others idle.
#[test]
fn a_request_longer_than_the_engines_guaranteed_share_is_refused_not_preempted_forever() {
    // (weights, pages, cap): engine 0's quota is 8 pages in each.
    for (weights, pages, cap) in [
        (vec![1u32, 3], 32u32, 1000u16),
        (vec![1, 2, 1], 32, 1000),
        (vec![1], 16, 500),
    ] {
        let (shared, mut engines) = build_weighted(pages, &weights, weights.len() as u16, cap);
        let id0 = engines[0].0.id();
        assert_eq!(shared.coordinator().block_quota(id0), 8);
        // Engine 0 has 32 tokens per page: 300 + 20 - 1 tokens are 10 pages.
        let long = request(1, 300, 20);
        engines[0].1.prompt_len.insert(1, 300);
        match engines[0].0.add(long) {
            Err(SchedError::TooLong { blocks, limit, .. }) => assert_eq!((blocks, limit), (10, 8)),
            Ok(()) => {
                let ended = run_beside_busy(&mut engines, 1, &mut 10_000, 400);
                panic!(
                    "{weights:?} cap {cap}: a 10-page request on an 8-page share was accepted \
                     and ended with {ended:?} after 400 steps ({} recompute preemptions)",
                    engines[0].0.batcher().stats().preempted_recompute
                );
            }
            Err(e) => panic!("{e}"),
        }
        // Within the quota (240 + 17 - 1 tokens: 8 pages) it finishes beside busy engines.
        add(&mut engines[0], request(2, 240, 17));
        assert_eq!(
            run_beside_busy(&mut engines, 2, &mut 20_000, 400),
            Some(FinishReason::MaxTokens),
            "{weights:?} cap {cap}"
        );
        drop(engines);
        assert_no_leak(&shared);
    }
    // Borrowing is untouched: three 6-page sequences run at once (18 pages on an 8-page
    // quota) while the other engine idles.
    let (shared, mut engines) = build_weighted(32, &[1, 3], 2, 1000);
    for id in 1..=3 {
        add(&mut engines[0], request(id, 170, 20));
    }
    let mut most = 0;
    while engines[0].0.has_work() {
        let (a, m) = &mut engines[0];
        a.step(m).unwrap();
        most = most.max(shared.coordinator().blocks_held(a.id()));
        assert!(a.steps() < 400);
    }
    assert_eq!(most, 18);
    drop(engines);
    assert_no_leak(&shared);
}

/// A sequence accepted within its engine's share, which then shrinks below its need (a third
/// engine registers), ends at the engine's next step with `FinishReason::TooLong`, its pages
/// and budget given back; it was left to be preempted forever beside busy engines.
#[test]
fn a_sequence_its_engines_shrunk_share_cannot_hold_ends_with_too_long() {
    let (shared, mut engines) = build_weighted(32, &[1, 1], 3, 1000);
    let c = shared.coordinator().clone();
    let id0 = engines[0].0.id();
    assert_eq!(c.block_quota(id0), 16);
    // 12 pages (372 + 13 - 1 tokens); a short one (2 pages) beside it.
    add(&mut engines[0], request(1, 372, 13));
    add(&mut engines[0], request(2, 40, 10));
    // Until it holds more than the share will be.
    while c.blocks_held(id0) <= 8 {
        let (a, m) = &mut engines[0];
        a.step(m).unwrap();
        assert!(a.steps() < 100);
    }
    engines.push(weighted_engine(&shared, 2, 1));
    assert_eq!(c.block_quota(id0), 8);
    let mut ended = HashMap::new();
    let mut too_long = None;
    let mut next = 10_000;
    for step in 0..400 {
        let reason = run_beside_busy(&mut engines, u64::MAX, &mut next, 1);
        assert!(reason.is_none());
        let a = &engines[0].0;
        for u in &a.results().updates {
            if let Some(r) = u.finished {
                ended.insert(u.id, r);
            }
        }
        if too_long.is_none() && ended.contains_key(&1) {
            too_long = Some(step);
        }
        if ended.len() == 2 {
            break;
        }
    }
    assert_eq!(
        ended.get(&1),
        Some(&FinishReason::TooLong),
        "the 12-page sequence on an 8-page share: {ended:?}, {} recompute preemptions",
        engines[0].0.batcher().stats().preempted_recompute
    );
    assert_eq!(
        too_long,
        Some(0),
        "not ended at the first step after the share shrank"
    );
    assert_eq!(ended.get(&2), Some(&FinishReason::MaxTokens));
    assert!(engines[0].0.batcher().stats().aborted >= 1);
    // Requests needing more than the new share are refused.
    let mut long = request(3, 372, 13);
    long.priority = Priority::LatencyCritical;
    assert!(matches!(
        engines[0].0.add(long),
        Err(SchedError::TooLong { limit: 8, .. })
    ));
    drop(engines);
    assert_no_leak(&shared);
}

/// A sequence that ended at the schedule of a batch not yet committed (here: its step failed)
/// has its end still to be reported, by the next step. Its id is not free before then: a new
/// request on that id was accepted, and the next step's results then held the old sequence's
/// end under the id of the new one (a client's stream for the new request closed before its
/// first token, and its tokens came after the end). The id is taken until the end is reported.
#[test]
fn an_id_whose_end_is_not_yet_reported_is_not_reused() {
    let (shared, mut engines) = build_armed(64, PreemptionMode::Recompute);
    let (engine, model) = &mut engines[0];
    for id in [1, 2] {
        let req = request(id, 8, 50);
        model.inner.prompt_len.insert(id, req.prompt.len());
        engine.add(req).unwrap();
    }
    for _ in 0..4 {
        engine.step(model).unwrap();
    }
    engine.finish_with(1, FinishReason::Caller(7)).unwrap();
    model.armed = true;
    assert!(engine.step(model).is_err());
    model.armed = false;
    // Seq 1's end is not reported yet (a server delivers nothing from a failed step). A
    // client reusing the id (a new stream on it) then delivers each step's results.
    let again = request(1, 4, 3);
    let mut streamed: Streamed = HashMap::new();
    let deliver = |engine: &Engine<HostBackend<f32>>, streamed: &mut Streamed| {
        let results = engine.results();
        for u in &results.updates {
            let entry = streamed.entry(u.id).or_default();
            assert!(entry.1.is_none(), "seq {} updated after it finished", u.id);
            entry.0.extend_from_slice(results.tokens_of(u));
            entry.1 = u.finished;
        }
    };
    match engine.add(again.clone()) {
        Err(SchedError::DuplicateId(1)) => {}
        Ok(()) => {
            model.inner.prompt_len.insert(1, again.prompt.len());
            for _ in 0..3 {
                engine.step(model).unwrap();
                deliver(engine, &mut streamed);
            }
            panic!("the new request on id 1 streamed {:?}", streamed.get(&1));
        }
        Err(e) => panic!("{e}"),
    }
    // The next step reports the end once; the id is free after that.
    engine.step(model).unwrap();
    deliver(engine, &mut streamed);
    assert_eq!(
        streamed.get(&1).and_then(|s| s.1),
        Some(FinishReason::Caller(7))
    );
    streamed.remove(&1);
    model.inner.prompt_len.insert(1, again.prompt.len());
    engine.add(again).unwrap();
    engine.abort(2).unwrap();
    for _ in 0..20 {
        if !engine.has_work() {
            break;
        }
        engine.step(model).unwrap();
        deliver(engine, &mut streamed);
    }
    assert!(!engine.has_work());
    assert_eq!(streamed[&1].0.len(), 3);
    assert_eq!(streamed[&1].1, Some(FinishReason::MaxTokens));
    drop(engines);
    assert_no_leak(&shared);
}

/// A query-head count whose output rows overflow (heads x head dim past what the kernels index
/// with 32 bits) is refused when the engine is built: it was accepted, and each step's output
/// size then overflowed (a panic in debug, a wrapped size in release).
#[test]
fn query_heads_whose_rows_overflow_are_refused() {
    let shape = ModelKvShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 32,
        dtype: KvDtype::F32,
    };
    let page_bytes = page_bytes_for(&[shape], 16).unwrap();
    let shared = SharedArena::host(BudgetConfig::new(1, 128, 64), page_bytes).unwrap();
    for heads in [usize::MAX, (i32::MAX as usize) / 32 + 1] {
        let r: Result<Engine<HostBackend<f32>>, _> = Engine::host(
            &shared,
            engine_config(PreemptionMode::Recompute),
            &shape,
            heads,
        );
        assert!(
            matches!(r, Err(EngineError::InvalidConfig(_))),
            "{heads} query heads: {:?}",
            r.map(|_| ())
        );
    }
    let fits = (i32::MAX as usize) / 32;
    let ok: Result<Engine<HostBackend<f32>>, _> = Engine::host(
        &shared,
        engine_config(PreemptionMode::Recompute),
        &shape,
        fits,
    );
    assert!(ok.is_ok(), "{:?}", ok.map(|_| ()));
}

/// ClosedForm whose sampling fails when armed (a device error while reading the logits back,
/// say): called by every commit, a step of no rows included.
struct FailingSample {
    inner: ClosedForm,
    armed: bool,
}

/// An engine and its model that can fail to sample.
type FailingDriven = (Engine<HostBackend<f32>>, FailingSample);

impl StepModel<HostBackend<f32>> for FailingSample {
    fn qkv(
        &mut self,
        backend: &HostBackend<f32>,
        layer: usize,
        batch: &Batch,
    ) -> Result<LayerQkv<'_, [f32]>, EngineError> {
        self.inner.qkv(backend, layer, batch)
    }
    fn attended(&mut self, layer: usize, batch: &Batch, out: &[f32]) -> Result<(), EngineError> {
        self.inner.attended(layer, batch, out)
    }
    fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError> {
        if self.armed {
            return Err(EngineError::Model("injected sampling failure".into()));
        }
        self.inner.sample(batch, out)
    }
}

/// `build(64, Recompute)`'s engines, each model wrapped in a disarmed `FailingSample`.
fn failing_sample_engines() -> (Arc<SharedArena>, Vec<FailingDriven>) {
    let (shared, engines) = build(64, PreemptionMode::Recompute);
    let engines = engines
        .into_iter()
        .map(|(e, inner)| {
            (
                e,
                FailingSample {
                    inner,
                    armed: false,
                },
            )
        })
        .collect();
    (shared, engines)
}

/// A sequence ended at the start of a step that schedules no rows (its abort ended the
/// engine's last sequence) and then fails is reported by the next step, as after a failed
/// step with rows (`Engine::step`'s docs): before, the batch being empty, nothing was
/// pending, the next schedule cleared the report, and the stream never got its end.
#[test]
fn an_end_at_a_failed_step_of_no_rows_is_reported_by_the_next() {
    let (shared, mut engines) = failing_sample_engines();
    let (engine, model) = &mut engines[0];
    let req = request(1, 8, 50);
    model.inner.prompt_len.insert(1, req.prompt.len());
    engine.add(req).unwrap();
    for _ in 0..3 {
        engine.step(model).unwrap();
    }
    engine.abort(1).unwrap();
    model.armed = true;
    assert!(engine.step(model).is_err());
    assert!(engine.batch().is_empty(), "the failed step had no rows");
    // The id's end is not reported yet: it is not taken by a new request meanwhile.
    let again = request(1, 8, 50);
    assert!(matches!(engine.add(again), Err(SchedError::DuplicateId(1))));
    model.armed = false;
    engine.step(model).unwrap();
    let ends: Vec<_> = engine
        .results()
        .updates
        .iter()
        .map(|u| (u.id, u.finished))
        .collect();
    assert_eq!(ends, [(1, Some(FinishReason::Aborted))], "the end was lost");
    assert_eq!(engine.finished().len(), 1);
    // Reported once it was delivered: the next step does not repeat it.
    engine.step(model).unwrap();
    assert!(engine.results().updates.is_empty());
    assert!(engine.finished().is_empty());
    drop(engines);
    assert_no_leak(&shared);
}

/// The same end, lost to a caller that steps while `has_work()` (the candle runner, the serve
/// example): the failed step's schedule ended the engine's last sequence, so before, the
/// engine reported no work, no step came, and the end (due with the next step) never came.
#[test]
fn an_engine_with_an_end_still_to_report_has_work() {
    let (shared, mut engines) = failing_sample_engines();
    let (engine, model) = &mut engines[0];
    let req = request(1, 8, 50);
    model.inner.prompt_len.insert(1, req.prompt.len());
    engine.add(req).unwrap();
    engine.step(model).unwrap();
    engine.abort(1).unwrap();
    model.armed = true;
    assert!(engine.step(model).is_err());
    model.armed = false;
    let mut ends = Vec::new();
    let mut steps = 0;
    while engine.has_work() && steps < 10 {
        engine.step(model).unwrap();
        steps += 1;
        ends.extend(engine.results().updates.iter().map(|u| (u.id, u.finished)));
    }
    assert_eq!(ends, [(1, Some(FinishReason::Aborted))], "the end was lost");
    assert!(!engine.has_work(), "reported: nothing is left");
    drop(engines);
    assert_no_leak(&shared);
}

/// An engine that does not use the arena's prefix cache beside one that does: the other's
/// cached-free pages count as free in the coordinator (lendable, the README's "Prefix cache"),
/// so they must be evictable for it too. It could not evict (no prefix link), its budget
/// granted the pages and the pool refused them, and its request waited forever once the
/// caching engine went idle with the pool full of its cached pages.
#[test]
fn an_engine_without_the_prefix_cache_gets_pages_the_others_cache_holds() {
    let (shared, mut engines) = build_with(32, PreemptionMode::Recompute, true);
    // Engine 0 caches its prompts' pages until the pool is full of cached-free pages.
    for s in 0..6u64 {
        // Distinct prompts: one salt each.
        engines[0].1.prompt_len.insert(s, 250);
        engines[0].0.add_salted(request(s, 250, 2), s).unwrap();
        run_to_idle(&mut engines[..1]);
    }
    assert!(
        shared.pool().free_count() < 8,
        "free {}",
        shared.pool().free_count()
    );
    assert_eq!(shared.coordinator().blocks_in_use(), 0);
    // Engine 1 without the cache.
    drop(engines.pop());
    let mut cfg = engine_config(PreemptionMode::Recompute);
    cfg.prefix_cache = false;
    let (shape, heads) = shapes()[1];
    let mut b = (
        Engine::host(&shared, cfg, &shape, heads).unwrap(),
        ClosedForm::new(heads, shape.num_kv_heads, shape.head_dim),
    );
    add(&mut b, request(1000, 200, 4));
    for _ in 0..50 {
        if !b.0.has_work() {
            break;
        }
        let (e, m) = &mut b;
        e.step(m).unwrap();
    }
    assert!(
        !b.0.has_work(),
        "the request never ran: {} pages free in the pool, {} in use in the coordinator",
        shared.pool().free_count(),
        shared.coordinator().blocks_in_use()
    );
    // It only evicts: nothing of its own is looked up or cached.
    assert_eq!(b.0.batcher().stats().prefix_prompt_tokens, 0);
    assert_eq!(shared.prefix_cache().unwrap().cached(b.0.id()), 0);
    drop(b);
    drop(engines);
    assert_no_leak(&shared);
}

/// A borrower told to give pages back (a lender became active) whose caller ends some of its
/// sequences before its next step (aborts: dropped streams) gets those pages back from the
/// ends: the shed is what is still owed after them. It preempted the full order on top of
/// the ends, throwing away running sequences' KV that nobody needed.
#[test]
fn pages_freed_by_aborts_count_toward_a_reclaim_order() {
    let (shared, mut engines) = build_weighted(32, &[1, 1], 2, 1000);
    let c = shared.coordinator().clone();
    // Engine 1 borrows engine 0's share: four sequences (14 pages at most each).
    let b_id = engines[1].0.id();
    for id in 1..=4 {
        add(&mut engines[1], request(id, 60, 150));
    }
    while c.blocks_held(b_id) < 26 {
        let (b, m) = &mut engines[1];
        b.step(m).unwrap();
        assert!(b.steps() < 400);
    }
    // Engine 0 gets work that needs more than the free pages (13 pages): it asks for its
    // whole quota, and engine 1's limit drops to its own.
    add(&mut engines[0], request(100, 200, 4));
    let (a, m) = &mut engines[0];
    a.step(m).unwrap();
    let owed = c.reclaim_for(b_id);
    assert!(owed > 0, "no reclaim order");
    // Engine 1's caller ends its two oldest sequences before its next step: they hold more
    // than the order.
    let held = c.blocks_held(b_id);
    engines[1].0.abort(1).unwrap();
    engines[1].0.abort(2).unwrap();
    let before = engines[1].0.batcher().stats();
    let (b, m) = &mut engines[1];
    let report = b.step(m).unwrap();
    let after = b.batcher().stats();
    let freed = held - c.blocks_held(b_id);
    assert!(
        u64::from(owed) <= freed,
        "the order was not met: {owed} owed, {freed} freed"
    );
    assert_eq!(
        (
            after.preempted_recompute - before.preempted_recompute,
            after.aborted - before.aborted
        ),
        (0, 2),
        "{owed} pages owed, shed {}: the aborts freed enough ({} running)",
        report.pages_shed,
        b.batcher().num_running()
    );
    drop(engines);
    assert_no_leak(&shared);
}

/// A caller's end asked while the sequence's last row waits for its commit (an abort between
/// schedule and commit), and that commit ends it by its stop rules: its end is reported once
/// (by the commit), and its id is free at once for a new request, as for any reported end.
/// The caller's pending end stayed queued, and a new request on the id was refused
/// (`DuplicateId`) until the next step.
#[test]
fn an_id_ended_at_a_commit_with_a_caller_end_pending_is_free_at_once() {
    let (shared, mut engines) = build(64, PreemptionMode::Recompute);
    let driven = &mut engines[0];
    add(driven, request(1, 8, 2));
    let (engine, model) = driven;
    engine.step(model).unwrap();
    assert_eq!(engine.results().updates.len(), 1);
    // Its last token's step: the caller aborts it while the step runs.
    engine.schedule();
    engine.execute(model).unwrap();
    engine.abort(1).unwrap();
    engine.commit(model).unwrap();
    let ends: Vec<_> = engine
        .results()
        .updates
        .iter()
        .map(|u| u.finished)
        .collect();
    assert_eq!(ends, [Some(FinishReason::MaxTokens)]);
    // Its end was reported: the id is free.
    model.prompt_len.insert(1, 4);
    engine.add(request(1, 4, 3)).unwrap();
    let mut streamed = Vec::new();
    for _ in 0..10 {
        if !engine.has_work() {
            break;
        }
        engine.step(model).unwrap();
        let results = engine.results();
        for u in &results.updates {
            assert_eq!(u.id, 1);
            streamed.extend_from_slice(results.tokens_of(u));
            if let Some(reason) = u.finished {
                // The new sequence runs to its own end: the old one's abort is not applied
                // to it.
                assert_eq!(reason, FinishReason::MaxTokens);
            }
        }
    }
    assert_eq!(streamed.len(), 3);
    drop(engines);
    assert_no_leak(&shared);
}

/// A configuration the batcher refuses (no running slots) is refused by `Engine::new` without
/// leaving the engine's budget registration behind, or ever making one: the coordinator still
/// has room for as many engines as before, and published nothing.
#[test]
fn a_config_the_batcher_refuses_leaves_no_registration() {
    let (shape, heads) = shapes()[0];
    let page_bytes = page_bytes_for(&[shape], 16).unwrap();
    let shared = SharedArena::host(BudgetConfig::new(2, 128, 32), page_bytes).unwrap();
    let mut bad = engine_config(PreemptionMode::Recompute);
    bad.max_running = 0;
    let epoch = shared.coordinator().epoch();
    for _ in 0..2 {
        let err = Engine::<HostBackend<f32>>::host(&shared, bad, &shape, heads).unwrap_err();
        assert!(matches!(err, EngineError::Sched(_)), "{err}");
    }
    // Refused before registering: registering and deregistering again published two rounds of
    // shares in between, and an engine stepping meanwhile saw its guaranteed pages drop (it
    // could end sequences with TooLong, or shed pages, for an engine that never ran).
    assert_eq!(
        shared.coordinator().epoch(),
        epoch,
        "a refused engine published shares"
    );
    let good = engine_config(PreemptionMode::Recompute);
    let a = Engine::<HostBackend<f32>>::host(&shared, good, &shape, heads);
    let b = Engine::<HostBackend<f32>>::host(&shared, good, &shape, heads);
    assert!(
        a.is_ok() && b.is_ok(),
        "a refused engine kept its registration"
    );
}

/// `StepReport::reclaim_closed_after` counts the steps from the one that first saw the demand
/// for lent-out pages to the one that found them free: the requester steps `n` times while
/// the donor has not stepped, the donor sheds, and the requester's next step reports `n`
/// (no other test checks the figure).
#[test]
fn a_reclaim_reports_the_steps_it_took() {
    for requester_steps in [1u64, 3] {
        let (_shared, mut engines) = lender_lent_out();
        for _ in 0..requester_steps {
            let (a, m) = &mut engines[0];
            assert_eq!(
                a.step(m).unwrap().reclaim_closed_after,
                None,
                "still lent out"
            );
        }
        let (b, m) = &mut engines[1];
        assert!(b.step(m).unwrap().pages_shed > 0);
        let (a, m) = &mut engines[0];
        assert_eq!(
            a.step(m).unwrap().reclaim_closed_after,
            Some(requester_steps),
            "the demand seen first {requester_steps} steps before"
        );
    }
}

/// ClosedForm that fails at its first attention output (`fail_attend`) or at sampling
/// (`fail_sample`) when told to.
struct Faulty {
    inner: ClosedForm,
    fail_attend: bool,
    fail_sample: bool,
}

impl StepModel<HostBackend<f32>> for Faulty {
    fn qkv(
        &mut self,
        backend: &HostBackend<f32>,
        layer: usize,
        batch: &Batch,
    ) -> Result<LayerQkv<'_, [f32]>, EngineError> {
        self.inner.qkv(backend, layer, batch)
    }
    fn attended(&mut self, layer: usize, batch: &Batch, out: &[f32]) -> Result<(), EngineError> {
        if self.fail_attend {
            return Err(EngineError::Model("injected attention failure".into()));
        }
        self.inner.attended(layer, batch, out)
    }
    fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError> {
        if self.fail_sample {
            return Err(EngineError::Model("injected sampling failure".into()));
        }
        self.inner.sample(batch, out)
    }
}

/// The coordinator's counters agree with what the engine holds after each of its steps: its
/// pages (without a prefix cache, whose cached-free pages an engine owns but is not charged
/// for, exactly), the device's tokens (every engine's grant), nothing held by an idle engine,
/// and after a failed step no more than its share (what it borrowed goes back, as at a commit).
fn assert_books(shared: &SharedArena, engine: &Engine<HostBackend<f32>>, failed: bool, seed: u64) {
    let (c, pool, id) = (shared.coordinator(), shared.pool(), engine.id());
    let held = u64::from(pool.held(id));
    if shared.prefix_cache().is_none() {
        assert_eq!(held, c.blocks_held(id), "seed {seed}: pages");
    } else {
        assert!(held >= c.blocks_held(id), "seed {seed}: pages");
    }
    let engines = c.config().max_engines;
    let granted: u64 = (0..engines).map(|k| c.tokens_granted(EngineId(k))).sum();
    assert_eq!(granted, c.tokens_in_use(), "seed {seed}: tokens");
    assert!(c.tokens_in_use() <= u64::from(c.config().tokens_per_step));
    if !engine.has_work() {
        assert!(!c.is_active(id), "seed {seed}: an idle engine is active");
        assert_eq!(
            c.tokens_granted(id),
            0,
            "seed {seed}: an idle engine holds tokens"
        );
    }
    if failed {
        assert!(
            c.tokens_granted(id) <= u64::from(c.token_share(id)),
            "seed {seed}: a failed step holds {} tokens, its share is {}",
            c.tokens_granted(id),
            c.token_share(id)
        );
    }
}

/// One random workload of every feature at once on two engines of one arena: priorities, EOS
/// and stop sequences (some reached inside a row of accepted drafts), drafts right and wrong,
/// aborts and caller finishes, the prefix cache, swap or recompute preemption on a small
/// arena, and steps failing at execute or at sampling. Every row's attention is checked by
/// the closed form; every delivered stream is the true continuation up to its end; ends are
/// delivered once (a failed step's ends come with the next); nothing leaks.
fn run_everything(seed: u64) {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let pages = rng.gen_range(12..40);
    let mode = if rng.gen_bool(0.5) {
        PreemptionMode::Swap
    } else {
        PreemptionMode::Recompute
    };
    let shapes = shapes();
    let page_bytes = page_bytes_for(&shapes.map(|(s, _)| s), 16).unwrap();
    let mut shared = SharedArena::host(BudgetConfig::new(2, 128, pages), page_bytes).unwrap();
    if rng.gen_bool(0.6) {
        Arc::get_mut(&mut shared)
            .unwrap()
            .enable_prefix_cache(Some(1));
    }
    let mut engines: Vec<(Engine<HostBackend<f32>>, Faulty)> = shapes
        .iter()
        .map(|(shape, heads)| {
            let mut cfg = engine_config(mode);
            cfg.max_running = rng.gen_range(1..8);
            cfg.max_batched_tokens = rng.gen_range(1..64);
            cfg.max_prefill_chunk = rng.gen_range(1..30);
            cfg.swap_blocks = rng.gen_range(0..40);
            cfg.weight = rng.gen_range(1..3);
            let engine = Engine::host(&shared, cfg, shape, *heads).unwrap();
            (
                engine,
                Faulty {
                    inner: ClosedForm::new(*heads, shape.num_kv_heads, shape.head_dim),
                    fail_attend: false,
                    fail_sample: false,
                },
            )
        })
        .collect();
    // Per engine, per sequence: (prompt, max_new, eos position, stop position, delivered
    // tokens, delivered end).
    type Want = (
        usize,
        u32,
        Option<usize>,
        Option<usize>,
        Vec<u32>,
        Option<FinishReason>,
    );
    let mut seqs: Vec<HashMap<SeqId, Want>> = vec![HashMap::new(), HashMap::new()];
    let mut next_id: SeqId = 0;
    for step in 0..3000 {
        for (e, (engine, model)) in engines.iter_mut().enumerate() {
            // New requests while the first steps run.
            if step < 80 && rng.gen_bool(0.5) {
                next_id += 1;
                let id = next_id;
                let prompt = rng.gen_range(1..90);
                let out = rng.gen_range(1..40u32);
                let eos = rng.gen_bool(0.3).then(|| rng.gen_range(0..out as usize));
                let stop = rng
                    .gen_bool(0.3)
                    .then(|| rng.gen_range(1..out as usize + 1));
                let mut req = request(id, prompt, out);
                if rng.gen_bool(0.3) {
                    req.priority = Priority::LatencyCritical;
                }
                if let Some(k) = eos {
                    req.stop.eos.push(truth((prompt + k) as i32));
                }
                if let Some(k) = stop {
                    // The output's tokens k-1 and k (or the first alone).
                    let from = k.saturating_sub(1);
                    req.stop.stop_sequences.push(
                        (from..=k.min(out as usize - 1))
                            .map(|j| truth((prompt + j) as i32))
                            .collect(),
                    );
                }
                model.inner.prompt_len.insert(id, prompt);
                let salt = rng.gen_range(0..2);
                if engine.add_salted(req, salt).is_ok() {
                    seqs[e].insert(id, (prompt, out, eos, stop, Vec::new(), None));
                }
            }
            // Aborts and caller finishes.
            let mut live: Vec<SeqId> = seqs[e]
                .iter()
                .filter(|(_, w)| w.5.is_none())
                .map(|(&id, _)| id)
                .collect();
            live.sort_unstable();
            for &id in &live {
                if rng.gen_bool(0.01) {
                    let _ = engine.abort(id);
                } else if rng.gen_bool(0.005) {
                    let _ = engine.finish_with(id, FinishReason::Caller(9));
                }
            }
            // Drafts.
            for &id in &live {
                if engine.batcher().phase(id) != Some(pagedkv::sched::SeqPhase::Decoding) {
                    continue;
                }
                let w = &seqs[e][&id];
                let pos = (w.0 + w.4.len()) as i32;
                let k = rng.gen_range(0..5usize);
                let drafts: Vec<u32> = (0..k as i32)
                    .map(|j| if rng.gen_bool(0.7) { truth(pos + j) } else { 3 })
                    .collect();
                let _ = engine.propose(id, &drafts);
            }
            let fail = rng.gen_range(0..20);
            model.fail_attend = fail == 0;
            model.fail_sample = fail == 1;
            let r = match rng.gen_range(0..10) {
                // A schedule discarded unexecuted.
                0 => {
                    engine.schedule();
                    engine.step(model)
                }
                // Aborts and proposals between schedule and commit.
                1 => {
                    engine.schedule();
                    if let Some(&id) = live.get(rng.gen_range(0..live.len().max(1))) {
                        let _ = engine.abort(id);
                    }
                    engine.execute(model).and_then(|_| engine.commit(model))
                }
                _ => engine.step(model),
            };
            model.fail_attend = false;
            model.fail_sample = false;
            assert_books(&shared, engine, r.is_err(), seed);
            if r.is_err() {
                assert!(fail <= 1, "seed {seed}: uninjected failure {r:?}");
                continue;
            }
            let results = engine.results();
            for u in &results.updates {
                let w = seqs[e]
                    .get_mut(&u.id)
                    .expect("update of an unknown sequence");
                assert!(
                    w.5.is_none(),
                    "seed {seed}: seq {} updated after its end",
                    u.id
                );
                w.4.extend_from_slice(results.tokens_of(u));
                w.5 = u.finished;
            }
            for f in engine.finished() {
                let w = &seqs[e][&f.id];
                assert_eq!(w.4, f.output, "seed {seed}: seq {}", f.id);
                assert_eq!(w.5, Some(f.reason), "seed {seed}: seq {}", f.id);
            }
        }
        if step > 80 && engines.iter().all(|(e, _)| !e.has_work()) {
            break;
        }
    }
    assert!(
        engines.iter().all(|(e, _)| !e.has_work()),
        "seed {seed}: did not go idle"
    );
    for (e, per) in seqs.iter().enumerate() {
        for (&id, w) in per {
            let (prompt, out, eos, stop, tokens, end) = w;
            let end = end.unwrap_or_else(|| panic!("seed {seed}: seq {id} never ended"));
            let truth_out: Vec<u32> = (*prompt as i32..).take(*out as usize).map(truth).collect();
            assert_eq!(
                &truth_out[..tokens.len()],
                &tokens[..],
                "seed {seed}: engine {e} seq {id}"
            );
            // Where it must have stopped, if it ran to its own end.
            let mut natural = (*out as usize, FinishReason::MaxTokens);
            if let Some(k) = stop {
                let k = (*k).min(*out as usize - 1);
                if k < natural.0 {
                    natural = (k + 1, FinishReason::StopSequence);
                }
            }
            if let Some(k) = eos {
                if *k < natural.0 {
                    natural = (k + 1, FinishReason::Eos);
                }
            }
            match end {
                FinishReason::Aborted | FinishReason::Caller(_) => {
                    assert!(tokens.len() <= natural.0, "seed {seed}: seq {id}")
                }
                FinishReason::TooLong => {}
                reason => assert_eq!(
                    (tokens.len(), reason),
                    natural,
                    "seed {seed}: engine {e} seq {id}"
                ),
            }
        }
    }
    drop(engines);
    assert_no_leak(&shared);
}

#[test]
fn random_workloads_of_every_feature_stay_exact() {
    for seed in 0..16 {
        run_everything(seed);
    }
}

/// A reclaim order met by swap-outs whose step then failed: the next step's shed request is
/// read before that step discards the failed batch, while the pages of its swap-outs still
/// count as held. Those pages go back at the start of the step (with the discard), so they
/// meet the order; the engine must not preempt as many pages again. It preempted three more
/// of its four running sequences (12 pages), though it was then at its limit.
#[test]
fn a_failed_steps_swap_outs_count_toward_the_next_steps_shed() {
    let shape = shapes()[0].0;
    let heads = shapes()[0].1;
    let page_bytes = page_bytes_for(&[shape], 8).unwrap();
    let shared = SharedArena::host(BudgetConfig::new(2, 1024, 32), page_bytes).unwrap();
    let cfg = EngineConfig {
        weight: 1,
        max_running: 8,
        max_batched_tokens: 512,
        max_prefill_chunk: 64,
        max_context: 64,
        preemption: PreemptionMode::Swap,
        swap_blocks: 64,
        recompute: RecomputePolicy::SERVER,
        prefix_cache: false,
    };
    let mut engines: Vec<Armed> = (0..2)
        .map(|_| {
            let engine = Engine::host(&shared, cfg, &shape, heads).unwrap();
            assert_eq!(engine.tokens_per_page(), 8);
            let inner = ClosedForm::new(heads, shape.num_kv_heads, shape.head_dim);
            (
                engine,
                FailingArmed {
                    inner,
                    armed: false,
                },
            )
        })
        .collect();
    let (a, b) = engines.split_at_mut(1);
    let ((ea, ma), (eb, mb)) = (&mut a[0], &mut b[0]);
    // Engine A alone: 7 sequences of 4 pages each, 28 pages (its limit is the whole pool
    // while B idles).
    for id in 0..7 {
        let req = request(id, 30, 10);
        ma.inner.prompt_len.insert(id, 30);
        ea.add(req).unwrap();
    }
    ea.step(ma).unwrap();
    assert_eq!(ea.batcher().num_running(), 7);
    assert_eq!(shared.coordinator().blocks_held(ea.id()), 28);
    // B gets work that needs its whole quota (three requests of 6 pages, more than the 4
    // free): A's limit drops to its own, 16 pages.
    for id in 100..103 {
        mb.inner.prompt_len.insert(id, 40);
        eb.add(request(id, 40, 4)).unwrap();
    }
    eb.step(mb).unwrap();
    assert_eq!(shared.coordinator().block_limit(ea.id()), 16);
    // A's reclaim order (12 pages) swaps out 3 sequences; the step fails.
    let batch = ea.schedule();
    assert_eq!(batch.swap_out.len(), 12);
    assert_eq!(ea.batcher().num_running(), 4);
    ma.armed = true;
    assert!(ea.execute(ma).is_err());
    ma.armed = false;
    // The next step discards the batch: the 3 swapped sequences wait to be recomputed and the
    // pages their swap-outs held go back, which brings A to its limit. Nothing more to shed.
    ea.schedule();
    assert_eq!(ea.batcher().num_waiting(), 3);
    assert_eq!(
        ea.batcher().num_running(),
        4,
        "A preempted again for pages the discard gave back (held {}, limit {})",
        shared.coordinator().blocks_held(ea.id()),
        shared.coordinator().block_limit(ea.id())
    );
    ea.execute(ma).unwrap();
    ea.commit(ma).unwrap();
    for _ in 0..200 {
        if !ea.has_work() && !eb.has_work() {
            break;
        }
        ea.step(ma).unwrap();
        eb.step(mb).unwrap();
    }
    assert!(!ea.has_work() && !eb.has_work());
    drop(engines);
    assert_no_leak(&shared);
}

/// A latency-critical request short of pages that its engine's own running throughput work
/// can make room for is admitted at its engine's next step by preempting that work, and no
/// other engine is asked for a donation: here the pool is full and a borrower (B) holds pages
/// lent by A, so A asked B to donate while (before) its request waited for B's next step, or
/// (with own preemption alone) both gave pages up for one page. B's reclaim order still
/// returns what it borrowed.
#[test]
fn a_latency_critical_request_preempts_its_own_throughput_work_before_asking_a_donor() {
    // Quotas 8, 8, 16 pages; while C idles, A and B may borrow its 16.
    let (shared, mut engines) = build_weighted(32, &[1, 1, 2], 3, 1000);
    let c = shared.coordinator().clone();
    let ids: Vec<_> = engines.iter().map(|(e, _)| e.id()).collect();
    // A: one throughput sequence of 3 pages (90 tokens, 32 a page), decoding.
    add(&mut engines[0], request(1, 90, 60));
    for _ in 0..6 {
        let (a, m) = &mut engines[0];
        a.step(m).unwrap();
    }
    assert_eq!(engines[0].0.batcher().phase(1), Some(SeqPhase::Decoding));
    let held_a = c.blocks_held(ids[0]);
    // B: borrows past its quota of 8 (8 sequences of up to 3 pages; C's share and what A's
    // block demand leaves of its own are lent).
    for s in 0..8 {
        add(&mut engines[1], request(100 + s, 40, 40));
    }
    for _ in 0..40 {
        let (b, m) = &mut engines[1];
        b.step(m).unwrap();
    }
    assert!(c.blocks_held(ids[1]) >= 16, "{:?}", c.snapshot());
    // C becomes active and takes the free pages: the pool is full, B is over its new limit.
    for s in 0..6 {
        add(&mut engines[2], request(200 + s, 60, 20));
    }
    for _ in 0..20 {
        let (e, m) = &mut engines[2];
        e.step(m).unwrap();
        if shared.pool().free_count() == 0 {
            break;
        }
    }
    assert_eq!(shared.pool().free_count(), 0);
    assert!(
        c.blocks_held(ids[1]) > u64::from(c.block_limit(ids[1])),
        "B holds lent pages"
    );
    assert!(
        held_a < u64::from(c.block_limit(ids[0])),
        "A is within its limit"
    );
    let mut urgent = request(50, 20, 2);
    urgent.priority = Priority::LatencyCritical;
    add(&mut engines[0], urgent);
    let (a, m) = &mut engines[0];
    let report = a.step(m).unwrap();
    assert_eq!(
        a.batcher().phase(50),
        Some(SeqPhase::Decoding),
        "the latency-critical request waited"
    );
    assert_eq!(
        a.batcher().phase(1),
        Some(SeqPhase::Waiting),
        "A's own work gave way"
    );
    assert!(!report.asked_donation, "a donor was asked for pages A had");
    step_while_working(&mut engines);
    assert!(engines.iter().all(|(e, _)| !e.has_work()));
    drop(engines);
    assert_no_leak(&shared);
}

/// A lender with latency-critical work short of the pages it lent (no throughput work of its
/// own to preempt) asks the borrower to donate them, and its raised block demand orders the
/// borrower to give back what it holds above its lowered limit: both reach the borrower at its
/// next step. The order's pages cover the request (the coordinator promises no more than the
/// pool), so the borrower gives back the larger of the two; it gave back their sum, preempting
/// the donated pages' worth of work more, for nothing.
#[test]
fn a_borrower_asked_to_donate_and_to_give_back_sheds_the_pages_once() {
    // Quotas 16 and 16 pages of 32 tokens; block demand quantum 1; whole prompts in one chunk.
    let (shared, mut engines) = two_engines_of_chunk(128);
    let c = shared.coordinator().clone();
    let ids: Vec<_> = engines.iter().map(|(e, _)| e.id()).collect();
    // A: one short latency-critical sequence, decoding: its block demand is two pages.
    let mut chat = request(1, 20, 40);
    chat.priority = Priority::LatencyCritical;
    add(&mut engines[0], chat);
    for _ in 0..3 {
        let (a, m) = &mut engines[0];
        a.step(m).unwrap();
    }
    let demand = c.block_demand(ids[0]).expect("A published a block demand");
    assert!(demand < 16, "{:?}", c.snapshot());
    // B, flooded, borrows what A's demand leaves of its quota.
    for s in 0..8 {
        add(&mut engines[1], request(100 + s, 40, 200));
    }
    for _ in 0..200 {
        let (b, m) = &mut engines[1];
        b.step(m).unwrap();
        if c.blocks_held(ids[1]) == u64::from(c.block_limit(ids[1])) {
            break;
        }
    }
    assert!(
        c.blocks_held(ids[1]) > 16,
        "B borrowed nothing: {:?}",
        c.snapshot()
    );
    let free = 32 - c.blocks_in_use();
    // A's second latency-critical request needs more than the pool has free, fewer than A's
    // quota leaves it.
    let mut urgent = request(2, 120, 4);
    urgent.priority = Priority::LatencyCritical;
    add(&mut engines[0], urgent);
    let (need_class, need) = engines[0].0.batcher().next_admission_need().unwrap();
    assert_eq!(need_class, Priority::LatencyCritical);
    assert!(
        u64::from(need) > free && c.blocks_held(ids[0]) + u64::from(need) <= 16,
        "need {need}, free {free}: {:?}",
        c.snapshot()
    );
    let (a, m) = &mut engines[0];
    let report = a.step(m).unwrap();
    // A's demand rises to cover the request (what it holds and the request's pages).
    let demand = c.block_demand(ids[0]).map_or(u64::MAX, u64::from);
    assert!(
        demand >= c.blocks_held(ids[0]) + u64::from(need),
        "{:?}",
        c.snapshot()
    );
    let owed = c.reclaim_for(ids[1]);
    assert!(owed >= need, "owed {owed}, need {need}: {:?}", c.snapshot());
    let (b, m) = &mut engines[1];
    let shed = b.step(m).unwrap().pages_shed;
    assert!(report.asked_donation, "A asked no donation");
    assert_eq!(shed, owed, "B gave back more than it borrowed");
    let (a, m) = &mut engines[0];
    a.step(m).unwrap();
    assert_ne!(
        a.batcher().phase(2),
        Some(SeqPhase::Waiting),
        "{:?}",
        c.snapshot()
    );
    step_while_working(&mut engines);
    assert!(engines.iter().all(|(e, _)| !e.has_work()));
    drop(engines);
    assert_no_leak(&shared);
}

/// A lender's running row waiting for pages it lent counts as a reclaim demand: the lender
/// (A, one long sequence decoding) lent most of its quota to B, admits a second prompt into
/// the free pages, and its next decode rows wait for B to give the pages back; the step after
/// B's shed reports the steps A's rows waited. Only blocked admissions were counted before,
/// so a lender's own work stalled for its borrowers showed no reclaim at all.
#[test]
fn a_lenders_rows_waiting_for_lent_pages_report_their_reclaim() {
    // Quotas 16 and 16 pages of 16 tokens; block demand quantum 1.
    let (shared, mut engines) = build_weighted(32, &[1, 1], 2, 1000);
    let c = shared.coordinator().clone();
    let (ida, idb) = (engines[0].0.id(), engines[1].0.id());
    add(&mut engines[0], request(1, 16, 80));
    let (a, m) = &mut engines[0];
    a.step(m).unwrap();
    for s in 0..24 {
        add(&mut engines[1], request(100 + s, 32, 60));
    }
    for _ in 0..200 {
        let (b, m) = &mut engines[1];
        b.step(m).unwrap();
        if c.blocks_held(idb) > 20 {
            break;
        }
    }
    assert!(
        c.blocks_held(idb) > 16,
        "B borrowed nothing: {:?}",
        c.snapshot()
    );
    // A admits a prompt of two pages more than are free (32 tokens a page in its geometry),
    // within its quota, and steps on alone until a prefill row waits for its pages.
    let free = 32 - c.blocks_in_use() as usize;
    assert!(c.blocks_held(ida) as usize + free + 2 <= 16);
    add(&mut engines[0], request(2, 32 * (free + 2), 40));
    let (a, m) = &mut engines[0];
    let mut waited = false;
    for _ in 0..20 {
        assert_eq!(a.step(m).unwrap().reclaim_closed_after, None);
        if a.batcher().stats().lent_page_waits > 0 {
            waited = true;
            break;
        }
    }
    assert!(waited, "A never waited for lent pages: {:?}", c.snapshot());
    let s = a.batcher().stats();
    assert_eq!((s.preempted_recompute, s.preempted_swap), (0, 0));
    let (b, m) = &mut engines[1];
    assert!(b.step(m).unwrap().pages_shed > 0, "B gave nothing back");
    let (a, m) = &mut engines[0];
    let waits = a.batcher().stats().lent_page_waits;
    let mut closed = None;
    for _ in 0..3 {
        closed = closed.or(a.step(m).unwrap().reclaim_closed_after);
    }
    assert_eq!(
        closed,
        Some(waits),
        "A's rows waited {waits} steps: {:?}",
        c.snapshot()
    );
    step_while_working(&mut engines);
    drop(engines);
    assert_no_leak(&shared);
}

/// A donation request whose need went away before the donor took it (the latency-critical
/// request that waited was aborted) is withdrawn at the first requester step that sees no
/// need: the donor then sheds nothing. It shed the pages anyway, preempting its own work for nobody.
#[test]
fn a_donation_no_longer_needed_is_withdrawn() {
    let (_shared, mut engines) = lender_lent_out();
    let (a, m) = &mut engines[0];
    assert!(a.step(m).unwrap().asked_donation);
    a.abort(1).unwrap();
    // The abort ends the sequence at the next step's schedule (after that step's donation
    // check); the step after sees no need.
    for _ in 0..2 {
        assert!(!a.step(m).unwrap().asked_donation);
    }
    let (b, m) = &mut engines[1];
    assert_eq!(
        b.step(m).unwrap().pages_shed,
        0,
        "the donor shed pages for an aborted request"
    );
}

/// A latency-critical request whose first chunk needs exactly what its engine's limit leaves
/// (here the whole 16-page quota, lent out) is within the limit, so it asks the borrower for a
/// donation at once. Counted as over the limit (`<` for `<=` in the driver's check), it would
/// wait for a reclaim order instead, and its reclaim latency would go untracked.
#[test]
fn a_request_needing_exactly_the_rest_of_its_share_asks_a_donation() {
    // Quotas 16 and 16 pages of 32 tokens; a 512-token prompt in one chunk is 16 pages.
    let (shared, mut engines) = two_engines_of_chunk(512);
    let c = shared.coordinator().clone();
    // B fills the pool while A is idle.
    for s in 0..8 {
        add(&mut engines[1], request(100 + s, 40, 200));
    }
    let b = engines[1].0.id();
    for _ in 0..200 {
        let (e, m) = &mut engines[1];
        e.step(m).unwrap();
        if c.blocks_held(b) == u64::from(c.block_limit(b)) {
            break;
        }
    }
    assert_eq!(shared.pool().free_count(), 0, "{:?}", c.snapshot());
    let mut urgent = request(1, 512, 1);
    urgent.priority = Priority::LatencyCritical;
    add(&mut engines[0], urgent);
    let a = engines[0].0.id();
    let (class, need) = engines[0].0.batcher().next_admission_need().unwrap();
    assert_eq!(class, Priority::LatencyCritical);
    assert_eq!(
        c.blocks_held(a) + u64::from(need),
        u64::from(c.block_limit(a)),
        "not the boundary: {:?}",
        c.snapshot()
    );
    let (a_engine, m) = &mut engines[0];
    let report = a_engine.step(m).unwrap();
    assert!(
        report.asked_donation,
        "A asked no donation: {:?}",
        c.snapshot()
    );
    step_while_working(&mut engines);
    assert!(engines.iter().all(|(e, _)| !e.has_work()));
    drop(engines);
    assert_no_leak(&shared);
}
