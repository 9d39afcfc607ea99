"""Private, symlink-safe files and directories: the only way the store creates either.

KV blocks are users' prompts in another form, so nothing of a store is readable or writable
by another local user, whatever the umask:

- ``private_dir(path)`` makes (0700) or checks a store directory and returns the path to
  use.  A path that is something else (a file, a device) raises ``NotADirectoryError``
  saying what it is.  It refuses (``UnsafeStoreError``, naming the path) a directory not owned by the
  running user, one that is group- or world-writable, one under an ancestor that group
  or others can write (unless that ancestor is sticky, like ``/tmp``), and a symlink owned
  by someone else.  A symlink the user owns is resolved once and logged; the store then
  uses the target.  An existing directory readable by others is tightened to 0700.
- ``open_file(path, create=True)`` opens without following a symlink (``O_NOFOLLOW``);
  a missing file is created ``O_CREAT | O_EXCL`` with mode 0600 (``fchmod``, so the
  umask cannot widen or narrow it).  Returns ``(fd, created)``; raises ``OSError``.
- ``create_new(path)`` creates a file that must not exist yet (``O_EXCL | O_NOFOLLOW``,
  0600), e.g. a temporary file before its rename.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

from .errors import UnsafeStoreError

log = logging.getLogger("sglang_flatcake")

DIR_MODE = 0o700
FILE_MODE = 0o600
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def create_new(path: str | os.PathLike, flags: int = os.O_WRONLY) -> int:
    """A new file at ``path`` (mode 0600); ``FileExistsError`` if anything is there."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(path: str | os.PathLike, flags: int = os.O_RDWR,
              create: bool = False) -> tuple[int, bool]:
    """(fd, created): ``path`` opened without following a symlink; see the module docstring."""
    if create:
        try:
            return create_new(path, flags), True
        except FileExistsError:
            pass
    return os.open(path, flags | O_NOFOLLOW | O_CLOEXEC), False


def _refuse(path: Path, why: str) -> UnsafeStoreError:
    return UnsafeStoreError(f"store directory {path} {why}; refusing to use it (another local "
                            "user could read the cache or plant links in it). Give a directory "
                            "only you can write, e.g. under ~/.cache")


def _not_a_dir(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "it is a regular file, not a directory"
    if stat.S_ISBLK(mode):
        return "it is a block device, not a directory (a region goes in --flatcake-ssd-path)"
    return "it is not a directory"


def _check_ancestors(path: Path) -> None:
    """No ancestor lets another user rename the store away (writable and not sticky)."""
    for a in path.parents:
        st = os.stat(a)
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise _refuse(path, f"sits in {a}, writable by others (mode {st.st_mode & 0o7777:o}) "
                                "and not sticky")


def private_dir(path: str | os.PathLike) -> Path:
    """Make or check a private directory; returns the path to use (see the module docstring)."""
    p = Path(os.path.abspath(path))
    uid = os.geteuid()
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        missing = [a for a in [*reversed(p.parents), p] if not os.path.lexists(a)]
        for a in missing:         # every directory made here is 0700, whatever the umask
            try:
                os.mkdir(a, DIR_MODE)
                os.chmod(a, DIR_MODE)
            except FileExistsError:
                pass              # someone made it first: the store dir is checked below
        st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid not in (uid, 0):
            raise _refuse(p, f"is a symlink owned by uid {st.st_uid}")
        real = p.resolve(strict=True)
        log.warning("flatcake: store directory %s is a symlink; using its target %s", p, real)
        p, st = real, os.lstat(real)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, _not_a_dir(st.st_mode), str(p))
    if st.st_uid != uid:
        raise _refuse(p, f"is owned by uid {st.st_uid}, not the running user (uid {uid})")
    if st.st_mode & 0o022:
        raise _refuse(p, f"is writable by group or others (mode {st.st_mode & 0o7777:o})")
    _check_ancestors(p)
    if st.st_mode & 0o077:
        os.chmod(p, DIR_MODE)
        log.info("flatcake: %s was readable by others; now mode 700", p)
    return p
