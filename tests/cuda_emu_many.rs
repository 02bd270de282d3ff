//! Three or four engines of different geometries on one external arena through raw backends
//! on the CUDA kernels' emulation: random workloads with preemption (swap or recompute), the
//! prefix cache, engines dropped and rebuilt, every attention row checked against the closed
//! form, every page free at the end.
#![cfg(all(feature = "cuda-emu", not(feature = "cuda")))]

use pagedkv::budget::BudgetConfig;
use pagedkv::cuda_emu::{EmuBuf, EmuDevice};
use pagedkv::cuda_raw::Rows;
use pagedkv::engine::{
    DeviceRows, Engine, EngineConfig, LayerQkv, RawBackend, RecomputePolicy, SharedArena, StepModel,
};
use pagedkv::error::EngineError;
use pagedkv::kv::{page_bytes_for, KvDtype, ModelKvShape};
use pagedkv::sched::{Batch, PreemptionMode, SeqId};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;

#[path = "support/many_lanes.rs"]
mod many_lanes;
use many_lanes::*;

struct Model {
    engine: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    buf: Option<EmuBuf>,
    views: Option<[DeviceRows; 3]>,
    prompt_len: HashMap<SeqId, usize>,
    fail: bool,
}

impl StepModel<RawBackend<EmuDevice>> for Model {
    fn qkv(
        &mut self,
        _backend: &RawBackend<EmuDevice>,
        layer: usize,
        batch: &Batch,
    ) -> Result<LayerQkv<'_, DeviceRows>, EngineError> {
        let n = batch.num_tokens();
        let (hq, hk, d) = (self.heads, self.kv_heads, self.head_dim);
        let mut fused = Vec::with_capacity(n * (hq + 2 * hk) * d);
        for t in 0..n {
            let (pos, token) = (batch.positions[t], batch.input_tokens[t]);
            fused.extend(std::iter::repeat_n(0.1f32, hq * d));
            fused.extend(std::iter::repeat_n(0.2f32, hk * d));
            for _ in 0..hk {
                fused.extend((0..d).map(|i| value(self.engine, pos, layer, i, token)));
            }
        }
        let buf = EmuBuf::from_slice(&fused).expect("allocation");
        let base = buf.ptr() as usize as u64;
        let view = |part| DeviceRows {
            rows: Rows::fused(base, &[hq, hk, hk], part, d, 4).expect("in range"),
            tokens: n,
        };
        self.views = Some([view(0), view(1), view(2)]);
        self.buf = Some(buf);
        let [query, key, value] = self.views.as_ref().expect("set");
        Ok(LayerQkv { query, key, value })
    }

    fn attended(
        &mut self,
        layer: usize,
        batch: &Batch,
        out: &DeviceRows,
    ) -> Result<(), EngineError> {
        if self.fail {
            return Err(EngineError::Model("injected".into()));
        }
        let stride = out.rows.token_stride;
        let len = out.tokens * stride;
        // SAFETY: under the emulation a device pointer is a host pointer; the backend's output
        // buffer holds at least `tokens` dense rows of `token_stride` f32 (its capacity, f32
        // aligned), written by the attention launch that completed before `decode`/`prefill`
        // returned, and not written again while this borrow lives (the engine waits for
        // `attended` before its next launch).
        let host = unsafe { std::slice::from_raw_parts(out.rows.ptr as usize as *const f32, len) };
        let form = ClosedForm {
            engine: self.engine,
            heads: self.heads,
            head_dim: self.head_dim,
            prompt_len: &self.prompt_len,
        };
        form.check_attended(
            layer,
            batch,
            2e-3,
            |x| x,
            |t, h, d| host[t * stride + h * self.head_dim + d],
        );
        Ok(())
    }

    fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError> {
        sample(batch, out);
        Ok(())
    }
}

struct Lane {
    engine: Engine<RawBackend<EmuDevice>>,
    model: Model,
    seqs: Seqs,
}

fn shapes() -> [(ModelKvShape, usize); 4] {
    let s = |num_layers, num_kv_heads, head_dim| ModelKvShape {
        num_layers,
        num_kv_heads,
        head_dim,
        dtype: KvDtype::F32,
    };
    [
        (s(2, 1, 64), 2),
        (s(1, 2, 128), 4),
        (s(1, 1, 80), 1),
        (s(1, 1, 64), 3),
    ]
}

fn make_lane(
    shared: &Arc<SharedArena>,
    base: u64,
    which: usize,
    rng: &mut rand::rngs::SmallRng,
    mode: PreemptionMode,
) -> Lane {
    let (shape, heads) = shapes()[which];
    let cfg = EngineConfig {
        weight: rng.gen_range(1..5),
        max_running: rng.gen_range(1..6),
        max_batched_tokens: rng.gen_range(1..48),
        max_prefill_chunk: rng.gen_range(1..24),
        max_context: 160,
        preemption: mode,
        swap_blocks: rng.gen_range(0..16),
        recompute: RecomputePolicy::SERVER,
        prefix_cache: rng.gen_bool(0.7),
    };
    // SAFETY: `base` is the emulated allocation of `shared`'s pages (`pool().total()` pages of
    // `page_bytes()`, made for it in `run`), alive until every engine is dropped (`run` drops
    // them first); every engine on those pages is built here on `shared`, so all keep the
    // page-ownership rule; the model hands the backend dense rows of `tokens` tokens in an
    // emulated buffer it keeps until its next `qkv`; `EmuDevice` keeps `RawDevice`'s contract.
    let engine =
        unsafe { Engine::raw(shared, EmuDevice::new(4), base, cfg, &shape, heads) }.unwrap();
    Lane {
        engine,
        model: Model {
            engine: which,
            heads,
            kv_heads: shape.num_kv_heads,
            head_dim: shape.head_dim,
            buf: None,
            views: None,
            prompt_len: HashMap::new(),
            fail: false,
        },
        seqs: HashMap::new(),
    }
}

impl Lane {
    fn tick(&mut self, rng: &mut rand::rngs::SmallRng, add: bool, next_id: &mut SeqId, seed: u64) {
        if add {
            *next_id += 1;
            let id = *next_id;
            let prompt = rng.gen_range(1..60);
            let out = rng.gen_range(1..24u32);
            let req = request(rng, id, prompt, out);
            self.model.prompt_len.insert(id, prompt);
            if self.engine.add_salted(req, rng.gen_range(0..2)).is_ok() {
                self.seqs.insert(id, (prompt, out, Vec::new(), None));
            }
        }
        let mut live: Vec<SeqId> = self
            .seqs
            .iter()
            .filter(|(_, w)| w.3.is_none())
            .map(|(&id, _)| id)
            .collect();
        live.sort_unstable();
        for &id in &live {
            if rng.gen_bool(0.01) {
                let _ = self.engine.abort(id);
            }
            if self.engine.batcher().phase(id) == Some(pagedkv::sched::SeqPhase::Decoding)
                && rng.gen_bool(0.3)
            {
                let w = &self.seqs[&id];
                let pos = (w.0 + w.2.len()) as i32;
                let k = rng.gen_range(1..4usize);
                let drafts: Vec<u32> = (0..k as i32)
                    .map(|j| if rng.gen_bool(0.7) { truth(pos + j) } else { 3 })
                    .collect();
                let _ = self.engine.propose(id, &drafts);
            }
        }
        self.model.fail = rng.gen_range(0..30) == 0;
        let r = self.engine.step(&mut self.model);
        let injected = self.model.fail;
        self.model.fail = false;
        if r.is_err() {
            assert!(injected, "seed {seed}: {r:?}");
            return;
        }
        record(&mut self.seqs, self.engine.results(), seed);
    }

    fn check(&self, seed: u64, strict: bool) {
        check_streams(&self.seqs, seed, strict);
    }
}

fn run(seed: u64) {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let page_bytes = page_bytes_for(&shapes().map(|(s, _)| s), 8).unwrap();
    let pages = rng.gen_range(10..40);
    let mode = if rng.gen_bool(0.5) {
        PreemptionMode::Swap
    } else {
        PreemptionMode::Recompute
    };
    let mut shared = SharedArena::external(BudgetConfig::new(4, 96, pages), page_bytes).unwrap();
    if rng.gen_bool(0.7) {
        Arc::get_mut(&mut shared)
            .unwrap()
            .enable_prefix_cache(Some(seed));
    }
    let arena = EmuBuf::zeroed(pages as usize * page_bytes).expect("guarded allocation");
    let base = arena.ptr() as usize as u64;
    let n = rng.gen_range(3..=4);
    let mut lanes: Vec<Option<Lane>> = (0..n)
        .map(|w| Some(make_lane(&shared, base, w, &mut rng, mode)))
        .collect();
    let mut burst: Vec<bool> = (0..n).map(|_| rng.gen_bool(0.5)).collect();
    let mut next_id = 0;
    for step in 0..3000 {
        for w in 0..n {
            if step < 120 && rng.gen_bool(0.05) {
                burst[w] = !burst[w];
            }
            if step < 120 && rng.gen_bool(0.005) {
                if let Some(lane) = lanes[w].take() {
                    lane.check(seed, false);
                }
                lanes[w] = Some(make_lane(&shared, base, w, &mut rng, mode));
                continue;
            }
            let lane = lanes[w].as_mut().expect("lane");
            let add = step < 120 && burst[w] && rng.gen_bool(0.4);
            lane.tick(&mut rng, add, &mut next_id, seed);
        }
        if step > 120 && lanes.iter().flatten().all(|l| !l.engine.has_work()) {
            break;
        }
    }
    for lane in lanes.iter().flatten() {
        assert!(!lane.engine.has_work(), "seed {seed}: did not go idle");
        lane.check(seed, true);
    }
    drop(lanes);
    if let Some(cache) = shared.prefix_cache() {
        cache.clear();
    }
    assert_eq!(
        shared.pool().free_count(),
        shared.pool().total(),
        "seed {seed}"
    );
    assert_eq!(shared.coordinator().blocks_in_use(), 0, "seed {seed}");
    drop(arena);
}

#[test]
fn many_raw_engines_share_one_arena_exactly() {
    let from: u64 = std::env::var("MANY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let count: u64 = std::env::var("MANY_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    for seed in from..from + count {
        run(seed);
    }
}
