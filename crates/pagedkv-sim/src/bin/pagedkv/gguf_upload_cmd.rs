//! `pagedkv gguf upload-bench FILE` (feature `cuda`): uploads a GGUF file's tensors to the GPU
//! through the pinned staging ring and reports GB/s beside a pinned-buffer host-to-device memcpy
//! of the same byte count measured in the same run, then downloads every tensor and compares it
//! with the file byte for byte.
//!
//! Both figures are wall-clock medians from queueing the first copy until the stream has
//! finished the last. The upload's time includes its device allocations and the copies out of
//! the memory-mapped file; one untimed upload first warms the page cache, so a file larger than the
//! page cache is measured from disk.

use pagedkv::cuda::Gpu;
use pagedkv::gguf::upload::{UploadOptions, Uploader};
use pagedkv::gguf::{Gguf, GgufBytes};
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
    /// Timed runs of each side (the median is reported).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Pinned staging buffers in the ring.
    #[arg(long, default_value_t = UploadOptions::default().staging_buffers)]
    buffers: usize,
    /// MiB per staging buffer.
    #[arg(long, default_value_t = UploadOptions::default().staging_bytes >> 20)]
    buffer_mib: usize,
    /// Pin the staging ring host-cached instead of write-combined.
    #[arg(long)]
    no_write_combined: bool,
}

type BoxErr = Box<dyn std::error::Error>;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs `pagedkv gguf upload-bench`.
pub fn run(a: Args) -> Result<(), BoxErr> {
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
        "device {}: {} (sm_{}{}), driver CUDA {}, runtime {}",
        info.ordinal,
        info.name,
        info.cc_major,
        info.cc_minor,
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
    let stream = gpu.stream().clone();

    // ---- baseline: one pinned buffer of up to 1 GiB copied whole, `reps` times ----
    let reps = total.div_ceil(1 << 30);
    let chunk = usize::try_from(total.div_ceil(reps))?;
    let moved = reps * chunk as u64;
    // SAFETY: the pinned buffer is uninitialized; it is fully written (write_bytes) below,
    // through as_mut_ptr, before anything reads it.
    let mut pinned = unsafe { gpu.context().alloc_pinned::<u8>(chunk) }?;
    // SAFETY: as_mut_ptr points to `chunk` writable bytes of the buffer just allocated.
    unsafe { std::ptr::write_bytes(pinned.as_mut_ptr()?, 0x5a, chunk) };
    let mut dev = gpu.alloc_zeros::<u8>(chunk)?;
    let mut base = Vec::with_capacity(iters);
    for i in 0..=iters {
        gpu.synchronize()?;
        let t0 = Instant::now();
        for _ in 0..reps {
            stream.memcpy_htod(&pinned, &mut dev)?;
        }
        gpu.synchronize()?;
        if i > 0 {
            base.push(moved as f64 / t0.elapsed().as_secs_f64() / 1e9);
        }
    }
    drop((pinned, dev));
    let base = median(base);
    println!("pinned memcpy H2D: {reps} x {chunk} bytes, median {base:.2} GB/s");

    // ---- upload through the staging ring ----
    let opts = UploadOptions {
        staging_buffers: a.buffers,
        staging_bytes: a.buffer_mib.saturating_mul(1 << 20),
        write_combined: !a.no_write_combined,
    };
    let mut up = Uploader::new(&gpu, opts)?;
    let mut rates = Vec::with_capacity(iters);
    let mut last = None;
    for i in 0..=iters {
        drop(last.take());
        gpu.synchronize()?;
        let mut calls = 0u64;
        let mut seen = 0u64;
        let t0 = Instant::now();
        let w = up.upload(&g, |p| {
            calls += 1;
            seen = p.done;
        })?;
        let secs = t0.elapsed().as_secs_f64();
        if seen != total {
            return Err(format!("progress ended at {seen} of {total} bytes").into());
        }
        if i > 0 {
            rates.push(total as f64 / secs / 1e9);
        } else {
            println!("warm-up upload: {secs:.3} s, {calls} progress calls");
        }
        last = Some(w);
    }
    let rate = median(rates);
    let pct = 100.0 * rate / base;
    println!(
        "upload: {} x {} MiB staging ({}), median {rate:.2} GB/s = {pct:.1}% of pinned memcpy \
         (target >= 80%: {})",
        opts.staging_buffers,
        opts.staging_bytes >> 20,
        if opts.write_combined {
            "write-combined"
        } else {
            "host-cached"
        },
        if pct >= 80.0 { "met" } else { "MISSED" }
    );

    // ---- correctness: every tensor back, byte for byte ----
    let w = last.ok_or("no upload ran")?;
    for t in g.tensors() {
        let d = w
            .get(t.name())
            .ok_or_else(|| format!("{} missing after upload", t.name()))?;
        if d.ty() != t.ty() || d.shape() != t.shape() || gpu.download(d.data())? != t.data() {
            return Err(format!("{}: device copy differs from the file", t.name()).into());
        }
    }
    println!("verified: {} tensors identical to the file", w.len());
    Ok(())
}
