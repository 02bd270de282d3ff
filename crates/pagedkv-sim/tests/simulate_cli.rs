//! `pagedkv simulate` from the command line: a short run writes its report, JSON and chart;
//! bad arguments and impossible configurations fail with one clear line.

use std::process::Command;

fn pagedkv(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_pagedkv"))
        .args(args)
        .output()
        .expect("the binary runs")
}

#[test]
fn short_run_writes_report_json_and_chart() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let svg = dir.path().join("r.svg");
    let out = pagedkv(&[
        "simulate",
        "--duration",
        "2",
        "--quiet",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("leaked blocks: 0"), "{stdout}");
    for name in ["chat-gqa", "code-mqa", "batch-mha"] {
        assert!(stdout.contains(name), "{stdout}");
    }
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report["engines"].as_array().unwrap().len(), 3);
    assert_eq!(report["leaked_blocks"], 0);
    // One arena shared by the three models: every KV byte allocated is the arena's.
    let pool = report["kv_pool_bytes"].as_u64().unwrap();
    let allocated = report["kv_bytes_allocated"].as_u64().unwrap();
    assert!(
        pool > 0 && allocated as f64 <= 1.05 * pool as f64,
        "{pool} {allocated}"
    );
    assert_eq!(
        pool,
        report["pool_blocks"].as_u64().unwrap() * report["page_bytes"].as_u64().unwrap()
    );
    assert!(stdout.contains("KV arena"), "{stdout}");
    // The prefix cache is on by default and the workload resends system prompts and history.
    let hit = report["prefix_hit_rate"].as_f64().unwrap();
    assert!((0.3..=1.0).contains(&hit), "{hit}");
    assert!(report["ttft_p50_ms"].as_f64().unwrap() > 0.0);
    assert!(stdout.contains("prefix cache on"), "{stdout}");
    assert!(stdout.contains("prefix hit"), "{stdout}");
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("KV blocks held per engine"));
}

#[test]
fn model_file_sizes_an_engine() {
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/gguf/all_types.gguf"
    );
    let out = pagedkv(&["simulate", "--model", fixture, "--duration", "1", "--quiet"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("all_types"), "{stdout}");
}

#[test]
fn bad_arguments_fail_clearly() {
    let cases: [(&[&str], &str); 6] = [
        (
            &["simulate", "--pool-blocks", "2", "--quiet"],
            "fewer than one per engine",
        ),
        (
            &["simulate", "--device", "tpu", "--quiet"],
            "unknown device",
        ),
        (&["simulate", "--dtype", "f64", "--quiet"], "unknown dtype"),
        (
            &["simulate", "--model", "/nonexistent.gguf", "--quiet"],
            "nonexistent.gguf",
        ),
        (&["simulate", "--duration=-1", "--quiet"], "duration"),
        (&["simulate", "--weights", "1,2", "--quiet"], "--weights"),
    ];
    for (args, needle) in cases {
        let out = pagedkv(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// `--model` engines take the built-in engines' traffic in turn, bursts included: the third
/// model gets no request in the first 8 s. `--help` says so (a user who gave three files and
/// `--duration 5` saw one model never used, with nothing telling why).
#[test]
fn model_engines_traffic_is_documented() {
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/gguf/all_types.gguf"
    );
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let out = pagedkv(&[
        "simulate",
        "--model",
        fixture,
        "--model",
        fixture,
        "--model",
        fixture,
        "--duration",
        "2",
        "--quiet",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(
        report["engines"][2]["requests"], 0,
        "the third model is silent for 8 s"
    );
    let help = pagedkv(&["simulate", "--help"]);
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("silent for the first 8 s"), "{help}");
}
