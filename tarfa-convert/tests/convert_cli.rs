//! The converter end to end: round trip on a real transformers checkpoint, atomicity under
//! interruption, --force, stale temporaries, Hub cache snapshots, and the synthetic generator.

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use tarfa_manifest::hash::to_hex;
use tarfa_manifest::Manifest;

mod common;
use common::{big_source, fixture, run, BIN};

#[test]
fn converts_the_oracle_checkpoint_byte_for_byte() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("bundle");
    let src = fixture("qwen3moe-a");
    let (code, stdout, err) = run(&[&src, &out]);
    assert_eq!(code, 0, "{err}");
    let manifest = Manifest::load(&out.join("manifest.toml")).unwrap();
    manifest.check_root().unwrap();
    assert!(
        stdout.contains(&manifest.root_digest),
        "prints the root digest: {stdout}"
    );
    let mut names: Vec<_> = fs::read_dir(&out)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "config.json",
            "generation_config.json",
            "manifest.toml",
            "model.jnf"
        ]
    );
    for f in &manifest.files {
        assert_eq!(
            fs::read(out.join(&f.name)).unwrap(),
            fs::read(src.join(&f.name)).unwrap()
        );
    }

    // Every tensor and expert in the container is the source's bytes, at the recorded source.
    let ckpt = tarfa_checkpoint::open(&src).unwrap();
    let jnf = jnf_format::JnfFile::open(&out.join("model.jnf")).unwrap();
    let h = jnf.header();
    assert_eq!(h.tensors.len(), ckpt.non_expert.len());
    assert_eq!(h.experts.len(), 4 * 32);
    for t in &h.tensors {
        let bytes = jnf.read_tensor(t).unwrap();
        assert_eq!(
            bytes,
            ckpt.read_tensor_bytes(&t.name).unwrap(),
            "{}",
            t.name
        );
        let rec = manifest.tensor(&t.name).unwrap();
        assert_eq!(rec.sha256, to_hex(&Sha256::digest(&bytes)));
        let src_ref = t.source.as_ref().unwrap();
        assert_eq!(src_ref.offset, ckpt.tensors[&t.name].offset);
    }
    let idx = manifest.expert_index();
    let mut buf = Vec::new();
    for e in &h.experts {
        jnf.read_extent_into(e, &mut buf).unwrap();
        let mut expected = Vec::new();
        for m in &e.matrices {
            expected.extend(ckpt.read_tensor_bytes(&m.name).unwrap());
        }
        assert_eq!(buf, expected, "{}", e.prefix);
        assert_eq!(
            idx[&(e.layer, e.expert)].sha256,
            to_hex(&Sha256::digest(&buf))
        );
        assert_eq!(idx[&(e.layer, e.expert)].blake3, blake3_hex(&buf));
    }
    // Shard records are the whole-file SHA-256s (what the Hub shows as the LFS sha256).
    for s in &manifest.shards {
        assert_eq!(
            s.sha256,
            to_hex(&Sha256::digest(fs::read(src.join(&s.name)).unwrap()))
        );
    }
}

fn blake3_hex(b: &[u8]) -> String {
    tarfa_manifest::hash::blake3_hex(b)
}

#[test]
fn never_overwrites_without_force() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("bundle");
    let a = fixture("qwen3moe-a");
    assert_eq!(run(&[&a, &out]).0, 0);
    let before = fs::read(out.join("manifest.toml")).unwrap();
    let (code, _, err) = run(&[&fixture("qwen3moe-code"), &out]);
    assert_eq!(code, 2);
    assert!(err.contains("--force"), "{err}");
    assert_eq!(
        fs::read(out.join("manifest.toml")).unwrap(),
        before,
        "untouched"
    );
    let (code, _, err) = run(&[&fixture("qwen3moe-code"), &out, &"--force"]);
    assert_eq!(code, 0, "{err}");
    let m = Manifest::load(&out.join("manifest.toml")).unwrap();
    assert!(
        m.files.iter().any(|f| f.name == "tokenizer.json"),
        "replaced by the second model"
    );
    let leftovers: Vec<_> = fs::read_dir(d.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(leftovers.len(), 1, "{leftovers:?}");
}

#[test]
fn removes_stale_temporaries_and_says_so() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("bundle");
    // A temporary of a process that no longer exists (above the default pid_max).
    let stale = d.path().join(".bundle.tarfa-tmp-4194999");
    fs::create_dir(&stale).unwrap();
    fs::write(stale.join("model.jnf"), b"half written").unwrap();
    let (code, _, err) = run(&[&fixture("qwen3moe-a"), &out]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("removed stale temporary") && err.contains("tarfa-tmp-4194999"),
        "{err}"
    );
    assert!(!stale.exists());
}

fn wait_for_temporary(dir: &Path) -> bool {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(20) {
        let found = fs::read_dir(dir)
            .unwrap()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().contains("tarfa-tmp"));
        if found {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}

#[test]
fn interrupted_conversion_leaves_nothing() {
    let d = tempfile::tempdir().unwrap();
    let src = big_source(d.path());
    let outdir = d.path().join("o");
    fs::create_dir(&outdir).unwrap();
    let out = outdir.join("bundle");
    let child = Command::new(BIN)
        .arg(&src)
        .arg(&out)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    assert!(wait_for_temporary(&outdir));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    if o.status.code() == Some(0) {
        // Finished before the signal landed: then it must be complete and valid.
        Manifest::load(&out.join("manifest.toml"))
            .unwrap()
            .check_root()
            .unwrap();
        return;
    }
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(err.contains("interrupted"), "{err}");
    assert!(!out.exists());
    assert_eq!(
        fs::read_dir(&outdir).unwrap().count(),
        0,
        "temporary removed"
    );
}

#[test]
fn killed_conversion_leaves_no_bundle_and_next_run_cleans_up() {
    let d = tempfile::tempdir().unwrap();
    let src = big_source(d.path());
    let outdir = d.path().join("o");
    fs::create_dir(&outdir).unwrap();
    let out = outdir.join("bundle");
    let mut child = Command::new(BIN)
        .arg(&src)
        .arg(&out)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert!(wait_for_temporary(&outdir));
    child.kill().unwrap(); // SIGKILL: no chance to clean up
    child.wait().unwrap();
    if out.exists() {
        // It won the race: the rename is the last step, so the bundle is whole.
        Manifest::load(&out.join("manifest.toml"))
            .unwrap()
            .check_root()
            .unwrap();
        return;
    }
    let (code, _, err) = run(&[&src, &out]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("removed stale temporary"), "{err}");
    let names: Vec<_> = fs::read_dir(&outdir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(names, ["bundle"]);
}

#[test]
fn hub_cache_snapshot_is_a_real_input() {
    let d = tempfile::tempdir().unwrap();
    let repo = d.path().join("models--tarfa--qwen3moe-a");
    let snap = repo.join("snapshots/0123abcd");
    fs::create_dir_all(&snap).unwrap();
    fs::create_dir_all(repo.join("blobs")).unwrap();
    for entry in fs::read_dir(fixture("qwen3moe-a")).unwrap().flatten() {
        let name = entry.file_name().into_string().unwrap();
        if name.starts_with("reference") {
            continue;
        }
        let bytes = fs::read(entry.path()).unwrap();
        // LFS files are named by SHA-256; small files by their git blob SHA-1.
        let blob = if name.ends_with(".safetensors") {
            to_hex(&Sha256::digest(&bytes))
        } else {
            use sha1_smol_like::git_blob_sha1;
            git_blob_sha1(&bytes)
        };
        fs::write(repo.join("blobs").join(&blob), &bytes).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snap.join(&name)).unwrap();
    }
    let out = d.path().join("bundle");
    let (code, _, err) = run(&[&snap, &out]);
    assert_eq!(code, 0, "{err}");
    // Corrupt one shard blob: its name no longer matches its content.
    let victim = fs::read_link(snap.join("model-00003-of-00012.safetensors")).unwrap();
    let blob = snap.join(victim);
    let mut b = fs::read(&blob).unwrap();
    let n = b.len();
    b[n - 1] ^= 1;
    fs::write(&blob, b).unwrap();
    let (code, _, err) = run(&[&snap, &d.path().join("bundle2")]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("model-00003-of-00012.safetensors"), "{err}");
    assert!(!d.path().join("bundle2").exists());
}

/// git's blob id: SHA-1 of "blob <len>\0" + content (sha1 via the checkpoint crate's dependency
/// would need a dev-dependency; the format is short enough to compute with sha2's sibling).
mod sha1_smol_like {
    pub fn git_blob_sha1(bytes: &[u8]) -> String {
        use sha1::{Digest, Sha1};
        let mut h = Sha1::new();
        h.update(format!("blob {}\0", bytes.len()).as_bytes());
        h.update(bytes);
        tarfa_manifest::hash::to_hex(&h.finalize())
    }
}

#[test]
fn synthetic_hub_and_direct_bundle_hold_identical_bytes() {
    let d = tempfile::tempdir().unwrap();
    let hub = d.path().join("hub");
    let direct = d.path().join("direct");
    let conv = d.path().join("conv");
    let args = ["--shape", "tiny", "--seed", "7", "--skew", "1", "--json"];
    let (c1, j1, e1) = run(&[
        &"synth", &args[0], &args[1], &args[2], &args[3], &args[4], &args[5], &args[6], &hub,
    ]);
    assert_eq!(c1, 0, "{e1}");
    let (c2, j2, e2) = run(&[
        &"synth",
        &args[0],
        &args[1],
        &args[2],
        &args[3],
        &args[4],
        &args[5],
        &args[6],
        &"--format",
        &"bundle",
        &direct,
    ]);
    assert_eq!(c2, 0, "{e2}");
    assert_eq!(run(&[&hub, &conv]).0, 0);
    let a = Manifest::load(&direct.join("manifest.toml")).unwrap();
    let b = Manifest::load(&conv.join("manifest.toml")).unwrap();
    // The same bytes, hashes, dtypes and shapes; offsets may differ (the hub bundle's header
    // carries source records, so its data starts later).
    let unplaced = |m: &Manifest| {
        let mut m = m.clone();
        m.tensors.iter_mut().for_each(|t| t.offset = 0);
        m.experts.iter_mut().for_each(|e| e.offset = 0);
        (m.tensors, m.experts)
    };
    assert_eq!(unplaced(&a), unplaced(&b));
    // The compressibility of the generated BF16 is in the range real weights show.
    for j in [j1, j2] {
        let v: serde_json::Value = serde_json::from_str(j.trim()).unwrap();
        let r = v["zstd_ratio"].as_f64().unwrap();
        assert!((1.1..1.5).contains(&r), "zstd ratio {r}");
    }
    // Deterministic: the same seed gives the same bundle; another seed does not.
    let again = d.path().join("again");
    let other = d.path().join("other");
    assert_eq!(
        run(&[
            &"synth",
            &"--shape",
            &"tiny",
            &"--seed",
            &"7",
            &"--skew",
            &"1",
            &"--format",
            &"bundle",
            &again
        ])
        .0,
        0
    );
    assert_eq!(
        run(&[
            &"synth",
            &"--shape",
            &"tiny",
            &"--seed",
            &"8",
            &"--skew",
            &"1",
            &"--format",
            &"bundle",
            &other
        ])
        .0,
        0
    );
    let root = |p: &Path| {
        Manifest::load(&p.join("manifest.toml"))
            .unwrap()
            .root_digest
    };
    assert_eq!(root(&direct), root(&again));
    assert_ne!(root(&direct), root(&other));
}

#[test]
fn synthetic_weights_look_trained_not_degenerate() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("b");
    assert_eq!(
        run(&[&"synth", &"--shape", &"tiny", &"--format", &"bundle", &out]).0,
        0
    );
    let jnf = jnf_format::JnfFile::open(&out.join("model.jnf")).unwrap();
    let mut buf = Vec::new();
    let e = &jnf.header().experts[3];
    jnf.read_extent_into(e, &mut buf).unwrap();
    let vals: Vec<f32> = buf
        .chunks_exact(2)
        .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
        .collect();
    let n = vals.len() as f64;
    let mean = vals.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = vals.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
    let zeros = vals.iter().filter(|&&v| v == 0.0).count();
    assert!(mean.abs() < 0.002, "centred: {mean}");
    assert!(
        (0.005..0.04).contains(&var.sqrt()),
        "trained-like scale: {}",
        var.sqrt()
    );
    assert!(zeros < vals.len() / 100, "not zeros");
    let distinct: std::collections::HashSet<_> = buf.chunks_exact(2).collect();
    assert!(distinct.len() > 1000, "not uniform bytes");
}

#[test]
fn json_output_and_usage_errors() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("b");
    let (code, stdout, _) = run(&[&fixture("qwen3moe-a"), &out, &"--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["root_digest"].as_str().unwrap().len(), 64);
    assert!(v["data_bytes"].as_u64().unwrap() > 6_000_000);
    assert_eq!(run(&[&"--bogus"]).0, 2);
    assert_eq!(run(&[]).0, 2);
    assert_eq!(
        run(&[&"synth", &"--shape", &"nope", &d.path().join("x")]).0,
        2
    );
    let (code, help, _) = run(&[&"--help"]);
    assert_eq!(code, 0);
    assert!(help.contains("Exit codes"));
}

#[test]
fn usage_errors_under_json_are_the_same_json_object() {
    let d = tempfile::tempdir().unwrap();
    let x = d.path().join("x");
    // clap's own errors: an unknown flag, a subcommand's missing required flag, a bad value
    for (args, needle) in [
        (
            vec![&"--bogus" as &dyn AsRef<std::ffi::OsStr>, &"--json"],
            "--bogus",
        ),
        (vec![&"synth", &"--json", &x], "--shape"),
        (
            vec![
                &"synth", &"--shape", &"tiny", &"--seed", &"many", &"--json", &x,
            ],
            "many",
        ),
    ] {
        let (code, stdout, stderr) = run(&args);
        assert_eq!(code, 2, "{stdout}{stderr}");
        assert_eq!(stdout.lines().count(), 1, "one line: {stdout}");
        let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        assert_eq!(v["exit_code"], 2, "{v}");
        assert_eq!(v["error"]["kind"], "usage", "{v}");
        assert!(v["error"]["path"].is_null(), "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle) && !msg.contains("Usage:"), "{msg}");
        assert!(!msg.starts_with("error:") && !msg.contains('\n'), "{msg}");
        assert!(stderr.is_empty(), "{stderr}");
    }
    // the library's usage error (no OUT) has the same shape
    let (code, stdout, _) = run(&[&fixture("qwen3moe-a"), &"--json"]);
    assert_eq!(code, 2);
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["error"]["kind"], "usage", "{v}");
    // without --json (or with it only after `--`, as a path), clap's text on stderr as before
    for args in [
        vec![&"--bogus" as &dyn AsRef<std::ffi::OsStr>],
        vec![&"--bogus", &"--", &"--json"],
    ] {
        let (code, stdout, stderr) = run(&args);
        assert_eq!(code, 2);
        assert!(stdout.is_empty(), "{stdout}");
        assert!(
            stderr.contains("--bogus") && stderr.contains("Usage:"),
            "{stderr}"
        );
    }
    // --help is not an error, --json or not
    let (code, help, _) = run(&[&"--help", &"--json"]);
    assert_eq!(code, 0);
    assert!(help.contains("Exit codes"));
}

#[test]
fn many_threads_with_nested_parallel_generation() {
    // Regression: the writer's per-thread scratch buffer was borrowed across the generator's
    // nested parallel fill, and rayon running another job on the same thread panicked
    // ("already borrowed"); seen with 16 threads on the GPU machine. Expert matrices of this
    // shape span many generator chunks, so nested work is stolen often.
    let d = tempfile::tempdir().unwrap();
    for i in 0..4 {
        let out = d.path().join(format!("b{i}"));
        let (code, _, err) = run(&[
            &"synth",
            &"--threads",
            &"16",
            &"--shape",
            &"qwen3-30b-a3b",
            &"--layers",
            &"1",
            &"--experts",
            &"8",
            &"--vocab",
            &"1000",
            &"--format",
            &"bundle",
            &out,
        ]);
        assert_eq!(code, 0, "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}
