//! Feature `cuda`:
//!
//! 1. finds nvcc (`$NVCC`, then `$CUDA_PATH/bin/nvcc`, `$CUDA_HOME/bin/nvcc`, then `PATH`) and
//!    stops the build with a message saying how to get one when there is none;
//! 2. compiles every kernel source listed in [`KERNELS`] with nvcc through the `cc` crate into
//!    one static library per source (`pagedkv_kernels_<stem>`, whole-unit device code: no
//!    relocatable device code), with SASS for sm_80 and sm_90 and PTX for
//!    compute_90 (so newer GPUs JIT it), linked against the static CUDA runtime; with sm_90
//!    among the targets, the [`SM90A_KERNELS`] too, with SASS for sm_90a alone;
//! 3. runs bindgen over `kernels/pagedkv.h`, the C ABI of every launcher, into
//!    `$OUT_DIR/pagedkv_ffi.rs`, which `src/cuda_raw/ffi.rs` includes.
//!
//! `PAGEDKV_CUDA_ARCHS` (e.g. `80` or `80,90`) narrows the SASS targets for quick local
//! iteration; CI and release builds leave it unset.

use crate::common::{bindings, track_kernel_sources, KERNELS, SM90A_KERNELS};
use std::env;
use std::path::{Path, PathBuf};

/// SASS targets when `PAGEDKV_CUDA_ARCHS` is unset: Ampere (A100) and Hopper (H100/H200).
const DEFAULT_ARCHS: &[&str] = &["80", "90"];
/// The PTX target kept in the fat binary so that later GPUs can JIT the kernels.
const PTX_ARCH: &str = "90";

pub fn build() {
    for var in ["NVCC", "CUDA_PATH", "CUDA_HOME", "PAGEDKV_CUDA_ARCHS"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    track_kernel_sources();

    let nvcc = find_nvcc();
    let cuda_root = nvcc
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_default();
    // The cc crate reads the compiler from `NVCC`; point it at the one found above.
    env::set_var("NVCC", &nvcc);

    let archs: Vec<String> = match env::var("PAGEDKV_CUDA_ARCHS") {
        Ok(s) if !s.trim().is_empty() => s
            .split(',')
            .map(|a| a.trim().trim_start_matches("sm_").to_string())
            .collect(),
        _ => DEFAULT_ARCHS.iter().map(|s| s.to_string()).collect(),
    };
    for a in &archs {
        if a.is_empty() || !a.chars().all(|c| c.is_ascii_digit()) {
            fail!("PAGEDKV_CUDA_ARCHS entry {a:?} is not a compute capability like 80 or 90");
        }
    }

    let mut build = cc::Build::new();
    build
        .cuda(true)
        .cudart("static")
        // Device code is always optimized: cc would pass -G (device debug, unoptimized
        // kernels) in debug builds.
        .debug(false)
        .opt_level(3)
        .include("kernels")
        .flag("-std=c++17")
        .flag("-O3")
        // Line tables for compute-sanitizer and ncu reports; no effect on the code.
        .flag("-lineinfo")
        // Compile the per-architecture passes in parallel.
        .flag("--threads=0")
        .flag("--expt-relaxed-constexpr")
        .warnings(false);
    // sm_90 among the targets: the sm_90a units too (their own SASS only, no PTX), and every
    // unit knows they are there.
    let sm90a = archs.iter().any(|a| a == "90");
    let mut sm90a_build = build.clone();
    if sm90a {
        build.define("PKV_HAVE_WGMMA", "1");
        sm90a_build
            .define("PKV_HAVE_WGMMA", "1")
            .flag("-gencode")
            .flag("arch=compute_90a,code=sm_90a");
    }
    for a in &archs {
        build
            .flag("-gencode")
            .flag(format!("arch=compute_{a},code=sm_{a}"));
    }
    build
        .flag("-gencode")
        .flag(format!("arch=compute_{PTX_ARCH},code=compute_{PTX_ARCH}"));
    // One library per source: cc compiles a build of several CUDA files as relocatable device
    // code (--device-c, then a device link), where nvcc keeps calls to the units' own
    // non-inlined device functions as ABI calls: the decode kernels took 127 registers instead
    // of 80 (sm_90) that way. No unit calls device code of another, so none needs it.
    let sm90a_units: &[&str] = if sm90a { SM90A_KERNELS } else { &[] };
    for (k, b) in KERNELS
        .iter()
        .map(|k| (k, &build))
        .chain(sm90a_units.iter().map(|k| (k, &sm90a_build)))
    {
        let stem = Path::new(k)
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("kernels");
        if let Err(e) = b
            .clone()
            .file(k)
            .try_compile(&format!("pagedkv_kernels_{stem}"))
        {
            fail!("nvcc ({}) failed to compile {k}: {e}", nvcc.display());
        }
    }

    // cc looks for the static runtime under targets/<arch>-linux/lib only; the PyPI toolchain
    // keeps it in lib/ and a system install in lib64/.
    for sub in ["lib", "lib64", "targets/x86_64-linux/lib"] {
        let dir = cuda_root.join(sub);
        if dir.join("libcudart_static.a").is_file() {
            println!("cargo:rustc-link-search=native={}", dir.display());
        }
    }
    // libcudart_static needs these from the C library on Linux.
    for lib in ["dl", "rt", "pthread"] {
        println!("cargo:rustc-link-lib={lib}");
    }

    bindings("kernels/pagedkv.h", "pkv", "pagedkv_ffi.rs");
}

fn find_nvcc() -> PathBuf {
    if let Some(n) = env::var_os("NVCC").filter(|n| !n.is_empty()) {
        let p = PathBuf::from(&n);
        if let Some(found) = which(&p) {
            return found;
        }
        fail!("NVCC={} is not an executable", p.display());
    }
    for var in ["CUDA_PATH", "CUDA_HOME"] {
        if let Some(root) = env::var_os(var).filter(|r| !r.is_empty()) {
            let p = PathBuf::from(root).join("bin").join("nvcc");
            if p.is_file() {
                return p;
            }
            fail!("{var} is set but {} does not exist", p.display());
        }
    }
    if let Some(p) = which(Path::new("nvcc")) {
        return p;
    }
    fail!(
        "no nvcc found (looked at $NVCC, $CUDA_PATH/bin, $CUDA_HOME/bin and PATH).\n\
         Install the pinned toolchain (no GPU needed) and retry:\n    \
         eval \"$(scripts/install-cuda-toolchain.sh)\"\n\
         or build without `--features cuda`."
    )
}

/// Resolves `p` as given (when it has a directory part) or through `PATH`.
fn which(p: &Path) -> Option<PathBuf> {
    if p.components().count() > 1 {
        return p.is_file().then(|| p.to_path_buf());
    }
    env::split_paths(&env::var_os("PATH")?)
        .map(|d| d.join(p))
        .find(|c| c.is_file())
}
