//! Test tiles for the MMA: one tile is the input of one `m16n8k16` MMA, i.e. 128 cases (each
//! output element is one fused dot of 16 products plus its accumulator). A tile's values come
//! from a [`Mode`], chosen by the tile's index, and a generator seeded by (seed, index), so a
//! counterexample is reproducible from its numbers alone.

/// A tile: `a[row][k]` (16 x 16 BF16), `b[col][k]` (8 columns of 16 BF16, i.e. B stored
/// column-major), `c[row][col]` (16 x 8 f32 bits).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tile {
    pub a: [[u16; 16]; 16],
    pub b: [[u16; 16]; 8],
    pub c: [[u32; 8]; 16],
}

/// The families of inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Uniformly random bit patterns (every class: NaN, inf, subnormal, zero).
    RandomBits,
    /// Finite values of moderate magnitude (exponents within 2^-7..2^7).
    Normal,
    /// Exponents across the whole finite range.
    FullSpread,
    /// Exponents within 40 of a base: terms land around the 25-bit truncation boundary.
    NearSpread,
    /// Products that cancel in pairs (a, -a against b, b + few ulps), and c near the negated sum.
    Cancel,
    /// Subnormal and tiny inputs, subnormal accumulators and results.
    Subnormal,
    /// Many zero operands paired with large values (does a zero product's exponent count?).
    Zeros,
    /// A dominant accumulator and products 20..30 binades below with full significands: the
    /// truncated bits and the final rounding decide the last bits.
    Ties,
    /// Finite values with infinities, NaNs and signed zeros sprinkled in.
    Specials,
    /// Exponents near the top: sums at and beyond f32's range.
    Overflow,
    /// All products zero, with signs, and c = +-0 or tiny.
    SignedZeros,
}

/// Every mode, in the order tiles cycle through them.
pub const MODES: [Mode; 11] = [
    Mode::RandomBits,
    Mode::Normal,
    Mode::FullSpread,
    Mode::NearSpread,
    Mode::Cancel,
    Mode::Subnormal,
    Mode::Zeros,
    Mode::Ties,
    Mode::Specials,
    Mode::Overflow,
    Mode::SignedZeros,
];

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::RandomBits => "random-bits",
            Mode::Normal => "normal",
            Mode::FullSpread => "full-spread",
            Mode::NearSpread => "near-spread",
            Mode::Cancel => "cancel",
            Mode::Subnormal => "subnormal",
            Mode::Zeros => "zeros",
            Mode::Ties => "ties",
            Mode::Specials => "specials",
            Mode::Overflow => "overflow",
            Mode::SignedZeros => "signed-zeros",
        }
    }

    /// The mode of tile `index`: the normal-ish modes get a larger share.
    pub fn of_tile(index: u64) -> Mode {
        // 16 slots: the "interesting arithmetic" modes twice.
        const SLOTS: [usize; 16] = [0, 1, 2, 3, 3, 4, 4, 5, 6, 7, 7, 8, 9, 10, 1, 4];
        MODES[SLOTS[(index % 16) as usize]]
    }
}

/// splitmix64.
#[derive(Clone, Debug)]
pub struct Rng(u64);

#[allow(clippy::should_implement_trait)]
impl Rng {
    pub fn new(seed: u64, index: u64) -> Rng {
        let mut r = Rng(seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        r.next();
        r
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next() >> 32) * n) >> 32
    }
    pub fn range(&mut self, lo: i64, hi: i64) -> i64 {
        lo + self.below((hi - lo + 1) as u64) as i64
    }
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }
}

/// A BF16 from sign, biased exponent (0..=254) and 7 mantissa bits.
fn bf(sign: bool, be: i64, man: u64) -> u16 {
    ((sign as u16) << 15) | ((be.clamp(0, 255) as u16) << 7) | (man as u16 & 0x7F)
}
/// An f32 from sign, biased exponent and 23 mantissa bits.
fn f(sign: bool, be: i64, man: u64) -> u32 {
    ((sign as u32) << 31) | ((be.clamp(0, 255) as u32) << 23) | (man as u32 & 0x7F_FFFF)
}

/// A tile of `mode` from generator `r`.
pub fn gen_tile(mode: Mode, r: &mut Rng) -> Tile {
    let mut t = Tile::default();
    match mode {
        Mode::RandomBits => {
            fill(&mut t, r, |r| r.next() as u16, |r| r.next() as u32);
        }
        Mode::Normal => fill(
            &mut t,
            r,
            |r| bf(r.chance(1, 2), r.range(120, 134), r.next()),
            |r| {
                if r.chance(1, 8) {
                    0
                } else {
                    f(r.chance(1, 2), r.range(118, 140), r.next())
                }
            },
        ),
        Mode::FullSpread => fill(
            &mut t,
            r,
            |r| bf(r.chance(1, 2), r.range(0, 254), r.next()),
            |r| f(r.chance(1, 2), r.range(0, 254), r.next()),
        ),
        Mode::NearSpread => {
            let base = r.range(40, 200);
            let bb = r.range(100, 150);
            let w = r.range(0, 40);
            fill(
                &mut t,
                r,
                |r| bf(r.chance(1, 2), base - r.range(0, w), r.next()),
                |r| f(r.chance(1, 2), base + bb - 127 - r.range(-2, w), r.next()),
            );
            for col in t.b.iter_mut() {
                for v in col.iter_mut() {
                    *v = bf(r.chance(1, 2), bb - r.range(0, w / 2), r.next());
                }
            }
        }
        Mode::Cancel => {
            let base = r.range(100, 150);
            for row in t.a.iter_mut() {
                for k in (0..16).step_by(2) {
                    let v = bf(r.chance(1, 2), base + r.range(-3, 3), r.next());
                    row[k] = v;
                    row[k + 1] = if r.chance(7, 8) {
                        v ^ 0x8000
                    } else {
                        v ^ 0x8001
                    };
                }
            }
            for col in t.b.iter_mut() {
                for k in (0..16).step_by(2) {
                    let v = bf(r.chance(1, 2), base + r.range(-3, 3), r.next());
                    col[k] = v;
                    // the partner differs by a few ulps (maybe none): a tiny exact remainder
                    let d = r.range(-2, 2) as i32;
                    col[k + 1] = (v as i32 + d).clamp(0, 0xFFFF) as u16;
                }
            }
            for i in 0..16 {
                for j in 0..8 {
                    t.c[i][j] = match r.below(4) {
                        0 => 0,
                        1 => f(r.chance(1, 2), 2 * base - 254 + r.range(-30, 0), r.next()),
                        _ => {
                            // c = -(the exact sum rounded to f32), so the result is the
                            // rounding residue
                            let s: f64 = (0..16).map(|k| bf16v(t.a[i][k]) * bf16v(t.b[j][k])).sum();
                            (-(s as f32)).to_bits()
                        }
                    };
                }
            }
        }
        Mode::Subnormal => fill(
            &mut t,
            r,
            |r| {
                if r.chance(1, 2) {
                    bf(r.chance(1, 2), 0, r.next())
                } else {
                    bf(r.chance(1, 2), r.range(1, 70), r.next())
                }
            },
            |r| match r.below(3) {
                0 => f(r.chance(1, 2), 0, r.next()),
                1 => 0,
                _ => f(r.chance(1, 2), r.range(1, 3), r.next()),
            },
        ),
        Mode::Zeros => {
            fill(
                &mut t,
                r,
                |r| {
                    if r.chance(1, 2) {
                        if r.chance(1, 2) {
                            0x0000
                        } else {
                            0x8000
                        }
                    } else {
                        bf(r.chance(1, 2), r.range(100, 254), r.next())
                    }
                },
                |r| f(r.chance(1, 2), r.range(0, 160), r.next()),
            );
        }
        Mode::Ties => {
            let ce = r.range(60, 200);
            let off = r.range(18, 32);
            fill(
                &mut t,
                r,
                |r| bf(r.chance(1, 2), r.range(120, 134), r.next()),
                |r| f(r.chance(1, 2), ce + r.range(0, 1), r.next()),
            );
            for row in t.a.iter_mut() {
                for v in row.iter_mut() {
                    *v = bf(r.chance(1, 2), ce - off - r.range(0, 6), r.next() | 0x40);
                }
            }
            for col in t.b.iter_mut() {
                for v in col.iter_mut() {
                    *v = bf(r.chance(1, 2), 127 + r.range(-1, 1), r.next());
                }
            }
        }
        Mode::Specials => fill(
            &mut t,
            r,
            |r| match r.below(24) {
                0 => 0x7F80,
                1 => 0xFF80,
                2 => 0x7FC0 | (r.next() as u16 & 0x3F),
                3 => 0xFF81,
                4 => 0x0000,
                5 => 0x8000,
                _ => bf(r.chance(1, 2), r.range(110, 144), r.next()),
            },
            |r| match r.below(10) {
                0 => 0x7F80_0000,
                1 => 0xFF80_0000,
                2 => 0x7FC0_0000,
                3 => 0x8000_0000,
                4 => 0,
                _ => f(r.chance(1, 2), r.range(110, 144), r.next()),
            },
        ),
        Mode::Overflow => fill(
            &mut t,
            r,
            |r| bf(r.chance(1, 4), r.range(180, 254), r.next()),
            |r| match r.below(3) {
                0 => 0x7F7F_FFFF ^ ((r.chance(1, 2) as u32) << 31),
                _ => f(r.chance(1, 2), r.range(240, 254), r.next()),
            },
        ),
        Mode::SignedZeros => fill(
            &mut t,
            r,
            |r| {
                if r.chance(3, 4) {
                    (r.chance(1, 2) as u16) << 15
                } else {
                    bf(r.chance(1, 2), r.range(0, 254), r.next())
                }
            },
            |r| match r.below(3) {
                0 => 0x8000_0000,
                1 => 0,
                _ => f(r.chance(1, 2), r.range(0, 2), r.next()),
            },
        ),
    }
    if mode == Mode::SignedZeros {
        // make every product zero: for each k, zero either all of A's column or all of B's row
        for k in 0..16 {
            if r.chance(1, 2) {
                for row in t.a.iter_mut() {
                    row[k] &= 0x8000;
                }
            } else {
                for col in t.b.iter_mut() {
                    col[k] &= 0x8000;
                }
            }
        }
    }
    t
}

fn bf16v(b: u16) -> f64 {
    f32::from_bits((b as u32) << 16) as f64
}

fn fill(
    t: &mut Tile,
    r: &mut Rng,
    mut ab: impl FnMut(&mut Rng) -> u16,
    mut c: impl FnMut(&mut Rng) -> u32,
) {
    for row in t.a.iter_mut() {
        for v in row.iter_mut() {
            *v = ab(r);
        }
    }
    for col in t.b.iter_mut() {
        for v in col.iter_mut() {
            *v = ab(r);
        }
    }
    for row in t.c.iter_mut() {
        for v in row.iter_mut() {
            *v = c(r);
        }
    }
}

/// Tile `index` of the run with `seed`, and its mode.
pub fn tile(seed: u64, index: u64) -> (Mode, Tile) {
    let mode = Mode::of_tile(index);
    let mut r = Rng::new(seed, index);
    (mode, gen_tile(mode, &mut r))
}

/// The smoke tile: small integers, exact under any model, so a mismatch there is a fragment-
/// layout bug of the harness, not an arithmetic result.
pub fn smoke_tile() -> Tile {
    let mut t = Tile::default();
    let b = |v: i32| ((v as f32).to_bits() >> 16) as u16;
    for i in 0..16 {
        for k in 0..16 {
            t.a[i][k] = b(((i * 3 + k * 7) % 11) as i32 - 5 + (i as i32) * 16);
        }
    }
    for j in 0..8 {
        for k in 0..16 {
            t.b[j][k] = b(((k * 5 + j * 3) % 7) as i32 - 3 + (k as i32 % 2) * (j as i32 + 1));
        }
    }
    for i in 0..16 {
        for j in 0..8 {
            t.c[i][j] = ((i as f32) * 1000.0 + j as f32).to_bits();
        }
    }
    t
}
