//! Shared helpers for the integration tests: scratch directories, running the real binary, and
//! building valid bundles without the converter (synthetic ones from random BF16 bytes, and one
//! from a real checkpoint with source records).

#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

use jnf_format::{Dtype, Header, LayoutPlan, MatrixRole, MatrixSpec, SourceRef, TensorSpec};
use tarfa_manifest::hash::{blake3_hex, sha256_hex};
use tarfa_manifest::{
    ExpertRecord, FileRecord, HeaderRecord, Manifest, MatrixRecord, ShardRecord, TensorRecord,
    CONTRACT_VERSION,
};

pub const BIN: &str = env!("CARGO_BIN_EXE_tarfa-verify");
pub const FIXTURE_A: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/oracle/qwen3moe-a");

/// A fresh directory under the system temp dir, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tarfa-verify-test-{}-{tag}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn join(&self, p: impl AsRef<Path>) -> PathBuf {
        self.0.join(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// The result of one run of the binary.
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {:?}", self.stdout))
    }
}

pub fn run(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Run {
    let out: Output = Command::new(BIN)
        .args(args.iter().map(|a| a.as_ref()))
        .output()
        .expect("the binary runs");
    Run {
        code: out.status.code().expect("exited normally, not by a signal"),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}

/// Like [`run`], but the child is killed (and the test fails) if it runs past `secs`: a hang is
/// a defect, never a slow test.
pub fn run_timeout(args: &[&dyn AsRef<std::ffi::OsStr>], secs: u64) -> Run {
    use std::io::Read;
    use std::process::Stdio;
    let mut child = Command::new(BIN)
        .args(args.iter().map(|a| a.as_ref()))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    // Drain both pipes on threads so a chatty child cannot block on a full pipe.
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = so.read_to_end(&mut v);
        v
    });
    let t_err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = se.read_to_end(&mut v);
        v
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("tarfa-verify hung (killed after {secs} s)");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    Run {
        code: status.code().expect("exited normally, not by a signal"),
        stdout: String::from_utf8(t_out.join().unwrap()).unwrap(),
        stderr: String::from_utf8(t_err.join().unwrap()).unwrap(),
    }
}

/// `check --json` on `bundle`, returning the run and the (name, kind) of each failure.
pub fn check_json(bundle: &Path, source: Option<&Path>) -> (Run, Vec<(String, String)>) {
    let r = match source {
        Some(s) => run(&[&"check", &bundle, &"--source", &s, &"--json"]),
        None => run(&[&"check", &bundle, &"--json"]),
    };
    assert!(
        r.code == 0 || r.code == 1,
        "exit {}; stderr: {}",
        r.code,
        r.stderr
    );
    let v = r.json();
    let failures = v["failures"]
        .as_array()
        .expect("failures is an array")
        .iter()
        .map(|f| {
            (
                f["name"].as_str().unwrap().to_string(),
                f["kind"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    (r, failures)
}

/// Deterministic pseudo-random bytes (xorshift64*), so failures reproduce.
pub fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(n);
    out
}

/// XOR one byte of a file with 0x01.
pub fn flip_byte(path: &Path, offset: u64) {
    let mut bytes = fs::read(path).unwrap();
    bytes[offset as usize] ^= 0x01;
    fs::write(path, bytes).unwrap();
}

pub fn set_byte(path: &Path, offset: u64, value: u8) {
    let mut bytes = fs::read(path).unwrap();
    bytes[offset as usize] = value;
    fs::write(path, bytes).unwrap();
}

pub fn read_header(bundle: &Path) -> Header {
    let bytes = fs::read(bundle.join("model.jnf")).unwrap();
    Header::parse(&bytes, bytes.len() as u64).unwrap()
}

pub fn read_manifest(bundle: &Path) -> Manifest {
    Manifest::load(&bundle.join("manifest.toml")).unwrap()
}

/// Rewrite the bundle's manifest through `edit`; the root digest is recomputed if `reroot`
/// (what a forger does: the manifest is then self-consistent, and only a pinned root or the
/// source can tell).
pub fn edit_manifest(bundle: &Path, reroot: bool, edit: impl FnOnce(&mut Manifest)) {
    let mut m = read_manifest(bundle);
    edit(&mut m);
    if reroot {
        m.seal();
    }
    fs::write(bundle.join("manifest.toml"), m.to_toml()).unwrap();
}

/// Shape of a synthetic bundle.
#[derive(Clone, Copy)]
pub struct Synthetic {
    pub layers: u32,
    pub experts: u32,
    pub hidden: u64,
    pub inter: u64,
    pub vocab: u64,
    /// Seeds the random bytes: two bundles with the same seed are byte-identical.
    pub seed: u64,
    /// Naming: `mlp.experts` (Qwen) or `block_sparse_moe.experts` (Mixtral).
    pub mixtral: bool,
    /// Start with a zero-length tensor `model.empty` (shape [0, hidden]), which shares its offset
    /// with the embedding that follows it.
    pub zero_length: bool,
}

impl Default for Synthetic {
    fn default() -> Self {
        Synthetic {
            layers: 2,
            experts: 4,
            hidden: 16,
            inter: 8,
            vocab: 32,
            seed: 1,
            mixtral: false,
            zero_length: false,
        }
    }
}

pub const CONFIG_JSON: &[u8] = br#"{"model_type": "qwen3_moe", "synthetic": true}"#;

/// Write a valid synthetic bundle into `dir` (created if needed): an embedding (BF16), a norm
/// (F32) per layer, and `layers x experts` BF16 experts; `config.json` copied in; no source.
pub fn write_synthetic(dir: &Path, s: Synthetic) -> (Header, Manifest) {
    fs::create_dir_all(dir).unwrap();
    let mut plan = LayoutPlan::new();
    let mut tensors: Vec<(String, Dtype, Vec<u64>)> = Vec::new();
    if s.zero_length {
        tensors.push(("model.empty".into(), Dtype::BF16, vec![0, s.hidden]));
    }
    tensors.push((
        "model.embed_tokens.weight".into(),
        Dtype::BF16,
        vec![s.vocab, s.hidden],
    ));
    for l in 0..s.layers {
        tensors.push((
            format!("model.layers.{l}.input_layernorm.weight"),
            Dtype::F32,
            vec![s.hidden],
        ));
    }
    tensors.push(("model.norm.weight".into(), Dtype::F32, vec![s.hidden]));
    for (name, dtype, shape) in &tensors {
        plan.add_tensor(TensorSpec {
            name: name.clone(),
            dtype: *dtype,
            shape: shape.clone(),
            source: None,
        });
    }
    let (module, mats) = if s.mixtral {
        ("block_sparse_moe.experts", ["w1", "w3", "w2"])
    } else {
        ("mlp.experts", ["gate_proj", "up_proj", "down_proj"])
    };
    let shapes = [
        vec![s.inter, s.hidden],
        vec![s.inter, s.hidden],
        vec![s.hidden, s.inter],
    ];
    for l in 0..s.layers {
        for e in 0..s.experts {
            let prefix = format!("model.layers.{l}.{module}.{e}");
            let specs = [0, 1, 2].map(|i| MatrixSpec {
                name: format!("{prefix}.{}.weight", mats[i]),
                dtype: Dtype::BF16,
                shape: shapes[i].clone(),
                source: None,
            });
            plan.add_expert(l, e, prefix, specs);
        }
    }
    plan.set_metadata("converter", "tarfa-verify test helper");
    let header = plan.finish().unwrap();

    let mut file = header.encode().unwrap();
    file.resize(header.file_size as usize, 0);
    let mut seed = s.seed << 32;
    let mut fill = |offset: u64, len: u64| {
        seed += 1;
        let bytes = random_bytes(seed, len as usize);
        file[offset as usize..(offset + len) as usize].copy_from_slice(&bytes);
        bytes
    };
    let mut manifest = empty_manifest();
    for t in &header.tensors {
        let bytes = fill(t.offset, t.length);
        manifest.tensors.push(tensor_record(t, &bytes));
    }
    for e in &header.experts {
        let bytes = fill(e.offset, e.length);
        manifest.experts.push(expert_record(e, &bytes));
    }
    fs::write(dir.join("model.jnf"), &file).unwrap();
    fs::write(dir.join("config.json"), CONFIG_JSON).unwrap();
    manifest.files.push(FileRecord {
        name: "config.json".into(),
        size: CONFIG_JSON.len() as u64,
        sha256: sha256_hex(CONFIG_JSON),
    });
    manifest.source.insert("kind".into(), "synthetic".into());
    manifest.header = HeaderRecord::of_container_prefix(&file).unwrap();
    manifest.seal();
    fs::write(dir.join("manifest.toml"), manifest.to_toml()).unwrap();
    (header, manifest)
}

fn empty_manifest() -> Manifest {
    Manifest {
        root_digest: String::new(),
        computed_root: String::new(),
        manifest_version: 2,
        format_version: "1.0".into(),
        contract_version: CONTRACT_VERSION,
        converter: "tarfa-verify test helper".into(),
        header: HeaderRecord {
            length: 0,
            sha256: sha256_hex(b""),
        },
        source: Default::default(),
        shards: Vec::new(),
        files: Vec::new(),
        tensors: Vec::new(),
        experts: Vec::new(),
    }
}

fn tensor_record(t: &jnf_format::TensorEntry, bytes: &[u8]) -> TensorRecord {
    TensorRecord {
        name: t.name.clone(),
        dtype: t.dtype.as_str().into(),
        shape: t.shape.clone(),
        offset: t.offset,
        length: bytes.len() as u64,
        sha256: sha256_hex(bytes),
        blake3: blake3_hex(bytes),
        nonfinite: 0,
    }
}

fn expert_record(e: &jnf_format::ExpertExtent, bytes: &[u8]) -> ExpertRecord {
    ExpertRecord {
        relayout: None,
        sources: Vec::new(),
        codec: None,
        stored_length: None,
        stored_blake3: None,
        name: e.prefix.clone(),
        layer: e.layer,
        expert: e.expert,
        offset: e.offset,
        length: e.length,
        padded_length: e.padded_length,
        sha256: sha256_hex(bytes),
        blake3: blake3_hex(bytes),
        nonfinite: 0,
        matrices: e
            .matrices
            .iter()
            .map(|m| MatrixRecord {
                role: m.role,
                name: m.name.clone(),
                dtype: m.dtype.as_str().into(),
                shape: m.shape.clone(),
                offset: m.offset,
                length: m.length,
            })
            .collect(),
    }
}

/// A stand-in for `tarfa-convert`, for tests only: converts the checkpoint in `src` into a bundle
/// in `out` following docs/FORMAT.md (source records, shard hashes, copied files).
pub fn bundle_from_checkpoint(src: &Path, out: &Path) -> (Header, Manifest) {
    bundle_from_checkpoint_with(src, out, None)
}

/// Like [`bundle_from_checkpoint`], but the expert `as_tensors` (layer, expert), if any, is stored
/// as three plain tensors instead of an extent: a self-consistent bundle that is not the source's
/// layout.
pub fn bundle_from_checkpoint_with(
    src: &Path,
    out: &Path,
    as_tensors: Option<(u32, u32)>,
) -> (Header, Manifest) {
    bundle_from_checkpoint_opts(src, out, as_tensors, false)
}

/// Like [`bundle_from_checkpoint`], in format version 2: every expert extent encoded with
/// `jnf-codec` (the helper's own encoding, not the converter's), the manifest recording the
/// decoded bytes' hashes and the stored bytes' codec, length and BLAKE3.
pub fn bundle_from_checkpoint_encoded(src: &Path, out: &Path) -> (Header, Manifest) {
    bundle_from_checkpoint_opts(src, out, None, true)
}

fn bundle_from_checkpoint_opts(
    src: &Path,
    out: &Path,
    as_tensors: Option<(u32, u32)>,
    encode: bool,
) -> (Header, Manifest) {
    let ck = tarfa_checkpoint::open(src).unwrap();
    let dtype = |t: &tarfa_checkpoint::SourceTensor| Dtype::parse(&t.dtype.to_string()).unwrap();
    let source = |t: &tarfa_checkpoint::SourceTensor| {
        Some(SourceRef {
            shard: ck.shards[t.shard].name.clone(),
            offset: t.offset,
        })
    };
    let mut plan = LayoutPlan::new();
    for name in &ck.non_expert {
        let t = &ck.tensors[name];
        plan.add_tensor(TensorSpec {
            name: name.clone(),
            dtype: dtype(t),
            shape: t.shape.clone(),
            source: source(t),
        });
    }
    for (&(l, e), es) in &ck.experts {
        if as_tensors == Some((l, e)) {
            for name in &es.tensors {
                let t = &ck.tensors[name];
                plan.add_tensor(TensorSpec {
                    name: name.clone(),
                    dtype: dtype(t),
                    shape: t.shape.clone(),
                    source: source(t),
                });
            }
            continue;
        }
        let specs = [0, 1, 2].map(|i| {
            let t = &ck.tensors[&es.tensors[i]];
            MatrixSpec {
                name: es.tensors[i].clone(),
                dtype: dtype(t),
                shape: t.shape.clone(),
                source: source(t),
            }
        });
        plan.add_expert(l, e, es.prefix.clone(), specs);
    }
    plan.set_metadata("converter", "tarfa-verify test helper");
    let extent_bytes = |e: &jnf_format::ExpertExtent| {
        let mut bytes = Vec::new();
        for role in MatrixRole::ORDER {
            bytes.extend(
                ck.read_tensor_bytes(&e.matrix(role).expect("gate, up, down").name)
                    .unwrap(),
            );
        }
        bytes
    };
    let mut header = plan.finish().unwrap();
    if encode {
        let mut plan = LayoutPlan::from_header(&header);
        for e in &header.experts {
            let stored = jnf_codec::encode(&extent_bytes(e)).unwrap().len() as u64;
            plan.set_extent_storage(
                e.layer,
                e.expert,
                jnf_format::ExtentCodec::ExponentPlaneZstd,
                stored,
            );
        }
        header = plan.finish().unwrap();
    }

    let mut file = header.encode().unwrap();
    file.resize(header.file_size as usize, 0);
    let mut manifest = empty_manifest();
    if encode {
        manifest.manifest_version = tarfa_manifest::MANIFEST_VERSION_CODECS;
        manifest.format_version = "2.0".into();
    }
    for t in &header.tensors {
        let bytes = ck.read_tensor_bytes(&t.name).unwrap();
        file[t.offset as usize..(t.offset + t.length) as usize].copy_from_slice(&bytes);
        manifest.tensors.push(tensor_record(t, &bytes));
    }
    for e in &header.experts {
        let bytes = extent_bytes(e);
        let mut record = expert_record(e, &bytes);
        let stored = if encode {
            let stored = jnf_codec::encode(&bytes).unwrap();
            record.codec = Some(e.codec.as_str().into());
            record.stored_length = Some(stored.len() as u64);
            record.stored_blake3 = Some(blake3_hex(&stored));
            stored
        } else {
            bytes
        };
        file[e.offset as usize..][..stored.len()].copy_from_slice(&stored);
        manifest.experts.push(record);
    }
    fs::create_dir_all(out).unwrap();
    fs::write(out.join("model.jnf"), &file).unwrap();
    for (s, sha) in ck.shards.iter().zip(ck.shard_sha256s().unwrap()) {
        manifest.shards.push(ShardRecord {
            name: s.name.clone(),
            size: s.size,
            sha256: tarfa_manifest::hash::to_hex(&sha),
        });
    }
    for f in &ck.extra_files {
        let bytes = fs::read(&f.path).unwrap();
        fs::write(out.join(&f.name), &bytes).unwrap();
        manifest.files.push(FileRecord {
            name: f.name.clone(),
            size: bytes.len() as u64,
            sha256: sha256_hex(&bytes),
        });
    }
    manifest.source.insert("kind".into(), "local".into());
    manifest.header = HeaderRecord::of_container_prefix(&file).unwrap();
    manifest.seal();
    fs::write(out.join("manifest.toml"), manifest.to_toml()).unwrap();
    (header, manifest)
}

/// Re-record model.jnf's header JSON (length and SHA-256) in the manifest and re-seal it: a
/// forger's edit of the header, made consistent.
pub fn reseal_header(bundle: &Path) {
    let bytes = fs::read(bundle.join("model.jnf")).unwrap();
    edit_manifest(bundle, true, |m| {
        m.header = HeaderRecord::of_container_prefix(&bytes).unwrap()
    });
}

/// Copy a checkpoint directory's regular files (not recursive) into `dst`.
pub fn copy_dir(src: &Path, dst: &Path) {
    fs::create_dir_all(dst).unwrap();
    for entry in fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            fs::copy(entry.path(), dst.join(entry.file_name())).unwrap();
        }
    }
}
