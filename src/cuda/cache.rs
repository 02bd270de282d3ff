//! The device KV cache (one allocation, the layout of [`crate::kv::layout`]) and the pinned
//! host swap space, with the block-moving operations: `copy_blocks`, `swap_out`, `swap_in`.

use super::device::{check_status, Gpu};
use super::ffi;
use crate::error::{CudaError, KvError};
use crate::kv::{check_block_mapping, HostKvCache, KvCacheConfig, KvDtype};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, DevicePtr, DevicePtrMut};
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

/// Head dims the CUDA kernels are instantiated for.
pub const SUPPORTED_HEAD_DIMS: [usize; 6] = [64, 80, 96, 112, 128, 256];
/// Block sizes the CUDA kernels accept.
pub const SUPPORTED_BLOCK_SIZES: [usize; 3] = [8, 16, 32];

/// A paged KV cache in device memory: one allocation of
/// [`total_bytes`](KvCacheConfig::total_bytes), zeroed at creation.
#[derive(Debug)]
pub struct DeviceKvCache {
    config: KvCacheConfig,
    /// The launchers' view of `config` (all sizes fit `i32`: checked in `new`).
    geom: ffi::pkv_cache_geometry,
    /// `[num_blocks][num_layers][2][block_size][num_kv_heads][head_dim]` of `config.dtype()`.
    data: CudaSlice<u8>,
    /// Device copy of the last `copy_blocks` pair list; grows, never shrinks.
    pairs: Option<CudaSlice<i32>>,
    /// Host staging of the same (no allocation per call once grown).
    pairs_host: Vec<i32>,
}

pub(crate) fn geometry(config: &KvCacheConfig) -> Result<ffi::pkv_cache_geometry, CudaError> {
    if !SUPPORTED_HEAD_DIMS.contains(&config.head_dim()) {
        return Err(CudaError::Unsupported {
            what: "head_dim",
            value: config.head_dim(),
        });
    }
    if !SUPPORTED_BLOCK_SIZES.contains(&config.block_size()) {
        return Err(CudaError::Unsupported {
            what: "block_size",
            value: config.block_size(),
        });
    }
    let i = |what: &'static str, v: usize| {
        i32::try_from(v).map_err(|_| CudaError::Unsupported { what, value: v })
    };
    Ok(ffi::pkv_cache_geometry {
        num_blocks: i("num_blocks", config.num_blocks())?,
        num_layers: i("num_layers", config.num_layers())?,
        block_size: i("block_size", config.block_size())?,
        num_kv_heads: i("num_kv_heads", config.num_kv_heads())?,
        head_dim: i("head_dim", config.head_dim())?,
        dtype: match config.dtype() {
            KvDtype::F32 => ffi::PKV_DTYPE_F32 as i32,
            KvDtype::F16 => ffi::PKV_DTYPE_F16 as i32,
            KvDtype::Bf16 => ffi::PKV_DTYPE_BF16 as i32,
        },
    })
}

/// Refuses a device buffer of another device than `gpu`'s.
pub(crate) fn same_device<T>(gpu: &Gpu, s: &CudaSlice<T>) -> Result<(), CudaError> {
    if s.ordinal() != gpu.info().ordinal {
        return Err(CudaError::WrongDevice {
            expected: gpu.info().ordinal,
            found: s.ordinal(),
        });
    }
    Ok(())
}

impl DeviceKvCache {
    /// Allocates a zeroed cache of `config` on `gpu`.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for a head dim or block size without a kernel (or a size
    /// beyond `i32`), [`CudaError::Driver`] if the allocation fails.
    pub fn new(gpu: &Gpu, config: KvCacheConfig) -> Result<Self, CudaError> {
        let geom = geometry(&config)?;
        let data = gpu.alloc_zeros::<u8>(config.total_bytes())?;
        Ok(Self {
            config,
            geom,
            data,
            pairs: None,
            pairs_host: Vec::new(),
        })
    }

    /// The geometry.
    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }
    /// The raw device allocation (for custom kernels; layout in [`crate::kv::layout`]).
    pub fn data(&self) -> &CudaSlice<u8> {
        &self.data
    }
    /// The raw device allocation, mutable.
    pub fn data_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.data
    }
    pub(crate) fn geom(&self) -> &ffi::pkv_cache_geometry {
        &self.geom
    }

    /// Copies a host cache of the same geometry into this one (ordered on `gpu`'s stream).
    ///
    /// # Errors
    /// [`KvError::GeometryMismatch`] (as [`CudaError::Kv`]) if the geometries differ,
    /// [`CudaError::Driver`] on copy failure.
    pub fn upload_from(&mut self, gpu: &Gpu, host: &HostKvCache) -> Result<(), CudaError> {
        if host.config() != &self.config {
            return Err(KvError::GeometryMismatch.into());
        }
        same_device(gpu, &self.data)?;
        gpu.stream().memcpy_htod(host.as_bytes(), &mut self.data)?;
        Ok(())
    }

    /// Copies this cache into a host cache of the same geometry (waits for the stream).
    ///
    /// # Errors
    /// As [`upload_from`](Self::upload_from).
    pub fn download_to(&self, gpu: &Gpu, host: &mut HostKvCache) -> Result<(), CudaError> {
        if host.config() != &self.config {
            return Err(KvError::GeometryMismatch.into());
        }
        same_device(gpu, &self.data)?;
        gpu.stream().memcpy_dtoh(&self.data, host.as_bytes_mut())?;
        gpu.synchronize()
    }

    /// Copies whole blocks `(src, dst)` (every layer, K and V) in one kernel launch
    /// (copy-on-write). Same rules as [`crate::attn::cpu::copy_blocks`]: indices in range,
    /// destinations distinct and not also sources.
    ///
    /// # Errors
    /// [`CudaError::Kv`] for a bad mapping (nothing launched), [`CudaError::Driver`] for the
    /// pair upload, [`CudaError::Launch`] for the launch.
    pub fn copy_blocks(&mut self, gpu: &Gpu, pairs: &[(u32, u32)]) -> Result<(), CudaError> {
        let n = self.config.num_blocks();
        check_block_mapping(pairs, n, n, true)?;
        if pairs.is_empty() {
            return Ok(());
        }
        same_device(gpu, &self.data)?;
        let num_pairs = i32::try_from(pairs.len()).map_err(|_| CudaError::Unsupported {
            what: "copy_blocks pairs",
            value: pairs.len(),
        })?;
        self.pairs_host.clear();
        // Indices are < num_blocks <= MAX_BLOCKS < 2^31 (checked above): the casts are exact.
        self.pairs_host
            .extend(pairs.iter().flat_map(|&(s, d)| [s as i32, d as i32]));
        let need = self.pairs_host.len();
        if self.pairs.as_ref().is_none_or(|p| p.len() < need) {
            self.pairs = Some(gpu.alloc_zeros::<i32>(need.next_power_of_two())?);
        }
        let stream = gpu.stream();
        let dev_pairs = self.pairs.as_mut().ok_or(CudaError::Unsupported {
            what: "copy_blocks pairs",
            value: need,
        })?;
        stream.memcpy_htod(&self.pairs_host[..], &mut dev_pairs.slice_mut(..need))?;
        gpu.bind()?;
        let (pp, _gp) = dev_pairs.device_ptr(stream);
        let (cp, _gc) = self.data.device_ptr_mut(stream);
        // SAFETY: `cp` is this cache's allocation of total_bytes = the geometry `self.geom`
        // describes; `pp` holds `num_pairs` (src, dst) i32 pairs written by the copy above on
        // the same stream, all < num_blocks (check_block_mapping). Both pointers stay valid
        // until the guards `_gp`/`_gc` drop after the call, and cudarc's events taken by
        // device_ptr* order this launch after earlier work on the buffers. The primary context
        // is current (bind), so the runtime API launches into cudarc's context and stream.
        let status = unsafe {
            ffi::pkv_copy_blocks(
                cp as usize as *mut c_void,
                &self.geom,
                pp as usize as *const i32,
                num_pairs,
                gpu.raw_stream(),
            )
        };
        check_status("pkv_copy_blocks", status)
    }

    /// Swaps blocks out to pinned host memory: `(device block, swap block)` pairs, one call,
    /// runs of consecutive blocks coalesced into one DMA copy each. Asynchronous; `swap`'s host
    /// accessors wait for it.
    ///
    /// # Errors
    /// [`CudaError::Kv`] for a mapping out of range or a different block shape,
    /// [`CudaError::Launch`] if a copy cannot be queued.
    pub fn swap_out(
        &self,
        gpu: &Gpu,
        swap: &mut PinnedSwapSpace,
        mapping: &[(u32, u32)],
    ) -> Result<(), CudaError> {
        self.check_swap(gpu, swap, mapping, true)?;
        let mut pairs = std::mem::take(&mut swap.staging);
        pairs.clear();
        pairs.extend(mapping.iter().flat_map(|&(s, d)| [s as i64, d as i64]));
        gpu.bind()?;
        let stream = gpu.stream();
        // Host memory is reused by this DMA: wait for earlier host-side use (none pending from
        // the host itself: accessors take &self/&mut self and finish synchronously).
        let (src, _g) = self.data.device_ptr(stream);
        // SAFETY: `src` is this cache's allocation (num_blocks blocks of bytes_per_block) and
        // `swap.ptr` the pinned allocation of swap.config's num_blocks blocks of the same
        // bytes_per_block (same block shape, checked); every pair is in range of its side
        // (check_swap). `pairs` is a host array of mapping.len() (src, dst) pairs read during the
        // call only. The DMA writes into `swap`'s memory, which we hold by &mut: no host access
        // can overlap it until `swap.pending` (recorded below) is waited on by an accessor.
        let status = unsafe {
            ffi::pkv_swap_blocks(
                swap.ptr.as_ptr() as *mut c_void,
                src as usize as *const c_void,
                self.config.bytes_per_block(),
                pairs.as_ptr(),
                mapping.len() as i32,
                1,
                gpu.raw_stream(),
            )
        };
        drop(_g);
        swap.staging = pairs;
        check_status("pkv_swap_blocks", status)?;
        swap.pending.record(stream)?;
        Ok(())
    }

    /// Swaps blocks back in from pinned host memory: `(swap block, device block)` pairs, one
    /// call, runs coalesced. Asynchronous.
    ///
    /// # Errors
    /// As [`swap_out`](Self::swap_out).
    pub fn swap_in(
        &mut self,
        gpu: &Gpu,
        swap: &mut PinnedSwapSpace,
        mapping: &[(u32, u32)],
    ) -> Result<(), CudaError> {
        self.check_swap(gpu, swap, mapping, false)?;
        let mut pairs = std::mem::take(&mut swap.staging);
        pairs.clear();
        pairs.extend(mapping.iter().flat_map(|&(s, d)| [s as i64, d as i64]));
        gpu.bind()?;
        let stream = gpu.stream();
        let (dst, _g) = self.data.device_ptr_mut(stream);
        // SAFETY: as in swap_out with the roles exchanged: `dst` is this cache's allocation,
        // `swap.ptr` the pinned swap allocation of the same block shape, pairs in range. The
        // DMA reads `swap`'s memory, held by &mut until `swap.pending` is recorded, so the host
        // cannot write it while the copy runs (accessors wait on `pending`).
        let status = unsafe {
            ffi::pkv_swap_blocks(
                dst as usize as *mut c_void,
                swap.ptr.as_ptr() as *const c_void,
                self.config.bytes_per_block(),
                pairs.as_ptr(),
                mapping.len() as i32,
                0,
                gpu.raw_stream(),
            )
        };
        drop(_g);
        swap.staging = pairs;
        check_status("pkv_swap_blocks", status)?;
        swap.pending.record(stream)?;
        Ok(())
    }

    fn check_swap(
        &self,
        gpu: &Gpu,
        swap: &PinnedSwapSpace,
        mapping: &[(u32, u32)],
        out: bool,
    ) -> Result<(), CudaError> {
        if !self.config.same_block_shape(&swap.config) {
            return Err(KvError::GeometryMismatch.into());
        }
        same_device(gpu, &self.data)?;
        let (dev, host) = (self.config.num_blocks(), swap.config.num_blocks());
        if out {
            check_block_mapping(mapping, dev, host, false)?;
        } else {
            check_block_mapping(mapping, host, dev, false)?;
        }
        if i32::try_from(mapping.len()).is_err() {
            return Err(CudaError::Unsupported {
                what: "swap mapping pairs",
                value: mapping.len(),
            });
        }
        Ok(())
    }
}

/// Page-locked host memory holding swapped-out blocks, in the cache layout (so a swapped block
/// is the same bytes as on the device). Allocated with `cuMemHostAlloc` (portable, cached: the
/// host reads it efficiently, unlike write-combined memory).
///
/// Host access ([`as_bytes`](Self::as_bytes), [`as_bytes_mut`](Self::as_bytes_mut), drop)
/// first waits for the last swap that used it, so a DMA never races a host access.
#[derive(Debug)]
pub struct PinnedSwapSpace {
    /// Geometry of the swap space (the cache's block shape, its own block count).
    config: KvCacheConfig,
    /// `config.total_bytes()` bytes of pinned memory, initialized (zeroed) at creation; owned.
    ptr: NonNull<u8>,
    /// Recorded on the stream after every swap that reads or writes `ptr`.
    pending: CudaEvent,
    /// Context that allocated `ptr` (bound again to free it).
    ctx: Arc<CudaContext>,
    /// Reused host staging of the launcher's pair list.
    staging: Vec<i64>,
}

// SAFETY: the pinned buffer is plain memory owned by this value alone (no aliasing handle is
// handed out except through &self/&mut self borrows), CudaEvent and Arc<CudaContext> are Send
// and Sync, and every host access synchronizes with the device through `pending` first.
unsafe impl Send for PinnedSwapSpace {}
// SAFETY: shared access only reads (as_bytes), after waiting on `pending`; see Send.
unsafe impl Sync for PinnedSwapSpace {}

impl PinnedSwapSpace {
    /// Pinned host space for `num_blocks` blocks of `cache_config`'s block shape, zeroed.
    ///
    /// # Errors
    /// [`CudaError::Kv`] for an invalid geometry, [`CudaError::Driver`] if pinning fails.
    pub fn new(
        gpu: &Gpu,
        cache_config: &KvCacheConfig,
        num_blocks: usize,
    ) -> Result<Self, CudaError> {
        let config = cache_config.with_num_blocks(num_blocks)?;
        let bytes = config.total_bytes();
        gpu.bind()?;
        // SAFETY: the context is current (bind); cuMemHostAlloc with flags 0 returns `bytes` of
        // page-locked, host-cached memory or an error. The memory is uninitialized: it is
        // zeroed below before any reference to it exists.
        let raw = unsafe { cudarc::driver::result::malloc_host(bytes, 0) }?;
        let Some(ptr) = NonNull::new(raw as *mut u8) else {
            return Err(KvError::AllocFailed { bytes }.into());
        };
        // SAFETY: `ptr` points to `bytes` writable bytes just allocated and not yet shared.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, bytes) };
        let pending = gpu.context().new_event(None)?;
        Ok(Self {
            config,
            ptr,
            pending,
            ctx: gpu.context().clone(),
            staging: Vec::new(),
        })
    }

    /// The swap space's geometry.
    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }

    /// The bytes (cache layout), after waiting for the last swap that used them.
    ///
    /// # Errors
    /// [`CudaError::Driver`] if waiting fails (a fault of the stream's earlier work).
    pub fn as_bytes(&self) -> Result<&[u8], CudaError> {
        self.pending.synchronize()?;
        // SAFETY: `ptr` owns config.total_bytes() initialized bytes; the last DMA touching them
        // has completed (pending waited on) and no new one can start while this shared borrow
        // lives (swaps need &mut self).
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.config.total_bytes()) })
    }

    /// The bytes, mutable, after waiting for the last swap that used them.
    ///
    /// # Errors
    /// As [`as_bytes`](Self::as_bytes).
    pub fn as_bytes_mut(&mut self) -> Result<&mut [u8], CudaError> {
        self.pending.synchronize()?;
        // SAFETY: as in as_bytes; the exclusive borrow of self makes this the only access.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.config.total_bytes()) })
    }

    /// Copies the swap space into a host cache of the same geometry (for inspection and tests).
    ///
    /// # Errors
    /// [`CudaError::Kv`] on a geometry mismatch; as [`as_bytes`](Self::as_bytes).
    pub fn copy_to_host(&self, host: &mut HostKvCache) -> Result<(), CudaError> {
        if host.config() != &self.config {
            return Err(KvError::GeometryMismatch.into());
        }
        host.as_bytes_mut().copy_from_slice(self.as_bytes()?);
        Ok(())
    }
}

impl Drop for PinnedSwapSpace {
    fn drop(&mut self) {
        // A DMA may still use the memory: wait (errors cannot be reported from drop; the memory
        // is freed only if the wait succeeded, else leaked rather than freed under a DMA).
        if self.pending.synchronize().is_err() || self.ctx.bind_to_thread().is_err() {
            return;
        }
        // SAFETY: `ptr` came from cuMemHostAlloc in this context, is freed exactly once (here),
        // and no DMA or borrow uses it any more (pending waited on, &mut self).
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr.as_ptr() as *mut c_void) };
    }
}
