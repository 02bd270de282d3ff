//! GGUF benches.
//!
//! * `gguf_header_parse`: parse the header of a llama-shaped file with 1,000 tensors and a
//!   32,000-entry vocabulary. pagedkv's zero-copy parser beside "candle-style": our
//!   re-implementation of the owned-value reader design of candle's `gguf_file::Content::read`
//!   (every key, string and array element copied into a `String`/`Vec`, tensors in a
//!   `HashMap<String, _>`), which is the common shape of Rust GGUF readers.
//! * `gguf_dequant/<TYPE>`: dequantize 2^20 elements to f32, pagedkv parallel and serial, beside
//!   a `memcpy` of the output bytes (the floor any dequantizer pays to write its output).
//!
//! * `gguf_dequant_bf16/<TYPE>`: `dequantize_into_bf16` (the device dequantizer's oracle,
//!   NaNs canonical) beside the same staged, parallel conversion narrowing with a plain
//!   `bf16::from_f32` (no NaN canonicalization).
//! * `gguf_dequant_f16/<TYPE>`: `dequantize_into_f16` beside the same schedule narrowing with a
//!   plain `f16::from_f32`, with `f16::from_f32` and a NaN branch (the library's narrowing
//!   before its vectorized rewrite) and with half's `convert_from_f32_slice`.
//!
//! Correctness is checked inside each group before timing: both parsers must agree on the
//! header, and parallel dequantization must equal the serial reference bit for bit.

use std::collections::HashMap;
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pagedkv::gguf::{
    dequantize_into, dequantize_into_bf16, dequantize_into_f16, dequantize_into_serial, GgmlType,
    Gguf, GgufWriter, MetaValue, ValueType,
};
use rayon::prelude::*;

/// A llama-shaped file: 1,000 tiny tensors, 30 scalar keys, a 32,000-token vocabulary.
fn header_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add("general.architecture", MetaValue::String("llama".into()))
        .expect("add");
    for i in 0..30u32 {
        w.add(&format!("llama.key_{i}"), MetaValue::U32(i))
            .expect("add");
    }
    w.add(
        "tokenizer.ggml.tokens",
        MetaValue::strings((0..32_000).map(|i| format!("tok_{i}"))),
    )
    .expect("add");
    w.add(
        "tokenizer.ggml.scores",
        MetaValue::Array {
            elem: ValueType::F32,
            items: (0..32_000).map(|i| MetaValue::F32(i as f32)).collect(),
        },
    )
    .expect("add");
    let blob: &'static [u8] = Box::leak(vec![0u8; 1000 * 64].into_boxed_slice());
    for i in 0..1000 {
        let layer = i / 10;
        w.add_tensor(
            &format!("blk.{layer}.tensor_{}.weight", i % 10),
            GgmlType::F32,
            &[4, 4],
            &blob[i * 64..i * 64 + 64],
        )
        .expect("tensor");
    }
    w.to_bytes().expect("write")
}

/// The candle-style owned reader (see the module docs).
mod owned {
    use super::HashMap;

    // The baseline materialises every value as an owned reader does; the bench times only
    // that, so most payloads are never read back.
    #[allow(dead_code)]
    #[derive(Debug)]
    pub enum Value {
        Int(i128),
        F32(f32),
        F64(f64),
        Bool(bool),
        String(String),
        Array(Vec<Value>),
    }

    #[derive(Debug)]
    pub struct TensorInfo {
        pub ty: u32,
        pub shape: Vec<u64>,
        pub offset: u64,
    }

    #[derive(Debug)]
    pub struct Content {
        pub metadata: HashMap<String, Value>,
        pub tensors: HashMap<String, TensorInfo>,
    }

    struct R<'a>(&'a [u8]);

    impl R<'_> {
        fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
            let (h, t) = self.0.split_first_chunk::<N>()?;
            self.0 = t;
            Some(*h)
        }
        fn u32(&mut self) -> Option<u32> {
            self.take().map(u32::from_le_bytes)
        }
        fn u64(&mut self) -> Option<u64> {
            self.take().map(u64::from_le_bytes)
        }
        fn string(&mut self) -> Option<String> {
            let n = usize::try_from(self.u64()?).ok()?;
            if n > self.0.len() {
                return None;
            }
            let (s, t) = self.0.split_at(n);
            self.0 = t;
            String::from_utf8(s.to_vec()).ok()
        }
        fn value(&mut self, ty: u32) -> Option<Value> {
            Some(match ty {
                0 => Value::Int(self.take::<1>()?[0].into()),
                1 => Value::Int((self.take::<1>()?[0] as i8).into()),
                2 => Value::Int(u16::from_le_bytes(self.take()?).into()),
                3 => Value::Int(i16::from_le_bytes(self.take()?).into()),
                4 => Value::Int(self.u32()?.into()),
                5 => Value::Int(i32::from_le_bytes(self.take()?).into()),
                6 => Value::F32(f32::from_le_bytes(self.take()?)),
                7 => Value::Bool(self.take::<1>()?[0] != 0),
                8 => Value::String(self.string()?),
                9 => {
                    let elem = self.u32()?;
                    let n = self.u64()?;
                    let mut v = Vec::new();
                    for _ in 0..n {
                        v.push(self.value(elem)?);
                    }
                    Value::Array(v)
                }
                10 => Value::Int(self.u64()?.into()),
                11 => Value::Int(i64::from_le_bytes(self.take()?).into()),
                12 => Value::F64(f64::from_le_bytes(self.take()?)),
                _ => return None,
            })
        }
    }

    pub fn read(bytes: &[u8]) -> Option<Content> {
        let mut r = R(bytes);
        r.take::<4>().filter(|m| m == b"GGUF")?;
        r.u32().filter(|v| *v == 3)?;
        let n_tensors = r.u64()?;
        let n_kv = r.u64()?;
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let k = r.string()?;
            let ty = r.u32()?;
            metadata.insert(k, r.value(ty)?);
        }
        let mut tensors = HashMap::new();
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()?;
            let shape = (0..n_dims).map(|_| r.u64()).collect::<Option<Vec<_>>>()?;
            let ty = r.u32()?;
            let offset = r.u64()?;
            tensors.insert(name, TensorInfo { ty, shape, offset });
        }
        Some(Content { metadata, tensors })
    }
}

fn bench_header(c: &mut Criterion) {
    let file = header_file();
    let g = Gguf::parse(&file).expect("parse");
    let o = owned::read(&file).expect("owned parse");
    // Correctness: both readers see the same header.
    assert_eq!(g.tensors().len(), 1000);
    assert_eq!(o.tensors.len(), 1000);
    assert_eq!(o.metadata.len(), g.metadata().len());
    for t in g.tensors() {
        let ot = &o.tensors[t.name()];
        assert_eq!(
            (ot.ty, &ot.shape[..], ot.offset),
            (t.ty().id(), t.shape(), t.offset())
        );
    }
    match &o.metadata["tokenizer.ggml.tokens"] {
        owned::Value::Array(v) => assert_eq!(
            v.len() as u64,
            g.get_array("tokenizer.ggml.tokens").expect("tokens").len()
        ),
        other => panic!("tokens: {other:?}"),
    }

    let header_bytes = g.data_offset();
    let mut grp = c.benchmark_group("gguf_header_parse");
    grp.throughput(Throughput::Bytes(header_bytes));
    grp.bench_function(BenchmarkId::new("pagedkv", "1000_tensors_32k_vocab"), |b| {
        b.iter(|| Gguf::parse(black_box(&file)).map(|g| g.tensors().len()))
    });
    grp.bench_function(
        BenchmarkId::new("candle-style", "1000_tensors_32k_vocab"),
        |b| b.iter(|| owned::read(black_box(&file)).map(|c| c.tensors.len())),
    );
    grp.finish();
}

fn bench_dequant(c: &mut Criterion) {
    const N: usize = 1 << 20;
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let types = [
        "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
        "Q5_K", "Q6_K", "IQ4_NL", "MXFP4",
    ];
    let mut grp = c.benchmark_group("gguf_dequant");
    grp.throughput(Throughput::Bytes((N * 4) as u64));
    for name in types {
        let ty = GgmlType::from_name(name).expect("type");
        let n_bytes = N / ty.block_size() as usize * ty.type_size() as usize;
        let src: Vec<u8> = (0..n_bytes)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        let mut par = vec![0f32; N];
        let mut ser = vec![0f32; N];
        dequantize_into(ty, &src, &mut par).expect("parallel");
        dequantize_into_serial(ty, &src, &mut ser).expect("serial");
        assert!(
            par.iter()
                .zip(&ser)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}: parallel != serial"
        );
        grp.bench_function(BenchmarkId::new("pagedkv", name), |b| {
            b.iter(|| dequantize_into(ty, black_box(&src), black_box(&mut par)))
        });
        grp.bench_function(BenchmarkId::new("pagedkv_serial", name), |b| {
            b.iter(|| dequantize_into_serial(ty, black_box(&src), black_box(&mut ser)))
        });
        let out = par.clone();
        grp.bench_function(BenchmarkId::new("memcpy_out", name), |b| {
            b.iter(|| black_box(&mut ser).copy_from_slice(black_box(&out)))
        });
    }
    grp.finish();
}

/// Random source bytes of `ty` for `n` elements with finite scales (and finite F16 values), so
/// that no element is a NaN and a conversion without NaN canonicalization agrees bit for bit.
fn narrow_src(ty: GgmlType, n: usize, state: &mut u64) -> Vec<u8> {
    let n_bytes = n / ty.block_size() as usize * ty.type_size() as usize;
    let mut src: Vec<u8> = (0..n_bytes)
        .map(|_| {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            *state as u8
        })
        .collect();
    let scale_at: &[usize] = match ty {
        GgmlType::Q8_0 => &[0],
        GgmlType::Q4_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        _ => &[],
    };
    for blk in src.chunks_exact_mut(ty.type_size() as usize) {
        for &at in scale_at {
            blk[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        }
        if ty == GgmlType::F16 {
            blk[1] &= 0x3F; // exponent below 0x1F: finite
        }
    }
    src
}

/// The library's narrow schedule (src/gguf/dequant.rs, `dequantize_narrow`: rayon over chunks
/// of 2^14 elements, each dequantized 4,096 at a time into a stack buffer that stays in L1,
/// then narrowed), narrowing each staged buffer with `narrow`.
fn staged<T: Send>(
    ty: GgmlType,
    src: &[u8],
    dst: &mut [T],
    narrow: impl Fn(&mut [T], &[f32]) + Sync,
) {
    const CHUNK: usize = 1 << 14;
    const STAGE: usize = 4096;
    let ts = ty.type_size() as usize;
    let chunk_bytes = CHUNK / ty.block_size() as usize * ts;
    let stage_bytes = STAGE / ty.block_size() as usize * ts;
    dst.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(chunk_bytes))
        .for_each(|(y, b)| {
            let mut buf = [0f32; STAGE];
            for (yc, bc) in y.chunks_mut(STAGE).zip(b.chunks(stage_bytes)) {
                let tmp = &mut buf[..yc.len()];
                dequantize_into_serial(ty, bc, tmp).expect("f32");
                narrow(yc, tmp);
            }
        });
}

/// `dequantize_into_bf16` (the device dequantizer's oracle: f32, then round to nearest even,
/// every NaN canonical) beside the same conversion without the NaN canonicalization: the same
/// schedule as the library's ([`staged`]), narrowing with a plain `bf16::from_f32`. So the two
/// differ only by the one NaN check per element that makes the narrow output a function of the
/// input bits. (A baseline that dequantized the whole tensor to f32 first and then narrowed it
/// on one thread would add a 4 MiB round trip through memory and a serial pass the library
/// does not make.)
fn bench_dequant_bf16(c: &mut Criterion) {
    const N: usize = 1 << 20;
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut grp = c.benchmark_group("gguf_dequant_bf16");
    grp.throughput(Throughput::Bytes((N * 2) as u64));
    for name in ["F16", "Q8_0", "Q4_K", "Q6_K"] {
        let ty = GgmlType::from_name(name).expect("type");
        let src = narrow_src(ty, N, &mut state);
        let mut ours = vec![half::bf16::ZERO; N];
        let mut plain = vec![half::bf16::ZERO; N];
        let narrow_plain = |yc: &mut [half::bf16], tmp: &[f32]| {
            for (d, &x) in yc.iter_mut().zip(tmp) {
                *d = half::bf16::from_f32(x);
            }
        };
        dequantize_into_bf16(ty, &src, &mut ours).expect("bf16");
        staged(ty, &src, &mut plain, narrow_plain);
        assert!(
            ours.iter()
                .zip(&plain)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}: bf16 outputs differ"
        );
        grp.bench_function(BenchmarkId::new("pagedkv", name), |b| {
            b.iter(|| dequantize_into_bf16(ty, black_box(&src), black_box(&mut ours)))
        });
        grp.bench_function(BenchmarkId::new("staged_from_f32", name), |b| {
            b.iter(|| staged(ty, black_box(&src), black_box(&mut plain), narrow_plain))
        });
    }
    grp.finish();
}

/// `dequantize_into_f16` (the device dequantizer's oracle, NaNs canonical) beside, on the same
/// schedule ([`staged`]): `staged_from_f32`, narrowing with a plain `f16::from_f32` (no NaN
/// canonicalization), and `staged_from_f32_canon`, the library's narrowing before its
/// vectorized rewrite (`f16::from_f32` per element, a NaN branch), and `staged_slice`, half's
/// `convert_from_f32_slice` (F16C eight at a time where the CPU has it) with no NaN pass.
fn bench_dequant_f16(c: &mut Criterion) {
    use half::slice::HalfFloatSliceExt;
    const N: usize = 1 << 20;
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut grp = c.benchmark_group("gguf_dequant_f16");
    grp.throughput(Throughput::Bytes((N * 2) as u64));
    for name in ["F16", "Q8_0", "Q4_K", "Q6_K"] {
        let ty = GgmlType::from_name(name).expect("type");
        let src = narrow_src(ty, N, &mut state);
        let mut ours = vec![half::f16::ZERO; N];
        let mut other = vec![half::f16::ZERO; N];
        let narrow_plain = |yc: &mut [half::f16], tmp: &[f32]| {
            for (d, &x) in yc.iter_mut().zip(tmp) {
                *d = half::f16::from_f32(x);
            }
        };
        let narrow_canon = |yc: &mut [half::f16], tmp: &[f32]| {
            for (d, &x) in yc.iter_mut().zip(tmp) {
                *d = if x.is_nan() {
                    pagedkv::gguf::F16_CANONICAL_NAN
                } else {
                    half::f16::from_f32(x)
                };
            }
        };
        let narrow_slice = |yc: &mut [half::f16], tmp: &[f32]| yc.convert_from_f32_slice(tmp);
        dequantize_into_f16(ty, &src, &mut ours).expect("f16");
        for narrow in [
            &narrow_plain as &(dyn Fn(&mut [half::f16], &[f32]) + Sync),
            &narrow_canon,
            &narrow_slice,
        ] {
            other.fill(half::f16::ZERO);
            staged(ty, &src, &mut other, narrow);
            assert!(
                ours.iter()
                    .zip(&other)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name}: f16 outputs differ"
            );
        }
        grp.bench_function(BenchmarkId::new("pagedkv", name), |b| {
            b.iter(|| dequantize_into_f16(ty, black_box(&src), black_box(&mut ours)))
        });
        grp.bench_function(BenchmarkId::new("staged_from_f32", name), |b| {
            b.iter(|| staged(ty, black_box(&src), black_box(&mut other), narrow_plain))
        });
        grp.bench_function(BenchmarkId::new("staged_from_f32_canon", name), |b| {
            b.iter(|| staged(ty, black_box(&src), black_box(&mut other), narrow_canon))
        });
        grp.bench_function(BenchmarkId::new("staged_slice", name), |b| {
            b.iter(|| staged(ty, black_box(&src), black_box(&mut other), narrow_slice))
        });
    }
    grp.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench_header, bench_dequant, bench_dequant_bf16, bench_dequant_f16
}
criterion_main!(benches);
