"""The linker's device path for ``gpu_check.py``: ``FlatCakeLinker`` over device KV buffers.

``linker_flow`` builds the linker as SGLang builds it (``Linker(server_args, params,
components=..., extra_config=..., forward_stream=...)``) over an MHA bf16 and an MLA pool,
writes three nodes of one session on the forward stream (a prompt, its reply, a second
turn: SSD and memory pages), offloads them, restores the chain into poisoned slots layer
by layer (each layer compared when the forward's wait for it returns), then flips one
SSD byte: the load must fail and the next lookup stop before that page.

On CUDA it also proves the two fences on the hardware: the forward writes the pages after
a long kernel (``offload`` must wait for it through ``record_offload_ready``), and the
scheduler's stream poisons the destination after a long kernel (the load must wait for
``start_layer_wise_loading``'s ready event).  Each is run as is and mutated (no forward
stream, no ready event): the mutated run must serve wrong KV, or the check proves nothing.

Where SGLang does not import (the GPU machine), ``--sglang-src`` names a copy of SGLang's
source files and ``standin_linker.load_linker_contract`` runs SGLang's own counter and
transfer classes from them (``README_gpu.md``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from types import SimpleNamespace
from unittest import mock

from sglang_flatcake.read import device as dv
from tests.support import standin
from tests.support.standin_linker import load_linker_contract

PAGE, LAYERS, SLOTS = 16, 8, 64 * 16
POOLS = {"mha_bf16": ("mha", 8, 128), "mla_bf16": ("mla", 1, 576)}
SPIN_CYCLES = int(4e8)             # the long kernel in front of a fenced write (~0.2 s)


def _keys(n: int, seed: str, start: str | None = None) -> list[str]:
    import hashlib
    h = bytes.fromhex(start) + seed.encode() if start else hashlib.sha256(seed.encode()).digest()
    out = []
    for i in range(n):
        h = hashlib.sha256(h + i.to_bytes(4, "little")).digest()
        out.append(h.hex())
    return out


class Rig:
    """One device pool, its request rows and one linker over them."""

    def __init__(self, torch, kind: str, heads: int, dim: int, on: str, root: str) -> None:
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
        from sglang_flatcake.sglang.linker import FlatCakeLinker
        self.torch, self.on, self.PoolName, self.PoolTransfer = torch, on, PoolName, PoolTransfer
        self.pool = standin.Pool(torch, kind, LAYERS, SLOTS, heads, dim, torch.bfloat16, on)
        self.bufs = (list(self.pool.k_buffer) + list(self.pool.v_buffer) if kind == "mha"
                     else list(self.pool.kv_buffer))
        # The request rows as SGLang's ReqToTokenPool holds them (the GPU machine has no
        # SGLang to import it from): the table on the device, every row held (no free slots)
        self.rows = torch.zeros((4, SLOTS), dtype=torch.int32, device=on)
        self.row_pool = SimpleNamespace(req_to_token=self.rows, free_slots=[])
        self.forward = torch.cuda.Stream() if on == "cuda" else None
        params = SimpleNamespace(
            token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: self.pool),
            page_size=PAGE, req_to_token_pool=self.row_pool,
            attn_tp_cache_group=None, tp_cache_group=None, pp_rank=0, pp_size=1,
            attn_cp_rank=0, attn_cp_size=1)
        args = SimpleNamespace(model_path="gpu-check", served_model_name=None, revision=None,
                               enable_metrics=False)
        cfg = {"store_dir": root, "durable": False, "memory_bytes": "64MiB",
               "ssd_bytes": "1GiB", "extent_bytes": "1MiB"}
        self.linker = FlatCakeLinker(args, params, components=(), extra_config=cfg,
                                     forward_stream=self.forward)

    def slots(self, first_page: int, pages: int):
        return self.torch.arange(first_page * PAGE, (first_page + pages) * PAGE,
                                 dtype=self.torch.int64, device=self.on)

    def kv(self, slots):
        return self.torch.stack([b[slots] for b in self.bufs])

    def write(self, first_page: int, pages: int, seed: int, late: bool = False) -> None:
        """The forward writes KV into those pages on its stream (after a long kernel: late).
        Values are made on the forward stream too, so the allocator cannot hand their memory
        to another stream while the copy still waits; nothing here waits on the host."""
        torch = self.torch
        span = slice(first_page * PAGE, (first_page + pages) * PAGE)
        ctx = torch.cuda.stream(self.forward) if self.forward is not None else contextlib.nullcontext()
        if self.forward is not None:
            self.forward.wait_stream(torch.cuda.current_stream())
        with ctx:
            vals = self.values(span, seed)
            if late:
                torch.cuda._sleep(SPIN_CYCLES)
            for b, v in zip(self.bufs, vals):
                b[span].copy_(v)

    def values(self, span, seed: int) -> list:
        """The KV ``write`` puts into ``span`` for ``seed`` (on the current stream)."""
        torch = self.torch
        g = torch.Generator(device=self.on).manual_seed(seed)
        return [torch.randn(b[span].shape, generator=g, device=self.on).to(b.dtype)
                for b in self.bufs]

    def offload(self, keys, slots, session: str) -> bool:
        t = self.PoolTransfer(self.PoolName.KV, device_indices=slots, keys=keys)
        before = self.linker.num_completed_offloads()
        assert self.linker.offload([t], session_id=session)
        deadline = time.monotonic() + 60
        while self.linker.num_completed_offloads() == before:
            if time.monotonic() > deadline:
                raise TimeoutError("offload did not complete in 60 s")
            time.sleep(0.005)
        return self.linker.pop_completed_offload()

    def lookup(self, keys) -> int:
        return len(self.linker.lookup("r", [self.PoolTransfer(self.PoolName.KV, keys=keys)]))

    def restore(self, keys, first_page: int, want, late_poison: bool = False) -> tuple[bool, int]:
        """The tree's calls: load, start, the forward's layer waits, finish; the layers that
        held the wrong KV when their wait returned."""
        torch = self.torch
        dst = self.slots(first_page, len(keys))
        span = slice(first_page * PAGE, (first_page + len(keys)) * PAGE)
        t = self.PoolTransfer(self.PoolName.KV, device_indices=dst, keys=keys)
        if not self.linker.load("r", [t]):
            return False, LAYERS
        if late_poison:                  # the last forward still writes these slots
            torch.cuda._sleep(SPIN_CYCLES)
        self.busy_at_start = late_poison and not torch.cuda.current_stream().query()
        for b in self.bufs:              # async, on the scheduler's stream
            b[span].fill_(float("nan"))
        index = self.linker.start_layer_wise_loading()
        counter = self.linker.layer_done_counter
        counter.set_consumer(index)
        wrong = 0
        parts = len(self.bufs) // LAYERS
        for layer in range(LAYERS):
            counter.wait_until(layer)
            got = torch.stack([self.bufs[p * LAYERS + layer][dst] for p in range(parts)])
            wrong += not torch.equal(got, want[[p * LAYERS + layer for p in range(parts)]])
        ok = self.linker.finish_layer_wise_loading(index)
        return ok, wrong + (not torch.equal(self.kv(dst), want))

    def close(self) -> None:
        self.linker.close()


def _session(rig: Rig) -> tuple[list[str], object, object, list]:
    """Prompt (3 pages), reply (2), second turn (2) of one session, written and offloaded."""
    prompt = _keys(3, "t")
    reply = _keys(2, "r", prompt[-1])
    turn2 = _keys(2, "u", reply[-1])
    parts = [(prompt, 1), (reply, 4), (turn2, 6)]
    row = rig.torch.cat([rig.slots(p, len(k)) for k, p in parts])
    rig.rows[1, :len(row)] = row.to(rig.torch.int32)
    offloaded = []
    for i, (keys, p) in enumerate(parts):
        rig.write(p, len(keys), 10 + i)
        offloaded.append(rig.offload(keys, rig.slots(p, len(keys)), "s"))
    if rig.forward is not None:
        rig.forward.synchronize()
    return prompt + reply + turn2, row, rig.kv(row).clone(), offloaded


def _flow(torch, name: str, on: str, workdir: str) -> dict:
    kind, heads, dim = POOLS[name]
    root = tempfile.mkdtemp(prefix="linker-", dir=workdir)
    rig = Rig(torch, kind, heads, dim, on, root)
    try:
        keys, _, want, offloaded = _session(rig)
        media = [a.medium.name for a in rig.linker.store.locate(keys)]
        found = rig.lookup(keys)
        ok, wrong = rig.restore(keys, 20, want)
        load = dict(rig.linker.stats()["load"])
        ssd = [i for i, m in enumerate(media) if m == "SSD"]
        _flip(rig.linker.store, [keys[ssd[-1]]])
        ok2, _ = rig.restore(keys, 40, want)
        after = rig.lookup(keys)
        res = {"offloaded": offloaded, "media": media, "lookup_pages": found,
               "landed": ok, "wrong_layers": wrong, "load": load,
               "after_flip": {"landed": ok2, "lookup_pages": after,
                              "damaged": len(rig.linker.loader.damaged)}}
        res["ok"] = (all(offloaded) and found == len(keys) and ok and wrong == 0
                     and load["pages_from_memory"] > 0 and load["pages_from_ssd"] > 0
                     and not ok2 and after == ssd[-1] and res["after_flip"]["damaged"] == 1)
        return res
    finally:
        rig.close()
        shutil.rmtree(root, ignore_errors=True)


def _flip(store, keys) -> None:
    """One byte of ``keys``' first SSD piece, flipped in the session file."""
    plan = store.plan(keys)
    cmd = plan.commands[int(plan.piece_cmd[0])]
    fd = os.open(cmd.path, os.O_RDWR)
    try:
        off = cmd.offset + int(plan.piece_offset[0]) + 7
        b = os.pread(fd, 1, off)
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), off)
    finally:
        os.close(fd)


def _fence(torch, which: str, mutate: bool, workdir: str) -> dict:
    """One session through a fence on CUDA: ``offload`` (the forward writes late) or
    ``load`` (the destination is poisoned late); ``mutate`` removes the fence.  The
    scheduler side runs on a stream of its own: kvikio's compatibility-mode copies are
    ordered after the legacy default stream, which would hide a missing load fence there."""
    from sglang_flatcake.sglang.linker import linker as lk
    root = tempfile.mkdtemp(prefix="fence-", dir=workdir)
    rig = Rig(torch, "mha", 8, 128, "cuda", root)
    event = lk._event
    seed = 5 + 2 * (which == "load") + mutate           # fresh KV and keys for each run
    try:
        with torch.cuda.stream(torch.cuda.Stream()):
            keys = _keys(4, f"{which}{mutate}")
            src = rig.slots(1, 4)
            rig.rows[0, :len(src)] = src.to(torch.int32)
            if which == "offload" and mutate:
                rig.linker.forward_stream = None        # no event on the forward stream
            rig.write(1, 4, seed, late=(which == "offload"))
            busy = not rig.forward.query()
            t = time.perf_counter()
            stored = rig.offload(keys, src, "f")
            offload_s = time.perf_counter() - t
            torch.cuda.synchronize()
            want = torch.stack(rig.values(slice(PAGE, 5 * PAGE), seed))
            written = torch.equal(rig.kv(src), want)  # the rig itself wrote what it meant to
            if which == "load" and mutate:
                lk._event = lambda: None                # no ready event: the loader writes at once
            t = time.perf_counter()
            ok, wrong = rig.restore(keys, 30, want, late_poison=(which == "load"))
            restore_s = time.perf_counter() - t
            torch.cuda.synchronize()
            wrong_now = not torch.equal(rig.kv(rig.slots(30, 4)), want)
        busy = busy if which == "offload" else rig.busy_at_start
        return {"stored": stored, "written_right": written, "fence_exercised": busy,
                "landed": ok, "wrong_layers": wrong, "wrong_after": wrong_now,
                "offload_s": round(offload_s, 3), "restore_s": round(restore_s, 3)}
    finally:
        lk._event = event
        rig.close()
        shutil.rmtree(root, ignore_errors=True)


def linker_flow(dev, torch, workdir, sglang_src: str | None = None) -> dict:
    """Both pools through the linker; on CUDA, both fences and their mutations."""
    if torch is None:
        return {"skipped": "torch missing (the linker's pools are torch tensors)"}
    from_source = load_linker_contract(sglang_src) if sglang_src else False
    on = "cuda" if dev.name == "cuda" else "cpu"
    with mock.patch.dict(os.environ, {dv.EMULATE_ENV: "1" if dev.name == "emulated" else "0"}):
        res: dict = {"device": dev.name, "sglang_from_source": from_source}
        for name in POOLS:
            res[name] = _flow(torch, name, on, workdir)
        ok = all(res[n]["ok"] for n in POOLS)
        if on == "cuda":
            res["fences"] = {f"{w}{'_mutated' if m else ''}": _fence(torch, w, m, workdir)
                             for w in ("offload", "load") for m in (False, True)}
            f = res["fences"]
            held = all(f[w]["landed"] and not f[w]["wrong_layers"] and not f[w]["wrong_after"]
                       for w in ("offload", "load")) and \
                all(x["written_right"] and x["fence_exercised"] for x in f.values())
            caught = all(f[w + "_mutated"]["wrong_after"] for w in ("offload", "load"))
            res["fences_hold"], res["mutations_caught"] = held, caught
            ok = ok and held and caught
        else:
            res["fences"] = {"skipped": "needs CUDA streams (the host pool has one order)"}
        res["ok"] = ok
        return res
