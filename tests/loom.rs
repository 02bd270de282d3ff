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
#[path = "loom/donations.rs"]
mod donations;
#[path = "loom/pool.rs"]
mod pool;
#[path = "loom/prefix.rs"]
mod prefix;
#[path = "loom/stream.rs"]
mod stream;
#[path = "loom/table.rs"]
mod table;

/// `loom::model(f)`, failing if loom ran `f` only once. A model whose threads loom never
/// interleaves proves nothing, and loom's DPOR can miss a race entirely when the spawned
/// thread's first access comes after the main thread's (four models here ran once each,
/// green, until this check; see tests/loom/pool.rs). Every model goes through it.
pub(crate) fn model<F>(f: F)
where
    F: Fn() + Sync + Send + 'static,
{
    use std::sync::atomic::{AtomicUsize, Ordering};
    let runs = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    loom::model(move || {
        counted.fetch_add(1, Ordering::Relaxed);
        f();
    });
    let runs = runs.load(Ordering::Relaxed);
    assert!(
        runs > 1,
        "loom explored {runs} interleaving: the model races nothing"
    );
}
