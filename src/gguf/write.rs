//! A GGUF writer.
//!
//! It lays a file out exactly as gguf-py's `GGUFWriter` does: header, metadata in insertion
//! order, tensor infos in insertion order with offsets packed in that order, zero padding to
//! the alignment, then each tensor's bytes followed by zero padding to the alignment. So a file
//! read by [`Gguf::parse`] and written back through [`GgufWriter::from_gguf`] is byte-identical
//! to what gguf-py wrote, and gguf-py's `GGUFReader` reads ours (versions 2 and 3: it refuses
//! version 1, which [`GgufWriter::with_version`] can still write for older readers), except a
//! Q8_1 tensor's data: gguf-py's type table gives Q8_1 40-byte blocks where ggml's are 36.

use std::collections::HashSet;
use std::io::Write;

use super::parse::{
    check_tensor_name, ArrayValue, Gguf, Value, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC,
    MAX_ARRAY_DEPTH, MAX_DIMS,
};
use super::types::{GgmlType, ValueType};
use super::GgufError;

/// An owned metadata value, for writing.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    /// `u8`.
    U8(u8),
    /// `i8`.
    I8(i8),
    /// `u16`.
    U16(u16),
    /// `i16`.
    I16(i16),
    /// `u32`.
    U32(u32),
    /// `i32`.
    I32(i32),
    /// `f32`.
    F32(f32),
    /// `bool`.
    Bool(bool),
    /// UTF-8 string.
    String(String),
    /// An array whose items all have type `elem` (which also types an empty array).
    Array {
        /// The element type.
        elem: ValueType,
        /// The elements.
        items: Vec<MetaValue>,
    },
    /// `u64`.
    U64(u64),
    /// `i64`.
    I64(i64),
    /// `f64`.
    F64(f64),
}

impl MetaValue {
    /// The value's type tag.
    pub fn value_type(&self) -> ValueType {
        match self {
            MetaValue::U8(_) => ValueType::U8,
            MetaValue::I8(_) => ValueType::I8,
            MetaValue::U16(_) => ValueType::U16,
            MetaValue::I16(_) => ValueType::I16,
            MetaValue::U32(_) => ValueType::U32,
            MetaValue::I32(_) => ValueType::I32,
            MetaValue::F32(_) => ValueType::F32,
            MetaValue::Bool(_) => ValueType::Bool,
            MetaValue::String(_) => ValueType::String,
            MetaValue::Array { .. } => ValueType::Array,
            MetaValue::U64(_) => ValueType::U64,
            MetaValue::I64(_) => ValueType::I64,
            MetaValue::F64(_) => ValueType::F64,
        }
    }

    /// An array of strings.
    pub fn strings<S: Into<String>>(items: impl IntoIterator<Item = S>) -> MetaValue {
        MetaValue::Array {
            elem: ValueType::String,
            items: items
                .into_iter()
                .map(|s| MetaValue::String(s.into()))
                .collect(),
        }
    }

    /// Copies a parsed value.
    pub fn from_value(v: &Value<'_>) -> MetaValue {
        match *v {
            Value::U8(x) => MetaValue::U8(x),
            Value::I8(x) => MetaValue::I8(x),
            Value::U16(x) => MetaValue::U16(x),
            Value::I16(x) => MetaValue::I16(x),
            Value::U32(x) => MetaValue::U32(x),
            Value::I32(x) => MetaValue::I32(x),
            Value::F32(x) => MetaValue::F32(x),
            Value::Bool(x) => MetaValue::Bool(x),
            Value::String(x) => MetaValue::String(x.into()),
            Value::Array(a) => MetaValue::from_array(&a),
            Value::U64(x) => MetaValue::U64(x),
            Value::I64(x) => MetaValue::I64(x),
            Value::F64(x) => MetaValue::F64(x),
        }
    }

    fn from_array(a: &ArrayValue<'_>) -> MetaValue {
        MetaValue::Array {
            elem: a.elem_type(),
            items: a.iter().map(|v| MetaValue::from_value(&v)).collect(),
        }
    }

    /// Checks homogeneity and nesting, returning a static description of the first problem.
    fn check(&self, depth: u32) -> Result<(), &'static str> {
        if let MetaValue::Array { elem, items } = self {
            if depth + 1 > MAX_ARRAY_DEPTH {
                return Err("arrays nested too deep");
            }
            for it in items {
                if it.value_type() != *elem {
                    return Err("array item type differs from the array's element type");
                }
                it.check(depth + 1)?;
            }
        }
        Ok(())
    }

    fn encode(&self, out: &mut Vec<u8>, wide: bool) -> Result<(), GgufError> {
        match self {
            MetaValue::U8(x) => out.push(*x),
            MetaValue::I8(x) => out.push(*x as u8),
            MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::Bool(x) => out.push(u8::from(*x)),
            MetaValue::String(s) => put_str(out, s, wide)?,
            MetaValue::Array { elem, items } => {
                out.extend_from_slice(&elem.id().to_le_bytes());
                put_count(out, items.len() as u64, wide)?;
                for it in items {
                    it.encode(out, wide)?;
                }
            }
            MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        }
        Ok(())
    }
}

fn put_count(out: &mut Vec<u8>, n: u64, wide: bool) -> Result<(), GgufError> {
    if wide {
        out.extend_from_slice(&n.to_le_bytes());
    } else {
        let n = u32::try_from(n).map_err(|_| {
            GgufError::Unwritable("a count or length exceeds u32 in a version-1 file")
        })?;
        out.extend_from_slice(&n.to_le_bytes());
    }
    Ok(())
}

fn put_str(out: &mut Vec<u8>, s: &str, wide: bool) -> Result<(), GgufError> {
    put_count(out, s.len() as u64, wide)?;
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

/// Where a written file's parts lie (GgufWriter::header).
struct Layout {
    /// The data section's offset: the header padded to the alignment.
    data_start: u64,
    /// The whole file, every tensor padded to the alignment.
    file_len: u64,
}

#[derive(Debug, Clone)]
struct PendingTensor<'d> {
    name: String,
    ty: GgmlType,
    shape: Vec<u64>,
    data: TensorBytes<'d>,
}

/// A tensor's bytes: borrowed now, or produced while the file is written.
#[derive(Debug, Clone, Copy)]
enum TensorBytes<'d> {
    Borrowed(&'d [u8]),
    /// [`GgufWriter::write_streaming`]'s producer writes this many bytes.
    Deferred(usize),
}

impl TensorBytes<'_> {
    fn len(&self) -> usize {
        match *self {
            TensorBytes::Borrowed(b) => b.len(),
            TensorBytes::Deferred(n) => n,
        }
    }
}

/// Builds a GGUF file from metadata and tensors borrowed from the caller.
#[derive(Debug, Clone)]
pub struct GgufWriter<'d> {
    version: u32,
    alignment: u64,
    metadata: Vec<(String, MetaValue)>,
    keys: HashSet<String>,
    tensors: Vec<PendingTensor<'d>>,
    names: HashSet<String>,
}

impl Default for GgufWriter<'_> {
    fn default() -> Self {
        Self::new()
    }
}

impl<'d> GgufWriter<'d> {
    /// An empty version-3 file with the default alignment (32).
    pub fn new() -> Self {
        GgufWriter {
            version: 3,
            alignment: DEFAULT_ALIGNMENT,
            metadata: Vec::new(),
            keys: HashSet::new(),
            tensors: Vec::new(),
            names: HashSet::new(),
        }
    }

    /// Writes format `version` (1, 2 or 3) instead of 3. gguf-py's `GGUFReader` reads only
    /// versions 2 and 3.
    pub fn with_version(mut self, version: u32) -> Result<Self, GgufError> {
        if !(1..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        self.version = version;
        Ok(self)
    }

    /// Copies the metadata and tensors of a parsed file, in its order and with its version.
    pub fn from_gguf(g: &Gguf<'d>) -> Result<Self, GgufError> {
        let mut w = GgufWriter::new().with_version(g.version())?;
        for (k, v) in g.metadata() {
            w.add(k, MetaValue::from_value(v))?;
        }
        for t in g.tensors() {
            w.add_tensor(t.name(), t.ty(), t.shape(), t.data())?;
        }
        Ok(w)
    }

    /// Adds a metadata entry. `general.alignment` (a `U32` power of two) also sets the
    /// alignment used for the data.
    pub fn add(&mut self, key: &str, value: MetaValue) -> Result<&mut Self, GgufError> {
        if self.keys.contains(key) {
            return Err(GgufError::DuplicateKey { key: key.into() });
        }
        value.check(0).map_err(GgufError::Unwritable)?;
        if key == ALIGNMENT_KEY {
            match value {
                MetaValue::U32(a) if a.is_power_of_two() => self.alignment = a.into(),
                MetaValue::U32(a) => return Err(GgufError::BadAlignment(a.into())),
                ref other => {
                    return Err(GgufError::AlignmentType {
                        found: other.value_type(),
                    })
                }
            }
        }
        self.keys.insert(key.into());
        self.metadata.push((key.into(), value));
        Ok(self)
    }

    /// Adds a tensor of type `ty` with `shape` (innermost dimension first) whose encoded bytes
    /// are `data`. Its name is at most [`crate::gguf::MAX_TENSOR_NAME_BYTES`] bytes (what ggml
    /// and llama.cpp take).
    pub fn add_tensor(
        &mut self,
        name: &str,
        ty: GgmlType,
        shape: &[u64],
        data: &'d [u8],
    ) -> Result<&mut Self, GgufError> {
        let n = self.check_tensor(name, ty, shape)?;
        if ty.bytes_for(n) != Some(data.len() as u64) {
            return Err(GgufError::Unwritable(
                "tensor data length does not match its type and shape",
            ));
        }
        self.push_tensor(name, ty, shape, TensorBytes::Borrowed(data));
        Ok(self)
    }

    /// Adds a tensor of type `ty` with `shape` whose bytes are produced while the file is
    /// written ([`GgufWriter::write_streaming`]), so a file larger than memory can be written
    /// one tensor at a time.
    pub fn add_tensor_deferred(
        &mut self,
        name: &str,
        ty: GgmlType,
        shape: &[u64],
    ) -> Result<&mut Self, GgufError> {
        let n = self.check_tensor(name, ty, shape)?;
        let len = ty
            .bytes_for(n)
            .and_then(|b| usize::try_from(b).ok())
            .ok_or(GgufError::Unwritable(
                "tensor size does not fit this machine's address space",
            ))?;
        self.push_tensor(name, ty, shape, TensorBytes::Deferred(len));
        Ok(self)
    }

    fn push_tensor(&mut self, name: &str, ty: GgmlType, shape: &[u64], data: TensorBytes<'d>) {
        self.names.insert(name.into());
        self.tensors.push(PendingTensor {
            name: name.into(),
            ty,
            shape: shape.to_vec(),
            data,
        });
    }

    /// Checks a new tensor's name and shape; returns its element count.
    fn check_tensor(&self, name: &str, ty: GgmlType, shape: &[u64]) -> Result<u64, GgufError> {
        check_tensor_name(name)?;
        if self.names.contains(name) {
            return Err(GgufError::DuplicateTensor { name: name.into() });
        }
        if shape.len() > MAX_DIMS {
            return Err(GgufError::TooManyDims {
                tensor: name.into(),
                n_dims: shape.len() as u64,
            });
        }
        if let Some(index) = shape.iter().position(|&d| d == 0) {
            return Err(GgufError::ZeroDim {
                tensor: name.into(),
                index,
            });
        }
        let n = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| GgufError::ElementCountOverflow {
                tensor: name.into(),
                shape: shape.to_vec(),
            })?;
        if shape.first().copied().unwrap_or(1) % u64::from(ty.block_size()) != 0 {
            return Err(GgufError::NotBlockMultiple {
                tensor: name.into(),
                ty,
                ne0: shape.first().copied().unwrap_or(1),
                block_size: ty.block_size(),
            });
        }
        Ok(n)
    }

    /// The header without its padding, and the file's layout: the data section's start (the
    /// header padded to the alignment) and the file's length (each tensor padded too). The
    /// padding is not held in memory: with a large `general.alignment` it can be gigabytes
    /// (a 57-byte file with no tensors and alignment 2^31 writes back as 2 GiB).
    fn header(&self) -> Result<(Vec<u8>, Layout), GgufError> {
        let wide = self.version >= 2;
        let mut h = Vec::new();
        h.extend_from_slice(&GGUF_MAGIC);
        h.extend_from_slice(&self.version.to_le_bytes());
        put_count(&mut h, self.tensors.len() as u64, wide)?;
        put_count(&mut h, self.metadata.len() as u64, wide)?;
        for (k, v) in &self.metadata {
            put_str(&mut h, k, wide)?;
            h.extend_from_slice(&v.value_type().id().to_le_bytes());
            v.encode(&mut h, wide)?;
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_str(&mut h, &t.name, wide)?;
            h.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            for &d in &t.shape {
                put_count(&mut h, d, wide)?;
            }
            h.extend_from_slice(&t.ty.id().to_le_bytes());
            h.extend_from_slice(&offset.to_le_bytes());
            offset = self.padded(offset.checked_add(t.data.len() as u64))?;
        }
        let data_start = self.padded(Some(h.len() as u64))?;
        let file_len = data_start
            .checked_add(offset)
            .ok_or(GgufError::DataOffsetOverflow)?;
        Ok((
            h,
            Layout {
                data_start,
                file_len,
            },
        ))
    }

    /// `n` rounded up to the alignment (`None`: an overflow already).
    fn padded(&self, n: Option<u64>) -> Result<u64, GgufError> {
        n.and_then(|n| n.checked_next_multiple_of(self.alignment))
            .ok_or(GgufError::DataOffsetOverflow)
    }

    /// The length in bytes of the file this writer writes (what [`GgufWriter::write_streaming`]
    /// returns), without writing it: to size a buffer, or to refuse a file too large for one.
    ///
    /// # Errors
    /// [`GgufError::DataOffsetOverflow`] where the layout does not fit in 64 bits; an error of
    /// the header's encoding (a count or string too long for the file's version).
    pub fn file_len(&self) -> Result<u64, GgufError> {
        Ok(self.header()?.1.file_len)
    }

    /// Writes the file to `out`, returning the bytes written.
    ///
    /// # Errors
    /// [`GgufError::Unwritable`], before anything is written, if a tensor was added with
    /// [`GgufWriter::add_tensor_deferred`] (write those with [`GgufWriter::write_streaming`]);
    /// [`GgufError::Write`] when `out` fails.
    pub fn write_to<W: Write>(&self, out: W) -> Result<u64, GgufError> {
        // Refused before the first byte is written, so `out` gets nothing rather than a
        // truncated file.
        if self
            .tensors
            .iter()
            .any(|t| matches!(t.data, TensorBytes::Deferred(_)))
        {
            return Err(GgufError::Unwritable(
                "a deferred tensor needs write_streaming",
            ));
        }
        self.write_streaming(out, |_, _, _| {
            Err(GgufError::Unwritable(
                "a deferred tensor needs write_streaming",
            ))
        })
    }

    /// Writes the file to `out`; for each tensor added with
    /// [`GgufWriter::add_tensor_deferred`], in order, `produce(index, tensor name, buf)` fills
    /// `buf` (handed over empty) with exactly the tensor's bytes. Returns the bytes written.
    ///
    /// # Errors
    /// `produce`'s error; [`GgufError::Unwritable`] if it produced the wrong number of bytes;
    /// [`GgufError::Write`] when `out` fails.
    pub fn write_streaming<W: Write>(
        &self,
        mut out: W,
        mut produce: impl FnMut(usize, &str, &mut Vec<u8>) -> Result<(), GgufError>,
    ) -> Result<u64, GgufError> {
        let (header, layout) = self.header()?;
        out.write_all(&header)?;
        // The padding in chunks of at most 64 KiB of zeros: memory stays bounded whatever the
        // alignment.
        let zeros = vec![0u8; self.alignment.min(1 << 16) as usize];
        let pad_with_zeros = |out: &mut W, mut pad: u64| -> Result<(), GgufError> {
            while pad > 0 {
                let n = pad.min(zeros.len() as u64);
                out.write_all(&zeros[..n as usize])?;
                pad -= n;
            }
            Ok(())
        };
        pad_with_zeros(&mut out, layout.data_start - header.len() as u64)?;
        let mut written = layout.data_start;
        let mut buf = Vec::new();
        for (i, t) in self.tensors.iter().enumerate() {
            match t.data {
                TensorBytes::Borrowed(b) => out.write_all(b)?,
                TensorBytes::Deferred(n) => {
                    buf.clear();
                    produce(i, &t.name, &mut buf)?;
                    if buf.len() != n {
                        return Err(GgufError::Unwritable(
                            "a deferred tensor's producer wrote the wrong number of bytes",
                        ));
                    }
                    out.write_all(&buf)?;
                }
            }
            // header() checked that every padded offset, and the file's length, fit in 64 bits.
            let len = t.data.len() as u64;
            let pad = len.next_multiple_of(self.alignment) - len;
            written += len + pad;
            pad_with_zeros(&mut out, pad)?;
        }
        out.flush()?;
        debug_assert_eq!(written, layout.file_len);
        Ok(written)
    }

    /// The file as bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>, GgufError> {
        let mut v = Vec::new();
        self.write_to(&mut v)?;
        Ok(v)
    }
}
