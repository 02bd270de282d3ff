//! The CUDA engine (feature `cuda`): [`CudaCopy`], a [`CopyEngine`] of pinned staging buffers,
//! `cuMemcpyHtoDAsync` on one stream and one `CUevent` per buffer; a [`RegisterEngine`] over
//! `cuMemHostRegister` (read-only) and a [`DequantEngine`] over `pkv_dequantize`
//! (kernels/dequant.cu). [`dequantize_on_device`] is the kernel alone, for tensors already on
//! the device.
//!
//! A DMA engine copies to the device asynchronously only from page-locked memory; from pageable
//! memory (an mmapped file) the driver stages the copy itself and the call returns only after
//! it, which is how llama.cpp's mmap path uploads. Here either fill threads copy each piece from
//! the file into a pinned buffer and its DMA is queued as soon as the buffer is full (the
//! staged path, [`super::StagingRing`]), or the file's own pages are registered and DMAed
//! directly (the registered path, [`super::upload_registered`]).

use super::engine::{CopyEngine, DequantEngine, RegisterEngine};
use super::{device_can_dequantize, DequantTo};
use crate::cuda::{ffi, Gpu};
use crate::error::CudaError;
use crate::gguf::GgmlType;
use cudarc::driver::{
    result, sys, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
};
use std::ffi::{c_void, CStr};
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
// for writes); CudaEvent is Send. Moving it to another thread (a fill thread) moves that
// ownership; the pinned memory is valid in any thread of the process.
unsafe impl Send for CudaStaging {}

/// Host memory registered for DMA by [`CudaCopy`]: `len` bytes at `ptr`. Dropping it without
/// [`RegisterEngine::unregister`] leaves them registered (pinned until the process exits).
#[derive(Debug)]
pub struct CudaRegistered {
    ptr: NonNull<u8>,
    len: usize,
}

/// The CUDA engine: pinned staging buffers on a context, DMAs, conversions and events on one
/// stream, destinations allocated on that stream.
#[derive(Debug)]
pub struct CudaCopy {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// `cuMemHostAlloc` flags of the staging buffers.
    host_alloc_flags: u32,
    /// How long the last `register` and `unregister` took (for the bench).
    pub(crate) last_register: Duration,
    pub(crate) last_unregister: Duration,
}

impl CudaCopy {
    /// An engine on `gpu`'s context and stream; staging buffers write-combined or not.
    pub(crate) fn new(gpu: &Gpu, write_combined: bool) -> Self {
        Self {
            ctx: gpu.context().clone(),
            stream: gpu.stream().clone(),
            host_alloc_flags: if write_combined {
                sys::CU_MEMHOSTALLOC_WRITECOMBINED
            } else {
                0
            },
            last_register: Duration::ZERO,
            last_unregister: Duration::ZERO,
        }
    }
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
        // The driver refuses a 0-byte allocation: an empty tensor gets one byte, below.
        let slice = unsafe { self.stream.alloc::<u8>(bytes.max(1)) }?;
        if bytes > 0 {
            return Ok(slice);
        }
        let ptr = slice.leak();
        // SAFETY: `ptr` is the allocation just made on this stream, whose ownership `leak` gave
        // up; the new slice takes it over (its drop frees it, once) and, of length 0, exposes
        // none of its byte.
        Ok(unsafe { self.stream.upgrade_device_ptr::<u8>(ptr, 0) })
    }

    unsafe fn fill(staging: &mut CudaStaging, at: usize, src: &[u8]) {
        debug_assert!(at + src.len() <= staging.len);
        // SAFETY: [at, at + src.len()) lies inside the buffer's `len` initialized bytes (the
        // caller's bound); no DMA reads them (the caller's contract) and no other reference to
        // them exists (we hold `&mut` of the buffer).
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(staging.ptr.as_ptr().add(at), src.len()) };
        bytes.copy_from_slice(src);
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

impl DequantEngine for CudaCopy {
    unsafe fn dequantize_async(
        &mut self,
        src: &CudaSlice<u8>,
        src_offset: usize,
        ty: GgmlType,
        n_elements: usize,
        dst: &mut CudaSlice<u8>,
        dst_elem: usize,
        to: DequantTo,
    ) -> Result<(), CudaError> {
        let bytes = ty
            .bytes_for(n_elements as u64)
            .and_then(|b| usize::try_from(b).ok())
            .ok_or(CudaError::Unsupported {
                what: "dequantize: elements not a whole number of blocks",
                value: n_elements,
            })?;
        let out = dst_elem * DequantTo::BYTES..(dst_elem + n_elements) * DequantTo::BYTES;
        launch_dequant(
            &self.ctx,
            &self.stream,
            src,
            src_offset..src_offset + bytes,
            ty,
            n_elements,
            dst,
            out,
            to,
        )
    }
}

impl RegisterEngine for CudaCopy {
    type Registered = CudaRegistered;

    unsafe fn register(&mut self, host: &[u8]) -> Result<CudaRegistered, CudaError> {
        let ptr = NonNull::new(host.as_ptr() as *mut u8)
            .ok_or(CudaError::HostAlloc { bytes: host.len() })?;
        self.ctx.bind_to_thread()?;
        let t0 = Instant::now();
        // SAFETY: `host` is `host.len()` readable bytes that, by the caller's contract, stay
        // mapped and unmodified until unregistered (or forever, if leaked). READ_ONLY: the
        // device only reads them, and a read-only mapping (an mmapped model file) can be
        // registered only so; the driver pins the pages, it never writes them.
        unsafe {
            sys::cuMemHostRegister_v2(
                ptr.as_ptr().cast(),
                host.len(),
                sys::CU_MEMHOSTREGISTER_READ_ONLY,
            )
        }
        .result()?;
        self.last_register = t0.elapsed();
        Ok(CudaRegistered {
            ptr,
            len: host.len(),
        })
    }

    unsafe fn copy_registered_async(
        &mut self,
        registered: &mut CudaRegistered,
        range: Range<usize>,
        dst: &mut CudaSlice<u8>,
        dst_offset: usize,
    ) -> Result<(), CudaError> {
        debug_assert!(range.end <= registered.len);
        let len = range.len();
        // SAFETY: `range` lies inside the registration (the caller's bound), whose bytes stay
        // mapped and unmodified while it is registered (register's contract).
        let bytes =
            unsafe { std::slice::from_raw_parts(registered.ptr.as_ptr().add(range.start), len) };
        let mut view = dst.slice_mut(dst_offset..dst_offset + len);
        let (dptr, _record) = view.device_ptr_mut(&self.stream);
        // SAFETY: `dptr` is `len` bytes of the destination; `bytes` is registered (page-locked)
        // memory that the caller does not unregister before a synchronize after this copy.
        unsafe { result::memcpy_htod_async(dptr, bytes, self.stream.cu_stream()) }?;
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), CudaError> {
        Ok(self.stream.synchronize()?)
    }

    unsafe fn unregister(&mut self, registered: CudaRegistered) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        let t0 = Instant::now();
        // SAFETY: the pointer was registered by `register` in this context and is unregistered
        // once (the handle is consumed); no copy from it is pending (the caller's contract).
        unsafe { sys::cuMemHostUnregister(registered.ptr.as_ptr().cast()) }.result()?;
        self.last_unregister = t0.elapsed();
        Ok(())
    }
}

/// Queues `pkv_dequantize` of `src[src_bytes]` (`n` elements of `ty`) into `dst[dst_bytes]`.
#[allow(clippy::too_many_arguments)]
fn launch_dequant(
    ctx: &CudaContext,
    stream: &CudaStream,
    src: &CudaSlice<u8>,
    src_bytes: Range<usize>,
    ty: GgmlType,
    n: usize,
    dst: &mut CudaSlice<u8>,
    dst_bytes: Range<usize>,
    to: DequantTo,
) -> Result<(), CudaError> {
    if !device_can_dequantize(ty) {
        return Err(unsupported_type(ty));
    }
    if src_bytes.end > src.len() || dst_bytes.end > dst.len() {
        return Err(CudaError::Unsupported {
            what: "dequantize: range past its buffer, end byte",
            value: src_bytes.end.max(dst_bytes.end),
        });
    }
    let n = i64::try_from(n).map_err(|_| CudaError::Unsupported {
        what: "dequantize: elements",
        value: n,
    })?;
    let dtype = match to {
        DequantTo::F16 => ffi::PKV_DTYPE_F16,
        DequantTo::BF16 => ffi::PKV_DTYPE_BF16,
    };
    ctx.bind_to_thread()?;
    let s = src.slice(src_bytes);
    let (sp, _gs) = s.device_ptr(stream);
    let mut d = dst.slice_mut(dst_bytes);
    let (dp, _gd) = d.device_ptr_mut(stream);
    // SAFETY: the context is current; `sp` / `dp` are the checked ranges of two device
    // allocations of this context (distinct: one is borrowed shared, the other exclusively),
    // sized for `n` elements each way; the launch is queued on `stream`, after the work that
    // wrote `src`, and cudarc's guards order later users of both buffers after it. The launcher
    // checks types, sizes and alignment itself and launches nothing it refuses.
    let status = unsafe {
        ffi::pkv_dequantize(
            dp as *mut c_void,
            dtype as i32,
            sp as *const c_void,
            ty.id() as i32,
            n,
            stream.cu_stream() as *mut c_void,
        )
    };
    if status == 0 {
        return Ok(());
    }
    // SAFETY: pkv_status_string returns a pointer to a static NUL-terminated string (a literal
    // or cudaGetErrorString's static table) for every int, never NULL; no side effects.
    let msg = unsafe { CStr::from_ptr(ffi::pkv_status_string(status)) };
    Err(CudaError::Launch {
        op: "pkv_dequantize",
        status,
        message: msg.to_str().unwrap_or("(non-UTF-8 message)"),
    })
}

/// Dequantizes `src` (a tensor's raw bytes on the device: whole blocks of `ty`, e.g. an
/// [`super::UploadOptions`]-raw upload's [`super::DeviceTensor::data`]) into a new device buffer
/// of 2-byte values of `to`, on `gpu`'s stream (asynchronous: later work on the stream sees the
/// result). Bit for bit [`crate::gguf::dequantize_into_f16`] /
/// [`crate::gguf::dequantize_into_bf16`].
///
/// # Errors
/// [`CudaError::Unsupported`] for a type outside [`super::DEVICE_DEQUANT_TYPES`] or bytes that
/// are not whole blocks; [`CudaError::Driver`] / [`CudaError::Launch`] from the allocation or
/// launch.
pub fn dequantize_on_device(
    gpu: &Gpu,
    ty: GgmlType,
    src: &CudaSlice<u8>,
    to: DequantTo,
) -> Result<CudaSlice<u8>, CudaError> {
    let n = whole_blocks(ty, src.len())?;
    // SAFETY: uninitialized device bytes (every bit pattern is a u8); the conversion queued
    // next on the same stream writes every one of them before anything can read them.
    let mut dst = unsafe { gpu.stream().alloc::<u8>((n * DequantTo::BYTES).max(1)) }?;
    dequantize_on_device_into(gpu, ty, src, &mut dst, to)?;
    Ok(dst)
}

/// As [`dequantize_on_device`], into `dst` (at least 2 bytes per element; the first
/// `2 * elements` bytes are written).
///
/// # Errors
/// As [`dequantize_on_device`], and [`CudaError::Unsupported`] for a `dst` too small.
pub fn dequantize_on_device_into(
    gpu: &Gpu,
    ty: GgmlType,
    src: &CudaSlice<u8>,
    dst: &mut CudaSlice<u8>,
    to: DequantTo,
) -> Result<(), CudaError> {
    let n = whole_blocks(ty, src.len())?;
    if dst.len() < n * DequantTo::BYTES {
        return Err(CudaError::Unsupported {
            what: "dequantize: destination bytes",
            value: dst.len(),
        });
    }
    launch_dequant(
        gpu.context(),
        gpu.stream(),
        src,
        0..src.len(),
        ty,
        n,
        dst,
        0..n * DequantTo::BYTES,
        to,
    )
}

/// The refusal of a type the device dequantizer does not convert.
fn unsupported_type(ty: GgmlType) -> CudaError {
    CudaError::Unsupported {
        what: "device dequantization of ggml type id",
        value: ty.id() as usize,
    }
}

/// Elements in `bytes` of `ty`, or the refusal of a type the device cannot dequantize (first:
/// no byte count makes it work) or of bytes that are not whole blocks.
fn whole_blocks(ty: GgmlType, bytes: usize) -> Result<usize, CudaError> {
    if !device_can_dequantize(ty) {
        return Err(unsupported_type(ty));
    }
    let ts = ty.type_size() as usize;
    if bytes % ts != 0 {
        return Err(CudaError::Unsupported {
            what: "dequantize: bytes not a whole number of blocks",
            value: bytes,
        });
    }
    Ok(bytes / ts * ty.block_size() as usize)
}
