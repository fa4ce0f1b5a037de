//! The bundle reader ([`bundle`]: a converted bundle's weights, verified against its manifest
//! before use) and expert streaming: run a model whose experts do not fit in memory, with the
//! same bits as the resident run. Both are [`WeightSource`]s, below the backends: this crate must
//! never depend on a backend or a CLI, and never hand out a byte it has not verified.
//!
//! The dense weights and the KV cache stay resident (see [`memory`]); the experts live in tiers:
//!
//! | tier | where | bounded by |
//! | --- | --- | --- |
//! | hot | GPU memory (the CUDA backend plugs in above the warm tier) | `--vram-budget` |
//! | warm | host RAM: this module's [`ExpertStore`] | `--ram-budget` |
//! | cold | the bundle on disk, read with `--io direct` (O_DIRECT) or `--io cached` (page cache) | |
//!
//! The warm tier's budget covers every expert buffer alive at once: cached entries, reads in
//! flight and the experts the forward is computing with. There is no separate staging copy:
//! an extent is read into one buffer, BLAKE3-checked there against the manifest, and the
//! forward computes from views into that very buffer ([`crate::weights::ExpertData`]). An
//! extent stored encoded (format version 2) is read into a buffer of its stored bytes, which
//! are BLAKE3-checked against the manifest's `stored_blake3`, decoded on the reader thread into
//! the buffer the forward will use, and checked there as a raw extent is; the stored bytes'
//! buffer is charged to the budget too, until the decode is done.
//!
//! How the forward cooperates (the [`WeightSource`] hints, all defaulted for resident sources):
//! once a layer's routes are known it asks [`WeightSource::expert_batches`] how to group the
//! needed experts (one group when they fit; otherwise groups that fit, the experts already held
//! first), announces the groups with [`WeightSource::prefetch`] (the store starts every read
//! the budget allows, in parallel: that is the queue depth), then asks for each group in turn
//! with [`WeightSource::expert_data`], computes its products, keeps the outputs and drops the
//! weights. The outputs are mixed in ascending expert id at the end, as resident runs do.
//!
//! With `--lookahead` the forward also names the next MoE layer before this one computes
//! ([`WeightSource::lookahead`]), and the store reads the experts it guesses that layer will
//! choose (from the heat ledger, the router, or both) into room the current layer does not
//! need, behind every read the current layer waits for ([`ExpertStore::lookahead`]).
//!
//! Nothing here may change a bit: budgets, I/O modes, cache policies, prefetching, look-ahead
//! and grouping only decide when bytes are read, never what is computed from them
//! (docs/EXACTNESS.md).
//! Every byte handed out was verified in the buffer handed out, and a read whose bytes do not
//! match the manifest stops the run (exit 1) before anything is computed from them.

pub mod bundle;
pub mod ledger;
pub mod memory;
pub mod size;
mod stats;
mod store;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

pub use ledger::{HeatLedger, LedgerLoad};
pub use memory::{mem_available, ResidentPart};
pub use size::{format_bytes, parse_size};
pub use stats::StreamStats;
pub use store::ExpertStore;

use crate::bundle::{BundleError, BundleSource};
// The weight seam under the names the moved files (bundle.rs, memory.rs, store.rs) use.
use crate::weights::{
    Bf16Matrix, ExpertData, ExpertHandle, ExpertWeights, HostTensor, LookaheadInput, SourceFailure,
    WeightError, WeightSource,
};
use tarfa_core::{config, exit, numerics, weights};

#[cfg(target_endian = "big")]
compile_error!("the streaming store views little-endian BF16 bytes in place as u16");

/// How expert extents are read from the bundle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IoMode {
    /// O_DIRECT: one read of the extent's `padded_length` (4096-aligned offset and length) into
    /// a 4096-aligned buffer, bypassing the page cache.
    Direct,
    /// Through the OS page cache: one `pread` of the extent's `length`.
    Cached,
}

impl IoMode {
    pub fn name(self) -> &'static str {
        match self {
            IoMode::Direct => "direct",
            IoMode::Cached => "cached",
        }
    }

    /// Bytes one read of `extent` transfers: its stored bytes, with O_DIRECT padded to 4096
    /// (`padded_length`), through the page cache as they are (`stored_length`, which is
    /// `length` for a raw extent).
    pub fn read_bytes(self, extent: &jnf_format::ExpertExtent) -> u64 {
        match self {
            IoMode::Direct => extent.padded_length,
            IoMode::Cached => extent.stored_length,
        }
    }

    /// Bytes the warm tier holds for `extent` once it is read, and what the RAM budget is
    /// charged for it while it is kept: a raw extent's read rounded up to whole 4096-byte pages
    /// (its `padded_length` in both modes, as the format pads extents to 4096); an encoded
    /// extent's decoded bytes, in whole pages.
    pub fn buffer_bytes(self, extent: &jnf_format::ExpertExtent) -> u64 {
        let held = if extent.is_encoded() {
            extent.length
        } else {
            self.read_bytes(extent)
        };
        held.max(1).div_ceil(4096) * 4096
    }

    /// Bytes an encoded extent's stored bytes occupy while they are checked and decoded (the
    /// budget is charged for them too, until the decoded bytes verify); 0 for a raw extent,
    /// which is read into the buffer it is used from.
    pub fn scratch_bytes(self, extent: &jnf_format::ExpertExtent) -> u64 {
        if extent.is_encoded() {
            self.read_bytes(extent).max(1).div_ceil(4096) * 4096
        } else {
            0
        }
    }
}

/// What the warm tier keeps once the forward is done with an expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CachePolicy {
    /// Keep everything, evict the least recently used.
    Lru,
    /// Pin the hottest experts of the heat ledger in half the budget; LRU for the rest.
    Ledger,
    /// Pin a fixed set (the ledger's hottest, else an even spread over layers) in three quarters
    /// of the budget; keep nothing else.
    Static,
    /// Keep nothing: every use reads (meant with `--io cached`, to measure the page cache).
    None,
}

impl CachePolicy {
    pub fn name(self) -> &'static str {
        match self {
            CachePolicy::Lru => "lru",
            CachePolicy::Ledger => "ledger",
            CachePolicy::Static => "static",
            CachePolicy::None => "none",
        }
    }
}

/// What the next MoE layer's experts are guessed from, to read them while this layer computes
/// (`--lookahead`; docs/PHASE_LOG.md S5). A guess decides only what is read early: the forward
/// asks for exactly the experts the router chooses, verified as always.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Lookahead {
    /// Nothing is read before a layer's routes are known.
    #[default]
    Off,
    /// The heat ledger's hottest experts of the next layer (the file's counts and this run's
    /// uses), as many as the layer before needed.
    Ledger,
    /// This step's residual through the next layer's router: each token's top-k.
    Router,
    /// The router's guess, then the ledger's.
    Both,
}

impl Lookahead {
    pub fn name(self) -> &'static str {
        match self {
            Lookahead::Off => "off",
            Lookahead::Ledger => "ledger",
            Lookahead::Router => "router",
            Lookahead::Both => "both",
        }
    }
}

/// How the warm tier is set up.
#[derive(Clone, Debug)]
pub struct StreamOptions {
    /// Bytes the warm tier may hold at once (cache, reads in flight, experts in use); `None`:
    /// unbounded, every expert stays once read.
    pub ram_budget: Option<u64>,
    pub io: IoMode,
    pub policy: CachePolicy,
    /// Reader threads: the most reads in flight at once.
    pub io_threads: usize,
    /// Reads of the next MoE layer's likely experts while this one computes.
    pub lookahead: Lookahead,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions {
            ram_budget: None,
            io: IoMode::Cached,
            policy: CachePolicy::Lru,
            io_threads: DEFAULT_IO_THREADS,
            lookahead: Lookahead::Off,
        }
    }
}

/// Enough reads in flight to keep an NVMe queue busy with expert-sized requests (a decode step
/// needs top-k of them per layer), without an unbounded number of threads.
pub const DEFAULT_IO_THREADS: usize = 16;

pub use tarfa_core::weights::HostPin;

/// Why streaming cannot start or go on.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// A budget cannot hold even one expert (exit 2).
    #[error("{flag} {} is smaller than one expert: the minimum is {minimum} bytes ({})", format_bytes(*budget), format_bytes(*minimum))]
    BudgetTooSmall {
        flag: &'static str,
        budget: u64,
        minimum: u64,
    },
    /// A size argument does not parse (exit 2).
    #[error(
        "{text:?} is not a size: {why} (bytes, or a number with K, M or G = 2^10, 2^20, 2^30)"
    )]
    BadSize { text: String, why: &'static str },
    /// The machine cannot hold the resident part (exit 3).
    #[error("the resident part needs {} ({} dense weights + {} KV cache for {context} positions) but only {} is available (MemAvailable)", format_bytes(*needed), format_bytes(*dense), format_bytes(*kv), format_bytes(*available))]
    ResidentTooLarge {
        needed: u64,
        dense: u64,
        kv: u64,
        context: usize,
        available: u64,
    },
    /// No `--ram-budget` was given and MemAvailable, less the resident part, cannot hold one
    /// expert (exit 3).
    #[error("not enough memory: MemAvailable {} holds the resident part ({}) but not one expert more ({})", format_bytes(*available), format_bytes(*resident), format_bytes(*minimum))]
    NoRoomForAnExpert {
        available: u64,
        resident: u64,
        minimum: u64,
    },
    /// An extent read back different bytes than the manifest records (exit 1).
    #[error("{path}: {name}: BLAKE3 of the bytes read does not match the manifest (the bundle changed during the run or is corrupt); nothing was computed from them")]
    HashMismatch { path: PathBuf, name: String },
    /// An encoded extent's stored bytes are not the ones the manifest records (exit 1): named
    /// before they are decoded.
    #[error("{path}: {name}: BLAKE3 of the stored (encoded) bytes read does not match the manifest's stored_blake3 (the bundle changed during the run or is corrupt); nothing was decoded or computed from them")]
    StoredHashMismatch { path: PathBuf, name: String },
    /// An encoded extent whose stored bytes verified does not decode (exit 1).
    #[error("{path}: {name}: the stored extent verified but does not decode ({msg}); nothing was computed from it")]
    Undecodable {
        path: PathBuf,
        name: String,
        msg: String,
    },
    /// An MXFP4 extent that verified holds a block with no exact BF16 widening (exit 1).
    #[error("{path}: {name}: {msg}; MXFP4 is widened exactly or refused")]
    Mxfp4 {
        path: PathBuf,
        name: String,
        msg: String,
    },
    /// The file ends inside an extent the header validated at open: it changed (exit 1).
    #[error("{path}: {name}: read {got} of {expected} bytes (the file is shorter than when it was opened: it changed during the run)")]
    Truncated {
        path: PathBuf,
        name: String,
        expected: u64,
        got: u64,
    },
    /// The file system refuses O_DIRECT (exit 3).
    #[error(
        "{path}: cannot open for O_DIRECT reads ({source}); use --io cached on this file system"
    )]
    DirectIoUnsupported {
        path: PathBuf,
        source: std::io::Error,
    },
    /// An I/O error while reading an extent (exit 3).
    #[error("{path}: {op}: {msg}")]
    Io {
        path: PathBuf,
        op: &'static str,
        msg: String,
    },
    /// An expert buffer could not be allocated (exit 3).
    #[error("cannot allocate {} for an expert buffer", format_bytes(*bytes))]
    OutOfMemory { bytes: u64 },
    /// A caller asked for more experts at once than the budget holds, holding nothing that
    /// could be released (a bug in the caller, which must follow `expert_batches`) (exit 3).
    #[error("layer {layer}: {requested} bytes of experts asked for at once; the RAM budget holds {capacity}")]
    BatchTooLarge {
        layer: usize,
        requested: u64,
        capacity: u64,
    },
}

impl StreamError {
    /// 1 verification failure, 2 bad input or usage, 3 environment.
    pub fn exit_code(&self) -> i32 {
        match self {
            StreamError::BudgetTooSmall { .. } | StreamError::BadSize { .. } => exit::BAD_INPUT,
            StreamError::HashMismatch { .. }
            | StreamError::StoredHashMismatch { .. }
            | StreamError::Undecodable { .. }
            | StreamError::Truncated { .. }
            | StreamError::Mxfp4 { .. } => exit::VERIFICATION_FAILED,
            StreamError::ResidentTooLarge { .. }
            | StreamError::NoRoomForAnExpert { .. }
            | StreamError::DirectIoUnsupported { .. }
            | StreamError::Io { .. }
            | StreamError::OutOfMemory { .. }
            | StreamError::BatchTooLarge { .. } => exit::ENVIRONMENT,
        }
    }
}

// The weight seam (tarfa-core) sits below this crate, so it carries the bundle's and the store's
// errors boxed; these keep `?` converting them and each keeps its own exit code.
impl SourceFailure for StreamError {
    fn exit_code(&self) -> i32 {
        StreamError::exit_code(self)
    }
    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }
}

impl From<StreamError> for WeightError {
    fn from(e: StreamError) -> WeightError {
        WeightError::Source(Box::new(e))
    }
}

impl SourceFailure for BundleError {
    fn exit_code(&self) -> i32 {
        BundleError::exit_code(self)
    }
    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }
}

impl From<BundleError> for WeightError {
    fn from(e: BundleError) -> WeightError {
        WeightError::Source(Box::new(e))
    }
}

/// The smallest RAM budget that holds one expert of `bundle` read with `io`: the largest
/// expert buffer, with an encoded extent's stored bytes beside it while it is decoded.
pub fn min_budget(bundle: &BundleSource, io: IoMode) -> u64 {
    bundle
        .expert_extents()
        .iter()
        .map(|(e, _)| io.buffer_bytes(e) + io.scratch_bytes(e))
        .max()
        .unwrap_or(0)
}

/// Called with (layer, layers) as the forward reaches each MoE layer (a progress line).
pub type ProgressFn = Box<dyn Fn(usize, usize) + Send + Sync>;

/// A [`WeightSource`] over a verified bundle whose experts come through the warm tier: the
/// non-expert tensors from [`BundleSource`] (loaded once, resident), the experts from an
/// [`ExpertStore`] under a RAM budget.
pub struct StreamSource {
    bundle: Arc<BundleSource>,
    store: ExpertStore,
    layers: usize,
    lookahead: Lookahead,
    progress: Mutex<Option<ProgressFn>>,
}

impl StreamSource {
    /// A store over `bundle`'s experts. `ledger` (this bundle's heat ledger, if any) decides
    /// what the `ledger` and `static` policies pin; it changes what is read when, never a bit.
    pub fn new(
        bundle: Arc<BundleSource>,
        opts: &StreamOptions,
        ledger: Option<&HeatLedger>,
    ) -> Result<StreamSource, StreamError> {
        let layers = bundle
            .expert_extents()
            .iter()
            .map(|(e, _)| e.layer as usize + 1)
            .max()
            .unwrap_or(0);
        let store = ExpertStore::new(bundle.clone(), opts, ledger)?;
        Ok(StreamSource {
            bundle,
            store,
            layers,
            lookahead: opts.lookahead,
            progress: Mutex::new(None),
        })
    }

    /// What the next layer's experts are guessed from (`--lookahead`).
    pub fn lookahead_mode(&self) -> Lookahead {
        self.lookahead
    }

    pub fn bundle(&self) -> &Arc<BundleSource> {
        &self.bundle
    }

    pub fn store(&self) -> &ExpertStore {
        &self.store
    }

    /// Counters since the store was made.
    pub fn stats(&self) -> StreamStats {
        self.store.stats()
    }

    /// Calls `f(layer, layers)` each time the forward reaches a MoE layer (until replaced).
    pub fn set_progress(&self, f: Option<ProgressFn>) {
        *self.progress.lock().unwrap_or_else(|e| e.into_inner()) = f;
    }

    /// Read every expert into the warm tier (`--preload`): the budget must hold them all and
    /// the policy must keep them.
    pub fn preload(&self) -> Result<(), WeightError> {
        for layer in 0..self.layers {
            let ids = self.store.expert_ids(layer);
            if ids.is_empty() {
                continue;
            }
            for batch in self.store.batches(layer, &ids) {
                drop(self.store.fetch_uncounted(layer, &batch)?);
            }
        }
        Ok(())
    }
}

impl WeightSource for StreamSource {
    fn tensor(&self, name: &str) -> Result<Arc<HostTensor>, WeightError> {
        self.bundle.tensor(name)
    }

    fn contains(&self, name: &str) -> bool {
        self.bundle.contains(name)
    }

    /// Owned copies, for callers that keep experts (the CUDA upload): copied from the verified
    /// buffers, in groups the budget holds. The warm tier does not keep what it read for them
    /// ([`ExpertStore::fetch_copy`]): a model whose experts all live on the GPU has no second
    /// copy in host memory, even with an unbounded budget.
    fn experts(&self, layer: usize, ids: &[usize]) -> Result<Vec<Arc<ExpertWeights>>, WeightError> {
        let mut distinct = ids.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        let mut got = std::collections::HashMap::new();
        for batch in self.store.batches(layer, &distinct) {
            // Copies for a caller that keeps them (loading a model), not uses: not counted in
            // the heat ledger.
            let handles = self.store.fetch_copy(layer, &batch)?;
            for (&id, h) in batch.iter().zip(&handles) {
                let [g, u, d] = h.matrices();
                let m = |v: crate::weights::Bf16View<'_>| Bf16Matrix {
                    rows: v.rows,
                    cols: v.cols,
                    data: crate::numerics::AlignedVec::from_slice(v.data),
                };
                got.insert(
                    id,
                    Arc::new(ExpertWeights {
                        gate: m(g),
                        up: m(u),
                        down: m(d),
                    }),
                );
            }
        }
        ids.iter()
            .map(|&id| {
                got.get(&id)
                    .cloned()
                    .ok_or_else(|| WeightError::MissingExpert {
                        layer,
                        expert: id,
                        name: format!("layer {layer} expert {id}"),
                    })
            })
            .collect()
    }

    fn record_uses(&self, layer: usize, ids: &[usize]) {
        self.store.record_uses(layer, ids);
    }

    fn use_host_pin(&self, pin: Arc<dyn HostPin>) {
        self.store.set_host_pin(pin);
    }

    fn expert_batches(&self, layer: usize, ids: &[usize]) -> Vec<Vec<usize>> {
        if let Some(f) = self
            .progress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            f(layer, self.layers);
        }
        self.store.batches(layer, ids)
    }

    fn prefetch(&self, layer: usize, batches: &[Vec<usize>]) {
        self.store.prefetch(layer, batches);
    }

    fn lookahead_input(&self) -> LookaheadInput {
        match self.lookahead {
            Lookahead::Off => LookaheadInput::None,
            Lookahead::Ledger => LookaheadInput::LayerOnly,
            Lookahead::Router | Lookahead::Both => LookaheadInput::Router,
        }
    }

    fn lookahead(&self, layer: usize, count: usize, router_guess: &[usize]) {
        let guess = match self.lookahead {
            Lookahead::Off => return,
            Lookahead::Ledger => self.store.hottest(layer, count),
            Lookahead::Router => router_guess.to_vec(),
            Lookahead::Both => {
                let mut g = router_guess.to_vec();
                for id in self.store.hottest(layer, count) {
                    if !g.contains(&id) {
                        g.push(id);
                    }
                }
                g
            }
        };
        self.store.lookahead(layer, &guess);
    }

    fn expert_data(&self, layer: usize, ids: &[usize]) -> Result<Vec<ExpertHandle>, WeightError> {
        Ok(self
            .store
            .fetch(layer, ids)?
            .into_iter()
            .map(|l| Arc::new(l) as ExpertHandle)
            .collect())
    }
}
