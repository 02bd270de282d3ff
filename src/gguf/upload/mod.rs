//! Device upload: a parsed GGUF's tensors into device memory, raw or dequantized on the device.
//!
//! Two ways to reach the device, both generic over the engine that moves the bytes:
//!
//! * **Staged** ([`StagingRing`]): a ring of staging buffers filled from the file by a pool of
//!   fill threads, each filled buffer's pieces copied asynchronously to the device (in the order
//!   fills complete) while the next buffers fill. The schedule, its safety argument and its
//!   progress order are on [`StagingRing`].
//! * **Registered** ([`upload_registered`]): the file's pages themselves are registered for DMA
//!   (page-locked where they are, read-only) and copied straight to the device; no host copy at
//!   all, at the price of pinning the pages first.
//!
//! Either lands each tensor **raw** (its ggml bytes) or **dequantized** ([`DequantTo`]): the raw
//! bytes go to a device staging area and a device kernel converts them into the tensor's f16 or
//! bf16 destination, bit for bit what [`crate::gguf::dequantize_into_f16`] /
//! [`crate::gguf::dequantize_into_bf16`] give on the CPU.
//!
//! Engines ([`CopyEngine`] and its extensions [`DequantEngine`], [`RegisterEngine`]):
//!
//! * `host` (feature `test-util`): `HostEngine`, device memory in host memory, the stream a
//!   worker thread with random delays; it checks the engines' contracts, so the schedules are
//!   tested without a GPU (tests/gguf_upload_host.rs). With feature `cuda-emu` its device
//!   dequantization runs the real kernel on the CPU emulation.
//! * with feature `cuda`: `CudaCopy` (pinned staging buffers or registered file pages,
//!   `cuMemcpyHtoDAsync`, events, and `pkv_dequantize` from kernels/dequant.cu), and on top of
//!   it `Uploader`, `upload_gguf`, `DeviceWeights`, `DeviceTensor`, `UploadOptions`;
//!   `dequantize_on_device` runs the kernel on a tensor already on the device.

#[cfg(feature = "cuda")]
mod cuda;
mod direct;
mod engine;
#[cfg(feature = "test-util")]
mod host;
mod pipeline;
mod plan;
#[cfg(feature = "cuda")]
mod uploader;

#[cfg(feature = "cuda")]
pub use cuda::{
    dequantize_on_device, dequantize_on_device_into, CudaCopy, CudaRegistered, CudaStaging,
};
pub use direct::{upload_registered, upload_registered_dequantized};
pub use engine::{CopyEngine, DequantEngine, RegisterEngine};
#[cfg(feature = "test-util")]
pub use host::{
    HostConfig, HostDst, HostEngine, HostFault, HostOp, HostProbe, HostRegistered, HostStaging,
    UploadError, Violation, HOST_DST_POISON,
};
pub use pipeline::{FillStats, Landed, StagingRing, MAX_FILL_THREADS};
#[cfg(feature = "cuda")]
pub use uploader::{
    upload_gguf, DeviceTensor, DeviceUploadError, DeviceWeights, RegisterTimes, UploadOptions,
    UploadPath, Uploader, MAX_STAGING_BUFFERS,
};

use crate::gguf::GgmlType;

/// What the progress callback is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UploadProgress<'a> {
    /// Bytes of the file's tensors now in device memory (a dequantizing upload counts the
    /// file's bytes it has converted, not the f16/bf16 bytes they became).
    pub done: u64,
    /// Bytes of all tensors in the file.
    pub total: u64,
    /// The tensor the last completed piece belongs to.
    pub tensor: &'a str,
}

/// The type a dequantizing upload lands its tensors in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DequantTo {
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
}

impl DequantTo {
    /// The ggml type the landed tensors have.
    pub fn ggml_type(self) -> GgmlType {
        match self {
            DequantTo::F16 => GgmlType::F16,
            DequantTo::BF16 => GgmlType::BF16,
        }
    }

    /// Bytes per landed element.
    pub const BYTES: usize = 2;
}

/// The source types the device dequantizer converts (`pkv_dequant_supported`); a dequantizing
/// upload refuses a file holding any other before it allocates or copies anything.
pub const DEVICE_DEQUANT_TYPES: [GgmlType; 7] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
];

/// Whether the device dequantizer converts `ty`.
pub fn device_can_dequantize(ty: GgmlType) -> bool {
    DEVICE_DEQUANT_TYPES.contains(&ty)
}

/// Elements in the unit a dequantizing upload may cut a tensor at: a multiple of every
/// supported block size (1, 32, 256), so every piece but a tensor's last is whole blocks and
/// starts on a 16-byte boundary of its f16/bf16 destination.
pub const DEQUANT_GRANULE: u64 = 256;

/// Why an upload through the generic schedules ([`StagingRing`]'s dequantizing upload,
/// [`upload_registered`], [`upload_registered_dequantized`]) failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError<E> {
    /// The engine failed.
    #[error("{0}")]
    Engine(E),
    /// A tensor's type cannot be dequantized on the device ([`DEVICE_DEQUANT_TYPES`]).
    #[error("tensor {tensor}: the device dequantizer does not convert {ty}")]
    NotDequantizable {
        /// Its index in the upload's list.
        tensor: usize,
        /// Its type.
        ty: GgmlType,
    },
    /// A tensor's byte length is not a whole number of its type's blocks.
    #[error("tensor {tensor}: {bytes} bytes are not a whole number of {ty} blocks")]
    PartialBlock {
        /// Its index in the upload's list.
        tensor: usize,
        /// Its type.
        ty: GgmlType,
        /// Its byte length.
        bytes: usize,
    },
    /// The staging buffers (or the registered path's device staging area) are too small for
    /// one cut unit ([`DEQUANT_GRANULE`] elements) of some tensor.
    #[error("staging areas of {have} bytes cannot hold one {needed}-byte unit of 256 elements")]
    StagingTooSmall {
        /// Bytes one unit of the largest cut needs.
        needed: usize,
        /// Bytes available.
        have: usize,
    },
    /// A tensor's range lies outside the registered host memory.
    #[error("tensor {tensor}: bytes {start}..{end} lie outside the {len} registered bytes")]
    OutOfRange {
        /// Its index in the upload's list.
        tensor: usize,
        /// Start of its range.
        start: usize,
        /// End of its range.
        end: usize,
        /// Bytes registered.
        len: usize,
    },
}

impl<E> From<E> for RingError<E> {
    fn from(e: E) -> Self {
        RingError::Engine(e)
    }
}
