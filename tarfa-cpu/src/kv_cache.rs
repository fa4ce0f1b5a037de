//! The KV cache of one sequence, with its RoPE rows.
//!
//! Keys are stored after q/k norm and RoPE, values as projected; both f32, per layer and KV head
//! `[position][head_dim]`, so a head's keys and values for positions `0..T` are contiguous.
//! Multi-head latent attention stores one row per position and layer, the latent and its
//! rotated rope key (`head_dim` = kv_lora_rank + qk_rope_head_dim, one "head", no values). The
//! cache holds no weights and must never depend on how positions were batched: appending tokens
//! one at a time or all at once stores the same values.

use tarfa_core::batch::Rewind;
use tarfa_core::numerics::{RopeError, RopeTable};

/// Keys, values and RoPE rows of one sequence.
#[derive(Clone, Debug)]
pub struct KvCache {
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    len: usize,
    max_len: usize,
    /// `[layer * kv_heads + head]` -> `len * head_dim` values
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    pub(crate) rope: RopeTable,
}

impl KvCache {
    pub(crate) fn new(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        max_len: usize,
        rope: RopeTable,
    ) -> KvCache {
        KvCache {
            layers,
            kv_heads,
            head_dim,
            len: 0,
            max_len,
            k: vec![Vec::new(); layers * kv_heads],
            v: vec![Vec::new(); layers * kv_heads],
            rope,
        }
    }

    /// Number of positions cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The most positions this cache accepts (`max_position_embeddings`).
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Forgets positions from `len` on (used to undo a failed step, or to rewind).
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len {
            return;
        }
        let keep = len * self.head_dim;
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            buf.truncate(keep);
        }
        self.len = len;
    }

    pub(crate) fn ensure_rope(&mut self, positions: usize) -> Result<(), RopeError> {
        self.rope.ensure(positions)
    }

    /// Appends one position's key and value of one (layer, head). Positions must be appended in
    /// order for every (layer, head) before [`KvCache::commit`].
    pub(crate) fn push(&mut self, layer: usize, head: usize, k: &[f32], v: &[f32]) {
        let i = layer * self.kv_heads + head;
        self.k[i].extend_from_slice(k);
        self.v[i].extend_from_slice(v);
    }

    /// Keys and values of (layer, head) for all positions stored so far (including ones pushed
    /// in the current step).
    pub(crate) fn head(&self, layer: usize, head: usize) -> (&[f32], &[f32]) {
        let i = layer * self.kv_heads + head;
        (&self.k[i], &self.v[i])
    }

    /// Marks `n` pushed positions as part of the cache.
    pub(crate) fn commit(&mut self, n: usize) {
        self.len += n;
        debug_assert!(self.k.iter().all(|b| b.len() == self.len * self.head_dim));
    }

    /// Drops positions pushed but not committed (after an error mid-step).
    pub(crate) fn rollback(&mut self) {
        let keep = self.len * self.head_dim;
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            buf.truncate(keep);
        }
    }

    /// Number of layers.
    pub fn layers(&self) -> usize {
        self.layers
    }
}

impl Rewind for KvCache {
    fn cached_len(&self) -> usize {
        self.len
    }

    fn rewind_to(&mut self, len: usize) {
        self.truncate(len);
    }
}
