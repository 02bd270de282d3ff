//! Pinning host memory (`pkv_host_register`): swaps to pinned host memory are asynchronous DMA;
//! to pageable memory they are staged by the driver, and a device-to-host copy blocks the
//! calling thread until it has run.

use super::check::check_status;
use super::ffi;
use crate::error::RawError;
use std::ffi::c_void;

/// Page-locks `bytes` of host memory at `ptr` for every device context, with a context current
/// on this thread. On an error the memory stays pageable and usable (and the runtime's last
/// error is cleared: it does not surface as a later launch's status).
///
/// # Safety
/// `ptr` points at `bytes` bytes of host memory the caller allocated, not already registered,
/// that stay allocated until [`host_unregister`] has returned.
///
/// # Errors
/// [`RawError::Launch`] with `PKV_ERR_NULL_POINTER` or `PKV_ERR_INVALID_ARG` (0 bytes), or the
/// runtime's refusal (too much locked memory, no context).
pub unsafe fn host_register(ptr: *mut c_void, bytes: usize) -> Result<(), RawError> {
    // SAFETY: the caller's contract: `ptr` holds `bytes` bytes of its own host memory.
    let status = unsafe { ffi::pkv_host_register(ptr, bytes) };
    check_status("pkv_host_register", status, None)
}

/// Unpins memory [`host_register`] pinned, with a context current on this thread.
///
/// # Safety
/// `ptr` is the address a successful [`host_register`] pinned, and no queued copy still uses
/// the memory.
///
/// # Errors
/// [`RawError::Launch`] with the runtime's refusal (not registered, no context).
pub unsafe fn host_unregister(ptr: *mut c_void) -> Result<(), RawError> {
    // SAFETY: the caller's contract: `ptr` is a registered base no queued work uses.
    let status = unsafe { ffi::pkv_host_unregister(ptr) };
    check_status("pkv_host_unregister", status, None)
}
