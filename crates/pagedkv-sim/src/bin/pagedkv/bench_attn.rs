//! Decode and prefill points of `pagedkv bench gpu`: each point's inputs (random bf16 K/V in a
//! one-layer paged cache whose block table is shuffled over the pool, random queries), as many
//! distinct copies as the L2 rotation asks for, its three timings, and, for points small enough,
//! a check of the timed kernel's output against the CPU oracle on the same inputs.

use crate::bench_timing::{time_point, BoxErr, Clock, Plan};
use cudarc::driver::CudaSlice;
use half::bf16;
use pagedkv::attn::{cpu, AttnWorkspace};
use pagedkv::cuda::{
    DecodeMode, DecodeWorkspace, DeviceAttnParams, DeviceKvCache, DeviceSeqs, Gpu, PinnedSwapSpace,
    PrefillTiling,
};
use pagedkv::kv::{AttnParams, HostKvCache, KvCacheConfig, KvDtype, PagedSeqs};
use pagedkv_sim::gpu_bench::{
    launches, rotation_copies, DecodePoint, Outcome, PrefillPoint, Shape,
};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

/// Bytes of random blocks kept in pinned memory per block shape; caches are filled from it.
const POOL_BYTES: usize = 64 << 20;
/// A point's output is checked against the CPU oracle when its FLOPs and cache are at most
/// these (the oracle runs on the host, and the cache is downloaded for it).
const CHECK_MAX_FLOPS: f64 = 2.5e9;
const CHECK_MAX_CACHE: usize = 256 << 20;
/// bf16 tolerance of kernel vs oracle (as tests/support/kernel_grid.rs).
const TOL: (f32, f32) = (1e-2, 2e-2);

/// What every point shares.
pub struct Bench<'g> {
    pub gpu: &'g Gpu,
    pub clock: Clock<'g>,
    pub shape: Shape,
    pub block_size: usize,
    pub mode: DecodeMode,
    /// The prefill points' tiling.
    pub prefill_tiling: PrefillTiling,
    /// Every launch a programmatic dependent launch (`DeviceAttnParams::programmatic_launch`).
    pub programmatic: bool,
    /// The device's L2 cache, bytes.
    pub l2_bytes: u64,
    /// Device bytes the copies of one point may take.
    pub budget: u64,
    pub min_launches: usize,
    pub reps: usize,
    pub one_call_iters: usize,
    pub warmup: usize,
    pub check: bool,
    rng: SmallRng,
    /// Pinned random blocks, by KV head count (the block shape's only varying dimension).
    pools: HashMap<usize, PinnedSwapSpace>,
}

/// One copy of a point's device inputs and output.
struct Copy {
    cache: DeviceKvCache,
    q: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
    ws: DecodeWorkspace,
}

/// A decode point's inputs on the device (and the host values the oracle check needs).
struct DecodeInputs {
    cfg: KvCacheConfig,
    per_seq: usize,
    tables: Vec<i32>,
    ctx_lens: Vec<i32>,
    attn: AttnParams<'static>,
    dseqs: DeviceSeqs,
    params: DeviceAttnParams,
    q_host: Vec<bf16>,
    copies: Vec<Copy>,
}

/// The batch's paged-sequence view: table rows of `per_seq` entries, one context per row.
fn paged<'a>(tables: &'a [i32], per_seq: usize, ctx_lens: &'a [i32]) -> PagedSeqs<'a> {
    PagedSeqs {
        block_tables: tables,
        max_blocks_per_seq: per_seq,
        context_lens: ctx_lens,
    }
}

/// A point's result and, when it was checked, the largest error against the oracle.
pub struct Measured {
    pub outcome: Outcome,
    pub check: Option<Result<f32, String>>,
}

impl<'g> Bench<'g> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &'g Gpu,
        shape: Shape,
        block_size: usize,
        mode: DecodeMode,
        l2_bytes: u64,
        budget: u64,
        (min_launches, reps, one_call_iters, warmup): (usize, usize, usize, usize),
        check: bool,
    ) -> Result<Self, BoxErr> {
        Ok(Self {
            gpu,
            clock: Clock::new(gpu)?,
            shape,
            block_size,
            mode,
            prefill_tiling: PrefillTiling::Auto,
            programmatic: false,
            l2_bytes,
            budget,
            min_launches,
            reps,
            one_call_iters,
            warmup,
            check,
            rng: SmallRng::seed_from_u64(0x5eed),
            pools: HashMap::new(),
        })
    }

    fn config(&self, kv_heads: usize, blocks: usize) -> Result<KvCacheConfig, BoxErr> {
        Ok(KvCacheConfig::new(
            1,
            kv_heads,
            self.shape.head_dim,
            self.block_size,
            blocks,
            KvDtype::Bf16,
        )?)
    }

    fn plan(&self, copies: usize) -> Plan {
        Plan {
            copies,
            launches: launches(self.min_launches, copies),
            reps: self.reps,
            one_call_iters: self.one_call_iters,
            warmup: self.warmup,
        }
    }

    /// A cache of `cfg` filled with random bf16 from the pinned pool of its block shape (the
    /// pool's blocks in turn from a random one on, so copies differ), by one swap-in whose runs
    /// of consecutive blocks are single DMA copies.
    fn random_cache(&mut self, cfg: &KvCacheConfig) -> Result<DeviceKvCache, BoxErr> {
        let hkv = cfg.num_kv_heads();
        if !self.pools.contains_key(&hkv) {
            let blocks = (POOL_BYTES / cfg.bytes_per_block()).clamp(1, cfg.num_blocks().max(1));
            let mut pool = PinnedSwapSpace::new(self.gpu, cfg, blocks)?;
            for pair in pool.as_bytes_mut()?.chunks_exact_mut(2) {
                let v = bf16::from_f32(self.rng.gen_range(-1.0f32..1.0));
                pair.copy_from_slice(&v.to_bits().to_le_bytes());
            }
            self.pools.insert(hkv, pool);
        }
        let start = self.rng.gen_range(0..u32::MAX as usize);
        let pool = self.pools.get_mut(&hkv).ok_or("random pool")?;
        let p = pool.config().num_blocks();
        let mut cache = DeviceKvCache::new(self.gpu, *cfg)?;
        let map: Vec<(u32, u32)> = (0..cfg.num_blocks())
            .map(|b| (((start + b) % p) as u32, b as u32))
            .collect();
        cache.swap_in(self.gpu, pool, &map)?;
        Ok(cache)
    }

    fn random_vec(&mut self, n: usize) -> Vec<bf16> {
        (0..n)
            .map(|_| bf16::from_f32(self.rng.gen_range(-1.0f32..1.0)))
            .collect()
    }

    /// Shuffled block ids: `seqs` rows of `per_seq` distinct blocks out of `seqs * per_seq`.
    fn tables(&mut self, seqs: usize, per_seq: usize) -> Vec<i32> {
        let mut ids: Vec<i32> = (0..(seqs * per_seq) as i32).collect();
        ids.shuffle(&mut self.rng);
        ids
    }

    /// Device copies of a point: caches (random), queries (the same random values in each
    /// copy's own allocation) and outputs.
    fn copies(
        &mut self,
        cfg: &KvCacheConfig,
        q_host: &[bf16],
        n: usize,
    ) -> Result<Vec<Copy>, BoxErr> {
        (0..n)
            .map(|_| {
                Ok(Copy {
                    cache: self.random_cache(cfg)?,
                    q: self.gpu.upload(q_host)?,
                    out: self.gpu.alloc_zeros(q_host.len())?,
                    ws: DecodeWorkspace::new(),
                })
            })
            .collect()
    }

    /// Bytes of one copy of a point's inputs and output: a cache of `blocks` blocks of `kv_heads`
    /// heads plus `io_bytes` (saturating: a point too large to count is over every budget).
    fn copy_bytes(&self, blocks: Option<usize>, kv_heads: usize, io_bytes: u64) -> u64 {
        let elem = self.shape.elem_bytes;
        blocks
            .and_then(|b| {
                [b, self.block_size, 2, kv_heads, self.shape.head_dim, elem]
                    .into_iter()
                    .try_fold(1u64, |acc, x| acc.checked_mul(x as u64))
            })
            .map_or(u64::MAX, |cache| cache.saturating_add(io_bytes))
    }

    /// A decode point's device inputs (`Err(bytes)`: over the budget, skipped). Sizes are
    /// counted before anything is built, without wrapping: a wrapped count passed the budget
    /// check and then allocated a batch-long table.
    fn decode_inputs(&mut self, p: &DecodePoint) -> Result<Result<DecodeInputs, u64>, BoxErr> {
        let (nh, hkv, d) = (p.heads.query, p.heads.kv, self.shape.head_dim);
        let per_seq = p.ctx.div_ceil(self.block_size);
        let blocks = p.batch.checked_mul(per_seq);
        let bytes = self.copy_bytes(blocks, hkv, p.io_bytes(self.shape));
        let (Some(blocks), true) = (blocks, bytes <= self.budget) else {
            return Ok(Err(bytes));
        };
        let ctx = i32::try_from(p.ctx).map_err(|_| format!("decode {p}: context over i32"))?;
        let cfg = self.config(hkv, blocks)?;
        let n = rotation_copies(bytes, self.l2_bytes, self.budget);
        let tables = self.tables(p.batch, per_seq);
        let ctx_lens = vec![ctx; p.batch];
        let dseqs = DeviceSeqs::upload(self.gpu, &cfg, &paged(&tables, per_seq, &ctx_lens))?;
        let attn = AttnParams::new(nh, d);
        let mut params = DeviceAttnParams::upload(self.gpu, &cfg, &attn)?;
        params.mode = self.mode;
        params.programmatic_launch = self.programmatic;
        let q_host = self.random_vec(p.batch * nh * d);
        let copies = self.copies(&cfg, &q_host, n)?;
        Ok(Ok(DecodeInputs {
            cfg,
            per_seq,
            tables,
            ctx_lens,
            attn,
            dseqs,
            params,
            q_host,
            copies,
        }))
    }

    pub fn decode(&mut self, p: &DecodePoint) -> Result<Measured, BoxErr> {
        let mut x = match self.decode_inputs(p)? {
            Ok(x) => x,
            Err(bytes) => return Ok(skipped(bytes)),
        };
        let (gpu, n) = (self.gpu, x.copies.len());
        let timing = time_point(&self.clock, &self.plan(n), &mut |i| {
            let c = &mut x.copies[i % n];
            c.cache
                .paged_attention_decode(gpu, 0, &c.q, &x.dseqs, &x.params, &mut c.ws, &mut c.out)
        })?;
        let check = (self.check
            && p.flops(self.shape) <= CHECK_MAX_FLOPS
            && x.cfg.total_bytes() <= CHECK_MAX_CACHE)
            .then(|| {
                let seqs = paged(&x.tables, x.per_seq, &x.ctx_lens);
                check_against_oracle(gpu, &x.copies[0], &x.cfg, &x.q_host, |kv, q, out| {
                    cpu::paged_attention_decode(
                        &mut AttnWorkspace::new(),
                        kv,
                        q,
                        &seqs,
                        &x.attn,
                        out,
                    )
                })
            });
        Ok(Measured {
            outcome: Outcome::Timed(timing),
            check,
        })
    }

    /// A decode step's attention half as an engine runs it per layer: reshape_and_cache of each
    /// sequence's newest token, then decode, timed with plain launches and with programmatic
    /// launches (the decode dispatched during the cache write), in that order.
    pub fn decode_step(&mut self, p: &DecodePoint) -> Result<[Outcome; 2], BoxErr> {
        if p.ctx == 0 {
            return Ok([(); 2].map(|_| Outcome::Skipped("no newest token".into())));
        }
        let mut x = match self.decode_inputs(p)? {
            Ok(x) => x,
            Err(bytes) => return Ok([(); 2].map(|_| skipped(bytes).outcome)),
        };
        let (hkv, d) = (p.heads.kv, self.shape.head_dim);
        // The newest token of sequence s: its slot in its last block.
        let (last, bs) = (p.ctx - 1, self.block_size);
        let slots: Vec<i64> = (0..p.batch)
            .map(|s| x.tables[s * x.per_seq + last / bs] as i64 * bs as i64 + (last % bs) as i64)
            .collect();
        let (k_host, v_host) = (
            self.random_vec(p.batch * hkv * d),
            self.random_vec(p.batch * hkv * d),
        );
        let (key, value, dslots) = (
            self.gpu.upload(&k_host)?,
            self.gpu.upload(&v_host)?,
            self.gpu.upload(&slots)?,
        );
        let (gpu, n) = (self.gpu, x.copies.len());
        let plan = self.plan(n);
        let mut time = |programmatic: bool| -> Result<Outcome, BoxErr> {
            x.params.programmatic_launch = programmatic;
            let timing = time_point(&self.clock, &plan, &mut |i| {
                let c = &mut x.copies[i % n];
                c.cache.reshape_and_cache(gpu, 0, &key, &value, &dslots)?;
                c.cache.paged_attention_decode(
                    gpu, 0, &c.q, &x.dseqs, &x.params, &mut c.ws, &mut c.out,
                )
            })?;
            Ok(Outcome::Timed(timing))
        };
        Ok([time(false)?, time(true)?])
    }

    /// The tiling the library runs for point `p` at the asked tiling on this device (what Auto
    /// chose; `pkv_prefill_tiling_choice`).
    pub fn prefill_runs(&self, p: &PrefillPoint) -> Result<Option<PrefillTiling>, BoxErr> {
        let cfg = self.config(p.heads.kv, p.context().div_ceil(self.block_size))?;
        Ok(self
            .prefill_tiling
            .resolve(&cfg, p.heads.query, 1, p.chunk, 0)?)
    }

    pub fn prefill(&mut self, p: &PrefillPoint) -> Result<Measured, BoxErr> {
        let (nh, hkv, d) = (p.heads.query, p.heads.kv, self.shape.head_dim);
        let per_seq = p.context().div_ceil(self.block_size);
        let bytes = self.copy_bytes(Some(per_seq), hkv, p.io_bytes(self.shape));
        if bytes > self.budget {
            return Ok(skipped(bytes));
        }
        let (Ok(context), Ok(chunk)) = (i32::try_from(p.context()), i32::try_from(p.chunk)) else {
            return Err(format!("prefill {p}: context over i32").into());
        };
        let cfg = self.config(hkv, per_seq)?;
        let n = rotation_copies(bytes, self.l2_bytes, self.budget);
        let tables = self.tables(1, per_seq);
        let ctx_lens = [context];
        let qsl = [0, chunk];
        let seqs = PagedSeqs {
            block_tables: &tables,
            max_blocks_per_seq: per_seq,
            context_lens: &ctx_lens,
        };
        let dseqs = DeviceSeqs::upload_prefill(self.gpu, &cfg, &seqs, &qsl)?;
        let attn = AttnParams::new(nh, d);
        let mut params = DeviceAttnParams::upload(self.gpu, &cfg, &attn)?;
        params.prefill_tiling = self.prefill_tiling;
        params.programmatic_launch = self.programmatic;
        let q_host = self.random_vec(p.chunk * nh * d);
        let mut copies = self.copies(&cfg, &q_host, n)?;
        let gpu = self.gpu;
        let timing = time_point(&self.clock, &self.plan(n), &mut |i| {
            let c = &mut copies[i % n];
            c.cache
                .paged_attention_prefill(gpu, 0, &c.q, &dseqs, &params, &mut c.out)
        })?;
        let check = (self.check
            && p.flops(self.shape) <= CHECK_MAX_FLOPS
            && cfg.total_bytes() <= CHECK_MAX_CACHE)
            .then(|| {
                check_against_oracle(gpu, &copies[0], &cfg, &q_host, |kv, q, out| {
                    cpu::paged_attention_prefill(
                        &mut AttnWorkspace::new(),
                        kv,
                        q,
                        &qsl,
                        &seqs,
                        &attn,
                        out,
                    )
                })
            });
        Ok(Measured {
            outcome: Outcome::Timed(timing),
            check,
        })
    }
}

fn skipped(bytes: u64) -> Measured {
    let why = if bytes == u64::MAX {
        "needs more than 2^64 bytes".to_string()
    } else {
        format!("needs {:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
    };
    Measured {
        outcome: Outcome::Skipped(why),
        check: None,
    }
}

/// The largest |kernel - oracle| over the output of copy `c` (whose last launch was the timed
/// kernel's), or what differs beyond the bf16 tolerance.
fn check_against_oracle(
    gpu: &Gpu,
    c: &Copy,
    cfg: &KvCacheConfig,
    q: &[bf16],
    oracle: impl FnOnce(
        pagedkv::kv::LayerKv<'_, bf16>,
        &[bf16],
        &mut [bf16],
    ) -> Result<(), pagedkv::error::AttnError>,
) -> Result<f32, String> {
    let run = || -> Result<(Vec<bf16>, Vec<bf16>), BoxErr> {
        let got = gpu.download(&c.out)?;
        let mut host = HostKvCache::new(*cfg)?;
        c.cache.download_to(gpu, &mut host)?;
        let mut want = vec![bf16::from_f32(f32::NAN); q.len()];
        oracle(host.view::<bf16>()?.layer(0)?, q, &mut want)?;
        Ok((got, want))
    };
    let (got, want) = run().map_err(|e| e.to_string())?;
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let (g, w) = (g.to_f32(), w.to_f32());
        let err = (g - w).abs();
        // NaN in either (an unwritten or broken output) fails too.
        if err.is_nan() || err > TOL.0 + TOL.1 * w.abs() {
            return Err(format!("element {i}: kernel {g} vs CPU {w}"));
        }
        worst = worst.max(err);
    }
    Ok(worst)
}
