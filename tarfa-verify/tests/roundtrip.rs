//! Round trips through the real converter on the real fixture: `tarfa-convert` writes a bundle,
//! `tarfa-verify` checks it (with and without the source), finds a flipped byte by name, and
//! diffs two conversions down to the one expert that differs.
//!
//! The converter binary is another package's, so Cargo gives us no `CARGO_BIN_EXE_` for it: it is
//! built (a no-op when up to date) into this test's own target directory, or taken from
//! `TARFA_CONVERT_BIN` when that is set.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::*;
use serde_json::json;

fn convert_bin() -> &'static Path {
    static BIN_PATH: OnceLock<PathBuf> = OnceLock::new();
    BIN_PATH.get_or_init(|| {
        if let Some(p) = std::env::var_os("TARFA_CONVERT_BIN") {
            return PathBuf::from(p);
        }
        // .../target/<profile>/tarfa-verify -> build tarfa-convert into the same place.
        let ours = Path::new(BIN);
        let profile_dir = ours.parent().unwrap();
        let target_dir = profile_dir.parent().unwrap();
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args([
            "build",
            "--quiet",
            "-p",
            "tarfa-convert",
            "--bin",
            "tarfa-convert",
        ])
        .env("CARGO_TARGET_DIR", target_dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"));
        if profile_dir.file_name() == Some("release".as_ref()) {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("cargo runs");
        assert!(status.success(), "building tarfa-convert failed");
        let bin = profile_dir.join("tarfa-convert");
        assert!(bin.is_file(), "{} was not built", bin.display());
        bin
    })
}

fn convert(src: &Path, out: &Path) {
    let o = Command::new(convert_bin())
        .arg(src)
        .arg(out)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "tarfa-convert {} {} failed: {}",
        src.display(),
        out.display(),
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn a_converted_fixture_verifies_with_and_without_source() {
    let s = Scratch::new("rt-ok");
    let b = s.join("bundle");
    convert(FIXTURE_A.as_ref(), &b);
    let (r, failures) = check_json(&b, None);
    assert_eq!(r.code, 0, "{failures:?}");
    let (r, failures) = check_json(&b, Some(FIXTURE_A.as_ref()));
    assert_eq!(r.code, 0, "{failures:?}");
    // The human form too.
    let r = run(&[&"check", &b, &"--source", &FIXTURE_A]);
    assert_eq!(r.code, 0);
    assert!(r.stdout.starts_with("ok: "), "{}", r.stdout);
    assert!(r.stdout.contains("128 experts"), "{}", r.stdout);
}

#[test]
fn a_flipped_expert_byte_in_the_bundle_names_exactly_that_expert() {
    let s = Scratch::new("rt-flip");
    let b = s.join("bundle");
    convert(FIXTURE_A.as_ref(), &b);
    let h = read_header(&b);
    let e = h.expert(1, 17).unwrap();
    flip_byte(&b.join("model.jnf"), e.offset + e.length / 2);
    let (r, failures) = check_json(&b, None);
    assert_eq!(r.code, 1);
    let want = |k: &str| (e.prefix.clone(), k.to_string());
    assert_eq!(failures, [want("sha256-mismatch"), want("blake3-mismatch")]);
    assert_eq!(e.prefix, "model.layers.1.mlp.experts.17");
}

#[test]
fn a_flipped_byte_in_a_source_shard_names_the_tensor_and_the_shard() {
    let s = Scratch::new("rt-src");
    let b = s.join("bundle");
    let src = s.join("src");
    copy_dir(FIXTURE_A.as_ref(), &src);
    convert(&src, &b);
    let h = read_header(&b);
    let t = h.tensor("model.layers.2.self_attn.o_proj.weight").unwrap();
    let sref = t.source.clone().expect("the converter records sources");
    flip_byte(&src.join(&sref.shard), sref.offset + 33);
    let (r, failures) = check_json(&b, Some(&src));
    assert_eq!(r.code, 1);
    assert_eq!(
        failures,
        [
            (t.name.clone(), "source-bytes-differ".to_string()),
            (sref.shard.clone(), "shard-sha256-mismatch".to_string()),
        ]
    );
    // Without the source, the bundle alone is still intact.
    assert_eq!(check_json(&b, None).0.code, 0);
}

#[test]
fn two_conversions_differ_in_exactly_the_changed_expert() {
    let s = Scratch::new("rt-diff");
    let src = s.join("src");
    copy_dir(FIXTURE_A.as_ref(), &src);
    // Change one byte of one matrix of expert (3, 9) in the copy of the checkpoint.
    let ck = tarfa_checkpoint::open(&src).unwrap();
    let name = "model.layers.3.mlp.experts.9.down_proj.weight";
    let t = &ck.tensors[name];
    let (shard, offset) = (src.join(&ck.shards[t.shard].name), t.offset);
    drop(ck);
    flip_byte(&shard, offset + 1);

    convert(FIXTURE_A.as_ref(), &s.join("a"));
    convert(&src, &s.join("b"));
    let r = run(&[&"diff", &s.join("a"), &s.join("b"), &"--json"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    let v = r.json();
    assert_eq!(
        v["changed"],
        json!([{"name": "model.layers.3.mlp.experts.9", "kind": "expert", "change": "bytes"}])
    );
    assert_eq!(v["added"], json!([]));
    assert_eq!(v["removed"], json!([]));
    // Every other tensor, expert and copied file is unchanged.
    let m = read_manifest(&s.join("a"));
    let entries = m.tensors.len() + m.experts.len() + m.files.len();
    assert_eq!(v["unchanged"], entries - 1);

    // The same two manifests given as files, and a release against itself.
    let r = run(&[
        &"diff",
        &s.join("a/manifest.toml"),
        &s.join("b/manifest.toml"),
    ]);
    assert_eq!(r.code, 1);
    assert!(r
        .stdout
        .starts_with("changed  model.layers.3.mlp.experts.9 (expert, bytes)\n"));
    let r = run(&[&"diff", &s.join("b"), &s.join("b")]);
    assert_eq!(r.code, 0);
}
