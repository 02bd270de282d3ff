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
