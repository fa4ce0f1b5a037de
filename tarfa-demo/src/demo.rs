//! `tarfa-demo`: the embedded default. Converts and verifies the small model that ships in
//! the repository (a Qwen3-MoE that transformers trained on Python source, with its tokenizer),
//! then generates from it, showing each step. Needs nothing downloaded.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use sha2::{Digest, Sha256};
use tarfa_run::bundle::BundleSource;
use tarfa_run::cli::generate::{self, BackendArg, GenerateArgs, KernelArg};
use tarfa_run::cli::{cache_root, threads_arg, CliError};

/// The demo's failure: the conversion's, or the runtime command's, each with its own exit code.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(transparent)]
    Convert(#[from] tarfa_convert::ConvertError),
    #[error(transparent)]
    Cli(#[from] CliError),
}

impl From<tarfa_run::bundle::BundleError> for DemoError {
    fn from(e: tarfa_run::bundle::BundleError) -> Self {
        DemoError::Cli(e.into())
    }
}

impl DemoError {
    /// 0 success; 1 verification failure; 2 bad input or usage; 3 runtime or environment.
    pub fn exit_code(&self) -> i32 {
        match self {
            DemoError::Convert(e) => e.exit_code(),
            DemoError::Cli(e) => e.exit_code(),
        }
    }
}

/// Where the demo model lives in a Tarfa checkout, relative to its root.
const DEMO_MODEL_IN_REPO: &str = "fixtures/oracle/qwen3moe-code";

/// Where the demo model lived in the repository this binary was built from (the last place
/// looked: the clone may have moved since).
const BUILD_TIME_DEMO_MODEL: &str = concat!(
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
    /// The source checkpoint (default: $TARFA_DEMO_MODEL, else fixtures/oracle/qwen3moe-code in
    /// the checkpoint above the binary, else above the current directory, else where it was at
    /// build time).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Where the converted bundle is cached (default: $TARFA_CACHE_DIR, $XDG_CACHE_HOME/tarfa or
    /// ~/.cache/tarfa).
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// Worker threads: 1 to 1024, or 0 for one per core (the default).
    #[arg(long, value_parser = threads_arg)]
    pub threads: Option<usize>,
    /// Write timings and the generated token ids (JSON).
    #[arg(long)]
    pub summary_json: Option<PathBuf>,
}

/// The demo model: `DEMO_MODEL_IN_REPO` under the nearest ancestor of `exe`'s directory that
/// holds it (a checkout's `target/release/tarfa-demo`, wherever the checkout now is), else under
/// the nearest ancestor of `cwd`, else `build_time`. The error says where it looked.
pub fn find_demo_model(
    exe: Option<&Path>,
    cwd: Option<&Path>,
    build_time: &Path,
) -> Result<PathBuf, String> {
    let holds = |dir: &Path| dir.join("config.json").is_file();
    let mut looked = Vec::new();
    let starts = [exe.and_then(Path::parent), cwd];
    for start in starts.into_iter().flatten() {
        for dir in start.ancestors() {
            let candidate = dir.join(DEMO_MODEL_IN_REPO);
            if holds(&candidate) {
                return Ok(candidate);
            }
        }
        looked.push(format!(
            "{DEMO_MODEL_IN_REPO} in every directory above {}",
            start.display()
        ));
    }
    if holds(build_time) {
        return Ok(build_time.to_path_buf());
    }
    looked.push(build_time.display().to_string());
    Err(format!(
        "the demo model is not in {}; pass --model DIR (a Hugging Face checkpoint) or set \
         TARFA_DEMO_MODEL",
        looked.join(", nor in ")
    ))
}

/// The source checkpoint's identity, the key of its cached bundle: SHA-256 over the converter's
/// version and, for every file in `dir` (sorted by name, links followed), its name, size and
/// SHA-256. Another model, or the same one changed, gets another bundle; the same bytes moved
/// elsewhere reuse theirs.
pub fn source_key(dir: &Path) -> Result<String, CliError> {
    let mut names: Vec<(String, PathBuf)> = std::fs::read_dir(dir)
        .map_err(CliError::io(dir, "list the demo model"))?
        .filter_map(|e| e.ok())
        .filter(|e| std::fs::metadata(e.path()).is_ok_and(|m| m.is_file()))
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .collect();
    names.sort();
    let mut key = Sha256::new();
    key.update(tarfa_convert::convert::converter_id().as_bytes());
    key.update([0]);
    let mut buf = vec![0u8; 1 << 20];
    for (name, path) in names {
        let mut f = std::fs::File::open(&path).map_err(CliError::io(&path, "hash"))?;
        let mut file = Sha256::new();
        let mut size = 0u64;
        loop {
            let n = f.read(&mut buf).map_err(CliError::io(&path, "hash"))?;
            if n == 0 {
                break;
            }
            size += n as u64;
            file.update(&buf[..n]);
        }
        key.update(name.as_bytes());
        key.update([0]);
        key.update(size.to_le_bytes());
        key.update(file.finalize());
    }
    Ok(key
        .finalize()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect())
}

pub fn run(a: &DemoArgs) -> Result<(), DemoError> {
    let model = match a
        .model
        .clone()
        .or_else(|| std::env::var_os("TARFA_DEMO_MODEL").map(PathBuf::from))
    {
        Some(m) => m,
        None => find_demo_model(
            std::env::current_exe().ok().as_deref(),
            std::env::current_dir().ok().as_deref(),
            Path::new(BUILD_TIME_DEMO_MODEL),
        )
        .map_err(CliError::Usage)?,
    };
    if !model.join("config.json").is_file() {
        return Err(DemoError::Cli(CliError::Usage(format!(
            "{}: the demo model is not there; pass --model DIR (a Hugging Face checkpoint) or set TARFA_DEMO_MODEL",
            model.display()
        ))));
    }
    // Keyed by the source's bytes: `demo --model B` after `demo` converts B.
    let bundle = cache_root(a.cache_dir.as_deref()).join(format!("demo-{}", source_key(&model)?));

    eprintln!("[1/3] convert  {} -> {}", model.display(), bundle.display());
    let cached = !a.fresh && BundleSource::open(&bundle, None).is_ok();
    if cached {
        eprintln!("      reusing the bundle converted earlier (--fresh converts again)");
    } else {
        let t = Instant::now();
        let s = tarfa_convert::convert(
            &model,
            &bundle,
            &tarfa_convert::ConvertOptions {
                force: true,
                ..Default::default()
            },
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
        prompt_file: None,
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
        cuda: Default::default(),
        invalid_bf16_before_lm_head: false,
        // Greedy, plain text: the flags' defaults.
        chat: false,
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
        seed: 0,
        stop: Vec::new(),
        // Plain decoding, as `generate`'s defaults.
        spec: Default::default(),
    };
    generate::run(&g)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model_at(root: &Path) -> PathBuf {
        let m = root.join(DEMO_MODEL_IN_REPO);
        std::fs::create_dir_all(&m).unwrap();
        std::fs::write(m.join("config.json"), "{}").unwrap();
        m
    }

    #[test]
    fn the_demo_model_is_found_above_the_binary_then_the_cwd_then_at_build_time() {
        let d = tempfile::tempdir().unwrap();
        let checkout = d.path().join("moved-clone");
        let exe = checkout.join("target/release/tarfa-demo");
        std::fs::create_dir_all(exe.parent().unwrap()).unwrap();
        let elsewhere = d.path().join("elsewhere/deep/dir");
        std::fs::create_dir_all(&elsewhere).unwrap();
        let built = d.path().join("built");
        let gone = d.path().join("gone/fixtures/oracle/qwen3moe-code");

        // Nothing anywhere: the error names every place looked.
        let err = find_demo_model(Some(&exe), Some(&elsewhere), &gone).unwrap_err();
        assert!(
            err.contains(&exe.parent().unwrap().display().to_string()),
            "{err}"
        );
        assert!(err.contains(&elsewhere.display().to_string()), "{err}");
        assert!(err.contains(&gone.display().to_string()), "{err}");
        assert!(err.contains("--model"), "{err}");

        // The build-time path, when it is all there is.
        let at_build = model_at(&built);
        assert_eq!(
            find_demo_model(Some(&exe), Some(&elsewhere), &at_build).unwrap(),
            at_build
        );
        // An ancestor of the current directory comes before the build-time path.
        let above_cwd = model_at(&d.path().join("elsewhere"));
        assert_eq!(
            find_demo_model(Some(&exe), Some(&elsewhere), &at_build).unwrap(),
            above_cwd
        );
        // The checkout holding the binary comes first.
        let above_exe = model_at(&checkout);
        assert_eq!(
            find_demo_model(Some(&exe), Some(&elsewhere), &at_build).unwrap(),
            above_exe
        );
        assert_eq!(find_demo_model(None, None, &at_build).unwrap(), at_build);
    }

    #[test]
    fn the_cache_key_follows_the_source_bytes_not_its_name() {
        let d = tempfile::tempdir().unwrap();
        let a = d.path().join("a");
        let b = d.path().join("b");
        for dir in [&a, &b] {
            std::fs::create_dir(dir).unwrap();
            std::fs::write(dir.join("config.json"), "{}").unwrap();
            std::fs::write(dir.join("model.safetensors"), [1u8, 2, 3]).unwrap();
        }
        let ka = source_key(&a).unwrap();
        assert_eq!(ka.len(), 16);
        assert_eq!(ka, source_key(&b).unwrap(), "same bytes, same bundle");
        std::fs::write(b.join("model.safetensors"), [1u8, 2, 4]).unwrap();
        assert_ne!(ka, source_key(&b).unwrap(), "a changed shard");
        std::fs::write(b.join("model.safetensors"), [1u8, 2, 3]).unwrap();
        std::fs::write(b.join("tokenizer.json"), "{}").unwrap();
        assert_ne!(ka, source_key(&b).unwrap(), "another file");
    }
}
