//! The batcher's latency-critical class: its admissions and swapped-out sequences come in
//! before throughput work (class by class), take running throughput sequences' pages, running
//! slots and prefill tokens when short of them, and never preempt latency-critical work.

use pagedkv::block::{BlockPool, EngineId};
use pagedkv::prefix::{PrefixCache, PrefixConfig};
use pagedkv::sched::{Batcher, BatcherConfig, FinishedSeq, PreemptionMode, Priority, SeqPhase};

#[path = "support/batcher_fixtures.rs"]
mod batcher_fixtures;
#[path = "support/random_batcher.rs"]
mod random_batcher;
use batcher_fixtures::{
    commit_scheduled, config, config_with, drive, pool, preemptions, req, step, urgent, with_prefix,
};
use random_batcher::Quota;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;

#[test]
fn latency_critical_admitted_first() {
    let p = pool(64);
    let mut bt = Batcher::new(
        BatcherConfig {
            max_running: 1,
            ..config()
        },
        p,
    )
    .unwrap();
    bt.add(req(1, vec![1], 2)).unwrap();
    let mut urgent = req(2, vec![2], 2);
    urgent.priority = Priority::LatencyCritical;
    bt.add(urgent).unwrap();
    let mut fin = Vec::new();
    assert_eq!(bt.schedule_into(&mut fin).seq_ids, vec![2]);
}

/// Priority's contract: latency-critical work is preempted last. A throughput sequence
/// admitted before a latency-critical one sat ahead of it in the running list, so when the
/// latency-critical one needed a page the throughput one (already in the batch) was out of
/// reach and the latency-critical one was preempted instead.
#[test]
fn a_latency_critical_sequence_is_not_preempted_for_a_throughput_one() {
    let mut bt = Batcher::new(config(), pool(3)).unwrap();
    let mut fin = Vec::new();
    bt.add(req(0, vec![1; 4], 8)).unwrap();
    let n = bt.schedule_into(&mut fin).num_samples();
    bt.commit(&vec![5; n], &mut fin).unwrap();
    let mut lc = req(1, vec![2; 4], 8);
    lc.priority = Priority::LatencyCritical;
    bt.add(lc).unwrap();
    // Throughput 0 decodes into its second page, latency-critical 1 prefills its first.
    let n = bt.schedule_into(&mut fin).num_samples();
    bt.commit(&vec![5; n], &mut fin).unwrap();
    assert_eq!(bt.phase(1), Some(SeqPhase::Decoding));
    // 1 needs a second page and the pool is empty: the throughput sequence must give way.
    let ids = bt.schedule_into(&mut fin).seq_ids.clone();
    assert_eq!(ids, vec![1], "{:?}", bt.stats());
    assert_eq!(bt.phase(0), Some(SeqPhase::Waiting));
}

/// A swap-preempting batcher on 6 pages whose two 8-token throughput requests (`max_new`
/// tokens each) prefilled, then a shed of 2 pages swapped the younger (id 1, 2 pages) out: the
/// older holds 3 pages, 3 are free.
fn younger_swapped_out(max_new: u32) -> (Batcher, Arc<BlockPool>, Vec<FinishedSeq>) {
    let p = pool(6);
    let mut bt = Batcher::new(config_with(PreemptionMode::Swap), p.clone()).unwrap();
    let mut fin = Vec::new();
    bt.add(req(0, vec![1; 8], max_new)).unwrap();
    bt.add(req(1, vec![2; 8], max_new)).unwrap();
    step(&mut bt, &mut fin); // both prefill: 2 pages each
    bt.request_shed(2);
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.swap_out.len(), 2, "the younger is swapped out");
    let n = b.num_samples();
    bt.commit(&vec![1000; n], &mut fin).unwrap();
    assert_eq!(bt.phase(1), Some(SeqPhase::Swapped));
    (bt, p, fin)
}

/// A swapped-out throughput sequence that cannot come back yet does not hold back a
/// latency-critical request that fits (swap preemption kept every waiting request out while
/// anything was swapped out: a priority inversion recompute preemption, which queues its
/// victims behind waiting latency-critical requests, does not have). Waiting throughput
/// requests still wait behind it.
#[test]
fn a_swapped_throughput_sequence_does_not_hold_back_latency_critical_admissions() {
    let (mut bt, p, mut fin) = younger_swapped_out(4);
    // 0 holds 3 pages. Another engine takes two of the three free: one left, too few for 1 to
    // come back, enough for a latency-critical request of one page.
    let mut other = Vec::new();
    p.alloc_n(EngineId(1), 2, &mut other).unwrap();
    bt.add(urgent(2, vec![3; 4])).unwrap();
    bt.add(req(3, vec![4; 4], 1)).unwrap();
    let ids = bt.schedule_into(&mut fin).seq_ids.clone();
    assert_eq!(bt.phase(1), Some(SeqPhase::Swapped));
    // Class by class: the admitted latency-critical row comes before the running throughput
    // one.
    assert_eq!(
        ids,
        vec![2, 0],
        "the latency-critical request waited behind a swapped one"
    );
    assert_eq!(
        bt.phase(3),
        Some(SeqPhase::Waiting),
        "throughput waits behind it"
    );
    commit_scheduled(&mut bt, &mut fin);
    p.free_n(&other).unwrap();
    fin.extend(drive(&mut bt, 100));
    assert_eq!(fin.len(), 4);
    assert_eq!(p.free_count(), 6);
}

/// A swapped-out throughput sequence that could come back does not take the pages a waiting
/// latency-critical request needs: the latency-critical one is admitted first, as
/// `next_admission_need` (the pages a latency-critical request asks another engine to donate)
/// and the batcher's docs order them. The swap-in ran first, took the pages, and the
/// latency-critical request waited (on an engine, pages donated for it went to the swap-in).
#[test]
fn a_swapped_throughput_sequence_does_not_take_the_pages_of_a_latency_critical_admission() {
    let (mut bt, p, mut fin) = younger_swapped_out(8);
    // 0 holds 3 pages: 3 free, enough for 1 to come back (2) or for a latency-critical
    // request of 2 pages, not for both.
    assert_eq!(p.free_count(), 3);
    bt.add(urgent(2, vec![3; 8])).unwrap();
    assert_eq!(
        bt.next_admission_need(),
        Some((Priority::LatencyCritical, 2)),
        "the latency-critical request is admitted next"
    );
    let ids = bt.schedule_into(&mut fin).seq_ids.clone();
    assert_eq!(
        ids,
        vec![2, 0],
        "the latency-critical request waited while a throughput sequence took its pages"
    );
    assert_eq!(bt.phase(1), Some(SeqPhase::Swapped), "1 waits for pages");
    commit_scheduled(&mut bt, &mut fin);
    fin.extend(drive(&mut bt, 100));
    assert_eq!(fin.len(), 3);
    assert_eq!(p.free_count(), 6);
}

/// A batcher on 4 pages whose two 6-token requests of `class` ran until the younger one (2
/// pages) was swapped out; nothing waits.
fn one_swapped_out(class: Priority) -> Batcher {
    let mut bt = Batcher::new(config_with(PreemptionMode::Swap), pool(4)).unwrap();
    for id in 0..2 {
        let mut r = req(id, vec![1; 6], 10);
        r.priority = class;
        bt.add(r).unwrap();
    }
    let mut fin = Vec::new();
    while bt.num_swapped() == 0 {
        assert!(bt.has_work(), "the workload swapped nothing out");
        step(&mut bt, &mut fin);
    }
    assert_eq!(bt.num_waiting_in(Priority::LatencyCritical), 0);
    assert_eq!(bt.num_waiting_in(Priority::Throughput), 0);
    bt
}

/// A swapped-out sequence is what the batcher admits next (it comes back before any waiting
/// one of its class or a less urgent one), so it is the next admission's need: before, only
/// waiting sequences were read, and an engine whose latency-critical sequence was swapped out
/// (a running one that finds no page swaps itself out under swap preemption) asked no
/// donation for it, where the same sequence preempted by recompute (waiting) did.
#[test]
fn a_swapped_sequence_is_the_next_admission_need() {
    let lc = Priority::LatencyCritical;
    let mut bt = one_swapped_out(lc);
    assert_eq!(bt.next_admission_need(), Some((lc, 2)));
    // A waiting throughput request does not come before it ...
    bt.add(req(7, vec![1; 9], 1)).unwrap();
    assert_eq!(bt.next_admission_need(), Some((lc, 2)));
    // ... and a waiting latency-critical one (9 tokens: 3 pages) comes before a swapped
    // throughput one.
    let mut tp = one_swapped_out(Priority::Throughput);
    assert_eq!(tp.next_admission_need(), Some((Priority::Throughput, 2)));
    tp.add(urgent(9, vec![1; 9])).unwrap();
    assert_eq!(tp.next_admission_need(), Some((lc, 3)));
}

/// A latency-critical request arriving while throughput decoders hold the whole pool is
/// admitted at the next step, and the latest of them preempted for its page (by the
/// configured mode). Before, it waited until one of them finished: its time to first token
/// was bounded by the throughput work's length, not by anything the operator set.
#[test]
fn a_waiting_latency_critical_request_preempts_the_latest_throughput_sequence() {
    for mode in [PreemptionMode::Recompute, PreemptionMode::Swap] {
        let cfg = config_with(mode);
        let p = pool(8);
        let mut bt = Batcher::new(cfg, p.clone()).unwrap();
        let mut fin = Vec::new();
        // 13 tokens each: 4 pages, and room in the last for three decode steps.
        bt.add(req(0, vec![1; 13], 6)).unwrap();
        bt.add(req(1, vec![2; 13], 6)).unwrap();
        step(&mut bt, &mut fin);
        assert_eq!(p.free_count(), 0, "{mode:?}: the decoders hold the pool");
        bt.add(urgent(2, vec![3; 4])).unwrap();
        let b = bt.schedule_into(&mut fin);
        assert_eq!(
            b.seq_ids,
            [2, 0],
            "{mode:?}: the latency-critical request waited for the throughput work"
        );
        let victim = bt.phase(1);
        let expect = match mode {
            PreemptionMode::Recompute => SeqPhase::Waiting,
            PreemptionMode::Swap => SeqPhase::Swapped,
        };
        assert_eq!(
            victim,
            Some(expect),
            "{mode:?}: the latest one gave its pages"
        );
        assert_eq!(bt.phase(0), Some(SeqPhase::Decoding), "{mode:?}");
        assert_eq!(preemptions(&bt), 1, "{mode:?}: {:?}", bt.stats());
        if mode == PreemptionMode::Swap {
            assert_eq!(bt.batch().swap_out.len(), 4, "{mode:?}");
        }
        commit_scheduled(&mut bt, &mut fin);
        fin.extend(drive(&mut bt, 200));
        assert_eq!(
            fin.len(),
            3,
            "{mode:?}: the preempted one came back and finished"
        );
        assert_eq!(p.free_count(), 8, "{mode:?}");
    }
}

/// Where preempting every running throughput sequence would still leave a latency-critical
/// request's first chunk short, none is preempted: it waits (their work lost for nothing,
/// and the next step would find the same shortage). Also where it is bound by a running slot
/// too (`max_running` 1): not even one is preempted for the slot.
#[test]
fn a_latency_critical_request_preempts_nothing_when_that_cannot_make_it_fit() {
    for (mode, slot_bound) in [
        (PreemptionMode::Recompute, false),
        (PreemptionMode::Swap, false),
        (PreemptionMode::Recompute, true),
        (PreemptionMode::Swap, true),
    ] {
        let mut cfg = config_with(mode);
        if slot_bound {
            cfg.max_running = 1;
        }
        let p = pool(8);
        let mut bt = Batcher::new(cfg, p.clone()).unwrap();
        let mut fin = Vec::new();
        bt.add(req(0, vec![1; 5], 3)).unwrap(); // 2 pages
        step(&mut bt, &mut fin);
        // Another engine holds the other 6.
        let mut other = Vec::new();
        p.alloc_n(EngineId(1), 6, &mut other).unwrap();
        bt.add(urgent(1, vec![2; 12])).unwrap(); // 3 pages: more than 0 holds
        let b = bt.schedule_into(&mut fin);
        assert_eq!(b.seq_ids, [0], "{mode:?}, slot-bound {slot_bound}");
        assert_eq!(
            bt.phase(1),
            Some(SeqPhase::Waiting),
            "{mode:?}, slot-bound {slot_bound}"
        );
        assert_eq!(
            preemptions(&bt),
            0,
            "{mode:?}, slot-bound {slot_bound}: {:?}",
            bt.stats()
        );
        commit_scheduled(&mut bt, &mut fin);
        p.free_n(&other).unwrap();
        fin.extend(drive(&mut bt, 200));
        assert_eq!(fin.len(), 2, "{mode:?}, slot-bound {slot_bound}");
        assert_eq!(p.free_count(), 8, "{mode:?}, slot-bound {slot_bound}");
    }
}

/// The pages a throughput sequence shares with the prefix cache and the waiting request (its
/// cached prefix, which the request attached) do not leave when it is preempted: only its own
/// page counts, too few for the request's chunk, so nothing is preempted (a count of its
/// table's pages said three, enough).
#[test]
fn pages_a_latency_critical_request_shares_do_not_count_as_room() {
    let (p, mut bt) = with_prefix(4);
    let mut fin = Vec::new();
    bt.add(req(0, (1..=8).collect(), 4)).unwrap();
    step(&mut bt, &mut fin); // 2 full pages, cached at the commit
    step(&mut bt, &mut fin); // its first decode: a third page
    assert_eq!(bt.blocks_of(0), Some(3));
    let other = p.alloc(EngineId(1)).unwrap();
    // Its prefix is 0's cached pages; its other 6 tokens need 2 more pages.
    let mut prompt: Vec<u32> = (1..=8).collect();
    prompt.extend([50, 51, 52, 53, 54, 55]);
    bt.add(urgent(1, prompt)).unwrap();
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.seq_ids, [0]);
    assert_eq!(bt.phase(1), Some(SeqPhase::Waiting));
    assert_eq!(bt.stats().preempted_recompute, 0, "{:?}", bt.stats());
    commit_scheduled(&mut bt, &mut fin);
    p.free_n(&[other]).unwrap();
    fin.extend(drive(&mut bt, 200));
    assert_eq!(fin.len(), 2);
    assert!(!bt.has_work());
}

/// A waiting latency-critical request never preempts a running latency-critical sequence:
/// it waits for one to finish.
#[test]
fn a_waiting_latency_critical_request_never_preempts_a_running_one() {
    for mode in [PreemptionMode::Recompute, PreemptionMode::Swap] {
        let cfg = config_with(mode);
        let p = pool(8);
        let mut bt = Batcher::new(cfg, p.clone()).unwrap();
        let mut fin = Vec::new();
        let long = |id, t| {
            let mut r = req(id, vec![t; 13], 3);
            r.priority = Priority::LatencyCritical;
            r
        };
        bt.add(long(0, 1)).unwrap();
        bt.add(long(1, 2)).unwrap();
        step(&mut bt, &mut fin); // the pool is full
        bt.add(urgent(2, vec![3; 4])).unwrap();
        let b = bt.schedule_into(&mut fin);
        assert_eq!(b.seq_ids, [0, 1], "{mode:?}");
        assert_eq!(bt.phase(2), Some(SeqPhase::Waiting), "{mode:?}");
        assert_eq!(preemptions(&bt), 0, "{mode:?}: {:?}", bt.stats());
        commit_scheduled(&mut bt, &mut fin);
        fin.extend(drive(&mut bt, 200));
        assert_eq!(fin.len(), 3, "{mode:?}");
        assert_eq!(p.free_count(), 8, "{mode:?}");
    }
}

/// A latency-critical request arriving while throughput sequences fill every running slot
/// (pages to spare) takes the slot of the latest of them at the next step (preempted by the
/// configured mode), and the tokens its row would have had: before, it waited for one of them
/// to finish. A step of 2 tokens leaves none to an admission while both decode.
#[test]
fn a_slot_bound_latency_critical_request_preempts_the_latest_throughput_sequence() {
    for mode in [PreemptionMode::Recompute, PreemptionMode::Swap] {
        let mut cfg = config_with(mode);
        cfg.max_running = 2;
        cfg.max_batched_tokens = 2;
        let p = pool(64);
        let mut bt = Batcher::new(cfg, p.clone()).unwrap();
        let mut fin = Vec::new();
        bt.add(req(0, vec![1], 20)).unwrap();
        bt.add(req(1, vec![2], 20)).unwrap();
        step(&mut bt, &mut fin);
        bt.add(urgent(2, vec![3; 4])).unwrap();
        let b = bt.schedule_into(&mut fin);
        assert_eq!(
            b.seq_ids,
            [2, 0],
            "{mode:?}: the latency-critical request waited for a running slot"
        );
        assert_eq!(b.num_tokens(), 2, "{mode:?}: the step's budget, exactly");
        let expect = match mode {
            PreemptionMode::Recompute => SeqPhase::Waiting,
            PreemptionMode::Swap => SeqPhase::Swapped,
        };
        assert_eq!(
            bt.phase(1),
            Some(expect),
            "{mode:?}: the latest gave its slot"
        );
        assert_eq!(bt.phase(0), Some(SeqPhase::Decoding), "{mode:?}");
        assert_eq!(bt.num_running(), 2, "{mode:?}");
        assert_eq!(preemptions(&bt), 1, "{mode:?}: {:?}", bt.stats());
        commit_scheduled(&mut bt, &mut fin);
        fin.extend(drive(&mut bt, 200));
        assert_eq!(fin.len(), 3, "{mode:?}: the preempted one came back");
        assert_eq!(p.free_count(), 64, "{mode:?}");
    }
}

/// The pages of the throughput sequence preempted for a running slot count toward the
/// request's first chunk: no second one is preempted when they cover it, and one more is
/// when they do not (all or nothing, latest first).
#[test]
fn a_slot_bound_latency_critical_request_counts_the_slots_victim_pages() {
    for (prompt, victims) in [(8, 1), (20, 2)] {
        let mut cfg = config();
        cfg.max_running = 3;
        let p = pool(12);
        let mut bt = Batcher::new(cfg, p.clone()).unwrap();
        let mut fin = Vec::new();
        for id in 0..3 {
            bt.add(req(id, vec![1; 13], 3)).unwrap(); // 4 pages each: the pool
        }
        step(&mut bt, &mut fin);
        bt.add(urgent(3, vec![2; prompt])).unwrap();
        let b = bt.schedule_into(&mut fin);
        assert_eq!(b.seq_ids[0], 3, "{prompt}: admitted");
        assert_eq!(bt.stats().preempted_recompute, victims, "{prompt}");
        assert_eq!(bt.phase(2), Some(SeqPhase::Waiting), "{prompt}");
        let second = if victims == 2 {
            SeqPhase::Waiting
        } else {
            SeqPhase::Decoding
        };
        assert_eq!(bt.phase(1), Some(second), "{prompt}");
        assert_eq!(bt.phase(0), Some(SeqPhase::Decoding), "{prompt}");
        commit_scheduled(&mut bt, &mut fin);
        fin.extend(drive(&mut bt, 200));
        assert_eq!(fin.len(), 4, "{prompt}");
        assert_eq!(p.free_count(), 12, "{prompt}");
    }
}

/// A slot-bound latency-critical request never preempts a latency-critical sequence: with
/// every slot held by latency-critical work it waits; with one throughput sequence among them,
/// that one gives its slot.
#[test]
fn a_slot_bound_latency_critical_request_never_preempts_a_latency_critical_one() {
    for mode in [PreemptionMode::Recompute, PreemptionMode::Swap] {
        for mixed in [false, true] {
            let mut cfg = config_with(mode);
            cfg.max_running = 2;
            let p = pool(64);
            let mut bt = Batcher::new(cfg, p.clone()).unwrap();
            let mut fin = Vec::new();
            let mut first = urgent(0, vec![1; 4]);
            first.stop.max_new_tokens = 5;
            let mut second = req(1, vec![2; 4], 5);
            if !mixed {
                second.priority = Priority::LatencyCritical;
            }
            bt.add(first).unwrap();
            bt.add(second).unwrap();
            step(&mut bt, &mut fin);
            bt.add(urgent(2, vec![3; 4])).unwrap();
            let ids = bt.schedule_into(&mut fin).seq_ids.clone();
            let s = bt.stats();
            let preempted = s.preempted_recompute + s.preempted_swap;
            if mixed {
                assert_eq!(ids, [0, 2], "{mode:?}");
                assert_eq!(preempted, 1, "{mode:?}: {s:?}");
            } else {
                assert_eq!(ids, [0, 1], "{mode:?}");
                assert_eq!(bt.phase(2), Some(SeqPhase::Waiting), "{mode:?}");
                assert_eq!(preempted, 0, "{mode:?}: {s:?}");
            }
            assert_eq!(bt.phase(0), Some(SeqPhase::Decoding), "{mode:?} {mixed}");
            commit_scheduled(&mut bt, &mut fin);
            fin.extend(drive(&mut bt, 200));
            assert_eq!(fin.len(), 3, "{mode:?} {mixed}");
            assert_eq!(p.free_count(), 64, "{mode:?} {mixed}");
        }
    }
}

/// Throughput prompts long enough to take the whole step in chunks (8-token chunks, 16 tokens a
/// step) leave none to a latency-critical arrival while it waits, for as many steps as they
/// have chunks: an admission took only what every throughput row left. Their prefill chunks
/// now give way, in arrival order (the older runs shorter, the younger has no row this step),
/// while the throughput decoders keep their tokens (their drafts too where the step has room
/// for them after the admission).
#[test]
fn a_latency_critical_request_takes_its_first_chunk_before_throughput_prefill_chunks() {
    // The step's 16 tokens: the batcher's own limit, or the coordinator's share.
    for coordinator in [false, true] {
        let mut cfg = config();
        cfg.max_prefill_chunk = 8;
        if !coordinator {
            cfg.max_batched_tokens = 16;
        }
        let p = pool(64);
        let mut bt = Batcher::new(cfg, p.clone()).unwrap();
        if coordinator {
            bt.attach_budget(Box::new(Quota {
                tokens: Arc::new(AtomicU32::new(16)),
                quota: 64,
                used: Arc::new(AtomicU32::new(0)),
            }));
        }
        let mut fin = Vec::new();
        bt.add(req(0, vec![1; 2], 6)).unwrap();
        bt.add(req(1, vec![2; 2], 6)).unwrap();
        step(&mut bt, &mut fin); // both decode from now on
        bt.add(req(2, vec![3; 40], 2)).unwrap();
        bt.add(req(3, vec![4; 40], 2)).unwrap();
        let b = bt.schedule_into(&mut fin);
        assert_eq!(
            b.query_start_loc,
            [0, 1, 2, 10, 16],
            "{coordinator}: the prompts fill the step"
        );
        let n = b.num_samples();
        bt.commit(&vec![1000; n], &mut fin).unwrap();
        bt.propose(0, &[1000, 1000]).unwrap();
        bt.add(urgent(4, vec![5; 12])).unwrap();
        let b = bt.schedule_into(&mut fin);
        assert_eq!(
            b.seq_ids,
            [4, 0, 1, 2],
            "{coordinator}: the latency-critical request waited behind throughput prefill chunks"
        );
        // Its first chunk (8), 0's token and 2 drafts, 1's token, and what is left to 2: the
        // step's 16 tokens exactly; 3 has no row this step.
        assert_eq!(b.query_start_loc, [0, 8, 11, 12, 16]);
        assert_eq!(b.drafts, [0, 2, 0, 0]);
        assert_eq!(b.num_tokens(), 16);
        assert_eq!(
            b.logits_indices,
            [8, 9, 10, 11],
            "{coordinator}: 0's three, 1's one; none for 2 yet"
        );
        let n = b.num_samples();
        assert_eq!(bt.stats().preempted_recompute, 0, "{:?}", bt.stats());
        bt.commit(&vec![1000; n], &mut fin).unwrap();
        assert_eq!(bt.phase(3), Some(SeqPhase::Prefilling));
        fin.extend(drive(&mut bt, 200));
        assert_eq!(
            fin.len(),
            5,
            "{coordinator}: the shortened prefills finished"
        );
        assert_eq!(p.free_count(), 64);
    }
}

/// Throughput decoders keep their tokens: where they alone fill the step (2 tokens, 2
/// decoders), a latency-critical request waits for a token (taking a decoder's token would
/// stall its stream for the admission; it comes in as soon as a decoder ends).
#[test]
fn a_latency_critical_request_waits_where_throughput_decoders_fill_the_step() {
    let mut cfg = config();
    cfg.max_batched_tokens = 2;
    let p = pool(64);
    let mut bt = Batcher::new(cfg, p.clone()).unwrap();
    let mut fin = Vec::new();
    bt.add(req(0, vec![1], 3)).unwrap();
    bt.add(req(1, vec![2], 3)).unwrap();
    step(&mut bt, &mut fin); // both decode from now on
    bt.add(urgent(2, vec![4; 4])).unwrap();
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.seq_ids, [0, 1], "a throughput decoder lost its token");
    assert_eq!(b.num_tokens(), 2);
    let n = b.num_samples();
    assert_eq!(bt.phase(2), Some(SeqPhase::Waiting));
    bt.commit(&vec![1000; n], &mut fin).unwrap();
    fin.extend(drive(&mut bt, 200));
    assert_eq!(fin.len(), 3);
    assert_eq!(p.free_count(), 64);
}

/// Draft tokens are optional: throughput decoders whose drafts would fill the step keep their
/// own token each, and the latency-critical request's first chunk takes the rest (the drafts
/// are dropped). Before, the drafts were owed ahead of the admission: a proposer drafting at
/// every step held the request back for as long as the decoders ran.
#[test]
fn throughput_drafts_do_not_hold_back_a_latency_critical_admission() {
    let mut cfg = config();
    cfg.max_batched_tokens = 4;
    let p = pool(64);
    let mut bt = Batcher::new(cfg, p.clone()).unwrap();
    let mut fin = Vec::new();
    bt.add(req(0, vec![1], 8)).unwrap();
    bt.add(req(1, vec![2], 8)).unwrap();
    step(&mut bt, &mut fin); // both decode from now on
    bt.propose(0, &[1000]).unwrap();
    bt.propose(1, &[1000]).unwrap();
    bt.add(urgent(2, vec![4; 4])).unwrap();
    let b = bt.schedule_into(&mut fin);
    assert_eq!(
        b.seq_ids,
        [2, 0, 1],
        "the latency-critical request waited behind draft tokens"
    );
    assert_eq!(b.query_start_loc, [0, 2, 3, 4], "its chunk, a token each");
    assert_eq!(b.drafts, [0, 0, 0], "the drafts gave way");
    commit_scheduled(&mut bt, &mut fin);
    fin.extend(drive(&mut bt, 200));
    assert_eq!(fin.len(), 3);
    assert_eq!(p.free_count(), 64);
}

/// Swap mode with a prefix cache (the simulator's defaults): a running sequence's completed
/// pages are also the cache's, so a swap-out keeps them allocated this step and only its
/// partial last page counts as room. Where that falls short, the latest throughput sequence
/// is preempted by recompute instead: its pages then leave at once (its completed ones stay
/// cached, free to evict, and its prefill attaches what is left of them). Before, nothing was
/// preempted and the request waited for the throughput work to finish.
#[test]
fn a_swap_victim_whose_pages_the_prefix_cache_keeps_is_recomputed_for_room() {
    let p = pool(8);
    let cfg = config_with(PreemptionMode::Swap);
    let mut bt = Batcher::new(cfg, p.clone()).unwrap();
    let cache = PrefixCache::new(p.clone(), PrefixConfig { seed: Some(3) });
    bt.attach_prefix_cache(Arc::new(cache)).unwrap();
    let mut fin = Vec::new();
    // 13 tokens each: 4 pages, 3 of them completed and cached at the commit.
    bt.add(req(0, vec![1; 13], 6)).unwrap();
    bt.add(req(1, vec![2; 13], 6)).unwrap();
    step(&mut bt, &mut fin);
    assert_eq!(p.free_count(), 0, "the decoders hold the pool");
    assert_eq!(
        bt.throughput_room(),
        8,
        "every page leaves if both are recomputed"
    );
    // 3 pages: more than both partial last pages.
    bt.add(urgent(2, vec![3; 12])).unwrap();
    let b = bt.schedule_into(&mut fin);
    assert_eq!(
        b.seq_ids,
        [2, 0],
        "the latency-critical request waited for the throughput work"
    );
    assert_eq!(bt.phase(1), Some(SeqPhase::Waiting), "recomputed");
    assert_eq!(bt.phase(0), Some(SeqPhase::Decoding));
    assert_eq!(preemptions(&bt), 1, "{:?}", bt.stats());
    commit_scheduled(&mut bt, &mut fin);
    fin.extend(drive(&mut bt, 200));
    assert_eq!(fin.len(), 3, "the preempted one came back and finished");
    assert!(!bt.has_work());
}

/// The same for a running latency-critical row short of pages (its next prefill chunk, in
/// the step's general preemption loop): the throughput sequences' completed pages are also the
/// cache's, so the row swapped out the latest for nothing this step, then the other for its
/// partial last page. The latest is recomputed instead: its pages leave at once, the row takes
/// them, and the other keeps running.
#[test]
fn a_latency_critical_row_short_of_pages_recomputes_a_swap_victim_the_cache_keeps() {
    let p = pool(6);
    let mut cfg = config_with(PreemptionMode::Swap);
    cfg.max_prefill_chunk = 8;
    let mut bt = Batcher::new(cfg, p.clone()).unwrap();
    let cache = Arc::new(PrefixCache::new(p.clone(), PrefixConfig { seed: Some(3) }));
    bt.attach_prefix_cache(cache.clone()).unwrap();
    let mut fin = Vec::new();
    // 0: 16 tokens in chunks of 8 (2 pages each); 1: 7 tokens (a completed page and a
    // partial one, its next token's); 2: 8 tokens (2 completed pages).
    bt.add(urgent(0, vec![1; 16])).unwrap();
    bt.add(req(1, vec![2; 7], 2)).unwrap();
    bt.add(req(2, vec![3; 8], 6)).unwrap();
    step(&mut bt, &mut fin);
    assert_eq!(p.free_count(), 0, "the three hold the pool");
    let ids = bt.schedule_into(&mut fin).seq_ids.clone();
    assert_eq!(ids, [0, 1], "{:?}", bt.stats());
    assert_eq!(bt.phase(2), Some(SeqPhase::Waiting), "recomputed");
    let s = bt.stats();
    assert_eq!((s.preempted_swap, s.preempted_recompute), (0, 1), "{s:?}");
    commit_scheduled(&mut bt, &mut fin);
    fin.extend(drive(&mut bt, 200));
    assert_eq!(fin.len(), 3);
    cache.clear();
    assert_eq!(p.free_count(), 6, "blocks leaked");
}
