//! A server in miniature: two models of different geometry share one KV arena, each run by an
//! [`Engine`] on its own thread; a tokio front end submits requests concurrently through one
//! [`Admission`] queue set, streams every request's tokens as they are generated, cancels some
//! by dropping their streams (the engine sees it and aborts them), and shuts down cleanly.
//!
//! ```text
//! cargo run --release --example serve_two_models
//! ```
//!
//! The models are stand-ins whose sampled token is read back from the KV cache: values are
//! `100 * seq + position`, keys are equal, so attention returns the mean over the positions
//! so far, from which the model recovers its position and emits `10_000 * seq + position`. A
//! page written by the wrong model or sequence shows up as a wrong token (or a model error).
//! tests/example_serve.rs runs [`run`] and checks every stream.

use std::collections::HashMap;
use std::error::Error;
use std::sync::Arc;
use std::thread;

use pagedkv::budget::BudgetConfig;
use pagedkv::engine::{
    Engine, EngineConfig, HostBackend, LayerQkv, RecomputePolicy, SharedArena, StepModel,
};
use pagedkv::error::{EngineError, SchedError};
use pagedkv::kv::{page_bytes_for, KvDtype, ModelKvShape};
use pagedkv::sched::admission::{
    Admission, AdmissionConfig, AdmissionError, OverflowPolicy, Route, StreamEvent, StreamRequest,
    StreamRouter,
};
use pagedkv::sched::{Batch, FinishReason, PreemptionMode, Priority, SeqId, SeqRequest, StopRules};

/// The queue set: a request with its stream in; the engine's verdict on it out.
type Queues = Admission<StreamRequest, Result<(), SchedError>>;
type BoxError = Box<dyn Error + Send + Sync>;

/// The size of a run.
#[derive(Debug, Clone, Copy)]
pub struct ServeConfig {
    /// Requests per model.
    pub requests_per_model: u64,
    /// Every `cancel_every`-th request is cancelled after its first few tokens (0: none).
    pub cancel_every: u64,
    /// Pages of the shared arena.
    pub pages: u32,
    /// Tokio worker threads of the front end.
    pub client_threads: usize,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            requests_per_model: 24,
            cancel_every: 4,
            pages: 32,
            client_threads: 2,
        }
    }
}

/// One request of the run, as the client planned it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// Sequence id (unique over both models).
    pub id: SeqId,
    /// The engine (model) it goes to.
    pub model: usize,
    /// Prompt tokens.
    pub prompt_len: u32,
    /// Tokens to generate.
    pub max_new_tokens: u32,
    /// Drop the stream once this many tokens arrived.
    pub cancel_after: Option<u32>,
}

impl Plan {
    /// The token this request's model emits at output index `n`.
    pub fn expected_token(&self, n: u32) -> u32 {
        token_for(self.id, self.prompt_len + n)
    }
}

/// What the client saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Tokens, then `Finished(reason)`, then the end of the stream.
    Finished {
        /// Every streamed token, in order.
        tokens: Vec<u32>,
        /// The finish reason.
        reason: FinishReason,
    },
    /// The client dropped the stream after these tokens.
    Cancelled {
        /// Tokens received before the drop.
        tokens: Vec<u32>,
    },
    /// Refused by admission or the engine, or the stream ended in an error.
    Failed(String),
}

/// What one engine thread saw.
#[derive(Debug, Clone, Default)]
pub struct EngineLog {
    /// Each sequence's finish reason, as the engine reported it.
    pub finished: HashMap<SeqId, FinishReason>,
    /// Sequences the engine aborted because their streams were dropped.
    pub cancelled: Vec<SeqId>,
    /// Steps run.
    pub steps: u64,
    /// Sequences preempted (recompute), streamed on without repeating a token.
    pub preempted: u64,
}

/// Everything a run produced.
#[derive(Debug)]
pub struct ServeReport {
    /// The plan and the client's outcome of every request.
    pub outcomes: Vec<(Plan, Outcome)>,
    /// Per engine.
    pub engines: Vec<EngineLog>,
    /// Free pages of the shared pool after both engines stopped.
    pub pool_free: u32,
    /// Pages of the shared pool.
    pub pool_total: u32,
    /// Pages the coordinator still counts in use after both engines stopped.
    pub blocks_in_use: u64,
}

/// The value stored for sequence `seq` at `pos`, and the token emitted after it.
fn kv_value(seq: SeqId, pos: i32) -> f32 {
    (seq * 100) as f32 + pos as f32
}

fn token_for(seq: SeqId, pos: u32) -> u32 {
    seq as u32 * 10_000 + pos
}

/// The stand-in model (see the module docs).
struct PositionModel {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    layers: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// The last layer's output, first element of each token's first head.
    last: Vec<f32>,
}

impl PositionModel {
    fn new(shape: &ModelKvShape, heads: usize) -> Self {
        Self {
            heads,
            kv_heads: shape.num_kv_heads,
            head_dim: shape.head_dim,
            layers: shape.num_layers,
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            last: Vec::new(),
        }
    }

    /// The sequence of each token of `batch`.
    fn token_seqs(batch: &Batch) -> impl Iterator<Item = SeqId> + '_ {
        (0..batch.num_seqs()).flat_map(move |s| {
            let n = batch.query_start_loc[s + 1] - batch.query_start_loc[s];
            std::iter::repeat_n(batch.seq_ids[s], n as usize)
        })
    }
}

impl StepModel<HostBackend<f32>> for PositionModel {
    fn qkv(
        &mut self,
        _backend: &HostBackend<f32>,
        _layer: usize,
        batch: &Batch,
    ) -> Result<LayerQkv<'_, [f32]>, EngineError> {
        let n = batch.num_tokens();
        self.q.clear();
        self.q.resize(n * self.heads * self.head_dim, 0.1);
        self.k.clear();
        self.k.resize(n * self.kv_heads * self.head_dim, 0.2);
        self.v.clear();
        for (seq, &pos) in Self::token_seqs(batch).zip(&batch.positions) {
            let width = self.kv_heads * self.head_dim;
            self.v
                .extend(std::iter::repeat_n(kv_value(seq, pos), width));
        }
        Ok(LayerQkv {
            query: &self.q,
            key: &self.k,
            value: &self.v,
        })
    }

    fn attended(&mut self, layer: usize, batch: &Batch, out: &[f32]) -> Result<(), EngineError> {
        if layer + 1 == self.layers {
            let width = self.heads * self.head_dim;
            self.last.clear();
            self.last
                .extend((0..batch.num_tokens()).map(|t| out[t * width]));
        }
        Ok(())
    }

    fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError> {
        for s in 0..batch.num_seqs() {
            if !batch.samples[s] {
                continue;
            }
            let t = batch.query_start_loc[s + 1] as usize - 1;
            let (seq, pos) = (batch.seq_ids[s], batch.positions[t]);
            // The mean of `100 * seq + p` over p in 0..=pos is `100 * seq + pos / 2`.
            let recovered = ((self.last[t] - (seq * 100) as f32) * 2.0).round() as i32;
            if recovered != pos {
                return Err(EngineError::Model(format!(
                    "seq {seq} pos {pos}: the cache gave back position {recovered}"
                )));
            }
            out.push(token_for(seq, pos as u32 + 1));
        }
        Ok(())
    }
}

/// The two models: (KV shape, query heads). Their pages hold 32 and 16 tokens.
fn models() -> [(ModelKvShape, usize); 2] {
    let shape = |num_layers, num_kv_heads, head_dim| ModelKvShape {
        num_layers,
        num_kv_heads,
        head_dim,
        dtype: KvDtype::F32,
    };
    [(shape(2, 1, 16), 2), (shape(1, 2, 32), 4)]
}

fn engine_config() -> EngineConfig {
    EngineConfig {
        weight: 1,
        max_running: 8,
        max_batched_tokens: 96,
        max_prefill_chunk: 32,
        max_context: 512,
        preemption: PreemptionMode::Recompute,
        swap_blocks: 0,
        recompute: RecomputePolicy::SERVER,
        prefix_cache: false,
    }
}

/// Whether the engine takes another request from its queue now. Its batcher's waiting list
/// has no bound of its own: taking every queued request at each step would move them all
/// there (each with its prompt and stream buffer), so the queue would never fill, `Block`
/// would never hold a submitter back, and memory would grow with the overload. So a request
/// is taken only while fewer than a batch (`max_running`) wait to start; a latency-critical
/// one (the next one taken, if any is queued) while fewer than a batch of its class wait, so
/// it does not queue behind throughput work. (A pop that finds that request still being
/// written takes the next throughput one instead: one past the bound, for a race.) The rest
/// wait in the admission queue, where the overflow policy applies.
fn has_room(
    engine: &Engine<HostBackend<f32>>,
    queues: &Queues,
    worker: usize,
) -> Result<bool, AdmissionError> {
    let backlog = engine.config().max_running as usize;
    let batcher = engine.batcher();
    Ok(batcher.num_waiting() < backlog
        || (batcher.num_waiting_in(Priority::LatencyCritical) < backlog
            && queues.depth(worker, Priority::LatencyCritical)? > 0))
}

/// One engine's thread: takes requests from its admission queue as its backlog allows
/// ([`has_room`]; parked while idle), aborts sequences whose streams were dropped, steps, and
/// routes each step's results to the streams.
/// Returns when the queue set is closed and the engine is idle.
fn engine_thread(
    shared: &Arc<SharedArena>,
    queues: &Queues,
    worker: usize,
    before_step: &mut dyn FnMut(u64) -> Result<(), BoxError>,
) -> Result<EngineLog, BoxError> {
    let (shape, heads) = models()[worker];
    let mut engine = Engine::<HostBackend<f32>>::host(shared, engine_config(), &shape, heads)?;
    let mut model = PositionModel::new(&shape, heads);
    let mut router = StreamRouter::new();
    let mut log = EngineLog::default();
    let mut abort = Vec::new();
    loop {
        // New requests: while the engine has work, what is queued as long as its batcher's
        // backlog has room (see `has_room`), else park for one.
        loop {
            let job = if engine.has_work() {
                if !has_room(&engine, queues, worker)? {
                    break;
                }
                match queues.pop(worker)? {
                    Some(job) => job,
                    None => break,
                }
            } else {
                match queues.pop_blocking(worker) {
                    Ok(job) => job,
                    Err(AdmissionError::Closed) => {
                        let stats = engine.batcher().stats();
                        log.steps = stats.steps;
                        log.preempted = stats.preempted_recompute;
                        return Ok(log);
                    }
                    Err(e) => return Err(e.into()),
                }
            };
            let (StreamRequest { request, tokens }, verdict) = job.into_parts();
            let id = request.id;
            if tokens.is_closed() {
                // Cancelled while queued: never reaches the engine.
                verdict.complete(Ok(()));
                continue;
            }
            match engine.add(request) {
                Ok(()) => {
                    // The batcher refuses duplicate ids, so the router has none either.
                    let _ = router.insert(id, tokens);
                    verdict.complete(Ok(()));
                }
                // The stream is dropped with the refusal: it ends `Abandoned`.
                Err(e) => verdict.complete(Err(e)),
            }
        }
        router.closed_into(&mut abort);
        for id in abort.drain(..) {
            // Already finished or aborted: nothing to do.
            let _ = engine.abort(id);
        }
        before_step(engine.steps())?;
        engine.step(&mut model)?;
        for f in engine.finished() {
            log.finished.insert(f.id, f.reason);
            if f.reason == FinishReason::Aborted {
                log.cancelled.push(f.id);
            }
        }
        router.dispatch(engine.results(), &mut abort);
    }
}

/// The client of one request: submit, wait for the engine's verdict, stream.
async fn client(queues: Arc<Queues>, plan: Plan) -> Outcome {
    let priority = if plan.id % 3 == 0 {
        Priority::LatencyCritical
    } else {
        Priority::Throughput
    };
    let request = SeqRequest {
        id: plan.id,
        prompt: vec![1; plan.prompt_len as usize],
        stop: StopRules {
            max_new_tokens: plan.max_new_tokens,
            eos: Vec::new(),
            stop_sequences: Vec::new(),
        },
        priority,
    };
    let (request, mut stream) = match StreamRequest::new(request) {
        Ok(pair) => pair,
        Err(e) => return Outcome::Failed(e.to_string()),
    };
    let ticket = match queues
        .submit(request, priority, Route::Worker(plan.model))
        .await
    {
        Ok(ticket) => ticket,
        Err(refused) => return Outcome::Failed(refused.error.to_string()),
    };
    match ticket.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Outcome::Failed(e.to_string()),
        Err(e) => return Outcome::Failed(e.to_string()),
    }
    let mut tokens = Vec::new();
    loop {
        match stream.recv().await {
            Some(Ok(StreamEvent::Tokens(t))) => {
                tokens.extend(t);
                if plan
                    .cancel_after
                    .is_some_and(|k| tokens.len() >= k as usize)
                {
                    drop(stream);
                    return Outcome::Cancelled { tokens };
                }
            }
            Some(Ok(StreamEvent::Finished(reason))) => {
                if stream.recv().await.is_some() {
                    return Outcome::Failed("an item after Finished".into());
                }
                return Outcome::Finished { tokens, reason };
            }
            // `Abandoned` (the engine dropped the request) or `Lagged` (not with a stream
            // sized to max_new_tokens).
            Some(Err(e)) => return Outcome::Failed(e.to_string()),
            None => return Outcome::Failed("the stream ended without Finished".into()),
        }
    }
}

/// The requests of a run: both models, mixed prompt and output lengths; every
/// `cancel_every`-th one is long and cancelled after 3 tokens. The long ones still fit one
/// model's guaranteed share of a 24-page arena (12 pages, 192 tokens of the larger model):
/// a longer one is refused, since it could finish only while the other model idles.
pub fn plans(cfg: &ServeConfig) -> Vec<Plan> {
    let mut out = Vec::new();
    for i in 0..cfg.requests_per_model {
        for model in 0..2 {
            let id = 1 + i * 2 + model as u64;
            let cancel = cfg.cancel_every > 0 && i % cfg.cancel_every == cfg.cancel_every - 1;
            out.push(Plan {
                id,
                model,
                prompt_len: 5 + (id as u32 * 7) % 60,
                max_new_tokens: if cancel {
                    120
                } else {
                    8 + (id as u32 * 5) % 40
                },
                cancel_after: cancel.then_some(3),
            });
        }
    }
    out
}

/// The shared arena of both models: `pages` pages of 16 tokens of the larger model.
pub fn arena(pages: u32) -> Result<Arc<SharedArena>, BoxError> {
    let shapes = models().map(|(s, _)| s);
    let page_bytes = page_bytes_for(&shapes, 16)?;
    Ok(SharedArena::host(
        BudgetConfig::new(2, 256, pages),
        page_bytes,
    )?)
}

/// One engine's thread as [`run`] spawns it: [`engine_thread`] for `worker` (its model's
/// engine on `shared`), with `before_step` called before each step (with the steps run so
/// far; an error ends the engine like a failed step: `run` passes a no-op, the tests inject
/// faults). If the engine fails (an error or a panic, which is then resumed), no client is
/// left waiting on it.
pub fn engine_worker(
    shared: &Arc<SharedArena>,
    queues: &Admission<StreamRequest, Result<(), SchedError>>,
    worker: usize,
    before_step: &mut dyn FnMut(u64) -> Result<(), BoxError>,
) -> Result<EngineLog, BoxError> {
    // A panic (the model's, say) unwinds out of `engine_thread` first, dropping its engine
    // (the pages go back) and its router (the running requests' streams end `Abandoned`).
    let log = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        engine_thread(shared, queues, worker, before_step)
    }));
    if !matches!(log, Ok(Ok(_))) {
        // Refuse the rest rather than leave clients waiting on this engine: the close refuses
        // later submits, and the requests already queued here (or admitted while the close
        // raced them) are dropped, which ends their tickets `Abandoned`. Nobody else pops
        // this worker's queue: without this, their clients (and `run`) would wait forever.
        queues.close();
        while let Ok(job) = queues.pop_blocking(worker) {
            drop(job);
        }
    }
    log.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// Runs the whole server once: arena, engines, queues, front end, shutdown.
pub fn run(cfg: &ServeConfig) -> Result<ServeReport, BoxError> {
    let shared = arena(cfg.pages)?;
    let queues: Arc<Queues> = Arc::new(Admission::new(AdmissionConfig::new(
        2,
        16,
        OverflowPolicy::Block,
    ))?);
    let engines: Vec<_> = (0..2)
        .map(|worker| {
            let (shared, queues) = (shared.clone(), queues.clone());
            thread::Builder::new()
                .name(format!("engine-{worker}"))
                .spawn(move || engine_worker(&shared, &queues, worker, &mut |_| Ok(())))
        })
        .collect::<Result<_, _>>()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.client_threads.max(1))
        .build()?;
    let plans = plans(cfg);
    let outcomes = runtime.block_on(async {
        let tasks: Vec<_> = plans
            .iter()
            .map(|&plan| tokio::spawn(client(queues.clone(), plan)))
            .collect();
        let mut outcomes = Vec::with_capacity(tasks.len());
        for (plan, task) in plans.iter().zip(tasks) {
            let outcome = task
                .await
                .unwrap_or_else(|e| Outcome::Failed(format!("client task: {e}")));
            outcomes.push((*plan, outcome));
        }
        outcomes
    });
    drop(runtime);
    // Shutdown: no more requests; each engine drains, sees `Closed` while idle and returns.
    queues.close();
    let mut logs = Vec::new();
    for handle in engines {
        let log = handle
            .join()
            .map_err(|_| "an engine thread panicked".to_string())??;
        logs.push(log);
    }
    Ok(ServeReport {
        outcomes,
        engines: logs,
        pool_free: shared.pool().free_count(),
        pool_total: shared.pool().total(),
        blocks_in_use: shared.coordinator().blocks_in_use(),
    })
}

fn main() -> Result<(), BoxError> {
    let started = std::time::Instant::now();
    let report = run(&ServeConfig::default())?;
    let (mut finished, mut cancelled, mut failed, mut tokens) = (0, 0, 0, 0);
    for (plan, outcome) in &report.outcomes {
        match outcome {
            Outcome::Finished { tokens: t, .. } => {
                finished += 1;
                tokens += t.len();
                let ok = t
                    .iter()
                    .enumerate()
                    .all(|(n, &tok)| tok == plan.expected_token(n as u32));
                if !ok {
                    return Err(format!("request {}: wrong tokens", plan.id).into());
                }
            }
            Outcome::Cancelled { tokens: t } => {
                cancelled += 1;
                tokens += t.len();
            }
            Outcome::Failed(e) => {
                failed += 1;
                eprintln!("request {}: {e}", plan.id);
            }
        }
    }
    println!(
        "{} requests on 2 models: {finished} finished, {cancelled} cancelled, {failed} failed; \
         {tokens} tokens streamed in {:.2?}",
        report.outcomes.len(),
        started.elapsed()
    );
    for (i, log) in report.engines.iter().enumerate() {
        println!(
            "engine {i}: {} steps, {} aborted on cancel, {} preempted",
            log.steps,
            log.cancelled.len(),
            log.preempted
        );
    }
    println!(
        "pool: {}/{} pages free at shutdown",
        report.pool_free, report.pool_total
    );
    if failed > 0 || report.pool_free != report.pool_total {
        return Err("the run did not end clean".into());
    }
    Ok(())
}
