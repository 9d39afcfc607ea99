"""The two trace formats: Mooncake JSON lines and WEKA kv-cache-tester session files.

Both return a ``traces.Trace``; every malformed record raises ``TraceError``
whose message starts with ``file:line:`` (for a WEKA file, the line where the
bad request object starts, and its path in the document, e.g.
``requests[3].requests[1]``).  See ``traces`` for what conversations and
sessions are.
"""

from __future__ import annotations

import io
import json
import lzma
import tarfile
from pathlib import Path

from .traces import FORMATS, Request, Trace, TraceError


def _need(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise TraceError(f"{where}: {msg}")


def _int_field(rec: dict, name: str, where: str) -> int:
    v = rec.get(name)
    _need(isinstance(v, int) and not isinstance(v, bool) and v >= 0, where,
          f"field {name!r} must be a non-negative integer, got {v!r}")
    return v


def _num_field(rec: dict, name: str, where: str) -> float:
    v = rec.get(name)
    _need(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0, where,
          f"field {name!r} must be a non-negative number, got {v!r}")
    return float(v)


def _ids_field(rec: dict, where: str) -> tuple[int, ...]:
    v = rec.get("hash_ids")
    _need(isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
          where, f"field 'hash_ids' must be a list of integers, got {str(v)[:60]!r}")
    return tuple(v)


def _open_text(path: Path) -> io.TextIOBase:
    if path.name.endswith(".xz"):
        return io.TextIOWrapper(lzma.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def load_mooncake(path: str | Path, block_tokens: int = 512) -> Trace:
    """Mooncake JSON lines (``.jsonl`` or ``.jsonl.xz``): one request a line,
    ``timestamp`` in milliseconds, ``hash_ids`` of ``block_tokens``-token blocks."""
    path = Path(path)
    rows: list[tuple[float, int, int, tuple[int, ...], str]] = []
    try:
        with _open_text(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TraceError(f"{where}: not valid JSON ({e.msg} at column {e.colno})"
                                     f"{'; the line looks truncated' if not line.endswith(chr(10)) else ''}") from None
                _need(isinstance(rec, dict), where, "expected a JSON object per line")
                ts = _num_field(rec, "timestamp", where)
                rows.append((ts / 1000.0, _int_field(rec, "input_length", where),
                             _int_field(rec, "output_length", where), _ids_field(rec, where), where))
    except (lzma.LZMAError, EOFError) as e:
        raise TraceError(f"{path}:{len(rows) + 1}: compressed stream is truncated or corrupt "
                         f"({e}); {len(rows)} records were read before it") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}:{len(rows) + 1}: not UTF-8 text ({e.reason})") from None
    _need(len(rows) > 0, str(path), "no requests in the file")
    for i in range(1, len(rows)):
        _need(rows[i][0] >= rows[i - 1][0], rows[i][4], "timestamps go backwards")
    return _mooncake_trace(path.name, rows, block_tokens)


def _mooncake_trace(name: str, rows: list, block_tokens: int) -> Trace:
    """Link conversations: hash ids are prefix-aware, so a chain is named by its last id."""
    last_of: dict[int, int] = {}      # hash id at position k -> latest request whose prefix ends there
    info = []                          # (conv, turn, parent)
    for i, (_, _, _, ids, _) in enumerate(rows):
        parent = None
        for k in range(len(ids), 1, -1):
            j = last_of.get(ids[k - 1])
            if j is not None:
                if k >= len(rows[j][3]) - 1:
                    parent = j
                break
        if parent is None:
            info.append((None, 0, None))
        else:
            info.append((info[parent][0] if info[parent][0] is not None else parent,
                         info[parent][1] + 1, parent))
        for h in ids:
            last_of[h] = i
    roots = [i for i, (c, _, _) in enumerate(info) if c is None]
    sess_of = {r: s for s, r in enumerate(roots)}
    reqs = []
    for i, ((t, inp, out, ids, where), (c, turn, parent)) in enumerate(zip(rows, info)):
        root = i if c is None else c
        reqs.append(Request(i, sess_of[root], sess_of[root], "mc", t, inp, out, ids, turn,
                            rows[parent][2] if parent is not None else 0, parent, where))
    return Trace(name, "mooncake", block_tokens, tuple(reqs), len(roots))


# ---------------------------------------------------------------- WEKA sessions

def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _record_positions(text: str, start: int, end: int) -> list[int]:
    """Start offsets of the elements of the first ``"requests": [...]`` array in
    ``text[start:end]`` (for error messages; best effort)."""
    dec = json.JSONDecoder()
    k = text.find('"requests"', start, end)
    if k < 0:
        return []
    k = text.find("[", k, end) + 1
    out = []
    while 0 < k < end:
        while k < end and text[k] in " \t\r\n,":
            k += 1
        if k >= end or text[k] == "]":
            break
        out.append(k)
        try:
            _, k = dec.raw_decode(text, k)
        except json.JSONDecodeError:
            break
    return out


def _weka_session(name: str, text: str, sess: int, conv0: int, rid0: int,
                  block_tokens: int | None) -> tuple[list[Request], int, int]:
    """Requests of one session file; returns (requests, conversations used, block size)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{name}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno}); "
                         "the file may be truncated") from None
    _need(isinstance(doc, dict) and isinstance(doc.get("requests"), list), f"{name}:1",
          "expected a session object with a 'requests' list")
    bs = doc.get("block_size", 64)
    _need(isinstance(bs, int) and bs > 0, f"{name}:1", f"bad block_size {bs!r}")
    _need(block_tokens in (None, bs), f"{name}:1",
          f"block_size {bs} differs from the other sessions' {block_tokens}")
    scope = f"{sess}:{doc.get('id', name)}"
    flat: list[tuple[float, int, dict, str]] = []   # (t, conv, record, where)
    n_conv = [1]                                      # conversation conv0 is the main thread

    def walk(records: list, base: float, conv: int, lo: int, hi: int, path: str) -> None:
        pos = _record_positions(text, lo, hi)
        for i, rec in enumerate(records):
            p = pos[i] if i < len(pos) else lo
            where = f"{name}:{_line_of(text, p)}: {path}[{i}]"
            _need(isinstance(rec, dict), where, "expected a request object")
            t = _num_field(rec, "t", where)
            if rec.get("type") == "subagent":
                _need(isinstance(rec.get("requests"), list), where,
                      "a subagent needs a 'requests' list")
                sub = conv0 + n_conv[0]
                n_conv[0] += 1
                nxt = pos[i + 1] if i + 1 < len(pos) else hi
                walk(rec["requests"], base + t, sub, p, nxt, f"{path}[{i}].requests")
            else:
                flat.append((base + t, conv, rec, where))

    walk(doc["requests"], 0.0, conv0, 0, len(text), "requests")
    flat.sort(key=lambda x: (x[0], x[1]))
    reqs: list[Request] = []
    last: dict[int, Request] = {}
    for t, conv, rec, where in flat:
        inp, out = _int_field(rec, "in", where), _int_field(rec, "out", where)
        ids = _ids_field(rec, where)
        prev = last.get(conv)
        r = Request(rid0 + len(reqs), sess, conv, scope, t, inp, out, ids,
                    0 if prev is None else prev.turn + 1, 0 if prev is None else prev.output_tokens,
                    None if prev is None else prev.rid, where.split(": ")[0])
        reqs.append(r)
        last[conv] = r
    return reqs, n_conv[0], bs


def load_weka(path: str | Path) -> Trace:
    """WEKA session files: a folder of ``*.json``, a ``.tar.xz`` of them, or one file."""
    path = Path(path)
    members: list[tuple[str, bytes]] = []
    if path.is_dir():
        files = sorted(path.glob("*.json"))
        _need(bool(files), str(path), "no *.json session files in this folder")
        members = [(str(p), p.read_bytes()) for p in files]
    elif path.name.endswith((".tar.xz", ".txz", ".tar", ".tar.gz", ".tgz")):
        try:
            with tarfile.open(path, "r:*") as tar:
                for m in sorted((m for m in tar.getmembers()
                                 if m.isfile() and m.name.endswith(".json")), key=lambda m: m.name):
                    members.append((f"{path}:{m.name}", tar.extractfile(m).read()))
        except (tarfile.TarError, lzma.LZMAError, EOFError, OSError) as e:
            raise TraceError(f"{path}:{len(members) + 1}: archive is truncated or corrupt ({e}); "
                             f"{len(members)} session files were read before it") from None
        _need(bool(members), str(path), "no .json session files in the archive")
    else:
        members = [(str(path), path.read_bytes())]
    reqs: list[Request] = []
    conv = 0
    bt = None
    for sess, (name, raw) in enumerate(members):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TraceError(f"{name}:1: not UTF-8 text ({e.reason})") from None
        got, n_conv, bt = _weka_session(name, text, sess, conv, len(reqs), bt)
        reqs.extend(got)
        conv += n_conv
    return Trace(path.name, "weka", bt or 64, tuple(reqs), len(members))


def detect_format(path: str | Path) -> str:
    p = Path(path)
    n = p.name
    if p.is_dir() or n.endswith((".tar.xz", ".txz", ".tar", ".tar.gz", ".tgz")):
        return "weka"
    if n.endswith((".jsonl", ".jsonl.xz")):
        return "mooncake"
    if n.endswith(".json"):
        with open(p, encoding="utf-8", errors="replace") as f:
            head = f.read(4096).lstrip()
        return "weka" if head.startswith("{") and '"requests"' in head else "mooncake"
    raise TraceError(f"{path}:1: cannot tell the trace format from the name; "
                     "pass --format mooncake or --format weka")


def load_trace(path: str | Path, fmt: str = "auto", block_tokens: int | None = None) -> Trace:
    """Load a trace; ``fmt`` is one of ``FORMATS``. ``block_tokens`` overrides Mooncake's 512."""
    if fmt not in FORMATS:
        raise TraceError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{path}:0: no such file or folder")
    fmt = detect_format(p) if fmt == "auto" else fmt
    if fmt == "mooncake":
        return load_mooncake(p, block_tokens or 512)
    tr = load_weka(p)
    if block_tokens and block_tokens != tr.block_tokens:
        raise TraceError(f"{path}:1: --block-tokens {block_tokens} contradicts the sessions' "
                         f"block_size {tr.block_tokens}")
    return tr
