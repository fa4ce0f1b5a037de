//! The resident part of a streamed run, accounted for apart from the expert tiers: the dense
//! weights (everything in the bundle that is not an expert) and the KV cache at the requested
//! context length. Both stay in memory for the whole run; the budgets bound only the experts.

use crate::bundle::BundleSource;
use crate::config::MoeConfig;

/// Bytes that stay resident whatever the budgets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ResidentPart {
    /// Non-expert tensors as the CPU model holds them: matrices as stored, vectors widened to
    /// f32 (norm weights, biases).
    pub dense_bytes: u64,
    /// Keys and values (f32) of every layer and KV head for `context` positions, and the RoPE
    /// rows (cos and sin, f32) for them.
    pub kv_bytes: u64,
    /// The gated DeltaNet layers' states (Qwen3-Next, Qwen3.5 MoE), f32, whatever the
    /// context: the convolution's and the recurrence's state, held twice (the committed state
    /// and the one the last step started from, kept for a rewind) and a third time while a step
    /// stages the next. 0 for a model without such layers.
    pub linear_state_bytes: u64,
    /// Positions the KV cache is sized for (prompt plus generated tokens).
    pub context: usize,
}

impl ResidentPart {
    pub fn new(bundle: &BundleSource, cfg: &MoeConfig, context: usize) -> ResidentPart {
        let dense_bytes = bundle
            .manifest()
            .tensors
            .iter()
            .map(|t| {
                // Vectors are widened to f32 when loaded (resident.rs): BF16 ones double.
                if t.shape.len() == 1 && t.dtype == "BF16" {
                    2 * t.length
                } else {
                    t.length
                }
            })
            .sum();
        ResidentPart {
            dense_bytes,
            kv_bytes: kv_bytes(cfg, context),
            linear_state_bytes: linear_state_bytes(cfg),
            context,
        }
    }

    pub fn total(&self) -> u64 {
        self.dense_bytes
            .saturating_add(self.kv_bytes)
            .saturating_add(self.linear_state_bytes)
    }
}

/// One sequence's gated DeltaNet states at their peak: three copies (committed, kept, staged)
/// of every linear layer's convolution and recurrent state, f32.
pub fn linear_state_bytes(cfg: &MoeConfig) -> u64 {
    let Some(d) = &cfg.linear else { return 0 };
    let layers = cfg.layer_linear.iter().filter(|&&l| l).count() as u64;
    let per_layer = (d.state_len() + d.conv_state_len()) as u64 * 4;
    3 * layers * per_layer
}

/// KV cache and RoPE rows for `context` positions (saturating: a context too large for memory
/// must read as too large, not wrap).
pub fn kv_bytes(cfg: &MoeConfig, context: usize) -> u64 {
    // a gated DeltaNet layer caches no rows
    let attention_layers = cfg.layer_linear.iter().filter(|&&l| !l).count();
    let per_pos = (attention_layers as u64 * cfg.num_kv_heads as u64 * cfg.head_dim as u64 * 2 * 4)
        .saturating_add(cfg.head_dim as u64 * 4);
    per_pos.saturating_mul(context as u64)
}

/// `MemAvailable` from /proc/meminfo (the kernel's estimate of memory a new workload can use
/// without swapping, page cache included), or `None` where it cannot be read.
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
}

fn parse_mem_available(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut parts = line.split_whitespace().skip(1);
    let kb: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") | None => kb.checked_mul(1024),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_parses_the_kernel_format() {
        let t = "MemTotal:       24600000 kB\nMemFree:  100 kB\nMemAvailable:   22000000 kB\n";
        assert_eq!(parse_mem_available(t), Some(22_000_000 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: x kB\n"), None);
        assert!(mem_available().is_some(), "Linux has /proc/meminfo");
    }
}
