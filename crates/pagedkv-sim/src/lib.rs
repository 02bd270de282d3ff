//! `pagedkv simulate`: several models serving a seeded workload on one device's shared block
//! pool, under one budget coordinator, through the admission queues, with the real kernels on
//! real KV caches.
//!
//! # How a run proceeds
//!
//! Every engine is the library's [`pagedkv::engine::Engine`] on one
//! [`SharedArena`] (its cache a view of the arena, CPU or CUDA), driven with a simulated model
//! (random projections, random sampling). Time is simulated: step `t` ends at
//! `(t + 1) * step_ms`. Each step has four phases, each a parallel section of the run itself
//! (the library imposes no wait between engines):
//!
//! 1. **clients** (in parallel) collect outcomes of earlier requests and submit every request
//!    that arrived before the step began, each to its model's admission queue (a step's batch
//!    is formed at its start: a request arriving during it waits for the next one, so no
//!    first token comes sooner than one step after its request);
//! 2. **engines schedule** in engine order (block grants are then the same on every run):
//!    each takes requests from its queue and runs the driver's `schedule` (one that was idle
//!    and got work is reported active and the budgets recomputed first, so it gets tokens in
//!    this step, as a server's engine does);
//! 3. **engines execute** their kernels in parallel on the shared arena, then **commit** in
//!    engine order (pages are freed, and offered to the prefix cache, in the same order on
//!    every run: with a prefix cache, which page holds what decides what eviction takes);
//! 4. **the coordinator** recomputes the budgets and the run records the pool's state.
//!
//! Latencies are measured in simulated time, so the same seed gives the same report on any
//! machine; wall-clock figures are reported apart. Each client serves a fixed set of engines,
//! and each engine's queue has one producer and one consumer per step, so queue overflow is
//! deterministic too.

mod config;
mod engine;
pub mod error;
pub mod gpu_bench;
mod model;
mod plot;
mod report;
mod workload;

pub use config::{Burst, EngineSpec, SimConfig};
pub use engine::{EngineMetrics, SimOutcome, EOS};
pub use plot::write_svg;
pub use report::{
    ClassLatency, EngineReport, Latency, Refusals, Report, StepLatency, TimelinePoint, WallReport,
};
pub use workload::{generate, SimRequest};

use crate::error::SimError;
use engine::EngineRuntime;
use pagedkv::block::EngineId;
use pagedkv::budget::BudgetConfig;
use pagedkv::engine::SharedArena;
use pagedkv::error::{AdmissionError, OverloadReason};
use pagedkv::kv::{page_bytes_for, ModelKvShape};
use pagedkv::sched::admission::{Admission, AdmissionConfig, Route, Ticket};
use pagedkv::sched::Priority;
use rayon::prelude::*;
use std::sync::Arc;
use std::time::Instant;

/// Progress of a run, passed to the caller's callback once per step.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Steps done.
    pub step: u64,
    /// Requests resolved (finished or refused) so far.
    pub resolved: u64,
    /// Requests in the workload.
    pub total: u64,
    /// Blocks in use in the pool.
    pub used_blocks: u32,
}

/// What one client saw.
#[derive(Debug, Default)]
struct ClientTally {
    refused: Vec<Refusals>,
}

/// One client: submits its requests as they arrive and collects their outcomes.
struct Client {
    mine: Vec<SimRequest>,
    next: usize,
    tickets: Vec<(usize, Ticket<SimOutcome>)>,
    tally: ClientTally,
    resolved: u64,
    pending: u64,
}

impl Client {
    /// Collects outcomes of earlier requests, then submits every request that arrived before
    /// `start_ms`, the start of the step, each to its model's admission queue.
    fn step(&mut self, admission: &Admission<SimRequest, SimOutcome>, start_ms: f64) {
        self.collect();
        while self.next < self.mine.len() && self.mine[self.next].arrival_ms < start_ms {
            let r = self.mine[self.next].clone();
            let (engine, priority) = (r.engine, r.priority);
            match admission.try_submit(r, priority, Route::Worker(engine)) {
                Ok(ticket) => {
                    self.pending += 1;
                    self.tickets.push((engine, ticket));
                }
                Err(_) => {
                    self.tally.refused[engine].queue_full += 1;
                    self.resolved += 1;
                }
            }
            self.next += 1;
        }
    }

    /// Collects the outcomes of the requests resolved so far (finished, or refused with a
    /// reason); the tickets of the others stay.
    fn collect(&mut self) {
        let (tally, resolved, pending) = (&mut self.tally, &mut self.resolved, &mut self.pending);
        self.tickets.retain_mut(|(engine, t)| match t.try_take() {
            None => true,
            Some(outcome) => {
                match outcome {
                    Ok(SimOutcome::TooLong) => tally.refused[*engine].too_long += 1,
                    Ok(SimOutcome::Finished { .. }) => {}
                    Err(AdmissionError::Overloaded {
                        reason: OverloadReason::EvictedOldest,
                        ..
                    }) => tally.refused[*engine].evicted += 1,
                    Err(_) => tally.refused[*engine].queue_full += 1,
                }
                *pending -= 1;
                *resolved += 1;
                false
            }
        });
    }
}

/// Where the kernels run.
#[derive(Debug)]
pub enum Device {
    /// The CPU kernels ([`pagedkv::attn::cpu`]) on host caches.
    Cpu,
    /// The CUDA kernels on device caches of this GPU (each engine on its own stream).
    #[cfg(feature = "cuda")]
    Cuda(pagedkv::cuda::Gpu),
}

impl Device {
    /// Opens a device by name: `cpu`, `cuda` or `cuda:N`. A CUDA device in a build without the
    /// `cuda` feature, or on a machine without a usable GPU, is a [`SimError::Device`].
    pub fn open(name: &str) -> Result<Self, SimError> {
        let ordinal = match name {
            "cpu" => return Ok(Device::Cpu),
            "cuda" => 0,
            _ => match name.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => n,
                _ => {
                    return Err(SimError::Device(format!(
                        "unknown device {name:?}: expected cpu, cuda or cuda:N"
                    )))
                }
            },
        };
        #[cfg(feature = "cuda")]
        {
            pagedkv::cuda::Gpu::open(ordinal)
                .map(Device::Cuda)
                .map_err(|e| SimError::Device(format!("{name}: {e}")))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = ordinal;
            Err(SimError::Device(format!(
                "{name}: this build has no CUDA support; rebuild with `--features cuda`"
            )))
        }
    }

    /// A name for reports.
    pub fn describe(&self) -> String {
        match self {
            Device::Cpu => "cpu".into(),
            #[cfg(feature = "cuda")]
            Device::Cuda(gpu) => format!("cuda ({:?})", gpu.info()),
        }
    }
}

/// Most steps of arrivals a run may simulate (`duration / step`).
pub const MAX_ARRIVAL_STEPS: u64 = 10_000_000;
/// Most requests a run's arrival rates may make on average (all are generated up front).
pub const MAX_EXPECTED_REQUESTS: u64 = 10_000_000;

/// Checks a configuration before anything is built.
pub fn validate(cfg: &SimConfig) -> Result<(), SimError> {
    let bad = |m: String| Err(SimError::InvalidConfig(m));
    if cfg.engines.is_empty() {
        return bad("at least one engine is needed".into());
    }
    if cfg.engines.len() > 64 {
        return bad(format!("{} engines; at most 64", cfg.engines.len()));
    }
    if (cfg.pool_blocks as usize) < cfg.engines.len() {
        return bad(format!(
            "the KV pool has {} blocks, fewer than one per engine ({} engines)",
            cfg.pool_blocks,
            cfg.engines.len()
        ));
    }
    if !(cfg.duration_s > 0.0 && cfg.duration_s.is_finite()) {
        return bad("duration must be a positive number of seconds".into());
    }
    if !(cfg.step_ms > 0.0 && cfg.step_ms.is_finite()) {
        return bad("step must be a positive number of milliseconds".into());
    }
    if cfg.clients == 0 {
        return bad("at least one client thread is needed".into());
    }
    // Bounds that keep a run finite in time and memory: every step is simulated, and every
    // request is generated up front.
    let arrival_steps = cfg.duration_s * 1e3 / cfg.step_ms;
    if arrival_steps > MAX_ARRIVAL_STEPS as f64 {
        return bad(format!(
            "{} s of arrivals at {} ms per step is {arrival_steps:.3e} steps; at most {MAX_ARRIVAL_STEPS}",
            cfg.duration_s, cfg.step_ms
        ));
    }
    // Every simulated time (a step's end, a latency, the chart's axis) must be finite: an
    // infinite end made latencies inf and NaN, and the chart's time axis hung `--plot`.
    if !(step_limit(cfg) as f64 * cfg.step_ms).is_finite() {
        return bad(format!(
            "{:e} ms per step: the run's step limit ({} steps) ends past the largest finite time",
            cfg.step_ms,
            step_limit(cfg)
        ));
    }
    let expected: f64 = cfg
        .engines
        .iter()
        .map(|e| e.rate * e.burst.map_or(1.0, |b| b.factor.max(1.0)) * cfg.duration_s)
        .sum();
    if expected.is_nan() || expected > MAX_EXPECTED_REQUESTS as f64 {
        return bad(format!(
            "the arrival rates over {} s make about {expected:.3e} requests; at most {MAX_EXPECTED_REQUESTS}",
            cfg.duration_s
        ));
    }
    if cfg.block_size == 0 || cfg.tokens_per_step == 0 || cfg.prefill_chunk == 0 {
        return bad("block size, tokens per step and prefill chunk must be at least 1".into());
    }
    // No engine would take a request from its queue: every request timed out at the step
    // limit, and the run reported that as a result.
    if cfg.admit_per_step == 0 {
        return bad("admissions per step must be at least 1".into());
    }
    if cfg.queue_capacity == 0 {
        return bad("admission queue capacity must be at least 1".into());
    }
    if !(1..=1000).contains(&cfg.cap_permille) {
        return bad(format!(
            "one engine's cap is {} per mille; it must be 1 to 1000",
            cfg.cap_permille
        ));
    }
    for e in &cfg.engines {
        if e.weight == 0 {
            return bad(format!("engine {}: weight must be at least 1", e.name));
        }
        if !(e.rate >= 0.0 && e.rate.is_finite()) {
            return bad(format!(
                "engine {}: arrival rate must be finite and >= 0",
                e.name
            ));
        }
        if e.max_prompt == 0 || e.max_output == 0 {
            return bad(format!(
                "engine {}: longest prompt and longest output must be >= 1",
                e.name
            ));
        }
        if !(0.0..=1.0).contains(&e.latency_fraction) {
            return bad(format!(
                "engine {}: latency-critical fraction must be in 0..=1",
                e.name
            ));
        }
        if e.layers == 0 || e.head_dim == 0 {
            return bad(format!(
                "engine {}: layers and head dim must be at least 1",
                e.name
            ));
        }
        if e.heads == 0 || e.kv_heads == 0 || e.heads % e.kv_heads != 0 {
            return bad(format!(
                "engine {}: {} query heads is not a multiple of {} KV heads",
                e.name, e.heads, e.kv_heads
            ));
        }
        if e.max_running == 0 || e.max_context == 0 {
            return bad(format!(
                "engine {}: max running and max context must be >= 1",
                e.name
            ));
        }
        if e.heads
            .saturating_mul(e.head_dim)
            .saturating_mul(cfg.tokens_per_step as usize)
            > (1 << 21)
        {
            return bad(format!(
                "engine {}: one step's projections ({} heads x {} dims x {} tokens) exceed the simulator's 2M-value random pool; lower --tokens-per-step",
                e.name, e.heads, e.head_dim, cfg.tokens_per_step
            ));
        }
    }
    Ok(())
}

/// Runs a simulation on the CPU kernels. `progress` is called once per step from the
/// coordinating thread.
pub fn run(cfg: &SimConfig, progress: &(dyn Fn(Progress) + Sync)) -> Result<Report, SimError> {
    run_on(cfg, &Device::Cpu, progress)
}

/// Runs a simulation with its kernels on `device`.
pub fn run_on(
    cfg: &SimConfig,
    device: &Device,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<Report, SimError> {
    validate(cfg)?;
    let n = cfg.engines.len();
    let requests = generate(cfg);
    let total = requests.len() as u64;
    let last_arrival_ms = requests.last().map_or(0.0, |r| r.arrival_ms);

    // One KV arena for every engine: pages sized so the model with the largest per-token KV
    // gets `block_size` tokens per page.
    let shapes: Vec<ModelKvShape> = cfg.engines.iter().map(|e| e.kv_shape(cfg.dtype)).collect();
    let page_bytes = page_bytes_for(&shapes, cfg.block_size as usize)?;
    let budget = BudgetConfig::new(n as u16, cfg.tokens_per_step, cfg.pool_blocks)
        .with_cap_permille(cfg.cap_permille);
    let mut shared = match device {
        Device::Cpu => SharedArena::host(budget, page_bytes)?,
        #[cfg(feature = "cuda")]
        Device::Cuda(gpu) => SharedArena::cuda(gpu, budget, page_bytes)?,
    };
    if cfg.prefix_cache {
        // A fixed seed: the same report on every run.
        Arc::get_mut(&mut shared)
            .unwrap_or_else(|| unreachable!("the arena is not shared yet"))
            .enable_prefix_cache(Some(cfg.seed));
    }
    let pool = shared.pool().clone();
    let coordinator = shared.coordinator().clone();
    let mut engines = Vec::with_capacity(n);
    for (index, spec) in cfg.engines.iter().enumerate() {
        engines.push(EngineRuntime::new(cfg, spec, index, &shared, device)?);
    }
    // Every queue's slots are allocated up front, but a queue never holds more requests than
    // its engine gets in its class over the whole run: a larger capacity behaves the same, so
    // it is not allocated (`--queue-capacity 100000000`, meant as "no limit", took 20 GB).
    let mut per_class = vec![[0usize; 2]; n];
    for r in &requests {
        per_class[r.engine][r.priority.index()] += 1;
    }
    let capacity = |class: Priority| {
        let most = per_class
            .iter()
            .map(|c| c[class.index()])
            .max()
            .unwrap_or(0);
        cfg.queue_capacity.min(most.max(1))
    };
    let admission: Admission<SimRequest, SimOutcome> = Admission::new(AdmissionConfig {
        high_capacity: capacity(Priority::LatencyCritical),
        low_capacity: capacity(Priority::Throughput),
        ..AdmissionConfig::new(n, cfg.queue_capacity, cfg.overflow)
    })?;
    // Client c serves engines c, c + clients, ... (a client beyond the engines would serve none).
    let n_clients = cfg.clients.min(n);
    let mut clients: Vec<Client> = (0..n_clients)
        .map(|c| Client {
            mine: requests
                .iter()
                .filter(|r| r.engine % n_clients == c)
                .cloned()
                .collect(),
            next: 0,
            tickets: Vec::new(),
            tally: ClientTally {
                refused: vec![Refusals::default(); n],
            },
            resolved: 0,
            pending: 0,
        })
        .collect();
    let max_steps = step_limit(cfg);

    let started = Instant::now();
    let mut timeline = Vec::new();
    let mut used_sum = 0f64;
    let mut used_peak = 0u32;
    // Pages the engines' budgets hold (their sequences'), apart from pages only the prefix
    // cache keeps: with a cache the pool fills with the latter, and "in use" alone read as a
    // pool run dry.
    let mut seq_sum = 0f64;
    let mut seq_peak = 0u64;
    let mut peak_held = vec![0u32; n];
    let mut peak_borrowed = vec![0u64; n];
    let mut peak_cached = vec![0u32; n];
    let mut steps_run = 0u64;
    // Each simulated step has three phases, each a parallel section of the run's own (no
    // engine waits for another inside the library): clients submit, engines schedule in
    // engine order (block grants are then the same on every run), engines execute and commit
    // concurrently on the shared arena, pool and coordinator; then the coordinator recomputes.
    for t in 0..max_steps {
        let (start_ms, end_ms) = (t as f64 * cfg.step_ms, (t + 1) as f64 * cfg.step_ms);
        clients
            .par_iter_mut()
            .for_each(|c| c.step(&admission, start_ms));
        for (idx, rt) in engines.iter_mut().enumerate() {
            rt.admit(&admission, idx)?;
            // An engine that just got work is reported active and the budgets recomputed before
            // it schedules, as a server's engine has them (`RecomputePolicy::SERVER`): without
            // this its budget stayed 0 until the step's end, and every request reaching an idle
            // engine lost a step. Deterministic: engines schedule one after another.
            let id = EngineId(idx as u16);
            if rt.batcher().has_work() && !coordinator.set_active(id, true) {
                coordinator.recompute();
            }
            rt.schedule();
            // Shares change only at a recompute (an engine waking above, the step's end below),
            // so, read now, this is the one the step saw.
            let share = coordinator.token_share(EngineId(idx as u16));
            let m = &mut rt.metrics;
            m.above_share += u64::from(
                m.per_tick
                    .last()
                    .copied()
                    .unwrap_or(0)
                    .saturating_sub(share),
            );
        }
        engines.par_iter_mut().try_for_each(|rt| rt.execute())?;
        for rt in &mut engines {
            rt.commit(end_ms)?;
        }
        coordinator.recompute();
        let used = pool.total() - pool.free_count();
        used_sum += f64::from(used);
        used_peak = used_peak.max(used);
        let snapshot = coordinator.snapshot();
        let seq_used: u64 = snapshot.engines.iter().map(|st| st.blocks_held).sum();
        seq_sum += seq_used as f64;
        seq_peak = seq_peak.max(seq_used);
        for (e, st) in snapshot.engines.iter().enumerate().take(n) {
            // What its budget holds (its sequences' pages), the figure beside "borrowed" (held
            // above its quota); the pool also counts, as the engine's, the pages only the
            // prefix cache keeps, reported apart.
            let held = u32::try_from(st.blocks_held).unwrap_or(u32::MAX);
            let owned = pool.held(EngineId(e as u16));
            peak_held[e] = peak_held[e].max(held);
            peak_borrowed[e] = peak_borrowed[e].max(st.blocks_borrowed);
            peak_cached[e] = peak_cached[e].max(owned.saturating_sub(held));
        }
        if t % 4 == 0 {
            timeline.push(TimelinePoint {
                t_s: (t + 1) as f64 * cfg.step_ms / 1e3,
                used_blocks: used,
                held: (0..n).map(|e| pool.held(EngineId(e as u16))).collect(),
                token_budget: (0..n)
                    .map(|e| coordinator.token_budget(EngineId(e as u16)))
                    .collect(),
            });
        }
        steps_run = t + 1;
        let resolved: u64 = clients.iter().map(|c| c.resolved).sum();
        progress(Progress {
            step: t + 1,
            resolved,
            total,
            used_blocks: used,
        });
        let arrivals_done =
            end_ms > last_arrival_ms && clients.iter().all(|c| c.next == c.mine.len());
        let pending: u64 = clients.iter().map(|c| c.pending).sum();
        if arrivals_done && pending == 0 && engines.iter().all(|e| e.is_idle()) {
            break;
        }
    }
    // Requests still unresolved at a forced stop time out. Outcomes of the last step (a
    // request finished or refused in it) are collected first: they are not time-outs, and a
    // finished one would otherwise count twice.
    let tallies: Vec<ClientTally> = clients
        .into_iter()
        .map(|mut c| {
            c.collect();
            for (engine, _) in &c.tickets {
                c.tally.refused[*engine].timed_out += 1;
            }
            c.tally
        })
        .collect();
    let elapsed = started.elapsed().as_secs_f64();

    // Unresolved requests at a forced stop: their engines still hold them.
    let mut reports = Vec::with_capacity(n);
    let weight_sum: u64 = cfg.engines.iter().map(|e| u64::from(e.weight)).sum();
    let saturated: Vec<bool> = (0..steps_run as usize)
        .map(|t| {
            engines
                .iter()
                .all(|e| e.metrics.backlogged.get(t).copied().unwrap_or(false))
        })
        .collect();
    let saturated_ticks = saturated.iter().filter(|&&x| x).count() as u64;
    let saturated_total: u64 = engines
        .iter()
        .map(|e| sum_where(&e.metrics.per_tick, &saturated))
        .sum();
    let sim_seconds = steps_run as f64 * cfg.step_ms / 1e3;
    let all_scheduled: u64 = engines.iter().map(|e| e.metrics.scheduled).sum();
    let mut refused_all = Refusals::default();
    for (e, rt) in engines.iter().enumerate() {
        let m = &rt.metrics;
        let mut refused = Refusals::default();
        for t in &tallies {
            refused.queue_full += t.refused[e].queue_full;
            refused.evicted += t.refused[e].evicted;
            refused.too_long += t.refused[e].too_long;
            refused.timed_out += t.refused[e].timed_out;
        }
        refused_all.queue_full += refused.queue_full;
        refused_all.evicted += refused.evicted;
        refused_all.too_long += refused.too_long;
        refused_all.timed_out += refused.timed_out;
        let stats = rt.batcher().stats();
        let class = |c: Priority| ClassLatency {
            ttft: Latency::of(&m.ttft_ms[c.index()]),
            itl: Latency::of(&m.itl_ms[c.index()]),
        };
        reports.push(EngineReport {
            name: rt.spec.name.clone(),
            weight: rt.spec.weight,
            weight_share: f64::from(rt.spec.weight) / weight_sum as f64,
            geometry: [
                rt.spec.layers,
                rt.spec.heads,
                rt.spec.kv_heads,
                rt.spec.head_dim,
            ],
            requests: requests.iter().filter(|r| r.engine == e).count() as u64,
            finished: m.finished,
            refused,
            generated_tokens: m.generated,
            scheduled_tokens: m.scheduled,
            tokens_per_s: m.generated as f64 / sim_seconds,
            token_share: if all_scheduled == 0 {
                0.0
            } else {
                m.scheduled as f64 / all_scheduled as f64
            },
            saturated_token_share: if saturated_total == 0 {
                0.0
            } else {
                sum_where(&m.per_tick, &saturated) as f64 / saturated_total as f64
            },
            latency_critical: class(Priority::LatencyCritical),
            throughput: class(Priority::Throughput),
            preempted_recompute: stats.preempted_recompute,
            preempted_swap: stats.preempted_swap,
            blocks_swapped: [stats.blocks_swapped_out, stats.blocks_swapped_in],
            blocks_shed: m.blocks_shed,
            donations_asked: m.donations_asked,
            peak_blocks: peak_held[e],
            peak_borrowed: peak_borrowed[e],
            peak_cached_blocks: peak_cached[e],
            tokens_above_share: if m.scheduled == 0 {
                0.0
            } else {
                m.above_share as f64 / m.scheduled as f64
            },
            kv_bytes_read: m.kv_bytes_read,
            tokens_per_page: rt.block_size,
            wasted_bytes_per_page: (page_bytes
                - rt.block_size as usize * shapes[e].bytes_per_token())
                as u64,
            // Every engine's cache is a view of the arena, on the CPU and the CUDA path.
            kv_bytes_allocated: 0,
            reclaim_steps: StepLatency::of(&m.reclaim_steps),
            prefix_hit_rate: ratio(stats.prefix_hit_tokens, stats.prefix_prompt_tokens),
            prefix_reused_tokens: stats.prefix_reused_tokens,
            ttft_p50_ms: Latency::of(&[m.ttft_ms[0].as_slice(), m.ttft_ms[1].as_slice()].concat())
                .p50_ms,
        });
    }
    let prefix_hit_rate = ratio(
        engines
            .iter()
            .map(|e| e.batcher().stats().prefix_hit_tokens)
            .sum(),
        engines
            .iter()
            .map(|e| e.batcher().stats().prefix_prompt_tokens)
            .sum(),
    );
    let all_ttft: Vec<f64> = engines
        .iter()
        .flat_map(|e| e.metrics.ttft_ms.iter().flatten().copied())
        .collect();
    let all_reclaims: Vec<u64> = engines
        .iter()
        .flat_map(|e| e.metrics.reclaim_steps.iter().copied())
        .collect();
    // The arena is allocated once whatever the device, and every engine's cache is a view of
    // it (CPU and CUDA), so the two figures are equal by construction.
    let kv_pool_bytes = shared.total_bytes();
    let kv_bytes_allocated = kv_pool_bytes;
    let finished: u64 = reports.iter().map(|r| r.finished).sum();
    let generated: u64 = reports.iter().map(|r| r.generated_tokens).sum();
    let scheduled: u64 = reports.iter().map(|r| r.scheduled_tokens).sum();
    let kv_read: u64 = reports.iter().map(|r| r.kv_bytes_read).sum();
    let schedule_s: Vec<f64> = engines
        .iter()
        .map(|e| e.metrics.schedule_wall.as_secs_f64())
        .collect();
    let wall = WallReport {
        elapsed_s: elapsed,
        tokens_per_s: generated as f64 / elapsed,
        scheduled_per_s: scheduled as f64 / elapsed,
        kv_read_gb_per_s: kv_read as f64 / elapsed / 1e9,
        engine_kernel_s: engines
            .iter()
            .map(|e| e.metrics.kernel_wall.as_secs_f64())
            .collect(),
        schedule_us_per_step: schedule_s.iter().sum::<f64>() * 1e6
            / (steps_run.max(1) as f64 * n as f64),
        engine_schedule_s: schedule_s,
    };
    // Blocks still allocated although every engine went idle would be a leak. (After a forced
    // stop, unfinished sequences legitimately hold blocks; dropping the engines frees them.)
    let forced = refused_all.timed_out > 0;
    // Pages only the prefix cache holds are not leaked: drop them before counting.
    if let Some(cache) = shared.prefix_cache() {
        cache.clear();
    }
    // Count while the engines live: dropping an engine frees all its batcher still holds, so
    // a count after the drop cannot see pages an idle engine kept.
    let held_while_idle = pool.total() - pool.free_count();
    drop(engines);
    let leaked_blocks = if forced {
        // Unfinished sequences held pages legitimately; dropping the engines must free them.
        pool.total() - pool.free_count()
    } else {
        held_while_idle
    };
    Ok(Report {
        seed: cfg.seed,
        device: device.describe(),
        duration_s: cfg.duration_s,
        step_ms: cfg.step_ms,
        steps: steps_run,
        pool_blocks: cfg.pool_blocks,
        page_bytes: page_bytes as u64,
        kv_pool_bytes,
        kv_bytes_allocated,
        reclaim_steps: StepLatency::of(&all_reclaims),
        requests: total,
        finished,
        refused: refused_all,
        tokens_per_s: generated as f64 / sim_seconds,
        kv_utilisation_mean: used_sum / steps_run.max(1) as f64 / f64::from(cfg.pool_blocks),
        kv_utilisation_peak: f64::from(used_peak) / f64::from(cfg.pool_blocks),
        kv_sequence_utilisation_mean: seq_sum
            / steps_run.max(1) as f64
            / f64::from(cfg.pool_blocks),
        kv_sequence_utilisation_peak: seq_peak as f64 / f64::from(cfg.pool_blocks),
        leaked_blocks,
        saturated_ticks,
        prefix_cache: cfg.prefix_cache,
        prefix_hit_rate,
        ttft_p50_ms: Latency::of(&all_ttft).p50_ms,
        engines: reports,
        timeline,
        wall,
    })
}

/// Most steps a run simulates: its arrivals six times over, then 4000 steps to drain.
fn step_limit(cfg: &SimConfig) -> u64 {
    ((cfg.duration_s * 1e3 / cfg.step_ms).ceil() as u64) * 6 + 4000
}

fn ratio(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

fn sum_where(per_tick: &[u32], mask: &[bool]) -> u64 {
    per_tick
        .iter()
        .zip(mask)
        .filter(|(_, &m)| m)
        .map(|(&x, _)| u64::from(x))
        .sum()
}
