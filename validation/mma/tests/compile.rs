//! Compiles kernels/mma.cu with NVRTC (the product's options, compute_90) on a machine with no
//! GPU. Skips (passes with a note) when libnvrtc cannot be loaded, unless TARFA_REQUIRE_NVRTC=1,
//! which turns a missing library into a failure (as tarfa-run/tests/cuda_compile.rs does in CI).
//! NVRTC from PyPI: `pip install --target DIR nvidia-cuda-nvrtc==13.0.88`,
//! `LD_LIBRARY_PATH=DIR/nvidia/cu13/lib`.

use tarfa_mma::gpu::{compile, nvrtc_present, ENTRIES};

#[test]
fn kernels_compile_for_sm90_with_the_products_options() {
    if !nvrtc_present() {
        assert!(
            std::env::var("TARFA_REQUIRE_NVRTC").as_deref() != Ok("1"),
            "TARFA_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded"
        );
        eprintln!("SKIPPED: libnvrtc cannot be loaded");
        return;
    }
    let ptx = compile("compute_90").unwrap_or_else(|e| panic!("{e}"));
    assert!(ptx.lines().any(|l| l.trim() == ".target sm_90"));
    for e in ENTRIES {
        assert!(ptx.contains(&format!(".entry {e}(")), "no entry {e}");
    }
    assert!(
        ptx.contains("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"),
        "the MMA instruction is not in the PTX"
    );
    // the split must be plain round-to-nearest subtraction, never an fma or a flush
    assert!(
        !ptx.contains(".ftz"),
        "flush-to-zero instruction in the PTX"
    );
    assert!(!ptx.contains("fma.rn.f32"), "fma in the PTX");
}
