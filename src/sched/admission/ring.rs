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
//! Lock-free, with one caveat that every array-based MPMC queue shares: a thread that claims a
//! position and is then descheduled before it updates the stamp makes the next thread to reach
//! that slot on the following lap wait (with `Backoff`) for it.

use std::mem::MaybeUninit;

use crate::sync::{fence, AtomicUsize, Backoff, CachePadded, Ordering, UnsafeCell};

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
    pub(crate) fn new(cap: usize) -> Self {
        debug_assert!((1..=usize::MAX / 4).contains(&cap));
        let one_lap = (cap + 1).next_power_of_two();
        let slots = (0..cap)
            .map(|i| Slot {
                // Lap 0: slot `i` waits for the producer of position `i`.
                stamp: AtomicUsize::new(i),
                value: UnsafeCell::new(MaybeUninit::uninit()),
            })
            .collect();
        Self {
            head: CachePadded::new(AtomicUsize::new(0)),
            tail: CachePadded::new(AtomicUsize::new(0)),
            slots,
            cap,
            one_lap,
        }
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

    /// Appends `value`, or gives it back if the ring is full.
    pub(crate) fn push(&self, value: T) -> Result<(), T> {
        let backoff = Backoff::new();
        let mut tail = self.tail.load(Ordering::Relaxed);
        loop {
            let slot = &self.slots[tail & (self.one_lap - 1)];
            // Acquire: pairs with the Release stamp store in `pop` that emptied this slot, so
            // the consumer's read of the old value happens before our write below.
            let stamp = slot.stamp.load(Ordering::Acquire);
            if stamp == tail {
                // The slot is empty for this lap: claim position `tail`.
                // SeqCst: the claim takes part in the single order that `fence(SeqCst)` in the
                // empty check of `pop` (and in `len`) relies on. On failure we only need the
                // fresh value to retry with.
                match self.tail.compare_exchange_weak(
                    tail,
                    self.advance(tail),
                    Ordering::SeqCst,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
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
                        tail = current;
                        backoff.spin();
                    }
                }
            } else if stamp.wrapping_add(self.one_lap) == tail + 1 {
                // The slot still holds the value written one lap ago: the ring may be full.
                // SeqCst fence: orders our stamp load before the head load below, pairing with
                // the SeqCst head CAS in `pop`, so "full" is only reported if, at the head load,
                // the consumer of that old value had not even claimed it.
                fence(Ordering::SeqCst);
                let head = self.head.load(Ordering::Relaxed);
                if head.wrapping_add(self.one_lap) == tail {
                    return Err(value);
                }
                // A consumer has claimed it and is reading it out: retry shortly.
                backoff.spin();
                tail = self.tail.load(Ordering::Relaxed);
            } else {
                // Another producer claimed `tail` and is writing: wait for it to move on.
                backoff.snooze();
                tail = self.tail.load(Ordering::Relaxed);
            }
        }
    }

    /// Takes the oldest value, or `None` if the ring is empty.
    pub(crate) fn pop(&self) -> Option<T> {
        let backoff = Backoff::new();
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            let slot = &self.slots[head & (self.one_lap - 1)];
            // Acquire: pairs with the Release stamp store in `push` that published the value.
            let stamp = slot.stamp.load(Ordering::Acquire);
            if stamp == head + 1 {
                // SeqCst: see `push`; failure needs only the fresh value.
                match self.head.compare_exchange_weak(
                    head,
                    self.advance(head),
                    Ordering::SeqCst,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        // SAFETY: the CAS made us the only consumer of position `head`; the
                        // stamp `head + 1` (read with Acquire) says its producer's write is
                        // complete and visible, and no producer of the next lap writes until
                        // our stamp store below. Reading moves the value out exactly once.
                        let value = slot.value.with(|v| unsafe { (*v).assume_init_read() });
                        // Release: our read happens before the next lap's producer's write
                        // (its Acquire stamp load).
                        slot.stamp
                            .store(head.wrapping_add(self.one_lap), Ordering::Release);
                        return Some(value);
                    }
                    Err(current) => {
                        head = current;
                        backoff.spin();
                    }
                }
            } else if stamp == head {
                // The slot is empty for this lap: the ring may be empty.
                // SeqCst fence: pairs with the SeqCst tail CAS in `push`, as in `push`'s full
                // check, so "empty" is reported only if no producer had claimed `head` yet.
                fence(Ordering::SeqCst);
                let tail = self.tail.load(Ordering::Relaxed);
                if tail == head {
                    return None;
                }
                // A producer claimed `head` and is writing: retry shortly.
                backoff.spin();
                head = self.head.load(Ordering::Relaxed);
            } else {
                // Another consumer took `head` and moved on: catch up.
                backoff.snooze();
                head = self.head.load(Ordering::Relaxed);
            }
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
        // `&mut self`: no other thread can touch the ring, so popping is only bookkeeping.
        while let Some(v) = self.pop() {
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::Ring;

    #[test]
    fn fifo_wraps_and_reports_full_and_empty() {
        for cap in [1usize, 2, 3, 5, 8, 13] {
            let r = Ring::new(cap);
            assert_eq!(r.pop(), None);
            let mut next_in = 0u32;
            let mut next_out = 0u32;
            for round in 0..(4 * cap) {
                // Fill completely, then drain a varying amount, to cross every lap boundary.
                while r.push(next_in).is_ok() {
                    next_in += 1;
                }
                assert_eq!(r.len(), cap, "cap {cap}");
                assert_eq!(r.push(u32::MAX), Err(u32::MAX));
                for _ in 0..=(round % cap) {
                    assert_eq!(r.pop(), Some(next_out));
                    next_out += 1;
                }
                assert_eq!(r.len(), cap - 1 - (round % cap));
            }
            while let Some(v) = r.pop() {
                assert_eq!(v, next_out);
                next_out += 1;
            }
            assert_eq!(next_in, next_out);
            assert_eq!(r.len(), 0);
        }
    }
}
