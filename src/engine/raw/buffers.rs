//! The device buffers of a [`RawBackend`](super::RawBackend) for one set of capacities: the
//! metadata block (and its layout, shared with the host staging buffer), the attention output
//! and the decode plan's workspace.

use super::{RawCaps, RawDevice};
use crate::cuda_raw::{CacheView, DecodeMode, DecodePlan, DevPtr, Workspace};
use crate::error::{EngineError, RawError};

/// Byte offsets of the metadata arrays in the device block (and the host staging buffer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct MetaLayout {
    /// `[max_tokens]` i64 at 0.
    pub(super) slots: usize,
    /// `[max_seqs + 1]` i32.
    pub(super) query_start: usize,
    /// `[max_seqs]` i32.
    pub(super) ctx: usize,
    /// `[max_seqs * max_blocks_per_seq]` i32 (a step uses its own row width).
    pub(super) tables: usize,
    /// `[max_copies][2]` i32.
    pub(super) copies: usize,
    pub(super) total: usize,
}

impl MetaLayout {
    pub(super) fn new(c: &RawCaps) -> Option<Self> {
        let up = |x: usize| x.checked_add(15).map(|v| v & !15);
        let query_start = up(c.max_tokens.checked_mul(8)?)?;
        let ctx = up(query_start.checked_add(c.max_seqs.checked_add(1)?.checked_mul(4)?)?)?;
        let tables = up(ctx.checked_add(c.max_seqs.checked_mul(4)?)?)?;
        let table_bytes = c
            .max_seqs
            .checked_mul(c.max_blocks_per_seq)?
            .checked_mul(4)?;
        let copies = up(tables.checked_add(table_bytes)?)?;
        let total = up(copies.checked_add(c.max_copies.checked_mul(8)?)?)?.max(16);
        Some(Self {
            slots: 0,
            query_start,
            ctx,
            tables,
            copies,
            total,
        })
    }
}

/// Device allocations of one capacity: metadata, attention output, decode workspace.
#[derive(Debug)]
pub(super) struct Buffers {
    pub(super) caps: RawCaps,
    pub(super) layout: MetaLayout,
    pub(super) meta: DevPtr,
    pub(super) out: DevPtr,
    pub(super) plan: DecodePlan,
    pub(super) workspace: Workspace,
}

impl Buffers {
    pub(super) fn allocate<D: RawDevice>(
        dev: &D,
        cache: &CacheView,
        heads: usize,
        mode: DecodeMode,
        caps: RawCaps,
    ) -> Result<Self, EngineError> {
        let cfg = &cache.config;
        let context = caps
            .max_blocks_per_seq
            .checked_mul(cfg.block_size())
            .ok_or_else(|| over("max_blocks_per_seq", caps.max_blocks_per_seq))?;
        let plan = DecodePlan::for_dtype(
            mode,
            cfg.dtype(),
            caps.max_seqs,
            heads,
            cfg.num_kv_heads(),
            cfg.head_dim(),
            context,
            dev.sm_count().max(1),
        )?;
        let layout = MetaLayout::new(&caps).ok_or_else(|| over("metadata bytes", caps.max_seqs))?;
        let out_bytes = caps
            .max_tokens
            .checked_mul(heads * cfg.head_dim() * cfg.dtype().size_bytes())
            .ok_or_else(|| over("max_tokens", caps.max_tokens))?;
        dev.bind()?;
        let meta = dev.alloc(layout.total)?;
        let rest = (|| {
            let out = dev.alloc(out_bytes)?;
            let workspace = match plan.workspace_bytes() {
                0 => Workspace::NONE,
                bytes => match dev
                    .alloc(bytes)
                    .and_then(|ptr| zero_counters(dev, ptr, &plan).map(|()| ptr))
                {
                    Ok(ptr) => Workspace { ptr, bytes },
                    Err(e) => {
                        // SAFETY: just allocated; nothing queued uses it (zero_counters waits
                        // for its copy, and frees the workspace itself when that fails).
                        unsafe { dev.free(out) };
                        return Err(e);
                    }
                },
            };
            Ok((out, workspace))
        })();
        let (out, workspace) = match rest {
            Ok(r) => r,
            Err(e) => {
                // SAFETY: just allocated, never used.
                unsafe { dev.free(meta) };
                return Err(e);
            }
        };
        Ok(Buffers {
            caps,
            layout,
            meta,
            out,
            plan,
            workspace,
        })
    }
}

/// Zeroes the split merge's counters at the head of a new workspace (the plan's contract: each
/// launch leaves them zero, so once per allocation). On failure the workspace is freed.
fn zero_counters<D: RawDevice>(dev: &D, ws: DevPtr, plan: &DecodePlan) -> Result<(), EngineError> {
    let zeros = vec![0u8; plan.counter_bytes()];
    if zeros.is_empty() {
        return Ok(());
    }
    // SAFETY: `ws` holds workspace_bytes >= counter_bytes bytes from `dev.alloc`; `zeros` lives
    // until the synchronize below has returned.
    let done = unsafe { dev.copy_to_device(ws, &zeros) }.and_then(|()| dev.synchronize());
    if done.is_err() {
        // SAFETY: allocated by the caller just now; the copy failed or was waited for.
        unsafe { dev.free(ws) };
    }
    done
}

/// Frees a capacity's buffers.
///
/// # Safety
/// They came from `dev`, are freed once, and no queued work uses them.
pub(super) unsafe fn free_buffers<D: RawDevice>(dev: &D, b: &Buffers) {
    // SAFETY: the caller's contract.
    unsafe {
        dev.free(b.meta);
        dev.free(b.out);
        if b.workspace.bytes > 0 {
            dev.free(b.workspace.ptr);
        }
    }
}

pub(super) fn over(what: &'static str, value: usize) -> EngineError {
    EngineError::Raw(RawError::Unsupported { what, value })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every region starts on the 16-byte grid, holds its capacity, and ends at or before the
    /// next region; sizes that overflow are refused, not wrapped.
    #[test]
    fn metadata_regions_are_aligned_disjoint_and_large_enough() {
        for max_seqs in [1, 2, 3, 7, 64, 257] {
            for max_tokens in [1, 5, 96, 8191] {
                for max_blocks_per_seq in [1, 3, 24, 1000] {
                    for max_copies in [0, 1, 9] {
                        let c = RawCaps {
                            max_seqs,
                            max_tokens,
                            max_blocks_per_seq,
                            max_copies,
                        };
                        let l = MetaLayout::new(&c).unwrap();
                        let regions = [
                            (l.slots, 8 * max_tokens),
                            (l.query_start, 4 * (max_seqs + 1)),
                            (l.ctx, 4 * max_seqs),
                            (l.tables, 4 * max_seqs * max_blocks_per_seq),
                            (l.copies, 8 * max_copies),
                        ];
                        for w in regions.windows(2) {
                            let ((start, len), (next, _)) = (w[0], w[1]);
                            assert_eq!(start % 16, 0, "{c:?}");
                            assert!(start + len <= next, "{c:?}: regions overlap");
                        }
                        let (last, len) = regions[4];
                        assert!(last % 16 == 0 && last + len <= l.total && l.total % 16 == 0);
                    }
                }
            }
        }
        let huge = RawCaps {
            max_seqs: usize::MAX / 2,
            max_tokens: 1,
            max_blocks_per_seq: 4,
            max_copies: 0,
        };
        assert_eq!(MetaLayout::new(&huge), None);
    }
}
