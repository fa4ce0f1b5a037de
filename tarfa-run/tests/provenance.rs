//! Bundle opening against forged provenance (issue 15), through the real binary: a BLAKE3-only
//! edit, a relabelled dtype, a changed shape, edited header metadata, edited copied files, an
//! unlisted file, FIFOs, symlink loops and missing files. Each is refused at open with the
//! documented exit code and one line naming the file, never a hang or a panic.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tarfa_manifest::hash::{blake3_hex, sha256_hex};
use tarfa_manifest::{HeaderRecord, Manifest};

const BIN: &str = env!("CARGO_BIN_EXE_tarfa-run");
/// How long one run may take before it counts as a hang.
const HANG: Duration = Duration::from_secs(60);

/// qwen3moe-a converted once; each test works on its own copy.
fn base() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("provenance-base");
        let _ = fs::remove_dir_all(&d);
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/oracle/qwen3moe-a");
        tarfa_convert::convert(&src, &d, &Default::default()).unwrap();
        d
    })
}

fn copy_bundle(to: &Path) -> String {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(base()).unwrap() {
        let e = e.unwrap();
        fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    load(to).root_digest
}

fn load(b: &Path) -> Manifest {
    Manifest::load(&b.join("manifest.toml")).unwrap()
}

/// Write the manifest back; `seal` recomputes the root (a forger's self-consistent edit), else
/// the original root line stays.
fn write_manifest(b: &Path, mut m: Manifest, seal: bool) {
    if seal {
        m.seal();
    }
    fs::write(b.join("manifest.toml"), m.to_toml()).unwrap();
}

/// Rewrite model.jnf's header JSON through `edit`, keeping data_start.
fn rewrite_header(b: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = b.join("model.jnf");
    let mut bytes = fs::read(&path).unwrap();
    let len = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
    let mut v: serde_json::Value = serde_json::from_slice(&bytes[24..24 + len]).unwrap();
    let data_start = v["data_start"].as_u64().unwrap() as usize;
    edit(&mut v);
    let json = serde_json::to_vec(&v).unwrap();
    assert!(24 + json.len() <= data_start);
    bytes[16..24].copy_from_slice(&(json.len() as u64).to_le_bytes());
    bytes[24..data_start].fill(0);
    bytes[24..24 + json.len()].copy_from_slice(&json);
    fs::write(&path, bytes).unwrap();
}

fn edit_tensor(v: &mut serde_json::Value, name: &str, key: &str, to: serde_json::Value) {
    for t in v["tensors"].as_array_mut().unwrap() {
        if t["name"] == name {
            t[key] = to.clone();
        }
    }
}

/// `generate` on `b` (one new token, all experts read first), killed if it hangs.
fn generate(b: &Path, expect_root: Option<&str>) -> (i32, String) {
    let mut c = Command::new(BIN);
    c.args(["generate", b.to_str().unwrap(), "--tokens", "1,2,3"])
        .args(["--max-new-tokens", "1", "--preload", "--backend", "cpu"]);
    if let Some(r) = expect_root {
        c.args(["--expect-root", r]);
    }
    let mut child = c
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err_pipe = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err_pipe.read_to_string(&mut s);
        s
    });
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if start.elapsed() > HANG {
            let _ = child.kill();
            let _ = child.wait();
            panic!("tarfa-run hung on {}", b.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let err = reader.join().unwrap();
    assert!(!err.contains("panicked"), "{err}");
    (status.code().expect("not killed by a signal"), err)
}

/// The refusal: exit `code`, and exactly one `tarfa-run: error:` line, naming `file` and
/// saying `what`.
fn assert_refused(out: &(i32, String), code: i32, file: &Path, what: &str) {
    let (got, err) = out;
    assert_eq!(*got, code, "{err}");
    let errors: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("tarfa-run: error:"))
        .collect();
    assert_eq!(errors.len(), 1, "{err}");
    let line = errors[0];
    assert!(
        line.contains(&file.display().to_string()) && line.contains(what),
        "wanted {} and {what:?}: {line}",
        file.display()
    );
    assert!(line.len() > "tarfa-run: error: ".len() + 10, "{line}");
}

#[test]
fn the_original_bundle_runs_with_its_root_pinned() {
    let d = tempfile::tempdir().unwrap();
    let b = d.path().join("b");
    let root = copy_bundle(&b);
    let (code, err) = generate(&b, Some(&root));
    assert_eq!(code, 0, "{err}");
    assert!(err.contains(&root), "{err}");
}

#[test]
fn a_blake3_only_edit_is_refused_with_the_original_root_pinned() {
    for target in ["model.layers.2.mlp.experts.5", "model.norm.weight"] {
        let d = tempfile::tempdir().unwrap();
        let b = d.path().join("b");
        let root = copy_bundle(&b);
        let mut m = load(&b);
        let (offset, length) = m
            .experts
            .iter()
            .find(|e| e.name == target)
            .map(|e| (e.offset, e.length))
            .or_else(|| m.tensor(target).map(|t| (t.offset, t.length)))
            .unwrap();
        let mut jnf = fs::read(b.join("model.jnf")).unwrap();
        jnf[offset as usize + 10] ^= 0x40;
        fs::write(b.join("model.jnf"), &jnf).unwrap();
        let b3 = blake3_hex(&jnf[offset as usize..(offset + length) as usize]);
        for e in m.experts.iter_mut().filter(|e| e.name == target) {
            e.blake3 = b3.clone();
        }
        for t in m.tensors.iter_mut().filter(|t| t.name == target) {
            t.blake3 = b3.clone();
        }
        write_manifest(&b, m.clone(), false);
        let out = generate(&b, Some(&root));
        assert_refused(&out, 1, &b.join("manifest.toml"), "root digest");
        // Re-sealed, the manifest is consistent; the pinned root refuses it.
        write_manifest(&b, m, true);
        let out = generate(&b, Some(&root));
        assert_refused(&out, 1, &b, &format!("expected {root}"));
    }
}

#[test]
fn a_dtype_relabel_or_a_shape_change_in_the_header_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let b = d.path().join("b");
    copy_bundle(&b);
    let original = fs::read(b.join("model.jnf")).unwrap();
    for (key, to) in [
        ("dtype", serde_json::json!("F16")),
        ("shape", serde_json::json!([128, 512])),
    ] {
        fs::write(b.join("model.jnf"), &original).unwrap();
        rewrite_header(&b, |v| {
            edit_tensor(v, "model.embed_tokens.weight", key, to.clone())
        });
        // As it stands: the header's bytes are not the ones the manifest records.
        let out = generate(&b, None);
        assert_refused(&out, 1, &b.join("model.jnf"), "header JSON");
        // The header digest re-recorded, the root line kept: the root refuses it.
        let mut m = load(&b);
        let jnf = fs::read(b.join("model.jnf")).unwrap();
        m.header = HeaderRecord::of_container_prefix(&jnf).unwrap();
        write_manifest(&b, m.clone(), false);
        let out = generate(&b, None);
        assert_refused(&out, 1, &b.join("manifest.toml"), "root digest");
        // Re-sealed too: header and manifest now disagree on the entry, by name.
        write_manifest(&b, m, true);
        let out = generate(&b, None);
        assert_refused(&out, 1, &b.join("model.jnf"), "model.embed_tokens.weight");
        assert!(out.1.contains(key), "{}", out.1);
        // Restore the manifest for the next case.
        for e in fs::read_dir(base()).unwrap() {
            let e = e.unwrap();
            if e.file_name() == "manifest.toml" {
                fs::copy(e.path(), b.join("manifest.toml")).unwrap();
            }
        }
    }
}

#[test]
fn edited_header_metadata_or_source_records_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let b = d.path().join("b");
    copy_bundle(&b);
    let original = fs::read(b.join("model.jnf")).unwrap();
    rewrite_header(&b, |v| v["metadata"]["converter"] = "someone else".into());
    assert_refused(&generate(&b, None), 1, &b.join("model.jnf"), "header JSON");
    fs::write(b.join("model.jnf"), &original).unwrap();
    rewrite_header(&b, |v| {
        let t = &mut v["tensors"][0];
        t["source"]["offset"] = 8.into();
    });
    assert_refused(&generate(&b, None), 1, &b.join("model.jnf"), "header JSON");
}

#[test]
fn edited_copied_files_are_refused_at_open() {
    for (file, from, to) in [
        (
            "config.json",
            "\"num_experts_per_tok\": 8",
            "\"num_experts_per_tok\": 2",
        ),
        ("generation_config.json", "{", "{\"eos_token_id\": 7, "),
    ] {
        let d = tempfile::tempdir().unwrap();
        let b = d.path().join("b");
        let root = copy_bundle(&b);
        let text = fs::read_to_string(b.join(file)).unwrap();
        assert!(text.contains(from));
        let edited = text.replacen(from, to, 1);
        fs::write(b.join(file), &edited).unwrap();
        // The manifest untouched: the file is named, before anything runs.
        assert_refused(
            &generate(&b, None),
            1,
            &b.join(file),
            "the manifest records",
        );
        // The manifest made consistent: the pinned root refuses the bundle.
        let mut m = load(&b);
        let rec = m.files.iter_mut().find(|f| f.name == file).unwrap();
        rec.size = edited.len() as u64;
        rec.sha256 = sha256_hex(edited.as_bytes());
        write_manifest(&b, m, true);
        assert_refused(&generate(&b, Some(&root)), 1, &b, "expected");
    }
}

#[test]
fn an_unlisted_file_the_run_would_read_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let b = d.path().join("b");
    copy_bundle(&b);
    fs::write(b.join("tokenizer.json"), b"{}").unwrap();
    assert_refused(&generate(&b, None), 1, &b, "tokenizer.json is not listed");
}

#[test]
fn a_fifo_or_a_symlink_loop_is_refused_at_once_with_exit_2() {
    for victim in [
        "manifest.toml",
        "model.jnf",
        "config.json",
        "generation_config.json",
    ] {
        for kind in ["fifo", "loop"] {
            let d = tempfile::tempdir().unwrap();
            let b = d.path().join("b");
            copy_bundle(&b);
            fs::remove_file(b.join(victim)).unwrap();
            if kind == "fifo" {
                let st = Command::new("mkfifo").arg(b.join(victim)).status().unwrap();
                assert!(st.success());
            } else {
                std::os::unix::fs::symlink(victim, b.join(victim)).unwrap();
            }
            let what = if kind == "fifo" {
                "FIFO"
            } else {
                "cannot be resolved"
            };
            assert_refused(&generate(&b, None), 2, &b.join(victim), what);
        }
    }
}

#[test]
fn a_listed_file_missing_is_a_verification_failure() {
    let d = tempfile::tempdir().unwrap();
    let b = d.path().join("b");
    copy_bundle(&b);
    fs::remove_file(b.join("generation_config.json")).unwrap();
    assert_refused(
        &generate(&b, None),
        1,
        &b.join("generation_config.json"),
        "missing",
    );
}

#[test]
fn a_version_1_manifest_is_refused_with_the_advice_to_reconvert() {
    let d = tempfile::tempdir().unwrap();
    let b = d.path().join("b");
    copy_bundle(&b);
    let text = fs::read_to_string(b.join("manifest.toml")).unwrap();
    let (root, body) = text.split_once('\n').unwrap();
    let v1 = body.replacen("manifest_version = 2", "manifest_version = 1", 1) + root + "\n";
    fs::write(b.join("manifest.toml"), v1).unwrap();
    assert_refused(
        &generate(&b, None),
        1,
        &b.join("manifest.toml"),
        "re-convert",
    );
}
