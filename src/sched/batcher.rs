//! The continuous-batching scheduler of one engine.
//!
//! Driven by the engine's step loop, single-threaded (`&mut self`): the concurrency lives in the
//! shared [`BlockPool`] and budget it draws from, and in the admission queues that feed it.
//!
//! ```text
//!   add ──► waiting ──► running (prefilling in chunks ──► decoding) ──► finished
//!              ▲   recompute    │  swap                                  ▲
//!              └────────────────┤────► swapped ──► running               │ abort (any time)
//! ```
//!
//! Each [`schedule`](Batcher::schedule) step:
//! 1. running sequences, oldest first: a decoding one gets one token; a prefilling one a chunk of
//!    at most `max_prefill_chunk` tokens; all within the step's token budget (the smaller of
//!    `max_batched_tokens` and the attached budget's). Blocks are taken from the pool so every
//!    sequence's table covers its tokens; when the pool (or the block quota) runs dry, the
//!    running sequence of lowest priority and latest arrival that is not yet in the batch is
//!    preempted, by recompute or by swap. The oldest sequence is never the victim while a
//!    younger one runs, so a workload that fits one sequence at a time always finishes.
//! 2. swapped sequences come back (oldest first) when their blocks fit;
//! 3. waiting sequences are admitted, latency-critical before throughput, first come first
//!    served within a class, unless this step preempted (admitting then would only thrash).
//!
//! The cost of a step is O(scheduled sequences + their new tokens + their blocks), with no
//! allocation in steady state: the [`Batch`] buffers and the scratch vectors are reused.

use super::batch::Batch;
use super::sequence::{FinishReason, FinishedSeq, Priority, SeqId, SeqPhase, SeqRequest, Sequence};
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
    /// Most tokens in one step.
    pub max_batched_tokens: u32,
    /// Most prompt tokens of one sequence in one step (chunked prefill).
    pub max_prefill_chunk: u32,
    /// Most blocks one sequence may hold (its longest context / block size).
    pub max_blocks_per_seq: u32,
    /// Preemption by recompute or swap.
    pub preemption: PreemptionMode,
    /// Host swap slots (blocks) available to this batcher.
    pub swap_blocks: u32,
}

/// The budget a batcher draws against besides its own limits: an engine's share of a global
/// coordinator (see [`crate::budget`]). Every call must be wait-free: it runs inside the step.
pub trait EngineBudget: Send + Sync {
    /// Tokens this engine may schedule this step.
    fn token_budget(&self) -> u32;
    /// Takes `n` blocks against the engine's quota; `false` (and nothing taken) if over.
    fn try_acquire_blocks(&self, n: u32) -> bool;
    /// Gives back `n` blocks taken with `try_acquire_blocks`.
    fn release_blocks(&self, n: u32);
    /// Reports whether the engine has work (idle engines lend their share).
    fn set_active(&self, active: bool);
    /// Reports the tokens scheduled this step.
    fn record_step(&self, tokens: u32) {
        let _ = tokens;
    }
}

/// Counters of a batcher's life.
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
    /// Sequences aborted.
    pub aborted: u64,
}

/// The continuous-batching scheduler of one engine. See the module docs.
pub struct Batcher {
    cfg: BatcherConfig,
    pool: Arc<BlockPool>,
    budget: Option<Box<dyn EngineBudget>>,
    /// Sequence storage; `free_slots` lists the empty entries.
    seqs: Vec<Option<Sequence>>,
    free_slots: Vec<usize>,
    index: HashMap<SeqId, usize>,
    /// Waiting sequences per priority class, FCFS (recompute-preempted ones at the front).
    waiting: [VecDeque<usize>; 2],
    /// Running sequences, oldest admission first.
    running: Vec<usize>,
    /// Swapped-out sequences, oldest first.
    swapped: VecDeque<usize>,
    /// Free host swap slots; `host_released` holds slots freed this step (reusable next step).
    host_free: Vec<u32>,
    host_released: Vec<u32>,
    /// Aborts requested since the last step, applied at the start of the next one (the batch
    /// in flight may still reference their blocks).
    pending_aborts: Vec<SeqId>,
    /// Blocks to give back at the start of the next step, by preempting (a reclaim order of
    /// the budget coordinator, or a donation to a higher-priority engine).
    shed_request: u32,
    batch: Batch,
    /// This step's rows: (slot, new tokens).
    scheduled: Vec<(usize, usize)>,
    scratch: Vec<BlockId>,
    /// Row stride of `batch.block_tables`, kept across steps so that rows stay in place.
    row_width: usize,
    /// The slot whose blocks each row of `batch.block_tables` holds (`usize::MAX`: none).
    row_owner: Vec<usize>,
    arrivals: u64,
    stats: BatcherStats,
    active_reported: bool,
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

impl Batcher {
    /// A batcher for `cfg.engine`, drawing blocks from `pool`.
    pub fn new(cfg: BatcherConfig, pool: Arc<BlockPool>) -> Result<Self, SchedError> {
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
        if cfg.engine.0 >= pool.max_engines() {
            return Err(SchedError::InvalidConfig(
                "engine id is not served by the pool",
            ));
        }
        Ok(Self {
            cfg,
            pool,
            budget: None,
            seqs: Vec::new(),
            free_slots: Vec::new(),
            index: HashMap::new(),
            waiting: [VecDeque::new(), VecDeque::new()],
            running: Vec::new(),
            swapped: VecDeque::new(),
            host_free: (0..cfg.swap_blocks).rev().collect(),
            host_released: Vec::new(),
            pending_aborts: Vec::new(),
            shed_request: 0,
            batch: Batch::default(),
            scheduled: Vec::new(),
            scratch: Vec::new(),
            row_width: 0,
            row_owner: Vec::new(),
            arrivals: 0,
            stats: BatcherStats::default(),
            active_reported: false,
        })
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

    /// The most blocks a sequence can ever hold here: its table's capacity, or the whole pool.
    fn block_limit(&self) -> u64 {
        u64::from(self.cfg.max_blocks_per_seq.min(self.pool.total()))
    }

    /// Queues a request. Refused at once if it is malformed or could never fit.
    pub fn add(&mut self, req: SeqRequest) -> Result<(), SchedError> {
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
        if self.index.contains_key(&id) || self.pending_aborts.contains(&id) {
            return Err(SchedError::DuplicateId(id));
        }
        // The last sampled token is never fed back, so the cache holds at most
        // prompt + max_new_tokens - 1 tokens.
        let longest = req.prompt.len() as u64 + u64::from(req.stop.max_new_tokens) - 1;
        let blocks = longest.div_ceil(u64::from(self.cfg.block_size));
        if blocks > self.block_limit() {
            return Err(SchedError::TooLong {
                id,
                blocks,
                limit: self.block_limit(),
            });
        }
        let seq = Sequence {
            id,
            priority: req.priority,
            stop: req.stop,
            prompt_len: req.prompt.len(),
            tokens: req.prompt,
            computed: 0,
            table: BlockTable::new(
                Arc::clone(&self.pool),
                self.cfg.engine,
                self.cfg.max_blocks_per_seq,
            ),
            phase: SeqPhase::Waiting,
            arrival: self.arrivals,
            host_blocks: Vec::new(),
            preemptions: 0,
            may_share: false,
            row_blocks: 0,
        };
        self.arrivals += 1;
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.seqs[s] = Some(seq);
                s
            }
            None => {
                self.seqs.push(Some(seq));
                self.seqs.len() - 1
            }
        };
        self.index.insert(id, slot);
        self.waiting[req.priority.index()].push_back(slot);
        Ok(())
    }

    /// Aborts a sequence. Takes effect at the start of the next step (the batch in flight may
    /// still use its blocks); its result then comes out of
    /// [`schedule_into`](Self::schedule_into)'s `finished` list.
    pub fn abort(&mut self, id: SeqId) -> Result<(), SchedError> {
        if !self.index.contains_key(&id) {
            return Err(SchedError::UnknownSeq(id));
        }
        if !self.pending_aborts.contains(&id) {
            self.pending_aborts.push(id);
        }
        Ok(())
    }

    /// Forks a running (decoding) sequence into a new one with id `child`, sharing every block
    /// (parallel sampling). The first write into a shared partial block copies it first.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<(), SchedError> {
        if self.index.contains_key(&child) {
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
            table: p.table.fork()?,
            phase: p.phase,
            arrival: self.arrivals,
            host_blocks: Vec::new(),
            preemptions: 0,
            may_share: true,
            row_blocks: 0,
        };
        self.seq_mut(slot).may_share = true;
        self.arrivals += 1;
        self.seqs.push(Some(seq));
        let child_slot = self.seqs.len() - 1;
        self.index.insert(child, child_slot);
        self.running.push(child_slot);
        Ok(())
    }

    /// Schedules the next step and returns its batch. Aborted sequences' results go to
    /// `finished`.
    pub fn schedule_into(&mut self, finished: &mut Vec<FinishedSeq>) -> &Batch {
        self.batch.clear();
        self.scheduled.clear();
        // Host slots freed by last step's swap-ins are safe to reuse now.
        self.host_free.append(&mut self.host_released);
        self.apply_aborts(finished);
        let mut preempted = self.apply_shed();

        let external = self.budget.as_ref().map_or(u32::MAX, |b| b.token_budget());
        let mut budget = self.cfg.max_batched_tokens.min(external) as usize;

        // 1. Running sequences, oldest first.
        let mut i = 0;
        while i < self.running.len() {
            let slot = self.running[i];
            let n = self.tokens_wanted(slot, budget);
            if n == 0 {
                i += 1;
                continue;
            }
            match self.reserve(slot, n) {
                Reserve::Ok => {
                    self.emit(slot, n);
                    budget -= n;
                    i += 1;
                }
                Reserve::NoBlocks => {
                    preempted = true;
                    // Victim: lowest priority, latest arrival, among those not yet scheduled
                    // (this one included).
                    let victim_pos = (i..self.running.len())
                        .max_by_key(|&k| {
                            let s = self.seq(self.running[k]);
                            (s.priority, s.arrival)
                        })
                        .unwrap_or(i);
                    let victim = self.running.remove(victim_pos);
                    self.preempt(victim);
                    // If the victim was this sequence, `i` now names the next one; otherwise
                    // retry this one with the freed blocks.
                }
            }
        }

        // 2. Swapped sequences come back when they fit.
        while let Some(&slot) = self.swapped.front() {
            if preempted || self.running.len() >= self.cfg.max_running as usize {
                break;
            }
            if !self.swap_in(slot) {
                break;
            }
            self.swapped.pop_front();
            self.running.push(slot);
        }

        // 3. Waiting sequences, latency-critical first, FCFS within a class.
        if !preempted && self.swapped.is_empty() {
            'admit: for class in Priority::ALL {
                while let Some(&slot) = self.waiting[class.index()].front() {
                    if self.running.len() >= self.cfg.max_running as usize || budget == 0 {
                        break 'admit;
                    }
                    let n = self.tokens_wanted(slot, budget);
                    if n == 0 {
                        break 'admit;
                    }
                    if let Reserve::NoBlocks = self.reserve(slot, n) {
                        break 'admit;
                    }
                    self.waiting[class.index()].pop_front();
                    self.seq_mut(slot).phase = SeqPhase::Prefilling;
                    self.running.push(slot);
                    self.emit(slot, n);
                    budget -= n;
                }
            }
        }

        self.write_block_tables();
        self.stats.steps += 1;
        self.stats.tokens_scheduled += self.batch.num_tokens() as u64;
        if let Some(b) = &self.budget {
            b.record_step(self.batch.num_tokens() as u32);
            let active = self.has_work();
            if active != self.active_reported {
                b.set_active(active);
                self.active_reported = active;
            }
        }
        &self.batch
    }

    /// Asks the batcher to give back `blocks` blocks at the start of its next step by
    /// preempting running sequences (lowest priority, latest arrival first). Requests add up.
    pub fn request_shed(&mut self, blocks: u32) {
        self.shed_request = self.shed_request.saturating_add(blocks);
    }

    /// The lowest priority among running sequences, and the blocks that preempting every
    /// running sequence of that priority would free; `None` when nothing runs.
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

    /// Waiting sequences of a class.
    pub fn num_waiting_in(&self, class: Priority) -> usize {
        self.waiting[class.index()].len()
    }

    /// Blocks the first waiting sequence of the most urgent non-empty class needs for its next
    /// chunk, with that class; `None` when nothing waits.
    pub fn next_admission_need(&self) -> Option<(Priority, u32)> {
        Priority::ALL.into_iter().find_map(|class| {
            let &slot = self.waiting[class.index()].front()?;
            let s = self.seq(slot);
            let n = (s.tokens.len() - s.computed).min(self.cfg.max_prefill_chunk as usize);
            Some((class, n.div_ceil(self.cfg.block_size as usize) as u32))
        })
    }

    /// Preempts running sequences (victim order as in a step) until the requested blocks are
    /// freed or nothing runs. Returns whether anything was preempted.
    fn apply_shed(&mut self) -> bool {
        let mut preempted = false;
        while self.shed_request > 0 && !self.running.is_empty() {
            let pos = (0..self.running.len())
                .max_by_key(|&k| {
                    let s = self.seq(self.running[k]);
                    (s.priority, s.arrival)
                })
                .unwrap_or(0);
            let slot = self.running.remove(pos);
            let blocks = self.seq(slot).table.len();
            self.preempt(slot);
            self.shed_request = self.shed_request.saturating_sub(blocks.max(1));
            preempted = true;
        }
        self.shed_request = 0;
        preempted
    }

    /// The last scheduled batch.
    pub fn batch(&self) -> &Batch {
        &self.batch
    }

    /// Applies the results of the last batch: `sampled` holds one token per sampling row, in
    /// row order. Finished sequences are appended to `finished` and their blocks freed.
    ///
    /// On a count mismatch nothing is applied.
    pub fn commit(
        &mut self,
        sampled: &[u32],
        finished: &mut Vec<FinishedSeq>,
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
            let (slot, n) = self.scheduled[row];
            let samples = self.batch.samples[row];
            let seq = self.seq_mut(slot);
            seq.computed += n;
            if !samples {
                continue;
            }
            let token = sampled[next_sample];
            next_sample += 1;
            seq.tokens.push(token);
            seq.phase = SeqPhase::Decoding;
            if let Some(reason) = seq.stop_reason(token) {
                any_finished = true;
                self.finish(slot, reason, finished);
            }
        }
        if any_finished {
            let seqs = &self.seqs;
            self.running.retain(|&s| seqs[s].is_some());
        }
        // Scheduled rows are consumed; a second commit of the same batch is refused.
        self.scheduled.clear();
        self.batch.samples.clear();
        self.batch.logits_indices.clear();
        if let Some(b) = &self.budget {
            let active = self.has_work();
            if active != self.active_reported {
                b.set_active(active);
                self.active_reported = active;
            }
        }
        Ok(())
    }

    fn seq(&self, slot: usize) -> &Sequence {
        self.seqs[slot]
            .as_ref()
            .unwrap_or_else(|| unreachable!("slot {slot} listed but empty"))
    }

    fn seq_mut(&mut self, slot: usize) -> &mut Sequence {
        self.seqs[slot]
            .as_mut()
            .unwrap_or_else(|| unreachable!("slot {slot} listed but empty"))
    }

    /// `(block, offset)` of token position `pos`. Block sizes are powers of two in practice
    /// (the CUDA kernels take 8, 16, 32), where this is a shift and a mask instead of a division
    /// (tens of cycles, per token, on the hot path).
    #[inline]
    fn split_pos(&self, pos: usize) -> (usize, usize) {
        let bs = self.cfg.block_size as usize;
        if bs.is_power_of_two() {
            (pos >> bs.trailing_zeros(), pos & (bs - 1))
        } else {
            (pos / bs, pos % bs)
        }
    }

    /// Blocks covering `tokens` tokens.
    #[inline]
    fn blocks_for(&self, tokens: usize) -> usize {
        let (blocks, rest) = self.split_pos(tokens);
        blocks + usize::from(rest != 0)
    }

    /// New tokens a sequence would compute this step within `budget`.
    fn tokens_wanted(&self, slot: usize, budget: usize) -> usize {
        let s = self.seq(slot);
        let remaining = s.tokens.len() - s.computed;
        remaining
            .min(self.cfg.max_prefill_chunk as usize)
            .min(budget)
    }

    /// Makes the sequence's table cover `computed + n` tokens, copying a shared partial last
    /// block first (copy-on-write). All or nothing.
    fn reserve(&mut self, slot: usize, n: usize) -> Reserve {
        let (computed, len, may_share) = {
            let s = self.seq(slot);
            (s.computed, s.table.len() as usize, s.may_share)
        };
        let need = self.blocks_for(computed + n).saturating_sub(len);
        if need == 0 && !may_share {
            // The common decode step: the token lands in a block the sequence owns alone.
            return Reserve::Ok;
        }
        // The next write lands inside an existing block if `computed` is not block-aligned.
        let (block, offset) = self.split_pos(computed);
        let cow_index = (may_share && offset != 0 && block < len)
            .then_some(block as u32)
            .filter(|&i| self.seq(slot).table.is_shared(i).unwrap_or(false));
        let total = need + usize::from(cow_index.is_some());
        if total == 0 {
            return Reserve::Ok;
        }
        let total = total as u32;
        if let Some(b) = &self.budget {
            if !b.try_acquire_blocks(total) {
                return Reserve::NoBlocks;
            }
        }
        self.scratch.clear();
        if self
            .pool
            .alloc_n(self.cfg.engine, total, &mut self.scratch)
            .is_err()
        {
            if let Some(b) = &self.budget {
                b.release_blocks(total);
            }
            return Reserve::NoBlocks;
        }
        let mut fresh = std::mem::take(&mut self.scratch);
        if let Some(i) = cow_index {
            let copy = fresh
                .pop()
                .unwrap_or_else(|| unreachable!("alloc_n gave fewer"));
            // The old block is shared, so `replace` only drops our reference; never freed.
            let old = self
                .seq_mut(slot)
                .table
                .replace(i, copy)
                .unwrap_or_else(|e| unreachable!("replace in range failed: {e}"));
            self.batch
                .copies
                .push((old.index() as i32, copy.index() as i32));
            // The row holding this sequence's table is stale from the replaced block on.
            self.seq_mut(slot).row_blocks = 0;
            self.stats.cow_copies += 1;
        }
        for &id in &fresh {
            // Cannot fail: admission checked the sequence's longest length against capacity.
            if let Err(e) = self.seq_mut(slot).table.push(id) {
                unreachable!("table capacity checked at admission: {e}");
            }
        }
        fresh.clear();
        self.scratch = fresh;
        Reserve::Ok
    }

    /// Appends one row for `n` new tokens of the sequence to the batch.
    fn emit(&mut self, slot: usize, n: usize) {
        let bs = i64::from(self.cfg.block_size);
        let Some(s) = self.seqs[slot].as_ref() else {
            return;
        };
        let start = s.computed;
        // Split every position before borrowing the batch mutably.
        let (mut block, mut offset) = self.split_pos(start);
        let b = &mut self.batch;
        b.seq_ids.push(s.id);
        if n == 1 {
            // Decode: one token (the common row).
            b.input_tokens.push(s.tokens[start]);
            b.positions.push(start as i32);
            let id = s
                .table
                .get(block as u32)
                .unwrap_or_else(|| unreachable!("reserve covered every token"));
            b.slot_mapping
                .push(i64::from(id.index()) * bs + offset as i64);
        } else {
            b.input_tokens
                .extend_from_slice(&s.tokens[start..start + n]);
            b.positions.extend((start..start + n).map(|p| p as i32));
            let mut id = s
                .table
                .get(block as u32)
                .unwrap_or_else(|| unreachable!("reserve covered every token"));
            for _ in 0..n {
                if offset as i64 == bs {
                    block += 1;
                    offset = 0;
                    id = s
                        .table
                        .get(block as u32)
                        .unwrap_or_else(|| unreachable!("reserve covered every token"));
                }
                b.slot_mapping
                    .push(i64::from(id.index()) * bs + offset as i64);
                offset += 1;
            }
        }
        b.query_start_loc.push(b.input_tokens.len() as i32);
        b.context_lens.push((start + n) as i32);
        let samples = start + n == s.tokens.len();
        b.samples.push(samples);
        if samples {
            b.logits_indices.push(b.input_tokens.len() as i32 - 1);
        }
        b.is_prefill.push(n > 1 || s.phase != SeqPhase::Decoding);
        b.max_blocks_per_seq = b.max_blocks_per_seq.max(s.table.len() as usize);
        self.scheduled.push((slot, n));
    }

    /// Fills `batch.block_tables`. Rows persist across steps: a sequence scheduled in the same
    /// row as last step (the common decode case) only writes the blocks it gained, so a step
    /// costs O(new blocks), not O(all blocks of all sequences). The stride grows in steps of 16
    /// (every row is rewritten then) and shrinks when the widest table has halved.
    fn write_block_tables(&mut self) {
        let needed = self.batch.max_blocks_per_seq;
        let rows = self.scheduled.len();
        let relayout = needed > self.row_width || (needed * 2 < self.row_width && needed > 0);
        if relayout {
            self.row_width = needed.next_multiple_of(16);
            self.row_owner.clear();
        }
        if rows == 0 {
            self.row_width = 0;
            self.row_owner.clear();
        }
        let width = self.row_width;
        self.batch.max_blocks_per_seq = width;
        let cells = rows * width;
        // Grow with -1 when needed; otherwise only shorten (stale padding is never read).
        if self.batch.block_tables.len() < cells {
            self.batch.block_tables.resize(cells, -1);
        } else {
            self.batch.block_tables.truncate(cells);
        }
        self.row_owner.resize(rows, usize::MAX);
        for (row, &(slot, _)) in self.scheduled.iter().enumerate() {
            let Some(s) = self.seqs[slot].as_mut() else {
                continue;
            };
            let len = s.table.len();
            let start = if self.row_owner[row] == slot {
                s.row_blocks.min(len)
            } else {
                0
            };
            let dst = &mut self.batch.block_tables
                [row * width + start as usize..row * width + len as usize];
            if let Err(e) = s.table.write_indices(start, dst) {
                unreachable!("row width is the widest table: {e}");
            }
            s.row_blocks = len;
            self.row_owner[row] = slot;
        }
    }

    /// Frees a sequence's blocks, giving them back to the budget too.
    fn release_table(&mut self, slot: usize) {
        let freed = self.seq_mut(slot).table.clear();
        if let Some(b) = &self.budget {
            b.release_blocks(freed);
        }
    }

    fn preempt(&mut self, slot: usize) {
        let blocks = self.seq(slot).table.len() as usize;
        self.seq_mut(slot).row_blocks = 0;
        let swap = self.cfg.preemption == PreemptionMode::Swap
            && blocks > 0
            && self.host_free.len() >= blocks;
        self.seq_mut(slot).preemptions += 1;
        if swap {
            let mut host_blocks = std::mem::take(&mut self.seq_mut(slot).host_blocks);
            host_blocks.clear();
            for i in 0..blocks {
                let host = self
                    .host_free
                    .pop()
                    .unwrap_or_else(|| unreachable!("checked free host slots"));
                let dev = self
                    .seq(slot)
                    .table
                    .get(i as u32)
                    .unwrap_or_else(|| unreachable!("i < table len"));
                self.batch.swap_out.push((dev.index() as i32, host as i32));
                host_blocks.push(host);
            }
            let s = self.seq_mut(slot);
            s.host_blocks = host_blocks;
            s.phase = SeqPhase::Swapped;
            self.release_table(slot);
            self.swapped.push_back(slot);
            self.stats.preempted_swap += 1;
            self.stats.blocks_swapped_out += blocks as u64;
        } else {
            self.release_table(slot);
            let s = self.seq_mut(slot);
            s.computed = 0;
            s.phase = SeqPhase::Waiting;
            let class = s.priority.index();
            self.waiting[class].push_front(slot);
            self.stats.preempted_recompute += 1;
        }
    }

    /// Brings a swapped sequence back if all its blocks fit; lists the copies.
    fn swap_in(&mut self, slot: usize) -> bool {
        let n = self.seq(slot).host_blocks.len() as u32;
        if let Some(b) = &self.budget {
            if !b.try_acquire_blocks(n) {
                return false;
            }
        }
        self.scratch.clear();
        if self
            .pool
            .alloc_n(self.cfg.engine, n, &mut self.scratch)
            .is_err()
        {
            if let Some(b) = &self.budget {
                b.release_blocks(n);
            }
            return false;
        }
        let fresh = std::mem::take(&mut self.scratch);
        let mut host_blocks = std::mem::take(&mut self.seq_mut(slot).host_blocks);
        for (&host, &dev) in host_blocks.iter().zip(&fresh) {
            self.batch.swap_in.push((host as i32, dev.index() as i32));
            if let Err(e) = self.seq_mut(slot).table.push(dev) {
                unreachable!("swapped blocks fit the table before: {e}");
            }
        }
        self.host_released.append(&mut host_blocks);
        self.scratch = fresh;
        self.scratch.clear();
        let s = self.seq_mut(slot);
        s.host_blocks = host_blocks;
        s.phase = if s.computed < s.prompt_len {
            SeqPhase::Prefilling
        } else {
            SeqPhase::Decoding
        };
        self.stats.blocks_swapped_in += u64::from(n);
        true
    }

    fn finish(&mut self, slot: usize, reason: FinishReason, out: &mut Vec<FinishedSeq>) {
        self.release_table(slot);
        let Some(seq) = self.seqs[slot].take() else {
            return;
        };
        self.host_released.extend_from_slice(&seq.host_blocks);
        self.index.remove(&seq.id);
        self.free_slots.push(slot);
        if reason == FinishReason::Aborted {
            self.stats.aborted += 1;
        } else {
            self.stats.finished += 1;
        }
        out.push(FinishedSeq {
            id: seq.id,
            output: seq.tokens[seq.prompt_len..].to_vec(),
            reason,
            preemptions: seq.preemptions,
        });
    }

    fn apply_aborts(&mut self, finished: &mut Vec<FinishedSeq>) {
        if self.pending_aborts.is_empty() {
            return;
        }
        let aborts = std::mem::take(&mut self.pending_aborts);
        for &id in &aborts {
            let Some(&slot) = self.index.get(&id) else {
                continue;
            };
            match self.seq(slot).phase {
                SeqPhase::Waiting => {
                    let class = self.seq(slot).priority.index();
                    self.waiting[class].retain(|&s| s != slot);
                }
                SeqPhase::Swapped => self.swapped.retain(|&s| s != slot),
                SeqPhase::Prefilling | SeqPhase::Decoding => self.running.retain(|&s| s != slot),
            }
            self.finish(slot, FinishReason::Aborted, finished);
        }
        self.pending_aborts = aborts;
        self.pending_aborts.clear();
    }
}

impl Drop for Batcher {
    fn drop(&mut self) {
        // Tables release their blocks to the pool when dropped; give the quota back too.
        for slot in 0..self.seqs.len() {
            if self.seqs[slot].is_some() {
                self.release_table(slot);
            }
        }
    }
}
