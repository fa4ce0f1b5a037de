//! Logits files: what `tarfa-run generate --logits-out` writes (a safetensors file with `tokens`
//! I64 [n], `logits` F32 [n, vocab], optionally `prefill_logits` F32 [prompt_len, vocab], and
//! metadata `{"root_digest": hex}`), the oracle's `reference.safetensors`, and the two ways the
//! checks compare them: bytewise (invariance) and within the oracle tolerance (f32 logits).

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use safetensors::{Dtype, SafeTensors};

/// A matrix of f32 rows.
#[derive(Clone, Debug, PartialEq)]
pub struct Rows {
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Rows {
    pub fn len(&self) -> usize {
        self.data.len().checked_div(self.cols).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }
}

fn f32_rows(st: &SafeTensors, name: &str) -> Result<Rows> {
    let v = st.tensor(name).map_err(|_| anyhow!("no tensor `{name}`"))?;
    if v.dtype() != Dtype::F32 {
        bail!("`{name}` is {:?}, not F32", v.dtype());
    }
    let shape = v.shape();
    if shape.len() != 2 {
        bail!("`{name}` has shape {shape:?}, not [rows, vocab]");
    }
    let data = v
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    Ok(Rows {
        cols: shape[1],
        data,
    })
}

fn i64_vec(st: &SafeTensors, name: &str) -> Result<(Vec<i64>, Vec<usize>)> {
    let v = st.tensor(name).map_err(|_| anyhow!("no tensor `{name}`"))?;
    if v.dtype() != Dtype::I64 {
        bail!("`{name}` is {:?}, not I64", v.dtype());
    }
    let data = v
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    Ok((data, v.shape().to_vec()))
}

fn metadata(bytes: &[u8]) -> Result<BTreeMap<String, String>> {
    let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| anyhow!("{e}"))?;
    Ok(meta
        .metadata()
        .clone()
        .map(|m| m.into_iter().collect())
        .unwrap_or_default())
}

/// A `--logits-out` file, checked for the documented dtypes and shapes.
#[derive(Clone, Debug)]
pub struct LogitsFile {
    /// The generated tokens.
    pub tokens: Vec<u32>,
    /// Row i chose `tokens[i]`.
    pub logits: Rows,
    pub prefill_logits: Option<Rows>,
    pub root_digest: Option<String>,
}

impl LogitsFile {
    pub fn read(path: &Path) -> Result<LogitsFile> {
        let bytes = fs::read(path).with_context(|| format!("read {}", path.display()))?;
        Self::parse(&bytes).with_context(|| format!("{}", path.display()))
    }

    pub fn parse(bytes: &[u8]) -> Result<LogitsFile> {
        let st = SafeTensors::deserialize(bytes).map_err(|e| anyhow!("not safetensors: {e}"))?;
        let (tokens, shape) = i64_vec(&st, "tokens")?;
        if shape.len() != 1 {
            bail!("`tokens` has shape {shape:?}, not [n]");
        }
        let tokens = tokens
            .into_iter()
            .map(|t| u32::try_from(t).map_err(|_| anyhow!("token {t} is not a token id")))
            .collect::<Result<Vec<u32>>>()?;
        let logits = f32_rows(&st, "logits")?;
        if logits.len() != tokens.len() {
            bail!(
                "`logits` has {} rows for {} generated tokens",
                logits.len(),
                tokens.len()
            );
        }
        let prefill_logits = match st.tensor("prefill_logits") {
            Ok(_) => {
                let p = f32_rows(&st, "prefill_logits")?;
                if p.cols != logits.cols && !tokens.is_empty() {
                    bail!(
                        "prefill_logits has {} columns, logits {}",
                        p.cols,
                        logits.cols
                    );
                }
                Some(p)
            }
            Err(_) => None,
        };
        let meta = metadata(bytes)?;
        for name in st.names() {
            // prompt_tokens: the ids the run was given (tarfa-run records them for audits).
            if !["prompt_tokens", "tokens", "logits", "prefill_logits"].contains(&name) {
                bail!("unexpected tensor `{name}`");
            }
        }
        Ok(LogitsFile {
            tokens,
            logits,
            prefill_logits,
            root_digest: meta.get("root_digest").cloned(),
        })
    }

    /// Logit vectors in the file: generated rows plus prefill rows.
    pub fn vectors(&self) -> usize {
        self.logits.len() + self.prefill_logits.as_ref().map_or(0, Rows::len)
    }
}

/// The outcome of a bytewise comparison of two logits files.
#[derive(Clone, Debug, PartialEq)]
pub struct ByteComparison {
    pub identical: bool,
    /// Bytes compared (the baseline file's size).
    pub bytes: u64,
    /// Logit vectors in the baseline file.
    pub vectors: usize,
    /// Where the files first differ, when they do.
    pub first_difference: Option<String>,
}

/// Compare two logits files byte for byte; on a difference, say where (tensor, row, column, the
/// two values and their bits).
pub fn compare_bytes(baseline: &Path, other: &Path) -> Result<ByteComparison> {
    let a = fs::read(baseline).with_context(|| format!("read {}", baseline.display()))?;
    let b = fs::read(other).with_context(|| format!("read {}", other.display()))?;
    let fa = LogitsFile::parse(&a).with_context(|| format!("{}", baseline.display()))?;
    let identical = a == b;
    let first_difference = if identical {
        None
    } else {
        Some(match LogitsFile::parse(&b) {
            Err(e) => format!("{}: {e:#}", other.display()),
            Ok(fb) => locate_difference(&fa, &fb),
        })
    };
    Ok(ByteComparison {
        identical,
        bytes: a.len() as u64,
        vectors: fa.vectors(),
        first_difference,
    })
}

/// The first place two parsed logits files differ.
pub fn locate_difference(a: &LogitsFile, b: &LogitsFile) -> String {
    if a.tokens != b.tokens {
        let i = a
            .tokens
            .iter()
            .zip(&b.tokens)
            .take_while(|(x, y)| x == y)
            .count();
        return format!(
            "generated tokens differ from step {i}: {:?} vs {:?}",
            a.tokens.get(i),
            b.tokens.get(i)
        );
    }
    let pairs = [
        (
            "prefill_logits",
            a.prefill_logits.as_ref(),
            b.prefill_logits.as_ref(),
        ),
        ("logits", Some(&a.logits), Some(&b.logits)),
    ];
    for (name, x, y) in pairs {
        match (x, y) {
            (None, None) => {}
            (Some(x), Some(y)) if x.cols == y.cols && x.len() == y.len() => {
                for (i, (u, v)) in x.data.iter().zip(&y.data).enumerate() {
                    if u.to_bits() != v.to_bits() {
                        return format!(
                            "{name}[{}][{}]: {u:e} ({:#010x}) vs {v:e} ({:#010x})",
                            i / x.cols,
                            i % x.cols,
                            u.to_bits(),
                            v.to_bits()
                        );
                    }
                }
            }
            _ => return format!("`{name}` is present or shaped differently"),
        }
    }
    if a.root_digest != b.root_digest {
        return format!(
            "metadata root_digest {:?} vs {:?}",
            a.root_digest, b.root_digest
        );
    }
    "the tensors are equal but the files' bytes differ (header order or metadata)".to_string()
}

/// The oracle's measure: `max_i |got_i - want_i| / max_i |want_i|`.
pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "rows of different widths");
    let scale = want.iter().fold(0f64, |m, &w| m.max((w as f64).abs()));
    let diff = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (&g, &w)| m.max((g as f64 - w as f64).abs()));
    if scale == 0.0 {
        if diff == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        diff / scale
    }
}

/// What transformers computed for one prompt (fixtures/oracle/README.md).
#[derive(Clone, Debug)]
pub struct OraclePrompt {
    pub prompt: Vec<u32>,
    pub greedy: Vec<u32>,
    /// [steps, vocab]; row j chose `greedy[j]`.
    pub step_logits: Rows,
    /// [prompt_len, vocab].
    pub prefill_logits: Rows,
    /// [moe layer][position] -> top-k expert ids (compared as sets).
    pub router_topk: Vec<Vec<Vec<u32>>>,
}

/// Every prompt of a `reference.safetensors`.
pub fn read_reference(path: &Path) -> Result<Vec<OraclePrompt>> {
    let bytes = fs::read(path).with_context(|| format!("read {}", path.display()))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let names: std::collections::BTreeSet<String> =
        st.names().into_iter().map(str::to_string).collect();
    let ids = |v: Vec<i64>| -> Result<Vec<u32>> {
        v.into_iter()
            .map(|t| u32::try_from(t).map_err(|_| anyhow!("token {t}")))
            .collect()
    };
    let mut out = Vec::new();
    for i in 0.. {
        if !names.contains(&format!("prompt.{i}")) {
            break;
        }
        let prompt = ids(i64_vec(&st, &format!("prompt.{i}"))?.0)?;
        let greedy = ids(i64_vec(&st, &format!("greedy.{i}"))?.0)?;
        let mut router_topk = Vec::new();
        for l in 0.. {
            let name = format!("prefill_router_topk.{i}.{l}");
            if !names.contains(&name) {
                break;
            }
            let (flat, shape) = i64_vec(&st, &name)?;
            let k = *shape.get(1).unwrap_or(&1);
            router_topk.push(
                flat.chunks_exact(k.max(1))
                    .map(|r| ids(r.to_vec()))
                    .collect::<Result<_>>()?,
            );
        }
        out.push(OraclePrompt {
            prompt,
            greedy,
            step_logits: f32_rows(&st, &format!("step_logits.{i}"))?,
            prefill_logits: f32_rows(&st, &format!("prefill_logits.{i}"))?,
            router_topk,
        });
    }
    if out.is_empty() {
        bail!("{}: no prompt.0", path.display());
    }
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    /// A logits file as the runtime documents it, written with the safetensors crate.
    pub fn write_logits(
        tokens: &[i64],
        logits: &[f32],
        vocab: usize,
        prefill: Option<(&[f32], usize)>,
        root: &str,
    ) -> Vec<u8> {
        let tb: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let lb: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut views = vec![
            (
                "tokens".to_string(),
                TensorView::new(Dtype::I64, vec![tokens.len()], &tb).unwrap(),
            ),
            (
                "logits".to_string(),
                TensorView::new(Dtype::F32, vec![tokens.len(), vocab], &lb).unwrap(),
            ),
        ];
        let pb: Vec<u8>;
        if let Some((p, rows)) = prefill {
            pb = p.iter().flat_map(|x| x.to_le_bytes()).collect();
            views.push((
                "prefill_logits".to_string(),
                TensorView::new(Dtype::F32, vec![rows, vocab], &pb).unwrap(),
            ));
        }
        let meta = [("root_digest".to_string(), root.to_string())]
            .into_iter()
            .collect();
        safetensors::serialize(views, Some(meta)).unwrap()
    }

    #[test]
    fn a_documented_file_parses() {
        let b = write_logits(
            &[3, 1],
            &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
            3,
            Some((&[9.0; 3], 1)),
            "ab",
        );
        let f = LogitsFile::parse(&b).unwrap();
        assert_eq!(f.tokens, [3, 1]);
        assert_eq!(f.logits.row(1), [3.0, 4.0, 5.0]);
        assert_eq!(f.prefill_logits.unwrap().len(), 1);
        assert_eq!(f.root_digest.as_deref(), Some("ab"));
    }

    #[test]
    fn rows_that_do_not_match_the_tokens_are_refused() {
        let b = write_logits(&[3], &[0.0; 3], 3, None, "ab");
        assert!(LogitsFile::parse(&b).is_ok());
        // two rows for one token: write by hand
        let tb = 3i64.to_le_bytes();
        let lb = [0u8; 24];
        let views = vec![
            ("tokens", TensorView::new(Dtype::I64, vec![1], &tb).unwrap()),
            (
                "logits",
                TensorView::new(Dtype::F32, vec![2, 3], &lb).unwrap(),
            ),
        ];
        let b = safetensors::serialize(views, None).unwrap();
        let e = LogitsFile::parse(&b).unwrap_err().to_string();
        assert!(e.contains("2 rows for 1"), "{e}");
    }

    #[test]
    fn bf16_logits_are_refused() {
        let tb = 3i64.to_le_bytes();
        let lb = [0u8; 6];
        let views = vec![
            ("tokens", TensorView::new(Dtype::I64, vec![1], &tb).unwrap()),
            (
                "logits",
                TensorView::new(Dtype::BF16, vec![1, 3], &lb).unwrap(),
            ),
        ];
        let b = safetensors::serialize(views, None).unwrap();
        assert!(LogitsFile::parse(&b)
            .unwrap_err()
            .to_string()
            .contains("not F32"));
    }

    #[test]
    fn the_first_differing_logit_is_located_to_the_bit() {
        let d = tempfile::tempdir().unwrap();
        let a = d.path().join("a");
        let b = d.path().join("b");
        let base = [1.0f32, 2.0, 3.0, 4.0];
        let mut other = base;
        other[3] = f32::from_bits(other[3].to_bits() + 1);
        fs::write(
            &a,
            write_logits(&[0, 1], &base, 2, Some((&[7.0, 8.0], 1)), "r"),
        )
        .unwrap();
        fs::write(
            &b,
            write_logits(&[0, 1], &other, 2, Some((&[7.0, 8.0], 1)), "r"),
        )
        .unwrap();
        let same = compare_bytes(&a, &a).unwrap();
        assert!(same.identical);
        assert_eq!(same.vectors, 3);
        let c = compare_bytes(&a, &b).unwrap();
        assert!(!c.identical);
        let where_ = c.first_difference.unwrap();
        assert!(where_.starts_with("logits[1][1]"), "{where_}");
        assert!(
            where_.contains("0x40800000") && where_.contains("0x40800001"),
            "{where_}"
        );
    }

    #[test]
    fn negative_zero_is_a_difference() {
        let x = LogitsFile::parse(&write_logits(&[0], &[0.0, 1.0], 2, None, "r")).unwrap();
        let y = LogitsFile::parse(&write_logits(&[0], &[-0.0, 1.0], 2, None, "r")).unwrap();
        assert!(locate_difference(&x, &y).starts_with("logits[0][0]"));
    }

    #[test]
    fn rel_err_is_relative_to_the_rows_scale() {
        assert_eq!(rel_err(&[1.0, -4.0], &[1.0, -4.0]), 0.0);
        assert!((rel_err(&[1.0, -4.0004], &[1.0, -4.0]) - 1e-4).abs() < 1e-7);
        assert_eq!(rel_err(&[1.0], &[0.0]), f64::INFINITY);
    }

    #[test]
    fn the_oracle_reference_reads() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures/oracle/qwen3moe-a/reference.safetensors");
        let r = read_reference(&p).unwrap();
        assert_eq!(r.len(), 4);
        assert_eq!(r[3].prompt.len(), 100);
        assert_eq!(r[3].prefill_logits.len(), 100);
        assert_eq!(r[0].step_logits.len(), r[0].greedy.len());
        assert_eq!(r[0].router_topk.len(), 4);
        assert_eq!(r[0].router_topk[0][0].len(), 8);
    }
}
