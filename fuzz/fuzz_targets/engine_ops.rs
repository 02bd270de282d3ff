//! Fuzz the engine driver (`engine::Engine` on the CPU backend over a shared host arena) with
//! arbitrary arena and engine configurations, model shapes and operation sequences: add (any
//! prompt, stop rules, priority, salt), abort, caller finish, draft proposals, whole steps and
//! split schedule / execute / commit, with a model that may fail or return the wrong number of
//! samples, engines dropped and re-created. Checks: no panic; every refusal is a typed error;
//! a refused `add` changes nothing; every step's results index their tokens and stream exactly
//! each finished sequence's output and reason; the budget's invariants hold after each step;
//! and at the end every engine drains, and the pool and the coordinator are back to empty.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pagedkv::budget::BudgetConfig;
use pagedkv::engine::{
    Engine, EngineConfig, HostBackend, LayerQkv, RecomputePolicy, SharedArena, StepModel,
};
use pagedkv::error::EngineError;
use pagedkv::kv::{page_bytes_for, KvDtype, ModelKvShape};
use pagedkv::sched::{Batch, FinishReason, PreemptionMode, Priority, SeqId, SeqRequest, StopRules};
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Debug, Arbitrary)]
struct Input {
    max_engines: u8,
    tokens_per_step: u16,
    total_blocks: u8,
    cap_permille: u16,
    tokens_per_page: u8,
    prefix_cache: bool,
    shapes: [(u8, u8, u8, u8); 2],
    configs: [Cfg; 2],
    samples: Vec<u8>,
    ops: Vec<Op>,
}

#[derive(Debug, Clone, Copy, Arbitrary)]
struct Cfg {
    weight: u8,
    max_running: u8,
    max_batched_tokens: u16,
    max_prefill_chunk: u16,
    max_context: u16,
    preemption: bool,
    swap_blocks: u8,
    when_dirty: bool,
    every_steps: u8,
    prefix_cache: bool,
}

#[derive(Debug, Arbitrary)]
enum Op {
    Add {
        e: u8,
        id: u8,
        prompt: u8,
        tok: u8,
        max_new: u8,
        eos: Option<u8>,
        stop: Option<(u8, u8)>,
        high: bool,
        salt: u8,
    },
    Abort {
        e: u8,
        id: u8,
    },
    Finish {
        e: u8,
        id: u8,
        code: u8,
    },
    Propose {
        e: u8,
        id: u8,
        drafts: Vec<u8>,
    },
    Step {
        e: u8,
        fail: Fail,
    },
    Schedule {
        e: u8,
    },
    Execute {
        e: u8,
        fail: Fail,
    },
    Commit {
        e: u8,
        fail: Fail,
    },
    Drop {
        e: u8,
    },
    Create {
        e: u8,
    },
}

#[derive(Debug, Clone, Copy, Arbitrary, PartialEq)]
enum Fail {
    None,
    QkvErr(u8),
    QkvShort(u8),
    AttendedErr(u8),
    SampleErr,
    SampleCount(i8),
}

/// A model whose projections are small functions of token and position, and whose samples
/// come from the fuzz input, with failures injected on request.
struct Model {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    samples: Vec<u8>,
    at: usize,
    fail: Fail,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl StepModel<HostBackend<f32>> for Model {
    fn qkv(
        &mut self,
        _backend: &HostBackend<f32>,
        layer: usize,
        batch: &Batch,
    ) -> Result<LayerQkv<'_, [f32]>, EngineError> {
        if self.fail == Fail::QkvErr(layer as u8) {
            return Err(EngineError::InvalidConfig("injected qkv failure".into()));
        }
        let n = batch.num_tokens();
        let f = |t: usize, i: usize| ((batch.input_tokens[t] as f32) * 0.1 + i as f32 * 0.01).sin();
        self.q = (0..n * self.heads * self.head_dim)
            .map(|i| f(i / (self.heads * self.head_dim), i))
            .collect();
        self.k = (0..n * self.kv_heads * self.head_dim)
            .map(|i| f(i / (self.kv_heads * self.head_dim), i + 7))
            .collect();
        self.v = (0..n * self.kv_heads * self.head_dim)
            .map(|i| f(i / (self.kv_heads * self.head_dim), i + 3))
            .collect();
        if self.fail == Fail::QkvShort(layer as u8) {
            self.k.pop();
        }
        Ok(LayerQkv {
            query: &self.q,
            key: &self.k,
            value: &self.v,
        })
    }

    fn attended(&mut self, layer: usize, batch: &Batch, out: &[f32]) -> Result<(), EngineError> {
        assert_eq!(out.len(), batch.num_tokens() * self.heads * self.head_dim);
        assert!(
            out.iter().all(|x| x.is_finite()),
            "attention output not finite"
        );
        if self.fail == Fail::AttendedErr(layer as u8) {
            return Err(EngineError::InvalidConfig(
                "injected attended failure".into(),
            ));
        }
        Ok(())
    }

    fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError> {
        if self.fail == Fail::SampleErr {
            return Err(EngineError::InvalidConfig("injected sample failure".into()));
        }
        let mut n = batch.logits_indices.len() as i64;
        if let Fail::SampleCount(d) = self.fail {
            n = (n + i64::from(d)).max(0);
        }
        for _ in 0..n {
            let b = if self.samples.is_empty() {
                0
            } else {
                self.samples[self.at % self.samples.len()]
            };
            self.at += 1;
            out.push(u32::from(b % 16));
        }
        Ok(())
    }
}

struct Slot {
    engine: Option<Engine<HostBackend<f32>>>,
    model: Model,
    shape: ModelKvShape,
    cfg: EngineConfig,
    /// Streamed tokens and end per sequence id.
    streamed: HashMap<SeqId, (Vec<u32>, Option<FinishReason>)>,
    ids: Vec<SeqId>,
    /// Updates of the current `results()` already recorded (they persist until the next
    /// schedule, and a repeated commit of the same batch adds none).
    seen: usize,
    /// The last schedule's batch was not committed (its step failed, or it is pending): the
    /// next schedule reports that schedule's ended sequences again (`Engine::schedule`).
    uncommitted: bool,
    /// Whether the current `results()` came from a schedule that followed an uncommitted
    /// step (they may repeat ends already recorded): what a commit's `record` is told.
    repeat: bool,
}

fn shape_of(s: (u8, u8, u8, u8)) -> (ModelKvShape, usize) {
    let kv = usize::from(s.1 % 2) + 1;
    let shape = ModelKvShape {
        num_layers: usize::from(s.0 % 2) + 1,
        num_kv_heads: kv,
        head_dim: 8 * (usize::from(s.2 % 3) + 1),
        dtype: KvDtype::F32,
    };
    (shape, kv * (usize::from(s.3 % 3) + 1))
}

fn cfg_of(c: Cfg) -> EngineConfig {
    EngineConfig {
        weight: u32::from(c.weight),
        max_running: u32::from(c.max_running % 16),
        max_batched_tokens: u32::from(c.max_batched_tokens % 300),
        max_prefill_chunk: u32::from(c.max_prefill_chunk % 300),
        max_context: u32::from(c.max_context % 600),
        preemption: if c.preemption {
            PreemptionMode::Swap
        } else {
            PreemptionMode::Recompute
        },
        swap_blocks: u32::from(c.swap_blocks % 64),
        recompute: RecomputePolicy {
            when_dirty: c.when_dirty,
            every_steps: u32::from(c.every_steps % 8),
        },
        prefix_cache: c.prefix_cache,
    }
}

/// Records the engine's new updates. `repeat`: this schedule followed one whose batch was not
/// committed, so the ends that schedule reported may come again (empty, the same reason).
fn record(slot: &mut Slot, repeat: bool) {
    let engine = slot.engine.as_ref().unwrap();
    let results = engine.results();
    if results.updates.len() < slot.seen {
        slot.seen = 0; // a new schedule cleared them
    }
    for u in &results.updates[slot.seen..] {
        assert!(u.tokens.start <= u.tokens.end && u.tokens.end <= results.tokens.len());
        let entry = slot.streamed.entry(u.id).or_default();
        if entry.1.is_some() {
            assert!(
                repeat && u.tokens.is_empty() && u.finished == entry.1,
                "seq {} updated after it finished",
                u.id
            );
            continue;
        }
        entry.0.extend_from_slice(results.tokens_of(u));
        entry.1 = u.finished;
    }
    slot.seen = results.updates.len();
    for f in engine.finished() {
        // `finished()` lasts until the next schedule: an id added again since then has a new
        // stream (unfinished, or not started), which this entry is not about.
        if let Some((tokens, Some(reason))) = slot.streamed.get(&f.id) {
            assert_eq!(tokens, &f.output, "seq {}", f.id);
            assert_eq!(*reason, f.reason);
        }
    }
}

fn check_shared(shared: &SharedArena) {
    let c = shared.coordinator();
    assert!(c.blocks_in_use() <= u64::from(shared.pool().total()));
    assert!(c.tokens_in_use() <= u64::from(c.config().tokens_per_step));
    assert!(c.snapshot().consistent);
}

fuzz_target!(|input: Input| {
    let max_engines = u16::from(input.max_engines % 4);
    let blocks = u32::from(input.total_blocks % 65);
    // Three in four inputs: 8, 16 or 32 tokens per page; the rest any count up to 63 (mostly
    // refused: only powers of two from 8 to 256 are).
    let tpp = match input.tokens_per_page % 4 {
        k @ 0..=2 => 8 << k,
        _ => usize::from(input.tokens_per_page / 4),
    };
    let shapes = input.shapes.map(shape_of);
    let Ok(page_bytes) = page_bytes_for(&shapes.map(|s| s.0), tpp) else {
        assert!(!tpp.is_power_of_two() || !(8..=256).contains(&tpp));
        return;
    };
    let budget = BudgetConfig::new(max_engines, u32::from(input.tokens_per_step % 512), blocks)
        .with_cap_permille(input.cap_permille % 1001);
    let mut shared = match SharedArena::host(budget, page_bytes) {
        Ok(s) => s,
        Err(_) => {
            assert!(max_engines == 0 || blocks == 0 || input.cap_permille % 1001 == 0);
            return;
        }
    };
    if input.prefix_cache {
        Arc::get_mut(&mut shared)
            .unwrap()
            .enable_prefix_cache(Some(7));
    }
    let mut slots: Vec<Slot> = (0..2)
        .map(|i| {
            let (shape, heads) = shapes[i];
            Slot {
                engine: None,
                model: Model {
                    heads,
                    kv_heads: shape.num_kv_heads,
                    head_dim: shape.head_dim,
                    samples: input.samples.clone(),
                    at: i,
                    fail: Fail::None,
                    q: vec![],
                    k: vec![],
                    v: vec![],
                },
                shape,
                cfg: cfg_of(input.configs[i]),
                streamed: HashMap::new(),
                ids: Vec::new(),
                seen: 0,
                uncommitted: false,
                repeat: false,
            }
        })
        .collect();
    let create = |slot: &mut Slot, shared: &Arc<SharedArena>| {
        let before = shared.coordinator().snapshot().engines.len();
        match Engine::host(shared, slot.cfg, &slot.shape, slot.model.heads) {
            Ok(e) => {
                slot.engine = Some(e);
                slot.seen = 0;
                slot.uncommitted = false;
                slot.repeat = false;
                slot.streamed.clear();
                slot.ids.clear();
            }
            Err(_) => {
                // A refused engine leaves no registration behind.
                assert_eq!(shared.coordinator().snapshot().engines.len(), before);
            }
        }
    };
    for slot in &mut slots {
        create(slot, &shared);
    }

    for op in input.ops.into_iter().take(200) {
        match op {
            Op::Add {
                e,
                id,
                prompt,
                tok,
                max_new,
                eos,
                stop,
                high,
                salt,
            } => {
                let slot = &mut slots[usize::from(e % 2)];
                let Some(engine) = slot.engine.as_mut() else {
                    continue;
                };
                let req = SeqRequest {
                    id: u64::from(id % 16),
                    prompt: (0..u32::from(prompt % 80))
                        .map(|i| (u32::from(tok) + i % 3) % 16)
                        .collect(),
                    stop: StopRules {
                        max_new_tokens: u32::from(max_new % 40),
                        eos: eos.map(|t| vec![u32::from(t % 16)]).unwrap_or_default(),
                        stop_sequences: stop
                            .map(|(a, b)| vec![vec![u32::from(a % 16), u32::from(b % 16)]])
                            .unwrap_or_default(),
                    },
                    priority: if high {
                        Priority::LatencyCritical
                    } else {
                        Priority::Throughput
                    },
                };
                let id = req.id;
                let free = shared.pool().free_count();
                let work = engine.has_work();
                match engine.add_salted(req, u64::from(salt % 2)) {
                    Ok(()) => {
                        slot.streamed.remove(&id);
                        slot.ids.push(id);
                    }
                    Err(_) => {
                        assert_eq!(
                            shared.pool().free_count(),
                            free,
                            "a refused add changed the pool"
                        );
                        assert_eq!(engine.has_work(), work);
                    }
                }
            }
            Op::Abort { e, id } => {
                let slot = &mut slots[usize::from(e % 2)];
                if let Some(engine) = slot.engine.as_mut() {
                    let _ = engine.abort(u64::from(id % 16));
                }
            }
            Op::Finish { e, id, code } => {
                let slot = &mut slots[usize::from(e % 2)];
                if let Some(engine) = slot.engine.as_mut() {
                    let _ =
                        engine.finish_with(u64::from(id % 16), FinishReason::Caller(code.into()));
                }
            }
            Op::Propose { e, id, drafts } => {
                let slot = &mut slots[usize::from(e % 2)];
                if let Some(engine) = slot.engine.as_mut() {
                    let d: Vec<u32> = drafts.iter().take(8).map(|&t| u32::from(t % 16)).collect();
                    let _ = engine.propose(u64::from(id % 16), &d);
                }
            }
            Op::Step { e, fail } => {
                let slot = &mut slots[usize::from(e % 2)];
                let Some(engine) = slot.engine.as_mut() else {
                    continue;
                };
                slot.model.fail = fail;
                slot.seen = 0;
                let repeat = slot.uncommitted;
                slot.repeat = repeat;
                let r = engine.step(&mut slot.model);
                slot.model.fail = Fail::None;
                slot.uncommitted = r.is_err();
                if fail == Fail::None {
                    r.as_ref()
                        .expect("a step with a well-behaved model succeeds");
                }
                // A server delivers nothing of a failed step: what it reported must come again
                // (checked at the end: every accepted request's stream ends).
                if r.is_ok() {
                    record(slot, repeat);
                }
            }
            Op::Schedule { e } => {
                let slot = &mut slots[usize::from(e % 2)];
                let Some(engine) = slot.engine.as_mut() else {
                    continue;
                };
                slot.seen = 0;
                let repeat = slot.uncommitted;
                slot.repeat = repeat;
                let batch = engine.schedule();
                assert_eq!(batch.input_tokens.len(), batch.positions.len());
                slot.uncommitted = true;
                record(slot, repeat);
            }
            Op::Execute { e, fail } => {
                let slot = &mut slots[usize::from(e % 2)];
                let Some(engine) = slot.engine.as_mut() else {
                    continue;
                };
                slot.model.fail = fail;
                let _ = engine.execute(&mut slot.model);
                slot.model.fail = Fail::None;
            }
            Op::Commit { e, fail } => {
                let slot = &mut slots[usize::from(e % 2)];
                let Some(engine) = slot.engine.as_mut() else {
                    continue;
                };
                slot.model.fail = fail;
                let r = engine.commit(&mut slot.model);
                slot.model.fail = Fail::None;
                if r.is_ok() {
                    slot.uncommitted = false;
                    let repeat = slot.repeat;
                    record(slot, repeat);
                }
            }
            Op::Drop { e } => {
                slots[usize::from(e % 2)].engine = None;
            }
            Op::Create { e } => {
                let slot = &mut slots[usize::from(e % 2)];
                if slot.engine.is_none() {
                    create(slot, &shared);
                }
            }
        }
        check_shared(&shared);
    }

    // Drain: abort everything, step each engine until idle.
    for slot in &mut slots {
        let Some(engine) = slot.engine.as_mut() else {
            continue;
        };
        for &id in &slot.ids {
            let _ = engine.abort(id);
        }
        let mut steps = 0;
        while slot.engine.as_ref().unwrap().has_work() {
            steps += 1;
            assert!(
                steps <= 64,
                "engine did not drain after aborting everything"
            );
            slot.seen = 0;
            let repeat = std::mem::replace(&mut slot.uncommitted, false);
            slot.engine
                .as_mut()
                .unwrap()
                .step(&mut slot.model)
                .expect("drain step");
            record(slot, repeat);
        }
        for id in &slot.ids {
            assert!(
                slot.streamed.get(id).is_some_and(|(_, end)| end.is_some()),
                "seq {id}: its end was never delivered"
            );
        }
        let id = slot.engine.as_ref().unwrap().id();
        assert_eq!(
            shared.coordinator().blocks_held(id),
            0,
            "idle engine holds blocks"
        );
    }
    drop(slots);
    if let Some(cache) = shared.prefix_cache() {
        cache.clear();
    }
    assert_eq!(
        shared.pool().free_count(),
        shared.pool().total(),
        "pages leaked"
    );
    assert_eq!(shared.coordinator().blocks_in_use(), 0);
    assert_eq!(shared.coordinator().tokens_in_use(), 0);
    assert!(shared.coordinator().snapshot().engines.is_empty());
});
