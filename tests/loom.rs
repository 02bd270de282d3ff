//! loom models of every atomic protocol in the crate. Compiled only with `--cfg loom`, and run
//! by CI with a preemption bound of 2 (every model is sized to finish at that bound within a
//! minute or so on 2 cores):
//!
//! ```text
//! RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test --release --test loom --target-dir target/loom
//! ```
//!
//! One file per protocol under tests/loom/.
#![cfg(loom)]

#[path = "loom/admission.rs"]
mod admission;
#[path = "loom/budget.rs"]
mod budget;
#[path = "loom/pool.rs"]
mod pool;
#[path = "loom/prefix.rs"]
mod prefix;
#[path = "loom/stream.rs"]
mod stream;
#[path = "loom/table.rs"]
mod table;
