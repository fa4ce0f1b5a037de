//! `tarfa-verify diff` between synthetic releases: exactly what changed is reported, from the
//! manifests alone.

mod common;

use std::fs;
use std::io::Read;
use std::process::{Command, Stdio};

use common::*;
use serde_json::json;

#[test]
fn identical_releases_have_no_differences() {
    let s = Scratch::new("same");
    let (_, m) = write_synthetic(&s.join("a"), Synthetic::default());
    write_synthetic(&s.join("b"), Synthetic::default());
    let r = run(&[&"diff", &s.join("a"), &s.join("b"), &"--json"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let entries = m.tensors.len() + m.experts.len() + m.files.len();
    assert_eq!(
        r.json(),
        json!({"changed": [], "added": [], "removed": [], "unchanged": entries})
    );
}

#[test]
fn one_changed_expert_is_reported_by_prefix_and_nothing_else() {
    let s = Scratch::new("oneexpert");
    let (h, m) = write_synthetic(&s.join("a"), Synthetic::default());
    write_synthetic(&s.join("b"), Synthetic::default());
    // Change the expert's bytes in b, then re-record its hashes as a converter would.
    let e = &h.experts[6];
    let b = s.join("b");
    flip_byte(&b.join("model.jnf"), e.offset + 10);
    let bytes = fs::read(b.join("model.jnf")).unwrap();
    let extent = &bytes[e.offset as usize..(e.offset + e.length) as usize];
    edit_manifest(&b, true, |m| {
        let r = m.experts.iter_mut().find(|r| r.name == e.prefix).unwrap();
        r.sha256 = tarfa_manifest::hash::sha256_hex(extent);
        r.blake3 = tarfa_manifest::hash::blake3_hex(extent);
    });
    assert_eq!(check_json(&b, None).0.code, 0, "b is a valid bundle");

    let r = run(&[&"diff", &s.join("a"), &b, &"--json"]);
    assert_eq!(r.code, 1);
    let entries = m.tensors.len() + m.experts.len() + m.files.len();
    assert_eq!(
        r.json(),
        json!({
            "changed": [{"name": "model.layers.1.mlp.experts.2", "kind": "expert", "change": "bytes"}],
            "added": [],
            "removed": [],
            "unchanged": entries - 1,
        })
    );

    let r = run(&[&"diff", &s.join("a"), &b]);
    assert_eq!(r.code, 1);
    assert!(r
        .stdout
        .starts_with("changed  model.layers.1.mlp.experts.2 (expert, bytes)\n"));
    // The per-layer table: layer 1 has the change, layer 0 none.
    let row = |label: &str| {
        r.stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(label))
            .unwrap_or_else(|| panic!("no row {label}: {}", r.stdout))
            .split_whitespace()
            .skip(1)
            .map(|n| n.parse::<usize>().unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(row("0"), [0, 0, 0, 5]); // 4 experts and a norm
    assert_eq!(row("1"), [1, 0, 0, 4]);
    assert_eq!(row("global"), [0, 0, 0, 3]); // embedding, final norm, config.json
    assert!(r
        .stdout
        .ends_with("1 changed, 0 added, 0 removed, 12 unchanged\n"));
}

#[test]
fn added_removed_and_reshaped_entries() {
    let s = Scratch::new("shapes");
    write_synthetic(&s.join("a"), Synthetic::default());
    write_synthetic(
        &s.join("b"),
        Synthetic {
            experts: 5,
            vocab: 40,
            ..Synthetic::default()
        },
    );
    fs::remove_file(s.join("b/config.json")).unwrap();
    edit_manifest(&s.join("b"), true, |m| m.files.clear());
    let r = run(&[&"diff", &s.join("a"), &s.join("b"), &"--json"]);
    assert_eq!(r.code, 1);
    let v = r.json();
    assert_eq!(
        v["added"],
        json!([
            "model.layers.0.mlp.experts.4",
            "model.layers.1.mlp.experts.4"
        ])
    );
    assert_eq!(v["removed"], json!(["config.json"]));
    let changed = v["changed"].as_array().unwrap();
    // Different seeds per bundle position would change bytes too; the embedding is reshaped.
    let emb = changed
        .iter()
        .find(|c| c["name"] == "model.embed_tokens.weight")
        .unwrap();
    assert_eq!(emb["change"], "shape");
    assert_eq!(emb["from"], json!([32, 16]));
    assert_eq!(emb["to"], json!([40, 16]));
}

#[test]
fn a_diff_reads_no_tensor_data() {
    let s = Scratch::new("nodata");
    write_synthetic(&s.join("a"), Synthetic::default());
    write_synthetic(&s.join("b"), Synthetic::default());
    // Garbage containers: only the manifests are read.
    fs::write(s.join("a/model.jnf"), b"garbage").unwrap();
    fs::remove_file(s.join("b/model.jnf")).unwrap();
    let r = run(&[&"diff", &s.join("a"), &s.join("b/manifest.toml"), &"--json"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["changed"], json!([]));
}

#[test]
fn bad_inputs_exit_2() {
    let s = Scratch::new("diffbad");
    write_synthetic(&s.join("a"), Synthetic::default());
    fs::write(s.join("garbage.toml"), "[[tensors]]\nname = 3\n").unwrap();
    fs::create_dir(s.join("empty")).unwrap();
    for other in [s.join("missing"), s.join("garbage.toml"), s.join("empty")] {
        // Under --json: one JSON object on stdout naming the path, nothing on stderr.
        let r = run(&[&"diff", &s.join("a"), &other, &"--json"]);
        assert_eq!(r.code, 2, "{}", r.stderr);
        assert!(r.stderr.is_empty(), "{}", r.stderr);
        let v = r.json();
        assert_eq!(v["exit_code"], 2);
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains(&other.display().to_string()),
            "{v}"
        );
        let r = run(&[&"diff", &s.join("a"), &other]);
        assert_eq!(r.code, 2, "{}", r.stderr);
        assert!(r.stdout.is_empty());
        assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
        assert!(
            r.stderr.contains(&other.display().to_string()),
            "{}",
            r.stderr
        );
    }
}

#[test]
fn a_manifest_with_a_wrong_root_is_diffed_with_a_warning() {
    let s = Scratch::new("diffroot");
    write_synthetic(&s.join("a"), Synthetic::default());
    write_synthetic(&s.join("b"), Synthetic::default());
    edit_manifest(&s.join("b"), false, |m| m.root_digest = "0".repeat(64));
    let r = run(&[&"diff", &s.join("a"), &s.join("b")]);
    assert_eq!(r.code, 0);
    assert!(r.stderr.contains("warning") && r.stderr.contains("root digest"));
}

#[test]
fn a_closed_pipe_keeps_the_verdict() {
    // Enough differences to fill the pipe, so the writer must meet EPIPE after the reader goes:
    // the differences are still found (exit 1), quietly. Only a success stays a success.
    let s = Scratch::new("pipe");
    let big = Synthetic {
        layers: 40,
        experts: 64,
        hidden: 2,
        inter: 2,
        vocab: 2,
        ..Synthetic::default()
    };
    write_synthetic(&s.join("a"), big);
    write_synthetic(&s.join("b"), Synthetic { seed: 2, ..big });
    let mut child = Command::new(BIN)
        .args([
            "diff".as_ref(),
            s.join("a").as_os_str(),
            s.join("b").as_os_str(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 16];
    child
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut first)
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn an_expert_shape_change_is_shown_per_matrix() {
    let s = Scratch::new("expertshape");
    write_synthetic(&s.join("a"), Synthetic::default());
    write_synthetic(
        &s.join("b"),
        Synthetic {
            inter: 4,
            ..Synthetic::default()
        },
    );
    let r = run(&[&"diff", &s.join("a"), &s.join("b")]);
    assert_eq!(r.code, 1);
    assert!(
        r.stdout.contains(
            "changed  model.layers.0.mlp.experts.0 (expert, shape gate [8, 16] up [8, 16] \
             down [16, 8] -> gate [4, 16] up [4, 16] down [16, 4])\n"
        ),
        "{}",
        r.stdout
    );
    let v = run(&[&"diff", &s.join("a"), &s.join("b"), &"--json"]).json();
    // Tensors are filled first from the same seed, so only the 8 experts differ, all by shape.
    let changed = v["changed"].as_array().unwrap();
    assert_eq!(changed.len(), 8);
    assert!(changed
        .iter()
        .all(|c| c["kind"] == "expert" && c["change"] == "shape"));
}
