//! How the f16 / bf16 prefill kernel tiles its query rows (`PKV_PREFILL_TILING_*` and
//! `pkv_paged_attention_prefill_tiled` in kernels/pagedkv.h).

use super::ffi;

/// The f16 / bf16 prefill kernel's tiling of the query rows. Results agree up to f32 rounding
/// whichever is chosen; f32 caches have one kernel and ignore the choice, and a tiling a launch
/// cannot run (below) runs [`PrefillTiling::WarpRows16`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillTiling {
    /// The library's choice: today [`PrefillTiling::WarpRows16`], the tiling measured on a
    /// GPU (BENCHMARKS.md).
    #[default]
    Auto,
    /// One m16 tile per warp (mma.sync), 64 rows per thread block.
    WarpRows16,
    /// Two m16 tiles per warp (mma.sync), 128 rows per thread block: every K / V fragment a
    /// warp loads from shared memory feeds two tensor-core instructions (head dims up to 128).
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
}

impl PrefillTiling {
    pub(super) fn abi(self) -> i32 {
        (match self {
            PrefillTiling::Auto => ffi::PKV_PREFILL_TILING_AUTO,
            PrefillTiling::WarpRows16 => ffi::PKV_PREFILL_TILING_WARP16,
            PrefillTiling::WarpRows32 => ffi::PKV_PREFILL_TILING_WARP32,
            PrefillTiling::Wgmma => ffi::PKV_PREFILL_TILING_WGMMA,
            PrefillTiling::Wgmma128 => ffi::PKV_PREFILL_TILING_WGMMA128,
            PrefillTiling::WgmmaOverlap => ffi::PKV_PREFILL_TILING_WGMMA_OVERLAP,
            PrefillTiling::Wgmma128Overlap => ffi::PKV_PREFILL_TILING_WGMMA128_OVERLAP,
        }) as i32
    }
}
