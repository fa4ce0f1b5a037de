//! gpt-oss through the converter: fused experts split so that each expert's slice of the fused
//! tensors becomes its extent (BF16 re-laid by the declared permutation, MXFP4 stored as
//! released), the manifest recording each expert's source ranges, `tarfa-verify check
//! --source` proving them (a flipped source byte named as its expert), `diff` naming experts,
//! and every other quantization refused with nothing written.
//!
//! The gpt-oss checkpoints are the shared oracle's (`gptoss-a`, `gptoss-mxfp4-a` and its BF16
//! twin); those tests run when TARFA_EXTRA_ORACLES names it (`.ci/run` sets it):
//! `TARFA_EXTRA_ORACLES=/work/shared/oracle cargo test -p tarfa-convert --test gpt_oss -- --include-ignored`

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use tarfa_verify::{check_bundle, CheckOptions};

const BIN: &str = env!("CARGO_BIN_EXE_tarfa-convert");

fn shared(name: &str) -> PathBuf {
    let root = std::env::var("TARFA_EXTRA_ORACLES")
        .expect("set TARFA_EXTRA_ORACLES to the directory holding the extra oracle fixtures");
    let dir = Path::new(&root).join(name);
    assert!(dir.join("config.json").is_file(), "{}", dir.display());
    dir
}

/// A copy of the checkpoint in `src` without the oracle's reference outputs.
fn copy_checkpoint(src: &Path, dst: &Path) {
    fs::create_dir_all(dst).unwrap();
    for e in fs::read_dir(src).unwrap().flatten() {
        let name = e.file_name().into_string().unwrap();
        if !name.starts_with("reference") {
            fs::copy(e.path(), dst.join(&name)).unwrap();
        }
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let p = dir.join("config.json");
    let mut v: Value = serde_json::from_slice(&fs::read(&p).unwrap()).unwrap();
    f(v.as_object_mut().unwrap());
    fs::write(&p, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

/// The binary on `src` -> `out`: (exit code, stdout, stderr).
fn convert_cli(src: &Path, out: &Path, json: bool) -> (i32, String, String) {
    let mut c = Command::new(BIN);
    c.arg(src).arg(out);
    if json {
        c.arg("--json");
    }
    let o = c.output().unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Refused with exit 2 in one line naming every needle, and nothing left beside `out`.
fn refused(src: &Path, out: &Path, needles: &[&str]) {
    let (code, _, err) = convert_cli(src, out, false);
    assert_eq!(code, 2, "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    for n in needles {
        assert!(err.contains(n), "names {n}: {err}");
    }
    assert!(!out.exists(), "no bundle on refusal");
    let parent = out.parent().unwrap();
    let left: Vec<_> = fs::read_dir(parent)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().into_string().unwrap())
        .filter(|n| n != "src")
        .collect();
    assert!(left.is_empty(), "nothing half-written: {left:?}");
}

/// (failure name, kind) of `tarfa-verify check` on `bundle` against `source`.
fn failures(bundle: &Path, source: &Path) -> Vec<(String, String)> {
    let opts = CheckOptions {
        source: Some(source.to_path_buf()),
        progress: false,
    };
    let r = check_bundle(bundle, &opts).unwrap();
    r.failures
        .iter()
        .map(|f| {
            let v = serde_json::to_value(f).unwrap();
            (f.name.clone(), v["kind"].as_str().unwrap().to_string())
        })
        .collect()
}

fn flip_byte(path: &Path, offset: u64) {
    use std::os::unix::fs::FileExt;
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, offset).unwrap();
    f.write_all_at(&[b[0] ^ 0x10], offset).unwrap();
}

fn manifest(bundle: &Path) -> tarfa_manifest::Manifest {
    tarfa_manifest::Manifest::load(&bundle.join("manifest.toml")).unwrap()
}

/// MXFP4 is gpt-oss's released form and nothing else's: on a Qwen3-MoE checkpoint it is
/// refused by name, naming config.json, before anything is written.
#[test]
fn mxfp4_on_another_family_is_refused_with_nothing_written() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    copy_checkpoint(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/oracle/qwen3moe-a"),
        &src,
    );
    edit_config(&src, |c| {
        c.insert(
            "quantization_config".into(),
            serde_json::json!({"quant_method": "mxfp4"}),
        );
    });
    refused(
        &src,
        &d.path().join("out"),
        &["config.json", "\"mxfp4\"", "gpt-oss's expert tensors only"],
    );
}

/// Any other quantization method on gpt-oss is refused by name, nothing written.
#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn another_quantization_on_gpt_oss_is_refused_with_nothing_written() {
    for method in ["fp8", "bitsandbytes"] {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("src");
        copy_checkpoint(&shared("gptoss-mxfp4-a"), &src);
        edit_config(&src, |c| {
            c["quantization_config"]["quant_method"] = Value::from(method);
        });
        refused(&src, &d.path().join("out"), &["config.json", method]);
    }
    // The MXFP4 checkpoint without its quantization_config: its U8 blocks are refused by name.
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    copy_checkpoint(&shared("gptoss-mxfp4-a"), &src);
    edit_config(&src, |c| {
        c.remove("quantization_config");
    });
    refused(&src, &d.path().join("out"), &["_blocks"]);
}

/// The BF16 fused checkpoint: every expert an extent of gate | up | down re-laid by the declared
/// permutation, its source ranges in the manifest, `check --source` passing; a flipped byte
/// inside expert 3's slice of layer 0's `gate_up_proj` (and then of layer 1's `down_proj`) is
/// named as that expert, with the shard.
#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn fused_bf16_experts_are_proven_against_their_fused_source() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    copy_checkpoint(&shared("gptoss-a"), &src);
    let bundle = d.path().join("bundle");
    let (code, _, err) = convert_cli(&src, &bundle, false);
    assert_eq!(code, 0, "{err}");
    let m = manifest(&bundle);
    assert_eq!(m.experts.len(), 4 * 8);
    let e = m
        .experts
        .iter()
        .find(|e| e.name == "model.layers.0.mlp.experts.3")
        .unwrap();
    assert_eq!(e.relayout.as_deref(), Some("gate_up_interleaved_columns"));
    let tensors: Vec<&str> = e.sources.iter().map(|s| s.tensor.as_str()).collect();
    assert_eq!(
        tensors,
        [
            "model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.0.mlp.experts.down_proj"
        ]
    );
    let roles: Vec<&str> = e.matrices.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["gate", "up", "down"]);
    // The biases are ordinary tensors.
    assert!(m
        .tensors
        .iter()
        .any(|t| t.name == "model.layers.0.mlp.experts.gate_up_proj_bias"));
    assert_eq!(failures(&bundle, &src), vec![]);

    let gu = &e.sources[0];
    flip_byte(&src.join(&gu.shard), gu.offset + 101);
    assert_eq!(
        failures(&bundle, &src),
        vec![
            (e.name.clone(), "source-bytes-differ".into()),
            (gu.shard.clone(), "shard-sha256-mismatch".into()),
        ]
    );
    flip_byte(&src.join(&gu.shard), gu.offset + 101);
    let e1 = m
        .experts
        .iter()
        .find(|e| e.name == "model.layers.1.mlp.experts.6")
        .unwrap();
    let down = &e1.sources[1];
    flip_byte(&src.join(&down.shard), down.offset + down.length - 1);
    assert_eq!(
        failures(&bundle, &src),
        vec![
            (e1.name.clone(), "source-bytes-differ".into()),
            (down.shard.clone(), "shard-sha256-mismatch".into()),
        ]
    );
}

/// The MXFP4 checkpoint: its experts stored as released (four U8 parts, each expert's slice of
/// its tensor byte for byte), the report naming the MXFP4 tensors, `check --source` passing and
/// naming the expert whose slice of `down_proj_blocks` has a flipped byte; `diff` against the
/// BF16 twin names every expert as `model.layers.L.mlp.experts.E`.
#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn mxfp4_experts_are_stored_as_released_and_proven() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    copy_checkpoint(&shared("gptoss-mxfp4-a"), &src);
    let bundle = d.path().join("bundle");
    let (code, out, err) = convert_cli(&src, &bundle, true);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("released form"), "{err}");
    let report: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["mxfp4"]["form"], "released");
    let listed = report["mxfp4"]["tensors"].as_array().unwrap();
    assert_eq!(listed.len(), 4 * 4);
    assert!(listed
        .iter()
        .any(|t| t == "model.layers.3.mlp.experts.gate_up_proj_scales"));

    let h = jnf_format::JnfFile::open(&bundle.join("model.jnf")).unwrap();
    let x = h.header().expert(2, 5).unwrap();
    assert_eq!(x.encoding(), jnf_format::ExtentEncoding::Mxfp4);
    let parts: Vec<(&str, &str, &[u64])> = x
        .matrices
        .iter()
        .map(|m| (m.role.as_str(), m.dtype.as_str(), m.shape.as_slice()))
        .collect();
    assert_eq!(
        parts,
        [
            ("gate_up_blocks", "U8", &[128u64, 4, 16][..]),
            ("gate_up_scales", "U8", &[128, 4][..]),
            ("down_blocks", "U8", &[128, 2, 16][..]),
            ("down_scales", "U8", &[128, 2][..]),
        ]
    );
    // Each part is the expert's slice of the released tensor, byte for byte.
    let m = manifest(&bundle);
    let e = m
        .experts
        .iter()
        .find(|e| e.name == "model.layers.2.mlp.experts.5")
        .unwrap();
    assert_eq!(e.relayout, None);
    let jnf = fs::read(bundle.join("model.jnf")).unwrap();
    let mut at = x.offset as usize;
    for s in &e.sources {
        let shard = fs::read(src.join(&s.shard)).unwrap();
        let want = &shard[s.offset as usize..][..s.length as usize];
        assert_eq!(&jnf[at..at + want.len()], want, "{}", s.tensor);
        at += want.len();
    }
    assert_eq!(failures(&bundle, &src), vec![]);

    let blocks = &e.sources[2];
    assert_eq!(blocks.tensor, "model.layers.2.mlp.experts.down_proj_blocks");
    flip_byte(&src.join(&blocks.shard), blocks.offset + 7);
    assert_eq!(
        failures(&bundle, &src),
        vec![
            (e.name.clone(), "source-bytes-differ".into()),
            (blocks.shard.clone(), "shard-sha256-mismatch".into()),
        ]
    );

    let twin = d.path().join("twin");
    let (code, _, err) = convert_cli(&shared("gptoss-mxfp4-a-bf16"), &twin, false);
    assert_eq!(code, 0, "{err}");
    let diff = tarfa_manifest::diff(&m, &manifest(&twin));
    let json = serde_json::to_value(&diff).unwrap().to_string();
    for l in 0..4 {
        for x in 0..8 {
            let name = format!("\"model.layers.{l}.mlp.experts.{x}\"");
            assert!(json.contains(&name), "diff names {name}");
        }
    }
}
