//! Issue 25 (research, not part of the product): a bit-exact CPU model of the H200's
//! `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` (the MMA-Sim hypothesis, see
//! [`model`]), an independent f64 transcription of the same definition ([`reference`]), the
//! test tiles the GPU harness compares the hardware with ([`cases`]), a SIMD emulator of the
//! candidate dot product for the CPU cost figures ([`simd`]) and the GPU harness itself
//! ([`gpu`], `mma-check`).

pub mod cases;
pub mod gpu;
pub mod model;
pub mod reference;
pub mod simd;
