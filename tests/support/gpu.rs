//! The GPU of a CUDA test, or a visible skip: shared by the tests that need a device.

use pagedkv::cuda::Gpu;
use std::io::Write;

/// The GPU, or `None` after printing a SKIP line (uncaptured) when there is none; panics
/// instead when `PAGEDKV_REQUIRE_GPU=1`, so a GPU run cannot pass by skipping.
pub fn gpu(test: &str) -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e) => {
            if std::env::var("PAGEDKV_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("{test}: PAGEDKV_REQUIRE_GPU=1 but no usable GPU: {e}");
            }
            // Written to the raw stderr handle: the test harness does not capture it.
            let _ = writeln!(std::io::stderr(), "SKIP {test}: no GPU ({e})");
            None
        }
    }
}
