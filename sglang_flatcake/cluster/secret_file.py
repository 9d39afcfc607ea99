"""Reading the cluster secret file (``--flatcake-cluster-secret-file``) safely, and with the
same checks a node's key file and the roster (``identity``).

The file is opened relative to its directory's descriptor with ``O_NOFOLLOW | O_NONBLOCK``
(a symlink is refused, a FIFO cannot block start-up) and every check is made with ``fstat``
on the open descriptors (no check-then-open race): the directory may be written by no one
but its owner (this user or root), the file must be a regular file owned by this user with
no group or other permission bits, and hold at least ``MIN_SECRET_BYTES`` bytes of varied
content (``low_entropy``).  Every refusal is one ``ConfigError`` line naming the file, never
its contents.
"""

from __future__ import annotations

import errno
import math
import os
import stat
from collections import Counter

from ..errors import ConfigError

MIN_SECRET_BYTES = 32
MAX_SECRET_BYTES = 4096
MIN_DISTINCT = 8              # distinct byte values
MIN_BITS = 128.0              # length x empirical entropy per byte


def low_entropy(data: bytes) -> bool:
    """Too few distinct bytes, or too little entropy by byte frequencies (all bytes equal,
    a short pattern repeated): not what ``head -c 32 /dev/urandom | base64`` makes."""
    counts = Counter(data)
    bits = -sum(c * math.log2(c / len(data)) for c in counts.values())
    return len(counts) < MIN_DISTINCT or bits < MIN_BITS


def read_secret_file(path: str, label: str = "cluster_secret_file",
                     most: int = MAX_SECRET_BYTES, public: bool = False) -> bytes:
    """The secret in ``path`` (a trailing newline dropped) after every check above; errors
    name it as ``label``.  ``public`` (the roster: a list of public keys) lets group and
    others read the file and root own it, nothing else; ``most`` bounds its size."""
    path = os.fspath(path)

    def bad(why: str) -> ConfigError:
        return ConfigError(f"{label}={path!r} {why}")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise bad(f"could not be read: its directory: {e.strerror}") from None
    try:
        d = os.fstat(dfd)
        if d.st_mode & 0o022 or d.st_uid not in (os.getuid(), 0):
            raise bad(f"is in a directory others can write or own ({folder!r}: mode "
                      f"{stat.S_IMODE(d.st_mode):o}, owner uid {d.st_uid}): keep it in a "
                      f"private directory (chmod go-w)")
        try:
            fd = os.open(os.path.basename(path),
                         os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise bad("is a symbolic link: name the file itself") from None
            raise bad(f"could not be read: {e.strerror}") from None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise bad("is not a regular file")
        if st.st_uid != os.getuid() and not (public and st.st_uid == 0):
            raise bad(f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})")
        if st.st_mode & (0o022 if public else 0o077):
            raise bad(f"is {'writable' if public else 'readable'} by group or others (mode "
                      f"{stat.S_IMODE(st.st_mode):o}): chmod {'644' if public else '600'} it")
        if st.st_size > most:
            raise bad(f"holds {st.st_size} bytes: expected at most {most}")
        data = b""
        while len(data) <= most:
            part = os.read(fd, most + 1 - len(data))
            if not part:
                break
            data += part
    except OSError as e:
        raise bad(f"could not be read: {e.strerror}") from None
    finally:
        os.close(fd)
    data = data.rstrip(b"\r\n")
    if len(data) < MIN_SECRET_BYTES:
        raise bad(f"holds {len(data)} bytes: expected at least {MIN_SECRET_BYTES} (e.g. "
                  f"`head -c 32 /dev/urandom | base64 > FILE`)")
    if low_entropy(data):
        raise bad(f"holds low-entropy content (fewer than {MIN_DISTINCT} distinct bytes or "
                  f"under {MIN_BITS:.0f} bits by byte frequency): use random bytes")
    return data
