//! The release side of [`BlockPool`]: references added and dropped, single and batch frees
//! (with the one-pass fast path for a sequence's unshared blocks), and the return of freed
//! blocks to the owner's magazine or the shared stack.

use super::*;

impl BlockPool {
    /// Returns blocks of `owner` whose last reference was just released to a free list: the
    /// owner's magazine when it has room and no other push to it is in progress (never
    /// awaited; `acct` unchanged: owned becomes parked), else the shared stack (uncounted
    /// first, so `held` never counts a block that is already on the stack).
    #[inline]
    pub(super) fn recycle(
        &self,
        owner: EngineId,
        chain: impl ExactSizeIterator<Item = u32> + Clone,
    ) {
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

    /// Pushes blocks whose last reference was just released, as one chain with one CAS:
    /// `chain[0]` becomes the new top and `chain[k-1]` links to the old top.
    #[inline]
    pub(super) fn push_chain(&self, chain: &[u32]) {
        let Some(&first) = chain.first() else {
            return;
        };
        let k = chain.len() as u32;
        // Release fence before the link stores below: a reader whose Relaxed load of a link
        // sees one of them (a snapshot reading the depth of a top it loaded earlier) and then
        // passes an Acquire fence also sees every head update that came before this push,
        // among them the pop that took these blocks off the stack (see `snapshot_free`).
        fence(Ordering::Release);
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
        self.share_counted(id).map(drop)
    }

    /// [`share`](Self::share), returning how many references the block had just before this
    /// one: a count read separately afterwards may already include other threads' changes,
    /// this one is the count this reference was added to.
    pub fn share_counted(&self, id: BlockId) -> Result<u32, PoolError> {
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
                Ok(_) => return Ok(meta_refs(cur)),
                Err(actual) => {
                    cur = actual;
                    backoff.spin();
                }
            }
        }
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
    pub(super) fn drop_ref(&self, id: BlockId) -> Result<Option<EngineId>, PoolError> {
        let index = self.check_id(id)?;
        // Acquire pairs with claim's Release store (the generation we compare against).
        let cur = self.blocks[index].meta.load(Ordering::Acquire);
        self.drop_ref_from(id, index, cur)
    }

    /// [`drop_ref`](Self::drop_ref) of a checked id at `index`, with `cur` a value of its
    /// metadata word read earlier (the CAS's first expected value; a stale one costs a retry).
    #[inline]
    pub(super) fn drop_ref_from(
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
    pub(super) fn free_unshared(&self, ids: &[BlockId]) -> Option<Result<u32, PoolError>> {
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
    pub(super) fn unfree(&self, ids: &[BlockId], owner: EngineId) {
        for &id in ids {
            // Release: the restored word is published like claim's.
            self.blocks[id.index() as usize]
                .meta
                .store(meta_word(1, id.generation(), owner), Ordering::Release);
        }
    }
}
