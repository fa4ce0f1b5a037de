//! The CUDA backend's speed knobs on the command line. They change how fast a step runs, never a
//! bit of what it computes; the runtime reads them once, when the model loads (no environment
//! variable is read), and an unknown value is a usage error.

use clap::Args;

use crate::cuda::{CudaTuning, DecodeMode, ManyKernels};

#[derive(Args, Debug, Clone, Default)]
pub struct CudaArgs {
    /// How decode steps run on the GPU: graph-pdl (the default and fastest: one CUDA graph with
    /// programmatic launch), graph, direct (kernels launched one by one) or legacy (the
    /// per-operation kernels). Every mode gives the same bits.
    #[arg(long, value_name = "MODE", value_parser = decode_mode_arg)]
    pub cuda_decode: Option<DecodeMode>,
    /// Wait after every CUDA kernel, so that a failure names the kernel (slow; for debugging).
    #[arg(long)]
    pub cuda_sync: bool,
    /// Copy streamed experts to the GPU from pageable host memory instead of page-locked
    /// buffers (slower; for comparisons).
    #[arg(long)]
    pub pageable_warm_tier: bool,
    /// Wait for each generated token before the GPU starts the next step, instead of queueing 8
    /// steps and waiting once (slower; for comparisons). Either way the same tokens.
    #[arg(long)]
    pub cuda_wait_each_token: bool,
    /// Which kernels run a step of many tokens (a prompt, a batch): auto (the default: the
    /// lane-sequential kernels of kernels/prefill.cu where a step has enough tokens for them, the
    /// token-tiled ones elsewhere, the few-pair experts kernels for batched decode and short
    /// steps; on the H200 1.4x to 6x tiled's prefill from 256 tokens up), tiled (the
    /// token-tiled kernels only), lanes (the lane-sequential kernels wherever they can run) or
    /// few (auto, and products of 2 to 8 tokens on mm_few, measured slower). Every choice gives
    /// the same bits (docs/PHASE_LOG.md B5, B8, B9, B11, B12).
    #[arg(long, value_name = "KERNELS", value_parser = many_kernels_arg)]
    pub cuda_many: Option<ManyKernels>,
}

impl CudaArgs {
    pub fn tuning(&self) -> CudaTuning {
        CudaTuning {
            decode: self.cuda_decode.unwrap_or_default(),
            sync_each_kernel: self.cuda_sync,
            pageable_warm_tier: self.pageable_warm_tier,
            wait_each_token: self.cuda_wait_each_token,
            many: self.cuda_many.unwrap_or_default(),
        }
    }
}

fn decode_mode_arg(s: &str) -> Result<DecodeMode, String> {
    DecodeMode::parse(s)
}

fn many_kernels_arg(s: &str) -> Result<ManyKernels, String> {
    ManyKernels::parse(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_modes_parse_exactly_and_errors_name_the_choices() {
        for m in DecodeMode::ALL {
            assert_eq!(decode_mode_arg(m.name()), Ok(m));
        }
        for bad in ["", "GRAPH", " graph", "pdl", "graph_pdl", "v7"] {
            let e = decode_mode_arg(bad).unwrap_err();
            assert!(
                e.contains("graph-pdl") && e.contains("legacy"),
                "{bad:?}: {e}"
            );
        }
        for m in ManyKernels::ALL {
            assert_eq!(many_kernels_arg(m.name()), Ok(m));
        }
        for bad in ["", "AUTO", "tile", "lane", " auto"] {
            let e = many_kernels_arg(bad).unwrap_err();
            assert!(e.contains("tiled") && e.contains("lanes"), "{bad:?}: {e}");
        }
        let t = CudaArgs::default().tuning();
        assert_eq!(t.decode, DecodeMode::GraphPdl);
        assert_eq!(t.many, ManyKernels::Auto);
        assert!(!t.sync_each_kernel && !t.pageable_warm_tier && !t.wait_each_token);
    }
}
