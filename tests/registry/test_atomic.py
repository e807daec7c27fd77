from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from registry.atomic import atomic_output, write_json_atomic


def test_write_json_atomic_replaces_and_leaves_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "x.json"
    write_json_atomic(target, {"a": 1})
    write_json_atomic(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert os.listdir(tmp_path) == ["x.json"]


def test_atomic_output_renames_on_success_keeping_the_suffix(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "model.onnx"  # the folder is created
    with atomic_output(target) as tmp:
        assert tmp.parent == target.parent and tmp.suffix == ".onnx" and tmp != target
        tmp.write_bytes(b"new")
        assert not target.exists()  # nothing under the final name until the writer is done
    assert target.read_bytes() == b"new"
    assert os.listdir(target.parent) == ["model.onnx"]


def test_atomic_output_keeps_the_old_file_when_the_writer_fails(tmp_path: Path) -> None:
    target = tmp_path / "model.onnx"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="writer crashed"), atomic_output(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("writer crashed")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["model.onnx"]  # the partial temp file is gone


def test_threads_writing_one_file_at_once_never_collide(tmp_path: Path) -> None:
    """The registry server's PUT handlers are threads of one process: each write needs its own
    temporary file, or one thread renames away another's half-written one."""
    from concurrent.futures import ThreadPoolExecutor

    from registry.atomic import write_bytes_atomic

    target = tmp_path / "chunk"
    payloads = [bytes([i]) * 65536 for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: write_bytes_atomic(target, payloads[i % 8]), range(200)))
    assert target.read_bytes() in payloads
    assert os.listdir(tmp_path) == ["chunk"]


def test_stale_temps_of_dead_writers_are_removed_live_ones_kept(tmp_path: Path) -> None:
    import subprocess
    import sys

    from registry.atomic import remove_stale_temps

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / "jobs" / "j1").mkdir(parents=True)
        stale = tmp_path / "jobs" / "j1" / f".tmp-{dead_pid}-0a1b2c3d-context.json"
        busy = tmp_path / "jobs" / f".tmp-{live.pid}-0a1b2c3d-x.json"
        other = tmp_path / "jobs" / ".tmp-notapid-x.json"  # not ours to judge
        kept = tmp_path / "jobs" / "j1" / "context.json"
        for p in (stale, busy, other, kept):
            p.write_text("{}")
        assert remove_stale_temps(tmp_path / "jobs") == []  # not recursive: j1 untouched
        assert remove_stale_temps(tmp_path / "jobs", recursive=True) == [stale]
        assert busy.exists() and other.exists() and kept.exists() and not stale.exists()
    finally:
        live.kill()
        live.wait()
