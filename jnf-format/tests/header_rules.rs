//! Every rule of the JNF header, broken one at a time by a crafted file.

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

/// A small valid layout: two non-expert tensors and two layers of three experts.
fn sample_plan() -> LayoutPlan {
    let mut plan = LayoutPlan::new();
    plan.add_tensor(TensorSpec {
        name: "model.embed_tokens.weight".into(),
        dtype: Dtype::BF16,
        shape: vec![16, 8],
        source: Some(SourceRef {
            shard: "model-00001-of-00002.safetensors".into(),
            offset: 1000,
        }),
    });
    plan.add_tensor(TensorSpec {
        name: "model.norm.weight".into(),
        dtype: Dtype::F32,
        shape: vec![8],
        source: None,
    });
    for l in 0..2 {
        for e in 0..3 {
            let p = format!("model.layers.{l}.mlp.experts.{e}");
            plan.add_expert(
                l,
                e,
                p.clone(),
                [
                    mat(&format!("{p}.gate_proj.weight"), &[6, 8]),
                    mat(&format!("{p}.up_proj.weight"), &[6, 8]),
                    mat(&format!("{p}.down_proj.weight"), &[8, 6]),
                ],
            );
        }
    }
    plan
}

fn header_json(h: &Header) -> Value {
    let bytes = h.encode().unwrap();
    let len = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
    serde_json::from_slice(&bytes[24..24 + len]).unwrap()
}

/// Encode `v` as a file: preamble, JSON, zero padding to `data_start`, zeros up to `file_size`.
/// `data_start` is recomputed unless `keep_start`.
fn file_from(mut v: Value, keep_start: bool) -> Vec<u8> {
    if !keep_start {
        // data_start's own digits can change the JSON length: iterate to a fixed point.
        loop {
            let len = serde_json::to_vec(&v).unwrap().len() as u64;
            let start = align_up(24 + len).unwrap();
            if v["data_start"] == json!(start) {
                break;
            }
            v["data_start"] = json!(start);
        }
    }
    let text = serde_json::to_vec(&v).unwrap();
    let mut out = Vec::new();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&1u16.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    let start = v["data_start"].as_u64().unwrap() as usize;
    let size = v["file_size"].as_u64().unwrap_or(0) as usize;
    out.resize(start.max(out.len()), 0);
    out.resize(size.max(out.len()), 0);
    out
}

fn parse(bytes: &[u8]) -> Result<Header, JnfError> {
    Header::parse(bytes, bytes.len() as u64)
}

/// Shift every absolute offset by `delta` (to keep a mutated header self-consistent).
fn valid_value() -> Value {
    header_json(&sample_plan().finish().unwrap())
}

#[test]
fn valid_layout_round_trips() {
    let h = sample_plan().finish().unwrap();
    let mut bytes = h.encode().unwrap();
    bytes.resize(h.file_size as usize, 0);
    let back = parse(&bytes).unwrap();
    assert_eq!(back, h);
    assert_eq!(h.data_start, 4096);
    // Non-expert tensors first, then experts in (layer, expert) order, adjacent, aligned.
    assert_eq!(h.tensors[0].offset, 4096);
    assert_eq!(h.tensors[1].offset, 8192);
    assert_eq!(h.experts[0].offset, 12288);
    for w in h.experts.windows(2) {
        assert_eq!(w[0].offset + w[0].padded_length, w[1].offset);
    }
    let e = h.expert(1, 2).unwrap();
    assert_eq!(e.prefix, "model.layers.1.mlp.experts.2");
    assert_eq!(e.length, 3 * 96);
    assert_eq!(e.matrix(MatrixRole::Up).unwrap().offset, 96);
    assert_eq!(e.matrix(MatrixRole::Down).unwrap().offset, 192);
    assert_eq!(h.file_size, 12288 + 6 * 4096);
}

#[test]
fn large_header_pushes_data_start() {
    let mut plan = LayoutPlan::new();
    for i in 0..400 {
        plan.add_tensor(TensorSpec {
            name: format!("model.layers.{i}.a_rather_long_tensor_name_to_grow_the_header.weight"),
            dtype: Dtype::BF16,
            shape: vec![2],
            source: None,
        });
    }
    let h = plan.finish().unwrap();
    assert!(h.data_start > 4096);
    assert_eq!(h.data_start % 4096, 0);
    let mut bytes = h.encode().unwrap();
    bytes.resize(h.file_size as usize, 0);
    assert_eq!(parse(&bytes).unwrap(), h);
}

#[test]
fn too_short() {
    assert_eq!(parse(b"TARFA"), Err(JnfError::TooShort { size: 5 }));
}

#[test]
fn bad_magic() {
    let mut b = file_from(valid_value(), false);
    b[0] = b'X';
    assert_eq!(parse(&b), Err(JnfError::BadMagic));
}

#[test]
fn newer_and_unknown_versions_are_named() {
    // a newer major version than this reader's (which reads 1.0 and 2.0)
    let mut b = file_from(valid_value(), false);
    b[8] = 3;
    let err = parse(&b).unwrap_err();
    assert_eq!(
        err,
        JnfError::NewerVersion {
            major: 3,
            minor: 0,
            reads_major: 2,
            reads_minor: 0
        }
    );
    assert_eq!(
        err.to_string(),
        "format version 3.0 is newer than this reader (2.0); read it with a newer Tarfa"
    );
    // a newer minor version of a major it reads
    let mut b = file_from(valid_value(), false);
    b[10] = 1;
    assert_eq!(
        parse(&b),
        Err(JnfError::NewerVersion {
            major: 1,
            minor: 1,
            reads_major: 1,
            reads_minor: 0
        })
    );
    // no JNF version is 0.x
    let mut b = file_from(valid_value(), false);
    b[8] = 0;
    assert_eq!(
        parse(&b),
        Err(JnfError::UnknownVersion { major: 0, minor: 0 })
    );
}

#[test]
fn a_version_1_reader_names_version_2() {
    // The rule as a reader of version 1 only applies it: what the readers released before
    // version 2 must say of a version-2 file (docs/FORMAT.md, "Version 2").
    let v1_reader = &[(1u16, 0u16)];
    assert_eq!(check_version(1, 0, v1_reader), Ok(()));
    assert_eq!(
        check_version(2, 0, v1_reader).unwrap_err().to_string(),
        "format version 2.0 is newer than this reader (1.0); read it with a newer Tarfa"
    );
    // and this build reads both
    assert_eq!(READS, &[(1, 0), (2, 0)]);
    assert_eq!(check_version(2, 0, READS), Ok(()));
}

#[test]
fn reserved_must_be_zero() {
    let mut b = file_from(valid_value(), false);
    b[12] = 1;
    assert_eq!(parse(&b), Err(JnfError::ReservedNonZero(1)));
}

#[test]
fn header_length_over_cap_or_past_end() {
    let mut b = file_from(valid_value(), false);
    b[16..24].copy_from_slice(&(MAX_HEADER_LEN + 1).to_le_bytes());
    assert!(matches!(parse(&b), Err(JnfError::HeaderTooLarge { .. })));
    let mut b = file_from(valid_value(), false);
    let n = b.len() as u64;
    b[16..24].copy_from_slice(&n.to_le_bytes());
    assert!(matches!(parse(&b), Err(JnfError::HeaderBeyondFile { .. })));
}

#[test]
fn header_not_utf8_or_not_json() {
    let mut b = file_from(valid_value(), false);
    b[24] = 0xff;
    assert_eq!(parse(&b), Err(JnfError::HeaderNotUtf8));
    let mut b = file_from(valid_value(), false);
    b[24] = b'[';
    assert!(matches!(parse(&b), Err(JnfError::HeaderJson(_))));
}

#[test]
fn unknown_field_is_refused() {
    let mut v = valid_value();
    v["surprise"] = json!(1);
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::HeaderJson(_))
    ));
}

#[test]
fn truncated_or_extended_file() {
    let b = file_from(valid_value(), false);
    let short = &b[..b.len() - 4096];
    assert!(matches!(
        parse(short),
        Err(JnfError::FileSizeMismatch { .. })
    ));
    let mut long = b.clone();
    long.extend_from_slice(&[0u8; 10]);
    assert!(matches!(
        parse(&long),
        Err(JnfError::FileSizeMismatch { .. })
    ));
}

#[test]
fn trailing_region_after_last_extent() {
    let mut v = valid_value();
    let fs = v["file_size"].as_u64().unwrap();
    v["file_size"] = json!(fs + 4096);
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::FileSizeMismatch { .. })
    ));
}

#[test]
fn data_start_must_follow_header() {
    let mut v = valid_value();
    v["data_start"] = json!(8192);
    assert!(matches!(
        parse(&file_from(v, true)),
        Err(JnfError::DataStartMismatch {
            expected: 4096,
            actual: 8192
        })
    ));
}

#[test]
fn alignment_must_be_4096() {
    let mut v = valid_value();
    v["alignment"] = json!(512);
    assert_eq!(
        parse(&file_from(v, false)),
        Err(JnfError::UnsupportedAlignment(512))
    );
}

#[test]
fn duplicate_names() {
    let mut v = valid_value();
    v["tensors"][1]["name"] = v["tensors"][0]["name"].clone();
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::DuplicateName(_))
    ));
    let mut v = valid_value();
    v["experts"][1]["matrices"][0]["name"] = v["tensors"][0]["name"].clone();
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::DuplicateName(_))
    ));
}

#[test]
fn invalid_names() {
    let mut v = valid_value();
    v["tensors"][0]["name"] = json!("");
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::InvalidName(_))
    ));
    let mut v = valid_value();
    v["tensors"][0]["name"] = json!("a\nb");
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::InvalidName(_))
    ));
}

#[test]
fn unknown_and_refused_dtypes() {
    let mut v = valid_value();
    v["tensors"][0]["dtype"] = json!("Q4_K");
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::UnknownDtype { .. })
    ));
    let mut v = valid_value();
    v["tensors"][0]["dtype"] = json!("F8_E4M3");
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::RefusedDtype { .. })
    ));
    let mut v = valid_value();
    v["experts"][0]["matrices"][2]["dtype"] = json!("I8");
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::RefusedDtype { .. })
    ));
}

#[test]
fn expert_must_be_bf16() {
    let mut v = valid_value();
    // F16 has the same size, so only the dtype rule can catch it.
    v["experts"][0]["matrices"][1]["dtype"] = json!("F16");
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::ExpertNotBf16 { .. })
    ));
}

#[test]
fn shape_overflow() {
    let mut v = valid_value();
    v["tensors"][0]["shape"] = json!([u64::MAX / 2, 3]);
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::ShapeOverflow { .. })
    ));
}

#[test]
fn length_must_equal_shape_times_dtype() {
    let mut v = valid_value();
    v["tensors"][0]["length"] = json!(255);
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::LengthMismatch { .. })
    ));
    let mut v = valid_value();
    v["experts"][0]["matrices"][0]["shape"] = json!([6, 9]);
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::LengthMismatch { .. })
    ));
}

#[test]
fn misaligned_offsets() {
    let mut v = valid_value();
    v["tensors"][1]["offset"] = json!(8192 + 16);
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::Misaligned { offset: 8208, .. })
    ));
    let mut v = valid_value();
    v["experts"][2]["offset"] = json!(v["experts"][2]["offset"].as_u64().unwrap() + 8);
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::Misaligned { .. })
    ));
}

#[test]
fn offsets_inside_header() {
    let mut v = valid_value();
    v["tensors"][0]["offset"] = json!(0);
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::InsideHeader { .. })
    ));
}

#[test]
fn out_of_bounds_offsets() {
    let mut v = valid_value();
    let fs = v["file_size"].as_u64().unwrap();
    v["tensors"][1]["offset"] = json!(fs);
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::OutOfBounds { .. })
    ));
    let mut v = valid_value();
    v["tensors"][1]["offset"] = json!(u64::MAX - 4095);
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::OutOfBounds { .. })
    ));
}

#[test]
fn overlapping_regions() {
    let mut v = valid_value();
    v["tensors"][1]["offset"] = v["tensors"][0]["offset"].clone();
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::Overlap { .. })
    ));
    let mut v = valid_value();
    v["tensors"][1]["offset"] = v["experts"][3]["offset"].clone();
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::Overlap { .. })
    ));
}

#[test]
fn expert_matrices_roles_and_packing() {
    let mut v = valid_value();
    v["experts"][0]["matrices"][0]["role"] = json!("up");
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::ExpertRoles { .. })
    ));
    let mut v = valid_value();
    v["experts"][0]["matrices"].as_array_mut().unwrap().pop();
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::ExpertRoles { .. })
    ));
    let mut v = valid_value();
    v["experts"][0]["matrices"][1]["offset"] = json!(100);
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::ExpertNotPacked { .. })
    ));
    let mut v = valid_value();
    v["experts"][0]["length"] = json!(300);
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::ExpertLength { .. })
    ));
    let mut v = valid_value();
    v["experts"][0]["padded_length"] = json!(8192);
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::ExpertLength { .. })
    ));
}

#[test]
fn experts_out_of_order_or_not_adjacent() {
    let mut v = valid_value();
    let first = v["experts"][0].clone();
    v["experts"][0] = v["experts"][1].clone();
    v["experts"][1] = first;
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::ExpertOrder { .. })
    ));
    // Same layer, a gap of one page between two experts.
    let mut v = valid_value();
    for i in 1..6 {
        let o = v["experts"][i]["offset"].as_u64().unwrap();
        v["experts"][i]["offset"] = json!(o + 4096);
    }
    let fs = v["file_size"].as_u64().unwrap();
    v["file_size"] = json!(fs + 4096);
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::ExpertOrder { .. })
    ));
}

#[test]
fn garbage_never_panics() {
    // A cheap deterministic mutation loop; the fuzz target does this properly.
    let base = file_from(valid_value(), false);
    let mut state = 0x9e3779b97f4a7c15u64;
    for _ in 0..3000 {
        let mut b = base.clone();
        for _ in 0..4 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let i = (state % 1200) as usize % b.len();
            b[i] = (state >> 32) as u8;
        }
        let _ = parse(&b);
    }
}

#[test]
fn expert_prefix_must_name_its_layer_and_expert() {
    let mut v = valid_value();
    v["experts"][1]["layer"] = json!(0);
    v["experts"][1]["expert"] = json!(7);
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::ExpertName { .. })
    ));
    let mut v = valid_value();
    v["experts"][2]["matrices"][1]["name"] = json!("model.layers.0.mlp.experts.9.up_proj.weight");
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::ExpertName { .. })
    ));
}

#[test]
fn re_encoding_a_header_that_no_longer_fits_is_an_error() {
    // A header parsed from compact JSON, with a long metadata value added, cannot re-encode into
    // the room before data_start: an error, not a truncated header.
    let mut h = sample_plan().finish().unwrap();
    h.metadata.insert("note".into(), "x".repeat(5000));
    assert!(matches!(
        h.encode(),
        Err(JnfError::EncodedHeaderTooLong { .. })
    ));
}

/// A layer of two MXFP4 experts as gpt-oss releases them (H = 64, I = 32): the four U8 parts.
fn mxfp4_plan() -> LayoutPlan {
    let mut plan = LayoutPlan::new();
    let u8p = |name: String, shape: &[u64]| MatrixSpec {
        name,
        dtype: Dtype::U8,
        shape: shape.to_vec(),
        source: None,
    };
    for e in 0..2 {
        let p = format!("model.layers.0.mlp.experts.{e}");
        plan.add_mxfp4_expert(
            0,
            e,
            p.clone(),
            [
                u8p(format!("{p}.gate_up_proj_blocks"), &[64, 2, 16]),
                u8p(format!("{p}.gate_up_proj_scales"), &[64, 2]),
                u8p(format!("{p}.down_proj_blocks"), &[64, 1, 16]),
                u8p(format!("{p}.down_proj_scales"), &[64, 1]),
            ],
        );
    }
    plan
}

#[test]
fn mxfp4_extents_round_trip_and_every_rule_of_their_parts_is_checked() {
    let h = mxfp4_plan().finish().unwrap();
    let e = h.expert(0, 1).unwrap();
    assert_eq!(e.encoding(), ExtentEncoding::Mxfp4);
    // 64*2*16 + 64*2 + 64*16 + 64 bytes: 17/32 of a byte per value of [64, 64] and [64, 32]
    assert_eq!(e.length, 2048 + 128 + 1024 + 64);
    let v = header_json(&h);
    assert_eq!(parse(&file_from(v.clone(), false)).unwrap(), h);

    // A U8 tensor is refused: U8 is only ever an MXFP4 part.
    let mut plan = mxfp4_plan();
    plan.add_tensor(TensorSpec {
        name: "model.norm.weight".into(),
        dtype: Dtype::U8,
        shape: vec![8],
        source: None,
    });
    assert!(matches!(plan.finish(), Err(JnfError::RefusedDtype { .. })));
    // A part in another dtype, parts out of order, and shapes that do not agree on H and I.
    for (path, value) in [
        (("matrices", 1, "dtype"), json!("BF16")),
        (("matrices", 0, "role"), json!("gate_up_scales")),
        (("matrices", 3, "role"), json!("down")),
    ] {
        let mut v = v.clone();
        v["experts"][0][path.0][path.1][path.2] = value;
        assert!(
            matches!(
                parse(&file_from(v, false)),
                Err(JnfError::Mxfp4Layout { .. } | JnfError::ExpertRoles { .. })
            ),
            "{path:?}"
        );
    }
    let mut v = v.clone();
    // down [H = 32, I = 32] blocks and scales, which no gate_up [2I = 64, H = 64] goes with;
    // lengths kept consistent so that only the block-layout rule can catch it.
    v["experts"][0]["matrices"][2]["shape"] = json!([32, 2, 16]);
    v["experts"][0]["matrices"][3]["shape"] = json!([32, 2]);
    assert!(matches!(
        parse(&file_from(v, false)),
        Err(JnfError::Mxfp4Layout { .. })
    ));
    // A BF16 gate/up/down matrix in U8 is refused too.
    let mut v = valid_value();
    v["experts"][0]["matrices"][0]["dtype"] = json!("U8");
    assert!(parse(&file_from(v, false)).is_err());
}
