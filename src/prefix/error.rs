//! The prefix cache's errors. Every refused call leaves the cache and the pool as they were.

use crate::block::{BlockId, EngineId};
use crate::error::PoolError;

/// Why a prefix-cache operation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PrefixError {
    /// The engine id is not below the pool's `max_engines`.
    #[error("engine {engine:?} is out of range: the cache serves {max_engines} engines")]
    UnknownEngine {
        /// The refused engine.
        engine: EngineId,
        /// Engines the cache (and its pool) serve.
        max_engines: u16,
    },
    /// A lookup or chain with zero tokens per block.
    #[error("block_tokens must be at least 1")]
    ZeroBlockTokens,
    /// The page is cached under another hash (a page holds at most one); forget it first.
    #[error("{id:?} is already cached under another hash")]
    PageHoldsOtherHash {
        /// The refused id.
        id: BlockId,
    },
    /// The page is cached for another engine.
    #[error("{id:?} is cached for engine {cached_for:?}, not {engine:?}")]
    PageOfOtherEngine {
        /// The refused id.
        id: BlockId,
        /// The engine it is cached for.
        cached_for: EngineId,
        /// The engine that asked.
        engine: EngineId,
    },
    /// The page was allocated by another engine: a page is cached only for its owner.
    #[error("{id:?} belongs to engine {owner:?}, not {engine:?}: it cannot be cached for it")]
    NotOwner {
        /// The refused id.
        id: BlockId,
        /// The engine that allocated it.
        owner: EngineId,
        /// The engine that asked.
        engine: EngineId,
    },
    /// The pool refused the id (foreign, out of range, free, stale, too many references).
    #[error(transparent)]
    Pool(#[from] PoolError),
}
