//! The decode plan: the split-K partitioning of decode attention, fixed for a batch capacity
//! (`pkv_decode_plan_init` in kernels/pagedkv.h is the one place that chooses it; this is its
//! typed front).
//!
//! A plan fixes the grid, the shared memory and the workspace of every decode launch made with
//! it; the kernels derive each sequence's partitions on the device from its context length. So
//! a decode step captured in a CUDA graph replays correctly after the context lengths, block
//! tables and queries change in place: nothing the capture baked in depends on them. The
//! contract is described at the top of kernels/attention.cuh.

use super::check::{check_status, dtype_abi, i32_of};
use super::ffi;
use crate::error::RawError;
use crate::kv::KvDtype;

/// How decode attention partitions each sequence's context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeMode {
    /// One split when the batch capacity alone gives every SM `PKV_DECODE_CTAS_PER_SM` thread
    /// blocks (`PKV_DECODE_CTAS_PER_SM_MHA` for MHA), else enough splits to do so (partitions
    /// of at least `PKV_DECODE_MIN_PART` tokens at capacity, `PKV_DECODE_MIN_PART_MHA` for
    /// MHA); GQA fills every resident block slot in one wave where partitions keep
    /// `PKV_DECODE_FILL_PART` tokens; then up to 3 more splits when that leaves a fuller last
    /// wave (the default; kernels/pagedkv.h).
    #[default]
    Auto,
    /// One split per (sequence, KV head), no split merge and no workspace, whatever the context
    /// capacity (the kernels keep nothing per token in shared memory).
    SinglePass,
    /// At least two splits, partitions of at most `PKV_DECODE_PARTITION` (512) tokens at
    /// capacity, merged in the same launch by the last block of each (sequence, head chunk).
    SplitK,
    /// Exactly this many splits (1 ..= `PKV_DECODE_MAX_SPLITS`; 1 behaves as
    /// [`DecodeMode::SinglePass`]): for a caller that tunes the partitioning of its own batch
    /// shapes, and for measuring the policy (`pagedkv bench gpu --mode splits:N`).
    Splits(u32),
}

impl DecodeMode {
    fn abi(self) -> i32 {
        (match self {
            DecodeMode::Auto => ffi::PKV_DECODE_AUTO,
            DecodeMode::SinglePass => ffi::PKV_DECODE_SINGLE,
            DecodeMode::SplitK => ffi::PKV_DECODE_SPLIT,
            DecodeMode::Splits(_) => ffi::PKV_DECODE_FIXED,
        }) as i32
    }
}

/// A decode plan (`pkv_decode_plan`): made once per captured batch shape and kept beside the
/// graph, or made per launch by an eager caller (cheap: integer arithmetic on the host).
#[derive(Debug, Clone, Copy)]
pub struct DecodePlan {
    raw: ffi::pkv_decode_plan,
}

impl DecodePlan {
    /// The plan of `mode` for launches of at most `num_seqs_capacity` sequences whose contexts
    /// are at most `max_context_capacity` tokens, `num_heads` query heads over `num_kv_heads`
    /// KV heads of `head_dim`, on a device of `sm_count` SMs (used by [`DecodeMode::Auto`]; 0
    /// asks the device current on this thread), for f16 / bf16 caches
    /// ([`DecodePlan::for_dtype`]: any).
    ///
    /// # Errors
    /// [`RawError::Unsupported`] for a size beyond the C ABI; [`RawError::Launch`] with
    /// `PKV_ERR_INVALID_ARG` for a zero size, heads that do not divide, a capacity above 65535
    /// sequences, or one needing more than `PKV_DECODE_MAX_SPLITS` splits;
    /// `PKV_ERR_HEAD_DIM` for a head dim without a kernel; a CUDA status if the SM query fails;
    /// `PKV_ERR_INVALID_ARG` for [`DecodeMode::Splits`] of 0 or past `PKV_DECODE_MAX_SPLITS`.
    pub fn new(
        mode: DecodeMode,
        num_seqs_capacity: usize,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        max_context_capacity: usize,
        sm_count: usize,
    ) -> Result<Self, RawError> {
        Self::for_dtype(
            mode,
            KvDtype::Bf16,
            num_seqs_capacity,
            num_heads,
            num_kv_heads,
            head_dim,
            max_context_capacity,
            sm_count,
        )
    }

    /// [`DecodePlan::new`] for caches of `dtype`: [`DecodeMode::Auto`] sizes its splits by the
    /// resident thread blocks of the kernel body that dtype runs (f32 runs CUDA-core bodies
    /// that fit fewer blocks per SM than the f16 / bf16 tensor-core ones `new` assumes). A plan
    /// made for one dtype is valid for launches of another; only their speed may suffer.
    ///
    /// # Errors
    /// As [`DecodePlan::new`].
    #[allow(clippy::too_many_arguments)]
    pub fn for_dtype(
        mode: DecodeMode,
        dtype: KvDtype,
        num_seqs_capacity: usize,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        max_context_capacity: usize,
        sm_count: usize,
    ) -> Result<Self, RawError> {
        let mut raw = ffi::pkv_decode_plan::default();
        let seqs = i32_of("num_seqs_capacity", num_seqs_capacity)?;
        let heads = i32_of("num_heads", num_heads)?;
        let kv_heads = i32_of("num_kv_heads", num_kv_heads)?;
        let dim = i32_of("head_dim", head_dim)?;
        let cap = i32_of("max_context_capacity", max_context_capacity)?;
        let (call, status) = match mode {
            // SAFETY: `raw` is a valid local the call writes (on success only); every other
            // argument is an integer; the call is host arithmetic only.
            DecodeMode::Splits(n) => ("pkv_decode_plan_init_splits", unsafe {
                ffi::pkv_decode_plan_init_splits(
                    &mut raw,
                    i32::try_from(n).unwrap_or(i32::MAX),
                    seqs,
                    heads,
                    kv_heads,
                    dim,
                    cap,
                )
            }),
            // SAFETY: as above. With sm_count 0 and Auto, the call queries the current device
            // through the runtime, which has no precondition (an error is a status).
            _ => ("pkv_decode_plan_init_dtype", unsafe {
                ffi::pkv_decode_plan_init_dtype(
                    &mut raw,
                    mode.abi(),
                    dtype_abi(dtype),
                    seqs,
                    heads,
                    kv_heads,
                    dim,
                    cap,
                    i32::try_from(sm_count).unwrap_or(i32::MAX),
                )
            }),
        };
        check_status(call, status, None)?;
        Ok(Self { raw })
    }

    /// Most sequences of a launch (grid y).
    pub fn num_seqs_capacity(&self) -> usize {
        self.raw.num_seqs_capacity as usize
    }
    /// Query heads of every launch.
    pub fn num_heads(&self) -> usize {
        self.raw.num_heads as usize
    }
    /// KV heads of every launch.
    pub fn num_kv_heads(&self) -> usize {
        self.raw.num_kv_heads as usize
    }
    /// Head dim of every launch.
    pub fn head_dim(&self) -> usize {
        self.raw.head_dim as usize
    }
    /// Longest context a launch may carry (longer ones are clamped on the device).
    pub fn max_context_capacity(&self) -> usize {
        self.raw.max_context_capacity as usize
    }
    /// Splits per sequence (grid z); 1 means no split merge and no workspace.
    pub fn num_splits(&self) -> usize {
        self.raw.num_splits as usize
    }
    /// Device workspace bytes a launch needs (0 with one split).
    pub fn workspace_bytes(&self) -> usize {
        self.raw.workspace_bytes as usize
    }
    /// The workspace's leading bytes that hold the split merge's arrival counters (0 with one
    /// split). They must be zero before the first launch with this plan, and again after the
    /// workspace served another plan; every launch leaves them zero, so a workspace kept with
    /// its plan (a captured graph's) is zeroed once, when allocated.
    pub fn counter_bytes(&self) -> usize {
        self.raw.counter_bytes as usize
    }
    /// The mode it was made with.
    pub fn mode(&self) -> DecodeMode {
        match self.raw.mode as u32 {
            ffi::PKV_DECODE_SINGLE => DecodeMode::SinglePass,
            ffi::PKV_DECODE_SPLIT => DecodeMode::SplitK,
            ffi::PKV_DECODE_FIXED => DecodeMode::Splits(self.raw.num_splits as u32),
            _ => DecodeMode::Auto,
        }
    }
    /// The ABI's struct (for a caller of the C launcher).
    pub fn as_ffi(&self) -> &ffi::pkv_decode_plan {
        &self.raw
    }
}
