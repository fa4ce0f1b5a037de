//! model.safetensors.index.json rules, and agreement between the index and the shards.

use std::path::Path;

use serde_json::json;

use super::*;
use crate::CheckpointError as E;

fn with_index_text(t: &Tiny, text: &str) -> E {
    let dir = t.write();
    std::fs::write(dir.join(crate::INDEX_FILE), text).unwrap();
    fails(&dir)
}

fn with_index(t: &Tiny, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> E {
    let mut index = t.index();
    edit(index["weight_map"].as_object_mut().unwrap());
    with_index_text(t, &serde_json::to_string(&index).unwrap())
}

const GATE_0_0: &str = "model.layers.0.mlp.experts.0.gate_proj.weight";

#[test]
fn index_invalid_json() {
    let t = Tiny::qwen3();
    for text in [
        "",
        "{",
        "[]",
        r#"{"metadata":{}}"#,
        r#"{"weight_map":[]}"#,
        r#"{"weight_map":{"a":1}}"#,
    ] {
        let e = with_index_text(&t, text);
        assert_variant!(e, E::IndexInvalidJson { ref file, .. } if file == Path::new(crate::INDEX_FILE));
    }
}

#[test]
fn index_duplicate_tensor() {
    let t = Tiny::qwen3();
    let text = serde_json::to_string(&t.index()).unwrap();
    let first = format!("\"{GATE_0_0}\":\"{}\"", t.file_of(GATE_0_0));
    let twice = text.replace(
        &first,
        &format!("{first},\"{GATE_0_0}\":\"{}\"", Tiny::shard_name(0, 3)),
    );
    assert_ne!(text, twice);
    assert_variant!(with_index_text(&t, &twice), E::IndexDuplicateTensor { ref tensor, .. } if tensor == GATE_0_0);
    // A duplicate elsewhere is a generic duplicate key.
    let dup_meta = text.replacen("\"metadata\":", "\"metadata\":{},\"metadata\":", 1);
    assert_variant!(with_index_text(&t, &dup_meta), E::DuplicateJsonKey { .. });
}

#[test]
fn index_names_missing_shard() {
    let t = Tiny::qwen3();
    let e = with_index(&t, |m| {
        m.insert(GATE_0_0.into(), json!("model-00009-of-00009.safetensors"));
    });
    assert_variant!(e, E::IndexMissingShard { ref shard, .. } if shard == "model-00009-of-00009.safetensors");
    let dir = t.write();
    std::fs::remove_file(dir.join(Tiny::shard_name(1, 3))).unwrap();
    assert_variant!(fails(&dir), E::IndexMissingShard { .. });
}

#[test]
fn index_lists_tensor_absent_from_every_shard() {
    let t = Tiny::qwen3();
    let e = with_index(&t, |m| {
        m.insert(
            "model.layers.0.ghost.weight".into(),
            json!(Tiny::shard_name(0, 3)),
        );
    });
    assert_variant!(e, E::IndexTensorAbsent { ref tensor, ref file, .. } if tensor == "model.layers.0.ghost.weight" && file == Path::new(crate::INDEX_FILE));
}

#[test]
fn tensor_in_two_shards() {
    let t = Tiny::qwen3();
    let dir = t.write();
    let home = t.file_of(GATE_0_0);
    let other = (0..3)
        .map(|i| Tiny::shard_name(i, 3))
        .find(|s| *s != home)
        .unwrap();
    // Rewrite `other` with an extra copy of the tensor.
    let mut specs: Vec<Spec> = t
        .tensors
        .iter()
        .filter(|s| t.file_of(&s.name) == other)
        .cloned()
        .collect();
    specs.push(
        t.tensors
            .iter()
            .find(|s| s.name == GATE_0_0)
            .unwrap()
            .clone(),
    );
    std::fs::write(dir.join(&other), safetensors_bytes(&specs)).unwrap();
    let e = fails(&dir);
    let e = assert_variant!(e, E::TensorInTwoShards { ref tensor, .. } if tensor == GATE_0_0);
    assert!(
        e.to_string().contains(&home) && e.to_string().contains(&other),
        "{e}"
    );
}

#[test]
fn two_names_for_one_shard_file_are_two_shards() {
    // A symlinked alias of a shard makes every tensor of it appear twice.
    let t = Tiny::qwen3();
    let dir = t.write();
    std::os::unix::fs::symlink(Tiny::shard_name(0, 3), dir.join("alias.safetensors")).unwrap();
    let mut index = t.index();
    let map = index["weight_map"].as_object_mut().unwrap();
    let k = map
        .iter()
        .find(|(_, v)| *v == &json!(Tiny::shard_name(0, 3)))
        .unwrap()
        .0
        .clone();
    map.insert(k, json!("alias.safetensors"));
    std::fs::write(
        dir.join(crate::INDEX_FILE),
        serde_json::to_string(&index).unwrap(),
    )
    .unwrap();
    assert_variant!(fails(&dir), E::TensorInTwoShards { .. });
}

#[test]
fn tensor_in_wrong_shard() {
    let t = Tiny::qwen3();
    let home = t.file_of(GATE_0_0);
    let other = (0..3)
        .map(|i| Tiny::shard_name(i, 3))
        .find(|s| *s != home)
        .unwrap();
    let e = with_index(&t, |m| {
        m.insert(GATE_0_0.into(), json!(other));
    });
    let e = assert_variant!(e, E::TensorInWrongShard { ref tensor, ref listed, .. } if tensor == GATE_0_0 && *listed == other);
    assert_eq!(e.file(), Path::new(&home));
}

#[test]
fn tensor_not_in_index() {
    let t = Tiny::qwen3();
    let e = with_index(&t, |m| {
        m.remove(GATE_0_0);
    });
    let e = assert_variant!(e, E::UnlistedTensor { ref tensor, .. } if tensor == GATE_0_0);
    assert_eq!(e.file(), Path::new(&t.file_of(GATE_0_0)));
}

#[test]
fn unused_shard_files_are_ignored() {
    let t = Tiny::qwen3();
    let dir = t.write();
    std::fs::write(dir.join("stray.safetensors"), b"not even a header").unwrap();
    assert_eq!(opens(&dir).shards.len(), 3);
}

#[test]
fn index_metadata_is_kept() {
    let c = opens(&Tiny::qwen3().write());
    assert_eq!(c.index_metadata, json!({"total_size": 0}));
    assert_eq!(c.weights_file(), crate::INDEX_FILE);
    let names: Vec<&str> = c.shards.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        (0..3).map(|i| Tiny::shard_name(i, 3)).collect::<Vec<_>>()
    );
}

#[test]
fn no_weights_and_ambiguous_weights() {
    let dir = Tiny::qwen3().write();
    for i in 0..3 {
        std::fs::remove_file(dir.join(Tiny::shard_name(i, 3))).unwrap();
    }
    std::fs::remove_file(dir.join(crate::INDEX_FILE)).unwrap();
    assert_variant!(fails(&dir), E::NoWeights { .. });

    let dir = Tiny::qwen3().write();
    Tiny::qwen3().single().write_into(&dir);
    assert_variant!(fails(&dir), E::AmbiguousWeights { .. });
}
