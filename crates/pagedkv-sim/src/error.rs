//! The simulator's error type.

#[cfg(feature = "cuda")]
use pagedkv::error::CudaError;
use pagedkv::error::{
    AdmissionError, AttnError, BudgetError, EngineError, KvError, PoolError, SchedError,
};

/// Errors of the `simulate` job ([`crate`]).
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The configuration cannot run.
    #[error("invalid simulation: {0}")]
    InvalidConfig(String),
    /// The requested device cannot be used.
    #[error("device: {0}")]
    Device(String),
    /// The block pool refused.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The KV cache refused.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// A kernel refused its inputs.
    #[error(transparent)]
    Attn(#[from] AttnError),
    /// The scheduler refused.
    #[error(transparent)]
    Sched(#[from] SchedError),
    /// The engine driver or its step executor refused.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The budget coordinator refused.
    #[error(transparent)]
    Budget(#[from] BudgetError),
    /// The admission queues refused.
    #[error(transparent)]
    Admission(#[from] AdmissionError),
    /// Writing the report failed.
    #[error("writing {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// What failed.
        source: std::io::Error,
    },
    /// Drawing the chart failed.
    #[error("drawing the chart: {0}")]
    Plot(String),
    /// A CUDA call failed.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// A worker thread panicked (a bug).
    #[error("a simulation thread panicked")]
    ThreadPanicked,
}
