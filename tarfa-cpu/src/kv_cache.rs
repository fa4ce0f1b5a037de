//! The KV cache of one sequence, with its RoPE rows.
//!
//! Keys are stored after q/k norm and RoPE, values as projected; both f32, per layer and KV head
//! `[position][head_dim]`, so a head's keys and values for positions `0..T` are contiguous.
//! Multi-head latent attention stores one row per position and layer, the latent and its
//! rotated rope key (`head_dim` = kv_lora_rank + qk_rope_head_dim, one "head", no values). The
//! cache holds no weights and must never depend on how positions were batched: appending tokens
//! one at a time or all at once stores the same values.
//!
//! A sliding-window layer (gpt-oss, Mixtral's `sliding_window`) or a chunked one (Llama 4) keeps
//! only the rows a later query can read: rows before [`Span::needed_from`] of the length the
//! current step started at are dropped when a step commits (in batches, so that the copy is
//! amortised: the layer's buffer holds at most about twice its span, [`REWIND_SLACK`] and one
//! step). The rows
//! read are the same values in the same order, so no bit changes; what changes is that a rewind
//! to a length whose queries would need dropped rows cannot be served: [`KvCache::truncate`]
//! then empties the cache and says so, and the caller re-feeds from position 0.
//!
//! A gated DeltaNet layer (Qwen3-Next, Qwen3.5 MoE) caches no rows: it carries a
//! [`LinearState`], its convolution's last inputs and its recurrent state, which a step
//! advances. A step writes the advanced state beside the committed one and [`KvCache::commit`]
//! swaps it in, keeping the state the step started from: a failed step leaves the committed
//! state as it was, and a rewind to the length the last step started at is served from the kept
//! state. The state at any other earlier length is gone (it is never stored), so such a rewind
//! empties the cache and says so, like a window's dropped rows.

use tarfa_core::batch::Rewind;
use tarfa_core::numerics::{RopeError, RopeTable};

/// Rows kept before what the step's first position needs, so that a rewind of up to this many
/// positions before a step's start is served too: generate's run-ahead and speculation's
/// rejected drafts (each at most 8 steps) rewind across steps that have already committed.
pub const REWIND_SLACK: usize = 64;

/// Which past rows a layer's queries read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Span {
    /// A sliding window of `w` positions (the query at `pos` reads `pos + 1 - w ..= pos`).
    pub window: Option<usize>,
    /// A chunk of `c` positions (the query at `pos` reads `c * (pos / c) ..= pos`).
    pub chunk: Option<usize>,
}

impl Span {
    /// The first position a query at `pos` or later reads.
    pub fn needed_from(&self, pos: usize) -> usize {
        let w = self.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let c = self
            .chunk
            .and_then(|c| pos.checked_div(c))
            .map_or(0, |q| q * self.chunk.unwrap_or(0));
        w.max(c)
    }

    /// Rows dropped at once: at least the span (and 16), so that each drop's copy of the rows
    /// kept (about the span, the slack and a step) is shared by at least that many tokens.
    fn batch(&self) -> Option<usize> {
        match (self.window, self.chunk) {
            (None, None) => None,
            (w, c) => Some(w.unwrap_or(0).max(c.unwrap_or(0)).max(16)),
        }
    }
}

/// One gated DeltaNet layer's state for one sequence (docs/EXACTNESS.md, "Gated DeltaNet").
#[derive(Clone, Debug, PartialEq)]
pub struct LinearState {
    /// The convolution's inputs at the last `K - 1` positions, oldest first, `[K-1][C]`;
    /// zeros before position 0 (transformers pads with zeros).
    pub conv: Vec<f32>,
    /// The recurrent state of every value head, `[Hv][Dv][Dk]`: row `(h, j)` is the state's
    /// column `j` that value `j`'s reductions read, contiguous over the key dimension.
    pub state: Vec<f32>,
}

impl LinearState {
    /// The state before any position: all zeros.
    pub fn zeros(conv_len: usize, state_len: usize) -> LinearState {
        LinearState {
            conv: vec![0.0; conv_len],
            state: vec![0.0; state_len],
        }
    }

    /// Values held.
    pub fn len(&self) -> usize {
        self.conv.len() + self.state.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The gated DeltaNet layers' states of one sequence.
#[derive(Clone, Debug)]
struct LinearStates {
    /// Per layer, its state at the cache's length (None for an attention layer).
    committed: Vec<Option<LinearState>>,
    /// Per layer, the state the step in progress has advanced to.
    pending: Vec<Option<LinearState>>,
    /// The committed states at the length the last committed step started at, and that length.
    before: Option<(usize, Vec<Option<LinearState>>)>,
    /// `(conv, state)` lengths of a fresh state.
    fresh: (usize, usize),
}

/// Keys, values and RoPE rows of one sequence.
#[derive(Clone, Debug)]
pub struct KvCache {
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    len: usize,
    max_len: usize,
    /// Per layer: which rows its queries read, and the first position it still holds.
    spans: Vec<Span>,
    base: Vec<usize>,
    /// `[layer * kv_heads + head]` -> `(len - base[layer]) * head_dim` values
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    pub(crate) rope: RopeTable,
    /// The gated DeltaNet layers' states, when the model has such layers.
    linear: Option<LinearStates>,
}

impl KvCache {
    pub(crate) fn new(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        max_len: usize,
        spans: Vec<Span>,
        rope: RopeTable,
    ) -> KvCache {
        assert_eq!(spans.len(), layers, "one span per layer");
        KvCache {
            layers,
            kv_heads,
            head_dim,
            len: 0,
            max_len,
            spans,
            base: vec![0; layers],
            k: vec![Vec::new(); layers * kv_heads],
            v: vec![Vec::new(); layers * kv_heads],
            rope,
            linear: None,
        }
    }

    /// Gives the layers `linear` marks a gated DeltaNet state of `conv_len` + `state_len`
    /// values, zero at position 0 (an empty cache only).
    pub(crate) fn with_linear_layers(
        mut self,
        linear: &[bool],
        conv_len: usize,
        state_len: usize,
    ) -> KvCache {
        assert_eq!(linear.len(), self.layers, "one flag per layer");
        assert!(self.is_empty(), "states are attached to an empty cache");
        let fresh: Vec<Option<LinearState>> = linear
            .iter()
            .map(|&on| on.then(|| LinearState::zeros(conv_len, state_len)))
            .collect();
        self.linear = Some(LinearStates {
            pending: vec![None; fresh.len()],
            committed: fresh,
            before: None,
            fresh: (conv_len, state_len),
        });
        self
    }

    /// Layer `l`'s gated DeltaNet state at the cache's length, None for an attention layer.
    pub fn linear_state(&self, l: usize) -> Option<&LinearState> {
        self.linear.as_ref()?.committed.get(l)?.as_ref()
    }

    /// Stages layer `l`'s state after the step in progress; [`KvCache::commit`] makes it the
    /// cache's.
    pub(crate) fn stage_linear(&mut self, l: usize, state: LinearState) {
        if let Some(ls) = self.linear.as_mut() {
            ls.pending[l] = Some(state);
        }
    }

    /// Values the gated DeltaNet states hold, the kept states of the last step included.
    pub fn linear_values(&self) -> usize {
        let Some(ls) = &self.linear else { return 0 };
        let sum = |v: &[Option<LinearState>]| v.iter().flatten().map(LinearState::len).sum();
        sum(&ls.committed) + ls.before.as_ref().map_or(0, |(_, b)| sum(b))
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

    /// Forgets positions from `len` on (used to undo a failed step, or to rewind) and returns
    /// the length kept: `min(len, self.len())`, or 0 when a windowed or chunked layer has
    /// dropped rows that a query at `len` would read (the cache is then emptied; re-feed from
    /// position 0). A rewind to the length a step started at, or up to [`REWIND_SLACK`]
    /// positions before it, is always served.
    #[must_use = "a rewind may keep fewer positions than asked: re-feed from what it returns"]
    pub fn truncate(&mut self, len: usize) -> usize {
        if let Some(ls) = self.linear.as_mut() {
            ls.pending.iter_mut().for_each(|p| *p = None);
        }
        if len >= self.len {
            return self.len;
        }
        let rows = (0..self.layers).all(|l| self.spans[l].needed_from(len) >= self.base[l]);
        // A gated DeltaNet state exists at the cache's length, at the length the last step
        // started at, and at 0.
        let states = match self.linear.as_mut() {
            None => true,
            Some(ls) => match ls.before.take() {
                Some((start, before)) if start == len => {
                    ls.committed = before;
                    true
                }
                _ => {
                    let (c, s) = ls.fresh;
                    for st in ls.committed.iter_mut().flatten() {
                        *st = LinearState::zeros(c, s);
                    }
                    len == 0
                }
            },
        };
        let servable = rows && states;
        let len = if servable { len } else { 0 };
        if let (false, Some(ls)) = (servable, self.linear.as_mut()) {
            let (c, s) = ls.fresh;
            for st in ls.committed.iter_mut().flatten() {
                *st = LinearState::zeros(c, s);
            }
        }
        if !servable {
            self.base.iter_mut().for_each(|b| *b = 0);
        }
        for l in 0..self.layers {
            let keep = (len - self.base[l]) * self.head_dim;
            for i in l * self.kv_heads..(l + 1) * self.kv_heads {
                self.k[i].truncate(keep);
                self.v[i].truncate(keep);
            }
        }
        self.len = len;
        len
    }

    /// Positions of layer `l` still held: `base..len` (0.. unless the layer is windowed or
    /// chunked).
    pub fn held(&self, l: usize) -> std::ops::Range<usize> {
        self.base[l]..self.len
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

    /// Keys and values of (layer, head) for the positions held, `base..` (including ones
    /// pushed in the current step), and `base`: position `j`'s row is row `j - base`.
    pub(crate) fn head(&self, layer: usize, head: usize) -> (&[f32], &[f32], usize) {
        let i = layer * self.kv_heads + head;
        (&self.k[i], &self.v[i], self.base[layer])
    }

    /// Marks `n` pushed positions as part of the cache, then drops the rows of windowed and
    /// chunked layers that no query from the step's first position on reads (so a rewind to
    /// that position stays servable), when there are a batch of them.
    pub(crate) fn commit(&mut self, n: usize) {
        let start = self.len;
        self.len += n;
        if let Some(ls) = self.linear.as_mut() {
            let mut before = Vec::with_capacity(ls.committed.len());
            for (c, p) in ls.committed.iter_mut().zip(ls.pending.iter_mut()) {
                match p.take() {
                    Some(next) => before.push(c.replace(next)),
                    // an attention layer, or a step of no token
                    None => before.push(c.clone()),
                }
            }
            ls.before = Some((start, before));
        }
        let d = self.head_dim;
        for l in 0..self.layers {
            let Some(batch) = self.spans[l].batch() else {
                continue;
            };
            let needed = self.spans[l]
                .needed_from(start)
                .saturating_sub(REWIND_SLACK);
            if needed < self.base[l] + batch {
                continue;
            }
            let drop = (needed - self.base[l]) * d;
            for i in l * self.kv_heads..(l + 1) * self.kv_heads {
                self.k[i].drain(..drop);
                if !self.v[i].is_empty() {
                    self.v[i].drain(..drop);
                }
            }
            self.base[l] = needed;
        }
        debug_assert!((0..self.layers).all(|l| {
            // a gated DeltaNet layer holds no rows
            if self.linear_state(l).is_some() {
                return true;
            }
            let rows = (self.len - self.base[l]) * d;
            (l * self.kv_heads..(l + 1) * self.kv_heads).all(|i| self.k[i].len() == rows)
        }));
    }

    /// Drops positions pushed but not committed (after an error mid-step).
    pub(crate) fn rollback(&mut self) {
        if let Some(ls) = self.linear.as_mut() {
            ls.pending.iter_mut().for_each(|p| *p = None);
        }
        for l in 0..self.layers {
            let keep = (self.len - self.base[l]) * self.head_dim;
            for i in l * self.kv_heads..(l + 1) * self.kv_heads {
                self.k[i].truncate(keep);
                self.v[i].truncate(keep);
            }
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

    fn rewind_to(&mut self, len: usize) -> usize {
        self.truncate(len)
    }
}
