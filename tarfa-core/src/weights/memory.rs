//! A [`WeightSource`] holding every tensor in owned host buffers: what the safetensors loader
//! builds for tests, and what the benchmark fills with random weights.
//!
//! It verifies nothing (its buffers come from a trusted caller); it must never be used to run
//! a bundle, whose bytes need per-extent verification.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{ExpertWeights, HostTensor, WeightError, WeightSource};

/// All weights resident in memory.
#[derive(Debug, Default)]
pub struct InMemorySource {
    tensors: HashMap<String, Arc<HostTensor>>,
    experts: HashMap<(usize, usize), Arc<ExpertWeights>>,
    expert_calls: AtomicU64,
    experts_fetched: AtomicU64,
}

impl InMemorySource {
    /// An empty source.
    pub fn new() -> InMemorySource {
        InMemorySource::default()
    }

    /// Adds a non-expert tensor.
    pub fn insert_tensor(&mut self, name: impl Into<String>, t: HostTensor) {
        self.tensors.insert(name.into(), Arc::new(t));
    }

    /// Removes a non-expert tensor (tests of missing weights use this).
    pub fn remove_tensor(&mut self, name: &str) -> Option<Arc<HostTensor>> {
        self.tensors.remove(name)
    }

    /// Adds an expert.
    pub fn insert_expert(&mut self, layer: usize, expert: usize, w: ExpertWeights) {
        self.experts.insert((layer, expert), Arc::new(w));
    }

    /// `(calls to experts(), experts handed out)` so far: lets tests check that the forward
    /// fetches experts once per layer per step.
    pub fn fetch_counts(&self) -> (u64, u64) {
        (
            self.expert_calls.load(Ordering::Relaxed),
            self.experts_fetched.load(Ordering::Relaxed),
        )
    }

    /// Names of the non-expert tensors.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(|s| s.as_str())
    }
}

impl WeightSource for InMemorySource {
    fn tensor(&self, name: &str) -> Result<Arc<HostTensor>, WeightError> {
        self.tensors
            .get(name)
            .cloned()
            .ok_or_else(|| WeightError::MissingTensor(name.to_string()))
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn experts(&self, layer: usize, ids: &[usize]) -> Result<Vec<Arc<ExpertWeights>>, WeightError> {
        self.expert_calls.fetch_add(1, Ordering::Relaxed);
        self.experts_fetched
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        ids.iter()
            .map(|&e| {
                self.experts
                    .get(&(layer, e))
                    .cloned()
                    .ok_or_else(|| WeightError::MissingExpert {
                        layer,
                        expert: e,
                        name: format!("layer {layer} expert {e}"),
                    })
            })
            .collect()
    }
}
