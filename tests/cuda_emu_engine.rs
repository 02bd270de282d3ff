//! The engine loop on the raw-pointer device backend (`engine::RawBackend`), on the CUDA
//! kernels' CPU emulation (feature `cuda-emu`), against the same engine on the CPU kernels
//! (`HostBackend`): one seeded workload of sequences with prompts longer than the prefill
//! chunk, on a pool small enough to preempt, runs step by step on both; every step's batch must
//! be the same, every layer's attention output must match within float tolerance, and the
//! generated tokens must be identical. With swap preemption, pages move through the raw
//! backend's `swap_blocks` and come back; with recompute, sequences are rebuilt by prefill.
//! The model is a deterministic stand-in whose projections depend on token, position and layer
//! and whose sampled token depends on the attention output, so a wrong cache byte changes what
//! is generated.
#![cfg(all(feature = "cuda-emu", not(feature = "cuda")))]

use pagedkv::budget::BudgetConfig;
use pagedkv::cuda_emu::{EmuBuf, EmuDevice};
use pagedkv::cuda_raw::Rows;
use pagedkv::engine::{
    DeviceRows, Engine, EngineConfig, HostBackend, KvBackend, LayerQkv, RawBackend, RawCaps,
    RecomputePolicy, SharedArena, StepModel,
};
use pagedkv::error::EngineError;
use pagedkv::kv::{page_bytes_for, KvDtype, ModelKvShape};
use pagedkv::sched::{Batch, PreemptionMode, Priority, SeqRequest, StopRules};
use std::sync::Arc;

const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 64;
const LAYERS: usize = 2;

fn shape() -> ModelKvShape {
    ModelKvShape {
        num_layers: LAYERS,
        num_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        dtype: KvDtype::F32,
    }
}

/// The projections of `layer` for the batch's tokens: q `[tokens, HEADS, D]`, k and v
/// `[tokens, KV_HEADS, D]`, smooth functions of token id, position and layer.
fn project(batch: &Batch, layer: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let val = |tok: u32, pos: i32, part: usize, i: usize| {
        let x = (tok as f32) * 0.37 + (pos as f32) * 0.11 + (layer as f32) * 0.53;
        ((x + (part * 97 + i) as f32 * 0.071).sin() * 0.9) + 0.05
    };
    let mut q = Vec::new();
    let mut k = Vec::new();
    let mut v = Vec::new();
    for (&tok, &pos) in batch.input_tokens.iter().zip(&batch.positions) {
        q.extend((0..HEADS * HEAD_DIM).map(|i| val(tok, pos, 0, i)));
        k.extend((0..KV_HEADS * HEAD_DIM).map(|i| val(tok, pos, 1, i)));
        v.extend((0..KV_HEADS * HEAD_DIM).map(|i| val(tok, pos, 2, i)));
    }
    (q, k, v)
}

/// The token sampled from a row's last-layer attention output: a coarse hash of the output
/// (rounded to 1/8, far above the two kernels' float differences) into a vocabulary of 50.
fn sample_token(row: &[f32]) -> u32 {
    let s: i64 = row
        .iter()
        .enumerate()
        .map(|(i, &x)| (x * 8.0).round() as i64 * (i as i64 % 7 + 1))
        .sum();
    s.rem_euclid(50) as u32
}

/// A step's rows as the model saw them: sequence ids, input tokens, positions, query starts.
type StepRows = (Vec<u64>, Vec<u32>, Vec<i32>, Vec<i32>);

/// What both models record: each step's batch shape and each layer's attention output.
#[derive(Debug, Default)]
struct Log {
    batches: Vec<StepRows>,
    outputs: Vec<Vec<f32>>,
    last_out: Vec<f32>,
}

impl Log {
    fn attended(&mut self, layer: usize, batch: &Batch, out: &[f32]) {
        if layer == 0 {
            self.batches.push((
                batch.seq_ids.clone(),
                batch.input_tokens.clone(),
                batch.positions.clone(),
                batch.query_start_loc.clone(),
            ));
        }
        self.outputs.push(out.to_vec());
        self.last_out = out.to_vec();
    }

    fn sample(&self, batch: &Batch, out: &mut Vec<u32>) {
        let row = HEADS * HEAD_DIM;
        for &t in &batch.logits_indices {
            let t = t as usize;
            out.push(sample_token(&self.last_out[t * row..(t + 1) * row]));
        }
    }
}

#[derive(Debug, Default)]
struct HostModel {
    log: Log,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl StepModel<HostBackend<f32>> for HostModel {
    fn qkv(
        &mut self,
        _backend: &HostBackend<f32>,
        layer: usize,
        batch: &Batch,
    ) -> Result<LayerQkv<'_, [f32]>, EngineError> {
        (self.q, self.k, self.v) = project(batch, layer);
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

/// The same model with its projections in one fused emulated "device" buffer per layer:
/// `[tokens][q heads | k heads | v heads]`, passed to the backend as strided row views.
#[derive(Debug, Default)]
struct RawModel {
    log: Log,
    fused: Option<EmuBuf>,
    views: Option<[DeviceRows; 3]>,
}

impl StepModel<RawBackend<EmuDevice>> for RawModel {
    fn qkv(
        &mut self,
        _backend: &RawBackend<EmuDevice>,
        layer: usize,
        batch: &Batch,
    ) -> Result<LayerQkv<'_, DeviceRows>, EngineError> {
        let (q, k, v) = project(batch, layer);
        let tokens = batch.num_tokens();
        let row = (HEADS + 2 * KV_HEADS) * HEAD_DIM;
        let mut fused = vec![0f32; tokens * row];
        for t in 0..tokens {
            let r = &mut fused[t * row..(t + 1) * row];
            let (qd, kd) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
            r[..qd].copy_from_slice(&q[t * qd..(t + 1) * qd]);
            r[qd..qd + kd].copy_from_slice(&k[t * kd..(t + 1) * kd]);
            r[qd + kd..].copy_from_slice(&v[t * kd..(t + 1) * kd]);
        }
        let buf = EmuBuf::from_slice(&fused).expect("guarded allocation");
        let base = buf.ptr() as usize as u64;
        let parts = [HEADS, KV_HEADS, KV_HEADS];
        let view = |part| DeviceRows {
            rows: Rows::fused(base, &parts, part, HEAD_DIM, 4).expect("in range"),
            tokens,
        };
        self.views = Some([view(0), view(1), view(2)]);
        self.fused = Some(buf);
        let [query, key, value] = self.views.as_ref().expect("just set");
        Ok(LayerQkv { query, key, value })
    }

    fn attended(
        &mut self,
        layer: usize,
        batch: &Batch,
        out: &DeviceRows,
    ) -> Result<(), EngineError> {
        assert_eq!(out.rows.token_stride, HEADS * HEAD_DIM);
        let len = out.tokens * out.rows.token_stride;
        // SAFETY: under the emulation a device pointer is a host pointer; the backend's output
        // buffer holds at least `tokens` dense rows of f32 (its capacity), written by the
        // attention launch that completed before `decode`/`prefill` returned, and not written
        // again until the next launch, after this call.
        let host = unsafe { std::slice::from_raw_parts(out.rows.ptr as usize as *const f32, len) };
        self.log.attended(layer, batch, host);
        Ok(())
    }

    fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError> {
        self.log.sample(batch, out);
        Ok(())
    }
}

fn engine_config(preemption: PreemptionMode) -> EngineConfig {
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

const PAGES: u32 = 24;
const TOKENS_PER_PAGE: usize = 16;

fn shared() -> Arc<SharedArena> {
    let page_bytes = page_bytes_for(&[shape()], TOKENS_PER_PAGE).unwrap();
    SharedArena::host(BudgetConfig::new(1, 96, PAGES), page_bytes).unwrap()
}

fn requests() -> Vec<SeqRequest> {
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

struct Run {
    log: Log,
    outputs: Vec<(u64, Vec<u32>)>,
    pages_moved: u64,
    caps: Option<RawCaps>,
}

fn run_host(preemption: PreemptionMode) -> Run {
    let shared = shared();
    let mut engine = Engine::host(&shared, engine_config(preemption), &shape(), HEADS).unwrap();
    let mut model = HostModel::default();
    let (outputs, pages_moved) = drive(&mut engine, &mut model);
    Run {
        log: model.log,
        outputs,
        pages_moved,
        caps: None,
    }
}

fn run_raw(preemption: PreemptionMode) -> Run {
    // The arena's bytes are the caller's: one guarded emulated allocation (an overrun past the
    // last page faults at once), behind an arena of pool and coordinator only.
    let page_bytes = page_bytes_for(&[shape()], TOKENS_PER_PAGE).unwrap();
    let shared = SharedArena::external(BudgetConfig::new(1, 96, PAGES), page_bytes).unwrap();
    assert!(shared.host_arena().is_none());
    let arena = EmuBuf::zeroed(PAGES as usize * page_bytes).expect("guarded allocation");
    let base = arena.ptr() as usize as u64;
    // SAFETY: under the emulation "device" memory is host memory: `arena` holds the pool's
    // PAGES pages of page_bytes (alive until after the engine is dropped below), and this
    // engine is the only user of it.
    let mut engine = unsafe {
        Engine::raw(
            &shared,
            EmuDevice::new(8),
            base,
            engine_config(preemption),
            &shape(),
            HEADS,
        )
    }
    .unwrap();
    let mut model = RawModel::default();
    let (outputs, pages_moved) = drive(&mut engine, &mut model);
    let caps = engine.backend().caps();
    drop(engine);
    drop(arena);
    Run {
        log: model.log,
        outputs,
        pages_moved,
        caps: Some(caps),
    }
}

fn drive<B: KvBackend, M: StepModel<B>>(
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

fn compare(host: &Run, raw: &Run) {
    assert_eq!(host.log.batches.len(), raw.log.batches.len(), "step counts");
    for (i, (h, r)) in host.log.batches.iter().zip(&raw.log.batches).enumerate() {
        assert_eq!(h, r, "step {i}: the batches differ");
    }
    assert_eq!(host.log.outputs.len(), raw.log.outputs.len());
    for (i, (h, r)) in host.log.outputs.iter().zip(&raw.log.outputs).enumerate() {
        assert_eq!(h.len(), r.len(), "output {i}: lengths");
        for (j, (&a, &b)) in h.iter().zip(r).enumerate() {
            assert!(
                a.is_finite() && b.is_finite() && (a - b).abs() <= 1e-4 + 1e-4 * a.abs(),
                "step/layer output {i}, element {j}: CPU {a} vs emulated CUDA {b}"
            );
        }
    }
    assert_eq!(host.outputs, raw.outputs, "generated tokens");
    assert_eq!(host.outputs.len(), 7, "every sequence finished");
}

/// Rows that run a sequence from a position it had already passed (a resume by recompute
/// after preemption).
fn recomputed_rows(log: &Log) -> usize {
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

#[test]
fn raw_backend_matches_host_backend_with_recompute() {
    let host = run_host(PreemptionMode::Recompute);
    let raw = run_raw(PreemptionMode::Recompute);
    compare(&host, &raw);
    let again = recomputed_rows(&host.log);
    assert!(
        again > 0,
        "the workload must preempt for this test to mean anything"
    );
    println!(
        "recompute: {} steps, {again} resumed rows, {} attention outputs compared, buffers {:?}",
        host.log.batches.len(),
        host.log.outputs.len(),
        raw.caps
    );
}

#[test]
fn raw_backend_matches_host_backend_with_swap() {
    let host = run_host(PreemptionMode::Swap);
    let raw = run_raw(PreemptionMode::Swap);
    assert!(
        host.pages_moved > 0,
        "the workload must swap pages for this test to mean anything"
    );
    assert_eq!(host.pages_moved, raw.pages_moved);
    compare(&host, &raw);
    println!(
        "swap: {} steps, {} pages swapped",
        host.log.batches.len(),
        raw.pages_moved
    );
}

#[test]
fn raw_backend_grows_its_buffers_for_a_larger_batch() {
    let shared = shared();
    let arena = shared.host_arena().unwrap().clone();
    let cfg = engine_config(PreemptionMode::Recompute);
    let config = shape()
        .config(TOKENS_PER_PAGE, PAGES as usize)
        .unwrap()
        .with_page_stride(shared.page_bytes())
        .unwrap();
    let small = RawCaps {
        max_seqs: 1,
        max_tokens: 1,
        max_blocks_per_seq: 1,
        max_copies: 0,
    };
    // SAFETY: as in run_raw.
    let backend = unsafe {
        RawBackend::new(
            EmuDevice::new(8),
            arena.base_ptr() as usize as u64,
            &config,
            HEADS,
            small,
            4,
        )
    }
    .unwrap();
    let mut engine = Engine::new(&shared, cfg, backend).unwrap();
    let mut model = RawModel::default();
    let (raw_out, _) = drive(&mut engine, &mut model);
    let caps = engine.backend().caps();
    assert!(caps.max_tokens > 1 && caps.max_seqs > 1 && caps.max_blocks_per_seq > 1);
    let host = run_host(PreemptionMode::Recompute);
    assert_eq!(host.outputs, raw_out);
}

#[test]
fn external_arena_refuses_bad_sizes() {
    for (pages, page_bytes) in [(0, 4096), (4, 0), (4, 4100)] {
        let err = SharedArena::external(BudgetConfig::new(1, 96, pages), page_bytes).unwrap_err();
        assert!(!err.to_string().is_empty());
    }
}

#[test]
fn raw_backend_refuses_bad_rows_and_bad_capacities() {
    let shared = shared();
    let arena = shared.host_arena().unwrap().clone();
    let config = shape()
        .config(TOKENS_PER_PAGE, PAGES as usize)
        .unwrap()
        .with_page_stride(shared.page_bytes())
        .unwrap();
    let zero = RawCaps {
        max_seqs: 0,
        max_tokens: 1,
        max_blocks_per_seq: 1,
        max_copies: 0,
    };
    // SAFETY: as in run_raw (nothing launches: construction fails).
    let err = unsafe {
        RawBackend::new(
            EmuDevice::new(8),
            arena.base_ptr() as usize as u64,
            &config,
            HEADS,
            zero,
            4,
        )
    }
    .unwrap_err();
    assert!(matches!(err, EngineError::InvalidConfig(_)), "{err}");
    // SAFETY: as in run_raw (3 query heads do not divide 2 KV heads: refused first).
    let err = unsafe {
        RawBackend::new(
            EmuDevice::new(8),
            arena.base_ptr() as usize as u64,
            &config,
            3,
            RawCaps::for_engine(&engine_config(PreemptionMode::Swap), TOKENS_PER_PAGE, PAGES),
            4,
        )
    }
    .unwrap_err();
    assert!(matches!(err, EngineError::InvalidConfig(_)), "{err}");

    // A model that hands the backend the wrong number of rows is refused with a typed error,
    // and the engine's step fails instead of launching.
    #[derive(Debug, Default)]
    struct ShortRows(RawModel);
    impl StepModel<RawBackend<EmuDevice>> for ShortRows {
        fn qkv(
            &mut self,
            backend: &RawBackend<EmuDevice>,
            layer: usize,
            batch: &Batch,
        ) -> Result<LayerQkv<'_, DeviceRows>, EngineError> {
            self.0.qkv(backend, layer, batch)?;
            let views = self.0.views.as_mut().expect("set by qkv");
            views[1].tokens -= 1;
            let [query, key, value] = &*views;
            Ok(LayerQkv { query, key, value })
        }
        fn attended(
            &mut self,
            layer: usize,
            batch: &Batch,
            out: &DeviceRows,
        ) -> Result<(), EngineError> {
            self.0.attended(layer, batch, out)
        }
        fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError> {
            self.0.sample(batch, out)
        }
    }
    // SAFETY: as in run_raw.
    let mut engine = unsafe {
        Engine::raw(
            &shared,
            EmuDevice::new(8),
            arena.base_ptr() as usize as u64,
            engine_config(PreemptionMode::Recompute),
            &shape(),
            HEADS,
        )
    }
    .unwrap();
    engine.add(requests().remove(0)).unwrap();
    let err = engine.step(&mut ShortRows::default()).unwrap_err();
    assert!(err.to_string().contains("key"), "{err}");
}
