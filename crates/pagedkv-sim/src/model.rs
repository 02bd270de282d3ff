//! The simulated model: random projections stand in for the model's layers, so every byte of
//! KV traffic is real while no weights exist, and sampling draws tokens at random. It plugs
//! into the library's step executor ([`pagedkv::engine::StepModel`]) on the CPU backend, and
//! (feature `cuda`) on the device backend, where the pool is uploaded once and each layer's
//! projections are views into it.

use crate::error::SimError;
use pagedkv::engine::{HostBackend, KvBackend, LayerQkv, StepModel};
use pagedkv::error::EngineError;
use pagedkv::kv::KvElem;
use pagedkv::sched::Batch;
use rand::{rngs::SmallRng, Rng};

/// Elements of the random pool the projections are sliced from (several steps' worth, so
/// consecutive steps see different values).
pub(crate) const NOISE: usize = 1 << 21;
/// Vocabulary the sampler draws from.
const VOCAB: u32 = 32_000;

/// Random projections and sampling for element type `T`.
#[derive(Debug)]
pub(crate) struct NoiseModel<T> {
    noise: Vec<T>,
    rng: SmallRng,
    #[cfg(feature = "cuda")]
    device: Option<device::DeviceNoise<T>>,
}

impl<T: KvElem> NoiseModel<T> {
    /// A model drawing its projections and samples from `rng`.
    pub(crate) fn new(mut rng: SmallRng) -> Self {
        Self {
            noise: (0..NOISE)
                .map(|_| T::from_f32(rng.gen_range(-1.0..1.0)))
                .collect(),
            rng,
            #[cfg(feature = "cuda")]
            device: None,
        }
    }

    /// The start of a random window of `len` elements of the pool.
    fn window(&mut self, len: usize) -> Result<usize, EngineError> {
        self.window_at(len, 1)
    }

    /// The start, a multiple of `align` elements, of a random window of `len` elements.
    fn window_at(&mut self, len: usize, align: usize) -> Result<usize, EngineError> {
        if len > self.noise.len() {
            return Err(EngineError::Model(
                SimError::InvalidConfig(format!(
                    "a step needs {len} projection values; the random pool holds {}",
                    self.noise.len()
                ))
                .to_string(),
            ));
        }
        Ok(self.rng.gen_range(0..=(self.noise.len() - len) / align) * align)
    }

    /// The (query, key/value) lengths of one layer's projections of `batch`.
    fn lens<K: KvBackend + ?Sized>(backend: &K, batch: &Batch) -> (usize, usize) {
        let cfg = backend.config();
        let tokens = batch.num_tokens();
        (
            tokens * backend.query_heads() * cfg.head_dim(),
            tokens * cfg.num_kv_heads() * cfg.head_dim(),
        )
    }

    fn sample_into(&mut self, batch: &Batch, out: &mut Vec<u32>) {
        for _ in 0..batch.num_samples() {
            out.push(self.rng.gen_range(0..VOCAB));
        }
    }
}

impl<T: KvElem> StepModel<HostBackend<T>> for NoiseModel<T> {
    fn qkv(
        &mut self,
        backend: &HostBackend<T>,
        _layer: usize,
        batch: &Batch,
    ) -> Result<LayerQkv<'_, [T]>, EngineError> {
        let (q_len, kv_len) = Self::lens(backend, batch);
        let (k, v, q) = (
            self.window(kv_len)?,
            self.window(kv_len)?,
            self.window(q_len)?,
        );
        Ok(LayerQkv {
            query: &self.noise[q..q + q_len],
            key: &self.noise[k..k + kv_len],
            value: &self.noise[v..v + kv_len],
        })
    }

    fn attended(&mut self, _layer: usize, _batch: &Batch, _out: &[T]) -> Result<(), EngineError> {
        Ok(())
    }

    fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError> {
        self.sample_into(batch, out);
        Ok(())
    }
}

#[cfg(feature = "cuda")]
mod device {
    use super::NoiseModel;
    use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr};
    use pagedkv::cuda::Gpu;
    use pagedkv::cuda_raw::Rows;
    use pagedkv::engine::{DeviceRows, KvBackend, LayerQkv, RawBackend, StepModel};
    use pagedkv::error::EngineError;
    use pagedkv::kv::KvElem;
    use pagedkv::sched::Batch;

    /// The random pool on the device (uploaded once, on the engine's stream: a step costs no
    /// allocation or copy of projections) and the step's views into it.
    #[derive(Debug)]
    pub(crate) struct DeviceNoise<T> {
        /// Owns the memory `base` points at.
        _pool: CudaSlice<T>,
        base: u64,
        views: Option<[DeviceRows; 3]>,
    }

    impl<T: KvElem + DeviceRepr> StepModel<RawBackend<Gpu>> for NoiseModel<T> {
        fn qkv(
            &mut self,
            backend: &RawBackend<Gpu>,
            _layer: usize,
            batch: &Batch,
        ) -> Result<LayerQkv<'_, DeviceRows>, EngineError> {
            let (q_len, kv_len) = Self::lens(backend, batch);
            // Views start on the 16-byte grid the kernels require.
            let es = std::mem::size_of::<T>();
            let align = 16 / es;
            let (k, v, q) = (
                self.window_at(kv_len, align)?,
                self.window_at(kv_len, align)?,
                self.window_at(q_len, align)?,
            );
            if self.device.is_none() {
                let gpu = backend.device();
                let pool = gpu.upload(&self.noise)?;
                // The address is taken once: the pool is read only, and only by launches on
                // the stream that uploaded it.
                let base = pool.device_ptr(gpu.stream()).0;
                self.device = Some(DeviceNoise {
                    _pool: pool,
                    base,
                    views: None,
                });
            }
            let cfg = backend.config();
            let (d, tokens) = (cfg.head_dim(), batch.num_tokens());
            let dev = self.device.as_mut().expect("set above");
            let view = |at: usize, heads: usize| DeviceRows {
                rows: Rows::dense(dev.base + (at * es) as u64, heads, d),
                tokens,
            };
            let views = [
                view(q, backend.query_heads()),
                view(k, cfg.num_kv_heads()),
                view(v, cfg.num_kv_heads()),
            ];
            let [query, key, value] = dev.views.insert(views);
            Ok(LayerQkv { query, key, value })
        }

        fn attended(
            &mut self,
            _layer: usize,
            _batch: &Batch,
            _out: &DeviceRows,
        ) -> Result<(), EngineError> {
            Ok(())
        }

        fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError> {
            self.sample_into(batch, out);
            Ok(())
        }
    }
}
