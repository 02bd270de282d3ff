//! The allocation side of [`BlockPool`]: single and batch allocation from the caller's
//! magazine or the shared stack, the stack's pop and batch detach, the magazine flush of the
//! refusal path, and the claim that marks a popped block allocated and mints its id.

use super::*;

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
    pub(super) fn claim(self, index: u32) -> BlockId {
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

impl BlockPool {
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
    pub(super) fn take_one(&self, engine: EngineId) -> Option<(u32, bool)> {
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
    pub(super) fn grab_stack(&self, n: u32, out: &mut Vec<BlockId>) -> bool {
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
    pub(super) fn flush_magazines(&self) {
        let mut buf = [0u32; MAG_CAP as usize];
        for (m, acct) in self.mags.iter().zip(self.acct.iter()) {
            let k = m.pop_all(&mut buf);
            if k > 0 {
                self.push_chain(&buf[..k as usize]);
                // Until here `held` counts these blocks. Release: a `held` that reads this
                // count (Acquire) then sees the magazine's pop above, so it cannot pair the
                // lowered count with the magazine's word from before the pop (a count k too
                // low: blocks the engine owns would read as not held).
                acct.fetch_sub(k, Ordering::Release);
            }
        }
    }

    /// Marks a block just popped from the free list as allocated to `engine` and mints its id.
    #[inline]
    pub(super) fn claim(&self, index: u32, engine: EngineId) -> BlockId {
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
    pub(super) fn pop(&self) -> Option<u32> {
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
}
