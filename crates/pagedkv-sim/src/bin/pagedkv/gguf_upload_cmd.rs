//! `pagedkv gguf upload-bench FILE` (feature `cuda`): uploads a GGUF file's tensors to the GPU
//! every way the library offers and reports each beside the baselines measured in the same run,
//! then checks every byte.
//!
//! * Baseline: a pinned-buffer host-to-device memcpy of the same byte count (1 GiB copies).
//! * Raw uploads, each against that baseline: staged with `--fill-threads` fill threads into a
//!   write-combined ring and into a host-cached one, staged with one fill thread, and
//!   registered (the file's pages registered read-only and DMAed in place; the register and
//!   unregister times are printed apart, since they are paid once per load).
//! * Device dequantization (`--dequant`, bf16 by default): the kernel alone on the raw tensors
//!   already on the device, per source type, against a device-to-device copy (bytes read plus
//!   bytes written each), and the dequantizing uploads (staged and registered), against the
//!   pinned memcpy of the file's bytes.
//!
//! Upload figures are wall-clock medians of `--iters` runs after one untimed warm-up (which also
//! warms the page cache: a file larger than it is measured from disk), from the first call until
//! the stream has finished; the kernel and the device copy are timed with CUDA events. Every
//! raw upload's last result is downloaded and compared with the file byte for byte, every
//! dequantized one with the CPU dequantizer bit for bit.

use cudarc::driver::sys::CUevent_flags;
use half::{bf16, f16};
use pagedkv::cuda::Gpu;
use pagedkv::gguf::upload::{
    dequantize_on_device_into, DequantTo, DeviceWeights, UploadOptions, UploadPath, Uploader,
};
use pagedkv::gguf::{dequantize_into_bf16, dequantize_into_f16, GgmlType, Gguf, GgufBytes};
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `pagedkv gguf upload-bench`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The GGUF file (memory-mapped: it must not be rewritten while the command runs).
    file: PathBuf,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Timed runs of each way (the median is reported).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Pinned staging buffers in the ring.
    #[arg(long, default_value_t = UploadOptions::default().staging_buffers)]
    buffers: usize,
    /// MiB per staging buffer.
    #[arg(long, default_value_t = UploadOptions::default().staging_bytes >> 20)]
    buffer_mib: usize,
    /// Fill threads of the staged ways.
    #[arg(long, default_value_t = UploadOptions::default().fill_threads)]
    fill_threads: usize,
    /// Output type of the dequantizing ways: bf16, f16, or none to skip them.
    #[arg(long, default_value = "bf16")]
    dequant: String,
    /// Skip the byte-for-byte and bit-for-bit checks (they download everything).
    #[arg(long)]
    no_verify: bool,
}

type BoxErr = Box<dyn std::error::Error>;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Runs `pagedkv gguf upload-bench`.
pub fn run(a: Args) -> Result<(), BoxErr> {
    let to = match a.dequant.to_ascii_lowercase().as_str() {
        "bf16" => Some(DequantTo::BF16),
        "f16" => Some(DequantTo::F16),
        "none" => None,
        other => return Err(format!("--dequant {other}: bf16, f16 or none").into()),
    };
    // SAFETY: `map` requires that nobody truncates or writes the file while the map lives; the
    // map lives for this one command, whose documented contract (`--help`) is that the model
    // file is not rewritten meanwhile, and the mapping is read-only.
    let bytes = unsafe { GgufBytes::map(&a.file) }?;
    let g = Gguf::parse(bytes.bytes()).map_err(|e| format!("{}: {e}", a.file.display()))?;
    let total = g.total_tensor_bytes();
    if total == 0 {
        return Err(format!("{}: no tensor bytes to upload", a.file.display()).into());
    }
    let gpu = Gpu::open(a.device)?;
    let info = gpu.info();
    println!(
        "device {}: {} (sm_{}{}, {} SMs), driver CUDA {}, runtime {}",
        info.ordinal,
        info.name,
        info.cc_major,
        info.cc_minor,
        info.sm_count,
        info.driver_version,
        info.runtime_version
    );
    println!(
        "file {}: {} tensors, {} bytes ({:.2} GiB)",
        a.file.display(),
        g.tensors().len(),
        total,
        total as f64 / (1u64 << 30) as f64
    );
    let iters = a.iters.max(1);
    let base = pinned_memcpy(&gpu, total, iters)?;

    // ---- raw uploads ----
    let staged = |threads: usize, wc: bool| UploadOptions {
        path: UploadPath::Staged,
        staging_buffers: a.buffers,
        staging_bytes: a.buffer_mib.saturating_mul(1 << 20),
        write_combined: wc,
        fill_threads: threads,
        dequantize: None,
    };
    let registered = UploadOptions {
        path: UploadPath::Registered,
        ..staged(0, false)
    };
    let ways = [
        (
            format!("staged, {} fill threads, write-combined", a.fill_threads),
            staged(a.fill_threads, true),
        ),
        (
            format!("staged, {} fill threads, host-cached", a.fill_threads),
            staged(a.fill_threads, false),
        ),
        (
            "staged, 1 fill thread, write-combined".to_string(),
            staged(1, true),
        ),
        ("registered (pages pinned in place)".to_string(), registered),
    ];
    let mut best: Option<(String, f64)> = None;
    let mut raw_weights = None;
    // A way that fails (a driver without read-only registration, say) is reported and the
    // others still run; the command fails at the end.
    let mut failed = Vec::new();
    for (name, opts) in &ways {
        let run = bench_upload(&gpu, &g, *opts, iters, name, base).and_then(|(rate, w)| {
            if !a.no_verify {
                verify_raw(&gpu, &g, &w)?;
            }
            Ok((rate, w))
        });
        match run {
            Ok((rate, w)) => {
                if best.as_ref().is_none_or(|b| rate > b.1) {
                    best = Some((name.clone(), rate));
                }
                raw_weights = Some(w);
            }
            Err(e) => {
                println!("{name}: FAILED: {e}");
                failed.push(name.clone());
            }
        }
    }
    if let Some((name, rate)) = &best {
        let pct = 100.0 * rate / base;
        println!(
            "best raw way: {name}, {rate:.2} GB/s = {pct:.1}% of pinned memcpy (target >= 90%: {})",
            if pct >= 90.0 { "met" } else { "MISSED" }
        );
    }

    // ---- device dequantization ----
    if let Some(to) = to {
        let raw = raw_weights.ok_or("no raw upload succeeded")?;
        if let Err(e) = kernel_alone(&gpu, &g, &raw, to, iters, a.no_verify) {
            println!("dequantize on the device: FAILED: {e}");
            failed.push("the kernel alone".to_string());
        }
        drop(raw);
        dequantizing_uploads(&gpu, &g, &a, to, iters, base, &mut failed);
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("failed: {}", failed.join("; ")).into())
    }
}

/// The staged and registered dequantizing uploads, each timed and verified.
fn dequantizing_uploads(
    gpu: &Gpu,
    g: &Gguf<'_>,
    a: &Args,
    to: DequantTo,
    iters: usize,
    base: f64,
    failed: &mut Vec<String>,
) {
    let staged = UploadOptions {
        path: UploadPath::Staged,
        staging_buffers: a.buffers,
        staging_bytes: a.buffer_mib.saturating_mul(1 << 20),
        write_combined: true,
        fill_threads: a.fill_threads,
        dequantize: Some(to),
    };
    for (name, opts) in [
        (
            format!(
                "staged + dequantize to {to:?}, {} fill threads",
                a.fill_threads
            ),
            staged,
        ),
        (
            format!("registered + dequantize to {to:?}"),
            UploadOptions {
                path: UploadPath::Registered,
                ..staged
            },
        ),
    ] {
        let run = bench_upload(gpu, g, opts, iters, &name, base).and_then(|(_, w)| {
            if !a.no_verify {
                verify_dequantized(gpu, g, &w, to)?;
            }
            Ok(())
        });
        if let Err(e) = run {
            println!("{name}: FAILED: {e}");
            failed.push(name);
        }
    }
}

/// Median GB/s of `reps` copies of one pinned buffer of up to 1 GiB covering `total` bytes.
fn pinned_memcpy(gpu: &Gpu, total: u64, iters: usize) -> Result<f64, BoxErr> {
    let reps = total.div_ceil(1 << 30);
    let chunk = usize::try_from(total.div_ceil(reps))?;
    let moved = reps * chunk as u64;
    // SAFETY: the pinned buffer is uninitialized; it is fully written (write_bytes) below,
    // through as_mut_ptr, before anything reads it.
    let mut pinned = unsafe { gpu.context().alloc_pinned::<u8>(chunk) }?;
    // SAFETY: as_mut_ptr points to `chunk` writable bytes of the buffer just allocated.
    unsafe { std::ptr::write_bytes(pinned.as_mut_ptr()?, 0x5a, chunk) };
    let mut dev = gpu.alloc_zeros::<u8>(chunk)?;
    let stream = gpu.stream().clone();
    let mut rates = Vec::with_capacity(iters);
    for i in 0..=iters {
        gpu.synchronize()?;
        let t0 = Instant::now();
        for _ in 0..reps {
            stream.memcpy_htod(&pinned, &mut dev)?;
        }
        gpu.synchronize()?;
        if i > 0 {
            rates.push(moved as f64 / t0.elapsed().as_secs_f64() / 1e9);
        }
    }
    let base = median(rates);
    println!("pinned memcpy H2D: {reps} x {chunk} bytes, median {base:.2} GB/s");
    Ok(base)
}

/// Times `iters` uploads with `opts` (after a warm-up) and prints the line of this way.
fn bench_upload(
    gpu: &Gpu,
    g: &Gguf<'_>,
    opts: UploadOptions,
    iters: usize,
    name: &str,
    base: f64,
) -> Result<(f64, DeviceWeights), BoxErr> {
    let total = g.total_tensor_bytes();
    let t_new = Instant::now();
    let mut up = Uploader::new(gpu, opts)?;
    let setup = t_new.elapsed().as_secs_f64();
    let (mut rates, mut reg, mut unreg) = (Vec::new(), Vec::new(), Vec::new());
    let mut last = None;
    for i in 0..=iters {
        drop(last.take());
        gpu.synchronize()?;
        let mut seen = 0u64;
        let t0 = Instant::now();
        let w = up.upload(g, |p| seen = p.done)?;
        gpu.synchronize()?;
        let secs = t0.elapsed().as_secs_f64();
        if seen != total {
            return Err(format!("{name}: progress ended at {seen} of {total} bytes").into());
        }
        if i > 0 {
            rates.push(total as f64 / secs / 1e9);
            if let Some(t) = up.register_times() {
                reg.push(t.register.as_secs_f64());
                unreg.push(t.unregister.as_secs_f64());
            }
        }
        last = Some(w);
    }
    let rate = median(rates);
    let mut line = format!(
        "{name}: median {rate:.2} GB/s = {:.1}% of pinned memcpy (setup {:.3} s)",
        100.0 * rate / base,
        setup
    );
    if !reg.is_empty() {
        let (r, u) = (median(reg), median(unreg));
        let dma = (total as f64 / rate / 1e9 - r - u).max(1e-9);
        line += &format!(
            "; register {r:.3} s, unregister {u:.3} s, DMA alone {:.2} GB/s",
            total as f64 / dma / 1e9
        );
    }
    if let Some(st) = up.fill_stats() {
        line += &format!(
            "; {} fills, {} queued ahead of an earlier one",
            st.fills, st.out_of_order
        );
    }
    println!("{line}");
    Ok((rate, last.ok_or("no upload ran")?))
}

/// Every tensor back, byte for byte.
fn verify_raw(gpu: &Gpu, g: &Gguf<'_>, w: &DeviceWeights) -> Result<(), BoxErr> {
    for t in g.tensors() {
        let d = w
            .get(t.name())
            .ok_or_else(|| format!("{} missing after upload", t.name()))?;
        if d.ty() != t.ty() || d.shape() != t.shape() || gpu.download(d.data())? != t.data() {
            return Err(format!("{}: device copy differs from the file", t.name()).into());
        }
    }
    println!("  verified: {} tensors identical to the file", w.len());
    Ok(())
}

/// The CPU dequantizer's bytes of `t`.
fn cpu_bytes(ty: GgmlType, data: &[u8], n: usize, to: DequantTo) -> Result<Vec<u8>, BoxErr> {
    Ok(match to {
        DequantTo::F16 => {
            let mut v = vec![f16::ZERO; n];
            dequantize_into_f16(ty, data, &mut v)?;
            v.iter().flat_map(|x| x.to_le_bytes()).collect()
        }
        DequantTo::BF16 => {
            let mut v = vec![bf16::ZERO; n];
            dequantize_into_bf16(ty, data, &mut v)?;
            v.iter().flat_map(|x| x.to_le_bytes()).collect()
        }
    })
}

/// Every dequantized tensor against the CPU dequantizer, bit for bit.
fn verify_dequantized(
    gpu: &Gpu,
    g: &Gguf<'_>,
    w: &DeviceWeights,
    to: DequantTo,
) -> Result<(), BoxErr> {
    for t in g.tensors() {
        let d = w
            .get(t.name())
            .ok_or_else(|| format!("{} missing after upload", t.name()))?;
        let want = cpu_bytes(t.ty(), t.data(), t.n_elements() as usize, to)?;
        if d.ty() != to.ggml_type() || gpu.download(d.data())?[..want.len()] != want[..] {
            return Err(
                format!("{}: device dequantization differs from the CPU's", t.name()).into(),
            );
        }
    }
    println!(
        "  verified: {} tensors bit-identical to the CPU dequantizer",
        w.len()
    );
    Ok(())
}

/// Median CUDA-event time of `iters` runs of `f` (after one warm-up run), in milliseconds.
fn event_ms(
    gpu: &Gpu,
    iters: usize,
    mut f: impl FnMut() -> Result<(), BoxErr>,
) -> Result<f64, BoxErr> {
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let (start, end) = (
        gpu.context().new_event(flags)?,
        gpu.context().new_event(flags)?,
    );
    f()?;
    gpu.synchronize()?;
    let mut t = Vec::with_capacity(iters);
    for _ in 0..iters.max(1) {
        start.record(gpu.stream())?;
        f()?;
        end.record(gpu.stream())?;
        end.synchronize()?;
        t.push(f64::from(start.elapsed_ms(&end)?));
    }
    Ok(median(t))
}

/// The kernel alone, per source type, on the raw tensors already on the device, beside a
/// device-to-device copy of 1 GiB (both counted as bytes read + bytes written).
fn kernel_alone(
    gpu: &Gpu,
    g: &Gguf<'_>,
    raw: &DeviceWeights,
    to: DequantTo,
    iters: usize,
    no_verify: bool,
) -> Result<(), BoxErr> {
    // Baseline: device-to-device copy.
    let n = 1usize << 30;
    let src = gpu.alloc_zeros::<u8>(n)?;
    let mut dst = gpu.alloc_zeros::<u8>(n)?;
    let ms = event_ms(gpu, iters, || {
        Ok(gpu.stream().memcpy_dtod(&src, &mut dst)?)
    })?;
    drop((src, dst));
    let d2d = 2.0 * n as f64 / (ms * 1e-3) / 1e9;
    println!("device-to-device copy: 1 GiB, median {d2d:.2} GB/s (read + write)");

    let mut types: Vec<GgmlType> = Vec::new();
    for t in g.tensors() {
        if !types.contains(&t.ty()) {
            types.push(t.ty());
        }
    }
    let mut all_bytes = 0u64;
    let mut all_secs = 0.0;
    for ty in types {
        let tensors: Vec<_> = g.tensors().iter().filter(|t| t.ty() == ty).collect();
        let mut outs = Vec::with_capacity(tensors.len());
        let mut moved = 0u64;
        for t in &tensors {
            let n = t.n_elements() as usize * DequantTo::BYTES;
            outs.push(gpu.alloc_zeros::<u8>(n.max(1))?);
            moved += (t.n_bytes() + n) as u64;
        }
        let srcs = tensors
            .iter()
            .map(|t| raw.get(t.name()).map(|d| d.data()))
            .collect::<Option<Vec<_>>>()
            .ok_or("raw tensor missing")?;
        let ms = event_ms(gpu, iters, || {
            for (s, out) in srcs.iter().zip(outs.iter_mut()) {
                dequantize_on_device_into(gpu, ty, s, out, to)?;
            }
            Ok(())
        })?;
        let secs = ms * 1e-3;
        all_bytes += moved;
        all_secs += secs;
        let rate = moved as f64 / secs / 1e9;
        println!(
            "dequantize {ty} -> {to:?} on the device: {} tensors, {:.1} MB read + written, median \
             {rate:.1} GB/s = {:.1}% of the device-to-device copy",
            tensors.len(),
            moved as f64 / 1e6,
            100.0 * rate / d2d
        );
        if !no_verify {
            for (t, out) in tensors.iter().zip(&outs) {
                let want = cpu_bytes(ty, t.data(), t.n_elements() as usize, to)?;
                if gpu.download(out)?[..want.len()] != want[..] {
                    return Err(format!(
                        "{}: device dequantization differs from the CPU's",
                        t.name()
                    )
                    .into());
                }
            }
        }
    }
    let rate = all_bytes as f64 / all_secs / 1e9;
    let pct = 100.0 * rate / d2d;
    println!(
        "dequantize, whole file: {rate:.1} GB/s = {pct:.1}% of the device-to-device copy \
         (target >= 70% of device memory bandwidth: {}){}",
        if pct >= 70.0 { "met" } else { "MISSED" },
        if no_verify {
            ""
        } else {
            "; every tensor bit-identical to the CPU dequantizer"
        }
    );
    Ok(())
}
