//! Format version 2 (encoded extents) under `tarfa-verify`: a bundle whose every extent is
//! stored encoded (by the test helper's own encoding) verifies, and is the source bit for bit;
//! a flipped stored byte is named as its expert, before anything is decoded; stored bytes that
//! verify but do not decode are named too; `diff` sees no difference from the version-1 bundle
//! of the same checkpoint.

mod common;

use common::*;
use serde_json::json;

#[test]
fn an_encoded_bundle_verifies_and_is_the_source_bit_for_bit() {
    let s = Scratch::new("v2-ok");
    let b = s.join("bundle");
    let (h, m) = bundle_from_checkpoint_encoded(FIXTURE_A.as_ref(), &b);
    assert_eq!((h.major, m.manifest_version), (2, 3));
    assert!(h.experts.iter().all(|e| e.is_encoded()));
    let (r, failures) = check_json(&b, None);
    assert_eq!(r.code, 0, "{failures:?}");
    // Every byte of the container after the header JSON is read once: the stored extents (not
    // their decoded size) and every padding byte; then the copied files.
    let v = r.json();
    let files: u64 = m.files.iter().map(|f| f.size).sum();
    let container = std::fs::read(b.join("model.jnf")).unwrap();
    let json_len = u64::from_le_bytes(container[16..24].try_into().unwrap());
    assert_eq!(
        v["checked_bytes"].as_u64().unwrap(),
        h.file_size - 24 - json_len + files
    );
    let note = v["notes"][0]["detail"].as_str().unwrap();
    assert!(
        note.contains(&format!(
            "{} of {} experts stored encoded",
            h.experts.len(),
            h.experts.len()
        )),
        "{note}"
    );
    // With the source: the decoded bytes are the source's (and every shard hashes as recorded).
    let (r, failures) = check_json(&b, Some(FIXTURE_A.as_ref()));
    assert_eq!(r.code, 0, "{failures:?}");
}

#[test]
fn a_flipped_stored_byte_is_named_as_its_expert_before_decoding() {
    let s = Scratch::new("v2-flip");
    let b = s.join("bundle");
    let (h, _) = bundle_from_checkpoint_encoded(FIXTURE_A.as_ref(), &b);
    let e = h.expert(2, 5).unwrap();
    // A byte of the sign-mantissa plane (the last stored byte): it would decode, to other
    // bytes; the stored hash names it first.
    flip_byte(&b.join("model.jnf"), e.offset + e.stored_length - 1);
    for source in [None, Some(FIXTURE_A.as_ref())] {
        let (r, failures) = check_json(&b, source);
        assert_eq!(r.code, 1);
        assert_eq!(
            failures,
            vec![(
                "model.layers.2.mlp.experts.5".to_string(),
                "stored-blake3-mismatch".to_string()
            )],
            "source {source:?}"
        );
        let detail = r.json()["failures"][0]["detail"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(detail.contains("not decoded"), "{detail}");
    }
    // and the plain-text report names it, exit 1
    let r = run(&[&"check", &b]);
    assert_eq!(r.code, 1);
    assert!(
        r.stdout
            .contains("FAIL model.layers.2.mlp.experts.5: stored-blake3-mismatch"),
        "{}",
        r.stdout
    );
}

#[test]
fn stored_bytes_that_verify_but_do_not_decode_are_named() {
    // A forger's bundle: a stored extent's value count changed and its stored_blake3
    // re-recorded (root re-sealed): the stored bytes verify, the decoder refuses them.
    let s = Scratch::new("v2-undecodable");
    let b = s.join("bundle");
    let (h, _) = bundle_from_checkpoint_encoded(FIXTURE_A.as_ref(), &b);
    let e = h.expert(1, 3).unwrap();
    flip_byte(&b.join("model.jnf"), e.offset);
    let bytes = std::fs::read(b.join("model.jnf")).unwrap();
    let stored = &bytes[e.offset as usize..][..e.stored_length as usize];
    edit_manifest(&b, true, |m| {
        let r = m.experts.iter_mut().find(|r| r.name == e.prefix).unwrap();
        r.stored_blake3 = Some(tarfa_manifest::hash::blake3_hex(stored));
    });
    let (r, failures) = check_json(&b, None);
    assert_eq!(r.code, 1);
    assert_eq!(
        failures,
        vec![(e.prefix.clone(), "stored-not-decodable".to_string())]
    );
    let detail = r.json()["failures"][0]["detail"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(detail.contains("BF16 values"), "{detail}");
}

#[test]
fn a_header_and_manifest_that_disagree_on_storage_are_named() {
    let s = Scratch::new("v2-storage");
    let b = s.join("bundle");
    let (h, _) = bundle_from_checkpoint_encoded(FIXTURE_A.as_ref(), &b);
    let e = h.expert(0, 0).unwrap();
    // The manifest says raw (a self-consistent raw record), the header says encoded.
    edit_manifest(&b, true, |m| {
        let r = m.experts.iter_mut().find(|r| r.name == e.prefix).unwrap();
        r.codec = Some("raw".into());
        r.stored_length = Some(r.length);
        r.stored_blake3 = Some(r.blake3.clone());
        r.padded_length = jnf_format::align_up(r.length).unwrap();
    });
    let (_, failures) = check_json(&b, None);
    assert!(
        failures.contains(&(e.prefix.clone(), "header-manifest-mismatch".to_string())),
        "{failures:?}"
    );
}

#[test]
fn diff_sees_no_difference_between_version_1_and_version_2_of_the_same_weights() {
    let s = Scratch::new("v2-diff");
    let (a, b) = (s.join("v1"), s.join("v2"));
    let (_, m) = bundle_from_checkpoint(FIXTURE_A.as_ref(), &a);
    let (h2, _) = bundle_from_checkpoint_encoded(FIXTURE_A.as_ref(), &b);
    assert!(h2.experts.iter().all(|e| e.is_encoded()));
    for (x, y) in [(&a, &b), (&b, &a)] {
        let r = run(&[&"diff", x, y, &"--json"]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        let entries = m.tensors.len() + m.experts.len() + m.files.len();
        assert_eq!(
            r.json(),
            json!({"changed": [], "added": [], "removed": [], "unchanged": entries})
        );
    }
}
