//! The real chat templates of Qwen3, Mixtral-8x7B-Instruct and OLMoE-Instruct (kept in
//! tests/chat/, provenance in its README.md) rendered by `tarfa_core::chat` on every conversation
//! of tests/chat/conversations.json, against what Jinja2 itself rendered in transformers'
//! environment (tests/chat/render.py wrote tests/chat/expected.json): the same text, byte for
//! byte, and a refusal where Jinja2 raised, with the template's own message.

use std::path::{Path, PathBuf};

use serde_json::Value;
use tarfa_core::chat::{ChatMessage, ChatTemplate};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/chat")
}

fn json(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join(name)).unwrap()).unwrap()
}

/// The template as a bundle holds it: the .jinja file (chat_template.jinja) beside a
/// tokenizer_config.json with the special tokens; and the same text as tokenizer_config.json's
/// `chat_template` string.
fn templates(spec: &Value) -> [ChatTemplate; 2] {
    let text = std::fs::read_to_string(dir().join(spec["file"].as_str().unwrap())).unwrap();
    let tokens = spec["special_tokens"].clone();
    let config = tokens.to_string();
    let mut with_template = tokens.as_object().unwrap().clone();
    with_template.insert("chat_template".into(), Value::String(text.clone()));
    let config_with_template = Value::Object(with_template).to_string();
    [
        ChatTemplate::from_files(Some(&config), Some(&text))
            .unwrap()
            .unwrap(),
        ChatTemplate::from_files(Some(&config_with_template), None)
            .unwrap()
            .unwrap(),
    ]
}

#[test]
fn real_templates_render_what_jinja2_renders() {
    let specs = json("templates.json");
    let expected = json("expected.json");
    let conversations = json("conversations.json");
    let mut checked = 0;
    for (name, spec) in specs.as_object().unwrap() {
        for template in templates(spec) {
            for c in conversations.as_array().unwrap() {
                let case = c["name"].as_str().unwrap();
                let messages: Vec<ChatMessage> = c["messages"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|m| {
                        ChatMessage::new(
                            m["role"].as_str().unwrap(),
                            m["content"].as_str().unwrap(),
                        )
                    })
                    .collect();
                let got = template.render(&messages, c["add_generation_prompt"].as_bool().unwrap());
                let want = &expected[name][case];
                match (got, want.get("text"), want.get("error")) {
                    (Ok(text), Some(w), None) => {
                        assert_eq!(
                            text,
                            w.as_str().unwrap(),
                            "{name} {case} ({})",
                            template.file()
                        )
                    }
                    (Err(e), None, Some(w)) => {
                        let msg = e.to_string();
                        assert!(msg.contains(w.as_str().unwrap()), "{name} {case}: {msg}");
                    }
                    (got, _, _) => panic!("{name} {case}: got {got:?}, Jinja2 gave {want}"),
                }
                checked += 1;
            }
        }
    }
    assert_eq!(
        checked,
        3 * 2 * 7,
        "every template on every conversation, from both files"
    );
}
