//! Requests into the batcher: queueing (checked against what could ever fit), aborts, finishes,
//! speculative drafts and forks.

use super::Batcher;
use crate::block::BlockTable;
use crate::error::SchedError;
use crate::sched::sequence::{FinishReason, SeqId, SeqPhase, SeqRequest, Sequence};
use crate::sync::Arc;

impl Batcher {
    /// Queues a request. Refused at once if it is malformed or could never fit: longer than a
    /// sequence's table, the pool, or the blocks the attached budget guarantees the engine
    /// ([`EngineBudget::guaranteed_blocks`](super::EngineBudget::guaranteed_blocks); what it
    /// could borrow beyond them is not counted, since it is taken back whenever the lenders
    /// have work), or than the whole pages below 2^31 tokens that a batch's `i32` positions
    /// count.
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
    /// one of them ([`Batch::drafts`](crate::sched::Batch::drafts)), and the commit accepts
    /// the longest prefix of drafts that the sampled tokens confirm, plus one sampled token
    /// (the correction or the bonus). The KV written for rejected drafts is rolled back: the
    /// sequence's computed length stops after the accepted ones and pages left empty are freed.
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
}
