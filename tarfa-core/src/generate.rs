//! Greedy decoding: prefill the prompt, then one token at a time, always the largest logit
//! (lowest index among equals). [`run`] is the one decode loop: [`greedy`] (a backend and its
//! cache, everything collected), the CLI (text streamed, logits written, the router traced) and
//! every other caller drive it through a [`Session`] and an [`Observer`].
//!
//! This module only sequences forward steps; it must never touch the arithmetic.

use crate::batch::Rewind;
use crate::step::{FinalHidden, ForwardOptions, ForwardOutput, LogitRows, RouterRecord, StepStats};
use crate::Backend;

/// The index of the largest logit, the lowest among equals (+0.0 and -0.0 are equal). NaN never
/// wins (comparisons with NaN are false); an all-NaN row gives 0.
///
/// Two passes, because the one-pass loop (compare each value with the best so far) is a chain
/// of dependent compares that no compiler vectorises: 0.6 ms per 151,936-logit row here, so a
/// host-side greedy choice for 128 sequences cost ~80 ms a step. First the largest non-NaN value,
/// kept in [`LANES`] independent running maxima (each `if v > m`, so a NaN is skipped; the
/// largest value is the same whatever the grouping, up to the sign of a zero, which the second
/// pass does not see), then the first index holding a value equal to it. The choice is exactly
/// the one-pass loop's (`argmax_is_the_one_pass_loops_choice`).
pub fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    let mut m = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (mj, &v) in m.iter_mut().zip(c) {
            *mj = if v > *mj { v } else { *mj };
        }
    }
    let mut top = f32::NEG_INFINITY;
    for &v in m.iter().chain(rest) {
        if v > top {
            top = v;
        }
    }
    // (a row of NaNs only holds no value equal to -inf: index 0, as the one-pass loop gives)
    logits.iter().position(|&v| v == top).unwrap_or(0) as u32
}

/// The one-pass loop [`argmax`] replaced: the definition its choice must keep (its test and
/// examples/argmax_bench compare the two), not for use.
#[doc(hidden)]
pub fn argmax_one_pass(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate().skip(1) {
        if v > logits[best] || logits[best].is_nan() && !v.is_nan() {
            best = i;
        }
    }
    best as u32
}

/// One sequence on one backend: the forward steps the decode loop runs, each appending its
/// tokens to the sequence's cache.
pub trait Session {
    type Error;

    /// [`Backend::forward`] on this sequence's cache.
    fn forward(
        &mut self,
        tokens: &[u32],
        opts: &ForwardOptions,
    ) -> Result<ForwardOutput, Self::Error>;

    /// [`Backend::greedy_step`] on this sequence's cache: the next token and the step's counters,
    /// with no logits and no router records.
    fn greedy_step(&mut self, token: u32) -> Result<(u32, StepStats), Self::Error>;

    /// How many greedy decode steps [`Session::greedy_steps`] runs in one call to gain speed: 1
    /// (the default) when running ahead gains nothing. A backend that waits for the device after
    /// every token (CUDA) gains by queueing several steps and waiting once.
    fn run_ahead(&self) -> usize {
        1
    }

    /// `n` greedy decode steps from `first`: feeds `first`, then each step's token to the next;
    /// returns the `n` tokens chosen, each with its step's counters. The tokens are
    /// [`Session::greedy_step`]'s, bit for bit. [`run`] calls it only when
    /// [`Session::run_ahead`] is above 1, and drops the positions past a stop with
    /// [`Session::rewind_to`]. The default runs `greedy_step` `n` times.
    fn greedy_steps(&mut self, first: u32, n: usize) -> Result<Vec<(u32, StepStats)>, Self::Error> {
        let mut out = Vec::with_capacity(n);
        let mut t = first;
        for _ in 0..n {
            let step = self.greedy_step(t)?;
            t = step.0;
            out.push(step);
        }
        Ok(out)
    }

    /// One step over `tokens` and the greedy token after each of them: row i's [`argmax`], the
    /// tokens [`Session::forward`] with the logits of every row gives (verifying drafts greedily,
    /// [`crate::speculate`]). The default takes the argmaxes on the host; [`Bound`] and the
    /// engine hand it to [`Backend::greedy_rows`], which a backend that chooses tokens where it
    /// computes them may override.
    fn greedy_rows(&mut self, tokens: &[u32]) -> Result<(Vec<u32>, StepStats), Self::Error> {
        let opts = ForwardOptions {
            logits: LogitRows::All,
            ..ForwardOptions::default()
        };
        let out = self.forward(tokens, &opts)?;
        Ok((out.logits.iter().map(|r| argmax(r)).collect(), out.stats))
    }

    /// Positions in this sequence's cache.
    fn cached_len(&self) -> usize;

    /// Forgets the positions from `len` on (the steps run ahead past a stop) and returns the
    /// positions kept ([`Rewind::rewind_to`]: fewer when a windowed layer dropped rows that
    /// position `len` reads).
    #[must_use = "a rewind may keep fewer positions than asked: re-feed from what it returns"]
    fn rewind_to(&mut self, len: usize) -> usize;
}

/// A backend and one sequence's cache, borrowed: the [`Session`] of [`greedy`].
pub struct Bound<'a, B: Backend> {
    pub backend: &'a B,
    pub cache: &'a mut B::Cache,
}

impl<B: Backend> Session for Bound<'_, B>
where
    B::Cache: Rewind,
{
    type Error = B::Error;

    fn cached_len(&self) -> usize {
        self.cache.cached_len()
    }

    fn rewind_to(&mut self, len: usize) -> usize {
        self.cache.rewind_to(len)
    }

    fn forward(
        &mut self,
        tokens: &[u32],
        opts: &ForwardOptions,
    ) -> Result<ForwardOutput, B::Error> {
        self.backend.forward(self.cache, tokens, opts)
    }

    fn greedy_step(&mut self, token: u32) -> Result<(u32, StepStats), B::Error> {
        self.backend.greedy_step(self.cache, token)
    }

    fn greedy_rows(&mut self, tokens: &[u32]) -> Result<(Vec<u32>, StepStats), B::Error> {
        self.backend.greedy_rows(self.cache, tokens)
    }
}

/// Which forward step of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// The prompt, all its tokens in one step.
    Prefill,
    /// One generated token fed back.
    Decode,
}

/// Whether a run goes on after a token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// End the run after this token (an EOS id): no further step is run.
    Stop,
}

/// What [`run`] keeps of each generated token's logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keep {
    /// Row j of [`Greedy::step_logits`] is the logits that chose token j.
    Logits,
    /// Only the tokens. When the step options ask for nothing else either (no router trace, the
    /// exact final hidden state), every decode step is [`Session::greedy_step`]: the backend
    /// chooses the token where it computes it (CUDA on the GPU, no logits copied back).
    Tokens,
}

/// What a run's caller sees, step by step: the place to stream text, stop at EOS, write the
/// router trace, and account for streaming. Every method has a default that does nothing.
///
/// The calls come in this order: the prefill's `before_step` and `after_step`; then for each
/// token j, `token(j, ..)`, and unless it said [`Flow::Stop`] or j was the last, the decode
/// step's `before_step` and `after_step`. A session that runs ahead ([`Session::run_ahead`])
/// makes that one decode step of k tokens (`before_step`/`after_step` with k, the counters of
/// all k), then `token` for each of the k; the positions past a stop are dropped, so the run's
/// tokens and the cache are those of one token per step.
pub trait Observer<S: Session + ?Sized> {
    type Error: From<S::Error>;

    /// Token `j` (0-based among the generated) was chosen.
    fn token(&mut self, _j: usize, _token: u32) -> Result<Flow, Self::Error> {
        Ok(Flow::Continue)
    }

    /// A step of `tokens` tokens is about to run.
    fn before_step(&mut self, _session: &S, _step: Step, _tokens: usize) {}

    /// A step ran: its counters and router records (empty unless traced; the observer may take
    /// them). For the prefill, whatever it leaves in `router` stays in [`Greedy::prefill`].
    fn after_step(
        &mut self,
        _session: &S,
        _step: Step,
        _tokens: usize,
        _stats: &StepStats,
        _router: &mut Vec<RouterRecord>,
    ) -> Result<(), Self::Error> {
        Ok(())
    }

    /// A speculative decode step ([`crate::speculate::run_speculative`]) fed `drafted` drafts
    /// and kept `accepted` of them; called once per decode step, after its tokens' `token`
    /// calls. Plain decoding never calls it.
    fn drafts_verified(&mut self, _drafted: usize, _accepted: usize) {}
}

/// Observes nothing: the run's result is all the caller wants.
impl<S: Session + ?Sized> Observer<S> for () {
    type Error = S::Error;
}

/// What a greedy run produced.
#[derive(Clone, Debug, Default)]
pub struct Greedy {
    /// The prefill step's output (logits of every prompt position when asked for).
    pub prefill: ForwardOutput,
    /// The generated tokens (an EOS that stopped the run included).
    pub tokens: Vec<u32>,
    /// Row j: the logits that chose `tokens[j]` (empty under [`Keep::Tokens`]).
    pub step_logits: Vec<Vec<f32>>,
    /// Router records of the decode steps (when traced; filled by [`greedy`], not by [`run`]).
    pub decode_router: Vec<RouterRecord>,
    /// Weight bytes the decode steps touched (every matrix applied, experts fetched, embeddings).
    pub decode_weight_bytes: u64,
}

/// How [`run_with`] chooses each token from its step's logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Choice<'a> {
    /// The largest logit, the lowest index among equals ([`argmax`]).
    Greedy,
    /// [`crate::sampling::sample`] with these settings, as request `request` of a run: token j
    /// is drawn at step j, with the prompt and tokens 0..j as its history (docs/EXACTNESS.md
    /// section 8). Settings that are greedy ([`SamplingParams::is_greedy`]) choose as
    /// [`Choice::Greedy`] does, on the same path.
    ///
    /// [`SamplingParams::is_greedy`]: crate::sampling::SamplingParams::is_greedy
    Sample {
        params: &'a crate::sampling::SamplingParams,
        request: u64,
    },
}

impl Choice<'_> {
    fn is_greedy(&self) -> bool {
        match self {
            Choice::Greedy => true,
            Choice::Sample { params, .. } => params.is_greedy(),
        }
    }
}

/// [`run_with`] choosing greedily: the one decode loop, as every greedy caller drives it.
pub fn run<S, O>(
    session: &mut S,
    prompt: &[u32],
    n_new: usize,
    opts: &ForwardOptions,
    keep: Keep,
    observer: &mut O,
) -> Result<Greedy, O::Error>
where
    S: Session + ?Sized,
    O: Observer<S> + ?Sized,
{
    run_with(session, prompt, n_new, opts, keep, Choice::Greedy, observer)
}

/// The one decode loop: prefill `prompt` with `opts`, then up to `n_new` tokens, each fed back
/// as a one-token step (`opts` with `LogitRows::Last`) unless it is the last or the observer
/// stopped the run. EOS is not special here: the observer decides when to stop. The last token
/// is never fed back, so the run computes `prompt.len() + n_new - 1` positions at most. Each
/// token is chosen from its step's logits as `choice` says.
pub fn run_with<S, O>(
    session: &mut S,
    prompt: &[u32],
    n_new: usize,
    opts: &ForwardOptions,
    keep: Keep,
    choice: Choice<'_>,
    observer: &mut O,
) -> Result<Greedy, O::Error>
where
    S: Session + ?Sized,
    O: Observer<S> + ?Sized,
{
    observer.before_step(session, Step::Prefill, prompt.len());
    let mut prefill = session.forward(prompt, opts)?;
    observer.after_step(
        session,
        Step::Prefill,
        prompt.len(),
        &prefill.stats,
        &mut prefill.router,
    )?;
    let mut last = prefill.logits.last().cloned().unwrap_or_default();
    let mut out = Greedy {
        prefill,
        ..Greedy::default()
    };
    let step_opts = ForwardOptions {
        logits: LogitRows::Last,
        ..*opts
    };
    // Nothing but the greedy token is asked for: the backend chooses it and no logits are kept.
    let greedy = choice.is_greedy();
    let token_only = greedy
        && keep == Keep::Tokens
        && !opts.trace_router
        && opts.final_hidden == FinalHidden::Exact;
    // The sampler's history: the prompt, then each token as it is chosen.
    let mut history: Vec<u32> = match choice {
        Choice::Sample { .. } if !greedy => prompt.to_vec(),
        _ => Vec::new(),
    };
    let mut chosen: Option<u32> = None;
    // Token j, once chosen: pushed and shown to the observer, unless a run ahead already did.
    let mut j = 0;
    let mut seen = false;
    while j < n_new {
        let next = chosen.take().unwrap_or_else(|| match choice {
            Choice::Sample { params, request } if !greedy => {
                let t = crate::sampling::sample(&last, &history, params, request, j as u64);
                history.push(t);
                t
            }
            _ => argmax(&last),
        });
        if !std::mem::take(&mut seen) {
            out.tokens.push(next);
            if keep == Keep::Logits {
                out.step_logits.push(std::mem::take(&mut last));
            }
            if observer.token(j, next)? == Flow::Stop || j + 1 == n_new {
                break;
            }
        }
        if token_only && session.run_ahead() > 1 {
            // Run k steps ahead (never past the last token to be chosen) and wait once, then
            // hand their tokens over one by one; a stop drops the positions fed after the
            // stopping token, so the cache is what one step per token leaves.
            let k = session.run_ahead().min(n_new - 1 - j);
            let base = session.cached_len();
            observer.before_step(session, Step::Decode, k);
            let steps = session.greedy_steps(next, k)?;
            let mut stats = StepStats::default();
            for (_, st) in &steps {
                stats.weight_bytes += st.weight_bytes;
                stats.experts_fetched += st.experts_fetched;
            }
            observer.after_step(session, Step::Decode, k, &stats, &mut Vec::new())?;
            for (m, &(t, st)) in steps.iter().enumerate() {
                out.tokens.push(t);
                out.decode_weight_bytes += st.weight_bytes;
                if observer.token(j + 1 + m, t)? == Flow::Stop || j + 2 + m == n_new {
                    // steps 0..=m fed `next` and the tokens before `t`
                    // within the steps run ahead (each at most REWIND_SLACK after the
                    // first): always served in full
                    let kept = session.rewind_to(base + m + 1);
                    assert_eq!(
                        kept,
                        base + m + 1,
                        "a run-ahead rewind keeps every position"
                    );
                    return Ok(out);
                }
            }
            j += k;
            chosen = Some(steps[k - 1].0);
            seen = true;
            continue;
        }
        observer.before_step(session, Step::Decode, 1);
        j += 1;
        if token_only {
            let (t, stats) = session.greedy_step(next)?;
            observer.after_step(session, Step::Decode, 1, &stats, &mut Vec::new())?;
            out.decode_weight_bytes += stats.weight_bytes;
            chosen = Some(t);
            continue;
        }
        let mut step = session.forward(&[next], &step_opts)?;
        observer.after_step(session, Step::Decode, 1, &step.stats, &mut step.router)?;
        out.decode_weight_bytes += step.stats.weight_bytes;
        last = step.logits.into_iter().next().unwrap_or_default();
    }
    Ok(out)
}

/// Collects the decode steps' router records into [`Greedy::decode_router`].
struct CollectRouter(Vec<RouterRecord>);

impl<S: Session + ?Sized> Observer<S> for CollectRouter {
    type Error = S::Error;

    fn after_step(
        &mut self,
        _session: &S,
        step: Step,
        _tokens: usize,
        _stats: &StepStats,
        router: &mut Vec<RouterRecord>,
    ) -> Result<(), S::Error> {
        if step == Step::Decode {
            self.0.append(router);
        }
        Ok(())
    }
}

/// Greedy decoding of `n_new` tokens after `prompt` on `engine` and `cache`, every step's logits
/// and router records kept (EOS is not treated specially: the caller decides when to stop).
/// `opts.logits` applies to the prefill step.
pub fn greedy<B: Backend>(
    engine: &B,
    cache: &mut B::Cache,
    prompt: &[u32],
    n_new: usize,
    opts: &ForwardOptions,
) -> Result<Greedy, B::Error>
where
    B::Cache: Rewind,
{
    let mut session = Bound {
        backend: engine,
        cache,
    };
    let mut collect = CollectRouter(Vec::new());
    let mut out = run(
        &mut session,
        prompt,
        n_new,
        opts,
        Keep::Logits,
        &mut collect,
    )?;
    out.decode_router = collect.0;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A session whose logits after token t put their maximum at (t * 7 + len) % 11, so that
    /// each step's token depends on the previous one and on the position; it logs every call.
    struct Fake {
        len: usize,
        calls: Vec<String>,
        /// Its [`Session::run_ahead`].
        ahead: usize,
    }

    impl Rewind for Fake {
        fn cached_len(&self) -> usize {
            self.len
        }
        fn rewind_to(&mut self, len: usize) -> usize {
            self.len = len;
            len
        }
    }

    fn row(t: u32, len: usize) -> Vec<f32> {
        let mut r = vec![0.0; 11];
        r[(t as usize * 7 + len) % 11] = 1.0;
        r
    }

    impl Session for Fake {
        type Error = String;
        fn forward(&mut self, t: &[u32], o: &ForwardOptions) -> Result<ForwardOutput, String> {
            self.calls.push(format!("forward {t:?} {:?}", o.logits));
            let mut logits = Vec::new();
            for (i, &tok) in t.iter().enumerate() {
                logits.push(row(tok, self.len + i + 1));
            }
            self.len += t.len();
            if o.logits == LogitRows::Last {
                logits.drain(..logits.len() - 1);
            }
            let router = if o.trace_router {
                vec![RouterRecord {
                    layer: 0,
                    moe_layer: 0,
                    position: self.len - 1,
                    experts: vec![],
                    probs: vec![],
                    weights: vec![],
                    kth_prob: 0.0,
                    next_prob: None,
                }]
            } else {
                vec![]
            };
            Ok(ForwardOutput {
                logits,
                router,
                stats: StepStats {
                    weight_bytes: 10 * t.len() as u64,
                    experts_fetched: 0,
                },
            })
        }
        fn greedy_step(&mut self, t: u32) -> Result<(u32, StepStats), String> {
            self.calls.push(format!("greedy_step {t}"));
            self.len += 1;
            let stats = StepStats {
                weight_bytes: 10,
                experts_fetched: 0,
            };
            Ok((argmax(&row(t, self.len)), stats))
        }
        fn run_ahead(&self) -> usize {
            self.ahead
        }
        fn greedy_steps(&mut self, t: u32, n: usize) -> Result<Vec<(u32, StepStats)>, String> {
            self.calls.push(format!("greedy_steps {t} {n}"));
            let mut out = Vec::new();
            let mut t = t;
            for _ in 0..n {
                self.len += 1;
                t = argmax(&row(t, self.len));
                out.push((
                    t,
                    StepStats {
                        weight_bytes: 10,
                        experts_fetched: 1,
                    },
                ));
            }
            Ok(out)
        }
        fn cached_len(&self) -> usize {
            self.len
        }
        fn rewind_to(&mut self, len: usize) -> usize {
            self.calls.push(format!("rewind_to {len}"));
            self.len = len;
            len
        }
    }

    /// Logs the observer calls and stops at `eos`.
    struct Log {
        eos: u32,
        calls: Vec<String>,
    }

    impl Observer<Fake> for Log {
        type Error = String;
        fn token(&mut self, j: usize, t: u32) -> Result<Flow, String> {
            self.calls.push(format!("token {j} {t}"));
            Ok(if t == self.eos {
                Flow::Stop
            } else {
                Flow::Continue
            })
        }
        fn before_step(&mut self, s: &Fake, step: Step, n: usize) {
            self.calls.push(format!("before {step:?} {n} at {}", s.len));
        }
        fn after_step(
            &mut self,
            s: &Fake,
            step: Step,
            n: usize,
            st: &StepStats,
            router: &mut Vec<RouterRecord>,
        ) -> Result<(), String> {
            self.calls.push(format!(
                "after {step:?} {n} at {} bytes {} records {}",
                s.len,
                st.weight_bytes,
                router.len()
            ));
            Ok(())
        }
    }

    fn fake() -> Fake {
        Fake {
            len: 0,
            calls: vec![],
            ahead: 1,
        }
    }

    #[test]
    fn argmax_takes_the_lowest_index_among_equals() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0, 0.5]), 1);
        assert_eq!(argmax(&[0.0, -0.0]), 0);
        assert_eq!(argmax(&[-1.0]), 0);
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[f32::NAN; 40]), 0);
    }

    #[test]
    fn argmax_is_the_one_pass_loops_choice() {
        // rows of every length around the lane count, drawn from a few values so that ties,
        // signed zeros, infinities and NaNs (leading, trailing, everywhere) all occur
        let pool = [
            f32::NAN,
            f32::NEG_INFINITY,
            f32::INFINITY,
            -0.0,
            0.0,
            -1.5,
            2.25,
            2.25,
            f32::MIN,
            f32::MAX,
            1e-45,
        ];
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for n in (0..70).chain([151_936]) {
            for _ in 0..200 {
                // a row of one or a few of the pool's values
                let k = 1 + (next() % pool.len() as u64) as usize;
                let from = (next() % (pool.len() - k + 1) as u64) as usize;
                let row: Vec<f32> = (0..n)
                    .map(|_| pool[from + (next() % k as u64) as usize])
                    .collect();
                assert_eq!(argmax(&row), argmax_one_pass(&row), "{row:?}");
            }
        }
    }

    #[test]
    fn the_token_only_path_chooses_the_tokens_the_logits_path_does() {
        let opts = ForwardOptions::default();
        let mut a = fake();
        let with = run(
            &mut a,
            &[3, 1],
            6,
            &opts,
            Keep::Logits,
            &mut Log {
                eos: 99,
                calls: vec![],
            },
        )
        .unwrap();
        let mut b = fake();
        let without = run(
            &mut b,
            &[3, 1],
            6,
            &opts,
            Keep::Tokens,
            &mut Log {
                eos: 99,
                calls: vec![],
            },
        )
        .unwrap();
        // Position p's token: after token t at length p, (t * 7 + p) % 11.
        assert_eq!(with.tokens, vec![9, 0, 4, 0, 6, 5]);
        assert_eq!(without.tokens, with.tokens);
        assert_eq!(with.step_logits.len(), 6);
        assert_eq!(with.step_logits[1], row(9, 3));
        assert!(without.step_logits.is_empty());
        // Five decode steps (the last token is never fed back), each one step of the session.
        assert_eq!(
            a.calls
                .iter()
                .filter(|c| c.starts_with("forward ["))
                .count(),
            6
        );
        assert_eq!(
            b.calls
                .iter()
                .filter(|c| c.starts_with("greedy_step"))
                .count(),
            5
        );
        assert_eq!(with.decode_weight_bytes, 50);
        assert_eq!(without.decode_weight_bytes, 50);
        assert_eq!(with.prefill.stats.weight_bytes, 20);
    }

    #[test]
    fn running_ahead_gives_the_tokens_and_the_cache_of_one_step_per_token() {
        let opts = ForwardOptions::default();
        // the greedy path from [3, 1] is 9, 0, 4, 0, 6, 5, ...: stop at 0 (token 1), at 6
        // (token 4), or never
        for eos in [0u32, 6, 99] {
            for n_new in [1usize, 2, 3, 5, 6, 9] {
                let mut one = fake();
                let want = run(
                    &mut one,
                    &[3, 1],
                    n_new,
                    &opts,
                    Keep::Tokens,
                    &mut Log { eos, calls: vec![] },
                )
                .unwrap();
                for ahead in [2usize, 3, 8] {
                    let mut s = Fake { ahead, ..fake() };
                    let mut log = Log { eos, calls: vec![] };
                    let got = run(&mut s, &[3, 1], n_new, &opts, Keep::Tokens, &mut log).unwrap();
                    let case = format!("eos {eos}, {n_new} new, ahead {ahead}");
                    assert_eq!(got.tokens, want.tokens, "{case}");
                    assert_eq!(s.len, one.len, "{case}: the cache after the run");
                    assert_eq!(got.decode_weight_bytes, want.decode_weight_bytes, "{case}");
                    // each token shown once, in order
                    let shown: Vec<String> = log
                        .calls
                        .iter()
                        .filter(|c| c.starts_with("token"))
                        .cloned()
                        .collect();
                    let want_shown: Vec<String> = want
                        .tokens
                        .iter()
                        .enumerate()
                        .map(|(j, t)| format!("token {j} {t}"))
                        .collect();
                    assert_eq!(shown, want_shown, "{case}");
                    // never a step past the last token to be chosen
                    let mut fed = 0;
                    for c in s.calls.iter().filter(|c| c.starts_with("greedy_steps")) {
                        let n: usize = c.rsplit(' ').next().unwrap().parse().unwrap();
                        assert!(n >= 1 && n <= ahead, "{case}: {c}");
                        fed += n;
                    }
                    assert!(fed < n_new.max(1), "{case}: {fed} steps for {n_new} tokens");
                    assert!(
                        !s.calls.iter().any(|c| c.starts_with("greedy_step ")),
                        "{case}: {:?}",
                        s.calls
                    );
                }
            }
        }
        // a stop inside a run drops the positions fed after it
        let mut s = Fake { ahead: 8, ..fake() };
        let g = run(
            &mut s,
            &[3, 1],
            9,
            &opts,
            Keep::Tokens,
            &mut Log {
                eos: 6,
                calls: vec![],
            },
        )
        .unwrap();
        assert_eq!(g.tokens, vec![9, 0, 4, 0, 6]);
        assert_eq!(s.calls[1..], ["greedy_steps 9 8", "rewind_to 6"]);
        assert_eq!(
            s.len,
            2 + 4,
            "the prompt and the 4 tokens fed before the stop"
        );
    }

    #[test]
    fn a_sampled_run_draws_token_j_at_step_j_with_the_prompt_and_tokens_before_it() {
        use crate::sampling::{sample, SamplingParams};
        let params = SamplingParams {
            temperature: 1.0,
            repetition_penalty: 3.0,
            seed: 5,
            ..SamplingParams::default()
        };
        let opts = ForwardOptions::default();
        let mut s = fake();
        let choice = Choice::Sample {
            params: &params,
            request: 2,
        };
        let g = run_with(&mut s, &[3, 1], 8, &opts, Keep::Logits, choice, &mut ()).unwrap();
        assert_eq!(g.tokens.len(), 8);
        let mut history = vec![3, 1];
        for (j, row) in g.step_logits.iter().enumerate() {
            let t = sample(row, &history, &params, 2, j as u64);
            assert_eq!(t, g.tokens[j], "token {j}");
            history.push(t);
        }
        assert_ne!(g.tokens, vec![9, 0, 4, 0, 6, 5, 0, 0], "not the greedy run");
        // Sampling needs the logits: every decode step is a forward, even under Keep::Tokens.
        let mut b = fake();
        let again = run_with(&mut b, &[3, 1], 8, &opts, Keep::Tokens, choice, &mut ()).unwrap();
        assert_eq!(again.tokens, g.tokens);
        assert!(
            b.calls.iter().all(|c| c.starts_with("forward")),
            "{:?}",
            b.calls
        );
        // Greedy settings through Sample keep the backend's token-only path.
        let greedy = SamplingParams::default();
        let mut c = fake();
        let choice = Choice::Sample {
            params: &greedy,
            request: 0,
        };
        let g = run_with(&mut c, &[3, 1], 6, &opts, Keep::Tokens, choice, &mut ()).unwrap();
        assert_eq!(g.tokens, vec![9, 0, 4, 0, 6, 5]);
        assert_eq!(
            c.calls
                .iter()
                .filter(|c| c.starts_with("greedy_step"))
                .count(),
            5
        );
    }

    #[test]
    fn a_trace_or_the_invalid_arm_keeps_the_forward_path() {
        for opts in [
            ForwardOptions {
                trace_router: true,
                ..Default::default()
            },
            ForwardOptions {
                final_hidden: FinalHidden::InvalidBf16BeforeLmHead,
                ..Default::default()
            },
        ] {
            let mut s = fake();
            run(
                &mut s,
                &[3],
                3,
                &opts,
                Keep::Tokens,
                &mut Log {
                    eos: 99,
                    calls: vec![],
                },
            )
            .unwrap();
            assert!(
                s.calls.iter().all(|c| c.starts_with("forward")),
                "{:?}",
                s.calls
            );
        }
    }

    #[test]
    fn the_observer_sees_each_step_in_order_and_stops_the_run() {
        let opts = ForwardOptions {
            logits: LogitRows::All,
            trace_router: true,
            ..Default::default()
        };
        let mut s = fake();
        let mut log = Log {
            eos: 0,
            calls: vec![],
        };
        let g = run(&mut s, &[3, 1], 6, &opts, Keep::Logits, &mut log).unwrap();
        assert_eq!(g.tokens, vec![9, 0], "stopped at the EOS, which is kept");
        assert_eq!(g.prefill.logits.len(), 2, "every prompt row");
        assert_eq!(
            g.prefill.router.len(),
            1,
            "the prefill's records stay in the output"
        );
        assert_eq!(
            log.calls,
            [
                "before Prefill 2 at 0",
                "after Prefill 2 at 2 bytes 20 records 1",
                "token 0 9",
                "before Decode 1 at 2",
                "after Decode 1 at 3 bytes 10 records 1",
                "token 1 0",
            ]
        );
        assert_eq!(s.calls, ["forward [3, 1] All", "forward [9] Last"]);
    }

    #[test]
    fn greedy_collects_the_decode_steps_router_records() {
        struct B;
        impl Backend for B {
            type Cache = Fake;
            type Error = crate::RunError;
            fn forward(
                &self,
                c: &mut Fake,
                t: &[u32],
                o: &ForwardOptions,
            ) -> Result<ForwardOutput, crate::RunError> {
                Ok(Session::forward(c, t, o).unwrap())
            }
        }
        let opts = ForwardOptions {
            trace_router: true,
            ..Default::default()
        };
        let g = greedy(&B, &mut fake(), &[3, 1], 4, &opts).unwrap();
        assert_eq!(g.tokens, vec![9, 0, 4, 0]);
        assert_eq!(g.prefill.router.len(), 1);
        let positions: Vec<usize> = g.decode_router.iter().map(|r| r.position).collect();
        assert_eq!(positions, vec![2, 3, 4]);
    }
}
