//! Scheduler step time: pagedkv's batcher beside a port of the oxillama design (our own
//! re-implementation of its data structures: `Vec::remove(0)` promotion, `contains` membership
//! checks, per-row token `Vec`s, no KV allocation at all) in the same groups.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pagedkv::block::{BlockPool, EngineId, PoolConfig};
use pagedkv::prefix::{PrefixCache, PrefixConfig};
use pagedkv::sched::{Batcher, BatcherConfig, PreemptionMode, Priority, SeqRequest, StopRules};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

const BS: u32 = 16;
/// Steps timed per fresh batcher (sequences grow by this many tokens).
const STEPS: u64 = 256;

/// A batcher with `running` decoding sequences and `prefilling` long prompts; with `cache`, a
/// prefix cache on its pool (each completed block is hashed and cached).
fn batcher(running: usize, prefilling: usize, cache: bool) -> Batcher {
    let blocks_per_seq = 8 + (STEPS as u32 / BS) + 2;
    let pool = Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: running as u32 * blocks_per_seq
                + prefilling as u32 * ((1 << 15) / BS + blocks_per_seq),
            max_engines: 1,
        })
        .unwrap(),
    );
    let prefix = cache.then(|| {
        Arc::new(PrefixCache::new(
            pool.clone(),
            PrefixConfig { seed: Some(1) },
        ))
    });
    let mut b = Batcher::new(
        BatcherConfig {
            engine: EngineId(0),
            block_size: BS,
            max_running: (running + prefilling) as u32,
            max_batched_tokens: 1 << 20,
            max_prefill_chunk: 256,
            max_blocks_per_seq: 4096,
            preemption: PreemptionMode::Recompute,
            swap_blocks: 0,
        },
        pool,
    )
    .unwrap();
    if let Some(prefix) = prefix {
        b.attach_prefix_cache(prefix).unwrap();
    }
    for id in 0..running as u64 {
        b.add(SeqRequest {
            id,
            prompt: vec![1; 100],
            stop: StopRules {
                max_new_tokens: 60_000,
                ..Default::default()
            },
            priority: Priority::Throughput,
        })
        .unwrap();
    }
    // Bring them to decoding, untimed.
    let mut fin = Vec::new();
    let n = b.schedule_into(&mut fin).num_samples();
    b.commit(&vec![2; n], &mut fin).unwrap();
    for id in 0..prefilling as u64 {
        b.add(SeqRequest {
            id: 1_000_000 + id,
            prompt: vec![1; 1 << 15],
            stop: StopRules {
                max_new_tokens: 30_000,
                ..Default::default()
            },
            priority: Priority::Throughput,
        })
        .unwrap();
    }
    b
}

fn time_pagedkv(iters: u64, running: usize, prefilling: usize, cache: bool) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    let mut sampled = vec![3u32; running + prefilling];
    let mut fin = Vec::new();
    while left > 0 {
        let mut b = batcher(running, prefilling, cache);
        let steps = left.min(STEPS);
        let t = Instant::now();
        for _ in 0..steps {
            let batch = b.schedule_into(&mut fin);
            let n = batch.num_samples();
            // Correctness inside the bench: every running sequence is scheduled each step.
            debug_assert!(batch.num_seqs() >= running);
            sampled.resize(n, 3);
            b.commit(&sampled[..n], &mut fin).unwrap();
        }
        total += t.elapsed();
        assert!(fin.is_empty(), "no sequence may finish inside the bench");
        left -= steps;
    }
    total
}

/// The oxillama design, re-implemented here with its data structures and algorithm.
mod oxillama {
    use std::collections::HashMap;

    #[derive(PartialEq, Clone, Copy)]
    pub enum State {
        Prefilling,
        Decoding,
    }
    pub struct Seq {
        pub state: State,
        pub prompt: Vec<u32>,
        pub output: Vec<u32>,
        pub prompt_pos: usize,
        pub max_tokens: usize,
    }
    pub struct Batch {
        pub seq_ids: Vec<u64>,
        pub tokens: Vec<Vec<u32>>,
        pub is_prefill: Vec<bool>,
    }
    impl Batch {
        fn total_tokens(&self) -> usize {
            self.tokens.iter().map(Vec::len).sum()
        }
    }
    pub struct Scheduler {
        pub seqs: HashMap<u64, Seq>,
        pub waiting: Vec<u64>,
        pub active: Vec<u64>,
        pub max_sequences: usize,
        pub max_batch_tokens: usize,
        pub max_prefill: usize,
    }
    impl Scheduler {
        pub fn add(&mut self, id: u64, prompt: Vec<u32>, max_tokens: usize) {
            self.seqs.insert(
                id,
                Seq {
                    state: State::Prefilling,
                    prompt,
                    output: Vec::new(),
                    prompt_pos: 0,
                    max_tokens,
                },
            );
            self.waiting.push(id);
        }
        pub fn schedule(&mut self) -> Batch {
            let mut b = Batch {
                seq_ids: Vec::new(),
                tokens: Vec::new(),
                is_prefill: Vec::new(),
            };
            while !self.waiting.is_empty()
                && self.active.len() < self.max_sequences
                && b.seq_ids.len() < self.max_sequences
            {
                let id = self.waiting.remove(0);
                let s = self.seqs.get_mut(&id).unwrap();
                self.active.push(id);
                let chunk = (s.prompt.len() - s.prompt_pos).min(self.max_prefill);
                let toks = s.prompt[s.prompt_pos..s.prompt_pos + chunk].to_vec();
                s.prompt_pos += chunk;
                if s.prompt_pos >= s.prompt.len() {
                    s.state = State::Decoding;
                }
                b.seq_ids.push(id);
                b.tokens.push(toks);
                b.is_prefill.push(true);
            }
            let snapshot = self.active.clone();
            for &id in &snapshot {
                if b.total_tokens() >= self.max_batch_tokens {
                    break;
                }
                if b.seq_ids.contains(&id) {
                    continue;
                }
                let s = self.seqs.get_mut(&id).unwrap();
                if s.state == State::Prefilling {
                    let budget = self.max_batch_tokens - b.total_tokens();
                    let chunk = (s.prompt.len() - s.prompt_pos)
                        .min(self.max_prefill)
                        .min(budget);
                    if chunk > 0 {
                        let toks = s.prompt[s.prompt_pos..s.prompt_pos + chunk].to_vec();
                        s.prompt_pos += chunk;
                        if s.prompt_pos >= s.prompt.len() {
                            s.state = State::Decoding;
                        }
                        b.seq_ids.push(id);
                        b.tokens.push(toks);
                        b.is_prefill.push(true);
                    }
                }
            }
            for &id in &snapshot {
                if b.seq_ids.len() >= self.max_sequences
                    || b.total_tokens() >= self.max_batch_tokens
                {
                    break;
                }
                let s = &self.seqs[&id];
                if s.state == State::Decoding
                    && s.prompt.len() + s.output.len() < s.max_tokens
                    && !b.seq_ids.contains(&id)
                {
                    let last = s
                        .output
                        .last()
                        .copied()
                        .unwrap_or(*s.prompt.last().unwrap());
                    b.seq_ids.push(id);
                    b.tokens.push(vec![last]);
                    b.is_prefill.push(false);
                }
            }
            let seqs = &self.seqs;
            self.active.retain(|id| {
                seqs.get(id)
                    .is_some_and(|s| s.prompt.len() + s.output.len() < s.max_tokens)
            });
            b
        }
    }
}

fn oxillama_scheduler(running: usize, prefilling: usize) -> oxillama::Scheduler {
    let mut s = oxillama::Scheduler {
        seqs: HashMap::new(),
        waiting: Vec::new(),
        active: Vec::new(),
        max_sequences: running + prefilling,
        max_batch_tokens: 1 << 20,
        max_prefill: 256,
    };
    for id in 0..running as u64 {
        s.add(id, vec![1; 100], 60_000);
    }
    s.schedule();
    for id in 0..prefilling as u64 {
        s.add(1_000_000 + id, vec![1; 1 << 15], (1 << 15) + 1);
    }
    s
}

fn time_oxillama(iters: u64, running: usize, prefilling: usize) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let mut s = oxillama_scheduler(running, prefilling);
        let steps = left.min(STEPS);
        let t = Instant::now();
        for _ in 0..steps {
            let b = s.schedule();
            assert!(b.seq_ids.len() >= running);
            // "Commit": the design appends sampled tokens one call at a time.
            for (i, &id) in b.seq_ids.iter().enumerate() {
                if !b.is_prefill[i] {
                    s.seqs.get_mut(&id).unwrap().output.push(3);
                }
            }
        }
        total += t.elapsed();
        left -= steps;
    }
    total
}

fn decode_steps(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode_step");
    for running in [256usize, 1024] {
        g.throughput(Throughput::Elements(running as u64));
        g.bench_with_input(BenchmarkId::new("pagedkv", running), &running, |b, &r| {
            b.iter_custom(|iters| time_pagedkv(iters, r, 0, false))
        });
        g.bench_with_input(BenchmarkId::new("oxillama", running), &running, |b, &r| {
            b.iter_custom(|iters| time_oxillama(iters, r, 0))
        });
    }
    g.finish();
}

fn mixed_steps(c: &mut Criterion) {
    let mut g = c.benchmark_group("mixed_step");
    // 256 decoding sequences plus 16 long prompts prefilling in chunks of 256.
    g.throughput(Throughput::Elements(256 + 16 * 256));
    g.bench_function("pagedkv/256+16", |b| {
        b.iter_custom(|iters| time_pagedkv(iters, 256, 16, false))
    });
    g.bench_function("oxillama/256+16", |b| {
        b.iter_custom(|iters| time_oxillama(iters, 256, 16))
    });
    g.finish();
}

/// The decode step at 1024 sequences with the prefix cache on (every 16th step of a sequence
/// completes a block, which is hashed and cached) against the same step without it, beside the
/// oxillama baseline, in one group.
fn prefix_cache_steps(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode_step_prefix_cache");
    let running = 1024usize;
    g.throughput(Throughput::Elements(running as u64));
    g.bench_function("pagedkv-cache-off/1024", |b| {
        b.iter_custom(|iters| time_pagedkv(iters, running, 0, false))
    });
    g.bench_function("pagedkv-cache-on/1024", |b| {
        b.iter_custom(|iters| time_pagedkv(iters, running, 0, true))
    });
    g.bench_function("oxillama/1024", |b| {
        b.iter_custom(|iters| time_oxillama(iters, running, 0))
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(3)).sample_size(20);
    targets = decode_steps, mixed_steps, prefix_cache_steps
}
criterion_main!(benches);
