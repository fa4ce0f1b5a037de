//! The warm tier: expert extents in host RAM under a byte budget, read by a pool of reader
//! threads, verified in the buffer they are used from, kept or dropped by the cache policy.
//!
//! Every expert buffer alive is charged to one [`Budget`] from the moment its read is issued
//! until the last handle on it is dropped: cached entries, reads in flight and experts the
//! forward is computing with. A read is issued only when its bytes fit (evicting unused,
//! unpinned entries, least recently used first), so the budget is never exceeded, and room for
//! the pinned set is kept free until the pinned experts are loaded.
//!
//! Life of an entry: `Queued` (planned or asked for, waiting for room) -> `Loading` (a reader
//! thread owns the read) -> `Ready` (verified; handed out as [`Lease`]s). A `Ready` entry with
//! no lease and no plan stays if the policy keeps it (evictable unless pinned), else it goes.
//!
//! Deadlock freedom rests on the order of the queue: a plan's reads are issued strictly in the
//! order the forward will ask for them, and the forward asks for one batch at a time and drops
//! it before asking for the next, so the reads it waits for are always first in line for room.
//! A request that can never be served (nothing in flight, no handle out, still no room) is an
//! error, never a hang.
//! That reasoning assumes one caller at a time (one forward per store). Two callers fetching
//! concurrently under a budget of a few experts can see the room held by an expert granted to
//! the other but not yet taken (no handle out yet) and get [`StreamError::BatchTooLarge`]
//! although their batch fits: two threads fetching single experts under a one-expert budget
//! got it on about half their fetches. Waiting instead could hang two callers that each hold
//! part of a batch, so the error stays.
//!
//! Locking: one mutex over the state. Dropping an [`Extent`] only touches atomics, so buffers
//! may be dropped with the lock held.
//!
//! Look-ahead (`--lookahead`): [`ExpertStore::lookahead`] names experts the next layer is
//! guessed to need. Their reads wait in a queue of their own, issued only once every read a
//! request or the plan waits for has been issued, so they never delay one by queue order, and
//! into room the guess may take from nothing the current step holds: never an expert planned,
//! leased or pinned, never another guessed one, and at most half the room the pins leave
//! (`lookahead_cap`). A guessed expert already held is only kept from the guess's own
//! evictions. Every read for a request may still evict what a guess holds, so a guess can delay
//! a request by at most the reads it has in flight, and cannot block it: deadlock freedom is the
//! plan's. A read look-ahead started is verified like any other; its first request counts as a
//! look-ahead hit; one dropped unused is counted wasted. The routes of the guessed layer
//! ([`ExpertStore::prefetch`]) score the guess and end it.
//!
//! An extent stored encoded (format version 2) costs more while it is read than once it is
//! held: its stored bytes' buffer, until they are checked and decoded into the buffer the
//! forward uses. A read is charged for both ([`ExtentInfo::read_charge`]) and gives the
//! stored part back the moment the decode is done; the groups [`ExpertStore::batches`] makes
//! leave room for one such read beside them, so that the last read of a group always fits.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use super::stats::{add, add_time, Counters};
use super::{CachePolicy, HeatLedger, HostPin, IoMode, StreamError, StreamOptions, StreamStats};
use crate::bundle::BundleSource;
use crate::weights::{Bf16View, ExpertData, WeightError};

/// (layer, expert).
type Key = (usize, usize);

/// O_DIRECT needs the buffer, offset and length aligned to the device's logical block size;
/// 4096 covers every device, and the format aligns extents to it.
const ALIGN: usize = 4096;

/// One matrix inside an extent: shape and byte range relative to the extent start.
#[derive(Clone, Copy, Debug)]
struct MatLayout {
    rows: usize,
    cols: usize,
    offset: usize,
    elems: usize,
}

/// What the store knows about one extent, from the reconciled header and manifest.
struct ExtentInfo {
    name: String,
    offset: u64,
    length: u64,
    /// Bytes one read transfers (padded with direct I/O): the stored bytes.
    read_bytes: u64,
    /// Bytes its buffer occupies (whole pages), what the budget is charged while it is held.
    buf_bytes: u64,
    /// An encoded extent's stored bytes' buffer (whole pages), charged besides `buf_bytes`
    /// from the read's issue until the decode is done; 0 for a raw extent.
    scratch_bytes: u64,
    /// An encoded extent: its header entry (to decode it) and the manifest's BLAKE3 of its
    /// stored bytes, checked before they are decoded.
    encoded: Option<(jnf_format::ExpertExtent, blake3::Hash)>,
    blake3: blake3::Hash,
    blake3_hex: String,
    mats: [MatLayout; 3],
    /// An MXFP4 extent (gpt-oss as released): widened exactly after it is verified, into a
    /// buffer of its own that the budget is charged for too (`buf_bytes`).
    mxfp4: Option<jnf_format::ExpertExtent>,
}

impl ExtentInfo {
    /// What a read of it is charged when issued: its buffer, and an encoded extent's stored
    /// bytes' buffer beside it until the decode.
    fn read_charge(&self) -> u64 {
        self.buf_bytes + self.scratch_bytes
    }
}

/// A zeroed, page-aligned buffer mapped for one extent and unmapped when dropped.
///
/// Not the heap: glibc serves multi-megabyte requests from per-thread arenas once its dynamic
/// mmap threshold has grown, and keeps what is freed there, so reader threads allocating and
/// freeing expert buffers held several times the budget resident (measured: 5 GiB of RSS for a
/// 256 MiB budget). An anonymous mapping is zero-filled by the kernel, aligned for O_DIRECT,
/// and returned to the system the moment it is dropped.
struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    mapped: usize,
    /// Who page-locked the mapping ([`HostPin`]), to undo it before it is unmapped.
    pinned_by: Option<Arc<dyn HostPin>>,
}

// SAFETY: the buffer is plain owned memory; it is written only through `&mut self` (by the one
// reader thread that owns it before it is shared) and read-only afterwards.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

/// Bytes a buffer of `len` bytes occupies: whole pages.
fn mapped_len(len: u64) -> u64 {
    len.max(1).div_ceil(ALIGN as u64) * ALIGN as u64
}

impl AlignedBuf {
    fn zeroed(len: usize) -> Option<AlignedBuf> {
        AlignedBuf::map(len, 0)
    }

    /// [`AlignedBuf::zeroed`] with every page faulted in by the kernel now (`MAP_POPULATE`),
    /// for a buffer the CPU is about to write whole (a decoded extent): one call instead of a
    /// fault per page on the first writes, measured at 1.26-1.32 against 1.52-1.64 GB/s of
    /// decoding per core, the mapping included (PHASE_LOG K2).
    fn populated(len: usize) -> Option<AlignedBuf> {
        AlignedBuf::map(len, libc::MAP_POPULATE)
    }

    fn map(len: usize, flags: libc::c_int) -> Option<AlignedBuf> {
        let mapped = mapped_len(len as u64) as usize;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        NonNull::new(p as *mut u8).map(|ptr| AlignedBuf {
            ptr,
            len,
            mapped,
            pinned_by: None,
        })
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `len <= mapped` bytes of a live, zero-initialised mapping.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// A page-locked mapping to unpin and unmap.
struct Doomed {
    ptr: NonNull<u8>,
    mapped: usize,
    pin: Arc<dyn HostPin>,
}

// SAFETY: the mapping is owned by this value alone once its buffer is dropped.
unsafe impl Send for Doomed {}

/// Unpinning and unmapping a page-locked buffer costs about a millisecond (the driver unmaps it
/// from the device too); one thread does it, so that whoever drops the last handle — the
/// forward, on its critical path — does not wait. The memory is released moments later.
fn reaper() -> &'static Mutex<Sender<Doomed>> {
    static REAPER: std::sync::OnceLock<Mutex<Sender<Doomed>>> = std::sync::OnceLock::new();
    REAPER.get_or_init(|| {
        let (tx, rx) = channel::<Doomed>();
        let _ = std::thread::Builder::new()
            .name("tarfa-unpin".into())
            .spawn(move || {
                for d in rx {
                    d.pin.unpin(d.ptr.as_ptr());
                    // SAFETY: the mapping made in `AlignedBuf::zeroed`, unmapped once.
                    unsafe {
                        libc::munmap(d.ptr.as_ptr() as *mut libc::c_void, d.mapped);
                    }
                }
            });
        Mutex::new(tx)
    })
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Some(pin) = self.pinned_by.take() {
            let d = Doomed {
                ptr: self.ptr,
                mapped: self.mapped,
                pin,
            };
            let tx = reaper().lock().unwrap_or_else(|e| e.into_inner());
            match tx.send(d) {
                Ok(()) => return,
                // no reaper thread: do it here
                Err(e) => e.0.pin.unpin(self.ptr.as_ptr()),
            }
        }
        // SAFETY: the mapping made in `zeroed`, unmapped once.
        unsafe {
            libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.mapped);
        }
    }
}

/// The warm tier's byte budget: bytes of expert buffers alive, and their peak.
struct Budget {
    /// `u64::MAX` when unbounded.
    capacity: u64,
    used: AtomicU64,
    peak: AtomicU64,
}

/// Bytes charged to the budget; released when dropped.
struct Charge {
    budget: Arc<Budget>,
    bytes: u64,
}

impl Budget {
    /// Charges `bytes`. Callers hold the state lock and checked the room (only chargers add,
    /// and they are serialised by that lock; releases only lower `used`).
    fn charge(self: &Arc<Budget>, bytes: u64) -> Charge {
        let now = self.used.fetch_add(bytes, Ordering::AcqRel) + bytes;
        self.peak.fetch_max(now, Ordering::AcqRel);
        Charge {
            budget: self.clone(),
            bytes,
        }
    }

    fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }
}

impl Charge {
    /// Gives back `bytes` of the charge now (an encoded extent's stored bytes, once decoded).
    fn release_part(&mut self, bytes: u64) {
        let bytes = bytes.min(self.bytes);
        self.bytes -= bytes;
        self.budget.used.fetch_sub(bytes, Ordering::AcqRel);
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// A verified extent: the buffer it was read and checked in, and its budget charge.
struct Extent {
    buf: AlignedBuf,
    info: Arc<ExtentInfo>,
    /// An MXFP4 extent's exact BF16 widening, made from `buf` after `buf` verified.
    widened: Option<crate::weights::ExpertWeights>,
    _charge: Charge,
}

impl Extent {
    fn views(&self) -> [Bf16View<'_>; 3] {
        if let Some(w) = &self.widened {
            return [w.gate.view(), w.up.view(), w.down.view()];
        }
        let bytes = self.buf.as_slice();
        self.info.mats.map(|m| {
            let raw = &bytes[m.offset..m.offset + 2 * m.elems];
            // SAFETY: the buffer is 4096-aligned and `m.offset` is even (checked when the index
            // was built), so the range is 2-byte aligned; any bits are a valid u16; the host is
            // little-endian (checked at compile time), as BF16 bytes are stored.
            let data = unsafe { std::slice::from_raw_parts(raw.as_ptr() as *const u16, m.elems) };
            Bf16View {
                rows: m.rows,
                cols: m.cols,
                data,
            }
        })
    }
}

/// Why a read failed; kept so that every later request fails the same way.
#[derive(Clone, Debug)]
enum Failure {
    Mismatch {
        name: String,
    },
    StoredMismatch {
        name: String,
    },
    Undecodable {
        name: String,
        msg: String,
    },
    Truncated {
        name: String,
        expected: u64,
        got: u64,
    },
    Io {
        name: String,
        msg: String,
    },
    Alloc {
        bytes: u64,
    },
    Mxfp4 {
        name: String,
        msg: String,
    },
    Closed,
}

impl Failure {
    fn to_error(&self, path: &std::path::Path) -> StreamError {
        let path = path.to_path_buf();
        match self.clone() {
            Failure::Mismatch { name } => StreamError::HashMismatch { path, name },
            Failure::StoredMismatch { name } => StreamError::StoredHashMismatch { path, name },
            Failure::Undecodable { name, msg } => StreamError::Undecodable { path, name, msg },
            Failure::Truncated {
                name,
                expected,
                got,
            } => StreamError::Truncated {
                path,
                name,
                expected,
                got,
            },
            Failure::Io { name, msg } => StreamError::Io {
                path,
                op: "read",
                msg: format!("{name}: {msg}"),
            },
            Failure::Alloc { bytes } => StreamError::OutOfMemory { bytes },
            Failure::Mxfp4 { name, msg } => StreamError::Mxfp4 { path, name, msg },
            Failure::Closed => StreamError::Io {
                path,
                op: "read",
                msg: "the reader threads stopped".into(),
            },
        }
    }
}

/// Reads extents from the container.
struct Reader {
    file: File,
    path: PathBuf,
}

impl Reader {
    fn open(bundle: &BundleSource, io: IoMode) -> Result<Reader, StreamError> {
        let path = bundle.jnf_path().to_path_buf();
        let file = match io {
            IoMode::Cached => bundle.file_handle().map_err(|e| StreamError::Io {
                path: path.clone(),
                op: "open",
                msg: e.to_string(),
            })?,
            IoMode::Direct => std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(&path)
                .map_err(|source| StreamError::DirectIoUnsupported {
                    path: path.clone(),
                    source,
                })?,
        };
        Ok(Reader { file, path })
    }

    /// Fills `buf` from the extent's offset: one `pread` of the whole buffer (continued only if
    /// the kernel returns short).
    fn read(&self, info: &ExtentInfo, buf: &mut [u8]) -> Result<(), Failure> {
        let want = buf.len();
        let mut done = 0;
        while done < want {
            match self
                .file
                .read_at(&mut buf[done..], info.offset + done as u64)
            {
                Ok(0) => {
                    return Err(Failure::Truncated {
                        name: info.name.clone(),
                        expected: want as u64,
                        got: done as u64,
                    })
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(Failure::Io {
                        name: info.name.clone(),
                        msg: e.to_string(),
                    })
                }
            }
        }
        Ok(())
    }
}

enum Status {
    Queued,
    Loading,
    Ready(Arc<Extent>),
}

struct Entry {
    status: Status,
    /// Part of the current look-ahead guess: kept from eviction by the guess's own reads (a
    /// read for a request may still evict it).
    guessed: bool,
    /// Read by look-ahead and not yet asked for: its first request is a look-ahead hit.
    ahead: bool,
    /// Handles out, plus requests waiting for this entry.
    leases: u32,
    /// Part of the current prefetch plan, not yet asked for.
    planned: bool,
    /// Asked for before its read was issued (the read is that request's miss).
    claimed: bool,
    /// Read, and the read not yet claimed by a request.
    unclaimed_read: bool,
    /// Read only for a caller that keeps its own copy ([`ExpertStore::fetch_copy`]: the CUDA
    /// upload): dropped when its last lease goes, whatever the policy, so that a model whose
    /// every expert lives on the GPU leaves no second copy in host memory. A request that uses
    /// the entry ([`ExpertStore::fetch`], [`ExpertStore::fetch_uncounted`]) makes it ordinary.
    transient: bool,
    last_use: u64,
}

impl Entry {
    fn queued(planned: bool) -> Entry {
        Entry {
            status: Status::Queued,
            guessed: false,
            ahead: false,
            leases: 0,
            planned,
            claimed: false,
            unclaimed_read: false,
            transient: false,
            last_use: 0,
        }
    }
}

struct Job {
    key: Key,
    charge: Charge,
    /// A look-ahead read (for the in-flight count of such reads).
    ahead: bool,
}

/// Why experts are fetched: what the heat ledger counts and what the warm tier keeps.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fetch {
    /// A step uses them: counted, kept by the policy.
    Use,
    /// Read ahead of use (`--preload`): not counted, kept by the policy.
    Preload,
    /// Copied by a caller that keeps its own copy: not counted, and not kept unless held
    /// already or wanted by a use.
    Copy,
}

struct State {
    entries: HashMap<Key, Entry>,
    /// Keys waiting for room, in the order their reads are to be issued.
    queue: VecDeque<Key>,
    /// Keys of the current prefetch plan.
    plan: Vec<Key>,
    /// Keys of the current look-ahead guess, most likely first.
    guess: Vec<Key>,
    /// Guessed keys waiting for room; issued only while `queue` is empty.
    guess_queue: VecDeque<Key>,
    /// The layer guessed and the guess, until that layer's routes arrive and score it.
    guess_for: Option<(usize, Vec<usize>)>,
    clock: u64,
    inflight: usize,
    /// Of `inflight`, the reads look-ahead issued.
    inflight_ahead: usize,
    busy_since: Option<Instant>,
    /// Bytes of pinned experts loading or loaded.
    pins_held: u64,
    /// Live [`Lease`]s.
    handed_out: usize,
    failure: Option<Failure>,
    /// Uses per expert in this store's life (the heat ledger's input).
    heat: HashMap<Key, u64>,
    tx: Option<Sender<Job>>,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
    budget: Arc<Budget>,
    counters: Counters,
    reader: Reader,
    index: BTreeMap<Key, Arc<ExtentInfo>>,
    policy: CachePolicy,
    io: IoMode,
    pinned: HashSet<Key>,
    pinned_bytes: u64,
    /// The most buffer bytes the current guess's unclaimed look-ahead reads may hold: half the
    /// room the pins leave, but at least one expert.
    lookahead_cap: u64,
    /// The heat ledger's counts at open (the `ledger` guess adds this run's uses).
    ledger_counts: HashMap<Key, u64>,
    bundle: Arc<BundleSource>,
    /// Page-locks each buffer once it is verified, when a backend asked ([`HostPin`]).
    host_pin: std::sync::OnceLock<Arc<dyn HostPin>>,
}

/// The warm tier of one bundle's experts.
pub struct ExpertStore {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

/// A verified expert handed to the forward: views into the buffer it was checked in. The
/// buffer stays charged to the budget, and its entry unevictable, until this is dropped.
pub struct Lease {
    shared: Arc<Shared>,
    key: Key,
    ext: Option<Arc<Extent>>,
}

impl ExpertData for Lease {
    fn matrices(&self) -> [Bf16View<'_>; 3] {
        match &self.ext {
            Some(e) => e.views(),
            None => {
                [Bf16View {
                    rows: 0,
                    cols: 0,
                    data: &[],
                }; 3]
            }
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let shared = self.shared.clone();
        let mut st = shared.lock();
        st.handed_out -= 1;
        // Dropping the buffer under the lock only touches the budget's atomics.
        self.ext = None;
        shared.release(&mut st, self.key);
        shared.pump(&mut st);
        drop(st);
        shared.cv.notify_all();
    }
}

fn build_index(
    bundle: &BundleSource,
    io: IoMode,
) -> Result<BTreeMap<Key, Arc<ExtentInfo>>, StreamError> {
    let path = bundle.jnf_path().to_path_buf();
    let bad = |name: &str, what: &str| StreamError::Io {
        path: path.clone(),
        op: "index experts",
        msg: format!("{name}: {what}"),
    };
    let mut index = BTreeMap::new();
    for (e, hex) in bundle.expert_extents() {
        let blake3 = blake3::Hash::from_hex(hex.as_bytes())
            .map_err(|_| bad(&e.prefix, "the manifest BLAKE3 is not hex"))?;
        let encoded = match (e.is_encoded(), bundle.stored_blake3(e.layer, e.expert)) {
            (false, _) => None,
            (true, Some(hex)) => Some((
                e.clone(),
                blake3::Hash::from_hex(hex.as_bytes())
                    .map_err(|_| bad(&e.prefix, "the manifest stored_blake3 is not hex"))?,
            )),
            (true, None) => return Err(bad(&e.prefix, "an encoded extent without stored_blake3")),
        };
        let mut mats = [MatLayout {
            rows: 0,
            cols: 0,
            offset: 0,
            elems: 0,
        }; 3];
        let mxfp4 = e.encoding() == jnf_format::ExtentEncoding::Mxfp4;
        // An MXFP4 extent is not viewed in place: its widened gate, up and down are charged
        // besides its buffer (3 H I BF16 values; the header validated the parts' shapes).
        let widened_bytes = if mxfp4 {
            let (h, i) = match e.matrices[2].shape.as_slice() {
                [h, g, _] => (*h, 32 * *g),
                _ => return Err(bad(&e.prefix, "an MXFP4 part is not [rows, groups, 16]")),
            };
            6 * h * i
        } else {
            0
        };
        for (m, h) in mats.iter_mut().zip(&e.matrices).filter(|_| !mxfp4) {
            let (rows, cols) = match h.shape.as_slice() {
                [r, c] => (*r as usize, *c as usize),
                _ => return Err(bad(&h.name, "an expert matrix is not 2-D")),
            };
            let elems = rows
                .checked_mul(cols)
                .ok_or_else(|| bad(&h.name, "shape overflows"))?;
            // The views reinterpret bytes as u16 in place: ranges must be even and inside.
            let ok = h.offset % 2 == 0
                && h.length == 2 * elems as u64
                && h.offset
                    .checked_add(h.length)
                    .is_some_and(|end| end <= e.length);
            if !ok {
                return Err(bad(
                    &h.name,
                    "matrix range is not a BF16 range inside the extent",
                ));
            }
            *m = MatLayout {
                rows,
                cols,
                offset: h.offset as usize,
                elems,
            };
        }
        let read_bytes = io.read_bytes(&e);
        if read_bytes < e.stored_length
            || (io == IoMode::Direct && !read_bytes.is_multiple_of(ALIGN as u64))
        {
            return Err(bad(
                &e.prefix,
                "the padded length does not cover the extent",
            ));
        }
        index.insert(
            (e.layer as usize, e.expert as usize),
            Arc::new(ExtentInfo {
                name: e.prefix.clone(),
                offset: e.offset,
                length: e.length,
                read_bytes,
                buf_bytes: io.buffer_bytes(&e) + widened_bytes,
                scratch_bytes: io.scratch_bytes(&e),
                encoded,
                blake3,
                blake3_hex: hex,
                mats,
                mxfp4: mxfp4.then(|| e.clone()),
            }),
        );
    }
    Ok(index)
}

/// The experts `policy` pins under `capacity`: a part of the budget for the hottest experts
/// (the ledger's), always leaving room to stream at least one more expert.
fn choose_pins(
    policy: CachePolicy,
    capacity: Option<u64>,
    index: &BTreeMap<Key, Arc<ExtentInfo>>,
    ledger: Option<&HeatLedger>,
) -> HashSet<Key> {
    let mut pins = HashSet::new();
    let total: u64 = index.values().map(|i| i.buf_bytes).sum();
    // The most one read needs at once (an encoded extent's stored bytes beside its buffer).
    let largest = index.values().map(|i| i.read_charge()).max().unwrap_or(0);
    let scratch = index.values().map(|i| i.scratch_bytes).max().unwrap_or(0);
    let cap = match capacity {
        Some(cap) if total + scratch > cap => cap,
        // Everything fits: the static set is everything (it keeps nothing else); the other
        // policies never evict, so pins would change nothing.
        _ => {
            if policy == CachePolicy::Static {
                pins.extend(index.keys().copied());
            }
            return pins;
        }
    };
    let share = match policy {
        CachePolicy::Ledger => cap / 2,
        CachePolicy::Static => cap - (cap / 4).max(largest).min(cap),
        CachePolicy::Lru | CachePolicy::None => return pins,
    };
    let limit = share.min(cap.saturating_sub(largest));
    let mut candidates: Vec<Key> = ledger.map(|l| l.hottest()).unwrap_or_default();
    if policy == CachePolicy::Static {
        // Without history, an even spread: expert 0 of every layer, then expert 1, ...
        let max_e = index.keys().map(|k| k.1).max().unwrap_or(0);
        let layers: Vec<usize> = index
            .keys()
            .map(|k| k.0)
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        let mut layers = layers;
        layers.sort_unstable();
        for e in 0..=max_e {
            for &l in &layers {
                candidates.push((l, e));
            }
        }
    }
    let mut used = 0u64;
    for k in candidates {
        let Some(info) = index.get(&k) else { continue };
        if pins.contains(&k) {
            continue;
        }
        if used + info.buf_bytes > limit {
            // Experts of a model are all one size: nothing later fits either.
            break;
        }
        used += info.buf_bytes;
        pins.insert(k);
    }
    pins
}

impl ExpertStore {
    /// The smallest `--ram-budget` that holds one expert of `bundle` under `io`: the largest
    /// expert's buffer, with an MXFP4 expert's widened matrices (what [`ExpertStore::new`]
    /// refuses below). Not the extent's length: an MXFP4 extent is about a quarter of what the
    /// RAM tier holds for it.
    pub fn min_ram_budget(bundle: &BundleSource, io: IoMode) -> Result<u64, StreamError> {
        let index = build_index(bundle, io)?;
        Ok(index.values().map(|i| i.read_charge()).max().unwrap_or(0))
    }

    pub fn new(
        bundle: Arc<BundleSource>,
        opts: &StreamOptions,
        ledger: Option<&HeatLedger>,
    ) -> Result<ExpertStore, StreamError> {
        let index = build_index(&bundle, opts.io)?;
        let minimum = index.values().map(|i| i.read_charge()).max().unwrap_or(0);
        if let Some(b) = opts.ram_budget {
            if b < minimum {
                return Err(StreamError::BudgetTooSmall {
                    flag: "--ram-budget",
                    budget: b,
                    minimum,
                });
            }
        }
        let reader = Reader::open(&bundle, opts.io)?;
        let pinned = choose_pins(opts.policy, opts.ram_budget, &index, ledger);
        let pinned_bytes: u64 = pinned.iter().map(|k| index[k].buf_bytes).sum();
        let (tx, rx) = channel::<Job>();
        let capacity = opts.ram_budget.unwrap_or(u64::MAX);
        let scratch = index.values().map(|i| i.scratch_bytes).max().unwrap_or(0);
        let lookahead_cap = (capacity
            .saturating_sub(pinned_bytes)
            .saturating_sub(scratch)
            / 2)
        .max(index.values().map(|i| i.buf_bytes).max().unwrap_or(0));
        let mut ledger_counts = HashMap::new();
        for (l, row) in ledger
            .map(|l| l.counts.as_slice())
            .unwrap_or(&[])
            .iter()
            .enumerate()
        {
            for (e, &n) in row.iter().enumerate() {
                if n > 0 && index.contains_key(&(l, e)) {
                    ledger_counts.insert((l, e), n);
                }
            }
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                entries: HashMap::new(),
                queue: VecDeque::new(),
                plan: Vec::new(),
                guess: Vec::new(),
                guess_queue: VecDeque::new(),
                guess_for: None,
                clock: 0,
                inflight: 0,
                inflight_ahead: 0,
                busy_since: None,
                pins_held: 0,
                handed_out: 0,
                failure: None,
                heat: HashMap::new(),
                tx: Some(tx),
            }),
            cv: Condvar::new(),
            budget: Arc::new(Budget {
                capacity,
                used: AtomicU64::new(0),
                peak: AtomicU64::new(0),
            }),
            counters: Counters::default(),
            reader,
            index,
            policy: opts.policy,
            io: opts.io,
            pinned,
            pinned_bytes,
            lookahead_cap,
            ledger_counts,
            bundle,
            host_pin: std::sync::OnceLock::new(),
        });
        // More readers than buffers the budget holds would only wait for room.
        let slots = (capacity / minimum.max(1)).max(1);
        let threads = opts.io_threads.max(1).min(slots.min(64) as usize);
        let rx = Arc::new(Mutex::new(rx));
        let mut store = ExpertStore {
            shared,
            workers: Vec::with_capacity(threads),
        };
        for i in 0..threads {
            let (shared, rx) = (store.shared.clone(), rx.clone());
            let w = std::thread::Builder::new()
                .name(format!("tarfa-io-{i}"))
                .spawn(move || reader_loop(&shared, &rx))
                .map_err(|e| StreamError::Io {
                    path: store.shared.reader.path.clone(),
                    op: "start reader threads",
                    msg: e.to_string(),
                })?;
            store.workers.push(w);
        }
        Ok(store)
    }

    /// Counters since the store was made.
    pub fn stats(&self) -> StreamStats {
        self.shared
            .counters
            .snapshot(self.shared.budget.peak.load(Ordering::Acquire))
    }

    /// Uses per (layer, expert) so far, for the heat ledger.
    pub fn heat(&self) -> Vec<((usize, usize), u64)> {
        let st = self.shared.lock();
        let mut v: Vec<_> = st.heat.iter().map(|(&k, &n)| (k, n)).collect();
        v.sort_unstable();
        v
    }

    /// From now on, page-lock every buffer once it is read and verified (a GPU backend copies
    /// from page-locked memory asynchronously, at the bus's speed). The first call wins.
    pub fn set_host_pin(&self, pin: Arc<dyn HostPin>) {
        let _ = self.shared.host_pin.set(pin);
    }

    /// Counts uses of experts that a tier above this one (the GPU's hot tier) served without
    /// asking: the heat ledger learns every use, whichever tier served it.
    pub fn record_uses(&self, layer: usize, ids: &[usize]) {
        let mut st = self.shared.lock();
        for &id in ids {
            *st.heat.entry((layer, id)).or_insert(0) += 1;
        }
    }

    /// The RAM budget in bytes (`None`: unbounded).
    pub fn capacity(&self) -> Option<u64> {
        (self.shared.budget.capacity != u64::MAX).then_some(self.shared.budget.capacity)
    }

    /// Bytes of expert buffers alive now.
    pub fn used_bytes(&self) -> u64 {
        self.shared.budget.used()
    }

    /// How many experts the policy pinned, and their bytes.
    pub fn pinned(&self) -> (usize, u64) {
        (self.shared.pinned.len(), self.shared.pinned_bytes)
    }

    pub fn io(&self) -> IoMode {
        self.shared.io
    }

    pub fn policy(&self) -> CachePolicy {
        self.shared.policy
    }

    /// Bytes the largest expert's read needs (the smallest budget): its buffer, and an encoded
    /// extent's stored bytes beside it until they are decoded.
    pub fn largest_buffer(&self) -> u64 {
        self.shared
            .index
            .values()
            .map(|i| i.read_charge())
            .max()
            .unwrap_or(0)
    }

    /// Bytes the buffers of all experts would occupy.
    pub fn total_buffer_bytes(&self) -> u64 {
        self.shared.index.values().map(|i| i.buf_bytes).sum()
    }

    /// The experts of `layer`, ascending.
    pub fn expert_ids(&self, layer: usize) -> Vec<usize> {
        self.shared
            .index
            .range((layer, 0)..(layer + 1, 0))
            .map(|(k, _)| k.1)
            .collect()
    }

    /// Groups of `ids` that fit, experts already held first (see
    /// [`crate::weights::WeightSource::expert_batches`]).
    pub fn batches(&self, layer: usize, ids: &[usize]) -> Vec<Vec<usize>> {
        let sh = &self.shared;
        let st = sh.lock();
        let size = |id: usize| sh.index.get(&(layer, id)).map_or(0, |i| i.buf_bytes);
        let ready = |id: usize| {
            matches!(
                st.entries.get(&(layer, id)),
                Some(Entry {
                    status: Status::Ready(_),
                    ..
                })
            )
        };
        let (held, missing): (Vec<usize>, Vec<usize>) = ids.iter().partition(|&&id| ready(id));
        // What a group may hold: the budget less the pinned set's share (pinned experts cost
        // nothing more, their room is reserved).
        let cost = |id: usize| {
            if sh.pinned.contains(&(layer, id)) {
                0
            } else {
                size(id)
            }
        };
        // Room for one read's stored bytes is kept beside every group (encoded extents), so
        // that its last read always fits once the others are decoded.
        let scratch = ids
            .iter()
            .filter_map(|&id| sh.index.get(&(layer, id)))
            .map(|i| i.scratch_bytes)
            .max()
            .unwrap_or(0);
        let room = sh
            .budget
            .capacity
            .saturating_sub(sh.pinned_bytes)
            .saturating_sub(scratch);
        let all: u64 = ids.iter().map(|&id| cost(id)).sum();
        if all <= room {
            // Everything fits: the held experts are computed while the others are read.
            return [held, missing]
                .into_iter()
                .filter(|b| !b.is_empty())
                .collect();
        }
        // Half the room per group, so that the next group's reads proceed while this one is
        // computed (but at least one expert per group).
        let largest = ids.iter().map(|&id| size(id)).max().unwrap_or(0);
        let group = (room / 2).max(largest);
        let mut out: Vec<Vec<usize>> = Vec::new();
        let mut cur: Vec<usize> = Vec::new();
        let mut cur_cost = 0u64;
        for id in held.into_iter().chain(missing) {
            let c = cost(id);
            if !cur.is_empty() && cur_cost + c > group {
                out.push(std::mem::take(&mut cur));
                cur_cost = 0;
            }
            cur.push(id);
            cur_cost += c;
        }
        if !cur.is_empty() {
            out.push(cur);
        }
        out
    }

    /// Starts the reads of `batches` of `layer`, in order, as far as the budget allows;
    /// replaces the previous plan.
    pub fn prefetch(&self, layer: usize, batches: &[Vec<usize>]) {
        let sh = &self.shared;
        let mut st = sh.lock();
        if st.failure.is_some() {
            return;
        }
        sh.cancel_plan(&mut st);
        // This layer's routes score the guess made for it.
        if let Some((guessed, guess)) = st.guess_for.take() {
            if guessed == layer {
                let ids: HashSet<usize> = batches.iter().flatten().copied().collect();
                let right = guess.iter().filter(|id| ids.contains(id)).count();
                add(&sh.counters.lookahead_guessed, guess.len() as u64);
                add(&sh.counters.lookahead_right, right as u64);
                add(&sh.counters.lookahead_needed, ids.len() as u64);
            }
        }
        for &id in batches.iter().flatten() {
            let key = (layer, id);
            if !sh.index.contains_key(&key) {
                continue;
            }
            match st.entries.get_mut(&key) {
                Some(e) => {
                    // A guessed read still waiting for room joins the plan's queue, in order.
                    let waiting_guess =
                        matches!(e.status, Status::Queued) && !e.planned && !e.claimed;
                    if !e.planned {
                        e.planned = true;
                        st.plan.push(key);
                    }
                    if waiting_guess {
                        st.queue.push_back(key);
                    }
                }
                None => {
                    st.entries.insert(key, Entry::queued(true));
                    st.queue.push_back(key);
                    st.plan.push(key);
                }
            }
        }
        // The routes are known: what the guess read and the plan wants is the plan's now.
        sh.cancel_guess(&mut st);
        sh.pump(&mut st);
    }

    /// Starts reading `guess` (experts of `layer`, most likely first) ahead of that layer's
    /// routes, into room nothing the current step holds needs, behind every read a request or
    /// the plan waits for; replaces the previous guess. Experts held already are kept from the
    /// guess's own evictions. See the module documentation for what a guess may evict.
    pub fn lookahead(&self, layer: usize, guess: &[usize]) {
        let sh = &self.shared;
        let mut st = sh.lock();
        if st.failure.is_some() {
            return;
        }
        sh.cancel_guess(&mut st);
        let mut ids: Vec<usize> = Vec::new();
        for &id in guess {
            let key = (layer, id);
            if !sh.index.contains_key(&key) || ids.contains(&id) {
                continue;
            }
            ids.push(id);
            st.guess.push(key);
            match st.entries.get_mut(&key) {
                Some(e) => e.guessed = true,
                None => {
                    st.entries.insert(
                        key,
                        Entry {
                            guessed: true,
                            ..Entry::queued(false)
                        },
                    );
                    st.guess_queue.push_back(key);
                }
            }
        }
        st.guess_for = Some((layer, ids));
        sh.pump(&mut st);
    }

    /// The `count` experts of `layer` used most, by the heat ledger's counts at open plus this
    /// run's uses, most used first (ties: lower id); experts never used are not guessed.
    pub fn hottest(&self, layer: usize, count: usize) -> Vec<usize> {
        let sh = &self.shared;
        let st = sh.lock();
        let mut heat: Vec<(u64, usize)> = sh
            .index
            .range((layer, 0)..(layer + 1, 0))
            .map(|(&k, _)| {
                let n = sh.ledger_counts.get(&k).copied().unwrap_or(0)
                    + st.heat.get(&k).copied().unwrap_or(0);
                (n, k.1)
            })
            .filter(|&(n, _)| n > 0)
            .collect();
        heat.sort_unstable_by_key(|&(n, id)| (std::cmp::Reverse(n), id));
        heat.into_iter().take(count).map(|(_, id)| id).collect()
    }

    /// Waits until no read is in flight: what a step started (a look-ahead read whose guess
    /// ended, a cancelled plan's read) has finished and been counted, so that figures taken
    /// now add up and nothing changes them until the next request or hint (a reader thread
    /// only acts on a read it was handed). Returns at once when nothing is in flight.
    pub fn settle(&self) {
        let sh = &self.shared;
        let mut st = sh.lock();
        while st.inflight > 0 {
            st = sh.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Reads done (or in flight) that no request has used yet: with the counters, once the
    /// store is settled ([`ExpertStore::settle`]),
    /// `reads = misses + lookahead_hits + wasted_reads + unclaimed_reads()`.
    pub fn unclaimed_reads(&self) -> u64 {
        let st = self.shared.lock();
        st.entries.values().filter(|e| e.unclaimed_read).count() as u64
    }

    /// The experts `ids` of `layer`, read and verified where not held, as leases.
    pub fn fetch(&self, layer: usize, ids: &[usize]) -> Result<Vec<Lease>, WeightError> {
        self.shared.fetch(layer, ids, Fetch::Use)
    }

    /// [`ExpertStore::fetch`] without counting uses in the heat ledger (`--preload` reads every
    /// expert once, which says nothing about which are hot).
    pub fn fetch_uncounted(&self, layer: usize, ids: &[usize]) -> Result<Vec<Lease>, WeightError> {
        self.shared.fetch(layer, ids, Fetch::Preload)
    }

    /// [`ExpertStore::fetch_uncounted`] for a caller that copies the experts and keeps the copy
    /// (the CUDA upload): what this read brings into the warm tier leaves it with the last
    /// lease, whatever the policy; what was held already stays.
    pub fn fetch_copy(&self, layer: usize, ids: &[usize]) -> Result<Vec<Lease>, WeightError> {
        self.shared.fetch(layer, ids, Fetch::Copy)
    }
}

impl Drop for ExpertStore {
    fn drop(&mut self) {
        // Closing the queue ends the reader threads once their reads are done.
        self.shared.lock().tx = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// CPU time of the calling thread, in ns.
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0;
    }
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// Whether `key` waits for its read.
fn is_queued(st: &State, key: Key) -> bool {
    matches!(
        st.entries.get(&key),
        Some(Entry {
            status: Status::Queued,
            ..
        })
    )
}

fn reader_loop(shared: &Arc<Shared>, rx: &Mutex<Receiver<Job>>) {
    loop {
        let job = {
            let rx = rx.lock().unwrap_or_else(|e| e.into_inner());
            match rx.recv() {
                Ok(j) => j,
                Err(_) => return,
            }
        };
        let result = shared.read_one(job);
        shared.complete(result);
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn keeps(&self, key: Key) -> bool {
        match self.policy {
            CachePolicy::Lru | CachePolicy::Ledger => true,
            CachePolicy::Static => self.pinned.contains(&key),
            CachePolicy::None => false,
        }
    }

    /// Reads and verifies one extent (on a reader thread, without the lock).
    fn read_one(&self, job: Job) -> (Key, bool, Result<Extent, Failure>) {
        let info = self.index[&job.key].clone();
        let mut charge = job.charge;
        let result = (|| {
            let alloc = || Failure::Alloc {
                bytes: info.read_charge(),
            };
            let mut buf = match &info.encoded {
                None => {
                    let mut buf = AlignedBuf::zeroed(info.read_bytes as usize).ok_or_else(alloc)?;
                    self.reader.read(&info, buf.as_mut_slice())?;
                    add(&self.counters.bytes_read, info.read_bytes);
                    buf
                }
                Some((extent, stored_blake3)) => {
                    let buf = self.read_decoded(&info, extent, stored_blake3, alloc)?;
                    // The stored bytes' buffer is gone: its share of the charge goes back.
                    charge.release_part(info.scratch_bytes);
                    buf
                }
            };
            // Verified in the buffer the forward will compute from, before anyone sees it.
            // Timed in thread CPU time: with more reader threads than cores, wall time would
            // count the time a hashing thread waited for a core.
            let t = thread_cpu_ns();
            let digest = blake3::hash(&buf.as_slice()[..info.length as usize]);
            add(&self.counters.verify_ns, thread_cpu_ns().saturating_sub(t));
            add(&self.counters.verified_bytes, info.length);
            if digest != info.blake3 {
                return Err(Failure::Mismatch {
                    name: info.name.clone(),
                });
            }
            self.bundle
                .note_expert_verified(&info.name, info.length, &info.blake3_hex);
            let widened = match &info.mxfp4 {
                None => None,
                Some(e) => Some(
                    crate::bundle::widen_mxfp4_extent(
                        self.bundle.jnf_path(),
                        e,
                        &buf.as_slice()[..info.length as usize],
                    )
                    .map_err(|err| Failure::Mxfp4 {
                        name: info.name.clone(),
                        msg: err.to_string(),
                    })?,
                ),
            };
            if let Some(p) = self.host_pin.get() {
                let t = Instant::now();
                if p.pin(buf.ptr.as_ptr(), buf.mapped) {
                    buf.pinned_by = Some(p.clone());
                }
                add_time(&self.counters.pin_ns, t.elapsed());
            }
            Ok(Extent {
                buf,
                info: info.clone(),
                widened,
                _charge: charge,
            })
        })();
        (job.key, job.ahead, result)
    }

    /// An encoded extent: its stored bytes read into a buffer of their own, checked against the
    /// manifest's `stored_blake3` (a mismatch stops here: nothing is decoded), then decoded into
    /// the buffer the forward will use, which is returned (its decoded bytes not yet checked).
    fn read_decoded(
        &self,
        info: &ExtentInfo,
        extent: &jnf_format::ExpertExtent,
        stored_blake3: &blake3::Hash,
        alloc: impl Fn() -> Failure,
    ) -> Result<AlignedBuf, Failure> {
        let mut stored = AlignedBuf::zeroed(info.read_bytes as usize).ok_or_else(&alloc)?;
        self.reader.read(info, stored.as_mut_slice())?;
        add(&self.counters.bytes_read, info.read_bytes);
        let stored = &stored.as_slice()[..extent.stored_length as usize];
        let t = thread_cpu_ns();
        let digest = blake3::hash(stored);
        add(&self.counters.verify_ns, thread_cpu_ns().saturating_sub(t));
        add(&self.counters.verified_bytes, extent.stored_length);
        if digest != *stored_blake3 {
            return Err(Failure::StoredMismatch {
                name: info.name.clone(),
            });
        }
        // Timed with its buffer's mapping: a raw extent's buffer pages are faulted in by its
        // read, an encoded one's by this.
        let t = thread_cpu_ns();
        let mut buf = AlignedBuf::populated(info.length as usize).ok_or_else(&alloc)?;
        extent
            .decode_stored(stored, buf.as_mut_slice())
            .map_err(|e| Failure::Undecodable {
                name: info.name.clone(),
                msg: e.to_string(),
            })?;
        add(&self.counters.decode_ns, thread_cpu_ns().saturating_sub(t));
        add(&self.counters.decoded_bytes, info.length);
        Ok(buf)
    }

    fn complete(&self, (key, ahead, result): (Key, bool, Result<Extent, Failure>)) {
        let mut st = self.lock();
        st.inflight -= 1;
        if ahead {
            st.inflight_ahead -= 1;
        }
        if st.inflight == 0 {
            if let Some(t) = st.busy_since.take() {
                add_time(&self.counters.read_busy_ns, t.elapsed());
            }
        }
        match result {
            Ok(ext) => {
                add(&self.counters.reads, 1);
                if let Some(e) = st.entries.get_mut(&key) {
                    e.status = Status::Ready(Arc::new(ext));
                }
                self.release_if_idle(&mut st, key);
            }
            Err(f) => {
                // The run stops: no later request is served, and no further read is issued.
                st.failure.get_or_insert(f);
                if let Some(e) = st.entries.remove(&key) {
                    self.note_gone(key, &e);
                }
            }
        }
        self.pump(&mut st);
        drop(st);
        self.cv.notify_all();
    }

    /// A lease on `key` ended.
    fn release(&self, st: &mut State, key: Key) {
        if let Some(e) = st.entries.get_mut(&key) {
            e.leases = e.leases.saturating_sub(1);
        }
        self.release_if_idle(st, key);
    }

    /// Drops `key`'s entry if nobody wants it and the policy does not keep it.
    fn release_if_idle(&self, st: &mut State, key: Key) {
        let Some(e) = st.entries.get(&key) else {
            return;
        };
        let keep = self.keeps(key) && !e.transient;
        let idle = e.leases == 0 && !e.planned && !e.guessed;
        match e.status {
            Status::Ready(_) if idle && !keep => {
                if let Some(e) = st.entries.remove(&key) {
                    self.note_gone(key, &e);
                }
            }
            Status::Queued if idle => {
                st.entries.remove(&key);
            }
            _ => {}
        }
    }

    /// Counts an entry leaving the warm tier: a read nobody used was wasted.
    fn note_gone(&self, key: Key, e: &Entry) {
        if e.unclaimed_read {
            add(&self.counters.wasted_reads, 1);
        }
        if e.ahead {
            add(&self.counters.lookahead_wasted, 1);
            add(
                &self.counters.lookahead_wasted_bytes,
                self.index[&key].read_bytes,
            );
        }
    }

    /// Ends the current guess: what it read stays as any read does (its first request a
    /// look-ahead hit), what it has not read yet is not read.
    fn cancel_guess(&self, st: &mut State) {
        st.guess_queue.clear();
        for key in std::mem::take(&mut st.guess) {
            if let Some(e) = st.entries.get_mut(&key) {
                e.guessed = false;
            }
            self.release_if_idle(st, key);
        }
    }

    /// Takes back the current plan's reservations.
    fn cancel_plan(&self, st: &mut State) {
        for key in std::mem::take(&mut st.plan) {
            if let Some(e) = st.entries.get_mut(&key) {
                e.planned = false;
            }
            self.release_if_idle(st, key);
        }
    }

    /// Makes room for `bytes` more (for `key`), evicting least recently used entries that are
    /// ready, unpinned and wanted by nobody (for a look-ahead read, not guessed either). False
    /// when that is not enough now.
    fn make_room(&self, st: &mut State, key: Key, bytes: u64, for_guess: bool) -> bool {
        let cap = self.budget.capacity;
        // A pinned expert's buffer has its room reserved (its read's stored bytes do not).
        let own = if self.pinned.contains(&key) {
            self.index[&key].buf_bytes
        } else {
            0
        };
        // Room the pinned set has not taken yet stays free for it.
        let reserve = (self.pinned_bytes - st.pins_held).saturating_sub(own);
        loop {
            let need = self
                .budget
                .used()
                .saturating_add(bytes)
                .saturating_add(reserve);
            if need <= cap {
                return true;
            }
            let victim = st
                .entries
                .iter()
                .filter(|(k, e)| {
                    matches!(e.status, Status::Ready(_))
                        && e.leases == 0
                        && !e.planned
                        && !(for_guess && e.guessed)
                        && !self.pinned.contains(k)
                })
                .min_by_key(|(k, e)| (e.last_use, **k))
                .map(|(k, _)| *k);
            let Some(v) = victim else { return false };
            if let Some(e) = st.entries.remove(&v) {
                self.note_gone(v, &e);
            }
            add(&self.counters.evictions, 1);
        }
    }

    /// Issues queued reads, in queue order, while they fit; then, once every one is issued,
    /// the look-ahead guess's reads, in its order, while they fit beside it.
    fn pump(&self, st: &mut State) {
        if st.failure.is_some() {
            return;
        }
        while let Some(&key) = st.queue.front() {
            if !is_queued(st, key) {
                st.queue.pop_front();
                continue;
            }
            let bytes = self.index[&key].read_charge();
            if !self.make_room(st, key, bytes, false) || !self.issue(st, key, bytes) {
                return;
            }
            st.queue.pop_front();
        }
        // The guess's unclaimed reads alive, in buffer bytes.
        let mut held: u64 = st
            .guess
            .iter()
            .filter(|k| st.entries.get(k).is_some_and(|e| e.ahead))
            .map(|k| self.index[k].buf_bytes)
            .sum();
        while let Some(&key) = st.guess_queue.front() {
            if !is_queued(st, key) {
                st.guess_queue.pop_front();
                continue;
            }
            let info = &self.index[&key];
            let bytes = info.read_charge();
            if held + info.buf_bytes > self.lookahead_cap
                || !self.make_room(st, key, bytes, true)
                || !self.issue(st, key, bytes)
            {
                return;
            }
            held += info.buf_bytes;
            st.guess_queue.pop_front();
        }
    }

    /// Hands `key`'s read, charged `bytes` (room made), to a reader thread. False when the
    /// readers are gone (the run stops).
    fn issue(&self, st: &mut State, key: Key, bytes: u64) -> bool {
        let info = &self.index[&key];
        let Some(tx) = st.tx.clone() else {
            st.failure.get_or_insert(Failure::Closed);
            return false;
        };
        let Some(e) = st.entries.get_mut(&key) else {
            return true;
        };
        // Nobody asked for it and no plan wants it: a look-ahead read.
        let ahead = !e.claimed && !e.planned;
        let charge = self.budget.charge(bytes);
        if tx.send(Job { key, charge, ahead }).is_err() {
            st.failure.get_or_insert(Failure::Closed);
            return false;
        }
        e.status = Status::Loading;
        e.unclaimed_read = !e.claimed;
        e.ahead = ahead;
        if ahead {
            st.inflight_ahead += 1;
            add(&self.counters.lookahead_reads, 1);
            add(&self.counters.lookahead_bytes, info.read_bytes);
        }
        if self.pinned.contains(&key) {
            st.pins_held += info.buf_bytes;
        }
        if st.inflight == 0 {
            st.busy_since = Some(Instant::now());
        }
        st.inflight += 1;
        true
    }

    fn fetch(
        self: &Arc<Self>,
        layer: usize,
        ids: &[usize],
        why: Fetch,
    ) -> Result<Vec<Lease>, WeightError> {
        for &id in ids {
            if !self.index.contains_key(&(layer, id)) {
                return Err(WeightError::MissingExpert {
                    layer,
                    expert: id,
                    name: format!("layer {layer} expert {id}"),
                });
            }
        }
        let t0 = Instant::now();
        let mut st = self.lock();
        if let Some(f) = &st.failure {
            return Err(f.to_error(&self.reader.path).into());
        }
        let mut fresh = Vec::new();
        for &id in ids {
            let key = (layer, id);
            if why == Fetch::Use {
                *st.heat.entry(key).or_insert(0) += 1;
            }
            add(&self.counters.requests, 1);
            st.clock += 1;
            let clock = st.clock;
            let e = st.entries.entry(key).or_insert_with(|| Entry {
                transient: why == Fetch::Copy,
                ..Entry::queued(false)
            });
            // A new entry, or a guessed one still waiting for room, is read for this request.
            if matches!(e.status, Status::Queued) && !e.planned && !e.claimed {
                fresh.push(key);
            }
            if why != Fetch::Copy {
                e.transient = false;
            }
            // A planned entry's reservation passes to this request.
            e.planned = false;
            e.leases += 1;
            e.last_use = clock;
            let served = match e.status {
                Status::Ready(_) | Status::Loading => {
                    let unclaimed = std::mem::take(&mut e.unclaimed_read);
                    if std::mem::take(&mut e.ahead) {
                        &self.counters.lookahead_hits
                    } else if unclaimed {
                        &self.counters.misses
                    } else {
                        &self.counters.warm_hits
                    }
                }
                Status::Queued => {
                    e.claimed = true;
                    &self.counters.misses
                }
            };
            add(served, 1);
        }
        // Reads nobody planned go ahead of the plan (whose later groups can wait).
        for key in fresh.into_iter().rev() {
            st.queue.push_front(key);
        }
        let ready = |st: &State| {
            ids.iter().all(|&id| {
                matches!(
                    st.entries.get(&(layer, id)),
                    Some(Entry {
                        status: Status::Ready(_),
                        ..
                    })
                )
            })
        };
        loop {
            if let Some(f) = st.failure.clone() {
                for &id in ids {
                    self.release(&mut st, (layer, id));
                }
                return Err(f.to_error(&self.reader.path).into());
            }
            self.pump(&mut st);
            if ready(&st) {
                break;
            }
            let stuck = st.inflight == 0
                && st.handed_out == 0
                && ids.iter().any(|&id| {
                    matches!(
                        st.entries.get(&(layer, id)),
                        Some(Entry {
                            status: Status::Queued,
                            ..
                        })
                    )
                });
            if stuck {
                if !st.plan.is_empty() {
                    // The plan's reservations are all that is left to give back.
                    self.cancel_plan(&mut st);
                    continue;
                }
                let requested = ids
                    .iter()
                    .map(|&id| self.index[&(layer, id)].buf_bytes)
                    .sum();
                for &id in ids {
                    self.release(&mut st, (layer, id));
                }
                return Err(StreamError::BatchTooLarge {
                    layer,
                    requested,
                    capacity: self.budget.capacity,
                }
                .into());
            }
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        let mut out = Vec::with_capacity(ids.len());
        for &id in ids {
            let key = (layer, id);
            // Every entry is ready: checked under this same lock.
            if let Some(Entry {
                status: Status::Ready(x),
                ..
            }) = st.entries.get(&key)
            {
                let ext = Some(x.clone());
                st.handed_out += 1;
                out.push(Lease {
                    shared: self.clone(),
                    key,
                    ext,
                });
            }
        }
        drop(st);
        add_time(&self.counters.io_wait_ns, t0.elapsed());
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::Barrier;
    use std::time::Duration;

    use jnf_format::{Dtype, Header, LayoutPlan, MatrixSpec, CONTAINER_FILE};
    use sha2::{Digest, Sha256};
    use tarfa_manifest::hash::to_hex;
    use tarfa_manifest::{
        ExpertRecord, HeaderRecord, Manifest, MatrixRecord, CONTRACT_VERSION, MANIFEST_FILE,
    };

    /// Every matrix of a test expert is 8 x 64 BF16 (down 64 x 8): 3072 bytes an extent, so
    /// one read through the page cache fills one 4096-byte buffer, the budget's unit here.
    const ROWS: usize = 8;
    const COLS: usize = 64;
    const EXTENT: u64 = (3 * ROWS * COLS * 2) as u64;
    const PAGE: u64 = 4096;

    fn prefix(layer: usize, expert: usize) -> String {
        format!("model.layers.{layer}.mlp.experts.{expert}")
    }

    /// The elements of expert (layer, expert): gate, up, down back to back, different in
    /// every expert, so that a lease holding another expert's bytes is seen; small values with
    /// few exponents, as weights have, so that an encoded test bundle's extents pay.
    fn elems(layer: usize, expert: usize) -> Vec<u16> {
        (0..3 * ROWS * COLS)
            .map(|i| {
                let h = ((layer * 1000 + expert * 10) as u32) ^ (i as u32).wrapping_mul(2654435761);
                // exponents 120..=123, any sign and mantissa
                0x3C00 | ((h >> 3) as u16 & 0x0180) | (h as u16 & 0x807F)
            })
            .collect()
    }

    /// A bundle of `layers` x `experts` experts and no other tensor, laid out by jnf-format
    /// and described by a sealed manifest, as tarfa-convert writes one (that crate is not a
    /// dependency here: BundleSource::open checks everything a store relies on).
    struct TestBundle {
        dir: tempfile::TempDir,
        header: Header,
    }

    impl TestBundle {
        fn new(layers: usize, experts: usize) -> TestBundle {
            TestBundle::build(layers, experts, false)
        }

        /// `encoded`: format version 2, every extent stored with the exponent-plane codec.
        fn build(layers: usize, experts: usize, encoded: bool) -> TestBundle {
            let mut plan = LayoutPlan::new();
            for l in 0..layers {
                for e in 0..experts {
                    let p = prefix(l, e);
                    let m = |role: &str, rows: usize, cols: usize| MatrixSpec {
                        name: format!("{p}.{role}_proj.weight"),
                        dtype: Dtype::BF16,
                        shape: vec![rows as u64, cols as u64],
                        source: None,
                    };
                    let mats = [
                        m("gate", ROWS, COLS),
                        m("up", ROWS, COLS),
                        m("down", COLS, ROWS),
                    ];
                    plan.add_expert(l as u32, e as u32, p.clone(), mats);
                }
            }
            let extent_bytes = |layer: u32, expert: u32| -> Vec<u8> {
                elems(layer as usize, expert as usize)
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect()
            };
            let mut header = plan.finish().unwrap();
            if encoded {
                let mut plan = LayoutPlan::from_header(&header);
                for x in &header.experts {
                    let n = jnf_codec::encode(&extent_bytes(x.layer, x.expert))
                        .unwrap()
                        .len();
                    plan.set_extent_storage(
                        x.layer,
                        x.expert,
                        jnf_format::ExtentCodec::ExponentPlaneZstd,
                        n as u64,
                    );
                }
                header = plan.finish().unwrap();
            }
            let mut file = header.encode().unwrap();
            file.resize(header.file_size as usize, 0);
            let mut experts = Vec::new();
            for x in &header.experts {
                let bytes = extent_bytes(x.layer, x.expert);
                assert_eq!(bytes.len() as u64, x.length);
                let stored = if encoded {
                    jnf_codec::encode(&bytes).unwrap()
                } else {
                    bytes.clone()
                };
                file[x.offset as usize..][..stored.len()].copy_from_slice(&stored);
                experts.push(ExpertRecord {
                    relayout: None,
                    sources: Vec::new(),
                    codec: encoded.then(|| x.codec.as_str().to_string()),
                    stored_length: encoded.then_some(x.stored_length),
                    stored_blake3: encoded.then(|| blake3::hash(&stored).to_hex().to_string()),
                    name: x.prefix.clone(),
                    layer: x.layer,
                    expert: x.expert,
                    offset: x.offset,
                    length: x.length,
                    padded_length: x.padded_length,
                    sha256: to_hex(&Sha256::digest(&bytes)),
                    blake3: blake3::hash(&bytes).to_hex().to_string(),
                    nonfinite: 0,
                    matrices: x
                        .matrices
                        .iter()
                        .map(|m| MatrixRecord {
                            role: m.role,
                            name: m.name.clone(),
                            dtype: m.dtype.to_string(),
                            shape: m.shape.clone(),
                            offset: m.offset,
                            length: m.length,
                        })
                        .collect(),
                });
            }
            let mut manifest = Manifest {
                root_digest: String::new(),
                computed_root: String::new(),
                manifest_version: tarfa_manifest::manifest_version_for(header.major).unwrap(),
                format_version: format!("{}.{}", header.major, header.minor),
                contract_version: CONTRACT_VERSION,
                converter: "tarfa-stream store tests".into(),
                header: HeaderRecord::of_container_prefix(&file).unwrap(),
                source: Default::default(),
                shards: Vec::new(),
                files: Vec::new(),
                tensors: Vec::new(),
                experts,
            };
            manifest.seal();
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join(CONTAINER_FILE), &file).unwrap();
            std::fs::write(dir.path().join(MANIFEST_FILE), manifest.to_toml()).unwrap();
            TestBundle { dir, header }
        }

        fn jnf(&self) -> PathBuf {
            self.dir.path().join(CONTAINER_FILE)
        }

        /// Where the bytes of expert (layer, expert) start in model.jnf.
        fn offset(&self, layer: usize, expert: usize) -> u64 {
            self.header
                .expert(layer as u32, expert as u32)
                .unwrap()
                .offset
        }

        fn open(&self) -> Arc<BundleSource> {
            Arc::new(BundleSource::open(self.dir.path(), None).unwrap())
        }

        /// A store whose budget holds `slots` expert buffers (`None`: unbounded).
        fn store(
            &self,
            slots: Option<u64>,
            policy: CachePolicy,
            ledger: Option<&HeatLedger>,
        ) -> ExpertStore {
            let opts = StreamOptions {
                ram_budget: slots.map(|n| n * PAGE),
                io: IoMode::Cached,
                policy,
                io_threads: 4,
                ..Default::default()
            };
            ExpertStore::new(self.open(), &opts, ledger).unwrap()
        }
    }

    /// Experts of `layer` the store holds verified now, ascending.
    fn held(store: &ExpertStore, layer: usize) -> Vec<usize> {
        let st = store.shared.lock();
        let mut v: Vec<usize> = st
            .entries
            .iter()
            .filter(|(k, e)| k.0 == layer && matches!(e.status, Status::Ready(_)))
            .map(|(k, _)| k.1)
            .collect();
        v.sort_unstable();
        v
    }

    /// The lease holds expert (layer, expert)'s shapes and bytes.
    fn check_lease(lease: &Lease, layer: usize, expert: usize) {
        let [g, u, d] = lease.matrices();
        assert_eq!((g.rows, g.cols, u.rows, u.cols), (ROWS, COLS, ROWS, COLS));
        assert_eq!((d.rows, d.cols), (COLS, ROWS));
        let got: Vec<u16> = [g.data, u.data, d.data].concat();
        assert!(got == elems(layer, expert), "lease of {layer}/{expert}");
    }

    /// One use of one expert, as the forward makes it: fetched, checked, dropped; the budget
    /// holds while it is in use.
    fn use_one(store: &ExpertStore, layer: usize, expert: usize) {
        let leases = store.fetch(layer, &[expert]).unwrap();
        assert_eq!(leases.len(), 1);
        check_lease(&leases[0], layer, expert);
        if let Some(cap) = store.capacity() {
            assert!(store.used_bytes() <= cap, "{} > {cap}", store.used_bytes());
        }
    }

    /// The counters a sequence of requests decides (not the timings).
    fn counts(s: &StreamStats) -> [u64; 8] {
        [
            s.requests,
            s.warm_hits,
            s.misses,
            s.reads,
            s.wasted_reads,
            s.evictions,
            s.bytes_read,
            s.verified_bytes,
        ]
    }

    fn stream_error(e: &WeightError) -> &StreamError {
        e.source_error::<StreamError>()
            .unwrap_or_else(|| panic!("not a stream error: {e}"))
    }

    #[test]
    fn leases_hold_their_experts_bytes_in_the_order_asked() {
        let b = TestBundle::new(2, 3);
        let store = b.store(None, CachePolicy::Lru, None);
        assert_eq!(store.largest_buffer(), PAGE);
        assert_eq!(store.total_buffer_bytes(), 6 * PAGE);
        assert_eq!(store.expert_ids(1), vec![0, 1, 2]);
        let leases = store.fetch(1, &[2, 0]).unwrap();
        check_lease(&leases[0], 1, 2);
        check_lease(&leases[1], 1, 0);
        assert_eq!(store.used_bytes(), 2 * PAGE);
        drop(leases);
        // lru keeps both once they are no longer used
        assert_eq!(held(&store, 1), vec![0, 2]);
        assert_eq!(held(&store, 0), Vec::<usize>::new());
        let s = store.stats();
        // requests, hits, misses, reads, wasted, evictions, bytes read, bytes verified
        assert_eq!(counts(&s), [2, 0, 2, 2, 0, 0, 2 * EXTENT, 2 * EXTENT]);
        assert_eq!(s.peak_warm_bytes, 2 * PAGE);
        // the bundle's verify report lists what the store checked
        let report = store.shared.bundle.report();
        let names: Vec<&str> = report.experts.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, vec![prefix(1, 0), prefix(1, 2)]);
    }

    #[test]
    fn lru_evicts_the_least_recently_used_and_never_exceeds_the_budget() {
        let b = TestBundle::new(1, 4);
        let store = b.store(Some(2), CachePolicy::Lru, None);
        assert_eq!(store.pinned(), (0, 0));
        // (expert used, experts held afterwards)
        let steps: [(usize, &[usize]); 7] = [
            (0, &[0]),
            (1, &[0, 1]),
            (0, &[0, 1]), // hit: 1 is now the least recently used
            (2, &[0, 2]), // evicts 1
            (0, &[0, 2]), // hit
            (3, &[0, 3]), // evicts 2
            (1, &[1, 3]), // evicts 0 (used before 3)
        ];
        for (i, (id, after)) in steps.into_iter().enumerate() {
            use_one(&store, 0, id);
            assert_eq!(held(&store, 0), after, "step {i}");
            assert_eq!(store.used_bytes(), after.len() as u64 * PAGE, "step {i}");
        }
        let s = store.stats();
        assert_eq!(counts(&s), [7, 2, 5, 5, 0, 3, 5 * EXTENT, 5 * EXTENT]);
        assert_eq!(s.peak_warm_bytes, 2 * PAGE);
        assert_eq!(
            store.heat(),
            vec![((0, 0), 3), ((0, 1), 2), ((0, 2), 1), ((0, 3), 1)]
        );
        // uncounted fetches (--preload, owned copies) are not uses; record_uses (the hot tier's)
        // are
        drop(store.fetch_uncounted(0, &[2]).unwrap());
        store.record_uses(0, &[3, 3]);
        assert_eq!(
            store.heat(),
            vec![((0, 0), 3), ((0, 1), 2), ((0, 2), 1), ((0, 3), 3)]
        );
    }

    #[test]
    fn policy_none_keeps_nothing_but_shares_a_buffer_in_use() {
        let b = TestBundle::new(1, 2);
        let store = b.store(None, CachePolicy::None, None);
        use_one(&store, 0, 0);
        assert!(held(&store, 0).is_empty());
        assert_eq!(store.used_bytes(), 0);
        use_one(&store, 0, 0);
        // two leases on one expert: one read, one buffer
        let first = store.fetch(0, &[1]).unwrap();
        let second = store.fetch(0, &[1]).unwrap();
        check_lease(&second[0], 0, 1);
        assert_eq!(store.used_bytes(), PAGE);
        drop(first);
        assert_eq!(held(&store, 0), vec![1]);
        drop(second);
        assert!(held(&store, 0).is_empty());
        assert_eq!(store.used_bytes(), 0);
        let s = store.stats();
        assert_eq!(counts(&s), [4, 1, 3, 3, 0, 0, 3 * EXTENT, 3 * EXTENT]);
    }

    #[test]
    fn copies_for_a_keeping_caller_leave_the_warm_tier_whatever_the_policy() {
        // An unbounded lru store (a CUDA run with every expert on the GPU): what the upload
        // copies must not stay in host memory.
        let b = TestBundle::new(2, 3);
        let store = b.store(None, CachePolicy::Lru, None);
        // expert (1, 1) is in use by a step, so it is held before and after the copies
        use_one(&store, 1, 1);
        assert_eq!(held(&store, 1), vec![1]);
        let copies = store.fetch_copy(1, &[0, 1, 2]).unwrap();
        for (lease, id) in copies.iter().zip([0, 1, 2]) {
            check_lease(lease, 1, id);
        }
        assert_eq!(store.used_bytes(), 3 * PAGE);
        drop(copies);
        assert_eq!(held(&store, 1), vec![1], "only what a use brought in stays");
        assert_eq!(store.used_bytes(), PAGE);
        // a copy whose read a use joins becomes the use's, and stays
        let copy = store.fetch_copy(0, &[2]).unwrap();
        use_one(&store, 0, 2);
        drop(copy);
        assert_eq!(held(&store, 0), vec![2]);
        // a copy never counts as a use; reading a dropped copy again is a miss
        assert_eq!(store.heat(), vec![((0, 2), 1), ((1, 1), 1)]);
        use_one(&store, 1, 0);
        let s = store.stats();
        // requests, hits, misses, reads, wasted, evictions, bytes read, bytes verified
        assert_eq!(counts(&s), [7, 2, 5, 5, 0, 0, 5 * EXTENT, 5 * EXTENT]);
    }

    #[test]
    fn static_keeps_only_its_pinned_set() {
        let b = TestBundle::new(2, 4);
        // 4 slots: 3 pinned (three quarters), one left to stream through; no history, so an
        // even spread: expert 0 of each layer, then expert 1 of layer 0
        let store = b.store(Some(4), CachePolicy::Static, None);
        assert_eq!(store.pinned(), (3, 3 * PAGE));
        let steps: [((usize, usize), usize); 6] = [
            ((0, 3), 0), // not pinned: dropped after use
            ((0, 0), 1),
            ((1, 0), 2),
            ((0, 1), 3),
            ((0, 3), 3), // read again
            ((0, 0), 3), // hit
        ];
        for (i, ((l, id), cached)) in steps.into_iter().enumerate() {
            use_one(&store, l, id);
            let n = held(&store, 0).len() + held(&store, 1).len();
            assert_eq!(n, cached, "step {i}");
            assert_eq!(store.used_bytes(), cached as u64 * PAGE, "step {i}");
        }
        assert_eq!(held(&store, 0), vec![0, 1]);
        assert_eq!(held(&store, 1), vec![0]);
        let s = store.stats();
        assert_eq!(counts(&s), [6, 1, 5, 5, 0, 0, 5 * EXTENT, 5 * EXTENT]);
    }

    #[test]
    fn ledger_pins_the_hottest_keeps_room_for_them_and_never_evicts_them() {
        let b = TestBundle::new(1, 8);
        let mut ledger = HeatLedger::empty("r", 1, 8);
        ledger.record(&[((0, 6), 9), ((0, 2), 5), ((0, 4), 1)]);
        // 4 slots: half for the hottest two
        let store = b.store(Some(4), CachePolicy::Ledger, Some(&ledger));
        assert_eq!(store.pinned(), (2, 2 * PAGE));
        let steps: [(usize, &[usize]); 10] = [
            (0, &[0]),
            (1, &[0, 1]),
            // the budget has room for 4 but 2 slots stay free for the pinned set
            (3, &[1, 3]),
            (6, &[1, 3, 6]),
            (2, &[1, 2, 3, 6]),
            // from here LRU among the unpinned only: 6 is older than 4 and 5 but stays
            (4, &[2, 3, 4, 6]),
            (5, &[2, 4, 5, 6]),
            (0, &[0, 2, 5, 6]),
            (6, &[0, 2, 5, 6]),
            (2, &[0, 2, 5, 6]),
        ];
        for (i, (id, after)) in steps.into_iter().enumerate() {
            use_one(&store, 0, id);
            assert_eq!(held(&store, 0), after, "step {i}");
        }
        let s = store.stats();
        assert_eq!(counts(&s), [10, 2, 8, 8, 0, 4, 8 * EXTENT, 8 * EXTENT]);
        assert_eq!(s.peak_warm_bytes, 4 * PAGE);
    }

    #[test]
    fn a_corrupt_expert_is_refused_by_name_and_never_cached() {
        let b = TestBundle::new(1, 3);
        // One byte of expert 1 changed on disk; opening does not read experts, the store's
        // first read of it checks it.
        let mut bytes = std::fs::read(b.jnf()).unwrap();
        bytes[(b.offset(0, 1) + 100) as usize] ^= 0x01;
        std::fs::write(b.jnf(), bytes).unwrap();
        let store = b.store(Some(3), CachePolicy::Lru, None);
        use_one(&store, 0, 0);
        let err = store
            .fetch(0, &[1])
            .err()
            .expect("a corrupt expert is refused");
        match stream_error(&err) {
            StreamError::HashMismatch { path, name } => {
                assert_eq!(path, &b.jnf());
                assert_eq!(name, &prefix(0, 1));
            }
            other => panic!("not a hash mismatch: {other}"),
        }
        assert_eq!(err.exit_code(), tarfa_core::exit::VERIFICATION_FAILED);
        assert!(err.to_string().contains(&prefix(0, 1)), "{err}");
        // never cached, its buffer no longer charged; the run stops: every later request
        // fails the same way, even for an expert held
        assert_eq!(held(&store, 0), vec![0]);
        assert_eq!(store.used_bytes(), PAGE);
        for id in [0, 1, 2] {
            let again = store.fetch(0, &[id]).err().expect("the run stopped");
            assert!(
                matches!(stream_error(&again), StreamError::HashMismatch { name, .. } if name == &prefix(0, 1)),
                "{again}"
            );
        }
        let s = store.stats();
        assert_eq!(s.reads, 1);
        assert_eq!(s.verified_bytes, 2 * EXTENT);
        // the verify report never lists it
        let report = store.shared.bundle.report();
        let names: Vec<&str> = report.experts.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, vec![prefix(0, 0)]);
    }

    #[test]
    fn encoded_extents_are_checked_decoded_and_held_decoded_within_the_budget() {
        let b = TestBundle::build(1, 4, true);
        let stored: Vec<u64> = b.header.experts.iter().map(|e| e.stored_length).collect();
        assert!(stored.iter().all(|&n| n < EXTENT), "{stored:?}");
        // A read needs its decoded buffer and its stored bytes' buffer (a page each); a held
        // expert, one page. Two pages are the least budget, and it is named as such.
        let opts = |pages: u64| StreamOptions {
            ram_budget: Some(pages * PAGE),
            io: IoMode::Cached,
            policy: CachePolicy::Lru,
            io_threads: 4,
            ..Default::default()
        };
        match ExpertStore::new(b.open(), &opts(1), None) {
            Err(StreamError::BudgetTooSmall { minimum, .. }) => assert_eq!(minimum, 2 * PAGE),
            other => panic!("{:?}", other.err()),
        }
        let store = b.store(Some(2), CachePolicy::Lru, None);
        assert_eq!(store.largest_buffer(), 2 * PAGE);
        assert_eq!(store.total_buffer_bytes(), 4 * PAGE);
        for e in [0, 1, 2, 3, 3, 0] {
            use_one(&store, 0, e);
        }
        let s = store.stats();
        // one held expert's page plus a read's two do not fit two pages: every new read
        // evicts what is held; 3 twice is a hit
        assert_eq!((s.requests, s.warm_hits, s.reads), (6, 1, 5));
        let read: u64 = [0, 1, 2, 3, 0].iter().map(|&e| stored[e]).sum();
        assert_eq!(s.bytes_read, read);
        assert_eq!(s.decoded_bytes, 5 * EXTENT);
        assert_eq!(s.verified_bytes, read + 5 * EXTENT);
        assert!(s.peak_warm_bytes <= 2 * PAGE, "{}", s.peak_warm_bytes);
        // the stored part of a read's charge is given back once decoded
        assert_eq!(store.used_bytes(), PAGE);

        // Groups as the forward asks for them fit any budget from the least up, with room
        // kept for the last read's stored bytes.
        for pages in 2..=6 {
            let store = b.store(Some(pages), CachePolicy::Lru, None);
            let batches = store.batches(0, &[0, 1, 2, 3]);
            store.prefetch(0, &batches);
            for group in &batches {
                let leases = store.fetch(0, group).unwrap();
                for (l, &e) in leases.iter().zip(group) {
                    check_lease(l, 0, e);
                }
                assert!(store.used_bytes() <= pages * PAGE);
            }
        }
        // the bundle source's own reads decode too
        let src = b.open();
        assert_eq!(src.verify_all().unwrap(), 4 * EXTENT);
        let w = crate::weights::WeightSource::experts(&*src, 0, &[2]).unwrap();
        let got: Vec<u16> = [&w[0].gate.data[..], &w[0].up.data[..], &w[0].down.data[..]].concat();
        assert!(got == elems(0, 2));
    }

    #[test]
    fn a_corrupt_stored_byte_is_refused_by_name_before_decoding() {
        let b = TestBundle::build(1, 3, true);
        let e1 = b.header.expert(0, 1).unwrap().clone();
        let mut bytes = std::fs::read(b.jnf()).unwrap();
        // the last stored byte: sign and mantissa, which would decode to other bytes
        bytes[(e1.offset + e1.stored_length - 1) as usize] ^= 0x01;
        std::fs::write(b.jnf(), bytes).unwrap();
        let store = b.store(Some(4), CachePolicy::Lru, None);
        use_one(&store, 0, 0);
        let err = store.fetch(0, &[1]).err().expect("refused");
        match stream_error(&err) {
            StreamError::StoredHashMismatch { name, .. } => assert_eq!(name, &prefix(0, 1)),
            other => panic!("not a stored-hash mismatch: {other}"),
        }
        assert_eq!(err.exit_code(), tarfa_core::exit::VERIFICATION_FAILED);
        // nothing of it was decoded; its charge is given back
        assert_eq!(store.stats().decoded_bytes, EXTENT);
        assert_eq!(store.used_bytes(), PAGE);
        // the bundle source names it the same way
        let src = b.open();
        let err = crate::weights::WeightSource::experts(&*src, 0, &[1]).expect_err("refused");
        assert!(
            err.to_string().contains("stored_blake3") && err.to_string().contains(&prefix(0, 1)),
            "{err}"
        );
        assert_eq!(err.exit_code(), tarfa_core::exit::VERIFICATION_FAILED);
    }

    #[test]
    fn a_bundle_cut_short_after_open_is_refused_as_truncated() {
        let b = TestBundle::new(1, 3);
        let store = b.store(None, CachePolicy::Lru, None);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(b.jnf())
            .unwrap();
        f.set_len(b.offset(0, 2) + 1000).unwrap();
        use_one(&store, 0, 1);
        let err = store.fetch(0, &[2]).err().expect("a cut extent is refused");
        match stream_error(&err) {
            StreamError::Truncated {
                name,
                expected,
                got,
                ..
            } => {
                assert_eq!(name, &prefix(0, 2));
                assert_eq!((*expected, *got), (EXTENT, 1000));
            }
            other => panic!("not a truncation: {other}"),
        }
        assert_eq!(err.exit_code(), tarfa_core::exit::VERIFICATION_FAILED);
        assert_eq!(held(&store, 0), vec![1]);
    }

    #[test]
    fn concurrent_requests_for_one_expert_read_it_once() {
        let b = TestBundle::new(1, 2);
        // nothing kept: only the one buffer alive while the leases are out is shared
        let store = b.store(None, CachePolicy::None, None);
        let n = 8;
        let (start, done) = (Barrier::new(n), Barrier::new(n));
        std::thread::scope(|s| {
            for _ in 0..n {
                s.spawn(|| {
                    start.wait();
                    let leases = store.fetch(0, &[1]).unwrap();
                    check_lease(&leases[0], 0, 1);
                    // every lease is alive at once before any is dropped
                    done.wait();
                });
            }
        });
        let s = store.stats();
        // the first request's read is its miss; the others find it loading or ready
        assert_eq!(counts(&s), [8, 7, 1, 1, 0, 0, EXTENT, EXTENT]);
        assert_eq!(s.peak_warm_bytes, PAGE);
        assert_eq!(store.used_bytes(), 0);
    }

    #[test]
    fn a_budget_below_one_expert_is_refused_at_open() {
        let b = TestBundle::new(1, 2);
        let opts = StreamOptions {
            ram_budget: Some(PAGE - 1),
            ..Default::default()
        };
        let err = ExpertStore::new(b.open(), &opts, None)
            .err()
            .expect("too small a budget is refused");
        assert!(
            matches!(err, StreamError::BudgetTooSmall { flag: "--ram-budget", budget, minimum } if budget == PAGE - 1 && minimum == PAGE),
            "{err}"
        );
        assert_eq!(err.exit_code(), tarfa_core::exit::BAD_INPUT);
        assert!(
            err.to_string().contains("the minimum is 4096 bytes"),
            "{err}"
        );
        // the minimum the store refuses below is the one it reports beforehand
        assert_eq!(
            ExpertStore::min_ram_budget(&b.open(), IoMode::Cached).unwrap(),
            PAGE
        );
        // exactly one expert is enough: every use evicts the one before
        let store = b.store(Some(1), CachePolicy::Lru, None);
        for id in [0, 1, 0, 1] {
            use_one(&store, 0, id);
            assert_eq!(held(&store, 0), vec![id]);
        }
        assert_eq!(store.stats().evictions, 3);
    }

    #[test]
    fn a_batch_larger_than_the_budget_is_refused_and_gives_everything_back() {
        let b = TestBundle::new(1, 3);
        let store = b.store(Some(2), CachePolicy::Lru, None);
        let err = store
            .fetch(0, &[0, 1, 2])
            .err()
            .expect("3 experts do not fit in 2");
        assert!(
            matches!(stream_error(&err), StreamError::BatchTooLarge { layer: 0, requested, capacity } if *requested == 3 * PAGE && *capacity == 2 * PAGE),
            "{err}"
        );
        assert_eq!(err.exit_code(), tarfa_core::exit::ENVIRONMENT);
        assert!(store.shared.lock().entries.values().all(|e| e.leases == 0));
        // what fitted was read for it; the third was never read; the store goes on
        assert_eq!(store.stats().reads, 2);
        assert!(store.used_bytes() <= 2 * PAGE);
        let leases = store.fetch(0, &[2, 0]).unwrap();
        check_lease(&leases[0], 0, 2);
        check_lease(&leases[1], 0, 0);
        assert_eq!(store.used_bytes(), 2 * PAGE);
        drop(leases);
        assert_eq!(store.stats().reads, 3);
    }

    #[test]
    fn a_prefetched_read_is_the_miss_of_its_use_and_a_dropped_one_is_wasted() {
        let b = TestBundle::new(1, 3);
        let store = b.store(None, CachePolicy::Lru, None);
        store.prefetch(0, &[vec![0, 1]]);
        let leases = store.fetch(0, &[0, 1]).unwrap();
        check_lease(&leases[1], 0, 1);
        drop(leases);
        use_one(&store, 0, 1);
        assert_eq!(
            counts(&store.stats()),
            [3, 1, 2, 2, 0, 0, 2 * EXTENT, 2 * EXTENT]
        );

        // Nothing kept and one reader thread: a plan replaced before its reads are used drops
        // them (in order: both are done before the read asked for next).
        let opts = StreamOptions {
            ram_budget: None,
            io: IoMode::Cached,
            policy: CachePolicy::None,
            io_threads: 1,
            ..Default::default()
        };
        let store = ExpertStore::new(b.open(), &opts, None).unwrap();
        store.prefetch(0, &[vec![0], vec![1]]);
        store.prefetch(0, &[vec![2]]);
        use_one(&store, 0, 2);
        assert_eq!(
            counts(&store.stats()),
            [1, 0, 1, 3, 2, 0, 3 * EXTENT, 3 * EXTENT]
        );
        assert_eq!(store.used_bytes(), 0);
    }

    #[test]
    fn batches_put_held_experts_first_and_fit_half_the_room() {
        let b = TestBundle::new(1, 8);
        let store = b.store(Some(4), CachePolicy::Lru, None);
        use_one(&store, 0, 6);
        use_one(&store, 0, 5);
        // all fit: the held ones (ascending), then the ones to read
        assert_eq!(store.batches(0, &[1, 5]), vec![vec![5], vec![1]]);
        assert_eq!(store.batches(0, &[1, 2]), vec![vec![1, 2]]);
        // 5 experts in 4 slots: groups of half the room, held ones first
        let batches = store.batches(0, &[1, 2, 5, 6, 7]);
        assert_eq!(batches, vec![vec![5, 6], vec![1, 2], vec![7]]);
        store.prefetch(0, &batches);
        for batch in &batches {
            let leases = store.fetch(0, batch).unwrap();
            assert_eq!(leases.len(), batch.len());
            assert!(store.used_bytes() <= 4 * PAGE);
        }
        assert!(store.stats().peak_warm_bytes <= 4 * PAGE);

        // static: the 3 pinned experts (0, 1, 2) cost nothing more, their room is reserved;
        // one slot is left for the others
        let store = b.store(Some(4), CachePolicy::Static, None);
        assert_eq!(store.pinned(), (3, 3 * PAGE));
        let batches = store.batches(0, &[0, 1, 2, 3, 4]);
        assert_eq!(batches, vec![vec![0, 1, 2, 3], vec![4]]);
        store.prefetch(0, &batches);
        for batch in &batches {
            let leases = store.fetch(0, batch).unwrap();
            for (l, &id) in leases.iter().zip(batch) {
                check_lease(l, 0, id);
            }
        }
        assert_eq!(held(&store, 0), vec![0, 1, 2]);
        assert!(store.stats().peak_warm_bytes <= 4 * PAGE);
    }

    /// Records what the store page-locks and unlocks.
    #[derive(Default)]
    struct RecordingPin {
        lock: bool,
        pinned: Mutex<Vec<(usize, usize)>>,
        unpinned: Mutex<Vec<usize>>,
    }

    impl HostPin for RecordingPin {
        fn pin(&self, ptr: *mut u8, len: usize) -> bool {
            self.pinned.lock().unwrap().push((ptr as usize, len));
            self.lock
        }
        fn unpin(&self, ptr: *mut u8) {
            self.unpinned.lock().unwrap().push(ptr as usize);
        }
    }

    #[test]
    fn host_pin_locks_each_verified_buffer_and_unlocks_it_before_unmapping() {
        let b = TestBundle::new(1, 2);
        for lock in [true, false] {
            let store = b.store(None, CachePolicy::None, None);
            let pin = Arc::new(RecordingPin {
                lock,
                ..Default::default()
            });
            store.set_host_pin(pin.clone());
            let leases = store.fetch(0, &[0]).unwrap();
            let ptr = leases[0].matrices()[0].data.as_ptr() as usize;
            assert_eq!(*pin.pinned.lock().unwrap(), vec![(ptr, PAGE as usize)]);
            assert_eq!(ptr % ALIGN, 0);
            drop(leases);
            // the unlock is the reaper thread's, moments later
            let until = Instant::now() + Duration::from_secs(5);
            let want = if lock { vec![ptr] } else { Vec::new() };
            while *pin.unpinned.lock().unwrap() != want && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(*pin.unpinned.lock().unwrap(), want, "pin succeeded: {lock}");
        }
    }

    /// A forward's pattern on every policy: per layer some experts, grouped by `batches`,
    /// announced by `prefetch`, fetched group by group. The budget holds at every step, every
    /// request is a hit or a miss, and every read is some request's miss.
    #[test]
    fn a_forward_like_workload_stays_in_budget_under_every_policy() {
        let b = TestBundle::new(2, 8);
        let mut ledger = HeatLedger::empty("r", 2, 8);
        ledger.record(&[((0, 3), 4), ((1, 5), 2)]);
        for policy in [
            CachePolicy::Lru,
            CachePolicy::Ledger,
            CachePolicy::Static,
            CachePolicy::None,
        ] {
            let store = b.store(Some(3), policy, Some(&ledger));
            let cap = 3 * PAGE;
            let mut rng = 0x2545_f491_u64;
            let mut requests = 0;
            for _step in 0..20 {
                for layer in 0..2 {
                    let mut ids: Vec<usize> = (0..4)
                        .map(|_| {
                            rng = rng
                                .wrapping_mul(6364136223846793005)
                                .wrapping_add(1442695040888963407);
                            (rng >> 33) as usize % 8
                        })
                        .collect();
                    ids.sort_unstable();
                    ids.dedup();
                    requests += ids.len() as u64;
                    let batches = store.batches(layer, &ids);
                    let mut flat: Vec<usize> = batches.concat();
                    flat.sort_unstable();
                    assert_eq!(flat, ids, "{policy:?}: batches cover the ids once");
                    store.prefetch(layer, &batches);
                    for batch in &batches {
                        let leases = store.fetch(layer, batch).unwrap();
                        for (l, &id) in leases.iter().zip(batch) {
                            check_lease(l, layer, id);
                        }
                        assert!(store.used_bytes() <= cap, "{policy:?}");
                    }
                }
            }
            let s = store.stats();
            assert_eq!(s.requests, requests, "{policy:?}");
            assert_eq!(s.warm_hits + s.misses, requests, "{policy:?}");
            assert_eq!(s.reads, s.misses, "{policy:?}");
            assert_eq!(s.wasted_reads, 0, "{policy:?}");
            assert_eq!(s.bytes_read, s.reads * EXTENT, "{policy:?}");
            assert!(
                s.peak_warm_bytes <= cap,
                "{policy:?}: peak {}",
                s.peak_warm_bytes
            );
            if policy == CachePolicy::None {
                assert_eq!(s.warm_hits, 0);
            }
        }
    }

    /// Waits until no read is in flight (reads finish on the reader threads).
    fn settle(store: &ExpertStore) {
        let until = Instant::now() + Duration::from_secs(10);
        while store.shared.lock().inflight > 0 {
            assert!(Instant::now() < until, "reads still in flight after 10 s");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The look-ahead counters: (guessed, right, needed, reads, hits, wasted).
    fn ahead(s: &StreamStats) -> [u64; 6] {
        [
            s.lookahead_guessed,
            s.lookahead_right,
            s.lookahead_needed,
            s.lookahead_reads,
            s.lookahead_hits,
            s.lookahead_wasted,
        ]
    }

    /// Every request is a warm hit, a look-ahead hit or a miss; every read is a miss, a
    /// look-ahead hit, wasted, or held unused; look-ahead's reads are among the reads.
    fn check_counts_add_up(store: &ExpertStore) {
        let s = store.stats();
        assert_eq!(
            s.requests,
            s.warm_hits + s.lookahead_hits + s.misses,
            "{s:?}"
        );
        assert_eq!(
            s.reads,
            s.misses + s.lookahead_hits + s.wasted_reads + store.unclaimed_reads(),
            "{s:?}"
        );
        assert!(s.lookahead_reads <= s.reads && s.lookahead_wasted <= s.wasted_reads);
        assert!(
            s.lookahead_hits + s.lookahead_wasted <= s.lookahead_reads,
            "{s:?}"
        );
        assert_eq!(s.bytes_read, s.reads * EXTENT, "{s:?}");
        assert_eq!(s.lookahead_wasted_bytes, s.lookahead_wasted * EXTENT);
        assert!(s.lookahead_right <= s.lookahead_guessed.min(s.lookahead_needed));
    }

    #[test]
    fn a_guess_is_read_ahead_and_its_first_use_is_a_lookahead_hit() {
        let b = TestBundle::new(2, 6);
        let store = b.store(None, CachePolicy::Lru, None);
        // layer 0 computes while layer 1's guess (3, then 2; 9 is no expert) is read
        store.prefetch(0, &[vec![0]]);
        drop(store.fetch(0, &[0]).unwrap());
        store.lookahead(1, &[3, 9, 2, 3]);
        settle(&store);
        assert_eq!(held(&store, 1), vec![2, 3]);
        // layer 1's routes: 3 and 4; the guess is scored and ends
        store.prefetch(1, &[vec![3, 4]]);
        let leases = store.fetch(1, &[3, 4]).unwrap();
        check_lease(&leases[0], 1, 3);
        check_lease(&leases[1], 1, 4);
        drop(leases);
        let s = store.stats();
        // requests, hits, misses, reads, wasted, evictions, bytes read, bytes verified
        assert_eq!(counts(&s), [3, 0, 2, 4, 0, 0, 4 * EXTENT, 4 * EXTENT]);
        // guessed 2 (3 and 2), right 1 (3), needed 2; 2 reads ahead, 1 used
        assert_eq!(ahead(&s), [2, 1, 2, 2, 1, 0]);
        assert_eq!(s.lookahead_bytes, 2 * EXTENT);
        // lru keeps the unused guess (2), unclaimed; its first use is still look-ahead's hit
        assert_eq!(store.unclaimed_reads(), 1);
        check_counts_add_up(&store);
        use_one(&store, 1, 2);
        assert_eq!(store.stats().lookahead_hits, 2);
        assert_eq!(store.unclaimed_reads(), 0);
        check_counts_add_up(&store);
        // a guess for a layer whose routes never come is not scored
        store.lookahead(0, &[5]);
        store.prefetch(1, &[vec![1]]);
        assert_eq!(store.stats().lookahead_guessed, 2);
    }

    #[test]
    fn a_wrong_guess_is_dropped_unused_and_counted_wasted() {
        let b = TestBundle::new(2, 4);
        // nothing kept: what the guess read goes once the routes show it unneeded
        let store = b.store(None, CachePolicy::None, None);
        store.lookahead(1, &[0, 1]);
        settle(&store);
        assert_eq!(held(&store, 1), vec![0, 1], "a guess keeps its reads");
        store.prefetch(1, &[vec![2]]);
        settle(&store);
        // the guess's reads went; the plan's read is held for its request
        assert_eq!(held(&store, 1), vec![2]);
        use_one(&store, 1, 2);
        let s = store.stats();
        assert_eq!(ahead(&s), [2, 0, 1, 2, 0, 2]);
        assert_eq!(s.wasted_reads, 2);
        assert_eq!(store.used_bytes(), 0);
        check_counts_add_up(&store);
    }

    #[test]
    fn a_guess_waits_behind_the_plan_and_never_evicts_what_the_step_holds() {
        let b = TestBundle::new(2, 8);
        let store = b.store(Some(2), CachePolicy::Lru, None);
        // the plan of layer 0: three groups of one in a budget of two
        store.prefetch(0, &[vec![0], vec![1], vec![2]]);
        store.lookahead(1, &[5]);
        settle(&store);
        // 0 and 1 read, 2 waits for room; the guess waits behind it
        assert_eq!(store.stats().lookahead_reads, 0);
        drop(store.fetch(0, &[0]).unwrap());
        settle(&store);
        // 2 is read into 0's room; 1 (planned) and 2 fill the budget: the guess still waits
        assert_eq!(held(&store, 0), vec![1, 2]);
        assert_eq!(store.stats().lookahead_reads, 0);
        let one = store.fetch(0, &[1]).unwrap();
        settle(&store);
        // 1 is leased and 2 planned: nothing the step holds may go for the guess
        assert_eq!(held(&store, 0), vec![1, 2]);
        assert_eq!(store.stats().lookahead_reads, 0);
        drop(one);
        settle(&store);
        // 1 is done with: the guess takes its room (2 is still planned)
        assert_eq!(held(&store, 0), vec![2]);
        assert_eq!(held(&store, 1), vec![5]);
        assert_eq!(store.stats().lookahead_reads, 1);
        check_lease(&store.fetch(0, &[2]).unwrap()[0], 0, 2);
        store.prefetch(1, &[vec![5]]);
        use_one(&store, 1, 5);
        let s = store.stats();
        assert_eq!(ahead(&s), [1, 1, 1, 1, 1, 0]);
        assert!(s.peak_warm_bytes <= 2 * PAGE);
        check_counts_add_up(&store);
    }

    #[test]
    fn a_guess_reads_into_at_most_half_the_room_and_the_rest_joins_the_plan() {
        let b = TestBundle::new(2, 8);
        let store = b.store(Some(6), CachePolicy::Lru, None);
        // half the room is three buffers: 4, 5 and 6 are read, 7 waits
        store.lookahead(1, &[4, 5, 6, 7]);
        settle(&store);
        assert_eq!(held(&store, 1), vec![4, 5, 6]);
        assert_eq!(store.stats().lookahead_reads, 3);
        // the routes want 4 and 7: 7's read is the plan's now, 5 and 6 stay unused (lru)
        store.prefetch(1, &[vec![4, 7]]);
        let leases = store.fetch(1, &[4, 7]).unwrap();
        check_lease(&leases[1], 1, 7);
        drop(leases);
        let s = store.stats();
        assert_eq!(ahead(&s), [4, 2, 2, 3, 1, 0]);
        assert_eq!((s.misses, s.reads), (1, 4));
        assert_eq!(store.unclaimed_reads(), 2);
        check_counts_add_up(&store);
    }

    #[test]
    fn a_guess_evicts_the_least_recently_used_it_does_not_guess() {
        let b = TestBundle::new(2, 8);
        let store = b.store(Some(3), CachePolicy::Lru, None);
        for id in [0, 1, 2] {
            use_one(&store, 1, id);
        }
        // 0 is the least recently used but guessed: the read of 5 evicts 1 instead
        store.lookahead(1, &[0, 5]);
        settle(&store);
        assert_eq!(held(&store, 1), vec![0, 2, 5]);
        assert_eq!(store.stats().evictions, 1);
        store.prefetch(1, &[vec![0, 5]]);
        drop(store.fetch(1, &[0, 5]).unwrap());
        let s = store.stats();
        // 0 a warm hit, 5 look-ahead's
        assert_eq!((s.warm_hits, s.lookahead_hits, s.misses), (1, 1, 3));
        assert_eq!(ahead(&s), [2, 2, 2, 1, 1, 0]);
        check_counts_add_up(&store);
    }

    /// A forward's pattern with a guess for the next layer made while each layer computes:
    /// right, wrong and mixed guesses, every policy, budgets down to one expert. The bytes
    /// handed out are always the asked-for experts', the budget holds, nothing hangs, and the
    /// counters add up.
    #[test]
    fn guesses_right_or_wrong_never_change_what_is_handed_out_at_any_budget() {
        let b = TestBundle::new(3, 8);
        let mut ledger = HeatLedger::empty("r", 3, 8);
        ledger.record(&[((1, 3), 4), ((2, 5), 2)]);
        let (done_tx, done_rx) = channel();
        let worker = std::thread::spawn(move || {
            for slots in [1u64, 2, 3, 5] {
                for policy in [
                    CachePolicy::Lru,
                    CachePolicy::Ledger,
                    CachePolicy::Static,
                    CachePolicy::None,
                ] {
                    // 0: always right, 1: always wrong, 2: half right
                    for kind in 0..3 {
                        let store = b.store(Some(slots), policy, Some(&ledger));
                        let cap = slots * PAGE;
                        let mut rng = 0x9e37_79b9_u64 ^ slots ^ (kind << 8);
                        let mut next = || {
                            rng = rng
                                .wrapping_mul(6364136223846793005)
                                .wrapping_add(1442695040888963407);
                            (rng >> 33) as usize % 8
                        };
                        for _step in 0..12 {
                            let routes: Vec<Vec<usize>> = (0..3)
                                .map(|_| {
                                    let mut ids: Vec<usize> = (0..3).map(|_| next()).collect();
                                    ids.sort_unstable();
                                    ids.dedup();
                                    ids
                                })
                                .collect();
                            for layer in 0..3 {
                                let ids = &routes[layer];
                                let batches = store.batches(layer, ids);
                                store.prefetch(layer, &batches);
                                if layer + 1 < 3 {
                                    let truth = &routes[layer + 1];
                                    let wrong: Vec<usize> =
                                        (0..8).filter(|e| !truth.contains(e)).collect();
                                    let guess = match kind {
                                        0 => truth.clone(),
                                        1 => wrong,
                                        _ => vec![truth[0], wrong[0]],
                                    };
                                    store.lookahead(layer + 1, &guess);
                                }
                                for batch in &batches {
                                    let leases = store.fetch(layer, batch).unwrap();
                                    for (l, &id) in leases.iter().zip(batch) {
                                        check_lease(l, layer, id);
                                    }
                                    assert!(store.used_bytes() <= cap, "{policy:?} {slots}");
                                }
                            }
                        }
                        settle(&store);
                        let s = store.stats();
                        let what = format!("{policy:?} slots {slots} kind {kind}: {s:?}");
                        assert!(s.peak_warm_bytes <= cap, "{what}");
                        check_counts_add_up(&store);
                        match kind {
                            0 => assert_eq!(s.lookahead_right, s.lookahead_needed, "{what}"),
                            1 => assert_eq!(s.lookahead_right, 0, "{what}"),
                            _ => assert!(s.lookahead_right > 0, "{what}"),
                        }
                        assert!(s.lookahead_guessed > 0, "{what}");
                    }
                }
            }
            let _ = done_tx.send(());
        });
        // a hang is a failure, not a stuck test run
        match done_rx.recv_timeout(Duration::from_secs(120)) {
            Ok(()) => worker.join().unwrap(),
            Err(_) => match worker.is_finished() {
                // the worker panicked: its message
                true => worker.join().unwrap(),
                false => panic!("the look-ahead workload did not finish in 120 s (deadlock?)"),
            },
        }
    }

    #[test]
    fn a_corrupt_expert_read_ahead_stops_the_run_by_name() {
        let b = TestBundle::new(2, 3);
        let mut bytes = std::fs::read(b.jnf()).unwrap();
        bytes[(b.offset(1, 2) + 7) as usize] ^= 0x40;
        std::fs::write(b.jnf(), bytes).unwrap();
        let store = b.store(Some(3), CachePolicy::Lru, None);
        // verified as every read is: a guess that reads a corrupt expert ends the run, though
        // no request asked for it; nothing is computed from it
        store.lookahead(1, &[2]);
        settle(&store);
        let err = store.fetch(1, &[0]).err().expect("the run stopped");
        assert!(
            matches!(stream_error(&err), StreamError::HashMismatch { name, .. } if name == &prefix(1, 2)),
            "{err}"
        );
        assert_eq!(err.exit_code(), tarfa_core::exit::VERIFICATION_FAILED);
        assert_eq!(store.used_bytes(), 0);
    }

    #[test]
    fn hottest_ranks_the_ledger_and_this_runs_uses() {
        let b = TestBundle::new(2, 6);
        let mut ledger = HeatLedger::empty("r", 2, 6);
        ledger.record(&[((1, 4), 3), ((1, 1), 2), ((0, 5), 9)]);
        let store = b.store(Some(4), CachePolicy::Lru, Some(&ledger));
        assert_eq!(store.hottest(1, 3), vec![4, 1]);
        // this run's uses add to the file's counts; ties go to the lower id
        for _ in 0..2 {
            use_one(&store, 1, 3);
        }
        use_one(&store, 1, 0);
        assert_eq!(store.hottest(1, 3), vec![4, 1, 3]);
        assert_eq!(store.hottest(1, 9), vec![4, 1, 3, 0]);
        assert_eq!(store.hottest(1, 0), Vec::<usize>::new());
        assert_eq!(store.hottest(0, 2), vec![5]);
        assert_eq!(store.hottest(7, 2), Vec::<usize>::new());
    }

    fn index(layers: usize, experts: usize, size: u64) -> BTreeMap<Key, Arc<ExtentInfo>> {
        let mut m = BTreeMap::new();
        for l in 0..layers {
            for e in 0..experts {
                let mat = MatLayout {
                    rows: 1,
                    cols: 1,
                    offset: 0,
                    elems: 1,
                };
                m.insert(
                    (l, e),
                    Arc::new(ExtentInfo {
                        name: format!("l{l}e{e}"),
                        offset: 0,
                        length: size,
                        read_bytes: size,
                        buf_bytes: size,
                        scratch_bytes: 0,
                        encoded: None,
                        blake3: blake3::Hash::from([0u8; 32]),
                        blake3_hex: String::new(),
                        mats: [mat; 3],
                        mxfp4: None,
                    }),
                );
            }
        }
        m
    }

    #[test]
    fn pins_take_their_share_and_always_leave_room_to_stream() {
        let idx = index(2, 8, 100); // 16 experts, 1600 bytes
        let mut ledger = HeatLedger::empty("r", 2, 8);
        ledger.record(&[((1, 3), 9), ((0, 5), 7), ((0, 1), 7), ((1, 0), 1)]);
        let pins = |p, cap| {
            let mut v: Vec<Key> = choose_pins(p, cap, &idx, Some(&ledger))
                .into_iter()
                .collect();
            v.sort_unstable();
            v
        };
        // ledger: the hottest in half the budget (500 of 1000: 5 slots, 4 experts have history)
        assert_eq!(
            pins(CachePolicy::Ledger, Some(1000)),
            vec![(0, 1), (0, 5), (1, 0), (1, 3)]
        );
        // 2 slots: (1, 3), then (0, 1) before (0, 5) (equal counts: lower layer, lower id)
        assert_eq!(pins(CachePolicy::Ledger, Some(400)), vec![(0, 1), (1, 3)]);
        // static: 3/4 of the budget, the ledger's hottest first, then an even spread
        // 6 slots: the 4 with history, then expert 0 of layer 0, (1, 0) is taken, expert 1 of
        // layer 0 is taken, expert 1 of layer 1
        assert_eq!(
            pins(CachePolicy::Static, Some(800)),
            vec![(0, 0), (0, 1), (0, 5), (1, 0), (1, 1), (1, 3)]
        );
        // a budget of one or two experts pins nothing: streaming needs the room
        assert!(pins(CachePolicy::Static, Some(100)).is_empty());
        assert!(pins(CachePolicy::Ledger, Some(199)).is_empty());
        // lru and none never pin; when everything fits static keeps everything
        assert!(pins(CachePolicy::Lru, Some(1000)).is_empty());
        assert!(pins(CachePolicy::None, None).is_empty());
        assert_eq!(pins(CachePolicy::Static, None).len(), 16);
        assert_eq!(pins(CachePolicy::Static, Some(1600)).len(), 16);
        // never more than the budget less one expert
        for cap in (100..=1500).step_by(50) {
            for p in [CachePolicy::Ledger, CachePolicy::Static] {
                let n = pins(p, Some(cap)).len() as u64;
                assert!(n * 100 + 100 <= cap, "{p:?} {cap}: {n} pinned");
            }
        }
    }
}
