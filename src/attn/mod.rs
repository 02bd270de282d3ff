//! Grouped-query paged attention and KV-cache kernels on the CPU: the fallback path and the
//! oracle every CUDA kernel is tested against.
//!
//! The kernels live in [`cpu`], with their reusable scratch memory ([`AttnWorkspace`]). What
//! they share with their CUDA twins, the batch view ([`PagedSeqs`](crate::kv::PagedSeqs)), the attention parameters
//! ([`AttnParams`](crate::kv::AttnParams)) and their validation, is the kernel contract in [`crate::kv`], below both;
//! the cache layout they read is [`KvCacheConfig`](crate::kv::KvCacheConfig).
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
//! s      = s + alibi_slopes[h] * (k_pos - q_pos)    only with ALiBi (bias <= 0 for the usual positive slopes)
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
//!
//! Non-finite inputs: a NaN or +inf score (a NaN key or query; an infinite key, inf - inf in
//! the max trick) makes its row NaN. A score of -inf takes no weight; a row whose every visible score is -inf has nothing to
//! attend to and is all zero, like padding, rather than the formula's 0 / 0. The CUDA kernels
//! follow both rules. A key of weight 0 (masked, a -inf score, or a weight that underflows)
//! contributes nothing whatever its value, row by row: an infinite or NaN value reaches only
//! the rows that give it weight, never the tokens before it in a prefill chunk nor a head that
//! scores it -inf, nor a row whose later, larger score (more than ~87.3 above its own: the CPU
//! kernels' exp gives 0, not a subnormal, below `ln(f32::MIN_POSITIVE)`) makes its weight
//! underflow after the walk has reached it (the CPU kernels then drop the accumulated sum
//! instead of rescaling it by 0, and recompute a row that rescales left non-finite with each
//! key's final weight, for a max that grew in several smaller steps).
//! The CUDA kernels do not follow this one yet: the prefill kernels multiply every key of a
//! loaded tile by its weight, masked ones included, every kernel a key of -inf score, and
//! every kernel rescales its running sum by a factor that underflows to 0 (the split decode's
//! merge excepted), `0 * inf = NaN` (tests/cuda_emu.rs,
//! `a_key_of_weight_zero_with_an_infinite_value_leaves_the_row_as_the_oracle_has_it` and
//! `a_value_whose_weight_underflows_later_leaves_the_row_as_the_oracle_has_it`, ignored).

pub mod cpu;
mod lanes;
mod walk;

/// Reusable scratch memory of the attention kernels. Keep one per engine thread and pass it to
/// every call: after the first calls of the largest shape it never allocates again.
#[derive(Debug, Default)]
pub struct AttnWorkspace {
    /// `f32` scratch, split into per-task slots (widened queries, accumulators, scores).
    scratch: Vec<f32>,
    /// Work items of the current call (sequence and run of KV heads, or query tile; cost prefix).
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
