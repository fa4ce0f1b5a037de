//! Every kind of bad input, as a crafted checkpoint handed to the real binary: exit code 2, one
//! line naming the file and the failed check, no panic, and no output directory left behind.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_tarfa-convert");

/// A tensor to put in a crafted safetensors file: name, dtype, shape, element bytes.
struct T {
    name: String,
    dtype: &'static str,
    shape: Vec<u64>,
}

fn t(name: &str, shape: &[u64]) -> T {
    T {
        name: name.into(),
        dtype: "BF16",
        shape: shape.to_vec(),
    }
}

/// The tensors of a valid one-layer, two-expert Qwen3-MoE (hidden 8, expert width 4).
fn tiny_tensors() -> Vec<T> {
    let mut v = vec![
        t("model.embed_tokens.weight", &[16, 8]),
        t("model.norm.weight", &[8]),
        t("lm_head.weight", &[16, 8]),
    ];
    let p = "model.layers.0";
    for (n, s) in [
        ("input_layernorm.weight", vec![8]),
        ("post_attention_layernorm.weight", vec![8]),
        ("self_attn.q_proj.weight", vec![8, 8]),
        ("self_attn.k_proj.weight", vec![4, 8]),
        ("self_attn.v_proj.weight", vec![4, 8]),
        ("self_attn.o_proj.weight", vec![8, 8]),
        ("self_attn.q_norm.weight", vec![4]),
        ("self_attn.k_norm.weight", vec![4]),
        ("mlp.gate.weight", vec![2, 8]),
    ] {
        v.push(t(&format!("{p}.{n}"), &s));
    }
    for e in 0..2 {
        v.push(t(&format!("{p}.mlp.experts.{e}.gate_proj.weight"), &[4, 8]));
        v.push(t(&format!("{p}.mlp.experts.{e}.up_proj.weight"), &[4, 8]));
        v.push(t(&format!("{p}.mlp.experts.{e}.down_proj.weight"), &[8, 4]));
    }
    v
}

fn config() -> Value {
    json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 8, "intermediate_size": 16, "moe_intermediate_size": 4,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        "num_experts": 2, "num_experts_per_tok": 1, "norm_topk_prob": true, "vocab_size": 16,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": false
    })
}

fn size_of(dtype: &str) -> u64 {
    match dtype {
        "F32" | "I32" => 4,
        "F64" | "I64" => 8,
        "F8_E4M3" | "I8" | "U8" => 1,
        _ => 2,
    }
}

/// Serialise tensors as a safetensors file (contiguous, in order) with non-zero data bytes.
fn safetensors_bytes(ts: &[T]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut off = 0u64;
    for x in ts {
        let n = x.shape.iter().product::<u64>() * size_of(x.dtype);
        header.insert(
            x.name.clone(),
            json!({"dtype": x.dtype, "shape": x.shape, "data_offsets": [off, off + n]}),
        );
        off += n;
    }
    raw_file(&serde_json::to_string(&header).unwrap(), off)
}

fn raw_file(header: &str, data_len: u64) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend((0..data_len).map(|i| (i * 7 + 3) as u8));
    out
}

struct Case {
    dir: tempfile::TempDir,
}

impl Case {
    fn src(&self) -> PathBuf {
        self.dir.path().join("src")
    }
    fn out(&self) -> PathBuf {
        self.dir.path().join("out")
    }
    /// A valid single-file checkpoint, then `mutate` breaks it.
    fn single(mutate: impl FnOnce(&Path)) -> Case {
        let c = Case {
            dir: tempfile::tempdir().unwrap(),
        };
        fs::create_dir(c.src()).unwrap();
        fs::write(
            c.src().join("config.json"),
            serde_json::to_vec(&config()).unwrap(),
        )
        .unwrap();
        fs::write(
            c.src().join("model.safetensors"),
            safetensors_bytes(&tiny_tensors()),
        )
        .unwrap();
        mutate(&c.src());
        c
    }
    /// A valid two-shard checkpoint (experts in shard 2), then `mutate` breaks it.
    fn sharded(mutate: impl FnOnce(&Path)) -> Case {
        let c = Case {
            dir: tempfile::tempdir().unwrap(),
        };
        fs::create_dir(c.src()).unwrap();
        fs::write(
            c.src().join("config.json"),
            serde_json::to_vec(&config()).unwrap(),
        )
        .unwrap();
        let (a, b): (Vec<T>, Vec<T>) = tiny_tensors()
            .into_iter()
            .partition(|x| !x.name.contains("experts"));
        let mut map = serde_json::Map::new();
        for (file, ts) in [
            ("model-00001-of-00002.safetensors", &a),
            ("model-00002-of-00002.safetensors", &b),
        ] {
            fs::write(c.src().join(file), safetensors_bytes(ts)).unwrap();
            for x in ts {
                map.insert(x.name.clone(), json!(file));
            }
        }
        fs::write(
            c.src().join("model.safetensors.index.json"),
            serde_json::to_vec(&json!({"metadata": {}, "weight_map": map})).unwrap(),
        )
        .unwrap();
        mutate(&c.src());
        c
    }
    /// Run the converter; return (exit code, stderr).
    fn run(&self) -> (i32, String) {
        let o = Command::new(BIN)
            .arg(self.src())
            .arg(self.out())
            .output()
            .unwrap();
        (
            o.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    }
}

/// Expect exit 2, one line mentioning `file` and `check`, no panic, no output left.
fn expect_refused(c: &Case, file: &str, check: &str) {
    let (code, err) = c.run();
    assert_eq!(code, 2, "exit code for {check}: stderr {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(err.contains(file), "names the file {file}: {err}");
    assert!(
        err.to_lowercase().contains(&check.to_lowercase()),
        "names the check {check:?}: {err}"
    );
    assert!(!c.out().exists(), "no output directory");
    let leftovers: Vec<_> = fs::read_dir(c.dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| n != "src")
        .collect();
    assert!(
        leftovers.is_empty(),
        "nothing else left behind: {leftovers:?}"
    );
}

fn rewrite_st(dir: &Path, file: &str, f: impl FnOnce(&mut Vec<u8>)) {
    let p = dir.join(file);
    let mut b = fs::read(&p).unwrap();
    f(&mut b);
    fs::write(p, b).unwrap();
}

/// Replace the JSON header of a safetensors file, keeping its data.
fn rewrite_header(dir: &Path, file: &str, f: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    rewrite_st(dir, file, |b| {
        let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        let mut h: serde_json::Map<String, Value> = serde_json::from_slice(&b[8..8 + n]).unwrap();
        f(&mut h);
        let data = b[8 + n..].to_vec();
        let text = serde_json::to_string(&h).unwrap();
        *b = (text.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(text.as_bytes());
        b.extend_from_slice(&data);
    });
}

const ST: &str = "model.safetensors";

#[test]
fn valid_crafted_checkpoints_convert() {
    for c in [Case::single(|_| {}), Case::sharded(|_| {})] {
        let (code, err) = c.run();
        assert_eq!(code, 0, "{err}");
        assert!(c.out().join("model.jnf").exists());
    }
}

#[test]
fn header_length_larger_than_file() {
    let c = Case::single(|d| {
        rewrite_st(d, ST, |b| {
            b[..8].copy_from_slice(&(10_000_000u64).to_le_bytes())
        })
    });
    expect_refused(&c, ST, "past the end");
}

#[test]
fn header_length_over_cap() {
    let c = Case::single(|d| {
        rewrite_st(d, ST, |b| {
            b[..8].copy_from_slice(&(200_000_000u64).to_le_bytes())
        })
    });
    expect_refused(&c, ST, "cap");
}

#[test]
fn truncated_file() {
    let c = Case::single(|d| rewrite_st(d, ST, |b| b.truncate(b.len() - 10)));
    expect_refused(&c, ST, "past the");
    let c = Case::single(|d| rewrite_st(d, ST, |b| b.truncate(5)));
    expect_refused(&c, ST, "too short");
}

#[test]
fn invalid_json_header() {
    let c = Case::single(|d| rewrite_st(d, ST, |b| b[8] = b'['));
    expect_refused(&c, ST, "JSON");
}

#[test]
fn invalid_utf8_header() {
    let c = Case::single(|d| rewrite_st(d, ST, |b| b[10] = 0xff));
    expect_refused(&c, ST, "UTF-8");
}

#[test]
fn duplicate_tensor_names_same_and_different_ranges() {
    // Identical ranges (the safetensors crate accepts these silently) and different ranges.
    for same in [true, false] {
        let c = Case::single(|d| {
            rewrite_st(d, ST, |b| {
                let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
                let text = String::from_utf8(b[8..8 + n].to_vec()).unwrap();
                let data = b[8 + n..].to_vec();
                let h: serde_json::Map<String, Value> = serde_json::from_str(&text).unwrap();
                let norm = &h["model.norm.weight"];
                let dup = if same {
                    norm.clone()
                } else {
                    h["model.layers.0.input_layernorm.weight"].clone()
                };
                // serde_json maps cannot hold duplicates: splice the key in as text.
                let extra = format!(",\"model.norm.weight\":{dup}}}");
                let text = format!("{}{}", &text[..text.len() - 1], extra);
                *b = (text.len() as u64).to_le_bytes().to_vec();
                b.extend_from_slice(text.as_bytes());
                b.extend_from_slice(&data);
            })
        });
        expect_refused(&c, ST, "twice");
    }
}

fn set_offsets(name: &'static str, begin: i64, end: i64) -> impl FnOnce(&Path) {
    move |d: &Path| {
        rewrite_header(d, ST, |h| {
            let o = h[name]["data_offsets"].as_array().unwrap();
            let (b, e) = (o[0].as_i64().unwrap(), o[1].as_i64().unwrap());
            h[name]["data_offsets"] = json!([b + begin, e + end]);
        })
    }
}

#[test]
fn overlapping_offsets() {
    let c = Case::single(set_offsets("model.norm.weight", -2, -2));
    expect_refused(&c, ST, "inside the previous");
}

#[test]
fn gapped_offsets() {
    let c = Case::single(set_offsets("model.norm.weight", 2, 2));
    expect_refused(&c, ST, "gap");
}

#[test]
fn out_of_bounds_offsets() {
    // The last tensor claims ten times its bytes, consistently with its shape.
    let c = Case::single(|d| {
        rewrite_header(d, ST, |h| {
            let name = "model.layers.0.mlp.experts.1.down_proj.weight";
            let b = h[name]["data_offsets"][0].as_u64().unwrap();
            h[name]["shape"] = json!([8, 40]);
            h[name]["data_offsets"] = json!([b, b + 640]);
        })
    });
    expect_refused(&c, ST, "past the");
}

#[test]
fn shape_overflow() {
    let c = Case::single(|d| {
        rewrite_header(d, ST, |h| {
            h["model.norm.weight"]["shape"] = json!([u64::MAX, 4])
        })
    });
    expect_refused(&c, ST, "overflow");
}

#[test]
fn length_not_shape_times_dtype() {
    let c =
        Case::single(|d| rewrite_header(d, ST, |h| h["model.norm.weight"]["shape"] = json!([9])));
    expect_refused(&c, ST, "spans 16 bytes but its shape and dtype need 18");
}

#[test]
fn unknown_dtype() {
    let c = Case::single(|d| {
        rewrite_header(d, ST, |h| h["model.norm.weight"]["dtype"] = json!("Q4_K"))
    });
    expect_refused(&c, ST, "unknown dtype");
}

#[test]
fn trailing_bytes() {
    let c = Case::single(|d| rewrite_st(d, ST, |b| b.extend_from_slice(&[1, 2, 3])));
    expect_refused(&c, ST, "trailing bytes");
}

const IDX: &str = "model.safetensors.index.json";

fn rewrite_index(f: impl FnOnce(&mut serde_json::Map<String, Value>)) -> impl FnOnce(&Path) {
    move |d: &Path| {
        let p = d.join(IDX);
        let mut v: Value = serde_json::from_slice(&fs::read(&p).unwrap()).unwrap();
        f(v["weight_map"].as_object_mut().unwrap());
        fs::write(p, serde_json::to_vec(&v).unwrap()).unwrap();
    }
}

#[test]
fn index_names_missing_shard() {
    let c = Case::sharded(rewrite_index(|m| {
        m["model.norm.weight"] = json!("model-00009-of-00009.safetensors");
    }));
    expect_refused(&c, IDX, "does not exist");
}

#[test]
fn index_tensor_absent_from_its_shard() {
    let c = Case::sharded(rewrite_index(|m| {
        m.insert(
            "model.layers.0.extra.weight".into(),
            json!("model-00001-of-00002.safetensors"),
        );
    }));
    expect_refused(&c, IDX, "no shard contains it");
}

#[test]
fn tensor_in_two_shards() {
    let c = Case::sharded(|d| {
        // Shard 2 also carries the final norm, which the index puts in shard 1.
        let mut ts: Vec<T> = tiny_tensors()
            .into_iter()
            .filter(|x| x.name.contains("experts"))
            .collect();
        ts.push(t("model.norm.weight", &[8]));
        fs::write(
            d.join("model-00002-of-00002.safetensors"),
            safetensors_bytes(&ts),
        )
        .unwrap();
    });
    expect_refused(&c, "model-0000", "model.norm.weight");
}

#[test]
fn index_name_escapes_directory() {
    for bad in [
        "../outside.safetensors",
        "/etc/passwd",
        "sub/../../x.safetensors",
    ] {
        let c = Case::sharded(rewrite_index(move |m| m["model.norm.weight"] = json!(bad)));
        expect_refused(&c, IDX, "refused");
    }
}

#[test]
fn symlink_out_of_directory() {
    let c = Case::single(|d| {
        let outside = d.parent().unwrap().join("elsewhere.safetensors");
        fs::rename(d.join(ST), &outside).unwrap();
        std::os::unix::fs::symlink(&outside, d.join(ST)).unwrap();
    });
    let (code, err) = c.run();
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(ST) && err.contains("outside the source directory"),
        "{err}"
    );
    assert!(!c.out().exists());
}

#[test]
fn missing_config() {
    let c = Case::single(|d| fs::remove_file(d.join("config.json")).unwrap());
    expect_refused(&c, "config.json", "missing");
}

#[test]
fn malformed_config() {
    let c = Case::single(|d| fs::write(d.join("config.json"), b"{\"model_type\": ").unwrap());
    expect_refused(&c, "config.json", "JSON");
    let c = Case::single(|d| {
        let mut v = config();
        v.as_object_mut().unwrap().remove("num_hidden_layers");
        fs::write(d.join("config.json"), serde_json::to_vec(&v).unwrap()).unwrap();
    });
    expect_refused(&c, "config.json", "num_hidden_layers");
    let c = Case::single(|d| {
        let mut v = config();
        v["num_experts"] = json!("many");
        fs::write(d.join("config.json"), serde_json::to_vec(&v).unwrap()).unwrap();
    });
    expect_refused(&c, "config.json", "num_experts");
}

fn rewrite_tensors(f: impl FnOnce(&mut Vec<T>)) -> impl FnOnce(&Path) {
    move |d: &Path| {
        let mut ts = tiny_tensors();
        f(&mut ts);
        fs::write(d.join(ST), safetensors_bytes(&ts)).unwrap();
    }
}

#[test]
fn no_expert_tensors() {
    let c = Case::single(rewrite_tensors(|ts| {
        ts.retain(|x| !x.name.contains("experts"))
    }));
    expect_refused(&c, "", "expert");
}

#[test]
fn expert_missing_a_matrix() {
    let c = Case::single(rewrite_tensors(|ts| {
        ts.retain(|x| x.name != "model.layers.0.mlp.experts.1.up_proj.weight")
    }));
    expect_refused(&c, "", "model.layers.0.mlp.experts.1");
}

#[test]
fn expert_with_an_extra_matrix() {
    let c = Case::single(rewrite_tensors(|ts| {
        ts.push(t("model.layers.0.mlp.experts.1.bias", &[8]))
    }));
    expect_refused(&c, "", "model.layers.0.mlp.experts.1");
}

#[test]
fn quantized_experts_are_refused_with_the_reason() {
    let c = Case::single(rewrite_tensors(|ts| {
        for x in ts.iter_mut().filter(|x| x.name.contains("experts")) {
            x.dtype = "F8_E4M3";
        }
    }));
    let (code, err) = c.run();
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("F8_E4M3") && err.contains("BF16"),
        "says why: {err}"
    );
    assert!(!c.out().exists());
    let c = Case::single(rewrite_tensors(|ts| ts[1].dtype = "I8"));
    let (code, err) = c.run();
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("I8"), "{err}");
}

#[test]
fn float_non_expert_tensors_are_carried_with_their_dtype() {
    let c = Case::single(rewrite_tensors(|ts| ts[1].dtype = "F32"));
    let (code, err) = c.run();
    assert_eq!(code, 0, "{err}");
    let m = tarfa_manifest::Manifest::load(&c.out().join("manifest.toml")).unwrap();
    assert_eq!(m.tensor("model.norm.weight").unwrap().dtype, "F32");
}

#[test]
fn missing_source_directory_is_bad_input() {
    let d = tempfile::tempdir().unwrap();
    let o = Command::new(BIN)
        .arg(d.path().join("nope"))
        .arg(d.path().join("out"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("nope"));
}

/// Overwrite elements of tensor `name` in `file` with the given BF16 bit patterns.
fn poke_bf16(dir: &Path, file: &str, name: &str, values: &[(usize, u16)]) {
    rewrite_st(dir, file, |b| {
        let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        let h: serde_json::Map<String, Value> = serde_json::from_slice(&b[8..8 + n]).unwrap();
        let begin = h[name]["data_offsets"][0].as_u64().unwrap() as usize + 8 + n;
        for &(i, bits) in values {
            b[begin + 2 * i..begin + 2 * i + 2].copy_from_slice(&bits.to_le_bytes());
        }
    });
}

#[test]
fn nan_and_inf_are_counted_per_tensor_and_expert_and_reported() {
    const NORM: &str = "model.norm.weight";
    const DOWN: &str = "model.layers.0.mlp.experts.1.down_proj.weight";
    let c = Case::single(|d| {
        // Two NaNs (quiet, and negative signalling) and one +Inf in the final norm.
        poke_bf16(d, ST, NORM, &[(0, 0x7fc0), (3, 0xff81), (7, 0x7f80)]);
        // One -Inf in an expert; 0x7f7f (the largest finite BF16) is not counted.
        poke_bf16(d, ST, DOWN, &[(5, 0xff80), (6, 0x7f7f)]);
    });
    let o = Command::new(BIN)
        .arg(c.src())
        .arg(c.out())
        .arg("--json")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["nonfinite_total"], 4, "{v}");
    assert_eq!(v["nonfinite"][0]["name"], NORM, "{v}");
    assert_eq!(v["nonfinite"][0]["count"], 3, "{v}");
    assert_eq!(
        v["nonfinite"][1]["name"], "model.layers.0.mlp.experts.1",
        "{v}"
    );
    assert_eq!(v["nonfinite"][1]["count"], 1, "{v}");
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(warnings.len(), 2, "{err}");
    assert!(
        warnings[0].contains(NORM) && warnings[0].contains("3 NaN or infinite"),
        "{err}"
    );
    let m = tarfa_manifest::Manifest::load(&c.out().join("manifest.toml")).unwrap();
    assert_eq!(m.tensor(NORM).unwrap().nonfinite, 3);
    assert_eq!(m.tensor("model.embed_tokens.weight").unwrap().nonfinite, 0);
    let e = |i: u32| {
        m.experts
            .iter()
            .find(|e| e.layer == 0 && e.expert == i)
            .unwrap()
    };
    assert_eq!(e(1).nonfinite, 1);
    assert_eq!(e(0).nonfinite, 0);
    // The bytes are carried unchanged.
    let jnf = fs::read(c.out().join("model.jnf")).unwrap();
    let src = fs::read(c.src().join(ST)).unwrap();
    let needle = [0xc0, 0x7f];
    assert!(src.windows(2).any(|w| w == needle) && jnf.windows(2).any(|w| w == needle));
}

#[test]
fn many_tiny_tensors_that_would_inflate_on_disk_are_refused() {
    // 20 000 one-element tensors: 40 KB of weights, each padded to 4 KiB, 82 MB on disk.
    let c = Case::single(rewrite_tensors(|ts| {
        for i in 0..20_000 {
            ts.push(t(&format!("model.extra_{i}.weight"), &[1]));
        }
    }));
    expect_refused(&c, "out", "20");
    let (_, err) = c.run();
    assert!(err.contains("tensors smaller than 4 KiB"), "{err}");
}
