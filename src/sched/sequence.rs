//! Requests, sequences and their life cycle in one engine's batcher.

use crate::block::BlockTable;

/// A request's id, unique within one batcher.
pub type SeqId = u64;

/// Priority class of a request. Latency-critical work is scheduled first and preempted last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Priority {
    /// Interactive traffic: scheduled before throughput work.
    LatencyCritical = 0,
    /// Batch traffic.
    #[default]
    Throughput = 1,
}

impl Priority {
    /// Both classes, most urgent first.
    pub const ALL: [Priority; 2] = [Priority::LatencyCritical, Priority::Throughput];

    /// The class as an index into per-class arrays.
    #[inline]
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The class's rank in the budget coordinator's donor choice (larger is more important).
    #[inline]
    pub const fn rank(self) -> crate::budget::Rank {
        match self {
            Priority::LatencyCritical => 1,
            Priority::Throughput => 0,
        }
    }
}

/// When a sequence stops generating.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopRules {
    /// Most tokens to generate (at least 1).
    pub max_new_tokens: u32,
    /// End-of-sequence token ids: sampling any of them finishes the sequence (the token is kept).
    pub eos: Vec<u32>,
    /// Stop sequences of token ids: the output ending with any of them finishes the sequence.
    pub stop_sequences: Vec<Vec<u32>>,
}

/// A generation request handed to a batcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqRequest {
    /// Unique within the batcher.
    pub id: SeqId,
    /// Prompt token ids (at least one).
    pub prompt: Vec<u32>,
    /// Stop rules.
    pub stop: StopRules,
    /// Priority class.
    pub priority: Priority,
}

impl SeqRequest {
    /// The most tokens its KV cache holds: the prompt and every output token but the last
    /// (the last sampled token is never fed back).
    pub fn max_cached_tokens(&self) -> u64 {
        (self.prompt.len() as u64 + u64::from(self.stop.max_new_tokens)).saturating_sub(1)
    }
}

/// Why a sequence finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// Sampled an end-of-sequence token.
    Eos,
    /// Generated `max_new_tokens`.
    MaxTokens,
    /// The output ended with a stop sequence.
    StopSequence,
    /// Aborted by the caller.
    Aborted,
    /// Finished by the caller with a code of its own, e.g. a stop string its detokenizer found
    /// in the text (distinct from an abort: the output is complete).
    Caller(u32),
    /// Ended by the scheduler, output incomplete: the pages its engine is guaranteed dropped
    /// below what the sequence needs at its longest (another engine registered on the device,
    /// or the weights changed), so it could have been preempted forever. A request that long
    /// is refused at `add` ([`SchedError::TooLong`](crate::error::SchedError::TooLong)).
    TooLong,
}

/// What one sequence got from a step's commit: the tokens appended to it this step (a range of
/// [`StepResults::tokens`]) and, if it ended, why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqUpdate {
    /// The request's id.
    pub id: SeqId,
    /// This step's tokens of the sequence, as a range of [`StepResults::tokens`] (empty for a
    /// sequence that ended without a new token: an abort or a caller's finish).
    pub tokens: std::ops::Range<usize>,
    /// Set when the sequence ended this step.
    pub finished: Option<FinishReason>,
}

/// Per-step results of one engine: first the sequences that ended at the start of the step
/// (aborts and caller finishes, with empty token ranges; after a step that was not committed,
/// that step's ones come first), then one entry per sampling row of the step's batch, in row
/// order ([`Engine::results`](crate::engine::Engine::results)). A [`Batcher`](crate::sched::Batcher)
/// driven by hand appends only the rows ([`Batcher::commit_with_updates`](crate::sched::Batcher::commit_with_updates)).
/// Cleared and refilled by each step; the two lists keep their capacity, so once they have
/// grown to a step's size filling them allocates nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepResults {
    /// One entry per sequence that got a token or ended this step.
    pub updates: Vec<SeqUpdate>,
    /// The tokens the updates' ranges index.
    pub tokens: Vec<u32>,
}

impl StepResults {
    /// Empties both lists, keeping their capacity.
    pub fn clear(&mut self) {
        self.updates.clear();
        self.tokens.clear();
    }

    /// The tokens of one update.
    ///
    /// # Panics
    /// If the update's range lies outside `tokens` (the engine's results never do; results a
    /// caller builds can: [`StreamRouter`](crate::sched::admission::StreamRouter) checks).
    pub fn tokens_of(&self, update: &SeqUpdate) -> &[u32] {
        &self.tokens[update.tokens.clone()]
    }
}

/// A finished sequence's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinishedSeq {
    /// The request's id.
    pub id: SeqId,
    /// Generated tokens.
    pub output: Vec<u32>,
    /// Why it finished.
    pub reason: FinishReason,
    /// How often it was preempted (by recompute or swap).
    pub preemptions: u32,
}

/// Where a sequence is in its life cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqPhase {
    /// Queued; holds no blocks.
    Waiting,
    /// Running, some prompt tokens not yet in the cache (chunked prefill).
    Prefilling,
    /// Running, generating one token per step.
    Decoding,
    /// Preempted by swap: its blocks live in host swap space.
    Swapped,
}

/// One sequence inside a batcher.
#[derive(Debug)]
pub(crate) struct Sequence {
    pub(crate) id: SeqId,
    pub(crate) priority: Priority,
    pub(crate) stop: StopRules,
    /// Prompt then generated tokens.
    pub(crate) tokens: Vec<u32>,
    pub(crate) prompt_len: usize,
    /// Tokens whose K/V are in the cache (a prefix of `tokens`).
    pub(crate) computed: usize,
    pub(crate) table: BlockTable,
    pub(crate) phase: SeqPhase,
    /// The running phase it left when last swapped out (`Prefilling` or `Decoding`), restored
    /// by its swap-in.
    pub(crate) swapped_from: SeqPhase,
    /// Admission order; later arrivals are preempted first.
    pub(crate) arrival: u64,
    /// Host swap slots holding its blocks while swapped, in logical order.
    pub(crate) host_blocks: Vec<u32>,
    pub(crate) preemptions: u32,
    /// Whether its table may hold blocks shared with another sequence (it was forked, or is a
    /// fork): only then must a write check for copy-on-write.
    pub(crate) may_share: bool,
    /// Leading blocks of its table already written in the batch's block-table row it last
    /// occupied (valid only while that row's owner is still this sequence's slot); reset to 0
    /// whenever the table changes other than by appending.
    pub(crate) row_blocks: u32,
    /// Draft tokens proposed for the next step (speculative decoding), verified and then
    /// cleared by the commit of the step that schedules them; never part of `tokens` before.
    pub(crate) drafts: Vec<u32>,
    /// The request's prefix-cache salt: it shares cached blocks only with requests of the
    /// same salt.
    pub(crate) salt: u64,
    /// Leading blocks already hashed (and offered to the prefix cache).
    pub(crate) hashed: u32,
    /// The hash of the last hashed block (`None`: none hashed yet).
    pub(crate) parent: Option<crate::prefix::BlockHash>,
}

impl Sequence {
    pub(crate) fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// The finish reason after appending a token, if any.
    pub(crate) fn stop_reason(&self, token: u32) -> Option<FinishReason> {
        if !self.stop.eos.is_empty() && self.stop.eos.contains(&token) {
            return Some(FinishReason::Eos);
        }
        if !self.stop.stop_sequences.is_empty() {
            let output = &self.tokens[self.prompt_len..];
            if self
                .stop
                .stop_sequences
                .iter()
                .any(|s| !s.is_empty() && output.ends_with(s))
            {
                return Some(FinishReason::StopSequence);
            }
        }
        if self.generated() >= self.stop.max_new_tokens as usize {
            return Some(FinishReason::MaxTokens);
        }
        None
    }
}
