//! Look-ahead reads (docs/PHASE_LOG.md S5): once a MoE layer's routes are known and its reads
//! announced, tell a streaming source which MoE layer comes next and, when it asks, which
//! experts this step's tokens would choose there if their residual went through that layer's
//! router now. The source may start reading them while this layer computes.
//!
//! The guess is computed from a copy of the residual and handed only to
//! [`WeightSource::lookahead`]: it never touches `h`, the step's statistics, the router trace
//! or a hook, so it cannot change a bit. The forward still asks for exactly the experts the
//! real router chooses, verified as always; a wrong guess costs reads, never bits.
//!
//! [`WeightSource::lookahead`]: tarfa_core::weights::WeightSource::lookahead

use tarfa_core::numerics::matvec::{transpose_rows, Activation};
use tarfa_core::numerics::{run_jobs, Kernel, MatJob};
use tarfa_core::resident::{LayerMlp, LayerWeights, MoeResident};
use tarfa_core::weights::LookaheadInput;

use super::forward::rms_norm;
use super::CpuModel;

/// Called by the MoE block of layer `l` after it announced its own reads: hints the next MoE
/// layer to the source, with the router's guess when the source asks for it. `h` is the
/// residual entering layer `l`'s MoE block (`[T][H]`), `count` the distinct experts layer `l`
/// needed. Nothing happens for a source without look-ahead (every resident source).
pub(crate) fn hint_next_layer(
    model: &CpuModel,
    kernel: Kernel,
    l: usize,
    h: &[Vec<f32>],
    count: usize,
) {
    let want = model.source.lookahead_input();
    if want == LookaheadInput::None {
        return;
    }
    let next = model
        .weights
        .layers
        .iter()
        .enumerate()
        .skip(l + 1)
        .find_map(|(i, layer)| match &layer.mlp {
            LayerMlp::Moe(moe) => Some((i, layer, moe)),
            LayerMlp::Dense(_) => None,
        });
    let Some((next, layer, moe)) = next else {
        return;
    };
    let guess = match want {
        LookaheadInput::Router => router_guess(model, kernel, layer, moe, h),
        LookaheadInput::LayerOnly | LookaheadInput::None => Vec::new(),
    };
    model.source.lookahead(next, count, &guess);
}

/// The experts `moe`'s router would pick for the tokens of `h` now: each token's top-k of the
/// router logits of `RMSNorm(h_t)` under `layer`'s norm (plus the router's linear bias and
/// correction bias where the family has them), ordered by how many tokens pick an expert, then
/// by its best rank among them, then by id. An approximation of every family's rule (grouped
/// and sigmoid routers rank the same logits): it only decides what is read first.
fn router_guess(
    model: &CpuModel,
    kernel: Kernel,
    layer: &LayerWeights,
    moe: &MoeResident,
    h: &[Vec<f32>],
) -> Vec<usize> {
    let cfg = &model.cfg;
    let xs: Vec<Activation> = h
        .iter()
        .map(|ht| {
            let y = rms_norm(kernel, ht, &layer.post_attention_norm, cfg.eps_f32());
            Activation::new(kernel, y)
        })
        .collect();
    let w = moe.router.as_ref();
    let rows = w.rows();
    let mut out = vec![0.0f32; rows * xs.len()];
    run_jobs(
        kernel,
        vec![MatJob {
            w,
            xs: xs.iter().collect(),
            out: &mut out,
        }],
    );
    let logits = transpose_rows(&out, rows, xs.len());
    // (tokens that pick the expert, best rank among them) per expert
    let mut tally = vec![(0usize, usize::MAX); rows];
    let k = cfg.top_k.min(rows);
    for mut lg in logits {
        for bias in [&moe.router_linear_bias, &moe.correction_bias]
            .into_iter()
            .flatten()
        {
            for (v, b) in lg.iter_mut().zip(bias) {
                *v += b;
            }
        }
        let mut order: Vec<usize> = (0..lg.len()).collect();
        // a total order: a NaN logit ranks like any value (a guess is never an error)
        order.sort_by(|&a, &b| lg[b].total_cmp(&lg[a]).then(a.cmp(&b)));
        for (rank, &e) in order.iter().take(k).enumerate() {
            let t = &mut tally[e];
            t.0 += 1;
            t.1 = t.1.min(rank);
        }
    }
    let mut picked: Vec<usize> = (0..rows).filter(|&e| tally[e].0 > 0).collect();
    picked.sort_by_key(|&e| (std::cmp::Reverse(tally[e].0), tally[e].1, e));
    picked
}
