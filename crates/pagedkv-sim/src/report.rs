//! The report of a simulation: deterministic figures (simulated time; the same seed gives the
//! same report on any machine) and, apart, wall-clock figures of this machine.

use serde::Serialize;

/// Latency percentiles in simulated milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Latency {
    /// Samples.
    pub count: usize,
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
}

impl Latency {
    /// Percentiles of `samples` (nearest rank); all zero, with `count` 0, for no sample (the
    /// text report prints "-" then).
    pub fn of(samples: &[f64]) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        let mut v = samples.to_vec();
        v.sort_by(f64::total_cmp);
        let rank = |p: f64| v[(((p * v.len() as f64).ceil() as usize).max(1) - 1).min(v.len() - 1)];
        Self {
            count: v.len(),
            p50_ms: rank(0.50),
            p99_ms: rank(0.99),
        }
    }
}

/// Per class latencies of one engine.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ClassLatency {
    /// Time to first token.
    pub ttft: Latency,
    /// Inter-token latency.
    pub itl: Latency,
}

/// Why requests did not finish.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Refusals {
    /// Refused at submit: the admission queue was full (drop-newest).
    pub queue_full: u64,
    /// Evicted from a full queue by a newer request (drop-oldest).
    pub evicted: u64,
    /// Refused by the engine: could never fit a sequence's table, the pool, or its engine's
    /// guaranteed share of the pool.
    pub too_long: u64,
    /// Still unfinished when the run's step limit was reached.
    pub timed_out: u64,
}

/// One engine's figures.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct EngineReport {
    /// Name.
    pub name: String,
    /// Share weight.
    pub weight: u32,
    /// Weight over the sum of weights.
    pub weight_share: f64,
    /// Geometry, for the record: layers, heads, KV heads, head dim.
    pub geometry: [usize; 4],
    /// Requests generated for it.
    pub requests: u64,
    /// Requests finished.
    pub finished: u64,
    /// Requests refused, by reason.
    pub refused: Refusals,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Tokens scheduled (prefill, decode, recomputation).
    pub scheduled_tokens: u64,
    /// Generated tokens per simulated second.
    pub tokens_per_s: f64,
    /// Share of all scheduled tokens, over the whole run.
    pub token_share: f64,
    /// Share of all scheduled tokens in ticks where every engine had a backlog.
    pub saturated_token_share: f64,
    /// Latency-critical class.
    pub latency_critical: ClassLatency,
    /// Throughput class.
    pub throughput: ClassLatency,
    /// Preemptions by recompute.
    pub preempted_recompute: u64,
    /// Preemptions by swap.
    pub preempted_swap: u64,
    /// Blocks swapped out / in.
    pub blocks_swapped: [u64; 2],
    /// Blocks this engine gave back on reclaim orders or donations.
    pub blocks_shed: u64,
    /// Donations it asked of lower-priority engines.
    pub donations_asked: u64,
    /// Most blocks its budget held at a tick's end: the pages its sequences hold (not those
    /// only the prefix cache keeps, see `peak_cached_blocks`).
    pub peak_blocks: u32,
    /// Most pages it owned in the pool at a tick's end beyond what its budget held: its
    /// cached-free pages, kept only by the prefix cache (evictable, lendable to no one else
    /// until evicted).
    pub peak_cached_blocks: u32,
    /// Most blocks it held above its quota (borrowed) at a tick's end.
    pub peak_borrowed: u64,
    /// The fraction of its scheduled tokens above its token share of their step: borrowed from
    /// idle engines or from what active engines' published demand left of theirs.
    pub tokens_above_share: f64,
    /// KV bytes its attention read.
    pub kv_bytes_read: u64,
    /// Tokens per page of its view of the arena.
    pub tokens_per_page: u32,
    /// Bytes of each page its blocks leave unused (page size minus its block size).
    pub wasted_bytes_per_page: u64,
    /// KV bytes it allocated beyond the shared arena (0 on the CPU path: its cache is a view).
    pub kv_bytes_allocated: u64,
    /// Reclaim latency as a lender: steps from this engine's demand for pages of its share lent
    /// to others (its next admission fits its limit, not the pool's free pages, or a running
    /// row waited for them) to enough of them being free.
    pub reclaim_steps: StepLatency,
    /// Prompt tokens found in the prefix cache / prompt tokens, over first admissions (0
    /// without a prefix cache).
    pub prefix_hit_rate: f64,
    /// Tokens attached from the prefix cache on any admission (re-admissions after a
    /// preemption included): prefill computation saved.
    pub prefix_reused_tokens: u64,
    /// Time to first token over all of this engine's requests that got one, median (0 when
    /// none did: the class counts tell; the text report prints "-").
    pub ttft_p50_ms: f64,
}

/// A distribution of step counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StepLatency {
    /// Episodes measured.
    pub count: usize,
    /// Median, steps.
    pub p50: u64,
    /// 99th percentile, steps.
    pub p99: u64,
    /// Longest, steps.
    pub max: u64,
}

impl StepLatency {
    /// Percentiles of `samples` (nearest rank).
    pub fn of(samples: &[u64]) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        let mut v = samples.to_vec();
        v.sort_unstable();
        let rank = |p: f64| v[(((p * v.len() as f64).ceil() as usize).max(1) - 1).min(v.len() - 1)];
        Self {
            count: v.len(),
            p50: rank(0.50),
            p99: rank(0.99),
            max: v[v.len() - 1],
        }
    }
}

/// KV and budget state at one tick.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TimelinePoint {
    /// Simulated time, seconds.
    pub t_s: f64,
    /// Blocks in use in the pool.
    pub used_blocks: u32,
    /// Pages each engine owns in the pool: those its sequences hold and its pages only the
    /// prefix cache keeps (the chart stacks these up to `used_blocks`).
    pub held: Vec<u32>,
    /// Token budget per engine.
    pub token_budget: Vec<u32>,
}

/// Wall-clock figures of this run on this machine (not deterministic).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct WallReport {
    /// Seconds the run took.
    pub elapsed_s: f64,
    /// Generated tokens per wall second, all engines.
    pub tokens_per_s: f64,
    /// Scheduled tokens per wall second, all engines.
    pub scheduled_per_s: f64,
    /// KV bytes read by attention per wall second.
    pub kv_read_gb_per_s: f64,
    /// Per engine: seconds in kernels, seconds in scheduling and commit.
    pub engine_kernel_s: Vec<f64>,
    /// Per engine: seconds scheduling and committing.
    pub engine_schedule_s: Vec<f64>,
    /// Mean scheduling + commit time per engine step, microseconds.
    pub schedule_us_per_step: f64,
}

/// Everything a run reports.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Report {
    /// Seed.
    pub seed: u64,
    /// Device the kernels ran on.
    pub device: String,
    /// Simulated seconds of arrivals.
    pub duration_s: f64,
    /// Simulated milliseconds per step.
    pub step_ms: f64,
    /// Steps run (arrivals, then drain).
    pub steps: u64,
    /// Blocks in the shared pool (pages of the arena).
    pub pool_blocks: u32,
    /// Bytes per page of the arena.
    pub page_bytes: u64,
    /// Bytes of the one KV arena every engine's cache is a view of.
    pub kv_pool_bytes: u64,
    /// Every KV byte allocated by every engine, summed: the arena (once) plus any cache an
    /// engine allocated for itself. Equal to `kv_pool_bytes` when every cache is a view.
    pub kv_bytes_allocated: u64,
    /// Reclaim latency over all engines (see [`EngineReport::reclaim_steps`]).
    pub reclaim_steps: StepLatency,
    /// Requests generated.
    pub requests: u64,
    /// Requests finished.
    pub finished: u64,
    /// Requests refused, by reason, all engines.
    pub refused: Refusals,
    /// Generated tokens per simulated second, all engines.
    pub tokens_per_s: f64,
    /// Mean pool utilisation at a step's end: pages allocated, those only the prefix cache
    /// keeps included.
    pub kv_utilisation_mean: f64,
    /// Peak pool utilisation (as the mean).
    pub kv_utilisation_peak: f64,
    /// Mean fraction of the pool the engines' budgets held at a step's end: their sequences'
    /// pages, not those only the prefix cache keeps.
    pub kv_sequence_utilisation_mean: f64,
    /// Peak of that fraction.
    pub kv_sequence_utilisation_peak: f64,
    /// Blocks left allocated at the end (must be 0).
    pub leaked_blocks: u32,
    /// Ticks where every engine had a backlog.
    pub saturated_ticks: u64,
    /// Whether the engines shared a prefix cache.
    pub prefix_cache: bool,
    /// Prompt tokens found in the prefix cache / prompt tokens, over every engine's first
    /// admissions.
    pub prefix_hit_rate: f64,
    /// Time to first token over all requests that got one, median, simulated ms (0 when none
    /// did: the engines' class counts tell; the text report prints "-").
    pub ttft_p50_ms: f64,
    /// Per engine.
    pub engines: Vec<EngineReport>,
    /// Pool and budget state over time (sampled).
    pub timeline: Vec<TimelinePoint>,
    /// This machine's wall-clock figures.
    pub wall: WallReport,
}

impl Report {
    /// The report as text, for a terminal.
    pub fn to_text(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "pagedkv simulate: seed {}, {} engines on one pool of {} blocks, device {}",
            self.seed,
            self.engines.len(),
            self.pool_blocks,
            self.device
        );
        let _ = writeln!(
            s,
            "{} s of arrivals at {} ms per step: {} steps; {} requests, {} finished, refused: {} queue full, {} evicted, {} too long, {} timed out",
            self.duration_s,
            self.step_ms,
            self.steps,
            self.requests,
            self.finished,
            self.refused.queue_full,
            self.refused.evicted,
            self.refused.too_long,
            self.refused.timed_out
        );
        let _ = writeln!(
            s,
            "KV utilisation (sequences and prefix cache) mean {:.1}% peak {:.1}%, by sequences mean {:.1}% peak {:.1}%; {} saturated steps; leaked blocks: {}",
            100.0 * self.kv_utilisation_mean,
            100.0 * self.kv_utilisation_peak,
            100.0 * self.kv_sequence_utilisation_mean,
            100.0 * self.kv_sequence_utilisation_peak,
            self.saturated_ticks,
            self.leaked_blocks
        );
        // No request got a first token: no latency (not 0 ms), as for a class or an engine.
        let first_tokens: usize = self
            .engines
            .iter()
            .map(|e| e.latency_critical.ttft.count + e.throughput.ttft.count)
            .sum();
        let _ = writeln!(
            s,
            "prefix cache {}: {:.1}% of prompt tokens hit; ttft p50 {} over all requests",
            if self.prefix_cache { "on" } else { "off" },
            100.0 * self.prefix_hit_rate,
            if first_tokens == 0 {
                "-".to_owned()
            } else {
                format!("{:.0} ms", self.ttft_p50_ms)
            }
        );
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let _ = writeln!(
            s,
            "KV arena {:.1} MiB ({} pages of {}); KV bytes allocated by all engines {:.1} MiB ({:.2}x the arena); reclaim latency p50/p99/max {}/{}/{} steps over {} lender demands",
            mib(self.kv_pool_bytes),
            self.pool_blocks,
            // Exact: a page of a small model is less than a KiB, or not a whole number of KiB.
            if self.page_bytes % 1024 == 0 {
                format!("{} KiB", self.page_bytes / 1024)
            } else {
                format!("{} B", self.page_bytes)
            },
            mib(self.kv_bytes_allocated),
            self.kv_bytes_allocated as f64 / self.kv_pool_bytes.max(1) as f64,
            self.reclaim_steps.p50,
            self.reclaim_steps.p99,
            self.reclaim_steps.max,
            self.reclaim_steps.count
        );
        let _ = writeln!(
            s,
            "\n{:<10} {:>6} {:>6} {:>6} {:>5} {:>6} {:>6} {:>8} {:>7} {:>7} | {:>17} {:>17} | {:>17} {:>17}",
            "engine", "weight", "tokens", "reqs", "done", "refus", "tok/s", "preempt", "swapped", "shed",
            "LC ttft p50/p99", "LC itl p50/p99", "TP ttft p50/p99", "TP itl p50/p99"
        );
        for e in &self.engines {
            let refused =
                e.refused.queue_full + e.refused.evicted + e.refused.too_long + e.refused.timed_out;
            // A class without a sample has no latency (not 0 ms).
            let lat = |l: &Latency| {
                if l.count == 0 {
                    "-".to_owned()
                } else {
                    format!("{:.0}/{:.0}", l.p50_ms, l.p99_ms)
                }
            };
            let _ = writeln!(
                s,
                "{:<10} {:>6} {:>5.1}% {:>6} {:>5} {:>6} {:>6.0} {:>8} {:>7} {:>7} | {:>17} {:>17} | {:>17} {:>17}",
                e.name,
                e.weight,
                100.0 * e.token_share,
                e.requests,
                e.finished,
                refused,
                e.tokens_per_s,
                e.preempted_recompute + e.preempted_swap,
                e.blocks_swapped[0],
                e.blocks_shed,
                lat(&e.latency_critical.ttft),
                lat(&e.latency_critical.itl),
                lat(&e.throughput.ttft),
                lat(&e.throughput.itl),
            );
        }
        let _ = writeln!(
            s,
            "\ntokens: each engine's share of the scheduled tokens; under saturation (steps where \
             every engine had a backlog: {}) beside its weight share; its tokens scheduled above its \
             token share of their step (lent):",
            self.saturated_ticks
        );
        for e in &self.engines {
            let saturated = if self.saturated_ticks >= 20 {
                format!("{:>5.1}%", 100.0 * e.saturated_token_share)
            } else {
                "  n/a ".to_owned()
            };
            let _ = writeln!(
                s,
                "   {:<10} saturated {}  weight {:>5.1}%  above share {:>5.1}% | blocks: peak held {:>5}, peak borrowed {:>4}, peak cached {:>4}, given back {:>4}, donations asked {} | {:>3} tokens/page, {} B/page unused, reclaim p50/max {}/{} steps ({}) | prefix hit {:>5.1}%, ttft p50 {}",
                e.name,
                saturated,
                100.0 * e.weight_share,
                100.0 * e.tokens_above_share,
                e.peak_blocks,
                e.peak_borrowed,
                e.peak_cached_blocks,
                e.blocks_shed,
                e.donations_asked,
                e.tokens_per_page,
                e.wasted_bytes_per_page,
                e.reclaim_steps.p50,
                e.reclaim_steps.max,
                e.reclaim_steps.count,
                100.0 * e.prefix_hit_rate,
                if e.latency_critical.ttft.count + e.throughput.ttft.count == 0 {
                    "-".to_owned()
                } else {
                    format!("{:.0} ms", e.ttft_p50_ms)
                }
            );
        }
        let _ = writeln!(
            s,
            "\nsimulated: {:.0} generated tokens/s; latencies in simulated ms (ttft = time to first token, itl = inter-token)",
            self.tokens_per_s
        );
        let _ = writeln!(
            s,
            "wall clock (this machine): {:.1} s, {:.0} generated tok/s, {:.0} scheduled tok/s, attention read {:.2} GB/s of KV, scheduling+commit {:.1} us per engine step",
            self.wall.elapsed_s,
            self.wall.tokens_per_s,
            self.wall.scheduled_per_s,
            self.wall.kv_read_gb_per_s,
            self.wall.schedule_us_per_step
        );
        s
    }
}
