//! Deterministic synthetic checkpoints of real MoE shapes, for every benchmark in the project.
//!
//! Weights look like trained ones where it matters for a storage and streaming engine: roughly
//! normal values with a per-matrix scale (so BF16 exponents carry the entropy real weights show,
//! and zstd compresses them about as well), norm weights near one, never zeros or uniform bytes.
//! With `skew > 0`, routers favour some experts over others, as trained routers do: the
//! embeddings carry a few large constant "massive activation" dimensions (as trained LLMs' hidden
//! states do), and each router row gets a per-expert weight on those dimensions.
//!
//! Every tensor's bytes depend only on (seed, tensor name, shape): the Hub layout and a bundle
//! written directly hold identical bytes, so converting one gives the other's hashes.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;

use half::bf16;
use jnf_format::{Dtype, ExpertExtent, LayoutPlan, MatrixSpec, TensorEntry, TensorSpec};
use rayon::prelude::*;
use serde_json::json;

use crate::bundle::{write_bundle, BundleSpec, CopiedFile, RegionSource, WriteSummary};
use crate::ConvertError;

/// Architecture dimensions of a synthetic model.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthShape {
    pub name: &'static str,
    pub family: Family,
    pub hidden: u64,
    pub layers: u32,
    pub experts: u32,
    pub top_k: u32,
    pub expert_width: u64,
    pub dense_width: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub vocab: u64,
    pub rope_theta: f64,
    pub rms_eps: f64,
    pub max_positions: u64,
    pub tie_embeddings: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Qwen3Moe,
    Mixtral,
}

/// The shapes `--shape` accepts.
pub fn shapes() -> Vec<SynthShape> {
    let qwen30 = SynthShape {
        name: "qwen3-30b-a3b",
        family: Family::Qwen3Moe,
        hidden: 2048,
        layers: 48,
        experts: 128,
        top_k: 8,
        expert_width: 768,
        dense_width: 6144,
        heads: 32,
        kv_heads: 4,
        head_dim: 128,
        vocab: 151_936,
        rope_theta: 1_000_000.0,
        rms_eps: 1e-6,
        max_positions: 40_960,
        tie_embeddings: false,
    };
    let qwen235 = SynthShape {
        name: "qwen3-235b-a22b",
        hidden: 4096,
        layers: 94,
        expert_width: 1536,
        dense_width: 12_288,
        heads: 64,
        ..qwen30.clone()
    };
    let mixtral = SynthShape {
        name: "mixtral-8x7b",
        family: Family::Mixtral,
        hidden: 4096,
        layers: 32,
        experts: 8,
        top_k: 2,
        expert_width: 14_336,
        dense_width: 14_336,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        vocab: 32_000,
        rope_theta: 1_000_000.0,
        rms_eps: 1e-5,
        max_positions: 32_768,
        tie_embeddings: false,
    };
    // For tests: every dimension small, some deliberately not multiples of 32.
    let tiny = SynthShape {
        name: "tiny",
        hidden: 96,
        layers: 2,
        experts: 8,
        top_k: 2,
        expert_width: 40,
        dense_width: 80,
        heads: 4,
        kv_heads: 2,
        head_dim: 24,
        vocab: 300,
        max_positions: 512,
        ..qwen30.clone()
    };
    vec![qwen30, qwen235, mixtral, tiny]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputFormat {
    /// A Hugging Face checkpoint: sharded safetensors, index, config.json.
    Hub,
    /// A JNF bundle, written directly (no source on disk).
    Bundle,
}

#[derive(Debug, Clone)]
pub struct SynthOptions {
    pub shape: SynthShape,
    pub seed: u64,
    /// 0 = routers independent of the input's massive dimensions; 1 = trained-like skew.
    pub skew: f32,
    pub format: OutputFormat,
    /// Largest shard of the Hub layout.
    pub shard_bytes: u64,
    pub force: bool,
}

/// One tensor of the synthetic model, in Hugging Face state-dict order.
#[derive(Debug, Clone)]
pub struct SynthTensor {
    pub name: String,
    pub shape: Vec<u64>,
    kind: Kind,
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Norm,
    Matrix,
    /// A projection back into the residual stream (o_proj, down_proj), its scale multiplied by
    /// 1/sqrt(2 x layers) as in GPT-2's initialisation, so that the residual stays dominated by
    /// token-specific content and routing stays token-dependent at depth.
    OutProj {
        scale: f32,
    },
    Embedding,
    Router {
        layer: u32,
    },
}

/// How many leading hidden dimensions carry the massive activation. Its value is
/// `MASSIVE_PER_SKEW x skew`, and each router row weighs those dimensions by
/// `ROUTER_SKEW x skew x N(0, 1)` (that expert's popularity).
const MASSIVE_DIMS: u64 = 4;
const MASSIVE_PER_SKEW: f32 = 2.0;
const ROUTER_SKEW: f32 = 0.05;
/// Token embeddings: N(0, 1). Their scale relative to the residual updates (see
/// [`Kind::OutProj`]) is what keeps hidden states, and so routing, token-dependent at depth:
/// with trained-looking 0.02 embeddings and undamped updates, a random model routes every token
/// of a prompt to the same experts (measured: 1 distinct top-8 set over 128 tokens).
const EMBED_SIGMA: f32 = 1.0;

impl SynthShape {
    fn expert_prefix(&self, l: u32, e: u32) -> String {
        match self.family {
            Family::Qwen3Moe => format!("model.layers.{l}.mlp.experts.{e}"),
            Family::Mixtral => format!("model.layers.{l}.block_sparse_moe.experts.{e}"),
        }
    }

    fn matrix_names(&self) -> [&'static str; 3] {
        match self.family {
            Family::Qwen3Moe => ["gate_proj", "up_proj", "down_proj"],
            Family::Mixtral => ["w1", "w3", "w2"],
        }
    }

    /// Every tensor, in state-dict order (so that a layer's experts spread over shards).
    pub fn tensors(&self) -> Vec<SynthTensor> {
        let out_proj = Kind::OutProj {
            scale: 1.0 / (2.0 * self.layers.max(1) as f32).sqrt(),
        };
        let (h, hd) = (self.hidden, self.head_dim);
        let t = |name: String, shape: Vec<u64>, kind| SynthTensor { name, shape, kind };
        let mut out = vec![t(
            "model.embed_tokens.weight".into(),
            vec![self.vocab, h],
            Kind::Embedding,
        )];
        for l in 0..self.layers {
            let p = format!("model.layers.{l}");
            out.push(t(
                format!("{p}.input_layernorm.weight"),
                vec![h],
                Kind::Norm,
            ));
            out.push(t(
                format!("{p}.self_attn.q_proj.weight"),
                vec![self.heads * hd, h],
                Kind::Matrix,
            ));
            out.push(t(
                format!("{p}.self_attn.k_proj.weight"),
                vec![self.kv_heads * hd, h],
                Kind::Matrix,
            ));
            out.push(t(
                format!("{p}.self_attn.v_proj.weight"),
                vec![self.kv_heads * hd, h],
                Kind::Matrix,
            ));
            out.push(t(
                format!("{p}.self_attn.o_proj.weight"),
                vec![h, self.heads * hd],
                out_proj,
            ));
            if self.family == Family::Qwen3Moe {
                out.push(t(
                    format!("{p}.self_attn.q_norm.weight"),
                    vec![hd],
                    Kind::Norm,
                ));
                out.push(t(
                    format!("{p}.self_attn.k_norm.weight"),
                    vec![hd],
                    Kind::Norm,
                ));
            }
            out.push(t(
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                Kind::Norm,
            ));
            let gate = match self.family {
                Family::Qwen3Moe => format!("{p}.mlp.gate.weight"),
                Family::Mixtral => format!("{p}.block_sparse_moe.gate.weight"),
            };
            out.push(t(
                gate,
                vec![self.experts as u64, h],
                Kind::Router { layer: l },
            ));
            let [g, u, d] = self.matrix_names();
            for e in 0..self.experts {
                let px = self.expert_prefix(l, e);
                out.push(t(
                    format!("{px}.{g}.weight"),
                    vec![self.expert_width, h],
                    Kind::Matrix,
                ));
                out.push(t(
                    format!("{px}.{u}.weight"),
                    vec![self.expert_width, h],
                    Kind::Matrix,
                ));
                out.push(t(
                    format!("{px}.{d}.weight"),
                    vec![h, self.expert_width],
                    out_proj,
                ));
            }
        }
        out.push(t("model.norm.weight".into(), vec![h], Kind::Norm));
        if !self.tie_embeddings {
            out.push(t(
                "lm_head.weight".into(),
                vec![self.vocab, h],
                Kind::Matrix,
            ));
        }
        out
    }

    pub fn config_json(&self) -> serde_json::Value {
        let (arch, model_type) = match self.family {
            Family::Qwen3Moe => ("Qwen3MoeForCausalLM", "qwen3_moe"),
            Family::Mixtral => ("MixtralForCausalLM", "mixtral"),
        };
        let mut c = json!({
            "architectures": [arch],
            "model_type": model_type,
            "hidden_size": self.hidden,
            "intermediate_size": self.dense_width,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "num_experts_per_tok": self.top_k,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_positions,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "attention_bias": false,
            "torch_dtype": "bfloat16",
            "bos_token_id": null,
            "eos_token_id": null,
        });
        let m = c.as_object_mut().expect("object");
        match self.family {
            Family::Qwen3Moe => {
                m.insert("num_experts".into(), json!(self.experts));
                m.insert("moe_intermediate_size".into(), json!(self.expert_width));
                m.insert("norm_topk_prob".into(), json!(true));
                m.insert("decoder_sparse_step".into(), json!(1));
                m.insert("mlp_only_layers".into(), json!([]));
            }
            Family::Mixtral => {
                m.insert("num_local_experts".into(), json!(self.experts));
                m.insert("intermediate_size".into(), json!(self.expert_width));
            }
        }
        c
    }

    /// (tensor count, total bytes), computed with checked arithmetic before any tensor list is
    /// built; `None` when either overflows a u64.
    pub fn checked_size(&self) -> Option<(u64, u64)> {
        let (h, hd) = (self.hidden, self.head_dim);
        let mat = |r: u64, c: u64| r.checked_mul(c)?.checked_mul(2);
        let per_layer_dense = [
            mat(1, h)?,                                              // input norm
            mat(self.heads.checked_mul(hd)?, h)?,                    // q
            mat(self.kv_heads.checked_mul(hd)?, h)?.checked_mul(2)?, // k, v
            mat(h, self.heads.checked_mul(hd)?)?,                    // o
            mat(2, hd)?,                  // q/k norm (Qwen; an upper bound for Mixtral)
            mat(1, h)?,                   // post-attention norm
            mat(self.experts as u64, h)?, // router
        ]
        .iter()
        .try_fold(0u64, |a, &b| a.checked_add(b))?;
        let per_expert = mat(self.expert_width, h)?.checked_mul(3)?;
        let per_layer =
            per_layer_dense.checked_add(per_expert.checked_mul(self.experts as u64)?)?;
        let global = mat(self.vocab, h)?
            .checked_mul(2)?
            .checked_add(mat(1, h)?)?;
        let bytes = per_layer
            .checked_mul(self.layers as u64)?
            .checked_add(global)?;
        let tensors = (self.experts as u64)
            .checked_mul(3)?
            .checked_add(10)?
            .checked_mul(self.layers as u64)?
            .checked_add(3)?;
        Some((tensors, bytes))
    }

    /// Total bytes of all tensors.
    pub fn total_bytes(&self) -> u64 {
        self.tensors()
            .iter()
            .map(|t| t.shape.iter().product::<u64>() * 2)
            .sum()
    }
}

// ---- deterministic values ----

/// SplitMix64's finaliser: a good 64-bit mix, used as a counter-based generator so that any
/// chunk of any tensor can be generated independently (in parallel) with the same result.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn name_key(seed: u64, name: &str) -> u64 {
    // FNV-1a over the name, then mixed with the seed.
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    mix(h ^ mix(seed))
}

/// An approximately standard normal value from 64 random bits: the sum of four 16-bit uniforms
/// (Irwin-Hall), centred and scaled. Integer arithmetic, then one exact conversion: the same on
/// every machine.
fn normal(bits: u64) -> f32 {
    let s = (bits & 0xffff) + ((bits >> 16) & 0xffff) + ((bits >> 32) & 0xffff) + (bits >> 48);
    (s as f32 - 131_070.0) * (1.0 / 37_837.2)
}

fn uniform01(bits: u64) -> f32 {
    (bits >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
}

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

impl SynthTensor {
    pub fn len_bytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * 2
    }

    /// Fill `dst` with this tensor's BF16 bytes.
    pub fn fill(&self, seed: u64, skew: f32, dst: &mut [u8]) {
        let key = name_key(seed, &self.name);
        // A per-matrix scale, like a trained model's: 0.02 x [0.5, 1.5).
        let sigma = 0.02 * (0.5 + uniform01(mix(key ^ 1)));
        let cols = *self.shape.last().unwrap_or(&1) as usize;
        let kind = self.kind;
        let router_shift: Vec<f32> = match kind {
            Kind::Router { layer } => {
                let rows = self.shape[0] as usize;
                let lk = name_key(seed, &format!("router-popularity.{layer}"));
                (0..rows)
                    .map(|e| skew * ROUTER_SKEW * normal(mix(lk ^ (e as u64).wrapping_mul(GOLDEN))))
                    .collect()
            }
            _ => Vec::new(),
        };
        let massive = MASSIVE_PER_SKEW * skew;
        const CHUNK: usize = 1 << 16;
        dst.par_chunks_mut(CHUNK * 2)
            .enumerate()
            .for_each(|(c, out)| {
                let base = c * CHUNK;
                for (j, pair) in out.chunks_exact_mut(2).enumerate() {
                    let i = base + j;
                    let r = mix(key.wrapping_add((i as u64).wrapping_mul(GOLDEN)));
                    let v = match kind {
                        Kind::Norm => 1.0 + 0.1 * normal(r),
                        Kind::Matrix => sigma * normal(r),
                        Kind::OutProj { scale } => sigma * scale * normal(r),
                        Kind::Embedding => {
                            if ((i % cols) as u64) < MASSIVE_DIMS {
                                massive
                            } else {
                                EMBED_SIGMA * normal(r)
                            }
                        }
                        Kind::Router { .. } => {
                            let (row, col) = (i / cols, i % cols);
                            let shift = if (col as u64) < MASSIVE_DIMS {
                                router_shift[row]
                            } else {
                                0.0
                            };
                            sigma * normal(r) + shift
                        }
                    };
                    pair.copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
                }
            });
    }
}

/// zstd (level 3) compression ratio of `bytes`.
pub fn zstd_ratio(bytes: &[u8]) -> f64 {
    let c = zstd::bulk::compress(bytes, 3).expect("in-memory compression");
    bytes.len() as f64 / c.len() as f64
}

/// What `synth` wrote.
#[derive(Debug)]
pub struct SynthReport {
    pub bytes: u64,
    pub tensors: usize,
    /// zstd ratio over a sample of expert weights (real BF16 weights give about 1.2 to 1.35).
    pub zstd_ratio: f64,
    pub bundle: Option<WriteSummary>,
}

/// Generate the model described by `opts` into `out`.
pub fn synth(out: &Path, opts: &SynthOptions) -> Result<SynthReport, ConvertError> {
    let shape = &opts.shape;
    let tensors = shape.tensors();
    let bytes: u64 = tensors.iter().map(SynthTensor::len_bytes).sum();
    // A sample of up to 16 MiB of expert bytes for the compressibility figure.
    let sample_src = tensors
        .iter()
        .find(|t| t.name.contains(".experts."))
        .expect("experts exist");
    let mut sample = vec![0u8; sample_src.len_bytes() as usize];
    sample_src.fill(opts.seed, opts.skew, &mut sample);
    sample.truncate(16 << 20);
    let ratio = zstd_ratio(&sample);

    let config = serde_json::to_vec_pretty(&shape.config_json()).expect("json");
    let generation = serde_json::to_vec_pretty(&json!({"_from_model_config": true})).expect("json");
    let bundle = match opts.format {
        OutputFormat::Hub => {
            write_hub(out, opts, &tensors, &config, &generation)?;
            None
        }
        OutputFormat::Bundle => Some(write_direct(out, opts, &tensors, config, generation)?),
    };
    Ok(SynthReport {
        bytes,
        tensors: tensors.len(),
        zstd_ratio: ratio,
        bundle,
    })
}

struct LazyTensor<'a> {
    t: &'a SynthTensor,
    shape: Vec<usize>,
    seed: u64,
    skew: f32,
}

impl safetensors::View for LazyTensor<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        safetensors::Dtype::BF16
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let mut v = vec![0u8; self.t.len_bytes() as usize];
        self.t.fill(self.seed, self.skew, &mut v);
        Cow::Owned(v)
    }
    fn data_len(&self) -> usize {
        self.t.len_bytes() as usize
    }
}

fn write_hub(
    out: &Path,
    opts: &SynthOptions,
    tensors: &[SynthTensor],
    config: &[u8],
    generation: &[u8],
) -> Result<(), ConvertError> {
    if out.exists() {
        if !opts.force {
            return Err(ConvertError::TargetExists(out.to_path_buf()));
        }
        if let Some(why) = not_a_hub_checkpoint(out) {
            return Err(ConvertError::NotABundle {
                target: out.to_path_buf(),
                why,
            });
        }
        std::fs::remove_dir_all(out).map_err(ConvertError::io(out, "remove"))?;
    }
    std::fs::create_dir_all(out).map_err(ConvertError::io(out, "create directory"))?;
    // Greedy shards in state-dict order.
    let mut shards: Vec<Vec<&SynthTensor>> = vec![Vec::new()];
    let mut size = 0u64;
    for t in tensors {
        if size > 0 && size + t.len_bytes() > opts.shard_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        size += t.len_bytes();
        shards.last_mut().expect("non-empty").push(t);
    }
    let n = shards.len();
    let mut weight_map = BTreeMap::new();
    let bar = crate::progress::bytes_bar(tensors.iter().map(SynthTensor::len_bytes).sum(), "synth");
    for (i, group) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, n);
        let views = group.iter().map(|t| {
            (
                t.name.clone(),
                LazyTensor {
                    t,
                    shape: t.shape.iter().map(|&d| d as usize).collect(),
                    seed: opts.seed,
                    skew: opts.skew,
                },
            )
        });
        let meta = Some(
            [("format".to_string(), "pt".to_string())]
                .into_iter()
                .collect(),
        );
        let path = out.join(&file);
        safetensors::serialize_to_file(views, meta, &path).map_err(|e| ConvertError::Io {
            path: path.clone(),
            op: "write shard",
            source: std::io::Error::other(e),
        })?;
        for t in group {
            weight_map.insert(t.name.clone(), file.clone());
            bar.inc(t.len_bytes());
        }
        if crate::interrupted() {
            return Err(ConvertError::Interrupted);
        }
    }
    bar.finish_and_clear();
    let index = json!({"metadata": {"total_size": tensors.iter().map(SynthTensor::len_bytes).sum::<u64>()}, "weight_map": weight_map});
    let write = |name: &str, bytes: &[u8]| {
        let p = out.join(name);
        std::fs::write(&p, bytes).map_err(ConvertError::io(&p, "write"))
    };
    write(
        "model.safetensors.index.json",
        &serde_json::to_vec_pretty(&index).expect("json"),
    )?;
    write("config.json", config)?;
    write("generation_config.json", generation)
}

/// Why `dir` is not something `synth --force` may delete: only a directory of a Hub
/// checkpoint's files (config.json, model.safetensors.index.json, other *.json and
/// *.safetensors, nothing else) is.
fn not_a_hub_checkpoint(dir: &Path) -> Option<&'static str> {
    let Ok(meta) = std::fs::symlink_metadata(dir) else {
        return Some("cannot be read");
    };
    if !meta.is_dir() {
        return Some("is not a directory, so not a synthetic checkpoint");
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Some("cannot be listed");
    };
    let mut has_config = false;
    for e in entries {
        let Ok(e) = e else {
            return Some("cannot be listed");
        };
        let name = e.file_name().to_string_lossy().into_owned();
        let is_file = e.file_type().is_ok_and(|t| t.is_file());
        has_config |= name == "config.json";
        if !is_file || !(name.ends_with(".json") || name.ends_with(".safetensors")) {
            return Some("holds files other than a checkpoint's .json and .safetensors");
        }
    }
    if !has_config {
        return Some("has no config.json, so not a checkpoint");
    }
    None
}

struct SynthSource<'a> {
    by_name: BTreeMap<&'a str, &'a SynthTensor>,
    seed: u64,
    skew: f32,
}

impl RegionSource for SynthSource<'_> {
    fn fill_tensor(&self, t: &TensorEntry, dst: &mut [u8]) -> Result<(), ConvertError> {
        self.by_name[t.name.as_str()].fill(self.seed, self.skew, dst);
        Ok(())
    }
    fn fill_expert(&self, e: &ExpertExtent, dst: &mut [u8]) -> Result<(), ConvertError> {
        for m in &e.matrices {
            let r = m.offset as usize..(m.offset + m.length) as usize;
            self.by_name[m.name.as_str()].fill(self.seed, self.skew, &mut dst[r]);
        }
        Ok(())
    }
}

fn write_direct(
    out: &Path,
    opts: &SynthOptions,
    tensors: &[SynthTensor],
    config: Vec<u8>,
    generation: Vec<u8>,
) -> Result<WriteSummary, ConvertError> {
    let shape = &opts.shape;
    let mut layout = LayoutPlan::new();
    let mut non_expert: Vec<&SynthTensor> = tensors
        .iter()
        .filter(|t| !t.name.contains(".experts."))
        .collect();
    // The same order as a conversion: non-expert tensors sorted by name.
    non_expert.sort_by(|a, b| a.name.cmp(&b.name));
    for t in non_expert {
        layout.add_tensor(TensorSpec {
            name: t.name.clone(),
            dtype: Dtype::BF16,
            shape: t.shape.clone(),
            source: None,
        });
    }
    let [g, u, d] = shape.matrix_names();
    for l in 0..shape.layers {
        for e in 0..shape.experts {
            let p = shape.expert_prefix(l, e);
            let spec = |m: &str, s: Vec<u64>| MatrixSpec {
                name: format!("{p}.{m}.weight"),
                dtype: Dtype::BF16,
                shape: s,
                source: None,
            };
            layout.add_expert(
                l,
                e,
                p.clone(),
                [
                    spec(g, vec![shape.expert_width, shape.hidden]),
                    spec(u, vec![shape.expert_width, shape.hidden]),
                    spec(d, vec![shape.hidden, shape.expert_width]),
                ],
            );
        }
    }
    let converter = format!("tarfa-convert synth {}", env!("CARGO_PKG_VERSION"));
    layout.set_metadata("converter", &converter);
    let header = layout.finish()?;
    let mut source = BTreeMap::new();
    source.insert("kind".into(), "synthetic".into());
    source.insert("shape".into(), shape.name.into());
    source.insert("layers".into(), shape.layers.to_string());
    source.insert("experts".into(), shape.experts.to_string());
    source.insert("seed".into(), opts.seed.to_string());
    source.insert("skew".into(), opts.skew.to_string());
    let spec = BundleSpec {
        header,
        files: vec![
            CopiedFile {
                name: "config.json".into(),
                bytes: config,
            },
            CopiedFile {
                name: "generation_config.json".into(),
                bytes: generation,
            },
        ],
        source,
        converter,
    };
    let src = SynthSource {
        by_name: tensors.iter().map(|t| (t.name.as_str(), t)).collect(),
        seed: opts.seed,
        skew: opts.skew,
    };
    write_bundle(out, opts.force, spec, &src)
}
