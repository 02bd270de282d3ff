//! Observability: a snapshot of every engine's figures, and every engine's block quota, read
//! under the publication epoch.

use super::{
    unpack_load, BudgetCoordinator, EngineStats, Snapshot, JOINING, LIVE, NO_DEMAND, USED_MASK,
};
use crate::ids::EngineId;
use crate::sync::{fence, Ordering};

impl BudgetCoordinator {
    /// Every registered engine's figures. Budgets, quotas and limits are read under the
    /// publication epoch and retried (a bounded number of times) until they come from one
    /// publication; counters are read as they are at that moment.
    pub fn snapshot(&self) -> Snapshot {
        let mut engines = Vec::with_capacity(self.slots.len());
        let (epoch, consistent) = self.read_published(&mut engines, |engines| {
            for (i, slot) in self.slots.iter().enumerate() {
                let state = slot.state.load(Ordering::Acquire);
                if state != JOINING && state != LIVE {
                    continue;
                }
                let held = slot.blocks_held.load(Ordering::Relaxed);
                let quota = slot.block_quota.load(Ordering::Relaxed);
                let limit = slot.block_limit.load(Ordering::Relaxed);
                engines.push(EngineStats {
                    engine: EngineId(i as u16),
                    weight: slot.weight.load(Ordering::Relaxed),
                    active: slot.active.load(Ordering::Relaxed),
                    token_budget: slot.token_budget.load(Ordering::Relaxed),
                    token_share: slot.token_share.load(Ordering::Relaxed),
                    token_demand: match slot.demand.load(Ordering::Relaxed) {
                        NO_DEMAND => None,
                        d => Some(d),
                    },
                    tokens_used: slot.tokens.load(Ordering::Relaxed) & USED_MASK,
                    block_quota: quota,
                    block_demand: match slot.block_demand.load(Ordering::Relaxed) {
                        NO_DEMAND => None,
                        d => Some(d),
                    },
                    block_limit: limit,
                    blocks_held: held,
                    blocks_borrowed: held.saturating_sub(u64::from(quota)),
                    blocks_to_reclaim: held.saturating_sub(u64::from(limit)),
                    load: unpack_load(slot.load.load(Ordering::Relaxed)),
                });
            }
        });
        Snapshot {
            epoch,
            consistent,
            tokens_per_step: self.config.tokens_per_step,
            total_blocks: self.config.total_blocks,
            blocks_in_use: self.blocks_in_use(),
            tokens_in_use: self.tokens_in_use(),
            engines,
        }
    }

    /// Every slot's block quota, indexed by engine id (0 for a slot no engine holds): what
    /// prefix-cache eviction weighs engines by ([`EngineShare`](crate::sched::EngineShare)).
    /// Read under the publication epoch and retried like [`snapshot`](Self::snapshot), so the
    /// quotas come from one publication: read slot by slot, they could pair one engine's
    /// lowered quota with another's not yet raised (or, read before and after a whole
    /// publication, an old quota with a new one). Only a publisher still writing through every
    /// attempt leaves a mix, each quota then that of the publication before or of the one
    /// being written.
    pub fn block_quotas(&self) -> Vec<u32> {
        let mut quotas = Vec::with_capacity(self.slots.len());
        self.read_published(&mut quotas, |quotas| {
            quotas.extend(
                self.slots
                    .iter()
                    .map(|slot| slot.block_quota.load(Ordering::Relaxed)),
            );
        });
        quotas
    }

    /// Fills `out` with `read` (loads of published figures) under the publication epoch, again
    /// (at most 8 passes) until one pass saw a single publication. Returns the epoch after the
    /// last pass and whether that pass was consistent.
    fn read_published<T>(
        &self,
        out: &mut Vec<T>,
        mut read: impl FnMut(&mut Vec<T>),
    ) -> (u64, bool) {
        const ATTEMPTS: u32 = 8;
        let mut attempt = 0;
        loop {
            out.clear();
            // Acquire: pairs with the publisher's final Release store of the even epoch.
            let before = self.epoch.load(Ordering::Acquire);
            read(out);
            // Acquire fence: if we read any value written after the publisher's odd store, the
            // re-read below sees an epoch past `before` (pairs with its Release fence).
            fence(Ordering::Acquire);
            let after = self.epoch.load(Ordering::Relaxed);
            attempt += 1;
            let consistent = before == after && before % 2 == 0;
            if consistent || attempt == ATTEMPTS {
                return (after, consistent);
            }
            crate::sync::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{BudgetConfig, BudgetCoordinator};
    use crate::sync::Ordering;

    /// A snapshot taken while a publisher is stalled in its write phase (the epoch odd) is
    /// reported torn: every attempt saw the odd epoch, so its figures may mix two
    /// publications. The stress test reaches this only when the timing falls that way.
    #[test]
    fn a_snapshot_taken_while_a_publisher_writes_is_not_consistent() {
        let c = BudgetCoordinator::new(BudgetConfig::new(2, 8, 8)).unwrap();
        c.register(1).unwrap();
        let even = c.epoch();
        assert_eq!(even % 2, 0);
        assert!(c.snapshot().consistent);
        c.epoch.store(even + 1, Ordering::Relaxed);
        let s = c.snapshot();
        assert_eq!(s.epoch, even + 1);
        assert!(
            !s.consistent,
            "a snapshot under an odd epoch read as consistent"
        );
        c.epoch.store(even, Ordering::Relaxed);
    }
}
