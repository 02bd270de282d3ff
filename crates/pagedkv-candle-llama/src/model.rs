//! The llama forward pass as pagedkv's [`StepModel`]: candle ops for everything but the
//! attention, which is pagedkv's paged attention over its KV arena.
//!
//! Per step the engine calls, for each layer, [`qkv`](StepModel::qkv) (RMSNorm, Q/K/V
//! projections, RoPE: the layer's inputs in pagedkv's `[tokens, heads, head_dim]` layout),
//! writes K/V into the paged cache, runs paged attention, and calls
//! [`attended`](StepModel::attended) (output projection, residual, RMSNorm, SwiGLU MLP,
//! residual); then [`sample`](StepModel::sample) (final RMSNorm, output projection for the
//! rows that need logits, greedy argmax). The step's tokens of every sequence are one flat
//! batch `[tokens, dim]`: chunked prefills and decodes of many sequences share each matmul.

use crate::config::LlamaConfig;
use crate::error::{Error, Result};
use crate::rope::Rope;
use crate::weights::{MatMulMode, Weights};
use candle_core::{Device, Tensor};
use pagedkv::engine::{HostBackend, KvBackend, LayerQkv, StepModel};
use pagedkv::error::EngineError;
use pagedkv::gguf::Gguf;
use pagedkv::kv::KvCacheConfig;
use pagedkv::sched::{Batch, SeqId, SeqRequest};

/// The logits of one sampled token, kept when [`PagedLlama::record_logits`] is on.
#[derive(Debug, Clone, PartialEq)]
pub struct RowLogits {
    /// The sequence.
    pub seq: SeqId,
    /// Position of the input token whose next-token logits these are.
    pub position: i32,
    /// `[vocab]`.
    pub logits: Vec<f32>,
}

/// A llama whose KV cache, attention and scheduling are pagedkv's.
#[derive(Debug)]
pub struct PagedLlama {
    cfg: LlamaConfig,
    weights: Weights,
    rope: Rope,
    device: Device,
    /// The residual stream of the step's tokens, `[tokens, dim]`: the embeddings before
    /// layer 0's `qkv`, each layer's output after its `attended`.
    hidden: Option<Tensor>,
    /// This step's RoPE rows, `[tokens, 1, head_dim / 2]`.
    rope_rows: Option<(Tensor, Tensor)>,
    /// The current layer's projections in pagedkv's layout, lent to the executor (host path).
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// The current layer's projections on the device and their views (CUDA path).
    #[cfg(feature = "candle-cuda")]
    pub(crate) device_qkv: Option<crate::cuda::LayerTensors>,
    record: bool,
    logits: Vec<RowLogits>,
}

impl PagedLlama {
    /// Loads the model from a parsed GGUF file. Every tensor's bytes come through pagedkv's
    /// parser; norms and the embedding are dequantized by pagedkv; float projections are
    /// dequantized and multiplied in f32, quantized ones as [`MatMulMode`] says (candle's
    /// `QMatMul` rules, so the model computes what `quantized_llama` computes). The file's
    /// bytes may be dropped afterwards: every weight is copied.
    pub fn from_gguf(g: &Gguf<'_>, mode: MatMulMode) -> Result<Self> {
        Self::from_gguf_on(g, mode, &Device::Cpu)
    }

    /// [`from_gguf`](Self::from_gguf) with every weight on `device` (a CUDA device runs the
    /// model on candle's CUDA kernels; quantized projections stay quantized there).
    pub fn from_gguf_on(g: &Gguf<'_>, mode: MatMulMode, device: &Device) -> Result<Self> {
        let cfg = LlamaConfig::from_gguf(g)?;
        let weights = Weights::load(g, &cfg, mode, device)?;
        let device = device.clone();
        let rope = Rope::new(
            cfg.head_dim(),
            cfg.params.rope_freq_base,
            &cfg.rope_scaling,
            &device,
        )?;
        Ok(Self {
            cfg,
            weights,
            rope,
            device,
            hidden: None,
            rope_rows: None,
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            #[cfg(feature = "candle-cuda")]
            device_qkv: None,
            record: false,
            logits: Vec::new(),
        })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The device the weights and activations live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Refuses a request the model cannot run (an empty prompt, a token outside the
    /// vocabulary), before it is queued: a step that meets such a token fails as a whole.
    pub fn check_request(&self, req: &SeqRequest) -> Result<()> {
        if req.prompt.is_empty() {
            return Err(Error::BadInput(format!(
                "request {} has an empty prompt",
                req.id
            )));
        }
        self.check_tokens(req.id, &req.prompt)
    }

    /// Checks draft tokens before `Engine::propose`: one outside the vocabulary would fail the
    /// whole step (every sequence in it) at the embedding lookup.
    ///
    /// # Errors
    /// [`Error::BadInput`] naming the first token outside the vocabulary.
    pub fn check_drafts(&self, id: u64, drafts: &[u32]) -> Result<()> {
        self.check_tokens(id, drafts)
    }

    fn check_tokens(&self, id: u64, tokens: &[u32]) -> Result<()> {
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(Error::BadInput(format!(
                "request {id}: token {t} is outside the vocabulary of {}",
                self.cfg.vocab_size
            )));
        }
        Ok(())
    }

    /// Keeps (or stops keeping) every sampled row's logits, for [`take_logits`](Self::take_logits).
    pub fn record_logits(&mut self, on: bool) {
        self.record = on;
    }

    /// The logits kept since the last call, in sampling order.
    pub fn take_logits(&mut self) -> Vec<RowLogits> {
        std::mem::take(&mut self.logits)
    }

    /// Checks the step's tokens and the backend's geometry, embeds the tokens and computes the
    /// step's RoPE rows (at layer 0).
    pub(crate) fn begin_step(
        &mut self,
        kv: &KvCacheConfig,
        query_heads: usize,
        batch: &Batch,
    ) -> Result<()> {
        if kv.num_layers() != self.cfg.n_layers()
            || kv.num_kv_heads() != self.cfg.n_kv_heads()
            || kv.head_dim() != self.cfg.head_dim()
            || query_heads != self.cfg.n_heads()
        {
            return Err(Error::Unsupported(format!(
                "the backend's cache ({} layers, {} KV heads of {}, {} query heads) is not this \
                 model's ({} layers, {} KV heads of {}, {} query heads)",
                kv.num_layers(),
                kv.num_kv_heads(),
                kv.head_dim(),
                query_heads,
                self.cfg.n_layers(),
                self.cfg.n_kv_heads(),
                self.cfg.head_dim(),
                self.cfg.n_heads()
            )));
        }
        if let Some(&t) = batch
            .input_tokens
            .iter()
            .find(|&&t| t as usize >= self.cfg.vocab_size)
        {
            return Err(Error::BadInput(format!(
                "token {t} is outside the vocabulary of {}",
                self.cfg.vocab_size
            )));
        }
        if batch.positions.iter().any(|&p| p < 0) {
            return Err(Error::BadInput("a negative position".into()));
        }
        let ids = Tensor::new(batch.input_tokens.as_slice(), &self.device)?;
        self.hidden = Some(self.weights.embedding.index_select(&ids, 0)?);
        self.rope_rows = Some(self.rope.tables(&batch.positions)?);
        Ok(())
    }

    fn layer(&self, layer: usize) -> Result<&crate::weights::LayerWeights> {
        self.weights.layers.get(layer).ok_or_else(|| {
            Error::BadInput(format!(
                "layer {layer} of a model of {} layers",
                self.cfg.n_layers()
            ))
        })
    }

    /// The layer's q, k, v as `[tokens, heads * head_dim]` f32 tensors on the model's device,
    /// contiguous in pagedkv's `[tokens, heads, head_dim]` order.
    pub(crate) fn project(&self, layer: usize) -> Result<(Tensor, Tensor, Tensor)> {
        let (Some(x), Some(rows)) = (&self.hidden, &self.rope_rows) else {
            return Err(Error::BadInput(format!(
                "qkv of layer {layer} before layer 0 of the step"
            )));
        };
        let w = self.layer(layer)?;
        let h = candle_nn::ops::rms_norm(x, &w.attn_norm, self.cfg.params.norm_eps)?;
        let q = Rope::apply(&w.wq.forward(&h)?, self.cfg.n_heads(), rows)?;
        let k = Rope::apply(&w.wk.forward(&h)?, self.cfg.n_kv_heads(), rows)?;
        let v = w.wv.forward(&h)?;
        let tokens = x.dim(0)?;
        Ok((
            q.reshape((tokens, ()))?.contiguous()?,
            k.reshape((tokens, ()))?.contiguous()?,
            v.contiguous()?,
        ))
    }

    fn project_host(&mut self, layer: usize) -> Result<()> {
        let (q, k, v) = self.project(layer)?;
        self.q = q.flatten_all()?.to_vec1()?;
        self.k = k.flatten_all()?.to_vec1()?;
        self.v = v.flatten_all()?.to_vec1()?;
        Ok(())
    }

    /// The step's `[tokens, dim]` (tokens and model width) while a step runs.
    pub(crate) fn step_shape(&self, layer: usize) -> Result<(usize, usize)> {
        let Some(x) = &self.hidden else {
            return Err(Error::BadInput(format!(
                "attention output of layer {layer} before its qkv"
            )));
        };
        Ok(x.dims2()?)
    }

    fn finish_layer_host(&mut self, layer: usize, out: &[f32]) -> Result<()> {
        let (tokens, dim) = self.step_shape(layer)?;
        if out.len() != tokens * dim {
            return Err(Error::BadInput(format!(
                "attention output of {} values for {tokens} tokens of width {dim}",
                out.len()
            )));
        }
        let attn = Tensor::from_slice(out, (tokens, dim), &self.device)?;
        self.finish_layer(layer, &attn)
    }

    /// The rest of layer `layer` after attention: `attn` is its output, `[tokens, dim]` f32 on
    /// the model's device.
    pub(crate) fn finish_layer(&mut self, layer: usize, attn: &Tensor) -> Result<()> {
        let Some(x) = &self.hidden else {
            return Err(Error::BadInput(format!(
                "attention output of layer {layer} before its qkv"
            )));
        };
        let w = self.layer(layer)?;
        let x = (w.wo.forward(attn)? + x)?;
        let h = candle_nn::ops::rms_norm(&x, &w.ffn_norm, self.cfg.params.norm_eps)?;
        let gated = (candle_nn::ops::silu(&w.gate.forward(&h)?)? * w.up.forward(&h)?)?;
        self.hidden = Some((w.down.forward(&gated)? + x)?);
        Ok(())
    }

    pub(crate) fn sample_rows(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<()> {
        // The step's hidden state is used once: a later step starts from its own embeddings.
        let hidden = self.hidden.take();
        self.rope_rows = None;
        if batch.logits_indices.is_empty() {
            return Ok(());
        }
        let Some(x) = hidden else {
            return Err(Error::BadInput("sampling before the step ran".into()));
        };
        let idx: Vec<u32> = batch.logits_indices.iter().map(|&i| i as u32).collect();
        let rows = x.index_select(&Tensor::new(idx.as_slice(), &self.device)?, 0)?;
        let h =
            candle_nn::ops::rms_norm(&rows, &self.weights.final_norm, self.cfg.params.norm_eps)?;
        let logits: Vec<Vec<f32>> = self.weights.output.forward(&h)?.to_vec2()?;
        for (&t, row) in batch.logits_indices.iter().zip(logits) {
            out.push(argmax(&row));
            if self.record {
                self.logits.push(RowLogits {
                    seq: batch.seq_ids[row_of(batch, t)],
                    position: batch.positions[t as usize],
                    logits: row,
                });
            }
        }
        Ok(())
    }
}

impl AsRef<PagedLlama> for PagedLlama {
    fn as_ref(&self) -> &PagedLlama {
        self
    }
}

/// The first index of the largest value (greedy sampling; NaN never wins: all NaN gives 0).
pub fn argmax(xs: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in xs.iter().enumerate() {
        if !x.is_nan() && best.is_none_or(|(_, b)| x > b) {
            best = Some((i, x));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

/// The row whose tokens include flattened token `t`.
fn row_of(batch: &Batch, t: i32) -> usize {
    // query_start_loc is non-decreasing with num_seqs + 1 entries; the row is the last start
    // at or before t.
    batch.query_start_loc.partition_point(|&s| s <= t) - 1
}

impl StepModel<HostBackend<f32>> for PagedLlama {
    fn qkv(
        &mut self,
        backend: &HostBackend<f32>,
        layer: usize,
        batch: &Batch,
    ) -> Result<LayerQkv<'_, [f32]>, EngineError> {
        if layer == 0 {
            self.begin_step(backend.config(), backend.query_heads(), batch)
                .map_err(Error::into_engine)?;
        }
        self.project_host(layer).map_err(Error::into_engine)?;
        Ok(LayerQkv {
            query: &self.q,
            key: &self.k,
            value: &self.v,
        })
    }

    fn attended(&mut self, layer: usize, _batch: &Batch, out: &[f32]) -> Result<(), EngineError> {
        self.finish_layer_host(layer, out)
            .map_err(Error::into_engine)
    }

    fn sample(&mut self, batch: &Batch, out: &mut Vec<u32>) -> Result<(), EngineError> {
        self.sample_rows(batch, out).map_err(Error::into_engine)
    }
}
