//! Build script. Without feature `cuda` it does nothing. With `cuda` it
//!
//! 1. finds nvcc (`$NVCC`, then `$CUDA_PATH/bin/nvcc`, `$CUDA_HOME/bin/nvcc`, then `PATH`) and
//!    stops the build with a message saying how to get one when there is none;
//! 2. compiles every kernel source listed in [`KERNELS`] with nvcc through the `cc` crate into
//!    the static library `pagedkv_kernels`, with SASS for sm_80 and sm_90 and PTX for
//!    compute_90 (so newer GPUs JIT it), linked against the static CUDA runtime;
//! 3. runs bindgen over `kernels/pagedkv.h`, the C ABI of every launcher, into
//!    `$OUT_DIR/pagedkv_ffi.rs`, which `src/cuda/ffi.rs` includes.
//!
//! `PAGEDKV_CUDA_ARCHS` (e.g. `80` or `80,90`) narrows the SASS targets for quick local
//! iteration; CI and release builds leave it unset.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "cuda")]
    cuda::build();
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::env;
    use std::path::{Path, PathBuf};

    /// Every translation unit compiled into `pagedkv_kernels`.
    const KERNELS: &[&str] = &[
        "kernels/paged_attention.cu",
        "kernels/cache_ops.cu",
        "kernels/probe.cu",
    ];
    /// Every header those units include; a change to any of them rebuilds the kernels.
    const HEADERS: &[&str] = &[
        "kernels/pagedkv.h",
        "kernels/common.cuh",
        "kernels/attention.cuh",
    ];
    /// SASS targets when `PAGEDKV_CUDA_ARCHS` is unset: Ampere (A100) and Hopper (H100/H200).
    const DEFAULT_ARCHS: &[&str] = &["80", "90"];
    /// The PTX target kept in the fat binary so that later GPUs can JIT the kernels.
    const PTX_ARCH: &str = "90";

    macro_rules! fail {
        ($($arg:tt)*) => {{
            eprintln!();
            eprintln!("error: pagedkv feature `cuda`: {}", format!($($arg)*));
            eprintln!();
            std::process::exit(1);
        }};
    }

    pub fn build() {
        for var in ["NVCC", "CUDA_PATH", "CUDA_HOME", "PAGEDKV_CUDA_ARCHS"] {
            println!("cargo:rerun-if-env-changed={var}");
        }
        for f in KERNELS.iter().chain(HEADERS) {
            if !Path::new(f).is_file() {
                fail!("{f} is listed in build.rs but does not exist");
            }
            println!("cargo:rerun-if-changed={f}");
        }
        check_listing();

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
        for a in &archs {
            build
                .flag("-gencode")
                .flag(format!("arch=compute_{a},code=sm_{a}"));
        }
        build
            .flag("-gencode")
            .flag(format!("arch=compute_{PTX_ARCH},code=compute_{PTX_ARCH}"));
        for k in KERNELS {
            build.file(k);
        }
        if let Err(e) = build.try_compile("pagedkv_kernels") {
            fail!("nvcc ({}) failed to compile kernels/: {e}", nvcc.display());
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

        let out = PathBuf::from(env::var_os("OUT_DIR").unwrap_or_default());
        let bindings = bindgen::Builder::default()
            .header("kernels/pagedkv.h")
            .allowlist_function("pkv_.*")
            .allowlist_type("pkv_.*")
            .allowlist_var("PKV_.*")
            .default_enum_style(bindgen::EnumVariation::Consts)
            .derive_debug(true)
            .derive_default(true)
            .layout_tests(true)
            .generate_comments(true)
            .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
            .generate();
        match bindings {
            Ok(b) => {
                if let Err(e) = b.write_to_file(out.join("pagedkv_ffi.rs")) {
                    fail!("cannot write bindings to {}: {e}", out.display());
                }
            }
            Err(e) => fail!(
                "bindgen failed on kernels/pagedkv.h: {e}\n\
                 bindgen needs libclang: `apt-get install libclang-dev` (or set LIBCLANG_PATH)"
            ),
        }
    }

    /// Fails when kernels/ holds a source or header that build.rs does not list, so a new file
    /// cannot be silently left out of the build or of the rebuild triggers.
    fn check_listing() {
        let Ok(entries) = std::fs::read_dir("kernels") else {
            fail!("kernels/ directory missing");
        };
        for e in entries.flatten() {
            let p = e.path();
            let Some(ext) = p.extension().and_then(|x| x.to_str()) else {
                continue;
            };
            if !matches!(ext, "cu" | "cuh" | "h") {
                continue;
            }
            let rel = format!(
                "kernels/{}",
                p.file_name().unwrap_or_default().to_string_lossy()
            );
            if !KERNELS.contains(&rel.as_str()) && !HEADERS.contains(&rel.as_str()) {
                fail!("{rel} exists but is not listed in build.rs KERNELS/HEADERS");
            }
        }
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
}
