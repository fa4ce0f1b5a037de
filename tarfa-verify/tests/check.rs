//! `tarfa-verify check` on synthetic bundles: each test breaks one thing and asserts that exactly
//! that thing is reported, by name and kind, with the documented exit code.

mod common;

use std::fs;
use std::path::Path;

use common::*;

fn json_len(bundle: &Path) -> u64 {
    let bytes = fs::read(bundle.join("model.jnf")).unwrap();
    u64::from_le_bytes(bytes[16..24].try_into().unwrap())
}

fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

#[test]
fn a_valid_bundle_passes_and_counts_every_byte() {
    let s = Scratch::new("valid");
    let b = s.join("bundle");
    let (h, _) = write_synthetic(&b, Synthetic::default());
    let (r, failures) = check_json(&b, None);
    assert_eq!(r.code, 0, "{}", r.stdout);
    assert!(failures.is_empty(), "{failures:?}");
    let v = r.json();
    assert_eq!(v["ok"], true);
    // Everything after the header JSON is hashed or checked to be zero, plus config.json.
    let expected = h.file_size - 24 - json_len(&b) + CONFIG_JSON.len() as u64;
    assert_eq!(v["checked_bytes"], expected);
}

#[test]
fn json_output_has_exactly_the_documented_fields() {
    let s = Scratch::new("fields");
    let b = s.join("bundle");
    write_synthetic(&b, Synthetic::default());
    flip_byte(&b.join("config.json"), 0);
    let (r, _) = check_json(&b, None);
    let v = r.json();
    let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(|k| k.as_str()).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["checked_bytes", "failures", "notes", "ok"]);
    assert_eq!(v["ok"], false);
    let f = &v["failures"][0];
    assert_eq!(f["name"], "config.json");
    assert_eq!(f["kind"], "file-sha256-mismatch");
    assert!(f["detail"].as_str().unwrap().contains("bytes"));
}

#[test]
fn human_output_is_one_line_per_failure_and_a_summary() {
    let s = Scratch::new("human");
    let b = s.join("bundle");
    let (h, _) = write_synthetic(&b, Synthetic::default());
    let r = run(&[&"check", &b]);
    assert_eq!(r.code, 0);
    assert_eq!(r.stdout.lines().count(), 1, "{}", r.stdout);
    assert!(r.stdout.starts_with("ok: "), "{}", r.stdout);
    assert!(r.stdout.contains("8 experts"), "{}", r.stdout);

    let e = &h.experts[5];
    flip_byte(&b.join("model.jnf"), e.offset + 100);
    let r = run(&[&"check", &b]);
    assert_eq!(r.code, 1);
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{}", r.stdout);
    assert!(lines[0].starts_with(&format!("FAIL {}: sha256-mismatch: ", e.prefix)));
    assert!(lines[1].starts_with(&format!("FAIL {}: blake3-mismatch: ", e.prefix)));
    assert!(lines[2].starts_with("FAILED: ") && lines[2].contains("2 failures"));
}

#[test]
fn a_flipped_expert_byte_names_exactly_that_expert() {
    let s = Scratch::new("expert");
    let b = s.join("bundle");
    let (h, _) = write_synthetic(&b, Synthetic::default());
    for (i, at) in [(0usize, 0u64), (3, 1), (6, 2)] {
        let e = &h.experts[i];
        // First byte, a byte inside up, last byte: each matrix of the extent is covered.
        let off = match at {
            0 => e.offset,
            1 => e.offset + e.matrices[1].offset + 7,
            _ => e.offset + e.length - 1,
        };
        flip_byte(&b.join("model.jnf"), off);
        let (r, failures) = check_json(&b, None);
        assert_eq!(r.code, 1);
        assert_eq!(
            failures,
            pairs(&[
                (&e.prefix, "sha256-mismatch"),
                (&e.prefix, "blake3-mismatch")
            ])
        );
        flip_byte(&b.join("model.jnf"), off); // restore
    }
    assert_eq!(check_json(&b, None).0.code, 0);
}

#[test]
fn mixtral_experts_are_named_by_their_prefix() {
    let s = Scratch::new("mixtral");
    let b = s.join("bundle");
    let (h, _) = write_synthetic(
        &b,
        Synthetic {
            mixtral: true,
            ..Synthetic::default()
        },
    );
    let e = &h.experts[2];
    assert_eq!(e.prefix, "model.layers.0.block_sparse_moe.experts.2");
    flip_byte(&b.join("model.jnf"), e.offset + 3);
    let (_, failures) = check_json(&b, None);
    assert!(failures.iter().all(|(n, _)| n == &e.prefix), "{failures:?}");
    assert_eq!(failures.len(), 2);
}

#[test]
fn a_flipped_tensor_byte_names_the_tensor() {
    let s = Scratch::new("tensor");
    let b = s.join("bundle");
    let (h, _) = write_synthetic(&b, Synthetic::default());
    let t = h.tensor("model.layers.1.input_layernorm.weight").unwrap();
    flip_byte(&b.join("model.jnf"), t.offset + t.length - 1);
    let (_, failures) = check_json(&b, None);
    assert_eq!(
        failures,
        pairs(&[(&t.name, "sha256-mismatch"), (&t.name, "blake3-mismatch")])
    );
}

#[test]
fn nonzero_padding_is_named_after_the_region_it_follows() {
    let s = Scratch::new("padding");
    let b = s.join("bundle");
    let (h, _) = write_synthetic(&b, Synthetic::default());
    let t = &h.tensors[0];
    assert!(t.length % 4096 != 0, "the test needs a padded tensor");
    set_byte(&b.join("model.jnf"), t.offset + t.length, 0x80);
    let e = h.experts.last().unwrap();
    set_byte(&b.join("model.jnf"), e.offset + e.padded_length - 1, 1);
    let (r, failures) = check_json(&b, None);
    assert_eq!(r.code, 1);
    assert_eq!(
        failures,
        pairs(&[
            (&t.name, "padding-not-zero"),
            (&e.prefix, "padding-not-zero")
        ])
    );
}

#[test]
fn nonzero_header_padding_is_named_model_jnf() {
    let s = Scratch::new("hpad");
    let b = s.join("bundle");
    let (h, _) = write_synthetic(&b, Synthetic::default());
    let end_of_json = 24 + json_len(&b);
    assert!(end_of_json < h.data_start);
    set_byte(&b.join("model.jnf"), h.data_start - 1, 7);
    let (_, failures) = check_json(&b, None);
    assert_eq!(failures, pairs(&[("model.jnf", "padding-not-zero")]));
}

#[test]
fn an_edited_manifest_without_a_new_root_fails_the_root_digest() {
    let s = Scratch::new("root");
    let b = s.join("bundle");
    write_synthetic(&b, Synthetic::default());
    let name = "model.layers.1.mlp.experts.2";
    edit_manifest(&b, false, |m| {
        let e = m.experts.iter_mut().find(|e| e.name == name).unwrap();
        e.sha256 = "0".repeat(64);
    });
    let (_, failures) = check_json(&b, None);
    assert_eq!(
        failures,
        pairs(&[("manifest.toml", "root-digest"), (name, "sha256-mismatch")])
    );
}

#[test]
fn a_wrong_blake3_alone_is_reported_alone() {
    let s = Scratch::new("blake3");
    let b = s.join("bundle");
    write_synthetic(&b, Synthetic::default());
    edit_manifest(&b, true, |m| {
        m.tensors[0].blake3 = "f".repeat(64);
    });
    let (_, failures) = check_json(&b, None);
    assert_eq!(
        failures,
        pairs(&[("model.embed_tokens.weight", "blake3-mismatch")])
    );
}

#[test]
fn header_and_manifest_must_list_the_same_entries() {
    let s = Scratch::new("sets");
    let b = s.join("bundle");
    write_synthetic(&b, Synthetic::default());
    edit_manifest(&b, true, |m| {
        m.experts
            .retain(|e| e.name != "model.layers.0.mlp.experts.1");
        m.tensors.retain(|t| t.name != "model.norm.weight");
        let mut extra = m.tensors[0].clone();
        extra.name = "lm_head.weight".into();
        m.tensors.push(extra);
    });
    let (_, failures) = check_json(&b, None);
    assert_eq!(
        failures,
        pairs(&[
            ("model.norm.weight", "missing-in-manifest"),
            ("model.layers.0.mlp.experts.1", "missing-in-manifest"),
            ("lm_head.weight", "missing-in-bundle"),
        ])
    );
}

#[test]
fn a_shape_or_dtype_disagreement_is_a_header_manifest_mismatch() {
    let s = Scratch::new("shape");
    let b = s.join("bundle");
    write_synthetic(&b, Synthetic::default());
    edit_manifest(&b, true, |m| {
        // Same byte count, other shape: only the comparison with the header can catch it.
        let t = m
            .tensors
            .iter_mut()
            .find(|t| t.name == "model.embed_tokens.weight")
            .unwrap();
        t.shape = vec![t.shape[1], t.shape[0]];
        let e = &mut m.experts[1];
        e.matrices[2].shape = vec![e.matrices[2].shape[1], e.matrices[2].shape[0]];
    });
    let (_, failures) = check_json(&b, None);
    assert_eq!(
        failures,
        pairs(&[
            ("model.embed_tokens.weight", "header-manifest-mismatch"),
            ("model.layers.0.mlp.experts.1", "header-manifest-mismatch"),
        ])
    );
}

#[test]
fn copied_files_are_hashed_and_nothing_unlisted_may_sit_in_the_bundle() {
    let s = Scratch::new("files");
    let b = s.join("bundle");
    write_synthetic(&b, Synthetic::default());
    fs::write(b.join("notes.txt"), "hello").unwrap();
    fs::create_dir(b.join("cache")).unwrap();
    let (_, failures) = check_json(&b, None);
    assert_eq!(
        failures,
        pairs(&[("cache", "unlisted-file"), ("notes.txt", "unlisted-file")])
    );
    fs::remove_file(b.join("notes.txt")).unwrap();
    fs::remove_dir(b.join("cache")).unwrap();

    fs::write(b.join("config.json"), [CONFIG_JSON, b" "].concat()).unwrap();
    let (_, failures) = check_json(&b, None);
    assert_eq!(failures, pairs(&[("config.json", "file-sha256-mismatch")]));

    fs::remove_file(b.join("config.json")).unwrap();
    let (_, failures) = check_json(&b, None);
    assert_eq!(failures, pairs(&[("config.json", "missing-in-bundle")]));
}

#[test]
fn a_garbage_manifest_fails_verification_with_exit_1() {
    let s = Scratch::new("badmanifest");
    let b = s.join("bundle");
    write_synthetic(&b, Synthetic::default());
    fs::write(b.join("manifest.toml"), "manifest_version = \"nope\"\n").unwrap();
    let (r, failures) = check_json(&b, None);
    assert_eq!(r.code, 1);
    // Without a manifest the files cannot be matched either, so only the manifest is named.
    assert_eq!(failures, pairs(&[("manifest.toml", "invalid-manifest")]));
}

#[test]
fn a_truncated_container_fails_verification_with_exit_1() {
    let s = Scratch::new("truncated");
    let b = s.join("bundle");
    let (h, _) = write_synthetic(&b, Synthetic::default());
    let f = fs::OpenOptions::new()
        .write(true)
        .open(b.join("model.jnf"))
        .unwrap();
    f.set_len(h.file_size - 4096).unwrap();
    let (r, failures) = check_json(&b, None);
    assert_eq!(r.code, 1);
    assert_eq!(failures, pairs(&[("model.jnf", "invalid-header")]));
    assert!(r.json()["failures"][0]["detail"]
        .as_str()
        .unwrap()
        .contains("truncated"));
}

#[test]
fn a_bundle_missing_its_container_fails_with_exit_1() {
    let s = Scratch::new("nocontainer");
    let b = s.join("bundle");
    write_synthetic(&b, Synthetic::default());
    fs::remove_file(b.join("model.jnf")).unwrap();
    let (r, failures) = check_json(&b, None);
    assert_eq!(r.code, 1);
    assert_eq!(failures, pairs(&[("model.jnf", "missing-in-bundle")]));
}

#[test]
fn paths_that_are_not_bundles_exit_2_with_one_line() {
    let s = Scratch::new("notbundle");
    let file = s.join("file.txt");
    fs::write(&file, "x").unwrap();
    let empty = s.join("empty");
    fs::create_dir(&empty).unwrap();
    for p in [s.join("missing"), file, empty] {
        // Under --json the error is one JSON object on stdout, and stderr is quiet.
        let r = run(&[&"check", &p, &"--json"]);
        assert_eq!(r.code, 2, "{}: {}", p.display(), r.stderr);
        assert!(r.stderr.is_empty(), "{}", r.stderr);
        assert_eq!(r.stdout.lines().count(), 1, "{}", r.stdout);
        assert_eq!(r.json()["error"]["kind"], "not-a-bundle");
        let r = run(&[&"check", &p]);
        assert_eq!(r.code, 2, "{}: {}", p.display(), r.stderr);
        assert!(r.stdout.is_empty());
        assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
        assert!(r.stderr.contains(&p.display().to_string()), "{}", r.stderr);
        assert!(r.stderr.contains("not a bundle"), "{}", r.stderr);
    }
}

#[test]
fn a_source_that_is_not_a_checkpoint_exits_2() {
    let s = Scratch::new("badsource");
    let b = s.join("bundle");
    write_synthetic(&b, Synthetic::default());
    for src in [s.join("nowhere"), b.clone()] {
        let r = run(&[&"check", &b, &"--source", &src]);
        assert_eq!(r.code, 2, "{}", r.stderr);
        assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
        assert!(
            r.stderr.starts_with("tarfa-verify: source "),
            "{}",
            r.stderr
        );
    }
}

#[test]
fn a_symlink_loop_exits_2() {
    let s = Scratch::new("io");
    let b = s.join("bundle");
    write_synthetic(&b, Synthetic::default());
    // A symlink loop cannot be resolved (ELOOP): bad input, named, not an environment failure.
    fs::remove_file(b.join("model.jnf")).unwrap();
    std::os::unix::fs::symlink("model.jnf", b.join("model.jnf")).unwrap();
    let r = run(&[&"check", &b]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("model.jnf"), "{}", r.stderr);
}

#[test]
fn usage_errors_exit_2_and_help_documents_exit_codes() {
    let r = run(&[&"check"]);
    assert_eq!(r.code, 2);
    let r = run(&[&"frobnicate"]);
    assert_eq!(r.code, 2);
    for args in [
        vec!["--help"],
        vec!["check", "--help"],
        vec!["diff", "--help"],
    ] {
        let a: Vec<&dyn AsRef<std::ffi::OsStr>> = args
            .iter()
            .map(|s| s as &dyn AsRef<std::ffi::OsStr>)
            .collect();
        let r = run(&a);
        assert_eq!(r.code, 0);
        assert!(r.stdout.contains("Exit codes:"), "{}", r.stdout);
        assert!(r.stdout.contains("3  runtime failure"), "{}", r.stdout);
    }
}

#[test]
fn zero_length_tensors_share_an_offset_in_either_order() {
    let s = Scratch::new("zero");
    let b = s.join("bundle");
    let (h, _) = write_synthetic(
        &b,
        Synthetic {
            zero_length: true,
            ..Synthetic::default()
        },
    );
    assert_eq!(h.tensors[0].length, 0);
    assert_eq!(h.tensors[0].offset, h.tensors[1].offset);
    let (r, failures) = check_json(&b, None);
    assert_eq!(r.code, 0, "{failures:?}");

    // List the embedding before the empty tensor: same JSON length, same valid layout.
    let path = b.join("model.jnf");
    let mut bytes = fs::read(&path).unwrap();
    let end = 24 + json_len(&b) as usize;
    let mut v: serde_json::Value = serde_json::from_slice(&bytes[24..end]).unwrap();
    v["tensors"].as_array_mut().unwrap().swap(0, 1);
    let text = serde_json::to_vec(&v).unwrap();
    assert_eq!(text.len(), end - 24);
    bytes[24..end].copy_from_slice(&text);
    fs::write(&path, &bytes).unwrap();
    reseal_header(&b); // the manifest binds the header's bytes: record the reordered ones
    assert_eq!(read_header(&b).tensors[0].name, "model.embed_tokens.weight");
    let (r, failures) = check_json(&b, None);
    assert_eq!(r.code, 0, "{failures:?}");

    // The embedding's padding is still checked.
    let emb = &read_header(&b).tensors[0];
    set_byte(&path, emb.offset + emb.length, 9);
    let (_, failures) = check_json(&b, None);
    assert_eq!(
        failures,
        pairs(&[("model.embed_tokens.weight", "padding-not-zero")])
    );
}

#[test]
fn the_manifest_must_name_the_containers_format_version() {
    let s = Scratch::new("fmtver");
    let b = s.join("bundle");
    write_synthetic(&b, Synthetic::default());
    // "1.00" is version 1.0 spelled otherwise: it parses, but is not what model.jnf says.
    edit_manifest(&b, true, |m| m.format_version = "1.00".into());
    let (_, failures) = check_json(&b, None);
    assert_eq!(
        failures,
        pairs(&[("manifest.toml", "header-manifest-mismatch")])
    );
    // A newer format version than this reader's: the manifest is refused, naming it.
    edit_manifest(&b, true, |m| m.format_version = "1.1".into());
    let (report, failures) = check_json(&b, None);
    assert_eq!(failures, pairs(&[("manifest.toml", "invalid-manifest")]));
    assert!(
        report
            .stdout
            .contains("format version 1.1 is newer than this reader (1.0)"),
        "{}",
        report.stdout
    );
}
