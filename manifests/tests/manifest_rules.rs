//! Manifest validation, the root digest as documented in docs/FORMAT.md, and diffs.

use jnf_format::MatrixRole;
use tarfa_manifest::hash::{blake3_hex, sha256_hex};
use tarfa_manifest::*;

fn expert(layer: u32, e: u32, bytes: &[u8]) -> ExpertRecord {
    let offset = 8192 + 4096 * (layer as u64 * 4 + e as u64);
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
        relayout: None,
        sources: Vec::new(),
        codec: None,
        stored_length: None,
        stored_blake3: None,
        name,
        layer,
        expert: e,
        offset,
        length: bytes.len() as u64,
        padded_length: 4096,
        sha256: sha256_hex(bytes),
        blake3: blake3_hex(bytes),
        nonfinite: 0,
        matrices: mats,
    }
}

fn sample() -> Manifest {
    let emb = vec![1u8; 32];
    let mut m = Manifest {
        root_digest: String::new(),
        computed_root: String::new(),
        manifest_version: 2,
        format_version: "1.0".into(),
        contract_version: CONTRACT_VERSION,
        converter: "test".into(),
        header: HeaderRecord {
            length: 1000,
            sha256: sha256_hex(b"header"),
        },
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
            offset: 4096,
            length: 32,
            sha256: sha256_hex(&emb),
            blake3: blake3_hex(&emb),
            nonfinite: 0,
        }],
        experts: (0..2)
            .flat_map(|l| (0..4).map(move |e| expert(l, e, &[(l * 4 + e) as u8; 24])))
            .collect(),
    };
    m.seal();
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
fn root_digest_is_sha256_of_the_lines_after_the_first() {
    let m = sample();
    let text = m.to_toml();
    // Recompute the documented way (`tail -n +2 manifest.toml | sha256sum`), independently of
    // the crate's implementation.
    let (first, body) = text.split_once('\n').unwrap();
    assert_eq!(
        first,
        format!("root_digest = \"{}\"", sha256_hex(body.as_bytes()))
    );
    assert_eq!(m.root_digest, sha256_hex(body.as_bytes()));
    assert!(body.starts_with("manifest_version = 2\n"), "{body}");
}

#[test]
fn tampered_entry_breaks_root() {
    let mut m = sample();
    m.experts[3].sha256 = sha256_hex(b"other");
    // Written with the old root line and read back, as a reader sees it.
    let back = Manifest::parse(&m.to_toml()).unwrap();
    assert!(matches!(
        back.check_root(),
        Err(ManifestError::RootMismatch { .. })
    ));
    m.seal();
    Manifest::parse(&m.to_toml()).unwrap().check_root().unwrap();
}

/// Every field the runtime trusts is bound: an edit of any of them, written back with the
/// original root line, parses but fails check_root.
#[test]
fn root_binds_every_field() {
    type Edit = Box<dyn Fn(&mut Manifest)>;
    let edits: Vec<(&str, Edit)> = vec![
        (
            "tensor blake3",
            Box::new(|m| m.tensors[0].blake3 = blake3_hex(b"x")),
        ),
        (
            "expert blake3",
            Box::new(|m| m.experts[2].blake3 = blake3_hex(b"x")),
        ),
        (
            "tensor dtype",
            Box::new(|m| m.tensors[0].dtype = "F16".into()),
        ),
        (
            "tensor shape",
            Box::new(|m| m.tensors[0].shape = vec![2, 8]),
        ),
        ("tensor offset", Box::new(|m| m.tensors[0].offset = 8192)),
        ("expert offset", Box::new(|m| m.experts[1].offset = 65536)),
        ("shard size", Box::new(|m| m.shards[0].size = 101)),
        (
            "header sha256",
            Box::new(|m| m.header.sha256 = sha256_hex(b"other")),
        ),
        ("header length", Box::new(|m| m.header.length = 999)),
        (
            "file sha256",
            Box::new(|m| m.files[0].sha256 = sha256_hex(b"[]")),
        ),
        ("contract version", Box::new(|m| m.contract_version = 7)),
        // "1.00" is version 1.0 spelled otherwise: it parses, and the root still moves.
        (
            "format version",
            Box::new(|m| m.format_version = "1.00".into()),
        ),
        ("nonfinite", Box::new(|m| m.tensors[0].nonfinite = 3)),
        (
            "source",
            Box::new(|m| {
                m.source.insert("kind".into(), "hub".into());
            }),
        ),
    ];
    let original = sample();
    for (what, edit) in edits {
        let mut m = original.clone();
        edit(&mut m);
        let text = m.to_toml(); // still the original root line
        let back = Manifest::parse(&text).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(
            matches!(back.check_root(), Err(ManifestError::RootMismatch { .. })),
            "{what}: an edit kept the root"
        );
        // Even a comment or a blank line changes the root: nothing is canonicalised.
    }
    let mut text = original.to_toml();
    text.push_str("# a comment\n");
    assert!(Manifest::parse(&text).unwrap().check_root().is_err());
}

#[test]
fn first_line_must_be_the_root_line() {
    let body = sample().body_toml();
    let good = sample().to_toml();
    for bad in [
        body.clone(),                                              // no root line
        format!("root_digest = \"{}\"\n{body}", "A".repeat(64)),   // uppercase
        format!("root_digest =  \"{}\"\n{body}", "a".repeat(64)),  // two spaces
        format!("root_digest = \"{}\"\r\n{body}", "a".repeat(64)), // CRLF
        format!("\n{good}"),                                       // blank first line
        format!("root_digest = \"{}\"", "a".repeat(64)),           // nothing after
    ] {
        let e = Manifest::parse(&bad).expect_err(&bad[..40.min(bad.len())]);
        assert!(
            matches!(e, ManifestError::BadRootLine | ManifestError::Toml(_)),
            "{e}"
        );
    }
    // A second root_digest key in the body is an unknown field, never a second root.
    let twice = format!("{good}root_digest = \"{}\"\n", "a".repeat(64));
    assert!(Manifest::parse(&twice).is_err());
}

#[test]
fn version_1_is_refused_with_advice() {
    // A v1 manifest: root_digest further down, covering only the SHA-256 lines.
    let v1 = format!(
        "manifest_version = 1\nformat_version = \"1.0\"\nconverter = \"x\"\nroot_digest = \"{}\"\n",
        "a".repeat(64)
    );
    let e = Manifest::parse(&v1).unwrap_err();
    assert_eq!(e, ManifestError::LegacyVersion(1));
    let msg = e.to_string();
    assert!(
        msg.contains("re-convert") && msg.contains("manifest_version 1"),
        "{msg}"
    );
    // The same fields under a v2-looking root line.
    let hybrid = format!("root_digest = \"{}\"\n{v1}", "a".repeat(64));
    assert!(matches!(
        Manifest::parse(&hybrid),
        Err(ManifestError::LegacyVersion(1))
    ));
}

#[test]
fn header_record_of_a_container_prefix() {
    let json = br#"{"a":1}"#;
    let mut c = b"TARFAJNF\x01\x00\x00\x00\x00\x00\x00\x00".to_vec();
    c.extend_from_slice(&(json.len() as u64).to_le_bytes());
    c.extend_from_slice(json);
    c.extend_from_slice(&[0u8; 100]);
    let r = HeaderRecord::of_container_prefix(&c).unwrap();
    assert_eq!(r.length, 7);
    assert_eq!(r.sha256, sha256_hex(json));
    assert!(HeaderRecord::of_container_prefix(&c[..30]).is_none());
}

/// A corruption of a valid manifest, and the error its validation must report.
type Case = (Box<dyn Fn(&mut Manifest)>, fn(&ManifestError) -> bool);

#[test]
fn rules() {
    let cases: Vec<Case> = vec![
        (Box::new(|m| m.manifest_version = 4), |e| {
            matches!(e, ManifestError::UnsupportedVersion(4))
        }),
        (Box::new(|m| m.manifest_version = 1), |e| {
            matches!(e, ManifestError::LegacyVersion(1))
        }),
        (Box::new(|m| m.header.sha256 = "x".into()), |e| {
            matches!(e, ManifestError::BadDigest { .. })
        }),
        (
            Box::new(|m| m.tensors[0].name = "model.norm\u{202E}thgiew".into()),
            |e| matches!(e, ManifestError::InvalidName(_)),
        ),
        (
            Box::new(|m| m.experts[0].matrices[0].name = "a\u{2066}b".into()),
            |e| matches!(e, ManifestError::InvalidName(_)),
        ),
        (
            Box::new(|m| m.files[0].name = "config\u{200F}.json".into()),
            |e| matches!(e, ManifestError::UnsafeFileName(_)),
        ),
        (
            Box::new(|m| m.shards[0].name = "m\u{061C}.safetensors".into()),
            |e| matches!(e, ManifestError::UnsafeFileName(_)),
        ),
        (Box::new(|m| m.tensors[0].name = "a\u{7}b".into()), |e| {
            matches!(e, ManifestError::InvalidName(_))
        }),
        (Box::new(|m| m.tensors[0].offset = 4097), |e| {
            matches!(e, ManifestError::BadPlacement { .. })
        }),
        (Box::new(|m| m.experts[0].offset = 100), |e| {
            matches!(e, ManifestError::BadPlacement { .. })
        }),
        (Box::new(|m| m.experts[0].padded_length = 24), |e| {
            matches!(e, ManifestError::BadPlacement { .. })
        }),
        (Box::new(|m| m.root_digest = "xyz".into()), |e| {
            matches!(e, ManifestError::BadRootLine)
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
        // U8 is only an MXFP4 expert part, never a tensor or a gate/up/down.
        (Box::new(|m| m.tensors[0].dtype = "U8".into()), |e| {
            matches!(e, ManifestError::BadDtype { .. })
        }),
        (
            Box::new(|m| m.experts[0].matrices[0].dtype = "U8".into()),
            |e| matches!(e, ManifestError::BadDtype { .. }),
        ),
        // A fused expert's source ranges must add up to its length, and a relayout must be a
        // declared permutation of BF16 fused sources.
        (
            Box::new(|m| {
                m.experts[0].sources = vec![SourceRange {
                    tensor: "model.layers.0.mlp.experts.gate_up_proj".into(),
                    shard: "model.safetensors".into(),
                    offset: 8,
                    length: 23,
                }]
            }),
            |e| matches!(e, ManifestError::BadMatrices { .. }),
        ),
        (
            Box::new(|m| {
                m.experts[0].sources = vec![SourceRange {
                    tensor: "model.layers.0.mlp.experts.gate_up_proj".into(),
                    shard: "model.safetensors".into(),
                    offset: 8,
                    length: 24,
                }];
                m.experts[0].relayout = Some("transpose".into());
            }),
            |e| matches!(e, ManifestError::BadMatrices { .. }),
        ),
        (
            Box::new(|m| m.experts[0].relayout = Some("gate_up_interleaved_columns".into())),
            |e| matches!(e, ManifestError::BadMatrices { .. }),
        ),
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
    let root = format!("root_digest = \"{}\"\n", "a".repeat(64));
    assert!(matches!(
        Manifest::parse(&format!("{root}manifest_version = [")),
        Err(ManifestError::Toml(_))
    ));
    assert!(matches!(
        Manifest::parse(&format!("{root}x = 1")),
        Err(ManifestError::Toml(_))
    ));
    assert!(matches!(
        Manifest::parse("manifest_version = ["),
        Err(ManifestError::BadRootLine)
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
