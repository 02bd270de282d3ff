//! Several engines (3-4) of different geometries, dtypes and tokens per page on one host arena
//! under the budget coordinator, with random weights, some idle then bursting, engines
//! dropped and re-created while others run. After every step: each engine's budget holding
//! matches the pages it owns (less its cached-free pages), every attention row matches the
//! closed form (no engine's KV written through another's view); at the end every page is free.

use pagedkv::budget::BudgetConfig;
use pagedkv::engine::{
    Engine, EngineConfig, HostBackend, LayerQkv, RecomputePolicy, SharedArena, StepModel,
};
use pagedkv::error::EngineError;
use pagedkv::kv::{page_bytes_for, KvDtype, KvElem, ModelKvShape};
use pagedkv::sched::{Batch, FinishReason, PreemptionMode, Priority, SeqId, SeqRequest, StopRules};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;

#[path = "support/many_lanes.rs"]
mod many_lanes;
use many_lanes::*;

struct Closed<T> {
    engine: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    tol: f32,
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    prompt_len: HashMap<SeqId, usize>,
    fail: bool,
    fail_sample: bool,
}

impl<T: KvElem> StepModel<HostBackend<T>> for Closed<T> {
    fn qkv(
        &mut self,
        _backend: &HostBackend<T>,
        layer: usize,
        batch: &Batch,
    ) -> Result<LayerQkv<'_, [T]>, EngineError> {
        let n = batch.num_tokens();
        self.q = vec![T::from_f32(0.1); n * self.heads * self.head_dim];
        self.k = vec![T::from_f32(0.2); n * self.kv_heads * self.head_dim];
        self.v.clear();
        for t in 0..n {
            let (pos, token) = (batch.positions[t], batch.input_tokens[t]);
            for _ in 0..self.kv_heads {
                self.v.extend(
                    (0..self.head_dim)
                        .map(|d| T::from_f32(value(self.engine, pos, layer, d, token))),
                );
            }
        }
        Ok(LayerQkv {
            query: &self.q,
            key: &self.k,
            value: &self.v,
        })
    }

    fn attended(&mut self, layer: usize, batch: &Batch, out: &[T]) -> Result<(), EngineError> {
        if self.fail {
            return Err(EngineError::Model("injected".into()));
        }
        let width = self.heads * self.head_dim;
        let form = ClosedForm {
            engine: self.engine,
            heads: self.heads,
            head_dim: self.head_dim,
            prompt_len: &self.prompt_len,
        };
        form.check_attended(
            layer,
            batch,
            self.tol,
            |x| T::from_f32(x).to_f32(),
            |t, h, d| out[t * width + h * self.head_dim + d].to_f32(),
        );
        Ok(())
    }

    fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError> {
        if self.fail_sample {
            return Err(EngineError::Model("injected".into()));
        }
        sample(batch, out);
        Ok(())
    }
}

thread_local! {
    /// The recompute policy of the engines the current test builds.
    static POLICY: std::cell::Cell<RecomputePolicy> = const { std::cell::Cell::new(RecomputePolicy::SERVER) };
}

/// One engine and its bookkeeping, whatever its dtype.
trait Lane {
    fn id(&self) -> pagedkv::block::EngineId;
    fn has_work(&self) -> bool;
    /// Adds requests (maybe), aborts (maybe) and steps once; checks delivered tokens.
    fn tick(&mut self, rng: &mut rand::rngs::SmallRng, add: bool, next_id: &mut SeqId, seed: u64);
    /// Every sequence delivered has ended (if `strict`) and its tokens are the truth.
    fn check_done(&self, seed: u64, strict: bool);
}

struct Typed<T: KvElem> {
    engine: Engine<HostBackend<T>>,
    model: Closed<T>,
    seqs: Seqs,
}

impl<T: KvElem> Lane for Typed<T> {
    fn id(&self) -> pagedkv::block::EngineId {
        self.engine.id()
    }
    fn has_work(&self) -> bool {
        self.engine.has_work()
    }
    fn tick(&mut self, rng: &mut rand::rngs::SmallRng, add: bool, next_id: &mut SeqId, seed: u64) {
        if add {
            for _ in 0..rng.gen_range(1..4) {
                *next_id += 1;
                let id = *next_id;
                let prompt = rng.gen_range(1..70);
                let out = rng.gen_range(1..30u32);
                let req = request(rng, id, prompt, out);
                self.model.prompt_len.insert(id, prompt);
                if self.engine.add_salted(req, rng.gen_range(0..2)).is_ok() {
                    self.seqs.insert(id, (prompt, out, Vec::new(), None));
                }
            }
        }
        let mut live: Vec<SeqId> = self
            .seqs
            .iter()
            .filter(|(_, w)| w.3.is_none())
            .map(|(&id, _)| id)
            .collect();
        live.sort_unstable();
        for &id in &live {
            if rng.gen_bool(0.01) {
                let _ = self.engine.abort(id);
            }
        }
        for &id in &live {
            if rng.gen_bool(0.005) {
                let _ = self.engine.finish_with(id, FinishReason::Caller(3));
            }
            if self.engine.batcher().phase(id) != Some(pagedkv::sched::SeqPhase::Decoding) {
                continue;
            }
            let w = &self.seqs[&id];
            let pos = (w.0 + w.2.len()) as i32;
            let k = rng.gen_range(0..4usize);
            let drafts: Vec<u32> = (0..k as i32)
                .map(|j| if rng.gen_bool(0.7) { truth(pos + j) } else { 3 })
                .collect();
            let _ = self.engine.propose(id, &drafts);
        }
        let f = rng.gen_range(0..30);
        self.model.fail = f == 0;
        self.model.fail_sample = f == 1;
        let r = match rng.gen_range(0..10) {
            0 => {
                self.engine.schedule();
                self.engine.step(&mut self.model)
            }
            1 => {
                self.engine.schedule();
                if let Some(&id) = live.get(rng.gen_range(0..live.len().max(1))) {
                    let _ = self.engine.abort(id);
                }
                self.engine
                    .execute(&mut self.model)
                    .and_then(|_| self.engine.commit(&mut self.model))
            }
            _ => self.engine.step(&mut self.model),
        };
        let injected = self.model.fail || self.model.fail_sample;
        self.model.fail = false;
        self.model.fail_sample = false;
        if r.is_err() {
            assert!(injected, "seed {seed}: {r:?}");
            return;
        }
        record(&mut self.seqs, self.engine.results(), seed);
    }
    fn check_done(&self, seed: u64, strict: bool) {
        check_streams(&self.seqs, seed, strict);
    }
}

fn shapes() -> [(ModelKvShape, usize, f32); 4] {
    [
        (
            ModelKvShape {
                num_layers: 2,
                num_kv_heads: 1,
                head_dim: 16,
                dtype: KvDtype::F32,
            },
            2,
            1e-3,
        ),
        (
            ModelKvShape {
                num_layers: 1,
                num_kv_heads: 2,
                head_dim: 32,
                dtype: KvDtype::F32,
            },
            4,
            1e-3,
        ),
        (
            ModelKvShape {
                num_layers: 3,
                num_kv_heads: 1,
                head_dim: 16,
                dtype: KvDtype::F16,
            },
            3,
            3e-3,
        ),
        (
            ModelKvShape {
                num_layers: 1,
                num_kv_heads: 1,
                head_dim: 8,
                dtype: KvDtype::Bf16,
            },
            1,
            1.5e-2,
        ),
    ]
}

fn make_lane(
    shared: &Arc<SharedArena>,
    which: usize,
    rng: &mut rand::rngs::SmallRng,
    mode: PreemptionMode,
) -> Box<dyn Lane + Send> {
    let (shape, heads, tol) = shapes()[which];
    let cfg = EngineConfig {
        weight: if rng.gen_bool(0.2) {
            rng.gen_range(1..60)
        } else {
            rng.gen_range(1..5)
        } * 1000,
        max_running: rng.gen_range(1..8),
        max_batched_tokens: rng.gen_range(1..64),
        max_prefill_chunk: rng.gen_range(1..30),
        max_context: 256,
        preemption: mode,
        swap_blocks: rng.gen_range(0..20),
        recompute: POLICY.with(|p| p.get()),
        prefix_cache: rng.gen_bool(0.7),
    };
    fn typed<T: KvElem>(
        shared: &Arc<SharedArena>,
        cfg: EngineConfig,
        which: usize,
        shape: &ModelKvShape,
        heads: usize,
        tol: f32,
    ) -> Box<dyn Lane + Send> {
        let engine = Engine::<HostBackend<T>>::host(shared, cfg, shape, heads).unwrap();
        Box::new(Typed {
            engine,
            model: Closed {
                engine: which,
                heads,
                kv_heads: shape.num_kv_heads,
                head_dim: shape.head_dim,
                tol,
                q: Vec::new(),
                k: Vec::new(),
                v: Vec::new(),
                prompt_len: HashMap::new(),
                fail: false,
                fail_sample: false,
            },
            seqs: HashMap::new(),
        })
    }
    match shape.dtype {
        KvDtype::F32 => typed::<f32>(shared, cfg, which, &shape, heads, tol),
        KvDtype::F16 => typed::<half::f16>(shared, cfg, which, &shape, heads, tol),
        KvDtype::Bf16 => typed::<half::bf16>(shared, cfg, which, &shape, heads, tol),
    }
}

/// Budget holdings against pool ownership, for every registered engine.
fn check_accounts(
    shared: &SharedArena,
    lanes: &[Option<Box<dyn Lane + Send>>],
    seed: u64,
    step: usize,
) {
    let exact = step % 29 == 0;
    if exact {
        if let Some(cache) = shared.prefix_cache() {
            cache.clear();
        }
    }
    let c = shared.coordinator();
    let pool = shared.pool();
    let mut sum = 0u64;
    for lane in lanes.iter().flatten() {
        let id = lane.id();
        let budget = c.blocks_held(id);
        let owned = u64::from(pool.held(id));
        let cached = shared.prefix_cache().map_or(0, |p| u64::from(p.cached(id)));
        assert!(
            budget <= owned && owned <= budget + cached,
            "seed {seed} step {step}: engine {id:?} budget {budget} owned {owned} cached {cached}"
        );
        if exact {
            assert_eq!(
                budget, owned,
                "seed {seed} step {step}: engine {id:?} after clear"
            );
        }
        if !lane.has_work() {
            assert_eq!(budget, 0, "seed {seed} step {step}: idle engine {id:?}");
            let e = c
                .snapshot()
                .engines
                .into_iter()
                .find(|e| e.engine == id)
                .unwrap();
            assert_eq!(
                e.load, None,
                "seed {seed} step {step}: idle engine {id:?} load"
            );
            assert_eq!(
                e.tokens_used, 0,
                "seed {seed} step {step}: idle engine {id:?} tokens"
            );
            assert!(
                !e.active,
                "seed {seed} step {step}: idle engine {id:?} active"
            );
        }
        sum += budget;
    }
    assert_eq!(
        sum,
        c.blocks_in_use(),
        "seed {seed} step {step}: blocks_in_use"
    );
    let snap = c.snapshot();
    assert!(snap.consistent);
    let quotas: u64 = lanes
        .iter()
        .flatten()
        .map(|l| u64::from(c.block_quota(l.id())))
        .sum();
    // What the engines reserve (an active one its quota, or its block demand where lower; an
    // idle one what it holds) and may borrow fits the pool, from the last publication on.
    let promised: u64 = snap
        .engines
        .iter()
        .map(|e| e.blocks_reserved() + u64::from(e.block_limit - e.block_quota))
        .sum();
    assert!(
        quotas <= u64::from(pool.total()),
        "seed {seed} step {step}: quotas {quotas}"
    );
    assert!(
        c.is_dirty() || promised <= u64::from(pool.total()),
        "seed {seed} step {step}: reserved and lent {promised}: {snap:?}"
    );
    let active: Vec<_> = lanes
        .iter()
        .flatten()
        .filter(|l| c.is_active(l.id()))
        .map(|l| l.id())
        .collect();
    // Shares split the device's tokens; budgets may sum past them where a demand lends.
    let shares: u64 = active.iter().map(|&e| u64::from(c.token_share(e))).sum();
    let tcap = u64::from(c.config().token_cap());
    let tps = u64::from(c.config().tokens_per_step);
    assert!(shares <= tps, "seed {seed} step {step}: shares {shares}");
    assert!(c.tokens_in_use() <= tps);
    if !c.is_dirty() && !active.is_empty() && active.len() as u64 * tcap >= tps {
        assert_eq!(
            shares,
            tps,
            "seed {seed} step {step}: token shares of {active:?}: dirty {} {:?}",
            c.is_dirty(),
            c.snapshot()
        );
    }
    for &e in &active {
        assert!(u64::from(c.token_budget(e)) <= tcap);
        if !c.is_dirty() {
            assert!(c.token_budget(e) >= c.token_share(e));
        }
        assert!(
            c.block_limit(e) <= c.config().block_cap().max(c.block_quota(e)),
            "seed {seed} step {step}: limit over cap"
        );
        if !c.is_dirty() && tps >= active.len() as u64 && tcap >= 1 {
            assert!(
                c.token_budget(e) >= 1,
                "seed {seed} step {step}: engine {e:?} 0 tokens"
            );
        }
    }
    let cap = u64::from(c.config().block_cap());
    let live = snap.engines.len() as u64;
    let all_quotas: u64 = snap.engines.iter().map(|e| u64::from(e.block_quota)).sum();
    if cap * live >= u64::from(pool.total()) {
        assert_eq!(
            all_quotas,
            u64::from(pool.total()),
            "seed {seed} step {step}: quotas"
        );
    }
    assert!(c.blocks_in_use() <= u64::from(pool.total()));
}

fn run(seed: u64) {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let sh = shapes();
    let page_bytes = page_bytes_for(&sh.map(|(s, _, _)| s), 8).unwrap();
    let pages = if rng.gen_bool(0.3) {
        rng.gen_range(4..16)
    } else {
        rng.gen_range(16..60)
    };
    let mode = if rng.gen_bool(0.5) {
        PreemptionMode::Swap
    } else {
        PreemptionMode::Recompute
    };
    let tokens = rng.gen_range(4..160);
    let cap = if rng.gen_bool(0.5) {
        1000
    } else {
        rng.gen_range(400..1000)
    };
    let pad: u16 = if rng.gen_bool(0.3) {
        rng.gen_range(60..70)
    } else {
        0
    };
    let mut shared = SharedArena::host(
        BudgetConfig::new(4 + pad, tokens, pages).with_cap_permille(cap),
        page_bytes,
    )
    .unwrap();
    if rng.gen_bool(0.7) {
        Arc::get_mut(&mut shared)
            .unwrap()
            .enable_prefix_cache(Some(seed));
    }
    let policy = match rng.gen_range(0..4) {
        0 => RecomputePolicy::SERVER,
        1 => RecomputePolicy {
            when_dirty: true,
            every_steps: 0,
        },
        2 => RecomputePolicy {
            when_dirty: false,
            every_steps: rng.gen_range(1..6),
        },
        _ => RecomputePolicy::CALLER,
    };
    POLICY.with(|p| p.set(policy));
    let n = rng.gen_range(3..=4);
    for _ in 0..pad {
        shared.coordinator().register(1).unwrap();
    }
    let mut lanes: Vec<Option<Box<dyn Lane + Send>>> = (0..n)
        .map(|w| Some(make_lane(&shared, w, &mut rng, mode)))
        .collect();
    // Each engine is idle or bursting for a random stretch.
    let mut burst: Vec<bool> = (0..n).map(|_| rng.gen_bool(0.5)).collect();
    let mut next_id = 0;
    for step in 0..4000 {
        for w in 0..n {
            if step < 300 && rng.gen_bool(0.05) {
                burst[w] = !burst[w];
            }
            // Drop an idle engine while others run and bring it back.
            if step < 300 && rng.gen_bool(0.004) {
                if let Some(lane) = lanes[w].take() {
                    lane.check_done(seed, false);
                    drop(lane);
                    check_accounts(&shared, &lanes, seed, step);
                }
                lanes[w] = Some(make_lane(&shared, w, &mut rng, mode));
                continue;
            }
            let Some(lane) = lanes[w].as_mut() else {
                continue;
            };
            let add = step < 300 && burst[w] && rng.gen_bool(0.4);
            if rng.gen_bool(0.01) {
                shared
                    .coordinator()
                    .set_weight(lane.id(), rng.gen_range(1..6) * 1000)
                    .unwrap();
            }
            lane.tick(&mut rng, add, &mut next_id, seed);
            check_accounts(&shared, &lanes, seed, step);
        }
        if policy == RecomputePolicy::CALLER {
            shared.coordinator().recompute();
        }
        if step > 300 && lanes.iter().flatten().all(|l| !l.has_work()) {
            break;
        }
    }
    POLICY.with(|p| p.set(RecomputePolicy::SERVER));
    for lane in lanes.iter().flatten() {
        assert!(
            !lane.has_work(),
            "seed {seed}: engine {:?} did not go idle ({policy:?})",
            lane.id()
        );
        lane.check_done(seed, true);
    }
    drop(lanes);
    if let Some(cache) = shared.prefix_cache() {
        cache.clear();
    }
    assert_eq!(
        shared.pool().free_count(),
        shared.pool().total(),
        "seed {seed}"
    );
    assert_eq!(shared.coordinator().blocks_in_use(), 0, "seed {seed}");
}

#[test]
fn many_engines_of_many_geometries_share_one_arena_exactly() {
    let from: u64 = std::env::var("MANY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let count: u64 = std::env::var("MANY_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8);
    for seed in from..from + count {
        run(seed);
    }
}

/// The same engines on one thread each, stepping at once: every attention row exact, every
/// stream the truth, and at the end every page free and no budget held.
fn run_threaded(seed: u64) {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let sh = shapes();
    let page_bytes = page_bytes_for(&sh.map(|(s, _, _)| s), 8).unwrap();
    let pages = rng.gen_range(16..60);
    let mode = if rng.gen_bool(0.5) {
        PreemptionMode::Swap
    } else {
        PreemptionMode::Recompute
    };
    let mut shared = SharedArena::host(BudgetConfig::new(4, 128, pages), page_bytes).unwrap();
    if rng.gen_bool(0.8) {
        Arc::get_mut(&mut shared)
            .unwrap()
            .enable_prefix_cache(Some(seed));
    }
    let n = rng.gen_range(3..=4);
    let lanes: Vec<Box<dyn Lane + Send>> = (0..n)
        .map(|w| make_lane(&shared, w, &mut rng, mode))
        .collect();
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let handles: Vec<_> = lanes
        .into_iter()
        .enumerate()
        .map(|(w, mut lane)| {
            let next = next.clone();
            let shared = shared.clone();
            std::thread::spawn(move || {
                let mut rng = rand::rngs::SmallRng::seed_from_u64(seed * 31 + w as u64);
                let mut burst = rng.gen_bool(0.5);
                for step in 0..20_000 {
                    if step < 300 && rng.gen_bool(0.005) {
                        lane.check_done(seed, false);
                        drop(lane);
                        let mut tries = 0;
                        lane = loop {
                            tries += 1;
                            assert!(tries < 10_000, "seed {seed}: no slot");
                            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                make_lane(&shared, w, &mut rng, mode)
                            })) {
                                Ok(l) => break l,
                                Err(_) => std::thread::yield_now(),
                            }
                        };
                    }
                    if step < 300 && rng.gen_bool(0.05) {
                        burst = !burst;
                    }
                    let add = step < 300 && burst && rng.gen_bool(0.4);
                    let mut id = next.fetch_add(10, std::sync::atomic::Ordering::Relaxed);
                    lane.tick(&mut rng, add, &mut id, seed);
                    if step > 300 && !lane.has_work() {
                        break;
                    }
                }
                assert!(!lane.has_work(), "seed {seed}: engine {w} did not go idle");
                lane.check_done(seed, true);
                lane
            })
        })
        .collect();
    let lanes: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    drop(lanes);
    if let Some(cache) = shared.prefix_cache() {
        cache.clear();
    }
    assert_eq!(
        shared.pool().free_count(),
        shared.pool().total(),
        "seed {seed}"
    );
    assert_eq!(shared.coordinator().blocks_in_use(), 0, "seed {seed}");
}

#[test]
fn many_engines_on_threads_share_one_arena_exactly() {
    let from: u64 = std::env::var("MANY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let count: u64 = std::env::var("MANY_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    for seed in from..from + count {
        run_threaded(seed);
    }
}

fn closed(engine: usize, shape: &ModelKvShape, heads: usize) -> Closed<f32> {
    Closed {
        engine,
        heads,
        kv_heads: shape.num_kv_heads,
        head_dim: shape.head_dim,
        tol: 1e-3,
        q: Vec::new(),
        k: Vec::new(),
        v: Vec::new(),
        prompt_len: HashMap::new(),
        fail: false,
        fail_sample: false,
    }
}

fn req(id: SeqId, prompt: usize, out: u32, priority: Priority) -> SeqRequest {
    SeqRequest {
        id,
        prompt: vec![prompt_token(id); prompt],
        stop: StopRules {
            max_new_tokens: out,
            eos: Vec::new(),
            stop_sequences: Vec::new(),
        },
        priority,
    }
}

/// A lender whose share is lent to a flooded borrower gets its request running within a few
/// steps, whatever the borrower keeps queueing, for every mix of modes and priorities.
#[test]
fn a_lender_gets_its_share_back_from_a_flooded_borrower() {
    let sh = shapes();
    let page_bytes = page_bytes_for(&sh.map(|(s, _, _)| s), 8).unwrap();
    for (mode, prefix, lc, n) in [
        (PreemptionMode::Recompute, false, false, 3),
        (PreemptionMode::Swap, false, false, 3),
        (PreemptionMode::Recompute, true, false, 3),
        (PreemptionMode::Swap, true, true, 3),
        (PreemptionMode::Recompute, true, true, 4),
        (PreemptionMode::Swap, false, true, 4),
    ] {
        let mut shared = SharedArena::host(BudgetConfig::new(4, 256, 32), page_bytes).unwrap();
        if prefix {
            Arc::get_mut(&mut shared)
                .unwrap()
                .enable_prefix_cache(Some(1));
        }
        let mut engines: Vec<(Engine<HostBackend<f32>>, Closed<f32>)> = (0..n)
            .map(|w| {
                let (shape, heads, _) = sh[w.min(1)];
                let cfg = EngineConfig {
                    weight: 1,
                    max_running: 16,
                    max_batched_tokens: 128,
                    max_prefill_chunk: 64,
                    max_context: 256,
                    preemption: mode,
                    swap_blocks: 64,
                    recompute: RecomputePolicy::SERVER,
                    prefix_cache: prefix,
                };
                (
                    Engine::host(&shared, cfg, &shape, heads).unwrap(),
                    closed(w, &shape, heads),
                )
            })
            .collect();
        let mut id = 1000;
        // The borrower (engine 1) fills the pool.
        let flood = |e: &mut (Engine<HostBackend<f32>>, Closed<f32>), id: &mut u64| {
            for _ in 0..2 {
                *id += 1;
                e.1.prompt_len.insert(*id, 20);
                let _ = e.0.add(req(*id, 20, 30, Priority::Throughput));
            }
        };
        for _ in 0..20 {
            flood(&mut engines[1], &mut id);
            let (e, m) = &mut engines[1];
            e.step(m).unwrap();
        }
        let c = shared.coordinator().clone();
        let lender = engines[0].0.id();
        assert!(
            c.blocks_held(engines[1].0.id()) > 24,
            "borrower holds {}",
            c.blocks_held(engines[1].0.id())
        );
        // The lender asks for 2 pages (< its quota).
        engines[0].1.prompt_len.insert(1, 20);
        let p = if lc {
            Priority::LatencyCritical
        } else {
            Priority::Throughput
        };
        engines[0].0.add(req(1, 20, 5, p)).unwrap();
        let mut admitted = None;
        for round in 0..40 {
            for w in 0..n {
                if w == 1 {
                    flood(&mut engines[1], &mut id);
                }
                let (e, m) = &mut engines[w];
                e.step(m).unwrap();
            }
            if admitted.is_none() && c.blocks_held(lender) > 0 {
                admitted = Some(round);
            }
        }
        println!(
            "{mode:?} prefix {prefix} lc {lc} n {n}: admitted after {admitted:?} rounds; quota {}",
            c.block_quota(lender)
        );
        assert!(
            admitted.is_some_and(|r| r <= 3),
            "{mode:?} prefix {prefix} lc {lc} n {n}: lender admitted after {admitted:?}"
        );
    }
}
