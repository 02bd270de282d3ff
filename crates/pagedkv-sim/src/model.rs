//! The simulated model: random projections stand in for the model's layers, so every byte of
//! KV traffic is real while no weights exist, and sampling draws tokens at random. It plugs
//! into the library's step executor ([`pagedkv::engine::StepModel`]) on the CPU backend, and
//! (feature `cuda`) on the device backend, where each layer's projections are uploaded.

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
    device: Option<device::Uploads<T>>,
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
        if len > self.noise.len() {
            return Err(EngineError::Model(
                SimError::InvalidConfig(format!(
                    "a step needs {len} projection values; the random pool holds {}",
                    self.noise.len()
                ))
                .to_string(),
            ));
        }
        Ok(self.rng.gen_range(0..=self.noise.len() - len))
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
    use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
    use pagedkv::engine::{DeviceBackend, LayerQkv, StepModel};
    use pagedkv::error::EngineError;
    use pagedkv::kv::KvElem;
    use pagedkv::sched::Batch;

    /// One layer's projections, uploaded to the engine's stream.
    #[derive(Debug)]
    pub(crate) struct Uploads<T> {
        query: CudaSlice<T>,
        key: CudaSlice<T>,
        value: CudaSlice<T>,
    }

    impl<T: KvElem + DeviceRepr + ValidAsZeroBits> StepModel<DeviceBackend<T>> for NoiseModel<T> {
        fn qkv(
            &mut self,
            backend: &DeviceBackend<T>,
            _layer: usize,
            batch: &Batch,
        ) -> Result<LayerQkv<'_, CudaSlice<T>>, EngineError> {
            let (q_len, kv_len) = Self::lens(backend, batch);
            let (k, v, q) = (
                self.window(kv_len)?,
                self.window(kv_len)?,
                self.window(q_len)?,
            );
            let gpu = backend.gpu();
            let up = Uploads {
                query: gpu.upload(&self.noise[q..q + q_len])?,
                key: gpu.upload(&self.noise[k..k + kv_len])?,
                value: gpu.upload(&self.noise[v..v + kv_len])?,
            };
            let up = self.device.insert(up);
            Ok(LayerQkv {
                query: &up.query,
                key: &up.key,
                value: &up.value,
            })
        }

        fn attended(
            &mut self,
            _layer: usize,
            _batch: &Batch,
            _out: &CudaSlice<T>,
        ) -> Result<(), EngineError> {
            Ok(())
        }

        fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError> {
            self.sample_into(batch, out);
            Ok(())
        }
    }
}
