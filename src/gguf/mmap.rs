//! Opening a GGUF file: memory-mapped (zero-copy) or read into memory.

use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

use super::GgufError;

/// The bytes of a GGUF file, either mapped read-only or owned. Parse them with
/// [`crate::gguf::Gguf::parse`]`(file.bytes())`; the parsed views borrow from this value.
#[derive(Debug)]
pub enum GgufBytes {
    /// A read-only shared mapping of the file (`MAP_SHARED` on Unix: later writes to the
    /// file show through it; see [`GgufBytes::map`]).
    Mapped(Mmap),
    /// The file's contents, read into memory.
    Owned(Vec<u8>),
}

impl GgufBytes {
    /// Maps `path` read-only. Tensor bytes are then read straight from the page cache, and a
    /// device upload can copy them without an intermediate host copy.
    ///
    /// # Safety
    ///
    /// The file must not be truncated or written, by this process or another, while the
    /// returned value (or anything borrowed from it) lives. Truncation makes reads of the
    /// vanished pages fault (SIGBUS); a write changes bytes behind shared references that the
    /// parser has validated (UTF-8 strings, sizes), which is undefined behaviour. Model files are
    /// normally immutable once written; callers that cannot promise it should use
    /// [`GgufBytes::read`].
    pub unsafe fn map(path: &Path) -> Result<GgufBytes, GgufError> {
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the caller promises (this function's contract) that nothing truncates or
        // writes the file while the map lives; the map itself is read-only, so this process
        // cannot write through it either.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Ok(GgufBytes::Mapped(map))
    }

    /// Reads the whole file into memory (safe whatever else happens to the file).
    pub fn read(path: &Path) -> Result<GgufBytes, GgufError> {
        std::fs::read(path)
            .map(GgufBytes::Owned)
            .map_err(|source| GgufError::Io {
                path: path.to_path_buf(),
                source,
            })
    }

    /// The file's bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            GgufBytes::Mapped(m) => m,
            GgufBytes::Owned(v) => v,
        }
    }
}
