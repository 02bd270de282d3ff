//! Building a step's rows: how many tokens a sequence gets, the blocks that cover them
//! (copy-on-write included), and its row of the kernel-ready batch.

use super::{Batcher, Reserve};
use crate::sched::sequence::SeqPhase;

impl Batcher {
    /// `(block, offset)` of token position `pos`. Block sizes are powers of two in practice
    /// (the CUDA kernels take 8, 16, 32), where this is a shift and a mask instead of a division
    /// (tens of cycles, per token, on the hot path).
    #[inline]
    pub(super) fn split_pos(&self, pos: usize) -> (usize, usize) {
        let bs = self.cfg.block_size as usize;
        if bs.is_power_of_two() {
            (pos >> bs.trailing_zeros(), pos & (bs - 1))
        } else {
            (pos / bs, pos % bs)
        }
    }

    /// Blocks covering `tokens` tokens.
    #[inline]
    pub(super) fn blocks_for(&self, tokens: usize) -> usize {
        let (blocks, rest) = self.split_pos(tokens);
        blocks + usize::from(rest != 0)
    }

    /// New tokens a sequence would compute this step within `budget`: its uncomputed tokens
    /// and, if all of them and its draft tokens fit, the drafts too (drafts that do not all fit
    /// are left out of the row, which is then a plain decode).
    pub(super) fn tokens_wanted(&self, slot: usize, budget: usize) -> usize {
        let s = self.seq(slot);
        let remaining = s.tokens.len() - s.computed;
        let limit = (self.cfg.max_prefill_chunk as usize).min(budget);
        let with_drafts = remaining + s.drafts.len();
        if !s.drafts.is_empty() && with_drafts <= limit {
            return with_drafts;
        }
        remaining.min(limit)
    }

    /// A shorter chunk for a sequence whose `n`-token prefill chunk could not get its pages:
    /// the tokens that the pages the failed attempt had on hand hold (the pages of this step's
    /// swap-outs it may reuse and the pool's free pages; it already evicted what it could)
    /// where they are fewer than the chunk needs, the common shortage; else (the budget
    /// refused before the pool was asked, or a copy-on-write page was also needed) half of its
    /// new pages; plus the rest of its last page. 0 where nothing shorter needs fewer pages (no
    /// new page was asked: what it lacks is a copy-on-write of its last page).
    pub(super) fn shorter_chunk(&self, slot: usize, n: usize) -> usize {
        let s = self.seq(slot);
        let len = s.table.len() as usize;
        let need = self.blocks_for(s.computed + n).saturating_sub(len);
        if need == 0 || n <= 1 {
            return 0;
        }
        let pages = match self.pages_on_hand {
            Some(on_hand) if (on_hand as usize) < need => on_hand as usize,
            _ => need / 2,
        };
        ((len + pages) * self.cfg.block_size as usize)
            .saturating_sub(s.computed)
            .min(n - 1)
    }

    /// The pages [`reserve`](Self::reserve) takes for `n` more tokens of the sequence: its new
    /// pages, and one more for the copy of a shared partial last block (whose index it gives).
    pub(super) fn pages_to_reserve(&self, slot: usize, n: usize) -> (usize, Option<u32>) {
        let s = self.seq(slot);
        let (computed, len, may_share) = (s.computed, s.table.len() as usize, s.may_share);
        let need = self.blocks_for(computed + n).saturating_sub(len);
        if !may_share {
            // The common decode step: the token lands in a block the sequence owns alone.
            return (need, None);
        }
        // The next write lands inside an existing block if `computed` is not block-aligned.
        let (block, offset) = self.split_pos(computed);
        let cow_index = (offset != 0 && block < len)
            .then_some(block as u32)
            .filter(|&i| s.table.is_shared(i).unwrap_or(false));
        (need + usize::from(cow_index.is_some()), cow_index)
    }

    /// Makes the sequence's table cover `computed + n` tokens, copying a shared partial last
    /// block first (copy-on-write). All or nothing.
    pub(super) fn reserve(&mut self, slot: usize, n: usize) -> Reserve {
        let (total, cow_index) = self.pages_to_reserve(slot, n);
        if total == 0 {
            return Reserve::Ok;
        }
        if !self.take_pages(total as u32) {
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

    /// Appends one row for `n` new tokens of the sequence to the batch: its uncomputed tokens,
    /// then its draft tokens if `n` reaches past them (`tokens_wanted` gives all or none).
    pub(super) fn emit(&mut self, slot: usize, n: usize) {
        let bs = i64::from(self.cfg.block_size);
        let Some(s) = self.seqs[slot].as_ref() else {
            return;
        };
        let start = s.computed;
        let known = s.tokens.len() - start;
        let drafts = n.saturating_sub(known);
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
                .extend_from_slice(&s.tokens[start..start + n - drafts]);
            b.input_tokens.extend_from_slice(&s.drafts[..drafts]);
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
        let samples = start + n >= s.tokens.len();
        b.samples.push(samples);
        b.drafts.push(drafts as u32);
        if samples {
            let end = b.input_tokens.len() as i32;
            if drafts == 0 {
                b.logits_indices.push(end - 1);
            } else {
                // One logit per draft and one after the last token: the row's last
                // `drafts + 1`.
                b.logits_indices.extend(end - 1 - drafts as i32..end);
            }
        }
        b.is_prefill.push(n > 1 || s.phase != SeqPhase::Decoding);
        b.max_blocks_per_seq = b.max_blocks_per_seq.max(s.table.len() as usize);
        self.scheduled.push((slot, n, drafts));
    }

    /// Fills `batch.block_tables`. Rows persist across steps: a sequence scheduled in the same
    /// row as last step only writes the blocks it gained, so a step costs O(new blocks) while
    /// rows keep their sequences. The stride is the widest table rounded up to a multiple of
    /// 16; it grows when a table outgrows it and shrinks when a stride of half its width or
    /// less would do (every row is rewritten then). A sequence that moves to another row (an
    /// admission, a preemption or an end ahead of it in the priority order) rewrites its row.
    pub(super) fn write_block_tables(&mut self) {
        let needed = self.batch.max_blocks_per_seq;
        let rows = self.scheduled.len();
        // Shrink only to a stride of half the width or less: comparing the table itself with
        // half the width relaid out every step while the widest table was under 8 blocks.
        let relayout = needed > self.row_width
            || (needed > 0 && needed.next_multiple_of(16) * 2 <= self.row_width);
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
        for (row, &(slot, _, _)) in self.scheduled.iter().enumerate() {
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
}
