//! [`Uploader`] (feature `cuda`): GGUF files to one device, staged or registered, raw or
//! dequantized, with the device-memory check and the result map ([`DeviceWeights`]).

use super::cuda::CudaCopy;
use super::{
    device_can_dequantize, upload_registered, upload_registered_dequantized, DequantTo, FillStats,
    RingError, StagingRing, UploadProgress, MAX_FILL_THREADS,
};
use crate::cuda::Gpu;
use crate::error::CudaError;
use crate::gguf::{GgmlType, Gguf, TensorInfo};
use cudarc::driver::{result, CudaSlice};
use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::ops::Range;
use std::time::Duration;

/// Most staging buffers a ring may have.
pub const MAX_STAGING_BUFFERS: usize = 64;

/// How the bytes reach the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UploadPath {
    /// Fill threads copy the file into a ring of pinned buffers, DMA out of them
    /// ([`super::StagingRing`]).
    Staged,
    /// Register the file's pages for DMA (read-only, in place) and DMA straight from them
    /// ([`super::upload_registered`]); each upload registers and unregisters.
    Registered,
}

/// How an [`Uploader`] moves tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UploadOptions {
    /// The path.
    pub path: UploadPath,
    /// Pinned buffers in the staged ring, 2 to [`MAX_STAGING_BUFFERS`] (the registered path
    /// allocates no ring and ignores it: checked only when staged).
    pub staging_buffers: usize,
    /// Bytes per staging buffer, 64 KiB to 2 GiB: the largest single DMA of the staged path;
    /// also the size of the registered path's device staging area when dequantizing.
    pub staging_bytes: usize,
    /// Allocate the staged ring write-combined (the host only writes it, the device only reads
    /// it).
    pub write_combined: bool,
    /// Fill threads of the staged path, 0 (the caller fills) to [`MAX_FILL_THREADS`].
    pub fill_threads: usize,
    /// Land tensors dequantized to f16/bf16 on the device (`None`: the raw ggml bytes).
    pub dequantize: Option<DequantTo>,
}

impl Default for UploadOptions {
    /// Staged through 16 write-combined buffers of 16 MiB, filled by as many threads as the
    /// machine has cores, up to 8; raw.
    fn default() -> Self {
        Self {
            path: UploadPath::Staged,
            staging_buffers: 16,
            staging_bytes: 16 << 20,
            write_combined: true,
            fill_threads: std::thread::available_parallelism()
                .map_or(1, NonZeroUsize::get)
                .min(8),
            dequantize: None,
        }
    }
}

impl UploadOptions {
    /// Checks the ranges documented on the fields.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] naming the field out of range.
    pub fn check(&self) -> Result<(), CudaError> {
        if self.path == UploadPath::Staged
            && !(2..=MAX_STAGING_BUFFERS).contains(&self.staging_buffers)
        {
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
        if self.fill_threads > MAX_FILL_THREADS {
            return Err(CudaError::Unsupported {
                what: "fill_threads",
                value: self.fill_threads,
            });
        }
        Ok(())
    }
}

/// One tensor in device memory.
#[derive(Debug)]
pub struct DeviceTensor {
    /// Its type on the device: the file's, or F16 / BF16 after a dequantizing upload.
    ty: GgmlType,
    /// Its type in the file.
    file_ty: GgmlType,
    /// Innermost dimension first, as in the file.
    shape: Vec<u64>,
    /// The tensor's bytes: `ty.bytes_for(product of shape)` of them.
    data: CudaSlice<u8>,
}

impl DeviceTensor {
    /// Its type on the device (F16 / BF16 when the upload dequantized it).
    pub fn ty(&self) -> GgmlType {
        self.ty
    }
    /// Its type in the file.
    pub fn file_ty(&self) -> GgmlType {
        self.file_ty
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
    /// Bytes of all tensors on the device.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }
    /// The map itself.
    pub fn into_map(self) -> HashMap<String, DeviceTensor> {
        self.tensors
    }
}

/// Why an [`Uploader`] upload failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceUploadError {
    /// A CUDA failure, the device-memory check included.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// A dequantizing upload met a type the device dequantizer does not convert (nothing was
    /// allocated or copied).
    #[error(
        "tensor {tensor}: the device dequantizer does not convert {ty} (it converts F32, F16, \
         BF16, Q4_0, Q8_0, Q4_K and Q6_K); upload it raw"
    )]
    NotDequantizable {
        /// The tensor's name.
        tensor: String,
        /// Its type.
        ty: GgmlType,
    },
    /// The schedule refused a tensor (a length or range a parsed file cannot have).
    #[error("tensor {tensor}: {reason}")]
    Refused {
        /// The tensor's name.
        tensor: String,
        /// The schedule's words.
        reason: String,
    },
}

/// Time the last registered upload spent registering and unregistering the file's pages (the
/// rest of its wall time is the DMAs and conversions).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RegisterTimes {
    /// `cuMemHostRegister` of the tensor data.
    pub register: Duration,
    /// `cuMemHostUnregister`.
    pub unregister: Duration,
}

/// The engine, with the staging ring when the path is staged.
#[derive(Debug)]
enum Engine {
    Staged(StagingRing<CudaCopy>),
    Registered(CudaCopy),
}

/// Uploads GGUF files to one device, reusable across files (a staged ring is pinned once).
#[derive(Debug)]
pub struct Uploader {
    gpu: Gpu,
    opts: UploadOptions,
    engine: Engine,
}

impl Uploader {
    /// An uploader on `gpu`'s context and stream; a staged one pins its ring now.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for options out of range, [`CudaError::HostAlloc`] or
    /// [`CudaError::Driver`] if pinning fails.
    pub fn new(gpu: &Gpu, opts: UploadOptions) -> Result<Self, CudaError> {
        opts.check()?;
        let engine = CudaCopy::new(gpu, opts.write_combined);
        let nz =
            |v: usize, what| NonZeroUsize::new(v).ok_or(CudaError::Unsupported { what, value: v });
        let engine = match opts.path {
            UploadPath::Staged => {
                // check() bounds both below by 2 and 64 KiB.
                let mut ring = StagingRing::new(
                    engine,
                    nz(opts.staging_buffers, "staging_buffers")?,
                    nz(opts.staging_bytes, "staging_bytes")?,
                )?;
                ring.set_fill_threads(opts.fill_threads);
                Engine::Staged(ring)
            }
            UploadPath::Registered => Engine::Registered(engine),
        };
        Ok(Self {
            gpu: gpu.clone(),
            opts,
            engine,
        })
    }

    /// The device and stream uploads run on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The options it was made with.
    pub fn options(&self) -> &UploadOptions {
        &self.opts
    }

    /// What the last staged upload's fills did (`None` when registered); all zero after an
    /// upload refused before its first fill (a type the device cannot dequantize, too little
    /// device memory, a schedule's refusal), never the upload's before.
    pub fn fill_stats(&self) -> Option<FillStats> {
        match &self.engine {
            Engine::Staged(r) => Some(r.last_stats()),
            Engine::Registered(_) => None,
        }
    }

    /// Register / unregister times of the last registered upload (`None` when staged); zero
    /// for a step it did not complete (an upload refused before it registered, a failed
    /// unregister), never the upload's before.
    pub fn register_times(&self) -> Option<RegisterTimes> {
        match &self.engine {
            Engine::Registered(e) => Some(RegisterTimes {
                register: e.last_register,
                unregister: e.last_unregister,
            }),
            Engine::Staged(_) => None,
        }
    }

    /// Copies every tensor of `gguf` into a device allocation of its own, largest first, raw or
    /// dequantized as the options say, calling `progress` as pieces complete (the file's
    /// bytes); returns once everything is on the device.
    ///
    /// # Errors
    /// [`DeviceUploadError::NotDequantizable`] (nothing allocated),
    /// [`CudaError::DeviceOutOfMemory`] if the device has too little free memory for the tensors
    /// and the device staging area (nothing copied), [`CudaError::Driver`] /
    /// [`CudaError::Launch`] for an allocation, copy, registration or conversion failure.
    /// Device memory already allocated is freed.
    pub fn upload(
        &mut self,
        gguf: &Gguf<'_>,
        mut progress: impl FnMut(UploadProgress<'_>),
    ) -> Result<DeviceWeights, DeviceUploadError> {
        // Whatever happens below, the stats describe this upload: a refusal before the ring or
        // the registration is reached leaves them zero, not the previous upload's.
        self.clear_stats();
        let order: Vec<TensorInfo<'_>> =
            gguf.tensors_largest_first().into_iter().copied().collect();
        let to = self.opts.dequantize;
        // Device bytes: every landed tensor, plus the staging area of a dequantizing upload.
        let mut needed = 0u64;
        for t in &order {
            needed += match to {
                None => t.n_bytes() as u64,
                Some(_) if !device_can_dequantize(t.ty()) => {
                    return Err(DeviceUploadError::NotDequantizable {
                        tensor: t.name().to_owned(),
                        ty: t.ty(),
                    })
                }
                Some(_) => t.n_elements() * DequantTo::BYTES as u64,
            };
        }
        if to.is_some() {
            needed += match &self.engine {
                Engine::Staged(r) => (r.staging_bytes().next_multiple_of(16) * r.buffers()) as u64,
                Engine::Registered(_) => self.opts.staging_bytes as u64,
            };
        }
        self.gpu.bind()?;
        let (free, _) = result::mem_get_info().map_err(CudaError::from)?;
        if needed > free as u64 {
            return Err(CudaError::DeviceOutOfMemory {
                needed,
                free: free as u64,
            }
            .into());
        }
        let total = gguf.total_tensor_bytes();
        let mut report = |i: usize, done: u64| {
            progress(UploadProgress {
                done,
                total,
                tensor: order[i].name(),
            })
        };
        let refused = |e: RingError<CudaError>| ring_error(e, &order);
        let landed: Vec<CudaSlice<u8>> = match (&mut self.engine, to) {
            (Engine::Staged(ring), None) => {
                let data: Vec<&[u8]> = order.iter().map(TensorInfo::data).collect();
                ring.upload_slices(&data, report)?
            }
            (Engine::Staged(ring), Some(to)) => {
                let data: Vec<(GgmlType, &[u8])> =
                    order.iter().map(|t| (t.ty(), t.data())).collect();
                ring.upload_slices_dequantized(&data, to, report)
                    .map_err(refused)?
            }
            (Engine::Registered(engine), to) => {
                let (host, ranges) = data_section(gguf, &order)?;
                match to {
                    None => upload_registered(engine, host, &ranges, report).map_err(refused)?,
                    Some(to) => {
                        let typed: Vec<(GgmlType, Range<usize>)> =
                            order.iter().map(TensorInfo::ty).zip(ranges).collect();
                        let stage = NonZeroUsize::new(self.opts.staging_bytes).ok_or(
                            CudaError::Unsupported {
                                what: "staging_bytes",
                                value: 0,
                            },
                        )?;
                        upload_registered_dequantized(engine, host, &typed, to, stage, &mut report)
                            .map_err(refused)?
                    }
                }
            }
        };
        let mut bytes = 0u64;
        let tensors = order
            .iter()
            .zip(landed)
            .map(|(t, data)| {
                bytes += data.len() as u64;
                let dt = DeviceTensor {
                    ty: to.map_or(t.ty(), DequantTo::ggml_type),
                    file_ty: t.ty(),
                    shape: t.shape().to_vec(),
                    data,
                };
                (t.name().to_owned(), dt)
            })
            .collect();
        Ok(DeviceWeights {
            tensors,
            total_bytes: bytes,
        })
    }
}

impl Uploader {
    /// Zeroes what [`Uploader::fill_stats`] and [`Uploader::register_times`] report.
    fn clear_stats(&mut self) {
        match &mut self.engine {
            Engine::Staged(ring) => ring.clear_stats(),
            Engine::Registered(engine) => {
                engine.last_register = Duration::ZERO;
                engine.last_unregister = Duration::ZERO;
            }
        }
    }
}

/// The file's data section (what the registered path registers) and each tensor's range in it.
fn data_section<'a>(
    gguf: &Gguf<'a>,
    order: &[TensorInfo<'a>],
) -> Result<(&'a [u8], Vec<Range<usize>>), DeviceUploadError> {
    let file = gguf.file_bytes();
    let start = usize::try_from(gguf.data_offset())
        .ok()
        .filter(|&s| s <= file.len())
        .unwrap_or(file.len());
    let host = &file[start..];
    let mut ranges = Vec::with_capacity(order.len());
    for t in order {
        // The parser checked that every tensor lies inside the data section.
        let off = usize::try_from(t.offset()).unwrap_or(usize::MAX);
        let r = off..off.saturating_add(t.n_bytes());
        if r.end > host.len() {
            return Err(DeviceUploadError::Refused {
                tensor: t.name().to_owned(),
                reason: format!("bytes {r:?} outside the {}-byte data section", host.len()),
            });
        }
        ranges.push(r);
    }
    Ok((host, ranges))
}

/// Names the tensor of a schedule's refusal.
fn ring_error(e: RingError<CudaError>, order: &[TensorInfo<'_>]) -> DeviceUploadError {
    let name = |i: usize| {
        order
            .get(i)
            .map_or_else(|| format!("#{i}"), |t| t.name().to_owned())
    };
    match e {
        RingError::Engine(e) => DeviceUploadError::Cuda(e),
        RingError::NotDequantizable { tensor, ty } => DeviceUploadError::NotDequantizable {
            tensor: name(tensor),
            ty,
        },
        RingError::PartialBlock { tensor, .. } | RingError::OutOfRange { tensor, .. } => {
            DeviceUploadError::Refused {
                tensor: name(tensor),
                reason: e.to_string(),
            }
        }
        RingError::StagingTooSmall { .. } => DeviceUploadError::Refused {
            tensor: String::from("(all)"),
            reason: e.to_string(),
        },
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
) -> Result<DeviceWeights, DeviceUploadError> {
    Uploader::new(gpu, UploadOptions::default())?.upload(gguf, progress)
}
