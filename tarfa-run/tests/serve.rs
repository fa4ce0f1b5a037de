//! `tarfa-run serve` end to end on the converted qwen3moe-code fixture (it has a tokenizer): the
//! real binary on a free loopback port, a minimal HTTP/1.1 client over std's TcpStream (the
//! server's HTTP is axum's; the test only needs `Connection: close` requests). Completions with
//! echo + logprobs equal `tarfa-run score`'s numbers bit for bit, alone and under concurrent
//! load; streaming yields the non-streaming tokens and text; bad input is 400 with an OpenAI
//! error body; the queue limit is 429 with Retry-After; --api-key is 401 without the token; a
//! disconnected stream's sequence is freed; SIGTERM drains and exits 0. A departed client's
//! request (queued or running, streaming or not) is cancelled, and one past its deadline is 504
//! (a stream: an error event), both counted in /metrics by reason, with every other answer
//! exact; /metrics names the bundle's root digest and counts refusals and verification checks.

use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_tarfa-run");
const FIXTURE: &str = "qwen3moe-code";

fn bundle() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("serve-bundles");
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        let out = d.join(FIXTURE);
        let src = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures/oracle")
            .join(FIXTURE);
        tarfa_convert::convert(&src, &out, &Default::default()).unwrap();
        out
    })
    .clone()
}

/// A running server, killed when dropped.
struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(extra: &[&str]) -> Server {
        let b = bundle();
        let mut c = Command::new(BIN);
        c.args([
            "serve",
            b.to_str().unwrap(),
            "--port",
            "0",
            "--backend",
            "cpu",
        ])
        .args(["--threads", "2", "--quiet"])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
        let mut child = c.spawn().unwrap();
        let mut err = BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        let t0 = Instant::now();
        let addr = loop {
            line.clear();
            if err.read_line(&mut line).unwrap() == 0 || t0.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                panic!("the server did not start: {line}");
            }
            if let Some(a) = line.trim().strip_prefix("listening on http://") {
                break a.to_string();
            }
        };
        // keep draining stderr so the server never blocks on it
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            assert!(!s.contains("panicked"), "the server panicked: {s}");
        });
        Server { child, addr }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Reply {
    status: u16,
    head: String,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

/// Decodes a chunked body.
fn dechunk(mut b: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = b.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap();
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        b = &rest[n + 2..];
    }
    out
}

fn http(addr: &str, method: &str, path: &str, body: &str, headers: &[&str]) -> Reply {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let extra: String = headers.iter().map(|h| format!("{h}\r\n")).collect();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: \
         application/json\r\nContent-Length: {}\r\n{extra}\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("a response head");
    let status = head[9..12].parse().unwrap();
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    Reply {
        status,
        head: head.to_string(),
        body,
    }
}

/// The value of the sample `series` (a metric name with its labels, as printed) in /metrics.
fn metric(addr: &str, series: &str, headers: &[&str]) -> u64 {
    let m = http(addr, "GET", "/metrics", "", headers);
    assert_eq!(m.status, 200, "{}", m.body);
    m.body
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {series} in\n{}", m.body))
        .parse()
        .unwrap()
}

/// Polls /metrics until `series` reads `want` (the scheduler sets its counters between steps).
fn await_metric(addr: &str, series: &str, want: u64) {
    let t0 = Instant::now();
    loop {
        let v = metric(addr, series, &[]);
        if v == want {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{series} is {v}, waited for {want}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends a request and returns the open connection without reading the answer.
fn send(addr: &str, path: &str, body: &Value, headers: &[&str]) -> TcpStream {
    let body = body.to_string();
    let extra: String = headers.iter().map(|h| format!("{h}\r\n")).collect();
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

fn post(addr: &str, path: &str, body: &Value) -> Reply {
    http(addr, "POST", path, &body.to_string(), &[])
}

fn f64_bits(v: &Value) -> Vec<Option<u64>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().map(f64::to_bits))
        .collect()
}

/// `tarfa-run score` on `lines`; the results.
fn score(lines: &[Value]) -> Vec<Value> {
    let dir = tempfile::tempdir().unwrap();
    let req = dir.path().join("r.jsonl");
    fs::write(
        &req,
        lines.iter().map(|l| format!("{l}\n")).collect::<String>(),
    )
    .unwrap();
    let b = bundle();
    let out = Command::new(BIN)
        .args([
            "score",
            b.to_str().unwrap(),
            "--requests",
            req.to_str().unwrap(),
        ])
        .args(["--backend", "cpu", "--quiet"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

const PROMPT: [u32; 6] = [17, 256, 1000, 33, 7, 2048];

#[test]
fn completions_equal_score_bit_for_bit_alone_and_under_load_and_stream_equals_non_stream() {
    let srv = Server::start(&["--max-batch", "4"]);
    // lm-eval's loglikelihood request: echo, max_tokens 0, logprobs 1
    let ll = json!({"prompt": PROMPT, "max_tokens": 0, "echo": true, "logprobs": 1});
    let gen = json!({"prompt": PROMPT, "max_tokens": 3, "logprobs": 2});
    let r = post(&srv.addr, "/v1/completions", &ll);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r
        .head
        .to_ascii_lowercase()
        .contains("x-tarfa-root-digest: "));
    let lj = r.json();
    assert_eq!(lj["tarfa"]["contract_version"], json!(1));
    let g = post(&srv.addr, "/v1/completions", &gen).json();
    let want = score(&[
        json!({"context": PROMPT[..1], "continuation": PROMPT[1..], "top_logprobs": 1}),
        json!({"context": PROMPT, "max_tokens": 3, "top_logprobs": 2}),
    ]);
    let lp = &lj["choices"][0]["logprobs"];
    assert_eq!(lp["token_ids"], json!(PROMPT));
    assert_eq!(lp["token_logprobs"][0], Value::Null);
    let tail = json!(lp["token_logprobs"].as_array().unwrap()[1..]);
    assert_eq!(f64_bits(&tail), f64_bits(&want[0]["token_logprobs"]));
    let top_ids: Vec<Value> = want[0]["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            json!(t
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p[0].clone())
                .collect::<Vec<_>>())
        })
        .collect();
    assert_eq!(
        json!(lp["top_token_ids"].as_array().unwrap()[1..]),
        json!(top_ids)
    );
    // lm-eval's local-completions form (max_tokens 1, temperature 0, a seed, a batch of token
    // lists): its echoed log-probs are the same bits
    let lm = json!({"prompt": [PROMPT], "max_tokens": 1, "echo": true, "logprobs": 1,
                    "temperature": 0, "seed": 1234, "model": "qwen3moe-code"});
    let r = post(&srv.addr, "/v1/completions", &lm);
    assert_eq!(r.status, 200, "{}", r.body);
    let e = &r.json()["choices"][0]["logprobs"]["token_logprobs"];
    let echoed = json!(e.as_array().unwrap()[1..PROMPT.len()]);
    assert_eq!(f64_bits(&echoed), f64_bits(&want[0]["token_logprobs"]));
    let gl = &g["choices"][0]["logprobs"];
    assert_eq!(gl["token_ids"], want[1]["tokens"]);
    assert_eq!(
        f64_bits(&gl["token_logprobs"]),
        f64_bits(&want[1]["token_logprobs"])
    );
    assert_eq!(g["choices"][0]["text"], want[1]["text"]);

    // under load: 8 clients at once, every answer the same bits as alone
    let answers: Vec<Value> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..8)
            .map(|i| {
                let (addr, body) = (&srv.addr, if i % 2 == 0 { &ll } else { &gen });
                s.spawn(move || post(addr, "/v1/completions", body).json())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, a) in answers.iter().enumerate() {
        let alone = if i % 2 == 0 { &lj } else { &g };
        assert_eq!(a["choices"], alone["choices"], "client {i}");
    }

    // streaming: the same tokens, and the deltas join into the same text
    let mut sg = gen.clone();
    sg["stream"] = json!(true);
    let r = post(&srv.addr, "/v1/completions", &sg);
    assert_eq!(r.status, 200, "{}", r.body);
    let mut ids = Vec::new();
    let mut text = String::new();
    let mut done = false;
    for line in r.body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line == "[DONE]" {
            done = true;
            continue;
        }
        let c: Value = serde_json::from_str(line).unwrap();
        ids.push(c["choices"][0]["logprobs"]["token_ids"][0].clone());
        text.push_str(c["choices"][0]["text"].as_str().unwrap());
    }
    assert!(done, "{}", r.body);
    assert_eq!(json!(ids), gl["token_ids"]);
    assert_eq!(json!(text), g["choices"][0]["text"]);

    // the gauges are set after each step, just after the step's results went out
    let t0 = Instant::now();
    let m = loop {
        let m = http(&srv.addr, "GET", "/metrics", "", &[]);
        if m.body.contains("tarfa_running_sequences 0") || t0.elapsed() > Duration::from_secs(5) {
            break m;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(m.body.contains("tarfa_running_sequences 0"), "{}", m.body);
    assert!(m.body.contains("tarfa_request_latency_seconds_count"));
    let models = http(&srv.addr, "GET", "/v1/models", "", &[]).json();
    let id = models["data"][0]["id"].as_str().unwrap();
    assert!(id.starts_with("qwen3moe-code@"), "{id}");
    // what the server verifies about itself: the root digest it names is the one every
    // response carries, and the reader's checks ran (the root at open; the files, tensors and
    // the experts the requests were routed to, on their reads)
    let root = id.rsplit('@').next().unwrap();
    assert!(
        m.body.lines().any(|l| l
            == format!(
                "tarfa_bundle_info{{name=\"qwen3moe-code\",root_digest=\"{root}\",\
                 contract_version=\"1\"}} 1"
            )),
        "{}",
        m.body
    );
    assert!(m.body.contains("\ntarfa_contract_version 1\n"));
    let checks = |what: &str| {
        metric(
            &srv.addr,
            &format!("tarfa_verification_checks_total{{what=\"{what}\"}}"),
            &[],
        )
    };
    assert_eq!(checks("root_digest"), 1);
    assert!(checks("file") >= 2, "config.json and tokenizer.json");
    assert!(checks("tensor") >= 1);
    assert!(checks("expert") >= 1);
    // 1 + 1 + 1 alone, 8 under load, 1 stream
    assert_eq!(metric(&srv.addr, "tarfa_requests_total", &[]), 12);
    for reason in ["disconnect", "deadline"] {
        let c = format!("tarfa_requests_cancelled_total{{reason=\"{reason}\"}}");
        assert_eq!(metric(&srv.addr, &c, &[]), 0, "{c}");
    }
    // the tokenizer endpoints lm-eval's tokenizer_backend=remote uses: /tokenize gives the ids
    // a text prompt is encoded to, /detokenize gives the text back
    let text = "def f(x):\n    return x";
    let t = post(&srv.addr, "/tokenize", &json!({"prompt": text})).json();
    let echo = json!({"prompt": text, "max_tokens": 0, "echo": true});
    let c = post(&srv.addr, "/v1/completions", &echo).json();
    assert_eq!(t["tokens"], c["choices"][0]["logprobs"]["token_ids"]);
    assert!(t["tokens"].as_array().unwrap().len() > 3);
    let d = post(&srv.addr, "/detokenize", &json!({"tokens": t["tokens"]})).json();
    assert_eq!(d["prompt"], json!(text));
    let info = http(&srv.addr, "GET", "/tokenizer_info", "", &[]).json();
    assert!(info["eos_token"].is_string(), "{info}");
    let r = post(&srv.addr, "/detokenize", &json!({"tokens": [4096]}));
    assert_eq!(r.status, 400, "{}", r.body);
}

#[test]
fn bad_input_is_400_with_an_openai_error_the_key_is_required_and_the_queue_is_bounded() {
    let srv = Server::start(&[
        "--max-batch",
        "1",
        "--max-queue",
        "0",
        "--api-key",
        "sekrit",
    ]);
    let auth = "Authorization: Bearer sekrit";
    assert_eq!(http(&srv.addr, "GET", "/health", "", &[]).status, 200);
    let r = http(&srv.addr, "GET", "/v1/models", "", &[]);
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["type"], json!("authentication_error"));
    assert_eq!(
        http(&srv.addr, "GET", "/v1/models", "", &[auth]).status,
        200
    );
    let bad = |body: &str, needle: &str| {
        let r = http(&srv.addr, "POST", "/v1/completions", body, &[auth]);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        let m = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(m.contains(needle), "{body}: {m}");
    };
    bad("{\"prompt\": [1, 2", "request body");
    bad(
        r#"{"prompt": [1, 2], "colour": 1}"#,
        "unknown field `colour`",
    );
    bad(r#"{"prompt": [1, 4096]}"#, "outside the vocabulary of 4096");
    bad(
        r#"{"prompt": [1, 2], "max_tokens": 5000}"#,
        "the model's context is 2048",
    );
    bad(r#"{"prompt": [1, 2], "n": 0}"#, "n must be 1 to");
    bad(r#"{"prompt": [1, 2], "temperature": -1}"#, "temperature");
    let r = http(
        &srv.addr,
        "POST",
        "/v1/chat/completions",
        r#"{"messages": []}"#,
        &[auth],
    );
    assert_eq!(r.status, 400, "{}", r.body);

    // one long generation holds the only slot; with no queue the next is 429
    let long = json!({"prompt": PROMPT, "max_tokens": 200, "stream": true}).to_string();
    let mut s = TcpStream::connect(&srv.addr).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{long}",
        long.len()
    )
    .unwrap();
    let mut first = [0u8; 64];
    let _ = s.read(&mut first).unwrap();
    let r = http(
        &srv.addr,
        "POST",
        "/v1/completions",
        r#"{"prompt": [1, 2]}"#,
        &[auth],
    );
    assert_eq!(r.status, 429, "{}", r.body);
    assert!(
        r.head.to_ascii_lowercase().contains("retry-after: "),
        "{}",
        r.head
    );
    // every refusal counted once, by reason (the 429s below are polled: at least one)
    let refused = |reason: &str| {
        let r = format!("tarfa_requests_refused_total{{reason=\"{reason}\"}}");
        metric(&srv.addr, &r, &[auth])
    };
    assert_eq!(refused("unauthorized"), 1);
    assert_eq!(refused("too_long"), 1);
    assert_eq!(refused("bad_input"), 6);
    assert_eq!(refused("queue_full"), 1);
    assert_eq!(refused("shutting_down"), 0);
    // the client goes away: its sequence is freed at the next step, and the slot serves again
    drop(s);
    let t0 = Instant::now();
    loop {
        let r = http(
            &srv.addr,
            "POST",
            "/v1/completions",
            r#"{"prompt": [1, 2], "max_tokens": 1}"#,
            &[auth],
        );
        if r.status == 200 {
            break;
        }
        assert_eq!(r.status, 429);
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the disconnected request was not freed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn sigterm_drains_and_exits_0_and_a_port_in_use_is_exit_3() {
    let mut srv = Server::start(&[]);
    let b = bundle();
    let out = Command::new(BIN)
        .args([
            "serve",
            b.to_str().unwrap(),
            "--backend",
            "cpu",
            "--quiet",
            "--port",
        ])
        .arg(srv.addr.rsplit(':').next().unwrap())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("cannot listen on {}", srv.addr)),
        "{err}"
    );
    // a request in flight when SIGTERM arrives still gets its answer
    let addr = srv.addr.clone();
    let h = std::thread::spawn(move || {
        post(
            &addr,
            "/v1/completions",
            &json!({"prompt": PROMPT, "max_tokens": 20}),
        )
    });
    std::thread::sleep(Duration::from_millis(300));
    unsafe { libc::kill(srv.child.id() as i32, libc::SIGTERM) };
    let r = h.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["choices"][0]["logprobs"], Value::Null);
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = srv.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0));
}

#[test]
fn load_64_concurrent_clients_every_answer_equals_the_request_alone() {
    let srv = Server::start(&["--max-batch", "16", "--max-queue", "256"]);
    // four distinct requests (different prompts and lengths), each answered alone first
    let bodies: Vec<Value> = (0..4u32)
        .map(|i| {
            let prompt: Vec<u32> = PROMPT.iter().map(|t| (t + 97 * i) % 4096).collect();
            json!({"prompt": prompt, "max_tokens": 2 + i, "logprobs": 1})
        })
        .collect();
    let alone: Vec<Value> = bodies
        .iter()
        .map(|b| post(&srv.addr, "/v1/completions", b).json()["choices"].clone())
        .collect();
    let t0 = Instant::now();
    let results: Vec<(usize, Value, Duration, u64)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..64)
            .map(|c| {
                let (addr, bodies) = (&srv.addr, &bodies);
                s.spawn(move || {
                    (0..2)
                        .map(|k| {
                            let i = (c + k) % bodies.len();
                            let t = Instant::now();
                            let r = post(addr, "/v1/completions", &bodies[i]);
                            assert_eq!(r.status, 200, "{}", r.body);
                            let j = r.json();
                            let n = j["choices"][0]["logprobs"]["token_ids"]
                                .as_array()
                                .unwrap()
                                .len() as u64;
                            (i, j["choices"].clone(), t.elapsed(), n)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    let wall = t0.elapsed().as_secs_f64();
    for (i, choices, _, _) in &results {
        assert_eq!(choices, &alone[*i], "request {i} under load");
    }
    let mut lat: Vec<f64> = results.iter().map(|r| r.2.as_secs_f64()).collect();
    lat.sort_by(f64::total_cmp);
    let tokens: u64 = results.iter().map(|r| r.3).sum();
    println!(
        "load: {} requests from 64 clients in {wall:.2} s | p50 {:.3} s | p99 {:.3} s | {:.1} \
         generated tok/s (test profile, CPU)",
        results.len(),
        lat[lat.len() / 2],
        lat[(lat.len() * 99) / 100],
        tokens as f64 / wall
    );
}

#[test]
fn departed_clients_requests_queued_or_running_are_cancelled_and_the_others_are_exact() {
    let srv = Server::start(&["--max-batch", "2", "--max-queue", "1"]);
    let ll = json!({"prompt": PROMPT, "max_tokens": 0, "echo": true, "logprobs": 1});
    let want = post(&srv.addr, "/v1/completions", &ll).json()["choices"].clone();
    let gen = json!({"prompt": PROMPT, "max_tokens": 60, "logprobs": 2});
    let want_gen = post(&srv.addr, "/v1/completions", &gen).json()["choices"].clone();
    let long = json!({"prompt": PROMPT, "max_tokens": 1500});
    // a stream and a plain request hold both slots; a third waits in the queue
    let mut streamed = long.clone();
    streamed["stream"] = json!(true);
    let mut x = send(&srv.addr, "/v1/completions", &streamed, &[]);
    let mut first = [0u8; 64];
    assert!(x.read(&mut first).unwrap() > 0);
    let w = send(&srv.addr, "/v1/completions", &long, &[]);
    await_metric(&srv.addr, "tarfa_running_sequences", 2);
    let y = send(&srv.addr, "/v1/completions", &ll, &[]);
    await_metric(&srv.addr, "tarfa_queue_depth", 1);
    let gone = "tarfa_requests_cancelled_total{reason=\"disconnect\"}";
    // the queued client leaves: its request never runs
    drop(y);
    await_metric(&srv.addr, gone, 1);
    await_metric(&srv.addr, "tarfa_queue_depth", 0);
    assert_eq!(metric(&srv.addr, "tarfa_running_sequences", &[]), 2);
    // the running plain request's client leaves, then the stream's
    drop(w);
    await_metric(&srv.addr, gone, 2);
    // a generation takes the freed slot beside the stream, which then leaves too (while the
    // generation runs, unless it is already done: either way its answer is the one alone)
    let addr = srv.addr.as_str();
    let beside = std::thread::scope(|s| {
        let v = s.spawn(|| post(addr, "/v1/completions", &gen));
        drop(x);
        await_metric(addr, gone, 3);
        v.join().unwrap()
    });
    assert_eq!(beside.status, 200, "{}", beside.body);
    assert_eq!(beside.json()["choices"], want_gen);
    await_metric(&srv.addr, "tarfa_running_sequences", 0);
    // none of the three was answered, every slot and queue place is back (max-queue 1: a
    // leaked place would make some of these 429), and the answers are the same bits
    assert_eq!(metric(&srv.addr, "tarfa_requests_total", &[]), 3);
    let answers: Vec<Reply> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|_| s.spawn(|| post(addr, "/v1/completions", &ll)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for a in &answers {
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(a.json()["choices"], want);
    }
    assert_eq!(
        metric(
            &srv.addr,
            "tarfa_requests_cancelled_total{reason=\"deadline\"}",
            &[]
        ),
        0
    );
}

#[test]
fn a_request_past_its_deadline_is_504_a_stream_ends_with_an_error_event_the_others_exact() {
    let srv = Server::start(&["--max-batch", "4", "--request-timeout", "600"]);
    let ll = json!({"prompt": PROMPT, "max_tokens": 0, "echo": true, "logprobs": 1});
    let gen = json!({"prompt": PROMPT, "max_tokens": 4, "logprobs": 1});
    let want_ll = post(&srv.addr, "/v1/completions", &ll).json()["choices"].clone();
    let want_gen = post(&srv.addr, "/v1/completions", &gen).json()["choices"].clone();
    // a deadline of 0 s has passed when the scheduler first looks (before any step): the
    // request is cancelled, whatever the timing, while the others share the same steps
    let due = "x-tarfa-timeout: 0";
    let mut streamed = gen.clone();
    streamed["stream"] = json!(true);
    let addr = srv.addr.as_str();
    let (gen_text, streamed_text) = (gen.to_string(), streamed.to_string());
    let (others, late, late_stream) = std::thread::scope(|s| {
        let others: Vec<_> = (0..4)
            .map(|i| {
                let b = if i % 2 == 0 { &ll } else { &gen };
                s.spawn(move || post(addr, "/v1/completions", b))
            })
            .collect();
        let late = s.spawn(|| http(addr, "POST", "/v1/completions", &gen_text, &[due]));
        let late_stream = s.spawn(|| http(addr, "POST", "/v1/completions", &streamed_text, &[due]));
        (
            others
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>(),
            late.join().unwrap(),
            late_stream.join().unwrap(),
        )
    });
    assert_eq!(late.status, 504, "{}", late.body);
    let e = &late.json()["error"];
    assert_eq!(e["code"], json!("deadline_exceeded"));
    assert_eq!(e["type"], json!("timeout_error"));
    assert!(e["message"].as_str().unwrap().contains("deadline of 0 s"));
    assert_eq!(late_stream.status, 200, "{}", late_stream.body);
    let events: Vec<&str> = late_stream
        .body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.len(), 2, "{}", late_stream.body);
    let err: Value = serde_json::from_str(events[0]).unwrap();
    assert_eq!(err["error"]["code"], json!("deadline_exceeded"));
    assert_eq!(events[1], "[DONE]");
    for (i, a) in others.iter().enumerate() {
        assert_eq!(a.status, 200, "{}", a.body);
        let want = if i % 2 == 0 { &want_ll } else { &want_gen };
        assert_eq!(&a.json()["choices"], want, "client {i}");
    }
    let expired = "tarfa_requests_cancelled_total{reason=\"deadline\"}";
    assert_eq!(metric(&srv.addr, expired, &[]), 2);
    // a longer deadline than the server's is not granted, a malformed one is refused
    let r = http(
        &srv.addr,
        "POST",
        "/v1/completions",
        &gen.to_string(),
        &["x-tarfa-timeout: 1e12"],
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let r = http(
        &srv.addr,
        "POST",
        "/v1/completions",
        &gen.to_string(),
        &["x-tarfa-timeout: 9000"],
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["choices"], want_gen);
    assert_eq!(
        metric(
            &srv.addr,
            "tarfa_requests_refused_total{reason=\"bad_input\"}",
            &[]
        ),
        1
    );
}

#[test]
fn request_timeout_must_be_a_positive_number_of_seconds() {
    let b = bundle();
    for bad in ["0", "-1", "soon", "nan", "2e9"] {
        let out = Command::new(BIN)
            .args(["serve", b.to_str().unwrap()])
            .arg(format!("--request-timeout={bad}"))
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--request-timeout"), "{bad}: {err}");
    }
}

#[test]
fn speculate_ngram_answers_are_the_plain_answers_streamed_or_not() {
    speculated_answers_are_the_plain_answers(&["--speculate", "ngram", "--draft-tokens", "4"]);
}

#[test]
fn a_draft_model_s_answers_are_the_plain_answers_streamed_or_not() {
    // The model as its own draft (the draft's own sequences and cache beside the model's).
    let b = bundle();
    speculated_answers_are_the_plain_answers(&[
        "--speculate",
        "model",
        "--draft-bundle",
        b.to_str().unwrap(),
        "--draft-tokens",
        "3",
    ]);
}

fn speculated_answers_are_the_plain_answers(spec: &[&str]) {
    // A prompt that quotes itself (drafts accepted), greedy and sampled, with a stop string.
    let quoting =
        "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(";
    let srv = Server::start(&[&["--max-batch", "3"][..], spec].concat());
    let reqs = [
        json!({"prompt": quoting, "max_tokens": 16, "logprobs": 2}),
        json!({"prompt": quoting, "max_tokens": 16, "stop": ["with"], "logprobs": 1}),
        json!({"prompt": quoting, "max_tokens": 9, "temperature": 0.8, "seed": 5, "logprobs": 1}),
    ];
    let want = score(&[
        json!({"context": quoting, "max_tokens": 16, "top_logprobs": 2}),
        json!({"context": quoting, "max_tokens": 16, "until": ["with"], "top_logprobs": 1}),
        json!({"context": quoting, "max_tokens": 9, "temperature": 0.8, "seed": 5,
               "top_logprobs": 1}),
    ]);
    assert_eq!(want[1]["finish_reason"], json!("stop"), "{}", want[1]);
    for (r, w) in reqs.iter().zip(&want) {
        let a = post(&srv.addr, "/v1/completions", r);
        assert_eq!(a.status, 200, "{}", a.body);
        let a = a.json();
        let lp = &a["choices"][0]["logprobs"];
        assert_eq!(lp["token_ids"], w["tokens"], "{r}");
        assert_eq!(
            f64_bits(&lp["token_logprobs"]),
            f64_bits(&w["token_logprobs"]),
            "{r}"
        );
        assert_eq!(a["choices"][0]["text"], w["text"], "{r}");
        // streamed: one event per token, the deltas joining into the same text
        let mut sr = r.clone();
        sr["stream"] = json!(true);
        let s = post(&srv.addr, "/v1/completions", &sr);
        assert_eq!(s.status, 200, "{}", s.body);
        let mut text = String::new();
        for line in s.body.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if line != "[DONE]" {
                let c: Value = serde_json::from_str(line).unwrap();
                text.push_str(c["choices"][0]["text"].as_str().unwrap());
            }
        }
        assert_eq!(json!(text), w["text"], "{r} streamed");
    }
    // /metrics counts the drafts (as each request finishes, after its answer went out).
    let t0 = Instant::now();
    while metric(&srv.addr, "tarfa_draft_tokens_total", &[]) == 0 {
        assert!(t0.elapsed() < Duration::from_secs(60), "no drafts counted");
        std::thread::sleep(Duration::from_millis(20));
    }
    let accepted = metric(&srv.addr, "tarfa_draft_tokens_accepted_total", &[]);
    assert!(accepted > 0, "the quoting prompt has drafts accepted");
    assert!(accepted <= metric(&srv.addr, "tarfa_draft_tokens_total", &[]));
}
