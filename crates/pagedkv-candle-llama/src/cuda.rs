//! The model on candle's CUDA device (feature `candle-cuda`), its KV cache, attention and scheduling
//! pagedkv's: the engine's [`RawBackend`] launches pagedkv's kernels on **candle's own stream**
//! over candle's tensors (device pointers, no copy of Q/K/V), with device memory from candle's
//! cudarc (0.19) through [`CandleCuda`]. pagedkv's own cudarc (0.17) is never used here: the
//! two bindings do not interoperate, and the raw backend needs neither.
//!
//! Per layer: candle computes q, k, v (cast to the cache's dtype), the backend writes k, v into
//! the paged cache and runs paged attention into its output buffer, one device-to-device copy
//! brings the output into a candle tensor, and candle finishes the layer. Everything is queued
//! on one stream; the engine's step waits for it once, at its end.

use crate::config::LlamaConfig;
use crate::error::{Error, Result};
use crate::model::PagedLlama;
use crate::runner::{engine_config, EngineSetup};
use candle_core::cuda_backend::cudarc::driver::{
    result, sys, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
};
use candle_core::cuda_backend::CudaDType;
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Storage, Tensor};
use pagedkv::budget::BudgetConfig;
use pagedkv::cuda_raw::{CuStream, DevPtr, Rows};
use pagedkv::engine::{
    DeviceRows, Engine, KvBackend, LayerQkv, RawBackend, RawDevice, SharedArena, StepModel,
};
use pagedkv::error::EngineError;
use pagedkv::kv::{page_bytes_for, KvDtype};
use pagedkv::sched::Batch;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

/// candle's CUDA device as pagedkv's [`RawDevice`]: candle's stream, memory from the driver
/// in candle's (primary) context.
#[derive(Debug, Clone)]
pub struct CandleCuda {
    device: CudaDevice,
    stream: Arc<CudaStream>,
    sms: usize,
}

impl CandleCuda {
    /// The device of a candle CUDA `device`.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a device that is not CUDA; the driver's refusal.
    pub fn new(device: &Device) -> Result<Self> {
        let Device::Cuda(cuda) = device else {
            return Err(Error::Unsupported(format!(
                "a CUDA engine needs a CUDA device, not {:?}",
                device.location()
            )));
        };
        let stream = cuda.cuda_stream();
        let sms = stream
            .context()
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver)?;
        Ok(Self {
            device: cuda.clone(),
            stream,
            sms: sms.max(1) as usize,
        })
    }
}

fn driver(e: impl std::fmt::Display) -> EngineError {
    EngineError::Model(format!("CUDA driver: {e}"))
}

// SAFETY: alloc is cuMemAlloc in candle's context (made current first: 256-byte aligned, at
// least `bytes`, valid until cuMemFree); copies are queued on candle's stream, which `stream`
// returns and `synchronize` waits for; `bind` makes candle's context current.
unsafe impl RawDevice for CandleCuda {
    fn stream(&self) -> CuStream {
        self.stream.cu_stream() as CuStream
    }

    fn sm_count(&self) -> usize {
        self.sms
    }

    fn bind(&self) -> Result<(), EngineError> {
        self.stream.context().bind_to_thread().map_err(driver)
    }

    fn alloc(&self, bytes: usize) -> Result<DevPtr, EngineError> {
        self.bind()?;
        // SAFETY: the context is current (bind); cuMemAlloc has no other precondition.
        unsafe { result::malloc_sync(bytes) }.map_err(driver)
    }

    unsafe fn free(&self, ptr: DevPtr) {
        if self.bind().is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc in this context, is freed once, and no queued
            // work uses it (the caller's contract). An error cannot be reported from here.
            let _ = unsafe { result::free_sync(ptr) };
        }
    }

    unsafe fn copy_to_device(&self, dst: DevPtr, src: &[u8]) -> Result<(), EngineError> {
        self.bind()?;
        // SAFETY: `dst` holds src.len() bytes of device memory of this context and `src`
        // stays unmodified until the stream is synchronised (the caller's contract).
        unsafe { result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }.map_err(driver)
    }

    fn synchronize(&self) -> Result<(), EngineError> {
        self.stream.synchronize().map_err(driver)
    }
}

/// An engine on a [`CandleCuda`] device with the arena it owns: the arena's device memory is
/// freed after the engine is dropped.
#[derive(Debug)]
pub struct CudaEngine {
    // Declared first: dropped before the arena it uses.
    engine: Engine<RawBackend<CandleCuda>>,
    _arena: DeviceArena,
}

impl Deref for CudaEngine {
    type Target = Engine<RawBackend<CandleCuda>>;
    fn deref(&self) -> &Self::Target {
        &self.engine
    }
}

impl DerefMut for CudaEngine {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.engine
    }
}

/// One allocation of device memory, freed on drop after the stream is idle.
#[derive(Debug)]
struct DeviceArena {
    dev: CandleCuda,
    ptr: DevPtr,
}

impl Drop for DeviceArena {
    fn drop(&mut self) {
        if self.dev.synchronize().is_ok() {
            // SAFETY: allocated by this device, freed once, and the stream is idle.
            unsafe { self.dev.free(self.ptr) };
        }
    }
}

/// An engine for `cfg`'s model on candle's CUDA `device`: a device arena of `setup.pages`
/// pages (zeroed), KV in `kv_dtype`, pagedkv's kernels on candle's stream.
///
/// # Errors
/// As [`build_engine`](crate::build_engine) (a `max_context` over the model's
/// `context_length` is refused before any device memory is taken), plus the driver's
/// refusals.
pub fn build_cuda_engine(
    cfg: &LlamaConfig,
    setup: &EngineSetup,
    device: &Device,
    kv_dtype: KvDtype,
) -> Result<CudaEngine> {
    let engine_cfg = engine_config(cfg, setup)?;
    let dev = CandleCuda::new(device)?;
    let shape = pagedkv::kv::ModelKvShape {
        dtype: kv_dtype,
        ..cfg.kv_shape()
    };
    let page_bytes = page_bytes_for(&[shape], setup.tokens_per_page)?;
    let budget = BudgetConfig::new(1, setup.max_batched_tokens, setup.pages);
    let shared = SharedArena::external(budget, page_bytes)?;
    let bytes = pagedkv::kv::check_arena_size(setup.pages as usize, page_bytes)?;
    let arena = DeviceArena {
        ptr: dev.alloc(bytes)?,
        dev: dev.clone(),
    };
    // SAFETY: the arena was just allocated on this stream's context with `bytes` bytes.
    unsafe { result::memset_d8_async(arena.ptr, 0, bytes, dev.stream.cu_stream()) }
        .map_err(driver)?;
    // SAFETY: `arena` is `shared`'s pages in candle's context (pages x page_bytes bytes), kept
    // alive by the returned CudaEngine until after its engine is dropped; this engine is the
    // arena's only user; CandleCuda keeps RawDevice's contract.
    let engine =
        unsafe { Engine::raw(&shared, dev, arena.ptr, engine_cfg, &shape, cfg.n_heads())? };
    Ok(CudaEngine {
        engine,
        _arena: arena,
    })
}

/// A layer's projections on the device (kept alive until the layer's attention has been
/// queued and its output taken) and the views the backend reads.
#[derive(Debug)]
pub(crate) struct LayerTensors {
    tensors: [Tensor; 3],
    views: [DeviceRows; 3],
    /// The backend's device, for the output copy in `attended`.
    dev: CandleCuda,
}

fn candle_dtype(kv: KvDtype) -> DType {
    match kv {
        KvDtype::F32 => DType::F32,
        KvDtype::F16 => DType::F16,
        KvDtype::Bf16 => DType::BF16,
    }
}

/// The device rows of a contiguous `[tokens, heads * head_dim]` CUDA tensor.
fn rows_of(t: &Tensor, stream: &CudaStream) -> Result<DeviceRows> {
    let (tokens, width) = t.dims2()?;
    let (storage, layout) = t.storage_and_layout();
    if !layout.is_contiguous() {
        return Err(Error::Unsupported("a non-contiguous projection".into()));
    }
    let Storage::Cuda(cuda) = &*storage else {
        return Err(Error::Unsupported(
            "a projection not on the CUDA device".into(),
        ));
    };
    let base = match t.dtype() {
        DType::F32 => cuda.as_cuda_slice::<f32>()?.device_ptr(stream).0,
        DType::F16 => cuda.as_cuda_slice::<half::f16>()?.device_ptr(stream).0,
        DType::BF16 => cuda.as_cuda_slice::<half::bf16>()?.device_ptr(stream).0,
        other => return Err(Error::Unsupported(format!("a projection of {other:?}"))),
    };
    let offset = layout.start_offset() * t.dtype().size_in_bytes();
    Ok(DeviceRows {
        rows: Rows {
            ptr: base + offset as u64,
            token_stride: width,
        },
        tokens,
    })
}

/// A new `[tokens, width]` tensor of `dtype` on `dev` holding a copy of `rows` (dense), queued
/// on candle's stream.
fn tensor_from_rows(
    dev: &CandleCuda,
    rows: &DeviceRows,
    width: usize,
    dtype: DType,
) -> Result<Tensor> {
    let n = rows.tokens * width;
    if rows.rows.token_stride != width {
        return Err(Error::Unsupported(format!(
            "attention output rows of stride {} for width {width}",
            rows.rows.token_stride
        )));
    }
    /// `n` elements of `T` copied from `src` into a new allocation, queued on candle's stream.
    fn copied<T: CudaDType + DeviceRepr>(
        dev: &CandleCuda,
        src: DevPtr,
        n: usize,
    ) -> Result<CudaStorage> {
        // SAFETY: uninitialised device memory of n elements, written in full by the copy
        // queued below on the same stream before any later work there reads it.
        let mut dst = unsafe { dev.device.alloc::<T>(n) }?;
        {
            let (ptr, _guard) = dst.device_ptr_mut(&dev.stream);
            // SAFETY: `dst` holds n elements on this stream's context; `src` is the backend's
            // output buffer of at least as many, written by the attention launch queued
            // earlier on the same stream, so the copy runs after it.
            unsafe {
                result::memcpy_dtod_async(
                    ptr,
                    src,
                    n * std::mem::size_of::<T>(),
                    dev.stream.cu_stream(),
                )
            }
            .map_err(driver)?;
        }
        Ok(CudaStorage::wrap_cuda_slice(dst, dev.device.clone()))
    }
    let src = rows.rows.ptr;
    let storage = match dtype {
        DType::F32 => copied::<f32>(dev, src, n)?,
        DType::F16 => copied::<half::f16>(dev, src, n)?,
        DType::BF16 => copied::<half::bf16>(dev, src, n)?,
        other => return Err(Error::Unsupported(format!("attention output of {other:?}"))),
    };
    Ok(Tensor::from_storage(
        Storage::Cuda(storage),
        (rows.tokens, width),
        BackpropOp::none(),
        false,
    ))
}

impl PagedLlama {
    fn qkv_cuda(
        &mut self,
        backend: &RawBackend<CandleCuda>,
        layer: usize,
        batch: &Batch,
    ) -> Result<()> {
        if layer == 0 {
            self.begin_step(backend.config(), backend.query_heads(), batch)?;
        }
        let dtype = candle_dtype(backend.config().dtype());
        let (q, k, v) = self.project(layer)?;
        let cast = |t: Tensor| -> Result<Tensor> { Ok(t.to_dtype(dtype)?.contiguous()?) };
        let tensors = [cast(q)?, cast(k)?, cast(v)?];
        let stream = &backend.device().stream;
        let views = [
            rows_of(&tensors[0], stream)?,
            rows_of(&tensors[1], stream)?,
            rows_of(&tensors[2], stream)?,
        ];
        self.device_qkv = Some(LayerTensors {
            tensors,
            views,
            dev: backend.device().clone(),
        });
        Ok(())
    }
}

impl StepModel<RawBackend<CandleCuda>> for PagedLlama {
    fn qkv(
        &mut self,
        backend: &RawBackend<CandleCuda>,
        layer: usize,
        batch: &Batch,
    ) -> Result<LayerQkv<'_, DeviceRows>, EngineError> {
        self.qkv_cuda(backend, layer, batch)
            .map_err(Error::into_engine)?;
        let Some(LayerTensors { views, .. }) = &self.device_qkv else {
            return Err(EngineError::Model("projections missing after qkv".into()));
        };
        let [query, key, value] = views;
        Ok(LayerQkv { query, key, value })
    }

    fn attended(
        &mut self,
        layer: usize,
        _batch: &Batch,
        out: &DeviceRows,
    ) -> Result<(), EngineError> {
        let mut run = || -> Result<()> {
            let (tokens, dim) = self.step_shape(layer)?;
            if out.tokens != tokens {
                return Err(Error::BadInput(format!(
                    "attention output of {} rows for {tokens} tokens",
                    out.tokens
                )));
            }
            let Some(l) = &self.device_qkv else {
                return Err(Error::BadInput("attention output before qkv".into()));
            };
            let attn =
                tensor_from_rows(&l.dev, out, dim, l.tensors[0].dtype())?.to_dtype(DType::F32)?;
            self.finish_layer(layer, &attn)
        };
        let r = run();
        // The projections may go: the attention that read them is queued before anything that
        // could reuse their memory (candle frees on its stream, in order).
        self.device_qkv = None;
        r.map_err(Error::into_engine)
    }

    fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError> {
        self.sample_rows(batch, out).map_err(Error::into_engine)
    }
}
