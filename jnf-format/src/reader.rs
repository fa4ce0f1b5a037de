//! Opening a JNF file: the header is read and validated before anything else is touched.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::header::parse_preamble;
use crate::{ExpertExtent, Header, JnfError, TensorEntry, PREAMBLE_LEN};

/// An open, validated JNF file. Reads go through `pread`; callers that need O_DIRECT open the
/// path themselves and use the header's offsets, which are all 4096-aligned.
pub struct JnfFile {
    path: PathBuf,
    file: File,
    header: Header,
}

impl JnfFile {
    pub fn open(path: &Path) -> Result<JnfFile, JnfError> {
        let mut file = File::open(path)?;
        let file_size = file.metadata()?.len();
        let mut preamble = [0u8; PREAMBLE_LEN as usize];
        let n = read_up_to(&mut file, &mut preamble)?;
        let (_, _, len) = parse_preamble(&preamble[..n], file_size)?;
        let mut buf = vec![0u8; (PREAMBLE_LEN + len) as usize];
        file.read_exact_at(&mut buf, 0)?;
        let header = Header::parse(&buf, file_size)?;
        Ok(JnfFile {
            path: path.to_path_buf(),
            file,
            header,
        })
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    /// The tensor's bytes (without padding), read into a fresh buffer.
    pub fn read_tensor(&self, t: &TensorEntry) -> Result<Vec<u8>, JnfError> {
        let mut buf = vec![0u8; t.length as usize];
        self.file.read_exact_at(&mut buf, t.offset)?;
        Ok(buf)
    }

    /// The extent's stored bytes (`stored_length` of them, without padding), read into `buf`:
    /// what the manifest's `stored_blake3` is the hash of.
    pub fn read_stored_into(&self, e: &ExpertExtent, buf: &mut Vec<u8>) -> Result<(), JnfError> {
        buf.resize(e.stored_length as usize, 0);
        self.file.read_exact_at(buf, e.offset)?;
        Ok(())
    }

    /// The extent's gate, up and down bytes (without padding), read into `buf`, decoded when
    /// the extent is stored encoded. No hash is checked here (the manifest's hashes are the
    /// caller's to check), and a hostile encoded extent is an error, never a panic.
    pub fn read_extent_into(&self, e: &ExpertExtent, buf: &mut Vec<u8>) -> Result<(), JnfError> {
        if !e.is_encoded() {
            buf.resize(e.length as usize, 0);
            self.file.read_exact_at(buf, e.offset)?;
            return Ok(());
        }
        let mut stored = Vec::new();
        self.read_stored_into(e, &mut stored)?;
        buf.resize(e.length as usize, 0);
        e.decode_stored(&stored, buf)
    }
}

fn read_up_to(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}
