//! Scoring requests over the engine's many-sequence steps.
//!
//! Up to `max_batch` requests are in flight, each on its own [`Sequence`]; every engine step runs
//! each in-flight request's next pending tokens (a prompt chunk, or one generated token and, with
//! `draft_tokens`, its prompt-lookup drafts: speculative decoding, whose accepted drafts are the
//! tokens one token per step would choose and whose rejected positions are forgotten). A
//! request that finishes frees its slot for the next one, and results come out in input order.
//! Every number comes from the request's own logit rows, which do not depend on what shares its
//! steps nor on how its tokens are split into steps (tarfa-engine's contract), so the output is
//! the same bytes for any `max_batch`, chunk size, thread count and backend.
//!
//! Semantics (lm-eval's):
//! - loglikelihood: input `(context + continuation)[..n-1]` from position 0; the row at position
//!   `p` is the distribution of token `p + 1`; the continuation's log-probs are its rows', summed
//!   in token order in f64; `is_greedy` when every continuation token is its row's argmax (the
//!   lowest id among equal logits, as greedy decoding chooses).
//! - rolling: tokens `1..n` are scored, each given everything before it, in disjoint windows of
//!   at most `window` positions: window `k` runs tokens `k*window .. (k+1)*window` as a fresh
//!   sequence and scores the token after each. This is lm-eval's `loglikelihood_rolling`
//!   (`get_rolling_token_windows` with `context_len = 1`, made disjoint), with token 0 in the
//!   role of its prefix token: a token at a window's start sees no earlier context.
//! - generate_until: greedy, or sampled by `tarfa_core::sampling::sample` as request 0 (so a
//!   request's text depends only on the model, the prompt, the settings and the seed, and equals
//!   `tarfa-run generate`'s with the same ones: never on its line or its batch); stops after `max_tokens` tokens (`length`), after an EOS id (`eos`;
//!   the id is in `tokens`, not in `text`), or when the decoded text contains a stop string
//!   (`stop`; `text` is cut before the earliest one; `tokens` keeps every generated id).

use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};

use serde::Serialize;
use tarfa_core::generate::argmax;
use tarfa_core::sampling::{sample, SamplingParams};
use tarfa_core::speculate::NgramDrafter;
use tarfa_core::step::{ForwardOutput, LogitRows};
use tarfa_engine::{EngineError, Model};

use crate::logprob::{token_logprob, top_logprobs};
use crate::request::{Request, Task};
use crate::scheduler::{Event, Scheduler};
use crate::text::TextSoFar;

/// How the requests are scheduled (none of it changes a result's bytes).
#[derive(Clone, Copy, Debug)]
pub struct ScoreOptions {
    /// Requests in flight at once (each engine step runs one chunk of each).
    pub max_batch: usize,
    /// The most tokens of one request in one step when every row's logits are kept (bounds the
    /// memory of `vocab` f32 per row).
    pub chunk_tokens: usize,
    /// generate_until's speculative decoding: up to this many tokens drafted by prompt lookup
    /// (`tarfa_core::speculate::NgramDrafter`), or by a draft model
    /// ([`Scheduler::with_draft_model`], [`score_drafted`]), and verified in each decode step; 0 (the default)
    /// drafts nothing. Exact like the rest: a request's tokens, log-probs and text are those of
    /// one token per step (docs/EXACTNESS.md, "Speculative decoding").
    pub draft_tokens: usize,
}

impl Default for ScoreOptions {
    fn default() -> Self {
        ScoreOptions {
            max_batch: 1,
            chunk_tokens: 256,
            draft_tokens: 0,
        }
    }
}

/// What decoding needs: the tokenizer (for `text` and stop strings) and the EOS ids.
pub struct Decoding<'a> {
    pub tokenizer: Option<&'a tokenizers::Tokenizer>,
    pub eos: &'a [u32],
}

/// Counters after a step, for a progress bar.
#[derive(Clone, Copy, Debug, Default)]
pub struct Progress {
    pub requests_done: usize,
    pub requests_total: usize,
    /// Tokens run through the model so far (every input position of every request, drafts a
    /// step rejected included).
    pub tokens: u64,
    /// generate_until's drafted tokens fed to steps, and those accepted (speculative decoding).
    pub drafted: u64,
    pub accepted: u64,
    /// A draft model's steps (each drafts one more token for every request it drafts for) and
    /// the positions it computed.
    pub draft_steps: u64,
    pub draft_positions: u64,
}

/// Why scoring stopped.
#[derive(Debug, thiserror::Error)]
pub enum ScoreError {
    /// The engine failed on a request's step.
    #[error("line {line}: {source}")]
    Engine { line: usize, source: EngineError },
    /// An engine step failed as a whole (a weight that did not verify, a device error): no one
    /// request caused it.
    #[error("{source}")]
    Step { source: EngineError },
    /// The caller's sink refused a result (writing the output).
    #[error(transparent)]
    Output(std::io::Error),
    /// The caller's `stop` said so between two steps ([`score_stoppable`]; Ctrl-C in Python).
    #[error("interrupted")]
    Interrupted,
}

/// One position's alternatives: `[token, logprob]` pairs, best first.
pub type Top = Vec<(u32, f64)>;

/// A loglikelihood result. Non-finite log-probs (a row with no distribution) print as `null`.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct LoglikelihoodResult {
    pub logprob: f64,
    pub is_greedy: bool,
    pub tokens: Vec<u32>,
    pub token_logprobs: Vec<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<Vec<Top>>,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub echo: Option<Echo>,
}

/// The prompt's tokens and their log-probs (`echo`): the first has nothing before it (`null`).
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct Echo {
    pub context_tokens: Vec<u32>,
    pub context_logprobs: Vec<Option<f64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context_top_logprobs: Option<Vec<Option<Top>>>,
}

/// A rolling result: `tokens` are the scored ones (the text's tokens after the first).
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct RollingResult {
    pub logprob: f64,
    pub tokens: Vec<u32>,
    pub token_logprobs: Vec<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<Vec<Top>>,
}

#[derive(Serialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    Stop,
    Length,
    Eos,
}

/// One generated token as it is produced (streaming): the same numbers the final
/// [`GenerateResult`] holds at `index`.
#[derive(Debug, Clone, PartialEq)]
pub struct GeneratedToken {
    /// Position among the generated tokens (0-based).
    pub index: usize,
    pub token: u32,
    pub logprob: f64,
    pub top_logprobs: Option<Top>,
    /// The decoded text of every token so far (without a final EOS, cut before a stop string).
    pub text: Option<String>,
    /// Set on the last token.
    pub finish_reason: Option<FinishReason>,
}

/// A generate_until result (`text` is `null` without a tokenizer).
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct GenerateResult {
    pub text: Option<String>,
    pub tokens: Vec<u32>,
    pub token_logprobs: Vec<f64>,
    pub finish_reason: FinishReason,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<Vec<Top>>,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub echo: Option<Echo>,
}

/// One request's result, printed as one JSON line.
#[derive(Serialize, Debug, Clone, PartialEq)]
#[serde(untagged)]
pub enum ScoreResult {
    Loglikelihood(LoglikelihoodResult),
    Rolling(RollingResult),
    Generate(GenerateResult),
}

impl ScoreResult {
    /// One JSON line (no newline). serde_json prints an f64 as its shortest representation that
    /// parses back to the same bits (ryu), so every number round-trips exactly.
    pub fn to_json_line(&self) -> String {
        serde_json::to_string(self).expect("results serialise")
    }
}

/// One scored position.
#[derive(Clone, Debug)]
pub(crate) struct Scored {
    pub(crate) logprob: f64,
    greedy: bool,
    pub(crate) top: Option<Top>,
}

fn score_row(row: &[f32], target: u32, k: usize) -> Scored {
    Scored {
        logprob: token_logprob(row, target),
        greedy: argmax(row) == target,
        top: (k > 0).then(|| top_logprobs(row, k)),
    }
}

/// A step's worth of one request's tokens.
pub(crate) struct Chunk {
    /// Start the sequence afresh (a rolling window) before these tokens.
    pub(crate) reset: bool,
    /// Index in the request's token list of the chunk's first input.
    start: usize,
    len: usize,
    /// Keep every row's logits (scored positions), or only the last (a prompt's end).
    pub(crate) rows: LogitRows,
}

/// Teacher-forced scoring (loglikelihood, rolling): inputs `tokens[..n-1]`, the row of input `p`
/// scores `tokens[p + 1]` when `p + 1 >= first_target`.
pub(crate) struct TeacherForced {
    tokens: Vec<u32>,
    first_target: usize,
    chunks: VecDeque<Chunk>,
    /// Scores of targets `first_target..n`.
    scored: Vec<Scored>,
}

impl TeacherForced {
    /// `windows`: split the inputs into fresh sequences of at most this many positions.
    fn new(tokens: Vec<u32>, first_target: usize, window: usize, chunk_tokens: usize) -> Self {
        let inputs = tokens.len() - 1;
        let mut chunks = VecDeque::new();
        let mut w = 0;
        while w < inputs {
            let end = (w + window).min(inputs);
            let mut s = w;
            // inputs whose rows score nothing run in one step with only the last row kept
            let first_row = first_target.saturating_sub(1).clamp(w, end);
            if first_row > s {
                chunks.push_back(Chunk {
                    reset: s == w,
                    start: s,
                    len: first_row - s,
                    rows: LogitRows::Last,
                });
                s = first_row;
            }
            while s < end {
                let len = chunk_tokens.min(end - s);
                chunks.push_back(Chunk {
                    reset: s == w,
                    start: s,
                    len,
                    rows: LogitRows::All,
                });
                s += len;
            }
            w = end;
        }
        TeacherForced {
            tokens,
            first_target,
            chunks,
            scored: Vec::new(),
        }
    }

    fn absorb(&mut self, chunk: &Chunk, out: ForwardOutput, k: usize) {
        if chunk.rows == LogitRows::Last {
            return;
        }
        for (i, row) in out.logits.iter().enumerate() {
            let target = chunk.start + i + 1;
            if target >= self.first_target {
                self.scored.push(score_row(row, self.tokens[target], k));
            }
        }
    }
}

/// Greedy generation after a prompt.
pub(crate) struct Generation {
    context: Vec<u32>,
    until: Vec<String>,
    max_tokens: usize,
    sampling: SamplingParams,
    /// Prompt chunks not yet run.
    prompt: VecDeque<Chunk>,
    /// Echo: scores of prompt tokens 1.. (when asked).
    echo: Option<Vec<Scored>>,
    generated: Vec<u32>,
    scores: Vec<Scored>,
    text: Option<String>,
    /// The generated text kept up to date a token at a time (text.rs), with a tokenizer.
    so_far: Option<TextSoFar>,
    /// How much of the text was settled at the last stop-string search: a match ending there
    /// or before was looked for then.
    stop_scanned: usize,
    finish: Option<FinishReason>,
    /// Drafts per decode step (0: none).
    draft_tokens: usize,
    /// The drafts fed by the step in flight, after the last generated token.
    drafts: Vec<u32>,
    /// Drafts fed so far, and those accepted.
    drafted: u64,
    accepted: u64,
    /// The drafts of a draft model ([`Work::set_drafts`]): used in place of prompt lookup,
    /// taken by the next step.
    given: Option<Vec<u32>>,
    /// Tokens generated by the last step, as streamed (in order).
    new_tokens: Vec<GeneratedToken>,
}

pub(crate) enum Work {
    Forced {
        tf: TeacherForced,
        rolling: bool,
        /// Loglikelihood with echo: the context's length (targets before it are the echo).
        echo_context: Option<usize>,
    },
    Generate(Box<Generation>),
}

impl Work {
    pub(crate) fn new(r: &Request, opts: &ScoreOptions) -> Work {
        let chunk = opts.chunk_tokens.max(1);
        match &r.task {
            Task::Loglikelihood {
                context,
                continuation,
            } => {
                let tokens = [context.as_slice(), continuation].concat();
                let (first, echo_context) = if r.options.echo {
                    (1, Some(context.len()))
                } else {
                    (context.len(), None)
                };
                Work::Forced {
                    tf: TeacherForced::new(tokens, first, usize::MAX, chunk),
                    rolling: false,
                    echo_context,
                }
            }
            Task::Rolling { tokens, window } => Work::Forced {
                tf: TeacherForced::new(tokens.clone(), 1, (*window).max(1), chunk),
                rolling: true,
                echo_context: None,
            },
            Task::GenerateUntil {
                context,
                until,
                max_tokens,
                sampling,
            } => {
                let n = context.len();
                let mut prompt = VecDeque::new();
                let mut s = 0;
                // without echo the whole prompt is one step (only its last row is needed)
                let step = if r.options.echo { chunk } else { n };
                while s < n {
                    let len = step.min(n - s);
                    prompt.push_back(Chunk {
                        reset: false,
                        start: s,
                        len,
                        rows: if r.options.echo {
                            LogitRows::All
                        } else {
                            LogitRows::Last
                        },
                    });
                    s += len;
                }
                Work::Generate(Box::new(Generation {
                    context: context.clone(),
                    until: until.clone(),
                    max_tokens: *max_tokens,
                    sampling: *sampling,
                    prompt,
                    echo: r.options.echo.then(Vec::new),
                    generated: Vec::new(),
                    scores: Vec::new(),
                    text: None,
                    so_far: None,
                    stop_scanned: 0,
                    finish: None,
                    draft_tokens: opts.draft_tokens,
                    drafts: Vec::new(),
                    drafted: 0,
                    accepted: 0,
                    given: None,
                    new_tokens: Vec::new(),
                }))
            }
        }
    }

    /// The next step's tokens, or `None` when the request is finished.
    pub(crate) fn next(&mut self) -> Option<(Chunk, Vec<u32>)> {
        match self {
            Work::Forced { tf, .. } => {
                let c = tf.chunks.pop_front()?;
                let toks = tf.tokens[c.start..c.start + c.len].to_vec();
                Some((c, toks))
            }
            Work::Generate(g) => {
                if let Some(c) = g.prompt.pop_front() {
                    let toks = g.context[c.start..c.start + c.len].to_vec();
                    return Some((c, toks));
                }
                if g.finish.is_some() {
                    return None;
                }
                let last = *g.generated.last().expect("a token after the prompt");
                // Drafts are tokens n.. (n generated so far); row i of the step chooses token
                // n + i, never past the last one allowed (max_tokens - 1): the step computes no
                // position one token per step would not.
                let room = g.draft_room();
                g.drafts = if let Some(mut d) = g.given.take() {
                    d.truncate(room);
                    d
                } else if room > 0 {
                    let context = [g.context.as_slice(), &g.generated].concat();
                    let mut d = NgramDrafter::default().propose(&context, room);
                    d.truncate(room);
                    d
                } else {
                    Vec::new()
                };
                g.drafted += g.drafts.len() as u64;
                let mut toks = Vec::with_capacity(1 + g.drafts.len());
                toks.push(last);
                toks.extend_from_slice(&g.drafts);
                Some((
                    Chunk {
                        reset: false,
                        start: g.context.len() + g.generated.len() - 1,
                        len: toks.len(),
                        rows: if g.drafts.is_empty() {
                            LogitRows::Last
                        } else {
                            LogitRows::All
                        },
                    },
                    toks,
                ))
            }
        }
    }

    pub(crate) fn absorb(&mut self, chunk: &Chunk, out: ForwardOutput, k: usize, dec: &Decoding) {
        match self {
            Work::Forced { tf, .. } => tf.absorb(chunk, out, k),
            Work::Generate(g) => {
                let prompt_chunk =
                    chunk.start + chunk.len <= g.context.len() && g.generated.is_empty();
                if prompt_chunk {
                    if let Some(echo) = g.echo.as_mut() {
                        for (i, row) in out.logits.iter().enumerate() {
                            let target = chunk.start + i + 1;
                            if target < g.context.len() {
                                echo.push(score_row(row, g.context[target], k));
                            }
                        }
                    }
                    if chunk.start + chunk.len < g.context.len() {
                        return;
                    }
                }
                // The prompt's last row chooses the first token; a decode step's row i the
                // token after its input i (the last generated token, then the drafts).
                let rows = if prompt_chunk {
                    let last = out.logits.len() - 1;
                    &out.logits[last..]
                } else {
                    &out.logits[..]
                };
                let drafts = std::mem::take(&mut g.drafts);
                for (i, row) in rows.iter().enumerate() {
                    // generate's choice: token j at step j, the history the prompt and the
                    // tokens before it, request 0
                    let next = if g.sampling.is_greedy() {
                        argmax(row)
                    } else {
                        let history = [g.context.as_slice(), &g.generated].concat();
                        sample(row, &history, &g.sampling, 0, g.generated.len() as u64)
                    };
                    g.scores.push(score_row(row, next, k));
                    g.generated.push(next);
                    g.decide(dec);
                    let streamed = g.streamed();
                    g.new_tokens.push(streamed);
                    // a draft is accepted only when it is the token chosen after the one before
                    // it; a stop or the length ends the request at this token
                    if g.finish.is_some() || drafts.get(i) != Some(&next) {
                        break;
                    }
                    g.accepted += 1;
                }
            }
        }
    }

    /// The tokens generated by the last step (several when it accepted drafts), each with its
    /// score, the text up to it (cut at a stop string) and whether generation finished there:
    /// what a stream hands out after each token. Taken: the next call returns the next step's.
    pub(crate) fn take_new_tokens(&mut self) -> Vec<GeneratedToken> {
        match self {
            Work::Generate(g) => std::mem::take(&mut g.new_tokens),
            Work::Forced { .. } => Vec::new(),
        }
    }

    /// The positions the request's sequence keeps after the last step: a generation keeps its
    /// prompt and every generated token but the last (not fed yet), so a step's rejected drafts
    /// are forgotten. `None`: everything run is kept.
    pub(crate) fn kept_len(&self) -> Option<usize> {
        match self {
            Work::Generate(g) if !g.generated.is_empty() => {
                Some(g.context.len() + g.generated.len() - 1)
            }
            _ => None,
        }
    }

    /// What a draft model is asked before the next step: the context (the prompt and every
    /// generated token) and the most tokens it may draft, for a generation in its decode steps
    /// with room for a draft; `None` otherwise (the step drafts nothing).
    pub(crate) fn draft_request(&self) -> Option<(Vec<u32>, usize)> {
        match self {
            Work::Generate(g) if g.prompt.is_empty() && g.finish.is_none() => {
                let room = g.draft_room();
                (room > 0 && !g.generated.is_empty())
                    .then(|| ([g.context.as_slice(), &g.generated].concat(), room))
            }
            _ => None,
        }
    }

    /// The next step's drafts, from a draft model (in place of prompt lookup).
    pub(crate) fn set_drafts(&mut self, drafts: Vec<u32>) {
        if let Work::Generate(g) = self {
            g.given = Some(drafts);
        }
    }

    /// Drafts (fed, accepted) so far: generate_until's speculative decoding.
    pub(crate) fn drafts(&self) -> (u64, u64) {
        match self {
            Work::Generate(g) => (g.drafted, g.accepted),
            Work::Forced { .. } => (0, 0),
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        match self {
            Work::Forced { tf, .. } => tf.chunks.is_empty(),
            Work::Generate(g) => g.prompt.is_empty() && g.finish.is_some(),
        }
    }

    pub(crate) fn result(self) -> ScoreResult {
        fn split(s: Vec<Scored>) -> (Vec<f64>, Option<Vec<Top>>, bool) {
            let greedy = s.iter().all(|x| x.greedy);
            let lps = s.iter().map(|x| x.logprob).collect();
            let tops = s.iter().map(|x| x.top.clone()).collect::<Option<Vec<_>>>();
            (lps, tops, greedy)
        }
        fn echo(context: &[u32], scored: Vec<Scored>) -> Echo {
            let with_top = scored.first().is_some_and(|s| s.top.is_some());
            Echo {
                context_tokens: context.to_vec(),
                context_logprobs: std::iter::once(None)
                    .chain(scored.iter().map(|s| Some(s.logprob)))
                    .collect(),
                context_top_logprobs: with_top.then(|| {
                    std::iter::once(None)
                        .chain(scored.iter().map(|s| s.top.clone()))
                        .collect()
                }),
            }
        }
        match self {
            Work::Forced {
                tf,
                rolling,
                echo_context,
            } => {
                let mut scored = tf.scored;
                let tokens = tf.tokens;
                if rolling {
                    let (token_logprobs, top_logprobs, _) = split(scored);
                    return ScoreResult::Rolling(RollingResult {
                        logprob: token_logprobs.iter().sum(),
                        tokens: tokens[1..].to_vec(),
                        token_logprobs,
                        top_logprobs,
                    });
                }
                let (cont_start, e) = match echo_context {
                    Some(c) => {
                        let cont = scored.split_off(c - 1);
                        let e = echo(&tokens[..c], std::mem::replace(&mut scored, cont));
                        (c, Some(e))
                    }
                    None => (tf.first_target, None),
                };
                let (token_logprobs, top_logprobs, is_greedy) = split(scored);
                ScoreResult::Loglikelihood(LoglikelihoodResult {
                    logprob: token_logprobs.iter().sum(),
                    is_greedy,
                    tokens: tokens[cont_start..].to_vec(),
                    token_logprobs,
                    top_logprobs,
                    echo: e,
                })
            }
            Work::Generate(g) => {
                let g = *g;
                let (token_logprobs, top_logprobs, _) = split(g.scores);
                ScoreResult::Generate(GenerateResult {
                    text: g.text,
                    tokens: g.generated,
                    token_logprobs,
                    finish_reason: g.finish.expect("finished"),
                    top_logprobs,
                    echo: g.echo.map(|s| echo(&g.context, s)),
                })
            }
        }
    }
}

impl Generation {
    /// The last generated token as streamed: its score, the text so far, the finish if any.
    fn streamed(&self) -> GeneratedToken {
        let (&token, s) = (
            self.generated.last().expect("a token"),
            self.scores.last().expect("a score"),
        );
        GeneratedToken {
            index: self.generated.len() - 1,
            token,
            logprob: s.logprob,
            top_logprobs: s.top.clone(),
            text: self.text.clone(),
            finish_reason: self.finish,
        }
    }

    /// After a generated token: decode, and stop at an EOS id, a stop string or the length.
    /// The text is the full decode of the generated ids (a final EOS left out), kept up to date
    /// by [`TextSoFar`] in time proportional to the new token; a stop string is looked for only
    /// where a match could have appeared since the last search, which finds the same first
    /// match as searching the whole text (a match inside text that was settled at the last
    /// search would have been found by it).
    fn decide(&mut self, dec: &Decoding) {
        let last = *self.generated.last().expect("a token");
        let is_eos = dec.eos.contains(&last);
        if let Some(tok) = dec.tokenizer {
            let so_far = self.so_far.get_or_insert_with(|| TextSoFar::new(tok));
            if !is_eos && so_far.push(tok, &self.generated).is_err() {
                // (what the full decode gave on an error: no text)
                *so_far = TextSoFar::new(tok);
            }
            let mut text = so_far.text();
            let longest = self.until.iter().map(String::len).max().unwrap_or(0);
            let mut from = self.stop_scanned.saturating_sub(longest.saturating_sub(1));
            while !text.is_char_boundary(from) {
                from -= 1;
            }
            self.stop_scanned = so_far.stable_len();
            let cut = self
                .until
                .iter()
                .filter_map(|s| text[from..].find(s.as_str()))
                .min();
            if let Some(cut) = cut {
                text.truncate(from + cut);
                self.text = Some(text);
                self.finish = Some(FinishReason::Stop);
                return;
            }
            self.text = Some(text);
        }
        if is_eos {
            self.finish = Some(FinishReason::Eos);
        } else if self.generated.len() >= self.max_tokens {
            self.finish = Some(FinishReason::Length);
        }
    }
}

impl Generation {
    /// Drafts the next step may feed: tokens n.. (n generated so far), row i choosing token
    /// n + i, never past the last one allowed (max_tokens - 1): the step computes no position
    /// one token per step would not.
    fn draft_room(&self) -> usize {
        self.draft_tokens
            .min(self.max_tokens.saturating_sub(1 + self.generated.len()))
    }
}

/// Scores `requests` on `model`, `opts.max_batch` at a time, handing each result to `emit` in
/// input order (index, result) as soon as it and every earlier one are done, and the counters to
/// `progress` after every step.
pub fn score(
    model: &Model,
    requests: &[Request],
    dec: &Decoding,
    opts: &ScoreOptions,
    emit: &mut dyn FnMut(usize, ScoreResult) -> Result<(), std::io::Error>,
    progress: &mut dyn FnMut(&Progress),
) -> Result<Progress, ScoreError> {
    score_stoppable(model, requests, dec, opts, emit, progress, &|| false)
}

/// [`score`], asking `stop` before every engine step: `true` ends the run with
/// [`ScoreError::Interrupted`] (what was emitted stays emitted; nothing else changes, the
/// sequences are the run's own).
pub fn score_stoppable(
    model: &Model,
    requests: &[Request],
    dec: &Decoding,
    opts: &ScoreOptions,
    emit: &mut dyn FnMut(usize, ScoreResult) -> Result<(), std::io::Error>,
    progress: &mut dyn FnMut(&Progress),
    stop: &dyn Fn() -> bool,
) -> Result<Progress, ScoreError> {
    score_drafted(model, None, requests, dec, opts, emit, progress, stop)
}

/// [`score_stoppable`] with generate_until's drafts from `draft` (a draft model of the same
/// tokenizer; [`Scheduler::with_draft_model`]) in place of prompt lookup, when given and
/// `opts.draft_tokens` is above 0. Every result is the same bytes as without.
#[allow(clippy::too_many_arguments)]
pub fn score_drafted(
    model: &Model,
    draft: Option<&Model>,
    requests: &[Request],
    dec: &Decoding,
    opts: &ScoreOptions,
    emit: &mut dyn FnMut(usize, ScoreResult) -> Result<(), std::io::Error>,
    progress: &mut dyn FnMut(&Progress),
    stop: &dyn Fn() -> bool,
) -> Result<Progress, ScoreError> {
    let max_batch = opts.max_batch.max(1);
    // results land here by index (the sinks outlive no step); emitted in input order
    let done: RefCell<BTreeMap<usize, ScoreResult>> = RefCell::new(BTreeMap::new());
    let mut sched = Scheduler::new(model, *opts);
    if let Some(d) = draft {
        sched = sched.with_draft_model(d);
    }
    let mut next = 0usize;
    let mut emitted = 0usize;
    loop {
        // submitted only as slots free up, so that the requests are not held twice
        while sched.running() + sched.waiting() < max_batch && next < requests.len() {
            let index = next;
            let done = &done;
            sched.submit(
                requests[index].clone(),
                Box::new(move |event| {
                    if let Event::Done(r) = event {
                        done.borrow_mut().insert(index, r);
                    }
                    true
                }),
            );
            next += 1;
        }
        if stop() {
            return Err(ScoreError::Interrupted);
        }
        if !sched.step(dec)? {
            break;
        }
        loop {
            let Some(r) = done.borrow_mut().remove(&emitted) else {
                break;
            };
            emit(emitted, r).map_err(ScoreError::Output)?;
            emitted += 1;
        }
        let mut stats = sched.progress();
        stats.requests_total = requests.len();
        progress(&stats);
    }
    let mut stats = sched.progress();
    stats.requests_total = requests.len();
    Ok(stats)
}

/// Rolling requests for one long token list, one per window of `window` positions (the windows
/// [`score`] would run for `{"rolling": tokens}`), so that a caller can score the windows of one
/// document in parallel: the sum of their results is the rolling result, bit for bit, when
/// summed in window order (perplexity).
pub fn rolling_windows(tokens: &[u32], window: usize, line: usize) -> Vec<Request> {
    let window = window.max(1);
    let inputs = tokens.len().saturating_sub(1);
    (0..inputs)
        .step_by(window)
        .map(|s| Request {
            line,
            task: Task::Rolling {
                tokens: tokens[s..(s + window).min(inputs) + 1].to_vec(),
                window,
            },
            options: Default::default(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printed_numbers_parse_back_to_the_same_bits() {
        // serde_json prints f64 as the shortest repr that round-trips (ryu): check it on log-probs
        // of every magnitude, subnormals and the extremes included.
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        let mut values = vec![
            -0.0,
            0.0,
            f64::MIN_POSITIVE,
            -f64::MAX,
            -5e-324,
            -1e-300,
            -0.1,
            -1.0 / 3.0,
        ];
        for _ in 0..20_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let v = f64::from_bits(s);
            if v.is_finite() {
                values.push(-v.abs());
            }
        }
        let r = RollingResult {
            logprob: -1.5,
            tokens: vec![0; values.len()],
            token_logprobs: values.clone(),
            top_logprobs: None,
        };
        let line = ScoreResult::Rolling(r).to_json_line();
        // Read back with Rust's correctly rounded parser (as Python's json is). serde_json's own
        // parser is not correctly rounded without its `float_roundtrip` feature: a reader in Rust
        // needs that feature to get the printed bits back.
        let list = line
            .split("\"token_logprobs\":[")
            .nth(1)
            .and_then(|t| t.split(']').next())
            .unwrap();
        let got: Vec<f64> = list.split(',').map(|v| v.parse().unwrap()).collect();
        assert_eq!(got.len(), values.len());
        for (g, v) in got.iter().zip(&values) {
            // -0.0 prints as "-0.0" and parses back as -0.0
            assert_eq!(g.to_bits(), v.to_bits(), "{v:e}");
        }
    }

    #[test]
    fn teacher_forced_chunks_cover_every_input_once() {
        // loglikelihood: context 5, continuation 4 -> inputs 0..8, rows of inputs 4.. scored
        let tf = TeacherForced::new((0..9).collect(), 5, usize::MAX, 3);
        let got: Vec<(bool, usize, usize, LogitRows)> = tf
            .chunks
            .iter()
            .map(|c| (c.reset, c.start, c.len, c.rows))
            .collect();
        assert_eq!(
            got,
            vec![
                (true, 0, 4, LogitRows::Last),
                (false, 4, 3, LogitRows::All),
                (false, 7, 1, LogitRows::All),
            ]
        );
        // rolling: 10 tokens, windows of 4 -> inputs 0..4, 4..8, 8..9, each fresh
        let tf = TeacherForced::new((0..10).collect(), 1, 4, 3);
        let got: Vec<(bool, usize, usize, LogitRows)> = tf
            .chunks
            .iter()
            .map(|c| (c.reset, c.start, c.len, c.rows))
            .collect();
        assert_eq!(
            got,
            vec![
                (true, 0, 3, LogitRows::All),
                (false, 3, 1, LogitRows::All),
                (true, 4, 3, LogitRows::All),
                (false, 7, 1, LogitRows::All),
                (true, 8, 1, LogitRows::All),
            ]
        );
        // rolling_windows cuts the same windows, each with its next token as the last target
        let w = rolling_windows(&(0..10).collect::<Vec<_>>(), 4, 1);
        let toks: Vec<Vec<u32>> = w
            .iter()
            .map(|r| match &r.task {
                Task::Rolling { tokens, .. } => tokens.clone(),
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(
            toks,
            vec![vec![0, 1, 2, 3, 4], vec![4, 5, 6, 7, 8], vec![8, 9]]
        );
    }
}

/// The rolling log-likelihood of a text as a perplexity ([`perplexity`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Perplexity {
    /// `0.0 - lp_1 - lp_2 - ...` in token order, window after window (docs/EXACTNESS.md,
    /// "Scores of requests"): the negated rolling log-likelihood, bit for bit.
    pub nll: f64,
    /// Tokens scored (every token but the first).
    pub scored: u64,
    /// Windows (requests) the text was cut into.
    pub windows: usize,
}

impl Perplexity {
    /// The mean negative log-likelihood per scored token.
    pub fn mean_nll(&self) -> f64 {
        self.nll / self.scored as f64
    }

    /// `exp(mean NLL)`, with the platform's `exp`: a summary; the contract's numbers are the
    /// log-probabilities and their sum.
    pub fn perplexity(&self) -> f64 {
        self.mean_nll().exp()
    }
}

/// The perplexity of `tokens` (at least 2) in lm-eval's disjoint rolling windows of `window`
/// positions ([`rolling_windows`]), the windows run side by side (`opts.max_batch`).
pub fn perplexity(
    model: &Model,
    tokens: &[u32],
    window: usize,
    dec: &Decoding,
    opts: &ScoreOptions,
    progress: &mut dyn FnMut(&Progress),
) -> Result<(Perplexity, Progress), ScoreError> {
    let windows = rolling_windows(tokens, window, 1);
    let mut p = Perplexity {
        nll: 0.0,
        scored: 0,
        windows: windows.len(),
    };
    // results come in input order: summed in token order, window after window
    let stats = score(
        model,
        &windows,
        dec,
        opts,
        &mut |_, r| {
            if let ScoreResult::Rolling(r) = r {
                for lp in r.token_logprobs {
                    p.nll -= lp;
                    p.scored += 1;
                }
            }
            Ok(())
        },
        progress,
    )?;
    Ok((p, stats))
}
