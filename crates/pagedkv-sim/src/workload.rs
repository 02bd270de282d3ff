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
    /// Session the request belongs to (a user's chat: its conversations one after another).
    pub session: u64,
    /// Conversation of the session the request belongs to (0: the session's first). A
    /// conversation that starts over is a new one: new messages, none of the last one's text.
    pub conversation: u32,
    /// Priority class.
    pub priority: Priority,
    /// Prompt tokens: the model's system prompt, then the session's earlier turns (resent as
    /// history), then this turn's message.
    pub prompt_len: u32,
    /// Tokens of the model's system prompt at the start of the prompt.
    pub system_len: u32,
    /// Turn of this request in its conversation (0: first); the prompt holds the messages of
    /// turns `0..=turn`, the lengths of which are `turns`.
    pub turn: u32,
    /// Lengths of the conversation's messages so far, this turn's last.
    pub turns: Vec<u32>,
    /// Tokens to generate (unless EOS comes first).
    pub max_new_tokens: u32,
}

impl SimRequest {
    /// The prompt's tokens: deterministic in the engine (system prompt) and the session,
    /// conversation and turn (messages), so that a conversation's next turn starts with the
    /// tokens of the last one, every prompt of a model starts with its system prompt, and a
    /// new conversation shares nothing else with the session's earlier ones.
    pub fn prompt(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.prompt_len as usize);
        let system = 0x5157_u64 << 40 | self.engine as u64;
        out.extend((0..self.system_len).map(|i| token(system, i)));
        let conversation = mix(self.session ^ mix(u64::from(self.conversation) + 1));
        for (t, &len) in self.turns.iter().enumerate() {
            let key = conversation ^ (t as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            out.extend((0..len).map(|i| token(key, i)));
        }
        out
    }
}

/// SplitMix64's finalizer: distinct inputs give distinct, well-spread outputs.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A token in `1..32000` (never the simulated EOS, 0) from a key and a position.
fn token(key: u64, i: u32) -> u32 {
    let mut x = key ^ u64::from(i).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 31;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 29;
    1 + (x % 31_999) as u32
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
        // Each session's conversation (how many it had before) and that conversation's
        // messages so far: a request resends them all as history.
        let mut history: std::collections::HashMap<u64, (u32, Vec<u32>)> = Default::default();
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
            // A few sessions per engine carry most of the traffic.
            let session = (e as u64) << 32 | heavy_tailed(&mut rng, 4.0, 64) as u64;
            let system_len = spec.system_prompt.min(spec.max_prompt.saturating_sub(1));
            let room = spec.max_prompt - system_len;
            // A message is half a prompt on average: with the history resent, a conversation's
            // prompts average about the model's prompt mean over its first few turns.
            let message = heavy_tailed(&mut rng, spec.prompt_mean / 2.0, room);
            let (conversation, turns) = history.entry(session).or_default();
            // A conversation ends after a turn with probability 1/3 (3 turns on average), and
            // starts over where it would outgrow half the prompt limit: the next one is new.
            let history_len = turns.iter().sum::<u32>();
            if rng.gen_bool(1.0 / 3.0) || history_len + message > room / 2 {
                if !turns.is_empty() {
                    *conversation += 1;
                }
                turns.clear();
            }
            turns.push(message);
            out.push(SimRequest {
                id: 0,
                engine: e,
                arrival_ms: t,
                session,
                conversation: *conversation,
                priority,
                prompt_len: system_len + turns.iter().sum::<u32>(),
                system_len,
                turn: turns.len() as u32 - 1,
                turns: turns.clone(),
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
