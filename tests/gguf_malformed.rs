//! Hand-made malformed GGUF files: one per validation rule and per overflow class. Each must
//! be refused with the error that names its problem, never a panic or a large allocation
//! (tests/gguf_memory.rs measures the allocations of these same shapes).

use pagedkv::gguf::GgufError;
use pagedkv::gguf::{Gguf, GgufWriter, MetaValue, MAX_ARRAY_DEPTH};

/// A little-endian GGUF byte builder.
struct B {
    v: Vec<u8>,
    wide: bool,
}

impl B {
    fn new(version: u32, n_tensors: u64, n_kv: u64) -> B {
        let mut b = B {
            v: b"GGUF".to_vec(),
            wide: version >= 2,
        };
        b.u32(version);
        b.count(n_tensors);
        b.count(n_kv);
        b
    }
    fn v3(n_tensors: u64, n_kv: u64) -> B {
        B::new(3, n_tensors, n_kv)
    }
    fn u32(&mut self, x: u32) -> &mut Self {
        self.v.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn u64(&mut self, x: u64) -> &mut Self {
        self.v.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn count(&mut self, n: u64) -> &mut Self {
        if self.wide {
            self.u64(n)
        } else {
            self.u32(n as u32)
        }
    }
    fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.v.extend_from_slice(bytes);
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.count(s.len() as u64).raw(s.as_bytes())
    }
    fn kv_u32(&mut self, key: &str, x: u32) -> &mut Self {
        self.str(key).u32(4).u32(x)
    }
    /// A tensor info: name, dims (innermost first), type id, offset.
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.count(d);
        }
        self.u32(ty).u64(offset)
    }
    /// Pads to `align` and appends `n` data bytes.
    fn data(&mut self, align: usize, n: usize) -> &mut Self {
        let pad = self.v.len().next_multiple_of(align) - self.v.len();
        self.v.extend(std::iter::repeat_n(0u8, pad + n));
        self
    }
    fn parse(&self) -> Result<(), GgufError> {
        Gguf::parse(&self.v).map(|_| ())
    }
}

macro_rules! refused {
    ($b:expr, $pat:pat) => {{
        let r = $b.parse();
        assert!(matches!(r, Err($pat)), "got {r:?}");
        // Every refusal prints as one line naming the problem.
        let msg = r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(!msg.contains('\n') && !msg.is_empty(), "{msg}");
    }};
}

#[test]
fn a_minimal_file_parses() {
    let mut b = B::v3(1, 1);
    b.kv_u32("a", 1).tensor("t", &[8], 0, 0).data(32, 32);
    b.parse().expect("valid");
}

#[test]
fn truncated_and_bad_headers() {
    refused!(
        B {
            v: vec![],
            wide: true
        },
        GgufError::Truncated { what: "magic", .. }
    );
    refused!(
        B {
            v: b"GGUF\x03\0".to_vec(),
            wide: true
        },
        GgufError::Truncated {
            what: "version",
            ..
        }
    );
    refused!(
        B {
            v: b"GGML\x03\0\0\0".to_vec(),
            wide: true
        },
        GgufError::BadMagic {
            found: [b'G', b'G', b'M', b'L']
        }
    );
    refused!(B::new(0, 0, 0), GgufError::UnsupportedVersion(0));
    refused!(B::new(4, 0, 0), GgufError::UnsupportedVersion(4));
    let mut be = B::new(3u32.swap_bytes(), 0, 0);
    refused!(be.u64(0), GgufError::BigEndian { version: 3 });
    let mut t = B::v3(0, 0);
    t.v.truncate(20);
    refused!(t, GgufError::Truncated { .. });
}

#[test]
fn counts_beyond_the_bytes_present() {
    refused!(
        B::v3(u64::MAX, 0),
        GgufError::CountTooLarge { what: "tensor", .. }
    );
    refused!(
        B::v3(0, 1 << 62),
        GgufError::CountTooLarge {
            what: "metadata entry",
            ..
        }
    );
    // Each count alone fits the bytes left, both together do not.
    let mut both = B::v3(2, 2);
    both.raw(&[0u8; 48]);
    refused!(both, GgufError::CountTooLarge { .. });
    refused!(
        B::new(1, u32::MAX as u64, 0),
        GgufError::CountTooLarge { what: "tensor", .. }
    );
}

#[test]
fn string_lengths_and_utf8() {
    let mut b = B::v3(0, 1);
    b.u64(u64::MAX).raw(b"key").raw(&[0; 16]);
    refused!(
        b,
        GgufError::Truncated {
            what: "metadata key",
            needed: u64::MAX,
            ..
        }
    );
    let mut b = B::v3(0, 1);
    b.u64(3).raw(b"a\xffb").u32(4).u32(1);
    refused!(
        b,
        GgufError::InvalidUtf8 {
            what: "metadata key",
            ..
        }
    );
    let mut b = B::v3(0, 1);
    b.str("k").u32(8).u64(2).raw(b"\xc3\x28");
    refused!(
        b,
        GgufError::InvalidUtf8 {
            what: "metadata string",
            ..
        }
    );
    let mut b = B::v3(1, 0);
    b.u64(2)
        .raw(b"\xe2\x82")
        .u32(1)
        .u64(8)
        .u32(0)
        .u64(0)
        .data(32, 32);
    refused!(
        b,
        GgufError::InvalidUtf8 {
            what: "tensor name",
            ..
        }
    );
}

#[test]
fn value_types_bools_and_duplicates() {
    let mut b = B::v3(0, 1);
    b.str("k").u32(13).u32(0);
    refused!(b, GgufError::UnknownValueType { type_id: 13, .. });
    let mut b = B::v3(0, 1);
    b.str("k").u32(7).raw(&[2]);
    refused!(b, GgufError::InvalidBool { value: 2, .. });
    let mut b = B::v3(0, 1);
    b.str("k").u32(9).u32(7).u64(3).raw(&[1, 0, 9]);
    refused!(b, GgufError::InvalidBool { value: 9, .. });
    let mut b = B::v3(0, 2);
    b.kv_u32("same", 1).kv_u32("same", 2);
    refused!(b, GgufError::DuplicateKey { .. });
    let mut b = B::v3(0, 1);
    b.str("k").u32(4).raw(&[1, 2]);
    refused!(
        b,
        GgufError::Truncated {
            what: "metadata value",
            ..
        }
    );
}

#[test]
fn arrays_claiming_more_than_the_file_holds() {
    // ggus panicked on a 2^62-element array; the count is refused before anything is reserved.
    let mut b = B::v3(0, 1);
    b.str("k").u32(9).u32(10).u64(1 << 62).raw(&[0; 64]);
    refused!(
        b,
        GgufError::CountTooLarge {
            what: "array length",
            ..
        }
    );
    // len * 8 would overflow u64: still a plain count refusal.
    let mut b = B::v3(0, 1);
    b.str("k").u32(9).u32(12).u64(u64::MAX / 4).raw(&[0; 64]);
    refused!(
        b,
        GgufError::CountTooLarge {
            what: "array length",
            ..
        }
    );
    let mut b = B::v3(0, 1);
    b.str("k").u32(9).u32(8).u64(1 << 40).raw(&[0; 64]);
    refused!(
        b,
        GgufError::CountTooLarge {
            what: "array length",
            ..
        }
    );
    let mut b = B::v3(0, 1);
    b.str("k").u32(9).u32(9).u64(1 << 40).raw(&[0; 64]);
    refused!(
        b,
        GgufError::CountTooLarge {
            what: "array length",
            ..
        }
    );
    // A string inside an array longer than the file.
    let mut b = B::v3(0, 1);
    b.str("k").u32(9).u32(8).u64(1).u64(1000).raw(b"abc");
    refused!(
        b,
        GgufError::Truncated {
            what: "array string",
            ..
        }
    );
    // Element type of an array unknown.
    let mut b = B::v3(0, 1);
    b.str("k").u32(9).u32(77).u64(0);
    refused!(b, GgufError::UnknownValueType { type_id: 77, .. });
}

#[test]
fn array_nesting_is_bounded() {
    let nested = |depth: u32| {
        let mut b = B::v3(0, 1);
        b.str("k").u32(9);
        for _ in 1..depth {
            b.u32(9).u64(1);
        }
        b.u32(4).u64(1).u32(42);
        b
    };
    nested(MAX_ARRAY_DEPTH).parse().expect("at the limit");
    refused!(nested(MAX_ARRAY_DEPTH + 1), GgufError::ArrayTooDeep { .. });
    refused!(nested(10_000), GgufError::ArrayTooDeep { .. });
}

#[test]
fn alignment_rules() {
    let with = |a: u32| {
        let mut b = B::v3(0, 1);
        b.kv_u32("general.alignment", a);
        b
    };
    with(64).parse().expect("64");
    with(1).parse().expect("1");
    refused!(with(0), GgufError::BadAlignment(0));
    refused!(with(48), GgufError::BadAlignment(48));
    let mut b = B::v3(0, 1);
    b.str("general.alignment").u32(10).u64(32);
    refused!(b, GgufError::AlignmentType { .. });
    // A huge alignment pushes the data section past the file.
    let mut b = B::v3(1, 1);
    b.kv_u32("general.alignment", 1 << 31)
        .tensor("t", &[8], 0, 0)
        .data(32, 32);
    refused!(b, GgufError::TensorOutOfBounds { .. });
}

fn one_tensor(dims: &[u64], ty: u32, offset: u64, data: usize) -> B {
    let mut b = B::v3(1, 0);
    b.tensor("t", dims, ty, offset).data(32, data);
    b
}

#[test]
fn tensor_shape_rules() {
    one_tensor(&[8, 2, 2, 2], 0, 0, 256)
        .parse()
        .expect("4 dims");
    one_tensor(&[], 0, 0, 4).parse().expect("0 dims: a scalar");
    refused!(
        one_tensor(&[1, 1, 1, 1, 1], 0, 0, 4),
        GgufError::TooManyDims { n_dims: 5, .. }
    );
    let mut b = B::v3(1, 0);
    b.str("t").u32(u32::MAX).raw(&[0; 16]);
    refused!(b, GgufError::TooManyDims { .. });
    refused!(
        one_tensor(&[8, 0], 0, 0, 32),
        GgufError::ZeroDim { index: 1, .. }
    );
    refused!(
        one_tensor(&[1 << 32, 1 << 32], 0, 0, 32),
        GgufError::ElementCountOverflow { .. }
    );
    // 2^63 elements: fits u64, not ggml's i64 element count.
    refused!(
        one_tensor(&[1 << 32, 1 << 31], 24, 0, 32),
        GgufError::ElementCountOverflow { .. }
    );
    // 2^62 F64 elements: the count fits, the byte size does not.
    refused!(
        one_tensor(&[1 << 31, 1 << 31], 28, 0, 32),
        GgufError::ByteSizeOverflow { .. }
    );
    refused!(
        one_tensor(&[33], 2, 0, 32),
        GgufError::NotBlockMultiple {
            ne0: 33,
            block_size: 32,
            ..
        }
    );
    refused!(
        one_tensor(&[256 * 3 + 32], 12, 0, 1024),
        GgufError::NotBlockMultiple {
            block_size: 256,
            ..
        }
    );
}

/// ggml stores a tensor's name in `char name[GGML_MAX_NAME]` (64, NUL included), and
/// llama.cpp's gguf reader refuses a name of 64 bytes or more ("tensor name is too long"): a
/// file with one is not a model any ggml program can load, and the writer must not make one.
#[test]
fn tensor_names_fit_ggml() {
    let ok = "n".repeat(63);
    let mut b = B::v3(1, 0);
    b.tensor(&ok, &[1], 0, 0).data(32, 4);
    b.parse().expect("a 63-byte name fits ggml's 64-byte field");
    let long = "n".repeat(64);
    let mut b = B::v3(1, 0);
    b.tensor(&long, &[1], 0, 0).data(32, 4);
    refused!(b, GgufError::TensorNameTooLong { len: 64, .. });

    let data = [0u8; 4];
    let mut w = GgufWriter::new();
    w.add_tensor(&ok, pagedkv::gguf::GgmlType::F32, &[1], &data)
        .expect("63 bytes");
    let r = w.add_tensor(&long, pagedkv::gguf::GgmlType::F32, &[1], &data);
    assert!(
        matches!(r, Err(GgufError::TensorNameTooLong { len: 64, .. })),
        "the writer accepted a name llama.cpp refuses: {:?}",
        r.map(|_| ())
    );
    let r = w.add_tensor_deferred(&long, pagedkv::gguf::GgmlType::F32, &[1]);
    assert!(matches!(r, Err(GgufError::TensorNameTooLong { .. })));
    // The refusals left the writer as it was: one tensor, and the file parses.
    let bytes = w.to_bytes().expect("write");
    assert_eq!(Gguf::parse(&bytes).expect("parse").tensors().len(), 1);
}

#[test]
fn tensor_type_ids() {
    refused!(
        one_tensor(&[32], 99, 0, 64),
        GgufError::UnknownTensorType { type_id: 99, .. }
    );
    refused!(
        one_tensor(&[32], u32::MAX, 0, 64),
        GgufError::UnknownTensorType { .. }
    );
    for (id, name) in [
        (4, "Q4_2"),
        (5, "Q4_3"),
        (31, "Q4_0_4_4"),
        (32, "Q4_0_4_8"),
        (33, "Q4_0_8_8"),
        (36, "IQ4_NL_4_4"),
        (37, "IQ4_NL_4_8"),
        (38, "IQ4_NL_8_8"),
    ] {
        let r = one_tensor(&[32], id, 0, 64).parse();
        assert!(
            matches!(r, Err(GgufError::RemovedTensorType { name: n, .. }) if n == name),
            "{id}: {r:?}"
        );
    }
}

#[test]
fn tensor_offsets_bounds_and_overlap() {
    refused!(
        one_tensor(&[8], 0, 16, 64),
        GgufError::MisalignedTensor { offset: 16, .. }
    );
    refused!(
        one_tensor(&[8], 0, 0, 31),
        GgufError::TensorOutOfBounds {
            n_bytes: 32,
            data_len: 31,
            ..
        }
    );
    refused!(
        one_tensor(&[8], 0, 64, 64),
        GgufError::TensorOutOfBounds { .. }
    );
    // offset + n_bytes overflows u64.
    refused!(
        one_tensor(&[8], 0, u64::MAX - 31, 64),
        GgufError::TensorOutOfBounds { .. }
    );
    let mut b = B::v3(2, 0);
    b.tensor("a", &[16], 0, 0)
        .tensor("b", &[8], 0, 32)
        .data(32, 96);
    refused!(b, GgufError::TensorOverlap { .. });
    let mut b = B::v3(2, 0);
    b.tensor("a", &[8], 0, 0)
        .tensor("b", &[8], 0, 0)
        .data(32, 64);
    refused!(b, GgufError::TensorOverlap { .. });
    // Out of order, even disjoint, is refused as llama.cpp refuses it (see below).
    let mut b = B::v3(2, 0);
    b.tensor("a", &[8], 0, 32)
        .tensor("b", &[8], 0, 0)
        .data(32, 64);
    refused!(
        b,
        GgufError::TensorNotPacked {
            offset: 32,
            expected: 0,
            ..
        }
    );
    let mut b = B::v3(2, 0);
    b.tensor("a", &[8], 0, 0)
        .tensor("a", &[8], 0, 32)
        .data(32, 64);
    refused!(b, GgufError::DuplicateTensor { .. });
    // The header ends inside the tensor infos.
    let mut b = B::v3(1, 0);
    b.str("t").u32(4).u64(8).u64(8).raw(&[0; 3]);
    refused!(
        b,
        GgufError::Truncated {
            what: "tensor dimension",
            ..
        }
    );
}

/// Tensor data is packed as llama.cpp requires ("tensor has offset N, expected M"): in header
/// order, each tensor at the previous one's end padded to the alignment, the first at 0. A gap
/// (before the first tensor or between two) is refused, so an offset corrupted to another
/// aligned, in-bounds, unused place cannot silently read the wrong bytes; the padding after
/// the last tensor may be absent, and bytes after it are not looked at (llama.cpp reads a
/// mapped file so too).
#[test]
fn tensor_data_is_packed_in_header_order() {
    // Two 16-byte F32 tensors: the second starts at the first's end padded to 32.
    let packed = |second: u64, data: usize| {
        let mut b = B::v3(2, 0);
        b.tensor("a", &[4], 0, 0)
            .tensor("b", &[4], 0, second)
            .data(32, data);
        b
    };
    packed(32, 64).parse().expect("packed, padded");
    packed(32, 48)
        .parse()
        .expect("the last tensor's padding may be absent");
    packed(32, 4096)
        .parse()
        .expect("bytes after the last tensor");
    refused!(
        packed(64, 96),
        GgufError::TensorNotPacked {
            offset: 64,
            expected: 32,
            ..
        }
    );
    refused!(
        packed(16, 64),
        GgufError::MisalignedTensor { offset: 16, .. }
    );
    // A gap before the first tensor.
    refused!(
        one_tensor(&[8], 0, 32, 64),
        GgufError::TensorNotPacked {
            offset: 32,
            expected: 0,
            ..
        }
    );
    // A larger general.alignment sets the padding.
    let aligned = |second: u64| {
        let mut b = B::v3(2, 1);
        b.kv_u32("general.alignment", 64)
            .tensor("a", &[4], 0, 0)
            .tensor("b", &[4], 0, second)
            .data(64, 128);
        b
    };
    aligned(64).parse().expect("padded to 64");
    refused!(aligned(32), GgufError::MisalignedTensor { .. });
    refused!(aligned(128), GgufError::TensorOutOfBounds { .. });
    let mut b = B::v3(2, 1);
    b.kv_u32("general.alignment", 64)
        .tensor("a", &[4], 0, 0)
        .tensor("b", &[4], 0, 128)
        .data(64, 192);
    refused!(
        b,
        GgufError::TensorNotPacked {
            offset: 128,
            expected: 64,
            ..
        }
    );
}

/// Every prefix of a valid file and every single-byte corruption of its header is either
/// parsed or refused; nothing panics.
#[test]
fn prefixes_and_byte_flips_never_panic() {
    let mut w = GgufWriter::new();
    let data = [3u8; 18 * 2];
    let f = [0u8; 16];
    w.add("general.architecture", MetaValue::String("llama".into()))
        .expect("add")
        .add("a.list", MetaValue::strings(["x", "yy", "zzz"]))
        .expect("add")
        .add("a.n", MetaValue::U64(7))
        .expect("add");
    w.add_tensor("q", pagedkv::gguf::GgmlType::Q4_0, &[64], &data)
        .expect("tensor")
        .add_tensor("f", pagedkv::gguf::GgmlType::F32, &[4], &f)
        .expect("tensor");
    let bytes = w.to_bytes().expect("write");
    let g = Gguf::parse(&bytes).expect("valid");
    let data_end = g
        .tensors()
        .iter()
        .map(|t| g.data_offset() as usize + t.offset() as usize + t.n_bytes())
        .max()
        .expect("tensors");
    for len in 0..bytes.len() {
        let r = Gguf::parse(&bytes[..len]);
        assert_eq!(r.is_ok(), len >= data_end, "prefix {len}: {r:?}");
    }
    let header_len = g.data_offset() as usize;
    for i in 0..header_len {
        for x in [0x01u8, 0x80, 0xFF] {
            let mut m = bytes.clone();
            m[i] ^= x;
            let _ = Gguf::parse(&m).map(|g| {
                for (_, v) in g.metadata() {
                    if let Some(a) = v.as_array() {
                        assert!(a.iter().count() as u64 == a.len());
                    }
                }
            });
        }
    }
}

/// Fuzz seeds and any crash kept from a fuzz run (fuzz/seeds/gguf_parse/) replay here as
/// ordinary inputs: parsed or refused, never a panic.
#[test]
fn fuzz_seeds_replay() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/gguf_parse");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("seed dir") {
        let path = entry.expect("entry").path();
        let bytes = std::fs::read(&path).expect("seed");
        if let Ok(g) = Gguf::parse(&bytes) {
            for t in g.tensors() {
                if t.ty().can_dequantize() {
                    t.dequantize().expect("validated sizes dequantize");
                }
            }
        }
        n += 1;
    }
    assert!(n >= 5, "seed corpus missing: {}", dir.display());
}
