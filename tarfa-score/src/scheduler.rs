//! Continuous batching: requests join at any time, every in-flight request's next chunk runs as
//! one [`Model::step`], and each request's results go to its own sink.
//!
//! [`crate::score()`] is a loop over a [`Scheduler`]; the server is another. A request's numbers
//! come from its own logit rows, which do not depend on what shares its steps nor on when it
//! joined or left (tarfa-engine's contract), so a result is the same bits alone or under any load.
//! A cancelled request (or one whose sink has gone) is dropped before the next step plans, and
//! its sequence goes back to the pool.

use std::collections::VecDeque;

use tarfa_core::generate::argmax;
use tarfa_core::step::{ForwardOptions, LogitRows};
use tarfa_engine::{Model, SeqStep, Sequence};

use crate::request::Request;
use crate::score::{
    Chunk, Decoding, GeneratedToken, Progress, ScoreError, ScoreOptions, ScoreResult, Work,
};

/// A submitted request's handle, for [`Scheduler::cancel`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(pub u64);

/// What a request's sink receives.
#[derive(Debug)]
pub enum Event {
    /// A generated token (generate_until only), as soon as it is chosen.
    Token(GeneratedToken),
    /// The request's result; nothing follows.
    Done(ScoreResult),
    /// The engine failed on this request (its sequence is freed); nothing follows.
    Failed(String),
}

/// Where a request's events go. `false` means the receiver is gone (a client that
/// disconnected): the request is cancelled and its sequence freed before the next step.
pub type Sink<'a> = Box<dyn FnMut(Event) -> bool + 'a>;

struct Queued<'a> {
    ticket: Ticket,
    request: Request,
    sink: Sink<'a>,
}

struct Slot<'a> {
    ticket: Ticket,
    line: usize,
    top_logprobs: usize,
    work: Work,
    seq: Sequence,
    /// The request's sequence on the draft model and the tokens it holds (with a draft model).
    draft: Option<(Sequence, Vec<u32>)>,
    sink: Sink<'a>,
    cancelled: bool,
}

/// One request's draft in the making ([`Scheduler::with_draft_model`]).
struct DraftWant {
    /// Its index among the in-flight requests.
    slot: usize,
    /// The most tokens it may draft.
    room: usize,
    /// What its draft sequence is fed next.
    feed: Vec<u32>,
    drafts: Vec<u32>,
}

/// The in-flight requests on one model, at most `max_batch` at once; the rest wait in arrival
/// order.
pub struct Scheduler<'a> {
    model: &'a Model,
    opts: ScoreOptions,
    next_ticket: u64,
    waiting: VecDeque<Queued<'a>>,
    active: Vec<Slot<'a>>,
    free: Vec<Sequence>,
    /// generate_until's draft model (same tokenizer), and its freed sequences.
    draft_model: Option<&'a Model>,
    draft_free: Vec<Sequence>,
    stats: Progress,
}

impl<'a> Scheduler<'a> {
    pub fn new(model: &'a Model, opts: ScoreOptions) -> Self {
        Scheduler {
            model,
            opts: ScoreOptions {
                max_batch: opts.max_batch.max(1),
                ..opts
            },
            next_ticket: 0,
            waiting: VecDeque::new(),
            active: Vec::new(),
            free: Vec::new(),
            draft_model: None,
            draft_free: Vec::new(),
            stats: Progress::default(),
        }
    }

    /// generate_until drafts with `draft`, a draft model of the same tokenizer, in place of
    /// prompt lookup (when `opts.draft_tokens` is above 0): before each step, every request in
    /// its decode steps gets the draft model's greedy continuation of its context, up to its
    /// room, from its own sequence on the draft model. That sequence keeps the longest prefix it
    /// shares with the request's context (so the positions past a rejected draft are forgotten,
    /// and the accepted ones kept) and is fed only the rest; the requests' draft tokens are run
    /// as one draft-model step per drafted token. The drafts are only proposals: every result is
    /// the bytes of plain decoding, whatever the draft model says.
    pub fn with_draft_model(mut self, draft: &'a Model) -> Self {
        self.draft_model = Some(draft);
        self
    }

    /// Queues `request`; it joins a step as soon as a slot is free.
    pub fn submit(&mut self, request: Request, sink: Sink<'a>) -> Ticket {
        let ticket = Ticket(self.next_ticket);
        self.next_ticket += 1;
        self.stats.requests_total += 1;
        self.waiting.push_back(Queued {
            ticket,
            request,
            sink,
        });
        ticket
    }

    /// Drops the request (waiting or in flight) before the next step; its sink hears nothing
    /// more. `false` when no such request is pending (it finished, or was never submitted).
    pub fn cancel(&mut self, ticket: Ticket) -> bool {
        if let Some(i) = self.waiting.iter().position(|q| q.ticket == ticket) {
            self.waiting.remove(i);
            self.stats.requests_total -= 1;
            return true;
        }
        match self.active.iter_mut().find(|s| s.ticket == ticket) {
            Some(s) => {
                s.cancelled = true;
                true
            }
            None => false,
        }
    }

    /// Requests waiting for a slot.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests in flight (each on its own sequence).
    pub fn running(&self) -> usize {
        self.active.len()
    }

    /// Nothing waiting and nothing in flight.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.active.is_empty()
    }

    /// The counters so far.
    pub fn progress(&self) -> Progress {
        self.stats
    }

    /// Fails every request (waiting and in flight) with `message`: after a step that failed as a
    /// whole, when the caller stops.
    pub fn fail_all(&mut self, message: &str) {
        for mut q in self.waiting.drain(..) {
            (q.sink)(Event::Failed(message.to_string()));
        }
        for mut s in std::mem::take(&mut self.active) {
            (s.sink)(Event::Failed(message.to_string()));
            let _emptied = s.seq.truncate(0);
            self.free.push(s.seq);
            self.free_draft(s.draft);
        }
    }

    fn free_draft(&mut self, draft: Option<(Sequence, Vec<u32>)>) {
        if let Some((mut seq, _)) = draft {
            let _emptied = seq.truncate(0);
            self.draft_free.push(seq);
        }
    }

    /// Fails every in-flight request with `err` (their sequences freed) and returns it.
    fn fail_active(&mut self, err: ScoreError) -> ScoreError {
        let message = err.to_string();
        for mut s in std::mem::take(&mut self.active) {
            (s.sink)(Event::Failed(message.clone()));
            let _emptied = s.seq.truncate(0);
            self.free.push(s.seq);
            self.free_draft(s.draft);
            self.stats.requests_total -= 1;
        }
        err
    }

    /// The draft model's drafts for every request that may draft in the next step
    /// ([`Scheduler::with_draft_model`]): round r runs one draft-model step over every request
    /// still drafting, each fed what its draft sequence lacks (round 0: the context past the
    /// shared prefix; later: its last draft), and takes the argmax of its last row.
    fn draft_with_model(&mut self, dm: &Model) -> Result<(), ScoreError> {
        let max_len = dm.config().max_position_embeddings;
        let mut wants: Vec<DraftWant> = Vec::new();
        for (i, s) in self.active.iter_mut().enumerate() {
            let Some((context, room)) = s.work.draft_request() else {
                continue;
            };
            // After d drafts the draft sequence holds context.len() + d - 1 positions.
            let room = room.min((max_len + 1).saturating_sub(context.len()));
            if room == 0 {
                s.work.set_drafts(Vec::new());
                continue;
            }
            if s.draft.is_none() {
                let seq = match self.draft_free.pop() {
                    Some(q) => q,
                    None => dm.new_sequence().map_err(|source| ScoreError::Engine {
                        line: s.line,
                        source,
                    })?,
                };
                s.draft = Some((seq, Vec::new()));
            }
            let (seq, fed) = s.draft.as_mut().expect("made above");
            let shared = fed
                .iter()
                .zip(&context)
                .take_while(|(a, b)| a == b)
                .count()
                .min(context.len() - 1);
            // a windowed draft model may keep fewer (its dropped rows): re-feed from there
            let shared = seq.truncate(shared);
            fed.truncate(shared);
            wants.push(DraftWant {
                slot: i,
                room,
                feed: context[shared..].to_vec(),
                drafts: Vec::new(),
            });
        }
        while !wants.is_empty() {
            let opts = ForwardOptions {
                logits: LogitRows::Last,
                ..ForwardOptions::default()
            };
            let mut lines = Vec::with_capacity(wants.len());
            let mut steps: Vec<SeqStep> = Vec::with_capacity(wants.len());
            let mut active: Vec<Option<&mut Slot<'a>>> = self.active.iter_mut().map(Some).collect();
            for w in &wants {
                let slot = active[w.slot].take().expect("one want per slot");
                lines.push(slot.line);
                let (seq, _) = slot.draft.as_mut().expect("made above");
                steps.push(SeqStep {
                    seq,
                    tokens: &w.feed,
                    opts,
                });
            }
            let result = dm.step(&mut steps);
            drop(steps);
            drop(active);
            let outs = match result {
                Ok(outs) => outs,
                Err(e) => {
                    // a draft sequence may have advanced: forget what every one holds
                    for s in &mut self.active {
                        if let Some((seq, fed)) = s.draft.as_mut() {
                            let _emptied = seq.truncate(0);
                            fed.clear();
                        }
                    }
                    let err = match e.index {
                        Some(i) => ScoreError::Engine {
                            line: lines[i],
                            source: e.error,
                        },
                        None => ScoreError::Step { source: e.error },
                    };
                    return Err(self.fail_active(err));
                }
            };
            self.stats.draft_steps += 1;
            let mut still = Vec::with_capacity(wants.len());
            for (mut w, out) in wants.into_iter().zip(outs) {
                self.stats.draft_positions += w.feed.len() as u64;
                let t = argmax(out.logits.last().map(Vec::as_slice).unwrap_or(&[]));
                let (_, fed) = self.active[w.slot].draft.as_mut().expect("made above");
                fed.extend_from_slice(&w.feed);
                w.drafts.push(t);
                if w.drafts.len() < w.room {
                    w.feed = vec![t];
                    still.push(w);
                } else {
                    self.active[w.slot].work.set_drafts(w.drafts);
                }
            }
            wants = still;
        }
        Ok(())
    }

    /// Admits waiting requests into free slots, drops cancelled ones, and runs one step of every
    /// in-flight request. Returns `Ok(false)` when there was nothing to run.
    ///
    /// On an engine error every in-flight request fails (each sink gets [`Event::Failed`], the
    /// sequences are freed: their planned chunks were taken) and the error is returned, naming
    /// the request's line when one request caused it; waiting requests stay queued.
    pub fn step(&mut self, dec: &Decoding) -> Result<bool, ScoreError> {
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].cancelled {
                let mut s = self.active.remove(i);
                let _emptied = s.seq.truncate(0);
                self.free.push(s.seq);
                self.free_draft(s.draft);
                self.stats.requests_total -= 1;
            } else {
                i += 1;
            }
        }
        while self.active.len() < self.opts.max_batch {
            let Some(q) = self.waiting.pop_front() else {
                break;
            };
            let seq = match self.free.pop() {
                Some(s) => s,
                None => match self.model.new_sequence() {
                    Ok(s) => s,
                    Err(source) => {
                        let line = q.request.line;
                        let mut sink = q.sink;
                        sink(Event::Failed(source.to_string()));
                        self.stats.requests_total -= 1;
                        return Err(ScoreError::Engine { line, source });
                    }
                },
            };
            self.active.push(Slot {
                ticket: q.ticket,
                line: q.request.line,
                top_logprobs: q.request.options.top_logprobs,
                work: Work::new(&q.request, &self.opts),
                seq,
                draft: None,
                sink: q.sink,
                cancelled: false,
            });
        }
        if self.active.is_empty() {
            return Ok(false);
        }
        if let Some(dm) = self.draft_model.filter(|_| self.opts.draft_tokens > 0) {
            self.draft_with_model(dm)?;
        }
        let plans: Vec<(Chunk, Vec<u32>)> = self
            .active
            .iter_mut()
            .map(|s| s.work.next().expect("in-flight work has a next step"))
            .collect();
        for (s, (c, _)) in self.active.iter_mut().zip(&plans) {
            if c.reset {
                let _emptied = s.seq.truncate(0);
            }
        }
        let mut steps: Vec<SeqStep> = self
            .active
            .iter_mut()
            .zip(&plans)
            .map(|(s, (c, toks))| SeqStep {
                seq: &mut s.seq,
                tokens: toks,
                opts: ForwardOptions {
                    logits: c.rows,
                    ..ForwardOptions::default()
                },
            })
            .collect();
        let result = self.model.step(&mut steps);
        drop(steps);
        let outs = match result {
            Ok(outs) => outs,
            Err(e) => {
                let err = match e.index {
                    Some(i) => ScoreError::Engine {
                        line: self.active[i].line,
                        source: e.error,
                    },
                    None => ScoreError::Step { source: e.error },
                };
                return Err(self.fail_active(err));
            }
        };
        // Each request's log-probs, choices and text come from its own rows alone, so the
        // requests are absorbed in parallel (a log-softmax over the vocabulary per row is most of
        // a decode step's host time); the sinks then see them in slot order.
        {
            use rayon::prelude::*;
            let mut works: Vec<(&mut Work, usize)> = self
                .active
                .iter_mut()
                .map(|s| (&mut s.work, s.top_logprobs))
                .collect();
            works
                .par_iter_mut()
                .zip(plans.par_iter())
                .zip(outs.into_par_iter())
                .for_each(|(((w, k), (c, _)), out)| w.absorb(c, out, *k, dec));
        }
        for (s, (_, toks)) in self.active.iter_mut().zip(&plans) {
            self.stats.tokens += toks.len() as u64;
            // the positions of drafts the step rejected are forgotten
            if let Some(len) = s.work.kept_len() {
                // at or after the step's start: always served in full
                let kept = s.seq.truncate(len);
                assert_eq!(
                    kept, len,
                    "a rewind within the verifying step keeps every position"
                );
            }
            for t in s.work.take_new_tokens() {
                if !s.cancelled && !(s.sink)(Event::Token(t)) {
                    s.cancelled = true;
                }
            }
        }
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].work.is_done() && !self.active[i].cancelled {
                let Slot {
                    work,
                    mut seq,
                    draft,
                    mut sink,
                    ..
                } = self.active.remove(i);
                let _emptied = seq.truncate(0);
                self.free.push(seq);
                self.free_draft(draft);
                self.stats.requests_done += 1;
                let (drafted, accepted) = work.drafts();
                self.stats.drafted += drafted;
                self.stats.accepted += accepted;
                sink(Event::Done(work.result()));
            } else {
                i += 1;
            }
        }
        Ok(true)
    }
}
