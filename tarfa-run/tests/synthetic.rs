//! Random small models of every family: structure the oracle fixtures do not cover (dense
//! layers, q/k/v/o biases, shared experts, tied embeddings, whole-projection q/k norm), checked
//! for the contract's invariances, and the error paths of loading and running.

mod common;

use std::sync::Arc;

use common::bits;
use common::synthetic::*;
use serde_json::json;
use tarfa_run::cpu::{CpuEngine, CpuModel, EngineOptions, ForwardOptions, LogitRows};
use tarfa_run::generate::greedy;
use tarfa_run::model::{layer_name, MlpKind};
use tarfa_run::numerics::{bf16_to_f32, AlignedVec, Kernel};
use tarfa_run::weights::{
    load_safetensors_dir, Bf16Matrix, ExpertWeights, HostTensor, InMemorySource, TensorData,
    WeightError, WeightSource,
};
use tarfa_run::{Backend, RunError};

fn model(src: InMemorySource, cfg: &serde_json::Value) -> Arc<CpuModel> {
    Arc::new(CpuModel::load(parse(cfg), Arc::new(src)).unwrap())
}

fn engine(m: &Arc<CpuModel>, threads: usize, kernel: Kernel) -> CpuEngine {
    CpuEngine::new(m.clone(), EngineOptions { threads, kernel }).unwrap()
}

fn logits_in_chunks(eng: &CpuEngine, prompt: &[u32], chunk: usize) -> Vec<Vec<f32>> {
    let mut cache = eng.model().new_cache();
    let opts = ForwardOptions {
        logits: LogitRows::All,
        ..Default::default()
    };
    prompt
        .chunks(chunk)
        .flat_map(|c| eng.forward(&mut cache, c, &opts).unwrap().logits)
        .collect()
}

fn families() -> Vec<(&'static str, serde_json::Value)> {
    vec![
        // dense layers 0 and 2 (mlp_only_layers, decoder_sparse_step), all biases, tied lm_head
        (
            "qwen3_moe",
            json!({"mlp_only_layers": [0], "decoder_sparse_step": 2, "attention_bias": true,
                   "tie_word_embeddings": true}),
        ),
        ("qwen2_moe", json!({"norm_topk_prob": false})),
        (
            "mixtral",
            json!({"num_local_experts": 8, "intermediate_size": 48}),
        ),
        (
            "olmoe",
            json!({"norm_topk_prob": false, "num_key_value_heads": 4}),
        ),
    ]
}

#[test]
fn every_family_is_invariant_to_chunking_threads_and_simd_path() {
    let prompt: Vec<u32> = (0..21).map(|i| (i * 37 + 5) % 96).collect();
    for (family, over) in families() {
        let cfg = config_json(family, over);
        let c = parse(&cfg);
        let m = model(random_source(&c, 42), &cfg);
        if family == "qwen3_moe" {
            use MlpKind::{Dense, Moe};
            assert_eq!(m.spec().layers, vec![Dense, Moe, Dense]);
            assert!(m.spec().qkv_bias && m.spec().o_bias);
        }
        if family == "qwen2_moe" {
            assert!(m.spec().shared_expert && m.spec().qkv_bias && !m.spec().o_bias);
        }
        let mut reference: Option<Vec<Vec<u32>>> = None;
        for kernel in Kernel::all_available() {
            for threads in [1, 2] {
                let eng = engine(&m, threads, kernel);
                let whole = logits_in_chunks(&eng, &prompt, prompt.len());
                assert!(whole.iter().flatten().all(|v| v.is_finite()), "{family}");
                assert!(
                    bits(&whole) == bits(&logits_in_chunks(&eng, &prompt, 1)),
                    "{family}: prefill vs decode"
                );
                assert!(
                    bits(&whole) == bits(&logits_in_chunks(&eng, &prompt, 5)),
                    "{family}: chunks of 5"
                );
                match &reference {
                    None => reference = Some(bits(&whole)),
                    Some(r) => assert!(*r == bits(&whole), "{family}: {kernel:?} x{threads}"),
                }
            }
        }
    }
}

/// The backend seam: `Backend::greedy_step` (the step the CLI runs when it keeps no logits)
/// chooses, step after step, the tokens the one greedy loop (`generate::greedy`, generic over the
/// backend) chooses, on every family, and leaves the cache as long.
#[test]
fn backend_greedy_steps_choose_the_greedy_loops_tokens() {
    let prompt: Vec<u32> = (0..9).map(|i| (i * 29 + 3) % 96).collect();
    let n_new = 6;
    for (family, over) in families() {
        let cfg = config_json(family, over);
        let m = model(random_source(&parse(&cfg), 7), &cfg);
        let eng = engine(&m, 2, Kernel::best());
        let mut looped = m.new_cache();
        let g = greedy(
            &eng,
            &mut looped,
            &prompt,
            n_new,
            &ForwardOptions::default(),
        )
        .unwrap();
        assert_eq!(g.tokens.len(), n_new, "{family}");
        assert_eq!(g.step_logits.len(), n_new, "{family}");
        let mut stepped = m.new_cache();
        let prefill = eng
            .forward(&mut stepped, &prompt, &ForwardOptions::default())
            .unwrap();
        assert!(
            bits(&prefill.logits) == bits(&g.step_logits[..1]),
            "{family}"
        );
        let mut tokens = vec![g.tokens[0]];
        for _ in 1..n_new {
            let (next, stats) = eng
                .greedy_step(&mut stepped, *tokens.last().unwrap())
                .unwrap();
            assert!(stats.weight_bytes > 0, "{family}: a step reads weights");
            tokens.push(next);
        }
        assert_eq!(tokens, g.tokens, "{family}");
        assert_eq!(stepped.len(), prompt.len() + n_new - 1, "{family}");
        assert_eq!(looped.len(), stepped.len(), "{family}");
    }
}

/// F32 weights are used as they are, through the same canonical dot: a BF16 matrix and its exact
/// widening to F32 must give the same bits.
#[test]
fn f32_copies_of_bf16_weights_give_identical_logits() {
    let cfg = config_json("qwen3_moe", json!({}));
    let c = parse(&cfg);
    let prompt: Vec<u32> = (0..9).map(|i| (i * 11 + 3) % 96).collect();
    let base = model(random_source(&c, 7), &cfg);
    let mut widened = random_source(&c, 7);
    let names: Vec<String> = widened.tensor_names().map(String::from).collect();
    for name in names {
        let t = widened.tensor(&name).unwrap();
        if let TensorData::Bf16(d) = &t.data {
            let f: Vec<f32> = d.iter().map(|&b| bf16_to_f32(b)).collect();
            let t32 = HostTensor::new(&name, t.shape.clone(), TensorData::F32(f.into())).unwrap();
            widened.insert_tensor(name, t32);
        }
    }
    let wide = model(widened, &cfg);
    for kernel in Kernel::all_available() {
        let a = logits_in_chunks(&engine(&base, 2, kernel), &prompt, prompt.len());
        let b = logits_in_chunks(&engine(&wide, 2, kernel), &prompt, prompt.len());
        assert!(bits(&a) == bits(&b), "{kernel:?}");
    }
}

#[test]
fn missing_or_misshapen_tensors_are_named_errors() {
    let cfg = config_json("qwen3_moe", json!({}));
    let c = parse(&cfg);
    let name = layer_name(c.family.names.k_proj, 1);
    let mut src = random_source(&c, 1);
    src.remove_tensor(&name);
    match CpuModel::load(c.clone(), Arc::new(src)) {
        Err(RunError::Weights(WeightError::MissingTensor(n))) => assert_eq!(n, name),
        other => panic!("expected MissingTensor, got {:?}", other.err()),
    }
    let qn = layer_name(c.family.names.q_norm, 2);
    let mut src = random_source(&c, 1);
    let bad = HostTensor::new(&qn, vec![8], TensorData::Bf16(AlignedVec::zeroed(8))).unwrap();
    src.insert_tensor(qn.clone(), bad);
    match CpuModel::load(c.clone(), Arc::new(src)) {
        Err(RunError::Weights(WeightError::ShapeMismatch {
            name,
            expected,
            found,
        })) => {
            assert_eq!((name, expected, found), (qn, vec![16], vec![8]));
        }
        other => panic!("expected ShapeMismatch, got {:?}", other.err()),
    }
    assert!(matches!(
        HostTensor::new("x", vec![2, 3], TensorData::Bf16(AlignedVec::zeroed(5))),
        Err(WeightError::LengthMismatch { .. })
    ));
}

#[test]
fn a_misshapen_expert_fails_the_step_and_leaves_the_cache_as_it_was() {
    let cfg = config_json("qwen3_moe", json!({}));
    let c = parse(&cfg);
    let mut src = random_source(&c, 3);
    for e in 0..c.num_experts {
        let m = |rows, cols| Bf16Matrix {
            rows,
            cols,
            data: AlignedVec::zeroed(rows * cols),
        };
        // down is [H, I]; give it [I, H]
        src.insert_expert(
            2,
            e,
            ExpertWeights {
                gate: m(48, 64),
                up: m(48, 64),
                down: m(48, 64),
            },
        );
    }
    let m = model(src, &cfg);
    let eng = engine(&m, 2, Kernel::best());
    let mut cache = m.new_cache();
    let err = eng
        .forward(&mut cache, &[1, 2, 3], &ForwardOptions::default())
        .unwrap_err();
    assert!(
        matches!(err, RunError::Weights(WeightError::ShapeMismatch { .. })),
        "{err}"
    );
    assert_eq!(cache.len(), 0);
}

/// One tensor of a checkpoint being written: name, dtype, shape, little-endian bytes.
type Item = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);
/// A corruption of a checkpoint and the error it must cause.
type Case<'a> = (
    &'static str,
    Box<dyn Fn(&mut Vec<Item>) + 'a>,
    fn(&WeightError) -> bool,
);

/// A fresh directory under the system temp dir.
fn temp_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("tarfa-run-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes the tensors of `src` (experts under their checkpoint names) to one safetensors file,
/// with `edit` applied to the (name, dtype, shape, bytes) list first.
fn write_checkpoint(
    dir: &std::path::Path,
    c: &tarfa_run::config::MoeConfig,
    src: &InMemorySource,
    edit: impl FnOnce(&mut Vec<Item>),
) {
    use safetensors::Dtype;
    let mut items: Vec<Item> = Vec::new();
    let bytes16 = |d: &[u16]| d.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
    for name in src.tensor_names() {
        let t = src.tensor(name).unwrap();
        match &t.data {
            TensorData::Bf16(d) => {
                items.push((name.to_string(), Dtype::BF16, t.shape.clone(), bytes16(d)))
            }
            TensorData::F32(d) => items.push((
                name.to_string(),
                Dtype::F32,
                t.shape.clone(),
                d.iter().flat_map(|v| v.to_le_bytes()).collect(),
            )),
        }
    }
    let spec = tarfa_run::model::ArchSpec::new(c);
    for (l, k) in spec.layers.iter().enumerate() {
        if *k != MlpKind::Moe {
            continue;
        }
        let ids: Vec<usize> = (0..c.num_experts).collect();
        for (e, w) in src.experts(l, &ids).unwrap().into_iter().enumerate() {
            for (pat, m) in [
                (spec.names.expert_gate, &w.gate),
                (spec.names.expert_up, &w.up),
                (spec.names.expert_down, &w.down),
            ] {
                let name = tarfa_run::model::expert_name(pat, l, e);
                items.push((name, Dtype::BF16, vec![m.rows, m.cols], bytes16(&m.data)));
            }
        }
    }
    edit(&mut items);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = items
        .iter()
        .map(|(n, dt, shape, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*dt, shape.clone(), b).unwrap(),
            )
        })
        .collect();
    let bytes = safetensors::tensor::serialize(views, None).unwrap();
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
}

#[test]
fn safetensors_loader_round_trips_and_rejects_bad_checkpoints() {
    let cfg = config_json(
        "mixtral",
        json!({"num_local_experts": 8, "intermediate_size": 48}),
    );
    let c = parse(&cfg);
    let spec = tarfa_run::model::ArchSpec::new(&c);
    let src = random_source(&c, 9);
    let prompt = [5u32, 9, 1, 0, 77];

    // round trip: the same weights through a file give the same bits
    let dir = temp_dir("ok");
    write_checkpoint(&dir, &c, &src, |_| {});
    let loaded = load_safetensors_dir(&dir, &c, &spec).unwrap();
    let a = logits_in_chunks(&engine(&model(src, &cfg), 1, Kernel::best()), &prompt, 5);
    let b = logits_in_chunks(&engine(&model(loaded, &cfg), 1, Kernel::best()), &prompt, 5);
    assert!(bits(&a) == bits(&b));

    let src = random_source(&c, 9);
    let expert = tarfa_run::model::expert_name(spec.names.expert_up, 1, 3);
    let cases: Vec<Case<'_>> = vec![
        (
            "missing-expert",
            Box::new(|items: &mut Vec<Item>| items.retain(|i| i.0 != expert)),
            |e| {
                matches!(
                    e,
                    WeightError::MissingExpert {
                        layer: 1,
                        expert: 3,
                        ..
                    }
                )
            },
        ),
        (
            "f32-expert",
            Box::new(
                |items: &mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>| {
                    for i in items.iter_mut().filter(|i| i.0 == expert) {
                        i.1 = safetensors::Dtype::F32;
                        i.3 = vec![0; i.3.len() * 2];
                    }
                },
            ),
            |e| matches!(e, WeightError::ExpertNotBf16 { .. }),
        ),
        (
            "f16-tensor",
            Box::new(
                |items: &mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>| {
                    for i in items.iter_mut().filter(|i| i.0 == "model.norm.weight") {
                        i.1 = safetensors::Dtype::F16;
                    }
                },
            ),
            |e| matches!(e, WeightError::UnsupportedDtype { .. }),
        ),
        (
            "expert-shape",
            Box::new(
                |items: &mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>| {
                    for i in items.iter_mut().filter(|i| i.0 == expert) {
                        i.2 = vec![i.2[1], i.2[0]];
                    }
                },
            ),
            |e| matches!(e, WeightError::ShapeMismatch { .. }),
        ),
    ];
    for (tag, edit, want) in cases {
        let dir = temp_dir(tag);
        write_checkpoint(&dir, &c, &src, |items| edit(items));
        let err = load_safetensors_dir(&dir, &c, &spec).expect_err(tag);
        assert!(want(&err), "{tag}: {err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
    let empty = temp_dir("empty");
    assert!(matches!(
        load_safetensors_dir(&empty, &c, &spec),
        Err(WeightError::NoFiles(_))
    ));
    std::fs::write(empty.join("bad.safetensors"), b"not a safetensors file").unwrap();
    assert!(matches!(
        load_safetensors_dir(&empty, &c, &spec),
        Err(WeightError::Safetensors { .. })
    ));
    let _ = std::fs::remove_dir_all(&empty);
    let _ = std::fs::remove_dir_all(&dir);
}
