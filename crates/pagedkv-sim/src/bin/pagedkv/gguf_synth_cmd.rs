//! `pagedkv gguf synth OUT.gguf --layers N`: writes a llama-shaped GGUF file of random tensors
//! with pagedkv's writer, so that the upload bench (and anything else that wants a realistic
//! file) runs anywhere, from nothing but a seed.
//!
//! The default shape is llama-2-7B's (width 4096, MLP 11008, 32 heads, vocabulary 32000) and the
//! default types mix F16, Q8_0, Q6_K and Q4_K the way the file of the first GPU run did
//! (token embedding F16, output Q6_K, per layer: attn_q F16, attn_k Q8_0, attn_v Q6_K,
//! attn_output Q4_K, ffn_gate and ffn_up Q8_0, ffn_down F16, norms F32): 8 layers make 75
//! tensors and about 2.45 GB. `--weights TYPE` puts every 2-D weight in one type instead.
//!
//! Values: F32 norms near 1; F16 / BF16 weights uniform in +-1/sqrt(fan-in); quantized blocks
//! random bytes with their f16 scale fields set to small finite positive values (so every
//! dequantized value is finite). Everything comes from a SplitMix64 stream per 1 MiB chunk,
//! seeded from `--seed`, the tensor and the chunk: the same arguments give the same bytes on
//! any machine, and chunks are generated in parallel. Tensors are produced one at a time while
//! the file is written (`GgufWriter::write_streaming`), so memory stays at one tensor (at most
//! 16 GiB: larger ones are refused, as are more than 4096 layers).

use half::{bf16, f16};
use pagedkv::gguf::{GgmlType, GgufWriter, MetaValue};
use rayon::prelude::*;
use std::io::BufWriter;
use std::path::PathBuf;

/// Arguments of `pagedkv gguf synth`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The file to write (replaced if it exists).
    out: PathBuf,
    /// Transformer layers, 1 to 4096 (8 gives the 2.45 GB file of the upload bench).
    #[arg(long)]
    layers: u32,
    /// Model width (a multiple of 256, for the K-quant blocks).
    #[arg(long, default_value_t = 4096)]
    dim: u64,
    /// MLP width (a multiple of 256).
    #[arg(long, default_value_t = 11008)]
    ffn: u64,
    /// Vocabulary size.
    #[arg(long, default_value_t = 32000)]
    vocab: u64,
    /// Attention heads (divides --dim).
    #[arg(long, default_value_t = 32)]
    heads: u64,
    /// Key/value heads (divides --heads).
    #[arg(long, default_value_t = 32)]
    kv_heads: u64,
    /// `llama.context_length`.
    #[arg(long, default_value_t = 4096)]
    context: u32,
    /// Put every 2-D weight in this type (F32, F16, BF16, Q4_0, Q8_0, Q4_K, Q6_K) instead of
    /// the default mix.
    #[arg(long)]
    weights: Option<String>,
    /// Seed of the values.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

type BoxErr = Box<dyn std::error::Error>;

/// Most layers: the file's tensor list (9 tensors a layer) is built in memory before anything
/// is written, so an absurd count ran out of memory instead of being refused. Far above any
/// real model's.
const MAX_LAYERS: u32 = 4096;
/// Largest tensor, bytes: each tensor is generated whole in memory while it is written.
const MAX_TENSOR_BYTES: u64 = 16 << 30;

/// The types synth can generate blocks of.
const TYPES: [GgmlType; 7] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
];

/// One tensor of the file: name, type, shape (innermost first), fan-in for the value scale.
struct Spec {
    name: String,
    ty: GgmlType,
    shape: Vec<u64>,
    fan_in: u64,
}

/// Runs `pagedkv gguf synth`.
pub fn run(a: Args) -> Result<(), BoxErr> {
    let weights = match &a.weights {
        None => None,
        Some(name) => {
            let ty = GgmlType::from_name(&name.to_ascii_uppercase())
                .filter(|t| TYPES.contains(t))
                .ok_or_else(|| {
                    format!(
                        "--weights {name}: synth writes F32, F16, BF16, Q4_0, Q8_0, Q4_K or Q6_K"
                    )
                })?;
            Some(ty)
        }
    };
    if a.layers == 0 || a.layers > MAX_LAYERS {
        return Err(format!(
            "--layers {}: must be 1 to {MAX_LAYERS} (the tensor list is built in memory)",
            a.layers
        )
        .into());
    }
    for (what, v) in [("--dim", a.dim), ("--ffn", a.ffn)] {
        if v == 0 || v % 256 != 0 {
            return Err(
                format!("{what} {v}: must be a positive multiple of 256 (K-quant blocks)").into(),
            );
        }
    }
    if a.vocab == 0 || a.heads == 0 || a.kv_heads == 0 || a.context == 0 {
        return Err("--vocab, --heads, --kv-heads and --context must be positive".into());
    }
    if a.dim % a.heads != 0 || a.heads % a.kv_heads != 0 {
        return Err(format!(
            "--heads {} must divide --dim {} and --kv-heads {} must divide --heads",
            a.heads, a.dim, a.kv_heads
        )
        .into());
    }
    let head_dim = a.dim / a.heads;
    let kv_dim = a.kv_heads * head_dim;
    let u32_of = |what: &str, v: u64| {
        u32::try_from(v).map_err(|_| format!("{what} {v} does not fit the file's u32 field"))
    };

    let specs = specs(&a, weights, kv_dim);
    for s in &specs {
        let bytes = s
            .shape
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .and_then(|n| s.ty.bytes_for(n))
            .filter(|&b| b <= MAX_TENSOR_BYTES);
        if bytes.is_none() {
            return Err(format!(
                "{} ({} of {:?}) is over {} GiB, the most synth generates in memory at once: \
                 lower --dim, --ffn or --vocab",
                s.name,
                s.ty,
                s.shape,
                MAX_TENSOR_BYTES >> 30
            )
            .into());
        }
    }
    let mut w = GgufWriter::new();
    let meta = [
        ("general.architecture", MetaValue::String("llama".into())),
        (
            "general.name",
            MetaValue::String(format!("pagedkv synth seed {}", a.seed)),
        ),
        ("llama.block_count", MetaValue::U32(a.layers)),
        ("llama.context_length", MetaValue::U32(a.context)),
        (
            "llama.embedding_length",
            MetaValue::U32(u32_of("--dim", a.dim)?),
        ),
        (
            "llama.feed_forward_length",
            MetaValue::U32(u32_of("--ffn", a.ffn)?),
        ),
        (
            "llama.attention.head_count",
            MetaValue::U32(u32_of("--heads", a.heads)?),
        ),
        (
            "llama.attention.head_count_kv",
            MetaValue::U32(u32_of("--kv-heads", a.kv_heads)?),
        ),
        (
            "llama.rope.dimension_count",
            MetaValue::U32(u32_of("head dim", head_dim)?),
        ),
        ("llama.rope.freq_base", MetaValue::F32(10_000.0)),
        (
            "llama.attention.layer_norm_rms_epsilon",
            MetaValue::F32(1e-5),
        ),
        (
            "llama.vocab_size",
            MetaValue::U32(u32_of("--vocab", a.vocab)?),
        ),
    ];
    for (k, v) in meta {
        w.add(k, v)?;
    }
    for s in &specs {
        w.add_tensor_deferred(&s.name, s.ty, &s.shape)?;
    }
    let file = std::fs::File::create(&a.out)
        .map_err(|e| format!("cannot create {}: {e}", a.out.display()))?;
    let t0 = std::time::Instant::now();
    let written = w.write_streaming(BufWriter::with_capacity(8 << 20, file), |i, _, buf| {
        let s = &specs[i];
        generate(buf, s, s.shape.iter().product(), a.seed, i as u64);
        Ok(())
    })?;
    let mut by_type: Vec<(GgmlType, u64)> = Vec::new();
    for s in &specs {
        let b = s.ty.bytes_for(s.shape.iter().product()).unwrap_or(0);
        match by_type.iter_mut().find(|(t, _)| *t == s.ty) {
            Some((_, total)) => *total += b,
            None => by_type.push((s.ty, b)),
        }
    }
    let mix: Vec<String> = by_type
        .iter()
        .map(|(t, b)| format!("{t} {:.1} MB", *b as f64 / 1e6))
        .collect();
    println!(
        "wrote {}: {} layers, {} tensors, {written} bytes ({:.2} GB) in {:.1} s; {}",
        a.out.display(),
        a.layers,
        specs.len(),
        written as f64 / 1e9,
        t0.elapsed().as_secs_f64(),
        mix.join(", ")
    );
    Ok(())
}

/// The tensors, in llama.cpp's order and names.
fn specs(a: &Args, weights: Option<GgmlType>, kv_dim: u64) -> Vec<Spec> {
    let mut v = Vec::new();
    let mut t = |name: String, default: GgmlType, n_in: u64, n_out: Option<u64>| {
        let (ty, shape) = match n_out {
            None => (GgmlType::F32, vec![n_in]),
            Some(o) => (weights.unwrap_or(default), vec![n_in, o]),
        };
        v.push(Spec {
            name,
            ty,
            shape,
            fan_in: n_in,
        });
    };
    t(
        "token_embd.weight".into(),
        GgmlType::F16,
        a.dim,
        Some(a.vocab),
    );
    for l in 0..a.layers {
        let b = format!("blk.{l}");
        t(format!("{b}.attn_norm.weight"), GgmlType::F32, a.dim, None);
        t(
            format!("{b}.attn_q.weight"),
            GgmlType::F16,
            a.dim,
            Some(a.dim),
        );
        t(
            format!("{b}.attn_k.weight"),
            GgmlType::Q8_0,
            a.dim,
            Some(kv_dim),
        );
        t(
            format!("{b}.attn_v.weight"),
            GgmlType::Q6_K,
            a.dim,
            Some(kv_dim),
        );
        t(
            format!("{b}.attn_output.weight"),
            GgmlType::Q4_K,
            a.dim,
            Some(a.dim),
        );
        t(format!("{b}.ffn_norm.weight"), GgmlType::F32, a.dim, None);
        t(
            format!("{b}.ffn_gate.weight"),
            GgmlType::Q8_0,
            a.dim,
            Some(a.ffn),
        );
        t(
            format!("{b}.ffn_up.weight"),
            GgmlType::Q8_0,
            a.dim,
            Some(a.ffn),
        );
        t(
            format!("{b}.ffn_down.weight"),
            GgmlType::F16,
            a.ffn,
            Some(a.dim),
        );
    }
    t("output_norm.weight".into(), GgmlType::F32, a.dim, None);
    t("output.weight".into(), GgmlType::Q6_K, a.dim, Some(a.vocab));
    v
}

/// SplitMix64: a tiny, well-mixed, seedable stream (Steele, Lea, Flood 2014).
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn signed_unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// About this many bytes per generated chunk (a whole number of blocks).
const CHUNK_BYTES: usize = 1 << 20;

/// Fills `buf` with the `n` elements of tensor `tensor` (of type `ty`; a norm if `norm`).
fn generate(buf: &mut Vec<u8>, s: &Spec, n: u64, seed: u64, tensor: u64) {
    let ty = s.ty;
    let norm = s.shape.len() == 1;
    let ts = ty.type_size() as usize;
    let blocks = (n / u64::from(ty.block_size())) as usize;
    buf.resize(blocks * ts, 0);
    let scale = 1.0 / (s.fan_in.max(1) as f32).sqrt();
    let per_chunk = (CHUNK_BYTES / ts).max(1);
    buf.par_chunks_mut(per_chunk * ts)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut rng =
                SplitMix64(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ (tensor << 40) ^ c as u64);
            for blk in chunk.chunks_exact_mut(ts) {
                fill_block(blk, ty, scale, norm, &mut rng);
            }
        });
}

/// One block of `ty` with random contents and finite, small scales (a norm's F32 values near
/// 1, a weight's uniform in +-scale).
fn fill_block(b: &mut [u8], ty: GgmlType, scale: f32, norm: bool, rng: &mut SplitMix64) {
    let f16_bytes = |x: f32| f16::from_f32(x).to_le_bytes();
    // A quantized block's scale: the weight scale over the quant range, within +-50%.
    let d = |rng: &mut SplitMix64, range: f32| {
        f16_bytes(scale / range * (1.0 + 0.5 * rng.signed_unit()))
    };
    match ty {
        GgmlType::F32 => {
            let x = if norm {
                1.0 + 0.05 * rng.signed_unit()
            } else {
                scale * rng.signed_unit()
            };
            b.copy_from_slice(&x.to_le_bytes());
        }
        GgmlType::F16 => b.copy_from_slice(&f16_bytes(scale * rng.signed_unit())),
        GgmlType::BF16 => {
            b.copy_from_slice(&bf16::from_f32(scale * rng.signed_unit()).to_le_bytes())
        }
        _ => {
            for c in b.chunks_mut(8) {
                let r = rng.next().to_le_bytes();
                c.copy_from_slice(&r[..c.len()]);
            }
            match ty {
                GgmlType::Q8_0 => b[0..2].copy_from_slice(&d(rng, 127.0)),
                GgmlType::Q4_0 => b[0..2].copy_from_slice(&d(rng, 8.0)),
                GgmlType::Q4_K => {
                    // d scales 6-bit sub-scales (up to 63) times 4-bit quants.
                    b[0..2].copy_from_slice(&d(rng, 63.0 * 15.0));
                    b[2..4].copy_from_slice(&d(rng, 63.0 * 15.0));
                }
                GgmlType::Q6_K => b[208..210].copy_from_slice(&d(rng, 127.0 * 32.0)),
                _ => {}
            }
        }
    }
}
