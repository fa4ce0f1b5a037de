//! Compiles every CUDA kernel with NVRTC, with exactly the runtime's options, on a machine with
//! no GPU (CI): the PTX must target sm_90, contain every entry point the runtime loads, and hold
//! no approximate or flush-to-zero instruction.
//!
//! NVRTC comes from PyPI's `nvidia-cuda-nvrtc` (kernels/README.md). Rust has no run-time skip,
//! so the test that needs it is `#[ignore]`d unless the crate was built with
//! `TARFA_REQUIRE_NVRTC=1` (build.rs turns that into `cfg(tarfa_require_nvrtc)`): `cargo test`
//! then reports it as ignored, not as a pass that compiled nothing. `.ci/run` installs libnvrtc
//! and sets the variable, so CI runs it, and fails it if the library cannot be loaded.
//! `cargo test -- --ignored` runs it anywhere, with the same failure when NVRTC is missing.
#![cfg(feature = "cuda")]

use tarfa_run::cuda::compile::{
    compile_all, forbidden_instructions, nvrtc_present, option_strings, KERNEL_FILES,
};

/// Fails, saying how to install it, when libnvrtc cannot be loaded.
fn require_nvrtc() {
    assert!(
        nvrtc_present(),
        "libnvrtc cannot be loaded, so the CUDA kernels cannot be compiled: install it with `pip \
         install --target DIR nvidia-cuda-nvrtc==13.0.88` and set \
         LD_LIBRARY_PATH=DIR/nvidia/cu13/lib (kernels/README.md; .ci/run does both)"
    );
}

#[test]
fn runtime_options_are_the_contracts() {
    let o = option_strings("compute_90");
    for want in [
        "--fmad=false",
        "--ftz=false",
        "--prec-div=true",
        "--prec-sqrt=true",
        "--gpu-architecture=compute_90",
    ] {
        assert!(o.iter().any(|x| x == want), "missing {want} in {o:?}");
    }
    assert!(
        !o.iter()
            .any(|x| x.contains("fast-math") || x == "--fmad=true"),
        "fast math in {o:?}"
    );
}

#[test]
#[cfg_attr(
    not(tarfa_require_nvrtc),
    ignore = "needs libnvrtc; .ci/run installs it and sets TARFA_REQUIRE_NVRTC=1"
)]
fn every_kernel_compiles_for_sm90_exactly() {
    require_nvrtc();
    let compiled = compile_all("compute_90").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(compiled.len(), KERNEL_FILES.len());
    for (file, ptx) in compiled {
        assert!(
            ptx.lines().any(|l| l.trim() == ".target sm_90"),
            "kernels/{}: PTX does not target sm_90",
            file.name
        );
        for entry in file.entries {
            assert!(
                ptx.contains(&format!(".entry {entry}(")),
                "kernels/{}: no entry point {entry}",
                file.name
            );
        }
        let bad = forbidden_instructions(&ptx);
        assert!(
            bad.is_empty(),
            "kernels/{}: inexact instructions {bad:?}",
            file.name
        );
        // BF16 weights are read 16 bytes at a time
        if file.name == "matvec.cu" || file.name == "moe.cu" || file.name == "decode.cu" {
            assert!(
                ptx.contains("ld.global.nc.v4.u32") || ptx.contains("ld.global.v4.u32"),
                "kernels/{}: no 16-byte BF16 loads",
                file.name
            );
        }
        eprintln!(
            "kernels/{}: {} bytes of PTX for sm_90",
            file.name,
            ptx.len()
        );
    }
}

#[test]
fn the_forbidden_instruction_scan_finds_what_fast_math_emits() {
    let ptx = "\tex2.approx.ftz.f32 \t%f1, %f2;\n\tadd.rn.f32 %f3, %f1, %f2;\n@%p1 div.full.f32 %f4, %f3, %f2;\n\tfma.rn.f32 %f5, %f1, %f2, %f3;\n";
    let bad = forbidden_instructions(ptx);
    assert_eq!(bad.len(), 2, "{bad:?}");
    assert!(
        forbidden_instructions("\tadd.rn.f32 %f3, %f1, %f2;\n\tsqrt.rn.f32 %f1, %f2;\n").is_empty()
    );
}
