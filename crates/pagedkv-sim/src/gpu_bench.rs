//! The host side of `pagedkv bench gpu` (the command itself is in the binary, feature `cuda`):
//! the grids, the bytes and FLOPs each point is credited with, how many distinct copies of its
//! inputs a timing rotates through, the dense peer's results (`benches/gpu_sdpa_baseline.py
//! --jsonl`) and the side-by-side tables. Pure functions of their arguments, so they are tested
//! without a GPU (tests/bench_plan.rs); the Python peer implements the same accounting and
//! rotation rule (its docstring says so), which is what makes the two columns comparable.
//!
//! # What a figure means
//!
//! A point is timed three ways on the same inputs: **graph** (N launches captured once in a
//! CUDA graph, the graph replayed between one event pair, divided by N: the kernel time without
//! host overhead), **back-to-back** (N launches between one event pair, divided by N: adds the
//! launch path where the GPU outruns the host) and **one call** (one launch per event pair,
//! median: the latency a lone call sees). Bandwidth and TFLOP/s come from the graph time.
//! When a point's inputs are smaller than [`L2_MULTIPLE`] times the L2 cache, the N launches
//! cycle over [`rotation_copies`] distinct allocations, so each launch finds its inputs evicted
//! from L2 by the others and the figure is HBM's, not L2's.

use serde::Deserialize;
use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

/// A point, peer line or argument the bench cannot use.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// A grid point (or head configuration) that does not parse, has a zero size or one past
    /// [`MAX_POINT_COUNT`].
    #[error("grid point `{text}`: {why}")]
    BadPoint {
        /// The text given.
        text: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A line of the peer's output that is not one of its documented records.
    #[error("peer output, line {line}: {why}")]
    BadPeerLine {
        /// 1-based line number.
        line: usize,
        /// The parse error.
        why: String,
    },
}

fn bad(text: &str, why: &'static str) -> PlanError {
    PlanError::BadPoint {
        text: text.to_string(),
        why,
    }
}

/// The largest count a point may hold (heads, sequences, tokens, and a prefill point's whole
/// context): the kernels take them as `i32`.
pub const MAX_POINT_COUNT: usize = i32::MAX as usize;

const TOO_LARGE: &str = "sizes are at most 2147483647 (the kernels count in i32)";

fn positive(text: &str, s: &str, why: &'static str) -> Result<usize, PlanError> {
    match s.trim().parse::<usize>() {
        Ok(v) if v > MAX_POINT_COUNT => Err(bad(text, TOO_LARGE)),
        Ok(v) if v > 0 => Ok(v),
        _ => Err(bad(text, why)),
    }
}

/// The product of `factors` in u64, saturating at `u64::MAX` (a point that large is over any
/// budget; wrapping made it look small).
fn saturating_product(factors: &[usize]) -> u64 {
    factors
        .iter()
        .try_fold(1u64, |acc, &f| acc.checked_mul(f as u64))
        .unwrap_or(u64::MAX)
}

/// Query and KV heads, written `query:kv` (e.g. `32:8`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Heads {
    /// Query heads, a positive multiple of `kv`.
    pub query: usize,
    /// KV heads, positive.
    pub kv: usize,
}

impl Heads {
    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.query / self.kv
    }
}

impl fmt::Display for Heads {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.query, self.kv)
    }
}

impl FromStr for Heads {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self, PlanError> {
        let (q, kv) = s
            .split_once(':')
            .ok_or_else(|| bad(s, "expected query:kv heads, e.g. 32:8"))?;
        let query = positive(s, q, "query heads must be a positive integer")?;
        let kv = positive(s, kv, "kv heads must be a positive integer")?;
        if query % kv != 0 {
            return Err(bad(s, "query heads must be a multiple of kv heads"));
        }
        Ok(Self { query, kv })
    }
}

/// A decode point: `batch` sequences of `ctx` tokens each, one query token per sequence,
/// written `32:8/64x4096`. Parsing refuses counts over [`MAX_POINT_COUNT`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecodePoint {
    /// Head configuration.
    pub heads: Heads,
    /// Sequences.
    pub batch: usize,
    /// Context tokens per sequence (the new token included).
    pub ctx: usize,
}

impl fmt::Display for DecodePoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}x{}", self.heads, self.batch, self.ctx)
    }
}

impl FromStr for DecodePoint {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self, PlanError> {
        let (h, rest) = s
            .split_once('/')
            .ok_or_else(|| bad(s, "expected HEADS/BATCHxCTX, e.g. 32:8/64x4096"))?;
        let heads: Heads = h.parse().map_err(|_| bad(s, "bad heads (query:kv)"))?;
        let (b, c) = rest
            .split_once('x')
            .ok_or_else(|| bad(s, "expected BATCHxCTX after the heads"))?;
        let batch = positive(s, b, "batch must be a positive integer")?;
        let ctx = positive(s, c, "context must be a positive integer")?;
        // The bench holds `batch x ctx` tokens and `batch x query` query rows: counts that
        // must not wrap (on a 32-bit host they could).
        if batch.checked_mul(ctx).is_none() || batch.checked_mul(heads.query).is_none() {
            return Err(bad(s, "batch x context (or x query heads) overflows"));
        }
        Ok(Self { heads, batch, ctx })
    }
}

/// A prefill point: one sequence whose `chunk` new query tokens follow `cached` tokens already
/// in the cache (causal over all `cached + chunk`), written `32:8/2048+32768`. Parsing refuses
/// counts, and a context `cached + chunk`, over [`MAX_POINT_COUNT`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PrefillPoint {
    /// Head configuration.
    pub heads: Heads,
    /// Query tokens of the chunk (positive).
    pub chunk: usize,
    /// Tokens cached before the chunk (may be 0).
    pub cached: usize,
}

impl fmt::Display for PrefillPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}+{}", self.heads, self.chunk, self.cached)
    }
}

impl FromStr for PrefillPoint {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self, PlanError> {
        let (h, rest) = s
            .split_once('/')
            .ok_or_else(|| bad(s, "expected HEADS/CHUNK+CACHED, e.g. 32:8/2048+4096"))?;
        let heads: Heads = h.parse().map_err(|_| bad(s, "bad heads (query:kv)"))?;
        let (c, k) = rest
            .split_once('+')
            .ok_or_else(|| bad(s, "expected CHUNK+CACHED after the heads"))?;
        let cached = k
            .trim()
            .parse::<usize>()
            .map_err(|_| bad(s, "cached tokens must be a non-negative integer"))?;
        let chunk = positive(s, c, "chunk must be a positive integer")?;
        if cached > MAX_POINT_COUNT - chunk {
            return Err(bad(
                s,
                "chunk + cached tokens is at most 2147483647 (the kernels count in i32)",
            ));
        }
        if chunk.checked_mul(heads.query).is_none() {
            return Err(bad(s, "chunk x query heads overflows"));
        }
        Ok(Self {
            heads,
            chunk,
            cached,
        })
    }
}

/// Parses a comma-separated list of points (`FromStr` of each); empty items are refused.
///
/// # Errors
/// The first item's [`PlanError::BadPoint`].
pub fn parse_points<P: FromStr<Err = PlanError>>(list: &str) -> Result<Vec<P>, PlanError> {
    list.split(',').map(|s| s.trim().parse()).collect()
}

/// What every point of a run shares: head dim and element size (bf16: 2 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Head dim.
    pub head_dim: usize,
    /// Bytes per element of K, V, Q and the output.
    pub elem_bytes: usize,
}

impl Shape {
    /// Bytes of `tokens` tokens' K and V over `kv_heads` heads (saturating).
    fn kv_bytes(&self, tokens: usize, kv_heads: usize) -> u64 {
        saturating_product(&[2, tokens, kv_heads, self.head_dim, self.elem_bytes])
    }
}

// The byte counts below saturate at `u64::MAX` instead of wrapping (the fields are public and
// the shape's head dim is anyone's): a point too large to count is over every budget.

impl DecodePoint {
    /// K and V bytes a call must read: every context token of every sequence, every KV head,
    /// once (the GQA group shares them).
    pub fn kv_bytes(&self, s: Shape) -> u64 {
        saturating_product(&[
            2,
            self.batch,
            self.ctx,
            self.heads.kv,
            s.head_dim,
            s.elem_bytes,
        ])
    }
    /// Query read plus output written.
    pub fn io_bytes(&self, s: Shape) -> u64 {
        saturating_product(&[2, self.batch, self.heads.query, s.head_dim, s.elem_bytes])
    }
    /// The bytes a call moves at least (what GB/s is computed from) and what one copy of its
    /// inputs occupies (what the L2 rotation counts).
    pub fn bytes(&self, s: Shape) -> u64 {
        self.kv_bytes(s).saturating_add(self.io_bytes(s))
    }
    /// Multiply-adds of q.k and p.v, two FLOPs each.
    pub fn flops(&self, s: Shape) -> f64 {
        4.0 * self.batch as f64 * self.heads.query as f64 * self.ctx as f64 * s.head_dim as f64
    }
}

impl PrefillPoint {
    /// Tokens of the sequence after the chunk.
    /// (Saturating at `usize::MAX`; a parsed point's is at most [`MAX_POINT_COUNT`].)
    pub fn context(&self) -> usize {
        self.cached.saturating_add(self.chunk)
    }
    /// (query, key) pairs of the causal region: query `i` of the chunk sits at position
    /// `cached + i` and attends `cached + i + 1` keys, so `chunk * cached + chunk (chunk + 1) / 2`
    /// (saturating at `u64::MAX`).
    pub fn causal_pairs(&self) -> u64 {
        let (c, k) = (self.chunk as u128, self.cached as u128);
        let pairs = c
            .saturating_mul(k)
            .saturating_add(c.saturating_mul(c + 1) / 2);
        u64::try_from(pairs).unwrap_or(u64::MAX)
    }
    /// FLOPs of the causal region: per pair and query head, `head_dim` multiply-adds for q.k
    /// and as many for p.v, two FLOPs each. Masked-out pairs are not counted, whatever a kernel
    /// computes and throws away.
    pub fn flops(&self, s: Shape) -> f64 {
        4.0 * self.causal_pairs() as f64 * self.heads.query as f64 * s.head_dim as f64
    }
    /// K and V bytes of the whole context (each read at least once).
    pub fn kv_bytes(&self, s: Shape) -> u64 {
        s.kv_bytes(self.context(), self.heads.kv)
    }
    /// Query read plus output written.
    pub fn io_bytes(&self, s: Shape) -> u64 {
        saturating_product(&[2, self.chunk, self.heads.query, s.head_dim, s.elem_bytes])
    }
    /// One copy of the inputs and output (what the L2 rotation counts).
    pub fn bytes(&self, s: Shape) -> u64 {
        self.kv_bytes(s).saturating_add(self.io_bytes(s))
    }
}

/// The head configurations of both grids: GQA 32:8 (what current models use) and MHA 32:32.
pub const GRID_HEADS: [Heads; 2] = [Heads { query: 32, kv: 8 }, Heads { query: 32, kv: 32 }];

/// The decode grid of issue 15: (batch, context) pairs, for each of [`GRID_HEADS`].
pub const DECODE_SHAPES: [(usize, usize); 6] = [
    (1, 512),
    (1, 4096),
    (1, 32768),
    (8, 4096),
    (64, 4096),
    (64, 32768),
];
/// Prefill chunk sizes (query tokens) of issue 15.
pub const PREFILL_CHUNKS: [usize; 2] = [512, 2048];
/// Tokens cached before the chunk, issue 15.
pub const PREFILL_CACHED: [usize; 3] = [0, 4096, 32768];

/// The default decode grid, heads outermost.
pub fn default_decode_grid() -> Vec<DecodePoint> {
    GRID_HEADS
        .iter()
        .flat_map(|&heads| {
            DECODE_SHAPES
                .iter()
                .map(move |&(batch, ctx)| DecodePoint { heads, batch, ctx })
        })
        .collect()
}

/// The default prefill grid, heads outermost, then chunk, then cached tokens.
pub fn default_prefill_grid() -> Vec<PrefillPoint> {
    let mut v = Vec::new();
    for heads in GRID_HEADS {
        for chunk in PREFILL_CHUNKS {
            for cached in PREFILL_CACHED {
                v.push(PrefillPoint {
                    heads,
                    chunk,
                    cached,
                });
            }
        }
    }
    v
}

/// A rotation's copies together span at least this many times the L2 cache: with LRU-like
/// replacement, the copy a launch reads was last touched `copies - 1` launches earlier, and at
/// least twice L2's worth of other data has passed through since.
pub const L2_MULTIPLE: u64 = 3;
/// At most this many copies (a point of a few KiB would otherwise ask for thousands).
pub const MAX_COPIES: usize = 256;

/// Distinct copies of a point's inputs to cycle through: `ceil(L2_MULTIPLE * l2 / bytes)`,
/// at least 1, at most [`MAX_COPIES`] and at most what `budget` bytes hold (never below 1:
/// whether one copy fits is the caller's skip decision). `L2_MULTIPLE * l2` saturates (an L2
/// that large asks for the most copies; wrapping asked for one).
pub fn rotation_copies(bytes: u64, l2_bytes: u64, budget: u64) -> usize {
    let bytes = bytes.max(1);
    let want = L2_MULTIPLE.saturating_mul(l2_bytes).div_ceil(bytes);
    let fit = budget / bytes;
    want.min(fit).clamp(1, MAX_COPIES as u64) as usize
}

/// Launches per timing: at least `min_launches`, a whole number of rotations (each copy used
/// equally often), at least one rotation; where that whole number passes `usize::MAX`, the
/// most whole rotations `usize` holds (wrapping gave a handful of launches).
pub fn launches(min_launches: usize, copies: usize) -> usize {
    let copies = copies.max(1);
    let rotations = min_launches.max(1).div_ceil(copies);
    copies
        .checked_mul(rotations)
        .unwrap_or(usize::MAX / copies * copies)
}

/// The median of `xs` (the upper one of an even count), `None` when empty; sorts `xs`.
pub fn median(xs: &mut [f64]) -> Option<f64> {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied()
}

/// GB/s of `bytes` in `us` microseconds.
pub fn gbps(bytes: f64, us: f64) -> f64 {
    bytes / us / 1e3
}

/// TFLOP/s of `flops` in `us` microseconds.
pub fn tflops(flops: f64, us: f64) -> f64 {
    flops / us / 1e6
}

/// The three timings of one point, microseconds per call.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct Timing {
    /// CUDA-graph replay of N launches, divided by N.
    pub graph_us: f64,
    /// N back-to-back launches between one event pair, divided by N.
    pub b2b_us: f64,
    /// One launch per event pair (median).
    pub one_us: f64,
    /// Distinct input copies the launches cycled through.
    pub copies: usize,
}

/// A point's result: timed, or skipped with the reason.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Measured.
    Timed(Timing),
    /// Not measured (e.g. the inputs do not fit the device).
    Skipped(String),
}

/// One record of the peer's `--jsonl` output (one JSON object per line).
#[derive(Debug, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
enum PeerLine {
    /// The peer's device, framework and its own copy bandwidth.
    Device {
        name: String,
        torch: String,
        d2d_gbps: f64,
    },
    Decode {
        point: String,
        #[serde(flatten)]
        timing: Timing,
        #[serde(default)]
        note: Option<String>,
    },
    Prefill {
        point: String,
        #[serde(flatten)]
        timing: Timing,
        #[serde(default)]
        note: Option<String>,
    },
    /// A point the peer could not run (e.g. out of memory), with its reason.
    Skip { point: String, why: String },
}

/// What the dense peer measured, by point.
#[derive(Debug, Default)]
pub struct PeerResults {
    /// `name, torch version` of the peer's device line.
    pub device: Option<String>,
    /// The peer's own device-to-device copy bandwidth, GB/s.
    pub d2d_gbps: Option<f64>,
    /// Decode results.
    pub decode: HashMap<DecodePoint, Outcome>,
    /// Prefill results.
    pub prefill: HashMap<PrefillPoint, Outcome>,
    /// Notes the peer attached to points (e.g. how it masked), `point: note`.
    pub notes: Vec<String>,
}

/// What the dense peer (benches/gpu_sdpa_baseline.py) is asked to run: the same device, grid
/// and timing rules as pagedkv's side of `bench gpu`.
#[derive(Debug, Clone, Copy)]
pub struct PeerArgs<'a> {
    /// Device ordinal (`bench gpu --device`): the peer runs on the same device.
    pub device: usize,
    /// Decode points.
    pub decode: &'a [DecodePoint],
    /// Prefill points.
    pub prefill: &'a [PrefillPoint],
    /// Head dim.
    pub head_dim: usize,
    /// The L2 size pagedkv's rotation uses, so both sides rotate by the same rule.
    pub l2_bytes: u64,
    /// Launches per graph and back-to-back timing (at least).
    pub min_launches: usize,
    /// Graph replays and back-to-back runs per point.
    pub reps: usize,
    /// One-call timings per point.
    pub one_call_iters: usize,
    /// Untimed launches per point first.
    pub warmup: usize,
}

impl PeerArgs<'_> {
    /// The peer script's arguments (after the script's path): `--jsonl` records of these points.
    pub fn to_args(&self) -> Vec<String> {
        fn join<T: ToString>(v: &[T]) -> String {
            v.iter().map(T::to_string).collect::<Vec<_>>().join(",")
        }
        vec![
            "--jsonl".to_string(),
            format!("--device={}", self.device),
            format!("--decode={}", join(self.decode)),
            format!("--prefill={}", join(self.prefill)),
            format!("--head-dim={}", self.head_dim),
            format!("--l2-bytes={}", self.l2_bytes),
            format!("--launches={}", self.min_launches),
            format!("--reps={}", self.reps),
            format!("--iters={}", self.one_call_iters),
            format!("--warmup={}", self.warmup),
        ]
    }
}

/// Parses the peer's `--jsonl` output: lines starting with `{` are records, others (blank
/// lines, a framework's banner) are ignored.
///
/// # Errors
/// [`PlanError::BadPeerLine`] for a record that is not valid JSON of a known kind or names a
/// point that does not parse.
pub fn parse_peer(text: &str) -> Result<PeerResults, PlanError> {
    let mut r = PeerResults::default();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if !line.starts_with('{') {
            continue;
        }
        let err = |why: String| PlanError::BadPeerLine { line: i + 1, why };
        let rec: PeerLine = serde_json::from_str(line).map_err(|e| err(e.to_string()))?;
        match rec {
            PeerLine::Device {
                name,
                torch,
                d2d_gbps,
            } => {
                r.device = Some(format!("{name}, torch {torch}"));
                r.d2d_gbps = Some(d2d_gbps);
            }
            PeerLine::Decode {
                point,
                timing,
                note,
            } => {
                let p: DecodePoint = point.parse().map_err(|e: PlanError| err(e.to_string()))?;
                if let Some(n) = note {
                    r.notes.push(format!("{p}: {n}"));
                }
                r.decode.insert(p, Outcome::Timed(timing));
            }
            PeerLine::Prefill {
                point,
                timing,
                note,
            } => {
                let p: PrefillPoint = point.parse().map_err(|e: PlanError| err(e.to_string()))?;
                if let Some(n) = note {
                    r.notes.push(format!("{p}: {n}"));
                }
                r.prefill.insert(p, Outcome::Timed(timing));
            }
            PeerLine::Skip { point, why } => {
                // A skip names a point of either grid.
                if let Ok(p) = point.parse::<DecodePoint>() {
                    r.decode.insert(p, Outcome::Skipped(why));
                } else if let Ok(p) = point.parse::<PrefillPoint>() {
                    r.prefill.insert(p, Outcome::Skipped(why));
                } else {
                    return Err(err(format!("skip of an unknown point `{point}`")));
                }
            }
        }
    }
    Ok(r)
}

/// The peer's results from how its process ended and what it printed on stdout. A peer that
/// failed (an exception, a crash, a kill) keeps the records it printed before (it flushes one per
/// point as the point ends), less an unfinished last line, with a note saying how it ended; the
/// points after them show as not run. `Err` says why there are none at all.
///
/// # Errors
/// The reason, where the peer failed before its first record or printed a bad record.
pub fn peer_results(success: bool, status: &str, stdout: &str) -> Result<PeerResults, String> {
    if success {
        return parse_peer(stdout).map_err(|e| e.to_string());
    }
    // An unfinished last line (the process ended mid-write) is not a record.
    let complete = match stdout.rfind('\n') {
        Some(i) if i + 1 < stdout.len() => &stdout[..=i],
        Some(_) => stdout,
        None => "",
    };
    let failed = format!("failed ({status})");
    match parse_peer(complete) {
        Ok(mut r) if !r.decode.is_empty() || !r.prefill.is_empty() => {
            let n = r.decode.len() + r.prefill.len();
            r.notes.push(format!(
                "{failed} after {n} points' records: the points after them were not run by it"
            ));
            Ok(r)
        }
        Ok(_) => Err(failed),
        Err(e) => Err(format!("{failed}; its output: {e}")),
    }
}

/// Header of the decode table (two lines).
pub fn decode_header() -> String {
    format!(
        "{:>15} {:>4} | {:>9} {:>9} {:>9} {:>8} {:>6} | {:>9} {:>8} | {:>7}\n{:>15} {:>4} | {:>9} {:>9} {:>9} {:>8} {:>6} | {:>9} {:>8} | {:>7}",
        "decode", "rot", "pagedkv", "", "", "", "", "SDPA", "", "pagedkv",
        "heads/BxCTX", "", "graph us", "b2b us", "1-call us", "GB/s", "% d2d", "graph us",
        "GB/s", "/ SDPA"
    )
}

/// One row of the decode table: pagedkv's three times, its GB/s (graph time) and the share of
/// the device's copy bandwidth `d2d_gbps`; the peer's graph time and GB/s; pagedkv's graph time
/// over the peer's (the target: at most 1.1).
pub fn decode_row(
    p: &DecodePoint,
    s: Shape,
    ours: &Outcome,
    peer: Option<&Outcome>,
    d2d_gbps: f64,
) -> String {
    let bytes = p.bytes(s) as f64;
    let mut row = format!("{:>15}", p.to_string());
    let our_t = match ours {
        Outcome::Timed(t) => {
            let bw = gbps(bytes, t.graph_us);
            row += &format!(
                " {:>4} | {:>9.1} {:>9.1} {:>9.1} {:>8.1} {:>5.1}%",
                t.copies,
                t.graph_us,
                t.b2b_us,
                t.one_us,
                bw,
                100.0 * bw / d2d_gbps
            );
            Some(t)
        }
        Outcome::Skipped(why) => {
            row += &format!(" {:>4} | {:<48}", "", format!("skipped: {why}"));
            None
        }
    };
    row += &peer_cells(peer, |t| gbps(bytes, t.graph_us));
    row += &match (our_t, peer) {
        (Some(o), Some(Outcome::Timed(q))) => format!(" | {:>6.2}x", o.graph_us / q.graph_us),
        _ => format!(" | {:>7}", "-"),
    };
    row
}

/// Header of the prefill table (two lines).
pub fn prefill_header() -> String {
    format!(
        "{:>18} {:>4} | {:>9} {:>9} {:>9} {:>8} | {:>9} {:>8} | {:>7}\n{:>18} {:>4} | {:>9} {:>9} {:>9} {:>8} | {:>9} {:>8} | {:>7}",
        "prefill", "rot", "pagedkv", "", "", "", "SDPA", "", "pagedkv",
        "heads/CHUNK+CACHED", "", "graph us", "b2b us", "1-call us", "TFLOP/s", "graph us",
        "TFLOP/s", "% SDPA"
    )
}

/// One row of the prefill table: pagedkv's three times and TFLOP/s (graph time, causal FLOPs);
/// the peer's graph time and TFLOP/s; pagedkv's TFLOP/s as a percentage of the peer's (the
/// issue's target: at least 70%).
pub fn prefill_row(p: &PrefillPoint, s: Shape, ours: &Outcome, peer: Option<&Outcome>) -> String {
    let flops = p.flops(s);
    let mut row = format!("{:>18}", p.to_string());
    let our_t = match ours {
        Outcome::Timed(t) => {
            row += &format!(
                " {:>4} | {:>9.1} {:>9.1} {:>9.1} {:>8.1}",
                t.copies,
                t.graph_us,
                t.b2b_us,
                t.one_us,
                tflops(flops, t.graph_us)
            );
            Some(t)
        }
        Outcome::Skipped(why) => {
            row += &format!(" {:>4} | {:<39}", "", format!("skipped: {why}"));
            None
        }
    };
    row += &peer_cells(peer, |t| tflops(flops, t.graph_us));
    row += &match (our_t, peer) {
        // Same FLOPs on both sides: the TFLOP/s ratio is the inverse time ratio.
        (Some(o), Some(Outcome::Timed(q))) => {
            format!(" | {:>6.1}%", 100.0 * q.graph_us / o.graph_us)
        }
        _ => format!(" | {:>7}", "-"),
    };
    row
}

/// The peer's two cells (graph time and a rate), or why there are none.
fn peer_cells(peer: Option<&Outcome>, rate: impl Fn(&Timing) -> f64) -> String {
    match peer {
        Some(Outcome::Timed(t)) => format!(" | {:>9.1} {:>8.1}", t.graph_us, rate(t)),
        Some(Outcome::Skipped(why)) => format!(" | {:<18}", format!("skipped: {why}")),
        None => format!(" | {:<18}", "not run"),
    }
}
