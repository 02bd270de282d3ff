//! Device upload (feature `cuda`): a parsed GGUF's tensors into device memory through a ring of
//! pinned staging buffers, host copies overlapped with the DMA.
//!
//! # The pipeline (n-buffered staging, as in NVIDIA's "How to Overlap Data Transfers")
//!
//! A DMA engine copies to the device asynchronously only from page-locked memory; from pageable
//! memory (an mmapped file) the driver stages the copy itself and the call returns only after
//! it, which is how llama.cpp's mmap path uploads. Here the tensors, largest first
//! ([`Gguf::tensors_largest_first`]), are cut into pieces of at most one staging buffer; the
//! host copies the next piece from the file into ring buffer `k mod n` (spread over rayon's pool:
//! one core's memcpy from the page cache is slower than a PCIe 5 DMA) and queues its
//! `cuMemcpyHtoDAsync` on the stream at once, while the DMAs of the buffers filled before run.
//! Small tensors share a buffer; every piece is its own DMA straight into its tensor's device
//! allocation, so nothing is copied twice on the device.
//!
//! # Never overwritten early
//!
//! Each staging buffer has one event, recorded on the stream right after every DMA that reads
//! the buffer (the stream runs copies in order, so the event's completion means every DMA from
//! that buffer has finished). The host synchronizes on that event before it writes the buffer
//! again, and before it frees it. Recording after each piece, not once per fill, keeps the
//! invariant true at every instant, so an error or a panicking progress callback mid-upload
//! leaves a ring that is safe to reuse and to drop.
//!
//! # Progress
//!
//! The callback sees bytes whose DMA has *completed* (observed through those events), in the
//! order they were queued; its last call reports `done == total`.

use super::{GgmlType, Gguf};
use crate::cuda::Gpu;
use crate::error::CudaError;
use cudarc::driver::{result, sys, CudaEvent, CudaSlice, DevicePtrMut};
use rayon::prelude::*;
use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::NonNull;

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

/// What the progress callback is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UploadProgress<'a> {
    /// Bytes now in device memory.
    pub done: u64,
    /// Bytes of all tensors.
    pub total: u64,
    /// The tensor the last completed piece belongs to.
    pub tensor: &'a str,
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

/// One pinned staging buffer of the ring.
#[derive(Debug)]
struct Staging {
    /// `len` bytes from `cuMemHostAlloc`, owned. The host writes them only once `done` has
    /// completed; DMAs queued since then read only bytes the host finished writing.
    ptr: NonNull<u8>,
    len: usize,
    /// Recorded after every DMA that reads this buffer: complete => no DMA reads it.
    done: CudaEvent,
}

// SAFETY: the pinned memory is owned by this value alone and only reached through `&mut` of the
// owning `Uploader`; CudaEvent is Send. Moving it to another thread moves that ownership.
unsafe impl Send for Staging {}

impl Drop for Staging {
    fn drop(&mut self) {
        // A DMA may still read the memory: wait (on failure leak rather than free under a DMA).
        if self.done.synchronize().is_err() || self.done.context().bind_to_thread().is_err() {
            return;
        }
        // SAFETY: `ptr` came from cuMemHostAlloc in this event's context, is freed once (here),
        // and no DMA reads it any more (`done`, recorded after each, has completed).
        let _ = unsafe { result::free_host(self.ptr.as_ptr() as *mut c_void) };
    }
}

/// Uploads GGUF files to one device through a ring of pinned staging buffers, reusable across
/// files (the ring is pinned once).
#[derive(Debug)]
pub struct Uploader {
    gpu: Gpu,
    /// Fill `k` of an upload goes to `ring[k % ring.len()]`.
    ring: Vec<Staging>,
}

impl Uploader {
    /// Pins the ring on `gpu`'s context; uploads run on `gpu`'s stream.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for options out of range, [`CudaError::HostAlloc`] or
    /// [`CudaError::Driver`] if pinning fails.
    pub fn new(gpu: &Gpu, opts: UploadOptions) -> Result<Self, CudaError> {
        opts.check()?;
        let flags = if opts.write_combined {
            sys::CU_MEMHOSTALLOC_WRITECOMBINED
        } else {
            0
        };
        let mut ring = Vec::with_capacity(opts.staging_buffers);
        for _ in 0..opts.staging_buffers {
            let done = gpu.context().new_event(None)?;
            gpu.context().bind_to_thread()?;
            // SAFETY: the context is current; cuMemHostAlloc returns `staging_bytes` of
            // page-locked memory or an error.
            let raw = unsafe { result::malloc_host(opts.staging_bytes, flags) }?;
            let ptr = NonNull::new(raw as *mut u8).ok_or(CudaError::HostAlloc {
                bytes: opts.staging_bytes,
            })?;
            // SAFETY: `ptr` is `staging_bytes` writable bytes just allocated, not yet shared and
            // not read by any DMA; zeroing them once lets later code take `&mut [u8]` of them.
            unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, opts.staging_bytes) };
            ring.push(Staging {
                ptr,
                len: opts.staging_bytes,
                done,
            });
        }
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
        mut progress: impl FnMut(UploadProgress<'_>),
    ) -> Result<DeviceWeights, CudaError> {
        let order = gguf.tensors_largest_first();
        let total = gguf.total_tensor_bytes();
        self.gpu.bind()?;
        let (free, _) = result::mem_get_info()?;
        if total > free as u64 {
            return Err(CudaError::DeviceOutOfMemory {
                needed: total,
                free: free as u64,
            });
        }
        let stream = self.gpu.stream().clone();
        // Every destination first, largest first (least fragmentation; out of memory before
        // any copy rather than after most of them).
        let mut dst = Vec::with_capacity(order.len());
        for t in &order {
            // SAFETY: uninitialized device memory; the loop below queues a DMA for every byte of
            // it before the returned DeviceWeights exists, and on an error it is freed unread.
            dst.push(unsafe { stream.alloc::<u8>(t.n_bytes()) }?);
        }
        let n = self.ring.len();
        // Pieces (index into `order`, bytes) whose completion `ring[i].done` will show.
        let mut pending: Vec<Vec<(usize, usize)>> = vec![Vec::new(); n];
        let mut done = 0u64;
        let mut report = |pieces: &mut Vec<(usize, usize)>| {
            for (ti, len) in pieces.drain(..) {
                done += len as u64;
                progress(UploadProgress {
                    done,
                    total,
                    tensor: order[ti].name(),
                });
            }
        };
        let (mut slot, mut fill) = (0usize, 0usize);
        self.ring[0].done.synchronize()?;
        for (ti, t) in order.iter().enumerate() {
            let data = t.data();
            let mut off = 0;
            while off < data.len() {
                if fill == self.ring[slot].len {
                    slot = (slot + 1) % n;
                    fill = 0;
                    self.ring[slot].done.synchronize()?;
                    report(&mut pending[slot]);
                }
                let stage = &mut self.ring[slot];
                let len = (data.len() - off).min(stage.len - fill);
                // SAFETY: [fill, fill + len) lies inside the buffer's `len` bytes; no DMA reads
                // it (`done` completed before this fill began, and this fill's DMAs read only
                // [0, fill)), and no other reference to it exists (we hold `&mut self`).
                let bytes =
                    unsafe { std::slice::from_raw_parts_mut(stage.ptr.as_ptr().add(fill), len) };
                copy_parallel(bytes, &data[off..off + len]);
                let mut view = dst[ti].slice_mut(off..off + len);
                let (dptr, _record) = view.device_ptr_mut(&stream);
                // SAFETY: `dptr` is `len` bytes of this tensor's allocation on this stream's
                // context (bound above; cudarc's allocations keep it current); `bytes` is pinned
                // memory the host has finished writing and will not touch until `done`,
                // recorded right after this copy, completes — so it outlives the DMA.
                unsafe { result::memcpy_htod_async(dptr, bytes, stream.cu_stream()) }?;
                stage.done.record(&stream)?;
                pending[slot].push((ti, len));
                fill += len;
                off += len;
            }
        }
        // Wait for the oldest fill first so progress stays in queue order.
        for k in 1..=n {
            let s = (slot + k) % n;
            self.ring[s].done.synchronize()?;
            report(&mut pending[s]);
        }
        let tensors = order
            .iter()
            .zip(dst)
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
