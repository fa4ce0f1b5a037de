//! Qwen3-Next and Qwen3.5 MoE through the converter: the shared oracle's `qwen3next-a` and
//! `qwen35moe-a` (transformers 5.17's per-expert form) converted and proven with `tarfa-verify
//! check --source`; and, made here from `qwen35moe-a`, the two forms the Qwen3.5 MoE releases
//! take: experts fused by rows (`mlp.experts.gate_up_proj` `[E, 2I, H]`, `down_proj`
//! `[E, H, I]`), whose extents must be the per-expert form's byte for byte, and the multimodal
//! wrapper (`qwen3_5_moe`: the text model under `model.language_model.`, a vision tower under
//! `model.visual.`, a multi-token-prediction module under `mtp.`), whose bundle must hold the
//! plain form's tensors and experts with the vision tower recorded as left out and `mtp.*`
//! as skipped.
//!
//! The checkpoints are the shared oracle's; these tests run when TARFA_EXTRA_ORACLES names it
//! (`.ci/run` sets it to ../shared/oracle):
//! `TARFA_EXTRA_ORACLES=/work/shared/oracle cargo test -p tarfa-convert --test qwen3_next -- --include-ignored`

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};
use tarfa_verify::{check_bundle, CheckOptions};

const BIN: &str = env!("CARGO_BIN_EXE_tarfa-convert");

fn shared(name: &str) -> PathBuf {
    let root = std::env::var("TARFA_EXTRA_ORACLES")
        .expect("set TARFA_EXTRA_ORACLES to the directory holding the extra oracle fixtures");
    let dir = Path::new(&root).join(name);
    assert!(dir.join("config.json").is_file(), "{}", dir.display());
    dir
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

fn converted(src: &Path, out: &Path) -> String {
    let (code, _, err) = convert_cli(src, out);
    assert_eq!(code, 0, "{}: {err}", src.display());
    err
}

/// (ok, [(failure name, kind)]) of `tarfa-verify check --source`.
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

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&fs::read(path).unwrap()).unwrap()
}

/// (name, sha256, blake3) of every tensor and expert of a bundle, sorted.
fn digests(bundle: &Path) -> Vec<(String, String, String)> {
    let m = manifest(bundle);
    let mut v: Vec<(String, String, String)> = m
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.sha256.clone(), t.blake3.clone()))
        .chain(
            m.experts
                .iter()
                .map(|e| (e.name.clone(), e.sha256.clone(), e.blake3.clone())),
        )
        .collect();
    v.sort();
    v
}

/// Every expert extent of a bundle, by name, as the bytes of its model.jnf.
fn extents(bundle: &Path) -> BTreeMap<String, Vec<u8>> {
    let jnf = fs::read(bundle.join("model.jnf")).unwrap();
    manifest(bundle)
        .experts
        .iter()
        .map(|e| {
            let bytes = jnf[e.offset as usize..][..e.length as usize].to_vec();
            (e.name.clone(), bytes)
        })
        .collect()
}

/// One tensor of a checkpoint being rewritten.
#[derive(Clone)]
struct Tensor {
    name: String,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// Every shard of the checkpoint in `dir` (shard name, its tensors), in shard-name order.
fn read_shards(dir: &Path) -> Vec<(String, Vec<Tensor>)> {
    let index = read_json(&dir.join("model.safetensors.index.json"));
    let mut names: Vec<String> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    names.sort();
    names.dedup();
    names
        .into_iter()
        .map(|shard| {
            let bytes = fs::read(dir.join(&shard)).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let mut tensors: Vec<Tensor> = st
                .tensors()
                .into_iter()
                .map(|(name, t)| Tensor {
                    name,
                    dtype: t.dtype(),
                    shape: t.shape().to_vec(),
                    data: t.data().to_vec(),
                })
                .collect();
            tensors.sort_by(|a, b| a.name.cmp(&b.name));
            (shard, tensors)
        })
        .collect()
}

/// Writes the shards and their index into `dir`, with `config` as its config.json and the
/// source's generation_config.json.
fn write_checkpoint(dir: &Path, src: &Path, shards: &[(String, Vec<Tensor>)], config: &Value) {
    fs::create_dir_all(dir).unwrap();
    let mut weight_map = serde_json::Map::new();
    for (shard, tensors) in shards {
        let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
            .iter()
            .map(|t| {
                let view = safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.data);
                (t.name.clone(), view.unwrap())
            })
            .collect();
        for t in tensors {
            weight_map.insert(t.name.clone(), Value::from(shard.clone()));
        }
        safetensors::serialize_to_file(views, None, &dir.join(shard)).unwrap();
    }
    let index = json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_vec_pretty(&index).unwrap(),
    )
    .unwrap();
    fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(config).unwrap(),
    )
    .unwrap();
    fs::copy(
        src.join("generation_config.json"),
        dir.join("generation_config.json"),
    )
    .unwrap();
}

/// `qwen35moe-a` with every layer's experts fused as the Qwen3.5 MoE releases store them:
/// `gate_up_proj[e]` is expert e's gate rows then its up rows (`[2I, H]`), `down_proj[e]` its
/// down matrix (`[H, I]`), stacked over e. Each layer's two tensors go into the shard that held
/// its expert 0's gate.
fn fuse_by_rows(shards: &mut [(String, Vec<Tensor>)], layers: usize, experts: usize) {
    let all: BTreeMap<String, Tensor> = shards
        .iter()
        .flat_map(|(_, ts)| ts.iter().map(|t| (t.name.clone(), t.clone())))
        .collect();
    let expert =
        |l: usize, e: usize, m: &str| &all[&format!("model.layers.{l}.mlp.experts.{e}.{m}.weight")];
    for l in 0..layers {
        let home = shards
            .iter()
            .position(|(_, ts)| {
                ts.iter()
                    .any(|t| t.name == format!("model.layers.{l}.mlp.experts.0.gate_proj.weight"))
            })
            .unwrap();
        let (i, h) = (
            expert(l, 0, "gate_proj").shape[0],
            expert(l, 0, "gate_proj").shape[1],
        );
        let mut gate_up = Vec::new();
        let mut down = Vec::new();
        for e in 0..experts {
            gate_up.extend_from_slice(&expert(l, e, "gate_proj").data);
            gate_up.extend_from_slice(&expert(l, e, "up_proj").data);
            down.extend_from_slice(&expert(l, e, "down_proj").data);
        }
        let module = format!("model.layers.{l}.mlp.experts.");
        for (_, ts) in shards.iter_mut() {
            ts.retain(|t| !t.name.starts_with(&module));
        }
        shards[home].1.push(Tensor {
            name: format!("{module}gate_up_proj"),
            dtype: safetensors::Dtype::BF16,
            shape: vec![experts, 2 * i, h],
            data: gate_up,
        });
        shards[home].1.push(Tensor {
            name: format!("{module}down_proj"),
            dtype: safetensors::Dtype::BF16,
            shape: vec![experts, h, i],
            data: down,
        });
    }
}

/// The text model of `shards` laid out as the multimodal release lays it out: `model.X` as
/// `model.language_model.X` (`lm_head.*` stays), plus a small vision-tower tensor and a
/// multi-token-prediction router in the last shard.
fn wrap_tensors(shards: &mut [(String, Vec<Tensor>)], hidden: usize, experts: usize) {
    for (_, ts) in shards.iter_mut() {
        for t in ts.iter_mut() {
            if let Some(rest) = t.name.strip_prefix("model.") {
                t.name = format!("model.language_model.{rest}");
            }
        }
    }
    let last = &mut shards.last_mut().unwrap().1;
    last.push(Tensor {
        name: "model.visual.blocks.0.attn.qkv.weight".into(),
        dtype: safetensors::Dtype::BF16,
        shape: vec![12, 4],
        data: vec![0x3f; 96],
    });
    last.push(Tensor {
        name: "mtp.layers.0.mlp.gate.weight".into(),
        dtype: safetensors::Dtype::BF16,
        shape: vec![experts, hidden],
        data: vec![0x3c; 2 * experts * hidden],
    });
}

/// The release's config.json around `text` (its `text_config`).
fn wrap_config(text: &Value) -> Value {
    json!({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 1, "hidden_size": 4},
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": false,
        "transformers_version": "5.17.0",
    })
}

/// `qwen35moe-a`'s config as the release's text_config writes it: the multimodal RoPE keys
/// (head_dim 32 x 0.25 = 8 rotary dims, 4 frequencies: sections 2 + 1 + 1) and the MTP keys.
fn release_text_config(plain: &Value, mrope_section: Value) -> Value {
    let mut text = plain.clone();
    text["rope_parameters"]["mrope_section"] = mrope_section;
    text["rope_parameters"]["mrope_interleaved"] = json!(true);
    text["mtp_num_hidden_layers"] = json!(1);
    text["mtp_use_dedicated_embeddings"] = json!(false);
    text
}

/// Both shared fixtures convert; every expert is an extent `model.layers.L.mlp.experts.E`
/// (no re-layout), the linear-attention, gated-attention and shared-expert tensors are carried,
/// `check --source` passes, and a flipped source byte is named as its expert.
#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn the_shared_fixtures_convert_and_are_proven_against_their_source() {
    for (name, linear) in [
        (
            "qwen3next-a",
            &["in_proj_qkvz.weight", "in_proj_ba.weight"][..],
        ),
        (
            "qwen35moe-a",
            &[
                "in_proj_qkv.weight",
                "in_proj_z.weight",
                "in_proj_a.weight",
                "in_proj_b.weight",
            ][..],
        ),
    ] {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("src");
        copy_checkpoint(&shared(name), &src);
        let config = read_json(&src.join("config.json"));
        let layer_types: Vec<&str> = config["layer_types"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        let experts = config["num_experts"].as_u64().unwrap();
        let bundle = d.path().join("bundle");
        converted(&src, &bundle);
        let m = manifest(&bundle);
        assert_eq!(
            m.experts.len() as u64,
            layer_types.len() as u64 * experts,
            "{name}"
        );
        for e in &m.experts {
            assert_eq!(
                e.name,
                format!("model.layers.{}.mlp.experts.{}", e.layer, e.expert)
            );
            assert!(e.relayout.is_none() && e.sources.is_empty(), "{}", e.name);
        }
        let tensors: std::collections::BTreeSet<&str> =
            m.tensors.iter().map(|t| t.name.as_str()).collect();
        for (l, kind) in layer_types.iter().enumerate() {
            let p = format!("model.layers.{l}");
            let own: Vec<String> = match *kind {
                "linear_attention" => linear
                    .iter()
                    .chain(&[
                        "conv1d.weight",
                        "A_log",
                        "dt_bias",
                        "norm.weight",
                        "out_proj.weight",
                    ])
                    .map(|t| format!("{p}.linear_attn.{t}"))
                    .collect(),
                "full_attention" => ["q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"]
                    .iter()
                    .map(|t| format!("{p}.self_attn.{t}.weight"))
                    .collect(),
                other => panic!("{name}: layer type {other}"),
            };
            for t in own.iter().map(String::as_str).chain([
                format!("{p}.mlp.gate.weight").as_str(),
                format!("{p}.mlp.shared_expert.down_proj.weight").as_str(),
                format!("{p}.mlp.shared_expert_gate.weight").as_str(),
            ]) {
                assert!(tensors.contains(t), "{name}: {t} carried");
            }
        }
        assert_eq!(
            verify(&bundle, &src),
            (true, vec![]),
            "{name}: check --source"
        );
        // A flipped byte of expert 5's up matrix in layer 2 is named as that expert.
        let up = "model.layers.2.mlp.experts.5.up_proj.weight".to_string();
        let index = read_json(&src.join("model.safetensors.index.json"));
        let shard = index["weight_map"][&up].as_str().unwrap().to_string();
        let at = safetensors_offset(&src.join(&shard), &up) + 7;
        flip_byte(&src.join(&shard), at);
        assert_eq!(
            verify(&bundle, &src),
            (
                false,
                vec![
                    (up.clone(), "source-bytes-differ".into()),
                    (shard.clone(), "shard-sha256-mismatch".into()),
                ]
            ),
            "{name}"
        );
    }
}

/// Greedy tokens and every step's logits bits of a bundle on the CPU runtime.
fn greedy_bits(bundle: &Path) -> (Vec<u32>, Vec<Vec<u32>>) {
    use std::sync::Arc;
    use tarfa_core::weights::WeightSource;
    use tarfa_cpu::{CpuEngine, CpuModel, EngineOptions, ForwardOptions, LogitRows};
    let src = Arc::new(tarfa_stream::bundle::BundleSource::open(bundle, None).unwrap());
    let cfg = tarfa_core::config::MoeConfig::from_json_str(
        &String::from_utf8(src.read_file("config.json").unwrap()).unwrap(),
    )
    .unwrap();
    let model = Arc::new(CpuModel::load(cfg, src as Arc<dyn WeightSource>).unwrap());
    let engine = CpuEngine::new(model.clone(), EngineOptions::default()).unwrap();
    let mut cache = model.new_cache();
    let opts = ForwardOptions {
        logits: LogitRows::Last,
        ..Default::default()
    };
    let out =
        tarfa_core::generate::greedy(&engine, &mut cache, &[1, 7, 33, 100], 4, &opts).unwrap();
    let bits = out
        .step_logits
        .iter()
        .map(|r| r.iter().map(|v| v.to_bits()).collect())
        .collect();
    (out.tokens, bits)
}

/// The absolute offset of a tensor's data in a safetensors file.
fn safetensors_offset(path: &Path, tensor: &str) -> u64 {
    let bytes = fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    let header: Value = serde_json::from_slice(&bytes[8..8 + n as usize]).unwrap();
    8 + n + header[tensor]["data_offsets"][0].as_u64().unwrap()
}

/// Experts fused by rows convert to exactly the per-expert form's extents: the same names,
/// SHA-256 and BLAKE3 digests, the same bytes, which are gate | up | down of the per-expert
/// source's matrices; each extent records its two source slices and no re-layout; `check
/// --source` proves them, and a flipped byte in an expert's up rows is named as that expert.
#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn experts_fused_by_rows_convert_to_the_per_expert_extents() {
    let d = tempfile::tempdir().unwrap();
    let plain_src = d.path().join("plain-src");
    copy_checkpoint(&shared("qwen35moe-a"), &plain_src);
    let config = read_json(&plain_src.join("config.json"));
    let layers = config["num_hidden_layers"].as_u64().unwrap() as usize;
    let experts = config["num_experts"].as_u64().unwrap() as usize;
    let (h, i) = (
        config["hidden_size"].as_u64().unwrap() as usize,
        config["moe_intermediate_size"].as_u64().unwrap() as usize,
    );
    let mut shards = read_shards(&plain_src);
    let by_hand: BTreeMap<String, Vec<u8>> = {
        let all: BTreeMap<&str, &Tensor> = shards
            .iter()
            .flat_map(|(_, ts)| ts.iter().map(|t| (t.name.as_str(), t)))
            .collect();
        (0..layers)
            .flat_map(|l| (0..experts).map(move |e| (l, e)))
            .map(|(l, e)| {
                let p = format!("model.layers.{l}.mlp.experts.{e}");
                let bytes = ["gate_proj", "up_proj", "down_proj"]
                    .iter()
                    .flat_map(|m| all[format!("{p}.{m}.weight").as_str()].data.clone())
                    .collect();
                (p, bytes)
            })
            .collect()
    };
    fuse_by_rows(&mut shards, layers, experts);
    let fused_src = d.path().join("fused-src");
    write_checkpoint(&fused_src, &plain_src, &shards, &config);

    let (plain, fused) = (d.path().join("plain"), d.path().join("fused"));
    converted(&plain_src, &plain);
    converted(&fused_src, &fused);
    assert_eq!(
        digests(&fused),
        digests(&plain),
        "the same tensors and experts"
    );
    let got = extents(&fused);
    assert_eq!(got, extents(&plain), "the same extents, byte for byte");
    assert_eq!(
        got, by_hand,
        "each extent is gate | up | down of the per-expert matrices"
    );

    let m = manifest(&fused);
    for e in &m.experts {
        assert_eq!(e.relayout, None, "{}: no re-layout", e.name);
        let base = format!("model.layers.{}.mlp.experts", e.layer);
        let srcs: Vec<(&str, u64)> = e
            .sources
            .iter()
            .map(|s| (s.tensor.as_str(), s.length))
            .collect();
        assert_eq!(
            srcs,
            [
                (format!("{base}.gate_up_proj").as_str(), (4 * i * h) as u64),
                (format!("{base}.down_proj").as_str(), (2 * h * i) as u64),
            ]
        );
        let roles: Vec<&str> = e.matrices.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["gate", "up", "down"]);
    }
    assert_eq!(verify(&fused, &fused_src), (true, vec![]), "check --source");
    assert_eq!(
        greedy_bits(&fused),
        greedy_bits(&plain),
        "the runtime reads the fused-rows bundle as the per-expert one, bit for bit"
    );
    let e = m
        .experts
        .iter()
        .find(|e| e.name == "model.layers.2.mlp.experts.5")
        .unwrap();
    let s = &e.sources[0];
    // Row 3 of up: I + 3 rows into expert 5's gate_up slice.
    let at = s.offset + ((i + 3) * h * 2) as u64 + 1;
    flip_byte(&fused_src.join(&s.shard), at);
    assert_eq!(
        verify(&fused, &fused_src),
        (
            false,
            vec![
                (e.name.clone(), "source-bytes-differ".into()),
                (s.shard.clone(), "shard-sha256-mismatch".into()),
            ]
        )
    );
}

/// The multimodal release of qwen35moe-a (the text model under `model.language_model.`, a
/// vision-tower tensor, an `mtp.*` tensor, the config wrapped), per expert and fused by rows:
/// the bundle holds the plain fixture's tensors and experts byte for byte, its config.json is
/// the text config, the manifest and the report name the vision tower as left out and `mtp.*`
/// as skipped, and `check --source` passes against the wrapped source.
#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn the_multimodal_release_converts_to_its_text_model() {
    let d = tempfile::tempdir().unwrap();
    let plain_src = d.path().join("plain-src");
    copy_checkpoint(&shared("qwen35moe-a"), &plain_src);
    let plain_config = read_json(&plain_src.join("config.json"));
    let layers = plain_config["num_hidden_layers"].as_u64().unwrap() as usize;
    let experts = plain_config["num_experts"].as_u64().unwrap() as usize;
    let hidden = plain_config["hidden_size"].as_u64().unwrap() as usize;
    let plain = d.path().join("plain");
    converted(&plain_src, &plain);

    let text = release_text_config(&plain_config, json!([2, 1, 1]));
    for fused in [false, true] {
        let mut shards = read_shards(&plain_src);
        if fused {
            fuse_by_rows(&mut shards, layers, experts);
        }
        wrap_tensors(&mut shards, hidden, experts);
        let tag = if fused { "fused" } else { "per-expert" };
        let src = d.path().join(format!("release-{tag}"));
        write_checkpoint(&src, &plain_src, &shards, &wrap_config(&text));
        let bundle = d.path().join(format!("bundle-{tag}"));
        let report = converted(&src, &bundle);
        for needle in [
            "vision tower left out: 1 tensors",
            "model.visual.*: 1",
            "skipped 1 multi-token-prediction tensors under mtp.*",
            "mtp_num_hidden_layers 1",
        ] {
            assert!(
                report.contains(needle),
                "{tag}: the report says {needle}: {report}"
            );
        }
        assert_eq!(digests(&bundle), digests(&plain), "{tag}: the text model");
        assert_eq!(extents(&bundle), extents(&plain), "{tag}: the extents");
        assert_eq!(
            read_json(&bundle.join("config.json")),
            text,
            "{tag}: config.json is the text config"
        );
        let m = manifest(&bundle);
        let multimodal = &m.source["multimodal"];
        for needle in [
            "Qwen3_5MoeForConditionalGeneration",
            "model.language_model.* read as model.*",
            "model.visual.*: 1",
            "e.g. model.visual.blocks.0.attn.qkv.weight",
        ] {
            assert!(
                multimodal.contains(needle),
                "{tag}: {needle} in {multimodal}"
            );
        }
        assert!(
            m.source["skipped"].contains("e.g. mtp.layers.0.mlp.gate.weight"),
            "{tag}: {}",
            m.source["skipped"]
        );
        let carried: Vec<&str> = m.tensors.iter().map(|t| t.name.as_str()).collect();
        assert!(
            carried
                .iter()
                .all(|n| !n.starts_with("model.visual.") && !n.starts_with("mtp.")),
            "{tag}: neither the vision tower nor mtp.* is carried"
        );
        assert_eq!(
            verify(&bundle, &src),
            (true, vec![]),
            "{tag}: check --source"
        );
    }
}

/// A release whose mrope_section is not three sections (transformers indexes the temporal,
/// height and width ones) is refused by name, naming config.json and the key, with nothing
/// written.
#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn a_release_with_a_bad_mrope_section_is_refused_by_name() {
    let d = tempfile::tempdir().unwrap();
    let plain_src = shared("qwen35moe-a");
    let plain_config = read_json(&plain_src.join("config.json"));
    let mut shards = read_shards(&plain_src);
    wrap_tensors(&mut shards, 128, 16);
    let src = d.path().join("src");
    let text = release_text_config(&plain_config, json!([2, 2]));
    write_checkpoint(&src, &plain_src, &shards, &wrap_config(&text));
    let out = d.path().join("out");
    let (code, _, err) = convert_cli(&src, &out);
    assert_eq!(code, 2, "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    for needle in ["config.json", "rope_parameters.mrope_section", "[2,2]"] {
        assert!(err.contains(needle), "names {needle}: {err}");
    }
    assert!(!out.exists(), "nothing written");
}
