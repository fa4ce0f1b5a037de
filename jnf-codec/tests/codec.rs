//! The exponent-plane codec: every BF16 bit pattern round-trips, the byte layout is the one
//! docs/FORMAT.md specifies, and every hostile encoding is a named error, never a panic.

use jnf_codec::{
    decode, decode_into, encode, encode_level, stored_len_is_possible, DecodeError, EncodeError,
    PREFIX_LEN,
};

fn every_pattern() -> Vec<u8> {
    (0..=u16::MAX).flat_map(|v| v.to_le_bytes()).collect()
}

/// N(0, 0.02)-like BF16 values from a fixed generator (what trained weights look like).
fn normal_weights(n: usize, mut s: u64) -> Vec<u8> {
    (0..n)
        .flat_map(|_| {
            let mut u = 0.0f32;
            for _ in 0..12 {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                u += (s >> 40) as f32 / (1u64 << 24) as f32;
            }
            (((0.02 * (u - 6.0)).to_bits() >> 16) as u16).to_le_bytes()
        })
        .collect()
}

/// The decoder written the plain way (a second buffer, no in-place interleave): what the
/// in-place one must agree with.
fn reference_decode(enc: &[u8]) -> Vec<u8> {
    let n = u64::from_le_bytes(enc[0..8].try_into().unwrap()) as usize;
    let z = u64::from_le_bytes(enc[8..16].try_into().unwrap()) as usize;
    let exp = zstd::bulk::decompress(&enc[16..16 + z], n).unwrap();
    let sm = &enc[16 + z..];
    exp.iter()
        .zip(sm)
        .flat_map(|(&e, &s)| {
            (((s as u16 & 0x80) << 8) | ((e as u16) << 7) | (s as u16 & 0x7F)).to_le_bytes()
        })
        .collect()
}

#[test]
fn every_bf16_pattern_round_trips() {
    let x = every_pattern();
    let e = encode(&x).unwrap();
    assert!(stored_len_is_possible(e.len() as u64, x.len() as u64));
    assert_eq!(decode(&e, x.len()).unwrap(), x);
    assert_eq!(reference_decode(&e), x);
}

#[test]
fn every_small_length_round_trips_in_place() {
    // The in-place interleave halves what is left each round: lengths 0..300 values reach
    // every shape of its last rounds (one value left, two, three, odd and even counts).
    let w = normal_weights(300, 7);
    for n in 0..=300 {
        let x = &w[..2 * n];
        let e = encode(x).unwrap();
        let mut out = vec![0xAAu8; 2 * n];
        decode_into(&e, &mut out).unwrap();
        assert_eq!(out, x, "{n} values");
    }
}

#[test]
fn the_byte_layout_is_the_documented_one() {
    // 0x3F80 = 1.0 (sign 0, exponent 127, mantissa 0); 0xC0A0 = -5.0 (sign 1, exponent 129,
    // mantissa 0x20)
    let x = [0x80u8, 0x3F, 0xA0, 0xC0];
    let e = encode(&x).unwrap();
    assert_eq!(u64::from_le_bytes(e[0..8].try_into().unwrap()), 2);
    let z = u64::from_le_bytes(e[8..16].try_into().unwrap()) as usize;
    assert_eq!(e.len(), 16 + z + 2);
    assert_eq!(
        zstd::bulk::decompress(&e[16..16 + z], 2).unwrap(),
        [127, 129]
    );
    assert_eq!(&e[16 + z..], [0x00, 0x80 | 0x20]);
}

#[test]
fn normal_weights_compress_to_about_two_thirds() {
    let x = normal_weights(1 << 18, 1);
    let e = encode(&x).unwrap();
    let ratio = e.len() as f64 / x.len() as f64;
    // (8 + ~2.5 bits) / 16 is the entropy bound; level 1 lands a few points above it
    assert!(
        ratio > 0.6 && ratio < 0.75,
        "stored {ratio:.3} of the raw size"
    );
    // a higher level only ever changes the frame, never what decodes
    let e19 = encode_level(&x, 19).unwrap();
    assert_eq!(decode(&e19, x.len()).unwrap(), x);
}

#[test]
fn odd_lengths_are_refused_both_ways() {
    assert_eq!(encode(&[1, 2, 3]), Err(EncodeError::OddLength { len: 3 }));
    let e = encode(&[1, 2]).unwrap();
    assert_eq!(
        decode_into(&e, &mut [0u8; 3]),
        Err(DecodeError::OddLength { len: 3 })
    );
    assert_eq!(decode(&e, 5), Err(DecodeError::OddLength { len: 5 }));
}

#[test]
fn hostile_encodings_are_named_errors() {
    let x = normal_weights(4096, 3);
    let e = encode(&x).unwrap();
    let n = x.len() / 2;
    let z = u64::from_le_bytes(e[8..16].try_into().unwrap());
    let mut out = vec![0u8; x.len()];

    for cut in [0, 7, 15] {
        assert_eq!(
            decode_into(&e[..cut], &mut out),
            Err(DecodeError::Truncated { len: cut })
        );
    }
    // cut inside the frame or the sign-mantissa plane: the plane is short
    for cut in [16, 16 + z as usize / 2, e.len() - 1] {
        assert!(
            matches!(
                decode_into(&e[..cut], &mut out),
                Err(DecodeError::FrameLength { .. } | DecodeError::SignMantissaLength { .. })
            ),
            "cut at {cut}"
        );
    }
    // a trailing byte: the sign-mantissa plane is one too long
    let mut longer = e.clone();
    longer.push(0);
    assert_eq!(
        decode_into(&longer, &mut out),
        Err(DecodeError::SignMantissaLength {
            got: n as u64 + 1,
            expected: n as u64
        })
    );
    // the value count is not the extent's
    assert_eq!(
        decode_into(&e, &mut out[..x.len() - 2]),
        Err(DecodeError::ValueCount {
            claimed: n as u64,
            expected: n as u64 - 1
        })
    );
    // a frame length past the end, and one that overflows any addition
    for claimed in [e.len() as u64, u64::MAX] {
        let mut f = e.clone();
        f[8..16].copy_from_slice(&claimed.to_le_bytes());
        assert!(matches!(
            decode_into(&f, &mut out),
            Err(DecodeError::FrameLength { .. })
        ));
    }
    // the frame's content one exponent short: zstd accepts it, the count does not
    let short = encode(&x[..x.len() - 2]).unwrap();
    let zs = u64::from_le_bytes(short[8..16].try_into().unwrap()) as usize;
    let mut f = e[..16].to_vec();
    f[8..16].copy_from_slice(&(zs as u64).to_le_bytes());
    f.extend_from_slice(&short[16..16 + zs]);
    f.extend_from_slice(&e[16 + z as usize..]);
    assert_eq!(
        decode_into(&f, &mut out),
        Err(DecodeError::ExponentCount {
            got: n as u64 - 1,
            expected: n as u64
        })
    );
    // a corrupt frame
    let mut f = e.clone();
    f[16..20].copy_from_slice(b"nope");
    assert!(matches!(
        decode_into(&f, &mut out),
        Err(DecodeError::ExponentFrame { .. })
    ));
    // flipped bytes anywhere: an error or other bytes, never a panic
    for at in (0..e.len()).step_by(7) {
        let mut f = e.clone();
        f[at] ^= 0x5A;
        let _ = decode_into(&f, &mut out);
    }
}

#[test]
fn a_huge_claimed_length_is_refused_before_allocating() {
    let e = encode(&[0x80, 0x3F]).unwrap();
    // would be 2^62 bytes if allocated first
    assert_eq!(
        decode(&e, 1 << 62),
        Err(DecodeError::TooShortFor {
            len: e.len() as u64,
            values: 1 << 61
        })
    );
}

#[test]
fn the_stored_length_bound_holds_for_every_encoding_and_rejects_impossible_ones() {
    for n in [0usize, 1, 2, 100, 4096] {
        let x = normal_weights(n, 5);
        let e = encode(&x).unwrap();
        assert!(stored_len_is_possible(e.len() as u64, x.len() as u64));
    }
    // exactly the prefix plus the raw plane leaves no room for a frame
    assert!(!stored_len_is_possible(PREFIX_LEN + 50, 100));
    assert!(stored_len_is_possible(PREFIX_LEN + 51, 100));
    // a decoded length that is not whole BF16 values
    assert!(!stored_len_is_possible(1000, 101));
    // and the bound caps the decoded length at twice the stored one
    assert!(!stored_len_is_possible(4096, 2 * 4096));
}
