//! Format version 2: encoded extents. A plan that sets an extent's storage writes version 2 and
//! places extents by their stored length; every storage rule is broken once by a crafted header;
//! a version-1 plan writes exactly the JSON it always did; the reader decodes what was stored.

use jnf_format::*;
use serde_json::{json, Value};

fn mat(name: &str, shape: &[u64]) -> MatrixSpec {
    MatrixSpec {
        name: name.into(),
        dtype: Dtype::BF16,
        shape: shape.to_vec(),
        source: None,
    }
}

/// One tensor and one layer of `experts` experts of `[rows, cols]` gate and up and `[cols,
/// rows]` down matrices.
fn plan(experts: u32, rows: u64, cols: u64) -> LayoutPlan {
    let mut plan = LayoutPlan::new();
    plan.add_tensor(TensorSpec {
        name: "model.norm.weight".into(),
        dtype: Dtype::F32,
        shape: vec![8],
        source: None,
    });
    for e in 0..experts {
        let p = format!("model.layers.0.mlp.experts.{e}");
        plan.add_expert(
            0,
            e,
            p.clone(),
            [
                mat(&format!("{p}.gate_proj.weight"), &[rows, cols]),
                mat(&format!("{p}.up_proj.weight"), &[rows, cols]),
                mat(&format!("{p}.down_proj.weight"), &[cols, rows]),
            ],
        );
    }
    plan
}

fn header_json(h: &Header) -> Value {
    let bytes = h.encode().unwrap();
    let len = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
    serde_json::from_slice(&bytes[24..24 + len]).unwrap()
}

/// A file of format `major` from header JSON `v` (data_start recomputed), zeros after it.
fn file_from(mut v: Value, major: u16) -> Vec<u8> {
    loop {
        let len = serde_json::to_vec(&v).unwrap().len() as u64;
        let start = align_up(24 + len).unwrap();
        if v["data_start"] == json!(start) {
            break;
        }
        v["data_start"] = json!(start);
    }
    let text = serde_json::to_vec(&v).unwrap();
    let mut out = Vec::new();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&major.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    out.resize(v["data_start"].as_u64().unwrap() as usize, 0);
    out.resize(v["file_size"].as_u64().unwrap() as usize, 0);
    out
}

fn parse(b: &[u8]) -> Result<Header, JnfError> {
    Header::parse(b, b.len() as u64)
}

/// Version 2 with expert 1 encoded in 200 of its 288 bytes (3 x [6, 8] BF16).
fn v2_header() -> Header {
    let mut p = plan(3, 6, 8);
    p.set_extent_storage(0, 1, ExtentCodec::ExponentPlaneZstd, 200);
    p.finish().unwrap()
}

#[test]
fn a_plan_without_storage_writes_version_1_json_as_before() {
    let h = plan(3, 6, 8).finish().unwrap();
    assert_eq!((h.major, h.minor), (1, 0));
    let text = serde_json::to_string(&header_json(&h)).unwrap();
    assert!(!text.contains("codec") && !text.contains("stored_length"));
    for e in &h.experts {
        assert_eq!((e.codec, e.stored_length), (ExtentCodec::Raw, e.length));
    }
    assert_eq!(LayoutPlan::from_header(&h).finish().unwrap(), h);
}

#[test]
fn version_2_records_every_extents_storage_and_places_by_stored_length() {
    // Extents of 3 x [512, 512] BF16 = 1.5 MiB: an encoded one of 1 MiB + 5 bytes takes 257
    // pages, not 384, and the next extent starts right after them.
    let mut p = plan(3, 512, 512);
    let length = 3 * 512 * 512 * 2;
    p.set_extent_storage(0, 1, ExtentCodec::ExponentPlaneZstd, (1 << 20) + 5);
    let h = p.finish().unwrap();
    assert_eq!((h.major, h.minor), (2, 0));
    let (e0, e1, e2) = (
        h.expert(0, 0).unwrap(),
        h.expert(0, 1).unwrap(),
        h.expert(0, 2).unwrap(),
    );
    assert_eq!((e0.codec, e0.stored_length), (ExtentCodec::Raw, length));
    assert_eq!(e1.codec, ExtentCodec::ExponentPlaneZstd);
    assert_eq!((e1.length, e1.stored_length), (length, (1 << 20) + 5));
    assert_eq!(e1.padded_length, 257 * 4096);
    assert_eq!(e2.offset, e1.offset + 257 * 4096);
    assert_eq!(h.file_size, e2.offset + e2.padded_length);
    // the JSON names the codec and stored length of every extent, raw ones included
    let v = header_json(&h);
    for (i, want) in [(0, "raw"), (1, "exp-zstd"), (2, "raw")] {
        assert_eq!(v["experts"][i]["codec"], json!(want));
        assert!(v["experts"][i]["stored_length"].is_u64());
    }
    // it round-trips through a file, and through a plan
    let mut bytes = h.encode().unwrap();
    bytes.resize(h.file_size as usize, 0);
    assert_eq!(parse(&bytes).unwrap(), h);
    assert_eq!(LayoutPlan::from_header(&h).finish().unwrap(), h);
}

#[test]
fn every_storage_rule_is_checked() {
    let v = header_json(&v2_header());
    let broken = |edit: &dyn Fn(&mut Value), major: u16| {
        let mut v = v.clone();
        edit(&mut v);
        parse(&file_from(v, major))
    };
    let storage = |r: Result<Header, JnfError>, what: &str| match r {
        Err(JnfError::ExtentStorage { prefix, why }) => {
            assert_eq!(prefix, "model.layers.0.mlp.experts.1", "{what}");
            why
        }
        other => panic!("{what}: {other:?}"),
    };
    // the unbroken file parses
    assert!(broken(&|_| {}, 2).is_ok());
    // a version-2 extent without its codec or its stored length
    for field in ["codec", "stored_length"] {
        let why = storage(
            broken(
                &|v| {
                    v["experts"][1].as_object_mut().unwrap().remove(field);
                },
                2,
            ),
            field,
        );
        assert!(why.contains("records its codec"), "{why}");
    }
    // version-2 fields in a version-1 file (the first extent already has them)
    assert!(matches!(
        broken(&|_| {}, 1),
        Err(JnfError::ExtentStorage { prefix, why })
            if prefix == "model.layers.0.mlp.experts.0" && why.contains("version-1 extent")
    ));
    // a codec this reader does not know
    assert_eq!(
        broken(&|v| v["experts"][1]["codec"] = json!("lz4"), 2),
        Err(JnfError::UnknownCodec {
            prefix: "model.layers.0.mlp.experts.1".into(),
            codec: "lz4".into()
        })
    );
    // a raw extent whose stored length is not its length
    let why = storage(
        broken(
            &|v| {
                v["experts"][1]["codec"] = json!("raw");
            },
            2,
        ),
        "raw",
    );
    assert!(why.contains("is not its length"), "{why}");
    // encoded, but not smaller than its bytes; or shorter than any encoding of 144 values
    // can be (16 + 144 + a frame)
    for stored in [288, 300, 160, 16, 0] {
        let why = storage(
            broken(&|v| v["experts"][1]["stored_length"] = json!(stored), 2),
            "stored",
        );
        assert!(why.contains("is not possible"), "{stored}: {why}");
    }
    // the padded length follows the stored length, not the decoded one
    assert!(matches!(
        broken(&|v| v["experts"][1]["padded_length"] = json!(8192), 2),
        Err(JnfError::ExpertLength { .. })
    ));
}

#[test]
fn an_mxfp4_extent_is_never_encoded() {
    let mut p = LayoutPlan::new();
    let u8p = |name: String, shape: &[u64]| MatrixSpec {
        name,
        dtype: Dtype::U8,
        shape: shape.to_vec(),
        source: None,
    };
    let pre = "model.layers.0.mlp.experts.0";
    p.add_mxfp4_expert(
        0,
        0,
        pre.into(),
        [
            u8p(format!("{pre}.gate_up_proj_blocks"), &[64, 2, 16]),
            u8p(format!("{pre}.gate_up_proj_scales"), &[64, 2]),
            u8p(format!("{pre}.down_proj_blocks"), &[64, 1, 16]),
            u8p(format!("{pre}.down_proj_scales"), &[64, 1]),
        ],
    );
    let mut raw = p.clone();
    raw.set_extent_storage(0, 0, ExtentCodec::Raw, 3264);
    assert_eq!(raw.finish().unwrap().major, 2);
    p.set_extent_storage(0, 0, ExtentCodec::ExponentPlaneZstd, 3000);
    assert!(matches!(
        p.finish(),
        Err(JnfError::ExtentStorage { why, .. }) if why.contains("MXFP4")
    ));
}

/// BF16 values like trained weights' (a fixed generator).
fn weights(n: usize) -> Vec<u8> {
    let mut s = 11u64;
    (0..n)
        .flat_map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            ((((u - 0.5) * 0.05).to_bits() >> 16) as u16).to_le_bytes()
        })
        .collect()
}

#[test]
fn the_reader_returns_the_decoded_extent_and_names_a_corrupt_one() {
    let (rows, cols) = (64u64, 32u64);
    let mut p = plan(2, rows, cols);
    let bytes: Vec<Vec<u8>> = (0..2)
        .map(|_| weights(3 * (rows * cols) as usize))
        .collect();
    let enc = jnf_codec::encode(&bytes[1]).unwrap();
    p.set_extent_storage(0, 1, ExtentCodec::ExponentPlaneZstd, enc.len() as u64);
    let h = p.finish().unwrap();
    let mut file = h.encode().unwrap();
    file.resize(h.file_size as usize, 0);
    let e0 = h.expert(0, 0).unwrap().clone();
    let e1 = h.expert(0, 1).unwrap().clone();
    file[e0.offset as usize..][..bytes[0].len()].copy_from_slice(&bytes[0]);
    file[e1.offset as usize..][..enc.len()].copy_from_slice(&enc);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(CONTAINER_FILE);
    std::fs::write(&path, &file).unwrap();

    let jnf = JnfFile::open(&path).unwrap();
    let mut buf = Vec::new();
    jnf.read_extent_into(&e0, &mut buf).unwrap();
    assert_eq!(buf, bytes[0]);
    jnf.read_extent_into(&e1, &mut buf).unwrap();
    assert_eq!(buf, bytes[1]);
    jnf.read_stored_into(&e1, &mut buf).unwrap();
    assert_eq!(buf, enc);

    // a stored byte of the value count flipped: named as the expert, never a panic
    file[e1.offset as usize] ^= 1;
    std::fs::write(&path, &file).unwrap();
    let jnf = JnfFile::open(&path).unwrap();
    match jnf.read_extent_into(&e1, &mut buf) {
        Err(JnfError::Decode { prefix, source }) => {
            assert_eq!(prefix, "model.layers.0.mlp.experts.1");
            assert!(matches!(source, jnf_codec::DecodeError::ValueCount { .. }));
        }
        other => panic!("{other:?}"),
    }
    // decode_stored checks the lengths it is given against the header's
    let mut out = vec![0u8; e1.length as usize];
    assert!(matches!(
        e1.decode_stored(&enc[1..], &mut out),
        Err(JnfError::ExtentStorage { .. })
    ));
}
