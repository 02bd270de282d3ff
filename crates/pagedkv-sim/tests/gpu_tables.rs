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
