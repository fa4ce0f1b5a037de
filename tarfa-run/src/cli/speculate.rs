//! The speculative-decoding flags of `generate`, `score` and `serve` (one set, flattened into
//! each), and the draft model `--speculate model` loads. Every mode gives the bytes of `off`
//! (docs/EXACTNESS.md "Speculative decoding"); the mode only changes how many positions a decode
//! step computes.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::{Args, ValueEnum};
use tarfa_core::config::MoeConfig;
use tarfa_core::weights::WeightSource;
use tarfa_engine::{LoadOptions, Model};

use super::CliError;

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum SpeculateArg {
    /// One token per decode step.
    Off,
    /// Prompt lookup: the context's last 3 (else 2) tokens are looked up in the earlier context
    /// and what followed their most recent match is drafted.
    Ngram,
    /// A draft model (--draft-bundle, the same tokenizer): its greedy continuation is drafted.
    Model,
}

impl SpeculateArg {
    /// The drafter's name in summaries.
    pub fn name(self) -> &'static str {
        match self {
            SpeculateArg::Off => "off",
            SpeculateArg::Ngram => "ngram",
            SpeculateArg::Model => "model",
        }
    }
}

/// The default `--speculate` of generate, score and serve: off until GPU figures show
/// speculation faster (docs/PHASE_LOG.md D1..D3). Turning it on is this one line; the tests
/// check that the default and `--no-speculative` give the same bytes.
pub const DEFAULT_SPECULATE: SpeculateArg = SpeculateArg::Off;

/// The most tokens a step may draft: 64 (a larger k only adds rejected positions).
fn draft_tokens_arg(s: &str) -> Result<u16, String> {
    match s.parse::<u16>() {
        Ok(k @ 1..=64) => Ok(k),
        _ => Err("expected a number of tokens from 1 to 64".into()),
    }
}

#[derive(Args, Debug, Clone)]
pub struct SpeculateArgs {
    /// Speculative decoding: draft up to --draft-tokens tokens per decode step and verify them
    /// all in one forward step. Exact: the tokens, logits and text are those of `off`, bit for
    /// bit (docs/EXACTNESS.md "Speculative decoding"); only the speed differs. Off by default
    /// until it is measured faster.
    #[arg(long, value_enum, default_value_t = DEFAULT_SPECULATE)]
    pub speculate: SpeculateArg,
    /// Speculative decoding off, whatever the default (the same as --speculate off).
    #[arg(long, conflicts_with_all = ["speculate", "draft_bundle"])]
    pub no_speculative: bool,
    /// The most tokens drafted per decode step (1 to 64) with --speculate.
    #[arg(long, default_value_t = 4, value_parser = draft_tokens_arg)]
    pub draft_tokens: u16,
    /// The draft model of --speculate model: a bundle with the same tokenizer.json (and
    /// vocabulary) as the model's, verified like it, run greedily on the same backend with its
    /// own cache. A small MoE bundle (the runtime has no dense path), or the model itself.
    #[arg(long, value_name = "PATH")]
    pub draft_bundle: Option<PathBuf>,
}

impl Default for SpeculateArgs {
    /// The flags' defaults.
    fn default() -> Self {
        SpeculateArgs {
            speculate: DEFAULT_SPECULATE,
            no_speculative: false,
            draft_tokens: 4,
            draft_bundle: None,
        }
    }
}

impl SpeculateArgs {
    /// The mode asked for (--no-speculative is off), checked against --draft-bundle: `model`
    /// needs it, the other modes refuse it.
    pub fn mode(&self) -> Result<SpeculateArg, CliError> {
        let mode = if self.no_speculative {
            SpeculateArg::Off
        } else {
            self.speculate
        };
        match (mode, &self.draft_bundle) {
            (SpeculateArg::Model, None) => Err(CliError::Usage(
                "--speculate model needs --draft-bundle PATH (the draft model)".into(),
            )),
            (SpeculateArg::Off | SpeculateArg::Ngram, Some(_)) => Err(CliError::Usage(format!(
                "--draft-bundle is the draft model of --speculate model, not of --speculate {}",
                mode.name()
            ))),
            _ => Ok(mode),
        }
    }

    /// Tokens drafted per step in `mode` (0 when off).
    pub fn k(&self, mode: SpeculateArg) -> usize {
        match mode {
            SpeculateArg::Off => 0,
            SpeculateArg::Ngram | SpeculateArg::Model => self.draft_tokens as usize,
        }
    }
}

/// The draft model, loaded: its bundle's directory and its config (for messages and limits).
pub struct DraftModel {
    pub model: Model,
    pub cfg: MoeConfig,
    pub bundle: PathBuf,
}

/// Opens, checks and loads `--draft-bundle` for a model of `cfg` whose bundle `bundle` has
/// `tokenizer_json` (its bytes; `None` without one). Refused (exit 2) unless the draft has the
/// same vocabulary size and the same tokenizer.json, byte for byte (compared by the manifests'
/// SHA-256, which the bundle reader checks the bytes against): a draft token must mean the
/// token it would mean to the model. Loaded with `load` (the model's backend and threads), its
/// weights resident (no streaming tiers), verified as they are read.
pub fn load_draft(
    draft: &Path,
    bundle: &Path,
    cfg: &MoeConfig,
    target: &crate::bundle::BundleSource,
    load: &LoadOptions,
    log: &dyn Fn(String),
) -> Result<DraftModel, CliError> {
    let opened = super::open_bundle(draft, None, log)?;
    let d = opened.cfg;
    if d.vocab_size != cfg.vocab_size {
        return Err(CliError::Usage(format!(
            "{}: --draft-bundle: a vocabulary of {} tokens; the model's ({}) has {}: the draft \
             model needs the model's tokenizer",
            draft.display(),
            d.vocab_size,
            bundle.display(),
            cfg.vocab_size
        )));
    }
    let digest = |s: &crate::bundle::BundleSource| {
        s.manifest()
            .files
            .iter()
            .find(|f| f.name == "tokenizer.json")
            .map(|f| f.sha256.clone())
    };
    let (mine, theirs) = (digest(target), digest(&opened.source));
    if mine != theirs {
        let show = |h: &Option<String>| match h {
            Some(h) => format!("sha256 {h}"),
            None => "none".to_string(),
        };
        return Err(CliError::Usage(format!(
            "{}: --draft-bundle: its tokenizer.json ({}) is not the model's ({}: {}): the draft \
             model needs the model's tokenizer",
            draft.display(),
            show(&theirs),
            bundle.display(),
            show(&mine)
        )));
    }
    // The bytes themselves, through the reader (checked against that digest again).
    if theirs.is_some() {
        opened.source.read_file("tokenizer.json")?;
    }
    let opts = LoadOptions {
        hot: None,
        ..load.clone()
    };
    log(format!(
        "draft model {}: {} layers, {} experts, top-{}",
        draft.display(),
        d.num_layers,
        d.num_experts,
        d.top_k
    ));
    let model = Model::load(
        d.clone(),
        opened.source.clone() as Arc<dyn WeightSource>,
        &opts,
        log,
    )?;
    Ok(DraftModel {
        model,
        cfg: d,
        bundle: draft.to_path_buf(),
    })
}
