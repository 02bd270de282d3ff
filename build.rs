//! Build script. Without feature `cuda` or `cuda-emu` it does nothing.
//!
//! - `cuda` (build/cuda.rs): compiles kernels/*.cu with nvcc into `pagedkv_kernels_<stem>`
//!   libraries and runs bindgen over kernels/pagedkv.h.
//! - `cuda-emu` (build/emu.rs): compiles the same sources as C++ for the CPU emulation in
//!   kernels/emu/ (after two mechanical rewrites), into `pagedkv_kernels_emu`, and runs bindgen
//!   over pagedkv.h and kernels/emu/pagedkv_emu.h. With both features, `cuda` wins: the
//!   emulation would define the same C symbols.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=build");
    #[cfg(feature = "cuda")]
    cuda::build();
    #[cfg(all(feature = "cuda-emu", not(feature = "cuda")))]
    emu::build();
}

#[cfg(any(feature = "cuda", feature = "cuda-emu"))]
#[macro_use]
#[path = "build/common.rs"]
mod common;

#[cfg(feature = "cuda")]
#[path = "build/cuda.rs"]
mod cuda;

#[cfg(all(feature = "cuda-emu", not(feature = "cuda")))]
#[path = "build/emu.rs"]
mod emu;
