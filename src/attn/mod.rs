//! Grouped-query paged attention and KV-cache kernels on the CPU: the fallback path and the
//! oracle every CUDA kernel is tested against.
//!
//! The kernels live in [`cpu`]; this module holds what they share with their CUDA twins: the
//! batch view ([`PagedSeqs`]), the attention parameters ([`AttnParams`]) and the reusable
//! scratch memory ([`AttnWorkspace`]). The cache layout they read is [`crate::kv::layout`].
//!
//! # Attention semantics (CPU and CUDA alike)
//!
//! For query head `h` (`0..num_heads`) of a query token at position `q_pos`, KV head
//! `kh = h / (num_heads / num_kv_heads)` (grouped-query attention), and every key position
//! `k_pos` in `0..=q_pos` of the sequence:
//!
//! ```text
//! s      = scale * dot(q[h], K[kh][k_pos])          f32 accumulation
//! s      = softcap * tanh(s / softcap)              only if softcap > 0
//! s      = s + alibi_slopes[h] * (k_pos - q_pos)    only with ALiBi (bias <= 0)
//! key visible iff k_pos <= q_pos and (window == 0 or q_pos - k_pos < window)
//! p      = softmax over visible keys of s           f32, max-subtracted
//! out[h] = sum over visible keys of p * V[kh][k_pos]   f32, rounded once to the dtype
//! ```
//!
//! Order: **scale, then soft-cap, then ALiBi, then mask** (the order of FlashAttention-2's
//! soft-capping). The query position of a decode token is `context_len - 1`; of prefill token
//! `i` of a sequence with `q_len` new tokens, `context_len - q_len + i`. The key at `q_pos`
//! itself is always visible, so every softmax has at least one term; a decode sequence with
//! `context_len == 0` (batch padding) gets an all-zero output row.

pub mod cpu;

/// The per-sequence part of a batch that attention reads: block tables and context lengths,
/// exactly the scheduler's flat `Batch` tensors.
#[derive(Debug, Clone, Copy)]
pub struct PagedSeqs<'a> {
    /// `[num_seqs, max_blocks_per_seq]` row-major, dense block indices. Row `s` entries
    /// `0..ceil(context_lens[s] / block_size)` are read and must be in `0..num_blocks`; entries
    /// past them are padding and never read.
    pub block_tables: &'a [i32],
    /// Columns of `block_tables`.
    pub max_blocks_per_seq: usize,
    /// `[num_seqs]`: tokens of each sequence in the cache, **including** this step's new tokens
    /// (`reshape_and_cache` runs first). `num_seqs` is `context_lens.len()`.
    pub context_lens: &'a [i32],
}

impl PagedSeqs<'_> {
    /// Sequences in the batch.
    #[inline]
    pub fn num_seqs(&self) -> usize {
        self.context_lens.len()
    }
}

/// Attention parameters shared by decode and prefill.
#[derive(Debug, Clone, Copy)]
pub struct AttnParams<'a> {
    /// Query heads; a positive multiple of the cache's `num_kv_heads`.
    pub num_heads: usize,
    /// Multiplier of `q·k` (typically `1/sqrt(head_dim)`); finite.
    pub scale: f32,
    /// `[num_heads]` ALiBi slopes: bias `slope * (k_pos - q_pos)` added after soft-capping.
    pub alibi_slopes: Option<&'a [f32]>,
    /// Sliding window in tokens: key visible iff `q_pos - k_pos < sliding_window`; 0 = off.
    pub sliding_window: usize,
    /// Logit soft-cap: `softcap * tanh(s / softcap)` applied to the scaled logit; 0 = off;
    /// finite and non-negative.
    pub softcap: f32,
}

impl AttnParams<'_> {
    /// Plain attention: `scale = 1/sqrt(head_dim)`, no ALiBi, no window, no soft-cap.
    pub fn new(num_heads: usize, head_dim: usize) -> Self {
        Self {
            num_heads,
            scale: 1.0 / (head_dim as f32).sqrt(),
            alibi_slopes: None,
            sliding_window: 0,
            softcap: 0.0,
        }
    }
}

/// Reusable scratch memory of the attention kernels. Keep one per engine thread and pass it to
/// every call: after the first calls of the largest shape it never allocates again.
#[derive(Debug, Default)]
pub struct AttnWorkspace {
    /// `f32` scratch, split into per-task slots (widened queries, accumulators, scores).
    scratch: Vec<f32>,
    /// Work items of the current call (sequence, KV head or query tile, cost prefix).
    items: Vec<cpu::WorkItem>,
}

impl AttnWorkspace {
    /// An empty workspace (it grows on first use).
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes currently reserved.
    pub fn capacity_bytes(&self) -> usize {
        self.scratch.capacity() * std::mem::size_of::<f32>()
            + self.items.capacity() * std::mem::size_of::<cpu::WorkItem>()
    }
}
