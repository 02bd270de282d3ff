//! The simulator's error type.

use pagedkv::error::{AdmissionError, EngineError, KvError, SchedError};

/// Errors of the `simulate` job ([`crate`]).
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The configuration cannot run.
    #[error("invalid simulation: {0}")]
    InvalidConfig(String),
    /// The requested device cannot be used.
    #[error("device: {0}")]
    Device(String),
    /// The KV cache refused.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// The scheduler refused.
    #[error(transparent)]
    Sched(#[from] SchedError),
    /// The engine driver or its step executor refused.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The admission queues refused.
    #[error(transparent)]
    Admission(#[from] AdmissionError),
    /// Drawing the chart failed.
    #[error("drawing the chart: {0}")]
    Plot(String),
}
