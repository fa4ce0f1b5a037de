//! The endpoints: OpenAI's fields in, tarfa-score requests to the scheduler, OpenAI's shapes out.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Request as HttpRequest, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::stream::{self, Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use tarfa_core::chat::ChatMessage;
use tarfa_score::{Event, Limits, Options, ScoreResult};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::metrics::{Identity, Refusal};
use crate::{Origin, Reply, Shared, Submission};

type AppState = Arc<Shared>;

pub(crate) fn router(shared: AppState) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/tokenizer_info", get(tokenizer_info))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/metrics", get(metrics))
        .layer(middleware::from_fn_with_state(shared.clone(), authorize))
        .route("/health", get(health))
        .layer(middleware::from_fn_with_state(shared.clone(), provenance))
        .layer(middleware::from_fn_with_state(
            shared.clone(),
            count_refusals,
        ))
        .with_state(shared)
}

/// The header a client sends to shorten its request's deadline (seconds from arrival).
pub(crate) const TIMEOUT_HEADER: &str = "x-tarfa-timeout";

/// An OpenAI-style error.
pub(crate) struct ApiError {
    status: StatusCode,
    kind: &'static str,
    code: Option<&'static str>,
    message: String,
    /// Set when the request was refused before it was queued: counted in /metrics.
    refusal: Option<Refusal>,
}

impl ApiError {
    fn bad(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code: None,
            message: message.into(),
            refusal: Some(Refusal::BadInput),
        }
    }

    fn server(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind: "server_error",
            code: None,
            message: message.into(),
            refusal: None,
        }
    }

    fn shutting_down() -> Self {
        ApiError {
            refusal: Some(Refusal::ShuttingDown),
            ..ApiError::server(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is shutting down",
            )
        }
    }

    /// 504: the request passed its deadline and was cancelled (its sequence freed).
    fn expired(timeout: Duration) -> Self {
        ApiError {
            status: StatusCode::GATEWAY_TIMEOUT,
            kind: "timeout_error",
            code: Some("deadline_exceeded"),
            message: expired_message(timeout),
            refusal: None,
        }
    }
}

fn expired_message(timeout: Duration) -> String {
    format!(
        "the request passed its deadline of {} s from arrival and was cancelled \
         (--request-timeout, or the {TIMEOUT_HEADER} header)",
        timeout.as_secs_f64()
    )
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.message, "type": self.kind, "param": null, "code": self.code}});
        let mut r = (self.status, axum::Json(body)).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if let Some(why) = self.refusal {
            r.extensions_mut().insert(why);
        }
        r
    }
}

/// Counts every refusal once, whichever layer refused (the handlers, or authorization).
async fn count_refusals(State(s): State<AppState>, req: HttpRequest, next: Next) -> Response {
    let r = next.run(req).await;
    if let Some(&why) = r.extensions().get::<Refusal>() {
        s.metrics.refused(why);
    }
    r
}

/// Every response names the bundle and the exactness contract it was computed under.
async fn provenance(State(s): State<AppState>, req: HttpRequest, next: Next) -> Response {
    let mut r = next.run(req).await;
    let h = r.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&s.cfg.root_digest) {
        h.insert("x-tarfa-root-digest", v);
    }
    h.insert(
        "x-tarfa-contract-version",
        HeaderValue::from(tarfa_core::numerics::CONTRACT_VERSION),
    );
    r
}

async fn authorize(State(s): State<AppState>, req: HttpRequest, next: Next) -> Response {
    if let Some(key) = &s.cfg.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(key.as_str()) {
            return ApiError {
                status: StatusCode::UNAUTHORIZED,
                kind: "authentication_error",
                code: None,
                message: "a valid API key is required: Authorization: Bearer KEY".into(),
                refusal: Some(Refusal::Unauthorized),
            }
            .into_response();
        }
    }
    next.run(req).await
}

fn tarfa_field(s: &Shared) -> Value {
    json!({"root_digest": s.cfg.root_digest, "contract_version": tarfa_core::numerics::CONTRACT_VERSION})
}

fn model_id(s: &Shared) -> String {
    format!("{}@{}", s.cfg.name, s.cfg.root_digest)
}

async fn health(State(s): State<AppState>) -> Response {
    axum::Json(json!({"status": "ok", "tarfa": tarfa_field(&s)})).into_response()
}

async fn metrics(State(s): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(&Identity {
            name: &s.cfg.name,
            root_digest: &s.cfg.root_digest,
            verification: s.cfg.verification.as_ref(),
        }),
    )
        .into_response()
}

async fn models(State(s): State<AppState>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{"id": model_id(&s), "object": "model", "created": 0, "owned_by": "tarfa",
                  "max_model_len": s.cfg.max_positions}],
        "tarfa": tarfa_field(&s),
    }))
    .into_response()
}

/// The bundle's tokenizer, or a 400 saying there is none.
fn tokenizer(s: &Shared) -> Result<&tokenizers::Tokenizer, ApiError> {
    s.cfg
        .tokenizer
        .as_ref()
        .ok_or_else(|| ApiError::bad("the bundle has no tokenizer"))
}

/// vLLM's `GET /tokenizer_info`, which lm-eval's `tokenizer_backend=remote` reads: with
/// `/tokenize` and `/detokenize` it lets a client count and split tokens with the bundle's own
/// tokenizer (the one every text prompt here is encoded with), not a re-creation of it.
async fn tokenizer_info(State(s): State<AppState>) -> Result<Response, ApiError> {
    let tok = tokenizer(&s)?;
    let eos = s.cfg.eos.first().and_then(|&id| tok.id_to_token(id));
    Ok(axum::Json(json!({
        "eos_token": eos,
        "bos_token": null,
        "pad_token": null,
        "model_max_length": s.cfg.max_positions,
        "tarfa": tarfa_field(&s),
    }))
    .into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizeBody {
    #[serde(default)]
    model: Option<String>,
    prompt: String,
    /// The tokenizer's post-processor (BOS and the like); completions encode without.
    #[serde(default)]
    add_special_tokens: bool,
}

/// vLLM's `POST /tokenize`: the ids of `prompt` (without special tokens unless asked, as a
/// completion's text prompt is encoded).
async fn tokenize(State(s): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let b: TokenizeBody = parse_body(&body)?;
    check_model(&s, &b.model)?;
    let ids = tokenizer(&s)?
        .encode(b.prompt.as_str(), b.add_special_tokens)
        .map_err(|e| ApiError::bad(format!("prompt: cannot encode: {e}")))?
        .get_ids()
        .to_vec();
    Ok(axum::Json(json!({
        "count": ids.len(),
        "max_model_len": s.cfg.max_positions,
        "tokens": ids,
        "tarfa": tarfa_field(&s),
    }))
    .into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DetokenizeBody {
    #[serde(default)]
    model: Option<String>,
    tokens: Vec<u32>,
}

/// vLLM's `POST /detokenize`: the text of `tokens`, special tokens kept.
async fn detokenize(State(s): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let b: DetokenizeBody = parse_body(&body)?;
    check_model(&s, &b.model)?;
    if let Some(&id) = b.tokens.iter().find(|&&t| t as usize >= s.cfg.vocab_size) {
        return Err(ApiError::bad(format!(
            "token id {id} is outside the vocabulary of {}",
            s.cfg.vocab_size
        )));
    }
    let text = tokenizer(&s)?
        .decode(&b.tokens, false)
        .map_err(|e| ApiError::bad(format!("tokens: cannot decode: {e}")))?;
    Ok(axum::Json(json!({"prompt": text, "tarfa": tarfa_field(&s)})).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CompletionBody {
    #[serde(default)]
    model: Option<String>,
    prompt: Value,
    max_tokens: Option<u64>,
    #[serde(default)]
    echo: bool,
    logprobs: Option<u64>,
    temperature: Option<f32>,
    top_p: Option<f64>,
    seed: Option<u64>,
    stop: Option<Value>,
    n: Option<u64>,
    #[serde(default)]
    stream: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatMessageBody {
    role: String,
    content: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatBody {
    #[serde(default)]
    model: Option<String>,
    messages: Vec<ChatMessageBody>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    logprobs: bool,
    top_logprobs: Option<u64>,
    temperature: Option<f32>,
    top_p: Option<f64>,
    seed: Option<u64>,
    stop: Option<Value>,
    n: Option<u64>,
    #[serde(default)]
    stream: bool,
}

/// The most choices one request asks for.
const MAX_N: u64 = 16;
/// OpenAI's default `max_tokens` for completions.
const DEFAULT_MAX_TOKENS: u64 = 16;

fn parse_body<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad(format!("request body: {e}")))
}

fn check_model(s: &Shared, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != &model_id(s) && m != &s.cfg.name => Err(ApiError {
            status: StatusCode::NOT_FOUND,
            ..ApiError::bad(format!(
                "model {m:?} is not served here; this server serves {:?}",
                model_id(s)
            ))
        }),
        _ => Ok(()),
    }
}

fn stops(v: &Option<Value>) -> Result<Vec<String>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| ApiError::bad("stop must be a string or a list of strings"))
            })
            .collect(),
        Some(_) => Err(ApiError::bad("stop must be a string or a list of strings")),
    }
}

/// The prompts, each as token ids (text encoded without special tokens, as `tarfa-run score`
/// encodes a context).
fn prompts(s: &Shared, v: &Value) -> Result<Vec<Vec<u32>>, ApiError> {
    let ids = |a: &[Value], which: String| -> Result<Vec<u32>, ApiError> {
        a.iter()
            .enumerate()
            .map(|(i, x)| {
                let id = x
                    .as_u64()
                    .ok_or_else(|| ApiError::bad(format!("{which}[{i}] is not a token id: {x}")))?;
                if id >= s.cfg.vocab_size as u64 {
                    return Err(ApiError::bad(format!(
                        "{which}[{i}]: token id {id} is outside the vocabulary of {}",
                        s.cfg.vocab_size
                    )));
                }
                Ok(id as u32)
            })
            .collect()
    };
    let text = |t: &str| -> Result<Vec<u32>, ApiError> {
        let tok = s.cfg.tokenizer.as_ref().ok_or_else(|| {
            ApiError::bad("the prompt is text and the bundle has no tokenizer: give token ids")
        })?;
        tok.encode(t, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| ApiError::bad(format!("prompt: cannot encode: {e}")))
    };
    let out = match v {
        Value::String(t) => vec![text(t)?],
        Value::Array(a) if a.is_empty() => return Err(ApiError::bad("prompt is an empty list")),
        Value::Array(a) if a.iter().all(Value::is_string) => a
            .iter()
            .map(|x| text(x.as_str().expect("a string")))
            .collect::<Result<_, _>>()?,
        Value::Array(a) if a.iter().all(Value::is_array) => a
            .iter()
            .enumerate()
            .map(|(i, x)| ids(x.as_array().expect("an array"), format!("prompt[{i}]")))
            .collect::<Result<_, _>>()?,
        Value::Array(a) => vec![ids(a, "prompt".into())?],
        _ => return Err(ApiError::bad(
            "prompt must be a string, a list of strings, a list of token ids or a list of lists",
        )),
    };
    if out.iter().any(Vec::is_empty) {
        return Err(ApiError::bad("a prompt has no tokens"));
    }
    Ok(out)
}

/// How one choice is computed.
enum Plan {
    /// A tarfa-score request (the JSON line `tarfa-run score` would read).
    Run(tarfa_score::Request),
    /// `max_tokens: 0` on a one-token prompt with echo, or without echo: nothing to compute.
    Nothing,
}

struct Settings {
    max_tokens: u64,
    echo: bool,
    top: u64,
    temperature: Option<f32>,
    top_p: Option<f64>,
    seed: Option<u64>,
    stop: Vec<String>,
}

/// The request for prompt `ids`, choice `i`: built as a `tarfa-run score` line and parsed by the
/// same parser, so that every check and every number is score's.
fn plan(s: &Shared, ids: &[u32], i: u64, st: &Settings) -> Result<Plan, ApiError> {
    let mut line = serde_json::Map::new();
    if st.max_tokens == 0 {
        // lm-eval's loglikelihood: the prompt's tokens scored given the ones before them
        if !st.echo || ids.len() < 2 {
            return Ok(Plan::Nothing);
        }
        line.insert("context".into(), json!(ids[..1]));
        line.insert("continuation".into(), json!(ids[1..]));
    } else {
        line.insert("context".into(), json!(ids));
        line.insert("max_tokens".into(), json!(st.max_tokens));
        line.insert("echo".into(), json!(st.echo));
        if !st.stop.is_empty() {
            line.insert("until".into(), json!(st.stop));
        }
        if let Some(t) = st.temperature {
            line.insert("temperature".into(), json!(t));
        }
        if let Some(p) = st.top_p {
            line.insert("top_p".into(), json!(p));
        }
        // choice i of n draws with seed + i: n different samples, each reproducible alone
        if st.seed.is_some() || i > 0 {
            line.insert("seed".into(), json!(st.seed.unwrap_or(0).wrapping_add(i)));
        }
    }
    line.insert("top_logprobs".into(), json!(st.top));
    let limits = Limits {
        vocab_size: s.cfg.vocab_size,
        max_positions: s.cfg.max_positions,
        eos: &s.cfg.eos,
        tokenizer: s.cfg.tokenizer.as_ref(),
        // chat completions render their messages here, before the request is built
        chat: Ok(None),
    };
    let text = Value::Object(line).to_string();
    let r = tarfa_score::parse_line(1, &text, Options::default(), &limits).map_err(|e| match e
        .problem
    {
        tarfa_score::Problem::TooLong { needed, max } => ApiError {
            refusal: Some(Refusal::TooLong),
            ..ApiError::bad(format!(
                "the request needs {needed} positions (prompt + max_tokens - 1); the \
                     model's context is {max}"
            ))
        },
        p => ApiError::bad(p.to_string()),
    })?;
    Ok(Plan::Run(r))
}

/// When a request that arrived at `t0` is cancelled: the server's `--request-timeout`, or the
/// client's shorter `x-tarfa-timeout` (seconds, a non-negative decimal). Returns the timeout
/// too, for the message.
fn deadline(
    s: &Shared,
    headers: &HeaderMap,
    t0: Instant,
) -> Result<Option<(Instant, Duration)>, ApiError> {
    let asked = match headers.get(TIMEOUT_HEADER) {
        None => None,
        Some(v) => {
            let secs = v
                .to_str()
                .ok()
                .and_then(|t| t.trim().parse::<f64>().ok())
                .filter(|x| x.is_finite() && *x >= 0.0 && *x <= 1e9)
                .ok_or_else(|| {
                    ApiError::bad(format!(
                        "{TIMEOUT_HEADER} must be a number of seconds, 0 to 1e9"
                    ))
                })?;
            Some(Duration::from_secs_f64(secs))
        }
    };
    let timeout = match (s.cfg.request_timeout, asked) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    Ok(timeout.map(|t| (t0 + t, t)))
}

/// Submits `plans`, failing with 429 when the queue is full. Returns each plan's receiver.
fn enqueue(
    s: &Shared,
    plans: Vec<Plan>,
    deadline: Option<(Instant, Duration)>,
) -> Result<Vec<Option<UnboundedReceiver<Reply>>>, ApiError> {
    let runs = plans.iter().filter(|p| matches!(p, Plan::Run(_))).count();
    let limit = s.cfg.max_batch + s.cfg.max_queue;
    let prev = s.pending.fetch_add(runs, Ordering::SeqCst);
    if runs > 0 && prev + runs > limit {
        s.pending.fetch_sub(runs, Ordering::SeqCst);
        return Err(ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            kind: "rate_limit_error",
            code: None,
            message: format!(
                "the server is at its limit of {limit} requests ({} in flight, {} queued): retry later",
                s.cfg.max_batch, s.cfg.max_queue
            ),
            refusal: Some(Refusal::QueueFull),
        });
    }
    let Some(tx) = s.submit.lock().expect("submit channel").clone() else {
        s.pending.fetch_sub(runs, Ordering::SeqCst);
        return Err(ApiError::shutting_down());
    };
    let origin = Arc::new(Origin::default());
    let mut out = Vec::new();
    let mut sent = 0;
    for p in plans {
        match p {
            Plan::Run(request) => {
                let (rtx, rrx) = unbounded_channel();
                let submission = Submission {
                    request,
                    replies: rtx,
                    deadline: deadline.map(|d| d.0),
                    origin: origin.clone(),
                };
                if tx.send(submission).is_err() {
                    // those sent are the scheduler's to count down; the rest are not coming
                    s.pending.fetch_sub(runs - sent, Ordering::SeqCst);
                    return Err(ApiError::shutting_down());
                }
                sent += 1;
                out.push(Some(rrx));
            }
            Plan::Nothing => out.push(None),
        }
    }
    Ok(out)
}

fn token_text(s: &Shared, id: u32) -> String {
    match &s.cfg.tokenizer {
        Some(t) => t.decode(&[id], false).unwrap_or_default(),
        None => String::new(),
    }
}

fn top_map(s: &Shared, top: &[(u32, f64)]) -> Value {
    let mut m = serde_json::Map::new();
    for (id, lp) in top {
        m.entry(token_text(s, *id)).or_insert(json!(lp));
    }
    Value::Object(m)
}

/// A completion choice from a result: OpenAI's legacy `logprobs` object, plus `token_ids` and
/// `top_token_ids` (token strings can collide; ids cannot).
fn choice(
    s: &Shared,
    index: usize,
    prompt: &[u32],
    st: &Settings,
    r: Option<ScoreResult>,
) -> Value {
    let mut ids: Vec<u32> = Vec::new();
    let mut lps: Vec<Option<f64>> = Vec::new();
    let mut tops: Vec<Option<Vec<(u32, f64)>>> = Vec::new();
    let mut text = String::new();
    let mut finish = "length";
    let decode = |t: &[u32]| {
        s.cfg
            .tokenizer
            .as_ref()
            .map(|tk| tk.decode(t, false).unwrap_or_default())
            .unwrap_or_default()
    };
    match r {
        None => {
            if st.echo {
                ids.extend_from_slice(prompt);
                lps.push(None);
                tops.push(None);
                text = decode(prompt);
            }
        }
        Some(ScoreResult::Loglikelihood(l)) => {
            ids.push(prompt[0]);
            ids.extend(&l.tokens);
            lps.push(None);
            lps.extend(l.token_logprobs.iter().map(|&x| Some(x)));
            tops.push(None);
            match l.top_logprobs {
                Some(t) => tops.extend(t.into_iter().map(Some)),
                None => tops.extend(l.tokens.iter().map(|_| None)),
            }
            text = decode(prompt);
        }
        Some(ScoreResult::Generate(g)) => {
            if let Some(e) = &g.echo {
                ids.extend(&e.context_tokens);
                lps.extend(&e.context_logprobs);
                match &e.context_top_logprobs {
                    Some(t) => tops.extend(t.iter().cloned()),
                    None => tops.extend(e.context_tokens.iter().map(|_| None)),
                }
                text = decode(prompt);
            }
            ids.extend(&g.tokens);
            lps.extend(g.token_logprobs.iter().map(|&x| Some(x)));
            match g.top_logprobs {
                Some(t) => tops.extend(t.into_iter().map(Some)),
                None => tops.extend(g.tokens.iter().map(|_| None)),
            }
            text.push_str(g.text.as_deref().unwrap_or(""));
            finish = match g.finish_reason {
                tarfa_score::FinishReason::Length => "length",
                tarfa_score::FinishReason::Stop | tarfa_score::FinishReason::Eos => "stop",
            };
        }
        Some(ScoreResult::Rolling(_)) => unreachable!("the server sends no rolling requests"),
    }
    let logprobs = st.top_or_echo().then(|| {
        json!({
            "tokens": ids.iter().map(|&t| token_text(s, t)).collect::<Vec<_>>(),
            "token_ids": ids,
            "token_logprobs": lps,
            "top_logprobs": tops.iter().map(|t| t.as_ref().map(|t| top_map(s, t))).collect::<Vec<_>>(),
            "top_token_ids": tops.iter().map(|t| t.as_ref().map(|t| t.iter().map(|x| x.0).collect::<Vec<_>>())).collect::<Vec<_>>(),
        })
    });
    json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})
}

impl Settings {
    /// OpenAI gives a `logprobs` object when `logprobs` is set; with echo and max_tokens 0 it
    /// is the point of the request.
    fn top_or_echo(&self) -> bool {
        self.top > 0 || (self.echo && self.max_tokens == 0)
    }
}

async fn wait(
    s: &Shared,
    rx: Option<UnboundedReceiver<Reply>>,
    deadline: Option<(Instant, Duration)>,
) -> Result<(Option<ScoreResult>, Option<Instant>), ApiError> {
    let Some(mut rx) = rx else {
        return Ok((None, None));
    };
    let mut first = None;
    while let Some(e) = rx.recv().await {
        match e {
            Reply::Event(Event::Token(_)) => {
                first.get_or_insert_with(Instant::now);
            }
            Reply::Event(Event::Done(r)) => return Ok((Some(r), first)),
            Reply::Event(Event::Failed(m)) => {
                s.metrics.failed();
                return Err(ApiError::server(StatusCode::INTERNAL_SERVER_ERROR, m));
            }
            Reply::Expired => {
                let timeout = deadline.map(|d| d.1).unwrap_or_default();
                return Err(ApiError::expired(timeout));
            }
        }
    }
    Err(ApiError::server(
        StatusCode::SERVICE_UNAVAILABLE,
        "the scheduler stopped before the request finished",
    ))
}

async fn completions(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let t0 = Instant::now();
    let due = deadline(&s, &headers, t0)?;
    let b: CompletionBody = parse_body(&body)?;
    check_model(&s, &b.model)?;
    let st = Settings {
        max_tokens: b.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS),
        echo: b.echo,
        top: b.logprobs.unwrap_or(0),
        temperature: b.temperature,
        top_p: b.top_p,
        seed: b.seed,
        stop: stops(&b.stop)?,
    };
    let n = b.n.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(ApiError::bad(format!("n must be 1 to {MAX_N}")));
    }
    let prompts = prompts(&s, &b.prompt)?;
    let mut plans = Vec::new();
    let mut which = Vec::new();
    for p in &prompts {
        for i in 0..n {
            plans.push(plan(&s, p, i, &st)?);
            which.push(p.clone());
        }
    }
    if b.stream {
        if plans.len() != 1 || st.max_tokens == 0 || st.echo {
            return Err(ApiError::bad(
                "stream takes one prompt, n = 1, max_tokens >= 1 and no echo",
            ));
        }
        let rx = enqueue(&s, plans, due)?
            .pop()
            .flatten()
            .expect("a generation");
        return Ok(stream_response(s, rx, t0, false, st.stop, due));
    }
    let rxs = enqueue(&s, plans, due)?;
    let mut choices = Vec::new();
    let mut ttft = None;
    for (i, (rx, p)) in rxs.into_iter().zip(&which).enumerate() {
        let (r, first) = wait(&s, rx, due).await?;
        ttft = ttft.or(first);
        choices.push(choice(&s, i, p, &st, r));
    }
    s.metrics.finished(
        t0.elapsed().as_secs_f64(),
        ttft.map(|t| (t - t0).as_secs_f64()),
    );
    Ok(axum::Json(json!({
        "id": format!("cmpl-{}", t0.elapsed().as_nanos()),
        "object": "text_completion",
        "created": 0,
        "model": model_id(&s),
        "choices": choices,
        "tarfa": tarfa_field(&s),
    }))
    .into_response())
}

/// Text that may still change: a stop string's start at its end, or an incomplete UTF-8
/// character (the replacement character), is held back until the next token settles it.
fn settled(text: &str, stops: &[String]) -> usize {
    let mut end = text.len();
    while text[..end].ends_with('\u{FFFD}') {
        end -= '\u{FFFD}'.len_utf8();
    }
    for s in stops {
        for (i, _) in s.char_indices().skip(1) {
            if text[..end].ends_with(&s[..i]) {
                end = end.min(text[..end].len() - i);
            }
        }
    }
    end
}

fn stream_response(
    s: AppState,
    rx: UnboundedReceiver<Reply>,
    t0: Instant,
    chat: bool,
    stops: Vec<String>,
    due: Option<(Instant, Duration)>,
) -> Response {
    let state = (s, rx, 0usize, false, stops, false);
    let events = stream::unfold(state, move |(s, mut rx, sent, first, stops, done)| async move {
        if done {
            return None;
        }
        let object = if chat { "chat.completion.chunk" } else { "text_completion" };
        let frame = |s: &Shared, delta: &str, t: Option<&tarfa_score::GeneratedToken>, finish: Option<&str>| {
            let lp = t.map(|t| json!({"token_ids": [t.token], "token_logprobs": [t.logprob]}));
            let c = if chat {
                json!({"index": 0, "delta": {"content": delta}, "finish_reason": finish, "logprobs": lp})
            } else {
                json!({"index": 0, "text": delta, "finish_reason": finish, "logprobs": lp})
            };
            json!({"object": object, "model": model_id(s), "choices": [c], "tarfa": tarfa_field(s)})
        };
        match rx.recv().await {
            Some(Reply::Event(Event::Token(t))) => {
                if !first {
                    s.metrics.first_token(t0.elapsed().as_secs_f64());
                }
                let text = t.text.clone().unwrap_or_default();
                let end = if t.finish_reason.is_some() { text.len() } else { settled(&text, &stops) };
                let end = end.max(sent);
                let delta = text.get(sent..end).unwrap_or("").to_string();
                let finish = t.finish_reason.map(|f| match f {
                    tarfa_score::FinishReason::Length => "length",
                    _ => "stop",
                });
                let ev = SseEvent::default().data(frame(&s, &delta, Some(&t), finish).to_string());
                Some((vec![ev], (s, rx, end, true, stops, false)))
            }
            Some(Reply::Event(Event::Done(_))) => {
                s.metrics.finished(t0.elapsed().as_secs_f64(), None);
                Some((vec![SseEvent::default().data("[DONE]")], (s, rx, sent, first, stops, true)))
            }
            None => {
                Some((vec![SseEvent::default().data("[DONE]")], (s, rx, sent, first, stops, true)))
            }
            Some(Reply::Event(Event::Failed(m))) => {
                s.metrics.failed();
                let ev = SseEvent::default().data(json!({"error": {"message": m, "type": "server_error", "param": null, "code": null}}).to_string());
                Some((vec![ev, SseEvent::default().data("[DONE]")], (s, rx, sent, first, stops, true)))
            }
            // the stream ends with OpenAI's error object, code deadline_exceeded, then [DONE]
            Some(Reply::Expired) => {
                let m = expired_message(due.map(|d| d.1).unwrap_or_default());
                let ev = SseEvent::default().data(json!({"error": {"message": m, "type": "timeout_error", "param": null, "code": "deadline_exceeded"}}).to_string());
                Some((vec![ev, SseEvent::default().data("[DONE]")], (s, rx, sent, first, stops, true)))
            }
        }
    })
    .flat_map(|v| stream::iter(v.into_iter().map(Ok::<_, Infallible>)));
    sse(events)
}

fn sse<S: Stream<Item = Result<SseEvent, Infallible>> + Send + 'static>(s: S) -> Response {
    Sse::new(s).into_response()
}

async fn chat_completions(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let t0 = Instant::now();
    let due = deadline(&s, &headers, t0)?;
    let b: ChatBody = parse_body(&body)?;
    check_model(&s, &b.model)?;
    let template = s
        .cfg
        .chat_template
        .as_ref()
        .ok_or_else(|| ApiError::bad("the bundle has no chat template"))?;
    let messages: Vec<ChatMessage> = b
        .messages
        .iter()
        .map(|m| ChatMessage::new(&m.role, &m.content))
        .collect();
    let text = template
        .render(&messages, true)
        .map_err(|e| ApiError::bad(format!("messages: {e}")))?;
    let tok = s
        .cfg
        .tokenizer
        .as_ref()
        .ok_or_else(|| ApiError::bad("the bundle has no tokenizer"))?;
    // the template's text carries its special tokens: nothing is added (as generate --chat)
    let ids = tok
        .encode(text.as_str(), false)
        .map_err(|e| ApiError::bad(format!("messages: cannot encode: {e}")))?
        .get_ids()
        .to_vec();
    let top = match (b.logprobs, b.top_logprobs) {
        (_, Some(k)) if k > 20 => return Err(ApiError::bad("top_logprobs must be 0 to 20")),
        (false, Some(_)) => return Err(ApiError::bad("top_logprobs needs logprobs: true")),
        (true, k) => k.unwrap_or(0).max(1),
        (false, None) => 0,
    };
    let st = Settings {
        max_tokens: b
            .max_completion_tokens
            .or(b.max_tokens)
            .unwrap_or(DEFAULT_MAX_TOKENS),
        echo: false,
        top,
        temperature: b.temperature,
        top_p: b.top_p,
        seed: b.seed,
        stop: stops(&b.stop)?,
    };
    if st.max_tokens == 0 {
        return Err(ApiError::bad("max_tokens must be at least 1"));
    }
    let n = b.n.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(ApiError::bad(format!("n must be 1 to {MAX_N}")));
    }
    let plans = (0..n)
        .map(|i| plan(&s, &ids, i, &st))
        .collect::<Result<Vec<_>, _>>()?;
    if b.stream {
        if n != 1 {
            return Err(ApiError::bad("stream takes n = 1"));
        }
        let rx = enqueue(&s, plans, due)?
            .pop()
            .flatten()
            .expect("a generation");
        return Ok(stream_response(s, rx, t0, true, st.stop, due));
    }
    let rxs = enqueue(&s, plans, due)?;
    let mut choices = Vec::new();
    for (i, rx) in rxs.into_iter().enumerate() {
        let (r, _) = wait(&s, rx, due).await?;
        let Some(ScoreResult::Generate(g)) = r else {
            unreachable!("a chat request generates")
        };
        let logprobs = b.logprobs.then(|| {
            let content: Vec<Value> = g
                .tokens
                .iter()
                .zip(&g.token_logprobs)
                .enumerate()
                .map(|(j, (&t, &lp))| {
                    let tops = g.top_logprobs.as_ref().map(|v| &v[j]);
                    json!({"token": token_text(&s, t), "token_id": t, "logprob": lp,
                           "top_logprobs": tops.map(|v| v.iter().map(|&(id, lp)| json!({"token": token_text(&s, id), "token_id": id, "logprob": lp})).collect::<Vec<_>>()).unwrap_or_default()})
                })
                .collect();
            json!({"content": content})
        });
        let finish = match g.finish_reason {
            tarfa_score::FinishReason::Length => "length",
            _ => "stop",
        };
        choices.push(json!({"index": i, "message": {"role": "assistant", "content": g.text.unwrap_or_default()},
                            "logprobs": logprobs, "finish_reason": finish, "token_ids": g.tokens}));
    }
    s.metrics.finished(t0.elapsed().as_secs_f64(), None);
    Ok(axum::Json(json!({
        "id": format!("chatcmpl-{}", t0.elapsed().as_nanos()),
        "object": "chat.completion",
        "created": 0,
        "model": model_id(&s),
        "choices": choices,
        "prompt_token_ids": ids,
        "tarfa": tarfa_field(&s),
    }))
    .into_response())
}
