//! One decode step (the metadata upload, then per layer the cache write of the new tokens'
//! K/V and decode attention, all from a fused QKV projection in place) captured once in a CUDA
//! graph through `DecodeStep`, then replayed over changed metadata (other context lengths,
//! block tables, slots, fewer live sequences), against the CPU oracle and the eager launch.
//!
//! Without a GPU each test prints `SKIP` and passes; with `PAGEDKV_REQUIRE_GPU=1` it fails
//! instead. The same fixed-plan contract runs without a GPU on the emulation
//! (tests/cuda_emu_raw.rs).
#![cfg(feature = "cuda")]

#[path = "support/kernel_grid.rs"]
mod kernel_grid;

use half::bf16;
use kernel_grid::*;
use pagedkv::attn::cpu;
use pagedkv::cuda::{
    DecodeMode, DecodeStep, DecodeWorkspace, DeviceAttnParams, DeviceKvCache, DeviceSeqs,
};
use pagedkv::cuda_raw::Rows;
use pagedkv::error::{AttnError, CudaError, RawError};
use pagedkv::kv::{HostKvCache, KvCacheConfig, KvElem, PagedSeqs};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

#[path = "support/gpu.rs"]
mod gpu_support;
use gpu_support::gpu;

/// One step's live sequences: contexts, block tables (rows of `mbps`, each sequence its own
/// shuffled blocks) and the slot of each sequence's new (last) token.
struct Step {
    tables: Vec<i32>,
    ctx: Vec<i32>,
    slots: Vec<i64>,
    mbps: usize,
}

fn make_step(rng: &mut SmallRng, cfg: &KvCacheConfig, ctx: &[usize], mbps: usize) -> Step {
    let bs = cfg.block_size();
    let mut ids: Vec<i32> = (0..cfg.num_blocks() as i32).collect();
    ids.shuffle(rng);
    let mut next = 0;
    let mut tables = vec![-5i32; ctx.len() * mbps];
    let mut slots = Vec::new();
    for (s, &c) in ctx.iter().enumerate() {
        for j in 0..c.div_ceil(bs) {
            tables[s * mbps + j] = ids[next];
            next += 1;
        }
        slots.push(if c == 0 {
            -1
        } else {
            let p = c - 1;
            i64::from(tables[s * mbps + p / bs]) * bs as i64 + (p % bs) as i64
        });
    }
    Step {
        tables,
        ctx: ctx.iter().map(|&c| c as i32).collect(),
        slots,
        mbps,
    }
}

impl Step {
    fn seqs(&self) -> PagedSeqs<'_> {
        PagedSeqs {
            block_tables: &self.tables,
            max_blocks_per_seq: self.mbps,
            context_lens: &self.ctx,
        }
    }
}

#[test]
fn captured_decode_step_replays_over_changed_metadata() {
    let Some(g) = gpu("captured_decode_step_replays_over_changed_metadata") else {
        return;
    };
    let mut rng = SmallRng::seed_from_u64(41);
    let (layers, hkv, group, d, bs) = (2, 2, 4, 128, 16);
    let (max_seqs, mbps) = (8, 64);
    let nh = hkv * group;
    let cfg =
        KvCacheConfig::new(layers, hkv, d, bs, max_seqs * mbps + 8, bf16::DTYPE).expect("cfg");
    let mut host = random_cache::<bf16>(&mut rng, cfg);
    let mut cache = DeviceKvCache::new(&g, cfg).expect("cache");
    cache.upload_from(&g, &host).expect("upload");
    let sl = slopes(&mut rng, nh);
    let f = Features {
        alibi: true,
        window: 300,
        softcap: 0.0,
    };
    let params = attn_params(nh, d, f, &sl);
    let dparams = DeviceAttnParams::upload(&g, &cfg, &params).expect("params");
    let mut step =
        DecodeStep::new(&g, &cfg, dparams, max_seqs, mbps, DecodeMode::Auto).expect("decode step");
    let eager_params = DeviceAttnParams::upload(&g, &cfg, &params).expect("params");

    // The fused projection [max_seqs][q heads | k heads | v heads] and the output, allocated
    // once; their addresses are taken before the capture (no cudarc event work inside it).
    let (row, kv_row) = (nh * d, hkv * d);
    let fused_row = row + 2 * kv_row;
    let mut qkv = g.alloc_zeros::<bf16>(max_seqs * fused_row).expect("qkv");
    let mut out = g.alloc_zeros::<bf16>(max_seqs * row).expect("out");
    let qkv_ptr = {
        use cudarc::driver::DevicePtr;
        qkv.device_ptr(g.stream()).0
    };
    let out_ptr = {
        use cudarc::driver::DevicePtrMut;
        out.device_ptr_mut(g.stream()).0
    };
    let parts = [nh, hkv, hkv];
    let view = |p| Rows::fused(qkv_ptr, &parts, p, d, 2).expect("view");
    let out_rows = Rows::dense(out_ptr, nh, d);

    let first = make_step(&mut rng, &cfg, &[1], mbps);
    step.stage(&first.seqs(), &first.slots).expect("stage");
    let graph = step
        .capture(|s| {
            s.upload()?;
            for layer in 0..layers {
                // SAFETY: qkv and out hold max_seqs rows at these strides, live until after
                // every replay below (they are dropped at the end of the test, after a
                // synchronize); the cache outlives the graph's replays likewise.
                unsafe {
                    s.reshape_and_cache_raw(&cache, layer, view(1), view(2))?;
                    s.attention_raw(&cache, layer, view(0), out_rows)?;
                }
            }
            Ok(())
        })
        .expect("capture");

    let cap = mbps * bs;
    let steps: [&[usize]; 5] = [
        &[1, 17, 300, 1000, 33, 16, 2, cap],
        &[cap - 1, 2, 700],
        &[5],
        &[0, 400, 0, 129, 64, 63, 1, 900],
        &[bs, bs + 1],
    ];
    for (i, ctx) in steps.iter().enumerate() {
        let st = make_step(&mut rng, &cfg, ctx, mbps);
        let n = ctx.len();
        let fused = random_vec::<bf16>(&mut rng, max_seqs * fused_row);
        g.stream().memcpy_htod(&fused, &mut qkv).expect("qkv");
        step.stage(&st.seqs(), &st.slots).expect("stage");
        // SAFETY: every buffer the graph uses (qkv, out, the cache, the step's own) is alive
        // and unchanged in size.
        unsafe { step.replay(&graph) }.expect("replay");
        g.synchronize().expect("sync");
        let got_all = g.download(&out).expect("download");

        let part = |p: usize, rows: usize| -> Vec<bf16> {
            let off = parts[..p].iter().sum::<usize>() * d;
            let w = parts[p] * d;
            (0..rows)
                .flat_map(|t| fused[t * fused_row + off..t * fused_row + off + w].to_vec())
                .collect()
        };
        let (q, k, v) = (part(0, n), part(1, n), part(2, n));
        // The host mirror: the same cache writes, then the oracle on the last layer.
        for layer in 0..layers {
            let mut hv = host.view_mut::<bf16>().expect("view");
            cpu::reshape_and_cache(hv.layer_mut(layer).expect("layer"), &k, &v, &st.slots)
                .expect("cpu write");
        }
        let b = Batch {
            cfg,
            tables: st.tables.clone(),
            mbps,
            ctx: st.ctx.clone(),
        };
        let layer = layers - 1;
        let want = cpu_decode(&b, &host, layer, &q, &params);
        let what = format!("replay {i}, contexts {ctx:?}");
        assert_close(&format!("{what} vs oracle"), &got_all[..n * row], &want, d);
        assert!(
            got_all[n * row..].iter().all(|x| x.to_f32() == 0.0),
            "{what}: padding rows not zero"
        );
        // The eager launch on the same device state (the replay's cache writes included).
        let dseqs = DeviceSeqs::upload(&g, &cfg, &st.seqs()).expect("seqs");
        let dq = g.upload(&q).expect("q");
        let mut eager = g.alloc_zeros::<bf16>(n * row).expect("eager out");
        cache
            .paged_attention_decode(
                &g,
                layer,
                &dq,
                &dseqs,
                &eager_params,
                &mut DecodeWorkspace::new(),
                &mut eager,
            )
            .expect("eager");
        let eager = g.download(&eager).expect("download");
        assert_close(&format!("{what} vs eager"), &got_all[..n * row], &eager, d);
        // The device cache equals the mirror: the captured cache writes used this step's slots.
        let mut back = HostKvCache::new(cfg).expect("host");
        cache.download_to(&g, &mut back).expect("download cache");
        assert!(
            back.as_bytes() == host.as_bytes(),
            "{what}: cache bytes differ"
        );
    }
    g.synchronize().expect("sync");
}

/// `stage` refuses what does not fit the step or the cache, and leaves the staged metadata
/// as it was (an eager step after a refusal still runs the last good metadata).
#[test]
fn decode_step_refuses_bad_metadata() {
    let Some(g) = gpu("decode_step_refuses_bad_metadata") else {
        return;
    };
    let mut rng = SmallRng::seed_from_u64(42);
    let cfg = KvCacheConfig::new(1, 2, 64, 16, 40, bf16::DTYPE).expect("cfg");
    let params = pagedkv::kv::AttnParams::new(4, 64);
    let dparams = DeviceAttnParams::upload(&g, &cfg, &params).expect("params");
    let mut step =
        DecodeStep::new(&g, &cfg, dparams, 4, 8, DecodeMode::SplitK).expect("decode step");
    assert!(step.plan().num_splits() >= 2);
    let good = make_step(&mut rng, &cfg, &[20, 3], 8);
    step.stage(&good.seqs(), &good.slots).expect("stage");
    let five = make_step(&mut rng, &cfg, &[1, 1, 1, 1, 1], 8);
    assert!(matches!(
        step.stage(&five.seqs(), &five.slots),
        Err(CudaError::Raw(RawError::OverCapacity {
            what: "num_seqs",
            ..
        }))
    ));
    let wide = make_step(&mut rng, &cfg, &[20], 9);
    assert!(matches!(
        step.stage(&wide.seqs(), &wide.slots),
        Err(CudaError::Raw(RawError::OverCapacity {
            what: "max_blocks_per_seq",
            ..
        }))
    ));
    let mut bad_block = make_step(&mut rng, &cfg, &[20], 8);
    bad_block.tables[1] = 40;
    assert!(matches!(
        step.stage(&bad_block.seqs(), &bad_block.slots),
        Err(CudaError::Attn(AttnError::BlockOutOfRange { .. }))
    ));
    let bad_slot = make_step(&mut rng, &cfg, &[20], 8);
    assert!(matches!(
        step.stage(&bad_slot.seqs(), &[640]),
        Err(CudaError::Attn(AttnError::SlotOutOfRange { .. }))
    ));
    assert_eq!(
        step.live_seqs(),
        2,
        "a refused stage changed the staged batch"
    );
}

/// A step's cache write before its first `upload` skips every row: the device metadata starts
/// as the staging does (slot -1, context 0). It used to start zeroed, and every row's K/V
/// landed in slot 0 (page 0, which the step's sequences may not own).
#[test]
fn decode_step_before_its_first_upload_writes_nothing() {
    let Some(g) = gpu("decode_step_before_its_first_upload_writes_nothing") else {
        return;
    };
    let cfg = KvCacheConfig::new(1, 2, 64, 16, 4, bf16::DTYPE).expect("cfg");
    let params = pagedkv::kv::AttnParams::new(4, 64);
    let dparams = DeviceAttnParams::upload(&g, &cfg, &params).expect("params");
    let step = DecodeStep::new(&g, &cfg, dparams, 4, 2, DecodeMode::Auto).expect("decode step");
    let mut cache = DeviceKvCache::new(&g, cfg).expect("cache");
    let row = cfg.token_stride();
    let kv = g.upload(&vec![bf16::ONE; 4 * row]).expect("k/v");
    step.reshape_and_cache(
        &mut cache,
        0,
        pagedkv::cuda::TokenRows::dense(&kv, row),
        pagedkv::cuda::TokenRows::dense(&kv, row),
    )
    .expect("cache write");
    let q = g.upload(&vec![bf16::ONE; 4 * 4 * 64]).expect("q");
    let mut out = g.upload(&vec![bf16::NAN; 4 * 4 * 64]).expect("out");
    step.attention(
        &cache,
        0,
        pagedkv::cuda::TokenRows::dense(&q, 4 * 64),
        pagedkv::cuda::TokenRowsMut::dense(&mut out, 4 * 64),
    )
    .expect("attention");
    let mut back = HostKvCache::new(cfg).expect("host");
    cache.download_to(&g, &mut back).expect("download cache");
    assert!(
        back.as_bytes().iter().all(|&b| b == 0),
        "a write before the first upload changed the cache"
    );
    let out = g.download(&out).expect("download");
    assert!(
        out.iter().all(|x| x.to_f32() == 0.0),
        "padding rows not zero"
    );
}
