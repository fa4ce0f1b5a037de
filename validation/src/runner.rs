//! Running `tarfa-run generate` as a child process: the flags of its documented command line, the
//! exit codes, and the peak memory of the child sampled while it runs.
//!
//! Every check and every A/B arm runs the runtime in a fresh process through this module, so that
//! nothing (a warm allocator, a cached weight, a thread pool) carries from one run to the next.

use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};

/// tarfa-run's exit codes (its `--help` documents them).
pub const EXIT_OK: i32 = 0;
pub const EXIT_VERIFICATION: i32 = 1;
pub const EXIT_BAD_INPUT: i32 = 2;
pub const EXIT_ENVIRONMENT: i32 = 3;

/// What an exit status means, for messages.
pub fn describe_exit(code: Option<i32>) -> &'static str {
    match code {
        Some(EXIT_OK) => "ok",
        Some(EXIT_VERIFICATION) => "verification failure",
        Some(EXIT_BAD_INPUT) => "bad input",
        Some(EXIT_ENVIRONMENT) => "environment failure",
        Some(_) => "unexpected exit code",
        None => "killed by a signal",
    }
}

/// A `tarfa-run` binary whose `generate` command answers `--help`.
#[derive(Clone, Debug)]
pub struct Runtime {
    pub bin: PathBuf,
    generate_help: String,
    /// A run still going after this long is killed and reported as timed out.
    pub timeout: Duration,
}

/// How long one `generate` may run in the checks before it counts as hung.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(900);

impl Runtime {
    /// The runtime at `explicit`, else `$TARFA_RUN`, else `tarfa-run` next to this executable
    /// (`target/<profile>/`, also from `target/<profile>/deps/`). Errors are environment failures.
    pub fn locate(explicit: Option<&Path>) -> Result<Runtime> {
        let bin = match explicit {
            Some(p) => p.to_path_buf(),
            None => match std::env::var_os("TARFA_RUN") {
                Some(p) => PathBuf::from(p),
                None => sibling_binary("tarfa-run").ok_or_else(|| {
                    anyhow!(
                        "no tarfa-run next to this executable; pass --tarfa-run or set TARFA_RUN"
                    )
                })?,
            },
        };
        Runtime::at(&bin)
    }

    /// The runtime at exactly `bin`.
    pub fn at(bin: &Path) -> Result<Runtime> {
        let out = Command::new(bin)
            .args(["generate", "--help"])
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("cannot run {}", bin.display()))?;
        if !out.status.success() {
            return Err(anyhow!(
                "{} generate --help exited {:?}: the runtime has no `generate` command yet? {}",
                bin.display(),
                out.status.code(),
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .next()
                    .unwrap_or("")
            ));
        }
        Ok(Runtime {
            bin: bin.to_path_buf(),
            generate_help: String::from_utf8_lossy(&out.stdout).into_owned(),
            timeout: DEFAULT_TIMEOUT,
        })
    }

    /// Whether `generate --help` lists `flag` (e.g. `--ram-budget`): how the arm table learns
    /// which features this build has.
    pub fn supports(&self, flag: &str) -> bool {
        self.generate_help
            .split(|c: char| {
                c.is_whitespace() || c == ',' || c == '=' || c == '[' || c == ']' || c == '<'
            })
            .any(|w| w == flag)
    }

    /// Whether `generate --help` mentions `value` for a flag whose values it lists (e.g. `cuda`).
    pub fn help_mentions(&self, value: &str) -> bool {
        self.generate_help.contains(value)
    }

    /// Run `generate` and wait for it, sampling its memory.
    pub fn generate(&self, g: &Generate) -> Result<Finished> {
        let mut cmd = Command::new(&self.bin);
        cmd.args(g.to_args());
        // No VRAM sampling here: the checks compare bits, and nvidia-smi every 100 ms costs more
        // CPU than a small run.
        run_watched(cmd, Duration::from_millis(5), self.timeout, false)
    }
}

/// A binary called `name` in the directory of the current executable, or its parent (test
/// executables live in `target/<profile>/deps/`).
pub fn sibling_binary(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    [dir.join(name), dir.parent()?.join(name)]
        .into_iter()
        .find(|p| p.is_file())
}

/// One `tarfa-run generate` invocation (the command line of the runtime's `generate --help`).
#[derive(Clone, Debug, Default)]
pub struct Generate {
    pub bundle: PathBuf,
    pub tokens: Vec<u32>,
    pub max_new_tokens: usize,
    /// Always fixed greedy with EOS ignored unless this is false.
    pub ignore_eos: bool,
    pub logits_out: Option<PathBuf>,
    pub prefill_logits: bool,
    pub router_trace: Option<PathBuf>,
    pub verify_report: Option<PathBuf>,
    pub summary_json: Option<PathBuf>,
    pub expect_root: Option<String>,
    /// The labelled validation-only arm that rounds the final hidden state to BF16.
    pub invalid_bf16_before_lm_head: bool,
    /// Options of the arm under test (`--threads 2`, `--kernel avx2`, ...), appended last.
    pub extra: Vec<String>,
}

impl Generate {
    pub fn new(bundle: &Path, tokens: &[u32], max_new_tokens: usize) -> Generate {
        Generate {
            bundle: bundle.to_path_buf(),
            tokens: tokens.to_vec(),
            max_new_tokens,
            ignore_eos: true,
            ..Default::default()
        }
    }

    pub fn to_args(&self) -> Vec<OsString> {
        let mut a: Vec<OsString> = vec!["generate".into(), self.bundle.clone().into()];
        let tokens: Vec<String> = self.tokens.iter().map(u32::to_string).collect();
        a.push("--tokens".into());
        a.push(tokens.join(",").into());
        a.push("--max-new-tokens".into());
        a.push(self.max_new_tokens.to_string().into());
        if self.ignore_eos {
            a.push("--ignore-eos".into());
        }
        let mut path = |flag: &str, p: &Option<PathBuf>| {
            if let Some(p) = p {
                a.push(flag.into());
                a.push(p.clone().into());
            }
        };
        path("--logits-out", &self.logits_out);
        path("--router-trace", &self.router_trace);
        path("--verify-report", &self.verify_report);
        path("--summary-json", &self.summary_json);
        if self.prefill_logits {
            a.push("--prefill-logits".into());
        }
        if let Some(r) = &self.expect_root {
            a.push("--expect-root".into());
            a.push(r.into());
        }
        if self.invalid_bf16_before_lm_head {
            a.push("--invalid-bf16-before-lm-head".into());
        }
        a.extend(self.extra.iter().map(OsString::from));
        a
    }
}

/// A finished child.
#[derive(Clone, Debug)]
pub struct Finished {
    /// The exit code; `None` when a signal ended it.
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    /// From spawn to exit.
    pub wall: Duration,
    /// The largest VmHWM (or VmRSS) read from /proc/<pid>/status while it ran, or the kernel's
    /// ru_maxrss at exit if larger, in bytes.
    pub peak_rss_bytes: Option<u64>,
    /// The largest GPU memory nvidia-smi attributed to it, in bytes; `None` without nvidia-smi.
    pub peak_vram_bytes: Option<u64>,
    /// It ran past its time limit and was killed.
    pub timed_out: bool,
}

impl Finished {
    pub fn ok(&self) -> bool {
        self.code == Some(EXIT_OK)
    }

    /// `Ok(self)` on exit 0, else an error quoting the exit and the last stderr line.
    pub fn require_ok(self, what: &str) -> Result<Finished> {
        if self.ok() {
            return Ok(self);
        }
        Err(anyhow!("{what}: {}", self.describe()))
    }

    /// "tarfa-run exited Some(1) (verification failure): <last stderr line>", or the timeout.
    pub fn describe(&self) -> String {
        if self.timed_out {
            return format!(
                "tarfa-run ran past its time limit after {:.0} s and was killed",
                self.wall.as_secs_f64()
            );
        }
        format!(
            "tarfa-run exited {:?} ({}): {}",
            self.code,
            describe_exit(self.code),
            self.stderr_tail()
        )
    }

    /// The last non-empty stderr line.
    pub fn stderr_tail(&self) -> &str {
        self.stderr
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("")
    }
}

/// `VmHWM` (the kernel's high-water mark; else `VmRSS`) of a live process, in bytes.
pub fn proc_peak_rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_vm_status(&status)
}

/// The larger of `VmHWM` and `VmRSS` in a /proc/<pid>/status text, in bytes.
pub fn parse_vm_status(status: &str) -> Option<u64> {
    let field = |key: &str| {
        status.lines().find_map(|l| {
            let rest = l.strip_prefix(key)?.trim();
            let kib: u64 = rest.strip_suffix("kB")?.trim().parse().ok()?;
            Some(kib * 1024)
        })
    };
    match (field("VmHWM:"), field("VmRSS:")) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// The memory nvidia-smi attributes to `pid` in its `--query-compute-apps=pid,used_memory
/// --format=csv` output, in bytes.
pub fn parse_nvidia_smi_apps(csv: &str, pid: u32) -> Option<u64> {
    let mut total = None;
    for line in csv.lines().skip(1) {
        let mut cols = line.split(',').map(str::trim);
        let (Some(p), Some(mem)) = (cols.next(), cols.next()) else {
            continue;
        };
        if p.parse::<u32>().ok() != Some(pid) {
            continue;
        }
        let mut it = mem.split_whitespace();
        let (Some(n), unit) = (it.next().and_then(|n| n.parse::<u64>().ok()), it.next()) else {
            continue;
        };
        let scale = match unit {
            Some("KiB") => 1 << 10,
            Some("GiB") => 1 << 30,
            _ => 1 << 20, // nvidia-smi prints MiB
        };
        *total.get_or_insert(0) += n * scale;
    }
    total
}

/// Whether `nvidia-smi` can be run here.
pub fn have_nvidia_smi() -> bool {
    Command::new("nvidia-smi")
        .arg("-L")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

fn drain<R: Read + Send + 'static>(r: Option<R>) -> thread::JoinHandle<String> {
    thread::spawn(move || {
        let mut s = Vec::new();
        if let Some(mut r) = r {
            let _ = r.read_to_end(&mut s);
        }
        String::from_utf8_lossy(&s).into_owned()
    })
}

/// Reap `pid` if it has exited: its exit code (`None` for a signal) and its peak RSS in bytes as
/// the kernel counted it (`wait4`'s `ru_maxrss`, KiB on Linux).
fn try_reap(pid: u32) -> Result<Option<(Option<i32>, Option<u64>)>> {
    let mut status: libc::c_int = 0;
    // SAFETY: an all-zero rusage is a valid value; wait4 only writes to the two out-pointers.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::wait4(pid as libc::pid_t, &mut status, libc::WNOHANG, &mut ru) };
    if r == 0 {
        return Ok(None);
    }
    if r < 0 {
        return Err(anyhow!("wait4({pid}): {}", std::io::Error::last_os_error()));
    }
    let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    let maxrss = (ru.ru_maxrss > 0).then(|| ru.ru_maxrss as u64 * 1024);
    Ok(Some((code, maxrss)))
}

/// Spawn `cmd`, poll its /proc status every `interval` (and, with `sample_vram`, nvidia-smi every
/// 100 ms where it exists) until it exits; kill it after `timeout`.
pub fn run_watched(
    mut cmd: Command,
    interval: Duration,
    timeout: Duration,
    sample_vram: bool,
) -> Result<Finished> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start {:?}", cmd.get_program()))?;
    let pid = child.id();
    let out = drain(child.stdout.take());
    let err = drain(child.stderr.take());

    let done = Arc::new(AtomicBool::new(false));
    let vram: Arc<Mutex<Option<u64>>> = Arc::new(Mutex::new(None));
    let vram_thread = (sample_vram && have_nvidia_smi()).then(|| {
        let (done, vram) = (done.clone(), vram.clone());
        thread::spawn(move || {
            *vram.lock().unwrap() = Some(0);
            while !done.load(Ordering::Relaxed) {
                if let Ok(o) = Command::new("nvidia-smi")
                    .args(["--query-compute-apps=pid,used_memory", "--format=csv"])
                    .output()
                {
                    if let Some(b) = parse_nvidia_smi_apps(&String::from_utf8_lossy(&o.stdout), pid)
                    {
                        let mut v = vram.lock().unwrap();
                        *v = Some(v.unwrap_or(0).max(b));
                    }
                }
                thread::sleep(Duration::from_millis(100));
            }
        })
    });

    let mut peak: Option<u64> = None;
    let mut timed_out = false;
    let (code, maxrss) = loop {
        if let Some(s) = proc_peak_rss(pid) {
            peak = Some(peak.unwrap_or(0).max(s));
        }
        if let Some(done) = try_reap(pid)? {
            break done;
        }
        if !timed_out && start.elapsed() > timeout {
            timed_out = true;
            let _ = child.kill(); // the child is not reaped yet, so its pid is still its own
        }
        thread::sleep(interval);
    };
    // The kernel's own peak of the child (ru_maxrss) also covers the last moments between
    // two polls.
    if let Some(m) = maxrss {
        peak = Some(peak.unwrap_or(0).max(m));
    }
    let wall = start.elapsed();
    done.store(true, Ordering::Relaxed);
    if let Some(t) = vram_thread {
        let _ = t.join();
    }
    let peak_vram_bytes = *vram.lock().unwrap();
    drop(child); // reaped by try_reap
    Ok(Finished {
        code,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
        wall,
        peak_rss_bytes: peak,
        peak_vram_bytes,
        timed_out,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generate_renders_the_documented_flags() {
        let mut g = Generate::new(Path::new("/b"), &[1, 2, 3], 4);
        g.logits_out = Some("/l".into());
        g.prefill_logits = true;
        g.router_trace = Some("/t".into());
        g.extra = vec!["--threads".into(), "2".into()];
        let a: Vec<String> = g
            .to_args()
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            a,
            [
                "generate",
                "/b",
                "--tokens",
                "1,2,3",
                "--max-new-tokens",
                "4",
                "--ignore-eos",
                "--logits-out",
                "/l",
                "--router-trace",
                "/t",
                "--prefill-logits",
                "--threads",
                "2"
            ]
        );
    }

    #[test]
    fn vm_status_gives_the_high_water_mark() {
        let s = "Name:\ttarfa-run\nVmPeak:\t 9000 kB\nVmHWM:\t    2048 kB\nVmRSS:\t    1024 kB\n";
        assert_eq!(parse_vm_status(s), Some(2048 * 1024));
        assert_eq!(parse_vm_status("VmRSS:\t 4 kB\n"), Some(4096));
        assert_eq!(parse_vm_status("Name: x\n"), None);
    }

    #[test]
    fn nvidia_smi_rows_of_the_pid_are_summed() {
        let csv = "pid, used_memory [MiB]\n123, 500 MiB\n77, 9 MiB\n123, 12 MiB\n";
        assert_eq!(parse_nvidia_smi_apps(csv, 123), Some(512 << 20));
        assert_eq!(parse_nvidia_smi_apps(csv, 5), None);
    }

    #[test]
    fn a_child_is_watched_to_its_exit() {
        let mut c = Command::new("sh");
        c.args(["-c", "echo out; echo err >&2; exit 3"]);
        let f = run_watched(c, Duration::from_millis(1), Duration::from_secs(60), true).unwrap();
        assert_eq!(f.code, Some(3));
        assert_eq!(f.stdout.trim(), "out");
        assert_eq!(f.stderr_tail(), "err");
        assert!(f.require_ok("x").is_err());
    }

    #[test]
    fn a_hung_child_is_killed_at_its_time_limit() {
        let mut c = Command::new("sleep");
        c.arg("30");
        let f = run_watched(
            c,
            Duration::from_millis(2),
            Duration::from_millis(200),
            false,
        )
        .unwrap();
        assert!(f.timed_out && f.code.is_none(), "{f:?}");
        assert!(f.wall < Duration::from_secs(10));
        assert!(f.describe().contains("time limit"));
    }
}
