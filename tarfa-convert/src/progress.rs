//! Progress bars on a terminal, silence otherwise.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A byte-counting bar on stderr: bytes, throughput and ETA. Hidden when stderr is not a
/// terminal (indicatif's stderr target checks), so scripts and CI logs stay clean.
pub fn bytes_bar(total: u64, message: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:>10} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_message(message.to_string());
    bar
}
