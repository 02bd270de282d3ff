//! What the `cuda` and `cuda-emu` builds share: the kernel source listing, the failure macro
//! and the bindgen step.

use std::path::{Path, PathBuf};

/// Every translation unit of the kernel library.
pub const KERNELS: &[&str] = &[
    "kernels/paged_attention.cu",
    "kernels/cache_ops.cu",
    "kernels/probe.cu",
    "kernels/dequant.cu",
];
/// Units built only for sm_90a (Hopper's arch-specific instructions) by the `cuda` build, when
/// sm_90 is among its targets, and always by the emulation; either build then defines
/// `PKV_HAVE_WGMMA` for every unit.
pub const SM90A_KERNELS: &[&str] = &["kernels/prefill_wgmma.cu"];
/// Every header those units include; a change to any of them rebuilds the kernels.
pub const HEADERS: &[&str] = &[
    "kernels/pagedkv.h",
    "kernels/common.cuh",
    "kernels/attention.cuh",
    "kernels/mma.cuh",
    "kernels/decode_v2.cuh",
    "kernels/decode_mma.cuh",
    "kernels/decode_merge_weighted.cuh",
    "kernels/decode_resident.cuh",
    "kernels/prefill_mma.cuh",
    "kernels/wgmma.cuh",
    "kernels/prefill_wgmma.cuh",
    "kernels/prefill_wgmma_persist.cuh",
];

/// Stops the build with a message.
macro_rules! fail {
    ($($arg:tt)*) => {{
        eprintln!();
        eprintln!("error: pagedkv build: {}", format!($($arg)*));
        eprintln!();
        std::process::exit(1);
    }};
}

/// Checks the listing and registers every kernel file as a rebuild trigger.
pub fn track_kernel_sources() {
    for f in KERNELS.iter().chain(SM90A_KERNELS).chain(HEADERS) {
        if !Path::new(f).is_file() {
            fail!("{f} is listed in build/common.rs but does not exist");
        }
        println!("cargo:rerun-if-changed={f}");
    }
    check_listing();
}

/// Fails when kernels/ holds a source or header that is not listed, so a new file cannot be
/// silently left out of the build or of the rebuild triggers.
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
        if ![KERNELS, SM90A_KERNELS, HEADERS]
            .iter()
            .any(|list| list.contains(&rel.as_str()))
        {
            fail!(
                "{rel} exists but is not listed in build/common.rs KERNELS/SM90A_KERNELS/HEADERS"
            );
        }
    }
}

/// The build's output directory.
pub fn out_dir() -> PathBuf {
    PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default())
}

/// Runs bindgen over `header` (functions, types and constants named by `prefix`) into
/// `$OUT_DIR/<out_name>`.
pub fn bindings(header: &str, prefix: &str, out_name: &str) {
    let bindings = bindgen::Builder::default()
        .header(header)
        .allowlist_function(format!("{prefix}_.*"))
        .allowlist_type(format!("{prefix}_.*"))
        .allowlist_var(format!("{}_.*", prefix.to_ascii_uppercase()))
        .default_enum_style(bindgen::EnumVariation::Consts)
        .derive_debug(true)
        .derive_default(true)
        .layout_tests(true)
        .generate_comments(true)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .generate();
    let out = out_dir();
    match bindings {
        Ok(b) => {
            if let Err(e) = b.write_to_file(out.join(out_name)) {
                fail!("cannot write bindings to {}: {e}", out.display());
            }
        }
        Err(e) => fail!(
            "bindgen failed on {header}: {e}\n\
             bindgen needs libclang: `apt-get install libclang-dev` (or set LIBCLANG_PATH)"
        ),
    }
}
