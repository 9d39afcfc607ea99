"""How one setting is declared, parsed and checked (used by ``config_groups`` and ``config``).

A setting is a dataclass field made with ``setting()``: its ``help`` becomes the flag help and
the line in docs/configuration.md, its ``allowed`` text says what is accepted, and its check
refuses anything else with one ``ConfigError`` line that starts ``name=value``.  Parsers here
turn flag strings (``4GiB``, ``off``) into typed values; they never guess.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Any, Callable

from .errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
    "p": 1000**5, "pb": 1000**5, "pib": 1 << 50,
}

Check = Callable[[Any, str], None]          # (value, name) -> None, or ConfigError


def refuse(name: str, value: Any, allowed: str) -> ConfigError:
    """The one line every refusal reads: ``name=value is not allowed: expected ...``."""
    return ConfigError(f"{name}={value!r} is not allowed: expected {allowed}")


def setting(default: Any, help: str, *, allowed: str = "", ok: Callable[[Any], bool] | None = None,
            check: Check | None = None, size: bool = False) -> Any:
    """A config field: ``help`` (flag help and docs), ``allowed`` (docs and the refusal),
    and either ``ok`` (a predicate; False refuses with ``allowed``) or ``check`` (raises its
    own ``ConfigError``).  ``size``: a byte count that flags may write as ``4GiB``."""
    if ok is not None and check is not None:
        raise TypeError("setting(): give ok or check, not both")
    if ok is not None:
        check = _predicate(ok, allowed)
    meta = {"help": help, "allowed": allowed, "check": check}
    if size:
        meta["bytes"] = True
    return dataclasses.field(default=default, metadata=meta)


def _predicate(ok: Callable[[Any], bool], allowed: str) -> Check:
    def check(value: Any, name: str) -> None:
        if not ok(value):
            raise refuse(name, value, allowed)
    return check


def kind(f: dataclasses.Field) -> str:
    """``int``, ``float``, ``bool`` or ``str``: the field's annotation, as a name."""
    return f.type if isinstance(f.type, str) else f.type.__name__


def check_type(value: Any, name: str, k: str) -> None:
    """Refuse a value of the wrong Python type (a bool is not a number, a list not a string)."""
    if k == "bool":
        if not isinstance(value, bool):
            raise refuse(name, value, "True or False (from_mapping parses strings such as "
                                      "'true' and 'off')")
    elif k == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise refuse(name, value, "an integer" + (", not a bool" if isinstance(value, bool)
                                                      else ""))
    elif k == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise refuse(name, value, "a number" + (", not a bool" if isinstance(value, bool)
                                                    else ""))
    elif k == "str":
        if not isinstance(value, str):
            raise refuse(name, value, f"a string, not {type(value).__name__}")
    else:                                   # a new kind needs its parser and check here
        raise TypeError(f"setting {name!r}: type {k!r} is not one of int, float, bool, str")


def check_fields(obj: Any, cls: type) -> None:
    """Type and per-field checks of ``cls``'s fields on ``obj``, in field order."""
    for f in dataclasses.fields(cls):
        value = getattr(obj, f.name)
        check_type(value, f.name, kind(f))
        if f.metadata.get("check") is not None:
            f.metadata["check"](value, f.name)


def parse_bytes(value: Any, name: str = "value") -> int:
    """Parse ``4GiB``, ``512MiB``, ``1.5GiB``, ``65536`` or an int into a whole number of bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a byte size such as 4GiB, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"{name}: expected a byte size such as 65536, 64KiB, 4GiB; got {value!r}")
    n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not n.is_integer():
        raise ConfigError(f"{name}: expected a whole number of bytes, got {value!r}")
    return int(n)


def format_bytes(n: int) -> str:
    """``4294967296`` -> ``4GiB``: the largest binary unit that divides ``n`` exactly."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def parse_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}: expected true or false, got {value!r}")


def parse_value(f: dataclasses.Field, value: Any, label: str) -> Any:
    """A flag string or a JSON value -> the field's type; ``ConfigError`` naming ``label``."""
    k = kind(f)
    try:
        if f.metadata.get("bytes"):
            return parse_bytes(value, label)
        if k == "bool":
            return parse_bool(value, label)
        if isinstance(value, bool):          # JSON true for a number or a string
            raise refuse(label, value, f"{'a number' if k != 'str' else 'a string'}, not a bool")
        if k == "int":
            return int(value.strip(), 0) if isinstance(value, str) else value
        if k == "float":
            return float(value) if isinstance(value, (str, int, float)) else value
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        return value                         # the constructor refuses a list, a number ...
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise refuse(label, value, f"{'a whole number' if k == 'int' else 'a number'}") from None


def check_ip(host: Any, name: str = "host") -> str:
    """``host`` must be a unicast IP address peers can reach (a bind address for transfers);
    ``ConfigError`` naming ``name`` and the value if not."""
    import ipaddress
    try:
        ip = ipaddress.ip_address(str(host))
    except ValueError:
        ip = None
    if ip is None or ip.is_unspecified or ip.is_multicast:
        raise ConfigError(f"{name}={host!r} is not allowed: expected the IP address of the "
                          f"interface other nodes reach (e.g. 127.0.0.1 on one host, or the "
                          f"node's RDMA/TCP address; not 0.0.0.0)")
    return str(host)


_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/?#]*)@")


def redact_url(url: Any) -> str:
    """``url`` as text with any password replaced by ``***`` (``user:***@``, or ``***@``
    where the user info has no ``:``): what error texts and logs may show of a directory
    URL.  Works on URLs that do not parse, too."""
    s = str(url)
    m = _USERINFO.match(s)
    if not m:
        return s
    user, colon, _ = m.group(2).rpartition(":") if ":" in m.group(2) else ("", "", "")
    return f"{m.group(1)}{user + colon if colon else ''}***@{s[m.end():]}"


def check_directory_url(url: Any, name: str = "cluster_directory") -> str:
    """``""`` (no cluster) or ``redis://HOST:PORT[/DB]``; ``ConfigError`` naming the value."""
    from urllib.parse import urlsplit
    if url == "":
        return url
    try:
        u = urlsplit(str(url))
        db = u.path.strip("/")
        ok = (u.scheme in ("redis", "rediss") and bool(u.hostname) and u.port is not None
              and (db == "" or db.isdigit()))
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"{name}={redact_url(url)!r} is not allowed: expected redis://HOST:PORT or "
                          f"redis://HOST:PORT/DB (empty: no cluster)")
    return str(url)


@functools.lru_cache(maxsize=1)
def machine_memory_bytes() -> int | None:
    """This machine's memory: physical RAM, or the cgroup's limit when that is lower;
    ``None`` where neither can be read."""
    found = []
    try:
        found.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            found.append(int(text))
    found = [n for n in found if n > 0]
    return min(found) if found else None
