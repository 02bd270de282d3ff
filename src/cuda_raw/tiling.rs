//! How the f16 / bf16 prefill kernel tiles its query rows (`PKV_PREFILL_TILING_*` and
//! `pkv_paged_attention_prefill_tiled` in kernels/pagedkv.h).

use super::check::{check_status, dtype_abi, i32_of, SUPPORTED_HEAD_DIMS};
use super::ffi;
use crate::error::RawError;
use crate::kv::KvCacheConfig;

/// The f16 / bf16 prefill kernel's tiling of the query rows. Results agree whichever is chosen
/// up to the cache type's rounding, not f32's: the tensor-core tilings round the probabilities
/// P to f16 / bf16 before `P V`, relative to a running maximum that depends on the rows and
/// key tiles a thread block holds (kernels/prefill_mma.cuh). f32 caches have one kernel and
/// ignore the choice, and a tiling a launch cannot run (below) runs
/// [`PrefillTiling::WarpRows16`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillTiling {
    /// The library's choice ([`PrefillTiling::resolve`] says which): on compute capability
    /// 9.0 at head dims up to 128, [`PrefillTiling::Wgmma128`] where its 128-row thread
    /// blocks cover half the SMs, else [`PrefillTiling::Wgmma`]; elsewhere
    /// [`PrefillTiling::WarpRows32`] where its blocks fill the device's resident slots, else
    /// [`PrefillTiling::WarpRows16`] (measured on an H100, BENCHMARKS.md).
    #[default]
    Auto,
    /// One m16 tile per warp (mma.sync), 64 rows per thread block.
    WarpRows16,
    /// Two m16 tiles per warp (mma.sync), 128 rows per thread block: every K / V fragment a
    /// warp loads from shared memory feeds two tensor-core instructions (head dims up to 128,
    /// and where the device lets a block opt in to its shared memory: not head dim 128 on
    /// compute capability 8.6 / 8.9 / 12.x, whose 99 KiB it passes).
    WarpRows32,
    /// Hopper's warpgroup instruction (wgmma), which reads K and V straight from shared
    /// memory, one warpgroup of 64 rows per thread block: on a device of compute capability
    /// 9.0 with a build for sm_90, at head dims up to 128.
    Wgmma,
    /// [`PrefillTiling::Wgmma`] with two warpgroups (128 rows) per thread block sharing each
    /// K / V tile: half the L2 -> shared memory copies per query row.
    Wgmma128,
    /// [`PrefillTiling::Wgmma`] with the overlapped schedule: a tile's softmax runs while the
    /// previous tile's P V is on the tensor cores.
    WgmmaOverlap,
    /// [`PrefillTiling::Wgmma128`] with the overlapped schedule.
    Wgmma128Overlap,
    /// [`PrefillTiling::Wgmma128`] as a persistent grid: one thread block per resident slot,
    /// each running its share of the 128-row tiles back to back, the next one's Q, first key
    /// tile and row addresses copied while the current one's last tiles compute (head dims
    /// 80-128; at 64 it runs [`PrefillTiling::Wgmma128`]).
    Wgmma128Persistent,
}

impl PrefillTiling {
    /// Every tiling but [`PrefillTiling::Auto`]: what a launch can run (and a test or a bench
    /// can compare).
    pub const EXPLICIT: [PrefillTiling; 7] = [
        PrefillTiling::WarpRows16,
        PrefillTiling::WarpRows32,
        PrefillTiling::Wgmma,
        PrefillTiling::Wgmma128,
        PrefillTiling::WgmmaOverlap,
        PrefillTiling::Wgmma128Overlap,
        PrefillTiling::Wgmma128Persistent,
    ];

    /// The tiling a prefill launch over a cache of `config` with `num_heads` query heads,
    /// `num_seqs` sequences and `max_query_len` runs when `self` is asked
    /// (`pkv_prefill_tiling_choice`): never [`PrefillTiling::Auto`], and `None` for an f32
    /// cache, whose one kernel has no tilings. `sm_count` 0 asks the device current on this
    /// thread (Auto's choice depends on it); at head dim 128, whether
    /// [`PrefillTiling::WarpRows32`] fits its shared memory is asked of that device too. Host
    /// only, no launch.
    ///
    /// # Errors
    /// [`RawError::Unsupported`] for a head dim without a kernel or a size the C ABI cannot
    /// carry; [`RawError::Launch`] for `num_heads` not a positive multiple of the KV heads
    /// (`PKV_ERR_INVALID_ARG`) or a failed device query.
    pub fn resolve(
        self,
        config: &KvCacheConfig,
        num_heads: usize,
        num_seqs: usize,
        max_query_len: usize,
        sm_count: usize,
    ) -> Result<Option<PrefillTiling>, RawError> {
        if !SUPPORTED_HEAD_DIMS.contains(&config.head_dim()) {
            return Err(RawError::Unsupported {
                what: "head_dim",
                value: config.head_dim(),
            });
        }
        let mut chosen = -1i32;
        // SAFETY: `chosen` is a valid local the call writes on success; every other argument
        // is an integer; the call is host arithmetic plus, for sm_count 0, a runtime query
        // with no precondition (an error is a status).
        let status = unsafe {
            ffi::pkv_prefill_tiling_choice(
                &mut chosen,
                self.abi(),
                dtype_abi(config.dtype()),
                i32_of("num_heads", num_heads)?,
                i32_of("num_kv_heads", config.num_kv_heads())?,
                i32_of("head_dim", config.head_dim())?,
                i32_of("num_seqs", num_seqs)?,
                i32_of("max_query_len", max_query_len)?,
                i32_of("sm_count", sm_count)?,
            )
        };
        check_status("pkv_prefill_tiling_choice", status, None)?;
        Ok(Self::from_abi(chosen))
    }

    /// The tiling of a `PKV_PREFILL_TILING_*` value (`None`: Auto, or not one of them).
    fn from_abi(v: i32) -> Option<PrefillTiling> {
        Self::EXPLICIT.into_iter().find(|t| t.abi() == v)
    }

    pub(super) fn abi(self) -> i32 {
        (match self {
            PrefillTiling::Auto => ffi::PKV_PREFILL_TILING_AUTO,
            PrefillTiling::WarpRows16 => ffi::PKV_PREFILL_TILING_WARP16,
            PrefillTiling::WarpRows32 => ffi::PKV_PREFILL_TILING_WARP32,
            PrefillTiling::Wgmma => ffi::PKV_PREFILL_TILING_WGMMA,
            PrefillTiling::Wgmma128 => ffi::PKV_PREFILL_TILING_WGMMA128,
            PrefillTiling::WgmmaOverlap => ffi::PKV_PREFILL_TILING_WGMMA_OVERLAP,
            PrefillTiling::Wgmma128Overlap => ffi::PKV_PREFILL_TILING_WGMMA128_OVERLAP,
            PrefillTiling::Wgmma128Persistent => ffi::PKV_PREFILL_TILING_WGMMA128_PERSISTENT,
        }) as i32
    }
}
