//! What one forward step takes and returns, whatever the backend: which logit rows, the router
//! trace, the final-hidden arm, and the logits, router records and counters that come back.
//!
//! Every backend returns these same types, so that a caller (the decode loop, the CLI, a
//! comparison of two backends) never needs to know which one computed them.

/// Which positions get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LogitRows {
    /// Only the last position of the step (generation).
    #[default]
    Last,
    /// Every position of the step (scoring, tests).
    All,
}

/// What the final hidden state is before the lm_head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FinalHidden {
    /// The f32 state, as the contract says. The only exact choice.
    #[default]
    Exact,
    /// INVALID, for validation only: rounds the final normed hidden state to BF16 before the
    /// lm_head, as a BF16 runtime would. A validation check uses it to show that the oracle
    /// tests can tell this precision loss apart. Never a default, never exact.
    InvalidBf16BeforeLmHead,
}

/// Options of one forward step.
#[derive(Clone, Copy, Debug, Default)]
pub struct ForwardOptions {
    /// Which rows of logits to compute.
    pub logits: LogitRows,
    /// Record the router's choices for every MoE layer and token.
    pub trace_router: bool,
    /// The final-hidden arm (exact unless a validation check asks otherwise).
    pub final_hidden: FinalHidden,
}

/// The router's decision for one token in one MoE layer.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterRecord {
    /// Absolute layer index.
    pub layer: usize,
    /// Index among MoE layers (as transformers numbers router outputs).
    pub moe_layer: usize,
    /// Sequence position of the token.
    pub position: usize,
    /// Selected experts, in selection order (descending probability, lower id first on ties).
    pub experts: Vec<u32>,
    /// Their softmax probabilities, same order.
    pub probs: Vec<f32>,
    /// Their mixing weights (renormalised or not, per the family).
    pub weights: Vec<f32>,
    /// The k-th largest probability (the last selected one).
    pub kth_prob: f32,
    /// The (k+1)-th largest probability, when there are more than k experts.
    pub next_prob: Option<f32>,
}

/// Counters of one step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepStats {
    /// Bytes of weights read: every matrix applied (once, whatever the token count), the
    /// experts fetched, and the embedding rows.
    pub weight_bytes: u64,
    /// Experts fetched (summed over layers).
    pub experts_fetched: u64,
}

/// What a forward step returns.
#[derive(Clone, Debug, Default)]
pub struct ForwardOutput {
    /// Logit rows (one per requested position), each `vocab_size` f32.
    pub logits: Vec<Vec<f32>>,
    /// Router records, when asked for (ordered by layer, then position).
    pub router: Vec<RouterRecord>,
    /// Counters.
    pub stats: StepStats,
}
