"""Write the aggregate as a checkpoint that ``hpc-train publish`` takes, streamed.

The layout is ``hpc_core.checkpoint``'s: ``model.safetensors`` (the base's tensors, names
and order, with the combined values), ``trainer_state.json`` (format, the base's model spec
inside a full training config, metrics) and the ``COMPLETE`` marker, plus ``aggregate.json``
(the report). The folder is built under a temporary name beside ``--out`` and renamed into
place last, so a failed run leaves no ``--out``; tensor bytes go to disk as they are made,
never held as a whole model.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from hpc_core.checkpoint_layout import FORMAT, MARKER
from hpc_core.config import TrainConfig
from registry.atomic import TMP_PREFIX, fsync_dir, write_json_atomic
from registry.manifest import Manifest
from registry.safetensors_io import safetensors_header

MODEL_FILE = "model.safetensors"
REPORT_FILE = "aggregate.json"


class CheckpointWriter:
    """``model.safetensors`` written tensor by tensor, in the base's blob order."""

    def __init__(self, out: Path, base: Manifest) -> None:
        self.out = Path(out)
        self.base = base
        self.tensors = sorted(base.tensors, key=lambda t: t.offset)
        self.tmp = self.out.parent / f"{TMP_PREFIX}{self.out.name}.{os.getpid()}"
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)
        self._file = open(self.tmp / MODEL_FILE, "wb")  # noqa: SIM115 - closed in finish/abort
        metadata = {"edgetrain": "hpc-train aggregate", "base": base.ref}
        self._file.write(safetensors_header(self.tensors, metadata))
        self.written = 0

    def write(self, data: bytes) -> None:
        self._file.write(data)
        self.written += len(data)

    def finish(self, report: dict[str, Any], metrics: dict[str, float]) -> Path:
        """Close the tensors, add the state, report and marker; move the folder to --out."""
        want = sum(t.nbytes for t in self.tensors)
        if self.written != want:
            raise RuntimeError(f"wrote {self.written} tensor bytes, the base has {want}")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        config = TrainConfig(model=self.base.model.model_copy())
        write_json_atomic(self.tmp / "trainer_state.json", {
            "format": FORMAT, "step": None, "epoch": None, "config": config.to_dict(),
            "metrics": metrics, "source": f"hpc-train aggregate of {self.base.ref}",
        })
        write_json_atomic(self.tmp / REPORT_FILE, report)
        (self.tmp / MARKER).write_text(FORMAT + "\n")
        fsync_dir(self.tmp)
        os.rename(self.tmp, self.out)  # refuses to replace a non-empty --out made meanwhile
        fsync_dir(self.out.parent)
        return self.out

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
