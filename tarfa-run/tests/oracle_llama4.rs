//! Llama 4 (text) against transformers' float32 run of the shared `llama4-a` checkpoint: top-1
//! sigmoid routing that scales the expert's input, a shared expert, fused experts (gate and up
//! the two halves of `gate_up_proj`), chunked attention (16) on the rotating layers, a NoPE layer,
//! the weightless q/k L2 norm. Then what can be derived by hand about the features the fixture
//! leaves unexercised (temperature tuning, a chunk longer than every prompt, dense layers).
//!
//! `TARFA_EXTRA_ORACLES=/work/shared/oracle cargo test -p tarfa-run --test oracle_llama4 -- --ignored`

mod common;

use common::family_cli::invariances_are_bitwise;
use common::*;
use tarfa_run::cpu::{ForwardOptions, LogitRows};
use tarfa_run::numerics::Kernel;

fn shared(name: &str) -> std::path::PathBuf {
    let root = std::env::var("TARFA_EXTRA_ORACLES")
        .expect("set TARFA_EXTRA_ORACLES to the directory holding the extra oracle fixtures");
    let dir = std::path::Path::new(&root).join(name);
    assert!(
        dir.join("reference.safetensors").is_file(),
        "{}: no reference.safetensors (TARFA_EXTRA_ORACLES={root})",
        dir.display()
    );
    dir
}

/// The checkpoint in `source` run under `dir`'s config with `edit` applied: every prompt's
/// prefill logits at every position, as bits.
fn prefill_bits_with(
    f: &Fixture,
    dir: &std::path::Path,
    source: std::sync::Arc<tarfa_run::weights::InMemorySource>,
    edit: impl Fn(&mut serde_json::Value),
) -> Vec<Vec<Vec<u32>>> {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    edit(&mut v);
    let cfg = tarfa_run::config::MoeConfig::from_json_str(&v.to_string()).unwrap();
    let model = std::sync::Arc::new(tarfa_run::cpu::CpuModel::load(cfg, source).unwrap());
    let eng = tarfa_run::cpu::CpuEngine::new(
        model.clone(),
        tarfa_run::cpu::EngineOptions {
            threads: 2,
            kernel: Kernel::best(),
        },
    )
    .unwrap();
    let opts = ForwardOptions {
        logits: LogitRows::All,
        ..Default::default()
    };
    f.prompts
        .iter()
        .map(|r| {
            let mut cache = model.new_cache();
            bits(&eng.forward(&mut cache, &r.prompt, &opts).unwrap().logits)
        })
        .collect()
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn llama4_matches_transformers() {
    check_against_oracle(&load_fixture_from(&shared("llama4-a"), "llama4-a"));
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn llama4_invariances_are_bitwise() {
    invariances_are_bitwise(&load_fixture_from(&shared("llama4-a"), "llama4-a"));
}

/// Chunked attention: a chunk at least as long as every prompt is no chunk, bit for bit (equal
/// to making every layer full attention); the fixture's chunk of 16 matters on its 33- and
/// 100-token prompts, and positions before 16 keep their bits.
#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn llama4_a_chunk_longer_than_every_prompt_equals_full_attention() {
    let dir = shared("llama4-a");
    let f = load_fixture_from(&dir, "llama4-a");
    let src = || f.source.clone();
    let wide = prefill_bits_with(&f, &dir, src(), |v| v["attention_chunk_size"] = 4096.into());
    let full = prefill_bits_with(&f, &dir, src(), |v| {
        v["layer_types"] = serde_json::json!(vec!["full_attention"; 4]);
    });
    assert!(wide == full);
    let own = prefill_bits_with(&f, &dir, src(), |_| {});
    for (i, (got, want)) in own.iter().zip(&full).enumerate() {
        let n = got.len();
        assert!(
            got[..n.min(16)] == want[..n.min(16)],
            "prompt {i}: positions < 16 lie in the first chunk"
        );
        if n > 16 {
            assert!(
                got[n - 1] != want[n - 1],
                "prompt {i}: the last position sees its chunk only"
            );
        }
    }
}

/// Attention temperature tuning: below position `floor_scale - 1` the scale is exactly 1
/// (`floor(...) = 0`, `log1p(0) = 0`), so on llama4-a (floor_scale 8192) turning it off changes
/// no bit; with floor_scale 4 the NoPE layer's queries are scaled from position 3 on, so
/// positions 0..3 keep their bits and the later ones change.
#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn llama4_temperature_tuning_starts_at_floor_scale() {
    let dir = shared("llama4-a");
    let f = load_fixture_from(&dir, "llama4-a");
    let src = || f.source.clone();
    let own = prefill_bits_with(&f, &dir, src(), |_| {});
    let off = prefill_bits_with(&f, &dir, src(), |v| {
        v["attn_temperature_tuning"] = false.into()
    });
    assert!(own == off, "the scale is exactly 1 below position 8191");
    let four = prefill_bits_with(&f, &dir, src(), |v| v["floor_scale"] = 4.into());
    for (i, (got, want)) in four.iter().zip(&own).enumerate() {
        let n = got.len();
        assert!(
            got[..n.min(3)] == want[..n.min(3)],
            "prompt {i}: (pos + 1) / 4 < 1"
        );
        if n > 3 {
            assert!(
                got[n - 1] != want[n - 1],
                "prompt {i}: scaled from position 3"
            );
        }
    }
}

/// Every tensor of a checkpoint directory: name -> (dtype, shape, bytes).
type Tensors = std::collections::BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>;

fn read_tensors(dir: &std::path::Path) -> Tensors {
    let mut out = Tensors::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        if !name.ends_with(".safetensors") || name == "reference.safetensors" {
            continue;
        }
        let bytes = std::fs::read(&p).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (n, v) in st.tensors() {
            out.insert(n, (v.dtype(), v.shape().to_vec(), v.data().to_vec()));
        }
    }
    out
}

/// `tensors` and `config` written as one checkpoint directory, loaded as a source.
fn write_checkpoint(
    tmp: &std::path::Path,
    tensors: &Tensors,
    config: &serde_json::Value,
) -> (
    tarfa_run::config::MoeConfig,
    tarfa_run::weights::InMemorySource,
) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (dt, shape, b))| {
            let v = safetensors::tensor::TensorView::new(*dt, shape.clone(), b).unwrap();
            (n.clone(), v)
        })
        .collect();
    let bytes = safetensors::serialize(views, None).unwrap();
    std::fs::write(tmp.join("model.safetensors"), bytes).unwrap();
    std::fs::write(tmp.join("config.json"), config.to_string()).unwrap();
    let cfg = tarfa_run::config::MoeConfig::from_json_str(&config.to_string()).unwrap();
    let spec = tarfa_run::model::ArchSpec::new(&cfg);
    let src = tarfa_run::weights::load_safetensors_dir(tmp, &cfg, &spec).unwrap();
    (cfg, src)
}

/// A dense layer (not in `moe_layers`, width `intermediate_size_mlp`, tensors
/// `feed_forward.{gate,up,down}_proj`) holding layer 3's shared-expert weights computes what
/// layer 3's MoE block computes once its routed experts output zero (`down_proj` all zeros: the
/// routed sum is +0, and `0 + shared = shared`), bit for bit, at every position of every prompt.
/// llama4-a has no dense layer; this is the check that one is loaded and run as transformers'
/// `Llama4TextMLP(intermediate_size_mlp)` where `interleave_moe_layer_step` puts one.
#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn llama4_a_dense_layer_is_the_shared_expert_alone() {
    let dir = shared("llama4-a");
    let f = load_fixture_from(&dir, "llama4-a");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let tensors = read_tensors(&dir);
    let ff = |s: &str| format!("model.layers.3.feed_forward.{s}");

    let mut zeroed = tensors.clone();
    let down = zeroed.get_mut(&ff("experts.down_proj")).unwrap();
    down.2.iter_mut().for_each(|b| *b = 0);
    let mut dense = tensors.clone();
    for p in ["gate_proj", "up_proj", "down_proj"] {
        let t = dense
            .remove(&ff(&format!("shared_expert.{p}.weight")))
            .unwrap();
        dense.insert(ff(&format!("{p}.weight")), t);
    }
    for n in ["experts.gate_up_proj", "experts.down_proj", "router.weight"] {
        dense.remove(&ff(n)).unwrap();
    }
    let mut dense_cfg = config.clone();
    dense_cfg["moe_layers"] = serde_json::json!([0, 1, 2]);
    dense_cfg["intermediate_size_mlp"] = config["intermediate_size"].clone();

    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (_, zsrc) = write_checkpoint(a.path(), &zeroed, &config);
    let (dcfg, dsrc) = write_checkpoint(b.path(), &dense, &dense_cfg);
    assert_eq!(
        tarfa_run::model::ArchSpec::new(&dcfg).layers[3],
        tarfa_run::model::MlpKind::Dense
    );
    let z = prefill_bits_with(&f, a.path(), std::sync::Arc::new(zsrc), |_| {});
    let d = prefill_bits_with(&f, b.path(), std::sync::Arc::new(dsrc), |_| {});
    assert!(z == d, "a dense layer is the MLP alone");
    let own = prefill_bits_with(&f, &dir, f.source.clone(), |_| {});
    assert!(own != z, "layer 3's routed experts matter");
}

/// Llama 3.1's rope scaling (Scout's and Maverick's configs) by hand: with `factor` 1 and
/// `low_freq_factor == high_freq_factor` (no medium band, Scout's form) every frequency is kept
/// or divided by 1, so the logits are the unscaled ones bit for bit; with factor 8 the low
/// frequencies change and so do the logits (positions past 0: position 0 does not rotate).
#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn llama4_llama3_rope_scaling_of_factor_one_changes_nothing() {
    let dir = shared("llama4-a");
    let f = load_fixture_from(&dir, "llama4-a");
    let src = || f.source.clone();
    let l3 = |factor: f64| {
        move |v: &mut serde_json::Value| {
            v["rope_parameters"] = serde_json::json!({"rope_type": "llama3",
                "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
                "high_freq_factor": 1.0, "original_max_position_embeddings": 64});
        }
    };
    let own = prefill_bits_with(&f, &dir, src(), |_| {});
    assert!(prefill_bits_with(&f, &dir, src(), l3(1.0)) == own);
    let scaled = prefill_bits_with(&f, &dir, src(), l3(8.0));
    assert!(scaled[3][0] == own[3][0] && scaled[3][99] != own[3][99]);
}

/// Non-expert tensors every Llama 4 bundle must list before its experts (llama4-a: all four
/// layers MoE).
const LLAMA4_NON_EXPERT: &[&str] = &[
    "model.layers.0.feed_forward.router.weight",
    "model.layers.0.feed_forward.shared_expert.gate_proj.weight",
    "model.layers.0.feed_forward.shared_expert.down_proj.weight",
    "model.layers.3.self_attn.o_proj.weight",
];

/// The CLI on the converted bundle: every prompt's prefill logits, as bytes, equal the runtime
/// reading the checkpoint directory itself (`load_safetensors_dir`, no bundle). The CLI reads
/// bundles only, so the directory side is the library, with the same contract (threads and
/// SIMD paths give the same bits: `invariances_are_bitwise`).
fn bundle_logits_are_the_checkpoint_dirs(f: &Fixture, bundle: &std::path::Path) {
    let tmp = tempfile::tempdir().unwrap();
    let eng = engine(f, 1, Kernel::best());
    let opts = ForwardOptions {
        logits: LogitRows::All,
        ..Default::default()
    };
    for (i, (printed, file)) in common::family_cli::cli_runs(bundle, f, tmp.path())
        .into_iter()
        .enumerate()
    {
        let r = &f.prompts[i];
        assert_eq!(printed, r.greedy, "{} prompt {i}: greedy tokens", f.name);
        let st = safetensors::SafeTensors::deserialize(&file).unwrap();
        let got = st.tensor("prefill_logits").unwrap().data().to_vec();
        let mut cache = f.model.new_cache();
        let rows = eng.forward(&mut cache, &r.prompt, &opts).unwrap().logits;
        let want: Vec<u8> = rows
            .iter()
            .flatten()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert!(
            got == want,
            "{} prompt {i}: the bundle's prefill logits are the checkpoint directory's, byte for byte",
            f.name
        );
    }
}

/// llama4-dense-s (in the repository: dense layers 0 and 2) through the converter and the
/// `tarfa-run` binary: transformers' greedy tokens and logits within the oracle's tolerance,
/// and the checkpoint directory's logits byte for byte.
#[test]
fn llama4_dense_s_bundle_through_the_converter_and_the_cli() {
    let dir = fixture_dir("llama4-dense-s");
    common::family_cli::cli_matches_oracle(
        &dir,
        "llama4-dense-s",
        &[
            "model.layers.0.feed_forward.gate_proj.weight",
            "model.layers.1.feed_forward.router.weight",
            "model.layers.1.feed_forward.shared_expert.up_proj.weight",
        ],
        "model.layers.3.feed_forward.experts.7",
    );
    let tmp = tempfile::tempdir().unwrap();
    let bundle = tmp.path().join("bundle");
    tarfa_convert::convert(&dir, &bundle, &Default::default()).unwrap();
    bundle_logits_are_the_checkpoint_dirs(&load_fixture("llama4-dense-s"), &bundle);
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn llama4_a_bundle_through_the_converter_and_the_cli() {
    let dir = shared("llama4-a");
    common::family_cli::cli_matches_oracle(
        &dir,
        "llama4-a",
        LLAMA4_NON_EXPERT,
        "model.layers.2.feed_forward.experts.5",
    );
    let tmp = tempfile::tempdir().unwrap();
    let bundle = tmp.path().join("bundle");
    tarfa_convert::convert(&dir, &bundle, &Default::default()).unwrap();
    bundle_logits_are_the_checkpoint_dirs(&load_fixture_from(&dir, "llama4-a"), &bundle);
}

/// llama4-dense-s rewritten as the multimodal release lays a checkpoint out: every tensor
/// under `language_model.` (`language_model.model.*`, `language_model.lm_head.weight`), two small
/// fake vision-tower tensors, and the config wrapped (`model_type: "llama4"`, the text config
/// under `text_config`). `extra` adds top-level keys.
fn wrap_llama4(src: &std::path::Path, dst: &std::path::Path, extra: &[(&str, serde_json::Value)]) {
    std::fs::create_dir_all(dst).unwrap();
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let mut shards: Vec<String> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    shards.sort();
    shards.dedup();
    let mut weight_map = serde_json::Map::new();
    for (k, shard) in shards.iter().enumerate() {
        let bytes = std::fs::read(src.join(shard)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(n, t)| {
                let n = match n.strip_prefix("model.") {
                    Some(rest) => format!("language_model.model.{rest}"),
                    None => format!("language_model.{n}"),
                };
                (n, t.dtype(), t.shape().to_vec(), t.data().to_vec())
            })
            .collect();
        if k + 1 == shards.len() {
            for n in [
                "vision_model.x.weight",
                "multi_modal_projector.linear_1.weight",
            ] {
                owned.push((
                    n.into(),
                    safetensors::Dtype::BF16,
                    vec![4, 4],
                    vec![0x3f; 32],
                ));
            }
        }
        let views: Vec<(String, safetensors::tensor::TensorView)> = owned
            .iter()
            .map(|(n, d, s, b)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
                )
            })
            .collect();
        for (n, _) in &views {
            weight_map.insert(n.clone(), serde_json::Value::from(shard.clone()));
        }
        safetensors::serialize_to_file(views, None, &dst.join(shard)).unwrap();
    }
    let index = serde_json::json!({"metadata": index["metadata"], "weight_map": weight_map});
    std::fs::write(
        dst.join("model.safetensors.index.json"),
        serde_json::to_vec_pretty(&index).unwrap(),
    )
    .unwrap();
    let text: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    let mut config = serde_json::json!({
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "text_config": text,
        "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 4},
        "boi_token_index": 200080,
        "eoi_token_index": 200081,
        "image_token_index": 200092,
        "tie_word_embeddings": false,
    });
    for (k, v) in extra {
        config[*k] = v.clone();
    }
    std::fs::write(
        dst.join("config.json"),
        serde_json::to_vec_pretty(&config).unwrap(),
    )
    .unwrap();
    std::fs::copy(
        src.join("generation_config.json"),
        dst.join("generation_config.json"),
    )
    .unwrap();
}

/// The multimodal wrapper of llama4-dense-s (tensors under `language_model.`, a fake vision
/// tower, the config under `text_config`; the same helper as tarfa-convert/tests/llama4.rs)
/// converted and run through the CLI: the `--logits-out` tensors (prompt, tokens, prefill and
/// step logits) are the text form's bundle's, byte for byte, on every prompt.
#[test]
fn llama4_multimodal_wrapper_gives_the_text_forms_logits_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixture_dir("llama4-dense-s");
    let wrapped = tmp.path().join("wrapped");
    wrap_llama4(&dir, &wrapped, &[]);
    let (plain, bundle) = (tmp.path().join("plain"), tmp.path().join("bundle"));
    tarfa_convert::convert(&dir, &plain, &Default::default()).unwrap();
    tarfa_convert::convert(&wrapped, &bundle, &Default::default()).unwrap();
    let f = load_fixture("llama4-dense-s");
    let tensors = |bytes: &[u8]| -> Vec<(String, Vec<u8>)> {
        let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
        let mut v: Vec<(String, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(n, t)| (n, t.data().to_vec()))
            .collect();
        v.sort();
        v
    };
    let (p, w) = (tmp.path().join("p"), tmp.path().join("w"));
    std::fs::create_dir_all(&p).unwrap();
    std::fs::create_dir_all(&w).unwrap();
    let a = common::family_cli::cli_runs(&plain, &f, &p);
    let b = common::family_cli::cli_runs(&bundle, &f, &w);
    assert_eq!(a.len(), f.prompts.len());
    for (i, ((ta, fa), (tb, fb))) in a.iter().zip(&b).enumerate() {
        assert_eq!(ta, tb, "prompt {i}: tokens");
        assert!(tensors(fa) == tensors(fb), "prompt {i}: logits bytes");
    }
}

/// A llama4-dense-s bundle streamed under a budget of a few experts with no cache (every token
/// reads its experts from the bundle) writes the very `--logits-out` tensors it writes
/// resident, on every prompt.
#[test]
fn llama4_dense_s_bundle_streamed_equals_resident() {
    let tmp = tempfile::tempdir().unwrap();
    let bundle = tmp.path().join("bundle");
    tarfa_convert::convert(&fixture_dir("llama4-dense-s"), &bundle, &Default::default()).unwrap();
    let f = load_fixture("llama4-dense-s");
    let tensors = |path: &std::path::Path| -> Vec<(String, Vec<u8>)> {
        let bytes = std::fs::read(path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut v: Vec<(String, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(n, t)| (n, t.data().to_vec()))
            .collect();
        v.sort();
        v
    };
    for (i, r) in f.prompts.iter().enumerate() {
        let toks: Vec<String> = r.prompt.iter().map(|t| t.to_string()).collect();
        let mut files = Vec::new();
        for (k, extra) in [
            &[][..],
            &[
                "--ram-budget",
                "4M",
                "--cache-policy",
                "none",
                "--io",
                "cached",
            ][..],
        ]
        .into_iter()
        .enumerate()
        {
            let out = tmp.path().join(format!("p{i}-{k}.safetensors"));
            let summary = tmp.path().join(format!("p{i}-{k}.json"));
            let n = r.greedy.len().to_string();
            let mut args = vec!["generate", bundle.to_str().unwrap(), "--tokens"];
            let joined = toks.join(",");
            args.push(&joined);
            args.extend([
                "--max-new-tokens",
                &n,
                "--ignore-eos",
                "--prefill-logits",
                "--backend",
                "cpu",
                "--logits-out",
                out.to_str().unwrap(),
                "--summary-json",
                summary.to_str().unwrap(),
            ]);
            args.extend(extra);
            let (code, _, err) = common::family_cli::run(&args);
            assert_eq!(code, 0, "{err}");
            if k == 1 {
                let sum: serde_json::Value =
                    serde_json::from_slice(&std::fs::read(&summary).unwrap()).unwrap();
                let read = sum["stream"]["totals"]["bytes_read"].as_u64().unwrap_or(0);
                assert!(read > 0, "prompt {i}: the run streamed");
            }
            files.push(tensors(&out));
        }
        assert!(
            files[0] == files[1],
            "prompt {i}: streamed == resident, byte for byte"
        );
    }
}
