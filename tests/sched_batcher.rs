//! The batcher: the oxillama design's behaviours where they are right, preemption (recompute and
//! swap), copy-on-write forks, aborts, budgets, and invariants over random workloads. The
//! latency-critical class's own behaviours are in tests/sched_latency_critical.rs.

use pagedkv::block::EngineId;
use pagedkv::error::SchedError;
use pagedkv::prefix::{PrefixCache, PrefixConfig, PrefixKey};
use pagedkv::sched::{
    Batcher, BatcherConfig, EngineBudget, FinishReason, FinishedSeq, PreemptionMode, Priority,
    SeqPhase,
};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

#[path = "support/batcher_fixtures.rs"]
mod batcher_fixtures;
#[path = "support/random_batcher.rs"]
mod random_batcher;
use batcher_fixtures::{
    check_batch, commit_scheduled, config, config_with, drive, pool, req, step, with_prefix, BS,
};
use random_batcher::Quota;

#[test]
fn single_request_prefill_then_decode() {
    let p = pool(64);
    let mut bt = Batcher::new(config(), p.clone()).unwrap();
    bt.add(req(1, vec![1, 2, 3], 10)).unwrap();
    assert_eq!(bt.num_waiting(), 1);
    let mut fin = Vec::new();
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.seq_ids, vec![1]);
    assert_eq!(b.input_tokens, vec![1, 2, 3]);
    assert_eq!(b.positions, vec![0, 1, 2]);
    assert!(b.is_prefill[0]);
    assert_eq!(b.logits_indices, vec![2]);
    assert_eq!(bt.num_running(), 1);
    bt.commit(&[4], &mut fin).unwrap();
    let b = bt.schedule_into(&mut fin);
    assert_eq!(
        b.input_tokens,
        vec![4],
        "decode feeds the last sampled token"
    );
    assert_eq!(b.positions, vec![3]);
    assert_eq!(b.context_lens, vec![4]);
    assert!(!b.is_prefill[0]);
    assert_eq!(bt.phase(1), Some(SeqPhase::Decoding));
}

#[test]
fn finishes_at_max_tokens_and_frees_blocks() {
    let p = pool(64);
    let mut bt = Batcher::new(config(), p.clone()).unwrap();
    bt.add(req(1, vec![1], 3)).unwrap();
    let done = drive(&mut bt, 100);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].reason, FinishReason::MaxTokens);
    assert_eq!(done[0].output.len(), 3);
    assert!(!bt.has_work());
    assert_eq!(p.free_count(), 64);
}

#[test]
fn eos_and_stop_sequences() {
    let p = pool(64);
    let mut bt = Batcher::new(config(), p.clone()).unwrap();
    let mut a = req(1, vec![1, 2], 100);
    a.stop.eos = vec![7];
    let mut b = req(2, vec![1, 2], 100);
    b.stop.stop_sequences = vec![vec![5, 6]];
    bt.add(a).unwrap();
    bt.add(b).unwrap();
    let mut fin = Vec::new();
    let script: [&[u32]; 4] = [&[3, 5], &[7, 6], &[], &[]];
    for toks in script {
        bt.schedule_into(&mut fin);
        bt.commit(toks, &mut fin).unwrap();
        if !bt.has_work() {
            break;
        }
    }
    let by_id: HashMap<u64, &FinishedSeq> = fin.iter().map(|f| (f.id, f)).collect();
    assert_eq!(by_id[&1].reason, FinishReason::Eos);
    assert_eq!(by_id[&1].output, vec![3, 7]);
    assert_eq!(by_id[&2].reason, FinishReason::StopSequence);
    assert_eq!(by_id[&2].output, vec![5, 6]);
    assert_eq!(p.free_count(), 64);
}

#[test]
fn max_running_respected() {
    let p = pool(64);
    let mut bt = Batcher::new(
        BatcherConfig {
            max_running: 2,
            ..config()
        },
        p,
    )
    .unwrap();
    for id in 0..3 {
        bt.add(req(id, vec![1], 10)).unwrap();
    }
    let mut fin = Vec::new();
    assert_eq!(bt.schedule_into(&mut fin).num_seqs(), 2);
    assert_eq!(bt.num_waiting(), 1);
}

#[test]
fn chunked_long_prefill() {
    let p = pool(64);
    let mut bt = Batcher::new(
        BatcherConfig {
            max_prefill_chunk: 4,
            ..config()
        },
        p,
    )
    .unwrap();
    bt.add(req(1, (1..=10).collect(), 20)).unwrap();
    let mut fin = Vec::new();
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.input_tokens, vec![1, 2, 3, 4]);
    assert_eq!(b.num_samples(), 0, "a partial prefill samples nothing");
    bt.commit(&[], &mut fin).unwrap();
    assert_eq!(bt.schedule_into(&mut fin).input_tokens, vec![5, 6, 7, 8]);
    bt.commit(&[], &mut fin).unwrap();
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.input_tokens, vec![9, 10]);
    assert_eq!(b.context_lens, vec![10]);
    assert_eq!(b.num_samples(), 1);
    bt.commit(&[11], &mut fin).unwrap();
    assert_eq!(bt.phase(1), Some(SeqPhase::Decoding));
}

#[test]
fn token_budget_splits_prefill_across_sequences() {
    let p = pool(64);
    let mut bt = Batcher::new(
        BatcherConfig {
            max_batched_tokens: 6,
            ..config()
        },
        p,
    )
    .unwrap();
    bt.add(req(1, vec![1; 4], 5)).unwrap();
    bt.add(req(2, vec![2; 4], 5)).unwrap();
    let mut fin = Vec::new();
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.num_tokens(), 6);
    assert_eq!(b.context_lens, vec![4, 2]);
}

#[test]
fn remove_via_abort_waiting_and_running() {
    let p = pool(64);
    let mut bt = Batcher::new(config(), p.clone()).unwrap();
    bt.add(req(1, vec![1, 2, 3, 4, 5], 10)).unwrap();
    let mut fin = Vec::new();
    bt.schedule_into(&mut fin);
    bt.commit(&[9], &mut fin).unwrap();
    bt.add(req(2, vec![1], 10)).unwrap();
    bt.abort(1).unwrap();
    bt.abort(2).unwrap();
    assert_eq!(bt.abort(3), Err(SchedError::UnknownSeq(3)));
    let b = bt.schedule_into(&mut fin);
    assert!(b.is_empty());
    assert_eq!(fin.len(), 2);
    assert!(fin.iter().all(|f| f.reason == FinishReason::Aborted));
    assert!(!bt.has_work());
    assert_eq!(p.free_count(), 64);
}

#[test]
fn bad_requests_are_refused() {
    let p = pool(8);
    let mut bt = Batcher::new(config(), p).unwrap();
    assert!(matches!(
        bt.add(req(1, vec![], 4)),
        Err(SchedError::InvalidRequest { .. })
    ));
    assert!(matches!(
        bt.add(req(1, vec![1], 0)),
        Err(SchedError::InvalidRequest { .. })
    ));
    // 8 blocks of 4 tokens: 33 tokens can never fit.
    assert_eq!(
        bt.add(req(1, vec![1; 30], 4)),
        Err(SchedError::TooLong {
            id: 1,
            blocks: 9,
            limit: 8
        })
    );
    bt.add(req(1, vec![1; 30], 3)).unwrap();
    assert_eq!(bt.add(req(1, vec![1], 3)), Err(SchedError::DuplicateId(1)));
    let mut fin = Vec::new();
    bt.schedule_into(&mut fin);
    assert_eq!(
        bt.commit(&[1, 2], &mut fin),
        Err(SchedError::SampleCountMismatch {
            expected: 1,
            got: 2
        })
    );
    assert!(Batcher::new(
        BatcherConfig {
            block_size: 0,
            ..config()
        },
        pool(4)
    )
    .is_err());
}

#[test]
fn recompute_preemption_keeps_progress_and_never_livelocks() {
    // 6 blocks of 4 tokens; each sequence needs up to 5 blocks: only one fits at a time.
    let p = pool(6);
    let mut bt = Batcher::new(config(), p.clone()).unwrap();
    for id in 0..4 {
        bt.add(req(id, vec![id as u32 + 1; 6], 14)).unwrap();
    }
    let done = drive(&mut bt, 10_000);
    assert_eq!(done.len(), 4, "every request finishes");
    assert!(done
        .iter()
        .all(|f| f.reason == FinishReason::MaxTokens && f.output.len() == 14));
    assert!(
        bt.stats().preempted_recompute > 0,
        "the workload needed preemption"
    );
    assert_eq!(p.free_count(), 6);
}

#[test]
fn swap_preemption_lists_copies_and_restores() {
    let p = pool(6);
    let mut bt = Batcher::new(
        BatcherConfig {
            preemption: PreemptionMode::Swap,
            swap_blocks: 16,
            ..config()
        },
        p.clone(),
    )
    .unwrap();
    for id in 0..3 {
        bt.add(req(id, vec![1; 6], 14)).unwrap();
    }
    let mut done = Vec::new();
    let mut outs = 0;
    let mut ins = 0;
    let mut host_in_use: HashSet<i32> = HashSet::new();
    for step in 0..10_000 {
        if !bt.has_work() {
            break;
        }
        let b = bt.schedule_into(&mut done);
        check_batch(b, 512);
        for &(_, host) in &b.swap_out {
            assert!(
                host_in_use.insert(host),
                "host slot {host} reused while occupied"
            );
        }
        // Swap-ins read host slots; a slot is free again only after the step.
        for &(host, _) in &b.swap_in {
            assert!(host_in_use.contains(&host));
        }
        let freed: Vec<i32> = b.swap_in.iter().map(|&(h, _)| h).collect();
        outs += b.swap_out.len();
        ins += b.swap_in.len();
        let sampled: Vec<u32> = (0..b.num_samples()).map(|k| (step + k) as u32).collect();
        bt.commit(&sampled, &mut done).unwrap();
        for h in freed {
            host_in_use.remove(&h);
        }
    }
    assert_eq!(done.len(), 3);
    assert!(bt.stats().preempted_swap > 0);
    assert!(
        outs > 0 && outs == ins,
        "every swapped-out block came back ({outs} out, {ins} in)"
    );
    assert_eq!(p.free_count(), 6);
}

#[test]
fn fork_shares_blocks_and_copies_on_write() {
    let p = pool(16);
    let mut bt = Batcher::new(config(), p.clone()).unwrap();
    bt.add(req(1, vec![1, 2, 3, 4, 5, 6], 8)).unwrap();
    let mut fin = Vec::new();
    bt.schedule_into(&mut fin);
    bt.commit(&[7], &mut fin).unwrap();
    let before = p.free_count();
    bt.fork(1, 2).unwrap();
    assert_eq!(p.free_count(), before, "a fork copies nothing up front");
    let b = bt.schedule_into(&mut fin);
    // Both write position 6, inside the shared second block: one copy-on-write.
    assert_eq!(b.num_seqs(), 2);
    assert_eq!(b.copies.len(), 1);
    let (src, dst) = b.copies[0];
    assert_ne!(src, dst);
    check_batch(b, 512);
    bt.commit(&[8, 9], &mut fin).unwrap();
    let rest = drive(&mut bt, 100);
    assert_eq!(fin.len() + rest.len(), 2);
    assert_eq!(p.free_count(), 16);
}

/// A quota of `quota` blocks and `tokens` tokens a step, and its counter of blocks in use.
fn quota(tokens: u32, quota: u32) -> (Quota, Arc<AtomicU32>) {
    let used = Arc::new(AtomicU32::new(0));
    let q = Quota {
        tokens: Arc::new(AtomicU32::new(tokens)),
        quota,
        used: used.clone(),
    };
    (q, used)
}

#[test]
fn attached_budget_limits_tokens_and_blocks() {
    let p = pool(64);
    let (budget, used) = quota(5, 3);
    let mut bt = Batcher::new(config(), p.clone()).unwrap();
    bt.attach_budget(Box::new(budget));
    for id in 0..3 {
        bt.add(req(id, vec![1; 4], 6)).unwrap();
    }
    let mut fin = Vec::new();
    for step in 0..2000 {
        if !bt.has_work() {
            break;
        }
        let b = bt.schedule_into(&mut fin);
        check_batch(b, 5);
        assert!(used.load(Ordering::Relaxed) <= 3, "quota exceeded");
        assert_eq!(
            64 - p.free_count(),
            used.load(Ordering::Relaxed),
            "quota accounting drifted"
        );
        let s: Vec<u32> = (0..b.num_samples()).map(|k| (step + k) as u32).collect();
        bt.commit(&s, &mut fin).unwrap();
    }
    assert_eq!(fin.len(), 3);
    assert_eq!(used.load(Ordering::Relaxed), 0);
    assert_eq!(p.free_count(), 64);
}

#[test]
fn random_workloads_keep_invariants() {
    for seed in 0..160u64 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let blocks = rng.gen_range(8..40);
        let p = pool(blocks);
        let mode = if seed % 2 == 0 {
            PreemptionMode::Recompute
        } else {
            PreemptionMode::Swap
        };
        let cfg = BatcherConfig {
            max_running: rng.gen_range(1..8),
            max_batched_tokens: rng.gen_range(1..64),
            // Longer chunks with a prefix cache (below): a first chunk then needs more pages than
            // the running sequences hold uncached.
            max_prefill_chunk: rng.gen_range(1..if seed % 4 >= 2 { 40 } else { 16 }),
            max_blocks_per_seq: 16,
            preemption: mode,
            swap_blocks: rng.gen_range(0..32),
            ..config()
        };
        let mut bt = Batcher::new(cfg, p.clone()).unwrap();
        // Half the seeds of each mode with a prefix cache, where every completed page of a
        // sequence is also the cache's (each prompt its own tokens: no page is shared across
        // sequences, so the pool is still the free pages, those the cache alone holds and
        // those the running sequences would give up).
        let cache = (seed % 4 >= 2).then(|| {
            let cache = Arc::new(PrefixCache::new(
                p.clone(),
                PrefixConfig { seed: Some(seed) },
            ));
            bt.attach_prefix_cache(cache.clone()).unwrap();
            cache
        });
        let mut submitted = 0u64;
        let mut refused = 0u64;
        let mut done = Vec::new();
        let mut classes = HashMap::new();
        for step in 0..5_000 {
            // Whether no latency-critical sequence waits, runs or is swapped out, and the
            // running decoders' rows (a token each: their drafts give way) leave a token of the
            // step, but for the row of one preempted for its running slot when every slot is taken
            // (the throughput prefill chunks give way to the admission): one arriving now is
            // admitted at this step, preempting the latest throughput sequence for a slot if
            // none is free and throughput sequences for its first chunk's pages if the pool is
            // short (they, the free pages and those only the prefix cache holds are the whole
            // pool, which holds any chunk here).
            let running = bt.num_running();
            let rows_kept = running.min(cfg.max_running as usize - 1);
            let decoders = (0..submitted)
                .filter(|&id| bt.phase(id) == Some(SeqPhase::Decoding))
                .count();
            let lc_idle = decoders.min(rows_kept) < cfg.max_batched_tokens as usize
                && (0..submitted)
                    .all(|id| classes[&id] == Priority::Throughput || bt.phase(id).is_none());
            let mut arrived_lc = None;
            if submitted < 40 && rng.gen_bool(0.3) {
                let mut r = req(
                    submitted,
                    vec![submitted as u32 + 1; rng.gen_range(1..40)],
                    rng.gen_range(1..30),
                );
                r.priority = if rng.gen_bool(0.3) {
                    Priority::LatencyCritical
                } else {
                    Priority::Throughput
                };
                r.stop.eos = vec![0];
                classes.insert(r.id, r.priority);
                let (id, class) = (r.id, r.priority);
                match bt.add(r) {
                    Ok(()) if class == Priority::LatencyCritical => arrived_lc = Some(id),
                    Ok(()) => {}
                    Err(SchedError::TooLong { .. }) => refused += 1,
                    Err(e) => panic!("{e}"),
                }
                submitted += 1;
            }
            if rng.gen_bool(0.02) && submitted > 0 {
                let _ = bt.abort(rng.gen_range(0..submitted));
            }
            // Draft tokens for some decoders (refused where more than a sequence may still
            // generate): optional tokens, which never hold back an admission.
            for id in 0..submitted {
                if bt.phase(id) == Some(SeqPhase::Decoding) && rng.gen_bool(0.3) {
                    let drafts: Vec<u32> = (0..rng.gen_range(1..4))
                        .map(|_| rng.gen_range(1..50))
                        .collect();
                    let _ = bt.propose(id, &drafts);
                }
            }
            let swapped: Vec<u64> = (0..submitted)
                .filter(|&id| bt.phase(id) == Some(SeqPhase::Swapped))
                .collect();
            // What an engine reads to ask for donations changes nothing: no cache lookup
            // counted, no page taken (a recomputed sequence's own cached pages are hits).
            let lookups = cache.as_ref().map(|c| c.metrics(EngineId(0)).lookups);
            let free = p.free_count();
            let _ = bt.next_admission_need();
            assert_eq!(
                cache.as_ref().map(|c| c.metrics(EngineId(0)).lookups),
                lookups,
                "seed {seed} step {step}: reading the admission need looked the cache up"
            );
            assert_eq!(p.free_count(), free, "seed {seed} step {step}");
            let b = bt.schedule_into(&mut done);
            check_batch(b, cfg.max_batched_tokens as usize);
            if let Some(id) = arrived_lc.filter(|_| lc_idle) {
                // (`None`: a random abort ended it.)
                assert!(
                    !matches!(bt.phase(id), Some(SeqPhase::Waiting)),
                    "seed {seed} step {step}: a latency-critical request waits while \
                     throughput sequences hold the pages, the running slot or the prefill \
                     tokens it needs"
                );
            }
            // A swapped-out throughput sequence comes back only once no latency-critical
            // request waits (it would take the pages that request needs).
            let swapped_in_throughput = swapped.iter().any(|&id| {
                classes[&id] == Priority::Throughput
                    && matches!(
                        bt.phase(id),
                        Some(SeqPhase::Prefilling | SeqPhase::Decoding)
                    )
            });
            assert!(
                !swapped_in_throughput || bt.num_waiting_in(Priority::LatencyCritical) == 0,
                "seed {seed} step {step}: a throughput sequence swapped in while a \
                 latency-critical request waits"
            );
            let b = bt.batch();
            let s: Vec<u32> = (0..b.num_samples()).map(|_| rng.gen_range(0..50)).collect();
            bt.commit(&s, &mut done).unwrap();
            if submitted == 40 && !bt.has_work() {
                let _ = step;
                break;
            }
        }
        assert!(!bt.has_work(), "seed {seed}: work left after 5000 steps");
        assert_eq!(
            done.len() as u64 + refused,
            submitted,
            "seed {seed}: every request finished or refused"
        );
        if let Some(cache) = cache {
            // Every page the cache holds is one only it holds now: back to the pool.
            cache.clear();
        }
        assert_eq!(p.free_count(), blocks, "seed {seed}: blocks leaked");
    }
}

/// With one arena shared by every model, a page is memory: the pages a swap-out reads must not
/// be handed to another engine before the batch has run (its kernels would overwrite them while
/// the swap-out copies them). The batcher keeps them until commit; then they are free.
#[test]
fn swapped_out_pages_stay_allocated_until_the_batch_has_run() {
    let p = pool(6);
    let mut bt = Batcher::new(
        BatcherConfig {
            preemption: PreemptionMode::Swap,
            swap_blocks: 16,
            ..config()
        },
        p.clone(),
    )
    .unwrap();
    for id in 0..3 {
        bt.add(req(id, vec![1; 6], 14)).unwrap();
    }
    let mut done = Vec::new();
    let mut checked = 0;
    for step in 0..10_000 {
        if !bt.has_work() {
            break;
        }
        let b = bt.schedule_into(&mut done);
        let sources: HashSet<u32> = b.swap_out.iter().map(|&(d, _)| d as u32).collect();
        let samples = b.num_samples();
        // Another engine takes every page the pool will give it right now.
        let free = p.free_count();
        let mut other = Vec::new();
        if free > 0 {
            p.alloc_n(EngineId(1), free, &mut other).unwrap();
        }
        if !sources.is_empty() {
            checked += 1;
            for id in &other {
                assert!(
                    !sources.contains(&id.index()),
                    "step {step}: page {} is being swapped out but another engine got it",
                    id.index()
                );
            }
        }
        p.free_n(&other).unwrap();
        let sampled: Vec<u32> = (0..samples).map(|k| (step + k) as u32).collect();
        bt.commit(&sampled, &mut done).unwrap();
    }
    assert!(checked > 0, "the workload swapped something out");
    assert_eq!(done.len(), 3);
    assert_eq!(
        p.free_count(),
        6,
        "swapped-out pages are freed after the batch"
    );
}

/// A sequence that attaches cached pages on admission but cannot reserve the rest stays
/// waiting without them: before, it kept them, and with a second such sequence (a preempted
/// one re-attaching its own) each held what the other needed and neither ever ran, though
/// each fits the pool alone.
#[test]
fn a_waiting_sequence_holds_no_cached_pages() {
    let (p, mut bt) = with_prefix(4);
    bt.add(req(1, (1..=8).collect(), 1)).unwrap();
    assert_eq!(drive(&mut bt, 10).len(), 1); // its two full blocks stay cached-free
    bt.add(req(2, (100..105).collect(), 12)).unwrap(); // all 4 pages over its life
    let mut fin = Vec::new();
    step(&mut bt, &mut fin);
    bt.add(req(3, (1..=9).collect(), 1)).unwrap(); // seq 1's prefix, cached
    fin.extend(drive(&mut bt, 300));
    let ids: HashSet<u64> = fin.iter().map(|f| f.id).collect();
    assert_eq!(ids, HashSet::from([2, 3]), "both finish");
    assert!(!bt.has_work());
    assert!(p.free_count() <= 4);
}

/// Prefix statistics count a prompt once, when its sequence is admitted, not on every step
/// it waits for pages.
#[test]
fn prefix_statistics_count_a_waiting_prompt_once() {
    let (_p, mut bt) = with_prefix(4);
    bt.add(req(1, (1..=8).collect(), 8)).unwrap(); // 15 tokens: all 4 pages
    let mut fin = Vec::new();
    step(&mut bt, &mut fin);
    bt.add(req(2, (20..25).collect(), 1)).unwrap(); // waits for seq 1's pages
    fin.extend(drive(&mut bt, 100));
    assert_eq!(fin.len(), 2);
    assert_eq!(bt.stats().prefix_prompt_tokens, 8 + 5);
}

/// Drafts proposed while the sequence's row is scheduled and not committed are refused: the
/// commit verifies the drafts the row carried. Before, a shorter proposal made the commit
/// panic, and one of the same length was verified in place of the row's.
#[test]
fn a_proposal_while_its_row_is_uncommitted_is_refused() {
    let mut bt = Batcher::new(config(), pool(16)).unwrap();
    bt.add(req(1, vec![1, 2, 3], 10)).unwrap();
    let mut fin = Vec::new();
    step(&mut bt, &mut fin);
    bt.propose(1, &[7, 8]).unwrap();
    assert_eq!(bt.schedule_into(&mut fin).num_samples(), 3);
    for drafts in [&[][..], &[8, 7]] {
        assert!(matches!(
            bt.propose(1, drafts),
            Err(SchedError::InvalidRequest { id: 1, .. })
        ));
    }
    bt.commit(&[7, 8, 9], &mut fin).unwrap(); // both drafts confirmed, and one more token
    bt.propose(1, &[4]).unwrap(); // the next step's, after the commit
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.input_tokens, [9, 4]);
}

/// Drafts that fit the row's limit exactly are scheduled: a decode token and two drafts under
/// a prefill chunk of three are one row of three tokens, three samples.
#[test]
fn drafts_that_exactly_fill_the_chunk_limit_are_scheduled() {
    let cfg = BatcherConfig {
        max_prefill_chunk: 3,
        ..config()
    };
    let mut bt = Batcher::new(cfg, pool(16)).unwrap();
    bt.add(req(1, vec![1, 2, 3], 10)).unwrap();
    let mut fin = Vec::new();
    step(&mut bt, &mut fin);
    bt.propose(1, &[7, 8]).unwrap();
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.input_tokens, [1000, 7, 8]);
    assert_eq!(b.num_samples(), 3);
}

/// Drafts are optional: when the pages they need are short, they are dropped (the row is a
/// plain decode), never paid for by a preemption. Before, the older sequence's two drafts
/// needing a second page preempted the younger sequence by recompute (its KV thrown away) so
/// that the speculative tokens could run; a younger sequence's drafts preempted itself.
#[test]
fn drafts_short_of_pages_are_dropped_not_paid_for_by_a_preemption() {
    for proposer in [1, 2] {
        let mut bt = Batcher::new(config(), pool(2)).unwrap();
        bt.add(req(1, vec![1, 2, 3], 5)).unwrap(); // 7 tokens at most: 2 pages over its life
        bt.add(req(2, vec![4, 5, 6], 5)).unwrap();
        let mut fin = Vec::new();
        step(&mut bt, &mut fin); // both prefilled: one page each, the pool is dry
        assert_eq!((bt.blocks_of(1), bt.blocks_of(2)), (Some(1), Some(1)));
        bt.propose(proposer, &[7, 8]).unwrap(); // positions 3..=5: a second page
        let b = bt.schedule_into(&mut fin);
        assert_eq!(b.seq_ids, [1, 2], "proposer {proposer}");
        assert_eq!(b.input_tokens, [1000, 1000], "proposer {proposer}");
        assert_eq!(b.num_samples(), 2);
        assert_eq!(bt.stats().preempted_recompute, 0, "proposer {proposer}");
        bt.commit(&[1001, 1002], &mut fin).unwrap();
        assert!(fin.is_empty());
    }
}

/// Runs `bt` to idle (at most 500 steps) with `check` after each schedule.
fn drive_checked(bt: &mut Batcher, fin: &mut Vec<FinishedSeq>, mut check: impl FnMut(&Batcher)) {
    for step in 0..500 {
        if !bt.has_work() {
            return;
        }
        let n = bt.schedule_into(fin).num_samples();
        check(bt);
        let s: Vec<u32> = (0..n).map(|k| (step + k) as u32).collect();
        bt.commit(&s, fin).unwrap();
    }
    panic!("not idle after 500 steps");
}

/// A budget wider than the pool: a page the budget grants but the pool cannot give is handed
/// back to the budget, so the budget always counts exactly the pages the engine holds.
#[test]
fn pages_the_pool_refuses_go_back_to_the_budget() {
    let p = pool(6);
    let (budget, used) = quota(512, 64);
    let mut bt = Batcher::new(config(), p.clone()).unwrap();
    bt.attach_budget(Box::new(budget));
    for id in 0..3 {
        bt.add(req(id, vec![1; 6], 10)).unwrap();
    }
    let mut fin = Vec::new();
    drive_checked(&mut bt, &mut fin, |_| {
        assert_eq!(
            6 - p.free_count(),
            used.load(Ordering::Relaxed),
            "the budget counts pages the engine does not hold"
        );
    });
    assert_eq!(fin.len(), 3);
    assert!(
        bt.stats().preempted_recompute > 0,
        "the pool never ran short"
    );
    assert_eq!(used.load(Ordering::Relaxed), 0);
}

/// Host swap slots come back: after a swapped sequence is swapped in, and when a swapped
/// sequence is aborted. Later preemptions then still find room to swap instead of falling
/// back to recompute.
#[test]
fn host_swap_slots_are_reused_after_swap_in_and_abort() {
    let swap_cfg = |swap_blocks| BatcherConfig {
        preemption: PreemptionMode::Swap,
        swap_blocks,
        ..config()
    };
    // More blocks pass through the swap space than it holds: the slots a swap-in freed are
    // reused.
    let mut bt = Batcher::new(swap_cfg(6), pool(6)).unwrap();
    for id in 0..3 {
        bt.add(req(id, vec![1; 6], 10)).unwrap();
    }
    let mut fin = Vec::new();
    drive_checked(&mut bt, &mut fin, |_| {});
    assert_eq!(fin.len(), 3);
    let st = bt.stats();
    assert!(st.blocks_swapped_out > 6, "{st:?}");
    assert_eq!(st.preempted_recompute, 0, "host slots leaked: {st:?}");
    // A swapped sequence aborted: its slots serve the next swap.
    let mut bt = Batcher::new(swap_cfg(4), pool(6)).unwrap();
    for id in 0..3 {
        bt.add(req(id, vec![1; 6], 10)).unwrap();
    }
    let mut at_abort = None;
    for step in 0..500u32 {
        if !bt.has_work() {
            break;
        }
        let n = bt.schedule_into(&mut fin).num_samples();
        let s: Vec<u32> = (0..n as u32).map(|k| step + k).collect();
        bt.commit(&s, &mut fin).unwrap();
        if at_abort.is_none() {
            if let Some(id) = (0..3).find(|&id| bt.phase(id) == Some(SeqPhase::Swapped)) {
                bt.abort(id).unwrap();
                at_abort = Some(bt.stats());
            }
        }
    }
    let before = at_abort.expect("nothing was swapped out");
    let st = bt.stats();
    assert!(st.preempted_swap > before.preempted_swap, "{st:?}");
    assert_eq!(
        st.preempted_recompute, before.preempted_recompute,
        "the aborted sequence's host slots leaked: {st:?}"
    );
}

/// A batch not committed when the batcher schedules again is discarded: its rows come again
/// (nothing was computed), an abort made meanwhile applies (the way out of a batch whose
/// execution failed), and no page is lost.
#[test]
fn an_uncommitted_batch_is_discarded_and_its_rows_scheduled_again() {
    let p = pool(16);
    let mut bt = Batcher::new(config(), p.clone()).unwrap();
    bt.add(req(1, vec![1, 2, 3], 4)).unwrap();
    bt.add(req(2, vec![4, 5], 4)).unwrap();
    let mut fin = Vec::new();
    let first = bt.schedule_into(&mut fin).input_tokens.clone();
    assert_eq!(first, [1, 2, 3, 4, 5]);
    assert!(bt.is_pending());
    // Its execution failed: abort sequence 2, schedule again.
    bt.abort(2).unwrap();
    let b = bt.schedule_into(&mut fin);
    assert_eq!(
        b.input_tokens,
        [1, 2, 3],
        "sequence 1's row again, 2 aborted"
    );
    assert!(fin
        .iter()
        .any(|f| f.id == 2 && f.reason == FinishReason::Aborted));
    bt.commit(&[9], &mut fin).unwrap();
    assert!(!bt.is_pending());
    fin.extend(drive(&mut bt, 20));
    assert!(fin.iter().any(|f| f.id == 1 && f.output.len() == 4));
    assert_eq!(p.free_count(), 16);
}

/// A fork's child id may be one whose sequence's end was reported, also when a caller's abort
/// of it came too late (its commit ended it first, by its stop rules): that abort is dropped
/// with the sequence, so it neither holds the id nor ends the new child. (It stayed pending
/// until the next step, and the id was refused, for `add` too, until then.)
#[test]
fn an_abort_pending_for_a_sequence_its_commit_ended_is_dropped() {
    let mut bt = Batcher::new(config(), pool(16)).unwrap();
    bt.add(req(1, vec![1, 2, 3], 2)).unwrap();
    bt.add(req(2, vec![4, 5, 6], 10)).unwrap();
    let mut fin = Vec::new();
    step(&mut bt, &mut fin);
    let n = bt.schedule_into(&mut fin).num_samples();
    bt.abort(1).unwrap();
    bt.commit(&vec![9; n], &mut fin).unwrap(); // seq 1 reaches its 2 tokens
    assert!(fin
        .iter()
        .any(|f| f.id == 1 && f.reason == FinishReason::MaxTokens));
    fin.clear();
    bt.fork(2, 1).unwrap();
    fin.extend(drive(&mut bt, 50));
    let child = fin.iter().find(|f| f.id == 1).expect("the child ends");
    assert_eq!(
        child.reason,
        FinishReason::MaxTokens,
        "the late abort ended the child"
    );
    assert_eq!(fin.len(), 2);
}

/// A fork is refused while the parent's row waits for its commit (the child would share the
/// block reserved for that row's token, and both write their next token into it); after the
/// commit it shares the parent's computed blocks and every slot stays its own.
#[test]
fn fork_waits_for_the_commit_of_the_parents_row() {
    let p = pool(32);
    let mut bt = Batcher::new(config(), p.clone()).unwrap();
    bt.add(req(1, (1..=8).collect(), 12)).unwrap(); // 8 tokens: two full blocks
    let mut fin = Vec::new();
    step(&mut bt, &mut fin); // prefill; the next token starts block 2
    bt.schedule_into(&mut fin); // its row reserves block 2, uncommitted
    assert!(matches!(
        bt.fork(1, 2),
        Err(SchedError::InvalidRequest { id: 1, .. })
    ));
    let n = bt.schedule_into(&mut fin).num_samples(); // discards, schedules again
    bt.commit(&vec![1000; n], &mut fin).unwrap();
    bt.fork(1, 2).unwrap();
    fin.extend(drive(&mut bt, 100)); // check_batch: no slot written twice
    assert_eq!(fin.len(), 2);
    assert_eq!(p.free_count(), 32);
}

/// A parent and its fork swapped out in the same step list their shared pages twice among the
/// pages the swap-outs hold: each page's budget goes back once, when its last reference does.
/// Before, leaving was counted before any release, neither entry saw the page leave, and its
/// budget was held for good (the engine could never deregister).
#[test]
fn sharing_sequences_swapped_out_together_give_their_budget_back() {
    let p = pool(16);
    let (budget, used) = quota(512, 16);
    let cfg = config_with(PreemptionMode::Swap);
    let mut bt = Batcher::new(cfg, p.clone()).unwrap();
    bt.attach_budget(Box::new(budget));
    bt.add(req(1, (1..=8).collect(), 6)).unwrap();
    let mut fin = Vec::new();
    step(&mut bt, &mut fin);
    bt.fork(1, 2).unwrap();
    bt.request_shed(100); // both swapped out in one step
    let b = bt.schedule_into(&mut fin);
    assert!(b.swap_out.len() >= 4, "both swapped out: {:?}", b.swap_out);
    bt.commit(&[], &mut fin).unwrap();
    assert_eq!(
        16 - p.free_count(),
        used.load(Ordering::Relaxed),
        "budget held for pages no longer held"
    );
    fin.extend(drive(&mut bt, 200));
    assert_eq!(fin.len(), 2);
    assert_eq!(p.free_count(), 16);
    assert_eq!(used.load(Ordering::Relaxed), 0);
}

/// An engine whose work ran out holds none of the device's step tokens, though it is not
/// stepped again (drivers park on their queue): its last step's tokens used to stay counted
/// and cut the other engine's grant (56 of the device's 64 here).
#[test]
fn an_idle_engine_holds_no_step_tokens() {
    use pagedkv::budget::{BudgetConfig, BudgetCoordinator};
    use pagedkv::sched::EngineShare;
    let c = Arc::new(BudgetCoordinator::new(BudgetConfig::new(2, 64, 64)).unwrap());
    let a = c.register(1).unwrap();
    let b = c.register(1).unwrap();
    let mut bt = Batcher::new(config(), pool(64)).unwrap();
    bt.attach_budget(Box::new(EngineShare::new(c.clone(), a)));
    bt.add(req(1, vec![7; 8], 1)).unwrap();
    bt.sync_activity();
    c.recompute();
    let mut done = Vec::new();
    while bt.has_work() {
        let n = bt.schedule_into(&mut done).num_samples();
        bt.commit(&vec![9; n], &mut done).unwrap();
        c.maybe_recompute();
    }
    assert_eq!(done.len(), 1);
    assert!(!c.is_active(a));
    assert_eq!(
        c.tokens_granted(a),
        0,
        "the idle engine still holds its last step's tokens"
    );
    let share_b = EngineShare::new(c.clone(), b);
    share_b.set_active(true);
    c.recompute();
    assert_eq!(
        share_b.token_budget(),
        64,
        "the device's tokens are partly lost"
    );
}

/// A copy-on-write source stays allocated until the batch has run, even when the sequence it
/// was shared with is preempted by recompute later in the same step (it was released then, and
/// another engine could get the page and write it before the batch copied from it).
#[test]
fn copy_on_write_sources_stay_allocated_until_the_batch_has_run() {
    let p = pool(5);
    let mut bt = Batcher::new(
        BatcherConfig {
            max_prefill_chunk: 8,
            ..config()
        },
        p.clone(),
    )
    .unwrap();
    bt.add(req(1, vec![1; 6], 8)).unwrap();
    bt.add(req(2, vec![2; 14], 2)).unwrap();
    let mut fin = Vec::new();
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.num_samples(), 1);
    bt.commit(&[7], &mut fin).unwrap();
    bt.fork(1, 3).unwrap();
    // 1 copies its shared partial page (the last free page); 2 finds no pages, so the fork
    // (latest arrival) is preempted, then 2 itself.
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.copies.len(), 1, "{b:?}");
    let src = b.copies[0].0 as u32;
    let samples = b.num_samples();
    let free = p.free_count();
    let mut other = Vec::new();
    if free > 0 {
        p.alloc_n(EngineId(1), free, &mut other).unwrap();
    }
    assert!(
        other.iter().all(|id| id.index() != src),
        "page {src}, a copy source of the batch in flight, went to another engine"
    );
    p.free_n(&other).unwrap();
    bt.commit(&vec![9; samples], &mut fin).unwrap();
    let rest = drive(&mut bt, 1000);
    assert_eq!(fin.len() + rest.len(), 3);
    assert_eq!(p.free_count(), 5);
}

/// Swap preemption of a fork after its parent's copy-on-write: the page it held went to
/// `swap_out_pending` and counted as reusable, and another copy-on-write took it as its
/// destination, so one step's copies read a page they also wrote (refused as CopyOverlap).
#[test]
fn a_copy_source_is_never_a_copy_destination_of_the_same_step() {
    let p = pool(5);
    let mut bt = Batcher::new(
        BatcherConfig {
            preemption: PreemptionMode::Swap,
            swap_blocks: 16,
            ..config()
        },
        p.clone(),
    )
    .unwrap();
    bt.add(req(1, vec![1; 6], 6)).unwrap();
    bt.add(req(2, vec![2; 6], 6)).unwrap();
    let mut fin = Vec::new();
    bt.schedule_into(&mut fin);
    bt.commit(&[7, 8], &mut fin).unwrap();
    bt.fork(2, 4).unwrap();
    bt.fork(1, 3).unwrap();
    for step in 0..200 {
        if !bt.has_work() {
            break;
        }
        let b = bt.schedule_into(&mut fin);
        let pairs: Vec<(u32, u32)> = b
            .copies
            .iter()
            .map(|&(s, d)| (s as u32, d as u32))
            .collect();
        assert!(
            pagedkv::kv::check_block_mapping(&pairs, 5, 5, true).is_ok(),
            "step {step}: the copies {pairs:?} read a page they also write"
        );
        let s = vec![9; b.num_samples()];
        bt.commit(&s, &mut fin).unwrap();
    }
    assert_eq!(fin.len(), 4);
    assert_eq!(p.free_count(), 5);
}

/// Same priority: the youngest sequence is the victim, never the oldest while a younger one
/// runs. Swapped-out sequences came back youngest first (the swapped queue was in preemption
/// order, youngest first within a step) and a sequence swapped in went to the end of the
/// running list, behind younger ones already in the batch: out of the victim choice's reach.
#[test]
fn the_oldest_sequence_is_not_the_victim_while_a_younger_one_runs() {
    let cfg = config_with(PreemptionMode::Swap);
    let mut bt = Batcher::new(cfg, pool(4)).unwrap();
    let mut fin = Vec::new();
    bt.add(req(0, vec![1; 4], 8)).unwrap();
    bt.add(req(1, vec![2; 3], 8)).unwrap();
    let n = bt.schedule_into(&mut fin).num_samples();
    bt.commit(&vec![5; n], &mut fin).unwrap();
    // Both swapped out in one step, then both swapped back in.
    bt.request_shed(2);
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.swap_out.len(), 2);
    bt.commit(&[], &mut fin).unwrap();
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.swap_in.len(), 2);
    bt.commit(&[], &mut fin).unwrap();
    // Both decode into a second page (4 pages for 2 + 2), then 0 needs a third page while 1
    // still writes into its second: the younger (1) must give way.
    let mut steps = 0;
    while bt.phase(0) == Some(SeqPhase::Decoding) && bt.phase(1) == Some(SeqPhase::Decoding) {
        let n = bt.schedule_into(&mut fin).num_samples();
        bt.commit(&vec![5; n], &mut fin).unwrap();
        steps += 1;
        assert!(steps < 20);
    }
    assert_eq!(bt.phase(0), Some(SeqPhase::Decoding), "{:?}", bt.stats());
    assert_eq!(bt.phase(1), Some(SeqPhase::Swapped));
}

/// Swapped sequences come back oldest first: two swapped out in one step (the younger first)
/// with room for one of them brought the younger back, and the older waited behind it.
#[test]
fn the_oldest_swapped_sequence_comes_back_first() {
    let cfg = config_with(PreemptionMode::Swap);
    let p = pool(4);
    let mut bt = Batcher::new(cfg, p.clone()).unwrap();
    let mut fin = Vec::new();
    bt.add(req(0, vec![1; 8], 2)).unwrap();
    bt.add(req(1, vec![2; 8], 2)).unwrap();
    // Both prefill: two pages each.
    let mut b0 = bt.schedule_into(&mut fin).clone();
    assert_eq!(b0.num_seqs(), 2);
    bt.commit(&vec![5; b0.num_samples()], &mut fin).unwrap();
    assert!(fin.is_empty());
    bt.request_shed(4);
    b0 = bt.schedule_into(&mut fin).clone();
    assert_eq!(b0.swap_out.len(), 4);
    bt.commit(&[], &mut fin).unwrap();
    // Another engine takes two pages: one sequence fits back.
    let mut other = Vec::new();
    p.alloc_n(EngineId(1), 2, &mut other).unwrap();
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.swap_in.len(), 2);
    bt.commit(&[], &mut fin).unwrap();
    assert_eq!(bt.phase(1), Some(SeqPhase::Swapped));
    assert_ne!(bt.phase(0), Some(SeqPhase::Swapped));
    p.free_n(&other).unwrap();
}

/// Through the coordinator link alone: engine A (weight 1) has a quota of 16 of 64 blocks, and
/// B (weight 3) is active, so A's limit is its quota even while B holds nothing. A request of
/// 20 blocks was accepted and preempted by recompute at every try, for as long as B stayed
/// active (never finishing, never refused); it is refused now, with the quota as the limit.
/// A request added before A's registration was published (no quota known yet) is accepted,
/// and ended with `FinishReason::TooLong` at the first step that knows the quota.
#[test]
fn a_request_longer_than_the_engines_quota_is_refused_through_the_coordinator() {
    use pagedkv::budget::{BudgetConfig, BudgetCoordinator};
    use pagedkv::sched::EngineShare;
    let c = Arc::new(BudgetCoordinator::new(BudgetConfig::new(2, 64, 64)).unwrap());
    let a = c.register(1).unwrap();
    // Before any publication: nothing is known of A's share, so nothing is refused on it.
    let mut bt = Batcher::new(config(), pool(64)).unwrap();
    bt.attach_budget(Box::new(EngineShare::new(c.clone(), a)));
    bt.add(req(1, vec![7; 60], 21)).unwrap();
    let b = c.register(3).unwrap();
    EngineShare::new(c.clone(), b).set_active(true);
    bt.sync_activity();
    c.recompute();
    assert_eq!((c.block_quota(a), c.block_limit(a)), (16, 16));
    // 60 + 21 - 1 = 80 tokens: 20 blocks of 4.
    match bt.add(req(2, vec![7; 60], 21)) {
        Err(SchedError::TooLong { blocks, limit, .. }) => assert_eq!((blocks, limit), (20, 16)),
        Ok(()) => {
            let mut done = Vec::new();
            for _ in 0..300 {
                let n = bt.schedule_into(&mut done).num_samples();
                bt.commit(&vec![9; n], &mut done).unwrap();
                c.maybe_recompute();
            }
            panic!(
                "a 20-block request on a 16-block quota was accepted; after 300 steps ended: \
                 {:?}, {} recompute preemptions",
                done.iter().map(|f| f.id).collect::<Vec<_>>(),
                bt.stats().preempted_recompute
            );
        }
        Err(e) => panic!("{e}"),
    }
    // Within the quota (16 blocks) it finishes; the early one ends with TooLong at once.
    bt.add(req(3, vec![7; 60], 5)).unwrap();
    let mut done = Vec::new();
    for step in 0..300 {
        if !bt.has_work() {
            break;
        }
        let n = bt.schedule_into(&mut done).num_samples();
        if step == 0 {
            assert_eq!(
                done.iter().map(|f| (f.id, f.reason)).collect::<Vec<_>>(),
                vec![(1, FinishReason::TooLong)]
            );
        }
        bt.commit(&vec![9; n], &mut done).unwrap();
        c.maybe_recompute();
    }
    let ended: HashMap<u64, FinishReason> = done.iter().map(|f| (f.id, f.reason)).collect();
    assert_eq!(
        ended,
        HashMap::from([(1, FinishReason::TooLong), (3, FinishReason::MaxTokens)]),
        "after 300 steps ({} recompute preemptions)",
        bt.stats().preempted_recompute
    );
    assert_eq!(bt.stats().aborted, 1);
    drop(bt);
    assert_eq!(c.blocks_in_use(), 0);
}

/// A request accepted while the guarantee was up (another engine had just left) is checked
/// again when it drops back before the next step: the batcher had last seen the lower figure,
/// so a drop back to it looked like no change.
#[test]
fn a_request_accepted_during_a_passing_rise_of_the_quota_is_ended_when_it_falls() {
    use pagedkv::budget::{BudgetConfig, BudgetCoordinator};
    use pagedkv::sched::EngineShare;
    let c = Arc::new(BudgetCoordinator::new(BudgetConfig::new(3, 64, 64)).unwrap());
    let a = c.register(1).unwrap();
    let b = c.register(1).unwrap();
    let third = c.register(2).unwrap();
    // The others have work (so lend nothing) throughout.
    c.set_active(b, true);
    c.set_active(third, true);
    c.recompute();
    assert_eq!(c.block_quota(a), 16);
    let mut bt = Batcher::new(config(), pool(64)).unwrap();
    bt.attach_budget(Box::new(EngineShare::new(c.clone(), a)));
    bt.add(req(1, vec![7; 8], 4)).unwrap();
    let mut done = Vec::new();
    let n = bt.schedule_into(&mut done).num_samples();
    bt.commit(&vec![9; n], &mut done).unwrap();
    // The third engine leaves: A's quota is 32, and a 24-block request (96 tokens) fits.
    c.deregister(third).unwrap();
    c.recompute();
    assert_eq!(c.block_quota(a), 32);
    bt.add(req(2, vec![7; 90], 7)).unwrap();
    // It comes back before A's next step.
    let third = c.register(2).unwrap();
    c.set_active(third, true);
    c.recompute();
    assert_eq!((c.block_quota(a), c.block_limit(a)), (16, 16));
    for _ in 0..300 {
        if !bt.has_work() {
            break;
        }
        let n = bt.schedule_into(&mut done).num_samples();
        bt.commit(&vec![9; n], &mut done).unwrap();
    }
    let ended: HashMap<u64, FinishReason> = done.iter().map(|f| (f.id, f.reason)).collect();
    assert_eq!(
        ended,
        HashMap::from([(1, FinishReason::MaxTokens), (2, FinishReason::TooLong)]),
        "{} recompute preemptions",
        bt.stats().preempted_recompute
    );
    drop(bt);
    assert_eq!(c.blocks_in_use(), 0);
}

/// A sequence swapped out part-way through recomputing its generated tokens (preempted by
/// recompute before, for want of host slots) comes back still recomputing: swap-in judged by
/// the prompt alone marked it decoding, so the API reported a phase it was not in and its
/// one-token recompute rows (under a tight token budget) went out as decode rows.
#[test]
fn a_sequence_swapped_mid_recompute_comes_back_prefilling() {
    let mut cfg = config();
    cfg.preemption = PreemptionMode::Swap;
    cfg.swap_blocks = 2;
    cfg.max_prefill_chunk = 4;
    let mut bt = Batcher::new(cfg, pool(16)).unwrap();
    let mut fin = Vec::new();
    bt.add(req(1, vec![3; 8], 10)).unwrap();
    // Prefill in two chunks, then decode until 12 tokens (3 pages).
    for _ in 0..5 {
        step(&mut bt, &mut fin);
    }
    assert_eq!(bt.blocks_of(1), Some(3));
    assert_eq!(bt.phase(1), Some(SeqPhase::Decoding));
    // Three pages, two host slots: preempted by recompute.
    bt.request_shed(100);
    step(&mut bt, &mut fin);
    assert_eq!(bt.phase(1), Some(SeqPhase::Waiting));
    // Readmitted: two chunks of 4 recompute the prompt; 4 generated tokens remain.
    step(&mut bt, &mut fin);
    step(&mut bt, &mut fin);
    assert_eq!(bt.phase(1), Some(SeqPhase::Prefilling));
    // Two pages now: swapped out, then back in.
    bt.request_shed(100);
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.swap_out.len(), 2);
    bt.commit(&[], &mut fin).unwrap();
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.swap_in.len(), 2);
    bt.commit(&[], &mut fin).unwrap();
    assert_eq!(bt.phase(1), Some(SeqPhase::Prefilling));
    let b = bt.schedule_into(&mut fin);
    assert_eq!(
        b.num_tokens(),
        4,
        "the 4 generated tokens recomputed in one chunk"
    );
    assert_eq!(b.num_samples(), 1);
    assert!(fin.is_empty());
}

/// A shed request counts the pages a preemption frees, not the pages its table lists: a fork
/// shares its parent's pages, so preempting it alone frees none, and the engine stayed over
/// the pages it was asked to give back.
#[test]
fn shedding_counts_the_pages_actually_freed() {
    let p = pool(16);
    let mut bt = Batcher::new(config(), p.clone()).unwrap();
    let mut fin = Vec::new();
    bt.add(req(1, (1..=8).collect(), 6)).unwrap();
    step(&mut bt, &mut fin); // 2 pages, 9 tokens
    bt.fork(1, 2).unwrap(); // shares both
    assert_eq!(p.free_count(), 14);
    bt.request_shed(2);
    let n = bt.schedule_into(&mut fin).num_samples();
    assert_eq!(n, 0, "both preempted");
    assert_eq!(p.free_count(), 16, "the two pages asked for are free");
    bt.commit(&[], &mut fin).unwrap();
    fin.extend(drive(&mut bt, 100));
    assert_eq!(fin.len(), 2);
}

/// A second prefix cache is refused while the first is attached: the budget's count of pages
/// leaving it (`page_leaves`) asks only the attached cache whether a page is cached, so pages a
/// running sequence held in the first cache never left the budget when the sequence ended
/// (here 2 of the quota's blocks, for good), and the first cache kept this engine's pages
/// past its drop.
#[test]
fn replacing_the_prefix_cache_leaks_no_budget() {
    let p = pool(16);
    let (budget, used) = quota(512, 16);
    let mut bt = Batcher::new(config(), p.clone()).unwrap();
    bt.attach_budget(Box::new(budget));
    let first = Arc::new(PrefixCache::new(p.clone(), PrefixConfig { seed: Some(3) }));
    bt.attach_prefix_cache(first.clone()).unwrap();
    bt.add(req(1, (1..=8).collect(), 4)).unwrap();
    let mut fin = Vec::new();
    step(&mut bt, &mut fin); // the prompt's two full blocks are cached in `first`
    assert_eq!(first.cached(EngineId(0)), 2);
    bt.attach_prefix_cache(first.clone()).unwrap(); // the same cache again: a no-op
    let second = Arc::new(PrefixCache::new(p.clone(), PrefixConfig { seed: Some(3) }));
    assert!(matches!(
        bt.attach_prefix_cache(second),
        Err(SchedError::InvalidConfig(_))
    ));
    fin.extend(drive(&mut bt, 50));
    assert_eq!(fin.len(), 1);
    assert_eq!(
        used.load(Ordering::Relaxed),
        0,
        "the engine's budget still counts pages it no longer holds"
    );
    drop(bt);
    assert_eq!(
        first.cached(EngineId(0)),
        0,
        "the dropped engine's pages stay cached"
    );
}

/// A block budget whose limit the test lowers (a coordinator's reclaim order: a lender became
/// active), and whose holdings it reads.
struct Lowered {
    limit: Arc<AtomicU32>,
    used: Arc<AtomicU32>,
}

impl EngineBudget for Lowered {
    fn token_budget(&self) -> u32 {
        u32::MAX
    }
    fn try_acquire_blocks(&self, n: u32) -> bool {
        let used = self.used.load(Ordering::Relaxed);
        if used + n > self.limit.load(Ordering::Relaxed) {
            return false;
        }
        self.used.store(used + n, Ordering::Relaxed);
        true
    }
    fn release_blocks(&self, n: u32) {
        let prev = self.used.fetch_sub(n, Ordering::Relaxed);
        assert!(prev >= n, "budget released below zero");
    }
    fn set_active(&self, _: bool) {}
}

/// Pages shed on a reclaim order leave the engine, whatever the preemption mode: under swap
/// preemption the victims' pages wait for their swap-out until the batch has run, and a
/// running sequence of the same step took one of them for its next token without asking the
/// budget, so the engine stayed over the limit the order was about (recompute preemption
/// asks the budget for that page, which refuses it).
#[test]
fn pages_shed_by_swapping_out_are_not_taken_back_in_the_same_step() {
    for preemption in [PreemptionMode::Recompute, PreemptionMode::Swap] {
        let p = pool(32);
        let limit = Arc::new(AtomicU32::new(32));
        let used = Arc::new(AtomicU32::new(0));
        let mut bt = Batcher::new(
            BatcherConfig {
                preemption,
                swap_blocks: 16,
                ..config()
            },
            p.clone(),
        )
        .unwrap();
        bt.attach_budget(Box::new(Lowered {
            limit: limit.clone(),
            used: used.clone(),
        }));
        // Two sequences of 8 prompt tokens (2 pages each): their next token needs a third.
        bt.add(req(1, vec![1; 8], 10)).unwrap();
        bt.add(req(2, vec![2; 8], 10)).unwrap();
        let mut fin = Vec::new();
        step(&mut bt, &mut fin);
        assert_eq!(used.load(Ordering::Relaxed), 4);
        // The order: 2 pages back (the limit drops to 2).
        limit.store(2, Ordering::Relaxed);
        bt.request_shed(2);
        let n = bt.schedule_into(&mut fin).num_samples();
        bt.commit(&vec![1000; n], &mut fin).unwrap();
        assert!(
            used.load(Ordering::Relaxed) <= 2,
            "{preemption:?}: {} pages held after shedding down to a limit of 2",
            used.load(Ordering::Relaxed)
        );
        assert_eq!(32 - p.free_count(), used.load(Ordering::Relaxed));
        limit.store(32, Ordering::Relaxed);
        fin.extend(drive(&mut bt, 200));
        assert_eq!(fin.len(), 2);
        assert_eq!(p.free_count(), 32);
        assert_eq!(used.load(Ordering::Relaxed), 0);
    }
}

/// Sequences a discarded batch preempts by recompute wait oldest first, as a step's own
/// preemptions leave them (first come first served within a class): the discard queued each
/// at the front in turn, so the youngest came back first.
#[test]
fn sequences_a_discarded_batch_recomputes_come_back_oldest_first() {
    let cfg = config_with(PreemptionMode::Swap);
    let p = pool(16);
    let mut bt = Batcher::new(cfg, p.clone()).unwrap();
    let mut fin = Vec::new();
    for id in 0..3 {
        bt.add(req(id, vec![1 + id as u32; 6], 8)).unwrap();
    }
    step(&mut bt, &mut fin);
    bt.request_shed(100);
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.swap_out.len(), 6, "all three are swapped out");
    // Discarded before it ran: all three are recomputed.
    let ids = bt.schedule_into(&mut fin).seq_ids.clone();
    assert_eq!(
        ids,
        vec![0, 1, 2],
        "recomputed sequences admitted youngest first"
    );
    let n = bt.batch().num_samples();
    bt.commit(&vec![1000; n], &mut fin).unwrap();
    fin.extend(drive(&mut bt, 100));
    assert_eq!(fin.len(), 3);
    assert_eq!(p.free_count(), 16);
}

/// An old model's engine caches a prompt and a router's `lookup` holds its pages; the engine
/// leaves, and another model registers on the same id (same block size, same tokens). The
/// router lets go of its pages before the new engine attaches the cache, or only after the new
/// engine has scheduled. Either way the new model finds none of the old model's KV: it
/// computes its whole prompt.
fn engine_id_reused_beside_a_router(router_lets_go_first: bool) {
    let p = pool(16);
    let cache = Arc::new(PrefixCache::new(p.clone(), PrefixConfig { seed: Some(5) }));
    let prompt: Vec<u32> = (1..=9).collect();
    let mut old = Batcher::new(config(), p.clone()).unwrap();
    old.attach_prefix_cache(cache.clone()).unwrap();
    old.add(req(1, prompt.clone(), 2)).unwrap();
    assert_eq!(drive(&mut old, 50).len(), 1);
    let key = PrefixKey {
        engine: EngineId(0),
        adapter: 0,
        salt: 0,
        block_tokens: BS,
    };
    let mut held = Vec::new();
    assert_eq!(cache.lookup(&key, &prompt, &mut held).unwrap().blocks, 2);
    drop(old);
    if router_lets_go_first {
        for id in held.drain(..) {
            p.release(id).unwrap();
        }
    }
    let mut new = Batcher::new(config(), p.clone()).unwrap();
    new.attach_prefix_cache(cache.clone()).unwrap();
    assert_eq!(
        cache.cached(EngineId(0)),
        0,
        "the old model's pages are still cached"
    );
    new.add(req(2, prompt.clone(), 2)).unwrap();
    let mut fin = Vec::new();
    let n = new.schedule_into(&mut fin).num_tokens();
    assert_eq!(n, prompt.len(), "the new model computes its whole prompt");
    // The router's references outlive the cache's: the pages go when it lets go.
    for id in held {
        p.release(id).unwrap();
    }
    drop(new);
    assert_eq!(p.free_count(), 16);
}

/// The router let go before the new engine attached: the old engine's drop could not uncache
/// those pages (they were held then), so the attach must. (They stayed cached under the id, and
/// the new model's first request was served the old model's KV.)
#[test]
fn an_engine_id_registered_again_finds_none_of_the_old_models_kv() {
    engine_id_reused_beside_a_router(true);
}

/// The router still holds the old pages when the new engine attaches and looks its first
/// prompt up. (Both the old engine's drop and the attach uncached only pages no one else held,
/// so the router's reference kept them cached under the id.)
#[test]
fn an_engine_id_registered_again_ignores_old_pages_a_holder_still_holds() {
    engine_id_reused_beside_a_router(false);
}

/// Swap slots past `MAX_BLOCKS` are refused: no host swap space holds more (`SwapSpace`, the
/// raw backend's, the pinned one all refuse them), and the batcher listed every slot up front,
/// 4 bytes each: `swap_blocks: u32::MAX` (a caller's "unlimited") allocated 16 GiB in `new`.
#[test]
fn swap_blocks_past_max_blocks_are_refused() {
    use pagedkv::block::MAX_BLOCKS;
    let mut cfg = config();
    cfg.preemption = PreemptionMode::Swap;
    cfg.swap_blocks = MAX_BLOCKS;
    assert!(Batcher::new(cfg, pool(16)).is_ok());
    for swap_blocks in [MAX_BLOCKS + 1, u32::MAX] {
        cfg.swap_blocks = swap_blocks;
        // Under recompute too: the slots were listed whatever the mode.
        for preemption in [PreemptionMode::Swap, PreemptionMode::Recompute] {
            cfg.preemption = preemption;
            assert!(
                matches!(
                    Batcher::new(cfg, pool(16)),
                    Err(SchedError::InvalidConfig(_))
                ),
                "swap_blocks {swap_blocks} ({preemption:?}) accepted"
            );
        }
    }
}

/// A prefill chunk short of pages runs shorter before anyone is preempted: the older
/// sequence's 12-token chunk needed 3 pages with 2 free, and preempting the younger decoding
/// one (by recompute: its whole context again) to make room cost more than prefilling 8 tokens.
#[test]
fn a_prefill_chunk_short_of_pages_shrinks_before_preempting_a_decoding_sequence() {
    let mut cfg = config();
    cfg.max_prefill_chunk = 16;
    let p = pool(7);
    let mut bt = Batcher::new(cfg, p.clone()).unwrap();
    let mut fin = Vec::new();
    bt.add(req(0, vec![1; 28], 1)).unwrap();
    bt.add(req(1, vec![2; 2], 2)).unwrap();
    // Step 1: 16 tokens of 0 (4 pages) and 1's prompt (1 page): 2 pages left.
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.query_start_loc, [0, 16, 18]);
    let n = b.num_samples();
    bt.commit(&vec![5; n], &mut fin).unwrap();
    // Step 2: 0's next 12 tokens need 3 pages: it prefills the 8 that 2 pages hold, and 1
    // decodes in the page it has.
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.seq_ids, [0, 1]);
    assert_eq!(b.query_start_loc, [0, 8, 9]);
    let n = b.num_samples();
    bt.commit(&vec![5; n], &mut fin).unwrap();
    let done = drive(&mut bt, 100);
    fin.extend(done);
    assert_eq!(fin.len(), 2);
    assert_eq!(bt.stats().preempted_recompute, 0, "{:?}", bt.stats());
    assert_eq!(p.free_count(), 7);
}

/// A batch counts positions and context lengths in `i32` (as the kernels do): a request whose
/// context would reach 2^31 tokens is refused at `add`, not scheduled until its positions wrap.
#[test]
fn a_request_past_i32_positions_is_refused() {
    let mut cfg = config();
    cfg.block_size = 1 << 12;
    cfg.max_blocks_per_seq = 1 << 19;
    let mut bt = Batcher::new(cfg, pool(1 << 19)).unwrap();
    // 1 + 2^31 - 1 = 2^31 cached tokens at most: 2^19 pages of 4096, within every page limit.
    let r = bt.add(req(0, vec![1], 1 << 31));
    assert!(
        matches!(r, Err(SchedError::TooLong { .. })),
        "a context of 2^31 tokens accepted: {r:?}"
    );
    // The limit is whole pages below 2^31 tokens: 2^19 - 1 pages fit.
    bt.add(req(1, vec![1], (1 << 31) - 4096)).unwrap();
}

/// A prefill chunk that the engine's block budget (not the pool) refuses runs shorter too,
/// also when the pool's free list is empty because the prefix cache holds every other page
/// (its steady state): the refused allocation never reached the cache's eviction, so the
/// pool's free count said nothing about what a shorter chunk could get, and the younger
/// decoding sequence was recomputed from scratch for the older one's full chunk.
#[test]
fn a_prefill_chunk_the_budget_refuses_shrinks_while_the_cache_holds_the_free_pages() {
    let mut cfg = config();
    cfg.max_prefill_chunk = 16;
    let p = pool(12);
    let mut bt = Batcher::new(cfg, p.clone()).unwrap();
    let cache = Arc::new(PrefixCache::new(p.clone(), PrefixConfig { seed: Some(3) }));
    bt.attach_prefix_cache(cache.clone()).unwrap();
    let (budget, used) = quota(u32::MAX, 7);
    bt.attach_budget(Box::new(budget));
    let mut fin = Vec::new();
    // Three finished requests of four full pages each: every page of the pool is cached-free.
    for id in 0..3u64 {
        let prompt = (0..16).map(|t| 100 + 16 * id as u32 + t).collect();
        bt.add(req(100 + id, prompt, 1)).unwrap();
        fin.extend(drive(&mut bt, 10));
    }
    assert_eq!(fin.len(), 3);
    assert_eq!(p.free_count(), 0, "the cache holds every page");
    assert_eq!(used.load(Ordering::Relaxed), 0);
    bt.add(req(0, vec![1; 28], 1)).unwrap();
    bt.add(req(1, vec![2; 2], 2)).unwrap();
    // Step 1: 16 tokens of 0 (4 pages) and 1's prompt (1 page): 5 of the quota's 7.
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.query_start_loc, [0, 16, 18]);
    let n = b.num_samples();
    bt.commit(&vec![5; n], &mut fin).unwrap();
    assert_eq!(used.load(Ordering::Relaxed), 5);
    // Step 2: 0's next 12 tokens need 3 pages, the quota has 2: it prefills fewer, and 1
    // decodes in the page it has (and ends: both always fit the quota together).
    let ids = bt.schedule_into(&mut fin).seq_ids.clone();
    assert_eq!(ids, [0, 1], "{:?}", bt.stats());
    let n = bt.batch().num_samples();
    bt.commit(&vec![5; n], &mut fin).unwrap();
    fin.extend(drive(&mut bt, 100));
    assert_eq!(fin.len(), 5);
    assert_eq!(bt.stats().preempted_recompute, 0, "{:?}", bt.stats());
    assert_eq!(used.load(Ordering::Relaxed), 0);
}

/// A prefill chunk short of pages runs shorter with the pages this step's swap-outs gave up
/// too (this engine reuses them before asking the pool): counted only the pool's free list
/// (empty), the older throughput sequence found no shorter chunk, had the younger decoding one
/// swapped out, then itself, where the pages on hand held half its chunk.
#[test]
fn a_prefill_chunk_short_of_pages_shrinks_to_the_pages_swap_outs_gave_up() {
    let mut cfg = config();
    cfg.max_prefill_chunk = 16;
    cfg.preemption = PreemptionMode::Swap;
    cfg.swap_blocks = 16;
    let p = pool(12);
    let mut bt = Batcher::new(cfg, p.clone()).unwrap();
    let mut fin = Vec::new();
    let mut lc = req(0, vec![1; 4], 4);
    lc.priority = Priority::LatencyCritical;
    bt.add(lc).unwrap();
    bt.add(req(1, vec![2; 32], 1)).unwrap();
    bt.add(req(2, vec![3; 2], 2)).unwrap();
    bt.add(req(3, vec![4; 12], 8)).unwrap();
    // Step 1: 0's prompt (1 page), 16 tokens of 1 (4 pages), 2's prompt (1), 3's (3): 9 pages.
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.query_start_loc, [0, 4, 20, 22, 34]);
    let n = b.num_samples();
    bt.commit(&vec![5; n], &mut fin).unwrap();
    // Another engine takes the 3 pages left.
    let mut other = Vec::new();
    p.alloc_n(EngineId(1), 3, &mut other).unwrap();
    // Step 2: 0 decodes into a new page: 3 (the youngest throughput one) is swapped out for it
    // and 0 reuses one of its 3 pages. 1's next 16 tokens need 4 pages, 2 are on hand: it
    // prefills 8 of them, and 2 decodes in the page it has.
    let ids = bt.schedule_into(&mut fin).seq_ids.clone();
    assert_eq!(bt.phase(3), Some(SeqPhase::Swapped));
    assert_eq!(ids, [0, 1, 2], "{:?}", bt.stats());
    assert_eq!(bt.stats().preempted_swap, 1, "{:?}", bt.stats());
    let n = bt.batch().num_samples();
    bt.commit(&vec![5; n], &mut fin).unwrap();
    p.free_n(&other).unwrap();
    fin.extend(drive(&mut bt, 200));
    assert_eq!(fin.len(), 4);
    assert_eq!(p.free_count(), 12);
}

/// Swap mode with a prefix cache (the simulator's defaults): every completed page of a running
/// sequence is also the cache's, so a swap-out keeps it allocated until the batch has run and
/// gives up only the victim's partial last page. A running sequence short of a page had the
/// youngest (all its pages completed, so none given up) swapped out for nothing, then the next
/// one too; recomputed instead, the youngest gives its pages up at once (cached, free to evict)
/// and the other keeps running.
#[test]
fn a_swap_victim_whose_pages_the_prefix_cache_keeps_is_recomputed_for_a_running_row() {
    let cfg = config_with(PreemptionMode::Swap);
    let p = pool(8);
    let mut bt = Batcher::new(cfg, p.clone()).unwrap();
    let cache = Arc::new(PrefixCache::new(p.clone(), PrefixConfig { seed: Some(3) }));
    bt.attach_prefix_cache(cache.clone()).unwrap();
    let mut fin = Vec::new();
    // 0: 8 tokens (2 completed pages), its next token needs a third page; 1: 9 tokens (2
    // completed pages and a partial one); 2: 12 tokens (3 completed pages). 8 pages in all.
    bt.add(req(0, vec![1; 8], 6)).unwrap();
    bt.add(req(1, vec![2; 9], 6)).unwrap();
    bt.add(req(2, vec![3; 12], 6)).unwrap();
    step(&mut bt, &mut fin);
    assert_eq!(p.free_count(), 0, "the three hold the pool");
    let ids = bt.schedule_into(&mut fin).seq_ids.clone();
    assert_eq!(
        ids,
        [0, 1],
        "a sequence was preempted that did not need to be: {:?}",
        bt.stats()
    );
    assert_eq!(bt.phase(2), Some(SeqPhase::Waiting), "recomputed");
    let s = bt.stats();
    assert_eq!((s.preempted_swap, s.preempted_recompute), (0, 1), "{s:?}");
    commit_scheduled(&mut bt, &mut fin);
    fin.extend(drive(&mut bt, 200));
    assert_eq!(fin.len(), 3);
    assert!(!bt.has_work());
    cache.clear();
    assert_eq!(p.free_count(), 8, "blocks leaked");
}

/// The pages a waiting request's admission takes, as an engine asks other engines to donate
/// them: with a prefix cache, not the cached prefix's pages that a running sequence already
/// holds (attached, they cost nothing), only its first chunk's past them. Counted without the
/// hit, the request asked for its whole prompt's pages. Reading the need changes nothing: no
/// lookup is counted, no reference or budget taken. Cached pages no one holds do count (they
/// come back into the budget).
#[test]
fn the_next_admission_need_leaves_out_cached_pages_a_running_sequence_holds() {
    let p = pool(16);
    let mut bt = Batcher::new(config(), p.clone()).unwrap();
    let cache = Arc::new(PrefixCache::new(p.clone(), PrefixConfig { seed: Some(3) }));
    bt.attach_prefix_cache(cache.clone()).unwrap();
    let (budget, used) = quota(u32::MAX, 16);
    bt.attach_budget(Box::new(budget));
    let mut fin = Vec::new();
    let system: Vec<u32> = (1..=8).collect();
    // 0: the system prompt (2 pages, cached at the commit) and a token (a third page).
    bt.add(req(0, [system.clone(), vec![50]].concat(), 20))
        .unwrap();
    step(&mut bt, &mut fin);
    assert_eq!(used.load(Ordering::Relaxed), 3);
    // 1: the system prompt and 3 tokens: 3 pages, 2 of them cached and held by 0.
    bt.add(req(1, [system.clone(), vec![60, 61, 62]].concat(), 4))
        .unwrap();
    let lookups = cache.metrics(EngineId(0)).lookups;
    let free = p.free_count();
    assert_eq!(
        bt.next_admission_need(),
        Some((Priority::Throughput, 1)),
        "the cached pages 0 holds were counted"
    );
    assert_eq!(
        cache.metrics(EngineId(0)).lookups,
        lookups,
        "a lookup was counted"
    );
    assert_eq!(p.free_count(), free);
    assert_eq!(used.load(Ordering::Relaxed), 3, "budget taken");
    // The admission takes what was said: 0 decodes in the page it has.
    let ids = bt.schedule_into(&mut fin).seq_ids.clone();
    assert_eq!(ids, [0, 1]);
    assert_eq!(used.load(Ordering::Relaxed), 4);
    commit_scheduled(&mut bt, &mut fin);
    fin.extend(drive(&mut bt, 100));
    assert_eq!(fin.len(), 2);
    // Cached pages no one holds come back into the budget: they count.
    bt.add(req(2, [system, vec![70]].concat(), 2)).unwrap();
    assert_eq!(bt.next_admission_need(), Some((Priority::Throughput, 3)));
    fin.extend(drive(&mut bt, 100));
    assert_eq!(fin.len(), 3);
    assert_eq!(used.load(Ordering::Relaxed), 0);
}

/// A batch counts its tokens in `i32` (`query_start_loc`, `logits_indices`): a step budget past
/// `i32::MAX` tokens (a caller's `u32::MAX` "unlimited") would wrap them, so it is refused.
#[test]
fn a_step_budget_past_i32_tokens_is_refused() {
    let mut cfg = config();
    cfg.max_batched_tokens = i32::MAX as u32;
    assert!(Batcher::new(cfg, pool(16)).is_ok());
    for tokens in [i32::MAX as u32 + 1, u32::MAX] {
        cfg.max_batched_tokens = tokens;
        assert!(
            matches!(
                Batcher::new(cfg, pool(16)),
                Err(SchedError::InvalidConfig(_))
            ),
            "max_batched_tokens {tokens} accepted"
        );
    }
}

/// A step that shortened a running prefill chunk for want of pages admits nothing: the quota
/// the halved chunk left went to a younger request, which the older one's next chunk then had
/// to shorten for or preempt (as after a preemption, admitting then would only thrash).
#[test]
fn a_step_that_shortened_a_chunk_for_pages_admits_nothing() {
    let mut cfg = config();
    cfg.max_prefill_chunk = 16;
    let p = pool(64);
    let (budget, used) = quota(512, 7);
    let mut bt = Batcher::new(cfg, p.clone()).unwrap();
    bt.attach_budget(Box::new(budget));
    let mut fin = Vec::new();
    bt.add(req(0, vec![1; 28], 1)).unwrap();
    bt.add(req(2, vec![3; 3], 2)).unwrap();
    // Step 1: 16 tokens of 0 (4 pages) and 2's prompt (1 page): 2 of the 7 left.
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.query_start_loc, [0, 16, 19]);
    let n = b.num_samples();
    bt.commit(&vec![5; n], &mut fin).unwrap();
    bt.add(req(1, vec![2; 3], 1)).unwrap();
    // Step 2: 0's last 12 tokens need 3 pages, the quota has 2: its chunk is shortened, 2
    // decodes in its page, and 1 (one page) is not admitted into what the chunk left.
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.seq_ids, [0, 2], "admitted beside a shortened chunk");
    let n = b.num_samples();
    bt.commit(&vec![5; n], &mut fin).unwrap();
    fin.extend(drive(&mut bt, 100));
    assert_eq!(fin.len(), 3);
    assert_eq!(bt.stats().preempted_recompute, 0, "{:?}", bt.stats());
    assert_eq!(used.load(Ordering::Relaxed), 0);
    assert_eq!(p.free_count(), 64);
}

/// A prompt of whole pages, every one of them cached, attaches all but its last page: its last
/// token is computed (its logits sample the first new token) and no cached page is written.
/// Attached whole, the sequence had nothing to compute and waited for ever.
#[test]
fn a_whole_page_prompt_cached_entirely_attaches_all_but_its_last_page() {
    let (_p, mut bt) = with_prefix(16);
    bt.add(req(1, (1..=8).collect(), 1)).unwrap();
    assert_eq!(drive(&mut bt, 10).len(), 1); // both of its pages are cached
    bt.add(req(2, (1..=8).collect(), 1)).unwrap();
    let fin = drive(&mut bt, 10);
    assert_eq!(
        fin.len(),
        1,
        "the repeated prompt never ran: {:?}",
        bt.stats()
    );
    assert_eq!(bt.stats().prefix_hit_tokens, 4, "{:?}", bt.stats());
}

/// A waiting request is not admitted ahead of a swapped-out sequence that does not fit back
/// yet: the pages it would take are the ones the swapped sequence waits for, and a stream of
/// small requests would keep it out for as long as they came.
#[test]
fn a_waiting_request_is_not_admitted_ahead_of_a_swapped_sequence() {
    let cfg = config_with(PreemptionMode::Swap);
    let p = pool(4);
    let mut bt = Batcher::new(cfg, p.clone()).unwrap();
    let mut fin = Vec::new();
    bt.add(req(0, vec![1; 8], 2)).unwrap();
    let n = bt.schedule_into(&mut fin).num_samples();
    bt.commit(&vec![5; n], &mut fin).unwrap();
    bt.request_shed(2);
    assert_eq!(bt.schedule_into(&mut fin).swap_out.len(), 2);
    bt.commit(&[], &mut fin).unwrap();
    // Another engine takes three pages: 0's two do not fit back, a one-page request would.
    let mut other = Vec::new();
    p.alloc_n(EngineId(1), 3, &mut other).unwrap();
    bt.add(req(1, vec![2; 3], 1)).unwrap();
    let b = bt.schedule_into(&mut fin);
    assert_eq!(
        b.num_seqs(),
        0,
        "admitted ahead of the swapped sequence: {:?}",
        b.seq_ids
    );
    bt.commit(&[], &mut fin).unwrap();
    assert_eq!(bt.phase(1), Some(SeqPhase::Waiting));
    p.free_n(&other).unwrap();
    fin.extend(drive(&mut bt, 20));
    assert_eq!(fin.len(), 2);
}

/// The page a row took for drafts the commit rejects goes back at the commit: a decode token and
/// three drafts reach a second page, the first draft is rejected, and the sequence's KV fits
/// its first page again (the next step takes the second when a token lands there).
#[test]
fn pages_of_rejected_drafts_go_back_at_the_commit() {
    let p = pool(16);
    let mut bt = Batcher::new(config(), p.clone()).unwrap();
    bt.add(req(1, vec![1, 2, 3], 10)).unwrap();
    let mut fin = Vec::new();
    step(&mut bt, &mut fin); // prefilled: one page
    bt.propose(1, &[7, 8, 9]).unwrap(); // positions 3..=6: a second page
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.input_tokens, [1000, 7, 8, 9]);
    assert_eq!(bt.blocks_of(1), Some(2));
    bt.commit(&[5, 5, 5, 5], &mut fin).unwrap(); // 7 rejected: 5 follows 1000
                                                 // Five tokens, four computed (the last is fed next step): one page.
    assert_eq!(
        (bt.blocks_of(1), p.free_count()),
        (Some(1), 15),
        "the rejected drafts' page stayed held"
    );
}

/// Pages an abort gives back count toward a shed ordered for the same step: only the rest is
/// preempted for, here nothing.
#[test]
fn pages_an_abort_gives_back_count_toward_a_shed() {
    let mut bt = Batcher::new(config(), pool(16)).unwrap();
    bt.add(req(1, vec![1; 8], 10)).unwrap();
    bt.add(req(2, vec![2; 8], 10)).unwrap();
    let mut fin = Vec::new();
    step(&mut bt, &mut fin); // two pages each
    bt.abort(1).unwrap();
    bt.request_shed(2);
    step(&mut bt, &mut fin);
    assert_eq!(fin.len(), 1);
    assert_eq!(
        bt.stats().preempted_recompute,
        0,
        "2 was preempted for the pages 1's abort gave back"
    );
}
