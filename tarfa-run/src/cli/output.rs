//! The files a run writes for audits and the validation suite: the logits file, the router
//! trace, the verification report and the summary. Each is byte-for-byte reproducible: nothing
//! that varies between identical runs (times, paths) goes into the logits file.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;
use tarfa_run::cpu::RouterRecord;

use super::CliError;

/// Rows of f32 as little-endian bytes.
fn f32_bytes(rows: &[Vec<f32>]) -> Vec<u8> {
    rows.iter()
        .flatten()
        .flat_map(|v| v.to_le_bytes())
        .collect()
}

/// `--logits-out`: `tokens` I64 [n], `logits` F32 [n, vocab] (row i chose tokens[i]), optionally
/// `prefill_logits` F32 [prompt_len, vocab]; metadata: the bundle's root digest only.
pub fn write_logits(
    path: &Path,
    root_digest: &str,
    vocab: usize,
    tokens: &[u32],
    step_logits: &[Vec<f32>],
    prefill_logits: Option<&[Vec<f32>]>,
) -> Result<(), CliError> {
    let tok_bytes: Vec<u8> = tokens
        .iter()
        .flat_map(|&t| (t as i64).to_le_bytes())
        .collect();
    let logit_bytes = f32_bytes(step_logits);
    let prefill_bytes = prefill_logits.map(f32_bytes);
    fn view<'a>(
        path: &Path,
        dtype: Dtype,
        shape: Vec<usize>,
        data: &'a [u8],
    ) -> Result<TensorView<'a>, CliError> {
        TensorView::new(dtype, shape, data).map_err(|e| CliError::Io {
            path: path.to_path_buf(),
            op: "build logits tensor",
            source: std::io::Error::other(e.to_string()),
        })
    }
    let mut tensors = vec![
        (
            "tokens".to_string(),
            view(path, Dtype::I64, vec![tokens.len()], &tok_bytes)?,
        ),
        (
            "logits".to_string(),
            view(
                path,
                Dtype::F32,
                vec![step_logits.len(), vocab],
                &logit_bytes,
            )?,
        ),
    ];
    if let (Some(rows), Some(bytes)) = (prefill_logits, prefill_bytes.as_ref()) {
        tensors.push((
            "prefill_logits".to_string(),
            view(path, Dtype::F32, vec![rows.len(), vocab], bytes)?,
        ));
    }
    let meta: HashMap<String, String> =
        [("root_digest".to_string(), root_digest.to_string())].into();
    safetensors::serialize_to_file(tensors, Some(meta), path).map_err(|e| CliError::Io {
        path: path.to_path_buf(),
        op: "write logits",
        source: std::io::Error::other(e.to_string()),
    })
}

/// `--router-trace`: JSON Lines, a header then one line per (layer, token).
pub struct RouterTrace {
    path: PathBuf,
    out: BufWriter<File>,
}

impl RouterTrace {
    pub fn create(path: &Path, header: serde_json::Value) -> Result<RouterTrace, CliError> {
        let f = File::create(path).map_err(CliError::io(path, "create router trace"))?;
        let mut t = RouterTrace {
            path: path.to_path_buf(),
            out: BufWriter::new(f),
        };
        t.line(&header)?;
        Ok(t)
    }

    fn line(&mut self, v: &serde_json::Value) -> Result<(), CliError> {
        writeln!(self.out, "{v}").map_err(CliError::io(&self.path, "write router trace"))
    }

    pub fn records(&mut self, rs: &[RouterRecord]) -> Result<(), CliError> {
        for r in rs {
            self.line(&json!({
                "kind": "route",
                "layer": r.layer,
                "moe_layer": r.moe_layer,
                "position": r.position,
                "experts": r.experts,
                "probs": r.probs,
                "weights": r.weights,
                "kth_prob": r.kth_prob,
                "next_prob": r.next_prob,
            }))?;
        }
        Ok(())
    }

    pub fn finish(mut self) -> Result<(), CliError> {
        self.out
            .flush()
            .map_err(CliError::io(&self.path, "write router trace"))
    }
}

/// Write a JSON document to `path`.
pub fn write_json(path: &Path, v: &impl serde::Serialize) -> Result<(), CliError> {
    let text = serde_json::to_string_pretty(v).expect("serialisable");
    std::fs::write(path, text + "\n").map_err(CliError::io(path, "write"))
}
