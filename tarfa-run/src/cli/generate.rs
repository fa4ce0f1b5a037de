//! `tarfa-run generate`: generation from a verified bundle, greedy unless sampling is asked for
//! (docs/EXACTNESS.md section 8), from a prompt that `--chat` may render with the bundle's chat
//! template, until EOS, a stop string or `--max-new-tokens`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::bundle::BundleSource;
use crate::config::MoeConfig;
use crate::cpu::{FinalHidden, ForwardOptions, LogitRows, RouterRecord, StepStats};
use crate::generate::{self, Choice, Flow, Keep, Observer, Step};
use crate::numerics::Kernel;
use crate::weights::WeightSource;
use clap::{ArgGroup, Args, ValueEnum};
use serde_json::json;
use tarfa_core::chat::{ChatMessage, ChatTemplate};
use tarfa_core::sampling::SamplingParams;
use tarfa_core::speculate::{run_speculative, ModelDrafter, NgramDrafter, SpecStats};
use tarfa_core::stop::StopStrings;

use tarfa_engine::{Engine, LoadOptions};
use tarfa_score::text::TextSoFar;

use super::output::{write_logits, OutputRules, RouterTrace};
use super::speculate::load_draft;
use super::stream::{StreamArgs, StreamRun};
use super::{peak_rss_bytes, threads_arg, CliError};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum KernelArg {
    /// The fastest path this CPU supports.
    Auto,
    /// Portable scalar code (the reference).
    Scalar,
    Avx2,
    Avx512,
}

pub use super::speculate::{SpeculateArg, SpeculateArgs};

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum BackendArg {
    /// CUDA when a usable GPU is present, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

/// The most bytes `--prompt-file` reads (a prompt is at most `max_position_embeddings` tokens).
const MAX_PROMPT_FILE_BYTES: u64 = 64 << 20;

#[derive(Args, Debug, Clone)]
#[command(group(ArgGroup::new("input").required(true).args(["prompt", "prompt_file", "tokens"])))]
pub struct GenerateArgs {
    /// The bundle directory (made by tarfa-convert).
    pub bundle: PathBuf,
    /// Prompt text, encoded with the bundle's tokenizer.json.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Prompt text read from a file (`-`: standard input), byte for byte (trailing newlines
    /// kept); it must be UTF-8.
    #[arg(long, value_name = "PATH")]
    pub prompt_file: Option<PathBuf>,
    /// Prompt token ids, comma-separated (for bundles without a tokenizer, and for audits).
    #[arg(long, value_delimiter = ',')]
    pub tokens: Option<Vec<u64>>,
    /// Tokens to generate. The prompt plus these, less one (the last token is never fed back),
    /// must fit in the config's max_position_embeddings (else exit 2).
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// Worker threads: 1 to 1024, or 0 for one per core (the default). Results are
    /// bit-identical for every count.
    #[arg(long, value_parser = threads_arg)]
    pub threads: Option<usize>,
    /// SIMD path. Results are bit-identical for every path.
    #[arg(long, value_enum, default_value_t = KernelArg::Auto)]
    pub kernel: KernelArg,
    /// Compute backend. Results are bit-identical for every backend.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    pub backend: BackendArg,
    /// Write the generated tokens and the logits that chose them (safetensors).
    #[arg(long)]
    pub logits_out: Option<PathBuf>,
    /// Also write the logits of every prompt position into --logits-out.
    #[arg(long, requires = "logits_out")]
    pub prefill_logits: bool,
    /// Keep generating past EOS (oracle comparisons and benchmarks).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Refuse any bundle whose root digest differs.
    #[arg(long)]
    pub expect_root: Option<String>,
    /// Write the router's choices per layer and token (JSON Lines). Not with --speculate (the
    /// trace would hold rejected positions).
    #[arg(long, conflicts_with_all = ["speculate", "draft_bundle"])]
    pub router_trace: Option<PathBuf>,
    /// Write what was verified before use (JSON).
    #[arg(long)]
    pub verify_report: Option<PathBuf>,
    /// Write timings and counts (JSON).
    #[arg(long)]
    pub summary_json: Option<PathBuf>,
    /// Read and verify every expert before the first step. Without it an expert is verified
    /// when first read, so a corrupted expert the prompt never routes to goes unnoticed.
    #[arg(long)]
    pub preload: bool,
    /// Print nothing but the generated text (no progress, no summary line).
    #[arg(long)]
    pub quiet: bool,
    /// The prompt becomes one user message rendered with the bundle's chat template
    /// (chat_template.jinja, else tokenizer_config.json's chat_template), the assistant's turn
    /// opened; the rendered text is encoded without adding special tokens (the template has them).
    #[arg(long, conflicts_with = "tokens")]
    pub chat: bool,
    /// Sampling temperature; 0 (the default) is greedy. Sampling is exact: the same seed gives
    /// the same tokens on every backend and thread count (docs/EXACTNESS.md section 8).
    #[arg(
        long,
        allow_negative_numbers = true,
        default_value_t = 0.0,
        value_name = "T"
    )]
    pub temperature: f32,
    /// Sample from the K largest logits only (0: all).
    #[arg(
        long,
        allow_negative_numbers = true,
        default_value_t = 0,
        value_name = "K"
    )]
    pub top_k: usize,
    /// Sample from the most probable tokens whose mass reaches P (in (0, 1]; 1: all).
    #[arg(
        long,
        allow_negative_numbers = true,
        default_value_t = 1.0,
        value_name = "P"
    )]
    pub top_p: f64,
    /// Drop tokens less probable than P times the most probable (in [0, 1]; 0: none).
    #[arg(
        long,
        allow_negative_numbers = true,
        default_value_t = 0.0,
        value_name = "P"
    )]
    pub min_p: f64,
    /// transformers' repetition penalty on every token of the prompt and the output (> 0; 1: none).
    #[arg(
        long,
        allow_negative_numbers = true,
        default_value_t = 1.0,
        value_name = "R"
    )]
    pub repetition_penalty: f32,
    /// Subtracted from a logit per earlier occurrence of its token (in [-2, 2]).
    #[arg(
        long,
        allow_negative_numbers = true,
        default_value_t = 0.0,
        value_name = "F"
    )]
    pub frequency_penalty: f32,
    /// Subtracted from a logit whose token occurred before (in [-2, 2]).
    #[arg(
        long,
        allow_negative_numbers = true,
        default_value_t = 0.0,
        value_name = "Q"
    )]
    pub presence_penalty: f32,
    /// The sampler's seed (Philox4x32-10's key).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop when the generated text contains STR (repeatable); the text printed ends before it.
    /// Needs the bundle's tokenizer.json.
    #[arg(long = "stop", value_name = "STR")]
    pub stop: Vec<String>,
    #[command(flatten)]
    pub spec: SpeculateArgs,
    #[command(flatten)]
    pub stream: StreamArgs,
    #[command(flatten)]
    pub cuda: super::tuning::CudaArgs,
    /// INVALID, for validation only: round the final hidden state to BF16 before the lm_head.
    /// The validation suite uses it to show its f32 check can tell the difference.
    #[arg(long, hide = true)]
    pub invalid_bf16_before_lm_head: bool,
}

pub(crate) fn kernel(k: KernelArg) -> Result<Kernel, CliError> {
    use crate::numerics::SimdPath;
    let path = match k {
        KernelArg::Auto => return Ok(Kernel::best()),
        KernelArg::Scalar => SimdPath::Scalar,
        KernelArg::Avx2 => SimdPath::Avx2,
        KernelArg::Avx512 => SimdPath::Avx512,
    };
    Kernel::new(path).map_err(|e| CliError::Environment(e.to_string()))
}

/// EOS ids: generation_config.json's when present, else config.json's; int or list. Ids outside
/// the vocabulary can never be produced: they are dropped with a warning.
pub fn eos_ids(source: &BundleSource, cfg: &MoeConfig, quiet: bool) -> Result<Vec<u32>, CliError> {
    let mut ids = cfg.eos_token_ids.clone();
    if source.has_file("generation_config.json") {
        let bytes = source.read_file("generation_config.json")?;
        let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| {
            CliError::Usage(format!(
                "{}: generation_config.json: {e}",
                source.dir().display()
            ))
        })?;
        match v.get("eos_token_id") {
            Some(serde_json::Value::Number(n)) => ids = n.as_u64().into_iter().collect(),
            Some(serde_json::Value::Array(a)) => {
                ids = a.iter().filter_map(|x| x.as_u64()).collect()
            }
            _ => {}
        }
    }
    let (inside, outside): (Vec<u64>, Vec<u64>) =
        ids.into_iter().partition(|&i| i < cfg.vocab_size as u64);
    for id in outside {
        if !quiet {
            eprintln!(
                "warning: EOS id {id} is outside the vocabulary of {}; ignored",
                cfg.vocab_size
            );
        }
    }
    Ok(inside.into_iter().map(|i| i as u32).collect())
}

/// Incremental detokenisation: prints only what the new token adds, holding back incomplete
/// UTF-8 (a byte-level BPE token can end inside a character). [`TextSoFar`] decodes only the
/// tokens since the text last settled, not all of them: a full decode per token grew to 0.46 ms
/// at 2,048 generated tokens, 2.2 ms at 4,096 (tarfa-score's text.rs).
struct TextStream {
    tok: tokenizers::Tokenizer,
    ids: Vec<u32>,
    text: TextSoFar,
}

impl TextStream {
    fn new(tok: tokenizers::Tokenizer) -> TextStream {
        TextStream {
            text: TextSoFar::new(&tok),
            tok,
            ids: Vec::new(),
        }
    }

    fn push(&mut self, id: u32) -> Option<String> {
        self.ids.push(id);
        let new = self.text.push(&self.tok, &self.ids).ok()?;
        (!new.is_empty()).then_some(new)
    }
}

/// What `generate` does around the decode loop's steps: stream accounting, the router trace,
/// the text (or token ids) on stdout, and the stop at EOS.
struct Hooks<'a> {
    streamed: &'a mut StreamRun,
    trace: Option<RouterTrace>,
    text: Option<TextStream>,
    out: std::io::StdoutLock<'static>,
    eos: &'a [u32],
    /// The stop strings, over the decoded text (with a tokenizer only).
    stop: Option<StopStrings>,
    /// When the prefill step ended (decode time runs from here).
    prefill_done: Option<Instant>,
    /// `--stats`: every speculative decode step's (drafted, accepted), printed as it ends.
    steps: Option<Vec<(usize, usize)>>,
    quiet: bool,
}

impl Observer<Engine> for Hooks<'_> {
    type Error = CliError;

    fn token(&mut self, j: usize, next: u32) -> Result<Flow, CliError> {
        let out = &mut self.out;
        // A closed stdout (a pipe to `head`) ends the stream, not the run.
        match self.text.as_mut() {
            Some(ts) => {
                if let Some(mut s) = ts.push(next) {
                    if let Some(stop) = self.stop.as_mut() {
                        s = stop.push(&s);
                    }
                    let _ = out.write_all(s.as_bytes()).and_then(|_| out.flush());
                }
                if self.stop.as_ref().is_some_and(|s| s.stopped()) {
                    return Ok(Flow::Stop);
                }
            }
            None => {
                let _ = write!(out, "{}{next}", if j == 0 { "" } else { " " })
                    .and_then(|_| out.flush());
            }
        }
        Ok(if self.eos.contains(&next) {
            Flow::Stop
        } else {
            Flow::Continue
        })
    }

    fn before_step(&mut self, engine: &Engine, step: Step, _tokens: usize) {
        self.streamed
            .begin(step == Step::Prefill, engine.hot_stats());
    }

    fn after_step(
        &mut self,
        engine: &Engine,
        step: Step,
        tokens: usize,
        _stats: &StepStats,
        router: &mut Vec<RouterRecord>,
    ) -> Result<(), CliError> {
        self.streamed
            .end(step == Step::Prefill, tokens, engine.hot_stats());
        if step == Step::Prefill {
            self.prefill_done = Some(Instant::now());
        }
        if let Some(t) = self.trace.as_mut() {
            t.records(router)?;
        }
        Ok(())
    }

    fn drafts_verified(&mut self, drafted: usize, accepted: usize) {
        if let Some(steps) = self.steps.as_mut() {
            steps.push((drafted, accepted));
            if !self.quiet {
                eprintln!(
                    "step {}: drafted {drafted}, accepted {accepted}",
                    steps.len()
                );
            }
        }
    }
}

pub fn run(a: &GenerateArgs) -> Result<(), CliError> {
    let log = |s: String| {
        if !a.quiet {
            eprintln!("{s}");
        }
    };
    let super::OpenedBundle {
        source,
        cfg,
        config_json: cfg_text,
        tokenizer,
    } = super::open_bundle(&a.bundle, a.expect_root.as_deref(), &log)?;
    let sampling = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repetition_penalty: a.repetition_penalty,
        frequency_penalty: a.frequency_penalty,
        presence_penalty: a.presence_penalty,
        seed: a.seed,
    };
    sampling
        .validate()
        .map_err(|e| CliError::Usage(format!("--{}: {e}", e.setting().replace('_', "-"))))?;
    let mode = a.spec.mode()?;
    let k = a.spec.k(mode);
    let eos = if a.ignore_eos {
        Vec::new()
    } else {
        eos_ids(&source, &cfg, a.quiet)?
    };

    let file_text = match &a.prompt_file {
        Some(p) => Some(read_prompt_file(p)?),
        None => None,
    };
    if !a.stop.is_empty() && tokenizer.is_none() {
        return Err(CliError::Usage(format!(
            "{}: --stop needs the bundle's tokenizer.json (stop strings match decoded text)",
            a.bundle.display()
        )));
    }
    let prompt: Vec<u32> = match (a.prompt.as_ref().or(file_text.as_ref()), &a.tokens) {
        (Some(text), _) => {
            let tok = tokenizer.as_ref().ok_or_else(|| {
                CliError::Usage(format!(
                    "{}: the bundle has no tokenizer.json; pass --tokens",
                    a.bundle.display()
                ))
            })?;
            // A chat prompt carries its special tokens in the template's text: nothing is added.
            let (text, add_special) = if a.chat {
                (chat_prompt(&source, &a.bundle, text)?, false)
            } else {
                (text.clone(), true)
            };
            tok.encode(text.as_str(), add_special)
                .map_err(|e| CliError::Usage(format!("cannot encode the prompt: {e}")))?
                .get_ids()
                .to_vec()
        }
        (None, Some(ids)) => {
            let mut out = Vec::with_capacity(ids.len());
            for &id in ids {
                if id >= cfg.vocab_size as u64 {
                    return Err(CliError::Usage(format!(
                        "token id {id} is outside the vocabulary of {}",
                        cfg.vocab_size
                    )));
                }
                out.push(id as u32);
            }
            out
        }
        (None, None) => {
            return Err(CliError::Usage(
                "give --prompt, --prompt-file or --tokens".into(),
            ))
        }
    };
    if prompt.is_empty() {
        return Err(CliError::Usage("the prompt is empty".into()));
    }
    let max_pos = cfg.max_position_embeddings;
    if prompt.len() > max_pos {
        return Err(CliError::Usage(format!(
            "the prompt has {} tokens; the model allows {max_pos} positions",
            prompt.len()
        )));
    }
    let max_new = a.max_new_tokens;
    // The last generated token is never fed back: the run computes prompt + max_new - 1
    // positions (what the validation suite's prefill = decode check relies on at the limit).
    let positions = prompt.len().saturating_add(max_new.saturating_sub(1));
    if positions > max_pos {
        return Err(CliError::Usage(format!(
            "the prompt's {} tokens plus --max-new-tokens {max_new} need {positions} positions; \
             the model's max_position_embeddings (config.json) is {max_pos}",
            prompt.len()
        )));
    }
    // Outputs are checked before the model is loaded: a bad path is refused in a moment, not
    // after the run.
    // Nothing is written into the model's bundle, nor into the draft model's.
    let mut read: Vec<&Path> = vec![&a.bundle];
    read.extend(a.spec.draft_bundle.as_deref());
    let rules = OutputRules::new(&read);
    for (path, flag) in [
        (&a.logits_out, "--logits-out"),
        (&a.router_trace, "--router-trace"),
        (&a.verify_report, "--verify-report"),
        (&a.summary_json, "--summary-json"),
    ] {
        if let Some(p) = path {
            rules.check(p, flag)?;
        }
    }

    let vocab = cfg.vocab_size;
    let spec = crate::model::ArchSpec::new(&cfg);
    let moe_layers: Vec<usize> = (0..cfg.num_layers)
        .filter(|&l| spec.moe_index(l).is_some())
        .collect();
    let router_header = json!({
        "kind": "header",
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k,
        "renormalizes": cfg.renormalize_topk,
        // The config's own key (absent for Mixtral, which always renormalises: null).
        "norm_topk_prob": serde_json::from_str::<serde_json::Value>(&cfg_text)
            .ok()
            .and_then(|v| v.get("norm_topk_prob").cloned())
            .unwrap_or(serde_json::Value::Null),
        "moe_layers": moe_layers,
        // The ids the run was given (after tokenisation), which an audit needs to replay it.
        "prompt_tokens": prompt,
    });
    // Experts come through the streaming tiers (unbounded unless a budget says otherwise); the
    // KV cache is accounted for at the whole requested context.
    let mut streamed = super::stream::open(
        &a.stream,
        source.clone(),
        &cfg,
        prompt.len() + max_new,
        a.quiet,
        &log,
    )?;
    let threads = a.threads.unwrap_or(0);
    let load = LoadOptions {
        backend: a.backend.into(),
        threads,
        kernel: kernel(a.kernel)?,
        hot: streamed.hot_options(),
        cuda: a.cuda.tuning(),
    };
    // The draft model first: a draft refused (another tokenizer) costs no load of the model.
    let draft = match (mode, &a.spec.draft_bundle) {
        (SpeculateArg::Model, Some(path)) => {
            Some(load_draft(path, &a.bundle, &cfg, &source, &load, &log)?)
        }
        _ => None,
    };
    let mut engine = Engine::load(
        cfg,
        streamed.source.clone() as Arc<dyn WeightSource>,
        &load,
        &log,
    )?;
    if a.preload {
        streamed.preload()?;
    }
    log(format!("prompt {} tokens", prompt.len()));
    let trace = match &a.router_trace {
        Some(p) => Some(RouterTrace::create(&rules, p, router_header)?),
        None => None,
    };
    let opts = ForwardOptions {
        logits: if a.prefill_logits {
            LogitRows::All
        } else {
            LogitRows::Last
        },
        trace_router: trace.is_some(),
        final_hidden: if a.invalid_bf16_before_lm_head {
            FinalHidden::InvalidBf16BeforeLmHead
        } else {
            FinalHidden::Exact
        },
    };
    // Without --logits-out (or a router trace, or the INVALID arm) a step's logits are only
    // needed for its greedy token: the engine chooses it (CUDA on the GPU, with no logits copied
    // back: the decode step's own speed, docs/PERFORMANCE.md "CUDA decode"), and none are kept.
    let keep = if a.logits_out.is_some() {
        Keep::Logits
    } else {
        Keep::Tokens
    };
    let mut hooks = Hooks {
        streamed: &mut streamed,
        trace,
        text: tokenizer.map(TextStream::new),
        out: std::io::stdout().lock(),
        eos: &eos,
        stop: (!a.stop.is_empty()).then(|| StopStrings::new(&a.stop)),
        prefill_done: None,
        steps: a.stream.stats.then(Vec::new),
        quiet: a.quiet,
    };
    // Greedy settings keep the greedy path (the GPU's token-only step); `generate` is request 0.
    let choice = if sampling.is_greedy() {
        Choice::Greedy
    } else {
        Choice::Sample {
            params: &sampling,
            request: 0,
        }
    };
    let t0 = Instant::now();
    // The draft model's (steps, positions) computed.
    let mut draft_work = None;
    let (g, spec) = match (mode, draft) {
        (SpeculateArg::Off, _) => {
            let g = generate::run_with(
                &mut engine,
                &prompt,
                max_new,
                &opts,
                keep,
                choice,
                &mut hooks,
            )?;
            // Plain decoding's steps, for --stats: one per token after the first.
            let steps = g.tokens.len().saturating_sub(1) as u64;
            let plain = SpecStats {
                steps,
                ..SpecStats::default()
            };
            (g, a.stream.stats.then_some(plain))
        }
        (SpeculateArg::Ngram, _) => {
            let (g, st) = run_speculative(
                &mut engine,
                &prompt,
                max_new,
                &opts,
                keep,
                choice,
                &mut NgramDrafter::default(),
                k,
                &mut hooks,
            )?;
            (g, Some(st))
        }
        (SpeculateArg::Model, d) => {
            let d = d.expect("loaded above for --speculate model");
            let max = d.cfg.max_position_embeddings;
            let seq = d.model.new_sequence()?;
            let mut drafter = ModelDrafter::new(
                Engine {
                    model: d.model,
                    seq,
                },
                max,
            );
            let (g, st) = run_speculative(
                &mut engine,
                &prompt,
                max_new,
                &opts,
                keep,
                choice,
                &mut drafter,
                k,
                &mut hooks,
            )?;
            draft_work = Some((drafter.steps, drafter.positions));
            (g, Some(st))
        }
    };
    // The text a stop string might have begun, when none did.
    if let Some(rest) = hooks.stop.as_mut().map(|s| s.finish()) {
        let _ = hooks.out.write_all(rest.as_bytes());
    }
    let _ = writeln!(hooks.out);
    let prefill_done = hooks.prefill_done.unwrap_or(t0);
    let prefill_time = prefill_done - t0;
    let decode_time = prefill_done.elapsed();
    let Hooks {
        trace,
        out,
        steps: hooks_steps,
        ..
    } = hooks;
    drop(out);
    let tokens = &g.tokens;

    if let Some(t) = trace {
        t.finish()?;
    }
    if let Some(p) = &a.logits_out {
        write_logits(
            &rules,
            p,
            source.root_digest(),
            vocab,
            &prompt,
            tokens,
            &g.step_logits,
            a.prefill_logits.then_some(g.prefill.logits.as_slice()),
        )?;
    }
    if let Some(p) = &a.verify_report {
        rules.write_json(p, "--verify-report", &source.report())?;
    }
    // The first token comes from the prefill logits: decode time covers the other n - 1.
    let decode_steps = tokens.len().saturating_sub(1);
    let prefill_tok_s = prompt.len() as f64 / prefill_time.as_secs_f64();
    let decode_tok_s = if decode_steps > 0 {
        decode_steps as f64 / decode_time.as_secs_f64()
    } else {
        0.0
    };
    let per_step = hooks_steps.map(|v| v.into_iter().map(|(d, a)| [d, a]).collect::<Vec<_>>());
    if let Some(p) = &a.summary_json {
        rules.write_json(
            p,
            "--summary-json",
            &json!({
                "root_digest": source.root_digest(),
                "backend": engine.name(),
                "threads": engine.threads(),
                "prompt_tokens": prompt.len(),
                "generated_tokens": tokens.len(),
                "tokens": tokens,
                "prefill_ms": prefill_time.as_secs_f64() * 1e3,
                "decode_ms": decode_time.as_secs_f64() * 1e3,
                "prefill_tok_s": prefill_tok_s,
                "decode_tok_s": decode_tok_s,
                "prefill_weight_bytes": g.prefill.stats.weight_bytes,
                "decode_weight_bytes_per_token": if decode_steps > 0 { g.decode_weight_bytes / decode_steps as u64 } else { 0 },
                "peak_rss_bytes": peak_rss_bytes(),
                "speculate": spec.map(|st| json!({
                    "drafter": mode.name(),
                    "draft_tokens": k,
                    "draft_bundle": a.spec.draft_bundle.as_ref().map(|p| p.display().to_string()),
                    "decode_steps": st.steps,
                    "drafted": st.drafted,
                    "accepted": st.accepted,
                    "acceptance": st.acceptance(),
                    "tokens_per_step": tokens_per_step(tokens.len(), st.steps),
                    "draft_model_steps": draft_work.map(|w| w.0),
                    "draft_model_positions": draft_work.map(|w| w.1),
                    "per_step": per_step,
                })),
                "stream": streamed.summary(),
            }),
        )?;
    }
    streamed.finish(&log);
    if let Some(st) = spec {
        log(format!(
            "speculate {} k {k}: {} decode steps, {} drafted, {} accepted ({:.1}%), {:.2} tokens \
             per step, decode {:.1} tok/s{}",
            mode.name(),
            st.steps,
            st.drafted,
            st.accepted,
            100.0 * st.acceptance(),
            tokens_per_step(tokens.len(), st.steps),
            decode_tok_s,
            match draft_work {
                Some((steps, positions)) =>
                    format!("; the draft model ran {steps} steps, {positions} positions"),
                None => String::new(),
            }
        ));
    }
    log(format!(
        "{} tokens generated after a {}-token prompt | prefill {:.1} tok/s | decode {:.1} tok/s",
        tokens.len(),
        prompt.len(),
        prefill_tok_s,
        decode_tok_s
    ));
    Ok(())
}

/// Tokens per decode step: the decode steps' tokens (all but the first, which the prefill
/// chose) over the steps.
fn tokens_per_step(tokens: usize, steps: u64) -> f64 {
    if steps == 0 {
        0.0
    } else {
        tokens.saturating_sub(1) as f64 / steps as f64
    }
}

/// The bundle's chat template (`None` when it has none), its files read through the manifest
/// (verified). `what` names the option or request kind that needs it, for messages.
pub fn chat_template(
    source: &BundleSource,
    bundle: &Path,
    what: &str,
) -> Result<Option<ChatTemplate>, CliError> {
    let read = |name: &str| -> Result<Option<String>, CliError> {
        if !source.has_file(name) {
            return Ok(None);
        }
        String::from_utf8(source.read_file(name)?)
            .map(Some)
            .map_err(|_| CliError::Usage(format!("{}: {name} is not UTF-8", bundle.display())))
    };
    let config = read("tokenizer_config.json")?;
    let jinja = read("chat_template.jinja")?;
    ChatTemplate::from_files(config.as_deref(), jinja.as_deref())
        .map_err(|e| CliError::Usage(format!("{}: {what}: {e}", bundle.display())))
}

/// `--chat`: the prompt as one user message in the bundle's chat template, the assistant's turn
/// opened.
fn chat_prompt(source: &BundleSource, bundle: &Path, text: &str) -> Result<String, CliError> {
    let template = chat_template(source, bundle, "--chat")?.ok_or_else(|| {
        CliError::Usage(format!(
            "{}: --chat: the bundle has no chat template (no chat_template.jinja, and no \
             chat_template in tokenizer_config.json)",
            bundle.display()
        ))
    })?;
    template
        .render(&[ChatMessage::new("user", text)], true)
        .map_err(|e| CliError::Usage(format!("{}: --chat: {e}", bundle.display())))
}

/// `--prompt-file`: the file's bytes (standard input for `-`), which must be UTF-8. A pipe or a
/// FIFO is read to its end (that is what `<(cmd)` gives); a directory or device is refused.
fn read_prompt_file(path: &Path) -> Result<String, CliError> {
    let bytes = super::read_input(path, "--prompt-file", MAX_PROMPT_FILE_BYTES)?;
    String::from_utf8(bytes).map_err(|e| {
        let shown = if path == Path::new("-") {
            "<stdin>".to_string()
        } else {
            path.display().to_string()
        };
        CliError::Usage(format!(
            "{shown}: --prompt-file: not UTF-8 (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        ))
    })
}
