//! Decodes one stored extent read from standard input and writes its decoded bytes to standard
//! output, for the shell recipe of docs/FORMAT.md ("Every hash, recomputed with a shell"):
//!
//! ```sh
//! tail -c +$((OFFSET + 1)) model.jnf | head -c $STORED_LENGTH \
//!     | cargo run -q -p jnf-codec --example decode -- $LENGTH | sha256sum
//! ```
//!
//! `LENGTH` is the extent's decoded length (the manifest's `length`). Exit 1 with a message on
//! stderr when the bytes do not decode.

use std::io::{Read, Write};

fn main() -> std::process::ExitCode {
    let usage = "usage: decode <DECODED_LENGTH> < stored-extent > decoded-extent";
    let Some(len) = std::env::args()
        .nth(1)
        .and_then(|a| a.parse::<usize>().ok())
    else {
        eprintln!("{usage}");
        return std::process::ExitCode::from(2);
    };
    let mut stored = Vec::new();
    if let Err(e) = std::io::stdin().read_to_end(&mut stored) {
        eprintln!("decode: reading standard input: {e}");
        return std::process::ExitCode::from(3);
    }
    match jnf_codec::decode(&stored, len) {
        Ok(bytes) => match std::io::stdout().lock().write_all(&bytes) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("decode: writing standard output: {e}");
                std::process::ExitCode::from(3)
            }
        },
        Err(e) => {
            eprintln!("decode: {} stored bytes: {e}", stored.len());
            std::process::ExitCode::from(1)
        }
    }
}
