//! Exact speculative decoding: a [`Drafter`] proposes the next few tokens, one forward step over
//! the pending token and the drafts verifies them all, and the run keeps the drafts the model
//! itself would have chosen. The output is [`generate::run_with`]'s, bit for bit: the contract
//! (docs/EXACTNESS.md §9) makes every row of a many-token step the logits that one token per step
//! would give, and each token is chosen from its own row exactly as the plain loop chooses it
//! (greedy: [`argmax`]; sampling: [`sampling::sample`] at that token's own step counter with that
//! token's own history). docs/EXACTNESS.md "Speculative decoding" says why this is exact.
//!
//! This module only sequences forward steps and rewinds; it must never touch the arithmetic.

use crate::generate::{argmax, Choice, Flow, Greedy, Keep, Observer, Session, Step};
use crate::sampling;
use crate::step::{FinalHidden, ForwardOptions, LogitRows};

/// Proposes tokens to follow a context. Its proposals only decide how much work a step may save:
/// a wrong draft costs a wasted position, never a different token.
///
/// `E` is the run's error type: a drafter that cannot fail (prompt lookup) implements the trait
/// for every `E`; a draft model's failed step ([`ModelDrafter`]) ends the run with its error, as
/// the verifying model's own would.
pub trait Drafter<E = std::convert::Infallible> {
    /// Up to `k` tokens proposed to follow `context` (the prompt and every token chosen so far);
    /// any beyond `k` are ignored.
    fn draft(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, E>;
}

/// Prompt lookup (n-gram) drafting, no model: the context's last `n` tokens are looked up in
/// the earlier context, and the tokens that followed the match are proposed.
///
/// The rule: for `n` from `max_n` down to `min_n`, the most recent earlier occurrence of the last
/// `n` tokens (one that starts before the suffix itself does) wins, and up to `k` of the tokens
/// that followed it are the draft; the longest `n` that matches anywhere is used. The most recent
/// match is taken because it is the one most likely to continue as the text now does (a quoted
/// passage, a repeated line of code). No match: no draft (the step is a plain one-token step).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NgramDrafter {
    /// The longest suffix looked up.
    pub max_n: usize,
    /// The shortest suffix looked up (at least 1).
    pub min_n: usize,
}

impl Default for NgramDrafter {
    /// Suffixes of 3 down to 2 tokens: one token alone matches too often in text that does not
    /// repeat, and every wrong draft is a position computed for nothing.
    fn default() -> Self {
        NgramDrafter { max_n: 3, min_n: 2 }
    }
}

impl NgramDrafter {
    /// The draft for `context` (see the type's rule): up to `k` tokens, perhaps none.
    pub fn propose(&self, context: &[u32], k: usize) -> Vec<u32> {
        let len = context.len();
        if k == 0 {
            return Vec::new();
        }
        for n in (self.min_n.max(1)..=self.max_n).rev() {
            if n >= len {
                continue;
            }
            let suffix = &context[len - n..];
            // Starts p with p + n < len: the match ends before the context does, so at least
            // one token follows it. The most recent first.
            if let Some(p) = (0..len - n).rev().find(|&p| &context[p..p + n] == suffix) {
                let from = p + n;
                return context[from..len.min(from + k)].to_vec();
            }
        }
        Vec::new()
    }
}

impl<E> Drafter<E> for NgramDrafter {
    fn draft(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, E> {
        Ok(self.propose(context, k))
    }
}

/// A drafter that never proposes anything: every step is a plain one-token step.
impl<E> Drafter<E> for () {
    fn draft(&mut self, _context: &[u32], _k: usize) -> Result<Vec<u32>, E> {
        Ok(Vec::new())
    }
}

/// A draft model: a second, cheaper model with the same tokenizer, run greedily on its own
/// [`Session`] (its own cache), whose next `k` greedy tokens are the draft. They are only
/// proposals: the verifying model accepts those it would have chosen itself, so the output is
/// plain decoding's whatever the draft model says (a wrong draft costs positions, never bits).
///
/// The draft model's cache is kept in step with the context it is asked about: it holds the
/// tokens it was last fed (the context then, and its own drafts but the last), and each call
/// rewinds it to the longest prefix it shares with the new context (so positions past a
/// rejected draft are forgotten and the accepted ones are kept) and feeds only the rest, usually
/// the verifying step's last one or two tokens. It never feeds more than `max_positions`
/// positions (the draft model's own limit): near it, it drafts fewer tokens, then none.
pub struct ModelDrafter<S> {
    session: S,
    /// The tokens in the session's cache, in order.
    fed: Vec<u32>,
    max_positions: usize,
    /// The draft model's steps run (each one or more positions).
    pub steps: u64,
    /// Positions the draft model computed (prompt and rewound ones included).
    pub positions: u64,
}

/// A rewind to a length at or after the verifying step's start (the rejected drafts' rows),
/// `context` holding at least the `len` tokens the cache must then hold. An attention cache
/// serves it in full; a gated DeltaNet layer's state exists only at the step's start
/// ([`crate::batch::Rewind::rewind_to`] keeps fewer), so the accepted tokens after what was
/// kept are fed again (their outputs discarded): the cache then holds what one token per step
/// would have left, bit for bit (prefill equals decode).
fn rewind_within_step<S: Session + ?Sized>(
    session: &mut S,
    len: usize,
    context: &[u32],
) -> Result<(), S::Error> {
    let kept = session.rewind_to(len);
    if kept < len {
        let opts = ForwardOptions::default();
        let _refed = session.forward(&context[kept..len], &opts)?;
    }
    Ok(())
}

impl<S: Session> ModelDrafter<S> {
    /// Drafts with `session` (emptied first), which accepts up to `max_positions` positions.
    pub fn new(mut session: S, max_positions: usize) -> Self {
        let _emptied = session.rewind_to(0);
        ModelDrafter {
            session,
            fed: Vec::new(),
            max_positions,
            steps: 0,
            positions: 0,
        }
    }

    /// The draft model's session.
    pub fn session(&self) -> &S {
        &self.session
    }

    /// The tokens the draft model's cache holds.
    pub fn fed(&self) -> &[u32] {
        &self.fed
    }

    fn greedy_after(&mut self, feed: &[u32]) -> Result<u32, S::Error> {
        self.steps += 1;
        self.positions += feed.len() as u64;
        let t = match feed {
            // One token: the draft model's token-only step (CUDA: argmax on the device).
            [t] => self.session.greedy_step(*t)?.0,
            _ => {
                let opts = ForwardOptions {
                    logits: LogitRows::Last,
                    ..ForwardOptions::default()
                };
                let out = self.session.forward(feed, &opts)?;
                argmax(out.logits.last().map(Vec::as_slice).unwrap_or(&[]))
            }
        };
        self.fed.extend_from_slice(feed);
        Ok(t)
    }
}

impl<S: Session, E: From<S::Error>> Drafter<E> for ModelDrafter<S> {
    fn draft(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, E> {
        // After d drafts the cache holds context.len() + d - 1 positions.
        let k = k.min(
            self.max_positions
                .saturating_add(1)
                .saturating_sub(context.len()),
        );
        if k == 0 || context.is_empty() {
            return Ok(Vec::new());
        }
        // The longest prefix the cache shares with the context, less the context's last token
        // at least (its row gives the first draft).
        let shared = self
            .fed
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count()
            .min(context.len() - 1);
        // a windowed model may keep fewer (its dropped rows): re-feed from what was kept
        let shared = self.session.rewind_to(shared);
        self.fed.truncate(shared);
        let mut drafts = Vec::with_capacity(k);
        let result = (|| {
            let mut t = self.greedy_after(&context[shared..])?;
            drafts.push(t);
            while drafts.len() < k {
                t = self.greedy_after(&[t])?;
                drafts.push(t);
            }
            Ok::<(), S::Error>(())
        })();
        if let Err(e) = result {
            // A failed step leaves the cache as it was before it; start afresh next time.
            let _emptied = self.session.rewind_to(0);
            self.fed.clear();
            return Err(e.into());
        }
        Ok(drafts)
    }
}

/// What speculation did in a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Decode steps run (each one forward over the pending token and its drafts).
    pub steps: u64,
    /// Draft tokens fed to those steps.
    pub drafted: u64,
    /// Draft tokens accepted (equal to the token the model chose at their position).
    pub accepted: u64,
}

impl SpecStats {
    /// Accepted over drafted (0 when nothing was drafted).
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

/// [`generate::run_with`] with up to `k` drafted tokens verified per decode step: the same
/// tokens, the same logits in [`Greedy::step_logits`] (under [`Keep::Logits`]), the same
/// observer [`Observer::token`] calls, and the same cache length at the end (positions past a
/// rejected draft or past a stop are rewound with [`Session::rewind_to`]).
///
/// Each decode step feeds `[pending, d_1..d_m]` (m <= k drafts, never more than the tokens still
/// to be chosen after the next) with the logits of every row. Row i chooses the token at its
/// position as the plain loop would; drafts are accepted while the chosen token equals the draft,
/// and the first token that differs (or the token after the last draft) is the next pending
/// token. `before_step`/`after_step` see one decode step of m + 1 tokens with the counters of all
/// m + 1 (rejected positions were computed: their bytes count). With a router trace
/// (`opts.trace_router`) nothing is drafted, so that the trace holds no rejected position.
///
/// When nothing but the greedy tokens is asked for (greedy, [`Keep::Tokens`], no trace, the exact
/// final hidden state: `run_with`'s token-only path) no logits come back to the host: a step
/// without drafts is [`Session::greedy_step`], the plain loop's own step (CUDA's argmax on the
/// device), and a step with drafts is [`Session::greedy_rows`]. Plain decoding's run-ahead
/// ([`Session::run_ahead`]) is not used: each step's drafts depend on the tokens before it.
///
/// [`generate::run_with`]: crate::generate::run_with
#[allow(clippy::too_many_arguments)]
pub fn run_speculative<S, O, D>(
    session: &mut S,
    prompt: &[u32],
    n_new: usize,
    opts: &ForwardOptions,
    keep: Keep,
    choice: Choice<'_>,
    drafter: &mut D,
    k: usize,
    observer: &mut O,
) -> Result<(Greedy, SpecStats), O::Error>
where
    S: Session + ?Sized,
    O: Observer<S> + ?Sized,
    D: Drafter<O::Error> + ?Sized,
{
    let mut stats = SpecStats::default();
    observer.before_step(session, Step::Prefill, prompt.len());
    let mut prefill = session.forward(prompt, opts)?;
    observer.after_step(
        session,
        Step::Prefill,
        prompt.len(),
        &prefill.stats,
        &mut prefill.router,
    )?;
    let first_row = prefill.logits.last().cloned().unwrap_or_default();
    let mut out = Greedy {
        prefill,
        ..Greedy::default()
    };
    if n_new == 0 {
        return Ok((out, stats));
    }
    // As run_with chooses: greedy settings take the argmax, others the counter-based sample at
    // the token's own step with the prompt and the tokens before it as history.
    let sample = match choice {
        Choice::Sample { params, request } if !params.is_greedy() => Some((params, request)),
        _ => None,
    };
    // As run_with: nothing but the greedy token is asked for, so the backend may choose it where
    // it computes it and no logits come back.
    let token_only = sample.is_none()
        && keep == Keep::Tokens
        && !opts.trace_router
        && opts.final_hidden == FinalHidden::Exact;
    let pick = |row: &[f32], history: &[u32], step: usize| match sample {
        Some((params, request)) => sampling::sample(row, history, params, request, step as u64),
        None => argmax(row),
    };
    // The prompt and every token chosen: the sampler's history and the drafter's context.
    let mut context = prompt.to_vec();
    let mut j = 0;
    let mut pending = pick(&first_row, &context, 0);
    context.push(pending);
    out.tokens.push(pending);
    if keep == Keep::Logits {
        out.step_logits.push(first_row);
    }
    if observer.token(0, pending)? == Flow::Stop || n_new == 1 {
        return Ok((out, stats));
    }
    loop {
        // `pending` is token j, chosen and shown, not yet fed; j + 1 < n_new. The step's rows
        // choose tokens j+1 ..= j+1+m, never past the last (n_new - 1).
        let room = if opts.trace_router {
            0
        } else {
            k.min(n_new - 2 - j)
        };
        let mut drafts = if room > 0 {
            drafter.draft(&context, room)?
        } else {
            Vec::new()
        };
        drafts.truncate(room);
        let mut feed = Vec::with_capacity(drafts.len() + 1);
        feed.push(pending);
        feed.extend_from_slice(&drafts);
        let base = session.cached_len();
        observer.before_step(session, Step::Decode, feed.len());
        // Rows of logits (chosen from on the host), or, on the token-only path, the greedy
        // tokens themselves (chosen by the backend: CUDA's argmax on the device, no logits
        // copied back; a step without drafts is plain decoding's own `greedy_step`).
        let (rows, greedy_tokens, step_stats) = if token_only {
            let (tokens, st) = if drafts.is_empty() {
                let (t, st) = session.greedy_step(pending)?;
                (vec![t], st)
            } else {
                session.greedy_rows(&feed)?
            };
            observer.after_step(session, Step::Decode, feed.len(), &st, &mut Vec::new())?;
            (Vec::new(), tokens, st)
        } else {
            let step_opts = ForwardOptions {
                logits: if drafts.is_empty() {
                    LogitRows::Last
                } else {
                    LogitRows::All
                },
                ..*opts
            };
            let mut step = session.forward(&feed, &step_opts)?;
            observer.after_step(
                session,
                Step::Decode,
                feed.len(),
                &step.stats,
                &mut step.router,
            )?;
            (step.logits, Vec::new(), step.stats)
        };
        out.decode_weight_bytes += step_stats.weight_bytes;
        stats.steps += 1;
        stats.drafted += drafts.len() as u64;
        let mut rows = rows.into_iter();
        for i in 0..feed.len() {
            let at = j + 1 + i;
            let t = if token_only {
                greedy_tokens[i]
            } else {
                let row = rows.next().unwrap_or_default();
                let t = pick(&row, &context, at);
                if keep == Keep::Logits {
                    out.step_logits.push(row);
                }
                t
            };
            context.push(t);
            out.tokens.push(t);
            // The cache keeps `pending` and the drafts accepted before row i: what one token
            // per step would have fed before choosing token `at`.
            // Row i follows the i drafts accepted before it in this step.
            if observer.token(at, t)? == Flow::Stop || at + 1 == n_new {
                rewind_within_step(session, base + i + 1, &context)?;
                observer.drafts_verified(drafts.len(), i);
                return Ok((out, stats));
            }
            if i == drafts.len() || t != drafts[i] {
                rewind_within_step(session, base + i + 1, &context)?;
                observer.drafts_verified(drafts.len(), i);
                pending = t;
                j = at;
                break;
            }
            stats.accepted += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::run_with;
    use crate::sampling::SamplingParams;
    use crate::step::{ForwardOutput, StepStats};

    const VOCAB: usize = 13;

    /// A session whose logits at each position depend on every token cached so far (so a wrong
    /// rewind or a lost position changes the rest of the run), with a repetitive bias: the
    /// largest logit is often the token that followed the previous token last time.
    #[derive(Default)]
    struct Fake {
        /// Another model (0: the verified one): a draft model that agrees with it only where
        /// the repetition bias decides.
        salt: u64,
        /// Fail every forward after this many (a draft model's failing step).
        fail_after: Option<usize>,
        cache: Vec<u32>,
        forwards: usize,
        /// Calls of the token-only entry points.
        greedy_steps: usize,
        greedy_rows: usize,
    }

    fn row(prefix: &[u32]) -> Vec<f32> {
        salted_row(prefix, 0)
    }

    fn salted_row(prefix: &[u32], salt: u64) -> Vec<f32> {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ salt;
        for &t in prefix {
            h = (h ^ t as u64).wrapping_mul(0x100_0000_01b3);
        }
        let mut r: Vec<f32> = (0..VOCAB)
            .map(|i| ((h >> (i % 8 * 8)) & 0xff) as f32 / 64.0 + i as f32 * 0.001)
            .collect();
        // Repetition: after token t, favour what followed t's previous occurrence.
        if let Some((&last, before)) = prefix.split_last() {
            if let Some(p) = before.iter().rposition(|&x| x == last) {
                if !h.is_multiple_of(4) {
                    r[before.get(p + 1).copied().unwrap_or(last) as usize] += 8.0;
                }
            }
        }
        r
    }

    impl Session for Fake {
        type Error = String;
        fn forward(&mut self, t: &[u32], o: &ForwardOptions) -> Result<ForwardOutput, String> {
            if t.is_empty() {
                return Err("empty step".into());
            }
            if self.fail_after.is_some_and(|n| self.forwards >= n) {
                return Err("the device fell over".into());
            }
            self.forwards += 1;
            let mut logits = Vec::new();
            for &tok in t {
                self.cache.push(tok);
                logits.push(salted_row(&self.cache, self.salt));
            }
            if o.logits == LogitRows::Last {
                logits.drain(..logits.len() - 1);
            }
            Ok(ForwardOutput {
                logits,
                router: vec![],
                stats: StepStats {
                    weight_bytes: t.len() as u64,
                    experts_fetched: 0,
                },
            })
        }
        fn greedy_step(&mut self, t: u32) -> Result<(u32, StepStats), String> {
            self.greedy_steps += 1;
            let o = ForwardOptions::default();
            let out = self.forward(&[t], &o)?;
            Ok((argmax(&out.logits[0]), out.stats))
        }
        fn greedy_rows(&mut self, t: &[u32]) -> Result<(Vec<u32>, StepStats), String> {
            self.greedy_rows += 1;
            let o = ForwardOptions {
                logits: LogitRows::All,
                ..ForwardOptions::default()
            };
            let out = self.forward(t, &o)?;
            Ok((out.logits.iter().map(|r| argmax(r)).collect(), out.stats))
        }
        fn cached_len(&self) -> usize {
            self.cache.len()
        }
        fn rewind_to(&mut self, len: usize) -> usize {
            self.cache.truncate(len);
            self.cache.len()
        }
    }

    /// Stops at `eos` and records every token call.
    struct Stop {
        eos: Option<u32>,
        calls: Vec<(usize, u32)>,
    }

    impl Observer<Fake> for Stop {
        type Error = String;
        fn token(&mut self, j: usize, t: u32) -> Result<Flow, String> {
            self.calls.push((j, t));
            Ok(if Some(t) == self.eos {
                Flow::Stop
            } else {
                Flow::Continue
            })
        }
    }

    /// Always proposes tokens the model never chooses first (the greedy token plus one).
    struct Wrong;
    impl Drafter<String> for Wrong {
        fn draft(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, String> {
            let mut c = context.to_vec();
            let mut d = Vec::new();
            for _ in 0..k {
                let t = (argmax(&row(&c)) + 1) % VOCAB as u32;
                c.push(t);
                d.push(t);
            }
            Ok(d)
        }
    }

    /// Proposes exactly the greedy continuation (every draft accepted under greedy).
    struct Oracle;
    impl Drafter<String> for Oracle {
        fn draft(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, String> {
            let mut c = context.to_vec();
            for _ in 0..k {
                c.push(argmax(&row(&c)));
            }
            Ok(c[context.len()..].to_vec())
        }
    }

    fn bits(rows: &[Vec<f32>]) -> Vec<Vec<u32>> {
        rows.iter()
            .map(|r| r.iter().map(|x| x.to_bits()).collect())
            .collect()
    }

    /// Plain and speculative runs agree on tokens, logits, token calls and the cache.
    fn check<D: Drafter<String>>(
        drafter: &mut D,
        prompt: &[u32],
        n_new: usize,
        k: usize,
        choice: Choice<'_>,
        eos: Option<u32>,
    ) -> SpecStats {
        let opts = ForwardOptions::default();
        let mut plain = Fake::default();
        let mut po = Stop { eos, calls: vec![] };
        let p = run_with(
            &mut plain,
            prompt,
            n_new,
            &opts,
            Keep::Logits,
            choice,
            &mut po,
        )
        .unwrap();
        let mut spec = Fake::default();
        let mut so = Stop { eos, calls: vec![] };
        let (s, stats) = run_speculative(
            &mut spec,
            prompt,
            n_new,
            &opts,
            Keep::Logits,
            choice,
            drafter,
            k,
            &mut so,
        )
        .unwrap();
        let what = format!("k {k} n_new {n_new} eos {eos:?} {choice:?}");
        assert_eq!(p.tokens, s.tokens, "{what}");
        assert_eq!(bits(&p.step_logits), bits(&s.step_logits), "{what}");
        assert_eq!(po.calls, so.calls, "{what}");
        assert_eq!(plain.cache, spec.cache, "{what}");
        assert!(stats.accepted <= stats.drafted);
        assert!(spec.forwards <= plain.forwards, "{what}");
        // Continuing after the run gives the same bits.
        let next = [3u32];
        let a = plain.forward(&next, &opts).unwrap();
        let b = spec.forward(&next, &opts).unwrap();
        assert_eq!(bits(&a.logits), bits(&b.logits), "{what}");
        if matches!(choice, Choice::Greedy) {
            // The token-only path: the same tokens, token calls and cache, every decode step
            // chosen by the session (greedy_step without drafts, greedy_rows with them).
            let mut plain = Fake::default();
            let mut po = Stop { eos, calls: vec![] };
            let pt = run_with(
                &mut plain,
                prompt,
                n_new,
                &opts,
                Keep::Tokens,
                choice,
                &mut po,
            )
            .unwrap();
            let mut spec = Fake::default();
            let mut so = Stop { eos, calls: vec![] };
            let (st, tstats) = run_speculative(
                &mut spec,
                prompt,
                n_new,
                &opts,
                Keep::Tokens,
                choice,
                drafter,
                k,
                &mut so,
            )
            .unwrap();
            assert_eq!(st.tokens, p.tokens, "{what}: token-only");
            assert_eq!(pt.tokens, p.tokens, "{what}: token-only plain");
            assert!(st.step_logits.is_empty());
            assert_eq!(po.calls, so.calls, "{what}: token-only");
            assert_eq!(plain.cache, spec.cache, "{what}: token-only");
            assert_eq!(tstats, stats, "{what}: token-only");
            assert_eq!(
                (spec.greedy_steps + spec.greedy_rows) as u64,
                tstats.steps,
                "{what}"
            );
            assert_eq!(tstats.drafted == 0, spec.greedy_rows == 0, "{what}");
            // prefill, then each step's one forward
            assert_eq!(spec.forwards as u64, 1 + tstats.steps, "{what}");
        }
        stats
    }

    fn prompts() -> Vec<Vec<u32>> {
        vec![
            // Repeats: drafts match.
            vec![1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3],
            // Never repeats a pair.
            vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
            vec![7],
        ]
    }

    #[test]
    fn ngram_takes_the_longest_most_recent_match() {
        let d = NgramDrafter { max_n: 3, min_n: 1 };
        // Suffix [1, 2] occurs at 0 and 4; the most recent (4) is followed by 9.
        assert_eq!(d.propose(&[1, 2, 7, 8, 1, 2, 9, 6, 1, 2], 2), vec![9, 6]);
        // Longest first: [5, 1, 2] matches at 0 (followed by 3), though [1, 2] matches later.
        assert_eq!(d.propose(&[5, 1, 2, 3, 1, 2, 4, 5, 1, 2], 3), vec![3, 1, 2]);
        // The draft stops at the end of the context and at k.
        assert_eq!(d.propose(&[4, 4], 5), vec![4]);
        assert_eq!(d.propose(&[1, 2, 3, 1, 2, 3, 1], 1), vec![2]);
        // No match, no context, k = 0: nothing.
        assert!(d.propose(&[1, 2, 3], 4).is_empty());
        assert!(d.propose(&[], 4).is_empty());
        assert!(d.propose(&[1, 1, 1], 0).is_empty());
        // min_n 2 ignores a one-token match.
        let d2 = NgramDrafter::default();
        assert!(d2.propose(&[1, 5, 2, 1], 3).is_empty());
    }

    #[test]
    fn greedy_output_is_plain_output_for_every_drafter() {
        let mut accepted = 0;
        for prompt in prompts() {
            for k in [1, 2, 3, 4, 8] {
                for n_new in [0, 1, 2, 3, 5, 9, 24] {
                    for eos in [None, Some(2), Some(4)] {
                        let g = Choice::Greedy;
                        let st = check(&mut NgramDrafter::default(), &prompt, n_new, k, g, eos);
                        accepted += st.accepted;
                        let st = check(&mut Wrong, &prompt, n_new, k, g, eos);
                        assert_eq!(st.accepted, 0);
                        let st = check(&mut Oracle, &prompt, n_new, k, g, eos);
                        if eos.is_none() {
                            assert_eq!(st.accepted, st.drafted, "the oracle's drafts are greedy");
                        }
                        check(&mut (), &prompt, n_new, k, g, eos);
                    }
                }
            }
        }
        assert!(accepted > 0, "the repeating prompt has drafts accepted");
    }

    #[test]
    fn sampled_output_is_plain_output() {
        let params = SamplingParams {
            temperature: 0.8,
            top_k: 5,
            repetition_penalty: 1.1,
            seed: 42,
            ..SamplingParams::default()
        };
        let mut accepted = 0;
        for prompt in prompts() {
            for k in [1, 2, 4, 8] {
                for n_new in [1, 2, 7, 24] {
                    for eos in [None, Some(5)] {
                        let c = Choice::Sample {
                            params: &params,
                            request: 3,
                        };
                        accepted +=
                            check(&mut NgramDrafter::default(), &prompt, n_new, k, c, eos).accepted;
                        check(&mut Wrong, &prompt, n_new, k, c, eos);
                        check(&mut Oracle, &prompt, n_new, k, c, eos);
                    }
                }
            }
        }
        assert!(accepted > 0);
    }

    #[test]
    fn oracle_drafts_save_steps() {
        let st = check(&mut Oracle, &[1, 2, 3], 25, 4, Choice::Greedy, None);
        // 24 tokens after the first, 5 per step: 5 steps (the last one shortened).
        assert_eq!(st.steps, 5);
        assert_eq!(st.accepted, 19);
    }

    /// A draft model over a `Fake` of `salt` (0: the verified model itself, every greedy draft
    /// right; another: a weak draft, right where the repetition bias decides).
    fn model_drafter(salt: u64) -> ModelDrafter<Fake> {
        ModelDrafter::new(
            Fake {
                salt,
                ..Fake::default()
            },
            usize::MAX,
        )
    }

    #[test]
    fn a_draft_model_gives_the_plain_output() {
        let params = SamplingParams {
            temperature: 0.8,
            top_k: 5,
            seed: 9,
            ..SamplingParams::default()
        };
        let sampled = Choice::Sample {
            params: &params,
            request: 0,
        };
        let (mut weak_drafted, mut weak_accepted) = (0, 0);
        for prompt in prompts() {
            for k in 1..=8 {
                for n_new in [1, 2, 5, 24] {
                    for eos in [None, Some(4)] {
                        for salt in [0, 7] {
                            // check() runs the drafter again on the token-only path: the same
                            // drafter, its cache rewound to the prompt.
                            let mut d = model_drafter(salt);
                            let st = check(&mut d, &prompt, n_new, k, Choice::Greedy, eos);
                            assert_eq!(d.session().cache, d.fed(), "the cache is what was fed");
                            if salt == 0 && eos.is_none() {
                                assert_eq!(st.accepted, st.drafted, "a self-draft is greedy");
                            }
                            if salt != 0 {
                                weak_drafted += st.drafted;
                                weak_accepted += st.accepted;
                            }
                            check(&mut model_drafter(salt), &prompt, n_new, k, sampled, eos);
                        }
                    }
                }
            }
        }
        assert!(weak_accepted > 0, "the weak draft is sometimes right");
        assert!(weak_accepted < weak_drafted, "and sometimes wrong");
    }

    #[test]
    fn a_draft_model_stays_in_step_with_the_context() {
        let mut d = model_drafter(7);
        let c1 = [1, 2, 3, 1, 2];
        let d1: Vec<u32> = Drafter::<String>::draft(&mut d, &c1, 3).unwrap();
        assert_eq!(d1.len(), 3);
        // The context and the drafts but the last.
        assert_eq!(d.fed(), [&c1[..], &d1[..2]].concat());
        assert_eq!((d.steps, d.positions), (3, 7));
        // The first draft accepted, the second rejected (another token chosen): only that token
        // is fed after the accepted one, and the drafts are a fresh draft model's.
        let other = (d1[1] + 1) % VOCAB as u32;
        let c2 = [&c1[..], &[d1[0], other]].concat();
        let d2: Vec<u32> = Drafter::<String>::draft(&mut d, &c2, 3).unwrap();
        assert_eq!((d.steps, d.positions), (6, 10));
        let fresh: Vec<u32> = Drafter::<String>::draft(&mut model_drafter(7), &c2, 3).unwrap();
        assert_eq!(d2, fresh);
        assert_eq!(d.fed(), [&c2[..], &d2[..2]].concat());
        assert_eq!(d.session().cache, d.fed());
        // Every draft accepted: the last draft and the new token are fed.
        let c3 = [&c2[..], &d2[..], &[5]].concat();
        let d3: Vec<u32> = Drafter::<String>::draft(&mut d, &c3, 2).unwrap();
        assert_eq!((d.steps, d.positions), (8, 13));
        assert_eq!(
            d3,
            Drafter::<String>::draft(&mut model_drafter(7), &c3, 2).unwrap()
        );
        // Never past the draft model's own positions: 6 allow 2 drafts after 5 tokens.
        let mut short = ModelDrafter::new(Fake::default(), 6);
        let got: Vec<u32> = Drafter::<String>::draft(&mut short, &c1, 4).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(short.session().cache.len(), 6);
        assert!(Drafter::<String>::draft(&mut short, &[1; 7], 4)
            .unwrap()
            .is_empty());
    }

    #[test]
    fn a_failing_draft_model_fails_the_run() {
        let mut d = ModelDrafter::new(
            Fake {
                fail_after: Some(3),
                ..Fake::default()
            },
            usize::MAX,
        );
        let r = run_speculative(
            &mut Fake::default(),
            &[1, 2, 3],
            20,
            &ForwardOptions::default(),
            Keep::Tokens,
            Choice::Greedy,
            &mut d,
            4,
            &mut (),
        );
        assert_eq!(r.unwrap_err(), "the device fell over");
        assert!(d.fed().is_empty() && d.session().cache.is_empty());
    }

    /// Counts `drafts_verified` calls.
    #[derive(Default)]
    struct Verified(Vec<(usize, usize)>);
    impl Observer<Fake> for Verified {
        type Error = String;
        fn drafts_verified(&mut self, drafted: usize, accepted: usize) {
            self.0.push((drafted, accepted));
        }
    }

    #[test]
    fn every_decode_step_reports_its_drafts() {
        for mut d in [model_drafter(0), model_drafter(7)] {
            let mut o = Verified::default();
            let (_, st) = run_speculative(
                &mut Fake::default(),
                &[1, 2, 3],
                20,
                &ForwardOptions::default(),
                Keep::Tokens,
                Choice::Greedy,
                &mut d,
                4,
                &mut o,
            )
            .unwrap();
            assert_eq!(o.0.len() as u64, st.steps);
            assert_eq!(o.0.iter().map(|x| x.0 as u64).sum::<u64>(), st.drafted);
            assert_eq!(o.0.iter().map(|x| x.1 as u64).sum::<u64>(), st.accepted);
            assert!(o.0.iter().all(|&(d, a)| a <= d && d <= 4));
        }
    }
}
