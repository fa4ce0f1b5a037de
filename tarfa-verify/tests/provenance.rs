//! The provenance holes of issue 15, each built as a hostile bundle and run through the real
//! binary: the root digest binds BLAKE3, dtypes, shapes, offsets and the header; copied files are
//! compared with the source; a FIFO never hangs a check; broken pipes keep the verdict; errors
//! under --json are JSON; names are escaped; NaN/Inf are notes.

mod common;

use std::fs;
use std::path::Path;

use common::*;
use tarfa_manifest::hash::{blake3_hex, sha256_hex};

/// How long any one run may take before it counts as a hang.
const HANG: u64 = 30;

fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

/// Rewrite model.jnf's header JSON through `edit`, keeping data_start (the edit must stay in
/// the header's padding): what a forger does to relabel a tensor or change metadata.
fn rewrite_header(bundle: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = bundle.join("model.jnf");
    let mut bytes = fs::read(&path).unwrap();
    let len = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
    let mut v: serde_json::Value = serde_json::from_slice(&bytes[24..24 + len]).unwrap();
    let data_start = v["data_start"].as_u64().unwrap() as usize;
    edit(&mut v);
    let json = serde_json::to_vec(&v).unwrap();
    assert!(
        24 + json.len() <= data_start,
        "the edit must fit the header's room"
    );
    bytes[16..24].copy_from_slice(&(json.len() as u64).to_le_bytes());
    bytes[24..data_start].fill(0);
    bytes[24..24 + json.len()].copy_from_slice(&json);
    fs::write(&path, bytes).unwrap();
}

fn root_line(bundle: &Path) -> String {
    fs::read_to_string(bundle.join("manifest.toml"))
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .to_string()
}

fn check(bundle: &Path) -> (Run, Vec<(String, String)>) {
    check_json(bundle, None)
}

#[test]
fn a_blake3_only_edit_keeps_no_root() {
    for target in ["expert", "tensor"] {
        let s = Scratch::new("b3only");
        let b = s.join("bundle");
        let (h, _) = write_synthetic(&b, Synthetic::default());
        let before = root_line(&b);
        // Change the bytes, then record only their new BLAKE3 (the runtime's check) and keep
        // the root line as it was.
        let (name, offset, length) = match target {
            "expert" => {
                let e = h.expert(1, 2).unwrap();
                (e.prefix.clone(), e.offset, e.length)
            }
            _ => {
                let t = h.tensor("model.norm.weight").unwrap();
                (t.name.clone(), t.offset, t.length)
            }
        };
        flip_byte(&b.join("model.jnf"), offset + 3);
        let jnf = fs::read(b.join("model.jnf")).unwrap();
        let new_b3 = blake3_hex(&jnf[offset as usize..(offset + length) as usize]);
        edit_manifest(&b, false, |m| {
            if let Some(e) = m.experts.iter_mut().find(|e| e.name == name) {
                e.blake3 = new_b3.clone();
            }
            if let Some(t) = m.tensors.iter_mut().find(|t| t.name == name) {
                t.blake3 = new_b3.clone();
            }
        });
        assert_eq!(root_line(&b), before, "the forger keeps the root line");
        let (r, failures) = check(&b);
        assert_eq!(r.code, 1);
        assert_eq!(
            failures,
            pairs(&[("manifest.toml", "root-digest"), (&name, "sha256-mismatch")]),
            "{target}"
        );
    }
}

#[test]
fn a_dtype_relabel_is_caught_at_every_step_of_the_forgery() {
    let s = Scratch::new("relabel");
    let b = s.join("bundle");
    write_synthetic(&b, Synthetic::default());
    let original = root_line(&b);
    let relabel = |v: &mut serde_json::Value| {
        for t in v["tensors"].as_array_mut().unwrap() {
            if t["name"] == "model.embed_tokens.weight" {
                t["dtype"] = "F16".into();
            }
        }
    };
    // 1. The header alone: its digest and the entry both disagree with the manifest.
    rewrite_header(&b, relabel);
    let (r, failures) = check(&b);
    assert_eq!(r.code, 1);
    assert_eq!(
        failures,
        pairs(&[
            ("model.jnf", "header-digest-mismatch"),
            ("model.embed_tokens.weight", "header-manifest-mismatch"),
        ])
    );
    // 2. The manifest made to agree, the root line kept: the root no longer matches.
    let jnf = fs::read(b.join("model.jnf")).unwrap();
    edit_manifest(&b, false, |m| {
        m.header = tarfa_manifest::HeaderRecord::of_container_prefix(&jnf).unwrap();
        m.tensors
            .iter_mut()
            .find(|t| t.name == "model.embed_tokens.weight")
            .unwrap()
            .dtype = "F16".into();
    });
    let (_, failures) = check(&b);
    assert_eq!(failures, pairs(&[("manifest.toml", "root-digest")]));
    // 3. Re-sealed: self-consistent, so only the root tells, and the root has changed.
    edit_manifest(&b, true, |_| {});
    let (r, _) = check(&b);
    assert_eq!(r.code, 0);
    assert_ne!(root_line(&b), original);
}

#[test]
fn a_shape_change_and_an_offset_disagreement_are_refused() {
    let s = Scratch::new("shape");
    let b = s.join("bundle");
    write_synthetic(&b, Synthetic::default());
    // [32, 16] -> [16, 32]: the same length, another matrix.
    rewrite_header(&b, |v| {
        for t in v["tensors"].as_array_mut().unwrap() {
            if t["name"] == "model.embed_tokens.weight" {
                t["shape"] = serde_json::json!([16, 32]);
            }
        }
    });
    reseal_header(&b);
    let (r, failures) = check(&b);
    assert_eq!(r.code, 1);
    assert_eq!(
        failures,
        pairs(&[("model.embed_tokens.weight", "header-manifest-mismatch")])
    );
    // The manifest pins offsets too: one moved in the manifest alone is named.
    let s2 = Scratch::new("offset");
    let b2 = s2.join("bundle");
    write_synthetic(&b2, Synthetic::default());
    edit_manifest(&b2, true, |m| m.experts[3].offset += 4096);
    let (_, failures) = check(&b2);
    let name = read_manifest(&b2).experts[3].name.clone();
    assert_eq!(failures, pairs(&[(&name, "header-manifest-mismatch")]));
}

#[test]
fn header_metadata_and_source_records_are_bound() {
    let s = Scratch::new("meta");
    let b = s.join("bundle");
    let src = s.join("src");
    copy_dir(FIXTURE_A.as_ref(), &src);
    let (h, _) = bundle_from_checkpoint(&src, &b);
    let good = b.with_extension("orig");
    copy_dir(&b, &good);
    rewrite_header(&b, |v| v["metadata"]["converter"] = "someone else".into());
    let (r, failures) = check(&b);
    assert_eq!(r.code, 1);
    assert_eq!(failures, pairs(&[("model.jnf", "header-digest-mismatch")]));

    // A tensor's source record pointed elsewhere: the header digest says so without the source.
    fs::remove_dir_all(&b).unwrap();
    copy_dir(&good, &b);
    let victim = h.tensors[1].name.clone();
    rewrite_header(&b, |v| {
        for t in v["tensors"].as_array_mut().unwrap() {
            if t["name"] == victim.as_str() {
                t["source"]["offset"] = 8.into();
            }
        }
    });
    let (_, failures) = check(&b);
    assert_eq!(failures, pairs(&[("model.jnf", "header-digest-mismatch")]));
    let _ = fs::remove_dir_all(&good);
}

#[test]
fn a_copied_file_edited_with_a_consistent_manifest_fails_check_source() {
    let s = Scratch::new("copied");
    let b = s.join("bundle");
    bundle_from_checkpoint(FIXTURE_A.as_ref(), &b);
    let before = root_line(&b);
    for (file, from, to) in [
        (
            "config.json",
            "\"num_experts_per_tok\": 8",
            "\"num_experts_per_tok\": 2",
        ),
        ("generation_config.json", "{", "{\"eos_token_id\": 7, "),
    ] {
        let text = fs::read_to_string(b.join(file)).unwrap();
        assert!(text.contains(from), "{file}");
        let edited = text.replacen(from, to, 1);
        fs::write(b.join(file), &edited).unwrap();
        edit_manifest(&b, true, |m| {
            let f = m.files.iter_mut().find(|f| f.name == file).unwrap();
            f.size = edited.len() as u64;
            f.sha256 = sha256_hex(edited.as_bytes());
        });
    }
    // Self-consistent: without the source only a pinned root tells (and it changed).
    let (r, _) = check(&b);
    assert_eq!(r.code, 0);
    assert_ne!(root_line(&b), before);
    let (r, failures) = check_json(&b, Some(FIXTURE_A.as_ref()));
    assert_eq!(r.code, 1);
    assert_eq!(
        failures,
        pairs(&[
            ("config.json", "source-file-differs"),
            ("generation_config.json", "source-file-differs"),
        ])
    );
    // The human report names the file on one line.
    let r = run_timeout(&[&"check", &b, &"--source", &FIXTURE_A], HANG);
    assert_eq!(r.code, 1);
    assert!(
        r.stdout
            .lines()
            .any(|l| l.starts_with("FAIL config.json: source-file-differs: ")),
        "{}",
        r.stdout
    );
}

#[test]
fn an_unlisted_extra_file_is_a_failure() {
    let s = Scratch::new("extra");
    let b = s.join("bundle");
    write_synthetic(&b, Synthetic::default());
    fs::write(b.join("tokenizer.json"), b"{}").unwrap();
    let (r, failures) = check(&b);
    assert_eq!(r.code, 1);
    assert_eq!(failures, pairs(&[("tokenizer.json", "unlisted-file")]));
}

#[test]
fn a_listed_file_missing_is_a_failure_not_an_io_error() {
    let s = Scratch::new("missing");
    let b = s.join("bundle");
    write_synthetic(&b, Synthetic::default());
    fs::remove_file(b.join("config.json")).unwrap();
    let (r, failures) = check(&b);
    assert_eq!(r.code, 1);
    assert_eq!(failures, pairs(&[("config.json", "missing-in-bundle")]));
    // A dangling symlink is missing too.
    std::os::unix::fs::symlink("nowhere.json", b.join("config.json")).unwrap();
    let (r, failures) = check(&b);
    assert_eq!(r.code, 1);
    assert_eq!(failures, pairs(&[("config.json", "missing-in-bundle")]));
}

fn mkfifo(path: &Path) {
    let st = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap();
    assert!(st.success());
}

#[test]
fn a_fifo_in_a_bundle_exits_2_at_once() {
    for victim in ["manifest.toml", "model.jnf", "config.json"] {
        let s = Scratch::new("fifo");
        let b = s.join("bundle");
        write_synthetic(&b, Synthetic::default());
        fs::remove_file(b.join(victim)).unwrap();
        mkfifo(&b.join(victim));
        let r = run_timeout(&[&"check", &b], HANG);
        assert_eq!(r.code, 2, "{victim}: {}", r.stderr);
        assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
        assert!(
            r.stderr.contains(&b.join(victim).display().to_string()) && r.stderr.contains("FIFO"),
            "{}",
            r.stderr
        );
        assert!(!r.stderr.contains("panicked"));
        // diff reads manifests the same way.
        if victim == "manifest.toml" {
            let r = run_timeout(&[&"diff", &b, &b], HANG);
            assert_eq!(r.code, 2, "{}", r.stderr);
            assert!(r.stderr.contains("FIFO"), "{}", r.stderr);
        }
    }
}

#[test]
fn a_symlink_loop_is_bad_input() {
    for victim in ["model.jnf", "manifest.toml", "config.json"] {
        let s = Scratch::new("loop");
        let b = s.join("bundle");
        write_synthetic(&b, Synthetic::default());
        fs::remove_file(b.join(victim)).unwrap();
        std::os::unix::fs::symlink(victim, b.join(victim)).unwrap();
        let r = run_timeout(&[&"check", &b], HANG);
        assert_eq!(r.code, 2, "{victim}: {}", r.stderr);
        assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
        assert!(r.stderr.contains(victim), "{}", r.stderr);
    }
}

#[test]
fn a_broken_pipe_keeps_the_verdict() {
    use std::process::{Command, Stdio};
    let s = Scratch::new("pipe");
    let good = s.join("good");
    write_synthetic(&good, Synthetic::default());
    let bad = s.join("bad");
    write_synthetic(&bad, Synthetic::default());
    edit_manifest(&bad, true, |m| {
        for e in &mut m.experts {
            e.sha256 = sha256_hex(b"wrong");
        }
    });
    for (b, want) in [(&good, 0), (&bad, 1)] {
        for all in [false, true] {
            // The reader is gone before the first write (`| head -0`).
            let mut c = Command::new(BIN);
            c.arg("check").arg(b);
            if all {
                c.arg("--all");
            }
            let mut child = c
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            drop(child.stdout.take());
            let out = child.wait_with_output().unwrap();
            assert_eq!(
                out.status.code(),
                Some(want),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                out.stderr.is_empty(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

#[test]
fn failures_are_capped_at_20_with_a_count_unless_all() {
    let s = Scratch::new("cap");
    let b = s.join("bundle");
    write_synthetic(
        &b,
        Synthetic {
            layers: 3,
            experts: 8,
            ..Synthetic::default()
        },
    );
    edit_manifest(&b, true, |m| {
        for e in &mut m.experts {
            e.sha256 = sha256_hex(b"wrong");
        }
    });
    let r = run_timeout(&[&"check", &b], HANG);
    assert_eq!(r.code, 1);
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(lines.iter().filter(|l| l.starts_with("FAIL ")).count(), 20);
    assert!(
        lines.contains(&"... and 4 more failures (--all or --json lists every one)"),
        "{}",
        r.stdout
    );
    assert!(
        lines.last().unwrap().contains("24 failures"),
        "{}",
        r.stdout
    );
    let r = run_timeout(&[&"check", &b, &"--all"], HANG);
    assert_eq!(
        r.stdout.lines().filter(|l| l.starts_with("FAIL ")).count(),
        24
    );
    let (_, failures) = check(&b);
    assert_eq!(failures.len(), 24);
}

#[test]
fn errors_under_json_are_json_on_stdout() {
    let s = Scratch::new("jsonerr");
    let nowhere = s.join("nowhere");
    for args in [
        vec![
            "check".to_string(),
            nowhere.display().to_string(),
            "--json".into(),
        ],
        vec![
            "diff".to_string(),
            nowhere.display().to_string(),
            nowhere.display().to_string(),
            "--json".into(),
        ],
    ] {
        let a: Vec<&dyn AsRef<std::ffi::OsStr>> = args
            .iter()
            .map(|s| s as &dyn AsRef<std::ffi::OsStr>)
            .collect();
        let r = run_timeout(&a, HANG);
        assert_eq!(r.code, 2);
        let v = r.json();
        assert_eq!(v["exit_code"], 2);
        assert!(
            ["not-a-bundle", "not-a-manifest"].contains(&v["error"]["kind"].as_str().unwrap()),
            "{v}"
        );
        assert_eq!(v["error"]["path"], nowhere.display().to_string());
        assert!(v["error"]["message"].as_str().unwrap().contains("nowhere"));
    }
    // A FIFO manifest under --json: the same shape, kind not-a-regular-file.
    let b = s.join("bundle");
    write_synthetic(&b, Synthetic::default());
    fs::remove_file(b.join("manifest.toml")).unwrap();
    mkfifo(&b.join("manifest.toml"));
    let r = run_timeout(&[&"check", &b, &"--json"], HANG);
    assert_eq!(r.code, 2);
    assert_eq!(r.json()["error"]["kind"], "not-a-regular-file");
}

#[test]
fn unusual_characters_in_names_are_escaped() {
    let s = Scratch::new("bidi");
    let b = s.join("bundle");
    write_synthetic(&b, Synthetic::default());
    // U+202E turns "exe.jnf" into what a terminal shows as "fnj.exe"; ESC starts a colour.
    fs::write(b.join("evil\u{202E}fnj.txt"), b"x").unwrap();
    fs::write(b.join("red\u{1b}[31m"), b"x").unwrap();
    let r = run_timeout(&[&"check", &b], HANG);
    assert_eq!(r.code, 1);
    assert!(!r.stdout.contains('\u{202E}') && !r.stdout.contains('\u{1b}'));
    assert!(
        r.stdout
            .contains("FAIL evil\\u{202e}fnj.txt: unlisted-file"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("FAIL red\\u{1b}[31m: unlisted-file"),
        "{}",
        r.stdout
    );
    // A manifest naming a tensor with a bidi override is invalid, however it was sealed.
    let s2 = Scratch::new("bidi2");
    let b2 = s2.join("bundle");
    write_synthetic(&b2, Synthetic::default());
    edit_manifest(&b2, true, |m| {
        m.tensors[0].name = "model.norm\u{202E}thgiew".into()
    });
    let r = run_timeout(&[&"check", &b2], HANG);
    assert_eq!(r.code, 1);
    assert!(
        r.stdout.contains("FAIL manifest.toml: invalid-manifest: ")
            && !r.stdout.contains('\u{202E}'),
        "{}",
        r.stdout
    );
}

#[test]
fn nonfinite_elements_are_a_note_not_a_failure() {
    let s = Scratch::new("nonfinite");
    let b = s.join("bundle");
    write_synthetic(&b, Synthetic::default());
    edit_manifest(&b, true, |m| {
        m.tensors[0].nonfinite = 3;
        m.experts[1].nonfinite = 1;
    });
    let m = read_manifest(&b);
    let r = run_timeout(&[&"check", &b], HANG);
    assert_eq!(r.code, 0, "{}", r.stdout);
    assert!(
        r.stdout.contains(&format!(
            "NOTE {}: 3 NaN or infinite elements",
            m.tensors[0].name
        )),
        "{}",
        r.stdout
    );
    assert!(r.stdout.lines().last().unwrap().starts_with("ok: "));
    let (r, failures) = check(&b);
    assert!(failures.is_empty());
    let notes = r.json()["notes"].as_array().unwrap().clone();
    assert_eq!(notes.len(), 2);
    assert_eq!(notes[1]["name"], m.experts[1].name.as_str());
}

#[test]
fn a_version_1_manifest_is_refused_with_the_advice_to_reconvert() {
    let s = Scratch::new("v1");
    let b = s.join("bundle");
    write_synthetic(&b, Synthetic::default());
    let text = fs::read_to_string(b.join("manifest.toml")).unwrap();
    let (root, body) = text.split_once('\n').unwrap();
    let v1 = body.replacen("manifest_version = 2", "manifest_version = 1", 1) + root + "\n";
    fs::write(b.join("manifest.toml"), v1).unwrap();
    let r = run_timeout(&[&"check", &b], HANG);
    assert_eq!(r.code, 1);
    assert!(
        r.stdout
            .contains("FAIL manifest.toml: invalid-manifest: manifest_version 1 is refused")
            && r.stdout.contains("re-convert"),
        "{}",
        r.stdout
    );
}
