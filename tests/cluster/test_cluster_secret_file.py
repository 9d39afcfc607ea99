"""Issue 32, finding "secret file" and the Redis password in error texts: the cluster secret
file is opened without following links or blocking, checked on the open descriptor, and
refused (one line naming the file, never its contents) when it is not a private regular file
of this user in a private directory with at least 32 bytes of varied content."""

from __future__ import annotations

import os
import threading

import pytest

from sglang_flatcake.cluster.secret import ClusterSecret
from sglang_flatcake.config_check import check_directory_url, redact_url
from sglang_flatcake.errors import ConfigError

GOOD = os.urandom(32).hex().encode()


def secret_at(folder, data=GOOD, mode=0o600, name="cluster.secret"):
    folder.mkdir(mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    p = folder / name
    p.write_bytes(data)
    os.chmod(p, mode)
    return p


def refused(path, needle, contents=GOOD):
    with pytest.raises(ConfigError) as e:
        ClusterSecret.from_file(str(path))
    text = str(e.value)
    assert needle in text and str(path) in text and "\n" not in text, text
    assert contents.decode(errors="replace")[:12] not in text
    return text


def test_a_private_file_of_random_bytes_is_accepted(tmp_path):
    s = ClusterSecret.from_file(str(secret_at(tmp_path / "d")))
    assert s.tag("t") == ClusterSecret(GOOD).tag("t")


def test_a_symlink_is_refused(tmp_path):
    real = secret_at(tmp_path / "d")
    link = tmp_path / "d" / "link"
    link.symlink_to(real)
    refused(link, "symbolic link")


def test_a_fifo_is_refused_without_blocking(tmp_path):
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    fifo = d / "fifo"
    os.mkfifo(fifo, 0o600)
    result = []
    t = threading.Thread(target=lambda: result.append(pytest.raises(
        ConfigError, ClusterSecret.from_file, str(fifo))), daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():                       # unblock the old code's open, then fail
        with open(fifo, "wb"):
            pass
        pytest.fail("opening a FIFO secret file blocked")
    assert "not a regular file" in str(result[0].value)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_group_or_other_bits_are_refused(tmp_path, mode):
    refused(secret_at(tmp_path / "d", mode=mode), "group or others")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_file_of_another_user_is_refused(tmp_path):
    p = secret_at(tmp_path / "d")
    os.chown(p, 4321, -1)
    refused(p, "owned by uid 4321")


@pytest.mark.parametrize("dmode", [0o777, 0o1777, 0o770])
def test_a_directory_others_can_write_is_refused(tmp_path, dmode):
    p = secret_at(tmp_path / "d")
    os.chmod(tmp_path / "d", dmode)
    refused(p, "directory")


@pytest.mark.parametrize("data,needle", [
    (b"z" * 16, "holds 16 bytes"), (b"k" * 31 + b"\n", "holds 31 bytes"),
    (b"\x07" * 64, "low-entropy"), (b"ab" * 32, "low-entropy"), (b"0123" * 16, "low-entropy")])
def test_short_or_low_entropy_contents_are_refused(tmp_path, data, needle):
    refused(secret_at(tmp_path / "d", data=data), needle, contents=data)


def test_a_directory_or_a_missing_path_is_refused(tmp_path):
    (tmp_path / "d").mkdir(mode=0o700)
    refused(tmp_path / "d" / "missing", "could not be read")
    (tmp_path / "d" / "sub").mkdir(mode=0o700)
    refused(tmp_path / "d" / "sub", "not a regular file")


def test_the_redis_password_is_never_in_an_error_text():
    for url in ("redis://:hunter2@10.0.0.1:notaport/0", "http://app:hunter2@h:6379",
                "redis://app:hunter2@h:6379/db", "redis://hunter2@h:x"):
        with pytest.raises(ConfigError) as e:
            check_directory_url(url)
        assert "hunter2" not in str(e.value) and "***" in str(e.value), str(e.value)
    assert redact_url("rediss://app:hunter2@h:6380/0") == "rediss://app:***@h:6380/0"
    assert redact_url("redis://:pw@h:1") == "redis://:***@h:1"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
