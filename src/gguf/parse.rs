//! The GGUF parser: one validating pass over the header, then zero-copy views.

use std::collections::HashMap;

use super::types::{GgmlType, TypeId, ValueType};
use super::GgufError;

/// The magic number, as the first four bytes of the file.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and of every tensor when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// Longest tensor name accepted, in bytes: ggml's `GGML_MAX_NAME` (64) less its NUL. llama.cpp
/// refuses a file with a longer name ("tensor name is too long"), and so do the parser and the
/// writer.
pub const MAX_TENSOR_NAME_BYTES: usize = 63;
/// Deepest nesting of arrays accepted (an array of arrays has depth 2).
pub const MAX_ARRAY_DEPTH: u32 = 8;
/// The metadata key that sets the alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// Metadata and tensor entries reserved for before any is parsed; past it the tables grow with
/// the entries actually read, so the parser's memory follows the header's bytes, not its counts.
const PREALLOC_ENTRIES: usize = 4096;

type Result<T> = std::result::Result<T, GgufError>;

/// A bounds-checked little-endian reader over the file.
#[derive(Debug, Clone)]
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Counts and lengths are u64 (versions 2 and 3) rather than u32 (version 1).
    wide: bool,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: u64, what: &'static str) -> Result<&'a [u8]> {
        let left = self.left();
        match usize::try_from(n) {
            Ok(n) if n <= left => {
                let s = &self.buf[self.pos..self.pos + n];
                self.pos += n;
                Ok(s)
            }
            _ => Err(GgufError::Truncated {
                offset: self.pos as u64,
                what,
                needed: n,
                available: left as u64,
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count or length: u32 in version 1, u64 after.
    fn count(&mut self, what: &'static str) -> Result<u64> {
        if self.wide {
            self.u64(what)
        } else {
            self.u32(what).map(u64::from)
        }
    }

    fn count_width(&self) -> u64 {
        if self.wide {
            8
        } else {
            4
        }
    }

    /// Reads a count of items each at least `min_item` bytes long, refusing counts the rest
    /// of the file cannot hold.
    fn bounded_count(&mut self, what: &'static str, min_item: u64) -> Result<u64> {
        let offset = self.pos as u64;
        let count = self.count(what)?;
        let available = self.left() as u64;
        // min_item > 0 always; a count above available / min_item needs more bytes than exist.
        if count > available / min_item {
            return Err(GgufError::CountTooLarge {
                offset,
                what,
                count,
                min_item_bytes: min_item,
                available,
            });
        }
        Ok(count)
    }

    fn string(&mut self, what: &'static str) -> Result<&'a str> {
        let len = self.count(what)?;
        let start = self.pos as u64;
        let bytes = self.take(len, what)?;
        std::str::from_utf8(bytes).map_err(|_| GgufError::InvalidUtf8 {
            offset: start,
            what,
        })
    }

    fn value_type(&mut self) -> Result<ValueType> {
        let offset = self.pos as u64;
        let id = self.u32("value type")?;
        ValueType::from_id(id).ok_or(GgufError::UnknownValueType {
            offset,
            type_id: id,
        })
    }

    /// Reads one value of type `ty`. `depth` is the nesting depth of arrays around it.
    fn value(&mut self, ty: ValueType, depth: u32) -> Result<Value<'a>> {
        let fixed = |c: &mut Self, n: u64| c.take(n, "metadata value");
        Ok(match ty {
            ValueType::U8 => Value::U8(fixed(self, 1)?[0]),
            ValueType::I8 => Value::I8(fixed(self, 1)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array("metadata value")?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array("metadata value")?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array("metadata value")?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array("metadata value")?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array("metadata value")?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array("metadata value")?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array("metadata value")?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array("metadata value")?)),
            ValueType::Bool => {
                let offset = self.pos as u64;
                let b = fixed(self, 1)?[0];
                match b {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    value => return Err(GgufError::InvalidBool { offset, value }),
                }
            }
            ValueType::String => Value::String(self.string("metadata string")?),
            ValueType::Array => Value::Array(self.array_value(depth + 1)?),
        })
    }

    /// Reads and validates an array at nesting depth `depth` (1 for a top-level array).
    fn array_value(&mut self, depth: u32) -> Result<ArrayValue<'a>> {
        let offset = self.pos as u64;
        if depth > MAX_ARRAY_DEPTH {
            return Err(GgufError::ArrayTooDeep {
                offset,
                max: MAX_ARRAY_DEPTH,
            });
        }
        let elem = self.value_type()?;
        let cw = self.count_width();
        let min_item = match elem {
            ValueType::String => cw,
            ValueType::Array => 4 + cw,
            fixed => fixed.fixed_size().unwrap_or(1) as u64,
        };
        let len = self.bounded_count("array length", min_item)?;
        let start = self.pos;
        match elem {
            ValueType::String => {
                for _ in 0..len {
                    self.string("array string")?;
                }
            }
            ValueType::Array => {
                for _ in 0..len {
                    self.array_value(depth + 1)?;
                }
            }
            ValueType::Bool => {
                let bytes = self.take(len, "bool array")?;
                if let Some(i) = bytes.iter().position(|&b| b > 1) {
                    return Err(GgufError::InvalidBool {
                        offset: (start + i) as u64,
                        value: bytes[i],
                    });
                }
            }
            fixed => {
                // bounded_count guarantees len * size <= bytes left, so this cannot overflow.
                let size = fixed.fixed_size().unwrap_or(1) as u64;
                self.take(len * size, "array data")?;
            }
        }
        Ok(ArrayValue {
            elem,
            len,
            bytes: &self.buf[start..self.pos],
            wide: self.wide,
        })
    }
}

/// A metadata value, borrowing strings and arrays from the file.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value<'a> {
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
    String(&'a str),
    /// Homogeneous array.
    Array(ArrayValue<'a>),
    /// `u64`.
    U64(u64),
    /// `i64`.
    I64(i64),
    /// `f64`.
    F64(f64),
}

impl<'a> Value<'a> {
    /// The value's type tag.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// Any integer value, widened to `i128` so every GGUF integer fits.
    pub fn as_int(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// An integer value that fits in `u32`, whatever its stored width.
    pub fn as_u32(&self) -> Option<u32> {
        self.as_int().and_then(|v| u32::try_from(v).ok())
    }

    /// An integer value that fits in `u64`.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_int().and_then(|v| u64::try_from(v).ok())
    }

    /// An integer value that fits in `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_int().and_then(|v| i64::try_from(v).ok())
    }

    /// A float value (`f64` narrowed with rounding).
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            Value::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    /// A float value, widened.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    /// A bool value.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// A string value.
    pub fn as_str(&self) -> Option<&'a str> {
        match *self {
            Value::String(v) => Some(v),
            _ => None,
        }
    }

    /// An array value.
    pub fn as_array(&self) -> Option<ArrayValue<'a>> {
        match *self {
            Value::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// A validated array, borrowed from the file and decoded on access.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArrayValue<'a> {
    elem: ValueType,
    /// Number of elements; the parser checked `bytes` holds exactly this many.
    len: u64,
    /// The encoded elements (after the type and length prefix), validated by the parser.
    bytes: &'a [u8],
    wide: bool,
}

impl<'a> ArrayValue<'a> {
    /// The element type.
    pub fn elem_type(&self) -> ValueType {
        self.elem
    }

    /// Number of elements.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The encoded elements as stored in the file (little-endian for numbers; length-prefixed
    /// for strings and nested arrays).
    pub fn raw_bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Element `i`, in O(1) for fixed-size element types and O(i) for strings and arrays.
    pub fn get(&self, i: u64) -> Option<Value<'a>> {
        if i >= self.len {
            return None;
        }
        match self.elem.fixed_size() {
            Some(size) => {
                let start = usize::try_from(i).ok()?.checked_mul(size)?;
                let mut c = Cursor {
                    buf: self.bytes.get(start..start.checked_add(size)?)?,
                    pos: 0,
                    wide: self.wide,
                };
                c.value(self.elem, 0).ok()
            }
            None => self.iter().nth(usize::try_from(i).ok()?),
        }
    }

    /// The elements in order.
    pub fn iter(&self) -> ArrayIter<'a> {
        ArrayIter {
            cursor: Cursor {
                buf: self.bytes,
                pos: 0,
                wide: self.wide,
            },
            elem: self.elem,
            left: self.len,
        }
    }
}

/// Iterator over an [`ArrayValue`].
#[derive(Debug, Clone)]
pub struct ArrayIter<'a> {
    cursor: Cursor<'a>,
    elem: ValueType,
    left: u64,
}

impl<'a> Iterator for ArrayIter<'a> {
    type Item = Value<'a>;

    fn next(&mut self) -> Option<Value<'a>> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        // The parser validated these bytes with this same decoder (depth aside, which was
        // checked there), so decoding cannot fail; if it somehow did, the iteration ends.
        match self.cursor.value(self.elem, 0) {
            Ok(v) => Some(v),
            Err(_) => {
                self.left = 0;
                None
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = usize::try_from(self.left).unwrap_or(usize::MAX);
        (n, Some(n))
    }
}

/// One tensor: its header entry and its bytes, borrowed from the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorInfo<'a> {
    name: &'a str,
    ty: GgmlType,
    /// Dimensions innermost first; entries past `n_dims` are 1.
    dims: [u64; MAX_DIMS],
    n_dims: u8,
    /// Offset from the start of the data section; a multiple of the alignment.
    offset: u64,
    /// Product of `dims`; fits in `i64`.
    n_elements: u64,
    /// The tensor's bytes: `n_elements / block_size * type_size` of them.
    data: &'a [u8],
}

impl<'a> TensorInfo<'a> {
    /// The tensor's name.
    pub fn name(&self) -> &'a str {
        self.name
    }

    /// Its element type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Its shape, innermost dimension first (ggml's `ne`), as many entries as it has
    /// dimensions.
    pub fn shape(&self) -> &[u64] {
        &self.dims[..usize::from(self.n_dims)]
    }

    /// All four dimensions, innermost first, padded with 1.
    pub fn ne(&self) -> [u64; MAX_DIMS] {
        self.dims
    }

    /// Its offset in the data section.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.n_elements
    }

    /// Number of bytes.
    pub fn n_bytes(&self) -> usize {
        self.data.len()
    }

    /// Its bytes, borrowed from the file (for a mapped file, straight from the page cache).
    pub fn data(&self) -> &'a [u8] {
        self.data
    }
}

/// A parsed GGUF file. Everything borrows from the bytes it was parsed from.
///
///
/// Layout (gguf.h / ggml's docs/gguf.md), all little-endian:
///
/// ```text
/// magic "GGUF" | version u32 | n_tensors | n_kv
/// n_kv x      (key: string, type: u32, value)
/// n_tensors x (name: string, n_dims: u32, dims: [count; n_dims], type: u32, offset: u64)
/// padding to `general.alignment` (default 32) | tensor data
/// ```
///
/// where a "count" (and a string's length prefix, an array's length) is a `u32` in version 1
/// and a `u64` from version 2 on.
///
/// # Memory bound
///
/// Nothing the file claims is trusted before it is checked against the bytes that are actually
/// present. Every count is first compared with `bytes_left / min_item_bytes` (the smallest
/// encoding an item can have), so a `Vec` is only ever reserved for items the file could hold.
/// Strings and arrays are not copied: a [`Value`] borrows them from the input, and arrays are
/// decoded lazily on iteration after one validating pass. The parse therefore allocates a
/// bounded number of bytes per header entry, and each entry takes at least 9 bytes of the file
/// (a version-1 metadata entry: 4-byte key length, empty key, type, one-byte value; 13 from
/// version 2 on, and more for a tensor entry): the allocation is a small multiple of the
/// header's size whatever the counts say.
///
/// Nesting depth of arrays is bounded by [`MAX_ARRAY_DEPTH`], so recursion is bounded too, and
/// every loop iteration consumes at least one byte of input, so the parse is linear time.
#[derive(Debug, Clone)]
pub struct Gguf<'a> {
    file: &'a [u8],
    version: u32,
    alignment: u64,
    data_offset: u64,
    /// Entries in file order; keys unique.
    metadata: Vec<(&'a str, Value<'a>)>,
    /// Key -> index into `metadata`.
    key_index: HashMap<&'a str, usize>,
    /// Tensors in file order; names unique, bytes in bounds and packed in this order (each at
    /// the previous one's end padded to the alignment).
    tensors: Vec<TensorInfo<'a>>,
    /// Name -> index into `tensors`.
    tensor_index: HashMap<&'a str, usize>,
}

/// Refuses a tensor name longer than [`MAX_TENSOR_NAME_BYTES`] (the error keeps a prefix, not
/// the whole name, which may be as long as the file).
pub(crate) fn check_tensor_name(name: &str) -> Result<()> {
    if name.len() <= MAX_TENSOR_NAME_BYTES {
        return Ok(());
    }
    let mut end = MAX_TENSOR_NAME_BYTES;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    Err(GgufError::TensorNameTooLong {
        prefix: name[..end].into(),
        len: name.len() as u64,
    })
}

/// Smallest encoding of a metadata entry: key length, empty key, type, a one-byte value.
const fn min_kv_bytes(cw: u64) -> u64 {
    cw + 4 + 1
}

/// Smallest encoding of a tensor entry: name length, empty name, n_dims, type, offset.
const fn min_tensor_bytes(cw: u64) -> u64 {
    cw + 4 + 4 + 8
}

impl<'a> Gguf<'a> {
    /// Parses and validates a whole GGUF file held in `file` (a memory map or a buffer).
    ///
    /// Every rule of the format is checked before the file is accepted: see [`GgufError`] for
    /// what each failure returns. Tensor data is not read, only bounds-checked.
    pub fn parse(file: &'a [u8]) -> Result<Gguf<'a>> {
        let mut c = Cursor {
            buf: file,
            pos: 0,
            wide: true,
        };
        let magic: [u8; 4] = c.array("magic")?;
        if magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic { found: magic });
        }
        let version = c.u32("version")?;
        match version {
            1 => c.wide = false,
            2 | 3 => {}
            v if (1..=3).contains(&v.swap_bytes()) => {
                return Err(GgufError::BigEndian {
                    version: v.swap_bytes(),
                })
            }
            v => return Err(GgufError::UnsupportedVersion(v)),
        }
        let cw = c.count_width();
        // Counts are read before either section; each is checked against all bytes left,
        // which bounds the reservation below by the header's size.
        let n_tensors = c.bounded_count("tensor", min_tensor_bytes(cw))?;
        let n_kv = c.bounded_count("metadata entry", min_kv_bytes(cw))?;
        if n_tensors
            .checked_mul(min_tensor_bytes(cw))
            .and_then(|t| t.checked_add(n_kv * min_kv_bytes(cw)))
            .is_none_or(|total| total > c.left() as u64)
        {
            return Err(GgufError::CountTooLarge {
                offset: c.pos as u64 - 2 * cw,
                what: "tensor and metadata entry",
                count: n_tensors.saturating_add(n_kv),
                min_item_bytes: min_kv_bytes(cw),
                available: c.left() as u64,
            });
        }
        // The checks above bound both counts by the file length, so they fit in usize.
        let n_kv = n_kv as usize;
        let n_tensors = n_tensors as usize;

        // Reserve for at most PREALLOC_ENTRIES up front and grow with what is parsed: a count
        // bounded only by the file's length (tensor data included) may be millions of
        // entries in a multi-GB file, and reserving them all aborted the process.
        let mut metadata = Vec::with_capacity(n_kv.min(PREALLOC_ENTRIES));
        let mut key_index = HashMap::with_capacity(n_kv.min(PREALLOC_ENTRIES));
        for i in 0..n_kv {
            let key = c.string("metadata key")?;
            let ty = c.value_type()?;
            let value = c.value(ty, 0)?;
            if key_index.insert(key, i).is_some() {
                return Err(GgufError::DuplicateKey { key: key.into() });
            }
            metadata.push((key, value));
        }

        let alignment = match key_index.get(ALIGNMENT_KEY).map(|&i| metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(Value::U32(a)) if a.is_power_of_two() => u64::from(a),
            Some(Value::U32(a)) => return Err(GgufError::BadAlignment(a.into())),
            Some(other) => {
                return Err(GgufError::AlignmentType {
                    found: other.value_type(),
                })
            }
        };

        struct Pending<'a> {
            name: &'a str,
            ty: GgmlType,
            dims: [u64; MAX_DIMS],
            n_dims: u8,
            offset: u64,
            n_elements: u64,
            n_bytes: u64,
        }
        let mut pending = Vec::with_capacity(n_tensors.min(PREALLOC_ENTRIES));
        let mut tensor_index = HashMap::with_capacity(n_tensors.min(PREALLOC_ENTRIES));
        for i in 0..n_tensors {
            let name = c.string("tensor name")?;
            check_tensor_name(name)?;
            let n_dims = c.u32("tensor n_dims")?;
            if n_dims as usize > MAX_DIMS {
                return Err(GgufError::TooManyDims {
                    tensor: name.into(),
                    n_dims: n_dims.into(),
                });
            }
            let mut dims = [1u64; MAX_DIMS];
            for (index, d) in dims.iter_mut().take(n_dims as usize).enumerate() {
                // Version 1 stored dimensions as u32, like its other counts.
                *d = c.count("tensor dimension")?;
                if *d == 0 {
                    return Err(GgufError::ZeroDim {
                        tensor: name.into(),
                        index,
                    });
                }
            }
            let type_id = c.u32("tensor type")?;
            let ty = match GgmlType::classify(type_id) {
                TypeId::Known(t) => t,
                TypeId::Removed(old) => {
                    return Err(GgufError::RemovedTensorType {
                        tensor: name.into(),
                        type_id,
                        name: old,
                    })
                }
                TypeId::Unknown => {
                    return Err(GgufError::UnknownTensorType {
                        tensor: name.into(),
                        type_id,
                    })
                }
            };
            let offset = c.u64("tensor offset")?;
            let n_elements = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|&n| n <= i64::MAX as u64)
                .ok_or_else(|| GgufError::ElementCountOverflow {
                    tensor: name.into(),
                    shape: dims[..n_dims as usize].to_vec(),
                })?;
            let block = u64::from(ty.block_size());
            if dims[0] % block != 0 {
                return Err(GgufError::NotBlockMultiple {
                    tensor: name.into(),
                    ty,
                    ne0: dims[0],
                    block_size: ty.block_size(),
                });
            }
            let n_bytes = ty
                .bytes_for(n_elements)
                .filter(|&b| usize::try_from(b).is_ok())
                .ok_or_else(|| GgufError::ByteSizeOverflow {
                    tensor: name.into(),
                })?;
            if offset % alignment != 0 {
                return Err(GgufError::MisalignedTensor {
                    tensor: name.into(),
                    offset,
                    alignment,
                });
            }
            if tensor_index.insert(name, i).is_some() {
                return Err(GgufError::DuplicateTensor { name: name.into() });
            }
            pending.push(Pending {
                name,
                ty,
                dims,
                n_dims: n_dims as u8,
                offset,
                n_elements,
                n_bytes,
            });
        }

        let header_end = c.pos as u64;
        let data_offset = header_end
            .checked_next_multiple_of(alignment)
            .ok_or(GgufError::DataOffsetOverflow)?;
        // A file without tensors may end right after its header, before the padding.
        let data_len = (file.len() as u64).saturating_sub(data_offset);

        let mut tensors = Vec::with_capacity(n_tensors);
        for p in &pending {
            let end = p.offset.checked_add(p.n_bytes).filter(|&e| e <= data_len);
            let Some(end) = end else {
                return Err(GgufError::TensorOutOfBounds {
                    tensor: p.name.into(),
                    offset: p.offset,
                    n_bytes: p.n_bytes,
                    data_len,
                });
            };
            // data_offset + end <= file.len(), so both bounds fit in usize.
            let start = (data_offset + p.offset) as usize;
            let stop = (data_offset + end) as usize;
            tensors.push(TensorInfo {
                name: p.name,
                ty: p.ty,
                dims: p.dims,
                n_dims: p.n_dims,
                offset: p.offset,
                n_elements: p.n_elements,
                data: &file[start..stop],
            });
        }
        drop(pending);

        // Overlap: sort by offset, then each tensor must end before the next begins.
        let mut order: Vec<usize> = (0..tensors.len()).collect();
        order.sort_unstable_by_key(|&i| tensors[i].offset);
        for w in order.windows(2) {
            let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
            if a.offset + a.data.len() as u64 > b.offset {
                return Err(GgufError::TensorOverlap {
                    first: a.name.into(),
                    second: b.name.into(),
                });
            }
        }

        // Packing, as llama.cpp checks it: in header order, each tensor starts at the previous
        // one's end padded to the alignment. Overlaps were named above; what is left is a gap
        // or an out-of-order tensor. Every end is at most data_len, so nothing overflows except
        // the padding of the last end near u64::MAX, which no later tensor can then match.
        let mut expected = 0u64;
        for t in &tensors {
            if t.offset != expected {
                return Err(GgufError::TensorNotPacked {
                    tensor: t.name.into(),
                    offset: t.offset,
                    expected,
                });
            }
            expected = (t.offset + t.data.len() as u64)
                .checked_next_multiple_of(alignment)
                .unwrap_or(u64::MAX);
        }

        Ok(Gguf {
            file,
            version,
            alignment,
            data_offset,
            metadata,
            key_index,
            tensors,
            tensor_index,
        })
    }

    /// The format version (1, 2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The alignment of the data section and of every tensor offset.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Where the data section starts, from the start of the file.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// The bytes the file was parsed from.
    pub fn file_bytes(&self) -> &'a [u8] {
        self.file
    }

    /// Metadata entries in file order.
    pub fn metadata(&self) -> &[(&'a str, Value<'a>)] {
        &self.metadata
    }

    /// The value stored under `key`.
    pub fn get(&self, key: &str) -> Option<Value<'a>> {
        self.key_index.get(key).map(|&i| self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<Value<'a>> {
        self.get(key)
            .ok_or_else(|| GgufError::MissingKey { key: key.into() })
    }

    fn typed<T>(
        &self,
        key: &str,
        expected: &'static str,
        f: impl FnOnce(&Value<'a>) -> Option<T>,
    ) -> Result<T> {
        let v = self.require(key)?;
        f(&v).ok_or_else(|| GgufError::WrongType {
            key: key.into(),
            expected,
            found: v.value_type(),
        })
    }

    /// An integer that fits `u32` (stored as any integer type).
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.typed(key, "an integer in u32 range", Value::as_u32)
    }

    /// An integer that fits `u64` (stored as any integer type).
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.typed(key, "an integer in u64 range", Value::as_u64)
    }

    /// An integer that fits `i64` (stored as any integer type).
    pub fn get_i64(&self, key: &str) -> Result<i64> {
        self.typed(key, "an integer in i64 range", Value::as_i64)
    }

    /// A float (FLOAT32, or FLOAT64 narrowed).
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.typed(key, "a float", Value::as_f32)
    }

    /// A float (FLOAT64, or FLOAT32 widened).
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        self.typed(key, "a float", Value::as_f64)
    }

    /// A bool.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        self.typed(key, "a bool", Value::as_bool)
    }

    /// A string.
    pub fn get_str(&self, key: &str) -> Result<&'a str> {
        self.typed(key, "a string", Value::as_str)
    }

    /// An array.
    pub fn get_array(&self, key: &str) -> Result<ArrayValue<'a>> {
        self.typed(key, "an array", Value::as_array)
    }

    /// Tensors in file order.
    pub fn tensors(&self) -> &[TensorInfo<'a>] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo<'a>> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The tensor named `name`, or [`GgufError::NoSuchTensor`].
    pub fn require_tensor(&self, name: &str) -> Result<&TensorInfo<'a>> {
        self.tensor(name)
            .ok_or_else(|| GgufError::NoSuchTensor { name: name.into() })
    }

    /// Tensors ordered largest first (ties in file order): the order a device upload wants,
    /// so the big copies start while the small ones fill the gaps.
    pub fn tensors_largest_first(&self) -> Vec<&TensorInfo<'a>> {
        let mut v: Vec<&TensorInfo<'a>> = self.tensors.iter().collect();
        v.sort_by_key(|t| std::cmp::Reverse(t.n_bytes()));
        v
    }

    /// Total bytes of all tensors.
    pub fn total_tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.n_bytes() as u64).sum()
    }
}
