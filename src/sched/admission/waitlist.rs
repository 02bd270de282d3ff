//! A lock-free list of parked tasks, woken all at once: a Treiber stack (R. K. Treiber, 1986)
//! whose only removal is "take the whole list" (`swap(null)`).
//!
//! # ABA and reclamation
//!
//! A Treiber stack with a single-node pop suffers ABA (a popper's `CAS(head, A → A.next)` can
//! succeed on a recycled `A` with a stale `next`) and needs deferred reclamation (a popper may
//! read `A.next` after another popper freed `A`). Neither applies here, because nodes are never
//! removed one at a time:
//!
//! - A push sets `node.next = h` and then `CAS(head, h → node)`. Its success means `head == h` at
//!   the CAS, so `node.next` is the current list whatever happened to `h` in between (even if
//!   `h` was taken, freed, and its address reused by a new node now at the head): ABA is benign.
//! - A pusher never dereferences `head`; only the thread whose `swap` took a list walks it, and
//!   that list is then private to it. Nodes are `Arc`s; the list owns one strong reference per
//!   node (`Arc::into_raw`), released by the taker after waking it. The registering task keeps
//!   its own reference to read `queued`.
//!
//! # Lost wake-ups
//!
//! The waiter side: `register`, then `fence(SeqCst)`, then re-check its condition. The waker
//! side: make the condition true, then `fence(SeqCst)`, then `has_waiters()` / `wake_all()`.
//! By the fence rule, either the waker's load sees the registration or the waiter's re-check
//! sees the condition: no waiter sleeps on a condition that became true unseen. (Modelled in
//! tests/loom/admission.rs.)

use std::ptr;
use std::task::Waker;

use crate::sync::{Arc, AtomicBool, AtomicPtr, Ordering};

/// One parked task.
pub(crate) struct Node {
    /// The task to wake. Immutable: a task that is re-polled with another waker registers a new
    /// node (see [`Registration::is_current`]).
    waker: Waker,
    /// The next (older) node. Written before the node is published by the push CAS (Release)
    /// and read only by the taker after its Acquire swap, so Relaxed accesses suffice.
    next: AtomicPtr<Node>,
    /// True from registration until the taker has woken this node: the registrant may rely on
    /// a future wake-up while it reads `true`.
    queued: AtomicBool,
}

/// What `register` gives back: the registrant's reference to its node.
#[derive(Debug)]
pub(crate) struct Registration(Arc<Node>);

impl Registration {
    /// True if the node is still queued and would wake `waker`'s task: re-registering is then
    /// unnecessary (the pending wake-up is still owed to us).
    pub(crate) fn is_current(&self, waker: &Waker) -> bool {
        // Acquire: pairs with the taker's Release store of `false`; a stale `true` is harmless
        // because the taker that cleared it wakes us right after.
        self.0.queued.load(Ordering::Acquire) && self.0.waker.will_wake(waker)
    }
}

impl Registration {
    /// True while the node is in a list no taker has taken yet (its wake-up is still owed).
    pub(crate) fn is_queued(&self) -> bool {
        // Acquire: as in `is_current`.
        self.0.queued.load(Ordering::Acquire)
    }

    /// Gives up a registration whose task no longer waits (its future dropped, or re-polled
    /// with another waker). The list cannot unlink one node, so a node still queued takes the
    /// whole list with it: its waiters get a spurious wake-up and register again (no wake-up
    /// is lost). Without this every abandoned registration kept its node and a clone of its
    /// task's waker (a whole task's memory, in a runtime) until the next wake-up, which an
    /// idle worker polling with a timeout never gets.
    ///
    /// # Panics
    /// A waker's panic, as [`WaitList::wake_all`] (not while the thread already panics).
    pub(crate) fn abandon(self, list: &WaitList) {
        if self.is_queued() {
            if let Some(panic) = list.wake_all_catching() {
                if !std::thread::panicking() {
                    std::panic::resume_unwind(panic);
                }
            }
        }
    }
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("queued", &self.queued.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// The list. See the module docs.
pub(crate) struct WaitList {
    /// The newest node, or null. Each node is owned by the list through one `Arc` strong count.
    head: AtomicPtr<Node>,
}

impl WaitList {
    /// An empty list.
    pub(crate) fn new() -> Self {
        Self {
            head: AtomicPtr::new(ptr::null_mut()),
        }
    }

    /// Queues `waker`. The caller must `fence(SeqCst)` and re-check its condition afterwards.
    pub(crate) fn register(&self, waker: &Waker) -> Registration {
        let node = Arc::new(Node {
            waker: waker.clone(),
            next: AtomicPtr::new(ptr::null_mut()),
            queued: AtomicBool::new(true),
        });
        let raw = Arc::into_raw(node.clone()) as *mut Node;
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            node.next.store(head, Ordering::Relaxed);
            // Release: publishes `next`, `waker` and `queued` to the taker's Acquire swap.
            // SeqCst would add nothing: the caller's fence orders this with its re-check.
            match self
                .head
                .compare_exchange_weak(head, raw, Ordering::Release, Ordering::Relaxed)
            {
                Ok(_) => return Registration(node),
                Err(current) => head = current,
            }
        }
    }

    /// True if some task may be queued. The caller must have made its condition true and
    /// issued `fence(SeqCst)` first (see the module docs).
    #[inline]
    pub(crate) fn has_waiters(&self) -> bool {
        // Relaxed: ordering comes from the caller's SeqCst fence; a non-null head is then
        // followed by the Acquire swap in `wake_all`.
        !self.head.load(Ordering::Relaxed).is_null()
    }

    /// Takes every queued node and wakes its task.
    ///
    /// # Panics
    ///
    /// If a waker panics, every other taken node is still woken and released (a panic must not
    /// strand the waiters behind it, queued forever with nobody left to wake them); then the
    /// first panic is resumed.
    pub(crate) fn wake_all(&self) {
        if let Some(panic) = self.wake_all_catching() {
            std::panic::resume_unwind(panic);
        }
    }

    /// [`WaitList::wake_all`], handing back the first waker panic instead of resuming it, so a
    /// caller with several lists to wake can finish them all first.
    pub(crate) fn wake_all_catching(&self) -> Option<Box<dyn std::any::Any + Send>> {
        // Acquire: pairs with the Release push CAS of every node in the taken list (a release
        // sequence on `head`), making their fields visible.
        let mut cur = self.head.swap(ptr::null_mut(), Ordering::Acquire);
        let mut first_panic = None;
        while !cur.is_null() {
            // SAFETY: `cur` came from `Arc::into_raw` in `register`, and the list's strong count
            // for it is ours alone: the swap took the whole list out of `head`, and no other
            // path reads nodes reachable from a taken list. Rebuilding the Arc releases it once.
            let node = unsafe { Arc::from_raw(cur as *const Node) };
            cur = node.next.load(Ordering::Relaxed);
            // Release: the registrant's Acquire load in `is_current` sees `false` only after
            // the node left the list.
            node.queued.store(false, Ordering::Release);
            // A waker is foreign code: catch its panic so that the rest of the list (already
            // detached, reachable only from here) is still woken. `AssertUnwindSafe`: the
            // closure only borrows the node's waker, which we drop right after either way.
            let woke = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                node.waker.wake_by_ref();
            }));
            if let Err(panic) = woke {
                first_panic.get_or_insert(panic);
            }
            // Dropping our reference may drop the waker (its registrant is gone): foreign code
            // too, whose panic must not strand the rest of the list either.
            let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                drop(node);
            }));
            if let Err(panic) = dropped {
                first_panic.get_or_insert(panic);
            }
        }
        first_panic
    }
}

impl Drop for WaitList {
    fn drop(&mut self) {
        // Only frees the nodes, waking nobody: every registrant is a future that borrows the
        // queue set owning this list, so none can still be waiting once it is dropped (a future
        // dropped while registered took the list with it, `Registration::abandon`: the nodes
        // left are those of futures leaked while registered).
        // Acquire: as in `wake_all_catching` (with `&mut self` it orders nothing new; loom's
        // `AtomicPtr` has no `get_mut`).
        let mut cur = self.head.swap(ptr::null_mut(), Ordering::Acquire);
        while !cur.is_null() {
            // SAFETY: as in `wake_all_catching`: `&mut self` makes the list ours alone, and each
            // node holds one strong count owned by the list, released once here.
            let node = unsafe { Arc::from_raw(cur as *const Node) };
            cur = node.next.load(Ordering::Relaxed);
        }
    }
}

impl std::fmt::Debug for WaitList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WaitList")
            .field("has_waiters", &!self.head.load(Ordering::Relaxed).is_null())
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::WaitList;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Wake, Waker};

    /// Counts its wake-ups; panics on each if `panics`.
    struct Probe {
        woken: AtomicUsize,
        panics: bool,
    }

    impl Wake for Probe {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.woken.fetch_add(1, Ordering::SeqCst);
            assert!(!self.panics, "this waker panics");
        }
    }

    fn probe(panics: bool) -> (Arc<Probe>, Waker) {
        let p = Arc::new(Probe {
            woken: AtomicUsize::new(0),
            panics,
        });
        (p.clone(), Waker::from(p))
    }

    /// A panicking waker in the middle of a list: the panic reaches the caller, and every other
    /// waiter (before and after it in the list) is still woken and no longer marked queued.
    #[test]
    fn a_panicking_waker_does_not_strand_the_rest_of_the_list() {
        let list = WaitList::new();
        let probes: Vec<_> = [false, false, true, false, false]
            .into_iter()
            .map(probe)
            .collect();
        let regs: Vec<_> = probes.iter().map(|(_, w)| list.register(w)).collect();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| list.wake_all()));
        assert!(r.is_err(), "the waker's panic is resumed");
        for (i, ((p, w), reg)) in probes.iter().zip(&regs).enumerate() {
            assert_eq!(p.woken.load(Ordering::SeqCst), 1, "waiter {i} woken once");
            assert!(!reg.is_current(w), "waiter {i} no longer queued");
        }
        assert!(!list.has_waiters());
        // Two panicking wakers: both woken, the first panic resumed, nothing left queued.
        let (a, wa) = probe(true);
        let (b, wb) = probe(true);
        let (c, wc) = probe(false);
        let _regs = [list.register(&wa), list.register(&wb), list.register(&wc)];
        assert!(list.wake_all_catching().is_some());
        for p in [&a, &b, &c] {
            assert_eq!(p.woken.load(Ordering::SeqCst), 1);
        }
        assert!(!list.has_waiters());
    }

    /// Panics when dropped (a waker whose destructor is foreign code that panics).
    struct PanicsOnDrop;

    impl Drop for PanicsOnDrop {
        fn drop(&mut self) {
            panic!("this waker's drop panics");
        }
    }

    impl Wake for PanicsOnDrop {
        fn wake(self: Arc<Self>) {}
    }

    /// A waker whose registrant has gone is dropped by the wake-up: its destructor's panic
    /// reaches the caller, and the waiters after it in the list are still woken.
    #[test]
    fn a_waker_whose_drop_panics_does_not_strand_the_rest_of_the_list() {
        let list = WaitList::new();
        let (after, w_after) = probe(false);
        let _kept = list.register(&w_after);
        // The last reference to this waker is its node's: registration and waker dropped.
        drop(list.register(&Waker::from(Arc::new(PanicsOnDrop))));
        let (before, w_before) = probe(false);
        let _kept2 = list.register(&w_before);
        assert!(
            list.wake_all_catching().is_some(),
            "the drop's panic is reported"
        );
        for p in [&before, &after] {
            assert_eq!(p.woken.load(Ordering::SeqCst), 1);
        }
        assert!(!list.has_waiters());
    }
}
