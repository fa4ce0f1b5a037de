//! Manifest version 3 (format version 2): every expert's codec, stored length and stored
//! BLAKE3, each rule broken once; the version pair; a newer format named before its schema.

use jnf_format::MatrixRole;
use tarfa_manifest::hash::{blake3_hex, sha256_hex};
use tarfa_manifest::*;

/// Expert `e` of layer 0: 3 x 1024 bytes decoded, stored `stored` (encoded when smaller).
fn expert(e: u32, stored: u64) -> ExpertRecord {
    let name = format!("model.layers.0.mlp.experts.{e}");
    let bytes = vec![e as u8; 3072];
    let encoded = stored < 3072;
    ExpertRecord {
        name: name.clone(),
        layer: 0,
        expert: e,
        offset: 4096 * (2 + e as u64),
        length: 3072,
        padded_length: 4096,
        sha256: sha256_hex(&bytes),
        blake3: blake3_hex(&bytes),
        codec: Some(if encoded { "exp-zstd" } else { "raw" }.into()),
        stored_length: Some(stored),
        stored_blake3: Some(if encoded {
            blake3_hex(b"stored")
        } else {
            blake3_hex(&bytes)
        }),
        matrices: MatrixRole::ORDER
            .iter()
            .enumerate()
            .map(|(i, &role)| MatrixRecord {
                role,
                name: format!("{name}.{}_proj.weight", role.as_str()),
                dtype: "BF16".into(),
                shape: vec![16, 32],
                offset: i as u64 * 1024,
                length: 1024,
            })
            .collect(),
        ..Default::default()
    }
}

fn v3() -> Manifest {
    let mut m = Manifest {
        root_digest: String::new(),
        computed_root: String::new(),
        manifest_version: MANIFEST_VERSION_CODECS,
        format_version: "2.0".into(),
        contract_version: CONTRACT_VERSION,
        converter: "test".into(),
        header: HeaderRecord {
            length: 1000,
            sha256: sha256_hex(b"header"),
        },
        source: Default::default(),
        shards: Vec::new(),
        files: Vec::new(),
        tensors: Vec::new(),
        experts: vec![expert(0, 2000), expert(1, 3072)],
    };
    m.seal();
    m
}

#[test]
fn a_version_3_manifest_round_trips_and_writes_its_storage_fields() {
    let m = v3();
    let text = m.to_toml();
    assert!(text.contains("\nmanifest_version = 3\nformat_version = \"2.0\"\n"));
    assert!(text.contains("codec = \"exp-zstd\"\nstored_length = 2000\nstored_blake3 = "));
    let back = Manifest::parse(&text).unwrap();
    assert_eq!(back, m);
    back.check_root().unwrap();
    assert_eq!(manifest_version_for(1), Some(2));
    assert_eq!(manifest_version_for(2), Some(3));
    assert_eq!(manifest_version_for(3), None);
}

/// The storage fields are bound by the root like every other field.
#[test]
fn the_root_binds_the_storage_fields() {
    for edit in [
        |m: &mut Manifest| m.experts[0].stored_length = Some(2001),
        |m: &mut Manifest| m.experts[0].stored_blake3 = Some(blake3_hex(b"other")),
    ] {
        let mut m = v3();
        edit(&mut m);
        let back = Manifest::parse(&m.to_toml()).unwrap();
        assert!(matches!(
            back.check_root(),
            Err(ManifestError::RootMismatch { .. })
        ));
    }
}

type Case = (&'static str, Box<dyn Fn(&mut Manifest)>, &'static str);

#[test]
fn every_storage_rule_is_checked() {
    let cases: Vec<Case> = vec![
        (
            "a v3 expert without its codec",
            Box::new(|m| m.experts[0].codec = None),
            "records its codec",
        ),
        (
            "a v3 expert without its stored_blake3",
            Box::new(|m| m.experts[1].stored_blake3 = None),
            "records its codec",
        ),
        (
            "an unknown codec",
            Box::new(|m| m.experts[0].codec = Some("lz4".into())),
            "unknown codec",
        ),
        (
            "a raw extent stored in fewer bytes",
            Box::new(|m| m.experts[1].stored_length = Some(3000)),
            "is not its length",
        ),
        (
            "a raw extent whose stored_blake3 is another",
            Box::new(|m| m.experts[1].stored_blake3 = Some(blake3_hex(b"x"))),
            "is not its blake3",
        ),
        (
            "an encoded extent no smaller than its bytes",
            Box::new(|m| m.experts[0].stored_length = Some(3072)),
            "is not possible",
        ),
        (
            "an encoded extent shorter than any encoding",
            Box::new(|m| m.experts[0].stored_length = Some(16 + 1536)),
            "is not possible",
        ),
    ];
    for (what, edit, says) in cases {
        let mut m = v3();
        edit(&mut m);
        match Manifest::parse(&m.to_toml()) {
            Err(ManifestError::BadStorage { why, .. }) => {
                assert!(why.contains(says), "{what}: {why}")
            }
            other => panic!("{what}: {other:?}"),
        }
    }
    // a stored_blake3 that is not a digest
    let mut m = v3();
    m.experts[0].stored_blake3 = Some("xyz".into());
    assert!(matches!(
        Manifest::parse(&m.to_toml()),
        Err(ManifestError::BadDigest {
            field: "stored_blake3",
            ..
        })
    ));
    // padded_length follows the stored length
    let mut m = v3();
    m.experts[0].stored_length = Some(5000);
    m.experts[0].length = 6144;
    for mm in &mut m.experts[0].matrices {
        mm.shape = vec![32, 32];
        mm.length = 2048;
    }
    m.experts[0].matrices[1].offset = 2048;
    m.experts[0].matrices[2].offset = 4096;
    assert!(matches!(
        Manifest::parse(&m.to_toml()),
        Err(ManifestError::BadPlacement { .. })
    ));
    m.experts[0].padded_length = 8192;
    Manifest::parse(&m.to_toml()).unwrap();
}

#[test]
fn a_version_2_manifest_has_no_storage_fields() {
    let mut m = v3();
    m.manifest_version = 2;
    m.format_version = "1.0".into();
    match Manifest::parse(&m.to_toml()) {
        Err(ManifestError::BadStorage { why, .. }) => {
            assert!(why.contains("manifest_version 3 fields"), "{why}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_manifest_version_goes_with_the_format_version() {
    for (mv, fv) in [(2, "2.0"), (3, "1.0")] {
        let mut m = v3();
        m.manifest_version = mv;
        m.format_version = fv.into();
        for e in &mut m.experts {
            if mv == 2 {
                (e.codec, e.stored_length, e.stored_blake3) = (None, None, None);
                e.padded_length = 4096;
            }
        }
        let err = Manifest::parse(&m.to_toml()).unwrap_err();
        assert!(
            matches!(err, ManifestError::VersionPair { manifest_version, .. } if manifest_version == mv),
            "{mv} {fv}: {err}"
        );
    }
    let mut m = v3();
    m.format_version = "two".into();
    assert_eq!(
        Manifest::parse(&m.to_toml()).unwrap_err(),
        ManifestError::BadFormatVersion("two".into())
    );
}

#[test]
fn a_newer_format_is_named_before_its_schema_is_judged() {
    // A manifest from a future format: a new version, fields this build has never heard of.
    let text = v3()
        .to_toml()
        .replace("format_version = \"2.0\"", "format_version = \"3.0\"")
        .replace("manifest_version = 3", "manifest_version = 4")
        + "[future]\nfield = 1\n";
    let err = Manifest::parse(&text).unwrap_err();
    assert_eq!(
        err.to_string(),
        "format version 3.0 is newer than this reader (2.0); read it with a newer Tarfa"
    );
    // and a newer minor version of one it reads
    let text = v3()
        .to_toml()
        .replace("format_version = \"2.0\"", "format_version = \"2.1\"");
    assert!(matches!(
        Manifest::parse(&text),
        Err(ManifestError::FormatVersion(
            jnf_format::JnfError::NewerVersion {
                major: 2,
                minor: 1,
                ..
            }
        ))
    ));
}
