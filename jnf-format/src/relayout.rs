//! The declared re-layouts of fused expert tensors (docs/FORMAT.md, "Fused experts"): how
//! one expert's slices of a checkpoint's fused tensors become the extent's `gate | up | down`
//! `[out, in]` matrices, and back. Each is a permutation of elements, generic over the element
//! (BF16 bits for the runtime, `[u8; 2]` for byte-level checks), so that the converter, the
//! runtime (tarfa-core) and `tarfa-verify check --source` apply this one definition.
//!
//! A manifest names the permutation an expert was re-laid with ([`Relayout::name`]); a reader
//! that does not know the name refuses the bundle.

/// A declared re-layout of a fused expert's slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Relayout {
    /// gpt-oss: `gate_up_proj[e]` `[H, 2I]` with gate and up interleaved by column (column
    /// `2j` is gate row `j`, `2j+1` up row `j`) and `down_proj[e]` `[I, H]`:
    /// `gate[j][x] = gu[x][2j]`, `up[j][x] = gu[x][2j+1]`, `down[y][j] = d[j][y]`.
    GateUpInterleavedColumns,
    /// Llama 4: `gate_up_proj[e]` `[H, 2I]` with gate in the first I columns and up in the
    /// last I (`gate[j][x] = gu[x][j]`, `up[j][x] = gu[x][I+j]`), `down_proj[e]` as above.
    GateUpConcatenatedColumns,
}

impl Relayout {
    const ALL: [Relayout; 2] = [
        Relayout::GateUpInterleavedColumns,
        Relayout::GateUpConcatenatedColumns,
    ];

    /// The name the manifest records.
    pub fn name(self) -> &'static str {
        match self {
            Relayout::GateUpInterleavedColumns => "gate_up_interleaved_columns",
            Relayout::GateUpConcatenatedColumns => "gate_up_concatenated_columns",
        }
    }

    /// The re-layout a manifest names, if it is one this crate declares.
    pub fn from_name(s: &str) -> Option<Relayout> {
        Self::ALL.into_iter().find(|r| r.name() == s)
    }

    /// The columns of `gate_up_proj` holding gate row `j` and up row `j` of an expert of
    /// width `i`.
    pub fn gate_up_columns(self, j: usize, i: usize) -> (usize, usize) {
        match self {
            Relayout::GateUpInterleavedColumns => (2 * j, 2 * j + 1),
            Relayout::GateUpConcatenatedColumns => (j, i + j),
        }
    }

    /// Expert slices `(gate_up [H, 2I], down [I, H])` into `gate | up | down` (`[I, H]`,
    /// `[I, H]`, `[H, I]`), concatenated. Panics if the slices are not `2HI` and `IH` long.
    pub fn to_extent<T: Copy>(self, gate_up: &[T], down: &[T], h: usize, i: usize) -> Vec<T> {
        assert_eq!(gate_up.len(), 2 * h * i, "gate_up slice is [H, 2I]");
        assert_eq!(down.len(), h * i, "down slice is [I, H]");
        let mut out = Vec::with_capacity(3 * h * i);
        for part in [0, 1] {
            for j in 0..i {
                let (cg, cu) = self.gate_up_columns(j, i);
                let c = if part == 0 { cg } else { cu };
                out.extend((0..h).map(|x| gate_up[x * 2 * i + c]));
            }
        }
        for y in 0..h {
            out.extend((0..i).map(|j| down[j * h + y]));
        }
        out
    }

    /// The inverse of [`Relayout::to_extent`]: `gate | up | down` back into the fused slices
    /// `(gate_up [H, 2I], down [I, H])`.
    pub fn to_fused<T: Copy + Default>(self, extent: &[T], h: usize, i: usize) -> (Vec<T>, Vec<T>) {
        assert_eq!(extent.len(), 3 * h * i, "gate | up | down");
        let (gate, rest) = extent.split_at(h * i);
        let (up, down) = rest.split_at(h * i);
        let mut gu = vec![T::default(); 2 * h * i];
        let mut d = vec![T::default(); h * i];
        for j in 0..i {
            let (cg, cu) = self.gate_up_columns(j, i);
            for x in 0..h {
                gu[x * 2 * i + cg] = gate[j * h + x];
                gu[x * 2 * i + cu] = up[j * h + x];
            }
        }
        for y in 0..h {
            for j in 0..i {
                d[j * h + y] = down[y * i + j];
            }
        }
        (gu, d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_interleaved_relayout_is_an_invertible_permutation() {
        let (h, i) = (6, 4);
        let r = Relayout::GateUpInterleavedColumns;
        let gu: Vec<u32> = (0..(2 * h * i) as u32).collect();
        let d: Vec<u32> = (1000..1000 + (h * i) as u32).collect();
        let ext = r.to_extent(&gu, &d, h, i);
        // gate row 1, column 2 is gu[2][2]; up row 1, column 2 is gu[2][3]; down row 3,
        // column 1 is d[1][3]
        assert_eq!(ext[h + 2], gu[2 * 2 * i + 2]);
        assert_eq!(ext[h * i + h + 2], gu[2 * 2 * i + 3]);
        assert_eq!(ext[2 * h * i + 3 * i + 1], d[h + 3]);
        let mut sorted = ext.clone();
        sorted.sort_unstable();
        let mut all: Vec<u32> = gu.iter().chain(&d).copied().collect();
        all.sort_unstable();
        assert_eq!(sorted, all, "a permutation: every element once");
        assert_eq!(r.to_fused(&ext, h, i), (gu, d));
        assert_eq!(Relayout::from_name(r.name()), Some(r));
        assert_eq!(Relayout::from_name("transpose"), None);
    }

    #[test]
    fn the_concatenated_relayout_is_an_invertible_permutation() {
        let (h, i) = (5, 3);
        let r = Relayout::GateUpConcatenatedColumns;
        let gu: Vec<u32> = (0..(2 * h * i) as u32).collect();
        let d: Vec<u32> = (1000..1000 + (h * i) as u32).collect();
        let ext = r.to_extent(&gu, &d, h, i);
        // gate row 1, column 2 is gu[2][1]; up row 1, column 2 is gu[2][I + 1]
        assert_eq!(ext[h + 2], gu[2 * 2 * i + 1]);
        assert_eq!(ext[h * i + h + 2], gu[2 * 2 * i + i + 1]);
        let mut sorted = ext.clone();
        sorted.sort_unstable();
        let mut all: Vec<u32> = gu.iter().chain(&d).copied().collect();
        all.sort_unstable();
        assert_eq!(sorted, all, "a permutation: every element once");
        assert_eq!(r.to_fused(&ext, h, i), (gu, d));
        assert_eq!(Relayout::from_name(r.name()), Some(r));
    }
}
