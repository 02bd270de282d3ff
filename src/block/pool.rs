//! The lock-free KV block pool of one device.

use super::ids::{self, BlockId, EngineId, INDEX_BITS, INDEX_MASK, MAX_BLOCKS};
use super::magazine::{count_of, Magazine, MAG_CAP};
use crate::error::PoolError;
use crate::sync::{global, AtomicU32, AtomicU64, Backoff, CachePadded, Ordering};

/// End-of-list marker in a link or the head (all index bits set).
const NIL: u32 = MAX_BLOCKS;
const TAG_SHIFT: u32 = INDEX_BITS;
/// Bits of the head's ABA tag: 40, or 2 under loom, so that a model with a few head updates can
/// wrap the tag and loom can show the tag is what stops ABA (tests/loom/pool.rs,
/// `pop_pop_push_aba`: three updates between a popper's load and its CAS must still be caught).
const TAG_BITS: u32 = if cfg!(loom) { 2 } else { 64 - INDEX_BITS };
const TAG_MASK: u64 = (1 << TAG_BITS) - 1;

const RC_BITS: u32 = 24;
const RC_MASK: u64 = (1 << RC_BITS) - 1;
const GEN_SHIFT: u32 = RC_BITS;
const GEN_MASK: u64 = (1 << 24) - 1;
const OWNER_SHIFT: u32 = 48;
/// The generation's bits, at the same place in a metadata word and in a [`BlockId`]
/// (`pool (16) | generation (24) | index (24)`), so the fast paths compare and mint
/// generations without shifting them.
const GEN_FIELD: u64 = GEN_MASK << GEN_SHIFT;
const GEN_ONE: u64 = 1 << GEN_SHIFT;
/// Where a [`BlockId`] keeps its pool tag.
const POOL_SHIFT: u32 = INDEX_BITS + ids::GEN_BITS;
const OWNER_FIELD: u64 = 0xffff << OWNER_SHIFT;
const _: () =
    assert!(GEN_SHIFT == INDEX_BITS && OWNER_SHIFT == POOL_SHIFT && GEN_MASK == ids::GEN_MASK);
/// The largest reference count a block can reach.
pub const MAX_REFS: u32 = (1 << RC_BITS) - 1;
/// Ids `free_n` checks with their words kept (and blocks it pushes with one CAS).
const CHAIN: usize = 64;
/// Engines with a magazine (engines beyond use the shared stack alone), bounding the pool's
/// magazine memory and the snapshot a refusal reads. Under loom only engine 0 has one, so models
/// drive the magazine through engine 0 and the shared stack (its ABA cases) through engine 1.
const MAG_ENGINES: u16 = if cfg!(loom) { 1 } else { 64 };

#[inline]
fn head_word(tag_of: u64, index: u32) -> u64 {
    // The new tag is the old one plus one, wrapping at TAG_BITS.
    ((((tag_of >> TAG_SHIFT).wrapping_add(1)) & TAG_MASK) << TAG_SHIFT) | u64::from(index)
}

#[inline]
fn head_index(head: u64) -> u32 {
    (head & INDEX_MASK) as u32
}

#[inline]
fn link_word(depth: u32, next: u32) -> u64 {
    (u64::from(depth) << 32) | u64::from(next)
}

#[inline]
fn link_next(link: u64) -> u32 {
    (link & INDEX_MASK) as u32
}

#[inline]
fn link_depth(link: u64) -> u32 {
    (link >> 32) as u32
}

#[inline]
fn meta_word(refs: u32, generation: u32, owner: EngineId) -> u64 {
    u64::from(refs)
        | ((u64::from(generation) & GEN_MASK) << GEN_SHIFT)
        | (u64::from(owner.0) << OWNER_SHIFT)
}

#[inline]
fn meta_refs(meta: u64) -> u32 {
    (meta & RC_MASK) as u32
}

#[inline]
fn meta_gen(meta: u64) -> u32 {
    ((meta >> GEN_SHIFT) & GEN_MASK) as u32
}

#[inline]
fn meta_owner(meta: u64) -> EngineId {
    EngineId((meta >> OWNER_SHIFT) as u16)
}

/// One block's words, alone on a cache line: blocks of different engines never share a line,
/// so two engines' scheduler threads releasing and claiming their own blocks write no common
/// line (with 8-byte words packed, neighbouring blocks of two engines made every release a
/// line transfer between cores: 2.4x the pair's time with 2 threads, BENCHMARKS.md). 64 bytes
/// of host memory per block (64 MiB for a million blocks).
#[derive(Debug)]
#[repr(align(64))]
struct BlockLine {
    /// `owner (16) | generation (24) | refs (24)`; `refs == 0` iff the block is free.
    meta: AtomicU64,
    /// `depth (32) | next (24)`. Meaningful only while the block is on the shared stack: `next`
    /// is the block below it, `depth` the stack's length from it to the bottom.
    link: AtomicU64,
}

/// Claims blocks just popped from a free list for one engine: see [`Claimer::claim`].
#[derive(Clone, Copy)]
struct Claimer<'a> {
    blocks: &'a [BlockLine],
    /// The pool's tag at its place in an id.
    tag: u64,
    /// The engine at its place in a metadata word, with one reference.
    owner: u64,
}

impl Claimer<'_> {
    /// Marks the block at `index` (popped from a free list by this thread) allocated, with a
    /// new generation, and mints its id.
    #[inline]
    fn claim(self, index: u32) -> BlockId {
        let meta = &self.blocks[index as usize].meta;
        // Relaxed load: the popper's Acquire on the list's word already ordered this after the
        // release that pushed the block (which wrote refs = 0 before its Release CAS).
        let old = meta.load(Ordering::Relaxed);
        debug_assert_eq!(meta_refs(old), 0, "a block on the free list had references");
        // The generation sits at the same bits of the metadata word and of the id, so the new
        // one is computed, stored and minted in place (no unpacking per block).
        let generation = (old & GEN_FIELD).wrapping_add(GEN_ONE) & GEN_FIELD;
        // A plain store is safe: while refs == 0 every CAS on this word (share, release) fails,
        // and only this thread holds the block. Release publishes the new generation before the
        // id escapes to other threads through the caller.
        meta.store(generation | self.owner, Ordering::Release);
        BlockId::from_bits(self.tag | generation | u64::from(index))
    }
}

/// How a pool is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// The device whose memory the blocks name (an id chosen by the caller, e.g. the CUDA
    /// ordinal); carried for error messages and checked through the pool tag of every id.
    pub device: u32,
    /// Blocks in the pool, `1..=MAX_BLOCKS`.
    pub num_blocks: u32,
    /// Engines that may allocate from the pool, `1..=u16::MAX`; engine ids are `0..max_engines`.
    pub max_engines: u16,
}

/// Counts read from a pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolStats {
    /// Blocks in the pool.
    pub total: u32,
    /// Blocks on the free list.
    pub free: u32,
    /// Physical blocks owned by each engine, indexed by engine id.
    pub held: Vec<u32>,
}

/// The free KV blocks of one device, shared by every engine (model) through `Arc`.
///
/// Lock-free: every operation completes in a bounded number of its own steps unless another
/// thread's operation on the same word (the head, a magazine, a block) succeeded meanwhile; no
/// operation waits for another to finish (a magazine another thread is pushing to is skipped). The algorithm and the ABA argument
/// follow.
///
///
/// # Algorithm
///
/// The free blocks form a **Treiber stack** (R. K. Treiber, 1986) threaded through a per-block
/// link array, with a **tagged head word** against ABA:
///
/// ```text
///  head: |        tag (40 bits)        | top index (24 bits) |
///  link[i]: | depth (32 bits) | next index (24 bits, low) |
/// ```
///
/// - `pop` reads the head, reads `link[top].next`, and CASes the head to `(tag + 1, next)`.
/// - `push(i)` writes `link[i] = (depth(top) + 1, top)` and CASes the head to `(tag + 1, i)`.
/// - `alloc_n(n)` walks `n` links from the top and detaches the whole chain with **one** CAS,
///   so it takes `n` blocks or none: no partial grab is ever visible to anyone.
///
/// **ABA.** Every successful CAS on the head increments the 40-bit tag. A CAS that compares
/// against a head it read earlier can only succeed if no other CAS succeeded in between, unless
/// a multiple of 2^40 (1.1 × 10^12) head updates happened while this thread was between its load
/// and its CAS: at one update per 10 ns that is a stall of three hours inside a handful of
/// instructions. (Under loom the tag has 2 bits, so that models can show it is what stops ABA.) Within that argument, a successful CAS proves the stack was untouched since the
/// load, so the `next` (or the chain) read from it was the live one. Links read from a stale head
/// may be garbage; they are only used if the CAS proves them current, and every link value is an
/// index below the pool size or the end marker, so reading them is always in bounds.
///
/// **Reclamation.** Nodes are never freed: the link array lives as long as the pool, so a stale
/// reader never touches freed memory (no hazard pointers or epochs needed).
///
/// # Per-engine magazines
///
/// Beside the shared stack, each of the first 64 engines has a **magazine** (magazine.rs): a
/// bounded array stack of up to 64 free blocks with one pusher at a time and any number of
/// poppers, so an engine's scheduler thread recycles its own blocks without the shared head and
/// without walking links.
///
/// - Blocks whose last reference `free_n` releases go to their owner's magazine if they fit and
///   no other push to that magazine is in progress (never awaited), else to the shared stack. A
///   single `release` pushes to the shared stack (one CAS, cheaper than a magazine push).
/// - `alloc`/`alloc_n` take from the caller's magazine when it holds enough (one CAS, a slice of
///   the array), else from the shared stack (one CAS). Each grab takes from one list, so no
///   partial grab is ever visible.
/// - When neither holds enough, the refusal is decided on a snapshot of the shared stack and
///   every magazine at one instant (a double collect: every change to any of those words changes
///   it, tags included). If the snapshot holds enough, every magazine is moved to the shared
///   stack and the grab retried: a retry means another thread's operation completed a step, so
///   this stays lock-free.
///
/// **Exact counts.** Each link records the depth of the stack below and including its node, set
/// when pushed; a magazine's word holds its count. The free count is the stack's top depth plus
/// every magazine's count: exact whenever no operation is in flight. During concurrent
/// operations a refusal (and `free_count`) reflects one instant at which the free lists held
/// fewer blocks than asked; blocks between lists at that instant count as not free: a block
/// being released (between its last reference and its push, as before magazines) and, new with
/// magazines, blocks another allocation is moving from the magazines to the shared stack.
///
/// # Ownership, reference counts and stale ids
///
/// Each block has a metadata word:
///
/// ```text
///  meta[i]: | owner engine (16) | generation (24) | reference count (24) |
/// ```
///
/// A count of zero means the block is on the free list. Only the thread that popped a block
/// writes its metadata while the count is zero (the block is unreachable by anyone else), so
/// allocation publishes `count = 1, generation + 1, owner` with a plain store. Every other change
/// (`share`, `release`) is a CAS that requires a non-zero count and the caller's generation: a
/// double free and a free of a never-allocated block are refused with an error, and so is a free
/// through an id kept after the block was freed and reallocated, unless the 24-bit generation
/// wrapped in between (the block reallocated a multiple of 2^24 times: see [`BlockId`]; with an
/// arbitrary reuse count a stale id is caught with probability 1 - 2^-24). The pool stays
/// consistent either way. The release that takes the count from one to zero is the only one
/// that pushes the block back, so a block returns to the free list exactly once.
///
/// # Per-engine accounting
///
/// The engine that allocates a block owns it until it returns to the free list;
/// [`held`](Self::held) counts the physical blocks each engine owns (shared references do not
/// count twice). It is kept as `acct[engine]` (owned plus parked in the engine's magazine) minus
/// the magazine's count, so a batch moving between an engine and its own magazine (the common
/// `alloc_n` / `free_n` pair) updates no counter: the counters change only when blocks move to
/// or from the shared stack.
///
/// # Memory
///
/// Each block's metadata word and link share one 64-byte line of their own (64 bytes of host
/// memory per block: 64 MiB for a million blocks), so blocks of different engines never share
/// a line: two engines' scheduler threads recycling their own blocks write no common line.
///
/// # Read-modify-writes per batch
///
/// The fast pair `alloc_n(n)` + `free_n` of those blocks does `n + 3` of them: the magazine pop,
/// one CAS per block (the release, which is also the block's check), and the magazine push's
/// claim and release. The per-block CAS is what makes a double free racing the batch come out
/// with exactly one success; it is most of the pair's time (see BENCHMARKS.md).
#[derive(Debug)]
pub struct BlockPool {
    /// `tag (40) | top index (24)`. The tag increments on every successful CAS; the index is the
    /// top of the free stack, or `NIL` when the pool is exhausted.
    head: CachePadded<AtomicU64>,
    /// Each block's words (metadata and free-list link), one cache line per block.
    blocks: Box<[BlockLine]>,
    /// Per engine: the physical blocks it owns (last reference still held) plus the free blocks
    /// parked in its magazine. A block moving between an engine's ownership and its magazine
    /// (the fast paths of `alloc_n` and `free_n`) leaves this unchanged, so those paths do no
    /// read-modify-write on it; only moves to or from the shared stack change it. `held`
    /// subtracts the magazine's count.
    acct: Box<[CachePadded<AtomicU32>]>,
    /// Free blocks parked per engine (the first `MAG_ENGINES` engines): a block whose last
    /// reference is released goes to its owner's magazine when there is room and no other push
    /// to it is in progress, else to the shared stack. Free = shared stack + every magazine.
    mags: Box<[Magazine]>,
    tag: u16,
    device: u32,
    total: u32,
}

impl BlockPool {
    /// Builds a pool with every block free.
    pub fn new(config: PoolConfig) -> Result<Self, PoolError> {
        if config.num_blocks == 0 {
            return Err(PoolError::InvalidConfig("num_blocks must be at least 1"));
        }
        if config.num_blocks > MAX_BLOCKS {
            return Err(PoolError::InvalidConfig(
                "num_blocks exceeds MAX_BLOCKS (2^24 - 1)",
            ));
        }
        if config.max_engines == 0 {
            return Err(PoolError::InvalidConfig("max_engines must be at least 1"));
        }
        let n = config.num_blocks;
        // Block 0 on top, so a fresh pool hands out 0, 1, 2, ... (predictable in tests).
        let blocks = (0..n)
            .map(|i| {
                let next = if i + 1 == n { NIL } else { i + 1 };
                BlockLine {
                    meta: AtomicU64::new(meta_word(0, 0, EngineId(0))),
                    link: AtomicU64::new(link_word(n - i, next)),
                }
            })
            .collect();
        let acct = (0..config.max_engines)
            .map(|_| CachePadded::new(AtomicU32::new(0)))
            .collect();
        let mag_cap = MAG_CAP.min(n);
        let mags = (0..config.max_engines.min(MAG_ENGINES))
            .map(|_| Magazine::new(mag_cap))
            .collect();
        Ok(Self {
            head: CachePadded::new(AtomicU64::new(0)),
            blocks,
            acct,
            mags,
            tag: global::next_pool_tag(),
            device: config.device,
            total: n,
        })
    }

    /// Blocks in the pool.
    #[inline]
    pub fn total(&self) -> u32 {
        self.total
    }

    /// The device this pool's blocks live on.
    #[inline]
    pub fn device(&self) -> u32 {
        self.device
    }

    /// The tag every id from this pool carries.
    #[inline]
    pub fn tag(&self) -> u16 {
        self.tag
    }

    /// Engines this pool serves.
    #[inline]
    pub fn max_engines(&self) -> u16 {
        self.acct.len() as u16
    }

    /// Free blocks (the shared stack plus every magazine). Exact whenever no operation is in
    /// flight; during concurrent operations it is the number of free blocks at some instant of
    /// the call (blocks a concurrent allocation is moving between free lists count as not
    /// free at that instant, as blocks being released always have).
    pub fn free_count(&self) -> u32 {
        self.snapshot_free()
    }

    /// Free blocks on the shared stack alone, from a head word read with Acquire.
    #[inline]
    fn stack_depth(&self, head: u64) -> u32 {
        let top = head_index(head);
        if top == NIL {
            0
        } else {
            // Relaxed: the caller's Acquire load of `head` pairs with the Release CAS of the
            // push that made this top current, so its link (and depth) is visible.
            link_depth(self.blocks[top as usize].link.load(Ordering::Relaxed))
        }
    }

    /// The free count at one instant, by double collect: read the head and every magazine
    /// word, read them again, and accept when nothing changed (every change to any of them
    /// changes its word: tags rise on every push, counts fall on every pop). Lock-free: a retry
    /// means another operation completed a step meanwhile.
    fn snapshot_free(&self) -> u32 {
        let mut words = [0u64; MAG_ENGINES as usize];
        let backoff = Backoff::new();
        loop {
            // Acquire: see stack_depth.
            let head = self.head.load(Ordering::Acquire);
            let mut free = self.stack_depth(head);
            for (w, m) in words.iter_mut().zip(self.mags.iter()) {
                *w = m.word();
                free += count_of(*w);
            }
            let same = self.head.load(Ordering::Acquire) == head
                && words
                    .iter()
                    .zip(self.mags.iter())
                    .all(|(&w, m)| m.word() == w);
            if same {
                return free;
            }
            backoff.spin();
        }
    }

    /// Physical blocks owned by `engine` (0 for an engine out of range).
    ///
    /// Exact whenever no operation is in flight. During concurrent operations it is the count
    /// at some instant of the call, except that blocks another thread is moving from `engine`'s
    /// magazine to the shared stack (the slow path of an allocation that found too few blocks
    /// where it looked) count as held until they reach the stack.
    pub fn held(&self, engine: EngineId) -> u32 {
        let Some(acct) = self.acct.get(engine.index()) else {
            return 0;
        };
        let Some(m) = self.mags.get(engine.index()) else {
            // Relaxed: a statistic; no memory is published through it.
            return acct.load(Ordering::Relaxed);
        };
        // Double collect: the magazine's word changes with every push and pop, so an unchanged
        // word around the read of `acct` gives the magazine's count at that read's instant.
        let backoff = Backoff::new();
        loop {
            let word = m.word();
            // Relaxed: see above.
            let owned_or_parked = acct.load(Ordering::Relaxed);
            if m.word() == word {
                return owned_or_parked.saturating_sub(count_of(word));
            }
            backoff.spin();
        }
    }

    /// A snapshot of the pool's counts (`held` of each engine as [`held`](Self::held) reads it).
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            total: self.total,
            free: self.snapshot_free(),
            held: (0..self.max_engines())
                .map(|e| self.held(EngineId(e)))
                .collect(),
        }
    }

    #[inline]
    fn check_engine(&self, engine: EngineId) -> Result<(), PoolError> {
        if engine.index() < self.acct.len() {
            Ok(())
        } else {
            Err(PoolError::UnknownEngine {
                engine,
                max_engines: self.max_engines(),
            })
        }
    }

    /// Checks that `id` was minted by this pool and is in range; returns its index.
    #[inline]
    fn check_id(&self, id: BlockId) -> Result<usize, PoolError> {
        if id.pool_tag() != self.tag {
            return Err(PoolError::ForeignBlock {
                id,
                id_pool: id.pool_tag(),
                pool: self.tag,
                device: self.device,
            });
        }
        if id.index() >= self.total {
            return Err(PoolError::OutOfRange {
                id,
                total: self.total,
            });
        }
        Ok(id.index() as usize)
    }

    /// Allocates one block for `engine`, with one reference.
    pub fn alloc(&self, engine: EngineId) -> Result<BlockId, PoolError> {
        self.check_engine(engine)?;
        let (index, from_magazine) = self.take_one(engine).ok_or(PoolError::OutOfBlocks {
            requested: 1,
            free: 0,
        })?;
        if !from_magazine {
            // Relaxed: a statistic (see `acct`).
            self.acct[engine.index()].fetch_add(1, Ordering::Relaxed);
        }
        Ok(self.claim(index, engine))
    }

    /// Takes one free block: from `engine`'s magazine, else the shared stack, else (moving
    /// every magazine to the stack) from anywhere; `None` when a snapshot found none free.
    /// Also says whether the block came from the magazine (no change to `acct`).
    fn take_one(&self, engine: EngineId) -> Option<(u32, bool)> {
        if let Some(m) = self.mags.get(engine.index()) {
            let mut got = [NIL];
            if m.pop_n(&mut got) {
                return Some((got[0], true));
            }
        }
        let backoff = Backoff::new();
        loop {
            if let Some(index) = self.pop() {
                return Some((index, false));
            }
            if self.snapshot_free() == 0 {
                return None;
            }
            self.flush_magazines();
            backoff.spin();
        }
    }

    /// Allocates `n` blocks for `engine`, all or nothing, appending their ids to `out`.
    ///
    /// Either `n` ids are appended, or none and the pool is unchanged. `out` only grows if its
    /// capacity is short, so a reused vector makes this allocation-free.
    ///
    /// The blocks come from one free list with one CAS: `engine`'s magazine when it holds `n`,
    /// else the shared stack. When neither does, a refusal is decided on a snapshot of every
    /// free list at one instant ([`free_count`](Self::free_count)); if that snapshot holds `n`,
    /// the magazines are moved to the shared stack and the grab is retried. No partial grab is
    /// ever visible: a thread that sees fewer free blocks sees them because another allocation
    /// took them, or is moving them between free lists.
    pub fn alloc_n(
        &self,
        engine: EngineId,
        n: u32,
        out: &mut Vec<BlockId>,
    ) -> Result<(), PoolError> {
        self.check_engine(engine)?;
        if n == 0 {
            return Ok(());
        }
        if n > self.total {
            return Err(PoolError::OutOfBlocks {
                requested: n,
                free: self.free_count(),
            });
        }
        if n <= MAG_CAP {
            if let Some(m) = self.mags.get(engine.index()) {
                let mut popped = [0u32; MAG_CAP as usize];
                let popped = &mut popped[..n as usize];
                if m.pop_n(popped) {
                    // From the engine's magazine to the engine: `acct` is unchanged.
                    let claimer = self.claimer(engine);
                    out.extend(popped.iter().map(move |&i| claimer.claim(i)));
                    return Ok(());
                }
            }
        }
        let start = out.len();
        out.reserve(n as usize);
        let backoff = Backoff::new();
        while !self.grab_stack(n, out) {
            let free = self.snapshot_free();
            if free < n {
                return Err(PoolError::OutOfBlocks { requested: n, free });
            }
            self.flush_magazines();
            backoff.spin();
        }
        // Counted before any id escapes, so a free of these blocks never meets an uncounted one.
        // Relaxed: a statistic (see `acct`).
        self.acct[engine.index()].fetch_add(n, Ordering::Relaxed);
        let claimer = self.claimer(engine);
        for slot in &mut out[start..] {
            *slot = claimer.claim(slot.to_bits() as u32);
        }
        Ok(())
    }

    /// Detaches `n` blocks from the shared stack with one CAS, appending their indices (as raw
    /// ids) to `out`; `false`, with `out` as it was, when the stack holds fewer than `n`.
    fn grab_stack(&self, n: u32, out: &mut Vec<BlockId>) -> bool {
        let start = out.len();
        let backoff = Backoff::new();
        // Acquire pairs with the Release CAS of the push that installed each top, making its
        // link visible; links further down were published by earlier pushes in the same release
        // sequence on `head`.
        let mut head = self.head.load(Ordering::Acquire);
        'retry: loop {
            let top = head_index(head);
            if self.stack_depth(head) < n {
                return false;
            }
            // Walk n links. If the head moved meanwhile, the walk may meet garbage; such a walk
            // is discarded because the CAS below fails.
            let mut cursor = top;
            for _ in 0..n {
                if cursor == NIL || cursor >= self.total {
                    out.truncate(start);
                    head = self.head.load(Ordering::Acquire);
                    backoff.spin();
                    continue 'retry;
                }
                out.push(BlockId::from_bits(u64::from(cursor)));
                cursor = link_next(self.blocks[cursor as usize].link.load(Ordering::Relaxed));
            }
            // AcqRel on success: acquire as above; release keeps the head's release sequence
            // (every later pusher's links stay visible to later poppers).
            match self.head.compare_exchange_weak(
                head,
                head_word(head, cursor),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(actual) => {
                    out.truncate(start);
                    head = actual;
                    backoff.spin();
                }
            }
        }
    }

    /// Moves every magazine's blocks to the shared stack (the slow path of an allocation that
    /// the stack alone cannot serve). Between a magazine's pop and the stack's push the blocks
    /// are this thread's alone: free, but on no list.
    #[cold]
    fn flush_magazines(&self) {
        let mut buf = [0u32; MAG_CAP as usize];
        for (m, acct) in self.mags.iter().zip(self.acct.iter()) {
            let k = m.pop_all(&mut buf);
            if k > 0 {
                self.push_chain(&buf[..k as usize]);
                // Relaxed: a statistic (see `acct`); until here `held` counts these blocks.
                acct.fetch_sub(k, Ordering::Relaxed);
            }
        }
    }

    /// Returns blocks of `owner` whose last reference was just released to a free list: the
    /// owner's magazine when it has room and no other push to it is in progress (never
    /// awaited; `acct` unchanged: owned becomes parked), else the shared stack (uncounted
    /// first, so `held` never counts a block that is already on the stack).
    #[inline]
    fn recycle(&self, owner: EngineId, chain: impl ExactSizeIterator<Item = u32> + Clone) {
        let k = chain.len();
        if k == 0 {
            return;
        }
        if let Some(m) = self.mags.get(owner.index()) {
            if m.try_push(chain.clone()) {
                return;
            }
        }
        // Relaxed: a statistic (see `acct`).
        self.acct[owner.index()].fetch_sub(k as u32, Ordering::Relaxed);
        let mut buf = [0u32; CHAIN];
        debug_assert!(k <= CHAIN, "recycled batches are at most CHAIN blocks");
        for (dst, index) in buf.iter_mut().zip(chain) {
            *dst = index;
        }
        self.push_chain(&buf[..k.min(CHAIN)]);
    }

    /// Marks a block just popped from the free list as allocated to `engine` and mints its id.
    #[inline]
    fn claim(&self, index: u32, engine: EngineId) -> BlockId {
        self.claimer(engine).claim(index)
    }

    /// What every claim for `engine` shares, read once per batch (a loop over `self` would
    /// reload the fields after every atomic store).
    #[inline]
    fn claimer(&self, engine: EngineId) -> Claimer<'_> {
        Claimer {
            blocks: &self.blocks,
            tag: u64::from(self.tag) << POOL_SHIFT,
            owner: (u64::from(engine.0) << OWNER_SHIFT) | 1,
        }
    }

    /// Pops the top of the free stack.
    #[inline]
    fn pop(&self) -> Option<u32> {
        let backoff = Backoff::new();
        // Acquire pairs with the Release CAS of the push that installed this top.
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            let top = head_index(head);
            if top == NIL {
                return None;
            }
            let next = link_next(self.blocks[top as usize].link.load(Ordering::Relaxed));
            // AcqRel: see alloc_n.
            match self.head.compare_exchange_weak(
                head,
                head_word(head, next),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(top),
                Err(actual) => {
                    head = actual;
                    backoff.spin();
                }
            }
        }
    }

    /// Pushes blocks whose last reference was just released, as one chain with one CAS:
    /// `chain[0]` becomes the new top and `chain[k-1]` links to the old top.
    #[inline]
    fn push_chain(&self, chain: &[u32]) {
        let Some(&first) = chain.first() else {
            return;
        };
        let k = chain.len() as u32;
        let backoff = Backoff::new();
        // Acquire: we read the top's depth, published by its pusher's Release CAS.
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            let top = head_index(head);
            let below = if top == NIL {
                0
            } else {
                link_depth(self.blocks[top as usize].link.load(Ordering::Relaxed))
            };
            // The chain's blocks are ours alone until the CAS publishes them, so their links
            // are rewritten freely on every retry. Relaxed: published by the Release CAS below.
            for (j, &index) in chain.iter().enumerate() {
                let next = chain.get(j + 1).copied().unwrap_or(top);
                self.blocks[index as usize]
                    .link
                    .store(link_word(below + k - j as u32, next), Ordering::Relaxed);
            }
            // Release publishes the links (and the zeroed metadata) to the next popper.
            match self.head.compare_exchange_weak(
                head,
                head_word(head, first),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return,
                Err(actual) => {
                    head = actual;
                    backoff.spin();
                }
            }
        }
    }

    /// Adds a reference to an allocated block (fork, prefix reuse). The block's owner does not
    /// change.
    pub fn share(&self, id: BlockId) -> Result<(), PoolError> {
        let index = self.check_id(id)?;
        let meta = &self.blocks[index].meta;
        let backoff = Backoff::new();
        // Acquire pairs with claim's Release store (the generation we compare against).
        let mut cur = meta.load(Ordering::Acquire);
        loop {
            self.check_live(id, cur)?;
            if meta_refs(cur) == MAX_REFS {
                return Err(PoolError::TooManyRefs { id });
            }
            match meta.compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(()),
                Err(actual) => {
                    cur = actual;
                    backoff.spin();
                }
            }
        }
    }

    #[inline]
    fn check_live(&self, id: BlockId, meta: u64) -> Result<(), PoolError> {
        if meta_gen(meta) != id.generation() {
            return Err(PoolError::StaleBlock {
                id,
                current: meta_gen(meta),
            });
        }
        if meta_refs(meta) == 0 {
            return Err(PoolError::NotAllocated { id });
        }
        Ok(())
    }

    /// Drops one reference to a block. Returns `true` if it was the last one and the block went
    /// back to the free list.
    ///
    /// Refused, with the pool unchanged: an id of another pool, out of range, of a free block
    /// (double free / never allocated), or stale (the block was freed and reallocated since).
    pub fn release(&self, id: BlockId) -> Result<bool, PoolError> {
        match self.drop_ref(id)? {
            Some(owner) => {
                // One block: the shared stack's single CAS is cheaper than a magazine push
                // (claim and release of its busy bit); batches go to the magazine.
                // Relaxed: a statistic (see `acct`).
                self.acct[owner.index()].fetch_sub(1, Ordering::Relaxed);
                self.push_chain(&[id.index()]);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Decrements the block's reference count. Returns its owner if this was the last reference:
    /// the caller then alone recycles the block (uncounts it and pushes it).
    #[inline]
    fn drop_ref(&self, id: BlockId) -> Result<Option<EngineId>, PoolError> {
        let index = self.check_id(id)?;
        // Acquire pairs with claim's Release store (the generation we compare against).
        let cur = self.blocks[index].meta.load(Ordering::Acquire);
        self.drop_ref_from(id, index, cur)
    }

    /// [`drop_ref`](Self::drop_ref) of a checked id at `index`, with `cur` a value of its
    /// metadata word read earlier (the CAS's first expected value; a stale one costs a retry).
    #[inline]
    fn drop_ref_from(
        &self,
        id: BlockId,
        index: usize,
        mut cur: u64,
    ) -> Result<Option<EngineId>, PoolError> {
        let meta = &self.blocks[index].meta;
        let backoff = Backoff::new();
        loop {
            self.check_live(id, cur)?;
            // AcqRel: the last release must see every other holder's earlier decrement (and their
            // use of the block) before it recycles the block.
            match meta.compare_exchange_weak(cur, cur - 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(actual) => {
                    cur = actual;
                    backoff.spin();
                }
            }
        }
        Ok((meta_refs(cur) == 1).then(|| meta_owner(cur)))
    }

    /// Frees one block: drops the caller's reference ([`release`](Self::release)); an unshared
    /// block goes back to the free list.
    #[inline]
    pub fn free(&self, id: BlockId) -> Result<bool, PoolError> {
        self.release(id)
    }

    /// Drops one reference to each block of `ids`, all or nothing with respect to bad input.
    ///
    /// Every id is checked first (pool, range, generation, allocated, and no block named more
    /// times than it has references); only then are any released, so a refused call leaves the
    /// pool unchanged. Returns how many blocks went back to the free list.
    ///
    /// One failure comes after the checks: another thread releases one of these references
    /// between the check and this call's release of it (a double free racing the batch; which
    /// of the two releases wins is down to timing). That id is skipped, every other reference
    /// is still released, and [`PoolError::ConcurrentDoubleFree`] reports the id and the count.
    /// The pool stays consistent: every block ends either free or allocated.
    pub fn free_n(&self, ids: &[BlockId]) -> Result<u32, PoolError> {
        if let Some(done) = self.free_unshared(ids) {
            return done;
        }
        // Phase 1: check every id. For a batch of up to CHAIN ids, each block's metadata word
        // is kept as the expected value of phase 2's CAS (saving a load per block), and
        // repeated mentions are found through a 64-bit filter of index bits: only an id whose
        // bit is already set is compared against the ids before it.
        let small = ids.len() <= CHAIN;
        let mut seen = [0u64; CHAIN];
        let mut filter = 0u64;
        for (i, &id) in ids.iter().enumerate() {
            let index = self.check_id(id)?;
            // Acquire pairs with claim's Release store.
            let meta = self.blocks[index].meta.load(Ordering::Acquire);
            self.check_live(id, meta)?;
            if small {
                seen[i] = meta;
                // A block may be named several times as long as it has a reference for each
                // mention (the caller holds those references, so they cannot vanish
                // concurrently except through a double free elsewhere, handled in phase 2).
                let bit = 1u64 << (id.index() % 64);
                if filter & bit != 0 {
                    let mentions = 1 + ids[..i].iter().filter(|&&other| other == id).count();
                    if mentions > meta_refs(meta) as usize {
                        return Err(PoolError::NotAllocated { id });
                    }
                }
                filter |= bit;
            }
        }
        if !small {
            let mut sorted = ids.to_vec();
            sorted.sort_unstable();
            for run in sorted.chunk_by(|a, b| a == b) {
                let refs = self.ref_count(run[0]).unwrap_or(0);
                if run.len() > refs as usize {
                    return Err(PoolError::NotAllocated { id: run[0] });
                }
            }
        }
        // Phase 2: release every reference; blocks that reach zero are recycled in runs of one
        // owner (up to CHAIN blocks), each with one push.
        let mut chain = [0u32; CHAIN];
        let mut len = 0;
        let mut freed = 0;
        let mut run_owner = EngineId(0);
        // Every id passed the checks above, but a double free elsewhere (another thread
        // releasing a reference this caller holds) can still make one fail here. Returning at
        // that point would strand the blocks already taken to zero references (neither free
        // nor allocated), so such an id is skipped, the batch is finished, and the race is
        // reported after.
        let mut raced = None;
        for (i, &id) in ids.iter().enumerate() {
            let index = id.index() as usize;
            let cur = if small {
                seen[i]
            } else {
                self.blocks[index].meta.load(Ordering::Acquire)
            };
            let owner = match self.drop_ref_from(id, index, cur) {
                Ok(Some(owner)) => owner,
                Ok(None) => continue,
                Err(_) => {
                    raced.get_or_insert(id);
                    continue;
                }
            };
            if len == CHAIN || (len > 0 && owner != run_owner) {
                self.recycle(run_owner, chain[..len].iter().copied());
                freed += len as u32;
                len = 0;
            }
            run_owner = owner;
            chain[len] = id.index();
            len += 1;
        }
        self.recycle(run_owner, chain[..len].iter().copied());
        let freed = freed + len as u32;
        match raced {
            None => Ok(freed),
            Some(id) => Err(PoolError::ConcurrentDoubleFree { id, freed }),
        }
    }

    /// `free_n`'s fast path, for the common batch: every id names a distinct block of one
    /// owner holding exactly one reference (a sequence giving back its blocks). One pass: each
    /// block's release is a CAS whose expected value is the word such a block must have
    /// (allocated, one reference, the id's generation, the first block's owner), so the CAS is
    /// also the block's whole check, and a repeated id fails its CAS (its first mention already
    /// took it to zero). The blocks go back with one push. `None`, with nothing changed, when the
    /// batch is not of that shape: the general path decides.
    ///
    /// When a CAS fails after earlier ones succeeded, those blocks are put back to one
    /// reference before returning `None`. Between the two they are at zero references and on
    /// no free list: no one can allocate them, and a `share`, `release` or `ref_count` that
    /// meets one of them is refused or reads zero. Only a thread that holds none of their
    /// references can meet them (this call's caller holds the only one), so no caller that uses
    /// the pool correctly can tell; a double free that meets one is refused, and this call's
    /// retry on the general path then frees the block, so of two racing frees of one
    /// reference exactly one still succeeds.
    #[inline]
    fn free_unshared(&self, ids: &[BlockId]) -> Option<Result<u32, PoolError>> {
        let n = ids.len();
        if n > CHAIN {
            return None;
        }
        let tag = u64::from(self.tag) << POOL_SHIFT;
        let first = ids.first()?.to_bits();
        if first & !(GEN_FIELD | INDEX_MASK) != tag {
            return None;
        }
        // Relaxed: only names the owner every block must have; the CASes below decide.
        let owner_bits = self
            .blocks
            .get((first & INDEX_MASK) as usize)?
            .meta
            .load(Ordering::Relaxed)
            & OWNER_FIELD;
        let owner = EngineId((owner_bits >> OWNER_SHIFT) as u16);
        for (i, &id) in ids.iter().enumerate() {
            let bits = id.to_bits();
            let index = bits & INDEX_MASK;
            // The word such a block must have: allocated, one reference, the id's generation
            // (same bits in both words), the batch's owner.
            let unshared = owner_bits | (bits & GEN_FIELD) | 1;
            let released = match self.blocks.get(index as usize) {
                // AcqRel on success: as in drop_ref_from. Relaxed on failure: not used.
                Some(line) if bits & !(GEN_FIELD | INDEX_MASK) == tag => line
                    .meta
                    .compare_exchange(unshared, unshared - 1, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok(),
                _ => false,
            };
            if !released {
                self.unfree(&ids[..i], owner);
                return None;
            }
        }
        self.recycle(owner, ids.iter().map(|id| id.index()));
        Some(Ok(n as u32))
    }

    /// Puts blocks that `free_unshared` took from one reference to none back to one (see
    /// there): they are this thread's alone meanwhile (on no list, every CAS of another thread
    /// on them fails), so a store restores them.
    #[cold]
    fn unfree(&self, ids: &[BlockId], owner: EngineId) {
        for &id in ids {
            // Release: the restored word is published like claim's.
            self.blocks[id.index() as usize]
                .meta
                .store(meta_word(1, id.generation(), owner), Ordering::Release);
        }
    }

    /// Whether more than one holder references the block (copy-on-write must copy before
    /// writing).
    pub fn is_shared(&self, id: BlockId) -> Result<bool, PoolError> {
        Ok(self.ref_count(id)? > 1)
    }

    /// The block's current reference count (at least 1 for a live id).
    pub fn ref_count(&self, id: BlockId) -> Result<u32, PoolError> {
        let index = self.check_id(id)?;
        let meta = self.blocks[index].meta.load(Ordering::Acquire);
        self.check_live(id, meta)?;
        Ok(meta_refs(meta))
    }

    /// The engine that owns (allocated) the block.
    pub fn owner(&self, id: BlockId) -> Result<EngineId, PoolError> {
        let index = self.check_id(id)?;
        let meta = self.blocks[index].meta.load(Ordering::Acquire);
        self.check_live(id, meta)?;
        Ok(meta_owner(meta))
    }
}
