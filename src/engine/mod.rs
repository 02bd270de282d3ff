//! The engine loop a server links: a step executor over any KV backend and an engine driver
//! that runs one model's batcher on a device's shared arena.
//!
//! - [`SharedArena`]: one device's pool, arena and budget coordinator, shared by its engines.
//! - [`Engine`]: one model's batcher, share and backend, with the multi-model protocol
//!   (reclaim and donations before scheduling, load publication and budget recomputation
//!   after commit) and per-step results ([`StepResults`](crate::sched::StepResults)) a server
//!   streams from.
//! - [`run_batch`]: runs a [`Batch`](crate::sched::Batch) in its documented order on a
//!   [`KvBackend`] ([`HostBackend`] on the CPU kernels; `RawBackend` on the CUDA kernels
//!   through raw pointers and a `RawDevice`'s stream and memory: pagedkv's own `Gpu`
//!   (`Engine::cuda`) or a client's driver binding (`Engine::raw`)), with the caller's
//!   [`StepModel`] supplying projections and sampling.
//!
//! No engine waits for another in the crate's own protocols: an engine's step is its own work
//! plus lock-free operations on the shared pool and coordinator, with no lock. Its kernels do
//! wait: `RawBackend` for its own stream at the end of a step, and the CPU kernels
//! ([`HostBackend`]) on rayon's global thread pool, which every engine of the process shares.
//! There the step thread (outside the pool) hands its tasks to rayon and blocks until they ran
//! on rayon's latch, a mutex and condition variable inside rayon-core (waking a sleeping worker
//! takes that worker's mutex too), and its tasks queue behind other engines': the one mutex on
//! a step path, and a busy pool delays an engine's step by other engines' kernels.

#[cfg(feature = "cuda")]
mod device;
mod donations;
mod driver;
mod exec;
mod host;
#[cfg(any(feature = "cuda", feature = "cuda-emu"))]
mod raw;
mod shared;

pub use driver::{Engine, EngineConfig, RecomputePolicy, StepReport};
pub use exec::{kv_bytes_read, run_batch, KvBackend, LayerQkv, StepModel, StepStats};
pub use host::HostBackend;
#[cfg(any(feature = "cuda", feature = "cuda-emu"))]
pub use raw::{DeviceRows, RawBackend, RawCaps, RawDevice};
pub use shared::SharedArena;
