//! The converter never destroys data that is not its own bundle, never publishes a bundle of a
//! source that changed underneath, and stays responsive: each test builds the hostile situation,
//! runs the real binary in a fresh temporary directory under a timeout, and asserts the exit
//! code, a one-line message naming the path and the check, and what is left on disk.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tarfa_manifest::Manifest;

mod common;
use common::{big_source, fixture, run, wait_limited, BIN};

/// Every file under `dir` (following no symlinks) with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap().flatten() {
            let t = e.file_type().unwrap();
            if t.is_dir() {
                stack.push(e.path());
            } else {
                let bytes = if t.is_symlink() {
                    fs::read_link(e.path())
                        .unwrap()
                        .into_os_string()
                        .into_encoded_bytes()
                } else {
                    fs::read(e.path()).unwrap()
                };
                out.insert(e.path().strip_prefix(dir).unwrap().to_path_buf(), bytes);
            }
        }
    }
    out
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap().flatten() {
        fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Exit 2, one line naming `what` and `check`, no panic.
fn assert_refused(code: i32, err: &str, what: &str, check: &str) {
    assert_eq!(code, 2, "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(err.contains(what), "names {what}: {err}");
    assert!(err.contains(check), "names the check {check:?}: {err}");
}

#[test]
fn output_equal_to_the_source_is_refused_and_the_source_kept() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    copy_dir(&fixture("qwen3moe-a"), &src);
    let before = snapshot(d.path());
    let (code, _, err) = run(&[&src, &src, &"--force"]);
    assert_refused(code, &err, "src", "is the source checkpoint");
    // The same directory spelled through `..` and through a symlink.
    let (code, _, err) = run(&[&src, &src.join("../src"), &"--force"]);
    assert_refused(code, &err, "src", "is the source checkpoint");
    std::os::unix::fs::symlink(&src, d.path().join("link")).unwrap();
    let (code, _, err) = run(&[&src, &d.path().join("link"), &"--force"]);
    assert_refused(code, &err, "link", "is the source checkpoint");
    fs::remove_file(d.path().join("link")).unwrap();
    assert_eq!(snapshot(d.path()), before, "nothing changed");
}

#[test]
fn output_holding_the_source_is_refused_and_kept() {
    let d = tempfile::tempdir().unwrap();
    let top = d.path().join("models");
    let src = top.join("a/src");
    copy_dir(&fixture("qwen3moe-a"), &src);
    fs::write(top.join("notes.txt"), b"the user's own file").unwrap();
    let before = snapshot(d.path());
    let (code, _, err) = run(&[&src, &top, &"--force"]);
    assert_refused(code, &err, "models", "contains the source checkpoint");
    let (code, _, err) = run(&[&src, &top.join("a"), &"--force"]);
    assert_refused(code, &err, "models/a", "contains the source checkpoint");
    assert_eq!(snapshot(d.path()), before, "nothing changed");
}

#[test]
fn output_inside_the_source_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    copy_dir(&fixture("qwen3moe-a"), &src);
    let before = snapshot(d.path());
    // Does not exist yet: its nearest existing ancestor is resolved.
    let out = src.join("new/../bundle");
    let (code, _, err) = run(&[&src, &out]);
    assert_refused(code, &err, "bundle", "is inside the source checkpoint");
    assert_eq!(snapshot(d.path()), before, "nothing created");
}

#[test]
fn force_refuses_a_directory_that_is_not_a_bundle() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("work");
    fs::create_dir(&out).unwrap();
    fs::write(out.join("thesis.tex"), b"years of work").unwrap();
    // A manifest.toml alone (no model.jnf with the magic) is not enough either.
    let almost = d.path().join("almost");
    fs::create_dir(&almost).unwrap();
    fs::write(
        almost.join("manifest.toml"),
        "manifest_version = 1\nformat_version = \"1.0\"\n",
    )
    .unwrap();
    fs::write(almost.join("model.jnf"), b"NOTMAGIC and more").unwrap();
    let before = snapshot(d.path());
    let (code, _, err) = run(&[&fixture("qwen3moe-a"), &out, &"--force"]);
    assert_refused(code, &err, "work", "--force replaces only a Tarfa bundle");
    assert!(err.contains("manifest.toml"), "{err}");
    let (code, _, err) = run(&[&fixture("qwen3moe-a"), &almost, &"--force"]);
    assert_refused(code, &err, "almost", "TARFAJNF");
    assert_eq!(snapshot(d.path()), before, "nothing changed");
    assert_eq!(names(d.path()), ["almost", "work"], "nothing left behind");
}

#[test]
fn force_refuses_a_regular_file_and_leaves_nothing_behind() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("afile");
    fs::write(&out, b"not a bundle").unwrap();
    let (code, _, err) = run(&[&fixture("qwen3moe-a"), &out, &"--force"]);
    assert_refused(code, &err, "afile", "is not a directory");
    assert_eq!(fs::read(&out).unwrap(), b"not a bundle");
    assert_eq!(names(d.path()), ["afile"], "no .tarfa-old-NNNN left");
}

#[test]
fn force_replaces_a_bundle_and_leaves_only_it() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("b");
    assert_eq!(run(&[&fixture("qwen3moe-a"), &out]).0, 0);
    let (code, _, err) = run(&[&fixture("qwen3moe-code"), &out, &"--force"]);
    assert_eq!(code, 0, "{err}");
    let m = Manifest::load(&out.join("manifest.toml")).unwrap();
    assert!(
        m.files.iter().any(|f| f.name == "tokenizer.json"),
        "the new bundle"
    );
    assert_eq!(
        names(d.path()),
        ["b"],
        "no temporary, old bundle or lock left"
    );
}

#[test]
fn a_held_lock_makes_the_second_writer_fail_cleanly() {
    use std::os::fd::AsRawFd;
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("b");
    let lock = fs::File::create(d.path().join(".b.tarfa-lock")).unwrap();
    // SAFETY: plain syscall on our own descriptor.
    assert_eq!(
        unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
        0
    );
    let (code, _, err) = run(&[&fixture("qwen3moe-a"), &out]);
    assert_eq!(code, 3, "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.contains("another tarfa-convert is writing") && err.contains("b.tarfa-lock"),
        "{err}"
    );
    assert_eq!(
        names(d.path()),
        [".b.tarfa-lock"],
        "no bundle, no temporary"
    );
    drop(lock);
    let (code, _, err) = run(&[&fixture("qwen3moe-a"), &out]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn concurrent_converts_to_one_output_never_both_succeed() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("b");
    for _ in 0..3 {
        let spawn = |src: &str| {
            Command::new(BIN)
                .arg(fixture(src))
                .arg(&out)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        };
        let (a, b) = (spawn("qwen3moe-a"), spawn("qwen3moe-code"));
        let (a, b) = (
            wait_limited(a, Duration::from_secs(120)),
            wait_limited(b, Duration::from_secs(120)),
        );
        let codes = [a.status.code().unwrap(), b.status.code().unwrap()];
        let wins = codes.iter().filter(|&&c| c == 0).count();
        assert_eq!(wins, 1, "exactly one wins: {codes:?} {:?} {:?}", a, b);
        let loser = if codes[0] == 0 { &b } else { &a };
        let err = String::from_utf8_lossy(&loser.stderr);
        assert!(
            err.contains("already exists") || err.contains("another tarfa-convert is writing"),
            "{err}"
        );
        // The bundle is the winner's, whole.
        let m = Manifest::load(&out.join("manifest.toml")).unwrap();
        m.check_root().unwrap();
        let code_won = codes[1] == 0;
        assert_eq!(m.files.iter().any(|f| f.name == "tokenizer.json"), code_won);
        assert_eq!(names(d.path()), ["b"], "nothing else left");
        fs::remove_dir_all(&out).unwrap();
    }
}

fn wait_for_temporary(dir: &Path) {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(60) {
        if fs::read_dir(dir).is_ok_and(|mut r| {
            r.any(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().contains("tarfa-tmp")))
        }) {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    panic!("no temporary appeared in {}", dir.display());
}

#[test]
fn a_source_shard_changed_mid_conversion_is_not_published() {
    let d = tempfile::tempdir().unwrap();
    let src = big_source(d.path());
    let shard = src.join("model-00002-of-00005.safetensors");
    assert!(shard.exists(), "{:?}", names(&src));
    let outdir = d.path().join("o");
    fs::create_dir(&outdir).unwrap();
    let out = outdir.join("bundle");
    let child = Command::new(BIN)
        .arg(&src)
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    wait_for_temporary(&outdir);
    // Stop it mid-copy, change one byte of a shard in place (same size), let it go on.
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let f = fs::OpenOptions::new().write(true).open(&shard).unwrap();
    let len = f.metadata().unwrap().len();
    f.write_all_at(&[0x55], len - 3).unwrap();
    drop(f);
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    let o = wait_limited(child, Duration::from_secs(120));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.contains("model-00002-of-00005.safetensors") && err.contains("source shard changed"),
        "{err}"
    );
    assert!(!out.exists());
    assert!(names(&outdir).is_empty(), "temporary and lock removed");
}

#[test]
fn sigterm_with_the_most_threads_is_honoured_promptly_and_cleans_up() {
    let d = tempfile::tempdir().unwrap();
    let src = big_source(d.path());
    let cores = std::thread::available_parallelism().unwrap().get();
    // Parent directories that the conversion creates, and must remove again.
    let out = d.path().join("new/deeper/bundle");
    let child = Command::new(BIN)
        .arg("--threads")
        .arg((4 * cores).max(64).to_string())
        .arg(&src)
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    wait_for_temporary(&d.path().join("new/deeper"));
    let sent = Instant::now();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let o = wait_limited(child, Duration::from_secs(30));
    let took = sent.elapsed();
    let err = String::from_utf8_lossy(&o.stderr);
    if o.status.code() == Some(0) {
        // It finished before the signal landed: then the bundle is whole.
        Manifest::load(&out.join("manifest.toml"))
            .unwrap()
            .check_root()
            .unwrap();
        return;
    }
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(err.contains("interrupted"), "{err}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert_eq!(
        names(d.path()),
        ["src"],
        "created parents removed: {:?}",
        names(d.path())
    );
}

#[test]
fn thread_counts_beyond_the_cap_are_refused_at_once() {
    let d = tempfile::tempdir().unwrap();
    let t = Instant::now();
    let (code, _, err) = run(&[
        &"--threads",
        &"100000",
        &fixture("qwen3moe-a"),
        &d.path().join("b"),
    ]);
    assert_refused(code, &err, "--threads 100000", "4 x the");
    assert!(t.elapsed() < Duration::from_secs(10));
    assert!(names(d.path()).is_empty());
    // 0 means one per core.
    let (code, _, err) = run(&[
        &"--threads",
        &"0",
        &fixture("qwen3moe-a"),
        &d.path().join("b"),
    ]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn synthetic_sizes_beyond_memory_or_disk_are_refused_naming_the_flag() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("s");
    for (flag, value, check) in [
        ("--experts", "4294967295", "tensors, more than"),
        ("--layers", "4294967295", "tensors, more than"),
        ("--vocab", "18446744073709551615", "overflows"),
        ("--vocab", "1000000000000", "bytes free"),
    ] {
        let t = Instant::now();
        let (code, _, err) = run(&[&"synth", &"--shape", &"tiny", &flag, &value, &out]);
        assert_refused(code, &err, &format!("{flag} {value}"), check);
        assert!(t.elapsed() < Duration::from_secs(10), "{flag}");
        assert!(!out.exists());
    }
}

#[test]
fn synth_force_refuses_a_directory_of_other_files() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("mine");
    fs::create_dir(&out).unwrap();
    fs::write(out.join("config.json"), b"{}").unwrap();
    fs::write(out.join("photo.jpg"), b"precious").unwrap();
    let (code, _, err) = run(&[&"synth", &"--shape", &"tiny", &"--force", &out]);
    assert_refused(code, &err, "mine", "holds files other than");
    assert_eq!(fs::read(out.join("photo.jpg")).unwrap(), b"precious");
    // Its own output it replaces.
    let hub = d.path().join("hub");
    assert_eq!(run(&[&"synth", &"--shape", &"tiny", &hub]).0, 0);
    let (code, _, err) = run(&[&"synth", &"--shape", &"tiny", &"--force", &hub]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn errors_under_json_are_one_json_object_on_stdout() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("afile");
    fs::write(&out, b"x").unwrap();
    let (code, stdout, _) = run(&[&fixture("qwen3moe-a"), &out, &"--force", &"--json"]);
    assert_eq!(code, 2);
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["exit_code"], 2);
    assert_eq!(v["error"]["kind"], "not_a_bundle");
    assert!(
        v["error"]["path"].as_str().unwrap().ends_with("afile"),
        "{v}"
    );
    assert!(
        v["error"]["message"].as_str().unwrap().contains("--force"),
        "{v}"
    );
    let (code, stdout, _) = run(&[&d.path().join("nope"), &d.path().join("b"), &"--json"]);
    assert_eq!(code, 2);
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["error"]["kind"], "checkpoint");
    assert!(
        v["error"]["path"].as_str().unwrap().ends_with("nope"),
        "{v}"
    );
}

#[test]
fn symlink_loops_are_bad_input() {
    let d = tempfile::tempdir().unwrap();
    let looped = d.path().join("loop");
    std::os::unix::fs::symlink(&looped, &looped).unwrap();
    let (code, _, err) = run(&[&looped, &d.path().join("b1")]);
    assert_refused(code, &err, "loop", "symbolic links");
    // A loop inside the source directory, where config.json should be.
    let src = d.path().join("src");
    copy_dir(&fixture("qwen3moe-a"), &src);
    fs::remove_file(src.join("config.json")).unwrap();
    std::os::unix::fs::symlink(src.join("config.json"), src.join("config.json")).unwrap();
    let (code, _, err) = run(&[&src, &d.path().join("b2")]);
    assert_refused(code, &err, "config.json", "symbolic links");
    assert_eq!(names(d.path()), ["loop", "src"]);
}

#[test]
fn a_failed_output_write_is_exit_3_naming_the_file_and_leaves_nothing() {
    use std::os::unix::process::CommandExt;
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("made/for/it/bundle");
    let mut cmd = Command::new(BIN);
    cmd.arg(fixture("qwen3moe-a"))
        .arg(&out)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: only async-signal-safe calls between fork and exec. A file-size limit of 1 MiB
    // makes the bundle's writes fail (EFBIG) as a full disk would, part-way; SIGXFSZ ignored so
    // that the failure is an error return, not a kill.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let lim = libc::rlimit {
                rlim_cur: 1 << 20,
                rlim_max: 1 << 20,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let o = wait_limited(cmd.spawn().unwrap(), Duration::from_secs(120));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("model.jnf"), "names the file: {err}");
    assert!(
        names(d.path()).is_empty(),
        "created parents removed: {:?}",
        names(d.path())
    );
}

#[test]
fn an_output_path_through_a_file_is_bad_input() {
    let d = tempfile::tempdir().unwrap();
    fs::write(d.path().join("afile"), b"x").unwrap();
    let (code, _, err) = run(&[&fixture("qwen3moe-a"), &d.path().join("afile/bundle")]);
    assert_refused(code, &err, "afile", "Not a directory");
    assert_eq!(fs::read(d.path().join("afile")).unwrap(), b"x");
    assert_eq!(names(d.path()), ["afile"]);
}
