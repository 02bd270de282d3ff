//! The simulator on bad input: a clear error, never a panic, a hang or unbounded memory; and
//! figures that are what was measured.

use pagedkv_sim::{self as sim, SimConfig};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Runs the binary; fails the test if it is still running after `limit` (a hang).
fn pagedkv_within(args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_pagedkv"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{args:?} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// Exited by itself (not killed by a signal such as SIGABRT on OOM) and did not panic.
fn assert_clean(args: &[&str], out: &Output) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code().is_some(),
        "{args:?} killed: {:?}\n{stderr}",
        out.status
    );
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    assert!(!stderr.contains("memory allocation"), "{args:?}: {stderr}");
}

/// `--step-ms 1e-9` asks for 10^12 steps for one simulated second: it must be refused,
/// not run (forever).
#[test]
fn tiny_step_is_refused_not_run_forever() {
    let args = [
        "simulate",
        "--quiet",
        "--duration",
        "1",
        "--step-ms",
        "1e-9",
    ];
    let out = pagedkv_within(&args, Duration::from_secs(30));
    assert_clean(&args, &out);
    assert!(!out.status.success(), "{args:?} succeeded");
}

/// Huge `--duration` or `--load` generate an unbounded workload (OOM abort in `generate`).
/// Checked on the library so the test itself cannot exhaust memory.
#[test]
fn unbounded_workloads_are_refused_by_validate() {
    let cfg = SimConfig {
        duration_s: 1e9,
        ..SimConfig::default()
    };
    assert!(sim::validate(&cfg).is_err(), "10^9 s of arrivals accepted");
    let mut cfg = SimConfig::default();
    for e in &mut cfg.engines {
        e.rate *= 1e200;
    }
    assert!(sim::validate(&cfg).is_err(), "10^200 requests/s accepted");
}

/// `(duration / step).ceil() as u64 * 6` overflows (debug: panic) although the run is empty.
#[test]
fn step_limit_does_not_overflow() {
    let args = [
        "simulate",
        "--quiet",
        "--duration",
        "1e17",
        "--load",
        "1e-300",
    ];
    let out = pagedkv_within(&args, Duration::from_secs(60));
    assert_clean(&args, &out);
}

/// `--clients` sizes a Vec of clients up front: 10^12 clients abort on allocation.
#[test]
fn huge_client_count_is_not_an_allocation_abort() {
    let args = [
        "simulate",
        "--quiet",
        "--duration",
        "0.5",
        "--clients",
        "1000000000000",
    ];
    let out = pagedkv_within(&args, Duration::from_secs(60));
    assert_clean(&args, &out);
}

/// Weights summing past u32::MAX: the weight shares must still sum to 1 (release: the u32 sum
/// wraps and prints "weight inf%"; debug: panics).
#[test]
fn weight_shares_sum_to_one_with_large_weights() {
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/gguf/all_types.gguf"
    );
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let args = [
        "simulate",
        "--quiet",
        "--duration",
        "0.5",
        "--model",
        fixture,
        "--model",
        fixture,
        "--weights",
        "4294967295,1",
        "--json",
        json.to_str().unwrap(),
    ];
    let out = pagedkv_within(&args, Duration::from_secs(120));
    assert_clean(&args, &out);
    assert!(out.status.success());
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let sum: f64 = r["engines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["weight_share"].as_f64().unwrap())
        .sum();
    assert!((sum - 1.0).abs() < 1e-9, "weight shares sum to {sum}");
}

/// `stress --seconds 1e300` is finite and positive, but `Duration::from_secs_f64` panics.
#[test]
fn stress_huge_seconds_is_a_clear_error() {
    let args = ["stress", "--seconds", "1e300"];
    let out = pagedkv_within(&args, Duration::from_secs(30));
    assert_clean(&args, &out);
    assert!(!out.status.success());
}

/// A public config the library accepts must not panic in the run: `max_output: 0` (and
/// `max_prompt: 0`) make `heavy_tailed` call `clamp(1, 0)`, a NaN latency fraction makes
/// `gen_bool` panic.
#[test]
fn library_configs_that_panic_in_generate_are_refused() {
    for bad in 0..3 {
        let mut cfg = SimConfig {
            duration_s: 0.5,
            ..SimConfig::default()
        };
        match bad {
            0 => cfg.engines[0].max_output = 0,
            1 => cfg.engines[0].max_prompt = 0,
            _ => cfg.engines[0].latency_fraction = f64::NAN,
        }
        let r = std::panic::catch_unwind(|| sim::run(&cfg, &|_| {}).map(|_| ()));
        assert!(
            matches!(r, Ok(Err(_))),
            "case {bad}: {}",
            if r.is_err() { "panicked" } else { "accepted" }
        );
    }
}

/// A run stopped at its step limit: every request is counted once, finished or refused with
/// a reason. One-token prompts and outputs at one token per step finish one request per step,
/// so a request finishes in the very last step: its client had not collected the outcome yet,
/// and it was counted as finished and as timed out.
#[test]
fn forced_stop_counts_each_request_once() {
    let mut e = SimConfig::default().engines[0].clone();
    e.rate = 200_000.0;
    e.burst = None;
    e.system_prompt = 0;
    e.max_prompt = 1;
    e.prompt_mean = 1.0;
    e.max_output = 1;
    e.output_mean = 1.0;
    let cfg = SimConfig {
        duration_s: 0.025,
        tokens_per_step: 1,
        cap_permille: 1000,
        queue_capacity: 8192,
        prefix_cache: false,
        engines: vec![e],
        ..SimConfig::default()
    };
    let r = sim::run(&cfg, &|_| {}).unwrap();
    assert!(r.refused.timed_out > 0, "the run was not cut short: {r:?}");
    let refused =
        r.refused.queue_full + r.refused.evicted + r.refused.too_long + r.refused.timed_out;
    assert_eq!(
        r.finished + refused,
        r.requests,
        "finished {} + refused {:?} vs {} requests",
        r.finished,
        r.refused,
        r.requests
    );
    let e = &r.engines[0];
    let e_refused =
        e.refused.queue_full + e.refused.evicted + e.refused.too_long + e.refused.timed_out;
    assert_eq!(e.finished + e_refused, e.requests);
    assert_eq!(r.leaked_blocks, 0);
}

/// The text report prints what was measured: half a second of arrivals is not "0 s" (nor a
/// second and a half "2 s"), and a class with no request has no latency, not 0 ms.
#[test]
fn text_report_prints_the_duration_and_no_latency_for_an_empty_class() {
    let mut cfg = SimConfig {
        duration_s: 0.5,
        ..SimConfig::default()
    };
    cfg.engines.truncate(1);
    cfg.engines[0].latency_fraction = 0.0;
    let r = sim::run(&cfg, &|_| {}).unwrap();
    let e = &r.engines[0];
    assert!(
        e.finished > 0 && e.latency_critical.ttft.count == 0,
        "{e:?}"
    );
    let text = r.to_text();
    assert!(text.contains("0.5 s of arrivals"), "{text}");
    let line = text
        .lines()
        .find(|l| l.starts_with(&e.name))
        .unwrap_or_else(|| panic!("no line for {}: {text}", e.name));
    let lc = line.split('|').nth(1).unwrap();
    assert!(
        !lc.contains("0/0"),
        "no latency-critical request, yet latencies of 0 ms: {line}"
    );
    // An engine without a request: no time to first token either.
    cfg.engines.push(cfg.engines[0].clone());
    cfg.engines[1].name = "idle".into();
    cfg.engines[1].rate = 0.0;
    let text = sim::run(&cfg, &|_| {}).unwrap().to_text();
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("idle") && l.contains("ttft p50"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(line.ends_with("ttft p50 -"), "{line}");
}

/// A page smaller than a KiB (a small model in f16) is not "0 KiB": the size is printed
/// exactly.
#[test]
fn text_report_prints_a_small_page_size() {
    let mut cfg = SimConfig {
        duration_s: 0.2,
        dtype: pagedkv::kv::KvDtype::F16,
        block_size: 8,
        ..SimConfig::default()
    };
    cfg.engines.truncate(1);
    let e = &mut cfg.engines[0];
    (e.layers, e.heads, e.kv_heads, e.head_dim) = (1, 2, 1, 8);
    let r = sim::run(&cfg, &|_| {}).unwrap();
    // 8 tokens x (K and V) x 1 KV head x 8 dims x 2 bytes.
    assert_eq!(r.page_bytes, 256);
    let text = r.to_text();
    assert!(text.contains("pages of 256 B)"), "{text}");
}

/// Zero sizes that make a run meaningless are refused by `validate`: with `admit_per_step: 0`
/// no engine took a request, the run spun to its step limit and reported every request timed
/// out. The others (a zero queue capacity or cap, an engine with no heads, layers or head dim)
/// were accepted by `validate` and refused only once the run had generated its workload.
#[test]
fn zeros_that_make_a_run_meaningless_are_refused_by_validate() {
    for case in 0..6 {
        let mut cfg = SimConfig {
            duration_s: 0.5,
            ..SimConfig::default()
        };
        let what = match case {
            0 => {
                cfg.admit_per_step = 0;
                "admit_per_step"
            }
            1 => {
                cfg.queue_capacity = 0;
                "queue_capacity"
            }
            2 => {
                cfg.cap_permille = 0;
                "cap_permille"
            }
            3 => {
                cfg.engines[1].heads = 0;
                "heads"
            }
            4 => {
                cfg.engines[1].layers = 0;
                "layers"
            }
            _ => {
                cfg.engines[1].head_dim = 0;
                "head_dim"
            }
        };
        assert!(
            matches!(
                sim::validate(&cfg),
                Err(sim::error::SimError::InvalidConfig(_))
            ),
            "{what}: 0 accepted"
        );
        assert!(sim::run(&cfg, &|_| {}).is_err(), "{what}: 0 ran");
    }
}

/// A run in which no request got a first token (every prompt longer than the engine's
/// context) has no time to first token: the headline printed "ttft p50 0 ms over all
/// requests", as if every request had been answered at once.
#[test]
fn headline_ttft_without_a_first_token_is_not_0_ms() {
    let mut cfg = SimConfig {
        duration_s: 0.5,
        ..SimConfig::default()
    };
    cfg.engines.truncate(1);
    cfg.engines[0].max_context = 16;
    let r = sim::run(&cfg, &|_| {}).unwrap();
    assert!(
        r.requests > 0 && r.refused.too_long == r.requests,
        "{:?}",
        r.refused
    );
    let text = r.to_text();
    let line = text
        .lines()
        .find(|l| l.contains("over all requests"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(line.ends_with("ttft p50 - over all requests"), "{line}");
}

/// A step so long that the step limit's simulated end overflows to infinity: the first
/// token times came out as inf ms, the inter-token gaps as NaN (inf - inf), and `--plot`
/// hung on the infinite time axis. Refused by `validate` instead.
#[test]
fn a_step_whose_simulated_end_overflows_is_refused() {
    let cfg = SimConfig {
        duration_s: 1.0,
        step_ms: 1e308,
        ..SimConfig::default()
    };
    match sim::run(&cfg, &|_| {}) {
        Err(sim::error::SimError::InvalidConfig(_)) => {}
        Err(e) => panic!("another error: {e}"),
        Ok(r) => {
            let lat: Vec<f64> = r
                .engines
                .iter()
                .flat_map(|e| [&e.latency_critical, &e.throughput])
                .flat_map(|c| [c.ttft.p50_ms, c.ttft.p99_ms, c.itl.p50_ms, c.itl.p99_ms])
                .collect();
            panic!(
                "accepted; latencies {lat:?}, timeline ends at {:?} s",
                r.timeline.last().map(|p| p.t_s)
            );
        }
    }
    // A long step whose limit stays finite is still accepted.
    let ok = SimConfig {
        duration_s: 0.2,
        step_ms: 1e304,
        ..SimConfig::default()
    };
    sim::validate(&ok).unwrap();
}

/// Every admission queue's slots are allocated up front: `--queue-capacity 100000000` (a
/// user's "no limit") made the run allocate 20 GB before its first step, and a larger one was
/// refused. A queue never holds more than its engine's requests of its class, so any capacity
/// above that runs as an unbounded queue: the same report as a capacity that just covers them.
#[test]
fn a_huge_queue_capacity_runs_as_an_unbounded_queue() {
    let cfg = |queue_capacity| SimConfig {
        duration_s: 0.5,
        queue_capacity,
        ..SimConfig::default()
    };
    let covering = sim::run(&cfg(4096), &|_| {}).unwrap();
    assert!(covering.requests > 0 && covering.requests < 4096);
    for huge in [1 << 30, usize::MAX] {
        let r =
            sim::run(&cfg(huge), &|_| {}).unwrap_or_else(|e| panic!("queue capacity {huge}: {e}"));
        assert_eq!(
            (r.requests, r.finished, &r.refused, r.steps),
            (
                covering.requests,
                covering.finished,
                &covering.refused,
                covering.steps
            ),
            "queue capacity {huge}"
        );
    }
}
