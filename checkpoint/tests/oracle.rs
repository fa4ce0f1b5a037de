//! The real checkpoints: the in-repo Qwen3-MoE fixtures always; Mixtral, Qwen2-MoE and OLMoE
//! (kept outside the repository for size) when `TARFA_EXTRA_ORACLES` names their directory:
//! `TARFA_EXTRA_ORACLES=/path/to/oracle cargo test -p tarfa-checkpoint --test oracle -- --ignored`

use std::path::{Path, PathBuf};

use tarfa_checkpoint::{open, Dtype, ExpertMatrix, ExpertNaming, ModelFamily};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/oracle")
        .join(name)
}

fn extra(name: &str) -> PathBuf {
    let root = std::env::var("TARFA_EXTRA_ORACLES")
        .expect("set TARFA_EXTRA_ORACLES to the extra oracle directory");
    Path::new(&root).join(name)
}

/// Opens `dir` and checks everything against the safetensors crate's own reading of the shards.
fn check(
    dir: &Path,
    family: ModelFamily,
    naming: ExpertNaming,
    layers: u32,
    experts: u32,
) -> tarfa_checkpoint::Checkpoint {
    let c = open(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    assert_eq!(c.config.family, family);
    assert_eq!(c.naming, naming);
    assert_eq!(c.config.num_hidden_layers, layers);
    assert_eq!(c.config.num_experts, experts);
    assert_eq!(c.experts.len(), (layers * experts) as usize);
    assert_eq!(c.expert_dims.len(), layers as usize);

    // Every tensor of every shard, as the reference reader sees it, and nothing else.
    let mut seen = 0;
    for (i, shard) in c.shards.iter().enumerate() {
        let bytes = std::fs::read(&shard.path).unwrap();
        assert_eq!(bytes.len() as u64, shard.size);
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in st.tensors() {
            let t = &c.tensors[&name];
            assert_eq!((t.shard, t.dtype), (i, view.dtype()));
            assert_eq!(
                t.shape,
                view.shape().iter().map(|&d| d as u64).collect::<Vec<_>>()
            );
            assert_eq!(
                &bytes[t.offset as usize..(t.offset + t.len) as usize],
                view.data(),
                "{name}"
            );
            seen += 1;
        }
    }
    assert_eq!(seen, c.tensors.len());

    // Experts: BF16, gate/up/down in that order, shapes per the layer's dims.
    for ((l, e), src) in &c.experts {
        assert_eq!(src.prefix, naming.expert_prefix(*l, *e));
        let dims = c.expert_dims[l];
        for m in ExpertMatrix::ALL {
            let t = &c.tensors[src.tensor(m)];
            assert_eq!(t.dtype, Dtype::BF16);
            assert_eq!(t.shape, dims.shape(m).to_vec());
        }
    }
    assert_eq!(c.non_expert.len() + 3 * c.experts.len(), c.tensors.len());

    // Reads through the handles agree with the files.
    let name = c.experts[&(layers - 1, experts - 1)]
        .tensor(ExpertMatrix::Down)
        .to_owned();
    let t = &c.tensors[&name];
    let map = c.map_shard(t.shard).unwrap();
    assert_eq!(c.read_tensor_bytes(&name).unwrap(), map.tensor(t).unwrap());

    // Shard hashes agree with a plain file hash.
    let hashes = c.shard_sha256s().unwrap();
    for (s, h) in c.shards.iter().zip(&hashes) {
        assert_eq!(tarfa_checkpoint::sha256_file(&s.path).unwrap(), *h);
    }
    c
}

#[test]
fn qwen3moe_a() {
    let c = check(
        &fixture("qwen3moe-a"),
        ModelFamily::Qwen3Moe,
        ExpertNaming::QwenStyle,
        4,
        32,
    );
    assert_eq!(c.shards.len(), 12);
    assert_eq!(c.config.num_experts_per_tok, 8);
    assert!(c.tensors.contains_key("lm_head.weight"));
    // One layer's experts are spread over several shards.
    let shards: std::collections::BTreeSet<usize> = (0..32)
        .flat_map(|e| c.experts[&(0, e)].tensors.clone())
        .map(|n| c.tensors[&n].shard)
        .collect();
    assert!(shards.len() > 1);
    let extras: Vec<&str> = c.extra_files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(extras, ["config.json", "generation_config.json"]);
}

#[test]
fn qwen3moe_code() {
    let c = check(
        &fixture("qwen3moe-code"),
        ModelFamily::Qwen3Moe,
        ExpertNaming::QwenStyle,
        4,
        32,
    );
    // Tied embeddings: no lm_head tensor.
    assert!(!c.tensors.contains_key("lm_head.weight"));
    assert!(c.extra_files.iter().any(|f| f.name == "tokenizer.json"));
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES"]
fn mixtral_a() {
    check(
        &extra("mixtral-a"),
        ModelFamily::Mixtral,
        ExpertNaming::Mixtral,
        3,
        8,
    );
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES"]
fn qwen2moe_a() {
    let c = check(
        &extra("qwen2moe-a"),
        ModelFamily::Qwen2Moe,
        ExpertNaming::QwenStyle,
        3,
        16,
    );
    assert!(c
        .non_expert
        .iter()
        .any(|n| n == "model.layers.0.mlp.shared_expert.gate_proj.weight"));
    assert!(c
        .non_expert
        .iter()
        .any(|n| n == "model.layers.2.mlp.shared_expert_gate.weight"));
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES"]
fn olmoe_a() {
    check(
        &extra("olmoe-a"),
        ModelFamily::Olmoe,
        ExpertNaming::QwenStyle,
        3,
        16,
    );
}

/// Qwen3-Next and Qwen3.5 MoE as transformers 5.17 saves them: experts per expert (the
/// runtime judges the linear-attention tensors, carried here as non-expert tensors).
#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES"]
fn qwen3next_a_and_qwen35moe_a() {
    for (name, family, qkv) in [
        (
            "qwen3next-a",
            ModelFamily::Qwen3Next,
            "model.layers.0.linear_attn.in_proj_qkvz.weight",
        ),
        (
            "qwen35moe-a",
            ModelFamily::Qwen3_5Moe,
            "model.layers.0.linear_attn.in_proj_qkv.weight",
        ),
    ] {
        let c = check(&extra(name), family, ExpertNaming::QwenStyle, 4, 16);
        assert!(c.fused.is_empty(), "{name}");
        assert!(c.skipped.is_empty() && c.mtp.is_empty(), "{name}");
        for t in [
            qkv,
            "model.layers.0.linear_attn.conv1d.weight",
            "model.layers.2.linear_attn.A_log",
            "model.layers.3.self_attn.q_norm.weight",
            "model.layers.3.mlp.shared_expert_gate.weight",
        ] {
            assert!(c.non_expert.iter().any(|n| n == t), "{name}: {t}");
        }
    }
}
