//! Bad input is refused with a typed error, never a panic: files this client does not run,
//! missing tensors, and tokens outside the vocabulary (before they are queued, and, if a
//! caller bypasses the check, as a failed step).

use pagedkv::error::{EngineError, KvError};
use pagedkv::gguf::{GgmlType, Gguf, GgufError, GgufWriter, MetaValue};
use pagedkv::sched::{PreemptionMode, Priority, SeqRequest, StopRules};
use pagedkv_candle_llama::fixture::TinyLlama;
use pagedkv_candle_llama::{build_engine, generate, EngineSetup, Error, MatMulMode, PagedLlama};

/// The tiny F32 file with its metadata passed through `edit` (`None` drops an entry) and
/// without the tensor `drop`.
fn rewritten(
    edit: impl Fn(&str, MetaValue) -> Option<(String, MetaValue)>,
    drop: Option<&str>,
) -> Vec<u8> {
    let bytes = TinyLlama::f32().write(9).unwrap();
    let g = Gguf::parse(&bytes).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in g.metadata() {
        if let Some((k, v)) = edit(k, MetaValue::from_value(v)) {
            w.add(&k, v).unwrap();
        }
    }
    for t in g.tensors().iter().filter(|t| Some(t.name()) != drop) {
        w.add_tensor(t.name(), t.ty(), t.shape(), t.data()).unwrap();
    }
    w.to_bytes().unwrap()
}

fn load(bytes: &[u8]) -> Result<PagedLlama, Error> {
    PagedLlama::from_gguf(&Gguf::parse(bytes).unwrap(), MatMulMode::Quantized)
}

/// Steps until a step fails (the first steps may schedule nothing while the coordinator's
/// budgets settle); panics if none does.
fn failing_step(
    engine: &mut pagedkv::engine::Engine<pagedkv::engine::HostBackend<f32>>,
    model: &mut PagedLlama,
) -> EngineError {
    for _ in 0..8 {
        if let Err(e) = engine.step(model) {
            return e;
        }
    }
    panic!("no step failed");
}

fn request(id: u64, prompt: Vec<u32>) -> SeqRequest {
    SeqRequest {
        id,
        prompt,
        stop: StopRules {
            max_new_tokens: 4,
            eos: Vec::new(),
            stop_sequences: Vec::new(),
        },
        priority: Priority::Throughput,
    }
}

#[test]
fn a_neox_rope_architecture_is_refused() {
    let bytes = rewritten(
        |k, v| match (k, v) {
            ("general.architecture", _) => Some((k.into(), MetaValue::String("qwen2".into()))),
            (k, v) => Some((k.replacen("llama.", "qwen2.", 1), v)),
        },
        None,
    );
    assert!(matches!(load(&bytes), Err(Error::Unsupported(m)) if m.contains("qwen2")));
}

/// The tiny F32 file with the metadata entries `extra` and the F32 tensors `tensors` added.
fn with_extra(extra: &[(&str, MetaValue)], tensors: &[(&str, Vec<f32>)]) -> Vec<u8> {
    let bytes = TinyLlama::f32().write(9).unwrap();
    let g = Gguf::parse(&bytes).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in g.metadata() {
        w.add(k, MetaValue::from_value(v)).unwrap();
    }
    for (k, v) in extra {
        w.add(k, v.clone()).unwrap();
    }
    for t in g.tensors() {
        w.add_tensor(t.name(), t.ty(), t.shape(), t.data()).unwrap();
    }
    let data: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    for ((name, values), data) in tensors.iter().zip(&data) {
        w.add_tensor(name, GgmlType::F32, &[values.len() as u64], data)
            .unwrap();
    }
    w.to_bytes().unwrap()
}

/// A RoPE scaling this client does not run (YaRN, LongRoPE, an attention factor) is refused,
/// not run with wrong logits, and so are unusable scale factors and malformed llama3
/// frequency factors; linear scaling (new or legacy key, with or without a type), llama3
/// factors and scalings that change nothing load, with the `RopeScaling` llama.cpp reads.
#[test]
fn rope_scalings_are_read_as_llama_cpp_reads_them() {
    let pairs = 16; // head_dim 32
    let refused = |extra: &[(&str, MetaValue)], tensors: &[(&str, Vec<f32>)], what: &str| {
        let r = load(&with_extra(extra, tensors));
        assert!(
            matches!(&r, Err(Error::Unsupported(m)) if m.contains("rope")),
            "{what}: {r:?}"
        );
    };
    let ty = |t: &str| ("llama.rope.scaling.type", MetaValue::String(t.into()));
    let factor = |f: f32| ("llama.rope.scaling.factor", MetaValue::F32(f));
    refused(&[ty("yarn"), factor(4.0)], &[], "yarn");
    refused(&[ty("longrope")], &[], "longrope");
    refused(
        &[("llama.rope.scaling.attn_factor", MetaValue::F32(1.2))],
        &[],
        "attention factor",
    );
    for f in [-2.0, f32::NAN, f32::INFINITY, 1e-45] {
        refused(&[factor(f)], &[], &format!("factor {f}"));
    }
    refused(
        &[],
        &[("rope_freqs.weight", vec![1.0; pairs + 1])],
        "factors of the wrong length",
    );
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let mut f = vec![1.0; pairs];
        f[3] = bad;
        refused(&[], &[("rope_freqs.weight", f)], &format!("factor {bad}"));
    }

    let scaling = |extra: &[(&str, MetaValue)], tensors: &[(&str, Vec<f32>)]| {
        let model = load(&with_extra(extra, tensors)).unwrap();
        let s = &model.config().rope_scaling;
        (s.freq_scale, s.freq_factors.clone())
    };
    assert_eq!(scaling(&[], &[]), (1.0, None));
    assert_eq!(scaling(&[ty("linear"), factor(4.0)], &[]), (0.25, None));
    // llama.cpp's default type is linear: a factor alone scales.
    assert_eq!(scaling(&[factor(2.0)], &[]), (0.5, None));
    let legacy = ("llama.rope.scale_linear", MetaValue::F32(2.0));
    assert_eq!(scaling(std::slice::from_ref(&legacy), &[]), (0.5, None));
    // The new key wins over the legacy one; 0 is "unset"; type "none" never scales.
    assert_eq!(scaling(&[factor(4.0), legacy], &[]), (0.25, None));
    assert_eq!(scaling(&[factor(0.0)], &[]), (1.0, None));
    assert_eq!(scaling(&[ty("none"), factor(4.0)], &[]), (1.0, None));
    let llama3: Vec<f32> = (0..pairs).map(|i| 1.0 + i as f32 / 2.0).collect();
    assert_eq!(
        scaling(&[], &[("rope_freqs.weight", llama3.clone())]),
        (1.0, Some(llama3.clone()))
    );
    // A new key that is present wins even at 0 ("unset"): the legacy key is not read.
    let legacy = ("llama.rope.scale_linear", MetaValue::F32(2.0));
    assert_eq!(scaling(&[factor(0.0), legacy], &[]), (1.0, None));
    // "none" forces freq_scale to 1 but llama.cpp still loads rope_freqs for every type
    // other than longrope, and divides by it.
    assert_eq!(
        scaling(
            &[ty("none"), factor(4.0)],
            &[("rope_freqs.weight", llama3.clone())]
        ),
        (1.0, Some(llama3))
    );
    // An attention factor of exactly 1 changes nothing; the YaRN-only keys (original
    // context length, finetuned) feed only the YaRN ramp, which a linear type never runs.
    let attn_one = ("llama.rope.scaling.attn_factor", MetaValue::F32(1.0));
    let orig_ctx = (
        "llama.rope.scaling.original_context_length",
        MetaValue::U32(2048),
    );
    let finetuned = ("llama.rope.scaling.finetuned", MetaValue::Bool(true));
    assert_eq!(
        scaling(
            &[ty("linear"), factor(4.0), attn_one, orig_ctx, finetuned],
            &[]
        ),
        (0.25, None)
    );
}

/// A Mixtral-style llama (routed experts instead of the dense MLP) is refused as such, not as
/// a missing `ffn_gate` tensor; `expert_count` 0 is a dense model.
#[test]
fn a_mixture_of_experts_file_is_refused() {
    let r = load(&with_extra(
        &[("llama.expert_count", MetaValue::U32(8))],
        &[],
    ));
    assert!(
        matches!(&r, Err(Error::Unsupported(m)) if m.contains("mixture-of-experts")),
        "{r:?}"
    );
    assert!(load(&with_extra(
        &[("llama.expert_count", MetaValue::U32(0))],
        &[]
    ))
    .is_ok());
}

#[test]
fn a_partial_rope_is_refused() {
    let bytes = rewritten(
        |k, v| match k {
            "llama.rope.dimension_count" => Some((k.into(), MetaValue::U32(16))),
            _ => Some((k.into(), v)),
        },
        None,
    );
    assert!(matches!(load(&bytes), Err(Error::Unsupported(m)) if m.contains("rope")));
}

#[test]
fn a_missing_key_or_tensor_is_a_gguf_error() {
    let no_eps = rewritten(
        |k, v| (k != "llama.attention.layer_norm_rms_epsilon").then(|| (k.into(), v)),
        None,
    );
    assert!(matches!(
        load(&no_eps),
        Err(Error::Gguf(GgufError::MissingKey { .. }))
    ));
    let no_down = rewritten(|k, v| Some((k.into(), v)), Some("blk.1.ffn_down.weight"));
    assert!(matches!(
        load(&no_down),
        Err(Error::Gguf(GgufError::NoSuchTensor { .. }))
    ));
}

#[test]
fn tokens_outside_the_vocabulary_are_refused() {
    let bytes = TinyLlama::f32().write(9).unwrap();
    let mut model = load(&bytes).unwrap();
    let vocab = model.config().vocab_size as u32;
    let setup = EngineSetup {
        preemption: PreemptionMode::Recompute,
        ..EngineSetup::default()
    };
    let mut engine = build_engine(model.config(), &setup).unwrap();
    // Checked before anything is queued: the good request is not queued either.
    let bad = [request(1, vec![1, 2]), request(2, vec![3, vocab])];
    let err = generate(&mut engine, &mut model, bad, 100).unwrap_err();
    assert!(
        matches!(err, Error::BadInput(ref m) if m.contains("vocabulary")),
        "{err}"
    );
    assert!(!engine.has_work());
    assert!(matches!(
        generate(&mut engine, &mut model, [request(3, vec![])], 100),
        Err(Error::BadInput(_))
    ));
    // A caller that queues past the check gets a failed step, not a panic; aborting the
    // sequence at fault lets the engine go on (the failed batch is discarded at the next
    // step), and the good request beside it finishes.
    engine.add(request(5, vec![1, 2, 3])).unwrap();
    engine.add(request(4, vec![vocab + 7])).unwrap();
    let err = failing_step(&mut engine, &mut model);
    assert!(
        matches!(err, EngineError::Model(ref m) if m.contains("vocabulary")),
        "{err}"
    );
    engine.abort(4).unwrap();
    let mut done = Vec::new();
    for _ in 0..50 {
        if !engine.has_work() {
            break;
        }
        engine.step(&mut model).unwrap();
        done.extend(engine.finished().iter().map(|f| (f.id, f.output.len())));
    }
    assert!(!engine.has_work());
    assert!(done.contains(&(5, 4)), "{done:?}");
    // Drafts are checked the same way before `propose`.
    assert!(matches!(
        model.check_drafts(5, &[1, vocab]),
        Err(Error::BadInput(ref m)) if m.contains("vocabulary")
    ));
    model.check_drafts(5, &[1, 2]).unwrap();
}

#[test]
fn a_layer_count_the_file_does_not_hold_is_an_error() {
    // The header's claim of u32::MAX layers was a capacity taken before any tensor was
    // found: the allocation aborted the process.
    let bytes = rewritten(
        |k, v| match k {
            "llama.block_count" => Some((k.into(), MetaValue::U32(u32::MAX))),
            _ => Some((k.into(), v)),
        },
        None,
    );
    assert!(matches!(
        load(&bytes),
        Err(Error::Gguf(GgufError::NoSuchTensor { .. }))
    ));
}

#[test]
fn greedy_sampling_skips_nan() {
    use pagedkv_candle_llama::argmax;
    assert_eq!(argmax(&[f32::NAN, 1.0, 2.0]), 2);
    assert_eq!(argmax(&[1.0, f32::NAN, 0.5]), 0);
    assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
    assert_eq!(argmax(&[0.0, 3.0, 3.0]), 1);
}

#[test]
fn a_model_on_another_models_engine_is_refused() {
    let small = load(&TinyLlama::f32().write(9).unwrap()).unwrap();
    let mut other = load(
        &TinyLlama {
            kv_heads: 4,
            ..TinyLlama::f32()
        }
        .write(9)
        .unwrap(),
    )
    .unwrap();
    let mut engine = build_engine(small.config(), &EngineSetup::default()).unwrap();
    engine.add(request(1, vec![1, 2, 3])).unwrap();
    let err = failing_step(&mut engine, &mut other);
    assert!(
        matches!(err, EngineError::Model(ref m) if m.contains("KV heads")),
        "{err}"
    );
}

/// A RoPE base or norm epsilon that makes every logit NaN is refused at load (the client
/// loaded such a file and generated token 0 at every step).
#[test]
fn a_rope_base_or_epsilon_that_makes_nan_logits_is_refused() {
    for (key, bad) in [
        ("llama.rope.freq_base", 0.0f32),
        ("llama.rope.freq_base", f32::NAN),
        ("llama.attention.layer_norm_rms_epsilon", -1.0),
    ] {
        let bytes = rewritten(
            |k, v| {
                if k == key {
                    Some((k.into(), MetaValue::F32(bad)))
                } else {
                    Some((k.into(), v))
                }
            },
            None,
        );
        let r = load(&bytes);
        assert!(
            matches!(r, Err(Error::Gguf(GgufError::BadHyperparameter { .. }))),
            "{key} = {bad}: {:?}",
            r.map(|_| "loaded")
        );
    }
}

/// A context longer than the file's `llama.context_length` (the positions the model was
/// trained for) is refused when the engine is built, with a typed error naming both; the
/// file's own length is accepted.
#[test]
fn a_context_longer_than_the_files_is_refused() {
    let model = load(&TinyLlama::f32().write(9).unwrap()).unwrap();
    let trained = model.config().params.context_length;
    assert_eq!(trained, TinyLlama::f32().context);
    let setup = |max_context| EngineSetup {
        max_context,
        pages: trained.div_ceil(16),
        ..EngineSetup::default()
    };
    for too_long in [trained + 1, u32::MAX] {
        let r = build_engine(model.config(), &setup(too_long));
        assert!(
            matches!(
                r,
                Err(Error::ContextTooLong { max_context, context_length })
                    if max_context == too_long && context_length == trained
            ),
            "max_context {too_long} over context_length {trained}: {:?}",
            r.map(|_| "accepted")
        );
    }
    build_engine(model.config(), &setup(trained)).unwrap();
}

/// The engine runs the tokens per page it was given: its pages were sized for
/// `tokens_per_page`, but the arena's view picked the largest power of two up to 256 that
/// fits, so 24 ran 16 tokens a page (a third of the KV memory unused) and 512 ran 256 (half).
/// A size the views do not take is refused.
#[test]
fn tokens_per_page_is_the_engines_or_refused() {
    let model = load(&TinyLlama::f32().write(9).unwrap()).unwrap();
    for tpp in [8, 16, 256, 24, 48, 512, 1, 3] {
        let setup = EngineSetup {
            tokens_per_page: tpp,
            ..EngineSetup::default()
        };
        match build_engine(model.config(), &setup) {
            Ok(engine) => assert_eq!(engine.tokens_per_page() as usize, tpp),
            Err(e) => {
                assert!(
                    matches!(e, Error::Kv(KvError::TokensPerPage { tokens_per_page, .. }) if tokens_per_page == tpp),
                    "{tpp}: {e}"
                );
                assert!(![8, 16, 256].contains(&tpp), "{tpp} refused: {e}");
            }
        }
    }
}

/// The fixture's writer refuses shapes it cannot write with a typed error, not a panic (no
/// heads divided by zero, no projection types indexed modulo zero, no count truncated to
/// 32 bits in the metadata).
#[test]
fn the_fixture_refuses_impossible_shapes() {
    let f32 = TinyLlama::f32();
    let bad = [
        (
            "no heads",
            TinyLlama {
                heads: 0,
                ..f32.clone()
            },
        ),
        (
            "no KV heads",
            TinyLlama {
                kv_heads: 0,
                ..f32.clone()
            },
        ),
        (
            "no projection types",
            TinyLlama {
                proj_types: vec![],
                ..f32.clone()
            },
        ),
        (
            "ungrouped KV heads",
            TinyLlama {
                kv_heads: 3,
                ..f32.clone()
            },
        ),
        (
            "vocab past 32 bits",
            TinyLlama {
                vocab: 1 << 32,
                dim: 1,
                heads: 1,
                kv_heads: 1,
                ..f32.clone()
            },
        ),
    ];
    for (what, spec) in bad {
        let r = std::panic::catch_unwind(|| spec.write(1).map(|b| b.len()));
        assert!(matches!(r, Ok(Err(_))), "{what}: {r:?}");
    }
}

/// A generation cut off by its step limit hands back what it produced: the sequences that
/// finished within the limit are in the error (the error carried only the limit, and their
/// outputs, already taken from the engine, were lost), and the engine can be stepped on.
#[test]
fn a_step_limit_keeps_the_finished_outputs() {
    let bytes = TinyLlama::f32().write(9).unwrap();
    let mut model = load(&bytes).unwrap();
    let mut engine = build_engine(model.config(), &EngineSetup::default()).unwrap();
    let mut long = request(2, vec![4, 5, 6]);
    long.stop.max_new_tokens = 60;
    let short = request(1, vec![1, 2, 3]); // 4 tokens
    let err = generate(&mut engine, &mut model, [short, long], 20).unwrap_err();
    let Error::StepLimit { steps, partial } = err else {
        panic!("{err}");
    };
    assert_eq!(steps, 20);
    assert_eq!(partial.steps, 20);
    assert_eq!(partial.outputs.len(), 1, "{:?}", partial.outputs);
    assert_eq!(partial.outputs[&1].len(), 4);
    assert!(partial.generated >= 4);
    assert!(engine.has_work());
    let rest = generate(&mut engine, &mut model, [], 200).unwrap();
    assert_eq!(rest.outputs[&2].len(), 60);
}

/// A llama file with bias tensors (llama.cpp's llama graph adds the optional
/// `blk.N.attn_{q,k,v,output}.bias` and `blk.N.ffn_{gate,up,down}.bias` it finds) is refused:
/// the client has no biases, so it loaded such a file and ran it with every bias left out
/// (candle's `quantized_llama` ignores them too, so the oracle agreed with the wrong logits).
#[test]
fn a_file_with_bias_tensors_is_refused() {
    for (name, len) in [
        ("blk.0.attn_q.bias", 256),
        ("blk.1.attn_k.bias", 64),
        ("blk.0.attn_output.bias", 256),
        ("blk.1.ffn_down.bias", 256),
        ("blk.0.ffn_up.bias", 512),
    ] {
        let r = load(&with_extra(&[], &[(name, vec![0.5; len])]));
        assert!(
            matches!(&r, Err(Error::Unsupported(m)) if m.contains(name)),
            "{name}: {:?}",
            r.map(|_| "loaded")
        );
    }
}

/// A generation whose step fails hands back what it produced, as a step limit does: the
/// sequences that finished before the failure are in the error (the error was the engine's
/// alone, and their outputs, already taken from the engine, were lost), and the engine can be
/// stepped on once the sequence at fault is aborted.
#[test]
fn a_failed_step_keeps_the_finished_outputs() {
    let bytes = TinyLlama::f32().write(9).unwrap();
    let mut model = load(&bytes).unwrap();
    let vocab = model.config().vocab_size as u32;
    let setup = EngineSetup {
        max_running: 1,
        ..EngineSetup::default()
    };
    let mut engine = build_engine(model.config(), &setup).unwrap();
    // Queued past the check (as a server adding requests itself would): one at a time, the
    // good one runs to its end before the bad one's first step fails.
    engine.add(request(1, vec![1, 2, 3])).unwrap();
    engine.add(request(2, vec![vocab + 1])).unwrap();
    let err = generate(&mut engine, &mut model, [], 100).unwrap_err();
    let Error::StepFailed { source, partial } = err else {
        panic!("{err}");
    };
    assert!(
        matches!(source, EngineError::Model(ref m) if m.contains("vocabulary")),
        "{source}"
    );
    assert_eq!(partial.outputs.len(), 1, "{:?}", partial.outputs);
    assert_eq!(partial.outputs[&1].len(), 4);
    engine.abort(2).unwrap();
    let rest = generate(&mut engine, &mut model, [], 100).unwrap();
    assert!(!engine.has_work());
    assert!(!rest.outputs.contains_key(&1), "{:?}", rest.outputs);
}

/// The RMSNorm epsilon is `layer_norm_rms_epsilon` (what candle and llama.cpp read for a
/// llama) even when the file also has a LayerNorm `layer_norm_epsilon`, which a llama's norms
/// never use.
#[test]
fn the_rms_epsilon_wins_over_a_layer_norm_epsilon() {
    let bytes = with_extra(
        &[("llama.attention.layer_norm_epsilon", MetaValue::F32(0.5))],
        &[],
    );
    let model = load(&bytes).unwrap();
    assert_eq!(
        model.config().params.norm_eps,
        TinyLlama::f32().rms_eps,
        "the norm epsilon read"
    );
}

/// A model deeper than the engine's cache is refused too: the engine calls only the layers
/// its cache has, so the model would run its first layers alone and sample from them.
#[test]
fn a_model_on_a_shallower_engine_is_refused() {
    let shallow = load(
        &TinyLlama {
            layers: 1,
            ..TinyLlama::f32()
        }
        .write(9)
        .unwrap(),
    )
    .unwrap();
    let mut deep = load(&TinyLlama::f32().write(9).unwrap()).unwrap();
    let mut engine = build_engine(shallow.config(), &EngineSetup::default()).unwrap();
    engine.add(request(1, vec![1, 2, 3])).unwrap();
    let err = failing_step(&mut engine, &mut deep);
    assert!(
        matches!(err, EngineError::Model(ref m) if m.contains("1 layers") && m.contains("2 layers")),
        "{err}"
    );
}

/// A model run on an engine built for another query-head count (same KV shape: 4 heads of 32
/// dims beside 8) is refused by name at its first step: the query rows it would write are
/// sized for the other model's heads.
#[test]
fn a_model_on_an_engine_of_other_query_heads_is_refused() {
    let narrow = load(
        &TinyLlama {
            dim: 128,
            heads: 4,
            ..TinyLlama::f32()
        }
        .write(9)
        .unwrap(),
    )
    .unwrap();
    let mut wide = load(&TinyLlama::f32().write(9).unwrap()).unwrap();
    assert_eq!(narrow.config().kv_shape(), wide.config().kv_shape());
    let mut engine = build_engine(narrow.config(), &EngineSetup::default()).unwrap();
    engine.add(request(1, vec![1, 2, 3])).unwrap();
    let err = failing_step(&mut engine, &mut wide);
    assert!(
        matches!(err, EngineError::Model(ref m) if m.contains("4 query heads") && m.contains("8 query heads")),
        "{err}"
    );
}
