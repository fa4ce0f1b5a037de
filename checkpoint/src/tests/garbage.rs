//! No panic on any input: random bytes, random token soup, and mutations of a valid file, each
//! compared with the `safetensors` crate (we may be stricter only about duplicate keys).

use std::path::Path;

use super::*;
use crate::{CheckpointError as E, SafetensorsHeader};

/// splitmix64: deterministic, so a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Parses with both readers and checks they agree: same tensors when both accept; when only the
/// crate accepts, the reason must be a duplicate key (which it resolves silently).
fn differential(bytes: &[u8]) {
    let ours = SafetensorsHeader::from_bytes(Path::new("m.safetensors"), bytes);
    let theirs = safetensors::SafeTensors::read_metadata(bytes);
    match (&ours, &theirs) {
        (Ok(h), Ok((n, meta))) => {
            assert_eq!(h.header_len, *n as u64);
            let mut theirs: Vec<_> = meta
                .tensors()
                .into_iter()
                .map(|(k, i)| {
                    (
                        k,
                        i.dtype,
                        i.shape.iter().map(|&d| d as u64).collect::<Vec<_>>(),
                        i.data_offsets,
                    )
                })
                .collect();
            theirs.sort_by(|a, b| (a.3, &a.0).cmp(&(b.3, &b.0)));
            let ours: Vec<_> = h
                .tensors
                .iter()
                .map(|t| {
                    (
                        t.name.clone(),
                        t.dtype,
                        t.shape.clone(),
                        (t.begin as usize, t.end as usize),
                    )
                })
                .collect();
            assert_eq!(ours, theirs);
        }
        (Ok(_), Err(e)) => panic!(
            "we accepted what safetensors refuses ({e:?}): {:?}",
            String::from_utf8_lossy(bytes)
        ),
        // Stricter than safetensors on purpose: duplicates, and names that could display as
        // other names.
        (
            Err(E::DuplicateTensor { .. } | E::DuplicateJsonKey { .. } | E::TensorNameChar { .. }),
            Ok(_),
        ) => {}
        (Err(e), Ok(_)) => panic!(
            "we refused what safetensors accepts ({e}): {:?}",
            String::from_utf8_lossy(bytes)
        ),
        (Err(e), Err(_)) => check_message(e),
    }
}

#[test]
fn random_bytes() {
    let mut rng = Rng(1);
    for _ in 0..20_000 {
        let len = rng.below(200);
        let mut bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        if len >= 8 && rng.below(2) == 0 {
            // A plausible length prefix, so the JSON parser gets the rest.
            let n = rng.below(len - 7) as u64;
            bytes[..8].copy_from_slice(&n.to_le_bytes());
        }
        differential(&bytes);
    }
}

/// Headers that are JSON and mostly well-formed, with random names (often repeated), dtypes
/// (some unknown), shapes (some huge) and offsets (mostly near the right ones), so the deeper
/// rules (gaps, overlaps, lengths, bounds, duplicates) are exercised, not just the JSON parser.
#[test]
fn random_structured_headers() {
    const NAMES: &[&str] = &["a", "b", "c", "a\\u0000", "__metadata__"];
    const DTYPES: &[&str] = &[
        "BF16", "F32", "U8", "F4", "F6_E2M3", "F64", "BOOL", "bf16", "Q4",
    ];
    const DIMS: &[u64] = &[0, 1, 2, 3, 7, 4294967296, 18446744073709551615];
    let mut rng = Rng(2);
    let mut outcomes = std::collections::BTreeSet::new();
    for _ in 0..40_000 {
        let mut entries = Vec::new();
        let mut offset = 0u64;
        for _ in 0..rng.below(5) {
            let name = NAMES[rng.below(NAMES.len())];
            if name == "__metadata__" {
                let v = ["{\"k\":\"v\"}", "null", "{\"k\":1}", "[]"][rng.below(4)];
                entries.push(format!("\"{name}\":{v}"));
                continue;
            }
            let dtype = DTYPES[rng.below(DTYPES.len())];
            let shape: Vec<u64> = (0..rng.below(3))
                .map(|_| {
                    let pool = if rng.below(8) == 0 { DIMS.len() } else { 5 };
                    DIMS[rng.below(pool)]
                })
                .collect();
            let bits = crate::header::parse_dtype(dtype).map_or(16, |d| d.bitsize() as u64);
            let len = shape
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .and_then(|n| n.checked_mul(bits))
                .map_or(0, |b| b / 8);
            let noise = |r: &mut Rng| {
                if r.below(6) == 0 {
                    r.below(5) as u64
                } else {
                    0
                }
            };
            let begin = offset
                .saturating_add(noise(&mut rng))
                .saturating_sub(noise(&mut rng));
            let end = begin
                .saturating_add(len)
                .saturating_add(noise(&mut rng))
                .saturating_sub(noise(&mut rng));
            offset = end;
            let shape = shape
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(",");
            let field = [
                format!("\"dtype\":\"{dtype}\""),
                format!("\"shape\":[{shape}]"),
                format!("\"data_offsets\":[{begin},{end}]"),
            ];
            let fields: Vec<&String> = field.iter().filter(|_| rng.below(30) != 0).collect();
            let fields: Vec<&str> = fields.iter().map(|f| f.as_str()).collect();
            entries.push(format!("\"{name}\":{{{}}}", fields.join(",")));
        }
        let header = format!("{{{}}}", entries.join(","));
        let data_len = (offset as usize).min(64) + if rng.below(6) == 0 { rng.below(3) } else { 0 };
        let bytes = raw_safetensors(&header, &vec![0; data_len]);
        differential(&bytes);
        let outcome = match SafetensorsHeader::from_bytes(Path::new("m"), &bytes) {
            Ok(_) => "Ok".to_owned(),
            Err(e) => format!("{e:?}")
                .split([' ', '{'])
                .next()
                .unwrap()
                .to_owned(),
        };
        outcomes.insert(outcome);
    }
    // The generator must reach the deep rules, or this test proves little.
    for rule in [
        "Ok",
        "DuplicateTensor",
        "DataGap",
        "DataOverlap",
        "LengthMismatch",
        "TrailingBytes",
        "DataOutOfBounds",
        "ShapeOverflow",
        "MisalignedSubByte",
        "UnknownDtype",
        "InvalidMetadata",
        "InvalidTensorEntry",
        "OffsetsReversed",
    ] {
        assert!(
            outcomes.contains(rule),
            "never reached {rule}: {outcomes:?}"
        );
    }
}

fn small_valid_file() -> Vec<u8> {
    let specs = [
        ("a", "BF16", vec![2u64, 3]),
        ("b", "F32", vec![]),
        ("c", "U8", vec![0, 5]),
        ("d", "F4", vec![4]),
        ("e", "F64", vec![1, 1, 1]),
    ];
    let specs: Vec<Spec> = specs
        .into_iter()
        .map(|(n, d, s)| Spec {
            name: n.into(),
            dtype: d.into(),
            shape: s,
        })
        .collect();
    safetensors_bytes(&specs)
}

#[test]
fn mutated_valid_files() {
    let base = small_valid_file();
    differential(&base);
    SafetensorsHeader::from_bytes(Path::new("m"), &base).unwrap();
    let header_end = 8 + u64::from_le_bytes(base[..8].try_into().unwrap()) as usize;
    let mut rng = Rng(3);
    for _ in 0..30_000 {
        let mut m = base.clone();
        for _ in 0..1 + rng.below(3) {
            match rng.below(7) {
                // Flip a bit somewhere in the header.
                0 if !m.is_empty() => {
                    let i = rng.below(header_end.min(m.len()));
                    m[i] ^= 1 << rng.below(8);
                }
                // Replace a digit in the header by another digit.
                1 => {
                    let digits: Vec<usize> = (8..header_end.min(m.len()))
                        .filter(|&i| m[i].is_ascii_digit())
                        .collect();
                    if !digits.is_empty() {
                        m[digits[rng.below(digits.len())]] = b'0' + rng.below(10) as u8;
                    }
                }
                // Truncate.
                2 => m.truncate(rng.below(m.len() + 1)),
                // Append.
                3 => m.extend((0..1 + rng.below(8)).map(|_| rng.next() as u8)),
                // Nudge the length prefix.
                4 if m.len() >= 8 => {
                    let n = u64::from_le_bytes(m[..8].try_into().unwrap())
                        .wrapping_add(rng.below(17) as u64)
                        .wrapping_sub(8);
                    m[..8].copy_from_slice(&n.to_le_bytes());
                }
                // Overwrite a header byte with a JSON-significant character.
                5 if header_end <= m.len() => {
                    let i = 8 + rng.below(header_end - 8);
                    m[i] = b"{}[]:,\" 0"[rng.below(9)];
                }
                // Random byte anywhere.
                _ if !m.is_empty() => {
                    let i = rng.below(m.len());
                    m[i] = rng.next() as u8;
                }
                _ => {}
            }
        }
        differential(&m);
    }
}

#[test]
fn mutated_shards_through_open() {
    let t = Tiny::qwen3().single();
    let dir = t.write();
    let base = std::fs::read(dir.join("model.safetensors")).unwrap();
    let mut rng = Rng(4);
    for _ in 0..300 {
        let mut m = base.clone();
        let i = rng.below(m.len().min(4000));
        m[i] ^= 1 << rng.below(8);
        if rng.below(4) == 0 {
            m.truncate(rng.below(m.len()));
        }
        std::fs::write(dir.join("model.safetensors"), &m).unwrap();
        if let Err(e) = open(&dir) {
            check_message(&e);
        }
    }
}

#[test]
fn garbage_side_files_through_open() {
    let t = Tiny::qwen3();
    let dir = t.write();
    let config = std::fs::read(dir.join("config.json")).unwrap();
    let index = std::fs::read(dir.join(crate::INDEX_FILE)).unwrap();
    let mut rng = Rng(5);
    for round in 0..400 {
        let (name, base) = if round % 2 == 0 {
            ("config.json", &config)
        } else {
            (crate::INDEX_FILE, &index)
        };
        let mut m = base.clone();
        for _ in 0..1 + rng.below(3) {
            let i = rng.below(m.len());
            m[i] = b"{}[]:,\"0 a\\\xff"[rng.below(12)];
        }
        std::fs::write(dir.join(name), &m).unwrap();
        if let Err(e) = open(&dir) {
            check_message(&e);
        }
        std::fs::write(dir.join(name), base).unwrap();
    }
}
