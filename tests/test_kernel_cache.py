"""The C kernels' cache (lowmem/kernels/cpu.py): private, self-repairing, one compile at a time; anything
it cannot trust or build means the torch fallback and a warning, never a crash."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from lowmem import kernels
from lowmem.kernels import cpu

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")


@pytest.fixture(autouse=True)
def fresh_library(monkeypatch, tmp_path):
    """Each test finds the kernels anew, in its own cache directory; later tests too."""
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("LOWMEM_CACHE_DIR", str(tmp_path / "cache"))
    cpu.library.cache_clear()
    yield
    cpu.library.cache_clear()


def warnings_of(caplog) -> str:
    return " ".join(r.getMessage() for r in caplog.records if r.name == cpu.__name__ and r.levelno == logging.WARNING)


def built(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.so"))


def test_the_cache_directory_is_created_private_and_holds_the_kernels(tmp_path):
    lib = cpu.library()
    assert lib is not None and lib.lowmem_adam is not None
    directory = tmp_path / "cache"
    assert (directory.stat().st_mode & 0o777) == 0o700
    assert [p.parent for p in built(directory)] == [directory]  # directly in LOWMEM_CACHE_DIR
    assert kernels.backend(torch.device("cpu")) == "cpu"


def test_the_cache_directory_follows_xdg_unless_lowmem_cache_dir_is_set(monkeypatch, tmp_path):
    assert cpu.cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("LOWMEM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cpu.cache_dir() == tmp_path / "xdg" / "lowmem"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # the XDG spec: ignored
    assert cpu.cache_dir() == Path.home() / ".cache" / "lowmem"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cpu.cache_dir() == Path.home() / ".cache" / "lowmem"


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_cache_directory_others_may_write_to_is_refused(tmp_path, caplog, mode):
    directory = tmp_path / "cache"
    directory.mkdir()
    directory.chmod(mode)
    assert cpu.library() is None
    assert "writable by you alone" in warnings_of(caplog) and "LOWMEM_CACHE_DIR" in warnings_of(caplog)
    assert list(directory.iterdir()) == []  # nothing built, written or loaded there
    assert kernels.backend(torch.device("cpu")) == "torch"


def test_a_cache_directory_of_another_user_is_refused(monkeypatch, tmp_path, caplog):
    (tmp_path / "cache").mkdir(mode=0o700)
    monkeypatch.setattr(cpu.os, "geteuid", lambda: os.stat(tmp_path).st_uid + 1)  # as if it were not ours
    assert cpu.library() is None
    assert "owned by uid" in warnings_of(caplog)
    assert built(tmp_path / "cache") == []


def test_a_corrupt_cached_library_is_deleted_and_rebuilt(tmp_path, caplog):
    target = cpu.kernel_path(cpu.compiler_command())
    target.parent.mkdir(mode=0o700)
    target.write_bytes(os.urandom(4096))
    assert cpu.library() is not None
    assert target.read_bytes()[:4] == b"\x7fELF"
    assert "rebuilding" in warnings_of(caplog)


@pytest.fixture(scope="module")
def built_once(tmp_path_factory) -> Path:
    """The kernels and their record, built once and never loaded (a library loaded in this process
    must not be cut short: its pages are mapped here): tests copy them into their cache."""
    compiler = cpu.compiler_command()
    target = tmp_path_factory.mktemp("built") / cpu.kernel_path(compiler).name
    cpu._build(compiler, target)
    return target


def cached_copy(built: Path, record: bool = True) -> Path:
    """``built`` copied into this test's cache directory, with its record or without; the copy."""
    target = cpu.kernel_path(cpu.compiler_command())
    target.parent.mkdir(mode=0o700)
    shutil.copy2(built, target)
    if record:
        shutil.copy2(built.with_name(built.name + ".sha256"), target.with_name(target.name + ".sha256"))
    return target


@pytest.mark.parametrize("kept", [5_000, 50_000])
def test_a_truncated_cached_library_is_rebuilt_before_it_is_loaded(built_once, caplog, kept):
    """Loaded, a library cut short kills the process (SIGBUS, "Bus error") at the first touch of a
    page past its end: it is checked against the size and checksum written with it instead."""
    target = cached_copy(built_once)
    whole = target.read_bytes()
    assert json.loads(target.with_name(target.name + ".sha256").read_text())["bytes"] == len(whole) > kept
    target.write_bytes(whole[:kept])
    lib = cpu.library()
    assert lib is not None and target.read_bytes() == whole
    warned = warnings_of(caplog)
    assert f"{kept} bytes where {len(whole)} were written" in warned and "rebuilding" in warned
    weights, grads = torch.ones(8, dtype=torch.bfloat16), torch.full((8,), 2.0, dtype=torch.bfloat16)
    cpu.sgd([weights], [grads], [torch.zeros(8, dtype=torch.bfloat16)], None, lr=0.5, momentum=0.0, nesterov=False,
            weight_decay=0.0, grad_scale=1.0)  # fmt: skip
    assert torch.equal(weights, torch.zeros(8, dtype=torch.bfloat16))


def test_a_cached_library_without_its_record_is_rebuilt(built_once, caplog):
    """A library whose size and checksum were never written (an older lowmem's, or a build killed
    between the two): not loaded, rebuilt."""
    target = cached_copy(built_once, record=False)
    assert cpu.library() is not None
    assert "no record of its size and checksum" in warnings_of(caplog)
    assert target.with_name(target.name + ".sha256").is_file()


def test_a_cached_library_without_the_kernels_is_deleted_and_rebuilt(tmp_path, caplog):
    """A stale or foreign library that loads but lacks a function (before: AttributeError in training),
    its record written with it."""
    target = cpu.kernel_path(cpu.compiler_command())
    target.parent.mkdir(mode=0o700)
    stub = tmp_path / "stub.c"
    stub.write_text("void lowmem_nothing(void) {}\n")
    subprocess.run(["cc", "-shared", "-fPIC", str(stub), "-o", str(target)], check=True)
    data = target.read_bytes()
    record = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    target.with_name(target.name + ".sha256").write_text(json.dumps(record))
    lib = cpu.library()
    assert lib is not None and lib.lowmem_sgd is not None
    assert b"lowmem_sgd" in target.read_bytes()
    assert "undefined symbol" in warnings_of(caplog)


def test_a_cc_with_arguments_is_a_command_line(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "env cc")
    assert cpu.library() is not None
    assert len(built(tmp_path / "cache")) == 1


@pytest.mark.parametrize("compiler", ["/nonexistent", '"unbalanced'])
def test_a_missing_or_malformed_compiler_means_the_fallback(monkeypatch, caplog, compiler):
    monkeypatch.setenv("CC", compiler)
    assert cpu.library() is None
    assert "using the torch fallback" in warnings_of(caplog)
    assert kernels.backend(torch.device("cpu")) == "torch"


def test_a_hung_compile_is_abandoned(monkeypatch, tmp_path, caplog):
    fake = tmp_path / "hanging-cc"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo fake 1.0; exit 0; }\nexec sleep 30\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setattr(cpu, "COMPILE_TIMEOUT_S", 0.5)
    began = time.monotonic()
    assert cpu.library() is None
    assert time.monotonic() - began < 10
    assert "timed out" in warnings_of(caplog)
    assert built(tmp_path / "cache") == []


def test_one_process_at_a_time_builds(tmp_path):
    """While another holds the cache's lock, the kernels are neither built nor loaded."""
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    with open(directory / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        result = []
        waiting = threading.Thread(target=lambda: result.append(cpu.library()))
        waiting.start()
        time.sleep(1.0)
        assert waiting.is_alive() and built(directory) == []
        fcntl.flock(held, fcntl.LOCK_UN)
    waiting.join(timeout=60)
    assert result and result[0] is not None
