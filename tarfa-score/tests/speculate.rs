//! generate_until with speculative decoding (`ScoreOptions::draft_tokens`): every result line and
//! every streamed token event is the same bytes as with one token per step, for draft lengths 1,
//! 2, 4 and 8, batches 1 and 3, greedy and sampled, with EOS, a stop string and max_tokens
//! cutting a draft, on the CPU and on the CUDA arm over tarfa-cuda's mock device.

use std::cell::RefCell;
use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;

use tarfa_core::config::MoeConfig;
use tarfa_core::model::ArchSpec;
use tarfa_core::numerics::Kernel;
use tarfa_core::weights::{load_safetensors_dir, WeightSource};
use tarfa_engine::{BackendChoice, LoadOptions, Model};
use tarfa_score::{
    parse_line, Decoding, Event, Limits, Options, Progress, Scheduler, ScoreOptions,
};

fn model(name: &str, backend: BackendChoice) -> Model {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/oracle")
        .join(name);
    let cfg = MoeConfig::from_json_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
        .unwrap();
    let source: Arc<dyn WeightSource> =
        Arc::new(load_safetensors_dir(&dir, &cfg, &ArchSpec::new(&cfg)).unwrap());
    let opts = LoadOptions {
        backend,
        threads: 2,
        kernel: Kernel::best(),
        hot: None,
        cuda: Default::default(),
    };
    Model::load(cfg, source, &opts, &|_| {}).unwrap()
}

/// Every request's events (each streamed token as its numbers and text, then the result line),
/// and the run's counters.
fn run(
    m: &Model,
    lines: &[&str],
    eos: &[u32],
    tok: Option<&tokenizers::Tokenizer>,
    max_batch: usize,
    draft_tokens: usize,
) -> (Vec<Vec<String>>, Progress) {
    run_drafted(m, None, lines, eos, tok, max_batch, draft_tokens)
}

/// [`run`] with a draft model's drafts (`Scheduler::with_draft_model`).
fn run_drafted(
    m: &Model,
    draft: Option<&Model>,
    lines: &[&str],
    eos: &[u32],
    tok: Option<&tokenizers::Tokenizer>,
    max_batch: usize,
    draft_tokens: usize,
) -> (Vec<Vec<String>>, Progress) {
    let cfg = m.config();
    let limits = Limits {
        vocab_size: cfg.vocab_size,
        max_positions: cfg.max_position_embeddings,
        eos,
        tokenizer: tok,
        chat: Ok(None),
    };
    let dec = Decoding {
        tokenizer: tok,
        eos,
    };
    let opts = ScoreOptions {
        max_batch,
        chunk_tokens: 4,
        draft_tokens,
    };
    let heard: Vec<Rc<RefCell<Vec<String>>>> = lines.iter().map(|_| Default::default()).collect();
    let mut s = Scheduler::new(m, opts);
    if let Some(d) = draft {
        s = s.with_draft_model(d);
    }
    for (i, l) in lines.iter().enumerate() {
        let r = parse_line(i + 1, l, Options::default(), &limits).unwrap();
        let h = heard[i].clone();
        s.submit(
            r,
            Box::new(move |e| {
                h.borrow_mut().push(match e {
                    Event::Token(t) => format!("{t:?}"),
                    Event::Done(r) => r.to_json_line(),
                    Event::Failed(m) => format!("failed {m}"),
                });
                true
            }),
        );
    }
    while s.step(&dec).unwrap() {}
    let p = s.progress();
    (heard.iter().map(|h| h.borrow().clone()).collect(), p)
}

/// Contexts that repeat (drafts fed and accepted) and one that does not; greedy and sampled;
/// max_tokens that cut a draft; top-k alternatives and echo. Every id is below 256 (the smallest
/// fixtures' vocabulary).
const LINES: [&str; 5] = [
    r#"{"context": [5, 9, 13, 2, 7, 5, 9, 13, 2, 7, 5, 9, 13, 2, 7, 5, 9, 13, 2, 7], "max_tokens": 14, "top_logprobs": 2}"#,
    r#"{"context": [30, 31, 30, 31, 30, 31, 30], "max_tokens": 9, "echo": true}"#,
    r#"{"context": [3, 17, 9, 44, 120, 8], "max_tokens": 6}"#,
    r#"{"context": [8, 8, 8, 8, 8], "max_tokens": 11, "temperature": 0.9, "top_p": 0.8, "seed": 7}"#,
    r#"{"context": [60, 61, 62, 60, 61, 62, 60, 61], "max_tokens": 2}"#,
];

#[test]
fn drafts_leave_every_result_and_streamed_token_bit_identical() {
    let lines = LINES;
    let cpu = model("qwen3moe-a", BackendChoice::Cpu);
    let (want, plain) = run(&cpu, &lines, &[1], None, 1, 0);
    assert!(want.iter().all(|w| w.last().unwrap().starts_with('{')));
    assert_eq!(plain.drafted, 0);
    // An EOS id the first request produces as its fourth token: it stops inside a draft.
    let first: serde_json::Value = serde_json::from_str(want[0].last().unwrap()).unwrap();
    let eos = [first["tokens"][3].as_u64().unwrap() as u32];
    let (want_eos, _) = run(&cpu, &lines, &eos, None, 3, 0);
    let mut accepted = 0;
    for k in [1, 2, 4, 8] {
        for batch in [1, 3] {
            let (got, p) = run(&cpu, &lines, &[1], None, batch, k);
            assert_eq!(got, want, "k {k}, batch {batch}");
            assert!(p.drafted > 0 && p.accepted <= p.drafted, "k {k}: {p:?}");
            accepted += p.accepted;
            assert!(p.tokens <= plain.tokens + p.drafted, "k {k}: {p:?}");
        }
        let (got, _) = run(&cpu, &lines, &eos, None, 3, k);
        assert_eq!(got, want_eos, "k {k}, EOS {eos:?}");
    }
    assert!(
        accepted > 0,
        "the repeating contexts have drafts accepted: {want:?}"
    );
    let cuda = model("qwen3moe-a", BackendChoice::CudaMock);
    let (got, _) = run(&cuda, &lines, &[1], None, 3, 4);
    assert_eq!(got, want, "cuda mock, k 4, batch 3");
}

#[test]
fn a_stop_string_inside_a_draft_ends_the_request_where_plain_decoding_does() {
    // The demo model and its tokenizer: Python that quotes itself, so that drafts are accepted,
    // and stop strings the plain run's text contains.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/oracle/qwen3moe-code");
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let m = model("qwen3moe-code", BackendChoice::Cpu);
    let prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(";
    let plain_line = serde_json::json!({"context": prompt, "max_tokens": 24}).to_string();
    let (want, _) = run(&m, &[&plain_line], &[], Some(&tok), 1, 0);
    let v: serde_json::Value = serde_json::from_str(want[0].last().unwrap()).unwrap();
    let text = v["text"].as_str().unwrap().to_string();
    assert!(text.len() > 8, "{text:?}");
    // Stops that begin at several places in the text (each cuts the run there).
    let mut lines = vec![plain_line];
    for at in [2, text.len() / 2, text.len() - 3] {
        let mut at = at;
        while !text.is_char_boundary(at) {
            at += 1;
        }
        let stop: String = text[at..].chars().take(2).collect();
        lines.push(
            serde_json::json!({"context": prompt, "max_tokens": 24, "until": [stop]}).to_string(),
        );
    }
    let lines: Vec<&str> = lines.iter().map(|s| s.as_str()).collect();
    let (want, _) = run(&m, &lines, &[], Some(&tok), 2, 0);
    for k in [2, 8] {
        let (got, p) = run(&m, &lines, &[], Some(&tok), 2, k);
        assert_eq!(got, want, "k {k}");
        assert!(p.drafted > 0 && p.accepted > 0, "k {k}: {p:?}");
    }
}

#[test]
fn a_stop_string_cuts_the_text_at_its_first_occurrence_in_the_full_decode() {
    // The text is kept up to date a token at a time (text.rs) and a stop string looked for only
    // where it can newly appear: the cut must be where searching the whole decode puts it, for
    // stops of 1 to 5 characters starting all over the text (inside a token, across tokens,
    // repeated earlier), and for several stops at once.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/oracle/qwen3moe-code");
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let m = model("qwen3moe-code", BackendChoice::Cpu);
    let prompt = "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n";
    let plain_line = serde_json::json!({"context": prompt, "max_tokens": 40}).to_string();
    let (plain, _) = run(&m, &[&plain_line], &[], Some(&tok), 1, 0);
    let v: serde_json::Value = serde_json::from_str(plain[0].last().unwrap()).unwrap();
    let text = v["text"].as_str().unwrap().to_string();
    assert!(text.chars().count() > 30, "{text:?}");
    let starts: Vec<usize> = text.char_indices().map(|(i, _)| i).step_by(3).collect();
    let mut stops: Vec<Vec<String>> = Vec::new();
    for (n, &at) in starts.iter().enumerate() {
        let stop: String = text[at..].chars().take(1 + n % 5).collect();
        stops.push(vec![stop]);
    }
    let n = starts.len();
    stops.push(vec![
        text[starts[n - 1]..].to_string(),
        text[starts[n / 2]..].chars().take(3).collect(),
    ]);
    stops.push(vec!["no such text \u{1F408}".to_string()]);
    let lines: Vec<String> = stops
        .iter()
        .map(|u| serde_json::json!({"context": prompt, "max_tokens": 40, "until": u}).to_string())
        .collect();
    let refs: Vec<&str> = lines.iter().map(|s| s.as_str()).collect();
    let (got, _) = run(&m, &refs, &[], Some(&tok), 8, 0);
    for (u, events) in stops.iter().zip(&got) {
        let r: serde_json::Value = serde_json::from_str(events.last().unwrap()).unwrap();
        let cut = u.iter().filter_map(|s| text.find(s.as_str())).min();
        match cut {
            Some(c) => {
                assert_eq!(r["text"].as_str().unwrap(), &text[..c], "until {u:?}");
                assert_eq!(r["finish_reason"], "stop", "until {u:?}");
            }
            None => {
                assert_eq!(r["text"].as_str().unwrap(), text, "until {u:?}");
                assert_eq!(r["finish_reason"], "length", "until {u:?}");
            }
        }
    }
}

#[test]
fn a_draft_model_leaves_every_result_and_streamed_token_bit_identical() {
    let lines = LINES;
    let cpu = model("qwen3moe-a", BackendChoice::Cpu);
    let (want, _) = run(&cpu, &lines, &[1], None, 1, 0);
    let first: serde_json::Value = serde_json::from_str(want[0].last().unwrap()).unwrap();
    let eos = [first["tokens"][3].as_u64().unwrap() as u32];
    let (want_eos, _) = run(&cpu, &lines, &eos, None, 3, 0);
    // The model as its own draft: batches 1 and 3, draft lengths 1, 3 and 8, an EOS inside a
    // draft.
    for (k, batch) in [(1, 1), (3, 3), (8, 3)] {
        let (got, p) = run_drafted(&cpu, Some(&cpu), &lines, &[1], None, batch, k);
        assert_eq!(got, want, "self-draft k {k}, batch {batch}");
        assert!(p.accepted > 0 && p.accepted <= p.drafted, "k {k}: {p:?}");
        assert!(
            p.draft_steps > 0 && p.draft_positions >= p.draft_steps,
            "{p:?}"
        );
    }
    let (got, _) = run_drafted(&cpu, Some(&cpu), &lines, &eos, None, 3, 4);
    assert_eq!(got, want_eos, "self-draft, EOS {eos:?}");
    // The CUDA arm (mock device) as the verifier and as the draft.
    let cuda = model("qwen3moe-a", BackendChoice::CudaMock);
    let (got, _) = run_drafted(&cuda, Some(&cpu), &lines, &[1], None, 3, 4);
    assert_eq!(got, want, "cuda mock verifying");
    let (got, _) = run_drafted(&cpu, Some(&cuda), &lines, &[1], None, 3, 2);
    assert_eq!(got, want, "cuda mock drafting");
    // A weak draft: another family's model of the same vocabulary.
    let verifier = model("qwen2moe-s", BackendChoice::Cpu);
    let weak = model("mixtral-s", BackendChoice::Cpu);
    let (want, _) = run(&verifier, &lines, &[1], None, 3, 0);
    for (k, batch) in [(2, 3), (5, 1)] {
        let (got, p) = run_drafted(&verifier, Some(&weak), &lines, &[1], None, batch, k);
        assert_eq!(got, want, "weak draft k {k}, batch {batch}");
        assert!(
            p.accepted < p.drafted,
            "the weak draft is sometimes wrong: {p:?}"
        );
    }
}
