//! The device KV cache (a model's view of a [`DeviceArena`], the layout of
//! [`KvCacheConfig`](crate::kv::KvCacheConfig)) and the pinned host swap space, with the block-moving operations:
//! `copy_blocks`, `swap_out`, `swap_in`.

use super::arena::DeviceArena;
use super::device::Gpu;
use crate::cuda_raw::{self, geometry, CacheView};
use crate::error::{CudaError, KvError};
use crate::kv::{check_block_mapping, HostKvCache, KvCacheConfig};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, DevicePtr};
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

pub use crate::cuda_raw::{SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_DIMS};

/// One model's paged KV cache in device memory: a view of a [`DeviceArena`] with the model's
/// geometry, block `b` at the start of arena page `b` (the geometry's page stride is the
/// arena's page size; the rest of each page is never touched by this view).
///
/// [`new`](Self::new) makes a dense cache over an arena of its own; [`view`](Self::view) puts
/// a model on a shared arena. Several views of one arena may live on different threads and
/// streams; which view may touch which page is the block pool's business (see the
/// [arena's rule](super::DeviceArena)).
#[derive(Debug)]
pub struct DeviceKvCache {
    arena: Arc<DeviceArena>,
    /// The view's geometry: `num_blocks` = the arena's pages, page stride = its page size;
    /// supported by the CUDA kernels (checked by `geometry` at construction).
    config: KvCacheConfig,
    /// Device copy of the last `copy_blocks` pair list; grows, never shrinks.
    pairs: Option<CudaSlice<i32>>,
    /// Host staging of the same (no allocation per call once grown).
    pairs_host: Vec<i32>,
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
    /// A zeroed cache of `config` on `gpu` over an arena of its own (`config.num_blocks()`
    /// pages of `config.page_bytes()`: dense unless `config` has a page stride).
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for a head dim or block size without a kernel (or a size
    /// beyond `i32`), [`CudaError::Driver`] if the allocation fails.
    pub fn new(gpu: &Gpu, config: KvCacheConfig) -> Result<Self, CudaError> {
        geometry(&config)?;
        let arena = DeviceArena::new(gpu, config.num_blocks(), config.page_bytes())?;
        Ok(Self::from_parts(arena, config))
    }

    /// A model's view of a shared arena: `config`'s block shape (layers, KV heads, head dim,
    /// tokens per block, dtype) over every page of `arena`. The view's
    /// [`config`](Self::config) is `config` with the arena's page count as `num_blocks` and its
    /// page size as the page stride (`config`'s own block count and stride are not used).
    ///
    /// # Errors
    /// [`KvError::PageTooSmall`] (as [`CudaError::Kv`]) if a block of `config` does not fit a
    /// page, [`CudaError::Unsupported`] as in [`new`](Self::new). Nothing is allocated.
    pub fn view(arena: &Arc<DeviceArena>, config: &KvCacheConfig) -> Result<Self, CudaError> {
        let config = config
            .with_num_blocks(arena.num_pages())?
            .with_page_stride(arena.page_bytes())?;
        geometry(&config)?;
        Ok(Self::from_parts(arena.clone(), config))
    }

    fn from_parts(arena: Arc<DeviceArena>, config: KvCacheConfig) -> Self {
        debug_assert_eq!(config.total_bytes(), arena.total_bytes());
        Self {
            arena,
            config,
            pairs: None,
            pairs_host: Vec::new(),
        }
    }

    /// The geometry (its page stride is the arena's page size).
    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }
    /// The arena this cache is a view of.
    pub fn arena(&self) -> &Arc<DeviceArena> {
        &self.arena
    }
    /// The view as the raw kernel API takes it ([`crate::cuda_raw`]): the arena's base and
    /// this geometry. The base stays valid while this cache (or its arena) lives.
    pub fn raw_view(&self) -> CacheView {
        CacheView {
            base: self.arena.base(),
            config: self.config,
        }
    }
    /// The arena's base as a swap launcher's argument.
    fn base(&self) -> *mut c_void {
        self.arena.base() as usize as *mut c_void
    }
    /// Refuses a `gpu` of another device than the arena's.
    pub(crate) fn check_device(&self, gpu: &Gpu) -> Result<(), CudaError> {
        self.arena.check_device(gpu)
    }

    /// Copies a host image of this view (same geometry, page stride included: the whole
    /// arena's bytes) into the arena, and waits for the copy.
    ///
    /// # Errors
    /// [`KvError::GeometryMismatch`] (as [`CudaError::Kv`]) if the geometries differ,
    /// [`CudaError::Driver`] on copy failure.
    pub fn upload_from(&mut self, gpu: &Gpu, host: &HostKvCache) -> Result<(), CudaError> {
        if host.config() != &self.config {
            return Err(KvError::GeometryMismatch.into());
        }
        self.arena.upload(gpu, host.as_bytes())
    }

    /// Copies the arena into a host image of this view (same geometry), after the work queued
    /// on `gpu`'s stream, and waits for it.
    ///
    /// # Errors
    /// As [`upload_from`](Self::upload_from).
    pub fn download_to(&self, gpu: &Gpu, host: &mut HostKvCache) -> Result<(), CudaError> {
        if host.config() != &self.config {
            return Err(KvError::GeometryMismatch.into());
        }
        self.arena.download(gpu, host.as_bytes_mut())
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
        self.check_device(gpu)?;
        if i32::try_from(pairs.len()).is_err() {
            return Err(CudaError::Unsupported {
                what: "copy_blocks pairs",
                value: pairs.len(),
            });
        }
        self.pairs_host.clear();
        // Indices are < num_blocks <= MAX_BLOCKS < 2^31 (checked above): the casts are exact.
        self.pairs_host
            .extend(pairs.iter().flat_map(|&(s, d)| [s as i32, d as i32]));
        let need = self.pairs_host.len();
        if self.pairs.as_ref().is_none_or(|p| p.len() < need) {
            self.pairs = Some(gpu.alloc_zeros::<i32>(need.next_power_of_two())?);
        }
        let stream = gpu.stream();
        let view = self.raw_view();
        let dev_pairs = self.pairs.as_mut().ok_or(CudaError::Unsupported {
            what: "copy_blocks pairs",
            value: need,
        })?;
        stream.memcpy_htod(&self.pairs_host[..], &mut dev_pairs.slice_mut(..need))?;
        gpu.bind()?;
        let (pp, _gp) = dev_pairs.device_ptr(stream);
        // SAFETY: `view` is the arena's allocation of num_blocks pages of the page stride its
        // config carries (the view's config was built from the arena's size), kept alive by
        // our Arc until after the launch completes (the arena's drop synchronizes); `pp` holds
        // `pairs.len()` (src, dst) i32 pairs written by the copy above on the same stream, all
        // < num_blocks and with distinct destinations that are not sources
        // (check_block_mapping), alive until `_gp` drops after the call, with cudarc's events
        // ordering the launch after that copy. The kernel writes only the block part of
        // destination pages, which this view's sequences own (the arena's rule). The primary
        // context is current (bind), so the runtime API launches into cudarc's context and
        // stream.
        unsafe { cuda_raw::copy_blocks(&view, pp, pairs.len(), gpu.raw_stream()) }?;
        Ok(())
    }

    /// Swaps blocks out to pinned host memory: `(device block, swap block)` pairs, one call.
    /// For a dense cache (page stride = block bytes, as the swap space's), runs of consecutive
    /// blocks are coalesced into one DMA copy each; a view with larger pages (a shared arena)
    /// copies each block on its own (its blocks are not equally spaced on the two sides).
    /// Asynchronous; `swap`'s host accessors wait for it.
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
        gpu.bind()?;
        // Every earlier swap through this space, on whatever stream, comes first, so that
        // `pending` (recorded after this one) covers them all: host access waits on it alone.
        gpu.stream().wait(&swap.pending)?;
        let mut pairs = std::mem::take(&mut swap.staging);
        pairs.clear();
        pairs.extend(mapping.iter().map(|&(s, d)| [i64::from(s), i64::from(d)]));
        // SAFETY: `self.base()` is the arena (num_blocks pages of config.page_bytes(), alive
        // through our Arc until the queued copies complete: the arena's drop synchronizes) and
        // `swap.ptr` the pinned allocation of swap.config's num_blocks dense blocks of the same
        // bytes_per_block (same block shape, checked); every pair is in range of its side
        // (check_swap), so each copy of bytes_per_block (or a merged run, equal page sizes
        // only) stays inside both allocations. `pairs` is read during the call only. The DMA
        // writes into `swap`'s memory, which we hold by &mut: no host access can overlap it
        // until `swap.pending` (recorded below) is waited on by an accessor, and no earlier
        // swap's DMA either (the stream waited on `pending` above).
        let r = unsafe {
            cuda_raw::swap_blocks(
                swap.ptr.as_ptr() as *mut c_void,
                swap.config.page_bytes(),
                self.base(),
                self.config.page_bytes(),
                self.config.bytes_per_block(),
                &pairs,
                true,
                gpu.raw_stream(),
            )
        };
        swap.staging = pairs;
        // Recorded even when the launcher failed: copies it queued before failing are waited
        // for too. Where the record itself fails, nothing would wait for them: the stream is
        // waited for here, before the pinned memory can be read, rewritten or freed.
        let recorded = swap.pending.record(gpu.stream());
        if recorded.is_err() {
            let _ = gpu.synchronize();
        }
        r?;
        recorded?;
        Ok(())
    }

    /// Swaps blocks back in from pinned host memory: `(swap block, device block)` pairs, one
    /// call, runs coalesced as in [`swap_out`](Self::swap_out) (dense caches only).
    /// Asynchronous.
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
        gpu.bind()?;
        // Every earlier swap through this space, on whatever stream, comes first, so that
        // `pending` (recorded after this one) covers them all: host access waits on it alone.
        gpu.stream().wait(&swap.pending)?;
        let mut pairs = std::mem::take(&mut swap.staging);
        pairs.clear();
        pairs.extend(mapping.iter().map(|&(s, d)| [i64::from(s), i64::from(d)]));
        // SAFETY: as in swap_out with the roles exchanged: the arena is the destination (only
        // the block part of the mapped pages is written, pages this view owns), `swap.ptr` the
        // pinned swap allocation of the same block shape, pairs in range. The DMA reads
        // `swap`'s memory, held by &mut until `swap.pending` is recorded, so the host cannot
        // write it while the copy runs (accessors wait on `pending`), nor an earlier swap's
        // DMA (the stream waited on `pending` above).
        let r = unsafe {
            cuda_raw::swap_blocks(
                self.base(),
                self.config.page_bytes(),
                swap.ptr.as_ptr() as *const c_void,
                swap.config.page_bytes(),
                self.config.bytes_per_block(),
                &pairs,
                false,
                gpu.raw_stream(),
            )
        };
        swap.staging = pairs;
        // Recorded even when the launcher failed: copies it queued before failing are waited
        // for too. Where the record itself fails, nothing would wait for them: the stream is
        // waited for here, before the pinned memory can be read, rewritten or freed.
        let recorded = swap.pending.record(gpu.stream());
        if recorded.is_err() {
            let _ = gpu.synchronize();
        }
        r?;
        recorded?;
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
        self.check_device(gpu)?;
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
/// is the same bytes as on the device). Allocated with `cuMemHostAlloc`, flags 0: pinned for
/// the context of the [`Gpu`] it was made on (not `CU_MEMHOSTALLOC_PORTABLE`: a swap on
/// another device's stream is refused, with the driver's `CUDA_ERROR_INVALID_CONTEXT`, before
/// any copy), host-cached (the host reads it efficiently, unlike write-combined memory).
///
/// Host access ([`as_bytes`](Self::as_bytes), [`as_bytes_mut`](Self::as_bytes_mut), drop)
/// first waits for the swaps that used it (each swap is queued behind the previous one, on
/// whatever stream of the device), so a DMA never races a host access or another swap's DMA.
#[derive(Debug)]
pub struct PinnedSwapSpace {
    /// Geometry of the swap space (the cache's block shape, its own block count).
    config: KvCacheConfig,
    /// `config.total_bytes()` bytes of pinned memory, initialized (zeroed) at creation; owned.
    ptr: NonNull<u8>,
    /// Recorded on the stream after every swap that reads or writes `ptr`; every swap's stream
    /// waits on it first, so it covers all of them.
    pending: CudaEvent,
    /// Context that allocated `ptr` (bound again to free it).
    ctx: Arc<CudaContext>,
    /// Reused host staging of the launcher's pair list.
    staging: Vec<[i64; 2]>,
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
        // The event first: nothing to undo if it fails (after the allocation, its failure
        // would leak the pinned memory).
        let pending = gpu.context().new_event(None)?;
        // SAFETY: the context is current (bind); cuMemHostAlloc with flags 0 returns `bytes` of
        // page-locked, host-cached memory or an error. The memory is uninitialized: it is
        // zeroed below before any reference to it exists.
        let raw = unsafe { cudarc::driver::result::malloc_host(bytes, 0) }?;
        let Some(ptr) = NonNull::new(raw as *mut u8) else {
            return Err(KvError::AllocFailed { bytes }.into());
        };
        // SAFETY: `ptr` points to `bytes` writable bytes just allocated and not yet shared.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, bytes) };
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
