//! Dequantizing uploads and the registered path on the host copy engine ([`HostEngine`]), no
//! GPU needed: [`StagingRing::upload_dequantized`] (each piece copied into its buffer's device
//! twin, then converted on the stream into the tensor's f16/bf16 destination),
//! [`upload_registered`] and [`upload_registered_dequantized`] (straight from registered host
//! memory).
//!
//! Files mix every type the device converts (F32, F16, BF16, Q4_0, Q8_0, Q4_K, Q6_K) in sizes
//! from one block to many buffers, element counts of the plain types that are multiples of
//! nothing, random bytes (random scales, NaN and infinity among them). Every destination must
//! equal the CPU dequantizer's bits ([`dequantize_into_f16`] / [`dequantize_into_bf16`]); under
//! feature `cuda-emu` the engine converts with the device kernel itself on the CPU emulation,
//! so this also runs the kernel through the whole schedule. Progress counts the file's bytes,
//! completed only, in planned order. Injected failures at every call of every operation must
//! leave no breach of the engines' contracts, no lost staging buffer, no registration ended
//! under a copy (and none leaked unless a synchronize or the unregister itself failed), and a
//! ring that uploads exactly again.

use half::{bf16, f16};
use pagedkv::gguf::upload::{
    upload_registered, upload_registered_dequantized, CopyEngine, DequantTo, HostConfig, HostDst,
    HostEngine, HostFault, HostOp, HostProbe, RegisterEngine, RingError, StagingRing, UploadError,
    UploadProgress, Violation,
};
use pagedkv::gguf::{dequantize_into_bf16, dequantize_into_f16, GgmlType, Gguf, GgufWriter};
use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};
use std::num::NonZeroUsize;
use std::ops::Range;
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

/// Every device type, in sizes from one block to several 4 KiB buffers, plus plain tensors
/// whose element counts are multiples of nothing.
fn mixed_specs() -> Vec<(GgmlType, Vec<u64>)> {
    vec![
        (GgmlType::Q4_K, vec![256, 9]),
        (GgmlType::Q6_K, vec![512, 3]),
        (GgmlType::Q8_0, vec![32, 61]),
        (GgmlType::Q4_0, vec![96, 40]),
        (GgmlType::F16, vec![1001, 3]),
        (GgmlType::BF16, vec![7, 5, 3]),
        (GgmlType::F32, vec![333, 2]),
        (GgmlType::F32, vec![5]),
        (GgmlType::Q8_0, vec![32]),
        (GgmlType::Q4_K, vec![256]),
        (GgmlType::Q6_K, vec![256]),
        (GgmlType::F16, vec![1]),
        (GgmlType::Q4_0, vec![32, 1]),
    ]
}

/// The CPU's bytes of `t` dequantized to `to`.
fn oracle(ty: GgmlType, data: &[u8], n: usize, to: DequantTo) -> Vec<u8> {
    match to {
        DequantTo::F16 => {
            let mut v = vec![f16::ZERO; n];
            dequantize_into_f16(ty, data, &mut v).expect("cpu");
            v.iter().flat_map(|x| x.to_le_bytes()).collect()
        }
        DequantTo::BF16 => {
            let mut v = vec![bf16::ZERO; n];
            dequantize_into_bf16(ty, data, &mut v).expect("cpu");
            v.iter().flat_map(|x| x.to_le_bytes()).collect()
        }
    }
}

fn first_diff(got: &[u8], want: &[u8]) -> Option<usize> {
    (0..got.len().min(want.len()))
        .find(|&i| got[i] != want[i])
        .or((got.len() != want.len()).then_some(got.len().min(want.len())))
}

/// Checks progress calls `(done, tensor)` against the upload order: strictly rising to the
/// total, never ahead of what the stream copied, each tensor covered exactly, in order.
fn check_progress(seen: &[(u64, String)], order: &[(String, usize)]) {
    assert!(
        seen.windows(2).all(|w| w[0].0 < w[1].0),
        "progress not rising"
    );
    let total: u64 = order.iter().map(|o| o.1 as u64).sum();
    assert_eq!(seen.last().map(|s| s.0), Some(total).filter(|&t| t > 0));
    let mut per: Vec<(String, u64)> = Vec::new();
    let mut prev = 0;
    for (done, name) in seen {
        match per.last_mut() {
            Some((n, b)) if n == name => *b += done - prev,
            _ => per.push((name.clone(), done - prev)),
        }
        prev = *done;
    }
    let want: Vec<(String, u64)> = order.iter().map(|(n, b)| (n.clone(), *b as u64)).collect();
    assert_eq!(per, want, "progress does not cover the tensors in order");
}

fn ring(
    buffers: usize,
    staging: usize,
    threads: usize,
    config: HostConfig,
) -> (StagingRing<HostEngine>, HostProbe) {
    let e = HostEngine::new(config);
    let probe = e.probe();
    let mut r = StagingRing::new(e, nz(buffers), nz(staging)).expect("ring");
    r.set_fill_threads(threads);
    (r, probe)
}

fn delays(us: u64, seed: u64) -> HostConfig {
    HostConfig {
        max_delay: Duration::from_micros(us),
        max_fill_delay: Duration::from_micros(us),
        seed,
        fault: None,
    }
}

/// A staged dequantizing upload of `g`, checked against the CPU.
fn staged_round_trip(
    r: &mut StagingRing<HostEngine>,
    probe: &HostProbe,
    g: &Gguf<'_>,
    to: DequantTo,
) {
    let base = probe.bytes_copied();
    let mut seen = Vec::new();
    let out = r
        .upload_dequantized(g, to, |p: UploadProgress<'_>| {
            assert_eq!(p.total, g.total_tensor_bytes());
            assert!(
                probe.bytes_copied() - base >= p.done,
                "progress ahead of the stream"
            );
            seen.push((p.done, p.tensor.to_owned()));
        })
        .expect("upload");
    let order: Vec<(String, usize)> = out
        .iter()
        .map(|(t, _)| (t.name().to_owned(), t.n_bytes()))
        .collect();
    check_progress(&seen, &order);
    for (t, d) in &out {
        let want = oracle(t.ty(), t.data(), t.n_elements() as usize, to);
        if let Some(i) = first_diff(&d.to_vec(), &want) {
            panic!(
                "{} ({}) -> {to:?}: byte {i} of {} differs (engine violations: {:?})",
                t.name(),
                t.ty(),
                want.len(),
                probe.violations()
            );
        }
    }
    assert_eq!(probe.violations(), Vec::<Violation>::new());
}

#[test]
fn staged_dequantized_uploads_match_the_cpu() {
    let bytes = file_of(&mixed_specs(), 1);
    let g = Gguf::parse(&bytes).expect("parse");
    // 1040 bytes hold one 256-element unit of F32 (1024 bytes) and the 16-byte alignment.
    for (k, (buffers, staging, threads)) in
        [(2, 1040, 0), (3, 4096, 1), (5, 3001, 4), (8, 65536, 2)]
            .into_iter()
            .enumerate()
    {
        let (mut r, probe) = ring(buffers, staging, threads, delays(30, k as u64));
        for to in [DequantTo::BF16, DequantTo::F16, DequantTo::BF16] {
            staged_round_trip(&mut r, &probe, &g, to);
        }
        // Raw uploads through the same ring still work, before and after.
        let raw = r.upload(&g, |_| {}).expect("raw");
        for (t, d) in &raw {
            assert_eq!(d.to_vec(), t.data());
        }
        drop(r);
        assert_eq!(probe.violations(), Vec::<Violation>::new());
        assert_eq!(probe.live_staging(), 0);
    }
}

#[test]
fn refusals_come_before_anything_is_allocated() {
    // A type the device does not convert.
    let bytes = file_of(
        &[(GgmlType::Q8_0, vec![64]), (GgmlType::Q5_K, vec![256])],
        2,
    );
    let g = Gguf::parse(&bytes).expect("parse");
    let (mut r, probe) = ring(2, 4096, 1, HostConfig::default());
    match r.upload_dequantized(&g, DequantTo::BF16, |_| panic!("no progress expected")) {
        Err(RingError::NotDequantizable { tensor, ty }) => {
            // Largest first: the Q5_K tensor (176 bytes) comes before the Q8_0 (68 bytes).
            assert_eq!((tensor, ty), (0, GgmlType::Q5_K));
        }
        other => panic!("{:?}", other.map(|v| v.len())),
    }
    // Buffers smaller than one unit of the largest cut (F32: 1024 bytes).
    let bytes = file_of(&[(GgmlType::F32, vec![300])], 3);
    let g = Gguf::parse(&bytes).expect("parse");
    let (mut small, small_probe) = ring(2, 1000, 1, HostConfig::default());
    assert_eq!(
        small
            .upload_dequantized(&g, DequantTo::F16, |_| {})
            .map(|v| v.len()),
        Err(RingError::StagingTooSmall {
            needed: 1024,
            have: 1000
        })
    );
    // Bytes that are not whole blocks (only reachable through the slice API).
    let partial = [0u8; 35];
    assert_eq!(
        r.upload_slices_dequantized(&[(GgmlType::Q8_0, &partial)], DequantTo::F16, |_, _| {})
            .map(|v| v.len()),
        Err(RingError::PartialBlock {
            tensor: 0,
            ty: GgmlType::Q8_0,
            bytes: 35
        })
    );
    for p in [&probe, &small_probe] {
        assert_eq!(p.copies_completed(), 0, "nothing may have been queued");
    }
    drop((r, small));
    assert_eq!(probe.violations(), Vec::<Violation>::new());
}

/// The file of the fault sweeps: every type, about 30 pieces through 3 buffers of 2 KiB.
fn sweep_file() -> Vec<u8> {
    file_of(
        &[
            (GgmlType::Q4_K, vec![256, 12]),
            (GgmlType::F32, vec![300]),
            (GgmlType::Q8_0, vec![64, 5]),
            (GgmlType::F16, vec![77]),
            (GgmlType::Q6_K, vec![256, 2]),
            (GgmlType::BF16, vec![40]),
            (GgmlType::Q4_0, vec![32, 3]),
        ],
        4,
    )
}

fn staged_fault_sweep(op: HostOp) {
    let bytes = sweep_file();
    let g = Gguf::parse(&bytes).expect("parse");
    let (mut failed, mut succeeded) = (0, 0);
    for call in 0..60u64 {
        let threads = (call % 3) as usize;
        let config = HostConfig {
            fault: Some(HostFault { op, call }),
            ..delays(20, call)
        };
        let e = HostEngine::new(config);
        let probe = e.probe();
        let Ok(mut r) = StagingRing::new(e, nz(3), nz(2048)) else {
            failed += 1;
            continue;
        };
        r.set_fill_threads(threads);
        let what = format!("{op:?} failing at call {call}, {threads} fill threads");
        match r.upload_dequantized(&g, DequantTo::BF16, |_| {}) {
            Ok(out) => {
                succeeded += 1;
                for (t, d) in &out {
                    let want = oracle(t.ty(), t.data(), t.n_elements() as usize, DequantTo::BF16);
                    assert_eq!(d.to_vec(), want, "{what}: {}", t.name());
                }
                drop(r);
                assert_eq!(probe.violations(), Vec::<Violation>::new(), "{what}");
            }
            Err(err) => {
                failed += 1;
                let name = format!("{op:?}");
                match err {
                    RingError::Engine(UploadError::Injected { call: c, .. }) => {
                        assert_eq!(c, call, "{what}")
                    }
                    other => panic!("{what}: {other:?} ({name})"),
                }
                if call % 2 == 0 {
                    staged_round_trip(&mut r, &probe, &g, DequantTo::F16);
                }
                drop(r);
                assert_eq!(probe.violations(), Vec::<Violation>::new(), "{what}");
                assert_eq!(probe.live_staging(), 0, "{what}: buffers leaked");
            }
        }
    }
    assert!(
        failed > 0 && succeeded > 0,
        "{op:?}: sweep too short or too long"
    );
}

#[test]
fn staged_dequantized_faults_at_every_call() {
    for op in [
        HostOp::Dequant,
        HostOp::Copy,
        HostOp::DstAlloc,
        HostOp::Wait,
        HostOp::Record,
    ] {
        staged_fault_sweep(op);
    }
}

// ---- the registered path -------------------------------------------------------------------

/// `g`'s data section and each tensor's range in it, largest first.
/// A tensor of the registered path: name, type, range in the data section.
type Part = (String, GgmlType, Range<usize>);

fn registered_parts<'a>(g: &Gguf<'a>) -> (&'a [u8], Vec<Part>) {
    let host = &g.file_bytes()[g.data_offset() as usize..];
    let parts = g
        .tensors_largest_first()
        .iter()
        .map(|t| {
            let off = t.offset() as usize;
            (t.name().to_owned(), t.ty(), off..off + t.n_bytes())
        })
        .collect();
    (host, parts)
}

fn registered_round_trip(
    e: &mut HostEngine,
    probe: &HostProbe,
    g: &Gguf<'_>,
    to: Option<DequantTo>,
    stage: usize,
) {
    let (host, parts) = registered_parts(g);
    let base = probe.bytes_copied();
    let mut seen = Vec::new();
    let mut progress = |i: usize, done: u64| {
        assert!(
            probe.bytes_copied() - base >= done,
            "progress ahead of the stream"
        );
        seen.push((done, parts[i].0.clone()));
    };
    let out: Vec<HostDst> = match to {
        None => {
            let ranges: Vec<Range<usize>> = parts.iter().map(|p| p.2.clone()).collect();
            upload_registered(e, host, &ranges, &mut progress).expect("registered")
        }
        Some(to) => {
            let typed: Vec<(GgmlType, Range<usize>)> =
                parts.iter().map(|p| (p.1, p.2.clone())).collect();
            upload_registered_dequantized(e, host, &typed, to, nz(stage), &mut progress)
                .expect("registered dequantized")
        }
    };
    let order: Vec<(String, usize)> = parts.iter().map(|p| (p.0.clone(), p.2.len())).collect();
    check_progress(&seen, &order);
    for ((name, ty, r), d) in parts.iter().zip(&out) {
        let want = match to {
            None => host[r.clone()].to_vec(),
            Some(to) => {
                let n = r.len() / ty.type_size() as usize * ty.block_size() as usize;
                oracle(*ty, &host[r.clone()], n, to)
            }
        };
        assert!(
            first_diff(&d.to_vec(), &want).is_none(),
            "{name} ({ty}) via {to:?}"
        );
    }
    assert_eq!(probe.violations(), Vec::<Violation>::new());
    assert_eq!(probe.live_registrations(), 0);
}

#[test]
fn registered_uploads_match_the_file_and_the_cpu() {
    let bytes = file_of(&mixed_specs(), 5);
    let g = Gguf::parse(&bytes).expect("parse");
    for (k, stage) in [1024usize, 1500, 4096, 1 << 20].into_iter().enumerate() {
        let mut e = HostEngine::new(delays(25, k as u64));
        let probe = e.probe();
        registered_round_trip(&mut e, &probe, &g, None, stage);
        registered_round_trip(&mut e, &probe, &g, Some(DequantTo::BF16), stage);
        registered_round_trip(&mut e, &probe, &g, Some(DequantTo::F16), stage);
    }
    // The staging area must hold one unit of the largest cut.
    let mut e = HostEngine::new(HostConfig::default());
    let (host, parts) = registered_parts(&g);
    let typed: Vec<(GgmlType, Range<usize>)> = parts.iter().map(|p| (p.1, p.2.clone())).collect();
    assert_eq!(
        upload_registered_dequantized(&mut e, host, &typed, DequantTo::F16, nz(1000), |_, _| {})
            .map(|v| v.len()),
        Err(RingError::StagingTooSmall {
            needed: 1024,
            have: 1000
        })
    );
    // Ranges outside the registered memory.
    assert_eq!(
        upload_registered(&mut e, &host[..100], &[0..50, 90..101], |_, _| {}).map(|v| v.len()),
        Err(RingError::OutOfRange {
            tensor: 1,
            start: 90,
            end: 101,
            len: 100
        })
    );
    assert_eq!(e.probe().live_registrations(), 0);
}

/// `StagingTooSmall::needed` is "bytes one unit of the largest cut needs", on both paths: the
/// registered path reported the first tensor whose unit did not fit (here F16's 512 bytes), so a
/// caller who grew the area to that size was refused again (F32 needs 1024). And both paths
/// refuse a type the device cannot convert before they look at the staging size.
#[test]
fn registered_staging_refusal_names_the_largest_unit_like_the_ring() {
    let host = vec![0u8; 144 + 512 + 1024 + 176];
    let typed = [
        (GgmlType::Q4_K, 0..144),
        (GgmlType::F16, 144..656),
        (GgmlType::F32, 656..1680),
    ];
    let slices: Vec<(GgmlType, &[u8])> =
        typed.iter().map(|(t, r)| (*t, &host[r.clone()])).collect();
    let (mut r, _probe) = ring(2, 300, 0, HostConfig::default());
    let staged = r
        .upload_slices_dequantized(&slices, DequantTo::F16, |_, _| {})
        .map(|v| v.len());
    let mut e = HostEngine::new(HostConfig::default());
    let registered =
        upload_registered_dequantized(&mut e, &host, &typed, DequantTo::F16, nz(300), |_, _| {})
            .map(|v| v.len());
    let want = Err(RingError::StagingTooSmall {
        needed: 1024,
        have: 300,
    });
    assert_eq!(staged, want, "staged");
    assert_eq!(registered, want, "registered");
    // A Q5_K tensor after one whose unit does not fit: both refuse the type.
    let typed = [(GgmlType::F32, 0..1024), (GgmlType::Q5_K, 1024..1200)];
    let slices: Vec<(GgmlType, &[u8])> =
        typed.iter().map(|(t, r)| (*t, &host[r.clone()])).collect();
    let staged = r
        .upload_slices_dequantized(&slices, DequantTo::F16, |_, _| {})
        .map(|v| v.len());
    let registered =
        upload_registered_dequantized(&mut e, &host, &typed, DequantTo::F16, nz(300), |_, _| {})
            .map(|v| v.len());
    let want = Err(RingError::NotDequantizable {
        tensor: 1,
        ty: GgmlType::Q5_K,
    });
    assert_eq!(staged, want, "staged");
    assert_eq!(registered, want, "registered");
}

#[test]
fn registered_faults_at_every_call() {
    let bytes = sweep_file();
    let g = Gguf::parse(&bytes).expect("parse");
    let (host, parts) = registered_parts(&g);
    let ranges: Vec<Range<usize>> = parts.iter().map(|p| p.2.clone()).collect();
    let typed: Vec<(GgmlType, Range<usize>)> = parts.iter().map(|p| (p.1, p.2.clone())).collect();
    for op in [
        HostOp::Register,
        HostOp::CopyRegistered,
        HostOp::Synchronize,
        HostOp::Unregister,
        HostOp::DstAlloc,
        HostOp::Dequant,
    ] {
        for dequant in [false, true] {
            let (mut failed, mut succeeded) = (0, 0);
            for call in 0..40u64 {
                let mut e = HostEngine::new(HostConfig {
                    fault: Some(HostFault { op, call }),
                    ..delays(20, call)
                });
                let probe = e.probe();
                let what = format!("{op:?} failing at call {call}, dequantized: {dequant}");
                let res = if dequant {
                    upload_registered_dequantized(
                        &mut e,
                        host,
                        &typed,
                        DequantTo::BF16,
                        nz(2048),
                        |_, _| {},
                    )
                } else {
                    upload_registered(&mut e, host, &ranges, |_, _| {})
                };
                match res {
                    Ok(out) => {
                        succeeded += 1;
                        for ((_, ty, r), d) in parts.iter().zip(&out) {
                            let want = if dequant {
                                let n =
                                    r.len() / ty.type_size() as usize * ty.block_size() as usize;
                                oracle(*ty, &host[r.clone()], n, DequantTo::BF16)
                            } else {
                                host[r.clone()].to_vec()
                            };
                            assert_eq!(d.to_vec(), want, "{what}");
                        }
                        assert_eq!(probe.live_registrations(), 0, "{what}");
                    }
                    Err(RingError::Engine(UploadError::Injected { call: c, .. })) => {
                        failed += 1;
                        assert_eq!(c, call, "{what}");
                        // Leaked only when nothing could prove the copies done, or the
                        // unregister itself failed.
                        let leaks = matches!(op, HostOp::Synchronize | HostOp::Unregister);
                        assert_eq!(probe.live_registrations(), usize::from(leaks), "{what}");
                        // The fault is spent: the engine uploads exactly again.
                        if call % 2 == 1 {
                            let to = dequant.then_some(DequantTo::F16);
                            registered_round_trip(&mut e, &probe, &g, to, 4096);
                        }
                    }
                    Err(other) => panic!("{what}: {other:?}"),
                }
                drop(e);
                assert_eq!(probe.violations(), Vec::<Violation>::new(), "{what}");
            }
            let reaches = op != HostOp::Dequant || dequant;
            assert!(
                succeeded > 0,
                "{op:?}: the sweep did not reach past the last call"
            );
            assert_eq!(failed > 0, reaches, "{op:?} (dequantized: {dequant})");
        }
    }
}

#[test]
fn engine_catches_an_unregister_under_a_pending_copy() {
    let mut e = HostEngine::new(HostConfig::default());
    let probe = e.probe();
    let host = [7u8; 32];
    // SAFETY: HostEngine copies registered bytes at registration and flags breaches instead of
    // relying on the contract; the ranges are in bounds. The unregister before a synchronize
    // breaks the contract on purpose.
    unsafe {
        let mut reg = e.register(&host).expect("register");
        let mut d = e.alloc_dst(32).expect("dst");
        probe.pause();
        e.copy_registered_async(&mut reg, 0..32, &mut d, 0)
            .expect("copy");
        e.unregister(reg).expect("unregister");
    }
    drop(e); // releases the held stream: the copy runs after the unregister
    assert_eq!(
        probe.violations(),
        [
            Violation::UnregisteredUnderCopy {
                region: 0,
                read: 0..32
            },
            Violation::CopyFromUnregistered { region: 0 }
        ]
    );
    assert_eq!(probe.live_registrations(), 0);
}
