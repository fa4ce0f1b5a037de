//! The synthetic shapes' bytes, pinned. Benchmarks and figures in docs/ were measured on these
//! bytes: a change to the generator that moves any of them (another tensor kind, order, scale,
//! name or config) must be a decision, so these digests were taken from the generator as it was
//! before its tensors came from tarfa-core's rules, and must never be updated to fit a change.

use sha2::{Digest, Sha256};
use tarfa_convert::synth::{self, OutputFormat, SynthOptions};
use tarfa_manifest::hash::to_hex;
use tarfa_manifest::Manifest;

/// Bytes of each tensor's start that go into the digest: enough to fix its kind and scale
/// (the first row of a router holds the skewed dimensions, of an embedding the massive ones).
const PREFIX: usize = 256;

fn shape(name: &str) -> synth::SynthShape {
    synth::shapes()
        .into_iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("shape {name}"))
}

/// SHA-256 over the config.json bytes, then every tensor in state-dict order: its name, its
/// shape, and its first [`PREFIX`] bytes (seed 1, skew 1).
fn listing_digest(s: &synth::SynthShape) -> String {
    let mut h = Sha256::new();
    h.update(serde_json::to_vec_pretty(&s.config_json()).unwrap());
    for t in s.tensors().unwrap() {
        h.update(t.name.as_bytes());
        h.update([0]);
        for d in &t.shape {
            h.update(d.to_le_bytes());
        }
        let mut b = vec![0u8; (t.len_bytes() as usize).min(PREFIX)];
        t.fill(1, 1.0, &mut b);
        h.update(&b);
    }
    to_hex(&h.finalize())
}

#[test]
fn every_existing_shape_lists_the_same_tensors_with_the_same_bytes() {
    let pinned = [
        (
            "qwen3-30b-a3b",
            "5c322aca32a31aef8068a02457942fe614c71f31d89d75a394e93bfc5283fb44",
        ),
        (
            "qwen3-235b-a22b",
            "084e5b7509d250c9a980f7b719444c6d61967498a776fa1cd7ed12dca8b8bb06",
        ),
        (
            "mixtral-8x7b",
            "409a6b5bc29230e4971ac6807fe23aee7041a1a8fafbf2e3ff4cf6821a102987",
        ),
        (
            "tiny",
            "628419d825db64a106ed4d3189afed13550079eda3b2ea712c15d77375d467b2",
        ),
    ];
    let got: Vec<(&str, String)> = pinned
        .iter()
        .map(|&(name, _)| (name, listing_digest(&shape(name))))
        .collect();
    let want: Vec<(&str, String)> = pinned.iter().map(|&(n, d)| (n, d.to_string())).collect();
    assert_eq!(got, want);
}

/// The whole of the `tiny` bundle, every byte of every tensor through its manifest's root
/// digest (which binds every hash, shape, offset and copied file).
#[test]
fn the_tiny_bundle_is_the_same_bundle() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("b");
    let opts = SynthOptions {
        shape: shape("tiny"),
        seed: 7,
        skew: 1.0,
        format: OutputFormat::Bundle,
        shard_bytes: 1 << 30,
        force: false,
    };
    synth::synth(&out, &opts).unwrap();
    let m = Manifest::load(&out.join("manifest.toml")).unwrap();
    assert_eq!(
        m.root_digest,
        "f5064e542180c361a00fae940326cefb619911a883e2ffd7c890637726dfbd6b"
    );
}
