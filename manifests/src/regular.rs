//! Opening a bundle's file only if it is a regular file: a FIFO, device or socket in a bundle
//! must be refused at once, never opened for a read that would block forever.

use std::fs::File;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use thiserror::Error;

/// Why a file of a bundle could not be opened as a regular file.
#[derive(Debug, Error)]
pub enum OpenRegularError {
    /// Nothing at the path (or a symlink to nothing).
    #[error("does not exist")]
    NotFound,
    /// A directory, FIFO, device or socket.
    #[error("is not a regular file (it is a {0})")]
    NotRegular(&'static str),
    /// A symlink loop, or a path component that is not a directory: bad input, not the machine.
    #[error("cannot be resolved ({0})")]
    Unresolvable(io::Error),
    /// Any other operating-system failure (permissions, I/O).
    #[error("{0}")]
    Io(io::Error),
}

/// Opens `path` read-only with O_NONBLOCK (so a FIFO does not block the open), then checks with
/// fstat on the open descriptor that it is a regular file. O_NONBLOCK has no effect on reads of
/// a regular file.
pub fn open_regular(path: &Path) -> Result<File, OpenRegularError> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(classify)?;
    let meta = file.metadata().map_err(OpenRegularError::Io)?;
    let ft = meta.file_type();
    if ft.is_file() {
        return Ok(file);
    }
    use std::os::unix::fs::FileTypeExt;
    let what = if ft.is_dir() {
        "directory"
    } else if ft.is_fifo() {
        "FIFO"
    } else if ft.is_socket() {
        "socket"
    } else if ft.is_block_device() || ft.is_char_device() {
        "device"
    } else {
        "special file"
    };
    Err(OpenRegularError::NotRegular(what))
}

fn classify(e: io::Error) -> OpenRegularError {
    match e.raw_os_error() {
        Some(libc::ENOENT) => OpenRegularError::NotFound,
        Some(libc::EISDIR) => OpenRegularError::NotRegular("directory"),
        Some(libc::ELOOP) | Some(libc::ENOTDIR) | Some(libc::ENAMETOOLONG) => {
            OpenRegularError::Unresolvable(e)
        }
        // Opening a socket gives ENXIO.
        Some(libc::ENXIO) => OpenRegularError::NotRegular("socket or device"),
        _ => OpenRegularError::Io(e),
    }
}

/// Reads the whole regular file at `path` (see [`open_regular`]).
pub fn read_regular(path: &Path) -> Result<Vec<u8>, OpenRegularError> {
    use std::io::Read;
    let mut f = open_regular(path)?;
    let mut out = Vec::new();
    f.read_to_end(&mut out).map_err(OpenRegularError::Io)?;
    Ok(out)
}
