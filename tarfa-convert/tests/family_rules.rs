//! A checkpoint the runtime would refuse is refused before the conversion writes anything: the
//! runtime's own config, shape, dtype and tokenizer rules (tarfa-core), and the reader's path and
//! name rules, each broken once on a copy of a real transformers checkpoint (qwen3moe-a) and
//! handed to the real binary. Every case: exit 2, one line naming the file (or tensor) and the
//! check, no panic, no hang, and no output directory or temporary left behind.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_tarfa-convert");
/// A refusal takes well under a second; a run this long has hung.
const TIMEOUT: Duration = Duration::from_secs(60);

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/oracle")
        .join(name)
}

/// A tempdir holding `src/` (a copy of qwen3moe-a, edited by the test) and room for `out/`.
struct Case {
    dir: tempfile::TempDir,
}

impl Case {
    fn new() -> Case {
        let c = Case {
            dir: tempfile::tempdir().unwrap(),
        };
        fs::create_dir(c.src()).unwrap();
        for e in fs::read_dir(fixture("qwen3moe-a")).unwrap().flatten() {
            let name = e.file_name().into_string().unwrap();
            // The oracle's reference outputs are not part of the checkpoint.
            if !name.starts_with("reference") {
                fs::copy(e.path(), c.src().join(&name)).unwrap();
            }
        }
        c
    }
    fn src(&self) -> PathBuf {
        self.dir.path().join("src")
    }
    fn out(&self) -> PathBuf {
        self.dir.path().join("out")
    }

    fn edit_config(self, f: impl FnOnce(&mut serde_json::Map<String, Value>)) -> Case {
        let p = self.src().join("config.json");
        let mut v: Value = serde_json::from_slice(&fs::read(&p).unwrap()).unwrap();
        f(v.as_object_mut().unwrap());
        fs::write(&p, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
        self
    }

    /// Rewrites the shard holding `tensor` with the safetensors crate: `f` edits its tensor
    /// list (name, dtype, shape, bytes); the index follows renames and removals.
    fn edit_shard_of(self, tensor: &str, f: impl FnOnce(&mut Vec<Tensor>)) -> Case {
        let index_path = self.src().join("model.safetensors.index.json");
        let mut index: Value = serde_json::from_slice(&fs::read(&index_path).unwrap()).unwrap();
        let shard = index["weight_map"][tensor].as_str().unwrap().to_string();
        let path = self.src().join(&shard);
        let bytes = fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut tensors: Vec<Tensor> = st
            .tensors()
            .into_iter()
            .map(|(name, v)| Tensor {
                name,
                dtype: v.dtype(),
                shape: v.shape().to_vec(),
                data: v.data().to_vec(),
            })
            .collect();
        let before: Vec<String> = tensors.iter().map(|t| t.name.clone()).collect();
        f(&mut tensors);
        let map = index["weight_map"].as_object_mut().unwrap();
        for name in before {
            map.remove(&name);
        }
        for t in &tensors {
            map.insert(t.name.clone(), json!(shard));
        }
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .map(|t| {
                let view = TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap();
                (t.name.clone(), view)
            })
            .collect();
        fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
        fs::write(&index_path, serde_json::to_vec_pretty(&index).unwrap()).unwrap();
        self
    }

    /// Runs the converter (killed and failed after [`TIMEOUT`]); returns (exit code, stderr).
    fn run_on(&self, src: &Path) -> (i32, String) {
        let mut child = Command::new(BIN)
            .arg(src)
            .arg(self.out())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let start = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if start.elapsed() > TIMEOUT {
                child.kill().unwrap();
                child.wait().unwrap();
                panic!("tarfa-convert {} hung", src.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        (status.code().unwrap_or(-1), err)
    }

    fn run(&self) -> (i32, String) {
        self.run_on(&self.src())
    }

    /// Exit 2, one line that names `file` and every one of `checks`, nothing written.
    fn refused(&self, file: &str, checks: &[&str]) -> String {
        self.refused_on(&self.src(), file, checks)
    }

    fn refused_on(&self, src: &Path, file: &str, checks: &[&str]) -> String {
        let (code, err) = self.run_on(src);
        assert_eq!(code, 2, "exit code: {err}");
        assert!(!err.contains("panicked"), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        assert!(err.contains(file), "names {file}: {err}");
        for check in checks {
            assert!(err.contains(check), "names the check {check:?}: {err}");
        }
        assert!(!self.out().exists(), "no output directory");
        let left: Vec<_> = fs::read_dir(self.dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .filter(|n| n != "src" && n != "hub")
            .collect();
        assert!(left.is_empty(), "nothing left behind: {left:?}");
        err
    }
}

struct Tensor {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn find<'a>(ts: &'a mut [Tensor], name: &str) -> &'a mut Tensor {
    ts.iter_mut().find(|t| t.name == name).unwrap()
}

/// Gives `name` shape `shape` (BF16 bytes of the new size).
fn reshape(name: &'static str, shape: &'static [usize]) -> impl FnOnce(&mut Vec<Tensor>) {
    move |ts| {
        let t = find(ts, name);
        t.shape = shape.to_vec();
        t.data = vec![0x3f; 2 * shape.iter().product::<usize>()];
    }
}

#[test]
fn the_fixture_copy_converts() {
    let c = Case::new();
    let (code, err) = c.run();
    assert_eq!(code, 0, "{err}");
    assert!(c.out().join("model.jnf").exists());
}

#[test]
fn a_tied_lm_head_may_be_absent() {
    let c = Case::new()
        .edit_config(|m| {
            m.insert("tie_word_embeddings".into(), json!(true));
        })
        .edit_shard_of("lm_head.weight", |ts| {
            ts.retain(|t| t.name != "lm_head.weight")
        });
    let (code, err) = c.run();
    assert_eq!(code, 0, "{err}");
}

#[test]
fn configs_the_runtime_cannot_run() {
    let set = |key: &'static str, v: Value| {
        move |m: &mut serde_json::Map<String, Value>| {
            m.insert(key.into(), v);
        }
    };
    // YaRN is implemented (EXACTNESS section 5); other scaling types are refused by name.
    let c = Case::new().edit_config(set(
        "rope_scaling",
        json!({"rope_type": "linear", "factor": 4.0}),
    ));
    c.refused("config.json", &["rope_scaling", "linear", "not supported"]);

    let c = Case::new().edit_config(|m| {
        m.insert("use_sliding_window".into(), json!(true));
        m.insert("sliding_window".into(), json!(4096));
    });
    let err = c.refused("config.json", &["sliding_window", "= 4096 "]);
    assert!(
        !err.contains("Some("),
        "the value as the config has it: {err}"
    );

    let c = Case::new().edit_config(set("hidden_act", json!("gelu")));
    c.refused("config.json", &["hidden_act", "\"gelu\""]);

    let c = Case::new().edit_config(set("num_key_value_heads", json!(0)));
    c.refused("config.json", &["num_key_value_heads", "at least 1"]);

    let c = Case::new().edit_config(set("num_key_value_heads", json!(3)));
    c.refused(
        "config.json",
        &["num_attention_heads 4", "num_key_value_heads 3"],
    );

    for theta in [json!(0.0), json!(-10000.0)] {
        let c = Case::new().edit_config(set(
            "rope_parameters",
            json!({"rope_theta": theta, "rope_type": "default"}),
        ));
        c.refused("config.json", &["rope_theta", &theta.to_string()]);
    }
    for eps in [json!(0.0), json!(-1e-6)] {
        let c = Case::new().edit_config(set("rms_norm_eps", eps.clone()));
        c.refused("config.json", &["rms_norm_eps", &eps.to_string()]);
    }
}

#[test]
fn a_vocab_size_that_disagrees_with_the_embedding() {
    let c = Case::new().edit_config(|m| {
        m.insert("vocab_size".into(), json!(500));
    });
    c.refused(
        "model-00001-of-00012.safetensors",
        &["model.embed_tokens.weight", "[512, 128]", "[500, 128]"],
    );
}

#[test]
fn a_missing_lm_head() {
    let c = Case::new().edit_shard_of("lm_head.weight", |ts| {
        ts.retain(|t| t.name != "lm_head.weight")
    });
    c.refused(
        "model.safetensors.index.json",
        &["\"lm_head.weight\"", "missing"],
    );
}

#[test]
fn wrong_q_proj_router_and_embedding_shapes() {
    let q = "model.layers.0.self_attn.q_proj.weight";
    let c = Case::new().edit_shard_of(q, reshape(q, &[64, 128]));
    c.refused(
        q,
        &["[64, 128]", "[128, 128]", "num_attention_heads x head_dim"],
    );

    let router = "model.layers.0.mlp.gate.weight";
    let c = Case::new().edit_shard_of(router, reshape(router, &[16, 128]));
    c.refused(router, &["[16, 128]", "[32, 128]"]);

    let embed = "model.embed_tokens.weight";
    let c = Case::new().edit_shard_of(embed, reshape(embed, &[512, 64]));
    c.refused(embed, &["[512, 64]", "[512, 128]"]);
}

#[test]
fn f16_and_f64_non_expert_tensors_are_refused_as_the_runtime_refuses_them() {
    let norm = "model.norm.weight";
    for (dtype, size, name) in [(Dtype::F16, 2, "F16"), (Dtype::F64, 8, "F64")] {
        let c = Case::new().edit_shard_of(norm, |ts| {
            let t = find(ts, norm);
            t.dtype = dtype;
            t.data = vec![0; size * 128];
        });
        c.refused(norm, &[name, "BF16 or F32"]);
    }
}

#[test]
fn a_tokenizer_that_does_not_load_or_does_not_fit() {
    let c = Case::new();
    fs::write(c.src().join("tokenizer.json"), b"{\"model\": \"garbage\"}").unwrap();
    c.refused("tokenizer.json", &["does not load as a tokenizer"]);

    // qwen3moe-code's tokenizer has 4096 ids; qwen3moe-a's vocabulary has 512 rows.
    let c = Case::new();
    fs::copy(
        fixture("qwen3moe-code").join("tokenizer.json"),
        c.src().join("tokenizer.json"),
    )
    .unwrap();
    c.refused("tokenizer.json", &["token id 4095", "vocab_size 512"]);
}

#[test]
fn a_hub_repository_folder_names_the_snapshot_to_use() {
    let c = Case::new();
    let repo = c.dir.path().join("hub").join("models--tarfa--a");
    let main = "1111111111111111111111111111111111111111";
    let old = "0000000000000000000000000000000000000000";
    fs::create_dir_all(repo.join("snapshots")).unwrap();
    fs::create_dir_all(repo.join("refs")).unwrap();
    fs::create_dir_all(repo.join("blobs")).unwrap();
    fs::rename(c.src(), repo.join("snapshots").join(main)).unwrap();
    fs::create_dir(repo.join("snapshots").join(old)).unwrap();
    fs::write(repo.join("refs").join("main"), main).unwrap();
    fs::create_dir(c.src()).unwrap();
    let err = c.refused_on(
        &repo,
        "models--tarfa--a",
        &["Hugging Face cache repository", "refs/main", old],
    );
    assert!(
        err.contains(&format!("models--tarfa--a/snapshots/{main}")),
        "names the snapshot refs/main points to: {err}"
    );
    // The snapshot it names converts.
    let (code, err) = c.run_on(&repo.join("snapshots").join(main));
    assert_eq!(code, 0, "{err}");
}

fn mkfifo(path: &Path) -> bool {
    Command::new("mkfifo")
        .arg(path)
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn fifos_are_refused_without_blocking() {
    for file in [
        "config.json",
        "model-00005-of-00012.safetensors",
        "tokenizer.json",
    ] {
        let c = Case::new();
        let _ = fs::remove_file(c.src().join(file));
        if !mkfifo(&c.src().join(file)) {
            eprintln!("no mkfifo here; skipped");
            return;
        }
        c.refused(file, &["not a regular file"]);
    }
}

#[test]
fn a_symlink_loop_is_bad_input() {
    let c = Case::new();
    let shard = c.src().join("model-00002-of-00012.safetensors");
    fs::remove_file(&shard).unwrap();
    std::os::unix::fs::symlink("model-00002-of-00012.safetensors", &shard).unwrap();
    c.refused("model-00002-of-00012.safetensors", &["loop"]);
}

#[test]
fn tensor_names_with_bidi_or_control_characters_are_refused_escaped() {
    for (bad, shown) in [
        ('\u{202E}', "\\u{202e}"),
        ('\u{2066}', "\\u{2066}"),
        ('\u{200F}', "\\u{200f}"),
        ('\u{061C}', "\\u{61c}"),
        ('\u{7}', "\\u{7}"),
    ] {
        let norm = "model.norm.weight";
        let c = Case::new().edit_shard_of(norm, |ts| {
            ts.push(Tensor {
                name: format!("model.norm{bad}.weight"),
                dtype: Dtype::BF16,
                shape: vec![1],
                data: vec![0, 0],
            })
        });
        let err = c.refused(
            "model-00012-of-00012.safetensors",
            &["is refused", &format!("U+{:04X}", bad as u32), shown],
        );
        assert!(
            !err.contains(bad),
            "the character itself never reaches the terminal: {err:?}"
        );
    }
}
