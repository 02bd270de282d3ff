//! The output of one scheduling step: everything the kernels need, in flat reusable buffers.

use super::sequence::SeqId;

/// One step's work, ready for the kernels. Buffers are reused across steps (cleared, never
/// shrunk), so filling the batch allocates nothing once they have grown to the step's size.
/// A decode step as a whole still allocates now and then: each sequence's tokens (its
/// request's prompt `Vec`, to which every sampled token is appended) grow by doubling. A
/// prompt `Vec` given capacity for the request's output (`prompt.len() + max_new_tokens`)
/// never grows, and a decode step of such sequences (no admission, end or preemption)
/// allocates nothing (tests/doc_claims.rs).
///
/// The caller runs, in this order: `swap_out`, `swap_in`, `copies`, then the model with
/// `reshape_and_cache` over `slot_mapping` and attention over `block_tables` / `context_lens`.
/// (Blocks freed by a swap-out may be reused by a swap-in or new tokens of the same step, so the
/// swap-out must come first; host slots freed by a swap-in are only reused from the next step.)
#[derive(Debug, Default, Clone)]
pub struct Batch {
    /// The scheduled sequences, in row order.
    pub seq_ids: Vec<SeqId>,
    /// Flattened input token ids of every row, `[num_tokens]`.
    pub input_tokens: Vec<u32>,
    /// Position of each input token in its sequence, `[num_tokens]`.
    pub positions: Vec<i32>,
    /// Row `s`'s tokens are `query_start_loc[s]..query_start_loc[s+1]`, `[num_seqs + 1]`.
    pub query_start_loc: Vec<i32>,
    /// Tokens in the cache for each row once this step's tokens are written, `[num_seqs]`.
    pub context_lens: Vec<i32>,
    /// Cache slot of each input token (`block * block_size + offset`), -1 for padding,
    /// `[num_tokens]`.
    pub slot_mapping: Vec<i64>,
    /// Flat `[num_seqs, max_blocks_per_seq]` physical block ids. Entries past a row's blocks
    /// (`context_lens[s].div_ceil(block_size)`) are unspecified and never read by the kernels.
    pub block_tables: Vec<i32>,
    /// Width of a `block_tables` row.
    pub max_blocks_per_seq: usize,
    /// Whether row `s` produces logits (its last token is the last token of its sequence), and
    /// so expects sampled tokens in `commit`: one, or one per draft token plus one.
    pub samples: Vec<bool>,
    /// Index into the flattened tokens of each token that needs logits, `[num_samples]`: each
    /// sampling row's last token, and before it the tokens its drafts follow (`drafts`).
    pub logits_indices: Vec<i32>,
    /// Whether row `s` is a prefill: more than one new token (a decode with drafts included),
    /// or any chunk of a prompt (a one-token last chunk included).
    pub is_prefill: Vec<bool>,
    /// Draft tokens (speculative decoding) at the end of row `s`'s tokens, `[num_seqs]`: a
    /// sampling row with `d` drafts has `d + 1` entries in `logits_indices` (its last `d + 1`
    /// tokens) and expects `d + 1` sampled tokens in `commit`.
    pub drafts: Vec<u32>,
    /// Copy-on-write block copies `(src, dst)` to run first (all layers).
    pub copies: Vec<(i32, i32)>,
    /// Device-to-host swaps `(device block, host slot)`.
    pub swap_out: Vec<(i32, i32)>,
    /// Host-to-device swaps `(host slot, device block)`.
    pub swap_in: Vec<(i32, i32)>,
}

impl Batch {
    /// Rows (scheduled sequences).
    #[inline]
    pub fn num_seqs(&self) -> usize {
        self.seq_ids.len()
    }

    /// Input tokens over all rows.
    #[inline]
    pub fn num_tokens(&self) -> usize {
        self.input_tokens.len()
    }

    /// Rows that sample a token.
    #[inline]
    pub fn num_samples(&self) -> usize {
        self.logits_indices.len()
    }

    /// Whether nothing was scheduled and nothing must be copied.
    pub fn is_empty(&self) -> bool {
        self.seq_ids.is_empty()
            && self.copies.is_empty()
            && self.swap_out.is_empty()
            && self.swap_in.is_empty()
    }

    pub(crate) fn clear(&mut self) {
        self.seq_ids.clear();
        self.input_tokens.clear();
        self.positions.clear();
        self.query_start_loc.clear();
        self.query_start_loc.push(0);
        self.context_lens.clear();
        self.slot_mapping.clear();
        // `block_tables` keeps its length: rows are rewritten where they hold blocks and the
        // rest is unspecified padding, so refilling it every step would be wasted work.
        self.max_blocks_per_seq = 0;
        self.samples.clear();
        self.logits_indices.clear();
        self.is_prefill.clear();
        self.drafts.clear();
        self.copies.clear();
        self.swap_out.clear();
        self.swap_in.clear();
    }
}
