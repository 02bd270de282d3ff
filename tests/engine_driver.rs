//! The engine driver and its step executor: two models of different geometry on one host arena,
//! driven step by step with a model whose attention output has a closed form, so every row of
//! every step is checked; per-step results against the final outputs; caller finish reasons;
//! no page or budget leaked.

use pagedkv::budget::BudgetConfig;
use pagedkv::engine::{
    Engine, EngineConfig, HostBackend, KvBackend, LayerQkv, RecomputePolicy, SharedArena, StepModel,
};
use pagedkv::error::EngineError;
use pagedkv::kv::{page_bytes_for, KvDtype, ModelKvShape};
use pagedkv::sched::{Batch, FinishReason, PreemptionMode, Priority, SeqId, SeqRequest, StopRules};
use std::collections::HashMap;
use std::sync::Arc;

/// Keys are all equal, so attention is uniform over the visible positions and each output
/// element is the mean of the values at positions `0..=pos`. Value element `d` of sequence `s`
/// at position `p` in layer `l` is `value(s, p, l, d)`: the expected output is known exactly.
struct ClosedForm {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// The next token each sequence samples (a per-sequence counter).
    next_token: HashMap<SeqId, u32>,
    rows_checked: u64,
}

fn value(seq: SeqId, pos: i32, layer: usize, d: usize) -> f32 {
    (seq as f32) * 0.5 + pos as f32 * 0.25 + layer as f32 * 3.0 + d as f32 * 0.01
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
            next_token: HashMap::new(),
            rows_checked: 0,
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
        for (t, &row) in rows.iter().enumerate() {
            let (seq, pos) = (batch.seq_ids[row], batch.positions[t]);
            for _ in 0..self.kv_heads {
                self.v
                    .extend((0..self.head_dim).map(|d| value(seq, pos, layer, d)));
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
            for h in 0..self.heads {
                for d in 0..self.head_dim {
                    let want =
                        (0..=pos).map(|p| value(seq, p, layer, d)).sum::<f32>() / (pos + 1) as f32;
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
        for (row, &seq) in batch.seq_ids.iter().enumerate() {
            if batch.samples[row] {
                let next = self.next_token.entry(seq).or_insert(100);
                out.push(*next);
                *next += 1;
            }
        }
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
    }
}

/// A model's engine with its closed-form model.
type Driven = (Engine<HostBackend<f32>>, ClosedForm);
/// Per sequence: the streamed tokens and the finish reason streamed last.
type Streamed = HashMap<SeqId, (Vec<u32>, Option<FinishReason>)>;

fn request(id: SeqId, prompt: usize, out: u32) -> SeqRequest {
    SeqRequest {
        id,
        prompt: vec![7; prompt],
        stop: StopRules {
            max_new_tokens: out,
            eos: Vec::new(),
            stop_sequences: Vec::new(),
        },
        priority: Priority::Throughput,
    }
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

fn build(pages: u32, preemption: PreemptionMode) -> (Arc<SharedArena>, Vec<Driven>) {
    let shapes = shapes();
    let page_bytes = page_bytes_for(&shapes.map(|(s, _)| s), 16).unwrap();
    let shared = SharedArena::host(BudgetConfig::new(2, 128, pages), page_bytes).unwrap();
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
    for (e, (engine, _)) in engines.iter_mut().enumerate() {
        for s in 0..6u64 {
            let id = 10 * e as u64 + s;
            engine
                .add(request(id, 5 + 11 * s as usize, 3 + s as u32 * 4))
                .unwrap();
        }
    }
    let streamed = run_to_idle(&mut engines);
    for (e, per) in streamed.iter().enumerate() {
        assert_eq!(per.len(), 6, "engine {e}");
        for (id, (tokens, reason)) in per {
            let s = id % 10;
            assert_eq!(tokens.len() as u64, 3 + s * 4, "seq {id}");
            assert_eq!(*reason, Some(FinishReason::MaxTokens));
            // The model's counter: tokens are 100, 101, ... in order.
            assert!(tokens.iter().zip(100..).all(|(&t, want)| t == want));
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
        for (e, (engine, _)) in engines.iter_mut().enumerate() {
            for s in 0..8u64 {
                engine
                    .add(request(100 * e as u64 + s, 20 + 3 * s as usize, 30))
                    .unwrap();
            }
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
    let (engine, model) = &mut engines[0];
    engine.add(request(1, 8, 50)).unwrap();
    engine.add(request(2, 8, 50)).unwrap();
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

#[test]
fn commit_before_execute_is_refused_and_changes_nothing() {
    let (_shared, mut engines) = build(64, PreemptionMode::Recompute);
    let (engine, model) = &mut engines[0];
    engine.add(request(1, 8, 4)).unwrap();
    // The first steps may be empty until the coordinator has seen the engine active.
    while engine.schedule().is_empty() {
        engine.execute(model).unwrap();
        engine.commit(model).unwrap();
    }
    let stats = engine.batcher().stats();
    assert!(engine.commit(model).is_err());
    assert_eq!(engine.batcher().stats(), stats);
    engine.execute(model).unwrap();
    engine.commit(model).unwrap();
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
