//! Loads a Hugging Face checkpoint directory (`*.safetensors` shards) into an
//! [`InMemorySource`], splitting expert tensors out by the family's name patterns.
//!
//! Files are read into owned buffers and every tensor is copied out of them; nothing is
//! memory-mapped. There is no manifest here to verify against: this source is for tests and
//! development on Hub checkpoints, never for running a bundle.

use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use super::fused::{expert_from_fused, expert_from_mxfp4, Mxfp4Part};
use super::{Bf16Matrix, ExpertWeights, HostTensor, InMemorySource, TensorData, WeightError};
use crate::config::MoeConfig;
use crate::model::{expert_name, ArchSpec, MlpKind};
use crate::numerics::AlignedVec;
use crate::shapes::{FusedExpertRules, FusedTensorRule, ModelRules};

/// Reads every `*.safetensors` file in `dir` (sorted by name) and sorts its tensors into
/// non-expert tensors and the experts of `spec`'s MoE layers.
pub fn load_safetensors_dir(
    dir: &Path,
    cfg: &MoeConfig,
    spec: &ArchSpec,
) -> Result<InMemorySource, WeightError> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| WeightError::Io {
            path: dir.display().to_string(),
            source: e,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        // reference.safetensors next to a checkpoint holds oracle outputs, not weights
        .filter(|p| p.file_name().is_some_and(|n| n != "reference.safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(WeightError::NoFiles(dir.display().to_string()));
    }

    let mut all: std::collections::HashMap<String, HostTensor> = Default::default();
    // U8 tensors: MXFP4 blocks and scales, which only the fused-expert rules below may take.
    let mut raw_u8: std::collections::HashMap<String, (Vec<usize>, Vec<u8>)> = Default::default();
    for path in &files {
        let shown = path.display().to_string();
        let bytes = read_shard(path).map_err(|e| WeightError::Io {
            path: shown.clone(),
            source: e,
        })?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| WeightError::Safetensors {
            path: shown.clone(),
            msg: e.to_string(),
        })?;
        for (name, view) in st.tensors() {
            let raw = view.data();
            if view.dtype() == Dtype::U8 {
                if all.contains_key(&name)
                    || raw_u8
                        .insert(name.clone(), (view.shape().to_vec(), raw.to_vec()))
                        .is_some()
                {
                    return Err(WeightError::Duplicate(name));
                }
                continue;
            }
            if raw_u8.contains_key(&name) {
                return Err(WeightError::Duplicate(name));
            }
            let data = match view.dtype() {
                Dtype::BF16 => TensorData::Bf16(AlignedVec::<u16>::from_le_bytes(raw)),
                Dtype::F32 => TensorData::F32(AlignedVec::<f32>::from_le_bytes(raw)),
                other => {
                    return Err(WeightError::UnsupportedDtype {
                        name,
                        dtype: format!("{other:?}"),
                    })
                }
            };
            let t = HostTensor::new(&name, view.shape().to_vec(), data)?;
            if all.insert(name.clone(), t).is_some() {
                return Err(WeightError::Duplicate(name));
            }
        }
    }

    let mut source = InMemorySource::new();
    let names = &spec.names;
    let (h, i) = (cfg.hidden_size, cfg.expert_width);
    let rules = ModelRules::new(cfg, spec);
    for fused in &rules.fused {
        let layer = fused.layer();
        let shape_of = |r: &FusedTensorRule, found: &[usize]| -> Result<(), WeightError> {
            if found != r.shape.as_slice() {
                return Err(WeightError::ShapeMismatch {
                    name: r.name.clone(),
                    expected: r.shape.clone(),
                    found: found.to_vec(),
                });
            }
            Ok(())
        };
        let missing = |r: &FusedTensorRule| WeightError::MissingExpert {
            layer,
            expert: 0,
            name: r.name.clone(),
        };
        match fused {
            FusedExpertRules::Bf16 { gate_up, down, .. } => {
                let mut take = |r: &FusedTensorRule| -> Result<AlignedVec<u16>, WeightError> {
                    let t = all.remove(&r.name).ok_or_else(|| {
                        if raw_u8.contains_key(&r.name) {
                            WeightError::ExpertNotBf16 {
                                name: r.name.clone(),
                                dtype: "U8".into(),
                            }
                        } else {
                            missing(r)
                        }
                    })?;
                    shape_of(r, &t.shape)?;
                    match t.data {
                        TensorData::Bf16(d) => Ok(d),
                        TensorData::F32(_) => Err(WeightError::ExpertNotBf16 {
                            name: r.name.clone(),
                            dtype: "F32".into(),
                        }),
                    }
                };
                let (gu, d) = (take(gate_up)?, take(down)?);
                for e in 0..cfg.num_experts {
                    let ew = expert_from_fused(
                        spec.extras.expert_layout,
                        &gu[e * h * 2 * i..(e + 1) * h * 2 * i],
                        &d[e * i * h..(e + 1) * i * h],
                        h,
                        i,
                    );
                    source.insert_expert(layer, e, ew);
                }
            }
            FusedExpertRules::Mxfp4 {
                gate_up_blocks,
                gate_up_scales,
                down_blocks,
                down_scales,
                ..
            } => {
                let mut take = |r: &FusedTensorRule| -> Result<Vec<u8>, WeightError> {
                    let (shape, bytes) = raw_u8.remove(&r.name).ok_or_else(|| missing(r))?;
                    shape_of(r, &shape)?;
                    Ok(bytes)
                };
                let parts = [
                    take(gate_up_blocks)?,
                    take(gate_up_scales)?,
                    take(down_blocks)?,
                    take(down_scales)?,
                ];
                let per: Vec<usize> = [gate_up_blocks, gate_up_scales, down_blocks, down_scales]
                    .iter()
                    .map(|r| r.expert_bytes())
                    .collect();
                for e in 0..cfg.num_experts {
                    let s = |k: usize| &parts[k][e * per[k]..(e + 1) * per[k]];
                    let ew = expert_from_mxfp4(s(0), s(1), s(2), s(3), h, i).map_err(
                        |(part, err)| WeightError::Mxfp4 {
                            name: match part {
                                Mxfp4Part::GateUp => gate_up_scales.name.clone(),
                                Mxfp4Part::Down => down_scales.name.clone(),
                            },
                            expert: e,
                            msg: err.to_string(),
                        },
                    )?;
                    source.insert_expert(layer, e, ew);
                }
            }
        }
    }
    if let Some(name) = raw_u8.keys().min() {
        return Err(WeightError::UnsupportedDtype {
            name: name.clone(),
            dtype: "U8".into(),
        });
    }
    for (layer, kind) in spec.layers.iter().enumerate() {
        if *kind != MlpKind::Moe || !rules.fused.is_empty() {
            continue;
        }
        for e in 0..cfg.num_experts {
            let mut take = |pattern: &str, rows: usize, cols: usize| {
                let name = expert_name(pattern, layer, e);
                let t = all
                    .remove(&name)
                    .ok_or_else(|| WeightError::MissingExpert {
                        layer,
                        expert: e,
                        name: name.clone(),
                    })?;
                expert_matrix(&name, t, rows, cols)
            };
            let gate = take(names.expert_gate, i, h)?;
            let up = take(names.expert_up, i, h)?;
            let down = take(names.expert_down, h, i)?;
            source.insert_expert(layer, e, ExpertWeights { gate, up, down });
        }
    }
    for (name, t) in all {
        source.insert_tensor(name, t);
    }
    Ok(source)
}

/// A shard's bytes. Only a regular file is read: a FIFO named `*.safetensors` would block the
/// open (O_NONBLOCK prevents that) and then the read forever; a device would never end.
fn read_shard(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    let m = f.metadata()?;
    if !m.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    let mut bytes = Vec::with_capacity(m.len() as usize);
    f.read_to_end(&mut bytes)?;
    Ok(bytes)
}

fn expert_matrix(
    name: &str,
    t: HostTensor,
    rows: usize,
    cols: usize,
) -> Result<Bf16Matrix, WeightError> {
    if t.shape != [rows, cols] {
        return Err(WeightError::ShapeMismatch {
            name: name.to_string(),
            expected: vec![rows, cols],
            found: t.shape,
        });
    }
    match t.data {
        TensorData::Bf16(data) => Ok(Bf16Matrix { rows, cols, data }),
        TensorData::F32(_) => Err(WeightError::ExpertNotBf16 {
            name: name.to_string(),
            dtype: "F32".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A FIFO named like a shard is refused at once, naming it, instead of blocking the open.
    #[test]
    fn a_fifo_shard_is_refused_without_blocking() {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/oracle/qwen3moe-a");
        let text = std::fs::read_to_string(fixture.join("config.json")).unwrap();
        let cfg = MoeConfig::from_json_str(&text).unwrap();
        let spec = ArchSpec::new(&cfg);
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("model.safetensors");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let dir = d.path().to_path_buf();
        std::thread::spawn(move || {
            let r = load_safetensors_dir(&dir, &cfg, &spec).map(|_| ());
            tx.send(r.map_err(|e| e.to_string())).unwrap()
        });
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("a FIFO shard does not hang the load");
        let err = got.unwrap_err();
        assert!(
            err.contains("model.safetensors") && err.contains("not a regular file"),
            "{err}"
        );
    }
}
