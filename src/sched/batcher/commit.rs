//! Committing a step: sampled tokens appended, stop rules applied, pages cached and
//! released, and the budget told the batch has run.

use super::Batcher;
use crate::error::SchedError;
use crate::sched::sequence::{FinishedSeq, SeqPhase, SeqUpdate, StepResults};

impl Batcher {
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

    /// Tells the attached budget that the scheduled batch ended without a commit: its execution
    /// or its sampling failed, and the caller will schedule again (which discards the batch).
    /// The batch stays pending; only the tokens the step holds above the engine's share go back
    /// now ([`EngineBudget::step_ran`](super::EngineBudget::step_ran)), as a commit would give
    /// them back: the engines they were lent by would otherwise wait for this engine's next
    /// schedule, however late its caller makes it. Harmless when repeated.
    pub fn step_failed(&self) {
        if let Some(b) = &self.budget {
            b.step_ran();
        }
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
}
