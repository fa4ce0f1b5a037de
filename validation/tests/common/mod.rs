//! Shared by the end-to-end tests: the workspace's real `tarfa-run` and `tarfa-convert`
//! binaries (built in this test profile), and oracle fixtures converted into fresh bundles.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

pub const VALIDATE: &str = env!("CARGO_BIN_EXE_tarfa-validate");
pub const AB: &str = env!("CARGO_BIN_EXE_tarfa-ab");

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `target/<profile>/`: where this test's own binaries are.
fn bin_dir() -> PathBuf {
    Path::new(VALIDATE).parent().unwrap().to_path_buf()
}

/// Build `bins` of the other workspace packages in this profile (cargo only builds the binaries
/// of the package under test; a no-op when `cargo test --workspace` built them already).
fn build(args: &[&str]) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let profile = if bin_dir().ends_with("release") {
        "release"
    } else {
        "test"
    };
    let st = Command::new(cargo)
        .current_dir(workspace())
        .args(["build", "--quiet", "--profile", profile])
        .args(args)
        .status()
        .expect("run cargo build");
    assert!(st.success(), "cargo build {args:?} failed");
}

/// The workspace's `tarfa-run` and `tarfa-convert`, built once per test process.
pub fn binaries() -> &'static (PathBuf, PathBuf) {
    static B: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    B.get_or_init(|| {
        build(&[
            "-p",
            "tarfa-run",
            "--bin",
            "tarfa-run",
            "-p",
            "tarfa-convert",
            "--bin",
            "tarfa-convert",
        ]);
        let run = std::env::var_os("TARFA_RUN")
            .map(PathBuf::from)
            .unwrap_or_else(|| bin_dir().join("tarfa-run"));
        (run, bin_dir().join("tarfa-convert"))
    })
}

/// The runtime; its `generate` command must answer `--help`.
pub fn runtime() -> PathBuf {
    let (run, _) = binaries();
    let o = Command::new(run)
        .args(["generate", "--help"])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{} has no `generate` command",
        run.display()
    );
    run.clone()
}

/// An oracle fixture converted by the real tarfa-convert into a fresh temporary directory.
pub struct Converted {
    pub dir: tempfile::TempDir,
    pub bundle: PathBuf,
}

pub fn convert(fixture: &str) -> Converted {
    convert_with(fixture, &[])
}

/// [`convert`] with more `tarfa-convert` arguments (`--codec exp-zstd`).
pub fn convert_with(fixture: &str, args: &[&str]) -> Converted {
    let (_, conv) = binaries();
    let dir = tempfile::Builder::new()
        .prefix("tarfa-validate-test-")
        .tempdir()
        .unwrap();
    let bundle = dir.path().join(fixture);
    let src = workspace().join("fixtures/oracle").join(fixture);
    let o = Command::new(conv)
        .arg(&src)
        .arg(&bundle)
        .args(args)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "tarfa-convert: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Converted { dir, bundle }
}

/// Run a binary; (exit code, stdout, stderr).
pub fn run(bin: &str, args: &[&dyn AsRef<std::ffi::OsStr>]) -> (i32, String, String) {
    let o = Command::new(bin)
        .args(args.iter().map(|a| a.as_ref()))
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Flip the low bit of the middle byte of the named region of `bundle/model.jnf`.
pub fn flip_byte_of(bundle: &Path, name: &str) {
    use std::io::{Read, Seek, SeekFrom, Write};
    let regions = tarfa_validate::bundle::jnf_regions(&bundle.join("model.jnf")).unwrap();
    let r = regions[name];
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(bundle.join("model.jnf"))
        .unwrap();
    let at = r.offset + r.length / 2;
    let mut b = [0u8];
    f.seek(SeekFrom::Start(at)).unwrap();
    f.read_exact(&mut b).unwrap();
    b[0] ^= 1;
    f.seek(SeekFrom::Start(at)).unwrap();
    f.write_all(&b).unwrap();
}
