//! Feature `cuda-emu`: the kernels of kernels/ compiled as C++ for the CPU emulation in
//! kernels/emu/ (see kernels/emu/emu.h for the model), so tests run every launcher and kernel
//! without a GPU.
//!
//! The sources are copied to `$OUT_DIR/emu/` with three rewrites that plain C++ cannot express
//! as macros; everything else (`__global__`, `threadIdx`, shuffles, half types, the runtime calls)
//! is supplied by the headers in kernels/emu/, which shadow the CUDA ones:
//!
//! - `extern __shared__ T name[];` becomes `T *name = ::emu::dynamic_smem<T>();`
//! - every other `__shared__` declaration is followed by `::emu::poison_shared_once(name, [] {});`
//!   for each variable it declares (fresh garbage per block, as on a GPU, and its size counted
//!   against the shared-memory limit);
//! - `kernel<targs><<<config>>>(args)` becomes
//!   `::emu::launch((const void *)&kernel<targs>, [=]() { kernel<targs>(args); }, config)`.
//!
//! The rewriter only accepts the shapes it knows and fails the build on anything else, so a new
//! construct in a kernel cannot be silently mistranslated.

use crate::common::{bindings, out_dir, track_kernel_sources, HEADERS, KERNELS, SM90A_KERNELS};
use std::path::Path;

/// The emulation's own sources and headers.
const EMU_FILES: &[&str] = &[
    "kernels/emu/emu.h",
    "kernels/emu/emu_mma.h",
    "kernels/emu/emu_runtime.cpp",
    "kernels/emu/pagedkv_emu.h",
    "kernels/emu/cuda_runtime.h",
    "kernels/emu/cuda_fp16.h",
    "kernels/emu/cuda_bf16.h",
    "kernels/emu/selftest.cu",
];

pub fn build() {
    track_kernel_sources();
    for f in EMU_FILES {
        if !Path::new(f).is_file() {
            fail!("{f} is listed in build/emu.rs but does not exist");
        }
        println!("cargo:rerun-if-changed={f}");
    }
    let dir = out_dir().join("emu");
    if let Err(e) = std::fs::create_dir_all(&dir) {
        fail!("cannot create {}: {e}", dir.display());
    }
    let mut units = Vec::new();
    for f in KERNELS.iter().chain(SM90A_KERNELS).chain(HEADERS) {
        let src = match std::fs::read_to_string(f) {
            Ok(s) => s,
            Err(e) => fail!("cannot read {f}: {e}"),
        };
        let out = match rewrite(&src) {
            Ok(s) => s,
            Err(e) => fail!("cuda-emu cannot translate {f}: {e}"),
        };
        let name = Path::new(f).file_name().unwrap_or_default();
        // A unit is compiled as C++: g++ would take a `.cu` file for linker input.
        let dest = if f.ends_with(".cu") {
            dir.join(name).with_extension("cpp")
        } else {
            dir.join(name)
        };
        if let Err(e) = std::fs::write(&dest, out) {
            fail!("cannot write {}: {e}", dest.display());
        }
        if f.ends_with(".cu") {
            units.push(dest);
        }
    }

    // The emulation's self-test kernels go through the same translation.
    let selftest = dir.join("selftest.cpp");
    match std::fs::read_to_string("kernels/emu/selftest.cu").map(|s| rewrite(&s)) {
        Ok(Ok(s)) => {
            if let Err(e) = std::fs::write(&selftest, s) {
                fail!("cannot write {}: {e}", selftest.display());
            }
        }
        Ok(Err(e)) => fail!("cuda-emu cannot translate kernels/emu/selftest.cu: {e}"),
        Err(e) => fail!("cannot read kernels/emu/selftest.cu: {e}"),
    }
    units.push(selftest);

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        // The emulation runs thousands of fiber switches per block: always optimize, also in
        // debug builds of the crate.
        .opt_level(2)
        .debug(false)
        // kernels/emu first: its cuda_runtime.h / cuda_fp16.h / cuda_bf16.h shadow CUDA's.
        .include("kernels/emu")
        .include(&dir)
        .define("PKV_CUDA_EMU", "1")
        .define("PKV_HAVE_WGMMA", "1")
        // The kernels read 16-byte vectors of half/bf16 elements through casts, as CUDA allows.
        .flag("-fno-strict-aliasing")
        // Signed int arithmetic wraps, as the GPU's does (PTX add.s32 / mul.lo.s32): without
        // this the C++ compiler may assume no overflow and fold `t + n > x` into a test the
        // GPU does not make, so a wrap the GPU would show passes here.
        .flag("-fwrapv")
        .flag_if_supported("-Wno-unknown-pragmas")
        .warnings(false)
        .file("kernels/emu/emu_runtime.cpp");
    for u in &units {
        build.file(u);
    }
    if let Err(e) = build.try_compile("pagedkv_kernels_emu") {
        fail!("the C++ compiler failed on the emulated kernels: {e}");
    }
    bindings("kernels/pagedkv.h", "pkv", "pagedkv_ffi.rs");
    bindings("kernels/emu/pagedkv_emu.h", "pkv_emu", "pagedkv_emu_ffi.rs");
}

/// Applies the rewrites described in the module docs.
fn rewrite(src: &str) -> Result<String, String> {
    rewrite_launches(&rewrite_static_shared(&rewrite_extern_shared(src)?)?)
}

/// After each `__shared__ T a[N], b;` declaration, poisons every variable it declares once per
/// thread block (the first thread to pass the declaration does it; no thread can touch the
/// variable before passing it, and none yields in between). Without this a block would see the
/// values the previous block left in the thread_local, which would hide a missing write.
fn rewrite_static_shared(src: &str) -> Result<String, String> {
    const KEY: &str = "__shared__";
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(i) = rest.find(KEY) {
        let end = rest[i..]
            .find(';')
            .map(|e| i + e)
            .ok_or_else(|| "`__shared__` without a `;`".to_string())?;
        let decl = rest[i + KEY.len()..end].trim();
        let mut names = Vec::new();
        for (k, d) in split_top_level(decl).into_iter().enumerate() {
            let d = d.trim();
            let head = d.split(['[', '=']).next().unwrap_or("").trim();
            // The first declarator carries the type: its name is the last word.
            let name = if k == 0 {
                head.rsplit(char::is_whitespace).next().unwrap_or("")
            } else {
                head
            };
            if !is_ident(name) || d.contains('=') {
                return Err(format!("unsupported `__shared__` declaration `{decl}`"));
            }
            names.push(name.to_string());
        }
        out.push_str(&rest[..=end]);
        for n in names {
            out.push_str(&format!(" ::emu::poison_shared_once({n}, [] {{}});"));
        }
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Splits at commas outside brackets and parentheses.
fn split_top_level(s: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '[' | '(' | '<' => depth += 1,
            ']' | ')' | '>' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

fn rewrite_extern_shared(src: &str) -> Result<String, String> {
    const KEY: &str = "extern __shared__";
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(i) = rest.find(KEY) {
        out.push_str(&rest[..i]);
        let after = &rest[i + KEY.len()..];
        let end = after
            .find(';')
            .ok_or_else(|| "`extern __shared__` without a `;`".to_string())?;
        let decl = after[..end].trim();
        // `T name[]` (T one or more tokens, e.g. `float` or `unsigned char`).
        let (ty, name) = decl
            .strip_suffix("[]")
            .and_then(|d| d.rsplit_once(char::is_whitespace))
            .ok_or_else(|| format!("unsupported `extern __shared__` declaration `{decl}`"))?;
        let (ty, name) = (ty.trim(), name.trim());
        if !is_ident(name) || ty.is_empty() {
            return Err(format!(
                "unsupported `extern __shared__` declaration `{decl}`"
            ));
        }
        out.push_str(&format!("{ty} *{name} = ::emu::dynamic_smem<{ty}>()"));
        rest = &after[end..];
    }
    out.push_str(rest);
    Ok(out)
}

fn rewrite_launches(src: &str) -> Result<String, String> {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(open) = rest.find("<<<") {
        let close = rest[open..]
            .find(">>>")
            .map(|c| open + c)
            .ok_or_else(|| "`<<<` without `>>>`".to_string())?;
        let config = rest[open + 3..close].trim();
        let kstart = kernel_start(&rest[..open])?;
        let kernel = rest[kstart..open].trim();
        let after = &rest[close + 3..];
        let lparen = after
            .find(|c: char| !c.is_whitespace())
            .filter(|&p| after[p..].starts_with('('))
            .ok_or_else(|| format!("launch of `{kernel}` not followed by `(`"))?;
        let rparen = matching_paren(&after[lparen..])
            .map(|p| lparen + p)
            .ok_or_else(|| format!("unbalanced arguments in the launch of `{kernel}`"))?;
        let args = &after[lparen + 1..rparen];
        out.push_str(&rest[..kstart]);
        out.push_str(&format!(
            "::emu::launch((const void *)&{kernel}, [=]() {{ {kernel}({args}); }}, {config})"
        ));
        rest = &after[rparen + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Where the kernel expression (`name` or `name<targs>`) ending at `before`'s end starts.
fn kernel_start(before: &str) -> Result<usize, String> {
    let b = before.trim_end().as_bytes();
    let mut i = b.len();
    if i > 0 && b[i - 1] == b'>' {
        // Template arguments: walk back to the matching `<`.
        let mut depth = 0usize;
        loop {
            if i == 0 {
                return Err("unbalanced template arguments before `<<<`".to_string());
            }
            i -= 1;
            match b[i] {
                b'>' => depth += 1,
                b'<' => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                _ => {}
            }
        }
    }
    let name_end = i;
    while i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_' || b[i - 1] == b':') {
        i -= 1;
    }
    if i == name_end {
        return Err("no kernel name before `<<<`".to_string());
    }
    Ok(i)
}

/// Index of the `)` matching the `(` at `s[0]`.
fn matching_paren(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

fn is_ident(s: &str) -> bool {
    !s.is_empty()
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !s.starts_with(|c: char| c.is_ascii_digit())
}
