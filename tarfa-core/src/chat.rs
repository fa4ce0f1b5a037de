//! Chat templates: the bundle's own `chat_template` rendered with minijinja in the environment
//! transformers' `apply_chat_template` gives it, so that a chat prompt is the text the model was
//! trained on.
//!
//! Where the template comes from (as transformers looks): `chat_template.jinja` when the bundle
//! has it, else `tokenizer_config.json`'s `chat_template`, a string or a list of named templates
//! of which the one named "default" is used. The environment: `trim_blocks` and `lstrip_blocks`
//! on, a template's single trailing newline dropped, Python's string methods (`startswith`,
//! `split`, `strip`...), loop controls, `tojson`, `raise_exception(msg)`, and the variables
//! `messages`, `add_generation_prompt` and the special tokens of tokenizer_config.json
//! (`bos_token`, `eos_token`, `unk_token`, `pad_token`).
//!
//! Not provided, on purpose: `strftime_now` (a prompt that depends on the clock would make a run
//! unrepeatable; a template that calls it is an error naming it). Tool definitions and other
//! message fields are not passed: a message is a role and a content.
//!
//! This module reads nothing itself: the caller hands it the files' text (verified against the
//! manifest by the bundle reader).

use std::collections::BTreeMap;

use minijinja::value::Value;
use minijinja::{Environment, Error, ErrorKind};

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

/// Why a chat template cannot be found, compiled or rendered. Every one is bad input: the
/// bundle's files or the conversation (exit code 2).
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// tokenizer_config.json is not a JSON object.
    #[error("tokenizer_config.json: not a JSON object: {why}")]
    TokenizerConfig { why: String },
    /// `chat_template` is neither a string nor a list of `{name, template}` objects.
    #[error("tokenizer_config.json: chat_template must be a string or a list of {{\"name\", \"template\"}} objects")]
    TemplateNotText,
    /// A list of named templates without one named "default".
    #[error("tokenizer_config.json: chat_template lists the templates {names:?} but none named \"default\"")]
    NoDefaultTemplate { names: Vec<String> },
    /// A special token that is neither a string nor an object with a string `content`.
    #[error(
        "tokenizer_config.json: {key} must be a string or an object with a string \"content\""
    )]
    SpecialToken { key: String },
    /// The template does not compile.
    #[error("{file}: the chat template does not compile: {why}")]
    Syntax { file: &'static str, why: String },
    /// Rendering failed: the template raised an exception (a conversation it refuses, e.g. roles
    /// that do not alternate) or used something the environment does not have.
    #[error("{file}: the chat template refused the conversation: {why}")]
    Render { file: &'static str, why: String },
}

/// A bundle's chat template, compiled, with the special tokens it may use.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Which file the template came from (for messages).
    file: &'static str,
    /// `bos_token`, `eos_token`, ... as tokenizer_config.json names them.
    special_tokens: BTreeMap<String, String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("file", &self.file)
            .field("special_tokens", &self.special_tokens)
            .finish()
    }
}

const TEMPLATE_NAME: &str = "chat";
const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
const JINJA_FILE: &str = "chat_template.jinja";
/// The special tokens transformers passes to a template (`special_tokens_map`).
const SPECIAL_TOKENS: [&str; 4] = ["bos_token", "eos_token", "unk_token", "pad_token"];

impl ChatTemplate {
    /// The template of a bundle with these files (their text, `None` when absent), or `None`
    /// when it has no template at all.
    pub fn from_files(
        tokenizer_config: Option<&str>,
        chat_template_jinja: Option<&str>,
    ) -> Result<Option<ChatTemplate>, ChatError> {
        let config: serde_json::Map<String, serde_json::Value> = match tokenizer_config {
            Some(text) => match serde_json::from_str(text) {
                Ok(serde_json::Value::Object(m)) => m,
                Ok(_) => {
                    return Err(ChatError::TokenizerConfig {
                        why: "the top level is not an object".into(),
                    })
                }
                Err(e) => return Err(ChatError::TokenizerConfig { why: e.to_string() }),
            },
            None => serde_json::Map::new(),
        };
        let (file, source) = match chat_template_jinja {
            Some(text) => (JINJA_FILE, text.to_string()),
            None => match config.get("chat_template") {
                None | Some(serde_json::Value::Null) => return Ok(None),
                Some(t) => (TOKENIZER_CONFIG, template_text(t)?),
            },
        };
        let mut special_tokens = BTreeMap::new();
        for key in SPECIAL_TOKENS {
            let token = match config.get(key) {
                None | Some(serde_json::Value::Null) => continue,
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(serde_json::Value::Object(o)) => match o.get("content") {
                    Some(serde_json::Value::String(s)) => s.clone(),
                    _ => return Err(ChatError::SpecialToken { key: key.into() }),
                },
                Some(_) => return Err(ChatError::SpecialToken { key: key.into() }),
            };
            special_tokens.insert(key.to_string(), token);
        }
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .expect("the default delimiters are valid"),
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |_fmt: String| -> Result<Value, Error> {
            Err(Error::new(
                ErrorKind::InvalidOperation,
                "strftime_now is not provided: a prompt must not depend on the clock",
            ))
        });
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| ChatError::Syntax {
                file,
                why: describe(&e),
            })?;
        Ok(Some(ChatTemplate {
            env,
            file,
            special_tokens,
        }))
    }

    /// The file the template came from: `chat_template.jinja` or `tokenizer_config.json`.
    pub fn file(&self) -> &'static str {
        self.file
    }

    /// The conversation as the model's prompt text; with `add_generation_prompt`, followed by
    /// whatever opens the assistant's reply.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                let mut o = BTreeMap::new();
                o.insert("role", Value::from(m.role.as_str()));
                o.insert("content", Value::from(m.content.as_str()));
                Value::from(o)
            })
            .collect();
        let mut ctx: BTreeMap<String, Value> = self
            .special_tokens
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        ctx.insert("messages".into(), Value::from(messages));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .expect("added at construction");
        template.render(ctx).map_err(|e| ChatError::Render {
            file: self.file,
            why: describe(&e),
        })
    }
}

/// The template text of tokenizer_config.json's `chat_template`.
fn template_text(t: &serde_json::Value) -> Result<String, ChatError> {
    match t {
        serde_json::Value::String(s) => Ok(s.clone()),
        serde_json::Value::Array(list) => {
            let mut names = Vec::new();
            for item in list {
                let name = item.get("name").and_then(|n| n.as_str());
                let text = item.get("template").and_then(|n| n.as_str());
                match (name, text) {
                    (Some("default"), Some(text)) => return Ok(text.to_string()),
                    (Some(name), Some(_)) => names.push(name.to_string()),
                    _ => return Err(ChatError::TemplateNotText),
                }
            }
            Err(ChatError::NoDefaultTemplate { names })
        }
        _ => Err(ChatError::TemplateNotText),
    }
}

/// A minijinja error on one line: its kind, its detail and where, without the source dump.
fn describe(e: &Error) -> String {
    let mut s = match e.detail() {
        Some(d) => d.to_string(),
        None => e.kind().to_string(),
    };
    if let Some(line) = e.line() {
        s.push_str(&format!(" (template line {line})"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(text: &str) -> Vec<ChatMessage> {
        vec![ChatMessage::new("user", text)]
    }

    #[test]
    fn no_template_is_none_and_the_jinja_file_wins() {
        assert!(ChatTemplate::from_files(None, None).unwrap().is_none());
        assert!(
            ChatTemplate::from_files(Some(r#"{"bos_token": "<s>"}"#), None)
                .unwrap()
                .is_none()
        );
        let cfg =
            r#"{"chat_template": "from config: {{ messages[0].content }}", "bos_token": "<s>"}"#;
        let t = ChatTemplate::from_files(Some(cfg), None).unwrap().unwrap();
        assert_eq!(t.file(), "tokenizer_config.json");
        assert_eq!(t.render(&user("hi"), false).unwrap(), "from config: hi");
        let t = ChatTemplate::from_files(
            Some(cfg),
            Some("{{ bos_token }}jinja: {{ messages[0].content }}\n"),
        )
        .unwrap()
        .unwrap();
        assert_eq!(t.file(), "chat_template.jinja");
        // The special tokens still come from tokenizer_config.json; one trailing newline dropped.
        assert_eq!(t.render(&user("hi"), false).unwrap(), "<s>jinja: hi");
    }

    #[test]
    fn a_list_of_named_templates_uses_default() {
        let cfg = r#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}],
                      "eos_token": {"content": "</s>", "lstrip": false}}"#;
        let t = ChatTemplate::from_files(Some(cfg), None).unwrap().unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "D</s>");
        let cfg = r#"{"chat_template": [{"name": "tool_use", "template": "T"}]}"#;
        let e = ChatTemplate::from_files(Some(cfg), None).unwrap_err();
        assert!(
            matches!(e, ChatError::NoDefaultTemplate { ref names } if names == &["tool_use"]),
            "{e}"
        );
    }

    #[test]
    fn bad_files_are_named_errors() {
        let e = ChatTemplate::from_files(Some("{"), None).unwrap_err();
        assert!(matches!(e, ChatError::TokenizerConfig { .. }), "{e}");
        let e = ChatTemplate::from_files(Some("[1]"), None).unwrap_err();
        assert!(matches!(e, ChatError::TokenizerConfig { .. }), "{e}");
        let e = ChatTemplate::from_files(Some(r#"{"chat_template": 3}"#), None).unwrap_err();
        assert!(matches!(e, ChatError::TemplateNotText), "{e}");
        let e = ChatTemplate::from_files(Some(r#"{"chat_template": "x", "bos_token": 1}"#), None)
            .unwrap_err();
        assert!(
            matches!(e, ChatError::SpecialToken { ref key } if key == "bos_token"),
            "{e}"
        );
        let e = ChatTemplate::from_files(None, Some("{% for m in messages %}")).unwrap_err();
        assert!(
            matches!(
                e,
                ChatError::Syntax {
                    file: "chat_template.jinja",
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn raise_exception_and_strftime_now_refuse_by_message() {
        let t = ChatTemplate::from_files(
            None,
            Some("{% if messages[0].role != 'user' %}{{ raise_exception('roles must alternate') }}{% endif %}ok"),
        )
        .unwrap()
        .unwrap();
        assert_eq!(t.render(&user("x"), false).unwrap(), "ok");
        let e = t
            .render(&[ChatMessage::new("assistant", "x")], false)
            .unwrap_err();
        assert!(e.to_string().contains("roles must alternate"), "{e}");
        let t = ChatTemplate::from_files(None, Some("{{ strftime_now('%d') }}"))
            .unwrap()
            .unwrap();
        let e = t.render(&user("x"), false).unwrap_err();
        assert!(e.to_string().contains("strftime_now"), "{e}");
    }
}
