//! The seeded workload of a simulation: Poisson arrivals, heavy-tailed prompt and output
//! lengths, sessions, two priority classes, and bursts that overload one model.

use super::config::{EngineSpec, SimConfig};
use pagedkv::sched::Priority;
use rand::{rngs::SmallRng, Rng, SeedableRng};
use rand_distr::{Distribution, Exp, LogNormal};

/// One request of the workload.
#[derive(Debug, Clone, PartialEq)]
pub struct SimRequest {
    /// Unique across the run.
    pub id: u64,
    /// Target engine (model).
    pub engine: usize,
    /// Arrival time, in simulated milliseconds.
    pub arrival_ms: f64,
    /// Session the request belongs to (a conversation).
    pub session: u64,
    /// Priority class.
    pub priority: Priority,
    /// Prompt tokens.
    pub prompt_len: u32,
    /// Tokens to generate (unless EOS comes first).
    pub max_new_tokens: u32,
}

/// Samples a heavy-tailed length with the given mean: log-normal with sigma 1 (its tail is what
/// real prompt and output lengths look like), clamped to `1..=max`.
fn heavy_tailed(rng: &mut SmallRng, mean: f64, max: u32) -> u32 {
    const SIGMA: f64 = 1.0;
    // E[LogNormal(mu, s)] = exp(mu + s^2 / 2).
    let mu = mean.max(1.0).ln() - SIGMA * SIGMA / 2.0;
    let d = LogNormal::new(mu, SIGMA).unwrap_or_else(|_| unreachable!("finite parameters"));
    (d.sample(rng).round() as u64).clamp(1, u64::from(max)) as u32
}

/// Arrival rate of an engine at time `t_ms`, bursts included.
fn rate_at(spec: &EngineSpec, t_ms: f64) -> f64 {
    match spec.burst {
        Some(b) if t_ms >= b.start_s * 1e3 && t_ms < (b.start_s + b.len_s) * 1e3 => {
            spec.rate * b.factor
        }
        _ => spec.rate,
    }
}

/// Every request of the run, sorted by arrival (ties by id). Deterministic in the seed.
pub fn generate(cfg: &SimConfig) -> Vec<SimRequest> {
    let mut out = Vec::new();
    let horizon_ms = cfg.duration_s * 1e3;
    for (e, spec) in cfg.engines.iter().enumerate() {
        // One stream per engine, so adding an engine does not reshuffle the others.
        let mut rng = SmallRng::seed_from_u64(
            cfg.seed ^ (0x9e37_79b9_7f4a_7c15u64.wrapping_mul(e as u64 + 1)),
        );
        let mut t = 0.0f64;
        // Poisson process with a piecewise-constant rate: thinning against the peak rate.
        let peak = spec.rate * spec.burst.map_or(1.0, |b| b.factor.max(1.0));
        if peak <= 0.0 {
            continue;
        }
        let gap = Exp::new(peak / 1e3).unwrap_or_else(|_| unreachable!("positive rate"));
        loop {
            t += gap.sample(&mut rng);
            if t >= horizon_ms {
                break;
            }
            if rng.gen::<f64>() * peak > rate_at(spec, t) {
                continue;
            }
            let priority = if rng.gen_bool(spec.latency_fraction.clamp(0.0, 1.0)) {
                Priority::LatencyCritical
            } else {
                Priority::Throughput
            };
            out.push(SimRequest {
                id: 0,
                engine: e,
                arrival_ms: t,
                // A few sessions per engine carry most of the traffic.
                session: (e as u64) << 32 | heavy_tailed(&mut rng, 4.0, 64) as u64,
                priority,
                prompt_len: heavy_tailed(&mut rng, spec.prompt_mean, spec.max_prompt),
                max_new_tokens: heavy_tailed(&mut rng, spec.output_mean, spec.max_output),
            });
        }
    }
    out.sort_by(|a, b| {
        a.arrival_ms
            .total_cmp(&b.arrival_ms)
            .then(a.engine.cmp(&b.engine))
    });
    for (i, r) in out.iter_mut().enumerate() {
        r.id = i as u64;
    }
    out
}
