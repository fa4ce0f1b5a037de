//! Evaluation over the exact engine: lm-eval's three request kinds (loglikelihood,
//! loglikelihood_rolling, generate_until) read from JSON Lines ([`request`]), scored over
//! tarfa-engine's many-sequence steps with up to `max_batch` requests in flight ([`score`]), one
//! JSON result per request in input order, every number printed so that it parses back to the
//! same bits.
//!
//! Log-probabilities are the log-softmax of the model's f32 logits in the fixed order
//! docs/EXACTNESS.md states ([`logprob`]), so a result depends only on the model and the request:
//! never on the batch, the chunking, the thread count or the backend.
//!
//! This crate must never compute a logit (the engine does), never choose a token any other way
//! than greedy decoding does, and never depend on a front end (the CLI, the server).

/// The contract's log-softmax (docs/EXACTNESS.md section 7), re-exported.
pub use tarfa_core::logprob;
pub mod request;
pub mod scheduler;
pub mod score;
pub mod text;

pub use request::{parse_line, BadRequest, Limits, Options, Problem, Request, Task};
pub use scheduler::{Event, Scheduler, Sink, Ticket};
pub use score::{
    perplexity, rolling_windows, score, score_drafted, score_stoppable, Decoding, FinishReason,
    GenerateResult, GeneratedToken, LoglikelihoodResult, Perplexity, Progress, ScoreError,
    ScoreOptions, ScoreResult,
};
