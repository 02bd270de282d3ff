//! Host-side checks of the raw launches: the CUDA kernels' geometry, query/out/key/value views,
//! attention parameters, and the launchers' status codes as typed errors. Everything the C
//! launchers would refuse is refused here first with a precise error; the launchers check
//! again (they are a C ABI of their own).

use super::ffi;
use super::{AttnParamsRaw, CacheView, DevPtr, Rows};
use crate::error::{AttnError, KvError, RawError};
use crate::kv::{KvCacheConfig, KvDtype};
use std::ffi::CStr;

/// Head dims the CUDA kernels are instantiated for.
pub const SUPPORTED_HEAD_DIMS: [usize; 6] = [64, 80, 96, 112, 128, 256];
/// Block sizes (tokens per block) the CUDA kernels accept: every power of two from 8 to 256.
pub const SUPPORTED_BLOCK_SIZES: [usize; 6] = [8, 16, 32, 64, 128, 256];

/// Bytes the attention kernels' vector loads need query and out views aligned to.
pub const VIEW_ALIGN: usize = 16;

/// `v` as the C ABI's `int32_t`, or [`RawError::Unsupported`] naming it.
pub(crate) fn i32_of(what: &'static str, v: usize) -> Result<i32, RawError> {
    i32::try_from(v).map_err(|_| RawError::Unsupported { what, value: v })
}

/// The C ABI's `PKV_DTYPE_*` of `dtype`.
pub(super) fn dtype_abi(dtype: KvDtype) -> i32 {
    (match dtype {
        KvDtype::F32 => ffi::PKV_DTYPE_F32,
        KvDtype::F16 => ffi::PKV_DTYPE_F16,
        KvDtype::Bf16 => ffi::PKV_DTYPE_BF16,
    }) as i32
}

/// The launchers' geometry of `config`, or why the CUDA kernels cannot take it.
///
/// # Errors
/// [`RawError::Unsupported`] for a head dim or block size without a kernel, or a size beyond
/// what the C ABI carries.
pub fn geometry(config: &KvCacheConfig) -> Result<ffi::pkv_cache_geometry, RawError> {
    if !SUPPORTED_HEAD_DIMS.contains(&config.head_dim()) {
        return Err(RawError::Unsupported {
            what: "head_dim",
            value: config.head_dim(),
        });
    }
    if !SUPPORTED_BLOCK_SIZES.contains(&config.block_size()) {
        return Err(RawError::Unsupported {
            what: "block_size",
            value: config.block_size(),
        });
    }
    Ok(ffi::pkv_cache_geometry {
        num_blocks: i32_of("num_blocks", config.num_blocks())?,
        num_layers: i32_of("num_layers", config.num_layers())?,
        block_size: i32_of("block_size", config.block_size())?,
        num_kv_heads: i32_of("num_kv_heads", config.num_kv_heads())?,
        head_dim: i32_of("head_dim", config.head_dim())?,
        dtype: dtype_abi(config.dtype()),
        // The config's invariant bounds num_blocks * page bytes by isize::MAX: the stride
        // (elements, <= bytes) fits i64.
        block_stride: i64::try_from(config.block_stride()).map_err(|_| RawError::Unsupported {
            what: "page stride",
            value: config.block_stride(),
        })?,
    })
}

/// The geometry of a cache view and its layer index, checked: a non-null 16-byte aligned
/// base, a supported geometry, a layer in range.
pub(crate) fn cache_and_layer(
    cache: &CacheView,
    layer: usize,
) -> Result<(ffi::pkv_cache_geometry, i32), RawError> {
    let geom = geometry(&cache.config)?;
    if layer >= cache.config.num_layers() {
        return Err(KvError::LayerOutOfRange {
            layer,
            num_layers: cache.config.num_layers(),
        }
        .into());
    }
    non_null("cache", cache.base)?;
    aligned("cache", cache.base, VIEW_ALIGN)?;
    Ok((geom, layer as i32))
}

pub(crate) fn non_null(what: &'static str, p: DevPtr) -> Result<(), RawError> {
    if p == 0 {
        return Err(RawError::NullPointer { what });
    }
    Ok(())
}

pub(crate) fn aligned(what: &'static str, p: DevPtr, align: usize) -> Result<(), RawError> {
    if p % align as u64 != 0 {
        return Err(RawError::Misaligned { what, align });
    }
    Ok(())
}

/// A view of `row`-element rows of `elem`-byte elements: non-null, stride >= row, pointer and
/// stride in bytes multiples of `align`. Returns the stride as the ABI's i64.
pub(crate) fn rows(
    what: &'static str,
    v: Rows,
    row: usize,
    elem: usize,
    align: usize,
) -> Result<i64, RawError> {
    non_null(what, v.ptr)?;
    if v.token_stride < row {
        return Err(RawError::StrideTooSmall {
            what,
            stride: v.token_stride,
            row,
        });
    }
    aligned(what, v.ptr, align)?;
    let bytes = v
        .token_stride
        .checked_mul(elem)
        .ok_or(RawError::Unsupported {
            what,
            value: v.token_stride,
        })?;
    if bytes % align != 0 {
        return Err(RawError::Misaligned { what, align });
    }
    i64::try_from(v.token_stride).map_err(|_| RawError::Unsupported {
        what,
        value: v.token_stride,
    })
}

/// The attention parameters as the ABI's struct, checked with the CPU kernels' rules for a
/// cache of `cfg` (the slopes' values live on the device: only their pointer is checked).
pub(crate) fn attn_params(
    cfg: &KvCacheConfig,
    p: &AttnParamsRaw,
) -> Result<ffi::pkv_attn_params, RawError> {
    let (nh, nkv) = (p.num_heads, cfg.num_kv_heads());
    if nh == 0 || nh % nkv != 0 {
        return Err(AttnError::HeadsNotMultiple {
            num_heads: nh,
            num_kv_heads: nkv,
        }
        .into());
    }
    if !p.scale.is_finite() {
        return Err(AttnError::BadParam {
            what: "scale is not finite",
        }
        .into());
    }
    if !(p.softcap.is_finite() && p.softcap >= 0.0) {
        return Err(AttnError::BadParam {
            what: "softcap is negative or not finite",
        }
        .into());
    }
    aligned("alibi_slopes", p.alibi_slopes, 4)?;
    Ok(ffi::pkv_attn_params {
        num_heads: i32_of("num_heads", nh)?,
        scale: p.scale,
        softcap: p.softcap,
        // A window beyond i32 is no window at all for contexts that fit i32.
        sliding_window: i32::try_from(p.sliding_window).unwrap_or(i32::MAX),
        alibi_slopes: p.alibi_slopes as usize as *const f32,
        launch_flags: if p.programmatic_launch {
            ffi::PKV_LAUNCH_PROGRAMMATIC as i32
        } else {
            0
        },
    })
}

/// The page size and block size a launch was given (for the typed page-stride errors).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PageArgs {
    /// Bytes from one block to the next.
    pub(crate) page_bytes: usize,
    /// Bytes of one block.
    pub(crate) block_bytes: usize,
}

impl PageArgs {
    /// The page of a cache view's geometry.
    pub(crate) fn of(config: &KvCacheConfig) -> Self {
        Self {
            page_bytes: config.page_bytes(),
            block_bytes: config.bytes_per_block(),
        }
    }
}

/// The launcher's description of a status (`pkv_status_string`).
pub fn status_message(status: i32) -> &'static str {
    // SAFETY: pkv_status_string returns a pointer to a static NUL-terminated string (a literal
    // or cudaGetErrorString's static table) for every int, never NULL; it has no side effects.
    let msg = unsafe { CStr::from_ptr(ffi::pkv_status_string(status)) };
    msg.to_str().unwrap_or("(non-UTF-8 message)")
}

/// Turns a launcher status (kernels/pagedkv.h) into a result. The page-stride refusals
/// (`PKV_ERR_PAGE_STRIDE`, `PKV_ERR_PAGE_ALIGN`) become the layout's own errors,
/// [`KvError::PageTooSmall`] and [`KvError::PageMisaligned`], when `page` says what the launch
/// was given; every other status is a [`RawError::Launch`].
pub(crate) fn check_status(
    op: &'static str,
    status: i32,
    page: Option<PageArgs>,
) -> Result<(), RawError> {
    if status == 0 {
        return Ok(());
    }
    if let Some(p) = page {
        if status == ffi::PKV_ERR_PAGE_STRIDE as i32 {
            return Err(KvError::PageTooSmall {
                page_bytes: p.page_bytes,
                block_bytes: p.block_bytes,
            }
            .into());
        }
        if status == ffi::PKV_ERR_PAGE_ALIGN as i32 {
            return Err(KvError::PageMisaligned {
                page_bytes: p.page_bytes,
                align: ffi::PKV_PAGE_ALIGN as usize,
            }
            .into());
        }
    }
    Err(RawError::Launch {
        op,
        status,
        message: status_message(status),
    })
}
