//! The donation board: engines ask each other for pages for their latency-critical work
//! ([`SharedArena::ask_donation`](super::SharedArena::ask_donation)), the donor takes the
//! requests at the start of its next step.
//!
//! One cell per *requester*, not per donor: it holds the requester's one outstanding request
//! (donor and pages), so a requester that leaves withdraws exactly its own request, and the
//! donor never sheds pages for an engine that is gone. (A per-donor sum could not tell whose
//! pages it held: taking one requester's part out of it races the donor's take and a third
//! engine's ask.) A per-donor flag says whether any cell may be addressed to the donor, so a
//! donor nobody asked takes with one swap instead of scanning every cell.

use crate::block::EngineId;
use crate::sync::{AtomicBool, AtomicU64, CachePadded, Ordering};

/// A cell's word: 0 (no request), or `(donor + 1) << 32 | pages` with `pages ≥ 1`.
const DONOR_SHIFT: u32 = 32;

#[derive(Debug)]
pub(super) struct DonationBoard {
    /// Per requester: its outstanding request, packed (see `DONOR_SHIFT`).
    requests: Box<[CachePadded<AtomicU64>]>,
    /// Per donor: set by an ask addressed to it, cleared by its take before it scans.
    asked: Box<[CachePadded<AtomicBool>]>,
    /// Per donor: how many times it took its requests (one per step).
    takes: Box<[CachePadded<AtomicU64>]>,
}

impl DonationBoard {
    pub(super) fn new(max_engines: u16) -> Self {
        let n = usize::from(max_engines);
        Self {
            requests: (0..n)
                .map(|_| CachePadded::new(AtomicU64::new(0)))
                .collect(),
            asked: (0..n)
                .map(|_| CachePadded::new(AtomicBool::new(false)))
                .collect(),
            takes: (0..n)
                .map(|_| CachePadded::new(AtomicU64::new(0)))
                .collect(),
        }
    }

    /// `requester` asks `donor` for `pages` (≥ 1; 0 withdraws), replacing any request of its
    /// own the donor it was addressed to has not taken yet: one request per requester, for
    /// its current need. Wait-free: two swaps.
    pub(super) fn ask(&self, requester: EngineId, donor: EngineId, pages: u32) {
        let (Some(cell), Some(flag)) = (
            self.requests.get(requester.index()),
            self.asked.get(donor.index()),
        ) else {
            return;
        };
        let word = if pages == 0 {
            0
        } else {
            ((u64::from(donor.0) + 1) << DONOR_SHIFT) | u64::from(pages)
        };
        // SeqCst, all of them (these two swaps, the requester's read of the count
        // after them, and the take's count, flag swap and scan): see `take`.
        cell.swap(word, Ordering::SeqCst);
        if word != 0 {
            // A swap, not a store (the same ordering argument): with a plain store, loom
            // 0.7.2 let a swap made after joining the storing thread still read `false`
            // (seen with two bare threads too), failing tests/loom/donations.rs spuriously.
            flag.swap(true, Ordering::SeqCst);
        }
    }

    /// Withdraws `requester`'s outstanding request, if its donor has not taken it; returns
    /// its pages (0: none outstanding). Wait-free: one swap. The cell is the requester's
    /// alone, so this never touches another engine's request, and a take racing it gets the
    /// pages or this call does, never both.
    pub(super) fn withdraw(&self, requester: EngineId) -> u32 {
        self.requests
            .get(requester.index())
            .map_or(0, |cell| cell.swap(0, Ordering::SeqCst) as u32)
    }

    /// Takes every request addressed to `donor` and returns their pages (saturating), and
    /// counts the take ([`taken`](Self::taken)). Wait-free: one `fetch_add` and one swap, then,
    /// if some request may be addressed to it, one load and at most one compare-exchange per
    /// cell, none retried (a cell whose compare-exchange fails was just replaced by its
    /// requester: the new request is taken at the donor's next step).
    pub(super) fn take(&self, donor: EngineId) -> u32 {
        let (Some(takes), Some(flag)) =
            (self.takes.get(donor.index()), self.asked.get(donor.index()))
        else {
            return 0;
        };
        // Counted before the flag swap and the scan, and all of them SeqCst with the
        // requester's two swaps and its read of the count: if the requester's read comes
        // before this count in their single total order, its ask (the cell, then the flag)
        // comes before this flag swap, which then reads it set, and before the scan's load of
        // its cell, which sees the request (or the requester's later replacement of it). So a
        // requester that asks again only once the count moved past the one it read never has
        // an ask the donor overlooked.
        takes.fetch_add(1, Ordering::SeqCst);
        if !flag.swap(false, Ordering::SeqCst) {
            return 0;
        }
        let mine = u64::from(donor.0) + 1;
        let mut pages = 0u32;
        for cell in self.requests.iter() {
            let word = cell.load(Ordering::SeqCst);
            if word >> DONOR_SHIFT == mine
                && cell
                    .compare_exchange(word, 0, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
            {
                pages = pages.saturating_add(word as u32);
            }
        }
        pages
    }

    /// How many times `donor` took its requests.
    pub(super) fn taken(&self, donor: EngineId) -> u64 {
        self.takes
            .get(donor.index())
            .map_or(0, |t| t.load(Ordering::SeqCst))
    }
}
