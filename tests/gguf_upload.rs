//! GGUF device upload: every tensor of the gguf-py fixture and of a synthetic multi-MiB file
//! (written with `GgufWriter`, random bytes, sizes that straddle staging buffers) goes up
//! through the pinned staging ring under several ring shapes and fill-thread counts, and
//! through registered file pages, comes back with a plain download, and must equal the file
//! byte for byte, with its type and shape; progress must rise to the total in largest-first
//! order. Dequantizing uploads (staged and registered, f16 and bf16) and the kernel alone
//! (`dequantize_on_device`, random blocks with extreme scales) must equal the CPU dequantizer
//! bit for bit.
//!
//! Without a GPU each GPU test prints `SKIP` and passes; with `PAGEDKV_REQUIRE_GPU=1` it fails
//! instead. `options_are_checked` and `synthetic_file_exercises_the_ring` run everywhere.
#![cfg(feature = "cuda")]

use half::{bf16, f16};
use pagedkv::cuda::Gpu;
use pagedkv::error::CudaError;
use pagedkv::gguf::upload::{
    dequantize_on_device, DequantTo, DeviceUploadError, FillStats, RegisterTimes, UploadOptions,
    UploadPath, UploadProgress, Uploader, DEVICE_DEQUANT_TYPES,
};
use pagedkv::gguf::{dequantize_into_bf16, dequantize_into_f16, GgmlType, Gguf, GgufWriter};
use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};
use std::path::Path;
use std::time::Duration;

#[path = "support/gpu.rs"]
mod gpu_support;
use gpu_support::gpu;

fn fixture() -> Vec<u8> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/all_types.gguf");
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// A file of ~21 MiB: F32/F16/Q8_0/Q4_K/BF16 tensors of random bytes, some far larger than a
/// staging buffer, some not a multiple of anything, many tiny ones that share a buffer.
fn synthetic() -> Vec<u8> {
    let mut rng = SmallRng::seed_from_u64(7);
    let specs: Vec<(String, GgmlType, Vec<u64>)> = vec![
        ("tok_embd".into(), GgmlType::F32, vec![1024, 4099]),
        ("big_q8".into(), GgmlType::Q8_0, vec![4096, 1031]),
        ("mid_f16".into(), GgmlType::F16, vec![333, 1027]),
        ("q4k".into(), GgmlType::Q4_K, vec![512, 77]),
        ("bf16".into(), GgmlType::BF16, vec![5, 7, 3, 2]),
    ]
    .into_iter()
    .chain((0..40).map(|i| (format!("norm.{i}"), GgmlType::F32, vec![1 + i * 37])))
    .collect();
    let data: Vec<Vec<u8>> = specs
        .iter()
        .map(|(_, ty, shape)| {
            let n = ty.bytes_for(shape.iter().product()).expect("size") as usize;
            let mut v = vec![0u8; n];
            rng.fill_bytes(&mut v);
            v
        })
        .collect();
    let mut w = GgufWriter::new();
    for ((name, ty, shape), d) in specs.iter().zip(&data) {
        w.add_tensor(name, *ty, shape, d).expect("add");
    }
    w.to_bytes().expect("write")
}

/// Uploads `g` with `up`, checks progress, downloads every tensor and compares it with the file.
fn round_trip(gpu: &Gpu, up: &mut Uploader, g: &Gguf<'_>) {
    let total = g.total_tensor_bytes();
    let mut seen: Vec<(u64, u64, String)> = Vec::new();
    let w = up
        .upload(g, |p: UploadProgress<'_>| {
            seen.push((p.done, p.total, p.tensor.to_owned()))
        })
        .expect("upload");
    // Progress: strictly rising to the total, tensors first seen in largest-first order.
    assert!(!seen.is_empty());
    assert!(seen.iter().all(|s| s.1 == total));
    assert!(
        seen.windows(2).all(|p| p[0].0 < p[1].0),
        "progress not rising"
    );
    assert_eq!(seen.last().map(|s| s.0), Some(total));
    let mut first_seen: Vec<&str> = Vec::new();
    for (_, _, name) in &seen {
        if first_seen.last() != Some(&name.as_str()) {
            assert!(
                !first_seen.contains(&name.as_str()),
                "{name} reported twice"
            );
            first_seen.push(name);
        }
    }
    let order: Vec<&str> = g.tensors_largest_first().iter().map(|t| t.name()).collect();
    assert_eq!(first_seen, order);
    // Contents.
    assert_eq!(w.len(), g.tensors().len());
    assert_eq!(w.total_bytes(), total);
    for t in g.tensors() {
        let d = w
            .get(t.name())
            .unwrap_or_else(|| panic!("{} missing", t.name()));
        assert_eq!(d.ty(), t.ty(), "{}", t.name());
        assert_eq!(d.shape(), t.shape(), "{}", t.name());
        let back = gpu.download(d.data()).expect("download");
        assert!(
            back == t.data(),
            "{}: device bytes differ from the file",
            t.name()
        );
    }
}

fn ring_shapes() -> [UploadOptions; 5] {
    let d = UploadOptions::default();
    [
        UploadOptions {
            staging_buffers: 2,
            staging_bytes: 64 << 10,
            write_combined: true,
            fill_threads: 0,
            ..d
        },
        UploadOptions {
            staging_buffers: 3,
            staging_bytes: (1 << 20) + 4096,
            write_combined: false,
            fill_threads: 2,
            ..d
        },
        UploadOptions {
            staging_buffers: 8,
            staging_bytes: 1 << 20,
            fill_threads: 8,
            ..d
        },
        UploadOptions {
            path: UploadPath::Registered,
            ..d
        },
        d,
    ]
}

/// The CPU dequantizer's bytes.
fn cpu_bytes(ty: GgmlType, data: &[u8], n: usize, to: DequantTo) -> Vec<u8> {
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

/// A file of every device-dequantizable type, random bytes (random scales, NaN and infinity
/// among them), sizes from one block to several MiB, plain types of odd element counts.
fn dequant_file() -> Vec<u8> {
    let mut rng = SmallRng::seed_from_u64(17);
    let specs: Vec<(String, GgmlType, Vec<u64>)> = vec![
        ("q4k".into(), GgmlType::Q4_K, vec![4096, 300]),
        ("q6k".into(), GgmlType::Q6_K, vec![2048, 129]),
        ("q8".into(), GgmlType::Q8_0, vec![4096, 257]),
        ("q4".into(), GgmlType::Q4_0, vec![1024, 33]),
        ("f16".into(), GgmlType::F16, vec![1001, 777]),
        ("bf16".into(), GgmlType::BF16, vec![999, 3]),
        ("f32".into(), GgmlType::F32, vec![4097, 5]),
        ("norm".into(), GgmlType::F32, vec![4096]),
        ("tiny".into(), GgmlType::Q8_0, vec![32]),
    ];
    let data: Vec<Vec<u8>> = specs
        .iter()
        .map(|(_, ty, shape)| {
            let n = ty.bytes_for(shape.iter().product()).expect("size") as usize;
            let mut v = vec![0u8; n];
            rng.fill_bytes(&mut v);
            v
        })
        .collect();
    let mut w = GgufWriter::new();
    for ((name, ty, shape), d) in specs.iter().zip(&data) {
        w.add_tensor(name, *ty, shape, d).expect("add");
    }
    w.to_bytes().expect("write")
}

#[test]
fn options_are_checked() {
    let ok = UploadOptions::default();
    assert!(ok.check().is_ok());
    for (bad, what) in [
        (
            UploadOptions {
                staging_buffers: 1,
                ..ok
            },
            "staging_buffers",
        ),
        (
            UploadOptions {
                staging_buffers: 65,
                ..ok
            },
            "staging_buffers",
        ),
        (
            UploadOptions {
                fill_threads: 65,
                ..ok
            },
            "fill_threads",
        ),
        (
            UploadOptions {
                staging_bytes: 4096,
                ..ok
            },
            "staging_bytes",
        ),
        (
            UploadOptions {
                staging_bytes: 3 << 30,
                ..ok
            },
            "staging_bytes",
        ),
    ] {
        match bad.check() {
            Err(CudaError::Unsupported { what: w, .. }) => assert_eq!(w, what),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
}

#[test]
fn synthetic_file_exercises_the_ring() {
    // Runs everywhere: the GPU tests below rely on these properties of their input.
    let syn = synthetic();
    let g = Gguf::parse(&syn).expect("parse");
    let sizes: Vec<usize> = g
        .tensors_largest_first()
        .iter()
        .map(|t| t.n_bytes())
        .collect();
    assert!(g.total_tensor_bytes() > 20 << 20);
    assert!(
        sizes[0] > 8 * ((1 << 20) + 4096),
        "a tensor spans many 1 MiB buffers"
    );
    assert!(
        sizes.iter().any(|&n| n % 4096 != 0),
        "sizes not page multiples"
    );
    assert!(
        sizes.iter().filter(|&&n| n < 4096).count() > 10,
        "tiny tensors share buffers"
    );
}

#[test]
fn fixture_round_trips_exactly() {
    let Some(gpu) = gpu("fixture_round_trips_exactly") else {
        return;
    };
    let bytes = fixture();
    let g = Gguf::parse(&bytes).expect("parse");
    for opts in ring_shapes() {
        let mut up = Uploader::new(&gpu, opts).expect("uploader");
        round_trip(&gpu, &mut up, &g);
    }
}

#[test]
fn synthetic_file_round_trips_exactly_and_ring_is_reusable() {
    let Some(gpu) = gpu("synthetic_file_round_trips_exactly_and_ring_is_reusable") else {
        return;
    };
    let (fx, syn) = (fixture(), synthetic());
    let (gf, gs) = (
        Gguf::parse(&fx).expect("parse"),
        Gguf::parse(&syn).expect("parse"),
    );
    assert!(gs.total_tensor_bytes() > 20 << 20);
    for opts in ring_shapes() {
        // One ring, three uploads: the second and third reuse buffers the DMA just read.
        let mut up = Uploader::new(&gpu, opts).expect("uploader");
        round_trip(&gpu, &mut up, &gs);
        round_trip(&gpu, &mut up, &gf);
        round_trip(&gpu, &mut up, &gs);
    }
}

#[test]
fn panicking_progress_leaves_a_usable_ring() {
    let Some(gpu) = gpu("panicking_progress_leaves_a_usable_ring") else {
        return;
    };
    let syn = synthetic();
    let g = Gguf::parse(&syn).expect("parse");
    let opts = UploadOptions {
        staging_buffers: 2,
        staging_bytes: 1 << 20,
        write_combined: true,
        fill_threads: 3,
        ..UploadOptions::default()
    };
    let mut up = Uploader::new(&gpu, opts).expect("uploader");
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        up.upload(&g, |p| assert!(p.done < 3 << 20, "stop mid-upload"))
    }));
    assert!(r.is_err(), "the callback should have panicked");
    round_trip(&gpu, &mut up, &g);
}

#[test]
fn dequantized_uploads_match_the_cpu_bit_for_bit() {
    let Some(gpu) = gpu("dequantized_uploads_match_the_cpu_bit_for_bit") else {
        return;
    };
    let bytes = dequant_file();
    let g = Gguf::parse(&bytes).expect("parse");
    let d = UploadOptions::default();
    for path in [UploadPath::Staged, UploadPath::Registered] {
        for (to, threads) in [(DequantTo::BF16, 4), (DequantTo::F16, 0)] {
            let opts = UploadOptions {
                path,
                staging_bytes: 1 << 20,
                fill_threads: threads,
                dequantize: Some(to),
                ..d
            };
            let mut up = Uploader::new(&gpu, opts).expect("uploader");
            for _ in 0..2 {
                let mut last = 0;
                let w = up.upload(&g, |p| last = p.done).expect("upload");
                assert_eq!(last, g.total_tensor_bytes());
                for t in g.tensors() {
                    let dt = w.get(t.name()).expect("tensor");
                    assert_eq!((dt.ty(), dt.file_ty()), (to.ggml_type(), t.ty()));
                    let want = cpu_bytes(t.ty(), t.data(), t.n_elements() as usize, to);
                    let got = gpu.download(dt.data()).expect("download");
                    assert!(got == want, "{path:?} {to:?}: {} differs", t.name());
                }
            }
        }
    }
    // A type the device does not convert: refused by name before anything moves.
    let fx = fixture();
    let gf = Gguf::parse(&fx).expect("parse");
    let mut up = Uploader::new(
        &gpu,
        UploadOptions {
            dequantize: Some(DequantTo::BF16),
            ..d
        },
    )
    .expect("uploader");
    match up.upload(&gf, |_| panic!("no progress expected")) {
        Err(DeviceUploadError::NotDequantizable { ty, .. }) => {
            assert!(!DEVICE_DEQUANT_TYPES.contains(&ty))
        }
        other => panic!("{:?}", other.map(|w| w.len())),
    }
}

#[test]
fn the_kernel_alone_matches_the_cpu_on_extreme_blocks() {
    let Some(gpu) = gpu("the_kernel_alone_matches_the_cpu_on_extreme_blocks") else {
        return;
    };
    let mut rng = SmallRng::seed_from_u64(23);
    // f16 bits that stress a scale, written over every block's scale fields in turn.
    let extremes: [u16; 10] = [
        0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE00, 0x7BFF, 0x0001, 0x8001, 0x0000, 0x3C00,
    ];
    for ty in DEVICE_DEQUANT_TYPES {
        let bs = ty.block_size() as u64;
        for n in [bs, 7 * bs, 256 * 33 + if bs == 1 { 5 } else { bs }, 1 << 20] {
            let len = ty.bytes_for(n).expect("size") as usize;
            let mut src = vec![0u8; len];
            rng.fill_bytes(&mut src);
            let ts = ty.type_size() as usize;
            let fields: &[usize] = match ty {
                GgmlType::Q8_0 | GgmlType::Q4_0 => &[0],
                GgmlType::Q4_K => &[0, 2],
                GgmlType::Q6_K => &[208],
                _ => &[],
            };
            for (b, blk) in src.chunks_exact_mut(ts).enumerate() {
                for &at in fields {
                    if b % 3 == 0 {
                        let x = extremes[(b / 3 + at) % extremes.len()];
                        blk[at..at + 2].copy_from_slice(&x.to_le_bytes());
                    }
                }
            }
            let dsrc = gpu.upload(&src).expect("upload");
            for to in [DequantTo::F16, DequantTo::BF16] {
                let out = dequantize_on_device(&gpu, ty, &dsrc, to).expect("dequantize");
                let got = gpu.download(&out).expect("download");
                let want = cpu_bytes(ty, &src, n as usize, to);
                assert!(
                    got[..want.len()] == want[..],
                    "{ty} -> {to:?}, {n} elements"
                );
            }
        }
    }
    // Refusals: a type it does not convert, bytes that are not whole blocks.
    let dsrc = gpu.upload(&[0u8; 35]).expect("upload");
    for (ty, what) in [
        (GgmlType::Q5_K, "device dequantization of ggml type id"),
        (
            GgmlType::Q8_0,
            "dequantize: bytes not a whole number of blocks",
        ),
    ] {
        match dequantize_on_device(&gpu, ty, &dsrc, DequantTo::F16) {
            Err(CudaError::Unsupported { what: w, .. }) => assert_eq!(w, what),
            other => panic!("{ty}: {:?}", other.map(|b| b.len())),
        }
    }
}

/// An upload refused before it reaches the ring or the registration (here: a type the device
/// does not dequantize) reports zero stats, not those of the successful upload before it.
#[test]
fn a_refused_upload_does_not_report_the_previous_uploads_stats() {
    let Some(gpu) = gpu("a_refused_upload_does_not_report_the_previous_uploads_stats") else {
        return;
    };
    let ok = dequant_file();
    let g_ok = Gguf::parse(&ok).expect("parse");
    let fx = fixture();
    let g_refused = Gguf::parse(&fx).expect("parse");
    for path in [UploadPath::Staged, UploadPath::Registered] {
        let opts = UploadOptions {
            path,
            staging_bytes: 1 << 20,
            dequantize: Some(DequantTo::F16),
            ..UploadOptions::default()
        };
        let mut up = Uploader::new(&gpu, opts).expect("uploader");
        up.upload(&g_ok, |_| {}).expect("upload");
        match path {
            UploadPath::Staged => assert!(up.fill_stats().expect("staged").fills > 0),
            UploadPath::Registered => {
                assert!(up.register_times().expect("registered").register > Duration::ZERO)
            }
        }
        let r = up.upload(&g_refused, |_| panic!("no progress expected"));
        assert!(
            matches!(r, Err(DeviceUploadError::NotDequantizable { .. })),
            "{:?}",
            r.map(|w| w.len())
        );
        match path {
            UploadPath::Staged => {
                assert_eq!(up.fill_stats(), Some(FillStats::default()), "{path:?}")
            }
            UploadPath::Registered => assert_eq!(
                up.register_times(),
                Some(RegisterTimes::default()),
                "{path:?}"
            ),
        }
    }
}
