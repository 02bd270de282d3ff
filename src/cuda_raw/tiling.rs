//! How the f16 / bf16 prefill kernel tiles its query rows (`PKV_PREFILL_WARP_ROWS_AUTO` and
//! `pkv_paged_attention_prefill_tiled` in kernels/pagedkv.h).

use super::ffi;

/// Query rows per warp of the tensor-core prefill kernel. Results agree up to f32 rounding
/// whichever is chosen; f32 caches and head dim 256 have one tiling and ignore the choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillTiling {
    /// The library's choice: today [`PrefillTiling::WarpRows16`], the tiling measured on a
    /// GPU (BENCHMARKS.md).
    #[default]
    Auto,
    /// One m16 tile per warp, 64 rows per thread block.
    WarpRows16,
    /// Two m16 tiles per warp, 128 rows per thread block: every K / V fragment a warp loads
    /// from shared memory feeds two tensor-core instructions (up to head dim 128).
    WarpRows32,
}

impl PrefillTiling {
    pub(super) fn abi(self) -> i32 {
        match self {
            PrefillTiling::Auto => ffi::PKV_PREFILL_WARP_ROWS_AUTO as i32,
            PrefillTiling::WarpRows16 => 16,
            PrefillTiling::WarpRows32 => 32,
        }
    }
}
