//! `tarfa-run demo`: the embedded default. Converts and verifies the small model that ships in
//! the repository (a Qwen3-MoE that transformers trained on Python source, with its tokenizer),
//! then generates from it, showing each step. Needs nothing downloaded.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use tarfa_run::bundle::BundleSource;

use super::generate::{self, BackendArg, GenerateArgs, KernelArg};
use super::CliError;

/// Where the demo model lives in the repository this binary was built from.
const REPO_DEMO_MODEL: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../fixtures/oracle/qwen3moe-code"
);

#[derive(Args, Debug, Clone)]
pub struct DemoArgs {
    /// Convert and verify again even if a verified bundle is cached.
    #[arg(long)]
    pub fresh: bool,
    /// The prompt.
    #[arg(long, default_value = "def fibonacci(n):\n")]
    pub prompt: String,
    #[arg(long, default_value_t = 96)]
    pub max_new_tokens: usize,
    /// Keep generating past EOS.
    #[arg(long)]
    pub ignore_eos: bool,
    /// The source checkpoint (default: $TARFA_DEMO_MODEL, else the repository's demo model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Where the converted bundle is cached (default: $TARFA_CACHE_DIR, $XDG_CACHE_HOME/tarfa or
    /// ~/.cache/tarfa).
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    #[arg(long)]
    pub threads: Option<usize>,
    /// Write timings and the generated token ids (JSON).
    #[arg(long)]
    pub summary_json: Option<PathBuf>,
}

pub fn cache_root(explicit: Option<&Path>) -> PathBuf {
    if let Some(p) = explicit {
        return p.to_path_buf();
    }
    if let Some(p) = std::env::var_os("TARFA_CACHE_DIR") {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(p).join("tarfa");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("tarfa")
}

pub fn run(a: &DemoArgs) -> Result<(), CliError> {
    let model = a
        .model
        .clone()
        .or_else(|| std::env::var_os("TARFA_DEMO_MODEL").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(REPO_DEMO_MODEL));
    if !model.join("config.json").is_file() {
        return Err(CliError::Usage(format!(
            "{}: the demo model is not there; pass --model DIR (a Hugging Face checkpoint) or set TARFA_DEMO_MODEL",
            model.display()
        )));
    }
    let bundle = cache_root(a.cache_dir.as_deref()).join("demo-qwen3moe-code");

    eprintln!("[1/3] convert  {} -> {}", model.display(), bundle.display());
    let cached = !a.fresh && BundleSource::open(&bundle, None).is_ok();
    if cached {
        eprintln!("      reusing the bundle converted earlier (--fresh converts again)");
    } else {
        let t = Instant::now();
        let s = tarfa_convert::convert(
            &model,
            &bundle,
            &tarfa_convert::ConvertOptions { force: true },
        )?;
        eprintln!(
            "      {:.1} MB copied and hashed, read back from disk and verified in {:.2} s",
            s.data_bytes as f64 / 1e6,
            t.elapsed().as_secs_f64()
        );
    }

    eprintln!("[2/3] verify   every tensor and expert against manifest.toml");
    let t = Instant::now();
    let source = BundleSource::open(&bundle, None)?;
    let bytes = source.verify_all()?;
    let (tensors, experts) = source.counts();
    eprintln!(
        "      {tensors} tensors and {experts} experts ({:.1} MB) match; root digest {} ({:.2} s)",
        bytes as f64 / 1e6,
        source.root_digest(),
        t.elapsed().as_secs_f64()
    );
    drop(source);

    eprintln!("[3/3] generate greedy, exact f32, prompt {:?}", a.prompt);
    eprintln!("----");
    print!("{}", a.prompt);
    let g = GenerateArgs {
        bundle,
        prompt: Some(a.prompt.clone()),
        tokens: None,
        max_new_tokens: a.max_new_tokens,
        threads: a.threads,
        kernel: KernelArg::Auto,
        backend: BackendArg::Auto,
        logits_out: None,
        prefill_logits: false,
        ignore_eos: a.ignore_eos,
        expect_root: None,
        router_trace: None,
        verify_report: None,
        summary_json: a.summary_json.clone(),
        preload: false,
        quiet: false,
        stream: Default::default(),
        invalid_bf16_before_lm_head: false,
    };
    generate::run(&g)?;
    Ok(())
}
