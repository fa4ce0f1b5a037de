//! `tarfa-run score` and `tarfa-run perplexity`: evaluation requests from JSON Lines (or a text
//! file's rolling log-likelihood), scored by tarfa-score over the engine. Thin: parse, load, call
//! tarfa-score, write.

use std::fs::{File, OpenOptions};
use std::io::{IsTerminal, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;
use tarfa_engine::{LoadOptions, Model};
use tarfa_score::{Decoding, Limits, Options, Progress, Request, ScoreError, ScoreOptions};

use crate::bundle::BundleSource;
use crate::config::MoeConfig;
use crate::weights::WeightSource;

use super::generate::{chat_template, eos_ids, kernel, BackendArg, KernelArg};
use super::output::OutputRules;
use super::speculate::{SpeculateArg, SpeculateArgs};
use super::stream::{StreamArgs, StreamRun};
use super::{threads_arg, CliError};

/// The most requests in flight at once.
pub const MAX_BATCH: usize = 4096;
/// The largest requests file (or perplexity text) read.
const MAX_INPUT_BYTES: u64 = 4 << 30;

fn max_batch_arg(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=MAX_BATCH).contains(&n) => Ok(n),
        _ => Err(format!(
            "expected a number of requests from 1 to {MAX_BATCH}"
        )),
    }
}

fn top_logprobs_arg(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n <= tarfa_score::request::MAX_TOP_LOGPROBS => Ok(n),
        _ => Err(format!(
            "expected 0 to {}",
            tarfa_score::request::MAX_TOP_LOGPROBS
        )),
    }
}

/// What `score` and `perplexity` share: the bundle, the engine's settings.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// The bundle directory (made by tarfa-convert).
    pub bundle: PathBuf,
    /// Compute backend. Results are bit-identical for every backend.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    pub backend: BackendArg,
    /// Worker threads: 1 to 1024, or 0 for one per core (the default). Results are
    /// bit-identical for every count.
    #[arg(long, value_parser = threads_arg)]
    pub threads: Option<usize>,
    /// SIMD path. Results are bit-identical for every path.
    #[arg(long, value_enum, default_value_t = KernelArg::Auto)]
    pub kernel: KernelArg,
    /// Requests (perplexity: windows) in flight at once, 1 to 4096; each engine step runs one
    /// chunk of each. Results are byte-identical for every value.
    #[arg(long, default_value_t = 8, value_parser = max_batch_arg)]
    pub max_batch: usize,
    /// Refuse any bundle whose root digest differs.
    #[arg(long)]
    pub expect_root: Option<String>,
    /// The summary as one JSON object on stdout (score: on stderr when results go to stdout).
    #[arg(long)]
    pub json: bool,
    /// No progress bar, no log lines.
    #[arg(long)]
    pub quiet: bool,
    #[command(flatten)]
    pub stream: StreamArgs,
    #[command(flatten)]
    pub cuda: super::tuning::CudaArgs,
}

#[derive(Args, Debug, Clone)]
pub struct ScoreArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The requests, one JSON object per line: {"context", "continuation"} (loglikelihood),
    /// {"rolling"} or {"context", "max_tokens", "until"} (generate_until); text or token-id
    /// lists; "messages" ([{"role", "content"}], rendered with the bundle's chat template) in
    /// place of "context"; "top_logprobs" and "echo" per request. Every line is checked before the model is
    /// loaded: a bad line is exit 2 naming it, and nothing is computed or written.
    #[arg(long, value_name = "FILE")]
    pub requests: PathBuf,
    /// Write the results here (else stdout), one line per request in order. Written
    /// incrementally, not atomically: each result is written and flushed as soon as it and every
    /// earlier one are done, so a run that fails or is interrupted keeps every result it finished
    /// (whole lines: the first N requests' results; rerun the rest). A failed write is exit 3.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Default top_logprobs of every request (0 to 100): the k best alternatives at each scored
    /// or generated position.
    #[arg(long, default_value_t = 0, value_parser = top_logprobs_arg)]
    pub top_logprobs: usize,
    /// Default echo of every request: also the log-probs of the context's tokens.
    #[arg(long)]
    pub echo: bool,
    /// generate_until's speculative decoding (every result line is the bytes of `off`).
    #[command(flatten)]
    pub spec: SpeculateArgs,
}

#[derive(Args, Debug, Clone)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The text (UTF-8), encoded with the bundle's tokenizer without special tokens.
    pub file: PathBuf,
    /// Window length in positions (default and at most: max_position_embeddings). The text is
    /// scored in disjoint windows of this many tokens, each from an empty cache (lm-eval's
    /// loglikelihood_rolling); every token but the first is scored once.
    #[arg(long)]
    pub context: Option<usize>,
}

/// The bundle opened, its config, tokenizer and EOS ids (everything a request is checked
/// against, before any weight is loaded).
pub(crate) struct Opened {
    pub(crate) source: Arc<BundleSource>,
    pub(crate) cfg: MoeConfig,
    pub(crate) tokenizer: Option<tokenizers::Tokenizer>,
    pub(crate) eos: Vec<u32>,
}

pub(crate) fn open(a: &ModelArgs, log: &dyn Fn(String)) -> Result<Opened, CliError> {
    let super::OpenedBundle {
        source,
        cfg,
        tokenizer,
        ..
    } = super::open_bundle(&a.bundle, a.expect_root.as_deref(), log)?;
    let eos = eos_ids(&source, &cfg, a.quiet)?;
    Ok(Opened {
        source,
        cfg,
        tokenizer,
        eos,
    })
}

pub(crate) fn load(
    a: &ModelArgs,
    o: &Opened,
    log: &dyn Fn(String),
) -> Result<(Model, StreamRun), CliError> {
    let streamed = super::stream::open(
        &a.stream,
        o.source.clone(),
        &o.cfg,
        o.cfg.max_position_embeddings,
        a.quiet,
        log,
    )?;
    let load = LoadOptions {
        backend: a.backend.into(),
        threads: a.threads.unwrap_or(0),
        kernel: kernel(a.kernel)?,
        hot: streamed.hot_options(),
        cuda: a.cuda.tuning(),
    };
    let model = Model::load(
        o.cfg.clone(),
        streamed.source.clone() as Arc<dyn WeightSource>,
        &load,
        log,
    )?;
    Ok((model, streamed))
}

/// Accepted over drafted (0 when nothing was drafted).
fn acceptance(drafted: u64, accepted: u64) -> f64 {
    if drafted == 0 {
        0.0
    } else {
        accepted as f64 / drafted as f64
    }
}

/// `--draft-bundle`'s model for `--speculate model` (score, serve), on the model's backend and
/// threads: checked against the model's vocabulary and tokenizer before either is loaded.
pub(crate) fn load_draft_for(
    a: &ModelArgs,
    spec: &SpeculateArgs,
    mode: SpeculateArg,
    o: &Opened,
    log: &dyn Fn(String),
) -> Result<Option<Model>, CliError> {
    let (SpeculateArg::Model, Some(path)) = (mode, &spec.draft_bundle) else {
        return Ok(None);
    };
    let load = LoadOptions {
        backend: a.backend.into(),
        threads: a.threads.unwrap_or(0),
        kernel: kernel(a.kernel)?,
        hot: None,
        cuda: a.cuda.tuning(),
    };
    let d = super::speculate::load_draft(path, &a.bundle, &o.cfg, &o.source, &load, log)?;
    Ok(Some(d.model))
}

/// Every line of the requests file, checked and encoded.
fn read_requests(a: &ScoreArgs, o: &Opened) -> Result<Vec<Request>, CliError> {
    let path = &a.requests;
    let bytes = super::read_input(path, "--requests", MAX_INPUT_BYTES)?;
    // A template that cannot be used fails only the requests that need it.
    let chat = chat_template(&o.source, &a.model.bundle, "messages").map_err(|e| e.to_string());
    let limits = Limits {
        vocab_size: o.cfg.vocab_size,
        max_positions: o.cfg.max_position_embeddings,
        eos: &o.eos,
        tokenizer: o.tokenizer.as_ref(),
        chat: match &chat {
            Ok(t) => Ok(t.as_ref()),
            Err(why) => Err(why.as_str()),
        },
    };
    let defaults = Options {
        top_logprobs: a.top_logprobs,
        echo: a.echo,
    };
    // a final newline ends the last line; it does not start an empty one
    let body = bytes.strip_suffix(b"\n").unwrap_or(&bytes);
    if body.is_empty() {
        return Err(CliError::Usage(format!(
            "{}: --requests: no requests",
            path.display()
        )));
    }
    let mut requests = Vec::new();
    for (i, line) in body.split(|&b| b == b'\n').enumerate() {
        let line_no = i + 1;
        let text = std::str::from_utf8(line).map_err(|e| {
            CliError::Usage(format!(
                "{}:{line_no}: not UTF-8 (invalid byte at column {})",
                path.display(),
                e.valid_up_to() + 1
            ))
        })?;
        let text = text.strip_suffix('\r').unwrap_or(text);
        let r = tarfa_score::parse_line(line_no, text, defaults, &limits).map_err(|e| {
            CliError::Usage(format!("{}:{}: {}", path.display(), e.line, e.problem))
        })?;
        requests.push(r);
    }
    Ok(requests)
}

/// `--out`: written line by line, each line one `write_all` then flushed (a `File` is not
/// buffered), so the file always holds whole results of the first requests. A write that fails
/// part way is cut back to the last whole line.
struct Incremental {
    path: PathBuf,
    file: File,
    len: u64,
}

impl Incremental {
    fn create(rules: &OutputRules, path: &Path) -> Result<Incremental, CliError> {
        rules.check(path, "--out")?;
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(path)
            .map_err(CliError::io(path, "--out"))?;
        let m = file.metadata().map_err(CliError::io(path, "--out"))?;
        if !m.is_file() {
            return Err(CliError::Usage(format!(
                "{}: --out: not a regular file",
                path.display()
            )));
        }
        Ok(Incremental {
            path: path.to_path_buf(),
            file,
            len: 0,
        })
    }

    fn line(&mut self, line: &str) -> std::io::Result<()> {
        let bytes = format!("{line}\n");
        if let Err(e) = self.file.write_all(bytes.as_bytes()) {
            let _ = self.file.set_len(self.len);
            return Err(e);
        }
        self.len += bytes.len() as u64;
        Ok(())
    }

    fn finish(self) -> Result<(), CliError> {
        self.file
            .sync_all()
            .map_err(CliError::io(&self.path, "--out"))
    }
}

fn progress_bar(enabled: bool, total: u64, unit: &str) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    let template = format!("{{bar:30}} {{pos}}/{{len}} {unit} | {{msg}} | ETA {{eta}}");
    if let Ok(style) = ProgressStyle::with_template(&template) {
        bar.set_style(style);
    }
    bar
}

/// What both commands score with: the bundle's decoding, `--max-batch`, and a progress bar of
/// `total` `unit`s (on a terminal, unless --quiet).
fn run_parts<'a>(
    a: &ModelArgs,
    o: &'a Opened,
    total: usize,
    unit: &str,
) -> (Decoding<'a>, ScoreOptions, ProgressBar) {
    let dec = Decoding {
        tokenizer: o.tokenizer.as_ref(),
        eos: &o.eos,
    };
    let opts = ScoreOptions {
        max_batch: a.max_batch,
        ..ScoreOptions::default()
    };
    let bar = progress_bar(
        !a.quiet && std::io::stderr().is_terminal(),
        total as u64,
        unit,
    );
    (dec, opts, bar)
}

fn score_error(e: ScoreError, out: &Path) -> CliError {
    match e {
        ScoreError::Engine { line, source } => CliError::AtLine {
            line,
            source: Box::new(source.into()),
        },
        ScoreError::Step { source } => source.into(),
        ScoreError::Output(source) => CliError::Io {
            path: out.to_path_buf(),
            op: "write",
            source,
        },
        // the CLI's stop never says so (Ctrl-C ends the process)
        ScoreError::Interrupted => CliError::Environment("interrupted".into()),
    }
}

pub fn run(a: &ScoreArgs) -> Result<(), CliError> {
    let quiet = a.model.quiet;
    let log = |s: String| {
        if !quiet {
            eprintln!("{s}");
        }
    };
    let mode = a.spec.mode()?;
    let o = open(&a.model, &log)?;
    // Every line is checked before the model loads and before any output exists.
    let requests = read_requests(a, &o)?;
    // Nothing is written into the model's bundle, nor into the draft model's.
    let mut read: Vec<&Path> = vec![&a.model.bundle];
    read.extend(a.spec.draft_bundle.as_deref());
    let rules = OutputRules::new(&read);
    if let Some(p) = &a.out {
        // the requests are the user's input: never truncated by --out naming them (or a link)
        use std::os::unix::fs::MetadataExt;
        if let (Ok(i), Ok(o)) = (std::fs::metadata(&a.requests), std::fs::metadata(p)) {
            if (i.dev(), i.ino()) == (o.dev(), o.ino()) {
                return Err(CliError::Usage(format!(
                    "{}: --out is the --requests file; write the results elsewhere",
                    p.display()
                )));
            }
        }
    }
    let mut out = match &a.out {
        Some(p) => Some(Incremental::create(&rules, p)?),
        None => None,
    };
    log(format!(
        "{} requests from {}",
        requests.len(),
        a.requests.display()
    ));
    let draft = load_draft_for(&a.model, &a.spec, mode, &o, &log)?;
    let (model, streamed) = load(&a.model, &o, &log)?;
    let (dec, mut opts, bar) = run_parts(&a.model, &o, requests.len(), "requests");
    opts.draft_tokens = a.spec.k(mode);
    let t0 = Instant::now();
    let stdout = std::io::stdout();
    let out_path = a.out.clone().unwrap_or_else(|| PathBuf::from("<stdout>"));
    let result = tarfa_score::score_drafted(
        &model,
        draft.as_ref(),
        &requests,
        &dec,
        &opts,
        &mut |_, r| {
            let line = r.to_json_line();
            match out.as_mut() {
                Some(f) => f.line(&line),
                None => {
                    let mut s = stdout.lock();
                    writeln!(s, "{line}").and_then(|_| s.flush())
                }
            }
        },
        &mut |p: &Progress| {
            bar.set_position(p.requests_done as u64);
            bar.set_message(format!(
                "{:.0} tok/s",
                p.tokens as f64 / t0.elapsed().as_secs_f64()
            ));
        },
        &|| false,
    );
    bar.finish_and_clear();
    let stats = result.map_err(|e| score_error(e, &out_path))?;
    if let Some(f) = out {
        f.finish()?;
    }
    let secs = t0.elapsed().as_secs_f64();
    let summary = json!({
        "requests": stats.requests_done,
        "tokens": stats.tokens,
        "seconds": secs,
        "requests_per_s": stats.requests_done as f64 / secs,
        "tokens_per_s": stats.tokens as f64 / secs,
        "max_batch": a.model.max_batch,
        "backend": model.name(),
        "threads": model.threads(),
        // generate_until's drafts: fed to steps, and accepted (the tokens count them all)
        "speculate": (mode != SpeculateArg::Off).then(|| json!({
            "drafter": mode.name(),
            "draft_tokens": a.spec.draft_tokens,
            "draft_bundle": a.spec.draft_bundle.as_ref().map(|p| p.display().to_string()),
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "acceptance": acceptance(stats.drafted, stats.accepted),
            "draft_model_steps": (mode == SpeculateArg::Model).then_some(stats.draft_steps),
            "draft_model_positions": (mode == SpeculateArg::Model).then_some(stats.draft_positions),
        })),
    });
    streamed.finish(&log);
    if mode != SpeculateArg::Off {
        log(format!(
            "speculate {} k {}: {} drafted, {} accepted ({:.1}%){}",
            mode.name(),
            a.spec.draft_tokens,
            stats.drafted,
            stats.accepted,
            100.0 * acceptance(stats.drafted, stats.accepted),
            if mode == SpeculateArg::Model {
                format!(
                    "; the draft model ran {} steps, {} positions",
                    stats.draft_steps, stats.draft_positions
                )
            } else {
                String::new()
            }
        ));
    }
    if a.model.json {
        if a.out.is_some() {
            println!("{summary}");
        } else {
            eprintln!("{summary}");
        }
    } else {
        log(format!(
            "{} requests, {} tokens in {secs:.2} s | {:.2} requests/s | {:.1} tok/s",
            stats.requests_done,
            stats.tokens,
            stats.requests_done as f64 / secs,
            stats.tokens as f64 / secs
        ));
    }
    Ok(())
}

pub fn perplexity(a: &PerplexityArgs) -> Result<(), CliError> {
    let quiet = a.model.quiet;
    let log = |s: String| {
        if !quiet {
            eprintln!("{s}");
        }
    };
    let o = open(&a.model, &log)?;
    let max = o.cfg.max_position_embeddings;
    let window = a.context.unwrap_or(max);
    if window == 0 || window > max {
        return Err(CliError::Usage(format!(
            "--context {window}: expected 1 to the model's max_position_embeddings, {max}"
        )));
    }
    let bytes = super::read_input(&a.file, "FILE", MAX_INPUT_BYTES)?;
    let text = String::from_utf8(bytes).map_err(|e| {
        CliError::Usage(format!(
            "{}: not UTF-8 (invalid byte at offset {})",
            a.file.display(),
            e.utf8_error().valid_up_to()
        ))
    })?;
    let tok = o.tokenizer.as_ref().ok_or_else(|| {
        CliError::Usage(format!(
            "{}: the bundle has no tokenizer.json",
            a.model.bundle.display()
        ))
    })?;
    let tokens = tok
        .encode(text.as_str(), false)
        .map_err(|e| CliError::Usage(format!("{}: cannot encode: {e}", a.file.display())))?
        .get_ids()
        .to_vec();
    if tokens.len() < 2 {
        return Err(CliError::Usage(format!(
            "{}: {} token(s); perplexity needs at least 2 (the first is never scored)",
            a.file.display(),
            tokens.len()
        )));
    }
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= o.cfg.vocab_size) {
        return Err(CliError::Usage(format!(
            "{}: the tokenizer gave id {t}, outside the vocabulary of {}",
            a.file.display(),
            o.cfg.vocab_size
        )));
    }
    let n_windows = tarfa_score::rolling_windows(&tokens, window, 1).len();
    log(format!(
        "{} tokens, {n_windows} windows of up to {window} positions",
        tokens.len(),
    ));
    let (model, streamed) = load(&a.model, &o, &log)?;
    let (dec, opts, bar) = run_parts(&a.model, &o, n_windows, "windows");
    let t0 = Instant::now();
    let result = tarfa_score::perplexity(&model, &tokens, window, &dec, &opts, &mut |p| {
        bar.set_position(p.requests_done as u64);
        bar.set_message(format!(
            "{:.0} tok/s",
            p.tokens as f64 / t0.elapsed().as_secs_f64()
        ));
    })
    .map_err(|e| score_error(e, &a.file));
    bar.finish_and_clear();
    let (ppl, stats) = result?;
    let (nll, scored, windows) = (ppl.nll, ppl.scored, ppl.windows);
    let secs = t0.elapsed().as_secs_f64();
    let (mean, ppl) = (ppl.mean_nll(), ppl.perplexity());
    streamed.finish(&log);
    let summary = json!({
        "tokens": tokens.len(),
        "scored_tokens": scored,
        "windows": windows,
        "context": window,
        "seconds": secs,
        "tokens_per_s": stats.tokens as f64 / secs,
        "nll": nll,
        "mean_nll": mean,
        "perplexity": ppl,
    });
    if a.model.json {
        println!("{summary}");
    } else {
        println!(
            "{} tokens ({scored} scored, {} windows of {window}) | {:.1} tok/s | mean NLL {mean} | \
             perplexity {ppl}",
            tokens.len(),
            windows,
            stats.tokens as f64 / secs
        );
    }
    Ok(())
}
