//! The workload and stand-in model shared by the raw-backend engine tests
//! (tests/cuda_emu_engine.rs on the emulation, tests/cuda_raw_engine.rs on a GPU): one seeded
//! set of sequences with prompts longer than the prefill chunk, on a pool small enough to
//! preempt, run on the CPU backend as the reference; a model whose projections depend on
//! token, position and layer and whose sampled token depends on the attention output, so a
//! wrong cache byte changes what is generated; the comparison of two runs.
// Each test crate that includes this file uses part of it.
#![allow(dead_code)]

use pagedkv::budget::BudgetConfig;
use pagedkv::engine::{
    Engine, EngineConfig, HostBackend, KvBackend, LayerQkv, RecomputePolicy, SharedArena, StepModel,
};
use pagedkv::error::EngineError;
use pagedkv::kv::{page_bytes_for, KvDtype, ModelKvShape};
use pagedkv::sched::{Batch, PreemptionMode, Priority, SeqRequest, StopRules};
use std::sync::Arc;

pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const HEAD_DIM: usize = 64;
pub const LAYERS: usize = 2;

pub fn shape() -> ModelKvShape {
    ModelKvShape {
        num_layers: LAYERS,
        num_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        dtype: KvDtype::F32,
    }
}

/// A model's attention shape: query heads, KV heads, head dim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    pub q: usize,
    pub kv: usize,
    pub d: usize,
}

/// The workload's default model.
pub const HEADS_DEFAULT: Heads = Heads {
    q: HEADS,
    kv: KV_HEADS,
    d: HEAD_DIM,
};

/// The heads of the model a backend serves.
pub fn heads_of<B: KvBackend>(backend: &B) -> Heads {
    Heads {
        q: backend.query_heads(),
        kv: backend.config().num_kv_heads(),
        d: backend.config().head_dim(),
    }
}

/// The projections of `layer` for the batch's tokens: q `[tokens, h.q, h.d]`, k and v
/// `[tokens, h.kv, h.d]`, smooth functions of token id, position and layer.
pub fn project(batch: &Batch, layer: usize, h: Heads) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let val = |tok: u32, pos: i32, part: usize, i: usize| {
        let x = (tok as f32) * 0.37 + (pos as f32) * 0.11 + (layer as f32) * 0.53;
        ((x + (part * 97 + i) as f32 * 0.071).sin() * 0.9) + 0.05
    };
    let mut q = Vec::new();
    let mut k = Vec::new();
    let mut v = Vec::new();
    for (&tok, &pos) in batch.input_tokens.iter().zip(&batch.positions) {
        q.extend((0..h.q * h.d).map(|i| val(tok, pos, 0, i)));
        k.extend((0..h.kv * h.d).map(|i| val(tok, pos, 1, i)));
        v.extend((0..h.kv * h.d).map(|i| val(tok, pos, 2, i)));
    }
    (q, k, v)
}

/// The token sampled from a row's last-layer attention output: a coarse hash of the output
/// (rounded to 1/8, far above the two kernels' float differences) into a vocabulary of 50.
pub fn sample_token(row: &[f32]) -> u32 {
    let s: i64 = row
        .iter()
        .enumerate()
        .map(|(i, &x)| (x * 8.0).round() as i64 * (i as i64 % 7 + 1))
        .sum();
    s.rem_euclid(50) as u32
}

/// A step's rows as the model saw them: sequence ids, input tokens, positions, query starts.
pub type StepRows = (Vec<u64>, Vec<u32>, Vec<i32>, Vec<i32>);

/// What both models record: each step's batch shape and each layer's attention output.
#[derive(Debug, Default)]
pub struct Log {
    pub batches: Vec<StepRows>,
    pub outputs: Vec<Vec<f32>>,
    last_out: Vec<f32>,
    /// Elements per token of the last output (query heads x head dim).
    row: usize,
    /// Every page a block table of a step named.
    pub pages: std::collections::BTreeSet<i32>,
}

impl Log {
    pub fn attended(&mut self, layer: usize, batch: &Batch, out: &[f32]) {
        if layer == 0 {
            self.batches.push((
                batch.seq_ids.clone(),
                batch.input_tokens.clone(),
                batch.positions.clone(),
                batch.query_start_loc.clone(),
            ));
            self.pages
                .extend(batch.block_tables.iter().copied().filter(|&p| p >= 0));
        }
        self.outputs.push(out.to_vec());
        self.last_out = out.to_vec();
        self.row = out.len() / batch.num_tokens().max(1);
    }

    pub fn sample(&self, batch: &Batch, out: &mut Vec<u32>) {
        let row = self.row;
        for &t in &batch.logits_indices {
            let t = t as usize;
            out.push(sample_token(&self.last_out[t * row..(t + 1) * row]));
        }
    }
}

#[derive(Debug, Default)]
pub struct HostModel {
    log: Log,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl HostModel {
    /// What the model recorded.
    pub fn into_log(self) -> Log {
        self.log
    }
}

impl StepModel<HostBackend<f32>> for HostModel {
    fn qkv(
        &mut self,
        backend: &HostBackend<f32>,
        layer: usize,
        batch: &Batch,
    ) -> Result<LayerQkv<'_, [f32]>, EngineError> {
        (self.q, self.k, self.v) = project(batch, layer, heads_of(backend));
        Ok(LayerQkv {
            query: &self.q,
            key: &self.k,
            value: &self.v,
        })
    }

    fn attended(&mut self, layer: usize, batch: &Batch, out: &[f32]) -> Result<(), EngineError> {
        self.log.attended(layer, batch, out);
        Ok(())
    }

    fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError> {
        self.log.sample(batch, out);
        Ok(())
    }
}

pub fn engine_config(preemption: PreemptionMode) -> EngineConfig {
    EngineConfig {
        weight: 1,
        max_running: 6,
        max_batched_tokens: 96,
        max_prefill_chunk: 40,
        max_context: 512,
        preemption,
        swap_blocks: 64,
        recompute: RecomputePolicy::SERVER,
        prefix_cache: false,
    }
}

pub const PAGES: u32 = 24;
pub const TOKENS_PER_PAGE: usize = 16;

pub fn shared() -> Arc<SharedArena> {
    let page_bytes = page_bytes_for(&[shape()], TOKENS_PER_PAGE).unwrap();
    SharedArena::host(BudgetConfig::new(1, 96, PAGES), page_bytes).unwrap()
}

pub fn requests() -> Vec<SeqRequest> {
    // Prompts of 3 to 90 tokens (several longer than the 40-token prefill chunk); together
    // with their outputs they need more than the pool's 24 pages of 16 tokens, so sequences
    // are preempted and resumed.
    (0..7u64)
        .map(|i| SeqRequest {
            id: i + 1,
            prompt: (0..3 + (i as u32 * 29) % 88)
                .map(|t| (t * 7 + i as u32) % 50)
                .collect(),
            stop: StopRules {
                max_new_tokens: 24 + (i as u32 % 3) * 8,
                eos: vec![],
                stop_sequences: vec![],
            },
            priority: Priority::Throughput,
        })
        .collect()
}

pub struct Run {
    pub log: Log,
    pub outputs: Vec<(u64, Vec<u32>)>,
    pub pages_moved: u64,
}

pub fn run_host(preemption: PreemptionMode) -> Run {
    let shared = shared();
    let mut engine = Engine::host(&shared, engine_config(preemption), &shape(), HEADS).unwrap();
    let mut model = HostModel::default();
    let (outputs, pages_moved) = drive(&mut engine, &mut model);
    Run {
        log: model.log,
        outputs,
        pages_moved,
    }
}

pub fn drive<B: KvBackend, M: StepModel<B>>(
    engine: &mut Engine<B>,
    model: &mut M,
) -> (Vec<(u64, Vec<u32>)>, u64) {
    for r in requests() {
        engine.add(r).unwrap();
    }
    let mut outputs = Vec::new();
    let mut moved = 0;
    let mut steps = 0;
    while engine.has_work() {
        steps += 1;
        assert!(steps < 2_000, "the workload did not finish");
        let report = engine.step(model).unwrap();
        moved += report.exec.pages_moved;
        for f in engine.finished() {
            outputs.push((f.id, f.output.clone()));
        }
    }
    outputs.sort();
    (outputs, moved)
}

pub fn compare(host: &Run, raw: &Run) {
    compare_logs(&host.log, &raw.log);
    assert_eq!(host.outputs, raw.outputs, "generated tokens");
    assert_eq!(host.outputs.len(), 7, "every sequence finished");
}

/// Same batches step by step, every attention output within float tolerance.
pub fn compare_logs(host: &Log, raw: &Log) {
    assert_eq!(host.batches.len(), raw.batches.len(), "step counts");
    for (i, (h, r)) in host.batches.iter().zip(&raw.batches).enumerate() {
        assert_eq!(h, r, "step {i}: the batches differ");
    }
    assert_eq!(host.outputs.len(), raw.outputs.len());
    for (i, (h, r)) in host.outputs.iter().zip(&raw.outputs).enumerate() {
        assert_eq!(h.len(), r.len(), "output {i}: lengths");
        for (j, (&a, &b)) in h.iter().zip(r).enumerate() {
            assert!(
                a.is_finite() && b.is_finite() && (a - b).abs() <= 1e-4 + 1e-4 * a.abs(),
                "step/layer output {i}, element {j}: CPU {a} vs emulated CUDA {b}"
            );
        }
    }
}

/// Rows that run a sequence from a position it had already passed (a resume by recompute
/// after preemption).
pub fn recomputed_rows(log: &Log) -> usize {
    let mut top = std::collections::HashMap::<u64, i32>::new();
    let mut again = 0;
    for (ids, _, positions, starts) in &log.batches {
        for (r, &id) in ids.iter().enumerate() {
            let (a, b) = (starts[r] as usize, starts[r + 1] as usize);
            let seen = top.entry(id).or_insert(-1);
            if a < b && positions[a] <= *seen {
                again += 1;
            }
            *seen = (*seen).max(positions[a..b].iter().copied().max().unwrap_or(-1));
        }
    }
    again
}

/// The projections of `layer` fused per token, `[tokens][q heads | k heads | v heads]`, as a
/// fused QKV matmul would leave them.
pub fn fused_qkv(batch: &Batch, layer: usize, h: Heads) -> Vec<f32> {
    let (q, k, v) = project(batch, layer, h);
    let (qd, kd) = (h.q * h.d, h.kv * h.d);
    let mut fused = Vec::with_capacity(q.len() + k.len() + v.len());
    for t in 0..batch.num_tokens() {
        fused.extend_from_slice(&q[t * qd..(t + 1) * qd]);
        fused.extend_from_slice(&k[t * kd..(t + 1) * kd]);
        fused.extend_from_slice(&v[t * kd..(t + 1) * kd]);
    }
    fused
}

/// Heads of the fused row's parts (q, k, v).
pub fn fused_parts(h: Heads) -> [usize; 3] {
    [h.q, h.kv, h.kv]
}
