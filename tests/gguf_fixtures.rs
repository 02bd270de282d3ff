//! pagedkv's GGUF reader, dequantizer and writer against files written by llama.cpp's gguf-py
//! (tests/fixtures/make_fixtures.py; the oracle data is committed, so no Python is needed).

use std::path::{Path, PathBuf};

use half::{bf16, f16};
use pagedkv::gguf::GgufError;
use pagedkv::gguf::{
    dequantize_into, dequantize_into_bf16, dequantize_into_f16, dequantize_into_serial, GgmlType,
    Gguf, GgufBytes, GgufWriter, MetaValue, Value, ValueType,
};
use serde_json::Value as Json;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf")
        .join(name)
}

fn read(name: &str) -> Vec<u8> {
    std::fs::read(fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn json(name: &str) -> Json {
    serde_json::from_slice(&read(name)).expect("fixture json")
}

/// Compares a parsed value with the value make_fixtures.py passed to gguf-py.
fn assert_value(key: &str, v: &Value<'_>, ty: &str, expected: &Json, elem: Option<&str>) {
    assert_eq!(v.value_type().name(), ty, "{key}: type");
    match v {
        Value::String(s) => assert_eq!(Some(*s), expected.as_str(), "{key}"),
        Value::Bool(b) => assert_eq!(Some(*b), expected.as_bool(), "{key}"),
        Value::F32(x) => assert_eq!(Some(f64::from(*x)), expected.as_f64(), "{key}"),
        Value::F64(x) => assert_eq!(Some(*x), expected.as_f64(), "{key}"),
        Value::Array(a) => {
            let items = expected.as_array().expect("array");
            let elem = elem.expect("array element type");
            assert_eq!(a.elem_type().name(), elem, "{key}: element type");
            assert_eq!(a.len() as usize, items.len(), "{key}: length");
            for (i, (got, want)) in a.iter().zip(items).enumerate() {
                let sub_elem = match want {
                    Json::Array(inner) => Some(match inner.first() {
                        Some(Json::Number(_)) => "INT32",
                        _ => "STRING",
                    }),
                    _ => None,
                };
                let k = format!("{key}[{i}]");
                assert_value(&k, &got, elem, want, sub_elem);
                if let Some(g) = a.get(i as u64) {
                    assert_eq!(g, got, "{k}: get() agrees with iter()");
                }
            }
        }
        int => {
            let got = int.as_int().expect("integer");
            let want = expected
                .as_i64()
                .map(i128::from)
                .or(expected.as_u64().map(i128::from))
                .expect("integer in json");
            assert_eq!(got, want, "{key}");
        }
    }
}

fn check_tensor_table(g: &Gguf<'_>, meta: &Json) {
    let tensors = meta["tensors"].as_array().expect("tensors");
    assert_eq!(g.tensors().len(), tensors.len());
    for (t, want) in g.tensors().iter().zip(tensors) {
        assert_eq!(t.name(), want["name"].as_str().expect("name"));
        assert_eq!(t.ty().name(), want["type"].as_str().expect("type"));
        let shape: Vec<u64> = want["shape"]
            .as_array()
            .expect("shape")
            .iter()
            .map(|d| d.as_u64().expect("dim"))
            .collect();
        assert_eq!(t.shape(), &shape[..], "{}", t.name());
        assert_eq!(Some(t.offset()), want["offset"].as_u64(), "{}", t.name());
        assert_eq!(Some(t.n_bytes() as u64), want["n_bytes"].as_u64());
        assert_eq!(t.n_elements(), shape.iter().product::<u64>());
        let start = (g.data_offset() + t.offset()) as usize;
        assert_eq!(t.data(), &g.file_bytes()[start..start + t.n_bytes()]);
    }
}

fn check_all_types(g: &Gguf<'_>, version: u32) {
    let meta = json("all_types.meta.json");
    assert_eq!(g.version(), version);
    assert_eq!(g.alignment(), 32);
    assert_eq!(g.data_offset() % 32, 0);
    let entries = meta["metadata"].as_array().expect("metadata");
    assert_eq!(g.metadata().len(), entries.len());
    for ((key, v), want) in g.metadata().iter().zip(entries) {
        assert_eq!(*key, want["key"].as_str().expect("key"));
        assert_value(
            key,
            v,
            want["type"].as_str().expect("type"),
            &want["value"],
            want.get("elem").and_then(Json::as_str),
        );
        assert_eq!(g.get(key), Some(*v));
    }
    check_tensor_table(g, &meta);
}

#[test]
fn reads_every_metadata_type_as_gguf_py_wrote_it() {
    let bytes = read("all_types.gguf");
    check_all_types(&Gguf::parse(&bytes).expect("parse"), 3);
}

#[test]
fn reads_version_2() {
    let bytes = read("all_types_v2.gguf");
    check_all_types(&Gguf::parse(&bytes).expect("parse"), 2);
}

#[test]
fn reads_version_1() {
    let bytes = read("v1.gguf");
    let g = Gguf::parse(&bytes).expect("parse v1");
    assert_eq!(g.version(), 1);
    assert_eq!(g.get_str("general.name").expect("name"), "v1 model");
    assert_eq!(g.get_u32("v1.u32").expect("u32"), 123_456);
    let strs: Vec<_> = g
        .get_array("v1.arr_str")
        .expect("arr")
        .iter()
        .map(|v| v.as_str().expect("str").to_owned())
        .collect();
    assert_eq!(strs, ["x", "yz"]);
    let ints: Vec<_> = g
        .get_array("v1.arr_i16")
        .expect("arr")
        .iter()
        .map(|v| v.as_int().expect("int"))
        .collect();
    assert_eq!(ints, [-2, 3]);
    check_tensor_table(&g, &json("v1.meta.json"));
    let a = g.tensor("a").expect("a").dequantize().expect("f32");
    assert_eq!(a, (0..64).map(|i| i as f32 / 8.0).collect::<Vec<_>>());
    // Written back as version 1, byte for byte.
    let again = GgufWriter::from_gguf(&g)
        .expect("writer")
        .to_bytes()
        .expect("write");
    assert_eq!(again, bytes);
}

#[test]
fn reads_custom_alignment() {
    let bytes = read("align64.gguf");
    let g = Gguf::parse(&bytes).expect("parse");
    assert_eq!(g.alignment(), 64);
    assert_eq!(g.data_offset() % 64, 0);
    for (i, n) in [40u64, 7, 100].into_iter().enumerate() {
        let t = g.tensor(&format!("x{i}")).expect("tensor");
        assert_eq!(t.offset() % 64, 0);
        assert_eq!(t.shape(), &[n]);
        let want: Vec<f32> = (0..n).map(|x| x as f32).collect();
        assert_eq!(t.dequantize().expect("f32"), want);
    }
}

#[test]
fn refuses_big_endian_by_name() {
    let bytes = read("big_endian.gguf");
    assert!(matches!(
        Gguf::parse(&bytes),
        Err(GgufError::BigEndian { version: 3 })
    ));
}

fn oracle(name: &str) -> Vec<f32> {
    read(&format!("{name}.f32"))
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn assert_bits_eq(ty: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{ty}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
            "{ty}[{i}]: pagedkv {g:e} ({:#010x}) vs gguf-py {w:e} ({:#010x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

const DEQUANT_TYPES: [&str; 15] = [
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
    "Q6_K", "IQ4_NL", "MXFP4",
];

#[test]
fn dequantization_is_bit_exact_with_gguf_py() {
    let bytes = read("all_types.gguf");
    let g = Gguf::parse(&bytes).expect("parse");
    for ty in DEQUANT_TYPES {
        let t = g.tensor(&format!("t.{ty}")).expect("tensor");
        assert_eq!(t.ty().name(), ty);
        assert!(t.ty().can_dequantize());
        let want = oracle(ty);
        assert_bits_eq(ty, &t.dequantize().expect("dequantize"), &want);
        let mut serial = vec![0f32; want.len()];
        dequantize_into_serial(t.ty(), t.data(), &mut serial).expect("serial");
        assert_bits_eq(ty, &serial, &want);
        // f16 / bf16 outputs are the f32 results rounded to nearest even.
        let mut h = vec![f16::ZERO; want.len()];
        dequantize_into_f16(t.ty(), t.data(), &mut h).expect("f16");
        let mut b = vec![bf16::ZERO; want.len()];
        dequantize_into_bf16(t.ty(), t.data(), &mut b).expect("bf16");
        for i in 0..want.len() {
            assert_eq!(
                h[i].to_bits(),
                f16::from_f32(want[i]).to_bits(),
                "{ty}[{i}] f16"
            );
            assert_eq!(
                b[i].to_bits(),
                bf16::from_f32(want[i]).to_bits(),
                "{ty}[{i}] bf16"
            );
        }
    }
}

/// The parallel path splits work at chunk boundaries; it must equal the serial path exactly on
/// tensors far above the parallel threshold and with a ragged last chunk.
#[test]
fn parallel_dequantization_equals_serial() {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for ty in DEQUANT_TYPES {
        let ty = GgmlType::from_name(ty).expect("type");
        let n_blocks = (1usize << 19) / ty.block_size() as usize + 3;
        let mut src: Vec<u8> = (0..n_blocks * ty.type_size() as usize)
            .map(|_| next() as u8)
            .collect();
        if ty == GgmlType::F32 {
            // keep NaN payloads out of the comparison
            for c in src.chunks_exact_mut(4) {
                c[3] &= 0x7E;
            }
        }
        let n = n_blocks * ty.block_size() as usize;
        let (mut par, mut ser) = (vec![0f32; n], vec![0f32; n]);
        dequantize_into(ty, &src, &mut par).expect("parallel");
        dequantize_into_serial(ty, &src, &mut ser).expect("serial");
        assert_bits_eq(ty.name(), &par, &ser);
    }
}

#[test]
fn dequantize_refuses_mismatched_lengths_and_unsupported_types() {
    let mut out = vec![0f32; 32];
    assert!(matches!(
        dequantize_into(GgmlType::Q4_0, &[0u8; 17], &mut out),
        Err(GgufError::DequantLength { .. })
    ));
    assert!(matches!(
        dequantize_into(GgmlType::Q4_0, &[0u8; 36], &mut out),
        Err(GgufError::DequantLength { .. })
    ));
    assert!(matches!(
        dequantize_into(GgmlType::IQ2_XXS, &[0u8; 66], &mut vec![0f32; 256]),
        Err(GgufError::UnsupportedDequant(GgmlType::IQ2_XXS))
    ));
}

#[test]
fn writer_reproduces_gguf_py_files_byte_for_byte() {
    for name in ["all_types.gguf", "all_types_v2.gguf", "align64.gguf"] {
        let bytes = read(name);
        let g = Gguf::parse(&bytes).expect("parse");
        let again = GgufWriter::from_gguf(&g)
            .expect("writer")
            .to_bytes()
            .expect("write");
        assert_eq!(again.len(), bytes.len(), "{name}");
        assert!(again == bytes, "{name}: re-encoded bytes differ");
    }
}

#[test]
fn writer_builds_files_the_parser_reads_back() {
    let q4 = [7u8; 18 * 4];
    let f = [1.5f32, -2.0, 0.25].map(f32::to_le_bytes).concat();
    let mut w = GgufWriter::new();
    w.add("general.architecture", MetaValue::String("llama".into()))
        .expect("add")
        .add("general.alignment", MetaValue::U32(128))
        .expect("add")
        .add("k.strs", MetaValue::strings(["a", "bc"]))
        .expect("add")
        .add(
            "k.nested",
            MetaValue::Array {
                elem: ValueType::Array,
                items: vec![MetaValue::Array {
                    elem: ValueType::F64,
                    items: vec![MetaValue::F64(1.0)],
                }],
            },
        )
        .expect("add")
        .add(
            "k.empty",
            MetaValue::Array {
                elem: ValueType::U32,
                items: vec![],
            },
        )
        .expect("add");
    w.add_tensor("q", GgmlType::Q4_0, &[64, 2], &q4)
        .expect("tensor");
    w.add_tensor("f", GgmlType::F32, &[3], &f).expect("tensor");
    let bytes = w.to_bytes().expect("write");
    let g = Gguf::parse(&bytes).expect("parse");
    assert_eq!(g.alignment(), 128);
    assert_eq!(g.tensor("f").expect("f").offset(), 128);
    assert_eq!(g.tensor("q").expect("q").data(), &q4[..]);
    assert_eq!(
        g.tensor("f").expect("f").dequantize().expect("f32"),
        [1.5, -2.0, 0.25]
    );
    assert!(g.get_array("k.empty").expect("empty").is_empty());
    let nested = g.get_array("k.nested").expect("nested");
    let inner = nested.get(0).and_then(|v| v.as_array()).expect("inner");
    assert_eq!(inner.get(0), Some(Value::F64(1.0)));
    // Writer-side validation mirrors the parser's.
    assert!(matches!(
        w.add("k.strs", MetaValue::U8(1)),
        Err(GgufError::DuplicateKey { .. })
    ));
    assert!(matches!(
        w.add_tensor("q", GgmlType::F32, &[3], &f),
        Err(GgufError::DuplicateTensor { .. })
    ));
    assert!(matches!(
        w.add_tensor("x", GgmlType::Q4_0, &[48], &q4[..27]),
        Err(GgufError::NotBlockMultiple { .. })
    ));
    assert!(matches!(
        w.add_tensor("x", GgmlType::F32, &[4], &f),
        Err(GgufError::Unwritable(_))
    ));
    assert!(matches!(
        w.add(
            "k.mixed",
            MetaValue::Array {
                elem: ValueType::U8,
                items: vec![MetaValue::U8(1), MetaValue::I8(1)]
            }
        ),
        Err(GgufError::Unwritable(_))
    ));
    assert!(matches!(
        GgufWriter::new().add("general.alignment", MetaValue::U32(48)),
        Err(GgufError::BadAlignment(48))
    ));
}

#[test]
fn llama_params_of_absurd_counts_have_no_cache_size() {
    // Every count positive and dividing: a valid header, not a model whose cache size fits
    // in 64 bits.
    let mut w = GgufWriter::new();
    w.add("general.architecture", MetaValue::String("llama".into()))
        .and_then(|w| w.add("llama.block_count", MetaValue::U32(u32::MAX)))
        .and_then(|w| w.add("llama.attention.head_count", MetaValue::U32(u32::MAX)))
        .and_then(|w| w.add("llama.embedding_length", MetaValue::U32(u32::MAX)))
        .and_then(|w| w.add("llama.context_length", MetaValue::U32(1)))
        .and_then(|w| {
            w.add(
                "llama.attention.layer_norm_rms_epsilon",
                MetaValue::F32(1e-5),
            )
        })
        .expect("metadata");
    let bytes = w.to_bytes().expect("write");
    let p = Gguf::parse(&bytes)
        .expect("parse")
        .llama_params()
        .expect("params");
    assert_eq!(
        (p.n_layers, p.n_kv_heads, p.head_dim),
        (u32::MAX, u32::MAX, 1)
    );
    assert_eq!(p.kv_bytes_per_token(2), None);
    assert_eq!(p.kv_bytes_per_token(1), None);
}

#[test]
fn writer_refuses_a_layout_past_64_bits() {
    // Two deferred tensors of 2^63 bytes each: each is a valid size, their offsets are not.
    let mut w = GgufWriter::new();
    w.add_tensor_deferred("a", GgmlType::F64, &[1 << 60])
        .and_then(|w| w.add_tensor_deferred("b", GgmlType::F64, &[1 << 60]))
        .expect("each tensor alone is valid");
    assert!(matches!(w.file_len(), Err(GgufError::DataOffsetOverflow)));
    let r = w.write_streaming(std::io::sink(), |_, _, _| unreachable!("refused first"));
    assert!(matches!(r, Err(GgufError::DataOffsetOverflow)));
}

#[test]
fn llama_params_from_gguf_py_file() {
    let bytes = read("all_types.gguf");
    let p = Gguf::parse(&bytes)
        .expect("parse")
        .llama_params()
        .expect("params");
    assert_eq!(p.architecture, "llama");
    assert_eq!(p.n_layers, 4);
    assert_eq!(p.n_heads, 8);
    assert_eq!(p.n_kv_heads, 2);
    assert_eq!(p.head_dim, 64);
    assert_eq!(p.head_dim_v, 64);
    assert_eq!(p.embedding_length, 512);
    assert_eq!(p.context_length, 4096);
    assert_eq!(p.rope_freq_base, 500_000.0);
    assert_eq!(p.norm_eps, 1e-5f32);
    assert_eq!(p.kv_bytes_per_token(2), Some(4 * 2 * 128 * 2));
}

#[test]
fn mapped_and_read_files_parse_alike() {
    let path = fixture("all_types.gguf");
    // SAFETY: the fixture is a committed file that no test writes or truncates.
    let mapped = unsafe { GgufBytes::map(&path) }.expect("map");
    let owned = GgufBytes::read(&path).expect("read");
    let a = Gguf::parse(mapped.bytes()).expect("parse mapped");
    let b = Gguf::parse(owned.bytes()).expect("parse owned");
    assert_eq!(a.metadata(), b.metadata());
    assert_eq!(a.tensors(), b.tensors());
    let sizes: Vec<usize> = a
        .tensors_largest_first()
        .iter()
        .map(|t| t.n_bytes())
        .collect();
    assert!(sizes.windows(2).all(|w| w[0] >= w[1]));
    assert_eq!(sizes.len(), a.tensors().len());
    assert!(matches!(
        GgufBytes::read(Path::new("/nonexistent/x.gguf")),
        Err(GgufError::Io { .. })
    ));
}

/// The narrow outputs write one canonical NaN (0x7E00 / 0x7FC0) for every NaN, whatever the
/// sign and payload the f32 arithmetic gave it: the device dequantizer must match them bit for
/// bit, and a NaN's payload is the one thing IEEE 754 leaves to the hardware.
#[test]
fn narrow_outputs_write_one_canonical_nan() {
    // Q8_0 blocks whose scale is a signalling NaN with a payload, a negative quiet NaN, and
    // infinity (so q = 0 gives inf * 0 = NaN and the rest give infinities).
    let mut src = Vec::new();
    for scale in [0x7C01u16, 0xFE55, 0x7C00] {
        src.extend_from_slice(&scale.to_le_bytes());
        src.extend((0..32).map(|i: i32| (i - 16) as i8 as u8));
    }
    let mut h = vec![f16::ZERO; 96];
    let mut b = vec![bf16::ZERO; 96];
    dequantize_into_f16(GgmlType::Q8_0, &src, &mut h).expect("f16");
    dequantize_into_bf16(GgmlType::Q8_0, &src, &mut b).expect("bf16");
    for i in 0..96 {
        let q = (i % 32) as i32 - 16;
        let (wh, wb) = if i < 64 || q == 0 {
            (0x7E00, 0x7FC0)
        } else if q > 0 {
            (0x7C00, 0x7F80)
        } else {
            (0xFC00, 0xFF80)
        };
        assert_eq!((h[i].to_bits(), b[i].to_bits()), (wh, wb), "element {i}");
    }
    // F32 NaNs with payloads and signs.
    let nans: Vec<u8> = [0x7FC0_0001u32, 0xFF80_0001, 0x7FFF_FFFF]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let mut h = vec![f16::ZERO; 3];
    let mut b = vec![bf16::ZERO; 3];
    dequantize_into_f16(GgmlType::F32, &nans, &mut h).expect("f16");
    dequantize_into_bf16(GgmlType::F32, &nans, &mut b).expect("bf16");
    assert!(h.iter().all(|x| x.to_bits() == 0x7E00));
    assert!(b.iter().all(|x| x.to_bits() == 0x7FC0));
}

/// The f16 narrowing of one f32, as the library defined it before its vectorized rewrite:
/// `f16::from_f32`, every NaN canonical.
fn f16_reference(x: u32) -> u16 {
    let f = f32::from_bits(x);
    if f.is_nan() {
        0x7E00
    } else {
        f16::from_f32(f).to_bits()
    }
}

/// Checks `dequantize_into_f16` (through the F32 source type, whose dequantization is the
/// identity) against [`f16_reference`] for every f32 in `xs`.
fn check_f16_narrowing(xs: &[u32]) {
    let src: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut h = vec![f16::ZERO; xs.len()];
    dequantize_into_f16(GgmlType::F32, &src, &mut h).expect("f16");
    for (&x, got) in xs.iter().zip(&h) {
        assert_eq!(got.to_bits(), f16_reference(x), "f32 bits {x:#010x}");
    }
}

/// The f16 narrowing rounds as `f16::from_f32` does for every f32 that is not a NaN (NaNs are
/// canonical). Where f16 rounds depends on the exponent (13 dropped mantissa bits for normal
/// results, up to 24 for subnormal ones, all for underflow to zero), so for every sign and
/// exponent (zeros, f32 subnormals, infinities and every NaN class included), every cut
/// position k of the mantissa is covered with the dropped bits around the tie (0, 1, just
/// below, at and just above it, all ones) under kept bits of both parities, plus the
/// neighbourhoods of 65504 (the largest f16), 65520 (the tie that overflows) and 2^-24 / 2^-25.
/// Through the parallel path. (All 2^32 inputs: `f16_narrowing_every_f32`, ignored.)
#[test]
fn f16_narrowing_rounds_every_boundary_as_from_f32() {
    let mut mans = std::collections::BTreeSet::new();
    for k in 0..=23u32 {
        let drop_mask = (1u32 << k) - 1;
        let tie = if k == 0 { 0 } else { 1u32 << (k - 1) };
        let lows = [
            0,
            1 & drop_mask,
            tie.saturating_sub(1),
            tie,
            (tie + 1) & drop_mask,
            drop_mask,
        ];
        let kept_bits = 23 - k;
        let kept_mask = if kept_bits == 0 {
            0
        } else {
            (1u32 << kept_bits) - 1
        };
        let highs = [0, 1, 2, 3, kept_mask >> 1, kept_mask & !1, kept_mask];
        for &hi in &highs {
            for &lo in &lows {
                mans.insert(((hi & kept_mask) << k | lo) & 0x7F_FFFF);
            }
        }
    }
    // A few pseudo-random mantissas per exponent as well.
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    for _ in 0..64 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        mans.insert(state as u32 & 0x7F_FFFF);
    }
    let mut xs: Vec<u32> = (0..512u32)
        .flat_map(|se| mans.iter().map(move |&m| se << 23 | m))
        .collect();
    for center in [
        65504.0f32,
        65520.0,
        65536.0,
        2f32.powi(-24),
        2f32.powi(-25),
        2f32.powi(-14),
    ] {
        let c = center.to_bits();
        for d in 0..=64u32 {
            for x in [c + d, c - d] {
                xs.push(x);
                xs.push(x | 0x8000_0000);
            }
        }
    }
    check_f16_narrowing(&xs);
}

/// Every f32 (2^32 of them, about a minute in release): the f16 narrowing equals
/// `f16::from_f32` with canonical NaNs, and `f16::from_f32` equals half's software conversion
/// (`from_f32_const`, what it uses without F16C): on an F16C machine, the hardware and software
/// conversions agree, so the result does not depend on which one a CPU gets.
#[test]
#[ignore = "exhaustive: run by hand in release"]
fn f16_narrowing_every_f32() {
    const STEP: u64 = 1 << 22;
    let mut xs = vec![0u32; STEP as usize];
    for start in (0..1u64 << 32).step_by(STEP as usize) {
        for (i, x) in xs.iter_mut().enumerate() {
            *x = (start + i as u64) as u32;
        }
        check_f16_narrowing(&xs);
        for &x in &xs {
            let f = f32::from_bits(x);
            if !f.is_nan() {
                assert_eq!(
                    f16::from_f32(f).to_bits(),
                    f16::from_f32_const(f).to_bits(),
                    "f32 bits {x:#010x}"
                );
            }
        }
    }
}

/// The bf16 narrowing rounds as `bf16::from_f32` does for every f32 that is not a NaN (NaNs are
/// canonical): every upper half with the lower halves where rounding decides (0, 1, just
/// below, at and above the tie, all ones), through the parallel path.
#[test]
fn bf16_narrowing_rounds_every_upper_half_as_from_f32() {
    const LOWS: [u32; 7] = [0, 1, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF];
    let xs: Vec<u32> = (0..=0xFFFFu32)
        .flat_map(|hi| LOWS.iter().map(move |&lo| hi << 16 | lo))
        .collect();
    let src: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut b = vec![bf16::ZERO; xs.len()];
    dequantize_into_bf16(GgmlType::F32, &src, &mut b).expect("bf16");
    for (&x, got) in xs.iter().zip(&b) {
        let f = f32::from_bits(x);
        let want = if f.is_nan() {
            0x7FC0
        } else {
            bf16::from_f32(f).to_bits()
        };
        assert_eq!(got.to_bits(), want, "f32 bits {x:#010x}");
    }
}
