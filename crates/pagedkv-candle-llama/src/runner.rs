//! Running the model on a pagedkv engine: one host arena, one engine, greedy generation to
//! completion.

use crate::config::LlamaConfig;
use crate::error::{Error, Result};
use crate::model::PagedLlama;
use pagedkv::budget::BudgetConfig;
use pagedkv::engine::{
    Engine, EngineConfig, HostBackend, KvBackend, RecomputePolicy, SharedArena, StepModel,
};
use pagedkv::kv::page_bytes_for;
use pagedkv::sched::{PreemptionMode, SeqId, SeqRequest};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The engine's shape and limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineSetup {
    /// Tokens per KV page (block size).
    pub tokens_per_page: usize,
    /// Pages in the arena: the KV memory of all sequences together.
    pub pages: u32,
    /// Most sequences running at once.
    pub max_running: u32,
    /// Most tokens in one step.
    pub max_batched_tokens: u32,
    /// Most prompt tokens of one sequence in one step (chunked prefill).
    pub max_prefill_chunk: u32,
    /// Longest sequence (prompt and output).
    pub max_context: u32,
    /// What preemption does with a victim's KV.
    pub preemption: PreemptionMode,
    /// Host swap slots for swap preemption.
    pub swap_blocks: u32,
}

impl Default for EngineSetup {
    fn default() -> Self {
        Self {
            tokens_per_page: 16,
            pages: 256,
            max_running: 32,
            max_batched_tokens: 256,
            max_prefill_chunk: 128,
            max_context: 1024,
            preemption: PreemptionMode::Recompute,
            swap_blocks: 64,
        }
    }
}

/// An engine for `cfg`'s model on a host arena of its own (f32 KV, pagedkv's CPU kernels).
pub fn build_engine(cfg: &LlamaConfig, setup: &EngineSetup) -> Result<Engine<HostBackend<f32>>> {
    let shape = cfg.kv_shape();
    let page_bytes = page_bytes_for(&[shape], setup.tokens_per_page)?;
    let budget = BudgetConfig::new(1, setup.max_batched_tokens, setup.pages);
    let shared = SharedArena::host(budget, page_bytes)?;
    Ok(Engine::host(
        &shared,
        engine_config(setup),
        &shape,
        cfg.n_heads(),
    )?)
}

/// The engine configuration of `setup` (one model, no prefix cache).
pub(crate) fn engine_config(setup: &EngineSetup) -> EngineConfig {
    EngineConfig {
        weight: 1,
        max_running: setup.max_running,
        max_batched_tokens: setup.max_batched_tokens,
        max_prefill_chunk: setup.max_prefill_chunk,
        max_context: setup.max_context,
        preemption: setup.preemption,
        swap_blocks: setup.swap_blocks,
        recompute: RecomputePolicy::SERVER,
        prefix_cache: false,
    }
}

/// What [`generate`] produced.
#[derive(Debug, Clone, Default)]
pub struct Generation {
    /// Each sequence's generated tokens.
    pub outputs: BTreeMap<SeqId, Vec<u32>>,
    /// Engine steps run.
    pub steps: u64,
    /// Tokens sampled (generated).
    pub generated: u64,
    /// Tokens run through the model: prompts, recomputed tokens and every decode step's input
    /// token.
    pub scheduled: u64,
    /// Wall time of the steps.
    pub elapsed: Duration,
}

impl Generation {
    /// Generated tokens per second of wall time.
    pub fn tokens_per_second(&self) -> f64 {
        self.generated as f64 / self.elapsed.as_secs_f64().max(f64::MIN_POSITIVE)
    }
}

/// Queues `requests` and steps the engine with `model` (a [`PagedLlama`], or a wrapper around
/// one) until every sequence finished, or `max_steps`.
///
/// Every request is checked ([`PagedLlama::check_request`]) before any is queued; if the
/// engine then refuses one (a duplicate id, a prompt longer than its context), the requests
/// before it stay queued.
pub fn generate<B: KvBackend, M: StepModel<B> + AsRef<PagedLlama> + ?Sized>(
    engine: &mut Engine<B>,
    model: &mut M,
    requests: impl IntoIterator<Item = SeqRequest>,
    max_steps: u64,
) -> Result<Generation> {
    let requests: Vec<SeqRequest> = requests.into_iter().collect();
    for r in &requests {
        model.as_ref().check_request(r)?;
    }
    for r in requests {
        engine.add(r)?;
    }
    let mut gen = Generation::default();
    let start = Instant::now();
    while engine.has_work() {
        if gen.steps == max_steps {
            return Err(Error::StepLimit(max_steps));
        }
        let report = engine.step(model)?;
        gen.steps += 1;
        gen.generated += u64::from(report.sampled);
        gen.scheduled += u64::from(report.scheduled);
        for f in engine.finished() {
            gen.outputs.insert(f.id, f.output.clone());
        }
    }
    gen.elapsed = start.elapsed();
    Ok(gen)
}
