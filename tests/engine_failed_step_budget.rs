//! What a failed step (its execute or its commit) leaves in the budget coordinator: tokens an
//! engine borrowed for the step go back at once, as after a commit, so that the engine they were
//! lent by gets its whole share at its next step; a dropped engine gives back everything.

use pagedkv::budget::BudgetConfig;
use pagedkv::engine::{
    Engine, EngineConfig, HostBackend, LayerQkv, RecomputePolicy, SharedArena, StepModel,
};
use pagedkv::error::EngineError;
use pagedkv::kv::{page_bytes_for, KvDtype, ModelKvShape};
use pagedkv::sched::{Batch, PreemptionMode, Priority, SeqRequest, StopRules};
use std::sync::Arc;

const HEADS: usize = 2;
const TOKENS_PER_STEP: u32 = 128;

fn shape() -> ModelKvShape {
    ModelKvShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 8,
        dtype: KvDtype::F32,
    }
}

/// Where the model fails when armed.
#[derive(Clone, Copy, Debug, PartialEq)]
enum FailAt {
    Execute,
    Sample,
}

/// Constant projections, a constant sampled token; fails at `fail` when set.
struct Stub {
    q: Vec<f32>,
    kv: Vec<f32>,
    fail: Option<FailAt>,
}

impl Stub {
    fn new() -> Self {
        Self {
            q: Vec::new(),
            kv: Vec::new(),
            fail: None,
        }
    }
}

impl StepModel<HostBackend<f32>> for Stub {
    fn qkv(
        &mut self,
        _: &HostBackend<f32>,
        _: usize,
        batch: &Batch,
    ) -> Result<LayerQkv<'_, [f32]>, EngineError> {
        let n = batch.num_tokens();
        let d = shape().head_dim;
        self.q = vec![0.5; n * HEADS * d];
        self.kv = vec![0.25; n * shape().num_kv_heads * d];
        Ok(LayerQkv {
            query: &self.q,
            key: &self.kv,
            value: &self.kv,
        })
    }
    fn attended(&mut self, layer: usize, _: &Batch, _: &[f32]) -> Result<(), EngineError> {
        if self.fail == Some(FailAt::Execute) {
            return Err(EngineError::Model(format!(
                "injected failure at layer {layer}"
            )));
        }
        Ok(())
    }
    fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError> {
        if self.fail == Some(FailAt::Sample) {
            return Err(EngineError::Model("injected sampling failure".into()));
        }
        out.extend(batch.logits_indices.iter().map(|_| 5));
        Ok(())
    }
}

fn config() -> EngineConfig {
    EngineConfig {
        weight: 1,
        max_running: 8,
        max_batched_tokens: TOKENS_PER_STEP,
        max_prefill_chunk: TOKENS_PER_STEP,
        max_context: 1024,
        preemption: PreemptionMode::Recompute,
        swap_blocks: 0,
        recompute: RecomputePolicy::SERVER,
        prefix_cache: false,
    }
}

fn request(id: u64, prompt: usize, out: u32) -> SeqRequest {
    SeqRequest {
        id,
        prompt: vec![3; prompt],
        stop: StopRules {
            max_new_tokens: out,
            eos: Vec::new(),
            stop_sequences: Vec::new(),
        },
        priority: Priority::Throughput,
    }
}

/// Two engines of equal weight on one arena (shares of 64 tokens each).
fn two_engines() -> (
    Arc<SharedArena>,
    Engine<HostBackend<f32>>,
    Engine<HostBackend<f32>>,
) {
    let page_bytes = page_bytes_for(&[shape()], 16).unwrap();
    let shared = SharedArena::host(BudgetConfig::new(2, TOKENS_PER_STEP, 256), page_bytes).unwrap();
    let a = Engine::host(&shared, config(), &shape(), HEADS).unwrap();
    let b = Engine::host(&shared, config(), &shape(), HEADS).unwrap();
    (shared, a, b)
}

/// A borrower whose step fails gives back what it holds above its share at once, as its commit
/// would have: before, the failed step kept the borrowed tokens until the engine's next
/// schedule, and the lender, whose work grew meanwhile, got only what the device had left.
#[test]
fn a_failed_step_gives_back_the_tokens_it_borrowed() {
    for fail in [FailAt::Execute, FailAt::Sample] {
        let (shared, mut a, mut b) = two_engines();
        let c = shared.coordinator().clone();
        let (mut ma, mut mb) = (Stub::new(), Stub::new());
        // The lender decodes one sequence: a low demand, its share lent to the borrower.
        b.add(request(1, 4, 500)).unwrap();
        for _ in 0..3 {
            b.step(&mut mb).unwrap();
        }
        // The borrower works through long prompts: its grant is the cut, it wants more.
        for id in 0..4 {
            a.add(request(10 + id, 400, 8)).unwrap();
        }
        a.step(&mut ma).unwrap();
        b.step(&mut mb).unwrap();
        let share = c.token_share(a.id());
        assert_eq!(share, TOKENS_PER_STEP / 2);
        ma.fail = Some(fail);
        assert!(a.step(&mut ma).is_err());
        assert!(
            a.batch().num_tokens() > share as usize,
            "{fail:?}: the failed step must have borrowed"
        );
        assert!(
            c.tokens_granted(a.id()) <= u64::from(share),
            "{fail:?}: the failed step still holds {} tokens above its share of {share}",
            c.tokens_granted(a.id()) - u64::from(share)
        );
        // The lender's work grows: its next step gets its whole share.
        b.add(request(2, 300, 4)).unwrap();
        let report = b.step(&mut mb).unwrap();
        assert_eq!(
            report.scheduled,
            c.token_share(b.id()),
            "{fail:?}: the lender's step did not get its share"
        );
        assert!(c.tokens_in_use() <= u64::from(TOKENS_PER_STEP));
        // The borrower's next step discards the failed batch and works on.
        ma.fail = None;
        a.step(&mut ma).unwrap();
        drop((a, b));
        assert_eq!(c.tokens_in_use(), 0);
        assert_eq!(c.blocks_in_use(), 0);
        assert_eq!(shared.pool().free_count(), shared.pool().total());
    }
}

/// An engine dropped right after a failed step (its batch pending, its grant held) gives back
/// every page and token and leaves the coordinator; the other engine's share grows to the whole.
#[test]
fn an_engine_dropped_after_a_failed_step_gives_back_everything() {
    for fail in [FailAt::Execute, FailAt::Sample] {
        let (shared, mut a, mut b) = two_engines();
        let c = shared.coordinator().clone();
        let (mut ma, mut mb) = (Stub::new(), Stub::new());
        b.add(request(1, 4, 500)).unwrap();
        b.step(&mut mb).unwrap();
        for id in 0..4 {
            a.add(request(10 + id, 100, 8)).unwrap();
        }
        a.step(&mut ma).unwrap();
        ma.fail = Some(fail);
        assert!(a.step(&mut ma).is_err());
        let id = a.id();
        drop(a);
        assert!(
            !c.is_registered(id),
            "{fail:?}: the dropped engine is registered"
        );
        assert_eq!(c.tokens_granted(id), 0);
        assert_eq!(c.tokens_in_use(), c.tokens_granted(b.id()));
        assert_eq!(c.blocks_in_use(), c.blocks_held(b.id()));
        b.step(&mut mb).unwrap();
        assert_eq!(c.token_share(b.id()), TOKENS_PER_STEP);
        drop(b);
        assert_eq!(c.tokens_in_use(), 0);
        assert_eq!(shared.pool().free_count(), shared.pool().total());
    }
}
