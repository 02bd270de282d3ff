//! Lock-free block pool and atomic block tables.
//!
//! - [`BlockPool`]: the free KV blocks of one device, shared by every engine through `Arc`.
//! - [`BlockTable`]: one sequence's logical-to-physical block map; one writer, many readers.

mod ids;

pub use ids::{BlockId, EngineId, MAX_BLOCKS};
