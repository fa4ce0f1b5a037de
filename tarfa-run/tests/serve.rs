//! `tarfa-run serve` end to end on the converted qwen3moe-code fixture (it has a tokenizer): the
//! real binary on a free loopback port, a minimal HTTP/1.1 client over std's TcpStream (the
//! server's HTTP is axum's; the test only needs `Connection: close` requests). Completions with
//! echo + logprobs equal `tarfa-run score`'s numbers bit for bit, alone and under concurrent
//! load; streaming yields the non-streaming tokens and text; bad input is 400 with an OpenAI
//! error body; the queue limit is 429 with Retry-After; --api-key is 401 without the token; a
//! disconnected stream's sequence is freed; SIGTERM drains and exits 0.

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
