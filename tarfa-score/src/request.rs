//! The JSON Lines requests: one object per line, exactly one of lm-eval's three kinds, parsed
//! strictly (an unknown key is an error) and checked against the model's vocabulary and context
//! before anything runs, so that a bad line costs nothing.
//!
//! - `{"context": C, "continuation": K}`: loglikelihood.
//! - `{"rolling": D}`: loglikelihood_rolling.
//! - `{"context": C, "max_tokens": n, "until": [..]}`: generate_until (`until` optional).
//! - `{"messages": [{"role": r, "content": c}, ..], ...}` in place of `context` (with
//!   `continuation`, or with `max_tokens`): the conversation rendered with the bundle's chat
//!   template, the assistant's turn opened (`add_generation_prompt`), is the context's text. It
//!   carries its special tokens in that text, so it is encoded, like every text here, without
//!   adding any (as `tarfa-run generate --chat` does).
//!
//! C, K and D are text (encoded with the bundle's tokenizer, without special tokens, as lm-eval
//! encodes for causal models) or lists of token ids. Every kind takes `top_logprobs` (k) and
//! `echo` (bool), which override the command line's defaults; generate_until takes the exact
//! sampler's settings (`temperature`, `top_k`, `top_p`, `min_p`, the three penalties, `seed`;
//! greedy by default).

use serde::Deserialize;
use serde_json::Value;
use tarfa_core::chat::{ChatMessage, ChatTemplate};
use tarfa_core::sampling::{SamplingError, SamplingParams};

/// The most alternatives `top_logprobs` asks for per position.
pub const MAX_TOP_LOGPROBS: usize = 100;

/// What a request is checked against: the model's facts and the bundle's tokenizer.
pub struct Limits<'a> {
    pub vocab_size: usize,
    /// Positions a sequence may reach (`max_position_embeddings`).
    pub max_positions: usize,
    /// The EOS ids generation stops at; the first stands before an empty context (lm-eval's
    /// `prefix_token_id`, the end-of-text token).
    pub eos: &'a [u32],
    pub tokenizer: Option<&'a tokenizers::Tokenizer>,
    /// The bundle's chat template for `messages` requests: `Ok(None)` when it has none, `Err`
    /// with the reason when its template cannot be used (so that only a request needing it
    /// fails).
    pub chat: Result<Option<&'a ChatTemplate>, &'a str>,
}

/// Per-request options; the command line's values are the defaults.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// The k best alternatives at each scored or generated position (0: none).
    pub top_logprobs: usize,
    /// Also score the prompt's tokens (the context's; every token after the first).
    pub echo: bool,
}

/// One request, checked and encoded.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// 1-based line of the requests file.
    pub line: usize,
    pub task: Task,
    pub options: Options,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Task {
    /// The log-probs of `continuation` after `context` (never empty: an empty context is the
    /// first EOS id).
    Loglikelihood {
        context: Vec<u32>,
        continuation: Vec<u32>,
    },
    /// The log-probs of `tokens[1..]`, in windows of at most `window` positions (see
    /// [`crate::score`]).
    Rolling { tokens: Vec<u32>, window: usize },
    /// Generation after `context` (greedy unless `sampling` says otherwise), up to `max_tokens`
    /// tokens, stopping at an EOS id or when the text contains one of `until`.
    GenerateUntil {
        context: Vec<u32>,
        until: Vec<String>,
        max_tokens: usize,
        sampling: SamplingParams,
    },
}

/// The request keys, exactly. Text-or-ids fields are taken as JSON values and converted here, so
/// that a wrong element gets a message naming it rather than serde's "did not match any variant".
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    context: Option<Value>,
    messages: Option<Vec<RawMessage>>,
    continuation: Option<Value>,
    rolling: Option<Value>,
    until: Option<Vec<String>>,
    max_tokens: Option<u64>,
    top_logprobs: Option<u64>,
    echo: Option<bool>,
    // generate_until's sampler (tarfa_core::sampling)
    temperature: Option<f32>,
    top_k: Option<usize>,
    top_p: Option<f64>,
    min_p: Option<f64>,
    repetition_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    seed: Option<u64>,
}

/// One message of a `messages` request: a role and a content, nothing else.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMessage {
    role: String,
    content: String,
}

/// Why a line is not a request. One variant per check.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum Problem {
    /// Not a JSON object of the known keys (the message is serde_json's, which names an unknown
    /// key and the column).
    #[error("{0}")]
    Json(String),
    /// A blank line: every line must be a request, so that results match lines one to one.
    #[error("an empty line (one JSON object per line)")]
    EmptyLine,
    /// The keys fit none of the three kinds.
    #[error(
        "not a request: give context (or messages) + continuation (loglikelihood), rolling, or \
         context (or messages) + max_tokens (generate_until)"
    )]
    NoKind,
    /// Keys of two kinds at once.
    #[error("{0} cannot be combined with {1}")]
    Conflict(&'static str, &'static str),
    /// A text-or-ids field is neither.
    #[error("{0} must be a string or a list of token ids")]
    NotTextOrIds(&'static str),
    /// An element of a token list is not a non-negative integer.
    #[error("{field}[{index}] is not a token id (a non-negative integer): {value}")]
    NotATokenId {
        field: &'static str,
        index: usize,
        value: String,
    },
    /// A token id at or past the vocabulary size.
    #[error("{field}[{index}]: token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfVocabulary {
        field: &'static str,
        index: usize,
        id: u64,
        vocab: usize,
    },
    /// Text, and the bundle has no tokenizer.
    #[error("{0} is text, and the bundle has no tokenizer.json: give token ids")]
    NoTokenizer(&'static str),
    /// The tokenizer failed on the text.
    #[error("{field}: cannot encode: {message}")]
    Encode {
        field: &'static str,
        message: String,
    },
    /// A context and continuation of different types.
    #[error("context and continuation must both be text or both token lists")]
    MixedInputs,
    /// The continuation has no tokens (after lm-eval's split of the encoded pair).
    #[error("the continuation is empty (it must have at least one token)")]
    EmptyContinuation,
    /// An empty context and no EOS id to stand before the continuation.
    #[error("the context is empty and the model has no EOS id to stand before the continuation")]
    NoPrefixToken,
    /// A generation prompt without tokens.
    #[error("the context is empty (generate_until needs at least one token)")]
    EmptyContext,
    /// A rolling text of fewer than two tokens has nothing to score.
    #[error("rolling has {0} token(s); it needs at least 2 (token 0 is never scored)")]
    RollingTooShort(usize),
    /// `max_tokens: 0`.
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    /// An empty stop string would stop before the first token.
    #[error("until[{0}] is an empty string")]
    EmptyStop(usize),
    /// Stop strings need text, which needs the tokenizer.
    #[error("until needs the bundle's tokenizer.json to decode the generated text")]
    UntilWithoutTokenizer,
    /// More alternatives than [`MAX_TOP_LOGPROBS`].
    #[error("top_logprobs {0} is more than the {MAX_TOP_LOGPROBS} allowed")]
    TooManyTopLogprobs(u64),
    /// The request needs more positions than the model has.
    #[error("the request needs {needed} positions; the model allows {max}")]
    TooLong { needed: usize, max: usize },
    /// A sampling setting out of its range.
    #[error("{0}")]
    Sampling(SamplingError),
    /// `messages` is an empty list.
    #[error("messages is empty (a conversation needs at least one message)")]
    EmptyMessages,
    /// `messages`, and the bundle has no chat template.
    #[error(
        "messages needs the bundle's chat template (chat_template.jinja or tokenizer_config.json's \
         chat_template), and the bundle has none"
    )]
    NoChatTemplate,
    /// The template refused the conversation (its own message).
    #[error("messages: {0}")]
    Chat(String),
    /// A sampling key on a request that does not generate.
    #[error("{0} applies to generate_until (context + max_tokens) only")]
    SamplingWithoutGeneration(&'static str),
}

/// A line that is not a valid request.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("line {line}: {problem}")]
pub struct BadRequest {
    pub line: usize,
    pub problem: Problem,
}

/// Text or token ids, as given.
enum Input {
    Text(String),
    Ids(Vec<u32>),
}

fn input(field: &'static str, v: Value, limits: &Limits) -> Result<Input, Problem> {
    match v {
        Value::String(s) => Ok(Input::Text(s)),
        Value::Array(items) => {
            let mut ids = Vec::with_capacity(items.len());
            for (index, item) in items.iter().enumerate() {
                let id = item.as_u64().ok_or_else(|| Problem::NotATokenId {
                    field,
                    index,
                    value: item.to_string(),
                })?;
                if id >= limits.vocab_size as u64 {
                    return Err(Problem::TokenOutOfVocabulary {
                        field,
                        index,
                        id,
                        vocab: limits.vocab_size,
                    });
                }
                ids.push(id as u32);
            }
            Ok(Input::Ids(ids))
        }
        _ => Err(Problem::NotTextOrIds(field)),
    }
}

/// `text` encoded without special tokens (lm-eval's `tok_encode` for causal models).
fn encode(field: &'static str, text: &str, limits: &Limits) -> Result<Vec<u32>, Problem> {
    let tok = limits.tokenizer.ok_or(Problem::NoTokenizer(field))?;
    let enc = tok.encode(text, false).map_err(|e| Problem::Encode {
        field,
        message: e.to_string(),
    })?;
    let ids = enc.get_ids().to_vec();
    // the tokenizer was checked to fit the vocabulary at conversion; an added token past it is
    // still refused here rather than by the backend
    if let Some((index, &id)) = ids
        .iter()
        .enumerate()
        .find(|(_, &id)| id as usize >= limits.vocab_size)
    {
        return Err(Problem::TokenOutOfVocabulary {
            field,
            index,
            id: id.into(),
            vocab: limits.vocab_size,
        });
    }
    Ok(ids)
}

fn ids(field: &'static str, i: Input, limits: &Limits) -> Result<Vec<u32>, Problem> {
    match i {
        Input::Text(t) => encode(field, &t, limits),
        Input::Ids(v) => Ok(v),
    }
}

/// lm-eval's `_encode_pair`: trailing whitespace of the context moves to the front of the
/// continuation; the pair is encoded whole, the context alone, and the continuation's tokens are
/// the whole's after the context's count. (Encoding them apart would split a word at the seam
/// differently from how the model saw it in training.)
fn encode_pair(
    context: &str,
    continuation: &str,
    limits: &Limits,
) -> Result<(Vec<u32>, Vec<u32>), Problem> {
    let trimmed = context.trim_end();
    let (context, continuation) = (
        trimmed,
        format!("{}{continuation}", &context[trimmed.len()..]),
    );
    let whole = encode("continuation", &format!("{context}{continuation}"), limits)?;
    let ctx = encode("context", context, limits)?;
    let cont = whole.get(ctx.len()..).unwrap_or_default().to_vec();
    Ok((ctx, cont))
}

/// A `messages` conversation as the context's text (the assistant's turn opened).
fn render(messages: &[RawMessage], limits: &Limits) -> Result<String, Problem> {
    if messages.is_empty() {
        return Err(Problem::EmptyMessages);
    }
    let template = limits
        .chat
        .map_err(|why| Problem::Chat(why.to_string()))?
        .ok_or(Problem::NoChatTemplate)?;
    let messages: Vec<ChatMessage> = messages
        .iter()
        .map(|m| ChatMessage::new(&m.role, &m.content))
        .collect();
    template
        .render(&messages, true)
        .map_err(|e| Problem::Chat(e.to_string()))
}

/// Parses and checks line `line` (1-based) of a requests file.
pub fn parse_line(
    line: usize,
    text: &str,
    defaults: Options,
    limits: &Limits,
) -> Result<Request, BadRequest> {
    parse(text, defaults, limits)
        .map_err(|problem| BadRequest { line, problem })
        .map(|(task, options)| Request {
            line,
            task,
            options,
        })
}

fn parse(text: &str, defaults: Options, limits: &Limits) -> Result<(Task, Options), Problem> {
    if text.trim().is_empty() {
        return Err(Problem::EmptyLine);
    }
    let raw: Raw = serde_json::from_str(text).map_err(|e| Problem::Json(e.to_string()))?;
    let d = SamplingParams::default();
    let sampling = SamplingParams {
        temperature: raw.temperature.unwrap_or(d.temperature),
        top_k: raw.top_k.unwrap_or(d.top_k),
        top_p: raw.top_p.unwrap_or(d.top_p),
        min_p: raw.min_p.unwrap_or(d.min_p),
        repetition_penalty: raw.repetition_penalty.unwrap_or(d.repetition_penalty),
        frequency_penalty: raw.frequency_penalty.unwrap_or(d.frequency_penalty),
        presence_penalty: raw.presence_penalty.unwrap_or(d.presence_penalty),
        seed: raw.seed.unwrap_or(d.seed),
    };
    sampling.validate().map_err(Problem::Sampling)?;
    let sampling_key = [
        ("temperature", raw.temperature.is_some()),
        ("top_k", raw.top_k.is_some()),
        ("top_p", raw.top_p.is_some()),
        ("min_p", raw.min_p.is_some()),
        ("repetition_penalty", raw.repetition_penalty.is_some()),
        ("frequency_penalty", raw.frequency_penalty.is_some()),
        ("presence_penalty", raw.presence_penalty.is_some()),
        ("seed", raw.seed.is_some()),
    ]
    .into_iter()
    .find_map(|(k, set)| set.then_some(k));
    if let Some(key) = sampling_key {
        if raw.max_tokens.is_none() {
            return Err(Problem::SamplingWithoutGeneration(key));
        }
    }
    let top = raw.top_logprobs.unwrap_or(defaults.top_logprobs as u64);
    if top > MAX_TOP_LOGPROBS as u64 {
        return Err(Problem::TooManyTopLogprobs(top));
    }
    let options = Options {
        top_logprobs: top as usize,
        echo: raw.echo.unwrap_or(defaults.echo),
    };
    let max = limits.max_positions;
    let context = match (raw.messages, raw.context) {
        (Some(_), Some(_)) => return Err(Problem::Conflict("messages", "context")),
        (Some(_), None) if raw.rolling.is_some() => {
            return Err(Problem::Conflict("messages", "rolling"))
        }
        (Some(m), None) => Some(Value::String(render(&m, limits)?)),
        (None, c) => c,
    };
    let task = match (context, raw.continuation, raw.rolling) {
        (_, _, Some(_)) if raw.until.is_some() || raw.max_tokens.is_some() => {
            return Err(Problem::Conflict("rolling", "until/max_tokens"))
        }
        (Some(_), _, Some(_)) => return Err(Problem::Conflict("rolling", "context")),
        (_, Some(_), Some(_)) => return Err(Problem::Conflict("rolling", "continuation")),
        (_, Some(_), None) if raw.until.is_some() || raw.max_tokens.is_some() => {
            return Err(Problem::Conflict("continuation", "until/max_tokens"))
        }
        (None, None, Some(d)) => {
            let tokens = ids("rolling", input("rolling", d, limits)?, limits)?;
            if tokens.len() < 2 {
                return Err(Problem::RollingTooShort(tokens.len()));
            }
            Task::Rolling {
                tokens,
                window: max,
            }
        }
        (Some(c), Some(k), None) => {
            let (mut context, continuation) = match (
                input("context", c, limits)?,
                input("continuation", k, limits)?,
            ) {
                (Input::Text(c), Input::Text(k)) => encode_pair(&c, &k, limits)?,
                (Input::Ids(c), Input::Ids(k)) => (c, k),
                _ => return Err(Problem::MixedInputs),
            };
            if continuation.is_empty() {
                return Err(Problem::EmptyContinuation);
            }
            if context.is_empty() {
                context.push(*limits.eos.first().ok_or(Problem::NoPrefixToken)?);
            }
            // the last continuation token is only a target, never an input
            let needed = context.len() + continuation.len() - 1;
            if needed > max {
                return Err(Problem::TooLong { needed, max });
            }
            Task::Loglikelihood {
                context,
                continuation,
            }
        }
        (Some(c), None, None) => {
            let Some(max_tokens) = raw.max_tokens else {
                return Err(Problem::NoKind);
            };
            let context = ids("context", input("context", c, limits)?, limits)?;
            if context.is_empty() {
                return Err(Problem::EmptyContext);
            }
            if max_tokens == 0 {
                return Err(Problem::ZeroMaxTokens);
            }
            let until = raw.until.unwrap_or_default();
            if let Some(i) = until.iter().position(|s| s.is_empty()) {
                return Err(Problem::EmptyStop(i));
            }
            if !until.is_empty() && limits.tokenizer.is_none() {
                return Err(Problem::UntilWithoutTokenizer);
            }
            // the last generated token is never fed back
            let needed = (context.len() as u64).saturating_add(max_tokens - 1);
            if needed > max as u64 {
                return Err(Problem::TooLong {
                    needed: needed.min(usize::MAX as u64) as usize,
                    max,
                });
            }
            Task::GenerateUntil {
                context,
                until,
                max_tokens: max_tokens as usize,
                sampling,
            }
        }
        (None, Some(_), None) | (None, None, None) => return Err(Problem::NoKind),
    };
    Ok((task, options))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits<'static> {
        Limits {
            vocab_size: 100,
            max_positions: 10,
            eos: &[7],
            tokenizer: None,
            chat: Ok(None),
        }
    }

    fn p(s: &str) -> Result<Request, BadRequest> {
        parse_line(3, s, Options::default(), &limits())
    }

    fn problem(s: &str) -> Problem {
        let e = p(s).unwrap_err();
        assert_eq!(e.line, 3);
        assert!(e.to_string().starts_with("line 3: "), "{e}");
        e.problem
    }

    #[test]
    fn the_three_kinds_from_token_ids() {
        let r = p(r#"{"context": [1, 2], "continuation": [3]}"#).unwrap();
        assert_eq!(
            r.task,
            Task::Loglikelihood {
                context: vec![1, 2],
                continuation: vec![3]
            }
        );
        let r = p(r#"{"rolling": [1, 2, 3], "top_logprobs": 2}"#).unwrap();
        assert_eq!(
            r.task,
            Task::Rolling {
                tokens: vec![1, 2, 3],
                window: 10
            }
        );
        assert_eq!(r.options.top_logprobs, 2);
        let r = p(r#"{"context": [1], "max_tokens": 4, "echo": true}"#).unwrap();
        assert_eq!(
            r.task,
            Task::GenerateUntil {
                context: vec![1],
                until: vec![],
                max_tokens: 4,
                sampling: SamplingParams::default(),
            }
        );
        assert!(r.options.echo);
        // an empty context is lm-eval's prefix token, the first EOS id
        let r = p(r#"{"context": [], "continuation": [3, 4]}"#).unwrap();
        assert_eq!(
            r.task,
            Task::Loglikelihood {
                context: vec![7],
                continuation: vec![3, 4]
            }
        );
    }

    #[test]
    fn messages_are_rendered_with_the_template_or_refused_by_name() {
        let template = ChatTemplate::from_files(
            None,
            Some(
                "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}\
                 {% endif %}<{{ m.role }}>{{ m.content }}{% endfor %}\
                 {% if add_generation_prompt %}<assistant>{% endif %}",
            ),
        )
        .unwrap()
        .unwrap();
        let with = |chat| Limits { chat, ..limits() };
        let pr = |s: &str, l: &Limits| parse_line(2, s, Options::default(), l).unwrap_err().problem;
        let msgs = r#""messages": [{"role": "user", "content": "hi"}]"#;
        let ok = with(Ok(Some(&template)));
        // rendered into the context's text, which then needs the tokenizer like any text
        assert_eq!(
            pr(&format!(r#"{{{msgs}, "max_tokens": 2}}"#), &ok),
            Problem::NoTokenizer("context")
        );
        assert_eq!(
            pr(&format!(r#"{{{msgs}, "continuation": "x"}}"#), &ok),
            Problem::NoTokenizer("continuation")
        );
        // an id continuation after a rendered (text) context
        assert_eq!(
            pr(&format!(r#"{{{msgs}, "continuation": [1]}}"#), &ok),
            Problem::MixedInputs
        );
        assert_eq!(
            pr(&format!(r#"{{{msgs}, "max_tokens": 2}}"#), &limits()),
            Problem::NoChatTemplate
        );
        assert_eq!(
            pr(
                &format!(r#"{{{msgs}, "max_tokens": 2}}"#),
                &with(Err("broken"))
            ),
            Problem::Chat("broken".into())
        );
        assert_eq!(
            pr(r#"{"messages": [], "max_tokens": 2}"#, &ok),
            Problem::EmptyMessages
        );
        assert!(matches!(
            pr(r#"{"messages": [{"role": "bad", "content": ""}], "max_tokens": 2}"#, &ok),
            Problem::Chat(m) if m.contains("no bad roles")
        ));
        assert!(matches!(
            pr(r#"{"messages": [{"role": "user", "content": "", "name": "x"}], "max_tokens": 2}"#, &ok),
            Problem::Json(m) if m.contains("unknown field `name`")
        ));
        assert_eq!(
            pr(
                &format!(r#"{{{msgs}, "context": [1], "max_tokens": 2}}"#),
                &ok
            ),
            Problem::Conflict("messages", "context")
        );
        assert_eq!(
            pr(&format!(r#"{{{msgs}, "rolling": [1, 2]}}"#), &ok),
            Problem::Conflict("messages", "rolling")
        );
    }

    #[test]
    fn command_line_defaults_and_per_request_overrides() {
        let d = Options {
            top_logprobs: 5,
            echo: true,
        };
        let r = parse_line(1, r#"{"rolling": [1, 2]}"#, d, &limits()).unwrap();
        assert_eq!(r.options, d);
        let r = parse_line(
            1,
            r#"{"rolling": [1, 2], "top_logprobs": 0, "echo": false}"#,
            d,
            &limits(),
        )
        .unwrap();
        assert_eq!(r.options, Options::default());
    }

    #[test]
    fn every_bad_line_is_named_with_its_problem() {
        assert!(matches!(
            problem(r#"{"rolling": [1, 2], "contxt": [1]}"#),
            Problem::Json(m) if m.contains("unknown field `contxt`")
        ));
        assert_eq!(problem("  "), Problem::EmptyLine);
        assert!(matches!(problem("[1]"), Problem::Json(_)));
        assert_eq!(
            problem(r#"{"context": [1], "continuation": []}"#),
            Problem::EmptyContinuation
        );
        assert_eq!(
            problem(r#"{"context": [1], "continuation": [100]}"#),
            Problem::TokenOutOfVocabulary {
                field: "continuation",
                index: 0,
                id: 100,
                vocab: 100
            }
        );
        assert!(matches!(
            problem(r#"{"rolling": [1, -2]}"#),
            Problem::NotATokenId {
                field: "rolling",
                index: 1,
                ..
            }
        ));
        assert_eq!(
            problem(r#"{"rolling": 5}"#),
            Problem::NotTextOrIds("rolling")
        );
        assert_eq!(problem(r#"{"rolling": [1]}"#), Problem::RollingTooShort(1));
        assert_eq!(
            problem(r#"{"rolling": "text"}"#),
            Problem::NoTokenizer("rolling")
        );
        assert_eq!(
            problem(r#"{"context": "a", "continuation": [1]}"#),
            Problem::MixedInputs
        );
        // 10 positions: 6 + 5 - 1 = 10 fits, 11 does not
        assert!(p(r#"{"context": [1,1,1,1,1,1], "continuation": [2,2,2,2,2]}"#).is_ok());
        assert_eq!(
            problem(r#"{"context": [1,1,1,1,1,1,1], "continuation": [2,2,2,2,2]}"#),
            Problem::TooLong {
                needed: 11,
                max: 10
            }
        );
        assert!(p(r#"{"context": [1,1], "max_tokens": 9}"#).is_ok());
        assert_eq!(
            problem(r#"{"context": [1,1], "max_tokens": 10}"#),
            Problem::TooLong {
                needed: 11,
                max: 10
            }
        );
        assert_eq!(
            problem(r#"{"context": [1], "max_tokens": 0}"#),
            Problem::ZeroMaxTokens
        );
        assert_eq!(
            problem(r#"{"context": [], "max_tokens": 2}"#),
            Problem::EmptyContext
        );
        assert_eq!(
            problem(r#"{"context": [1], "max_tokens": 2, "until": ["x"]}"#),
            Problem::UntilWithoutTokenizer
        );
        assert_eq!(
            problem(r#"{"context": [1], "max_tokens": 2, "until": [""]}"#),
            Problem::EmptyStop(0)
        );
        assert_eq!(problem(r#"{"context": [1]}"#), Problem::NoKind);
        assert_eq!(problem(r#"{"echo": true}"#), Problem::NoKind);
        assert_eq!(
            problem(r#"{"rolling": [1, 2], "context": [1]}"#),
            Problem::Conflict("rolling", "context")
        );
        assert_eq!(
            problem(r#"{"context": [1], "continuation": [2], "max_tokens": 3}"#),
            Problem::Conflict("continuation", "until/max_tokens")
        );
        assert_eq!(
            problem(r#"{"rolling": [1, 2], "top_logprobs": 101}"#),
            Problem::TooManyTopLogprobs(101)
        );
        assert!(matches!(
            problem(r#"{"context": [1], "max_tokens": 2, "top_p": 1.5}"#),
            Problem::Sampling(SamplingError::TopP(_))
        ));
        assert_eq!(
            problem(r#"{"context": [1], "continuation": [2], "seed": 3}"#),
            Problem::SamplingWithoutGeneration("seed")
        );
        let r = p(r#"{"context": [1], "max_tokens": 2, "temperature": 0.7, "seed": 9}"#).unwrap();
        let Task::GenerateUntil { sampling, .. } = r.task else {
            panic!("{r:?}")
        };
        assert_eq!((sampling.temperature, sampling.seed), (0.7, 9));
    }
}
