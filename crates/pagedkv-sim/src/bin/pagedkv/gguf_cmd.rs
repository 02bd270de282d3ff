//! `pagedkv gguf`: inspect a GGUF file, dequantize one of its tensors to raw f32, write a
//! synthetic one (gguf_synth_cmd.rs), or bench the device upload (gguf_upload_cmd.rs).

use std::borrow::Cow;
use std::fmt::Write as _;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use pagedkv::gguf::{Gguf, GgufBytes, Value};
use serde_json::Value as Json;

/// Arguments of `pagedkv gguf`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: GgufCommand,
}

#[derive(Debug, clap::Subcommand)]
enum GgufCommand {
    /// Print a GGUF file's header: version, metadata and tensor table.
    ///
    /// The file is memory-mapped; it must not be rewritten while the command runs.
    Inspect {
        /// Print JSON: {"version", "alignment", "data_offset", "metadata": {key: value},
        /// "tensors": [{"name", "type", "shape", "offset", "n_bytes"}]}, shapes innermost
        /// dimension first, offsets relative to the data section.
        #[arg(long)]
        json: bool,
        /// The GGUF file.
        file: PathBuf,
    },
    /// Write one tensor, dequantized, as little-endian f32 (innermost dimension fastest).
    Dequant {
        /// The GGUF file.
        file: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The output file ("-" for standard output).
        #[arg(short, long)]
        output: PathBuf,
    },
    /// Write a llama-shaped file of random tensors (F16 / Q8_0 / Q6_K / Q4_K mix; 8 layers of
    /// the default shape make 75 tensors, about 2.45 GB), deterministic from --seed.
    Synth(crate::gguf_synth_cmd::Args),
    /// Upload every tensor to the GPU each way (staged with fill threads, registered file
    /// pages, dequantized on the device); report GB/s beside a pinned-buffer memcpy of the same
    /// byte count and the device dequantizer beside a device-to-device copy, and check every
    /// byte (feature `cuda`).
    #[cfg(feature = "cuda")]
    UploadBench(crate::gguf_upload_cmd::Args),
}

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Runs `pagedkv gguf`.
pub fn run(args: Args) -> Result<()> {
    match args.command {
        GgufCommand::Inspect { json, file } => {
            let bytes = map(&file)?;
            let g = Gguf::parse(bytes.bytes()).map_err(|e| named(&file, e))?;
            let text = if json { to_json(&g) } else { to_table(&g) };
            let mut out = std::io::stdout().lock();
            out.write_all(text.as_bytes())?;
            out.flush()?;
            Ok(())
        }
        GgufCommand::Dequant {
            file,
            tensor,
            output,
        } => {
            let bytes = map(&file)?;
            let g = Gguf::parse(bytes.bytes()).map_err(|e| named(&file, e))?;
            let values = g.require_tensor(&tensor)?.dequantize()?;
            let sink: Box<dyn Write> = if output.as_os_str() == "-" {
                Box::new(std::io::stdout().lock())
            } else {
                Box::new(
                    std::fs::File::create(&output)
                        .map_err(|e| format!("cannot create {}: {e}", output.display()))?,
                )
            };
            let mut w = BufWriter::with_capacity(1 << 20, sink);
            for chunk in values.chunks(1 << 16) {
                let bytes: Vec<u8> = chunk.iter().flat_map(|x| x.to_le_bytes()).collect();
                w.write_all(&bytes)?;
            }
            w.flush()?;
            Ok(())
        }
        GgufCommand::Synth(a) => crate::gguf_synth_cmd::run(a),
        #[cfg(feature = "cuda")]
        GgufCommand::UploadBench(a) => crate::gguf_upload_cmd::run(a),
    }
}

fn named(file: &Path, e: pagedkv::gguf::GgufError) -> String {
    format!("{}: {e}", file.display())
}

fn map(file: &Path) -> Result<GgufBytes> {
    // SAFETY: `map` requires that nobody truncates or writes the file while the map lives. The
    // map lives only for this one command, which reads a model file that is, by the command's
    // documented contract (see `inspect --help`), not being rewritten; the mapping is
    // read-only, so this process cannot violate it either.
    Ok(unsafe { GgufBytes::map(file) }?)
}

/// Whether printing `c` raw could drive the terminal or garble what follows: C0, DEL and C1
/// controls (ESC starts an escape sequence, U+009B is a CSI) and the bidirectional embeddings,
/// overrides and isolates. A crafted file's keys, strings and tensor names may hold any of them.
fn unsafe_to_print(c: char) -> bool {
    c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `s` with the characters of [`unsafe_to_print`] escaped: as `\u{..}` for the table, or as
/// JSON's `\uXXXX` (`json`). Unchanged (borrowed) when it has none.
fn escape_unsafe(s: &str, json: bool) -> Cow<'_, str> {
    if !s.chars().any(unsafe_to_print) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        if !unsafe_to_print(c) {
            out.push(c);
        } else if json {
            let _ = write!(out, "\\u{:04x}", u32::from(c));
        } else {
            let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
        }
    }
    Cow::Owned(out)
}

/// `s` for the table (see [`escape_unsafe`]).
fn printable(s: &str) -> Cow<'_, str> {
    escape_unsafe(s, false)
}

/// `v` as JSON text with the characters of [`unsafe_to_print`] as `\uXXXX` escapes: the same
/// JSON value (serde_json escapes only U+0000 to U+001F itself, and in its output such
/// characters occur only inside strings, all of them in the Basic Multilingual Plane).
fn json_text(v: &Json) -> String {
    let text = v.to_string();
    if let Cow::Owned(escaped) = escape_unsafe(&text, true) {
        return escaped;
    }
    text
}

fn value_json(v: &Value<'_>) -> Json {
    match *v {
        Value::U8(x) => x.into(),
        Value::I8(x) => x.into(),
        Value::U16(x) => x.into(),
        Value::I16(x) => x.into(),
        Value::U32(x) => x.into(),
        Value::I32(x) => x.into(),
        Value::U64(x) => x.into(),
        Value::I64(x) => x.into(),
        // NaN and infinities have no JSON form: they print as null.
        Value::F32(x) => Json::from(f64::from(x)),
        Value::F64(x) => Json::from(x),
        Value::Bool(x) => x.into(),
        Value::String(s) => s.into(),
        Value::Array(a) => Json::Array(a.iter().map(|v| value_json(&v)).collect()),
    }
}

/// JSON with metadata keys in file order (serde_json's map would sort them).
fn to_json(g: &Gguf<'_>) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        "{{\"version\":{},\"alignment\":{},\"data_offset\":{},\"metadata\":{{",
        g.version(),
        g.alignment(),
        g.data_offset()
    );
    for (i, (k, v)) in g.metadata().iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&json_text(&Json::from(*k)));
        s.push(':');
        s.push_str(&json_text(&value_json(v)));
    }
    s.push_str("},\"tensors\":[");
    for (i, t) in g.tensors().iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(
            s,
            "{{\"name\":{},\"type\":\"{}\",\"shape\":{},\"offset\":{},\"n_bytes\":{}}}",
            json_text(&Json::from(t.name())),
            t.ty().name(),
            Json::from(t.shape()),
            t.offset(),
            t.n_bytes()
        );
    }
    s.push_str("]}\n");
    s
}

/// A value for the table: arrays abbreviated to their first few items.
fn value_short(v: &Value<'_>) -> String {
    const SHOW: usize = 8;
    match v {
        Value::Array(a) => {
            let items: Vec<String> = a.iter().take(SHOW).map(|v| value_short(&v)).collect();
            let more = if a.len() as usize > SHOW { ", ..." } else { "" };
            format!(
                "[{} x {}] [{}{}]",
                a.len(),
                a.elem_type(),
                items.join(", "),
                more
            )
        }
        Value::String(s) if s.chars().count() > 80 => {
            let head: String = s.chars().take(77).collect();
            format!("{head:?}...")
        }
        other => value_json(other).to_string(),
    }
}

/// Widest key or name column of the table.
const COLUMN: usize = 64;

fn to_table(g: &Gguf<'_>) -> String {
    let mut s = String::new();
    let total: u64 = g.total_tensor_bytes();
    let _ = writeln!(
        s,
        "GGUF v{}  alignment {}  data at byte {}  {} metadata entries  {} tensors  {:.2} MiB of tensor data",
        g.version(),
        g.alignment(),
        g.data_offset(),
        g.metadata().len(),
        g.tensors().len(),
        total as f64 / (1u64 << 20) as f64
    );
    if let Ok(p) = g.llama_params() {
        let _ = writeln!(
            s,
            "{}: {} layers, {} heads, {} KV heads, head dim {}, context {}, rope base {}, norm eps {:e}",
            printable(&p.architecture),
            p.n_layers,
            p.n_heads,
            p.n_kv_heads,
            p.head_dim,
            p.context_length,
            p.rope_freq_base,
            p.norm_eps
        );
    }
    let _ = writeln!(s, "\nmetadata:");
    // Columns as wide as the longest key / name, up to COLUMN: a longer one overflows its
    // column instead of padding every line to its length (a file's one 1 MB key made every
    // line 1 MB, and a width past u16::MAX panics the formatter).
    // Keys, names and strings are printed with control characters escaped (`printable`).
    let kw = g
        .metadata()
        .iter()
        .map(|(k, _)| printable(k).len())
        .max()
        .unwrap_or(0)
        .min(COLUMN);
    for (k, v) in g.metadata() {
        let _ = writeln!(
            s,
            "  {:<kw$}  {:<7}  {}",
            printable(k),
            v.value_type().name(),
            printable(&value_short(v))
        );
    }
    let _ = writeln!(s, "\ntensors:");
    let nw = g
        .tensors()
        .iter()
        .map(|t| printable(t.name()).len())
        .max()
        .unwrap_or(4)
        .clamp(4, COLUMN);
    let _ = writeln!(
        s,
        "  {:<nw$}  {:<7}  {:<24}  {:>14}  {:>14}",
        "name", "type", "shape", "offset", "bytes"
    );
    for t in g.tensors() {
        let shape = format!("{:?}", t.shape());
        let _ = writeln!(
            s,
            "  {:<nw$}  {:<7}  {:<24}  {:>14}  {:>14}",
            printable(t.name()),
            t.ty().name(),
            shape,
            t.offset(),
            t.n_bytes()
        );
    }
    s
}
