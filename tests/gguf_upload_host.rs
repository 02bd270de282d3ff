//! The staged upload ([`StagingRing`]) on the host copy engine ([`HostEngine`]: host memory
//! for device memory, a worker thread with random delays for the stream), no GPU needed.
//!
//! GGUF files written with `GgufWriter` — tiny tensors that share a buffer, tensors exactly one
//! or two buffers long, tensors spanning many buffers, sizes that are multiples of nothing —
//! go up through rings of 1 to 16 buffers of 7 bytes to 4 KiB, filled on the calling thread or
//! by 1 to 8 fill threads (fills then finish, and are queued, out of order). Every destination
//! byte must equal the file's; progress must count only completed bytes (checked against the
//! stream's own count), rise in planned order, cover each tensor exactly and end at the total;
//! tensors go largest first, ties in file order. Injected failures at every call of every
//! engine operation, a fill that panics on a fill thread, and a panicking progress callback,
//! must leave a ring that keeps all its buffers (every one freed when it drops), is correct
//! when reused, and never rewrites or frees a staging buffer under a pending copy (the engine
//! records every such breach as a [`Violation`]). The engine's own checks are tested too:
//! breaking the contract on purpose must be flagged and must show in the bytes.

use pagedkv::gguf::upload::UploadError;
use pagedkv::gguf::upload::UploadProgress;
use pagedkv::gguf::upload::{
    CopyEngine, HostConfig, HostEngine, HostFault, HostOp, HostProbe, StagingRing, Violation,
    HOST_DST_POISON,
};
use pagedkv::gguf::{GgmlType, Gguf, GgufWriter};
use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};
use std::num::NonZeroUsize;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

fn nz(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n).expect("non-zero")
}

/// A GGUF file of tensors `(type, shape)` named `t0, t1, ...`, random bytes.
fn file_of(specs: &[(GgmlType, Vec<u64>)], seed: u64) -> Vec<u8> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let data: Vec<Vec<u8>> = specs
        .iter()
        .map(|(ty, shape)| {
            let n = ty.bytes_for(shape.iter().product()).expect("size") as usize;
            let mut v = vec![0u8; n];
            rng.fill_bytes(&mut v);
            v
        })
        .collect();
    let mut w = GgufWriter::new();
    for (i, ((ty, shape), d)) in specs.iter().zip(&data).enumerate() {
        w.add_tensor(&format!("t{i}"), *ty, shape, d).expect("add");
    }
    w.to_bytes().expect("write")
}

/// A GGUF file of I8 tensors of these byte sizes.
fn file_of_sizes(sizes: &[usize], seed: u64) -> Vec<u8> {
    let specs: Vec<(GgmlType, Vec<u64>)> = sizes
        .iter()
        .map(|&n| (GgmlType::I8, vec![n as u64]))
        .collect();
    file_of(&specs, seed)
}

/// Sizes around a staging buffer of `s` bytes: exactly one and two buffers, many buffers and
/// a bit, one short and one over, half, and twenty tiny tensors that share buffers.
fn sizes_around(s: usize) -> Vec<usize> {
    let mut v = vec![s, 2 * s, 7 * s + 3, s + 1, s / 2 + 1, 3 * s / 2];
    if s > 1 {
        v.push(s - 1);
    }
    v.extend((0..20).map(|i| 1 + (i * 7) % 13));
    v
}

fn ring(
    buffers: usize,
    staging: usize,
    config: HostConfig,
) -> (StagingRing<HostEngine>, HostProbe) {
    ring_with(buffers, staging, 1, config)
}

fn ring_with(
    buffers: usize,
    staging: usize,
    threads: usize,
    config: HostConfig,
) -> (StagingRing<HostEngine>, HostProbe) {
    let e = HostEngine::new(config);
    let probe = e.probe();
    let mut r = StagingRing::new(e, nz(buffers), nz(staging)).expect("ring");
    r.set_fill_threads(threads);
    assert_eq!(r.fill_threads(), threads);
    (r, probe)
}

/// Drops the ring and checks that it freed every buffer and saw no breach.
fn drop_clean(r: StagingRing<HostEngine>, probe: &HostProbe, what: &str) {
    drop(r);
    assert_eq!(probe.violations(), Vec::<Violation>::new(), "{what}");
    assert_eq!(probe.live_staging(), 0, "{what}: buffers leaked");
}

/// Copies and fills each wait up to `max_us` microseconds (fills on fill threads then finish
/// out of order).
fn delays(max_us: u64, seed: u64) -> HostConfig {
    HostConfig {
        max_delay: Duration::from_micros(max_us),
        max_fill_delay: Duration::from_micros(max_us),
        seed,
        fault: None,
    }
}

/// Queue order worked out independently of the library: largest first, ties in file order.
fn expected_order(g: &Gguf<'_>) -> Vec<String> {
    let mut v: Vec<(usize, usize, &str)> = g
        .tensors()
        .iter()
        .enumerate()
        .map(|(i, t)| (t.n_bytes(), i, t.name()))
        .collect();
    v.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    v.into_iter().map(|(_, _, n)| n.to_owned()).collect()
}

/// Uploads `g` through `ring`; checks progress against the stream's own count of copied bytes
/// and against queue order, then every destination byte and the violation log.
fn round_trip(ring: &mut StagingRing<HostEngine>, probe: &HostProbe, g: &Gguf<'_>) {
    let total = g.total_tensor_bytes();
    // Copies of an earlier, failed upload may still be running: they only make this laxer.
    let base = probe.bytes_copied();
    let mut seen: Vec<(u64, String)> = Vec::new();
    let out = ring
        .upload(g, |p: UploadProgress<'_>| {
            assert_eq!(p.total, total);
            let copied = probe.bytes_copied() - base;
            assert!(
                copied >= p.done,
                "progress reports {} bytes done, the stream has copied {copied}",
                p.done
            );
            seen.push((p.done, p.tensor.to_owned()));
        })
        .expect("upload");
    let order = expected_order(g);
    // Progress: strictly rising to the total; the pieces, in the order reported, are the
    // tensors in queue order, each covered exactly.
    assert!(
        seen.windows(2).all(|w| w[0].0 < w[1].0),
        "progress not rising"
    );
    assert_eq!(seen.last().map(|s| s.0), Some(total).filter(|&t| t > 0));
    let mut per_tensor: Vec<(String, u64)> = Vec::new();
    let mut prev = 0;
    for (done, name) in &seen {
        match per_tensor.last_mut() {
            Some((n, b)) if n == name => *b += done - prev,
            _ => per_tensor.push((name.clone(), done - prev)),
        }
        prev = *done;
    }
    let names: Vec<&str> = per_tensor.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, order, "progress not in queue order");
    for (name, bytes) in &per_tensor {
        let t = g.tensor(name).expect("tensor");
        assert_eq!(
            *bytes,
            t.n_bytes() as u64,
            "{name}: progress covers it wrongly"
        );
    }
    // Contents, in queue order.
    assert_eq!(out.len(), g.tensors().len());
    let out_names: Vec<&str> = out.iter().map(|(t, _)| t.name()).collect();
    assert_eq!(out_names, order);
    for (t, d) in &out {
        let back = d.to_vec();
        if back != t.data() {
            let wrong = back.iter().zip(t.data()).filter(|(a, b)| a != b).count();
            let never = back
                .iter()
                .zip(t.data())
                .filter(|&(&a, &b)| a == HOST_DST_POISON && b != HOST_DST_POISON)
                .count();
            panic!(
                "{}: {wrong} of {} bytes wrong ({never} still hold the never-copied poison); \
                 engine saw {} contract violations",
                t.name(),
                back.len(),
                probe.violations().len()
            );
        }
    }
    assert_eq!(probe.violations(), Vec::<Violation>::new());
}

#[test]
fn every_byte_arrives_in_queue_order_under_many_ring_shapes() {
    let shapes = [
        (2, 64),
        (3, 100),
        (4, 4096),
        (16, 1000),
        (2, 7),
        (5, 333),
        (8, 4096),
        (1, 256),
    ];
    let mut overtaken = 0;
    for (i, &(buffers, staging)) in shapes.iter().enumerate() {
        for (max_us, threads) in [(0, 0), (40, 1), (40, 3), (0, 8)] {
            let seed = (i as u64) << 8 | max_us << 4 | threads as u64;
            let a = file_of_sizes(&sizes_around(staging), seed);
            let b = file_of_sizes(&sizes_around(staging + 5), seed + 1);
            let (ga, gb) = (
                Gguf::parse(&a).expect("parse"),
                Gguf::parse(&b).expect("parse"),
            );
            let (mut r, probe) = ring_with(buffers, staging, threads, delays(max_us, seed));
            // One ring, three uploads: later ones reuse buffers the stream just read.
            round_trip(&mut r, &probe, &ga);
            round_trip(&mut r, &probe, &gb);
            round_trip(&mut r, &probe, &ga);
            let st = r.last_stats();
            assert_eq!(st.threads, threads);
            assert!(st.fills > 0);
            if threads < 2 {
                assert_eq!(st.out_of_order, 0, "one filler cannot overtake itself");
            }
            overtaken += st.out_of_order;
            drop_clean(
                r,
                &probe,
                &format!("{buffers} x {staging}, {threads} threads"),
            );
        }
    }
    // The shapes with several buffers and fill threads, random fill times: some fills must
    // have been queued before an earlier one, or the out-of-order path went untested.
    assert!(overtaken > 0, "no fill ever overtook another");
}

#[test]
fn quantized_and_multi_dimensional_tensors_round_trip() {
    let mut specs = vec![
        (GgmlType::F32, vec![64, 33]),
        (GgmlType::Q8_0, vec![256, 9]),
        (GgmlType::Q4_K, vec![256, 5]),
        (GgmlType::F16, vec![33, 17]),
        (GgmlType::BF16, vec![5, 7, 3, 2]),
    ];
    specs.extend((0..12).map(|i| (GgmlType::F32, vec![1 + i * 5])));
    let bytes = file_of(&specs, 3);
    let g = Gguf::parse(&bytes).expect("parse");
    for (buffers, staging, threads) in [(2, 1024, 0), (3, 4099, 2), (6, 512, 4)] {
        let (mut r, probe) = ring_with(buffers, staging, threads, delays(20, 9));
        round_trip(&mut r, &probe, &g);
    }
}

#[test]
fn ties_go_in_file_order() {
    // Sizes with ties, not sorted in the file.
    let bytes = file_of_sizes(&[10, 300, 10, 300, 7, 10, 300], 5);
    let g = Gguf::parse(&bytes).expect("parse");
    let (mut r, probe) = ring(2, 64, delays(10, 5));
    let out = r.upload(&g, |_| {}).expect("upload");
    let names: Vec<&str> = out.iter().map(|(t, _)| t.name()).collect();
    assert_eq!(names, ["t1", "t3", "t6", "t0", "t2", "t5", "t4"]);
    round_trip(&mut r, &probe, &g);
}

#[test]
fn a_file_without_tensors_uploads_nothing() {
    let bytes = file_of_sizes(&[], 0);
    let g = Gguf::parse(&bytes).expect("parse");
    let (mut r, probe) = ring(2, 64, HostConfig::default());
    let mut calls = 0;
    let out = r.upload(&g, |_| calls += 1).expect("upload");
    assert!(out.is_empty());
    assert_eq!(calls, 0);
    assert_eq!(probe.bytes_copied(), 0);
}

/// Upload through a ring of 3 buffers of 128 bytes: about 25 pieces.
fn sweep_file() -> Vec<u8> {
    file_of_sizes(&[300, 301, 50, 7, 7, 1, 128, 900, 256, 3], 11)
}

/// Injects a failure at call `call` of `op` for every call an upload makes (and one past);
/// after each failure the ring is either dropped at once (copies may still be pending) or
/// reused; neither may rewrite or free a buffer under a copy, and the reuse must be exact.
fn fault_sweep(op: HostOp, name: &'static str) {
    let bytes = sweep_file();
    let g = Gguf::parse(&bytes).expect("parse");
    for threads in [0, 2] {
        let (mut failed, mut succeeded) = (0, 0);
        for call in 0..80u64 {
            let config = HostConfig {
                fault: Some(HostFault { op, call }),
                ..delays(30, call)
            };
            let e = HostEngine::new(config);
            let probe = e.probe();
            let mut r = match StagingRing::new(e, nz(3), nz(128)) {
                Ok(r) => r,
                Err(err) => {
                    assert_eq!(op, HostOp::StagingAlloc);
                    assert_eq!(err, UploadError::Injected { op: name, call });
                    assert_eq!(probe.violations(), Vec::<Violation>::new());
                    assert_eq!(probe.live_staging(), 0, "buffers of a failed new() freed");
                    failed += 1;
                    continue;
                }
            };
            r.set_fill_threads(threads);
            let what = format!("{name} failing at call {call}, {threads} fill threads");
            match r.upload(&g, |_| {}) {
                Ok(out) => {
                    succeeded += 1;
                    for (t, d) in &out {
                        assert_eq!(d.to_vec(), t.data(), "{}", t.name());
                    }
                    drop(r);
                    // The fault may fire inside the drop's waits: a leak is then the right
                    // answer, a breach never is.
                    assert_eq!(probe.violations(), Vec::<Violation>::new(), "{what}");
                }
                Err(err) => {
                    failed += 1;
                    assert_eq!(err, UploadError::Injected { op: name, call }, "{what}");
                    // The fault is spent: a second upload must succeed and be exact.
                    if call % 2 == 1 {
                        round_trip(&mut r, &probe, &g);
                    }
                    // No buffer lost: the drop frees them all.
                    drop_clean(r, &probe, &what);
                }
            }
        }
        assert!(failed > 0, "{name}: no call failed");
        assert!(
            succeeded > 0,
            "{name}: the sweep did not reach past the last call"
        );
    }
}

#[test]
fn staging_allocation_failure() {
    fault_sweep(HostOp::StagingAlloc, "alloc_staging");
}

#[test]
fn destination_allocation_failure_at_every_call() {
    fault_sweep(HostOp::DstAlloc, "alloc_dst");
}

#[test]
fn copy_failure_at_every_call() {
    fault_sweep(HostOp::Copy, "copy_async");
}

#[test]
fn record_failure_at_every_call() {
    fault_sweep(HostOp::Record, "record");
}

#[test]
fn wait_failure_at_every_call() {
    fault_sweep(HostOp::Wait, "wait");
}

#[test]
fn a_fill_that_panics_on_a_fill_thread_gives_its_buffer_back() {
    let bytes = sweep_file();
    let g = Gguf::parse(&bytes).expect("parse");
    for threads in [0, 1, 3] {
        for call in [0u64, 1, 5, 11] {
            let config = HostConfig {
                fault: Some(HostFault {
                    op: HostOp::Fill,
                    call,
                }),
                ..delays(20, call)
            };
            let (mut r, probe) = ring_with(3, 128, threads, config);
            let res = catch_unwind(AssertUnwindSafe(|| r.upload(&g, |_| {})));
            let what = format!("fill #{call} panics, {threads} fill threads");
            let msg = res
                .err()
                .map(|p| p.downcast_ref::<String>().cloned().unwrap_or_default());
            assert!(
                msg.as_deref().is_some_and(|m| m.contains("injected panic")),
                "{what}: the fill's panic must reach the caller, got {msg:?}"
            );
            // Every buffer came back: the ring uploads exactly again and frees all three.
            round_trip(&mut r, &probe, &g);
            drop_clean(r, &probe, &what);
        }
    }
}

#[test]
fn failed_destination_allocation_queues_no_copy() {
    let bytes = sweep_file();
    let g = Gguf::parse(&bytes).expect("parse");
    let config = HostConfig {
        fault: Some(HostFault {
            op: HostOp::DstAlloc,
            call: 4,
        }),
        ..HostConfig::default()
    };
    let (mut r, probe) = ring(3, 128, config);
    assert!(r.upload(&g, |_| panic!("no progress expected")).is_err());
    drop(r);
    assert_eq!(probe.copies_completed(), 0);
    assert_eq!(probe.bytes_copied(), 0);
}

#[test]
fn stats_are_cleared_by_an_upload_that_fails_before_its_first_fill() {
    use pagedkv::gguf::upload::FillStats;
    let bytes = sweep_file();
    let g = Gguf::parse(&bytes).expect("parse");
    let n = g.tensors().len() as u64;
    // The second upload's first destination allocation fails.
    let config = HostConfig {
        fault: Some(HostFault {
            op: HostOp::DstAlloc,
            call: n,
        }),
        ..HostConfig::default()
    };
    let (mut r, probe) = ring_with(3, 128, 2, config);
    r.upload(&g, |_| {}).expect("first upload");
    assert!(r.last_stats().fills > 0);
    assert!(r.upload(&g, |_| {}).is_err());
    // last_stats: "all zero ... after one that failed before its first fill".
    assert_eq!(r.last_stats(), FillStats::default());
    drop_clean(r, &probe, "stats");
}

#[test]
fn stats_are_cleared_by_an_upload_that_fails_at_its_first_wait_or_copy() {
    use pagedkv::gguf::upload::FillStats;
    // One 10-byte tensor through 2 buffers: an upload makes 3 waits (one before its only fill,
    // one per buffer at the end) and 1 copy. Fail the second upload's first wait (before it
    // hands out a fill) or its only copy (before its fill is queued).
    let bytes = file_of_sizes(&[10], 5);
    let g = Gguf::parse(&bytes).expect("parse");
    for fault in [
        HostFault {
            op: HostOp::Wait,
            call: 3,
        },
        HostFault {
            op: HostOp::Copy,
            call: 1,
        },
    ] {
        let config = HostConfig {
            fault: Some(fault),
            ..HostConfig::default()
        };
        let (mut r, probe) = ring_with(2, 128, 2, config);
        r.upload(&g, |_| {}).expect("first upload");
        assert_eq!(r.last_stats().threads, 2);
        assert!(r.upload(&g, |_| {}).is_err(), "{fault:?}");
        // last_stats: "all zero ... after one that failed before its first fill".
        assert_eq!(r.last_stats(), FillStats::default(), "{fault:?}");
        drop_clean(r, &probe, "stats");
    }
}

#[test]
fn stats_are_cleared_by_an_upload_whose_first_fill_panics() {
    use pagedkv::gguf::upload::FillStats;
    // One buffer: the first fill is the only one out, so when its first piece panics no fill
    // has been queued. The panic reaches the caller; last_stats must then say what an upload
    // failing before its first fill says (all zero), not the threads it spawned for nothing.
    let bytes = sweep_file();
    let g = Gguf::parse(&bytes).expect("parse");
    for threads in [0, 2] {
        let config = HostConfig {
            fault: Some(HostFault {
                op: HostOp::Fill,
                call: 0,
            }),
            ..HostConfig::default()
        };
        let (mut r, probe) = ring_with(1, 128, threads, config);
        let res = catch_unwind(AssertUnwindSafe(|| r.upload(&g, |_| {})));
        assert!(
            res.is_err(),
            "{threads} threads: the fill's panic reaches the caller"
        );
        assert_eq!(r.last_stats(), FillStats::default(), "{threads} threads");
        // The ring is whole: the next upload is exact and reports its own fills.
        round_trip(&mut r, &probe, &g);
        assert!(r.last_stats().fills > 0);
        drop_clean(r, &probe, "stats after a panicking fill");
    }
}

#[test]
fn panicking_progress_leaves_a_safe_ring() {
    let sizes = sizes_around(100);
    let bytes = file_of_sizes(&sizes, 21);
    let g = Gguf::parse(&bytes).expect("parse");
    let total = g.total_tensor_bytes();
    for (k, stop) in [1, 150, total / 2, total - 1, total]
        .into_iter()
        .enumerate()
    {
        let (mut r, probe) = ring_with(3, 100, k % 3, delays(50, k as u64));
        let res = catch_unwind(AssertUnwindSafe(|| {
            r.upload(&g, |p| assert!(p.done < stop, "stop mid-upload"))
        }));
        assert!(res.is_err(), "the callback should have panicked");
        if k % 2 == 1 {
            round_trip(&mut r, &probe, &g);
        }
        // Dropped right after the panic: copies of later pieces may still be pending.
        drop_clean(r, &probe, &format!("stop at {stop}"));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn random_size_lists_round_trip(
        sizes in prop::collection::vec(1usize..3000, 0..24),
        buffers in 1usize..=16,
        staging in 16usize..1500,
        threads in 0usize..6,
        max_us in 0u64..40,
        seed in any::<u64>(),
    ) {
        let bytes = file_of_sizes(&sizes, seed);
        let g = Gguf::parse(&bytes).expect("parse");
        let (mut r, probe) = ring_with(buffers, staging, threads, delays(max_us, seed));
        round_trip(&mut r, &probe, &g);
        round_trip(&mut r, &probe, &g);
        drop(r);
        prop_assert_eq!(probe.violations(), Vec::<Violation>::new());
        prop_assert_eq!(probe.live_staging(), 0);
    }
}

// ---- the engine's own checks: breaking the contract on purpose must be caught ----

#[test]
fn engine_catches_a_rewrite_before_the_wait_and_the_bytes_show_it() {
    let mut e = HostEngine::new(HostConfig::default());
    let probe = e.probe();
    let mut s = e.alloc_staging(8).expect("staging");
    let mut d = e.alloc_dst(4).expect("dst");
    assert_eq!(d.to_vec(), [HOST_DST_POISON; 4]);
    probe.pause();
    // SAFETY: HostEngine's unsafe methods are memory-safe in any order (atomic bytes, buffers
    // shared by Arc); their contract is checked, not assumed. Ranges are in bounds.
    unsafe {
        HostEngine::fill(&mut s, 0, &[1, 2, 3, 4]);
        e.copy_async(&mut s, 0..4, &mut d, 0).expect("copy");
    }
    e.record(&mut s).expect("record");
    // The breach: the copy has not run (the stream is held) and nobody waited.
    // SAFETY: as above; the breach is the point of the test.
    unsafe { HostEngine::fill(&mut s, 2, &[9, 9]) };
    assert_eq!(
        probe.violations(),
        [Violation::RewriteUnderCopy {
            buffer: 0,
            write: 2..4,
            read: 0..4
        }]
    );
    assert_eq!(probe.bytes_copied(), 0, "a held stream copies nothing");
    probe.resume();
    e.wait(&mut s).expect("wait");
    assert_eq!(probe.bytes_copied(), 4);
    assert_eq!(
        d.to_vec(),
        [1, 2, 9, 9],
        "the copy reads the buffer when it runs"
    );
    // After the wait the same rewrite is fine.
    // SAFETY: as above; this one keeps the contract.
    unsafe { HostEngine::fill(&mut s, 0, &[5; 8]) };
    assert_eq!(probe.violations().len(), 1);
}

#[test]
fn engine_events_cover_every_earlier_copy_on_the_stream() {
    let mut e = HostEngine::new(delays(200, 1));
    let probe = e.probe();
    let mut a = e.alloc_staging(4).expect("staging");
    let mut b = e.alloc_staging(4).expect("staging");
    let mut d = e.alloc_dst(8).expect("dst");
    // SAFETY: see the test above; this sequence keeps the contract.
    unsafe {
        HostEngine::fill(&mut a, 0, &[1; 4]);
        e.copy_async(&mut a, 0..4, &mut d, 0).expect("copy");
        HostEngine::fill(&mut b, 0, &[2; 4]);
        e.copy_async(&mut b, 0..4, &mut d, 4).expect("copy");
    }
    e.record(&mut a).expect("record");
    e.record(&mut b).expect("record");
    // b's event was recorded after a's copy too: waiting on it frees both buffers.
    e.wait(&mut b).expect("wait");
    // SAFETY: the wait above covers the copy from `a` (stream order).
    unsafe { HostEngine::fill(&mut a, 0, &[3; 4]) };
    assert_eq!(probe.violations(), Vec::<Violation>::new());
    assert_eq!(d.to_vec(), [1, 1, 1, 1, 2, 2, 2, 2]);
}

#[test]
fn engine_catches_a_free_under_a_pending_copy() {
    let mut e = HostEngine::new(HostConfig::default());
    let probe = e.probe();
    let mut s = e.alloc_staging(16).expect("staging");
    let mut d = e.alloc_dst(16).expect("dst");
    probe.pause();
    // SAFETY: memory-safe whatever the order (see above); the free breaks the contract on
    // purpose.
    unsafe {
        HostEngine::fill(&mut s, 0, &[7; 16]);
        e.copy_async(&mut s, 0..16, &mut d, 0).expect("copy");
        e.free_staging(s);
    }
    // The drop releases the held stream, the copy runs after the free.
    drop(e);
    assert_eq!(
        probe.violations(),
        [
            Violation::FreedUnderCopy {
                buffer: 0,
                read: 0..16
            },
            Violation::CopyFromFreed { buffer: 0 }
        ]
    );
}

#[test]
fn engine_faults_fire_once_at_the_chosen_call() {
    let config = HostConfig {
        fault: Some(HostFault {
            op: HostOp::Copy,
            call: 1,
        }),
        ..HostConfig::default()
    };
    let mut e = HostEngine::new(config);
    let probe = e.probe();
    let mut s = e.alloc_staging(4).expect("staging");
    let mut d = e.alloc_dst(4).expect("dst");
    // SAFETY: memory-safe whatever the order; each copy is waited on before the next fill.
    unsafe {
        HostEngine::fill(&mut s, 0, &[1; 4]);
        e.copy_async(&mut s, 0..4, &mut d, 0).expect("call 0");
        e.record(&mut s).expect("record");
        e.wait(&mut s).expect("wait");
        assert_eq!(
            e.copy_async(&mut s, 0..4, &mut d, 0),
            Err(UploadError::Injected {
                op: "copy_async",
                call: 1
            })
        );
        e.copy_async(&mut s, 0..4, &mut d, 0).expect("call 2");
    }
    e.record(&mut s).expect("record");
    e.wait(&mut s).expect("wait");
    assert_eq!(
        probe.copies_completed(),
        2,
        "the failed call queued nothing"
    );
}
