//! The step executor: one function that runs a [`Batch`] on any KV backend, in the order the
//! batch documents, with the caller's model supplying each layer's projections.

use crate::error::EngineError;
use crate::kv::KvCacheConfig;
use crate::sched::Batch;

/// A KV cache the step executor can drive: the CPU cache over the host arena
/// ([`HostBackend`](super::HostBackend)) or the CUDA kernels over a device arena
/// (`RawBackend`, features `cuda` / `cuda-emu`).
///
/// The executor calls, per step: [`swap_out`](Self::swap_out), [`swap_in`](Self::swap_in),
/// [`copy_blocks`](Self::copy_blocks) (each only when the batch has such work), then, when
/// the batch has tokens, [`begin`](Self::begin), and per layer
/// [`reshape_and_cache`](Self::reshape_and_cache) followed by [`decode`](Self::decode) (every
/// row one token) or [`prefill`](Self::prefill); and finally [`end`](Self::end) (also for a
/// batch of no tokens).
pub trait KvBackend {
    /// The buffer type of projections and attention output: a host slice, a device slice.
    type Buf: ?Sized;

    /// The cache's geometry (this model's view of the arena).
    fn config(&self) -> &KvCacheConfig;
    /// Query heads of the model (a multiple of the cache's KV heads).
    fn query_heads(&self) -> usize;
    /// Pages of the backend's host swap space: swap slots `0..swap_slots` are valid in
    /// [`swap_out`](Self::swap_out) and [`swap_in`](Self::swap_in). `None` (the default):
    /// not known. [`Engine::new`](super::Engine::new) refuses a swap-preempting engine whose
    /// `swap_blocks` exceed a known count (its batcher would hand out slots the backend
    /// refuses, failing every step that swaps into them).
    fn swap_slots(&self) -> Option<usize> {
        None
    }
    /// Copies `(page, swap slot)` pairs from the cache to swap space (every layer).
    fn swap_out(&mut self, pairs: &[(u32, u32)]) -> Result<(), EngineError>;
    /// Copies `(swap slot, page)` pairs from swap space into the cache.
    fn swap_in(&mut self, pairs: &[(u32, u32)]) -> Result<(), EngineError>;
    /// Copies `(src page, dst page)` pairs within the cache (copy-on-write).
    fn copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<(), EngineError>;
    /// Prepares the step's attention over `batch` (metadata upload, output sizing).
    fn begin(&mut self, batch: &Batch) -> Result<(), EngineError>;
    /// Writes the step's keys and values of `layer` into the slots of `batch.slot_mapping`.
    fn reshape_and_cache(
        &mut self,
        layer: usize,
        key: &Self::Buf,
        value: &Self::Buf,
        batch: &Batch,
    ) -> Result<(), EngineError>;
    /// Decode attention of `layer` (one query token per row); returns the output buffer.
    fn decode(
        &mut self,
        layer: usize,
        query: &Self::Buf,
        batch: &Batch,
    ) -> Result<&Self::Buf, EngineError>;
    /// Prefill attention of `layer` (rows of any length, causal); returns the output buffer.
    fn prefill(
        &mut self,
        layer: usize,
        query: &Self::Buf,
        batch: &Batch,
    ) -> Result<&Self::Buf, EngineError>;
    /// Ends the step: on a device, waits for its work so errors surface in this step.
    fn end(&mut self) -> Result<(), EngineError>;
}

/// A layer's projections of the step's tokens, in the layout the kernels take:
/// `query [tokens, query_heads, head_dim]`, `key` and `value [tokens, kv_heads, head_dim]`.
#[derive(Debug)]
pub struct LayerQkv<'a, B: ?Sized> {
    /// Queries.
    pub query: &'a B,
    /// Keys.
    pub key: &'a B,
    /// Values.
    pub value: &'a B,
}

/// The caller's model, as the step executor sees it: it projects each layer's inputs, takes
/// each layer's attention output, and samples one token per sampling row.
pub trait StepModel<K: KvBackend + ?Sized> {
    /// The projections of `layer` for `batch`'s tokens (called after the previous layer's
    /// [`attended`](Self::attended)).
    fn qkv(
        &mut self,
        backend: &K,
        layer: usize,
        batch: &Batch,
    ) -> Result<LayerQkv<'_, K::Buf>, EngineError>;
    /// The attention output of `layer`, `[tokens, query_heads, head_dim]`.
    fn attended(&mut self, layer: usize, batch: &Batch, out: &K::Buf) -> Result<(), EngineError>;
    /// One token per entry of `batch.logits_indices`, in order, appended to `out`: one per
    /// sampling row, or `drafts + 1` for a row with draft tokens (the token sampled after each
    /// of its last `drafts + 1` inputs; the commit accepts drafts while they equal these).
    fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError>;
}

/// What one executed step did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepStats {
    /// Tokens written to the cache (every row's new tokens).
    pub tokens: u64,
    /// KV bytes the attention read: every context token's K and V in every layer.
    pub kv_bytes_read: u64,
    /// Pages copied (copy-on-write), swapped out and swapped in.
    pub pages_moved: u64,
}

/// Runs one step's KV work and attention on `backend`, in the order [`Batch`] documents:
/// swap-outs first (a swap-in or new token of this step may reuse a page a swap-out reads),
/// then swap-ins, copy-on-write copies, and per layer `reshape_and_cache` before attention.
/// `pairs` is scratch reused across calls.
///
/// On an error the backend's work queued before it (swaps, copies, earlier layers) is waited
/// for before returning (`end`; its own error, if any, is dropped for the first one): the
/// batch is then discarded and its pages may go to another engine at once, which must not
/// meet this step's writes still in flight.
pub fn run_batch<K: KvBackend + ?Sized, M: StepModel<K> + ?Sized>(
    backend: &mut K,
    model: &mut M,
    batch: &Batch,
    pairs: &mut Vec<(u32, u32)>,
) -> Result<StepStats, EngineError> {
    let r = run_batch_steps(backend, model, batch, pairs);
    if r.is_err() {
        let _ = backend.end();
    }
    r
}

fn run_batch_steps<K: KvBackend + ?Sized, M: StepModel<K> + ?Sized>(
    backend: &mut K,
    model: &mut M,
    batch: &Batch,
    pairs: &mut Vec<(u32, u32)>,
) -> Result<StepStats, EngineError> {
    let mut stats = StepStats::default();
    for (list, op) in [
        (&batch.swap_out, Op::SwapOut),
        (&batch.swap_in, Op::SwapIn),
        (&batch.copies, Op::Copy),
    ] {
        if list.is_empty() {
            continue;
        }
        to_pairs(list, pairs)?;
        stats.pages_moved += pairs.len() as u64;
        match op {
            Op::SwapOut => backend.swap_out(pairs)?,
            Op::SwapIn => backend.swap_in(pairs)?,
            Op::Copy => backend.copy_blocks(pairs)?,
        }
    }
    let tokens = batch.num_tokens();
    if tokens == 0 {
        backend.end()?;
        return Ok(stats);
    }
    backend.begin(batch)?;
    let cfg = *backend.config();
    // Every row exactly one token (rows may be empty: as many rows as tokens is not enough).
    let decode_only = batch
        .query_start_loc
        .iter()
        .enumerate()
        .all(|(i, &q)| q as usize == i);
    for layer in 0..cfg.num_layers() {
        let qkv = model.qkv(backend, layer, batch)?;
        backend.reshape_and_cache(layer, qkv.key, qkv.value, batch)?;
        let out = if decode_only {
            backend.decode(layer, qkv.query, batch)?
        } else {
            backend.prefill(layer, qkv.query, batch)?
        };
        // The model's borrow of its projections ended with the attention call; the output
        // is the backend's.
        model.attended(layer, batch, out)?;
    }
    backend.end()?;
    stats.tokens = tokens as u64;
    stats.kv_bytes_read = kv_bytes_read(&cfg, batch);
    Ok(stats)
}

#[derive(Clone, Copy)]
enum Op {
    SwapOut,
    SwapIn,
    Copy,
}

/// KV bytes a step's attention reads: every context token's K and V in every layer.
pub fn kv_bytes_read(cfg: &KvCacheConfig, batch: &Batch) -> u64 {
    let ctx: u64 = batch.context_lens.iter().map(|&c| c.max(0) as u64).sum();
    let per_token =
        2 * cfg.num_layers() * cfg.num_kv_heads() * cfg.head_dim() * cfg.dtype().size_bytes();
    ctx * per_token as u64
}

/// The batch's `(i32, i32)` pairs as the caches' `(u32, u32)`; a negative id is refused.
fn to_pairs(src: &[(i32, i32)], dst: &mut Vec<(u32, u32)>) -> Result<(), EngineError> {
    dst.clear();
    for &(a, b) in src {
        let (Ok(a), Ok(b)) = (u32::try_from(a), u32::try_from(b)) else {
            return Err(EngineError::InvalidConfig(format!(
                "a batch names a negative page or swap slot: ({a}, {b})"
            )));
        };
        dst.push((a, b));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvDtype;

    /// Records which calls a step made; fails at `fail_at` (a call's name), if set.
    struct Recorder {
        cfg: KvCacheConfig,
        calls: Vec<&'static str>,
        fail_at: Option<&'static str>,
        out: Vec<f32>,
    }

    impl Recorder {
        fn call(&mut self, what: &'static str) -> Result<(), EngineError> {
            self.calls.push(what);
            match self.fail_at {
                Some(f) if f == what => Err(EngineError::Model(format!("{what} failed"))),
                _ => Ok(()),
            }
        }
    }

    impl KvBackend for Recorder {
        type Buf = [f32];
        fn config(&self) -> &KvCacheConfig {
            &self.cfg
        }
        fn query_heads(&self) -> usize {
            1
        }
        fn swap_out(&mut self, _: &[(u32, u32)]) -> Result<(), EngineError> {
            self.call("swap_out")
        }
        fn swap_in(&mut self, _: &[(u32, u32)]) -> Result<(), EngineError> {
            self.call("swap_in")
        }
        fn copy_blocks(&mut self, _: &[(u32, u32)]) -> Result<(), EngineError> {
            self.call("copy_blocks")
        }
        fn begin(&mut self, _: &Batch) -> Result<(), EngineError> {
            self.call("begin")
        }
        fn reshape_and_cache(
            &mut self,
            _: usize,
            _: &[f32],
            _: &[f32],
            _: &Batch,
        ) -> Result<(), EngineError> {
            self.call("reshape_and_cache")
        }
        fn decode(&mut self, _: usize, _: &[f32], _: &Batch) -> Result<&[f32], EngineError> {
            self.call("decode")?;
            Ok(&self.out)
        }
        fn prefill(&mut self, _: usize, _: &[f32], _: &Batch) -> Result<&[f32], EngineError> {
            self.call("prefill")?;
            Ok(&self.out)
        }
        fn end(&mut self) -> Result<(), EngineError> {
            self.call("end")
        }
    }

    struct Model(Vec<f32>);

    impl StepModel<Recorder> for Model {
        fn qkv(
            &mut self,
            _: &Recorder,
            _: usize,
            _: &Batch,
        ) -> Result<LayerQkv<'_, [f32]>, EngineError> {
            Ok(LayerQkv {
                query: &self.0,
                key: &self.0,
                value: &self.0,
            })
        }
        fn attended(&mut self, _: usize, _: &Batch, _: &[f32]) -> Result<(), EngineError> {
            Ok(())
        }
        fn sample(&mut self, _: &Batch, _: &mut Vec<u32>) -> Result<(), EngineError> {
            Ok(())
        }
    }

    fn run(rows: &[i32], copies: bool, fail_at: Option<&'static str>) -> (Vec<&'static str>, bool) {
        let mut b = Batch {
            query_start_loc: rows.to_vec(),
            seq_ids: (0..rows.len() as u64 - 1).collect(),
            input_tokens: vec![1; *rows.last().unwrap() as usize],
            ..Default::default()
        };
        if copies {
            b.copies.push((0, 1));
        }
        let mut backend = Recorder {
            cfg: KvCacheConfig::new(1, 1, 8, 4, 4, KvDtype::F32).unwrap(),
            calls: Vec::new(),
            fail_at,
            out: Vec::new(),
        };
        let ok = run_batch(&mut backend, &mut Model(Vec::new()), &b, &mut Vec::new()).is_ok();
        (backend.calls, ok)
    }

    /// Decode only where every row is one token: rows [2, 0] are as many rows as tokens, not
    /// a decode batch (decode would pair query row i with sequence i).
    #[test]
    fn decode_runs_only_for_one_token_rows() {
        assert!(run(&[0, 1, 2], false, None).0.contains(&"decode"));
        assert!(run(&[0, 2, 2], false, None).0.contains(&"prefill"));
        assert!(run(&[0, 3], false, None).0.contains(&"prefill"));
    }

    /// A step of page moves and no tokens still ends: on a device, `end` is what waits for the
    /// swaps and copies, before the batcher hands the pages they read to other sequences.
    #[test]
    fn a_step_of_no_tokens_still_ends() {
        let (calls, ok) = run(&[0], true, None);
        assert!(ok);
        assert_eq!(calls, ["copy_blocks", "end"]);
    }

    /// A step's stats count its new tokens, every context token's K and V in every layer, and
    /// every page it copied or swapped (the figures behind the engines' bandwidth reports).
    #[test]
    fn a_steps_stats_count_tokens_kv_bytes_and_pages_moved() {
        let b = Batch {
            // Two rows: one token, then two.
            query_start_loc: vec![0, 1, 3],
            seq_ids: vec![0, 1],
            input_tokens: vec![1; 3],
            context_lens: vec![5, 2],
            swap_out: vec![(2, 0)],
            swap_in: vec![(1, 3)],
            copies: vec![(0, 1), (2, 3)],
            ..Default::default()
        };
        let mut backend = Recorder {
            // 2 layers, 2 KV heads of 8 f32: 2 x 2 x 2 x 8 x 4 = 256 bytes of K and V a token.
            cfg: KvCacheConfig::new(2, 2, 8, 4, 4, KvDtype::F32).unwrap(),
            calls: Vec::new(),
            fail_at: None,
            out: Vec::new(),
        };
        let stats = run_batch(&mut backend, &mut Model(Vec::new()), &b, &mut Vec::new()).unwrap();
        assert_eq!(
            stats,
            StepStats {
                tokens: 3,
                kv_bytes_read: 7 * 256,
                pages_moved: 4,
            }
        );
    }

    /// A step that fails after queuing work waits for it (`end`) before returning the error.
    #[test]
    fn a_failed_step_still_ends() {
        for fail_at in ["copy_blocks", "begin", "reshape_and_cache", "decode"] {
            let (calls, ok) = run(&[0, 1], true, Some(fail_at));
            assert!(!ok);
            assert_eq!(
                calls.last(),
                Some(&"end"),
                "failing at {fail_at}: {calls:?}"
            );
        }
    }
}
