//! Page-aligned buffers and O_DIRECT reads: verification must see the disk, not the page cache.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use jnf_format::ALIGN;

/// A zeroed heap buffer aligned to 4096 bytes, as O_DIRECT requires.
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    pub fn new(len: usize) -> AlignedBuf {
        let layout = Layout::from_size_align(len.max(1), ALIGN as usize).expect("valid layout");
        // SAFETY: the layout has non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, len }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes for the buffer's lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout =
            Layout::from_size_align(self.len.max(1), ALIGN as usize).expect("valid layout");
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, layout) }
    }
}

/// How a file was opened for reading back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadMode {
    /// O_DIRECT: every read goes to the device.
    Direct,
    /// The file system refused O_DIRECT (tmpfs, some overlays): its cached pages were dropped
    /// with posix_fadvise(DONTNEED) after fsync, so reads still come from the device where the
    /// kernel honours the advice.
    DroppedCache,
}

/// Open `path` for reads that bypass the page cache.
pub fn open_uncached(path: &Path) -> io::Result<(File, ReadMode)> {
    match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Ok(f) => Ok((f, ReadMode::Direct)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            let f = File::open(path)?;
            drop_cache(&f)?;
            Ok((f, ReadMode::DroppedCache))
        }
        Err(e) => Err(e),
    }
}

/// Ask the kernel to drop the file's clean cached pages (the file must be fsynced first).
pub fn drop_cache(f: &File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: plain syscall on an open descriptor.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

/// Read exactly `buf.len()` bytes at `offset`; with O_DIRECT both must be 4096-aligned.
pub fn read_at(f: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    f.read_exact_at(buf, offset)
}

/// Write `len` bytes of `f` from `offset` to the device and wait for them
/// (sync_file_range: data only; the final fsync covers metadata and the device cache). Where
/// reads do not bypass the cache, the range's pages are then dropped so that they come from
/// the device.
pub fn sync_range(f: &File, offset: u64, len: u64, mode: ReadMode) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
        | libc::SYNC_FILE_RANGE_WRITE
        | libc::SYNC_FILE_RANGE_WAIT_AFTER;
    // SAFETY: plain syscall on an open descriptor.
    let rc = unsafe { libc::sync_file_range(f.as_raw_fd(), offset as i64, len as i64, flags) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        // Some file systems (tmpfs among them) have nothing to write back.
        if !matches!(
            e.raw_os_error(),
            Some(libc::EINVAL | libc::ESPIPE | libc::ENOSYS)
        ) {
            return Err(e);
        }
    }
    if mode == ReadMode::DroppedCache {
        // SAFETY: plain syscall on an open descriptor.
        let rc = unsafe {
            libc::posix_fadvise(
                f.as_raw_fd(),
                offset as i64,
                len as i64,
                libc::POSIX_FADV_DONTNEED,
            )
        };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
    }
    Ok(())
}
