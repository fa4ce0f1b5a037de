//! A cancelled request (its client gone, or past its deadline: the server cancels both through
//! `Scheduler::cancel`) leaves nothing behind: requests that shared its steps, and a request that
//! later runs on its freed sequence, give the same bytes as each request alone; the cancelled
//! request's sink hears nothing more, waiting or in flight.

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
    parse_line, Decoding, Event, Limits, Options, Request, Scheduler, ScoreOptions, Sink,
};

const EOS: [u32; 1] = [1];

fn model() -> Model {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/oracle/qwen3moe-a");
    let cfg = MoeConfig::from_json_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
        .unwrap();
    let source: Arc<dyn WeightSource> =
        Arc::new(load_safetensors_dir(&dir, &cfg, &ArchSpec::new(&cfg)).unwrap());
    let opts = LoadOptions {
        backend: BackendChoice::Cpu,
        threads: 2,
        kernel: Kernel::best(),
        hot: None,
        cuda: Default::default(),
    };
    Model::load(cfg, source, &opts, &|_| {}).unwrap()
}

fn request(m: &Model, line: &str) -> Request {
    let cfg = m.config();
    let limits = Limits {
        vocab_size: cfg.vocab_size,
        max_positions: cfg.max_position_embeddings,
        eos: &EOS,
        tokenizer: None,
        chat: Ok(None),
    };
    parse_line(1, line, Options::default(), &limits).unwrap()
}

const DEC: Decoding<'static> = Decoding {
    tokenizer: None,
    eos: &EOS,
};

/// Every event a request's sink heard, as text (tokens and the result's JSON line).
type Heard = Rc<RefCell<Vec<String>>>;

fn sink<'a>(heard: &Heard) -> Sink<'a> {
    let heard = heard.clone();
    Box::new(move |e: Event| {
        heard.borrow_mut().push(match e {
            Event::Token(t) => format!("token {}", t.token),
            Event::Done(r) => r.to_json_line(),
            Event::Failed(m) => format!("failed {m}"),
        });
        true
    })
}

fn opts(max_batch: usize) -> ScoreOptions {
    // small chunks: a prefill spans several steps, so a cancel lands mid-request
    ScoreOptions {
        max_batch,
        chunk_tokens: 3,
        draft_tokens: 0,
    }
}

/// The events of `line` run alone.
fn alone(m: &Model, line: &str) -> Vec<String> {
    let heard = Heard::default();
    let mut s = Scheduler::new(m, opts(1));
    s.submit(request(m, line), sink(&heard));
    while s.step(&DEC).unwrap() {}
    let v = heard.borrow().clone();
    v
}

const A: &str = r#"{"context": [100, 200, 300, 5, 6, 7, 8], "max_tokens": 6, "top_logprobs": 2}"#;
const B: &str = r#"{"context": [9, 10, 11, 12, 13, 14, 15, 16], "max_tokens": 12, "echo": true}"#;
const C: &str =
    r#"{"context": [3, 17, 9], "continuation": [40, 2, 77, 5, 5, 6, 8], "top_logprobs": 3}"#;
const D: &str = r#"{"context": [250, 251], "max_tokens": 5}"#;
const E: &str = r#"{"context": [42, 43, 44, 45, 46], "max_tokens": 4, "top_logprobs": 1}"#;

#[test]
fn cancelled_requests_waiting_or_in_flight_leave_every_other_result_bit_identical() {
    let m = model();
    let want: Vec<Vec<String>> = [A, C, E].iter().map(|l| alone(&m, l)).collect();
    assert!(want.iter().all(|w| w.last().unwrap().starts_with('{')));

    let heard: Vec<Heard> = (0..5).map(|_| Heard::default()).collect();
    let mut s = Scheduler::new(&m, opts(3));
    let ta = s.submit(request(&m, A), sink(&heard[0]));
    let tb = s.submit(request(&m, B), sink(&heard[1]));
    s.submit(request(&m, C), sink(&heard[2]));
    let td = s.submit(request(&m, D), sink(&heard[3]));
    // A, B and C in flight, D waiting; B is part-way through its prefill
    for _ in 0..2 {
        assert!(s.step(&DEC).unwrap());
    }
    assert_eq!((s.running(), s.waiting()), (3, 1));
    assert!(s.cancel(tb), "B is in flight");
    assert!(s.cancel(td), "D is waiting");
    assert!(!s.cancel(td), "D is already gone");
    assert_eq!(s.waiting(), 0);
    // E arrives after the cancel and runs on a sequence B (or a finished request) gave back
    s.submit(request(&m, E), sink(&heard[4]));
    let heard_b = heard[1].borrow().len();
    while s.step(&DEC).unwrap() {}
    assert!(s.is_idle());
    assert!(!s.cancel(ta), "A finished");
    assert_eq!(*heard[0].borrow(), want[0], "A shared its steps with B");
    assert_eq!(*heard[2].borrow(), want[1], "C shared its steps with B");
    assert_eq!(*heard[4].borrow(), want[2], "E ran after B was cancelled");
    assert_eq!(
        heard[1].borrow().len(),
        heard_b,
        "B heard nothing after its cancel"
    );
    assert!(heard[1].borrow().iter().all(|e| !e.starts_with('{')));
    assert!(heard[3].borrow().is_empty(), "D never ran");
    assert_eq!(s.progress().requests_done, 3);
}
