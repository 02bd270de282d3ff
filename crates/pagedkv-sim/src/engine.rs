//! One engine (model) of a simulation: its batcher on the shared pool, its KV cache and swap
//! space, its kernels, and the latency bookkeeping of its requests.

use super::config::{EngineSpec, SimConfig};
use super::kernels::KernelBuffers;
use super::workload::SimRequest;
use crate::error::SimError;
use half::{bf16, f16};
use pagedkv::block::{BlockPool, EngineId, KvArena};
use pagedkv::budget::BudgetCoordinator;
use pagedkv::kv::{ArenaView, KvDtype};
use pagedkv::sched::admission::{Admission, Completion};
use pagedkv::sched::{
    budget_priority, Batcher, BatcherConfig, EngineShare, FinishReason, FinishedSeq, Priority,
    SeqId, SeqRequest, StopRules,
};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Token id the simulated "model" treats as end of sequence.
pub const EOS: u32 = 0;
/// Vocabulary the sampler draws from.
const VOCAB: u32 = 32_000;

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
    /// The engine refused it: it could never fit the KV pool or a sequence's table.
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
    /// The step an open demand started at.
    pub demand_since: Option<u64>,
    /// Steps scheduled so far.
    pub steps: u64,
}

/// The kernels of one engine: CPU kernels on a host cache, or CUDA kernels on a device cache.
enum AnyKernels {
    F32(KernelBuffers<f32>),
    F16(KernelBuffers<f16>),
    Bf16(KernelBuffers<bf16>),
    #[cfg(feature = "cuda")]
    CudaF32(super::kernels_cuda::DeviceKernels<f32>),
    #[cfg(feature = "cuda")]
    CudaF16(super::kernels_cuda::DeviceKernels<f16>),
    #[cfg(feature = "cuda")]
    CudaBf16(super::kernels_cuda::DeviceKernels<bf16>),
}

/// One engine's state, owned by its thread.
pub(crate) struct EngineRuntime {
    pub(crate) id: EngineId,
    pub(crate) spec: EngineSpec,
    pub(crate) batcher: Batcher,
    coordinator: Arc<BudgetCoordinator>,
    kernels: AnyKernels,
    rng: SmallRng,
    tracked: HashMap<SeqId, Tracked>,
    finished: Vec<FinishedSeq>,
    sampled: Vec<u32>,
    admit_per_step: usize,
    pub(crate) metrics: EngineMetrics,
    /// KV bytes this engine allocated beyond the shared arena.
    pub(crate) kv_bytes_allocated: u64,
    /// Tokens per block (page) of this engine's view.
    pub(crate) block_size: u32,
}

impl EngineRuntime {
    pub(crate) fn new(
        cfg: &SimConfig,
        spec: &EngineSpec,
        id: EngineId,
        pool: Arc<BlockPool>,
        coordinator: Arc<BudgetCoordinator>,
        device: &super::Device,
        arena: &Arc<KvArena>,
    ) -> Result<Self, SimError> {
        let shape = spec.kv_shape(cfg.dtype);
        // This model's view of the shared arena: its own tokens per page.
        let view = ArenaView::new(arena.clone(), &shape)
            .map_err(|e| SimError::InvalidConfig(format!("engine {}: {e}", spec.name)))?;
        let kv = *view.config();
        let block_size = kv.block_size() as u32;
        if spec.heads == 0 || spec.heads % spec.kv_heads != 0 {
            return Err(SimError::InvalidConfig(format!(
                "engine {}: {} query heads is not a multiple of {} KV heads",
                spec.name, spec.heads, spec.kv_heads
            )));
        }
        let mut batcher = Batcher::new(
            BatcherConfig {
                engine: id,
                block_size,
                max_running: spec.max_running,
                max_batched_tokens: cfg.tokens_per_step,
                max_prefill_chunk: cfg.prefill_chunk,
                // A sequence may outgrow the engine's guaranteed share into pages other engines
                // leave idle (a long context on an idle pool); when a lender wants its pages
                // back, the coordinator's reclaim order preempts it (recompute or swap).
                max_blocks_per_seq: spec.max_context.div_ceil(block_size).min(pool.total()),
                preemption: cfg.preemption,
                swap_blocks: cfg.swap_blocks,
            },
            pool,
        )?;
        batcher.attach_budget(Box::new(EngineShare::new(coordinator.clone(), id)));
        let mut rng = SmallRng::seed_from_u64(cfg.seed ^ 0x5eed_0000 ^ u64::from(id.0));
        let swap_blocks = cfg.swap_blocks as usize;
        // KV bytes this engine allocates itself: none on the CPU path (its cache is a view of
        // the arena); a device cache of its own on the CUDA path.
        #[allow(unused_mut)] // only the CUDA path adds to it
        let mut kv_bytes_allocated = 0u64;
        let kernels = match device {
            super::Device::Cpu => match cfg.dtype {
                KvDtype::F32 => AnyKernels::F32(KernelBuffers::new(view, swap_blocks, &mut rng)?),
                KvDtype::F16 => AnyKernels::F16(KernelBuffers::new(view, swap_blocks, &mut rng)?),
                KvDtype::Bf16 => AnyKernels::Bf16(KernelBuffers::new(view, swap_blocks, &mut rng)?),
            },
            #[cfg(feature = "cuda")]
            super::Device::Cuda(gpu) => {
                use super::kernels_cuda::DeviceKernels;
                let heads = spec.heads;
                // The device path still gives each engine a dense cache of its own over the
                // pool's block numbers (same tokens per block as its arena view).
                let kv = shape.config(kv.block_size(), kv.num_blocks())?;
                kv_bytes_allocated += kv.total_bytes() as u64;
                match cfg.dtype {
                    KvDtype::F32 => AnyKernels::CudaF32(DeviceKernels::new(
                        gpu,
                        kv,
                        swap_blocks,
                        heads,
                        &mut rng,
                    )?),
                    KvDtype::F16 => AnyKernels::CudaF16(DeviceKernels::new(
                        gpu,
                        kv,
                        swap_blocks,
                        heads,
                        &mut rng,
                    )?),
                    KvDtype::Bf16 => AnyKernels::CudaBf16(DeviceKernels::new(
                        gpu,
                        kv,
                        swap_blocks,
                        heads,
                        &mut rng,
                    )?),
                }
            }
        };
        Ok(Self {
            id,
            spec: spec.clone(),
            batcher,
            coordinator,
            kernels,
            rng,
            tracked: HashMap::new(),
            finished: Vec::new(),
            sampled: Vec::new(),
            admit_per_step: cfg.admit_per_step,
            metrics: EngineMetrics::default(),
            kv_bytes_allocated,
            block_size,
        })
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
                prompt: vec![1 + (req.id % 1000) as u32; req.prompt_len as usize],
                stop: StopRules {
                    max_new_tokens: req.max_new_tokens,
                    eos: vec![EOS],
                    stop_sequences: Vec::new(),
                },
                priority: req.priority,
            };
            match self.batcher.add(seq) {
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
                Err(pagedkv::error::SchedError::TooLong { .. }) => {
                    self.metrics.too_long += 1;
                    completion.complete(SimOutcome::TooLong);
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Applies blocks the engine must give back, then schedules its step.
    pub(crate) fn schedule(&mut self, donations: u32) {
        let t = Instant::now();
        self.track_reclaim();
        self.metrics.steps += 1;
        let shed = self.coordinator.reclaim_for(self.id) + donations;
        if shed > 0 {
            self.metrics.blocks_shed += u64::from(shed);
            self.batcher.request_shed(shed);
        }
        self.finished.clear();
        self.batcher.schedule_into(&mut self.finished);
        self.metrics.backlogged.push(self.batcher.num_waiting() > 0);
        self.metrics.schedule_wall += t.elapsed();
    }

    /// Runs the step's kernels.
    pub(crate) fn execute(&mut self) -> Result<(), SimError> {
        let t = Instant::now();
        let batch = self.batcher.batch();
        let heads = self.spec.heads;
        let bytes = match &mut self.kernels {
            AnyKernels::F32(k) => k.run(batch, heads, &mut self.rng)?,
            AnyKernels::F16(k) => k.run(batch, heads, &mut self.rng)?,
            AnyKernels::Bf16(k) => k.run(batch, heads, &mut self.rng)?,
            #[cfg(feature = "cuda")]
            AnyKernels::CudaF32(k) => k.run(batch, &mut self.rng)?,
            #[cfg(feature = "cuda")]
            AnyKernels::CudaF16(k) => k.run(batch, &mut self.rng)?,
            #[cfg(feature = "cuda")]
            AnyKernels::CudaBf16(k) => k.run(batch, &mut self.rng)?,
        };
        self.metrics.kv_bytes_read += bytes;
        self.metrics.kernel_wall += t.elapsed();
        Ok(())
    }

    /// Samples, commits, and resolves finished requests. `now_ms` is the simulated time at the
    /// end of this step.
    pub(crate) fn commit(&mut self, now_ms: f64) -> Result<(), SimError> {
        let t = Instant::now();
        let batch = self.batcher.batch();
        let tokens = batch.num_tokens() as u32;
        self.metrics.scheduled += u64::from(tokens);
        self.metrics.per_tick.push(tokens);
        self.sampled.clear();
        for _ in 0..batch.num_samples() {
            self.sampled.push(self.rng.gen_range(0..VOCAB));
        }
        // Every sampling row gets a token at `now_ms`.
        for (row, &id) in batch.seq_ids.iter().enumerate() {
            if !batch.samples[row] {
                continue;
            }
            if let Some(tr) = self.tracked.get_mut(&id) {
                let class = tr.priority.index();
                match tr.last_token_ms {
                    None => self.metrics.ttft_ms[class].push(now_ms - tr.arrival_ms),
                    Some(prev) => self.metrics.itl_ms[class].push(now_ms - prev),
                }
                tr.last_token_ms = Some(now_ms);
            }
        }
        self.metrics.generated += self.sampled.len() as u64;
        self.batcher.commit(&self.sampled, &mut self.finished)?;
        for f in self.finished.drain(..) {
            if let Some(tr) = self.tracked.remove(&f.id) {
                self.metrics.finished += 1;
                tr.completion.complete(SimOutcome::Finished {
                    tokens: f.output.len() as u32,
                    reason: f.reason,
                });
            }
        }
        // Publish what preempting this engine would free, for other engines' donor choice.
        match self.batcher.preemptible_load() {
            Some((class, blocks)) => {
                self.coordinator
                    .publish_load(self.id, budget_priority(class), blocks)
            }
            None => self.coordinator.clear_load(self.id),
        }
        self.metrics.schedule_wall += t.elapsed();
        Ok(())
    }

    /// If latency-critical work waits for blocks that are lent out (this engine is within its
    /// limit, but the pool is not), the lower-priority engine to take them from and how many.
    /// (When the engine's own limit binds, a donation would not help it: it waits for its own
    /// sequences, or for reclaim orders to return its lent share.)
    pub(crate) fn donation_needed(&mut self) -> Option<(EngineId, u32)> {
        let (class, need) = self.batcher.next_admission_need()?;
        if class != Priority::LatencyCritical {
            return None;
        }
        let limit = u64::from(self.coordinator.block_limit(self.id));
        if self.coordinator.blocks_held(self.id) + u64::from(need) > limit {
            return None;
        }
        let total = u64::from(self.coordinator.config().total_blocks);
        if self.coordinator.blocks_in_use() + u64::from(need) <= total {
            return None;
        }
        let donor = self
            .coordinator
            .pick_donor(self.id, budget_priority(class), need)?;
        self.metrics.donations_asked += 1;
        Some((donor.engine, need))
    }

    /// Reclaim latency bookkeeping, at the start of each step: a *demand* is open while this
    /// engine's next admission fits its own block limit but not the pool's free pages (pages
    /// of its share are lent to other engines); it closes at the first step where the pages
    /// are free (or the demand went away), and its length in steps is recorded.
    fn track_reclaim(&mut self) {
        let step = self.metrics.steps;
        let demand = self.batcher.next_admission_need().is_some_and(|(_, need)| {
            let need = u64::from(need);
            let limit = u64::from(self.coordinator.block_limit(self.id));
            let total = u64::from(self.coordinator.config().total_blocks);
            self.coordinator.blocks_held(self.id) + need <= limit
                && self.coordinator.blocks_in_use() + need > total
        });
        match (demand, self.metrics.demand_since) {
            (true, None) => self.metrics.demand_since = Some(step),
            (false, Some(since)) => {
                self.metrics.reclaim_steps.push(step - since);
                self.metrics.demand_since = None;
            }
            _ => {}
        }
    }

    /// Whether the engine has no request left.
    pub(crate) fn is_idle(&self) -> bool {
        !self.batcher.has_work() && self.tracked.is_empty()
    }
}
