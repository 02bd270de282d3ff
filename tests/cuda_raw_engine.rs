//! The engine loop on the raw-pointer device backend (`engine::RawBackend`) on a GPU, with
//! pagedkv's own `Gpu` as the `RawDevice` and the arena in one `cuMemAlloc` allocation behind
//! `SharedArena::external`, against the same engine on the CPU kernels, with the workload of
//! tests/support/engine_workload.rs (the emulated twin is tests/cuda_emu_engine.rs): identical
//! batches and generations, every attention output within float tolerance, through chunked
//! prefill and preemption by recompute and by swap. The model hands the backend q, k and v as
//! strided views of one fused device buffer.
//!
//! Without a GPU each test prints `SKIP` and passes; with `PAGEDKV_REQUIRE_GPU=1` it fails.
#![cfg(feature = "cuda")]

#[path = "support/engine_workload.rs"]
mod engine_workload;

use engine_workload::*;
use pagedkv::budget::BudgetConfig;
use pagedkv::cuda::Gpu;
use pagedkv::cuda_raw::{DevPtr, Rows};
use pagedkv::engine::{
    DeviceRows, Engine, LayerQkv, RawBackend, RawDevice, SharedArena, StepModel,
};
use pagedkv::error::EngineError;
use pagedkv::kv::page_bytes_for;
use pagedkv::sched::{Batch, PreemptionMode};

#[path = "support/gpu.rs"]
mod gpu_support;
use gpu_support::gpu;

/// Device memory freed (after the stream is idle) on drop.
struct DeviceAlloc {
    gpu: Gpu,
    ptr: DevPtr,
}

impl DeviceAlloc {
    fn new(gpu: &Gpu, bytes: usize) -> Self {
        let ptr = RawDevice::alloc(gpu, bytes).expect("device allocation");
        Self {
            gpu: gpu.clone(),
            ptr,
        }
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        if RawDevice::synchronize(&self.gpu).is_ok() {
            // SAFETY: allocated by this Gpu, freed once, and the stream is idle.
            unsafe { RawDevice::free(&self.gpu, self.ptr) };
        }
    }
}

/// The workload's model on the GPU: each layer's fused projections copied into one device
/// buffer (on the backend's stream, so in order with its kernels), the attention output read
/// back to the host for the log.
struct GpuModel {
    log: Log,
    gpu: Gpu,
    fused: DeviceAlloc,
    /// This step's host copies of each layer's projections: kept until the step has ended
    /// (the backend waits for the stream at the end of every step).
    staging: Vec<Vec<f32>>,
    views: Option<[DeviceRows; 3]>,
    host_out: Vec<f32>,
}

impl GpuModel {
    fn new(gpu: &Gpu, max_tokens: usize) -> Self {
        let row = fused_parts(HEADS_DEFAULT).iter().sum::<usize>() * HEAD_DIM;
        Self {
            log: Log::default(),
            gpu: gpu.clone(),
            fused: DeviceAlloc::new(gpu, max_tokens * row * 4),
            staging: Vec::new(),
            views: None,
            host_out: Vec::new(),
        }
    }
}

impl StepModel<RawBackend<Gpu>> for GpuModel {
    fn qkv(
        &mut self,
        _backend: &RawBackend<Gpu>,
        layer: usize,
        batch: &Batch,
    ) -> Result<LayerQkv<'_, DeviceRows>, EngineError> {
        if layer == 0 {
            self.staging.clear();
        }
        self.staging.push(fused_qkv(batch, layer, HEADS_DEFAULT));
        let host = self.staging.last().expect("just pushed");
        // SAFETY: the buffer holds max_tokens fused rows (a step has at most that many
        // tokens); `host` stays in `staging`, unmodified, until the next step's layer 0, after
        // the backend's end of this step waited for the stream.
        unsafe { RawDevice::copy_to_device(&self.gpu, self.fused.ptr, bytemuck_f32(host)) }?;
        let tokens = batch.num_tokens();
        let view = |part| DeviceRows {
            rows: Rows::fused(
                self.fused.ptr,
                &fused_parts(HEADS_DEFAULT),
                part,
                HEAD_DIM,
                4,
            )
            .expect("in range"),
            tokens,
        };
        self.views = Some([view(0), view(1), view(2)]);
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
        self.host_out
            .resize(out.tokens * out.rows.token_stride, f32::NAN);
        // SAFETY: `out` is the backend's output buffer of at least that many f32 on this
        // context, written by the attention launch queued before on the same stream; the
        // host slice is ours; the synchronize below completes the copy before it is read.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                &mut self.host_out,
                out.rows.ptr,
                self.gpu.stream().cu_stream(),
            )
        }
        .map_err(|e| EngineError::Model(format!("{e}")))?;
        RawDevice::synchronize(&self.gpu)?;
        self.log.attended(layer, batch, &self.host_out);
        Ok(())
    }

    fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError> {
        self.log.sample(batch, out);
        Ok(())
    }
}

fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: any f32 slice is a valid byte slice of 4x its length (no padding, alignment 1).
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

fn run_gpu(gpu: &Gpu, preemption: PreemptionMode) -> Run {
    let page_bytes = page_bytes_for(&[shape()], TOKENS_PER_PAGE).unwrap();
    let shared = SharedArena::external(BudgetConfig::new(1, 96, PAGES), page_bytes).unwrap();
    let bytes = PAGES as usize * page_bytes;
    let arena = DeviceAlloc::new(gpu, bytes);
    // SAFETY: the arena was just allocated with `bytes` bytes on this context.
    unsafe {
        cudarc::driver::result::memset_d8_async(arena.ptr, 0, bytes, gpu.stream().cu_stream())
    }
    .unwrap();
    let cfg = engine_config(preemption);
    let mut model = GpuModel::new(gpu, cfg.max_batched_tokens as usize);
    // SAFETY: `arena` is the pool's PAGES pages of page_bytes on the Gpu's context, alive
    // until after the engine is dropped below; this engine is its only user.
    let mut engine =
        unsafe { Engine::raw(&shared, gpu.clone(), arena.ptr, cfg, &shape(), HEADS) }.unwrap();
    // The swap run's attention as programmatic dependent launches, each over its layer's cache
    // write (compute capability 9.0+): the same outputs as the host backend's.
    engine.set_programmatic_launch(matches!(preemption, PreemptionMode::Swap));
    // Swap space only under swap preemption, pinned unless the device refused (said, not
    // asserted: a locked-memory limit is the machine's, and the swaps are right either way).
    let swap = engine.backend().swap_space().map(|s| s.total_bytes());
    assert_eq!(swap.is_some(), matches!(preemption, PreemptionMode::Swap));
    println!(
        "{preemption:?}: swap space {swap:?} bytes, pinned: {}",
        engine.backend().swap_pinned()
    );
    let (outputs, pages_moved) = drive(&mut engine, &mut model);
    drop(engine);
    drop(arena);
    Run {
        log: model.log,
        outputs,
        pages_moved,
    }
}

#[test]
fn gpu_raw_backend_matches_host_backend_with_recompute() {
    let Some(gpu) = gpu("gpu_raw_backend_matches_host_backend_with_recompute") else {
        return;
    };
    let host = run_host(PreemptionMode::Recompute);
    let raw = run_gpu(&gpu, PreemptionMode::Recompute);
    compare(&host, &raw);
    assert!(recomputed_rows(&host.log) > 0, "the workload must preempt");
}

#[test]
fn gpu_raw_backend_matches_host_backend_with_swap() {
    let Some(gpu) = gpu("gpu_raw_backend_matches_host_backend_with_swap") else {
        return;
    };
    let host = run_host(PreemptionMode::Swap);
    let raw = run_gpu(&gpu, PreemptionMode::Swap);
    assert!(host.pages_moved > 0, "the workload must swap");
    assert_eq!(host.pages_moved, raw.pages_moved);
    compare(&host, &raw);
}
