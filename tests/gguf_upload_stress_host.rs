//! Random stress of the staged ring on the host engine: raw and dequantizing uploads mixed on
//! one ring, faults in any operation, panicking progress callbacks, then reuse.

use pagedkv::gguf::upload::{
    DequantTo, HostConfig, HostEngine, HostFault, HostOp, StagingRing, Violation,
};
use pagedkv::gguf::{dequantize_into_bf16, dequantize_into_f16, GgmlType, Gguf, GgufWriter};
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};
use std::num::NonZeroUsize;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

fn file(rng: &mut SmallRng) -> Vec<u8> {
    let tys = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ];
    let n = rng.gen_range(1..8);
    let mut specs = Vec::new();
    for _ in 0..n {
        let ty = tys[rng.gen_range(0..tys.len())];
        let bs = u64::from(ty.block_size());
        let shape = vec![bs * rng.gen_range(1..4), rng.gen_range(1..6)];
        let nb = ty.bytes_for(shape.iter().product()).expect("size") as usize;
        let mut d = vec![0u8; nb];
        rng.fill_bytes(&mut d);
        specs.push((ty, shape, d));
    }
    let mut w = GgufWriter::new();
    for (i, (ty, shape, d)) in specs.iter().enumerate() {
        w.add_tensor(&format!("t{i}"), *ty, shape, d).expect("add");
    }
    w.to_bytes().expect("write")
}

fn oracle(ty: GgmlType, data: &[u8], n: usize, to: DequantTo) -> Vec<u8> {
    match to {
        DequantTo::F16 => {
            let mut v = vec![half::f16::ZERO; n];
            dequantize_into_f16(ty, data, &mut v).expect("cpu");
            v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
        }
        DequantTo::BF16 => {
            let mut v = vec![half::bf16::ZERO; n];
            dequantize_into_bf16(ty, data, &mut v).expect("cpu");
            v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
        }
    }
}

#[test]
fn random_mixed_uploads_with_faults_and_panics() {
    let ops = [
        HostOp::DstAlloc,
        HostOp::Copy,
        HostOp::Record,
        HostOp::Wait,
        HostOp::Dequant,
        HostOp::Fill,
    ];
    let iters: u64 = std::env::var("STRESS_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(150);
    for seed in 0..iters {
        let mut rng = SmallRng::seed_from_u64(seed);
        let bytes = file(&mut rng);
        let g = Gguf::parse(&bytes).expect("parse");
        let op = ops[rng.gen_range(0..ops.len())];
        let call = rng.gen_range(0..40);
        let cfg = HostConfig {
            max_delay: Duration::from_micros(rng.gen_range(0..30)),
            max_fill_delay: Duration::from_micros(rng.gen_range(0..30)),
            seed,
            fault: Some(HostFault { op, call }),
        };
        let e = HostEngine::new(cfg);
        let probe = e.probe();
        let buffers = rng.gen_range(1..5);
        let staging = rng.gen_range(1024..4000);
        let mut r = StagingRing::new(
            e,
            NonZeroUsize::new(buffers).unwrap(),
            NonZeroUsize::new(staging).unwrap(),
        )
        .expect("ring");
        r.set_fill_threads(rng.gen_range(0..4));
        let mut spent = false;
        let what = format!("seed {seed}: {op:?} #{call}, {buffers}x{staging}");
        for k in 0..4 {
            let mode = rng.gen_range(0..3);
            let stop = if rng.gen_bool(0.2) {
                rng.gen_range(0..=g.total_tensor_bytes())
            } else {
                u64::MAX
            };
            let res = catch_unwind(AssertUnwindSafe(|| match mode {
                0 => r
                    .upload(&g, |p| assert!(p.done < stop, "stop"))
                    .map(|v| {
                        v.into_iter()
                            .map(|(t, d)| (t, d.to_vec(), None))
                            .collect::<Vec<_>>()
                    })
                    .map_err(|e| format!("{e:?}")),
                _ => {
                    let to = if mode == 1 {
                        DequantTo::F16
                    } else {
                        DequantTo::BF16
                    };
                    r.upload_dequantized(&g, to, |p| assert!(p.done < stop, "stop"))
                        .map(|v| {
                            v.into_iter()
                                .map(|(t, d)| (t, d.to_vec(), Some(to)))
                                .collect()
                        })
                        .map_err(|e| format!("{e:?}"))
                }
            }));
            match res {
                Err(p) => {
                    let m = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    if m.contains("injected panic") {
                        spent = true;
                    } else {
                        assert!(
                            m.contains("stop"),
                            "{what} upload {k}: unexpected panic {m}"
                        );
                    }
                }
                Ok(Err(e)) => {
                    assert!(e.contains("Injected"), "{what} upload {k}: {e}");
                    assert!(!spent, "{what} upload {k}: second fault {e}");
                    spent = true;
                }
                Ok(Ok(out)) => {
                    for (t, d, to) in &out {
                        let want = match to {
                            None => t.data().to_vec(),
                            Some(to) => oracle(t.ty(), t.data(), t.n_elements() as usize, *to),
                        };
                        assert!(d == &want, "{what} upload {k} ({mode}): {} wrong", t.name());
                    }
                }
            }
            assert_eq!(
                probe.violations(),
                Vec::<Violation>::new(),
                "{what} upload {k}"
            );
        }
        drop(r);
        assert_eq!(probe.violations(), Vec::<Violation>::new(), "{what} drop");
        if spent || !matches!(op, HostOp::Wait | HostOp::Record) {
            assert_eq!(probe.live_staging(), 0, "{what}: leaked");
        }
    }
}

#[test]
fn random_registered_uploads() {
    use pagedkv::gguf::upload::{upload_registered, upload_registered_dequantized};
    use std::ops::Range;
    let iters: u64 = std::env::var("STRESS_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(150);
    for seed in 0..iters {
        let mut rng = SmallRng::seed_from_u64(seed ^ 0xabc);
        let bytes = file(&mut rng);
        let g = Gguf::parse(&bytes).expect("parse");
        let host = &g.file_bytes()[g.data_offset() as usize..];
        let mut parts: Vec<(GgmlType, Range<usize>, &[u8], u64)> = g
            .tensors()
            .iter()
            .map(|t| {
                (
                    t.ty(),
                    t.offset() as usize..t.offset() as usize + t.n_bytes(),
                    t.data(),
                    t.n_elements(),
                )
            })
            .collect();
        // random order, some repeated
        for _ in 0..rng.gen_range(0..3) {
            let i = rng.gen_range(0..parts.len());
            parts.push(parts[i].clone());
        }
        let n = parts.len();
        for i in 0..n {
            parts.swap(i, rng.gen_range(0..n));
        }
        let mut e = HostEngine::new(HostConfig {
            max_delay: Duration::from_micros(rng.gen_range(0..20)),
            seed,
            ..HostConfig::default()
        });
        let probe = e.probe();
        let stage = rng.gen_range(1024..5000);
        let to = if rng.gen_bool(0.5) {
            DequantTo::F16
        } else {
            DequantTo::BF16
        };
        let typed: Vec<(GgmlType, Range<usize>)> =
            parts.iter().map(|p| (p.0, p.1.clone())).collect();
        let mut seen = Vec::new();
        let out = upload_registered_dequantized(
            &mut e,
            host,
            &typed,
            to,
            NonZeroUsize::new(stage).unwrap(),
            |i, d| seen.push((i, d)),
        );
        let out = out.expect("upload");
        for (p, d) in parts.iter().zip(&out) {
            assert_eq!(
                d.to_vec(),
                oracle(p.0, p.2, p.3 as usize, to),
                "seed {seed} stage {stage}"
            );
        }
        let ranges: Vec<Range<usize>> = parts.iter().map(|p| p.1.clone()).collect();
        let out = upload_registered(&mut e, host, &ranges, |_, _| {}).expect("raw");
        for (p, d) in parts.iter().zip(&out) {
            assert_eq!(d.to_vec(), p.2, "seed {seed}");
        }
        drop(e);
        assert_eq!(probe.violations(), Vec::<Violation>::new());
        assert_eq!(probe.live_registrations(), 0);
    }
}
