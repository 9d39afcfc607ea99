"""Opening the region medium: one raw block device or one pre-sized regular file.

``open_medium(path, new_bytes, force, is_ours)`` returns a ``Medium`` that holds the
path exclusively (``O_EXCL`` on a block device, ``flock`` on a file) until ``close``.
It refuses with ``UnsafeMediumError`` (saying why, having written nothing):

- always: a block device that is mounted (``/proc/mounts``), used as swap, held by
  another driver (``/sys/dev/block/M:m/holders``), partitioned, or already opened
  exclusively; a path that is neither a block device nor a regular file;
- unless ``force``: a device or pre-existing file whose first bytes carry a known
  signature (ext2/3/4, XFS, btrfs, swap, LUKS, LVM, ISO 9660, MBR, GPT), or a
  pre-existing file with any non-zero byte in its first ``PROBE_BYTES`` that is not a
  flatcake region (``is_ours(first_bytes)``).

A missing file is created (mode 0600, ``O_EXCL``: never through a dangling symlink) and
pre-sized to ``new_bytes`` with fallocate; an empty one is grown to it.  The logical block size comes from ``BLKSSZGET`` (4 KiB for a file).
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
from dataclasses import dataclass
from typing import Callable

from ..errors import UnsafeMediumError
from ..private_fs import create_new

BLKSSZGET, BLKGETSIZE64 = 0x1268, 0x80081272
PROBE_BYTES = 128 << 10          # covers every signature below (btrfs sits at 64 KiB + 64)
SIGNATURES = (                   # (offset, magic, what)
    (1080, b"\x53\xef", "an ext2/3/4 filesystem (superblock magic 0xEF53 at byte 1080)"),
    (0, b"XFSB", "an XFS filesystem ('XFSB' at byte 0)"),
    (65600, b"_BHRfS_M", "a btrfs filesystem ('_BHRfS_M' at byte 65600)"),
    (4086, b"SWAPSPACE2", "swap space ('SWAPSPACE2')"),
    (4086, b"SWAP-SPACE", "swap space ('SWAP-SPACE')"),
    (0, b"LUKS\xba\xbe", "a LUKS encrypted volume"),
    (512, b"LABELONE", "an LVM physical volume ('LABELONE' at byte 512)"),
    (32769, b"CD001", "an ISO 9660 filesystem"),
    (512, b"EFI PART", "a GPT partition table ('EFI PART' at byte 512)"),
    (4096, b"EFI PART", "a GPT partition table ('EFI PART' at byte 4096)"),
    (510, b"\x55\xaa", "an MBR partition table or boot sector (0x55AA at byte 510)"),
)


@dataclass
class Medium:
    path: str
    kind: str                    # "block" or "file"
    size: int                    # bytes
    block_size: int              # logical block size: offsets and lengths align to it
    lock_fd: int
    created: bool                # a new file, pre-sized just now

    def close(self) -> None:
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1


def signature(buf: bytes) -> str | None:
    """What the first bytes of a medium hold, by its magic numbers, or None."""
    for off, magic, what in SIGNATURES:
        if buf[off:off + len(magic)] == magic:
            return what
    return None


def _read_probe(fd: int) -> bytes:
    return os.pread(fd, PROBE_BYTES, 0)


def _device_in_use(path: str, rdev: int) -> str | None:
    """Why the block device ``rdev`` must not be touched, or None."""
    maj, mnr = os.major(rdev), os.minor(rdev)
    sysdir = f"/sys/dev/block/{maj}:{mnr}"

    def same_or_part(p: str) -> bool:
        try:
            st = os.stat(p)
        except OSError:
            return False
        if not stat.S_ISBLK(st.st_mode):
            return False
        if st.st_rdev == rdev:
            return True
        other = f"/sys/dev/block/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        return os.path.exists(f"{other}/partition") and \
            os.path.realpath(f"{other}/..") == os.path.realpath(sysdir)   # one of our partitions
    for table, what in (("/proc/mounts", "mounted at {}"), ("/proc/swaps", "used as swap")):
        try:
            lines = open(table).read().splitlines()
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f and f[0].startswith("/") and same_or_part(f[0]):
                return f"{path} is {what.format(f[1] if len(f) > 1 else '?')} ({f[0]})"
    try:
        holders = os.listdir(f"{sysdir}/holders")
    except OSError:
        holders = []
    if holders:
        return f"{path} is held by {', '.join(holders)} (device mapper, LVM, RAID)"
    try:
        parts = [d for d in os.listdir(sysdir) if os.path.exists(f"{sysdir}/{d}/partition")]
    except OSError:
        parts = []
    if parts:
        return f"{path} has partitions ({', '.join(sorted(parts))}); give one partition, not the disk"
    return None


def _refuse_foreign(path: str, probe: bytes, force: bool, is_ours, zero_ok: bool) -> None:
    if is_ours(probe) or force:
        return
    what = signature(probe)
    if what is not None:
        raise UnsafeMediumError(f"{path} holds {what}; refusing to overwrite it. Give another "
                                "path, or --flatcake-ssd-force (ssd_force=true) to overwrite it")
    if not zero_ok and any(probe):
        raise UnsafeMediumError(f"{path} holds data that is not a flatcake region; refusing to "
                                "overwrite it. Give a new path, or --flatcake-ssd-force")


def open_medium(path: str, new_bytes: int, force: bool,
                is_ours: Callable[[bytes], bool]) -> Medium:
    """Open (or create) the medium at ``path``; see the module docstring."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISBLK(st.st_mode):
        why = _device_in_use(path, st.st_rdev)
        if why:
            raise UnsafeMediumError(why + "; refusing to use it")
        try:
            fd = os.open(path, os.O_RDWR | os.O_EXCL)
        except OSError as e:
            raise UnsafeMediumError(f"cannot open {path} exclusively: {e.strerror} "
                                    "(in use by a filesystem or another process?)") from None
        try:
            size = struct.unpack("Q", fcntl.ioctl(fd, BLKGETSIZE64, b"\0" * 8))[0]
            bsz = struct.unpack("i", fcntl.ioctl(fd, BLKSSZGET, b"\0" * 4))[0]
            _refuse_foreign(path, _read_probe(fd), force, is_ours, zero_ok=True)
        except BaseException:
            os.close(fd)
            raise
        return Medium(path, "block", size, bsz, fd, False)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise UnsafeMediumError(f"{path} is neither a block device nor a regular file")
    created = st is None
    if created:         # a new region file: created O_EXCL, 0600, never through a symlink
        try:
            fd = create_new(path, os.O_RDWR)
        except FileExistsError:
            raise UnsafeMediumError(f"{path} is a dangling symlink (or appeared while it was "
                                    "being created); refusing to create the region through "
                                    "it") from None
    else:
        fd = os.open(path, os.O_RDWR)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UnsafeMediumError(f"{path} is in use by another flatcake store") from None
        if not created:
            _refuse_foreign(path, _read_probe(fd), force, is_ours, zero_ok=False)
        if os.fstat(fd).st_size == 0:
            try:
                os.posix_fallocate(fd, 0, new_bytes)
            except OSError as e:
                os.ftruncate(fd, 0)
                raise UnsafeMediumError(f"cannot pre-size {path} to {new_bytes} bytes: "
                                        f"{e.strerror}") from None
            created = True
        size = os.fstat(fd).st_size
    except BaseException:
        os.close(fd)
        if created and st is None:
            try:
                os.unlink(path)
            except OSError:
                pass
        raise
    return Medium(path, "file", size, 4096, fd, created)
