//! What every engine of one device shares: the block pool, the KV arena it indexes, the budget
//! coordinator, and the donation board through which engines ask each other for pages.

use crate::block::{BlockPool, EngineId, PoolConfig};
use crate::budget::{BudgetConfig, BudgetCoordinator};
use crate::error::EngineError;
use crate::kv::KvArena;
use crate::prefix::{PrefixCache, PrefixConfig};
use crate::sync::{Arc, AtomicU32, AtomicU64, CachePadded, Ordering};

/// One device's shared KV state. Built once, then shared by every [`Engine`](super::Engine)
/// through `Arc`. The pool and the arena are built together, so a page id from the pool always
/// names a page of this arena.
#[derive(Debug)]
pub struct SharedArena {
    pool: Arc<BlockPool>,
    coordinator: Arc<BudgetCoordinator>,
    host: Option<Arc<KvArena>>,
    #[cfg(feature = "cuda")]
    device: Option<Arc<crate::cuda::DeviceArena>>,
    page_bytes: usize,
    /// The prefix cache every engine of the arena shares, if enabled.
    prefix: Option<Arc<PrefixCache>>,
    /// Pages other engines asked each engine to give back for their latency-critical work,
    /// taken (and zeroed) by the engine at the start of its next step.
    donations: Box<[CachePadded<AtomicU32>]>,
    /// How many times each engine took its donation requests (one per step): a requester
    /// asks a donor again only once the donor has taken its last request.
    donation_takes: Box<[CachePadded<AtomicU64>]>,
}

impl SharedArena {
    /// A host arena of `budget.total_blocks` pages of `page_bytes` (see
    /// [`page_bytes_for`](crate::kv::page_bytes_for)), its pool, and a coordinator of `budget`.
    pub fn host(budget: BudgetConfig, page_bytes: usize) -> Result<Arc<Self>, EngineError> {
        let mut shared = Self::accounting(budget, page_bytes)?;
        shared.host = Some(Arc::new(KvArena::new(
            budget.total_blocks as usize,
            page_bytes,
        )?));
        Ok(Arc::new(shared))
    }

    /// A device arena on `gpu`, its pool, and a coordinator of `budget`.
    #[cfg(feature = "cuda")]
    pub fn cuda(
        gpu: &crate::cuda::Gpu,
        budget: BudgetConfig,
        page_bytes: usize,
    ) -> Result<Arc<Self>, EngineError> {
        let mut shared = Self::accounting(budget, page_bytes)?;
        shared.device = Some(crate::cuda::DeviceArena::new(
            gpu,
            budget.total_blocks as usize,
            page_bytes,
        )?);
        Ok(Arc::new(shared))
    }

    /// The pool and coordinator of an arena whose bytes the caller allocates: `budget.total_blocks`
    /// pages of `page_bytes` in memory of the caller's own (device memory from a client's driver
    /// binding, for `Engine::raw` backends). The arena holds no memory of
    /// its own; [`host_arena`](Self::host_arena) is `None`.
    ///
    /// # Errors
    /// As [`SharedArena::host`] for the sizes (zero, misaligned, too many pages, overflow).
    pub fn external(budget: BudgetConfig, page_bytes: usize) -> Result<Arc<Self>, EngineError> {
        crate::kv::check_arena_size(budget.total_blocks as usize, page_bytes)?;
        Ok(Arc::new(Self::accounting(budget, page_bytes)?))
    }

    fn accounting(budget: BudgetConfig, page_bytes: usize) -> Result<Self, EngineError> {
        let pool = Arc::new(BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: budget.total_blocks,
            max_engines: budget.max_engines,
        })?);
        let coordinator = Arc::new(BudgetCoordinator::new(budget)?);
        let donations = (0..budget.max_engines)
            .map(|_| CachePadded::new(AtomicU32::new(0)))
            .collect();
        let donation_takes = (0..budget.max_engines)
            .map(|_| CachePadded::new(AtomicU64::new(0)))
            .collect();
        Ok(Self {
            pool,
            coordinator,
            host: None,
            #[cfg(feature = "cuda")]
            device: None,
            page_bytes,
            prefix: None,
            donations,
            donation_takes,
        })
    }

    /// Builds the arena's prefix cache (shared by every engine that enables it in its
    /// [`EngineConfig`](super::EngineConfig)). Call before sharing the arena, e.g.
    /// `Arc::get_mut(&mut shared)`; `seed` fixes the block hasher's seed (`None`: a secret one).
    pub fn enable_prefix_cache(&mut self, seed: Option<u64>) {
        self.prefix = Some(Arc::new(PrefixCache::new(
            self.pool.clone(),
            PrefixConfig { seed },
        )));
    }

    /// The prefix cache, if enabled.
    pub fn prefix_cache(&self) -> Option<&Arc<PrefixCache>> {
        self.prefix.as_ref()
    }

    /// The block pool (one block = one page of the arena).
    pub fn pool(&self) -> &Arc<BlockPool> {
        &self.pool
    }

    /// The budget coordinator.
    pub fn coordinator(&self) -> &Arc<BudgetCoordinator> {
        &self.coordinator
    }

    /// The host arena, if this is a host arena.
    pub fn host_arena(&self) -> Option<&Arc<KvArena>> {
        self.host.as_ref()
    }

    /// The device arena, if this is a device arena.
    #[cfg(feature = "cuda")]
    pub fn device_arena(&self) -> Option<&Arc<crate::cuda::DeviceArena>> {
        self.device.as_ref()
    }

    /// Bytes of one page.
    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// Bytes of the whole arena (pages x page bytes): every KV byte the engines use.
    pub fn total_bytes(&self) -> u64 {
        u64::from(self.pool.total()) * self.page_bytes as u64
    }

    /// Asks `donor` to give back `pages` pages at the start of its next step (one wait-free
    /// `fetch_add`; requests add up). A request larger than the pool is clamped to it. The sum
    /// would wrap only past 2^32 pages asked between two steps of the donor; shedding is
    /// advisory, so a wrapped sum only makes the donor give back fewer pages.
    pub fn ask_donation(&self, donor: EngineId, pages: u32) {
        if let Some(slot) = self.donations.get(donor.index()) {
            // SeqCst, like the take's count and swap and the requester's read of the count
            // after this (`donations_taken`): see `take_donations`. The pages themselves are
            // handed over through the pool.
            slot.fetch_add(pages.min(self.pool.total()), Ordering::SeqCst);
        }
    }

    /// Takes the pages other engines asked `engine` to give back (one wait-free `swap`), and
    /// counts the take ([`donations_taken`](Self::donations_taken)).
    pub fn take_donations(&self, engine: EngineId) -> u32 {
        // Counted before the swap, and all four operations (the requester's ask and its read
        // of the count after it, this count and this swap) SeqCst: if the requester's read
        // comes before this count in their single total order, its ask comes before this
        // swap, which takes it. So a requester that asks again only once the count moved past
        // the one it read never has two requests outstanding with this donor.
        if let Some(takes) = self.donation_takes.get(engine.index()) {
            takes.fetch_add(1, Ordering::SeqCst);
        }
        self.donations
            .get(engine.index())
            .map_or(0, |slot| slot.swap(0, Ordering::SeqCst))
    }

    /// How many times `engine` took its donation requests
    /// ([`take_donations`](Self::take_donations), once per step of an
    /// [`Engine`](super::Engine)). A requester that reads this after
    /// [`ask_donation`](Self::ask_donation) and asks again only once it changed has at most
    /// one request outstanding with that donor: a waiting engine that steps faster than its
    /// donor does not pile up requests for the same pages.
    pub fn donations_taken(&self, engine: EngineId) -> u64 {
        self.donation_takes
            .get(engine.index())
            // SeqCst: see `take_donations`.
            .map_or(0, |slot| slot.load(Ordering::SeqCst))
    }
}
