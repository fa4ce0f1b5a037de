//! Whole-file hashes: SHA-256 (what manifests and the Hub's LFS blob names use) and the git blob
//! SHA-1 (what the Hub names small, non-LFS files by). Streaming with a large buffer; nothing is
//! mapped, so a file that shrinks while being hashed is an I/O error, never a crash.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use sha1::Sha1;
use sha2::{Digest, Sha256};

use crate::read_at;

/// Read size for hashing: large enough that syscall overhead vanishes next to SHA-256 itself.
const HASH_BUF: usize = 4 << 20;

/// The SHA-256 of the file at `path`, read front to back with a 4 MiB buffer.
pub fn sha256_file(path: &Path) -> io::Result<[u8; 32]> {
    sha256_handle(&File::open(path)?)
}

/// SHA-256 of many files, hashed in parallel on rayon's pool (one file per task, so a few large
/// shards keep as many cores busy as there are shards). Results are in the order of `paths`.
pub fn sha256_files_parallel(paths: &[PathBuf]) -> Vec<io::Result<[u8; 32]>> {
    paths.par_iter().map(|p| sha256_file(p)).collect()
}

/// Lowercase hex of a digest.
pub fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// SHA-256 of everything behind an open handle, from offset 0 (the handle's cursor is not used,
/// so one handle can be hashed and read concurrently).
pub(crate) fn sha256_handle(file: &File) -> io::Result<[u8; 32]> {
    let mut h = Sha256::new();
    stream(file, |chunk| h.update(chunk))?;
    Ok(h.finalize().into())
}

/// The git blob SHA-1 of a file: `sha1("blob <len>\0" + content)`, as `git hash-object` prints.
pub(crate) fn git_blob_sha1_handle(file: &File) -> io::Result<[u8; 20]> {
    let len = file.metadata()?.len();
    let mut h = Sha1::new();
    h.update(format!("blob {len}\0").as_bytes());
    let read = stream(file, |chunk| h.update(chunk))?;
    if read != len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "file changed size while being hashed",
        ));
    }
    Ok(h.finalize().into())
}

/// SHA-256 of bytes in memory.
pub(crate) fn sha256_bytes(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// The git blob SHA-1 of bytes in memory.
pub(crate) fn git_blob_sha1_bytes(bytes: &[u8]) -> [u8; 20] {
    let mut h = Sha1::new();
    h.update(format!("blob {}\0", bytes.len()).as_bytes());
    h.update(bytes);
    h.finalize().into()
}

/// Feeds the whole file to `sink` in [`HASH_BUF`] chunks; returns the byte count.
fn stream(file: &File, mut sink: impl FnMut(&[u8])) -> io::Result<u64> {
    let mut buf = vec![0u8; HASH_BUF];
    let mut offset = 0u64;
    loop {
        let n = match read_at(file, &mut buf, offset) {
            Ok(0) => return Ok(offset),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        sink(&buf[..n]);
        offset += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_digests() {
        let dir = crate::tests::scratch_dir("hash");
        let p = dir.join("hello");
        std::fs::write(&p, b"hello\n").unwrap();
        assert_eq!(
            to_hex(&sha256_file(&p).unwrap()),
            "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03"
        );
        // `printf 'hello\n' | git hash-object --stdin`
        let f = File::open(&p).unwrap();
        assert_eq!(
            to_hex(&git_blob_sha1_handle(&f).unwrap()),
            "ce013625030ba8dba906f756967f9e9ca394464a"
        );
        let empty = dir.join("empty");
        std::fs::write(&empty, b"").unwrap();
        assert_eq!(
            to_hex(&sha256_file(&empty).unwrap()),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        let many = sha256_files_parallel(&[p.clone(), empty.clone(), dir.join("absent")]);
        assert_eq!(many[0].as_ref().unwrap(), &sha256_file(&p).unwrap());
        assert!(many[2].is_err());
    }

    #[test]
    fn large_file_crosses_buffer_boundary() {
        let dir = crate::tests::scratch_dir("hash-large");
        let p = dir.join("big");
        let data: Vec<u8> = (0..(HASH_BUF * 2 + 12345))
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        std::fs::write(&p, &data).unwrap();
        let expect: [u8; 32] = Sha256::digest(&data).into();
        assert_eq!(sha256_file(&p).unwrap(), expect);
    }
}
