//! `tarfa-run score` and `tarfa-run perplexity` end to end, on the converted qwen3moe-code fixture
//! (it has a tokenizer): agreement with transformers' log-probs, each request kind, bad input
//! (exit 2 naming the line, nothing written), and the output file's bytes under every batch size,
//! thread count and SIMD path. The CUDA backend is not exercised here (the binary cannot reach the
//! mock device): tarfa-score/tests/backends.rs scores on the CUDA arm over tarfa-cuda's mock
//! device and compares with the CPU's bytes; on a GPU machine, validation/gpu/score.sh compares
//! the CLI's files.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use safetensors::SafeTensors;
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_tarfa-run");
const FIXTURE: &str = "qwen3moe-code";

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/oracle")
        .join(FIXTURE)
}

/// The fixture converted once for this file's tests.
fn bundle() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("score-bundles");
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        let out = d.join(FIXTURE);
        tarfa_convert::convert(&fixture(), &out, &Default::default()).unwrap();
        out
    })
    .clone()
}

/// Runs the binary to its end; kills it and fails the test after 120 s, and on a panic.
fn run(args: &[&str]) -> (i32, String, String) {
    let mut c = Command::new(BIN);
    c.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            String::from_utf8_lossy(&v).into_owned()
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{c:?} hung (killed after 120 s)");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (out, err) = (out.join().unwrap(), err.join().unwrap());
    assert!(!err.contains("panicked"), "{c:?} panicked: {err}");
    (status.code().unwrap_or(-1), out, err)
}

fn last_line(err: &str) -> &str {
    err.trim_end().lines().last().unwrap_or("")
}

fn write_requests(dir: &Path, name: &str, lines: &[Value]) -> PathBuf {
    let p = dir.join(name);
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    fs::write(&p, text).unwrap();
    p
}

/// `score` on CPU with `extra` flags; the result lines parsed.
fn score(requests: &Path, extra: &[&str]) -> Vec<Value> {
    let b = bundle();
    let mut args = vec![
        "score",
        b.to_str().unwrap(),
        "--requests",
        requests.to_str().unwrap(),
        "--backend",
        "cpu",
        "--quiet",
    ];
    args.extend_from_slice(extra);
    let (code, out, err) = run(&args);
    assert_eq!(code, 0, "{err}");
    out.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn i64s(st: &SafeTensors, name: &str) -> Vec<u32> {
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

fn rows(st: &SafeTensors, name: &str) -> Vec<Vec<f32>> {
    let t = st.tensor(name).unwrap();
    let cols = t.shape()[1];
    let flat: Vec<f32> = t
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    flat.chunks_exact(cols).map(|r| r.to_vec()).collect()
}

/// transformers' log_softmax of one of its own rows: f32 logits, computed here independently
/// (the platform's exp/ln, summed from the last id down).
fn ref_log_softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let s: f64 = row.iter().rev().map(|&x| (x as f64 - m).exp()).sum();
    row.iter().map(|&x| x as f64 - m - s.ln()).collect()
}

/// The k best ids of a reference row, and whether the k-th and (k+1)-th are too close to order.
fn ref_top(lp: &[f64], k: usize) -> (Vec<u32>, bool) {
    let mut ids: Vec<usize> = (0..lp.len()).collect();
    ids.sort_by(|&a, &b| lp[b].partial_cmp(&lp[a]).unwrap().then(a.cmp(&b)));
    let mut top: Vec<u32> = ids[..k].iter().map(|&i| i as u32).collect();
    top.sort();
    (top, (lp[ids[k - 1]] - lp[ids[k]]).abs() < 1e-4)
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The ids of one position's top_logprobs, sorted.
fn top_ids(v: &Value) -> Vec<u32> {
    let mut ids: Vec<u32> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[0].as_u64().unwrap() as u32)
        .collect();
    ids.sort();
    ids
}

const TOL: f64 = 2e-4;

#[test]
fn teacher_forced_logprobs_agree_with_transformers() {
    let bytes = fs::read(fixture().join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let d = tempfile::tempdir().unwrap();
    let n_cont = 12;
    let k = 5;
    let mut lines = Vec::new();
    let mut refs = Vec::new();
    for i in 0..4 {
        let prompt = i64s(&st, &format!("prompt.{i}"));
        let greedy = i64s(&st, &format!("greedy.{i}"));
        let cont = greedy[..n_cont].to_vec();
        lines.push(
            json!({"context": prompt, "continuation": cont, "top_logprobs": k, "echo": true}),
        );
        refs.push((
            prompt,
            cont,
            rows(&st, &format!("step_logits.{i}")),
            rows(&st, &format!("prefill_logits.{i}")),
        ));
    }
    let req = write_requests(d.path(), "oracle.jsonl", &lines);
    let results = score(&req, &["--max-batch", "4"]);
    assert_eq!(results.len(), 4);
    let (mut worst, mut checked) = (0f64, 0);
    for (i, (r, (prompt, cont, step, prefill))) in results.iter().zip(&refs).enumerate() {
        assert_eq!(u32s(&r["tokens"]), *cont, "request {i}");
        // transformers' own greedy tokens are greedy here too
        assert_eq!(r["is_greedy"], json!(true), "request {i}");
        let lps = f64s(&r["token_logprobs"]);
        let mut sum = 0f64;
        for (j, &lp) in lps.iter().enumerate() {
            let want = ref_log_softmax(&step[j]);
            let e = (lp - want[cont[j] as usize]).abs();
            worst = worst.max(e);
            assert!(
                e <= TOL,
                "request {i} token {j}: {lp} vs {}",
                want[cont[j] as usize]
            );
            let (top, tie) = ref_top(&want, k);
            if !tie {
                assert_eq!(top_ids(&r["top_logprobs"][j]), top, "request {i} token {j}");
            }
            sum += lp;
            checked += 1;
        }
        assert_eq!(r["logprob"].as_f64().unwrap().to_bits(), sum.to_bits());
        // echo: every context token after the first, against the prefill rows
        assert_eq!(u32s(&r["context_tokens"]), *prompt);
        let ctx = r["context_logprobs"].as_array().unwrap();
        assert!(ctx[0].is_null());
        for t in 1..prompt.len() {
            let want = ref_log_softmax(&prefill[t - 1]);
            let got = ctx[t].as_f64().unwrap();
            let e = (got - want[prompt[t] as usize]).abs();
            worst = worst.max(e);
            assert!(e <= TOL, "request {i} context token {t}");
            let (top, tie) = ref_top(&want, k);
            if !tie {
                assert_eq!(top_ids(&r["context_top_logprobs"][t]), top);
            }
            checked += 1;
        }
    }
    eprintln!("{checked} log-probs within {worst:e} of transformers'");
}

#[test]
fn each_request_kind_and_how_they_agree() {
    let d = tempfile::tempdir().unwrap();
    let text = "import os\nimport sys\n\ndef main():\n    return 0\n";
    let tok = tokenizers::Tokenizer::from_file(fixture().join("tokenizer.json")).unwrap();
    let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
    assert!(ids.len() > 8);
    let req = write_requests(
        d.path(),
        "kinds.jsonl",
        &[
            json!({"rolling": text}),
            json!({"context": [ids[0]], "continuation": ids[1..]}),
            json!({"context": ids[..4], "max_tokens": 6}),
            json!({"context": ids[..4], "continuation": [0, 0, 0, 0, 0, 0]}),
            json!({"context": "def main():", "max_tokens": 40, "until": ["\n"]}),
            // lm-eval's split: the context's trailing space goes to the continuation
            json!({"context": "def main(): ", "continuation": "return 0"}),
            json!({"context": "def main():", "continuation": " return 0"}),
        ],
    );
    let r = score(&req, &[]);
    assert_eq!(r.len(), 7);
    // rolling over text = loglikelihood of tokens 1.. after token 0, bit for bit
    assert_eq!(u32s(&r[0]["tokens"]), ids[1..]);
    assert_eq!(r[0]["token_logprobs"], r[1]["token_logprobs"]);
    assert_eq!(r[0]["logprob"], r[1]["logprob"]);
    assert!(r[0].get("is_greedy").is_none());
    // generate_until's tokens are greedy: scored as a continuation they are all greedy, with the
    // same log-probs as generation gave them
    assert_eq!(r[2]["finish_reason"], json!("length"));
    let gen = u32s(&r[2]["tokens"]);
    assert_eq!(gen.len(), 6);
    let again = write_requests(
        d.path(),
        "again.jsonl",
        &[json!({"context": ids[..4], "continuation": gen})],
    );
    let a = &score(&again, &[])[0];
    assert_eq!(a["is_greedy"], json!(true));
    assert_eq!(a["token_logprobs"], r[2]["token_logprobs"]);
    assert_eq!(r[2]["text"], json!(tok.decode(&gen, false).unwrap()));
    // an unlikely continuation is not greedy
    assert_eq!(r[3]["is_greedy"], json!(false));
    // a stop string: the text is cut before it, and it is never in the text
    let stop = &r[4];
    let t = stop["text"].as_str().unwrap();
    assert!(!t.contains('\n'), "{t:?}");
    if stop["finish_reason"] == json!("stop") {
        let full = tok.decode(&u32s(&stop["tokens"]), false).unwrap();
        assert!(full.starts_with(t) && full[t.len()..].starts_with('\n'));
    } else {
        assert_eq!(stop["finish_reason"], json!("length"));
    }
    assert_eq!(r[5], r[6], "trailing whitespace moves to the continuation");
}

#[test]
fn messages_requests_score_the_rendered_chat_template() {
    let d = tempfile::tempdir().unwrap();
    // A copy of the fixture with a chat template in tokenizer_config.json.
    let src = d.path().join("src");
    fs::create_dir(&src).unwrap();
    for e in fs::read_dir(fixture()).unwrap().flatten() {
        fs::copy(e.path(), src.join(e.file_name())).unwrap();
    }
    let template = "{% for m in messages %}\n# {{ m.role }}: {{ m.content }}\n{% endfor %}\n{% if add_generation_prompt %}def {% endif %}";
    fs::write(
        src.join("tokenizer_config.json"),
        json!({"chat_template": template, "eos_token": "x"}).to_string(),
    )
    .unwrap();
    let chat = d.path().join("chat");
    tarfa_convert::convert(&src, &chat, &Default::default()).unwrap();
    let msgs =
        json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "parse"}]);
    // what the template renders (trim_blocks, lstrip_blocks), written out by hand
    let rendered = "# system: be brief\n# user: parse\ndef ";
    let req = write_requests(
        d.path(),
        "chat.jsonl",
        &[
            json!({"messages": msgs, "continuation": "main():"}),
            json!({"context": rendered, "continuation": "main():"}),
            json!({"messages": msgs, "max_tokens": 5, "top_logprobs": 2}),
            json!({"context": rendered, "max_tokens": 5, "top_logprobs": 2}),
        ],
    );
    let (code, out, err) = run(&[
        "score",
        chat.to_str().unwrap(),
        "--requests",
        req.to_str().unwrap(),
        "--backend",
        "cpu",
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    let r: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(r.len(), 4);
    assert_eq!(r[0], r[1], "a conversation scores as its rendered text");
    assert_eq!(r[2], r[3]);
    assert_eq!(u32s(&r[2]["tokens"]).len(), 5);
    // the bundle without a template: the messages line is refused by name, exit 2
    let (code, out, err) = run(&[
        "score",
        bundle().to_str().unwrap(),
        "--requests",
        req.to_str().unwrap(),
        "--backend",
        "cpu",
        "--quiet",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(out.is_empty());
    let last = last_line(&err);
    assert!(
        last.contains("chat.jsonl:1: messages needs the bundle's chat template"),
        "{err}"
    );
}

#[test]
fn perplexity_is_the_rolling_loglikelihood_in_windows() {
    let d = tempfile::tempdir().unwrap();
    let text = "import os\nimport sys\n\ndef main(argv):\n    for a in argv:\n        print(a)\n";
    let file = d.path().join("t.py");
    fs::write(&file, text).unwrap();
    let tok = tokenizers::Tokenizer::from_file(fixture().join("tokenizer.json")).unwrap();
    let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
    let b = bundle();
    let ppl = |extra: &[&str]| -> Value {
        let mut args = vec![
            "perplexity",
            b.to_str().unwrap(),
            file.to_str().unwrap(),
            "--backend",
            "cpu",
            "--json",
            "--quiet",
        ];
        args.extend_from_slice(extra);
        let (code, out, err) = run(&args);
        assert_eq!(code, 0, "{err}");
        serde_json::from_str(out.trim()).unwrap()
    };
    // one window: the rolling request's log-likelihood, negated, bit for bit
    let whole = ppl(&[]);
    assert_eq!(whole["tokens"], json!(ids.len()));
    assert_eq!(whole["scored_tokens"], json!(ids.len() - 1));
    let req = write_requests(d.path(), "r.jsonl", &[json!({"rolling": ids})]);
    let rolling = &score(&req, &[])[0];
    let mut nll = 0f64;
    for lp in f64s(&rolling["token_logprobs"]) {
        nll -= lp;
    }
    assert_eq!(whole["nll"].as_f64().unwrap().to_bits(), nll.to_bits());
    let mean = nll / (ids.len() - 1) as f64;
    assert_eq!(
        whole["mean_nll"].as_f64().unwrap().to_bits(),
        mean.to_bits()
    );
    assert!((whole["perplexity"].as_f64().unwrap() - mean.exp()).abs() < 1e-9 * mean.exp());

    // windows of 8: each a fresh sequence starting at the token the last one ended on, scoring
    // the 8 after it -- loglikelihood requests of those pieces, summed in order
    let w = 8;
    let pieces: Vec<Value> = (0..ids.len() - 1)
        .step_by(w)
        .map(|s| {
            let e = (s + w).min(ids.len() - 1);
            json!({"context": [ids[s]], "continuation": ids[s + 1..e + 1]})
        })
        .collect();
    let req = write_requests(d.path(), "w.jsonl", &pieces);
    let mut nll = 0f64;
    for r in score(&req, &["--max-batch", "3"]) {
        for lp in f64s(&r["token_logprobs"]) {
            nll -= lp;
        }
    }
    let windowed = ppl(&["--context", "8", "--max-batch", "2"]);
    assert_eq!(windowed["windows"], json!(pieces.len()));
    assert_eq!(windowed["nll"].as_f64().unwrap().to_bits(), nll.to_bits());
    assert_ne!(windowed["nll"], whole["nll"], "windows see less context");
    // a window longer than the model's positions is refused
    let (code, _, err) = run(&[
        "perplexity",
        b.to_str().unwrap(),
        file.to_str().unwrap(),
        "--context",
        "2049",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(last_line(&err).contains("--context 2049"), "{err}");
}

#[test]
fn bad_lines_are_exit_2_naming_the_line_and_nothing_is_written() {
    let d = tempfile::tempdir().unwrap();
    let b = bundle();
    let good = json!({"context": [1, 2], "continuation": [3]});
    let cases: Vec<(Value, &str)> = vec![
        (
            json!({"context": [1], "continuation": [2], "cntinuation": [3]}),
            "unknown field `cntinuation`",
        ),
        (
            json!({"context": "def f():", "continuation": ""}),
            "continuation is empty",
        ),
        (
            json!({"context": [1], "continuation": []}),
            "continuation is empty",
        ),
        (
            json!({"context": [1], "continuation": [4096]}),
            "token id 4096 is outside the vocabulary of 4096",
        ),
        (
            json!({"context": vec![5; 2000], "continuation": vec![6; 50]}),
            "needs 2049 positions; the model allows 2048",
        ),
        (
            json!({"context": vec![5; 2000], "max_tokens": 50}),
            "needs 2049 positions; the model allows 2048",
        ),
    ];
    for (bad, want) in cases {
        // the bad line is line 3: the two before it are fine, and are not scored either
        let req = write_requests(d.path(), "bad.jsonl", &[good.clone(), good.clone(), bad]);
        let out = d.path().join("out.jsonl");
        let (code, stdout, err) = run(&[
            "score",
            b.to_str().unwrap(),
            "--requests",
            req.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--backend",
            "cpu",
        ]);
        assert_eq!(code, 2, "{err}");
        let msg = last_line(&err);
        assert!(msg.contains(&format!("{}:3: ", req.display())), "{msg}");
        assert!(msg.contains(want), "{msg}");
        assert!(
            !out.exists(),
            "nothing is written before every line is checked"
        );
        assert!(stdout.is_empty());
        // and the model was never loaded
        assert!(!err.contains("backend cpu"), "{err}");
    }
    // --out naming the requests file is refused, and the requests are left whole
    let req = write_requests(d.path(), "same.jsonl", std::slice::from_ref(&good));
    let before = fs::read(&req).unwrap();
    let (code, _, err) = run(&[
        "score",
        b.to_str().unwrap(),
        "--requests",
        req.to_str().unwrap(),
        "--out",
        req.to_str().unwrap(),
        "--backend",
        "cpu",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        last_line(&err).contains("--out is the --requests file"),
        "{err}"
    );
    assert_eq!(
        fs::read(&req).unwrap(),
        before,
        "the requests file is untouched"
    );
    // a blank line in the middle is a bad line too (results match lines one to one)
    let req = d.path().join("blank.jsonl");
    fs::write(&req, format!("{good}\n\n{good}\n")).unwrap();
    let (code, _, err) = run(&[
        "score",
        b.to_str().unwrap(),
        "--requests",
        req.to_str().unwrap(),
    ]);
    assert_eq!(code, 2);
    assert!(last_line(&err).contains(":2: an empty line"), "{err}");
    // a missing requests file
    let (code, _, err) = run(&[
        "score",
        b.to_str().unwrap(),
        "--requests",
        "/nonexistent.jsonl",
    ]);
    assert_eq!(code, 2);
    assert!(last_line(&err).contains("/nonexistent.jsonl"), "{err}");
}

#[test]
fn the_output_file_is_the_same_bytes_for_every_batch_thread_count_and_simd_path() {
    let d = tempfile::tempdir().unwrap();
    let b = bundle();
    let req = write_requests(
        d.path(),
        "mix.jsonl",
        &[
            json!({"context": "def add(a, b):", "continuation": " return a + b", "top_logprobs": 3}),
            json!({"rolling": "import os\nimport sys\nprint(sys.argv)\n"}),
            json!({"context": "class Foo:\n", "max_tokens": 8, "until": ["\n\n"]}),
            json!({"context": [481, 289, 1478], "continuation": [270, 1245], "echo": true}),
            json!({"context": "for i in range(", "max_tokens": 5, "top_logprobs": 2, "echo": true}),
            json!({"rolling": [481, 289, 1478, 270, 1245, 520, 8, 78]}),
            json!({"context": [], "continuation": [481, 289]}),
            json!({"context": "def ", "max_tokens": 6, "temperature": 0.9, "top_p": 0.95, "seed": 11}),
        ],
    );
    let mut files = Vec::new();
    for (name, extra) in [
        ("b1", vec!["--max-batch", "1", "--threads", "2"]),
        ("b3", vec!["--max-batch", "3", "--threads", "2"]),
        ("b32", vec!["--max-batch", "32", "--threads", "2"]),
        ("t1", vec!["--max-batch", "3", "--threads", "1"]),
        (
            "scalar",
            vec!["--max-batch", "3", "--threads", "2", "--kernel", "scalar"],
        ),
    ] {
        let out = d.path().join(format!("{name}.jsonl"));
        let mut args = vec![
            "score",
            b.to_str().unwrap(),
            "--requests",
            req.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--backend",
            "cpu",
            "--json",
        ];
        args.extend(extra);
        let (code, stdout, err) = run(&args);
        assert_eq!(code, 0, "{name}: {err}");
        // the summary is the only thing on stdout when results go to --out
        let summary: Value = serde_json::from_str(stdout.trim()).unwrap();
        assert_eq!(summary["requests"], json!(8), "{name}");
        assert!(summary["tokens"].as_u64().unwrap() > 0);
        files.push((name, fs::read(&out).unwrap()));
    }
    let (_, want) = &files[0];
    assert_eq!(String::from_utf8_lossy(want).lines().count(), 8);
    for (name, got) in &files[1..] {
        assert!(
            got == want,
            "{name}: the output differs from --max-batch 1's"
        );
    }
}

#[test]
fn a_sampled_generation_is_generates_for_the_same_prompt_settings_and_seed() {
    let d = tempfile::tempdir().unwrap();
    let b = bundle();
    let prompt = [481u32, 289, 1478, 270];
    let req = write_requests(
        d.path(),
        "s.jsonl",
        &[
            // the same request twice, on different lines and in the same step: the same text
            json!({"context": prompt, "max_tokens": 10, "temperature": 1.3, "seed": 5}),
            json!({"context": prompt, "max_tokens": 10, "temperature": 1.3, "seed": 5}),
            json!({"context": prompt, "max_tokens": 10}),
        ],
    );
    let r = score(&req, &["--max-batch", "3"]);
    assert_eq!(r[0], r[1]);
    let sampled = u32s(&r[0]["tokens"]);
    let summary = d.path().join("summary.json");
    let ids = prompt.map(|t| t.to_string()).join(",");
    let (code, _, err) = run(&[
        "generate",
        b.to_str().unwrap(),
        "--tokens",
        &ids,
        "--max-new-tokens",
        "10",
        "--temperature",
        "1.3",
        "--seed",
        "5",
        "--backend",
        "cpu",
        "--summary-json",
        summary.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let s: Value = serde_json::from_slice(&fs::read(&summary).unwrap()).unwrap();
    let gen = u32s(&s["tokens"]);
    // generate stops at EOS; score does too (finish_reason eos), with the EOS in its tokens
    assert_eq!(sampled, gen);
    assert_ne!(
        sampled,
        u32s(&r[2]["tokens"]),
        "a temperature of 1.3 changes the tokens"
    );
    // a sampled token's log-prob is still the model's own (not the tempered distribution's)
    let again = write_requests(
        d.path(),
        "lp.jsonl",
        &[json!({"context": prompt, "continuation": sampled})],
    );
    assert_eq!(
        score(&again, &[])[0]["token_logprobs"],
        r[0]["token_logprobs"]
    );
}

#[test]
fn score_speculate_ngram_gives_the_plain_results_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let quoting =
        "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(";
    let reqs = write_requests(
        dir.path(),
        "gen.jsonl",
        &[
            json!({"context": quoting, "max_tokens": 20, "top_logprobs": 2}),
            json!({"context": quoting, "max_tokens": 20, "until": ["b\n"]}),
            json!({"context": "import os\nimport os\nimport", "max_tokens": 7, "temperature": 0.8, "seed": 2}),
            json!({"context": "x = 1", "max_tokens": 5, "echo": true}),
        ],
    );
    let b = bundle();
    let args = |extra: &[&'static str]| {
        let mut v = vec![
            "score".to_string(),
            b.to_str().unwrap().to_string(),
            "--requests".into(),
            reqs.to_str().unwrap().to_string(),
            "--backend".into(),
            "cpu".into(),
            "--max-batch".into(),
            "3".into(),
            "--json".into(),
        ];
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let call = |extra: &[&'static str]| {
        let a = args(extra);
        let a: Vec<&str> = a.iter().map(|s| s.as_str()).collect();
        let (code, out, err) = run(&a);
        assert_eq!(code, 0, "{err}");
        (out, err)
    };
    let (want, _) = call(&[]);
    assert_eq!(want.lines().count(), 4, "{want}");
    let mut accepted = 0;
    for k in ["1", "4", "8"] {
        let k: &'static str = k;
        let (got, err) = call(&["--speculate", "ngram", "--draft-tokens", k]);
        assert_eq!(got, want, "--draft-tokens {k}");
        let summary: Value = serde_json::from_str(last_line(&err)).unwrap();
        let s = &summary["speculate"];
        assert!(s["drafted"].as_u64().unwrap() > 0, "{summary}");
        accepted += s["accepted"].as_u64().unwrap();
    }
    assert!(accepted > 0, "the quoting context has drafts accepted");
}
