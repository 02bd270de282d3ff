//! `pagedkv gguf inspect` and `pagedkv gguf dequant`, run as a user would.

use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/gguf")
        .join(name)
}

fn pagedkv(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_pagedkv"))
        .args(args)
        .output()
        .expect("run pagedkv")
}

#[test]
fn inspect_json_matches_the_documented_schema() {
    let f = fixture("all_types.gguf");
    let out = pagedkv(&["gguf", "inspect", "--json", f.to_str().expect("utf8")]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let want: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("all_types.meta.json")).expect("meta"))
            .expect("meta json");
    assert_eq!(j["version"], 3);
    assert_eq!(j["alignment"], 32);
    assert!(j["data_offset"].as_u64().expect("data_offset") % 32 == 0);
    assert_eq!(j["tensors"], want["tensors"]);
    let meta = j["metadata"].as_object().expect("metadata object");
    for m in want["metadata"].as_array().expect("entries") {
        let key = m["key"].as_str().expect("key");
        assert_eq!(meta[key], m["value"], "{key}");
    }
    assert_eq!(
        meta.len(),
        want["metadata"].as_array().map(Vec::len).unwrap_or(0)
    );
}

#[test]
fn inspect_table_names_types_and_hyperparameters() {
    let f = fixture("all_types.gguf");
    let out = pagedkv(&["gguf", "inspect", f.to_str().expect("utf8")]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).expect("utf8");
    assert!(text.starts_with("GGUF v3"));
    assert!(text.contains("4 layers, 8 heads, 2 KV heads, head dim 64, context 4096"));
    for ty in ["Q4_K", "MXFP4", "IQ4_NL", "BF16"] {
        assert!(text.contains(&format!("t.{ty}")), "{ty}");
    }
}

#[test]
fn dequant_writes_little_endian_f32() {
    let dir = tempfile::tempdir().expect("tmp");
    for ty in ["Q6_K", "F16", "MXFP4"] {
        let out = dir.path().join(format!("{ty}.f32"));
        let f = fixture("all_types.gguf");
        let r = pagedkv(&[
            "gguf",
            "dequant",
            f.to_str().expect("utf8"),
            &format!("t.{ty}"),
            "-o",
            out.to_str().expect("utf8"),
        ]);
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        assert_eq!(
            std::fs::read(&out).expect("out"),
            std::fs::read(fixture(&format!("{ty}.f32"))).expect("oracle"),
            "{ty}"
        );
    }
}

#[test]
fn bad_input_is_a_one_line_error_and_a_failing_exit() {
    let dir = tempfile::tempdir().expect("tmp");
    let good = std::fs::read(fixture("all_types.gguf")).expect("fixture");
    let truncated = dir.path().join("truncated.gguf");
    std::fs::write(&truncated, &good[..3000]).expect("write");
    let garbage = dir.path().join("garbage.gguf");
    std::fs::write(&garbage, b"not a gguf file at all").expect("write");
    let f = fixture("all_types.gguf");
    let be = fixture("big_endian.gguf");
    let runs: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["gguf", "inspect", truncated.to_str().expect("p")],
            "past the file",
        ),
        (
            vec!["gguf", "inspect", "--json", garbage.to_str().expect("p")],
            "not a GGUF file",
        ),
        (
            vec!["gguf", "inspect", "/nonexistent/model.gguf"],
            "cannot read",
        ),
        (
            vec!["gguf", "inspect", be.to_str().expect("p")],
            "big-endian",
        ),
        (
            vec![
                "gguf",
                "dequant",
                f.to_str().expect("p"),
                "missing",
                "-o",
                "/dev/null",
            ],
            "no tensor named \"missing\"",
        ),
    ];
    for (args, needle) in runs {
        let r = pagedkv(&args);
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(!r.status.success(), "{args:?} succeeded");
        assert_eq!(r.status.code(), Some(1), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// The table's key column was padded to the longest key: a key of 64 KiB or more panicked the
/// formatter (widths stop at u16::MAX), and a shorter long key padded every other line to its
/// length (a 2 MB file of one 1 MB key and 77,000 short ones would print 77 GB).
#[test]
fn inspect_table_stays_proportional_to_the_file() {
    use pagedkv::gguf::{GgufWriter, MetaValue};
    let dir = tempfile::tempdir().expect("tmp");
    // 32 KiB: every line padded to it; 64 KiB: past the formatter's widest width.
    for key_len in [32 << 10, 64 << 10] {
        let mut w = GgufWriter::new();
        w.add(&"k".repeat(key_len), MetaValue::U8(0))
            .expect("long key");
        for i in 0..2000 {
            w.add(&format!("k{i}"), MetaValue::U8(1))
                .expect("short key");
        }
        let bytes = w.to_bytes().expect("write");
        let f = dir.path().join("long_key.gguf");
        std::fs::write(&f, &bytes).expect("write");
        let out = pagedkv(&["gguf", "inspect", f.to_str().expect("utf8")]);
        assert!(
            out.status.success(),
            "key of {key_len} bytes: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.stdout.len() < 4 * bytes.len(),
            "a {}-byte file printed a {}-byte table",
            bytes.len(),
            out.stdout.len()
        );
    }
}

// ---- pagedkv gguf synth ----------------------------------------------------------------------

/// Runs `pagedkv gguf synth OUT` with a small shape plus `extra`; returns the file's bytes.
fn synth(out: &Path, layers: &str, extra: &[&str]) -> Vec<u8> {
    let mut args = vec![
        "gguf",
        "synth",
        out.to_str().expect("utf8"),
        "--layers",
        layers,
        "--dim",
        "256",
        "--ffn",
        "512",
        "--vocab",
        "300",
        "--heads",
        "4",
        "--kv-heads",
        "2",
    ];
    args.extend_from_slice(extra);
    let r = pagedkv(&args);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let text = String::from_utf8_lossy(&r.stdout);
    assert!(text.starts_with("wrote "), "{text}");
    std::fs::read(out).expect("synth output")
}

#[test]
fn synth_writes_a_llama_shaped_file_of_finite_random_tensors() {
    use pagedkv::gguf::{GgmlType, Gguf};
    let dir = tempfile::tempdir().expect("tmp");
    let bytes = synth(&dir.path().join("a.gguf"), "8", &[]);
    let g = Gguf::parse(&bytes).expect("parse");
    // The first GPU run's file had 8 layers and 75 tensors: 9 per layer, embedding, output
    // norm and output.
    assert_eq!(g.tensors().len(), 75);
    let p = g.llama_params().expect("llama params");
    assert_eq!(
        (
            p.n_layers,
            p.n_heads,
            p.n_kv_heads,
            p.head_dim,
            p.embedding_length
        ),
        (8, 4, 2, 64, 256)
    );
    let ty = |name: &str| g.tensor(name).unwrap_or_else(|| panic!("{name}")).ty();
    let kv_dim = 2 * 64;
    for (name, want, shape) in [
        ("token_embd.weight", GgmlType::F16, vec![256, 300]),
        ("output.weight", GgmlType::Q6_K, vec![256, 300]),
        ("output_norm.weight", GgmlType::F32, vec![256]),
        ("blk.7.attn_q.weight", GgmlType::F16, vec![256, 256]),
        ("blk.7.attn_k.weight", GgmlType::Q8_0, vec![256, kv_dim]),
        ("blk.7.attn_v.weight", GgmlType::Q6_K, vec![256, kv_dim]),
        ("blk.7.attn_output.weight", GgmlType::Q4_K, vec![256, 256]),
        ("blk.7.ffn_gate.weight", GgmlType::Q8_0, vec![256, 512]),
        ("blk.7.ffn_up.weight", GgmlType::Q8_0, vec![256, 512]),
        ("blk.7.ffn_down.weight", GgmlType::F16, vec![512, 256]),
        ("blk.0.attn_norm.weight", GgmlType::F32, vec![256]),
        ("blk.0.ffn_norm.weight", GgmlType::F32, vec![256]),
    ] {
        assert_eq!(ty(name), want, "{name}");
        assert_eq!(g.tensor(name).expect("t").shape(), shape, "{name}");
    }
    // Values: finite everywhere, norms near 1, weights within their scale.
    for t in g.tensors() {
        let v = t.dequantize().expect("dequantize");
        assert!(
            v.iter().all(|x| x.is_finite()),
            "{}: non-finite value",
            t.name()
        );
        if t.shape().len() == 1 {
            assert!(v.iter().all(|x| (0.94..=1.06).contains(x)), "{}", t.name());
        } else {
            let max = v.iter().fold(0f32, |m, x| m.max(x.abs()));
            assert!(max > 0.0 && max < 1.0, "{}: max |x| {max}", t.name());
        }
    }
    // Deterministic from the seed: the same arguments give the same bytes, another seed others.
    let again = synth(&dir.path().join("b.gguf"), "8", &[]);
    assert!(again == bytes, "same arguments, different bytes");
    let other = synth(&dir.path().join("c.gguf"), "8", &["--seed", "2"]);
    assert_eq!(other.len(), bytes.len());
    assert!(other != bytes, "another seed, same bytes");
}

#[test]
fn synth_weights_option_and_refusals() {
    use pagedkv::gguf::{GgmlType, Gguf};
    let dir = tempfile::tempdir().expect("tmp");
    for (flag, want) in [
        ("q4_0", GgmlType::Q4_0),
        ("BF16", GgmlType::BF16),
        ("q4_k", GgmlType::Q4_K),
    ] {
        let bytes = synth(
            &dir.path().join(format!("{flag}.gguf")),
            "1",
            &["--weights", flag],
        );
        let g = Gguf::parse(&bytes).expect("parse");
        for t in g.tensors() {
            let expect = if t.shape().len() == 1 {
                GgmlType::F32
            } else {
                want
            };
            assert_eq!(t.ty(), expect, "{flag}: {}", t.name());
            assert!(t.dequantize().expect("dq").iter().all(|x| x.is_finite()));
        }
    }
    let out = dir.path().join("x.gguf");
    let o = out.to_str().expect("utf8");
    for (args, needle) in [
        (vec!["gguf", "synth", o, "--layers", "0"], "--layers"),
        (
            vec!["gguf", "synth", o, "--layers", "1", "--dim", "300"],
            "multiple of 256",
        ),
        (
            vec!["gguf", "synth", o, "--layers", "1", "--weights", "Q5_K"],
            "--weights",
        ),
        (
            vec![
                "gguf", "synth", o, "--layers", "1", "--dim", "256", "--heads", "3",
            ],
            "--heads",
        ),
        (
            vec!["gguf", "synth", "/nonexistent/dir/x.gguf", "--layers", "1"],
            "cannot create",
        ),
    ] {
        let r = pagedkv(&args);
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// Sizes synth cannot hold in memory are refused before anything is built: `--layers
/// 4294967295` built 9 x 2^32 tensor entries first (out of memory), `--vocab 4294967295`
/// generated a 32 TiB embedding in one buffer (allocation abort). Run under a 4 GiB
/// address-space limit, so that a binary without the bounds fails fast instead of taking the
/// machine's memory.
#[cfg(unix)]
#[test]
fn synth_refuses_sizes_it_cannot_hold_in_memory() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("x.gguf");
    let o = out.to_str().expect("utf8");
    for (extra, needle) in [
        (&["--layers", "4294967295"][..], "--layers 4294967295"),
        (&["--layers", "4097"][..], "--layers 4097"),
        (
            &["--layers", "1", "--vocab", "4294967295"][..],
            "token_embd.weight",
        ),
        (
            &[
                "--layers",
                "1",
                "--dim",
                "1048576",
                "--vocab",
                "300",
                "--heads",
                "1",
                "--kv-heads",
                "1",
            ][..],
            "blk.0.attn_q.weight",
        ),
    ] {
        let r = Command::new("sh")
            .args(["-c", "ulimit -v 4194304 && exec \"$@\"", "sh"])
            .arg(env!("CARGO_BIN_EXE_pagedkv"))
            .args(["gguf", "synth", o])
            .args(extra)
            .output()
            .expect("run pagedkv");
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(1), "{extra:?}: {:?} {err}", r.status);
        assert!(err.contains(needle), "{extra:?}: {err}");
        assert!(!err.contains("memory allocation"), "{extra:?}: {err}");
    }
}

/// `inspect` prints a crafted file's metadata keys, string values and tensor names with their
/// control characters escaped: printed raw, an ESC (or a C1 CSI, U+009B) in them drove the
/// terminal. `--json` escapes them as `\uXXXX`, so the JSON values are unchanged.
#[test]
fn inspect_escapes_control_characters() {
    use pagedkv::gguf::{GgmlType, GgufWriter, MetaValue};
    let key = "evil\u{1b}]0;pwned\u{7}.key";
    let value = "red \u{9b}31m \u{7f} \u{202e}txt \u{1b}[2J";
    let name = "t\u{1b}[31m";
    let data = [0u8; 16];
    let mut w = GgufWriter::new();
    w.add(key, MetaValue::String(value.into())).expect("key");
    w.add("list", MetaValue::strings(["a\u{1b}[5m\u{85}"]))
        .expect("list");
    w.add_tensor(name, GgmlType::F32, &[4], &data)
        .expect("tensor");
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("evil.gguf");
    std::fs::write(&path, w.to_bytes().expect("bytes")).expect("write");
    let p = path.to_str().expect("utf8");
    for json in [false, true] {
        let args: &[&str] = if json {
            &["gguf", "inspect", "--json", p]
        } else {
            &["gguf", "inspect", p]
        };
        let out = pagedkv(args);
        assert!(out.status.success(), "{json}");
        let text = String::from_utf8(out.stdout).expect("utf8");
        for raw in ['\u{1b}', '\u{7}', '\u{9b}', '\u{7f}', '\u{85}', '\u{202e}'] {
            assert!(
                !text.contains(raw),
                "json {json}: {raw:?} printed raw: {text:?}"
            );
        }
        if json {
            let j: serde_json::Value = serde_json::from_str(&text).expect("json");
            assert_eq!(j["metadata"][key], value);
            assert_eq!(j["metadata"]["list"][0], "a\u{1b}[5m\u{85}");
            assert_eq!(j["tensors"][0]["name"], name);
        } else {
            assert!(text.contains("evil\\u{1b}]0;pwned\\u{7}.key"), "{text}");
            assert!(text.contains("t\\u{1b}[31m"), "{text}");
            assert!(text.contains("\\u{9b}31m"), "{text}");
        }
    }
}
