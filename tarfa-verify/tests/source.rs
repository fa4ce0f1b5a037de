//! `check --source` on the real fixture checkpoint, with a bundle built by the test helper (the
//! converter's own round trip is in roundtrip.rs): bit identity with the source, failures named
//! by tensor and shard.

mod common;

use std::fs;

use common::*;

#[test]
fn a_faithful_bundle_passes_with_and_without_source() {
    let s = Scratch::new("src-ok");
    let b = s.join("bundle");
    let (h, m) = bundle_from_checkpoint(FIXTURE_A.as_ref(), &b);
    assert!(!h.experts.is_empty() && !m.shards.is_empty());
    let (r, failures) = check_json(&b, None);
    assert_eq!(r.code, 0, "{failures:?}");
    let plain = r.json()["checked_bytes"].as_u64().unwrap();
    let (r, failures) = check_json(&b, Some(FIXTURE_A.as_ref()));
    assert_eq!(r.code, 0, "{failures:?}");
    // With a source, every tensor byte is read once more from the source, every shard whole,
    // and every copied file of the source once.
    let tensor_bytes: u64 = h.tensors.iter().map(|t| t.length).sum::<u64>()
        + h.experts.iter().map(|e| e.length).sum::<u64>();
    let shard_bytes: u64 = m.shards.iter().map(|s| s.size).sum();
    let file_bytes: u64 = m.files.iter().map(|f| f.size).sum();
    assert_eq!(
        r.json()["checked_bytes"].as_u64().unwrap(),
        plain + tensor_bytes + shard_bytes + file_bytes
    );
}

#[test]
fn a_flipped_source_byte_names_the_tensor_and_the_shard() {
    let s = Scratch::new("src-flip");
    let b = s.join("bundle");
    let src = s.join("src");
    copy_dir(FIXTURE_A.as_ref(), &src);
    let (h, _) = bundle_from_checkpoint(&src, &b);

    // An expert matrix (down of layer 2, expert 5) and a non-expert tensor, in their shards.
    let e = h.expert(2, 5).unwrap();
    let down = &e.matrices[2];
    let t = h.tensor("model.layers.1.self_attn.q_proj.weight").unwrap();
    for (name, sref, delta) in [
        (&down.name, down.source.clone().unwrap(), 17u64),
        (&t.name, t.source.clone().unwrap(), 0),
    ] {
        flip_byte(&src.join(&sref.shard), sref.offset + delta);
        let (r, failures) = check_json(&b, Some(&src));
        assert_eq!(r.code, 1);
        assert_eq!(
            failures,
            vec![
                (name.clone(), "source-bytes-differ".to_string()),
                (sref.shard.clone(), "shard-sha256-mismatch".to_string()),
            ]
        );
        let detail = r.json()["failures"][0]["detail"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(detail.contains(&sref.shard), "{detail}");
        assert!(detail.contains(&format!("byte {delta} ")), "{detail}");
        // The bundle itself is still intact.
        assert_eq!(check_json(&b, None).0.code, 0);
        flip_byte(&src.join(&sref.shard), sref.offset + delta);
    }
    assert_eq!(check_json(&b, Some(&src)).0.code, 0);
}

#[test]
fn a_flipped_bundle_byte_with_source_names_the_expert_and_its_matrix() {
    let s = Scratch::new("src-bundleflip");
    let b = s.join("bundle");
    let (h, _) = bundle_from_checkpoint(FIXTURE_A.as_ref(), &b);
    let e = h.expert(3, 31).unwrap();
    let up = &e.matrices[1];
    flip_byte(&b.join("model.jnf"), e.offset + up.offset + 5);
    let (_, failures) = check_json(&b, Some(FIXTURE_A.as_ref()));
    assert_eq!(
        failures,
        vec![
            (up.name.clone(), "source-bytes-differ".to_string()),
            (e.prefix.clone(), "sha256-mismatch".to_string()),
            (e.prefix.clone(), "blake3-mismatch".to_string()),
        ]
    );
}

#[test]
fn the_source_must_hold_exactly_the_bundles_tensors_and_shards() {
    let s = Scratch::new("src-sets");
    let b = s.join("bundle");
    let (_, m) = bundle_from_checkpoint(FIXTURE_A.as_ref(), &b);

    // The manifest records a shard the source lacks, and misrecords another one's size.
    let ghost = m.shards[0].clone();
    edit_manifest(&b, true, |m| {
        let mut extra = ghost.clone();
        extra.name = "model-00099-of-00099.safetensors".into();
        m.shards.push(extra);
        m.shards[1].size += 1;
    });
    let (_, failures) = check_json(&b, Some(FIXTURE_A.as_ref()));
    assert_eq!(
        failures,
        vec![
            (m.shards[1].name.clone(), "shard-size-mismatch".to_string()),
            (
                "model-00099-of-00099.safetensors".to_string(),
                "missing-in-source".to_string()
            ),
        ]
    );
}

#[test]
fn a_misrecorded_source_offset_is_named() {
    let s = Scratch::new("src-offset");
    let b = s.join("bundle");
    bundle_from_checkpoint(FIXTURE_A.as_ref(), &b);
    // Rewrite the header so that one tensor claims another place in its shard (same length,
    // so the header JSON keeps its size and the layout stays valid).
    let path = b.join("model.jnf");
    let mut bytes = fs::read(&path).unwrap();
    let h = read_header(&b);
    let t = h.tensor("model.norm.weight").unwrap();
    let src = t.source.clone().unwrap();
    let old = format!(r#""offset":{}}}"#, src.offset);
    let new = format!(r#""offset":{}}}"#, src.offset + 2);
    assert_eq!(
        old.len(),
        new.len(),
        "pick a tensor whose offset keeps its digit count"
    );
    let json_end = 24 + u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
    let text = String::from_utf8(bytes[24..json_end].to_vec()).unwrap();
    let key = r#""name":"model.norm.weight""#;
    let at = text.find(key).unwrap();
    let rel = text[at..].find(&old).unwrap();
    let patched = format!(
        "{}{}{}",
        &text[..at + rel],
        new,
        &text[at + rel + old.len()..]
    );
    bytes[24..json_end].copy_from_slice(patched.as_bytes());
    fs::write(&path, bytes).unwrap();
    // The manifest binds the header's bytes: as it stands the edit is a header-digest mismatch.
    let (_, failures) = check_json(&b, None);
    assert_eq!(
        failures,
        vec![(
            "model.jnf".to_string(),
            "header-digest-mismatch".to_string()
        )]
    );
    // A forger who re-seals the manifest is caught against the source.
    reseal_header(&b);

    let (_, failures) = check_json(&b, Some(FIXTURE_A.as_ref()));
    assert_eq!(
        failures,
        vec![(
            "model.norm.weight".to_string(),
            "source-location-mismatch".to_string()
        )]
    );
    // Re-sealed and without a source the record cannot be checked (only a pinned root tells).
    assert_eq!(check_json(&b, None).0.code, 0);
}

#[test]
fn an_expert_stored_as_plain_tensors_is_caught_only_against_the_source() {
    let s = Scratch::new("src-split");
    let b = s.join("bundle");
    bundle_from_checkpoint_with(FIXTURE_A.as_ref(), &b, Some((2, 7)));
    // Self-consistent: every byte matches the manifest, and the tensor names match the source.
    assert_eq!(check_json(&b, None).0.code, 0);
    let (r, failures) = check_json(&b, Some(FIXTURE_A.as_ref()));
    assert_eq!(r.code, 1);
    assert_eq!(
        failures,
        vec![(
            "model.layers.2.mlp.experts.7".to_string(),
            "missing-in-bundle".to_string()
        )]
    );
}

#[test]
fn a_source_shard_the_manifest_does_not_list_is_named_once() {
    let s = Scratch::new("src-unlisted");
    let b = s.join("bundle");
    let (h, m) = bundle_from_checkpoint(FIXTURE_A.as_ref(), &b);
    let gone = m.shards[3].name.clone();
    let users = h
        .tensors
        .iter()
        .filter_map(|t| t.source.as_ref())
        .chain(
            h.experts
                .iter()
                .flat_map(|e| e.matrices.iter().filter_map(|m| m.source.as_ref())),
        )
        .filter(|s| s.shard == gone)
        .count();
    assert!(users > 1, "the test needs a shard holding several tensors");
    edit_manifest(&b, true, |m| m.shards.retain(|s| s.name != gone));
    let (r, failures) = check_json(&b, None);
    assert_eq!(
        failures,
        vec![(gone.clone(), "header-manifest-mismatch".to_string())]
    );
    let detail = r.json()["failures"][0]["detail"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(detail.contains(&format!("for {users} tensors")), "{detail}");
    // Against the source, the shard is also one the manifest does not list.
    let (_, failures) = check_json(&b, Some(FIXTURE_A.as_ref()));
    assert_eq!(
        failures,
        vec![
            (gone.clone(), "header-manifest-mismatch".to_string()),
            (gone, "missing-in-manifest".to_string()),
        ]
    );
}
