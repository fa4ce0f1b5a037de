//! The runtime's verification report (`tarfa-run generate --verify-report FILE`) and its
//! cross-check against the bundle's `manifest.toml`: every tensor and expert the run used is
//! listed, with the manifest's digest and byte count, and was verified before use.
//!
//! Format: `{"root_digest": hex, "root_recomputed": bool, "files": [...] (optional),
//!  "tensors": [{"name", "bytes", "algorithm": "sha256"|"blake3", "digest", "verified_before_use"}],
//!  "experts": [{"name", "bytes", "algorithm", "digest", "reads", "verified_before_use"}],
//!  "unverified_uses": 0}`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

use anyhow::{anyhow, Context, Result};
use rayon::prelude::*;
use serde::Deserialize;

use crate::bundle::{blake3_hex, jnf_regions, read_region, sha256_hex, Manifest};

#[derive(Clone, Debug, Deserialize)]
pub struct TensorUse {
    pub name: String,
    pub bytes: u64,
    pub algorithm: String,
    pub digest: String,
    pub verified_before_use: bool,
}

#[derive(Clone, Debug, Deserialize)]
pub struct ExpertUse {
    pub name: String,
    pub bytes: u64,
    pub algorithm: String,
    pub digest: String,
    pub reads: u64,
    pub verified_before_use: bool,
}

/// A copied file the run read (config.json, tokenizer.json, ...), checked by SHA-256.
#[derive(Clone, Debug, Deserialize)]
pub struct FileUse {
    pub name: String,
    pub bytes: u64,
    pub algorithm: String,
    pub digest: String,
    pub verified_before_use: bool,
}

#[derive(Clone, Debug, Deserialize)]
pub struct VerifyReport {
    pub root_digest: String,
    pub root_recomputed: bool,
    /// Copied files the run read (optional in the format: a run may read none but config.json).
    #[serde(default)]
    pub files: Vec<FileUse>,
    pub tensors: Vec<TensorUse>,
    pub experts: Vec<ExpertUse>,
    pub unverified_uses: u64,
}

impl VerifyReport {
    pub fn parse(text: &str) -> Result<VerifyReport> {
        serde_json::from_str(text).map_err(|e| anyhow!("verify report: {e}"))
    }

    pub fn read(path: &Path) -> Result<VerifyReport> {
        Self::parse(&fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?)
    }

    /// Bytes the report says were verified.
    pub fn bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.bytes).sum::<u64>()
            + self.experts.iter().map(|e| e.bytes).sum::<u64>()
    }
}

/// What the cross-check found.
#[derive(Clone, Debug, Default)]
pub struct ReportFindings {
    pub files: usize,
    pub tensors: usize,
    pub experts: usize,
    pub bytes: u64,
    /// Experts the router trace says were used, all of which the report covers when this holds.
    pub traced_experts: usize,
    pub violations: Vec<String>,
    pub violation_count: usize,
}

impl ReportFindings {
    fn violate(&mut self, msg: String) {
        self.violation_count += 1;
        if self.violations.len() < 8 {
            self.violations.push(msg);
        }
    }

    pub fn held(&self) -> bool {
        self.violation_count == 0
    }
}

/// The manifest's digest of an entry under `algorithm`, if it records one.
fn manifest_digest<'a>(
    sha256: &'a str,
    blake3: Option<&'a str>,
    algorithm: &str,
) -> Option<&'a str> {
    match algorithm {
        "sha256" => Some(sha256),
        "blake3" => blake3,
        _ => None,
    }
}

/// Cross-check `report` against `manifest`. `used_experts` are the (layer, expert) pairs the
/// router trace of the same run chose: each must be listed with at least one verified read.
/// Every non-expert tensor of the manifest must be listed (every forward pass uses them all).
pub fn check_report(
    report: &VerifyReport,
    manifest: &Manifest,
    used_experts: &[(u32, u32)],
) -> ReportFindings {
    let mut f = ReportFindings {
        files: report.files.len(),
        tensors: report.tensors.len(),
        experts: report.experts.len(),
        bytes: report.bytes(),
        traced_experts: used_experts.len(),
        ..Default::default()
    };
    if report.root_digest != manifest.root_digest {
        f.violate(format!(
            "report root {} != manifest root {}",
            report.root_digest, manifest.root_digest
        ));
    }
    if !report.root_recomputed {
        f.violate("the runtime did not recompute the root digest".into());
    }
    let recomputed = manifest.recompute_root();
    if recomputed != manifest.root_digest {
        f.violate(format!(
            "manifest.toml's entries hash to root {recomputed}, not its recorded {}",
            manifest.root_digest
        ));
    }
    if report.unverified_uses != 0 {
        f.violate(format!("{} unverified uses", report.unverified_uses));
    }

    for file in &report.files {
        let Some(m) = manifest.files.iter().find(|m| m.name == file.name) else {
            f.violate(format!("file {} is not in manifest.toml", file.name));
            continue;
        };
        if file.algorithm != "sha256" || file.digest != m.sha256 || file.bytes != m.size {
            f.violate(format!(
                "file {}: {} {} of {} bytes, manifest sha256 {} of {} bytes",
                file.name, file.algorithm, file.digest, file.bytes, m.sha256, m.size
            ));
        }
        if !file.verified_before_use {
            f.violate(format!(
                "file {} was used before it was verified",
                file.name
            ));
        }
    }

    let tensors = manifest.tensor_map();
    let mut seen = BTreeSet::new();
    for t in &report.tensors {
        if !seen.insert(t.name.as_str()) {
            f.violate(format!("tensor {} listed twice", t.name));
        }
        let Some(m) = tensors.get(t.name.as_str()) else {
            f.violate(format!("tensor {} is not in manifest.toml", t.name));
            continue;
        };
        if t.bytes != m.length {
            f.violate(format!(
                "tensor {}: {} bytes, manifest says {}",
                t.name, t.bytes, m.length
            ));
        }
        match manifest_digest(&m.sha256, m.blake3.as_deref(), &t.algorithm) {
            None => f.violate(format!(
                "tensor {}: algorithm `{}` has no manifest digest",
                t.name, t.algorithm
            )),
            Some(d) if d != t.digest => f.violate(format!(
                "tensor {}: {} {} != manifest {d}",
                t.name, t.algorithm, t.digest
            )),
            _ => {}
        }
        if !t.verified_before_use {
            f.violate(format!("tensor {} was used before it was verified", t.name));
        }
    }
    let missing: Vec<&str> = tensors
        .keys()
        .filter(|n| !seen.contains(*n))
        .copied()
        .collect();
    if !missing.is_empty() {
        f.violate(format!(
            "{} manifest tensors are not in the report (every forward uses them): {}",
            missing.len(),
            missing
                .iter()
                .take(4)
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }

    let experts = manifest.expert_map();
    let mut listed: BTreeMap<&str, &ExpertUse> = BTreeMap::new();
    for e in &report.experts {
        if listed.insert(e.name.as_str(), e).is_some() {
            f.violate(format!("expert {} listed twice", e.name));
        }
        let Some(m) = experts.get(e.name.as_str()) else {
            f.violate(format!("expert {} is not in manifest.toml", e.name));
            continue;
        };
        if e.bytes != m.length {
            f.violate(format!(
                "expert {}: {} bytes, manifest says {}",
                e.name, e.bytes, m.length
            ));
        }
        match manifest_digest(&m.sha256, Some(&m.blake3), &e.algorithm) {
            None => f.violate(format!(
                "expert {}: unknown algorithm `{}`",
                e.name, e.algorithm
            )),
            Some(d) if d != e.digest => f.violate(format!(
                "expert {}: {} {} != manifest {d}",
                e.name, e.algorithm, e.digest
            )),
            _ => {}
        }
        if !e.verified_before_use {
            f.violate(format!("expert {} was used before it was verified", e.name));
        }
        if e.reads == 0 {
            f.violate(format!("expert {} is listed with 0 reads", e.name));
        }
    }
    for &(layer, expert) in used_experts {
        match manifest.expert_name(layer, expert) {
            None => f.violate(format!(
                "the router chose layer {layer} expert {expert}, which manifest.toml lacks"
            )),
            Some(name) if !listed.contains_key(name) => f.violate(format!(
                "the router chose {name}, but the report does not list it as verified"
            )),
            _ => {}
        }
    }
    f
}

/// Re-hash, from `model.jnf`, every region the report lists, with the report's algorithm, and
/// compare with the manifest. Returns the bytes hashed and the mismatches.
pub fn rehash_bundle(
    jnf: &Path,
    report: &VerifyReport,
    manifest: &Manifest,
) -> Result<(u64, Vec<String>)> {
    let regions = jnf_regions(jnf)?;
    let tensors = manifest.tensor_map();
    let experts = manifest.expert_map();
    let mut jobs: Vec<(&str, &str, Option<&str>)> = Vec::new(); // (name, algorithm, manifest digest)
    for t in &report.tensors {
        if let Some(m) = tensors.get(t.name.as_str()) {
            jobs.push((
                &t.name,
                &t.algorithm,
                manifest_digest(&m.sha256, m.blake3.as_deref(), &t.algorithm),
            ));
        }
    }
    for e in &report.experts {
        if let Some(m) = experts.get(e.name.as_str()) {
            jobs.push((
                &e.name,
                &e.algorithm,
                manifest_digest(&m.sha256, Some(&m.blake3), &e.algorithm),
            ));
        }
    }
    let results: Vec<Result<(u64, Option<String>)>> = jobs
        .par_iter()
        .map(|&(name, alg, want)| {
            let r = *regions
                .get(name)
                .ok_or_else(|| anyhow!("{name} is not in the model.jnf header"))?;
            let mut file = fs::File::open(jnf)?;
            let mut bytes = read_region(&mut file, r)?;
            // an encoded extent's digests are of its decoded bytes: decode with the format's
            // codec (a stored byte flipped may fail to decode: that is a mismatch too)
            if let Some(n) = r.encoded {
                match jnf_codec::decode(&bytes, n as usize) {
                    Ok(d) => bytes = d,
                    Err(e) => {
                        let bad = format!("{name}: model.jnf's stored extent does not decode: {e}");
                        return Ok((n, Some(bad)));
                    }
                }
            }
            let got = if alg == "blake3" {
                blake3_hex(&bytes)
            } else {
                sha256_hex(&bytes)
            };
            let bad = (Some(got.as_str()) != want).then(|| {
                format!("{name}: model.jnf bytes hash ({alg}) to {got}, manifest {want:?}")
            });
            Ok((bytes.len() as u64, bad))
        })
        .collect();
    let mut total = 0;
    let mut bad = Vec::new();
    for r in results {
        let (n, b) = r?;
        total += n;
        bad.extend(b);
    }
    Ok((total, bad))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest() -> Manifest {
        let h = |c: char| c.to_string().repeat(64);
        let mut m = Manifest::parse(&format!(
            r#"root_digest = "x"
[[files]]
name = "config.json"
size = 10
sha256 = "{}"
[[tensors]]
name = "model.norm.weight"
dtype = "BF16"
length = 256
sha256 = "{}"
blake3 = "{}"
[[experts]]
name = "model.layers.0.mlp.experts.0"
layer = 0
expert = 0
length = 4096
sha256 = "{}"
blake3 = "{}"
[[experts]]
name = "model.layers.0.mlp.experts.1"
layer = 0
expert = 1
length = 4096
sha256 = "{}"
blake3 = "{}"
"#,
            h('0'),
            h('1'),
            h('2'),
            h('3'),
            h('4'),
            h('5'),
            h('6')
        ))
        .unwrap();
        m.root_digest = m.recompute_root();
        m
    }

    fn good_report(m: &Manifest) -> serde_json::Value {
        serde_json::json!({
            "root_digest": m.root_digest, "root_recomputed": true,
            "files": [{"name": "config.json", "bytes": 10, "algorithm": "sha256",
                       "digest": "0".repeat(64), "verified_before_use": true}],
            "tensors": [{"name": "model.norm.weight", "bytes": 256, "algorithm": "sha256",
                         "digest": "1".repeat(64), "verified_before_use": true}],
            "experts": [
                {"name": "model.layers.0.mlp.experts.0", "bytes": 4096, "algorithm": "blake3",
                 "digest": "4".repeat(64), "reads": 1, "verified_before_use": true},
                {"name": "model.layers.0.mlp.experts.1", "bytes": 4096, "algorithm": "blake3",
                 "digest": "6".repeat(64), "reads": 2, "verified_before_use": true}],
            "unverified_uses": 0
        })
    }

    fn check(v: &serde_json::Value, used: &[(u32, u32)]) -> ReportFindings {
        check_report(
            &VerifyReport::parse(&v.to_string()).unwrap(),
            &manifest(),
            used,
        )
    }

    /// The good report with one change, which must produce a violation containing `needle`.
    fn assert_violates(
        change: impl FnOnce(&mut serde_json::Value),
        used: &[(u32, u32)],
        needle: &str,
    ) {
        let mut v = good_report(&manifest());
        change(&mut v);
        let f = check(&v, used);
        assert!(
            f.violations.iter().any(|x| x.contains(needle)),
            "{needle:?} not in {:?}",
            f.violations
        );
    }

    #[test]
    fn a_complete_report_holds() {
        let f = check(&good_report(&manifest()), &[(0, 0), (0, 1)]);
        assert!(f.held(), "{:?}", f.violations);
        assert_eq!((f.tensors, f.experts, f.bytes), (1, 2, 256 + 8192));
    }

    #[test]
    fn each_broken_rule_is_named() {
        let used = [(0, 0)];
        assert_violates(
            |v| v["experts"][0]["digest"] = "9".repeat(64).into(),
            &used,
            "!= manifest",
        );
        assert_violates(
            |v| v["tensors"][0]["bytes"] = 255.into(),
            &used,
            "255 bytes",
        );
        assert_violates(
            |v| v["experts"][1]["verified_before_use"] = false.into(),
            &used,
            "used before it was verified",
        );
        assert_violates(|v| v["unverified_uses"] = 3.into(), &used, "3 unverified");
        assert_violates(
            |v| v["files"][0]["bytes"] = 11.into(),
            &used,
            "file config.json",
        );
        assert_violates(
            |v| v["files"][0]["name"] = "x.json".into(),
            &used,
            "file x.json is not in manifest",
        );
        assert_violates(
            |v| v["root_recomputed"] = false.into(),
            &used,
            "did not recompute",
        );
        assert_violates(
            |v| v["root_digest"] = "0".repeat(64).into(),
            &used,
            "report root",
        );
        assert_violates(
            |v| v["tensors"][0]["algorithm"] = "md5".into(),
            &used,
            "md5",
        );
        assert_violates(|v| v["experts"][0]["reads"] = 0.into(), &used, "0 reads");
        assert_violates(
            |v| v["experts"][1]["name"] = "model.layers.0.mlp.experts.7".into(),
            &used,
            "experts.7 is not in manifest",
        );
        assert_violates(
            |v| {
                let e = v["experts"][0].clone();
                v["experts"].as_array_mut().unwrap().push(e)
            },
            &used,
            "listed twice",
        );
    }

    #[test]
    fn a_used_expert_or_tensor_missing_from_the_report_is_caught() {
        assert_violates(
            |v| {
                v["experts"].as_array_mut().unwrap().pop();
            },
            &[(0, 1)],
            "the report does not list it",
        );
        assert_violates(|_| {}, &[(3, 1)], "manifest.toml lacks");
        assert_violates(
            |v| v["tensors"] = serde_json::json!([]),
            &[],
            "manifest tensors are not in the report",
        );
    }

    #[test]
    fn a_manifest_whose_root_does_not_match_its_entries_is_caught() {
        let mut m = manifest();
        let report = VerifyReport::parse(&good_report(&m).to_string()).unwrap();
        // What an edit on disk does: the bytes after the root line are no longer the ones the
        // root was computed over.
        let edited = Manifest::parse(&format!(
            "root_digest = \"{}\"\n[[files]]\nname = \"config.json\"\nsize = 11\nsha256 = \"{}\"\n",
            m.root_digest,
            "7".repeat(64)
        ))
        .unwrap();
        m.body_sha256 = edited.body_sha256;
        let f = check_report(&report, &m, &[]);
        assert!(
            f.violations
                .iter()
                .any(|v| v.contains("entries hash to root")),
            "{:?}",
            f.violations
        );
    }
}
