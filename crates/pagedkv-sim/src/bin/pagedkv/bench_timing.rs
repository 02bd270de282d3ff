//! The three ways `pagedkv bench gpu` times a point (what each means: pagedkv_sim::gpu_bench):
//! CUDA-graph replay of N launches, N back-to-back launches between one event pair, and one
//! launch per event pair. `call(i)` queues launch `i` (on input copy `i % copies`) on the
//! [`Gpu`]'s stream and must not allocate: it is also captured into a graph.

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaEvent, CudaGraph};
use pagedkv::cuda::Gpu;
use pagedkv::error::CudaError;
use pagedkv_sim::gpu_bench::{median, Timing};

pub type BoxErr = Box<dyn std::error::Error>;

/// How many launches and repetitions one point gets.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Distinct input copies the launches cycle through.
    pub copies: usize,
    /// Launches per graph / back-to-back timing (a whole number of rotations).
    pub launches: usize,
    /// Graph replays and back-to-back runs; the median is reported.
    pub reps: usize,
    /// One-call timings; the median is reported.
    pub one_call_iters: usize,
    /// Untimed launches first (at least one per copy).
    pub warmup: usize,
}

/// A pair of timing events on the bench's stream.
pub struct Clock<'g> {
    gpu: &'g Gpu,
    start: CudaEvent,
    end: CudaEvent,
}

impl<'g> Clock<'g> {
    pub fn new(gpu: &'g Gpu) -> Result<Self, BoxErr> {
        let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
        Ok(Self {
            gpu,
            start: gpu.context().new_event(flags)?,
            end: gpu.context().new_event(flags)?,
        })
    }

    /// Milliseconds between events recorded before and after what `f` queues.
    pub fn span_ms(&self, f: impl FnOnce() -> Result<(), BoxErr>) -> Result<f64, BoxErr> {
        let stream = self.gpu.stream();
        self.start.record(stream)?;
        f()?;
        self.end.record(stream)?;
        self.end.synchronize()?;
        Ok(f64::from(self.start.elapsed_ms(&self.end)?))
    }
}

/// Times `call` the three ways (microseconds per call).
pub fn time_point(
    clock: &Clock<'_>,
    plan: &Plan,
    call: &mut dyn FnMut(usize) -> Result<(), CudaError>,
) -> Result<Timing, BoxErr> {
    let gpu = clock.gpu;
    // Every copy once (first touch, lazily grown workspaces, the launchers' one-time function
    // attributes), before any timing and before the capture, which must not allocate.
    for i in 0..plan.copies.max(plan.warmup) {
        call(i)?;
    }
    gpu.synchronize()?;

    let mut one = Vec::with_capacity(plan.one_call_iters);
    for i in 0..plan.one_call_iters.max(1) {
        one.push(1e3 * clock.span_ms(|| Ok(call(i)?))?);
    }

    let n = plan.launches.max(1);
    let mut b2b = Vec::with_capacity(plan.reps);
    for _ in 0..plan.reps.max(1) {
        let ms = clock.span_ms(|| {
            for i in 0..n {
                call(i)?;
            }
            Ok(())
        })?;
        b2b.push(1e3 * ms / n as f64);
    }

    let graph = capture(gpu, n, call)?;
    graph.launch()?; // the first replay uploads the graph
    gpu.synchronize()?;
    let mut replay = Vec::with_capacity(plan.reps);
    for _ in 0..plan.reps.max(1) {
        replay.push(1e3 * clock.span_ms(|| Ok(graph.launch()?))? / n as f64);
    }

    let med = |v: &mut Vec<f64>| median(v).ok_or("no timing samples");
    Ok(Timing {
        graph_us: med(&mut replay)?,
        b2b_us: med(&mut b2b)?,
        one_us: med(&mut one)?,
        copies: plan.copies,
    })
}

/// Captures launches `0..n` into a graph. Relaxed mode: the launchers query device attributes
/// and set function attributes, which the stricter modes may refuse while capturing. The capture
/// is always ended, also when a launch fails, so the stream stays usable.
fn capture(
    gpu: &Gpu,
    n: usize,
    call: &mut dyn FnMut(usize) -> Result<(), CudaError>,
) -> Result<CudaGraph, BoxErr> {
    let stream = gpu.stream();
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
    let mut queued = Ok(());
    for i in 0..n {
        queued = call(i);
        if queued.is_err() {
            break;
        }
    }
    // No graph node allocates, so the flag changes nothing; cudarc needs one.
    let graph = stream
        .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
    queued?;
    Ok(graph?.ok_or("stream capture produced no graph")?)
}
