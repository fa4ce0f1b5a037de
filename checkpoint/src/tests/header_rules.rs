//! One test per safetensors header rule, each with crafted hostile bytes.

use std::path::Path;

use super::*;
use crate::{CheckpointError as E, Dtype, SafetensorsHeader, MAX_HEADER_LEN};

fn parse(bytes: &[u8]) -> Result<SafetensorsHeader, E> {
    let r = SafetensorsHeader::from_bytes(Path::new("x.safetensors"), bytes);
    if let Err(e) = &r {
        check_message(e);
        assert_eq!(e.file(), Path::new("x.safetensors"));
    }
    r
}

/// A header with `data_len` zero bytes of data after it.
fn hdr(header: &str, data_len: usize) -> Result<SafetensorsHeader, E> {
    parse(&raw_safetensors(header, &vec![0; data_len]))
}

/// The same bytes as the single file of an otherwise valid checkpoint, through `open`.
fn through_open(bytes: &[u8]) -> E {
    let dir = Tiny::qwen3().single().write();
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    let e = fails(&dir);
    assert_eq!(e.file(), Path::new("model.safetensors"));
    e
}

#[test]
fn valid_header_parses() {
    let h = hdr(
        r#"{"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[2,3],"data_offsets":[4,16]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
        16,
    )
    .unwrap();
    assert_eq!(h.tensors.len(), 2);
    assert_eq!(h.tensors[0].name, "a");
    assert_eq!(
        (h.tensors[1].begin, h.tensors[1].end, h.tensors[1].dtype),
        (4, 16, Dtype::BF16)
    );
    assert_eq!(h.metadata.unwrap()["format"], "pt");
}

#[test]
fn leading_and_trailing_whitespace_and_null_metadata_are_accepted() {
    // As the safetensors crate accepts them.
    hdr("  {\"__metadata__\":null,\"a\":{\"dtype\":\"BF16\",\"shape\":[1],\"data_offsets\":[0,2]}}   ", 2).unwrap();
}

#[test]
fn empty_header_with_no_data_is_valid() {
    let h = hdr("{}", 0).unwrap();
    assert!(h.tensors.is_empty());
    assert_variant!(hdr("{}", 1).unwrap_err(), E::TrailingBytes { extra: 1, .. });
}

#[test]
fn zero_length_tensors_tile_at_one_offset() {
    hdr(
        r#"{"a":{"dtype":"BF16","shape":[0,4],"data_offsets":[0,0]},"b":{"dtype":"BF16","shape":[0],"data_offsets":[0,0]},"c":{"dtype":"U16","shape":[1],"data_offsets":[0,2]}}"#,
        2,
    )
    .unwrap();
}

#[test]
fn file_too_small() {
    assert_variant!(parse(b"").unwrap_err(), E::FileTooSmall { len: 0, .. });
    assert_variant!(
        parse(&[2, 0, 0, 0, 0, 0, 0]).unwrap_err(),
        E::FileTooSmall { len: 7, .. }
    );
    assert_variant!(
        through_open(b"\x02\x00\x00"),
        E::FileTooSmall { len: 3, .. }
    );
}

#[test]
fn header_over_the_cap() {
    let mut bytes = (MAX_HEADER_LEN + 1).to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    assert_variant!(parse(&bytes).unwrap_err(), E::HeaderTooLarge { header_len, .. } if header_len == MAX_HEADER_LEN + 1);
    let mut huge = u64::MAX.to_le_bytes().to_vec();
    huge.extend_from_slice(b"{}");
    assert_variant!(parse(&huge).unwrap_err(), E::HeaderTooLarge { .. });
    assert_variant!(through_open(&huge), E::HeaderTooLarge { .. });
}

#[test]
fn header_past_end_of_file() {
    let mut bytes = 1000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    assert_variant!(
        parse(&bytes).unwrap_err(),
        E::HeaderPastEnd {
            header_len: 1000,
            file_len: 10,
            ..
        }
    );
    assert_variant!(through_open(&bytes), E::HeaderPastEnd { .. });
}

#[test]
fn truncated_file() {
    let full = safetensors_bytes(&Tiny::qwen3().tensors);
    let e = parse(&full[..full.len() - 1]).unwrap_err();
    assert_variant!(e, E::DataOutOfBounds { .. });
    assert_variant!(
        through_open(&full[..full.len() - 100]),
        E::DataOutOfBounds { .. }
    );
    // Cut inside the header.
    assert_variant!(parse(&full[..20]).unwrap_err(), E::HeaderPastEnd { .. });
}

#[test]
fn header_not_utf8() {
    let bytes = raw_safetensors(b"{\"a\xff\":1}", &[]);
    assert_variant!(
        parse(&bytes).unwrap_err(),
        E::HeaderNotUtf8 { valid_up_to: 3, .. }
    );
    assert_variant!(through_open(&bytes), E::HeaderNotUtf8 { .. });
}

#[test]
fn header_invalid_json() {
    for bad in [
        "",
        "{",
        "{\"a\":}",
        "[]",
        "null",
        "12",
        "{} {}",
        "{\"a\":1,}",
        "\"str\"",
    ] {
        assert_variant!(hdr(bad, 0).unwrap_err(), E::HeaderInvalidJson { .. });
    }
    let deep = format!("{{\"a\":{}{}}}", "[".repeat(10_000), "]".repeat(10_000));
    assert_variant!(hdr(&deep, 0).unwrap_err(), E::HeaderInvalidJson { .. });
    assert_variant!(
        through_open(&raw_safetensors("{nope}", &[])),
        E::HeaderInvalidJson { .. }
    );
}

#[test]
fn duplicate_tensor_with_identical_ranges() {
    // The safetensors crate accepts this silently (the second entry wins).
    let h = r#"{"a":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]},"a":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}}"#;
    assert_variant!(hdr(h, 2).unwrap_err(), E::DuplicateTensor { ref tensor, .. } if tensor == "a");
    assert_variant!(
        through_open(&raw_safetensors(h, &[0, 0])),
        E::DuplicateTensor { .. }
    );
}

#[test]
fn duplicate_tensor_with_different_ranges() {
    // The safetensors crate reports this as an "invalid offset".
    let h = r#"{"a":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]},"a":{"dtype":"BF16","shape":[1],"data_offsets":[2,4]}}"#;
    assert_variant!(hdr(h, 4).unwrap_err(), E::DuplicateTensor { .. });
}

#[test]
fn duplicate_key_inside_an_entry_or_the_metadata() {
    let h = r#"{"a":{"dtype":"BF16","dtype":"F32","shape":[1],"data_offsets":[0,2]}}"#;
    assert_variant!(hdr(h, 2).unwrap_err(), E::DuplicateJsonKey { ref key_path, .. } if key_path == r#""a"."dtype""#);
    let h = r#"{"__metadata__":{"k":"1","k":"2"}}"#;
    assert_variant!(hdr(h, 0).unwrap_err(), E::DuplicateJsonKey { .. });
    let h = r#"{"__metadata__":{},"__metadata__":{}}"#;
    assert_variant!(hdr(h, 0).unwrap_err(), E::DuplicateJsonKey { .. });
}

#[test]
fn invalid_metadata() {
    assert_variant!(
        hdr(r#"{"__metadata__":{"k":1}}"#, 0).unwrap_err(),
        E::InvalidMetadata { .. }
    );
    assert_variant!(
        hdr(r#"{"__metadata__":["k"]}"#, 0).unwrap_err(),
        E::InvalidMetadata { .. }
    );
    assert_variant!(
        hdr(r#"{"__metadata__":"pt"}"#, 0).unwrap_err(),
        E::InvalidMetadata { .. }
    );
}

#[test]
fn invalid_tensor_entry() {
    for entry in [
        r#""BF16""#,
        r#"{"shape":[1],"data_offsets":[0,2]}"#,
        r#"{"dtype":"BF16","data_offsets":[0,2]}"#,
        r#"{"dtype":"BF16","shape":[1]}"#,
        r#"{"dtype":"BF16","shape":[-1],"data_offsets":[0,2]}"#,
        r#"{"dtype":"BF16","shape":[1.5],"data_offsets":[0,2]}"#,
        r#"{"dtype":"BF16","shape":[1],"data_offsets":[0,2,4]}"#,
        r#"{"dtype":"BF16","shape":[1],"data_offsets":[0]}"#,
        r#"{"dtype":"BF16","shape":[1],"data_offsets":[0,18446744073709551616]}"#,
        r#"{"dtype":2,"shape":[1],"data_offsets":[0,2]}"#,
    ] {
        let e = hdr(&format!("{{\"t\":{entry}}}"), 2).unwrap_err();
        assert_variant!(e, E::InvalidTensorEntry { ref tensor, .. } if tensor == "t");
    }
}

#[test]
fn unknown_dtype() {
    for d in ["BF17", "bf16", "", "F8", "Q4_K"] {
        let h = format!(r#"{{"t":{{"dtype":"{d}","shape":[1],"data_offsets":[0,2]}}}}"#);
        assert_variant!(hdr(&h, 2).unwrap_err(), E::UnknownDtype { ref dtype, .. } if dtype == d);
    }
}

#[test]
fn shape_overflow() {
    // Element count overflows.
    let h = r#"{"t":{"dtype":"BF16","shape":[4294967296,4294967296,2],"data_offsets":[0,0]}}"#;
    assert_variant!(hdr(h, 0).unwrap_err(), E::ShapeOverflow { .. });
    // Element count fits, bit count does not.
    let h = r#"{"t":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}}"#;
    assert_variant!(hdr(h, 0).unwrap_err(), E::ShapeOverflow { .. });
    // A zero dimension makes the product zero even with huge others: no overflow, zero bytes.
    let h = r#"{"t":{"dtype":"F64","shape":[0,18446744073709551615],"data_offsets":[0,0]}}"#;
    hdr(h, 0).unwrap();
}

#[test]
fn sub_byte_dtype_must_fill_whole_bytes() {
    let h = r#"{"t":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#;
    assert_variant!(hdr(h, 2).unwrap_err(), E::MisalignedSubByte { .. });
    // An even count is fine at the header level (the dtype policy refuses F4 later).
    hdr(
        r#"{"t":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}}"#,
        2,
    )
    .unwrap();
}

#[test]
fn offsets_reversed() {
    let h = r#"{"t":{"dtype":"BF16","shape":[1],"data_offsets":[2,0]}}"#;
    assert_variant!(
        hdr(h, 2).unwrap_err(),
        E::OffsetsReversed {
            begin: 2,
            end: 0,
            ..
        }
    );
}

#[test]
fn length_not_shape_times_dtype() {
    let h = r#"{"t":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,6]}}"#;
    assert_variant!(
        hdr(h, 6).unwrap_err(),
        E::LengthMismatch {
            expected: 8,
            actual: 6,
            ..
        }
    );
    let h = r#"{"t":{"dtype":"F32","shape":[],"data_offsets":[0,2]}}"#;
    assert_variant!(
        hdr(h, 2).unwrap_err(),
        E::LengthMismatch {
            expected: 4,
            actual: 2,
            ..
        }
    );
}

#[test]
fn gap_before_first_tensor_and_between_tensors() {
    let h = r#"{"t":{"dtype":"BF16","shape":[1],"data_offsets":[2,4]}}"#;
    assert_variant!(
        hdr(h, 4).unwrap_err(),
        E::DataGap {
            expected: 0,
            begin: 2,
            ..
        }
    );
    let h = r#"{"a":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]},"b":{"dtype":"BF16","shape":[1],"data_offsets":[4,6]}}"#;
    assert_variant!(hdr(h, 6).unwrap_err(), E::DataGap { ref tensor, expected: 2, begin: 4, .. } if tensor == "b");
    // A far-away zero-length tensor is a gap too.
    let h = r#"{"a":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]},"z":{"dtype":"BF16","shape":[0],"data_offsets":[9223372036854775808,9223372036854775808]}}"#;
    assert_variant!(hdr(h, 2).unwrap_err(), E::DataGap { .. });
}

#[test]
fn overlapping_tensors() {
    let h = r#"{"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},"b":{"dtype":"BF16","shape":[2],"data_offsets":[2,6]}}"#;
    assert_variant!(hdr(h, 6).unwrap_err(), E::DataOverlap { ref tensor, expected: 4, begin: 2, .. } if tensor == "b");
    // Two names over the very same bytes (aliasing).
    let h = r#"{"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},"b":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}}"#;
    assert_variant!(hdr(h, 4).unwrap_err(), E::DataOverlap { .. });
}

#[test]
fn data_out_of_bounds() {
    let h = r#"{"a":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]}}"#;
    assert_variant!(
        hdr(h, 6).unwrap_err(),
        E::DataOutOfBounds {
            end: 8,
            data_len: 6,
            ..
        }
    );
    let h = r#"{"a":{"dtype":"U8","shape":[1152921504606846976],"data_offsets":[0,1152921504606846976]}}"#;
    assert_variant!(hdr(h, 6).unwrap_err(), E::DataOutOfBounds { .. });
}

#[test]
fn trailing_bytes() {
    let h = r#"{"a":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}}"#;
    assert_variant!(hdr(h, 3).unwrap_err(), E::TrailingBytes { extra: 1, .. });
    let mut bytes = safetensors_bytes(&Tiny::qwen3().tensors);
    bytes.extend_from_slice(b"PAYLOAD");
    assert_variant!(through_open(&bytes), E::TrailingBytes { extra: 7, .. });
}

#[test]
fn hostile_names_stay_on_one_line() {
    let h = "{\"a\\nFAKE: ok\":{\"dtype\":\"BF16\",\"shape\":[1],\"data_offsets\":[0,3]}}";
    // Refused by name, before any other check, and printed escaped.
    let e = assert_variant!(hdr(h, 3).unwrap_err(), E::TensorNameChar { code: 0x0a, .. });
    assert!(e.to_string().contains(r#""a\nFAKE: ok""#), "{e}");
}

#[test]
fn bidi_and_format_characters_in_tensor_names_are_refused() {
    for c in [
        '\u{202A}', '\u{202B}', '\u{202C}', '\u{202D}', '\u{202E}', '\u{2066}', '\u{2067}',
        '\u{2068}', '\u{2069}', '\u{200E}', '\u{200F}', '\u{061C}', '\u{0}', '\u{1b}', '\u{7f}',
        '\u{85}',
    ] {
        let name = format!("lm_head{c}.weight");
        let h = serde_json::json!({ name.clone(): {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]} })
            .to_string();
        let e = assert_variant!(hdr(&h, 2).unwrap_err(), E::TensorNameChar { ref tensor, code, .. } if *tensor == name && code == c as u32);
        let msg = e.to_string();
        assert!(!msg.contains(c), "escaped: {msg:?}");
        assert!(msg.contains(&format!("U+{:04X}", c as u32)), "{msg}");
    }
    // Other non-ASCII letters are names like any other.
    let h = r#"{"caf\u00e9.weight":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}}"#;
    hdr(h, 2).unwrap();
}
