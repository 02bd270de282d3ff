//! Guarded "device" buffers and ABI helpers shared by the tests of the kernels on the CPU
//! emulation (feature `cuda-emu`). Included by `#[path]` from each.
#![allow(dead_code)]

use pagedkv::cuda_emu::{self, ffi, EmuBuf, EmuElem};
use pagedkv::kv::{KvCacheConfig, KvDtype};
use std::ffi::c_void;

/// The f16 / bf16 prefill kernel's tilings (16 and 32 query rows per warp; wgmma with one
/// and two warpgroups, in order and overlapped; the persistent grid): every emulated prefill
/// check runs each.
pub const PREFILL_TILINGS: [u32; 7] = [
    ffi::PKV_PREFILL_TILING_WARP16,
    ffi::PKV_PREFILL_TILING_WARP32,
    ffi::PKV_PREFILL_TILING_WGMMA,
    ffi::PKV_PREFILL_TILING_WGMMA128,
    ffi::PKV_PREFILL_TILING_WGMMA_OVERLAP,
    ffi::PKV_PREFILL_TILING_WGMMA128_OVERLAP,
    ffi::PKV_PREFILL_TILING_WGMMA128_PERSISTENT,
];

/// A guarded copy of `data`.
pub fn buf<T: EmuElem>(data: &[T]) -> EmuBuf {
    EmuBuf::from_slice(data).expect("guarded allocation")
}

/// A buffer of `n` elements of T, every byte 0xFF (NaN in all three float types).
pub fn poisoned<T: EmuElem>(n: usize) -> EmuBuf {
    let mut b = EmuBuf::zeroed(n * std::mem::size_of::<T>()).expect("guarded allocation");
    b.as_mut_slice::<u8>().fill(0xff);
    b
}

/// A decode workspace of `bytes` (at least 1) as a caller prepares one: the split merge's
/// `counter_bytes` of arrival counters zeroed (the plan's contract), everything after them
/// poisoned, so a partial the launch did not write reads as NaN.
pub fn decode_workspace(bytes: usize, counter_bytes: usize) -> EmuBuf {
    let mut b = poisoned::<u8>(bytes.max(1));
    b.as_mut_slice::<u8>()[..counter_bytes].fill(0);
    b
}

pub fn null() -> *mut c_void {
    std::ptr::null_mut()
}

/// The ABI geometry of a cache configuration.
pub fn geometry(cfg: &KvCacheConfig) -> ffi::pkv_cache_geometry {
    ffi::pkv_cache_geometry {
        num_blocks: cfg.num_blocks() as i32,
        num_layers: cfg.num_layers() as i32,
        block_size: cfg.block_size() as i32,
        num_kv_heads: cfg.num_kv_heads() as i32,
        head_dim: cfg.head_dim() as i32,
        dtype: match cfg.dtype() {
            KvDtype::F32 => ffi::PKV_DTYPE_F32,
            KvDtype::F16 => ffi::PKV_DTYPE_F16,
            KvDtype::Bf16 => ffi::PKV_DTYPE_BF16,
        } as i32,
        block_stride: cfg.block_stride() as i64,
    }
}

/// Asserts a launcher returned PKV_OK, with the emulation's last fault in the message.
pub fn expect_ok(what: &str, status: i32) {
    assert_eq!(
        status,
        ffi::PKV_OK as i32,
        "{what}: launcher status {status} ({}); last fault: {:?}",
        cuda_emu::status_string(status),
        cuda_emu::last_fault()
    );
}
