//! What every engine of one device shares: the block pool, the KV arena it indexes, the budget
//! coordinator, and the donation board through which engines ask each other for pages.

use super::donations::DonationBoard;
use crate::block::{BlockPool, EngineId, PoolConfig};
use crate::budget::{BudgetConfig, BudgetCoordinator};
use crate::error::EngineError;
use crate::kv::KvArena;
use crate::prefix::{PrefixCache, PrefixConfig};
use crate::sync::Arc;

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
    /// Pages engines asked each other to give back for their latency-critical work, one
    /// request per requester, taken by the donor at the start of its next step.
    donations: DonationBoard,
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
        Ok(Self {
            pool,
            coordinator,
            host: None,
            #[cfg(feature = "cuda")]
            device: None,
            page_bytes,
            prefix: None,
            donations: DonationBoard::new(budget.max_engines),
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

    /// `requester` asks `donor` to give back `pages` pages at the start of its next step (a
    /// wait-free pair of swaps). A request larger than the pool is clamped to it. Each
    /// engine has one request outstanding at most: this replaces any earlier one of
    /// `requester`'s that its donor has not taken (its need now is this one), and 0 pages
    /// withdraws it.
    pub fn ask_donation(&self, requester: EngineId, donor: EngineId, pages: u32) {
        self.donations
            .ask(requester, donor, pages.min(self.pool.total()));
    }

    /// Withdraws `requester`'s outstanding request ([`ask_donation`](Self::ask_donation)) if
    /// its donor has not taken it, and returns its pages (0: none). An engine does this as it
    /// leaves, so that its donor does not shed pages for nobody. Wait-free: one swap.
    pub fn withdraw_donation(&self, requester: EngineId) -> u32 {
        self.donations.withdraw(requester)
    }

    /// Takes the pages other engines asked `engine` to give back, and counts the take
    /// ([`donations_taken`](Self::donations_taken)). Wait-free: O(1) when nobody asked it,
    /// else one load and at most one compare-exchange per engine slot.
    pub fn take_donations(&self, engine: EngineId) -> u32 {
        self.donations.take(engine)
    }

    /// How many times `engine` took its donation requests
    /// ([`take_donations`](Self::take_donations), once per step of an
    /// [`Engine`](super::Engine)). A requester that reads this after
    /// [`ask_donation`](Self::ask_donation) knows, once it changed, that the donor has taken
    /// that request (or the one replacing it): an engine asks again only then, not at each of
    /// its steps while the donor has not stepped.
    pub fn donations_taken(&self, engine: EngineId) -> u64 {
        self.donations.taken(engine)
    }
}
