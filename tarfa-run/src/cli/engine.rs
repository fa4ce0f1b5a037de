//! The CLI's side of the engine seam ([`tarfa_engine`]): `--backend` as the engine's
//! [`BackendChoice`], and the engine's errors as the CLI's, with their exit codes.

use crate::cuda::CudaError;
use tarfa_engine::{BackendChoice, EngineError};

use super::generate::BackendArg;
use super::CliError;

impl From<BackendArg> for BackendChoice {
    fn from(b: BackendArg) -> Self {
        match b {
            BackendArg::Auto => BackendChoice::Auto,
            BackendArg::Cpu => BackendChoice::Cpu,
            BackendArg::Cuda => BackendChoice::Cuda,
        }
    }
}

impl From<EngineError> for CliError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Run(r) => CliError::Run(r),
            EngineError::Cuda(c) => c.into(),
            // a caller's bug, never the user's input
            e @ EngineError::ForeignSequence { .. } => CliError::Environment(e.to_string()),
        }
    }
}

/// The runtime's own error keeps its exit code; what the user asked for that the kernels cannot do
/// is bad input (exit 2); every other CUDA failure is the environment's (exit 3). Every variant is
/// named, so that a new one is a decision.
impl From<CudaError> for CliError {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::Run(r) => CliError::Run(r),
            e @ (CudaError::NotCompiled
            | CudaError::NoMockDevice
            | CudaError::NoDriver
            | CudaError::NoNvrtc
            | CudaError::NoDevice
            | CudaError::Compile { .. }
            | CudaError::OutOfMemory { .. }
            | CudaError::KernelFailed { .. }
            | CudaError::DeviceLost { .. }
            | CudaError::Driver { .. }
            | CudaError::Internal(_)) => CliError::Environment(e.to_string()),
            e @ (CudaError::UnsupportedModel(_)
            | CudaError::TooManyTokens { .. }
            | CudaError::VramBudgetTooSmall { .. }
            | CudaError::NoSuchDevice { .. }) => CliError::Usage(e.to_string()),
        }
    }
}
