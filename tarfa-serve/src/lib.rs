//! The OpenAI-compatible server: `POST /v1/completions`, `POST /v1/chat/completions`,
//! `GET /v1/models`, `GET /health`, `GET /metrics`.
//!
//! One std::thread owns the [`Model`] and runs tarfa-score's [`Scheduler`]: every in-flight
//! request's next chunk is one engine step, requests join and leave between steps. The HTTP
//! handlers (axum on tokio) only turn OpenAI's fields into the JSON of a `tarfa-run score`
//! request, parsed by the same [`tarfa_score::parse_line`], and the result back into OpenAI's
//! shape. So a completion's numbers are the ones `tarfa-run score` prints for the same request,
//! and, since a request's logit rows do not depend on what shares its steps, the same bits at any
//! load.
//!
//! A request leaves early in two ways, both at the next step, both through
//! [`Scheduler::cancel`] (its sequence truncated and returned to the pool, never written again
//! for it): its client closed the connection (queued or running, streaming or not), or it passed
//! its deadline (`request_timeout`, or a shorter `x-tarfa-timeout` header), which is answered 504
//! (a stream ends with an error event). What shares its steps is unaffected: each request's
//! numbers come from its own rows.

mod api;
mod metrics;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use tarfa_core::chat::ChatTemplate;
use tarfa_engine::Model;
use tarfa_score::{Decoding, Event, Request, Scheduler, ScoreOptions, Ticket};
use tokio::sync::mpsc::UnboundedSender;

use metrics::Cancel;
pub use metrics::{Metrics, VerificationProbe, Verified};

/// What the server says about its model and how it schedules.
pub struct ServeConfig {
    /// The bundle's name (its directory's).
    pub name: String,
    /// The bundle's root digest (hex).
    pub root_digest: String,
    /// Requests in flight at once.
    pub max_batch: usize,
    /// Requests waiting beyond those in flight; more are answered 429.
    pub max_queue: usize,
    /// Completions' speculative decoding: drafts per decode step (0: none), by prompt lookup
    /// or by the draft model of [`serve_drafted`]; [`ScoreOptions::draft_tokens`]. Every answer is the same bits either way.
    pub draft_tokens: usize,
    /// Bearer token every endpoint but /health requires.
    pub api_key: Option<String>,
    pub vocab_size: usize,
    pub max_positions: usize,
    pub eos: Vec<u32>,
    pub tokenizer: Option<tokenizers::Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
    /// Every request's deadline, from its arrival; `None`: no deadline. A client may ask for a
    /// shorter one (`x-tarfa-timeout`), never a longer one.
    pub request_timeout: Option<Duration>,
    /// The bundle reader's verification counts, for /metrics.
    pub verification: Option<VerificationProbe>,
}

/// Why the server did not run.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The address could not be bound (in use, not permitted).
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    /// The runtime or the connection loop failed.
    #[error("server: {0}")]
    Io(#[from] std::io::Error),
    /// The scheduler thread panicked.
    #[error("the scheduler thread stopped unexpectedly")]
    SchedulerPanicked,
}

/// What a request's handler hears from the scheduler thread.
pub(crate) enum Reply {
    Event(Event),
    /// The request passed its deadline and was cancelled; nothing follows.
    Expired,
}

/// One HTTP request, shared by the submissions of its prompts and choices: it is counted
/// cancelled once, however many of its sequences are freed.
#[derive(Default)]
pub(crate) struct Origin {
    cancelled: AtomicBool,
}

/// A request for the scheduler thread, with where its replies go.
pub(crate) struct Submission {
    pub request: Request,
    pub replies: UnboundedSender<Reply>,
    /// When the scheduler cancels it (checked before every step).
    pub deadline: Option<Instant>,
    pub origin: Arc<Origin>,
}

/// What the scheduler thread keeps of a submitted request to cancel it: a departed client is
/// seen as its reply channel closed, a deadline against the clock, both before every step.
struct Watched {
    replies: UnboundedSender<Reply>,
    deadline: Option<Instant>,
    origin: Arc<Origin>,
}

/// What the handlers share.
pub(crate) struct Shared {
    pub cfg: ServeConfig,
    /// `None` once the server stops accepting: the scheduler thread then drains and returns.
    pub submit: std::sync::Mutex<Option<mpsc::Sender<Submission>>>,
    /// Requests submitted and not yet finished (waiting or in flight): the backpressure count.
    pub pending: AtomicUsize,
    pub metrics: Metrics,
}

impl Shared {
    pub(crate) fn decoding(&self) -> Decoding<'_> {
        Decoding {
            tokenizer: self.cfg.tokenizer.as_ref(),
            eos: &self.cfg.eos,
        }
    }
}

/// Binds `addr`, calls `on_listening` with the bound address (a port of 0 picks a free one),
/// serves until SIGTERM or SIGINT, then drains: every request already accepted runs to its end
/// before this returns.
pub fn serve(
    model: Model,
    cfg: ServeConfig,
    addr: SocketAddr,
    on_listening: &dyn Fn(SocketAddr),
) -> Result<(), ServeError> {
    serve_drafted(model, None, cfg, addr, on_listening)
}

/// [`serve`] with completions drafted by `draft` (a draft model of the same tokenizer:
/// [`Scheduler::with_draft_model`]) in place of prompt lookup, when given and
/// `cfg.draft_tokens` is above 0. Every answer is the same bits as without.
pub fn serve_drafted(
    model: Model,
    draft: Option<Model>,
    cfg: ServeConfig,
    addr: SocketAddr,
    on_listening: &dyn Fn(SocketAddr),
) -> Result<(), ServeError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(addr))
        .map_err(|source| ServeError::Bind { addr, source })?;
    let bound = listener.local_addr()?;
    let (tx, rx) = mpsc::channel::<Submission>();
    let shared = Arc::new(Shared {
        cfg,
        submit: std::sync::Mutex::new(Some(tx)),
        pending: AtomicUsize::new(0),
        metrics: Metrics::default(),
    });
    let worker = {
        let shared = shared.clone();
        std::thread::Builder::new()
            .name("tarfa-scheduler".into())
            .spawn(move || run_scheduler(&model, draft.as_ref(), &shared, rx))?
    };
    on_listening(bound);
    let app = api::router(shared.clone());
    rt.block_on(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown_signal())
            .await
    })?;
    // the handlers are gone: closing the channel lets the thread finish what it holds and stop
    // (the thread holds `shared` too, so the sender is taken out rather than dropped with it)
    shared.submit.lock().expect("submit channel").take();
    drop(shared);
    worker.join().map_err(|_| ServeError::SchedulerPanicked)?;
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("a SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutting down: draining the requests in flight");
}

/// The scheduler thread: blocks while idle, otherwise takes every new submission and runs one
/// step. Stops when every sender is gone and nothing is left to run.
fn run_scheduler(
    model: &Model,
    draft: Option<&Model>,
    shared: &Arc<Shared>,
    rx: mpsc::Receiver<Submission>,
) {
    let opts = ScoreOptions {
        max_batch: shared.cfg.max_batch,
        draft_tokens: shared.cfg.draft_tokens,
        ..ScoreOptions::default()
    };
    let dec = shared.decoding();
    let mut sched = Scheduler::new(model, opts);
    if let Some(d) = draft {
        sched = sched.with_draft_model(d);
    }
    let mut watched: BTreeMap<Ticket, Watched> = BTreeMap::new();
    let mut open = true;
    loop {
        if sched.is_idle() {
            // whatever is still watched has finished
            watched.clear();
            if !open {
                return;
            }
            match rx.recv() {
                Ok(s) => submit(&mut sched, &mut watched, shared, s),
                Err(_) => return,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(s) => submit(&mut sched, &mut watched, shared, s),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        cancel_departed_and_expired(&mut sched, &mut watched, &shared.metrics, Instant::now());
        shared
            .metrics
            .set_depths(sched.waiting() as u64, sched.running() as u64);
        let before = sched.progress();
        if let Err(e) = sched.step(&dec) {
            tracing::error!("engine step failed: {e}");
        }
        let after = sched.progress();
        shared
            .metrics
            .add_tokens(after.tokens.saturating_sub(before.tokens));
        shared.metrics.add_drafts(
            after.drafted.saturating_sub(before.drafted),
            after.accepted.saturating_sub(before.accepted),
        );
        shared
            .metrics
            .set_depths(sched.waiting() as u64, sched.running() as u64);
    }
}

/// Cancels, before the next step, every request whose client has gone (its reply channel is
/// closed: the handler, and with it the receiver, was dropped when the connection closed) or
/// whose deadline has passed (its handler is told, and answers 504). A ticket the scheduler no
/// longer holds has finished: it is forgotten.
fn cancel_departed_and_expired(
    sched: &mut Scheduler<'_>,
    watched: &mut BTreeMap<Ticket, Watched>,
    metrics: &Metrics,
    now: Instant,
) {
    watched.retain(|&ticket, w| {
        let why = if w.replies.is_closed() {
            Cancel::Disconnect
        } else if w.deadline.is_some_and(|d| now >= d) {
            Cancel::Deadline
        } else {
            return true;
        };
        if sched.cancel(ticket) {
            if why == Cancel::Deadline {
                let _ = w.replies.send(Reply::Expired);
            }
            if !w.origin.cancelled.swap(true, Ordering::SeqCst) {
                metrics.cancelled(why);
            }
        }
        false
    });
}

/// Decrements the backpressure count when the scheduler drops a request's sink: at its end,
/// its failure, or its cancellation (where the sink hears nothing more).
struct PendingSlot<'a>(&'a AtomicUsize);

impl Drop for PendingSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn submit<'a>(
    sched: &mut Scheduler<'a>,
    watched: &mut BTreeMap<Ticket, Watched>,
    shared: &'a Arc<Shared>,
    s: Submission,
) {
    let replies = s.replies.clone();
    let slot = PendingSlot(&shared.pending);
    let ticket = sched.submit(
        s.request,
        Box::new(move |e: Event| {
            let _held = &slot;
            replies.send(Reply::Event(e)).is_ok()
        }),
    );
    watched.insert(
        ticket,
        Watched {
            replies: s.replies,
            deadline: s.deadline,
            origin: s.origin,
        },
    );
}
