//! `tarfa-run io-bench <BUNDLE>`: the disk's read bandwidth for whole expert extents, the reads
//! expert streaming makes, at several queue depths. The streaming benchmark divides the bytes a
//! token must read by this to get its I/O roofline.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use jnf_format::{JnfFile, CONTAINER_FILE};
use serde_json::json;

use super::output::OutputRules;
use super::CliError;

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum IoBenchMode {
    /// O_DIRECT: every read goes to the device.
    Direct,
    /// Through the page cache (drop it first for a cold measurement).
    Cached,
}

#[derive(Args, Debug, Clone)]
pub struct IoBenchArgs {
    /// The bundle whose expert extents are read.
    pub bundle: PathBuf,
    /// Queue depths: that many reads in flight (one thread each), 1 to 256.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16", value_parser = queue_depth_arg)]
    pub queue_depths: Vec<usize>,
    /// Seconds per queue depth.
    #[arg(long, default_value_t = 4.0)]
    pub seconds: f64,
    #[arg(long, value_enum, default_value_t = IoBenchMode::Direct)]
    pub io: IoBenchMode,
    /// Write the figures as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// The deepest queue measured: one reader thread per read in flight.
const MAX_QUEUE_DEPTH: usize = 256;

fn queue_depth_arg(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=MAX_QUEUE_DEPTH).contains(&n) => Ok(n),
        _ => Err(format!(
            "expected a queue depth from 1 to {MAX_QUEUE_DEPTH}"
        )),
    }
}

/// A page-aligned buffer for O_DIRECT.
struct Aligned {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Aligned {
    fn new(len: usize) -> std::io::Result<Aligned> {
        let oom = || {
            std::io::Error::new(
                std::io::ErrorKind::OutOfMemory,
                format!("cannot allocate a read buffer of {len} bytes"),
            )
        };
        let layout = std::alloc::Layout::from_size_align(len.max(4096), 4096).map_err(|_| oom())?;
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(oom());
        }
        Ok(Aligned { ptr, layout })
    }
    fn slice(&mut self, len: usize) -> &mut [u8] {
        // SAFETY: ptr is valid for layout.size() >= len bytes, owned exclusively.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, len) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

pub fn run(a: &IoBenchArgs) -> Result<(), CliError> {
    let rules = OutputRules::new(&[&a.bundle]);
    if let Some(p) = &a.json {
        rules.check(p, "--json")?;
    }
    let path = a.bundle.join(CONTAINER_FILE);
    let jnf =
        JnfFile::open(&path).map_err(|e| CliError::Usage(format!("{}: {e}", path.display())))?;
    let extents: Vec<(u64, u64)> = jnf
        .header()
        .experts
        .iter()
        .map(|e| (e.offset, e.padded_length))
        .collect();
    if extents.is_empty() {
        return Err(CliError::Usage(format!(
            "{}: no expert extents",
            path.display()
        )));
    }
    let mut opts = OpenOptions::new();
    opts.read(true);
    if a.io == IoBenchMode::Direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    let file: File = opts.open(&path).map_err(CliError::io(&path, "open"))?;
    let max_len = extents.iter().map(|e| e.1).max().unwrap_or(4096) as usize;
    let mean = extents.iter().map(|e| e.1).sum::<u64>() / extents.len() as u64;
    eprintln!(
        "{} extents of {:.2} MB on average, {:?} reads, {:.0} s per queue depth",
        extents.len(),
        mean as f64 / 1e6,
        a.io,
        a.seconds
    );
    let mut rows = Vec::new();
    for &qd in &a.queue_depths {
        let bytes = AtomicU64::new(0);
        let reads = AtomicU64::new(0);
        // A shared cursor over a fixed pseudo-random permutation of the extents, as decode
        // scatters over experts; every thread takes the next one.
        let next = AtomicUsize::new(0);
        let order: Vec<usize> = {
            let n = extents.len();
            let step = (n / 2 + 1..n).find(|s| gcd(*s, n) == 1).unwrap_or(1);
            (0..n).map(|i| (i * step) % n).collect()
        };
        let deadline = Instant::now() + Duration::from_secs_f64(a.seconds);
        let t0 = Instant::now();
        // A thread that cannot start (too many threads for the system) is an environment
        // failure, exit 3; the readers already started stop at the deadline, which the failure
        // moves to now.
        let stop = std::sync::atomic::AtomicBool::new(false);
        let failed: Result<(), CliError> = std::thread::scope(|s| {
            let mut handles = Vec::with_capacity(qd);
            let mut spawn_error = None;
            for i in 0..qd {
                let reader = || {
                    let mut buf = Aligned::new(max_len)?;
                    while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
                        let i = order[next.fetch_add(1, Ordering::Relaxed) % order.len()];
                        let (off, len) = extents[i];
                        file.read_exact_at(buf.slice(len as usize), off)?;
                        bytes.fetch_add(len, Ordering::Relaxed);
                        reads.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok::<(), std::io::Error>(())
                };
                match std::thread::Builder::new()
                    .name(format!("io-bench-{i}"))
                    .spawn_scoped(s, reader)
                {
                    Ok(h) => handles.push(h),
                    Err(e) => {
                        stop.store(true, Ordering::Relaxed);
                        spawn_error = Some(CliError::Environment(format!(
                            "io-bench: cannot start reader thread {} of {qd}: {e}",
                            i + 1
                        )));
                        break;
                    }
                }
            }
            let mut first = spawn_error.map_or(Ok(()), Err);
            for h in handles {
                let r = match h.join() {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(CliError::Io {
                        path: path.clone(),
                        op: "read",
                        source: e,
                    }),
                    Err(_) => Err(CliError::Environment(
                        "io-bench: a reader thread panicked".into(),
                    )),
                };
                if first.is_ok() {
                    first = r;
                }
            }
            first
        });
        failed?;
        let dt = t0.elapsed().as_secs_f64();
        let gbs = bytes.load(Ordering::Relaxed) as f64 / dt / 1e9;
        println!(
            "queue depth {qd:>3}: {gbs:.3} GB/s ({} extent reads in {dt:.1} s)",
            reads.load(Ordering::Relaxed)
        );
        rows.push(json!({"queue_depth": qd, "gbs": gbs, "reads": reads.load(Ordering::Relaxed), "seconds": dt}));
    }
    if let Some(p) = &a.json {
        rules.write_json(
            p,
            "--json",
            &json!({"io": format!("{:?}", a.io), "mean_extent_bytes": mean, "results": rows}),
        )?;
    }
    Ok(())
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}
