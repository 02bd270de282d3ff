//! The CUDA engine on a device pagedkv opened (feature `cuda`): [`RawBackend`] over this crate's
//! [`Gpu`], on the [`SharedArena`]'s own device arena. One GPU backend serves both kinds of
//! client: a server that lets pagedkv open the device (this constructor, safe) and a client on
//! its own driver binding ([`Engine::raw`], which takes the arena's address on trust).

use super::{Engine, EngineConfig, RawBackend, SharedArena};
use crate::cuda::Gpu;
use crate::error::EngineError;
use crate::kv::ModelKvShape;
use crate::sync::Arc;

impl Engine<RawBackend<Gpu>> {
    /// An engine whose cache is a view of `shared`'s device arena with `shape`'s geometry (its
    /// tokens per page), on the CUDA kernels on a new stream of `gpu`, for a model of
    /// `query_heads` heads. The backend's metadata, output and workspace buffers are allocated
    /// once (grown when a batch outgrows them); a step is one metadata copy and the launches.
    ///
    /// # Errors
    /// [`EngineError::InvalidConfig`] when `shared` has no device arena; `gpu` on another
    /// device than the arena ([`CudaError::WrongDevice`](crate::error::CudaError::WrongDevice));
    /// then as [`Engine::raw`].
    pub fn cuda(
        shared: &Arc<SharedArena>,
        gpu: &Gpu,
        cfg: EngineConfig,
        shape: &ModelKvShape,
        query_heads: usize,
    ) -> Result<Self, EngineError> {
        let arena = shared.device_arena().ok_or_else(|| {
            EngineError::InvalidConfig("the shared arena is not a device arena".into())
        })?;
        arena.check_device(gpu)?;
        let gpu = gpu.with_new_stream()?;
        let base = arena.base();
        // SAFETY: `base` is the address of `shared`'s own device arena, which holds
        // `shared.pool().total()` pages of `shared.page_bytes()` bytes (SharedArena::cuda made
        // both from one budget) in `gpu`'s context (checked above); the engine keeps an `Arc`
        // of `shared`, so the arena outlives the backend. Every engine on `shared` is built by
        // this constructor, `Engine::host`'s kin or `Engine::raw`, all of which run only their
        // own batcher's batches from `shared`'s pool (the page-ownership rule). `Gpu` keeps
        // `RawDevice`'s contract (src/cuda/raw_device.rs).
        unsafe { Self::raw(shared, gpu, base, cfg, shape, query_heads) }
    }
}
