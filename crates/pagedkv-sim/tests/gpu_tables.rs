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

/// Runs scripts/gpu-tables.py on folders of logs (`folders[i]`: (log name, text) pairs, as a
/// device call's unpacked logs.tar.gz); its stdout.
fn tables_of_folders(name: &str, folders: &[&[(&str, String)]]) -> String {
    let root =
        std::env::temp_dir().join(format!("pagedkv-gpu-tables-{}-{name}", std::process::id()));
    let mut args = Vec::new();
    for (i, logs) in folders.iter().enumerate() {
        let dir = root.join(format!("call{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        for (log, text) in logs.iter() {
            std::fs::write(dir.join(format!("{log}.log")), text).unwrap();
        }
        args.push(dir);
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/gpu-tables.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .args(&args)
        .output()
        .unwrap();
    std::fs::remove_dir_all(&root).ok();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A prefill table of `tiling` over `rows` (point, our graph us), as the bench prints it.
fn prefill_log(tiling: &str, rows: &[(&str, f64)]) -> String {
    let mut log = format!(
        "\nprefill bf16 d128 bs16 tiling {tiling}, one sequence, causal; TFLOP/s of the causal region at the graph time\n"
    );
    log += &prefill_header();
    log += "\n";
    for (p, us) in rows {
        let p: PrefillPoint = p.parse().unwrap();
        log += &prefill_row(&p, S, &t(*us), None);
        log += "\n";
    }
    log
}

/// The header cells of the table titled `title`.
fn header_of(text: &str, title: &str) -> Vec<String> {
    let mut lines = text.lines().skip_while(|l| !l.contains(title));
    let head = lines
        .find(|l| l.starts_with("| point"))
        .unwrap_or_else(|| panic!("no table {title}:\n{text}"));
    head.trim_matches('|')
        .split('|')
        .map(|c| c.trim().to_string())
        .collect()
}

/// A device call's ncu-* stages run the bench under the profiler (one launch per timing, every
/// kernel replayed per section): their tables are not figures, yet they were read as columns
/// (a decode column 6x over SDPA), and a profiled prefill tiling's column had the same label as
/// the measured one (`Wgmma128 | Wgmma128`), telling them apart impossible.
#[test]
fn gpu_tables_leaves_out_profiled_runs() {
    let bench = prefill_log("Auto", &[("32:8/2048+0", 123.1)])
        + &prefill_log("Wgmma128", &[("32:8/2048+0", 123.6)]);
    let ncu = "==PROF== Connected to process 1755\n".to_string()
        + &prefill_log("Wgmma128", &[("32:8/2048+0", 146.1)]);
    let text = tables_of_folders(
        "ncu",
        &[&[
            ("bench-prefill-d128", bench),
            ("ncu-prefill-wgmma128-32_8_2048_0", ncu),
        ]],
    );
    assert!(
        !text.contains("146.1"),
        "a profiled run read as a figure:\n{text}"
    );
    let head = header_of(&text, "Prefill d128");
    assert_eq!(
        head.iter().filter(|c| *c == "Wgmma128").count(),
        1,
        "{text}"
    );
}

/// Two calls' logs side by side (before and after a change): each column says which call it
/// came from (both calls name their stage bench-decode, so the columns were indistinguishable).
#[test]
fn gpu_tables_columns_of_two_calls_differ() {
    let decode = |us: f64| {
        let p: DecodePoint = "32:8/1x4096".parse().unwrap();
        format!(
            "decode bf16 d128 bs16 mode Auto; times per call; GB/s of K/V + q + out bytes at the graph time\n{}\n{}\n",
            decode_header(),
            decode_row(&p, S, &t(us), Some(&t(13.0)), 3000.0)
        )
    };
    let text = tables_of_folders(
        "two",
        &[
            &[("bench-decode", decode(18.9))],
            &[("bench-decode", decode(16.2))],
        ],
    );
    let head = header_of(&text, "Decode d128");
    let cols = &head[1..head.len() - 2]; // point | columns... | SDPA | fastest
    assert_eq!(cols.len(), 2, "{text}");
    assert_ne!(
        cols[0], cols[1],
        "two calls' columns share a label:\n{text}"
    );
}

/// A point whose output the bench found wrong (`CHECK FAILED ...` under its row, the bench's
/// exit status 1) was tabulated like any other: its time, its ratio over SDPA, and named the
/// fastest of a sweep, with nothing in the table saying the kernel computed something else.
#[test]
fn gpu_tables_marks_a_failed_check() {
    let p: DecodePoint = "32:8/1x4096".parse().unwrap();
    let decode = |splits: u32, us: f64, failed: bool| {
        format!(
            "decode bf16 d128 bs16 mode Splits({splits}); times per call; GB/s of K/V + q + out bytes at the graph time\n{}\n{}\n{}",
            decode_header(),
            decode_row(&p, S, &t(us), None, 3000.0),
            if failed {
                "CHECK FAILED decode 32:8/1x4096: element 7: kernel 0.5 vs CPU 0.25\n"
            } else {
                "                  (checked against the CPU oracle: max |err| 1.00e-3)\n"
            }
        )
    };
    let mut prefill = prefill_log("Wgmma128", &[("32:8/512+0", 20.0)]);
    prefill += "CHECK FAILED prefill 32:8/512+0 Wgmma128: element 0: kernel NaN vs CPU 0.1\n";
    let text = tables_of_folders(
        "failed",
        &[&[
            ("sweep-splits-16", decode(16, 10.0, true)),
            ("sweep-splits-33", decode(33, 12.0, false)),
            ("bench-prefill-d128", prefill),
        ]],
    );
    let row = row_of(&text, "32:8/1x4096");
    assert!(row[1].contains("FAILED"), "{text}");
    assert!(!row[2].contains("FAILED"), "{text}");
    assert_eq!(
        row.last().unwrap(),
        "sweep-splits-33 Splits(33)",
        "a wrong kernel named the fastest:\n{text}"
    );
    let row = row_of(&text, "32:8/512+0");
    assert!(row[3].contains("FAILED"), "{text}");
}
