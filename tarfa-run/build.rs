//! Build-time settings of tarfa-run's tests, nothing else.
//!
//! `TARFA_REQUIRE_NVRTC=1` when building (what `.ci/run` sets) turns on `cfg(tarfa_require_nvrtc)`:
//! the test that compiles every CUDA kernel with NVRTC then runs, and fails if libnvrtc cannot be
//! loaded. Without it that test is reported as ignored, never as a pass that checked nothing.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(tarfa_require_nvrtc)");
    println!("cargo::rerun-if-env-changed=TARFA_REQUIRE_NVRTC");
    println!("cargo::rerun-if-changed=build.rs");
    if std::env::var("TARFA_REQUIRE_NVRTC").is_ok_and(|v| v.trim() == "1") {
        println!("cargo::rustc-cfg=tarfa_require_nvrtc");
    }
}
