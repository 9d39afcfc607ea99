"""``writer_priority.lower_this_thread``: a writer thread's nice, never the main thread's."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from sglang_flatcake.sglang import writer_priority


def in_thread(fn):
    out = {}

    def run():
        out["ret"] = fn()
        out["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    return out


def test_a_writer_thread_is_lowered_once_and_the_process_is_not():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    got = in_thread(lambda: (writer_priority.lower_this_thread(15),
                             writer_priority.lower_this_thread(15)))
    assert got["ret"] == (True, True)
    assert got["nice"] == max(base, 15)
    assert os.getpriority(os.PRIO_PROCESS, 0) == base       # the main thread kept its own


def test_the_main_thread_and_nice_zero_are_left_alone():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert writer_priority.lower_this_thread(19) is False   # pytest runs tests on main
    assert os.getpriority(os.PRIO_PROCESS, 0) == base
    got = in_thread(lambda: writer_priority.lower_this_thread(0))
    assert got["ret"] is False and got["nice"] == base


def test_a_refusal_is_logged_and_the_writer_goes_on(monkeypatch, caplog):
    def refuse(*_):
        raise PermissionError(1, "Operation not permitted")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base >= 19:
        pytest.skip("this process already runs at nice 19: nothing to lower")
    monkeypatch.setattr(os, "setpriority", refuse)
    with caplog.at_level(logging.WARNING, logger="sglang_flatcake"):
        got = in_thread(lambda: (writer_priority.lower_this_thread(19),
                                 writer_priority.lower_this_thread(19)))
    assert got["ret"] == (False, False) and got["nice"] == base
    assert sum("could not lower" in r.message for r in caplog.records) == 1
