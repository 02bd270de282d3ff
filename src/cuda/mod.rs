//! CUDA run time (feature `cuda`): device probe, the device KV cache, pinned swap space, safe
//! launch wrappers over cudarc 0.17 buffers and the graph-safe [`DecodeStep`]: a convenience
//! layer over [`crate::cuda_raw`] (the launches over raw pointers and the caller's stream,
//! which clients on other cudarc versions use directly).
//!
//! # Two CUDA APIs, one context
//!
//! The kernels are compiled by nvcc into a static library linked with the **static CUDA runtime**
//! (`libcudart_static.a`); each `extern "C"` launcher in kernels/*.cu launches with `<<<>>>`
//! (runtime API) and returns a status code. Memory, streams, events and the device probe go
//! through **cudarc's driver API**, loaded at run time (`dynamic-loading`), so a binary built
//! with `cuda` starts on a machine without a driver and reports [`CudaError::DriverNotFound`]
//! instead of failing to load.
//!
//! They share one context: cudarc's [`CudaContext::new`](cudarc::driver::CudaContext::new)
//! retains the device's **primary context**, and the runtime API, when a thread calls it with a
//! context current, uses that context (and otherwise the device's primary context, the same
//! one). Every wrapper here makes the primary context current on the calling thread
//! (`bind_to_thread`) before calling a launcher, and passes cudarc's `CUstream` as the launch's
//! `cudaStream_t` (the same handle type). Device pointers from cudarc are therefore valid in the
//! launchers, launches are ordered with cudarc's copies on the same stream, and cudarc's
//! per-buffer events (taken around each launch through `device_ptr`/`device_ptr_mut`) keep its
//! multi-stream synchronisation correct.
//!
//! # Never panics, never aborts
//!
//! [`Gpu::open`] first asks [`is_culib_present`](cudarc::driver::sys::is_culib_present) (cudarc
//! panics if the driver library is missing and it is used), then the device count, then
//! `pkv_probe` (does this build hold a kernel image for the device). Every launcher's status
//! and every driver call's result becomes a typed [`CudaError`]. Shapes are checked on the host
//! with the CPU kernels' rules and words ([`crate::error::AttnError`]) before anything launches.
//!
//! # Layout and semantics
//!
//! One [`DeviceArena`] per device (`num_pages x page_bytes`); every model's [`DeviceKvCache`]
//! is a view of it with its own geometry and the arena's page size as page stride, in the
//! layout of [`KvCacheConfig`](crate::kv::KvCacheConfig) (the C ABI carries the stride: `pkv_cache_geometry::
//! block_stride`). Attention semantics of [`crate::attn`]. The CPU kernels in
//! [`crate::attn::cpu`] are the oracle of `tests/cuda_kernels.rs` and `tests/cuda_arena.rs`.

mod arena;
mod cache;
mod device;
mod ops;
mod raw_device;
mod step;

pub use crate::cuda_raw::ffi;
pub use crate::cuda_raw::{DecodeMode, DecodePlan, PrefillTiling};
pub use crate::error::CudaError;
pub use arena::{DeviceArena, POISON_BYTE};
pub use cache::{DeviceKvCache, PinnedSwapSpace, SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_DIMS};
pub use device::{device_count, Gpu, GpuInfo};
pub use ops::{DecodeWorkspace, DeviceAttnParams, DeviceSeqs, TokenRows, TokenRowsMut};
pub use step::{DecodeGraph, DecodeStep};
