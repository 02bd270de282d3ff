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
    /// Tokens per KV page (block size): a power of two from
    /// [`MIN_TOKENS_PER_PAGE`](pagedkv::kv::MIN_TOKENS_PER_PAGE) to
    /// [`MAX_TOKENS_PER_PAGE`](pagedkv::kv::MAX_TOKENS_PER_PAGE) (the block sizes the arena's
    /// views and the kernels take); another is refused when the engine is built.
    pub tokens_per_page: usize,
    /// Pages in the arena: the KV memory of all sequences together.
    pub pages: u32,
    /// Most sequences running at once.
    pub max_running: u32,
    /// Most tokens in one step.
    pub max_batched_tokens: u32,
    /// Most prompt tokens of one sequence in one step (chunked prefill).
    pub max_prefill_chunk: u32,
    /// Most positions one sequence runs: its prompt and every output token but the last
    /// (sampled, never fed back: [`SeqRequest::max_cached_tokens`]), so a prompt of `p` tokens
    /// may ask for up to `max_context + 1 - p` new ones. At most the file's
    /// `llama.context_length` (the positions the model was trained for): a longer one is
    /// refused when the engine is built ([`Error::ContextTooLong`]), not capped.
    pub max_context: u32,
    /// What preemption does with a victim's KV.
    pub preemption: PreemptionMode,
    /// Host swap slots for swap preemption; ignored (no swap space is allocated for them)
    /// under [`PreemptionMode::Recompute`].
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
///
/// # Errors
/// [`Error::ContextTooLong`] if `setup.max_context` exceeds the model's
/// `context_length`; [`KvError::TokensPerPage`](pagedkv::error::KvError::TokensPerPage) for
/// a `tokens_per_page` that is not a block size; the engine's, arena's and geometry's
/// refusals.
pub fn build_engine(cfg: &LlamaConfig, setup: &EngineSetup) -> Result<Engine<HostBackend<f32>>> {
    let engine_cfg = engine_config(cfg, setup)?;
    let shape = cfg.kv_shape();
    let page_bytes = page_bytes_for(&[shape], setup.tokens_per_page)?;
    let budget = BudgetConfig::new(1, setup.max_batched_tokens, setup.pages);
    let shared = SharedArena::host(budget, page_bytes)?;
    Ok(Engine::host(&shared, engine_cfg, &shape, cfg.n_heads())?)
}

/// The engine configuration of `setup` for `cfg`'s model (one model, no prefix cache): no
/// swap slots under recompute preemption (the backend's swap space is sized by them, and
/// recompute never swaps).
///
/// # Errors
/// [`Error::ContextTooLong`] if `setup.max_context` exceeds the model's `context_length`.
pub(crate) fn engine_config(cfg: &LlamaConfig, setup: &EngineSetup) -> Result<EngineConfig> {
    let context_length = cfg.params.context_length;
    if setup.max_context > context_length {
        return Err(Error::ContextTooLong {
            max_context: setup.max_context,
            context_length,
        });
    }
    Ok(EngineConfig {
        weight: 1,
        max_running: setup.max_running,
        max_batched_tokens: setup.max_batched_tokens,
        max_prefill_chunk: setup.max_prefill_chunk,
        max_context: setup.max_context,
        preemption: setup.preemption,
        // The engine allocates swap space only under swap preemption.
        swap_blocks: setup.swap_blocks,
        recompute: RecomputePolicy::SERVER,
        prefix_cache: false,
    })
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
/// before it stay queued. A step that fails ends the generation with
/// [`Error::StepFailed`], which keeps the outputs of the sequences finished before it.
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
            gen.elapsed = start.elapsed();
            return Err(Error::StepLimit {
                steps: max_steps,
                partial: Box::new(gen),
            });
        }
        let report = match engine.step(model) {
            Ok(report) => report,
            Err(source) => {
                // The outputs already taken from the engine are returned, not dropped with
                // the error: their sequences are gone from the engine.
                gen.elapsed = start.elapsed();
                return Err(Error::StepFailed {
                    source,
                    partial: Box::new(gen),
                });
            }
        };
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
