//! The rules against the fixtures' real tensor tables, and each rule broken once.

use std::collections::BTreeMap;

use serde_json::Value;

use super::*;

/// `name -> (dtype, shape)`: a checkpoint's tensor table.
type Table = BTreeMap<String, (String, Vec<u64>)>;

/// The tensor table of a fixture, from its shards' headers.
fn fixture_table(name: &str) -> (MoeConfig, Table) {
    let dir = format!("{}/../fixtures/oracle/{name}", env!("CARGO_MANIFEST_DIR"));
    let cfg =
        MoeConfig::from_json_str(&std::fs::read_to_string(format!("{dir}/config.json")).unwrap())
            .unwrap();
    let mut table = BTreeMap::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        if !file.starts_with("model") || !file.ends_with(".safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: BTreeMap<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        for (t, v) in header {
            if t == "__metadata__" {
                continue;
            }
            let dtype = v["dtype"].as_str().unwrap().to_string();
            let shape = v["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .collect();
            table.insert(t, (dtype, shape));
        }
    }
    (cfg, table)
}

fn check(cfg: &MoeConfig, table: &Table) -> Result<(), ShapeError> {
    ModelRules::for_config(cfg).check(|name| {
        table
            .get(name)
            .map(|(dtype, shape)| FoundTensor { dtype, shape })
    })
}

#[test]
fn every_fixture_meets_its_rules_and_nothing_is_left_over() {
    for name in [
        "qwen3moe-a",
        "qwen3moe-code",
        "qwen3moe-dense",
        "qwen3moe-odd",
    ] {
        let (cfg, table) = fixture_table(name);
        check(&cfg, &table).unwrap_or_else(|e| panic!("{name}: {e}"));
        // The rules name every tensor the fixture has: nothing the runtime ignores.
        let rules = ModelRules::for_config(&cfg);
        let mut named: Vec<String> = rules
            .non_expert()
            .iter()
            .filter(|r| r.need == Need::Required || table.contains_key(&r.name))
            .map(|r| r.name.clone())
            .collect();
        named.extend(rules.expert_matrices().map(|m| m.name));
        named.sort();
        let have: Vec<String> = table.keys().cloned().collect();
        let extra: Vec<_> = have.iter().filter(|n| !named.contains(n)).collect();
        let absent: Vec<_> = named.iter().filter(|n| !have.contains(n)).collect();
        assert!(
            extra.is_empty() && absent.is_empty(),
            "{name}: not in the rules {extra:?}, not in the fixture {absent:?}"
        );
        assert_eq!(named.len(), have.len(), "{name}");
    }
}

#[test]
fn each_broken_rule_is_its_own_error() {
    let (cfg, table) = fixture_table("qwen3moe-a");
    let broken = |f: &dyn Fn(&mut Table)| {
        let mut t = table.clone();
        f(&mut t);
        check(&cfg, &t).unwrap_err()
    };
    assert_eq!(
        broken(&|t| {
            t.remove("lm_head.weight");
        }),
        ShapeError::Missing {
            name: "lm_head.weight".into(),
            why: "vocab_size x hidden_size"
        }
    );
    let q = "model.layers.2.self_attn.q_proj.weight";
    assert!(matches!(
        broken(&|t| t.get_mut(q).unwrap().1 = vec![64, 128]),
        ShapeError::WrongShape { name, expected, .. } if name == q && expected == [128, 128]
    ));
    let router = "model.layers.0.mlp.gate.weight";
    assert!(matches!(
        broken(&|t| t.get_mut(router).unwrap().1 = vec![16, 128]),
        ShapeError::WrongShape { name, expected, .. } if name == router && expected == [32, 128]
    ));
    assert!(matches!(
        broken(&|t| t.get_mut("model.embed_tokens.weight").unwrap().1 = vec![511, 128]),
        ShapeError::WrongShape { expected, .. } if expected == [512, 128]
    ));
    for dtype in ["F16", "F64"] {
        assert_eq!(
            broken(&|t| t.get_mut("model.norm.weight").unwrap().0 = dtype.into()),
            ShapeError::NonExpertDtype {
                name: "model.norm.weight".into(),
                dtype: dtype.into()
            }
        );
    }
    let expert = "model.layers.3.mlp.experts.31.down_proj.weight";
    assert!(matches!(
        broken(&|t| { t.remove(expert); }),
        ShapeError::MissingExpert { name, layer: 3, experts: 32 } if name == expert
    ));
    assert!(matches!(
        broken(&|t| t.get_mut(expert).unwrap().0 = "F32".into()),
        ShapeError::ExpertDtype { name, .. } if name == expert
    ));
    assert!(matches!(
        broken(&|t| t.get_mut(expert).unwrap().1 = vec![64, 128]),
        ShapeError::WrongShape { name, expected, .. } if name == expert && expected == [128, 64]
    ));
    // F32 non-expert tensors are carried and computed with as they are.
    let mut t = table.clone();
    t.get_mut("model.norm.weight").unwrap().0 = "F32".into();
    check(&cfg, &t).unwrap();
}

#[test]
fn a_tied_lm_head_may_be_absent_but_not_misshapen() {
    let (mut cfg, mut table) = fixture_table("qwen3moe-a");
    cfg.tie_word_embeddings = true;
    let rules = ModelRules::for_config(&cfg);
    assert_eq!(rules.lm_head.need, Need::Optional);
    table.get_mut("lm_head.weight").unwrap().1 = vec![1, 1];
    assert!(matches!(
        check(&cfg, &table),
        Err(ShapeError::WrongShape { .. })
    ));
    table.remove("lm_head.weight");
    check(&cfg, &table).unwrap();
}

#[test]
fn family_features_add_their_tensors() {
    let qwen2 = serde_json::json!({
        "model_type": "qwen2_moe", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 24,
        "moe_intermediate_size": 8, "shared_expert_intermediate_size": 12,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 2,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 64, "rope_theta": 10000.0
    });
    let cfg = MoeConfig::from_json_object(qwen2.as_object().unwrap()).unwrap();
    let rules = ModelRules::for_config(&cfg);
    // layer 0 dense ((0+1) % 2 != 0), layer 1 MoE with a shared expert; q/k/v biases on.
    assert!(matches!(rules.layers[0].mlp, MlpRules::Dense(ref d) if d.down.shape == [16, 24]));
    let MlpRules::Moe {
        shared: Some((ref d, ref gate)),
        experts,
        ref router,
        ..
    } = rules.layers[1].mlp
    else {
        panic!("layer 1 is MoE with a shared expert");
    };
    assert_eq!(
        (d.gate.shape.clone(), gate.shape.clone()),
        (vec![12, 16], vec![1, 16])
    );
    assert_eq!(router.shape, [4, 16]);
    assert_eq!(experts.down, [16, 8]);
    assert_eq!(gqa(&rules.layers[1]).k_bias.as_ref().unwrap().shape, [8]);
    assert!(gqa(&rules.layers[1]).q_norm.is_none());
    assert_eq!(rules.expert_matrices().count(), 4 * 3);

    let olmoe = serde_json::json!({
        "model_type": "olmoe", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 64, "rope_theta": 10000.0
    });
    let cfg = MoeConfig::from_json_object(olmoe.as_object().unwrap()).unwrap();
    let rules = ModelRules::for_config(&cfg);
    assert_eq!(gqa(&rules.layers[0]).q_norm.as_ref().unwrap().shape, [16]);
    assert_eq!(gqa(&rules.layers[0]).k_norm.as_ref().unwrap().shape, [8]);
    assert!(gqa(&rules.layers[0]).q_bias.is_none());
}

fn gqa(layer: &LayerRules) -> &GqaRules {
    match &layer.attention {
        AttentionRules::Gqa(a) => a,
        AttentionRules::Mla(_) | AttentionRules::Linear(_) => panic!("a GQA layer was expected"),
    }
}
