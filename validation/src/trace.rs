//! The router trace (`tarfa-run generate --router-trace FILE`, JSON Lines) and the rules it must
//! satisfy: the config's top-k in every MoE layer at every position, distinct experts, ids below
//! E, probabilities in the contract's order, and the family's renormalisation.
//!
//! Format: a header line
//! `{"kind":"header","num_experts":E,"num_experts_per_tok":k,"norm_topk_prob":b,"renormalizes":b,"moe_layers":[...]}`,
//! then per forward step (the prefill, then each decode step) one line per (MoE layer, position)
//! in layer-then-position order:
//! `{"kind":"route","layer":l,"moe_layer":m,"position":p,"experts":[...],"probs":[...],"weights":[...],"kth_prob":x,"next_prob":y|null}`.

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;

use crate::bundle::ModelConfig;
use crate::logits::OraclePrompt;

#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct Header {
    pub kind: String,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub norm_topk_prob: bool,
    pub renormalizes: bool,
    pub moe_layers: Vec<usize>,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct Route {
    pub kind: String,
    pub layer: usize,
    pub moe_layer: usize,
    pub position: usize,
    pub experts: Vec<u32>,
    /// Softmax probabilities of the selected experts, in selection order. The runtime prints
    /// f32 values in their shortest round-trip form, so parsing back to f32 gives the exact bits.
    pub probs: Vec<f32>,
    pub weights: Vec<f32>,
    pub kth_prob: f32,
    pub next_prob: Option<f32>,
}

/// A parsed trace.
#[derive(Clone, Debug)]
pub struct Trace {
    pub header: Header,
    pub routes: Vec<Route>,
}

impl Trace {
    pub fn parse(text: &str) -> Result<Trace> {
        let mut lines = text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty());
        let (_, first) = lines
            .next()
            .ok_or_else(|| anyhow!("the router trace is empty"))?;
        let header: Header =
            serde_json::from_str(first).context("router trace line 1 is not a header")?;
        if header.kind != "header" {
            bail!(
                "router trace line 1 has kind `{}`, not `header`",
                header.kind
            );
        }
        let routes = lines
            .map(|(i, l)| {
                let r: Route = serde_json::from_str(l)
                    .with_context(|| format!("router trace line {} is not a route", i + 1))?;
                if r.kind != "route" {
                    bail!("router trace line {} has kind `{}`", i + 1, r.kind);
                }
                Ok(r)
            })
            .collect::<Result<_>>()?;
        Ok(Trace { header, routes })
    }

    /// The experts the run used, as (layer, expert) pairs, sorted and distinct.
    pub fn used_experts(&self) -> Vec<(u32, u32)> {
        let mut v: Vec<(u32, u32)> = self
            .routes
            .iter()
            .flat_map(|r| r.experts.iter().map(move |&e| (r.layer as u32, e)))
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// What one trace check found.
#[derive(Clone, Debug, Default)]
pub struct TraceFindings {
    pub routes: usize,
    pub moe_layers: usize,
    pub positions: usize,
    /// Largest |sum of weights - 1| over the routes (renormalising families).
    pub worst_weight_sum_error: f64,
    /// Rule violations, the first few in full.
    pub violations: Vec<String>,
    pub violation_count: usize,
    /// Prefill routes compared with the oracle's top-k sets, and how many differed at a near tie.
    pub oracle_compared: usize,
    pub oracle_near_ties: usize,
}

impl TraceFindings {
    fn violate(&mut self, msg: String) {
        self.violation_count += 1;
        if self.violations.len() < 8 {
            self.violations.push(msg);
        }
    }

    pub fn held(&self) -> bool {
        self.violation_count == 0
    }
}

/// Relative tolerance of the renormalised weights: f32 division and a k-term f32 sum, each a few
/// ulps (2^-24 each) away from the exact values.
pub const WEIGHT_TOLERANCE: f64 = 1e-5;

/// Check a trace against the config, for a run of `prompt_len` prompt tokens that generated
/// `generated` tokens (greedy feeds every generated token but the last back in, so decode
/// positions run from `prompt_len` to `prompt_len + generated - 2`). With `oracle`, the prefill
/// routes' top-k sets are also compared with transformers', allowing only near ties.
pub fn check_trace(
    trace: &Trace,
    cfg: &ModelConfig,
    prompt_len: usize,
    generated: usize,
    oracle: Option<&OraclePrompt>,
) -> TraceFindings {
    let mut f = TraceFindings::default();
    let h = &trace.header;
    let k = cfg.top_k;
    let e_count = cfg.num_experts;
    if h.num_experts_per_tok != k {
        f.violate(format!(
            "header num_experts_per_tok {} != config's {k}",
            h.num_experts_per_tok
        ));
    }
    if h.num_experts != e_count {
        f.violate(format!(
            "header num_experts {} != config's {e_count}",
            h.num_experts
        ));
    }
    if h.norm_topk_prob != cfg.norm_topk_prob {
        f.violate(format!(
            "header norm_topk_prob {} != config's {}",
            h.norm_topk_prob, cfg.norm_topk_prob
        ));
    }
    if h.renormalizes != cfg.renormalizes {
        f.violate(format!(
            "header renormalizes {} but the {} family {}",
            h.renormalizes,
            cfg.model_type,
            if cfg.renormalizes {
                "renormalises"
            } else {
                "does not renormalise"
            }
        ));
    }
    if h.moe_layers != cfg.moe_layers {
        f.violate(format!(
            "header moe_layers {:?} != the config's {:?}",
            h.moe_layers, cfg.moe_layers
        ));
    }

    // The exact sequence of (layer, position) the documented order implies.
    let layers = &cfg.moe_layers;
    let mut expected: Vec<(usize, usize, usize)> = Vec::new();
    for (m, &l) in layers.iter().enumerate() {
        for p in 0..prompt_len {
            expected.push((l, m, p));
        }
    }
    for p in prompt_len..(prompt_len + generated).saturating_sub(1) {
        for (m, &l) in layers.iter().enumerate() {
            expected.push((l, m, p));
        }
    }
    f.routes = trace.routes.len();
    f.moe_layers = layers.len();
    f.positions = (prompt_len + generated).saturating_sub(1);
    if trace.routes.len() != expected.len() {
        f.violate(format!(
            "{} route lines; {} MoE layers x {} positions need {}",
            trace.routes.len(),
            layers.len(),
            f.positions,
            expected.len()
        ));
    }
    for (i, (r, &(l, m, p))) in trace.routes.iter().zip(&expected).enumerate() {
        let at = format!("route {i} (layer {}, position {})", r.layer, r.position);
        if (r.layer, r.moe_layer, r.position) != (l, m, p) {
            f.violate(format!(
                "{at}: expected layer {l} (MoE layer {m}) position {p} in layer-then-position order, got layer {} (MoE layer {}) position {}",
                r.layer, r.moe_layer, r.position
            ));
            continue;
        }
        check_route(&mut f, r, cfg, &at);
    }

    if let Some(o) = oracle {
        for r in trace.routes.iter().filter(|r| r.position < prompt_len) {
            let Some(want) = o
                .router_topk
                .get(r.moe_layer)
                .and_then(|v| v.get(r.position))
            else {
                continue;
            };
            f.oracle_compared += 1;
            let mut a = r.experts.clone();
            let mut b = want.clone();
            a.sort_unstable();
            b.sort_unstable();
            if a != b {
                // transformers may break a near tie the other way; anything else is a real
                // routing difference.
                let gap = (r.kth_prob as f64 - r.next_prob.unwrap_or(0.0) as f64).abs();
                if gap <= 1e-6 {
                    f.oracle_near_ties += 1;
                } else {
                    f.violate(format!(
                        "layer {} position {}: top-k {a:?}, transformers {b:?} (k-th/next gap {gap:e})",
                        r.layer, r.position
                    ));
                }
            }
        }
    }
    f
}

fn check_route(f: &mut TraceFindings, r: &Route, cfg: &ModelConfig, at: &str) {
    let k = cfg.top_k;
    if r.experts.len() != k || r.probs.len() != k || r.weights.len() != k {
        f.violate(format!(
            "{at}: {} experts, {} probs, {} weights; top-k is {k}",
            r.experts.len(),
            r.probs.len(),
            r.weights.len()
        ));
        return;
    }
    let mut sorted = r.experts.clone();
    sorted.sort_unstable();
    sorted.dedup();
    if sorted.len() != k {
        f.violate(format!("{at}: experts {:?} repeat an expert", r.experts));
    }
    if let Some(&bad) = r.experts.iter().find(|&&e| e as usize >= cfg.num_experts) {
        f.violate(format!(
            "{at}: expert {bad} >= num_experts {}",
            cfg.num_experts
        ));
    }
    for (j, w) in r.probs.windows(2).enumerate() {
        // Descending; equal probabilities list the lower expert id first (EXACTNESS.md §2).
        let ok = w[0] > w[1] || (w[0] == w[1] && r.experts[j] < r.experts[j + 1]);
        if !ok {
            f.violate(format!(
                "{at}: probs not descending at {j}: {} then {} (experts {} then {})",
                w[0],
                w[1],
                r.experts[j],
                r.experts[j + 1]
            ));
            break;
        }
    }
    if r.probs
        .iter()
        .any(|p| !p.is_finite() || *p < 0.0 || *p > 1.0)
    {
        f.violate(format!("{at}: a probability outside [0, 1]: {:?}", r.probs));
    }
    if r.kth_prob != r.probs[k - 1] {
        f.violate(format!(
            "{at}: kth_prob {} is not the last selected prob {}",
            r.kth_prob,
            r.probs[k - 1]
        ));
    }
    match r.next_prob {
        None if k < cfg.num_experts => f.violate(format!("{at}: next_prob is null with k < E")),
        Some(n) if n > r.kth_prob => f.violate(format!(
            "{at}: an unselected expert has probability {n} > the k-th {}",
            r.kth_prob
        )),
        _ => {}
    }
    if cfg.renormalizes {
        let sum: f64 = r.probs.iter().map(|&p| p as f64).sum();
        let wsum: f64 = r.weights.iter().map(|&w| w as f64).sum();
        let err = (wsum - 1.0).abs();
        f.worst_weight_sum_error = f.worst_weight_sum_error.max(err);
        if err > WEIGHT_TOLERANCE {
            f.violate(format!("{at}: weights sum to {wsum}, not 1"));
        }
        for (j, (&w, &p)) in r.weights.iter().zip(&r.probs).enumerate() {
            let want = p as f64 / sum;
            if (w as f64 - want).abs() > WEIGHT_TOLERANCE * want.max(1e-30) {
                f.violate(format!("{at}: weight {j} is {w}, prob/sum is {want}"));
                break;
            }
        }
    } else if r.weights != r.probs {
        f.violate(format!(
            "{at}: weights {:?} differ from probs {:?} though the family does not renormalise",
            r.weights, r.probs
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(renorm: bool) -> ModelConfig {
        ModelConfig {
            model_type: "qwen3_moe".into(),
            vocab_size: 16,
            num_hidden_layers: 2,
            max_position_embeddings: Some(64),
            num_experts: 4,
            top_k: 2,
            norm_topk_prob: renorm,
            renormalizes: renorm,
            moe_layers: vec![0, 1],
        }
    }

    fn header(renorm: bool) -> String {
        format!(
            r#"{{"kind":"header","num_experts":4,"num_experts_per_tok":2,"norm_topk_prob":{renorm},"renormalizes":{renorm},"moe_layers":[0,1]}}"#
        )
    }

    fn route(l: usize, p: usize, experts: [u32; 2], probs: [f32; 2], renorm: bool) -> String {
        let s = probs[0] + probs[1];
        let w = if renorm {
            [probs[0] / s, probs[1] / s]
        } else {
            probs
        };
        let next = probs[1] * 0.5;
        format!(
            r#"{{"kind":"route","layer":{l},"moe_layer":{l},"position":{p},"experts":[{},{}],"probs":[{},{}],"weights":[{},{}],"kth_prob":{},"next_prob":{next}}}"#,
            experts[0], experts[1], probs[0], probs[1], w[0], w[1], probs[1]
        )
    }

    /// Prompt of 2 tokens, 2 generated: prefill positions 0, 1 per layer, then position 2.
    fn good_trace(renorm: bool) -> Vec<String> {
        let mut v = vec![header(renorm)];
        for l in 0..2 {
            for p in 0..2 {
                v.push(route(l, p, [2, 0], [0.5, 0.25], renorm));
            }
        }
        for l in 0..2 {
            v.push(route(l, 2, [1, 3], [0.4, 0.4], renorm));
        }
        v
    }

    fn run(lines: &[String], renorm: bool) -> TraceFindings {
        let t = Trace::parse(&lines.join("\n")).unwrap();
        check_trace(&t, &cfg(renorm), 2, 2, None)
    }

    #[test]
    fn a_well_formed_trace_holds() {
        for renorm in [true, false] {
            let f = run(&good_trace(renorm), renorm);
            assert!(f.held(), "{:?}", f.violations);
            assert_eq!((f.routes, f.positions), (6, 3));
        }
        let t = Trace::parse(&good_trace(true).join("\n")).unwrap();
        assert_eq!(
            t.used_experts(),
            [
                (0, 0),
                (0, 1),
                (0, 2),
                (0, 3),
                (1, 0),
                (1, 1),
                (1, 2),
                (1, 3)
            ]
        );
    }

    fn assert_violates(lines: &[String], renorm: bool, needle: &str) {
        let f = run(lines, renorm);
        assert!(!f.held(), "expected a violation containing {needle:?}");
        assert!(
            f.violations.iter().any(|v| v.contains(needle)),
            "{needle:?} not in {:?}",
            f.violations
        );
    }

    #[test]
    fn a_lowered_top_k_is_caught() {
        let mut t = good_trace(true);
        t[1] = t[1].replace(
            r#""experts":[2,0],"probs":[0.5,0.25]"#,
            r#""experts":[2],"probs":[0.5]"#,
        );
        assert_violates(&t, true, "1 experts, 1 probs, 2 weights");
        let mut t = good_trace(true);
        t[0] = t[0].replace(r#""num_experts_per_tok":2"#, r#""num_experts_per_tok":1"#);
        assert_violates(&t, true, "num_experts_per_tok 1 != config's 2");
    }

    #[test]
    fn repeated_out_of_range_and_misordered_experts_are_caught() {
        let mut t = good_trace(true);
        t[2] = t[2].replace("[2,0]", "[2,2]");
        assert_violates(&t, true, "repeat");
        let mut t = good_trace(true);
        t[2] = t[2].replace("[2,0]", "[2,4]");
        assert_violates(&t, true, ">= num_experts 4");
        let mut t = good_trace(true);
        t[2] = route(0, 1, [2, 0], [0.25, 0.5], true);
        assert_violates(&t, true, "not descending");
        // equal probabilities must list the lower id first
        let mut t = good_trace(true);
        t[5] = route(0, 2, [3, 1], [0.4, 0.4], true);
        assert_violates(&t, true, "not descending");
    }

    #[test]
    fn weights_that_do_not_sum_to_one_are_caught() {
        let mut t = good_trace(true);
        t[1] = route(0, 0, [2, 0], [0.5, 0.25], false); // weights = probs, sum 0.75
        assert_violates(&t, true, "sum to 0.75");
        // and a family that does not renormalise must report weights = probs
        let mut t = good_trace(false);
        t[1] = route(0, 0, [2, 0], [0.5, 0.25], true);
        assert_violates(&t, false, "does not renormalise");
    }

    #[test]
    fn missing_extra_and_misordered_lines_are_caught() {
        let mut t = good_trace(true);
        t.pop();
        assert_violates(&t, true, "5 route lines");
        let mut t = good_trace(true);
        t.swap(2, 3); // layer 0 position 1 after layer 1 position 0
        assert_violates(&t, true, "layer-then-position order");
        let mut t = good_trace(true);
        t.push(route(0, 3, [1, 3], [0.4, 0.4], true));
        assert_violates(&t, true, "7 route lines");
    }

    #[test]
    fn k_th_and_next_probabilities_are_checked() {
        let mut t = good_trace(true);
        t[1] = t[1].replace(r#""next_prob":0.125"#, r#""next_prob":0.3"#);
        assert_violates(&t, true, "unselected expert has probability 0.3");
        let mut t = good_trace(true);
        t[1] = t[1].replace(r#""kth_prob":0.25"#, r#""kth_prob":0.5"#);
        assert_violates(&t, true, "kth_prob 0.5");
    }

    #[test]
    fn a_header_that_disagrees_with_the_config_is_caught() {
        let mut t = good_trace(true);
        t[0] = t[0].replace(r#""moe_layers":[0,1]"#, r#""moe_layers":[1]"#);
        assert_violates(&t, true, "moe_layers [1]");
        let mut t = good_trace(true);
        t[0] = t[0].replace(r#""renormalizes":true"#, r#""renormalizes":false"#);
        assert_violates(&t, true, "renormalizes false");
    }

    #[test]
    fn malformed_lines_are_errors() {
        assert!(Trace::parse("").is_err());
        assert!(Trace::parse(&route(0, 0, [1, 2], [0.5, 0.25], true)).is_err());
        let t = format!("{}\n{{\"kind\":\"route\"}}", header(true));
        assert!(Trace::parse(&t).is_err());
    }

    #[test]
    fn oracle_sets_are_compared_and_only_near_ties_excused() {
        let t = Trace::parse(&good_trace(true).join("\n")).unwrap();
        let mut o = OraclePrompt {
            prompt: vec![0, 0],
            greedy: vec![],
            step_logits: crate::logits::Rows {
                cols: 1,
                data: vec![],
            },
            prefill_logits: crate::logits::Rows {
                cols: 1,
                data: vec![],
            },
            router_topk: vec![vec![vec![0, 2], vec![2, 0]], vec![vec![0, 2], vec![0, 2]]],
        };
        let f = check_trace(&t, &cfg(true), 2, 2, Some(&o));
        assert!(f.held());
        assert_eq!((f.oracle_compared, f.oracle_near_ties), (4, 0));
        o.router_topk[1][1] = vec![0, 1];
        let f = check_trace(&t, &cfg(true), 2, 2, Some(&o));
        assert!(
            f.violations
                .iter()
                .any(|v| v.contains("transformers [0, 1]")),
            "{:?}",
            f.violations
        );
    }
}
