#!/usr/bin/env python3
"""Page-cache control for the streaming benchmark (validation/gpu/bench-stream.sh), without root.

    pagecache.py evict FILE...      drop FILE's clean pages from the page cache (fadvise DONTNEED)
    pagecache.py resident FILE      bytes of FILE in the page cache now (mincore)
    pagecache.py hog LEAVE_BYTES    hold anonymous memory until killed, so that MemAvailable
                                    falls to about LEAVE_BYTES: the page cache can then hold at
                                    most that much (the machine has no swap to push the hog to)
"""
import ctypes
import ctypes.util
import mmap
import os
import signal
import sys
import time


def evict(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError:
            pass
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def resident(path):
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        step = 1 << 30
        for off in range(0, size, step):
            n = min(step, size - off)
            addr = libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, off)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), "mmap")
            vec = (ctypes.c_ubyte * ((n + page - 1) // page))()
            rc = libc.mincore(addr, n, vec)
            libc.munmap(addr, n)
            if rc != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            total += sum(b & 1 for b in vec) * page
    finally:
        os.close(fd)
    return min(total, size)


def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def hog(leave):
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    chunk = 1 << 30
    held = 0
    # Touch memory a GiB at a time (memset: every page becomes resident), re-reading
    # MemAvailable as the kernel drops page cache to make room.
    while mem_available() - leave >= chunk:
        addr = libc.mmap(None, chunk, mmap.PROT_READ | mmap.PROT_WRITE,
                         mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            break
        libc.memset(addr, 1, chunk)
        held += chunk
    print(f"hog: holding {held / 2**30:.1f} GiB; MemAvailable now {mem_available() / 2**30:.1f} GiB",
          flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    cmd = sys.argv[1]
    if cmd == "evict":
        evict(sys.argv[2:])
    elif cmd == "resident":
        print(resident(sys.argv[2]))
    elif cmd == "hog":
        hog(int(sys.argv[2]))
    else:
        sys.exit(__doc__)
