//! `tarfa-run serve`: the OpenAI-compatible server (tarfa-serve) on a bundle. Thin: open and load
//! as `score` does, hand the model to tarfa-serve, report where it listens.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use clap::Args;

use super::score::ModelArgs;
use super::speculate::SpeculateArgs;
use super::CliError;

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// The bundle, the engine's settings, and --max-batch: requests in flight at once (each
    /// engine step runs one chunk of each). Answers are bit-identical for every value and load.
    #[command(flatten)]
    pub model: ModelArgs,
    /// The address to bind. Only this machine can connect unless told otherwise.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// The port (0: any free port; the line `listening on http://HOST:PORT` on stderr says which).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Requests that may wait for a slot beyond the --max-batch in flight; more are answered 429
    /// with Retry-After.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health.
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Every request's deadline, in seconds from its arrival (a decimal above 0; default: none).
    /// A request past it is cancelled at the next step, queued or running (its sequence freed;
    /// what shares its steps is unaffected) and answered 504 with error code
    /// `deadline_exceeded` (a stream ends with that error event, then [DONE]). A client may ask
    /// for a shorter deadline with the header `x-tarfa-timeout: SECONDS`, never a longer one.
    #[arg(long, value_name = "SECONDS", value_parser = timeout_arg)]
    pub request_timeout: Option<Duration>,
    /// Speculative decoding of completions (every answer is the bits of `off`).
    #[command(flatten)]
    pub spec: SpeculateArgs,
}

/// The most seconds a deadline may be (about 31 years: beyond it, no deadline is meant).
const MAX_TIMEOUT_SECS: f64 = 1e9;

fn timeout_arg(s: &str) -> Result<Duration, String> {
    match s.parse::<f64>() {
        Ok(x) if x > 0.0 && x <= MAX_TIMEOUT_SECS => Ok(Duration::from_secs_f64(x)),
        _ => Err(format!(
            "expected a number of seconds above 0 and at most {MAX_TIMEOUT_SECS:e} (omit the \
             flag for no deadline)"
        )),
    }
}

fn serve_error(e: tarfa_serve::ServeError) -> CliError {
    match e {
        tarfa_serve::ServeError::Bind { .. } => CliError::Environment(e.to_string()),
        tarfa_serve::ServeError::Io(_) => CliError::Environment(e.to_string()),
        tarfa_serve::ServeError::SchedulerPanicked => CliError::Environment(e.to_string()),
    }
}

/// The bundle reader's own record of what it verified (the `--verify-report` ledger: every read
/// of a copied file, tensor or expert, each checked against the manifest before use), as counts.
fn verification_probe(
    source: std::sync::Arc<crate::bundle::BundleSource>,
) -> tarfa_serve::VerificationProbe {
    Box::new(move || {
        let r = source.report();
        let reads = |v: &[crate::bundle::VerifiedEntry]| v.iter().map(|e| e.reads).sum();
        tarfa_serve::Verified {
            root_digest: u64::from(r.root_recomputed),
            files: reads(&r.files),
            tensors: reads(&r.tensors),
            experts: reads(&r.experts),
        }
    })
}

pub fn run(a: &ServeArgs) -> Result<(), CliError> {
    let quiet = a.model.quiet;
    let log = |s: String| {
        if !quiet {
            eprintln!("{s}");
        }
    };
    if a.api_key.as_deref() == Some("") {
        return Err(CliError::Usage("--api-key: an empty key".into()));
    }
    let mode = a.spec.mode()?;
    let o = super::score::open(&a.model, &log)?;
    let chat_template =
        super::generate::chat_template(&o.source, &a.model.bundle, "chat completions")?;
    let draft = super::score::load_draft_for(&a.model, &a.spec, mode, &o, &log)?;
    let (model, streamed) = super::score::load(&a.model, &o, &log)?;
    let name = a
        .model
        .bundle
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| a.model.bundle.display().to_string());
    let cfg = tarfa_serve::ServeConfig {
        name,
        root_digest: o.source.root_digest().to_string(),
        max_batch: a.model.max_batch,
        max_queue: a.max_queue,
        draft_tokens: a.spec.k(mode),
        api_key: a.api_key.clone(),
        vocab_size: o.cfg.vocab_size,
        max_positions: o.cfg.max_position_embeddings,
        eos: o.eos.clone(),
        tokenizer: o.tokenizer.clone(),
        chat_template,
        request_timeout: a.request_timeout,
        verification: Some(verification_probe(o.source.clone())),
    };
    let addr = SocketAddr::new(a.host, a.port);
    // the one line a script waits for: printed even with --quiet
    tarfa_serve::serve_drafted(model, draft, cfg, addr, &|bound| {
        eprintln!("listening on http://{bound}")
    })
    .map_err(serve_error)?;
    streamed.finish(&log);
    log("drained; stopped".into());
    Ok(())
}
