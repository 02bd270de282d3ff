//! Giving blocks back: preemption by recompute or swap, swapping back in, shedding on a
//! coordinator's request, and finishing or aborting sequences.

use super::{Batcher, PreemptionMode};
use crate::block::BlockId;
use crate::sched::sequence::{FinishReason, FinishedSeq, Priority, SeqPhase};

impl Batcher {
    /// Preempts running sequences (victim order as in a step) until the requested blocks are
    /// freed or nothing runs. Returns whether anything was preempted.
    pub(super) fn apply_shed(&mut self) -> bool {
        let mut preempted = false;
        while self.shed_request > 0 && !self.running.is_empty() {
            let pos = (0..self.running.len())
                .max_by_key(|&k| {
                    let s = self.seq(self.running[k]);
                    (s.priority, s.arrival)
                })
                .unwrap_or(0);
            let slot = self.running.remove(pos);
            // The pages that leave this engine, not the table's length: pages a fork or the
            // prefix cache shares stay (a swap-out's leave once the batch has read them).
            let freed = self.pages_leaving(slot, 0);
            self.preempt(slot);
            self.shed_request = self.shed_request.saturating_sub(freed);
            preempted = true;
        }
        self.shed_request = 0;
        preempted
    }

    /// Makes room for a latency-critical sequence (a waiting request's first chunk, or a
    /// swapped-out sequence's pages) by preempting running throughput sequences among
    /// `running[from..]` (none of them in the batch yet), latest arrival first: the first of
    /// them for a running slot if `for_slot` (the running sequences fill `max_running`), then
    /// more while the pages they give up and those the last failed `take_pages` had on hand
    /// fall short of `need` (0: its pages were taken). All or nothing: where preempting every
    /// one of them would still leave it short (or no throughput sequence runs to give up a
    /// slot), none is preempted (it would cost their work for nothing: the sequence would not
    /// come in). Returns whether any was preempted.
    ///
    /// A victim counts only the pages this step may take back at once
    /// ([`pages_freed_by`](Self::pages_freed_by)): a page another sequence or the request
    /// itself still references (a fork, a cached prefix it attached) stays allocated. Where the
    /// budget refused before the pool was asked (`pages_on_hand` is `None`), nothing on hand is
    /// counted: the budget's headroom is not known, so the victims' pages alone must cover the
    /// need.
    ///
    /// In swap mode a victim is swapped out where that gives up what the request still lacks,
    /// and recomputed where only a recompute would: a swap-out keeps the pages the prefix
    /// cache also holds (every completed page of a sequence, with a cache attached) until the
    /// batch has run, so only its uncached pages count, and the request would wait, with
    /// nothing preempted, for as long as the throughput work runs. Recomputed, it gives them up
    /// at once (cached, free to evict) and attaches what is left of them when it comes back.
    pub(super) fn make_room_for_latency_critical(
        &mut self,
        need: usize,
        for_slot: bool,
        from: usize,
    ) -> bool {
        let need = need as u64;
        let mut have = if need > 0 {
            u64::from(self.pages_on_hand.unwrap_or(0))
        } else {
            0
        };
        // Rare (latency-critical work short of pages or a slot): a list of the candidates is
        // fine.
        let mut victims: Vec<usize> = self.running[from.min(self.running.len())..]
            .iter()
            .copied()
            .filter(|&v| self.seq(v).priority == Priority::Throughput)
            .collect();
        victims.sort_unstable_by_key(|&v| std::cmp::Reverse(self.seq(v).arrival));
        // Whether each chosen victim may be swapped out (else recomputed).
        let mut swap_ok = Vec::with_capacity(victims.len());
        let mut host_left = self.host_free.len();
        let mut chosen = 0;
        for k in 0..victims.len() {
            let slot_wanted = for_slot && chosen == 0;
            if have >= need && !slot_wanted {
                break;
            }
            // Host slots are used up only by the victims actually swapped out: one passed over
            // or recomputed leaves them to the next, which a swap then takes.
            let mut left = host_left;
            let (freed, swap) = self.victim_mode(victims[k], need.saturating_sub(have), &mut left);
            // A victim that gives up no page (all shared) would be preempted for nothing,
            // unless its running slot is what is wanted.
            if freed > 0 || slot_wanted {
                host_left = left;
                have += u64::from(freed);
                victims[chosen] = victims[k];
                swap_ok.push(swap);
                chosen += 1;
            }
        }
        if have < need || (for_slot && chosen == 0) {
            return false;
        }
        for (&victim, &swap) in victims[..chosen].iter().zip(&swap_ok) {
            self.running.retain(|&s| s != victim);
            self.preempt_as(victim, swap);
        }
        chosen > 0
    }

    /// How to preempt the running sequence `victim` for a sequence that still lacks `short`
    /// pages (with `host_left` host slots free, which a swap uses up): the pages it gives up
    /// at once, and whether it may be swapped out (else it is recomputed). In swap mode a
    /// swap-out that gives up what is lacking is kept; one that falls short (it keeps the
    /// pages the prefix cache also holds, every completed page of a sequence with a cache
    /// attached, until the batch has run) gives way to a recompute where that gives up more:
    /// the victim's pages then leave at once (its cached ones free to evict), and it attaches
    /// what is left of them when it comes back. Otherwise more victims would be swapped out,
    /// each for its partial last page, where one recompute would do.
    pub(super) fn victim_mode(
        &self,
        victim: usize,
        short: u64,
        host_left: &mut usize,
    ) -> (u32, bool) {
        let mut left = *host_left;
        let swapped = self.pages_freed_by(victim, &mut left);
        if left < *host_left && u64::from(swapped) < short {
            let recomputed = self.pages_freed_by(victim, &mut 0);
            if recomputed > swapped {
                return (recomputed, false);
            }
        }
        *host_left = left;
        (swapped, true)
    }

    /// The pages that preempting the running sequence `slot` (with `host_left` host slots
    /// still free, which a swap uses up) makes available to this engine in the same step: by
    /// swap, the pages it holds alone ([`take_pages`](Self::take_pages) may reuse those); by
    /// recompute (or a swap without host slots), the pages that leave its budget
    /// ([`pages_leaving`](Self::pages_leaving): freed, or cached-free and so evictable). Neither
    /// counts a page a copy of the batch reads (held until the batch has run).
    pub(super) fn pages_freed_by(&self, slot: usize, host_left: &mut usize) -> u32 {
        let s = self.seq(slot);
        let blocks = s.table.len() as usize;
        let swap =
            self.cfg.preemption == PreemptionMode::Swap && blocks > 0 && *host_left >= blocks;
        if swap {
            *host_left -= blocks;
        }
        let copies = &self.batch.copies;
        (0..s.table.len())
            .filter_map(|i| s.table.get(i))
            .filter(|&id| !is_copy_source(copies, id))
            .filter(|&id| {
                if swap {
                    self.pool.ref_count(id) == Ok(1)
                } else {
                    self.page_leaves(id)
                }
            })
            .count() as u32
    }

    /// Frees a sequence's blocks, giving them back to the budget too. Returns how many left
    /// the budget.
    pub(super) fn release_table(&mut self, slot: usize) -> u32 {
        let leaving = self.pages_leaving(slot, 0);
        let s = self.seq_mut(slot);
        s.table.clear();
        s.hashed = 0;
        s.parent = None;
        if let Some(b) = &self.budget {
            b.release_blocks(leaving);
        }
        leaving
    }

    /// After rejected drafts: frees the pages past the sequence's computed tokens (their KV is
    /// rolled back), giving them back to the budget too. The page the next token lands in is
    /// reserved again by the next step if it was freed.
    pub(super) fn roll_back_pages(&mut self, slot: usize) {
        let keep = self.blocks_for(self.seq(slot).computed) as u32;
        let s = self.seq_mut(slot);
        if s.table.len() > keep {
            // The row's block-table entries past `keep` are stale now.
            s.row_blocks = s.row_blocks.min(keep);
            let leaving = self.pages_leaving(slot, keep);
            self.seq_mut(slot).table.truncate(keep);
            if let Some(b) = &self.budget {
                b.release_blocks(leaving);
            }
        }
    }

    /// Moves a swapped-out sequence's pages from its table to `swap_out_pending`: one extra
    /// reference per page keeps them allocated (and charged to this engine's budget) until
    /// [`release_swapped_pages`](Self::release_swapped_pages), after the batch has run.
    fn hold_for_swap_out(&mut self, slot: usize) {
        self.hold_pages(slot, false);
        // Drops the table's references; the budget stays charged for the held pages.
        self.seq_mut(slot).table.clear();
    }

    /// Keeps one reference (and its budget) in `swap_out_pending` to each page of `slot`'s table
    /// that a copy of the batch being built reads, released with the swapped-out pages after
    /// the batch has run. For a sequence preempted by recompute after a copy-on-write left it
    /// the copy's source alone: released now, the page would go back to the pool, and another
    /// engine could get it and write it before the batch copies from it.
    fn hold_copy_sources(&mut self, slot: usize) {
        if !self.batch.copies.is_empty() {
            self.hold_pages(slot, true);
        }
    }

    /// Takes one more reference to each page of `slot`'s table (only those a copy of the batch
    /// reads, if `copy_sources_only`) into `swap_out_pending`.
    fn hold_pages(&mut self, slot: usize, copy_sources_only: bool) {
        let mut pages = std::mem::take(&mut self.scratch);
        pages.clear();
        self.seq(slot).table.ids_into(&mut pages);
        for &id in &pages {
            if copy_sources_only && !is_copy_source(&self.batch.copies, id) {
                continue;
            }
            match self.pool.share(id) {
                Ok(()) => self.swap_out_pending.push(id),
                // The table holds a reference, so sharing cannot fail short of a pool bug; if it
                // does, the page is not held and is released with the table.
                Err(e) => debug_assert!(false, "sharing a held page failed: {e}"),
            }
        }
        pages.clear();
        self.scratch = pages;
    }

    /// Takes `n` pages for this engine into `self.scratch`, all or nothing: pages this step's
    /// swap-outs gave up first (still charged to this engine; the batch's swap-outs run
    /// before anything writes, so this engine may reuse them in the same step, and no other
    /// engine can), except those its shed gave back, then new ones from the budget and the
    /// pool. On failure nothing is taken.
    pub(super) fn take_pages(&mut self, n: u32) -> bool {
        self.scratch.clear();
        // Only pages the pending swap-outs hold alone may be reused: one another sequence still
        // references (a fork, an attached cached prefix) or the prefix cache holds must not be
        // rewritten. A stable partition puts the reusable ones last (only when swap-outs are
        // pending, which is rare). Nor may a page a copy of this batch reads: the copies run at
        // once, and a copy-on-write into it would make the list read a page it writes.
        // Nor may a page a shed gave back (the leading `shed_held` entries, left in place).
        let mut reusable = 0;
        if self.swap_out_pending.len() > self.shed_held {
            let mut pending = std::mem::take(&mut self.swap_out_pending);
            let (pool, copies) = (&self.pool, &self.batch.copies);
            let free_to_reuse =
                |id: BlockId| pool.ref_count(id) == Ok(1) && !is_copy_source(copies, id);
            let own = &mut pending[self.shed_held..];
            own.sort_by_key(|&id| free_to_reuse(id));
            reusable = own
                .iter()
                .rev()
                .take_while(|&&id| free_to_reuse(id))
                .count();
            self.swap_out_pending = pending;
        }
        let reuse = (n as usize).min(reusable);
        let fresh = n - reuse as u32;
        if fresh > 0 {
            if let Some(b) = &self.budget {
                if !b.try_acquire_blocks(fresh) {
                    self.pages_on_hand = None;
                    return false;
                }
            }
            let mut taken = self.pool.alloc_n(self.cfg.engine, fresh, &mut self.scratch);
            if taken.is_err() {
                // Short of free pages: cached-free pages may be evicted for them.
                let short = fresh.saturating_sub(self.pool.free_count());
                if self.evict_for(short.max(1), fresh) {
                    taken = self.pool.alloc_n(self.cfg.engine, fresh, &mut self.scratch);
                }
            }
            if taken.is_err() {
                if let Some(b) = &self.budget {
                    b.release_blocks(fresh);
                }
                self.scratch.clear();
                self.pages_on_hand = Some((reusable as u32).saturating_add(self.pool.free_count()));
                return false;
            }
        }
        let from = self.swap_out_pending.len() - reuse;
        self.scratch.extend(self.swap_out_pending.drain(from..));
        true
    }

    /// Drops the references `hold_for_swap_out` kept, freeing the pages and their budget.
    /// Returns how many pages left the budget.
    pub(super) fn release_swapped_pages(&mut self) -> u32 {
        self.shed_held = 0;
        if self.swap_out_pending.is_empty() {
            return 0;
        }
        let mut pending = std::mem::take(&mut self.swap_out_pending);
        // A page leaves the budget only if no other sequence still references it (a fork, or
        // a cached prefix another sequence attached): see `pages_leaving`. Counted as each
        // reference goes: a page two sequences swapped out in one step is listed twice, and
        // counted before any release neither entry saw it leave (its budget was never given
        // back).
        let mut leaving = 0;
        for id in pending.drain(..) {
            leaving += u32::from(self.page_leaves(id));
            // Each id holds the reference taken in `hold_for_swap_out`: a failure here would be
            // a pool bug (double free); the page is then already free, nothing is lost.
            let released = self.pool.release(id);
            debug_assert!(released.is_ok(), "releasing a held page failed");
        }
        self.swap_out_pending = pending;
        if let Some(b) = &self.budget {
            b.release_blocks(leaving);
        }
        leaving
    }

    pub(super) fn preempt(&mut self, slot: usize) {
        self.preempt_as(slot, true);
    }

    /// Preempts by the preemption mode, but by recompute where `may_swap` is false.
    pub(super) fn preempt_as(&mut self, slot: usize, may_swap: bool) {
        let blocks = self.seq(slot).table.len() as usize;
        self.seq_mut(slot).row_blocks = 0;
        self.seq_mut(slot).drafts.clear();
        let swap = may_swap
            && self.cfg.preemption == PreemptionMode::Swap
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
            s.swapped_from = s.phase;
            s.phase = SeqPhase::Swapped;
            // Keep the pages (and their budget) until the swap-out has read them.
            self.hold_for_swap_out(slot);
            // In order of priority, then arrival: one step preempts the youngest first, but
            // the oldest comes back first.
            let key = self.order_key(slot);
            let at = self
                .swapped
                .iter()
                .position(|&o| self.order_key(o) > key)
                .unwrap_or(self.swapped.len());
            self.swapped.insert(at, slot);
            self.stats.preempted_swap += 1;
            self.stats.blocks_swapped_out += blocks as u64;
        } else {
            self.hold_copy_sources(slot);
            self.release_table(slot);
            let s = self.seq_mut(slot);
            s.computed = 0;
            s.phase = SeqPhase::Waiting;
            let class = s.priority.index();
            self.waiting[class].push_front(slot);
            self.stats.preempted_recompute += 1;
        }
    }

    /// Discards a scheduled batch that was not committed, whether or not (or how far) it ran.
    /// Its rows need nothing: a sequence's computed length moves only at a commit, so they are
    /// scheduled again and their KV rewritten. What the batch was to move outside its rows
    /// cannot be trusted: a sequence it swapped out (the host copy may not exist), swapped in
    /// or copied a block into (the device pages may hold anything) is preempted by recompute.
    /// Their pages and host slots go back; nothing else changes. Returns how many pages left
    /// the budget (those of the sequences recomputed).
    pub(super) fn discard_uncommitted(&mut self) -> u32 {
        if !self.uncommitted {
            return 0;
        }
        self.uncommitted = false;
        self.scheduled.clear();
        let b = &self.batch;
        let mut hosts: Vec<u32> = b.swap_out.iter().map(|&(_, h)| h as u32).collect();
        let mut devs: Vec<u32> = b.swap_in.iter().map(|&(_, d)| d as u32).collect();
        devs.extend(b.copies.iter().map(|&(_, d)| d as u32));
        hosts.sort_unstable();
        devs.sort_unstable();
        // The sequences to recompute, queued together at the end so that the oldest waits
        // at the front of its class (as a step's own preemptions leave them).
        let mut requeue = Vec::new();
        // Swapped out by this batch: its host slots are this batch's swap-out targets. The
        // table is already empty (the pages wait in swap_out_pending, released at the next
        // schedule).
        let mut k = 0;
        while k < self.swapped.len() {
            let slot = self.swapped[k];
            let ours = self
                .seq(slot)
                .host_blocks
                .iter()
                .any(|h| hosts.binary_search(h).is_ok());
            if !ours {
                k += 1;
                continue;
            }
            self.swapped.remove(k);
            let mut host = std::mem::take(&mut self.seq_mut(slot).host_blocks);
            self.host_free.append(&mut host);
            self.seq_mut(slot).host_blocks = host;
            requeue.push(slot);
        }
        if !devs.is_empty() {
            // Swapped in, or copied into: a page of its table is a swap-in or copy target.
            let mut pages = std::mem::take(&mut self.scratch);
            let mut k = 0;
            while k < self.running.len() {
                let slot = self.running[k];
                self.seq(slot).table.ids_into(&mut pages);
                if pages.iter().any(|p| devs.binary_search(&p.index()).is_ok()) {
                    self.running.remove(k);
                    requeue.push(slot);
                } else {
                    k += 1;
                }
            }
            pages.clear();
            self.scratch = pages;
        }
        // Each goes to the front of its class: the youngest first, so the oldest ends first.
        requeue.sort_unstable_by_key(|&slot| std::cmp::Reverse(self.order_key(slot)));
        let mut leaving = 0u32;
        for slot in requeue {
            leaving = leaving.saturating_add(self.requeue_for_recompute(slot));
        }
        leaving
    }

    /// Preempts a sequence (taken off its queue by the caller) by recompute: its pages go back
    /// and it waits at the front of its class with nothing computed. Returns how many pages
    /// left the budget.
    fn requeue_for_recompute(&mut self, slot: usize) -> u32 {
        let leaving = self.release_table(slot);
        let s = self.seq_mut(slot);
        s.computed = 0;
        s.row_blocks = 0;
        s.drafts.clear();
        s.preemptions += 1;
        s.phase = SeqPhase::Waiting;
        let class = s.priority.index();
        self.waiting[class].push_front(slot);
        self.stats.preempted_recompute += 1;
        leaving
    }

    /// Brings a swapped sequence back if all its blocks fit; lists the copies.
    pub(super) fn swap_in(&mut self, slot: usize) -> bool {
        let n = self.seq(slot).host_blocks.len() as u32;
        if !self.take_pages(n) {
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
        // As it left: one swapped out while recomputing its generated tokens is past its
        // prompt but not decoding yet.
        s.phase = s.swapped_from;
        self.stats.blocks_swapped_in += u64::from(n);
        true
    }

    /// Ends a sequence, freeing its pages; returns how many left the budget.
    pub(super) fn finish(
        &mut self,
        slot: usize,
        reason: FinishReason,
        out: &mut Vec<FinishedSeq>,
    ) -> u32 {
        let leaving = self.release_table(slot);
        let Some(seq) = self.seqs[slot].take() else {
            return leaving;
        };
        self.host_released.extend_from_slice(&seq.host_blocks);
        self.index.remove(&seq.id);
        // An end the caller asked for that has not come yet (a commit's stop rules ended the
        // sequence first) is moot: dropped, or it would keep the reported id taken
        // (`id_taken`) until the next step. (`apply_aborts` holds the list apart while it
        // ends sequences, so this finds nothing there.)
        if !self.pending_aborts.is_empty() {
            let id = seq.id;
            self.pending_aborts.retain(|&(p, _)| p != id);
        }
        self.free_slots.push(slot);
        if matches!(reason, FinishReason::Aborted | FinishReason::TooLong) {
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
        leaving
    }

    /// Ends the sequences aborted or finished by the caller (and those `end_unguaranteed`
    /// found too long). The pages they give back count toward a pending shed request: it asks
    /// for pages back, and these are back, so only the rest is preempted for.
    pub(super) fn apply_aborts(&mut self, finished: &mut Vec<FinishedSeq>) {
        if self.pending_aborts.is_empty() {
            return;
        }
        let mut freed = 0u32;
        let aborts = std::mem::take(&mut self.pending_aborts);
        for &(id, reason) in &aborts {
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
            freed = freed.saturating_add(self.finish(slot, reason, finished));
        }
        self.shed_request = self.shed_request.saturating_sub(freed);
        self.pending_aborts = aborts;
        self.pending_aborts.clear();
    }
}

/// Whether a copy of `copies` (source, destination page pairs) reads `id`'s page.
fn is_copy_source(copies: &[(i32, i32)], id: BlockId) -> bool {
    let page = id.index() as i32;
    copies.iter().any(|&(s, _)| s == page)
}
