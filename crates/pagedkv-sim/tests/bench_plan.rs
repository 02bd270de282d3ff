//! The host side of `pagedkv bench gpu` (pagedkv_sim::gpu_bench), without a GPU: the grids of
//! issue 15, the bytes and causal FLOPs each point is credited with (checked against sums done
//! the long way), the L2 rotation rule, parsing the dense peer's output, and the table rows.

use pagedkv_sim::gpu_bench::*;

const BF16_D128: Shape = Shape {
    head_dim: 128,
    elem_bytes: 2,
};
const MIB: u64 = 1 << 20;

fn heads(q: usize, kv: usize) -> Heads {
    Heads { query: q, kv }
}

#[test]
fn default_grids_are_the_issues() {
    let d = default_decode_grid();
    let names: Vec<String> = d.iter().map(ToString::to_string).collect();
    assert_eq!(
        names,
        [
            "32:8/1x512",
            "32:8/1x4096",
            "32:8/1x32768",
            "32:8/8x4096",
            "32:8/64x4096",
            "32:8/64x32768",
            "32:32/1x512",
            "32:32/1x4096",
            "32:32/1x32768",
            "32:32/8x4096",
            "32:32/64x4096",
            "32:32/64x32768",
        ]
    );
    let p = default_prefill_grid();
    assert_eq!(p.len(), 12);
    for h in GRID_HEADS {
        for chunk in [512, 2048] {
            for cached in [0, 4096, 32768] {
                assert!(p.contains(&PrefillPoint {
                    heads: h,
                    chunk,
                    cached
                }));
            }
        }
    }
}

#[test]
fn points_round_trip_and_bad_ones_are_refused() {
    for p in default_decode_grid() {
        assert_eq!(p.to_string().parse::<DecodePoint>(), Ok(p));
    }
    for p in default_prefill_grid() {
        assert_eq!(p.to_string().parse::<PrefillPoint>(), Ok(p));
    }
    let list: Vec<DecodePoint> = parse_points("32:8/1x512, 8:1/3x7").unwrap();
    assert_eq!(
        list[1],
        DecodePoint {
            heads: heads(8, 1),
            batch: 3,
            ctx: 7
        }
    );
    for bad in [
        "32:8",
        "32:8/0x512",
        "32:8/1x",
        "32:7/1x512",
        "0:8/1x1",
        "32:0/1x1",
        "a:b/1x1",
        "",
    ] {
        assert!(
            matches!(bad.parse::<DecodePoint>(), Err(PlanError::BadPoint { .. })),
            "{bad:?} accepted"
        );
    }
    assert_eq!(
        "32:8/512+0".parse::<PrefillPoint>().map(|p| p.cached),
        Ok(0)
    );
    for bad in ["32:8/0+4096", "32:8/512", "32:8/512+-1", "32:8/x+1"] {
        assert!(bad.parse::<PrefillPoint>().is_err(), "{bad:?} accepted");
    }
    assert!(parse_points::<DecodePoint>("32:8/1x512,,32:8/1x4096").is_err());
}

#[test]
fn decode_bytes_count_each_kv_byte_once_per_kv_head() {
    // 64 x 4096 GQA 32:8 bf16 d128: 64*4096 tokens x 8 heads x 128 x (K+V) x 2 bytes.
    let p = DecodePoint {
        heads: heads(32, 8),
        batch: 64,
        ctx: 4096,
    };
    assert_eq!(p.kv_bytes(BF16_D128), 64 * 4096 * 8 * 128 * 2 * 2);
    assert_eq!(p.kv_bytes(BF16_D128), 1_073_741_824);
    assert_eq!(p.io_bytes(BF16_D128), 2 * 64 * 32 * 128 * 2);
    assert_eq!(
        p.bytes(BF16_D128),
        p.kv_bytes(BF16_D128) + p.io_bytes(BF16_D128)
    );
    // MHA reads 4x the KV of GQA 32:8 for the same query heads.
    let mha = DecodePoint {
        heads: heads(32, 32),
        ..p
    };
    assert_eq!(mha.kv_bytes(BF16_D128), 4 * p.kv_bytes(BF16_D128));
    assert_eq!(p.flops(BF16_D128), 4.0 * 64.0 * 32.0 * 4096.0 * 128.0);
}

#[test]
fn prefill_flops_are_the_causal_region() {
    for p in default_prefill_grid().into_iter().chain([PrefillPoint {
        heads: heads(4, 2),
        chunk: 3,
        cached: 5,
    }]) {
        // Count pairs the long way: query i at position cached + i sees keys 0..=cached + i.
        let pairs: u64 = (0..p.chunk).map(|i| (p.cached + i + 1) as u64).sum();
        assert_eq!(p.causal_pairs(), pairs, "{p}");
        let flops = 4.0 * pairs as f64 * (p.heads.query * 128) as f64;
        assert_eq!(p.flops(BF16_D128), flops, "{p}");
        assert_eq!(p.context(), p.cached + p.chunk);
        assert_eq!(
            p.kv_bytes(BF16_D128),
            (p.context() * p.heads.kv * 128 * 4) as u64
        );
    }
    // Without cached tokens a chunk of n is n(n+1)/2 pairs: a 2048 chunk at 32 heads d128 is
    // 4 * 2098176 * 4096 FLOPs.
    let p = PrefillPoint {
        heads: heads(32, 8),
        chunk: 2048,
        cached: 0,
    };
    assert_eq!(p.causal_pairs(), 2048 * 2049 / 2);
    assert_eq!(p.flops(BF16_D128), 4.0 * 2_098_176.0 * 4096.0);
}

#[test]
fn rotation_spans_three_l2s_within_budget() {
    let l2 = 50 * MIB;
    // 2 MiB of inputs: 75 copies (150 MiB >= 3 x 50 MiB, 74 would be 148 MiB).
    assert_eq!(rotation_copies(2 * MIB, l2, 1 << 40), 75);
    assert!(75 * 2 * MIB >= L2_MULTIPLE * l2 && 74 * 2 * MIB < L2_MULTIPLE * l2);
    // At or above 3 x L2: one copy.
    assert_eq!(rotation_copies(150 * MIB, l2, 1 << 40), 1);
    assert_eq!(rotation_copies(1 << 34, l2, 1 << 40), 1);
    // Just under: two.
    assert_eq!(rotation_copies(150 * MIB - 1, l2, 1 << 40), 2);
    // Tiny inputs are capped; zero-byte inputs do not divide by zero.
    assert_eq!(rotation_copies(1024, l2, 1 << 40), MAX_COPIES);
    assert_eq!(rotation_copies(0, l2, 1 << 40), MAX_COPIES);
    // The memory budget caps it, but never below one copy.
    assert_eq!(rotation_copies(2 * MIB, l2, 20 * MIB), 10);
    assert_eq!(rotation_copies(2 * MIB, l2, MIB), 1);
    // `--l2-bytes` past u64::MAX / 3: the most copies (the peer's exact rule), not the one
    // copy a wrapped `3 x l2` (2 bytes) asked for.
    assert_eq!(rotation_copies(1024, u64::MAX / 3 + 1, 1 << 40), MAX_COPIES);
    // Every point of the default decode grid on an H100: small points rotate, large do not.
    let budget = 64 << 30;
    let copies: Vec<usize> = default_decode_grid()
        .iter()
        .map(|p| rotation_copies(p.bytes(BF16_D128), l2, budget))
        .collect();
    assert_eq!(copies, [75, 10, 2, 2, 1, 1, 19, 3, 1, 1, 1, 1]);
}

#[test]
fn launches_cover_whole_rotations() {
    assert_eq!(launches(20, 1), 20);
    assert_eq!(launches(20, 75), 75);
    assert_eq!(launches(20, 3), 21);
    assert_eq!(launches(20, 10), 20);
    assert_eq!(launches(0, 0), 1);
    // `--launches` near `usize::MAX`: the most whole rotations, not a wrapped handful.
    assert_eq!(launches(usize::MAX, 75), usize::MAX / 75 * 75);
    assert_eq!(launches(usize::MAX, 1), usize::MAX);
    for c in 1..100 {
        let n = launches(20, c);
        assert!(n >= 20 && n >= c && n % c == 0 && n < 20 + c, "{c}: {n}");
    }
}

#[test]
fn median_and_rates() {
    assert_eq!(median(&mut []), None);
    assert_eq!(median(&mut [3.0, 1.0, 2.0]), Some(2.0));
    assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), Some(3.0));
    // 1 GiB in 354 us is 3.03 TB/s (the issue's dense figure at 64 x 4096).
    let bw = gbps(1_073_741_824.0, 354.0);
    assert!((bw - 3033.2).abs() < 0.1, "{bw}");
    // 1e12 FLOPs in 1e6 us is 1 TFLOP/s.
    assert_eq!(tflops(1e12, 1e6), 1.0);
}

const PEER: &str = r#"
device: NVIDIA H100 80GB HBM3 (a banner line the parser skips)
{"kind": "device", "name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "d2d_gbps": 2989.5}
{"kind": "decode", "point": "32:8/64x4096", "graph_us": 354.0, "b2b_us": 356.5, "one_us": 390.0, "copies": 1}
{"kind": "prefill", "point": "32:8/2048+4096", "graph_us": 1000.0, "b2b_us": 1002.0, "one_us": 1040.0, "copies": 3, "note": "lower-right causal mask"}
{"kind": "skip", "point": "32:32/64x32768", "why": "needs 70.0 GiB"}
"#;

#[test]
fn peer_output_parses() {
    let r = parse_peer(PEER).unwrap();
    assert_eq!(
        r.device.as_deref(),
        Some("NVIDIA H100 80GB HBM3, torch 2.11.0")
    );
    assert_eq!(r.d2d_gbps, Some(2989.5));
    let p: DecodePoint = "32:8/64x4096".parse().unwrap();
    assert_eq!(
        r.decode.get(&p),
        Some(&Outcome::Timed(Timing {
            graph_us: 354.0,
            b2b_us: 356.5,
            one_us: 390.0,
            copies: 1
        }))
    );
    let q: PrefillPoint = "32:8/2048+4096".parse().unwrap();
    assert!(matches!(r.prefill.get(&q), Some(Outcome::Timed(t)) if t.copies == 3));
    assert_eq!(r.notes, ["32:8/2048+4096: lower-right causal mask"]);
    let s: DecodePoint = "32:32/64x32768".parse().unwrap();
    assert_eq!(
        r.decode.get(&s),
        Some(&Outcome::Skipped("needs 70.0 GiB".into()))
    );
}

#[test]
fn bad_peer_lines_are_refused_with_their_line() {
    for (text, line) in [
        ("{\"kind\": \"decode\", \"point\": \"32:8/1x512\"}", 1),
        ("\n{\"kind\": \"bogus\"}", 2),
        ("{not json", 1),
        (
            "{\"kind\": \"decode\", \"point\": \"32:8\", \"graph_us\": 1, \"b2b_us\": 1, \"one_us\": 1, \"copies\": 1}",
            1,
        ),
        ("{\"kind\": \"skip\", \"point\": \"?\", \"why\": \"x\"}", 1),
    ] {
        match parse_peer(text) {
            Err(PlanError::BadPeerLine { line: l, .. }) => assert_eq!(l, line, "{text}"),
            other => panic!("{text}: {other:?}"),
        }
    }
}

#[test]
fn rows_show_both_sides_and_the_ratio() {
    let p: DecodePoint = "32:8/64x4096".parse().unwrap();
    let ours = Outcome::Timed(Timing {
        graph_us: 708.0,
        b2b_us: 710.0,
        one_us: 760.0,
        copies: 1,
    });
    let peer = parse_peer(PEER).unwrap();
    let row = decode_row(&p, BF16_D128, &ours, peer.decode.get(&p), 2989.0);
    // pagedkv: 1 GiB + 1 MiB of io in 708 us = 1518 GB/s = 50.8% of 2989; SDPA 3036 GB/s; 2.00x.
    for want in [
        "32:8/64x4096",
        "708.0",
        "710.0",
        "760.0",
        "1518.1",
        "50.8%",
        "354.0",
        "3036.1",
        "2.00x",
    ] {
        assert!(row.contains(want), "{want:?} missing from {row:?}");
    }
    let none = decode_row(&p, BF16_D128, &ours, None, 2989.0);
    assert!(
        none.contains("not run") && none.trim_end().ends_with('-'),
        "{none}"
    );
    let skipped = decode_row(
        &p,
        BF16_D128,
        &Outcome::Skipped("too big".into()),
        None,
        2989.0,
    );
    assert!(skipped.contains("skipped: too big"), "{skipped}");
    // Every row lines up under the header.
    let header = decode_header();
    let width = header.lines().next().unwrap().len();
    assert_eq!(header.lines().nth(1).unwrap().len(), width);
    assert_eq!(row.len(), width, "{row}\n{header}");

    let q: PrefillPoint = "32:8/2048+4096".parse().unwrap();
    let ours = Outcome::Timed(Timing {
        graph_us: 1250.0,
        b2b_us: 1260.0,
        one_us: 1300.0,
        copies: 3,
    });
    let row = prefill_row(&q, BF16_D128, &ours, peer.prefill.get(&q));
    let flops = q.flops(BF16_D128);
    let (mine, theirs) = (tflops(flops, 1250.0), tflops(flops, 1000.0));
    for want in [
        format!("{mine:.1}"),
        format!("{theirs:.1}"),
        "80.0%".to_string(),
        "1250.0".to_string(),
    ] {
        assert!(row.contains(&want), "{want:?} missing from {row:?}");
    }
    let header = prefill_header();
    assert_eq!(
        row.len(),
        header.lines().next().unwrap().len(),
        "{row}\n{header}"
    );
}

/// The Python peer's accounting (`--plan`: no torch, no GPU) is the same as this crate's on the
/// default grids: same bytes, FLOPs and rotation copies per point. Skipped, saying so, where no
/// `python3` runs.
#[test]
fn python_peer_accounts_the_same_way() {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../benches/gpu_sdpa_baseline.py"
    );
    let (l2, budget) = (50 * MIB, 64u64 << 30);
    let out = match std::process::Command::new("python3")
        .args([script, "--plan"])
        .arg(format!("--l2-bytes={l2}"))
        .arg(format!("--budget-bytes={budget}"))
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            eprintln!("SKIP python_peer_accounts_the_same_way: cannot run python3 ({e})");
            return;
        }
    };
    assert!(
        out.status.success(),
        "{script} --plan failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let recs: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let ours: Vec<(String, u64, f64, usize)> = default_decode_grid()
        .iter()
        .map(|p| {
            let b = p.bytes(BF16_D128);
            (
                p.to_string(),
                b,
                p.flops(BF16_D128),
                rotation_copies(b, l2, budget),
            )
        })
        .chain(default_prefill_grid().iter().map(|p| {
            let b = p.bytes(BF16_D128);
            (
                p.to_string(),
                b,
                p.flops(BF16_D128),
                rotation_copies(b, l2, budget),
            )
        }))
        .collect();
    assert_eq!(recs.len(), ours.len(), "{text}");
    for (r, (point, bytes, flops, copies)) in recs.iter().zip(&ours) {
        assert_eq!(r["point"].as_str(), Some(point.as_str()), "{r}");
        assert_eq!(r["bytes"].as_u64(), Some(*bytes), "{r}");
        assert_eq!(r["flops"].as_f64(), Some(*flops), "{r}");
        assert_eq!(r["copies"].as_u64(), Some(*copies as u64), "{r}");
    }
}

/// A peer that fails part way (an exception at a later point, a crash in the profiler, a
/// kill) keeps the points it timed before: `bench gpu` showed no SDPA column at all for any
/// non-zero exit, losing every point the peer had already timed.
#[test]
fn a_peer_that_failed_keeps_the_points_it_timed() {
    // Cut inside the skip record: the process ended mid-write.
    let cut = PEER.find(r#"{"kind": "skip""#).unwrap() + 20;
    let r = peer_results(false, "signal: 11 (SIGSEGV)", &PEER[..cut]).unwrap();
    let p: DecodePoint = "32:8/64x4096".parse().unwrap();
    let q: PrefillPoint = "32:8/2048+4096".parse().unwrap();
    assert!(matches!(r.decode.get(&p), Some(Outcome::Timed(_))));
    assert!(matches!(r.prefill.get(&q), Some(Outcome::Timed(_))));
    assert_eq!(r.decode.len() + r.prefill.len(), 2);
    assert!(
        r.notes
            .iter()
            .any(|n| n.contains("failed (signal: 11 (SIGSEGV))")),
        "{:?}",
        r.notes
    );
    // Nothing timed before the failure: no results, and why.
    let device_only = &PEER[..PEER.find(r#"{"kind": "decode""#).unwrap()];
    let e = peer_results(false, "exit status: 1", device_only).unwrap_err();
    assert!(e.contains("exit status: 1"), "{e}");
    // A peer that succeeded parses as before; a bad record is still refused.
    let ok = peer_results(true, "exit status: 0", PEER).unwrap();
    assert_eq!(ok.decode.len() + ok.prefill.len(), 3);
    assert!(ok.notes.iter().all(|n| !n.contains("failed")));
    assert!(peer_results(true, "exit status: 0", "{\"kind\": \"decode\"}\n").is_err());
}

/// Counts past i32 are refused when a point is parsed (the bench hands them to the kernels as
/// i32: `ctx as i32` truncated a context of 2^32 + 1 to 1), and the byte and FLOP counts of a
/// point too large to count saturate instead of wrapping: `32:8/4294967296x4294967296` parsed,
/// its K/V bytes wrapped to 0 in a release build, and the wrapped total passed the budget check
/// before a batch-long allocation.
#[test]
fn huge_points_are_refused_and_their_sizes_do_not_wrap() {
    for bad in [
        "32:8/4294967296x4294967296",
        "32:8/1x2147483648",
        "32:8/2147483648x1",
        "4294967296:1/1x1",
    ] {
        assert!(
            matches!(bad.parse::<DecodePoint>(), Err(PlanError::BadPoint { .. })),
            "{bad} accepted"
        );
    }
    let max = i32::MAX as usize;
    assert_eq!(
        "32:8/1x2147483647".parse::<DecodePoint>().map(|p| p.ctx),
        Ok(max)
    );
    for bad in [
        "32:8/2147483648+0",
        "32:8/1+2147483647",
        "32:8/2048+18446744073709551615",
    ] {
        assert!(
            matches!(bad.parse::<PrefillPoint>(), Err(PlanError::BadPoint { .. })),
            "{bad} accepted"
        );
    }
    assert_eq!(
        "32:8/1+2147483646"
            .parse::<PrefillPoint>()
            .map(|p| p.context()),
        Ok(max)
    );
    // Built by hand (the fields are public): 2^32 x 2^32 tokens.
    let p = DecodePoint {
        heads: heads(32, 8),
        batch: 1 << 32,
        ctx: 1 << 32,
    };
    assert_eq!(p.kv_bytes(BF16_D128), u64::MAX);
    assert_eq!(p.bytes(BF16_D128), u64::MAX);
    assert!(p.flops(BF16_D128) > 1e23, "{}", p.flops(BF16_D128));
    let p = PrefillPoint {
        heads: heads(32, 8),
        chunk: 1 << 33,
        cached: usize::MAX - 1,
    };
    assert_eq!(p.context(), usize::MAX);
    assert_eq!(p.causal_pairs(), u64::MAX);
    assert_eq!(p.bytes(BF16_D128), u64::MAX);
    assert!(p.flops(BF16_D128) > 1e23, "{}", p.flops(BF16_D128));
}

/// `bench gpu --device N` ran its side on device N and the peer on device 0 (the peer was never
/// told, and the script had no way to be): the two columns of one row came from two GPUs. The
/// peer's command line now names the device, and the script takes every argument the bench
/// passes (its `--plan` parses them all, no GPU needed). Skipped, saying so, where no `python3`
/// runs.
#[test]
fn the_peer_takes_every_argument_the_bench_passes() {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../benches/gpu_sdpa_baseline.py"
    );
    let decode: Vec<DecodePoint> = parse_points("32:8/1x512,32:32/8x4096").unwrap();
    let prefill: Vec<PrefillPoint> = parse_points("32:8/512+4096").unwrap();
    let base = PeerArgs {
        device: 1,
        decode: &decode,
        prefill: &prefill,
        head_dim: 128,
        l2_bytes: 50 * MIB,
        min_launches: 20,
        reps: 5,
        one_call_iters: 20,
        warmup: 3,
    };
    let args = base.to_args();
    assert!(args.contains(&"--device=1".to_string()), "{args:?}");
    let out = match std::process::Command::new("python3")
        .arg(script)
        .args(&args)
        .arg("--plan")
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            eprintln!("SKIP the_peer_takes_every_argument_the_bench_passes: no python3 ({e})");
            return;
        }
    };
    assert!(
        out.status.success(),
        "{script} refused the bench's arguments {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let points: Vec<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let r: serde_json::Value = serde_json::from_str(l).unwrap();
            r["point"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(
        points,
        ["32:8/1x512", "32:32/8x4096", "32:8/512+4096"],
        "{args:?}"
    );
    // No points on one side: an empty list, which the peer reads as none.
    let none = PeerArgs {
        decode: &[],
        ..base
    }
    .to_args();
    let out = std::process::Command::new("python3")
        .arg(script)
        .args(&none)
        .arg("--plan")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout).unwrap().lines().count(), 1);
}
