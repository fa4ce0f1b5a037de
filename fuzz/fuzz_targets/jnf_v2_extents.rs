//! Format version 2's encoded extents, as a reader meets them (issue 24; docs/FORMAT.md,
//! "Version 2"). The first byte picks the mode:
//! - even: the rest is a whole JNF file. What `Header::parse` accepts, every extent's stored
//!   bytes are decoded as a reader would (`ExpertExtent::decode_stored`, with no hash check, as
//!   a hostile bundle whose manifest vouches for its bytes would be): no panic, and no encoded
//!   extent may claim more than twice its stored bytes (what bounds a reader's allocation);
//!   what decodes must re-encode and decode to the same bytes.
//! - odd: the rest is a decoded length (u32, little-endian) and stored bytes, with the codec
//!   from bit 1 of the first byte: an extent the storage rule (`check_extent_storage`, the
//!   header's and the manifest's) accepts must decode or fail with an error, never panic; a raw
//!   one decodes to its stored bytes.
#![no_main]

use jnf_format::{
    check_extent_storage, ExpertExtent, ExpertMatrix, ExtentCodec, ExtentEncoding, Header,
    MatrixRole,
};
use libfuzzer_sys::fuzz_target;

/// Decodes `stored` as `e`, checks the round trip, and returns whether it decoded.
fn decode(e: &ExpertExtent, stored: &[u8]) -> bool {
    let mut out = vec![0u8; e.length as usize];
    if e.decode_stored(stored, &mut out).is_err() {
        return false;
    }
    match e.codec {
        ExtentCodec::Raw => assert_eq!(out, stored),
        ExtentCodec::ExponentPlaneZstd => {
            let again = jnf_codec::encode(&out).expect("decoded bytes are whole BF16 values");
            assert_eq!(
                jnf_codec::decode(&again, out.len()).expect("its own encoding decodes"),
                out
            );
        }
    }
    true
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    if sel & 1 == 0 {
        let Ok(h) = Header::parse(rest, rest.len() as u64) else {
            return;
        };
        for e in h.experts.iter().take(64) {
            if e.is_encoded() {
                assert!(
                    e.length <= 2 * e.stored_length,
                    "{}: decoded bound",
                    e.prefix
                );
            }
            // validated: the stored bytes lie inside the file
            let stored = &rest[e.offset as usize..(e.offset + e.stored_length) as usize];
            decode(e, stored);
        }
        return;
    }
    let Some((len, stored)) = rest.split_first_chunk::<4>() else {
        return;
    };
    let length = u64::from(u32::from_le_bytes(*len) & 0x3_FFFF);
    let codec = if sel & 2 == 0 {
        ExtentCodec::Raw
    } else {
        ExtentCodec::ExponentPlaneZstd
    };
    let stored_length = stored.len() as u64;
    if check_extent_storage(codec, ExtentEncoding::Bf16, stored_length, length).is_err() {
        return;
    }
    let matrix = ExpertMatrix {
        role: MatrixRole::Gate,
        name: "model.layers.0.mlp.experts.0.gate_proj.weight".into(),
        dtype: jnf_format::Dtype::BF16,
        shape: vec![length / 2],
        offset: 0,
        length,
        source: None,
    };
    let e = ExpertExtent {
        layer: 0,
        expert: 0,
        prefix: "model.layers.0.mlp.experts.0".into(),
        offset: 0,
        length,
        padded_length: jnf_format::align_up(stored_length).unwrap_or(0),
        codec,
        stored_length,
        matrices: vec![matrix],
    };
    decode(&e, stored);
});
