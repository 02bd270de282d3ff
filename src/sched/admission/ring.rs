//! A bounded multi-producer multi-consumer ring: Dmitry Vyukov's bounded MPMC queue
//! (1024cores.net, "Bounded MPMC queue"), with positions that carry a lap number so the capacity
//! need not be a power of two (the encoding crossbeam's `ArrayQueue` popularised).
//!
//! # Algorithm
//!
//! Every slot carries a *stamp*. A position is `lap | index`: the low bits (below `one_lap`, the
//! next power of two at or above the capacity) are the slot index, the high bits count laps
//! around the ring. A producer that reads `tail == T` owns position `T` once its CAS moves `tail`
//! past it, but only writes if the slot's stamp says the slot is empty *for this lap*
//! (`stamp == T`); it then publishes the value with `stamp = T + 1`. A consumer that reads
//! `head == H` takes the slot if its stamp is `H + 1` (full for this lap), and hands it back to the
//! producer of the next lap with `stamp = H + one_lap`.
//!
//! # ABA and reclamation
//!
//! There is nothing to reclaim: the slots are allocated once and values move in and out by
//! value. `head` and `tail` only grow (modulo 2^64 with the lap in the high bits), so a CAS on
//! them cannot succeed on a recycled value unless 2^64 / `one_lap` laps pass between a thread's
//! load and its CAS — a paused thread would need centuries of traffic. The stamp tells a slot's
//! laps apart, so a producer can never overwrite a value of the previous lap that no consumer has
//! taken yet (it sees `stamp == T - one_lap + 1`, which means "full").
//!
//! # Progress
//!
//! Vyukov's queue is **not lock-free in the strict sense**: a position is claimed (CAS on
//! `tail` or `head`) before its slot is written or emptied (the stamp store), and a thread
//! descheduled between the two holds that slot. A consumer cannot take any later value while
//! the producer of the value at `head` is stalled (positions are consumed in order), and a
//! producer cannot reuse a slot whose consumer of the previous lap is stalled. This ring never
//! waits for such a thread: [`Ring::try_push`] and [`Ring::try_pop`] report the situation
//! ([`PushError::Busy`], [`Pop::Busy`]) and return. Apart from that, both are lock-free: a retry
//! happens only after a failed CAS or a changed stamp or position, that is, after another
//! thread completed a step. Waiting (if a caller wants to) is the caller's business: the
//! admission layer parks tasks on wait lists that the thread finishing the step wakes.
//!
//! Eviction for the drop-oldest policy is [`Ring::evict_if_full`]: a pop that succeeds only if
//! the ring is full at the instant of its CAS (see there), so it never evicts while there is room.

use std::mem::MaybeUninit;

use crate::sync::{fence, AtomicUsize, Backoff, CachePadded, Ordering, UnsafeCell};

/// Why [`Ring::try_push`] gave a value back.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PushError<T> {
    /// Every slot's position is claimed by a producer and not yet by a consumer.
    Full(T),
    /// There is room, but the slot the next position maps to is still being read out by a
    /// consumer that claimed it (possibly descheduled). It frees the slot with its stamp store.
    Busy(T),
}

impl<T> PushError<T> {
    /// The value handed back.
    pub(crate) fn into_inner(self) -> T {
        match self {
            PushError::Full(v) | PushError::Busy(v) => v,
        }
    }
}

/// What [`Ring::try_pop`] and [`Ring::evict_if_full`] found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Pop<T> {
    /// The oldest value, taken.
    Value(T),
    /// `try_pop`: no position was claimed past `head` (empty). `evict_if_full`: the ring was not
    /// full (nothing evicted).
    Empty,
    /// The oldest position is claimed by a producer that has not published it yet (possibly
    /// descheduled between its claim and its stamp store): nothing can be taken before it.
    Busy,
}

/// What a push that cannot proceed reports, before the final stamp re-check.
enum Verdict {
    Full,
    Busy,
}

/// One cell of the ring.
struct Slot<T> {
    /// `stamp == p` (for the position `p` that maps to this slot): empty, the producer that
    /// claims `p` writes it next. `stamp == p + 1`: holds the value written at position `p`,
    /// the consumer that claims `p` takes it next. Any other value: a thread is mid-way through
    /// claiming and filling (or emptying) it.
    stamp: AtomicUsize,
    /// Initialised exactly when `stamp == p + 1` for some position `p` not yet consumed.
    value: UnsafeCell<MaybeUninit<T>>,
}

/// The ring. See the module docs.
pub(crate) struct Ring<T> {
    /// The position the next pop takes. Invariant: `head <= tail` in position order.
    head: CachePadded<AtomicUsize>,
    /// The position the next push fills.
    tail: CachePadded<AtomicUsize>,
    /// `cap` slots; slot `i` serves every position whose index bits are `i`.
    slots: Box<[Slot<T>]>,
    /// Number of slots (the capacity), at least 1.
    cap: usize,
    /// The smallest power of two above `cap - 1`: adding it to a position moves it one lap on.
    one_lap: usize,
}

// SAFETY: the ring hands each `T` from exactly one producer to exactly one consumer (the stamp
// protocol gives every written value a single taker), so sharing the ring between threads only
// ever moves `T`s across threads: `T: Send` suffices, exactly as for a channel.
unsafe impl<T: Send> Send for Ring<T> {}
// SAFETY: as above; `&Ring` gives no access to a `&T`, only moves of `T`.
unsafe impl<T: Send> Sync for Ring<T> {}

impl<T> Ring<T> {
    /// A ring with room for `cap` values. `cap` must be in `1..=usize::MAX / 4` (the caller,
    /// `AdmissionConfig::validate`, checks it), so that the lap arithmetic has bits to spare.
    #[cfg(test)]
    pub(crate) fn new(cap: usize) -> Self {
        Self::try_new(cap).unwrap_or_else(|| panic!("no memory for a ring of {cap} slots"))
    }

    /// Bytes of one slot (for a caller sizing many rings before building them).
    pub(crate) const SLOT_BYTES: usize = std::mem::size_of::<Slot<T>>();

    /// A ring of `cap` slots, or `None` if the allocator refuses their memory (a capacity
    /// that cannot fit, refused up front rather than aborting the process).
    pub(crate) fn try_new(cap: usize) -> Option<Self> {
        Self::try_new_from(cap, false)
    }

    /// A ring of `cap` slots whose positions start two laps before they wrap around `usize`,
    /// so that a test reaches the wrap (from lap 0 it takes 2^64 / `one_lap` laps).
    #[cfg(test)]
    pub(crate) fn new_near_wrap(cap: usize) -> Self {
        Self::try_new_from(cap, true).unwrap_or_else(|| panic!("no memory for {cap} slots"))
    }

    /// `try_new`; `near_wrap`: the first position is index 0 of the last lap but one.
    fn try_new_from(cap: usize, near_wrap: bool) -> Option<Self> {
        debug_assert!((1..=usize::MAX / 4).contains(&cap));
        let one_lap = (cap + 1).next_power_of_two();
        let start = if near_wrap {
            (usize::MAX & !(one_lap - 1)).wrapping_sub(one_lap)
        } else {
            0
        };
        let mut slots = Vec::new();
        slots.try_reserve_exact(cap).ok()?;
        slots.extend((0..cap).map(|i| Slot {
            // The first lap: slot `i` waits for the producer of position `start + i`.
            stamp: AtomicUsize::new(start + i),
            value: UnsafeCell::new(MaybeUninit::uninit()),
        }));
        let slots = slots.into_boxed_slice();
        Some(Self {
            head: CachePadded::new(AtomicUsize::new(start)),
            tail: CachePadded::new(AtomicUsize::new(start)),
            slots,
            cap,
            one_lap,
        })
    }

    /// The capacity.
    pub(crate) fn capacity(&self) -> usize {
        self.cap
    }

    /// The position after `pos`: the next index, or index 0 of the next lap.
    #[inline]
    fn advance(&self, pos: usize) -> usize {
        let index = pos & (self.one_lap - 1);
        if index + 1 < self.cap {
            pos + 1
        } else {
            (pos & !(self.one_lap - 1)).wrapping_add(self.one_lap)
        }
    }

    /// Appends `value`. Never waits for another thread: gives the value back with
    /// [`PushError::Full`] if every slot is taken, or [`PushError::Busy`] if the slot it needs
    /// still holds the previous lap's value whose consumer has claimed it but not finished
    /// reading it out (a room that exists but is not usable yet; that consumer's stamp store
    /// frees it).
    pub(crate) fn try_push(&self, value: T) -> Result<(), PushError<T>> {
        let backoff = Backoff::new();
        let mut tail = self.tail.load(Ordering::Relaxed);
        loop {
            let slot = &self.slots[tail & (self.one_lap - 1)];
            // Acquire: pairs with the Release stamp store in `try_pop` / `evict_if_full` that
            // emptied this slot, so the consumer's read of the old value happens before our
            // write below.
            let stamp = slot.stamp.load(Ordering::Acquire);
            if stamp == tail {
                // The slot is empty for this lap: claim position `tail`.
                // SeqCst: the claim takes part in the single order that the `fence(SeqCst)` of
                // the empty check in `try_pop` relies on. On failure we only need the fresh
                // value to retry with.
                match self.tail.compare_exchange_weak(
                    tail,
                    self.advance(tail),
                    Ordering::SeqCst,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        #[cfg(all(test, not(loom)))]
                        stall::point(stall::Point::Claimed);
                        // SAFETY: the CAS made us the only owner of position `tail`, and the
                        // stamp (== tail, read with Acquire) says its consumer of the previous
                        // lap has finished reading, so nobody else touches the slot until we
                        // publish it with the stamp store below.
                        slot.value.with_mut(|v| unsafe { (*v).write(value) });
                        // Release: publishes the value to the consumer's Acquire stamp load.
                        slot.stamp.store(tail + 1, Ordering::Release);
                        return Ok(());
                    }
                    Err(current) => {
                        // Another producer claimed `tail` first (it progressed): retry.
                        tail = current;
                        backoff.spin();
                    }
                }
                continue;
            }
            let verdict = if stamp.wrapping_add(self.one_lap) == tail + 1 {
                // The slot still holds the value written one lap ago. `tail` is current (no
                // producer can claim it before that value leaves), so the ring is full unless
                // the value's consumer has claimed it already.
                // SeqCst fence: orders our stamp load before the head load below, pairing with
                // the SeqCst head CAS of the consumers, so "full" is only reported if, at the
                // head load, the consumer of that old value had not even claimed it.
                fence(Ordering::SeqCst);
                let head = self.head.load(Ordering::Relaxed);
                if head.wrapping_add(self.one_lap) == tail {
                    Verdict::Full
                } else {
                    // Its consumer claimed it and is reading it out.
                    Verdict::Busy
                }
            } else {
                // `tail` is stale (another producer filled this position: catch up), or the
                // producer of the previous lap claimed this slot and has not written it yet:
                // then every slot is claimed and the ring is full.
                let current = self.tail.load(Ordering::Relaxed);
                if current != tail {
                    tail = current;
                    backoff.spin();
                    continue;
                }
                Verdict::Full
            };
            // Acquire: as the first stamp load. A changed stamp means the thread we would be
            // reporting on has moved on: retry instead of reporting a state that has passed.
            if slot.stamp.load(Ordering::Acquire) != stamp {
                backoff.spin();
                tail = self.tail.load(Ordering::Relaxed);
                continue;
            }
            return Err(match verdict {
                Verdict::Full => PushError::Full(value),
                Verdict::Busy => PushError::Busy(value),
            });
        }
    }

    /// Takes the oldest value. Never waits for another thread: reports [`Pop::Empty`] if no
    /// position is claimed past `head`, or [`Pop::Busy`] if the oldest position is claimed by a
    /// producer that has not finished writing it (its stamp store publishes it).
    pub(crate) fn try_pop(&self) -> Pop<T> {
        self.take(false)
    }

    /// Drop-oldest eviction: takes the oldest value **only if the ring is full at the instant
    /// of the taking CAS**; otherwise reports [`Pop::Empty`] ("not full": the caller retries its
    /// push) or [`Pop::Busy`] (the oldest value is still being written).
    ///
    /// Why the check is exact: the ring is full when `tail == head + one_lap` (every slot's
    /// position claimed). We read `head == H`, then `tail == H + one_lap`, then CAS `head` from
    /// `H`. No producer can claim `H + one_lap` before the consumer of `H` hands the slot back,
    /// which needs a successful CAS from `H`; so if ours succeeds, `tail` was still exactly
    /// `H + one_lap` (it never decreases) when it did.
    pub(crate) fn evict_if_full(&self) -> Pop<T> {
        self.take(true)
    }

    /// `try_pop`, or with `only_if_full` `evict_if_full`.
    fn take(&self, only_if_full: bool) -> Pop<T> {
        let backoff = Backoff::new();
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            let slot = &self.slots[head & (self.one_lap - 1)];
            // Acquire: pairs with the Release stamp store in `try_push` that published the value.
            let stamp = slot.stamp.load(Ordering::Acquire);
            if stamp == head + 1 {
                if only_if_full {
                    // Relaxed: a stale (smaller) tail only makes us report "not full", and the
                    // caller's retried push re-reads it; the CAS below settles fullness (see
                    // `evict_if_full`).
                    let tail = self.tail.load(Ordering::Relaxed);
                    if head.wrapping_add(self.one_lap) != tail {
                        return Pop::Empty;
                    }
                }
                // SeqCst: see `try_push`; failure needs only the fresh value.
                match self.head.compare_exchange_weak(
                    head,
                    self.advance(head),
                    Ordering::SeqCst,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        #[cfg(all(test, not(loom)))]
                        stall::point(stall::Point::Taken);
                        // SAFETY: the CAS made us the only consumer of position `head`; the
                        // stamp `head + 1` (read with Acquire) says its producer's write is
                        // complete and visible, and no producer of the next lap writes until
                        // our stamp store below. Reading moves the value out exactly once.
                        let value = slot.value.with(|v| unsafe { (*v).assume_init_read() });
                        // Release: our read happens before the next lap's producer's write
                        // (its Acquire stamp load).
                        slot.stamp
                            .store(head.wrapping_add(self.one_lap), Ordering::Release);
                        return Pop::Value(value);
                    }
                    Err(current) => {
                        // Another consumer took `head` first (it progressed): retry.
                        head = current;
                        backoff.spin();
                    }
                }
                continue;
            }
            if stamp != head {
                // Neither this lap's value nor empty for this lap: `head` is stale (another
                // consumer took this position: catch up), or the consumer of the previous lap
                // has not handed the slot back yet (then no producer can have claimed `head`
                // either, and the tail check below reports empty).
                let current = self.head.load(Ordering::Relaxed);
                if current != head {
                    head = current;
                    backoff.spin();
                    continue;
                }
            }
            // Nothing to take at `head`.
            // SeqCst fence: pairs with the SeqCst tail CAS in `try_push`, so "empty" is
            // reported only if no producer had claimed `head` at the tail load.
            fence(Ordering::SeqCst);
            let tail = self.tail.load(Ordering::Relaxed);
            if tail == head {
                return Pop::Empty;
            }
            // A producer claimed `head` and is writing it. Acquire: as above; a changed stamp
            // means it has finished: retry rather than report a state that has passed.
            if slot.stamp.load(Ordering::Acquire) != stamp {
                backoff.spin();
                continue;
            }
            return Pop::Busy;
        }
    }

    /// The number of values in the ring, as of one moment during the call (a consistent
    /// `(head, tail)` pair). Lock-free: retries only while `tail` moves under it.
    pub(crate) fn len(&self) -> usize {
        let backoff = Backoff::new();
        loop {
            // SeqCst loads: `tail`, `head`, `tail` again in the single total order, so an
            // unchanged `tail` means `head` was read while `tail` held that value.
            let tail = self.tail.load(Ordering::SeqCst);
            let head = self.head.load(Ordering::SeqCst);
            if self.tail.load(Ordering::SeqCst) == tail {
                let mask = self.one_lap - 1;
                let (hix, tix) = (head & mask, tail & mask);
                return if hix < tix {
                    tix - hix
                } else if hix > tix {
                    self.cap - hix + tix
                } else if tail == head {
                    0
                } else {
                    self.cap
                };
            }
            backoff.spin();
        }
    }
}

impl<T> Drop for Ring<T> {
    fn drop(&mut self) {
        // `&mut self`: no other thread can touch the ring, so every claimed position was
        // published (a claim and its stamp store are one call) and popping is only bookkeeping.
        while let Pop::Value(v) = self.try_pop() {
            drop(v);
        }
    }
}

impl<T> std::fmt::Debug for Ring<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("len", &self.len())
            .field("cap", &self.cap)
            .finish()
    }
}

/// Test-only stall points: a unit test can make one thread stop between a claim and its stamp
/// store, the state a descheduled thread leaves behind. Compiled only into the crate's own unit
/// tests; the library proper has no hook.
#[cfg(all(test, not(loom)))]
pub(crate) mod stall {
    use std::cell::RefCell;

    /// Where a thread can be stopped.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) enum Point {
        /// A producer after its tail CAS, before its value write and stamp store.
        Claimed,
        /// A consumer after its head CAS, before its value read and stamp store.
        Taken,
    }

    type Hook = Box<dyn FnMut(Point)>;

    thread_local!(static HOOK: RefCell<Option<Hook>> = const { RefCell::new(None) });

    /// Installs `hook` for the calling thread (replacing any previous one).
    pub(crate) fn set(hook: impl FnMut(Point) + 'static) {
        HOOK.with(|h| *h.borrow_mut() = Some(Box::new(hook)));
    }

    /// Calls the calling thread's hook, if any.
    pub(crate) fn point(p: Point) {
        HOOK.with(|h| {
            if let Some(f) = h.borrow_mut().as_mut() {
                f(p);
            }
        });
    }

    /// Installs a hook that stops the calling thread the first time it reaches `at`: it sends
    /// on `stopped`, then waits until `resume` yields a message or is dropped.
    pub(crate) fn once_at(
        at: Point,
        stopped: std::sync::mpsc::Sender<()>,
        resume: std::sync::mpsc::Receiver<()>,
    ) {
        let mut armed = true;
        set(move |p| {
            if armed && p == at {
                armed = false;
                let _ = stopped.send(());
                let _ = resume.recv();
            }
        });
    }

    /// Runs `f` on its own thread and fails the test with `what` if it has not returned within
    /// 10 s (a spinning or blocked call becomes a failure with a message, not a hung test).
    pub(crate) fn within<R: Send + 'static>(
        what: &str,
        f: impl FnOnce() -> R + Send + 'static,
    ) -> R {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        match rx.recv_timeout(std::time::Duration::from_secs(10)) {
            Ok(r) => r,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                panic!("{what}: did not return within 10 s")
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("{what}: panicked"),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::stall::{self, within, Point};
    use super::{Pop, PushError, Ring};
    use std::sync::mpsc::channel;
    use std::sync::Arc;

    #[test]
    fn fifo_wraps_and_reports_full_and_empty() {
        fifo_laps(Ring::new);
    }

    /// The same laps from two laps before the positions wrap around `usize`: `head`, `tail`
    /// and the stamps cross from the last lap to lap 0 (the lap arithmetic is modular: no
    /// comparison of positions may assume they only grow).
    #[test]
    fn fifo_across_the_position_wrap() {
        fifo_laps(Ring::new_near_wrap);
    }

    fn fifo_laps(new: fn(usize) -> Ring<u32>) {
        for cap in [1usize, 2, 3, 5, 8, 13] {
            let r = new(cap);
            assert_eq!(r.try_pop(), Pop::Empty);
            assert_eq!(r.evict_if_full(), Pop::Empty);
            let mut next_in = 0u32;
            let mut next_out = 0u32;
            for round in 0..(4 * cap) {
                // Fill completely, then drain a varying amount, to cross every lap boundary.
                while r.try_push(next_in).is_ok() {
                    next_in += 1;
                }
                assert_eq!(r.len(), cap, "cap {cap}");
                assert_eq!(r.try_push(u32::MAX), Err(PushError::Full(u32::MAX)));
                for i in 0..=(round % cap) {
                    // Alternate plain pops and evictions of the full ring.
                    let got = if i == 0 && round % 2 == 1 {
                        r.evict_if_full()
                    } else {
                        r.try_pop()
                    };
                    assert_eq!(got, Pop::Value(next_out));
                    next_out += 1;
                }
                assert_eq!(r.len(), cap - 1 - (round % cap));
                assert_eq!(r.evict_if_full(), Pop::Empty, "not full: nothing evicted");
                assert_eq!(r.len(), cap - 1 - (round % cap));
            }
            while let Pop::Value(v) = r.try_pop() {
                assert_eq!(v, next_out);
                next_out += 1;
            }
            assert_eq!(next_in, next_out);
            assert_eq!(r.len(), 0);
        }
    }

    /// A producer stopped between its tail CAS and its stamp store: `try_pop` must say so at
    /// once (not spin until the producer runs again), later producers still get in, and the
    /// values come out in order once it resumes.
    #[test]
    fn try_pop_reports_busy_while_a_producer_is_stalled() {
        let r = Arc::new(Ring::new(4));
        let (stopped_tx, stopped) = channel();
        let (resume, resume_rx) = channel();
        let producer = {
            let r = r.clone();
            std::thread::spawn(move || {
                stall::once_at(Point::Claimed, stopped_tx, resume_rx);
                r.try_push(1u32)
            })
        };
        stopped.recv().unwrap();
        let r2 = r.clone();
        let (busy, later) = within("try_pop/try_push with a stalled producer", move || {
            (r2.try_pop(), r2.try_push(2))
        });
        assert_eq!(busy, Pop::Busy);
        assert_eq!(later, Ok(()));
        let r2 = r.clone();
        assert_eq!(within("try_pop again", move || r2.try_pop()), Pop::Busy);
        resume.send(()).unwrap();
        assert_eq!(producer.join().unwrap(), Ok(()));
        assert_eq!(r.try_pop(), Pop::Value(1));
        assert_eq!(r.try_pop(), Pop::Value(2));
        assert_eq!(r.try_pop(), Pop::Empty);
    }

    /// A consumer stopped between its head CAS and its stamp store, in a full ring: the slot the
    /// next push needs is still being read, so `try_push` reports `Busy` at once, and
    /// `evict_if_full` does not evict (the ring is not full any more).
    #[test]
    fn try_push_reports_busy_while_a_consumer_is_stalled() {
        let r = Arc::new(Ring::new(2));
        r.try_push(1u32).unwrap();
        r.try_push(2).unwrap();
        let (stopped_tx, stopped) = channel();
        let (resume, resume_rx) = channel();
        let consumer = {
            let r = r.clone();
            std::thread::spawn(move || {
                stall::once_at(Point::Taken, stopped_tx, resume_rx);
                r.try_pop()
            })
        };
        stopped.recv().unwrap();
        let r2 = r.clone();
        let (push, evict) = within("try_push/evict with a stalled consumer", move || {
            (r2.try_push(3), r2.evict_if_full())
        });
        assert_eq!(push, Err(PushError::Busy(3)));
        assert_eq!(evict, Pop::Empty, "one slot is being freed: not full");
        assert_eq!(r.len(), 1);
        resume.send(()).unwrap();
        assert_eq!(consumer.join().unwrap(), Pop::Value(1));
        assert_eq!(r.try_push(3), Ok(()));
        assert_eq!(r.try_pop(), Pop::Value(2));
        assert_eq!(r.try_pop(), Pop::Value(3));
    }
}
