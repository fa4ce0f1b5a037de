//! A vector of `u16` or `f32` whose storage starts on a 64-byte (cache-line) boundary.
//!
//! Weights and prepared activations live in these: a 512-bit load that straddles two cache lines
//! costs two, which measurably slows the memory-bound matvec (weights allocated by `malloc` are
//! typically 16 bytes off a line). Alignment changes speed only, never values.
//!
//! This module must never expose uninitialised memory: storage is always zero-filled or copied.

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

/// One cache line of storage.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Element types an [`AlignedVec`] may hold: plain data for which all-zero bytes are a valid
/// value and any alignment up to 64 is satisfied by a cache line.
pub trait Element: Copy + sealed::Sealed + 'static {}
impl Element for u16 {}
impl Element for f32 {}
mod sealed {
    pub trait Sealed {}
    impl Sealed for u16 {}
    impl Sealed for f32 {}
}

/// A fixed-length, 64-byte-aligned vector.
#[derive(Clone)]
pub struct AlignedVec<T: Element> {
    lines: Vec<Line>,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Element> AlignedVec<T> {
    /// `len` zeros.
    pub fn zeroed(len: usize) -> AlignedVec<T> {
        let bytes = len * std::mem::size_of::<T>();
        AlignedVec {
            lines: vec![Line([0; 64]); bytes.div_ceil(64)],
            len,
            _t: PhantomData,
        }
    }

    /// A copy of `s`.
    pub fn from_slice(s: &[T]) -> AlignedVec<T> {
        let mut v = AlignedVec::zeroed(s.len());
        v.copy_from_slice(s);
        v
    }
}

impl AlignedVec<u16> {
    /// Little-endian `u16`s from bytes (a trailing odd byte is ignored; callers check lengths).
    pub fn from_le_bytes(raw: &[u8]) -> AlignedVec<u16> {
        let mut v = AlignedVec::zeroed(raw.len() / 2);
        for (d, b) in v.iter_mut().zip(raw.chunks_exact(2)) {
            *d = u16::from_le_bytes([b[0], b[1]]);
        }
        v
    }
}

impl AlignedVec<f32> {
    /// Little-endian `f32`s from bytes.
    pub fn from_le_bytes(raw: &[u8]) -> AlignedVec<f32> {
        let mut v = AlignedVec::zeroed(raw.len() / 4);
        for (d, b) in v.iter_mut().zip(raw.chunks_exact(4)) {
            *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        v
    }
}

impl<T: Element> Deref for AlignedVec<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `lines` holds at least len * size_of::<T>() initialised bytes, aligned to 64
        // (>= align_of::<T>()), and every bit pattern is a valid u16 / f32.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr() as *const T, self.len) }
    }
}

impl<T: Element> DerefMut for AlignedVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `self` is borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr() as *mut T, self.len) }
    }
}

impl<T: Element> From<Vec<T>> for AlignedVec<T> {
    fn from(v: Vec<T>) -> AlignedVec<T> {
        AlignedVec::from_slice(&v)
    }
}

impl<T: Element + std::fmt::Debug> std::fmt::Debug for AlignedVec<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedVec(len {})", self.len)
    }
}

impl<T: Element + PartialEq> PartialEq for AlignedVec<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_round_trips() {
        for n in [0usize, 1, 31, 32, 33, 1000] {
            let src: Vec<u16> = (0..n as u16).collect();
            let v = AlignedVec::from(src.clone());
            assert_eq!(&v[..], &src[..]);
            assert_eq!(v.as_ptr() as usize % 64, 0);
            let f: AlignedVec<f32> = AlignedVec::zeroed(n);
            assert!(f.iter().all(|&x| x.to_bits() == 0));
        }
        let b = AlignedVec::<u16>::from_le_bytes(&[1, 0, 0, 1]);
        assert_eq!(&b[..], &[1, 256]);
    }
}
