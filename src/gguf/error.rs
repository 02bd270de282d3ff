//! The GGUF reader's, writer's and dequantizer's error type, beside them (the crate-wide
//! `crate::error` holds the errors of the floors below).

/// Errors of the GGUF reader, writer and dequantizer ([`crate::gguf`]).
///
/// Parse errors carry the byte offset in the file where the bad field starts, so a one-line
/// message is enough to find it with a hex dump.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// Reading or mapping the file failed.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// Writing a file failed.
    #[error("write failed: {0}")]
    Write(#[from] std::io::Error),
    /// The file ends inside a field.
    #[error("truncated at byte {offset}: {what} needs {needed} bytes, {available} left")]
    Truncated {
        /// Where the field starts.
        offset: u64,
        /// The field being read.
        what: &'static str,
        /// Bytes the field needs.
        needed: u64,
        /// Bytes left in the file.
        available: u64,
    },
    /// The first four bytes are not "GGUF".
    #[error("not a GGUF file: magic is {found:02x?}, expected \"GGUF\"")]
    BadMagic {
        /// The first four bytes.
        found: [u8; 4],
    },
    /// The header is big-endian; only little-endian files are read.
    #[error("big-endian GGUF (version {version} byte-swapped) is not supported")]
    BigEndian {
        /// The version, read big-endian.
        version: u32,
    },
    /// A version other than 1, 2 or 3.
    #[error("unsupported GGUF version {0} (1, 2 and 3 are read)")]
    UnsupportedVersion(u32),
    /// A count claims more items than the bytes left in the file could hold.
    #[error(
        "at byte {offset}: {what} count {count} cannot fit in the {available} bytes left \
         (each takes at least {min_item_bytes})"
    )]
    CountTooLarge {
        /// Where the count starts.
        offset: u64,
        /// What is being counted.
        what: &'static str,
        /// The count the file claims.
        count: u64,
        /// Minimum bytes per item.
        min_item_bytes: u64,
        /// Bytes left after the count.
        available: u64,
    },
    /// A string is not valid UTF-8.
    #[error("at byte {offset}: {what} is not valid UTF-8")]
    InvalidUtf8 {
        /// Where the string's bytes start.
        offset: u64,
        /// Which string.
        what: &'static str,
    },
    /// A metadata value type id outside 0..=12.
    #[error("at byte {offset}: unknown metadata value type {type_id}")]
    UnknownValueType {
        /// Where the type id starts.
        offset: u64,
        /// The id.
        type_id: u32,
    },
    /// Arrays nested deeper than [`crate::gguf::MAX_ARRAY_DEPTH`].
    #[error("at byte {offset}: arrays nested more than {max} deep")]
    ArrayTooDeep {
        /// Where the too-deep array starts.
        offset: u64,
        /// The limit.
        max: u32,
    },
    /// A bool byte other than 0 or 1.
    #[error("at byte {offset}: bool value {value} is neither 0 nor 1")]
    InvalidBool {
        /// Where the byte is.
        offset: u64,
        /// The byte.
        value: u8,
    },
    /// Two metadata entries share a key.
    #[error("duplicate metadata key {key:?}")]
    DuplicateKey {
        /// The key.
        key: String,
    },
    /// Two tensors share a name.
    #[error("duplicate tensor name {name:?}")]
    DuplicateTensor {
        /// The name.
        name: String,
    },
    /// `general.alignment` is not a `u32`.
    #[error("general.alignment must be a UINT32, found {found}")]
    AlignmentType {
        /// The type found.
        found: crate::gguf::ValueType,
    },
    /// `general.alignment` is zero or not a power of two.
    #[error("general.alignment {0} is not a non-zero power of two")]
    BadAlignment(u64),
    /// A tensor name of more than [`crate::gguf::MAX_TENSOR_NAME_BYTES`] bytes: ggml keeps a
    /// tensor's name in a 64-byte field (NUL included), and llama.cpp refuses such a file.
    #[error("tensor name {prefix:?}... is {len} bytes long (at most 63)")]
    TensorNameTooLong {
        /// The name's first bytes (at most 63, cut at a character boundary).
        prefix: String,
        /// Its length in bytes.
        len: u64,
    },
    /// A tensor with more than four dimensions.
    #[error("tensor {tensor:?}: {n_dims} dimensions (at most 4)")]
    TooManyDims {
        /// The tensor.
        tensor: String,
        /// Its dimension count.
        n_dims: u64,
    },
    /// A tensor dimension of zero. Refused deliberately, though ggml's reader accepts an empty
    /// tensor: no model tensor is empty, and every consumer here (upload, dequant, views)
    /// would otherwise have a zero-byte case to get right.
    #[error("tensor {tensor:?}: dimension {index} is zero")]
    ZeroDim {
        /// The tensor.
        tensor: String,
        /// Which dimension (0 = innermost).
        index: usize,
    },
    /// The product of a tensor's dimensions overflows `i64` (ggml's element count type).
    #[error("tensor {tensor:?}: element count {shape:?} overflows")]
    ElementCountOverflow {
        /// The tensor.
        tensor: String,
        /// Its shape, innermost first.
        shape: Vec<u64>,
    },
    /// A tensor's byte size overflows (u64, or the address space on this target).
    #[error("tensor {tensor:?}: byte size overflows")]
    ByteSizeOverflow {
        /// The tensor.
        tensor: String,
    },
    /// The innermost dimension is not a multiple of the type's block size.
    #[error("tensor {tensor:?}: first dimension {ne0} is not a multiple of {ty}'s block size {block_size}")]
    NotBlockMultiple {
        /// The tensor.
        tensor: String,
        /// Its type.
        ty: crate::gguf::GgmlType,
        /// Its innermost dimension.
        ne0: u64,
        /// The type's block size.
        block_size: u32,
    },
    /// A tensor type id ggml never assigned.
    #[error("tensor {tensor:?}: unknown ggml type id {type_id}")]
    UnknownTensorType {
        /// The tensor.
        tensor: String,
        /// The id.
        type_id: u32,
    },
    /// A tensor type ggml has removed.
    #[error("tensor {tensor:?}: ggml type {name} (id {type_id}) was removed from ggml")]
    RemovedTensorType {
        /// The tensor.
        tensor: String,
        /// The id.
        type_id: u32,
        /// Its former name.
        name: &'static str,
    },
    /// A tensor offset that is not a multiple of the alignment.
    #[error("tensor {tensor:?}: offset {offset} is not a multiple of the alignment {alignment}")]
    MisalignedTensor {
        /// The tensor.
        tensor: String,
        /// Its offset in the data section.
        offset: u64,
        /// The file's alignment.
        alignment: u64,
    },
    /// A tensor's bytes reach past the end of the file.
    #[error(
        "tensor {tensor:?}: bytes {offset}..+{n_bytes} of the data section end past the file \
         ({data_len} data bytes)"
    )]
    TensorOutOfBounds {
        /// The tensor.
        tensor: String,
        /// Its offset in the data section.
        offset: u64,
        /// Its size.
        n_bytes: u64,
        /// Bytes in the data section.
        data_len: u64,
    },
    /// Two tensors' bytes overlap.
    #[error("tensors {first:?} and {second:?} overlap in the data section")]
    TensorOverlap {
        /// The one that starts first.
        first: String,
        /// The other.
        second: String,
    },
    /// A tensor's bytes do not start where the tensors before it leave off: llama.cpp (and
    /// every writer that follows the format: gguf-py, ggml, [`crate::gguf::GgufWriter`]) stores
    /// them in header order, each at the previous one's end padded to the alignment. A file
    /// with gaps or tensors out of order is refused as llama.cpp refuses it: a corrupted offset
    /// that still lands in bounds, aligned and clear of the other tensors would otherwise read
    /// the wrong bytes without a word.
    #[error(
        "tensor {tensor:?} starts at data offset {offset}, expected {expected} (tensors are \
         stored in header order, each at the previous one's end padded to the alignment)"
    )]
    TensorNotPacked {
        /// The tensor.
        tensor: String,
        /// Its offset in the data section.
        offset: u64,
        /// Where it should start: the end of the tensor before it in the header, padded to the
        /// alignment (0 for the first).
        expected: u64,
    },
    /// The data section starts past what `u64`/`usize` can address.
    #[error("data section offset overflows")]
    DataOffsetOverflow,
    /// A metadata key the caller needs is absent.
    #[error("metadata key {key:?} is missing")]
    MissingKey {
        /// The key.
        key: String,
    },
    /// A metadata value has the wrong type (or does not fit the type asked for).
    #[error("metadata key {key:?}: expected {expected}, found {found}")]
    WrongType {
        /// The key.
        key: String,
        /// What the caller asked for.
        expected: &'static str,
        /// The value's type.
        found: crate::gguf::ValueType,
    },
    /// A hyperparameter is present but unusable (zero heads, heads not divisible by KV heads...).
    #[error("metadata key {key:?}: {reason}")]
    BadHyperparameter {
        /// The key.
        key: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// No tensor has this name.
    #[error("no tensor named {name:?}")]
    NoSuchTensor {
        /// The name asked for.
        name: String,
    },
    /// The type has no dequantizer here.
    #[error("dequantizing {0} is not supported")]
    UnsupportedDequant(crate::gguf::GgmlType),
    /// Input and output lengths do not describe the same number of whole blocks.
    #[error("{ty}: {src_bytes} input bytes do not match {dst_elems} output elements")]
    DequantLength {
        /// The type.
        ty: crate::gguf::GgmlType,
        /// Input bytes.
        src_bytes: usize,
        /// Output elements.
        dst_elems: usize,
    },
    /// The writer was asked for something a file cannot hold (a mixed-type array, a tensor
    /// whose bytes do not match its shape, a count too large for a version-1 file...).
    #[error("cannot write: {0}")]
    Unwritable(&'static str),
}
