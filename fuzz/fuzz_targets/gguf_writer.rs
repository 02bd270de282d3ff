//! Fuzz the GGUF writer's API (`GgufWriter::add`, `add_tensor`, `add_tensor_deferred`,
//! `with_version`, `file_len`, `to_bytes`, `write_streaming`) with arbitrary metadata (nested
//! arrays, mismatched item types, the alignment key, llama hyperparameter keys) and tensors
//! (every type, arbitrary shapes, wrong data lengths), then read the result back with
//! `Gguf::parse`, `llama_params` and the dequantizers.
//!
//! Checks: every call is accepted exactly when a model of the format's rules says so, and a
//! refused call leaves the writer unchanged; `file_len` is what is written; whatever the writer
//! produces parses, with the same metadata (bit for bit, in order), tensors (name, type, shape,
//! bytes) and alignment; `llama_params` on it returns values consistent with its own rules.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pagedkv::gguf::{
    dequantize_into, Gguf, GgufWriter, MetaValue, Value, ValueType, ALIGNMENT_KEY, ALL_TYPES,
    MAX_ARRAY_DEPTH, MAX_DIMS,
};

#[derive(Debug, Arbitrary)]
struct Input {
    version: u8,
    ops: Vec<WOp>,
}

#[derive(Debug, Arbitrary)]
enum WOp {
    Meta {
        key: Key,
        value: FMeta,
    },
    Tensor {
        name: u8,
        ty: u8,
        shape: Vec<u8>,
        delta: i8,
        deferred: bool,
    },
    /// Every key `llama_params` requires, with small values (so it often succeeds).
    Llama {
        layers: u8,
        heads: u8,
        kv: u8,
        embd: u16,
        ctx: u8,
        per_layer: bool,
    },
}

#[derive(Debug, Arbitrary)]
enum Key {
    Llama(u8),
    Alignment,
    Other(String),
}

const LLAMA_KEYS: [&str; 12] = [
    "general.architecture",
    "llama.block_count",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.embedding_length",
    "llama.attention.key_length",
    "llama.attention.value_length",
    "llama.context_length",
    "llama.rope.freq_base",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.attention.layer_norm_epsilon",
    "general.name",
];

#[derive(Debug, Arbitrary)]
enum FMeta {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    SmallU32(u8),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Llama,
    Array { elem: u8, items: Vec<FMeta> },
    U64(u64),
    I64(i64),
    F64(f64),
}

fn vt(id: u8) -> ValueType {
    ValueType::from_id(u32::from(id % 13)).expect("0..13 are the value types")
}

fn meta(f: &FMeta, budget: &mut usize) -> MetaValue {
    *budget = budget.saturating_sub(1);
    match f {
        FMeta::U8(x) => MetaValue::U8(*x),
        FMeta::I8(x) => MetaValue::I8(*x),
        FMeta::U16(x) => MetaValue::U16(*x),
        FMeta::I16(x) => MetaValue::I16(*x),
        FMeta::U32(x) => MetaValue::U32(*x),
        FMeta::SmallU32(x) => MetaValue::U32(u32::from(*x % 65)),
        FMeta::I32(x) => MetaValue::I32(*x),
        FMeta::F32(x) => MetaValue::F32(*x),
        FMeta::Bool(x) => MetaValue::Bool(*x),
        FMeta::Str(s) => MetaValue::String(s.clone()),
        FMeta::Llama => MetaValue::String("llama".into()),
        FMeta::Array { elem, items } => {
            let items: Vec<MetaValue> = items
                .iter()
                .take(*budget)
                .map(|i| meta(i, budget))
                .collect();
            // Mostly the first item's type, so well-formed arrays are common.
            let elem = if *elem < 200 {
                items.first().map_or(vt(*elem), MetaValue::value_type)
            } else {
                vt(*elem)
            };
            MetaValue::Array { elem, items }
        }
        FMeta::U64(x) => MetaValue::U64(*x),
        FMeta::I64(x) => MetaValue::I64(*x),
        FMeta::F64(x) => MetaValue::F64(*x),
    }
}

/// The format's rule for a value: arrays at most MAX_ARRAY_DEPTH deep, items of the element type.
fn well_formed(v: &MetaValue, depth: u32) -> bool {
    match v {
        MetaValue::Array { elem, items } => {
            depth < MAX_ARRAY_DEPTH
                && items
                    .iter()
                    .all(|i| i.value_type() == *elem && well_formed(i, depth + 1))
        }
        _ => true,
    }
}

/// Bitwise equality (NaNs with their payloads).
fn same(a: &MetaValue, b: &MetaValue) -> bool {
    match (a, b) {
        (MetaValue::F32(x), MetaValue::F32(y)) => x.to_bits() == y.to_bits(),
        (MetaValue::F64(x), MetaValue::F64(y)) => x.to_bits() == y.to_bits(),
        (
            MetaValue::Array {
                elem: e1,
                items: i1,
            },
            MetaValue::Array {
                elem: e2,
                items: i2,
            },
        ) => e1 == e2 && i1.len() == i2.len() && i1.iter().zip(i2).all(|(x, y)| same(x, y)),
        _ => a == b,
    }
}

/// Deterministic tensor bytes.
fn fill(n: usize, seed: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i.wrapping_mul(31) ^ seed.wrapping_mul(7)) as u8)
        .collect()
}

struct CountingSink(u64);
impl std::io::Write for CountingSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|input: Input| {
    let version = u32::from(input.version % 5);
    let w = GgufWriter::new().with_version(version);
    let mut w = match w {
        Ok(w) => w,
        Err(_) => {
            assert!(!(1..=3).contains(&version));
            return;
        }
    };
    // Tensor data lives here for the writer's borrow: prepare it first.
    struct T {
        name: String,
        ty: pagedkv::gguf::GgmlType,
        shape: Vec<u64>,
        data: Vec<u8>,
        deferred: bool,
    }
    let tensors: Vec<T> = input
        .ops
        .iter()
        .enumerate()
        .filter_map(|(i, op)| match op {
            WOp::Tensor {
                name,
                ty,
                shape,
                delta,
                deferred,
            } => {
                let ty = ALL_TYPES[usize::from(*ty) % ALL_TYPES.len()];
                // Dims: 1, a few, or a block multiple; occasionally 0.
                let shape: Vec<u64> = shape
                    .iter()
                    .take(MAX_DIMS + 1)
                    .map(|&d| match d % 4 {
                        0 => u64::from(d / 4 % 4) * u64::from(ty.block_size()),
                        _ => u64::from(d / 4 % 5),
                    })
                    .collect();
                let n: Option<u64> = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
                let len = n.and_then(|n| ty.bytes_for(n)).unwrap_or(0);
                let len = (len as i64 + i64::from(*delta % 2)).clamp(0, 1 << 12) as usize;
                Some(T {
                    name: format!("t{}", name % 8),
                    ty,
                    shape,
                    data: fill(len, i),
                    deferred: *deferred,
                })
            }
            _ => None,
        })
        .collect();

    let mut model_meta: Vec<(String, MetaValue)> = Vec::new();
    let mut model_tensors: Vec<&T> = Vec::new();
    let mut alignment = 32u64;
    let mut next_tensor = 0;
    let mut budget = 512usize;
    for op in input.ops.iter().take(64) {
        let before = format!("{w:?}");
        match op {
            WOp::Llama {
                layers,
                heads,
                kv,
                embd,
                ctx,
                per_layer,
            } => {
                let l = u32::from(*layers % 4);
                let heads_v = if *per_layer {
                    MetaValue::Array {
                        elem: ValueType::U32,
                        items: (0..l)
                            .map(|_| MetaValue::U32(u32::from(*heads % 9)))
                            .collect(),
                    }
                } else {
                    MetaValue::U32(u32::from(*heads % 9))
                };
                let entries = [
                    ("general.architecture", MetaValue::String("llama".into())),
                    ("llama.block_count", MetaValue::U32(l)),
                    ("llama.attention.head_count", heads_v),
                    (
                        "llama.attention.head_count_kv",
                        MetaValue::U32(u32::from(*kv % 9)),
                    ),
                    (
                        "llama.embedding_length",
                        MetaValue::U32(u32::from(*embd % 1024)),
                    ),
                    ("llama.context_length", MetaValue::U32(u32::from(*ctx))),
                    (
                        "llama.attention.layer_norm_rms_epsilon",
                        MetaValue::F32(1e-5),
                    ),
                ];
                for (k, v) in entries {
                    let ok = !model_meta.iter().any(|(mk, _)| mk == k);
                    assert_eq!(w.add(k, v.clone()).is_ok(), ok);
                    if ok {
                        model_meta.push((k.to_string(), v));
                    }
                }
            }
            WOp::Meta { key, value } => {
                let key = match key {
                    Key::Llama(i) => LLAMA_KEYS[usize::from(*i) % LLAMA_KEYS.len()].to_string(),
                    Key::Alignment => ALIGNMENT_KEY.to_string(),
                    Key::Other(s) => s.clone(),
                };
                let value = meta(value, &mut budget);
                let mut ok = !model_meta.iter().any(|(k, _)| *k == key) && well_formed(&value, 0);
                let mut new_alignment = alignment;
                if ok && key == ALIGNMENT_KEY {
                    match value {
                        MetaValue::U32(a) if a.is_power_of_two() => new_alignment = a.into(),
                        _ => ok = false,
                    }
                }
                let got = w.add(&key, value.clone()).is_ok();
                assert_eq!(got, ok, "add({key:?}, {value:?})");
                if !got {
                    assert_eq!(format!("{w:?}"), before, "a refused add changed the writer");
                }
                if ok {
                    model_meta.push((key, value));
                    alignment = new_alignment;
                }
            }
            WOp::Tensor { .. } => {
                let t = &tensors[next_tensor];
                next_tensor += 1;
                let n = t
                    .shape
                    .iter()
                    .try_fold(1u64, |a, &d| a.checked_mul(d))
                    .filter(|&n| n <= i64::MAX as u64);
                let ne0 = t.shape.first().copied().unwrap_or(1);
                let ok = !model_tensors.iter().any(|m| m.name == t.name)
                    && t.shape.len() <= MAX_DIMS
                    && !t.shape.contains(&0)
                    && n.is_some()
                    && ne0 % u64::from(t.ty.block_size()) == 0
                    && (t.deferred
                        || n.and_then(|n| t.ty.bytes_for(n)) == Some(t.data.len() as u64));
                let got = if t.deferred {
                    w.add_tensor_deferred(&t.name, t.ty, &t.shape).is_ok()
                } else {
                    w.add_tensor(&t.name, t.ty, &t.shape, &t.data).is_ok()
                };
                assert_eq!(
                    got,
                    ok,
                    "add_tensor({}, {:?}, {:?}, {} bytes)",
                    t.name,
                    t.ty,
                    t.shape,
                    t.data.len()
                );
                if !got {
                    assert_eq!(
                        format!("{w:?}"),
                        before,
                        "a refused add_tensor changed the writer"
                    );
                }
                if ok {
                    model_tensors.push(t);
                }
            }
        }
    }
    let Ok(len) = w.file_len() else {
        // Only an offset overflow (an enormous alignment with enormous tensors) may refuse.
        return;
    };
    // The producer hands over each deferred tensor whole: past 64 MiB for one tensor the
    // harness, not the writer, would hold gigabytes (shapes multiply fuzzed dimensions), so
    // such files are only sized above, not written.
    let largest = model_tensors
        .iter()
        .filter(|t| t.deferred)
        .map(|t| {
            t.ty.bytes_for(t.shape.iter().product::<u64>())
                .unwrap_or(u64::MAX)
        })
        .max()
        .unwrap_or(0);
    if largest > 1 << 26 {
        return;
    }
    // The deferred tensors' producer hands out the bytes of the right length.
    let produce = |i: usize, name: &str, buf: &mut Vec<u8>| {
        let t = model_tensors[i];
        assert_eq!(t.name, name);
        let n = t.shape.iter().product::<u64>();
        let len = t.ty.bytes_for(n).unwrap() as usize;
        buf.extend_from_slice(&fill(len, 99));
        Ok(())
    };
    if len > 1 << 22 {
        let mut sink = CountingSink(0);
        let n = w.write_streaming(&mut sink, produce).expect("streamed");
        assert_eq!((n, sink.0), (len, len));
        return;
    }
    let mut bytes = Vec::new();
    let n = w.write_streaming(&mut bytes, produce).expect("written");
    assert_eq!(n, len);
    assert_eq!(bytes.len() as u64, len, "file_len is what is written");
    if model_tensors.iter().all(|t| !t.deferred) {
        assert_eq!(w.to_bytes().expect("to_bytes"), bytes);
    }

    let g =
        Gguf::parse(&bytes).unwrap_or_else(|e| panic!("the writer's output does not parse: {e}"));
    assert_eq!(g.version(), version);
    assert_eq!(g.alignment(), alignment);
    assert_eq!(g.metadata().len(), model_meta.len());
    for ((k, v), (mk, mv)) in g.metadata().iter().zip(&model_meta) {
        assert_eq!(k, mk);
        assert!(same(&MetaValue::from_value(v), mv), "{k}: {v:?} vs {mv:?}");
    }
    assert_eq!(g.tensors().len(), model_tensors.len());
    for (t, m) in g.tensors().iter().zip(&model_tensors) {
        assert_eq!(t.name(), m.name);
        assert_eq!(t.ty(), m.ty);
        assert_eq!(t.shape(), &m.shape[..]);
        assert_eq!(
            (t.data().as_ptr() as usize - bytes.as_ptr() as usize) as u64 % alignment,
            0
        );
        if m.deferred {
            assert_eq!(t.data(), &fill(t.data().len(), 99)[..]);
        } else {
            assert_eq!(t.data(), &m.data[..]);
        }
        if t.ty().can_dequantize() && t.n_elements() <= 1 << 14 {
            let mut out = vec![0f32; t.n_elements() as usize];
            dequantize_into(t.ty(), t.data(), &mut out).expect("sizes were validated");
        }
    }
    match g.llama_params() {
        Ok(p) => {
            assert!(p.n_layers > 0 && p.n_heads > 0 && p.n_kv_heads > 0);
            assert_eq!(p.n_heads % p.n_kv_heads, 0);
            assert!(p.head_dim > 0 && p.head_dim_v > 0 && p.embedding_length > 0);
            assert!(p.context_length > 0);
            assert!(p.rope_freq_base.is_finite() && p.rope_freq_base > 0.0);
            assert!(p.norm_eps.is_finite() && p.norm_eps >= 0.0);
            let _ = p.kv_bytes_per_token(2);
            assert!(matches!(
                g.get("general.architecture"),
                Some(Value::String(_))
            ));
        }
        Err(_) => {}
    }
    // And the writer's round trip through the parsed file is stable.
    let again = GgufWriter::from_gguf(&g)
        .and_then(|w| w.to_bytes())
        .expect("write back");
    assert!(again == bytes, "round trip through parse is not stable");
});
