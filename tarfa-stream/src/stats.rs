//! Counters of the warm tier, for `--stats` and the summary's "stream" key.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;

/// Cumulative counters since the store was made; subtract two snapshots for one step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StreamStats {
    /// Experts the forward asked for (one per expert per MoE layer per step).
    pub requests: u64,
    /// Requests served from the warm tier without a read.
    pub warm_hits: u64,
    /// Requests that needed a read from disk.
    pub misses: u64,
    /// Requests served by a read look-ahead started before the request (`--lookahead`): no
    /// read of their own, though the read may still have been in flight.
    pub lookahead_hits: u64,
    /// Extents read from disk: the misses, the look-ahead hits, plus reads that were never used
    /// (wasted, or still held unused).
    pub reads: u64,
    /// Extents read ahead and dropped or evicted unused (a prefetch plan cancelled by an error
    /// or a concurrent user, a wrong look-ahead guess).
    pub wasted_reads: u64,
    /// Experts a look-ahead guessed for a layer (counted when that layer's routes arrive).
    pub lookahead_guessed: u64,
    /// Of those, the ones the layer then asked for.
    pub lookahead_right: u64,
    /// Experts asked for by layers that had a guess (the guess's recall is `right / needed`).
    pub lookahead_needed: u64,
    /// Reads look-ahead started (a guessed expert not held), and their bytes (as `bytes_read`).
    pub lookahead_reads: u64,
    pub lookahead_bytes: u64,
    /// Look-ahead reads dropped or evicted unused (also in `wasted_reads`), and their bytes.
    pub lookahead_wasted: u64,
    pub lookahead_wasted_bytes: u64,
    /// Bytes read from disk: per read, `padded_length` with `--io direct`, `stored_length`
    /// (`length` when raw) with `--io cached`.
    pub bytes_read: u64,
    /// Wall time during which at least one read was in flight (ns).
    pub read_busy_ns: u64,
    /// CPU time spent BLAKE3-hashing extents, summed over reader threads (ns).
    pub verify_ns: u64,
    /// Bytes hashed (an encoded extent's stored bytes and its decoded bytes).
    pub verified_bytes: u64,
    /// CPU time spent decoding encoded extents, summed over reader threads (ns).
    pub decode_ns: u64,
    /// Bytes decoded (the decoded size of the encoded extents read).
    pub decoded_bytes: u64,
    /// Reader-thread time spent page-locking buffers for a GPU backend (ns).
    pub pin_ns: u64,
    /// Time the forward spent waiting for experts (ns).
    pub io_wait_ns: u64,
    /// Entries evicted to make room.
    pub evictions: u64,
    /// The most bytes of expert buffers alive at once (cache, reads in flight, in use).
    pub peak_warm_bytes: u64,
}

impl StreamStats {
    /// Counters accumulated between `earlier` and `self` (the peak stays the running peak).
    pub fn since(&self, earlier: &StreamStats) -> StreamStats {
        StreamStats {
            requests: self.requests - earlier.requests,
            warm_hits: self.warm_hits - earlier.warm_hits,
            misses: self.misses - earlier.misses,
            lookahead_hits: self.lookahead_hits - earlier.lookahead_hits,
            reads: self.reads - earlier.reads,
            wasted_reads: self.wasted_reads - earlier.wasted_reads,
            lookahead_guessed: self.lookahead_guessed - earlier.lookahead_guessed,
            lookahead_right: self.lookahead_right - earlier.lookahead_right,
            lookahead_needed: self.lookahead_needed - earlier.lookahead_needed,
            lookahead_reads: self.lookahead_reads - earlier.lookahead_reads,
            lookahead_bytes: self.lookahead_bytes - earlier.lookahead_bytes,
            lookahead_wasted: self.lookahead_wasted - earlier.lookahead_wasted,
            lookahead_wasted_bytes: self.lookahead_wasted_bytes - earlier.lookahead_wasted_bytes,
            bytes_read: self.bytes_read - earlier.bytes_read,
            read_busy_ns: self.read_busy_ns - earlier.read_busy_ns,
            verify_ns: self.verify_ns - earlier.verify_ns,
            verified_bytes: self.verified_bytes - earlier.verified_bytes,
            decode_ns: self.decode_ns - earlier.decode_ns,
            decoded_bytes: self.decoded_bytes - earlier.decoded_bytes,
            pin_ns: self.pin_ns - earlier.pin_ns,
            io_wait_ns: self.io_wait_ns - earlier.io_wait_ns,
            evictions: self.evictions - earlier.evictions,
            peak_warm_bytes: self.peak_warm_bytes,
        }
    }

    /// Warm-tier hits over requests, when there were requests.
    pub fn warm_hit_rate(&self) -> Option<f64> {
        (self.requests > 0).then(|| self.warm_hits as f64 / self.requests as f64)
    }

    /// Requests served without a read of their own, from the warm tier or by a look-ahead
    /// read, over requests, when there were requests.
    pub fn ahead_hit_rate(&self) -> Option<f64> {
        (self.requests > 0)
            .then(|| (self.warm_hits + self.lookahead_hits) as f64 / self.requests as f64)
    }

    /// Guessed experts the layer then asked for, over guessed experts.
    pub fn lookahead_precision(&self) -> Option<f64> {
        (self.lookahead_guessed > 0)
            .then(|| self.lookahead_right as f64 / self.lookahead_guessed as f64)
    }

    /// Experts asked for that had been guessed, over experts asked for by guessed layers.
    pub fn lookahead_recall(&self) -> Option<f64> {
        (self.lookahead_needed > 0)
            .then(|| self.lookahead_right as f64 / self.lookahead_needed as f64)
    }

    /// Bytes read per second of read-busy wall time, in GB/s (10^9), when anything was read.
    pub fn disk_gb_s(&self) -> Option<f64> {
        (self.read_busy_ns > 0).then(|| self.bytes_read as f64 / self.read_busy_ns as f64)
    }

    /// Decoding throughput per core (decoded bytes per ns of decoding CPU time), GB/s.
    pub fn decode_gb_s(&self) -> Option<f64> {
        (self.decode_ns > 0).then(|| self.decoded_bytes as f64 / self.decode_ns as f64)
    }

    /// Hashing throughput per core (bytes per ns of hashing CPU time), GB/s.
    pub fn verify_gb_s(&self) -> Option<f64> {
        (self.verify_ns > 0).then(|| self.verified_bytes as f64 / self.verify_ns as f64)
    }
}

#[derive(Default)]
pub(crate) struct Counters {
    pub requests: AtomicU64,
    pub warm_hits: AtomicU64,
    pub misses: AtomicU64,
    pub lookahead_hits: AtomicU64,
    pub reads: AtomicU64,
    pub wasted_reads: AtomicU64,
    pub lookahead_guessed: AtomicU64,
    pub lookahead_right: AtomicU64,
    pub lookahead_needed: AtomicU64,
    pub lookahead_reads: AtomicU64,
    pub lookahead_bytes: AtomicU64,
    pub lookahead_wasted: AtomicU64,
    pub lookahead_wasted_bytes: AtomicU64,
    pub bytes_read: AtomicU64,
    pub read_busy_ns: AtomicU64,
    pub verify_ns: AtomicU64,
    pub verified_bytes: AtomicU64,
    pub decode_ns: AtomicU64,
    pub decoded_bytes: AtomicU64,
    pub pin_ns: AtomicU64,
    pub io_wait_ns: AtomicU64,
    pub evictions: AtomicU64,
}

pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

pub(crate) fn add_time(c: &AtomicU64, d: Duration) {
    c.fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
}

impl Counters {
    pub fn snapshot(&self, peak_warm_bytes: u64) -> StreamStats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StreamStats {
            requests: g(&self.requests),
            warm_hits: g(&self.warm_hits),
            misses: g(&self.misses),
            lookahead_hits: g(&self.lookahead_hits),
            reads: g(&self.reads),
            wasted_reads: g(&self.wasted_reads),
            lookahead_guessed: g(&self.lookahead_guessed),
            lookahead_right: g(&self.lookahead_right),
            lookahead_needed: g(&self.lookahead_needed),
            lookahead_reads: g(&self.lookahead_reads),
            lookahead_bytes: g(&self.lookahead_bytes),
            lookahead_wasted: g(&self.lookahead_wasted),
            lookahead_wasted_bytes: g(&self.lookahead_wasted_bytes),
            bytes_read: g(&self.bytes_read),
            read_busy_ns: g(&self.read_busy_ns),
            verify_ns: g(&self.verify_ns),
            verified_bytes: g(&self.verified_bytes),
            decode_ns: g(&self.decode_ns),
            decoded_bytes: g(&self.decoded_bytes),
            pin_ns: g(&self.pin_ns),
            io_wait_ns: g(&self.io_wait_ns),
            evictions: g(&self.evictions),
            peak_warm_bytes,
        }
    }
}
