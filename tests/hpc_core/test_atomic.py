from __future__ import annotations

import json
import os
from pathlib import Path

from hpc_core.atomic import write_json_atomic


def test_write_json_atomic_replaces_and_leaves_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "x.json"
    write_json_atomic(target, {"a": 1})
    write_json_atomic(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert os.listdir(tmp_path) == ["x.json"]
