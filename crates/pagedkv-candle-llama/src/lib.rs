//! A llama on candle ops whose KV cache, attention and scheduling are pagedkv's.
//!
//! [`PagedLlama`] implements pagedkv's [`StepModel`](pagedkv::engine::StepModel) on the CPU
//! (f32): embedding, RMSNorm, RoPE, the Q/K/V/O and SwiGLU projections are candle ops on
//! weights read through pagedkv's GGUF parser and dequantizer; the KV cache is a view of
//! pagedkv's arena, attention is pagedkv's paged attention, and pagedkv's engine (continuous
//! batching, chunked prefill, preemption) decides what runs each step. It computes what
//! candle-transformers' `quantized_llama` computes from the same file (its tests check every
//! sampled row's logits against it), so it is a real client of the engine loop, not a
//! stand-in; a RoPE scaling, which candle ignores, is run as llama.cpp runs it
//! ([`RopeScaling`]), and what neither runs the same (another RoPE, experts, projection
//! biases) is refused with [`Error::Unsupported`].
//!
//! ```no_run
//! use pagedkv::gguf::{Gguf, GgufBytes};
//! use pagedkv::sched::{Priority, SeqRequest, StopRules};
//! use pagedkv_candle_llama::{build_engine, generate, EngineSetup, MatMulMode, PagedLlama};
//! # fn main() -> Result<(), pagedkv_candle_llama::Error> {
//! let bytes = GgufBytes::read(std::path::Path::new("model.gguf"))?;
//! let mut model = PagedLlama::from_gguf(&Gguf::parse(bytes.bytes())?, MatMulMode::Quantized)?;
//! let mut engine = build_engine(model.config(), &EngineSetup::default())?;
//! let request = SeqRequest {
//!     id: 1,
//!     prompt: vec![1, 2, 3],
//!     stop: StopRules { max_new_tokens: 16, eos: vec![], stop_sequences: vec![] },
//!     priority: Priority::Throughput,
//! };
//! let out = generate(&mut engine, &mut model, [request], 1_000)?;
//! println!("{:?} at {:.1} tokens/s", out.outputs[&1], out.tokens_per_second());
//! # Ok(()) }
//! ```

mod config;
#[cfg(feature = "candle-cuda")]
mod cuda;
mod error;
pub mod fixture;
mod model;
mod rope;
mod runner;
mod weights;

pub use config::{LlamaConfig, RopeScaling};
#[cfg(feature = "candle-cuda")]
pub use cuda::{build_cuda_engine, CandleCuda, CudaEngine};
pub use error::{Error, Result};
pub use model::{argmax, PagedLlama, RowLogits};
pub use runner::{build_engine, generate, EngineSetup, Generation};
pub use weights::MatMulMode;
