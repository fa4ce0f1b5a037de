//! Prompts: seeded random token ids (the A/B workloads and bundles without an oracle), and the
//! oracle's own prompts where the bundle was converted from an oracle fixture.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::bundle::{sha256_hex, Bundle};
use crate::logits::{read_reference, OraclePrompt};
use crate::prng::Rng;

/// `len` token ids drawn uniformly from `0..vocab` with a generator seeded by `(seed, len)`, so
/// that a workload's prompt does not depend on which other workloads run.
pub fn random_prompt(seed: u64, len: usize, vocab: usize) -> Vec<u32> {
    let mut rng = Rng::new(seed ^ (len as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    (0..len).map(|_| rng.below(vocab as u64) as u32).collect()
}

/// A prompt and how many tokens to generate after it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prompt {
    pub label: String,
    pub tokens: Vec<u32>,
    pub new_tokens: usize,
}

/// An oracle fixture whose checkpoint the bundle was converted from.
#[derive(Clone, Debug)]
pub struct Oracle {
    /// The `reference.safetensors`.
    pub path: PathBuf,
    pub prompts: Vec<OraclePrompt>,
}

impl Oracle {
    pub fn load(reference: &Path) -> Result<Oracle> {
        Ok(Oracle {
            path: reference.to_path_buf(),
            prompts: read_reference(reference)?,
        })
    }

    pub fn as_prompts(&self) -> Vec<Prompt> {
        self.prompts
            .iter()
            .enumerate()
            .map(|(i, p)| Prompt {
                label: format!("oracle prompt {i}"),
                tokens: p.prompt.clone(),
                new_tokens: p.greedy.len(),
            })
            .collect()
    }
}

/// The directory under `roots` holding `reference.safetensors` and exactly the source shards the
/// bundle's manifest lists (same names, sizes and SHA-256): the fixture it was converted from.
pub fn find_oracle(bundle: &Bundle, roots: &[PathBuf]) -> Option<PathBuf> {
    let shards = &bundle.manifest.shards;
    if shards.is_empty() {
        return None;
    }
    for root in roots {
        let Ok(entries) = fs::read_dir(root) else {
            continue;
        };
        let mut dirs: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        dirs.sort();
        'dir: for d in dirs {
            let reference = d.join("reference.safetensors");
            if !reference.is_file() {
                continue;
            }
            for s in shards {
                let p = d.join(&s.name);
                match fs::metadata(&p) {
                    Ok(m) if m.len() == s.size => {}
                    _ => continue 'dir,
                }
            }
            for s in shards {
                match fs::read(d.join(&s.name)) {
                    Ok(b) if sha256_hex(&b) == s.sha256 => {}
                    _ => continue 'dir,
                }
            }
            return Some(reference);
        }
    }
    None
}

/// Prompts for bundles without an oracle: lengths 1, 7, 33 and 300 (the last crosses the 256
/// lanes of the canonical reduction in attention), each followed by 8 generated tokens, within
/// the model's context.
pub fn default_prompts(bundle: &Bundle, seed: u64) -> Vec<Prompt> {
    let max = bundle.config.max_position_embeddings.unwrap_or(4096);
    [1usize, 7, 33, 300]
        .into_iter()
        .filter(|&n| n + 8 <= max)
        .map(|n| Prompt {
            label: format!("random {n}"),
            tokens: random_prompt(seed, n, bundle.config.vocab_size),
            new_tokens: 8,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_are_reproducible_and_in_the_vocabulary() {
        let a = random_prompt(5, 512, 100);
        assert_eq!(a, random_prompt(5, 512, 100));
        assert_ne!(a, random_prompt(6, 512, 100));
        assert!(a.iter().all(|&t| t < 100));
        // a workload's prompt does not depend on the others: same (seed, len), same tokens
        assert_eq!(random_prompt(5, 3, 100), random_prompt(5, 3, 100));
        assert_ne!(random_prompt(5, 3, 100)[..], random_prompt(5, 4, 100)[..3]);
    }
}
