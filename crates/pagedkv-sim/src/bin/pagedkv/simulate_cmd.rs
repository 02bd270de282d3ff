//! `pagedkv simulate`: the main job. Several models serve a seeded workload on one shared KV
//! pool; prints a report, optionally as JSON and as an SVG chart.

use indicatif::{ProgressBar, ProgressStyle};
use pagedkv::kv::KvDtype;
use pagedkv::sched::admission::OverflowPolicy;
use pagedkv::sched::PreemptionMode;
use pagedkv_sim::{self as sim, SimConfig};
use std::path::PathBuf;

/// Arguments of `pagedkv simulate`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Seed of the workload, projections and sampling.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Simulated seconds of arrivals (the run then drains).
    #[arg(long, default_value_t = 20.0)]
    duration: f64,
    /// Simulated milliseconds per engine step.
    #[arg(long, default_value_t = 25.0)]
    step_ms: f64,
    /// KV blocks in the shared device pool.
    #[arg(long, default_value_t = 1536)]
    pool_blocks: u32,
    /// Tokens per KV block of the largest model: a power of two from 8 to 256.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// Global tokens per step, split across engines by weight.
    #[arg(long, default_value_t = 256)]
    tokens_per_step: u32,
    /// Most of the global budget one engine may take, per mille.
    #[arg(long, default_value_t = 800)]
    cap_permille: u16,
    /// KV dtype: f32, f16 or bf16.
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    dtype: KvDtype,
    /// Preemption: swap or recompute.
    #[arg(long, default_value = "swap", value_parser = parse_preemption)]
    preemption: PreemptionMode,
    /// Prefix cache shared by the engines on the arena: on or off.
    #[arg(long, default_value = "on", value_parser = parse_on_off, action = clap::ArgAction::Set)]
    prefix_cache: bool,
    /// Full admission queue: drop-newest, drop-oldest.
    #[arg(long, default_value = "drop-newest", value_parser = parse_overflow)]
    overflow: OverflowPolicy,
    /// Capacity of each engine's admission queue per class (any capacity above the requests
    /// an engine gets in a class runs as an unbounded queue and costs no memory beyond them).
    #[arg(long, default_value_t = 64)]
    queue_capacity: usize,
    /// Client threads submitting requests.
    #[arg(long, default_value_t = 2)]
    clients: usize,
    /// Multiply every engine's arrival rate.
    #[arg(long, default_value_t = 1.0)]
    load: f64,
    /// Size an engine from a GGUF model file's hyperparameters (repeat for several models;
    /// replaces the three built-in engines). The n-th model takes the traffic of built-in
    /// engine n modulo 3 (rate, lengths, system prompt, burst): the second one's rate is
    /// 5x from 6 to 10 s, the third one is silent for the first 8 s.
    #[arg(long = "model", value_name = "FILE.gguf")]
    models: Vec<PathBuf>,
    /// Share weights of the `--model` engines, comma-separated (default: 1 each).
    #[arg(long, value_delimiter = ',')]
    weights: Vec<u32>,
    /// Most layers simulated per `--model` engine (every simulated layer's KV is real).
    #[arg(long, default_value_t = 4)]
    max_layers: usize,
    /// Device for the kernels: cpu, cuda or cuda:N (needs the `cuda` feature and a GPU).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw KV blocks per engine and token budgets over time as SVG to this file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

fn parse_dtype(s: &str) -> Result<KvDtype, String> {
    match s {
        "f32" => Ok(KvDtype::F32),
        "f16" => Ok(KvDtype::F16),
        "bf16" => Ok(KvDtype::Bf16),
        _ => Err(format!("unknown dtype {s:?}: expected f32, f16 or bf16")),
    }
}

fn parse_preemption(s: &str) -> Result<PreemptionMode, String> {
    match s {
        "swap" => Ok(PreemptionMode::Swap),
        "recompute" => Ok(PreemptionMode::Recompute),
        _ => Err(format!(
            "unknown preemption {s:?}: expected swap or recompute"
        )),
    }
}

fn parse_overflow(s: &str) -> Result<OverflowPolicy, String> {
    match s {
        "drop-newest" => Ok(OverflowPolicy::DropNewest),
        "drop-oldest" => Ok(OverflowPolicy::DropOldest),
        _ => Err(format!(
            "unknown overflow policy {s:?}: expected drop-newest or drop-oldest (a simulation cannot block its clients)"
        )),
    }
}

/// Builds the configuration from the arguments.
fn config(args: &Args) -> Result<SimConfig, Box<dyn std::error::Error>> {
    let mut cfg = SimConfig {
        seed: args.seed,
        duration_s: args.duration,
        step_ms: args.step_ms,
        pool_blocks: args.pool_blocks,
        block_size: args.block_size,
        dtype: args.dtype,
        tokens_per_step: args.tokens_per_step,
        cap_permille: args.cap_permille,
        clients: args.clients,
        queue_capacity: args.queue_capacity,
        overflow: args.overflow,
        preemption: args.preemption,
        prefix_cache: args.prefix_cache,
        ..SimConfig::default()
    };
    if !args.models.is_empty() {
        if !args.weights.is_empty() && args.weights.len() != args.models.len() {
            return Err(format!(
                "--weights has {} values for {} --model files",
                args.weights.len(),
                args.models.len()
            )
            .into());
        }
        let traffic = cfg.engines.clone();
        let mut engines = Vec::new();
        for (i, path) in args.models.iter().enumerate() {
            let bytes = map(path)?;
            let gguf = pagedkv::gguf::Gguf::parse(bytes.bytes())
                .map_err(|e| format!("{}: {e}", path.display()))?;
            let params = gguf
                .llama_params()
                .map_err(|e| format!("{}: {e}", path.display()))?;
            let name = path
                .file_stem()
                .map_or_else(|| format!("model{i}"), |s| s.to_string_lossy().into_owned());
            engines.push(sim::EngineSpec::from_llama(
                &name,
                &params,
                args.weights.get(i).copied().unwrap_or(1),
                args.max_layers,
                &traffic[i % traffic.len()],
            )?);
        }
        cfg.engines = engines;
    } else if !args.weights.is_empty() {
        return Err("--weights applies to --model engines".into());
    }
    if !(args.load > 0.0 && args.load.is_finite()) {
        return Err("--load must be a positive number".into());
    }
    for e in &mut cfg.engines {
        e.rate *= args.load;
    }
    Ok(cfg)
}

/// Maps a model file read-only.
fn map(path: &std::path::Path) -> Result<pagedkv::gguf::GgufBytes, Box<dyn std::error::Error>> {
    // SAFETY: `map` requires that nobody truncates or writes the file while the map lives; the
    // map lives only while the header is parsed here, and a model file being rewritten during
    // that instant is outside what this command supports (as for any reader of model files).
    Ok(unsafe { pagedkv::gguf::GgufBytes::map(path) }
        .map_err(|e| format!("{}: {e}", path.display()))?)
}

/// Runs the simulation and prints its report.
pub fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let cfg = config(&args)?;
    sim::validate(&cfg)?;
    let bar = if args.quiet {
        ProgressBar::hidden()
    } else {
        let total = sim::generate(&cfg).len() as u64;
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests resolved {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar
    };
    let device = sim::Device::open(&args.device)?;
    let report = sim::run_on(&cfg, &device, &|p| {
        bar.set_position(p.resolved);
        if p.step % 8 == 0 {
            bar.set_message(format!(
                "step {} | {} KV blocks in use",
                p.step, p.used_blocks
            ));
        }
    })?;
    bar.finish_and_clear();
    print!("{}", report.to_text());
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json).map_err(|e| format!("writing {}: {e}", path.display()))?;
        println!("report written to {}", path.display());
    }
    if let Some(path) = &args.plot {
        sim::write_svg(&report, path)?;
        println!("chart written to {}", path.display());
    }
    if report.leaked_blocks != 0 {
        return Err(format!("{} KV blocks leaked", report.leaked_blocks).into());
    }
    Ok(())
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{s:?}: expected on or off")),
    }
}
