//! The table of invariance arms: every optional feature of the runtime, each as the options that
//! switch it on. Every arm must reproduce the baseline's logits file byte for byte.
//!
//! A new feature is one line in [`ARMS`]: its name, its `tarfa-run generate` options, and what it
//! needs (a flag the runtime's `--help` must list, a CPU feature, a GPU). Arms whose needs are not
//! met are reported as not available, never silently dropped. Arguments may name sizes of the
//! bundle, resolved by [`resolve_arg`]: `{experts}` (bytes of all expert extents), `{expert}`
//! (the largest single extent), each optionally divided or multiplied, `{experts/4}`,
//! `{expert*3}`.

use crate::bundle::Bundle;
use crate::runner::{have_nvidia_smi, Runtime};

/// What an arm needs to be run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// `tarfa-run generate --help` lists this flag.
    Flag(&'static str),
    /// This processor has the feature (`avx2` means AVX2 with FMA, as the runtime requires).
    Cpu(&'static str),
    /// An NVIDIA GPU answers `nvidia-smi -L`.
    Gpu,
}

/// One arm: a named set of options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arm {
    pub name: &'static str,
    pub args: &'static [&'static str],
    pub needs: &'static [Need],
}

const fn arm(name: &'static str, args: &'static [&'static str], needs: &'static [Need]) -> Arm {
    Arm { name, args, needs }
}

/// The reference every arm is compared with: one thread, the scalar kernel, everything else at
/// the runtime's defaults.
pub const BASELINE: Arm = arm("baseline", &["--threads", "1", "--kernel", "scalar"], &[]);

use Need::*;

/// Every arm, in the order they run. One line per feature.
pub const ARMS: &[Arm] = &[
    // Thread counts: work is split across rows, tokens and experts, never inside a reduction.
    // The split does not depend on the kernel, so most thread arms use the fast one; one arm
    // keeps the scalar kernel so the reference path is also run split.
    arm(
        "threads=2 scalar",
        &["--threads", "2", "--kernel", "scalar"],
        &[],
    ),
    arm("threads=2", &["--threads", "2", "--kernel", "auto"], &[]),
    arm("threads=3", &["--threads", "3", "--kernel", "auto"], &[]),
    arm("threads=8", &["--threads", "8", "--kernel", "auto"], &[]),
    // SIMD kernels: the same 256 lanes, in registers.
    arm(
        "kernel=avx2",
        &["--threads", "1", "--kernel", "avx2"],
        &[Cpu("avx2")],
    ),
    arm(
        "kernel=avx512",
        &["--threads", "1", "--kernel", "avx512"],
        &[Cpu("avx512f")],
    ),
    // What a user gets without flags (also a second fresh process of the default path).
    arm("defaults", &[], &[]),
    // Expert residency: every expert read before the first step instead of on first use.
    arm("preload", &["--preload"], &[Flag("--preload")]),
    // Streaming: expert residency under a memory budget, and the read path.
    arm(
        "ram-budget=experts/4",
        &["--ram-budget", "{experts/4}"],
        &[Flag("--ram-budget")],
    ),
    arm(
        "ram-budget=expert*2",
        &["--ram-budget", "{expert*2}"],
        &[Flag("--ram-budget")],
    ),
    arm("io=direct", &["--io", "direct"], &[Flag("--io")]),
    arm("io=cached", &["--io", "cached"], &[Flag("--io")]),
    arm(
        "ram-budget=expert*2 io=direct",
        &["--ram-budget", "{expert*2}", "--io", "direct"],
        &[Flag("--ram-budget")],
    ),
    arm(
        "cache-policy=ledger",
        &["--ram-budget", "{experts/4}", "--cache-policy", "ledger"],
        &[Flag("--cache-policy")],
    ),
    arm(
        "cache-policy=static",
        &["--ram-budget", "{experts/4}", "--cache-policy", "static"],
        &[Flag("--cache-policy")],
    ),
    arm(
        "cache-policy=none io=cached",
        &[
            "--ram-budget",
            "{expert*2}",
            "--cache-policy",
            "none",
            "--io",
            "cached",
        ],
        &[Flag("--cache-policy")],
    ),
    // Backends.
    arm("backend=cpu", &["--backend", "cpu"], &[Flag("--backend")]),
    arm(
        "backend=cuda",
        &["--backend", "cuda"],
        &[Flag("--backend"), Gpu],
    ),
    arm(
        "backend=cuda vram-budget=experts/4",
        &["--backend", "cuda", "--vram-budget", "{experts/4}"],
        &[Flag("--backend"), Flag("--vram-budget"), Gpu],
    ),
    // Observability must not perturb anything.
    arm("stats", &["--stats"], &[Flag("--stats")]),
];

/// Whether this processor has `feature`, as the runtime decides it.
pub fn cpu_has(feature: &str) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        match feature {
            "avx2" => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            "avx512f" => std::arch::is_x86_feature_detected!("avx512f"),
            _ => false,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = feature;
        false
    }
}

/// Why `arm` cannot run here, or `None` when it can.
pub fn unavailable(arm: &Arm, runtime: &Runtime) -> Option<String> {
    for need in arm.needs {
        match *need {
            Flag(f) if !runtime.supports(f) => return Some(format!("tarfa-run has no {f} yet")),
            Cpu(c) if !cpu_has(c) => return Some(format!("this CPU lacks {c}")),
            Gpu if !have_nvidia_smi() => return Some("no NVIDIA GPU".into()),
            _ => {}
        }
    }
    None
}

/// Replace a `{experts}` / `{expert}` size placeholder (optionally `/N` or `*N`) with bytes.
pub fn resolve_arg(arg: &str, bundle: &Bundle) -> Result<String, String> {
    let Some(inner) = arg.strip_prefix('{').and_then(|a| a.strip_suffix('}')) else {
        return Ok(arg.to_string());
    };
    let (name, op) = match inner.find(['/', '*']) {
        Some(i) => (&inner[..i], Some((&inner[i..i + 1], &inner[i + 1..]))),
        None => (inner, None),
    };
    let base = match name {
        "experts" => bundle.manifest.expert_bytes(),
        "expert" => bundle
            .manifest
            .experts
            .iter()
            .map(|e| e.length)
            .max()
            .unwrap_or(0),
        other => return Err(format!("unknown size `{other}` in `{arg}`")),
    };
    let v = match op {
        None => base,
        Some((o, n)) => {
            let n: u64 = n.parse().map_err(|_| format!("bad factor in `{arg}`"))?;
            if o == "/" {
                base / n.max(1)
            } else {
                base * n
            }
        }
    };
    Ok(v.to_string())
}

/// Parse a command-line arm, `NAME=OPTIONS` (options split on whitespace).
pub fn parse_extra_arm(spec: &str) -> Result<(String, Vec<String>), String> {
    let (name, opts) = spec
        .split_once('=')
        .ok_or_else(|| format!("--arm `{spec}`: expected NAME=OPTIONS"))?;
    if name.trim().is_empty() {
        return Err(format!("--arm `{spec}`: empty name"));
    }
    Ok((
        name.trim().to_string(),
        opts.split_whitespace().map(str::to_string).collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bundle::{Manifest, ModelConfig};

    fn bundle() -> Bundle {
        let e = |i: u32, len: u64| {
            format!(
                "[[experts]]\nname = \"e{i}\"\nlayer = 0\nexpert = {i}\nlength = {len}\nsha256 = \"\"\nblake3 = \"\"\n"
            )
        };
        Bundle {
            dir: "/nowhere".into(),
            config: ModelConfig::parse(
                r#"{"model_type":"mixtral","vocab_size":8,"num_hidden_layers":1,"num_local_experts":2,"num_experts_per_tok":1}"#,
            )
            .unwrap(),
            manifest: Manifest::parse(&format!("root_digest = \"r\"\n{}{}", e(0, 1000), e(1, 3000))).unwrap(),
            config_attested: true,
        }
    }

    #[test]
    fn sizes_resolve_from_the_manifest() {
        let b = bundle();
        assert_eq!(resolve_arg("{experts}", &b).unwrap(), "4000");
        assert_eq!(resolve_arg("{experts/4}", &b).unwrap(), "1000");
        assert_eq!(resolve_arg("{expert*2}", &b).unwrap(), "6000");
        assert_eq!(resolve_arg("--io", &b).unwrap(), "--io");
        assert!(resolve_arg("{layers}", &b).is_err());
        assert!(resolve_arg("{experts/x}", &b).is_err());
    }

    #[test]
    fn arm_names_are_unique_and_every_placeholder_resolves() {
        let b = bundle();
        let mut names: Vec<&str> = ARMS.iter().map(|a| a.name).collect();
        names.push(BASELINE.name);
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n);
        for a in ARMS {
            for x in a.args {
                resolve_arg(x, &b).unwrap();
            }
        }
    }

    #[test]
    fn extra_arms_parse() {
        assert_eq!(
            parse_extra_arm("t4=--threads 4 --kernel avx2").unwrap(),
            (
                "t4".to_string(),
                vec![
                    "--threads".into(),
                    "4".into(),
                    "--kernel".into(),
                    "avx2".into()
                ]
            )
        );
        assert!(parse_extra_arm("--threads 4").is_err());
        assert!(parse_extra_arm("=x").is_err());
    }
}
