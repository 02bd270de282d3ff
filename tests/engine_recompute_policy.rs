//! When an engine recomputes the coordinator's budgets ([`RecomputePolicy`]): at every
//! `every_steps`-th committed step and at no other, and never at its steps under the caller's
//! policy. Each recomputation moves the coordinator's publication epoch, which is what these
//! tests watch (tests/engine_driver.rs checks that failed steps do not shift the count).

use pagedkv::budget::BudgetConfig;
use pagedkv::engine::{
    Engine, EngineConfig, HostBackend, LayerQkv, RecomputePolicy, SharedArena, StepModel,
};
use pagedkv::error::EngineError;
use pagedkv::kv::{page_bytes_for, KvDtype, ModelKvShape};
use pagedkv::sched::{Batch, PreemptionMode, Priority, SeqRequest, StopRules};

const HEADS: usize = 2;

fn shape() -> ModelKvShape {
    ModelKvShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 8,
        dtype: KvDtype::F32,
    }
}

/// Constant projections and a constant sampled token: only the step count matters here.
#[derive(Default)]
struct Constant {
    q: Vec<f32>,
    kv: Vec<f32>,
}

impl StepModel<HostBackend<f32>> for Constant {
    fn qkv(
        &mut self,
        _: &HostBackend<f32>,
        _: usize,
        batch: &Batch,
    ) -> Result<LayerQkv<'_, [f32]>, EngineError> {
        let (n, d) = (batch.num_tokens(), shape().head_dim);
        self.q = vec![1.0; n * HEADS * d];
        self.kv = vec![1.0; n * shape().num_kv_heads * d];
        Ok(LayerQkv {
            query: &self.q,
            key: &self.kv,
            value: &self.kv,
        })
    }
    fn attended(&mut self, _: usize, _: &Batch, _: &[f32]) -> Result<(), EngineError> {
        Ok(())
    }
    fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError> {
        out.extend(batch.logits_indices.iter().map(|_| 7));
        Ok(())
    }
}

/// One engine under `recompute`, with one sequence that decodes for longer than the test
/// steps; returns the coordinator's epoch after each of `steps` committed steps.
fn epochs_after_each_step(recompute: RecomputePolicy, steps: usize) -> Vec<u64> {
    let page_bytes = page_bytes_for(&[shape()], 16).unwrap();
    let shared = SharedArena::host(BudgetConfig::new(1, 64, 64), page_bytes).unwrap();
    let cfg = EngineConfig {
        weight: 1,
        max_running: 4,
        max_batched_tokens: 64,
        max_prefill_chunk: 64,
        max_context: 256,
        preemption: PreemptionMode::Recompute,
        swap_blocks: 0,
        recompute,
        prefix_cache: false,
    };
    let mut engine = Engine::host(&shared, cfg, &shape(), HEADS).unwrap();
    engine
        .add(SeqRequest {
            id: 1,
            prompt: vec![3; 8],
            stop: StopRules {
                max_new_tokens: 100,
                eos: Vec::new(),
                stop_sequences: Vec::new(),
            },
            priority: Priority::Throughput,
        })
        .unwrap();
    let mut model = Constant::default();
    let c = shared.coordinator();
    // The first step under the caller's policy schedules nothing until the caller recomputes
    // (the engine only reports itself active): recomputed here, before counting.
    engine.schedule();
    c.recompute();
    let mut epochs = Vec::new();
    for _ in 0..steps {
        engine.step(&mut model).unwrap();
        epochs.push(c.epoch());
    }
    epochs
}

/// At every `every_steps`-th committed step the engine recomputes, also when nothing marked
/// the coordinator's inputs changed (that is what refreshes the pages idle engines can lend as
/// holdings change), and at no step between: each recompute is a publishing round that every
/// engine's next step reads.
#[test]
fn an_engine_recomputes_at_every_nth_committed_step_only() {
    let policy = RecomputePolicy {
        when_dirty: false,
        every_steps: 3,
    };
    let epochs = epochs_after_each_step(policy, 6);
    let moved: Vec<bool> = epochs.windows(2).map(|w| w[1] != w[0]).collect();
    // Whether the epoch moved at committed steps 2, 3, 4, 5 and 6.
    assert_eq!(
        moved,
        [false, true, false, false, true],
        "epochs after committed steps 1..=6: {epochs:?}"
    );
}

/// Under the caller's policy the engine's steps never recompute (a deterministic simulation
/// recomputes once per simulated step itself).
#[test]
fn an_engine_under_the_callers_policy_never_recomputes() {
    let epochs = epochs_after_each_step(RecomputePolicy::CALLER, 6);
    assert!(
        epochs.windows(2).all(|w| w[0] == w[1]),
        "epochs after each step: {epochs:?}"
    );
}
