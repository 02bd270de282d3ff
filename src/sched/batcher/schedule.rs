//! One step's schedule: the running sequences in priority order, latency-critical arrivals
//! ahead of the throughput rows, swapped sequences back, then waiting throughput requests;
//! and the step's token demand reported to the budget.

use super::{Batcher, Reserve};

/// The tokens ahead of each sequence (running, swapped out, or admissible from the queue) whose
/// pages an engine's block demand counts: a lender keeps the pages its sequences need for about
/// this many more tokens (a few seconds of decoding) out of what it lends, so that it is not
/// short of pages, waiting for borrowers to give back, each time one of them crosses a page
/// boundary.
const BLOCK_DEMAND_HORIZON: usize = 128;

/// The most steps in a row a row short of pages this engine lent waits for the borrowers to give
/// them back (they do at their next step once this engine's demand is published) before it
/// preempts as if nothing were lent.
const LENT_WAIT_STEPS: u32 = 4;
use crate::sched::batch::Batch;
use crate::sched::sequence::{FinishedSeq, Priority, SeqPhase};

impl Batcher {
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
        // Whether a running row waits for pages lent to another engine.
        let mut waited = false;
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
                let pressed = preempted || shortened_any || waited;
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
                        // The pages are lent to another engine, which gives them back at its
                        // next step (this step's demand tells the coordinator to take them
                        // back): waiting a step costs less than preempting a sequence of this
                        // row's own class for them. Not where the victim is throughput work
                        // and this row latency-critical: that work gives its pages up now, as
                        // it would to a latency-critical admission. Nothing is admitted this
                        // step either.
                        if self.waits_for_lent_pages(slot, n) {
                            waited = true;
                            owed = owed.saturating_sub(row_owed);
                            i += 1;
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
        let pressed = preempted || shortened_any || waited;
        self.lent_waits = if waited { self.lent_waits + 1 } else { 0 };
        self.stats.lent_page_waits += u64::from(waited);

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
            b.record_block_demand(self.block_growth());
            let active = self.has_work();
            if active != self.active_reported {
                b.set_active(active);
                self.active_reported = active;
            }
        }
        &self.batch
    }

    /// Whether `slot`'s `n`-token row, refused its pages, should wait for pages this engine
    /// lent rather than preempt ([`EngineBudget::pages_lent_out`](super::EngineBudget::pages_lent_out)):
    /// not after [`LENT_WAIT_STEPS`] steps in a row that waited, so that a borrower that does
    /// not step (its driver stalled, or one that never calls for its reclaim orders) cannot
    /// hold this engine's work up for longer: it preempts then, as with nothing lent.
    fn waits_for_lent_pages(&self, slot: usize, n: usize) -> bool {
        if self.lent_waits >= LENT_WAIT_STEPS {
            return false;
        }
        let need = self.pages_to_reserve(slot, n).0 as u32;
        self.budget.as_ref().is_some_and(|b| b.pages_lent_out(need))
    }

    /// The pages this engine's work will take over the next [`BLOCK_DEMAND_HORIZON`] tokens
    /// of each sequence (at most to its longest) beyond what it holds: the running and the
    /// swapped-out sequences, and the waiting ones that the free running slots could admit
    /// (latency-critical first, each in queue order), saturating at `u32::MAX`. Counting the
    /// work that waits or was refused pages, rather than asking for everything while any waits
    /// or a step is short, keeps a light engine's arrival from taking back all it lent: the
    /// borrowers give back what the arrival needs. O(running + swapped sequences + free
    /// slots).
    fn block_growth(&self) -> u32 {
        let free_slots =
            (self.cfg.max_running as usize).saturating_sub(self.running.len() + self.swapped.len());
        let waiting = self.waiting.iter().flatten().take(free_slots);
        let growth = self
            .running
            .iter()
            .chain(&self.swapped)
            .chain(waiting)
            .map(|&slot| {
                let s = self.seq(slot);
                let longest = (s.prompt_len + s.stop.max_new_tokens as usize).saturating_sub(1);
                let until = (s.tokens.len() + BLOCK_DEMAND_HORIZON).min(longest);
                self.blocks_for(until)
                    .saturating_sub(s.table.len() as usize)
            });
        growth.fold(0u32, |sum, g| {
            sum.saturating_add(g.min(u32::MAX as usize) as u32)
        })
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
}
