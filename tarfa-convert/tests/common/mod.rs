//! What the converter's process tests share: the binary, the fixtures, a run with a time limit,
//! and a synthetic checkpoint big enough to interrupt.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

pub const BIN: &str = env!("CARGO_BIN_EXE_tarfa-convert");

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/oracle")
        .join(name)
}

/// Wait for `child`, killing it and failing the test after `limit`.
pub fn wait_limited(child: std::process::Child, limit: Duration) -> Output {
    let pid = child.id() as i32;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(o) => o.unwrap(),
        Err(_) => {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("tarfa-convert did not finish within {limit:?}");
        }
    }
}

/// Run the binary with a 120 s limit; (exit code, stdout, stderr).
pub fn run(args: &[&dyn AsRef<std::ffi::OsStr>]) -> (i32, String, String) {
    let child = Command::new(BIN)
        .args(args.iter().map(|a| a.as_ref()))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let o = wait_limited(child, Duration::from_secs(120));
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// A ~190 MB synthetic checkpoint in the Hub layout, four shards: big enough to interrupt
/// mid-conversion.
pub fn big_source(dir: &Path) -> PathBuf {
    let src = dir.join("src");
    let (code, _, err) = run(&[
        &"synth",
        &"--shape",
        &"qwen3-30b-a3b",
        &"--layers",
        &"1",
        &"--experts",
        &"16",
        &"--vocab",
        &"2000",
        &"--shard-size",
        &"50000000",
        &src,
    ]);
    assert_eq!(code, 0, "{err}");
    src
}
