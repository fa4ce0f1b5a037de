//! The `tarfa-run` binary end to end, on bundles converted from the oracle fixtures: logits files
//! are reproducible and exact, and bad input gets the documented exit codes (the demo's own test
//! is tarfa-demo/tests/demo.rs).

use std::fs;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use safetensors::SafeTensors;

const BIN: &str = env!("CARGO_BIN_EXE_tarfa-run");

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/oracle")
        .join(name)
}

/// One converted bundle per fixture, shared by the tests of this file. They live in a fixed
/// directory under the target dir, emptied when the first test asks (a static TempDir would never
/// be dropped, leaving bundles in /tmp after every run).
fn bundle(name: &'static str) -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-bundles");
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    });
    let out = dir.join(name);
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = LOCK.lock().unwrap();
    if !out.exists() {
        tarfa_convert::convert(&fixture(name), &out, &Default::default()).unwrap();
    }
    out
}

fn run(args: &[&str]) -> (i32, String, String) {
    let mut c = Command::new(BIN);
    c.args(args);
    run_cmd(c, None)
}

/// Runs `c` to its end, feeding it `stdin`; kills it and fails the test after 60 s (a hang), and
/// fails it on a panic message.
fn run_cmd(mut c: Command, stdin: Option<&[u8]>) -> (i32, String, String) {
    c.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    if let Some(bytes) = stdin {
        use std::io::Write;
        child.stdin.take().unwrap().write_all(bytes).unwrap();
    }
    // Drained on threads, so that a chatty child never blocks on a full pipe.
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            String::from_utf8_lossy(&v).into_owned()
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{c:?} hung (killed after 60 s)");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (out, err) = (out.join().unwrap(), err.join().unwrap());
    assert!(!err.contains("panicked"), "{c:?} panicked: {err}");
    (status.code().unwrap_or(-1), out, err)
}

/// The last line of stderr: the error a failed run ends with.
fn last_line(err: &str) -> &str {
    err.trim_end().lines().last().unwrap_or("")
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
}

/// This process's umask, from /proc (reading it with umask(2) would change it for a moment, for
/// every test thread).
fn umask() -> u32 {
    let s = fs::read_to_string("/proc/self/status").unwrap();
    let l = s.lines().find(|l| l.starts_with("Umask:")).unwrap();
    u32::from_str_radix(l.split_whitespace().nth(1).unwrap(), 8).unwrap()
}

fn i64s(st: &SafeTensors, name: &str) -> Vec<i64> {
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn f32s(st: &SafeTensors, name: &str) -> (Vec<usize>, Vec<f32>) {
    let t = st.tensor(name).unwrap();
    (
        t.shape().to_vec(),
        t.data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
    )
}

fn tokens_arg(ids: &[i64]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn logits_file_is_exact_and_reproducible() {
    let b = bundle("qwen3moe-a");
    let d = tempfile::tempdir().unwrap();
    let refs = fs::read(fixture("qwen3moe-a/reference.safetensors")).unwrap();
    let refs = SafeTensors::deserialize(&refs).unwrap();
    let prompt = i64s(&refs, "prompt.2");
    let greedy = i64s(&refs, "greedy.2");
    let (_, ref_steps) = f32s(&refs, "step_logits.2");
    let (_, ref_prefill) = f32s(&refs, "prefill_logits.2");
    let out = |name: &str, threads: &str| {
        let p = d.path().join(name);
        let (code, stdout, err) = run(&[
            "generate",
            b.to_str().unwrap(),
            "--tokens",
            &tokens_arg(&prompt),
            "--max-new-tokens",
            &greedy.len().to_string(),
            "--ignore-eos",
            "--prefill-logits",
            "--threads",
            threads,
            "--logits-out",
            p.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{err}");
        (fs::read(p).unwrap(), stdout, err)
    };
    let (a, stdout, err) = out("a.safetensors", "2");
    let (b1, _, _) = out("b.safetensors", "1");
    assert_eq!(
        a, b1,
        "identical runs (1 and 2 threads) give identical files"
    );
    let manifest = tarfa_manifest::Manifest::load(&b.join("manifest.toml")).unwrap();
    assert!(
        err.contains(&manifest.root_digest),
        "prints the root digest: {err}"
    );
    assert!(
        err.contains("prefill") && err.contains("decode") && err.contains("tok/s"),
        "{err}"
    );
    // No tokenizer in this bundle: the ids are printed.
    let printed: Vec<i64> = stdout
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect();
    assert_eq!(printed, greedy);
    // Without --logits-out the engine chooses each token itself (no logits kept): the same
    // tokens.
    let (code, stdout2, err2) = run(&[
        "generate",
        b.to_str().unwrap(),
        "--tokens",
        &tokens_arg(&prompt),
        "--max-new-tokens",
        &greedy.len().to_string(),
        "--ignore-eos",
    ]);
    assert_eq!(code, 0, "{err2}");
    assert_eq!(stdout2, stdout, "tokens without --logits-out");

    let st = SafeTensors::deserialize(&a).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&a).unwrap();
    assert_eq!(
        meta.metadata().as_ref().unwrap()["root_digest"],
        manifest.root_digest
    );
    assert_eq!(i64s(&st, "tokens"), greedy);
    assert_eq!(
        i64s(&st, "prompt_tokens"),
        prompt,
        "the prompt's ids are recorded"
    );
    let mode = fs::metadata(d.path().join("a.safetensors"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o644 & !umask(), "0644 before the umask");
    let (shape, steps) = f32s(&st, "logits");
    assert_eq!(shape, [greedy.len(), 512]);
    let (pshape, prefill) = f32s(&st, "prefill_logits");
    assert_eq!(pshape, [prompt.len(), 512]);
    // The first step's logits are the last prefill row, bit for bit.
    assert_eq!(
        steps[..512].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        prefill[prefill.len() - 512..]
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>()
    );
    for (rows, reference) in [(&steps, &ref_steps), (&prefill, &ref_prefill)] {
        for (r, (got, want)) in rows.chunks(512).zip(reference.chunks(512)).enumerate() {
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = got
                .iter()
                .zip(want)
                .fold(0f32, |m, (g, w)| m.max((g - w).abs()));
            assert!(err <= 1e-4 * scale, "row {r}: {err} > 1e-4 * {scale}");
        }
    }
}

#[test]
fn router_trace_and_verify_report() {
    let b = bundle("qwen3moe-a");
    let d = tempfile::tempdir().unwrap();
    let trace = d.path().join("t.jsonl");
    let report = d.path().join("v.json");
    let (code, _, err) = run(&[
        "generate",
        b.to_str().unwrap(),
        "--tokens",
        "1,2,3",
        "--max-new-tokens",
        "3",
        "--ignore-eos",
        "--router-trace",
        trace.to_str().unwrap(),
        "--verify-report",
        report.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<serde_json::Value> = fs::read_to_string(&trace)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["kind"], "header");
    assert_eq!(lines[0]["num_experts_per_tok"], 8);
    assert_eq!(lines[0]["prompt_tokens"], serde_json::json!([1, 2, 3]));
    for f in [&trace, &report] {
        let mode = fs::metadata(f).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o644 & !umask(), "{}", f.display());
    }
    // 4 MoE layers x (3 prompt tokens + 2 decode steps).
    assert_eq!(lines.len() - 1, 4 * 5);
    for l in &lines[1..] {
        assert_eq!(l["experts"].as_array().unwrap().len(), 8);
    }
    let v: serde_json::Value = serde_json::from_slice(&fs::read(&report).unwrap()).unwrap();
    let m = tarfa_manifest::Manifest::load(&b.join("manifest.toml")).unwrap();
    assert_eq!(v["root_digest"], m.root_digest);
    assert_eq!(v["tensors"].as_array().unwrap().len(), m.tensors.len());
    let used: std::collections::HashSet<String> = lines[1..]
        .iter()
        .flat_map(|l| {
            let layer = l["layer"].as_u64().unwrap();
            l["experts"]
                .as_array()
                .unwrap()
                .iter()
                .map(move |e| format!("model.layers.{layer}.mlp.experts.{}", e.as_u64().unwrap()))
                .collect::<Vec<_>>()
        })
        .collect();
    let verified: std::collections::HashSet<String> = v["experts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        used, verified,
        "exactly the experts used were read, each verified"
    );
}

#[test]
fn corrupted_bundle_is_a_verification_failure() {
    let d = tempfile::tempdir().unwrap();
    let b = d.path().join("b");
    tarfa_convert::convert(&fixture("qwen3moe-a"), &b, &Default::default()).unwrap();
    let jnf = jnf_format::JnfFile::open(&b.join("model.jnf")).unwrap();
    let victim = jnf.header().expert(2, 5).unwrap().clone();
    drop(jnf);
    let mut bytes = fs::read(b.join("model.jnf")).unwrap();
    bytes[victim.offset as usize + 100] ^= 0x40;
    fs::write(b.join("model.jnf"), bytes).unwrap();
    // Route every layer through all experts: a long prompt reaches expert 5 of layer 2.
    let prompt: Vec<String> = (0..100).map(|i| ((i * 37) % 512).to_string()).collect();
    let (code, _, err) = run(&[
        "generate",
        b.to_str().unwrap(),
        "--tokens",
        &prompt.join(","),
        "--max-new-tokens",
        "2",
        "--preload",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("model.layers.2.mlp.experts.5") && err.contains("BLAKE3"),
        "{err}"
    );
}

#[test]
fn bad_input_exit_codes() {
    let b = bundle("qwen3moe-a");
    let bs = b.to_str().unwrap();
    let cases: Vec<(Vec<String>, i32, &str)> = vec![
        (
            vec![
                "generate".into(),
                "/nonexistent/bundle".into(),
                "--tokens".into(),
                "1".into(),
            ],
            2,
            "not a Tarfa bundle",
        ),
        (
            vec![
                "generate".into(),
                bs.into(),
                "--tokens".into(),
                "1,512".into(),
            ],
            2,
            "outside the vocabulary",
        ),
        (
            vec!["generate".into(), bs.into(), "--prompt".into(), "hi".into()],
            2,
            "no tokenizer",
        ),
        (
            vec![
                "generate".into(),
                bs.into(),
                "--tokens".into(),
                "1".into(),
                "--expect-root".into(),
                "ab".repeat(32),
            ],
            1,
            "root digest",
        ),
        (vec!["generate".into(), bs.into()], 2, ""),
        (vec!["bogus".into()], 2, ""),
    ];
    for (args, want, msg) in cases {
        let a: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        let (code, _, err) = run(&a);
        assert_eq!(code, want, "{args:?}: {err}");
        assert!(err.contains(msg), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // An empty prompt (the demo model has a tokenizer).
    let code_bundle = bundle("qwen3moe-code");
    let (code, _, err) = run(&["generate", code_bundle.to_str().unwrap(), "--prompt", ""]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("empty"), "{err}");
    // Longer than max_position_embeddings (2048 for the demo model).
    let long: Vec<String> = (0..2049).map(|i| (i % 4096).to_string()).collect();
    let (code, _, err) = run(&[
        "generate",
        code_bundle.to_str().unwrap(),
        "--tokens",
        &long.join(","),
        "--max-new-tokens",
        "1",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("2048"), "{err}");
    // Help documents the exit codes.
    let (code, help, _) = run(&["generate", "--help"]);
    assert_eq!(code, 0);
    assert!(help.contains("Exit codes"));
}

#[test]
fn eos_from_generation_config_stops_generation_unless_ignored() {
    // A copy of qwen3moe-a whose generation_config.json names, as EOS, a list holding an id
    // outside the vocabulary (ignored with a warning) and the 4th token greedy decoding produces.
    let refs = fs::read(fixture("qwen3moe-a/reference.safetensors")).unwrap();
    let refs = SafeTensors::deserialize(&refs).unwrap();
    let prompt = i64s(&refs, "prompt.1");
    let greedy = i64s(&refs, "greedy.1");
    let eos = greedy[3];
    let stop = greedy.iter().position(|&t| t == eos).unwrap();
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    fs::create_dir(&src).unwrap();
    for e in fs::read_dir(fixture("qwen3moe-a")).unwrap().flatten() {
        fs::copy(e.path(), src.join(e.file_name())).unwrap();
    }
    fs::write(
        src.join("generation_config.json"),
        format!("{{\"eos_token_id\": [99999, {eos}]}}"),
    )
    .unwrap();
    let b = d.path().join("b");
    tarfa_convert::convert(&src, &b, &Default::default()).unwrap();
    let s = d.path().join("s.json");
    let gen = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            b.to_str().unwrap(),
            "--max-new-tokens",
            "12",
            "--summary-json",
            s.to_str().unwrap(),
        ];
        let t = tokens_arg(&prompt);
        args.extend(["--tokens", &t]);
        args.extend(extra);
        let (code, _, err) = run(&args);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_slice(&fs::read(&s).unwrap()).unwrap();
        (v["generated_tokens"].as_u64().unwrap() as usize, err)
    };
    let (n, err) = gen(&[]);
    assert_eq!(n, stop + 1, "stops at the first EOS, inclusive");
    assert!(
        err.contains("EOS id 99999 is outside the vocabulary"),
        "{err}"
    );
    let (n, _) = gen(&["--ignore-eos"]);
    assert_eq!(n, 12);
}

#[test]
fn backends_without_a_gpu() {
    let b = bundle("qwen3moe-a");
    let bs = b.to_str().unwrap();
    // cuda is a clear environment error here (CI has no GPU); auto falls back and says so.
    let (code, _, err) = run(&[
        "generate",
        bs,
        "--tokens",
        "1,2",
        "--max-new-tokens",
        "2",
        "--backend",
        "cuda",
    ]);
    if code == 0 {
        return; // a machine with a GPU: nothing to check here (the selftest covers it)
    }
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("CUDA") || err.contains("GPU") || err.contains("NVRTC"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let (code, _, err) = run(&["generate", bs, "--tokens", "1,2", "--max-new-tokens", "2"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("backend auto: no usable GPU") && err.contains("using the CPU"),
        "{err}"
    );
    let (code, _, err) = run(&["selftest", "--backend", "cuda", bs]);
    assert_eq!(code, 3, "{err}");
}

/// Output paths that are not regular files, or lie inside the bundle, are refused (exit 2, naming
/// the path and the flag) before the run, and left as they were.
#[test]
fn outputs_are_written_only_to_regular_files_outside_the_bundle() {
    let b = bundle("qwen3moe-a");
    let bs = b.to_str().unwrap();
    let d = tempfile::tempdir().unwrap();
    let gen = |extra: &[&str]| {
        let mut args = vec!["generate", bs, "--tokens", "1,2,3", "--max-new-tokens", "2"];
        args.extend(extra);
        run(&args)
    };
    let refused = |flag: &str, path: &Path, why: &str| {
        let (code, _, err) = gen(&[flag, path.to_str().unwrap()]);
        assert_eq!(code, 2, "{flag} {}: {err}", path.display());
        let line = last_line(&err);
        assert!(
            line.contains(&path.display().to_string()) && line.contains(flag) && line.contains(why),
            "{flag} {}: {err}",
            path.display()
        );
        assert!(
            !err.contains("tokens generated"),
            "refused before the run: {err}"
        );
    };
    // A character device: never opened for writing, still a device.
    let full = Path::new("/dev/full");
    if full.exists() {
        refused("--logits-out", full, "a character device");
        assert!(fs::metadata(full).unwrap().file_type().is_char_device());
    }
    // A FIFO (with no reader: opening it for writing would block).
    let fifo = d.path().join("fifo");
    mkfifo(&fifo);
    refused("--router-trace", &fifo, "a FIFO");
    assert!(fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
    // A directory, and a dangling symbolic link.
    refused("--summary-json", d.path(), "a directory");
    let dangling = d.path().join("dangling");
    std::os::unix::fs::symlink(d.path().join("nowhere"), &dangling).unwrap();
    refused("--verify-report", &dangling, "dangling");
    assert!(!d.path().join("nowhere").exists());
    // A missing directory.
    refused(
        "--summary-json",
        &d.path().join("no/such/dir/s.json"),
        "does not exist",
    );
    // The bundle's own files, directly, through a symbolic link, and through a hard link.
    let manifest = b.join("manifest.toml");
    let before = fs::read(&manifest).unwrap();
    refused("--logits-out", &manifest, "inside the bundle");
    let link = d.path().join("link.toml");
    std::os::unix::fs::symlink(&manifest, &link).unwrap();
    refused("--summary-json", &link, "inside the bundle");
    let hard = d.path().join("hard.toml");
    if fs::hard_link(&manifest, &hard).is_ok() {
        refused("--verify-report", &hard, "hard link");
    }
    refused("--router-trace", &b.join("new.jsonl"), "inside the bundle");
    assert_eq!(
        fs::read(&manifest).unwrap(),
        before,
        "the manifest is untouched"
    );
    assert!(!b.join("new.jsonl").exists());
    // Two flags naming one file.
    let s = d.path().join("s.json");
    let (code, _, err) = gen(&[
        "--summary-json",
        s.to_str().unwrap(),
        "--verify-report",
        s.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        last_line(&err).contains("the same file as --verify-report"),
        "{err}"
    );

    // A symbolic link to a regular file is written through: the link stays, the target holds the
    // logits, the target's mode is kept.
    let target = d.path().join("target.safetensors");
    fs::write(&target, b"old").unwrap();
    fs::set_permissions(&target, fs::Permissions::from_mode(0o600)).unwrap();
    let via = d.path().join("via.safetensors");
    std::os::unix::fs::symlink(&target, &via).unwrap();
    let (code, _, err) = gen(&["--logits-out", via.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(fs::symlink_metadata(&via).unwrap().file_type().is_symlink());
    let bytes = fs::read(&target).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(i64s(&st, "prompt_tokens"), [1, 2, 3]);
    assert_eq!(
        fs::metadata(&target).unwrap().permissions().mode() & 0o777,
        0o600
    );
}

/// A write that fails (here EFBIG, from a 512-byte RLIMIT_FSIZE) is exit 3 naming the file, and
/// leaves no partial output: a new file is removed, an existing one left empty.
#[test]
fn a_failed_output_write_is_exit_3_naming_the_file() {
    let b = bundle("qwen3moe-a");
    let d = tempfile::tempdir().unwrap();
    let limited = |flag: &str, path: &Path| {
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg("trap '' XFSZ; ulimit -f 1; exec \"$@\"")
            .arg("sh")
            .arg(BIN)
            .args(["generate", b.to_str().unwrap(), "--tokens", "1,2,3"])
            .args(["--max-new-tokens", "4", "--ignore-eos"])
            .arg(flag)
            .arg(path);
        run_cmd(c, None)
    };
    for flag in ["--logits-out", "--router-trace"] {
        let p = d.path().join(format!("new{flag}"));
        let (code, _, err) = limited(flag, &p);
        assert_eq!(code, 3, "{flag}: {err}");
        let line = last_line(&err);
        assert!(
            line.contains(&p.display().to_string()) && line.contains("File too large"),
            "{flag}: {err}"
        );
        assert!(!p.exists(), "{flag}: no partial file is left");

        let old = d.path().join(format!("old{flag}"));
        fs::write(&old, b"previous contents").unwrap();
        let (code, _, err) = limited(flag, &old);
        assert_eq!(code, 3, "{flag}: {err}");
        assert_eq!(
            fs::read(&old).unwrap(),
            b"",
            "{flag}: left empty, not half-written"
        );
    }
}

/// `--prompt-file` takes the bytes as they are (trailing newlines kept), from a file or stdin,
/// and refuses what is not UTF-8, naming the file.
#[test]
fn prompt_file_is_read_byte_for_byte() {
    let b = bundle("qwen3moe-code");
    let bs = b.to_str().unwrap();
    let d = tempfile::tempdir().unwrap();
    let text = "def add(a, b):\n\n";
    let f = d.path().join("prompt.py");
    fs::write(&f, text).unwrap();
    let trace = d.path().join("t.jsonl");
    let prompt_ids = |input: &[&str], stdin: Option<&[u8]>| {
        let mut c = Command::new(BIN);
        c.args(["generate", bs, "--max-new-tokens", "1", "--router-trace"])
            .arg(&trace)
            .args(input);
        let (code, _, err) = run_cmd(c, stdin);
        assert_eq!(code, 0, "{input:?}: {err}");
        let header: serde_json::Value =
            serde_json::from_str(fs::read_to_string(&trace).unwrap().lines().next().unwrap())
                .unwrap();
        header["prompt_tokens"].clone()
    };
    let from_file = prompt_ids(&["--prompt-file", f.to_str().unwrap()], None);
    assert_eq!(from_file, prompt_ids(&["--prompt", text], None));
    assert_eq!(
        from_file,
        prompt_ids(&["--prompt-file", "-"], Some(text.as_bytes())),
        "stdin"
    );
    assert_ne!(
        from_file,
        prompt_ids(&["--prompt", text.trim_end()], None),
        "the trailing newlines are tokens of the prompt"
    );

    let bad = d.path().join("latin1.txt");
    fs::write(&bad, b"caf\xe9\n").unwrap();
    let (code, _, err) = run(&["generate", bs, "--prompt-file", bad.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    let line = last_line(&err);
    assert!(
        line.contains(&bad.display().to_string()) && line.contains("not UTF-8"),
        "{err}"
    );
    let missing = d.path().join("missing.txt");
    let (code, _, err) = run(&["generate", bs, "--prompt-file", missing.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(
        last_line(&err).contains(&missing.display().to_string()),
        "{err}"
    );
    // One prompt source only.
    let (code, _, err) = run(&[
        "generate",
        bs,
        "--prompt",
        "x",
        "--prompt-file",
        f.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("cannot be used with"), "{err}");
}

/// A prompt plus --max-new-tokens beyond max_position_embeddings is refused before the run.
#[test]
fn prompt_plus_new_tokens_must_fit_the_context() {
    let b = bundle("qwen3moe-code");
    let prompt: Vec<String> = (0..2000).map(|i| (i % 4096).to_string()).collect();
    let (code, _, err) = run(&[
        "generate",
        b.to_str().unwrap(),
        "--tokens",
        &prompt.join(","),
        "--max-new-tokens",
        "100",
    ]);
    assert_eq!(code, 2, "{err}");
    let line = last_line(&err);
    for want in [
        "2000",
        "100",
        "2099 positions",
        "2048",
        "max_position_embeddings",
    ] {
        assert!(line.contains(want), "names {want}: {err}");
    }
    assert!(!err.contains("tokens generated"), "{err}");
    // At the limit, on a copy of qwen3moe-a whose config allows 16 positions: 10 + 7 tokens
    // compute 16 positions (the last token is never fed back) and run; 10 + 8 are refused.
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    fs::create_dir(&src).unwrap();
    for e in fs::read_dir(fixture("qwen3moe-a")).unwrap().flatten() {
        fs::copy(e.path(), src.join(e.file_name())).unwrap();
    }
    let cfg = fs::read_to_string(src.join("config.json")).unwrap();
    let edited = cfg.replace(
        "\"max_position_embeddings\": 4096",
        "\"max_position_embeddings\": 16",
    );
    assert_ne!(edited, cfg, "the edit applies");
    fs::write(src.join("config.json"), edited).unwrap();
    let small = d.path().join("b");
    tarfa_convert::convert(&src, &small, &Default::default()).unwrap();
    let s = d.path().join("s.json");
    let gen = |new: &str| {
        run(&[
            "generate",
            small.to_str().unwrap(),
            "--tokens",
            "1,2,3,4,5,6,7,8,9,10",
            "--max-new-tokens",
            new,
            "--ignore-eos",
            "--summary-json",
            s.to_str().unwrap(),
        ])
    };
    let (code, _, err) = gen("7");
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_slice(&fs::read(&s).unwrap()).unwrap();
    assert_eq!(v["generated_tokens"], 7);
    let (code, _, err) = gen("8");
    assert_eq!(code, 2, "{err}");
    assert!(last_line(&err).contains("17 positions"), "{err}");
}

/// Thread counts are capped (exit 2 naming the flag, the value and the cap); --threads 0 is one
/// thread per core.
#[test]
fn thread_counts_are_capped() {
    let b = bundle("qwen3moe-a");
    let bs = b.to_str().unwrap();
    let cases: [(&[&str], &str); 3] = [
        (
            &["generate", bs, "--tokens", "1", "--threads", "100000"],
            "1024",
        ),
        (
            &["generate", bs, "--tokens", "1", "--io-threads", "1000000"],
            "256",
        ),
        (&["io-bench", bs, "--queue-depths", "1,100000"], "256"),
    ];
    for (args, cap) in cases {
        let (code, _, err) = run(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        let flag = args[args.len() - 2];
        let value = args[args.len() - 1].rsplit(',').next().unwrap();
        assert!(
            err.contains(flag) && err.contains(value) && err.contains(cap),
            "{args:?}: {err}"
        );
    }
    let (_, help, _) = run(&["generate", "--help"]);
    assert!(help.contains("1 to 1024, or 0 for one per core"), "{help}");
    assert!(help.contains("--preload"), "{help}");
    let d = tempfile::tempdir().unwrap();
    let s = d.path().join("s.json");
    let (code, _, err) = run(&[
        "generate",
        bs,
        "--tokens",
        "1",
        "--max-new-tokens",
        "1",
        "--backend",
        "cpu",
        "--threads",
        "0",
        "--summary-json",
        s.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_slice(&fs::read(&s).unwrap()).unwrap();
    let cores = std::thread::available_parallelism().unwrap().get();
    assert_eq!(v["threads"], cores, "--threads 0: one per core");
}

/// A FIFO where the heat ledger lives is ignored with a warning, without hanging, and kept.
#[test]
fn a_fifo_as_the_heat_ledger_is_ignored() {
    let b = bundle("qwen3moe-a");
    let root = tarfa_manifest::Manifest::load(&b.join("manifest.toml"))
        .unwrap()
        .root_digest;
    let cache = tempfile::tempdir().unwrap();
    fs::create_dir(cache.path().join("ledger")).unwrap();
    let fifo = cache.path().join("ledger").join(format!("{root}.json"));
    mkfifo(&fifo);
    let mut c = Command::new(BIN);
    c.env("TARFA_CACHE_DIR", cache.path())
        .args(["generate", b.to_str().unwrap(), "--tokens", "1,2,3"])
        .args([
            "--max-new-tokens",
            "2",
            "--ram-budget",
            "64M",
            "--backend",
            "cpu",
        ]);
    let (code, _, err) = run_cmd(c, None);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(&fifo.display().to_string()) && err.contains("not a regular file"),
        "{err}"
    );
    assert!(fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
}

#[test]
fn demo_without_tarfa_demo_beside_the_binary_says_how_to_run_it() {
    // A copy of tarfa-run alone in a directory: `demo` must not run anything else, and must say
    // where the demo is (exit 2, one line).
    let dir = tempfile::tempdir().unwrap();
    let lone = dir.path().join("tarfa-run");
    std::fs::copy(BIN, &lone).unwrap();
    let mut c = Command::new(&lone);
    c.args(["demo", "--max-new-tokens", "4"]);
    let (code, _out, err) = run_cmd(c, None);
    assert_eq!(code, 2, "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("tarfa-demo") && err.contains("cargo run --release -p tarfa-demo"),
        "{err}"
    );
}

/// `generate` on the trained demo model with `extra` flags: (stdout, generated tokens).
fn generate_code(extra: &[&str]) -> (String, Vec<u64>) {
    let b = bundle("qwen3moe-code");
    let d = tempfile::tempdir().unwrap();
    let s = d.path().join("s.json");
    let mut args = vec![
        "generate",
        b.to_str().unwrap(),
        "--prompt",
        "def parse(",
        "--max-new-tokens",
        "16",
        "--quiet",
        "--summary-json",
        s.to_str().unwrap(),
    ];
    args.extend(extra);
    let (code, out, err) = run(&args);
    assert_eq!(code, 0, "{extra:?}: {err}");
    let v: serde_json::Value = serde_json::from_slice(&fs::read(&s).unwrap()).unwrap();
    let tokens = v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    (out, tokens)
}

#[test]
fn sampling_gives_the_same_text_for_a_seed_on_any_thread_count() {
    let sampled = |seed: &str, threads: &str| {
        generate_code(&[
            "--temperature",
            "1.2",
            "--top-k",
            "50",
            "--top-p",
            "0.95",
            "--repetition-penalty",
            "1.1",
            "--seed",
            seed,
            "--threads",
            threads,
        ])
    };
    let (text1, tokens1) = sampled("7", "1");
    let (text2, tokens2) = sampled("7", "2");
    assert_eq!(tokens1, tokens2, "threads 1 vs 2");
    assert_eq!(text1, text2);
    let scalar = generate_code(&[
        "--temperature",
        "1.2",
        "--top-k",
        "50",
        "--top-p",
        "0.95",
        "--repetition-penalty",
        "1.1",
        "--seed",
        "7",
        "--kernel",
        "scalar",
    ]);
    assert_eq!(
        scalar,
        (text1.clone(), tokens1.clone()),
        "the scalar SIMD path"
    );
    let (_, other_seed) = sampled("8", "2");
    assert_ne!(tokens1, other_seed, "another seed draws other tokens");
    let (greedy_text, greedy) = generate_code(&[]);
    assert_ne!(
        tokens1, greedy,
        "sampling at temperature 1.2 is not the greedy run"
    );
    // Temperature 0 is greedy, whatever the seed and the filters.
    let (t0_text, t0) = generate_code(&["--temperature", "0", "--top-k", "5", "--seed", "3"]);
    assert_eq!(t0, greedy);
    assert_eq!(t0_text, greedy_text);
}

#[test]
fn bad_sampling_values_exit_2_naming_the_flag() {
    let b = bundle("qwen3moe-code");
    let bs = b.to_str().unwrap();
    for (flag, value) in [
        ("--temperature", "-1"),
        ("--temperature", "nan"),
        ("--top-p", "0"),
        ("--top-p", "1.5"),
        ("--min-p", "2"),
        ("--repetition-penalty", "0"),
        ("--frequency-penalty", "3"),
        ("--presence-penalty", "-2.5"),
        ("--top-k", "-1"),
        ("--seed", "x"),
    ] {
        let (code, out, err) = run(&["generate", bs, "--prompt", "x", flag, value]);
        assert_eq!(code, 2, "{flag} {value}: {err}");
        assert!(err.contains(flag), "{flag} {value}: {err}");
        assert!(out.is_empty(), "{flag} {value}: nothing generated: {out}");
    }
}

#[test]
fn stop_strings_end_the_text_before_them() {
    let (full, tokens) = generate_code(&[]);
    let full = full.trim_end_matches('\n').to_string();
    // A piece of the greedy text from its middle: the run must stop where it first occurs.
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() > 12, "{full:?}");
    let stop: String = chars[8..11].iter().collect();
    let at = full.find(&stop).unwrap();
    let (text, stopped) = generate_code(&["--stop", &stop, "--stop", "never-there"]);
    assert_eq!(text, format!("{}\n", &full[..at]), "stop {stop:?}");
    assert!(stopped.len() < tokens.len(), "the run ended early");
    assert_eq!(
        stopped[..],
        tokens[..stopped.len()],
        "the same tokens up to there"
    );
    // Stop strings need text: a bundle without a tokenizer refuses them.
    let b = bundle("qwen3moe-a");
    let (code, _, err) = run(&[
        "generate",
        b.to_str().unwrap(),
        "--tokens",
        "1,2",
        "--stop",
        "x",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(last_line(&err).contains("--stop"), "{err}");
}

#[test]
fn chat_renders_the_bundles_template_or_says_there_is_none() {
    let b = bundle("qwen3moe-code");
    let (code, _, err) = run(&["generate", b.to_str().unwrap(), "--prompt", "x", "--chat"]);
    assert_eq!(code, 2, "{err}");
    assert!(last_line(&err).contains("no chat template"), "{err}");
    // A copy of the demo model with a template in tokenizer_config.json.
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    fs::create_dir(&src).unwrap();
    for e in fs::read_dir(fixture("qwen3moe-code")).unwrap().flatten() {
        fs::copy(e.path(), src.join(e.file_name())).unwrap();
    }
    let template = "{% for m in messages %}\n# {{ m.role }}: {{ m.content }}\n{% endfor %}\n{% if add_generation_prompt %}def {% endif %}";
    fs::write(
        src.join("tokenizer_config.json"),
        serde_json::json!({"chat_template": template, "eos_token": "x"}).to_string(),
    )
    .unwrap();
    let chat = d.path().join("b");
    tarfa_convert::convert(&src, &chat, &Default::default()).unwrap();
    let trace = d.path().join("t.jsonl");
    let (code, _, err) = run(&[
        "generate",
        chat.to_str().unwrap(),
        "--prompt",
        "parse a file",
        "--chat",
        "--max-new-tokens",
        "1",
        "--router-trace",
        trace.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let header: serde_json::Value =
        serde_json::from_str(fs::read_to_string(&trace).unwrap().lines().next().unwrap()).unwrap();
    // trim_blocks and lstrip_blocks, as transformers renders it; encoded without special tokens.
    let tok = tokenizers::Tokenizer::from_file(fixture("qwen3moe-code/tokenizer.json")).unwrap();
    let want = tok.encode("# user: parse a file\ndef ", false).unwrap();
    let want: Vec<u64> = want.get_ids().iter().map(|&t| t as u64).collect();
    assert_eq!(header["prompt_tokens"], serde_json::json!(want));
    // --chat takes text, not token ids.
    let (code, _, err) = run(&[
        "generate",
        chat.to_str().unwrap(),
        "--tokens",
        "1",
        "--chat",
    ]);
    assert_eq!(code, 2, "{err}");
}

#[test]
fn speculate_ngram_gives_the_plain_output_byte_for_byte() {
    // The code fixture has a tokenizer: a prompt that quotes itself (drafts accepted), stop
    // strings cutting a draft, greedy and sampled, the logits file compared byte for byte.
    let b = bundle("qwen3moe-code");
    let d = tempfile::tempdir().unwrap();
    let prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(";
    let gen = |name: &str, extra: &[&str]| {
        let p = d.path().join(name);
        let s = d.path().join(format!("{name}.json"));
        let mut args = vec![
            "generate",
            b.to_str().unwrap(),
            "--prompt",
            prompt,
            "--max-new-tokens",
            "20",
            "--ignore-eos",
            "--threads",
            "2",
            "--logits-out",
            p.to_str().unwrap(),
            "--summary-json",
            s.to_str().unwrap(),
        ];
        args.extend(extra);
        let (code, stdout, err) = run(&args);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_slice(&fs::read(&s).unwrap()).unwrap();
        (fs::read(p).unwrap(), stdout, v, err)
    };
    let (plain, text, v, _) = gen("off", &[]);
    assert!(v["speculate"].is_null());
    // A stop string from the middle of the plain output's text.
    let stop: String = text.trim_end().chars().skip(6).take(3).collect();
    let sampled = ["--temperature", "0.8", "--seed", "5"];
    let (plain_stop, text_stop, _, _) = gen("off-stop", &["--stop", &stop]);
    let (plain_s, text_s, _, _) = gen("off-sampled", &sampled);
    assert!(text_stop.len() < text.len(), "{stop:?} stops the run early");
    let mut accepted = 0;
    for k in ["1", "2", "4", "8"] {
        let on = ["--speculate", "ngram", "--draft-tokens", k];
        let (l, t, v, err) = gen("on", &on);
        assert_eq!((l == plain, &t), (true, &text), "k {k}");
        assert!(err.contains("speculate ngram"), "{err}");
        assert!(v["speculate"]["decode_steps"].as_u64().unwrap() <= 19);
        accepted += v["speculate"]["accepted"].as_u64().unwrap();
        let (l, t, _, _) = gen("on-stop", &[&on[..], &["--stop", &stop]].concat());
        assert_eq!(
            (l == plain_stop, &t),
            (true, &text_stop),
            "k {k} stop {stop:?}"
        );
        let (l, t, _, _) = gen("on-sampled", &[&on[..], &sampled].concat());
        assert_eq!((l == plain_s, &t), (true, &text_s), "k {k} sampled");
    }
    assert!(accepted > 0, "the repeating prompt has drafts accepted");
    // With a router trace speculation is refused by name (the trace would hold rejected
    // positions).
    let r = d.path().join("r.jsonl");
    let (code, _, err) = run(&[
        "generate",
        b.to_str().unwrap(),
        "--prompt",
        "x",
        "--speculate",
        "ngram",
        "--router-trace",
        r.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--router-trace"), "{err}");
}
