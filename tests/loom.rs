//! loom models of every atomic protocol in the crate. Compiled only with `--cfg loom`:
//!
//! ```text
//! RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 cargo test --release --test loom
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
#[path = "loom/table.rs"]
mod table;
