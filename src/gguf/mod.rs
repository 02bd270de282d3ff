//! GGUF weights: a defensive parser, zero-copy tensor views, dequantization and a writer.
//!
//! ```no_run
//! use pagedkv::gguf::{Gguf, GgufBytes};
//! # fn main() -> Result<(), pagedkv::gguf::GgufError> {
//! let bytes = GgufBytes::read(std::path::Path::new("model.gguf"))?;
//! let gguf = Gguf::parse(bytes.bytes())?;
//! let params = gguf.llama_params()?;
//! println!("{} layers, {} KV heads of dim {}", params.n_layers, params.n_kv_heads, params.head_dim);
//! for t in gguf.tensors_largest_first() {
//!     // t.data() borrows the tensor's bytes from the file: upload them as they are.
//!     println!("{} {} {:?} {} bytes", t.name(), t.ty(), t.shape(), t.n_bytes());
//! }
//! # Ok(()) }
//! ```
//!
//! * [`GgmlType`], [`ValueType`]: ggml's type table (every current id, its block size and bytes
//!   per block; removed ids named) and the metadata value types.
//! * [`Gguf::parse`] validates a whole file (versions 1 to 3) in one pass whose allocations are
//!   bounded by the header's size, whatever its counts claim; see [`Gguf`] for the argument and
//!   [`GgufError`] for every refusal.
//! * [`GgufBytes`], a read-only map or an owned buffer to parse.
//! * [`dequantize_into`] and its twins: bit-exact dequantization of F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
//!   Q2_K..Q6_K, IQ4_NL and MXFP4 to f32/f16/bf16, parallel on rayon.
//! * [`GgufWriter`], laying files out as gguf-py does.
//! * [`LlamaParams`], the hyperparameters that size a llama-family engine.
//! * [`upload`]: [`StagingRing`](upload::StagingRing), tensors into device memory through a ring of staging buffers,
//!   host copies overlapped with asynchronous copies, generic over a [`CopyEngine`](upload::CopyEngine); a host
//!   engine tests it without a GPU, and with feature `cuda`, `Uploader` runs it over pinned
//!   memory and the DMA engine.

mod dequant;
mod error;
mod llama;
mod mmap;
mod parse;
mod types;
pub mod upload;
mod write;

pub use dequant::{
    dequantize_into, dequantize_into_bf16, dequantize_into_f16, dequantize_into_serial,
    BF16_CANONICAL_NAN, F16_CANONICAL_NAN,
};
pub use error::GgufError;
pub use llama::LlamaParams;
pub use mmap::GgufBytes;
pub use parse::{
    ArrayIter, ArrayValue, Gguf, TensorInfo, Value, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC,
    MAX_ARRAY_DEPTH, MAX_DIMS, MAX_TENSOR_NAME_BYTES,
};
pub use types::{GgmlType, TypeId, ValueType, ALL_TYPES, QK_K};
pub use write::{GgufWriter, MetaValue};
