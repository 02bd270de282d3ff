//! The KV arena, the lock-free block pool over its pages, and atomic block tables.
//!
//! - [`KvArena`]: one device's KV bytes, `num_pages x page_bytes`; a block id is a page, and
//!   every model's cache is a view of it.
//! - [`BlockPool`]: the free KV blocks of one device, shared by every engine through `Arc`
//!   (a Treiber stack with a tagged head and per-engine magazines).
//! - [`BlockTable`]: one sequence's logical-to-physical block map; one writer (appends are
//!   wait-free; truncation, replacement and drop release blocks through the pool and are
//!   lock-free), any number of readers taking consistent snapshots.

mod arena;
mod magazine;
mod pool;
mod table;

pub use crate::ids::{BlockId, EngineId, MAX_BLOCKS};
pub use arena::{KvArena, ARENA_ALIGN, PAGE_ALIGN, POISON_BYTE};
// The ground-floor ids, under their old in-crate path for the pool and tables.
use crate::ids;
pub use pool::{BlockPool, PoolConfig, PoolStats, MAX_REFS};
pub use table::{BlockTable, TableReader};
