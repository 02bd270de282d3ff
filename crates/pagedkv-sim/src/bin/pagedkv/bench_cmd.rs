//! `pagedkv bench gpu`: in one run, the device's measured device-to-device copy bandwidth and
//! pinned host<->device bandwidth, then median kernel times (CUDA events, warm-up first) with
//! bytes moved and the fraction of that bandwidth, for decode attention over the batch x
//! context grid, reshape_and_cache, copy_blocks and swap out/in.
//!
//! Inputs: one layer of a bf16 (default) cache, block tables shuffled over the pool, so the
//! working set of every decode configuration above batch 1 x 512 exceeds L2; each timed
//! kernel's inputs are the same buffers every iteration (the KV read dominates and is far
//! larger than L2 except for the smallest points, which are marked).

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use pagedkv::cuda::{
    DecodeMode, DecodeWorkspace, DeviceAttnParams, DeviceKvCache, DeviceSeqs, Gpu, PinnedSwapSpace,
};
use pagedkv::error::CudaError;
use pagedkv::kv::{AttnParams, PagedSeqs};
use pagedkv::kv::{KvCacheConfig, KvDtype};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::sync::Arc;

/// Arguments of `pagedkv bench`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(Debug, clap::Subcommand)]
enum What {
    /// CUDA kernels: bandwidth, decode grid, cache ops, swap (needs a GPU).
    Gpu(GpuArgs),
}

/// Arguments of `pagedkv bench gpu`.
#[derive(Debug, clap::Args)]
pub struct GpuArgs {
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Timed iterations per point (the median is reported).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Untimed warm-up iterations per point.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Batch sizes (sequences) of the decode grid.
    #[arg(long, value_delimiter = ',', default_value = "1,8,64,256")]
    batches: Vec<usize>,
    /// Context lengths of the decode grid.
    #[arg(long, value_delimiter = ',', default_value = "512,4096,32768")]
    contexts: Vec<usize>,
    /// Head configurations `query:kv` of the decode grid.
    #[arg(long, value_delimiter = ',', default_value = "32:8,32:32")]
    heads: Vec<String>,
    /// Head dim.
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    /// Block size.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Decode partitioning: auto, single or split.
    #[arg(long, default_value = "auto")]
    mode: String,
}

type BoxErr = Box<dyn std::error::Error>;

/// Runs `pagedkv bench ...`.
pub fn run(args: Args) -> Result<(), BoxErr> {
    match args.what {
        What::Gpu(a) => run_gpu(a),
    }
}

/// Median of CUDA-event times of `iters` runs of `f` after `warmup` runs, in milliseconds.
fn time_ms(
    gpu: &Gpu,
    warmup: usize,
    iters: usize,
    mut f: impl FnMut() -> Result<(), CudaError>,
) -> Result<f64, BoxErr> {
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let (start, end) = (
        gpu.context().new_event(flags)?,
        gpu.context().new_event(flags)?,
    );
    for _ in 0..warmup {
        f()?;
    }
    gpu.synchronize()?;
    let mut t = Vec::with_capacity(iters);
    for _ in 0..iters.max(1) {
        start.record(gpu.stream())?;
        f()?;
        end.record(gpu.stream())?;
        end.synchronize()?;
        t.push(start.elapsed_ms(&end)? as f64);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

fn gbps(bytes: f64, ms: f64) -> f64 {
    bytes / (ms * 1e-3) / 1e9
}

fn run_gpu(a: GpuArgs) -> Result<(), BoxErr> {
    let gpu = Gpu::open(a.device)?;
    let info = gpu.info().clone();
    println!(
        "device {}: {} (sm_{}{}, {} SMs, {:.1} GiB), driver CUDA {}, runtime {}",
        info.ordinal,
        info.name,
        info.cc_major,
        info.cc_minor,
        info.sm_count,
        info.total_mem as f64 / (1u64 << 30) as f64,
        info.driver_version,
        info.runtime_version
    );
    let mode = match a.mode.as_str() {
        "auto" => DecodeMode::Auto,
        "single" => DecodeMode::SinglePass,
        "split" => DecodeMode::SplitK,
        m => return Err(format!("--mode {m}: expected auto, single or split").into()),
    };

    // ---- device-to-device copy bandwidth (read + write bytes) ----
    let n = 1usize << 30;
    let src = gpu.alloc_zeros::<u8>(n)?;
    let mut dst = gpu.alloc_zeros::<u8>(n)?;
    let stream: Arc<CudaStream> = gpu.stream().clone();
    let ms = time_ms(&gpu, a.warmup, a.iters, || {
        Ok(stream.memcpy_dtod(&src, &mut dst)?)
    })?;
    let d2d = gbps(2.0 * n as f64, ms);
    println!("d2d copy: 1 GiB in {ms:.3} ms = {d2d:.1} GB/s (read + write)");
    drop((src, dst));

    // ---- decode grid ----
    println!();
    println!(
        "decode bf16 d{} bs{} mode {:?}",
        a.head_dim, a.block_size, mode
    );
    println!(
        "{:>7} {:>6} {:>7} {:>10} {:>10} {:>9} {:>7}",
        "heads", "batch", "ctx", "median ms", "KV MB", "GB/s", "% d2d"
    );
    let mut rng = SmallRng::seed_from_u64(1);
    for h in &a.heads {
        let (nh, hkv) = parse_heads(h)?;
        for &batch in &a.batches {
            for &ctx in &a.contexts {
                let blocks_per_seq = ctx.div_ceil(a.block_size);
                let num_blocks = batch * blocks_per_seq;
                let cfg = KvCacheConfig::new(
                    1,
                    hkv,
                    a.head_dim,
                    a.block_size,
                    num_blocks,
                    KvDtype::Bf16,
                )?;
                if cfg.total_bytes() as f64 > 0.8 * info.total_mem as f64 {
                    println!(
                        "{:>7} {batch:>6} {ctx:>7}   skipped: cache needs {:.1} GiB",
                        h,
                        cfg.total_bytes() as f64 / (1u64 << 30) as f64
                    );
                    continue;
                }
                let cache = DeviceKvCache::new(&gpu, cfg)?;
                let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
                ids.shuffle(&mut rng);
                let ctx_lens = vec![ctx as i32; batch];
                let seqs = PagedSeqs {
                    block_tables: &ids,
                    max_blocks_per_seq: blocks_per_seq,
                    context_lens: &ctx_lens,
                };
                let dseqs = DeviceSeqs::upload(&gpu, &cfg, &seqs)?;
                let mut params =
                    DeviceAttnParams::upload(&gpu, &cfg, &AttnParams::new(nh, a.head_dim))?;
                params.mode = mode;
                let q: CudaSlice<bf16> =
                    gpu.upload(&vec![bf16::from_f32(0.01); batch * nh * a.head_dim])?;
                let mut out: CudaSlice<bf16> = gpu.alloc_zeros(batch * nh * a.head_dim)?;
                let mut ws = DecodeWorkspace::new();
                let ms = time_ms(&gpu, a.warmup, a.iters, || {
                    cache.paged_attention_decode(&gpu, 0, &q, &dseqs, &params, &mut ws, &mut out)
                })?;
                let kv_bytes = (batch * ctx * hkv * a.head_dim * 2 * 2) as f64;
                let io = (2 * batch * nh * a.head_dim * 2) as f64;
                let bw = gbps(kv_bytes + io, ms);
                println!(
                    "{:>7} {batch:>6} {ctx:>7} {ms:>10.4} {:>10.1} {bw:>9.1} {:>6.1}%",
                    h,
                    kv_bytes / 1e6,
                    100.0 * bw / d2d
                );
            }
        }
    }

    // ---- reshape_and_cache, copy_blocks ----
    println!();
    let (hkv, d, bs) = (8usize, a.head_dim, a.block_size);
    let tokens = 16384usize;
    let cfg = KvCacheConfig::new(4, hkv, d, bs, tokens.div_ceil(bs) * 2, KvDtype::Bf16)?;
    let mut cache = DeviceKvCache::new(&gpu, cfg)?;
    let mut slots: Vec<i64> = (0..(cfg.num_blocks() * bs) as i64).collect();
    slots.shuffle(&mut rng);
    slots.truncate(tokens);
    let dslots = gpu.upload(&slots)?;
    let k: CudaSlice<bf16> = gpu.alloc_zeros(tokens * hkv * d)?;
    let v: CudaSlice<bf16> = gpu.alloc_zeros(tokens * hkv * d)?;
    let ms = time_ms(&gpu, a.warmup, a.iters, || {
        cache.reshape_and_cache(&gpu, 1, &k, &v, &dslots)
    })?;
    let bytes = (2 * 2 * tokens * hkv * d * 2) as f64; // K and V, read and write
    let bw = gbps(bytes, ms);
    println!("reshape_and_cache {tokens} tokens x {hkv} kv heads x d{d}: {ms:.4} ms, {bw:.1} GB/s, {:.1}% d2d", 100.0 * bw / d2d);

    let half = cfg.num_blocks() / 2;
    let mut pairs: Vec<(u32, u32)> = (0..half as u32).map(|i| (i, i + half as u32)).collect();
    pairs.shuffle(&mut rng);
    pairs.truncate(1024.min(half));
    let ms = time_ms(&gpu, a.warmup, a.iters, || cache.copy_blocks(&gpu, &pairs))?;
    let bytes = (2 * pairs.len() * cfg.bytes_per_block()) as f64;
    let bw = gbps(bytes, ms);
    println!(
        "copy_blocks {} pairs x {} KiB: {ms:.4} ms, {bw:.1} GB/s, {:.1}% d2d (pair upload included)",
        pairs.len(),
        cfg.bytes_per_block() / 1024,
        100.0 * bw / d2d
    );

    // ---- swap vs pinned host bandwidth ----
    let swap_blocks = pairs.len();
    let mut pinned = PinnedSwapSpace::new(&gpu, &cfg, swap_blocks)?;
    // Plain pinned copies of the same size: the bandwidth swap is measured against.
    let bytes = swap_blocks * cfg.bytes_per_block();
    let mut dev_buf = gpu.alloc_zeros::<u8>(bytes)?;
    let mut host_pinned = {
        // SAFETY: the pinned buffer is fully written by the first device-to-host copy below
        // before anything reads it; it is only used as a copy destination here.
        unsafe { gpu.context().alloc_pinned::<u8>(bytes) }?
    };
    let ms_pin = time_ms(&gpu, a.warmup, a.iters, || {
        Ok(stream.memcpy_dtoh(&dev_buf, &mut host_pinned)?)
    })?;
    let pin_bw = gbps(bytes as f64, ms_pin);
    let ms_pin_in = time_ms(&gpu, a.warmup, a.iters, || {
        Ok(stream.memcpy_htod(&host_pinned, &mut dev_buf)?)
    })?;
    let pin_in_bw = gbps(bytes as f64, ms_pin_in);
    // Swap out blocks in runs of 4 (scattered runs, as a preempted sequence's blocks are).
    let mapping: Vec<(u32, u32)> = (0..swap_blocks as u32)
        .map(|i| ((i / 4) * 8 + i % 4, i))
        .filter(|&(s, _)| (s as usize) < cfg.num_blocks())
        .collect();
    let ms = time_ms(&gpu, a.warmup, a.iters, || {
        cache.swap_out(&gpu, &mut pinned, &mapping)
    })?;
    let bw = gbps((mapping.len() * cfg.bytes_per_block()) as f64, ms);
    println!(
        "pinned copy {:.1} MB: d2h {pin_bw:.1} GB/s, h2d {pin_in_bw:.1} GB/s",
        bytes as f64 / 1e6
    );
    println!(
        "swap_out {} blocks (runs of 4): {ms:.4} ms, {bw:.1} GB/s, {:.1}% of pinned d2h",
        mapping.len(),
        100.0 * bw / pin_bw
    );
    let back: Vec<(u32, u32)> = mapping.iter().map(|&(s, d)| (d, s)).collect();
    let ms = time_ms(&gpu, a.warmup, a.iters, || {
        cache.swap_in(&gpu, &mut pinned, &back)
    })?;
    let bw = gbps((back.len() * cfg.bytes_per_block()) as f64, ms);
    println!(
        "swap_in {} blocks (runs of 4): {ms:.4} ms, {bw:.1} GB/s, {:.1}% of pinned h2d",
        back.len(),
        100.0 * bw / pin_in_bw
    );
    Ok(())
}

fn parse_heads(s: &str) -> Result<(usize, usize), BoxErr> {
    let (q, kv) = s
        .split_once(':')
        .ok_or_else(|| format!("--heads {s}: expected query:kv, e.g. 32:8"))?;
    Ok((q.trim().parse()?, kv.trim().parse()?))
}
