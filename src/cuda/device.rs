//! Device probe and the [`Gpu`] handle (context + stream).

use crate::cuda_raw::{check_status, ffi};
use crate::error::CudaError;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use std::sync::Arc;

/// What [`Gpu::open`] found out about the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// The driver's name for the device (e.g. "NVIDIA H100 80GB HBM3").
    pub name: String,
    /// Compute capability, major.
    pub cc_major: i32,
    /// Compute capability, minor.
    pub cc_minor: i32,
    /// Streaming multiprocessors.
    pub sm_count: i32,
    /// Global memory in bytes.
    pub total_mem: usize,
    /// CUDA runtime version linked into this binary (e.g. 13000).
    pub runtime_version: i32,
    /// Driver's CUDA version (e.g. 13000).
    pub driver_version: i32,
}

/// Devices the driver reports.
///
/// # Errors
/// [`CudaError::DriverNotFound`] when libcuda cannot be loaded; [`CudaError::Driver`] when
/// `cuInit` or the count fails (e.g. a driver without devices).
pub fn device_count() -> Result<usize, CudaError> {
    if !culib_present() {
        return Err(CudaError::DriverNotFound);
    }
    Ok(CudaContext::device_count()?.max(0) as usize)
}

fn culib_present() -> bool {
    // SAFETY: is_culib_present only tries to dlopen the driver library's candidate names and
    // drops the handles; it touches no CUDA state, so it is sound to call at any time, from any
    // thread, any number of times.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// One CUDA device's primary context and the stream every wrapper of this module launches on.
///
/// Cheap to clone (two `Arc`s and the info). Work on one `Gpu`'s stream is ordered; use
/// [`Gpu::with_new_stream`] for concurrent streams on the same device.
#[derive(Debug, Clone)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    info: GpuInfo,
}

impl Gpu {
    /// Opens device `ordinal`: checks that the driver library loads, that the device exists,
    /// retains its primary context, creates a stream, and checks that this build has a kernel
    /// image for it.
    ///
    /// # Errors
    /// [`CudaError::DriverNotFound`], [`CudaError::NoDevice`], [`CudaError::Driver`],
    /// [`CudaError::NoKernelImage`], or [`CudaError::Launch`] from the runtime probe.
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        let stream = ctx.new_stream()?;
        let name = ctx.name()?;
        let (cc_major, cc_minor) = ctx.compute_capability()?;
        let total_mem = {
            ctx.bind_to_thread()?;
            let (_free, total) = cudarc::driver::result::mem_get_info()?;
            total
        };
        let driver_version = {
            let mut v = 0i32;
            // SAFETY: cuDriverGetVersion writes one int through the valid pointer; cuInit has
            // run (CudaContext::new), and the library is loaded (culib_present above).
            let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
            r.result()?;
            v
        };
        let (mut rt, mut cc, mut sms) = (0i32, 0i32, 0i32);
        ctx.bind_to_thread()?;
        // SAFETY: the three pointers are valid locals; pkv_probe runs synchronous runtime-API
        // queries on the device of the current context, which bind_to_thread just set to this
        // device's primary context.
        let status = unsafe { ffi::pkv_probe(&mut rt, &mut cc, &mut sms) };
        // cudaErrorNoKernelImageForDevice (209) / cudaErrorInvalidDeviceFunction (98).
        if status == 209 || status == 98 {
            return Err(CudaError::NoKernelImage {
                major: cc_major,
                minor: cc_minor,
            });
        }
        check_status("pkv_probe", status, None).map_err(CudaError::from)?;
        Ok(Self {
            ctx,
            stream,
            info: GpuInfo {
                ordinal,
                name,
                cc_major,
                cc_minor,
                sm_count: sms,
                total_mem,
                runtime_version: rt,
                driver_version,
            },
        })
    }

    /// The same device and context with a new stream of its own.
    ///
    /// # Errors
    /// [`CudaError::Driver`] if the stream cannot be created.
    pub fn with_new_stream(&self) -> Result<Self, CudaError> {
        Ok(Self {
            ctx: self.ctx.clone(),
            stream: self.ctx.new_stream()?,
            info: self.info.clone(),
        })
    }

    /// What the probe found.
    pub fn info(&self) -> &GpuInfo {
        &self.info
    }
    /// The primary context (cudarc).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// The stream every wrapper launches on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Makes the primary context current on this thread (before any raw launch: the kernels
    /// run in the context current on the calling thread).
    ///
    /// # Errors
    /// [`CudaError::Driver`] if the driver refuses.
    pub fn bind(&self) -> Result<(), CudaError> {
        Ok(self.ctx.bind_to_thread()?)
    }

    /// The stream as the raw launches take it ([`crate::cuda_raw::CuStream`], a `CUstream`).
    pub fn raw_stream(&self) -> crate::cuda_raw::CuStream {
        self.stream.cu_stream() as *mut std::ffi::c_void
    }

    /// Waits for all work queued on this handle's stream.
    ///
    /// # Errors
    /// [`CudaError::Driver`] with the first asynchronous error of the stream's work (a kernel
    /// fault surfaces here).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        Ok(self.stream.synchronize()?)
    }

    /// Copies a host slice into a new device buffer (ordered on this stream).
    ///
    /// # Errors
    /// [`CudaError::Driver`] on allocation or copy failure.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.memcpy_stod(host)?)
    }

    /// Copies a device buffer back into a new `Vec` (waits for the stream).
    ///
    /// # Errors
    /// [`CudaError::Driver`] on copy failure, including an earlier kernel fault on the stream.
    pub fn download<T: DeviceRepr>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>, CudaError> {
        Ok(self.stream.memcpy_dtov(dev)?)
    }

    /// A zeroed device buffer of `len` elements.
    ///
    /// # Errors
    /// [`CudaError::Driver`] on allocation failure.
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.alloc_zeros(len)?)
    }
}
