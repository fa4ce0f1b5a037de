//! A bundle as the checks see it: `config.json`, `manifest.toml` and the `model.jnf` header, each
//! read here with serde and nothing of the runtime's.
//!
//! The checks must judge the runtime from outside: a check that read the bundle through the
//! runtime's own loader would inherit the loader's bugs. So this module re-states the few rules it
//! needs (docs/FORMAT.md for the files, transformers' semantics for the config) and must never
//! import a Tarfa crate.

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of `bytes`, lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// BLAKE3 of `bytes`, lowercase hex.
pub fn blake3_hex(bytes: &[u8]) -> String {
    blake3::hash(bytes).to_hex().to_string()
}

/// The routing facts of a config, as transformers defines them.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub model_type: String,
    pub vocab_size: usize,
    pub num_hidden_layers: usize,
    pub max_position_embeddings: Option<usize>,
    /// E: `num_experts` (Qwen, OLMoE) or `num_local_experts` (Mixtral).
    pub num_experts: usize,
    /// k: `num_experts_per_tok`.
    pub top_k: usize,
    /// `norm_topk_prob` as written (absent: transformers' default, false).
    pub norm_topk_prob: bool,
    /// Whether the selected probabilities are renormalised: Mixtral always; the Qwen families and
    /// OLMoE when `norm_topk_prob`.
    pub renormalizes: bool,
    /// The decoder layers that have an MoE block, ascending.
    pub moe_layers: Vec<usize>,
}

fn usize_key(obj: &serde_json::Map<String, Value>, key: &str) -> Result<Option<usize>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| anyhow!("config.json: `{key}` is not a non-negative integer: {v}")),
    }
}

impl ModelConfig {
    /// Parse a Hugging Face `config.json` of one of the MoE families Tarfa runs.
    pub fn parse(text: &str) -> Result<ModelConfig> {
        let v: Value = serde_json::from_str(text).context("config.json is not JSON")?;
        let obj = v
            .as_object()
            .ok_or_else(|| anyhow!("config.json is not an object"))?;
        let model_type = obj
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| anyhow!("config.json has no model_type"))?
            .to_string();
        let req = |key: &str| -> Result<usize> {
            usize_key(obj, key)?.ok_or_else(|| anyhow!("config.json has no `{key}`"))
        };
        // transformers 5 spells E either way in every family (an attribute map); the family's
        // own key first.
        let experts = |first: &str, second: &str| -> Result<usize> {
            match usize_key(obj, first)? {
                Some(e) => Ok(e),
                None => usize_key(obj, second)?
                    .ok_or_else(|| anyhow!("config.json has neither `{first}` nor `{second}`")),
            }
        };
        let vocab_size = req("vocab_size")?;
        let num_hidden_layers = req("num_hidden_layers")?;
        let max_position_embeddings = usize_key(obj, "max_position_embeddings")?;
        let top_k = req("num_experts_per_tok")?;
        let norm_topk_prob = obj
            .get("norm_topk_prob")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        // Which key holds E, whether top-k is renormalised, and which layers are MoE, per family
        // (transformers' modeling files).
        let (num_experts, renormalizes, moe_layers) = match model_type.as_str() {
            "qwen3_moe" | "qwen2_moe" => {
                let e = experts("num_experts", "num_local_experts")?;
                let step = usize_key(obj, "decoder_sparse_step")?.unwrap_or(1);
                if step == 0 {
                    bail!("config.json: decoder_sparse_step is 0");
                }
                let mlp_only: Vec<usize> = match obj.get("mlp_only_layers") {
                    None | Some(Value::Null) => Vec::new(),
                    Some(Value::Array(a)) => a
                        .iter()
                        .map(|x| {
                            x.as_u64().map(|n| n as usize).ok_or_else(|| {
                                anyhow!("config.json: mlp_only_layers holds {x}, not a layer index")
                            })
                        })
                        .collect::<Result<_>>()?,
                    Some(other) => bail!("config.json: mlp_only_layers is {other}, not a list"),
                };
                let layers = (0..num_hidden_layers)
                    .filter(|l| !mlp_only.contains(l) && e > 0 && (l + 1) % step == 0)
                    .collect();
                (e, norm_topk_prob, layers)
            }
            "olmoe" => (
                experts("num_experts", "num_local_experts")?,
                norm_topk_prob,
                (0..num_hidden_layers).collect(),
            ),
            "mixtral" => (
                experts("num_local_experts", "num_experts")?,
                true,
                (0..num_hidden_layers).collect(),
            ),
            other => {
                bail!("config.json: model_type `{other}` is not an MoE family the checks know")
            }
        };
        Ok(ModelConfig {
            model_type,
            vocab_size,
            num_hidden_layers,
            max_position_embeddings,
            num_experts,
            top_k,
            norm_topk_prob,
            renormalizes,
            moe_layers,
        })
    }
}

/// A `[[shards]]` or `[[files]]` entry.
#[derive(Clone, Debug, Deserialize)]
pub struct FileEntry {
    pub name: String,
    pub size: u64,
    pub sha256: String,
}

/// A `[[tensors]]` entry (the fields the checks use; the rest is ignored).
#[derive(Clone, Debug, Deserialize)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: String,
    pub length: u64,
    pub sha256: String,
    pub blake3: Option<String>,
}

/// An `[[experts]]` entry (the fields the checks use).
#[derive(Clone, Debug, Deserialize)]
pub struct ExpertEntry {
    pub name: String,
    pub layer: u32,
    pub expert: u32,
    pub length: u64,
    pub sha256: String,
    pub blake3: String,
}

/// `manifest.toml`, as far as the checks need it.
#[derive(Clone, Debug, Deserialize)]
pub struct Manifest {
    pub root_digest: String,
    /// SHA-256 of the text after the first line, as read.
    #[serde(skip)]
    pub body_sha256: String,
    #[serde(default)]
    pub shards: Vec<FileEntry>,
    #[serde(default)]
    pub files: Vec<FileEntry>,
    #[serde(default)]
    pub tensors: Vec<TensorEntry>,
    #[serde(default)]
    pub experts: Vec<ExpertEntry>,
}

impl Manifest {
    pub fn parse(text: &str) -> Result<Manifest> {
        let mut m: Manifest =
            toml::from_str(text).map_err(|e| anyhow!("manifest.toml: {}", e.message()))?;
        // The root covers the bytes after the first line (docs/FORMAT.md, manifest_version 2).
        let body = text.split_once('\n').map_or("", |(_, rest)| rest);
        m.body_sha256 = hex(&Sha256::digest(body.as_bytes()));
        Ok(m)
    }

    /// The root digest recomputed as docs/FORMAT.md says, independently of tarfa-manifest:
    /// the SHA-256 of every byte of manifest.toml after its first line
    /// (`tail -n +2 manifest.toml | sha256sum`).
    pub fn recompute_root(&self) -> String {
        self.body_sha256.clone()
    }

    pub fn tensor_map(&self) -> BTreeMap<&str, &TensorEntry> {
        self.tensors.iter().map(|t| (t.name.as_str(), t)).collect()
    }

    pub fn expert_map(&self) -> BTreeMap<&str, &ExpertEntry> {
        self.experts.iter().map(|e| (e.name.as_str(), e)).collect()
    }

    /// The extent name of (layer, expert), e.g. `model.layers.3.mlp.experts.17`.
    pub fn expert_name(&self, layer: u32, expert: u32) -> Option<&str> {
        self.experts
            .iter()
            .find(|e| e.layer == layer && e.expert == expert)
            .map(|e| e.name.as_str())
    }

    /// Total bytes of all expert extents (without padding).
    pub fn expert_bytes(&self) -> u64 {
        self.experts.iter().map(|e| e.length).sum()
    }
}

/// Where a tensor or an expert extent lies in `model.jnf`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub offset: u64,
    /// Bytes of the region in the file: the stored bytes of an encoded extent.
    pub length: u64,
    /// `Some(decoded length)` for an expert extent stored encoded (format version 2, codec
    /// `exp-zstd`): its manifest digests are of the decoded bytes.
    pub encoded: Option<u64>,
}

/// The `model.jnf` header's regions by name (tensors by name, extents by prefix).
pub fn jnf_regions(path: &Path) -> Result<BTreeMap<String, Region>> {
    let mut f = fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut pre = [0u8; 24];
    f.read_exact(&mut pre)
        .with_context(|| format!("{}: shorter than a JNF preamble", path.display()))?;
    if &pre[..8] != b"TARFAJNF" {
        bail!("{}: not a JNF file (bad magic)", path.display());
    }
    let header_len = u64::from_le_bytes(pre[16..24].try_into().unwrap());
    if header_len > 64 << 20 {
        bail!(
            "{}: header of {header_len} bytes exceeds 64 MiB",
            path.display()
        );
    }
    let mut header = vec![0u8; header_len as usize];
    f.read_exact(&mut header)
        .with_context(|| format!("{}: truncated header", path.display()))?;
    let h: Value = serde_json::from_slice(&header).context("JNF header is not JSON")?;
    let mut out = BTreeMap::new();
    let region = |v: &Value| -> Result<Region> {
        let get = |k: &str| {
            v.get(k)
                .and_then(Value::as_u64)
                .ok_or_else(|| anyhow!("JNF header entry lacks `{k}`: {v}"))
        };
        Ok(Region {
            offset: get("offset")?,
            length: get("length")?,
            encoded: None,
        })
    };
    for t in h["tensors"].as_array().into_iter().flatten() {
        let name = t["name"]
            .as_str()
            .ok_or_else(|| anyhow!("JNF tensor without a name"))?;
        out.insert(name.to_string(), region(t)?);
    }
    for e in h["experts"].as_array().into_iter().flatten() {
        let name = e["prefix"]
            .as_str()
            .ok_or_else(|| anyhow!("JNF extent without a prefix"))?;
        let mut r = region(e)?;
        // format version 2: an extent records how it is stored (docs/FORMAT.md, "Version 2")
        match e.get("codec").map(|c| c.as_str()) {
            None | Some(Some("raw")) => {}
            Some(Some("exp-zstd")) => {
                let stored = e
                    .get("stored_length")
                    .and_then(Value::as_u64)
                    .ok_or_else(|| {
                        anyhow!("JNF extent {name}: exp-zstd without `stored_length`")
                    })?;
                r = Region {
                    offset: r.offset,
                    length: stored,
                    encoded: Some(r.length),
                };
            }
            Some(c) => bail!("JNF extent {name}: unknown codec {c:?}"),
        }
        out.insert(name.to_string(), r);
    }
    Ok(out)
}

/// Read `region` of the file at `path`.
pub fn read_region(file: &mut fs::File, region: Region) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; region.length as usize];
    file.seek(SeekFrom::Start(region.offset))?;
    file.read_exact(&mut buf)?;
    Ok(buf)
}

/// A bundle directory with its config and manifest loaded.
#[derive(Clone, Debug)]
pub struct Bundle {
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub manifest: Manifest,
    /// Whether config.json's SHA-256 equals the manifest's `[[files]]` record of it.
    pub config_attested: bool,
}

impl Bundle {
    /// Load `dir/config.json` and `dir/manifest.toml`. An error here is a bad argument (exit 2).
    pub fn open(dir: &Path) -> Result<Bundle> {
        let config_bytes = fs::read(dir.join("config.json"))
            .with_context(|| format!("{} is not a bundle: no config.json", dir.display()))?;
        let manifest_text = fs::read_to_string(dir.join("manifest.toml"))
            .with_context(|| format!("{} is not a bundle: no manifest.toml", dir.display()))?;
        if !dir.join("model.jnf").is_file() {
            bail!("{} is not a bundle: no model.jnf", dir.display());
        }
        let config = ModelConfig::parse(
            std::str::from_utf8(&config_bytes).context("config.json is not UTF-8")?,
        )?;
        let manifest = Manifest::parse(&manifest_text)?;
        let config_sha = sha256_hex(&config_bytes);
        let config_attested = manifest
            .files
            .iter()
            .any(|f| f.name == "config.json" && f.sha256 == config_sha);
        Ok(Bundle {
            dir: dir.to_path_buf(),
            config,
            manifest,
            config_attested,
        })
    }

    pub fn jnf_path(&self) -> PathBuf {
        self.dir.join("model.jnf")
    }

    /// The first 12 hex digits of the root digest, for output lines.
    pub fn short_root(&self) -> &str {
        &self.manifest.root_digest[..self.manifest.root_digest.len().min(12)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen(extra: &str) -> String {
        format!(
            r#"{{"model_type":"qwen3_moe","vocab_size":512,"num_hidden_layers":4,
               "num_experts":32,"num_experts_per_tok":8{extra}}}"#
        )
    }

    #[test]
    fn qwen_layers_follow_mlp_only_layers_and_the_sparse_step() {
        let c = ModelConfig::parse(&qwen(r#","norm_topk_prob":true"#)).unwrap();
        assert_eq!(c.moe_layers, vec![0, 1, 2, 3]);
        assert!(c.renormalizes);
        let c =
            ModelConfig::parse(&qwen(r#","decoder_sparse_step":2,"mlp_only_layers":[3]"#)).unwrap();
        assert_eq!(c.moe_layers, vec![1]);
        assert!(!c.renormalizes, "norm_topk_prob defaults to false");
    }

    #[test]
    fn mixtral_always_renormalises_and_reads_num_local_experts() {
        let c = ModelConfig::parse(
            r#"{"model_type":"mixtral","vocab_size":32000,"num_hidden_layers":2,
                "num_local_experts":8,"num_experts_per_tok":2,"norm_topk_prob":false}"#,
        )
        .unwrap();
        assert_eq!((c.num_experts, c.top_k, c.renormalizes), (8, 2, true));
        assert_eq!(c.moe_layers, vec![0, 1]);
    }

    #[test]
    fn unknown_families_and_missing_keys_are_refused() {
        assert!(ModelConfig::parse(r#"{"model_type":"llama"}"#).is_err());
        assert!(ModelConfig::parse(
            r#"{"model_type":"qwen3_moe","vocab_size":1,"num_hidden_layers":1,"num_experts_per_tok":1}"#
        )
        .is_err());
        // transformers 5 writes num_local_experts for Qwen3-MoE too (the oracle fixtures do)
        let c = ModelConfig::parse(
            r#"{"model_type":"qwen3_moe","vocab_size":1,"num_hidden_layers":1,"num_experts_per_tok":1,"num_local_experts":4}"#,
        )
        .unwrap();
        assert_eq!(c.num_experts, 4);
    }

    #[test]
    fn the_root_digest_is_recomputed_as_format_md_says() {
        let a = "a".repeat(64);
        let body =
            format!("manifest_version = 2\n[[files]]\nname = \"b\"\nsize = 1\nsha256 = \"{a}\"\n");
        let text = format!("root_digest = \"x\"\n{body}");
        let m = Manifest::parse(&text).unwrap();
        assert_eq!(m.recompute_root(), sha256_hex(body.as_bytes()));
    }
}
