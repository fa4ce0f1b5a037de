//! Tests: each rule is broken by a crafted checkpoint (built here, in a temp dir) and the exact
//! error variant is asserted. `Tiny` builds a small valid model of each family; tests then edit
//! its config, its tensor list, or the bytes on disk.

mod config_rules;
mod expert_rules;
mod garbage;
mod header_rules;
mod hybrid_rules;
mod index_rules;
mod path_rules;
mod reading;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::{open, Checkpoint, CheckpointError};

/// A fresh, empty directory under the system temp dir, unique per test.
pub(crate) fn scratch_dir(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "tarfa-checkpoint-{}-{}-{}",
        std::process::id(),
        tag,
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Opens `dir`, expecting failure; checks the message is one line that starts with the file.
pub(crate) fn fails(dir: &Path) -> CheckpointError {
    match open(dir) {
        Ok(_) => panic!("{} opened, but a check should have failed", dir.display()),
        Err(e) => {
            check_message(&e);
            e
        }
    }
}

pub(crate) fn opens(dir: &Path) -> Checkpoint {
    open(dir).unwrap_or_else(|e| panic!("{} should open: {e}", dir.display()))
}

pub(crate) fn check_message(e: &CheckpointError) {
    let msg = e.to_string();
    assert!(
        !msg.contains('\n') && !msg.contains('\r'),
        "message is not one line: {msg:?}"
    );
    let file = e.file().display().to_string();
    assert!(
        msg.starts_with(&format!("{file}: ")),
        "message does not start with the file {file:?}: {msg}"
    );
}

/// Asserts that `$e` is the given variant, printing it otherwise.
macro_rules! assert_variant {
    ($e:expr, $pat:pat) => {{
        let e = $e;
        assert!(matches!(e, $pat), "wrong error: {e:?}\n  ({e})");
        e
    }};
    ($e:expr, $pat:pat if $cond:expr) => {{
        let e = $e;
        assert!(matches!(e, $pat if $cond), "wrong error: {e:?}\n  ({e})");
        e
    }};
}
pub(crate) use assert_variant;

/// A tensor to write: name, dtype string as it appears in the header, shape.
#[derive(Debug, Clone)]
pub(crate) struct Spec {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
}

/// Deterministic content for a tensor: every byte depends on the name and position.
pub(crate) fn content(name: &str, len: usize) -> Vec<u8> {
    let seed = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    (0..len)
        .map(|i| {
            (seed
                .wrapping_add(i as u64)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                >> 56) as u8
        })
        .collect()
}

pub(crate) fn byte_len(dtype: &str, shape: &[u64]) -> usize {
    let bits = crate::header::parse_dtype(dtype).map_or(16, |d| d.bitsize());
    (shape.iter().product::<u64>() as usize * bits).div_ceil(8)
}

/// `8-byte length + header + data`, exactly as written, no checks.
pub(crate) fn raw_safetensors(header: impl AsRef<[u8]>, data: &[u8]) -> Vec<u8> {
    let header = header.as_ref();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend_from_slice(data);
    out
}

/// A valid safetensors file (tensors laid out in name order, header padded with spaces to a
/// multiple of 8, as the reference writer does).
pub(crate) fn safetensors_bytes(tensors: &[Spec]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut data = Vec::new();
    for t in tensors {
        let bytes = content(&t.name, byte_len(&t.dtype, &t.shape));
        let begin = data.len();
        data.extend_from_slice(&bytes);
        header.insert(
            t.name.clone(),
            json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [begin, data.len()]}),
        );
    }
    let mut text = serde_json::to_string(&header).unwrap();
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    raw_safetensors(&text, &data)
}

/// A small valid checkpoint of one family, to be edited by a test and written to disk.
#[derive(Debug, Clone)]
pub(crate) struct Tiny {
    pub config: Value,
    pub tensors: Vec<Spec>,
    /// `None`: one `model.safetensors`; `Some(n)`: an index and `n` shards, tensors dealt out
    /// round-robin in name order (so an expert's matrices land in different shards).
    pub shards: Option<usize>,
}

pub(crate) const LAYERS: u32 = 2;
pub(crate) const EXPERTS: u32 = 4;
pub(crate) const HIDDEN: u64 = 8;
pub(crate) const INTER: u64 = 4;

impl Tiny {
    fn base(model_type: &str, arch: &str, count_key: &str, naming: crate::ExpertNaming) -> Tiny {
        let config = json!({
            "architectures": [arch],
            "model_type": model_type,
            "hidden_size": HIDDEN,
            "num_hidden_layers": LAYERS,
            count_key: EXPERTS,
            "num_experts_per_tok": 2,
            "vocab_size": 16,
        });
        let mut t = Tiny {
            config,
            tensors: Vec::new(),
            shards: Some(3),
        };
        t.add("model.embed_tokens.weight", "BF16", &[16, HIDDEN]);
        t.add("model.norm.weight", "BF16", &[HIDDEN]);
        t.add("lm_head.weight", "BF16", &[16, HIDDEN]);
        let router = match naming {
            crate::ExpertNaming::QwenStyle => "mlp.gate",
            crate::ExpertNaming::Mixtral => "block_sparse_moe.gate",
        };
        for l in 0..LAYERS {
            t.add(
                &format!("model.layers.{l}.input_layernorm.weight"),
                "BF16",
                &[HIDDEN],
            );
            t.add(
                &format!("model.layers.{l}.self_attn.q_proj.weight"),
                "BF16",
                &[HIDDEN, HIDDEN],
            );
            t.add(
                &format!("model.layers.{l}.{router}.weight"),
                "BF16",
                &[EXPERTS as u64, HIDDEN],
            );
            for e in 0..EXPERTS {
                t.add_expert(naming, l, e, INTER);
            }
        }
        t
    }

    pub fn qwen3() -> Tiny {
        Tiny::base(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            "num_local_experts",
            crate::ExpertNaming::QwenStyle,
        )
    }

    pub fn mixtral() -> Tiny {
        Tiny::base(
            "mixtral",
            "MixtralForCausalLM",
            "num_local_experts",
            crate::ExpertNaming::Mixtral,
        )
    }

    pub fn olmoe() -> Tiny {
        Tiny::base(
            "olmoe",
            "OlmoeForCausalLM",
            "num_experts",
            crate::ExpertNaming::QwenStyle,
        )
    }

    pub fn qwen2() -> Tiny {
        let mut t = Tiny::base(
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            "num_experts",
            crate::ExpertNaming::QwenStyle,
        );
        t.add_shared_expert();
        for l in 0..LAYERS {
            t.add(
                &format!("model.layers.{l}.self_attn.q_proj.bias"),
                "BF16",
                &[HIDDEN],
            );
        }
        t
    }

    /// Qwen3-Next: Qwen3-MoE's expert names, a sigmoid-gated shared expert (its attention
    /// tensors are the runtime's rules to judge, not this crate's).
    pub fn qwen3_next() -> Tiny {
        let mut t = Tiny::base(
            "qwen3_next",
            "Qwen3NextForCausalLM",
            "num_experts",
            crate::ExpertNaming::QwenStyle,
        );
        t.add_shared_expert();
        t
    }

    /// Qwen3.5 MoE's text model, per expert as transformers saves it.
    pub fn qwen3_5() -> Tiny {
        let mut t = Tiny::base(
            "qwen3_5_moe_text",
            "Qwen3_5MoeForCausalLM",
            "num_experts",
            crate::ExpertNaming::QwenStyle,
        );
        t.add_shared_expert();
        t
    }

    /// Qwen2-MoE's shared expert and its sigmoid gate, in every layer.
    fn add_shared_expert(&mut self) {
        let t = self;
        for l in 0..LAYERS {
            for m in ["gate_proj", "up_proj"] {
                t.add(
                    &format!("model.layers.{l}.mlp.shared_expert.{m}.weight"),
                    "BF16",
                    &[16, HIDDEN],
                );
            }
            t.add(
                &format!("model.layers.{l}.mlp.shared_expert.down_proj.weight"),
                "BF16",
                &[HIDDEN, 16],
            );
            t.add(
                &format!("model.layers.{l}.mlp.shared_expert_gate.weight"),
                "BF16",
                &[1, HIDDEN],
            );
        }
    }

    pub fn add_expert(&mut self, naming: crate::ExpertNaming, layer: u32, expert: u32, inter: u64) {
        for m in crate::ExpertMatrix::ALL {
            let shape = crate::ExpertDims {
                intermediate: inter,
                hidden: HIDDEN,
            }
            .shape(m);
            self.add(&naming.tensor_name(layer, expert, m), "BF16", &shape);
        }
    }

    pub fn single(mut self) -> Tiny {
        self.shards = None;
        self
    }

    pub fn set(&mut self, key: &str, value: Value) -> &mut Tiny {
        self.config
            .as_object_mut()
            .unwrap()
            .insert(key.into(), value);
        self
    }

    pub fn unset(&mut self, key: &str) -> &mut Tiny {
        self.config.as_object_mut().unwrap().remove(key);
        self
    }

    pub fn add(&mut self, name: &str, dtype: &str, shape: &[u64]) -> &mut Tiny {
        self.tensors.push(Spec {
            name: name.into(),
            dtype: dtype.into(),
            shape: shape.to_vec(),
        });
        self
    }

    pub fn remove(&mut self, name: &str) -> &mut Tiny {
        let before = self.tensors.len();
        self.tensors.retain(|t| t.name != name);
        assert_eq!(before, self.tensors.len() + 1, "no tensor {name}");
        self
    }

    fn spec_mut(&mut self, name: &str) -> &mut Spec {
        self.tensors
            .iter_mut()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no tensor {name}"))
    }

    pub fn retype(&mut self, name: &str, dtype: &str) -> &mut Tiny {
        self.spec_mut(name).dtype = dtype.into();
        self
    }

    pub fn reshape(&mut self, name: &str, shape: &[u64]) -> &mut Tiny {
        self.spec_mut(name).shape = shape.to_vec();
        self
    }

    /// Shard file name of shard `i` of `n`.
    pub fn shard_name(i: usize, n: usize) -> String {
        format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
    }

    /// Which file a tensor is written to.
    pub fn file_of(&self, name: &str) -> String {
        self.layout()
            .into_iter()
            .find(|(_, ts)| ts.iter().any(|t| t.name == name))
            .unwrap()
            .0
    }

    fn layout(&self) -> Vec<(String, Vec<Spec>)> {
        let mut sorted = self.tensors.clone();
        sorted.sort_by(|a, b| a.name.cmp(&b.name));
        match self.shards {
            None => vec![(crate::SINGLE_FILE.to_owned(), sorted)],
            Some(n) => {
                let mut out: Vec<(String, Vec<Spec>)> = (0..n)
                    .map(|i| (Tiny::shard_name(i, n), Vec::new()))
                    .collect();
                for (i, t) in sorted.into_iter().enumerate() {
                    out[i % n].1.push(t);
                }
                out
            }
        }
    }

    /// The index document this layout would get.
    pub fn index(&self) -> Value {
        let mut map = BTreeMap::new();
        for (file, ts) in self.layout() {
            for t in ts {
                map.insert(t.name, file.clone());
            }
        }
        json!({"metadata": {"total_size": 0}, "weight_map": map})
    }

    /// Writes the checkpoint into a fresh directory.
    pub fn write(&self) -> PathBuf {
        let dir = scratch_dir("ckpt");
        self.write_into(&dir);
        dir
    }

    pub fn write_into(&self, dir: &Path) {
        std::fs::write(
            dir.join("config.json"),
            serde_json::to_string_pretty(&self.config).unwrap(),
        )
        .unwrap();
        for (file, ts) in self.layout() {
            std::fs::write(dir.join(file), safetensors_bytes(&ts)).unwrap();
        }
        if self.shards.is_some() {
            std::fs::write(
                dir.join(crate::INDEX_FILE),
                serde_json::to_string_pretty(&self.index()).unwrap(),
            )
            .unwrap();
        }
    }
}

pub(crate) fn qwen_expert(layer: u32, expert: u32, m: crate::ExpertMatrix) -> String {
    crate::ExpertNaming::QwenStyle.tensor_name(layer, expert, m)
}

#[test]
fn every_family_opens() {
    for (tiny, naming) in [
        (Tiny::qwen3(), crate::ExpertNaming::QwenStyle),
        (Tiny::qwen2(), crate::ExpertNaming::QwenStyle),
        (Tiny::olmoe(), crate::ExpertNaming::QwenStyle),
        (Tiny::mixtral(), crate::ExpertNaming::Mixtral),
        (Tiny::qwen3_next(), crate::ExpertNaming::QwenStyle),
        (Tiny::qwen3_5(), crate::ExpertNaming::QwenStyle),
    ] {
        for tiny in [tiny.clone(), tiny.single()] {
            let c = opens(&tiny.write());
            assert_eq!(c.naming, naming);
            assert_eq!(c.experts.len(), (LAYERS * EXPERTS) as usize);
            assert_eq!(c.tensors.len(), tiny.tensors.len());
            assert_eq!(c.non_expert.len() + 3 * c.experts.len(), c.tensors.len());
            assert_eq!(c.config.moe_layers, vec![0, 1]);
            assert_eq!(c.config.num_experts, EXPERTS);
            for l in 0..LAYERS {
                assert_eq!(
                    c.expert_dims[&l],
                    crate::ExpertDims {
                        intermediate: INTER,
                        hidden: HIDDEN
                    }
                );
            }
            let e = &c.experts[&(1, 3)];
            assert_eq!(e.prefix, naming.expert_prefix(1, 3));
            assert_eq!(
                e.tensor(crate::ExpertMatrix::Down),
                naming.tensor_name(1, 3, crate::ExpertMatrix::Down)
            );
            assert_eq!(c.extra_files.len(), 1);
            assert_eq!(c.extra_files[0].name, "config.json");
            assert_eq!(c.index.is_some(), tiny.shards.is_some());
        }
    }
}

#[test]
fn qwen2_shared_expert_is_non_expert() {
    let c = opens(&Tiny::qwen2().write());
    assert!(c
        .non_expert
        .iter()
        .any(|n| n == "model.layers.0.mlp.shared_expert.gate_proj.weight"));
    assert!(c
        .non_expert
        .iter()
        .any(|n| n == "model.layers.1.mlp.shared_expert_gate.weight"));
}

#[test]
fn extra_files_are_listed_in_order() {
    let dir = Tiny::qwen3().write();
    for name in [
        "tokenizer.json",
        "generation_config.json",
        "chat_template.jinja",
    ] {
        std::fs::write(dir.join(name), b"{}").unwrap();
    }
    std::fs::write(dir.join("README.md"), b"ignored").unwrap();
    let c = opens(&dir);
    let names: Vec<&str> = c.extra_files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "chat_template.jinja"
        ]
    );
    assert!(c
        .extra_files
        .iter()
        .all(|f| f.path.starts_with(&c.root) && f.hub_blob.is_none()));
}
