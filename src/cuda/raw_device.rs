//! pagedkv's own [`Gpu`] as a [`RawDevice`], so the raw-pointer backend
//! ([`RawBackend`](crate::engine::RawBackend)) also runs on a device pagedkv opened: memory
//! from `cuMemAlloc`, copies and launches on the `Gpu`'s stream.

use super::device::Gpu;
use crate::cuda_raw::{CuStream, DevPtr};
use crate::engine::RawDevice;
use crate::error::{CudaError, EngineError};

// SAFETY: alloc returns cuMemAlloc memory of the primary context (256-byte aligned, at least
// `bytes`, valid until cuMemFree), with that context made current first; copies are queued on
// the Gpu's stream, which `stream` returns and `synchronize` waits for; `bind` makes the
// primary context current.
unsafe impl RawDevice for Gpu {
    fn stream(&self) -> CuStream {
        self.raw_stream()
    }

    fn sm_count(&self) -> usize {
        self.info().sm_count.max(1) as usize
    }

    fn bind(&self) -> Result<(), EngineError> {
        Ok(Gpu::bind(self)?)
    }

    fn alloc(&self, bytes: usize) -> Result<DevPtr, EngineError> {
        Gpu::bind(self)?;
        // SAFETY: the context is current (bind); cuMemAlloc has no other precondition.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes) }.map_err(CudaError::from)?;
        Ok(ptr)
    }

    unsafe fn free(&self, ptr: DevPtr) {
        if Gpu::bind(self).is_err() {
            // Without the context the memory cannot be freed; leaking it is the safe choice.
            return;
        }
        // SAFETY: `ptr` came from cuMemAlloc in this context, is freed once and no queued work
        // uses it (the caller's contract). An error cannot be reported from here.
        let _ = unsafe { cudarc::driver::result::free_sync(ptr) };
    }

    unsafe fn copy_to_device(&self, dst: DevPtr, src: &[u8]) -> Result<(), EngineError> {
        Gpu::bind(self)?;
        // SAFETY: `dst` holds src.len() bytes of device memory of this context and `src`
        // stays unmodified until the stream is synchronised (the caller's contract); the stream
        // is the Gpu's own, alive as long as it.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, self.stream().cu_stream()) }
            .map_err(CudaError::from)?;
        Ok(())
    }

    fn synchronize(&self) -> Result<(), EngineError> {
        Ok(Gpu::synchronize(self)?)
    }
}
