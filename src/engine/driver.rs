//! The engine driver: one model's batcher, its share of the coordinator and its KV backend,
//! running the multi-model protocol around each step.

use super::exec::{run_batch, KvBackend, StepModel, StepStats};
use super::shared::SharedArena;
use crate::block::EngineId;
use crate::error::{EngineError, SchedError};
use crate::sched::{
    Batch, Batcher, BatcherConfig, EngineShare, FinishReason, FinishedSeq, PreemptionMode,
    Priority, SeqId, SeqRequest, SeqUpdate, StepResults,
};
use crate::sync::Arc;
use std::mem::ManuallyDrop;

/// When an engine recomputes the coordinator's budgets itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecomputePolicy {
    /// Recompute at the start of each step (after reporting the engine active, so that its
    /// first step after `add` gets tokens) and after each commit, when the coordinator's inputs
    /// changed: registrations, weights, activity or a published token demand (one load when
    /// nothing did).
    pub when_dirty: bool,
    /// Also recompute every this many committed steps (0: never), which refreshes what idle
    /// engines can lend as holdings change. Committed, not scheduled: a failed step and the
    /// schedule that retries it would otherwise shift the count past the multiple, and a
    /// caller whose failures fell on it would never recompute.
    pub every_steps: u32,
}

impl RecomputePolicy {
    /// Engines recompute on changes and every 8 steps: what a server wants.
    pub const SERVER: Self = Self {
        when_dirty: true,
        every_steps: 8,
    };
    /// Engines never recompute at their steps; the caller does (e.g. once per simulated step,
    /// for a deterministic simulation). Building and dropping an engine still publish (the
    /// coordinator's registration and deregistration do).
    pub const CALLER: Self = Self {
        when_dirty: false,
        every_steps: 0,
    };
}

/// How one engine (model) runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// The engine's weight in the coordinator (its share of tokens and pages), at least 1.
    pub weight: u32,
    /// Most sequences running at once.
    pub max_running: u32,
    /// Most tokens in one step (also bounded by the coordinator's token budget), at most
    /// `i32::MAX`.
    pub max_batched_tokens: u32,
    /// Most prompt tokens of one sequence in one step (chunked prefill).
    pub max_prefill_chunk: u32,
    /// Most positions one sequence runs, in tokens: its prompt and every output token but the
    /// last (sampled, never fed back: [`SeqRequest::max_cached_tokens`]), so a prompt of `p`
    /// tokens may ask for up to `max_context + 1 - p` new ones.
    pub max_context: u32,
    /// What preemption does with a victim's KV.
    pub preemption: PreemptionMode,
    /// Host swap slots (pages) for swap preemption; under recompute preemption nothing is
    /// swapped, and the engine's constructors allocate no swap space whatever this says
    /// ([`swap_space_pages`](Self::swap_space_pages)).
    pub swap_blocks: u32,
    /// When the engine recomputes the coordinator's budgets.
    pub recompute: RecomputePolicy,
    /// Whether the engine uses the arena's prefix cache (if the arena has one). An engine that
    /// does not still evicts the others' cached-free pages when the pool runs dry (they count
    /// as free in the coordinator).
    pub prefix_cache: bool,
}

/// What one [`Engine::step`] (or [`Engine::commit`]) reports besides its
/// [`results`](Engine::results).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepReport {
    /// The executed step.
    pub exec: StepStats,
    /// Tokens scheduled.
    pub scheduled: u32,
    /// Tokens sampled: one per logits index (one per sampling row, `d + 1` for a row with
    /// `d` draft tokens, rejected ones included).
    pub sampled: u32,
    /// Pages this engine was asked to give back at the start of the step (reclaim orders of
    /// lenders and donations to other engines).
    pub pages_shed: u32,
    /// Whether this engine asked another for pages this step (a donation).
    pub asked_donation: bool,
    /// Set when a reclaim demand closed at this step: how many steps it took from the demand
    /// (the next admission fits this engine's limit but not the pool's free pages, because
    /// pages of its share are lent out, or the last step left a running row waiting for such
    /// pages: [`Batcher::waiting_for_lent_pages`]) to the pages being free.
    pub reclaim_closed_after: Option<u64>,
}

impl EngineConfig {
    /// The swap space the engine's constructors allocate: `swap_blocks` pages under swap
    /// preemption, none under recompute (its batcher never swaps).
    pub fn swap_space_pages(&self) -> u32 {
        match self.preemption {
            PreemptionMode::Swap => self.swap_blocks,
            PreemptionMode::Recompute => 0,
        }
    }
}

/// One model's engine on a shared arena: a continuous-batching [`Batcher`], its share of the
/// coordinator, its KV backend, and the multi-model protocol around each step:
///
/// - **before scheduling**: pages lenders reclaim ([`BudgetCoordinator::reclaim_for`]) or
///   pages other engines asked for ([`SharedArena::take_donations`]), the larger, become a
///   shed request (the batcher preempts to give them back); latency-critical work that waits for pages lent
///   out asks the lowest-priority engine for a donation (once per step of that donor: the
///   request is not repeated on each of this engine's steps while the donor has not taken it);
/// - **after commit**: the engine publishes what preempting it would free (donor choice of the
///   others) and recomputes budgets as its [`RecomputePolicy`] says.
///
/// Nothing here waits for another engine: each call is the engine's own work plus wait-free or
/// lock-free operations on the shared state, except that a [`HostBackend`](super::HostBackend)'s
/// kernels run on rayon's pool, shared with every other engine's (module docs).
/// [`step`](Self::step) is [`schedule`](Self::schedule) + [`execute`](Self::execute) +
/// [`commit`](Self::commit); a caller that interleaves engines (a simulation with a
/// deterministic order) calls them apart.
///
/// [`BudgetCoordinator::reclaim_for`]: crate::budget::BudgetCoordinator::reclaim_for
#[derive(Debug)]
pub struct Engine<B: KvBackend> {
    id: EngineId,
    shared: Arc<SharedArena>,
    /// Dropped by hand in `Drop`, before the engine leaves the coordinator (its drop gives the
    /// engine's pages and their budget back).
    batcher: ManuallyDrop<Batcher>,
    backend: B,
    cfg: EngineConfig,
    finished: Vec<FinishedSeq>,
    results: StepResults,
    sampled: Vec<u32>,
    pairs: Vec<(u32, u32)>,
    report: StepReport,
    steps: u64,
    /// Steps committed so far: what [`RecomputePolicy::every_steps`] counts.
    commits: u64,
    demand_since: Option<u64>,
    /// Whether the current batch was executed (commit refuses an unexecuted non-empty batch).
    executed: bool,
    /// Whether an execute of the current batch failed part-way: it is not run again (its
    /// rows may have written pages its swap-outs or copies read), only discarded by the next
    /// schedule.
    exec_failed: bool,
    /// Whether the last schedule's step was committed (its results handed over); false from a
    /// schedule until its commit succeeds, whether or not the batch has rows: the ends that
    /// schedule reported stay in `results` until then.
    committed: bool,
    /// The donor last asked for pages and its count of takes read after asking
    /// ([`SharedArena::donations_taken`]): it is asked again only once it has taken that
    /// request.
    donation_asked: Option<(EngineId, u64)>,
}

impl<B: KvBackend> Engine<B> {
    /// Registers an engine of `cfg.weight` with the shared coordinator and builds its batcher
    /// over `backend` (whose geometry gives the tokens per page).
    ///
    /// The backend must work on `shared`'s arena: a [`HostBackend`](super::HostBackend) over a
    /// view of [`SharedArena::host_arena`] (see [`Engine::host`]) or a device backend over
    /// `SharedArena::device_arena` (feature `cuda`). Refused ([`EngineError::InvalidConfig`]):
    /// a backend whose cache has another page count than the pool, and under swap preemption
    /// one whose swap space ([`KvBackend::swap_slots`]) holds fewer than `cfg.swap_blocks`
    /// pages.
    pub fn new(
        shared: &Arc<SharedArena>,
        cfg: EngineConfig,
        backend: B,
    ) -> Result<Self, EngineError> {
        if cfg.max_context == 0 {
            return Err(EngineError::InvalidConfig(
                "max_context must be at least 1 token".into(),
            ));
        }
        let kv = *backend.config();
        if kv.num_blocks() != shared.pool().total() as usize {
            return Err(EngineError::InvalidConfig(format!(
                "the backend's cache has {} pages, the shared pool {}",
                kv.num_blocks(),
                shared.pool().total()
            )));
        }
        // The batcher hands out swap slots 0..swap_blocks; a backend with fewer would refuse
        // every swap-out into the others (each such step failing, found only at run time).
        if let (PreemptionMode::Swap, Some(slots)) = (cfg.preemption, backend.swap_slots()) {
            if cfg.swap_blocks as usize > slots {
                return Err(EngineError::InvalidConfig(format!(
                    "swap_blocks is {}, the backend's swap space {slots} pages",
                    cfg.swap_blocks
                )));
            }
        }
        let block_size = kv.block_size() as u32;
        let mut batcher_cfg = BatcherConfig {
            engine: EngineId(0), // the registered id, below
            block_size,
            max_running: cfg.max_running,
            max_batched_tokens: cfg.max_batched_tokens,
            max_prefill_chunk: cfg.max_prefill_chunk,
            // The engine's sequences together may grow past its guaranteed share into pages
            // others leave idle (reclaim orders preempt them when the lenders want them
            // back); one sequence alone is bounded by the share itself (the budget's
            // `guaranteed_blocks`), or it could be preempted for as long as others work.
            max_blocks_per_seq: cfg
                .max_context
                .div_ceil(block_size)
                .min(shared.pool().total()),
            preemption: cfg.preemption,
            swap_blocks: cfg.swap_space_pages(),
        };
        // Refused before registering: a registration publishes new shares, and the other
        // engines would shed or end sequences for an engine that never runs.
        batcher_cfg.check()?;
        let coordinator = shared.coordinator().clone();
        let id = coordinator.register(cfg.weight)?;
        batcher_cfg.engine = id;
        // Donations asked of an earlier engine on this id (dropped before it took them) are
        // not this engine's to shed: discarded. None can be asked of this one yet: a donor is
        // picked by the load it publishes, which it does first at a commit. A request the
        // earlier engine made and did not withdraw (it was leaked, not dropped) is not this
        // one's either.
        let _ = shared.take_donations(id);
        let _ = shared.withdraw_donation(id);
        coordinator.recompute();
        let batcher = Batcher::new(batcher_cfg, shared.pool().clone());
        let mut batcher = match batcher {
            Ok(b) => b,
            Err(e) => {
                // Leave the coordinator as it was.
                let _ = coordinator.deregister(id);
                coordinator.recompute();
                return Err(e.into());
            }
        };
        batcher.attach_budget(Box::new(EngineShare::new(coordinator.clone(), id)));
        // An engine that does not use the arena's cache still evicts from it: the other
        // engines' cached-free pages count as free in the coordinator (lendable), so without
        // eviction its budget would grant pages the pool never hands out.
        if let Some(cache) = shared.prefix_cache() {
            let attached = if cfg.prefix_cache {
                batcher.attach_prefix_cache(cache.clone())
            } else {
                batcher.attach_prefix_cache_for_eviction(cache.clone())
            };
            if let Err(e) = attached {
                drop(batcher);
                let _ = coordinator.deregister(id);
                coordinator.recompute();
                return Err(e.into());
            }
        }
        Ok(Self {
            id,
            shared: shared.clone(),
            batcher: ManuallyDrop::new(batcher),
            backend,
            cfg,
            finished: Vec::new(),
            results: StepResults::default(),
            sampled: Vec::new(),
            pairs: Vec::new(),
            report: StepReport::default(),
            steps: 0,
            commits: 0,
            demand_since: None,
            executed: true,
            exec_failed: false,
            committed: true,
            donation_asked: None,
        })
    }

    /// The engine's id in the pool and the coordinator.
    pub fn id(&self) -> EngineId {
        self.id
    }

    /// The engine's configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The batcher (statistics, sequence phases).
    pub fn batcher(&self) -> &Batcher {
        &self.batcher
    }

    /// The KV backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The KV backend, mutable, for this module's backend-specific settings (not public: a
    /// caller running batches on it directly would break the batcher's ownership of pages).
    #[cfg(any(feature = "cuda", feature = "cuda-emu"))]
    pub(super) fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// The shared arena.
    pub fn shared(&self) -> &Arc<SharedArena> {
        &self.shared
    }

    /// Tokens per page of this engine's view.
    pub fn tokens_per_page(&self) -> u32 {
        self.batcher.config().block_size
    }

    /// Steps scheduled so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Whether the engine has sequences (waiting, running or swapped), or ends still to
    /// report: those of a step that was not committed (it failed), which the next step reports
    /// ([`schedule`](Self::schedule)). A caller that steps while this holds delivers every end,
    /// also when the failed step's schedule ended the engine's last sequence.
    pub fn has_work(&self) -> bool {
        self.batcher.has_work() || (!self.committed && !self.finished.is_empty())
    }

    /// Queues a request; refused at once if malformed or too long ever to fit (past
    /// `max_context` tokens, or the pages one sequence can get: the engine's guaranteed share
    /// of the arena, its block quota, since pages borrowed beyond it are taken back whenever
    /// the other engines have work). A queued sequence whose need the share no longer covers
    /// (an engine registered, weights changed) ends with
    /// [`FinishReason::TooLong`](crate::sched::FinishReason::TooLong) at the next step.
    pub fn add(&mut self, req: SeqRequest) -> Result<(), SchedError> {
        self.add_salted(req, 0)
    }

    /// [`add`](Self::add) with a prefix-cache salt (requests share cached blocks only with
    /// requests of the same salt, e.g. one per tenant).
    ///
    /// An id is taken until its sequence's end is reported: one that ended at the schedule of
    /// a step not yet committed (it failed, say, even with no rows) is reported by the next
    /// step, and a new request on it is refused ([`SchedError::DuplicateId`]) until then (its
    /// results would otherwise hold the old sequence's end under the new one's id).
    pub fn add_salted(&mut self, req: SeqRequest, salt: u64) -> Result<(), SchedError> {
        if !self.committed && self.finished.iter().any(|f| f.id == req.id) {
            return Err(SchedError::DuplicateId(req.id));
        }
        // The batcher's own limit is whole pages, which may hold more than max_context.
        let tokens = req.max_cached_tokens();
        if tokens > u64::from(self.cfg.max_context) {
            return Err(SchedError::ContextTooLong {
                id: req.id,
                tokens,
                max_context: u64::from(self.cfg.max_context),
            });
        }
        self.batcher.add_salted(req, salt)
    }

    /// Ends a sequence at the start of the next step with [`FinishReason::Aborted`].
    pub fn abort(&mut self, id: SeqId) -> Result<(), SchedError> {
        self.batcher.abort(id)
    }

    /// Ends a sequence at the start of the next step with the caller's reason (e.g.
    /// [`FinishReason::Caller`] for a stop string found by its detokenizer).
    pub fn finish_with(&mut self, id: SeqId, reason: FinishReason) -> Result<(), SchedError> {
        self.batcher.finish_with(id, reason)
    }

    /// Proposes draft tokens for a decoding sequence's next step (speculative decoding): see
    /// [`Batcher::propose`]. The model's [`sample`](StepModel::sample) then returns one token
    /// per logits index, and the commit accepts the confirmed drafts and rolls back the rest.
    pub fn propose(&mut self, id: SeqId, drafts: &[u32]) -> Result<(), SchedError> {
        self.batcher.propose(id, drafts)
    }

    /// The last step's per-sequence results: sequences that ended at the start of the step
    /// (aborts, caller finishes; after a step that was not committed, its own come first: see
    /// [`schedule`](Self::schedule)), then one entry per sampled row in row order.
    pub fn results(&self) -> &StepResults {
        &self.results
    }

    /// Sequences that finished in the last step, with their whole output.
    pub fn finished(&self) -> &[FinishedSeq] {
        &self.finished
    }

    /// The current batch (after [`schedule`](Self::schedule)).
    pub fn batch(&self) -> &Batch {
        self.batcher.batch()
    }

    /// Runs the protocol's first half and schedules the next step: applies reclaim orders and
    /// donation requests as a shed request, asks a donor for pages if latency-critical work
    /// waits for pages lent out, and builds the batch. Sequences ended by aborts or caller
    /// finishes appear in [`results`](Self::results) and [`finished`](Self::finished).
    ///
    /// Called again before [`commit`](Self::commit) (after an [`execute`](Self::execute) that
    /// failed, say, and an [`abort`](Self::abort) of the sequence at fault), it discards the
    /// uncommitted batch safely first ([`Batcher::schedule_into`]): its rows are scheduled
    /// again, and the sequences whose KV it was to swap or copy are preempted by recompute.
    /// The sequences that ended at the uncommitted step's schedule (one with no rows too) are
    /// reported again, first, in this step's [`results`](Self::results) and
    /// [`finished`](Self::finished) (a failed step's caller need not deliver them; one that did
    /// sees them twice).
    pub fn schedule(&mut self) -> &Batch {
        // A step not committed (its execute or its commit failed) is discarded below. Its
        // results hold only the sequences that ended at its schedule (a commit appends only
        // once it succeeds), and the caller of a failed step does not deliver them: they are
        // reported again with this step's, or those sequences' ends would be lost. A step of
        // no rows too: its batch is not pending, but its ends were not delivered either.
        if self.committed {
            self.results.clear();
            self.finished.clear();
        }
        self.report = StepReport::default();
        // An engine that just got its first requests reports itself active and, as the policy
        // allows, has the budgets recomputed now: its first step then gets tokens (without
        // this, an idle engine's first step after `add` schedules nothing).
        self.batcher.sync_activity();
        if self.cfg.recompute.when_dirty {
            self.shared.coordinator().maybe_recompute();
        }
        self.track_reclaim();
        self.steps += 1;
        match self.donation_needed() {
            // One request outstanding per donor: while the donor has not taken the last one
            // (it has not stepped since), asking again on each of this engine's steps would
            // pile up requests for the same pages, and the donor would shed them all.
            Some((donor, pages))
                if self.donation_asked.is_none_or(|(d, taken)| {
                    d != donor || self.shared.donations_taken(donor) != taken
                }) =>
            {
                self.shared.ask_donation(self.id, donor, pages);
                // Read after asking: a take racing the ask may count as the one this request
                // waits for (the next ask then waits a donor step longer), never the reverse.
                self.donation_asked = Some((donor, self.shared.donations_taken(donor)));
                self.report.asked_donation = true;
            }
            Some(_) => {}
            // The need went away (the request was admitted with pages freed elsewhere, or
            // aborted): a request its donor has not taken yet is withdrawn, or the donor would
            // preempt its own work for pages nobody waits for.
            None => {
                if self.donation_asked.take().is_some() {
                    self.shared.withdraw_donation(self.id);
                }
            }
        }
        // Not their sum: a donation is asked only for pages that fit the asker's limit but not
        // the pool's free pages, pages lent out, and what a reclaim order gives back goes to the
        // pool, where the asker takes them. A lender short of pages it lent both asks for a
        // donation and (its raised block demand) orders the borrowers to give back: summed,
        // a borrower given both at one step preempted the asked pages twice, for nothing.
        // (Taken at different steps they do not add up either: the order asks only for what
        // this engine still holds above its limit.)
        let shed = self
            .shared
            .coordinator()
            .reclaim_for(self.id)
            .max(self.shared.take_donations(self.id));
        if shed > 0 {
            self.batcher.request_shed(shed);
            self.report.pages_shed = shed;
        }
        let ended_before = self.finished.len();
        self.batcher.schedule_into(&mut self.finished);
        for f in &self.finished[ended_before..] {
            let at = self.results.tokens.len();
            self.results.updates.push(SeqUpdate {
                id: f.id,
                tokens: at..at,
                finished: Some(f.reason),
            });
        }
        self.executed = self.batcher.batch().is_empty();
        self.exec_failed = false;
        self.committed = false;
        self.report.scheduled = self.batcher.batch().num_tokens() as u32;
        self.batcher.batch()
    }

    /// Runs the scheduled batch's KV work and attention with `model`'s projections, once:
    /// refused for a batch already executed, or whose execute failed (running it again could
    /// copy pages its first run's rows had already written: schedule again instead, which
    /// discards it, after aborting the sequence at fault).
    pub fn execute<M: StepModel<B> + ?Sized>(
        &mut self,
        model: &mut M,
    ) -> Result<StepStats, EngineError> {
        if !self.batcher.batch().is_empty() && (self.executed || self.exec_failed) {
            return Err(EngineError::InvalidConfig(
                "the scheduled batch was executed already, or failed part-way: schedule again"
                    .into(),
            ));
        }
        let stats = run_batch(
            &mut self.backend,
            model,
            self.batcher.batch(),
            &mut self.pairs,
        );
        self.exec_failed = stats.is_err();
        if self.exec_failed {
            // The batch will not run again: what the step borrowed goes back now, as at a
            // commit, not at whatever later step the caller schedules.
            self.batcher.step_failed();
        }
        let stats = stats?;
        self.executed = true;
        self.report.exec = stats;
        Ok(stats)
    }

    /// Samples with `model`, commits the step, publishes this engine's preemptible load and
    /// recomputes budgets as the policy says. Refused (nothing applied, the model not called)
    /// if the batch was not executed, or if this step was committed already (once per
    /// [`schedule`](Self::schedule): a second commit would report the step twice).
    pub fn commit<M: StepModel<B> + ?Sized>(
        &mut self,
        model: &mut M,
    ) -> Result<StepReport, EngineError> {
        if self.committed {
            return Err(EngineError::InvalidConfig(
                "the step was committed already: schedule the next".into(),
            ));
        }
        if !self.executed {
            return Err(EngineError::InvalidConfig(
                "commit before the scheduled batch was executed".into(),
            ));
        }
        self.sampled.clear();
        let committed = model
            .sample(self.batcher.batch(), &mut self.sampled)
            .and_then(|()| {
                self.batcher
                    .commit_with_updates(&self.sampled, &mut self.finished, &mut self.results)
                    .map_err(EngineError::from)
            });
        if let Err(e) = committed {
            // Nothing was applied and the caller schedules again (discarding the batch): what
            // the step borrowed goes back now, as at a successful commit.
            self.batcher.step_failed();
            return Err(e);
        }
        self.report.sampled = self.sampled.len() as u32;
        self.committed = true;
        self.commits += 1;
        let coordinator = self.shared.coordinator();
        match self.batcher.preemptible_load() {
            Some((class, pages)) => coordinator.publish_load(self.id, class.rank(), pages),
            None => coordinator.clear_load(self.id),
        }
        let policy = self.cfg.recompute;
        if policy.every_steps > 0 && self.commits % u64::from(policy.every_steps) == 0 {
            coordinator.recompute();
        } else if policy.when_dirty {
            coordinator.maybe_recompute();
        }
        Ok(self.report)
    }

    /// One whole step: [`schedule`](Self::schedule), [`execute`](Self::execute),
    /// [`commit`](Self::commit).
    ///
    /// On an error nothing of the batch is committed and the engine is not poisoned: abort the
    /// sequence at fault (a step that fails for its input fails again) and step again; that
    /// step discards the failed batch and reports the sequences that ended at its start. The
    /// tokens the failed step holds above the engine's share (lent by other engines) go back
    /// at the failure, as at a commit; the rest, its pages and its sequences stay until then.
    pub fn step<M: StepModel<B> + ?Sized>(
        &mut self,
        model: &mut M,
    ) -> Result<StepReport, EngineError> {
        self.schedule();
        self.execute(model)?;
        self.commit(model)
    }

    /// If latency-critical work waits for pages that are lent out (this engine is within its
    /// limit, the pool is not), the lower-priority engine to take them from and how many.
    /// (When the engine's own limit binds, a donation would not help: its step preempts its
    /// own throughput sequences for the request, or it waits for reclaim orders to return its
    /// lent share.) None either where the pool's free pages and what this engine's own
    /// throughput sequences would give up cover the need: the step preempts those for the
    /// request ([`Batcher::throughput_room`]), a step sooner than a donor would shed.
    fn donation_needed(&self) -> Option<(EngineId, u32)> {
        let (class, need) = self.batcher.next_admission_need()?;
        if class != Priority::LatencyCritical || !self.lent_out_blocks(need) {
            return None;
        }
        let c = self.shared.coordinator();
        let free = u64::from(c.config().total_blocks).saturating_sub(c.blocks_in_use());
        if free + u64::from(self.batcher.throughput_room()) >= u64::from(need) {
            return None;
        }
        let donor = self
            .shared
            .coordinator()
            .pick_donor(self.id, class.rank(), need)?;
        Some((donor.engine, need))
    }

    /// Whether `need` more pages fit this engine's limit but not the pool's free pages.
    fn lent_out_blocks(&self, need: u32) -> bool {
        let c = self.shared.coordinator();
        let need = u64::from(need);
        c.blocks_held(self.id) + need <= u64::from(c.block_limit(self.id))
            && c.blocks_in_use() + need > u64::from(c.config().total_blocks)
    }

    /// Reclaim latency, at the start of each step: a demand is open while the next admission
    /// fits this engine's limit but not the pool's free pages, or while the last step left a
    /// running row waiting for pages this engine lent (a lender's own work, not only its
    /// arrivals, waits for the borrowers); it closes at the first step where the pages are
    /// free (or the demand went away). A row's wait is seen a step late (after the schedule
    /// that waited) and closes a step late (after the schedule that got the pages): the count
    /// is the steps it waited.
    fn track_reclaim(&mut self) {
        let demand = self.batcher.waiting_for_lent_pages()
            || self
                .batcher
                .next_admission_need()
                .is_some_and(|(_, need)| self.lent_out_blocks(need));
        match (demand, self.demand_since) {
            (true, None) => self.demand_since = Some(self.steps),
            (false, Some(since)) => {
                self.report.reclaim_closed_after = Some(self.steps - since);
                self.demand_since = None;
            }
            _ => {}
        }
    }
}

impl<B: KvBackend> Drop for Engine<B> {
    fn drop(&mut self) {
        // The backend's queued work first (a step that failed part-way may still write pages):
        // only then may the batcher give its pages to the other engines.
        let _ = self.backend.end();
        // SAFETY: the batcher is dropped once, here, and never used after (this is the
        // engine's drop; no other code path drops it).
        unsafe { ManuallyDrop::drop(&mut self.batcher) };
        // The batcher gave every page back; the engine's share now goes to the others. A
        // donation it asked for and its donor has not taken goes with it: the donor would
        // otherwise preempt its own work, at its next step, for pages nobody waits for.
        let _ = self.shared.withdraw_donation(self.id);
        self.shared.coordinator().clear_load(self.id);
        let _ = self.shared.coordinator().deregister(self.id);
        self.shared.coordinator().recompute();
    }
}

impl<T: crate::kv::KvElem> Engine<super::HostBackend<T>> {
    /// An engine whose cache is a view of `shared`'s host arena with `shape`'s geometry (its
    /// own tokens per page), on the CPU kernels, for a model of `query_heads` heads.
    pub fn host(
        shared: &Arc<SharedArena>,
        cfg: EngineConfig,
        shape: &crate::kv::ModelKvShape,
        query_heads: usize,
    ) -> Result<Self, EngineError> {
        let arena = shared.host_arena().ok_or_else(|| {
            EngineError::InvalidConfig("the shared arena is not a host arena".into())
        })?;
        let view = crate::kv::ArenaView::new(arena.clone(), shape)?;
        // SAFETY: the engine runs only its own batcher's current batch on this backend, before
        // the batcher's next schedule or commit, and its batcher takes pages from `shared`'s
        // pool, which hands out exactly this arena's pages; every other engine built here
        // keeps the same rule (`HostBackend::new`'s contract).
        let backend =
            unsafe { super::HostBackend::new(view, query_heads, cfg.swap_space_pages() as usize)? };
        Self::new(shared, cfg, backend)
    }
}
