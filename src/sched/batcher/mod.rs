//! The continuous-batching scheduler of one engine: its configuration, the budget it draws
//! against and its state here; requests in (`requests.rs`), one step's schedule
//! (`schedule.rs`), the commit (`commit.rs`), preemption and shedding (`preempt.rs`), row
//! and page arithmetic (`rows.rs`), the prefix cache's attachment (`prefix_link.rs`).

mod commit;
mod preempt;
mod prefix_link;
mod requests;
mod rows;
mod schedule;
#[cfg(test)]
mod swapped_lc_tests;
#[cfg(test)]
mod tests;

use super::batch::Batch;
use super::sequence::{FinishReason, Priority, SeqId, SeqPhase, Sequence};
use crate::block::{BlockId, BlockPool, EngineId};
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
    /// Reports the pages the engine's work (running, swapped out, and waiting where a running
    /// slot is free) will take over its next steps beyond what it holds now (`u32::MAX`: all
    /// it can get). An engine whose demand is below its quota lets the coordinator lend the
    /// rest until it rises.
    fn record_block_demand(&self, growth: u32) {
        let _ = growth;
    }
    /// Whether `n` more blocks fit this engine's limit but not the device's free blocks: pages
    /// it lent are held by borrowers, whom the coordinator orders to give them back once this
    /// engine's demand is published ([`record_block_demand`](Self::record_block_demand)). A
    /// running sequence short of pages then runs as much of a prefill chunk as the pages on
    /// hand hold, and waits for the rest (up to four steps in a row: a borrower that does not
    /// step cannot hold it up longer) rather than preempt a sequence of its own class (a
    /// latency-critical row still preempts this engine's throughput work at once). `false`
    /// (the default): nothing is lent.
    fn pages_lent_out(&self, n: u32) -> bool {
        let _ = n;
        false
    }
    /// Reports that the step's batch has run (its commit), or ended without a commit (its
    /// execution or sampling failed: [`Batcher::step_failed`]). Tokens held above the engine's
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
    /// Steps in which a running row waited for pages this engine lent out rather than preempt
    /// ([`EngineBudget::pages_lent_out`]).
    pub lent_page_waits: u64,
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
    /// Steps in a row in which a row waited for pages this engine lent (reset by a step
    /// without such a wait): after a few, rows preempt as if nothing were lent.
    lent_waits: u32,
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
            lent_waits: 0,
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

    /// Whether the last [`schedule_into`](Self::schedule_into) left a running row waiting for
    /// pages this engine lent out ([`EngineBudget::pages_lent_out`]): the borrowers give them
    /// back at their next steps.
    pub fn waiting_for_lent_pages(&self) -> bool {
        self.lent_waits > 0
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
            // Those another holder (a router's lookup) holds too: the tables went above.
            link.cache.purge_engine(self.cfg.engine);
        }
    }
}
