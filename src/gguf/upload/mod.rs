//! Device upload: a parsed GGUF's tensors into device memory through a ring of staging buffers,
//! host copies overlapped with asynchronous copies to the device.
//!
//! * [`StagingRing`], the schedule (pieces, ring slots, one event per buffer,
//!   wait before rewrite, progress in queue order, error and drop safety), generic over a
//!   [`CopyEngine`]: the stream, events and allocations it drives.
//! * `host` (feature `test-util`): `HostEngine`, a copy engine whose device memory is host memory and whose stream
//!   is a worker thread with random delays; it checks the engine contract, so the schedule is
//!   tested without a GPU (tests/gguf_upload_host.rs).
//! * with feature `cuda`: `Uploader`, `upload_gguf`, `DeviceWeights`, `DeviceTensor` and
//!   `UploadOptions`, the ring over CUDA's pinned memory, `cuMemcpyHtoDAsync` and events.

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "test-util")]
mod host;
mod pipeline;

#[cfg(feature = "cuda")]
pub use cuda::{
    upload_gguf, DeviceTensor, DeviceWeights, UploadOptions, Uploader, MAX_STAGING_BUFFERS,
};
#[cfg(feature = "test-util")]
pub use host::{
    HostConfig, HostDst, HostEngine, HostFault, HostOp, HostProbe, HostStaging, UploadError,
    Violation, HOST_DST_POISON,
};
pub use pipeline::{CopyEngine, StagingRing};

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
