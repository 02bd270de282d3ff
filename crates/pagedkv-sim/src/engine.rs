//! One engine (model) of a simulation: the library's engine driver on the shared arena with
//! the simulated model, and the latency bookkeeping of its requests.

use super::config::{EngineSpec, SimConfig};
use super::model::NoiseModel;
use super::workload::SimRequest;
use crate::error::SimError;
use half::{bf16, f16};
use pagedkv::engine::{
    Engine, EngineConfig, KvBackend, RecomputePolicy, SharedArena, StepModel, StepReport,
};
use pagedkv::kv::{KvDtype, KvElem};
use pagedkv::sched::admission::{Admission, Completion};
use pagedkv::sched::{
    Batcher, FinishReason, FinishedSeq, Priority, SeqId, SeqRequest, StepResults, StopRules,
};
use rand::{rngs::SmallRng, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Token id the simulated "model" treats as end of sequence.
pub const EOS: u32 = 0;

/// What a request's submitter learns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimOutcome {
    /// Generated `tokens` tokens and stopped for `reason`.
    Finished {
        /// Tokens generated.
        tokens: u32,
        /// Why it stopped.
        reason: FinishReason,
    },
    /// The engine refused it: it could never fit the KV pool, a sequence's table, or the
    /// engine's guaranteed share of the pool.
    TooLong,
}

/// A request in an engine's hands.
#[derive(Debug)]
struct Tracked {
    arrival_ms: f64,
    priority: Priority,
    last_token_ms: Option<f64>,
    completion: Completion<SimOutcome>,
}

/// Deterministic per-engine figures (simulated time).
#[derive(Debug, Default, Clone)]
pub struct EngineMetrics {
    /// Time to first token per class (index = `Priority::index`), ms.
    pub ttft_ms: [Vec<f64>; 2],
    /// Inter-token latency per class, ms.
    pub itl_ms: [Vec<f64>; 2],
    /// Tokens generated (sampled).
    pub generated: u64,
    /// Tokens scheduled (prefill and decode, recomputation included).
    pub scheduled: u64,
    /// Tokens scheduled in each tick.
    pub per_tick: Vec<u32>,
    /// Tokens scheduled above the engine's token share of the tick (borrowed from idle engines
    /// or from what active engines' demand left).
    pub above_share: u64,
    /// Whether the engine had a backlog (requests waiting in its batcher) after each tick's
    /// scheduling: it wanted more than it got.
    pub backlogged: Vec<bool>,
    /// Requests finished, by reason.
    pub finished: u64,
    /// Requests refused by the engine as too long.
    pub too_long: u64,
    /// KV bytes read by attention.
    pub kv_bytes_read: u64,
    /// Blocks this engine was asked to give back (reclaim by lenders, donations).
    pub blocks_shed: u64,
    /// Donations this engine asked of others for latency-critical work.
    pub donations_asked: u64,
    /// Wall time in kernels (not deterministic; reported apart).
    pub kernel_wall: Duration,
    /// Wall time in scheduling (not deterministic; reported apart).
    pub schedule_wall: Duration,
    /// Reclaim latencies: steps from this engine's demand for pages lent out to enough of
    /// them being free.
    pub reclaim_steps: Vec<u64>,
    /// Steps scheduled so far.
    pub steps: u64,
}

/// An engine driver with its model, behind one object-safe face (the element type and the
/// device are chosen at run time; the driver is generic over them).
trait Driven: Send {
    fn add(&mut self, req: SeqRequest) -> Result<(), pagedkv::error::SchedError>;
    fn schedule(&mut self) -> u32;
    fn execute(&mut self) -> Result<(), SimError>;
    fn commit(&mut self) -> Result<StepReport, SimError>;
    fn results(&self) -> &StepResults;
    fn finished(&self) -> &[FinishedSeq];
    fn batcher(&self) -> &Batcher;
    fn tokens_per_page(&self) -> u32;
}

struct WithModel<B: KvBackend, M> {
    engine: Engine<B>,
    model: M,
}

impl<B, M> Driven for WithModel<B, M>
where
    B: KvBackend + Send,
    M: StepModel<B> + Send,
{
    fn add(&mut self, req: SeqRequest) -> Result<(), pagedkv::error::SchedError> {
        self.engine.add(req)
    }
    fn schedule(&mut self) -> u32 {
        self.engine.schedule().num_tokens() as u32
    }
    fn execute(&mut self) -> Result<(), SimError> {
        self.engine.execute(&mut self.model)?;
        Ok(())
    }
    fn commit(&mut self) -> Result<StepReport, SimError> {
        Ok(self.engine.commit(&mut self.model)?)
    }
    fn results(&self) -> &StepResults {
        self.engine.results()
    }
    fn finished(&self) -> &[FinishedSeq] {
        self.engine.finished()
    }
    fn batcher(&self) -> &Batcher {
        self.engine.batcher()
    }
    fn tokens_per_page(&self) -> u32 {
        self.engine.tokens_per_page()
    }
}

fn host<T: KvElem>(
    shared: &Arc<SharedArena>,
    cfg: EngineConfig,
    spec: &EngineSpec,
    dtype: KvDtype,
    rng: SmallRng,
) -> Result<Box<dyn Driven>, SimError> {
    let engine = Engine::<pagedkv::engine::HostBackend<T>>::host(
        shared,
        cfg,
        &spec.kv_shape(dtype),
        spec.heads,
    )?;
    Ok(Box::new(WithModel {
        engine,
        model: NoiseModel::<T>::new(rng),
    }))
}

#[cfg(feature = "cuda")]
fn on_device<T>(
    shared: &Arc<SharedArena>,
    gpu: &pagedkv::cuda::Gpu,
    cfg: EngineConfig,
    spec: &EngineSpec,
    dtype: KvDtype,
    rng: SmallRng,
) -> Result<Box<dyn Driven>, SimError>
where
    T: KvElem + cudarc::driver::DeviceRepr,
{
    let engine = Engine::<pagedkv::engine::RawBackend<pagedkv::cuda::Gpu>>::cuda(
        shared,
        gpu,
        cfg,
        &spec.kv_shape(dtype),
        spec.heads,
    )?;
    Ok(Box::new(WithModel {
        engine,
        model: NoiseModel::<T>::new(rng),
    }))
}

/// One engine's state, owned by the run.
pub(crate) struct EngineRuntime {
    pub(crate) spec: EngineSpec,
    driven: Box<dyn Driven>,
    tracked: HashMap<SeqId, Tracked>,
    admit_per_step: usize,
    pub(crate) metrics: EngineMetrics,
    /// Tokens per block (page) of this engine's view.
    pub(crate) block_size: u32,
}

impl EngineRuntime {
    pub(crate) fn new(
        cfg: &SimConfig,
        spec: &EngineSpec,
        index: usize,
        shared: &Arc<SharedArena>,
        device: &super::Device,
    ) -> Result<Self, SimError> {
        if spec.heads == 0 || spec.heads % spec.kv_heads != 0 {
            return Err(SimError::InvalidConfig(format!(
                "engine {}: {} query heads is not a multiple of {} KV heads",
                spec.name, spec.heads, spec.kv_heads
            )));
        }
        let ecfg = EngineConfig {
            weight: spec.weight,
            max_running: spec.max_running,
            max_batched_tokens: cfg.tokens_per_step,
            max_prefill_chunk: cfg.prefill_chunk,
            max_context: spec.max_context,
            preemption: cfg.preemption,
            swap_blocks: cfg.swap_blocks,
            // The run recomputes once per simulated step itself, so budgets (and the report)
            // do not depend on thread timing.
            recompute: RecomputePolicy::CALLER,
            prefix_cache: cfg.prefix_cache,
        };
        let rng = SmallRng::seed_from_u64(cfg.seed ^ 0x5eed_0000 ^ index as u64);
        let named = |e: SimError| match e {
            SimError::Engine(e) => SimError::InvalidConfig(format!("engine {}: {e}", spec.name)),
            e => e,
        };
        let driven = match device {
            super::Device::Cpu => match cfg.dtype {
                KvDtype::F32 => host::<f32>(shared, ecfg, spec, cfg.dtype, rng),
                KvDtype::F16 => host::<f16>(shared, ecfg, spec, cfg.dtype, rng),
                KvDtype::Bf16 => host::<bf16>(shared, ecfg, spec, cfg.dtype, rng),
            },
            #[cfg(feature = "cuda")]
            super::Device::Cuda(gpu) => match cfg.dtype {
                KvDtype::F32 => on_device::<f32>(shared, gpu, ecfg, spec, cfg.dtype, rng),
                KvDtype::F16 => on_device::<f16>(shared, gpu, ecfg, spec, cfg.dtype, rng),
                KvDtype::Bf16 => on_device::<bf16>(shared, gpu, ecfg, spec, cfg.dtype, rng),
            },
        }
        .map_err(named)?;
        Ok(Self {
            block_size: driven.tokens_per_page(),
            spec: spec.clone(),
            driven,
            tracked: HashMap::new(),
            admit_per_step: cfg.admit_per_step,
            metrics: EngineMetrics::default(),
        })
    }

    /// The engine's batcher (statistics).
    pub(crate) fn batcher(&self) -> &Batcher {
        self.driven.batcher()
    }

    /// Takes up to `admit_per_step` requests from this engine's admission queue.
    pub(crate) fn admit(
        &mut self,
        admission: &Admission<SimRequest, SimOutcome>,
        worker: usize,
    ) -> Result<(), SimError> {
        for _ in 0..self.admit_per_step {
            let Some(job) = admission.pop(worker)? else {
                break;
            };
            let (req, completion) = job.into_parts();
            let seq = SeqRequest {
                id: req.id,
                prompt: req.prompt(),
                stop: StopRules {
                    max_new_tokens: req.max_new_tokens,
                    eos: vec![EOS],
                    stop_sequences: Vec::new(),
                },
                priority: req.priority,
            };
            match self.driven.add(seq) {
                Ok(()) => {
                    self.tracked.insert(
                        req.id,
                        Tracked {
                            arrival_ms: req.arrival_ms,
                            priority: req.priority,
                            last_token_ms: None,
                            completion,
                        },
                    );
                }
                Err(
                    pagedkv::error::SchedError::TooLong { .. }
                    | pagedkv::error::SchedError::ContextTooLong { .. },
                ) => {
                    self.metrics.too_long += 1;
                    completion.complete(SimOutcome::TooLong);
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Schedules this engine's step (the driver applies reclaim orders and donations).
    pub(crate) fn schedule(&mut self) {
        let t = Instant::now();
        let tokens = self.driven.schedule();
        self.metrics.steps += 1;
        self.metrics.scheduled += u64::from(tokens);
        self.metrics.per_tick.push(tokens);
        self.metrics
            .backlogged
            .push(self.driven.batcher().num_waiting() > 0);
        self.metrics.schedule_wall += t.elapsed();
    }

    /// Runs the step's kernels (engines run this in parallel).
    pub(crate) fn execute(&mut self) -> Result<(), SimError> {
        let t = Instant::now();
        self.driven.execute()?;
        self.metrics.kernel_wall += t.elapsed();
        Ok(())
    }

    /// Commits the step and resolves finished requests (engines run this in engine order, so
    /// the pool's pages are freed, and cached, in the same order on every run). `now_ms` is
    /// the simulated time at the end of this step.
    pub(crate) fn commit(&mut self, now_ms: f64) -> Result<(), SimError> {
        let t = Instant::now();
        let report = self.driven.commit()?;
        self.metrics.schedule_wall += t.elapsed();
        let m = &mut self.metrics;
        m.kv_bytes_read += report.exec.kv_bytes_read;
        m.generated += u64::from(report.sampled);
        m.blocks_shed += u64::from(report.pages_shed);
        m.donations_asked += u64::from(report.asked_donation);
        if let Some(steps) = report.reclaim_closed_after {
            m.reclaim_steps.push(steps);
        }
        // Every token of this step arrives at `now_ms`.
        for u in &self.driven.results().updates {
            if u.tokens.is_empty() {
                continue;
            }
            if let Some(tr) = self.tracked.get_mut(&u.id) {
                let class = tr.priority.index();
                match tr.last_token_ms {
                    None => m.ttft_ms[class].push(now_ms - tr.arrival_ms),
                    Some(prev) => m.itl_ms[class].push(now_ms - prev),
                }
                tr.last_token_ms = Some(now_ms);
            }
        }
        for f in self.driven.finished() {
            if let Some(tr) = self.tracked.remove(&f.id) {
                m.finished += 1;
                tr.completion.complete(SimOutcome::Finished {
                    tokens: f.output.len() as u32,
                    reason: f.reason,
                });
            }
        }
        Ok(())
    }

    /// Whether the engine has no request left.
    pub(crate) fn is_idle(&self) -> bool {
        !self.driven.batcher().has_work() && self.tracked.is_empty()
    }
}
