//! Fuzz the engine driver (`engine::Engine` on the CPU backend over a shared host arena) with
//! arbitrary arena and engine configurations, model shapes and operation sequences: add (any
//! prompt, stop rules, priority, salt), abort, caller finish, draft proposals, whole steps and
//! split schedule / execute / commit, with a model that may fail or return the wrong number of
//! samples, engines dropped and re-created. Checks: no panic; every refusal is a typed error;
//! a refused `add` changes nothing; every step's results index their tokens and stream exactly
//! each finished sequence's output and reason; the budget's invariants hold after each step,
//! and each engine owns in the pool exactly the pages its budget holds plus its cached-free
//! ones (an id no live engine has, none);
//! and at the end every engine drains, and the pool and the coordinator are back to empty.
//!
//! Against an independent record (`Expect`, built from the requests, the model's own samples
//! and the stop rules, never from the engine's results): every batch the model sees feeds each
//! sequence its prompt followed by its committed outputs at their positions, drafts only as
//! proposed and right after the last token, and asks for logits exactly where a new token is
//! due; every commit accepts exactly the drafts its samples confirm; and what is streamed is
//! what the samples and the stop rules (max_new_tokens, eos, stop sequences) or the caller's
//! end say, no token more or less, ended exactly when they say.
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
use std::collections::{HashMap, HashSet};
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
        /// Draft what the model will sample next (as if it were the only sampling row of the
        /// next step) where a draft byte is not a multiple of 4: arbitrary drafts are almost
        /// never all accepted, and the bonus token after them would go untested.
        peek: bool,
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
    /// The batch of the last `sample` call and the tokens it returned: what the harness's
    /// record commits (the engine's own account of them is what is under test).
    drawn: Option<(Batch, Vec<u32>)>,
}

impl Model {
    /// The token the `i`-th next sample will be.
    fn upcoming(&self, i: usize) -> u32 {
        match self.samples.len() {
            0 => 0,
            len => u32::from(self.samples[(self.at + i) % len] % 16),
        }
    }
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
        let first = out.len();
        for _ in 0..n {
            out.push(self.upcoming(0));
            self.at += 1;
        }
        self.drawn = Some((batch.clone(), out[first..].to_vec()));
        Ok(())
    }
}

/// The harness's own record of one sequence: its request, the tokens the model sampled for it
/// that a commit must have kept, and its end, derived here from the stop rules and the
/// caller's calls alone.
#[derive(Debug)]
struct Expect {
    prompt: Vec<u32>,
    stop: StopRules,
    /// Committed output: the model's samples at this sequence's logits, as accepted.
    out: Vec<u32>,
    /// Its end: a stop rule at a commit, the caller's at the schedule after it, or `TooLong`
    /// (the engine's call, which depends on the budget: taken from the stream, see
    /// `check_streams`).
    end: Option<FinishReason>,
    /// The first abort or `finish_with` accepted while it ran: applied at the next schedule.
    pending_end: Option<FinishReason>,
    /// The last accepted proposal, until a commit of one of its rows consumes it (the engine
    /// may drop it earlier, on preemption or a short token budget: a row may then have none).
    proposal: Vec<u32>,
}

impl Expect {
    /// Prompt then committed output: the tokens the model must be fed, by position.
    fn token_at(&self, pos: usize) -> Option<u32> {
        match pos.checked_sub(self.prompt.len()) {
            None => Some(self.prompt[pos]),
            Some(i) => self.out.get(i).copied(),
        }
    }

    fn len(&self) -> usize {
        self.prompt.len() + self.out.len()
    }

    /// The end `StopRules` documents after `out` got its last token: an eos token, the
    /// output (not the prompt) ending with a stop sequence, or `max_new_tokens` generated.
    fn stop_after_token(&self) -> Option<FinishReason> {
        let last = *self.out.last()?;
        if self.stop.eos.contains(&last) {
            Some(FinishReason::Eos)
        } else if self
            .stop
            .stop_sequences
            .iter()
            .any(|s| !s.is_empty() && self.out.ends_with(s))
        {
            Some(FinishReason::StopSequence)
        } else if self.out.len() >= self.stop.max_new_tokens as usize {
            Some(FinishReason::MaxTokens)
        } else {
            None
        }
    }
}

/// What a scheduled batch asks of its commit, as the record computed it: every row's
/// sequence, and for each sampling row (row order) its drafts.
#[derive(Debug, Default)]
struct Plan {
    rows: Vec<SeqId>,
    sampling: Vec<(SeqId, Vec<u32>)>,
}

/// A schedule applies the ends callers asked for since the last one (aborts, `finish_with`),
/// before it builds rows. Repeated schedules (after an uncommitted step) apply nothing new.
fn on_schedule(expect: &mut HashMap<SeqId, Expect>) {
    for e in expect.values_mut() {
        if e.end.is_none() {
            e.end = e.pending_end.take();
        }
    }
}

/// Checks the batch the model is given against the record, and returns what its commit must
/// do. Each row: a live sequence (once), consecutive positions, each known token the one at
/// its position (prompt, then committed output: after a preemption by recompute the outputs
/// are fed again like a prompt, and only the token after the last is sampled); drafts only as
/// last proposed, after exactly the last token; logits exactly at each row that reaches the
/// last token (its last token, and the tokens its drafts follow).
fn check_batch(expect: &HashMap<SeqId, Expect>, batch: &Batch) -> Plan {
    let rows = batch.seq_ids.len();
    assert_eq!(batch.input_tokens.len(), batch.positions.len());
    assert_eq!(batch.query_start_loc.len(), rows + 1);
    assert_eq!(batch.query_start_loc[0], 0);
    assert_eq!(batch.samples.len(), rows);
    assert_eq!(batch.drafts.len(), rows);
    assert_eq!(batch.context_lens.len(), rows);
    let mut plan = Plan::default();
    let mut logits = Vec::new();
    let mut seen = HashSet::new();
    let mut start = 0usize;
    for row in 0..rows {
        let id = batch.seq_ids[row];
        assert!(seen.insert(id), "seq {id} has two rows");
        let e = expect
            .get(&id)
            .unwrap_or_else(|| panic!("row for unknown seq {id}"));
        assert!(
            e.end.is_none(),
            "row for seq {id}, which ended ({:?})",
            e.end
        );
        let end = batch.query_start_loc[row + 1] as usize;
        assert!(
            start < end && end <= batch.input_tokens.len(),
            "seq {id}: empty row"
        );
        let first = batch.positions[start] as usize;
        for (k, t) in (start..end).enumerate() {
            assert_eq!(
                batch.positions[t] as usize,
                first + k,
                "seq {id}: positions"
            );
        }
        let last = first + (end - start) - 1;
        assert_eq!(
            batch.context_lens[row] as usize,
            last + 1,
            "seq {id}: context length"
        );
        let d = batch.drafts[row] as usize;
        let known = (end - start)
            .checked_sub(d)
            .expect("more drafts than tokens");
        for t in start..start + known {
            let pos = batch.positions[t] as usize;
            let want = e.token_at(pos).unwrap_or_else(|| {
                panic!("seq {id}: position {pos} past its {} known tokens", e.len())
            });
            assert_eq!(
                batch.input_tokens[t], want,
                "seq {id}: token at position {pos}"
            );
        }
        let drafts = batch.input_tokens[start + known..end].to_vec();
        let samples = first + known == e.len();
        assert_eq!(batch.samples[row], samples, "seq {id}: sampling row");
        if d > 0 {
            assert_eq!(drafts, e.proposal, "seq {id}: drafts not the ones proposed");
            assert!(
                known == 1 && samples,
                "seq {id}: drafts not right after its last token"
            );
        }
        if samples {
            logits.extend((end - 1 - d..end).map(|i| i as i32));
            plan.sampling.push((id, drafts));
        }
        plan.rows.push(id);
        start = end;
    }
    assert_eq!(start, batch.input_tokens.len(), "tokens outside every row");
    assert_eq!(batch.logits_indices, logits, "logits indices");
    plan
}

/// Commits `drawn` (the model's samples, row order) as the record says: per sampling row the
/// drafts its samples confirm, then one sampled token, stopping at the first token that ends
/// the sequence. Every scheduled row's proposal is consumed.
fn on_commit(expect: &mut HashMap<SeqId, Expect>, plan: &Plan, drawn: &[u32]) {
    let want: usize = plan.sampling.iter().map(|(_, d)| d.len() + 1).sum();
    assert_eq!(
        drawn.len(),
        want,
        "a commit succeeded on a wrong sample count"
    );
    let mut k = 0;
    for (id, drafts) in &plan.sampling {
        let samples = &drawn[k..k + drafts.len() + 1];
        k += samples.len();
        // Draft i stands if the sample at the token it follows is draft i.
        let accepted = drafts
            .iter()
            .zip(samples)
            .take_while(|(d, s)| d == s)
            .count();
        let e = expect.get_mut(id).unwrap();
        for &t in &samples[..=accepted] {
            e.out.push(t);
            e.end = e.stop_after_token();
            if e.end.is_some() {
                break;
            }
        }
    }
    for id in &plan.rows {
        expect.get_mut(id).unwrap().proposal.clear();
    }
}

/// After the engine's results were recorded: every sequence streamed exactly its recorded
/// output and end. A `TooLong` end the record cannot predict (it depends on the coordinator's
/// guarantee) is taken from the stream, but only for a sequence no caller ended first.
fn check_streams(slot: &mut Slot) {
    for (id, e) in &mut slot.expect {
        let (tokens, end) = slot.streamed.get(id).cloned().unwrap_or_default();
        if e.end.is_none() && e.pending_end.is_none() && end == Some(FinishReason::TooLong) {
            e.end = end;
        }
        assert_eq!(
            tokens, e.out,
            "seq {id}: streamed tokens, prompt {:?}",
            e.prompt
        );
        assert_eq!(end, e.end, "seq {id}: streamed end, output {:?}", e.out);
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
    /// The independent record of every sequence added since the engine was created.
    expect: HashMap<SeqId, Expect>,
    /// What the scheduled batch's commit must do, until a commit succeeds.
    plan: Option<Plan>,
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

/// An accepted abort or `finish_with`: the first one since the sequence's last schedule wins
/// and ends it at the next schedule.
fn caller_end(slot: &mut Slot, id: SeqId, reason: FinishReason) {
    let e = slot
        .expect
        .get_mut(&id)
        .expect("an end accepted for an unknown seq");
    assert!(
        e.end.is_none(),
        "seq {id}: an end accepted after it ended ({:?})",
        e.end
    );
    e.pending_end.get_or_insert(reason);
}

/// Applies a successful commit to the record: the scheduled batch's plan with the samples the
/// model drew for it. A second commit of the same batch (no schedule between) commits nothing:
/// its sampling fields are cleared, so the model drew nothing.
fn commit_record(slot: &mut Slot) {
    let (batch, drawn) = slot
        .model
        .drawn
        .take()
        .expect("a commit succeeded without sampling");
    match slot.plan.take() {
        Some(plan) => {
            assert_eq!(
                batch.seq_ids, plan.rows,
                "committed another batch than scheduled"
            );
            on_commit(&mut slot.expect, &plan, &drawn);
        }
        None => assert!(drawn.is_empty(), "a repeated commit took samples"),
    }
}

/// One whole step, checked against the record: its schedule applies the callers' ends, the
/// batch the model was given is checked, and if the step succeeded its commit is applied to
/// the record and its results are recorded and compared with it. A failed step commits
/// nothing, and a server delivers nothing of it: what it reported comes again with the next.
fn step_checked(slot: &mut Slot) -> Result<(), EngineError> {
    slot.seen = 0;
    let repeat = slot.uncommitted;
    slot.repeat = repeat;
    slot.model.drawn = None;
    let engine = slot.engine.as_mut().unwrap();
    let r = engine.step(&mut slot.model);
    slot.model.fail = Fail::None;
    on_schedule(&mut slot.expect);
    // The batch the model was given: as sampled (the commit then cleared its sampling
    // fields), or, for a failed step, as it still stands.
    let batch = match (&r, &slot.model.drawn) {
        (Ok(_), Some((b, _))) => b,
        (Ok(_), None) => panic!("a step committed without sampling"),
        (Err(_), _) => engine.batch(),
    };
    slot.plan = Some(check_batch(&slot.expect, batch));
    slot.uncommitted = r.is_err();
    if r.is_ok() {
        commit_record(slot);
        record(slot, repeat);
        check_streams(slot);
    }
    r.map(|_| ())
}

fn check_shared(shared: &SharedArena, slots: &[Slot]) {
    let c = shared.coordinator();
    assert!(c.blocks_in_use() <= u64::from(shared.pool().total()));
    assert!(c.tokens_in_use() <= u64::from(c.config().tokens_per_step));
    assert!(c.snapshot().consistent);
    // Page accounting between calls: an engine owns in the pool exactly the pages its budget
    // holds (its sequences' and its swap-outs in flight) plus its cached-free pages; an id no
    // live engine has owns none.
    let held = shared.pool().stats().held;
    let mut live = vec![false; held.len()];
    for slot in slots {
        let Some(engine) = slot.engine.as_ref() else {
            continue;
        };
        let e = engine.id();
        live[e.index()] = true;
        let cached_free = shared
            .prefix_cache()
            .map_or(0, |cache| cache.reclaimable(Some(e)));
        assert_eq!(
            u64::from(held[e.index()]),
            c.blocks_held(e) + u64::from(cached_free),
            "engine {e:?}: pool pages vs budget ({}) + cached-free ({cached_free})",
            c.blocks_held(e)
        );
    }
    for (e, &h) in held.iter().enumerate() {
        assert!(
            live[e] || h == 0,
            "engine id {e} owns {h} pages, no engine has it"
        );
    }
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
                    drawn: None,
                },
                shape,
                cfg: cfg_of(input.configs[i]),
                streamed: HashMap::new(),
                ids: Vec::new(),
                seen: 0,
                uncommitted: false,
                repeat: false,
                expect: HashMap::new(),
                plan: None,
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
                slot.expect.clear();
                slot.plan = None;
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
                let expect = Expect {
                    prompt: req.prompt.clone(),
                    stop: req.stop.clone(),
                    out: Vec::new(),
                    end: None,
                    pending_end: None,
                    proposal: Vec::new(),
                };
                match engine.add_salted(req, u64::from(salt % 2)) {
                    Ok(()) => {
                        // An id is refused until its last sequence's end was reported.
                        if let Some(old) = slot.expect.get(&id) {
                            assert!(old.end.is_some(), "seq {id} added twice while it runs");
                        }
                        slot.expect.insert(id, expect);
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
                    let id = u64::from(id % 16);
                    if engine.abort(id).is_ok() {
                        caller_end(slot, id, FinishReason::Aborted);
                    }
                }
            }
            Op::Finish { e, id, code } => {
                let slot = &mut slots[usize::from(e % 2)];
                if let Some(engine) = slot.engine.as_mut() {
                    let (id, reason) = (u64::from(id % 16), FinishReason::Caller(code.into()));
                    if engine.finish_with(id, reason).is_ok() {
                        caller_end(slot, id, reason);
                    }
                }
            }
            Op::Propose {
                e,
                id,
                drafts,
                peek,
            } => {
                let slot = &mut slots[usize::from(e % 2)];
                if let Some(engine) = slot.engine.as_mut() {
                    let d: Vec<u32> = drafts
                        .iter()
                        .take(8)
                        .enumerate()
                        .map(|(i, &t)| match peek && t % 4 != 0 {
                            true => slot.model.upcoming(i),
                            false => u32::from(t % 16),
                        })
                        .collect();
                    let id = u64::from(id % 16);
                    if engine.propose(id, &d).is_ok() {
                        let e = slot
                            .expect
                            .get_mut(&id)
                            .expect("proposal for an unknown seq");
                        // Room for every draft and the token after them.
                        assert!(
                            e.out.len() + d.len() < e.stop.max_new_tokens as usize,
                            "seq {id}: {} drafts accepted with {} of {} tokens generated",
                            d.len(),
                            e.out.len(),
                            e.stop.max_new_tokens
                        );
                        e.proposal = d;
                    }
                }
            }
            Op::Step { e, fail } => {
                let slot = &mut slots[usize::from(e % 2)];
                if slot.engine.is_none() {
                    continue;
                }
                slot.model.fail = fail;
                let r = step_checked(slot);
                if fail == Fail::None {
                    r.expect("a step with a well-behaved model succeeds");
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
                on_schedule(&mut slot.expect);
                slot.plan = Some(check_batch(&slot.expect, batch));
                slot.uncommitted = true;
                record(slot, repeat);
                check_streams(slot);
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
                slot.model.drawn = None;
                let r = engine.commit(&mut slot.model);
                slot.model.fail = Fail::None;
                if r.is_ok() {
                    slot.uncommitted = false;
                    commit_record(slot);
                    let repeat = slot.repeat;
                    record(slot, repeat);
                    check_streams(slot);
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
        check_shared(&shared, &slots);
    }

    // Drain: abort everything, step each engine until idle.
    for slot in &mut slots {
        if slot.engine.is_none() {
            continue;
        }
        for id in slot.ids.clone() {
            if slot.engine.as_mut().unwrap().abort(id).is_ok() {
                caller_end(slot, id, FinishReason::Aborted);
            }
        }
        let mut steps = 0;
        while slot.engine.as_ref().unwrap().has_work() {
            steps += 1;
            assert!(
                steps <= 64,
                "engine did not drain after aborting everything"
            );
            step_checked(slot).expect("drain step");
        }
        for id in &slot.ids {
            assert!(
                slot.streamed.get(id).is_some_and(|(_, end)| end.is_some()),
                "seq {id}: its end was never delivered"
            );
        }
        // And each stream is the record's: its tokens, and the end its rules or caller gave.
        check_streams(slot);
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
