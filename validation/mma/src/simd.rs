//! The candidate dot product ([`crate::model::dot_v2`] under [`Params::HOPPER`]) computed fast
//! on the CPU, for the cost figures: the activation is split and decoded once ([`Prepared`]),
//! then each row takes, per 16-chunk and split part, one AVX-512 step: exponents added, the
//! maximum reduced, significands multiplied, aligned with a variable shift (truncating), signed
//! and summed; the accumulator is normalised in scalar code. Any chunk with an infinity or NaN
//! (in the row or the activation) is computed by the scalar model. Same bits as the model
//! (tested in tests/simd.rs).

use crate::model::{self, Params};

/// An activation split into three BF16 parts, decoded per element.
pub struct Prepared {
    len: usize,
    /// Per part: nominal exponent (-126 for zero and subnormals) per element, padded to 16.
    e: [Vec<i32>; 3],
    /// Per part: significand (hidden bit included) with the sign in bit 31.
    m: [Vec<u32>; 3],
    /// Per chunk: whether the activation has a non-finite value there.
    special: Vec<bool>,
    /// The raw values (for the scalar fallback).
    raw: Vec<f32>,
}

impl Prepared {
    pub fn new(x: &[f32]) -> Prepared {
        let padded = x.len().div_ceil(16) * 16;
        let mut e: [Vec<i32>; 3] = std::array::from_fn(|_| vec![-126; padded]);
        let mut m: [Vec<u32>; 3] = std::array::from_fn(|_| vec![0; padded]);
        let mut special = vec![false; padded / 16];
        for (i, &v) in x.iter().enumerate() {
            if !v.is_finite() {
                special[i / 16] = true;
            }
            for (j, part) in model::split3(v).into_iter().enumerate() {
                let be = ((part >> 7) & 0xFF) as i32;
                let man = (part & 0x7F) as u32;
                e[j][i] = if be == 0 { -126 } else { be - 127 };
                m[j][i] = (if be == 0 { man } else { man | 0x80 }) | (((part >> 15) as u32) << 31);
            }
        }
        Prepared {
            len: x.len(),
            e,
            m,
            special,
            raw: x.to_vec(),
        }
    }
}

/// The candidate dot of BF16 row `w` with `x` (scalar model code when AVX-512 is missing).
pub fn dot_v2(w: &[u16], x: &Prepared) -> f32 {
    assert_eq!(w.len(), x.len);
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512dq")
        && std::arch::is_x86_feature_detected!("avx512bw")
    {
        // SAFETY: the features were just detected.
        return unsafe { avx512::dot(w, x) };
    }
    model::dot_v2(w, &x.raw, &Params::HOPPER)
}

/// Decodes the accumulator: (sign, significand, exponent) of an f32 (finite).
#[inline(always)]
fn dec_acc(c: u32) -> (bool, u64, i32) {
    let be = ((c >> 23) & 0xFF) as i32;
    let m = (c & 0x7F_FFFF) as u64;
    if be == 0 {
        (c >> 31 != 0, m, -126)
    } else {
        (c >> 31 != 0, m | 0x80_0000, be - 127)
    }
}

/// The scalar fallback for one chunk (specials): three MMAs of the model.
#[allow(clippy::needless_range_loop)]
fn chunk_scalar(w: &[u16], x: &Prepared, c0: usize, acc: u32, from_part: usize) -> u32 {
    let mut a = [0u16; 16];
    let n = (x.len - c0).min(16);
    a[..n].copy_from_slice(&w[c0..c0 + n]);
    let mut parts = [[0u16; 16]; 3];
    for i in 0..n {
        let s = model::split3(x.raw[c0 + i]);
        for j in 0..3 {
            parts[j][i] = s[j];
        }
    }
    let mut acc = acc;
    for p in &parts[from_part..] {
        acc = model::mma_elem(&a, p, acc, &Params::HOPPER);
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx2")]
    pub unsafe fn dot(w: &[u16], x: &Prepared) -> f32 {
        let n = x.len;
        let full = n / 16;
        let mut acc = 0u32;
        let zero = _mm512_setzero_si512();
        let ff = _mm512_set1_epi32(0xFF);
        let x7f = _mm512_set1_epi32(0x7F);
        let x80 = _mm512_set1_epi32(0x80);
        let one = _mm512_set1_epi32(1);
        let bias = _mm512_set1_epi32(127);
        for c in 0..n.div_ceil(16) {
            let c0 = c * 16;
            let wv = if c < full {
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(w.as_ptr().add(c0) as *const __m256i))
            } else {
                let mut t = [0u16; 16];
                t[..n - c0].copy_from_slice(&w[c0..]);
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(t.as_ptr() as *const __m256i))
            };
            let be = _mm512_and_si512(_mm512_srli_epi32(wv, 7), ff);
            if x.special[c]
                || acc & 0x7F80_0000 == 0x7F80_0000
                || _mm512_cmpeq_epi32_mask(be, ff) != 0
            {
                acc = chunk_scalar(w, x, c0, acc, 0);
                continue;
            }
            let norm = _mm512_cmpneq_epi32_mask(be, zero);
            let wm = _mm512_mask_or_epi32(
                _mm512_and_si512(wv, x7f),
                norm,
                _mm512_and_si512(wv, x7f),
                x80,
            );
            let we = _mm512_sub_epi32(_mm512_max_epi32(be, one), bias);
            let ws = _mm512_slli_epi32(wv, 16);
            for p in 0..3 {
                if acc & 0x7F80_0000 == 0x7F80_0000 {
                    // an overflow to infinity inside the chunk: the rest by the model
                    acc = chunk_scalar(w, x, c0, acc, p);
                    break;
                }
                let xe = _mm512_loadu_si512(x.e[p].as_ptr().add(c0) as *const _);
                let xm = _mm512_loadu_si512(x.m[p].as_ptr().add(c0) as *const _);
                let e = _mm512_add_epi32(we, xe);
                let emax_p = _mm512_reduce_max_epi32(e);
                let (cs, cm, ce) = dec_acc(acc);
                let emax = emax_p.max(ce);
                let m =
                    _mm512_mullo_epi32(wm, _mm512_and_si512(xm, _mm512_set1_epi32(0x7FFF_FFFF)));
                let d = _mm512_sub_epi32(_mm512_set1_epi32(emax), e);
                let v = _mm512_srlv_epi32(_mm512_slli_epi32(m, 11), d);
                let neg = _mm512_movepi32_mask(_mm512_xor_si512(ws, xm));
                let v = _mm512_mask_sub_epi32(v, neg, zero, v);
                let mut sum = _mm512_reduce_add_epi32(v) as i64;
                let sh = (emax - ce) as u32;
                let cv = if sh >= 64 {
                    0
                } else {
                    ((cm << 2) >> sh) as i64
                };
                sum += if cs { -cv } else { cv };
                acc = model::to_f32(sum, emax - 25, &Params::HOPPER);
            }
        }
        f32::from_bits(acc)
    }
}

/// 16 rows of BF16 weights repacked for [`dot_rows16`]: per 16-chunk of k, per k, the 16 rows'
/// values side by side (a load-time layout a CPU backend would keep; zero-padded in k).
pub struct Rows16 {
    k: usize,
    data: Vec<u16>,
}

impl Rows16 {
    /// `rows`: 16 rows of `k` BF16 values, row-major.
    pub fn new(rows: &[u16], k: usize) -> Rows16 {
        assert_eq!(rows.len(), 16 * k);
        let chunks = k.div_ceil(16);
        let mut data = vec![0u16; chunks * 256];
        for r in 0..16 {
            for i in 0..k {
                data[(i / 16) * 256 + (i % 16) * 16 + r] = rows[r * k + i];
            }
        }
        Rows16 { k, data }
    }

    fn row_chunk(&self, r: usize, c: usize) -> [u16; 16] {
        std::array::from_fn(|i| self.data[c * 256 + i * 16 + r])
    }
}

/// The candidate dots of 16 rows with `x`, vectorised across the rows (one lane per row: the
/// maximum is a vertical max, no horizontal reductions, the normalisation in vector code).
/// Same bits as [`crate::model::dot_v2`] per row.
pub fn dot_rows16(w: &Rows16, x: &Prepared) -> [f32; 16] {
    assert_eq!(w.k, x.len);
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512dq")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512cd")
    {
        // SAFETY: the features were just detected.
        return unsafe { rows16::dot(w, x) };
    }
    std::array::from_fn(|r| {
        let row: Vec<u16> = (0..w.k)
            .map(|i| w.data[(i / 16) * 256 + (i % 16) * 16 + r])
            .collect();
        model::dot_v2(&row, &x.raw, &Params::HOPPER)
    })
}

#[cfg(target_arch = "x86_64")]
mod rows16 {
    use super::*;
    use std::arch::x86_64::*;

    /// RZ normalisation of 8 signed sums with per-lane scales (`sum * 2^scale`) to f32 bits.
    #[inline(always)]
    unsafe fn norm8(s: __m512i, scale: __m512i) -> __m256i {
        let zero = _mm512_setzero_si512();
        let neg = _mm512_cmplt_epi64_mask(s, zero);
        let mag = _mm512_abs_epi64(s);
        let msb = _mm512_sub_epi64(_mm512_set1_epi64(63), _mm512_lzcnt_epi64(mag));
        let e = _mm512_add_epi64(msb, scale);
        let normal = _mm512_cmpge_epi64_mask(e, _mm512_set1_epi64(-126));
        let sh = _mm512_mask_blend_epi64(
            normal,
            _mm512_sub_epi64(_mm512_set1_epi64(-149), scale),
            _mm512_sub_epi64(msb, _mm512_set1_epi64(23)),
        );
        let right = _mm512_cmpge_epi64_mask(sh, zero);
        let q = _mm512_mask_blend_epi64(
            right,
            _mm512_sllv_epi64(mag, _mm512_sub_epi64(zero, sh)),
            _mm512_srlv_epi64(mag, sh),
        );
        let bn = _mm512_or_si512(
            _mm512_slli_epi64(_mm512_add_epi64(e, _mm512_set1_epi64(127)), 23),
            _mm512_and_si512(q, _mm512_set1_epi64(0x7F_FFFF)),
        );
        let mut bits = _mm512_mask_blend_epi64(normal, q, bn);
        let over = _mm512_cmpge_epi64_mask(e, _mm512_set1_epi64(128));
        bits = _mm512_mask_mov_epi64(bits, over, _mm512_set1_epi64(0x7F80_0000));
        let nz = _mm512_cmpneq_epi64_mask(bits, zero) & !_mm512_cmpeq_epi64_mask(mag, zero);
        bits = _mm512_maskz_mov_epi64(nz, bits);
        bits = _mm512_mask_or_epi64(bits, neg & nz, bits, _mm512_set1_epi64(0x8000_0000));
        _mm512_cvtepi64_epi32(bits)
    }

    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512cd,avx2")]
    pub unsafe fn dot(w: &Rows16, x: &Prepared) -> [f32; 16] {
        let zero = _mm512_setzero_si512();
        let ff = _mm512_set1_epi32(0xFF);
        let x7f = _mm512_set1_epi32(0x7F);
        let x80 = _mm512_set1_epi32(0x80);
        let one = _mm512_set1_epi32(1);
        let bias = _mm512_set1_epi32(127);
        let fin = _mm512_set1_epi32(0x7F80_0000);
        let mut acc = zero; // 16 f32 bit patterns, +0
        for c in 0..w.k.div_ceil(16) {
            let c0 = c * 16;
            let mut we = [zero; 16];
            let mut wm = [zero; 16];
            let mut ws = [zero; 16];
            let mut special =
                x.special[c] || _mm512_cmpeq_epi32_mask(_mm512_and_si512(acc, fin), fin) != 0;
            for k in 0..16 {
                let wv = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                    w.data.as_ptr().add(c * 256 + k * 16) as *const __m256i,
                ));
                let be = _mm512_and_si512(_mm512_srli_epi32(wv, 7), ff);
                special |= _mm512_cmpeq_epi32_mask(be, ff) != 0;
                let norm = _mm512_cmpneq_epi32_mask(be, zero);
                wm[k] = _mm512_mask_or_epi32(
                    _mm512_and_si512(wv, x7f),
                    norm,
                    _mm512_and_si512(wv, x7f),
                    x80,
                );
                we[k] = _mm512_sub_epi32(_mm512_max_epi32(be, one), bias);
                ws[k] = _mm512_slli_epi32(wv, 16);
            }
            if special {
                let mut lanes = [0u32; 16];
                _mm512_storeu_si512(lanes.as_mut_ptr() as *mut _, acc);
                for (r, l) in lanes.iter_mut().enumerate() {
                    let row = w.row_chunk(r, c);
                    let mut full = vec![0u16; x.len];
                    let n = (x.len - c0).min(16);
                    full[c0..c0 + n].copy_from_slice(&row[..n]);
                    *l = chunk_scalar(&full, x, c0, *l, 0);
                }
                acc = _mm512_loadu_si512(lanes.as_ptr() as *const _);
                continue;
            }
            for p in 0..3 {
                if _mm512_cmpeq_epi32_mask(_mm512_and_si512(acc, fin), fin) != 0 {
                    // an overflow to infinity inside the chunk: the rest by the model
                    let mut lanes = [0u32; 16];
                    _mm512_storeu_si512(lanes.as_mut_ptr() as *mut _, acc);
                    for (r, l) in lanes.iter_mut().enumerate() {
                        let row = w.row_chunk(r, c);
                        let mut full = vec![0u16; x.len];
                        let n = (x.len - c0).min(16);
                        full[c0..c0 + n].copy_from_slice(&row[..n]);
                        *l = chunk_scalar(&full, x, c0, *l, p);
                    }
                    acc = _mm512_loadu_si512(lanes.as_ptr() as *const _);
                    break;
                }
                // the accumulator, decoded per lane
                let cb = _mm512_and_si512(_mm512_srli_epi32(acc, 23), ff);
                let cnorm = _mm512_cmpneq_epi32_mask(cb, zero);
                let cm = _mm512_mask_or_epi32(
                    _mm512_and_si512(acc, _mm512_set1_epi32(0x7F_FFFF)),
                    cnorm,
                    _mm512_and_si512(acc, _mm512_set1_epi32(0x7F_FFFF)),
                    _mm512_set1_epi32(0x80_0000),
                );
                let ce = _mm512_sub_epi32(_mm512_max_epi32(cb, one), bias);
                let mut e = [zero; 16];
                let mut emax = ce;
                for k in 0..16 {
                    e[k] = _mm512_add_epi32(we[k], _mm512_set1_epi32(x.e[p][c0 + k]));
                    emax = _mm512_max_epi32(emax, e[k]);
                }
                let mut psum = zero;
                for k in 0..16 {
                    let xm = x.m[p][c0 + k] as i32;
                    // both significands < 2^8 in 32-bit lanes: the 16-bit multiply is exact (< 2^16)
                    let m = _mm512_mullo_epi16(wm[k], _mm512_set1_epi32(xm & 0x7FFF_FFFF));
                    let v =
                        _mm512_srlv_epi32(_mm512_slli_epi32(m, 11), _mm512_sub_epi32(emax, e[k]));
                    let neg = _mm512_movepi32_mask(_mm512_xor_si512(ws[k], _mm512_set1_epi32(xm)));
                    psum = _mm512_add_epi32(psum, _mm512_mask_sub_epi32(v, neg, zero, v));
                }
                let cv = _mm512_srlv_epi32(_mm512_slli_epi32(cm, 2), _mm512_sub_epi32(emax, ce));
                let cv = _mm512_mask_sub_epi32(cv, _mm512_movepi32_mask(acc), zero, cv);
                let scale = _mm512_sub_epi32(emax, _mm512_set1_epi32(25));
                let lo = _mm512_add_epi64(
                    _mm512_cvtepi32_epi64(_mm512_castsi512_si256(psum)),
                    _mm512_cvtepi32_epi64(_mm512_castsi512_si256(cv)),
                );
                let hi = _mm512_add_epi64(
                    _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(psum, 1)),
                    _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(cv, 1)),
                );
                let rlo = norm8(lo, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(scale)));
                let rhi = norm8(
                    hi,
                    _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(scale, 1)),
                );
                acc = _mm512_inserti64x4(_mm512_castsi256_si512(rlo), rhi, 1);
            }
        }
        let mut out = [0f32; 16];
        _mm512_storeu_ps(out.as_mut_ptr(), _mm512_castsi512_ps(acc));
        out
    }
}

/// 8 rows of BF16 weights repacked for [`dot_rows8`] (the AVX2 emulator): per 16-chunk of k,
/// per k, the 8 rows' values side by side, zero-padded in k.
pub struct Rows8 {
    k: usize,
    data: Vec<u16>,
}

impl Rows8 {
    /// `rows`: 8 rows of `k` BF16 values, row-major.
    pub fn new(rows: &[u16], k: usize) -> Rows8 {
        assert_eq!(rows.len(), 8 * k);
        let mut data = vec![0u16; k.div_ceil(16) * 128];
        for r in 0..8 {
            for i in 0..k {
                data[(i / 16) * 128 + (i % 16) * 8 + r] = rows[r * k + i];
            }
        }
        Rows8 { k, data }
    }

    fn row_chunk(&self, r: usize, c: usize) -> [u16; 16] {
        std::array::from_fn(|i| self.data[c * 128 + i * 8 + r])
    }
}

/// The candidate dots of 8 rows with `x`, vectorised across the rows with AVX2 (one 32-bit lane
/// per row). AVX2 has variable shifts but no mask registers and no 64-bit leading-zero count,
/// so signs are applied by xor/subtract and each (chunk, part)'s normalisation to f32 is
/// scalar ([`model::to_f32`]). Same bits as [`crate::model::dot_v2`] per row; the scalar model
/// where AVX2 is missing.
pub fn dot_rows8(w: &Rows8, x: &Prepared) -> [f32; 8] {
    assert_eq!(w.k, x.len);
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the feature was just detected.
        return unsafe { rows8::dot(w, x) };
    }
    std::array::from_fn(|r| {
        let row: Vec<u16> = (0..w.k)
            .map(|i| w.data[(i / 16) * 128 + (i % 16) * 8 + r])
            .collect();
        model::dot_v2(&row, &x.raw, &Params::HOPPER)
    })
}

#[cfg(target_arch = "x86_64")]
mod rows8 {
    use super::*;
    use std::arch::x86_64::*;

    /// The lanes' chunk by the scalar model, from split part `from` on.
    unsafe fn lanes_scalar(
        w: &Rows8,
        x: &Prepared,
        c: usize,
        acc: __m256i,
        from: usize,
    ) -> __m256i {
        let mut lanes = [0u32; 8];
        _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, acc);
        let c0 = c * 16;
        let n = (x.len - c0).min(16);
        for (r, l) in lanes.iter_mut().enumerate() {
            let row = w.row_chunk(r, c);
            let mut full = vec![0u16; x.len];
            full[c0..c0 + n].copy_from_slice(&row[..n]);
            *l = chunk_scalar(&full, x, c0, *l, from);
        }
        _mm256_loadu_si256(lanes.as_ptr() as *const __m256i)
    }

    #[target_feature(enable = "avx2")]
    pub unsafe fn dot(w: &Rows8, x: &Prepared) -> [f32; 8] {
        let zero = _mm256_setzero_si256();
        let ff = _mm256_set1_epi32(0xFF);
        let x7f = _mm256_set1_epi32(0x7F);
        let x80 = _mm256_set1_epi32(0x80);
        let one = _mm256_set1_epi32(1);
        let bias = _mm256_set1_epi32(127);
        let fin = _mm256_set1_epi32(0x7F80_0000);
        let inf_lane = |acc: __m256i| {
            _mm256_movemask_epi8(_mm256_cmpeq_epi32(_mm256_and_si256(acc, fin), fin)) != 0
        };
        let mut acc = zero; // 8 f32 bit patterns, +0
        for c in 0..w.k.div_ceil(16) {
            let c0 = c * 16;
            let mut we = [zero; 16];
            let mut wm = [zero; 16];
            let mut ws = [zero; 16];
            let mut special = x.special[c] || inf_lane(acc);
            for k in 0..16 {
                let wv = _mm256_cvtepu16_epi32(_mm_loadu_si128(
                    w.data.as_ptr().add(c * 128 + k * 8) as *const __m128i,
                ));
                let be = _mm256_and_si256(_mm256_srli_epi32(wv, 7), ff);
                special |= _mm256_movemask_epi8(_mm256_cmpeq_epi32(be, ff)) != 0;
                // the hidden bit where the exponent field is not zero
                let hidden = _mm256_andnot_si256(_mm256_cmpeq_epi32(be, zero), x80);
                wm[k] = _mm256_or_si256(_mm256_and_si256(wv, x7f), hidden);
                we[k] = _mm256_sub_epi32(_mm256_max_epi32(be, one), bias);
                ws[k] = _mm256_slli_epi32(wv, 16);
            }
            if special {
                acc = lanes_scalar(w, x, c, acc, 0);
                continue;
            }
            for p in 0..3 {
                if inf_lane(acc) {
                    // an overflow to infinity inside the chunk: the rest by the model
                    acc = lanes_scalar(w, x, c, acc, p);
                    break;
                }
                let cb = _mm256_and_si256(_mm256_srli_epi32(acc, 23), ff);
                let chidden =
                    _mm256_andnot_si256(_mm256_cmpeq_epi32(cb, zero), _mm256_set1_epi32(0x80_0000));
                let cm =
                    _mm256_or_si256(_mm256_and_si256(acc, _mm256_set1_epi32(0x7F_FFFF)), chidden);
                let ce = _mm256_sub_epi32(_mm256_max_epi32(cb, one), bias);
                let mut e = [zero; 16];
                let mut emax = ce;
                for k in 0..16 {
                    e[k] = _mm256_add_epi32(we[k], _mm256_set1_epi32(x.e[p][c0 + k]));
                    emax = _mm256_max_epi32(emax, e[k]);
                }
                let mut psum = zero;
                for k in 0..16 {
                    let xm = x.m[p][c0 + k] as i32;
                    // both significands < 2^8 in 32-bit lanes: the 16-bit multiply is exact
                    let m = _mm256_mullo_epi16(wm[k], _mm256_set1_epi32(xm & 0x7FFF_FFFF));
                    // shifts of 32 or more give 0, as truncation wants
                    let v =
                        _mm256_srlv_epi32(_mm256_slli_epi32(m, 11), _mm256_sub_epi32(emax, e[k]));
                    let neg = _mm256_srai_epi32(_mm256_xor_si256(ws[k], _mm256_set1_epi32(xm)), 31);
                    psum = _mm256_add_epi32(psum, _mm256_sub_epi32(_mm256_xor_si256(v, neg), neg));
                }
                let cv = _mm256_srlv_epi32(_mm256_slli_epi32(cm, 2), _mm256_sub_epi32(emax, ce));
                let cneg = _mm256_srai_epi32(acc, 31);
                let cv = _mm256_sub_epi32(_mm256_xor_si256(cv, cneg), cneg);
                let (mut ps, mut cs, mut em) = ([0i32; 8], [0i32; 8], [0i32; 8]);
                _mm256_storeu_si256(ps.as_mut_ptr() as *mut __m256i, psum);
                _mm256_storeu_si256(cs.as_mut_ptr() as *mut __m256i, cv);
                _mm256_storeu_si256(em.as_mut_ptr() as *mut __m256i, emax);
                let bits: [u32; 8] = std::array::from_fn(|l| {
                    model::to_f32(ps[l] as i64 + cs[l] as i64, em[l] - 25, &Params::HOPPER)
                });
                acc = _mm256_loadu_si256(bits.as_ptr() as *const __m256i);
            }
        }
        let mut out = [0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_castsi256_ps(acc));
        out
    }
}
