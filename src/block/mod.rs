//! The lock-free block pool over the KV arena's pages, and atomic block tables.
//!
//! A block id is a page of the device's [`KvArena`](crate::kv::KvArena), of which every model's
//! cache is a view.
//!
//! - [`BlockPool`]: the free KV blocks of one device, shared by every engine through `Arc`
//!   (a Treiber stack with a tagged head and per-engine magazines).
//! - [`BlockTable`]: one sequence's logical-to-physical block map; one writer (appends are
//!   wait-free; truncation, replacement and drop release blocks through the pool and are
//!   lock-free), any number of readers taking consistent snapshots.

mod magazine;
mod pool;
mod table;

pub use crate::ids::{BlockId, EngineId, MAX_BLOCKS};
// The ground-floor ids, under their old in-crate path for the pool and tables.
use crate::ids;
pub use pool::{BlockPool, PoolConfig, PoolStats, MAX_REFS};
pub use table::{BlockTable, TableReader};
