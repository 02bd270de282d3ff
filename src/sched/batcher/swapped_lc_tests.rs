//! Unit tests of a swapped-out latency-critical sequence coming back by preempting throughput
//! work. Through the public API an engine never holds one beside running throughput
//! sequences (every preemption takes a throughput sequence first, and none comes in while
//! one is swapped out), so these put one there directly.

use super::*;
use crate::block::PoolConfig;
use crate::sched::{PreemptionMode, Priority, SeqRequest, StopRules};

fn request(id: SeqId, prompt: usize, priority: Priority) -> SeqRequest {
    SeqRequest {
        id,
        prompt: vec![1; prompt],
        stop: StopRules {
            max_new_tokens: 5,
            ..Default::default()
        },
        priority,
    }
}

/// A batcher running latency-critical sequence 0 (13 tokens: 4 pages) and throughput
/// sequence 1 (`tp_prompt` tokens) on a pool of `pages`, then 0 swapped out (as a
/// preemption with no throughput work running would), its pages back in the pool.
fn lc_swapped_beside_throughput(
    pages: u32,
    swap_blocks: u32,
    tp_prompt: usize,
) -> (Arc<BlockPool>, Batcher) {
    let pool = Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: pages,
            max_engines: 2,
        })
        .unwrap(),
    );
    let cfg = BatcherConfig {
        engine: EngineId(0),
        block_size: 4,
        max_running: 2,
        max_batched_tokens: 256,
        max_prefill_chunk: 256,
        max_blocks_per_seq: 16,
        preemption: PreemptionMode::Swap,
        swap_blocks,
    };
    let mut bt = Batcher::new(cfg, pool.clone()).unwrap();
    bt.add(request(0, 13, Priority::LatencyCritical)).unwrap();
    bt.add(request(1, tp_prompt, Priority::Throughput)).unwrap();
    let mut fin = Vec::new();
    let n = bt.schedule_into(&mut fin).num_samples();
    bt.commit(&vec![7; n], &mut fin).unwrap();
    let lc = bt.index[&0];
    bt.running.retain(|&s| s != lc);
    bt.preempt(lc);
    // The engine would copy the pages out with the next batch; this one has none.
    bt.batch.swap_out.clear();
    bt.release_swapped_pages();
    assert_eq!(bt.phase(0), Some(SeqPhase::Swapped));
    (pool, bt)
}

/// Runs the batcher to the end, checking every sequence finished and the pool is whole.
fn finish(bt: &mut Batcher, pool: &BlockPool, pages: u32, sequences: usize) {
    let mut fin = Vec::new();
    for _ in 0..200 {
        if !bt.has_work() {
            break;
        }
        let n = bt.schedule_into(&mut fin).num_samples();
        bt.commit(&vec![7; n], &mut fin).unwrap();
    }
    assert_eq!(fin.len(), sequences);
    assert_eq!(pool.free_count(), pages);
}

/// Short of pages (another engine holds the rest), the swapped latency-critical sequence
/// comes back at the next step by preempting the throughput sequence holding them: by swap
/// where host slots are left, by recompute where its own swap-out took them all. Before, it
/// waited for the throughput sequence to finish.
#[test]
fn a_swapped_latency_critical_sequence_preempts_throughput_work_for_its_pages() {
    for (swap_blocks, expect) in [(16, SeqPhase::Swapped), (4, SeqPhase::Waiting)] {
        let (pool, mut bt) = lc_swapped_beside_throughput(8, swap_blocks, 13);
        let mut other = Vec::new();
        pool.alloc_n(EngineId(1), pool.free_count(), &mut other)
            .unwrap();
        let mut fin = Vec::new();
        let b = bt.schedule_into(&mut fin);
        assert_eq!(b.swap_in.len(), 4, "{swap_blocks}: 0 came back");
        assert_eq!(bt.phase(0), Some(SeqPhase::Decoding), "{swap_blocks}");
        assert_eq!(bt.phase(1), Some(expect), "{swap_blocks}: 1 gave its pages");
        let n = bt.batch().num_samples();
        bt.commit(&vec![7; n], &mut fin).unwrap();
        pool.free_n(&other).unwrap();
        finish(&mut bt, &pool, 8, 2);
    }
}

/// With every running slot taken by throughput work (pages to spare), the swapped
/// latency-critical sequence takes the slot of the latest throughput sequence.
#[test]
fn a_swapped_latency_critical_sequence_preempts_throughput_work_for_a_slot() {
    let (pool, mut bt) = lc_swapped_beside_throughput(32, 16, 5);
    bt.fork(1, 2).unwrap(); // both slots held by throughput sequences
    let mut fin = Vec::new();
    let b = bt.schedule_into(&mut fin);
    assert_eq!(b.swap_in.len(), 4, "0 came back");
    assert_eq!(b.seq_ids, [1], "1 decodes; 2 gave its slot");
    // 2's swap-out does not write the host slots 0's swap-in reads: an executor runs a batch's
    // swap-outs first, which would overwrite 0's KV before it is read back.
    assert!(
        b.swap_out
            .iter()
            .all(|&(_, h)| b.swap_in.iter().all(|&(r, _)| r != h)),
        "a host slot read and written in one batch: in {:?}, out {:?}",
        b.swap_in,
        b.swap_out
    );
    assert_eq!(bt.phase(0), Some(SeqPhase::Decoding));
    assert_eq!(bt.phase(2), Some(SeqPhase::Swapped));
    assert_eq!(bt.num_running(), 2);
    let n = bt.batch().num_samples();
    bt.commit(&vec![7; n], &mut fin).unwrap();
    finish(&mut bt, &pool, 32, 3);
}

/// Where the throughput sequence's pages would not cover the swapped sequence's, nothing is
/// preempted: it stays swapped out (and a waiting latency-critical request behind it waits).
#[test]
fn a_swapped_latency_critical_sequence_preempts_nothing_that_would_not_bring_it_back() {
    let (pool, mut bt) = lc_swapped_beside_throughput(8, 16, 5); // 1 holds 2 pages
    let mut other = Vec::new();
    pool.alloc_n(EngineId(1), pool.free_count(), &mut other)
        .unwrap();
    let mut fin = Vec::new();
    let b = bt.schedule_into(&mut fin);
    assert!(b.swap_in.is_empty());
    assert_eq!(b.seq_ids, [1]);
    assert_eq!(bt.phase(0), Some(SeqPhase::Swapped));
    assert_eq!(bt.stats().preempted_swap, 1, "only 0's own swap-out");
    let n = bt.batch().num_samples();
    bt.commit(&vec![7; n], &mut fin).unwrap();
    pool.free_n(&other).unwrap();
    finish(&mut bt, &pool, 8, 2);
}
