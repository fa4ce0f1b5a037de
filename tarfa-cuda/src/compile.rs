//! The kernel sources (kernels/*.cu, embedded at build time) and the one set of NVRTC options
//! they are compiled with, shared by the runtime and by the CPU-side test that compiles every
//! kernel in CI (tests/cuda_compile.rs).
//!
//! The options are the contract's (docs/EXACTNESS.md section 3): no contraction of `a*b + c`
//! into an fma (`--fmad=false`), subnormals kept (`--ftz=false`), correctly rounded division and
//! square root (`--prec-div=true`, `--prec-sqrt=true`), never fast math. `-lineinfo` only adds
//! source lines for compute-sanitizer's reports; it changes no instruction.
//!
//! This module must never add an option that changes arithmetic.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

use super::CudaError;

/// The header every kernel file includes (prepended to each source, see [`full_source`]).
pub const COMMON_HEADER: &str = include_str!("../../kernels/common.cuh");

/// One kernel source file and the entry points the runtime loads from it.
#[derive(Debug)]
pub struct KernelFile {
    /// File name under kernels/.
    pub name: &'static str,
    /// Its text.
    pub source: &'static str,
    /// `extern "C" __global__` functions the runtime looks up.
    pub entries: &'static [&'static str],
}

/// Every kernel file.
pub const KERNEL_FILES: &[KernelFile] = &[
    KernelFile {
        name: "matvec.cu",
        source: include_str!("../../kernels/matvec.cu"),
        entries: &["matvec_bf16", "matvec_f32"],
    },
    KernelFile {
        name: "norm_rope.cu",
        source: include_str!("../../kernels/norm_rope.cu"),
        entries: &[
            "embed_bf16",
            "embed_f32",
            "rmsnorm",
            "rope_append_kv",
            "rope_append_kv_seqs",
            "clip_abs",
            "round_to_bf16",
        ],
    },
    KernelFile {
        name: "attention.cu",
        source: include_str!("../../kernels/attention.cu"),
        entries: &["attention", "attention_seqs"],
    },
    KernelFile {
        name: "moe.cu",
        source: include_str!("../../kernels/moe.cu"),
        entries: &[
            "route_topk",
            "route_topk_first",
            "scale_slots",
            "route_grouped",
            "gate_up_bf16",
            "gate_up_f32",
            "down_mix",
            "gate_up_slots",
            "down_slots",
            "moe_mix",
        ],
    },
    KernelFile {
        name: "tile.cu",
        source: include_str!("../../kernels/tile.cu"),
        entries: &[
            "mm_tile_bf16",
            "mm_tile_f32",
            "moe_group",
            "gate_up_tile_bf16",
            "gate_up_tile_f32",
            "down_tile",
            "gate_up_few_bf16",
            "down_few",
            "mm_few_bf16",
        ],
    },
    KernelFile {
        name: "prefill.cu",
        source: include_str!("../../kernels/prefill.cu"),
        entries: &[
            "ls_mm_bf16",
            "ls_mm_f32",
            "ls_gate_up_bf16",
            "ls_gate_up_f32",
            "ls_down_bf16",
            "attn_scores_d8",
            "attn_scores_d16",
            "attn_scores_d32",
            "attn_scores_d64",
            "attn_scores_d128",
            "attn_softmax",
            "attn_pv",
        ],
    },
    KernelFile {
        name: "mla.cu",
        source: include_str!("../../kernels/mla.cu"),
        entries: &[
            "mla_rope_append",
            "mla_rope_append_seqs",
            "mla_attention_bf16",
            "mla_attention_f32",
            "mla_attention_seqs_bf16",
            "mla_attention_seqs_f32",
            "mla_rope_append_dec",
            "mla_attention_dec_bf16",
            "mla_attention_dec_f32",
        ],
    },
    KernelFile {
        name: "decode.cu",
        source: include_str!("../../kernels/decode.cu"),
        entries: &[
            "dmv2_bf16",
            "dmv2_f32",
            "dmv2w_bf16",
            "dmv2f_bf16",
            "dmv2wf_bf16",
            "dmv2fe_bf16",
            "dmv2wfe_bf16",
            "lmhead2_bf16",
            "lmhead2_f32",
            "lmhead2f_bf16",
            "lmhead2fe_bf16",
            "gate_up_dec2_bf16",
            "gate_up_dec2_f32",
            "gate_up_dec2f_bf16",
            "gate_up_route2_bf16",
            "gate_up_route2f_bf16",
            "moe_down_dec2",
            "moe_down_dec2f8",
            "moe_down_route2f8e",
            "attn_decode4_d32",
            "attn_decode4_d64",
            "attn_decode4_d128",
            "attn_decode4_d256",
            "attn_decode4p_d32",
            "attn_decode4p_d64",
            "attn_decode4p_d128",
            "attn_decode4p_d256",
        ],
    },
    KernelFile {
        name: "linear_attn.cu",
        source: include_str!("../../kernels/linear_attn.cu"),
        entries: &[
            "linear_unpack",
            "linear_conv",
            "linear_qk_norm",
            "linear_recur",
            "silu_gate",
            "split_query_gate",
            "sigmoid_gate",
        ],
    },
    KernelFile {
        name: "probe.cu",
        source: include_str!("../../kernels/probe.cu"),
        entries: &[
            "probe_exp",
            "probe_silu",
            "probe_sigmoid",
            "probe_rsqrt",
            "probe_softplus",
            "probe_nop",
        ],
    },
];

/// The source NVRTC compiles for `file`: the common header, then the file with its
/// `#include "common.cuh"` line removed (NVRTC is given no include paths).
pub fn full_source(file: &KernelFile) -> String {
    let body: Vec<&str> = file
        .source
        .lines()
        .filter(|l| l.trim() != "#include \"common.cuh\"")
        .collect();
    format!(
        "{COMMON_HEADER}\n#line 1 \"{}\"\n{}\n",
        file.name,
        body.join("\n")
    )
}

/// The NVRTC options of every kernel, for a virtual architecture such as `compute_90`.
pub fn compile_options(arch: &'static str, name: &str) -> CompileOptions {
    CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(false),
        use_fast_math: None,
        maxrregcount: None,
        include_paths: Vec::new(),
        arch: Some(arch),
        name: Some(name.to_string()),
        options: vec!["--std=c++17".into(), "-lineinfo".into()],
    }
}

/// The options as NVRTC receives them (for reports and tests).
pub fn option_strings(arch: &'static str) -> Vec<String> {
    let o = compile_options(arch, "x.cu");
    let mut v = Vec::new();
    if let Some(b) = o.ftz {
        v.push(format!("--ftz={b}"));
    }
    if let Some(b) = o.prec_sqrt {
        v.push(format!("--prec-sqrt={b}"));
    }
    if let Some(b) = o.prec_div {
        v.push(format!("--prec-div={b}"));
    }
    if let Some(b) = o.fmad {
        v.push(format!("--fmad={b}"));
    }
    if let Some(a) = o.arch {
        v.push(format!("--gpu-architecture={a}"));
    }
    v.extend(o.options);
    v
}

/// Whether libnvrtc can be loaded (cudarc panics on first use when it cannot).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// The virtual architecture name for a compute capability (`compute_90` for 9.0).
pub fn arch_for(major: i32, minor: i32) -> &'static str {
    static NAMES: OnceLock<Mutex<HashMap<(i32, i32), &'static str>>> = OnceLock::new();
    if (major, minor) == (9, 0) {
        return "compute_90";
    }
    let mut m = NAMES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    m.entry((major, minor))
        .or_insert_with(|| Box::leak(format!("compute_{major}{minor}").into_boxed_str()))
}

/// PTX of one file, compiled with [`compile_options`].
pub fn compile_file(file: &KernelFile, arch: &'static str) -> Result<String, CudaError> {
    if !nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    let ptx = compile_ptx_with_opts(full_source(file), compile_options(arch, file.name)).map_err(
        |e| CudaError::Compile {
            file: file.name.to_string(),
            log: compile_log(&e),
        },
    )?;
    Ok(ptx.to_src())
}

fn compile_log(e: &cudarc::nvrtc::CompileError) -> String {
    match e {
        cudarc::nvrtc::CompileError::CompileError { nvrtc, log, .. } => {
            format!("{nvrtc:?}: {}", log.to_string_lossy())
        }
        other => format!("{other:?}"),
    }
}

/// PTX of every file for `arch`, compiled once per process and cached.
pub fn compile_all(arch: &'static str) -> Result<Vec<(&'static KernelFile, String)>, CudaError> {
    type Cache = Mutex<HashMap<&'static str, Vec<String>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut guard = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(v) = guard.get(arch) {
        return Ok(KERNEL_FILES.iter().zip(v.iter().cloned()).collect());
    }
    let mut out = Vec::new();
    for f in KERNEL_FILES {
        out.push(compile_file(f, arch)?);
    }
    guard.insert(arch, out.clone());
    Ok(KERNEL_FILES.iter().zip(out).collect())
}

/// PTX instructions an exact kernel must never contain: approximate instructions, anything that
/// flushes subnormals, and the transcendental instructions (which exist only approximate).
pub const FORBIDDEN_PTX: &[&str] = &[
    ".approx", ".ftz", "div.full", "ex2", "lg2", "sin", "cos", "tanh",
];

/// The forbidden instructions found in a PTX text (none in a correct build).
pub fn forbidden_instructions(ptx: &str) -> Vec<String> {
    let mut found = Vec::new();
    for line in ptx.lines() {
        let code = line.split("//").next().unwrap_or("").trim();
        if code.is_empty()
            || code.starts_with('.')
            || code.ends_with(':')
            || code.starts_with('{')
            || code.starts_with('}')
        {
            continue;
        }
        // the mnemonic: the first token that is not a predicate guard (@%p1, @!%p1)
        let Some(op) = code.split_whitespace().find(|t| !t.starts_with('@')) else {
            continue;
        };
        let bad = FORBIDDEN_PTX.iter().any(|b| {
            if b.starts_with('.') {
                op.contains(b)
            } else {
                op == *b || op.starts_with(&format!("{b}."))
            }
        });
        if bad {
            found.push(code.to_string());
        }
    }
    found
}
