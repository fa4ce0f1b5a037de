//! Manifest validation, the root digest as documented in docs/FORMAT.md, and diffs.

use jnf_format::MatrixRole;
use tarfa_manifest::hash::{blake3_hex, sha256_hex};
use tarfa_manifest::*;

fn expert(layer: u32, e: u32, bytes: &[u8]) -> ExpertRecord {
    let name = format!("model.layers.{layer}.mlp.experts.{e}");
    let n = bytes.len() as u64 / 3;
    let mats = MatrixRole::ORDER
        .iter()
        .enumerate()
        .map(|(i, &role)| MatrixRecord {
            role,
            name: format!("{name}.{}_proj.weight", role.as_str()),
            dtype: "BF16".into(),
            shape: vec![n / 2],
            offset: i as u64 * n,
            length: n,
        })
        .collect();
    ExpertRecord {
        name,
        layer,
        expert: e,
        length: bytes.len() as u64,
        sha256: sha256_hex(bytes),
        blake3: blake3_hex(bytes),
        nonfinite: 0,
        matrices: mats,
    }
}

fn sample() -> Manifest {
    let emb = vec![1u8; 32];
    let mut m = Manifest {
        manifest_version: 1,
        format_version: "1.0".into(),
        converter: "test".into(),
        root_digest: String::new(),
        source: Default::default(),
        shards: vec![ShardRecord {
            name: "model.safetensors".into(),
            size: 100,
            sha256: sha256_hex(b"shard"),
        }],
        files: vec![FileRecord {
            name: "config.json".into(),
            size: 2,
            sha256: sha256_hex(b"{}"),
        }],
        tensors: vec![TensorRecord {
            name: "model.embed_tokens.weight".into(),
            dtype: "BF16".into(),
            shape: vec![4, 4],
            length: 32,
            sha256: sha256_hex(&emb),
            blake3: blake3_hex(&emb),
            nonfinite: 0,
        }],
        experts: (0..2)
            .flat_map(|l| (0..4).map(move |e| expert(l, e, &[(l * 4 + e) as u8; 24])))
            .collect(),
    };
    m.root_digest = m.compute_root_digest();
    m
}

#[test]
fn round_trip_through_toml() {
    let m = sample();
    let text = m.to_toml();
    let back = Manifest::parse(&text).unwrap();
    assert_eq!(back, m);
    back.check_root().unwrap();
}

#[test]
fn root_digest_is_sha256_of_sorted_sha256sum_lines() {
    let m = sample();
    // Recompute the documented way, independently of the crate's implementation.
    let mut lines = vec![
        format!("{}  model.safetensors", sha256_hex(b"shard")),
        format!("{}  config.json", sha256_hex(b"{}")),
        format!("{}  model.embed_tokens.weight", sha256_hex(&[1u8; 32])),
    ];
    for l in 0..2u8 {
        for e in 0..4u8 {
            lines.push(format!(
                "{}  model.layers.{l}.mlp.experts.{e}",
                sha256_hex(&[l * 4 + e; 24])
            ));
        }
    }
    lines.sort();
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    assert_eq!(m.root_digest, sha256_hex(text.as_bytes()));
}

#[test]
fn tampered_entry_breaks_root() {
    let mut m = sample();
    m.experts[3].sha256 = sha256_hex(b"other");
    assert!(matches!(
        m.check_root(),
        Err(ManifestError::RootMismatch { .. })
    ));
}

/// A corruption of a valid manifest, and the error its validation must report.
type Case = (Box<dyn Fn(&mut Manifest)>, fn(&ManifestError) -> bool);

#[test]
fn rules() {
    let cases: Vec<Case> = vec![
        (Box::new(|m| m.manifest_version = 2), |e| {
            matches!(e, ManifestError::UnsupportedVersion(2))
        }),
        (Box::new(|m| m.root_digest = "xyz".into()), |e| {
            matches!(e, ManifestError::BadDigest { .. })
        }),
        (Box::new(|m| m.tensors[0].sha256 = "A".repeat(64)), |e| {
            matches!(e, ManifestError::BadDigest { .. })
        }),
        (
            Box::new(|m| m.experts[0].blake3.pop().map(|_| ()).unwrap()),
            |e| matches!(e, ManifestError::BadDigest { .. }),
        ),
        (
            Box::new(|m| m.files[0].name = "../config.json".into()),
            |e| matches!(e, ManifestError::UnsafeFileName(_)),
        ),
        (Box::new(|m| m.shards[0].name = "/etc/passwd".into()), |e| {
            matches!(e, ManifestError::UnsafeFileName(_))
        }),
        (Box::new(|m| m.shards[0].name = "..".into()), |e| {
            matches!(e, ManifestError::UnsafeFileName(_))
        }),
        (
            Box::new(|m| m.files[0].name = "model.safetensors".into()),
            |e| matches!(e, ManifestError::DuplicateName(_)),
        ),
        (
            Box::new(|m| {
                let t = m.experts[1].clone();
                m.experts.push(t)
            }),
            |e| matches!(e, ManifestError::DuplicateName(_)),
        ),
        (Box::new(|m| m.tensors[0].name = String::new()), |e| {
            matches!(e, ManifestError::InvalidName(_))
        }),
        (Box::new(|m| m.tensors[0].dtype = "F8_E4M3".into()), |e| {
            matches!(e, ManifestError::BadDtype { .. })
        }),
        (Box::new(|m| m.tensors[0].dtype = "NOPE".into()), |e| {
            matches!(e, ManifestError::BadDtype { .. })
        }),
        (
            Box::new(|m| m.experts[0].matrices[0].dtype = "F16".into()),
            |e| matches!(e, ManifestError::BadDtype { .. }),
        ),
        (Box::new(|m| m.tensors[0].length = 31), |e| {
            matches!(e, ManifestError::LengthMismatch { .. })
        }),
        (Box::new(|m| m.tensors[0].shape = vec![u64::MAX, 4]), |e| {
            matches!(e, ManifestError::LengthMismatch { .. })
        }),
        (Box::new(|m| m.experts[0].matrices.swap(0, 1)), |e| {
            matches!(e, ManifestError::BadMatrices { .. })
        }),
        (
            Box::new(|m| {
                m.experts[0].matrices.pop();
            }),
            |e| matches!(e, ManifestError::BadMatrices { .. }),
        ),
        (Box::new(|m| m.experts[0].matrices[1].offset = 9), |e| {
            matches!(e, ManifestError::BadMatrices { .. })
        }),
        (Box::new(|m| m.experts[0].length = 25), |e| {
            matches!(e, ManifestError::BadMatrices { .. })
        }),
        (Box::new(|m| m.experts[0].layer = 5), |e| {
            matches!(e, ManifestError::NameMismatch { .. })
        }),
        (Box::new(|m| m.experts[0].expert = 3), |e| {
            matches!(e, ManifestError::NameMismatch { .. })
        }),
    ];
    for (i, (mutate, ok)) in cases.iter().enumerate() {
        let mut m = sample();
        mutate(&mut m);
        let err = Manifest::parse(&m.to_toml()).expect_err(&format!("case {i} should fail"));
        assert!(ok(&err), "case {i}: unexpected error {err}");
    }
}

#[test]
fn not_toml() {
    assert!(matches!(
        Manifest::parse("manifest_version = ["),
        Err(ManifestError::Toml(_))
    ));
    assert!(matches!(
        Manifest::parse("x = 1"),
        Err(ManifestError::Toml(_))
    ));
    let e = Manifest::parse("\u{0}\u{1}garbage").unwrap_err();
    assert!(!e.to_string().contains('\n'), "errors are one line: {e}");
}

#[test]
fn diff_reports_exactly_the_changed_expert() {
    let a = sample();
    let mut b = sample();
    b.experts[5] = expert(1, 1, &[99u8; 24]);
    let d = diff(&a, &b);
    assert_eq!(d.changed.len(), 1);
    assert_eq!(d.changed[0].name, "model.layers.1.mlp.experts.1");
    assert_eq!(d.changed[0].change, ChangeKind::Bytes);
    assert_eq!(d.changed[0].kind, EntryKind::Expert);
    assert!(d.added.is_empty() && d.removed.is_empty());
    assert_eq!(d.unchanged, 2 + 7); // config.json, embed_tokens, 7 experts
    assert_eq!(d.per_layer[&LayerKey::Layer(1)].changed, 1);
    assert_eq!(d.per_layer[&LayerKey::Layer(0)].unchanged, 4);
    assert!(diff(&a, &a).is_empty());
}

#[test]
fn diff_added_removed_shape_and_dtype() {
    let a = sample();
    let mut b = sample();
    b.experts.pop();
    b.experts.push(expert(2, 0, &[7u8; 24]));
    b.tensors[0].shape = vec![2, 8];
    b.files[0].sha256 = sha256_hex(b"{\"a\":1}");
    b.tensors.push(TensorRecord {
        dtype: "F32".into(),
        name: "model.norm.weight".into(),
        ..a.tensors[0].clone()
    });
    let mut c = sample();
    c.tensors[0].dtype = "F16".into();
    let d = diff(&a, &b);
    assert_eq!(
        d.added,
        vec!["model.layers.2.mlp.experts.0", "model.norm.weight"]
    );
    assert_eq!(d.removed, vec!["model.layers.1.mlp.experts.3"]);
    let kinds: Vec<_> = d
        .changed
        .iter()
        .map(|c| (c.name.as_str(), c.change.clone()))
        .collect();
    assert!(kinds.contains(&("config.json", ChangeKind::Bytes)));
    assert!(kinds.contains(&(
        "model.embed_tokens.weight",
        ChangeKind::Shape {
            from: vec![4, 4],
            to: vec![2, 8]
        }
    )));
    let d2 = diff(&a, &c);
    assert_eq!(
        d2.changed[0].change,
        ChangeKind::Dtype {
            from: "BF16".into(),
            to: "F16".into()
        }
    );
    // Expert width change shows as a shape change.
    let mut e = sample();
    e.experts[0].matrices[0].shape = vec![3, 1];
    let d3 = diff(&a, &e);
    assert!(matches!(d3.changed[0].change, ChangeKind::Shape { .. }));
}

#[test]
fn layer_names() {
    assert_eq!(layer_of("model.layers.12.mlp.experts.3"), Some(12));
    assert_eq!(layer_of("model.embed_tokens.weight"), None);
    assert_eq!(layer_of("model.layers.x.y"), None);
}
