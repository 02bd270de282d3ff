//! The device KV arena: one device allocation of `num_pages x page_bytes` bytes that every
//! model's [`DeviceKvCache`](super::DeviceKvCache) on the device is a view of. A block id
//! handed out by the block pool names a page whatever model holds it, so a page one model frees
//! is the same device memory another model writes next: a block lent between models is not
//! paid for twice. (The host twin is `kv::KvArena`; how a geometry lays its blocks over a
//! page is [`KvCacheConfig::with_page_stride`].)
//!
//! # Raw addresses instead of cudarc's per-buffer events
//!
//! cudarc orders work on one buffer across streams with a read and a write event per
//! [`CudaSlice`]. An arena is shared by engines that each launch on a stream of their own, on
//! disjoint pages; ordering every launch after the last one on *any* page would serialize the
//! engines. So the arena takes its device address once, at creation, and every view launches on
//! that raw address: launches of one view are ordered by its stream; work of different views
//! touches different pages, and a page moves between views only through the block pool.
//!
//! That makes one rule the caller's (the engine loop keeps it by synchronizing its stream at the
//! end of every step, before the pages a step frees go back to the pool): **a page is returned
//! to the pool only after the work its stream queued on it has completed**, so the next owner's
//! first launch on the page, on another stream, cannot overtake the previous owner's last one
//! (a swap-out DMA, say). Breaking it gives wrong values in device memory, never a host memory
//! error: every launcher bounds its accesses to the arena (see the launchers' docs).
//!
//! The allocation lives as long as the last view's `Arc`; dropping the arena synchronizes its
//! context first, so no stream still uses the memory when cudarc frees it.

use super::device::Gpu;
use crate::error::{CudaError, KvError};
use crate::kv::PAGE_ALIGN;
use cudarc::driver::{CudaContext, CudaSlice, DevicePtr};
use std::sync::Arc;

/// The byte written over a poisoned page: `0xFF` bytes read as NaN in f32, f16 and bf16, so a
/// kernel that reads a byte a page's previous owner left produces a NaN that tests catch.
pub const POISON_BYTE: u8 = 0xFF;

/// One device allocation of `num_pages` pages of `page_bytes` bytes, zeroed at creation, shared
/// through `Arc` by the [`DeviceKvCache`](super::DeviceKvCache) views of every model on the
/// device.
///
/// Invariant: `base` is the device address of `data`, which holds `num_pages * page_bytes`
/// bytes; `num_pages` is in `1..=MAX_BLOCKS`, `page_bytes` a positive multiple of
/// [`PAGE_ALIGN`], their product fits `isize`. `data` is never handed out (no cudarc event of
/// it orders anything after creation; see the module docs).
#[derive(Debug)]
pub struct DeviceArena {
    /// The allocation; owned here so that cudarc frees it (after `Drop` synchronized).
    data: CudaSlice<u8>,
    /// `data`'s device address, taken once in [`new`](Self::new).
    base: u64,
    num_pages: usize,
    page_bytes: usize,
    /// The context `data` belongs to (synchronized before the free).
    ctx: Arc<CudaContext>,
}

impl DeviceArena {
    /// Allocates `num_pages` zeroed pages of `page_bytes` bytes on `gpu`'s device, and waits
    /// for the zeroing, so that views on any stream of the device may use the arena at once.
    ///
    /// # Errors
    /// [`KvError::ZeroDimension`], [`KvError::TooManyBlocks`] (more pages than block ids),
    /// [`KvError::PageMisaligned`] (a page size that is not a multiple of [`PAGE_ALIGN`]),
    /// [`KvError::SizeOverflow`] (all as [`CudaError::Kv`]); [`CudaError::Driver`] if the
    /// allocation fails. Nothing is allocated on error.
    pub fn new(gpu: &Gpu, num_pages: usize, page_bytes: usize) -> Result<Arc<Self>, CudaError> {
        let total = Self::check(num_pages, page_bytes)?;
        let data = gpu.alloc_zeros::<u8>(total)?;
        let base = {
            let (ptr, _read) = data.device_ptr(gpu.stream());
            ptr
        };
        gpu.synchronize()?;
        Ok(Arc::new(Self {
            data,
            base,
            num_pages,
            page_bytes,
            ctx: gpu.context().clone(),
        }))
    }

    /// The size checks of [`new`](Self::new), without a device; returns the byte size.
    ///
    /// # Errors
    /// As [`new`](Self::new), less the driver's.
    pub fn check(num_pages: usize, page_bytes: usize) -> Result<usize, KvError> {
        if num_pages == 0 {
            return Err(KvError::ZeroDimension { what: "num_pages" });
        }
        if page_bytes == 0 {
            return Err(KvError::ZeroDimension { what: "page_bytes" });
        }
        if num_pages > crate::ids::MAX_BLOCKS as usize {
            return Err(KvError::TooManyBlocks {
                num_blocks: num_pages,
                max: crate::ids::MAX_BLOCKS as usize,
            });
        }
        if page_bytes % PAGE_ALIGN != 0 {
            return Err(KvError::PageMisaligned {
                page_bytes,
                align: PAGE_ALIGN,
            });
        }
        num_pages
            .checked_mul(page_bytes)
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or(KvError::SizeOverflow)
    }

    /// Pages in the arena (block ids `0..num_pages`).
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }
    /// Bytes per page: every view's page stride.
    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }
    /// Bytes of the whole arena.
    pub fn total_bytes(&self) -> usize {
        self.num_pages * self.page_bytes
    }
    /// The device the arena lives on.
    pub fn ordinal(&self) -> usize {
        self.data.ordinal()
    }

    /// The device address of page 0 (16-byte aligned: cudarc's allocations are 256-byte
    /// aligned). Valid while `self` lives.
    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    /// Refuses a `gpu` of another device than the arena's.
    pub(crate) fn check_device(&self, gpu: &Gpu) -> Result<(), CudaError> {
        if self.ordinal() != gpu.info().ordinal {
            return Err(CudaError::WrongDevice {
                expected: gpu.info().ordinal,
                found: self.ordinal(),
            });
        }
        Ok(())
    }

    /// Fills whole pages with `byte` on `gpu`'s stream (asynchronous), e.g. [`POISON_BYTE`]
    /// over the pages a model frees, in test and debug builds. The caller owns the pages (the
    /// module docs' rule).
    ///
    /// # Errors
    /// [`KvError::BlockOutOfRange`] (as [`CudaError::Kv`]) for a page past the arena, nothing
    /// filled; [`CudaError::WrongDevice`]; [`CudaError::Driver`] if a fill cannot be queued.
    pub fn fill_pages(&self, gpu: &Gpu, pages: &[u32], byte: u8) -> Result<(), CudaError> {
        self.check_device(gpu)?;
        if let Some(&p) = pages.iter().find(|&&p| p as usize >= self.num_pages) {
            return Err(KvError::BlockOutOfRange {
                block: i64::from(p),
                num_blocks: self.num_pages,
            }
            .into());
        }
        gpu.bind()?;
        for &p in pages {
            let at = self.base + (p as usize * self.page_bytes) as u64;
            // SAFETY: page p < num_pages (checked), so [at, at + page_bytes) lies inside the
            // allocation, which outlives the queued fill (dropping the arena synchronizes the
            // context first). The context is current (bind) and the stream belongs to it; the
            // bytes are plain u8, valid whatever their value.
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    at,
                    byte,
                    self.page_bytes,
                    gpu.stream().cu_stream(),
                )
            }?;
        }
        Ok(())
    }

    /// Fills the whole arena with `byte` (asynchronous, on `gpu`'s stream).
    ///
    /// # Errors
    /// [`CudaError::WrongDevice`], [`CudaError::Driver`].
    pub fn fill(&self, gpu: &Gpu, byte: u8) -> Result<(), CudaError> {
        self.check_device(gpu)?;
        gpu.bind()?;
        // SAFETY: the range is the whole allocation, alive until after the fill (see
        // fill_pages); the context is current and owns the stream.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                self.base,
                byte,
                self.total_bytes(),
                gpu.stream().cu_stream(),
            )
        }?;
        Ok(())
    }

    /// Copies `host` (exactly [`total_bytes`](Self::total_bytes) bytes) into the arena and
    /// waits for the copy.
    ///
    /// # Errors
    /// [`KvError::LengthMismatch`] (as [`CudaError::Kv`]) for another length,
    /// [`CudaError::WrongDevice`], [`CudaError::Driver`].
    pub fn upload(&self, gpu: &Gpu, host: &[u8]) -> Result<(), CudaError> {
        self.check_len(host.len())?;
        self.check_device(gpu)?;
        gpu.bind()?;
        // SAFETY: the destination is the whole allocation (host.len() == total_bytes, checked),
        // alive for the call; `host` is borrowed until the synchronize below has waited for the
        // copy, so the driver never reads it after it could change or be freed.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(self.base, host, gpu.stream().cu_stream())
        }?;
        gpu.synchronize()
    }

    /// Copies the whole arena into `host` (exactly [`total_bytes`](Self::total_bytes) bytes),
    /// after the work queued on `gpu`'s stream, and waits for it.
    ///
    /// # Errors
    /// As [`upload`](Self::upload).
    pub fn download(&self, gpu: &Gpu, host: &mut [u8]) -> Result<(), CudaError> {
        self.check_len(host.len())?;
        self.check_device(gpu)?;
        gpu.bind()?;
        // SAFETY: the source is the whole allocation (lengths checked), alive for the call;
        // `host` is exclusively borrowed until the synchronize below has waited for the DMA
        // that writes it, so no host access overlaps the copy.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(host, self.base, gpu.stream().cu_stream())
        }?;
        gpu.synchronize()
    }

    fn check_len(&self, len: usize) -> Result<(), KvError> {
        if len != self.total_bytes() {
            return Err(KvError::LengthMismatch {
                what: "arena bytes",
                expected: self.total_bytes(),
                found: len,
            });
        }
        Ok(())
    }
}

impl Drop for DeviceArena {
    fn drop(&mut self) {
        // Work queued on the arena by any stream of the context (views launch on raw addresses
        // cudarc does not track) must finish before cudarc frees `data` right after this. An
        // error cannot be reported from drop; a failed synchronize means the context is broken
        // (a sticky fault), where the free fails too.
        let _ = self.ctx.synchronize();
    }
}
