//! Files written by pagedkv's writer, for gguf-py to read back.
//!
//! This test writes them (and what they must contain) under
//! `$CARGO_TARGET_TMPDIR/gguf_roundtrip/`, and checks them with our own parser. The CI step
//! with Python then runs `tests/fixtures/check_roundtrip.py` on that directory, which reads
//! every file with gguf-py's `GGUFReader` and compares it field by field (and dequantizes every
//! tensor with `gguf.quants.dequantize`, which must equal our output bit for bit).

use std::path::{Path, PathBuf};

use pagedkv::gguf::{GgmlType, Gguf, GgufWriter, MetaValue, Value, ValueType};
use serde_json::{json, Value as Json};

fn out_dir() -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gguf_roundtrip");
    std::fs::create_dir_all(&d).expect("mkdir");
    d
}

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/gguf")
            .join(name),
    )
    .expect("fixture")
}

fn to_json(v: &Value<'_>) -> Json {
    match *v {
        Value::Array(a) => Json::Array(a.iter().map(|x| to_json(&x)).collect()),
        Value::String(s) => s.into(),
        Value::Bool(b) => b.into(),
        Value::F32(x) => f64::from(x).into(),
        Value::F64(x) => x.into(),
        ref int => int
            .as_i64()
            .map(Json::from)
            .or(int.as_u64().map(Json::from))
            .unwrap_or(Json::Null),
    }
}

#[test]
fn write_files_for_gguf_py() {
    let dir = out_dir();
    // 1. Every gguf-py fixture, parsed and written back by us.
    for name in ["all_types.gguf", "align64.gguf"] {
        let bytes = fixture(name);
        let g = Gguf::parse(&bytes).expect("parse");
        let out = GgufWriter::from_gguf(&g)
            .expect("writer")
            .to_bytes()
            .expect("write");
        std::fs::write(dir.join(format!("rt_{name}")), &out).expect("write file");
    }

    // 2. A file built from scratch: every value type, alignment 64, every dequantized type.
    let src = fixture("all_types.gguf");
    let fx = Gguf::parse(&src).expect("parse");
    let mut w = GgufWriter::new();
    let scalars = [
        ("w.u8", MetaValue::U8(255)),
        ("w.i8", MetaValue::I8(-128)),
        ("w.u16", MetaValue::U16(65535)),
        ("w.i16", MetaValue::I16(-32768)),
        ("w.u32", MetaValue::U32(u32::MAX)),
        ("w.i32", MetaValue::I32(i32::MIN)),
        ("w.f32", MetaValue::F32(-0.1)),
        ("w.bool", MetaValue::Bool(true)),
        ("w.str", MetaValue::String("ünï ✓".into())),
        ("w.u64", MetaValue::U64(u64::MAX)),
        ("w.i64", MetaValue::I64(i64::MIN)),
        ("w.f64", MetaValue::F64(1e-300)),
        ("w.arr_str", MetaValue::strings(["a", "", "bc"])),
        (
            "w.arr_i64",
            MetaValue::Array {
                elem: ValueType::I64,
                items: vec![MetaValue::I64(-1), MetaValue::I64(i64::MAX)],
            },
        ),
        (
            "w.arr_f32",
            MetaValue::Array {
                elem: ValueType::F32,
                items: vec![MetaValue::F32(1.5), MetaValue::F32(-2.25)],
            },
        ),
        ("general.alignment", MetaValue::U32(64)),
    ];
    w.add("general.architecture", MetaValue::String("llama".into()))
        .expect("add");
    for (k, v) in scalars {
        w.add(k, v).expect("add");
    }
    for t in fx.tensors() {
        w.add_tensor(&format!("w.{}", t.name()), t.ty(), t.shape(), t.data())
            .expect("tensor");
    }
    let built = w.to_bytes().expect("write");
    let g = Gguf::parse(&built).expect("our output parses");
    assert_eq!(g.alignment(), 64);
    let meta: Vec<Json> = g
        .metadata()
        .iter()
        .map(|(k, v)| {
            let mut e = json!({"key": k, "type": v.value_type().name(), "value": to_json(v)});
            if let Some(a) = v.as_array() {
                e["elem"] = a.elem_type().name().into();
            }
            e
        })
        .collect();
    let mut tensors = Vec::new();
    for t in g.tensors() {
        let f = t.dequantize().expect("dequantize");
        let raw: Vec<u8> = f.iter().flat_map(|x| x.to_le_bytes()).collect();
        let f32_name = format!("built.{}.f32", t.name());
        std::fs::write(dir.join(&f32_name), raw).expect("write f32");
        tensors.push(json!({
            "name": t.name(), "type": t.ty().name(), "shape": t.shape(),
            "offset": t.offset(), "n_bytes": t.n_bytes(), "f32": f32_name,
        }));
    }
    std::fs::write(dir.join("built.gguf"), &built).expect("write");
    std::fs::write(
        dir.join("built.expect.json"),
        serde_json::to_vec_pretty(&json!({"alignment": 64, "metadata": meta, "tensors": tensors}))
            .expect("json"),
    )
    .expect("write");
    assert!(GgmlType::MXFP4.can_dequantize());
}

/// Deferred tensors (`add_tensor_deferred` + `write_streaming`, how `pagedkv gguf synth` writes
/// files larger than memory) give the very bytes of borrowed ones; a producer that writes the
/// wrong length, and `write_to` on a writer with deferred tensors, are refused.
#[test]
fn deferred_tensors_stream_the_same_bytes() {
    let a: Vec<u8> = (0..34 * 3).map(|i| (i * 7) as u8).collect();
    let b: Vec<u8> = (0..4 * 5).map(|i| (i * 13 + 1) as u8).collect();
    let mut borrowed = GgufWriter::new();
    borrowed
        .add("general.architecture", MetaValue::String("llama".into()))
        .expect("meta");
    let mut deferred = borrowed.clone();
    borrowed
        .add_tensor("a", GgmlType::Q8_0, &[32, 3], &a)
        .expect("a");
    borrowed
        .add_tensor("b", GgmlType::F32, &[5], &b)
        .expect("b");
    deferred
        .add_tensor("a", GgmlType::Q8_0, &[32, 3], &a)
        .expect("a");
    deferred
        .add_tensor_deferred("b", GgmlType::F32, &[5])
        .expect("b");
    let want = borrowed.to_bytes().expect("borrowed");
    let mut got = Vec::new();
    let mut calls = Vec::new();
    let n = deferred
        .write_streaming(&mut got, |i, name, buf| {
            calls.push((i, name.to_owned(), buf.len()));
            buf.extend_from_slice(&b);
            Ok(())
        })
        .expect("streaming");
    assert_eq!(
        calls,
        [(1, "b".to_owned(), 0)],
        "one call, for the deferred tensor only"
    );
    assert_eq!(n, got.len() as u64);
    assert!(got == want, "deferred bytes differ from borrowed ones");
    assert!(matches!(
        deferred.write_streaming(Vec::new(), |_, _, buf| {
            buf.push(0);
            Ok(())
        }),
        Err(pagedkv::gguf::GgufError::Unwritable(_))
    ));
    assert!(matches!(
        deferred.to_bytes(),
        Err(pagedkv::gguf::GgufError::Unwritable(_))
    ));
    // A deferred tensor is checked like a borrowed one.
    assert!(deferred
        .add_tensor_deferred("b", GgmlType::F32, &[5])
        .is_err());
    assert!(deferred
        .add_tensor_deferred("c", GgmlType::Q4_K, &[100])
        .is_err());
}

/// `write_to` cannot write a deferred tensor: it must say so before it writes anything, not
/// after the header and the tensors before it (a truncated file left on disk behind the error).
#[test]
fn write_to_refuses_deferred_tensors_before_writing() {
    let a = [0u8; 8];
    let mut w = GgufWriter::new();
    w.add("general.name", MetaValue::String("x".into()))
        .expect("meta");
    w.add_tensor("a", GgmlType::F32, &[2], &a).expect("a");
    w.add_tensor_deferred("b", GgmlType::F32, &[2]).expect("b");
    let mut out = Vec::new();
    let r = w.write_to(&mut out);
    assert!(
        matches!(r, Err(pagedkv::gguf::GgufError::Unwritable(_))),
        "{r:?}"
    );
    assert!(
        out.is_empty(),
        "write_to wrote {} bytes before refusing the deferred tensor",
        out.len()
    );
}
