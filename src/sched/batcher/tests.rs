//! Unit tests of the batcher's private storage.

use super::*;
use crate::block::PoolConfig;
use crate::sched::{PreemptionMode, Priority, SeqRequest, StopRules};

/// Sequences made by `fork` reuse free storage slots as `add`'s do: a server doing parallel
/// sampling for ever keeps storage bounded by the sequences alive at once (before, every
/// fork pushed a new slot: 1000 rounds of one request and 3 forks left 3001 slots).
#[test]
fn forked_sequences_reuse_free_slots() {
    let pool = Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: 64,
            max_engines: 1,
        })
        .unwrap(),
    );
    let cfg = BatcherConfig {
        engine: EngineId(0),
        block_size: 4,
        max_running: 8,
        max_batched_tokens: 256,
        max_prefill_chunk: 256,
        max_blocks_per_seq: 16,
        preemption: PreemptionMode::Recompute,
        swap_blocks: 0,
    };
    let mut bt = Batcher::new(cfg, pool.clone()).unwrap();
    let mut fin = Vec::new();
    for round in 0..1000u64 {
        let id = 4 * round;
        bt.add(SeqRequest {
            id,
            prompt: vec![1, 2, 3],
            stop: StopRules {
                max_new_tokens: 3,
                ..Default::default()
            },
            priority: Priority::Throughput,
        })
        .unwrap();
        let mut forked = false;
        while bt.has_work() {
            let n = bt.schedule_into(&mut fin).num_samples();
            bt.commit(&vec![7; n], &mut fin).unwrap();
            if !forked && bt.index.contains_key(&id) {
                for child in 1..4 {
                    bt.fork(id, id + child).unwrap();
                }
                forked = true;
            }
        }
        assert!(forked);
    }
    assert_eq!(fin.len(), 4000);
    assert!(
        bt.seqs.len() <= 8,
        "{} slots for at most 4 live sequences",
        bt.seqs.len()
    );
    assert_eq!(pool.free_count(), 64);
}
