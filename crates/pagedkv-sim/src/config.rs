//! What a simulation runs: the device, the engines (models) and their traffic.

use pagedkv::kv::KvDtype;
use pagedkv::sched::admission::OverflowPolicy;
use pagedkv::sched::PreemptionMode;

/// A period during which one engine's arrival rate is multiplied.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Burst {
    /// Start, in simulated seconds.
    pub start_s: f64,
    /// Length, in simulated seconds.
    pub len_s: f64,
    /// Rate multiplier.
    pub factor: f64,
}

/// One engine: a model's geometry, its share weight and its traffic.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineSpec {
    /// Display name.
    pub name: String,
    /// Share weight for the budget coordinator.
    pub weight: u32,
    /// Transformer layers whose KV the engine keeps.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads (grouped-query attention when fewer than `heads`).
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Longest context a sequence may reach.
    pub max_context: u32,
    /// Mean arrival rate, requests per simulated second.
    pub rate: f64,
    /// Fraction of requests in the latency-critical class.
    pub latency_fraction: f64,
    /// Mean prompt length (log-normal, heavy-tailed).
    pub prompt_mean: f64,
    /// Longest prompt.
    pub max_prompt: u32,
    /// Mean output length (log-normal, heavy-tailed).
    pub output_mean: f64,
    /// Longest output.
    pub max_output: u32,
    /// Overload period, if any.
    pub burst: Option<Burst>,
    /// Most sequences running at once.
    pub max_running: u32,
    /// Tokens of the model's system prompt, which starts every one of its prompts (0: none).
    pub system_prompt: u32,
}

/// The whole run.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Seed of the workload, the projections and the sampling.
    pub seed: u64,
    /// Simulated time to generate arrivals for, in seconds; the run then drains.
    pub duration_s: f64,
    /// Simulated time of one engine step, in milliseconds (latencies are reported in
    /// simulated time, so the report is the same on every machine).
    pub step_ms: f64,
    /// KV blocks of the shared device pool.
    pub pool_blocks: u32,
    /// Tokens per page (block) of the model with the largest per-token KV, a power of two from
    /// 8 to 256: it sizes the arena's page; smaller models get more tokens per page (see
    /// [`pagedkv::kv::ArenaView`]).
    pub block_size: u32,
    /// KV dtype.
    pub dtype: KvDtype,
    /// Global tokens per step, split by the budget coordinator.
    pub tokens_per_step: u32,
    /// Most of the global budget (per mille) one engine may get.
    pub cap_permille: u16,
    /// Most prompt tokens of one sequence per step.
    pub prefill_chunk: u32,
    /// Client threads submitting requests.
    pub clients: usize,
    /// Capacity of each engine's admission queue, per priority class. A capacity above the
    /// requests an engine gets in a class never fills: it is not allocated, and any such value
    /// (up to `usize::MAX`) runs as an unbounded queue.
    pub queue_capacity: usize,
    /// What a full admission queue does.
    pub overflow: OverflowPolicy,
    /// Preemption mode of every engine.
    pub preemption: PreemptionMode,
    /// Host swap blocks per engine.
    pub swap_blocks: u32,
    /// Most requests an engine takes from its queue per step (at least 1).
    pub admit_per_step: usize,
    /// Whether the engines share a prefix cache on the arena.
    pub prefix_cache: bool,
    /// The engines.
    pub engines: Vec<EngineSpec>,
}

impl Default for SimConfig {
    /// Three models of different geometry, weights 3:2:1, on one pool; the code model gets a
    /// burst that overloads it, the batch model is silent for the first 8 s. Sized to finish within a minute on 2 CPU cores.
    fn default() -> Self {
        Self {
            seed: 42,
            duration_s: 20.0,
            step_ms: 25.0,
            pool_blocks: 1536,
            block_size: 16,
            dtype: KvDtype::F32,
            tokens_per_step: 256,
            cap_permille: 800,
            prefill_chunk: 128,
            clients: 2,
            queue_capacity: 64,
            overflow: OverflowPolicy::DropNewest,
            preemption: PreemptionMode::Swap,
            swap_blocks: 256,
            admit_per_step: 8,
            prefix_cache: true,
            engines: vec![
                EngineSpec {
                    name: "chat-gqa".into(),
                    weight: 3,
                    layers: 2,
                    heads: 16,
                    kv_heads: 4,
                    head_dim: 64,
                    max_context: 4096,
                    rate: 5.0,
                    latency_fraction: 0.7,
                    prompt_mean: 160.0,
                    max_prompt: 1536,
                    output_mean: 96.0,
                    max_output: 512,
                    burst: None,
                    max_running: 48,
                    system_prompt: 192,
                },
                EngineSpec {
                    name: "code-mqa".into(),
                    weight: 2,
                    layers: 2,
                    heads: 8,
                    kv_heads: 1,
                    head_dim: 128,
                    max_context: 4096,
                    rate: 2.5,
                    latency_fraction: 0.4,
                    prompt_mean: 320.0,
                    max_prompt: 2048,
                    output_mean: 128.0,
                    max_output: 512,
                    burst: Some(Burst {
                        start_s: 6.0,
                        len_s: 4.0,
                        factor: 5.0,
                    }),
                    max_running: 48,
                    system_prompt: 256,
                },
                EngineSpec {
                    name: "batch-mha".into(),
                    weight: 1,
                    layers: 2,
                    heads: 8,
                    kv_heads: 8,
                    head_dim: 64,
                    max_context: 4096,
                    rate: 2.0,
                    latency_fraction: 0.1,
                    prompt_mean: 256.0,
                    max_prompt: 1536,
                    output_mean: 160.0,
                    max_output: 768,
                    // Silent for the first 8 s: its share of the pool is lent to the others
                    // (the code model's burst borrows it) and reclaimed when it wakes up.
                    burst: Some(Burst {
                        start_s: 0.0,
                        len_s: 8.0,
                        factor: 0.0,
                    }),
                    max_running: 48,
                    system_prompt: 128,
                },
            ],
        }
    }
}

impl EngineSpec {
    /// The model's KV shape in `dtype` (what the arena lays over its pages).
    pub fn kv_shape(&self, dtype: pagedkv::kv::KvDtype) -> pagedkv::kv::ModelKvShape {
        pagedkv::kv::ModelKvShape {
            num_layers: self.layers,
            num_kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            dtype,
        }
    }

    /// An engine sized from a llama-family model's hyperparameters (a GGUF file's), with the
    /// traffic of `traffic`. At most `max_layers` layers are simulated: the KV of every layer is
    /// real, and a CPU run of all of a large model's layers would take minutes.
    pub fn from_llama(
        name: &str,
        params: &pagedkv::gguf::LlamaParams,
        weight: u32,
        max_layers: usize,
        traffic: &EngineSpec,
    ) -> Result<Self, crate::error::SimError> {
        let bad = |why: String| {
            Err(crate::error::SimError::InvalidConfig(format!(
                "{name}: {why}"
            )))
        };
        if params.n_heads == 0 || params.n_kv_heads == 0 || params.n_heads % params.n_kv_heads != 0
        {
            return bad(format!(
                "{} query heads is not a positive multiple of {} KV heads",
                params.n_heads, params.n_kv_heads
            ));
        }
        if params.head_dim == 0 || params.head_dim % 8 != 0 {
            return bad(format!(
                "head dim {} is not a positive multiple of 8",
                params.head_dim
            ));
        }
        if params.head_dim != params.head_dim_v {
            return bad(format!(
                "key head dim {} differs from value head dim {}; the paged layout holds one",
                params.head_dim, params.head_dim_v
            ));
        }
        Ok(Self {
            name: name.to_owned(),
            weight,
            layers: (params.n_layers as usize).clamp(1, max_layers.max(1)),
            heads: params.n_heads as usize,
            kv_heads: params.n_kv_heads as usize,
            head_dim: params.head_dim as usize,
            max_context: params.context_length.clamp(16, traffic.max_context.max(16)),
            ..traffic.clone()
        })
    }
}
