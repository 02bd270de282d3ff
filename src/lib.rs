//! pagedkv: the memory and scheduling core of an LLM inference engine.
//!
//! The crate owns the paged KV cache of one device: which physical block belongs to which
//! sequence of which model ([`block`]), how many tokens and blocks each model may use per step
//! ([`budget`]), which sequences run next ([`sched`]), the byte layout of a block ([`kv`]) and
//! the kernels that read and write it ([`attn`] on the CPU, `cuda` on a GPU). It also loads
//! GGUF weights ([`gguf`]). No hot path takes a mutex of the crate's own: the pool, tables,
//! budget, admission, prefix cache and streams are atomic protocols (see each module's docs for
//! its algorithm and memory-ordering argument). The CPU kernels ([`attn`]) are the exception:
//! they fork and join on rayon's pool, and a thread outside it (an engine's step thread) blocks
//! on rayon's latch, a mutex and condition variable inside rayon-core ([`engine`] module docs).
#![warn(missing_docs)]

pub mod attn;
pub mod block;
pub mod budget;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(all(feature = "cuda-emu", not(feature = "cuda")))]
pub mod cuda_emu;
#[cfg(any(feature = "cuda", feature = "cuda-emu"))]
pub mod cuda_raw;
pub mod engine;
pub mod error;
pub mod gguf;
mod ids;
pub mod kv;
pub mod prefix;
pub mod sched;
pub mod sync;
