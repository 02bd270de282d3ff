//! Device upload over CUDA (feature `cuda`): [`super::StagingRing`] driven by [`CudaCopy`], a
//! [`CopyEngine`] of pinned staging buffers, `cuMemcpyHtoDAsync` on one stream and one
//! `CUevent` per buffer; [`Uploader`] wraps it with the device-memory check and the result map.
//!
//! A DMA engine copies to the device asynchronously only from page-locked memory; from pageable
//! memory (an mmapped file) the driver stages the copy itself and the call returns only after
//! it, which is how llama.cpp's mmap path uploads. Here the host copies each piece from the file
//! into a pinned buffer (spread over rayon's pool: one core's memcpy from the page cache is
//! slower than a PCIe 5 DMA) and queues its DMA at once, while the DMAs of the buffers filled
//! before run; every piece is its own DMA straight into its tensor's device allocation, so
//! nothing is copied twice on the device. The schedule and its safety argument are in
//! [`super::pipeline`].

use super::pipeline::{CopyEngine, StagingRing};
use super::UploadProgress;
use crate::cuda::Gpu;
use crate::error::CudaError;
use crate::gguf::{GgmlType, Gguf};
use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtrMut};
use rayon::prelude::*;
use std::collections::HashMap;
use std::ffi::c_void;
use std::num::NonZeroUsize;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;

/// Most staging buffers a ring may have.
pub const MAX_STAGING_BUFFERS: usize = 16;

/// How an [`Uploader`] stages its copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UploadOptions {
    /// Pinned buffers in the ring, 2 to [`MAX_STAGING_BUFFERS`]: two overlap one host copy
    /// with one DMA; more absorb jitter in either.
    pub staging_buffers: usize,
    /// Bytes per staging buffer, 64 KiB to 2 GiB: the largest single DMA.
    pub staging_bytes: usize,
    /// Allocate the ring write-combined (the host only writes it, the device only reads it).
    pub write_combined: bool,
}

impl Default for UploadOptions {
    /// Four write-combined buffers of 64 MiB.
    fn default() -> Self {
        Self {
            staging_buffers: 4,
            staging_bytes: 64 << 20,
            write_combined: true,
        }
    }
}

impl UploadOptions {
    /// Checks the ranges documented on the fields.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] naming the field out of range.
    pub fn check(&self) -> Result<(), CudaError> {
        if !(2..=MAX_STAGING_BUFFERS).contains(&self.staging_buffers) {
            return Err(CudaError::Unsupported {
                what: "staging_buffers",
                value: self.staging_buffers,
            });
        }
        if !((64 << 10)..=(2 << 30)).contains(&self.staging_bytes) {
            return Err(CudaError::Unsupported {
                what: "staging_bytes",
                value: self.staging_bytes,
            });
        }
        Ok(())
    }
}

/// One tensor in device memory.
#[derive(Debug)]
pub struct DeviceTensor {
    ty: GgmlType,
    /// Innermost dimension first, as in the file.
    shape: Vec<u64>,
    /// The tensor's bytes exactly as stored in the file (`ty.bytes_for(product of shape)`).
    data: CudaSlice<u8>,
}

impl DeviceTensor {
    /// Its ggml type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }
    /// Its shape, innermost dimension first.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }
    /// Its bytes in device memory.
    pub fn data(&self) -> &CudaSlice<u8> {
        &self.data
    }
    /// Its bytes in device memory, owned.
    pub fn into_data(self) -> CudaSlice<u8> {
        self.data
    }
}

/// A GGUF's tensors in device memory, by name.
#[derive(Debug, Default)]
pub struct DeviceWeights {
    tensors: HashMap<String, DeviceTensor>,
    total_bytes: u64,
}

impl DeviceWeights {
    /// The tensor named `name`.
    pub fn get(&self, name: &str) -> Option<&DeviceTensor> {
        self.tensors.get(name)
    }
    /// Every tensor, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &DeviceTensor)> {
        self.tensors.iter().map(|(k, v)| (k.as_str(), v))
    }
    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }
    /// True when there are no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }
    /// Bytes of all tensors.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }
    /// The map itself.
    pub fn into_map(self) -> HashMap<String, DeviceTensor> {
        self.tensors
    }
}

/// One pinned staging buffer of a [`CudaCopy`] ring and its event. Dropping it destroys the
/// event and leaks the memory; [`CopyEngine::free_staging`] frees it.
#[derive(Debug)]
pub struct CudaStaging {
    /// `len` bytes from `cuMemHostAlloc`, owned, zeroed once at allocation. The host writes a
    /// range only when no DMA reading it is pending (the [`CopyEngine`] contract).
    ptr: NonNull<u8>,
    len: usize,
    /// Recorded after every DMA that reads this buffer: complete => no DMA reads it.
    done: CudaEvent,
}

// SAFETY: the pinned memory is owned by this value alone and reached only through it (`&mut`
// for writes); CudaEvent is Send. Moving it to another thread moves that ownership.
unsafe impl Send for CudaStaging {}

/// The CUDA [`CopyEngine`]: pinned staging buffers on a context, DMAs and events on one stream,
/// destinations allocated on that stream.
#[derive(Debug)]
pub struct CudaCopy {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// `cuMemHostAlloc` flags of the staging buffers.
    host_alloc_flags: u32,
}

impl CopyEngine for CudaCopy {
    type Error = CudaError;
    type Staging = CudaStaging;
    type Dst = CudaSlice<u8>;

    fn alloc_staging(&mut self, bytes: usize) -> Result<CudaStaging, CudaError> {
        let done = self.ctx.new_event(None)?;
        self.ctx.bind_to_thread()?;
        // SAFETY: the context is current; cuMemHostAlloc returns `bytes` of page-locked memory
        // or an error.
        let raw = unsafe { result::malloc_host(bytes, self.host_alloc_flags) }?;
        let ptr = NonNull::new(raw as *mut u8).ok_or(CudaError::HostAlloc { bytes })?;
        // SAFETY: `ptr` is `bytes` writable bytes just allocated, not yet shared and not read by
        // any DMA; zeroing them once lets later code take slices of them.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, bytes) };
        Ok(CudaStaging {
            ptr,
            len: bytes,
            done,
        })
    }

    // Relies on the trait's contract: no DMA still reads the buffer (see the SAFETY below).
    unsafe fn free_staging(&mut self, staging: CudaStaging) {
        if self.ctx.bind_to_thread().is_err() {
            return; // leak rather than free in the wrong context
        }
        // SAFETY: `ptr` came from cuMemHostAlloc in this context and is freed once (the handle is
        // consumed); the caller guarantees no DMA reads it any more.
        let _ = unsafe { result::free_host(staging.ptr.as_ptr() as *mut c_void) };
    }

    fn alloc_dst(&mut self, bytes: usize) -> Result<CudaSlice<u8>, CudaError> {
        // SAFETY: uninitialized device memory of `u8`, for which every bit pattern is a value;
        // reading it before the copies land (a download) yields unspecified bytes, not UB.
        Ok(unsafe { self.stream.alloc::<u8>(bytes) }?)
    }

    unsafe fn fill(&mut self, staging: &mut CudaStaging, at: usize, src: &[u8]) {
        debug_assert!(at + src.len() <= staging.len);
        // SAFETY: [at, at + src.len()) lies inside the buffer's `len` initialized bytes (the
        // caller's bound); no DMA reads them (the caller's contract) and no other reference to
        // them exists (we hold `&mut` of the buffer).
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(staging.ptr.as_ptr().add(at), src.len()) };
        copy_parallel(bytes, src);
    }

    unsafe fn copy_async(
        &mut self,
        staging: &mut CudaStaging,
        range: Range<usize>,
        dst: &mut CudaSlice<u8>,
        dst_offset: usize,
    ) -> Result<(), CudaError> {
        let len = range.len();
        debug_assert!(range.end <= staging.len);
        // SAFETY: `range` lies inside the buffer's initialized bytes (the caller's bound); the
        // host does not write them while this shared slice or the DMA reading it lives (the
        // caller's contract).
        let bytes =
            unsafe { std::slice::from_raw_parts(staging.ptr.as_ptr().add(range.start), len) };
        let mut view = dst.slice_mut(dst_offset..dst_offset + len);
        let (dptr, _record) = view.device_ptr_mut(&self.stream);
        // SAFETY: `dptr` is `len` bytes of the destination on this stream's context (cudarc's
        // allocations keep it current); `bytes` is pinned memory the host has finished writing
        // and, by the caller's contract, neither rewrites nor frees before an event recorded
        // after this copy completes — so it outlives the DMA.
        unsafe { result::memcpy_htod_async(dptr, bytes, self.stream.cu_stream()) }?;
        Ok(())
    }

    fn record(&mut self, staging: &mut CudaStaging) -> Result<(), CudaError> {
        Ok(staging.done.record(&self.stream)?)
    }

    fn wait(&mut self, staging: &mut CudaStaging) -> Result<(), CudaError> {
        Ok(staging.done.synchronize()?)
    }
}

/// Uploads GGUF files to one device through a ring of pinned staging buffers, reusable across
/// files (the ring is pinned once).
#[derive(Debug)]
pub struct Uploader {
    gpu: Gpu,
    ring: StagingRing<CudaCopy>,
}

impl Uploader {
    /// Pins the ring on `gpu`'s context; uploads run on `gpu`'s stream.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for options out of range, [`CudaError::HostAlloc`] or
    /// [`CudaError::Driver`] if pinning fails.
    pub fn new(gpu: &Gpu, opts: UploadOptions) -> Result<Self, CudaError> {
        opts.check()?;
        let engine = CudaCopy {
            ctx: gpu.context().clone(),
            stream: gpu.stream().clone(),
            host_alloc_flags: if opts.write_combined {
                sys::CU_MEMHOSTALLOC_WRITECOMBINED
            } else {
                0
            },
        };
        // check() bounds both below by 2 and 64 KiB.
        let nz =
            |v: usize, what| NonZeroUsize::new(v).ok_or(CudaError::Unsupported { what, value: v });
        let ring = StagingRing::new(
            engine,
            nz(opts.staging_buffers, "staging_buffers")?,
            nz(opts.staging_bytes, "staging_bytes")?,
        )?;
        Ok(Self {
            gpu: gpu.clone(),
            ring,
        })
    }

    /// The device and stream uploads run on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Copies every tensor of `gguf` into a device allocation of its own, largest first,
    /// calling `progress` as pieces complete; returns once all bytes are on the device.
    ///
    /// # Errors
    /// [`CudaError::DeviceOutOfMemory`] if the device has too little free memory (nothing is
    /// copied), [`CudaError::Driver`] for an allocation or copy failure. Device memory already
    /// allocated is freed.
    pub fn upload(
        &mut self,
        gguf: &Gguf<'_>,
        progress: impl FnMut(UploadProgress<'_>),
    ) -> Result<DeviceWeights, CudaError> {
        let total = gguf.total_tensor_bytes();
        self.gpu.bind()?;
        let (free, _) = result::mem_get_info()?;
        if total > free as u64 {
            return Err(CudaError::DeviceOutOfMemory {
                needed: total,
                free: free as u64,
            });
        }
        let tensors = self
            .ring
            .upload(gguf, progress)?
            .into_iter()
            .map(|(t, data)| {
                let dt = DeviceTensor {
                    ty: t.ty(),
                    shape: t.shape().to_vec(),
                    data,
                };
                (t.name().to_owned(), dt)
            })
            .collect();
        Ok(DeviceWeights {
            tensors,
            total_bytes: total,
        })
    }
}

/// Copies `src` into `dst` (same length), split over rayon's pool above a few MiB.
fn copy_parallel(dst: &mut [u8], src: &[u8]) {
    const PART: usize = 4 << 20;
    if src.len() <= PART {
        dst.copy_from_slice(src);
    } else {
        dst.par_chunks_mut(PART)
            .zip(src.par_chunks(PART))
            .for_each(|(d, s)| d.copy_from_slice(s));
    }
}

/// Uploads `gguf` to `gpu` with [`UploadOptions::default`] (pins a ring for this call only).
///
/// # Errors
/// As [`Uploader::new`] and [`Uploader::upload`].
pub fn upload_gguf(
    gpu: &Gpu,
    gguf: &Gguf<'_>,
    progress: impl FnMut(UploadProgress<'_>),
) -> Result<DeviceWeights, CudaError> {
    Uploader::new(gpu, UploadOptions::default())?.upload(gguf, progress)
}
