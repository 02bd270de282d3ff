//! The engine loop on the raw-pointer device backend (`engine::RawBackend`), on the CUDA
//! kernels' CPU emulation (feature `cuda-emu`), against the same engine on the CPU kernels
//! (`HostBackend`), with the workload of tests/support/engine_workload.rs: every step's batch
//! must be the same, every layer's attention output must match within float tolerance, and the
//! generated tokens must be identical. With swap preemption, pages move through the raw
//! backend's `swap_blocks` and come back; with recompute, sequences are rebuilt by prefill.
//! The model hands the backend q, k and v as strided views of one fused buffer. The same on a
//! GPU, through pagedkv's own `Gpu` as the `RawDevice`, is tests/cuda_raw_engine.rs.
#![cfg(all(feature = "cuda-emu", not(feature = "cuda")))]

#[path = "support/engine_workload.rs"]
mod engine_workload;

use engine_workload::*;
use pagedkv::budget::BudgetConfig;
use pagedkv::cuda_emu::{EmuBuf, EmuDevice};
use pagedkv::cuda_raw::Rows;
use pagedkv::engine::{
    DeviceRows, Engine, KvBackend, LayerQkv, RawBackend, RawCaps, SharedArena, StepModel,
};
use pagedkv::error::EngineError;
use pagedkv::kv::{page_bytes_for, KvDtype, ModelKvShape};
use pagedkv::sched::{Batch, PreemptionMode};

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
        backend: &RawBackend<EmuDevice>,
        layer: usize,
        batch: &Batch,
    ) -> Result<LayerQkv<'_, DeviceRows>, EngineError> {
        let h = heads_of(backend);
        let fused = fused_qkv(batch, layer, h);
        let tokens = batch.num_tokens();
        let buf = EmuBuf::from_slice(&fused).expect("guarded allocation");
        let base = buf.ptr() as usize as u64;
        let view = |part| DeviceRows {
            rows: Rows::fused(base, &fused_parts(h), part, h.d, 4).expect("in range"),
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
    // Swap space (pinned host memory on a device) only where the engine swaps.
    let swap_pages = match preemption {
        PreemptionMode::Swap => engine_config(preemption).swap_blocks as usize,
        PreemptionMode::Recompute => 0,
    };
    assert_eq!(engine.backend().swap_slots(), Some(swap_pages));
    // The swap run's attention as programmatic dependent launches: the same outputs.
    let programmatic = matches!(preemption, PreemptionMode::Swap);
    engine.set_programmatic_launch(programmatic);
    assert_eq!(engine.backend().programmatic_launch(), programmatic);
    let mut model = RawModel::default();
    let (outputs, pages_moved) = drive(&mut engine, &mut model);
    let caps = engine.backend().caps();
    drop(engine);
    drop(arena);
    println!("raw backend buffers at the end: {caps:?}");
    Run {
        log: model.log,
        outputs,
        pages_moved,
    }
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
        "recompute: {} steps, {again} resumed rows, {} attention outputs compared",
        host.log.batches.len(),
        host.log.outputs.len()
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

/// A raw backend over the emulated device on `shared`'s host arena (the "device" memory under
/// the emulation), with the workload's geometry.
fn emu_backend(
    shared: &SharedArena,
    heads: usize,
    caps: RawCaps,
) -> Result<RawBackend<EmuDevice>, EngineError> {
    let arena = shared.host_arena().expect("a host arena");
    let config = shape()
        .config(TOKENS_PER_PAGE, PAGES as usize)?
        .with_page_stride(shared.page_bytes())?;
    // SAFETY: under the emulation "device" memory is host memory: the arena holds the pool's
    // pages (alive as long as `shared`, which every caller keeps past the backend), and each
    // test's engine is the arena's only user.
    unsafe {
        RawBackend::new(
            EmuDevice::new(8),
            arena.base_ptr() as usize as u64,
            &config,
            heads,
            caps,
            4,
        )
    }
}

#[test]
fn raw_backend_grows_its_buffers_for_a_larger_batch() {
    let shared = shared();
    let cfg = engine_config(PreemptionMode::Recompute);
    let small = RawCaps {
        max_seqs: 1,
        max_tokens: 1,
        max_blocks_per_seq: 1,
        max_copies: 0,
    };
    let backend = emu_backend(&shared, HEADS, small).unwrap();
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
    let zero = RawCaps {
        max_seqs: 0,
        max_tokens: 1,
        max_blocks_per_seq: 1,
        max_copies: 0,
    };
    let err = emu_backend(&shared, HEADS, zero).unwrap_err();
    assert!(matches!(err, EngineError::InvalidConfig(_)), "{err}");
    // 3 query heads do not divide 2 KV heads: refused first.
    let caps = RawCaps::for_engine(&engine_config(PreemptionMode::Swap), TOKENS_PER_PAGE, PAGES);
    let err = emu_backend(&shared, 3, caps).unwrap_err();
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

/// A batch the backend must refuse before anything reaches the device is refused with a typed
/// error naming the problem, and the backend serves the next good batch as if nothing happened.
#[test]
fn raw_backend_refuses_malformed_batches_and_stays_usable() {
    let shared = shared();
    let caps = RawCaps::for_engine(&engine_config(PreemptionMode::Swap), TOKENS_PER_PAGE, PAGES);
    let mut backend = emu_backend(&shared, HEADS, caps).unwrap();
    // Two sequences: a 3-token prefill chunk (context 3) and one decode token (context 18).
    let good = Batch {
        seq_ids: vec![1, 2],
        input_tokens: vec![4, 5, 6, 7],
        positions: vec![0, 1, 2, 17],
        query_start_loc: vec![0, 3, 4],
        context_lens: vec![3, 18],
        slot_mapping: vec![0, 1, 2, 16 * 3 + 1],
        block_tables: vec![0, -1, 2, 3],
        max_blocks_per_seq: 2,
        ..Batch::default()
    };
    backend.begin(&good).unwrap();
    backend.end().unwrap();
    let bad = |f: &dyn Fn(&mut Batch)| {
        let mut b = good.clone();
        f(&mut b);
        b
    };
    let cases: Vec<(&str, Batch)> = vec![
        (
            "a block outside the pool",
            bad(&|b| b.block_tables[2] = PAGES as i32),
        ),
        (
            "a slot outside the cache",
            bad(&|b| b.slot_mapping[1] = 1 << 40),
        ),
        ("a context past its row", bad(&|b| b.context_lens[1] = 33)),
        (
            "query starts out of order",
            bad(&|b| b.query_start_loc = vec![0, 5, 4]),
        ),
        (
            "query starts short",
            bad(&|b| b.query_start_loc = vec![0, 3]),
        ),
        (
            "a context per row",
            bad(&|b| {
                b.context_lens.push(1);
                b.block_tables.extend([4, 5]);
            }),
        ),
        (
            "a slot per token",
            bad(&|b| {
                b.slot_mapping.pop();
            }),
        ),
    ];
    for (what, batch) in &cases {
        let err = backend.begin(batch).unwrap_err();
        assert!(
            matches!(err, EngineError::Attn(_)),
            "{what}: expected a kernel-contract error, got {err}"
        );
        // Attention without a successful begin is refused, not run on stale metadata.
        let rows = DeviceRows {
            rows: Rows::dense(16, HEADS, HEAD_DIM),
            tokens: batch.num_tokens(),
        };
        assert!(
            backend.decode(0, &rows, batch).is_err(),
            "{what}: decode ran"
        );
    }
    backend.begin(&good).unwrap();
    backend.end().unwrap();
}

/// Steps two engines in lockstep (A, then B, each step) until both are done; their
/// generations, sorted by request.
fn drive_pair<B: pagedkv::engine::KvBackend, M: StepModel<B>>(
    a: (&mut Engine<B>, &mut M),
    b: (&mut Engine<B>, &mut M),
) -> [Vec<(u64, Vec<u32>)>; 2] {
    let mut engines = [a, b];
    for (engine, _) in engines.iter_mut() {
        for r in requests() {
            engine.add(r).unwrap();
        }
    }
    let mut outputs = [Vec::new(), Vec::new()];
    let mut steps = 0;
    while engines.iter().any(|(e, _)| e.has_work()) {
        steps += 1;
        assert!(steps < 4_000, "the workload did not finish");
        for ((engine, model), out) in engines.iter_mut().zip(outputs.iter_mut()) {
            engine.step(&mut **model).unwrap();
            out.extend(engine.finished().iter().map(|f| (f.id, f.output.clone())));
        }
    }
    for out in &mut outputs {
        out.sort();
    }
    outputs
}

/// Two models of different geometry on one arena, each through its own raw backend (model A:
/// GQA 4/2, d64, two layers, 16 tokens per page; model B: MQA 2/1, d128, one layer, 32 tokens
/// per page), against the same pair on host backends over a host arena: every step's batch,
/// attention output and generated token of each model match, and the two models' block tables
/// name common pages (pages freed by one were written and read by the other).
#[test]
fn two_models_share_one_arena_through_raw_backends() {
    let a = shape();
    let b = ModelKvShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 128,
        dtype: KvDtype::F32,
    };
    let (heads_a, heads_b) = (HEADS_DEFAULT.q, 2);
    let page_bytes = page_bytes_for(&[a, b], TOKENS_PER_PAGE).unwrap();
    let budget = BudgetConfig::new(2, 96, PAGES);
    let cfg = || engine_config(PreemptionMode::Recompute);

    let host = SharedArena::host(budget, page_bytes).unwrap();
    let mut host_a = Engine::host(&host, cfg(), &a, heads_a).unwrap();
    let mut host_b = Engine::host(&host, cfg(), &b, heads_b).unwrap();
    assert_ne!(host_a.tokens_per_page(), host_b.tokens_per_page());
    let (mut ma, mut mb) = (HostModel::default(), HostModel::default());
    let host_out = drive_pair((&mut host_a, &mut ma), (&mut host_b, &mut mb));
    let host_logs = [ma.into_log(), mb.into_log()];

    let raw = SharedArena::external(budget, page_bytes).unwrap();
    let arena = EmuBuf::zeroed(PAGES as usize * page_bytes).expect("guarded allocation");
    let base = arena.ptr() as usize as u64;
    // SAFETY: `arena` holds the pool's pages (alive until after both engines are dropped
    // below); the two engines are its only users and share it through `raw`'s pool.
    let (mut raw_a, mut raw_b) = unsafe {
        (
            Engine::raw(&raw, EmuDevice::new(8), base, cfg(), &a, heads_a).unwrap(),
            Engine::raw(&raw, EmuDevice::new(8), base, cfg(), &b, heads_b).unwrap(),
        )
    };
    let (mut ra, mut rb) = (RawModel::default(), RawModel::default());
    let raw_out = drive_pair((&mut raw_a, &mut ra), (&mut raw_b, &mut rb));
    drop((raw_a, raw_b));
    drop(arena);

    for (m, (h, r)) in host_logs.iter().zip([&ra.log, &rb.log]).enumerate() {
        compare_logs(h, r);
        assert_eq!(host_out[m], raw_out[m], "model {m}: generated tokens");
        assert_eq!(host_out[m].len(), 7, "model {m}: every sequence finished");
    }
    let shared_pages = host_logs[0].pages.intersection(&host_logs[1].pages).count();
    assert!(shared_pages > 0, "the two models never used a common page");
    println!(
        "two models: {} and {} steps, {shared_pages} pages used by both",
        host_logs[0].batches.len(),
        host_logs[1].batches.len()
    );
}

/// An engine that may run more sequences at once than a decode plan takes (65535) is refused
/// when built: its capacities are clamped to the plan's limit, so it was built, and its first
/// step past 65535 sequences failed instead.
#[test]
fn raw_engines_running_more_sequences_than_a_plan_takes_are_refused() {
    let page_bytes = page_bytes_for(&[shape()], TOKENS_PER_PAGE).unwrap();
    let shared = SharedArena::external(BudgetConfig::new(1, 96, PAGES), page_bytes).unwrap();
    let arena = EmuBuf::zeroed(PAGES as usize * page_bytes).expect("guarded allocation");
    let base = arena.ptr() as usize as u64;
    for (max_running, ok) in [(65_535, true), (65_536, false), (u32::MAX, false)] {
        let mut cfg = engine_config(PreemptionMode::Recompute);
        cfg.max_running = max_running;
        // SAFETY: under the emulation "device" memory is host memory: `arena` holds the pool's
        // PAGES pages of page_bytes, alive until after the engine, its only user, is dropped.
        let r = unsafe { Engine::raw(&shared, EmuDevice::new(8), base, cfg, &shape(), HEADS) };
        match r {
            Ok(_) => assert!(ok, "max_running {max_running} accepted"),
            Err(e) => assert!(
                !ok && matches!(e, EngineError::InvalidConfig(ref m) if m.contains("65535")),
                "max_running {max_running}: {e}"
            ),
        }
    }
    drop(arena);
}

/// An engine whose prefill rows may be longer than a prefill launch takes is refused when
/// built. The launch's row tiles (`max_query_len x group` rows, 32 a tile for f32) must fit
/// grid y (65535): with 64 query heads on one KV head, 32767 tokens. An engine whose
/// `max_prefill_chunk`, `max_batched_tokens` and `max_context` all allow 32768-token rows was
/// built, and every step prefilling a full chunk failed (`OverCapacity`) for as long as such
/// a prompt waited: a configuration no step could serve, found only at run time.
#[test]
fn raw_engines_whose_prefill_chunks_pass_the_launch_limit_are_refused() {
    use pagedkv::error::RawError;
    let mqa = ModelKvShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 64,
        dtype: KvDtype::F32,
    };
    let heads = 64;
    let limit = 65_535 * 32 / heads; // 32767 tokens
    let pages = (limit as u32 + 1).div_ceil(TOKENS_PER_PAGE as u32) + 1;
    let page_bytes = page_bytes_for(&[mqa], TOKENS_PER_PAGE).unwrap();
    let shared = SharedArena::external(BudgetConfig::new(1, 1 << 16, pages), page_bytes).unwrap();
    let arena = EmuBuf::zeroed(pages as usize * page_bytes).expect("guarded allocation");
    let base = arena.ptr() as usize as u64;
    let config = |chunk: u32| {
        let mut cfg = engine_config(PreemptionMode::Recompute);
        cfg.max_running = 1;
        cfg.max_prefill_chunk = chunk;
        cfg.max_batched_tokens = chunk;
        cfg.max_context = chunk + 16;
        cfg
    };

    // What such an engine's backend does with a full chunk: refused at the launch.
    let cfg = mqa
        .config(TOKENS_PER_PAGE, pages as usize)
        .unwrap()
        .with_page_stride(page_bytes)
        .unwrap();
    let caps = RawCaps::for_engine(&config(limit as u32 + 1), TOKENS_PER_PAGE, pages);
    // SAFETY: `arena` holds the pool's pages; the batch below names pages of it only, and the
    // query rows are refused before any launch reads them.
    let mut backend =
        unsafe { RawBackend::new(EmuDevice::new(8), base, &cfg, heads, caps, 0) }.unwrap();
    let n = limit + 1;
    let blocks = n.div_ceil(TOKENS_PER_PAGE);
    let batch = Batch {
        seq_ids: vec![1],
        input_tokens: vec![1; n],
        positions: (0..n as i32).collect(),
        query_start_loc: vec![0, n as i32],
        context_lens: vec![n as i32],
        slot_mapping: (0..n as i64).collect(),
        block_tables: (0..blocks as i32).collect(),
        max_blocks_per_seq: blocks,
        ..Batch::default()
    };
    backend.begin(&batch).unwrap();
    let query = DeviceRows {
        rows: Rows::dense(base, heads, 64),
        tokens: n,
    };
    let err = backend.prefill(0, &query, &batch).unwrap_err();
    assert!(
        matches!(err, EngineError::Raw(RawError::OverCapacity { .. })),
        "{err}"
    );
    backend.end().unwrap();
    drop(backend);

    for (chunk, ok) in [(limit as u32, true), (limit as u32 + 1, false)] {
        // SAFETY: nothing is launched (the engines are only built): the arena is never used.
        let r =
            unsafe { Engine::raw(&shared, EmuDevice::new(8), base, config(chunk), &mqa, heads) };
        match r {
            Ok(_) => assert!(ok, "a max_prefill_chunk of {chunk} accepted"),
            Err(e) => assert!(
                !ok && matches!(e, EngineError::InvalidConfig(ref m) if m.contains("prefill")),
                "max_prefill_chunk {chunk}: {e}"
            ),
        }
    }
    drop(arena);
}
