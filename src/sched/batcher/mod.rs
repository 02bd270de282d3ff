//! The continuous-batching scheduler of one engine.

mod preempt;
mod prefix_link;
mod rows;
#[cfg(test)]
mod swapped_lc_tests;
#[cfg(test)]
mod tests;

use super::batch::Batch;
use super::sequence::{
    FinishReason, FinishedSeq, Priority, SeqId, SeqPhase, SeqRequest, SeqUpdate, Sequence,
    StepResults,
};
use crate::block::{BlockId, BlockPool, BlockTable, EngineId};
use crate::error::SchedError;
use crate::sync::Arc;
use std::collections::{HashMap, VecDeque};

/// How a preempted sequence gives its blocks back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptionMode {
    /// Free its blocks and recompute its tokens later (no copy; costs a prefill).
    Recompute,
    /// Copy its blocks to host swap space and back on resume (falls back to recompute when the
    /// swap space is full).
    Swap,
}

/// How a batcher schedules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatcherConfig {
    /// The engine this batcher allocates blocks for.
    pub engine: EngineId,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Most sequences running at once.
    pub max_running: u32,
    /// Most tokens in one step, at most `i32::MAX` (a batch counts its tokens in `i32`).
    pub max_batched_tokens: u32,
    /// Most prompt tokens of one sequence in one step (chunked prefill).
    pub max_prefill_chunk: u32,
    /// Most blocks one sequence may hold (its longest context / block size).
    pub max_blocks_per_seq: u32,
    /// Preemption by recompute or swap.
    pub preemption: PreemptionMode,
    /// Host swap slots (blocks) available to this batcher; at most
    /// [`MAX_BLOCKS`](crate::block::MAX_BLOCKS), as many as a swap space holds.
    pub swap_blocks: u32,
}

/// The budget a batcher draws against besides its own limits: an engine's share of a global
/// coordinator (see [`crate::budget`]). Every call runs inside the step, so none may block: no
/// lock, no waiting for another thread. A call may retry only when another thread's operation
/// succeeded, or when a weak compare-exchange failed spuriously (LL/SC machines allow that,
/// x86 never does): lock-free; the coordinator's link is wait-free except its releases, which
/// are lock-free ([`EngineShare`](crate::sched::EngineShare)).
pub trait EngineBudget: Send + Sync {
    /// Tokens this engine may schedule this step.
    fn token_budget(&self) -> u32;
    /// Takes `n` blocks against the engine's quota; `false` (and nothing taken) if over.
    fn try_acquire_blocks(&self, n: u32) -> bool;
    /// Gives back `n` blocks taken with `try_acquire_blocks`.
    fn release_blocks(&self, n: u32);
    /// Reports whether the engine has work (idle engines lend their share).
    fn set_active(&self, active: bool);
    /// Reports the tokens scheduled this step, and the step's demand: the tokens it would
    /// have scheduled with no external budget, at most `max_batched_tokens` (equal to
    /// `tokens` when something else bounded the step: it ran out of work, pages or sequence
    /// slots). A demand below the engine's share lets the coordinator lend the rest.
    fn record_step(&self, tokens: u32, demand: u32) {
        let _ = (tokens, demand);
    }
    /// Reports that the step's batch has run (its commit). Tokens held above the engine's
    /// guaranteed share may go back here rather than at the next schedule, so that an engine
    /// they were lent from does not wait for this one's next step to get them.
    fn step_ran(&self) {}
    /// The most blocks this engine is sure to get whatever the other engines do (its block
    /// quota), or `None` when unknown yet or unbounded (the default). One sequence needing more
    /// could be preempted forever (what it borrows above this is taken back whenever a lender
    /// has work), so the batcher refuses such a request at [`Batcher::add`]
    /// ([`SchedError::TooLong`]), and when the figure drops below the need of a sequence it
    /// holds (an engine registered, weights changed), ends that sequence at its next step with
    /// [`FinishReason::TooLong`]. Called once per step: keep it a few loads.
    fn guaranteed_blocks(&self) -> Option<u32> {
        None
    }
    /// Every engine's block quota (its weighted share of the pages), indexed by engine id:
    /// what prefix-cache eviction weighs engines by. Only called when the pool runs dry.
    fn block_quotas(&self) -> Vec<u32> {
        Vec::new()
    }
    /// Every engine's blocks held against its budget (the pages its sequences reference and
    /// its pending swap-outs read), indexed by engine id. Beside the pool's count of the pages
    /// an engine owns, it bounds the engine's cached-free pages, so that prefix-cache eviction
    /// tries first the engines that may have some: a sweep over an engine whose cached pages
    /// are all in use reads every page's record twice and finds nothing. Only called when the
    /// pool runs dry. Empty (the default): unknown, every engine with cached pages is tried in
    /// share order.
    fn blocks_held(&self) -> Vec<u32> {
        Vec::new()
    }
}

/// Counters of a batcher's life. The scheduling counters (steps, tokens, swaps, copies) count
/// every scheduled batch, those discarded uncommitted and scheduled again included; a
/// discard's recomputes count as preemptions by recompute.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatcherStats {
    /// Steps scheduled.
    pub steps: u64,
    /// Tokens scheduled (prefill and decode).
    pub tokens_scheduled: u64,
    /// Preemptions by recompute.
    pub preempted_recompute: u64,
    /// Preemptions by swap.
    pub preempted_swap: u64,
    /// Blocks swapped out.
    pub blocks_swapped_out: u64,
    /// Blocks swapped in.
    pub blocks_swapped_in: u64,
    /// Copy-on-write block copies.
    pub cow_copies: u64,
    /// Sequences finished (any reason but abort).
    pub finished: u64,
    /// Sequences aborted (by the caller, or ended with [`FinishReason::TooLong`]).
    pub aborted: u64,
    /// Prompt tokens of sequences admitted for the first time with a prefix cache attached.
    pub prefix_prompt_tokens: u64,
    /// Of those, tokens found in the prefix cache (not prefilled).
    pub prefix_hit_tokens: u64,
    /// Tokens attached from the prefix cache on any admission, re-admissions after a
    /// preemption by recompute included: computation saved.
    pub prefix_reused_tokens: u64,
}

/// The continuous-batching scheduler of one engine.
///
///
/// Driven by the engine's step loop, single-threaded (`&mut self`): the concurrency lives in the
/// shared [`BlockPool`] and budget it draws from, and in the admission queues that feed it.
///
/// ```text
///   add ──► waiting ──► running (prefilling in chunks ──► decoding) ──► finished
///              ▲   recompute    │  swap                                  ▲
///              └────────────────┤────► swapped ──► running               │ abort (any time)
/// ```
///
/// Each [`schedule_into`](Batcher::schedule_into) step:
/// 1. running sequences, latency-critical first and oldest first within a class (the order
///    preemption spares them in): a decoding one gets one token; a prefilling one a chunk of
///    at most `max_prefill_chunk` tokens; all within the step's token budget (the smaller of
///    `max_batched_tokens` and the attached budget's). Blocks are taken from the pool so every
///    sequence's table covers its tokens; when the pool (or the block quota) runs dry, a
///    prefill chunk first runs shorter (to what the free pages, this step's swapped-out ones
///    included, hold; halving where the quota refused) rather than cost a sequence of its own
///    class a preemption, and otherwise the running sequence of lowest
///    priority and latest arrival (by that order, never one already in the batch) is
///    preempted, by recompute or by swap (by recompute where its swap-out would give up fewer
///    pages than the row lacks and a recompute more: with a prefix cache, a swap-out keeps the
///    completed pages the cache also holds until the batch has run). The oldest sequence is
///    never the victim while a younger one of its class runs, so a workload that fits one
///    sequence at a time always finishes. Under an attached budget "fits" means within the
///    engine's guaranteed blocks ([`EngineBudget::guaranteed_blocks`]): a longer request is
///    refused at [`add`](Batcher::add), and one the guarantee shrank below is ended at the
///    start of the next step with [`FinishReason::TooLong`], so no sequence is preempted
///    forever for want of pages that other engines' work keeps.
///    Between the running latency-critical sequences and the running throughput ones, the
///    latency-critical class's others come in: swapped ones come back (oldest first), then,
///    once none is left swapped, waiting ones are admitted (first come first served) within
///    the tokens the running throughput decoders leave (one each): the throughput prefill
///    chunks and draft tokens give way, running shorter this step or not at all (no row; a
///    long prompt in chunks would otherwise hold a latency-critical first token for as many
///    steps as it has chunks), the oldest keeping the most. One short of pages (pool or quota)
///    or of a running slot (`max_running` sequences run) preempts running throughput
///    sequences (none is in the batch yet), latest arrival first: the latest for the slot (its
///    tokens then go to the admission), more while the pages they give up at once fall short
///    of its first chunk (all of a swapped one's pages), and only if that brings it in: where
///    preempting all of them would not, none is preempted and it waits (a page that stays
///    allocated after the preemption, one that a fork or the request's attached prefix also
///    holds, does not count; in swap mode a victim whose swap-out would keep pages the prefix
///    cache also holds is recomputed where the request needs them). A latency-critical
///    sequence is never preempted for another, so a flood of latency-critical work may starve
///    throughput work (the class's priority); without latency-critical work nothing preempts
///    for admissions. None of this in a step whose latency-critical rows preempted or
///    shortened a chunk for want of pages.
/// 2. once no latency-critical request waits, the other swapped sequences come back (oldest
///    first) when their blocks fit, unless this step preempted or shortened a chunk for want
///    of pages: a swapped throughput sequence never takes the pages of a latency-critical
///    admission;
/// 3. then waiting throughput requests are admitted, first come first served, if no swapped
///    sequence is left to come back before them, unless this step preempted or shortened a
///    chunk (admitting then would only thrash).
///
/// The cost of a step is O(scheduled sequences + their new tokens + their blocks), plus, with
/// a prefix cache on a pool run dry, the eviction's walk over page records (CLOCK: up to two
/// laps of the pool per engine it tries, the engines likely to have cached-free pages first,
/// see [`EngineBudget::blocks_held`]). The
/// [`Batch`] buffers and the scratch vectors are reused; what a decode step still allocates is
/// each sequence's token list growing (its request's prompt `Vec`, doubling as tokens are
/// appended), unless the prompt was given capacity for its output ([`Batch`]'s docs).
pub struct Batcher {
    cfg: BatcherConfig,
    pool: Arc<BlockPool>,
    budget: Option<Box<dyn EngineBudget>>,
    /// The prefix cache shared with the pool's other engines, if attached.
    prefix: Option<prefix_link::PrefixLink>,
    /// Sequence storage; `free_slots` lists the empty entries.
    seqs: Vec<Option<Sequence>>,
    free_slots: Vec<usize>,
    index: HashMap<SeqId, usize>,
    /// Waiting sequences per priority class, FCFS (recompute-preempted ones at the front).
    waiting: [VecDeque<usize>; 2],
    /// Running sequences; sorted by priority, then arrival, at the start of each step (the
    /// victim choice only reaches the sequences not yet in the batch, so every one before them
    /// must be one preemption would spare).
    running: Vec<usize>,
    /// Whether a push may have put `running` out of order (a latency-critical admission after
    /// throughput ones, a swap-in, a fork): only then does the step sort it.
    running_unsorted: bool,
    /// Swapped-out sequences, by priority, then arrival.
    swapped: VecDeque<usize>,
    /// Free host swap slots; `host_released` holds slots freed this step (reusable next step).
    host_free: Vec<u32>,
    host_released: Vec<u32>,
    /// Pages swapped out by the batch in flight: their sequences no longer hold them, but the
    /// batch's swap-out still reads them, so this batcher keeps one reference (and their
    /// budget) until the batch has run (the next commit or schedule). With one arena shared by
    /// every model, a page freed at schedule time could be written by another engine's kernels
    /// while this engine's swap-out copies it.
    swap_out_pending: Vec<BlockId>,
    /// Leading entries of `swap_out_pending` held for swap-outs of this step's shed
    /// ([`request_shed`](Batcher::request_shed)): pages given back on an order, which this
    /// engine must not take again for its own sequences in the same step (only a page the
    /// budget grants again may be; reusing one would keep the engine over the limit the order
    /// was about). Reset when the held pages are released.
    shed_held: usize,
    /// What the last `take_pages` that failed had on hand: the pages of this step's swap-outs
    /// it may reuse and the pool's free pages after its eviction; `None` where the attached
    /// budget refused first, before the pool (and the prefix cache's eviction) was asked, so
    /// that the pool's free count says nothing (its free list may be empty while the cache
    /// holds every other page). `shorter_chunk` sizes a shorter chunk by it.
    pages_on_hand: Option<u32>,
    /// Aborts and caller finishes requested since the last step, applied at the start of the
    /// next one (the batch in flight may still reference their blocks).
    pending_aborts: Vec<(SeqId, FinishReason)>,
    /// Blocks to give back at the start of the next step, by preempting (a reclaim order of
    /// the budget coordinator, or a donation to a higher-priority engine).
    shed_request: u32,
    batch: Batch,
    /// This step's rows: (slot, new tokens, draft tokens among them).
    scheduled: Vec<(usize, usize, usize)>,
    /// A non-empty batch was scheduled and not yet committed (the next schedule_into
    /// discards it).
    uncommitted: bool,
    scratch: Vec<BlockId>,
    /// Row stride of `batch.block_tables`, kept across steps so that rows stay in place.
    row_width: usize,
    /// The slot whose blocks each row of `batch.block_tables` holds (`usize::MAX`: none).
    row_owner: Vec<usize>,
    arrivals: u64,
    stats: BatcherStats,
    active_reported: bool,
    /// Whether this step's token budget left work out (a row shorter than it wanted, a
    /// decoder or an admission skipped for tokens): its demand is then more than it scheduled.
    budget_cut: bool,
    /// At least the longest need of every sequence held: the budget's guaranteed blocks as
    /// last checked, raised by each `add` to its request's need (`u32::MAX` until first
    /// checked). A guarantee at or above it covers every sequence; only a lower one makes the
    /// next step look at them.
    guaranteed_seen: u32,
}

impl std::fmt::Debug for Batcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher")
            .field("cfg", &self.cfg)
            .field("waiting", &(self.waiting[0].len() + self.waiting[1].len()))
            .field("running", &self.running.len())
            .field("swapped", &self.swapped.len())
            .field("stats", &self.stats)
            .finish()
    }
}

enum Reserve {
    Ok,
    /// Not enough blocks (pool or quota); nothing was taken.
    NoBlocks,
}

impl BatcherConfig {
    /// Checks what [`Batcher::new`] refuses but the engine id (which `new` checks against its
    /// pool): an engine validates its configuration with this before it registers for an id.
    ///
    /// # Errors
    /// [`SchedError::InvalidConfig`] naming the first field out of range.
    pub fn check(&self) -> Result<(), SchedError> {
        let cfg = self;
        if cfg.block_size == 0 {
            return Err(SchedError::InvalidConfig("block_size must be at least 1"));
        }
        if cfg.max_running == 0 || cfg.max_batched_tokens == 0 || cfg.max_prefill_chunk == 0 {
            return Err(SchedError::InvalidConfig(
                "max_running, max_batched_tokens and max_prefill_chunk must be at least 1",
            ));
        }
        if cfg.max_blocks_per_seq == 0 {
            return Err(SchedError::InvalidConfig(
                "max_blocks_per_seq must be at least 1",
            ));
        }
        // A batch counts its tokens in `i32` (`query_start_loc`, `logits_indices`, as the
        // kernels read them): a larger step would wrap them.
        if cfg.max_batched_tokens > i32::MAX as u32 {
            return Err(SchedError::InvalidConfig(
                "max_batched_tokens must be at most i32::MAX",
            ));
        }
        // No host swap space holds more slots (`SwapSpace`, the raw backend's, the pinned one
        // refuse them), and every slot is listed here, 4 bytes each: `u32::MAX` was 16 GiB.
        if cfg.swap_blocks > crate::ids::MAX_BLOCKS {
            return Err(SchedError::InvalidConfig(
                "swap_blocks must be at most MAX_BLOCKS",
            ));
        }
        Ok(())
    }
}

impl Batcher {
    /// A batcher for `cfg.engine`, drawing blocks from `pool`.
    ///
    /// # Errors
    /// As [`BatcherConfig::check`], and [`SchedError::InvalidConfig`] for an engine id the pool
    /// does not serve.
    pub fn new(cfg: BatcherConfig, pool: Arc<BlockPool>) -> Result<Self, SchedError> {
        cfg.check()?;
        if cfg.engine.0 >= pool.max_engines() {
            return Err(SchedError::InvalidConfig(
                "engine id is not served by the pool",
            ));
        }
        Ok(Self {
            cfg,
            pool,
            budget: None,
            prefix: None,
            seqs: Vec::new(),
            free_slots: Vec::new(),
            index: HashMap::new(),
            waiting: [VecDeque::new(), VecDeque::new()],
            running: Vec::new(),
            running_unsorted: false,
            swapped: VecDeque::new(),
            host_free: (0..cfg.swap_blocks).rev().collect(),
            host_released: Vec::new(),
            swap_out_pending: Vec::new(),
            shed_held: 0,
            pages_on_hand: None,
            pending_aborts: Vec::new(),
            shed_request: 0,
            batch: Batch::default(),
            scheduled: Vec::new(),
            uncommitted: false,
            scratch: Vec::new(),
            row_width: 0,
            row_owner: Vec::new(),
            arrivals: 0,
            stats: BatcherStats::default(),
            active_reported: false,
            budget_cut: false,
            guaranteed_seen: u32::MAX,
        })
    }

    /// Reports to the attached budget whether the engine has work, if that changed since the
    /// last report (the batcher otherwise reports it at the end of each schedule and commit).
    /// Call after queueing requests on an idle engine, so that a budget recomputation before
    /// the next schedule already gives it a share.
    pub fn sync_activity(&mut self) {
        if let Some(b) = &self.budget {
            let active = self.has_work();
            if active != self.active_reported {
                b.set_active(active);
                self.active_reported = active;
            }
        }
    }

    /// Draw also against `budget` (token budget per step and block quota).
    pub fn attach_budget(&mut self, budget: Box<dyn EngineBudget>) {
        self.budget = Some(budget);
    }

    /// The configuration.
    pub fn config(&self) -> &BatcherConfig {
        &self.cfg
    }

    /// Counters.
    pub fn stats(&self) -> BatcherStats {
        self.stats
    }

    /// Waiting sequences (both classes).
    pub fn num_waiting(&self) -> usize {
        self.waiting[0].len() + self.waiting[1].len()
    }

    /// Running sequences.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Swapped-out sequences.
    pub fn num_swapped(&self) -> usize {
        self.swapped.len()
    }

    /// Whether any sequence is waiting, running or swapped.
    pub fn has_work(&self) -> bool {
        !self.index.is_empty()
    }

    /// The phase of a sequence.
    pub fn phase(&self, id: SeqId) -> Option<SeqPhase> {
        self.index
            .get(&id)
            .and_then(|&s| self.seqs[s].as_ref())
            .map(|s| s.phase)
    }

    /// Blocks held by a sequence's table.
    pub fn blocks_of(&self, id: SeqId) -> Option<u32> {
        self.index
            .get(&id)
            .and_then(|&s| self.seqs[s].as_ref())
            .map(|s| s.table.len())
    }

    /// The most blocks a sequence may need here: its table's capacity, the whole pool, the
    /// blocks the attached budget guarantees the engine, or the blocks whose tokens a batch's
    /// `i32` positions and context lengths can count, whichever is least.
    fn block_limit(&self) -> u64 {
        let guaranteed = self
            .budget
            .as_ref()
            .and_then(|b| b.guaranteed_blocks())
            .unwrap_or(u32::MAX);
        let positions = i32::MAX as u32 / self.cfg.block_size;
        u64::from(
            self.cfg
                .max_blocks_per_seq
                .min(self.pool.total())
                .min(guaranteed)
                .min(positions),
        )
    }

    /// Blocks a sequence holds at its longest (prompt and every output token but the last).
    fn blocks_needed(&self, s: &Sequence) -> u64 {
        (s.prompt_len as u64 + u64::from(s.stop.max_new_tokens))
            .saturating_sub(1)
            .div_ceil(u64::from(self.cfg.block_size))
    }

    /// Ends, at this step's start, every sequence whose longest need the budget's guaranteed
    /// blocks no longer cover (the guarantee dropped below `guaranteed_seen`: an engine
    /// registered, weights changed), with [`FinishReason::TooLong`]: left to run, it could be
    /// preempted for as long as other engines keep their shares busy. Costs one budget read
    /// unless the guarantee dropped.
    fn end_unguaranteed(&mut self) {
        let Some(g) = self.budget.as_ref().and_then(|b| b.guaranteed_blocks()) else {
            return;
        };
        let seen = std::mem::replace(&mut self.guaranteed_seen, g);
        if g >= seen {
            return;
        }
        for slot in 0..self.seqs.len() {
            let Some(s) = self.seqs[slot].as_ref() else {
                continue;
            };
            let id = s.id;
            if self.blocks_needed(s) > u64::from(g)
                && !self.pending_aborts.iter().any(|&(p, _)| p == id)
            {
                self.pending_aborts.push((id, FinishReason::TooLong));
            }
        }
    }

    /// Queues a request. Refused at once if it is malformed or could never fit: longer than a
    /// sequence's table, the pool, or the blocks the attached budget guarantees the engine
    /// ([`EngineBudget::guaranteed_blocks`]; what it could borrow beyond them is not counted,
    /// since it is taken back whenever the lenders have work), or than the whole pages below
    /// 2^31 tokens that a batch's `i32` positions count.
    pub fn add(&mut self, req: SeqRequest) -> Result<(), SchedError> {
        self.add_salted(req, 0)
    }

    /// [`add`](Self::add) with a prefix-cache salt: the request shares cached blocks only with
    /// requests of the same salt (e.g. one per tenant). Without a prefix cache the salt is
    /// ignored.
    pub fn add_salted(&mut self, req: SeqRequest, salt: u64) -> Result<(), SchedError> {
        let id = req.id;
        if req.prompt.is_empty() {
            return Err(SchedError::InvalidRequest {
                id,
                reason: "empty prompt",
            });
        }
        if req.stop.max_new_tokens == 0 {
            return Err(SchedError::InvalidRequest {
                id,
                reason: "max_new_tokens must be at least 1",
            });
        }
        if self.id_taken(id) {
            return Err(SchedError::DuplicateId(id));
        }
        let blocks = req
            .max_cached_tokens()
            .div_ceil(u64::from(self.cfg.block_size));
        let limit = self.block_limit();
        if blocks > limit {
            return Err(SchedError::TooLong { id, blocks, limit });
        }
        // The table is sized for the longest the request can grow (`max_blocks_per_seq` bounds
        // it, but allocating that, 8 bytes a block, for every request made a generous limit
        // cost gigabytes each): at most the pool's total, so the table accepts it. The
        // guarantee read here may be above the one the next step reads (it can drop in
        // between): that step must then look again.
        let table = BlockTable::new(Arc::clone(&self.pool), self.cfg.engine, blocks as u32)?;
        self.guaranteed_seen = self.guaranteed_seen.max(blocks as u32);
        let seq = Sequence {
            id,
            priority: req.priority,
            stop: req.stop,
            prompt_len: req.prompt.len(),
            tokens: req.prompt,
            computed: 0,
            table,
            phase: SeqPhase::Waiting,
            swapped_from: SeqPhase::Prefilling,
            arrival: self.arrivals,
            host_blocks: Vec::new(),
            preemptions: 0,
            may_share: false,
            row_blocks: 0,
            drafts: Vec::new(),
            salt,
            hashed: 0,
            parent: None,
        };
        self.arrivals += 1;
        let slot = self.store(seq);
        self.index.insert(id, slot);
        self.waiting[req.priority.index()].push_back(slot);
        Ok(())
    }

    /// Aborts a sequence. Takes effect at the start of the next step (the batch in flight may
    /// still use its blocks); its result then comes out of
    /// [`schedule_into`](Self::schedule_into)'s `finished` list.
    pub fn abort(&mut self, id: SeqId) -> Result<(), SchedError> {
        self.finish_with(id, FinishReason::Aborted)
    }

    /// Ends a sequence for a reason of the caller's (e.g. [`FinishReason::Caller`] when its
    /// detokenizer found a stop string), taking effect like [`abort`](Self::abort). The first
    /// request for a sequence wins; later ones are ignored.
    pub fn finish_with(&mut self, id: SeqId, reason: FinishReason) -> Result<(), SchedError> {
        if !self.index.contains_key(&id) {
            return Err(SchedError::UnknownSeq(id));
        }
        if !self.pending_aborts.iter().any(|&(p, _)| p == id) {
            self.pending_aborts.push((id, reason));
        }
        Ok(())
    }

    /// Proposes draft tokens (speculative decoding) for a decoding sequence's next step: the
    /// step's row then carries its last token followed by the drafts, asks for logits at every
    /// one of them ([`Batch::drafts`]), and the commit accepts the longest prefix of drafts that
    /// the sampled tokens confirm, plus one sampled token (the correction or the bonus). The KV
    /// written for rejected drafts is rolled back: the sequence's computed length stops after
    /// the accepted ones and pages left empty are freed.
    ///
    /// Replaces earlier proposals of the same step. Dropped if the step's token budget (or
    /// `max_prefill_chunk`, which bounds a row) cannot take them all, or the pages they need
    /// are short (the row is then a plain decode: no sequence is preempted for drafts).
    /// Refused: an unknown or non-decoding sequence, more drafts than the tokens it may still
    /// generate minus one, or a sequence with a row in the scheduled batch not yet committed
    /// (that row's drafts are the ones its commit verifies; propose the next step's after the
    /// commit).
    pub fn propose(&mut self, id: SeqId, drafts: &[u32]) -> Result<(), SchedError> {
        let &slot = self.index.get(&id).ok_or(SchedError::UnknownSeq(id))?;
        let s = self.seq(slot);
        if s.phase != SeqPhase::Decoding {
            return Err(SchedError::InvalidRequest {
                id,
                reason: "only a decoding sequence takes draft tokens",
            });
        }
        self.refuse_uncommitted_row(id, slot)?;
        let left = (s.stop.max_new_tokens as usize).saturating_sub(s.generated());
        if drafts.len() >= left.max(1) {
            return Err(SchedError::InvalidRequest {
                id,
                reason: "more draft tokens than the sequence may still generate minus one",
            });
        }
        let s = self.seq_mut(slot);
        s.drafts.clear();
        s.drafts.extend_from_slice(drafts);
        Ok(())
    }

    /// Forks a running (decoding) sequence into a new one with id `child`, sharing every block
    /// of its computed tokens (parallel sampling). The first write into a shared partial block
    /// copies it first. Refused while the parent's row of a scheduled batch waits for its
    /// commit (fork after the commit: the child then starts from the committed state).
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<(), SchedError> {
        if self.id_taken(child) {
            return Err(SchedError::DuplicateId(child));
        }
        let &slot = self
            .index
            .get(&parent)
            .ok_or(SchedError::UnknownSeq(parent))?;
        let Some(p) = self.seqs[slot].as_ref() else {
            return Err(SchedError::UnknownSeq(parent));
        };
        if p.phase != SeqPhase::Decoding {
            return Err(SchedError::InvalidRequest {
                id: parent,
                reason: "only a decoding sequence can be forked",
            });
        }
        self.refuse_uncommitted_row(parent, slot)?;
        if self.running.len() >= self.cfg.max_running as usize {
            return Err(SchedError::InvalidRequest {
                id: parent,
                reason: "max_running sequences already run",
            });
        }
        let seq = Sequence {
            id: child,
            priority: p.priority,
            stop: p.stop.clone(),
            tokens: p.tokens.clone(),
            prompt_len: p.prompt_len,
            computed: p.computed,
            table: {
                // Only the blocks of its computed tokens: one reserved past them (by a batch
                // discarded before it ran) stays the parent's alone, or both would write their
                // next token into it unseen (the copy-on-write check looks at the block of the
                // next write only when that write lands inside it, not at its start).
                let mut t = p.table.fork()?;
                t.truncate(self.blocks_for(p.computed) as u32);
                t
            },
            phase: p.phase,
            swapped_from: SeqPhase::Prefilling,
            arrival: self.arrivals,
            host_blocks: Vec::new(),
            preemptions: 0,
            may_share: true,
            row_blocks: 0,
            drafts: Vec::new(),
            salt: p.salt,
            hashed: p.hashed,
            parent: p.parent,
        };
        self.seq_mut(slot).may_share = true;
        self.arrivals += 1;
        let child_slot = self.store(seq);
        self.index.insert(child, child_slot);
        self.push_running(child_slot);
        Ok(())
    }

    /// The order of `running` and `swapped`: latency-critical first, then oldest first.
    pub(super) fn order_key(&self, slot: usize) -> (Priority, u64) {
        let s = self.seq(slot);
        (s.priority, s.arrival)
    }

    /// Appends to `running`, noting when that breaks its order.
    fn push_running(&mut self, slot: usize) {
        self.insert_running(self.running.len(), slot);
    }

    /// Inserts into `running` at `at`, noting when that breaks its order.
    fn insert_running(&mut self, at: usize, slot: usize) {
        let key = self.order_key(slot);
        if let Some(&before) = at.checked_sub(1).and_then(|k| self.running.get(k)) {
            self.running_unsorted |= key < self.order_key(before);
        }
        if let Some(&after) = self.running.get(at) {
            self.running_unsorted |= self.order_key(after) < key;
        }
        self.running.insert(at, slot);
    }

    /// Refuses a change (`propose`, `fork`) to a sequence whose row in the scheduled batch
    /// waits for its commit: that row's drafts and reserved blocks are what the commit uses.
    fn refuse_uncommitted_row(&self, id: SeqId, slot: usize) -> Result<(), SchedError> {
        if self
            .scheduled
            .iter()
            .any(|&(row_slot, ..)| row_slot == slot)
        {
            return Err(SchedError::InvalidRequest {
                id,
                reason: "its row in the scheduled batch is not committed yet",
            });
        }
        Ok(())
    }

    /// Whether `id` names a sequence, or one whose abort is still pending (its result not yet
    /// reported: a new sequence of that id would be taken for it).
    fn id_taken(&self, id: SeqId) -> bool {
        self.index.contains_key(&id) || self.pending_aborts.iter().any(|&(p, _)| p == id)
    }

    /// Stores a new sequence in a free slot (reused first, so storage stays bounded by the
    /// sequences alive at once) and returns it.
    fn store(&mut self, seq: Sequence) -> usize {
        match self.free_slots.pop() {
            Some(s) => {
                self.seqs[s] = Some(seq);
                s
            }
            None => {
                self.seqs.push(Some(seq));
                self.seqs.len() - 1
            }
        }
    }

    /// Schedules the next step and returns its batch. Aborted sequences' results go to
    /// `finished`. The step's tokens go, in this order, to the running latency-critical rows,
    /// the running throughput decode rows (a token each), the latency-critical admissions'
    /// first chunks, then the running throughput rows' drafts and prefill chunks (shorter,
    /// or none this step, where the admissions took their tokens), and
    /// last to throughput admissions; in a step without a latency-critical admission the
    /// running throughput rows take theirs in arrival order. The steps are listed on
    /// [`Batcher`].
    ///
    /// A batch not committed when this is called again (its execution failed, say, and the
    /// caller aborted the sequence at fault) is discarded safely first: its rows are scheduled
    /// again (a computed length moves only at a commit), and every sequence whose KV it was to
    /// swap out, swap in or copy a block into is preempted by recompute, since what of that
    /// ran is unknown. [`is_pending`](Self::is_pending) says whether one is uncommitted.
    pub fn schedule_into(&mut self, finished: &mut Vec<FinishedSeq>) -> &Batch {
        let discarded = self.discard_uncommitted();
        self.batch.clear();
        self.scheduled.clear();
        // Host slots freed by last step's swap-ins are safe to reuse now, and so are the pages
        // its swap-outs read (if no commit released them).
        self.host_free.append(&mut self.host_released);
        let released = self.release_swapped_pages();
        // The pages a discarded batch held (its swap-outs', those of the sequences it
        // recomputes) are given back here, after the caller read what to shed (an engine's
        // reclaim order counts them as held): they count toward the shed, as the ends below do.
        self.shed_request = self
            .shed_request
            .saturating_sub(discarded.saturating_add(released));
        self.end_unguaranteed();
        self.apply_aborts(finished);
        let mut preempted = self.apply_shed();
        // What the shed swapped out is given back, not reusable this step (the list was empty
        // before it: released above).
        self.shed_held = self.swap_out_pending.len();

        let external = self.budget.as_ref().map_or(u32::MAX, |b| b.token_budget());
        self.budget_cut = false;
        let mut budget = self.cfg.max_batched_tokens.min(external) as usize;

        // 1. Running sequences, most urgent and oldest first. Admissions, swap-ins and forks
        // append; when one of them broke the order, the sort puts it back (removals keep it).
        if std::mem::take(&mut self.running_unsorted) {
            let mut running = std::mem::take(&mut self.running);
            running.sort_unstable_by_key(|&s| self.order_key(s));
            self.running = running;
        }
        let mut i = 0;
        // A shortened prefill chunk for `running[i]`'s retry (see the `NoBlocks` arm), and
        // whether any chunk was shortened this step.
        let mut shortened = None;
        let mut shortened_any = false;
        let mut arrivals_done = false;
        // The tokens the throughput decode rows not yet scheduled are owed, in a step that
        // admitted latency-critical work before the throughput prefill chunks: a chunk takes
        // only what exceeds them (`budget >= owed` throughout).
        let mut owed = 0;
        let mut owing = false;
        loop {
            // Between the running latency-critical sequences and the running throughput ones:
            // the latency-critical class's swapped and waiting sequences, which may preempt
            // the throughput sequences (none in the batch yet) for their pages.
            if !arrivals_done
                && self
                    .running
                    .get(i)
                    .is_none_or(|&s| self.seq(s).priority != Priority::LatencyCritical)
            {
                arrivals_done = true;
                let pressed = preempted || shortened_any;
                let (made_room, lc_owed) =
                    self.admit_latency_critical(&mut i, &mut budget, pressed);
                preempted |= made_room;
                owed = lc_owed;
                owing = lc_owed > 0;
            }
            let Some(&slot) = self.running.get(i) else {
                break;
            };
            // A decoder's row takes its token, owed (`budget >= owed`), and its drafts only
            // from what no decoder is owed; a prefill chunk what the decoders after it are not
            // owed, maybe nothing (it then has no row this step, as when the budget ran out).
            let row_owed = if owing { self.decode_need(slot) } else { 0 };
            let n = match shortened.take() {
                Some(m) => m,
                None => {
                    let m = self.tokens_wanted(slot, budget.saturating_sub(owed) + row_owed);
                    self.note_budget_cut(slot, m);
                    m
                }
            };
            if n == 0 {
                i += 1;
                continue;
            }
            match self.reserve(slot, n) {
                Reserve::Ok => {
                    self.emit(slot, n);
                    budget -= n;
                    owed = owed.saturating_sub(row_owed);
                    i += 1;
                }
                Reserve::NoBlocks if !self.seq(slot).drafts.is_empty() => {
                    // Drafts are optional: short of pages for them, the row is a plain decode
                    // (retried without them), never a preemption of this or another sequence
                    // for speculative tokens. `reserve` took nothing; the row is still owed its
                    // token.
                    self.seq_mut(slot).drafts.clear();
                }
                Reserve::NoBlocks => {
                    // Victim: lowest priority, latest arrival, among those not yet scheduled
                    // (this one included).
                    let victim_pos = (i..self.running.len())
                        .max_by_key(|&k| {
                            let s = self.seq(self.running[k]);
                            (s.priority, s.arrival)
                        })
                        .unwrap_or(i);
                    // A prefill chunk short of pages runs shorter before it costs a sequence of
                    // its own class a preemption (that sequence's whole context recomputed or
                    // swapped, or this one's own progress): `shorter_chunk` until one fits,
                    // preempting only when no shorter chunk needs fewer pages. A
                    // latency-critical chunk still preempts throughput work for its full size.
                    let victim_class = self.seq(self.running[victim_pos]).priority;
                    if victim_class == self.seq(slot).priority {
                        let m = self.shorter_chunk(slot, n);
                        if m > 0 {
                            shortened = Some(m);
                            shortened_any = true;
                            continue;
                        }
                    }
                    preempted = true;
                    // In swap mode, a victim whose swap-out would not give up the pages this
                    // row still lacks (the prefix cache keeps its completed ones this step) is
                    // recomputed where that gives up more: otherwise the next victims are
                    // swapped out too, each for its partial last page. A sequence preempted
                    // for its own row needs no room: it keeps the preemption mode.
                    let victim = self.running[victim_pos];
                    let may_swap = victim == slot || {
                        let need = self.pages_to_reserve(slot, n).0 as u64;
                        let have = u64::from(self.pages_on_hand.unwrap_or(0));
                        let mut host_left = self.host_free.len();
                        self.victim_mode(victim, need.saturating_sub(have), &mut host_left)
                            .1
                    };
                    self.running.remove(victim_pos);
                    if owing {
                        owed = owed.saturating_sub(self.decode_need(victim));
                    }
                    self.preempt_as(victim, may_swap);
                    // If the victim was this sequence, `i` now names the next one; otherwise
                    // retry this one with the freed blocks.
                }
            }
        }

        // A step that preempted, or shortened a running chunk for want of pages, brings nothing
        // back and admits nothing: what they took would be the pages the running sequences
        // lack (the next step would preempt or shorten again: thrash).
        let pressed = preempted || shortened_any;

        // 2. Once no latency-critical request waits (it would be denied the pages they take:
        // a swapped throughput sequence never takes the pages of a latency-critical
        // admission), swapped sequences come back while they fit (`swapped` is in priority
        // order, then arrival);
        // 3. then waiting throughput requests, FCFS, if no swapped sequence is left to come
        // back before them.
        if self.waiting[Priority::LatencyCritical.index()].is_empty() {
            let mut end = self.running.len();
            self.swap_in_fitting(pressed, &mut end);
            let class = Priority::Throughput;
            while let Some(&slot) = self.waiting[class.index()].front() {
                if pressed
                    || !self.swapped.is_empty()
                    || self.running.len() >= self.cfg.max_running as usize
                {
                    break;
                }
                if budget == 0 {
                    self.budget_cut = true;
                    break;
                }
                let hit = self.attach_cached_prefix(slot);
                let n = self.tokens_wanted(slot, budget);
                self.note_budget_cut(slot, n);
                if n == 0 || matches!(self.reserve(slot, n), Reserve::NoBlocks) {
                    // It stays waiting, and a waiting sequence holds no pages.
                    self.detach_cached_prefix(slot);
                    break;
                }
                self.admit(slot, hit, n);
                self.push_running(slot);
                budget -= n;
            }
        }

        self.write_block_tables();
        self.uncommitted = !self.batch.is_empty();
        self.stats.steps += 1;
        self.stats.tokens_scheduled += self.batch.num_tokens() as u64;
        if let Some(b) = &self.budget {
            // The step's demand: what it scheduled, unless the token budget left work out;
            // then more, as much as its own limit allows.
            let tokens = self.batch.num_tokens() as u32;
            let demand = if self.budget_cut {
                tokens.max(self.cfg.max_batched_tokens)
            } else {
                tokens
            };
            b.record_step(tokens, demand);
            let active = self.has_work();
            if active != self.active_reported {
                b.set_active(active);
                self.active_reported = active;
            }
        }
        &self.batch
    }

    /// At the class boundary of step 1 (`running[*at..]` are throughput sequences, none in the
    /// batch yet): brings swapped latency-critical sequences back (oldest first), then, if none
    /// is left swapped, admits waiting latency-critical requests (FCFS) within what of the
    /// step's `budget` the throughput decode rows leave (one token each): the throughput
    /// prefill chunks and draft tokens give way, running shorter or not at all this step;
    /// nothing in a step short of pages (`pressed`). One short of pages or of a running slot
    /// (`max_running` sequences run) preempts running throughput sequences of this
    /// engine, latest arrival first, when that brings it in at once
    /// ([`make_room_for_latency_critical`](Self::make_room_for_latency_critical)): the latest
    /// for the slot (its row's tokens then go to the admission), more only while the pages
    /// they give up fall short; nothing otherwise: it waits. A latency-critical sequence is
    /// never preempted for another. Every sequence brought in is put at `*at`, which moves past
    /// it (a swapped-in one gets its row next step, as in step 2). Returns whether it
    /// preempted, and the tokens of `budget` the throughput decode rows are owed: what their
    /// prefill chunks must leave them (0 where nothing was admitted: the step's tokens then
    /// go to the throughput rows in order, as without latency-critical work).
    fn admit_latency_critical(
        &mut self,
        at: &mut usize,
        budget: &mut usize,
        pressed: bool,
    ) -> (bool, usize) {
        if pressed {
            return (false, 0);
        }
        let class = Priority::LatencyCritical;
        let mut preempted = false;
        while let Some(&slot) = self.swapped.front() {
            if self.seq(slot).priority != class {
                break;
            }
            let full = self.running.len() >= self.cfg.max_running as usize;
            if full && self.latest_throughput(*at).is_none() {
                break;
            }
            if self.swap_in(slot) {
                if full {
                    // Its pages are taken; a throughput sequence gives up its slot.
                    preempted |= self.make_room_for_latency_critical(0, true, *at);
                }
            } else {
                let need = self.seq(slot).host_blocks.len();
                let made = self.make_room_for_latency_critical(need, full, *at);
                preempted |= made;
                if !made || !self.swap_in(slot) {
                    break;
                }
            }
            self.swapped.pop_front();
            self.insert_running(*at, slot);
            *at += 1;
        }
        if self
            .swapped
            .front()
            .is_some_and(|&s| self.seq(s).priority == class)
        {
            return (preempted, 0);
        }
        let mut admitted = false;
        while let Some(&slot) = self.waiting[class.index()].front() {
            // The step's tokens go to the running throughput decoders first (their rows come
            // later, their pages do not): an admission takes what they leave, so a throughput
            // decoder is never skipped for an admission's prefill chunk, but the one preempted
            // for the slot. Throughput prefill chunks come after the admission: a long prompt
            // in chunks would otherwise hold the budget, and time to first token, for as many
            // steps as it has chunks.
            let full = self.running.len() >= self.cfg.max_running as usize;
            let slot_victim = full.then(|| self.latest_throughput(*at));
            if slot_victim == Some(None) {
                break;
            }
            let owed = self.owed_to_decoders(*at, slot_victim.flatten());
            let left = budget.saturating_sub(owed);
            if left == 0 {
                self.budget_cut = true;
                break;
            }
            let hit = self.attach_cached_prefix(slot);
            let n = self.tokens_wanted(slot, left);
            self.note_budget_cut(slot, n);
            let mut fits = n > 0 && matches!(self.reserve(slot, n), Reserve::Ok);
            if fits && full {
                // Its pages are taken; a throughput sequence gives up its slot.
                preempted |= self.make_room_for_latency_critical(0, true, *at);
            } else if !fits && n > 0 {
                let need = self.pages_to_reserve(slot, n).0;
                if self.make_room_for_latency_critical(need, full, *at) {
                    preempted = true;
                    fits = matches!(self.reserve(slot, n), Reserve::Ok);
                }
            }
            if !fits {
                // It stays waiting, and a waiting sequence holds no pages.
                self.detach_cached_prefix(slot);
                break;
            }
            self.admit(slot, hit, n);
            self.insert_running(*at, slot);
            *at += 1;
            *budget -= n;
            admitted = true;
        }
        // Preemptions for pages may have taken decoders since their tokens were counted.
        let owed = if admitted {
            self.owed_to_decoders(*at, None)
        } else {
            0
        };
        (preempted, owed)
    }

    /// The running throughput sequence of latest arrival among `running[from..]`, if any.
    fn latest_throughput(&self, from: usize) -> Option<usize> {
        self.running[from.min(self.running.len())..]
            .iter()
            .copied()
            .filter(|&s| self.seq(s).priority == Priority::Throughput)
            .max_by_key(|&s| self.seq(s).arrival)
    }

    /// The tokens the decode rows of `running[from..]` (throughput sequences, none in the
    /// batch yet) are owed: one each; `except` (a sequence about to be preempted) none.
    /// Latency-critical admissions come after them, before the prefill chunks and the draft
    /// tokens.
    fn owed_to_decoders(&self, from: usize, except: Option<usize>) -> usize {
        self.running[from..]
            .iter()
            .filter(|&&s| Some(s) != except)
            .map(|&s| self.decode_need(s))
            .sum()
    }

    /// Notes a cut by the token budget when `n`, what `slot` got, is less than it wants with
    /// no budget (its chunk limit and drafts as they are).
    fn note_budget_cut(&mut self, slot: usize, n: usize) {
        if n < self.tokens_wanted(slot, usize::MAX) {
            self.budget_cut = true;
        }
    }

    /// The tokens a decoding sequence's row is owed: its one token, not its drafts (they are
    /// optional: a proposer drafting at every step would otherwise hold a latency-critical
    /// admission back for as long as the decoders run); 0 for a prefilling one.
    fn decode_need(&self, slot: usize) -> usize {
        if self.seq(slot).phase == SeqPhase::Decoding {
            self.tokens_wanted(slot, 1)
        } else {
            0
        }
    }

    /// Moves the waiting sequence at the front of its class, its first chunk of `n` tokens
    /// reserved, to prefilling and emits its row; the caller lists it as running.
    fn admit(&mut self, slot: usize, hit: usize, n: usize) {
        self.count_prefix(slot, hit);
        let class = self.seq(slot).priority.index();
        self.waiting[class].pop_front();
        self.seq_mut(slot).phase = SeqPhase::Prefilling;
        self.emit(slot, n);
    }

    /// Swaps sequences back in, oldest first, while they fit (pages and `max_running`); none
    /// in a step short of pages (`pressed`: it preempted or shortened a chunk). Each is listed
    /// as running at `*at`, which moves past it. (Step 2: the latency-critical ones came back
    /// at the class boundary, where they may preempt throughput work.)
    fn swap_in_fitting(&mut self, pressed: bool, at: &mut usize) {
        while let Some(&slot) = self.swapped.front() {
            if pressed || self.running.len() >= self.cfg.max_running as usize {
                break;
            }
            if !self.swap_in(slot) {
                break;
            }
            self.swapped.pop_front();
            self.insert_running(*at, slot);
            *at += 1;
        }
    }

    /// Asks the batcher to give back `blocks` blocks at the start of its next step by
    /// preempting running sequences (lowest priority, latest arrival first). Requests add up.
    /// Pages that the sequences ended at that step's start (aborts, caller finishes, requests
    /// grown too long for the engine's share) give back count toward it, and so do the pages
    /// an uncommitted batch held that its discard at that step's start gives back (the pages
    /// its swap-outs read, those of the sequences it recomputes).
    pub fn request_shed(&mut self, blocks: u32) {
        self.shed_request = self.shed_request.saturating_add(blocks);
    }

    /// The lowest priority among running sequences, and the blocks their tables hold;
    /// `None` when nothing runs. A page two of them share (a fork) or the prefix cache also
    /// holds is counted per table: an upper bound on what preempting them all frees, kept so
    /// (O(running sequences) per step) rather than walking every page's count.
    pub fn preemptible_load(&self) -> Option<(Priority, u32)> {
        let lowest = self.running.iter().map(|&s| self.seq(s).priority).max()?;
        let blocks = self
            .running
            .iter()
            .map(|&s| self.seq(s))
            .filter(|s| s.priority == lowest)
            .map(|s| s.table.len())
            .sum();
        Some((lowest, blocks))
    }

    /// The pages that preempting every running throughput sequence would give this engine
    /// at once: those that leave its budget (freed, or left to the prefix cache alone and so
    /// evictable; not one a fork or another holder of a cached prefix keeps), which is what a
    /// step preempts them for when latency-critical work (a waiting request, or a swapped-out
    /// sequence coming back) is short of pages, recomputing a victim where a swap-out would
    /// keep its cached pages. An engine asks other engines to donate pages only for what these
    /// (and the free pages) do not cover. O(the running sequences' pages).
    pub fn throughput_room(&self) -> u32 {
        self.running
            .iter()
            .filter(|&&s| self.seq(s).priority == Priority::Throughput)
            .map(|&s| self.pages_leaving(s, 0))
            .fold(0u32, u32::saturating_add)
    }

    /// Waiting sequences of a class.
    pub fn num_waiting_in(&self, class: Priority) -> usize {
        self.waiting[class.index()].len()
    }

    /// The pages the sequence a step admits next needs, with its class; `None` when nothing
    /// waits or is swapped out. That sequence is, as [`schedule_into`](Self::schedule_into)
    /// orders them, the first swapped-out one (all its pages) unless a waiting one of a more
    /// urgent class comes first, else the first waiting one of the most urgent non-empty class
    /// (the pages its first chunk takes: with a prefix cache attached, those past the cached
    /// prefix it would attach, and the attached pages only the cache holds; not those another
    /// sequence holds, which cost nothing). Reads the cache without changing it.
    pub fn next_admission_need(&self) -> Option<(Priority, u32)> {
        let waiting = Priority::ALL.into_iter().find_map(|class| {
            let &slot = self.waiting[class.index()].front()?;
            Some((class, self.admission_pages(slot)))
        });
        let swapped = self.swapped.front().map(|&slot| {
            let s = self.seq(slot);
            (s.priority, s.host_blocks.len() as u32)
        });
        match (swapped, waiting) {
            (Some((sc, _)), Some((wc, need))) if wc < sc => Some((wc, need)),
            (Some(s), _) => Some(s),
            (None, w) => w,
        }
    }

    /// The last scheduled batch.
    pub fn batch(&self) -> &Batch {
        &self.batch
    }

    /// Whether a scheduled batch with work in it waits for its [`commit`](Self::commit) (the
    /// next [`schedule_into`](Self::schedule_into) discards it otherwise).
    pub fn is_pending(&self) -> bool {
        self.uncommitted
    }

    /// Applies the results of the last batch: `sampled` holds, in row order, one token per
    /// sampling row, or `d + 1` for a row with `d` drafts (its `logits_indices` entries).
    /// Finished sequences are appended to `finished` and their blocks freed.
    ///
    /// On a count mismatch nothing is applied.
    pub fn commit(
        &mut self,
        sampled: &[u32],
        finished: &mut Vec<FinishedSeq>,
    ) -> Result<(), SchedError> {
        self.commit_inner(sampled, finished, None)
    }

    /// [`commit`](Self::commit), also appending to `results` one [`SeqUpdate`] per sampling
    /// row (its tokens: one, or a row with drafts its accepted drafts and one more; and its
    /// finish reason if it ended), in row order: what a server streams. Sequences ended by
    /// aborts are not listed here ([`schedule_into`](Self::schedule_into) reports them in
    /// `finished`); [`Engine`](crate::engine::Engine) lists them first in its results.
    pub fn commit_with_updates(
        &mut self,
        sampled: &[u32],
        finished: &mut Vec<FinishedSeq>,
        results: &mut StepResults,
    ) -> Result<(), SchedError> {
        self.commit_inner(sampled, finished, Some(results))
    }

    fn commit_inner(
        &mut self,
        sampled: &[u32],
        finished: &mut Vec<FinishedSeq>,
        mut results: Option<&mut StepResults>,
    ) -> Result<(), SchedError> {
        if sampled.len() != self.batch.num_samples() {
            return Err(SchedError::SampleCountMismatch {
                expected: self.batch.num_samples(),
                got: sampled.len(),
            });
        }
        let mut next_sample = 0;
        let mut any_finished = false;
        for row in 0..self.scheduled.len() {
            let (slot, n, drafts) = self.scheduled[row];
            let samples = self.batch.samples[row];
            let caching = self.reuses_prefixes();
            let seq = self.seq_mut(slot);
            if !samples || drafts == 0 {
                // The common rows: a prefill chunk, or one token. Proposals are for one step:
                // any left (not scheduled: the budget could not take them) are dropped.
                seq.computed += n;
                seq.drafts.clear();
                let mut update = None;
                if samples {
                    let token = sampled[next_sample];
                    next_sample += 1;
                    seq.tokens.push(token);
                    seq.phase = SeqPhase::Decoding;
                    update = Some((seq.id, token, seq.stop_reason(token)));
                }
                if caching {
                    self.cache_completed_blocks(slot);
                }
                let Some((id, token, reason)) = update else {
                    continue;
                };
                if let Some(reason) = reason {
                    any_finished = true;
                    self.finish(slot, reason, finished);
                }
                if let Some(r) = results.as_deref_mut() {
                    let at = r.tokens.len();
                    r.tokens.push(token);
                    r.updates.push(SeqUpdate {
                        id,
                        tokens: at..at + 1,
                        finished: reason,
                    });
                }
                continue;
            }
            // A row verifying draft tokens.
            let proposed = std::mem::take(&mut seq.drafts);
            let row_sampled = &sampled[next_sample..next_sample + drafts + 1];
            next_sample += drafts + 1;
            // Accept the drafts the sampled tokens confirm: the token sampled after draft i's
            // predecessor must be draft i. The first mismatch (or the end) gives one more token.
            let accepted = proposed[..drafts]
                .iter()
                .zip(row_sampled)
                .take_while(|(d, t)| d == t)
                .count();
            // The row's KV is in the cache; the part for rejected drafts is rolled back below.
            seq.computed += n;
            let id = seq.id;
            let at = results.as_deref().map_or(0, |r| r.tokens.len());
            let mut reason = None;
            let mut appended = 0;
            for &token in &row_sampled[..=accepted] {
                let seq = self.seq_mut(slot);
                seq.tokens.push(token);
                seq.phase = SeqPhase::Decoding;
                appended += 1;
                if let Some(r) = results.as_deref_mut() {
                    r.tokens.push(token);
                }
                reason = seq.stop_reason(token);
                if reason.is_some() {
                    break;
                }
            }
            {
                let seq = self.seq_mut(slot);
                // The last token is fed next step, so the cache holds the ones before it: this
                // drops the rejected drafts' KV (and, after a stop mid-row, the tokens past it).
                seq.computed = seq.computed.min(seq.tokens.len() - 1);
                seq.drafts = proposed;
                seq.drafts.clear();
            }
            // Before a finish drops the table: a finished sequence's blocks stay cached for
            // the next turn of its conversation.
            self.cache_completed_blocks(slot);
            if let Some(reason) = reason {
                any_finished = true;
                self.finish(slot, reason, finished);
            } else if drafts > accepted {
                self.roll_back_pages(slot);
            }
            if let Some(r) = results.as_deref_mut() {
                r.updates.push(SeqUpdate {
                    id,
                    tokens: at..at + appended,
                    finished: reason,
                });
            }
        }
        if any_finished {
            let seqs = &self.seqs;
            self.running.retain(|&s| seqs[s].is_some());
        }
        // The batch has run: the pages its swap-outs read can go.
        self.release_swapped_pages();
        // Scheduled rows are consumed; a second commit of the same batch is refused.
        self.scheduled.clear();
        self.uncommitted = false;
        self.batch.samples.clear();
        self.batch.logits_indices.clear();
        self.batch.drafts.clear();
        if let Some(b) = &self.budget {
            b.step_ran();
            let active = self.has_work();
            if active != self.active_reported {
                b.set_active(active);
                self.active_reported = active;
            }
        }
        Ok(())
    }

    pub(super) fn seq(&self, slot: usize) -> &Sequence {
        self.seqs[slot]
            .as_ref()
            .unwrap_or_else(|| unreachable!("slot {slot} listed but empty"))
    }

    pub(super) fn seq_mut(&mut self, slot: usize) -> &mut Sequence {
        self.seqs[slot]
            .as_mut()
            .unwrap_or_else(|| unreachable!("slot {slot} listed but empty"))
    }
}

impl Drop for Batcher {
    fn drop(&mut self) {
        // Tables release their blocks to the pool when dropped; give the quota back too.
        self.release_swapped_pages();
        for slot in 0..self.seqs.len() {
            if self.seqs[slot].is_some() {
                self.release_table(slot);
            }
        }
        // This engine's cached pages leave with it: its id may be registered again for
        // another model, whose lookups would otherwise find them (keys hold the engine id).
        if let Some(link) = &self.prefix {
            link.cache.clear_engine(self.cfg.engine);
        }
    }
}
