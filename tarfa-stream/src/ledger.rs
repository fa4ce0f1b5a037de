//! The heat ledger: how often each expert was used, learned across runs of one bundle, so that
//! the `ledger` and `static` cache policies can pin the hottest experts before they are needed.
//!
//! One JSON file per bundle, named by the bundle's root digest, in the cache directory
//! (`$TARFA_CACHE_DIR/ledger/<root>.json`, else `$XDG_CACHE_HOME/tarfa/ledger/...`, else
//! `~/.cache/tarfa/ledger/...`), never inside the bundle (which is read-only and hashed). A use
//! is one (step, layer) in which the forward needed the expert, so a 100-token prefill that
//! routes 30 tokens to an expert counts once: that is what a read costs.
//!
//! The ledger only decides what stays in memory; it can never change an output. A file that
//! does not parse, names another bundle, or has another shape is ignored with a warning (and
//! replaced at the end of the run). Anything but a regular file at the path (a FIFO, a device, a
//! directory) is ignored with a warning without being read, and never replaced. It is written atomically: a temporary file in the same
//! directory, fsync, rename, fsync of the directory. Two runs that end at once keep the counts
//! of the last one to finish.

use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

const FORMAT: &str = "tarfa-heat-ledger";
const VERSION: u32 = 1;
/// Larger files are not ledgers this runtime wrote (12k experts of counts are ~100 KB).
const MAX_FILE_BYTES: u64 = 64 << 20;

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct LedgerFile {
    format: String,
    version: u32,
    root_digest: String,
    layers: usize,
    experts: usize,
    runs: u64,
    counts: Vec<Vec<u64>>,
}

/// Use counts per (layer, expert) of one bundle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeatLedger {
    pub root_digest: String,
    pub layers: usize,
    pub experts: usize,
    /// Runs recorded.
    pub runs: u64,
    /// `counts[layer][expert]`.
    pub counts: Vec<Vec<u64>>,
}

/// What loading found.
#[derive(Clone, Debug)]
pub struct LedgerLoad {
    /// The ledger to use: the file's, or an empty one.
    pub ledger: HeatLedger,
    /// Whether a valid file was found.
    pub found: bool,
    /// Why a file that exists was ignored.
    pub warning: Option<String>,
}

impl HeatLedger {
    /// No history.
    pub fn empty(root_digest: &str, layers: usize, experts: usize) -> HeatLedger {
        HeatLedger {
            root_digest: root_digest.to_string(),
            layers,
            experts,
            runs: 0,
            counts: vec![vec![0; experts]; layers],
        }
    }

    /// Where the ledger of bundle `root_digest` lives under `cache_root`, or `None` when the
    /// digest is not a hex string (it names a file).
    pub fn path(cache_root: &Path, root_digest: &str) -> Option<PathBuf> {
        let hex = !root_digest.is_empty() && root_digest.chars().all(|c| c.is_ascii_hexdigit());
        hex.then(|| {
            cache_root
                .join("ledger")
                .join(format!("{root_digest}.json"))
        })
    }

    /// Loads the ledger at `path` for a bundle of that root digest and shape. Never fails: a
    /// missing file is an empty ledger, a bad one an empty ledger and a warning.
    pub fn load(path: &Path, root_digest: &str, layers: usize, experts: usize) -> LedgerLoad {
        let empty = HeatLedger::empty(root_digest, layers, experts);
        let ignored = |why: String| LedgerLoad {
            ledger: empty.clone(),
            found: false,
            warning: Some(format!("heat ledger {} ignored: {why}", path.display())),
        };
        // O_NONBLOCK: opening a FIFO must not wait for a writer; what was opened is then
        // checked to be a regular file before a byte is read.
        let file = match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return LedgerLoad {
                    ledger: empty,
                    found: false,
                    warning: None,
                }
            }
            Err(e) => return ignored(e.to_string()),
        };
        match file.metadata() {
            Ok(m) if m.is_file() => {}
            Ok(_) => return ignored("not a regular file".into()),
            Err(e) => return ignored(e.to_string()),
        }
        let mut bytes = Vec::new();
        if let Err(e) = file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes) {
            return ignored(e.to_string());
        }
        if bytes.len() as u64 > MAX_FILE_BYTES {
            return ignored("larger than any ledger".into());
        }
        let f: LedgerFile = match serde_json::from_slice(&bytes) {
            Ok(f) => f,
            Err(e) => return ignored(format!("not a ledger ({e})")),
        };
        if f.format != FORMAT || f.version != VERSION {
            return ignored(format!("format {:?} version {}", f.format, f.version));
        }
        if f.root_digest != root_digest {
            return ignored(format!("it belongs to bundle {}", f.root_digest));
        }
        let shape_ok = f.layers == layers
            && f.experts == experts
            && f.counts.len() == layers
            && f.counts.iter().all(|r| r.len() == experts);
        if !shape_ok {
            return ignored(format!(
                "its shape is {} layers x {} experts, the bundle's {layers} x {experts}",
                f.counts.len(),
                f.counts.first().map_or(0, |r| r.len())
            ));
        }
        LedgerLoad {
            ledger: HeatLedger {
                root_digest: f.root_digest,
                layers,
                experts,
                runs: f.runs,
                counts: f.counts,
            },
            found: true,
            warning: None,
        }
    }

    /// Adds one run's uses.
    pub fn record(&mut self, uses: &[((usize, usize), u64)]) {
        for &((l, e), n) in uses {
            if let Some(c) = self.counts.get_mut(l).and_then(|r| r.get_mut(e)) {
                *c = c.saturating_add(n);
            }
        }
        self.runs = self.runs.saturating_add(1);
    }

    /// Experts used at least once, hottest first (ties: lower layer, then lower id).
    pub fn hottest(&self) -> Vec<(usize, usize)> {
        let mut v: Vec<((usize, usize), u64)> = self
            .counts
            .iter()
            .enumerate()
            .flat_map(|(l, r)| r.iter().enumerate().map(move |(e, &c)| ((l, e), c)))
            .filter(|&(_, c)| c > 0)
            .collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        v.into_iter().map(|(k, _)| k).collect()
    }

    /// Writes the ledger to `path` atomically.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        let dir = path
            .parent()
            .ok_or_else(|| std::io::Error::other("no parent directory"))?;
        std::fs::create_dir_all(dir)?;
        // The rename below would replace whatever is at the path: only a ledger file (or
        // nothing) may be there.
        match std::fs::symlink_metadata(path) {
            Ok(m) if !m.is_file() && !m.file_type().is_symlink() => {
                return Err(std::io::Error::other(format!(
                    "{} is not a regular file; not replaced",
                    path.display()
                )))
            }
            _ => {}
        }
        let f = LedgerFile {
            format: FORMAT.into(),
            version: VERSION,
            root_digest: self.root_digest.clone(),
            layers: self.layers,
            experts: self.experts,
            runs: self.runs,
            counts: self.counts.clone(),
        };
        let text = serde_json::to_vec(&f).map_err(std::io::Error::other)?;
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("ledger");
        let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
        let result = (|| {
            let mut out = std::fs::File::create(&tmp)?;
            out.write_all(&text)?;
            out.write_all(b"\n")?;
            out.sync_all()?;
            std::fs::rename(&tmp, path)?;
            // The rename is durable once the directory is.
            std::fs::File::open(dir)?.sync_all()
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROOT: &str = "ab12";

    #[test]
    fn round_trips_and_accumulates() {
        let d = tempfile::tempdir().unwrap();
        let p = HeatLedger::path(d.path(), ROOT).unwrap();
        let first = HeatLedger::load(&p, ROOT, 2, 3);
        assert!(!first.found && first.warning.is_none());
        let mut l = first.ledger;
        l.record(&[((0, 1), 5), ((1, 2), 7), ((9, 9), 1)]);
        l.save(&p).unwrap();
        let mut again = HeatLedger::load(&p, ROOT, 2, 3);
        assert!(again.found, "{:?}", again.warning);
        assert_eq!(again.ledger, l);
        again.ledger.record(&[((0, 1), 1)]);
        assert_eq!(again.ledger.runs, 2);
        assert_eq!(again.ledger.counts, vec![vec![0, 6, 0], vec![0, 0, 7]]);
        assert_eq!(again.ledger.hottest(), vec![(1, 2), (0, 1)]);
        // no temporary file is left behind
        let names: Vec<_> = std::fs::read_dir(p.parent().unwrap())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    #[test]
    fn bad_ledgers_are_ignored_with_a_warning() {
        let d = tempfile::tempdir().unwrap();
        let p = HeatLedger::path(d.path(), ROOT).unwrap();
        let mut good = HeatLedger::empty(ROOT, 2, 3);
        good.record(&[((0, 0), 1)]);
        good.save(&p).unwrap();
        let text = std::fs::read_to_string(&p).unwrap();
        let cases = [
            ("not json", "{".to_string()),
            ("foreign root", text.replace(ROOT, "cd34")),
            (
                "wrong shape",
                text.replace("\"experts\":3", "\"experts\":4"),
            ),
            ("ragged", text.replace("[1,0,0]", "[1,0]")),
            (
                "unknown field",
                text.replace("\"runs\"", "\"extra\":1,\"runs\""),
            ),
            ("other format", text.replace(FORMAT, "something-else")),
        ];
        for (what, bad) in cases {
            assert_ne!(bad, text, "{what}: the edit applies");
            std::fs::write(&p, bad).unwrap();
            let got = HeatLedger::load(&p, ROOT, 2, 3);
            assert!(!got.found, "{what}");
            assert!(
                got.warning.as_deref().unwrap_or("").contains("ignored"),
                "{what}"
            );
            assert_eq!(got.ledger, HeatLedger::empty(ROOT, 2, 3), "{what}");
        }
        assert!(HeatLedger::path(d.path(), "../x").is_none());
    }

    /// A FIFO at the ledger's path is neither waited on (opening it for reading would block
    /// until a writer came) nor replaced by the save.
    #[test]
    fn a_fifo_at_the_ledger_path_is_ignored_and_kept() {
        use std::os::unix::fs::FileTypeExt;
        let d = tempfile::tempdir().unwrap();
        let p = HeatLedger::path(d.path(), ROOT).unwrap();
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let q = p.clone();
        std::thread::spawn(move || tx.send(HeatLedger::load(&q, ROOT, 2, 3)).unwrap());
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("loading a FIFO returns at once");
        assert!(!got.found);
        let w = got.warning.unwrap_or_default();
        assert!(
            w.contains("not a regular file") && w.contains("ignored"),
            "{w}"
        );
        let err = got.ledger.save(&p).unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
        assert!(std::fs::symlink_metadata(&p).unwrap().file_type().is_fifo());
    }
}
