//! The lossless extent codecs' decoder (issue 24; `validation/codec`) on hostile bytes. The first
//! byte picks the codec and the mode:
//! - even: the rest is an encoded extent: decoding must not panic or allocate past the bound,
//!   and what it accepts must re-encode and decode to the same bytes;
//! - odd: the rest is raw BF16 (an even prefix of it): encode then decode must give it back.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tarfa_codec_lab::{decode, encode, Codec};

/// The largest extent a hostile header may claim here (a reader bounds it by the manifest's).
const MAX_ELEMS: usize = 1 << 16;

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let codec = Codec::ALL[(sel as usize >> 1) % Codec::ALL.len()];
    if sel & 1 == 0 {
        if let Ok(out) = decode(codec, rest, MAX_ELEMS) {
            assert!(out.len() <= 2 * MAX_ELEMS);
            let again = decode(codec, &encode(codec, &out, 1), MAX_ELEMS).expect("own encoding");
            assert_eq!(again, out);
        }
    } else {
        let raw = &rest[..rest.len() & !1];
        let enc = encode(codec, raw, 1);
        assert_eq!(decode(codec, &enc, raw.len() / 2).expect("own encoding"), raw);
    }
});
