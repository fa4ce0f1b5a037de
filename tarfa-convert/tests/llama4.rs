//! Llama 4 (text) through the converter: each MoE layer's fused `feed_forward.experts`
//! (`gate_up_proj` `[E, H, 2I]`, gate and up the two HALVES of the columns, `down_proj`
//! `[E, I, H]`) split so that expert e's slices become its extent, re-laid into gate | up | down
//! by the declared permutation (`gate_up_concatenated_columns`), the manifest recording each
//! expert's source ranges, `tarfa-verify check --source` proving them (a flipped source byte
//! named as its expert). The extent is also re-derived here by hand from the shard bytes, with
//! transformers' `gate, up = gate_up.chunk(2, dim=-1)`, not with the code under test.
//!
//! `llama4-dense-s` is in the repository (dense layers 0 and 2, MoE layers 1 and 3) and always
//! runs; `llama4-a` is the shared oracle's:
//! `TARFA_EXTRA_ORACLES=/work/shared/oracle cargo test -p tarfa-convert --test llama4 -- --include-ignored`
//! The CLI runs of the bundles (greedy tokens and logits against transformers and against the
//! runtime on the checkpoint directory) are in tarfa-run/tests/oracle_llama4.rs, the crate that
//! has the `tarfa-run` binary.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use tarfa_verify::{check_bundle, CheckOptions};

const BIN: &str = env!("CARGO_BIN_EXE_tarfa-convert");

fn shared(name: &str) -> PathBuf {
    let root = std::env::var("TARFA_EXTRA_ORACLES")
        .expect("set TARFA_EXTRA_ORACLES to the directory holding the extra oracle fixtures");
    let dir = Path::new(&root).join(name);
    assert!(dir.join("config.json").is_file(), "{}", dir.display());
    dir
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/oracle")
        .join(name)
}

/// A copy of the checkpoint in `src` without the oracle's reference outputs.
fn copy_checkpoint(src: &Path, dst: &Path) {
    fs::create_dir_all(dst).unwrap();
    for e in fs::read_dir(src).unwrap().flatten() {
        let name = e.file_name().into_string().unwrap();
        if !name.starts_with("reference") {
            fs::copy(e.path(), dst.join(&name)).unwrap();
        }
    }
}

/// The binary on `src` -> `out`: (exit code, stdout, stderr).
fn convert_cli(src: &Path, out: &Path) -> (i32, String, String) {
    let o = Command::new(BIN).arg(src).arg(out).output().unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// (ok, [(failure name, kind)]) of `tarfa-verify check --source`. `ok == false` is what the
/// binary maps to exit 1 (tarfa-verify/src/main.rs).
fn verify(bundle: &Path, source: &Path) -> (bool, Vec<(String, String)>) {
    let opts = CheckOptions {
        source: Some(source.to_path_buf()),
        progress: false,
    };
    let r = check_bundle(bundle, &opts).unwrap();
    let f = r
        .failures
        .iter()
        .map(|f| {
            let v = serde_json::to_value(f).unwrap();
            (f.name.clone(), v["kind"].as_str().unwrap().to_string())
        })
        .collect();
    (r.ok, f)
}

fn flip_byte(path: &Path, offset: u64) {
    use std::os::unix::fs::FileExt;
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, offset).unwrap();
    f.write_all_at(&[b[0] ^ 0x10], offset).unwrap();
}

fn manifest(bundle: &Path) -> tarfa_manifest::Manifest {
    tarfa_manifest::Manifest::load(&bundle.join("manifest.toml")).unwrap()
}

/// The config's MoE layers, resolved here as transformers' Llama4TextConfig does.
fn moe_layers(config: &Value) -> Vec<u64> {
    let n = config["num_hidden_layers"].as_u64().unwrap();
    match config.get("moe_layers").and_then(Value::as_array) {
        Some(l) => l.iter().map(|x| x.as_u64().unwrap()).collect(),
        None => {
            let step = config["interleave_moe_layer_step"].as_u64().unwrap_or(1);
            (step - 1..n).step_by(step as usize).collect()
        }
    }
}

/// Expert e's extent worked out from its source slices by hand: `gu` is `[H, 2I]` (gate the
/// columns `0..I`, up the columns `I..2I`), `d` is `[I, H]`; the extent is gate `[I, H]`, up
/// `[I, H]`, down `[H, I]`, each `[out, in]`.
fn extent_by_hand(gu: &[u8], d: &[u8], h: usize, i: usize) -> Vec<u8> {
    let at = |b: &[u8], k: usize| [b[2 * k], b[2 * k + 1]];
    let mut out = Vec::with_capacity(6 * h * i);
    for half in [0, i] {
        for j in 0..i {
            for x in 0..h {
                out.extend(at(gu, x * 2 * i + half + j));
            }
        }
    }
    for y in 0..h {
        for j in 0..i {
            out.extend(at(d, j * h + y));
        }
    }
    out
}

/// The whole check on one Llama 4 checkpoint; `flips` are (layer, expert) to corrupt in turn.
fn fused_experts_are_proven(name: &str, src_dir: &Path, flips: &[(u64, u64)]) {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    copy_checkpoint(src_dir, &src);
    let config: Value =
        serde_json::from_slice(&fs::read(src.join("config.json")).unwrap()).unwrap();
    let (h, i) = (
        config["hidden_size"].as_u64().unwrap() as usize,
        config["intermediate_size"].as_u64().unwrap() as usize,
    );
    let n_experts = config["num_local_experts"].as_u64().unwrap();
    let layers = config["num_hidden_layers"].as_u64().unwrap();
    let moe = moe_layers(&config);

    let bundle = d.path().join("bundle");
    let (code, _, err) = convert_cli(&src, &bundle);
    assert_eq!(code, 0, "{name}: {err}");
    let m = manifest(&bundle);

    // One extent per (MoE layer, expert), named as docs/FORMAT.md says.
    let got: BTreeSet<String> = m.experts.iter().map(|e| e.name.clone()).collect();
    let want: BTreeSet<String> = moe
        .iter()
        .flat_map(|l| {
            (0..n_experts).map(move |e| format!("model.layers.{l}.feed_forward.experts.{e}"))
        })
        .collect();
    assert_eq!(got, want, "{name}: the extents");

    // The router and the shared expert of MoE layers, and the dense MLPs of the others, are
    // ordinary tensors; no q/k norm weight exists (use_qk_norm is a weightless L2 norm).
    let tensors: BTreeSet<&str> = m.tensors.iter().map(|t| t.name.as_str()).collect();
    for l in 0..layers {
        let ff = format!("model.layers.{l}.feed_forward");
        if moe.contains(&l) {
            for t in [
                "router.weight",
                "shared_expert.gate_proj.weight",
                "shared_expert.up_proj.weight",
                "shared_expert.down_proj.weight",
            ] {
                assert!(tensors.contains(format!("{ff}.{t}").as_str()), "{ff}.{t}");
            }
            assert!(!tensors.contains(format!("{ff}.gate_proj.weight").as_str()));
        } else {
            for t in ["gate_proj.weight", "up_proj.weight", "down_proj.weight"] {
                assert!(tensors.contains(format!("{ff}.{t}").as_str()), "{ff}.{t}");
            }
            assert!(!tensors.contains(format!("{ff}.router.weight").as_str()));
        }
    }
    assert!(!tensors
        .iter()
        .any(|t| t.contains("q_norm") || t.contains("k_norm")));

    // Every extent: the permutation named, its two source ranges expert e's slices, and its
    // bytes the by-hand re-layout of those ranges.
    let jnf = fs::read(bundle.join("model.jnf")).unwrap();
    for e in &m.experts {
        assert_eq!(
            e.relayout.as_deref(),
            Some("gate_up_concatenated_columns"),
            "{}",
            e.name
        );
        let srcs: Vec<&str> = e.sources.iter().map(|s| s.tensor.as_str()).collect();
        let base = format!("model.layers.{}.feed_forward.experts", e.layer);
        assert_eq!(
            srcs,
            [format!("{base}.gate_up_proj"), format!("{base}.down_proj")]
        );
        assert_eq!(e.sources[0].length as usize, 2 * h * 2 * i);
        assert_eq!(e.sources[1].length as usize, 2 * i * h);
        let roles: Vec<&str> = e.matrices.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["gate", "up", "down"]);
        let slice = |k: usize| {
            let s = &e.sources[k];
            let shard = fs::read(src.join(&s.shard)).unwrap();
            shard[s.offset as usize..][..s.length as usize].to_vec()
        };
        let want = extent_by_hand(&slice(0), &slice(1), h, i);
        assert!(
            jnf[e.offset as usize..][..e.length as usize] == want[..],
            "{}: the extent is the halves re-laid",
            e.name
        );
    }
    assert_eq!(
        verify(&bundle, &src),
        (true, vec![]),
        "{name}: check --source"
    );

    for &(layer, expert) in flips {
        let e = m
            .experts
            .iter()
            .find(|e| e.name == format!("model.layers.{layer}.feed_forward.experts.{expert}"))
            .unwrap();
        // A byte in the up half of gate_up (column I + 1 of row 1), then the last of down.
        for (k, at) in [
            (0usize, (2 * i + i + 1) as u64 * 2),
            (1, e.sources[1].length - 1),
        ] {
            let s = &e.sources[k];
            flip_byte(&src.join(&s.shard), s.offset + at);
            assert_eq!(
                verify(&bundle, &src),
                (
                    false,
                    vec![
                        (e.name.clone(), "source-bytes-differ".into()),
                        (s.shard.clone(), "shard-sha256-mismatch".into()),
                    ]
                ),
                "{name}: a flipped byte in {}'s slice of {}",
                e.name,
                s.tensor
            );
            flip_byte(&src.join(&s.shard), s.offset + at);
        }
    }
    assert_eq!(verify(&bundle, &src), (true, vec![]));
}

/// The in-repository fixture, with dense layers (the config says so; asserted first).
#[test]
fn llama4_dense_s_fused_experts_are_proven_against_their_source() {
    let dir = fixture("llama4-dense-s");
    let config: Value =
        serde_json::from_slice(&fs::read(dir.join("config.json")).unwrap()).unwrap();
    let moe = moe_layers(&config);
    let n = config["num_hidden_layers"].as_u64().unwrap();
    assert!(
        !moe.is_empty() && (moe.len() as u64) < n,
        "llama4-dense-s has dense and MoE layers: {moe:?}"
    );
    fused_experts_are_proven("llama4-dense-s", &dir, &[(1, 5), (3, 0)]);
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn llama4_a_fused_experts_are_proven_against_their_source() {
    fused_experts_are_proven("llama4-a", &shared("llama4-a"), &[(0, 3), (2, 7)]);
}

/// A fused tensor in the wrong dtype, or one under a dense layer, is refused by name with
/// nothing written.
#[test]
fn a_fused_tensor_in_a_dense_layer_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    copy_checkpoint(&fixture("llama4-dense-s"), &src);
    // Layer 1 becomes dense: its fused experts are then tensors of no rule.
    let p = src.join("config.json");
    let mut v: Value = serde_json::from_slice(&fs::read(&p).unwrap()).unwrap();
    v["moe_layers"] = serde_json::json!([3]);
    fs::write(&p, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    let out = d.path().join("out");
    let (code, _, err) = convert_cli(&src, &out);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("model.layers.1.feed_forward.experts."),
        "{err}"
    );
    assert!(!out.exists());
}

/// llama4-dense-s rewritten as the multimodal release lays a checkpoint out: every tensor
/// under `language_model.` (`language_model.model.*`, `language_model.lm_head.weight`), two small
/// fake vision-tower tensors, and the config wrapped (`model_type: "llama4"`, the text config
/// under `text_config`). `extra` adds top-level keys.
pub fn wrap_llama4(src: &Path, dst: &Path, extra: &[(&str, Value)]) {
    fs::create_dir_all(dst).unwrap();
    let index: Value =
        serde_json::from_slice(&fs::read(src.join("model.safetensors.index.json")).unwrap())
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
        let bytes = fs::read(src.join(shard)).unwrap();
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
            weight_map.insert(n.clone(), Value::from(shard.clone()));
        }
        safetensors::serialize_to_file(views, None, &dst.join(shard)).unwrap();
    }
    let index = serde_json::json!({"metadata": index["metadata"], "weight_map": weight_map});
    fs::write(
        dst.join("model.safetensors.index.json"),
        serde_json::to_vec_pretty(&index).unwrap(),
    )
    .unwrap();
    let text: Value = serde_json::from_slice(&fs::read(src.join("config.json")).unwrap()).unwrap();
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
    fs::write(
        dst.join("config.json"),
        serde_json::to_vec_pretty(&config).unwrap(),
    )
    .unwrap();
    fs::copy(
        src.join("generation_config.json"),
        dst.join("generation_config.json"),
    )
    .unwrap();
}

/// (name, sha256) of every tensor and expert of a bundle.
fn hashes(bundle: &Path) -> Vec<(String, String)> {
    let m = manifest(bundle);
    let mut v: Vec<(String, String)> = m
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.sha256.clone()))
        .chain(m.experts.iter().map(|e| (e.name.clone(), e.sha256.clone())))
        .collect();
    v.sort();
    v
}

/// The multimodal wrapper: its text model converted under the text model's names, the same
/// tensors and experts (byte for byte) as the text form's bundle, its config.json the text
/// config; the vision tower left out and named in the manifest and the report; `check
/// --source` passing against the wrapped source. An unknown top-level key, and a tensor that
/// is neither the text model's nor the vision tower's, are refused by name.
#[test]
fn a_multimodal_llama4_wrapper_converts_to_its_text_model() {
    let d = tempfile::tempdir().unwrap();
    let plain_src = fixture("llama4-dense-s");
    let wrapped = d.path().join("wrapped");
    wrap_llama4(&plain_src, &wrapped, &[]);
    let (plain, bundle) = (d.path().join("plain"), d.path().join("bundle"));
    let (code, _, err) = convert_cli(&plain_src, &plain);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = convert_cli(&wrapped, &bundle);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("vision tower left out: 2 tensors"), "{err}");
    assert_eq!(
        hashes(&bundle),
        hashes(&plain),
        "the text model, byte for byte"
    );
    let cfg = |b: &Path| -> Value {
        serde_json::from_slice(&fs::read(b.join("config.json")).unwrap()).unwrap()
    };
    assert_eq!(cfg(&bundle), cfg(&plain), "config.json is the text config");
    let toml = fs::read_to_string(bundle.join("manifest.toml")).unwrap();
    for needle in [
        "Llama4ForConditionalGeneration",
        "vision_model.*: 1",
        "multi_modal_projector.*: 1",
    ] {
        assert!(toml.contains(needle), "the manifest names {needle}");
    }
    assert!(!toml.contains("name = \"vision_model.x.weight\""));
    assert_eq!(verify(&bundle, &wrapped), (true, vec![]), "check --source");
    // A flipped byte of an expert's slice is still named as that expert.
    let e = manifest(&bundle)
        .experts
        .into_iter()
        .find(|e| e.name == "model.layers.3.feed_forward.experts.2")
        .unwrap();
    let s = &e.sources[1];
    assert_eq!(s.tensor, "model.layers.3.feed_forward.experts.down_proj");
    flip_byte(&wrapped.join(&s.shard), s.offset + 3);
    assert_eq!(
        verify(&bundle, &wrapped),
        (
            false,
            vec![
                (e.name.clone(), "source-bytes-differ".into()),
                (s.shard.clone(), "shard-sha256-mismatch".into()),
            ]
        )
    );

    // Refusals, nothing written.
    let odd = d.path().join("odd");
    wrap_llama4(
        &plain_src,
        &odd,
        &[("rope_scaling", serde_json::json!({"factor": 2.0}))],
    );
    let out = d.path().join("out-odd");
    let (code, _, err) = convert_cli(&odd, &out);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("\"rope_scaling\"") && err.contains("config.json"),
        "{err}"
    );
    assert!(!out.exists());
}

/// `tarfa-verify diff` (tarfa_manifest::diff) between the bundle and one converted from the
/// same checkpoint with one byte of expert 6 of layer 3 changed (in its slice of
/// `gate_up_proj`) names that expert as `model.layers.3.feed_forward.experts.6`, and nothing
/// else.
#[test]
fn diff_names_a_changed_llama4_expert() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    copy_checkpoint(&fixture("llama4-dense-s"), &src);
    let (a, b) = (d.path().join("a"), d.path().join("b"));
    assert_eq!(convert_cli(&src, &a).0, 0);
    let e = manifest(&a)
        .experts
        .into_iter()
        .find(|e| e.name == "model.layers.3.feed_forward.experts.6")
        .unwrap();
    let s = &e.sources[0];
    flip_byte(&src.join(&s.shard), s.offset + 17);
    assert_eq!(convert_cli(&src, &b).0, 0);
    let diff = tarfa_manifest::diff(&manifest(&a), &manifest(&b));
    let json = serde_json::to_value(&diff).unwrap().to_string();
    assert!(
        json.contains("\"model.layers.3.feed_forward.experts.6\""),
        "{json}"
    );
    for other in [
        "model.layers.3.feed_forward.experts.5\"",
        "model.layers.1.feed_forward.experts.6\"",
    ] {
        assert!(!json.contains(other), "{other} unchanged: {json}");
    }
}
