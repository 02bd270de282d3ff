//! The engine over a backend that fails part-way through its KV work (a swap or copy list
//! half done, a failed launch or wait): every such step is discarded, and the engines still
//! stream every token of the model's true continuation exactly once, and leak nothing.

use pagedkv::budget::BudgetConfig;
use pagedkv::engine::{
    Engine, EngineConfig, HostBackend, KvBackend, LayerQkv, RecomputePolicy, SharedArena, StepModel,
};
use pagedkv::error::EngineError;
use pagedkv::kv::{page_bytes_for, KvCacheConfig, KvDtype, ModelKvShape};
use pagedkv::sched::{Batch, FinishReason, PreemptionMode, Priority, SeqId, SeqRequest, StopRules};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

fn truth(pos: i32) -> u32 {
    100 + pos as u32
}

fn prompt_token(seq: SeqId) -> u32 {
    7 + (seq % 3) as u32
}

fn value(pos: i32, layer: usize, d: usize, token: u32) -> f32 {
    pos as f32 * 0.25 + layer as f32 * 3.0 + d as f32 * 0.01 + (token % 97) as f32 * 0.125
}

/// A sequence's streamed tokens and its reported end.
type Streamed = (Vec<u32>, Option<FinishReason>);

/// A HostBackend whose operations fail when `fail` names them: a list op does its first half.
struct Flaky {
    inner: HostBackend<f32>,
    fail: Arc<Mutex<Option<&'static str>>>,
}

impl Flaky {
    fn hit(&mut self, what: &'static str) -> bool {
        let mut f = self.fail.lock().unwrap();
        if *f == Some(what) {
            *f = None;
            return true;
        }
        false
    }
}

impl KvBackend for Flaky {
    type Buf = [f32];
    fn config(&self) -> &KvCacheConfig {
        self.inner.config()
    }
    fn query_heads(&self) -> usize {
        self.inner.query_heads()
    }
    fn swap_slots(&self) -> Option<usize> {
        self.inner.swap_slots()
    }
    fn swap_out(&mut self, pairs: &[(u32, u32)]) -> Result<(), EngineError> {
        if self.hit("swap_out") {
            self.inner.swap_out(&pairs[..pairs.len() / 2])?;
            return Err(EngineError::Model("swap_out failed".into()));
        }
        self.inner.swap_out(pairs)
    }
    fn swap_in(&mut self, pairs: &[(u32, u32)]) -> Result<(), EngineError> {
        if self.hit("swap_in") {
            self.inner.swap_in(&pairs[..pairs.len() / 2])?;
            return Err(EngineError::Model("swap_in failed".into()));
        }
        self.inner.swap_in(pairs)
    }
    fn copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<(), EngineError> {
        if self.hit("copy") {
            self.inner.copy_blocks(&pairs[..pairs.len() / 2])?;
            return Err(EngineError::Model("copy failed".into()));
        }
        self.inner.copy_blocks(pairs)
    }
    fn begin(&mut self, batch: &Batch) -> Result<(), EngineError> {
        if self.hit("begin") {
            return Err(EngineError::Model("begin failed".into()));
        }
        self.inner.begin(batch)
    }
    fn reshape_and_cache(
        &mut self,
        layer: usize,
        key: &[f32],
        value: &[f32],
        batch: &Batch,
    ) -> Result<(), EngineError> {
        self.inner.reshape_and_cache(layer, key, value, batch)
    }
    fn decode(
        &mut self,
        layer: usize,
        query: &[f32],
        batch: &Batch,
    ) -> Result<&[f32], EngineError> {
        self.inner.decode(layer, query, batch)
    }
    fn prefill(
        &mut self,
        layer: usize,
        query: &[f32],
        batch: &Batch,
    ) -> Result<&[f32], EngineError> {
        self.inner.prefill(layer, query, batch)
    }
    fn end(&mut self) -> Result<(), EngineError> {
        if self.hit("end") {
            return Err(EngineError::Model("end failed".into()));
        }
        self.inner.end()
    }
}

struct ClosedForm {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    prompt_len: HashMap<SeqId, usize>,
}

fn token_rows(batch: &Batch) -> Vec<usize> {
    let mut rows = Vec::new();
    for s in 0..batch.num_seqs() {
        let (a, b) = (batch.query_start_loc[s], batch.query_start_loc[s + 1]);
        rows.extend(std::iter::repeat_n(s, (b - a) as usize));
    }
    rows
}

impl StepModel<Flaky> for ClosedForm {
    fn qkv(
        &mut self,
        _: &Flaky,
        layer: usize,
        batch: &Batch,
    ) -> Result<LayerQkv<'_, [f32]>, EngineError> {
        let n = batch.num_tokens();
        self.q = vec![0.1; n * self.heads * self.head_dim];
        self.k = vec![0.2; n * self.kv_heads * self.head_dim];
        self.v.clear();
        for t in 0..n {
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
        let rows = token_rows(batch);
        let width = self.heads * self.head_dim;
        for (t, &row) in rows.iter().enumerate() {
            let (seq, pos) = (batch.seq_ids[row], batch.positions[t]);
            let pl = self.prompt_len[&seq] as i32;
            let token = |p: i32| if p < pl { prompt_token(seq) } else { truth(p) };
            for d in 0..self.head_dim {
                let want =
                    (0..=pos).map(|p| value(p, layer, d, token(p))).sum::<f32>() / (pos + 1) as f32;
                let got = out[t * width + d];
                assert!(
                    (got - want).abs() <= 1e-3 * want.abs().max(1.0),
                    "seq {seq} pos {pos} layer {layer} dim {d}: {got} != {want}"
                );
            }
        }
        Ok(())
    }
    fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError> {
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
    let s = |num_layers, num_kv_heads, head_dim| ModelKvShape {
        num_layers,
        num_kv_heads,
        head_dim,
        dtype: KvDtype::F32,
    };
    [(s(2, 1, 16), 2), (s(1, 2, 32), 4)]
}

#[test]
fn backend_failures_part_way_discard_the_step_and_keep_every_result_exact() {
    for prefix in [false, true] {
        for op in ["swap_out", "swap_in", "copy", "begin", "end"] {
            run(op, prefix);
        }
    }
}

fn run(op: &'static str, prefix: bool) {
    let shapes = shapes();
    let page_bytes = page_bytes_for(&shapes.map(|(s, _)| s), 16).unwrap();
    let mut shared = SharedArena::host(BudgetConfig::new(2, 128, 24), page_bytes).unwrap();
    if prefix {
        Arc::get_mut(&mut shared)
            .unwrap()
            .enable_prefix_cache(Some(1));
    }
    let cfg = EngineConfig {
        weight: 1,
        max_running: 8,
        max_batched_tokens: 64,
        max_prefill_chunk: 24,
        max_context: 512,
        preemption: PreemptionMode::Swap,
        swap_blocks: 64,
        recompute: RecomputePolicy::SERVER,
        prefix_cache: true,
    };
    let switches: Vec<Arc<Mutex<Option<&'static str>>>> = (0..2).map(|_| Arc::default()).collect();
    let mut engines: Vec<(Engine<Flaky>, ClosedForm)> = shapes
        .iter()
        .zip(&switches)
        .map(|((shape, heads), sw)| {
            let view =
                pagedkv::kv::ArenaView::new(shared.host_arena().unwrap().clone(), shape).unwrap();
            // SAFETY: only the engine's own batches run on it, from this arena's pool.
            let inner = unsafe { HostBackend::new(view, *heads, 64).unwrap() };
            let e = Engine::new(
                &shared,
                cfg,
                Flaky {
                    inner,
                    fail: sw.clone(),
                },
            )
            .unwrap();
            (
                e,
                ClosedForm {
                    heads: *heads,
                    kv_heads: shape.num_kv_heads,
                    head_dim: shape.head_dim,
                    q: vec![],
                    k: vec![],
                    v: vec![],
                    prompt_len: HashMap::new(),
                },
            )
        })
        .collect();
    for (e, (engine, model)) in engines.iter_mut().enumerate() {
        for s in 0..8u64 {
            let id = 100 * e as u64 + s;
            let prompt = 20 + 3 * s as usize;
            model.prompt_len.insert(id, prompt);
            engine
                .add(SeqRequest {
                    id,
                    prompt: vec![prompt_token(id); prompt],
                    stop: StopRules {
                        max_new_tokens: 30,
                        eos: vec![],
                        stop_sequences: vec![],
                    },
                    priority: Priority::Throughput,
                })
                .unwrap();
        }
    }
    let mut streamed: Vec<HashMap<SeqId, Streamed>> = vec![HashMap::new(); 2];
    let mut failed = 0;
    let mut n = 0u64;
    for _ in 0..4000 {
        if engines.iter().all(|(e, _)| !e.has_work()) {
            break;
        }
        for (i, (engine, model)) in engines.iter_mut().enumerate() {
            n += 1;
            let b = engine.schedule();
            let arm = match op {
                "swap_out" => !b.swap_out.is_empty(),
                "swap_in" => !b.swap_in.is_empty(),
                "copy" => !b.copies.is_empty(),
                _ => n % 3 == 0 && b.num_seqs() > 0,
            } && failed < 30;
            if arm {
                *switches[i].lock().unwrap() = Some(op);
            }
            let r = engine.execute(model).and_then(|_| engine.commit(model));
            if r.is_err() {
                failed += 1;
                continue;
            }
            let results = engine.results();
            for u in &results.updates {
                let entry = streamed[i].entry(u.id).or_default();
                if entry.1.is_some() {
                    continue;
                }
                entry.0.extend_from_slice(results.tokens_of(u));
                entry.1 = u.finished;
            }
        }
    }
    assert!(failed > 0 || op == "copy", "{op}: the test must fail steps");
    eprintln!("{op} prefix {prefix}: {failed} failed steps");
    for (e, per) in streamed.iter().enumerate() {
        assert_eq!(per.len(), 8, "{op} engine {e}");
        for (id, (tokens, reason)) in per {
            let prompt = 20 + 3 * (id % 100) as i32;
            let want: Vec<u32> = (prompt..prompt + 30).map(truth).collect();
            assert_eq!(tokens, &want, "{op} seq {id}");
            assert_eq!(*reason, Some(FinishReason::MaxTokens));
        }
    }
    drop(engines);
    if let Some(cache) = shared.prefix_cache() {
        cache.clear();
    }
    assert_eq!(shared.pool().free_count(), shared.pool().total(), "{op}");
    assert_eq!(shared.coordinator().blocks_in_use(), 0, "{op}");
}
