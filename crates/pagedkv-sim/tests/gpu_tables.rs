//! scripts/gpu-tables.py (the BENCHMARKS tables from a device call's logs) on a log written by
//! the bench's own row formatters.
use pagedkv_sim::gpu_bench::*;

const S: Shape = Shape {
    head_dim: 128,
    elem_bytes: 2,
};

fn t(g: f64) -> Outcome {
    Outcome::Timed(Timing {
        graph_us: g,
        b2b_us: g + 1.0,
        one_us: g + 5.0,
        copies: 3,
    })
}

/// The header line under each table title (`heads/BxCTX | graph us ...`) split into four cells
/// and passed the old row filter: every table got a bogus first row.
#[test]
fn gpu_tables_reads_only_point_rows() {
    let dir = std::env::temp_dir().join(format!("pagedkv-gpu-tables-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut log = String::new();
    log += "decode bf16 d128 bs16 mode Auto; times per call; GB/s of K/V + q + out bytes at the graph time\n";
    log += &decode_header();
    log += "\n";
    let p: DecodePoint = "32:8/1x4096".parse().unwrap();
    log += &decode_row(&p, S, &t(16.2), Some(&t(13.0)), 3000.0);
    log += "\n";
    log += "                  (checked against the CPU oracle: max |err| 1.00e-3)\n";
    log += "\nprefill bf16 d128 bs16 tiling Auto, one sequence, causal; TFLOP/s of the causal region at the graph time\n";
    log += &prefill_header();
    log += "\n";
    let q: PrefillPoint = "32:8/2048+4096".parse().unwrap();
    log += &prefill_row(&q, S, &t(441.9), Some(&t(554.1)));
    log += "\n                  (Auto ran Wgmma128)\n";
    let path = dir.join("bench-x.log");
    std::fs::write(&path, &log).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/gpu-tables.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .arg(&path)
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !text.contains("heads/"),
        "a header line read as a point row:\n{text}"
    );
    assert!(
        text.contains("32:8/1x4096") && text.contains("32:8/2048+4096"),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Runs scripts/gpu-tables.py on one log; its stdout.
fn tables_of(name: &str, log: &str) -> String {
    let dir =
        std::env::temp_dir().join(format!("pagedkv-gpu-tables-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bench-prefill-d128.log");
    std::fs::write(&path, log).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/gpu-tables.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .arg(&path)
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The table's row of `point`, split into its cells.
fn row_of(text: &str, point: &str) -> Vec<String> {
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("| {point} |")))
        .unwrap_or_else(|| panic!("no row for {point}:\n{text}"));
    line.trim_matches('|')
        .split('|')
        .map(|c| c.trim().to_string())
        .collect()
}

/// The bench prints `(Auto: the f32 kernel)` where Auto runs no tensor-core tiling, and after
/// its tables the peer's notes (`peer note: POINT: fastest of N: WAY (others: ...); kernels:
/// ...`), which say which SDPA each prefill figure was measured against: the table carries
/// both (it said `-` for the f32 kernel and dropped the notes).
#[test]
fn gpu_tables_reads_auto_f32_and_the_peers_way() {
    let mut log = String::new();
    log += "prefill bf16 d128 bs16 tiling Auto, one sequence, causal; TFLOP/s of the causal region at the graph time\n";
    log += &prefill_header();
    log += "\n";
    let a: PrefillPoint = "32:8/2048+4096".parse().unwrap();
    let b: PrefillPoint = "32:8/512+0".parse().unwrap();
    log += &prefill_row(&a, S, &t(441.9), Some(&t(554.1)));
    log += "\n                  (Auto: the f32 kernel)\n";
    log += &prefill_row(&b, S, &t(40.0), Some(&t(30.0)));
    log += "\n                  (Auto ran Wgmma128)\n";
    log += "peer note: 32:8/2048+4096: fastest of 3: dense mask, cuDNN (others: lower-right bias 600.1 us, dense mask, default 900.0 us); kernels: cudnn_generated_fort_native_sdpa_sm90_flash_fprop\n";
    log += "peer note: 32:8/512+0: kernels: void pytorch_flash::flash_fwd_kernel\n";
    let text = tables_of("f32", &log);
    let ra = row_of(&text, "32:8/2048+4096");
    assert_eq!(ra.last().unwrap(), "f32", "{text}");
    assert!(
        ra.iter().any(|c| c.contains("dense mask, cuDNN")),
        "the peer's way is missing:\n{text}"
    );
    let rb = row_of(&text, "32:8/512+0");
    assert_eq!(rb.last().unwrap(), "Wgmma128", "{text}");
    assert!(
        rb.iter().any(|c| c.contains("flash_fwd_kernel")),
        "the peer's kernels are missing:\n{text}"
    );
}
