//! Lock-free block pool and atomic block tables.
//!
//! - [`BlockPool`]: the free KV blocks of one device, shared by every engine through `Arc`
//!   (a Treiber stack with a tagged head; see [`pool`]).
//! - [`BlockTable`]: one sequence's logical-to-physical block map; one writer (appends are
//!   wait-free; truncation, replacement and drop release blocks through the pool and are
//!   lock-free), any number of readers taking consistent snapshots (see [`table`]).

mod ids;
pub mod pool;
pub mod table;

pub use ids::{BlockId, EngineId, MAX_BLOCKS};
pub use pool::{BlockPool, PoolConfig, PoolStats, MAX_REFS};
pub use table::{BlockTable, TableReader};
