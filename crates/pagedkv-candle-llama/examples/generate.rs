//! Greedy generation from a llama GGUF file on pagedkv's engine (CPU with f32 KV, or candle's
//! CUDA device with `--cuda`), printing tokens/s.
//!
//! ```sh
//! # a tiny random llama written by pagedkv's GGUF writer (1.1 MB)
//! cargo run --release -p pagedkv-candle-llama --example generate -- --write-tiny /tmp/tiny.gguf
//! # 8 sequences at once, 64 tokens each
//! cargo run --release -p pagedkv-candle-llama --example generate -- /tmp/tiny.gguf --seqs 8 --max-new 64
//! # on a GPU (feature candle-cuda; nvcc to build): candle's CUDA device, pagedkv's CUDA kernels
//! # on candle's stream, KV in bf16
//! cargo run --release -p pagedkv-candle-llama --features candle-cuda --example generate -- \
//!     /tmp/tiny.gguf --seqs 32 --cuda --kv bf16
//! ```
//!
//! Prompts are token ids (`--prompt 1,450,4996`): the example has no tokenizer. When the file
//! carries `tokenizer.ggml.tokens`, generated ids are also printed as the vocabulary's pieces.

use clap::Parser;
use pagedkv::gguf::{Gguf, GgufBytes};
use pagedkv::sched::{PreemptionMode, Priority, SeqRequest, StopRules};
use pagedkv_candle_llama::fixture::TinyLlama;
use pagedkv_candle_llama::{build_engine, generate, EngineSetup, MatMulMode, PagedLlama};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(
    about = "Greedy generation from a llama GGUF on pagedkv's engine (CPU, or CUDA with --cuda)"
)]
struct Args {
    /// The GGUF file to run.
    path: Option<PathBuf>,
    /// Write a tiny random llama (mixed Q4_K/Q8_0/Q4_0/F16/F32 tensors, heads of 64) to this
    /// path and exit.
    #[arg(long)]
    write_tiny: Option<PathBuf>,
    /// Prompt token ids, comma-separated (default: the file's BOS id, or 1).
    #[arg(long, value_delimiter = ',')]
    prompt: Vec<u32>,
    /// Tokens to generate per sequence (at least 1).
    #[arg(long, default_value_t = 32)]
    max_new: u32,
    /// Sequences run together, at least 1 (each prompt is the given one with its last token
    /// shifted by the sequence's index, so they differ).
    #[arg(long, default_value_t = 1)]
    seqs: u32,
    /// Multiply quantized tensors dequantized in f32 instead of with candle's quantized matmul.
    #[arg(long)]
    dequantized: bool,
    /// KV pages of 16 tokens (0: just enough for every sequence's whole context at once; f32
    /// KV is 8 bytes per layer, KV head and head element per token).
    #[arg(long, default_value_t = 0)]
    pages: u32,
    /// Run on CUDA device 0 (feature `candle-cuda`).
    #[arg(long)]
    cuda: bool,
    /// KV cache element type on CUDA: f32, f16 or bf16 (the CPU engine keeps f32).
    #[arg(long, default_value = "f32")]
    kv: String,
    /// On CUDA, make the attention launches programmatic dependent launches (each layer's
    /// attention launch overlaps its cache write; compute capability 9.0 and later).
    #[arg(long)]
    programmatic: bool,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if let Some(out) = &args.write_tiny {
        let bytes = TinyLlama::mixed().with_head_dim(64).write(0x5eed)?;
        std::fs::write(out, &bytes)?;
        println!("wrote {} ({} bytes)", out.display(), bytes.len());
        return Ok(());
    }
    let Some(path) = &args.path else {
        return Err("give a GGUF path (or --write-tiny PATH)".into());
    };
    check_counts(args.seqs, args.max_new)?;
    let load = Instant::now();
    let file = GgufBytes::read(path)?;
    let g = Gguf::parse(file.bytes())?;
    let mode = if args.dequantized {
        MatMulMode::Dequantized
    } else {
        MatMulMode::Quantized
    };
    let device = if args.cuda {
        cuda_device()?
    } else {
        candle_core::Device::Cpu
    };
    let mut model = PagedLlama::from_gguf_on(&g, mode, &device)?;
    let cfg = model.config().clone();
    let p = &cfg.params;
    println!(
        "{}: {} layers, width {}, {} heads ({} KV) of {}, vocab {}, loaded in {:.2?}",
        path.display(),
        p.n_layers,
        p.embedding_length,
        p.n_heads,
        p.n_kv_heads,
        p.head_dim,
        cfg.vocab_size,
        load.elapsed()
    );
    let vocab = cfg.vocab_size as u32;
    let bos = g.get_u32("tokenizer.ggml.bos_token_id").unwrap_or(1) % vocab;
    let eos: Vec<u32> = g
        .get_u32("tokenizer.ggml.eos_token_id")
        .into_iter()
        .collect();
    let prompt = if args.prompt.is_empty() {
        vec![bos]
    } else {
        args.prompt.clone()
    };
    if let Some(&t) = prompt.iter().find(|&&t| t >= vocab) {
        return Err(format!("prompt token {t} is outside the vocabulary of {vocab}").into());
    }
    let (seqs, max_new) = (args.seqs, args.max_new);
    let (max_context, pages) = plan(prompt.len(), max_new, seqs, args.pages)?;
    if max_context > p.context_length {
        return Err(format!(
            "a prompt of {} tokens and --max-new {max_new} need {max_context} positions, more \
             than the model's context_length {}",
            prompt.len(),
            p.context_length
        )
        .into());
    }
    let setup = EngineSetup {
        tokens_per_page: TOKENS_PER_PAGE,
        pages,
        max_running: seqs,
        max_context,
        preemption: PreemptionMode::Recompute,
        ..EngineSetup::default()
    };
    let mut requests: Vec<SeqRequest> = Vec::new();
    requests
        .try_reserve_exact(seqs as usize)
        .map_err(|e| format!("--seqs {seqs}: {e}"))?;
    requests.extend((0..seqs).map(|i| {
        let mut prompt = prompt.clone();
        if let Some(last) = prompt.last_mut() {
            *last = shifted(*last, i, vocab);
        }
        SeqRequest {
            id: u64::from(i),
            prompt,
            stop: StopRules {
                max_new_tokens: max_new,
                eos: eos.clone(),
                stop_sequences: Vec::new(),
            },
            priority: Priority::Throughput,
        }
    }));
    let gen = if args.cuda {
        run_cuda(
            &cfg,
            &setup,
            &device,
            (&args.kv, args.programmatic),
            &mut model,
            requests,
        )?
    } else {
        let mut engine = build_engine(&cfg, &setup)?;
        generate(&mut engine, &mut model, requests, u64::MAX)?
    };
    let pieces = g.get_array("tokenizer.ggml.tokens").ok();
    for (id, out) in &gen.outputs {
        print!("seq {id}: {out:?}");
        if let Some(pieces) = &pieces {
            let text: String = out
                .iter()
                .filter_map(|&t| pieces.get(u64::from(t)).and_then(|v| v.as_str()))
                .collect::<String>()
                .replace('\u{2581}', " ");
            print!(" {text:?}");
        }
        println!();
    }
    println!(
        "{} sequences, {} tokens generated ({} scheduled) in {} steps, {:.2?}: {:.1} tokens/s, \
         {:.2?} per step on {}",
        gen.outputs.len(),
        gen.generated,
        gen.scheduled,
        gen.steps,
        gen.elapsed,
        gen.tokens_per_second(),
        gen.elapsed / u32::try_from(gen.steps.max(1)).unwrap_or(u32::MAX),
        if args.cuda { "CUDA" } else { "the CPU" }
    );
    Ok(())
}

/// Tokens per KV page.
const TOKENS_PER_PAGE: usize = 16;

/// Refuses `--seqs 0` and `--max-new 0` (they were silently run as 1).
fn check_counts(seqs: u32, max_new: u32) -> Result<(), String> {
    if seqs == 0 {
        return Err("--seqs 0: run at least 1 sequence".into());
    }
    if max_new == 0 {
        return Err("--max-new 0: generate at least 1 token".into());
    }
    Ok(())
}

/// The engine's `max_context` and arena pages for `seqs` sequences of a `prompt_len`-token
/// prompt and `max_new` new tokens each, where `pages` pages were asked for (0: enough for
/// every sequence's whole context at once). The context is the positions the model runs: the
/// prompt and every output token but the last, which is sampled and never fed back (the
/// engine's own measure, `SeqRequest::max_cached_tokens`). An error names the flags whose
/// values do not fit in 32 bits (the sums wrapped, or panicked in a debug build).
fn plan(prompt_len: usize, max_new: u32, seqs: u32, pages: u32) -> Result<(u32, u32), String> {
    let max_context = u64::try_from(prompt_len)
        .ok()
        .and_then(|p| p.checked_add(u64::from(max_new)))
        .and_then(|n| u32::try_from(n.saturating_sub(1)).ok())
        .ok_or_else(|| {
            format!(
                "a prompt of {prompt_len} tokens and --max-new {max_new} need more than {} \
                 positions",
                u32::MAX
            )
        })?;
    let pages = match pages {
        0 => max_context
            .div_ceil(TOKENS_PER_PAGE as u32)
            .checked_mul(seqs)
            .ok_or_else(|| {
                format!(
                    "--seqs {seqs} of {max_context} tokens need more than {} pages of \
                     {TOKENS_PER_PAGE} tokens: give --pages",
                    u32::MAX
                )
            })?,
        n => n,
    };
    Ok((max_context, pages))
}

/// Sequence `i`'s last prompt token: `last` shifted by `i` within the vocabulary (in 64 bits:
/// the 32-bit sum wrapped for large `--seqs`).
fn shifted(last: u32, i: u32, vocab: u32) -> u32 {
    ((u64::from(last) + u64::from(i)) % u64::from(vocab)) as u32
}

#[cfg(feature = "candle-cuda")]
fn cuda_device() -> Result<candle_core::Device, Box<dyn std::error::Error>> {
    Ok(candle_core::Device::new_cuda(0)?)
}

#[cfg(not(feature = "candle-cuda"))]
fn cuda_device() -> Result<candle_core::Device, Box<dyn std::error::Error>> {
    Err("--cuda needs the example built with --features candle-cuda".into())
}

#[cfg(feature = "candle-cuda")]
fn run_cuda(
    cfg: &pagedkv_candle_llama::LlamaConfig,
    setup: &EngineSetup,
    device: &candle_core::Device,
    (kv, programmatic): (&str, bool),
    model: &mut PagedLlama,
    requests: Vec<SeqRequest>,
) -> Result<pagedkv_candle_llama::Generation, Box<dyn std::error::Error>> {
    use pagedkv::kv::KvDtype;
    let kv = match kv {
        "f32" => KvDtype::F32,
        "f16" => KvDtype::F16,
        "bf16" => KvDtype::Bf16,
        other => return Err(format!("--kv {other}: f32, f16 or bf16").into()),
    };
    let mut engine = pagedkv_candle_llama::build_cuda_engine(cfg, setup, device, kv)?;
    engine.set_programmatic_launch(programmatic);
    Ok(generate(&mut engine, model, requests, u64::MAX)?)
}

#[cfg(not(feature = "candle-cuda"))]
fn run_cuda(
    _cfg: &pagedkv_candle_llama::LlamaConfig,
    _setup: &EngineSetup,
    _device: &candle_core::Device,
    _kv: (&str, bool),
    _model: &mut PagedLlama,
    _requests: Vec<SeqRequest>,
) -> Result<pagedkv_candle_llama::Generation, Box<dyn std::error::Error>> {
    Err("--cuda needs the example built with --features candle-cuda".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The positions a generation runs are the prompt's and every output token's but the last
    /// (it is sampled, never fed back): a prompt of 1 token and --max-new 2048 fit a
    /// context_length of 2048 (the engine takes them), where the plan asked for 2049 and the
    /// example refused them.
    #[test]
    fn plan_counts_the_positions_the_engine_runs() {
        assert_eq!(plan(1, 2048, 1, 0), Ok((2048, 128)));
        assert_eq!(plan(16, 17, 2, 0), Ok((32, 4)));
    }

    #[test]
    fn plan_refuses_sizes_past_32_bits() {
        assert_eq!(plan(3, 29, 2, 0), Ok((31, 4)));
        assert_eq!(plan(3, 29, 2, 7), Ok((31, 7)));
        // --max-new u32::MAX after 2 prompt tokens: the context wrapped to prompt_len - 2.
        assert_eq!(plan(1, u32::MAX, 1, 64), Ok((u32::MAX, 64)));
        let e = plan(2, u32::MAX, 1, 0).unwrap_err();
        assert!(e.contains("--max-new"), "{e}");
        assert!(plan(usize::MAX, 1, 1, 0).is_err());
        // --seqs past 2^28 of 256 tokens: the page count wrapped to 16.
        let e = plan(1, 256, (1 << 28) + 1, 0).unwrap_err();
        assert!(e.contains("--pages"), "{e}");
        // An explicit page count needs no product.
        assert_eq!(plan(1, 256, u32::MAX, 64), Ok((256, 64)));
    }

    #[test]
    fn zero_counts_are_refused() {
        assert_eq!(check_counts(1, 1), Ok(()));
        assert!(check_counts(0, 32).unwrap_err().contains("--seqs"));
        assert!(check_counts(8, 0).unwrap_err().contains("--max-new"));
    }

    #[test]
    fn shifted_prompts_stay_in_the_vocabulary() {
        assert_eq!(shifted(5, 3, 384), 8);
        assert_eq!(
            shifted(383, u32::MAX, 384),
            ((383 + u64::from(u32::MAX)) % 384) as u32
        );
        assert!(shifted(u32::MAX, u32::MAX, 384) < 384);
    }
}
