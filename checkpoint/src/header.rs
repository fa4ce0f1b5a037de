//! The safetensors header: every rule a `.safetensors` file must pass, in one place.
//!
//! Layout: 8 bytes little-endian `n`, then `n` bytes of UTF-8 JSON mapping tensor names to
//! `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to the data section,
//! which starts at `8 + n`), plus an optional `"__metadata__"` object of strings. The data section
//! must be covered exactly: tensors contiguous from 0, no gaps, no overlaps, nothing after the
//! last one. These are the `safetensors` crate's rules, checked here with our own errors, plus
//! duplicate names, which that crate reports wrongly or not at all.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use crate::error::CheckpointError;
use crate::json::{first_duplicate_key, render_path};
use crate::{read_exact_at, Dtype, MAX_HEADER_LEN};

/// A validated safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SafetensorsHeader {
    /// `n`, the JSON header's length in bytes.
    pub header_len: u64,
    /// The `__metadata__` map, if the header has one.
    pub metadata: Option<BTreeMap<String, String>>,
    /// The tensors in data order (ascending offsets); their ranges tile the data section.
    pub tensors: Vec<HeaderTensor>,
}

/// One tensor of a validated header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Byte range `[begin, end)` within the data section (add [`SafetensorsHeader::data_start`]
    /// for the file offset).
    pub begin: u64,
    pub end: u64,
}

impl SafetensorsHeader {
    /// File offset of the data section: `8 + header_len`.
    pub fn data_start(&self) -> u64 {
        8 + self.header_len
    }

    /// Validates a whole safetensors file held in memory. `file` only names it in errors.
    pub fn from_bytes(file: &Path, bytes: &[u8]) -> Result<Self, CheckpointError> {
        let file_len = bytes.len() as u64;
        let header_len = check_prefix(file, bytes.get(..8), file_len)?;
        // check_prefix proved 8 + header_len <= file_len, so this slice is in bounds.
        let header = &bytes[8..8 + header_len as usize];
        parse(file, header_len, header, file_len)
    }

    /// Validates the safetensors file behind an open handle. `file` only names it in errors.
    pub(crate) fn read(file: &Path, handle: &File, file_len: u64) -> Result<Self, CheckpointError> {
        let mut prefix = [0u8; 8];
        let got_prefix = if file_len >= 8 {
            read_exact_at(handle, &mut prefix, 0).map_err(|e| io(file, e))?;
            Some(&prefix[..])
        } else {
            None
        };
        let header_len = check_prefix(file, got_prefix, file_len)?;
        let mut header = vec![0u8; header_len as usize];
        read_exact_at(handle, &mut header, 8).map_err(|e| io(file, e))?;
        parse(file, header_len, &header, file_len)
    }
}

fn io(file: &Path, source: std::io::Error) -> CheckpointError {
    CheckpointError::Io {
        file: file.to_path_buf(),
        op: "reading the safetensors header",
        source,
    }
}

/// Checks the 8-byte length prefix against the cap and the file length; returns `n`.
fn check_prefix(file: &Path, prefix: Option<&[u8]>, file_len: u64) -> Result<u64, CheckpointError> {
    let Some(prefix) = prefix.and_then(|p| <[u8; 8]>::try_from(p).ok()) else {
        return Err(CheckpointError::FileTooSmall {
            file: file.into(),
            len: file_len,
        });
    };
    let header_len = u64::from_le_bytes(prefix);
    if header_len > MAX_HEADER_LEN {
        return Err(CheckpointError::HeaderTooLarge {
            file: file.into(),
            header_len,
        });
    }
    if header_len > file_len - 8 {
        return Err(CheckpointError::HeaderPastEnd {
            file: file.into(),
            header_len,
            file_len,
        });
    }
    Ok(header_len)
}

#[derive(Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

fn parse(
    file: &Path,
    header_len: u64,
    header: &[u8],
    file_len: u64,
) -> Result<SafetensorsHeader, CheckpointError> {
    let f = || PathBuf::from(file);
    let text = std::str::from_utf8(header).map_err(|e| CheckpointError::HeaderNotUtf8 {
        file: f(),
        valid_up_to: e.valid_up_to(),
    })?;
    match first_duplicate_key(text) {
        Err(e) => {
            return Err(CheckpointError::HeaderInvalidJson {
                file: f(),
                message: e.to_string(),
            })
        }
        Ok(Some(path)) if path.len() == 1 && path[0] != "__metadata__" => {
            return Err(CheckpointError::DuplicateTensor {
                file: f(),
                tensor: path[0].clone(),
            })
        }
        Ok(Some(path)) => {
            return Err(CheckpointError::DuplicateJsonKey {
                file: f(),
                key_path: render_path(&path),
            })
        }
        Ok(None) => {}
    }
    let entries: serde_json::Map<String, Value> =
        serde_json::from_str(text).map_err(|e| CheckpointError::HeaderInvalidJson {
            file: f(),
            message: e.to_string(),
        })?;

    let mut metadata = None;
    let mut tensors = Vec::with_capacity(entries.len());
    for (name, value) in entries {
        if name == "__metadata__" {
            // `null` is accepted as "no metadata", like the safetensors crate does.
            metadata =
                serde_json::from_value::<Option<BTreeMap<String, String>>>(value).map_err(|e| {
                    CheckpointError::InvalidMetadata {
                        file: f(),
                        message: e.to_string(),
                    }
                })?;
            continue;
        }
        if let Some((c, what)) = suspicious_char(&name) {
            return Err(CheckpointError::TensorNameChar {
                file: f(),
                tensor: name,
                code: c as u32,
                what,
            });
        }
        let raw: RawEntry =
            serde_json::from_value(value).map_err(|e| CheckpointError::InvalidTensorEntry {
                file: f(),
                tensor: name.clone(),
                message: e.to_string(),
            })?;
        let dtype = parse_dtype(&raw.dtype).ok_or_else(|| CheckpointError::UnknownDtype {
            file: f(),
            tensor: name.clone(),
            dtype: raw.dtype.clone(),
        })?;
        let bits = raw
            .shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .and_then(|n| n.checked_mul(dtype.bitsize() as u64))
            .ok_or_else(|| CheckpointError::ShapeOverflow {
                file: f(),
                tensor: name.clone(),
                shape: raw.shape.clone(),
            })?;
        if !bits.is_multiple_of(8) {
            return Err(CheckpointError::MisalignedSubByte {
                file: f(),
                tensor: name,
            });
        }
        let (begin, end) = raw.data_offsets;
        if end < begin {
            return Err(CheckpointError::OffsetsReversed {
                file: f(),
                tensor: name,
                begin,
                end,
            });
        }
        if end - begin != bits / 8 {
            return Err(CheckpointError::LengthMismatch {
                file: f(),
                tensor: name,
                expected: bits / 8,
                actual: end - begin,
            });
        }
        tensors.push(HeaderTensor {
            name,
            dtype,
            shape: raw.shape,
            begin,
            end,
        });
    }

    // Ties (zero-length tensors at one offset) are ordered by name so the order is deterministic.
    tensors.sort_by(|a, b| (a.begin, a.end, &a.name).cmp(&(b.begin, b.end, &b.name)));
    let mut covered = 0u64;
    for t in &tensors {
        if t.begin > covered {
            return Err(CheckpointError::DataGap {
                file: f(),
                tensor: t.name.clone(),
                expected: covered,
                begin: t.begin,
            });
        }
        if t.begin < covered {
            return Err(CheckpointError::DataOverlap {
                file: f(),
                tensor: t.name.clone(),
                expected: covered,
                begin: t.begin,
            });
        }
        covered = t.end;
    }
    let data_len = file_len - 8 - header_len;
    if covered > data_len {
        let last = tensors.last().map(|t| t.name.clone()).unwrap_or_default();
        return Err(CheckpointError::DataOutOfBounds {
            file: f(),
            tensor: last,
            end: covered,
            data_len,
        });
    }
    if covered < data_len {
        return Err(CheckpointError::TrailingBytes {
            file: f(),
            extra: data_len - covered,
        });
    }
    Ok(SafetensorsHeader {
        header_len,
        metadata,
        tensors,
    })
}

/// The first character of a tensor name that could make it display as another name: a control
/// character, or a bidirectional override, embedding, isolate or mark (Trojan Source,
/// CVE-2021-42574). Such a name can be printed escaped, but never trusted by eye.
pub(crate) fn suspicious_char(name: &str) -> Option<(char, &'static str)> {
    name.chars().find_map(|c| match c {
        '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}' => {
            Some((c, "a bidirectional override or isolate"))
        }
        '\u{200E}' | '\u{200F}' | '\u{061C}' => Some((c, "a bidirectional mark")),
        c if c.is_control() => Some((c, "a control character")),
        _ => None,
    })
}

/// The safetensors dtype named `s` (its exact spelling in headers, e.g. `"BF16"`), if any.
pub(crate) fn parse_dtype(s: &str) -> Option<Dtype> {
    serde_json::from_value(Value::String(s.to_owned())).ok()
}
