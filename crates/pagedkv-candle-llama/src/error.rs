//! The client's errors: each source keeps its own typed error.

use pagedkv::error::{EngineError, KvError, SchedError};
use pagedkv::gguf::GgufError;

/// Everything loading or running the llama can refuse.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The GGUF file was malformed, lacked a key or tensor, or could not be dequantized.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A candle operation failed.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// The engine (batcher, cache, kernels) refused.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The scheduler refused a request.
    #[error(transparent)]
    Sched(#[from] SchedError),
    /// The KV geometry was refused.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// The file describes a model this client does not run (another architecture, a RoPE
    /// that covers part of a head or is scaled other than linearly or by llama3 factors,
    /// mixture-of-experts layers, projection biases, a tensor of the wrong shape or type).
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// A request or a step's input the model cannot take (a token outside the vocabulary, a
    /// negative position).
    #[error("bad input: {0}")]
    BadInput(String),
    /// The engine's longest sequence is longer than the model's `context_length` (the
    /// positions its RoPE was trained for); build it with `max_context` at most that.
    #[error("max_context {max_context} exceeds the model's context_length {context_length}")]
    ContextTooLong {
        /// The requested `max_context`.
        max_context: u32,
        /// The file's `{arch}.context_length`.
        context_length: u32,
    },
    /// The engine did not finish its requests within the step limit. `partial` holds what
    /// the steps produced: the outputs of the sequences that finished (the others are still
    /// queued in the engine, which can be stepped on).
    #[error("the engine still had work after {steps} steps")]
    StepLimit {
        /// The limit reached.
        steps: u64,
        /// The finished sequences' outputs and the counters of the steps run.
        partial: Box<crate::Generation>,
    },
    /// A step of [`generate`](crate::generate) failed (`source`: the engine's or the model's
    /// refusal). `partial` holds what the steps before it produced: the outputs of the
    /// sequences that finished (the others are still queued in the engine, which can be
    /// stepped on once the sequence at fault is aborted).
    #[error("step {} of the generation failed: {source}", partial.steps + 1)]
    StepFailed {
        /// Why the step failed.
        source: EngineError,
        /// The finished sequences' outputs and the counters of the steps that succeeded.
        partial: Box<crate::Generation>,
    },
}

impl Error {
    /// As the engine's error type, for the [`StepModel`](pagedkv::engine::StepModel) methods
    /// (the engine keeps the caller's message).
    pub(crate) fn into_engine(self) -> EngineError {
        match self {
            Error::Engine(e) => e,
            other => EngineError::Model(other.to_string()),
        }
    }
}

/// The client's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
