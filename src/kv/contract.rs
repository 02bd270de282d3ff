//! The kernel contract: what the CPU kernels ([`crate::attn::cpu`]) and their CUDA twins
//! (`crate::cuda`) take besides the cache, and the one validation of it both run before they
//! touch memory. It sits on this floor, below both, so the CUDA layer does not depend on the
//! CPU oracle.

use super::layout::KvCacheConfig;
use crate::error::AttnError;

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

/// Elements of one query / output row: `num_heads * head_dim`, refused where it overflows (a
/// head count from a caller is not bounded by any buffer until it is multiplied out).
pub(crate) fn row_elems(num_heads: usize, head_dim: usize) -> Result<usize, AttnError> {
    num_heads.checked_mul(head_dim).ok_or(AttnError::BadParam {
        what: "num_heads x head_dim overflows",
    })
}

/// Elements of `rows` rows of `row` elements, refused where it overflows.
pub(crate) fn elems_of(rows: usize, row: usize) -> Result<usize, AttnError> {
    rows.checked_mul(row).ok_or(AttnError::BadParam {
        what: "rows x (num_heads x head_dim) overflows",
    })
}

pub(crate) fn check_len(
    what: &'static str,
    expected: usize,
    found: usize,
) -> Result<(), AttnError> {
    if expected != found {
        return Err(AttnError::LengthMismatch {
            what,
            expected,
            found,
        });
    }
    Ok(())
}

/// Validates what decode and prefill share; returns the GQA group size
/// (`num_heads / num_kv_heads`).
pub(crate) fn check_params(
    cfg: &KvCacheConfig,
    seqs: &PagedSeqs<'_>,
    params: &AttnParams<'_>,
) -> Result<usize, AttnError> {
    let (nh, nkv) = (params.num_heads, cfg.num_kv_heads());
    if nh == 0 || nh % nkv != 0 {
        return Err(AttnError::HeadsNotMultiple {
            num_heads: nh,
            num_kv_heads: nkv,
        });
    }
    if !params.scale.is_finite() {
        return Err(AttnError::BadParam {
            what: "scale is not finite",
        });
    }
    if !(params.softcap.is_finite() && params.softcap >= 0.0) {
        return Err(AttnError::BadParam {
            what: "softcap is negative or not finite",
        });
    }
    if let Some(slopes) = params.alibi_slopes {
        check_len("alibi_slopes", nh, slopes.len())?;
        if slopes.iter().any(|x| !x.is_finite()) {
            return Err(AttnError::BadParam {
                what: "an ALiBi slope is not finite",
            });
        }
    }
    check_seqs(cfg, seqs)?;
    Ok(nh / nkv)
}

/// Validates a batch's block tables and context lengths against the cache geometry (the
/// table's shape, each context within its row, every live block id in range); returns the
/// largest context length. The CUDA wrappers run the same checks before a launch.
pub(crate) fn check_seqs(cfg: &KvCacheConfig, seqs: &PagedSeqs<'_>) -> Result<usize, AttnError> {
    let num_seqs = seqs.num_seqs();
    let mbps = seqs.max_blocks_per_seq;
    let table_len = num_seqs
        .checked_mul(mbps)
        .ok_or(AttnError::LengthMismatch {
            what: "block_tables",
            expected: usize::MAX,
            found: seqs.block_tables.len(),
        })?;
    check_len("block_tables", table_len, seqs.block_tables.len())?;
    let capacity = mbps.saturating_mul(cfg.block_size());
    let mut max_ctx = 0usize;
    for (seq, &ctx) in seqs.context_lens.iter().enumerate() {
        if ctx < 0 || ctx as usize > capacity {
            return Err(AttnError::ContextLen {
                seq,
                context_len: ctx as i64,
                capacity,
            });
        }
        let live = cfg.blocks_for_tokens(ctx as usize);
        let row = &seqs.block_tables[seq * mbps..seq * mbps + live];
        for (index, &block) in row.iter().enumerate() {
            if block < 0 || block as usize >= cfg.num_blocks() {
                return Err(AttnError::BlockOutOfRange {
                    seq,
                    index,
                    block,
                    num_blocks: cfg.num_blocks(),
                });
            }
        }
        max_ctx = max_ctx.max(ctx as usize);
    }
    Ok(max_ctx)
}

/// Validates a slot mapping against the cache: every slot is `-1` (no write) or in
/// `0..num_blocks * block_size`. The CPU kernel's check, which the CUDA paths run before a
/// launch too.
pub(crate) fn check_slots(cfg: &KvCacheConfig, slot_mapping: &[i64]) -> Result<(), AttnError> {
    let num_slots = cfg.num_blocks() * cfg.block_size();
    for (token, &slot) in slot_mapping.iter().enumerate() {
        if slot != -1 && !(0..num_slots as i64).contains(&slot) {
            return Err(AttnError::SlotOutOfRange {
                token,
                slot,
                num_slots,
            });
        }
    }
    Ok(())
}

/// Validates `query_start_loc` for `seqs` (prefill's contract): `num_seqs + 1` entries from 0,
/// non-decreasing, no row longer than its context; returns the number of tokens.
pub(crate) fn check_query_starts(
    query_start_loc: &[i32],
    seqs: &PagedSeqs<'_>,
) -> Result<usize, AttnError> {
    let num_seqs = seqs.num_seqs();
    check_len("query_start_loc", num_seqs + 1, query_start_loc.len())?;
    if query_start_loc[0] != 0 {
        return Err(AttnError::QueryStartLoc { seq: 0 });
    }
    for s in 0..num_seqs {
        let (a, b) = (query_start_loc[s], query_start_loc[s + 1]);
        if b < a {
            return Err(AttnError::QueryStartLoc { seq: s });
        }
        let (q_len, context_len) = ((b - a) as usize, seqs.context_lens[s] as usize);
        if q_len > context_len {
            return Err(AttnError::QueryLongerThanContext {
                seq: s,
                q_len,
                context_len,
            });
        }
    }
    Ok(query_start_loc[num_seqs] as usize)
}
