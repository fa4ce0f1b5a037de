//! One expert's matrices out of fused expert tensors (gpt-oss's, Llama 4's; docs/FORMAT.md,
//! "Fused experts"): the declared re-layout from the checkpoint's orientation into the runtime's
//! `[out, in]` gate, up and down, and its inverse. The two families differ only in which
//! columns of `gate_up_proj` hold gate and up ([`ExpertLayout::gate_up_columns`]). Both are pure permutations of BF16 values
//! (the BF16 form) or an exact widening followed by one (the MXFP4 form): no value changes.

use super::{Bf16Matrix, ExpertWeights};
use crate::model::ExpertLayout;
use crate::numerics::mxfp4::{widen_rows, Mxfp4Error};
use crate::numerics::AlignedVec;

fn matrix(rows: usize, cols: usize, v: Vec<u16>) -> Bf16Matrix {
    Bf16Matrix {
        rows,
        cols,
        data: AlignedVec::from_slice(&v),
    }
}

/// gpt-oss's [`expert_from_fused`]: gate and up interleaved by column.
pub fn expert_from_fused_bf16(gate_up: &[u16], down: &[u16], h: usize, i: usize) -> ExpertWeights {
    expert_from_fused(ExpertLayout::FusedInterleaved, gate_up, down, h, i)
}

/// Expert `e`'s slice of `gate_up_proj` (`[H, 2I]`) and of `down_proj` (`[I, H]`) as the
/// runtime's matrices: with `(cg, cu)` the layout's gate/up columns of row `j` (gpt-oss
/// `(2j, 2j+1)`, Llama 4 `(j, I+j)`), `gate[j][x] = gu[x][cg]`, `up[j][x] = gu[x][cu]`,
/// `down[y][j] = d[j][y]`. The permutation is the one the bundle format declares
/// ([`jnf_format::Relayout`]), which the converter applies and `tarfa-verify check --source` re-applies.
/// `layout` must be a fused one.
pub fn expert_from_fused(
    layout: ExpertLayout,
    gate_up: &[u16],
    down: &[u16],
    h: usize,
    i: usize,
) -> ExpertWeights {
    let r = layout.relayout().expect("a fused expert layout");
    let ext = r.to_extent(gate_up, down, h, i);
    ExpertWeights {
        gate: matrix(i, h, ext[..i * h].to_vec()),
        up: matrix(i, h, ext[i * h..2 * i * h].to_vec()),
        down: matrix(h, i, ext[2 * i * h..].to_vec()),
    }
}

/// The inverse of [`expert_from_fused_bf16`]: the fused slices `(gate_up [H, 2I], down [I, H])`
/// of an expert's matrices. The tests use it to prove the re-layout loses nothing.
pub fn fused_bf16_from_expert(e: &ExpertWeights, h: usize, i: usize) -> (Vec<u16>, Vec<u16>) {
    fused_from_expert(ExpertLayout::FusedInterleaved, e, h, i)
}

/// The inverse of [`expert_from_fused`] under `layout` (a fused one).
pub fn fused_from_expert(
    layout: ExpertLayout,
    e: &ExpertWeights,
    h: usize,
    i: usize,
) -> (Vec<u16>, Vec<u16>) {
    let ext: Vec<u16> = [&e.gate.data, &e.up.data, &e.down.data]
        .iter()
        .flat_map(|d| d.iter().copied())
        .collect();
    layout
        .relayout()
        .expect("a fused expert layout")
        .to_fused(&ext, h, i)
}

/// Which MXFP4 tensor a block that cannot be widened is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mxfp4Part {
    GateUp,
    Down,
}

/// Expert `e`'s MXFP4 slices (gate_up: `2I` rows of `H` values; down: `H` rows of `I` values,
/// both `[out, in]`) widened exactly into the runtime's matrices: gate is rows `2j`, up rows
/// `2j+1`, down as it is.
pub fn expert_from_mxfp4(
    gate_up_blocks: &[u8],
    gate_up_scales: &[u8],
    down_blocks: &[u8],
    down_scales: &[u8],
    h: usize,
    i: usize,
) -> Result<ExpertWeights, (Mxfp4Part, Mxfp4Error)> {
    let gu = |rows: Box<dyn Iterator<Item = usize>>| {
        let mut v = Vec::with_capacity(i * h);
        widen_rows(gate_up_blocks, gate_up_scales, h, rows, &mut v)
            .map_err(|e| (Mxfp4Part::GateUp, e))?;
        Ok(v)
    };
    let gate = gu(Box::new((0..i).map(|j| 2 * j)))?;
    let up = gu(Box::new((0..i).map(|j| 2 * j + 1)))?;
    let mut dn = Vec::with_capacity(h * i);
    widen_rows(down_blocks, down_scales, i, 0..h, &mut dn).map_err(|e| (Mxfp4Part::Down, e))?;
    Ok(ExpertWeights {
        gate: matrix(i, h, gate),
        up: matrix(i, h, up),
        down: matrix(h, i, dn),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bf16_relayout_is_an_invertible_permutation() {
        let (h, i) = (6, 4);
        let gu: Vec<u16> = (0..(h * 2 * i) as u16).collect();
        let d: Vec<u16> = (1000..1000 + (i * h) as u16).collect();
        let e = expert_from_fused_bf16(&gu, &d, h, i);
        // gate row 1, column 2 is gate_up[2][2]; up row 1, column 2 is gate_up[2][3]
        assert_eq!(e.gate.data[h + 2], gu[2 * 2 * i + 2]);
        assert_eq!(e.up.data[h + 2], gu[2 * 2 * i + 3]);
        assert_eq!(e.down.data[3 * i + 1], d[h + 3]);
        assert_eq!(fused_bf16_from_expert(&e, h, i), (gu.clone(), d.clone()));
        // Llama 4: gate is the first half of the columns, up the second
        let l = ExpertLayout::FusedConcatenated;
        let e = expert_from_fused(l, &gu, &d, h, i);
        assert_eq!(e.gate.data[h + 2], gu[2 * 2 * i + 1]);
        assert_eq!(e.up.data[h + 2], gu[2 * 2 * i + i + 1]);
        assert_eq!(e.down.data[3 * i + 1], d[h + 3]);
        assert_eq!(fused_from_expert(l, &e, h, i), (gu, d));
    }
}
