//! `pagedkv bench gpu`: in one run, the device's measured device-to-device copy bandwidth, the
//! dense peer (benches/gpu_sdpa_baseline.py: torch SDPA on contiguous K/V) and pagedkv's decode
//! and prefill attention over the grids of issue 15, side by side, then reshape_and_cache,
//! copy_blocks and swap against the bandwidths they are bounded by.
//!
//! Each attention point is timed three ways (graph replay, back-to-back, one call) on random
//! bf16 inputs, rotating distinct copies where one copy would fit in L2; the rules and the
//! accounting are pagedkv_sim::gpu_bench (tested without a GPU), the timing bench_timing.rs, the
//! points bench_attn.rs, the peer bench_peer.rs.

use crate::bench_attn::{Bench, Measured};
use crate::bench_peer::{self, PeerRequest};
use crate::bench_timing::{BoxErr, Clock};
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use pagedkv::cuda::{DecodeMode, DeviceKvCache, Gpu, PinnedSwapSpace, PrefillTiling};
use pagedkv::kv::{KvCacheConfig, KvDtype};
use pagedkv_sim::gpu_bench::{
    decode_header, decode_row, default_decode_grid, default_prefill_grid, median, parse_points,
    prefill_header, prefill_row, DecodePoint, Outcome, PeerArgs, PeerResults, PrefillPoint, Shape,
};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;
use std::sync::Arc;

/// Arguments of `pagedkv bench`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(Debug, clap::Subcommand)]
enum What {
    /// CUDA kernels against the dense SDPA peer: bandwidth, decode and prefill grids, cache
    /// ops, swap (needs a GPU).
    Gpu(GpuArgs),
}

/// Arguments of `pagedkv bench gpu`.
#[derive(Debug, clap::Args)]
pub struct GpuArgs {
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Decode points `QUERY:KV/BATCHxCTX,...`, `default` (issue 15's grid) or `none`.
    #[arg(long, default_value = "default")]
    decode: String,
    /// Prefill points `QUERY:KV/CHUNK+CACHED,...`, `default` (issue 15's grid) or `none`.
    #[arg(long, default_value = "default")]
    prefill: String,
    /// Head dim.
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    /// Block size (tokens per block).
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Decode partitioning: auto, single, split, or splits:N (exactly N splits).
    #[arg(long, default_value = "auto")]
    mode: String,
    /// Prefill tilings, a list of auto, 16, 32 (query rows per warp), wgmma and wgmma128 (64 or
    /// 128 rows per thread block), wgmma-ovl and wgmma128-ovl (the overlapped schedule),
    /// wgmma128-persist (the persistent grid): the prefill grid runs once per entry (beside the
    /// one peer run), for A/B comparisons in one process.
    #[arg(long, default_value = "auto")]
    prefill_tiling: String,
    /// Launches per graph and back-to-back timing (at least; a whole number of rotations).
    #[arg(long, default_value_t = 20)]
    launches: usize,
    /// Graph replays and back-to-back runs per point (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// One-call timings per point (the median is reported); also the cache ops' timed runs.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Untimed launches per point before timing (at least one per input copy).
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// L2 bytes the rotation rule assumes (default: the device's).
    #[arg(long)]
    l2_bytes: Option<u64>,
    /// The dense peer's script, or `none`.
    #[arg(long, default_value = "benches/gpu_sdpa_baseline.py")]
    peer: String,
    /// The Python that runs the peer.
    #[arg(long, default_value = "python3")]
    python: String,
    /// Skip checking small points' outputs against the CPU oracle.
    #[arg(long)]
    no_check: bool,
    /// Skip reshape_and_cache, copy_blocks and swap.
    #[arg(long)]
    no_cache_ops: bool,
    /// Make every attention launch a programmatic dependent launch (compute capability 9.0+):
    /// back to back, each launch's dispatch overlaps the previous one's tail.
    #[arg(long)]
    programmatic: bool,
    /// Also time each decode point as an engine's per-layer step (reshape_and_cache of the
    /// newest tokens, then decode), with plain and with programmatic launches.
    #[arg(long)]
    step: bool,
}

/// Runs `pagedkv bench ...`.
pub fn run(args: Args) -> Result<(), BoxErr> {
    match args.what {
        What::Gpu(a) => run_gpu(a),
    }
}

fn grid<P: std::str::FromStr<Err = pagedkv_sim::gpu_bench::PlanError>>(
    arg: &str,
    default: fn() -> Vec<P>,
) -> Result<Vec<P>, BoxErr> {
    Ok(match arg {
        "default" => default(),
        "none" => Vec::new(),
        list => parse_points(list)?,
    })
}

fn run_gpu(a: GpuArgs) -> Result<(), BoxErr> {
    if a.block_size == 0 || a.head_dim == 0 {
        return Err("--block-size and --head-dim must be at least 1".into());
    }
    let mode = match a.mode.as_str() {
        "auto" => DecodeMode::Auto,
        "single" => DecodeMode::SinglePass,
        "split" => DecodeMode::SplitK,
        m => match m
            .strip_prefix("splits:")
            .and_then(|n| n.parse::<u32>().ok())
        {
            Some(n) if n > 0 => DecodeMode::Splits(n),
            _ => {
                return Err(format!(
                    "--mode {m}: expected auto, single, split or splits:N (N >= 1)"
                )
                .into())
            }
        },
    };
    let tilings = a
        .prefill_tiling
        .split(',')
        .map(|t| match t.trim() {
            "auto" => Ok(PrefillTiling::Auto),
            "16" => Ok(PrefillTiling::WarpRows16),
            "32" => Ok(PrefillTiling::WarpRows32),
            "wgmma" => Ok(PrefillTiling::Wgmma),
            "wgmma128" => Ok(PrefillTiling::Wgmma128),
            "wgmma-ovl" => Ok(PrefillTiling::WgmmaOverlap),
            "wgmma128-ovl" => Ok(PrefillTiling::Wgmma128Overlap),
            "wgmma128-persist" => Ok(PrefillTiling::Wgmma128Persistent),
            t => Err(format!(
                "--prefill-tiling {t}: expected auto, 16, 32, wgmma, wgmma128, wgmma-ovl, \
                 wgmma128-ovl or wgmma128-persist"
            )),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let decode: Vec<DecodePoint> = grid(&a.decode, default_decode_grid)?;
    let prefill: Vec<PrefillPoint> = grid(&a.prefill, default_prefill_grid)?;

    let gpu = Gpu::open(a.device)?;
    // SAFETY: called before this process allocates any device memory, so no buffer carries
    // cudarc's cross-stream events: every launch, copy and free of this command is queued on
    // the one stream of `gpu` (in order by construction) and every host read of device data
    // synchronizes first. Without the events, launches can be captured into a CUDA graph
    // (waiting on an event recorded outside a capture is invalid inside one).
    unsafe { gpu.context().disable_event_tracking() };
    let info = gpu.info().clone();
    let l2 = match a.l2_bytes {
        Some(b) => b,
        None => gpu
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?
            as u64,
    };
    println!(
        "device {}: {} (sm_{}{}, {} SMs, {:.1} GiB, L2 {:.0} MiB), driver CUDA {}, runtime {}",
        info.ordinal,
        info.name,
        info.cc_major,
        info.cc_minor,
        info.sm_count,
        info.total_mem as f64 / (1u64 << 30) as f64,
        l2 as f64 / (1u64 << 20) as f64,
        info.driver_version,
        info.runtime_version
    );
    let shape = Shape {
        head_dim: a.head_dim,
        elem_bytes: 2,
    };

    // ---- the dense peer, first and alone on the device ----
    let peer = if a.peer == "none" {
        Err("--peer none".to_string())
    } else {
        eprintln!("running the dense peer: {} {}", a.python, a.peer);
        bench_peer::run(&PeerRequest {
            python: &a.python,
            script: &PathBuf::from(&a.peer),
            args: PeerArgs {
                device: a.device,
                decode: &decode,
                prefill: &prefill,
                head_dim: a.head_dim,
                l2_bytes: l2,
                min_launches: a.launches,
                reps: a.reps,
                one_call_iters: a.iters,
                warmup: a.warmup,
            },
        })
    };
    match &peer {
        Ok(r) => println!(
            "peer: torch SDPA, dense contiguous K/V ({}; its d2d copy {:.1} GB/s)",
            r.device.as_deref().unwrap_or("device line missing"),
            r.d2d_gbps.unwrap_or(f64::NAN)
        ),
        Err(why) => println!("peer: not run: {why}"),
    }
    let none = PeerResults::default();
    let pr = peer.as_ref().unwrap_or(&none);

    // ---- device-to-device copy bandwidth (read + write bytes) ----
    let clock = Clock::new(&gpu)?;
    let stream: Arc<CudaStream> = gpu.stream().clone();
    let n = 1usize << 30;
    let src = gpu.alloc_zeros::<u8>(n)?;
    let mut dst = gpu.alloc_zeros::<u8>(n)?;
    stream.memcpy_dtod(&src, &mut dst)?;
    let mut t = Vec::new();
    for _ in 0..a.iters.max(1) {
        t.push(clock.span_ms(|| Ok(stream.memcpy_dtod(&src, &mut dst)?))?);
    }
    let ms = median(&mut t).ok_or("no copy timings")?;
    let d2d = 2.0 * n as f64 / (ms * 1e-3) / 1e9;
    println!("d2d copy: 1 GiB in {ms:.3} ms = {d2d:.1} GB/s (read + write)");
    drop((src, dst));

    let mut bench = Bench::new(
        &gpu,
        shape,
        a.block_size,
        mode,
        l2,
        (0.8 * info.total_mem as f64) as u64,
        (a.launches, a.reps, a.iters, a.warmup),
        !a.no_check,
    )?;
    bench.programmatic = a.programmatic;
    let launch = if a.programmatic {
        ", programmatic launches"
    } else {
        ""
    };
    let mut failed_checks = Vec::new();
    let mut note_check = |what: String, m: &Measured| match &m.check {
        Some(Ok(err)) => println!(
            "{:>15}   (checked against the CPU oracle: max |err| {err:.2e})",
            ""
        ),
        Some(Err(e)) => {
            println!("CHECK FAILED {what}: {e}");
            failed_checks.push(what);
        }
        None => {}
    };

    if !decode.is_empty() {
        println!();
        println!(
            "decode bf16 d{} bs{} mode {mode:?}{launch}; times per call; GB/s of K/V + q + out bytes at the graph time",
            a.head_dim, a.block_size
        );
        println!("{}", decode_header());
        for p in &decode {
            let m = bench.decode(p)?;
            println!(
                "{}",
                decode_row(p, shape, &m.outcome, pr.decode.get(p), d2d)
            );
            note_check(format!("decode {p}"), &m);
        }
    }
    if a.step && !decode.is_empty() {
        println!();
        println!(
            "decode step: reshape_and_cache of each sequence's newest token, then decode (graph us per step)"
        );
        println!(
            "{:>15} | {:>9} {:>9} | {:>13}",
            "heads/BxCTX", "plain", "programm.", "programm./plain"
        );
        for p in &decode {
            let [plain, prog] = bench.decode_step(p)?;
            let us = |o: &Outcome| match o {
                Outcome::Timed(t) => Some(t.graph_us),
                _ => None,
            };
            match (us(&plain), us(&prog)) {
                (Some(a), Some(b)) => {
                    println!(
                        "{:>15} | {a:>9.1} {b:>9.1} | {:>13.3}",
                        p.to_string(),
                        b / a
                    )
                }
                _ => println!("{:>15} | skipped", p.to_string()),
            }
        }
    }
    for &tiling in tilings.iter().filter(|_| !prefill.is_empty()) {
        println!();
        println!(
            "prefill bf16 d{} bs{} tiling {tiling:?}{launch}, one sequence, causal; TFLOP/s of the causal region at the graph time",
            a.head_dim, a.block_size
        );
        println!("{}", prefill_header());
        bench.prefill_tiling = tiling;
        for p in &prefill {
            let m = bench.prefill(p)?;
            println!("{}", prefill_row(p, shape, &m.outcome, pr.prefill.get(p)));
            // (A skipped point may not even make a cache configuration.)
            if tiling == PrefillTiling::Auto && matches!(m.outcome, Outcome::Timed(_)) {
                match bench.prefill_runs(p)? {
                    Some(t) => println!("                  (Auto ran {t:?})"),
                    None => println!("                  (Auto: the f32 kernel)"),
                }
            }
            note_check(format!("prefill {p} {tiling:?}"), &m);
        }
    }
    for n in &pr.notes {
        println!("peer note: {n}");
    }
    drop(bench);

    if !a.no_cache_ops {
        cache_ops(&gpu, &clock, &a, d2d)?;
    }
    if !failed_checks.is_empty() {
        return Err(format!(
            "outputs differ from the CPU oracle: {}",
            failed_checks.join(", ")
        )
        .into());
    }
    Ok(())
}

/// reshape_and_cache, copy_blocks and swap out/in on random data (one call per event pair: each
/// moves far more than L2, so host overhead is small against it).
fn cache_ops(gpu: &Gpu, clock: &Clock<'_>, a: &GpuArgs, d2d: f64) -> Result<(), BoxErr> {
    let time = |f: &mut dyn FnMut() -> Result<(), BoxErr>| -> Result<f64, BoxErr> {
        for _ in 0..a.warmup {
            f()?;
        }
        let mut t = Vec::new();
        for _ in 0..a.iters.max(1) {
            t.push(clock.span_ms(&mut *f)?);
        }
        Ok(median(&mut t).ok_or("no timings")?)
    };
    let gbps = |bytes: f64, ms: f64| bytes / (ms * 1e-3) / 1e9;
    let mut rng = SmallRng::seed_from_u64(2);
    println!();
    let (hkv, d, bs) = (8usize, a.head_dim, a.block_size);
    let tokens = 16384usize;
    let cfg = KvCacheConfig::new(4, hkv, d, bs, tokens.div_ceil(bs) * 2, KvDtype::Bf16)?;
    let mut cache = DeviceKvCache::new(gpu, cfg)?;
    let mut slots: Vec<i64> = (0..(cfg.num_blocks() * bs) as i64).collect();
    slots.shuffle(&mut rng);
    slots.truncate(tokens);
    let dslots = gpu.upload(&slots)?;
    let mut random = |n: usize| -> Vec<bf16> {
        (0..n)
            .map(|_| bf16::from_f32(rng.gen_range(-1.0f32..1.0)))
            .collect()
    };
    let k: CudaSlice<bf16> = gpu.upload(&random(tokens * hkv * d))?;
    let v: CudaSlice<bf16> = gpu.upload(&random(tokens * hkv * d))?;
    let ms = time(&mut || Ok(cache.reshape_and_cache(gpu, 1, &k, &v, &dslots)?))?;
    let bytes = (2 * 2 * tokens * hkv * d * 2) as f64; // K and V, read and write
    let bw = gbps(bytes, ms);
    println!("reshape_and_cache {tokens} tokens x {hkv} kv heads x d{d}: {ms:.4} ms, {bw:.1} GB/s, {:.1}% d2d", 100.0 * bw / d2d);

    let half = cfg.num_blocks() / 2;
    let mut pairs: Vec<(u32, u32)> = (0..half as u32).map(|i| (i, i + half as u32)).collect();
    pairs.shuffle(&mut rng);
    pairs.truncate(1024.min(half));
    let ms = time(&mut || Ok(cache.copy_blocks(gpu, &pairs)?))?;
    let bytes = (2 * pairs.len() * cfg.bytes_per_block()) as f64;
    let bw = gbps(bytes, ms);
    println!(
        "copy_blocks {} pairs x {} KiB: {ms:.4} ms, {bw:.1} GB/s, {:.1}% d2d (pair upload included)",
        pairs.len(),
        cfg.bytes_per_block() / 1024,
        100.0 * bw / d2d
    );

    // ---- swap vs pinned host bandwidth ----
    let stream = gpu.stream().clone();
    let swap_blocks = pairs.len();
    let mut pinned = PinnedSwapSpace::new(gpu, &cfg, swap_blocks)?;
    let bytes = swap_blocks * cfg.bytes_per_block();
    let mut dev_buf = gpu.alloc_zeros::<u8>(bytes)?;
    let mut host_pinned = {
        // SAFETY: the pinned buffer is fully written by the first device-to-host copy below
        // before anything reads it; it is only used as a copy destination and source here.
        unsafe { gpu.context().alloc_pinned::<u8>(bytes) }?
    };
    let ms_pin = time(&mut || Ok(stream.memcpy_dtoh(&dev_buf, &mut host_pinned)?))?;
    let pin_bw = gbps(bytes as f64, ms_pin);
    let ms_pin_in = time(&mut || Ok(stream.memcpy_htod(&host_pinned, &mut dev_buf)?))?;
    let pin_in_bw = gbps(bytes as f64, ms_pin_in);
    // The same copies from and to pageable memory: what a swap space the device refused to pin
    // (`RawBackend::swap_pinned` false) costs.
    let mut host_pageable = vec![0u8; bytes];
    let ms_page = time(&mut || Ok(stream.memcpy_dtoh(&dev_buf, &mut host_pageable)?))?;
    let ms_page_in = time(&mut || Ok(stream.memcpy_htod(&host_pageable, &mut dev_buf)?))?;
    let (page_bw, page_in_bw) = (gbps(bytes as f64, ms_page), gbps(bytes as f64, ms_page_in));
    // Blocks in runs of 4 (scattered runs, as a preempted sequence's blocks are).
    let mapping: Vec<(u32, u32)> = (0..swap_blocks as u32)
        .map(|i| ((i / 4) * 8 + i % 4, i))
        .filter(|&(s, _)| (s as usize) < cfg.num_blocks())
        .collect();
    let ms = time(&mut || Ok(cache.swap_out(gpu, &mut pinned, &mapping)?))?;
    let bw = gbps((mapping.len() * cfg.bytes_per_block()) as f64, ms);
    println!(
        "pinned copy {:.1} MB: d2h {pin_bw:.1} GB/s, h2d {pin_in_bw:.1} GB/s",
        bytes as f64 / 1e6
    );
    println!(
        "pageable copy {:.1} MB: d2h {page_bw:.1} GB/s ({:.1}% of pinned), h2d {page_in_bw:.1} GB/s ({:.1}%)",
        bytes as f64 / 1e6,
        100.0 * page_bw / pin_bw,
        100.0 * page_in_bw / pin_in_bw
    );
    println!(
        "swap_out {} blocks (runs of 4): {ms:.4} ms, {bw:.1} GB/s, {:.1}% of pinned d2h",
        mapping.len(),
        100.0 * bw / pin_bw
    );
    let back: Vec<(u32, u32)> = mapping.iter().map(|&(s, d)| (d, s)).collect();
    let ms = time(&mut || Ok(cache.swap_in(gpu, &mut pinned, &back)?))?;
    let bw = gbps((back.len() * cfg.bytes_per_block()) as f64, ms);
    println!(
        "swap_in {} blocks (runs of 4): {ms:.4} ms, {bw:.1} GB/s, {:.1}% of pinned h2d",
        back.len(),
        100.0 * bw / pin_in_bw
    );
    Ok(())
}
